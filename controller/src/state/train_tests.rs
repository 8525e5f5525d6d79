//! Training jobs through `ControllerState::apply` on a virtual clock: the
//! requests the driver is given at every step of a job's life, the answers
//! it brings back, the sync groups (deferred replies) and DynPipe's
//! decision path from reports to `train status`.

use std::time::Duration;

use distmind_common::proto::{
    ControllerReply, ControllerRequest, DataPeer, ErrorCode, RuntimeRequest, Slice, TrainJobState,
};
use distmind_models::graph::Dtype;
use distmind_models::{Family, Manifest, ParamDtype, ParamEntry, Scale};

use super::super::tests::{register, reply};
use super::*;
use crate::catalog::tests::entry;
use crate::state::STAGE_REQUEST_ID_BASE;

const MS: Duration = Duration::from_millis(1);

/// A manifest of `family`'s tiny architecture (what the controller reads:
/// layers, params, inputs), as a catalog entry holds it.
fn manifest(family: Family) -> serde_json::Value {
    let config = family.config(Scale::Tiny);
    let arch = config.build();
    let m = Manifest {
        format_version: 1,
        name: "m".into(),
        family,
        scale: Some(Scale::Tiny),
        seed: Some(0),
        origin: None,
        config,
        inputs: arch.inputs.clone(),
        outputs: arch.outputs.clone(),
        param_dtype: ParamDtype::F32,
        group_bytes: 0,
        alignment: 512,
        learnable_param_count: 0,
        stored_bytes: 0,
        layers: arch.layers.clone(),
        params: arch
            .params
            .iter()
            .map(|p| ParamEntry {
                name: p.name.clone(),
                shape: p.shape.clone(),
                dtype: Dtype::F32,
                layer: 0,
                group: 0,
                offset: 0,
                nbytes: 0,
                learnable: p.learnable,
            })
            .collect(),
        groups: Vec::new(),
    };
    serde_json::to_value(&m).unwrap()
}

fn register_runtime(s: &mut ControllerState, port: u16, devices: u32, t: Instant) -> u32 {
    let req = ControllerRequest::RegisterRuntime {
        addr: format!("127.0.0.1:{port}"),
        devices,
        executor: "sim".into(),
        boot_id: 4,
        device_ids: Vec::new(),
        cache_bytes: 0,
        device_bytes: 0,
        resident_models_max: 0,
    };
    match reply(s, req, t) {
        ControllerReply::RuntimeRegistered { runtime, .. } => runtime,
        r => panic!("{r:?}"),
    }
}

/// A state with three memory servers, model `m` (`manifest`) and a runtime
/// of `devices` devices registered at `t0`; returns its id.
fn with_model(t0: Instant, manifest: serde_json::Value, devices: u32) -> (ControllerState, u32) {
    let mut s = ControllerState::new(Duration::from_millis(100));
    for i in 0..3 {
        register(&mut s, i, 1, t0);
    }
    let mut e = entry("m", 1);
    e.manifest = manifest;
    let put = ControllerRequest::PutModel { entry: Box::new(e) };
    assert!(matches!(
        reply(&mut s, put, t0),
        ControllerReply::Put { .. }
    ));
    let rt = register_runtime(&mut s, 10009, devices, t0);
    (s, rt)
}

fn with_model_and_runtime(t0: Instant, layers: usize, devices: u32) -> (ControllerState, u32) {
    with_model(
        t0,
        serde_json::json!({ "layers": vec![serde_json::json!({}); layers] }),
        devices,
    )
}

fn job_spec(name: &str, pipelines: u32, stages: u32, extra: &str) -> Box<JobSpec> {
    Box::new(
        JobSpec::from_json(&format!(
            r#"{{"name": "{name}", "model": "m", "optimizer": {{"sgd": {{"lr": 0.1}}}},
                "batch": 4, "microbatches": 2, "pipelines": {pipelines}, "stages": {stages},
                "iterations": 100 {extra}}}"#
        ))
        .unwrap(),
    )
}

fn submit(s: &mut ControllerState, spec: Box<JobSpec>, t: Instant) -> TrainJobStatus {
    match reply(s, ControllerRequest::TrainSubmit { spec }, t) {
        ControllerReply::TrainSubmitted { job } => *job,
        r => panic!("{r:?}"),
    }
}

fn refusal(s: &mut ControllerState, spec: Box<JobSpec>, t: Instant) -> ErrorReply {
    match reply(s, ControllerRequest::TrainSubmit { spec }, t) {
        ControllerReply::Error(e) => e,
        r => panic!("{r:?}"),
    }
}

/// The one `Send` action queued, as (phase, requests).
fn one_send(s: &mut ControllerState) -> (StagePhase, Vec<StageRequest>) {
    let mut a = s.take_train_actions();
    assert_eq!(a.len(), 1, "{a:?}");
    match a.pop().unwrap() {
        TrainAction::Send {
            phase, requests, ..
        } => (phase, requests),
        a => panic!("{a:?}"),
    }
}

fn answer(
    r: &StageRequest,
    job: &str,
    phase: StagePhase,
    reply: Result<RuntimeReply, String>,
) -> StageAnswer {
    StageAnswer {
        job: job.to_string(),
        generation: 0,
        phase,
        pipeline: r.pipeline,
        stage: r.stage,
        runtime: r.runtime,
        reply,
    }
}

fn ready(r: &StageRequest, job: &str) -> StageAnswer {
    let reply = RuntimeReply::TrainStageReady {
        id: 1,
        job: job.to_string(),
        generation: 0,
        pipeline: r.pipeline,
        stage: r.stage,
        data_addr: format!("10.0.0.9:{}", 40000 + r.pipeline * 10 + r.stage),
        layer_checksums: Vec::new(),
    };
    answer(r, job, StagePhase::Setup, Ok(reply))
}

fn started(r: &StageRequest, job: &str) -> StageAnswer {
    let reply = RuntimeReply::TrainStageStarted {
        id: 1,
        job: job.to_string(),
        generation: 0,
        pipeline: r.pipeline,
        stage: r.stage,
    };
    answer(r, job, StagePhase::Start, Ok(reply))
}

fn state_of(s: &ControllerState, id: &str) -> TrainJobState {
    s.jobs().get(id).unwrap().state().clone()
}

/// Submits a P x S job and answers its whole two-step start: running.
fn running(
    s: &mut ControllerState,
    name: &str,
    p: u32,
    st: u32,
    extra: &str,
    t: Instant,
) -> String {
    let id = submit(s, job_spec(name, p, st, extra), t).id;
    let (_, setup) = one_send(s);
    for r in &setup {
        s.stage_answered(ready(r, &id), t);
    }
    let (_, start) = one_send(s);
    for r in &start {
        s.stage_answered(started(r, &id), t);
    }
    assert_eq!(state_of(s, &id), TrainJobState::Running);
    id
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
    // DynPipe's monitor needs its baseline at a window's end.
    let e = refusal(
        &mut s,
        job_spec(
            "a",
            1,
            2,
            r#", "dynamic": {"enabled": true, "window": 40, "baseline_at": 100}"#,
        ),
        t0,
    );
    assert!(
        e.message
            .contains("dynamic.baseline_at = 100: must be a multiple of dynamic.window = 40"),
        "{e}"
    );
    assert!(s.take_train_actions().is_empty(), "nothing was placed");

    // Fits the runtime's two devices: placed at once, and the driver is
    // given every worker's TrainStage.
    let job = submit(&mut s, job_spec("a", 1, 2, ""), t0);
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
    let (phase, reqs) = one_send(&mut s);
    assert_eq!(phase, StagePhase::Setup);
    assert_eq!(reqs.len(), 2);
    assert!(reqs
        .iter()
        .all(|r| r.addr == "127.0.0.1:10009" && r.runtime == rt));
    match &reqs[0].request {
        RuntimeRequest::TrainStage { id, assignment } => {
            assert!(*id >= STAGE_REQUEST_ID_BASE);
            assert_eq!((assignment.stage, assignment.layers.end), (0, 5));
        }
        r => panic!("{r:?}"),
    }
    assert_eq!(s.training_runtimes(), BTreeSet::from([rt]));

    // No device is left: the next job waits, saying why.
    let job = submit(&mut s, job_spec("b", 1, 1, ""), t0);
    assert_eq!(job.state, TrainJobState::Pending);
    assert!(
        job.waiting
            .as_deref()
            .unwrap()
            .starts_with("needs 1 GPUs (1 pipelines x 1 stages) and 0 are free"),
        "{job:?}"
    );

    // Reports (workers may report before the driver heard them start),
    // then a stop heard by the next report.
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
    // Both workers were sent their TrainStage: both are told to stop, once.
    let (phase, stops) = one_send(&mut s);
    assert_eq!(phase, StagePhase::Stop);
    assert_eq!(stops.len(), 2);
    assert!(matches!(
        stops[1].request,
        RuntimeRequest::TrainStageStop { stage: 1, .. }
    ));
    reply(&mut s, report(0, 0, 2), t0);
    // The runtime's answer to a stop counts as heard.
    let ack = RuntimeReply::Training {
        id: 1,
        device: 1,
        model: None,
        iterations: 2,
    };
    s.stage_answered(answer(&stops[1], "a-1", StagePhase::Stop, Ok(ack)), t0);
    assert_eq!(state_of(&s, "a-1"), TrainJobState::Stopped);
    // Its devices went to the waiting job, whose start goes out.
    let (phase, reqs) = one_send(&mut s);
    assert_eq!((phase, reqs.len()), (StagePhase::Setup, 1));
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
fn a_job_starts_in_two_steps_and_runs_when_every_worker_started() {
    let t0 = Instant::now();
    let (mut s, rt) = with_model_and_runtime(t0, 10, 4);
    let id = submit(&mut s, job_spec("a", 2, 2, ""), t0).id;
    let (_, setup) = one_send(&mut s);
    assert_eq!(setup.len(), 4);
    for r in &setup[..3] {
        s.stage_answered(ready(r, &id), t0);
        assert!(s.take_train_actions().is_empty(), "waits for every worker");
    }
    // A late answer of another generation, or a duplicate, changes nothing.
    let mut stale = ready(&setup[3], &id);
    stale.generation = 7;
    s.stage_answered(stale, t0);
    assert!(s.take_train_actions().is_empty());
    s.stage_answered(ready(&setup[3], &id), t0);
    let (phase, start) = one_send(&mut s);
    assert_eq!((phase, start.len()), (StagePhase::Start, 4));
    let addr = |p: u32, st: u32| format!("10.0.0.9:{}", 40000 + p * 10 + st);
    let peer = |p: u32, st: u32| DataPeer {
        pipeline: p,
        stage: st,
        worker: p * 2 + st,
        data_addr: addr(p, st),
    };
    for r in &start {
        assert_eq!(r.runtime, rt);
        let RuntimeRequest::TrainStageStart {
            id: rid,
            job,
            generation,
            pipeline,
            stage,
            prev,
            next,
            replicas,
        } = &r.request
        else {
            panic!("{r:?}");
        };
        assert!(*rid >= STAGE_REQUEST_ID_BASE);
        assert_eq!((job.as_str(), *generation), (id.as_str(), 0));
        let (p, st) = (*pipeline, *stage);
        assert_eq!(*prev, (st == 1).then(|| peer(p, 0)));
        assert_eq!(*next, (st == 0).then(|| peer(p, 1)));
        assert_eq!(*replicas, vec![peer(0, st), peer(1, st)]);
    }
    for r in &start[..3] {
        s.stage_answered(started(r, &id), t0);
    }
    assert_eq!(state_of(&s, &id), TrainJobState::Placing);
    s.stage_answered(started(&start[3], &id), t0 + MS);
    assert_eq!(state_of(&s, &id), TrainJobState::Running);
    assert!(s.take_train_actions().is_empty());
    // A stop: every started worker is told, and the job is stopped at once
    // (none reported).
    match reply(&mut s, ControllerRequest::TrainStop { job: id.clone() }, t0) {
        ControllerReply::TrainStopped { job } => assert_eq!(job.state, TrainJobState::Stopped),
        r => panic!("{r:?}"),
    }
    let (phase, stops) = one_send(&mut s);
    assert_eq!((phase, stops.len()), (StagePhase::Stop, 4));
    assert!(
        s.training_runtimes().is_empty(),
        "no link is needed any more"
    );
}

#[test]
fn a_refusal_fails_the_job_naming_the_stage_and_the_runtimes_reason() {
    let t0 = Instant::now();
    let (mut s, rt) = with_model_and_runtime(t0, 10, 4);
    let id = submit(&mut s, job_spec("a", 2, 2, ""), t0).id;
    let (_, setup) = one_send(&mut s);
    s.stage_answered(ready(&setup[0], &id), t0);
    // Today's GPU servers refuse stage workers.
    let refused = RuntimeReply::Error {
        id: 2,
        error: ErrorReply::new(
            ErrorCode::Unsupported,
            "this GPU server does not run training stage workers yet (job a-1 pipeline 0 stage 1)",
        ),
    };
    s.stage_answered(answer(&setup[1], &id, StagePhase::Setup, Ok(refused)), t0);
    match state_of(&s, &id) {
        TrainJobState::Failed {
            pipeline,
            stage,
            reason,
        } => {
            assert_eq!((pipeline, stage), (0, 1));
            assert_eq!(
                reason,
                format!(
                    "runtime {rt} (127.0.0.1:10009), device 1 refused its TrainStage: unsupported: \
                     this GPU server does not run training stage workers yet (job a-1 pipeline 0 stage 1); \
                     no checkpoint yet"
                )
            );
        }
        st => panic!("{st:?}"),
    }
    // The other three were sent their TrainStage: they are told to stop;
    // the refusing one runs nothing.
    let (phase, stops) = one_send(&mut s);
    assert_eq!(phase, StagePhase::Stop);
    let told: Vec<(u32, u32)> = stops.iter().map(|r| (r.pipeline, r.stage)).collect();
    assert_eq!(told, vec![(0, 0), (1, 0), (1, 1)]);
    // Later answers change nothing.
    s.stage_answered(ready(&setup[2], &id), t0);
    assert!(s.take_train_actions().is_empty());

    // No answer in time names the timeout.
    let id = submit(&mut s, job_spec("b", 1, 2, ""), t0).id;
    let (_, setup) = one_send(&mut s);
    let why = "no answer within 120s (STAGE_READY_TIMEOUT)".to_string();
    s.stage_answered(answer(&setup[0], &id, StagePhase::Setup, Err(why)), t0);
    match state_of(&s, &id) {
        TrainJobState::Failed { stage, reason, .. } => {
            assert_eq!(stage, 0);
            assert!(
                reason.ends_with(
                    "device 0: no TrainStageReady: no answer within 120s (STAGE_READY_TIMEOUT); \
                     no checkpoint yet"
                ),
                "{reason}"
            );
        }
        st => panic!("{st:?}"),
    }
    let (phase, stops) = one_send(&mut s);
    assert_eq!((phase, stops.len()), (StagePhase::Stop, 1), "its stage 1");
    // A wrong answer names what came.
    let id = submit(&mut s, job_spec("c", 1, 1, ""), t0).id;
    let (_, setup) = one_send(&mut s);
    let wrong = RuntimeReply::Training {
        id: 1,
        device: 0,
        model: Some("c-3".into()),
        iterations: 0,
    };
    s.stage_answered(answer(&setup[0], &id, StagePhase::Setup, Ok(wrong)), t0);
    match state_of(&s, &id) {
        TrainJobState::Failed { reason, .. } => {
            assert!(
                reason.contains("answered TrainStage with Training"),
                "{reason}"
            )
        }
        st => panic!("{st:?}"),
    }
}

#[test]
fn a_lost_stage_link_or_gpu_server_fails_its_jobs_and_stops_the_rest() {
    let t0 = Instant::now();
    let (mut s, rt0) = with_model_and_runtime(t0, 10, 2);
    let rt1 = register_runtime(&mut s, 10010, 2, t0);
    // Two pipelines of two stages: one per host.
    let id = running(&mut s, "a", 2, 2, "", t0);
    assert_eq!(s.training_runtimes(), BTreeSet::from([rt0, rt1]));
    s.stage_link_lost(rt1, "the runtime closed the connection", t0);
    match state_of(&s, &id) {
        TrainJobState::Failed {
            pipeline,
            stage,
            reason,
        } => {
            assert_eq!((pipeline, stage), (1, 0));
            assert_eq!(
                reason,
                format!(
                    "its GPU server, runtime {rt1} (127.0.0.1:10010), device 0: \
                     its stage link closed: the runtime closed the connection; no checkpoint yet"
                )
            );
        }
        st => panic!("{st:?}"),
    }
    // Only the workers still reachable are told to stop.
    let (phase, stops) = one_send(&mut s);
    assert_eq!(phase, StagePhase::Stop);
    assert!(stops.iter().all(|r| r.runtime == rt0), "{stops:?}");
    assert_eq!(stops.len(), 2);

    // A silent GPU server: the expiry sweep fails its jobs.
    let (mut s, rt) = with_model_and_runtime(t0, 10, 1);
    let id = running(&mut s, "b", 1, 1, "", t0);
    s.expire(t0 + Duration::from_millis(301));
    match state_of(&s, &id) {
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
    assert!(
        s.take_train_actions().is_empty(),
        "nothing is sent to a lost server"
    );
}

fn group_ask(job: &str, pipeline: u32, stage: u32, iteration: u64) -> ControllerRequest {
    ControllerRequest::TrainGroupReady {
        job: job.into(),
        generation: 0,
        pipeline,
        stage,
        iteration,
    }
}

/// (members, stop) of a group reply.
fn group(r: ControllerReply) -> (Vec<u32>, bool) {
    match r {
        ControllerReply::TrainGroup { members, stop, .. } => (members, stop),
        r => panic!("{r:?}"),
    }
}

#[test]
fn group_asks_are_answered_when_their_group_closes() {
    let t0 = Instant::now();
    let (mut s, _) = with_model_and_runtime(t0, 10, 6);
    // Pending jobs have no groups; unknown jobs and stages are named.
    let e = reply(&mut s, group_ask("zz-1", 0, 0, 1), t0);
    assert!(
        matches!(e, ControllerReply::Error(ref e) if e.message.contains("no training job \"zz-1\"")),
        "{e:?}"
    );

    // allreduce: every pipeline.
    let id = running(&mut s, "a", 3, 1, "", t0);
    let e = reply(&mut s, group_ask(&id, 3, 0, 1), t0);
    assert!(
        matches!(e, ControllerReply::Error(ref e) if e.message.contains("no pipeline 3 stage 0")),
        "{e:?}"
    );
    let mut p0 = s.apply(group_ask(&id, 0, 0, 1), t0);
    let mut p2 = s.apply(group_ask(&id, 2, 0, 1), t0 + MS);
    assert!(p0.try_reply().is_none() && p2.try_reply().is_none());
    assert_eq!(s.group_asks_waiting(&id), 2);
    match reply(
        &mut s,
        ControllerRequest::TrainStatus {
            job: Some(id.clone()),
        },
        t0,
    ) {
        ControllerReply::TrainJobs { jobs } => assert_eq!(jobs[0].group_asks_waiting, 2),
        r => panic!("{r:?}"),
    }
    // One ask per worker at a time.
    match reply(&mut s, group_ask(&id, 0, 0, 1), t0 + MS) {
        ControllerReply::Error(e) => assert!(e.message.contains("already waits"), "{e}"),
        r => panic!("{r:?}"),
    }
    let p1 = s.apply(group_ask(&id, 1, 0, 1), t0 + 2 * MS);
    for o in [
        p0.try_reply().unwrap(),
        p1.into_reply(),
        p2.try_reply().unwrap(),
    ] {
        assert_eq!(group(o), (vec![0, 1, 2], false));
    }
    assert_eq!(s.next_group_deadline(), None);

    // An asker that went away (the server dropped its reply) is replaced
    // by the same worker asking again.
    let gone = s.apply(group_ask(&id, 0, 0, 2), t0 + 3 * MS);
    assert_eq!(s.group_asks_waiting(&id), 1);
    drop(gone);
    assert_eq!(s.group_asks_waiting(&id), 0, "nobody listens");
    let mut again = s.apply(group_ask(&id, 0, 0, 2), t0 + 3 * MS);
    assert_eq!(s.group_asks_waiting(&id), 1);
    let p1 = s.apply(group_ask(&id, 1, 0, 2), t0 + 3 * MS);
    let p2 = s.apply(group_ask(&id, 2, 0, 2), t0 + 3 * MS);
    assert_eq!(group(again.try_reply().unwrap()), (vec![0, 1, 2], false));
    assert_eq!(group(p1.into_reply()), (vec![0, 1, 2], false));
    assert_eq!(group(p2.into_reply()), (vec![0, 1, 2], false));

    // A stop answers a waiting ask with stop, and later asks at once.
    let mut waiting = s.apply(group_ask(&id, 1, 0, 3), t0 + 3 * MS);
    assert!(waiting.try_reply().is_none());
    reply(
        &mut s,
        ControllerRequest::TrainStop { job: id.clone() },
        t0 + 4 * MS,
    );
    assert_eq!(group(waiting.try_reply().unwrap()), (vec![], true));
    assert_eq!(
        group(reply(&mut s, group_ask(&id, 0, 0, 3), t0 + 5 * MS)),
        (vec![], true)
    );
    assert_eq!(s.group_asks_waiting(&id), 0);
}

#[test]
fn a_partial_reduce_group_closes_at_its_deadline_on_the_controllers_clock() {
    let t0 = Instant::now();
    let (mut s, _) = with_model_and_runtime(t0, 10, 6);
    let id = running(
        &mut s,
        "p",
        3,
        2,
        r#", "sync": {"preduce": {"wait_ms_initial": 50}}"#,
        t0,
    );
    let mut p0 = s.apply(group_ask(&id, 0, 1, 1), t0 + 10 * MS);
    let mut p1 = s.apply(group_ask(&id, 1, 1, 1), t0 + 20 * MS);
    // The opener's wait from its ask: the server's timer sleeps until then.
    assert_eq!(s.next_group_deadline(), Some(t0 + 60 * MS));
    s.poll_groups(t0 + 59 * MS);
    assert!(p0.try_reply().is_none() && p1.try_reply().is_none());
    s.poll_groups(t0 + 60 * MS);
    assert_eq!(group(p0.try_reply().unwrap()), (vec![0, 1], false));
    assert_eq!(group(p1.try_reply().unwrap()), (vec![0, 1], false));
    assert_eq!(s.next_group_deadline(), None);

    // Pipeline 2's GPU server goes silent while its replicas wait: the job
    // fails and the waiting asks hear stop.
    let mut w = s.apply(group_ask(&id, 0, 0, 2), t0 + 70 * MS);
    assert!(w.try_reply().is_none());
    s.expire(t0 + Duration::from_secs(1));
    assert_eq!(group(w.try_reply().unwrap()), (vec![], true));
}

#[test]
fn dynpipe_decides_a_repartition_from_reports_and_status_shows_it() {
    let t0 = Instant::now();
    let (mut s, _) = with_model(t0, manifest(Family::Resnet152), 2);
    let dynamic = r#", "dynamic": {"enabled": true, "window": 2, "baseline_at": 2, "delay": 3}"#;
    let id = running(&mut s, "d", 1, 2, dynamic, t0);
    let partition = s.jobs().get(&id).unwrap().partition().to_vec();
    let total: u32 = partition.iter().sum();
    let report = |stage: u32, iteration: u64, fwd_bwd_s: f64| ControllerRequest::TrainReport {
        job: id.clone(),
        pipeline: 0,
        stage,
        iteration,
        fwd_bwd_s,
        loss: None,
        samples: 4,
    };
    // Iterations 1-2: the baseline window. 3-4: stage 1 takes 3x.
    for it in 1..=4u64 {
        let slow = if it > 2 { 0.3 } else { 0.1 };
        // Out of order across stages: an iteration is fed once complete.
        reply(&mut s, report(1, it, slow), t0 + it as u32 * MS);
        assert!(s.take_train_actions().is_empty(), "iteration {it}");
        reply(&mut s, report(0, it, 0.1), t0 + it as u32 * MS);
    }
    let mut a = s.take_train_actions();
    assert_eq!(a.len(), 1, "{a:?}");
    let TrainAction::Plan(input) = a.pop().unwrap() else {
        panic!("a plan");
    };
    assert!(input.model.is_some(), "the catalog's entry, for the FLOPs");
    assert_eq!(input.trigger.decided_at_iteration, 4);
    // What the driver does off the lock.
    let decision = jobs::plan_repartition(&input);
    s.repartition_planned(&id, input.generation, decision, t0);
    let st = match reply(
        &mut s,
        ControllerRequest::TrainStatus {
            job: Some(id.clone()),
        },
        t0,
    ) {
        ControllerReply::TrainJobs { mut jobs } => jobs.pop().unwrap(),
        r => panic!("{r:?}"),
    };
    let d = st.repartition.expect("the decision is in the status");
    assert_eq!(
        (d.generation, d.decided_at_iteration, d.at_iteration),
        (0, 4, 7)
    );
    assert_eq!(d.old_partition, partition);
    assert_eq!(d.stragglers, vec![1]);
    assert!((d.ratios[1] - 3.0).abs() < 1e-9, "{:?}", d.ratios);
    assert_eq!(d.layer_costs, "flops");
    assert_eq!(d.new_partition.iter().sum::<u32>(), total);
    assert!(
        d.new_partition[1] < partition[1],
        "layers move off the slow stage: {:?} -> {:?}",
        partition,
        d.new_partition
    );
    assert!(
        d.predicted_s_per_microbatch < d.current_s_per_microbatch,
        "{} vs {}",
        d.predicted_s_per_microbatch,
        d.current_s_per_microbatch
    );
    // The monitor decided once; carrying it out drains every worker after
    // the decision's iteration (the reply to each report says so).
    let job = s.jobs().get(&id).unwrap();
    assert_eq!(*job.state(), TrainJobState::Repartitioning);
    for it in 5..=7u64 {
        for stage in 0..2 {
            match reply(&mut s, report(stage, it, 0.9), t0) {
                ControllerReply::TrainReported {
                    stop: false,
                    drain: Some(order),
                    ..
                } => {
                    assert_eq!(order.after_iteration, 7);
                    assert_eq!(order.checkpoint.as_deref(), Some(&*format!("{id}-g1")));
                    assert_eq!(order.partition, partition);
                }
                r => panic!("{r:?}"),
            }
        }
    }
    assert!(
        s.take_train_actions().is_empty(),
        "one decision until applied"
    );
}

fn checkpointed(id: &str, stage: u32, iteration: u64, offset: u64) -> ControllerRequest {
    let at = |memserver: u32| Location {
        memserver,
        addr: format!("10.0.0.{memserver}:7000"),
        offset,
    };
    ControllerRequest::TrainCheckpointed {
        job: id.to_string(),
        generation: 0,
        pipeline: 0,
        stage,
        iteration,
        model: format!("{id}-ckpt"),
        group: GroupLocation {
            index: stage,
            bytes: 64,
            checksum: "00".into(),
            slices: vec![Slice {
                group_offset: 0,
                len: 64,
                checksum: "00".into(),
                replicas: vec![at(1), at(2)],
            }],
        },
        layer_checksums: vec![1; 5],
    }
}

/// The `Free` actions queued, as (job, extents' offsets); each extent
/// names its owner, the job's periodic checkpoint.
fn frees(s: &mut ControllerState) -> Vec<(String, Vec<u64>)> {
    s.take_train_actions()
        .into_iter()
        .filter_map(|a| match a {
            TrainAction::Free { job, extents } => {
                for e in &extents {
                    assert_eq!(e.owner, format!("{job}-ckpt"), "{e:?}");
                }
                Some((job, extents.iter().map(|e| e.at.offset).collect()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn the_driver_is_handed_the_extents_of_abandoned_checkpoint_parts_to_free() {
    let t0 = Instant::now();
    let (mut s, _) = with_model_and_runtime(t0, 10, 2);
    let id = running(&mut s, "a", 1, 2, r#", "checkpoint_every": 2"#, t0);
    let ok =
        |r: ControllerReply| assert!(matches!(r, ControllerReply::TrainReported { .. }), "{r:?}");
    ok(reply(&mut s, checkpointed(&id, 0, 2, 100), t0));
    assert_eq!(frees(&mut s), vec![]);
    // A newer checkpoint begins before the first completed: the first's
    // part is freed, every replica.
    ok(reply(&mut s, checkpointed(&id, 1, 4, 200), t0));
    assert_eq!(frees(&mut s), vec![(id.clone(), vec![100, 100])]);
    // The job fails: the part of the one being written.
    ok(reply(
        &mut s,
        ControllerRequest::TrainFailed {
            job: id.clone(),
            pipeline: 0,
            stage: 0,
            reason: "out of memory".into(),
        },
        t0,
    ));
    assert_eq!(frees(&mut s), vec![(id.clone(), vec![200, 200])]);
    assert_eq!(frees(&mut s), vec![]);
}
