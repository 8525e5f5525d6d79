//! The dispatcher on a virtual clock: admission, EDF order, routing by
//! where models are, training, runtime loss, the original's balancer.

use super::*;
use crate::policy::distmind::DistMindConfig;
use distmind_common::proto::{DeviceSnapshot, ServePath, TimingMsg};

const MS: Micros = 1_000;

/// A runtime's shape with `devices`, a host cache of `cache_bytes` and room
/// for `resident_max` models a device (device bytes unknown).
fn shape(devices: &[u32], cache_bytes: u64, resident_max: u32) -> RuntimeShape {
    RuntimeShape {
        device_ids: devices.to_vec(),
        cache_bytes,
        device_bytes: 0,
        resident_models_max: resident_max,
    }
}

fn cfg(policy: PolicyKind) -> DispatchConfig {
    let mut c = DispatchConfig::new(policy, DistMindConfig::inference_only(1));
    // 10 ms compute, uploads at 1 GB/s, a 100 MB/s link: a 10 MB model is
    // 10 ms resident, 20 ms host-cached, 120 ms remote.
    c.priors = Priors {
        net_bytes_per_s: 1e8,
        h2d_bytes_per_s: 1e9,
        compute_ms: 10.0,
        batch_increment: 0.1,
    };
    // One request at a time unless a test batches: the admission and order
    // tests count whole requests.
    c.batch_max = 1;
    c
}

/// A dispatcher with `gpus` single-device runtimes, links up.
fn dispatcher(policy: PolicyKind, gpus: u32) -> Dispatcher {
    dispatcher_with(cfg(policy), gpus)
}

/// [`dispatcher`] with the `slo` policy and `window` batches outstanding
/// per GPU.
fn slo_window(window: u32, gpus: u32) -> Dispatcher {
    let mut c = cfg(PolicyKind::Slo);
    c.window = window;
    dispatcher_with(c, gpus)
}

fn dispatcher_with(c: DispatchConfig, gpus: u32) -> Dispatcher {
    let mut d = Dispatcher::new(c).unwrap();
    let mut out = Vec::new();
    for r in 0..gpus {
        d.runtime_seen(0, r, 1, &shape(&[0], 1 << 30, 4), None, &mut out);
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
        warmup: false,
    }
}

fn gpu(runtime: u32) -> Gpu {
    Gpu { runtime, device: 0 }
}

/// Marks `model` resident on runtime `r`'s device through a snapshot.
/// Runtime `r` (one device, 4 resident models at most, `cache_bytes` of
/// host cache) heartbeats at time 0 with `snap`.
fn heartbeat(d: &mut Dispatcher, r: u32, cache_bytes: u64, snap: &RuntimeSnapshot) {
    d.runtime_seen(
        0,
        r,
        1,
        &shape(&[0], cache_bytes, 4),
        Some((next_seq(), snap)),
        &mut Vec::new(),
    );
}

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
    heartbeat(d, r, 1 << 30, &snap);
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
fn a_holder_that_meets_the_deadline_beats_a_load_elsewhere() {
    // Resident on GPU 1 (10 ms each), remote on GPU 0 (120 ms): the 13th
    // request finishes at 130 ms on GPU 1, at 120 ms on GPU 0.
    for (slo_ms, loads) in [(10_000.0, 0), (125.0, 1)] {
        let mut d = dispatcher(PolicyKind::Slo, 2);
        let m = model(&mut d, "a");
        make_resident(&mut d, 1, "a");
        let mut out = Vec::new();
        let ids: Vec<ReqId> = (0..13)
            .map(|_| d.submit(0, m, Some(slo_ms), &mut out))
            .collect();
        assert!(failed(&out).is_empty(), "SLO {slo_ms} ms: {out:?}");
        let on_gpu0: Vec<ReqId> = sent(&out)
            .into_iter()
            .filter(|(_, g)| *g == gpu(0))
            .map(|(r, _)| r)
            .collect();
        if loads == 0 {
            // GPU 1 meets every deadline: nothing is loaded elsewhere,
            // though GPU 0 would finish the 13th sooner. GPU 1 got two at
            // once (its window) and queued the other eleven.
            assert!(on_gpu0.is_empty(), "SLO {slo_ms} ms: {out:?}");
            assert_eq!(sent(&out).len(), 2);
            assert_eq!(d.queued(), 11);
        } else {
            // Only a load on GPU 0 meets the 13th's 125 ms.
            assert_eq!(on_gpu0, vec![ids[12]], "SLO {slo_ms} ms: {out:?}");
        }
    }
}

/// A model whose batch is in flight to a GPU stays in the dispatcher's view
/// of that GPU when an earlier batch answers with a resident list from
/// before the load; once nothing is in flight, the list is taken as is.
#[test]
fn a_model_on_its_way_to_a_gpu_stays_in_view_when_an_earlier_batch_answers() {
    let mut d = slo_window(2, 1);
    let a = model(&mut d, "a");
    let b = model(&mut d, "b");
    make_resident(&mut d, 0, "a");
    let mut out = Vec::new();
    let first = d.submit(0, a, Some(1000.0), &mut out);
    let second = d.submit(0, b, Some(1000.0), &mut out);
    assert_eq!(sent(&out).len(), 2, "{out:?}");
    assert_eq!(d.where_is(0, b), Where::Resident);
    // The device answers "a" before it loads "b": its list has "a" alone.
    let only_a = vec!["a".to_string()];
    let t = timing(ServePath::DeviceResident, 10.0);
    d.complete(10 * MS, first, &c_of(&t, &only_a), &mut out);
    assert_eq!(d.where_is(0, b), Where::Resident);
    assert_eq!(d.resident_on.get(b), &[0]);
    // Nothing in flight: the answer's list is the truth ("b" was evicted).
    let t = timing(ServePath::HostCached, 30.0);
    d.complete(50 * MS, second, &c_of(&t, &only_a), &mut out);
    assert_ne!(d.where_is(0, b), Where::Resident);
    assert!(d.resident_on.get(b).is_empty());
}

#[test]
fn the_host_cache_view_keeps_what_fits_most_recent_first() {
    let bytes = |m: u32| [40, 30, 30, 50][m as usize];
    let mut c = HostCached::from_mru(vec![2, 1, 2]);
    assert_eq!(
        c.iter().collect::<Vec<_>>(),
        vec![2, 1],
        "a repeat is dropped"
    );
    c.insert_oldest(0);
    assert_eq!(c.iter().collect::<Vec<_>>(), vec![2, 1, 0]);
    // 100 bytes hold 0, 1 and 2 (100); loading 3 (50) pushes out the least
    // recent until it fits: 0, then 1.
    c.load(3, 100, bytes);
    assert_eq!(c.iter().collect::<Vec<_>>(), vec![3, 2]);
    assert!(!c.contains(&0) && !c.contains(&1) && c.contains(&3));
    // Loading one already there makes it the most recent.
    c.load(2, 100, bytes);
    assert_eq!(c.iter().collect::<Vec<_>>(), vec![2, 3]);
    // A model larger than the cache stays alone; 0 bytes: no bound.
    c.load(0, 10, bytes);
    assert_eq!(c.iter().collect::<Vec<_>>(), vec![0]);
    c.load(1, 0, bytes);
    c.load(3, 0, bytes);
    assert_eq!(c.iter().collect::<Vec<_>>(), vec![3, 1, 0]);
    c.remove(&1);
    assert_eq!(c.iter().collect::<Vec<_>>(), vec![3, 0]);
    c.clear();
    assert_eq!(c.iter().count(), 0);
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
    heartbeat(&mut d, 0, 1 << 30, &snap);
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

/// A reply the lost runtime sent before it went (or one its connection
/// delivered late) names a request that is queued again elsewhere: it is
/// dropped, and the request runs where it is queued.
#[test]
fn a_late_reply_from_a_lost_runtime_does_not_answer_a_request_queued_again() {
    let mut d = dispatcher(PolicyKind::Slo, 2);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    make_resident(&mut d, 1, "a");
    let mut out = Vec::new();
    let ids: Vec<ReqId> = (0..6)
        .map(|_| d.submit(0, m, Some(10_000.0), &mut out))
        .collect();
    let on0: Vec<ReqId> = sent(&out)
        .into_iter()
        .filter(|(_, g)| *g == gpu(0))
        .map(|(r, _)| r)
        .collect();
    assert!(!on0.is_empty(), "{out:?}");
    out.clear();
    d.runtime_down(5 * MS, 0, "killed", &mut out);
    let again: Vec<ReqId> = sent(&out).iter().map(|(r, _)| *r).collect();
    let requeued: Vec<ReqId> = on0.iter().copied().filter(|r| !again.contains(r)).collect();
    assert!(
        !requeued.is_empty(),
        "GPU 1's window took them all: {out:?}"
    );
    let queued = d.queued();
    let t = timing(ServePath::DeviceResident, 10.0);
    for &r in &requeued {
        // The network layer asks first and drops the reply; the core drops
        // it too.
        assert!(d.waits_to_be_sent(r));
        assert!(d.complete(6 * MS, r, &c_of(&t, &[]), &mut out).is_none());
    }
    assert!(again.iter().all(|&r| !d.waits_to_be_sent(r)));
    assert!(!d.waits_to_be_sent(ReqId::MAX), "an unknown request");
    assert_eq!(
        d.queued(),
        queued,
        "the late replies took nothing off the queue"
    );
    assert_eq!(d.in_flight(), ids.len());
    // Answered where they run now, every request once.
    let mut answered = 0;
    let mut now = 10 * MS;
    while answered < ids.len() {
        out.clear();
        let running: Vec<ReqId> = ids
            .iter()
            .copied()
            .filter(|r| d.reqs.get(r).is_some_and(|x| x.sent_at.is_some()))
            .collect();
        assert!(!running.is_empty(), "nothing runs with {answered} answered");
        for r in running {
            assert!(d.complete(now, r, &c_of(&t, &[]), &mut out).is_some());
            answered += 1;
        }
        now += 10 * MS;
    }
    assert_eq!((d.in_flight(), d.queued()), (0, 0));
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
        d.runtime_seen(0, r, 1, &shape(&[0], 1 << 30, 4), None, &mut out);
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
    d.runtime_seen(0, 0, 1, &shape(&[0], 1 << 30, 4), None, &mut out);
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
        d.runtime_seen(0, 0, 1, &shape(&[0], 1 << 30, 4), None, &mut out);
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
    d.runtime_seen(0, 0, 1, &shape(&[0], 25_000_000, 4), None, &mut out);
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
        &shape(&[0], 25_000_000, 4),
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
    d.runtime_seen(
        0,
        0,
        1,
        &shape(&[0], 1 << 30, 4),
        Some((7, &snap)),
        &mut Vec::new(),
    );
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
        &shape(&[0], 1 << 30, 4),
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
        d.runtime_seen(0, r, 1, &shape(&[0], 25_000_000, 4), None, &mut out);
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
        &shape(&[0], 25_000_000, 4),
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
    d.runtime_seen(0, 0, 1, &shape(&[0], 1 << 30, 4), None, &mut out);
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

/// A runtime that hangs (stopped, its host cut off) is declared lost only
/// after missed heartbeats: a request it holds is answered
/// `deadline_exceeded` once its deadline and grace are past, its reply (if
/// it comes after) answers nothing, and its GPU goes silent: what is queued
/// for it moves to another GPU at once, and nothing is routed to it until
/// it heartbeats or answers.
#[test]
fn a_request_in_flight_unanswered_past_its_deadline_and_grace_is_given_up() {
    let mut d = slo_window(1, 2);
    let mut out = Vec::new();
    let m = model(&mut d, "a");
    // Resident on GPU 0 only (10 ms there, 120 ms to load on GPU 1): GPU 0
    // takes the first and queues the next two.
    make_resident(&mut d, 0, "a");
    let first = d.submit(0, m, Some(100.0), &mut out);
    let queued: Vec<ReqId> = (0..2)
        .map(|_| d.submit(0, m, Some(1_000.0), &mut out))
        .collect();
    assert_eq!(sent(&out), vec![(first, gpu(0))]);
    assert_eq!(d.queued(), 2);
    out.clear();
    // The grace is its SLO (the estimated device time, 10 ms, is shorter).
    let overdue = 100 * MS + 100 * MS;
    d.tick(overdue, &mut out);
    assert!(out.is_empty(), "not yet: {out:?}");
    d.tick(overdue + 1, &mut out);
    assert_eq!(failed(&out), vec![(first, ErrorCode::DeadlineExceeded)]);
    let Action::Fail { error, .. } = &out[0] else {
        unreachable!()
    };
    assert!(
        error.message.contains("has not answered") && error.message.contains("100 ms SLO"),
        "{}",
        error.message
    );
    assert_eq!(d.counters().deadline_exceeded, 1);
    // Its queue went to GPU 1, which can still meet their deadlines.
    assert_eq!(sent(&out), vec![(queued[0], gpu(1))]);
    out.clear();
    // Its late reply answers nothing and counts nothing.
    let t = timing(ServePath::DeviceResident, 10.0);
    assert!(d
        .complete(overdue + 2, first, &c_of(&t, &[]), &mut out)
        .is_none());
    assert_eq!(d.counters().completed, 0);
    assert!(
        !d.gpus.routable(0),
        "silent still: the core no longer held it"
    );
    // Silent, it gets no new request, though its model is resident there.
    let next = d.submit(overdue + 3, m, Some(1_000.0), &mut out);
    assert!(sent(&out).iter().all(|(_, g)| *g != gpu(0)), "{out:?}");
    assert!(failed(&out).is_empty(), "{out:?}");
    out.clear();
    // A heartbeat saying a request still waits on its device (stuck there)
    // changes nothing; one saying nothing waits does.
    let stuck = RuntimeSnapshot {
        devices: vec![DeviceSnapshot {
            device: 0,
            queued: 1,
            resident: vec!["a".into()],
            ..Default::default()
        }],
        ..Default::default()
    };
    heartbeat(&mut d, 0, 1 << 30, &stuck);
    d.submit(overdue + 4, m, Some(1_000.0), &mut out);
    assert!(sent(&out).iter().all(|(_, g)| *g != gpu(0)), "{out:?}");
    out.clear();
    make_resident(&mut d, 0, "a");
    let later = d.submit(overdue + 5, m, Some(1_000.0), &mut out);
    assert_eq!(sent(&out), vec![(later, gpu(0))]);
    assert!(d.reqs.contains_key(&next));
}

/// The network layer drops a reply for a request given up, and tells the
/// core that its GPU answered: a silent GPU is routed to again at once.
#[test]
fn a_late_answer_from_a_silent_gpu_makes_it_routable_again() {
    let mut d = slo_window(1, 1);
    let mut out = Vec::new();
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let first = d.submit(0, m, Some(100.0), &mut out);
    out.clear();
    d.tick(200 * MS + 1, &mut out);
    assert_eq!(failed(&out), vec![(first, ErrorCode::DeadlineExceeded)]);
    assert!(!d.gpus.routable(0));
    out.clear();
    d.answered_late(200 * MS + 2, gpu(0));
    assert!(d.gpus.routable(0));
    let next = d.submit(200 * MS + 3, m, Some(100.0), &mut out);
    assert_eq!(sent(&out), vec![(next, gpu(0))]);
    // An answer from a GPU it does not know changes nothing.
    d.answered_late(200 * MS + 4, gpu(7));
}

/// A GPU that answers is working through a backlog, not hung: a request
/// it holds past its deadline and grace is given up, but the GPU is still
/// routed to.
#[test]
fn a_gpu_that_answers_is_not_silenced_by_a_request_given_up() {
    let mut d = slo_window(2, 1);
    let mut out = Vec::new();
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let slow = d.submit(0, m, Some(1_000.0), &mut out);
    let late = d.submit(0, m, Some(100.0), &mut out);
    assert_eq!(sent(&out).len(), 2, "{out:?}");
    out.clear();
    let t = timing(ServePath::DeviceResident, 150.0);
    assert!(d
        .complete(150 * MS, slow, &c_of(&t, &[]), &mut out)
        .is_some());
    out.clear();
    d.tick(200 * MS + 1, &mut out);
    assert_eq!(failed(&out), vec![(late, ErrorCode::DeadlineExceeded)]);
    out.clear();
    // It answered 51 ms ago, within the grace (100 ms): still routed to.
    let next = d.submit(200 * MS + 2, m, Some(1_000.0), &mut out);
    assert_eq!(sent(&out), vec![(next, gpu(0))]);
}

/// A GPU that answers nothing pumps its queue no more: a request queued
/// for it is answered `deadline_exceeded` at the first tick past its
/// deadline, not when the GPU's runtime is declared lost.
#[test]
fn a_request_queued_for_a_gpu_that_runs_nothing_is_answered_at_its_deadline() {
    let mut d = slo_window(1, 1);
    let mut out = Vec::new();
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    // A window of one batch (of one here): the first runs, the next two queue.
    let first = d.submit(0, m, Some(1_000.0), &mut out);
    let second = d.submit(0, m, Some(100.0), &mut out);
    let third = d.submit(0, m, Some(500.0), &mut out);
    assert_eq!(sent(&out), vec![(first, gpu(0))]);
    assert_eq!(d.queued(), 2);
    out.clear();
    d.tick(100 * MS, &mut out);
    assert!(
        failed(&out).is_empty(),
        "at its deadline, not past it: {out:?}"
    );
    d.tick(100 * MS + 1, &mut out);
    assert_eq!(failed(&out), vec![(second, ErrorCode::DeadlineExceeded)]);
    let Action::Fail { error, .. } = &out[0] else {
        unreachable!()
    };
    assert!(
        error.message.contains("dropped before it ran"),
        "{}",
        error.message
    );
    assert!(sent(&out).is_empty(), "{out:?}");
    assert_eq!(d.queued(), 1);
    out.clear();
    // The first's reply comes at last: the third runs.
    let t = timing(ServePath::DeviceResident, 10.0);
    assert!(d
        .complete(150 * MS, first, &c_of(&t, &[]), &mut out)
        .is_some());
    assert_eq!(sent(&out), vec![(third, gpu(0))]);
    assert_eq!(d.queued(), 0);
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
    d.runtime_seen(0, 0, 1, &shape(&[0], 1 << 30, 4), None, &mut out);
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

// ----------------------------------------------------------------------
// Admission that tracks the device, batching, switch-aware order.
// ----------------------------------------------------------------------

/// A workload and a device for [`run_device`]: requests every `gap_ms`
/// with `slo_ms`; batches take `device_ms` plus `inc_ms` per extra
/// request; replies reach the dispatcher `net_ms` after the device.
struct Load {
    requests: u64,
    gap_ms: f64,
    slo_ms: f64,
    device_ms: f64,
    inc_ms: f64,
    net_ms: f64,
}

/// A device as the runtime runs it (batches in arrival order) under `l`,
/// every request for `model`. Returns (rejected, late, served).
fn run_device(d: &mut Dispatcher, model: u32, l: &Load) -> (u64, u64, u64) {
    use std::collections::BTreeMap;
    let Load {
        requests,
        gap_ms,
        slo_ms,
        device_ms,
        inc_ms,
        net_ms,
    } = *l;
    let us = |ms: f64| (ms * 1e3) as Micros;
    let resident = vec![d.model_name(model).to_string()];
    // Replies due: time -> (req, batch size, device time).
    let mut replies: BTreeMap<(Micros, ReqId), (u32, f64)> = BTreeMap::new();
    let mut device_free: Micros = 0;
    let mut arrival: HashMap<ReqId, Micros> = HashMap::new();
    let (mut late, mut served) = (0, 0);
    let mut out = Vec::new();
    let mut next = 0u64;
    let handle = |out: &mut Vec<Action>,
                  now: Micros,
                  replies: &mut BTreeMap<(Micros, ReqId), (u32, f64)>,
                  device_free: &mut Micros| {
        for a in out.drain(..) {
            if let Action::Send { req, batch, .. } = a {
                let n = batch.len() as u32 + 1;
                let took = device_ms + inc_ms * f64::from(n - 1);
                let start = (*device_free).max(now);
                *device_free = start + us(took);
                for id in std::iter::once(req).chain(batch.iter().map(|m| m.req)) {
                    replies.insert((*device_free + us(net_ms), id), (n, took));
                }
            }
        }
    };
    loop {
        let t_arrive = us(next as f64 * gap_ms);
        let t_reply = replies.keys().next().map(|k| k.0);
        match t_reply {
            Some(t) if next >= requests || t <= t_arrive => {
                let ((now, id), (n, took)) = replies.pop_first().unwrap();
                let mut t = timing(ServePath::DeviceResident, took);
                t.batch_requests = n;
                let c = Completion {
                    timing: Some(&t),
                    resident: &resident,
                };
                d.complete(now, id, &c, &mut out).unwrap();
                served += 1;
                if now - arrival[&id] > us(slo_ms) {
                    late += 1;
                }
                handle(&mut out, now, &mut replies, &mut device_free);
            }
            _ if next < requests => {
                let id = d.submit(t_arrive, model, Some(slo_ms), &mut out);
                arrival.insert(id, t_arrive);
                next += 1;
                handle(&mut out, t_arrive, &mut replies, &mut device_free);
            }
            _ => break,
        }
    }
    (d.counters().rejected, late, served)
}

/// The `slo` policy at 83% load with replies 3 ms behind the device: it
/// served everything in time, but rejected most requests, when its view of
/// the device drifted. Every estimate carried the round trip's overhead as
/// device time, and the device was only seen free again once idle at a
/// reply, which a continuously busy window never is.
#[test]
fn a_busy_device_with_slow_replies_is_not_seen_ever_busier() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let load = Load {
        requests: 2000,
        gap_ms: 12.0,
        slo_ms: 60.0,
        device_ms: 10.0,
        inc_ms: 0.0,
        net_ms: 3.0,
    };
    let (rejected, late, served) = run_device(&mut d, m, &load);
    assert_eq!((rejected, late, served), (0, 0, 2000));
}

/// Batching under overload: one model, requests every 4 ms, 10 ms each
/// alone and 1 ms per extra request in a batch. One at a time the device
/// serves 100 req/s of the 250 offered; with batches of up to 8 all of
/// them, in time, and admission counts a request that joins a batch as
/// its increment (it would reject most of them otherwise).
#[test]
fn batches_serve_what_one_at_a_time_cannot_and_admission_counts_them() {
    let run = |batch_max: u32| {
        let mut c = cfg(PolicyKind::Slo);
        c.batch_max = batch_max;
        let mut d = Dispatcher::new(c).unwrap();
        d.runtime_seen(0, 0, 1, &shape(&[0], 1 << 30, 4), None, &mut Vec::new());
        d.link_up(0);
        let m = model(&mut d, "a");
        make_resident(&mut d, 0, "a");
        // The fitted increment: one batch of 8 observed.
        let meta = d.models[m as usize].meta.clone();
        d.cost.observe(m, &meta, Where::Resident, 10.0, None, 10.0);
        d.cost.observe_batch(m, &meta, Where::Resident, 8, 17.0);
        let load = Load {
            requests: 1000,
            gap_ms: 4.0,
            slo_ms: 100.0,
            device_ms: 10.0,
            inc_ms: 1.0,
            net_ms: 0.5,
        };
        let r = run_device(&mut d, m, &load);
        (r, d.counters().clone())
    };
    let ((rejected, late, served), _) = run(1);
    assert!(rejected > 500, "one at a time: {rejected} rejected");
    assert_eq!(late + served, 1000 - rejected + late);
    let ((rejected, late, served), c) = run(8);
    assert_eq!((rejected, late, served), (0, 0, 1000));
    let mean = c.batched_requests as f64 / c.batches as f64;
    assert!(mean > 2.0 && mean <= 8.0, "mean batch {mean}");
}

/// A dispatcher whose one GPU is busy (an outstanding request holds its
/// window of 1) with a random queue behind it, models "a".."c", "a"
/// resident, costs observed (10 ms resident, 30 ms to load, 2 ms per extra
/// request in a batch).
fn random_queue(
    rng: &mut rand::rngs::StdRng,
    reorder: bool,
    efficient: bool,
) -> (Dispatcher, ReqId) {
    use rand::Rng;
    let mut c = cfg(PolicyKind::Slo);
    c.batch_max = 4;
    c.window = 1;
    c.reorder = reorder;
    c.efficient_order = efficient;
    let mut d = Dispatcher::new(c).unwrap();
    d.runtime_seen(0, 0, 1, &shape(&[0], 1 << 30, 4), None, &mut Vec::new());
    d.link_up(0);
    let ms: Vec<u32> = ["a", "b", "c"].iter().map(|n| model(&mut d, n)).collect();
    make_resident(&mut d, 0, "a");
    let meta = d.models[0].meta.clone();
    d.cost.observe(0, &meta, Where::Resident, 10.0, None, 10.0);
    d.cost
        .observe(0, &meta, Where::HostCached, 30.0, None, 30.0);
    d.cost.observe_batch(0, &meta, Where::Resident, 2, 12.0);
    let mut out = Vec::new();
    let first = d.submit(0, ms[0], Some(1000.0), &mut out);
    for i in 0..rng.gen_range(1..12) {
        let m = ms[rng.gen_range(0..3)];
        d.submit(i, m, Some(rng.gen_range(20.0..300.0)), &mut out);
    }
    (d, first)
}

/// A queue as it was: (slot, service, model, id) in EDF order.
type QueueView = Vec<(Slot, Micros, u32, ReqId)>;

/// Completes `first` at `now` and returns the queue as it was before and
/// the batch sent next (its head and members).
fn next_batch(
    d: &mut Dispatcher,
    first: ReqId,
    now: Micros,
) -> (QueueView, Option<(ReqId, Vec<BatchMate>)>) {
    let queue: Vec<_> = d.gpus[0]
        .queue
        .iter()
        .map(|(slot, s, id)| (slot, s, d.reqs[id].model, *id))
        .collect();
    let mut out = Vec::new();
    let t = timing(ServePath::DeviceResident, 10.0);
    let resident = vec!["a".to_string()];
    d.complete(now, first, &c_of(&t, &resident), &mut out);
    let send = out.into_iter().find_map(|a| match a {
        Action::Send { req, batch, .. } => Some((req, batch)),
        _ => None,
    });
    (queue, send)
}

/// Device time of a request for `model` alone and of a batch of `n`
/// beyond it, on the dispatcher's cost model (as the schedule below uses
/// them).
fn costs(d: &Dispatcher, model: u32, n: usize) -> (Micros, Micros) {
    let meta = &d.models[model as usize].meta;
    let at = d.where_is(0, model);
    (
        d.cost.estimate(model, meta, at),
        d.cost.batch_extra(model, meta, n as u32),
    )
}

/// Checks, on the cost model, that the batch sent ends every member in
/// time and makes no other queued request late that EDF one at a time
/// (with the same estimates) ends in time.
fn check_batch(
    d: &Dispatcher,
    now: Micros,
    queue: &[(Slot, Micros, u32, ReqId)],
    send: &(ReqId, Vec<BatchMate>),
) {
    let ids: Vec<ReqId> = std::iter::once(send.0)
        .chain(send.1.iter().map(|m| m.req))
        .collect();
    let lead = queue.iter().find(|q| q.3 == send.0).unwrap().2;
    let (one, extra) = costs(d, lead, ids.len());
    let start = now + d.cost.overhead();
    let batch_end = start + one + extra;
    let mut t = batch_end;
    let mut edf = start;
    for (i, &(slot, s, model, id)) in queue.iter().enumerate() {
        // EDF runs its head where the head's model is now; the rest as
        // admitted.
        let s = if i == 0 { costs(d, model, 1).0 } else { s };
        edf += s;
        if ids.contains(&id) {
            assert_eq!(model, lead, "a batch carries one model");
            // The head alone is what EDF sends, late or not.
            let late_head_alone = ids.len() == 1 && id == queue[0].3;
            assert!(
                batch_end <= slot.0 || late_head_alone,
                "member {id} ends at {batch_end} past its deadline {}: {queue:?} batch {ids:?}",
                slot.0
            );
            continue;
        }
        t += s;
        assert!(
            t <= slot.0 || edf > slot.0,
            "request {id} (deadline {}) ends at {t}; EDF alone ends it at {edf}: {queue:?} batch {ids:?}",
            slot.0
        );
    }
    // Members are taken in EDF order: none of the model's skipped between.
    let positions: Vec<usize> = ids
        .iter()
        .map(|id| queue.iter().position(|q| q.3 == *id).unwrap())
        .collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
}

#[test]
fn batches_never_break_a_deadline_on_the_cost_model() {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut batched = 0;
    for _ in 0..2000 {
        let (mut d, first) = random_queue(&mut rng, false, false);
        let now = 10 * MS;
        let (queue, send) = next_batch(&mut d, first, now);
        let Some(send) = send else { continue };
        // Without reordering the EDF head leads.
        assert_eq!(send.0, queue[0].3);
        check_batch(&d, now, &queue, &send);
        batched += usize::from(!send.1.is_empty());
    }
    assert!(batched > 200, "only {batched} of 2000 queues batched");
}

/// Both switch-aware orders: only a resident model's batch passes the EDF
/// head, and no batch makes a request late that EDF would end in time.
#[test]
fn reordering_never_misses_a_deadline_edf_would_meet() {
    use rand::SeedableRng;
    for (efficient, seed) in [(false, 11), (true, 13)] {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut reordered = 0;
        for _ in 0..2000 {
            let (mut d, first) = random_queue(&mut rng, true, efficient);
            let now = 10 * MS;
            let (queue, send) = next_batch(&mut d, first, now);
            let Some(send) = send else { continue };
            if send.0 != queue[0].3 {
                reordered += 1;
                let lead = queue.iter().find(|q| q.3 == send.0).unwrap().2;
                assert_eq!(lead, 0, "efficient {efficient}: {queue:?}");
                if !efficient {
                    // Without the efficient order it passes only a head
                    // that must be loaded.
                    assert_ne!(queue[0].2, 0);
                }
            }
            check_batch(&d, now, &queue, &send);
        }
        assert!(
            reordered > 100,
            "efficient {efficient}: only {reordered} of 2000 queues reordered"
        );
    }
}

/// A GPU runs the larger batch of a resident model before a lone request
/// for another resident model at the head of its queue, when that makes
/// the lone one no later than its deadline; in EDF order without it.
#[test]
fn the_efficient_order_runs_a_larger_batch_before_a_lone_head() {
    let run = |efficient: bool| {
        let mut c = cfg(PolicyKind::Slo);
        c.window = 1;
        c.batch_max = 8;
        c.efficient_order = efficient;
        let mut d = Dispatcher::new(c).unwrap();
        d.runtime_seen(0, 0, 1, &shape(&[0], 1 << 30, 4), None, &mut Vec::new());
        d.link_up(0);
        let a = model(&mut d, "a");
        let b = model(&mut d, "b");
        make_resident(&mut d, 0, "a");
        make_resident(&mut d, 0, "b");
        for m in [a, b] {
            let meta = d.models[m as usize].meta.clone();
            d.cost.observe(m, &meta, Where::Resident, 10.0, None, 10.0);
            d.cost.observe_batch(m, &meta, Where::Resident, 4, 16.0);
        }
        let mut out = Vec::new();
        let first = d.submit(0, a, Some(1000.0), &mut out);
        // "b" is the EDF head behind the request in flight; four for "a"
        // queue behind it with later deadlines.
        let lone = d.submit(0, b, Some(500.0), &mut out);
        let four: Vec<ReqId> = (0..4)
            .map(|_| d.submit(0, a, Some(600.0), &mut out))
            .collect();
        out.clear();
        let t = timing(ServePath::DeviceResident, 10.0);
        let resident = vec!["a".to_string(), "b".to_string()];
        d.complete(10 * MS, first, &c_of(&t, &resident), &mut out);
        let send = out.iter().find_map(|x| match x {
            Action::Send { req, batch, .. } => {
                Some((*req, batch.iter().map(|m| m.req).collect::<Vec<_>>()))
            }
            _ => None,
        });
        (send.expect("a batch goes"), lone, four)
    };
    let ((head, mates), _, four) = run(true);
    assert_eq!((head, mates), (four[0], four[1..].to_vec()));
    let ((head, mates), lone, _) = run(false);
    assert_eq!((head, mates), (lone, vec![]));
}

#[test]
fn a_batch_is_answered_per_request_and_frees_its_slot_once() {
    let mut c = cfg(PolicyKind::Slo);
    c.window = 1;
    c.batch_max = 8;
    let mut d = Dispatcher::new(c).unwrap();
    d.runtime_seen(0, 0, 1, &shape(&[0], 1 << 30, 4), None, &mut Vec::new());
    d.link_up(0);
    let a = model(&mut d, "a");
    let b = model(&mut d, "b");
    make_resident(&mut d, 0, "a");
    let mut out = Vec::new();
    let first = d.submit(0, a, Some(1000.0), &mut out);
    let mates: Vec<ReqId> = (0..3)
        .map(|_| d.submit(0, a, Some(1000.0), &mut out))
        .collect();
    let other = d.submit(0, b, Some(1000.0), &mut out);
    assert_eq!(sent(&out), vec![(first, gpu(0))]);
    out.clear();
    let resident = vec!["a".to_string()];
    let t = timing(ServePath::DeviceResident, 10.0);
    d.complete(10 * MS, first, &c_of(&t, &resident), &mut out);
    // One Send: the three for "a" together; "b" waits for the window.
    let sends: Vec<_> = out
        .iter()
        .filter_map(|a| match a {
            Action::Send { req, batch, .. } => {
                Some((*req, batch.iter().map(|m| m.req).collect::<Vec<_>>()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(sends, vec![(mates[0], vec![mates[1], mates[2]])]);
    out.clear();
    let mut t = timing(ServePath::DeviceResident, 12.0);
    t.batch_requests = 3;
    // The first reply frees the window: "b" goes.
    let info = d
        .complete(22 * MS, mates[1], &c_of(&t, &resident), &mut out)
        .unwrap();
    assert_eq!(info.total_ms, 22.0);
    assert_eq!(sent(&out), vec![(other, gpu(0))]);
    out.clear();
    for &id in &[mates[0], mates[2]] {
        assert!(d
            .complete(22 * MS, id, &c_of(&t, &resident), &mut out)
            .is_some());
        assert!(out.is_empty(), "the slot is freed once: {out:?}");
    }
    // Each answered once.
    assert!(d
        .complete(23 * MS, mates[0], &c_of(&t, &resident), &mut out)
        .is_none());
    let c = d.counters();
    assert_eq!(
        (c.sent, c.completed, c.batches, c.batched_requests),
        (5, 4, 3, 5)
    );
    assert_eq!(d.gpus[0].outstanding, 1);
    assert!(d.batches.len() == 1, "only b's batch is open");
    // The batch of 3 was learnt: 2 ms over one request.
    let meta = d.models[a as usize].meta.clone();
    assert_eq!(d.cost.batch_extra(a, &meta, 3), 2_000);
}

/// An idle GPU prefetching a hot model was charged the prior's load time
/// until it went idle again at a reply, so for that long the `slo` policy
/// rejected even requests for the model it held. The prefetch's own reply
/// ends the charge, and its measured load replaces the prior.
#[test]
fn a_prefetch_occupies_its_gpu_until_its_reply_only() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let a = model(&mut d, "a");
    let b = model(&mut d, "b");
    make_resident(&mut d, 0, "a");
    // "b" is requested much more than "a" and resident nowhere.
    d.models[a as usize].rate.observe(1.0);
    d.models[b as usize].rate.observe(10.0);
    let mut out = Vec::new();
    d.tick(0, &mut out);
    let prefetch = out
        .iter()
        .any(|x| matches!(x, Action::Prefetch { model, .. } if model == "b"));
    assert!(prefetch, "{out:?}");
    out.clear();
    // The prior says 10 ms of upload: meanwhile a 15 ms SLO cannot be met.
    let r = d.submit(MS, a, Some(15.0), &mut out);
    assert_eq!(failed(&out), vec![(r, ErrorCode::Rejected)]);
    out.clear();
    // The runtime took 2 ms.
    d.prefetched(2 * MS, gpu(0), "b", ServePath::HostCached, 2.0);
    d.prefetch_done(2 * MS, gpu(0), None);
    let r = d.submit(2 * MS, a, Some(15.0), &mut out);
    assert_eq!(sent(&out), vec![(r, gpu(0))]);
    // Loading "b" from the host cache is now 2 ms + its compute.
    let meta = d.models[b as usize].meta.clone();
    assert_eq!(d.cost.estimate(b, &meta, Where::HostCached), 12 * MS);
}

#[test]
fn an_idle_gpu_prefetches_only_what_is_clearly_hotter_than_what_it_holds() {
    for (rate_b, prefetches) in [(1.2, false), (2.0, true)] {
        let mut d = dispatcher(PolicyKind::Slo, 1);
        let a = model(&mut d, "a");
        let b = model(&mut d, "b");
        make_resident(&mut d, 0, "a");
        d.models[a as usize].rate.observe(1.0);
        d.models[b as usize].rate.observe(rate_b);
        let mut out = Vec::new();
        d.tick(0, &mut out);
        let sent = out.iter().any(|x| matches!(x, Action::Prefetch { .. }));
        assert_eq!(sent, prefetches, "b at {rate_b}x a's rate: {out:?}");
    }
}

/// Routing sends a request to a GPU that holds its model whenever one meets
/// the deadline, so a hot model held by one GPU queued there while others
/// idled (`simulate` at the paper's scale, 32 GPUs, closed loop: 3785 req/s
/// where the one-model bound is 8860). An idle GPU with room for it and one
/// more model now takes a copy of a model whose holders it keeps more than
/// [`REPLICA_LOAD`] busy each, and nothing else.
#[test]
fn a_model_that_keeps_its_holders_busy_is_copied_onto_idle_gpus_with_room() {
    // (a's rate in req/s, each GPU's parameter memory, copies wanted). Each
    // request takes 10 ms (the prior), so 20 req/s keep one GPU 20% busy.
    for (rate, device_bytes, copies) in [
        (5.0, 1 << 30, 0),
        (20.0, 1 << 30, 1),
        (50.0, 1 << 30, 2),
        // Room for a but not for one more model besides.
        (50.0, 15_000_000, 0),
        // Not known: no copies.
        (50.0, 0, 0),
    ] {
        let mut d = Dispatcher::new(cfg(PolicyKind::Slo)).unwrap();
        let mut out = Vec::new();
        for r in 0..3 {
            let shape = RuntimeShape {
                device_bytes,
                ..shape(&[0], 1 << 30, 4)
            };
            d.runtime_seen(0, r, 1, &shape, None, &mut out);
            d.link_up(r);
        }
        let a = model(&mut d, "a");
        make_resident(&mut d, 0, "a");
        d.models[a as usize].rate.observe(rate);
        d.tick(0, &mut out);
        let to: Vec<Gpu> = out
            .iter()
            .filter_map(|x| match x {
                Action::Prefetch { gpu, model } if model == "a" => Some(*gpu),
                _ => None,
            })
            .collect();
        assert_eq!(to.len(), copies, "{rate} req/s, {device_bytes} B: {out:?}");
        assert!(!to.contains(&gpu(0)), "its holder: {out:?}");
        assert_eq!(out.len(), copies, "nothing else: {out:?}");
    }
}

/// The dispatcher learns a model on its first request; a snapshot that
/// named it cached before then was dropped, so a warm host cache looked
/// cold (remote) until the next heartbeat, and the `slo` policy rejected
/// every request for a model not resident for that long.
#[test]
fn a_warm_cache_is_warm_for_models_first_asked_for_after_the_snapshot() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let snap = RuntimeSnapshot {
        devices: vec![DeviceSnapshot {
            device: 0,
            ..Default::default()
        }],
        host_cached: vec!["a".into()],
        host_cached_truncated: false,
    };
    heartbeat(&mut d, 0, 1 << 30, &snap);
    let a = model(&mut d, "a");
    let b = model(&mut d, "b");
    assert_eq!(d.where_is(0, a), Where::HostCached);
    assert_eq!(d.where_is(0, b), Where::Remote);
    // 20 ms from the host cache, 120 ms remote: a 50 ms SLO is met for "a".
    let mut out = Vec::new();
    let r = d.submit(0, a, Some(50.0), &mut out);
    assert_eq!(sent(&out), vec![(r, gpu(0))]);
}

#[test]
fn a_queued_request_is_dropped_only_when_late_even_on_an_idle_device() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let a = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let mut out = Vec::new();
    // 10 ms each, a window of 2: r1 and r2 go at once, r3 (due at 35 ms)
    // waits and is estimated to end at 30 ms.
    let r1 = d.submit(0, a, Some(100.0), &mut out);
    let r2 = d.submit(0, a, Some(100.0), &mut out);
    let r3 = d.submit(0, a, Some(35.0), &mut out);
    let r4 = d.submit(0, a, Some(100.0), &mut out);
    assert_eq!(sent(&out), vec![(r1, gpu(0)), (r2, gpu(0))]);
    out.clear();
    let t = timing(ServePath::DeviceResident, 10.0);
    let res = vec!["a".to_string()];
    // r1 answered late, at 18 ms: with r2 estimated ahead of it r3 would
    // end at 38 ms, but the device may be quicker than that estimate: r3
    // goes (the runtime drops it if its budget runs out there).
    d.complete(18 * MS, r1, &c_of(&t, &res), &mut out);
    assert_eq!(sent(&out), vec![(r3, gpu(0))]);
    out.clear();
    // r4's turn at 95 ms: it cannot end by 100 ms even alone.
    d.complete(95 * MS, r2, &c_of(&t, &res), &mut out);
    assert!(sent(&out).is_empty());
    assert_eq!(failed(&out), vec![(r4, ErrorCode::DeadlineExceeded)]);
}

/// Replies from a continuously busy GPU come 20 ms apart for requests the
/// runtime timed at 10 ms: the dispatcher measures the other 10 ms per
/// request and admits fewer requests against a deadline than the estimate
/// alone would.
#[test]
fn device_time_beyond_the_estimate_is_measured_and_admitted_against() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let t = timing(ServePath::DeviceResident, 10.0);
    let mut out = Vec::new();
    let mut live: VecDeque<ReqId> = VecDeque::new();
    let mut now = 0;
    // Keep two outstanding; answer the oldest every 20 ms.
    for _ in 0..40 {
        let r = d.submit(now, m, Some(1000.0), &mut out);
        assert!(failed(&out).is_empty(), "{out:?}");
        live.push_back(r);
        out.clear();
        if live.len() > 2 {
            now += 20 * MS;
            let done = live.pop_front().unwrap();
            assert!(d.complete(now, done, &c_of(&t, &[]), &mut out).is_some());
            out.clear();
        }
    }
    let serial = d.serial_us(0);
    assert!(
        (8 * MS..=12 * MS).contains(&serial),
        "measured {serial} us beyond the estimate, expected about 10 ms"
    );
    // Replies on time measure nothing more: a fresh dispatcher answered
    // every 10 ms stays near zero.
    let mut d2 = dispatcher(PolicyKind::Slo, 1);
    let m2 = model(&mut d2, "a");
    make_resident(&mut d2, 0, "a");
    let (mut live, mut now) = (VecDeque::new(), 0);
    for _ in 0..40 {
        live.push_back(d2.submit(now, m2, Some(1000.0), &mut out));
        out.clear();
        if live.len() > 2 {
            now += 10 * MS;
            let done = live.pop_front().unwrap();
            assert!(d2.complete(now, done, &c_of(&t, &[]), &mut out).is_some());
            out.clear();
        }
    }
    assert!(d2.serial_us(0) <= MS, "{}", d2.serial_us(0));
    // Admission counts it: with 20 ms per request, fewer requests fit a
    // 100 ms deadline than with 10.
    let fit = |d: &mut Dispatcher, m: u32, at: Micros| {
        let mut out = Vec::new();
        for _ in 0..20 {
            d.submit(at, m, Some(100.0), &mut out);
        }
        20 - failed(&out).len()
    };
    let slow = fit(&mut d, m, now + 1_000 * MS);
    let fast = fit(&mut d2, m2, now + 1_000 * MS);
    assert!(
        slow < fast,
        "admitted {slow} with 20 ms per request, {fast} with 10 ms"
    );
}

/// One GPU with "a" resident and two 10 ms requests outstanding (its
/// window), busy until 20 ms.
fn busy_gpu() -> (Dispatcher, u32, [ReqId; 2]) {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    let m = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let mut out = Vec::new();
    let r1 = d.submit(0, m, Some(500.0), &mut out);
    let r2 = d.submit(0, m, Some(500.0), &mut out);
    assert_eq!(sent(&out).len(), 2);
    (d, m, [r1, r2])
}

#[test]
fn a_higher_priority_request_runs_first_when_no_deadline_suffers() {
    let t = timing(ServePath::DeviceResident, 10.0);
    let done = |d: &mut Dispatcher, at: Micros, req: ReqId| {
        let mut out = Vec::new();
        d.complete(at, req, &c_of(&t, &[]), &mut out);
        sent(&out).into_iter().map(|(r, _)| r).collect::<Vec<_>>()
    };
    // Default priority: EDF, the earlier deadline first.
    let (mut d, m, [r1, _]) = busy_gpu();
    let mut out = Vec::new();
    let early = d.submit_with(0, m, Some(200.0), 0, &mut out);
    let _late = d.submit_with(0, m, Some(400.0), 0, &mut out);
    assert!(out.is_empty());
    assert_eq!(done(&mut d, 10 * MS, r1), vec![early]);
    // Priority 1 (the highest) before the default, though due later.
    let (mut d, m, [r1, _]) = busy_gpu();
    let _low = d.submit_with(0, m, Some(200.0), 0, &mut out);
    let high = d.submit_with(0, m, Some(400.0), 1, &mut out);
    assert!(out.is_empty());
    assert_eq!(done(&mut d, 10 * MS, r1), vec![high]);
    // Level 1 before level 3, both above the default.
    let (mut d, m, [r1, _]) = busy_gpu();
    let _three = d.submit_with(0, m, Some(200.0), 3, &mut out);
    let one = d.submit_with(0, m, Some(400.0), 1, &mut out);
    assert_eq!(done(&mut d, 10 * MS, r1), vec![one]);
    // Not when it would make the earlier one late (35 ms: 20 ms of work
    // ahead, then 10 ms each; the margin counts the priority's time twice).
    let (mut d, m, [r1, _]) = busy_gpu();
    let tight = d.submit_with(0, m, Some(35.0), 0, &mut out);
    let _high = d.submit_with(0, m, Some(400.0), 1, &mut out);
    assert!(out.is_empty());
    assert_eq!(done(&mut d, 10 * MS, r1), vec![tight]);
}

#[test]
fn a_higher_priority_request_takes_the_place_of_a_lower_one_only() {
    // Queued behind the window: l1 due at 30 ms, l2 at 40 ms; each finishes
    // just in time. A request due at 35 ms fits only if l1 goes.
    let setup = |queued_priority: u32| {
        let (mut d, m, rs) = busy_gpu();
        let mut out = Vec::new();
        let l1 = d.submit_with(0, m, Some(30.0), queued_priority, &mut out);
        let l2 = d.submit_with(0, m, Some(40.0), queued_priority, &mut out);
        assert!(out.is_empty(), "both admitted: {out:?}");
        (d, m, l1, l2, rs)
    };
    // Same (default) priority: the newcomer is rejected, the queue stays.
    let (mut d, m, ..) = setup(0);
    let mut out = Vec::new();
    let h = d.submit_with(0, m, Some(35.0), 0, &mut out);
    assert_eq!(failed(&out), vec![(h, ErrorCode::Rejected)]);
    // Priority 1: l1 alone is dropped (dropping l2 would not make room),
    // rejected with a message saying why; l2 and the newcomer keep theirs.
    let (mut d, m, l1, l2, rs) = setup(0);
    out.clear();
    let h = d.submit_with(0, m, Some(35.0), 1, &mut out);
    assert_eq!(failed(&out), vec![(l1, ErrorCode::Rejected)]);
    let why = out
        .iter()
        .find_map(|a| match a {
            Action::Fail { error, .. } => Some(error.message.clone()),
            _ => None,
        })
        .unwrap();
    assert!(why.contains("higher priority (1)"), "{why}");
    assert_eq!(d.queued(), 2);
    // Both then run in time: the newcomer, then l2.
    let t = timing(ServePath::DeviceResident, 10.0);
    for (at, req, next) in [(10, rs[0], h), (20, rs[1], l2)] {
        out.clear();
        d.complete(at * MS, req, &c_of(&t, &[]), &mut out);
        assert_eq!(sent(&out), vec![(next, gpu(0))]);
    }
    // Queued requests of higher priority than the newcomer are never
    // dropped for it.
    let (mut d, m, ..) = setup(1);
    out.clear();
    let h = d.submit_with(0, m, Some(35.0), 2, &mut out);
    assert_eq!(failed(&out), vec![(h, ErrorCode::Rejected)]);
    assert_eq!(d.queued(), 2);
}

/// Every lane equals what its GPU's state says through a busy run:
/// batches, completions out of order, training, a lost runtime and its
/// return (routing's cheap bound reads lanes only).
#[test]
fn every_lane_follows_its_gpu_through_a_busy_run() {
    let mut c = cfg(PolicyKind::Slo);
    c.batch_max = 4;
    let mut d = Dispatcher::new(c).unwrap();
    let mut out = Vec::new();
    for r in 0..3 {
        d.runtime_seen(0, r, 1, &shape(&[0, 1], 1 << 30, 4), None, &mut out);
        d.link_up(r);
    }
    let models: Vec<u32> = (0..6).map(|m| model(&mut d, &format!("m{m}"))).collect();
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut live: Vec<ReqId> = Vec::new();
    let t = timing(ServePath::DeviceResident, 10.0);
    let mut batched = 0;
    for step in 0..2_000u64 {
        let now = step * MS;
        use rand::Rng;
        // Runtime 1 is lost at step 900 and back at 1 400, whatever the
        // random steps around them did.
        if step == 900 {
            d.runtime_down(now, 1, "killed in the test", &mut out);
        } else if step == 1_400 {
            d.runtime_seen(now, 1, 2, &shape(&[0, 1], 1 << 30, 4), None, &mut out);
            d.link_up(1);
        } else {
            match rng.gen_range(0..10) {
                0..=5 => {
                    let m = models[rng.gen_range(0..models.len())];
                    d.submit(now, m, Some(rng.gen_range(15.0..300.0)), &mut out);
                }
                6..=8 if !live.is_empty() => {
                    let id = live.swap_remove(rng.gen_range(0..live.len()));
                    d.complete(now, id, &c_of(&t, &[]), &mut out);
                }
                _ => d.tick(now, &mut out),
            }
        }
        for a in out.drain(..) {
            if let Action::Send {
                req, batch, gpu, ..
            } = a
            {
                if gpu.runtime == 1 && (900..1_400).contains(&step) {
                    panic!("sent to runtime 1 while it was down");
                }
                live.push(req);
                live.extend(batch.iter().map(|m| m.req));
                batched += usize::from(!batch.is_empty());
            }
        }
        assert!(
            d.gpus.lanes_match_state(),
            "a lane went stale at step {step}"
        );
        for gi in 0..d.gpus.len() {
            for (_, _, id) in d.gpus[gi].queue.iter() {
                assert!(
                    d.reqs.contains_key(id),
                    "step {step}: request {id} queued for GPU {gi} is gone"
                );
            }
        }
    }
    let c = d.counters();
    assert!(
        c.sent > 500 && batched > 10 && c.completed > 500,
        "the run was not busy: {c:?}, {batched} batches"
    );
}

/// A device's first run pays one-time costs (on an H200, 150 ms for a
/// ResNet-152 that then runs in 5): learnt from, it would shut the model
/// out of a 100 ms SLO until other samples wore it down. The runtime marks
/// it `warmup`; the dispatcher learns neither a service time nor a serial
/// time from it.
#[test]
fn the_devices_warm_up_run_teaches_the_cost_model_nothing() {
    let run = |warmup: bool| {
        let mut d = dispatcher(PolicyKind::Slo, 1);
        let m = model(&mut d, "a");
        make_resident(&mut d, 0, "a");
        let mut out = Vec::new();
        let first = d.submit(0, m, Some(1000.0), &mut out);
        let second = d.submit(0, m, Some(1000.0), &mut out);
        out.clear();
        let slow = TimingMsg {
            warmup,
            ..timing(ServePath::DeviceResident, 150.0)
        };
        d.complete(150 * MS, first, &c_of(&slow, &[]), &mut out);
        // The second waited behind it at the runtime.
        let t = TimingMsg {
            queue_ms: 150.0,
            total_ms: 155.0,
            ..timing(ServePath::DeviceResident, 5.0)
        };
        d.complete(155 * MS, second, &c_of(&t, &[]), &mut out);
        out.clear();
        let meta = d.models[m as usize].meta.clone();
        let estimate = d.cost.estimate(m, &meta, Where::Resident);
        let admitted = {
            let r = d.submit(200 * MS, m, Some(100.0), &mut out);
            !failed(&out).iter().any(|&(id, _)| id == r)
        };
        (estimate, d.serial_us(0), admitted)
    };
    let (estimate, serial, admitted) = run(true);
    assert_eq!(estimate, 5 * MS, "only the second run was learnt from");
    assert!(serial <= MS, "{serial} us of serial time");
    assert!(admitted);
    // The same replies without the mark: the 150 ms shuts the model out.
    let (estimate, _, admitted) = run(false);
    assert!(estimate > 100 * MS, "{estimate}");
    assert!(!admitted);
}

/// The dispatcher's view of a host cache holds what the cache's bytes hold:
/// it used to keep every model ever routed through it until the next
/// snapshot, and routed loads as host-cached that went to the memory
/// servers.
#[test]
fn a_load_pushes_the_least_recent_model_out_of_the_host_cache_view() {
    let mut d = dispatcher(PolicyKind::Slo, 1);
    // Room for two of the 10 MB models.
    let snap = RuntimeSnapshot {
        devices: vec![DeviceSnapshot {
            device: 0,
            ..Default::default()
        }],
        host_cached: Vec::new(),
        host_cached_truncated: false,
    };
    heartbeat(&mut d, 0, 20_000_000, &snap);
    let ms: Vec<u32> = ["a", "b", "c"].iter().map(|n| model(&mut d, n)).collect();
    let mut out = Vec::new();
    for &m in &ms {
        d.submit(0, m, Some(10_000.0), &mut out);
    }
    assert!(failed(&out).is_empty(), "{out:?}");
    // Loaded through the cache in the order a, b, c: a is out.
    assert_eq!(d.where_on_host(0, ms[0]), Where::Remote);
    assert_eq!(d.where_on_host(0, ms[1]), Where::HostCached);
    assert_eq!(d.where_on_host(0, ms[2]), Where::HostCached);
}

/// `n` requests for `m` with a 100 ms SLO at `now`, each answered at once
/// (10 ms, resident) where it was sent: the demand a rate window sees.
fn offer(d: &mut Dispatcher, now: Micros, m: u32, n: usize) {
    let mut out = Vec::new();
    for _ in 0..n {
        d.submit(now, m, Some(100.0), &mut out);
    }
    answer_all(d, now, m, &out);
}

/// Answers at `now` every request for `m` that `out` sends, and every one
/// sent in turn as they are answered.
fn answer_all(d: &mut Dispatcher, now: Micros, m: u32, out: &[Action]) {
    let t = timing(ServePath::DeviceResident, 10.0);
    let resident = [d.models[m as usize].meta.name.clone()];
    let mut todo = sent(out);
    while let Some((r, _)) = todo.pop() {
        let mut more = Vec::new();
        d.complete(now, r, &c_of(&t, &resident), &mut more);
        todo.extend(sent(&more));
    }
}

/// The GPUs `out` tells to train (`true`) or to stop (`false`).
fn train_orders(out: &[Action], start: bool) -> Vec<Gpu> {
    out.iter()
        .filter_map(|a| match a {
            Action::Train { gpu, model } if model.is_some() == start => Some(*gpu),
            _ => None,
        })
        .collect()
}

/// Runtime `r`'s one device heartbeats: `resident` on it, training or not
/// with iterations of `iteration_ms`.
fn trainer_heartbeat(
    d: &mut Dispatcher,
    r: u32,
    resident: &[&str],
    training: bool,
    iteration_ms: f64,
) {
    let snap = RuntimeSnapshot {
        devices: vec![DeviceSnapshot {
            device: 0,
            resident: resident.iter().map(|m| m.to_string()).collect(),
            training: training.then(|| "resnet152_train".to_string()),
            train_iteration_ms: iteration_ms,
            ..Default::default()
        }],
        host_cached: vec![],
        host_cached_truncated: false,
    };
    heartbeat(d, r, 1 << 30, &snap);
}

#[test]
fn slo_keeps_enough_gpus_from_training_when_an_iteration_outlasts_the_slo() {
    let mut c = cfg(PolicyKind::Slo);
    c.distmind.use_train = true;
    c.train_model = Some("resnet152_train".into());
    let mut d = dispatcher_with(c, 4);
    let a = model(&mut d, "a");
    make_resident(&mut d, 0, "a");
    let mut out = Vec::new();
    // Nothing trains before the demand is measured.
    d.tick(0, &mut out);
    assert!(train_orders(&out, true).is_empty(), "{out:?}");
    // 50 requests/s of 10 ms: half a GPU. Two GPUs stay (each at most 40%
    // busy), the one holding `a` first; the other two train once the
    // demand has called for fewer for a second.
    let mut trainers = Vec::new();
    for k in 1..=15 {
        offer(&mut d, k * 100 * MS, a, 5);
        out.clear();
        d.tick(k * 100 * MS, &mut out);
        assert!(train_orders(&out, false).is_empty(), "{out:?}");
        let started = train_orders(&out, true);
        assert!(k >= 11 || started.is_empty(), "at {k}00 ms: {out:?}");
        trainers.extend(started);
    }
    assert_eq!(trainers.len(), 2, "{trainers:?}");
    assert!(!trainers.contains(&gpu(0)), "{trainers:?}");
    // Their runtimes say an iteration takes 250 ms: a request that could
    // wait for one would miss its SLO, so none goes there.
    for g in &trainers {
        trainer_heartbeat(&mut d, g.runtime, &[], true, 250.0);
    }
    out.clear();
    for _ in 0..8 {
        d.submit(1_500 * MS, a, Some(100.0), &mut out);
    }
    assert!(!sent(&out).is_empty(), "{out:?}");
    assert!(
        sent(&out).iter().all(|(_, g)| !trainers.contains(g)),
        "{out:?}"
    );
    answer_all(&mut d, 1_510 * MS, a, &out);
    // 150 requests/s: three GPUs at once; one trainer is told to stop and
    // counted busy for the iteration it may be in.
    let (mut now, mut stopped) = (1_500 * MS, Vec::new());
    for _ in 0..3 {
        now += 100 * MS;
        offer(&mut d, now, a, 15);
        out.clear();
        d.tick(now, &mut out);
        stopped.extend(train_orders(&out, false));
    }
    assert_eq!(stopped.len(), 1, "{stopped:?}");
    let gi = d.gpus.iter().position(|g| g.gpu == stopped[0]).unwrap();
    assert!(d.gpus[gi].busy_until >= now - 200 * MS + 250 * MS);
    // Iterations of 20 ms next to a 100 ms SLO: every GPU trains between
    // requests again, after the hold.
    for r in 0..4 {
        let resident: &[&str] = if r == 0 { &["a"] } else { &[] };
        trainer_heartbeat(&mut d, r, resident, trainers.contains(&gpu(r)), 20.0);
    }
    let mut started = Vec::new();
    for _ in 0..12 {
        now += 100 * MS;
        offer(&mut d, now, a, 15);
        out.clear();
        d.tick(now, &mut out);
        started.extend(train_orders(&out, true));
    }
    assert_eq!(started.len(), 3, "the three not training: {started:?}");
}

#[test]
fn with_no_requests_every_gpu_trains_under_slo() {
    let mut c = cfg(PolicyKind::Slo);
    c.distmind.use_train = true;
    c.train_model = Some("resnet152_train".into());
    let mut d = dispatcher_with(c, 3);
    model(&mut d, "a");
    let mut started = Vec::new();
    for k in 0..=12 {
        let mut out = Vec::new();
        d.tick(k * 100 * MS, &mut out);
        started.extend(train_orders(&out, true));
    }
    started.sort_by_key(|g| g.runtime);
    assert_eq!(started, vec![gpu(0), gpu(1), gpu(2)]);
}

/// Loads measured while they shared their GPU server's link are learnt as
/// what one load alone takes: a model nothing holds is admitted once the
/// link is free, and a load that would share the link again is estimated
/// as sharing it. (Learnt as measured, the loads of a start where every
/// GPU cold-started at once shut every later load out: the requests that
/// would have measured one alone were rejected.)
#[test]
fn a_load_measured_on_a_shared_link_does_not_shut_later_loads_out() {
    let mut d = Dispatcher::new(cfg(PolicyKind::Slo)).unwrap();
    let mut out = Vec::new();
    // One GPU server of 4 GPUs: one link to the memory servers.
    d.runtime_seen(0, 0, 1, &shape(&[0, 1, 2, 3], 1 << 30, 4), None, &mut out);
    d.link_up(0);
    let ms: Vec<u32> = ["a", "b", "c", "d", "e", "f"]
        .iter()
        .map(|n| model(&mut d, n))
        .collect();
    // Four loads at once, one per GPU.
    let first: Vec<ReqId> = ms[..4]
        .iter()
        .map(|&m| d.submit(0, m, Some(1000.0), &mut out))
        .collect();
    assert_eq!(sent(&out).len(), 4, "{out:?}");
    assert_eq!(d.hosts[&0].link.loads(), 4);
    // Each took 400 ms, 390 of them fetching its 10 MB at a quarter of the
    // link (100 MB/s alone: about 100 ms).
    let mut t = timing(ServePath::Cold, 400.0);
    t.fetch_ms = 390.0;
    t.fetched_bytes = 10_000_000;
    for &r in &first {
        d.complete(400 * MS, r, &c_of(&t, &[]), &mut out);
    }
    assert_eq!(d.hosts[&0].link.loads(), 0);
    // Alone: 400 - (390 - 97.5) = 107.5 ms.
    let meta = d.models[ms[4] as usize].meta.clone();
    let alone = d.cost.estimate(ms[4], &meta, Where::Remote);
    assert!((105 * MS..110 * MS).contains(&alone), "{alone} us");
    // A model nothing holds, on a free link, within a 150 ms SLO: admitted
    // (learnt as measured, 400 ms, it was rejected).
    out.clear();
    let e = d.submit(500 * MS, ms[4], Some(150.0), &mut out);
    assert_eq!(
        sent(&out).iter().map(|s| s.0).collect::<Vec<_>>(),
        vec![e],
        "{out:?}"
    );
    assert_eq!(d.hosts[&0].link.loads(), 1);
    // Another load now shares the link with it: about 205 ms, rejected.
    out.clear();
    let f = d.submit(500 * MS, ms[5], Some(150.0), &mut out);
    assert_eq!(failed(&out), vec![(f, ErrorCode::Rejected)], "{out:?}");
    // With the room to wait for it, it goes, and both count on the link
    // until each is answered, or their GPU server is lost.
    out.clear();
    d.submit(500 * MS, ms[5], Some(1000.0), &mut out);
    assert_eq!(sent(&out).len(), 1, "{out:?}");
    assert_eq!(d.hosts[&0].link.loads(), 2);
    d.runtime_down(600 * MS, 0, "test", &mut out);
    assert_eq!(d.hosts[&0].link.loads(), 0);
}

/// An `slo` dispatcher with one GPU server of 2 GPUs, linked, and models
/// "a" and "b" (their ids).
fn two_gpus_a_and_b() -> (Dispatcher, u32, u32) {
    let mut d = Dispatcher::new(cfg(PolicyKind::Slo)).unwrap();
    d.runtime_seen(0, 0, 1, &shape(&[0, 1], 1 << 30, 4), None, &mut Vec::new());
    d.link_up(0);
    let a = model(&mut d, "a");
    let b = model(&mut d, "b");
    (d, a, b)
}

/// A prefetch from the memory servers counts on its GPU server's link
/// until it is reported, and its time is learnt as one load alone.
#[test]
fn a_prefetch_from_the_memory_servers_counts_on_the_link() {
    let (mut d, a, b) = two_gpus_a_and_b();
    let mut out = Vec::new();
    // A load on GPU 0 and a prefetch on GPU 1 share the link.
    d.submit(0, a, Some(1000.0), &mut out);
    d.occupy_with_prefetch(0, 1, b);
    assert_eq!(d.hosts[&0].link.loads(), 2);
    assert!(d.gpus[1].prefetch_load.is_some());
    // Reported after 200 ms of fetching, shared all along: learnt as about
    // 100 ms of fetching alone (plus compute).
    d.prefetched(
        200 * MS,
        Gpu {
            runtime: 0,
            device: 1,
        },
        "b",
        ServePath::Cold,
        200.0,
    );
    d.prefetch_done(
        200 * MS,
        Gpu {
            runtime: 0,
            device: 1,
        },
        None,
    );
    assert_eq!(d.hosts[&0].link.loads(), 1);
    let meta = d.models[b as usize].meta.clone();
    let alone = d.cost.estimate(b, &meta, Where::Remote);
    assert!((100 * MS..120 * MS).contains(&alone), "{alone} us");
}

/// A prefetch from the memory servers waits for its GPU server's link to
/// carry no load: it slowed loads that requests waited for, admitted on
/// estimates that had not counted it. One from the host cache does not
/// wait (it does not use the link).
#[test]
fn a_prefetch_from_the_memory_servers_waits_for_the_link_to_be_free() {
    let (mut d, a, b) = two_gpus_a_and_b();
    let mut out = Vec::new();
    // "b" is hot and resident nowhere; GPU 0 loads "a" from the memory
    // servers.
    d.models[b as usize].rate.observe(10.0);
    let r = d.submit(0, a, Some(1000.0), &mut out);
    assert_eq!(sent(&out), vec![(r, gpu(0))]);
    assert_eq!(d.hosts[&0].link.loads(), 1);
    let prefetches = |out: &[Action]| -> Vec<(Gpu, String)> {
        out.iter()
            .filter_map(|x| match x {
                Action::Prefetch { gpu, model } => Some((*gpu, model.clone())),
                _ => None,
            })
            .collect()
    };
    out.clear();
    d.tick(10 * MS, &mut out);
    assert_eq!(prefetches(&out), vec![], "GPU 1 is idle, the link is not");
    // The load is answered: the link is free, an idle GPU takes "b".
    let t = timing(ServePath::Cold, 50.0);
    d.complete(50 * MS, r, &c_of(&t, &["a".to_string()]), &mut out);
    out.clear();
    // (Within the 100 ms before demand is measured again.)
    d.tick(60 * MS, &mut out);
    let models: Vec<String> = prefetches(&out).into_iter().map(|p| p.1).collect();
    assert_eq!(models, vec!["b".to_string()], "{out:?}");
    assert_eq!(d.hosts[&0].link.loads(), 1, "the prefetch counts there");

    // From the host cache, a prefetch starts beside a load.
    let mut d = Dispatcher::new(cfg(PolicyKind::Slo)).unwrap();
    let mut out = Vec::new();
    let a = model(&mut d, "a");
    let b = model(&mut d, "b");
    let snap = RuntimeSnapshot {
        devices: Vec::new(),
        host_cached: vec!["b".into()],
        host_cached_truncated: false,
    };
    d.runtime_seen(
        0,
        0,
        1,
        &shape(&[0, 1], 1 << 30, 4),
        Some((next_seq(), &snap)),
        &mut out,
    );
    d.link_up(0);
    d.models[b as usize].rate.observe(10.0);
    d.submit(0, a, Some(1000.0), &mut out);
    assert_eq!(d.hosts[&0].link.loads(), 1);
    out.clear();
    d.tick(10 * MS, &mut out);
    let gpu1 = Gpu {
        runtime: 0,
        device: 1,
    };
    assert_eq!(prefetches(&out), vec![(gpu1, "b".to_string())], "{out:?}");
}

/// Loads of every GPU server share the memory servers' links: with one
/// memory server, a load on one GPU server slows a load on another, and a
/// prefetch from the memory servers waits for it; with two, each load has
/// a memory server's link to itself.
#[test]
fn loads_of_two_gpu_servers_share_one_memory_servers_link() {
    let mut d = Dispatcher::new(cfg(PolicyKind::Slo)).unwrap();
    let mut out = Vec::new();
    for runtime in [0, 1] {
        d.runtime_seen(0, runtime, 1, &shape(&[0], 1 << 30, 4), None, &mut out);
        d.link_up(runtime);
    }
    let a = model(&mut d, "a");
    let b = model(&mut d, "b");
    d.models[b as usize].rate.observe(10.0);
    let r = d.submit(0, a, Some(1000.0), &mut out);
    let loading = sent(&out)[0].1;
    assert_eq!(sent(&out), vec![(r, loading)]);
    let other = 1 - d.gpus.iter().position(|g| g.gpu == loading).unwrap();
    let alone = d.estimate_on(other, b, Where::Remote);
    d.set_memservers(0, 1);
    let shared = d.estimate_on(other, b, Where::Remote);
    assert!(
        shared > alone,
        "one memory server: {shared} us, not above {alone} us"
    );
    out.clear();
    d.tick(10 * MS, &mut out);
    let prefetch = |out: &[Action]| out.iter().any(|x| matches!(x, Action::Prefetch { .. }));
    assert!(!prefetch(&out), "the memory server's link is busy: {out:?}");

    d.set_memservers(20 * MS, 2);
    assert_eq!(d.estimate_on(other, b, Where::Remote), alone);
    out.clear();
    d.tick(30 * MS, &mut out);
    let to_other = Action::Prefetch {
        gpu: d.gpus[other].gpu,
        model: "b".into(),
    };
    assert_eq!(out, vec![to_other], "a link of its own");
}

/// Under `slo`, a request that comes while the only GPU server is starting
/// (known, its link not up yet) waits for its link within its deadline;
/// one that would wait past it, or whose GPU server is lost, fails then,
/// naming why.
#[test]
fn a_request_waits_for_a_starting_gpu_server_within_its_deadline() {
    let starting = || {
        let mut d = Dispatcher::new(cfg(PolicyKind::Slo)).unwrap();
        d.runtime_seen(0, 0, 1, &shape(&[0], 1 << 30, 4), None, &mut Vec::new());
        let a = model(&mut d, "a");
        (d, a)
    };
    let mut out = Vec::new();
    let (mut d, a) = starting();
    let r = d.submit(0, a, Some(1000.0), &mut out);
    assert_eq!(out, vec![], "it waits");
    d.link_up(0);
    d.route_waiting(5 * MS, &mut out);
    assert_eq!(sent(&out), vec![(r, gpu(0))]);

    // Its deadline passes first.
    let (mut d, a) = starting();
    out.clear();
    let r = d.submit(0, a, Some(100.0), &mut out);
    d.tick(150 * MS, &mut out);
    assert_eq!(failed(&out), vec![(r, ErrorCode::DeadlineExceeded)]);
    assert!(format!("{out:?}").contains("waited 150 ms for a GPU server to start"));

    // The GPU server is lost before its link is up.
    let (mut d, a) = starting();
    out.clear();
    let r = d.submit(0, a, Some(1000.0), &mut out);
    d.runtime_down(10 * MS, 0, "it sent no heartbeat", &mut out);
    assert_eq!(failed(&out), vec![(r, ErrorCode::Unavailable)]);
    assert!(format!("{out:?}").contains("runtime 0 was lost (it sent no heartbeat)"));

    // No GPU server known at all: unavailable at once.
    let mut d = Dispatcher::new(cfg(PolicyKind::Slo)).unwrap();
    let a = model(&mut d, "a");
    out.clear();
    let r = d.submit(0, a, Some(1000.0), &mut out);
    assert_eq!(failed(&out), vec![(r, ErrorCode::Unavailable)]);
}
