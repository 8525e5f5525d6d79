//! Training stage workers: the runtime's side of a distributed training
//! job (P pipelines x S stages, PipeDream 1F1B, replicas of a stage
//! averaging their weights).
//!
//! Life cycle of one worker (one per device at most, at most
//! [`STAGE_WORKERS_PER_SERVER_MAX`] per runtime), each step a request of the
//! job's coordinator (the controller):
//!
//! 1. `TrainStage` ([`train_stage`]): the assignment is checked
//!    ([`assignment`]), the device reserved, and the worker's thread
//!    started; it loads the stage ([`load`]: catalog entry, host cache over
//!    the data path, `StageModel`, data listener) and answers
//!    `TrainStageReady` with its data address. The same assignment again is
//!    answered the same way (a retried request); another one for a taken
//!    device is refused by name.
//! 2. `TrainStageStart` ([`train_stage_start`]): the worker dials `next`,
//!    takes the link `prev` dials, sets up its replicas' collective, answers
//!    `TrainStageStarted` and iterates ([`run`]). A start for no worker of
//!    that job and generation is refused by name. A ready worker that gets
//!    no start within [`START_TIMEOUT`] ends (and tells the controller).
//! 3. Each iteration: 1F1B over the microbatches ([`schedule`], [`routing`],
//!    [`links`]), the local SGD step, the sync of the spec's mode, then
//!    `TrainReport` ([`report`]); a `stop` in the reply, the spec's last
//!    iteration, or a `TrainStageStop` ([`train_stage_stop`], answered
//!    `Training` once the worker ended) ends it at that boundary. Runtime
//!    shutdown aborts every worker mid-wait and joins its thread.
//!    A reply may instead order a drain (a re-partitioning): the worker
//!    stops once it completed the order's iteration, a worker of pipeline
//!    0 first writing its layers to the memory servers as its part of the
//!    checkpoint ([`checkpoint`]) and telling the controller
//!    (`TrainCheckpointed`). With the spec's `checkpoint_every`, a worker
//!    of pipeline 0 also writes its part of the job's periodic checkpoint
//!    (`<job>-ckpt`) every that many iterations, after the report, and
//!    goes on; the answer to the part that completes one hands that
//!    worker the replaced checkpoint's extents to free.
//! 4. A link, collective, compute or controller error ends the worker and
//!    sends `TrainFailed` naming the stage and the reason (unless the worker
//!    was already told to stop, when an error from a neighbour that stopped
//!    first is part of stopping); its neighbours fail on their own links.
//!
//! Sync modes ([`sync`]; after every iteration, the local step first in all
//! of them, so the comparison isolates the grouping):
//!
//! * `allreduce`: every pipeline's replica of the stage averages its
//!   weights (`params_flat`: learnable params and BatchNorm running
//!   statistics; momentum buffers stay local) by ring all-reduce: model
//!   averaging after each local step. The group is all P pipelines; the
//!   controller is not asked.
//! * `preduce` (SD-Pipe) and `adpsgd` (AD-PSGD): `TrainGroupReady` to the
//!   controller's group scheduler, then the same averaging with the members
//!   of the returned group (a group of one goes on alone; `stop` ends the
//!   worker). `iteration` there counts iterations completed, as in reports.
//! * `hetpipe` and the `adam` optimizer are refused (`Unsupported`).
//!
//! The data is the spec's synthetic source ([`data`]), drawn on every stage
//! that needs it; interference is injected by the workers it names
//! ([`interference`]).
//!
//! Sharing the device with inference: every forward, backward, step and
//! weight copy holds the device's lock ([`super::device_lock`]), which the
//! device's inference worker takes with priority per task; a request waits
//! for at most one training op, and training yields between ops. This is
//! finer than the controller's inference/training split assumes (its
//! `policy::training` and the dispatcher budget one background *iteration*
//! of delay per request on a training GPU): the heartbeat reports a stage
//! worker's job as the device's training and its longest op as the
//! iteration time, so the dispatcher budgets what a request can really
//! wait. Stage workers compute with the CPU training code
//! ([`crate::train`]) whatever the device's executor.

pub(crate) mod assignment;
mod checkpoint;
pub(crate) mod data;
mod error;
mod interference;
mod links;
mod load;
mod report;
mod requests;
mod routing;
mod run;
mod schedule;
mod sync;

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::Sender;
use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{DataPeer, ErrorCode, RuntimeReply, StageAssignment};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::worker::{self, Outgoing};

pub(crate) use requests::{train_stage, train_stage_start, train_stage_stop};

/// Stage workers one runtime runs at once (each holds one device).
pub const STAGE_WORKERS_PER_SERVER_MAX: usize = 16;
/// Commands (a start) waiting for one worker's thread.
pub const STAGE_COMMANDS_MAX: usize = 4;
/// How long a ready worker waits for its `TrainStageStart`.
pub const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a worker waits for a neighbour's next message: a neighbour's
/// op, its share of the device under inference, a straggler's sleep.
pub const LINK_RECV_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a send waits for a credit (the window is the pipeline depth,
/// so a healthy pipeline never waits here).
pub const LINK_SEND_TIMEOUT: Duration = Duration::from_secs(120);
/// Bounds dialling the next stage (connect and opening).
pub const LINK_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a starting worker waits for the previous stage to dial it.
pub const LINK_ACCEPT_TIMEOUT: Duration = Duration::from_secs(30);
/// Bounds one socket write on a link.
pub const LINK_IO_TIMEOUT: Duration = Duration::from_secs(60);
/// Bounds building a replicas' ring (a member that never joins).
pub const COLLECTIVE_SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Bounds one read or write of an all-reduce (a member that hangs).
pub const COLLECTIVE_IO_TIMEOUT: Duration = Duration::from_secs(60);
/// Bounds connecting to the controller and each report's reply.
pub const CONTROLLER_TIMEOUT: Duration = Duration::from_secs(10);
/// Bounds a `TrainGroupReady`'s reply (the group scheduler's wait).
pub const GROUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a `TrainStageStop` reply waits for the worker to end (it
/// ends at its iteration boundary); after it, the reply goes anyway and
/// the stop stands.
pub const STOP_REPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a waiting worker looks at its abort flag.
pub const ABORT_POLL: Duration = Duration::from_millis(50);
/// The longest straggler sleep (`interference.hetero_s`) a worker takes:
/// a quarter of its neighbours' receive timeout.
pub const HETERO_S_LIMIT: Duration = Duration::from_secs(30);
/// Iteration losses a worker keeps for its status.
pub const LOSS_HISTORY_MAX: usize = 1024;

const _: () = assert!(HETERO_S_LIMIT.as_secs() * 4 <= LINK_RECV_TIMEOUT.as_secs());
const _: () = assert!(STAGE_COMMANDS_MAX >= 1);
const _: () = assert!(STAGE_WORKERS_PER_SERVER_MAX <= super::DEVICES_MAX);

/// What stage workers need from the runtime's configuration.
#[derive(Clone)]
pub(crate) struct StageConfig {
    pub key: ClusterKey,
    /// The controller's metadata port (reports, groups, failures).
    pub controller: String,
    /// Data listeners bind here (the runtime's listen IP), port 0.
    pub bind_ip: IpAddr,
    /// The host peers dial (the runtime's advertised host).
    pub data_host: String,
}

/// Which worker: the job, its partition's generation, its place.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct StageKey {
    pub job: String,
    pub generation: u64,
    pub pipeline: u32,
    pub stage: u32,
}

impl StageKey {
    fn of(a: &StageAssignment) -> Self {
        StageKey {
            job: a.job.clone(),
            generation: a.generation,
            pipeline: a.pipeline,
            stage: a.stage,
        }
    }
}

impl std::fmt::Display for StageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "job {} generation {} pipeline {} stage {}",
            self.job, self.generation, self.pipeline, self.stage
        )
    }
}

/// Where a worker is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagePhase {
    Loading,
    /// Loaded, listener bound, waiting for `TrainStageStart`.
    Ready,
    Running,
    Ended,
}

/// How a worker ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageEnd {
    /// It ran the spec's iterations.
    Finished,
    /// It was told to stop (a report's reply, `TrainStageStop`, shutdown).
    Stopped(String),
    /// It could not go on; the reason `TrainFailed` carried.
    Failed(String),
}

/// A stage worker as [`RuntimeMonitor::stage_workers`](super::RuntimeMonitor::stage_workers) shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct StageWorkerStatus {
    pub job: String,
    pub generation: u64,
    pub pipeline: u32,
    pub stage: u32,
    pub device: u32,
    pub phase: StagePhase,
    /// The data listener's `host:port`, once loaded.
    pub data_addr: Option<String>,
    /// Iterations of the job completed (counting from 0, so a worker that
    /// started at `start_iteration` reports from there).
    pub iterations: u64,
    /// The last stage's mean loss of each iteration it ran (the last
    /// `LOSS_HISTORY_MAX`); empty on other stages.
    pub losses: Vec<f64>,
    /// xxh3-64 of the stage's `params_flat` (its f32 values' bytes) after
    /// the last iteration's sync: replicas that averaged together hold
    /// equal checksums.
    pub params_checksum: Option<u64>,
    /// The same before that sync (after the local step): replicas differ
    /// there, having trained on different samples.
    pub params_checksum_before_sync: Option<u64>,
    /// The longest forward or backward of the last iteration (what an
    /// inference request may wait behind), ms.
    pub op_ms_max: f64,
    /// Per layer of the stage, xxh3-64 of the params loaded (what the
    /// ready answer carries).
    pub layer_checksums: Vec<u64>,
    pub end: Option<StageEnd>,
}

/// What a worker's thread and the runtime share.
pub(crate) struct Control {
    /// Stop at the next iteration boundary.
    pub stop: AtomicBool,
    /// Stop now, mid-wait (runtime shutdown).
    pub abort: AtomicBool,
    status: Mutex<StageWorkerStatus>,
    ended: Condvar,
}

impl Control {
    pub fn status(&self) -> MutexGuard<'_, StageWorkerStatus> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the end (the last thing the thread does) and wakes waiters.
    pub fn end(&self, end: StageEnd) {
        let mut s = self.status();
        s.phase = StagePhase::Ended;
        s.end = Some(end);
        drop(s);
        self.ended.notify_all();
    }

    /// Waits up to `timeout` for the end; the iterations completed.
    fn wait_end(&self, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        let mut s = self.status();
        while s.phase != StagePhase::Ended {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .ended
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        s.iterations
    }
}

/// Where a reply goes: the connection that asked, and its in-flight slot.
pub(crate) struct Reply {
    pub id: u64,
    pub tx: mpsc::Sender<Outgoing>,
    pub permit: Option<OwnedSemaphorePermit>,
}

impl Reply {
    pub fn send(mut self, reply: RuntimeReply) {
        let out = Outgoing {
            reply,
            frames: Vec::new(),
            permit: self.permit.take(),
            spent: Vec::new(),
        };
        // The connection may be gone; the reply goes nowhere then.
        let _ = self.tx.blocking_send(out);
    }

    pub fn error(self, code: ErrorCode, message: String) {
        let id = self.id;
        let out = worker::error(id, code, message);
        self.send(out.reply);
    }
}

/// The peers of a `TrainStageStart`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Peers {
    pub prev: Option<DataPeer>,
    pub next: Option<DataPeer>,
    pub replicas: Vec<DataPeer>,
}

pub(crate) enum Command {
    Start { peers: Peers, reply: Reply },
}

/// One worker as the registry holds it.
struct Handle {
    key: StageKey,
    assignment: Arc<StageAssignment>,
    control: Arc<Control>,
    commands: Sender<Command>,
    /// The peers it started with, once started.
    started: Mutex<Option<Peers>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Handle {
    fn ended(&self) -> bool {
        self.control.status().phase == StagePhase::Ended
    }

    fn join(&self) {
        let t = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t {
            if t.join().is_err() {
                log::error!("stage worker {} panicked", self.key);
            }
        }
    }
}

/// The runtime's stage workers: at most one per device.
pub(crate) struct StageWorkers {
    config: StageConfig,
    /// By device index.
    slots: Mutex<Vec<Option<Arc<Handle>>>>,
    closed: AtomicBool,
}

impl StageWorkers {
    pub fn new(config: StageConfig, devices: usize) -> Self {
        StageWorkers {
            config,
            slots: Mutex::new(vec![None; devices]),
            closed: AtomicBool::new(false),
        }
    }

    fn slots(&self) -> MutexGuard<'_, Vec<Option<Arc<Handle>>>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every worker's status, by device.
    pub fn statuses(&self) -> Vec<StageWorkerStatus> {
        self.slots()
            .iter()
            .flatten()
            .map(|h| h.control.status().clone())
            .collect()
    }

    /// The worker on device `index`, while it has not ended.
    pub fn running_on(&self, index: usize) -> Option<StageWorkerStatus> {
        let slots = self.slots();
        let h = slots.get(index)?.as_ref()?;
        let s = h.control.status();
        (s.phase != StagePhase::Ended).then(|| s.clone())
    }

    fn find(&self, job: &str, pipeline: u32, stage: u32) -> Option<Arc<Handle>> {
        self.slots()
            .iter()
            .flatten()
            .find(|h| h.key.job == job && h.key.pipeline == pipeline && h.key.stage == stage)
            .cloned()
    }

    /// Refuses new workers and aborts every running one mid-wait (runtime
    /// shutdown); [`join_all`](Self::join_all) then waits for their threads.
    pub fn abort_all(&self) {
        self.closed.store(true, Ordering::Relaxed);
        for h in self.slots().iter().flatten() {
            h.control.abort.store(true, Ordering::Relaxed);
        }
    }

    /// Joins every worker's thread (after [`abort_all`](Self::abort_all)).
    pub fn join_all(&self) {
        let handles: Vec<Arc<Handle>> = self.slots().iter_mut().filter_map(Option::take).collect();
        for h in handles {
            h.control.abort.store(true, Ordering::Relaxed);
            h.join();
        }
    }
}
