//! The training data plane over real sockets on 127.0.0.1: stage links
//! (order, bounded in-flight, refusals, close, timeouts) and ring
//! all-reduce / broadcast among worker threads (bit-identical means, the
//! per-group connection cache, a member that dies or never joins).
//!
//! Every listener is bound before anyone dials it; no test sleeps or
//! asserts a duration.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distmind_common::handshake::{ClusterKey, HandshakeError};
use distmind_runtime::dist::{
    Collective, CollectiveError, CollectiveOptions, DistListener, InjectedFault, LinkError, LinkId,
    LinkOptions, MessageHeader, MessageKind, Refusal, RingMember, StageLink, StageMessage, Tensor,
    WorkerIdentity,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const JOB: u64 = 42;
/// Generous: bounds a wait only when something is broken.
const WAIT: Duration = Duration::from_secs(30);

fn key() -> ClusterKey {
    ClusterKey::from_secret(b"dist-links-test-cluster-key")
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn stage_listener(pipeline: u32, stage: u32) -> DistListener {
    DistListener::bind(
        any_port(),
        key(),
        WorkerIdentity {
            job: JOB,
            worker: stage,
            pipeline,
            stage,
        },
    )
    .unwrap()
}

fn message(kind: MessageKind, stage: u32, microbatch: u64) -> StageMessage {
    StageMessage {
        header: MessageHeader {
            job: JOB,
            pipeline: 0,
            stage,
            microbatch,
            kind,
        },
        tensors: vec![
            Tensor {
                reference: 12,
                shape: vec![2, 3],
                data: (0..6).map(|i| (microbatch * 10 + i) as f32).collect(),
            },
            Tensor {
                reference: -1,
                shape: vec![],
                data: vec![microbatch as f32],
            },
        ],
    }
}

fn link_id(from: u32, to: u32) -> LinkId {
    LinkId {
        job: JOB,
        pipeline: 0,
        from,
        to,
    }
}

/// Stage 0 dials stage 1's listener; returns (listener, stage 0's end,
/// stage 1's end).
fn linked(window: u32) -> (DistListener, StageLink, StageLink) {
    let l = stage_listener(0, 1);
    let a = StageLink::connect(
        l.local_addr(),
        link_id(0, 1),
        LinkOptions::new(key(), window),
    )
    .unwrap();
    let b = StageLink::accept(&l, 0, LinkOptions::new(key(), window), WAIT).unwrap();
    (l, a, b)
}

#[test]
fn a_link_carries_100_activations_and_gradients_in_order_within_the_window() {
    const WINDOW: u32 = 4;
    const MESSAGES: u64 = 100;
    let (_l, a, b) = linked(WINDOW);
    let sent_fwd = AtomicU64::new(0);
    let sent_bwd = AtomicU64::new(0);
    std::thread::scope(|s| {
        // Stage 0, forward: activations as fast as credits allow.
        s.spawn(|| {
            for mb in 0..MESSAGES {
                a.send(&message(MessageKind::Activation, 0, mb)).unwrap();
                assert!(a.in_flight() <= WINDOW);
                sent_fwd.fetch_add(1, Ordering::SeqCst);
            }
        });
        // Stage 1: takes activation mb, sends gradient mb back.
        s.spawn(|| {
            for mb in 0..MESSAGES {
                let m = b.recv().unwrap();
                assert_eq!(m, message(MessageKind::Activation, 0, mb));
                // Stage 0 cannot have sent more than what was taken + window.
                assert!(sent_fwd.load(Ordering::SeqCst) <= mb + 1 + u64::from(WINDOW));
                b.send(&message(MessageKind::Gradient, 1, mb)).unwrap();
                sent_bwd.fetch_add(1, Ordering::SeqCst);
            }
        });
        // Stage 0, backward: gradients in order.
        for mb in 0..MESSAGES {
            let m = a.recv().unwrap();
            assert_eq!(m, message(MessageKind::Gradient, 1, mb));
            assert!(sent_bwd.load(Ordering::SeqCst) <= mb + 1 + u64::from(WINDOW));
        }
    });
    assert_eq!(sent_fwd.load(Ordering::SeqCst), MESSAGES);
    assert_eq!(a.in_flight(), 0);
}

#[test]
fn a_sender_is_held_at_the_window_while_the_receiver_does_not_read() {
    const WINDOW: u32 = 3;
    let (_l, a, b) = linked(WINDOW);
    for mb in 0..u64::from(WINDOW) {
        a.send(&message(MessageKind::Activation, 0, mb)).unwrap();
    }
    assert_eq!(a.in_flight(), WINDOW);
    // Counted, not timed: the window is full, nothing more goes.
    assert!(!a
        .try_send(&message(MessageKind::Activation, 0, 99))
        .unwrap());
    assert!(!a
        .try_send(&message(MessageKind::Activation, 0, 99))
        .unwrap());
    // One read frees one credit: a blocking send goes through, and the
    // window is full again.
    assert_eq!(b.recv().unwrap().header.microbatch, 0);
    a.send(&message(MessageKind::Activation, 0, 3)).unwrap();
    assert!(!a
        .try_send(&message(MessageKind::Activation, 0, 99))
        .unwrap());
    for mb in 1..=3 {
        assert_eq!(b.recv().unwrap().header.microbatch, mb);
    }
    // Nothing else was sent: the refused try_sends left no trace.
    assert!(matches!(
        b.recv_timeout(Duration::from_millis(50)),
        Err(LinkError::RecvTimeout { .. })
    ));
}

#[test]
fn a_wrong_cluster_key_is_refused() {
    let l = stage_listener(0, 1);
    let wrong = ClusterKey::from_secret(b"some-other-cluster-key");
    let e =
        StageLink::connect(l.local_addr(), link_id(0, 1), LinkOptions::new(wrong, 2)).unwrap_err();
    assert!(
        matches!(
            &e,
            LinkError::Handshake {
                source: HandshakeError::ServerNotInCluster,
                ..
            }
        ),
        "{e}"
    );
    let text = e.to_string();
    assert!(text.contains(&l.local_addr().to_string()), "{text}");
    assert!(text.contains("job 42 pipeline 0 stage 0->1"), "{text}");
}

#[test]
fn a_wrong_job_pipeline_or_stage_is_refused_with_the_named_refusal() {
    let l = stage_listener(0, 2);
    let dial = |job, pipeline, from, to| {
        StageLink::connect(
            l.local_addr(),
            LinkId {
                job,
                pipeline,
                from,
                to,
            },
            LinkOptions::new(key(), 2),
        )
        .unwrap_err()
    };
    let refusal = |e: LinkError| match e {
        LinkError::Refused { refusal, peer, .. } => {
            assert_eq!(peer, l.local_addr());
            refusal
        }
        e => panic!("expected a refusal, got {e}"),
    };
    assert_eq!(
        refusal(dial(7, 0, 1, 2)),
        Refusal::WrongJob {
            ours: JOB,
            theirs: 7
        }
    );
    assert_eq!(
        refusal(dial(JOB, 1, 1, 2)),
        Refusal::WrongPipeline { ours: 0, theirs: 1 }
    );
    assert_eq!(
        refusal(dial(JOB, 0, 2, 3)),
        Refusal::WrongStage { ours: 2, theirs: 3 }
    );
    assert_eq!(
        refusal(dial(JOB, 0, 0, 2)),
        Refusal::NotAdjacent { from: 0, to: 2 }
    );
    assert_eq!(l.stats().accepted, 0);
    // The right one still gets through, from either neighbour.
    for from in [1, 3] {
        let _a = StageLink::connect(l.local_addr(), link_id(from, 2), LinkOptions::new(key(), 2))
            .unwrap();
        let _b = StageLink::accept(&l, from, LinkOptions::new(key(), 2), WAIT).unwrap();
    }
}

#[test]
fn a_peer_that_closes_gives_a_named_closed_error_after_its_last_messages() {
    let (_l, a, b) = linked(4);
    a.send(&message(MessageKind::Activation, 0, 0)).unwrap();
    a.send(&message(MessageKind::Activation, 0, 1)).unwrap();
    drop(a);
    assert_eq!(b.recv().unwrap().header.microbatch, 0);
    assert_eq!(b.recv().unwrap().header.microbatch, 1);
    let e = b.recv().unwrap_err();
    assert!(matches!(&e, LinkError::Closed { .. }), "{e}");
    assert!(e.to_string().contains("stage 1->0"), "{e}");
    let e = b.send(&message(MessageKind::Gradient, 1, 0)).unwrap_err();
    assert!(matches!(&e, LinkError::Closed { .. }), "{e}");
}

#[test]
fn an_oversize_message_is_refused_by_the_receiver_naming_the_field_and_the_peer() {
    let l = stage_listener(0, 1);
    let mut loose = LinkOptions::new(key(), 2);
    loose.limits.bytes_max = 1 << 20;
    let mut tight = LinkOptions::new(key(), 2);
    tight.limits.bytes_max = 4096;
    let a = StageLink::connect(l.local_addr(), link_id(0, 1), loose).unwrap();
    let b = StageLink::accept(&l, 0, tight.clone(), WAIT).unwrap();
    let big = StageMessage {
        header: message(MessageKind::Activation, 0, 0).header,
        tensors: vec![Tensor {
            reference: 7,
            shape: vec![2048],
            data: vec![0.5; 2048],
        }],
    };
    a.send(&big).unwrap();
    let e = b.recv().unwrap_err();
    assert!(matches!(&e, LinkError::BadMessage { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains("`body bytes`"), "{text}");
    assert!(text.contains(&a.local_addr().to_string()), "{text}");
    assert!(text.contains("stage 1->0"), "{text}");
    // The sender is told before anything is written when it knows the limit.
    let c = StageLink::connect(l.local_addr(), link_id(0, 1), tight).unwrap();
    let e = c.send(&big).unwrap_err();
    assert!(matches!(&e, LinkError::Unsendable { .. }), "{e}");
}

#[test]
fn a_sender_waiting_for_credit_sees_the_peer_close() {
    let (_l, a, b) = linked(2);
    a.send(&message(MessageKind::Activation, 0, 0)).unwrap();
    a.send(&message(MessageKind::Activation, 0, 1)).unwrap();
    std::thread::scope(|s| {
        let blocked = s.spawn(|| a.send(&message(MessageKind::Activation, 0, 2)));
        drop(b);
        let e = blocked.join().unwrap().unwrap_err();
        assert!(matches!(&e, LinkError::Closed { .. }), "{e}");
    });
}

#[test]
fn receive_and_accept_timeouts_are_named() {
    let (l, a, _b) = linked(2);
    let e = a.recv_timeout(Duration::from_millis(20)).unwrap_err();
    assert!(
        matches!(
            e,
            LinkError::RecvTimeout {
                link: LinkId { from: 0, to: 1, .. },
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains(&l.local_addr().to_string()), "{e}");
    let e = StageLink::accept(&l, 2, LinkOptions::new(key(), 2), Duration::from_millis(20))
        .unwrap_err();
    assert!(matches!(e, LinkError::AcceptTimeout { .. }), "{e}");
}

#[test]
fn a_rate_limited_link_still_carries_everything() {
    let l = stage_listener(0, 1);
    let mut opts = LinkOptions::new(key(), 2);
    opts.rate_limit_bytes_per_s = Some(50 << 20);
    let a = StageLink::connect(l.local_addr(), link_id(0, 1), opts.clone()).unwrap();
    let b = StageLink::accept(&l, 0, opts, WAIT).unwrap();
    let big = StageMessage {
        header: message(MessageKind::Activation, 0, 0).header,
        tensors: vec![Tensor {
            reference: 3,
            shape: vec![256, 1024],
            data: (0..256 * 1024).map(|i| i as f32).collect(),
        }],
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..4 {
                a.send(&big).unwrap();
            }
        });
        for _ in 0..4 {
            assert_eq!(b.recv().unwrap(), big);
        }
    });
}

// ---- collectives ----

struct Worker {
    listener: Arc<DistListener>,
    member: RingMember,
}

fn workers(ids: &[u32]) -> Vec<Worker> {
    ids.iter()
        .map(|&id| {
            let listener = Arc::new(
                DistListener::bind(
                    any_port(),
                    key(),
                    WorkerIdentity {
                        job: JOB,
                        worker: id,
                        pipeline: id,
                        stage: 0,
                    },
                )
                .unwrap(),
            );
            let member = RingMember {
                id,
                addr: listener.local_addr(),
            };
            Worker { listener, member }
        })
        .collect()
}

fn options() -> CollectiveOptions {
    let mut o = CollectiveOptions::new(key());
    o.setup_timeout = WAIT;
    o.io_timeout = WAIT;
    o
}

fn collective(w: &Worker, opts: CollectiveOptions) -> Collective {
    Collective::new(w.listener.clone(), opts).unwrap()
}

fn group(ws: &[Worker], ids: &[u32]) -> Vec<RingMember> {
    ws.iter()
        .filter(|w| ids.contains(&w.member.id))
        .map(|w| w.member)
        .collect()
}

/// Runs `f` on every collective at once, one thread each; returns the
/// results in the same order.
fn together<T: Send>(
    cs: &mut [Collective],
    f: impl Fn(usize, &mut Collective) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = cs
            .iter_mut()
            .enumerate()
            .map(|(i, c)| s.spawn(move || f(i, c)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn assert_same_bits(outs: &[Vec<f32>]) {
    for o in &outs[1..] {
        assert_eq!(o.len(), outs[0].len());
        assert!(
            o.iter()
                .zip(&outs[0])
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "members differ"
        );
    }
}

/// All-reduces each member's input; returns every member's output.
fn all_reduce(cs: &mut [Collective], members: &[RingMember], inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    together(cs, |i, c| {
        let mut buf = inputs[i].clone();
        c.all_reduce_mean(members, &mut buf).unwrap();
        buf
    })
}

#[test]
fn all_reduce_gives_every_member_the_same_mean_bits() {
    let mut rng = StdRng::seed_from_u64(5);
    for n in [1usize, 2, 3, 5] {
        let ids: Vec<u32> = (0..n as u32).map(|i| 10 + 3 * i).collect();
        let ws = workers(&ids);
        let members = group(&ws, &ids);
        let mut cs: Vec<_> = ws.iter().map(|w| collective(w, options())).collect();
        let mut lens = vec![0usize, 1, 7, 1000];
        if n == 3 {
            lens.push(1_000_003);
        }
        for &len in &lens {
            // Values in [1, 2): the mean is at least 1, so relative error
            // is error.
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|_| (0..len).map(|_| rng.gen_range(1.0f32..2.0)).collect())
                .collect();
            let outs = all_reduce(&mut cs, &members, &inputs);
            assert_same_bits(&outs);
            for j in 0..len {
                let mean = inputs.iter().map(|x| f64::from(x[j])).sum::<f64>() / n as f64;
                let got = f64::from(outs[0][j]);
                assert!(
                    ((got - mean) / mean).abs() <= 1e-6,
                    "n={n} len={len} j={j}: {got} vs {mean}"
                );
            }
            // Integers whose mean is exact: j % 1000 + m, mean j % 1000 + (n-1)/2.
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|m| (0..len).map(|j| ((j % 1000) + m) as f32).collect())
                .collect();
            let outs = all_reduce(&mut cs, &members, &inputs);
            assert_same_bits(&outs);
            for (j, v) in outs[0].iter().enumerate() {
                assert_eq!(
                    *v,
                    (j % 1000) as f32 + (n as f32 - 1.0) / 2.0,
                    "n={n} len={len} j={j}"
                );
            }
        }
        for c in &cs {
            let st = c.stats();
            assert_eq!(st.ops, 2 * lens.len() as u64);
            // One ring for the whole sequence (none for a group of one).
            assert_eq!(st.rings_built, u64::from(n > 1));
        }
    }
}

#[test]
fn rings_are_cached_per_group_and_reused() {
    let ws = workers(&[0, 1, 2]);
    let mut cs: Vec<_> = ws.iter().map(|w| collective(w, options())).collect();
    let all = group(&ws, &[0, 1, 2]);
    let pair = group(&ws, &[0, 1]);
    let ones = |n: usize| vec![vec![1.0f32; 10]; n];
    all_reduce(&mut cs, &all, &ones(3));
    all_reduce(&mut cs, &all, &ones(3));
    for c in &cs {
        let st = c.stats();
        assert_eq!(
            (st.rings_built, st.ring_reuses, st.connections_dialled),
            (1, 1, 1)
        );
    }
    // A different group opens new connections, only among its members.
    let outs = all_reduce(&mut cs[..2], &pair, &[vec![1.0; 10], vec![3.0; 10]]);
    assert_eq!(outs[0], vec![2.0; 10]);
    for c in &cs[..2] {
        let st = c.stats();
        assert_eq!((st.rings_built, st.connections_dialled), (2, 2));
        assert_eq!(c.cached_groups(), vec![vec![0, 1, 2], vec![0, 1]]);
    }
    assert_eq!(cs[2].stats().rings_built, 1);
    // Members 0 and 1 each hold one accepted edge per group; 2 holds one.
    assert_eq!(ws[0].listener.open_connections(), 2);
    assert_eq!(ws[2].listener.open_connections(), 1);
    // Back to the first group: still cached.
    all_reduce(&mut cs, &all, &ones(3));
    for c in &cs {
        assert_eq!(c.stats().ring_reuses, 2);
        assert_eq!(c.stats().evictions, 0);
    }
}

#[test]
fn a_group_evicted_by_some_members_is_rebuilt_with_those_that_kept_it() {
    let ws = workers(&[0, 1, 2]);
    let small = CollectiveOptions {
        cache_max: 1,
        ..options()
    };
    let mut cs = vec![
        collective(&ws[0], small.clone()),
        collective(&ws[1], small),
        collective(&ws[2], options()),
    ];
    let all = group(&ws, &[0, 1, 2]);
    let pair = group(&ws, &[0, 1]);
    let inputs = vec![vec![0.0f32; 5], vec![3.0; 5], vec![6.0; 5]];
    assert_eq!(all_reduce(&mut cs, &all, &inputs)[0], vec![3.0; 5]);
    // 0 and 1 average alone, evicting the group of three; 2 keeps it.
    all_reduce(&mut cs[..2], &pair, &inputs[..2]);
    let outs = all_reduce(&mut cs, &all, &inputs);
    assert_same_bits(&outs);
    assert_eq!(outs[0], vec![3.0; 5]);
    for c in &cs[..2] {
        let st = c.stats();
        assert_eq!((st.rings_built, st.evictions), (3, 2));
    }
    let st = cs[2].stats();
    assert_eq!((st.rings_built, st.ring_reuses), (1, 1));
    // Both of 2's cached edges were closed by the neighbours that evicted.
    assert_eq!(st.edges_replaced, 2);
}

#[test]
fn broadcast_copies_the_root_buffer_to_every_member() {
    for (n, root_index, len) in [
        (1usize, 0usize, 9usize),
        (2, 1, 9),
        (3, 1, 600_001),
        (5, 4, 1000),
    ] {
        let ids: Vec<u32> = (0..n as u32).collect();
        let ws = workers(&ids);
        let members = group(&ws, &ids);
        let mut cs: Vec<_> = ws.iter().map(|w| collective(w, options())).collect();
        let root = ids[root_index];
        let outs = together(&mut cs, |i, c| {
            let mut buf: Vec<f32> = (0..len).map(|j| (i * len + j) as f32 * 0.5).collect();
            c.broadcast(&members, root, &mut buf).unwrap();
            buf
        });
        let want: Vec<f32> = (0..len)
            .map(|j| (root_index * len + j) as f32 * 0.5)
            .collect();
        for o in &outs {
            assert!(o.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
}

#[test]
fn a_member_killed_mid_reduce_fails_every_other_member_then_the_group_recovers() {
    let ids = [0u32, 1, 2, 3];
    let ws = workers(&ids);
    let members = group(&ws, &ids);
    let failing = CollectiveOptions {
        setup_timeout: Duration::from_secs(10),
        io_timeout: Duration::from_secs(10),
        ..options()
    };
    let victim = 2;
    let mut cs: Vec<_> = ws
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let mut o = failing.clone();
            if i == victim {
                // Several segments per step at this length: it dies mid-step.
                o.fault = Some(InjectedFault::DieAfterSegments(3));
            }
            collective(w, o)
        })
        .collect();
    let len = 2_000_000;
    let results = together(&mut cs, |i, c| {
        let mut buf = vec![i as f32; len];
        c.all_reduce_mean(&members, &mut buf)
    });
    for (i, r) in results.iter().enumerate() {
        let e = r.as_ref().unwrap_err();
        eprintln!("member {i}: {e}");
        if i == victim {
            assert!(matches!(e, CollectiveError::Injected { .. }), "{e}");
        } else {
            assert!(
                matches!(
                    e,
                    CollectiveError::MemberLost { .. } | CollectiveError::Timeout { .. }
                ),
                "member {i}: {e}"
            );
            assert!(e.to_string().contains("group [0, 1, 2, 3]"), "{e}");
        }
    }
    // The victim comes back (a fresh collective on its listener) and the
    // group averages again over new connections.
    cs[victim] = collective(&ws[victim], failing);
    let outs = together(&mut cs, |i, c| {
        let mut buf = vec![i as f32 * 2.0; 1000];
        c.all_reduce_mean(&members, &mut buf).unwrap();
        buf
    });
    assert_same_bits(&outs);
    assert_eq!(outs[0], vec![3.0; 1000]);
}

#[test]
fn a_member_gone_between_operations_fails_the_others_at_once() {
    let ws = workers(&[0, 1, 2]);
    let members = group(&ws, &[0, 1, 2]);
    let mut cs: Vec<_> = ws.iter().map(|w| collective(w, options())).collect();
    all_reduce(
        &mut cs,
        &members,
        &[vec![1.0; 8], vec![2.0; 8], vec![3.0; 8]],
    );
    // Member 2 goes away: its sockets close with no bye.
    drop(cs.pop());
    let results = together(&mut cs, |_, c| c.all_reduce_mean(&members, &mut [1.0; 8]));
    for r in &results {
        // Lost at once on the cached edge, not after a timeout (WAIT is 30 s
        // and the error is not a timeout).
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(e, CollectiveError::MemberLost { member: 0 | 2, .. }),
            "{e}"
        );
    }
}

#[test]
fn a_member_that_never_joins_fails_the_others_within_the_setup_timeout() {
    let ws = workers(&[0, 1, 2]);
    let members = group(&ws, &[0, 1, 2]);
    let short = CollectiveOptions {
        setup_timeout: Duration::from_millis(500),
        io_timeout: Duration::from_secs(2),
        ..options()
    };
    // Member 2's listener is bound, but it never calls.
    let mut cs: Vec<_> = ws[..2]
        .iter()
        .map(|w| collective(w, short.clone()))
        .collect();
    let results = together(&mut cs, |_, c| c.all_reduce_mean(&members, &mut [1.0; 4]));
    let e = results[0].as_ref().unwrap_err();
    assert!(
        matches!(e, CollectiveError::NeverConnected { member: 2, .. }),
        "{e}"
    );
    let e = results[1].as_ref().unwrap_err();
    assert!(
        matches!(
            e,
            CollectiveError::MemberLost { member: 0, .. }
                | CollectiveError::Timeout { .. }
                | CollectiveError::NeverConnected { .. }
        ),
        "{e}"
    );
}

#[test]
fn collectives_refuse_groups_they_cannot_run() {
    let ws = workers(&[0, 1]);
    let mut c = collective(&ws[0], options());
    let stranger = RingMember {
        id: 9,
        addr: ws[1].member.addr,
    };
    for bad in [vec![], vec![ws[1].member], vec![ws[0].member, ws[0].member]] {
        assert!(matches!(
            c.all_reduce_mean(&bad, &mut [1.0]),
            Err(CollectiveError::Invalid(_))
        ));
    }
    assert!(matches!(
        c.broadcast(&[ws[0].member, stranger], 5, &mut [1.0]),
        Err(CollectiveError::Invalid(_))
    ));
    // A ring edge to a worker that is not member 9 is refused by its listener.
    let e = c
        .all_reduce_mean(&[ws[0].member, stranger], &mut [1.0])
        .unwrap_err();
    assert!(
        matches!(
            &e,
            CollectiveError::Dial {
                member: 9,
                source: distmind_runtime::dist::DialError::Refused(Refusal::WrongWorker {
                    ours: 1,
                    theirs: 9
                }),
                ..
            }
        ),
        "{e}"
    );
}
