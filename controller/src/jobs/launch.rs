//! Starting a placed job's stage workers on their GPU servers, in two
//! steps, and telling them to stop; the controller's driver
//! (`crate::driver`) sends the requests, this keeps where each worker is.
//!
//! 1. Every worker gets its `TrainStage`; it loads its layers, binds its
//!    data listener and answers `TrainStageReady` with the listener's
//!    address.
//! 2. Once every worker is ready, each gets its `TrainStageStart` with its
//!    neighbours' and replicas' data addresses
//!    ([`super::start_link_requests`]); it connects its links and answers
//!    `TrainStageStarted`. When all have, the job runs (`placing ->
//!    running`, unless every stage's report got there first).
//!
//! A refusal, a wrong answer or no answer in time fails the job naming the
//! worker and why ([`JobRegistry::stage_refused`]). A stop or a failure
//! sends `TrainStageStop` once to every worker that was sent its
//! `TrainStage` ([`JobRegistry::take_stop_requests`]); a runtime's answer
//! to it counts as the worker having heard the stop. Pure, like the
//! registry: answers in, what to send next out.

use std::collections::BTreeSet;
use std::time::Instant;

use distmind_common::limits::NAME_BYTES_MAX;
use distmind_common::proto::TrainJobState;

use super::requests::{stop_requests_where, StageRequest};
use super::{Event, JobError, JobRegistry};

/// Where one stage worker is in its start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Launch {
    /// Nothing sent yet.
    #[default]
    NotSent,
    /// Its `TrainStage` went out.
    Sent,
    /// It answered `TrainStageReady`: its data listener's address.
    Ready { data_addr: String },
    /// Its `TrainStageStart` went out.
    StartSent { data_addr: String },
    /// It answered `TrainStageStarted`.
    Started { data_addr: String },
    /// It refused or did not answer: it runs nothing.
    Refused,
}

impl Launch {
    /// It may run something (it was sent its `TrainStage` and did not
    /// refuse): a stop goes to it.
    pub fn launched(&self) -> bool {
        !matches!(self, Launch::NotSent | Launch::Refused)
    }

    /// Its data listener, once it answered ready.
    pub fn data_addr(&self) -> Option<&str> {
        match self {
            Launch::Ready { data_addr }
            | Launch::StartSent { data_addr }
            | Launch::Started { data_addr } => Some(data_addr),
            _ => None,
        }
    }
}

/// What an answer leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchStep {
    /// Other workers have not answered yet.
    Wait,
    /// Every worker is ready: send each its `TrainStageStart`.
    AllReady,
    /// Every worker started.
    AllStarted,
    /// For another generation, or the job is past starting: dropped.
    Stale,
}

impl JobRegistry {
    /// Every worker of `id` was sent its `TrainStage`.
    pub fn launch_sent(&mut self, id: &str) -> Result<(), JobError> {
        let job = self.get_mut(id)?;
        for s in &mut job.stages {
            s.launch = Launch::Sent;
            s.stop_sent = false;
        }
        Ok(())
    }

    /// Every ready worker of `id` was sent its `TrainStageStart`.
    pub fn start_sent(&mut self, id: &str) -> Result<(), JobError> {
        let job = self.get_mut(id)?;
        for s in &mut job.stages {
            if let Launch::Ready { data_addr } = &s.launch {
                s.launch = Launch::StartSent {
                    data_addr: data_addr.clone(),
                };
            }
        }
        Ok(())
    }

    /// Worker (`pipeline`, `stage`) of `generation` answered
    /// `TrainStageReady` with `data_addr` and its loaded layers'
    /// checksums.
    #[allow(clippy::too_many_arguments)]
    pub fn stage_ready(
        &mut self,
        id: &str,
        generation: u64,
        pipeline: u32,
        stage: u32,
        data_addr: &str,
        layer_checksums: &[u64],
        now: Instant,
    ) -> Result<LaunchStep, JobError> {
        let job = self.get_mut(id)?;
        let i = job.check_stage(pipeline, stage)?;
        if generation != job.generation || !job.starting() || job.stages[i].launch != Launch::Sent {
            return Ok(LaunchStep::Stale);
        }
        if data_addr.is_empty() || data_addr.len() > NAME_BYTES_MAX {
            let reason = format!(
                "answered TrainStageReady with a data address of {} bytes (1..={NAME_BYTES_MAX}); \
                 the GPU server's stage worker is broken",
                data_addr.len()
            );
            return self.stage_refused(id, generation, pipeline, stage, &reason, now);
        }
        job.stages[i].launch = Launch::Ready {
            data_addr: data_addr.to_string(),
        };
        job.stages[i].loaded = Some(layer_checksums.to_vec());
        if job.state == TrainJobState::Repartitioning {
            JobRegistry::note_loaded(job);
        }
        Ok(
            if job
                .stages
                .iter()
                .all(|s| matches!(s.launch, Launch::Ready { .. }))
            {
                LaunchStep::AllReady
            } else {
                LaunchStep::Wait
            },
        )
    }

    /// Worker (`pipeline`, `stage`) of `generation` answered
    /// `TrainStageStarted`; the last one moves the job to running.
    pub fn stage_started(
        &mut self,
        id: &str,
        generation: u64,
        pipeline: u32,
        stage: u32,
        now: Instant,
    ) -> Result<LaunchStep, JobError> {
        let job = self.get_mut(id)?;
        let i = job.check_stage(pipeline, stage)?;
        let Launch::StartSent { data_addr } = &job.stages[i].launch else {
            return Ok(LaunchStep::Stale);
        };
        if generation != job.generation || !(job.starting() || job.state == TrainJobState::Running)
        {
            return Ok(LaunchStep::Stale);
        }
        job.stages[i].launch = Launch::Started {
            data_addr: data_addr.clone(),
        };
        if !job
            .stages
            .iter()
            .all(|s| matches!(s.launch, Launch::Started { .. }))
        {
            return Ok(LaunchStep::Wait);
        }
        if job.state == TrainJobState::Placing {
            job.go(Event::AllStarted, TrainJobState::Running, now)?;
        } else if job.state == TrainJobState::Repartitioning {
            JobRegistry::repartitioned(job, now)?;
        }
        Ok(LaunchStep::AllStarted)
    }

    /// Worker (`pipeline`, `stage`) of `generation` refused its start, gave
    /// a wrong answer or none in time (`reason` says which, naming its
    /// runtime): the job fails naming it. Returns [`LaunchStep::Stale`] when
    /// the answer no longer matters.
    pub fn stage_refused(
        &mut self,
        id: &str,
        generation: u64,
        pipeline: u32,
        stage: u32,
        reason: &str,
        now: Instant,
    ) -> Result<LaunchStep, JobError> {
        let job = self.get_mut(id)?;
        let i = job.check_stage(pipeline, stage)?;
        if generation != job.generation || !job.stages[i].launch.launched() {
            return Ok(LaunchStep::Stale);
        }
        job.stages[i].launch = Launch::Refused;
        if job.state.is_terminal() {
            return Ok(LaunchStep::Stale);
        }
        self.fail(id, pipeline, stage, reason, now)?;
        Ok(LaunchStep::Wait)
    }

    /// The `TrainStageStop` of every worker of `id` that was sent its
    /// `TrainStage`, did not refuse and was not told to stop yet, except
    /// those on `except_runtime` (lost: nothing reaches it); ids from
    /// `first_id`. Marks them told.
    pub fn take_stop_requests(
        &mut self,
        id: &str,
        first_id: u64,
        except_runtime: Option<u32>,
    ) -> Vec<StageRequest> {
        let Ok(job) = self.get_mut(id) else {
            return Vec::new();
        };
        let reqs = stop_requests_where(job, first_id, |i| {
            let s = &job.stages[i];
            s.launch.launched() && !s.stop_sent && Some(job.placement[i].runtime) != except_runtime
        });
        for r in &reqs {
            let i = job.index(r.pipeline, r.stage);
            job.stages[i].stop_sent = true;
        }
        reqs
    }

    /// The runtime answered worker (`pipeline`, `stage`)'s
    /// `TrainStageStop`: it heard the stop.
    pub fn stop_acknowledged(
        &mut self,
        id: &str,
        generation: u64,
        pipeline: u32,
        stage: u32,
        now: Instant,
    ) {
        let Ok(job) = self.get_mut(id) else {
            return;
        };
        let Ok(i) = job.check_stage(pipeline, stage) else {
            return;
        };
        if generation == job.generation && job.state == TrainJobState::Stopping {
            job.stages[i].stopped = true;
            job.maybe_stopped(now);
        }
    }

    /// The runtimes that host a launched worker of an unended job: the
    /// ones the driver keeps a stage link to.
    pub fn runtimes_in_use(&self) -> BTreeSet<u32> {
        self.jobs
            .values()
            .filter(|j| !j.state.is_terminal())
            .flat_map(|j| {
                j.stages
                    .iter()
                    .zip(&j.placement)
                    .filter(|(s, _)| s.launch.launched())
                    .map(|(_, p)| p.runtime)
            })
            .collect()
    }
}

impl JobRegistry {
    /// Every unended job with a worker on `runtime`, and the pipelines of
    /// those workers.
    pub fn pipelines_on(&self, runtime: u32) -> Vec<(String, BTreeSet<u32>)> {
        self.jobs
            .values()
            .filter(|j| j.holds_devices())
            .filter_map(|j| {
                let pipelines: BTreeSet<u32> = j
                    .placement
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.runtime == runtime)
                    .map(|(i, _)| i as u32 / j.spec.stages)
                    .collect();
                (!pipelines.is_empty()).then(|| (j.id.clone(), pipelines))
            })
            .collect()
    }
}
