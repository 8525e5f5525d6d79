//! The job registry on a virtual clock: the state machine, reports, stops,
//! failures, bounds and the stage requests.

use super::*;
use distmind_common::proto::{
    DeviceUse, DrainOrder, GroupLocation, LastCheckpoint, Location, RuntimeRequest, Slice,
    StagePeer,
};

const MS: Duration = Duration::from_millis(1);

fn spec(name: &str, pipelines: u32, stages: u32) -> JobSpec {
    JobSpec::from_json(&format!(
        r#"{{"name": "{name}", "model": "m", "optimizer": {{"sgd": {{"lr": 0.1}}}},
            "batch": 8, "microbatches": 4, "pipelines": {pipelines}, "stages": {stages},
            "iterations": 3}}"#
    ))
    .unwrap()
}

/// Stage `i` (pipeline-major) on runtime `i / 2`, device `i % 2`.
fn placement(n: u32) -> Vec<StagePlacement> {
    (0..n)
        .map(|i| StagePlacement {
            runtime: i / 2,
            addr: format!("10.0.0.{}:10009", i / 2),
            device: i % 2,
            usage: DeviceUse::Idle,
        })
        .collect()
}

fn report(pipeline: u32, stage: u32, iteration: u64) -> StageReport {
    StageReport {
        pipeline,
        stage,
        iteration,
        fwd_bwd_s: 0.5,
        loss: (stage == 1).then_some(2.0 / iteration as f64),
        samples: 8,
    }
}

/// A registry with one 2 x 2 job of a 10-layer model, placed.
fn placed(t0: Instant) -> (JobRegistry, String) {
    let mut r = JobRegistry::new();
    let id = r.submit(spec("j", 2, 2), 10, 7, t0).unwrap();
    r.place(&id, placement(4), t0).unwrap();
    (r, id)
}

fn state(r: &JobRegistry, id: &str) -> TrainJobState {
    r.get(id).unwrap().state().clone()
}

#[test]
fn the_transition_table() {
    use TrainJobState as S;
    let failed = S::Failed {
        pipeline: 0,
        stage: 0,
        reason: "x".into(),
    };
    let states = [
        S::Pending,
        S::Placing,
        S::Running,
        S::Repartitioning,
        S::Stopping,
        S::Stopped,
        failed,
        S::Finished,
    ];
    let events = [
        Event::Place,
        Event::AllReported,
        Event::AllStarted,
        Event::Repartition,
        Event::Repartitioned,
        Event::Stop,
        Event::AllStopped,
        Event::Fail,
        Event::Finish,
    ];
    // Rows: states in the order above; columns: events in the order above.
    let table = [
        "P....S...", // pending: place, stop
        ".AA..S.F.", // placing: all reported, all started, stop, fail
        "...R.S.FF", // running: repartition, stop, fail, finish
        "....RS.F.", // repartitioning: done, stop, fail
        "......A..", // stopping: all stopped
        ".........", // stopped
        ".........", // failed
        ".........", // finished
    ];
    for (s, row) in states.iter().zip(table) {
        for (e, cell) in events.iter().zip(row.chars()) {
            assert_eq!(allowed(s, *e), cell != '.', "{} / {e:?}", s.name());
        }
    }
    for s in &states[5..] {
        assert!(s.is_terminal());
    }
}

#[test]
fn a_job_runs_from_pending_to_finished() {
    let t0 = Instant::now();
    let mut r = JobRegistry::new();
    let id = r.submit(spec("j", 2, 2), 10, 7, t0).unwrap();
    assert_eq!(id, "j-1");
    assert_eq!(state(&r, &id), TrainJobState::Pending);
    assert_eq!(r.pending(), vec![id.clone()]);
    assert!(r.held_devices().is_empty());
    let e = r.report(&id, report(0, 0, 1), t0).unwrap_err();
    assert!(
        matches!(
            e,
            JobError::IllegalTransition {
                state: "pending",
                ..
            }
        ),
        "{e}"
    );

    r.set_waiting(&id, "needs 4 GPUs".into()).unwrap();
    assert_eq!(
        r.status(Some(&id), t0).unwrap()[0].waiting.as_deref(),
        Some("needs 4 GPUs")
    );
    r.place(&id, placement(4), t0).unwrap();
    assert_eq!(state(&r, &id), TrainJobState::Placing);
    assert_eq!(r.held_devices().len(), 4);
    assert!(r.pending().is_empty());
    let e = r.place(&id, placement(4), t0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "job j-1 is placing: cannot be placed",
        "a named, refused transition"
    );

    // Every stage reports once: running.
    for (i, (p, s)) in [(0, 0), (0, 1), (1, 0)].into_iter().enumerate() {
        let o = r.report(&id, report(p, s, 1), t0 + i as u32 * MS).unwrap();
        assert_eq!((o.state, o.stop), (TrainJobState::Placing, false));
    }
    let o = r.report(&id, report(1, 1, 1), t0 + 10 * MS).unwrap();
    assert_eq!((o.state, o.stop), (TrainJobState::Running, false));
    for it in 2..=3 {
        for (p, s) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            r.report(&id, report(p, s, it), t0 + (it as u32 * 1000) * MS)
                .unwrap();
        }
    }
    assert_eq!(state(&r, &id), TrainJobState::Finished);
    assert!(r.held_devices().is_empty(), "an ended job holds no GPU");
    let o = r.report(&id, report(0, 0, 3), t0).unwrap();
    assert!(o.stop, "a late report hears the job ended");

    let st = &r.status(Some(&id), t0 + 3500 * MS).unwrap()[0];
    assert_eq!(st.partition, vec![5, 5]);
    let last = &st.stages[3];
    assert_eq!((last.pipeline, last.stage), (1, 1));
    assert_eq!((last.layers.first, last.layers.end), (5, 10));
    assert_eq!(last.iteration, Some(3));
    assert_eq!(last.loss, Some(2.0 / 3.0));
    assert_eq!(last.reports, 3);
    assert_eq!(last.fwd_bwd_s, Some(0.5));
    assert_eq!(last.last_report_ms_ago, Some(500));
    // 16 samples between the first report (10 ms) and the last (3000 ms).
    let rate = last.samples_per_s.unwrap();
    assert!((rate - 16.0 / 2.99).abs() < 1e-9, "{rate}");
    assert_eq!(
        last.placement.as_ref().map(|p| (p.runtime, p.device)),
        Some((1, 1))
    );
}

#[test]
fn reports_are_checked_and_their_history_is_bounded() {
    let t0 = Instant::now();
    let (mut r, id) = placed(t0);
    let e = r.report(&id, report(2, 0, 1), t0).unwrap_err();
    assert!(e.to_string().contains("no pipeline 2 stage 0"), "{e}");
    let e = r.report("nope-9", report(0, 0, 1), t0).unwrap_err();
    assert!(matches!(e, JobError::UnknownJob { .. }), "{e}");
    for (bad, says) in [
        (
            StageReport {
                fwd_bwd_s: -1.0,
                ..report(0, 0, 1)
            },
            "fwd_bwd_s = -1",
        ),
        (
            StageReport {
                fwd_bwd_s: f64::NAN,
                ..report(0, 0, 1)
            },
            "fwd_bwd_s = NaN",
        ),
        (
            StageReport {
                loss: Some(f64::INFINITY),
                ..report(0, 0, 1)
            },
            "loss is not a finite",
        ),
        (
            StageReport {
                iteration: 4,
                ..report(0, 0, 1)
            },
            "past the job's 3 iterations",
        ),
        (
            StageReport {
                samples: 9,
                ..report(0, 0, 1)
            },
            "batch of 8",
        ),
    ] {
        let e = r.report(&id, bad, t0).unwrap_err();
        assert!(e.to_string().contains(says), "{e}");
    }
    for k in 0..(REPORTS_PER_STAGE_MAX as u32 + 10) {
        r.report(&id, report(0, 0, 1), t0 + k * MS).unwrap();
    }
    let job = r.get(&id).unwrap();
    assert_eq!(job.reports(0, 0).count(), REPORTS_PER_STAGE_MAX);
    assert_eq!(
        r.status(Some(&id), t0).unwrap()[0].stages[0].reports,
        REPORTS_PER_STAGE_MAX as u64 + 10
    );
}

#[test]
fn stopping_waits_for_the_workers_that_reported() {
    let t0 = Instant::now();
    // Pending: stopped at once.
    let mut r = JobRegistry::new();
    let id = r.submit(spec("p", 1, 2), 10, 1, t0).unwrap();
    assert_eq!(r.stop(&id, t0).unwrap(), TrainJobState::Stopped);
    let e = r.stop(&id, t0).unwrap_err();
    assert_eq!(e.to_string(), format!("job {id} is stopped: cannot stop"));

    // Placed, nobody reported: stopped at once.
    let (mut r, id) = placed(t0);
    assert_eq!(r.stop(&id, t0).unwrap(), TrainJobState::Stopped);
    assert!(r.held_devices().is_empty());

    // Two workers reported: stopping until both heard it.
    let (mut r, id) = placed(t0);
    r.report(&id, report(0, 0, 1), t0).unwrap();
    r.report(&id, report(1, 1, 1), t0).unwrap();
    assert_eq!(r.stop(&id, t0).unwrap(), TrainJobState::Stopping);
    assert!(matches!(
        r.stop(&id, t0).unwrap_err(),
        JobError::IllegalTransition {
            state: "stopping",
            ..
        }
    ));
    assert_eq!(r.held_devices().len(), 4, "workers may still run");
    let o = r.report(&id, report(0, 0, 2), t0).unwrap();
    assert_eq!((o.state, o.stop), (TrainJobState::Stopping, true));
    let o = r.report(&id, report(1, 1, 2), t0).unwrap();
    assert_eq!((o.state, o.stop), (TrainJobState::Stopped, true));
    assert!(r.held_devices().is_empty());

    // A silent worker: stopped after the grace.
    let (mut r, id) = placed(t0);
    r.report(&id, report(0, 0, 1), t0).unwrap();
    r.stop(&id, t0).unwrap();
    assert!(r.expire(t0 + STOP_GRACE - MS).is_empty());
    assert_eq!(r.expire(t0 + STOP_GRACE), vec![id.clone()]);
    assert_eq!(state(&r, &id), TrainJobState::Stopped);
}

#[test]
fn failures_name_the_stage_and_the_reason() {
    let t0 = Instant::now();
    let (mut r, id) = placed(t0);
    let s = r.fail(&id, 1, 0, "CUDA out of memory", t0).unwrap();
    assert_eq!(
        s,
        TrainJobState::Failed {
            pipeline: 1,
            stage: 0,
            reason: "CUDA out of memory; no checkpoint yet".into()
        }
    );
    assert!(r.held_devices().is_empty());
    assert!(r.report(&id, report(0, 0, 1), t0).unwrap().stop);
    let e = r.fail(&id, 5, 0, "x", t0).unwrap_err();
    assert!(matches!(e, JobError::NoSuchStage { .. }), "{e}");
    // A pending job has no worker to fail.
    let id2 = r.submit(spec("q", 1, 1), 10, 1, t0).unwrap();
    assert!(matches!(
        r.fail(&id2, 0, 0, "x", t0).unwrap_err(),
        JobError::IllegalTransition {
            state: "pending",
            ..
        }
    ));
    // Reasons are bounded.
    let (mut r, id) = placed(t0);
    match r
        .fail(&id, 0, 0, &"é".repeat(REASON_BYTES_MAX), t0)
        .unwrap()
    {
        TrainJobState::Failed { reason, .. } => {
            assert!(reason.len() <= REASON_BYTES_MAX, "{}", reason.len());
            assert!(reason.len() >= REASON_BYTES_MAX - 1, "{}", reason.len());
            assert!(reason.ends_with("é; no checkpoint yet"), "{reason}");
        }
        s => panic!("{s:?}"),
    }
}

#[test]
fn a_lost_gpu_server_fails_the_jobs_on_it() {
    let t0 = Instant::now();
    let (mut r, id) = placed(t0);
    // Stages 2 and 3 (pipeline 1) are on runtime 1.
    assert!(r.runtime_lost(7, "no heartbeat", t0).is_empty());
    assert_eq!(
        r.runtime_lost(1, "no heartbeat for 3 s", t0),
        vec![id.clone()]
    );
    match state(&r, &id) {
        TrainJobState::Failed {
            pipeline,
            stage,
            reason,
        } => {
            assert_eq!((pipeline, stage), (1, 0));
            assert_eq!(
                reason,
                "its GPU server, runtime 1 (10.0.0.1:10009), device 0: no heartbeat for 3 s; \
                 no checkpoint yet"
            );
        }
        s => panic!("{s:?}"),
    }
    // While stopping, the lost workers count as stopped.
    let (mut r, id) = placed(t0);
    r.report(&id, report(1, 0, 1), t0).unwrap();
    r.report(&id, report(1, 1, 1), t0).unwrap();
    r.stop(&id, t0).unwrap();
    r.runtime_lost(1, "restarted", t0);
    assert_eq!(state(&r, &id), TrainJobState::Stopped);
}

#[test]
fn repartitioning_moves_layers_and_bumps_the_generation() {
    let t0 = Instant::now();
    let (mut r, id) = placed(t0);
    assert!(matches!(
        r.begin_repartition(&id, vec![4, 6], t0).unwrap_err(),
        JobError::IllegalTransition {
            state: "placing",
            ..
        }
    ));
    for (p, s) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        r.report(&id, report(p, s, 1), t0).unwrap();
    }
    let e = r.begin_repartition(&id, vec![4, 7], t0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "training spec: partition = [4, 7] (sum 11): must sum to the model's 10 layers"
    );
    let e = r.begin_repartition(&id, vec![10, 0], t0).unwrap_err();
    assert!(
        e.to_string().starts_with("training spec: partition[1] = 0"),
        "{e}"
    );
    r.begin_repartition(&id, vec![3, 7], t0).unwrap();
    assert_eq!(state(&r, &id), TrainJobState::Repartitioning);
    r.report(&id, report(0, 0, 2), t0).unwrap();
    r.finish_repartition(&id, t0).unwrap();
    let job = r.get(&id).unwrap();
    assert_eq!((job.partition(), job.generation()), (&[3, 7][..], 1));
    assert_eq!(state(&r, &id), TrainJobState::Running);
    let reqs = start_requests(job, 100);
    match &reqs[1].request {
        RuntimeRequest::TrainStage { assignment: a, .. } => {
            assert_eq!((a.generation, a.layers.first, a.layers.end), (1, 3, 10));
            assert_eq!(a.start_iteration, 1, "the slowest stage's last iteration");
        }
        r => panic!("{r:?}"),
    }
    assert!(r.finish_repartition(&id, t0).is_err());
}

#[test]
fn names_and_job_counts_are_bounded() {
    let t0 = Instant::now();
    let mut r = JobRegistry::new();
    let id = r.submit(spec("same", 1, 1), 10, 1, t0).unwrap();
    let e = r.submit(spec("same", 1, 1), 10, 1, t0).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("a job named \"same\" is already pending as {id}; stop it or choose another name")
    );
    r.stop(&id, t0).unwrap();
    r.submit(spec("same", 1, 1), 10, 1, t0).unwrap();
    // A spec the model cannot take.
    let e = r.submit(spec("big", 1, 4), 3, 1, t0).unwrap_err();
    assert!(
        e.to_string().contains("has 3 layers: at most 3 stages"),
        "{e}"
    );
    // Active jobs are bounded; ended ones are dropped oldest first.
    let mut r = JobRegistry::new();
    let ids: Vec<String> = (0..JOBS_ACTIVE_MAX)
        .map(|i| r.submit(spec(&format!("a{i}"), 1, 1), 10, 1, t0).unwrap())
        .collect();
    let e = r.submit(spec("one-more", 1, 1), 10, 1, t0).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Full);
    assert!(e.to_string().contains("16 training jobs are active"), "{e}");
    for id in &ids {
        r.stop(id, t0).unwrap();
    }
    for i in 0..JOBS_KEPT_MAX {
        let id = r.submit(spec(&format!("b{i}"), 1, 1), 10, 1, t0).unwrap();
        r.stop(&id, t0).unwrap();
    }
    assert_eq!(r.len(), JOBS_KEPT_MAX);
    assert!(r.get(&ids[0]).is_none(), "the oldest ended job was dropped");
    assert!(r.status(Some(&ids[0]), t0).is_err());
    assert_eq!(r.status(None, t0).unwrap().len(), JOBS_KEPT_MAX);
}

#[test]
fn stage_requests_carry_everything_a_worker_needs() {
    let t0 = Instant::now();
    let (r, id) = placed(t0);
    let job = r.get(&id).unwrap();
    let reqs = start_requests(job, 1 << 40);
    assert_eq!(reqs.len(), 4);
    for (i, q) in reqs.iter().enumerate() {
        let (p, s) = (i as u32 / 2, i as u32 % 2);
        assert_eq!(
            (q.runtime, q.addr.as_str()),
            (i as u32 / 2, format!("10.0.0.{}:10009", i / 2).as_str())
        );
        let RuntimeRequest::TrainStage {
            id: rid,
            assignment: a,
        } = &q.request
        else {
            panic!("{q:?}");
        };
        assert_eq!(*rid, (1 << 40) + i as u64);
        assert_eq!(
            (a.job.as_str(), a.pipeline, a.stage, a.device),
            ("j-1", p, s, i as u32 % 2)
        );
        assert_eq!(
            (a.model.as_str(), a.catalog_version, a.generation),
            ("m", 7, 0)
        );
        assert_eq!(
            (a.layers.first, a.layers.end),
            if s == 0 { (0, 5) } else { (5, 10) }
        );
        assert_eq!(a.partition, vec![5, 5]);
        assert_eq!(a.start_iteration, 0);
        assert_eq!(*a.spec, *job.spec());
        let peer = |pp: u32, ss: u32| (pp, ss, (pp * 2 + ss) / 2, (pp * 2 + ss) % 2);
        let key = |x: &StagePeer| (x.pipeline, x.stage, x.runtime, x.device);
        assert_eq!(a.peers.prev.as_ref().map(key), (s == 1).then(|| peer(p, 0)));
        assert_eq!(a.peers.next.as_ref().map(key), (s == 0).then(|| peer(p, 1)));
        assert_eq!(
            a.peers.same_stage.iter().map(key).collect::<Vec<_>>(),
            vec![peer(1 - p, s)]
        );
    }
    let stops = stop_requests(job, 9);
    assert_eq!(stops.len(), 4);
    assert_eq!(
        stops[3].request,
        RuntimeRequest::TrainStageStop {
            id: 12,
            job: "j-1".into(),
            pipeline: 1,
            stage: 1,
            generation: 0,
        }
    );
    // A pending job has nothing to start.
    let mut r = JobRegistry::new();
    let id = r.submit(spec("p", 1, 1), 10, 1, t0).unwrap();
    assert!(start_requests(r.get(&id).unwrap(), 0).is_empty());
}

/// A written checkpoint group, as a worker's `TrainCheckpointed` says.
fn part(stage: u32) -> GroupLocation {
    GroupLocation {
        index: stage,
        bytes: 4096,
        checksum: format!("{:016x}", stage + 1),
        slices: Vec::new(),
    }
}

/// Job `sp` (2 pipelines of 2 stages) placed and started, every worker
/// past iteration 3.
fn started(sp: JobSpec, t0: Instant) -> (JobRegistry, String) {
    let mut r = JobRegistry::new();
    let id = r.submit(sp, 10, 7, t0).unwrap();
    r.place(&id, placement(4), t0).unwrap();
    let workers = [(0, 0), (0, 1), (1, 0), (1, 1)];
    r.launch_sent(&id).unwrap();
    for (p, s) in workers {
        let addr = format!("10.0.0.9:{}", 4000 + p * 2 + s);
        r.stage_ready(&id, 0, p, s, &addr, &[], t0).unwrap();
    }
    r.start_sent(&id).unwrap();
    for (p, s) in workers {
        r.stage_started(&id, 0, p, s, t0).unwrap();
    }
    for (p, s) in workers {
        r.report(&id, report(p, s, 3), t0).unwrap();
    }
    (r, id)
}

/// DynPipe's decision to move layers from `old` to [7, 3].
fn decision(old: Vec<u32>) -> RepartitionDecision {
    RepartitionDecision {
        generation: 0,
        decided_at_iteration: 1,
        at_iteration: 2,
        ratios: vec![1.0, 3.0],
        stragglers: vec![1],
        old_partition: old,
        new_partition: vec![7, 3],
        predicted_s_per_microbatch: 0.1,
        current_s_per_microbatch: 0.2,
        layer_costs: "layers".into(),
    }
}

#[test]
fn a_repartitioning_drains_checkpoints_stops_and_starts_the_next_generation() {
    let t0 = Instant::now();
    let mut sp = spec("j", 2, 2);
    sp.iterations = 10;
    let (mut r, id) = started(sp, t0);
    let workers = [(0, 0), (0, 1), (1, 0), (1, 1)];
    let old = r.get(&id).unwrap().partition().to_vec();
    let decision = decision(old.clone());
    // The plan came late: every worker reported 3, so all stop after 4.
    assert!(r.record_repartition(&id, decision, t0));
    assert_eq!(state(&r, &id), TrainJobState::Repartitioning);
    let name = format!("{id}-g1");
    for (p, s) in workers {
        let o = r.report(&id, report(p, s, 4), t0).unwrap();
        assert!(!o.stop);
        assert_eq!(
            o.drain,
            Some(DrainOrder {
                after_iteration: 4,
                generation: 0,
                checkpoint: (p == 0).then(|| name.clone()),
                partition: old.clone(),
            })
        );
    }
    // Only pipeline 0's parts, of the drained iteration, one per stage.
    let bad = [
        r.checkpointed(&id, 0, 1, 0, 4, &name, part(0), vec![1; 5]),
        r.checkpointed(&id, 0, 0, 0, 3, &name, part(0), vec![1; 5]),
        r.checkpointed(&id, 0, 0, 0, 4, "other", part(0), vec![1; 5]),
        r.checkpointed(&id, 0, 0, 0, 4, &name, part(1), vec![1; 5]),
        r.checkpointed(&id, 0, 0, 0, 4, &name, part(0), vec![1; 4]),
        r.checkpointed(&id, 1, 0, 0, 4, &name, part(0), vec![1; 5]),
    ];
    for e in bad {
        assert!(matches!(e, Err(JobError::BadReport { .. })), "{e:?}");
    }
    assert_eq!(
        r.checkpointed(&id, 0, 0, 0, 4, &name, part(0), vec![1; 5]),
        Ok(None)
    );
    let parts = r
        .checkpointed(&id, 0, 0, 1, 4, &name, part(1), vec![2; 5])
        .unwrap()
        .expect("every part written");
    assert_eq!(parts.base, ("m".to_string(), 7));
    assert_eq!(parts.partition, old);
    assert_eq!(parts.groups, vec![part(0), part(1)]);
    let written = checkpoint::combine(&[1, 1, 1, 1, 1, 2, 2, 2, 2, 2]);
    // In the catalog: every drained worker is told to stop; the last
    // answer starts generation 1.
    assert!(r.checkpoint_put(&id, 9));
    assert_eq!(r.take_stop_requests(&id, 100, None).len(), 4);
    for (i, (p, s)) in workers.into_iter().enumerate() {
        assert_eq!(r.drained_worker_stopped(&id, 0, p, s), i == 3);
    }
    r.start_next_generation(&id).unwrap();
    let job = r.get(&id).unwrap();
    assert_eq!((job.generation(), job.partition()), (1, &[7, 3][..]));
    for req in start_requests(job, 200) {
        match req.request {
            RuntimeRequest::TrainStage { assignment: a, .. } => {
                assert_eq!((a.model.as_str(), a.catalog_version), (&*name, 9));
                assert_eq!((a.generation, a.start_iteration), (1, 4));
                assert_eq!(a.partition, vec![7, 3]);
            }
            r => panic!("{r:?}"),
        }
    }
    // The new workers load what was written (checksums in their ready
    // answers), start, and the job runs again.
    r.launch_sent(&id).unwrap();
    for (p, s) in workers {
        let sums = if s == 0 {
            vec![1, 1, 1, 1, 1, 2, 2]
        } else {
            vec![2, 2, 2]
        };
        let addr = format!("10.0.0.9:{}", 5000 + p * 2 + s);
        r.stage_ready(&id, 1, p, s, &addr, &sums, t0).unwrap();
    }
    let ck = r.get(&id).unwrap().status(t0).checkpoint.unwrap();
    assert_eq!(ck.written, Some(written));
    assert_eq!(ck.loaded, vec![Some(written); 2]);
    assert_eq!((ck.catalog_version, ck.after_iteration), (Some(9), 4));
    r.start_sent(&id).unwrap();
    for (p, s) in workers {
        r.stage_started(&id, 1, p, s, t0).unwrap();
    }
    assert_eq!(state(&r, &id), TrainJobState::Running);
    let o = r.report(&id, report(0, 0, 5), t0).unwrap();
    assert_eq!((o.stop, o.drain), (false, None));
    // A decision that keeps the partition is recorded, not carried out.
    let mut same = r.get(&id).unwrap().repartition().unwrap().clone();
    same.generation = 1;
    same.new_partition = vec![7, 3];
    assert!(r.record_repartition(&id, same, t0));
    assert_eq!(state(&r, &id), TrainJobState::Running);
}

#[test]
fn periodic_checkpoint_parts_are_checked_collected_and_named_by_a_failure() {
    let t0 = Instant::now();
    let mut r = JobRegistry::new();
    let mut sp = spec("j", 2, 2);
    sp.iterations = 10;
    sp.checkpoint_every = Some(2);
    let id = r.submit(sp, 10, 7, t0).unwrap();
    r.place(&id, placement(4), t0).unwrap();
    let name = format!("{id}-ckpt");
    // Only pipeline 0's parts, of a due iteration, one per stage.
    let bad = [
        r.checkpointed(&id, 0, 1, 0, 2, &name, part(0), vec![1; 5]),
        r.checkpointed(&id, 0, 0, 0, 3, &name, part(0), vec![1; 5]),
        r.checkpointed(&id, 0, 0, 0, 10, &name, part(0), vec![1; 5]),
        r.checkpointed(&id, 0, 0, 0, 2, &name, part(1), vec![1; 5]),
        r.checkpointed(&id, 0, 0, 0, 2, &name, part(0), vec![1; 4]),
        r.checkpointed(&id, 1, 0, 0, 2, &name, part(0), vec![1; 5]),
    ];
    for e in bad {
        assert!(matches!(e, Err(JobError::BadReport { .. })), "{e:?}");
    }
    assert_eq!(
        r.checkpointed(&id, 0, 0, 0, 2, &name, part(0), vec![1; 5]),
        Ok(None)
    );
    let again = r.checkpointed(&id, 0, 0, 0, 2, &name, part(0), vec![1; 5]);
    assert!(
        matches!(again, Err(JobError::BadReport { .. })),
        "{again:?}"
    );
    let parts = r
        .checkpointed(&id, 0, 0, 1, 2, &name, part(1), vec![2; 5])
        .unwrap()
        .expect("every part written");
    assert!(parts.periodic);
    assert_eq!(parts.name, name);
    assert_eq!(parts.base, ("m".to_string(), 7));
    assert_eq!((parts.generation, parts.iteration), (0, 2));
    assert_eq!(parts.groups, vec![part(0), part(1)]);
    let written = checkpoint::combine(&[1, 1, 1, 1, 1, 2, 2, 2, 2, 2]);
    assert_eq!(parts.written, written);
    // Not the last checkpoint until the catalog has it.
    assert_eq!(r.get(&id).unwrap().status(t0).last_checkpoint, None);
    assert!(r.checkpoint_saved(&id, &parts, 11));
    let last = r.get(&id).unwrap().status(t0).last_checkpoint.unwrap();
    assert_eq!(
        last,
        LastCheckpoint {
            model: name.clone(),
            catalog_version: 11,
            generation: 0,
            iteration: 2,
            written,
            group_checksums: vec!["0000000000000001".into(), "0000000000000002".into()],
        }
    );
    // One that never completes is left for a later one; an older part
    // than the one being written is refused.
    assert_eq!(
        r.checkpointed(&id, 0, 0, 0, 4, &name, part(0), vec![1; 5]),
        Ok(None)
    );
    assert_eq!(
        r.checkpointed(&id, 0, 0, 1, 6, &name, part(1), vec![2; 5]),
        Ok(None)
    );
    let old = r.checkpointed(&id, 0, 0, 1, 4, &name, part(1), vec![2; 5]);
    assert!(matches!(old, Err(JobError::BadReport { .. })), "{old:?}");
    // An older checkpoint put late does not replace the last one.
    let mut late = parts.clone();
    late.iteration = 0;
    assert!(r.checkpoint_saved(&id, &late, 12));
    assert_eq!(
        r.get(&id)
            .unwrap()
            .last_checkpoint()
            .unwrap()
            .catalog_version,
        11
    );
    // A failure names the last checkpoint; a failed job takes no parts.
    let s = r.fail(&id, 1, 1, "runtime 0 lost", t0).unwrap();
    assert_eq!(
        s,
        TrainJobState::Failed {
            pipeline: 1,
            stage: 1,
            reason: format!(
                "runtime 0 lost; last checkpoint: {name} (catalog version 11) after iteration 2"
            ),
        }
    );
    let after = r.checkpointed(&id, 0, 0, 0, 6, &name, part(0), vec![1; 5]);
    assert!(
        matches!(after, Err(JobError::BadReport { .. })),
        "{after:?}"
    );
}

/// A written checkpoint group at `offset` on two memory servers.
fn part_at(stage: u32, offset: u64) -> GroupLocation {
    let at = |memserver: u32| Location {
        memserver,
        addr: format!("10.0.0.{memserver}:7000"),
        offset,
    };
    GroupLocation {
        slices: vec![Slice {
            group_offset: 0,
            len: 4096,
            checksum: "00".into(),
            replicas: vec![at(1), at(2)],
        }],
        ..part(stage)
    }
}

#[test]
fn checkpoint_parts_that_will_never_be_in_the_catalog_are_abandoned_to_be_freed() {
    let t0 = Instant::now();
    let mut sp = spec("j", 2, 2);
    sp.iterations = 10;
    sp.checkpoint_every = Some(2);
    let (mut r, id) = started(sp.clone(), t0);
    let name = name_of(&id);
    // The extents of a part at `offset`, owned by checkpoint `owner`.
    let owned = |owner: &str, offset| -> Vec<OwnedExtent> {
        part_at(0, offset).slices[0]
            .replicas
            .iter()
            .map(|at| OwnedExtent {
                owner: owner.to_string(),
                at: at.clone(),
            })
            .collect()
    };
    let at = |offset| owned(&name, offset);
    // A complete checkpoint, and a refused part, abandon nothing.
    for (stage, offset) in [(0, 100), (1, 200)] {
        r.checkpointed(
            &id,
            0,
            0,
            stage,
            2,
            &name,
            part_at(stage, offset),
            vec![1; 5],
        )
        .unwrap();
    }
    let refused = r.checkpointed(&id, 0, 1, 0, 4, &name, part_at(0, 300), vec![1; 5]);
    assert!(refused.is_err(), "{refused:?}");
    assert!(!r.has_abandoned());
    assert_eq!(r.take_abandoned(), vec![]);
    // A newer checkpoint begun before the one being written completed:
    // the older one's parts, every replica, once.
    assert_eq!(
        r.checkpointed(&id, 0, 0, 0, 4, &name, part_at(0, 400), vec![1; 5]),
        Ok(None)
    );
    assert_eq!(
        r.checkpointed(&id, 0, 0, 1, 6, &name, part_at(1, 500), vec![1; 5]),
        Ok(None)
    );
    assert!(r.has_abandoned());
    assert_eq!(r.take_abandoned(), vec![(id.clone(), at(400))]);
    assert_eq!(r.take_abandoned(), vec![]);
    // The job fails: the parts of the one being written.
    r.fail(&id, 1, 1, "lost", t0).unwrap();
    assert_eq!(r.take_abandoned(), vec![(id.clone(), at(500))]);
    // A stop abandons them too, and so does the catalog refusing a
    // complete one.
    let (mut r, id) = started(sp.clone(), t0);
    r.checkpointed(&id, 0, 0, 1, 2, &name_of(&id), part_at(1, 600), vec![1; 5])
        .unwrap();
    r.stop(&id, t0).unwrap();
    assert_eq!(
        r.take_abandoned(),
        vec![(id.clone(), owned(&name_of(&id), 600))]
    );
    let (mut r, id) = started(sp.clone(), t0);
    r.checkpointed(&id, 0, 0, 0, 2, &name_of(&id), part_at(0, 700), vec![1; 5])
        .unwrap();
    let parts = r
        .checkpointed(&id, 0, 0, 1, 2, &name_of(&id), part_at(1, 800), vec![1; 5])
        .unwrap()
        .expect("complete");
    assert!(r.abandon_checkpoint(&id, &parts));
    assert_eq!(
        r.take_abandoned(),
        vec![(
            id.clone(),
            [owned(&name_of(&id), 700), owned(&name_of(&id), 800)].concat()
        )]
    );
    // A re-partitioning's parts, while it drains, when the job stops.
    sp.checkpoint_every = None;
    let (mut r, id) = started(sp, t0);
    let old = r.get(&id).unwrap().partition().to_vec();
    assert!(r.record_repartition(&id, decision(old), t0));
    let drained = format!("{id}-g1");
    for (p, s) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        r.report(&id, report(p, s, 4), t0).unwrap();
    }
    r.checkpointed(&id, 0, 0, 0, 4, &drained, part_at(0, 900), vec![1; 5])
        .unwrap();
    assert!(!r.has_abandoned());
    r.stop(&id, t0).unwrap();
    assert_eq!(r.take_abandoned(), vec![(id.clone(), owned(&drained, 900))]);
}

fn name_of(id: &str) -> String {
    format!("{id}-ckpt")
}
