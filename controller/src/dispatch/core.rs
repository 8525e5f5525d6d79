//! The dispatcher's decisions, with no IO: requests in, actions out.
//!
//! [`Dispatcher`] owns the view of every GPU (what is resident, what each
//! host caches, what is queued and outstanding, whether it trains), the
//! cost model and the policy. The network layer ([`super::net`]) feeds it
//! arrivals, replies, runtime changes and ticks, and carries out the
//! [`Action`]s it returns: send a request to a GPU, fail one with an
//! explicit status, prefetch, evict, start or stop training.
//!
//! **Invariant:** every submitted request ends in exactly one `Send` (as its
//! head or as a member of its batch) that is later `complete`d, or in
//! exactly one `Fail`. Nothing is dropped silently. A `Send` to a runtime
//! that [`Dispatcher::runtime_down`] then reports lost is void: the request
//! is sent again elsewhere (at most once after it was in flight) or failed
//! `unavailable`.
//!
//! Under the `slo` policy the dispatcher also forms batches: when a GPU has
//! room it takes the head of its EDF queue and coalesces queued requests for
//! the same model into one `Send`, as long as the batch and every request
//! still queued behind it meet their deadlines on the cost model. Another
//! model's batch may go first when that makes no queued request late
//! (switch-aware order): by default the one of least estimated device time
//! per request among the head's batch and the resident models' batches (a
//! resident model's batch before a load; a batch of four before a request
//! alone), or, with `efficient_order` off, a resident model's batch when
//! the head's model must be loaded.
//!
//! Requests carry a priority (the Open Inference Protocol's: 1 is the
//! highest level, larger is lower, 0 the default and lowest). Under `slo`,
//! a request of higher priority than the EDF head runs first when that
//! makes no queued request late; and one that no GPU can admit in time
//! takes the place of queued requests of lower priority, the lowest (then
//! the latest deadline) dropped first, each failed `rejected` naming why.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use distmind_common::proto::{
    DispatchInfo, ErrorCode, ErrorReply, GpuAssignment, GpuRole, RuntimeSnapshot, ServePath,
    TimingMsg, BATCH_MEMBERS_MAX,
};

use super::gpus::{GpuState, Gpus, Resident};
use super::link::{self, LinkLoad, LoadMark};
use super::sets::{IdMap, IdSet, ModelSet};
use crate::policy::cost::{CostModel, LoadCost, ModelMeta, Priors};
use crate::policy::distmind::{DistMindConfig, DistMindPolicy};
use crate::policy::edf::{EdfQueue, Slot};
use crate::policy::training::TrainingJob;
use crate::policy::{Balancer, Ewma, Gpu, Micros, PolicyKind, Where};
use crate::runtimes::RuntimeShape;

/// A request's handle inside the dispatcher.
pub type ReqId = u64;

/// Requests one GPU has outstanding at its runtime under the `slo` policy:
/// enough to keep the device busy across a reply's round trip, few enough
/// that the order is the dispatcher's (EDF), not the runtime's FIFO.
pub const SLO_WINDOW_DEFAULT: u32 = 2;
/// The original load balancer's bound on outstanding requests per GPU.
pub const LOR_OUTSTANDING_MAX: u32 = 8;
/// Most requests queued at the dispatcher for one GPU.
pub const GPU_QUEUE_MAX: usize = 256;
/// Most requests the `distmind` policy holds waiting for a free GPU.
pub const PENDING_MAX: usize = 4096;
/// Most requests alive in the dispatcher at once (queued + outstanding).
pub const REQUESTS_MAX: usize = 65_536;
/// Most models the dispatcher tracks.
pub const MODELS_MAX: usize = 65_536;
/// Most requests one batch carries unless configured: the profiles' largest
/// measured batch, so the cost model interpolates rather than extrapolates.
pub const BATCH_MAX_DEFAULT: u32 = 8;
/// Most requests one batch may carry (the protocol's bound).
pub const BATCH_MAX: u32 = BATCH_MEMBERS_MAX as u32 + 1;
/// Most models whose batches the efficient order weighs per decision (the
/// head's and the resident ones with the most requests queued): each costs
/// a pass over the GPU's queue.
pub const ORDER_CANDIDATES_MAX: usize = 8;
/// Default latency objective when neither the request nor controller.json
/// gives one.
pub const SLO_MS_DEFAULT: f64 = 1000.0;
/// A request sent to a runtime and not answered within this long is failed
/// (the runtime hangs or lost it); its reply, if it ever comes, is dropped.
/// Most requests are given up long before: past their deadline by a grace
/// of their SLO, or of four times their estimated device time if longer.
pub const OUTSTANDING_TIMEOUT_US: Micros = 120_000_000;
/// A GPU whose runtime refused the training job is asked again after this
/// long (times the time dilation): the job's model may not be deployed yet.
pub const TRAIN_RETRY_US: Micros = 1_000_000;
/// The cache-aware balancer frees this multiple of a model's size. The
/// original frees 1.2x; at a cache of a few models that throws out two
/// models to make room for one. The runtime's cache needs the model's
/// blocks in one run, and when fragmentation leaves it short it evicts its
/// own least recently used model, so the exact size is enough here.
const CACHE_OUT_FACTOR: f64 = 1.0;
/// Under `slo`, a model whose demand (requests per second times its device
/// time) would keep each GPU that holds it more than this busy is copied
/// onto an idle GPU with room. A copy evicts nothing and costs one load
/// on a GPU that had nothing to do, so the bar is low: in `simulate` at the
/// paper's scale (32 GPUs of room for 68 ResNet-152 each, 128 models, 32
/// closed-loop clients, Zipf 0.9, seed 0), 0.5 gave 5009 req/s, 0.25 6235,
/// 0.1 7477 and 0.05 7473, against 3785 without copies.
pub const REPLICA_LOAD: f64 = 0.1;
/// Under `slo` with training, every GPU trains between requests when one
/// training iteration is at most this share of the tightest SLO requested:
/// a request then waits at most one iteration for its GPU to yield and
/// still has half its SLO left. With longer iterations a request on a
/// training GPU would miss its deadline, and GPUs are split instead.
pub const MIX_ITERATION_SHARE: f64 = 0.5;
/// Under `slo` with training split from inference, enough GPUs stay
/// inference-only for the demand (requests per second times their device
/// time) to keep each this busy; the rest train. SLO first: in `simulate`
/// at the paper's scale (32 GPUs, 128 ResNet-152, 244 ms iterations,
/// Poisson, 100 ms SLO, 60 s, seed 0), 0.5 kept 98.9-99.5% within the SLO
/// from 500 to 4000 req/s with 76%, 42% and 0% of the GPUs' time training
/// at 500, 2000 and 4000; 0.6 (lowering at 0.5) trained 79%, 52% and 9%
/// with 98.2-99.2% at 1000 req/s over seeds 0-2 against 98.8-99.2%; 0.7
/// fell to 95.5% at 500 req/s.
pub const RESERVE_LOAD: f64 = 0.5;
/// They are fewer only where fewer would each be at most this busy (below
/// [`RESERVE_LOAD`]: a demand near a whole number of GPUs does not move
/// one to and fro).
pub const RESERVE_LOWER_LOAD: f64 = 0.4;
/// Requests per second (all models) under which no GPU is kept from
/// training: demand decays to this within a few seconds of the last request.
pub const RESERVE_MIN_RATE: f64 = 0.1;
/// The inference-only GPUs are fewer only after the demand has called for
/// fewer for this long (times the time dilation): a GPU given back to
/// training takes one iteration to return.
pub const RESERVE_HOLD_US: Micros = 1_000_000;

#[derive(Debug, Clone)]
pub struct DispatchConfig {
    pub policy: PolicyKind,
    pub balancer: Balancer,
    /// Latency objective per model family, ms (controller.json `slo_ms`).
    pub slo_ms_by_family: BTreeMap<String, f64>,
    pub slo_ms_default: f64,
    pub window: u32,
    /// Most requests per batch under the `slo` policy (1: no batching), and
    /// per model family where it differs.
    pub batch_max: u32,
    pub batch_max_by_family: BTreeMap<String, u32>,
    /// Switch-aware order under the `slo` policy: a batch for a resident
    /// model may run before a head that has to be loaded when no queued
    /// request is made late.
    pub reorder: bool,
    /// With `reorder`: of the EDF head's batch and the batches of resident
    /// models that make no queued request late, the one of least estimated
    /// device time per request runs next, so that under load a GPU runs its
    /// larger batches first and small queues grow while they wait. Off: a
    /// resident model's batch passes only a head that must be loaded.
    pub efficient_order: bool,
    pub distmind: DistMindConfig,
    pub priors: Priors,
    /// Training job for GPUs that train (`use_train`).
    pub train_model: Option<String>,
    /// K of an emulated link (1: none): the clock runs K times slower, so
    /// the training schedule's seconds and [`OUTSTANDING_TIMEOUT_US`] are
    /// stretched by K. SLOs and the period come dilated already.
    pub time_dilation: f64,
}

impl DispatchConfig {
    pub fn new(policy: PolicyKind, distmind: DistMindConfig) -> Self {
        DispatchConfig {
            policy,
            balancer: Balancer::LeastOutstanding,
            slo_ms_by_family: BTreeMap::new(),
            slo_ms_default: SLO_MS_DEFAULT,
            window: SLO_WINDOW_DEFAULT,
            batch_max: BATCH_MAX_DEFAULT,
            batch_max_by_family: BTreeMap::new(),
            reorder: true,
            efficient_order: true,
            distmind,
            priors: Priors::default(),
            train_model: None,
            time_dilation: 1.0,
        }
    }
}

/// A request that runs in the batch of another `Send`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchMate {
    pub req: ReqId,
    /// The time left before its deadline.
    pub budget_ms: u64,
}

/// What the network layer must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send request `req` (its input is held by the network layer) to a GPU;
    /// `budget_ms`: the time left before its deadline. `batch`: requests for
    /// the same model that run in one batch with it (their inputs follow
    /// `req`'s, in this order); each is answered under its own id.
    Send {
        req: ReqId,
        gpu: Gpu,
        model: String,
        budget_ms: u64,
        batch: Vec<BatchMate>,
    },
    /// Answer `req` with this error; it is finished.
    Fail {
        req: ReqId,
        error: ErrorReply,
    },
    Prefetch {
        gpu: Gpu,
        model: String,
    },
    /// Cache-out: drop `model` from `runtime`'s host cache. Devices that
    /// hold it keep it (their own LRU decides).
    Evict {
        runtime: u32,
        model: String,
    },
    Train {
        gpu: Gpu,
        model: Option<String>,
    },
}

/// A runtime's reply to a request the dispatcher sent.
#[derive(Debug, Clone, Default)]
pub struct Completion<'a> {
    /// Present when it ran (an `Output` reply).
    pub timing: Option<&'a TimingMsg>,
    /// The device's resident models after it ran.
    pub resident: &'a [String],
}

/// Counters the metrics endpoint exports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DispatchCounters {
    pub submitted: u64,
    pub sent: u64,
    pub completed: u64,
    pub completed_within_slo: u64,
    pub rejected: u64,
    pub deadline_exceeded: u64,
    pub failed_other: u64,
    pub busy: u64,
    /// Failed `unavailable`: their GPU server was lost and no other could
    /// take them in time.
    pub unavailable: u64,
    /// Requests in flight on a lost GPU server sent again elsewhere.
    pub retried: u64,
    pub prefetches: u64,
    pub evictions: u64,
    /// `Send`s (batches, a lone request being a batch of one) and the
    /// requests they carried: their ratio is the mean batch size.
    pub batches: u64,
    pub batched_requests: u64,
    /// Batches sent to a GPU that did not hold their model (it loads it).
    pub model_switches: u64,
}

#[derive(Debug)]
struct Req {
    model: u32,
    arrival: Micros,
    deadline: Micros,
    slo_ms: f64,
    est_finish: Micros,
    service: Micros,
    at: Where,
    gpu: Option<usize>,
    sent_at: Option<Micros>,
    /// Set when the loss of a runtime moved it: "runtime N (why)". Routing
    /// that finds no GPU for it fails it `unavailable` with this reason.
    displaced: Option<Arc<str>>,
    /// It was in flight on a lost runtime and was sent again: a second
    /// loss fails it.
    retried: bool,
    /// Once sent: its batch (the head's id).
    batch: Option<ReqId>,
    /// Its priority as a rank: lower runs first ([`rank`]).
    rank: u32,
}

/// The fewest of `gpus` inference GPUs, each with room for `slots`
/// models, that keep each at most `load` busy (all of them where none do,
/// at least one). Models are given most requested first, with their demand
/// in GPUs where resident (`resident`) and where each request has to load
/// them (`loaded`): with `n` GPUs the first `n * slots` models stay
/// resident and every request for the rest pays a load.
fn reserve_for(resident: &[f64], loaded: &[f64], slots: usize, gpus: usize, load: f64) -> usize {
    let total_loaded: f64 = loaded.iter().sum();
    let mut held = 0.0;
    let mut held_loaded = 0.0;
    let mut fit = 0;
    for n in 1..=gpus {
        let upto = (n * slots.max(1)).min(resident.len());
        while fit < upto {
            held += resident[fit];
            held_loaded += loaded[fit];
            fit += 1;
        }
        if held + (total_loaded - held_loaded) <= load * n as f64 {
            return n;
        }
    }
    gpus
}

/// A priority level as a rank that sorts the highest level first: 1 is the
/// highest level, larger is lower, and 0 (the default) is the lowest.
fn rank(priority: u32) -> u32 {
    if priority == 0 {
        u32::MAX
    } else {
        priority
    }
}

/// The priority level a rank came from.
fn level(rank: u32) -> u32 {
    if rank == u32::MAX {
        0
    } else {
        rank
    }
}

/// A batch sent to a GPU (a lone request is a batch of one).
#[derive(Debug)]
struct Batch {
    gi: usize,
    model: u32,
    /// Its estimated device time.
    service: Micros,
    /// The cost model's part of `service` (without the GPU's measured
    /// serial time), what its reply-to-reply interval is compared with.
    base: Micros,
    /// Its requests.
    n: u32,
    /// Members not answered yet.
    left: u32,
    /// It no longer holds a slot of the GPU's window (its first reply came:
    /// the device ran it).
    released: bool,
    /// It loads its model from the memory servers: counted on its GPU
    /// server's link until released.
    load: Option<LoadMark>,
}

/// Model id -> the GPUs (indices) that hold it: the reverse of every GPU's
/// resident set or assignment, so that routing a model it holds looks at
/// its holders only.
#[derive(Debug, Default)]
struct Holders(IdMap<u32, Vec<usize>>);

impl Holders {
    fn get(&self, model: u32) -> &[usize] {
        self.0.get(&model).map_or(&[], |v| v)
    }

    fn add(&mut self, model: u32, gi: usize) {
        let v = self.0.entry(model).or_default();
        if !v.contains(&gi) {
            v.push(gi);
        }
    }

    fn remove(&mut self, model: u32, gi: usize) {
        if let Some(v) = self.0.get_mut(&model) {
            v.retain(|&g| g != gi);
            if v.is_empty() {
                self.0.remove(&model);
            }
        }
    }
}

#[derive(Debug, Default)]
struct HostState {
    boot_id: u64,
    /// The last snapshot applied (each is applied once: replies are fresher).
    snapshot_seq: u64,
    cached: HostCached,
    /// Models the last snapshot said are cached that the dispatcher had not
    /// been asked for yet (it learns models on first request): counted as
    /// cached when they are (a warm cache is warm from the first request).
    cached_unknown: HashSet<String>,
    cache_bytes: u64,
    link_up: bool,
    /// Why its runtime was lost, from [`Dispatcher::runtime_down`] until
    /// its link is up again. A runtime whose link is not up yet and was
    /// never lost is starting: requests may wait for it, not for a lost one.
    lost: Option<String>,
    /// Loads from the memory servers on its link.
    link: LinkLoad,
}

/// The dispatcher's view of a host cache: which models it holds, most
/// recently loaded first. A load the dispatcher routes there makes its
/// model the most recent and, once the cache's bytes are spent, pushes the
/// least recent out; snapshots replace it. The runtime's cache lets go
/// first of models its devices keep (`runtime::cache`), which this view
/// does not follow: following it from the view's GPU residency (which
/// counts models, not bytes, until a reply corrects it) cost 4% of
/// throughput in `simulate` where each GPU holds one model, and gained
/// nothing where GPUs hold several.
#[derive(Debug, Default)]
struct HostCached {
    set: ModelSet,
    order: Vec<u32>,
}

impl HostCached {
    fn from_mru(order: Vec<u32>) -> Self {
        let mut order = order;
        let mut set = ModelSet::default();
        order.retain(|&m| set.insert(m));
        HostCached { set, order }
    }

    fn contains(&self, model: &u32) -> bool {
        self.set.contains(model)
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.order.iter().copied()
    }

    /// Cached, least recent of all (a snapshot named it, in no order).
    fn insert_oldest(&mut self, model: u32) {
        if self.set.insert(model) {
            self.order.push(model);
        }
    }

    fn remove(&mut self, model: &u32) {
        if self.set.remove(model) {
            self.order.retain(|m| m != model);
        }
    }

    fn clear(&mut self) {
        self.set.clear();
        self.order.clear();
    }

    /// `model` was loaded through this cache: the most recent now; the
    /// least recent leave while the models' bytes (`bytes_of`) exceed
    /// `capacity` (0: unbounded), `model` itself always stays.
    fn load(&mut self, model: u32, capacity: u64, bytes_of: impl Fn(u32) -> u64) {
        if !self.set.insert(model) {
            self.order.retain(|&m| m != model);
        }
        self.order.insert(0, model);
        if capacity == 0 {
            return;
        }
        let mut used: u64 = self.order.iter().map(|&m| bytes_of(m)).sum();
        while used > capacity && self.order.len() > 1 {
            let gone = self.order.pop().expect("more than one");
            self.set.remove(&gone);
            used -= bytes_of(gone);
        }
    }
}

#[derive(Debug)]
struct Model {
    meta: ModelMeta,
    /// Requests in the last rate window and the smoothed rate (req/s).
    recent: u64,
    rate: Ewma,
    /// Cluster-wide request count (LFU).
    uses: u64,
}

/// The dispatcher's state and decisions.
#[derive(Debug)]
pub struct Dispatcher {
    cfg: DispatchConfig,
    models: Vec<Model>,
    by_name: HashMap<String, u32>,
    gpus: Gpus,
    hosts: IdMap<u32, HostState>,
    /// Memory servers serving loads (0: unknown), the GPU servers loading
    /// from them and the share of their links a load gets
    /// ([`link::memservers_share`]).
    memservers: u32,
    loading_hosts: u32,
    mem_share: f64,
    cost: CostModel,
    distmind: DistMindPolicy,
    /// Requests waiting for a GPU, FIFO: under the balancers while no GPU
    /// has room; under `slo` while no GPU server is up but one is starting.
    pending: VecDeque<ReqId>,
    reqs: IdMap<ReqId, Req>,
    next_req: ReqId,
    counters: DispatchCounters,
    last_rate_at: Micros,
    training_started: HashSet<Gpu>,
    /// How `slo` shares GPUs with training.
    split: TrainSplit,
    /// Requests routed to each (runtime, model), queued or outstanding: a
    /// model with any is never cached out.
    active: IdMap<(u32, u32), u32>,
    /// The `gpu` bound's one model (the first one asked for).
    only_model: Option<u32>,
    /// Model -> GPUs where it is resident (kept by the `resident_*`
    /// methods, the only writers of `GpuState::resident`).
    resident_on: Holders,
    /// Model -> GPUs the `distmind` policy assigned it to.
    assigned_to: Holders,
    /// Batches sent and not fully answered, by their head's id.
    batches: IdMap<ReqId, Batch>,
    /// The latest time any call passed in (for the link counts of requests
    /// that end where no time is given).
    clock: Micros,
}

/// What the `slo` policy knows and decided about sharing GPUs with the
/// training job.
#[derive(Debug, Default)]
struct TrainSplit {
    /// The job's iteration as its runtimes last reported it (0: not yet).
    iteration: Micros,
    /// The tightest SLO of the requests in the current rate window, and of
    /// the last window that had any.
    slo_window: Option<Micros>,
    slo_tightest: Option<Micros>,
    /// GPUs kept from training (0 while every GPU trains).
    reserve: usize,
    /// Since when the demand has called for fewer, and the most it called
    /// for since.
    lower: Option<(Micros, usize)>,
}

/// The batch a GPU runs next: slots of its queue, the first leading.
#[derive(Debug)]
struct BatchPlan {
    members: Vec<Slot>,
    /// Estimated device time of the batch.
    service: Micros,
}

/// What [`Dispatcher::route_balanced`] did with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Routed {
    Sent,
    /// Every GPU that holds the model is full (others may have room).
    HoldersFull,
    /// No GPU the request may go to has room.
    NoRoom,
}

impl Dispatcher {
    pub fn new(cfg: DispatchConfig) -> Result<Self, String> {
        let mut distmind = DistMindPolicy::new(cfg.distmind.clone())?;
        if !(cfg.time_dilation.is_finite() && cfg.time_dilation >= 1.0) {
            return Err(format!(
                "the time dilation must be a number >= 1, got {}",
                cfg.time_dilation
            ));
        }
        distmind.set_time_dilation(cfg.time_dilation);
        if cfg.window == 0 {
            return Err("the dispatch window must be at least 1".into());
        }
        if cfg.slo_ms_default.is_nan() || cfg.slo_ms_default <= 0.0 {
            return Err("the default SLO must be positive".into());
        }
        for (what, &b) in std::iter::once((&"every family".to_string(), &cfg.batch_max))
            .chain(cfg.batch_max_by_family.iter())
        {
            if !(1..=BATCH_MAX).contains(&b) {
                return Err(format!(
                    "the maximum batch ({what}) must be 1..={BATCH_MAX} requests, got {b}"
                ));
            }
        }
        Ok(Dispatcher {
            cost: CostModel::new(cfg.priors),
            gpus: Gpus::new(cfg.policy == PolicyKind::DistMind),
            cfg,
            models: Vec::new(),
            by_name: HashMap::new(),
            hosts: IdMap::default(),
            memservers: 0,
            loading_hosts: 0,
            mem_share: 0.0,
            distmind,
            pending: VecDeque::new(),
            reqs: IdMap::default(),
            next_req: 1,
            counters: DispatchCounters::default(),
            last_rate_at: 0,
            training_started: HashSet::new(),
            split: TrainSplit::default(),
            active: IdMap::default(),
            only_model: None,
            resident_on: Holders::default(),
            assigned_to: Holders::default(),
            batches: IdMap::default(),
            clock: 0,
        })
    }

    pub fn policy(&self) -> PolicyKind {
        self.cfg.policy
    }

    pub fn counters(&self) -> &DispatchCounters {
        &self.counters
    }

    /// Requests alive (queued, pending or outstanding).
    /// A request's round trip to its GPU server and back beyond the
    /// server's own time, as observed (smoothed).
    pub fn dispatch_overhead_us(&self) -> Micros {
        self.cost.overhead()
    }

    pub fn in_flight(&self) -> usize {
        self.reqs.len()
    }

    /// `gpu` answered at `now` a request this dispatcher no longer holds
    /// (given up, or failed): it works, so it is routed to again if it was
    /// silent. (Replies for requests it holds reach [`Self::complete`].)
    pub fn answered_late(&mut self, now: Micros, gpu: Gpu) {
        self.clock = self.clock.max(now);
        if let Some(gi) = self.gpus.iter().position(|g| g.gpu == gpu) {
            self.gpus.answered(gi, now);
        }
    }

    /// Whether request `id` is alive here and not sent to a runtime (queued
    /// or pending): no reply for it is expected until it is sent, as for
    /// one that the loss of its runtime queued again.
    pub fn waits_to_be_sent(&self, id: ReqId) -> bool {
        self.reqs.get(&id).is_some_and(|r| r.sent_at.is_none())
    }

    /// Requests waiting at the dispatcher, per GPU queue and pending.
    pub fn queued(&self) -> usize {
        self.pending.len() + self.gpus.iter().map(|g| g.queue.len()).sum::<usize>()
    }

    /// The id of a model, registering (or updating) its metadata.
    pub fn model(&mut self, meta: ModelMeta) -> Result<u32, ErrorReply> {
        if let Some(&id) = self.by_name.get(&meta.name) {
            let m = &mut self.models[id as usize];
            if m.meta != meta {
                self.cost.register(id, &meta.family);
                m.meta = meta;
                self.cost.forget(id);
            }
            return Ok(id);
        }
        if self.models.len() >= MODELS_MAX {
            return Err(ErrorReply::new(
                ErrorCode::Full,
                format!("the dispatcher tracks {MODELS_MAX} models already"),
            ));
        }
        let id = self.models.len() as u32;
        for h in self.hosts.values_mut() {
            if h.cached_unknown.remove(&meta.name) {
                h.cached.insert_oldest(id);
            }
        }
        self.by_name.insert(meta.name.clone(), id);
        self.cost.register(id, &meta.family);
        self.models.push(Model {
            meta,
            recent: 0,
            rate: Ewma::default(),
            uses: 0,
        });
        let n = self.models.len();
        self.distmind
            .set_models(n)
            .map_err(|e| ErrorReply::new(ErrorCode::Internal, e.to_string()))?;
        Ok(id)
    }

    pub fn model_id(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    pub fn model_name(&self, id: u32) -> &str {
        &self.models[id as usize].meta.name
    }

    /// The SLO a request gets: its own, else its family's, else the default.
    pub fn slo_ms(&self, model: u32, requested: Option<f64>) -> f64 {
        requested.filter(|s| *s > 0.0).unwrap_or_else(|| {
            self.cfg
                .slo_ms_by_family
                .get(&self.models[model as usize].meta.family)
                .copied()
                .unwrap_or(self.cfg.slo_ms_default)
        })
    }

    // ------------------------------------------------------------------
    // Runtimes.
    // ------------------------------------------------------------------

    /// Adds or updates a runtime's devices and state. A new boot id means
    /// it restarted: its caches are empty and whatever was outstanding there
    /// is failed.
    pub fn runtime_seen(
        &mut self,
        now: Micros,
        runtime: u32,
        boot_id: u64,
        shape: &RuntimeShape,
        snapshot: Option<(u64, &RuntimeSnapshot)>,
        out: &mut Vec<Action>,
    ) {
        self.clock = self.clock.max(now);
        let resident_models_max = shape.resident_models_max;
        let restarted = self
            .hosts
            .get(&runtime)
            .is_some_and(|h| h.boot_id != boot_id);
        if restarted {
            self.runtime_down(now, runtime, "it restarted", out);
            self.hosts.remove(&runtime);
        }
        let host = self.hosts.entry(runtime).or_insert_with(|| HostState {
            boot_id,
            ..HostState::default()
        });
        host.cache_bytes = shape.cache_bytes;
        let mut added = false;
        for &device in &shape.device_ids {
            let gpu = Gpu { runtime, device };
            if !self.gpus.iter().any(|g| g.gpu == gpu) {
                self.gpus.push(GpuState {
                    gpu,
                    role: GpuRole::Inference,
                    resident: Resident::default(),
                    resident_max: if resident_models_max == 0 {
                        usize::MAX
                    } else {
                        resident_models_max as usize
                    },
                    device_bytes: shape.device_bytes,
                    outstanding: 0,
                    outstanding_models: Vec::new(),
                    busy_until: now,
                    work_out: 0,
                    prefetch_work: 0,
                    queued_models: IdMap::default(),
                    queued_ranked: 0,
                    queue: EdfQueue::new(GPU_QUEUE_MAX),
                    training: None,
                    prefetching: false,
                    prefetch_load: None,
                    link_loads: 0,
                    train_retry_at: None,
                    busy_since: None,
                    serial: Ewma::default(),
                    serial_us: 0,
                    assigned: None,
                    link_up: self.hosts.get(&runtime).is_some_and(|h| h.link_up),
                    silent: false,
                    answered_at: now,
                });
                added = true;
            }
        }
        if added {
            // GPUs are only ever appended: requests hold their index.
            let all: Vec<Gpu> = self.gpus.iter().map(|g| g.gpu).collect();
            self.distmind.set_gpus(&all);
        }
        if let Some((seq, s)) = snapshot {
            let h = self.hosts.get_mut(&runtime).expect("inserted above");
            if seq > h.snapshot_seq {
                h.snapshot_seq = seq;
                self.apply_snapshot(runtime, s);
            }
        }
    }

    fn apply_snapshot(&mut self, runtime: u32, s: &RuntimeSnapshot) {
        let ids = |names: &[String], by: &HashMap<String, u32>| -> Vec<u32> {
            names.iter().filter_map(|n| by.get(n).copied()).collect()
        };
        if !s.host_cached_truncated {
            let cached = HostCached::from_mru(ids(&s.host_cached, &self.by_name));
            let unknown = s
                .host_cached
                .iter()
                .filter(|n| !self.by_name.contains_key(*n))
                .cloned()
                .collect();
            if let Some(h) = self.hosts.get_mut(&runtime) {
                h.cached = cached;
                h.cached_unknown = unknown;
            }
        }
        for d in &s.devices {
            let resident = ids(&d.resident, &self.by_name);
            let Some(gi) = self
                .gpus
                .iter()
                .position(|g| g.gpu.runtime == runtime && g.gpu.device == d.device)
            else {
                continue;
            };
            // Only trust the snapshot when nothing is in flight there (a
            // reply would be fresher).
            if self.gpus[gi].outstanding == 0 {
                self.resident_replace(gi, resident);
            }
            self.end_prefetch_load(gi);
            let mut g = self.gpus.get_mut(gi);
            g.prefetching = false;
            g.prefetch_work = 0;
            // Nothing waits there: a silent GPU is routed to again. (One
            // whose device is stuck on a request heartbeats on, and stays
            // silent.)
            if d.queued == 0 {
                g.silent = false;
            }
            let iteration = (d.train_iteration_ms * 1e3) as Micros;
            g.training = d.training.as_ref().map(|_| TrainingJob {
                started_at: 0,
                iteration,
            });
            // Told to train and not yet training as this snapshot was
            // taken: it starts an iteration as soon as the order arrives.
            if g.training.is_none()
                && g.train_retry_at.is_none()
                && self.cfg.policy == PolicyKind::Slo
                && self.training_started.contains(&g.gpu)
            {
                g.training = Some(TrainingJob {
                    started_at: 0,
                    iteration: self.split.iteration,
                });
            }
            drop(g);
            if iteration > 0 && d.training.is_some() && d.training == self.cfg.train_model {
                self.split.iteration = iteration;
            }
        }
    }

    /// Requests that wait for a GPU are routed again now (a link came up).
    pub fn route_waiting(&mut self, now: Micros, out: &mut Vec<Action>) {
        self.clock = self.clock.max(now);
        if !self.pending.is_empty() {
            self.drain_pending(now, out);
        }
    }

    /// The link to `runtime` is up (requests may be sent).
    pub fn link_up(&mut self, runtime: u32) {
        if let Some(h) = self.hosts.get_mut(&runtime) {
            h.link_up = true;
            h.lost = None;
        }
        self.gpus.for_each_mut(|g| {
            if g.gpu.runtime == runtime {
                g.link_up = true;
            }
        });
    }

    /// The runtime is gone (dead, restarted, its link broke), `why` says
    /// how. Every request it held moves at once, earliest deadline first:
    /// those queued for its GPUs are routed again, those in flight there
    /// (inference is idempotent) are sent again once, each to a GPU that
    /// can still meet its deadline; the rest fail `unavailable`, naming
    /// the runtime and why. Nothing waits for a GPU that is gone.
    pub fn runtime_down(&mut self, now: Micros, runtime: u32, why: &str, out: &mut Vec<Action>) {
        self.clock = self.clock.max(now);
        if let Some(h) = self.hosts.get_mut(&runtime) {
            h.link_up = false;
            h.cached.clear();
            h.lost = Some(why.to_string());
            h.link.reset(now);
            self.update_memservers_share(now);
        }
        for b in self.batches.values_mut() {
            if self.gpus[b.gi].gpu.runtime == runtime {
                b.load = None;
            }
        }
        let mut moved = Vec::new();
        for gi in 0..self.gpus.len() {
            if self.gpus[gi].gpu.runtime != runtime {
                continue;
            }
            self.resident_replace(gi, Vec::new());
            let mut g = self.gpus.get_mut(gi);
            g.link_up = false;
            moved.extend(g.queue.drain());
            g.queued_models.clear();
            g.queued_ranked = 0;
            g.outstanding = 0;
            g.outstanding_models.clear();
            g.work_out = 0;
            g.prefetch_work = 0;
            g.busy_until = now;
            g.training = None;
            g.prefetching = false;
            g.prefetch_load = None;
            g.link_loads = 0;
        }
        moved.extend(
            self.reqs
                .iter()
                .filter(|(_, r)| {
                    r.sent_at.is_some()
                        && r.gpu.is_some_and(|gi| self.gpus[gi].gpu.runtime == runtime)
                })
                .map(|(&id, _)| id),
        );
        self.training_started.retain(|g| g.runtime != runtime);
        let reason: Arc<str> = Arc::from(format!("runtime {runtime} was lost ({why})"));
        self.move_requests(now, moved, &reason, out);
        // With every GPU server lost, requests waiting for a GPU would
        // only wait out their deadline.
        if let Some(why) = self.every_gpu_lost() {
            for id in std::mem::take(&mut self.pending) {
                if let Some(r) = self.take(id) {
                    let message = format!(
                        "request for {}: {why}",
                        self.models[r.model as usize].meta.name
                    );
                    self.fail(id, ErrorCode::Unavailable, message, out);
                }
            }
        }
    }

    /// Moves requests off a GPU that `reason` says cannot run them,
    /// earliest deadline first: those queued are routed again, those in
    /// flight (inference is idempotent) are sent again once, each to a GPU
    /// that can still meet its deadline; the rest fail `unavailable`,
    /// naming the reason.
    fn move_requests(
        &mut self,
        now: Micros,
        moved: Vec<ReqId>,
        reason: &Arc<str>,
        out: &mut Vec<Action>,
    ) {
        let mut moved: Vec<(Micros, ReqId, Req)> = moved
            .into_iter()
            .filter_map(|id| Some((id, self.take(id)?)))
            .map(|(id, r)| (r.deadline, id, r))
            .collect();
        moved.sort_unstable_by_key(|&(deadline, id, _)| (deadline, id));
        for (_, id, mut r) in moved {
            let name = &self.models[r.model as usize].meta.name;
            if r.sent_at.is_some() && r.retried {
                let message = format!(
                    "request for {name}: {reason} while it ran there, and it had been sent there \
                     again after another GPU server was lost; it is not sent a third time"
                );
                self.fail(id, ErrorCode::Unavailable, message, out);
                continue;
            }
            let was_in_flight = r.sent_at.take().is_some();
            r.retried |= was_in_flight;
            r.displaced = Some(reason.clone());
            r.gpu = None;
            r.batch = None;
            self.reroute(now, id, r, out);
            if was_in_flight && self.reqs.contains_key(&id) {
                self.counters.retried += 1;
            }
        }
    }

    /// Routes a request that the loss of a runtime moved, or fails it
    /// `unavailable` when no GPU can meet its deadline: under `slo` the
    /// admission test decides (its rejection becomes `unavailable`, see
    /// [`Self::route_slo`]); the balancers have no admission test, so a
    /// request that cannot finish in time even where its model is resident
    /// fails here, and the others route as usual.
    fn reroute(&mut self, now: Micros, id: ReqId, r: Req, out: &mut Vec<Action>) {
        if self.cfg.policy != PolicyKind::Slo {
            let meta = &self.models[r.model as usize].meta;
            let best = self.cost.estimate(r.model, meta, Where::Resident);
            if now + best > r.deadline {
                let message = format!(
                    "request for {}: {}, and {:.0} ms are left of its {:.0} ms SLO, less than \
                     the {:.1} ms it takes where its model is resident",
                    meta.name,
                    r.displaced.as_deref().unwrap_or("its GPU server was lost"),
                    r.deadline.saturating_sub(now) as f64 / 1e3,
                    r.slo_ms,
                    best as f64 / 1e3
                );
                self.fail(id, ErrorCode::Unavailable, message, out);
                return;
            }
        }
        self.route(now, id, r, out);
    }

    /// Runtimes the dispatcher knows (linked, starting or lost).
    pub fn runtimes_known(&self) -> usize {
        self.hosts.len()
    }

    /// Runtimes whose link is up: requests can be sent to their GPUs.
    pub fn runtimes_linked(&self) -> usize {
        self.hosts.values().filter(|h| h.link_up).count()
    }

    /// Whether a known runtime is starting: its link is not up yet and it
    /// was never lost.
    fn a_runtime_starts(&self) -> bool {
        self.hosts.values().any(|h| !h.link_up && h.lost.is_none())
    }

    /// When GPUs are known and the runtime of every one of them is lost
    /// (not merely starting), why: "no GPU server is available: runtime 0
    /// was lost (why); ...". `None` otherwise.
    fn every_gpu_lost(&self) -> Option<String> {
        if self.gpus.is_empty() {
            return None;
        }
        let mut lost = BTreeMap::new();
        for g in self.gpus.iter() {
            if g.link_up {
                return None;
            }
            match self
                .hosts
                .get(&g.gpu.runtime)
                .and_then(|h| h.lost.as_deref())
            {
                Some(why) => lost.insert(g.gpu.runtime, why),
                None => return None,
            };
        }
        let each: Vec<String> = lost
            .iter()
            .map(|(runtime, why)| format!("runtime {runtime} was lost ({why})"))
            .collect();
        Some(format!("no GPU server is available: {}", each.join("; ")))
    }

    // ------------------------------------------------------------------
    // Requests.
    // ------------------------------------------------------------------

    fn bind_gpu(&mut self, gi: usize, model: u32) {
        *self
            .active
            .entry((self.gpus[gi].gpu.runtime, model))
            .or_insert(0) += 1;
    }

    /// Takes request `id` out of the table, releasing its GPU binding and
    /// its share of its batch (the batch's window slot goes with its first
    /// member out).
    fn take(&mut self, id: ReqId) -> Option<Req> {
        let r = self.reqs.remove(&id)?;
        if let Some(gi) = r.gpu {
            self.unbind_gpu(gi, r.model);
        }
        if let Some(head) = r.batch {
            self.leave_batch(head);
        }
        Some(r)
    }

    fn leave_batch(&mut self, head: ReqId) {
        let Some(b) = self.batches.get_mut(&head) else {
            return;
        };
        b.left = b.left.saturating_sub(1);
        let left = b.left;
        let release = (!b.released).then(|| {
            b.released = true;
            (b.gi, b.model, b.service, b.load.take().is_some())
        });
        if let Some((gi, model, service, loaded)) = release {
            if loaded {
                self.load_ended(gi);
            }
            let mut g = self.gpus.get_mut(gi);
            g.outstanding = g.outstanding.saturating_sub(1);
            g.work_out = g.work_out.saturating_sub(service);
            if let Some(k) = g.outstanding_models.iter().position(|&m| m == model) {
                g.outstanding_models.remove(k);
            }
        }
        if left == 0 {
            self.batches.remove(&head);
        }
    }

    /// Ends request `id` (already out of the table) with an error: counts it
    /// by code and emits its `Fail`.
    fn fail(&mut self, id: ReqId, code: ErrorCode, message: String, out: &mut Vec<Action>) {
        let c = &mut self.counters;
        match code {
            ErrorCode::Rejected => c.rejected += 1,
            ErrorCode::DeadlineExceeded => c.deadline_exceeded += 1,
            ErrorCode::Busy => c.busy += 1,
            ErrorCode::Unavailable => c.unavailable += 1,
            _ => c.failed_other += 1,
        }
        out.push(Action::Fail {
            req: id,
            error: ErrorReply::new(code, message),
        });
    }

    fn unbind_gpu(&mut self, gi: usize, model: u32) {
        let k = (self.gpus[gi].gpu.runtime, model);
        if let Some(n) = self.active.get_mut(&k) {
            *n -= 1;
            if *n == 0 {
                self.active.remove(&k);
            }
        }
    }

    /// A request for `model` arrived at `now`. Returns its id; `out` gets a
    /// `Send` (now or later, as GPUs free up) or a `Fail`.
    pub fn submit(
        &mut self,
        now: Micros,
        model: u32,
        slo_ms: Option<f64>,
        out: &mut Vec<Action>,
    ) -> ReqId {
        self.submit_with(now, model, slo_ms, 0, out)
    }

    /// [`Dispatcher::submit`] at a priority level: 1 is the highest, larger
    /// is lower, 0 (the default) the lowest.
    pub fn submit_with(
        &mut self,
        now: Micros,
        model: u32,
        slo_ms: Option<f64>,
        priority: u32,
        out: &mut Vec<Action>,
    ) -> ReqId {
        self.clock = self.clock.max(now);
        let id = self.next_req;
        self.next_req += 1;
        self.counters.submitted += 1;
        let slo = self.slo_ms(model, slo_ms);
        let slo_us = (slo * 1e3) as Micros;
        let w = &mut self.split.slo_window;
        *w = Some(w.map_or(slo_us, |t| t.min(slo_us)));
        let m = &mut self.models[model as usize];
        m.recent += 1;
        m.uses += 1;
        if self.reqs.len() >= REQUESTS_MAX {
            let message =
                format!("the dispatcher holds {REQUESTS_MAX} requests already; retry later");
            self.fail(id, ErrorCode::Busy, message, out);
            return id;
        }
        let r = Req {
            model,
            arrival: now,
            deadline: now + (slo * 1e3) as Micros,
            slo_ms: slo,
            est_finish: 0,
            service: 0,
            at: Where::Remote,
            gpu: None,
            sent_at: None,
            displaced: None,
            retried: false,
            batch: None,
            rank: rank(priority),
        };
        self.route(now, id, r, out);
        id
    }

    fn where_is(&self, gi: usize, model: u32) -> Where {
        if self.gpus[gi].resident.contains(&model) {
            Where::Resident
        } else {
            self.where_is_unheld(gi, model)
        }
    }

    /// [`Self::where_is`] of a model GPU `gi` does not hold.
    fn where_is_unheld(&self, gi: usize, model: u32) -> Where {
        self.where_on_host(self.gpus[gi].gpu.runtime, model)
    }

    /// Where a GPU of `runtime` that does not hold `model` finds it.
    fn where_on_host(&self, runtime: u32, model: u32) -> Where {
        if self
            .hosts
            .get(&runtime)
            .is_some_and(|h| h.cached.contains(&model))
        {
            Where::HostCached
        } else {
            Where::Remote
        }
    }

    fn routable(&self, gi: usize) -> bool {
        self.gpus.routable(gi)
    }

    fn route(&mut self, now: Micros, id: ReqId, r: Req, out: &mut Vec<Action>) {
        if self.cfg.policy == PolicyKind::Gpu {
            let only = *self.only_model.get_or_insert(r.model);
            if r.model != only {
                let message = format!(
                    "request for {} refused: the gpu bound serves one model, {}, and never switches",
                    self.models[r.model as usize].meta.name, self.models[only as usize].meta.name
                );
                self.fail(id, ErrorCode::BadRequest, message, out);
                return;
            }
        }
        match self.cfg.policy {
            PolicyKind::Slo => self.route_slo(now, id, r, out),
            PolicyKind::DistMind | PolicyKind::Mps | PolicyKind::Ray | PolicyKind::Gpu => {
                self.reqs.insert(id, r);
                if self.route_balanced(now, id, out) != Routed::Sent {
                    if let Some(why) = self.every_gpu_lost() {
                        let r = self.take(id).expect("inserted above");
                        let message = format!(
                            "request for {}: {why}",
                            self.models[r.model as usize].meta.name
                        );
                        self.fail(id, ErrorCode::Unavailable, message, out);
                    } else if self.pending.len() >= PENDING_MAX {
                        let r = self.take(id).expect("inserted above");
                        let message = format!(
                            "request for {}: {PENDING_MAX} requests already wait for a GPU; retry later",
                            self.models[r.model as usize].meta.name
                        );
                        self.fail(id, ErrorCode::Busy, message, out);
                    } else {
                        self.pending.push_back(id);
                    }
                }
            }
        }
    }

    /// When GPU `gi` can start new work: after what it has outstanding and,
    /// when it trains and is otherwise idle, after one training iteration.
    fn free_at(&self, now: Micros, gi: usize) -> Micros {
        self.gpus.lane(gi).free_at(now)
    }

    /// The `slo` policy: among the GPUs that meet the request's deadline
    /// without making a queued request late, one that holds its model (the
    /// earliest to finish), else the one that finishes it earliest; none =
    /// rejected at once.
    fn route_slo(&mut self, now: Micros, id: ReqId, mut r: Req, out: &mut Vec<Action>) {
        let meta = &self.models[r.model as usize].meta;
        let est = [Where::Resident, Where::HostCached, Where::Remote]
            .map(|at| self.cost.estimate(r.model, meta, at));
        let overhead = self.cost.overhead();
        let mut best: Option<(Micros, Where, usize, Micros)> = None;
        let mut earliest: Option<Micros> = None;
        // The model's holders first (a short list): the best of them bounds
        // the rest, most of which the cheap bound then passes over, and an
        // idle holder ends the search. Then every other GPU, in order, with
        // its host's cache looked up once per runtime.
        let holders = self.resident_on.get(r.model);
        // (runtime, where the model is there, its device time there on a
        // GPU that does not load and on one that does: a load shares the
        // link with the other GPUs that load)
        let mut host: Option<(u32, Where, [Micros; 2])> = None;
        // A load's cost, worked out for the first GPU server that needs it.
        let mut load: Option<LoadCost> = None;
        let others = (0..self.gpus.len()).filter(|gi| !holders.contains(gi));
        for (gi, held) in holders
            .iter()
            .map(|&gi| (gi, true))
            .chain(others.map(|gi| (gi, false)))
        {
            // A holder that meets the deadline beats any load elsewhere,
            // however much sooner: a load pushes a model out of that GPU,
            // and its next request must load it again. (Earliest-finish
            // routing loaded models round the GPUs until the memory
            // servers' link was full: 4 GPUs, half the set in host memory,
            // `up` on an emulated 100 Gbit/s link kept 66-70% within the
            // SLO at 800 req/s; 98% this way.) Holders come first, so the
            // rest need no look.
            if !held && best.is_some_and(|(_, w, _, _)| w == Where::Resident) {
                break;
            }
            // A lower bound of its finish here, from its lane alone: a GPU
            // that cannot beat the best so far, or the deadline, is not
            // looked at further (routing over many GPUs stays fast).
            let lane = self.gpus.lane(gi);
            if !lane.open {
                continue;
            }
            let (at, time) = match host {
                _ if held => (Where::Resident, est[Where::Resident as usize]),
                Some((rt, at, times)) if rt == lane.runtime => {
                    (at, times[usize::from(self.gpus[gi].link_loads > 0)])
                }
                _ => {
                    let at = self.where_on_host(lane.runtime, r.model);
                    let times = match at {
                        Where::Remote => {
                            let load = *load.get_or_insert_with(|| {
                                let meta = &self.models[r.model as usize].meta;
                                self.cost.load_cost(r.model, meta)
                            });
                            self.load_times(lane.runtime, load)
                        }
                        _ => [est[at as usize]; 2],
                    };
                    host = Some((lane.runtime, at, times));
                    (at, times[usize::from(self.gpus[gi].link_loads > 0)])
                }
            };
            // Counted whole even when it may join a queued batch of its
            // model: whether it does is decided when the batch is sent
            // (deadlines then), and a credit given here for a batch that
            // does not form over-admits (measured: under 10x overload on
            // the cpu executor, 3 requests admitted for every one run).
            // Batches that do form finish early, and every reply
            // re-anchors the GPU's free time, which admits the next ones.
            let service = time + lane.serial_us;
            let free = lane.free_at(now);
            let ahead = if lane.last_deadline <= r.deadline {
                lane.work
            } else {
                0
            };
            let bound = free + overhead + ahead + service;
            if bound > r.deadline || best.is_some_and(|(f, ..)| bound > f) {
                earliest = Some(earliest.map_or(bound, |e: Micros| e.min(bound)));
                continue;
            }
            let adm = self.gpus[gi]
                .queue
                .admit(free, r.deadline, service, overhead);
            earliest = Some(earliest.map_or(adm.finish, |e: Micros| e.min(adm.finish)));
            if adm.feasible && best.is_none_or(|(f, w, _, _)| (adm.finish, at) < (f, w)) {
                best = Some((adm.finish, at, gi, service));
                // Nothing beats an idle GPU that holds the model.
                if at == Where::Resident && adm.finish == now + overhead + service {
                    break;
                }
            }
        }
        if best.is_none() && r.rank != u32::MAX {
            best = self.make_room(now, &r, out);
        }
        let Some((finish, at, gi, service)) = best else {
            // No GPU can take requests yet, but a GPU server is starting
            // (known, its link not up yet): the request waits for it, within
            // its deadline ([`Self::drain_pending`]).
            if earliest.is_none()
                && r.displaced.is_none()
                && self.pending.len() < PENDING_MAX
                && self.a_runtime_starts()
            {
                self.reqs.insert(id, r);
                self.pending.push_back(id);
                return;
            }
            let meta = &self.models[r.model as usize].meta;
            // A request the loss of a runtime moved, or one that finds no
            // GPU server up, is `unavailable` (the loss is the cause);
            // otherwise no GPU can meet its deadline: `rejected`.
            let (code, message) = match (earliest, &r.displaced) {
                (None, _) => (
                    ErrorCode::Unavailable,
                    format!(
                        "request for {}: {}",
                        meta.name,
                        self.every_gpu_lost()
                            .unwrap_or_else(|| "no GPU server is available".to_string())
                    ),
                ),
                (Some(f), Some(lost)) => (
                    ErrorCode::Unavailable,
                    format!(
                        "request for {}: {lost}, and no other GPU can meet its {:.0} ms SLO (the \
                         earliest would finish {:.1} ms after it arrived)",
                        meta.name,
                        r.slo_ms,
                        (f - r.arrival) as f64 / 1e3
                    ),
                ),
                (Some(f), None) => (
                    ErrorCode::Rejected,
                    format!(
                        "request for {} rejected: it cannot meet its {:.0} ms SLO (the earliest \
                         any GPU could finish it is {:.1} ms after arrival)",
                        meta.name,
                        r.slo_ms,
                        (f - now) as f64 / 1e3
                    ),
                ),
            };
            log::debug!(
                "dispatcher: {message}; estimates (resident, host-cached, remote) {est:?} us, overhead {overhead} us, \
                 GPUs free at {:?} us from now",
                (0..self.gpus.len())
                    .map(|gi| self.free_at(now, gi) - now)
                    .collect::<Vec<_>>()
            );
            self.fail(id, code, message, out);
            return;
        };
        r.est_finish = finish;
        r.service = service;
        r.at = at;
        r.gpu = Some(gi);
        let model = r.model;
        let deadline = r.deadline;
        let ranked = r.rank != u32::MAX;
        self.reqs.insert(id, r);
        self.bind_gpu(gi, model);
        let mut g = self.gpus.get_mut(gi);
        if g.queue.is_empty() {
            g.queued_models.clear();
            g.queued_ranked = 0;
        }
        g.queued_ranked += u32::from(ranked);
        g.queue
            .push(deadline, service, id)
            .expect("admission skipped full queues");
        let q = g.queued_models.entry(model).or_insert((0, 0));
        *q = (q.0 + 1, q.1.max(deadline));
        drop(g);
        self.expect_resident(gi, model);
        self.pump(now, gi, out);
    }

    /// Room for `r`, which no GPU admits in time as things stand, made by
    /// dropping queued requests of lower priority, on the GPU where the
    /// fewest must go (then the earliest finish): one alone if one makes
    /// room, else the lowest priority first and among equals the latest
    /// deadline, until it fits. They fail `rejected`, naming why. Returns
    /// where `r` goes, as [`Self::route_slo`] picks it.
    fn make_room(
        &mut self,
        now: Micros,
        r: &Req,
        out: &mut Vec<Action>,
    ) -> Option<(Micros, Where, usize, Micros)> {
        let overhead = self.cost.overhead();
        // (victims, finish, where, gpu, service, their slots)
        let mut best: Option<(usize, Micros, Where, usize, Micros, Vec<Slot>)> = None;
        for gi in 0..self.gpus.len() {
            if !self.routable(gi) {
                continue;
            }
            let g = &self.gpus[gi];
            let mut lower: Vec<(u32, Slot, ReqId)> = g
                .queue
                .iter()
                .filter_map(|(slot, _, &id)| {
                    let k = self.reqs[&id].rank;
                    (k > r.rank).then_some((k, slot, id))
                })
                .collect();
            if lower.is_empty() {
                continue;
            }
            lower.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
            let at = self.where_is(gi, r.model);
            let service = self.estimate_on(gi, r.model, at) + self.serial_us(gi);
            let free = self.free_at(now, gi);
            let single = lower.iter().find_map(|&(_, slot, id)| {
                let adm = g
                    .queue
                    .admit_without(free, r.deadline, service, overhead, |q| *q == id);
                adm.feasible.then_some((adm.finish, slot))
            });
            if let Some((finish, slot)) = single {
                if best.as_ref().is_none_or(|b| (1, finish) < (b.0, b.1)) {
                    best = Some((1, finish, at, gi, service, vec![slot]));
                }
                continue;
            }
            let mut gone: IdSet<ReqId> = IdSet::default();
            for (n, &(_, _, id)) in lower.iter().enumerate() {
                if best.as_ref().is_some_and(|b| n + 1 > b.0) {
                    break;
                }
                gone.insert(id);
                let adm = g
                    .queue
                    .admit_without(free, r.deadline, service, overhead, |q| gone.contains(q));
                if adm.feasible {
                    if best
                        .as_ref()
                        .is_none_or(|b| (n + 1, adm.finish) < (b.0, b.1))
                    {
                        let slots = lower[..=n].iter().map(|v| v.1).collect();
                        best = Some((n + 1, adm.finish, at, gi, service, slots));
                    }
                    break;
                }
            }
        }
        let (_, finish, at, gi, service, victims) = best?;
        let name = self.models[r.model as usize].meta.name.clone();
        for slot in victims {
            let (_, _, vid) = self
                .gpus
                .get_mut(gi)
                .queue
                .remove(slot)
                .expect("listed above");
            self.unqueue_model(gi, vid);
            let v = self.take(vid).expect("queued requests are alive");
            let message = format!(
                "request for {} (priority {}) dropped before it ran: a request for {name} of \
                 higher priority ({}) needed its place on {} to meet its {:.0} ms SLO",
                self.models[v.model as usize].meta.name,
                level(v.rank),
                level(r.rank),
                self.gpus[gi].gpu,
                r.slo_ms,
            );
            self.fail(vid, ErrorCode::Rejected, message, out);
        }
        Some((finish, at, gi, service))
    }

    /// GPU `gi`'s resident set becomes `order` (most recently used first).
    fn resident_replace(&mut self, gi: usize, order: Vec<u32>) {
        let old = std::mem::take(&mut self.gpus.get_mut(gi).resident);
        let mut new = Resident::default();
        new.replace(order);
        for &m in old.iter() {
            if !new.contains(&m) {
                self.resident_on.remove(m, gi);
            }
        }
        for &m in new.iter() {
            if !old.contains(&m) {
                self.resident_on.add(m, gi);
            }
        }
        self.gpus.get_mut(gi).resident = new;
    }

    /// GPU `gi`'s resident set as its runtime reported it with an answer,
    /// plus the models of the batches sent there and not answered yet: the
    /// device runs batches in order, so a model loading behind the answered
    /// one is not in the report yet. Forgetting it made the next request
    /// for it look for another GPU and load it there too (4 GPUs of 3
    /// models, 8 models, the simulator at 1600 req/s, seed 1: 460 cold
    /// starts in 10 s and 56% within the SLO, against 9 and 99.5%).
    /// Requests still queued here are not added: the batch planner must
    /// see which of them need a load.
    fn resident_reported(&mut self, gi: usize, order: Vec<u32>) {
        self.resident_replace(gi, order);
        let coming = self.gpus[gi].outstanding_models.clone();
        for m in coming {
            if !self.gpus[gi].resident.contains(&m) {
                self.expect_resident(gi, m);
            }
        }
    }

    /// Records that `model` will be resident on GPU `gi` once the request
    /// sent there runs, and cached on its host if it has to be loaded (a
    /// resident model is served without the host cache); replies correct
    /// it.
    fn expect_resident(&mut self, gi: usize, model: u32) {
        let mut g = self.gpus.get_mut(gi);
        let fresh = !g.resident.contains(&model);
        let max = g.resident_max;
        let runtime = g.gpu.runtime;
        let gone = g.resident.touch(model, max);
        drop(g);
        for gone in gone {
            self.resident_on.remove(gone, gi);
        }
        if fresh {
            self.resident_on.add(model, gi);
            let bytes = |m: u32| self.models[m as usize].meta.bytes;
            if let Some(h) = self.hosts.get_mut(&runtime) {
                let capacity = h.cache_bytes;
                h.cached.load(model, capacity, bytes);
            }
        }
    }

    /// The most requests one batch of `model` carries.
    fn batch_max(&self, model: u32) -> u32 {
        if self.cfg.policy != PolicyKind::Slo {
            return 1;
        }
        self.cfg
            .batch_max_by_family
            .get(&self.models[model as usize].meta.family)
            .copied()
            .unwrap_or(self.cfg.batch_max)
    }

    /// Request `id` left GPU `gi`'s queue.
    fn unqueue_model(&mut self, gi: usize, id: ReqId) {
        let Some((model, ranked)) = self.reqs.get(&id).map(|r| (r.model, r.rank != u32::MAX))
        else {
            return;
        };
        let mut g = self.gpus.get_mut(gi);
        g.queued_ranked = g.queued_ranked.saturating_sub(u32::from(ranked));
        let q = &mut g.queued_models;
        if let Some(e) = q.get_mut(&model) {
            e.0 = e.0.saturating_sub(1);
            if e.0 == 0 {
                q.remove(&model);
            }
        }
    }

    /// Sends queued batches to GPU `gi` while it has room in its window.
    fn pump(&mut self, now: Micros, gi: usize, out: &mut Vec<Action>) {
        while self.gpus[gi].outstanding < self.cfg.window {
            let Some((slot, service, &id)) = self.gpus[gi].queue.iter().next() else {
                return;
            };
            if now + service > slot.0 {
                // Late even on an idle device: say so rather than run it.
                // (Estimates of the work ahead of it are estimates: one
                // that may still make it goes, and the runtime drops it if
                // its budget runs out in the device's queue.)
                self.gpus.get_mut(gi).queue.remove(slot);
                self.unqueue_model(gi, id);
                let r = self.take(id).expect("queued requests are alive");
                let message = format!(
                    "request for {} can no longer meet its {:.0} ms SLO: dropped before it ran",
                    self.models[r.model as usize].meta.name, r.slo_ms
                );
                self.fail(id, ErrorCode::DeadlineExceeded, message, out);
                continue;
            }
            let plan = self.plan_batch(now, gi);
            let ids: Vec<ReqId> = plan
                .members
                .iter()
                .map(|&slot| {
                    self.gpus
                        .get_mut(gi)
                        .queue
                        .remove(slot)
                        .expect("planned from the queue")
                        .2
                })
                .collect();
            for &id in &ids {
                self.unqueue_model(gi, id);
            }
            self.send_batch(now, gi, &ids, plan.service, out);
        }
    }

    /// The batch GPU `gi` runs next: led by the EDF head's model, or, when
    /// the head's model must be loaded, by a resident model whose batch
    /// makes no queued request late even with its own time again as margin.
    fn plan_batch(&self, now: Micros, gi: usize) -> BatchPlan {
        let g = &self.gpus[gi];
        let head = *g.queue.iter().next().expect("pumped a non-empty queue").2;
        let head_model = self.reqs[&head].model;
        if g.queued_ranked > 0 {
            // The highest-priority queued request (the earliest deadline
            // among equals) leads when its model's batch first makes no
            // queued request late, with its own time again as margin.
            let (top, top_slot, top_model) = g
                .queue
                .iter()
                .map(|(slot, _, id)| (self.reqs[id].rank, slot, self.reqs[id].model))
                .min_by_key(|&(k, ..)| k)
                .expect("pumped a non-empty queue");
            if top < self.reqs[&head].rank {
                if let Some(plan) = self.plan_top(now, gi, top_slot, top_model) {
                    return plan;
                }
            }
        }
        if self.cfg.reorder && self.cfg.efficient_order {
            return self.plan_efficient(now, gi, head_model);
        }
        if self.cfg.reorder && !g.resident.contains(&head_model) {
            // A resident model with requests queued (most recently used
            // first: the one the device keeps longest).
            let alt = g
                .resident
                .iter()
                .copied()
                .find(|m| g.queued_models.get(m).is_some_and(|q| q.0 > 0));
            if let Some(plan) = alt.and_then(|m| self.plan_for(now, gi, m, true)) {
                return plan;
            }
        }
        self.plan_head(now, gi, head_model)
    }

    /// The batch the EDF head of GPU `gi` (for `head_model`) leads.
    fn plan_head(&self, now: Micros, gi: usize, head_model: u32) -> BatchPlan {
        let g = &self.gpus[gi];
        if g.queued_models.get(&head_model).is_none_or(|q| q.0 <= 1)
            || self.batch_max(head_model) <= 1
        {
            // Nothing to coalesce: the head alone, as EDF sends it.
            let slot = g.queue.iter().next().expect("pumped a non-empty queue").0;
            return BatchPlan {
                members: vec![slot],
                service: self.head_time(gi),
            };
        }
        self.plan_for(now, gi, head_model, false)
            .expect("the head always leads its own batch")
    }

    /// The efficient order's batch for GPU `gi`: of the head model's batch
    /// and the batches of up to [`ORDER_CANDIDATES_MAX`] other resident
    /// models with requests queued (most queued first), the one of least
    /// estimated device time per request. Another model's batch qualifies
    /// only as a reordered plan ([`Self::plan_for`] with `reorder`): it
    /// makes no queued request late that EDF would end in time, with its
    /// own time again as margin. Only resident models pass the head: a
    /// load's time per request leaves out the model it evicts, which
    /// comes back as another load (`simulate`, 8 ResNet-152 variants at
    /// 700 req/s on the estimated H200 profile: 89.0% within the SLO when
    /// batches to load could pass too, 99.1% with resident ones only).
    fn plan_efficient(&self, now: Micros, gi: usize, head_model: u32) -> BatchPlan {
        let g = &self.gpus[gi];
        let mut best = self.plan_head(now, gi, head_model);
        if g.queued_models.len() <= 1 {
            return best;
        }
        let per_request = |p: &BatchPlan| p.service / p.members.len().max(1) as Micros;
        let mut best_per = per_request(&best);
        // Only models whose best case beats the head's batch are planned:
        // a plan costs a pass over the queue, the floor a few estimates.
        let mut others: Vec<(u32, u32)> = g
            .queued_models
            .iter()
            .filter(|&(&m, q)| {
                m != head_model
                    && g.resident.contains(&m)
                    && self.per_request_floor(gi, m, q.0) < best_per
            })
            .map(|(&m, q)| (q.0, m))
            .collect();
        others.sort_unstable_by(|a, b| b.cmp(a));
        others.truncate(ORDER_CANDIDATES_MAX - 1);
        for (_, m) in others {
            if let Some(plan) = self.plan_for(now, gi, m, true) {
                let per = per_request(&plan);
                if per < best_per {
                    (best, best_per) = (plan, per);
                }
            }
        }
        best
    }

    /// The least device time per request a batch of `model`'s `queued`
    /// requests could take on GPU `gi`, on the cost model: where the model
    /// is now (its queued loads only add to it), at the best batch size up
    /// to the batch bound.
    fn per_request_floor(&self, gi: usize, model: u32, queued: u32) -> Micros {
        let meta = &self.models[model as usize].meta;
        let serial = self.serial_us(gi);
        let one = self.estimate_on(gi, model, self.where_is(gi, model)) + serial;
        (1..=queued.min(self.batch_max(model)).max(1))
            .map(|n| {
                (one + self.cost.batch_extra(model, meta, n) + Micros::from(n - 1) * serial)
                    / Micros::from(n)
            })
            .min()
            .unwrap_or(one)
    }

    /// A batch led by `top`, a queued request of higher priority than GPU
    /// `gi`'s EDF head (for `model`): its model's batch when that holds it,
    /// else it alone, if either makes no queued request late with its own
    /// time again as margin.
    fn plan_top(&self, now: Micros, gi: usize, top: Slot, model: u32) -> Option<BatchPlan> {
        if let Some(plan) = self.plan_for(now, gi, model, true) {
            if plan.members.contains(&top) {
                return Some(plan);
            }
        }
        let g = &self.gpus[gi];
        let id = g.queue.iter().find(|(s, ..)| *s == top)?.2;
        let r = &self.reqs[id];
        let at = self.where_is(gi, model).max(r.at);
        let time = self.estimate_on(gi, model, at) + self.serial_us(gi);
        let start = g.busy_until.max(now) + self.cost.overhead();
        self.batch_keeps_deadlines(gi, start, &[top], 2 * time)
            .then(|| BatchPlan {
                members: vec![top],
                service: time,
            })
    }

    /// A batch of `lead`'s queued requests (in EDF order) for GPU `gi`, as
    /// large as the batch bound allows while the batch and every other
    /// queued request that EDF would finish in time still finish in time
    /// (on the cost model). `reorder`: `lead` is not the head's model; its
    /// batch must keep twice its time of slack for the requests it passes,
    /// or there is no plan.
    fn plan_for(&self, now: Micros, gi: usize, lead: u32, reorder: bool) -> Option<BatchPlan> {
        let g = &self.gpus[gi];
        let meta = &self.models[lead as usize].meta;
        let at = self.batch_at(gi, lead);
        let serial = self.serial_us(gi);
        let one = self.estimate_on(gi, lead, at) + serial;
        let max = self.batch_max(lead) as usize;
        let start = g.busy_until.max(now) + self.cost.overhead();
        let batch_time =
            |n: usize| one + self.cost.batch_extra(lead, meta, n as u32) + (n as u64 - 1) * serial;
        let mut members: Vec<Slot> = Vec::new();
        let mut member_deadline = Micros::MAX;
        // Greedy: a request of `lead` joins while the batch still ends by
        // every member's deadline and the requests it passes keep enough
        // slack. EDF's finish of item i is `edf`; its finish with the batch
        // first is edf + batch time - (service of the members before it),
        // so each passed request allows the batch up to its slack plus
        // that credit.
        let head_now = self.head_time(gi);
        let mut edf = start;
        let mut credit: Micros = 0;
        let mut allowance = Micros::MAX;
        for (i, (slot, s, id)) in g.queue.iter().enumerate() {
            let s = if i == 0 { head_now } else { s };
            edf += s;
            if members.len() < max && self.reqs[id].model == lead {
                let t = batch_time(members.len() + 1);
                let margin = if reorder { t } else { 0 };
                let fits = start + t <= member_deadline.min(slot.0) && allowance >= t + margin;
                if fits || (members.is_empty() && !reorder) {
                    members.push(slot);
                    member_deadline = member_deadline.min(slot.0);
                    credit += s;
                    continue;
                }
                if members.is_empty() {
                    return None;
                }
                break;
            }
            if edf <= slot.0 {
                allowance = allowance.min(slot.0 - edf + credit);
            }
        }
        // Exact check of the whole schedule; shrink until it holds (the
        // greedy bound misses only requests after the batch whose stored
        // service is below the increment).
        while members.len() > 1
            && !self.batch_keeps_deadlines(gi, start, &members, batch_time(members.len()))
        {
            members.pop();
        }
        if reorder && !self.batch_keeps_deadlines(gi, start, &members, batch_time(members.len())) {
            return None;
        }
        Some(BatchPlan {
            service: batch_time(members.len()),
            members,
        })
    }

    /// Whether running `members` (slots of GPU `gi`'s queue) first as one
    /// batch of `batch_time`, then the rest in EDF order, ends every member
    /// by its deadline and every other request EDF would end in time in
    /// time. Times from `start` (overhead included).
    fn batch_keeps_deadlines(
        &self,
        gi: usize,
        start: Micros,
        members: &[Slot],
        batch_time: Micros,
    ) -> bool {
        let mut t = start + batch_time;
        if members.iter().any(|m| t > m.0) {
            return false;
        }
        let head_now = self.head_time(gi);
        let mut edf = start;
        for (i, (slot, s, _)) in self.gpus[gi].queue.iter().enumerate() {
            let s = if i == 0 { head_now } else { s };
            edf += s;
            if members.contains(&slot) {
                continue;
            }
            t += s;
            if t > slot.0 && edf <= slot.0 {
                return false;
            }
        }
        true
    }

    /// The device time of GPU `gi`'s EDF head alone, where its model is now
    /// (the others keep the estimate they were admitted with: where their
    /// model will be is the head's doing).
    fn head_time(&self, gi: usize) -> Micros {
        let g = &self.gpus[gi];
        g.queue.iter().next().map_or(0, |(_, _, id)| {
            let r = &self.reqs[id];
            let at = self.where_is(gi, r.model).max(r.at);
            self.estimate_on(gi, r.model, at) + self.serial_us(gi)
        })
    }

    /// GPU `gi`'s measured device time per request beyond the cost model.
    fn serial_us(&self, gi: usize) -> Micros {
        self.gpus[gi].serial_us
    }

    /// Where `model`'s next batch on GPU `gi` finds it. Admission marks a
    /// model resident as soon as the request that loads it is queued (so
    /// later requests are admitted as warm), so residency alone would
    /// charge that load as a warm run: a queued request admitted as a
    /// load keeps its load.
    fn batch_at(&self, gi: usize, model: u32) -> Where {
        let at = self.where_is(gi, model);
        if at == Where::Remote {
            return at;
        }
        self.gpus[gi]
            .queue
            .iter()
            .map(|(_, _, id)| &self.reqs[id])
            .filter(|r| r.model == model)
            .fold(at, |a, r| a.max(r.at))
    }

    /// Sends `ids` (the first leads; all for one model) to GPU `gi` as one
    /// batch of estimated device time `service`.
    fn send_batch(
        &mut self,
        now: Micros,
        gi: usize,
        ids: &[ReqId],
        service: Micros,
        out: &mut Vec<Action>,
    ) {
        let head = ids[0];
        let model = self.reqs[&head].model;
        // Each load was admitted as the one request that finds its model
        // not resident (admission expects it resident from then on).
        let loads = ids.iter().any(|id| self.reqs[id].at != Where::Resident);
        let from_memory_servers = ids.iter().any(|id| self.reqs[id].at == Where::Remote);
        let budget = |r: &Req| r.deadline.saturating_sub(now).div_ceil(1000);
        let mut batch = Vec::with_capacity(ids.len() - 1);
        for &id in ids {
            let r = self.reqs.get_mut(&id).expect("sent requests are alive");
            r.sent_at = Some(now);
            r.gpu = Some(gi);
            r.batch = Some(head);
            if id != head {
                batch.push(BatchMate {
                    req: id,
                    budget_ms: budget(r),
                });
            }
        }
        let mut g = self.gpus.get_mut(gi);
        g.busy_until = g.busy_until.max(now) + service;
        g.work_out += service;
        g.outstanding += 1;
        g.outstanding_models.push(model);
        let gpu = g.gpu;
        drop(g);
        let n = ids.len() as u32;
        let base = service.saturating_sub(u64::from(n) * self.serial_us(gi));
        let load = from_memory_servers.then(|| self.load_started(gi, now));
        self.batches.insert(
            head,
            Batch {
                gi,
                model,
                service,
                base,
                n,
                left: n,
                released: false,
                load,
            },
        );
        let c = &mut self.counters;
        c.sent += ids.len() as u64;
        c.batches += 1;
        c.batched_requests += ids.len() as u64;
        c.model_switches += u64::from(loads);
        out.push(Action::Send {
            req: head,
            gpu,
            model: self.models[model as usize].meta.name.clone(),
            budget_ms: budget(&self.reqs[&head]),
            batch,
        });
    }

    /// The balancer of the `distmind` policy and of the baselines: sends
    /// the request now if a GPU has room, else returns false (it waits in
    /// `pending`). The baselines hold every model in every GPU server's host
    /// memory, so any GPU may serve any model: the least outstanding GPU
    /// where it is resident if one has room, else the least outstanding.
    fn route_balanced(&mut self, now: Micros, id: ReqId, out: &mut Vec<Action>) -> Routed {
        let model = self.reqs[&id].model;
        let baseline = self.cfg.policy.is_baseline();
        // Least outstanding (< 8) in three tiers: GPUs holding the model
        // (resident, or for `lor` also assigned), hosts caching it, any GPU.
        // A model some GPU holds waits for its holders rather than spreading
        // (the original's behaviour), even when every holder is full; the
        // baselines spread to any GPU.
        let holders_count = baseline || self.cfg.balancer == Balancer::LeastOutstanding;
        let mut held_somewhere = false;
        let mut best_holder = None::<(u32, usize)>;
        if holders_count {
            let assigned: &[usize] = if baseline {
                &[]
            } else {
                self.assigned_to.get(model)
            };
            for &gi in self.resident_on.get(model).iter().chain(assigned) {
                if !self.routable(gi) {
                    continue;
                }
                held_somewhere = true;
                let g = &self.gpus[gi];
                let key = (g.outstanding, gi);
                if g.outstanding < LOR_OUTSTANDING_MAX && best_holder.is_none_or(|b| key < b) {
                    best_holder = Some(key);
                }
            }
        }
        let target = if best_holder.is_some() || (held_somewhere && !baseline) {
            best_holder.map(|(_, gi)| gi)
        } else {
            self.least_outstanding_for(model)
        };
        let Some(gi) = target else {
            return if !baseline && held_somewhere {
                Routed::HoldersFull
            } else {
                Routed::NoRoom
            };
        };
        // Cache-out only for a load: a resident model never touches the
        // host cache.
        if !baseline && !self.gpus[gi].resident.contains(&model) {
            self.cache_out_for(gi, model, out);
        }
        let at = self.where_is(gi, model);
        let service = self.estimate_on(gi, model, at);
        {
            let r = self.reqs.get_mut(&id).expect("alive");
            r.at = at;
            r.service = service;
            r.est_finish = self.gpus[gi].busy_until.max(now) + service;
        }
        self.expect_resident(gi, model);
        self.bind_gpu(gi, model);
        self.send_batch(now, gi, &[id], service, out);
        Routed::Sent
    }

    /// The least outstanding routable GPU with room, one whose host caches
    /// `model` (or that has it resident) before any other. No GPU with room
    /// holds the model when this is asked.
    fn least_outstanding_for(&self, model: u32) -> Option<usize> {
        let mut best = [None::<(u32, usize)>; 2];
        // Whether the host of the GPU before caches the model: a host's GPUs
        // are usually next to each other, so one lookup serves them all.
        let mut host_caches: Option<(u32, bool)> = None;
        for gi in 0..self.gpus.len() {
            let g = &self.gpus[gi];
            if g.outstanding >= LOR_OUTSTANDING_MAX || !self.routable(gi) {
                continue;
            }
            let runtime = g.gpu.runtime;
            let cached = match host_caches {
                Some((r, c)) if r == runtime => c,
                _ => {
                    let c = self
                        .hosts
                        .get(&runtime)
                        .is_some_and(|h| h.cached.contains(&model));
                    host_caches = Some((runtime, c));
                    c
                }
            };
            let tier = usize::from(!(cached || g.resident.contains(&model)));
            let key = (g.outstanding, gi);
            if best[tier].is_none_or(|b| key < b) {
                best[tier] = Some(key);
            }
        }
        best[0].or(best[1]).map(|(_, gi)| gi)
    }

    /// Whether a GPU of `runtime` holds `model`.
    fn resident_on_host(&self, runtime: u32, model: u32) -> bool {
        self.resident_on
            .get(model)
            .iter()
            .any(|&gi| self.gpus[gi].gpu.runtime == runtime)
    }

    /// Cache-aware cache-out: before a model is pulled into a host cache
    /// that lacks it, evict models there until [`CACHE_OUT_FACTOR`] x its
    /// size fits: idle ones with the lowest request rate first (`lor`), or
    /// the least frequently used cluster-wide (`lfu`). Only the host cache:
    /// a device that holds a victim keeps it.
    fn cache_out_for(&mut self, gi: usize, model: u32, out: &mut Vec<Action>) {
        let runtime = self.gpus[gi].gpu.runtime;
        let Some(h) = self.hosts.get(&runtime) else {
            return;
        };
        if h.cache_bytes == 0 || h.cached.contains(&model) {
            return;
        }
        let need = (self.models[model as usize].meta.bytes as f64 * CACHE_OUT_FACTOR) as u64;
        let used: u64 = h
            .cached
            .iter()
            .map(|m| self.models[m as usize].meta.bytes)
            .sum();
        if used + need <= h.cache_bytes {
            return;
        }
        let mut victims: Vec<u32> = h
            .cached
            .iter()
            .filter(|&m| !self.active.contains_key(&(runtime, m)))
            .collect();
        match self.cfg.balancer {
            // Models a GPU of this host holds first: they are served from the
            // device, so the host copy is the one not needed now.
            Balancer::LeastOutstanding => victims.sort_by_key(|&m| {
                (
                    !self.resident_on_host(runtime, m),
                    (self.models[m as usize].rate.get().unwrap_or(0.0) * 1e6) as u64,
                )
            }),
            Balancer::Lfu => victims.sort_by_key(|&m| self.models[m as usize].uses),
        }
        let mut freed = 0;
        let mut evict = Vec::new();
        for m in victims {
            if used - freed + need <= h.cache_bytes {
                break;
            }
            freed += self.models[m as usize].meta.bytes;
            evict.push(m);
        }
        let h = self.hosts.get_mut(&runtime).expect("looked up above");
        for m in evict {
            h.cached.remove(&m);
            self.counters.evictions += 1;
            out.push(Action::Evict {
                runtime,
                model: self.models[m as usize].meta.name.clone(),
            });
        }
    }

    /// A reply to `req` arrived at `now`. Returns the dispatch record for
    /// the client, or `None` for an unknown id (already failed).
    pub fn complete(
        &mut self,
        now: Micros,
        req: ReqId,
        c: &Completion<'_>,
        out: &mut Vec<Action>,
    ) -> Option<DispatchInfo> {
        self.clock = self.clock.max(now);
        // Only a request in flight can be answered: one that is queued
        // again (its runtime was lost and its late reply came anyway) waits
        // for the GPU it is queued for.
        if self.waits_to_be_sent(req) {
            log::debug!(
                "dispatcher: a reply for request {req}, which is not in flight, is dropped"
            );
            return None;
        }
        // The batch's first answer frees its window slot: the device ran it.
        let open =
            open_batch(&self.batches, self.reqs.get(&req)).map(|b| (b.base, b.n, b.gi, b.load));
        let answered = open.map(|(base, n, ..)| (base, n));
        // The loads that shared its link, its own included, while its batch
        // loaded the model (read before the first answer releases it).
        let share = match open {
            Some((_, _, gi, Some(mark))) => self.load_share(gi, Some(mark), now),
            _ => 1.0,
        };
        let r = self.take(req)?;
        let gi = r.gpu?;
        // It answers: it is routed to (again).
        self.gpus.answered(gi, now);
        // The device's first run pays one-time costs (TimingMsg::warmup):
        // neither its serial time nor its service time is learnt from.
        let warmup = c.timing.is_some_and(|t| t.warmup);
        if let Some((base, n)) = answered {
            let mut g = self.gpus.get_mut(gi);
            if let Some(since) = g.busy_since.filter(|_| !warmup) {
                // Capped: one stall (a page fault storm, a descheduled
                // server) must not shut admission for a while.
                let extra = (now.saturating_sub(since).saturating_sub(base)).min(4 * base);
                g.serial.observe(extra as f64 / f64::from(n.max(1)));
                g.serial_us = g.serial.get().map_or(0, |v| v.round() as Micros);
            }
            // The next interval measures the device only when it went
            // straight on to an inference batch.
            let continuous = g.outstanding > 0 && g.prefetch_work == 0 && g.training.is_none();
            g.busy_since = continuous.then_some(now);
            // Busy for what is still outstanding, from now: estimates that
            // ran long or short do not accumulate over a busy period.
            g.busy_until = now + g.work_out + g.prefetch_work;
        }
        let total_ms = (now - r.arrival) as f64 / 1e3;
        if let Some(t) = c.timing {
            let at = match t.path {
                ServePath::DeviceResident => Where::Resident,
                ServePath::HostCached => Where::HostCached,
                ServePath::Cold => Where::Remote,
            };
            let rtt = r.sent_at.map(|s| (now - s) as f64 / 1e3);
            let meta = &self.models[r.model as usize].meta;
            let mut service_ms = t.total_ms - t.queue_ms;
            if at == Where::Remote && !warmup {
                service_ms = self.cost.load_alone_ms(
                    r.model,
                    meta,
                    service_ms,
                    t.fetch_ms,
                    t.fetched_bytes,
                    share,
                );
            }
            if warmup {
                log::debug!(
                    "dispatcher: {}'s {:.1} ms on {} is its device's warm-up, not learnt from",
                    meta.name,
                    service_ms,
                    self.gpus[gi].gpu
                );
            } else if t.batch_requests <= 1 {
                self.cost
                    .observe(r.model, meta, at, service_ms, rtt, t.total_ms);
            } else if answered.is_some() {
                // One observation per batch.
                self.cost
                    .observe_batch(r.model, meta, at, t.batch_requests, service_ms);
                if let Some(rtt) = rtt {
                    self.cost.observe_overhead(rtt, t.total_ms);
                }
            }
            let resident: Vec<u32> = c
                .resident
                .iter()
                .filter_map(|n| self.by_name.get(n).copied())
                .collect();
            if !c.resident.is_empty() {
                self.resident_reported(gi, resident);
            }
            self.counters.completed += 1;
            if total_ms <= r.slo_ms {
                self.counters.completed_within_slo += 1;
            }
        }
        let gpu = self.gpus[gi].gpu;
        match self.cfg.policy {
            PolicyKind::Slo => self.pump(now, gi, out),
            PolicyKind::DistMind | PolicyKind::Mps | PolicyKind::Ray | PolicyKind::Gpu => {
                self.drain_pending(now, out)
            }
        }
        Some(DispatchInfo {
            runtime: gpu.runtime,
            device: gpu.device,
            slo_ms: r.slo_ms,
            estimated_ms: r.est_finish.saturating_sub(r.arrival) as f64 / 1e3,
            dispatch_queue_ms: r.sent_at.map_or(0.0, |s| (s - r.arrival) as f64 / 1e3),
            total_ms,
        })
    }

    /// Routes waiting requests (FIFO) while GPUs have room; fails those
    /// whose deadline passed. Routing only ever fills GPUs, so once no GPU
    /// has room, or a model's holders are full, the requests after wait too
    /// without being tried (a drain costs the waiting requests, not them
    /// times the GPUs).
    fn drain_pending(&mut self, now: Micros, out: &mut Vec<Action>) {
        if self.cfg.policy == PolicyKind::Slo {
            // Under `slo` only requests that came while no GPU server was up
            // yet wait here: each is routed again (it waits on while none is).
            for id in std::mem::take(&mut self.pending) {
                let Some(r) = self.take(id) else { continue };
                if now > r.deadline {
                    self.fail_waited(now, id, &r, "a GPU server to start", out);
                } else {
                    self.route_slo(now, id, r, out);
                }
            }
            return;
        }
        let mut still = VecDeque::new();
        let mut no_room = false;
        let mut holders_full: IdSet<u32> = IdSet::default();
        while let Some(id) = self.pending.pop_front() {
            let Some(r) = self.reqs.get(&id) else {
                continue;
            };
            if now > r.deadline {
                let r = self.take(id).expect("looked up");
                self.fail_waited(now, id, &r, "a GPU", out);
                continue;
            }
            let model = r.model;
            if no_room || holders_full.contains(&model) {
                still.push_back(id);
                continue;
            }
            match self.route_balanced(now, id, out) {
                Routed::Sent => {}
                Routed::HoldersFull => {
                    holders_full.insert(model);
                    still.push_back(id);
                }
                Routed::NoRoom => {
                    no_room = true;
                    still.push_back(id);
                }
            }
        }
        self.pending = still;
    }

    /// Fails request `id` (`r`, taken from `pending`) that waited in vain
    /// for `what` past its deadline.
    fn fail_waited(&mut self, now: Micros, id: ReqId, r: &Req, what: &str, out: &mut Vec<Action>) {
        let message = format!(
            "request for {} waited {:.0} ms for {what}, past its {:.0} ms SLO",
            self.models[r.model as usize].meta.name,
            (now - r.arrival) as f64 / 1e3,
            r.slo_ms
        );
        self.fail(id, ErrorCode::DeadlineExceeded, message, out);
    }

    /// Periodic work at `now`: the policy's placement, training roles,
    /// demand tracking, expiry of waiting requests.
    pub fn tick(&mut self, now: Micros, out: &mut Vec<Action>) {
        self.clock = self.clock.max(now);
        // Demand: requests per second per model, smoothed; per emulated
        // second on a dilated clock (K times the real clock's rate).
        let window = now.saturating_sub(self.last_rate_at);
        if window >= 100_000 {
            let k = self.cfg.time_dilation;
            for m in &mut self.models {
                m.rate.observe(m.recent as f64 * 1e6 * k / window as f64);
                m.recent = 0;
            }
            if let Some(t) = self.split.slo_window.take() {
                self.split.slo_tightest = Some(t);
            }
            self.last_rate_at = now;
        }
        self.expire_overdue(now, out);
        match self.cfg.policy {
            PolicyKind::DistMind => {
                self.distmind.tick(now);
                self.apply_distmind(now, out);
                self.drain_pending(now, out);
            }
            PolicyKind::Slo => {
                self.drain_pending(now, out);
                self.share_with_training(now, out);
                self.prefetch_hot(now, out);
            }
            // No placement and no training: requests wait for a GPU only.
            PolicyKind::Mps | PolicyKind::Ray | PolicyKind::Gpu => self.drain_pending(now, out),
        }
    }

    /// Answers, at a tick, the requests that can only be late now: those
    /// in flight past their deadline by their grace ([`overdue_at`]) and
    /// those queued for a GPU past their deadline (a GPU that answers
    /// nothing pumps its queue no more), both `deadline_exceeded`; and any
    /// a runtime has held for over [`OUTSTANDING_TIMEOUT_US`] (times the
    /// time dilation), `internal`. A reply that comes after its request was
    /// given up is dropped. A GPU that left a request unanswered so long,
    /// and answered nothing for longer than that request's grace, goes
    /// [`silent`](GpuState::silent): its queue moves to other GPUs at once.
    /// (One that answers is working through a backlog, not hung.) A
    /// runtime that hangs (stopped, or its host cut off) is declared lost
    /// only after its missed heartbeats, seconds later; its clients are
    /// answered, or served elsewhere, by then.
    fn expire_overdue(&mut self, now: Micros, out: &mut Vec<Action>) {
        let timeout_us = (OUTSTANDING_TIMEOUT_US as f64 * self.cfg.time_dilation) as Micros;
        let stuck: Vec<(ReqId, bool)> = self
            .reqs
            .iter()
            .filter_map(|(&id, r)| {
                let sent = r.sent_at?;
                if now.saturating_sub(sent) > timeout_us {
                    Some((id, false))
                } else {
                    (now > overdue_at(r)).then_some((id, true))
                }
            })
            .collect();
        for (id, overdue) in stuck {
            let r = self.take(id).expect("listed above");
            let Some(gi) = r.gpu else { continue };
            let gpu = self.gpus[gi].gpu;
            let name = &self.models[r.model as usize].meta.name;
            let late_ms = now.saturating_sub(r.deadline) as f64 / 1e3;
            let message = if overdue {
                format!(
                    "request for {name}: {gpu} has not answered it {late_ms:.0} ms past its \
                     {:.0} ms SLO (it may hang); given up",
                    r.slo_ms
                )
            } else {
                format!(
                    "request for {name} got no reply from {gpu} within {} s; retry it",
                    timeout_us / 1_000_000
                )
            };
            let code = if overdue {
                ErrorCode::DeadlineExceeded
            } else {
                ErrorCode::Internal
            };
            self.fail(id, code, message, out);
            let quiet = now.saturating_sub(self.gpus[gi].answered_at) > grace(&r);
            if quiet && !self.gpus[gi].silent {
                // Routed to no more until it answers, or heartbeats with
                // nothing waiting on it; what is queued for it goes
                // elsewhere now.
                log::warn!(
                    "dispatcher: {gpu} left a request unanswered {late_ms:.0} ms past its \
                     deadline and answered nothing for {:.0} ms; nothing is routed to it until \
                     it answers, or heartbeats with nothing waiting on it",
                    now.saturating_sub(self.gpus[gi].answered_at) as f64 / 1e3
                );
                let mut g = self.gpus.get_mut(gi);
                g.silent = true;
                let queued: Vec<ReqId> = g.queue.drain();
                g.queued_models.clear();
                g.queued_ranked = 0;
                drop(g);
                let reason: Arc<str> = Arc::from(format!(
                    "{gpu} has not answered a request {late_ms:.0} ms past its deadline"
                ));
                self.move_requests(now, queued, &reason, out);
            }
        }
        for gi in 0..self.gpus.len() {
            let late: Vec<(Slot, ReqId)> = self.gpus[gi]
                .queue
                .iter()
                .take_while(|(slot, _, _)| slot.0 < now)
                .map(|(slot, _, &id)| (slot, id))
                .collect();
            for (slot, id) in late {
                self.gpus.get_mut(gi).queue.remove(slot);
                self.unqueue_model(gi, id);
                let r = self.take(id).expect("queued requests are alive");
                let message = format!(
                    "request for {} waited in the queue for {} past its {:.0} ms SLO: dropped \
                     before it ran",
                    self.models[r.model as usize].meta.name, self.gpus[gi].gpu, r.slo_ms
                );
                self.fail(id, ErrorCode::DeadlineExceeded, message, out);
            }
        }
    }

    fn train_model(&self) -> Option<&str> {
        if !self.cfg.distmind.use_train {
            return None;
        }
        self.cfg.train_model.as_deref()
    }

    /// `distmind`: roles and placements as the policy says; training GPUs
    /// get the training job, inference GPUs prefetch their model.
    fn apply_distmind(&mut self, now: Micros, out: &mut Vec<Action>) {
        let train = self.train_model().map(str::to_string);
        for gi in 0..self.gpus.len() {
            let gpu = self.gpus[gi].gpu;
            let Some(a) = self.distmind.assignment(gpu) else {
                continue;
            };
            if !self.hosts.get(&gpu.runtime).is_some_and(|h| h.link_up) {
                continue;
            }
            let retry = a.role == GpuRole::Training
                && self.gpus[gi].train_retry_at.is_some_and(|t| now >= t);
            if self.gpus[gi].role != a.role || retry {
                let mut g = self.gpus.get_mut(gi);
                g.role = a.role;
                g.train_retry_at = None;
                drop(g);
                let job = match a.role {
                    GpuRole::Training => train.clone(),
                    GpuRole::Inference => None,
                };
                if job.is_some() || self.training_started.remove(&gpu) {
                    if job.is_some() {
                        self.training_started.insert(gpu);
                    }
                    out.push(Action::Train { gpu, model: job });
                }
            }
            let assigned = a.model.map(|m| m as u32);
            if let Some(old) = self.gpus[gi].assigned {
                self.assigned_to.remove(old, gi);
            }
            if let Some(m) = assigned {
                self.assigned_to.add(m, gi);
            }
            self.gpus.get_mut(gi).assigned = assigned;
            if a.role == GpuRole::Inference {
                if let Some(m) = a.model {
                    let m = m as u32;
                    // Loaded ahead only onto an idle GPU: a prefetch goes
                    // through the device's queue, and on a busy GPU it
                    // would delay the requests behind it for a model none
                    // of them asked for (a request for it loads it anyway).
                    let g = &self.gpus[gi];
                    if !g.resident.contains(&m) && !g.prefetching && g.outstanding == 0 {
                        self.occupy_with_prefetch(now, gi, m);
                        self.cache_out_for(gi, m, out);
                        self.expect_resident(gi, m);
                        self.counters.prefetches += 1;
                        out.push(Action::Prefetch {
                            gpu,
                            model: self.models[m as usize].meta.name.clone(),
                        });
                    }
                }
            }
        }
    }

    /// `slo` with training on: which GPUs run the training job between
    /// requests (a runtime yields to inference at iteration boundaries).
    /// Every GPU trains while no request calls for one, and whenever an
    /// iteration is short next to the tightest SLO requested
    /// ([`MIX_ITERATION_SHARE`]). Where it is longer, a request on a
    /// training GPU would wait out its deadline for the GPU to yield: as
    /// many GPUs as [`Self::training_reserve`] says stay inference-only
    /// (those not training, then those holding the most requested models,
    /// first) and the rest train. A GPU told to stop is counted busy for
    /// one more iteration, the most it takes to yield.
    fn share_with_training(&mut self, now: Micros, out: &mut Vec<Action>) {
        let Some(train) = self.train_model().map(str::to_string) else {
            return;
        };
        let reserve = self.training_reserve(now);
        let mut reserved = vec![false; self.gpus.len()];
        if reserve > 0 {
            let held = |g: &GpuState| -> f64 {
                g.resident
                    .iter()
                    .map(|&m| self.models[m as usize].rate.get().unwrap_or(0.0))
                    .sum()
            };
            let mut order: Vec<(bool, f64, usize)> = (0..self.gpus.len())
                .filter(|&gi| self.gpus[gi].link_up && !self.gpus[gi].silent)
                .map(|gi| {
                    let g = &self.gpus[gi];
                    (self.training_started.contains(&g.gpu), held(g), gi)
                })
                .collect();
            order.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)).then(a.2.cmp(&b.2)));
            for &(_, _, gi) in order.iter().take(reserve) {
                reserved[gi] = true;
            }
        }
        let iteration = self.split.iteration;
        let started = &mut self.training_started;
        for (gi, &reserved) in reserved.iter().enumerate() {
            let mut g = self.gpus.get_mut(gi);
            if g.train_retry_at.is_some_and(|t| now >= t) {
                g.train_retry_at = None;
                started.remove(&g.gpu);
            }
            if reserved {
                if started.remove(&g.gpu) {
                    out.push(Action::Train {
                        gpu: g.gpu,
                        model: None,
                    });
                    g.training = None;
                    g.busy_until = g.busy_until.max(now) + iteration;
                }
            } else if g.train_retry_at.is_none() && g.link_up && started.insert(g.gpu) {
                out.push(Action::Train {
                    gpu: g.gpu,
                    model: Some(train.clone()),
                });
                g.training = Some(TrainingJob {
                    started_at: 0,
                    iteration,
                });
            }
        }
    }

    /// While `slo` splits GPUs between inference and training, GPU `gi`
    /// trains and serves no request.
    fn trains_only(&self, gi: usize) -> bool {
        self.split.reserve > 0 && self.training_started.contains(&self.gpus[gi].gpu)
    }

    /// How many GPUs `slo` keeps from training now (see
    /// [`Self::share_with_training`]): all until the first demand is
    /// measured ([`Self::tick`]'s first rate window); then none while fewer than
    /// [`RESERVE_MIN_RATE`] requests a second come, or while an iteration
    /// is short enough to mix; else the fewest that [`reserve_for`] finds
    /// enough, at least one. More at once; fewer only once the demand has
    /// called for fewer for [`RESERVE_HOLD_US`].
    fn training_reserve(&mut self, now: Micros) -> usize {
        let usable: Vec<&GpuState> = self
            .gpus
            .iter()
            .filter(|g| g.link_up && !g.silent)
            .collect();
        let rate: f64 = self.models.iter().filter_map(|m| m.rate.get()).sum();
        let iteration = self.split.iteration as f64;
        let mixes = iteration > 0.0
            && self
                .split
                .slo_tightest
                .is_some_and(|slo| iteration <= MIX_ITERATION_SHARE * slo as f64);
        let (wanted, lower_to) = if self.last_rate_at == 0 {
            // No demand measured yet: nothing trains before it is.
            (usable.len(), usable.len())
        } else if usable.is_empty() || rate < RESERVE_MIN_RATE || mixes {
            (0, 0)
        } else {
            let k = 1e6 * self.cfg.time_dilation;
            // Per model, most requested first: its demand in GPUs where it
            // is resident, and where it has to be loaded.
            let mut demand: Vec<(f64, f64, u64)> = self
                .models
                .iter()
                .enumerate()
                .filter_map(|(i, m)| {
                    let r = m.rate.get().filter(|&r| r > 0.0)?;
                    let at = |w| self.cost.estimate(i as u32, &m.meta, w) as f64 * r / k;
                    Some((at(Where::Resident), at(Where::Remote), m.meta.bytes))
                })
                .collect();
            demand.sort_by(|a, b| b.0.total_cmp(&a.0));
            let largest = demand.iter().map(|d| d.2).max().unwrap_or(1).max(1);
            let slots = usable
                .iter()
                .map(|g| match g.device_bytes {
                    0 => g.resident_max,
                    b => g.resident_max.min((b / largest) as usize),
                })
                .min()
                .unwrap_or(1);
            let (resident, loaded): (Vec<f64>, Vec<f64>) =
                demand.iter().map(|d| (d.0, d.1)).unzip();
            let at = |load| reserve_for(&resident, &loaded, slots, usable.len(), load);
            (at(RESERVE_LOAD), at(RESERVE_LOWER_LOAD))
        };
        let s = &mut self.split;
        let before = s.reserve;
        if wanted >= s.reserve {
            s.reserve = wanted;
            s.lower = None;
        } else if lower_to >= s.reserve {
            s.lower = None;
        } else {
            let (since, most) = s.lower.get_or_insert((now, lower_to));
            *most = (*most).max(lower_to);
            let hold = (RESERVE_HOLD_US as f64 * self.cfg.time_dilation) as Micros;
            if now.saturating_sub(*since) >= hold {
                s.reserve = *most;
                s.lower = None;
            }
        }
        if s.reserve != before {
            log::debug!(
                "dispatcher: {} of {} GPUs kept from training ({rate:.1} requests/s, \
                 iteration {:.1} ms, tightest SLO {:?} us)",
                s.reserve,
                usable.len(),
                iteration / 1e3,
                s.slo_tightest
            );
        }
        s.reserve.min(usable.len())
    }

    /// `slo` demand-driven placement: each idle GPU prefetches one model.
    /// First the most requested model resident nowhere, when it is clearly
    /// more requested than every model the GPU holds (loading it may push
    /// one out: hot models stay resident). Else another copy of the model
    /// whose holders are the busiest with it, when its demand would keep
    /// each of them more than [`REPLICA_LOAD`] busy and the GPU has room
    /// for it and one more model besides (so a copy never makes a later
    /// load evict; a model's device bytes are taken as its stored bytes,
    /// and where the GPU's memory is not known it takes no copies):
    /// routing sends a request to a GPU that holds its model whenever one
    /// meets the deadline, so a hot model held by few GPUs queues there
    /// while others idle. While GPUs are split between inference and
    /// training, those that train neither take a model nor count as
    /// holding one.
    ///
    /// A prefetch from the memory servers starts only while no GPU of its
    /// server loads from them: it is work no request waits for, and on a
    /// shared link it slowed the loads requests did wait for, after they
    /// were admitted on estimates that had not counted it. (`simulate`, one
    /// GPU server of 4 GPUs, 64 ResNet-152, 100 req/s, Zipf 0.9, 100 ms
    /// SLO, 30 s, seeds 0-9: within the SLO at 25/40/50 Gbit/s 27/78/90%
    /// with prefetches started regardless, 82/93/97% this way; mps
    /// 24/85/93%.)
    fn prefetch_hot(&mut self, now: Micros, out: &mut Vec<Action>) {
        let mut hot: Vec<(u64, u32)> = Vec::new();
        // (model, its demand in GPUs busy with it, its holders)
        let mut spread: Vec<(u32, f64, usize)> = Vec::new();
        let split = self.split.reserve > 0;
        for (i, m) in self.models.iter().enumerate() {
            let Some(rate) = m.rate.get() else { continue };
            let id = i as u32;
            let holders = match split {
                false => self.resident_on.get(id).len(),
                true => {
                    let holders = self.resident_on.get(id).iter();
                    holders.filter(|&&gi| !self.trains_only(gi)).count()
                }
            };
            if holders == 0 {
                if rate >= 0.5 {
                    hot.push(((rate * 1e3) as u64, id));
                }
                continue;
            }
            let demand = rate * self.cost.estimate(id, &m.meta, Where::Resident) as f64
                / 1e6
                / self.cfg.time_dilation;
            if demand > REPLICA_LOAD * holders as f64 {
                spread.push((id, demand, holders));
            }
        }
        hot.sort_unstable_by(|a, b| b.cmp(a));
        let mut hot = hot.into_iter().peekable();
        let largest = self.models.iter().map(|m| m.meta.bytes).max().unwrap_or(0);
        for gi in 0..self.gpus.len() {
            let idle = {
                let g = &self.gpus[gi];
                g.outstanding == 0 && g.queue.is_empty() && !g.prefetching
            };
            if !idle || self.trains_only(gi) || !self.routable(gi) {
                continue;
            }
            // Whether a load from the memory servers may start here now.
            let runtime = self.gpus[gi].gpu.runtime;
            let link_free = self.hosts.get(&runtime).is_none_or(|h| h.link.loads() == 0)
                && self.memservers_share(runtime, true) <= 1.0;
            let can_load = |m: u32| link_free || self.where_is(gi, m) != Where::Remote;
            let m = match hot.peek().copied() {
                // Left for a GPU of another server.
                Some((_, m)) if !can_load(m) => continue,
                Some((rate, m)) => {
                    hot.next();
                    let coldest_held = self.gpus[gi]
                        .resident
                        .iter()
                        .map(|&r| (self.models[r as usize].rate.get().unwrap_or(0.0) * 1e3) as u64)
                        .min();
                    if coldest_held.is_some_and(|c| rate * 2 < c * 3) {
                        continue;
                    }
                    m
                }
                None => {
                    let g = &self.gpus[gi];
                    let bytes = |m: u32| self.models[m as usize].meta.bytes;
                    if spread.is_empty() || g.resident.len() + 2 > g.resident_max {
                        continue;
                    }
                    let used: u64 = g.resident.iter().map(|&r| bytes(r)).sum();
                    let spare = g.device_bytes.saturating_sub(used).saturating_sub(largest);
                    let busiest = spread
                        .iter_mut()
                        .filter(|(m, demand, holders)| {
                            !g.resident.contains(m)
                                && can_load(*m)
                                && bytes(*m) <= spare
                                && *demand > REPLICA_LOAD * *holders as f64
                        })
                        .max_by(|a, b| (a.1 / a.2 as f64).total_cmp(&(b.1 / b.2 as f64)));
                    let Some((m, _, holders)) = busiest else {
                        continue;
                    };
                    *holders += 1;
                    *m
                }
            };
            let gpu = self.gpus[gi].gpu;
            self.occupy_with_prefetch(now, gi, m);
            self.expect_resident(gi, m);
            self.counters.prefetches += 1;
            out.push(Action::Prefetch {
                gpu,
                model: self.models[m as usize].meta.name.clone(),
            });
        }
    }

    /// A prefetch goes through the device's queue like a request: requests
    /// routed after it wait for its load.
    fn occupy_with_prefetch(&mut self, now: Micros, gi: usize, model: u32) {
        let meta = &self.models[model as usize].meta;
        let at = self.where_is(gi, model);
        let load = self
            .estimate_on(gi, model, at)
            .saturating_sub(self.cost.estimate(model, meta, Where::Resident));
        self.end_prefetch_load(gi);
        let mark = (at == Where::Remote).then(|| self.load_started(gi, now));
        let mut g = self.gpus.get_mut(gi);
        g.prefetching = true;
        g.prefetch_work = load;
        g.prefetch_load = mark;
        g.busy_until = g.busy_until.max(now) + load;
    }

    /// GPU `gi`'s prefetch, if it loads from the memory servers, no longer
    /// counts on its GPU server's link.
    fn end_prefetch_load(&mut self, gi: usize) {
        if self.gpus.get_mut(gi).prefetch_load.take().is_some() {
            self.load_ended(gi);
        }
    }

    /// GPU `gi` sends a job that loads from the memory servers at `now`:
    /// where on its GPU server's link it starts. The GPU counts there from
    /// its first such job until its last is answered.
    fn load_started(&mut self, gi: usize, now: Micros) -> LoadMark {
        let runtime = self.gpus[gi].gpu.runtime;
        let first = {
            let mut g = self.gpus.get_mut(gi);
            g.link_loads += 1;
            g.link_loads == 1
        };
        if first {
            self.hosts.entry(runtime).or_default().link.start(now);
            self.update_memservers_share(now);
        }
        self.hosts.entry(runtime).or_default().link.mark(now)
    }

    /// One of GPU `gi`'s jobs that loaded from the memory servers ended.
    fn load_ended(&mut self, gi: usize) {
        let runtime = self.gpus[gi].gpu.runtime;
        let last = {
            let mut g = self.gpus.get_mut(gi);
            if g.link_loads == 0 {
                return;
            }
            g.link_loads -= 1;
            g.link_loads == 0
        };
        if last {
            if let Some(h) = self.hosts.get_mut(&runtime) {
                h.link.end(self.clock);
                self.update_memservers_share(self.clock);
            }
        }
    }

    /// Device time of model `model` on GPU `gi` where it is `at`: a load
    /// from the memory servers shares the GPU server's link with the other
    /// GPUs of that server that load.
    fn estimate_on(&self, gi: usize, model: u32, at: Where) -> Micros {
        let g = &self.gpus[gi];
        self.estimates_on_host(g.gpu.runtime, model, at)[usize::from(g.link_loads > 0)]
    }

    /// [`Self::estimate_on`] a GPU of `runtime` that does not load, and one
    /// that does (its own loads run before this one, not beside it).
    fn estimates_on_host(&self, runtime: u32, model: u32, at: Where) -> [Micros; 2] {
        let meta = &self.models[model as usize].meta;
        if at != Where::Remote {
            return [self.cost.estimate(model, meta, at); 2];
        }
        self.load_times(runtime, self.cost.load_cost(model, meta))
    }

    /// A load of cost `load` on a GPU of `runtime` that does not load, and
    /// on one that does.
    fn load_times(&self, runtime: u32, load: LoadCost) -> [Micros; 2] {
        let loading = self.hosts.get(&runtime).map_or(0, |h| h.link.loads());
        // A GPU that does not load adds a load to both sides; one that
        // loads is counted on both already.
        let idle = f64::from(loading + 1).max(self.memservers_share(runtime, true));
        let busy = f64::from(loading.max(1)).max(self.memservers_share(runtime, false));
        [idle, busy].map(|share| load.sharing(share - 1.0))
    }

    /// The memory servers serving the cluster's loads (0: unknown; then
    /// only the GPU servers' links are counted); see `dispatch/link.rs`.
    pub fn set_memservers(&mut self, now: Micros, count: u32) {
        self.clock = self.clock.max(now);
        if count != self.memservers {
            self.memservers = count;
            self.update_memservers_share(now);
        }
    }

    /// The share of the memory servers' links a load on a GPU of `runtime`
    /// has, with one more load there (`one_more`) or as the loads are
    /// (0 while the memory servers are unknown).
    fn memservers_share(&self, runtime: u32, one_more: bool) -> f64 {
        if self.memservers == 0 {
            return 0.0;
        }
        if !one_more {
            return self.mem_share;
        }
        let here = self.hosts.get(&runtime).map_or(0, |h| h.link.loads());
        if self.loading_hosts + u32::from(here == 0) <= self.memservers {
            return 1.0;
        }
        let mut loads: Vec<u32> = self
            .hosts
            .iter()
            .map(|(&r, h)| h.link.loads() + u32::from(r == runtime))
            .collect();
        if !self.hosts.contains_key(&runtime) {
            loads.push(1);
        }
        link::memservers_share(&mut loads, self.memservers)
    }

    /// The loads on some GPU server's link changed at `now`: the memory
    /// servers' share is worked out again and every link learns it.
    fn update_memservers_share(&mut self, now: Micros) {
        let mut loads: Vec<u32> = self.hosts.values().map(|h| h.link.loads()).collect();
        self.loading_hosts = loads.iter().filter(|&&n| n > 0).count() as u32;
        self.mem_share = match self.memservers {
            0 => 0.0,
            m => link::memservers_share(&mut loads, m),
        };
        for h in self.hosts.values_mut() {
            h.link.set_floor(now, self.mem_share);
        }
    }

    /// The runtime refused a `Train` for `gpu` (the job's model may not be
    /// deployed yet): it is asked again [`TRAIN_RETRY_US`] (dilated) later,
    /// while the policy still wants it to train.
    pub fn train_failed(&mut self, now: Micros, gpu: Gpu) {
        self.clock = self.clock.max(now);
        let retry_us = (TRAIN_RETRY_US as f64 * self.cfg.time_dilation) as Micros;
        if let Some(gi) = self.gpus.iter().position(|g| g.gpu == gpu) {
            self.gpus.get_mut(gi).train_retry_at = Some(now + retry_us);
        }
    }

    /// A prefetch of `model` on `gpu` finished at the runtime: it took
    /// `ms` and found the model `path` (nothing to do when resident). The
    /// load it measured is what a request that finds the model there
    /// pays beyond its compute.
    pub fn prefetched(&mut self, now: Micros, gpu: Gpu, model: &str, path: ServePath, ms: f64) {
        self.clock = self.clock.max(now);
        let Some(id) = self.by_name.get(model).copied() else {
            return;
        };
        let Some(gi) = self.gpus.iter().position(|g| g.gpu == gpu) else {
            return;
        };
        if !ms.is_finite() || ms < 0.0 {
            return;
        }
        let at = match path {
            ServePath::DeviceResident => return,
            ServePath::HostCached => Where::HostCached,
            ServePath::Cold => Where::Remote,
        };
        let meta = self.models[id as usize].meta.clone();
        let compute = self.cost.estimate(id, &meta, Where::Resident) as f64 / 1e3;
        let mut service = ms + compute;
        if at == Where::Remote {
            // Its `ms` is the fetch (bytes not reported: the link's rate is
            // learnt from requests).
            let share = self.load_share(gi, self.gpus[gi].prefetch_load, now);
            service = self.cost.load_alone_ms(id, &meta, service, ms, 0, share);
        }
        self.cost.observe(id, &meta, at, service, None, 0.0);
    }

    /// The mean number of GPUs loading on GPU `gi`'s server link since
    /// `mark` (a load's start), 1 without one.
    fn load_share(&mut self, gi: usize, mark: Option<LoadMark>, now: Micros) -> f64 {
        let runtime = self.gpus[gi].gpu.runtime;
        match (mark, self.hosts.get_mut(&runtime)) {
            (Some(mark), Some(h)) => h.link.share_since(mark, now),
            _ => 1.0,
        }
    }

    /// A prefetch finished (or failed) at `now`: the GPU may prefetch again,
    /// and is busy only with what it has outstanding.
    pub fn prefetch_done(&mut self, now: Micros, gpu: Gpu, resident: Option<&[String]>) {
        self.clock = self.clock.max(now);
        if let Some(gi) = self.gpus.iter().position(|g| g.gpu == gpu) {
            self.end_prefetch_load(gi);
            let mut g = self.gpus.get_mut(gi);
            g.prefetching = false;
            g.prefetch_work = 0;
            g.busy_until = now + g.work_out;
            drop(g);
            if let Some(names) = resident {
                let ids = names
                    .iter()
                    .filter_map(|n| self.by_name.get(n).copied())
                    .collect();
                self.resident_replace(gi, ids);
            }
        }
    }

    /// What every GPU does, for subscribers.
    pub fn assignments(&self) -> Vec<GpuAssignment> {
        self.gpus
            .iter()
            .map(|g| {
                let models = match self.cfg.policy {
                    PolicyKind::DistMind => match self.distmind.assignment(g.gpu) {
                        Some(a) if a.role == GpuRole::Training => {
                            self.train_model().map(str::to_string).into_iter().collect()
                        }
                        Some(a) => a
                            .model
                            .map(|m| self.models[m].meta.name.clone())
                            .into_iter()
                            .collect(),
                        None => Vec::new(),
                    },
                    PolicyKind::Slo | PolicyKind::Mps | PolicyKind::Ray | PolicyKind::Gpu => g
                        .resident
                        .iter()
                        .map(|&m| self.models[m as usize].meta.name.clone())
                        .collect(),
                };
                GpuAssignment {
                    runtime: g.gpu.runtime,
                    device: g.gpu.device,
                    role: g.role,
                    models,
                }
            })
            .collect()
    }

    /// The last snapshot sequence number applied for `runtime` (0: none).
    pub fn snapshot_seq(&self, runtime: u32) -> u64 {
        self.hosts.get(&runtime).map_or(0, |h| h.snapshot_seq)
    }
}

/// When a request in flight is given up: its deadline plus a grace of its
/// SLO, or of four times its batch's estimated device time where that is
/// longer. A runtime that works answers within its deadline and one batch
/// (it drops a request whose deadline passed in its queue); the grace
/// covers estimates that run short (a first load of a model) many times
/// over.
fn overdue_at(r: &Req) -> Micros {
    r.deadline + grace(r)
}

/// [`overdue_at`]'s grace.
fn grace(r: &Req) -> Micros {
    let slo = (r.slo_ms * 1e3) as Micros;
    slo.max(4 * r.service)
}

/// Whether `r` (alive) belongs to a batch none of whose members has been
/// answered yet.
/// The batch of `r` while it still holds its GPU's window slot.
fn open_batch<'a>(batches: &'a IdMap<ReqId, Batch>, r: Option<&Req>) -> Option<&'a Batch> {
    r.and_then(|r| r.batch)
        .and_then(|h| batches.get(&h))
        .filter(|b| !b.released)
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
