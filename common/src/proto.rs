//! Control-plane messages (JSON in [`crate::wire`] message frames).
//!
//! Every request gets exactly one reply, in order, on the same connection.
//! A request that cannot be served gets [`ErrorReply`] naming what was wrong;
//! the connection stays usable unless the framing itself broke.

use serde::{Deserialize, Serialize};

use crate::train_spec::JobSpec;

/// Why a request failed, for callers that branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadRequest,
    UnknownModel,
    UnknownExtent,
    Full,
    ChecksumMismatch,
    Busy,
    /// The request's deadline passed before it could be served.
    DeadlineExceeded,
    /// Refused at admission: no GPU could finish it before its deadline.
    /// Sent at once, before any work is done; the message says the
    /// earliest finish the dispatcher could offer.
    Rejected,
    ShuttingDown,
    /// No GPU server can take the request: the one it was queued for or
    /// running on was lost (the message names it and why) and no other
    /// can meet its deadline, or none is up. Sent at once, not at the
    /// deadline.
    Unavailable,
    /// The server does not offer what was asked (a data path it does not serve).
    Unsupported,
    Internal,
}

impl ErrorCode {
    /// The wire name (`BadRequest` -> `bad_request`), also the `status`
    /// label of every service's metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::UnknownModel => "unknown_model",
            ErrorCode::UnknownExtent => "unknown_extent",
            ErrorCode::Full => "full",
            ErrorCode::ChecksumMismatch => "checksum_mismatch",
            ErrorCode::Busy => "busy",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
            ErrorCode::Rejected => "rejected",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Internal => "internal",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
}

impl ErrorReply {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorReply {
            code,
            message: message.into(),
        }
    }
}

/// Requests on a memory server's control connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum MemserverRequest {
    /// Reserve `bytes` of the arena for `owner` (a model name, for accounting).
    /// Replies `Allocated`. The extent is writable and not yet readable.
    Alloc {
        bytes: u64,
        owner: String,
    },
    /// Ends the writes into an extent (sent as write-chunk frames after
    /// `Alloc`): the server checks the bytes against `checksum` and makes the
    /// extent readable. Replies `Committed`, or `ChecksumMismatch` and the
    /// extent stays unreadable. Any earlier rejected write chunk is reported here.
    Commit {
        offset: u64,
        checksum: String,
    },
    /// Releases an extent; its space is reused once in-flight reads finish.
    /// With `owner`, only an extent allocated for that owner: a free that
    /// names another owner (the offset was freed and reused since) is
    /// refused and frees nothing.
    Free {
        offset: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<String>,
    },
    Stats,
    /// Which one-sided data paths this server offers besides tcp (always
    /// served on its port). Replies `DataPaths`.
    DataPaths,
    /// Connects an RC queue pair for verbs reads: `qp` is the client's
    /// `QpInfo` (56 bytes, hex). Replies `VerbsConnected` with the server's,
    /// which names the arena's rkey, address and length. The server's queue
    /// pair lives as long as this control connection.
    VerbsConnect {
        qp: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum MemserverReply {
    Allocated { offset: u64 },
    Committed { offset: u64 },
    Freed { offset: u64 },
    Stats(MemserverStats),
    DataPaths(DataPaths),
    VerbsConnected { qp: String },
    Error(ErrorReply),
}

/// The one-sided data paths a memory server serves (tcp is always served).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPaths {
    /// Its arena over libfabric, when it serves one.
    pub fabric: Option<FabricOffer>,
    /// Its arena over RDMA verbs, when it serves one.
    pub verbs: Option<VerbsOffer>,
}

/// What a client needs to `fi_read` a memory server's arena.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FabricOffer {
    /// The provider the server's endpoint runs (`tcp;ofi_rxm`, `efa`, ...);
    /// a client must run the same one.
    pub provider: String,
    /// The endpoint's address (`fi_getname`), hex.
    pub name: String,
    /// The arena registration's remote key.
    pub key: u64,
    /// The remote address of arena offset 0 (0 under `FI_MR_VIRT_ADDR`-less
    /// providers, which address by offset).
    pub base: u64,
    /// Arena bytes.
    pub len: u64,
}

/// The RDMA device a memory server reads are served from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerbsOffer {
    pub device: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemserverStats {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub largest_free_bytes: u64,
    pub extents: u64,
    pub connections: u64,
    pub bytes_served: u64,
    pub reads_served: u64,
}

/// Where one copy of a slice lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    pub memserver: u32,
    /// The memory server's address, as it registered (host:port).
    pub addr: String,
    /// Offset of the slice in that memory server's arena.
    pub offset: u64,
}

/// A contiguous piece of a group stored on one memory server (and replicas).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    /// Offset of the slice within its group.
    pub group_offset: u64,
    pub len: u64,
    /// xxh3-64 of the slice bytes, hex ([`crate::checksum::to_hex`]).
    pub checksum: String,
    /// First entry is the primary; the others are replicas.
    pub replicas: Vec<Location>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLocation {
    pub index: u32,
    pub bytes: u64,
    /// xxh3-64 of the whole group, hex.
    pub checksum: String,
    pub slices: Vec<Slice>,
}

/// The catalog's entry for a deployed model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelEntry {
    pub name: String,
    pub family: String,
    pub total_bytes: u64,
    /// Sharding strategy and replication it was deployed with.
    pub strategy: String,
    pub replication: u32,
    pub groups: Vec<GroupLocation>,
    /// Set by the controller's catalog when the entry is stored: it grows
    /// with every put, so a newer deployment of a name has a larger version.
    #[serde(default)]
    pub version: u64,
    /// The package manifest (layers, params, groups), so that GPU servers
    /// need nothing but the catalog to run the model.
    pub manifest: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSummary {
    pub name: String,
    pub family: String,
    pub total_bytes: u64,
    pub groups: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemserverInfo {
    pub id: u32,
    pub addr: String,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub alive: bool,
    pub last_heartbeat_ms_ago: u64,
}

/// Requests on the controller's metadata (catalog) port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControllerRequest {
    /// A memory server announces itself. `boot_id` changes on every start:
    /// a new one means the server's arena (and every slice on it) is gone.
    RegisterMemserver {
        addr: String,
        capacity_bytes: u64,
        boot_id: u64,
    },
    Heartbeat {
        memserver: u32,
        boot_id: u64,
        used_bytes: u64,
    },
    ListMemservers,
    /// Adds or replaces a model; replies `Put` with the entry it replaced.
    PutModel {
        entry: Box<ModelEntry>,
    },
    GetModel {
        name: String,
    },
    RemoveModel {
        name: String,
    },
    ListModels,
    /// A GPU server (runtime) announces itself: its request address, how
    /// many devices it serves and with which executor. `boot_id` changes on
    /// every start. Replies `RuntimeRegistered`.
    RegisterRuntime {
        addr: String,
        devices: u32,
        executor: String,
        boot_id: u64,
        /// Device ordinals (what `Infer.device` names); default 0..devices.
        #[serde(default)]
        device_ids: Vec<u32>,
        /// Host cache bytes, shared by the devices (0: not reported).
        #[serde(default)]
        cache_bytes: u64,
        /// Parameter memory per device (0: not reported).
        #[serde(default)]
        device_bytes: u64,
        /// Models one device keeps resident at most (0: not reported).
        #[serde(default)]
        resident_models_max: u32,
    },
    /// A runtime's periodic liveness report; `queued` is the requests waiting
    /// in its device queues (for the dispatcher). Replies `HeartbeatOk`.
    RuntimeHeartbeat {
        runtime: u32,
        boot_id: u64,
        queued: u64,
        /// What the runtime holds now; corrects the dispatcher's view.
        #[serde(default)]
        snapshot: Option<RuntimeSnapshot>,
    },
    ListRuntimes,
    /// The subscriber channel: which GPU does what, as the policy decided.
    /// Replies `Assignments`; `epoch` grows on every change, so a
    /// subscriber polls and acts only when it moved.
    Assignments,
    /// Submits a distributed training job ([`crate::train_spec`]). The
    /// controller checks it against the catalog (the model's layer count),
    /// registers it and places its P x S stage workers on GPUs the
    /// inference policy leaves idle, or keeps it `pending` (saying why)
    /// until enough devices are free. Replies `TrainSubmitted`.
    TrainSubmit {
        spec: Box<JobSpec>,
    },
    /// One job (`job`: its id), or every job the controller keeps.
    /// Replies `TrainJobs`.
    TrainStatus {
        #[serde(default)]
        job: Option<String>,
    },
    /// Stops a job: a pending one at once; a placed one once each of its
    /// workers that ever reported has been told so (by the reply to its
    /// next report, its GPU server's answer to its `TrainStageStop`, or its
    /// runtime's loss). Waiting `TrainGroupReady` asks are answered with
    /// `stop`. Replies `TrainStopped`.
    TrainStop {
        job: String,
    },
    /// A stage worker's report after each iteration: `iteration` is the
    /// number of iterations it completed, `fwd_bwd_s` that iteration's
    /// forward and backward time, `loss` the mean loss (the last stage
    /// only), `samples` the samples it processed. Replies `TrainReported`;
    /// its `stop` tells the worker to stop.
    TrainReport {
        job: String,
        pipeline: u32,
        stage: u32,
        iteration: u64,
        fwd_bwd_s: f64,
        #[serde(default)]
        loss: Option<f64>,
        samples: u64,
    },
    /// A drained stage worker of pipeline 0 wrote its layers' weights as
    /// group `group.index` (= `stage`) of the checkpoint model `model`
    /// (generation `generation`, after `iteration` iterations; see
    /// [`DrainOrder`]); `layer_checksums`: per layer of the stage, in
    /// order, the checksum of its params' f32 bytes. Replies
    /// `TrainReported`.
    TrainCheckpointed {
        job: String,
        generation: u64,
        pipeline: u32,
        stage: u32,
        iteration: u64,
        model: String,
        group: GroupLocation,
        layer_checksums: Vec<u64>,
    },
    /// A stage worker cannot go on: the job fails naming this stage and the
    /// reason. Replies `TrainReported` (with `stop`).
    TrainFailed {
        job: String,
        pipeline: u32,
        stage: u32,
        reason: String,
    },
    /// A stage worker finished `iteration`'s backward passes (and its local
    /// optimizer step where the sync mode steps first) and asks with whom
    /// to average this stage's weights. The controller's group scheduler
    /// for (job, stage) answers once the group closes (all pipelines for
    /// `allreduce`; SD-Pipe's partial reduce for `preduce`; a seeded
    /// partner for `adpsgd`), so the reply may take as long as the group's
    /// deadline. Replies `TrainGroup`. One outstanding per worker.
    TrainGroupReady {
        job: String,
        generation: u64,
        pipeline: u32,
        stage: u32,
        iteration: u64,
    },
}

/// A runtime's state as it reports it in heartbeats.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RuntimeSnapshot {
    pub devices: Vec<DeviceSnapshot>,
    /// Models whose every group is in the host cache (at most
    /// [`SNAPSHOT_MODELS_MAX`]; `host_cached_truncated` when cut).
    pub host_cached: Vec<String>,
    #[serde(default)]
    pub host_cached_truncated: bool,
}

/// Most model names one snapshot list carries.
pub const SNAPSHOT_MODELS_MAX: usize = 4096;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceSnapshot {
    pub device: u32,
    /// Requests queued or running.
    pub queued: u64,
    /// Models resident on the device, most recently used first.
    pub resident: Vec<String>,
    /// The training job this device runs between requests, if any.
    #[serde(default)]
    pub training: Option<String>,
    /// Recent training iteration time (0 when not training).
    #[serde(default)]
    pub train_iteration_ms: f64,
}

/// What one GPU is assigned to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuRole {
    Inference,
    Training,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuAssignment {
    pub runtime: u32,
    pub device: u32,
    pub role: GpuRole,
    /// The model(s) the policy placed on it (inference), or the training job.
    pub models: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum ControllerReply {
    Registered {
        memserver: u32,
        heartbeat_interval_ms: u64,
    },
    HeartbeatOk,
    Memservers {
        memservers: Vec<MemserverInfo>,
    },
    Put {
        replaced: Option<Box<ModelEntry>>,
    },
    Model {
        entry: Box<ModelEntry>,
    },
    Removed {
        entry: Box<ModelEntry>,
    },
    Models {
        models: Vec<ModelSummary>,
    },
    RuntimeRegistered {
        runtime: u32,
        heartbeat_interval_ms: u64,
    },
    Runtimes {
        runtimes: Vec<RuntimeInfo>,
    },
    Assignments {
        epoch: u64,
        policy: String,
        gpus: Vec<GpuAssignment>,
    },
    /// The job as registered: its id, state and, once placed, where each
    /// stage runs.
    TrainSubmitted {
        job: Box<TrainJobStatus>,
    },
    /// Jobs, oldest first.
    TrainJobs {
        jobs: Vec<TrainJobStatus>,
    },
    /// The job after a stop: `stopped`, or `stopping` while workers finish
    /// their iteration.
    TrainStopped {
        job: Box<TrainJobStatus>,
    },
    /// A report was taken. `stop`: the worker stops now (the job is
    /// stopping, stopped, failed or finished). `drain`: the job is
    /// re-partitioning; the worker stops once it completed
    /// `drain.after_iteration` iterations (writing its checkpoint first
    /// when `drain.checkpoint` names one). `free`: in the reply to the
    /// `TrainCheckpointed` that completed a periodic checkpoint, the
    /// extents of the one it replaced in the catalog, for the worker to
    /// free (the new entry is visible by then).
    TrainReported {
        job: String,
        state: TrainJobState,
        stop: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        drain: Option<DrainOrder>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        free: Vec<Location>,
    },
    /// The group a `TrainGroupReady` joined: the pipelines whose stage
    /// replicas average their weights now, sorted, the asker included (a
    /// group of one: go on alone). `stop`: the job ends; do not average.
    TrainGroup {
        job: String,
        stage: u32,
        iteration: u64,
        members: Vec<u32>,
        stop: bool,
    },
    Error(ErrorReply),
}

/// Where a training job is in its life.
///
/// ```text
/// pending -> placing -> running <-> repartitioning
///    |          |          |  \-> finished
///    |          +----------+--> stopping -> stopped
///    +--> stopped    (any placed state) --> failed
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainJobState {
    /// Registered, waiting for devices.
    Pending,
    /// Devices chosen and stage workers asked to start; not every stage has
    /// reported yet.
    Placing,
    /// Every stage has reported.
    Running,
    /// Moving layers between stages (DynPipe); workers restart on the new
    /// partition.
    Repartitioning,
    /// Stop asked; waiting for workers to hear it.
    Stopping,
    Stopped,
    /// A stage worker failed or its GPU server was lost.
    Failed {
        pipeline: u32,
        stage: u32,
        reason: String,
    },
    /// Every stage completed the spec's iterations.
    Finished,
}

impl TrainJobState {
    /// The state's name (`failed` for every failure).
    pub fn name(&self) -> &'static str {
        match self {
            TrainJobState::Pending => "pending",
            TrainJobState::Placing => "placing",
            TrainJobState::Running => "running",
            TrainJobState::Repartitioning => "repartitioning",
            TrainJobState::Stopping => "stopping",
            TrainJobState::Stopped => "stopped",
            TrainJobState::Failed { .. } => "failed",
            TrainJobState::Finished => "finished",
        }
    }

    /// Stopped, failed or finished: nothing runs and nothing changes.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            TrainJobState::Stopped | TrainJobState::Failed { .. } | TrainJobState::Finished
        )
    }
}

/// A training job as `train status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainJobStatus {
    /// `<name>-<n>`.
    pub id: String,
    pub state: TrainJobState,
    /// Why a pending job waits (its last placement attempt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    pub spec: Box<JobSpec>,
    /// The model's layer count and catalog version when it was submitted.
    pub layers: u32,
    pub catalog_version: u64,
    /// Layers per stage now (re-partitioning changes it).
    pub partition: Vec<u32>,
    /// Grows with every re-partitioning; stage assignments carry it.
    pub generation: u64,
    pub submitted_ms_ago: u64,
    /// Time in the current state.
    pub state_ms_ago: u64,
    /// Every stage worker, pipeline-major (`pipeline * stages + stage`).
    pub stages: Vec<StageStatus>,
    /// Its workers' `TrainGroupReady` asks waiting for their sync group now.
    #[serde(default)]
    pub group_asks_waiting: u32,
    /// DynPipe's last re-partitioning decision (`dynamic.enabled`): where
    /// the controller would move layers and what it predicts; `None` until
    /// the straggler monitor triggers one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repartition: Option<RepartitionDecision>,
    /// The last re-partitioning's checkpoint (written and reloaded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointStatus>,
    /// The job's last complete checkpoint in the catalog: the periodic one
    /// (`checkpoint_every`) or a re-partitioning's, whichever came last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint: Option<LastCheckpoint>,
}

/// A complete checkpoint of a training job: every stage of pipeline 0
/// wrote its part and the controller put the model in its catalog.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastCheckpoint {
    /// The checkpoint model (`<job>-ckpt` for a periodic one, `<job>-g<n>`
    /// for a re-partitioning's) and its catalog version.
    pub model: String,
    pub catalog_version: u64,
    /// The generation that wrote it, and the iterations it had completed.
    pub generation: u64,
    pub iteration: u64,
    /// The checksum (xxh3 over the per-layer checksums, in layer order) of
    /// the params written.
    pub written: u64,
    /// Each group's checksum (one group per stage), as in the catalog
    /// entry.
    pub group_checksums: Vec<String>,
}

impl std::fmt::Display for LastCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (catalog version {}) after iteration {}",
            self.model, self.catalog_version, self.iteration
        )
    }
}

/// A re-partitioning's drain, as the reply to a report tells a worker of
/// the current generation: stop after completing `after_iteration`
/// iterations (every pipeline at the same one, so replicas stay
/// consistent); a worker of pipeline 0 first writes its layers' weights
/// as group `stage` of the checkpoint model `checkpoint`, whose layout is
/// the job's model's with one group per stage of `partition` (the
/// partition drained), and says so with `TrainCheckpointed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainOrder {
    pub after_iteration: u64,
    pub generation: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    pub partition: Vec<u32>,
}

/// A re-partitioning's checkpoint as `train status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointStatus {
    /// The checkpoint model in the catalog, and its version once put.
    pub model: String,
    #[serde(default)]
    pub catalog_version: Option<u64>,
    /// The generation drained, and the iterations it completed.
    pub generation: u64,
    pub after_iteration: u64,
    /// The checksum (xxh3 over the per-layer checksums, in layer order) of
    /// the params written, once every stage wrote its part.
    #[serde(default)]
    pub written: Option<u64>,
    /// The same over the params each pipeline of the next generation
    /// loaded, by pipeline, once every worker of that pipeline was ready.
    #[serde(default)]
    pub loaded: Vec<Option<u64>>,
}

/// A re-partitioning DynPipe's monitor triggered and the re-partitioner
/// chose (the controller's decision; applying it is the workers' drain,
/// checkpoint and reload).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepartitionDecision {
    /// The partition generation it was decided in.
    pub generation: u64,
    /// Iterations completed when the monitor decided (a window boundary).
    pub decided_at_iteration: u64,
    /// The iteration before which the new partition would take over
    /// (`decided_at_iteration + dynamic.delay`).
    pub at_iteration: u64,
    /// Each stage's last window time over its baseline (capped, finite).
    pub ratios: Vec<f64>,
    /// The stages past a threshold.
    pub stragglers: Vec<u32>,
    /// Layers per stage now, and chosen.
    pub old_partition: Vec<u32>,
    pub new_partition: Vec<u32>,
    /// The predicted steady-state time per microbatch of the new partition
    /// and of the old one, under the measured slowdowns (seconds).
    pub predicted_s_per_microbatch: f64,
    pub current_s_per_microbatch: f64,
    /// How the stages' times were spread over their layers: `flops` (in
    /// proportion to each layer's forward FLOPs from the manifest) or
    /// `layers: <why>` (evenly, when the FLOPs could not be counted).
    pub layer_costs: String,
}

/// One stage worker of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageStatus {
    pub pipeline: u32,
    pub stage: u32,
    pub layers: LayerRange,
    /// Where it runs; `None` while the job is pending.
    #[serde(default)]
    pub placement: Option<StagePlacement>,
    /// Iterations completed, as last reported.
    #[serde(default)]
    pub iteration: Option<u64>,
    #[serde(default)]
    pub loss: Option<f64>,
    /// Samples per second over the reports kept (wall time between them).
    #[serde(default)]
    pub samples_per_s: Option<f64>,
    /// Mean forward + backward time per iteration over the reports kept.
    #[serde(default)]
    pub fwd_bwd_s: Option<f64>,
    #[serde(default)]
    pub last_report_ms_ago: Option<u64>,
    /// Reports received in all.
    #[serde(default)]
    pub reports: u64,
}

/// Layers `first..end` of the manifest's `layers` list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRange {
    pub first: u32,
    pub end: u32,
}

/// The GPU a stage worker runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagePlacement {
    pub runtime: u32,
    /// The runtime's request address.
    pub addr: String,
    pub device: u32,
    /// What the device was doing when it was chosen.
    pub usage: DeviceUse,
}

/// A device's use as the job placement sees it, best for training first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceUse {
    /// The inference policy gave it to training.
    Training,
    /// An inference GPU with nothing resident or queued.
    Idle,
    /// An inference GPU serving models; training there yields to them.
    Serving,
}

impl DeviceUse {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceUse::Training => "training",
            DeviceUse::Idle => "idle",
            DeviceUse::Serving => "serving",
        }
    }
}

/// Another stage worker a worker exchanges with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagePeer {
    pub pipeline: u32,
    pub stage: u32,
    pub runtime: u32,
    /// The runtime's request address.
    pub addr: String,
    pub device: u32,
}

/// The workers a stage worker talks to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagePeers {
    /// The previous stage of its pipeline (activations in, gradients out);
    /// `None` for stage 0.
    pub prev: Option<StagePeer>,
    /// The next stage (activations out, gradients in); `None` for the last.
    pub next: Option<StagePeer>,
    /// The same stage in every other pipeline, by pipeline (gradient sync).
    pub same_stage: Vec<StagePeer>,
}

/// Everything a stage worker needs to run its part of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageAssignment {
    pub job: String,
    /// The partition's generation: a worker drops messages of an older one.
    pub generation: u64,
    pub pipeline: u32,
    pub stage: u32,
    /// The device of the runtime this is sent to.
    pub device: u32,
    /// The model's catalog name and the version every worker loads.
    pub model: String,
    pub catalog_version: u64,
    /// This stage's layers.
    pub layers: LayerRange,
    /// Layers per stage of the whole pipeline (this generation).
    pub partition: Vec<u32>,
    /// The first iteration to run (0, or where a re-partitioning resumes).
    pub start_iteration: u64,
    pub peers: StagePeers,
    /// The job as submitted: optimizer, batch and microbatches, sync mode,
    /// data, iterations, interference (a worker applies the slowdowns and
    /// `hetero_s` that name its stage and pipeline), checkpoints.
    pub spec: Box<JobSpec>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeInfo {
    pub id: u32,
    pub addr: String,
    pub devices: u32,
    pub executor: String,
    /// Requests waiting in its device queues at the last heartbeat.
    pub queued: u64,
    pub alive: bool,
    pub last_heartbeat_ms_ago: u64,
}

// ---------------------------------------------------------------------------
// The runtime's (GPU server's) request port.
//
// A request is one message frame ([`RuntimeRequest`]); `Infer` is followed
// by exactly one write-chunk frame whose whole payload is the input tensor
// as `.npy` bytes (bounded by `limits::CONTROL_FRAME_BYTES_MAX`). Requests
// are pipelined: a client may send many before reading, and replies carry
// the request's `id` and may come back in any order. An `Output` reply
// message is followed by one write-chunk frame per output (`.npy` bytes), in
// the order of `outputs`; every other reply is the message alone.
// ---------------------------------------------------------------------------

/// Most trace entries one `Output` reply carries; a longer trace is cut at
/// the end and `trace_truncated` is set.
pub const TRACE_ENTRIES_MAX: usize = 16384;

/// Most outputs one model may return in a reply.
pub const RUNTIME_OUTPUTS_MAX: usize = 64;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum RuntimeRequest {
    /// Runs `model` on the input frame that follows. `deadline_ms`: give up
    /// (an error reply) when the request waited this long in the queue.
    /// `trace`: return the request's pipeline trace with the outputs.
    /// `device`: run it on this device (the dispatcher's choice); default:
    /// the device that holds the model, else the least loaded.
    ///
    /// On the controller's client port the same request is routed by the
    /// dispatcher: `deadline_ms` is then the request's latency SLO (default:
    /// the model family's `slo_ms` in controller.json) and `device` must be
    /// left out.
    Infer {
        id: u64,
        model: String,
        #[serde(default)]
        deadline_ms: Option<u64>,
        #[serde(default)]
        trace: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<u32>,
        /// Dynamic batching: more requests for `model` that run in one
        /// batch with this one (at most [`BATCH_MEMBERS_MAX`]). One input
        /// frame follows per request, this one's first, then the members'
        /// in order; every request gets its own reply under its own id,
        /// with its rows of the outputs.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        batch: Vec<BatchMember>,
        /// The catalog version of `model` the sender resolved (the
        /// dispatcher's); a runtime whose compiled plan is older refreshes it
        /// once. `None`: the runtime's own view is used.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        catalog_version: Option<u64>,
    },
    /// Cache-in without running: fetch `model` into the host cache and, with
    /// `device`, make it resident there. Replies `Prefetched`.
    Prefetch {
        id: u64,
        model: String,
        #[serde(default)]
        device: Option<u32>,
    },
    /// Starts (`model`: a CNN package in the catalog) or stops (`None`) the
    /// background training job of `device`. Training runs SGD iterations
    /// while the device queue is empty and yields to inference at the next
    /// iteration boundary. Replies `Training`.
    Train {
        id: u64,
        device: u32,
        #[serde(default)]
        model: Option<String>,
    },
    /// Host cache and per-device counters.
    Stats { id: u64 },
    /// Cache-out: drops `model` from the host cache and, unless
    /// `host_only`, from every device (freed once the requests using it
    /// finish). The controller's cache-out is `host_only`: a model resident
    /// on a device keeps serving from there, whatever its host copy.
    Evict {
        id: u64,
        model: String,
        #[serde(default)]
        host_only: bool,
    },
    /// Starts a training job's stage worker on `assignment.device` (the
    /// controller's job placement). The worker reports to the controller
    /// (`ControllerRequest::TrainReport`) after every iteration and stops
    /// when a reply says so. Replies `Training` (`model`: the job id) once
    /// it started, or an error.
    TrainStage {
        id: u64,
        assignment: Box<StageAssignment>,
    },
    /// Stops the job's stage worker at its next iteration boundary; a
    /// worker of another `generation` is left alone. Replies `Training`
    /// (`model`: `None`, `iterations`: the worker's).
    TrainStageStop {
        id: u64,
        job: String,
        pipeline: u32,
        stage: u32,
        generation: u64,
    },
    /// The second step of starting a job: every worker answered its
    /// `TrainStage` with `TrainStageReady` (its data address), so each now
    /// learns its neighbours' and replicas' data addresses, connects its
    /// stage links (it dials `next`; `prev` dials it) and starts iterating
    /// from the assignment's `start_iteration`. Replies `TrainStageStarted`.
    TrainStageStart {
        id: u64,
        job: String,
        generation: u64,
        pipeline: u32,
        stage: u32,
        #[serde(default)]
        prev: Option<DataPeer>,
        #[serde(default)]
        next: Option<DataPeer>,
        /// This stage in every pipeline, this worker included, by pipeline.
        replicas: Vec<DataPeer>,
    },
}

/// A stage worker's training data endpoint (`runtime::dist`'s listener):
/// stage links and the replicas' all-reduce rings connect there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPeer {
    pub pipeline: u32,
    pub stage: u32,
    /// `pipeline * stages + stage`: the worker id the listener checks.
    pub worker: u32,
    /// `host:port` of its data listener.
    pub data_addr: String,
}

/// The `u64` job key of the training data plane's wire headers and
/// handshakes (`runtime::dist`): a stable hash of the job id, so a message
/// of another job (or an earlier one of the same name) is refused.
pub fn train_job_key(job: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(job.as_bytes())
}

/// Most requests one batched `Infer` carries besides its own.
pub const BATCH_MEMBERS_MAX: usize = 63;

/// Another request in a batched `Infer`: its id and its own deadline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchMember {
    pub id: u64,
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    #[serde(default)]
    pub trace: bool,
}

/// Which stages a request went through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServePath {
    /// Fetched from the memory servers, uploaded, run.
    Cold,
    /// Found in the host cache: uploaded, run.
    HostCached,
    /// Resident on the device: run.
    DeviceResident,
}

/// A request's timing breakdown. Stage spans overlap in a pipelined run, so
/// they do not add up to `total_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimingMsg {
    /// Arrival at the server to the start of the pipeline.
    pub queue_ms: f64,
    pub fetch_ms: f64,
    pub h2d_ms: f64,
    pub compute_ms: f64,
    /// Arrival to outputs.
    pub total_ms: f64,
    pub path: ServePath,
    /// Outputs are not computed (`sim` executor: zeros).
    pub simulated: bool,
    /// The device that ran it.
    pub device: u32,
    /// Bytes this request read from memory servers.
    pub fetched_bytes: u64,
    /// Time the device spent finishing a training iteration before it took
    /// this request (0 when it was not training).
    #[serde(default)]
    pub train_yield_ms: f64,
    /// Requests that ran in the same batch (1: alone).
    #[serde(default = "one")]
    pub batch_requests: u32,
    /// The device's first inference since the runtime started. It pays
    /// one-time costs: on an H200 the cuda executor's first run of a
    /// ResNet-152 took 150 ms against about 5 ms after (CUDA loads
    /// kernels lazily, pools grow). Not a service time to learn from.
    #[serde(default, skip_serializing_if = "is_false")]
    pub warmup: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn one() -> u32 {
    1
}

/// One event of a request's pipeline, `at_ms` after the pipeline started.
/// `event` is one of `host_ready`, `upload_start`, `uploaded`, `gate_opened`
/// (`index`: the group), `uploads_complete` (every copy done on the device),
/// `layer_start`, `layer_end` (`index`: the layer), `group_ready` (the
/// program's own gate event; `index`: the group), `compute_start`,
/// `compute_end`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEntry {
    pub at_ms: f64,
    pub event: String,
    #[serde(default)]
    pub index: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCacheStats {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub models: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Models a device evicted that were fetched back in the background.
    #[serde(default)]
    pub refills: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceStats {
    pub device: u32,
    /// Requests waiting or running on this device.
    pub queued: u64,
    pub served: u64,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub models: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Time spent computing or loading (requests, prefetches and training).
    #[serde(default)]
    pub busy_ms: f64,
    /// The background training job, if any.
    #[serde(default)]
    pub training: Option<String>,
    /// Training iterations this device ran, every job.
    #[serde(default)]
    pub train_iterations: u64,
    /// Moving average of the current job's iteration time (0: none yet).
    #[serde(default)]
    pub train_iteration_ms: f64,
    /// Time the device's serial path (its worker) spent on requests and
    /// prefetches beyond the executor's compute and copy time: parsing,
    /// resolving, batching, encoding and handing over replies.
    #[serde(default)]
    pub serial_overhead_ms: f64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RuntimeStats {
    pub executor: String,
    pub cache: HostCacheStats,
    pub devices: Vec<DeviceStats>,
    pub connections: u64,
    /// Requests answered with outputs.
    pub served: u64,
    /// Requests answered with an error.
    pub errors: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum RuntimeReply {
    /// Followed by one write-chunk frame per name in `outputs`.
    Output {
        id: u64,
        timing: TimingMsg,
        outputs: Vec<String>,
        /// Present when the request asked for it.
        #[serde(default)]
        trace: Option<Vec<TraceEntry>>,
        #[serde(default)]
        trace_truncated: bool,
        /// Models resident on the device that ran it, after it ran, most
        /// recently used first (the dispatcher's live view).
        #[serde(default)]
        resident: Vec<String>,
        /// Set by the controller's dispatcher on replies it routed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dispatch: Option<DispatchInfo>,
    },
    Prefetched {
        id: u64,
        model: String,
        /// `Cold` when it was fetched, `HostCached` when only uploaded,
        /// `DeviceResident` when there was nothing to do.
        path: ServePath,
        /// How long the load took (the fetch when `Cold`, the upload to
        /// the device), not counting its wait behind the device's queue.
        /// A host-cache prefetch's is its whole time, waits included.
        ms: f64,
    },
    Training {
        id: u64,
        device: u32,
        /// The job now running (`None`: stopped).
        model: Option<String>,
        /// Iterations the previous job ran.
        iterations: u64,
    },
    /// A `TrainStage` worker is set up: its data listener is bound at
    /// `data_addr` and its layers are loaded; it waits for
    /// `TrainStageStart`.
    TrainStageReady {
        id: u64,
        job: String,
        generation: u64,
        pipeline: u32,
        stage: u32,
        data_addr: String,
        /// Per layer of the stage, in order, the checksum of the params
        /// loaded (their f32 bytes): how a re-partitioning checks the
        /// reload against the checkpoint.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        layer_checksums: Vec<u64>,
    },
    /// A `TrainStageStart` took: links connected, iterations running.
    TrainStageStarted {
        id: u64,
        job: String,
        generation: u64,
        pipeline: u32,
        stage: u32,
    },
    Stats {
        id: u64,
        stats: RuntimeStats,
    },
    /// `host_cache`: it was in the host cache; `devices`: how many devices
    /// held it.
    Evicted {
        id: u64,
        model: String,
        host_cache: bool,
        devices: u32,
    },
    /// `id` is 0 when the request was too malformed to carry one.
    Error {
        id: u64,
        error: ErrorReply,
    },
}

/// How the controller's dispatcher handled a request it routed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DispatchInfo {
    pub runtime: u32,
    pub device: u32,
    /// The request's latency objective.
    pub slo_ms: f64,
    /// The dispatcher's estimate of the finish time at admission, from arrival.
    pub estimated_ms: f64,
    /// Time spent waiting in the dispatcher's queue for the device.
    pub dispatch_queue_ms: f64,
    /// Arrival at the dispatcher to the reply leaving it.
    pub total_ms: f64,
}

impl RuntimeReply {
    pub fn id(&self) -> u64 {
        match self {
            RuntimeReply::Output { id, .. }
            | RuntimeReply::Prefetched { id, .. }
            | RuntimeReply::Training { id, .. }
            | RuntimeReply::TrainStageReady { id, .. }
            | RuntimeReply::TrainStageStarted { id, .. }
            | RuntimeReply::Stats { id, .. }
            | RuntimeReply::Evicted { id, .. }
            | RuntimeReply::Error { id, .. } => *id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_code_names_are_the_wire_names() {
        use ErrorCode::*;
        for c in [
            BadRequest,
            UnknownModel,
            UnknownExtent,
            Full,
            ChecksumMismatch,
            Busy,
            DeadlineExceeded,
            Rejected,
            ShuttingDown,
            Unavailable,
            Unsupported,
            Internal,
        ] {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
    }

    #[test]
    fn messages_round_trip_through_json() {
        let r = MemserverRequest::Alloc {
            bytes: 10,
            owner: "m".into(),
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(s, r#"{"op":"alloc","bytes":10,"owner":"m"}"#);
        assert_eq!(serde_json::from_str::<MemserverRequest>(&s).unwrap(), r);
        let e = ControllerReply::Error(ErrorReply::new(ErrorCode::UnknownModel, "no model x"));
        let s = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<ControllerReply>(&s).unwrap(), e);
        let r = RuntimeRequest::Infer {
            id: 3,
            model: "m".into(),
            deadline_ms: None,
            trace: false,
            device: None,
            batch: Vec::new(),
            catalog_version: None,
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<RuntimeRequest>(&s).unwrap(), r);
        // Optional fields may be left out.
        assert_eq!(
            serde_json::from_str::<RuntimeRequest>(r#"{"op":"infer","id":3,"model":"m"}"#).unwrap(),
            r
        );
        let e = RuntimeReply::Error {
            id: 9,
            error: ErrorReply::new(ErrorCode::Busy, "queue full"),
        };
        let s = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<RuntimeReply>(&s).unwrap(), e);
        assert_eq!(e.id(), 9);
    }

    fn spec() -> JobSpec {
        JobSpec::from_json(
            r#"{"name": "j", "model": "m", "optimizer": {"sgd": {"lr": 0.1}}, "batch": 4,
                "microbatches": 2, "pipelines": 2, "stages": 2, "iterations": 5}"#,
        )
        .unwrap()
    }

    #[test]
    fn training_messages_round_trip_and_optional_fields_may_be_left_out() {
        let reqs = [
            ControllerRequest::TrainSubmit {
                spec: Box::new(spec()),
            },
            ControllerRequest::TrainStatus { job: None },
            ControllerRequest::TrainStop { job: "j-1".into() },
            ControllerRequest::TrainReport {
                job: "j-1".into(),
                pipeline: 1,
                stage: 0,
                iteration: 3,
                fwd_bwd_s: 0.25,
                loss: Some(2.5),
                samples: 4,
            },
            ControllerRequest::TrainFailed {
                job: "j-1".into(),
                pipeline: 0,
                stage: 1,
                reason: "out of memory".into(),
            },
            ControllerRequest::TrainCheckpointed {
                job: "j-1".into(),
                generation: 0,
                pipeline: 0,
                stage: 1,
                iteration: 12,
                model: "j-1-g1".into(),
                group: GroupLocation {
                    index: 1,
                    bytes: 4096,
                    checksum: "00000000000000ff".into(),
                    slices: Vec::new(),
                },
                layer_checksums: vec![1, u64::MAX],
            },
        ];
        for r in reqs {
            let s = serde_json::to_string(&r).unwrap();
            assert_eq!(
                serde_json::from_str::<ControllerRequest>(&s).unwrap(),
                r,
                "{s}"
            );
        }
        assert_eq!(
            serde_json::from_str::<ControllerRequest>(r#"{"op":"train_status"}"#).unwrap(),
            ControllerRequest::TrainStatus { job: None }
        );
        let report = r#"{"op":"train_report","job":"j-1","pipeline":0,"stage":0,"iteration":1,
                         "fwd_bwd_s":0.5,"samples":4}"#;
        match serde_json::from_str::<ControllerRequest>(report).unwrap() {
            ControllerRequest::TrainReport { loss, .. } => assert_eq!(loss, None),
            r => panic!("{r:?}"),
        }
        // Messages from before training jobs decode as they did.
        assert_eq!(
            serde_json::from_str::<ControllerRequest>(r#"{"op":"assignments"}"#).unwrap(),
            ControllerRequest::Assignments
        );

        let failed = TrainJobState::Failed {
            pipeline: 0,
            stage: 2,
            reason: "runtime 1 lost".into(),
        };
        assert_eq!(
            serde_json::to_string(&failed).unwrap(),
            r#"{"failed":{"pipeline":0,"stage":2,"reason":"runtime 1 lost"}}"#
        );
        assert_eq!(
            serde_json::to_string(&TrainJobState::Running).unwrap(),
            r#""running""#
        );
        assert!(failed.is_terminal() && !TrainJobState::Stopping.is_terminal());
        let reply = ControllerReply::TrainReported {
            job: "j-1".into(),
            state: failed,
            stop: true,
            drain: None,
            free: Vec::new(),
        };
        let s = serde_json::to_string(&reply).unwrap();
        assert_eq!(serde_json::from_str::<ControllerReply>(&s).unwrap(), reply);
        assert!(!s.contains("drain"), "{s}");
        let reply = ControllerReply::TrainReported {
            job: "j-1".into(),
            state: TrainJobState::Repartitioning,
            stop: false,
            drain: Some(DrainOrder {
                after_iteration: 12,
                generation: 0,
                checkpoint: Some("j-1-g1".into()),
                partition: vec![3, 2],
            }),
            free: Vec::new(),
        };
        let s = serde_json::to_string(&reply).unwrap();
        assert_eq!(serde_json::from_str::<ControllerReply>(&s).unwrap(), reply);

        let peer = |pipeline, stage| StagePeer {
            pipeline,
            stage,
            runtime: 3,
            addr: "10.0.0.3:10009".into(),
            device: stage,
        };
        let stage = RuntimeRequest::TrainStage {
            id: 7,
            assignment: Box::new(StageAssignment {
                job: "j-1".into(),
                generation: 0,
                pipeline: 0,
                stage: 1,
                device: 1,
                model: "m".into(),
                catalog_version: 4,
                layers: LayerRange { first: 3, end: 6 },
                partition: vec![3, 3],
                start_iteration: 0,
                peers: StagePeers {
                    prev: Some(peer(0, 0)),
                    next: None,
                    same_stage: vec![peer(1, 1)],
                },
                spec: Box::new(spec()),
            }),
        };
        let s = serde_json::to_string(&stage).unwrap();
        assert!(s.starts_with(r#"{"op":"train_stage","id":7,"#), "{s}");
        assert_eq!(serde_json::from_str::<RuntimeRequest>(&s).unwrap(), stage);
        let stop = RuntimeRequest::TrainStageStop {
            id: 8,
            job: "j-1".into(),
            pipeline: 0,
            stage: 1,
            generation: 0,
        };
        let s = serde_json::to_string(&stop).unwrap();
        assert_eq!(serde_json::from_str::<RuntimeRequest>(&s).unwrap(), stop);
    }
}
