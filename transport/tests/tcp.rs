//! TcpTransport against a test-only data server that does the real handshake
//! and speaks the real data protocol, plus misbehaving variants.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::handshake::{self, ClusterKey};
use distmind_common::limits::READ_CHUNK_BYTES_MAX;
use distmind_common::wire::{ReadReply, ReadRequest, ReadStatus, Role, READ_REQUEST_BYTES};
use distmind_transport::{
    read_blocking, Completion, HostBuffer, HugePages, PeerId, ReadOp, RegionId, TcpOptions,
    TcpTransport, Transport, TransportError, INFLIGHT_OPS_MAX,
};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Behavior {
    Good,
    /// Sends half of the first payload, then closes.
    CloseMidPayload,
    /// Echoes a wrong wr_id.
    WrongWrId,
    /// Answers with one byte less than asked.
    WrongLen,
    /// Reads requests, never answers.
    Stall,
}

fn key() -> ClusterKey {
    ClusterKey::from_secret(b"transport-test-cluster-key")
}

/// Arena byte `i` of the server seeded `seed`.
fn pattern(i: u64, seed: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9).wrapping_add(seed) >> 3) as u8
}

fn arena(len: usize, seed: u64) -> Arc<HostBuffer> {
    let b = HostBuffer::new(len, HugePages::No).unwrap();
    // SAFETY: not shared yet.
    let s = unsafe { b.slice_mut(0..len) };
    for (i, x) in s.iter_mut().enumerate() {
        *x = pattern(i as u64, seed);
    }
    Arc::new(b)
}

/// Starts a data server on 127.0.0.1:0; its threads end with the test process.
fn serve(arena: Arc<HostBuffer>, key: ClusterKey, behavior: Behavior) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let (a, k) = (arena.clone(), key.clone());
            std::thread::spawn(move || {
                if let Some(s) = handshake_server(s.unwrap(), &k) {
                    serve_conn(s, &a, behavior);
                }
            });
        }
    });
    addr
}

fn handshake_server(s: TcpStream, key: &ClusterKey) -> Option<TcpStream> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    s.set_nonblocking(true).unwrap();
    let s = rt.block_on(async {
        let mut s = tokio::net::TcpStream::from_std(s).unwrap();
        match handshake::server(&mut s, key).await {
            Ok(Role::Data) => Some(s),
            _ => None,
        }
    })?;
    let s = s.into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    Some(s)
}

fn serve_conn(mut s: TcpStream, arena: &HostBuffer, behavior: Behavior) {
    let mut rb = [0u8; READ_REQUEST_BYTES];
    while s.read_exact(&mut rb).is_ok() {
        let req = ReadRequest::decode(&rb, READ_CHUNK_BYTES_MAX).unwrap();
        if behavior == Behavior::Stall {
            continue;
        }
        if req
            .offset
            .checked_add(req.len)
            .is_none_or(|e| e > arena.len() as u64)
        {
            let r = ReadReply {
                wr_id: req.wr_id,
                status: ReadStatus::OutOfRange,
                len: 0,
            };
            s.write_all(&r.encode()).unwrap();
            continue;
        }
        let (wr_id, len) = match behavior {
            Behavior::WrongWrId => (req.wr_id + 100, req.len),
            Behavior::WrongLen => (req.wr_id, req.len - 1),
            _ => (req.wr_id, req.len),
        };
        let start = req.offset as usize;
        // SAFETY: nothing writes the arena after it was filled.
        let bytes = unsafe { arena.slice(start..start + len as usize) };
        let r = ReadReply {
            wr_id,
            status: ReadStatus::Ok,
            len,
        };
        if s.write_all(&r.encode()).is_err() {
            return;
        }
        if behavior == Behavior::CloseMidPayload {
            let _ = s.write_all(&bytes[..bytes.len() / 2]);
            let _ = s.shutdown(Shutdown::Both);
            return;
        }
        if s.write_all(bytes).is_err() {
            return;
        }
    }
}

fn transport(f: impl FnOnce(&mut TcpOptions)) -> TcpTransport {
    let mut o = TcpOptions::new(key());
    f(&mut o);
    TcpTransport::new(o).unwrap()
}

fn op(wr_id: u64, remote_offset: u64, len: u64, local: RegionId, local_offset: u64) -> ReadOp {
    ReadOp {
        wr_id,
        remote_offset,
        len,
        local,
        local_offset,
    }
}

/// Posts every batch, then polls until all of them completed.
fn run_all(t: &dyn Transport, batches: &[(PeerId, Vec<ReadOp>)]) -> Vec<Completion> {
    let total: usize = batches.iter().map(|b| b.1.len()).sum();
    for (p, ops) in batches {
        // SAFETY: the tests give every op its own local range and touch
        // local buffers only after the completions were polled.
        unsafe { t.post_reads(*p, ops).unwrap() };
    }
    let mut out = Vec::new();
    while out.len() < total {
        t.poll(&mut out, total, Duration::from_secs(10)).unwrap();
    }
    out
}

fn check(local: &HostBuffer, local_offset: u64, remote_offset: u64, len: u64, seed: u64) {
    // SAFETY: reads into this range have completed.
    let got = unsafe { local.slice(local_offset as usize..(local_offset + len) as usize) };
    for (i, &b) in got.iter().enumerate() {
        assert_eq!(
            b,
            pattern(remote_offset + i as u64, seed),
            "byte {i} of local {local_offset}+{len}"
        );
    }
}

#[test]
fn reads_64_mib_from_two_peers_over_four_streams_each() {
    const HALF: u64 = 32 << 20;
    let a1 = serve(arena(HALF as usize + 4096, 1), key(), Behavior::Good);
    let a2 = serve(arena(HALF as usize + 4096, 2), key(), Behavior::Good);
    let t = transport(|_| {});
    let local = Arc::new(HostBuffer::new(2 * HALF as usize, HugePages::Try).unwrap());
    let r = t.register(local.clone()).unwrap();
    let p1 = t.connect(&a1).unwrap();
    let p2 = t.connect(&a2).unwrap();
    assert_eq!(
        t.connect(&a1).unwrap(),
        p1,
        "connect is idempotent per address"
    );
    assert_ne!(p1, p2);
    // Ops of uneven sizes (not multiples of the 4 MiB chunk), at an offset.
    let sizes = [10 << 20, 1, (4 << 20) + 7, HALF - (18 << 20) - 8, 4 << 20];
    let mut batches = vec![(p1, Vec::new()), (p2, Vec::new())];
    for (bi, b) in batches.iter_mut().enumerate() {
        let mut pos = 0;
        for (i, &len) in sizes.iter().enumerate() {
            b.1.push(op(
                (bi * 100 + i) as u64,
                4096 + pos,
                len,
                r,
                bi as u64 * HALF + pos,
            ));
            pos += len;
        }
        assert_eq!(pos, HALF);
    }
    let done = run_all(&t, &batches);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    check(&local, 0, 4096, HALF, 1);
    check(&local, HALF, 4096, HALF, 2);
    let st = t.stats();
    assert_eq!(
        (st.bytes_read, st.ops_completed, st.ops_failed),
        (2 * HALF, 10, 0)
    );
    t.deregister(r).unwrap();
}

/// Ops posted together, each with a chunk for every stream, land in the
/// order they were posted: every stream carries the first op's chunk before
/// the second's (a fetch's group 0 does not share the link with group 1).
#[test]
fn ops_posted_together_complete_in_posting_order() {
    const STREAMS: u64 = 4;
    const CHUNK: u64 = 1 << 20;
    const OPS: u64 = 6;
    let len = STREAMS * CHUNK;
    let a = serve(arena((OPS * len) as usize, 5), key(), Behavior::Good);
    let t = transport(|o| {
        o.streams_per_peer = STREAMS as usize;
        o.chunk_bytes = CHUNK;
    });
    let local = Arc::new(HostBuffer::new((OPS * len) as usize, HugePages::No).unwrap());
    let r = t.register(local.clone()).unwrap();
    let p = t.connect(&a).unwrap();
    for round in 0..3 {
        let ops: Vec<ReadOp> = (0..OPS).map(|i| op(i, i * len, len, r, i * len)).collect();
        let done = run_all(&t, &[(p, ops)]);
        let order: Vec<u64> = done.iter().map(|c| c.wr_id).collect();
        assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
        assert_eq!(order, (0..OPS).collect::<Vec<_>>(), "round {round}");
    }
    check(&local, 0, 0, OPS * len, 5);
    t.deregister(r).unwrap();
}

#[test]
fn stream_threads_run_at_the_configured_nice_value_and_still_read() {
    let a = serve(arena(1 << 20, 5), key(), Behavior::Good);
    let t = transport(|o| o.thread_nice = 9);
    let local = Arc::new(HostBuffer::new(1 << 20, HugePages::No).unwrap());
    let r = t.register(local.clone()).unwrap();
    let p = t.connect(&a).unwrap();
    let done = run_all(&t, &[(p, vec![op(1, 0, 1 << 20, r, 0)])]);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    check(&local, 0, 0, 1 << 20, 5);
    // Other tests' transports run at the process's own value; this one's
    // threads (named dm-tcp-*) carry the configured one.
    let want = 9.max(distmind_transport::priority::current_thread_nice());
    let found = distmind_transport::priority::threads_nice("dm-tcp");
    assert!(
        found.contains(&want),
        "stream threads' nice values: {found:?}"
    );
}

#[test]
fn many_small_ops_with_small_chunks() {
    let a = serve(arena(1 << 20, 3), key(), Behavior::Good);
    let t = transport(|o| {
        o.chunk_bytes = 1000;
        o.streams_per_peer = 3;
        o.inflight_per_stream = 8;
    });
    let local = Arc::new(HostBuffer::new(16 << 20, HugePages::No).unwrap());
    let r = t.register(local.clone()).unwrap();
    let p = t.connect(&a).unwrap();
    let mut ops = Vec::new();
    let mut pos = 0;
    for i in 0..10_000u64 {
        let len = 1 + (i * 7919) % 3000;
        ops.push(op(i, (i * 104_729) % ((1 << 20) - 3000), len, r, pos));
        pos += len;
    }
    // SAFETY: disjoint local ranges, untouched until the call returns.
    unsafe { read_blocking(&t, p, &ops).unwrap() };
    for o in &ops {
        check(&local, o.local_offset, o.remote_offset, o.len, 3);
    }
    assert_eq!(t.stats().ops_completed, 10_000);
}

#[test]
fn queue_full_is_reported_and_clears_after_polling() {
    let a = serve(arena(1 << 20, 4), key(), Behavior::Good);
    let t = transport(|_| {});
    let local = Arc::new(HostBuffer::new(INFLIGHT_OPS_MAX + 1, HugePages::No).unwrap());
    let r = t.register(local.clone()).unwrap();
    let p = t.connect(&a).unwrap();
    let ops: Vec<_> = (0..INFLIGHT_OPS_MAX as u64 + 1)
        .map(|i| op(i, i, 1, r, i))
        .collect();
    // SAFETY (all posts): disjoint one-byte ranges, read only after polling.
    unsafe { t.post_reads(p, &ops[..INFLIGHT_OPS_MAX]).unwrap() };
    let e = unsafe { t.post_reads(p, &ops[INFLIGHT_OPS_MAX..]) }.unwrap_err();
    assert!(matches!(e, TransportError::QueueFull { .. }), "{e}");
    let mut out = Vec::new();
    while out.len() < INFLIGHT_OPS_MAX {
        t.poll(&mut out, usize::MAX, Duration::from_secs(10))
            .unwrap();
    }
    unsafe { read_blocking(&t, p, &ops[INFLIGHT_OPS_MAX..]).unwrap() };
    check(&local, 0, 0, INFLIGHT_OPS_MAX as u64 + 1, 4);
}

#[test]
fn rate_limit_is_honoured() {
    const BYTES: u64 = 24 << 20;
    const RATE: u64 = 48 << 20;
    let a = serve(arena(BYTES as usize, 5), key(), Behavior::Good);
    let t = transport(|o| o.rate_limit_bytes_per_s = Some(RATE));
    let local = Arc::new(HostBuffer::new(BYTES as usize, HugePages::No).unwrap());
    let r = t.register(local.clone()).unwrap();
    let p = t.connect(&a).unwrap();
    let start = Instant::now();
    // SAFETY: the op owns `local` until the call returns.
    unsafe { read_blocking(&t, p, &[op(1, 0, BYTES, r, 0)]).unwrap() };
    let elapsed = start.elapsed().as_secs_f64();
    let ideal = BYTES as f64 / RATE as f64;
    assert!(
        elapsed >= 0.8 * ideal,
        "{BYTES} bytes at {RATE} B/s took {elapsed:.3}s, under 80% of {ideal:.3}s"
    );
    check(&local, 0, 0, BYTES, 5);
}

#[test]
fn peer_closing_mid_payload_fails_its_ops_and_spares_others() {
    let bad = serve(arena(16 << 20, 6), key(), Behavior::CloseMidPayload);
    let good = serve(arena(16 << 20, 7), key(), Behavior::Good);
    let t = transport(|o| o.streams_per_peer = 2);
    let local = Arc::new(HostBuffer::new(32 << 20, HugePages::No).unwrap());
    let r = t.register(local.clone()).unwrap();
    let pb = t.connect(&bad).unwrap();
    let pg = t.connect(&good).unwrap();
    let bad_ops: Vec<_> = (0..4)
        .map(|i| op(i, i << 22, 4 << 20, r, i << 22))
        .collect();
    let good_ops = vec![op(10, 0, 16 << 20, r, 16 << 20)];
    let done = run_all(&t, &[(pb, bad_ops), (pg, good_ops)]);
    for c in &done {
        if c.wr_id == 10 {
            assert!(c.result.is_ok(), "{c:?}");
        } else {
            let e = c
                .result
                .as_ref()
                .expect_err("a truncated read never succeeds");
            assert!(
                matches!(e, TransportError::PeerLost { addr, .. } if *addr == bad),
                "{e}"
            );
        }
    }
    check(&local, 16 << 20, 0, 16 << 20, 7);
    // SAFETY (both posts): nothing reads `local` during them.
    let e = unsafe { t.post_reads(pb, &[op(20, 0, 1, r, 0)]) }.unwrap_err();
    assert!(matches!(e, TransportError::PeerLost { .. }), "{e}");
    let again = t.connect(&bad).unwrap();
    assert_ne!(again, pb, "a lost peer is replaced by a fresh connection");
    assert!(matches!(
        t.post_reads_unchecked(pb),
        Err(TransportError::UnknownPeer(_))
    ));
    assert_eq!(t.stats().ops_failed, 4);
}

trait PostOne {
    fn post_reads_unchecked(&self, p: PeerId) -> Result<(), TransportError>;
}

impl PostOne for TcpTransport {
    /// Posts a read into a region that does not exist: only the peer check matters.
    fn post_reads_unchecked(&self, p: PeerId) -> Result<(), TransportError> {
        // SAFETY: the op cannot pass validation, so nothing is written.
        unsafe { self.post_reads(p, &[op(0, 0, 1, RegionId(u32::MAX), 0)]) }
    }
}

fn single_failure(behavior: Behavior) -> (String, TransportError) {
    let a = serve(arena(1 << 20, 8), key(), behavior);
    let t = transport(|o| o.streams_per_peer = 1);
    let local = Arc::new(HostBuffer::new(1 << 20, HugePages::No).unwrap());
    let r = t.register(local).unwrap();
    let p = t.connect(&a).unwrap();
    // SAFETY: nothing reads the local buffer.
    let e = unsafe { read_blocking(&t, p, &[op(1, 0, 1000, r, 0), op(2, 1000, 1000, r, 1000)]) }
        .unwrap_err();
    (a, e)
}

#[test]
fn wrong_wr_id_is_a_protocol_error() {
    let (a, e) = single_failure(Behavior::WrongWrId);
    assert!(protocol_failure(&e, &a, "expecting"), "{e}");
}

/// The op whose reply was wrong fails with `Protocol`; the peer's other ops
/// fail with `PeerLost` carrying the same cause. Which one a caller sees
/// first depends on completion order, so either is accepted.
fn protocol_failure(e: &TransportError, a: &str, what: &str) -> bool {
    match e {
        TransportError::Protocol { addr, detail } => addr == a && detail.contains(what),
        TransportError::PeerLost { addr, reason } => {
            addr == a && reason.contains("protocol error") && reason.contains(what)
        }
        _ => false,
    }
}

#[test]
fn wrong_len_is_a_protocol_error() {
    let (a, e) = single_failure(Behavior::WrongLen);
    assert!(protocol_failure(&e, &a, "999"), "{e}");
}

#[test]
fn silent_peer_times_out_as_peer_lost() {
    let a = serve(arena(1 << 20, 9), key(), Behavior::Stall);
    let t = transport(|o| o.io_timeout = Duration::from_millis(200));
    let local = Arc::new(HostBuffer::new(1 << 20, HugePages::No).unwrap());
    let r = t.register(local).unwrap();
    let p = t.connect(&a).unwrap();
    // SAFETY: nothing reads the local buffer.
    let e = unsafe { read_blocking(&t, p, &[op(1, 0, 1000, r, 0)]) }.unwrap_err();
    assert!(
        matches!(&e, TransportError::PeerLost { reason, .. } if reason.contains("timeout")),
        "{e}"
    );
}

#[test]
fn disconnect_fails_queued_and_inflight_ops_and_frees_the_region() {
    let a = serve(arena(64 << 20, 10), key(), Behavior::Stall);
    let t = transport(|o| o.chunk_bytes = 1 << 20);
    let local = Arc::new(HostBuffer::new(64 << 20, HugePages::No).unwrap());
    let r = t.register(local).unwrap();
    let p = t.connect(&a).unwrap();
    let ops: Vec<_> = (0..8)
        .map(|i| op(i, i << 23, 8 << 20, r, i << 23))
        .collect();
    // SAFETY: nothing reads the local buffer.
    unsafe { t.post_reads(p, &ops).unwrap() };
    assert!(matches!(t.deregister(r), Err(TransportError::Busy(_))));
    t.disconnect(p);
    let mut out = Vec::new();
    assert_eq!(
        t.poll(&mut out, 100, Duration::ZERO).unwrap(),
        8,
        "disconnect completes every op"
    );
    assert!(out
        .iter()
        .all(|c| matches!(c.result, Err(TransportError::PeerLost { .. }))));
    t.deregister(r).unwrap();
    assert!(matches!(
        t.post_reads_unchecked(p),
        Err(TransportError::UnknownPeer(_))
    ));
}

#[test]
fn remote_out_of_range_fails_only_that_op() {
    let a = serve(arena(1 << 20, 11), key(), Behavior::Good);
    let t = transport(|o| o.streams_per_peer = 1);
    let local = Arc::new(HostBuffer::new(1 << 20, HugePages::No).unwrap());
    let r = t.register(local.clone()).unwrap();
    let p = t.connect(&a).unwrap();
    let done = run_all(
        &t,
        &[(
            p,
            vec![op(1, (1 << 20) - 10, 100, r, 0), op(2, 0, 4096, r, 4096)],
        )],
    );
    for c in done {
        match c.wr_id {
            1 => assert!(
                matches!(c.result, Err(TransportError::RemoteOutOfRange { offset, len: 100, .. }) if offset == (1 << 20) - 10)
            ),
            _ => c.result.unwrap(),
        }
    }
    check(&local, 4096, 0, 4096, 11);
}

#[test]
fn wrong_cluster_key_fails_the_handshake_naming_the_address() {
    let a = serve(
        arena(4096, 12),
        ClusterKey::from_secret(b"another-cluster-key"),
        Behavior::Good,
    );
    let t = transport(|_| {});
    let e = t.connect(&a).unwrap_err();
    assert!(
        matches!(&e, TransportError::Handshake { addr, .. } if *addr == a),
        "{e}"
    );
    assert!(e.to_string().contains(&a), "{e}");
}

/// Starts a plain server that, per connection, writes `len` bytes of the
/// arena from `offset` once a one-byte go is received.
fn serve_raw(arena: Arc<HostBuffer>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let a = arena.clone();
            std::thread::spawn(move || {
                let mut s = s.unwrap();
                let mut go = [0u8; 1];
                s.read_exact(&mut go).unwrap();
                // SAFETY: nothing writes the arena after it was filled.
                s.write_all(unsafe { a.slice(0..a.len()) }).unwrap();
            });
        }
    });
    addr
}

/// `cargo test --release -p distmind-transport --test tcp -- --ignored --nocapture`
#[test]
#[ignore = "throughput measurement; run in release"]
fn throughput_vs_raw_socket_copy() {
    const TOTAL: u64 = 1 << 30;
    let local = Arc::new(HostBuffer::new(TOTAL as usize, HugePages::Try).unwrap());
    for servers in [1u64, 2, 4] {
        let per = TOTAL / servers;
        let arenas: Vec<_> = (0..servers).map(|i| arena(per as usize, i)).collect();
        // Raw: one plain socket per server, read_exact in 4 MiB pieces.
        let raw: Vec<_> = arenas.iter().map(|a| serve_raw(a.clone())).collect();
        let start = Instant::now();
        std::thread::scope(|sc| {
            for (i, addr) in raw.iter().enumerate() {
                let local = &local;
                sc.spawn(move || {
                    let mut s = TcpStream::connect(addr).unwrap();
                    s.write_all(&[1]).unwrap();
                    let base = i as u64 * per;
                    for off in (0..per).step_by(4 << 20) {
                        let n = (4 << 20).min(per - off);
                        // SAFETY: each thread owns its own range of `local`.
                        let dst = unsafe {
                            local.slice_mut((base + off) as usize..(base + off + n) as usize)
                        };
                        s.read_exact(dst).unwrap();
                    }
                });
            }
        });
        let raw_gbps = TOTAL as f64 / start.elapsed().as_secs_f64() / 1e9;

        let addrs: Vec<_> = arenas
            .iter()
            .map(|a| serve(a.clone(), key(), Behavior::Good))
            .collect();
        // DM_TCP_SOCKBUF=<bytes> tries explicit socket buffers instead of autotuning.
        let t = transport(|o| {
            o.socket_buffer_bytes = std::env::var("DM_TCP_SOCKBUF")
                .ok()
                .filter(|v| !v.is_empty())
                .map(|v| v.parse().unwrap())
        });
        let r = t.register(local.clone()).unwrap();
        let batches: Vec<_> = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let p = t.connect(a).unwrap();
                // One op per 32 MB parameter group, like a cache fill.
                let ops = (0..per)
                    .step_by(32 << 20)
                    .map(|off| op(off, off, (32 << 20).min(per - off), r, i as u64 * per + off));
                (p, ops.collect::<Vec<_>>())
            })
            .collect();
        let start = Instant::now();
        let done = run_all(&t, &batches);
        let tcp_gbps = TOTAL as f64 / start.elapsed().as_secs_f64() / 1e9;
        assert!(done.iter().all(|c| c.result.is_ok()));
        for (i, _) in arenas.iter().enumerate() {
            check(&local, i as u64 * per, 0, 1 << 20, i as u64);
        }
        println!(
            "servers={servers} raw={raw_gbps:.2} GB/s transport={tcp_gbps:.2} GB/s ratio={:.2}",
            tcp_gbps / raw_gbps
        );
    }
}
