//! Distributed training jobs: the registry, their state machine, the reports
//! of their stage workers, and (in [`placement`]) where the workers run.
//!
//! Like the rest of the controller's state this does no IO and never reads
//! the clock: every method that needs the time takes `now`. The server
//! applies requests to it under [`crate::state::ControllerState`]'s lock.
//!
//! A job's life ([`TrainJobState`]), each arrow one [`Event`], anything else
//! refused with [`JobError::IllegalTransition`]:
//!
//! ```text
//! pending --place--> placing --all reported--> running --finish--> finished
//!                            or all started
//!    |                  |                      |     ^
//!    |                  |           repartition|     |repartitioned
//!    |                  |                      v     |
//!    |                  |                    repartitioning
//!    |                  +------ fail (placing, running, repartitioning) --> failed
//!    +--stop--> stopped <--all stopped-- stopping <--stop-- (placing, running, repartitioning)
//! ```
//!
//! A stop is done when every worker that ever reported has been told: the
//! reply to its next report says `stop`, or its GPU server answered its
//! `TrainStageStop`, or its GPU server is lost, or [`STOP_GRACE`] passed. A worker that never reported is told by the
//! `TrainStageStop` its runtime gets and counts as stopped at once.
//!
//! `placing -> running` also happens when every worker answered its
//! two-step start ([`launch`]): the controller's driver sends the requests
//! ([`start_requests`], [`start_link_requests`], [`stop_requests`]) and
//! feeds the answers back here. With `dynamic.enabled`, reports feed
//! DynPipe's monitor and a triggered re-partition is planned and recorded
//! ([`dynpipe`]), then carried out: drain, checkpoint, the next generation
//! ([`repartition`]).

pub mod checkpoint;
pub mod dynpipe;
mod job;
pub mod launch;
mod periodic;
pub mod placement;
pub mod repartition;
mod requests;

pub use dynpipe::{plan_repartition, RepartitionInput};
use job::StageProgress;
pub use job::{Job, OwnedExtent, Received, ReportOutcome, StageReport};
pub use launch::{Launch, LaunchStep};
pub use repartition::{CheckpointParts, Drain, DrainPhase};
pub use requests::{
    start_link_requests, start_requests, start_requests_with, stop_requests, StageRequest,
};

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use distmind_common::limits::{CONTROL_FRAME_BYTES_MAX, NAME_BYTES_MAX};
use distmind_common::proto::{
    ErrorCode, ErrorReply, RepartitionDecision, StagePlacement, TrainJobState, TrainJobStatus,
};
use distmind_common::train_spec::{check_partition, JobSpec, SpecError, STAGE_WORKERS_MAX};

use crate::policy::Gpu;

/// Most jobs not yet stopped, failed or finished.
pub const JOBS_ACTIVE_MAX: usize = 16;
/// Most jobs kept for `train status`, ended ones included: the oldest
/// ended job is dropped to make room.
pub const JOBS_KEPT_MAX: usize = 32;
/// Reports kept per stage worker (throughput and stage times are taken
/// over them; the DynPipe planner reads them).
pub const REPORTS_PER_STAGE_MAX: usize = 64;
/// How long a stop waits for workers that reported before to hear it.
pub const STOP_GRACE: Duration = Duration::from_secs(30);
/// Longest failure reason kept (longer ones are cut).
pub const REASON_BYTES_MAX: usize = 1024;
/// Longest forward + backward time a report may state.
pub const FWD_BWD_S_MAX: f64 = 86_400.0;

/// A bound on one stage's share of a status reply (numbers, names, the
/// runtime's address) and on the rest of a job's (its spec: bounded
/// names, at most 64 stages and slowdowns, and the fields).
const STAGE_STATUS_BYTES_MAX: usize = 320 + NAME_BYTES_MAX;
const JOB_STATUS_BYTES_MAX: usize = STAGE_WORKERS_MAX as usize * STAGE_STATUS_BYTES_MAX
    + 16 * 1024
    + REASON_BYTES_MAX
    + DECISION_STATUS_BYTES_MAX;
/// A re-partitioning decision in a status: per stage a ratio, two
/// partition entries and a straggler (numbers of at most 24 bytes), the
/// note and the fields.
const DECISION_STATUS_BYTES_MAX: usize = 64 * 4 * 24 + dynpipe::LAYER_COSTS_NOTE_BYTES_MAX + 512;
const _: () = assert!(JOBS_ACTIVE_MAX < JOBS_KEPT_MAX);
// `train status` of every kept job fits one control frame.
const _: () = assert!(JOBS_KEPT_MAX * JOB_STATUS_BYTES_MAX <= CONTROL_FRAME_BYTES_MAX as usize);

/// Why a job request was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("no training job {job:?}; `distmind train status` lists the jobs")]
    UnknownJob { job: String },
    #[error(
        "{active} training jobs are active, the most the controller runs at once \
         ({JOBS_ACTIVE_MAX}); stop one first"
    )]
    TooManyJobs { active: usize },
    #[error("a job named {name:?} is already {state} as {id}; stop it or choose another name")]
    NameInUse {
        name: String,
        id: String,
        state: &'static str,
    },
    #[error("job {job} is {state}: cannot {event}")]
    IllegalTransition {
        job: String,
        state: &'static str,
        event: &'static str,
    },
    #[error(
        "job {job} has pipelines 0..{pipelines} and stages 0..{stages}: no pipeline {pipeline} stage {stage}"
    )]
    NoSuchStage {
        job: String,
        pipeline: u32,
        stage: u32,
        pipelines: u32,
        stages: u32,
    },
    #[error("report of job {job} pipeline {pipeline} stage {stage}: {what}")]
    BadReport {
        job: String,
        pipeline: u32,
        stage: u32,
        what: String,
    },
}

impl JobError {
    pub fn code(&self) -> ErrorCode {
        match self {
            JobError::TooManyJobs { .. } => ErrorCode::Full,
            _ => ErrorCode::BadRequest,
        }
    }
}

impl From<JobError> for ErrorReply {
    fn from(e: JobError) -> Self {
        ErrorReply::new(e.code(), e.to_string())
    }
}

/// What moves a job from one state to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Place,
    AllReported,
    AllStarted,
    Repartition,
    Repartitioned,
    Stop,
    AllStopped,
    Fail,
    Finish,
}

impl Event {
    /// What the event does, for errors ("cannot ...").
    pub fn as_str(self) -> &'static str {
        match self {
            Event::Place => "be placed",
            Event::AllReported => "start running",
            Event::AllStarted => "start running (every worker started)",
            Event::Repartition => "re-partition",
            Event::Repartitioned => "finish re-partitioning",
            Event::Stop => "stop",
            Event::AllStopped => "complete a stop",
            Event::Fail => "fail",
            Event::Finish => "finish",
        }
    }
}

/// The state machine: whether `event` may happen in `state`.
pub fn allowed(state: &TrainJobState, event: Event) -> bool {
    use TrainJobState as S;
    match event {
        Event::Place => matches!(state, S::Pending),
        Event::AllReported | Event::AllStarted => matches!(state, S::Placing),
        Event::Repartition | Event::Finish => matches!(state, S::Running),
        Event::Repartitioned => matches!(state, S::Repartitioning),
        Event::Stop => matches!(
            state,
            S::Pending | S::Placing | S::Running | S::Repartitioning
        ),
        Event::AllStopped => matches!(state, S::Stopping),
        Event::Fail => matches!(state, S::Placing | S::Running | S::Repartitioning),
    }
}

/// Every job the controller keeps, by submission order.
#[derive(Debug, Default)]
pub struct JobRegistry {
    /// By sequence number (the id's suffix).
    jobs: BTreeMap<u64, Job>,
    next_seq: u64,
}

impl JobRegistry {
    pub fn new() -> Self {
        JobRegistry {
            jobs: BTreeMap::new(),
            next_seq: 1,
        }
    }

    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Jobs not stopped, failed or finished.
    pub fn active(&self) -> usize {
        self.jobs
            .values()
            .filter(|j| !j.state.is_terminal())
            .count()
    }

    pub fn get(&self, id: &str) -> Option<&Job> {
        let seq: u64 = id.rsplit_once('-')?.1.parse().ok()?;
        self.jobs.get(&seq).filter(|j| j.id == id)
    }

    fn get_mut(&mut self, id: &str) -> Result<&mut Job, JobError> {
        let seq = id.rsplit_once('-').and_then(|(_, n)| n.parse::<u64>().ok());
        seq.and_then(|seq| self.jobs.get_mut(&seq))
            .filter(|j| j.id == id)
            .ok_or_else(|| JobError::UnknownJob {
                job: id.to_string(),
            })
    }

    /// Registers a job for a model of `layers` layers at `catalog_version`:
    /// `pending`, with the partition in effect. Returns its id
    /// (`<name>-<n>`). Refuses an invalid spec, a name an active job has,
    /// and more than [`JOBS_ACTIVE_MAX`] active jobs; drops the oldest
    /// ended job beyond [`JOBS_KEPT_MAX`].
    pub fn submit(
        &mut self,
        spec: JobSpec,
        layers: u32,
        catalog_version: u64,
        now: Instant,
    ) -> Result<String, JobError> {
        spec.validate()?;
        let partition = spec.partition_for(layers)?;
        if let Some(j) = self
            .jobs
            .values()
            .find(|j| !j.state.is_terminal() && j.spec.name == spec.name)
        {
            return Err(JobError::NameInUse {
                name: spec.name.clone(),
                id: j.id.clone(),
                state: j.state.name(),
            });
        }
        let active = self.active();
        if active >= JOBS_ACTIVE_MAX {
            return Err(JobError::TooManyJobs { active });
        }
        while self.jobs.len() >= JOBS_KEPT_MAX {
            let oldest_ended = self
                .jobs
                .iter()
                .find(|(_, j)| j.state.is_terminal())
                .map(|(&seq, _)| seq)
                .expect("fewer than JOBS_KEPT_MAX jobs are active");
            self.jobs.remove(&oldest_ended);
        }
        let dynpipe = if spec.dynamic.enabled {
            Some(dynpipe::DynPipeWatch::new(&spec, 0)?)
        } else {
            None
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let id = format!("{}-{seq}", spec.name);
        let workers = (spec.pipelines * spec.stages) as usize;
        log::info!(
            "training job {id} submitted: model {} ({layers} layers, partition {partition:?}), \
             {} pipelines x {} stages, sync {}",
            spec.model,
            spec.pipelines,
            spec.stages,
            spec.sync.name()
        );
        self.jobs.insert(
            seq,
            Job {
                id: id.clone(),
                spec,
                layers,
                catalog_version,
                state: TrainJobState::Pending,
                waiting: None,
                submitted: now,
                state_since: now,
                partition,
                next_partition: None,
                generation: 0,
                placement: Vec::new(),
                stages: (0..workers).map(|_| StageProgress::default()).collect(),
                dynpipe,
                repartition: None,
                drain: None,
                checkpoint: None,
                model_now: None,
                periodic: None,
                abandoned: Vec::new(),
                last_checkpoint: None,
            },
        );
        Ok(id)
    }

    /// Pending jobs, oldest first.
    pub fn pending(&self) -> Vec<String> {
        self.jobs
            .values()
            .filter(|j| j.state == TrainJobState::Pending)
            .map(|j| j.id.clone())
            .collect()
    }

    /// Devices the stage workers of placed, unended jobs hold.
    pub fn held_devices(&self) -> BTreeSet<Gpu> {
        self.jobs
            .values()
            .filter(|j| j.holds_devices())
            .flat_map(|j| &j.placement)
            .map(|p| Gpu {
                runtime: p.runtime,
                device: p.device,
            })
            .collect()
    }

    /// Records why a pending job still waits.
    pub fn set_waiting(&mut self, id: &str, why: String) -> Result<(), JobError> {
        let job = self.get_mut(id)?;
        if job.waiting.as_ref() != Some(&why) {
            log::info!("training job {id} waits: {why}");
        }
        job.waiting = Some(why);
        Ok(())
    }

    /// pending -> placing on `placement` (pipeline-major, one per stage).
    pub fn place(
        &mut self,
        id: &str,
        placement: Vec<StagePlacement>,
        now: Instant,
    ) -> Result<(), JobError> {
        let job = self.get_mut(id)?;
        assert_eq!(
            placement.len(),
            job.stages.len(),
            "a placement has one device per stage worker"
        );
        job.go(Event::Place, TrainJobState::Placing, now)?;
        job.placement = placement;
        job.waiting = None;
        Ok(())
    }

    /// Takes a stage worker's report. A report completes `placing` (every
    /// stage reported) and `running` (every stage did the spec's
    /// iterations), and is how a worker hears a stop.
    pub fn report(
        &mut self,
        id: &str,
        r: StageReport,
        now: Instant,
    ) -> Result<ReportOutcome, JobError> {
        let job = self.get_mut(id)?;
        let i = job.check_stage(r.pipeline, r.stage)?;
        let bad = |what: String| JobError::BadReport {
            job: id.to_string(),
            pipeline: r.pipeline,
            stage: r.stage,
            what,
        };
        if !(r.fwd_bwd_s.is_finite() && (0.0..=FWD_BWD_S_MAX).contains(&r.fwd_bwd_s)) {
            return Err(bad(format!(
                "fwd_bwd_s = {} is not a time in 0..={FWD_BWD_S_MAX} s",
                r.fwd_bwd_s
            )));
        }
        if r.loss.is_some_and(|l| !l.is_finite()) {
            return Err(bad("loss is not a finite number".into()));
        }
        if r.iteration > job.spec.iterations {
            return Err(bad(format!(
                "iteration = {} is past the job's {} iterations",
                r.iteration, job.spec.iterations
            )));
        }
        if r.samples > u64::from(job.spec.batch) {
            return Err(bad(format!(
                "samples = {} is more than a pipeline's batch of {}",
                r.samples, job.spec.batch
            )));
        }
        match job.state {
            TrainJobState::Pending => return Err(job.illegal(Event::AllReported)),
            TrainJobState::Stopped | TrainJobState::Failed { .. } | TrainJobState::Finished => {
                return Ok(ReportOutcome {
                    state: job.state.clone(),
                    stop: true,
                    repartition: None,
                    drain: None,
                })
            }
            _ => {}
        }
        let stage = &mut job.stages[i];
        if stage.reports.len() == REPORTS_PER_STAGE_MAX {
            stage.reports.pop_front();
        }
        stage.reports.push_back(Received { at: now, report: r });
        stage.total += 1;
        if job.state == TrainJobState::Stopping {
            stage.stopped = true;
            job.maybe_stopped(now);
            return Ok(ReportOutcome {
                state: job.state.clone(),
                stop: true,
                repartition: None,
                drain: None,
            });
        }
        let repartition = if job.state == TrainJobState::Repartitioning {
            None
        } else {
            job.dynpipe
                .as_mut()
                .and_then(|w| w.observe(r.pipeline, r.stage, r.iteration, r.fwd_bwd_s))
        };
        if job.state == TrainJobState::Placing && job.stages.iter().all(|s| s.total > 0) {
            job.go(Event::AllReported, TrainJobState::Running, now)?;
        }
        let done = |s: &StageProgress| {
            s.reports
                .back()
                .is_some_and(|r| r.report.iteration >= job.spec.iterations)
        };
        if job.state == TrainJobState::Running && job.stages.iter().all(done) {
            job.go(Event::Finish, TrainJobState::Finished, now)?;
        }
        Ok(ReportOutcome {
            state: job.state.clone(),
            stop: job.state.is_terminal(),
            repartition,
            drain: job.drain_order(r.pipeline),
        })
    }

    /// Records DynPipe's decision for `id` (of the generation it was made
    /// in; a decision for another one is dropped) and, while the job runs,
    /// starts carrying it out ([`repartition`]: running ->
    /// repartitioning) unless it keeps the partition or comes too late (the
    /// log says why). Returns whether it was kept.
    pub fn record_repartition(
        &mut self,
        id: &str,
        decision: RepartitionDecision,
        now: Instant,
    ) -> bool {
        let Ok(job) = self.get_mut(id) else {
            return false;
        };
        if decision.generation != job.generation || job.state.is_terminal() {
            return false;
        }
        log::info!(
            "training job {id}: DynPipe decided to re-partition {:?} -> {:?} before iteration {} \
             (decided at {}; stage ratios {:?}; predicted {:.6} s per microbatch, now {:.6} s; layer costs by {})",
            decision.old_partition,
            decision.new_partition,
            decision.at_iteration,
            decision.decided_at_iteration,
            decision.ratios,
            decision.predicted_s_per_microbatch,
            decision.current_s_per_microbatch,
            decision.layer_costs,
        );
        if let Err(why) = job.begin_drain(&decision, now) {
            log::info!("training job {id}: the re-partitioning is not carried out: {why}");
        }
        job.repartition = Some(decision);
        true
    }

    /// A stage worker failed: the job fails naming it (while stopping, the
    /// worker just counts as stopped; an ended job stays as it is).
    pub fn fail(
        &mut self,
        id: &str,
        pipeline: u32,
        stage: u32,
        reason: &str,
        now: Instant,
    ) -> Result<TrainJobState, JobError> {
        let job = self.get_mut(id)?;
        let i = job.check_stage(pipeline, stage)?;
        let reason = job.failure_reason(reason);
        match &job.state {
            TrainJobState::Stopping => {
                log::warn!("training job {id}: pipeline {pipeline} stage {stage} failed while stopping: {reason}");
                job.stages[i].stopped = true;
                job.maybe_stopped(now);
            }
            s if s.is_terminal() => {}
            _ => {
                log::error!(
                    "training job {id} failed: pipeline {pipeline} stage {stage}: {reason}"
                );
                job.go(
                    Event::Fail,
                    TrainJobState::Failed {
                        pipeline,
                        stage,
                        reason,
                    },
                    now,
                )?;
            }
        }
        Ok(job.state.clone())
    }

    /// Stops a job: pending -> stopped; placed -> stopping, or stopped when
    /// no worker ever reported.
    pub fn stop(&mut self, id: &str, now: Instant) -> Result<TrainJobState, JobError> {
        let job = self.get_mut(id)?;
        if job.state == TrainJobState::Pending {
            job.go(Event::Stop, TrainJobState::Stopped, now)?;
            return Ok(job.state.clone());
        }
        job.go(Event::Stop, TrainJobState::Stopping, now)?;
        for s in &mut job.stages {
            s.stopped = s.total == 0;
        }
        job.maybe_stopped(now);
        Ok(job.state.clone())
    }

    /// running -> repartitioning towards `partition` (checked against the
    /// job's stages and the model's layers).
    pub fn begin_repartition(
        &mut self,
        id: &str,
        partition: Vec<u32>,
        now: Instant,
    ) -> Result<(), JobError> {
        let job = self.get_mut(id)?;
        if !allowed(&job.state, Event::Repartition) {
            return Err(job.illegal(Event::Repartition));
        }
        check_partition(&partition, job.spec.stages, job.layers)?;
        job.go(Event::Repartition, TrainJobState::Repartitioning, now)?;
        job.next_partition = Some(partition);
        Ok(())
    }

    /// repartitioning -> running on the new partition, one generation on
    /// (the workers' new assignments are [`start_requests`]).
    pub fn finish_repartition(&mut self, id: &str, now: Instant) -> Result<(), JobError> {
        let job = self.get_mut(id)?;
        job.go(Event::Repartitioned, TrainJobState::Running, now)?;
        job.partition = job
            .next_partition
            .take()
            .expect("repartitioning has a partition to move to");
        job.generation += 1;
        Ok(())
    }

    /// A GPU server is lost (`why`: silent or restarted): every unended job
    /// with a worker there fails naming its first such stage, or, while
    /// stopping, those workers count as stopped. Returns the jobs changed.
    pub fn runtime_lost(&mut self, runtime: u32, why: &str, now: Instant) -> Vec<String> {
        let mut changed = Vec::new();
        for job in self.jobs.values_mut().filter(|j| j.holds_devices()) {
            let on_it: Vec<usize> = (0..job.placement.len())
                .filter(|&i| job.placement[i].runtime == runtime)
                .collect();
            let Some(&first) = on_it.first() else {
                continue;
            };
            changed.push(job.id.clone());
            if job.state == TrainJobState::Stopping {
                for &i in &on_it {
                    job.stages[i].stopped = true;
                }
                job.maybe_stopped(now);
                continue;
            }
            let at = &job.placement[first];
            let reason = job.failure_reason(&format!(
                "its GPU server, runtime {runtime} ({}), device {}: {why}",
                at.addr, at.device
            ));
            let (pipeline, stage) = (
                first as u32 / job.spec.stages,
                first as u32 % job.spec.stages,
            );
            log::error!(
                "training job {} failed: pipeline {pipeline} stage {stage}: {reason}",
                job.id
            );
            let failed = TrainJobState::Failed {
                pipeline,
                stage,
                reason,
            };
            job.go(Event::Fail, failed, now)
                .expect("an unended placed job other than stopping may fail");
        }
        changed
    }

    /// Completes stops older than [`STOP_GRACE`] (their silent workers are
    /// named in the log). Returns the jobs stopped.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let mut stopped = Vec::new();
        for job in self.jobs.values_mut() {
            if job.state == TrainJobState::Stopping
                && now.saturating_duration_since(job.state_since) >= STOP_GRACE
            {
                let silent: Vec<String> = job
                    .stages
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| !s.stopped)
                    .map(|(i, _)| {
                        format!(
                            "{}/{}",
                            i as u32 / job.spec.stages,
                            i as u32 % job.spec.stages
                        )
                    })
                    .collect();
                log::warn!(
                    "training job {}: stopped after {STOP_GRACE:?} without word from pipeline/stage {}",
                    job.id,
                    silent.join(", ")
                );
                for s in &mut job.stages {
                    s.stopped = true;
                }
                job.maybe_stopped(now);
                stopped.push(job.id.clone());
            }
        }
        stopped
    }

    /// One job's status (`Some(id)`), or every job's, oldest first.
    pub fn status(&self, id: Option<&str>, now: Instant) -> Result<Vec<TrainJobStatus>, JobError> {
        match id {
            Some(id) => {
                self.get(id)
                    .map(|j| vec![j.status(now)])
                    .ok_or_else(|| JobError::UnknownJob {
                        job: id.to_string(),
                    })
            }
            None => Ok(self.jobs.values().map(|j| j.status(now)).collect()),
        }
    }
}

/// `s` cut to at most `max` bytes at a character boundary.
pub(crate) fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

#[cfg(test)]
mod tests;
