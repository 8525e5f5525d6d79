//! The rules of a spec ([`JobSpec::validate`]) and its partition against a
//! model ([`JobSpec::partition_for`]).

use std::fmt;
use std::ops::Range;

use super::{
    JobSpec, Optimizer, SpecError, SyncMode, BATCH_MAX, DYNAMIC_WINDOW_MAX, HETERO_S_MAX,
    ITERATIONS_MAX, JOB_NAME_BYTES_MAX, LAYERS_MAX, LR_MAX, MICROBATCHES_MAX, PIPELINES_MAX,
    PREDUCE_WAIT_MS_MAX, PUSH_EVERY_MAX, SLOWDOWNS_MAX, SLOWDOWN_FACTOR_MAX, SSP_BOUND_MAX,
    STAGES_MAX, STAGE_WORKERS_MAX,
};
use crate::limits::NAME_BYTES_MAX;

fn invalid(
    field: impl Into<String>,
    value: impl fmt::Display,
    rule: impl Into<String>,
) -> SpecError {
    SpecError::Invalid {
        field: field.into(),
        value: value.to_string(),
        rule: rule.into(),
    }
}

/// Checks `lo <= v <= hi` for a finite float.
fn check_f64(field: &str, v: f64, lo: f64, hi: f64, what: &str) -> Result<(), SpecError> {
    if v.is_finite() && v >= lo && v <= hi {
        Ok(())
    } else {
        Err(invalid(field, v, what))
    }
}

impl JobSpec {
    /// Checks every rule that needs no catalog; the first broken one is the
    /// error. The rules are listed in `settings/README.md`.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.check_name()?;
        if self.model.is_empty() || self.model.len() > NAME_BYTES_MAX {
            return Err(invalid(
                "model",
                format!("{:?}", self.model),
                format!("a model name is 1..={NAME_BYTES_MAX} bytes"),
            ));
        }
        self.check_optimizer()?;
        self.check_shape()?;
        self.check_sync()?;
        self.check_dynamic()?;
        if self.iterations == 0 || self.iterations > ITERATIONS_MAX {
            return Err(invalid(
                "iterations",
                self.iterations,
                format!("must be 1..={ITERATIONS_MAX}"),
            ));
        }
        self.check_interference()?;
        if let Some(c) = self.checkpoint_every {
            if c == 0 || c > self.iterations {
                return Err(invalid(
                    "checkpoint_every",
                    c,
                    format!(
                        "must be 1..=iterations ({}); leave it out for no checkpoints",
                        self.iterations
                    ),
                ));
            }
        }
        Ok(())
    }

    fn check_name(&self) -> Result<(), SpecError> {
        let n = &self.name;
        let ok = !n.is_empty()
            && n.len() <= JOB_NAME_BYTES_MAX
            && n.as_bytes()[0].is_ascii_alphanumeric()
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
        if ok {
            Ok(())
        } else {
            Err(invalid(
                "name",
                format!("{n:?}"),
                format!(
                    "a job name is 1..={JOB_NAME_BYTES_MAX} bytes of letters, digits, '.', '_' and '-', \
                     starting with a letter or digit"
                ),
            ))
        }
    }

    fn check_optimizer(&self) -> Result<(), SpecError> {
        match &self.optimizer {
            Optimizer::Sgd(s) => {
                check_lr("optimizer.sgd.lr", s.lr)?;
                check_fraction("optimizer.sgd.momentum", s.momentum)?;
                check_f64(
                    "optimizer.sgd.weight_decay",
                    s.weight_decay,
                    0.0,
                    1.0,
                    "must be in [0, 1]",
                )
            }
            Optimizer::Adam(a) => {
                check_lr("optimizer.adam.lr", a.lr)?;
                check_fraction("optimizer.adam.beta1", a.beta1)?;
                check_fraction("optimizer.adam.beta2", a.beta2)?;
                if !(a.eps.is_finite() && a.eps > 0.0 && a.eps <= 1.0) {
                    return Err(invalid("optimizer.adam.eps", a.eps, "must be in (0, 1]"));
                }
                check_f64(
                    "optimizer.adam.weight_decay",
                    a.weight_decay,
                    0.0,
                    1.0,
                    "must be in [0, 1]",
                )
            }
        }
    }

    fn check_shape(&self) -> Result<(), SpecError> {
        let (p, s) = (self.pipelines, self.stages);
        if p == 0 || p > PIPELINES_MAX {
            return Err(invalid(
                "pipelines",
                p,
                format!("must be 1..={PIPELINES_MAX}"),
            ));
        }
        if s == 0 || s > STAGES_MAX {
            return Err(invalid("stages", s, format!("must be 1..={STAGES_MAX}")));
        }
        if p * s > STAGE_WORKERS_MAX {
            return Err(invalid(
                "pipelines x stages",
                format!("{p} x {s} = {}", p * s),
                format!(
                    "a job has at most {STAGE_WORKERS_MAX} stage workers (one GPU each); \
                     lower pipelines or stages"
                ),
            ));
        }
        if self.batch == 0 || self.batch > BATCH_MAX {
            return Err(invalid(
                "batch",
                self.batch,
                format!("must be 1..={BATCH_MAX}"),
            ));
        }
        let m = self.microbatches;
        if m == 0 || m > MICROBATCHES_MAX {
            return Err(invalid(
                "microbatches",
                m,
                format!("must be 1..={MICROBATCHES_MAX}"),
            ));
        }
        if !self.batch.is_multiple_of(m) {
            return Err(invalid(
                "microbatches",
                m,
                format!(
                    "batch {} is not divisible into {m} equal microbatches",
                    self.batch
                ),
            ));
        }
        if m < s {
            return Err(invalid(
                "microbatches",
                m,
                format!(
                    "1F1B keeps one microbatch in flight per stage: with fewer microbatches than \
                     stages ({s}) the pipeline never fills; use microbatches >= stages"
                ),
            ));
        }
        if let Some(part) = &self.partition {
            if part.len() != s as usize {
                return Err(invalid(
                    "partition",
                    format!("{part:?}"),
                    format!(
                        "needs one entry per stage: {} entries for stages = {s}",
                        part.len()
                    ),
                ));
            }
            for (i, &n) in part.iter().enumerate() {
                if n == 0 || n > LAYERS_MAX {
                    return Err(invalid(
                        format!("partition[{i}]"),
                        n,
                        format!("every stage holds 1..={LAYERS_MAX} layers"),
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_sync(&self) -> Result<(), SpecError> {
        let needs_replicas = |mode: &str| {
            if self.pipelines < 2 {
                Err(invalid(
                    format!("sync.{mode}"),
                    format!("pipelines = {}", self.pipelines),
                    format!(
                        "{mode} synchronizes replicas: it needs pipelines >= 2 (or use allreduce)"
                    ),
                ))
            } else {
                Ok(())
            }
        };
        match &self.sync {
            SyncMode::Allreduce(_) => Ok(()),
            SyncMode::Preduce(p) => {
                needs_replicas("preduce")?;
                if let Some(w) = p.wait_ms_initial {
                    if w > PREDUCE_WAIT_MS_MAX {
                        return Err(invalid(
                            "sync.preduce.wait_ms_initial",
                            w,
                            format!("must be 0..={PREDUCE_WAIT_MS_MAX}"),
                        ));
                    }
                }
                if let Some(b) = p.ssp_bound {
                    if b > SSP_BOUND_MAX {
                        return Err(invalid(
                            "sync.preduce.ssp_bound",
                            b,
                            format!("must be 0..={SSP_BOUND_MAX}; leave it out for no bound"),
                        ));
                    }
                }
                Ok(())
            }
            SyncMode::Adpsgd(_) => needs_replicas("adpsgd"),
            SyncMode::Hetpipe(h) => {
                if h.push_every == 0 || h.push_every > PUSH_EVERY_MAX {
                    return Err(invalid(
                        "sync.hetpipe.push_every",
                        h.push_every,
                        format!("must be 1..={PUSH_EVERY_MAX}"),
                    ));
                }
                Ok(())
            }
        }
    }

    fn check_dynamic(&self) -> Result<(), SpecError> {
        let d = &self.dynamic;
        if d.window == 0 || d.window > DYNAMIC_WINDOW_MAX {
            return Err(invalid(
                "dynamic.window",
                d.window,
                format!("must be 1..={DYNAMIC_WINDOW_MAX}"),
            ));
        }
        if d.baseline_at < u64::from(d.window) || d.baseline_at > ITERATIONS_MAX {
            return Err(invalid(
                "dynamic.baseline_at",
                d.baseline_at,
                format!(
                    "the baseline is the window ending there: must be window ({})..={ITERATIONS_MAX}",
                    d.window
                ),
            ));
        }
        if !(d.threshold_up.is_finite() && d.threshold_up > 1.0) {
            return Err(invalid(
                "dynamic.threshold_up",
                d.threshold_up,
                "must be a finite number above 1",
            ));
        }
        if !(d.threshold_down.is_finite() && d.threshold_down > 0.0 && d.threshold_down < 1.0) {
            return Err(invalid(
                "dynamic.threshold_down",
                d.threshold_down,
                "must be in (0, 1)",
            ));
        }
        if d.delay > ITERATIONS_MAX {
            return Err(invalid(
                "dynamic.delay",
                d.delay,
                format!("must be 0..={ITERATIONS_MAX}"),
            ));
        }
        if d.enabled && self.stages < 2 {
            return Err(invalid(
                "dynamic.enabled",
                "true",
                "re-partitioning moves layers between stages: it needs stages >= 2",
            ));
        }
        Ok(())
    }

    fn check_interference(&self) -> Result<(), SpecError> {
        let i = &self.interference;
        check_f64(
            "interference.hetero_s",
            i.hetero_s,
            0.0,
            HETERO_S_MAX,
            &format!("must be 0..={HETERO_S_MAX} seconds"),
        )?;
        check_f64(
            "interference.hetero_p",
            i.hetero_p,
            0.0,
            1.0,
            "must be in [0, 1]",
        )?;
        if i.slowdowns.len() > SLOWDOWNS_MAX {
            return Err(invalid(
                "interference.slowdowns",
                format!("{} entries", i.slowdowns.len()),
                format!("at most {SLOWDOWNS_MAX}"),
            ));
        }
        for (k, s) in i.slowdowns.iter().enumerate() {
            let f = |name: &str| format!("interference.slowdowns[{k}].{name}");
            if let Some(p) = s.pipeline {
                if p >= self.pipelines {
                    return Err(invalid(
                        f("pipeline"),
                        p,
                        format!("pipelines are 0..{}", self.pipelines),
                    ));
                }
            }
            if s.stage >= self.stages {
                return Err(invalid(
                    f("stage"),
                    s.stage,
                    format!("stages are 0..{}", self.stages),
                ));
            }
            if !(s.factor.is_finite() && s.factor > 0.0 && s.factor <= SLOWDOWN_FACTOR_MAX) {
                return Err(invalid(
                    f("factor"),
                    s.factor,
                    format!("must be in (0, {SLOWDOWN_FACTOR_MAX}]"),
                ));
            }
            if s.at_iteration >= self.iterations {
                return Err(invalid(
                    f("at_iteration"),
                    s.at_iteration,
                    format!(
                        "the job runs iterations 0..{}: the slowdown would never start",
                        self.iterations
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The partition in effect for a model of `layers` layers: the spec's,
    /// checked to sum to `layers`, or layers spread evenly (the first
    /// `layers % stages` stages hold one more). Call after
    /// [`validate`](Self::validate).
    pub fn partition_for(&self, layers: u32) -> Result<Vec<u32>, SpecError> {
        let s = self.stages;
        if layers < s {
            return Err(invalid(
                "stages",
                s,
                format!(
                    "model {:?} has {layers} layers: at most {layers} stages, one layer each at least",
                    self.model
                ),
            ));
        }
        match &self.partition {
            Some(part) => {
                check_partition(part, s, layers).map_err(|e| match e {
                    SpecError::Invalid { field, value, rule } => SpecError::Invalid {
                        field,
                        value,
                        rule: format!("{rule} (model {:?})", self.model),
                    },
                    other => other,
                })?;
                Ok(part.clone())
            }
            None => Ok(balanced_partition(layers, s)),
        }
    }
}

/// Checks `0 <= v < 1` (momentum, Adam's betas).
fn check_fraction(field: &str, v: f64) -> Result<(), SpecError> {
    if (0.0..1.0).contains(&v) {
        Ok(())
    } else {
        Err(invalid(field, v, "must be in [0, 1)"))
    }
}

fn check_lr(field: &str, lr: f64) -> Result<(), SpecError> {
    if lr.is_finite() && lr > 0.0 && lr <= LR_MAX {
        Ok(())
    } else {
        Err(invalid(field, lr, format!("must be in (0, {LR_MAX}]")))
    }
}

/// Checks a partition (from a spec or a re-partitioning planner): one entry
/// per stage, each at least 1, summing to `layers`.
pub fn check_partition(part: &[u32], stages: u32, layers: u32) -> Result<(), SpecError> {
    if part.len() != stages as usize {
        return Err(invalid(
            "partition",
            format!("{part:?}"),
            format!(
                "needs one entry per stage: {} entries for stages = {stages}",
                part.len()
            ),
        ));
    }
    if let Some(i) = part.iter().position(|&n| n == 0) {
        return Err(invalid(
            format!("partition[{i}]"),
            0,
            "every stage holds at least one layer",
        ));
    }
    let sum: u64 = part.iter().map(|&n| u64::from(n)).sum();
    if sum != u64::from(layers) {
        return Err(invalid(
            "partition",
            format!("{part:?} (sum {sum})"),
            format!("must sum to the model's {layers} layers"),
        ));
    }
    Ok(())
}

/// `layers` spread over `stages` (> 0, <= layers): the first
/// `layers % stages` stages hold one layer more.
pub fn balanced_partition(layers: u32, stages: u32) -> Vec<u32> {
    assert!(
        stages > 0 && stages <= layers,
        "{stages} stages over {layers} layers"
    );
    let (q, r) = (layers / stages, layers % stages);
    (0..stages).map(|i| q + u32::from(i < r)).collect()
}

/// The layer range of every stage of `partition`, in order.
pub fn layer_ranges(partition: &[u32]) -> Vec<Range<u32>> {
    let mut at = 0;
    partition
        .iter()
        .map(|&n| {
            let r = at..at + n;
            at += n;
            r
        })
        .collect()
}
