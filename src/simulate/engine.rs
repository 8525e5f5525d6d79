//! The discrete-event core of `distmind simulate`: a virtual clock, the
//! controller's real [`Dispatcher`] deciding, and a model of the GPU
//! servers, memory servers and links it drives.
//!
//! Per GPU server (runtime): one host cache ([`Lru`] in the runtime's
//! order: a model one of its GPUs keeps past its next eviction first, the
//! one that ran there last first, as the runtime's own [`DeviceUses`]
//! records it; then LRU),
//! its fills (the runtime's fetch engine: every model being fetched at once,
//! one group on the wire at a time, the lowest group index first and among
//! equals the oldest fill, so group 0 of every waiting model goes first; a
//! GPU that needs a model being filled waits for its groups instead of
//! fetching it again, and counts as host-cached, as the runtime's pipeline
//! does), a NIC, and for the baselines at equal memory a local disk read one
//! model at a time (a GPU that needs a model being read waits for the
//! read). On a GPU server of one GPU, a model the GPU evicts that its host
//! cache lacks is fetched back in the background, as the runtime's
//! `HostCache::refill` does: only in place of models the GPU keeps, only
//! while no other fill runs (so one refill at a time), and its groups go
//! on the wire after every waited-for fill's (one that the GPU comes to
//! need is then waited for).
//! Per GPU: a FIFO of jobs run one at a time (the runtime's device worker),
//! device residency ([`Lru`] within its parameter budget and at most N
//! models), one PCIe link at the profile's H2D rate, and, when the
//! controller gives it the training job, back-to-back training iterations
//! whenever its queue is empty (a request waits for the iteration in
//! progress, never more, as the runtime yields at iteration boundaries).
//!
//! A request runs one of three paths, as the runtime's pipeline does:
//! resident (compute only), host-cached (upload group by group, each
//! group's layers computing once it is up) and cold (the same, each group's
//! upload waiting for its bytes over the network). Baselines load the whole
//! model before computing. Memory servers hold every model, each group's
//! slices where the deploy tool's placement puts them (the controller's
//! `placement::plan`, any strategy); a group's slices travel at once, the
//! next group after them, and every memory server's and GPU server's NIC
//! shares its bandwidth max-min fairly ([`Network`]).
//!
//! Given (`Config::round_trip_s`, `Config::serial_s`; none by default): the
//! dispatcher-to-runtime round trip, half on the way to the runtime (a
//! batch, a prefetch, an eviction, a training order) and half on the way
//! back (answers, a prefetch's report), and the runtime's serial path per
//! request, which keeps the device from its next job after a batch. A
//! closed-loop client whose request is answered at the instant it was
//! sent (rejected at admission, no round trip given) sends again a
//! loopback round trip later (`INSTANT_REPLY_TURNAROUND_S`).
//!
//! Not modelled: CPU time of any process beyond that serial path (routing,
//! framing, checksums, wake-ups), jitter of the round trip or of the
//! heartbeats, loading the training job's own weights.
//! Simplified: the simulator puts one group on the wire after the other,
//! where the engine overlaps a group's last reads with the next group's
//! first ones; a training iteration takes the profile's estimate
//! ([`distmind_runtime::profile::Profile::train_iteration_s`]).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use distmind_common::proto::{
    DeviceSnapshot, ErrorCode, ErrorReply, RuntimeSnapshot, ServePath, TimingMsg,
};
use distmind_controller::dispatch::{Action, Completion, Dispatcher, ReqId};
use distmind_controller::policy::{Gpu, Micros};
use distmind_controller::runtimes::RuntimeShape;
use distmind_runtime::device::DeviceUses;
use rand::rngs::StdRng;

use super::lru::Lru;
use super::net::Network;
use crate::loadgen::drive::{thread_rng, Arrivals, ModelDraw};
use crate::loadgen::stats::{Collector, Outcome};
use crate::up::timeline::Bins;

/// The controller's tick (as `dispatch::net`).
pub const TICK_S: f64 = 0.05;
/// The runtime's heartbeat (the registry's default).
pub const HEARTBEAT_S: f64 = 1.0;

/// One model's shape: all variants of a family share it.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Stored bytes per parameter group.
    pub group_bytes: Vec<u64>,
    /// Bytes it takes in the host cache (whole cache blocks).
    pub cache_bytes: u64,
    /// Layers before the first group's first layer (no params).
    pub prefix_s: f64,
    /// Per group: the layers from its first to the next group's first.
    pub group_compute_s: Vec<f64>,
    /// Compute time of a batch of k + 1 requests over one request's
    /// (index k, up to [`BATCH_REQUESTS_MAX`] requests).
    pub batch_factor: Vec<f64>,
}

impl Shape {
    pub fn stored_bytes(&self) -> u64 {
        self.group_bytes.iter().sum()
    }

    pub fn compute_s(&self) -> f64 {
        self.prefix_s + self.group_compute_s.iter().sum::<f64>()
    }

    /// Compute time of a batch of `n` requests over one request's.
    pub fn factor(&self, n: u32) -> f64 {
        let i = (n.max(1) - 1) as usize;
        self.batch_factor
            .get(i)
            .or(self.batch_factor.last())
            .copied()
            .unwrap_or(1.0)
    }
}

/// Most requests one batch carries (the protocol's bound).
pub const BATCH_REQUESTS_MAX: usize = distmind_common::proto::BATCH_MEMBERS_MAX + 1;

/// One model's slices: per group, (memory server, bytes) of each slice.
pub type ModelPlacement = Vec<Vec<(usize, u64)>>;

/// A training job as the simulator runs it: back-to-back iterations of a
/// fixed time (the profile's estimate), each yielding to queued requests at
/// its end, as the runtime's device worker does.
#[derive(Debug, Clone)]
pub struct TrainSim {
    pub model: String,
    pub iteration_s: f64,
}

/// Where a warm start puts models before the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Warm {
    Nothing,
    /// Every model prefetched into each host cache, least popular first.
    HostCache,
    /// Model 0 resident on every device (the GPU bound).
    Device,
}

/// The workload, from `distmind client`'s own generators: closed-loop
/// clients draw models from the client's per-thread generators, open-loop
/// connections replay the client's arrivals (Poisson or a trace), so a
/// simulation with the client's seed sends the client's requests.
pub enum Load {
    Closed { clients: usize },
    Open { connections: Vec<Arrivals> },
}

pub struct Config {
    pub gpu_servers: usize,
    pub gpus_per_server: usize,
    pub memservers: usize,
    pub link_bytes_per_s: f64,
    pub h2d_bytes_per_s: f64,
    pub cache_bytes: u64,
    pub device_bytes: u64,
    pub resident_max: usize,
    pub whole_model: bool,
    pub warm: Warm,
    pub names: Vec<String>,
    pub shape: Shape,
    pub load: Load,
    /// Zipf exponent of model popularity (rank k is model k).
    pub zipf: f64,
    pub slo_ms: Option<f64>,
    pub duration_s: f64,
    pub seed: u64,
    /// Per model (catalog order), per group: the memory server and bytes of
    /// each slice, as the deploy tool's placement put them.
    pub placement: Vec<ModelPlacement>,
    /// Baselines at equal memory: a model missing from a GPU server's host
    /// memory is read whole from its local disk at this rate (`None`: from
    /// the memory servers, DistMind's path).
    pub local_disk_bytes_per_s: Option<f64>,
    /// The training job GPUs run when the controller says so.
    pub train: Option<TrainSim>,
    /// Count answers and training iterations per interval of this length.
    pub timeline_interval_s: Option<f64>,
    /// 1, or the K of a time-dilated real run to mirror: there the
    /// controller's tick and the runtimes' heartbeats run on the real
    /// clock, so they come K times as often in emulated time.
    pub mirror_dilation: f64,
    /// The dispatcher-to-runtime round trip, seconds, half each way: an
    /// order (a batch, a prefetch, an eviction, a training order) reaches
    /// its runtime, and the runtime's answers and prefetch reports the
    /// dispatcher, that long after they were sent (0: at once).
    pub round_trip_s: f64,
    /// The runtime's serial path per request of a batch, seconds: after a
    /// batch, the device takes its next job this much later per request
    /// (the work around compute and copy that `up` reports per request).
    pub serial_s: f64,
    /// A model a device evicted is fetched back into its host cache in
    /// the background, as the runtime's `HostCache::refill` does (by
    /// default on GPU servers of one device).
    pub host_refill: bool,
}

#[derive(Debug, Default, Clone)]
pub struct Counts {
    pub events: u64,
    /// Requests that found their model in the host cache (not on the device).
    pub host_hits: u64,
    /// Loads that fetched their model over the network (prefetches included).
    pub cold: u64,
    /// Requests that found their model on the device.
    pub resident: u64,
    pub fetched_bytes: u64,
    pub evictions_ordered: u64,
    /// Background fills of what a device evicted.
    pub refills: u64,
    pub prefetches: u64,
    /// Models read from a GPU server's local disk (baselines at equal memory).
    pub disk_loads: u64,
    pub train_iterations: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Ev {
    Issue {
        client: usize,
    },
    Arrival {
        conn: usize,
        model: usize,
        slo_ms: Option<u64>,
    },
    Tick,
    Heartbeat,
    Net {
        epoch: u64,
    },
    DeviceDone {
        gpu: usize,
        job: u64,
    },
    /// A device's serial work after a batch is done.
    DeviceFree {
        gpu: usize,
    },
    /// An order the dispatcher sent reaches its runtime.
    Deliver {
        key: u64,
    },
    /// A runtime's report (answers, a prefetch done) reaches the dispatcher.
    Report {
        key: u64,
    },
    /// A whole model read from the local disk is in host memory.
    DiskDone {
        runtime: usize,
        model: u32,
    },
}

#[derive(Debug, PartialEq)]
struct At {
    t: f64,
    seq: u64,
    ev: Ev,
}

impl Eq for At {}
impl PartialOrd for At {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for At {
    /// Reversed: the heap pops the earliest (then the first scheduled).
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Clone, Copy)]
enum JobKind {
    /// A batch: `req` leads; its members are in `Sim::batches`.
    Infer {
        req: ReqId,
        budget_s: f64,
        /// Requests in the batch (1: alone).
        n: u32,
    },
    Prefetch,
    /// One training iteration.
    Train,
}

#[derive(Debug, Clone, Copy)]
struct Job {
    kind: JobKind,
    model: u32,
    enqueued: f64,
}

/// The job a device runs, and its pipeline so far.
#[derive(Debug)]
struct Running {
    job: Job,
    seq: u64,
    start: f64,
    path: ServePath,
    /// End of the last upload and of the last compute on the timeline.
    h2d_end: f64,
    compute_end: f64,
    /// Time the pipeline spent in each stage (for the timing reply).
    fetch_s: f64,
    h2d_s: f64,
}

struct Device {
    runtime: usize,
    device: u32,
    queue: VecDeque<Job>,
    running: Option<Running>,
    residency: Lru,
    /// The controller gave it the training job: it trains when idle.
    training: bool,
    /// Busy with the serial work after its last batch until then.
    free_at: f64,
}

/// A runtime's answers for the requests of one batch (or one request),
/// on their way to the dispatcher.
struct Answers {
    timing: Option<TimingMsg>,
    resident: Vec<String>,
    replies: Vec<(ReqId, Outcome)>,
}

/// What the dispatcher orders a runtime to do, on its way there.
enum Order {
    /// Run a job (a batch, a prefetch) on device `.0`.
    Job(usize, Job),
    /// Drop `model` from host `runtime`'s cache.
    Evict { runtime: usize, model: u32 },
    /// Train between requests on device `gpu`, or stop.
    Train { gpu: usize, on: bool },
}

/// What a runtime tells the dispatcher, on its way there.
enum Report {
    Answers(Answers),
    /// A prefetch finished: the path it found the model on and the load
    /// it measured in ms, or `None` when it ran nothing.
    Prefetched {
        gpu: Gpu,
        model: u32,
        load: Option<(ServePath, f64)>,
    },
}

/// A model being fetched into a host cache, as the runtime's fetch engine
/// runs one.
struct Fill {
    model: u32,
    /// The order fills began in (ties of group index go to the oldest).
    seq: u64,
    /// Groups in host memory (group 0 first); the fill is over when every
    /// group of the model has landed.
    landed: usize,
    /// Devices whose running job uploads this model's groups as they land.
    waiters: Vec<usize>,
    /// Read whole from the local disk (the baselines at equal memory), not
    /// over the network: every group lands at once.
    disk: bool,
    /// Begun for no request: it holds the host cache's pin until it ends.
    background: bool,
}

/// The group of a fill on the wire, and how many of its slices are still
/// travelling.
struct Wire {
    model: u32,
    parts_left: usize,
}

struct Host {
    cache: Lru,
    /// What its devices hold and when each model last ran there: the
    /// runtime's own record, which its host cache's eviction order reads.
    on_devices: DeviceUses,
    /// Models being fetched (at most one per model).
    fills: Vec<Fill>,
    wire: Option<Wire>,
    snapshot_seq: u64,
    /// When the local disk finishes the reads queued on it.
    disk_free_at: f64,
}

impl Host {
    fn filling(&self, m: u32) -> bool {
        self.fills.iter().any(|f| f.model == m)
    }
}

struct Pending {
    client: Option<usize>,
    model: u32,
    issued: f64,
    slo_ms: f64,
}

pub struct Sim {
    cfg: Config,
    d: Dispatcher,
    ids: Vec<u32>,
    heap: BinaryHeap<At>,
    seq: u64,
    now: f64,
    hosts: Vec<Host>,
    devices: Vec<Device>,
    net: Network,
    net_epoch: u64,
    pending: HashMap<ReqId, Pending>,
    /// Members of the batches queued or running, by their head, with each
    /// member's budget (s).
    batches: HashMap<ReqId, Vec<(ReqId, f64)>>,
    /// Closed loop: each client's generator, seeded as the client seeds its threads.
    client_rngs: Vec<StdRng>,
    zipf: ModelDraw,
    /// Open loop: each connection's arrivals, taken from when due.
    connections: Vec<Arrivals>,
    out: Vec<Action>,
    job_seq: u64,
    /// (runtime, model) a device evicted in this step: refill candidates.
    refill_after: Vec<(usize, u32)>,
    /// Orders and reports between the dispatcher and a runtime
    /// (`Config::round_trip_s`), by key.
    to_runtime: HashMap<u64, Order>,
    to_dispatcher: HashMap<u64, Report>,
    next_key: u64,
    /// Latencies kept, bounded as the client bounds them.
    stored_latencies: std::sync::atomic::AtomicUsize,
    pub collector: Collector,
    pub counts: Counts,
    pub timeline: Option<Bins>,
}

/// Compute time of `job` over one request's (a batch runs longer).
/// Where a host cache's entry (`stamp`: when it was last used) stands in
/// its eviction order, lowest first, as in the runtime's cache: class
/// [`KEPT`] for a model a GPU keeps past its next eviction (the one that
/// ran last first), then the rest by LRU.
fn host_order(uses: &DeviceUses, name: &str, stamp: u64) -> (u8, u64) {
    match uses.kept_on_device(name) {
        Some(ran) => (KEPT, u64::MAX - ran),
        None => (KEPT + 1, stamp),
    }
}

/// How long a closed-loop client takes to send again after a reply that
/// came at the instant of its request (a rejection at admission when
/// `Config::round_trip_s` is 0): about a client's loopback round trip
/// (`distmind bench dispatch` measures 80-120 us here, p50-p99).
pub(super) const INSTANT_REPLY_TURNAROUND_S: f64 = 80e-6;

/// [`host_order`]'s class of a model a GPU keeps.
const KEPT: u8 = 0;

fn batch_factor(s: &Shape, job: &Job) -> f64 {
    match job.kind {
        JobKind::Infer { n, .. } => s.factor(n),
        JobKind::Prefetch | JobKind::Train => 1.0,
    }
}

fn us(t: f64) -> Micros {
    (t * 1e6).round().max(0.0) as Micros
}

impl Sim {
    pub fn new(mut cfg: Config, mut d: Dispatcher) -> anyhow::Result<Sim> {
        anyhow::ensure!(!cfg.names.is_empty(), "no models to simulate");
        anyhow::ensure!(
            cfg.gpu_servers > 0 && cfg.gpus_per_server > 0 && cfg.memservers > 0,
            "need at least one GPU server, one GPU per server and one memory server"
        );
        let covers = |m: &ModelPlacement| {
            m.len() == cfg.shape.group_bytes.len()
                && m.iter().zip(&cfg.shape.group_bytes).all(|(slices, &b)| {
                    !slices.is_empty()
                        && slices.iter().all(|&(ms, _)| ms < cfg.memservers)
                        && slices.iter().map(|&(_, n)| n).sum::<u64>() == b
                })
        };
        anyhow::ensure!(
            cfg.placement.len() == cfg.names.len() && cfg.placement.iter().all(covers),
            "the placement must give every group of every model slices that cover it, on the memory servers"
        );
        let timeline = cfg
            .timeline_interval_s
            .map(|i| Bins::new(i, cfg.duration_s))
            .transpose()?;
        let mut ids = Vec::with_capacity(cfg.names.len());
        for n in &cfg.names {
            let id = d
                .model(distmind_controller::policy::cost::ModelMeta {
                    name: n.clone(),
                    family: n.split('-').next().unwrap_or("model").to_string(),
                    bytes: cfg.shape.stored_bytes(),
                })
                .map_err(|e| anyhow::anyhow!("model {n}: {}", e.message))?;
            ids.push(id);
        }
        let zipf = ModelDraw::new(cfg.names.len(), cfg.zipf)?;
        let (client_rngs, connections) = match &mut cfg.load {
            Load::Closed { clients } => (
                (0..*clients).map(|t| thread_rng(cfg.seed, t)).collect(),
                Vec::new(),
            ),
            Load::Open { connections } => (Vec::new(), std::mem::take(connections)),
        };
        let hosts = (0..cfg.gpu_servers)
            .map(|_| Host {
                cache: Lru::new(cfg.cache_bytes, usize::MAX),
                on_devices: DeviceUses::default(),
                fills: Vec::new(),
                wire: None,
                snapshot_seq: 0,
                disk_free_at: 0.0,
            })
            .collect();
        let devices = (0..cfg.gpu_servers * cfg.gpus_per_server)
            .map(|i| Device {
                runtime: i / cfg.gpus_per_server,
                device: (i % cfg.gpus_per_server) as u32,
                queue: VecDeque::new(),
                running: None,
                residency: Lru::new(cfg.device_bytes, cfg.resident_max),
                training: false,
                free_at: 0.0,
            })
            .collect();
        let net = Network::new(cfg.memservers, cfg.gpu_servers, cfg.link_bytes_per_s);
        let models = cfg.names.len();
        Ok(Sim {
            client_rngs,
            connections,
            cfg,
            d,
            ids,
            heap: BinaryHeap::new(),
            seq: 0,
            now: 0.0,
            hosts,
            devices,
            net,
            net_epoch: 0,
            pending: HashMap::new(),
            batches: HashMap::new(),
            zipf,
            out: Vec::new(),
            job_seq: 0,
            refill_after: Vec::new(),
            to_runtime: HashMap::new(),
            to_dispatcher: HashMap::new(),
            next_key: 0,
            stored_latencies: std::sync::atomic::AtomicUsize::new(0),
            collector: Collector::new(models),
            counts: Counts::default(),
            timeline,
        })
    }

    fn tick_s(&self) -> f64 {
        TICK_S / self.cfg.mirror_dilation
    }

    fn heartbeat_s(&self) -> f64 {
        HEARTBEAT_S / self.cfg.mirror_dilation
    }

    fn at(&mut self, t: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(At {
            t,
            seq: self.seq,
            ev,
        });
    }

    fn gpu_index(&self, g: Gpu) -> Option<usize> {
        let (r, d) = (g.runtime as usize, g.device as usize);
        (r < self.cfg.gpu_servers && d < self.cfg.gpus_per_server)
            .then_some(r * self.cfg.gpus_per_server + d)
    }

    fn snapshot(&self, runtime: usize) -> RuntimeSnapshot {
        let name = |id: u32| self.cfg.names[id as usize].clone();
        RuntimeSnapshot {
            devices: self
                .devices
                .iter()
                .filter(|d| d.runtime == runtime)
                .map(|d| DeviceSnapshot {
                    device: d.device,
                    // As the runtime counts: requests, not a training
                    // iteration.
                    queued: d.queue.len() as u64
                        + u64::from(
                            d.running
                                .as_ref()
                                .is_some_and(|r| !matches!(r.job.kind, JobKind::Train)),
                        ),
                    resident: d.residency.mru().into_iter().map(name).collect(),
                    training: self
                        .cfg
                        .train
                        .as_ref()
                        .filter(|_| d.training)
                        .map(|t| t.model.clone()),
                    train_iteration_ms: match (&self.cfg.train, d.training) {
                        (Some(t), true) => t.iteration_s * 1e3,
                        _ => 0.0,
                    },
                })
                .collect(),
            host_cached: self.hosts[runtime]
                .cache
                .mru()
                .into_iter()
                .filter(|&m| !self.hosts[runtime].filling(m))
                .map(name)
                .collect(),
            host_cached_truncated: false,
        }
    }

    fn heartbeat(&mut self) {
        self.d
            .set_memservers(us(self.now), self.cfg.memservers as u32);
        for r in 0..self.cfg.gpu_servers {
            self.hosts[r].snapshot_seq += 1;
            let snap = self.snapshot(r);
            let shape = RuntimeShape {
                device_ids: (0..self.cfg.gpus_per_server as u32).collect(),
                cache_bytes: self.cfg.cache_bytes,
                device_bytes: self.cfg.device_bytes,
                resident_models_max: self.cfg.resident_max as u32,
            };
            let seq = self.hosts[r].snapshot_seq;
            self.d.runtime_seen(
                us(self.now),
                r as u32,
                1,
                &shape,
                Some((seq, &snap)),
                &mut self.out,
            );
        }
    }

    /// Runs the workload for the configured duration.
    pub fn run(&mut self) -> anyhow::Result<()> {
        self.warm();
        self.heartbeat();
        for r in 0..self.cfg.gpu_servers {
            self.d.link_up(r as u32);
        }
        self.apply_actions();
        for c in 0..self.client_rngs.len() {
            self.at(0.0, Ev::Issue { client: c });
        }
        for conn in 0..self.connections.len() {
            self.next_arrival(conn);
        }
        self.at(self.tick_s(), Ev::Tick);
        self.at(self.heartbeat_s(), Ev::Heartbeat);
        while let Some(At { t, ev, .. }) = self.heap.pop() {
            if t > self.cfg.duration_s {
                break;
            }
            self.now = t;
            self.counts.events += 1;
            match ev {
                Ev::Issue { client } => {
                    let k = self.zipf.pick(&mut self.client_rngs[client]);
                    self.issue(Some(client), k, self.cfg.slo_ms);
                }
                Ev::Arrival {
                    conn,
                    model,
                    slo_ms,
                } => {
                    self.issue(None, model, slo_ms.map(|s| s as f64));
                    self.next_arrival(conn);
                }
                Ev::Tick => {
                    self.d.tick(us(t), &mut self.out);
                    self.at(t + self.tick_s(), Ev::Tick);
                }
                Ev::Heartbeat => {
                    self.heartbeat();
                    self.at(t + self.heartbeat_s(), Ev::Heartbeat);
                }
                Ev::Net { epoch } => {
                    if epoch == self.net_epoch {
                        self.on_net();
                    }
                }
                Ev::DeviceDone { gpu, job } => self.on_device_done(gpu, job),
                Ev::DiskDone { runtime, model } => self.on_disk_done(runtime, model),
                Ev::DeviceFree { gpu } => {
                    if self.devices[gpu].running.is_none() {
                        self.start_next(gpu);
                    }
                }
                Ev::Deliver { key } => {
                    if let Some(order) = self.to_runtime.remove(&key) {
                        self.carry_out(order);
                    }
                }
                Ev::Report { key } => {
                    if let Some(r) = self.to_dispatcher.remove(&key) {
                        self.deliver(r);
                    }
                }
            }
            self.apply_actions();
        }
        Ok(())
    }

    fn warm(&mut self) {
        let bytes = self.cfg.shape.cache_bytes;
        match self.cfg.warm {
            Warm::Nothing => {}
            Warm::HostCache => {
                for h in &mut self.hosts {
                    for m in (0..self.cfg.names.len() as u32).rev() {
                        h.cache.admit(m, bytes);
                    }
                }
            }
            Warm::Device => {
                let stored = self.cfg.shape.stored_bytes();
                for h in &mut self.hosts {
                    h.cache.admit(0, bytes);
                }
                for d in &mut self.devices {
                    d.residency.admit(0, stored);
                    self.hosts[d.runtime]
                        .on_devices
                        .used(&self.cfg.names[0], d.device);
                }
            }
        }
    }

    /// Schedules connection `conn`'s next arrival, if it has one.
    fn next_arrival(&mut self, conn: usize) {
        if let Some(due) = self.connections[conn].next() {
            if due.model < self.ids.len() {
                self.at(
                    due.at_s,
                    Ev::Arrival {
                        conn,
                        model: due.model,
                        slo_ms: due.slo_ms,
                    },
                );
            }
        }
    }

    /// Client `client` (closed loop) or a connection (`None`) sends a
    /// request for model index `k`.
    fn issue(&mut self, client: Option<usize>, k: usize, slo_ms: Option<f64>) {
        self.collector.sent(k);
        let model = self.ids[k];
        let req = self.d.submit(us(self.now), model, slo_ms, &mut self.out);
        let slo_ms = self.d.slo_ms(model, slo_ms);
        self.pending.insert(
            req,
            Pending {
                client,
                model: k as u32,
                issued: self.now,
                slo_ms,
            },
        );
    }

    /// A request's reply reached its client.
    fn reply(&mut self, req: ReqId, outcome: Outcome) {
        let Some(p) = self.pending.remove(&req) else {
            return;
        };
        if let (Some(b), Outcome::Ok { .. }) = (&mut self.timeline, &outcome) {
            b.inference(self.now);
        }
        let outcome = match outcome {
            Outcome::Ok {
                simulated, path, ..
            } => Outcome::Ok {
                latency_ms: (self.now - p.issued) * 1e3,
                slo_ms: Some(p.slo_ms),
                simulated,
                path,
            },
            o => o,
        };
        self.collector
            .record(p.model as usize, outcome, &self.stored_latencies);
        if let Some(c) = p.client {
            // A reply at the instant of its request (one rejected at
            // admission, with no round trip configured) would let a closed
            // loop resend at that instant forever; the client pays at
            // least a loopback round trip.
            let next = if self.now <= p.issued {
                self.now + INSTANT_REPLY_TURNAROUND_S
            } else {
                self.now
            };
            self.at(next, Ev::Issue { client: c });
        }
    }

    fn apply_actions(&mut self) {
        while !self.out.is_empty() {
            let actions: Vec<Action> = std::mem::take(&mut self.out);
            for a in actions {
                match a {
                    Action::Send {
                        req,
                        gpu,
                        model,
                        budget_ms,
                        batch,
                    } => {
                        let Some(gi) = self.gpu_index(gpu) else {
                            continue;
                        };
                        let Some(model) = self.d.model_id(&model) else {
                            continue;
                        };
                        let n = batch.len() as u32 + 1;
                        if !batch.is_empty() {
                            let members = batch
                                .iter()
                                .map(|m| (m.req, m.budget_ms as f64 / 1e3))
                                .collect();
                            self.batches.insert(req, members);
                        }
                        let job = Job {
                            kind: JobKind::Infer {
                                req,
                                budget_s: budget_ms as f64 / 1e3,
                                n,
                            },
                            model,
                            enqueued: self.now,
                        };
                        self.order(Order::Job(gi, job));
                    }
                    Action::Fail { req, error } => {
                        self.reply(
                            req,
                            Outcome::Refused {
                                code: error.code,
                                message: error.message,
                            },
                        );
                    }
                    Action::Prefetch { gpu, model } => {
                        self.counts.prefetches += 1;
                        let (Some(gi), Some(model)) =
                            (self.gpu_index(gpu), self.d.model_id(&model))
                        else {
                            continue;
                        };
                        self.order(Order::Job(
                            gi,
                            Job {
                                kind: JobKind::Prefetch,
                                model,
                                enqueued: self.now,
                            },
                        ));
                    }
                    Action::Evict { runtime, model } => {
                        let Some(m) = self.d.model_id(&model) else {
                            continue;
                        };
                        self.counts.evictions_ordered += 1;
                        self.order(Order::Evict {
                            runtime: runtime as usize,
                            model: m,
                        });
                    }
                    Action::Train { gpu, model } => {
                        let Some(gi) = self.gpu_index(gpu) else {
                            continue;
                        };
                        self.order(Order::Train {
                            gpu: gi,
                            on: model.is_some(),
                        });
                    }
                }
            }
        }
    }

    /// Sends an order to its runtime: it arrives half a round trip later.
    fn order(&mut self, order: Order) {
        if self.cfg.round_trip_s > 0.0 {
            self.next_key += 1;
            let key = self.next_key;
            self.to_runtime.insert(key, order);
            self.at(self.now + self.cfg.round_trip_s / 2.0, Ev::Deliver { key });
        } else {
            self.carry_out(order);
        }
    }

    /// A runtime carries out an order that reached it.
    fn carry_out(&mut self, order: Order) {
        match order {
            Order::Job(gi, mut job) => {
                // The runtime's own clock starts on arrival.
                job.enqueued = self.now;
                self.enqueue(gi, job);
            }
            Order::Evict { runtime, model } => {
                if !self.hosts[runtime].filling(model) {
                    self.hosts[runtime].cache.remove(model);
                }
            }
            Order::Train { gpu, on } => {
                self.devices[gpu].training = on && self.cfg.train.is_some();
                if self.devices[gpu].running.is_none() {
                    self.start_next(gpu);
                }
            }
        }
    }

    fn enqueue(&mut self, gi: usize, job: Job) {
        self.devices[gi].queue.push_back(job);
        if self.devices[gi].running.is_none() {
            self.start_next(gi);
        }
    }

    /// Sends a runtime's answers to the dispatcher.
    fn answer(&mut self, a: Answers) {
        self.report(Report::Answers(a));
    }

    /// Sends a runtime's report to the dispatcher: it arrives half a round
    /// trip later.
    fn report(&mut self, r: Report) {
        if self.cfg.round_trip_s > 0.0 {
            self.next_key += 1;
            let key = self.next_key;
            self.to_dispatcher.insert(key, r);
            self.at(self.now + self.cfg.round_trip_s / 2.0, Ev::Report { key });
        } else {
            self.deliver(r);
        }
    }

    /// The dispatcher takes a runtime's report, and the clients their answers.
    fn deliver(&mut self, r: Report) {
        let a = match r {
            Report::Answers(a) => a,
            Report::Prefetched { gpu, model, load } => {
                if let Some((path, ms)) = load {
                    let name = &self.cfg.names[model as usize];
                    self.d.prefetched(us(self.now), gpu, name, path, ms);
                }
                self.d.prefetch_done(us(self.now), gpu, None);
                return;
            }
        };
        let c = Completion {
            timing: a.timing.as_ref(),
            resident: &a.resident,
        };
        for (id, outcome) in a.replies {
            self.d.complete(us(self.now), id, &c, &mut self.out);
            self.reply(id, outcome);
        }
    }

    /// Starts the device's next job, if any; with none queued and the
    /// training job set, one training iteration. Not before the serial
    /// work after its last batch is done.
    fn start_next(&mut self, gi: usize) {
        if self.now < self.devices[gi].free_at {
            return;
        }
        while self.devices[gi].running.is_none() {
            let Some(mut job) = self.devices[gi].queue.pop_front() else {
                self.begin_train(gi);
                return;
            };
            if let JobKind::Infer { req, budget_s, n } = job.kind {
                // As the runtime: a request whose deadline passed in the
                // queue is failed; the rest of its batch runs.
                let waited = self.now - job.enqueued;
                let late = |budget: f64| waited > budget;
                let mut members = self.batches.remove(&req).unwrap_or_default();
                let dropped: Vec<ReqId> = std::iter::once((req, budget_s))
                    .chain(members.iter().copied())
                    .filter(|&(_, b)| late(b))
                    .map(|(id, _)| id)
                    .collect();
                if !dropped.is_empty() {
                    let message = format!(
                        "its deadline passed after {:.1} ms in the device queue",
                        waited * 1e3
                    );
                    self.answer(Answers {
                        timing: None,
                        resident: Vec::new(),
                        replies: dropped
                            .iter()
                            .map(|&id| {
                                let o = Outcome::Refused {
                                    code: ErrorCode::DeadlineExceeded,
                                    message: message.clone(),
                                };
                                (id, o)
                            })
                            .collect(),
                    });
                }
                if dropped.len() as u32 == n {
                    continue;
                }
                members.retain(|(id, _)| !dropped.contains(id));
                let (head, budget_s) = if dropped.contains(&req) {
                    members.remove(0)
                } else {
                    (req, budget_s)
                };
                job.kind = JobKind::Infer {
                    req: head,
                    budget_s,
                    n: members.len() as u32 + 1,
                };
                if !members.is_empty() {
                    self.batches.insert(head, members);
                }
            }
            if let Err(e) = self.begin(gi, job) {
                self.fail_job(gi, job, e);
            }
            self.refill();
        }
    }

    /// One training iteration on idle device `gi`, if it trains. Requests
    /// that arrive meanwhile wait for its end (the runtime yields at
    /// iteration boundaries, never inside one).
    fn begin_train(&mut self, gi: usize) {
        let Some(t) = &self.cfg.train else {
            return;
        };
        if !self.devices[gi].training || self.devices[gi].running.is_some() {
            return;
        }
        let end = self.now + t.iteration_s;
        self.job_seq += 1;
        let seq = self.job_seq;
        self.devices[gi].running = Some(Running {
            job: Job {
                kind: JobKind::Train,
                model: u32::MAX,
                enqueued: self.now,
            },
            seq,
            start: self.now,
            path: ServePath::DeviceResident,
            h2d_end: self.now,
            compute_end: end,
            fetch_s: 0.0,
            h2d_s: 0.0,
        });
        self.at(end, Ev::DeviceDone { gpu: gi, job: seq });
    }

    fn fail_job(&mut self, gi: usize, job: Job, e: ErrorReply) {
        match job.kind {
            JobKind::Infer { req, .. } => {
                let members = self.batches.remove(&req).unwrap_or_default();
                let replies = std::iter::once(req)
                    .chain(members.into_iter().map(|(id, _)| id))
                    .map(|id| {
                        let o = Outcome::Refused {
                            code: e.code,
                            message: e.message.clone(),
                        };
                        (id, o)
                    })
                    .collect();
                self.answer(Answers {
                    timing: None,
                    resident: Vec::new(),
                    replies,
                });
            }
            JobKind::Prefetch => {
                let d = &self.devices[gi];
                let gpu = Gpu {
                    runtime: d.runtime as u32,
                    device: d.device,
                };
                self.report(Report::Prefetched {
                    gpu,
                    model: job.model,
                    load: None,
                });
            }
            JobKind::Train => {}
        }
    }

    /// Model `m` was loaded onto, or ran on, device `gi` (the runtime notes
    /// a use when a request takes the model and when it lets it go).
    fn note_device_use(&mut self, gi: usize, m: u32) {
        let d = &self.devices[gi];
        self.hosts[d.runtime]
            .on_devices
            .used(&self.cfg.names[m as usize], d.device);
    }

    /// Begins `job` on device `gi` (idle).
    fn begin(&mut self, gi: usize, job: Job) -> Result<(), ErrorReply> {
        let m = job.model;
        let runtime = self.devices[gi].runtime;
        let stored = self.cfg.shape.stored_bytes();
        let resident = self.devices[gi].residency.contains(m);
        let compute = matches!(job.kind, JobKind::Infer { .. });
        self.job_seq += 1;
        let mut run = Running {
            job,
            seq: self.job_seq,
            start: self.now,
            path: ServePath::DeviceResident,
            h2d_end: self.now,
            compute_end: self.now,
            fetch_s: 0.0,
            h2d_s: 0.0,
        };
        if resident {
            self.devices[gi].residency.touch(m);
            self.devices[gi].residency.pin(m);
            self.note_device_use(gi, m);
            if compute {
                self.counts.resident += 1;
            }
            if compute {
                run.compute_end =
                    self.now + self.cfg.shape.compute_s() * batch_factor(&self.cfg.shape, &job);
            }
            let (end, seq) = (run.compute_end, run.seq);
            self.devices[gi].running = Some(run);
            self.at(end, Ev::DeviceDone { gpu: gi, job: seq });
            return Ok(());
        }
        let Some(evicted) = self.devices[gi].residency.admit(m, stored) else {
            return Err(ErrorReply::new(
                ErrorCode::Internal,
                format!(
                    "device {} cannot hold {} ({stored} bytes) next to the models in use",
                    self.devices[gi].device, self.cfg.names[m as usize]
                ),
            ));
        };
        let device = self.devices[gi].device;
        for &v in &evicted {
            self.hosts[runtime]
                .on_devices
                .left(&self.cfg.names[v as usize], device);
        }
        self.refill_after
            .extend(evicted.iter().map(|&v| (runtime, v)));
        self.devices[gi].residency.pin(m);
        self.note_device_use(gi, m);
        let host = &mut self.hosts[runtime];
        if host.cache.contains(m) {
            host.cache.touch(m);
            host.cache.pin(m);
            if compute {
                self.counts.host_hits += 1;
            }
            run.path = ServePath::HostCached;
            if let Some(fill) = host.fills.iter_mut().find(|f| f.model == m) {
                // Being fetched (by another GPU's miss or a prefetch): the
                // groups that landed go up now, the rest as they land.
                fill.waiters.push(gi);
                let landed = fill.landed;
                let mut t = self.now;
                for g in 0..landed {
                    t = self.upload_group(&mut run, g, t, compute);
                }
                self.devices[gi].running = Some(run);
                return Ok(());
            }
            // Every group is in host memory: uploads back to back.
            let mut t = self.now;
            for g in 0..self.cfg.shape.group_bytes.len() {
                t = self.upload_group(&mut run, g, t, compute);
            }
            let end = self.finish_time(&run, compute);
            let seq = run.seq;
            self.devices[gi].running = Some(run);
            self.at(end, Ev::DeviceDone { gpu: gi, job: seq });
            return Ok(());
        }
        // Cold: reserve in the host cache, then fetch group by group; what
        // a device keeps leaves first, as in the runtime's cache.
        let names = &self.cfg.names;
        let uses = &host.on_devices;
        let admitted = host
            .cache
            .admit_by(m, self.cfg.shape.cache_bytes, |v, stamp| {
                host_order(uses, &names[v as usize], stamp)
            });
        if admitted.is_none() {
            self.devices[gi].residency.unpin(m);
            self.devices[gi].residency.remove(m);
            host.on_devices.left(&names[m as usize], device);
            return Err(ErrorReply::new(
                ErrorCode::Internal,
                format!(
                    "the host cache of GPU server {runtime} cannot hold {} next to the models in use",
                    self.cfg.names[m as usize]
                ),
            ));
        }
        host.cache.pin(m);
        self.counts.cold += 1;
        run.path = ServePath::Cold;
        if let Some(rate) = self.cfg.local_disk_bytes_per_s {
            // The whole model from the local disk, one read at a time.
            let start = host.disk_free_at.max(self.now);
            host.disk_free_at = start + stored as f64 / rate;
            let end = host.disk_free_at;
            host.fills.push(Fill {
                model: m,
                seq: run.seq,
                landed: 0,
                waiters: vec![gi],
                disk: true,
                background: false,
            });
            self.counts.disk_loads += 1;
            self.devices[gi].running = Some(run);
            self.at(end, Ev::DiskDone { runtime, model: m });
            return Ok(());
        }
        let seq = run.seq;
        self.devices[gi].running = Some(run);
        self.hosts[runtime].fills.push(Fill {
            model: m,
            seq,
            landed: 0,
            waiters: vec![gi],
            disk: false,
            background: false,
        });
        self.next_fetch(runtime);
        Ok(())
    }

    /// Models devices evicted that their host cache lacks: fetched back
    /// into it in the background, when room can be made by letting go of
    /// models a device keeps (the host cache then holds what its GPUs do
    /// not). A background fill's groups go on the wire after every waited-for
    /// fill's.
    fn refill(&mut self) {
        let evicted = std::mem::take(&mut self.refill_after);
        if !self.cfg.host_refill
            || self.cfg.whole_model
            || self.cfg.local_disk_bytes_per_s.is_some()
        {
            return;
        }
        for (runtime, v) in evicted {
            let names = &self.cfg.names;
            let host = &mut self.hosts[runtime];
            // Not while any fill runs: one a request waits for, or another
            // refill (one at a time).
            if host.cache.contains(v) || !host.fills.is_empty() {
                continue;
            }
            let uses = &host.on_devices;
            let admitted = host.cache.admit_within(
                v,
                self.cfg.shape.cache_bytes,
                |x, stamp| host_order(uses, &names[x as usize], stamp),
                KEPT,
            );
            if admitted.is_none() {
                continue;
            }
            host.cache.pin(v);
            self.job_seq += 1;
            host.fills.push(Fill {
                model: v,
                seq: self.job_seq,
                landed: 0,
                waiters: Vec::new(),
                disk: false,
                background: true,
            });
            self.counts.refills += 1;
            self.next_fetch(runtime);
        }
    }

    /// Uploads group `g` once its bytes are in host memory at `ready`;
    /// returns when the upload ended. Whole-model loads compute only after
    /// the last group; pipelined ones compute each group after its upload.
    fn upload_group(&self, run: &mut Running, g: usize, ready: f64, compute: bool) -> f64 {
        let s = &self.cfg.shape;
        let h2d = s.group_bytes[g] as f64 / self.cfg.h2d_bytes_per_s;
        let start = run.h2d_end.max(ready);
        run.h2d_end = start + h2d;
        run.h2d_s += h2d;
        if compute && !self.cfg.whole_model {
            let f = batch_factor(s, &run.job);
            let prefix = if g == 0 { s.prefix_s * f } else { 0.0 };
            let c_start = if g == 0 {
                run.start + prefix
            } else {
                run.compute_end
            };
            run.compute_end = c_start.max(run.h2d_end) + s.group_compute_s[g] * f;
        }
        run.h2d_end
    }

    fn finish_time(&self, run: &Running, compute: bool) -> f64 {
        if !compute {
            return run.h2d_end;
        }
        if self.cfg.whole_model {
            run.h2d_end + self.cfg.shape.compute_s() * batch_factor(&self.cfg.shape, &run.job)
        } else {
            run.compute_end.max(run.h2d_end)
        }
    }

    /// Puts the host's next group on the wire when none travels: of the
    /// fills, the one whose next group has the lowest index, then the
    /// oldest (the fetch engine's posting order). Each slice comes from the
    /// memory server the placement put it on.
    fn next_fetch(&mut self, runtime: usize) {
        let host = &mut self.hosts[runtime];
        if host.wire.is_some() {
            return;
        }
        let Some(f) = host
            .fills
            .iter()
            .filter(|f| !f.disk)
            .min_by_key(|f| (f.waiters.is_empty(), f.landed, f.seq))
        else {
            return;
        };
        let (model, group) = (f.model, f.landed);
        let slices = &self.cfg.placement[model as usize][group];
        host.wire = Some(Wire {
            model,
            parts_left: slices.len(),
        });
        self.net.advance(self.now);
        self.net.start(
            slices
                .iter()
                .map(|&(ms, bytes)| (ms, runtime, bytes.max(1), runtime as u64)),
        );
        self.counts.fetched_bytes += slices.iter().map(|&(_, b)| b).sum::<u64>();
        self.schedule_net();
    }

    /// A whole model read from the local disk is in host memory: upload it.
    fn on_disk_done(&mut self, runtime: usize, model: u32) {
        let host = &mut self.hosts[runtime];
        let Some(k) = host.fills.iter().position(|f| f.model == model && f.disk) else {
            return;
        };
        let now = self.now;
        for gi in host.fills.swap_remove(k).waiters {
            let Some(mut run) = self.devices[gi].running.take() else {
                continue;
            };
            let compute = matches!(run.job.kind, JobKind::Infer { .. });
            if run.path == ServePath::Cold {
                run.fetch_s = now - run.start;
            }
            for g in 0..self.cfg.shape.group_bytes.len() {
                self.upload_group(&mut run, g, now, compute);
            }
            let end = self.finish_time(&run, compute);
            let seq = run.seq;
            self.devices[gi].running = Some(run);
            self.at(end, Ev::DeviceDone { gpu: gi, job: seq });
        }
    }

    fn schedule_net(&mut self) {
        self.net_epoch += 1;
        if let Some(t) = self.net.next_done() {
            self.at(
                t.max(self.now),
                Ev::Net {
                    epoch: self.net_epoch,
                },
            );
        }
    }

    fn on_net(&mut self) {
        self.net.advance(self.now);
        let done = self.net.take_done();
        for tag in done {
            let runtime = tag as usize;
            let Some(w) = self.hosts[runtime].wire.as_mut() else {
                continue;
            };
            w.parts_left -= 1;
            if w.parts_left > 0 {
                continue;
            }
            // The group on the wire is in host memory now: every GPU
            // waiting on the model uploads it.
            let model = w.model;
            self.hosts[runtime].wire = None;
            let now = self.now;
            let groups = self.cfg.shape.group_bytes.len();
            let host = &mut self.hosts[runtime];
            let k = host
                .fills
                .iter()
                .position(|f| f.model == model)
                .expect("the group on the wire has its fill");
            let g = host.fills[k].landed;
            host.fills[k].landed += 1;
            let last = g + 1 == groups;
            let waiters = if last {
                let f = host.fills.swap_remove(k);
                if f.background {
                    host.cache.unpin(model);
                }
                f.waiters
            } else {
                host.fills[k].waiters.clone()
            };
            for gi in waiters {
                let Some(mut run) = self.devices[gi].running.take() else {
                    continue;
                };
                let compute = matches!(run.job.kind, JobKind::Infer { .. });
                self.upload_group(&mut run, g, now, compute);
                if last {
                    if run.path == ServePath::Cold {
                        run.fetch_s = now - run.start;
                    }
                    let end = self.finish_time(&run, compute);
                    let seq = run.seq;
                    self.at(end, Ev::DeviceDone { gpu: gi, job: seq });
                }
                self.devices[gi].running = Some(run);
            }
            self.next_fetch(runtime);
        }
        self.schedule_net();
    }

    fn on_device_done(&mut self, gi: usize, job_seq: u64) {
        let Some(run) = self.devices[gi].running.take_if(|r| r.seq == job_seq) else {
            return;
        };
        if matches!(run.job.kind, JobKind::Train) {
            self.counts.train_iterations += 1;
            if let Some(b) = &mut self.timeline {
                b.training(self.now);
            }
            self.start_next(gi);
            return;
        }
        let m = run.job.model;
        let runtime = self.devices[gi].runtime;
        self.devices[gi].residency.unpin(m);
        self.note_device_use(gi, m);
        if run.path != ServePath::DeviceResident {
            self.hosts[runtime].cache.unpin(m);
        }
        let gpu = Gpu {
            runtime: runtime as u32,
            device: self.devices[gi].device,
        };
        match run.job.kind {
            JobKind::Infer { req, n, .. } => {
                let total = self.now - run.job.enqueued;
                let compute_s =
                    self.cfg.shape.compute_s() * batch_factor(&self.cfg.shape, &run.job);
                let t = TimingMsg {
                    queue_ms: (run.start - run.job.enqueued) * 1e3,
                    fetch_ms: run.fetch_s * 1e3,
                    h2d_ms: run.h2d_s * 1e3,
                    compute_ms: compute_s * 1e3,
                    total_ms: total * 1e3,
                    path: run.path,
                    simulated: true,
                    device: gpu.device,
                    fetched_bytes: if run.path == ServePath::Cold {
                        self.cfg.shape.stored_bytes()
                    } else {
                        0
                    },
                    train_yield_ms: 0.0,
                    batch_requests: n,
                    warmup: false,
                };
                let resident: Vec<String> = self.devices[gi]
                    .residency
                    .mru()
                    .into_iter()
                    .map(|x| self.cfg.names[x as usize].clone())
                    .collect();
                // One reply per request of the batch.
                let members = self.batches.remove(&req).unwrap_or_default();
                let replies = std::iter::once(req)
                    .chain(members.into_iter().map(|(id, _)| id))
                    .map(|id| {
                        let o = Outcome::Ok {
                            latency_ms: 0.0,
                            slo_ms: None,
                            simulated: true,
                            path: Some(run.path),
                        };
                        (id, o)
                    })
                    .collect();
                self.answer(Answers {
                    timing: Some(t),
                    resident,
                    replies,
                });
                if self.cfg.serial_s > 0.0 {
                    let free = self.now + self.cfg.serial_s * f64::from(n);
                    self.devices[gi].free_at = free;
                    self.at(free, Ev::DeviceFree { gpu: gi });
                }
            }
            JobKind::Prefetch => {
                // As the runtime's `Prefetched` reply: the load it measured.
                let ms = (self.now - run.start) * 1e3;
                self.report(Report::Prefetched {
                    gpu,
                    model: m,
                    load: Some((run.path, ms)),
                });
            }
            JobKind::Train => unreachable!("handled above"),
        }
        self.start_next(gi);
    }
}
