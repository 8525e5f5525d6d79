//! The dispatcher's IO: the client port, one link per runtime, and the task
//! that owns the [`Dispatcher`] and turns its actions into messages.
//!
//! ```text
//!  client reader tasks --Event::Request--> core task --(write)--> runtime
//!        client socket <-------(write)------ core task <--Event::Reply-- link reader task
//! ```
//!
//! * The core task is the only owner of the dispatcher state: no locks on
//!   the decision path. It holds each request's input bytes and where its
//!   reply goes until the request is sent or answered.
//! * The core task writes requests to runtimes and replies to clients
//!   itself ([`Outbox`]): a request crosses one task hop on its way in and
//!   one on its way back, not four. Only bytes a socket does not take at
//!   once wait for that socket's writer task. A runtime's `Output` reply is
//!   forwarded as the runtime encoded it, re-addressed (its id, the
//!   dispatch record) without encoding it again.
//! * Clients speak the runtime protocol (`RuntimeRequest::Infer` + one
//!   input frame; `RuntimeReply::Output` + output frames), so the same
//!   client talks to a runtime or to the dispatcher; replies carry the
//!   client's id and a [`DispatchInfo`].
//! * Bounded everywhere: connections, requests in flight per connection,
//!   the event channel, the bytes waiting for each socket, requests in the
//!   dispatcher, the input bytes it holds.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distmind_common::handshake::{self, ClusterKey};
use distmind_common::limits::{CONTROL_FRAME_BYTES_MAX, NAME_BYTES_MAX};
use distmind_common::proto::{
    BatchMember, DispatchInfo, ErrorCode, ErrorReply, RuntimeReply, RuntimeRequest,
    RUNTIME_OUTPUTS_MAX,
};
use distmind_common::wire::{self, FrameKind, Role};
use tokio::io::{AsyncRead, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use super::core::{Action, BatchMate, Completion, Dispatcher, ReqId};
use super::metrics::{DispatchMetrics, UNRESOLVED_MODEL};
use super::outbox::{Outbox, OutboxError};
use crate::policy::cost::ModelMeta;
use crate::policy::{Gpu, Micros};
use crate::state::ControllerState;

/// Most client connections at once.
pub const CLIENT_CONNECTIONS_MAX: usize = 1024;
/// Requests one client connection may have outstanding; the dispatcher
/// stops reading from it at this bound.
pub const CLIENT_IN_FLIGHT_MAX: usize = 256;
/// Events waiting for the core task.
const EVENTS_MAX: usize = 16_384;
/// Events the core task handles in one turn before it writes what they
/// produced (a burst shares its writes).
const EVENTS_PER_TURN: usize = 64;
/// Bytes waiting to be written to one runtime (requests and their inputs).
const LINK_QUEUE_BYTES_MAX: usize = 256 << 20;
/// Bytes of replies waiting to be written to one client: past it the
/// client, which does not read its replies, is disconnected.
const CLIENT_QUEUE_BYTES_MAX: usize = 256 << 20;
/// Input bytes the dispatcher holds for requests not yet answered.
pub const HELD_INPUT_BYTES_MAX: u64 = 1 << 30;
/// How often the core re-reads the runtime registry and runs the policy.
const TICK: Duration = Duration::from_millis(50);
/// While the dispatcher knows no GPU server, requests read the registry
/// ahead of the tick at most this often.
const EARLY_SYNC_MIN: Duration = Duration::from_millis(1);
/// Connecting (and the handshake) to a runtime.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// After a link to a runtime fails, wait this long before connecting again.
const RELINK_BACKOFF: Duration = Duration::from_secs(1);
/// Control requests on a link (prefetch, evict, train) have ids with this
/// bit set, so their replies are told apart from requests'.
const CONTROL_ID_BIT: u64 = 1 << 63;

type Shared = Arc<Mutex<ControllerState>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, ControllerState> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// A reply to a client that is not on the native port: a message and its
/// output frames.
pub struct Outgoing {
    pub reply: RuntimeReply,
    pub frames: Vec<Vec<u8>>,
    /// Released when the reply is written (the connection's in-flight bound).
    pub permit: Option<OwnedSemaphorePermit>,
}

/// Where a request's reply goes.
#[derive(Clone)]
pub enum ReplyTo {
    /// A native client connection: the core task writes the reply to its
    /// socket.
    Conn(Arc<Outbox>),
    /// Any other front end: the reply as an [`Outgoing`] on this channel.
    Channel(mpsc::Sender<Outgoing>),
}

enum Event {
    Request {
        client: ReplyTo,
        client_id: u64,
        model: String,
        slo_ms: Option<u64>,
        /// 1 is the highest level, larger is lower; 0: the default, the
        /// lowest.
        priority: u32,
        trace: bool,
        input: Vec<u8>,
        permit: OwnedSemaphorePermit,
    },
    Reply {
        runtime: u32,
        boot_id: u64,
        reply: RuntimeReply,
        /// The reply message as the runtime encoded it.
        raw: Vec<u8>,
        frames: Vec<Vec<u8>>,
    },
    LinkUp {
        runtime: u32,
        boot_id: u64,
    },
    LinkDown {
        runtime: u32,
        boot_id: u64,
        why: String,
    },
}

struct Inflight {
    client: ReplyTo,
    client_id: u64,
    trace: bool,
    /// Kept until the request is answered: a request in flight on a
    /// runtime that is lost is sent again elsewhere.
    input: Vec<u8>,
    permit: Option<OwnedSemaphorePermit>,
    model: String,
}

struct Link {
    boot_id: u64,
    /// Requests for the runtime; written by the core task.
    out: Arc<Outbox>,
    /// The link's task: a link given up (its runtime stopped heartbeating)
    /// may be stuck writing to a host that vanished; dropping it ends it.
    task: tokio::task::AbortHandle,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where the dispatcher's tasks (the core, its links, the client
/// connections) run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchThread {
    /// On the controller's thread pool, beside its other connections.
    Pool,
    /// On a single-threaded runtime of their own, on one thread.
    Own,
}

/// Hosts with at most this many cores give the dispatcher a thread of its
/// own under [`DispatchThread::auto`].
pub const OWN_THREAD_CORES_MAX: usize = 4;

impl DispatchThread {
    /// [`Own`](Self::Own) on hosts of at most [`OWN_THREAD_CORES_MAX`]
    /// cores, else [`Pool`](Self::Pool). Measured with `bench dispatch`
    /// (the added time per request): on 2 cores its own thread cut it, on
    /// 16 the pool kept it lower; between them the cut is not measured.
    pub fn auto() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cores <= OWN_THREAD_CORES_MAX {
            DispatchThread::Own
        } else {
            DispatchThread::Pool
        }
    }
}

impl std::str::FromStr for DispatchThread {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::auto()),
            "own" => Ok(DispatchThread::Own),
            "pool" => Ok(DispatchThread::Pool),
            other => Err(format!(
                "dispatcher thread {other:?}: expected auto, own or pool"
            )),
        }
    }
}

impl std::fmt::Display for DispatchThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DispatchThread::Pool => "pool",
            DispatchThread::Own => "own",
        })
    }
}

/// The dispatcher's tasks; see the module docs.
pub struct DispatchNet {
    events: mpsc::Sender<Event>,
}

impl DispatchNet {
    /// Starts the core task; `serve_clients` then accepts on the client port.
    pub fn start(
        dispatcher: Dispatcher,
        state: Shared,
        key: ClusterKey,
        metrics: Arc<DispatchMetrics>,
        tasks: &mut JoinSet<()>,
        stop: watch::Receiver<bool>,
    ) -> DispatchNet {
        let (net, core, rx) = DispatchNet::new(dispatcher, state, key, metrics);
        tasks.spawn(core.run(rx, stop));
        net
    }

    /// [`start`](Self::start) and [`serve_clients`](Self::serve_clients)
    /// on a thread of their own ([`DispatchThread::Own`]): a single-threaded
    /// runtime there runs the core task, its links and every client
    /// connection until `stop`. Returns once that thread took `listener`
    /// over; the receiver completes when the thread has finished (its tasks
    /// ended, its runtime dropped).
    pub async fn start_on_own_thread(
        dispatcher: Dispatcher,
        state: Shared,
        key: ClusterKey,
        metrics: Arc<DispatchMetrics>,
        listener: std::net::TcpListener,
        stop: watch::Receiver<bool>,
    ) -> std::io::Result<(DispatchNet, tokio::sync::oneshot::Receiver<()>)> {
        listener.set_nonblocking(true)?;
        let (net, core, rx) = DispatchNet::new(dispatcher, state, key.clone(), metrics);
        let ours = DispatchNet {
            events: net.events.clone(),
        };
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<std::io::Result<()>>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("dispatcher".into())
            .spawn(move || {
                // Built, run and dropped on this thread only (a runtime may
                // not be dropped inside another's tasks).
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => {
                            let _ = ready_tx.send(Ok(()));
                            let clients = ours.serve_clients(listener, key, stop.clone());
                            tokio::join!(core.run(rx, stop), clients);
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                });
                // Links and connections still open end with the runtime.
                drop(rt);
                let _ = done_tx.send(());
            })?;
        ready_rx.await.unwrap_or_else(|_| {
            Err(std::io::Error::other(
                "the dispatcher's thread ended before it started",
            ))
        })?;
        Ok((net, done_rx))
    }

    /// The core task, not started, and the handle to it.
    fn new(
        dispatcher: Dispatcher,
        state: Shared,
        key: ClusterKey,
        metrics: Arc<DispatchMetrics>,
    ) -> (DispatchNet, CoreTask, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel(EVENTS_MAX);
        let core = CoreTask {
            d: dispatcher,
            state,
            key,
            metrics,
            epoch: Instant::now(),
            inflight: HashMap::new(),
            links: HashMap::new(),
            relink_at: HashMap::new(),
            controls: HashMap::new(),
            next_control: 0,
            early_sync: None,
            held_bytes: 0,
            events: tx.clone(),
            actions: Vec::new(),
            dirty: Vec::new(),
        };
        (DispatchNet { events: tx }, core, rx)
    }

    /// A handle for in-process front ends (the Open Inference Protocol
    /// servers): they submit requests to the same core task as the client
    /// port does.
    pub fn handle(&self) -> DispatchHandle {
        DispatchHandle {
            events: self.events.clone(),
            in_flight: Arc::new(Semaphore::new(HANDLE_IN_FLIGHT_MAX)),
            next_id: Arc::new(AtomicU64::new(1)),
        }
    }

    /// Accepts client connections until `stop`.
    pub async fn serve_clients(
        &self,
        listener: tokio::net::TcpListener,
        key: ClusterKey,
        mut stop: watch::Receiver<bool>,
    ) {
        let limit = Arc::new(Semaphore::new(CLIENT_CONNECTIONS_MAX));
        let mut conns = JoinSet::new();
        let mut refusing = false;
        let conn_stop = stop.clone();
        loop {
            while conns.try_join_next().is_some() {}
            let accepted = tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, peer)) => match limit.clone().try_acquire_owned() {
                    Ok(permit) => {
                        refusing = false;
                        let events = self.events.clone();
                        let key = key.clone();
                        let stop = conn_stop.clone();
                        conns.spawn(async move {
                            client_conn(stream, peer, key, events, stop).await;
                            drop(permit);
                        });
                    }
                    Err(_) => {
                        if !refusing {
                            log::warn!("refusing client {peer}: {CLIENT_CONNECTIONS_MAX} connections open (the bound)");
                            refusing = true;
                        }
                    }
                },
                Err(e) => {
                    log::warn!("dispatcher accept failed: {e}; retrying in 50 ms");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        conns.shutdown().await;
    }
}

/// Requests all clones of one [`DispatchHandle`] may have outstanding;
/// callers wait for a slot beyond it.
pub const HANDLE_IN_FLIGHT_MAX: usize = 4096;

/// Submits requests to the dispatcher from inside the controller process.
/// Cloneable; every clone shares one in-flight bound.
#[derive(Clone)]
pub struct DispatchHandle {
    events: mpsc::Sender<Event>,
    in_flight: Arc<Semaphore>,
    next_id: Arc<AtomicU64>,
}

impl DispatchHandle {
    /// Routes one request for `model` (`input`: the runtime's input frame,
    /// a `.npy` file) and waits for its answer: `RuntimeReply::Output` with
    /// one frame per output name, or `RuntimeReply::Error`. A dispatcher
    /// that has stopped answers `ShuttingDown`.
    pub async fn infer(
        &self,
        model: String,
        slo_ms: Option<u64>,
        priority: u32,
        input: Vec<u8>,
    ) -> Outgoing {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let stopped = |model: &str| Outgoing {
            reply: RuntimeReply::Error {
                id,
                error: ErrorReply::new(
                    ErrorCode::ShuttingDown,
                    format!("request for {model}: the dispatcher has stopped"),
                ),
            },
            frames: Vec::new(),
            permit: None,
        };
        let Ok(permit) = self.in_flight.clone().acquire_owned().await else {
            return stopped(&model);
        };
        // Exactly one reply comes back per request.
        let (tx, mut rx) = mpsc::channel(1);
        let ev = Event::Request {
            client: ReplyTo::Channel(tx),
            client_id: id,
            model: model.clone(),
            slo_ms,
            priority,
            trace: false,
            input,
            permit,
        };
        if self.events.send(ev).await.is_err() {
            return stopped(&model);
        }
        rx.recv().await.unwrap_or_else(|| stopped(&model))
    }
}

struct CoreTask {
    d: Dispatcher,
    state: Shared,
    key: ClusterKey,
    metrics: Arc<DispatchMetrics>,
    epoch: Instant,
    inflight: HashMap<ReqId, Inflight>,
    links: HashMap<u32, Link>,
    /// Runtimes whose link failed, and when to try again.
    relink_at: HashMap<u32, Instant>,
    /// Control requests in flight on links: id -> (gpu, what).
    controls: HashMap<u64, (Gpu, &'static str)>,
    next_control: u64,
    /// When a request last read the registry ahead of the tick (while the
    /// dispatcher knew no GPU server): at most once per [`EARLY_SYNC_MIN`].
    early_sync: Option<Instant>,
    held_bytes: u64,
    events: mpsc::Sender<Event>,
    actions: Vec<Action>,
    /// Outboxes with bytes staged this turn, written at its end.
    dirty: Vec<Arc<Outbox>>,
}

impl CoreTask {
    fn now(&self) -> Micros {
        self.epoch.elapsed().as_micros() as Micros
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Event>, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                _ = tick.tick() => self.on_tick(),
                ev = rx.recv() => match ev {
                    Some(ev) => {
                        self.on_event(ev);
                        // What else is ready goes in the same turn.
                        for _ in 1..EVENTS_PER_TURN {
                            match rx.try_recv() {
                                Ok(ev) => self.on_event(ev),
                                Err(_) => break,
                            }
                        }
                    }
                    None => break,
                },
            }
            self.flush();
            self.write_out();
        }
        // Answer whatever is still here: nothing is dropped silently.
        let ids: Vec<ReqId> = self.inflight.keys().copied().collect();
        for id in ids {
            let model = self.inflight[&id].model.clone();
            self.fail(
                id,
                ErrorReply::new(
                    ErrorCode::ShuttingDown,
                    format!("request for {model}: the controller is shutting down"),
                ),
            );
        }
        self.write_out();
    }

    /// Writes what this turn staged, one write per socket.
    fn write_out(&mut self) {
        for out in self.dirty.drain(..) {
            out.flush();
        }
    }

    /// Sends `reply` (and, for an `Output`, its `frames`) to `to`.
    fn answer(
        &mut self,
        to: &ReplyTo,
        reply: RuntimeReply,
        frames: Vec<Vec<u8>>,
        permit: Option<OwnedSemaphorePermit>,
    ) {
        match to {
            ReplyTo::Channel(tx) => {
                let _ = tx.try_send(Outgoing {
                    reply,
                    frames,
                    permit,
                });
            }
            ReplyTo::Conn(out) => {
                let parts: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
                let staged = out.stage_reply(&reply, &parts, permit);
                self.staged(out, staged);
            }
        }
    }

    /// Notes an outbox that staged bytes; a client's that could not is
    /// closed (its replies would be lost anyway).
    fn staged(&mut self, out: &Arc<Outbox>, r: Result<bool, OutboxError>) {
        match r {
            Ok(true) => self.dirty.push(out.clone()),
            Ok(false) => {}
            Err(e @ OutboxError::Full { .. }) => {
                log::warn!("dispatcher: closing a client connection: {e}");
                out.close(e.to_string());
            }
            Err(OutboxError::Closed(why)) => {
                log::debug!("dispatcher: reply to a closed client dropped: {why}")
            }
        }
    }

    fn on_tick(&mut self) {
        let now = self.now();
        let wall = Instant::now();
        // Snapshots are cloned out of the registry only when new.
        let (views, dead_after, memservers) = {
            let s = lock(&self.state);
            let r = s.runtimes();
            (
                r.live_newer(wall, |id| self.d.snapshot_seq(id)),
                r.dead_after(),
                s.memservers_alive(wall),
            )
        };
        let memservers = u32::try_from(memservers).unwrap_or(u32::MAX);
        self.d.set_memservers(now, memservers);
        let live: HashMap<u32, u64> = views.iter().map(|v| (v.id, v.boot_id)).collect();
        // Runtimes that died or restarted: their links go.
        let gone: Vec<u32> = self
            .links
            .iter()
            .filter(|(id, l)| live.get(id) != Some(&l.boot_id))
            .map(|(&id, _)| id)
            .collect();
        // A host that vanishes silently (no reset, no FIN) is noticed here:
        // within the registry's dead-after (3 heartbeat intervals) plus a
        // tick. A closed or reset connection is noticed at once (LinkDown).
        for id in gone {
            self.links.remove(&id);
            self.controls.retain(|_, (g, _)| g.runtime != id);
            let why = if live.contains_key(&id) {
                "it restarted".to_string()
            } else {
                format!("it sent no heartbeat for over {dead_after:?}")
            };
            self.d.runtime_down(now, id, &why, &mut self.actions);
        }
        for v in &views {
            self.d.runtime_seen(
                now,
                v.id,
                v.boot_id,
                &v.shape,
                v.snapshot.as_ref().map(|s| (v.snapshot_seq, s)),
                &mut self.actions,
            );
            if self.relink_at.get(&v.id).is_some_and(|&t| wall < t) {
                continue;
            }
            if let std::collections::hash_map::Entry::Vacant(slot) = self.links.entry(v.id) {
                let out = Outbox::new(LINK_QUEUE_BYTES_MAX);
                let task = tokio::spawn(link(
                    v.id,
                    v.boot_id,
                    v.addr.clone(),
                    self.key.clone(),
                    out.clone(),
                    self.events.clone(),
                ))
                .abort_handle();
                slot.insert(Link {
                    boot_id: v.boot_id,
                    out,
                    task,
                });
            }
        }
        self.d.tick(now, &mut self.actions);
        let assignments = self.d.assignments();
        lock(&self.state).publish_assignments(self.d.policy().as_str(), assignments);
        self.metrics.observe_dispatcher(&self.d, self.held_bytes);
    }

    fn on_event(&mut self, ev: Event) {
        let now = self.now();
        match ev {
            Event::Request {
                client,
                client_id,
                model,
                slo_ms,
                priority,
                trace,
                input,
                permit,
            } => {
                let fail = |me: &mut Self, code, message: String, permit| {
                    let reply = RuntimeReply::Error {
                        id: client_id,
                        error: ErrorReply::new(code, message),
                    };
                    me.answer(&client, reply, Vec::new(), Some(permit));
                };
                let id = match self.resolve(&model) {
                    Ok(id) => id,
                    Err(e) => {
                        self.metrics.finished(UNRESOLVED_MODEL, Err(e.code));
                        return fail(self, e.code, e.message, permit);
                    }
                };
                if self.held_bytes + input.len() as u64 > HELD_INPUT_BYTES_MAX {
                    self.metrics.finished(&model, Err(ErrorCode::Busy));
                    return fail(
                        self,
                        ErrorCode::Busy,
                        format!(
                            "request {client_id} for {model}: the dispatcher holds {HELD_INPUT_BYTES_MAX} bytes of inputs \
                             already; retry later"
                        ),
                        permit,
                    );
                }
                self.held_bytes += input.len() as u64;
                // A GPU server that registered since the last tick is
                // learnt of now, so that a request right after its
                // registration (a client that waited for readiness) waits
                // for its link instead of finding no GPU server.
                if self.d.runtimes_known() == 0
                    && self
                        .early_sync
                        .is_none_or(|t| t.elapsed() >= EARLY_SYNC_MIN)
                {
                    self.early_sync = Some(Instant::now());
                    self.on_tick();
                }
                let t0 = Instant::now();
                let req = self.d.submit_with(
                    now,
                    id,
                    slo_ms.map(|s| s as f64),
                    priority,
                    &mut self.actions,
                );
                self.metrics.decision(t0.elapsed());
                // Its actions are carried out after this event, with the
                // input in place.
                self.inflight.insert(
                    req,
                    Inflight {
                        client,
                        client_id,
                        trace,
                        input,
                        permit: Some(permit),
                        model,
                    },
                );
            }
            Event::Reply {
                runtime,
                boot_id,
                reply,
                raw,
                frames,
            } => {
                if self.links.get(&runtime).map(|l| l.boot_id) != Some(boot_id) {
                    return; // a reply from a link already given up
                }
                self.on_reply(now, runtime, reply, &raw, frames);
            }
            Event::LinkUp { runtime, boot_id } => {
                if self.links.get(&runtime).map(|l| l.boot_id) == Some(boot_id) {
                    log::info!("dispatcher: link to runtime {runtime} up");
                    self.relink_at.remove(&runtime);
                    self.d.link_up(runtime);
                    self.d.route_waiting(now, &mut self.actions);
                }
            }
            Event::LinkDown {
                runtime,
                boot_id,
                why,
            } => {
                if self.links.get(&runtime).map(|l| l.boot_id) == Some(boot_id) {
                    log::warn!("dispatcher: link to runtime {runtime} down: {why}");
                    // What the dispatcher decided before it learnt of the
                    // loss is carried out first: a request it sent there
                    // this turn is then in flight on the lost runtime,
                    // which `runtime_down` sends again elsewhere. (Left
                    // for the end of the turn, that send found no link and
                    // failed `internal`, and the resend found nothing to
                    // send: seen about once in ten runs of tests/failover.)
                    self.flush();
                    self.links.remove(&runtime);
                    self.relink_at
                        .insert(runtime, Instant::now() + RELINK_BACKOFF);
                    self.controls.retain(|_, (g, _)| g.runtime != runtime);
                    self.d.runtime_down(now, runtime, &why, &mut self.actions);
                }
            }
        }
    }

    /// The dispatcher's id of `model`, from the catalog on first use.
    fn resolve(&mut self, model: &str) -> Result<u32, ErrorReply> {
        if let Some(id) = self.d.model_id(model) {
            return Ok(id);
        }
        if model.is_empty() || model.len() > NAME_BYTES_MAX {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                format!(
                    "a model name is 1..={NAME_BYTES_MAX} bytes, got {}",
                    model.len()
                ),
            ));
        }
        let entry = lock(&self.state).catalog().get(model)?;
        self.d.model(ModelMeta {
            name: entry.name.clone(),
            family: entry.family.clone(),
            bytes: entry.total_bytes,
        })
    }

    fn on_reply(
        &mut self,
        now: Micros,
        runtime: u32,
        reply: RuntimeReply,
        raw: &[u8],
        frames: Vec<Vec<u8>>,
    ) {
        let id = reply.id();
        if id & CONTROL_ID_BIT != 0 {
            let Some((gpu, what)) = self.controls.remove(&id) else {
                return;
            };
            match &reply {
                RuntimeReply::Error { error, .. } => {
                    log::warn!("dispatcher: {what} on {gpu} failed: {error}");
                    if what == "train" {
                        self.d.train_failed(now, gpu);
                    }
                }
                r => log::debug!("dispatcher: {what} on {gpu}: {r:?}"),
            }
            if what == "prefetch" {
                if let RuntimeReply::Prefetched {
                    model, path, ms, ..
                } = &reply
                {
                    self.d.prefetched(now, gpu, model, *path, *ms);
                }
                self.d.prefetch_done(now, gpu, None);
            }
            return;
        }
        if self.d.waits_to_be_sent(id) {
            // A reply for a request queued again (its runtime was lost):
            // it is answered once, when it runs where it waits now, and
            // its input stays held for that send. Replies on a link given
            // up never get here (dropped by boot id on arrival); this
            // keeps the input of any other such reply. (A request the
            // dispatcher no longer knows is answered below, as before.)
            log::debug!(
                "dispatcher: late reply from runtime {runtime} for request {id}, queued again \
                 elsewhere since: dropped"
            );
            return;
        }
        let Some(mut f) = self.inflight.remove(&id) else {
            log::debug!("dispatcher: reply for unknown request {id} from runtime {runtime}");
            // Given up on (past its deadline and grace), its device answers
            // after all: it works.
            if let RuntimeReply::Output { timing, .. } = &reply {
                let gpu = Gpu {
                    runtime,
                    device: timing.device,
                };
                self.d.answered_late(now, gpu);
            }
            return;
        };
        self.held_bytes -= f.input.len() as u64;
        let (completion, code) = match &reply {
            RuntimeReply::Output {
                timing, resident, ..
            } => (
                Completion {
                    timing: Some(timing),
                    resident,
                },
                None,
            ),
            RuntimeReply::Error { error, .. } => (Completion::default(), Some(error.code)),
            _ => (Completion::default(), Some(ErrorCode::Internal)),
        };
        let info = self.d.complete(now, id, &completion, &mut self.actions);
        let outcome = match (code, info.as_ref()) {
            (None, Some(i)) => Ok(i),
            (Some(c), _) => Err(c),
            (None, None) => Err(ErrorCode::Internal),
        };
        self.metrics.finished(&f.model, outcome);
        let permit = f.permit.take();
        // A native client gets the runtime's `Output` message as it came,
        // re-addressed: nothing in it is encoded again.
        let forward = match (&f.client, &reply, &info) {
            (ReplyTo::Conn(_), RuntimeReply::Output { trace, .. }, Some(info))
                if f.trace || trace.is_none() =>
            {
                readdress(raw, f.client_id, info)
            }
            _ => None,
        };
        if let (ReplyTo::Conn(out), Some((head, body, tail))) = (&f.client, forward) {
            let parts: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
            let r = out.stage_raw(&[&head, body, &tail], &parts, permit);
            self.staged(out, r);
            return;
        }
        let reply = match reply {
            RuntimeReply::Output {
                timing,
                outputs,
                trace,
                trace_truncated,
                resident,
                ..
            } => RuntimeReply::Output {
                id: f.client_id,
                timing,
                outputs,
                trace: if f.trace { trace } else { None },
                trace_truncated,
                resident,
                dispatch: info.clone(),
            },
            RuntimeReply::Error { error, .. } => RuntimeReply::Error {
                id: f.client_id,
                error,
            },
            other => RuntimeReply::Error {
                id: f.client_id,
                error: ErrorReply::new(
                    ErrorCode::Internal,
                    format!("runtime {runtime} answered an inference with {other:?}"),
                ),
            },
        };
        let frames = if code.is_none() { frames } else { Vec::new() };
        self.answer(&f.client, reply, frames, permit);
    }

    /// Carries out the dispatcher's actions.
    fn flush(&mut self) {
        let actions = std::mem::take(&mut self.actions);
        for a in actions {
            match a {
                Action::Send {
                    req,
                    gpu,
                    model,
                    budget_ms,
                    batch,
                } => self.send_infer(req, gpu, model, budget_ms, batch),
                Action::Fail { req, error } => self.fail(req, error),
                Action::Prefetch { gpu, model } => {
                    let id = self.control_id(gpu, "prefetch");
                    let msg = RuntimeRequest::Prefetch {
                        id,
                        model,
                        device: Some(gpu.device),
                    };
                    if self.send_link(gpu.runtime, &msg, &[]).is_err() {
                        self.controls.remove(&id);
                        let now = self.now();
                        self.d.prefetch_done(now, gpu, None);
                    }
                }
                Action::Evict { runtime, model } => {
                    let gpu = Gpu { runtime, device: 0 };
                    let id = self.control_id(gpu, "evict");
                    let msg = RuntimeRequest::Evict {
                        id,
                        model,
                        host_only: true,
                    };
                    if self.send_link(runtime, &msg, &[]).is_err() {
                        self.controls.remove(&id);
                    }
                }
                Action::Train { gpu, model } => {
                    let id = self.control_id(gpu, "train");
                    let msg = RuntimeRequest::Train {
                        id,
                        device: gpu.device,
                        model,
                    };
                    if self.send_link(gpu.runtime, &msg, &[]).is_err() {
                        self.controls.remove(&id);
                    }
                }
            }
        }
        if !self.actions.is_empty() {
            // Failing a send can queue more actions (the next request).
            self.flush();
        }
    }

    /// One `Infer` for a batch: `req` leads, its members follow in order,
    /// each with its own input frame. Ids on the link are the dispatcher's
    /// request ids, so every reply maps back to its own client.
    fn send_infer(
        &mut self,
        req: ReqId,
        gpu: Gpu,
        model: String,
        budget_ms: u64,
        batch: Vec<BatchMate>,
    ) {
        let mut ids = Vec::with_capacity(batch.len() + 1);
        let mut members = Vec::with_capacity(batch.len());
        let (mut trace, mut head_budget) = (false, budget_ms);
        let all = std::iter::once(BatchMate { req, budget_ms }).chain(batch);
        for m in all {
            // The dispatcher sends only requests it was given and not yet
            // answered; one missing here would be a bug, so it is left out
            // of the batch rather than sent without its input.
            let Some(f) = self.inflight.get(&m.req) else {
                log::error!(
                    "dispatcher: request {} to send is not held; left out",
                    m.req
                );
                continue;
            };
            if ids.is_empty() {
                (trace, head_budget) = (f.trace, m.budget_ms);
            } else {
                members.push(BatchMember {
                    id: m.req,
                    deadline_ms: Some(m.budget_ms),
                    trace: f.trace,
                });
            }
            ids.push(m.req);
        }
        let Some(&head) = ids.first() else {
            return;
        };
        // The catalog's version of the model now: a runtime whose compiled
        // plan is older refreshes it once (a redeploy), others never ask.
        let catalog_version = lock(&self.state)
            .catalog()
            .get(&model)
            .ok()
            .map(|e| e.version);
        let msg = RuntimeRequest::Infer {
            id: head,
            model,
            deadline_ms: Some(head_budget),
            trace,
            device: Some(gpu.device),
            batch: members,
            catalog_version,
        };
        let inputs: Vec<&[u8]> = ids
            .iter()
            .map(|id| self.inflight[id].input.as_slice())
            .collect();
        let sent = stage_link(&self.links, &mut self.dirty, gpu.runtime, &msg, &inputs);

        match sent {
            Ok(()) => {}
            // The link's task ended after queueing its LinkDown (it closes
            // its queue only on return): the batch is in flight on a lost
            // runtime, which `runtime_down` settles when that event arrives.
            Err(SendError::Closed) => {}
            Err(SendError::NoLink(why) | SendError::Full(why)) => {
                let now = self.now();
                for id in ids {
                    self.d
                        .complete(now, id, &Completion::default(), &mut self.actions);
                    self.fail(id, ErrorReply::new(ErrorCode::Internal, why.clone()));
                }
            }
        }
    }

    fn control_id(&mut self, gpu: Gpu, what: &'static str) -> u64 {
        self.next_control += 1;
        let id = CONTROL_ID_BIT | self.next_control;
        self.controls.insert(id, (gpu, what));
        id
    }

    /// Stages `req` and its input frames (one per request of a batched
    /// `Infer`, none for control requests) for `runtime`'s link; they are
    /// written at the end of this turn.
    fn send_link(
        &mut self,
        runtime: u32,
        req: &RuntimeRequest,
        inputs: &[&[u8]],
    ) -> Result<(), SendError> {
        stage_link(&self.links, &mut self.dirty, runtime, req, inputs)
    }

    fn fail(&mut self, req: ReqId, error: ErrorReply) {
        let Some(mut f) = self.inflight.remove(&req) else {
            return;
        };
        self.held_bytes -= f.input.len() as u64;
        self.metrics.finished(&f.model, Err(error.code));
        let reply = RuntimeReply::Error {
            id: f.client_id,
            error,
        };
        let permit = f.permit.take();
        self.answer(&f.client, reply, Vec::new(), permit);
    }
}

/// Stages a request for `runtime`'s link (see [`CoreTask::send_link`]).
fn stage_link(
    links: &HashMap<u32, Link>,
    dirty: &mut Vec<Arc<Outbox>>,
    runtime: u32,
    req: &RuntimeRequest,
    inputs: &[&[u8]],
) -> Result<(), SendError> {
    let Some(l) = links.get(&runtime) else {
        return Err(SendError::NoLink(format!("no link to runtime {runtime}")));
    };
    match l.out.stage_request(req, inputs) {
        Ok(first) => {
            if first {
                dirty.push(l.out.clone());
            }
            Ok(())
        }
        Err(e @ OutboxError::Full { .. }) => Err(SendError::Full(format!(
            "the link to runtime {runtime}: {e}"
        ))),
        Err(OutboxError::Closed(_)) => Err(SendError::Closed),
    }
}

/// The runtime's `Output` message `raw` re-addressed to the client: its
/// id replaced by `client_id` and `info` added as `dispatch`, the rest as
/// the runtime encoded it. Returns (head, body, tail), the message being
/// their concatenation; `None` when `raw` is not laid out as the protocol's
/// encoder writes an `Output` (it is then encoded again).
fn readdress<'a>(
    raw: &'a [u8],
    client_id: u64,
    info: &DispatchInfo,
) -> Option<(Vec<u8>, &'a [u8], Vec<u8>)> {
    const PREFIX: &[u8] = br#"{"reply":"output","id":"#;
    let rest = raw.strip_prefix(PREFIX)?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let body = rest[digits..].strip_suffix(b"}")?;
    // A runtime never sets `dispatch`; one that did (or a name holding the
    // word) would make a duplicate key: encode again instead.
    if digits == 0 || !body.starts_with(b",") || body.windows(10).any(|w| w == br#""dispatch""#) {
        return None;
    }
    let mut head = Vec::with_capacity(PREFIX.len() + 20);
    head.extend_from_slice(PREFIX);
    head.extend_from_slice(client_id.to_string().as_bytes());
    let mut tail = Vec::with_capacity(192);
    tail.extend_from_slice(br#","dispatch":"#);
    serde_json::to_writer(&mut tail, info).expect("dispatch records always serialise");
    tail.push(b'}');
    Some((head, body, tail))
}

/// Why a message could not be queued on a runtime's link.
enum SendError {
    /// No link to that runtime (never linked, or given up).
    NoLink(String),
    /// Its queue is full: the runtime is not keeping up.
    Full(String),
    /// Its task ended, after queueing the LinkDown that says why.
    Closed,
}

// ---------------------------------------------------------------------------
// Links to runtimes.
// ---------------------------------------------------------------------------

async fn link(
    runtime: u32,
    boot_id: u64,
    addr: String,
    key: ClusterKey,
    out: Arc<Outbox>,
    events: mpsc::Sender<Event>,
) {
    let down = |why: String| Event::LinkDown {
        runtime,
        boot_id,
        why,
    };
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, async {
        let mut s = TcpStream::connect(&addr).await.map_err(|e| e.to_string())?;
        let _ = s.set_nodelay(true);
        handshake::client(&mut s, &key, Role::Control)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(s)
    })
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            let _ = events
                .send(down(format!("cannot connect to {addr}: {e}")))
                .await;
            return;
        }
        Err(_) => {
            let _ = events
                .send(down(format!(
                    "connecting to {addr} took over {CONNECT_TIMEOUT:?}"
                )))
                .await;
            return;
        }
    };
    if events
        .send(Event::LinkUp { runtime, boot_id })
        .await
        .is_err()
    {
        return;
    }
    // Requests are written by the core task (the outbox); replies are read
    // buffered, with few syscalls.
    let (rd, wr) = stream.into_split();
    out.connect(wr);
    let mut rd = BufReader::new(rd);
    let reader_events = events.clone();
    let mut reader = tokio::spawn(async move {
        loop {
            match read_reply(&mut rd).await {
                Ok((reply, raw, frames)) => {
                    let ev = Event::Reply {
                        runtime,
                        boot_id,
                        reply,
                        raw,
                        frames,
                    };
                    if reader_events.send(ev).await.is_err() {
                        return String::from("the dispatcher stopped");
                    }
                }
                Err(e) => return e,
            }
        }
    });
    // The reader goes with the link, however the link's task ends (aborted
    // included): a host that vanished never closes the connection.
    let _reader_guard = AbortOnDrop(reader.abort_handle());
    // Writes what the socket did not take from the core task at once; the
    // link ends when either direction fails (the dispatcher dropping the
    // link aborts this task).
    let why = tokio::select! {
        r = &mut reader => r.unwrap_or_else(|e| format!("reader task failed: {e}")),
        e = out.drain() => {
            reader.abort();
            format!("cannot write to {addr}: {e}")
        }
    };
    let _ = events.send(down(why)).await;
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One reply: the message, as decoded and as it came, and its frames.
pub(crate) async fn read_reply<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<(RuntimeReply, Vec<u8>, Vec<Vec<u8>>), String> {
    let (reply, raw): (RuntimeReply, _) = match wire::read_frame(r, CONTROL_FRAME_BYTES_MAX).await {
        Ok(Some((FrameKind::Message, payload))) => (
            wire::decode_message(&payload).map_err(|e| format!("not a runtime reply: {e}"))?,
            payload,
        ),
        Ok(Some((kind, _))) => {
            return Err(format!("expected a reply message, got a {kind:?} frame"))
        }
        Ok(None) => return Err("the runtime closed the connection".into()),
        Err(e) => return Err(e.to_string()),
    };
    let mut frames = Vec::new();
    if let RuntimeReply::Output { outputs, .. } = &reply {
        if outputs.len() > RUNTIME_OUTPUTS_MAX {
            return Err(format!(
                "{} outputs announced, at most {RUNTIME_OUTPUTS_MAX}",
                outputs.len()
            ));
        }
        for name in outputs {
            match wire::read_frame(r, CONTROL_FRAME_BYTES_MAX).await {
                Ok(Some((FrameKind::WriteChunk, b))) => frames.push(b),
                Ok(Some((kind, _))) => {
                    return Err(format!(
                        "expected output frame {name}, got a {kind:?} frame"
                    ))
                }
                Ok(None) => return Err("the runtime closed the connection mid-reply".into()),
                Err(e) => return Err(e.to_string()),
            }
        }
    }
    Ok((reply, raw, frames))
}

// ---------------------------------------------------------------------------
// Client connections.
// ---------------------------------------------------------------------------

async fn client_conn(
    mut stream: TcpStream,
    peer: SocketAddr,
    key: ClusterKey,
    events: mpsc::Sender<Event>,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    match handshake::server(&mut stream, &key).await {
        Ok(Role::Control) => {}
        Ok(role) => {
            log::warn!("refused client {peer}: asked for a {role:?} connection; the dispatcher serves control");
            return;
        }
        Err(e) => {
            log::warn!("refused client {peer}: {e}");
            return;
        }
    }
    // Replies are written by the core task (the outbox); what the socket
    // does not take at once, by this connection's writer task.
    let (rd, wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let out = Outbox::new(CLIENT_QUEUE_BYTES_MAX);
    out.connect(wr);
    let writer_out = out.clone();
    let mut writer = tokio::spawn(async move { writer_out.drain().await });
    let _writer_guard = AbortOnDrop(writer.abort_handle());
    let in_flight = Arc::new(Semaphore::new(CLIENT_IN_FLIGHT_MAX));
    let reply_now = |out: &Arc<Outbox>, id: u64, code, message: String| {
        let reply = RuntimeReply::Error {
            id,
            error: ErrorReply::new(code, message),
        };
        if out.stage_reply(&reply, &[], None).is_ok() {
            out.flush();
        }
    };
    let tx = &out;
    loop {
        let permit = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            _ = &mut writer => break,
            p = in_flight.clone().acquire_owned() => p.expect("never closed"),
        };
        let frame = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            _ = &mut writer => break,
            f = wire::read_frame(&mut rd, CONTROL_FRAME_BYTES_MAX) => f,
        };
        let payload = match frame {
            Ok(None) => break,
            Ok(Some((FrameKind::Message, p))) => p,
            Ok(Some((kind, p))) => {
                reply_now(
                    tx,
                    0,
                    ErrorCode::BadRequest,
                    format!(
                        "expected a request message, got a {kind:?} frame of {} bytes",
                        p.len()
                    ),
                );
                continue;
            }
            Err(e) => {
                log::warn!("closing client {peer}: {e}");
                reply_now(tx, 0, ErrorCode::BadRequest, format!("{e}; closing"));
                break;
            }
        };
        let req = match wire::decode_message::<RuntimeRequest>(&payload) {
            Ok(r) => r,
            Err(e) => {
                reply_now(tx, 0, ErrorCode::BadRequest, format!("not a request: {e}"));
                continue;
            }
        };
        let RuntimeRequest::Infer {
            id,
            model,
            deadline_ms,
            trace,
            device,
            ..
        } = req
        else {
            reply_now(
                tx,
                req_id(&req),
                ErrorCode::BadRequest,
                "the dispatcher's client port takes infer requests only; stats, evict, prefetch and train go to a runtime"
                    .into(),
            );
            continue;
        };
        // The input frame follows every Infer, whatever we make of it.
        let input = match wire::read_frame(&mut rd, CONTROL_FRAME_BYTES_MAX).await {
            Ok(Some((FrameKind::WriteChunk, b))) => b,
            Ok(Some((kind, _))) => {
                reply_now(
                    tx,
                    id,
                    ErrorCode::BadRequest,
                    format!(
                        "request {id}: expected its input frame, got a {kind:?} frame; closing"
                    ),
                );
                break;
            }
            Ok(None) => break,
            Err(e) => {
                reply_now(
                    tx,
                    id,
                    ErrorCode::BadRequest,
                    format!("request {id}: {e}; closing"),
                );
                break;
            }
        };
        if device.is_some() {
            reply_now(
                tx,
                id,
                ErrorCode::BadRequest,
                format!("request {id}: `device` is chosen by the dispatcher; leave it out"),
            );
            continue;
        }
        let ev = Event::Request {
            client: ReplyTo::Conn(out.clone()),
            client_id: id,
            model,
            slo_ms: deadline_ms,
            // The native protocol has no priority: the default level.
            priority: 0,
            trace,
            input,
            permit,
        };
        if events.send(ev).await.is_err() {
            break;
        }
    }
    // Let replies still owed reach the client, briefly: each holds a
    // permit until it is written.
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        in_flight.acquire_many(CLIENT_IN_FLIGHT_MAX as u32),
    )
    .await;
}

pub(crate) fn req_id(r: &RuntimeRequest) -> u64 {
    match r {
        RuntimeRequest::Infer { id, .. }
        | RuntimeRequest::Prefetch { id, .. }
        | RuntimeRequest::Train { id, .. }
        | RuntimeRequest::Stats { id }
        | RuntimeRequest::Evict { id, .. }
        | RuntimeRequest::TrainStage { id, .. }
        | RuntimeRequest::TrainStageStart { id, .. }
        | RuntimeRequest::TrainStageStop { id, .. } => *id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::proto::{ServePath, TimingMsg};

    fn output(resident: Vec<String>) -> RuntimeReply {
        RuntimeReply::Output {
            id: 12345,
            timing: TimingMsg {
                queue_ms: 0.5,
                fetch_ms: 0.0,
                h2d_ms: 0.0,
                compute_ms: 3.0,
                total_ms: 3.5,
                path: ServePath::DeviceResident,
                simulated: false,
                device: 1,
                fetched_bytes: 0,
                train_yield_ms: 0.0,
                batch_requests: 2,
                warmup: false,
            },
            outputs: vec!["logits".into()],
            trace: None,
            trace_truncated: false,
            resident,
            dispatch: None,
        }
    }

    fn info() -> DispatchInfo {
        DispatchInfo {
            runtime: 3,
            device: 1,
            slo_ms: 100.0,
            estimated_ms: 4.0,
            dispatch_queue_ms: 0.25,
            total_ms: 5.0,
        }
    }

    #[test]
    fn a_forwarded_output_is_the_runtimes_re_addressed() {
        let reply = output(vec!["a".into(), "b".into()]);
        let raw = wire::encode_message(&reply);
        let (head, body, tail) = readdress(&raw, 7, &info()).expect("the encoder's layout");
        let msg = [head.as_slice(), body, tail.as_slice()].concat();
        let got: RuntimeReply = wire::decode_message(&msg).unwrap();
        let mut want = reply.clone();
        if let RuntimeReply::Output { id, dispatch, .. } = &mut want {
            *id = 7;
            *dispatch = Some(info());
        }
        assert_eq!(got, want);
    }

    #[test]
    fn what_is_not_laid_out_as_expected_is_encoded_again() {
        // A model named like the field would make a duplicate key.
        let raw = wire::encode_message(&output(vec!["dispatch".into()]));
        assert!(readdress(&raw, 7, &info()).is_none());
        let raw = wire::encode_message(&RuntimeReply::Error {
            id: 1,
            error: ErrorReply::new(ErrorCode::Busy, "x"),
        });
        assert!(readdress(&raw, 7, &info()).is_none());
        assert!(readdress(br#"{"reply":"output","id":,"x":1}"#, 7, &info()).is_none());
    }
}
