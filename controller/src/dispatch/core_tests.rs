//! The dispatcher on a virtual clock: admission, EDF order, routing by
//! where models are, training, runtime loss, the original's balancer.

use super::*;
use crate::policy::distmind::DistMindConfig;
use distmind_common::proto::{DeviceSnapshot, ServePath, TimingMsg};

const MS: Micros = 1_000;

fn cfg(policy: PolicyKind) -> DispatchConfig {
    let mut c = DispatchConfig::new(
        policy,
        DistMindConfig {
            period: 1_000 * MS,
            zipf_s: 0.9,
            inference_workload_s: vec![1],
            use_train: false,
            seed: 1,
        },
    );
    // 10 ms compute, uploads at 1 GB/s, a 100 MB/s link: a 10 MB model is
    // 10 ms resident, 20 ms host-cached, 120 ms remote.
    c.priors = Priors {
        net_bytes_per_s: 1e8,
        h2d_bytes_per_s: 1e9,
        compute_ms: 10.0,
    };
    c
}

/// A dispatcher with `gpus` single-device runtimes, links up.
fn dispatcher(policy: PolicyKind, gpus: u32) -> Dispatcher {
    let mut d = Dispatcher::new(cfg(policy)).unwrap();
    let mut out = Vec::new();
    for r in 0..gpus {
        d.runtime_seen(0, r, 1, &[0], 1 << 30, 4, None, &mut out);
        d.link_up(r);
    }
    assert!(out.is_empty());
    d
}

fn model(d: &mut Dispatcher, name: &str) -> u32 {
    d.model(ModelMeta {
        name: name.into(),
        family: "resnet152".into(),
        bytes: 10_000_000,
    })
    .unwrap()
}

fn sent(out: &[Action]) -> Vec<(ReqId, Gpu)> {
    out.iter()
        .filter_map(|a| match a {
            Action::Send { req, gpu, .. } => Some((*req, *gpu)),
            _ => None,
        })
        .collect()
}

fn failed(out: &[Action]) -> Vec<(ReqId, ErrorCode)> {
    out.iter()
        .filter_map(|a| match a {
            Action::Fail { req, error } => Some((*req, error.code)),
            _ => None,
        })
        .collect()
}

fn timing(path: ServePath, service_ms: f64) -> TimingMsg {
    TimingMsg {
        queue_ms: 0.0,
        fetch_ms: 0.0,
        h2d_ms: 0.0,
        compute_ms: service_ms,
        total_ms: service_ms,
        path,
        simulated: false,
        device: 0,
        fetched_bytes: 0,
        train_yield_ms: 0.0,
        batch_requests: 1,
    }
}

fn gpu(runtime: u32) -> Gpu {
    Gpu { runtime, device: 0 }
}

/// Marks `model` resident on runtime `r`'s device through a snapshot.
fn make_resident(d: &mut Dispatcher, r: u32, name: &str) {
    let snap = RuntimeSnapshot {
        devices: vec![DeviceSnapshot {
            device: 0,
            resident: vec![name.into()],
            ..Default::default()
        }],
        host_cached: vec![name.into()],
        host_cached_truncated: false,
    };
    d.runtime_seen(
        0,
        r,
        1,
        &[0],
        1 << 30,
        4,
        Some((next_seq(), &snap)),
        &mut Vec::new(),
    );
}

#[test]
fn admission_rejects_exactly_the_infeasible_requests() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let mut out = Vec::new();
    // 10 ms each; window 2: two are sent at once, busy until 20 ms.
    let r1 = d.submit(0, m, Some(25.0), &mut out);
    let r2 = d.submit(0, m, Some(25.0), &mut out);
    assert_eq!(sent(&out), vec![(r1, gpu(0)), (r2, gpu(0))]);
    out.clear();
    // A third would finish at 30 ms: infeasible under 25, feasible under 30.
    let r3 = d.submit(0, m, Some(25.0), &mut out);
    assert_eq!(failed(&out), vec![(r3, ErrorCode::Rejected)]);
    out.clear();
    let r4 = d.submit(0, m, Some(30.0), &mut out);
    assert!(
        out.is_empty(),
        "queued at the dispatcher, window full: {out:?}"
    );
    // Now 40 ms is the earliest; a request with 35 ms is refused, and one
    // that would fit itself but make r4 late (deadline 30) is refused too.
    let r5 = d.submit(0, m, Some(35.0), &mut out);
    assert_eq!(failed(&out), vec![(r5, ErrorCode::Rejected)]);
    out.clear();
    let r6 = d.submit(0, m, Some(21.0), &mut out);
    assert_eq!(
        failed(&out),
        vec![(r6, ErrorCode::Rejected)],
        "r6 would push r4 to 40 ms"
    );
    out.clear();
    // r1 finishes at 10 ms: r4 goes out.
    let t = timing(ServePath::DeviceResident, 10.0);
    let resident = vec!["a".to_string()];
    let c = Completion {
        timing: Some(&t),
        resident: &resident,
    };
    let info = d.complete(10 * MS, r1, &c, &mut out).unwrap();
    assert_eq!((info.runtime, info.device, info.slo_ms), (0, 0, 25.0));
    assert_eq!(sent(&out), vec![(r4, gpu(0))]);
    assert_eq!(d.counters().rejected, 3);
    assert_eq!(d.counters().completed_within_slo, 1);
}

#[test]
fn edf_sends_the_earliest_deadline_first() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let mut out = Vec::new();
    let r1 = d.submit(0, m, Some(500.0), &mut out);
    let _r2 = d.submit(0, m, Some(500.0), &mut out);
    out.clear();
    let late = d.submit(0, m, Some(400.0), &mut out);
    let early = d.submit(0, m, Some(100.0), &mut out);
    let middle = d.submit(0, m, Some(200.0), &mut out);
    assert!(out.is_empty());
    let t = timing(ServePath::DeviceResident, 10.0);
    let mut order = Vec::new();
    let mut done = vec![r1];
    for step in 1..=3 {
        let id = done.remove(0);
        let c = Completion {
            timing: Some(&t),
            resident: &[],
        };
        d.complete(step * 10 * MS, id, &c, &mut out);
        for (req, _) in sent(&out) {
            order.push(req);
            done.push(req);
        }
        out.clear();
    }
    assert_eq!(order, vec![early, middle, late]);
}

#[test]
fn routes_to_the_gpu_that_finishes_earliest() {
    let mut d = dispatcher(PolicyKind::Slo, 2);
    let m = model(&mut d, "a");
    make_resident(&mut d, 1, "a");
    let mut out = Vec::new();
    // Resident on GPU 1 (10 ms each) beats remote on GPU 0 (120 ms) until
    // GPU 1's backlog makes it finish later than a cold start on GPU 0:
    // the 12th request finishes at 120 ms either way (ties go to the
    // resident copy), the 13th at 130 ms on GPU 1 or 120 ms on GPU 0.
    let ids: Vec<ReqId> = (0..13)
        .map(|_| d.submit(0, m, Some(10_000.0), &mut out))
        .collect();
    assert!(failed(&out).is_empty());
    let on_gpu0: Vec<ReqId> = sent(&out)
        .into_iter()
        .filter(|(_, g)| *g == gpu(0))
        .map(|(r, _)| r)
        .collect();
    assert_eq!(on_gpu0, vec![ids[12]], "{out:?}");
    // GPU 1 got two at once (its window) and queued the other ten.
    assert_eq!(sent(&out).len(), 3);
    assert_eq!(d.queued(), 10);
}

#[test]
fn a_training_gpu_costs_one_iteration_to_yield() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let m = model(&mut d, "a");
    let snap = RuntimeSnapshot {
        devices: vec![DeviceSnapshot {
            device: 0,
            resident: vec!["a".into()],
            training: Some("resnet152_train".into()),
            train_iteration_ms: 50.0,
            ..Default::default()
        }],
        host_cached: vec!["a".into()],
        host_cached_truncated: false,
    };
    d.runtime_seen(
        0,
        0,
        1,
        &[0],
        1 << 30,
        4,
        Some((next_seq(), &snap)),
        &mut Vec::new(),
    );
    let mut out = Vec::new();
    // 10 ms of compute after up to 50 ms of training iteration.
    let r = d.submit(0, m, Some(55.0), &mut out);
    assert_eq!(failed(&out), vec![(r, ErrorCode::Rejected)]);
    out.clear();
    let r = d.submit(0, m, Some(60.0), &mut out);
    assert_eq!(sent(&out), vec![(r, gpu(0))]);
}

#[test]
fn a_lost_runtime_sends_its_requests_elsewhere() {
    let mut d = dispatcher(PolicyKind::Slo, 2);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let mut out = Vec::new();
    for _ in 0..3 {
        d.submit(0, m, Some(10_000.0), &mut out);
    }
    // Two went to GPU 0 (resident), one to GPU 0's queue or to GPU 1.
    let sent0: Vec<ReqId> = sent(&out)
        .into_iter()
        .filter(|(_, g)| *g == gpu(0))
        .map(|(r, _)| r)
        .collect();
    assert!(!sent0.is_empty());
    out.clear();
    d.runtime_down(5 * MS, 0, "killed", &mut out);
    // Its deadline allows: each request in flight there is sent again, to
    // GPU 1, and nothing fails.
    assert!(failed(&out).is_empty(), "{out:?}");
    let again: Vec<ReqId> = sent(&out).iter().map(|(r, _)| *r).collect();
    assert!(sent0.iter().all(|r| again.contains(r)), "{out:?}");
    assert!(sent(&out).iter().all(|(_, g)| *g == gpu(1)));
    assert_eq!(d.counters().retried, sent0.len() as u64);
    assert_eq!(d.in_flight(), 3);
}

#[test]
fn least_outstanding_balancer_bounds_each_gpu_at_eight() {
    let mut d = dispatcher(PolicyKind::DistMind, 2);
    let m = model(&mut d, "a");
    let mut out = Vec::new();
    d.tick(0, &mut out);
    out.clear();
    make_resident(&mut d, 0, "a");
    make_resident(&mut d, 1, "a");
    let ids: Vec<ReqId> = (0..20)
        .map(|_| d.submit(0, m, Some(1e6), &mut out))
        .collect();
    let s = sent(&out);
    assert_eq!(s.len(), 16, "8 per GPU");
    let per0 = s.iter().filter(|(_, g)| *g == gpu(0)).count();
    assert_eq!(per0, 8);
    out.clear();
    // A completion lets one waiting request through, in arrival order.
    let t = timing(ServePath::DeviceResident, 10.0);
    let c = Completion {
        timing: Some(&t),
        resident: &[],
    };
    d.complete(10 * MS, ids[0], &c, &mut out);
    assert_eq!(
        sent(&out).iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        vec![ids[16]]
    );
}

#[test]
fn distmind_policy_places_models_and_trains_the_rest() {
    let mut c = cfg(PolicyKind::DistMind);
    c.distmind.use_train = true;
    c.distmind.inference_workload_s = vec![1, 2];
    c.train_model = Some("resnet152_train".into());
    let mut d = Dispatcher::new(c).unwrap();
    let mut out = Vec::new();
    for r in 0..2 {
        d.runtime_seen(0, r, 1, &[0], 1 << 30, 4, None, &mut out);
        d.link_up(r);
    }
    for k in 0..5 {
        model(&mut d, &format!("m{k}"));
    }
    d.tick(0, &mut out);
    // Second 0: one inference GPU (prefetching its model), one training.
    let trains: Vec<_> = out
        .iter()
        .filter(|a| matches!(a, Action::Train { model: Some(_), .. }))
        .collect();
    assert_eq!(trains.len(), 1, "{out:?}");
    assert_eq!(
        out.iter()
            .filter(|a| matches!(a, Action::Prefetch { .. }))
            .count(),
        1
    );
    let a = d.assignments();
    assert_eq!(a.iter().filter(|g| g.role == GpuRole::Training).count(), 1);
    out.clear();
    // Second 1: both infer; the trainer is told to stop.
    d.tick(1_000 * MS, &mut out);
    assert!(
        out.iter()
            .any(|a| matches!(a, Action::Train { model: None, .. })),
        "{out:?}"
    );
    assert!(d.assignments().iter().all(|g| g.role == GpuRole::Inference));
}

#[test]
fn a_refused_training_job_is_asked_for_again_a_second_later() {
    let mut c = cfg(PolicyKind::DistMind);
    c.distmind.use_train = true;
    c.distmind.inference_workload_s = vec![0];
    c.train_model = Some("resnet152_train".into());
    let mut d = Dispatcher::new(c).unwrap();
    let mut out = Vec::new();
    d.runtime_seen(0, 0, 1, &[0], 1 << 30, 4, None, &mut out);
    d.link_up(0);
    model(&mut d, "m0");
    let trains = |out: &[Action]| {
        out.iter()
            .filter(|a| matches!(a, Action::Train { model: Some(_), .. }))
            .count()
    };
    d.tick(0, &mut out);
    assert_eq!(trains(&out), 1, "{out:?}");
    out.clear();
    // The runtime refuses (the job's model is not deployed yet).
    let gpu = Gpu {
        runtime: 0,
        device: 0,
    };
    d.train_failed(10 * MS, gpu);
    d.tick(500 * MS, &mut out);
    assert_eq!(trains(&out), 0, "not before the retry time: {out:?}");
    d.tick(1_100 * MS, &mut out);
    assert_eq!(trains(&out), 1, "asked again: {out:?}");
    out.clear();
    // Accepted this time: no more asks.
    d.tick(3_000 * MS, &mut out);
    assert_eq!(trains(&out), 0, "{out:?}");
}

#[test]
fn a_reassignment_loads_its_model_only_onto_an_idle_gpu() {
    let prefetched = |out: &[Action]| -> Vec<String> {
        out.iter()
            .filter_map(|x| match x {
                Action::Prefetch { model, .. } => Some(model.clone()),
                _ => None,
            })
            .collect()
    };
    // A seed whose first draw reassigns the GPU to `b` while it serves `a`.
    for seed in 0..64 {
        let mut c = cfg(PolicyKind::DistMind);
        c.distmind.seed = seed;
        let mut d = Dispatcher::new(c).unwrap();
        let mut out = Vec::new();
        d.runtime_seen(0, 0, 1, &[0], 1 << 30, 4, None, &mut out);
        d.link_up(0);
        let a = model(&mut d, "a");
        model(&mut d, "b");
        let r = d.submit(0, a, Some(1e6), &mut out);
        out.clear();
        d.tick(0, &mut out);
        if d.assignments()[0].models != vec!["b".to_string()] {
            continue;
        }
        assert!(
            prefetched(&out).is_empty(),
            "nothing ahead of a request the GPU is serving: {out:?}"
        );
        // Idle again: the next tick loads it.
        let t = timing(ServePath::DeviceResident, 10.0);
        d.complete(10 * MS, r, &c_of(&t, &["a".to_string()]), &mut out);
        out.clear();
        d.tick(50 * MS, &mut out);
        assert_eq!(prefetched(&out), vec!["b".to_string()], "{out:?}");
        return;
    }
    panic!("no seed in 0..64 reassigns to b first");
}

#[test]
fn cache_out_drops_the_host_copy_of_a_model_a_gpu_holds_first() {
    // One host with a cache for two 10 MB models (25 MB) and one GPU; the
    // host caches m0 and m1, the GPU holds m1 and m2.
    let mut d = Dispatcher::new(cfg(PolicyKind::DistMind)).unwrap();
    let mut out = Vec::new();
    d.runtime_seen(0, 0, 1, &[0], 25_000_000, 4, None, &mut out);
    d.link_up(0);
    let ms: Vec<u32> = (0..4).map(|k| model(&mut d, &format!("m{k}"))).collect();
    let snap = RuntimeSnapshot {
        devices: vec![DeviceSnapshot {
            device: 0,
            resident: vec!["m1".into(), "m2".into()],
            ..Default::default()
        }],
        host_cached: vec!["m0".into(), "m1".into()],
        host_cached_truncated: false,
    };
    d.runtime_seen(
        0,
        0,
        1,
        &[0],
        25_000_000,
        4,
        Some((next_seq(), &snap)),
        &mut out,
    );
    out.clear();
    // m3 needs room: m1 goes (served from the GPU), m0 stays (it is not).
    d.submit(0, ms[3], Some(1e6), &mut out);
    let evicted: Vec<String> = out
        .iter()
        .filter_map(|a| match a {
            Action::Evict { model, .. } => Some(model.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(evicted, vec!["m1".to_string()], "{out:?}");
    assert!(d.hosts[&0].cached.contains(&ms[0]));
}

fn c_of<'a>(t: &'a TimingMsg, resident: &'a [String]) -> Completion<'a> {
    Completion {
        timing: Some(t),
        resident,
    }
}

#[test]
fn bounded_pending_and_request_table() {
    let mut d = dispatcher(PolicyKind::DistMind, 1);
    let m = model(&mut d, "a");
    let mut out = Vec::new();
    for _ in 0..(LOR_OUTSTANDING_MAX as usize + PENDING_MAX + 10) {
        d.submit(0, m, Some(1e6), &mut out);
    }
    let busy = failed(&out)
        .iter()
        .filter(|(_, c)| *c == ErrorCode::Busy)
        .count();
    assert_eq!(busy, 10);
    assert_eq!(d.queued(), PENDING_MAX);
}

/// Snapshot sequence numbers for tests: every snapshot is new.
fn next_seq() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(1);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

#[test]
fn an_old_snapshot_is_applied_once_and_never_undoes_a_reply() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let m = model(&mut d, "a");
    let snap = RuntimeSnapshot {
        devices: vec![DeviceSnapshot {
            device: 0,
            ..Default::default()
        }],
        ..Default::default()
    };
    d.runtime_seen(0, 0, 1, &[0], 1 << 30, 4, Some((7, &snap)), &mut Vec::new());
    let mut out = Vec::new();
    let r = d.submit(0, m, Some(1000.0), &mut out);
    let t = timing(ServePath::Cold, 50.0);
    let resident = vec!["a".to_string()];
    d.complete(
        50 * MS,
        r,
        &Completion {
            timing: Some(&t),
            resident: &resident,
        },
        &mut out,
    );
    // The same (older) snapshot again on the next tick: "a" stays resident.
    d.runtime_seen(
        60 * MS,
        0,
        1,
        &[0],
        1 << 30,
        4,
        Some((7, &snap)),
        &mut Vec::new(),
    );
    assert_eq!(d.assignments()[0].models, vec!["a".to_string()]);
}

#[test]
fn lfu_routes_to_the_host_that_caches_the_model_and_evicts_the_least_used() {
    let mut c = cfg(PolicyKind::DistMind);
    c.balancer = Balancer::Lfu;
    let mut d = Dispatcher::new(c).unwrap();
    let mut out = Vec::new();
    // Two hosts whose caches hold two 10 MB models each (25 MB).
    for r in 0..2 {
        d.runtime_seen(0, r, 1, &[0], 25_000_000, 4, None, &mut out);
        d.link_up(r);
    }
    let ms: Vec<u32> = (0..3).map(|k| model(&mut d, &format!("m{k}"))).collect();
    let snap = RuntimeSnapshot {
        devices: vec![DeviceSnapshot {
            device: 0,
            ..Default::default()
        }],
        host_cached: vec!["m0".into(), "m1".into()],
        host_cached_truncated: false,
    };
    d.runtime_seen(
        0,
        1,
        1,
        &[0],
        25_000_000,
        4,
        Some((next_seq(), &snap)),
        &mut out,
    );
    out.clear();
    let t = timing(ServePath::HostCached, 10.0);
    let done = |d: &mut Dispatcher, id: ReqId, out: &mut Vec<Action>| {
        let c = Completion {
            timing: Some(&t),
            resident: &[],
        };
        d.complete(10 * MS, id, &c, out);
    };
    // m0 once, m1 three times: both are cached on host 1 only, so they go
    // there (host 0 is idle but lacks them).
    for (m, times) in [(ms[0], 1), (ms[1], 3)] {
        for _ in 0..times {
            let r = d.submit(0, m, Some(1e6), &mut out);
            assert_eq!(sent(&out), vec![(r, gpu(1))]);
            out.clear();
            done(&mut d, r, &mut out);
        }
    }
    // Host 0 goes away; m2 must land on host 1, whose cache is full:
    // the least frequently used idle model, m0, is cached out, and only it.
    d.runtime_down(20 * MS, 0, "test", &mut out);
    out.clear();
    let r = d.submit(20 * MS, ms[2], Some(1e6), &mut out);
    let ev: Vec<(u32, String)> = out
        .iter()
        .filter_map(|a| match a {
            Action::Evict { runtime, model } => Some((*runtime, model.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(ev, vec![(1, "m0".to_string())], "{out:?}");
    assert_eq!(sent(&out), vec![(r, gpu(1))]);
    // Cache-out is the host cache's: the device that ran m0 still holds it.
    let g1 = d.gpus.iter().find(|g| g.gpu == gpu(1)).unwrap();
    assert!(g1.resident.contains(&ms[0]), "{:?}", g1.resident);
    assert!(!d.hosts[&1].cached.contains(&ms[0]));
}

#[test]
fn baselines_route_to_a_gpu_holding_the_model_else_the_least_outstanding_and_never_place() {
    for policy in [PolicyKind::Mps, PolicyKind::Ray] {
        let mut d = dispatcher(policy, 2);
        let a = model(&mut d, "a");
        let b = model(&mut d, "b");
        make_resident(&mut d, 1, "a");
        let mut out = Vec::new();
        // No placement, no prefetch, no training on ticks.
        d.tick(0, &mut out);
        d.tick(2_000 * MS, &mut out);
        assert!(out.is_empty(), "{policy}: {out:?}");
        // `a` goes where it is resident, while that GPU has room.
        let first = d.submit(0, a, Some(1e6), &mut out);
        assert_eq!(sent(&out), vec![(first, gpu(1))], "{policy}");
        out.clear();
        // `b` is resident nowhere: any GPU may load it (the whole set is in
        // every host's memory), the least outstanding first.
        let second = d.submit(0, b, Some(1e6), &mut out);
        assert_eq!(sent(&out), vec![(second, gpu(0))], "{policy}");
        // Never a cache-out: the baselines hold every model in host memory.
        assert!(
            !out.iter().any(|a| matches!(a, Action::Evict { .. })),
            "{policy}: {out:?}"
        );
        out.clear();
        // Full GPUs: requests wait, then go out as replies come.
        let more: Vec<ReqId> = (0..20)
            .map(|_| d.submit(0, a, Some(1e6), &mut out))
            .collect();
        assert_eq!(sent(&out).len(), 2 * LOR_OUTSTANDING_MAX as usize - 2);
        out.clear();
        let t = timing(ServePath::DeviceResident, 10.0);
        let c = Completion {
            timing: Some(&t),
            resident: &["a".to_string()],
        };
        d.complete(10 * MS, first, &c, &mut out);
        assert_eq!(
            sent(&out).len(),
            1,
            "{policy}: one waiting request goes out"
        );
        assert!(more.contains(&sent(&out)[0].0));
    }
}

#[test]
fn the_gpu_bound_serves_its_first_model_only() {
    let mut d = dispatcher(PolicyKind::Gpu, 1);
    let a = model(&mut d, "a");
    let b = model(&mut d, "b");
    let mut out = Vec::new();
    let first = d.submit(0, a, Some(1e6), &mut out);
    assert_eq!(sent(&out), vec![(first, gpu(0))]);
    out.clear();
    let other = d.submit(0, b, Some(1e6), &mut out);
    assert_eq!(failed(&out), vec![(other, ErrorCode::BadRequest)]);
    let Some(Action::Fail { error, .. }) = out.first() else {
        panic!("{out:?}")
    };
    assert!(error.message.contains("one model, a"), "{}", error.message);
    out.clear();
    let again = d.submit(0, a, Some(1e6), &mut out);
    assert_eq!(sent(&out), vec![(again, gpu(0))]);
}

#[test]
fn policy_names_parse_and_name_the_baselines() {
    for (name, kind) in [
        ("distmind", PolicyKind::DistMind),
        ("slo", PolicyKind::Slo),
        ("mps", PolicyKind::Mps),
        ("ray", PolicyKind::Ray),
        ("gpu", PolicyKind::Gpu),
    ] {
        let parsed: PolicyKind = name.parse().unwrap();
        assert_eq!(parsed, kind);
        assert_eq!(parsed.as_str(), name);
        assert_eq!(kind.is_baseline(), matches!(name, "mps" | "ray" | "gpu"));
    }
    let e = "lru".parse::<PolicyKind>().unwrap_err();
    assert!(e.contains("mps") && e.contains("lru"), "{e}");
}

#[test]
fn a_dilated_clock_stretches_the_outstanding_timeout() {
    let mut c = cfg(PolicyKind::Mps);
    c.time_dilation = 3.0;
    let mut d = Dispatcher::new(c).unwrap();
    let mut out = Vec::new();
    d.runtime_seen(0, 0, 1, &[0], 1 << 30, 4, None, &mut out);
    d.link_up(0);
    let m = model(&mut d, "m");
    let req = d.submit(0, m, Some(1e9), &mut out);
    assert_eq!(sent(&out), vec![(req, gpu(0))]);
    out.clear();
    // Past the undilated timeout the request is still waiting for its reply...
    d.tick(2 * OUTSTANDING_TIMEOUT_US, &mut out);
    assert!(failed(&out).is_empty(), "{out:?}");
    // ... and past three times it, it is failed explicitly.
    d.tick(3 * OUTSTANDING_TIMEOUT_US + 1, &mut out);
    assert_eq!(failed(&out), vec![(req, ErrorCode::Internal)]);
    // A dilation below 1 would run the clock faster than real time.
    let mut bad = cfg(PolicyKind::Mps);
    bad.time_dilation = 0.5;
    assert!(Dispatcher::new(bad).unwrap_err().contains("dilation"));
}

/// Drives a dispatcher and checks its invariant on every action: each
/// request ends exactly once, in a `Send` that is completed or in a `Fail`;
/// a `Send` to a runtime reported lost is replaced, in the same call, by
/// another `Send` or a `Fail`.
#[derive(Default)]
struct Ledger {
    /// Request -> the GPU of its live `Send`.
    live: BTreeMap<ReqId, Gpu>,
    ended: HashMap<ReqId, Option<ErrorCode>>,
    submitted: Vec<ReqId>,
}

impl Ledger {
    fn apply(&mut self, out: &mut Vec<Action>) {
        for a in out.drain(..) {
            match a {
                Action::Send { req, gpu, .. } => {
                    assert!(!self.ended.contains_key(&req), "{req} sent after it ended");
                    self.live.insert(req, gpu);
                }
                Action::Fail { req, error } => {
                    assert!(
                        self.ended.insert(req, Some(error.code)).is_none(),
                        "{req} ended twice"
                    );
                    self.live.remove(&req);
                }
                _ => {}
            }
        }
    }

    fn submit(&mut self, d: &mut Dispatcher, now: Micros, m: u32, slo_ms: f64) -> ReqId {
        let mut out = Vec::new();
        let r = d.submit(now, m, Some(slo_ms), &mut out);
        self.submitted.push(r);
        self.apply(&mut out);
        r
    }

    fn complete(&mut self, d: &mut Dispatcher, now: Micros, req: ReqId) {
        assert!(self.live.contains_key(&req));
        let t = timing(ServePath::DeviceResident, 10.0);
        let mut out = Vec::new();
        assert!(d.complete(now, req, &c_of(&t, &[]), &mut out).is_some());
        assert!(self.live.remove(&req).is_some());
        self.ended.insert(req, None);
        self.apply(&mut out);
    }

    fn runtime_down(&mut self, d: &mut Dispatcher, now: Micros, runtime: u32) {
        let mut out = Vec::new();
        d.runtime_down(now, runtime, "killed", &mut out);
        self.apply(&mut out);
        // Each send there is void: the request was sent elsewhere, failed,
        // or waits at the dispatcher (a GPU's queue, pending) for a Send.
        let void: Vec<ReqId> = self
            .live
            .iter()
            .filter(|(_, g)| g.runtime == runtime)
            .map(|(&r, _)| r)
            .collect();
        for r in void {
            let waiting = d.reqs.get(&r).is_some_and(|q| q.sent_at.is_none());
            assert!(waiting, "request {r} is left on lost runtime {runtime}");
            self.live.remove(&r);
        }
    }

    fn code(&self, req: ReqId) -> Option<ErrorCode> {
        *self.ended.get(&req).expect("ended")
    }
}

#[test]
fn in_flight_requests_are_retried_once_then_fail_unavailable() {
    let mut d = dispatcher(PolicyKind::Slo, 3);
    let m = model(&mut d, "a");
    for r in 0..3 {
        make_resident(&mut d, r, "a");
    }
    let mut l = Ledger::default();
    let req = l.submit(&mut d, 0, m, 1000.0);
    let first = l.live[&req];
    l.runtime_down(&mut d, MS, first.runtime);
    let second = l.live[&req];
    assert_ne!(second, first, "sent again elsewhere");
    assert_eq!(d.counters().retried, 1);
    // Lost a second time: it already had its retry.
    let mut out = Vec::new();
    d.runtime_down(2 * MS, second.runtime, "killed again", &mut out);
    let f: Vec<&ErrorReply> = out
        .iter()
        .filter_map(|a| match a {
            Action::Fail { req: r, error } if *r == req => Some(error),
            _ => None,
        })
        .collect();
    assert_eq!(f.len(), 1, "{out:?}");
    assert_eq!(f[0].code, ErrorCode::Unavailable);
    assert!(
        f[0].message
            .contains(&format!("runtime {}", second.runtime))
            && f[0].message.contains("killed again"),
        "{}",
        f[0].message
    );
    assert!(sent(&out).is_empty());
    assert_eq!(d.counters().unavailable, 1);
    assert_eq!(d.in_flight(), 0);
}

#[test]
fn requests_no_other_gpu_can_serve_in_time_fail_at_once_naming_the_lost_runtime() {
    // `a` resident on GPU 0 (10 ms); GPU 1 would load it from the memory
    // servers (120 ms).
    let mut d = dispatcher(PolicyKind::Slo, 2);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let mut l = Ledger::default();
    // Tight (50 ms: only GPU 0 can) and loose (500 ms) requests, some in
    // flight on GPU 0, the rest in its queue.
    let tight: Vec<ReqId> = (0..3).map(|_| l.submit(&mut d, 0, m, 50.0)).collect();
    let loose = l.submit(&mut d, 0, m, 500.0);
    assert!(tight
        .iter()
        .all(|r| l.live.get(r).is_none_or(|g| *g == gpu(0))));
    l.runtime_down(&mut d, 2 * MS, 0);
    for r in &tight {
        assert_eq!(l.code(*r), Some(ErrorCode::Unavailable), "{r}");
    }
    assert_eq!(l.live.get(&loose), Some(&gpu(1)), "the loose one moved");
    // New arrivals are judged by admission as usual: `rejected`.
    let late = l.submit(&mut d, 3 * MS, m, 50.0);
    assert_eq!(l.code(late), Some(ErrorCode::Rejected));
}

#[test]
fn the_unavailable_message_names_the_runtime_and_why() {
    let mut d = dispatcher(PolicyKind::Slo, 2);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let mut out = Vec::new();
    let req = d.submit(0, m, Some(50.0), &mut out);
    out.clear();
    d.runtime_down(MS, 0, "the runtime closed the connection", &mut out);
    match &out[..] {
        [Action::Fail { req: r, error }] => {
            assert_eq!(*r, req);
            assert_eq!(error.code, ErrorCode::Unavailable);
            assert!(
                error
                    .message
                    .contains("runtime 0 was lost (the runtime closed the connection)"),
                "{}",
                error.message
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn with_every_gpu_server_lost_nothing_waits_for_one() {
    for policy in [PolicyKind::DistMind, PolicyKind::Mps, PolicyKind::Slo] {
        let mut d = dispatcher(policy, 1);
        let m = model(&mut d, "a");
        make_resident(&mut d, 0, "a");
        let mut l = Ledger::default();
        // Balancers: 8 in flight and 4 waiting for room; slo: 2 in flight,
        // 10 queued.
        let ids: Vec<ReqId> = (0..12).map(|_| l.submit(&mut d, 0, m, 1000.0)).collect();
        l.runtime_down(&mut d, MS, 0);
        for r in &ids {
            assert_eq!(l.code(*r), Some(ErrorCode::Unavailable), "{policy}: {r}");
        }
        assert_eq!(d.in_flight(), 0, "{policy}");
        assert_eq!(d.queued(), 0, "{policy}");
        // New arrivals fail at once, naming the lost runtime.
        let mut out = Vec::new();
        let r = d.submit(2 * MS, m, Some(1000.0), &mut out);
        match &out[..] {
            [Action::Fail { req, error }] => {
                assert_eq!((*req, error.code), (r, ErrorCode::Unavailable), "{policy}");
                assert!(
                    error.message.contains("runtime 0 was lost (killed)"),
                    "{policy}: {}",
                    error.message
                );
            }
            other => panic!("{policy}: {other:?}"),
        }
        // Back up: served again.
        d.link_up(0);
        out.clear();
        let r = d.submit(3 * MS, m, Some(1000.0), &mut out);
        assert_eq!(sent(&out), vec![(r, gpu(0))], "{policy}");
    }
}

#[test]
fn requests_wait_for_a_starting_gpu_server_but_not_a_lost_one() {
    let mut d = Dispatcher::new(cfg(PolicyKind::DistMind)).unwrap();
    let mut out = Vec::new();
    // Registered, its link not up yet: starting, never lost.
    d.runtime_seen(0, 0, 1, &[0], 1 << 30, 4, None, &mut out);
    let m = model(&mut d, "a");
    let r = d.submit(0, m, Some(1000.0), &mut out);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(d.queued(), 1);
    d.link_up(0);
    d.tick(10 * MS, &mut out);
    assert!(
        sent(&out).iter().any(|(q, g)| (*q, *g) == (r, gpu(0))),
        "{out:?}"
    );
}

#[test]
fn a_balancer_retries_only_what_can_still_finish_in_time() {
    let mut d = dispatcher(PolicyKind::Mps, 2);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let mut l = Ledger::default();
    // Resident service is 10 ms: at 15 ms, 20 ms of SLO leaves 5 ms.
    let short = l.submit(&mut d, 0, m, 20.0);
    let long = l.submit(&mut d, 0, m, 1000.0);
    assert_eq!(l.live.get(&short), Some(&gpu(0)));
    assert_eq!(l.live.get(&long), Some(&gpu(0)));
    l.runtime_down(&mut d, 15 * MS, 0);
    assert_eq!(l.code(short), Some(ErrorCode::Unavailable));
    assert_eq!(l.live.get(&long), Some(&gpu(1)));
}

#[test]
fn random_losses_and_returns_keep_every_request_ending_exactly_once() {
    // A small xorshift: the schedule is reproducible from the seed.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for policy in [PolicyKind::Slo, PolicyKind::DistMind, PolicyKind::Mps] {
        let mut d = dispatcher(policy, 3);
        let ms: Vec<u32> = (0..4).map(|i| model(&mut d, &format!("m{i}"))).collect();
        let mut l = Ledger::default();
        let mut down = [false; 3];
        let mut now = 0;
        for _ in 0..3000 {
            now += next(3 * MS);
            match next(20) {
                0..=9 => {
                    let m = ms[next(4) as usize];
                    let slo = [30.0, 100.0, 400.0, 2000.0][next(4) as usize];
                    l.submit(&mut d, now, m, slo);
                }
                10..=15 => {
                    if !l.live.is_empty() {
                        let k = next(l.live.len() as u64) as usize;
                        let req = *l.live.keys().nth(k).unwrap();
                        l.complete(&mut d, now, req);
                    }
                }
                16 => {
                    let r = next(3) as u32;
                    if !down[r as usize] {
                        down[r as usize] = true;
                        l.runtime_down(&mut d, now, r);
                    }
                }
                17 => {
                    let r = next(3) as u32;
                    if down[r as usize] {
                        down[r as usize] = false;
                        d.link_up(r);
                    }
                }
                _ => {
                    let mut out = Vec::new();
                    d.tick(now, &mut out);
                    l.apply(&mut out);
                }
            }
        }
        // Bring everything back and drain: every request ends.
        for r in 0..3 {
            d.link_up(r);
        }
        while !l.live.is_empty() || d.in_flight() > 0 {
            now += 10 * MS;
            let live: Vec<ReqId> = l.live.keys().copied().collect();
            for req in live {
                l.complete(&mut d, now, req);
            }
            let mut out = Vec::new();
            d.tick(now, &mut out);
            l.apply(&mut out);
        }
        for r in &l.submitted {
            assert!(l.ended.contains_key(r), "{policy}: request {r} never ended");
        }
        assert_eq!(l.ended.len(), l.submitted.len(), "{policy}");
        let c = d.counters();
        assert!(c.retried > 0 && c.unavailable > 0, "{policy}: {c:?}");
    }
}
