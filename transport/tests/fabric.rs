//! libfabric wrapper end to end: two endpoints in one process over
//! `tcp;ofi_rxm` on loopback, one-sided reads verified byte by byte.
#![cfg(feature = "fabric")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_transport::fabric::{
    Access, AddressVector, CompletionQueue, CqEntry, Domain, Endpoint, Fabric, FabricTransport,
    Hints, Info, MemoryRegion, RemoteArena, Resolver, CQ_SIZE_DEFAULT, DEFAULT_PROVIDER,
};
use distmind_transport::{
    read_blocking, HostBuffer, HugePages, PeerId, ReadOp, Transport, TransportError, TransportStats,
};

const MIB: usize = 1 << 20;

/// One side: everything down to an enabled endpoint.
struct Side {
    domain: Domain,
    cq: CompletionQueue,
    ep: Endpoint,
}

fn side() -> Side {
    let info = Info::get(&Hints::new(DEFAULT_PROVIDER)).expect("fi_getinfo tcp;ofi_rxm");
    let fabric = Fabric::open(&info).expect("fi_fabric");
    let domain = Domain::open(&fabric).expect("fi_domain");
    let av = AddressVector::open(&domain).expect("fi_av_open");
    let cq = CompletionQueue::open(&domain, CQ_SIZE_DEFAULT).expect("fi_cq_open");
    let ep = Endpoint::open(&domain, &av, &cq).expect("fi_endpoint");
    Side { domain, cq, ep }
}

fn pattern(i: usize) -> u8 {
    ((i as u64).wrapping_mul(0x9E37_79B1) >> 13) as u8 ^ (i >> 20) as u8
}

/// Keeps polling the serving side's completion queue (manual progress) until dropped.
struct Progress {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Progress {
    fn start(cq: CompletionQueue) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                cq.poll(&mut seen, 64).expect("server fi_cq_read");
                std::thread::yield_now();
            }
            seen.len()
        });
        Progress {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn reads_64_mib_with_8_in_flight_and_verifies_every_byte() {
    const OPS: usize = 64;
    const OP_BYTES: usize = MIB;
    const WINDOW: usize = 8;
    const SERVER_KEY: u64 = 0xD157;

    let server = side();
    let client = side();
    assert!(server.domain.info().provider_name().contains("ofi_rxm"));

    let mut src = HostBuffer::new(OPS * OP_BYTES, HugePages::No).unwrap();
    for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
        *b = pattern(i);
    }
    let src_mr = MemoryRegion::register(
        &server.domain,
        Arc::new(src),
        Access::RemoteRead,
        SERVER_KEY,
    )
    .expect("register server buffer");
    let dst = Arc::new(HostBuffer::new(OPS * OP_BYTES, HugePages::No).unwrap());
    let dst_mr = MemoryRegion::register(&client.domain, dst.clone(), Access::LocalReadTarget, 1)
        .expect("register client buffer");

    // The exchange a control connection would carry: address, key, base.
    let server_name = server.ep.name().expect("fi_getname");
    assert!(!server_name.is_empty());
    let peer = client.ep.insert_peer(&server_name).expect("fi_av_insert");
    let key = src_mr.key();

    let progress = Progress::start(server.cq.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut next = 0usize;
    let mut in_flight = 0usize;
    let mut done = [false; OPS];
    let mut completions: Vec<CqEntry> = Vec::new();
    let started = Instant::now();
    while next < OPS || in_flight > 0 {
        assert!(
            Instant::now() < deadline,
            "reads did not finish: {next} posted, {in_flight} in flight"
        );
        while next < OPS && in_flight < WINDOW {
            let off = next * OP_BYTES;
            // SAFETY: each op has its own disjoint 1 MiB range of `dst`, which
            // nothing else touches until all completions were polled; dst_mr
            // lives until the end of the test.
            let r = unsafe {
                client.ep.read(
                    &dst_mr,
                    off,
                    OP_BYTES,
                    peer,
                    src_mr.remote_addr(off as u64),
                    key,
                    next as u64,
                )
            };
            match r {
                Ok(()) => {
                    next += 1;
                    in_flight += 1;
                }
                Err(e) if e.is_again() => break,
                Err(e) => panic!("fi_read: {e}"),
            }
        }
        completions.clear();
        client
            .cq
            .poll(&mut completions, WINDOW)
            .expect("client fi_cq_read");
        for c in &completions {
            c.result
                .as_ref()
                .unwrap_or_else(|e| panic!("read {} failed: {e}", c.context));
            let i = c.context as usize;
            assert!(
                i < OPS && !done[i],
                "unexpected or duplicate completion {i}"
            );
            done[i] = true;
            in_flight -= 1;
        }
    }
    let elapsed = started.elapsed();
    drop(progress);
    eprintln!(
        "{OPS} x {} MiB over {}: {:.2} GB/s",
        OP_BYTES / MIB,
        client.domain.info().provider_name(),
        (OPS * OP_BYTES) as f64 / elapsed.as_secs_f64() / 1e9
    );

    // SAFETY: every read completed; no one writes `dst` any more.
    let got = unsafe { dst.slice(0..OPS * OP_BYTES) };
    if let Some(i) = (0..got.len()).find(|&i| got[i] != pattern(i)) {
        panic!(
            "byte {i} (op {}) is {:#x}, expected {:#x}",
            i / OP_BYTES,
            got[i],
            pattern(i)
        );
    }
    // Drop order: regions, then endpoints, then the rest (each holds its parents).
    drop(dst_mr);
    drop(src_mr);
}

#[test]
fn unknown_provider_is_a_clear_error_naming_it() {
    let err = Info::get(&Hints::new("no-such-provider")).unwrap_err();
    assert_eq!(err.call, "fi_getinfo");
    assert!(err.code > 0);
    let text = err.to_string();
    assert!(text.contains("\"no-such-provider\""), "{text}");
    assert!(text.contains("fi_getinfo"), "{text}");
}

#[test]
fn local_range_outside_the_region_is_refused_before_posting() {
    let server = side();
    let client = side();
    let dst = Arc::new(HostBuffer::new(4096, HugePages::No).unwrap());
    let dst_mr = MemoryRegion::register(&client.domain, dst, Access::LocalReadTarget, 7).unwrap();
    let peer = client.ep.insert_peer(&server.ep.name().unwrap()).unwrap();
    for (off, len) in [(0usize, 0usize), (4000, 200), (usize::MAX, 2)] {
        // SAFETY: refused before anything is posted.
        let err = unsafe { client.ep.read(&dst_mr, off, len, peer, 0, 1, 0) }.unwrap_err();
        assert_eq!(err.call, "fi_read");
        assert!(err.message.contains("outside"), "{err}");
    }
    // A region of another domain is refused too.
    let other = MemoryRegion::register(
        &server.domain,
        Arc::new(HostBuffer::new(4096, HugePages::No).unwrap()),
        Access::LocalReadTarget,
        8,
    )
    .unwrap();
    // SAFETY: refused before anything is posted.
    let err = unsafe { client.ep.read(&other, 0, 16, peer, 0, 1, 0) }.unwrap_err();
    assert!(err.message.contains("another domain"), "{err}");
}

/// A memory server in miniature: an endpoint serving a patterned arena, its
/// completion queue polled by a thread.
/// The endpoint closes while the progress thread still polls (the wrapper
/// makes that safe: closes wait for polls of the same domain).
struct MiniServer {
    _side: Side,
    _arena: MemoryRegion,
    _progress: Progress,
    published: RemoteArena,
}

fn mini_server(bytes: usize) -> MiniServer {
    let side = side();
    let mut buf = HostBuffer::new(bytes, HugePages::No).unwrap();
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = pattern(i);
    }
    let arena =
        MemoryRegion::register(&side.domain, Arc::new(buf), Access::RemoteRead, 42).unwrap();
    let published = RemoteArena::serving(&side.ep, &arena).unwrap();
    let progress = Progress::start(side.cq.clone());
    MiniServer {
        _side: side,
        _arena: arena,
        _progress: progress,
        published,
    }
}

fn transport_for(server: &MiniServer) -> FabricTransport {
    let published = server.published.clone();
    let resolver: Resolver = Box::new(move |addr: &str| {
        if addr == "mem0:7000" {
            Ok(published.clone())
        } else {
            Err(TransportError::Connect {
                addr: addr.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such memory server"),
            })
        }
    });
    FabricTransport::new(DEFAULT_PROVIDER, resolver).expect("fabric transport")
}

#[test]
fn fabric_transport_reads_through_the_transport_trait() {
    const BYTES: usize = 16 * MIB;
    let server = mini_server(BYTES);
    let t = transport_for(&server);
    let dyn_t: &dyn Transport = &t;
    assert_eq!(dyn_t.name(), "fabric");

    let dst = Arc::new(HostBuffer::new(BYTES, HugePages::No).unwrap());
    let region = t.register(dst.clone()).unwrap();
    let peer = t.connect("mem0:7000").unwrap();
    assert_eq!(
        t.connect("mem0:7000").unwrap(),
        peer,
        "connect is idempotent per address"
    );
    assert!(matches!(
        t.connect("mem9:1"),
        Err(TransportError::Connect { .. })
    ));

    // 1 MiB ops, the local halves swapped, plus small unaligned ones at the end.
    let mut ops: Vec<ReadOp> = (0..8u64)
        .map(|i| ReadOp {
            wr_id: i,
            remote_offset: i * MIB as u64,
            len: MIB as u64,
            local: region,
            local_offset: ((i + 8) % 16) * MIB as u64,
        })
        .collect();
    ops.extend((8..16u64).map(|i| ReadOp {
        wr_id: i,
        remote_offset: i * MIB as u64 + 3,
        len: MIB as u64 - 3,
        local: region,
        local_offset: (i - 8) * MIB as u64,
    }));
    // SAFETY: disjoint local ranges; `dst` is not touched until the call returns.
    unsafe { read_blocking(&t, peer, &ops) }.expect("read_blocking");
    // SAFETY: every read completed.
    let got = unsafe { dst.slice(0..BYTES) };
    for op in &ops {
        let l = op.local_offset as usize;
        let r = op.remote_offset as usize;
        for k in 0..op.len as usize {
            assert_eq!(got[l + k], pattern(r + k), "op {} byte {k}", op.wr_id);
        }
    }
    let stats = t.stats();
    assert_eq!(stats.ops_completed, 16);
    assert_eq!(stats.ops_failed, 0);
    assert_eq!(stats.bytes_read, ops.iter().map(|o| o.len).sum::<u64>());

    // Busy while a read is in flight, free after its completion.
    let one = ReadOp {
        wr_id: 99,
        remote_offset: 0,
        len: 4096,
        local: region,
        local_offset: 0,
    };
    // SAFETY: nothing else uses `dst` now.
    unsafe { t.post_reads(peer, &[one]) }.unwrap();
    assert!(matches!(t.deregister(region), Err(TransportError::Busy(_))));
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.is_empty() {
        assert!(Instant::now() < deadline, "single read never completed");
        t.poll(&mut out, 1, Duration::from_millis(100)).unwrap();
    }
    assert_eq!(out[0].wr_id, 99);
    assert!(out[0].result.is_ok());
    t.deregister(region).unwrap();
}

#[test]
fn fabric_transport_validates_batches_before_posting() {
    let server = mini_server(MIB);
    let t = transport_for(&server);
    let dst = Arc::new(HostBuffer::new(MIB, HugePages::No).unwrap());
    let region = t.register(dst).unwrap();
    let peer = t.connect("mem0:7000").unwrap();
    let op = |remote_offset: u64, len: u64, local_offset: u64| ReadOp {
        wr_id: 1,
        remote_offset,
        len,
        local: region,
        local_offset,
    };
    // SAFETY: every batch below is refused, nothing is posted.
    unsafe {
        assert!(matches!(
            t.post_reads(peer, &[op(MIB as u64 - 10, 20, 0)]),
            Err(TransportError::RemoteOutOfRange { .. })
        ));
        assert!(matches!(
            t.post_reads(peer, &[op(0, 20, MIB as u64 - 10)]),
            Err(TransportError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.post_reads(peer, &[op(0, 0, 0)]),
            Err(TransportError::EmptyRead { .. })
        ));
        assert!(matches!(
            t.post_reads(PeerId(77), &[op(0, 1, 0)]),
            Err(TransportError::UnknownPeer(_))
        ));
    }
    assert_eq!(t.stats(), TransportStats::default());
}

#[test]
fn ops_are_cut_into_chunks_with_bounded_reads_in_flight() {
    use distmind_transport::fabric::FabricOptions;
    const BYTES: usize = 8 * MIB;
    let server = mini_server(BYTES);
    let published = server.published.clone();
    let resolver: Resolver = Box::new(move |_: &str| Ok(published.clone()));
    let opts = FabricOptions {
        chunk_bytes: 64 << 10,
        reads_in_flight_max: 3,
    };
    let t = FabricTransport::with_options(DEFAULT_PROVIDER, resolver, opts).unwrap();
    assert_eq!(t.chunk_bytes(), 64 << 10);
    let dst = Arc::new(HostBuffer::new(BYTES, HugePages::No).unwrap());
    let region = t.register(dst.clone()).unwrap();
    let peer = t.connect("mem0:7000").unwrap();
    // Two ops of 4 MiB - 5 bytes (64 chunks each, the last one short), swapped halves.
    let len = (4 * MIB - 5) as u64;
    let ops = [
        ReadOp {
            wr_id: 1,
            remote_offset: 5,
            len,
            local: region,
            local_offset: 4 * MIB as u64,
        },
        ReadOp {
            wr_id: 2,
            remote_offset: 4 * MIB as u64,
            len,
            local: region,
            local_offset: 0,
        },
    ];
    // SAFETY: disjoint local ranges; `dst` is read only after the call.
    unsafe { read_blocking(&t, peer, &ops) }.expect("chunked reads");
    // SAFETY: every read completed.
    let got = unsafe { dst.slice(0..BYTES) };
    for op in &ops {
        let (l, r) = (op.local_offset as usize, op.remote_offset as usize);
        assert!(
            (0..op.len as usize).all(|k| got[l + k] == pattern(r + k)),
            "op {}",
            op.wr_id
        );
    }
    let stats = t.stats();
    assert_eq!(
        (stats.ops_completed, stats.ops_failed),
        (2, 0),
        "one completion per op"
    );
    assert_eq!(stats.bytes_read, 2 * len);
    // An op needing more chunks than a transport keeps in flight is refused whole.
    let huge = ReadOp {
        wr_id: 3,
        remote_offset: 0,
        len: BYTES as u64,
        local: region,
        local_offset: 0,
    };
    let tiny_chunks = FabricOptions {
        chunk_bytes: 1,
        reads_in_flight_max: 1,
    };
    let published = server.published.clone();
    let t1 = FabricTransport::with_options(
        DEFAULT_PROVIDER,
        Box::new(move |_: &str| Ok(published.clone())),
        tiny_chunks,
    )
    .unwrap();
    let r1 = t1.register(dst.clone()).unwrap();
    let p1 = t1.connect("mem0:7000").unwrap();
    // SAFETY: refused before anything is posted.
    let e = unsafe { t1.post_reads(p1, &[ReadOp { local: r1, ..huge }]) }.unwrap_err();
    assert!(
        matches!(e, TransportError::OpTooLarge { wr_id: 3, .. }),
        "{e}"
    );
}

/// A serving side that sleeps in `fi_cq_sread` (as memory servers do) still
/// serves reads, and does not spin while idle.
#[test]
fn a_waiting_serving_side_serves_reads_and_sleeps_when_idle() {
    use std::sync::atomic::AtomicUsize;
    const BYTES: usize = 16 * MIB;
    let info = Info::get(&Hints::new(DEFAULT_PROVIDER)).unwrap();
    let domain = Domain::open(&Fabric::open(&info).unwrap()).unwrap();
    let av = AddressVector::open(&domain).unwrap();
    let cq = CompletionQueue::open_waitable(&domain, CQ_SIZE_DEFAULT).unwrap();
    let ep = Endpoint::open(&domain, &av, &cq).unwrap();
    let mut buf = HostBuffer::new(BYTES, HugePages::No).unwrap();
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = pattern(i);
    }
    let arena = MemoryRegion::register(&domain, Arc::new(buf), Access::RemoteRead, 7).unwrap();
    let published = RemoteArena::serving(&ep, &arena).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let wakeups = Arc::new(AtomicUsize::new(0));
    let progress = {
        let (stop, wakeups, cq) = (stop.clone(), wakeups.clone(), cq.clone());
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                cq.wait(&mut seen, Duration::from_millis(100)).unwrap();
                wakeups.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let t = FabricTransport::new(
        DEFAULT_PROVIDER,
        Box::new(move |_: &str| Ok(published.clone())),
    )
    .unwrap();
    let dst = Arc::new(HostBuffer::new(BYTES, HugePages::No).unwrap());
    let region = t.register(dst.clone()).unwrap();
    let peer = t.connect("mem0:7000").unwrap();
    let op = ReadOp {
        wr_id: 1,
        remote_offset: 0,
        len: BYTES as u64,
        local: region,
        local_offset: 0,
    };
    // SAFETY: `dst` is read only after the call.
    unsafe { read_blocking(&t, peer, &[op]) }.unwrap();
    // SAFETY: the read completed.
    let got = unsafe { dst.slice(0..BYTES) };
    assert!((0..BYTES).all(|i| got[i] == pattern(i)));
    let before = wakeups.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(500));
    let idle = wakeups.load(Ordering::Relaxed) - before;
    // Sleeping 100 ms per wait: about 5; a busy poll would be ~10^5.
    assert!(idle < 100, "{idle} wakeups in 500 ms of idleness");
    stop.store(true, Ordering::Relaxed);
    progress.join().unwrap();
}
