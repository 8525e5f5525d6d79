//! The three-stage cold start of one request for a model:
//!
//! 1. **network -> host cache** (a stage thread): [`HostCache::fill`] reads
//!    every slice, group 0 first; group g becomes visible in the cache (its
//!    per-group flag set, waiters woken) as soon as all its slices verified.
//! 2. **host -> arena** (a stage thread, the H2D copy stream on CUDA): in
//!    group order, waits for group g in host memory, calls
//!    `arena.upload_async(g, device_offset, param_dtype, group_bytes)` with
//!    the group's stored bytes straight from the cache blocks (a
//!    half-precision group is widened to f32 on the way: the arena holds
//!    `manifest.device_bytes()`), then opens gate g.
//!    It holds the model's host-cache pin until every copy it started
//!    completed ([`Arena::wait_uploaded`]), so no eviction or reservation
//!    reuses those blocks while a DMA engine still reads them: a prefetch
//!    ([`load`]) returns only then.
//! 3. **compute** (the calling thread, the device's worker): `program.run(inputs, gate, trace)`
//!    where `gate(g)` waits on [`GroupGates`] for stage 2 of group g, with a
//!    timeout, and fails at once with the reason when an earlier stage failed.
//!
//! Stages 1 and 2 run on the device's [`StageThreads`], two long-lived
//! threads started with its [`Residency`]: no thread is spawned per request.
//!
//! Warm paths use the same code: a model found in the host cache skips
//! stage 1 (if another request is still filling it, stage 2 waits on that
//! fill's group flags); a model resident on the device skips stages 1 and 2
//! (its gates are open, or being opened by the request that loads it).
//!
//! [`cold_start`] overlaps the stages; [`sequential`] is the load-then-run
//! baseline over the same code: fetch everything, then upload everything,
//! then run. [`load`] runs stages 1 and 2 only (a prefetch to a device: the
//! model ends up resident, nothing is computed), and [`cache_in`] stage 1
//! only (a prefetch to the host cache, or the bytes a training job starts
//! from).
//!
//! Every call returns the outputs with a [`Timing`] breakdown and a
//! [`MergedTrace`]: host arrival, upload and gate events per group and the
//! program's own trace, on one clock starting when the pipeline started
//! (empty when [`PipelineOptions::trace`] is off).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam::channel;
use distmind_common::proto::ModelEntry;
use distmind_models::Manifest;

use crate::cache::{CacheError, CachedModel, HostCache, Lookup};
use crate::device::{DeviceError, Residency, Resident};
use crate::exec::{Arena, ExecError, Executor, HostTensor, Trace, TraceEvent};
use crate::fetch::{FetchOptions, FetchReport};

/// How long a stage waits for the previous stage's group by default; a
/// failed stage never makes the next one wait this long (failures are
/// propagated at once).
pub const GATE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(120);

/// State of one group's gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateState {
    Pending,
    Ready,
    Failed(String),
}

/// Per-group "uploaded" flags that compute waits on.
pub struct GroupGates {
    state: Mutex<Vec<GateState>>,
    cv: Condvar,
}

impl GroupGates {
    /// `groups` gates, all pending.
    pub fn new(groups: usize) -> Self {
        GroupGates {
            state: Mutex::new(vec![GateState::Pending; groups]),
            cv: Condvar::new(),
        }
    }

    /// `groups` gates, all open (a model already on the device).
    pub fn opened(groups: usize) -> Self {
        GroupGates {
            state: Mutex::new(vec![GateState::Ready; groups]),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<GateState>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    pub fn state(&self, group: usize) -> Option<GateState> {
        self.lock().get(group).cloned()
    }

    pub fn all_open(&self) -> bool {
        self.lock().iter().all(|s| *s == GateState::Ready)
    }

    /// Group `group` is usable by compute.
    pub fn open(&self, group: usize) {
        if let Some(s) = self.lock().get_mut(group) {
            *s = GateState::Ready;
        }
        self.cv.notify_all();
    }

    /// Fails every gate not yet open with `why`; waiters return at once.
    pub fn fail_pending(&self, why: &str) {
        for s in self.lock().iter_mut() {
            if *s == GateState::Pending {
                *s = GateState::Failed(why.to_string());
            }
        }
        self.cv.notify_all();
    }

    /// Blocks until `group` is open; [`ExecError::Gate`] naming the group
    /// and why when it failed or `timeout` passed.
    pub fn wait(&self, group: usize, timeout: Duration) -> Result<(), ExecError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            match s.get(group) {
                None => {
                    return Err(ExecError::Gate {
                        group,
                        why: format!("the model has {} groups", s.len()),
                    })
                }
                Some(GateState::Ready) => return Ok(()),
                Some(GateState::Failed(why)) => {
                    return Err(ExecError::Gate {
                        group,
                        why: why.clone(),
                    })
                }
                Some(GateState::Pending) => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ExecError::Gate {
                    group,
                    why: format!("not uploaded after {timeout:?}"),
                });
            }
            s = self
                .cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Threads per device that run the fetch-wait and upload stages of its
/// requests; compute runs on the caller (the device's worker thread).
pub const STAGE_THREADS: usize = 2;

/// One device's long-lived stage threads, started with the device (its
/// [`Residency`]): they run stage 1 (waiting on [`HostCache::fill`]) and
/// stage 2 (the uploads) of every request of the device, so no thread is
/// spawned per request. Work is handed over in FIFO order, so a request's
/// fetch always starts before its upload (which waits for the fetch's
/// groups) and before the stages of any later request; it may borrow from
/// the request: `StageThreads::scope` returns only once everything handed
/// over in it finished.
pub struct StageThreads {
    pool: rayon::ThreadPool,
    /// What every one of its threads' names starts with.
    thread_prefix: String,
}

impl std::fmt::Debug for StageThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageThreads")
            .field("threads", &self.pool.current_num_threads())
            .finish()
    }
}

impl StageThreads {
    /// [`STAGE_THREADS`] threads named `"{name} stage {i}"`, at nice value
    /// `nice` (0: the process's own; see [`distmind_transport::priority`]).
    ///
    /// # Panics
    /// When the OS refuses to start a thread (as `std::thread::spawn`).
    pub fn new(name: &str, nice: i32) -> Self {
        let thread_prefix = format!("{name} stage");
        let prefix = thread_prefix.clone();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(STAGE_THREADS)
            .thread_name(move |i| format!("{prefix} {i}"))
            .start_handler(move |_| distmind_transport::priority::lower_current_thread(nice))
            .build()
            .unwrap_or_else(|e| panic!("starting the stage threads of {name}: {e}"));
        StageThreads {
            pool,
            thread_prefix,
        }
    }

    /// What the names of these threads start with (`"{name} stage"`), as
    /// `ps` and [`distmind_transport::priority::threads_cpu_time`] see them
    /// (names are cut at 15 bytes).
    pub fn thread_prefix(&self) -> &str {
        let max = 15.min(self.thread_prefix.len());
        let cut = (0..=max)
            .rev()
            .find(|&i| self.thread_prefix.is_char_boundary(i))
            .unwrap_or(0);
        &self.thread_prefix[..cut]
    }

    /// Runs `op` on the calling thread; what it hands over with
    /// [`StageScope::run`] runs on the stage threads, and this returns once
    /// all of it finished.
    fn scope<'s, R>(&self, op: impl FnOnce(&StageScope<'_, 's>) -> R) -> R {
        self.pool
            .in_place_scope_fifo(|scope| op(&StageScope { scope }))
    }
}

/// Hands work to a device's stage threads, see [`StageThreads::scope`].
struct StageScope<'a, 's> {
    scope: &'a rayon::ScopeFifo<'s>,
}

impl<'s> StageScope<'_, 's> {
    /// Runs `f` on a stage thread; its result, or its panic as
    /// [`PipelineError::Panicked`], comes back through the handle.
    fn run<T: Send + 's>(
        &self,
        model: &str,
        stage: &'static str,
        f: impl FnOnce() -> Result<T, PipelineError> + Send + 's,
    ) -> StageDone<T> {
        let (tx, rx) = channel::bounded(1);
        let panicked = PipelineError::Panicked {
            model: model.to_string(),
            stage,
        };
        self.scope.spawn_fifo(move |_| {
            let r =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(Err(panicked));
            // The receiver lives until the scope ends; one send, never blocks.
            let _ = tx.send(r);
        });
        StageDone {
            rx,
            model: model.to_string(),
            stage,
        }
    }
}

/// The result of work handed to a stage thread.
struct StageDone<T> {
    rx: channel::Receiver<Result<T, PipelineError>>,
    model: String,
    stage: &'static str,
}

impl<T> StageDone<T> {
    /// Blocks until the work finished.
    fn wait(self) -> Result<T, PipelineError> {
        self.rx.recv().unwrap_or(Err(PipelineError::Panicked {
            model: self.model,
            stage: self.stage,
        }))
    }
}

/// Which stages a request went through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadPath {
    /// Fetched from the memory servers, uploaded, run.
    #[default]
    Cold,
    /// Found in the host cache (complete, or being filled by another
    /// request): uploaded, run.
    HostCached,
    /// Resident on the device: run.
    DeviceResident,
}

/// The timing breakdown returned with every reply. In a pipelined run the
/// stage spans overlap: they do not add up to `total`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timing {
    pub path: LoadPath,
    /// Arrival of the request to the start of the pipeline.
    pub queue: Duration,
    /// First read posted to the last group verified in host memory (the
    /// fetch's own clock); for a model another request was filling, the wait
    /// for its last group; 0 when the model was in host memory already.
    pub fetch: Duration,
    /// First upload started to the last copy completed on the device
    /// (asynchronous copies run past their enqueueing); 0 when resident.
    pub h2d: Duration,
    /// `Program::run`, gate waits included.
    pub compute: Duration,
    /// Arrival to outputs.
    pub total: Duration,
    /// Bytes this request read from memory servers.
    pub fetched_bytes: u64,
    /// Reads retried on a replica.
    pub fetch_retries: u32,
    /// Outputs are not computed (`sim` executor).
    pub simulated: bool,
}

/// One event of a request's pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipelineEvent {
    /// Stage 1 done for a group: verified in the host cache.
    HostReady {
        group: usize,
    },
    /// Stage 2 began copying a group.
    UploadStart {
        group: usize,
    },
    /// Stage 2 done for a group: its gate is open (its copy is enqueued;
    /// on a GPU it may still be running).
    Uploaded {
        group: usize,
    },
    /// Every copy stage 2 started has completed: the device read the last
    /// host byte ([`Arena::wait_uploaded`] returned for every group).
    UploadsComplete,
    /// Compute's `gate(group)` returned (timed by the pipeline itself).
    GateOpened {
        group: usize,
    },
    ComputeStart,
    ComputeEnd,
    /// The program's own trace, shifted onto the pipeline's clock (its
    /// offset is the program's start as the pipeline saw it, so these may
    /// read a few microseconds early).
    Exec(TraceEvent),
}

/// A request's events, sorted by time since the pipeline started.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MergedTrace {
    pub events: Vec<(Duration, PipelineEvent)>,
}

impl MergedTrace {
    /// Time of the first occurrence of `event`.
    pub fn time_of(&self, event: PipelineEvent) -> Option<Duration> {
        self.events
            .iter()
            .find(|(_, e)| *e == event)
            .map(|(t, _)| *t)
    }

    pub fn host_ready(&self, group: usize) -> Option<Duration> {
        self.time_of(PipelineEvent::HostReady { group })
    }

    pub fn uploaded(&self, group: usize) -> Option<Duration> {
        self.time_of(PipelineEvent::Uploaded { group })
    }

    pub fn gate_opened(&self, group: usize) -> Option<Duration> {
        self.time_of(PipelineEvent::GateOpened { group })
    }

    pub fn layer_start(&self, layer: usize) -> Option<Duration> {
        self.time_of(PipelineEvent::Exec(TraceEvent::LayerStart { layer }))
    }

    /// How many events match `pred`.
    pub fn count(&self, pred: impl Fn(&PipelineEvent) -> bool) -> usize {
        self.events.iter().filter(|(_, e)| pred(e)).count()
    }
}

/// What the stages run on: shared by every request of one device worker.
#[derive(Clone, Copy)]
pub struct Stages<'a> {
    pub cache: &'a HostCache,
    pub executor: &'a dyn Executor,
    pub residency: &'a Residency,
}

/// One inference request.
#[derive(Clone, Copy)]
pub struct Request<'a> {
    /// The catalog entry (where the slices are).
    pub entry: &'a ModelEntry,
    /// The model's manifest (layers, packed layout); its groups must match
    /// the entry's.
    pub manifest: &'a Manifest,
    pub inputs: &'a [HostTensor],
    /// When the request arrived, for the queue time.
    pub arrived: Instant,
}

#[derive(Debug, Clone, Copy)]
pub struct PipelineOptions {
    pub fetch: FetchOptions,
    /// Longest wait of a stage for one group of the previous stage.
    pub gate_timeout: Duration,
    /// Build the [`MergedTrace`] (host arrival, upload, gate and layer
    /// events on one clock). Off, a run returns an empty one: the runtime
    /// turns it off for requests that did not ask for a trace, as merging
    /// and sorting a model's thousand events costs the device's serial
    /// path about as much as the rest of a run's bookkeeping.
    pub trace: bool,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            fetch: FetchOptions::default(),
            gate_timeout: GATE_TIMEOUT_DEFAULT,
            trace: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    #[error("model {model}: the catalog entry and the manifest disagree: {why}")]
    Mismatch { model: String, why: String },
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("{}", name_model(model, error))]
    Exec {
        model: String,
        error: Box<ExecError>,
    },
    #[error("model {model}: the {stage} stage panicked")]
    Panicked { model: String, stage: &'static str },
}

/// An executor error, prefixed with the model unless it names it already.
fn name_model(model: &str, error: &ExecError) -> String {
    let text = error.to_string();
    if text.contains(model) {
        text
    } else {
        format!("model {model}: {text}")
    }
}

/// Outputs, timing breakdown and trace of one request.
pub type Served = (Vec<HostTensor>, Timing, MergedTrace);

/// Serves `req` with the three stages overlapped (from whichever stage the
/// model's residency allows).
pub fn cold_start(
    stages: &Stages<'_>,
    req: &Request<'_>,
    opts: &PipelineOptions,
) -> Result<Served, PipelineError> {
    serve(stages, req, opts, Mode::Overlap)
}

/// The load-then-run baseline: the same stages, each finished before the
/// next starts.
pub fn sequential(
    stages: &Stages<'_>,
    req: &Request<'_>,
    opts: &PipelineOptions,
) -> Result<Served, PipelineError> {
    serve(stages, req, opts, Mode::Sequential)
}

/// Makes `entry`'s model resident on the device without running it: the
/// fetch (when it is not in the host cache) and the upload overlap as in
/// [`cold_start`], then this waits until every group is uploaded.
/// `req.inputs` is ignored. The timing's `path` says what had to be done
/// ([`LoadPath::DeviceResident`]: nothing); `compute` is the wait for the
/// last upload.
pub fn load(
    stages: &Stages<'_>,
    req: &Request<'_>,
    opts: &PipelineOptions,
) -> Result<Timing, PipelineError> {
    // Nothing reads a load's trace: it is not built.
    let opts = PipelineOptions {
        trace: false,
        ..*opts
    };
    serve(stages, req, &opts, Mode::LoadOnly).map(|(_, timing, _)| timing)
}

/// Stage 1 alone: brings `entry`'s model into the host cache (fetching it
/// on a miss, waiting for the fill of another request on a hit) and returns
/// it pinned, with [`LoadPath::Cold`] when this call fetched it (and the
/// fetch report) or [`LoadPath::HostCached`] when it was there already.
pub fn cache_in(
    cache: &HostCache,
    entry: &ModelEntry,
    manifest: &Manifest,
    opts: &PipelineOptions,
) -> Result<(CachedModel, LoadPath, Option<FetchReport>), PipelineError> {
    let sizes = group_layout(entry, manifest)?;
    let (m, lookup) = cache.lookup_or_reserve(&entry.name, &sizes)?;
    match lookup {
        Lookup::Miss => {
            let report = cache.fill(&m, entry, opts.fetch, &mut |_| {})?;
            Ok((m, LoadPath::Cold, Some(report)))
        }
        Lookup::Hit => {
            for g in 0..sizes.len() {
                m.wait_group(g, opts.gate_timeout)?;
            }
            Ok((m, LoadPath::HostCached, None))
        }
    }
}

/// How [`serve`] runs the stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// All three stages at once ([`cold_start`]).
    Overlap,
    /// Each stage done before the next ([`sequential`]).
    Sequential,
    /// Stages 1 and 2 overlapped, no compute ([`load`]).
    LoadOnly,
}

/// Checks that the catalog entry and the manifest describe the same packed
/// layout; returns the group lengths.
fn group_layout(entry: &ModelEntry, m: &Manifest) -> Result<Vec<u64>, PipelineError> {
    let bad = |why: String| PipelineError::Mismatch {
        model: entry.name.clone(),
        why,
    };
    if entry.groups.len() != m.groups.len() {
        return Err(bad(format!(
            "{} groups in the catalog, {} in the manifest",
            entry.groups.len(),
            m.groups.len()
        )));
    }
    let mut at = 0u64;
    for (g, (e, mg)) in entry.groups.iter().zip(&m.groups).enumerate() {
        if e.bytes != mg.bytes || mg.offset != at {
            return Err(bad(format!(
                "group {g}: catalog has {} bytes at {at}, manifest {} bytes at {}",
                e.bytes, mg.bytes, mg.offset
            )));
        }
        at += mg.bytes;
    }
    if at == 0 {
        return Err(bad("the model has no parameter bytes".into()));
    }
    Ok(entry.groups.iter().map(|g| g.bytes).collect())
}

/// What the upload stage reports, per group.
type UploadEvent = (Instant, PipelineEvent);

fn serve(
    stages: &Stages<'_>,
    req: &Request<'_>,
    opts: &PipelineOptions,
    mode: Mode,
) -> Result<Served, PipelineError> {
    let overlap = mode != Mode::Sequential;
    let t0 = Instant::now();
    let model = req.entry.name.as_str();
    let manifest = req.manifest;
    let sizes = group_layout(req.entry, manifest)?;
    let groups = sizes.len();
    // Every parameter is f32 on the device: twice the stored bytes for a
    // half-precision package (group_layout checked the stored layout).
    let arena_bytes = manifest.device_bytes();
    let exec_err = |error: ExecError| PipelineError::Exec {
        model: model.into(),
        error: Box::new(error),
    };

    let executor = stages.executor;
    let admit = || {
        stages
            .residency
            .get_or_admit(model, arena_bytes, groups, || {
                let arena = executor.alloc_arena(arena_bytes)?;
                let program = executor.program(manifest, arena.clone())?;
                Ok((arena, program))
            })
    };

    let mut timing = Timing {
        queue: t0.saturating_duration_since(req.arrived),
        ..Timing::default()
    };
    let (tx, rx) = channel::bounded::<UploadEvent>(2 * groups + 1);
    let cancel = AtomicBool::new(false);
    let mut cached: Option<CachedModel> = None;
    let mut fetch_result: Option<Result<FetchReport, PipelineError>> = None;
    let mut upload_result: Option<Result<(), PipelineError>> = None;

    // Not resident: reserve host memory first, so that on a cold start the
    // fetch (the long pole) begins before the arena is allocated and the
    // program compiled, which then happen while the first bytes arrive.
    if stages.residency.contains(model) {
        timing.path = LoadPath::DeviceResident;
    } else {
        let (m, lookup) = stages.cache.lookup_or_reserve(model, &sizes)?;
        timing.path = match lookup {
            Lookup::Miss => LoadPath::Cold,
            Lookup::Hit => LoadPath::HostCached,
        };
        cached = Some(m);
    }

    let mut trace = Trace::new();
    let mut gate_times: Vec<(Instant, usize)> = Vec::with_capacity(groups);
    let mut run_window = (t0, t0);
    let mut simulated = false;

    let scoped = stages.residency.stage_threads().scope(|s| {
        let mut fetch = None;
        let mut upload = None;
        if let (Some(m), LoadPath::Cold) = (&cached, timing.path) {
            let m = m.clone();
            let cache = stages.cache;
            let entry = req.entry;
            let fetch_opts = opts.fetch;
            let done = s.run(model, "fetch", move || {
                cache
                    .fill(&m, entry, fetch_opts, &mut |_| {})
                    .map_err(PipelineError::from)
            });
            if overlap {
                fetch = Some(done);
            } else {
                fetch_result = Some(done.wait());
            }
        }
        let (resident, found) = match admit() {
            Ok(r) => r,
            Err(e) => {
                if let Some(done) = fetch {
                    fetch_result = Some(done.wait());
                }
                return Err(PipelineError::from(e));
            }
        };
        if found {
            // Resident already (or made so by a concurrent request, whose
            // upload stage owns the arena): only compute.
            timing.path = LoadPath::DeviceResident;
        } else if let Some(m) = &cached {
            let m = m.clone();
            let resident = resident.clone();
            let tx = tx.clone();
            let cancel = &cancel;
            let timeout = opts.gate_timeout;
            let done = s.run(model, "upload", move || {
                upload_groups(&m, &resident, manifest, timeout, cancel, &tx)
            });
            if overlap {
                upload = Some(done);
            } else {
                upload_result = Some(done.wait());
            }
        }

        let gates = resident.gates();
        let timeout = opts.gate_timeout;
        let start = Instant::now();
        let out = if mode == Mode::LoadOnly {
            // No program run: wait for every group's upload instead.
            (0..groups)
                .try_for_each(|g| {
                    gates.wait(g, timeout)?;
                    gate_times.push((Instant::now(), g));
                    Ok(())
                })
                .map(|()| Vec::new())
        } else {
            let mut program = resident.program();
            simulated = program.simulated();
            program.run(
                req.inputs,
                &mut |g| {
                    gates.wait(g, timeout)?;
                    gate_times.push((Instant::now(), g));
                    Ok(())
                },
                &mut trace,
            )
        };
        run_window = (start, Instant::now());
        if out.is_err() {
            // Stop uploading a model whose request failed; the fetch runs
            // to its end and leaves the model in the host cache.
            cancel.store(true, Ordering::Release);
        }
        if let Some(done) = upload {
            upload_result = Some(done.wait());
        }
        if let Some(done) = fetch {
            fetch_result = Some(done.wait());
        }
        Ok((resident, out))
    });
    drop(tx);
    let (resident, compute) = match scoped {
        Ok(v) => v,
        Err(e) => {
            // Admission failed: report the fetch's own failure first if it had one.
            if let Some(Err(fe)) = fetch_result {
                return Err(fe);
            }
            return Err(e);
        }
    };
    let finished = Instant::now();

    if !resident.gates().all_open() {
        // A failed or cancelled load: the next request starts over.
        stages.residency.discard(&resident);
    }
    // The root cause first: fetch, then upload, then compute.
    let fetch_report = match fetch_result {
        Some(Err(e)) => return Err(e),
        Some(Ok(r)) => Some(r),
        None => None,
    };
    if let Some(Err(e)) = upload_result {
        return Err(e);
    }
    let outputs = compute.map_err(exec_err)?;

    // Timing and trace on one clock (t0).
    let since = |t: Instant| t.saturating_duration_since(t0);
    let mut events: Vec<(Duration, PipelineEvent)> = Vec::new();
    if let Some(m) = &cached {
        let mut last = None;
        for g in 0..groups {
            if let Some(at) = m.ready_at(g).filter(|at| *at >= t0) {
                if opts.trace {
                    events.push((since(at), PipelineEvent::HostReady { group: g }));
                }
                last = last.max(Some(at));
            }
        }
        timing.fetch = last.map(since).unwrap_or_default();
    }
    if let Some(r) = &fetch_report {
        // This request fetched: first read posted to last group verified.
        timing.fetch = r.elapsed;
        timing.fetched_bytes = r.bytes;
        timing.fetch_retries = r.retries;
    }
    let uploads: Vec<UploadEvent> = rx.try_iter().collect();
    let first_upload = uploads.iter().map(|(t, _)| *t).min();
    let last_upload = uploads.iter().map(|(t, _)| *t).max();
    if let (Some(a), Some(b)) = (first_upload, last_upload) {
        timing.h2d = b.saturating_duration_since(a);
    }
    let (run_start, run_end) = run_window;
    if opts.trace {
        events.extend(uploads.into_iter().map(|(t, e)| (since(t), e)));
        events.extend(
            gate_times
                .iter()
                .map(|(t, g)| (since(*t), PipelineEvent::GateOpened { group: *g })),
        );
        events.push((since(run_start), PipelineEvent::ComputeStart));
        events.push((since(run_end), PipelineEvent::ComputeEnd));
        let offset = since(run_start);
        events.extend(
            trace
                .iter()
                .map(|(d, e)| (offset + *d, PipelineEvent::Exec(*e))),
        );
        events.sort_by_key(|(t, _)| *t);
    }

    timing.compute = run_end.saturating_duration_since(run_start);
    timing.total = finished.saturating_duration_since(req.arrived);
    timing.simulated = simulated;
    log::debug!("{model}: {timing:?}");
    Ok((outputs, timing, MergedTrace { events }))
}

/// Stage 2: uploads every group in order as it becomes visible in the host
/// cache, opening its gate as soon as its copy is enqueued (compute's own
/// gate on the device orders it after the copy); on any failure fails every
/// gate still pending with the reason, so compute never waits for a group
/// that will not come.
///
/// Returns only once every copy it started stopped reading host memory
/// ([`Arena::wait_uploaded`]): `cached`, the pin on the model's host-cache
/// blocks, outlives the DMA that reads them, whatever happened.
fn upload_groups(
    cached: &CachedModel,
    resident: &Resident,
    manifest: &Manifest,
    timeout: Duration,
    cancel: &AtomicBool,
    events: &channel::Sender<UploadEvent>,
) -> Result<(), PipelineError> {
    let arena: &dyn Arena = &**resident.arena();
    let mut started = 0;
    let enqueued = enqueue_uploads(
        cached,
        resident,
        manifest,
        timeout,
        cancel,
        events,
        &mut started,
    );
    // Every group whose copy was started, the failed one included (it may
    // have enqueued part of its copy).
    let waited = (0..started).try_for_each(|g| arena.wait_uploaded(g));
    if waited.is_ok() && started > 0 {
        // The channel holds two events per group and one more: never blocks.
        let _ = events.try_send((Instant::now(), PipelineEvent::UploadsComplete));
    }
    enqueued?;
    waited.map_err(|e| {
        resident
            .gates()
            .fail_pending(&format!("waiting for an upload to complete: {e}"));
        PipelineError::Exec {
            model: cached.name().into(),
            error: Box::new(e),
        }
    })
}

/// The loop of [`upload_groups`]; `started` counts the groups whose copy it
/// started, for the caller to wait on.
fn enqueue_uploads(
    cached: &CachedModel,
    resident: &Resident,
    manifest: &Manifest,
    timeout: Duration,
    cancel: &AtomicBool,
    events: &channel::Sender<UploadEvent>,
    started: &mut usize,
) -> Result<(), PipelineError> {
    let gates = resident.gates();
    let arena: &dyn Arena = &**resident.arena();
    let model = cached.name();
    let stored = manifest.param_dtype;
    let offset = |g: usize| manifest.groups[g].device_offset(stored);
    for g in 0..manifest.groups.len() {
        if cancel.load(Ordering::Acquire) {
            gates.fail_pending("the request was abandoned before this group was uploaded");
            return Ok(());
        }
        let bytes = match cached.wait_group(g, timeout) {
            Ok(b) => b,
            Err(e) => {
                gates.fail_pending(&format!("not in host memory: {e}"));
                return Err(e.into());
            }
        };
        // The channel holds two events per group: sends never block.
        let _ = events.try_send((Instant::now(), PipelineEvent::UploadStart { group: g }));
        *started = g + 1;
        #[allow(unsafe_code)]
        // SAFETY: `bytes` are the group's blocks in the host cache, which
        // stay allocated and unchanged while `cached` pins the model; the
        // caller, `upload_groups`, holds that pin until `wait_uploaded`
        // returned for every group started here (this one included).
        let enqueued = unsafe { arena.upload_async(g, offset(g), stored, bytes) };
        if let Err(e) = enqueued {
            gates.fail_pending(&format!("upload of group {g} failed: {e}"));
            return Err(PipelineError::Exec {
                model: model.into(),
                error: Box::new(e),
            });
        }
        // Timed before the gate opens, so Uploaded{g} <= GateOpened{g}.
        let done = Instant::now();
        gates.open(g);
        let _ = events.try_send((done, PipelineEvent::Uploaded { group: g }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_threads_run_at_their_nice_value() {
        let own = distmind_transport::priority::current_thread_nice();
        let stages = StageThreads::new("nice test", 7);
        let on_stage = stages.scope(|s| {
            s.run("m", "probe", || {
                Ok(distmind_transport::priority::current_thread_nice())
            })
            .wait()
        });
        assert_eq!(on_stage.unwrap(), 7.max(own));
        assert_eq!(
            distmind_transport::priority::current_thread_nice(),
            own,
            "the caller keeps its priority"
        );
    }

    #[test]
    fn stage_threads_are_found_by_their_name_prefix() {
        use distmind_transport::priority::threads_cpu_time;
        let stages = StageThreads::new("prefix test", 0);
        // "prefix test stage 0" is cut to 15 bytes by the kernel.
        assert_eq!(stages.thread_prefix(), "prefix test sta");
        assert_eq!(StageThreads::new("dev 3", 0).thread_prefix(), "dev 3 stage");
        let before = threads_cpu_time(stages.thread_prefix());
        let spun = stages.scope(|s| {
            s.run("m", "spin", || {
                let t = std::time::Instant::now();
                let mut x = 0u64;
                while t.elapsed() < Duration::from_millis(20) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
                Ok(x)
            })
            .wait()
        });
        assert!(spun.unwrap() > 0);
        assert!(threads_cpu_time(stages.thread_prefix()) > before);
    }

    #[test]
    fn gates_open_fail_and_time_out_naming_the_group() {
        let gates = GroupGates::new(3);
        gates.open(0);
        gates.wait(0, Duration::ZERO).unwrap();
        let e = gates
            .wait(1, Duration::from_millis(5))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("group 1") && e.contains("not uploaded after"),
            "{e}"
        );
        std::thread::scope(|s| {
            let h = s.spawn(|| gates.wait(2, Duration::from_secs(30)));
            std::thread::sleep(Duration::from_millis(10));
            gates.fail_pending("fetch failed: ms0 lost");
            let e = h.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("group 2") && e.contains("ms0 lost"), "{e}");
        });
        assert_eq!(
            gates.state(0),
            Some(GateState::Ready),
            "open gates stay open"
        );
        assert!(!gates.all_open());
        assert!(gates
            .wait(7, Duration::ZERO)
            .unwrap_err()
            .to_string()
            .contains("3 groups"));
        assert!(GroupGates::opened(4).all_open());
    }
}
