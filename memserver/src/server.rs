//! The memory server's listener, mini-redis style: [`Memserver::bind`]
//! allocates the arena and binds the port once; [`Memserver::serve`] accepts
//! connections until its shutdown future resolves. Each connection is its own
//! task (handshake, then `control` or `data` by role), bounded by a semaphore.
//! With [`MemserverConfig::metrics_listen`] set, `bind` also binds the
//! Prometheus endpoint and `serve` serves it ([`crate::metrics`]) until
//! shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::handshake::{self, ClusterKey};
use distmind_common::limits::READ_CHUNK_BYTES_MAX;
use distmind_common::metrics as scrape;
use distmind_common::proto::MemserverStats;
use distmind_common::wire::Role;
use distmind_transport::MemoryError;
use log::{error, info, warn};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::arena::Arena;
use crate::metrics::{gauge_value, Metrics};
use crate::onesided::{OneSided, OneSidedConfig, OneSidedError};
use crate::samples::{FeatureExtractor, PrepPool, PREP_WORKERS_MAX};

/// How long in-flight requests get to finish once shutdown starts.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Default bound on open connections.
pub const CONNECTIONS_MAX_DEFAULT: usize = 256;
/// Default size of the sample service's preprocessing pool.
pub const PREP_WORKERS_DEFAULT: usize = 2;
/// Default bound on bytes of read replies being sent at once.
pub const READ_BYTES_IN_FLIGHT_MAX_DEFAULT: u64 = 256 << 20;

const _: () = assert!(READ_BYTES_IN_FLIGHT_MAX_DEFAULT >= READ_CHUNK_BYTES_MAX);
const _: () = assert!(READ_CHUNK_BYTES_MAX <= u32::MAX as u64);

/// How a memory server runs; [`MemserverConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct MemserverConfig {
    pub listen: SocketAddr,
    /// Where to serve Prometheus metrics (`GET /metrics`, `GET /health`);
    /// `None` (the default): no metrics endpoint.
    pub metrics_listen: Option<SocketAddr>,
    pub capacity_bytes: u64,
    pub key: ClusterKey,
    /// `host:port` of the controller's metadata port; `None`: do not register.
    pub controller: Option<String>,
    /// Address to register with the controller; default: the bound address.
    pub advertise: Option<String>,
    pub max_connections: usize,
    /// At least [`READ_CHUNK_BYTES_MAX`], so that any one read can proceed.
    pub read_bytes_in_flight_max: u64,
    pub huge_pages: bool,
    /// One-sided data paths to serve besides tcp (default: none).
    pub one_sided: OneSidedConfig,
    /// Hold the tcp replies of every connection together to this rate: the
    /// host's NIC, for emulated links (default: none).
    pub nic_bytes_per_s: Option<u64>,
    /// Threads of the sample service's preprocessing pool (1 to
    /// [`crate::samples::PREP_WORKERS_MAX`]), apart from the serving tasks.
    pub prep_workers: usize,
    /// The frozen backbone the sample service extracts features with
    /// (NDPipe); `None`: `Extract` requests are refused.
    pub extractor: Option<Arc<dyn FeatureExtractor>>,
}

impl MemserverConfig {
    /// A configuration with the documented defaults.
    pub fn new(listen: SocketAddr, capacity_bytes: u64, key: ClusterKey) -> Self {
        MemserverConfig {
            listen,
            metrics_listen: None,
            capacity_bytes,
            key,
            controller: None,
            advertise: None,
            max_connections: CONNECTIONS_MAX_DEFAULT,
            read_bytes_in_flight_max: READ_BYTES_IN_FLIGHT_MAX_DEFAULT,
            huge_pages: true,
            one_sided: OneSidedConfig::default(),
            nic_bytes_per_s: None,
            prep_workers: PREP_WORKERS_DEFAULT,
            extractor: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemserverError {
    #[error("invalid memory server configuration: {0}")]
    Config(String),
    #[error("cannot allocate the {capacity_bytes}-byte arena: {source} (lower --capacity?)")]
    Arena {
        capacity_bytes: u64,
        #[source]
        source: MemoryError,
    },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    OneSided(#[from] OneSidedError),
    #[error("cannot serve metrics on {addr}: {source}")]
    MetricsBind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// State every connection task shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub arena: Arc<Arena>,
    /// The one-sided data paths (libfabric, verbs) serving `arena`, if any.
    pub one_sided: OneSided,
    pub key: ClusterKey,
    pub capacity_bytes: u64,
    /// Permits are bytes of read replies being written.
    pub read_bytes: Semaphore,
    /// [`MemserverConfig::read_bytes_in_flight_max`]: all of `read_bytes`.
    pub read_bytes_max: usize,
    /// Every counter, the data path's included.
    pub metrics: Metrics,
    /// [`MemserverConfig::nic_bytes_per_s`].
    pub nic: Option<distmind_transport::TokenBucket>,
    /// The sample service's preprocessing workers.
    pub prep: PrepPool,
    /// [`MemserverConfig::extractor`].
    pub extractor: Option<Arc<dyn FeatureExtractor>>,
}

impl Shared {
    pub fn stats(&self) -> MemserverStats {
        let t = self.arena.stats();
        MemserverStats {
            capacity_bytes: self.capacity_bytes,
            used_bytes: t.alloc.used_bytes,
            largest_free_bytes: t.alloc.largest_free_bytes,
            extents: t.alloc.extents,
            connections: u64::try_from(self.metrics.connections.get()).unwrap_or(0),
            bytes_served: self.metrics.bytes_served.get(),
            reads_served: self.metrics.reads_served.get(),
        }
    }

    /// Sets the gauges read at scrape time and encodes every series.
    pub fn render_metrics(&self) -> String {
        let s = self.stats();
        let m = &self.metrics;
        m.capacity_bytes.set(gauge_value(s.capacity_bytes));
        m.used_bytes.set(gauge_value(s.used_bytes));
        m.largest_free_bytes.set(gauge_value(s.largest_free_bytes));
        m.extents.set(gauge_value(s.extents));
        let in_flight = self
            .read_bytes_max
            .saturating_sub(self.read_bytes.available_permits());
        m.read_bytes_in_flight.set(gauge_value(in_flight as u64));
        m.encode()
    }
}

/// Read-only view of a running server's counters (for tests and metrics).
#[derive(Debug, Clone)]
pub struct StatsHandle(Arc<Shared>);

impl StatsHandle {
    pub fn snapshot(&self) -> MemserverStats {
        self.0.stats()
    }
    /// Connections whose handshake failed (wrong key, garbage, timeout).
    pub fn handshakes_refused(&self) -> u64 {
        self.0.metrics.handshakes_refused.get()
    }
    /// Connections closed at once because the connection bound was reached.
    pub fn connections_refused(&self) -> u64 {
        self.0.metrics.connections_refused.get()
    }
    /// The Prometheus exposition `GET /metrics` would return now
    /// (OpenMetrics text), with or without a metrics endpoint.
    pub fn render_metrics(&self) -> String {
        self.0.render_metrics()
    }
}

/// A bound memory server: [`Memserver::bind`], then [`Memserver::serve`].
pub struct Memserver {
    listener: TcpListener,
    /// The Prometheus endpoint, if [`MemserverConfig::metrics_listen`] is set.
    metrics_listener: Option<TcpListener>,
    shared: Arc<Shared>,
    config: MemserverConfig,
    boot_id: u64,
}

impl Memserver {
    /// Allocates and faults in the arena (once, here), then binds the port.
    pub async fn bind(config: MemserverConfig) -> Result<Memserver, MemserverError> {
        if config.max_connections == 0 {
            return Err(MemserverError::Config(
                "max_connections must be at least 1".into(),
            ));
        }
        if config.read_bytes_in_flight_max < READ_CHUNK_BYTES_MAX {
            return Err(MemserverError::Config(format!(
                "read_bytes_in_flight_max is {} bytes; it must be at least the largest read, {}",
                config.read_bytes_in_flight_max, READ_CHUNK_BYTES_MAX
            )));
        }
        if config.nic_bytes_per_s == Some(0) {
            return Err(MemserverError::Config(
                "nic_bytes_per_s is 0: use None for no limit".into(),
            ));
        }
        if config.prep_workers == 0 || config.prep_workers > PREP_WORKERS_MAX {
            return Err(MemserverError::Config(format!(
                "prep_workers is {}: it must be 1 to {PREP_WORKERS_MAX}",
                config.prep_workers
            )));
        }
        let in_flight = usize::try_from(config.read_bytes_in_flight_max)
            .ok()
            .filter(|&n| n <= Semaphore::MAX_PERMITS)
            .ok_or_else(|| {
                MemserverError::Config("read_bytes_in_flight_max is too large".into())
            })?;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| MemserverError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let metrics_listener = match config.metrics_listen {
            None => None,
            Some(addr) => Some(
                scrape::bind(addr)
                    .await
                    .map_err(|source| MemserverError::MetricsBind { addr, source })?,
            ),
        };
        let (capacity_bytes, huge) = (config.capacity_bytes, config.huge_pages);
        let started = Instant::now();
        // Faulting in gigabytes takes seconds: keep it off the async workers.
        let arena = tokio::task::spawn_blocking(move || Arena::new(capacity_bytes, huge))
            .await
            .expect("arena allocation panicked")
            .map_err(|source| MemserverError::Arena {
                capacity_bytes,
                source,
            })?;
        info!(
            "memory server arena: {} bytes allocated and faulted in in {:.3} s (huge pages: {})",
            capacity_bytes,
            started.elapsed().as_secs_f64(),
            arena.huge_pages()
        );
        // Registering pins the arena's pages (RDMA) or maps them (tcp
        // provider): once, here, like the fault-in.
        let one_sided = if config.one_sided.any() {
            let (cfg, buf) = (config.one_sided.clone(), Arc::clone(arena.buffer()));
            tokio::task::spawn_blocking(move || OneSided::start(&cfg, &buf))
                .await
                .expect("one-sided data path start panicked")?
        } else {
            OneSided::start(&config.one_sided, arena.buffer())?
        };
        let metrics = Metrics::new();
        for (path, on) in [
            ("fabric", one_sided.offer().fabric.is_some()),
            ("verbs", one_sided.offer().verbs.is_some()),
        ] {
            if on {
                metrics
                    .one_sided_paths
                    .get_or_create(&crate::metrics::PathLabels { path })
                    .set(1);
            }
        }
        let shared = Arc::new(Shared {
            arena: Arc::new(arena),
            one_sided,
            key: config.key.clone(),
            capacity_bytes,
            read_bytes: Semaphore::new(in_flight),
            read_bytes_max: in_flight,
            metrics,
            nic: config
                .nic_bytes_per_s
                .map(distmind_transport::TokenBucket::new),
            prep: PrepPool::new(config.prep_workers).map_err(|e| {
                MemserverError::Config(format!("cannot start the preprocessing workers: {e}"))
            })?,
            extractor: config.extractor.clone(),
        });
        Ok(Memserver {
            listener,
            metrics_listener,
            shared,
            config,
            boot_id: rand::random(),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// The bound metrics address (`None` without
    /// [`MemserverConfig::metrics_listen`]); the CLI prints
    /// `metrics listening on <addr>`.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener
            .as_ref()
            .map(|l| l.local_addr().expect("a bound listener has an address"))
    }

    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(Arc::clone(&self.shared))
    }

    /// Changes on every process start; sent to the controller.
    pub fn boot_id(&self) -> u64 {
        self.boot_id
    }

    /// Serves until `shutdown` resolves, then stops accepting, gives
    /// in-flight requests [`SHUTDOWN_GRACE`] to finish, and returns.
    pub async fn serve(mut self, shutdown: impl Future<Output = ()>) -> Result<(), MemserverError> {
        let local = self.local_addr();
        info!("memory server listening on {local}");
        let (stop_tx, stop_rx) = watch::channel(false);
        let limit = Arc::new(Semaphore::new(self.config.max_connections));
        let mut tasks = JoinSet::new();
        if let Some(listener) = self.metrics_listener.take() {
            if let Ok(addr) = listener.local_addr() {
                info!("memory server metrics on http://{addr}/metrics");
            }
            let shared = Arc::clone(&self.shared);
            let render: Arc<dyn Fn() -> String + Send + Sync> =
                Arc::new(move || shared.render_metrics());
            tasks.spawn(scrape::serve(listener, render, stop_rx.clone()));
        }
        if let Some(controller) = self.config.controller.clone() {
            let advertise = self
                .config
                .advertise
                .clone()
                .unwrap_or_else(|| local.to_string());
            tasks.spawn(crate::register::run(
                Arc::clone(&self.shared),
                controller,
                advertise,
                self.boot_id,
                stop_rx.clone(),
            ));
        }
        let mut refusing = false;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                Some(done) = tasks.join_next(), if !tasks.is_empty() => report_join(done),
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => match Arc::clone(&limit).try_acquire_owned() {
                        Ok(permit) => {
                            refusing = false;
                            let shared = Arc::clone(&self.shared);
                            let stop = stop_rx.clone();
                            tasks.spawn(handle_connection(shared, stream, peer, stop, permit));
                        }
                        Err(_) => {
                            self.shared.metrics.connections_refused.inc();
                            // Once per episode of being full, not once per connection.
                            if !refusing {
                                warn!(
                                    "refusing connection from {peer}: {} connections open (the bound); \
                                     closing new connections until one ends",
                                    self.config.max_connections
                                );
                                refusing = true;
                            }
                            drop(stream);
                        }
                    },
                    Err(e) => {
                        // Typically EMFILE: back off instead of spinning.
                        warn!("accept on {local} failed: {e}; retrying in 100 ms");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        drop(self.listener);
        info!(
            "memory server {local} shutting down: {} tasks to finish",
            tasks.len()
        );
        let _ = stop_tx.send(true);
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while let Some(done) = tasks.join_next().await {
                report_join(done);
            }
        })
        .await;
        if drained.is_err() {
            warn!(
                "{} connections still busy after {SHUTDOWN_GRACE:?}; closing them",
                tasks.len()
            );
            tasks.shutdown().await;
        }
        info!("memory server {local} stopped");
        Ok(())
    }
}

fn report_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        if e.is_panic() {
            error!("a memory server connection task panicked: {e}");
        }
    }
}

/// Decrements the open-connection gauge when a connection ends.
struct OpenConnection<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl Drop for OpenConnection<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn handle_connection(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    peer: SocketAddr,
    mut stop: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    shared.metrics.connections.inc();
    let _open = OpenConnection(&shared.metrics.connections);
    let _ = stream.set_nodelay(true);
    let role = match handshake::server(&mut stream, &shared.key).await {
        Ok(role) => role,
        Err(e) => {
            shared.metrics.handshakes_refused.inc();
            warn!("refused connection from {peer}: {e}");
            return;
        }
    };
    match role {
        Role::Control => crate::control::serve(&shared, stream, peer, &mut stop).await,
        Role::Data => crate::data::serve(&shared, stream, peer, &mut stop).await,
        Role::Sample => crate::samples::serve(&shared, stream, peer, &mut stop).await,
    }
}

/// Bytes of unread input a closing connection discards, at most.
const LINGER_DRAIN_BYTES_MAX: usize = 1 << 20;
const LINGER_TIMEOUT: Duration = Duration::from_millis(500);

/// Closes a connection whose last reply is an error, so that the peer reads
/// that reply: closing with unread input would send a reset, which can
/// discard the reply before the peer reads it. Sends FIN, then discards
/// input (bounded in bytes and time) until the peer closes too.
pub(crate) async fn close_after_error(stream: &mut TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = stream.shutdown().await;
    let drain = async {
        let mut buf = [0u8; 4096];
        let mut left = LINGER_DRAIN_BYTES_MAX;
        while left > 0 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIMEOUT, drain).await;
}
