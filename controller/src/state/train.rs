//! Training jobs in the controller's state: submit (checked against the
//! catalog), stop, placement of pending jobs on the live GPU servers, and
//! what the controller's driver (`crate::driver`) must send to the GPU
//! servers, as values ([`TrainAction`]), with the answers it brings back.
//!
//! A job's life as the driver sees it:
//!
//! ```text
//! placed      -> Send Setup (TrainStage to every worker)
//! all ready   -> Send Start (TrainStageStart with the data peers)
//! all started -> running
//! a refusal, a wrong answer, no answer in time, a lost GPU server
//!             -> failed (naming the stage and why) + Send Stop to the others
//! stop        -> Send Stop (TrainStageStop to every worker sent a TrainStage)
//! DynPipe trigger (a report) -> Plan (off the lock) -> the decision recorded
//!             -> repartitioning: report replies say drain (`jobs::repartition`)
//! every checkpoint part written -> the checkpoint in the catalog
//!             -> Send Stop (TrainStageStop to every drained worker)
//! all answered -> generation + 1: Send Setup ... as above -> running
//! checkpoint parts abandoned (`jobs::periodic`) -> Free their extents
//! ```
//!
//! Every change that stops or ends a job also answers its workers' waiting
//! group asks with `stop` (`state::groups`).

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use distmind_common::proto::{
    ErrorCode, ErrorReply, GroupLocation, Location, ModelEntry, RepartitionDecision, RuntimeReply,
    TrainJobState, TrainJobStatus,
};
use distmind_common::train_spec::JobSpec;
use distmind_models::Manifest;
use serde::Deserialize;

use super::ControllerState;
use crate::jobs::checkpoint::checkpoint_manifest;
use crate::jobs::{
    self, placement, JobError, LaunchStep, OwnedExtent, RepartitionInput, StageRequest,
    JOBS_KEPT_MAX,
};

/// Most actions waiting for the driver: per kept job at most a setup, a
/// start, a stop, a plan and a free are ever outstanding at once.
pub const TRAIN_ACTIONS_MAX: usize = 5 * JOBS_KEPT_MAX;

/// Which request of a stage worker's life a [`TrainAction::Send`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagePhase {
    /// `TrainStage`; answered `TrainStageReady`.
    Setup,
    /// `TrainStageStart`; answered `TrainStageStarted`.
    Start,
    /// `TrainStageStop`; answered `Training`.
    Stop,
}

impl StagePhase {
    /// The request's name, for errors.
    pub fn request(self) -> &'static str {
        match self {
            StagePhase::Setup => "TrainStage",
            StagePhase::Start => "TrainStageStart",
            StagePhase::Stop => "TrainStageStop",
        }
    }

    /// The answer it waits for.
    pub fn answer(self) -> &'static str {
        match self {
            StagePhase::Setup => "TrainStageReady",
            StagePhase::Start => "TrainStageStarted",
            StagePhase::Stop => "Training",
        }
    }
}

/// What the driver does for training jobs.
#[derive(Debug)]
pub enum TrainAction {
    /// Send each request to its GPU server and bring back every answer, or
    /// why there is none, with [`ControllerState::stage_answered`].
    Send {
        job: String,
        generation: u64,
        phase: StagePhase,
        requests: Vec<StageRequest>,
    },
    /// Run DynPipe's planner ([`jobs::plan_repartition`]; it may simulate
    /// many candidates, so off the lock) and bring the decision back with
    /// [`ControllerState::repartition_planned`].
    Plan(Box<RepartitionInput>),
    /// Free these extents on their memory servers (off the lock, best
    /// effort, logged): parts of job `job`'s checkpoints that will never
    /// be in the catalog.
    Free {
        job: String,
        extents: Vec<OwnedExtent>,
    },
}

/// A GPU server's answer to one stage request, or why there is none.
#[derive(Debug, Clone, PartialEq)]
pub struct StageAnswer {
    pub job: String,
    pub generation: u64,
    pub phase: StagePhase,
    pub pipeline: u32,
    pub stage: u32,
    pub runtime: u32,
    /// The answer, or why none came (no link, the link failed, no answer
    /// in time).
    pub reply: Result<RuntimeReply, String>,
}

impl ControllerState {
    /// Registers a job after checking its spec and, against the catalog,
    /// its model (the partition must cover the model's layers), then tries
    /// to place it.
    pub(super) fn train_submit(
        &mut self,
        spec: JobSpec,
        now: Instant,
    ) -> Result<TrainJobStatus, ErrorReply> {
        spec.validate().map_err(JobError::from)?;
        let entry = self.catalog.get(&spec.model).map_err(|e| {
            ErrorReply::new(
                e.code,
                format!(
                    "training spec: model = {:?}: not in the catalog; deploy it first (`distmind deploy`)",
                    spec.model
                ),
            )
        })?;
        let layers = entry
            .manifest
            .get("layers")
            .and_then(|l| l.as_array())
            .map(|l| l.len())
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                ErrorReply::new(
                    ErrorCode::BadRequest,
                    format!(
                        "model {:?}: its catalog entry's manifest has no layer list; deploy the package again",
                        spec.model
                    ),
                )
            })?;
        let layers = u32::try_from(layers).unwrap_or(u32::MAX);
        let id = self.jobs.submit(spec, layers, entry.version, now)?;
        self.place_pending(now);
        Ok(self.job_status(&id, now))
    }

    pub(super) fn train_stop(
        &mut self,
        id: &str,
        now: Instant,
    ) -> Result<TrainJobStatus, JobError> {
        let state = self.jobs.stop(id, now)?;
        self.stop_stage_workers(id, None);
        self.job_changed(id);
        if state.is_terminal() {
            self.place_pending(now);
        }
        Ok(self.job_status(id, now))
    }

    /// A worker said it cannot go on: the job fails naming it.
    pub(super) fn train_failed(
        &mut self,
        id: &str,
        pipeline: u32,
        stage: u32,
        reason: &str,
        now: Instant,
    ) -> Result<TrainJobState, JobError> {
        let state = self.jobs.fail(id, pipeline, stage, reason, now)?;
        if state.is_terminal() {
            self.stop_stage_workers(id, None);
            self.place_pending(now);
        }
        self.job_changed(id);
        Ok(state)
    }

    pub(super) fn job_status(&self, id: &str, now: Instant) -> TrainJobStatus {
        self.train_status(Some(id), now)
            .ok()
            .and_then(|mut v| v.pop())
            .expect("the job was just registered or changed")
    }

    /// `train status`: the registry's view and the asks waiting for groups.
    pub(super) fn train_status(
        &self,
        id: Option<&str>,
        now: Instant,
    ) -> Result<Vec<TrainJobStatus>, JobError> {
        let mut jobs = self.jobs.status(id, now)?;
        for j in &mut jobs {
            j.group_asks_waiting = u32::try_from(self.groups.waiting(&j.id)).unwrap_or(u32::MAX);
        }
        Ok(jobs)
    }

    /// Places pending jobs, oldest first, on the devices live GPU servers
    /// offer and no job holds; a job that does not fit waits, saying why,
    /// and younger ones that fit go ahead of it. Called when a job or a
    /// GPU server comes or goes, and on every expiry sweep.
    pub fn place_pending(&mut self, now: Instant) {
        let pending = self.jobs.pending();
        if pending.is_empty() {
            return;
        }
        let live = self.runtimes.live(now);
        for id in pending {
            let Some((p, s)) = self
                .jobs
                .get(&id)
                .map(|j| (j.spec().pipelines, j.spec().stages))
            else {
                continue;
            };
            let held = self.jobs.held_devices();
            let candidates = placement::candidates(&live, &self.assignments.gpus, &held);
            let outcome = match placement::place(p, s, &candidates) {
                Ok(at) => self.jobs.place(&id, at, now).map(|()| {
                    self.start_stage_workers(&id);
                }),
                Err(e) => self.jobs.set_waiting(&id, e.to_string()),
            };
            if let Err(e) = outcome {
                log::error!("placing training job {id}: {e}");
            }
        }
    }

    fn take_request_ids(&mut self, n: usize) -> u64 {
        let first = self.next_stage_request_id;
        self.next_stage_request_id += n as u64;
        first
    }

    /// The actions for the driver, oldest first, with the frees of every
    /// checkpoint part abandoned since the last time.
    pub fn take_train_actions(&mut self) -> Vec<TrainAction> {
        for (job, extents) in self.jobs.take_abandoned() {
            self.train_actions
                .push_back(TrainAction::Free { job, extents });
        }
        self.train_actions.drain(..).collect()
    }

    /// Wakes the driver when a job abandoned checkpoint parts, for it to
    /// free them (the next [`Self::take_train_actions`] takes them).
    pub(super) fn free_abandoned_soon(&mut self) {
        if self.jobs.has_abandoned() {
            self.train_wake.notify_one();
        }
    }

    /// Queues an action and wakes the driver. The queue is bounded
    /// ([`TRAIN_ACTIONS_MAX`]); past it (no driver takes them) the oldest
    /// is dropped, logged.
    fn push_action(&mut self, a: TrainAction) {
        if self.train_actions.len() >= TRAIN_ACTIONS_MAX {
            if let Some(old) = self.train_actions.pop_front() {
                log::error!(
                    "{TRAIN_ACTIONS_MAX} training actions wait for the driver (the bound); dropped the oldest: {}",
                    describe(&old)
                );
            }
        }
        self.train_actions.push_back(a);
        self.train_wake.notify_one();
    }

    /// Sends a placed job's `TrainStage` requests (the first step of its
    /// start). Returns what goes out.
    fn start_stage_workers(&mut self, id: &str) -> Vec<StageRequest> {
        let Some(n) = self.jobs.get(id).map(|j| j.placement().len()) else {
            return Vec::new();
        };
        let first = self.take_request_ids(n);
        let job = self.jobs.get(id).expect("looked up above");
        let (generation, reqs) = (job.generation(), jobs::start_requests(job, first));
        if reqs.is_empty() {
            return reqs;
        }
        log_stage_requests(id, "TrainStage", &reqs);
        let _ = self.jobs.launch_sent(id);
        self.push_action(TrainAction::Send {
            job: id.to_string(),
            generation,
            phase: StagePhase::Setup,
            requests: reqs.clone(),
        });
        reqs
    }

    /// Sends `TrainStageStop` to every worker of `id` that was sent its
    /// `TrainStage` and not told yet, except those on `except_runtime`.
    fn stop_stage_workers(&mut self, id: &str, except_runtime: Option<u32>) {
        let Some((n, generation)) = self
            .jobs
            .get(id)
            .map(|j| (j.placement().len(), j.generation()))
        else {
            return;
        };
        let first = self.take_request_ids(n);
        let reqs = self.jobs.take_stop_requests(id, first, except_runtime);
        if reqs.is_empty() {
            return;
        }
        log_stage_requests(id, "TrainStageStop", &reqs);
        self.push_action(TrainAction::Send {
            job: id.to_string(),
            generation,
            phase: StagePhase::Stop,
            requests: reqs,
        });
    }

    /// The GPU servers hosting a started (or starting) worker of an unended
    /// job: the driver keeps a stage link to each.
    pub fn training_runtimes(&self) -> BTreeSet<u32> {
        self.jobs.runtimes_in_use()
    }

    /// A GPU server's answer to a stage request (or why there is none):
    /// the next step of the job's start, or its failure naming the stage.
    pub fn stage_answered(&mut self, a: StageAnswer, now: Instant) {
        let (id, generation, p, s) = (a.job.as_str(), a.generation, a.pipeline, a.stage);
        let Some(job) = self.jobs.get(id) else {
            return;
        };
        let before = job.state().clone();
        let where_ = job
            .placement()
            .get((p * job.spec().stages + s) as usize)
            .map_or_else(
                || format!("runtime {}", a.runtime),
                |at| format!("runtime {} ({}), device {}", at.runtime, at.addr, at.device),
            );
        let wrong = |r: &RuntimeReply| {
            format!(
                "{where_}: answered {} with {}; the GPU server runs another protocol version?",
                a.phase.request(),
                reply_name(r)
            )
        };
        let step = match (a.phase, &a.reply) {
            (StagePhase::Stop, _) if self.jobs.drained_worker_stopped(id, generation, p, s) => {
                // The last drained worker is gone: its device is free.
                if let Err(e) = &a.reply {
                    log::warn!("training job {id}: pipeline {p} stage {s}: no answer to its TrainStageStop from {where_}: {e}");
                }
                self.start_next_generation(id, now);
                return;
            }
            (StagePhase::Stop, Ok(RuntimeReply::Error { error, .. })) => {
                log::warn!(
                    "training job {id}: pipeline {p} stage {s}: {where_} refused its TrainStageStop: {error}"
                );
                return;
            }
            (StagePhase::Stop, Ok(_)) => {
                self.jobs.stop_acknowledged(id, generation, p, s, now);
                Ok(LaunchStep::Wait)
            }
            (StagePhase::Stop, Err(why)) => {
                log::warn!(
                    "training job {id}: pipeline {p} stage {s}: its TrainStageStop did not reach {where_}: {why}"
                );
                return;
            }
            (phase, Ok(RuntimeReply::Error { error, .. })) => {
                let reason = format!(
                    "{where_} refused its {}: {}: {}",
                    phase.request(),
                    error.code.as_str(),
                    error.message
                );
                self.jobs.stage_refused(id, generation, p, s, &reason, now)
            }
            (phase, Err(why)) => {
                let reason = format!("{where_}: no {}: {why}", phase.answer());
                self.jobs.stage_refused(id, generation, p, s, &reason, now)
            }
            (StagePhase::Setup, Ok(r)) => match r {
                RuntimeReply::TrainStageReady {
                    job,
                    generation: g,
                    pipeline,
                    stage,
                    data_addr,
                    layer_checksums,
                    ..
                } if (job.as_str(), *g, *pipeline, *stage) == (id, generation, p, s) => self
                    .jobs
                    .stage_ready(id, generation, p, s, data_addr, layer_checksums, now),
                r => {
                    let reason = wrong(r);
                    self.jobs.stage_refused(id, generation, p, s, &reason, now)
                }
            },
            (StagePhase::Start, Ok(r)) => match r {
                RuntimeReply::TrainStageStarted {
                    job,
                    generation: g,
                    pipeline,
                    stage,
                    ..
                } if (job.as_str(), *g, *pipeline, *stage) == (id, generation, p, s) => {
                    self.jobs.stage_started(id, generation, p, s, now)
                }
                r => {
                    let reason = wrong(r);
                    self.jobs.stage_refused(id, generation, p, s, &reason, now)
                }
            },
        };
        match step {
            Ok(LaunchStep::AllReady) => self.start_links(id),
            Ok(LaunchStep::AllStarted) => {
                log::info!("training job {id}: every stage worker started")
            }
            Ok(LaunchStep::Wait | LaunchStep::Stale) => {}
            Err(e) => log::warn!("training job {id}: an answer from {where_}: {e}"),
        }
        let after = self.jobs.get(id).map(|j| j.state().clone());
        let over = after
            .as_ref()
            .is_none_or(|s| s.is_terminal() || *s == TrainJobState::Stopping);
        if after.as_ref() != Some(&before) && over {
            // A failure (or the last stop heard) ends it: tell the others,
            // answer its group asks, and give its devices to pending jobs.
            self.stop_stage_workers(id, None);
            self.job_changed(id);
            if after.is_some_and(|s| s.is_terminal()) {
                self.place_pending(now);
            }
        }
    }

    /// A worker of pipeline 0 wrote its checkpoint part: a drained one's
    /// (a re-partitioning) or a periodic one's (`checkpoint_every`). The
    /// last part puts the checkpoint in the catalog (it becomes the job's
    /// last checkpoint); a re-partitioning's then stops the drained
    /// generation. A checkpoint that cannot be put fails the job naming
    /// why. Returns the job's state and, when a periodic checkpoint
    /// replaced the previous one, that one's extents for the worker to
    /// free.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn train_checkpointed(
        &mut self,
        id: &str,
        generation: u64,
        pipeline: u32,
        stage: u32,
        iteration: u64,
        model: &str,
        group: GroupLocation,
        layer_checksums: Vec<u64>,
        now: Instant,
    ) -> Result<(TrainJobState, Vec<Location>), JobError> {
        let parts = self.jobs.checkpointed(
            id,
            generation,
            pipeline,
            stage,
            iteration,
            model,
            group,
            layer_checksums,
        )?;
        let mut free = Vec::new();
        if let Some(parts) = parts {
            match self.put_checkpoint(id, &parts) {
                Ok((version, replaced)) => {
                    self.jobs.checkpoint_saved(id, &parts, version);
                    if parts.periodic {
                        log::info!(
                            "training job {id}: periodic checkpoint {} (catalog version \
                             {version}) written after iteration {iteration}",
                            parts.name
                        );
                        free = replaced
                            .iter()
                            .flat_map(|e| e.groups.iter())
                            .flat_map(|g| g.slices.iter())
                            .flat_map(|s| s.replicas.iter().cloned())
                            .collect();
                    } else {
                        log::info!(
                            "training job {id}: checkpoint {} (catalog version {version}) \
                             written after iteration {iteration}; stopping the drained workers",
                            parts.name
                        );
                        if self.jobs.checkpoint_put(id, version) {
                            self.stop_stage_workers(id, None);
                        }
                    }
                }
                Err(why) => {
                    let what = if parts.periodic {
                        // Taken out of the job when complete: abandoned
                        // here (a re-partitioning's are when the job fails).
                        self.jobs.abandon_checkpoint(id, &parts);
                        "periodic checkpoint"
                    } else {
                        "re-partitioning: checkpoint"
                    };
                    let reason = format!("{what} {}: {why}", parts.name);
                    return self
                        .train_failed(id, pipeline, stage, &reason, now)
                        .map(|s| (s, Vec::new()));
                }
            }
        }
        // A newer periodic checkpoint may have abandoned an older one.
        self.free_abandoned_soon();
        let state = self
            .jobs
            .get(id)
            .map(|j| j.state().clone())
            .expect("checkpointed looked it up");
        Ok((state, free))
    }

    /// Puts job `job`'s checkpoint's catalog entry: the model's manifest
    /// re-cut per stage, with the groups the workers wrote. Returns its
    /// catalog version and the entry it replaced (only ever the job's own
    /// last checkpoint).
    fn put_checkpoint(
        &mut self,
        job: &str,
        parts: &jobs::CheckpointParts,
    ) -> Result<(u64, Option<Arc<ModelEntry>>), String> {
        let (base, version) = &parts.base;
        let entry = self
            .catalog
            .get(base)
            .ok()
            .filter(|e| e.version == *version)
            .ok_or_else(|| {
                format!("model {base} at catalog version {version} is no longer in the catalog")
            })?;
        let manifest = Manifest::deserialize(&entry.manifest)
            .map_err(|e| format!("model {base}'s manifest does not parse: {e}"))?;
        // Only the job's own last checkpoint is replaced (and freed), never
        // a model someone deployed under the name.
        if let Ok(old) = self.catalog.get(&parts.name) {
            let own = self
                .jobs
                .get(job)
                .and_then(|j| j.last_checkpoint())
                .is_some_and(|c| c.model == parts.name && c.catalog_version == old.version);
            if !own {
                return Err(format!(
                    "the catalog has a model {} (version {}) that is not this job's last \
                     checkpoint; remove it or rename the job",
                    parts.name, old.version
                ));
            }
        }
        let sums: Vec<String> = parts.groups.iter().map(|g| g.checksum.clone()).collect();
        let m = checkpoint_manifest(&manifest, &parts.partition, &parts.name, &sums)?;
        for (g, want) in parts.groups.iter().zip(&m.groups) {
            if g.bytes != want.bytes {
                return Err(format!(
                    "stage {} wrote {} bytes, its group has {}",
                    g.index, g.bytes, want.bytes
                ));
            }
        }
        let ckpt = ModelEntry {
            name: parts.name.clone(),
            family: entry.family.clone(),
            total_bytes: parts.groups.iter().map(|g| g.bytes).sum(),
            strategy: entry.strategy.clone(),
            replication: parts
                .groups
                .iter()
                .flat_map(|g| g.slices.iter().map(|s| s.replicas.len() as u32))
                .min()
                .unwrap_or(1),
            version: 0,
            groups: parts.groups.clone(),
            manifest: serde_json::to_value(&m).map_err(|e| e.to_string())?,
        };
        let registry = &self.registry;
        let replaced = self
            .catalog
            .put(ckpt, |id| registry.addr(id))
            .map_err(|e| format!("the catalog refused it: {}", e.message))?;
        let version = self
            .catalog
            .get(&parts.name)
            .map(|e| e.version)
            .expect("just put");
        Ok((version, replaced))
    }

    /// Every drained worker of `id` stopped: its next generation starts.
    fn start_next_generation(&mut self, id: &str, now: Instant) {
        match self.jobs.start_next_generation(id) {
            Ok(()) => {
                self.start_stage_workers(id);
            }
            Err(e) => {
                log::error!("training job {id}: cannot start its next generation: {e}");
                let _ = self.train_failed(id, 0, 0, &e.to_string(), now);
            }
        }
    }

    /// Every worker of `id` is ready: the second step of its start.
    fn start_links(&mut self, id: &str) {
        let Some(n) = self.jobs.get(id).map(|j| j.placement().len()) else {
            return;
        };
        let first = self.take_request_ids(n);
        let job = self.jobs.get(id).expect("looked up above");
        let (generation, reqs) = (job.generation(), jobs::start_link_requests(job, first));
        if reqs.is_empty() {
            return;
        }
        log_stage_requests(id, "TrainStageStart", &reqs);
        let _ = self.jobs.start_sent(id);
        self.push_action(TrainAction::Send {
            job: id.to_string(),
            generation,
            phase: StagePhase::Start,
            requests: reqs,
        });
    }

    /// The driver's stage link to `runtime` closed (`why`): the GPU server
    /// is taken as lost, as when it stops heartbeating.
    pub fn stage_link_lost(&mut self, runtime: u32, why: &str, now: Instant) {
        let why = format!("its stage link closed: {why}");
        self.runtime_gone(runtime, &why, now);
    }

    /// GPU server `runtime` is lost (`why`: silent, restarted, its link
    /// closed): its workers leave their sync groups, every unended job with
    /// a worker there fails naming its first such stage (or, while
    /// stopping, they count as stopped), the jobs' other workers are told
    /// to stop, and their devices go to pending jobs.
    pub(super) fn runtime_gone(&mut self, runtime: u32, why: &str, now: Instant) {
        let at = self.group_clock(now);
        let mut released = Vec::new();
        for (job, pipelines) in self.jobs.pipelines_on(runtime) {
            for p in pipelines {
                released.extend(self.groups.remove(&job, p, at));
            }
        }
        let changed = self.jobs.runtime_lost(runtime, why, now);
        self.deliver(released);
        for job in &changed {
            self.stop_stage_workers(job, Some(runtime));
            self.job_changed(job);
        }
        if !changed.is_empty() {
            self.place_pending(now);
        }
    }

    /// DynPipe's monitor triggered on a report of `id`: the planner's input,
    /// for the driver.
    pub(super) fn plan_repartition(&mut self, id: &str, trigger: jobs::dynpipe::Trigger) {
        let Some(job) = self.jobs.get(id) else {
            return;
        };
        let (_, version) = job.model();
        let model = self
            .catalog
            .get(&job.spec().model)
            .ok()
            .filter(|e| e.version == version);
        log::info!(
            "training job {id}: DynPipe's monitor triggered at iteration {} (stage ratios {:?}, stragglers {:?}); planning",
            trigger.decided_at_iteration,
            trigger.ratios,
            trigger.stragglers
        );
        let input = RepartitionInput {
            job: id.to_string(),
            generation: job.generation(),
            trigger,
            microbatches: job.spec().microbatches,
            partition: job.partition().to_vec(),
            model,
        };
        self.push_action(TrainAction::Plan(Box::new(input)));
    }

    /// The planner's answer for `job` (`generation`): recorded on the job,
    /// which `train status` shows; a failure is logged.
    pub fn repartition_planned(
        &mut self,
        job: &str,
        generation: u64,
        decision: Result<RepartitionDecision, String>,
        now: Instant,
    ) {
        match decision {
            Ok(d) => {
                if !self.jobs.record_repartition(job, d, now) {
                    log::debug!("training job {job}: a re-partitioning decision of generation {generation} dropped: the job moved on");
                }
            }
            Err(e) => log::warn!(
                "training job {job}: DynPipe could not plan a re-partitioning (generation {generation}): {e}"
            ),
        }
    }
}

/// An action in a few words, for logs.
fn describe(a: &TrainAction) -> String {
    match a {
        TrainAction::Send {
            job,
            phase,
            requests,
            ..
        } => format!(
            "{} {} requests of job {job}",
            requests.len(),
            phase.request()
        ),
        TrainAction::Plan(i) => format!("the re-partitioning plan of job {}", i.job),
        TrainAction::Free { job, extents } => format!(
            "freeing {} extents of job {job}'s abandoned checkpoint parts (they stay allocated)",
            extents.len()
        ),
    }
}

/// A runtime reply's kind, for errors.
fn reply_name(r: &RuntimeReply) -> &'static str {
    match r {
        RuntimeReply::Output { .. } => "Output",
        RuntimeReply::Prefetched { .. } => "Prefetched",
        RuntimeReply::Training { .. } => "Training",
        RuntimeReply::TrainStageReady { .. } => "TrainStageReady (of another worker)",
        RuntimeReply::TrainStageStarted { .. } => "TrainStageStarted (of another worker)",
        RuntimeReply::Stats { .. } => "Stats",
        RuntimeReply::Evicted { .. } => "Evicted",
        RuntimeReply::Error { .. } => "Error",
    }
}

fn log_stage_requests(job: &str, what: &str, reqs: &[StageRequest]) {
    log::info!(
        "training job {job}: {} {what} requests to {} GPU servers",
        reqs.len(),
        reqs.iter()
            .map(|r| r.runtime)
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    );
    for r in reqs {
        log::debug!(
            "training job {job}: to runtime {} ({}): {:?}",
            r.runtime,
            r.addr,
            r.request
        );
    }
}

/// Where a deque of actions is kept (the state's field type).
pub(super) type TrainActions = VecDeque<TrainAction>;

#[cfg(test)]
#[path = "train_tests.rs"]
mod tests;
