//! Training jobs in the controller's state: submit (checked against the
//! catalog), stop, placement of pending jobs on the live GPU servers, and
//! the hooks where stage-worker requests go to the runtimes.

use std::time::Instant;

use distmind_common::proto::{ErrorCode, ErrorReply, TrainJobStatus};
use distmind_common::train_spec::JobSpec;

use super::ControllerState;
use crate::jobs::{self, placement, JobError, StageRequest};

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
        let placed = self.jobs.get(id).is_some_and(|j| !j.placement().is_empty());
        let state = self.jobs.stop(id, now)?;
        if placed {
            self.stop_stage_workers(id);
        }
        if state.is_terminal() {
            self.place_pending(now);
        }
        Ok(self.job_status(id, now))
    }

    fn job_status(&self, id: &str, now: Instant) -> TrainJobStatus {
        self.jobs
            .status(Some(id), now)
            .ok()
            .and_then(|mut v| v.pop())
            .expect("the job was just registered or changed")
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

    /// HOOK: where a placed job's `TrainStage` requests go to the GPU
    /// servers. The runtime side of stage workers is not built yet, so they
    /// are logged, not sent; returns exactly what would be sent (one per
    /// stage worker, to the runtime that hosts it).
    pub fn start_stage_workers(&mut self, id: &str) -> Vec<StageRequest> {
        let Some(n) = self.jobs.get(id).map(|j| j.placement().len()) else {
            return Vec::new();
        };
        let first = self.take_request_ids(n);
        let job = self.jobs.get(id).expect("looked up above");
        let reqs = jobs::start_requests(job, first);
        log_stage_requests(id, "TrainStage", &reqs);
        reqs
    }

    /// HOOK: where a job's `TrainStageStop` requests go to the GPU servers
    /// (logged, not sent, as [`start_stage_workers`](Self::start_stage_workers)).
    pub fn stop_stage_workers(&mut self, id: &str) -> Vec<StageRequest> {
        let Some(n) = self.jobs.get(id).map(|j| j.placement().len()) else {
            return Vec::new();
        };
        let first = self.take_request_ids(n);
        let job = self.jobs.get(id).expect("looked up above");
        let reqs = jobs::stop_requests(job, first);
        log_stage_requests(id, "TrainStageStop", &reqs);
        reqs
    }
}

fn log_stage_requests(job: &str, what: &str, reqs: &[StageRequest]) {
    if reqs.is_empty() {
        return;
    }
    log::info!(
        "training job {job}: {} {what} requests for {} GPU servers are ready; not sent: \
         the GPU servers' stage workers are not built yet",
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use distmind_common::proto::{ControllerReply, ControllerRequest, TrainJobState};

    use super::super::tests::{register, reply};
    use super::*;
    use crate::catalog::tests::entry;
    use crate::state::STAGE_REQUEST_ID_BASE;

    /// A state with three memory servers, model `m` of `layers` layers and
    /// a runtime of `devices` devices registered at `t0`; returns its id.
    fn with_model_and_runtime(t0: Instant, layers: usize, devices: u32) -> (ControllerState, u32) {
        let mut s = ControllerState::new(Duration::from_millis(100));
        for i in 0..3 {
            register(&mut s, i, 1, t0);
        }
        let mut e = entry("m", 1);
        e.manifest = serde_json::json!({ "layers": vec![serde_json::json!({}); layers] });
        let put = ControllerRequest::PutModel { entry: Box::new(e) };
        assert!(matches!(
            reply(&mut s, put, t0),
            ControllerReply::Put { .. }
        ));
        let req = ControllerRequest::RegisterRuntime {
            addr: "127.0.0.1:10009".into(),
            devices,
            executor: "sim".into(),
            boot_id: 4,
            device_ids: Vec::new(),
            cache_bytes: 0,
            device_bytes: 0,
            resident_models_max: 0,
        };
        match reply(&mut s, req, t0) {
            ControllerReply::RuntimeRegistered { runtime, .. } => (s, runtime),
            r => panic!("{r:?}"),
        }
    }

    fn job_spec(name: &str, pipelines: u32, stages: u32, extra: &str) -> Box<JobSpec> {
        Box::new(
            JobSpec::from_json(&format!(
                r#"{{"name": "{name}", "model": "m", "optimizer": {{"sgd": {{"lr": 0.1}}}},
                    "batch": 4, "microbatches": 2, "pipelines": {pipelines}, "stages": {stages},
                    "iterations": 2 {extra}}}"#
            ))
            .unwrap(),
        )
    }

    fn refusal(s: &mut ControllerState, spec: Box<JobSpec>, t: Instant) -> ErrorReply {
        match reply(s, ControllerRequest::TrainSubmit { spec }, t) {
            ControllerReply::Error(e) => e,
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn training_jobs_are_checked_placed_reported_and_stopped() {
        let t0 = Instant::now();
        let (mut s, rt) = with_model_and_runtime(t0, 10, 2);
        // Refused, naming the field: against the catalog and on their own.
        let e = refusal(&mut s, job_spec("a", 1, 2, r#", "partition": [3, 3]"#), t0);
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(
            e.message
                .contains("partition = [3, 3] (sum 6): must sum to the model's 10 layers"),
            "{e}"
        );
        let mut unknown = job_spec("a", 1, 2, "");
        unknown.model = "nope".into();
        let e = refusal(&mut s, unknown, t0);
        assert_eq!(e.code, ErrorCode::UnknownModel);
        assert!(
            e.message.contains("model = \"nope\": not in the catalog"),
            "{e}"
        );
        let mut big = job_spec("a", 1, 2, "");
        big.pipelines = 64;
        big.stages = 16;
        big.microbatches = 16;
        big.batch = 16;
        let e = refusal(&mut s, big, t0);
        assert!(
            e.message.contains("pipelines x stages = 64 x 16 = 1024"),
            "{e}"
        );

        // Fits the runtime's two devices: placed at once.
        let job = match reply(
            &mut s,
            ControllerRequest::TrainSubmit {
                spec: job_spec("a", 1, 2, ""),
            },
            t0,
        ) {
            ControllerReply::TrainSubmitted { job } => job,
            r => panic!("{r:?}"),
        };
        assert_eq!(
            (job.id.as_str(), &job.state),
            ("a-1", &TrainJobState::Placing)
        );
        assert_eq!(job.partition, vec![5, 5]);
        let at: Vec<_> = job
            .stages
            .iter()
            .map(|st| st.placement.as_ref().map(|p| (p.runtime, p.device)))
            .collect();
        assert_eq!(at, vec![Some((rt, 0)), Some((rt, 1))]);
        // The hook returns the exact requests, ids in their own range.
        let reqs = s.start_stage_workers("a-1");
        assert_eq!(reqs.len(), 2);
        assert!(reqs
            .iter()
            .all(|r| r.addr == "127.0.0.1:10009" && r.runtime == rt));
        match &reqs[0].request {
            distmind_common::proto::RuntimeRequest::TrainStage { id, assignment } => {
                assert!(*id >= STAGE_REQUEST_ID_BASE);
                assert_eq!((assignment.stage, assignment.layers.end), (0, 5));
            }
            r => panic!("{r:?}"),
        }

        // No device is left: the next job waits, saying why.
        let job = match reply(
            &mut s,
            ControllerRequest::TrainSubmit {
                spec: job_spec("b", 1, 1, ""),
            },
            t0,
        ) {
            ControllerReply::TrainSubmitted { job } => job,
            r => panic!("{r:?}"),
        };
        assert_eq!(job.state, TrainJobState::Pending);
        assert!(
            job.waiting
                .as_deref()
                .unwrap()
                .starts_with("needs 1 GPUs (1 pipelines x 1 stages) and 0 are free"),
            "{job:?}"
        );

        // Reports, then a stop heard by the next report.
        let report = |pipeline, stage, iteration| ControllerRequest::TrainReport {
            job: "a-1".into(),
            pipeline,
            stage,
            iteration,
            fwd_bwd_s: 0.1,
            loss: None,
            samples: 4,
        };
        reply(&mut s, report(0, 0, 1), t0);
        match reply(&mut s, report(0, 1, 1), t0) {
            ControllerReply::TrainReported { state, stop, .. } => {
                assert_eq!((state, stop), (TrainJobState::Running, false))
            }
            r => panic!("{r:?}"),
        }
        match reply(
            &mut s,
            ControllerRequest::TrainStop { job: "a-1".into() },
            t0,
        ) {
            ControllerReply::TrainStopped { job } => assert_eq!(job.state, TrainJobState::Stopping),
            r => panic!("{r:?}"),
        }
        reply(&mut s, report(0, 0, 2), t0);
        match reply(&mut s, report(0, 1, 2), t0) {
            ControllerReply::TrainReported { state, stop, .. } => {
                assert_eq!((state, stop), (TrainJobState::Stopped, true))
            }
            r => panic!("{r:?}"),
        }
        // Its devices went to the waiting job.
        match reply(&mut s, ControllerRequest::TrainStatus { job: None }, t0) {
            ControllerReply::TrainJobs { jobs } => {
                let states: Vec<_> = jobs
                    .iter()
                    .map(|j| (j.id.as_str(), j.state.name()))
                    .collect();
                assert_eq!(states, vec![("a-1", "stopped"), ("b-2", "placing")]);
            }
            r => panic!("{r:?}"),
        }
        match reply(
            &mut s,
            ControllerRequest::TrainStatus {
                job: Some("zz-9".into()),
            },
            t0,
        ) {
            ControllerReply::Error(e) => {
                assert!(e.message.contains("no training job \"zz-9\""), "{e}")
            }
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn a_silent_gpu_server_fails_its_training_jobs() {
        let t0 = Instant::now();
        let (mut s, rt) = with_model_and_runtime(t0, 10, 1);
        let spec = job_spec("a", 1, 1, "");
        assert!(matches!(
            reply(&mut s, ControllerRequest::TrainSubmit { spec }, t0),
            ControllerReply::TrainSubmitted { .. }
        ));
        s.expire(t0 + Duration::from_millis(301));
        match s.jobs().get("a-1").unwrap().state() {
            TrainJobState::Failed {
                pipeline: 0,
                stage: 0,
                reason,
            } => assert!(
                reason.starts_with(&format!(
                    "its GPU server, runtime {rt} (127.0.0.1:10009), device 0: no heartbeat for more than"
                )),
                "{reason}"
            ),
            st => panic!("{st:?}"),
        }
    }
}
