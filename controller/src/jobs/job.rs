//! One job as the registry keeps it: its spec, state, placement and the
//! reports of its stage workers, and its status as `train status` shows it.

use std::collections::VecDeque;
use std::time::Instant;

use distmind_common::proto::{
    CheckpointStatus, DrainOrder, LastCheckpoint, LayerRange, Location, RepartitionDecision,
    StagePlacement, StageStatus, TrainJobState, TrainJobStatus,
};
use distmind_common::train_spec::{layer_ranges, JobSpec};

use super::dynpipe::{DynPipeWatch, Trigger};
use super::launch::Launch;
use super::{allowed, Event, JobError};

/// One report of a stage worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageReport {
    pub pipeline: u32,
    pub stage: u32,
    /// Iterations completed.
    pub iteration: u64,
    pub fwd_bwd_s: f64,
    pub loss: Option<f64>,
    pub samples: u64,
}

/// A report as kept, with when it arrived.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Received {
    pub at: Instant,
    pub report: StageReport,
}

/// What a report changed, for the reply to the worker.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportOutcome {
    pub state: TrainJobState,
    /// The worker stops now.
    pub stop: bool,
    /// DynPipe's monitor scheduled a re-partition with this report: plan it
    /// ([`super::plan_repartition`]) and record the decision.
    pub repartition: Option<Trigger>,
    /// The job is draining for a re-partitioning: what the worker does.
    pub drain: Option<DrainOrder>,
}

#[derive(Debug, Default)]
pub(super) struct StageProgress {
    /// The last [`super::REPORTS_PER_STAGE_MAX`] reports, oldest first.
    pub(super) reports: VecDeque<Received>,
    pub(super) total: u64,
    /// Told to stop (or never started) during a stop.
    pub(super) stopped: bool,
    /// Where its start on its GPU server is.
    pub(super) launch: Launch,
    /// Its `TrainStageStop` went out.
    pub(super) stop_sent: bool,
    /// Its loaded layers' checksums, as its ready answer gave them.
    pub(super) loaded: Option<Vec<u64>>,
}

/// One job as the registry keeps it.
#[derive(Debug)]
pub struct Job {
    pub(super) id: String,
    pub(super) spec: JobSpec,
    pub(super) layers: u32,
    pub(super) catalog_version: u64,
    pub(super) state: TrainJobState,
    pub(super) waiting: Option<String>,
    pub(super) submitted: Instant,
    pub(super) state_since: Instant,
    pub(super) partition: Vec<u32>,
    pub(super) next_partition: Option<Vec<u32>>,
    pub(super) generation: u64,
    /// Pipeline-major; empty until placed.
    pub(super) placement: Vec<StagePlacement>,
    pub(super) stages: Vec<StageProgress>,
    /// DynPipe's monitor (`dynamic.enabled`).
    pub(super) dynpipe: Option<DynPipeWatch>,
    /// DynPipe's last decision.
    pub(super) repartition: Option<RepartitionDecision>,
    /// The re-partitioning under way.
    pub(super) drain: Option<super::repartition::Drain>,
    /// The last re-partitioning's checkpoint.
    pub(super) checkpoint: Option<CheckpointStatus>,
    /// The checkpoint the current generation loads (`None`: the job's
    /// model as submitted).
    pub(super) model_now: Option<(String, u64)>,
    /// The periodic checkpoint being written (`checkpoint_every`).
    pub(super) periodic: Option<super::periodic::Periodic>,
    /// The last complete checkpoint in the catalog (periodic or a
    /// re-partitioning's).
    pub(super) last_checkpoint: Option<LastCheckpoint>,
    /// Extents of checkpoint parts that will never be in the catalog (see
    /// [`Job::abandon`]), until the controller takes them to free.
    pub(super) abandoned: Vec<OwnedExtent>,
}

/// An extent of an abandoned checkpoint part: where it is, and the owner it
/// was allocated for on its memory server (the checkpoint's name), which
/// the free names so that it never frees what another owner holds there now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedExtent {
    pub owner: String,
    pub at: Location,
}

impl Job {
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    pub fn state(&self) -> &TrainJobState {
        &self.state
    }

    /// Layers per stage now.
    pub fn partition(&self) -> &[u32] {
        &self.partition
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The model's layer count and catalog version the job runs.
    pub fn model(&self) -> (u32, u64) {
        (self.layers, self.catalog_version)
    }

    /// Where each stage runs, pipeline-major; empty while pending.
    pub fn placement(&self) -> &[StagePlacement] {
        &self.placement
    }

    /// Where worker (`pipeline`, `stage`) is in its start.
    pub fn launch(&self, pipeline: u32, stage: u32) -> Option<&Launch> {
        self.stages
            .get(self.index(pipeline, stage))
            .map(|s| &s.launch)
    }

    /// DynPipe's last re-partitioning decision.
    pub fn repartition(&self) -> Option<&RepartitionDecision> {
        self.repartition.as_ref()
    }

    /// The reports kept for one stage worker, oldest first.
    pub fn reports(&self, pipeline: u32, stage: u32) -> impl Iterator<Item = &Received> {
        self.stages
            .get(self.index(pipeline, stage))
            .into_iter()
            .flat_map(|s| s.reports.iter())
    }

    pub(super) fn index(&self, pipeline: u32, stage: u32) -> usize {
        (pipeline * self.spec.stages + stage) as usize
    }

    /// Whether its workers are being started: placing, or the start of a
    /// re-partitioning's next generation.
    pub(super) fn starting(&self) -> bool {
        match self.state {
            TrainJobState::Placing => true,
            TrainJobState::Repartitioning => self
                .drain
                .as_ref()
                .is_some_and(|d| d.phase == super::repartition::DrainPhase::Starting),
            _ => false,
        }
    }

    /// The first iteration every stage still has to run (a
    /// re-partitioning's: the drained one).
    pub(super) fn resume_iteration(&self) -> u64 {
        if let Some(d) = &self.drain {
            return d.after_iteration;
        }
        self.stages
            .iter()
            .map(|s| s.reports.back().map_or(0, |r| r.report.iteration))
            .min()
            .unwrap_or(0)
    }

    pub(super) fn holds_devices(&self) -> bool {
        !self.state.is_terminal() && !self.placement.is_empty()
    }

    pub(super) fn go(
        &mut self,
        event: Event,
        to: TrainJobState,
        now: Instant,
    ) -> Result<(), JobError> {
        if !allowed(&self.state, event) {
            return Err(self.illegal(event));
        }
        log::info!(
            "training job {}: {} -> {}",
            self.id,
            self.state.name(),
            to.name()
        );
        self.state = to;
        self.state_since = now;
        if !self.takes_checkpoint_parts() {
            self.abandon_unfinished_checkpoints();
        }
        Ok(())
    }

    pub(super) fn illegal(&self, event: Event) -> JobError {
        JobError::IllegalTransition {
            job: self.id.clone(),
            state: self.state.name(),
            event: event.as_str(),
        }
    }

    pub(super) fn check_stage(&self, pipeline: u32, stage: u32) -> Result<usize, JobError> {
        if pipeline >= self.spec.pipelines || stage >= self.spec.stages {
            return Err(JobError::NoSuchStage {
                job: self.id.clone(),
                pipeline,
                stage,
                pipelines: self.spec.pipelines,
                stages: self.spec.stages,
            });
        }
        Ok(self.index(pipeline, stage))
    }

    /// Completes a stop once every worker heard it.
    pub(super) fn maybe_stopped(&mut self, now: Instant) {
        if self.state == TrainJobState::Stopping && self.stages.iter().all(|s| s.stopped) {
            let _ = self.go(Event::AllStopped, TrainJobState::Stopped, now);
        }
    }

    pub(super) fn status(&self, now: Instant) -> TrainJobStatus {
        let ms = |t: Instant| {
            u64::try_from(now.saturating_duration_since(t).as_millis()).unwrap_or(u64::MAX)
        };
        let ranges = layer_ranges(&self.partition);
        let stages = self
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let (pipeline, stage) = (i as u32 / self.spec.stages, i as u32 % self.spec.stages);
                let r = &ranges[stage as usize];
                let last = s.reports.back();
                let n = s.reports.len();
                let samples_per_s = match (s.reports.front(), last) {
                    (Some(first), Some(last)) if n >= 2 => {
                        let secs = last.at.saturating_duration_since(first.at).as_secs_f64();
                        let samples: u64 = s.reports.iter().skip(1).map(|r| r.report.samples).sum();
                        (secs > 0.0).then(|| samples as f64 / secs)
                    }
                    _ => None,
                };
                StageStatus {
                    pipeline,
                    stage,
                    layers: LayerRange {
                        first: r.start,
                        end: r.end,
                    },
                    placement: self.placement.get(i).cloned(),
                    iteration: last.map(|r| r.report.iteration),
                    loss: last.and_then(|r| r.report.loss),
                    samples_per_s,
                    fwd_bwd_s: (n > 0).then(|| {
                        s.reports.iter().map(|r| r.report.fwd_bwd_s).sum::<f64>() / n as f64
                    }),
                    last_report_ms_ago: last.map(|r| ms(r.at)),
                    reports: s.total,
                }
            })
            .collect();
        TrainJobStatus {
            id: self.id.clone(),
            state: self.state.clone(),
            waiting: self.waiting.clone(),
            spec: Box::new(self.spec.clone()),
            layers: self.layers,
            catalog_version: self.catalog_version,
            partition: self.partition.clone(),
            generation: self.generation,
            submitted_ms_ago: ms(self.submitted),
            state_ms_ago: ms(self.state_since),
            stages,
            group_asks_waiting: 0,
            repartition: self.repartition.clone(),
            checkpoint: self.checkpoint.clone(),
            last_checkpoint: self.last_checkpoint.clone(),
        }
    }
}
