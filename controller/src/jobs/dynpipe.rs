//! DynPipe's decision in the controller: a job's stage times, from its
//! workers' reports, go to a [`StragglerMonitor`]; when the monitor
//! schedules a re-partition, [`plan_repartition`] chooses the new partition
//! with the re-partitioner ([`repartition`]) and the job records the
//! decision, which `train status` shows, and carries it out (drain,
//! checkpoint to the memory servers, reload on the new partition:
//! [`super::repartition`]).
//!
//! * **Stage times.** One time per stage per iteration: the slowest of the
//!   stage's replicas (the partition is one for every pipeline, and the
//!   slowest replica paces a stage's averaging). An iteration is fed once
//!   every worker reported it, in order; at most [`OPEN_ITERATIONS_MAX`]
//!   are held, and past that the oldest is fed with what it has (a stage no
//!   replica reported keeps its last time; without one the iteration is
//!   skipped).
//! * **Layer costs.** The re-partitioner wants each layer's solo time: a
//!   stage's baseline time per microbatch (its frozen baseline window over
//!   the window's iterations and the job's microbatches) is spread over its
//!   layers in proportion to their forward FLOPs, counted from the model's
//!   manifest ([`distmind_models::flops`]), evenly when they cannot be
//!   counted; each layer's share is split into forward and backward as 1 :
//!   [`BACKWARD_PER_FORWARD`]. Communication is not measured, so it is 0.
//! * **Slowdowns.** The monitor's measured ratio per stage (its last window
//!   over its baseline), capped to [`RATIO_MAX`] either way.
//!
//! The planner can simulate up to `COMBINATIONS_MAX` candidates, so it runs
//! off the controller's lock (the driver runs it on a blocking thread):
//! the registry hands out a [`RepartitionInput`] value and takes the
//! decision back.

use std::collections::BTreeMap;
use std::sync::Arc;

use distmind_common::proto::{ModelEntry, RepartitionDecision};
use distmind_common::train_spec::{JobSpec, SpecError};
use distmind_models::flops::manifest_flops;
use distmind_models::Manifest;
use serde::Deserialize;

use crate::training::{
    repartition, LayerCost, MeasuredRatio, MonitorConfig, RepartitionOptions, StragglerMonitor,
};

/// Iterations held while some worker has not reported them.
pub const OPEN_ITERATIONS_MAX: usize = 64;
/// The largest slowdown (and smallest, inverted) a ratio is capped to.
pub const RATIO_MAX: f64 = 1000.0;
/// A layer's backward time over its forward time (the common rule of
/// thumb: the backward computes two products per forward one).
pub const BACKWARD_PER_FORWARD: f64 = 2.0;

/// What the monitor decided, in the job's iterations.
#[derive(Debug, Clone, PartialEq)]
pub struct Trigger {
    /// Iterations completed when it decided.
    pub decided_at_iteration: u64,
    /// `decided_at_iteration + dynamic.delay`.
    pub at_iteration: u64,
    /// Each stage's last window over its baseline, capped.
    pub ratios: Vec<f64>,
    pub stragglers: Vec<u32>,
    /// Each stage's baseline time per iteration, seconds.
    pub baseline_s: Vec<f64>,
}

/// One job's straggler monitor and the iterations it assembles.
#[derive(Debug, Clone)]
pub struct DynPipeWatch {
    monitor: StragglerMonitor,
    pipelines: u32,
    stages: u32,
    delay: u64,
    /// The next iteration (iterations completed) to feed.
    next: u64,
    /// Iteration -> each worker's time (pipeline-major), as reported.
    open: BTreeMap<u64, Vec<Option<f64>>>,
    /// Each stage's last time fed.
    last: Vec<Option<f64>>,
}

impl DynPipeWatch {
    /// The watch of a job with `spec` (whose `dynamic` is enabled) whose
    /// workers start after `start_iteration` completed iterations. Refuses
    /// monitor settings the monitor cannot take, naming the field.
    pub fn new(spec: &JobSpec, start_iteration: u64) -> Result<DynPipeWatch, SpecError> {
        let d = &spec.dynamic;
        let cfg = MonitorConfig {
            window: u64::from(d.window),
            baseline_at: d.baseline_at,
            delay: d.delay,
            slow_ratio: d.threshold_up,
            fast_ratio: d.threshold_down,
        };
        if d.window == 0 || !d.baseline_at.is_multiple_of(u64::from(d.window)) {
            return Err(SpecError::Invalid {
                field: "dynamic.baseline_at".into(),
                value: d.baseline_at.to_string(),
                rule: format!(
                    "must be a multiple of dynamic.window = {}: the baseline is the window that ends there",
                    d.window
                ),
            });
        }
        let monitor =
            StragglerMonitor::new(spec.stages as usize, cfg).map_err(|e| SpecError::Invalid {
                field: "dynamic".into(),
                value: format!("{d:?}"),
                rule: e.to_string(),
            })?;
        Ok(DynPipeWatch {
            monitor,
            pipelines: spec.pipelines,
            stages: spec.stages,
            delay: d.delay,
            next: start_iteration + 1,
            open: BTreeMap::new(),
            last: vec![None; spec.stages as usize],
        })
    }

    /// Iterations held, waiting for reports.
    pub fn open_iterations(&self) -> usize {
        self.open.len()
    }

    /// One report: worker (`pipeline`, `stage`) completed `iteration` in
    /// `fwd_bwd_s`. Returns the re-partition the monitor scheduled, if
    /// feeding it did (at most one until the monitor starts over).
    pub fn observe(
        &mut self,
        pipeline: u32,
        stage: u32,
        iteration: u64,
        fwd_bwd_s: f64,
    ) -> Option<Trigger> {
        if iteration < self.next || pipeline >= self.pipelines || stage >= self.stages {
            return None;
        }
        let workers = (self.pipelines * self.stages) as usize;
        let times = self
            .open
            .entry(iteration)
            .or_insert_with(|| vec![None; workers]);
        times[(pipeline * self.stages + stage) as usize] = Some(fwd_bwd_s);
        let mut out = None;
        while let Some((&it, times)) = self.open.first_key_value() {
            let complete = it == self.next && times.iter().all(Option::is_some);
            if !complete && self.open.len() <= OPEN_ITERATIONS_MAX {
                break;
            }
            let (it, times) = self.open.pop_first().expect("looked at above");
            self.next = it + 1;
            if let Some(stage_times) = self.fold(&times) {
                out = out.or(self.feed(it, &stage_times));
            } else {
                log::debug!("DynPipe: iteration {it} skipped: a stage has no time yet");
            }
        }
        out
    }

    /// Each stage's time: the slowest replica that reported, else its last.
    fn fold(&mut self, times: &[Option<f64>]) -> Option<Vec<f64>> {
        let s = self.stages as usize;
        let mut out = Vec::with_capacity(s);
        for stage in 0..s {
            let now = (0..self.pipelines as usize)
                .filter_map(|p| times[p * s + stage])
                .reduce(f64::max)
                .or(self.last[stage])?;
            out.push(now);
        }
        for (l, &t) in self.last.iter_mut().zip(&out) {
            *l = Some(t);
        }
        Some(out)
    }

    fn feed(&mut self, iteration: u64, stage_times: &[f64]) -> Option<Trigger> {
        match self.monitor.observe(stage_times) {
            Ok(Some(s)) => {
                let window = self.monitor.config().window as f64;
                let baseline_s = self
                    .monitor
                    .baseline()
                    .map(|b| b.iter().map(|t| t / window).collect())
                    .unwrap_or_default();
                Some(Trigger {
                    decided_at_iteration: iteration,
                    at_iteration: iteration + self.delay,
                    ratios: s.ratios.iter().map(|&r| cap_ratio(r)).collect(),
                    stragglers: s.stragglers.iter().map(|&x| x as u32).collect(),
                    baseline_s,
                })
            }
            Ok(None) => None,
            Err(e) => {
                log::warn!("DynPipe: iteration {iteration}: {e}");
                None
            }
        }
    }
}

/// A ratio the re-partitioner can take: finite, in
/// [1 / [`RATIO_MAX`], [`RATIO_MAX`]].
fn cap_ratio(r: f64) -> f64 {
    if r.is_nan() {
        1.0
    } else {
        r.clamp(1.0 / RATIO_MAX, RATIO_MAX)
    }
}

/// Everything [`plan_repartition`] needs, as a value (it runs off the lock).
#[derive(Debug, Clone)]
pub struct RepartitionInput {
    pub job: String,
    pub generation: u64,
    pub trigger: Trigger,
    pub microbatches: u32,
    /// Layers per stage now.
    pub partition: Vec<u32>,
    /// The job's model as the catalog holds it (its manifest gives the
    /// FLOPs); `None` when the catalog has another version now.
    pub model: Option<Arc<ModelEntry>>,
}

/// Each layer's solo cost: stage `s`'s time per microbatch `stage_s[s]`
/// spread over its layers (`partition`) in proportion to `flops` (evenly
/// without them, or where a stage's layers count none), forward and
/// backward as 1 : [`BACKWARD_PER_FORWARD`].
pub fn layer_costs(stage_s: &[f64], partition: &[u32], flops: Option<&[u64]>) -> Vec<LayerCost> {
    let mut out = Vec::with_capacity(partition.iter().map(|&n| n as usize).sum());
    let mut first = 0usize;
    for (&t, &n) in stage_s.iter().zip(partition) {
        let n = n as usize;
        let weights: Vec<f64> = match flops {
            Some(f) => f[first..first + n].iter().map(|&x| x as f64).collect(),
            None => vec![1.0; n],
        };
        let total: f64 = weights.iter().sum();
        for w in weights {
            let share = if total > 0.0 {
                t * w / total
            } else {
                t / n as f64
            };
            let forward = share / (1.0 + BACKWARD_PER_FORWARD);
            out.push(LayerCost::new(forward, share - forward));
        }
        first += n;
    }
    out
}

/// Each layer's forward FLOPs from the model's manifest, or why not.
fn model_flops(model: Option<&ModelEntry>, layers: usize) -> Result<Vec<u64>, String> {
    let entry = model.ok_or("the catalog holds another version of the model now")?;
    let manifest = Manifest::deserialize(&entry.manifest)
        .map_err(|e| format!("its manifest does not parse: {e}"))?;
    let flops = manifest_flops(&manifest)?;
    if flops.len() != layers {
        return Err(format!(
            "the manifest has {} layers, the job's partition {layers}",
            flops.len()
        ));
    }
    Ok(flops.iter().map(|f| f.total()).collect())
}

/// DynPipe's decision for a triggered re-partition: the layer costs as the
/// module says, the measured slowdowns, the re-partitioner's choice and
/// its predicted time per microbatch against the current partition's.
pub fn plan_repartition(input: &RepartitionInput) -> Result<RepartitionDecision, String> {
    let t = &input.trigger;
    let stages = input.partition.len();
    if t.baseline_s.len() != stages || t.ratios.len() != stages {
        return Err(format!(
            "the monitor measured {} stages, the partition has {stages}",
            t.baseline_s.len()
        ));
    }
    let layers: usize = input.partition.iter().map(|&n| n as usize).sum();
    let (flops, layer_costs_note) = match model_flops(input.model.as_deref(), layers) {
        Ok(f) => (Some(f), "flops".to_string()),
        Err(why) => {
            log::warn!(
                "DynPipe: job {}: layer costs spread evenly over each stage's layers: {why}",
                input.job
            );
            (None, format!("layers: {why}"))
        }
    };
    let per_microbatch: Vec<f64> = t
        .baseline_s
        .iter()
        .map(|s| s / f64::from(input.microbatches.max(1)))
        .collect();
    let costs = layer_costs(&per_microbatch, &input.partition, flops.as_deref());
    let current: Vec<usize> = input.partition.iter().map(|&n| n as usize).collect();
    let predictor = MeasuredRatio::new(t.ratios.clone()).map_err(|e| e.to_string())?;
    let plan = repartition(&costs, &current, &predictor, &RepartitionOptions::default())
        .map_err(|e| format!("re-partitioning: {e}"))?;
    Ok(RepartitionDecision {
        generation: input.generation,
        decided_at_iteration: t.decided_at_iteration,
        at_iteration: t.at_iteration,
        ratios: t.ratios.clone(),
        stragglers: t.stragglers.clone(),
        old_partition: input.partition.clone(),
        new_partition: plan.partition.iter().map(|&n| n as u32).collect(),
        predicted_s_per_microbatch: plan.time_per_microbatch_s,
        current_s_per_microbatch: plan.current_time_per_microbatch_s,
        layer_costs: crate::jobs::cut(&layer_costs_note, LAYER_COSTS_NOTE_BYTES_MAX),
    })
}

/// Longest `layer_costs` note kept in a decision.
pub const LAYER_COSTS_NOTE_BYTES_MAX: usize = 256;

#[cfg(test)]
#[path = "dynpipe_tests.rs"]
mod tests;
