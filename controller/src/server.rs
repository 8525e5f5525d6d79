//! The controller's listener: one task per connection, mini-redis style.
//!
//! A connection proves the cluster key, then sends JSON request frames and
//! gets one reply frame each, in order. A frame that is intact but is not a
//! request gets an `ErrorReply` and the connection goes on; a broken frame
//! (bad header, too long, cut short) gets a best-effort error and the
//! connection is closed. Nothing a client sends affects other clients.
//!
//! State lives in one [`ControllerState`] behind a `std` mutex held for one
//! synchronous `apply` (never across an `.await`). A deferred reply (a
//! training sync group's) is awaited after the lock is released, bounded by
//! [`GROUP_REPLY_WAIT_MAX`]. Connections are capped by a semaphore; shutdown
//! stops accepting, tells every connection to stop and waits for them.
//!
//! Besides connections it runs the expiry sweep, the training driver
//! ([`crate::driver`]) and the sync groups' deadline timer.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use distmind_common::handshake::{self, ClusterKey};
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{ControllerReply, ControllerRequest, ErrorCode, ErrorReply};
use distmind_common::wire::{self, FrameKind, Role, WireError};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::task::JoinSet;

use crate::dispatch::metrics::DispatchMetrics;
use crate::dispatch::net::{DispatchNet, DispatchThread};
use crate::dispatch::{DispatchConfig, Dispatcher};
use crate::oip::{self, Frontend};
use crate::registry::HEARTBEAT_INTERVAL_DEFAULT;
use crate::state::{ControllerState, Outcome, GROUP_REPLY_WAIT_MAX};

/// Default cap on simultaneous connections.
pub const MAX_CONNECTIONS_DEFAULT: usize = 1024;

/// How long a best-effort error reply to a client whose framing broke may take.
const FAREWELL_TIMEOUT: Duration = Duration::from_secs(1);

/// How long shutdown waits for connections to finish their current reply.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    pub listen: SocketAddr,
    pub key: ClusterKey,
    /// How often memory servers heartbeat; 3 missed intervals = dead.
    pub heartbeat_interval: Duration,
    pub max_connections: usize,
    /// The dispatcher's client port and its policy; `None`: no dispatcher
    /// (the controller serves the catalog and registries only).
    pub dispatch: Option<(SocketAddr, DispatchConfig)>,
    /// Prometheus scrape endpoint (`GET /metrics`, `GET /health`).
    pub metrics_listen: Option<SocketAddr>,
    /// The Open Inference Protocol over HTTP; served only with the dispatcher.
    pub inference_http: Option<SocketAddr>,
    /// The Open Inference Protocol over gRPC; served only with the dispatcher.
    pub inference_grpc: Option<SocketAddr>,
    /// `settings/api.key`: when set, inference requests need `Bearer <key>`.
    pub api_key: Option<String>,
    /// Start placed training jobs' stage workers on their GPU servers (the
    /// training driver; default on). Off, the controller still places
    /// jobs, forms sync groups and takes reports, and whoever else
    /// coordinates the workers sends the stage requests (the runtime's
    /// stage-worker tests do).
    pub drive_training: bool,
    /// Where the dispatcher's tasks run (default: [`DispatchThread::auto`]).
    pub dispatch_thread: DispatchThread,
}

impl ControllerConfig {
    /// A config with the default heartbeat interval and connection cap.
    pub fn new(listen: SocketAddr, key: ClusterKey) -> Self {
        ControllerConfig {
            listen,
            key,
            heartbeat_interval: HEARTBEAT_INTERVAL_DEFAULT,
            max_connections: MAX_CONNECTIONS_DEFAULT,
            dispatch: None,
            metrics_listen: None,
            inference_http: None,
            inference_grpc: None,
            api_key: None,
            drive_training: true,
            dispatch_thread: DispatchThread::auto(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControllerError {
    #[error("cannot listen on {addr}: {source} (is another controller running there?)")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid controller config: {0}")]
    Config(String),
    #[error("cannot listen for {what} on {addr}: {source}")]
    BindPort {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("accepting connections on {addr} failed: {source}")]
    Accept {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// The state shared by every connection task.
#[derive(Debug)]
struct Shared {
    state: Arc<Mutex<ControllerState>>,
    key: ClusterKey,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ControllerState> {
        // `apply` checks before it mutates, so the state behind a poisoned
        // lock is still consistent; keep serving rather than cascade panics.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A bound controller, ready to [`serve`](Controller::serve).
pub struct Controller {
    listener: TcpListener,
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    heartbeat_interval: Duration,
    max_connections: usize,
    dispatch: Option<(TcpListener, Dispatcher)>,
    metrics: Option<TcpListener>,
    dispatch_metrics: Arc<DispatchMetrics>,
    /// The Open Inference Protocol listeners (HTTP, gRPC) and the api key.
    inference_http: Option<TcpListener>,
    inference_grpc: Option<TcpListener>,
    api_key: Option<String>,
    drive_training: bool,
    dispatch_thread: DispatchThread,
}

impl Controller {
    pub async fn bind(config: ControllerConfig) -> Result<Controller, ControllerError> {
        if config.heartbeat_interval.is_zero() {
            return Err(ControllerError::Config(
                "heartbeat_interval must be positive".into(),
            ));
        }
        if config.max_connections == 0 {
            return Err(ControllerError::Config(
                "max_connections must be at least 1".into(),
            ));
        }
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| ControllerError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| ControllerError::Bind {
                addr: config.listen,
                source,
            })?;
        let dispatch = match config.dispatch {
            None => None,
            Some((addr, cfg)) => {
                let d = Dispatcher::new(cfg).map_err(ControllerError::Config)?;
                let l =
                    TcpListener::bind(addr)
                        .await
                        .map_err(|source| ControllerError::BindPort {
                            what: "clients (the dispatcher)",
                            addr,
                            source,
                        })?;
                Some((l, d))
            }
        };
        let metrics =
            match config.metrics_listen {
                None => None,
                Some(addr) => Some(TcpListener::bind(addr).await.map_err(|source| {
                    ControllerError::BindPort {
                        what: "metrics",
                        addr,
                        source,
                    }
                })?),
            };
        if dispatch.is_none()
            && (config.inference_http.is_some() || config.inference_grpc.is_some())
        {
            return Err(ControllerError::Config(
                "the inference endpoints (HTTP, gRPC) route through the dispatcher: they need it on"
                    .into(),
            ));
        }
        let bind_port = |what: &'static str, addr: Option<SocketAddr>| async move {
            match addr {
                None => Ok(None),
                Some(addr) => TcpListener::bind(addr)
                    .await
                    .map(Some)
                    .map_err(|source| ControllerError::BindPort { what, addr, source }),
            }
        };
        let inference_http = bind_port("inference over HTTP", config.inference_http).await?;
        let inference_grpc = bind_port("inference over gRPC", config.inference_grpc).await?;
        Ok(Controller {
            listener,
            local_addr,
            shared: Arc::new(Shared {
                state: Arc::new(Mutex::new(ControllerState::new(config.heartbeat_interval))),
                key: config.key,
            }),
            heartbeat_interval: config.heartbeat_interval,
            max_connections: config.max_connections,
            dispatch,
            metrics,
            dispatch_metrics: Arc::new(DispatchMetrics::new()),
            inference_http,
            inference_grpc,
            api_key: config.api_key,
            drive_training: config.drive_training,
            dispatch_thread: config.dispatch_thread,
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The dispatcher's client port, when it runs.
    pub fn client_addr(&self) -> Option<SocketAddr> {
        self.dispatch
            .as_ref()
            .and_then(|(l, _)| l.local_addr().ok())
    }

    /// The metrics endpoint, when enabled.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The Open Inference Protocol's HTTP endpoint, when enabled.
    pub fn inference_http_addr(&self) -> Option<SocketAddr> {
        self.inference_http
            .as_ref()
            .and_then(|l| l.local_addr().ok())
    }

    /// The Open Inference Protocol's gRPC endpoint, when enabled.
    pub fn inference_grpc_addr(&self) -> Option<SocketAddr> {
        self.inference_grpc
            .as_ref()
            .and_then(|l| l.local_addr().ok())
    }

    /// The Prometheus text exposition (what `GET /metrics` returns).
    pub fn render_metrics(&self) -> String {
        render(&self.shared, &self.dispatch_metrics)
    }

    /// Serves until `shutdown` completes, then closes every connection.
    pub async fn serve(
        mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ControllerError> {
        log::info!("controller (metadata) listening on {}", self.local_addr);
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        tasks.spawn(expire_loop(
            self.shared.clone(),
            self.heartbeat_interval,
            stop_rx.clone(),
        ));
        // Training jobs: the driver sends what the state decides to the GPU
        // servers; the group timer closes sync groups at their deadlines.
        if self.drive_training {
            crate::driver::spawn(
                self.shared.state.clone(),
                self.shared.key.clone(),
                &mut tasks,
                stop_rx.clone(),
            );
        }
        let group_wake = self.shared.lock().group_wake();
        tasks.spawn(group_timer(
            self.shared.clone(),
            group_wake,
            stop_rx.clone(),
        ));
        if let Some((listener, d)) = self.dispatch.take() {
            log::info!(
                "dispatcher ({} policy, {} thread) listening on {}",
                d.policy(),
                self.dispatch_thread,
                listener
                    .local_addr()
                    .map_or_else(|_| "?".into(), |a| a.to_string())
            );
            let (net, listener) = match self.dispatch_thread {
                DispatchThread::Pool => {
                    let net = DispatchNet::start(
                        d,
                        self.shared.state.clone(),
                        self.shared.key.clone(),
                        self.dispatch_metrics.clone(),
                        &mut tasks,
                        stop_rx.clone(),
                    );
                    (net, Some(listener))
                }
                DispatchThread::Own => {
                    let addr = listener
                        .local_addr()
                        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
                    let started = match listener.into_std() {
                        Ok(l) => {
                            DispatchNet::start_on_own_thread(
                                d,
                                self.shared.state.clone(),
                                self.shared.key.clone(),
                                self.dispatch_metrics.clone(),
                                l,
                                stop_rx.clone(),
                            )
                            .await
                        }
                        Err(e) => Err(e),
                    };
                    let (net, done) = started.map_err(|source| ControllerError::BindPort {
                        what: "clients (the dispatcher, on its own thread)",
                        addr,
                        source,
                    })?;
                    // Shutdown waits for the dispatcher's thread too.
                    tasks.spawn(async move {
                        let _ = done.await;
                    });
                    (net, None)
                }
            };
            // The protocol front ends reach the same dispatcher.
            let frontend =
                Frontend::new(net.handle(), self.shared.state.clone(), self.api_key.take());
            if let Some(l) = self.inference_http.take() {
                log::info!(
                    "inference (Open Inference Protocol, HTTP) listening on {}",
                    addr_of(&l)
                );
                tasks.spawn(oip::http::serve(l, frontend.clone(), stop_rx.clone()));
            }
            if let Some(l) = self.inference_grpc.take() {
                log::info!(
                    "inference (Open Inference Protocol, gRPC) listening on {}",
                    addr_of(&l)
                );
                tasks.spawn(oip::grpc::serve(l, frontend.clone(), stop_rx.clone()));
            }
            if let Some(listener) = listener {
                let key = self.shared.key.clone();
                let stop = stop_rx.clone();
                tasks.spawn(async move { net.serve_clients(listener, key, stop).await });
            }
        }
        if let Some(listener) = self.metrics.take() {
            let shared = self.shared.clone();
            let m = self.dispatch_metrics.clone();
            let render = Arc::new(move || render(&shared, &m));
            tasks.spawn(distmind_common::metrics::serve(
                listener,
                render,
                stop_rx.clone(),
            ));
        }
        let limit = Arc::new(Semaphore::new(self.max_connections));
        let result = tokio::select! {
            r = accept_loop(&self, &limit, &mut tasks, &stop_rx) => r,
            _ = shutdown => Ok(()),
        };
        log::info!("controller on {} shutting down", self.local_addr);
        drop(self.listener);
        let _ = stop_tx.send(true);
        let drain = async { while tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(SHUTDOWN_GRACE, drain).await.is_err() {
            log::warn!("connections did not finish within {SHUTDOWN_GRACE:?}; aborting them");
            tasks.abort_all();
        }
        result
    }
}

async fn accept_loop(
    c: &Controller,
    limit: &Arc<Semaphore>,
    tasks: &mut JoinSet<()>,
    stop: &watch::Receiver<bool>,
) -> Result<(), ControllerError> {
    loop {
        // Reap finished connection tasks so the set stays small.
        while tasks.try_join_next().is_some() {}
        let permit = match limit.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                log::warn!(
                    "{} connections open (the limit): new connections wait",
                    c.max_connections
                );
                limit
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the semaphore is never closed")
            }
        };
        let (stream, peer) = match c.listener.accept().await {
            Ok(v) => v,
            Err(e) if is_transient(&e) => {
                log::warn!("accept on {} failed: {e}; retrying", c.local_addr);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(source) => {
                return Err(ControllerError::Accept {
                    addr: c.local_addr,
                    source,
                })
            }
        };
        let shared = c.shared.clone();
        let mut stop = stop.clone();
        tasks.spawn(async move {
            tokio::select! {
                _ = handle_connection(stream, peer, &shared) => {}
                _ = stop.wait_for(|s| *s) => log::debug!("closing connection from {peer}: shutting down"),
            }
            drop(permit);
        });
    }
}

fn addr_of(l: &TcpListener) -> String {
    l.local_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string())
}

/// Errors that say something about one connection attempt, not the listener.
fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock | TimedOut
    ) || e.raw_os_error().is_some_and(|c| c == 23 || c == 24) // ENFILE, EMFILE
}

fn render(shared: &Shared, m: &DispatchMetrics) -> String {
    {
        let s = shared.lock();
        let now = Instant::now();
        m.models.set(s.catalog().len() as i64);
        m.runtimes_alive.set(s.runtimes().live(now).len() as i64);
        m.memservers_alive
            .set(s.registry().list(now).iter().filter(|x| x.alive).count() as i64);
    }
    m.render()
}

async fn expire_loop(shared: Arc<Shared>, interval: Duration, mut stop: watch::Receiver<bool>) {
    // Sweep twice per interval so a death is noticed within half an interval.
    let mut tick = tokio::time::interval(interval / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => { shared.lock().expire(Instant::now()); }
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// The reply of `outcome`; a deferred one is awaited (bounded by
/// [`GROUP_REPLY_WAIT_MAX`]) while watching the client: `None` when it went
/// away meanwhile (its ask is dropped, so a worker that comes back on a new
/// connection takes its own place in its group).
async fn await_reply(outcome: Outcome, stream: &TcpStream) -> Option<ControllerReply> {
    if !matches!(outcome, Outcome::Deferred(_)) {
        return Some(outcome.into_reply());
    }
    let reply = outcome.resolve(GROUP_REPLY_WAIT_MAX);
    tokio::pin!(reply);
    let mut byte = [0u8; 1];
    tokio::select! {
        r = &mut reply => Some(r),
        seen = stream.peek(&mut byte) => match seen {
            // End of stream or a broken connection: nobody reads a reply.
            Ok(0) | Err(_) => None,
            // It sent its next request early: it is read after the reply.
            Ok(_) => Some(reply.await),
        },
    }
}

/// Closes training sync groups at their deadlines: sleeps until the
/// earliest, woken early when an ask may have set an earlier one.
async fn group_timer(shared: Arc<Shared>, wake: Arc<Notify>, mut stop: watch::Receiver<bool>) {
    loop {
        let next = shared.lock().next_group_deadline();
        let due = async {
            match next {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = due => shared.lock().poll_groups(Instant::now()),
            _ = wake.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

async fn handle_connection(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    let _ = stream.set_nodelay(true);
    match handshake::server(&mut stream, &shared.key).await {
        Ok(Role::Control) => {}
        Ok(role) => {
            log::warn!("refused {peer}: asked for a {role:?} connection, the controller serves control only");
            return;
        }
        Err(e) => {
            log::warn!("refused connection from {peer}: {e}");
            return;
        }
    }
    log::debug!("control connection from {peer}");
    loop {
        let req = match wire::read_frame(&mut stream, CONTROL_FRAME_BYTES_MAX).await {
            Ok(None) => return,
            Ok(Some((FrameKind::Message, payload))) => {
                match wire::decode_message::<ControllerRequest>(&payload) {
                    Ok(req) => Ok(req),
                    Err(e) => Err(format!("not a controller request: {e}")),
                }
            }
            Ok(Some((kind, payload))) => Err(format!(
                "the controller takes JSON message frames only, got a {kind:?} frame of {} bytes",
                payload.len()
            )),
            Err(e @ (WireError::TooLarge { .. } | WireError::Malformed(_))) => {
                log::warn!("closing connection from {peer}: {e}");
                let farewell = ControllerReply::Error(ErrorReply::new(
                    ErrorCode::BadRequest,
                    format!("{e}; closing"),
                ));
                let _ = tokio::time::timeout(
                    FAREWELL_TIMEOUT,
                    wire::send_message(&mut stream, &farewell),
                )
                .await;
                return;
            }
            Err(e) => {
                log::warn!("closing connection from {peer}: {e}");
                return;
            }
        };
        let reply = match req {
            Ok(req) => {
                let outcome = shared.lock().apply(req, Instant::now());
                // A deferred reply (a training sync group) is awaited here,
                // with the lock released.
                match await_reply(outcome, &stream).await {
                    Some(r) => r,
                    None => {
                        log::debug!("{peer} went away while its request waited for its reply");
                        return;
                    }
                }
            }
            Err(message) => {
                log::warn!("bad request from {peer}: {message}");
                ControllerReply::Error(ErrorReply::new(ErrorCode::BadRequest, message))
            }
        };
        let mut payload = wire::encode_message(&reply);
        if payload.len() > CONTROL_FRAME_BYTES_MAX as usize {
            let message = format!(
                "the reply is {} bytes, more than a frame's {CONTROL_FRAME_BYTES_MAX} bytes",
                payload.len()
            );
            log::error!("cannot answer {peer}: {message}");
            payload = wire::encode_message(&ControllerReply::Error(ErrorReply::new(
                ErrorCode::Internal,
                message,
            )));
        }
        if let Err(e) = wire::write_frame(&mut stream, FrameKind::Message, &[&payload]).await {
            log::warn!("closing connection from {peer}: cannot send reply: {e}");
            return;
        }
    }
}
