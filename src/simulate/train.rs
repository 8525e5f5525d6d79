//! `distmind train simulate`: a training job (a [`JobSpec`]) on a virtual
//! clock, at scales this machine cannot run as processes (8 to hundreds of
//! GPUs).
//!
//! What is real: the decisions. The sync groups come from the controller's
//! own schedulers (`training::PartialReduce`, `AllReduce`, `AdPsgd`), each
//! pipeline's iteration from the 1F1B simulator DynPipe's re-partitioner
//! uses (`training::sim1f1b`), and re-partitioning from the controller's
//! `StragglerMonitor` and `repartition`. What is modelled, and how:
//! - **Layer times** come from a GPU profile at the microbatch's batch
//!   (`Profile::get`: interpolated where that batch is not profiled); a
//!   layer's backward takes `backward_factor` times its forward (default 2,
//!   the usual ratio; profiles hold forward times only).
//! - **Links** carry data at one rate (`--link`), without contention between
//!   the stage links and the all-reduce rings of a server's NIC: a boundary
//!   costs its live tensors' bytes / rate each way; a ring all-reduce of B
//!   bytes over n members 2 (n - 1) / n x B / rate plus [`HOP_LATENCY_S`]
//!   per ring step.
//! - **Interference** as the spec injects it: `hetero_s` with probability
//!   `hetero_p` per worker and iteration (a sleeping stage holds its whole
//!   pipeline up by that long: the pipeline's iteration is delayed by the
//!   longest sleep among its stages), and `slowdowns` (a stage's GPU runs its
//!   layers `factor` times slower from `at_iteration` on, whichever layers
//!   it holds).
//! - **A pipeline's next iteration** starts once every one of its stages has
//!   averaged (or found itself alone): the next forwards of stage s wait for
//!   s's weights anyway, and the later stages for the earlier ones.
//! - **Re-partitioning** (DynPipe, `dynamic.enabled`): the monitor reads
//!   pipeline 0's per-stage forward + backward times; at the scheduled
//!   iteration every pipeline drains, the new partition is the
//!   re-partitioner's, and the pause is a checkpoint (each stage writes its
//!   weights over its link, stages in parallel) plus a reload: `dynamic`
//!   reloads only the layers that changed stage, `restart` (DynPipe-Re)
//!   every layer of every stage, plus `restart_s`.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use distmind_common::train_spec::{JobSpec, Slowdown, SyncMode};
use distmind_controller::training::{
    repartition, simulate_with_events, AdPsgd, AllReduce, BoundaryComm, GroupScheduler, LayerCost,
    MeasuredRatio, MonitorConfig, OpKind, PReduceConfig, PartialReduce, RepartitionOptions,
    StageTime, StragglerMonitor,
};
use distmind_models::shape;
use distmind_models::{Family, Scale};
use distmind_runtime::profile::Profile;
use rand::{Rng, SeedableRng};

/// Latency of one ring step of an all-reduce (a small message's one-way
/// time on a datacenter network; an assumption).
pub const HOP_LATENCY_S: f64 = 10e-6;
/// Most events the simulation processes before it gives up (a bound on a
/// spec that would never finish).
pub const EVENTS_MAX: u64 = 200_000_000;

/// How a job reacts to a slow stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RepartitionMode {
    /// Never re-partitions (the spec's `dynamic` is ignored).
    Static,
    /// DynPipe-Re: stop, re-partition, restart from the checkpoint
    /// (every layer reloaded, plus `--restart-s`).
    Restart,
    /// DynPipe: re-partition in place; only the layers that moved reload.
    Dynamic,
}

#[derive(Args, Debug, Clone)]
pub struct TrainSimArgs {
    /// The job spec (JSON, as `train submit` takes it).
    #[arg(long)]
    pub spec: PathBuf,
    /// The model's family (the spec names a catalog model; the simulator
    /// needs its architecture).
    #[arg(long, default_value = "resnet152")]
    pub family: Family,
    #[arg(long, default_value = "full")]
    pub scale: Scale,
    /// GPU profile: forward time of every layer.
    #[arg(
        long,
        default_value = "settings/profiles/h100-measured-2026-11-26.json"
    )]
    pub profile: PathBuf,
    /// A layer's backward time over its forward time (an assumption).
    #[arg(long, default_value_t = 2.0)]
    pub backward_factor: f64,
    /// Every link's rate: stage links and all-reduce rings (e.g. 100gbit, 25GB/s).
    #[arg(long, default_value = "100gbit")]
    pub link: String,
    /// Override the spec's pipelines (P).
    #[arg(long)]
    pub pipelines: Option<u32>,
    /// Override the spec's sync mode: allreduce, preduce or adpsgd.
    #[arg(long)]
    pub sync: Option<String>,
    /// Override the spec's hetero_s (seconds slept with probability hetero_p).
    #[arg(long)]
    pub hetero: Option<f64>,
    /// Add a slowdown, STAGE:FACTOR@ITER (or PIPELINE/STAGE:FACTOR@ITER); repeatable.
    #[arg(long)]
    pub slowdown: Vec<Slowdown>,
    /// static, restart or dynamic (default: dynamic if the spec enables it, else static).
    #[arg(long, value_enum)]
    pub mode: Option<RepartitionMode>,
    /// Extra pause of a restart (process start, model build), seconds.
    #[arg(long, default_value_t = 0.0)]
    pub restart_s: f64,
    /// Seed of the interference draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Append one row per iteration of pipeline 0 to this CSV.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// The CSV's `label` column (default: sync and mode).
    #[arg(long)]
    pub label: Option<String>,
}

/// Per-layer costs of one model at one microbatch size.
#[derive(Debug, Clone)]
pub struct ModelCosts {
    pub forward_s: Vec<f64>,
    pub backward_s: Vec<f64>,
    /// Parameter bytes (f32) per layer.
    pub param_bytes: Vec<u64>,
    /// Per cut `0..=layers`: bytes of the tensors live across it.
    pub boundary_bytes: Vec<u64>,
}

impl ModelCosts {
    /// The costs of `family` at `scale` for microbatches of `microbatch`
    /// samples, from `profile`.
    pub fn from_profile(
        profile: &Profile,
        family: Family,
        scale: Scale,
        microbatch: usize,
        backward_factor: f64,
    ) -> anyhow::Result<ModelCosts> {
        let arch = family.config(scale).with_batch_size(microbatch).build();
        let prof = profile.get(family, scale, microbatch).with_context(|| {
            format!(
                "profile {} has no {family} ({scale}) entry",
                profile.origin()
            )
        })?;
        if prof.layers.len() != arch.layers.len() {
            bail!(
                "profile {} has {} layers for {family} ({scale}), the architecture {}",
                profile.origin(),
                prof.layers.len(),
                arch.layers.len()
            );
        }
        let params: std::collections::HashMap<&str, u64> = arch
            .params
            .iter()
            .map(|p| {
                (
                    p.name.as_str(),
                    p.shape.iter().product::<usize>() as u64 * 4,
                )
            })
            .collect();
        let shapes = shape::infer(&arch.layers, &arch.inputs, |n| {
            arch.params
                .iter()
                .find(|p| p.name == n)
                .map(|p| p.shape.as_slice())
        })
        .map_err(|(l, e)| anyhow::anyhow!("{family} layer {l}: {e}"))?;
        let bytes_of = |r: i64| -> u64 {
            let (dims, dtype) = if r < 0 {
                let spec = &arch.inputs[(-r - 1) as usize];
                (spec.shape.clone(), spec.dtype)
            } else {
                (shapes[r as usize].dims.clone(), shapes[r as usize].dtype)
            };
            dims.iter().product::<usize>() as u64 * dtype.size_bytes()
        };
        let outputs: Vec<usize> = arch.outputs.iter().map(|o| o.layer).collect();
        let boundary_bytes = (0..=arch.layers.len())
            .map(|c| {
                distmind_runtime::train::live_tensors(&arch.layers, &outputs, c)
                    .into_iter()
                    .map(bytes_of)
                    .sum()
            })
            .collect();
        Ok(ModelCosts {
            forward_s: prof.layers.iter().map(|l| l.time_s).collect(),
            backward_s: prof
                .layers
                .iter()
                .map(|l| l.time_s * backward_factor)
                .collect(),
            param_bytes: arch
                .layers
                .iter()
                .map(|l| l.params.iter().map(|p| params[p.as_str()]).sum())
                .collect(),
            boundary_bytes,
        })
    }

    pub fn layers(&self) -> usize {
        self.forward_s.len()
    }
}

/// The knobs of a simulation beyond the spec.
#[derive(Debug, Clone)]
pub struct SimOptions {
    pub link_bytes_per_s: f64,
    pub mode: RepartitionMode,
    pub restart_s: f64,
    pub seed: u64,
}

/// One re-partitioning the simulation did.
#[derive(Debug, Clone, PartialEq)]
pub struct Repartitioned {
    pub at_iteration: u64,
    pub at_s: f64,
    pub pause_s: f64,
    pub before: Vec<usize>,
    pub after: Vec<usize>,
}

/// What a simulation measured.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSimReport {
    /// Samples trained by every pipeline over the virtual time.
    pub samples_per_s: f64,
    pub elapsed_s: f64,
    /// Pipeline 0's iterations: (end time, duration).
    pub iterations: Vec<(f64, f64)>,
    pub repartitions: Vec<Repartitioned>,
    /// Mean members of the groups that closed (all stages).
    pub mean_group: f64,
    pub partition: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Event {
    /// Pipeline p starts its next iteration.
    Start { p: usize },
    /// Pipeline p's stage s finished its backwards of the iteration.
    Ready { p: usize, s: usize },
    /// The scheduler of stage s may have a deadline due.
    Poll { s: usize },
    /// An averaging finished for the members of `groups[group]`.
    Averaged { group: usize },
}

/// A virtual-clock event; the heap pops the earliest (then the first queued).
#[derive(Debug, Clone, Copy)]
struct Timed {
    at: f64,
    seq: u64,
    ev: Event,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> Ordering {
        o.at.total_cmp(&self.at).then(o.seq.cmp(&self.seq))
    }
}

/// The group scheduler of one stage key, by sync mode.
fn scheduler(spec: &JobSpec, pipelines: usize) -> anyhow::Result<Box<dyn GroupScheduler>> {
    Ok(match &spec.sync {
        SyncMode::Allreduce(_) => Box::new(AllReduce::new(pipelines)?),
        SyncMode::Preduce(p) => {
            let mut cfg = PReduceConfig::new(pipelines);
            if let Some(w) = p.wait_ms_initial {
                cfg.wait_initial = Duration::from_millis(w);
            }
            if let Some(b) = p.ssp_bound {
                cfg.ssp_bound = u64::from(b);
            }
            Box::new(PartialReduce::new(cfg)?)
        }
        SyncMode::Adpsgd(a) => Box::new(AdPsgd::new(pipelines, a.seed)?),
        SyncMode::Hetpipe(_) => {
            bail!("sync hetpipe (a parameter server per stage) is not simulated; use allreduce, preduce or adpsgd")
        }
    })
}

/// The slowdown factor of pipeline `p`'s stage `s` at iteration `i`: the
/// latest slowdown naming it that has begun (1 without one).
fn slowdown(spec: &JobSpec, p: usize, s: usize, i: u64) -> f64 {
    spec.interference
        .slowdowns
        .iter()
        .filter(|d| {
            d.stage as usize == s
                && d.at_iteration <= i
                && d.pipeline.is_none_or(|q| q as usize == p)
        })
        .max_by_key(|d| d.at_iteration)
        .map_or(1.0, |d| d.factor)
}

/// Seconds pipeline `p`'s worker `s` sleeps before iteration `i`.
fn hetero_sleep(spec: &JobSpec, seed: u64, p: usize, s: usize, i: u64) -> f64 {
    let h = &spec.interference;
    if h.hetero_s <= 0.0 || h.hetero_p <= 0.0 {
        return 0.0;
    }
    let key = seed
        ^ (p as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (s as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ i.wrapping_mul(0x1656_67B1_9E37_79F9);
    let mut rng = rand::rngs::StdRng::seed_from_u64(key);
    if rng.gen::<f64>() < h.hetero_p {
        h.hetero_s
    } else {
        0.0
    }
}

/// Layer ranges of a partition.
fn ranges(partition: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut at = 0;
    partition
        .iter()
        .map(|&n| {
            at += n;
            at - n..at
        })
        .collect()
}

/// Everything a running simulation holds.
struct Sim<'a> {
    costs: &'a ModelCosts,
    spec: &'a JobSpec,
    opts: &'a SimOptions,
    /// Per layer, for the re-partitioner: solo times and boundary costs.
    solo: Vec<LayerCost>,
    partition: Vec<usize>,
    schedulers: Vec<Box<dyn GroupScheduler>>,
    monitor: StragglerMonitor,
    heap: BinaryHeap<Timed>,
    seq: u64,
    /// Per pipeline: iterations completed, stages still averaging, start
    /// of the iteration running.
    completed: Vec<u64>,
    unsynced: Vec<usize>,
    started_at: Vec<f64>,
    finished: Vec<bool>,
    /// Members of every group that closed, by index.
    groups: Vec<Vec<usize>>,
    group_members: usize,
    p0: Vec<(f64, f64)>,
    repartitions: Vec<Repartitioned>,
    /// The iteration before which to re-partition, once scheduled.
    scheduled: Option<u64>,
    drained: Vec<usize>,
    end: f64,
}

impl Sim<'_> {
    fn push(&mut self, at: f64, ev: Event) {
        self.seq += 1;
        self.heap.push(Timed {
            at,
            seq: self.seq,
            ev,
        });
    }

    fn stage_bytes(&self, s: usize) -> u64 {
        self.costs.param_bytes[ranges(&self.partition)[s].clone()]
            .iter()
            .sum()
    }

    /// Starts the averaging of each closed group of stage `s` at `now`.
    fn averaging(&mut self, now: f64, s: usize, closed: Vec<Vec<usize>>) {
        for members in closed {
            let n = members.len() as f64;
            let t = if members.len() > 1 {
                2.0 * (n - 1.0) / n * self.stage_bytes(s) as f64 / self.opts.link_bytes_per_s
                    + 2.0 * (n - 1.0) * HOP_LATENCY_S
            } else {
                0.0
            };
            self.group_members += members.len();
            self.groups.push(members);
            let group = self.groups.len() - 1;
            self.push(now + t, Event::Averaged { group });
        }
    }

    /// Asks stage `s`'s scheduler to be polled at its next deadline.
    fn poll_later(&mut self, s: usize, now: f64) {
        if let Some(d) = self.schedulers[s].next_deadline() {
            self.push(d.as_secs_f64().max(now), Event::Poll { s });
        }
    }

    fn start(&mut self, p: usize, now: f64) -> anyhow::Result<()> {
        let (spec, costs) = (self.spec, self.costs);
        let (sn, m) = (spec.stages as usize, spec.microbatches as usize);
        let rate = self.opts.link_bytes_per_s;
        let i = self.completed[p];
        self.started_at[p] = now;
        let stage_ranges = ranges(&self.partition);
        let times: Vec<StageTime> = stage_ranges
            .iter()
            .enumerate()
            .map(|(s, r)| {
                let f = slowdown(spec, p, s, i);
                StageTime::new(
                    costs.forward_s[r.clone()].iter().sum::<f64>() * f,
                    costs.backward_s[r.clone()].iter().sum::<f64>() * f,
                )
            })
            .collect();
        let comm: Vec<BoundaryComm> = stage_ranges[..sn - 1]
            .iter()
            .map(|r| BoundaryComm::symmetric(costs.boundary_bytes[r.end] as f64 / rate))
            .collect();
        let (_, ops) = simulate_with_events(&times, &comm, m)?;
        let sleep = (0..sn)
            .map(|s| hetero_sleep(spec, self.opts.seed, p, s, i))
            .fold(0.0, f64::max);
        if p == 0 && self.opts.mode != RepartitionMode::Static {
            let per_stage: Vec<f64> = times
                .iter()
                .map(|t| (t.forward_s + t.backward_s) * m as f64)
                .collect();
            if let Some(r) = self.monitor.observe(&per_stage)? {
                self.scheduled.get_or_insert(r.at_iteration);
            }
        }
        let mut last_backward = vec![0f64; sn];
        for o in ops.iter().filter(|o| o.kind == OpKind::Backward) {
            last_backward[o.stage] = last_backward[o.stage].max(o.end_s);
        }
        self.unsynced[p] = sn;
        for (s, t) in last_backward.into_iter().enumerate() {
            self.push(now + sleep + t, Event::Ready { p, s });
        }
        Ok(())
    }

    fn ready(&mut self, p: usize, s: usize, now: f64) -> anyhow::Result<()> {
        if self.spec.pipelines == 1 {
            self.averaging(now, s, vec![vec![p]]);
            return Ok(());
        }
        let closed = self.schedulers[s].ready(p, Duration::from_secs_f64(now))?;
        self.averaging(now, s, closed.into_iter().map(|g| g.members).collect());
        self.poll_later(s, now);
        Ok(())
    }

    fn poll(&mut self, s: usize, now: f64) {
        let closed = self.schedulers[s].poll(Duration::from_secs_f64(now));
        self.averaging(now, s, closed.into_iter().map(|g| g.members).collect());
        self.poll_later(s, now);
    }

    fn averaged(&mut self, group: usize, now: f64) -> anyhow::Result<()> {
        for p in self.groups[group].clone() {
            self.unsynced[p] -= 1;
            if self.unsynced[p] == 0 {
                self.iteration_done(p, now)?;
            }
        }
        Ok(())
    }

    /// Pipeline `p` averaged every stage of its iteration at `now`.
    fn iteration_done(&mut self, p: usize, now: f64) -> anyhow::Result<()> {
        if p == 0 {
            self.p0.push((now, now - self.started_at[p]));
        }
        self.completed[p] += 1;
        self.end = self.end.max(now);
        if self.completed[p] >= self.spec.iterations {
            // Nothing waits for a finished pipeline any more.
            self.finished[p] = true;
            for s in 0..self.schedulers.len() {
                if self.spec.pipelines > 1 {
                    let closed = self.schedulers[s].remove(p, Duration::from_secs_f64(now))?;
                    self.averaging(now, s, closed.into_iter().map(|g| g.members).collect());
                    self.poll_later(s, now);
                }
            }
        } else if self.scheduled == Some(self.completed[p]) {
            self.drained.push(p);
        } else {
            self.push(now, Event::Start { p });
        }
        let live = self.finished.iter().filter(|f| !**f).count();
        if self.scheduled.is_some() && !self.drained.is_empty() && self.drained.len() == live {
            let at = self.scheduled.take().expect("scheduled");
            let r = apply_repartition(
                self.costs,
                &self.solo,
                &mut self.partition,
                &self.monitor,
                self.opts,
                self.spec.microbatches as usize,
            )?;
            self.monitor.reset_baseline();
            let pause = r.pause_s;
            self.repartitions.push(Repartitioned {
                at_iteration: at,
                at_s: now,
                ..r
            });
            for q in std::mem::take(&mut self.drained) {
                self.push(now + pause, Event::Start { p: q });
            }
        }
        Ok(())
    }
}

/// Runs `spec` (P pipelines x S stages, `iterations`) over `costs`.
pub fn simulate(
    costs: &ModelCosts,
    spec: &JobSpec,
    opts: &SimOptions,
) -> anyhow::Result<TrainSimReport> {
    spec.validate()?;
    let (pn, sn) = (spec.pipelines as usize, spec.stages as usize);
    let layers = costs.layers();
    let partition: Vec<usize> = spec
        .partition_for(layers as u32)?
        .into_iter()
        .map(|n| n as usize)
        .collect();
    anyhow::ensure!(
        opts.link_bytes_per_s > 0.0 && opts.link_bytes_per_s.is_finite(),
        "the link rate must be a positive number of bytes per second"
    );
    let rate = opts.link_bytes_per_s;
    let mut sim = Sim {
        costs,
        spec,
        opts,
        solo: (0..layers)
            .map(|l| LayerCost {
                forward_s: costs.forward_s[l],
                backward_s: costs.backward_s[l],
                comm_in_s: costs.boundary_bytes[l] as f64 / rate,
                comm_out_s: costs.boundary_bytes[l + 1] as f64 / rate,
            })
            .collect(),
        partition,
        schedulers: (0..sn)
            .map(|_| scheduler(spec, pn))
            .collect::<anyhow::Result<_>>()?,
        monitor: StragglerMonitor::new(
            sn,
            MonitorConfig {
                window: u64::from(spec.dynamic.window),
                baseline_at: spec.dynamic.baseline_at,
                delay: spec.dynamic.delay,
                slow_ratio: spec.dynamic.threshold_up,
                fast_ratio: spec.dynamic.threshold_down,
            },
        )?,
        heap: BinaryHeap::new(),
        seq: 0,
        completed: vec![0; pn],
        unsynced: vec![0; pn],
        started_at: vec![0.0; pn],
        finished: vec![false; pn],
        groups: Vec::new(),
        group_members: 0,
        p0: Vec::new(),
        repartitions: Vec::new(),
        scheduled: None,
        drained: Vec::new(),
        end: 0.0,
    };
    for p in 0..pn {
        sim.push(0.0, Event::Start { p });
    }
    let mut events = 0u64;
    while let Some(Timed { at: now, ev, .. }) = sim.heap.pop() {
        events += 1;
        if events > EVENTS_MAX {
            bail!("the simulation passed {EVENTS_MAX} events (EVENTS_MAX) without finishing");
        }
        match ev {
            Event::Start { p } => sim.start(p, now)?,
            Event::Ready { p, s } => sim.ready(p, s, now)?,
            Event::Poll { s } => sim.poll(s, now),
            Event::Averaged { group } => sim.averaged(group, now)?,
        }
    }
    let done = sim.finished.iter().filter(|f| **f).count();
    anyhow::ensure!(
        done == pn,
        "the simulation stalled: {done} of {pn} pipelines finished (a group never closed)"
    );
    let samples = (pn as u64 * spec.iterations * u64::from(spec.batch)) as f64;
    let groups = sim.groups.len();
    Ok(TrainSimReport {
        samples_per_s: if sim.end > 0.0 {
            samples / sim.end
        } else {
            0.0
        },
        elapsed_s: sim.end,
        iterations: sim.p0,
        repartitions: sim.repartitions,
        mean_group: if groups > 0 {
            sim.group_members as f64 / groups as f64
        } else {
            0.0
        },
        partition: sim.partition,
    })
}

/// Re-partitions `partition` with the monitor's ratios; returns the record
/// (time fields filled by the caller) with the pause it costs.
fn apply_repartition(
    costs: &ModelCosts,
    solo: &[LayerCost],
    partition: &mut Vec<usize>,
    monitor: &StragglerMonitor,
    opts: &SimOptions,
    microbatches: usize,
) -> anyhow::Result<Repartitioned> {
    let predictor = match monitor.pending() {
        Some(r) => r.predictor()?,
        None => MeasuredRatio::none(),
    };
    let plan = repartition(
        solo,
        partition,
        &predictor,
        &RepartitionOptions {
            microbatches: microbatches.max(1),
            ..RepartitionOptions::default()
        },
    )?;
    let rate = opts.link_bytes_per_s;
    let old = ranges(partition);
    let new = ranges(&plan.partition);
    let bytes = |r: &std::ops::Range<usize>| costs.param_bytes[r.clone()].iter().sum::<u64>();
    // Checkpoint: every stage writes its weights, stages in parallel.
    let write_s = old.iter().map(bytes).max().unwrap_or(0) as f64 / rate;
    let reload_s = match opts.mode {
        RepartitionMode::Restart => new.iter().map(bytes).max().unwrap_or(0) as f64 / rate,
        _ => {
            new.iter()
                .enumerate()
                .map(|(s, r)| {
                    r.clone()
                        .filter(|l| !old[s].contains(l))
                        .map(|l| costs.param_bytes[l])
                        .sum::<u64>()
                })
                .max()
                .unwrap_or(0) as f64
                / rate
        }
    };
    let pause_s = write_s
        + reload_s
        + if opts.mode == RepartitionMode::Restart {
            opts.restart_s
        } else {
            0.0
        };
    let before = std::mem::replace(partition, plan.partition.clone());
    Ok(Repartitioned {
        at_iteration: 0,
        at_s: 0.0,
        pause_s,
        before,
        after: plan.partition,
    })
}

/// `distmind train simulate`.
pub fn run(args: &TrainSimArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.spec)
        .with_context(|| format!("reading the job spec {}", args.spec.display()))?;
    let mut spec =
        JobSpec::from_json(&text).with_context(|| format!("job spec {}", args.spec.display()))?;
    if let Some(p) = args.pipelines {
        spec.pipelines = p;
    }
    if let Some(s) = &args.sync {
        spec.sync = match s.as_str() {
            "allreduce" => SyncMode::Allreduce(Default::default()),
            "preduce" => SyncMode::Preduce(Default::default()),
            "adpsgd" => SyncMode::Adpsgd(Default::default()),
            other => bail!("--sync {other}: expected allreduce, preduce or adpsgd"),
        };
    }
    if let Some(h) = args.hetero {
        spec.interference.hetero_s = h;
    }
    spec.interference
        .slowdowns
        .extend(args.slowdown.iter().cloned());
    let mode = args.mode.unwrap_or(if spec.dynamic.enabled {
        RepartitionMode::Dynamic
    } else {
        RepartitionMode::Static
    });
    if mode != RepartitionMode::Static {
        spec.dynamic.enabled = true;
    }
    spec.validate()?;
    let profile = Profile::load(&args.profile)?;
    let microbatch = (spec.batch / spec.microbatches) as usize;
    let costs = ModelCosts::from_profile(
        &profile,
        args.family,
        args.scale,
        microbatch,
        args.backward_factor,
    )?;
    let link = distmind_common::emulate::parse_rate(&args.link).map_err(anyhow::Error::msg)?;
    let opts = SimOptions {
        link_bytes_per_s: link,
        mode,
        restart_s: args.restart_s,
        seed: args.seed,
    };
    let report = simulate(&costs, &spec, &opts)?;
    let label = args.label.clone().unwrap_or_else(|| {
        format!(
            "{}-{}",
            spec.sync.name(),
            format!("{mode:?}").to_lowercase()
        )
    });
    println!(
        "train simulate: {} ({}) x{} pipelines x {} stages, {} microbatches of {}, sync {}, mode {:?}, \
         hetero {} s (p {}), link {}; layer times {} (backward {}x forward, assumed)",
        args.family,
        args.scale,
        spec.pipelines,
        spec.stages,
        spec.microbatches,
        microbatch,
        spec.sync.name(),
        mode,
        spec.interference.hetero_s,
        spec.interference.hetero_p,
        distmind_common::emulate::format_link(link),
        profile.source_label(),
        args.backward_factor
    );
    for r in &report.repartitions {
        println!(
            "  re-partitioned before iteration {} at {:.2} s: {} -> {}, paused {:.3} s",
            r.at_iteration,
            r.at_s,
            partition_text(&r.before),
            partition_text(&r.after),
            r.pause_s
        );
    }
    println!(
        "  {label}: {:.1} samples/s over {:.2} s (virtual), mean group {:.2} of {}, \
         iteration time (pipeline 0) median {:.4} s",
        report.samples_per_s,
        report.elapsed_s,
        report.mean_group,
        spec.pipelines,
        median(report.iterations.iter().map(|&(_, d)| d).collect())
    );
    if let Some(path) = &args.csv {
        let mut text = String::new();
        for (i, (at, d)) in report.iterations.iter().enumerate() {
            text.push_str(&format!(
                "{label},{},{:?},{},{},{},{},{:.6},{:.6},{:.3}\n",
                spec.sync.name(),
                mode,
                spec.pipelines,
                spec.stages,
                spec.interference.hetero_s,
                i + 1,
                at,
                d,
                report.samples_per_s
            ));
        }
        crate::bench::append_csv(
            path,
            "label,sync,mode,pipelines,stages,hetero_s,iteration,end_s,iteration_s,samples_per_s",
            &text,
        )?;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A one-line partition, e.g. `20-18-17`.
pub fn partition_text(p: &[usize]) -> String {
    let parts: Vec<String> = p.iter().map(|n| n.to_string()).collect();
    parts.join("-")
}

#[cfg(test)]
mod tests;
