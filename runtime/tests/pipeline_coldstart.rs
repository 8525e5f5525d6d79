//! The three-stage pipeline (network -> host cache -> arena -> compute) over
//! in-memory memory servers holding a generated tiny package, with a
//! test-double executor.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distmind_common::checksum::{checksum, to_hex};
use distmind_common::proto::{GroupLocation, Location, ModelEntry, Slice};
use distmind_models::{Family, GenOptions, Manifest, Package, Scale};
use distmind_runtime::cache::{CacheConfig, HostCache};
use distmind_runtime::device::Residency;
use distmind_runtime::exec::{
    Arena, ExecError, Executor, ExecutorKind, HostTensor, Program, Trace, TraceEvent,
};
use distmind_runtime::pipeline::{
    cache_in, cold_start, load, sequential, GateState, LoadPath, PipelineEvent, PipelineOptions,
    Request, Stages, STAGE_THREADS,
};
use distmind_runtime::FetchOptions;
use distmind_transport::{
    Completion, HostBuffer, HugePages, MemFabric, MemTransport, PeerId, ReadOp, RegionId,
    Transport, TransportError, TransportStats,
};

const PEERS: [&str; 2] = ["ms0", "ms1"];

// ---------------------------------------------------------------------------
// Test double executor.

/// A TEST DOUBLE for pipeline logic only (the real `cpu`/`sim`/`cuda`
/// executors live in `runtime/src/exec`): its arena is a `Vec<u8>` and its
/// program does no math. The program walks the manifest's layers, calls
/// `gate(g)` before the first layer of group g, records GroupReady /
/// LayerStart / LayerEnd, sleeps `layer_delay` per layer, and outputs one
/// i64 per group: the xxh3 of the group's bytes in the arena as it saw them
/// right after the gate, so outputs prove the right bytes were uploaded
/// before compute used them.
struct DoubleExecutor {
    layer_delay: Duration,
    arenas: Mutex<Vec<Arc<VecArena>>>,
}

impl DoubleExecutor {
    fn new(layer_delay: Duration) -> Self {
        DoubleExecutor {
            layer_delay,
            arenas: Mutex::new(Vec::new()),
        }
    }
}

struct VecArena {
    bytes: Mutex<Vec<u8>>,
    uploads: AtomicUsize,
    /// The threads that uploaded, by id and name.
    uploaders: Mutex<Vec<(std::thread::ThreadId, String)>>,
}

impl Arena for VecArena {
    fn len(&self) -> u64 {
        self.bytes.lock().unwrap().len() as u64
    }

    unsafe fn upload_async(
        &self,
        _group: usize,
        offset: u64,
        _stored: distmind_models::ParamDtype,
        bytes: &[u8],
    ) -> Result<(), ExecError> {
        let mut b = self.bytes.lock().unwrap();
        let end = offset as usize + bytes.len();
        if end > b.len() {
            return Err(ExecError::UploadOutOfRange {
                offset,
                len: bytes.len() as u64,
                arena: b.len() as u64,
            });
        }
        b[offset as usize..end].copy_from_slice(bytes);
        self.uploads.fetch_add(1, Ordering::Relaxed);
        let me = std::thread::current();
        self.uploaders
            .lock()
            .unwrap()
            .push((me.id(), me.name().unwrap_or("").to_string()));
        Ok(())
    }
}

impl Executor for DoubleExecutor {
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Sim
    }

    fn describe(&self) -> String {
        "test double".into()
    }

    fn for_device(&self, _ordinal: u32) -> Result<Arc<dyn Executor>, ExecError> {
        Ok(Arc::new(DoubleExecutor::new(self.layer_delay)))
    }

    fn alloc_arena(&self, bytes: u64) -> Result<Arc<dyn Arena>, ExecError> {
        let a = Arc::new(VecArena {
            bytes: Mutex::new(vec![0; bytes as usize]),
            uploads: AtomicUsize::new(0),
            uploaders: Mutex::new(Vec::new()),
        });
        self.arenas.lock().unwrap().push(a.clone());
        Ok(a)
    }

    fn program(
        &self,
        manifest: &Manifest,
        arena: Arc<dyn Arena>,
    ) -> Result<Box<dyn Program>, ExecError> {
        let want = Arc::as_ptr(&arena) as *const u8;
        let arena = self
            .arenas
            .lock()
            .unwrap()
            .iter()
            .find(|a| Arc::as_ptr(a) as *const u8 == want)
            .cloned()
            .expect("an arena of this executor");
        Ok(Box::new(DoubleProgram {
            manifest: manifest.clone(),
            arena,
            layer_delay: self.layer_delay,
        }))
    }
}

struct DoubleProgram {
    manifest: Manifest,
    arena: Arc<VecArena>,
    layer_delay: Duration,
}

impl Program for DoubleProgram {
    fn run(
        &mut self,
        _inputs: &[HostTensor],
        gate: &mut dyn FnMut(usize) -> Result<(), ExecError>,
        trace: &mut Trace,
    ) -> Result<Vec<HostTensor>, ExecError> {
        let start = Instant::now();
        let m = &self.manifest;
        let mut sums = vec![0i64; m.groups.len()];
        for layer in 0..m.layers.len() {
            if let Some(g) = m.groups.iter().position(|g| g.first_layer == layer) {
                gate(g)?;
                trace.push((start.elapsed(), TraceEvent::GroupReady { group: g }));
                let grp = &m.groups[g];
                let b = self.arena.bytes.lock().unwrap();
                sums[g] =
                    checksum(&b[grp.offset as usize..(grp.offset + grp.bytes) as usize]) as i64;
            }
            trace.push((start.elapsed(), TraceEvent::LayerStart { layer }));
            std::thread::sleep(self.layer_delay);
            trace.push((start.elapsed(), TraceEvent::LayerEnd { layer }));
        }
        Ok(vec![HostTensor::i64(vec![sums.len()], sums)])
    }
}

// ---------------------------------------------------------------------------
// A transport that is slow per read and can lose every peer mid-fetch.

struct SlowTransport {
    inner: MemTransport,
    fabric: MemFabric,
    per_read: Duration,
    reads: AtomicUsize,
    /// After this many posted reads, every peer fails.
    fail_after: AtomicUsize,
}

impl SlowTransport {
    fn new(fabric: &MemFabric, per_read: Duration) -> Self {
        SlowTransport {
            inner: MemTransport::new(fabric.clone()),
            fabric: fabric.clone(),
            per_read,
            reads: AtomicUsize::new(0),
            fail_after: AtomicUsize::new(usize::MAX),
        }
    }
}

impl Transport for SlowTransport {
    fn name(&self) -> &'static str {
        "slow-mem"
    }
    fn register(&self, buf: Arc<HostBuffer>) -> Result<RegionId, TransportError> {
        self.inner.register(buf)
    }
    fn deregister(&self, region: RegionId) -> Result<(), TransportError> {
        self.inner.deregister(region)
    }
    fn connect(&self, peer_addr: &str) -> Result<PeerId, TransportError> {
        self.inner.connect(peer_addr)
    }
    fn disconnect(&self, peer: PeerId) {
        self.inner.disconnect(peer)
    }
    unsafe fn post_reads(&self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError> {
        for _ in ops {
            let n = self.reads.fetch_add(1, Ordering::Relaxed);
            if n == self.fail_after.load(Ordering::Relaxed) {
                for p in PEERS {
                    self.fabric.fail_peer(p);
                }
            }
        }
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.inner.post_reads(peer, ops) }
    }
    /// One link that serves one read at a time: each completion comes
    /// `per_read` after the one before (posting itself takes no time, as
    /// on a real transport).
    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, TransportError> {
        let n = self.inner.poll(out, max.min(1), timeout)?;
        if n > 0 {
            std::thread::sleep(self.per_read);
        }
        Ok(n)
    }
    fn stats(&self) -> TransportStats {
        self.inner.stats()
    }
}

// ---------------------------------------------------------------------------
// The world: a tiny package on two in-memory memory servers.

struct World {
    _dir: tempfile::TempDir,
    fabric: MemFabric,
    manifest: Manifest,
    entry: ModelEntry,
    /// xxh3 of each packed group, as the package has it.
    group_sums: Vec<i64>,
}

fn world(group_bytes: u64) -> World {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = GenOptions::new(Family::Resnet152, dir.path());
    opts.scale = Scale::Tiny;
    opts.group_bytes = group_bytes;
    let pkg_dir = distmind_models::generate(&opts).unwrap().remove(0);
    let (manifest, packed) = open(&pkg_dir);
    let model: Vec<u8> = packed.concat();
    let fabric = MemFabric::new();
    for p in PEERS {
        let mut b = HostBuffer::new(model.len(), HugePages::No).unwrap();
        b.as_mut_slice().copy_from_slice(&model);
        fabric.add_peer(p, Arc::new(b));
    }
    let groups = manifest
        .groups
        .iter()
        .map(|g| {
            let (start, len) = (g.offset, g.bytes);
            // Two slices per group where it is big enough, cut at 512 bytes.
            let cut = if len >= 1024 {
                (len / 2) / 512 * 512
            } else {
                len
            };
            let pieces: Vec<(u64, u64)> = if cut < len {
                vec![(0, cut), (cut, len - cut)]
            } else {
                vec![(0, len)]
            };
            GroupLocation {
                index: g.index as u32,
                bytes: len,
                checksum: g.checksum.clone(),
                slices: pieces
                    .into_iter()
                    .map(|(off, n)| {
                        let at = (start + off) as usize;
                        Slice {
                            group_offset: off,
                            len: n,
                            checksum: to_hex(checksum(&model[at..at + n as usize])),
                            replicas: PEERS
                                .iter()
                                .enumerate()
                                .map(|(i, a)| Location {
                                    memserver: i as u32,
                                    addr: a.to_string(),
                                    offset: start + off,
                                })
                                .collect(),
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    let entry = ModelEntry {
        name: manifest.name.clone(),
        family: "resnet152".into(),
        total_bytes: model.len() as u64,
        strategy: "hybrid".into(),
        replication: 2,
        version: 0,
        groups,
        manifest: serde_json::to_value(&manifest).unwrap(),
    };
    let group_sums = packed.iter().map(|g| checksum(g) as i64).collect();
    World {
        _dir: dir,
        fabric,
        manifest,
        entry,
        group_sums,
    }
}

fn open(dir: &Path) -> (Manifest, Vec<Vec<u8>>) {
    let pkg = Package::open(dir).unwrap();
    let packed = pkg.packed().unwrap();
    (pkg.manifest, packed)
}

/// One device worker: host cache, executor, residency.
struct Worker {
    transport: Arc<SlowTransport>,
    cache: HostCache,
    executor: DoubleExecutor,
    residency: Residency,
}

fn worker(w: &World, per_read: Duration, layer_delay: Duration) -> Worker {
    let transport = Arc::new(SlowTransport::new(&w.fabric, per_read));
    let cache = HostCache::new(CacheConfig::new(4 << 20, 64 << 10), transport.clone()).unwrap();
    Worker {
        transport,
        cache,
        executor: DoubleExecutor::new(layer_delay),
        residency: Residency::new(64 << 20, 4),
    }
}

impl Worker {
    fn stages(&self) -> Stages<'_> {
        Stages {
            cache: &self.cache,
            executor: &self.executor,
            residency: &self.residency,
        }
    }
}

fn request(w: &World) -> Request<'_> {
    Request {
        entry: &w.entry,
        manifest: &w.manifest,
        inputs: &[],
        arrived: Instant::now(),
    }
}

/// One read in flight: groups arrive strictly one after the other.
fn one_read_at_a_time() -> PipelineOptions {
    PipelineOptions {
        fetch: FetchOptions {
            bytes_in_flight_max: 1,
            ..FetchOptions::default()
        },
        gate_timeout: Duration::from_secs(30),
        trace: true,
    }
}

fn sums(out: &[HostTensor]) -> Vec<i64> {
    match &out[0].data {
        distmind_runtime::exec::TensorData::I64(v) => v.clone(),
        other => panic!("unexpected output {other:?}"),
    }
}

/// Small groups so that the tiny model has several.
const GROUP_BYTES: u64 = 16 << 10;

// ---------------------------------------------------------------------------

#[test]
fn pipeline_compute_of_each_group_starts_before_the_next_group_arrives() {
    let w = world(GROUP_BYTES);
    let n = w.manifest.groups.len();
    assert!(n >= 4, "the tiny model should have several groups, has {n}");
    let wk = worker(&w, Duration::from_millis(25), Duration::ZERO);
    let (out, timing, trace) =
        cold_start(&wk.stages(), &request(&w), &one_read_at_a_time()).unwrap();
    assert_eq!(
        sums(&out),
        w.group_sums,
        "compute saw every group's real bytes"
    );
    assert_eq!(timing.path, LoadPath::Cold);
    assert_eq!(timing.fetched_bytes, w.entry.total_bytes);
    assert!(timing.fetch > Duration::ZERO && timing.h2d > Duration::ZERO);
    assert!(timing.total >= timing.compute && timing.total >= timing.fetch);
    for g in 0..n {
        let host = trace.host_ready(g).unwrap();
        let up = trace.uploaded(g).unwrap();
        let gate = trace.gate_opened(g).unwrap();
        assert!(
            host <= up && up <= gate,
            "group {g}: host {host:?} upload {up:?} gate {gate:?}"
        );
        if g + 1 < n {
            let next = trace.host_ready(g + 1).unwrap();
            assert!(
                gate < next,
                "compute of group {g} ({gate:?}) should start before group {} is in host memory ({next:?})",
                g + 1
            );
            let first = w.manifest.groups[g].first_layer;
            assert!(trace.layer_start(first).unwrap() < next);
        }
    }
    // Uploads in group order, once each.
    let uploads: Vec<usize> = trace
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            PipelineEvent::Uploaded { group } => Some(*group),
            _ => None,
        })
        .collect();
    assert_eq!(uploads, (0..n).collect::<Vec<_>>());
    // Compute began before the fetch ended: the stages overlapped.
    assert!(trace.time_of(PipelineEvent::ComputeStart).unwrap() < trace.host_ready(n - 1).unwrap());
}

#[test]
fn pipeline_without_a_trace_computes_and_times_the_same_and_merges_no_events() {
    let w = world(GROUP_BYTES);
    let wk = worker(&w, Duration::from_millis(2), Duration::ZERO);
    let opts = PipelineOptions {
        trace: false,
        ..one_read_at_a_time()
    };
    let (out, timing, trace) = cold_start(&wk.stages(), &request(&w), &opts).unwrap();
    assert_eq!(sums(&out), w.group_sums);
    assert!(trace.events.is_empty(), "{:?}", trace.events);
    // The breakdown does not come from the trace: it is all there.
    assert_eq!(timing.path, LoadPath::Cold);
    assert_eq!(timing.fetched_bytes, w.entry.total_bytes);
    assert!(timing.fetch > Duration::ZERO && timing.h2d > Duration::ZERO);
    assert!(timing.compute > Duration::ZERO && timing.total >= timing.compute);
    // Resident now: the next untraced run computes the same.
    let (again, timing, trace) = cold_start(&wk.stages(), &request(&w), &opts).unwrap();
    assert_eq!(again, out);
    assert_eq!(timing.path, LoadPath::DeviceResident);
    assert!(trace.events.is_empty());
}

#[test]
fn pipeline_sequential_matches_pipelined_outputs_without_overlap() {
    let w = world(GROUP_BYTES);
    let n = w.manifest.groups.len();
    let a = worker(&w, Duration::from_millis(2), Duration::from_millis(1));
    let b = worker(&w, Duration::from_millis(2), Duration::from_millis(1));
    let opts = one_read_at_a_time();
    let (pipelined, _, _) = cold_start(&a.stages(), &request(&w), &opts).unwrap();
    let (seq, timing, trace) = sequential(&b.stages(), &request(&w), &opts).unwrap();
    assert_eq!(pipelined, seq);
    assert_eq!(sums(&seq), w.group_sums);
    assert_eq!(timing.path, LoadPath::Cold);
    let last_host = trace.host_ready(n - 1).unwrap();
    let first_upload = trace
        .time_of(PipelineEvent::UploadStart { group: 0 })
        .unwrap();
    let last_upload = trace.uploaded(n - 1).unwrap();
    let compute = trace.time_of(PipelineEvent::ComputeStart).unwrap();
    assert!(last_host <= first_upload, "fetch everything, then upload");
    assert!(last_upload <= compute, "upload everything, then run");
}

#[test]
fn pipeline_warm_paths_skip_stages() {
    let w = world(GROUP_BYTES);
    let n = w.manifest.groups.len();
    let wk = worker(&w, Duration::ZERO, Duration::ZERO);
    let opts = PipelineOptions::default();
    let (cold, t, _) = cold_start(&wk.stages(), &request(&w), &opts).unwrap();
    assert_eq!(t.path, LoadPath::Cold);
    let bytes = wk.transport.stats().bytes_read;
    assert_eq!(bytes, w.entry.total_bytes);

    // Resident on the device: no fetch, no upload.
    let (out, t, trace) = cold_start(&wk.stages(), &request(&w), &opts).unwrap();
    assert_eq!(out, cold);
    assert_eq!(t.path, LoadPath::DeviceResident);
    assert_eq!(
        (t.fetch, t.h2d, t.fetched_bytes),
        (Duration::ZERO, Duration::ZERO, 0)
    );
    assert_eq!(
        trace.count(|e| matches!(e, PipelineEvent::HostReady { .. })),
        0
    );
    assert_eq!(
        trace.count(|e| matches!(e, PipelineEvent::Uploaded { .. })),
        0
    );
    assert_eq!(
        trace.count(|e| matches!(e, PipelineEvent::GateOpened { .. })),
        n
    );
    assert_eq!(wk.transport.stats().bytes_read, bytes);

    // Evicted from the device, still in the host cache: upload, no fetch.
    assert_eq!(wk.residency.evict(&w.entry.name), Some(true));
    let (out, t, trace) = cold_start(&wk.stages(), &request(&w), &opts).unwrap();
    assert_eq!(out, cold);
    assert_eq!(t.path, LoadPath::HostCached);
    assert_eq!((t.fetch, t.fetched_bytes), (Duration::ZERO, 0));
    assert_eq!(
        trace.count(|e| matches!(e, PipelineEvent::HostReady { .. })),
        0
    );
    assert_eq!(
        trace.count(|e| matches!(e, PipelineEvent::Uploaded { .. })),
        n
    );
    // The copies' completion closes the upload stage and its time.
    let complete = trace.time_of(PipelineEvent::UploadsComplete).unwrap();
    let last_uploaded = trace
        .time_of(PipelineEvent::Uploaded { group: n - 1 })
        .unwrap();
    let first_start = trace
        .time_of(PipelineEvent::UploadStart { group: 0 })
        .unwrap();
    assert!(complete >= last_uploaded);
    assert_eq!(t.h2d, complete - first_start);
    assert_eq!(wk.transport.stats().bytes_read, bytes);

    // Gone from both: cold again.
    wk.residency.evict(&w.entry.name);
    assert_eq!(wk.cache.remove(&w.entry.name), Some(true));
    let (out, t, _) = sequential(&wk.stages(), &request(&w), &opts).unwrap();
    assert_eq!(out, cold);
    assert_eq!(t.path, LoadPath::Cold);
    assert_eq!(wk.transport.stats().bytes_read, 2 * bytes);
    let s = wk.cache.stats();
    assert_eq!((s.hits, s.misses, s.models), (1, 2, 1));
}

#[test]
fn pipeline_failed_fetch_fails_the_request_without_hanging() {
    let w = world(GROUP_BYTES);
    let wk = worker(&w, Duration::ZERO, Duration::ZERO);
    for p in PEERS {
        w.fabric.fail_peer(p);
    }
    let started = Instant::now();
    let e = cold_start(&wk.stages(), &request(&w), &one_read_at_a_time())
        .unwrap_err()
        .to_string();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "no hang: {:?}",
        started.elapsed()
    );
    assert!(
        e.contains(&w.entry.name) && e.contains("every replica failed") && e.contains("group 0"),
        "{e}"
    );
    assert!(!wk.residency.contains(&w.entry.name) && !wk.cache.contains(&w.entry.name));
    assert_eq!(wk.cache.stats().used_bytes, 0);
    assert_eq!(wk.residency.stats().used_bytes, 0);
    // The failure is not sticky.
    for p in PEERS {
        w.fabric.heal_peer(p);
    }
    let (out, t, _) = cold_start(&wk.stages(), &request(&w), &one_read_at_a_time()).unwrap();
    assert_eq!(sums(&out), w.group_sums);
    assert_eq!(t.path, LoadPath::Cold);
}

#[test]
fn pipeline_peers_lost_mid_fetch_fail_compute_at_the_next_gate() {
    let w = world(GROUP_BYTES);
    let n = w.manifest.groups.len();
    let wk = worker(&w, Duration::from_millis(5), Duration::ZERO);
    // Group 0 (two slices) arrives, then every memory server dies.
    wk.transport.fail_after.store(2, Ordering::Relaxed);
    let started = Instant::now();
    let e = cold_start(&wk.stages(), &request(&w), &one_read_at_a_time())
        .unwrap_err()
        .to_string();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(
        e.contains("every replica failed") && e.contains("group 1"),
        "{e}"
    );
    assert!(n > 1);
    assert!(!wk.residency.contains(&w.entry.name) && !wk.cache.contains(&w.entry.name));
}

#[test]
fn pipeline_concurrent_requests_share_one_load() {
    let w = world(GROUP_BYTES);
    let wk = worker(&w, Duration::from_millis(3), Duration::ZERO);
    let opts = one_read_at_a_time();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|i| {
                let (wk, w, opts) = (&wk, &w, &opts);
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(10 * i));
                    cold_start(&wk.stages(), &request(w), opts).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut paths: Vec<LoadPath> = results.iter().map(|r| r.1.path).collect();
    paths.sort_by_key(|p| *p as u8);
    assert_eq!(paths, vec![LoadPath::Cold, LoadPath::DeviceResident]);
    for r in &results {
        assert_eq!(sums(&r.0), w.group_sums);
    }
    assert_eq!(
        wk.transport.stats().bytes_read,
        w.entry.total_bytes,
        "fetched once"
    );
}

#[test]
fn pipeline_refuses_models_that_do_not_fit_or_disagree() {
    let w = world(GROUP_BYTES);
    let transport = Arc::new(SlowTransport::new(&w.fabric, Duration::ZERO));
    let small = HostCache::new(CacheConfig::new(64 << 10, 64 << 10), transport).unwrap();
    let executor = DoubleExecutor::new(Duration::ZERO);
    let residency = Residency::new(64 << 20, 4);
    let stages = Stages {
        cache: &small,
        executor: &executor,
        residency: &residency,
    };
    let e = cold_start(&stages, &request(&w), &PipelineOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("larger than the whole host cache (65536 bytes)"),
        "{e}"
    );
    assert!(!residency.contains(&w.entry.name), "no arena left behind");

    let tiny_device = Residency::new(1024, 4);
    let wk = worker(&w, Duration::ZERO, Duration::ZERO);
    let stages = Stages {
        residency: &tiny_device,
        ..wk.stages()
    };
    let e = cold_start(&stages, &request(&w), &PipelineOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("parameter budget of 1024 bytes"), "{e}");

    let mut entry = w.entry.clone();
    entry.groups.pop();
    let req = Request {
        entry: &entry,
        ..request(&w)
    };
    let e = cold_start(&wk.stages(), &req, &PipelineOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("disagree"), "{e}");
}

#[test]
fn pipeline_load_makes_a_model_resident_without_running_it() {
    let w = world(GROUP_BYTES);
    let wk = worker(&w, Duration::ZERO, Duration::from_millis(50));
    let opts = one_read_at_a_time();
    let t = load(&wk.stages(), &request(&w), &opts).unwrap();
    assert_eq!(t.path, LoadPath::Cold);
    assert_eq!(t.fetched_bytes, w.entry.total_bytes);
    assert!(
        wk.residency.is_ready(&w.manifest.name),
        "every group uploaded"
    );
    // The program never ran: 50 ms per layer would show.
    assert!(t.compute < Duration::from_millis(50), "{t:?}");
    assert_eq!(
        load(&wk.stages(), &request(&w), &opts).unwrap().path,
        LoadPath::DeviceResident
    );
    // A request after the prefetch computes on the uploaded bytes.
    let (out, timing, _) = cold_start(&wk.stages(), &request(&w), &opts).unwrap();
    assert_eq!(timing.path, LoadPath::DeviceResident);
    assert_eq!(sums(&out), w.group_sums);
    // Evicted from the device but still in host memory: only an upload.
    wk.residency.evict(&w.manifest.name);
    let t = load(&wk.stages(), &request(&w), &opts).unwrap();
    assert_eq!((t.path, t.fetched_bytes), (LoadPath::HostCached, 0));
}

#[test]
fn pipeline_cache_in_fetches_once_into_host_memory() {
    let w = world(GROUP_BYTES);
    let wk = worker(&w, Duration::ZERO, Duration::ZERO);
    let opts = one_read_at_a_time();
    let (m, path, report) = cache_in(&wk.cache, &w.entry, &w.manifest, &opts).unwrap();
    assert_eq!(path, LoadPath::Cold);
    assert_eq!(report.unwrap().bytes, w.entry.total_bytes);
    assert!(m.is_complete());
    for g in 0..m.groups() {
        assert_eq!(checksum(m.group(g).unwrap()) as i64, w.group_sums[g]);
    }
    let (_, path, report) = cache_in(&wk.cache, &w.entry, &w.manifest, &opts).unwrap();
    assert_eq!((path, report.is_none()), (LoadPath::HostCached, true));
    assert!(
        !wk.residency.contains(&w.manifest.name),
        "nothing on the device"
    );
    assert_eq!(wk.cache.stats().fetched_bytes, w.entry.total_bytes);
}

#[test]
fn pipeline_stages_run_on_the_devices_long_lived_threads() {
    let w = world(GROUP_BYTES);
    let wk = worker(&w, Duration::ZERO, Duration::ZERO);
    let opts = PipelineOptions::default();
    let runs = 5;
    for _ in 0..runs {
        wk.cache.remove(&w.entry.name);
        wk.residency.evict(&w.entry.name);
        let (out, t, _) = cold_start(&wk.stages(), &request(&w), &opts).unwrap();
        assert_eq!(t.path, LoadPath::Cold);
        assert_eq!(sums(&out), w.group_sums);
    }
    let arenas = wk.executor.arenas.lock().unwrap();
    assert_eq!(arenas.len(), runs, "every run loaded the model again");
    let mut threads = std::collections::HashSet::new();
    for a in arenas.iter() {
        for (id, name) in a.uploaders.lock().unwrap().iter() {
            assert!(name.starts_with("device stage "), "uploaded on {name:?}");
            threads.insert(*id);
        }
    }
    // A thread per request would have shown `runs` different uploaders.
    assert!(
        !threads.is_empty() && threads.len() <= STAGE_THREADS,
        "{} upload threads over {runs} cold starts",
        threads.len()
    );
}

/// A cache that holds exactly one copy of `w`'s model.
fn one_model_cache(w: &World, transport: Arc<SlowTransport>) -> HostCache {
    let block = 64 << 10;
    let blocks = w.entry.total_bytes.div_ceil(block);
    HostCache::new(CacheConfig::new(blocks * block, block), transport).unwrap()
}

/// Evicts `w`'s model from the host cache and the device while `load`
/// uploads it (after group 0, before the last group): both evictions wait
/// for the upload stage (its pins), the model's blocks cannot be reserved
/// by another model until the load returned, and then they can.
fn evict_during_upload(w: &World, executor: &dyn Executor, per_read: Duration) {
    let name = w.entry.name.as_str();
    let sizes: Vec<u64> = w.entry.groups.iter().map(|g| g.bytes).collect();
    let transport = Arc::new(SlowTransport::new(&w.fabric, per_read));
    let cache = one_model_cache(w, transport);
    let residency = Residency::new(64 << 20, 4);
    let stages = Stages {
        cache: &cache,
        executor,
        residency: &residency,
    };
    let opts = one_read_at_a_time();
    std::thread::scope(|s| {
        let loading = s.spawn(|| load(&stages, &request(w), &opts));
        // Wait until group 0 is uploaded and the last one is not.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mid = residency.get(name).is_some_and(|r| {
                r.gates().state(0) == Some(GateState::Ready) && !r.gates().all_open()
            });
            if mid {
                break;
            }
            if loading.is_finished() || Instant::now() > deadline {
                let r = loading.join().unwrap().map(|t| t.path);
                panic!("never saw the upload in progress: the load returned {r:?}");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(
            cache.remove(name),
            Some(false),
            "the upload stage's pin keeps the blocks"
        );
        assert_eq!(
            residency.evict(name),
            Some(false),
            "the load pins the arena"
        );
        let e = cache.reserve("other", &sizes).err().map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|e| e.contains("other")),
            "the blocks under the upload were handed out: {e:?}"
        );
        match loading.join().unwrap() {
            Ok(t) => assert_eq!(t.path, LoadPath::Cold),
            Err(e) => assert!(e.to_string().contains(name), "{e}"),
        }
    });
    assert_eq!(cache.stats().used_bytes, 0, "freed with the last pin");
    assert_eq!(residency.stats().used_bytes, 0);
    assert!(!cache.contains(name) && !residency.contains(name));
    cache
        .reserve("other", &sizes)
        .expect("the blocks are free again");
}

#[test]
fn pipeline_evict_during_an_upload_waits_for_it_on_the_cpu_executor() {
    let w = world(GROUP_BYTES);
    let exec = distmind_runtime::exec::cpu::CpuExecutor::new();
    // The cpu upload converts as fast as it can: slow reads, one at a time,
    // keep the upload stage between groups, holding its pin.
    evict_during_upload(&w, &exec, Duration::from_millis(10));
}

#[test]
fn pipeline_evict_during_an_upload_waits_for_it_on_the_sim_executor() {
    let w = world(GROUP_BYTES);
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(distmind_runtime::profile::SHIPPED_ESTIMATED_PATH);
    let mut profile = distmind_runtime::profile::Profile::load(path).unwrap();
    // The whole model takes about 300 ms over the simulated PCIe link.
    profile.peaks.h2d_bytes_per_s = w.entry.total_bytes as f64 / 0.3;
    let exec = distmind_runtime::exec::sim::SimExecutor::new(profile);
    evict_during_upload(&w, &exec, Duration::ZERO);
}
