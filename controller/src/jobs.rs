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
//!    |                  |                      |     ^
//!    |                  |           repartition|     |repartitioned
//!    |                  |                      v     |
//!    |                  |                    repartitioning
//!    |                  +------ fail (placing, running, repartitioning) --> failed
//!    +--stop--> stopped <--all stopped-- stopping <--stop-- (placing, running, repartitioning)
//! ```
//!
//! A stop is done when every worker that ever reported has been told: the
//! reply to its next report says `stop`, or its GPU server is lost, or
//! [`STOP_GRACE`] passed. A worker that never reported is told by the
//! `TrainStageStop` its runtime gets and counts as stopped at once.
//!
//! Starting and stopping stage workers on the GPU servers is the runtime
//! side's (not built yet): [`start_requests`] and [`stop_requests`] are the
//! exact `RuntimeRequest`s to send, and the state's hooks
//! (`ControllerState::start_stage_workers`, `stop_stage_workers`) are where
//! they go out.

pub mod placement;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use distmind_common::limits::{CONTROL_FRAME_BYTES_MAX, NAME_BYTES_MAX};
use distmind_common::proto::{
    ErrorCode, ErrorReply, LayerRange, RuntimeRequest, StageAssignment, StagePeer, StagePeers,
    StagePlacement, StageStatus, TrainJobState, TrainJobStatus,
};
use distmind_common::train_spec::{
    check_partition, layer_ranges, JobSpec, SpecError, STAGE_WORKERS_MAX,
};

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
const JOB_STATUS_BYTES_MAX: usize =
    STAGE_WORKERS_MAX as usize * STAGE_STATUS_BYTES_MAX + 16 * 1024 + REASON_BYTES_MAX;
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
        Event::AllReported => matches!(state, S::Placing),
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
}

#[derive(Debug, Default)]
struct StageProgress {
    /// The last [`REPORTS_PER_STAGE_MAX`] reports, oldest first.
    reports: VecDeque<Received>,
    total: u64,
    /// Told to stop (or never started) during a stop.
    stopped: bool,
}

/// One job as the registry keeps it.
#[derive(Debug)]
pub struct Job {
    id: String,
    spec: JobSpec,
    layers: u32,
    catalog_version: u64,
    state: TrainJobState,
    waiting: Option<String>,
    submitted: Instant,
    state_since: Instant,
    partition: Vec<u32>,
    next_partition: Option<Vec<u32>>,
    generation: u64,
    /// Pipeline-major; empty until placed.
    placement: Vec<StagePlacement>,
    stages: Vec<StageProgress>,
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

    /// The reports kept for one stage worker, oldest first.
    pub fn reports(&self, pipeline: u32, stage: u32) -> impl Iterator<Item = &Received> {
        self.stages
            .get(self.index(pipeline, stage))
            .into_iter()
            .flat_map(|s| s.reports.iter())
    }

    fn index(&self, pipeline: u32, stage: u32) -> usize {
        (pipeline * self.spec.stages + stage) as usize
    }

    /// The first iteration every stage still has to run.
    fn resume_iteration(&self) -> u64 {
        self.stages
            .iter()
            .map(|s| s.reports.back().map_or(0, |r| r.report.iteration))
            .min()
            .unwrap_or(0)
    }

    fn holds_devices(&self) -> bool {
        !self.state.is_terminal() && !self.placement.is_empty()
    }

    fn go(&mut self, event: Event, to: TrainJobState, now: Instant) -> Result<(), JobError> {
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
        Ok(())
    }

    fn illegal(&self, event: Event) -> JobError {
        JobError::IllegalTransition {
            job: self.id.clone(),
            state: self.state.name(),
            event: event.as_str(),
        }
    }

    fn check_stage(&self, pipeline: u32, stage: u32) -> Result<usize, JobError> {
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
    fn maybe_stopped(&mut self, now: Instant) {
        if self.state == TrainJobState::Stopping && self.stages.iter().all(|s| s.stopped) {
            let _ = self.go(Event::AllStopped, TrainJobState::Stopped, now);
        }
    }

    fn status(&self, now: Instant) -> TrainJobStatus {
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
        }
    }
}

/// A request for one stage worker's runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct StageRequest {
    pub runtime: u32,
    /// The runtime's request address.
    pub addr: String,
    pub request: RuntimeRequest,
}

/// The `TrainStage` request of every stage worker of a placed job, in
/// pipeline-major order, with request ids `first_id..`. Empty while the job
/// is pending.
pub fn start_requests(job: &Job, first_id: u64) -> Vec<StageRequest> {
    let s = job.spec.stages;
    let ranges = layer_ranges(&job.partition);
    let peer = |pipeline: u32, stage: u32| {
        let p = &job.placement[job.index(pipeline, stage)];
        StagePeer {
            pipeline,
            stage,
            runtime: p.runtime,
            addr: p.addr.clone(),
            device: p.device,
        }
    };
    let start_iteration = job.resume_iteration();
    job.placement
        .iter()
        .enumerate()
        .map(|(i, at)| {
            let (pipeline, stage) = (i as u32 / s, i as u32 % s);
            let r = &ranges[stage as usize];
            let assignment = StageAssignment {
                job: job.id.clone(),
                generation: job.generation,
                pipeline,
                stage,
                device: at.device,
                model: job.spec.model.clone(),
                catalog_version: job.catalog_version,
                layers: LayerRange {
                    first: r.start,
                    end: r.end,
                },
                partition: job.partition.clone(),
                start_iteration,
                peers: StagePeers {
                    prev: (stage > 0).then(|| peer(pipeline, stage - 1)),
                    next: (stage + 1 < s).then(|| peer(pipeline, stage + 1)),
                    same_stage: (0..job.spec.pipelines)
                        .filter(|&q| q != pipeline)
                        .map(|q| peer(q, stage))
                        .collect(),
                },
                spec: Box::new(job.spec.clone()),
            };
            StageRequest {
                runtime: at.runtime,
                addr: at.addr.clone(),
                request: RuntimeRequest::TrainStage {
                    id: first_id + i as u64,
                    assignment: Box::new(assignment),
                },
            }
        })
        .collect()
}

/// The `TrainStageStop` request of every stage worker of a placed job,
/// with request ids `first_id..`.
pub fn stop_requests(job: &Job, first_id: u64) -> Vec<StageRequest> {
    let s = job.spec.stages;
    job.placement
        .iter()
        .enumerate()
        .map(|(i, at)| StageRequest {
            runtime: at.runtime,
            addr: at.addr.clone(),
            request: RuntimeRequest::TrainStageStop {
                id: first_id + i as u64,
                job: job.id.clone(),
                pipeline: i as u32 / s,
                stage: i as u32 % s,
                generation: job.generation,
            },
        })
        .collect()
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
            });
        }
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
        })
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
        let reason = cut(reason, REASON_BYTES_MAX);
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
            let reason = cut(
                &format!(
                    "its GPU server, runtime {runtime} ({}), device {}: {why}",
                    at.addr, at.device
                ),
                REASON_BYTES_MAX,
            );
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
fn cut(s: &str, max: usize) -> String {
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
