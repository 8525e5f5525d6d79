//! The GPU server's request port, mini-redis style: [`RuntimeServer::bind`]
//! maps the host cache, starts one worker thread per device and binds the
//! port; [`RuntimeServer::serve`] accepts connections until its shutdown
//! future resolves.
//!
//! * One process per host. The host cache (one [`HostCache`], one tcp
//!   transport over the cluster key) is shared by every device; each device
//!   has its own [`Residency`] and one worker thread (the pipeline is
//!   synchronous) fed by a bounded queue: a full queue is a `Busy` reply.
//! * A request goes to the device that has its model resident, else to the
//!   least-loaded queue.
//! * [`conn`]: one task per connection; requests are pipelined and replies
//!   carry the request id, in completion order.
//! * [`worker`]: resolves the model through the controller's catalog (cached
//!   per name), runs [`pipeline::cold_start`](crate::pipeline::cold_start),
//!   encodes the reply.
//! * [`register`]: registration and heartbeats to the controller.

mod conn;
mod register;
mod worker;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel;
use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{DeviceStats, HostCacheStats, RuntimeStats};
use distmind_transport::tcp::{TcpOptions, TcpTransport};
use distmind_transport::{HugePages, TransportError};
use log::{info, warn};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::cache::{CacheConfig, CacheError, HostCache, BLOCK_BYTES_DEFAULT, CACHE_BYTES_DEFAULT};
use crate::device::{Residency, RESIDENT_MODELS_MAX_DEFAULT};
use crate::exec::Executor;
use crate::exec::ExecutorKind;
use crate::pipeline::PipelineOptions;

pub use worker::Job;

/// Default bound on open connections.
pub const CONNECTIONS_MAX_DEFAULT: usize = 256;
/// Default bound on requests waiting in one device's queue.
pub const QUEUE_DEPTH_MAX_DEFAULT: usize = 64;
/// Requests one connection may have outstanding (sent, not yet answered);
/// the server stops reading from a connection at this bound.
pub const REQUESTS_IN_FLIGHT_PER_CONNECTION_MAX: usize = 64;
/// Most devices one runtime serves.
pub const DEVICES_MAX: usize = 64;
/// How long in-flight requests get to finish once shutdown starts.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

pub struct RuntimeConfig {
    pub listen: SocketAddr,
    pub key: ClusterKey,
    /// `host:port` of the controller's metadata port (catalog, registration).
    pub controller: String,
    pub executor: Arc<dyn Executor>,
    /// Device ordinals, one worker each.
    pub devices: Vec<u32>,
    /// Host cache size, shared by every device.
    pub cache_bytes: u64,
    pub cache_block_bytes: u64,
    /// Parameter memory per device (the residency budget).
    pub device_bytes: u64,
    pub resident_models_max: usize,
    /// Models the GPU server's NIC: one token bucket over all its reads.
    pub rate_limit_bytes_per_s: Option<u64>,
    /// Address to register with the controller; default: the bound address.
    pub advertise: Option<String>,
    pub max_connections: usize,
    pub queue_depth_max: usize,
    pub pipeline: PipelineOptions,
    /// Try huge pages for the host cache.
    pub huge_pages: bool,
}

impl RuntimeConfig {
    /// A configuration with the documented defaults: device 0, a
    /// [`CACHE_BYTES_DEFAULT`] host cache and as much per device.
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
            advertise: None,
            max_connections: CONNECTIONS_MAX_DEFAULT,
            queue_depth_max: QUEUE_DEPTH_MAX_DEFAULT,
            pipeline: PipelineOptions::default(),
            huge_pages: true,
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
    Cache(#[from] CacheError),
    #[error("cannot start the worker thread of device {device}: {source}")]
    Spawn {
        device: u32,
        #[source]
        source: std::io::Error,
    },
}

/// One device: its residency and queue counters.
pub(crate) struct DeviceState {
    pub id: u32,
    pub residency: Residency,
    /// Requests queued or running here.
    pub queued: AtomicU64,
    pub served: AtomicU64,
}

/// What workers and connections share.
pub(crate) struct Core {
    pub executor: Arc<dyn Executor>,
    pub cache: HostCache,
    pub devices: Vec<DeviceState>,
    pub catalog: worker::Catalog,
    pub pipeline: PipelineOptions,
    pub served: AtomicU64,
    pub errors: AtomicU64,
    pub connections: AtomicU64,
}

impl Core {
    pub fn queued(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| d.queued.load(Ordering::Relaxed))
            .sum()
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
            },
            devices: self
                .devices
                .iter()
                .map(|d| {
                    let r = d.residency.stats();
                    DeviceStats {
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
}

/// Connections' view: the core and the device queues (closed at shutdown).
pub(crate) struct Shared {
    pub core: Arc<Core>,
    pub key: ClusterKey,
    queues: Mutex<Vec<channel::Sender<Job>>>,
}

/// Why a job was not queued.
pub(crate) enum DispatchError {
    Busy(Box<Job>),
    ShuttingDown(Box<Job>),
}

impl Shared {
    fn queues(&self) -> MutexGuard<'_, Vec<channel::Sender<Job>>> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job` on the device that has its model resident, else on the
    /// least-loaded one; `Busy` when every candidate queue is full.
    pub fn dispatch(&self, mut job: Job) -> Result<(), DispatchError> {
        let queues = self.queues();
        if queues.is_empty() {
            return Err(DispatchError::ShuttingDown(Box::new(job)));
        }
        let devices = &self.core.devices;
        let mut order: Vec<usize> = (0..devices.len()).collect();
        order.sort_by_key(|&d| {
            (
                !devices[d].residency.contains(&job.model),
                devices[d].queued.load(Ordering::Relaxed),
            )
        });
        for d in order {
            devices[d].queued.fetch_add(1, Ordering::Relaxed);
            job.device = d;
            match queues[d].try_send(job) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    devices[d].queued.fetch_sub(1, Ordering::Relaxed);
                    job = e.into_inner();
                }
            }
        }
        Err(DispatchError::Busy(Box::new(job)))
    }

    /// Refuses new jobs; workers finish the queued ones and exit.
    fn close_queues(&self) {
        self.queues().clear();
    }
}

/// A bound runtime, ready to [`serve`](RuntimeServer::serve).
pub struct RuntimeServer {
    listener: TcpListener,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    controller: String,
    advertise: Option<String>,
    max_connections: usize,
    boot_id: u64,
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
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| RuntimeServerError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let transport = TcpTransport::new(TcpOptions {
            rate_limit_bytes_per_s: config.rate_limit_bytes_per_s,
            ..TcpOptions::new(config.key.clone())
        })?;
        let cache_config = CacheConfig {
            capacity_bytes: config.cache_bytes,
            block_bytes: config.cache_block_bytes,
            huge_pages: if config.huge_pages {
                HugePages::Try
            } else {
                HugePages::No
            },
            // Pinned host memory lets H2D copies run asynchronously.
            pin: (config.executor.kind() == ExecutorKind::Cuda).then(crate::exec::cuda::pin_hook),
        };
        // Faulting in gigabytes takes seconds: keep it off the async workers.
        let cache =
            tokio::task::spawn_blocking(move || HostCache::new(cache_config, Arc::new(transport)))
                .await
                .expect("host cache allocation panicked")?;
        let core = Arc::new(Core {
            executor: config.executor.clone(),
            cache,
            devices: config
                .devices
                .iter()
                .map(|&id| DeviceState {
                    id,
                    residency: Residency::new(config.device_bytes, config.resident_models_max),
                    queued: AtomicU64::new(0),
                    served: AtomicU64::new(0),
                })
                .collect(),
            catalog: worker::Catalog::new(config.controller.clone(), config.key.clone()),
            pipeline: config.pipeline,
            served: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            connections: AtomicU64::new(0),
        });
        let mut queues = Vec::with_capacity(config.devices.len());
        let mut workers = Vec::with_capacity(config.devices.len());
        for (index, &device) in config.devices.iter().enumerate() {
            let (tx, rx) = channel::bounded::<Job>(config.queue_depth_max);
            let core = core.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("device {device}"))
                .spawn(move || worker::run(&core, index, rx));
            match spawned {
                Ok(h) => workers.push(h),
                Err(source) => {
                    // Close the queues already made so their workers exit.
                    drop(queues);
                    return Err(RuntimeServerError::Spawn { device, source });
                }
            }
            queues.push(tx);
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
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Changes on every process start; sent to the controller.
    pub fn boot_id(&self) -> u64 {
        self.boot_id
    }

    /// Serves until `shutdown` resolves, then stops accepting, gives open
    /// connections [`SHUTDOWN_GRACE`] to receive their replies, lets the
    /// workers finish what they hold and returns.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeServerError> {
        let local = self.local_addr();
        info!("runtime listening on {local}");
        let (stop_tx, stop_rx) = watch::channel(false);
        let limit = Arc::new(Semaphore::new(self.max_connections));
        let mut tasks = JoinSet::new();
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
        let joined = tokio::task::spawn_blocking(move || {
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
