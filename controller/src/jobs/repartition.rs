//! Carrying out DynPipe's re-partitioning decision (pure, like the
//! registry): the job stays `repartitioning` through four steps.
//!
//! 1. **Drain.** Every report's reply carries a [`DrainOrder`]: stop once
//!    `after_iteration` iterations are done (the decision's iteration, or
//!    the first one no worker has reported yet when the planner answered
//!    later). Each iteration's 1F1B schedule ends with its microbatches
//!    flushed, so stopping at a boundary drains the pipeline; every
//!    pipeline stops at the same iteration.
//! 2. **Checkpoint.** Each worker of pipeline 0 writes its layers' weights
//!    (learnable params and BatchNorm statistics; SGD momentum restarts at
//!    zero: its buffers are not part of the model's layout) as group
//!    `stage` of the checkpoint model ([`checkpoint`](super::checkpoint))
//!    to the memory servers and says `TrainCheckpointed`. Under `preduce`
//!    and `adpsgd` the pipelines' replicas may differ: pipeline 0's weights
//!    are every pipeline's from here on. With every group written the
//!    controller puts the checkpoint in its catalog.
//! 3. **Stop.** Every worker of the drained generation gets its
//!    `TrainStageStop` (they have stopped or are stopping); its answer
//!    means the device is free.
//! 4. **Start.** Generation + 1 starts on the new partition from the
//!    checkpoint at `after_iteration`, by the same two-step start as a new
//!    job; each worker's ready answer carries its loaded layers'
//!    checksums, compared with the written ones in `train status`. Every
//!    worker started: `repartitioned`, the job runs, DynPipe's monitor
//!    starts over.

use distmind_common::limits::NAME_BYTES_MAX;
use distmind_common::proto::{
    CheckpointStatus, DrainOrder, GroupLocation, RepartitionDecision, TrainJobState,
};

use super::checkpoint::{checkpoint_name, combine, periodic_checkpoint_name};
use super::dynpipe::DynPipeWatch;
use super::launch::Launch;
use super::{Event, Job, JobError, JobRegistry};

/// Where a re-partitioning is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainPhase {
    /// Waiting for pipeline 0's checkpoint parts.
    Draining,
    /// The checkpoint is in the catalog; the drained workers are told to
    /// stop.
    Stopping,
    /// The next generation is starting.
    Starting,
}

/// A re-partitioning under way.
#[derive(Debug, Clone)]
pub struct Drain {
    pub after_iteration: u64,
    /// The checkpoint model's name.
    pub checkpoint: String,
    pub phase: DrainPhase,
    /// Per stage of pipeline 0: its written group and per-layer checksums.
    pub(super) parts: Vec<Option<(GroupLocation, Vec<u64>)>>,
}

/// Every part of a checkpoint, for the catalog entry.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointParts {
    pub name: String,
    /// The model the drained generation ran, and its catalog version
    /// (whose manifest the checkpoint re-cuts).
    pub base: (String, u64),
    /// The drained generation's partition.
    pub partition: Vec<u32>,
    /// One per stage, in order.
    pub groups: Vec<GroupLocation>,
    /// The generation that wrote it and the iterations it had completed.
    pub generation: u64,
    pub iteration: u64,
    /// [`combine`] over every layer's checksum, in layer order.
    pub written: u64,
    /// A periodic checkpoint (`checkpoint_every`), not a re-partitioning's.
    pub periodic: bool,
}

impl Job {
    /// The model (catalog name and version) the current generation loads.
    pub fn model_now(&self) -> (&str, u64) {
        match &self.model_now {
            Some((m, v)) => (m, *v),
            None => (&self.spec.model, self.catalog_version),
        }
    }

    /// The re-partitioning under way.
    pub fn drain(&self) -> Option<&Drain> {
        self.drain.as_ref()
    }

    /// What the reply to a report of `pipeline` says about a drain.
    pub(super) fn drain_order(&self, pipeline: u32) -> Option<DrainOrder> {
        let d = self.drain.as_ref()?;
        (self.state == TrainJobState::Repartitioning && d.phase == DrainPhase::Draining).then(
            || DrainOrder {
                after_iteration: d.after_iteration,
                generation: self.generation,
                checkpoint: (pipeline == 0).then(|| d.checkpoint.clone()),
                partition: self.partition.clone(),
            },
        )
    }

    /// Iterations every worker has completed at most, as reported.
    fn latest_reported(&self) -> u64 {
        self.stages
            .iter()
            .filter_map(|s| s.reports.back())
            .map(|r| r.report.iteration)
            .max()
            .unwrap_or(0)
    }

    /// Starts carrying out `decision` (recorded, of this generation): why
    /// not, when it cannot be.
    pub(super) fn begin_drain(
        &mut self,
        decision: &RepartitionDecision,
        now: std::time::Instant,
    ) -> Result<(), String> {
        if self.state != TrainJobState::Running {
            return Err(format!("the job is {}", self.state.name()));
        }
        if decision.new_partition == self.partition {
            return Err("the new partition is the current one".into());
        }
        // Every worker still has to hear the order in a report's reply.
        let after = decision.at_iteration.max(self.latest_reported() + 1);
        if after >= self.spec.iterations {
            return Err(format!(
                "the job ends at iteration {} before the drain at {after}",
                self.spec.iterations
            ));
        }
        let name = checkpoint_name(&self.id, self.generation + 1);
        if name.len() > NAME_BYTES_MAX {
            return Err(format!(
                "the checkpoint's model name {name:?} is longer than {NAME_BYTES_MAX} bytes"
            ));
        }
        super::check_partition(&decision.new_partition, self.spec.stages, self.layers)
            .map_err(|e| e.to_string())?;
        self.go(Event::Repartition, TrainJobState::Repartitioning, now)
            .map_err(|e| e.to_string())?;
        self.next_partition = Some(decision.new_partition.clone());
        log::info!(
            "training job {}: re-partitioning {:?} -> {:?}: every worker stops after iteration \
             {after}; pipeline 0 checkpoints to {name}",
            self.id,
            self.partition,
            decision.new_partition
        );
        self.checkpoint = Some(CheckpointStatus {
            model: name.clone(),
            catalog_version: None,
            generation: self.generation,
            after_iteration: after,
            written: None,
            loaded: Vec::new(),
        });
        self.drain = Some(Drain {
            after_iteration: after,
            checkpoint: name,
            phase: DrainPhase::Draining,
            parts: vec![None; self.spec.stages as usize],
        });
        Ok(())
    }
}

impl JobRegistry {
    /// Worker (`pipeline`, `stage`) of `generation` wrote its checkpoint
    /// part: `group` of `model` after `iteration` iterations. Returns every
    /// part once the last one came. Refuses a part the job did not ask for.
    #[allow(clippy::too_many_arguments)]
    pub fn checkpointed(
        &mut self,
        id: &str,
        generation: u64,
        pipeline: u32,
        stage: u32,
        iteration: u64,
        model: &str,
        group: GroupLocation,
        layer_checksums: Vec<u64>,
    ) -> Result<Option<CheckpointParts>, JobError> {
        if model == periodic_checkpoint_name(id) {
            let part = super::periodic::Part {
                generation,
                pipeline,
                stage,
                iteration,
                group,
                layer_checksums,
            };
            return self.get_mut(id)?.periodic_part(part);
        }
        let job = self.get_mut(id)?;
        job.check_stage(pipeline, stage)?;
        let bad = |what: String| JobError::BadReport {
            job: id.to_string(),
            pipeline,
            stage,
            what,
        };
        let ranges = distmind_common::train_spec::layer_ranges(&job.partition);
        let layers = ranges[stage as usize].len();
        let (base_model, base_version) = job.model_now();
        let base = (base_model.to_string(), base_version);
        let Some(d) = job
            .drain
            .as_mut()
            .filter(|_| job.state == TrainJobState::Repartitioning && generation == job.generation)
        else {
            return Err(bad(format!(
                "a checkpoint part of generation {generation}, but job is {} in generation {} \
                 with no drain under way",
                job.state.name(),
                job.generation
            )));
        };
        if d.phase != DrainPhase::Draining
            || pipeline != 0
            || iteration != d.after_iteration
            || model != d.checkpoint
            || group.index != stage
        {
            return Err(bad(format!(
                "a checkpoint part of pipeline {pipeline} as group {} of {model} after iteration \
                 {iteration}; the drain asks pipeline 0 for group {stage} of {} after iteration {}",
                group.index, d.checkpoint, d.after_iteration
            )));
        }
        if layer_checksums.len() != layers {
            return Err(bad(format!(
                "{} layer checksums for the stage's {layers} layers",
                layer_checksums.len()
            )));
        }
        log::info!(
            "training job {id}: stage {stage} wrote its checkpoint part of {model} ({} bytes)",
            group.bytes
        );
        d.parts[stage as usize] = Some((group, layer_checksums));
        if d.parts.iter().any(Option::is_none) {
            return Ok(None);
        }
        let sums: Vec<u64> = d
            .parts
            .iter()
            .flatten()
            .flat_map(|(_, c)| c.iter().copied())
            .collect();
        let parts = CheckpointParts {
            name: d.checkpoint.clone(),
            base,
            partition: job.partition.clone(),
            groups: d.parts.iter().flatten().map(|(g, _)| g.clone()).collect(),
            generation: job.generation,
            iteration: d.after_iteration,
            written: combine(&sums),
            periodic: false,
        };
        if let Some(c) = job.checkpoint.as_mut() {
            c.written = Some(combine(&sums));
        }
        Ok(Some(parts))
    }

    /// The checkpoint of `id` is in the catalog as `version`: the drained
    /// workers are told to stop next (false: the job moved on).
    pub fn checkpoint_put(&mut self, id: &str, version: u64) -> bool {
        let Ok(job) = self.get_mut(id) else {
            return false;
        };
        let Some(d) = job.drain.as_mut() else {
            return false;
        };
        if job.state != TrainJobState::Repartitioning || d.phase != DrainPhase::Draining {
            return false;
        }
        d.phase = DrainPhase::Stopping;
        if let Some(c) = job.checkpoint.as_mut() {
            c.catalog_version = Some(version);
        }
        for s in &mut job.stages {
            s.stopped = !s.launch.launched();
        }
        true
    }

    /// A drained worker's `TrainStageStop` was answered (or could not be):
    /// returns true when that was the last one, so the next generation
    /// starts.
    pub fn drained_worker_stopped(
        &mut self,
        id: &str,
        generation: u64,
        pipeline: u32,
        stage: u32,
    ) -> bool {
        let Ok(job) = self.get_mut(id) else {
            return false;
        };
        let Ok(i) = job.check_stage(pipeline, stage) else {
            return false;
        };
        let stopping = job
            .drain
            .as_ref()
            .is_some_and(|d| d.phase == DrainPhase::Stopping);
        if job.state != TrainJobState::Repartitioning || generation != job.generation || !stopping {
            return false;
        }
        job.stages[i].stopped = true;
        job.stages.iter().all(|s| s.stopped)
    }

    /// Every drained worker stopped: generation + 1 on the new partition,
    /// loading the checkpoint; its `TrainStage` requests go out next
    /// ([`super::start_requests`]).
    pub fn start_next_generation(&mut self, id: &str) -> Result<(), JobError> {
        let job = self.get_mut(id)?;
        let version = job.checkpoint.as_ref().and_then(|c| c.catalog_version);
        let (Some(d), Some(version)) = (job.drain.as_mut(), version) else {
            return Err(job.illegal(Event::Repartitioned));
        };
        if job.state != TrainJobState::Repartitioning || d.phase != DrainPhase::Stopping {
            return Err(job.illegal(Event::Repartitioned));
        }
        d.phase = DrainPhase::Starting;
        job.model_now = Some((d.checkpoint.clone(), version));
        job.partition = job
            .next_partition
            .take()
            .expect("repartitioning has a partition to move to");
        job.generation += 1;
        for s in &mut job.stages {
            s.launch = Launch::NotSent;
            s.stop_sent = false;
            s.stopped = false;
            s.loaded = None;
        }
        Ok(())
    }

    /// Each pipeline's loaded checksum, once all its workers are ready.
    pub(super) fn note_loaded(job: &mut Job) {
        let stages = job.spec.stages as usize;
        let loaded: Vec<Option<u64>> = job
            .stages
            .chunks(stages)
            .map(|p| {
                p.iter()
                    .map(|s| s.loaded.clone())
                    .collect::<Option<Vec<Vec<u64>>>>()
                    .map(|v| combine(&v.concat()))
            })
            .collect();
        if let Some(c) = job.checkpoint.as_mut() {
            if c.generation + 1 == job.generation {
                c.loaded = loaded;
            }
        }
    }

    /// Every worker of the new generation started: the job runs again and
    /// DynPipe's monitor starts over from the drained iteration.
    pub(super) fn repartitioned(job: &mut Job, now: std::time::Instant) -> Result<(), JobError> {
        let after = job.drain.take().map_or(0, |d| d.after_iteration);
        job.go(Event::Repartitioned, TrainJobState::Running, now)?;
        if job.spec.dynamic.enabled {
            job.dynpipe = DynPipeWatch::new(&job.spec, after).ok();
        }
        let c = job.checkpoint.as_ref();
        log::info!(
            "training job {}: re-partitioned: generation {} on {:?} from iteration {after}; \
             params written {:x?}, loaded {:x?}",
            job.id,
            job.generation,
            job.partition,
            c.and_then(|c| c.written),
            c.map(|c| &c.loaded)
        );
        Ok(())
    }
}
