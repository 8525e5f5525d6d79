//! The GPU server's request port, mini-redis style: [`RuntimeServer::bind`]
//! maps the host cache, starts one worker thread per device and binds the
//! port (and the metrics port, when configured); [`RuntimeServer::serve`]
//! accepts connections until its shutdown future resolves.
//!
//! * One process per host. The host cache (one [`HostCache`], one
//!   transport over the cluster key: tcp, fabric or verbs, see
//!   [`crate::transports`]) is shared by every device; each device
//!   has its own [`Residency`] and one worker thread (the pipeline is
//!   synchronous) fed by a bounded queue: a full queue is a `Busy` reply.
//! * `Infer` goes to the device it names (the controller's dispatcher
//!   places work; an unknown ordinal is `BadRequest`), else to the device
//!   that has its model resident, else to the least-loaded queue. The
//!   `Output` reply lists the models resident on that device afterwards,
//!   most recently used first.
//! * A batched `Infer` (its `batch` members, one input frame per request)
//!   is one device job: the connection concatenates the inputs along
//!   dimension 0 (off the device's serial path); the worker leaves out
//!   requests whose deadline passed or whose input does not fit the model
//!   (each answered with its error), concatenating the others' inputs again
//!   if it left any out, runs the model once and answers each request under
//!   its own id with its own rows (`timing.batch_requests`: how many ran
//!   together). Bounded by
//!   [`BATCH_MEMBERS_MAX`](distmind_common::proto::BATCH_MEMBERS_MAX)
//!   members and [`BATCH_INPUT_BYTES_MAX`] input bytes (held twice while
//!   the job is queued: the frames and their concatenation).
//! * `Prefetch` caches a model in without running it: with a device, through
//!   that device's queue (ordered with its inference) into the host cache and
//!   onto the device; without, into the host cache only, on a blocking
//!   thread, at most [`PREFETCHES_IN_FLIGHT_MAX`] at once.
//! * `Train` starts, switches or stops a device's background training job
//!   (CNN families): the worker runs one SGD iteration whenever its queue is
//!   empty and checks the queue again after each, so inference waits for at
//!   most one iteration (`TimingMsg.train_yield_ms` says how long).
//! * `TrainStage`, `TrainStageStart`, `TrainStageStop`: a distributed
//!   training job's stage workers, at most one per device (`stage`), each
//!   on its own thread; their forward and backward ops share the device
//!   with inference through its lock (`device_lock`), inference first.
//! * `conn`: one task per connection; requests are pipelined and replies
//!   carry the request id, in completion order.
//! * `plan`: one compiled `ModelPlan` per model (typed manifest, layout
//!   checked once) and catalog version. The connection attaches it to the
//!   job; a model new to the runtime, forgotten, or older than the request's
//!   `catalog_version` is refreshed on a blocking thread, one controller call
//!   per model however many requests wait for it, never on a device's serial
//!   path.
//! * `worker`: runs [`pipeline::cold_start`](crate::pipeline::cold_start)
//!   ([`pipeline::sequential`](crate::pipeline::sequential) with
//!   `whole_model`, the baselines' whole-model loads; [`pipeline::load`](crate::pipeline::load)
//!   for a prefetch), runs the
//!   training iterations, encodes the replies.
//! * `register`: registration and heartbeats (with a snapshot of queues,
//!   resident models, training jobs and the host cache) to the controller.
//! * `preload` (`preload` on: the baselines): keeps every catalog model
//!   in the host cache.
//! * `metrics`: Prometheus metrics ([`RuntimeMonitor::render_metrics`]),
//!   served over HTTP at `metrics_listen` when set.

mod batch;
mod conn;
mod device_lock;
mod metrics;
mod plan;
mod preload;
mod register;
pub(crate) mod stage;
mod worker;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel;
use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{
    DeviceSnapshot, DeviceStats, HostCacheStats, RuntimeSnapshot, RuntimeStats, SNAPSHOT_MODELS_MAX,
};
use distmind_transport::tcp::TcpOptions;
use distmind_transport::{HugePages, TransportError};
use log::{info, warn};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::cache::{CacheConfig, CacheError, HostCache, BLOCK_BYTES_DEFAULT, CACHE_BYTES_DEFAULT};
use crate::device::{Residency, RESIDENT_MODELS_MAX_DEFAULT};
use crate::exec::Executor;
use crate::pipeline::PipelineOptions;
use crate::train::SgdConfig;

pub use stage::{StageEnd, StagePhase, StageWorkerStatus, STAGE_WORKERS_PER_SERVER_MAX};
pub use worker::Job;

/// Default bound on open connections.
pub const CONNECTIONS_MAX_DEFAULT: usize = 256;
/// Default bound on requests waiting in one device's queue.
pub const QUEUE_DEPTH_MAX_DEFAULT: usize = 64;
/// Requests one connection may have outstanding (sent, not yet answered);
/// the server stops reading from a connection at this bound. A batched
/// `Infer` holds one slot per request, so it fits a whole batch of
/// 1 + [`BATCH_MEMBERS_MAX`](distmind_common::proto::BATCH_MEMBERS_MAX).
pub const REQUESTS_IN_FLIGHT_PER_CONNECTION_MAX: usize = 64;
/// Most input bytes (the `.npy` frames of every request together) one
/// batched `Infer` may carry; each frame is bounded on its own by the
/// control-frame bound. Over it, every request of the batch is refused.
pub const BATCH_INPUT_BYTES_MAX: usize = 64 << 20;
const _: () =
    assert!(REQUESTS_IN_FLIGHT_PER_CONNECTION_MAX > distmind_common::proto::BATCH_MEMBERS_MAX);
/// Most devices one runtime serves.
pub const DEVICES_MAX: usize = 64;
/// How long in-flight requests get to finish once shutdown starts.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Host-cache prefetches (`Prefetch` without a device) running at once per
/// runtime; one more is answered `Busy`.
pub const PREFETCHES_IN_FLIGHT_MAX: usize = 4;
/// How often `preload` looks for newly deployed models.
pub const PRELOAD_INTERVAL: Duration = Duration::from_secs(1);
/// `Train` requests waiting for one device's next iteration boundary; one
/// more is answered `Busy`.
pub const TRAIN_CONTROLS_MAX: usize = 4;
/// Default images per training iteration ([`RuntimeConfig::train_batch`]).
pub const TRAIN_BATCH_DEFAULT: usize = 8;
/// Largest training batch accepted (a job holds its synthetic batch in memory).
pub const TRAIN_BATCH_MAX: usize = 1024;
/// Weight of the newest iteration in the iteration-time EWMA.
pub const TRAIN_ITERATION_EWMA_WEIGHT: f64 = 0.2;

/// How a runtime is set up; [`RuntimeConfig::new`] fills in the defaults.
pub struct RuntimeConfig {
    pub listen: SocketAddr,
    pub key: ClusterKey,
    /// `host:port` of the controller's metadata port (catalog, registration).
    pub controller: String,
    /// The executor of the first device bound to it (cuda) and the template
    /// of every other: each device runs its own
    /// ([`Executor::for_device`]).
    pub executor: Arc<dyn Executor>,
    /// Device ordinals, one worker and one executor each.
    pub devices: Vec<u32>,
    /// Host cache size, shared by every device.
    pub cache_bytes: u64,
    pub cache_block_bytes: u64,
    /// Parameter memory per device (the residency budget).
    pub device_bytes: u64,
    pub resident_models_max: usize,
    /// Models the GPU server's NIC: one token bucket over all its reads
    /// (tcp reads only: a one-sided transport is limited by its NIC).
    pub rate_limit_bytes_per_s: Option<u64>,
    /// The data path (default: tcp).
    pub transport: crate::transports::TransportChoice,
    /// Address to register with the controller; default: the bound address.
    pub advertise: Option<String>,
    pub max_connections: usize,
    pub queue_depth_max: usize,
    pub pipeline: PipelineOptions,
    /// Try huge pages for the host cache.
    pub huge_pages: bool,
    /// Images (and labels) per background training iteration; at least 2
    /// (BatchNorm in training mode needs two values per channel), at most
    /// [`TRAIN_BATCH_MAX`]. Default [`TRAIN_BATCH_DEFAULT`].
    pub train_batch: usize,
    /// The background training jobs' SGD hyper-parameters; default
    /// [`SgdConfig::default`] (torchvision's ImageNet recipe).
    pub train_sgd: SgdConfig,
    /// Where to serve Prometheus metrics (`GET /metrics`, `GET /health`);
    /// `None` (the default): no metrics port.
    pub metrics_listen: Option<SocketAddr>,
    /// Load a model whole (fetch, then upload, then compute) instead of
    /// pipelining the stages group by group: the baselines of the
    /// evaluation (MPS, Ray Serve). Default false.
    pub whole_model: bool,
    /// Keep every model of the catalog in the host cache: fetch each one
    /// as soon as it is deployed (checked every [`PRELOAD_INTERVAL`]), as
    /// the baselines hold the whole model set in every GPU server's host
    /// memory. The cache must be large enough. Default false.
    pub preload: bool,
    /// Fetch a model the device evicted back into the host cache in the
    /// background ([`HostCache::refill`](crate::cache::HostCache::refill)),
    /// so that host memory holds what the device does not. Only a server of
    /// one device refills: with several, a host copy of a model one device
    /// keeps still serves the others, and refilling in its place lost 3-8%
    /// of throughput in `distmind simulate` at the paper's scale (8 GPUs a
    /// server). Default true.
    pub host_refill: bool,
}

impl RuntimeConfig {
    /// A configuration with the documented defaults: device 0, a
    /// [`CACHE_BYTES_DEFAULT`] host cache and as much per device, training
    /// batches of [`TRAIN_BATCH_DEFAULT`], no metrics port.
    pub fn new(
        listen: SocketAddr,
        key: ClusterKey,
        controller: String,
        executor: Arc<dyn Executor>,
    ) -> Self {
        RuntimeConfig {
            listen,
            key,
            controller,
            executor,
            devices: vec![0],
            cache_bytes: CACHE_BYTES_DEFAULT,
            cache_block_bytes: BLOCK_BYTES_DEFAULT,
            device_bytes: CACHE_BYTES_DEFAULT,
            resident_models_max: RESIDENT_MODELS_MAX_DEFAULT,
            rate_limit_bytes_per_s: None,
            transport: crate::transports::TransportChoice::default(),
            advertise: None,
            max_connections: CONNECTIONS_MAX_DEFAULT,
            queue_depth_max: QUEUE_DEPTH_MAX_DEFAULT,
            pipeline: PipelineOptions::default(),
            huge_pages: true,
            train_batch: TRAIN_BATCH_DEFAULT,
            train_sgd: SgdConfig::default(),
            metrics_listen: None,
            whole_model: false,
            preload: false,
            host_refill: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeServerError {
    #[error("invalid runtime configuration: {0}")]
    Config(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create the tcp transport: {0}")]
    Transport(#[from] TransportError),
    #[error(transparent)]
    TransportOpen(#[from] crate::transports::TransportOpenError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("cannot start the worker thread of device {device}: {source}")]
    Spawn {
        device: u32,
        #[source]
        source: std::io::Error,
    },
}

/// A device's background training job, as the worker last reported it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainingStatus {
    /// The model being trained (`None`: no job).
    pub model: Option<String>,
    /// Iterations of the current job.
    pub iterations: u64,
    /// Iterations of every job this device ran.
    pub total_iterations: u64,
    /// The last iteration's wall time.
    pub iteration_ms_last: f64,
    /// EWMA of the current job's iteration times (weight
    /// [`TRAIN_ITERATION_EWMA_WEIGHT`] on the newest; the first iteration
    /// seeds it). 0 before the first iteration.
    pub iteration_ms_ewma: f64,
    /// The current job's longest iteration.
    pub iteration_ms_max: f64,
    /// Training loss of the last iteration; NaN when `simulated`.
    pub loss: f32,
    /// The job's iterations are simulated (the `sim` executor: the
    /// profile's training time held on the device, nothing computed, so
    /// there is no loss).
    pub simulated: bool,
    /// Why the last job stopped on its own (a failed iteration), if it did.
    pub last_error: Option<String>,
}

/// One device: its residency, queue counters and training state.
pub(crate) struct DeviceState {
    pub id: u32,
    /// This device's own executor (cuda: GPU `id`).
    pub executor: Arc<dyn Executor>,
    pub residency: Residency,
    /// Requests queued or running here.
    pub queued: AtomicU64,
    pub served: AtomicU64,
    /// Nanoseconds spent loading or computing: requests, prefetches,
    /// starting training jobs and training iterations.
    pub busy_ns: AtomicU64,
    /// Nanoseconds the worker (the device's serial path) spent on queued
    /// tasks, from taking one off the queue to handing its last reply to
    /// the connection.
    pub serial_ns: AtomicU64,
    /// The part of `serial_ns` that was neither the executor's compute nor
    /// its copies: parsing, resolving, batching, encoding, replying.
    pub serial_overhead_ns: AtomicU64,
    pub training: Mutex<TrainingStatus>,
    /// Who computes on the device now: its worker (inference, first) or a
    /// training op.
    pub lock: device_lock::DeviceLock,
    /// What stage workers ran on this device, every job.
    pub stage_counters: StageCounters,
    /// An inference has run here: the next is not the warm-up
    /// ([`TimingMsg::warmup`](distmind_common::proto::TimingMsg::warmup)).
    pub inferred: AtomicBool,
}

/// Per-device counters of training stage workers (every job).
#[derive(Debug, Default)]
pub(crate) struct StageCounters {
    pub iterations: AtomicU64,
    /// Samples of the iterations (a pipeline's batch each).
    pub samples: AtomicU64,
    /// Forward ops' compute (and injected slowdowns).
    pub forward_ns: AtomicU64,
    pub backward_ns: AtomicU64,
}

impl DeviceState {
    pub fn training(&self) -> MutexGuard<'_, TrainingStatus> {
        self.training.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the inference that just ran was this device's first.
    pub fn first_inference(&self) -> bool {
        !self.inferred.swap(true, Ordering::Relaxed)
    }

    /// Adds the time since `since` to the busy time.
    pub fn add_busy(&self, since: Instant) {
        let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.busy_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// One task on the serial path: `took` in all, `work` of it the
    /// executor's compute and copies.
    pub fn add_serial(&self, took: Duration, work: Duration) {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.serial_ns.fetch_add(ns(took), Ordering::Relaxed);
        self.serial_overhead_ns
            .fetch_add(ns(took.saturating_sub(work)), Ordering::Relaxed);
    }
}

/// What workers and connections share.
pub(crate) struct Core {
    pub executor: Arc<dyn Executor>,
    pub cache: HostCache,
    pub devices: Vec<DeviceState>,
    pub catalog: plan::Catalog,
    pub pipeline: PipelineOptions,
    /// Load whole models, stages one after the other (the baselines).
    pub whole_model: bool,
    pub served: AtomicU64,
    pub errors: AtomicU64,
    pub connections: AtomicU64,
    /// Parameter memory per device, as configured.
    pub device_bytes: u64,
    pub train_batch: usize,
    pub train_sgd: SgdConfig,
    /// One permit per host-cache prefetch in flight.
    pub prefetch_slots: Arc<Semaphore>,
    pub metrics: metrics::Metrics,
    /// Training stage workers, at most one per device.
    pub stages: stage::StageWorkers,
}

impl Core {
    /// Fetches `model`, which a device just evicted, back into the host
    /// cache in the background when the cache can take it
    /// ([`HostCache::refill`]); its catalog entry is the one its last
    /// request used (none: nothing to do).
    fn refill(&self, model: &str) {
        let Some(plan) = self.catalog.cached(model, None) else {
            return;
        };
        match self.cache.refill(&plan.entry, self.pipeline.fetch) {
            Ok(true) => log::debug!("refilling {model} into the host cache"),
            Ok(false) => {}
            Err(e) => log::warn!("host cache refill of {model}: {e}"),
        }
    }

    pub fn queued(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| d.queued.load(Ordering::Relaxed))
            .sum()
    }

    /// The index of the device whose ordinal is `ordinal`, or a message
    /// naming it and the ordinals this runtime serves.
    pub fn device_index(&self, ordinal: u32) -> Result<usize, String> {
        self.devices
            .iter()
            .position(|d| d.id == ordinal)
            .ok_or_else(|| {
                let known: Vec<u32> = self.devices.iter().map(|d| d.id).collect();
                format!("this runtime has no device {ordinal} (its devices: {known:?})")
            })
    }

    pub fn stats(&self) -> RuntimeStats {
        let c = self.cache.stats();
        RuntimeStats {
            executor: self.executor.describe(),
            cache: HostCacheStats {
                capacity_bytes: c.capacity_bytes,
                used_bytes: c.used_bytes,
                models: c.models,
                hits: c.hits,
                misses: c.misses,
                evictions: c.evictions,
                refills: c.refills,
            },
            devices: self
                .devices
                .iter()
                .map(|d| {
                    let r = d.residency.stats();
                    let t = d.training.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    DeviceStats {
                        busy_ms: d.busy_ns.load(Ordering::Relaxed) as f64 / 1e6,
                        serial_overhead_ms: d.serial_overhead_ns.load(Ordering::Relaxed) as f64
                            / 1e6,
                        training: t.model,
                        train_iterations: t.total_iterations,
                        train_iteration_ms: t.iteration_ms_ewma,
                        device: d.id,
                        queued: d.queued.load(Ordering::Relaxed),
                        served: d.served.load(Ordering::Relaxed),
                        capacity_bytes: r.capacity_bytes,
                        used_bytes: r.used_bytes,
                        models: r.models,
                        hits: r.hits,
                        misses: r.misses,
                        evictions: r.evictions,
                    }
                })
                .collect(),
            connections: self.connections.load(Ordering::Relaxed),
            served: self.served.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }

    /// What the heartbeat reports: per device the queue, the resident
    /// models (most recently used first) and the training job; the models
    /// complete in the host cache (at most [`SNAPSHOT_MODELS_MAX`]).
    pub fn snapshot(&self) -> RuntimeSnapshot {
        let (host_cached, host_cached_truncated) = self.cache.complete_models(SNAPSHOT_MODELS_MAX);
        RuntimeSnapshot {
            devices: self
                .devices
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let t = d.training().clone();
                    let (training, train_iteration_ms) = match (t.model, self.stages.running_on(i))
                    {
                        (Some(model), _) => (Some(model), t.iteration_ms_ewma),
                        // A stage worker yields the device between ops: a
                        // request waits for at most its longest op.
                        (None, Some(w)) => (Some(w.job), w.op_ms_max),
                        (None, None) => (None, 0.0),
                    };
                    DeviceSnapshot {
                        device: d.id,
                        queued: d.queued.load(Ordering::Relaxed),
                        resident: d.residency.resident_mru(),
                        train_iteration_ms,
                        training,
                    }
                })
                .collect(),
            host_cached,
            host_cached_truncated,
        }
    }
}

/// Where stage workers bind their data listeners (the runtime's listen IP)
/// and the host peers dial (the advertised host, else the bound IP).
fn stage_config(
    config: &RuntimeConfig,
    listener: &TcpListener,
) -> Result<stage::StageConfig, RuntimeServerError> {
    let bound = listener
        .local_addr()
        .map_err(|source| RuntimeServerError::Bind {
            addr: config.listen,
            source,
        })?;
    let data_host = match &config.advertise {
        Some(a) => match a.rsplit_once(':') {
            Some((host, _)) => host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            None => a.clone(),
        },
        None => bound.ip().to_string(),
    };
    Ok(stage::StageConfig {
        key: config.key.clone(),
        controller: config.controller.clone(),
        bind_ip: bound.ip(),
        data_host,
    })
}

/// One device's way in: its bounded task queue and its training controls.
struct DeviceQueue {
    tasks: channel::Sender<worker::Task>,
    control: channel::Sender<worker::TrainControl>,
}

/// Connections' view: the core and the device queues (closed at shutdown).
pub(crate) struct Shared {
    pub core: Arc<Core>,
    pub key: ClusterKey,
    queues: Mutex<Vec<DeviceQueue>>,
}

/// Why a task was not queued.
pub(crate) enum DispatchError<T> {
    Busy(Box<T>),
    ShuttingDown(Box<T>),
}

impl Shared {
    fn queues(&self) -> MutexGuard<'_, Vec<DeviceQueue>> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job` on the device that has its model resident, else on the
    /// least-loaded one; `Busy` when every candidate queue is full.
    pub fn dispatch(&self, job: worker::Job) -> Result<(), DispatchError<worker::Task>> {
        let queues = self.queues();
        let mut task = worker::Task::Infer(job);
        if queues.is_empty() {
            return Err(DispatchError::ShuttingDown(Box::new(task)));
        }
        let devices = &self.core.devices;
        let mut order: Vec<usize> = (0..devices.len()).collect();
        order.sort_by_key(|&d| {
            (
                !devices[d].residency.contains(task.model()),
                devices[d].queued.load(Ordering::Relaxed),
            )
        });
        for d in order {
            match Self::try_queue(devices, &queues, d, task) {
                Ok(()) => return Ok(()),
                Err(t) => task = *t,
            }
        }
        Err(DispatchError::Busy(Box::new(task)))
    }

    /// Queues `task` on device `index` (an index into the core's devices).
    pub fn dispatch_to(
        &self,
        index: usize,
        task: worker::Task,
    ) -> Result<(), DispatchError<worker::Task>> {
        let queues = self.queues();
        if queues.is_empty() {
            return Err(DispatchError::ShuttingDown(Box::new(task)));
        }
        Self::try_queue(&self.core.devices, &queues, index, task).map_err(DispatchError::Busy)
    }

    fn try_queue(
        devices: &[DeviceState],
        queues: &[DeviceQueue],
        d: usize,
        mut task: worker::Task,
    ) -> Result<(), Box<worker::Task>> {
        let requests = task.requests();
        devices[d].queued.fetch_add(requests, Ordering::Relaxed);
        task.set_queued(d, Instant::now());
        match queues[d].tasks.try_send(task) {
            Ok(()) => Ok(()),
            Err(e) => {
                devices[d].queued.fetch_sub(requests, Ordering::Relaxed);
                Err(Box::new(e.into_inner()))
            }
        }
    }

    /// Hands a `Train` request to device `index`'s worker, which applies it
    /// at its next iteration boundary.
    pub fn control(
        &self,
        index: usize,
        c: worker::TrainControl,
    ) -> Result<(), DispatchError<worker::TrainControl>> {
        let queues = self.queues();
        let Some(q) = queues.get(index) else {
            return Err(DispatchError::ShuttingDown(Box::new(c)));
        };
        q.control.try_send(c).map_err(|e| match e {
            channel::TrySendError::Full(c) => DispatchError::Busy(Box::new(c)),
            channel::TrySendError::Disconnected(c) => DispatchError::ShuttingDown(Box::new(c)),
        })
    }

    /// Refuses new jobs; workers finish the queued ones and exit.
    fn close_queues(&self) {
        self.queues().clear();
    }
}

/// A cloneable view of a running runtime for tests and tools: its counters,
/// its heartbeat snapshot, its training jobs and its metrics text. Take it
/// with [`RuntimeServer::monitor`] before [`RuntimeServer::serve`].
#[derive(Clone)]
pub struct RuntimeMonitor {
    core: Arc<Core>,
    registry: Arc<Registry>,
}

impl RuntimeMonitor {
    /// What a `Stats` request answers.
    pub fn stats(&self) -> RuntimeStats {
        self.core.stats()
    }

    /// What the next heartbeat reports.
    pub fn snapshot(&self) -> RuntimeSnapshot {
        self.core.snapshot()
    }

    /// The training state of the device whose ordinal is `device`.
    pub fn training(&self, device: u32) -> Option<TrainingStatus> {
        let i = self.core.device_index(device).ok()?;
        Some(self.core.devices[i].training().clone())
    }

    /// Time device `device` spent loading or computing (requests,
    /// prefetches, training).
    pub fn busy(&self, device: u32) -> Option<Duration> {
        let i = self.core.device_index(device).ok()?;
        Some(Duration::from_nanos(
            self.core.devices[i].busy_ns.load(Ordering::Relaxed),
        ))
    }

    /// Every training stage worker this runtime holds (running, or ended
    /// and not yet replaced on its device), by device.
    pub fn stage_workers(&self) -> Vec<StageWorkerStatus> {
        self.core.stages.statuses()
    }

    /// Times this runtime asked the controller for a model's catalog entry
    /// (each compiled one plan).
    pub fn catalog_refreshes(&self) -> u64 {
        self.core.catalog.refreshes()
    }

    /// The Prometheus metrics in the OpenMetrics text format (what
    /// `GET /metrics` serves).
    pub fn render_metrics(&self) -> String {
        distmind_common::metrics::encode(&self.registry)
    }
}

/// A bound runtime, ready to [`serve`](RuntimeServer::serve).
pub struct RuntimeServer {
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    registry: Arc<Registry>,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    controller: String,
    advertise: Option<String>,
    max_connections: usize,
    boot_id: u64,
    preload: bool,
}

impl RuntimeServer {
    /// Binds the port, maps and registers the host cache, starts the workers.
    pub async fn bind(config: RuntimeConfig) -> Result<RuntimeServer, RuntimeServerError> {
        let bad = |m: String| Err(RuntimeServerError::Config(m));
        if config.devices.is_empty() || config.devices.len() > DEVICES_MAX {
            return bad(format!(
                "devices: {} given, 1..={DEVICES_MAX} needed",
                config.devices.len()
            ));
        }
        let mut seen = config.devices.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != config.devices.len() {
            return bad(format!("devices {:?} name one twice", config.devices));
        }
        if config.max_connections == 0 || config.queue_depth_max == 0 {
            return bad("max_connections and queue_depth_max must be at least 1".into());
        }
        if config.device_bytes == 0 {
            return bad("device_bytes must be positive".into());
        }
        if !(2..=TRAIN_BATCH_MAX).contains(&config.train_batch) {
            return bad(format!(
                "train_batch is {}; 2..={TRAIN_BATCH_MAX} needed (BatchNorm in training mode needs two images)",
                config.train_batch
            ));
        }
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| RuntimeServerError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let metrics_listener = match config.metrics_listen {
            Some(addr) => Some(
                distmind_common::metrics::bind(addr)
                    .await
                    .map_err(|source| RuntimeServerError::Bind { addr, source })?,
            ),
            None => None,
        };
        let transport = crate::transports::open_transport(
            &config.transport,
            TcpOptions {
                rate_limit_bytes_per_s: config.rate_limit_bytes_per_s,
                thread_nice: config.executor.kind().data_thread_nice(),
                ..TcpOptions::new(config.key.clone())
            },
        )?;
        let cache_config = CacheConfig {
            capacity_bytes: config.cache_bytes,
            block_bytes: config.cache_block_bytes,
            huge_pages: if config.huge_pages {
                HugePages::Try
            } else {
                HugePages::No
            },
            pin: None,
            thread_nice: 0,
        }
        // Pinned host memory lets H2D copies run asynchronously.
        .pinned_for(config.executor.kind())
        .niced_for(config.executor.kind());
        // Faulting in gigabytes takes seconds: keep it off the async workers.
        let cache = tokio::task::spawn_blocking(move || HostCache::new(cache_config, transport))
            .await
            .expect("host cache allocation panicked")?;
        let executors = crate::exec::per_device(&config.executor, &config.devices)
            .map_err(|e| RuntimeServerError::Config(e.to_string()))?;
        let stage_config = stage_config(&config, &listener)?;
        let core = Arc::new(Core {
            executor: config.executor.clone(),
            cache,
            devices: config
                .devices
                .iter()
                .zip(executors)
                .map(|(&id, executor)| DeviceState {
                    id,
                    executor,
                    residency: Residency::for_device(
                        id,
                        config.device_bytes,
                        config.resident_models_max,
                        config.executor.kind().stage_thread_nice(),
                    ),
                    queued: AtomicU64::new(0),
                    served: AtomicU64::new(0),
                    busy_ns: AtomicU64::new(0),
                    serial_ns: AtomicU64::new(0),
                    serial_overhead_ns: AtomicU64::new(0),
                    training: Mutex::new(TrainingStatus::default()),
                    lock: device_lock::DeviceLock::default(),
                    stage_counters: StageCounters::default(),
                    inferred: AtomicBool::new(false),
                })
                .collect(),
            catalog: plan::Catalog::new(config.controller.clone(), config.key.clone()),
            pipeline: config.pipeline,
            whole_model: config.whole_model,
            served: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            device_bytes: config.device_bytes,
            train_batch: config.train_batch,
            train_sgd: config.train_sgd,
            prefetch_slots: Arc::new(Semaphore::new(PREFETCHES_IN_FLIGHT_MAX)),
            metrics: metrics::Metrics::new(),
            stages: stage::StageWorkers::new(stage_config, config.devices.len()),
        });
        // The host cache evicts what the devices hold first, and takes
        // back what they give up.
        for d in &core.devices {
            d.residency.report_uses_to(core.cache.device_uses().clone());
            if config.host_refill && !config.whole_model && config.devices.len() == 1 {
                let weak = Arc::downgrade(&core);
                d.residency.on_evict(Box::new(move |name| {
                    if let Some(core) = weak.upgrade() {
                        core.refill(name);
                    }
                }));
            }
        }
        let registry = Arc::new(metrics::registry(&core));
        let mut queues = Vec::with_capacity(config.devices.len());
        let mut workers = Vec::with_capacity(config.devices.len());
        for (index, &device) in config.devices.iter().enumerate() {
            let (tx, rx) = channel::bounded::<worker::Task>(config.queue_depth_max);
            let (control_tx, control_rx) =
                channel::bounded::<worker::TrainControl>(TRAIN_CONTROLS_MAX);
            let core = core.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("device {device}"))
                .spawn(move || worker::run(&core, index, rx, control_rx));
            match spawned {
                Ok(h) => workers.push(h),
                Err(source) => {
                    // Close the queues already made so their workers exit.
                    drop(queues);
                    return Err(RuntimeServerError::Spawn { device, source });
                }
            }
            queues.push(DeviceQueue {
                tasks: tx,
                control: control_tx,
            });
        }
        info!(
            "runtime: {} devices {:?} on {}, host cache {} bytes, {} bytes per device",
            config.devices.len(),
            config.devices,
            config.executor.describe(),
            core.cache.capacity_bytes(),
            config.device_bytes
        );
        Ok(RuntimeServer {
            listener,
            metrics_listener,
            registry,
            shared: Arc::new(Shared {
                core,
                key: config.key,
                queues: Mutex::new(queues),
            }),
            workers,
            controller: config.controller,
            advertise: config.advertise,
            max_connections: config.max_connections,
            boot_id: rand::random(),
            preload: config.preload,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Where metrics are served (`RuntimeConfig::metrics_listen`, resolved
    /// when its port was 0); `None` without a metrics port.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
    }

    /// A view of the runtime's counters, training jobs and metrics that
    /// stays valid while (and after) it serves.
    pub fn monitor(&self) -> RuntimeMonitor {
        RuntimeMonitor {
            core: self.shared.core.clone(),
            registry: self.registry.clone(),
        }
    }

    /// The Prometheus metrics text (what `GET /metrics` serves); see
    /// [`RuntimeMonitor::render_metrics`] for use while serving.
    pub fn render_metrics(&self) -> String {
        self.monitor().render_metrics()
    }

    /// Changes on every process start; sent to the controller.
    pub fn boot_id(&self) -> u64 {
        self.boot_id
    }

    /// Serves until `shutdown` resolves (and metrics at
    /// [`metrics_addr`](RuntimeServer::metrics_addr), when bound), then stops
    /// accepting, gives open connections [`SHUTDOWN_GRACE`] to receive their
    /// replies, lets the workers finish what they hold (a training job stops
    /// at its iteration boundary) and returns.
    pub async fn serve(
        mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), RuntimeServerError> {
        let local = self.local_addr();
        info!("runtime listening on {local}");
        let (stop_tx, stop_rx) = watch::channel(false);
        let limit = Arc::new(Semaphore::new(self.max_connections));
        let mut tasks = JoinSet::new();
        if let Some(listener) = self.metrics_listener.take() {
            if let Ok(addr) = listener.local_addr() {
                info!("runtime metrics on http://{addr}/metrics");
            }
            let registry = self.registry.clone();
            let render: Arc<dyn Fn() -> String + Send + Sync> =
                Arc::new(move || distmind_common::metrics::encode(&registry));
            tasks.spawn(distmind_common::metrics::serve(
                listener,
                render,
                stop_rx.clone(),
            ));
        }
        if self.preload {
            tasks.spawn(preload::run(self.shared.core.clone(), stop_rx.clone()));
        }
        let advertise = self.advertise.clone().unwrap_or_else(|| local.to_string());
        tasks.spawn(register::run(
            self.shared.clone(),
            self.controller.clone(),
            advertise,
            self.boot_id,
            stop_rx.clone(),
        ));
        let mut refusing = false;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => match limit.clone().try_acquire_owned() {
                        Ok(permit) => {
                            refusing = false;
                            let shared = self.shared.clone();
                            let stop = stop_rx.clone();
                            tasks.spawn(async move {
                                conn::handle(shared, stream, peer, stop).await;
                                drop(permit);
                            });
                        }
                        Err(_) => {
                            if !refusing {
                                warn!(
                                    "refusing connection from {peer}: {} connections open (the bound)",
                                    self.max_connections
                                );
                                refusing = true;
                            }
                            drop(stream);
                        }
                    },
                    Err(e) => {
                        warn!("accept on {local} failed: {e}; retrying in 100 ms");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        drop(self.listener);
        info!("runtime {local} shutting down");
        // Stop taking requests, answer those already queued, then close.
        self.shared.close_queues();
        // Stage workers stop mid-wait, so the replies they owe go out now.
        self.shared.core.stages.abort_all();
        let _ = stop_tx.send(true);
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!("connections still busy after {SHUTDOWN_GRACE:?}; closing them");
            tasks.shutdown().await;
        }
        let workers = self.workers;
        let core = self.shared.core.clone();
        let joined = tokio::task::spawn_blocking(move || {
            // Stage workers first (aborted above): their threads joined.
            core.stages.join_all();
            for w in workers {
                let _ = w.join();
            }
        });
        if tokio::time::timeout(SHUTDOWN_GRACE, joined).await.is_err() {
            warn!("device workers still running after {SHUTDOWN_GRACE:?}; leaving them");
        }
        info!("runtime {local} stopped");
        Ok(())
    }
}
