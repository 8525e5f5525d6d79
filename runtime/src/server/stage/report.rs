//! A stage worker's own connections to the controller: reports (and the
//! failure notice) on one, bounded by [`CONTROLLER_TIMEOUT`]; sync-group
//! requests on another, bounded by [`GROUP_TIMEOUT`], since the group
//! scheduler answers only when the group closes. Each is opened when
//! first needed; after an error the next call opens a fresh one.

use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{
    ControllerReply, ControllerRequest, DrainOrder, GroupLocation, Location, TrainJobState,
};
use distmind_controller::{ClientError, ControllerClient};

use super::error::{At, StageError};
use super::{CONTROLLER_TIMEOUT, GROUP_TIMEOUT};

/// The group a `TrainGroupReady` got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyncGroup {
    /// Pipelines whose replicas of this stage average now, sorted.
    pub members: Vec<u32>,
    /// The job ends: do not average.
    pub stop: bool,
}

pub(crate) struct Reporter {
    controller: String,
    key: ClusterKey,
    job: String,
    generation: u64,
    pipeline: u32,
    stage: u32,
    reports: Option<ControllerClient>,
    groups: Option<ControllerClient>,
}

impl Reporter {
    pub fn new(
        controller: String,
        key: ClusterKey,
        job: String,
        generation: u64,
        pipeline: u32,
        stage: u32,
    ) -> Self {
        Reporter {
            controller,
            key,
            job,
            generation,
            pipeline,
            stage,
            reports: None,
            groups: None,
        }
    }

    fn call(
        &self,
        slot: &mut Option<ControllerClient>,
        timeout: std::time::Duration,
        req: &ControllerRequest,
    ) -> Result<ControllerReply, ClientError> {
        if slot.is_none() {
            *slot = Some(ControllerClient::connect(
                &self.controller,
                &self.key,
                timeout,
            )?);
        }
        let client = slot.as_mut().expect("connected above");
        let reply = client.request(req);
        if reply.is_err() {
            // A refusal keeps the connection usable, anything else does
            // not: open a fresh one next time either way.
            *slot = None;
        }
        reply
    }

    fn err(&self, at: &At, what: &'static str) -> impl Fn(ClientError) -> StageError + '_ {
        let at = at.clone();
        move |source| StageError::Controller {
            at: at.clone(),
            what,
            controller: self.controller.clone(),
            source: Box::new(source),
        }
    }

    /// Reports `iteration` (iterations completed); whether to stop, the
    /// job's state and a re-partitioning's drain order.
    pub fn report(
        &mut self,
        at: &At,
        iteration: u64,
        fwd_bwd_s: f64,
        loss: Option<f64>,
        samples: u64,
    ) -> Result<(bool, TrainJobState, Option<DrainOrder>), StageError> {
        let req = ControllerRequest::TrainReport {
            job: self.job.clone(),
            pipeline: self.pipeline,
            stage: self.stage,
            iteration,
            fwd_bwd_s,
            loss,
            samples,
        };
        let mut slot = self.reports.take();
        let reply = self.call(&mut slot, CONTROLLER_TIMEOUT, &req);
        self.reports = slot;
        match reply.map_err(self.err(at, "the iteration report"))? {
            ControllerReply::TrainReported {
                stop, state, drain, ..
            } => Ok((stop, state, drain)),
            other => Err(self.err(at, "the iteration report")(
                ClientError::UnexpectedReply {
                    addr: self.controller.clone(),
                    request: "train_report",
                    reply: format!("{other:?}"),
                },
            )),
        }
    }

    /// Tells the controller this worker wrote its part of checkpoint
    /// `model` after `iteration` iterations; the job's state, and the
    /// extents of a replaced periodic checkpoint this worker is to free.
    pub fn checkpointed(
        &mut self,
        at: &At,
        iteration: u64,
        model: &str,
        group: GroupLocation,
        layer_checksums: Vec<u64>,
    ) -> Result<(TrainJobState, Vec<Location>), StageError> {
        let req = ControllerRequest::TrainCheckpointed {
            job: self.job.clone(),
            generation: self.generation,
            pipeline: self.pipeline,
            stage: self.stage,
            iteration,
            model: model.to_string(),
            group,
            layer_checksums,
        };
        let mut slot = self.reports.take();
        let reply = self.call(&mut slot, CONTROLLER_TIMEOUT, &req);
        self.reports = slot;
        match reply.map_err(self.err(at, "the checkpoint notice"))? {
            ControllerReply::TrainReported { state, free, .. } => Ok((state, free)),
            other => Err(self.err(at, "the checkpoint notice")(
                ClientError::UnexpectedReply {
                    addr: self.controller.clone(),
                    request: "train_checkpointed",
                    reply: format!("{other:?}"),
                },
            )),
        }
    }

    /// Asks with whom to average after `iteration` (iterations completed).
    pub fn group(&mut self, at: &At, iteration: u64) -> Result<SyncGroup, StageError> {
        let req = ControllerRequest::TrainGroupReady {
            job: self.job.clone(),
            generation: self.generation,
            pipeline: self.pipeline,
            stage: self.stage,
            iteration,
        };
        let mut slot = self.groups.take();
        let reply = self.call(&mut slot, GROUP_TIMEOUT, &req);
        self.groups = slot;
        match reply.map_err(self.err(at, "the sync-group request"))? {
            ControllerReply::TrainGroup { members, stop, .. } => Ok(SyncGroup { members, stop }),
            other => Err(self.err(at, "the sync-group request")(
                ClientError::UnexpectedReply {
                    addr: self.controller.clone(),
                    request: "train_group_ready",
                    reply: format!("{other:?}"),
                },
            )),
        }
    }

    /// Tells the controller this worker cannot go on; best effort (a
    /// controller that cannot be reached learns it from the runtime's
    /// heartbeats and the neighbours' failures).
    pub fn failed(&mut self, reason: &str) {
        let req = ControllerRequest::TrainFailed {
            job: self.job.clone(),
            pipeline: self.pipeline,
            stage: self.stage,
            reason: reason.to_string(),
        };
        let mut slot = self.reports.take();
        match self.call(&mut slot, CONTROLLER_TIMEOUT, &req) {
            Ok(_) => {}
            Err(e) => log::warn!(
                "job {} pipeline {} stage {}: could not tell the controller at {} that the \
                 worker failed ({reason}): {e}",
                self.job,
                self.pipeline,
                self.stage,
                self.controller
            ),
        }
        self.reports = slot;
    }
}
