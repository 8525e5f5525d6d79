//! `distmind simulate`: the cluster as a discrete-event simulation on a
//! virtual clock, for scales this machine cannot run as processes.
//!
//! It runs the controller's own dispatcher (`distmind_controller::dispatch::
//! Dispatcher`, configured by the same `services::dispatch_config` as a real
//! controller), GPU time from a profile (per layer, at the request's batch,
//! as the `sim` executor takes it), the package layout's parameter groups
//! (`distmind_models::layout`), and the client's Zipf draws and report. What
//! it models instead of running is in [`engine`]'s header. Every figure it
//! prints says it was simulated.

pub mod engine;
pub mod lru;
pub mod net;
pub mod train;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use distmind_models::{Family, Scale};
use distmind_runtime::profile::Profile;

use crate::loadgen::{self, stats::Report, stats::RunInfo};
use crate::up::System;
use engine::{Config, Load, Shape, Sim, Warm};

/// Most `--round-trip` or `--serial` takes: past it, it is not a network
/// or a serial path but a typo.
const ROUND_TRIP_MAX: Duration = Duration::from_secs(1);

/// `distmind simulate` flags.
#[derive(Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Settings directory (controller.json: policy, period, SLOs).
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// distmind, or a baseline: mps, ray, gpu (as `up --system`).
    #[arg(long, value_enum, default_value = "distmind")]
    pub system: System,
    /// The distmind system's controller policy (default: controller.json's).
    #[arg(long)]
    pub policy: Option<String>,
    /// lor or lfu (the controller's --balancer).
    #[arg(long)]
    pub balancer: Option<String>,
    /// Seconds between the distmind policy's reassignments (default: controller.json's).
    #[arg(long)]
    pub period: Option<f64>,
    /// Model family; every model is a variant of it.
    #[arg(long, default_value = "resnet152")]
    pub family: Family,
    #[arg(long, default_value = "full")]
    pub scale: Scale,
    /// Models in the catalog.
    #[arg(long, default_value_t = 8)]
    pub models: usize,
    /// Parameter group size (default: controller.json's group_bytes).
    #[arg(long)]
    pub group_bytes: Option<u64>,
    /// GPU servers.
    #[arg(long, default_value_t = 1)]
    pub gpu_servers: usize,
    /// GPUs per GPU server.
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// Memory servers.
    #[arg(long, default_value_t = 2)]
    pub memservers: usize,
    /// How each model's groups are sharded over the memory servers (as
    /// `distmind deploy --strategy`: hybrid, per-app, horizontal, vertical).
    #[arg(long, default_value = "hybrid")]
    pub strategy: distmind_controller::placement::Strategy,
    /// Memory servers a model is spread over (0: min(memory servers, 4), as deploy).
    #[arg(long, default_value_t = 0)]
    pub shard_width: usize,
    /// Baselines at equal memory: a model that is not in a GPU server's host
    /// memory (--cache smaller than the set) is read from its local disk at
    /// this rate, e.g. 3GB/s (NVMe). Without it a baseline's whole set must
    /// fit its host memory.
    #[arg(long)]
    pub local_disk: Option<String>,
    /// Share GPUs with training (the controller's use_train): the distmind
    /// policy moves GPUs between inference and training following
    /// inference_workload_s; the slo policy trains between requests, or,
    /// where an iteration is over half the SLO, on the GPUs that the
    /// demand leaves.
    #[arg(long)]
    pub use_train: bool,
    /// Inputs per training iteration (the original's resnet152_train: 96).
    /// An iteration takes 3 forward passes at this batch (estimated).
    #[arg(long, default_value_t = 96)]
    pub train_batch: usize,
    /// GPUs doing inference in each second, repeating (default:
    /// controller.json's inference_workload_s), e.g. 32,16,8,16.
    #[arg(long, value_delimiter = ',')]
    pub inference_workload: Vec<u32>,
    /// Write utilization over time (inference and training, figure 9) to this CSV.
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Interval of --timeline, simulated seconds.
    #[arg(long, default_value_t = 1.0)]
    pub timeline_interval: f64,
    /// GPU profile (default: `<settings>/profiles/v100-estimated.json`).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Every host's NIC (GPU servers and memory servers), e.g. 100gbit, 12.5GB/s.
    #[arg(long, default_value = "100gbit")]
    pub link: String,
    /// Host cache of each GPU server (default: the whole model set).
    #[arg(long, value_parser = parse_size)]
    pub cache: Option<u64>,
    /// Parameter memory of each GPU.
    #[arg(long, default_value = "16GiB", value_parser = parse_size)]
    pub device_memory: u64,
    /// DistMind starts with its host caches warm (the baselines always do).
    #[arg(long)]
    pub warm_cache: bool,
    /// closed (--concurrency clients, one request each), poisson (--rate over
    /// --connections) or trace (--trace); the client's own generators, so the
    /// same --seed sends the same requests as `distmind client`.
    #[arg(long, value_enum, default_value = "closed")]
    pub mode: loadgen::Mode,
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Requests per second (poisson), spread over --connections.
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// Open loop: connections the requests are spread over (as the client's).
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// CSV trace (--mode trace): header `time_s,model[,slo_ms]`, one request per
    /// line in time order. Every model it names is a variant of --family.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Zipf exponent of model popularity (0: uniform).
    #[arg(long, default_value_t = 0.9)]
    pub zipf: f64,
    /// Simulated time of the workload (trace: the part of the trace before it).
    #[arg(long, default_value = "60s", value_parser = loadgen::parse::parse_duration)]
    pub duration: Duration,
    /// Latency objective per request (default: controller.json's per family).
    #[arg(long)]
    pub slo_ms: Option<u64>,
    /// Inputs per request.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Mirror a time-dilated real run (`--emulate-link`) of this K, for
    /// validation: there the controller's tick (50 ms) and the runtimes'
    /// heartbeats (1 s) run on the real clock, K times as often in emulated
    /// time. 1 (default): a cluster at real speed.
    #[arg(long, default_value_t = 1.0)]
    pub mirror_dilation: f64,
    /// The round trip between the dispatcher and a GPU server, e.g. 1ms:
    /// a batch (or a prefetch, eviction or training order) reaches its
    /// runtime half of it after it was sent, and the answers (or a
    /// prefetch's report) the dispatcher half of it after the device
    /// finished (default: none, both at once). A real run's is the controller's
    /// `distmind_controller_dispatch_overhead_ms`.
    #[arg(long, value_parser = loadgen::parse::parse_duration)]
    pub round_trip: Option<Duration>,
    /// The GPU server's serial path per request, e.g. 0.1ms: after a batch
    /// of n requests, its device takes the next job n times this later
    /// (default: none). `distmind up` reports a real run's ("the GPU
    /// server's serial path: X ms of wall time per request").
    #[arg(long, value_parser = loadgen::parse::parse_duration)]
    pub serial: Option<Duration>,
    /// No background refills of a GPU server's host cache with what its
    /// devices evict (the runtime's `--no-host-refill`). As in the runtime,
    /// only GPU servers of one GPU refill, and baselines never do.
    #[arg(long)]
    pub no_host_refill: bool,
    /// Append the result as a row to this CSV (the columns of `up --csv`, source=simulator).
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// The row's system column (default: --system).
    #[arg(long)]
    pub label: Option<String>,
    /// The row's test column.
    #[arg(long, default_value = "simulate")]
    pub test: String,
}

/// Where every model's slices sit: the deploy tool's placement (the
/// controller's `placement::plan`), model after model, each planned with
/// the memory servers' use so far as deploy sees it.
fn place(
    group_bytes: &[u64],
    models: usize,
    a: &SimulateArgs,
) -> anyhow::Result<Vec<engine::ModelPlacement>> {
    use distmind_controller::placement::{plan, PlanOptions};
    let mut servers: Vec<distmind_common::proto::MemserverInfo> = (0..a.memservers)
        .map(|i| distmind_common::proto::MemserverInfo {
            id: i as u32,
            addr: format!("memserver-{i}"),
            capacity_bytes: u64::MAX / 2,
            used_bytes: 0,
            alive: true,
            last_heartbeat_ms_ago: 0,
        })
        .collect();
    let opts = PlanOptions {
        strategy: a.strategy,
        shard_width: a.shard_width,
        replication: 1,
        seed: a.seed,
    };
    let mut out = Vec::with_capacity(models);
    for m in 0..models {
        let p = plan(group_bytes, &servers, &opts)
            .map_err(|e| anyhow::anyhow!("placing model {m}: {e}"))?;
        let groups: engine::ModelPlacement = p
            .iter()
            .map(|g| g.iter().map(|s| (s.replicas[0] as usize, s.len)).collect())
            .collect();
        for &(ms, b) in groups.iter().flatten() {
            servers[ms].used_bytes += b;
        }
        out.push(groups);
    }
    Ok(out)
}

/// The workload of the client's generators for these flags.
fn load(
    a: &SimulateArgs,
    names: &[String],
    trace: Option<&[loadgen::TraceRow]>,
) -> anyhow::Result<Load> {
    let n = a.connections;
    Ok(match a.mode {
        loadgen::Mode::Closed => Load::Closed {
            clients: a.concurrency.clamp(1, loadgen::CONCURRENCY_MAX),
        },
        loadgen::Mode::Poisson => {
            let draw = std::sync::Arc::new(loadgen::drive::ModelDraw::new(names.len(), a.zipf)?);
            Load::Open {
                connections: (0..n)
                    .map(|i| {
                        loadgen::drive::Arrivals::poisson(
                            a.rate / n as f64,
                            a.duration.as_secs_f64(),
                            draw.clone(),
                            a.slo_ms,
                            loadgen::drive::thread_rng(a.seed, i),
                        )
                    })
                    .collect(),
            }
        }
        loadgen::Mode::Trace => {
            let rows = trace.expect("trace mode has a trace");
            let limit = Some(a.duration.as_secs_f64());
            Load::Open {
                connections: loadgen::drive::trace_arrivals(rows, names, n, limit, 1.0, a.slo_ms)
                    .into_iter()
                    .map(|d| loadgen::drive::Arrivals::Fixed(d.into_iter()))
                    .collect(),
            }
        }
    })
}

fn parse_size(s: &str) -> Result<u64, String> {
    distmind_memserver::parse_size(s).map_err(|e| e.to_string())
}

/// A model's groups and per-group compute at `batch`, from the family's
/// architecture, the package layout rule and the profile.
pub fn shape(
    family: Family,
    scale: Scale,
    batch: usize,
    group_bytes: u64,
    profile: &Profile,
) -> anyhow::Result<Shape> {
    let arch = family.config(scale).build();
    let sizes: HashMap<&str, (usize, u64)> = arch
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                p.name.as_str(),
                (i, p.shape.iter().product::<usize>() as u64 * 4),
            )
        })
        .collect();
    let layout = distmind_models::layout::plan(
        &arch.layers,
        arch.params.len(),
        |n| sizes.get(n).copied(),
        group_bytes,
        distmind_common::limits::PARAM_ALIGN_BYTES,
    )
    .map_err(|e| anyhow::anyhow!("{family}: {e}"))?;
    let times = profile.get(family, scale, batch).with_context(|| {
        format!(
            "profile {} has no layer times for {family}/{scale}",
            profile.origin()
        )
    })?;
    anyhow::ensure!(
        times.layers.len() == arch.layers.len(),
        "profile {} gives {} layers for {family}/{scale}, the architecture has {}",
        profile.origin(),
        times.layers.len(),
        arch.layers.len()
    );
    let firsts: Vec<usize> = layout.groups.iter().map(|g| g.first_layer).collect();
    let sum = |a: usize, b: usize| times.layers[a..b].iter().map(|l| l.time_s).sum::<f64>();
    let n = arch.layers.len();
    let group_compute_s = (0..firsts.len())
        .map(|g| sum(firsts[g], firsts.get(g + 1).copied().unwrap_or(n)))
        .collect();
    let block = distmind_runtime::cache::BLOCK_BYTES_DEFAULT;
    let stored = layout.stored_bytes();
    // A batch of k requests runs at k times the client's batch: the
    // profile's time there (interpolated between its measured batches,
    // e.g. b1 and b8) over its time at one request's batch.
    let one = times.total_s;
    let batch_factor = (1..=engine::BATCH_REQUESTS_MAX)
        .map(|k| {
            let t = profile
                .get(family, scale, batch * k)
                .map_or(one * k as f64, |m| m.total_s);
            if one > 0.0 {
                t / one
            } else {
                1.0
            }
        })
        .collect();
    Ok(Shape {
        group_bytes: layout.groups.iter().map(|g| g.bytes).collect(),
        cache_bytes: stored.div_ceil(block) * block,
        prefix_s: sum(0, firsts.first().copied().unwrap_or(n)),
        group_compute_s,
        batch_factor,
    })
}

/// What a simulation produced, for callers that compare it.
pub struct Outcome {
    pub report: Report,
    pub counts: engine::Counts,
    pub wall: Duration,
}

pub fn run(a: &SimulateArgs) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let settings = crate::services::load_settings(&a.settings)?;
    anyhow::ensure!(a.models > 0, "--models must be at least 1");
    anyhow::ensure!(a.batch > 0, "--batch must be at least 1");
    anyhow::ensure!(
        (a.mode == loadgen::Mode::Trace) == a.trace.is_some(),
        "--mode trace and --trace FILE go together"
    );
    anyhow::ensure!(
        a.mirror_dilation.is_finite()
            && (1.0..=distmind_common::emulate::DILATION_MAX).contains(&a.mirror_dilation),
        "--mirror-dilation must be in 1..={}",
        distmind_common::emulate::DILATION_MAX
    );
    for (flag, d) in [("--round-trip", a.round_trip), ("--serial", a.serial)] {
        anyhow::ensure!(
            d.is_none_or(|d| d <= ROUND_TRIP_MAX),
            "{flag} must be at most {} ms, got {:?}",
            ROUND_TRIP_MAX.as_millis(),
            d.unwrap_or_default()
        );
    }
    anyhow::ensure!(
        (1..=loadgen::CONNECTIONS_MAX).contains(&a.connections),
        "--connections must be 1..={}",
        loadgen::CONNECTIONS_MAX
    );
    anyhow::ensure!(
        a.mode != loadgen::Mode::Poisson || (a.rate > 0.0 && a.rate <= loadgen::RATE_MAX),
        "--rate must be in (0, {}]",
        loadgen::RATE_MAX
    );
    let trace = a.trace.as_deref().map(loadgen::load_trace).transpose()?;
    let profile_path = a
        .profile
        .clone()
        .unwrap_or_else(|| a.settings.join("profiles").join("v100-estimated.json"));
    let profile = Profile::load(&profile_path)?;
    let link = distmind_common::emulate::parse_rate(&a.link)
        .map_err(|e| anyhow::anyhow!("--link {}: {e}", a.link))?;
    let group_bytes = a.group_bytes.unwrap_or(settings.controller.group_bytes);
    let shape = shape(a.family, a.scale, a.batch, group_bytes, &profile)?;
    // The catalog: --models variants of the family, or the trace's models
    // (sorted, as the client lists them), each with the family's shape.
    let names: Vec<String> = match &trace {
        Some(rows) => {
            let mut n: Vec<String> = rows.iter().map(|r| r.model.clone()).collect();
            n.sort();
            n.dedup();
            n
        }
        None => (0..a.models)
            .map(|i| distmind_models::variant_name(a.family, a.scale, i))
            .collect(),
    };
    anyhow::ensure!(!names.is_empty(), "the trace names no models");
    let (resident_max, whole_model, preload) = match a.system.baseline() {
        Some(b) => b.preset(),
        None => (
            distmind_runtime::device::RESIDENT_MODELS_MAX_DEFAULT,
            false,
            false,
        ),
    };
    let policy = match a.system.baseline() {
        Some(_) => Some(a.system.as_str().to_string()),
        None => a.policy.clone(),
    };
    let controller = crate::services::ControllerArgs {
        settings: &a.settings,
        listen: None,
        client_listen: None,
        http_listen: None,
        grpc_listen: None,
        no_dispatcher: false,
        // The simulator runs the dispatcher's core on a virtual clock; no
        // tasks, no threads.
        dispatch_thread: distmind_controller::dispatch::DispatchThread::Pool,
        metrics: None,
        policy,
        balancer: a.balancer.clone(),
        train_model: None,
        use_train: Some(false),
        period_s: a.period,
        zipf_s: Some(a.zipf),
        seed: a.seed,
        emulate: crate::emulate::EmulateArgs::default(),
    };
    let mut dcfg = crate::services::dispatch_config(&settings, &controller)?;
    let train =
        if a.use_train {
            anyhow::ensure!(
                a.system.baseline().is_none(),
                "--use-train: the {} baseline does not share GPUs with training",
                a.system.as_str()
            );
            anyhow::ensure!(a.train_batch > 0, "--train-batch must be at least 1");
            let iteration_s = profile
                .train_iteration_s(a.family, a.scale, a.train_batch)
                .with_context(|| {
                    format!("profile {} has no times for {}", profile.origin(), a.family)
                })?;
            let model = format!("{}_train", a.family);
            dcfg.distmind.use_train = true;
            dcfg.train_model = Some(model.clone());
            if !a.inference_workload.is_empty() {
                dcfg.distmind.inference_workload_s = a.inference_workload.clone();
            }
            let gpus = (a.gpu_servers * a.gpus) as u32;
            anyhow::ensure!(
            !dcfg.distmind.inference_workload_s.is_empty()
                && dcfg.distmind.inference_workload_s.iter().all(|&n| n <= gpus),
            "--inference-workload (or controller.json's inference_workload_s) must list 1 or more \
             counts of inference GPUs, each at most the {gpus} GPUs; got {:?}",
            dcfg.distmind.inference_workload_s
        );
            Some(engine::TrainSim { model, iteration_s })
        } else {
            None
        };
    // What a controller on an emulated link of this rate assumes (emulated time).
    dcfg.priors.net_bytes_per_s = link;
    let d = distmind_controller::dispatch::Dispatcher::new(dcfg).map_err(anyhow::Error::msg)?;
    let cache = a
        .cache
        .unwrap_or(shape.cache_bytes * names.len() as u64 + (8 << 20));
    let local_disk = a
        .local_disk
        .as_deref()
        .map(|r| {
            distmind_common::emulate::parse_rate(r)
                .map_err(|e| anyhow::anyhow!("--local-disk {r}: {e}"))
        })
        .transpose()?;
    anyhow::ensure!(
        local_disk.is_none() || a.system.baseline().is_some(),
        "--local-disk is the baselines' source at equal memory; DistMind reads from the memory servers"
    );
    if a.system.baseline().is_some() && local_disk.is_none() {
        anyhow::ensure!(
            cache >= shape.cache_bytes * names.len() as u64,
            "the {} baseline holds the whole model set in host memory, and --cache {} does not fit {} \
             models of {} bytes: raise --cache, or give --local-disk RATE (equal memory)",
            a.system.as_str(),
            cache,
            names.len(),
            shape.cache_bytes
        );
    }
    // The gpu bound serves the first model only.
    let served: Vec<String> = if a.system == System::Gpu {
        names[..1].to_vec()
    } else {
        names.clone()
    };
    let placement = place(&shape.group_bytes, served.len(), a)?;
    let warm = match a.system {
        System::Gpu => Warm::Device,
        _ if preload || a.warm_cache => Warm::HostCache,
        _ => Warm::Nothing,
    };
    let cfg = Config {
        gpu_servers: a.gpu_servers,
        gpus_per_server: a.gpus,
        memservers: a.memservers,
        link_bytes_per_s: link,
        h2d_bytes_per_s: profile.peaks.h2d_bytes_per_s,
        cache_bytes: cache,
        device_bytes: a.device_memory,
        resident_max,
        whole_model,
        warm,
        names: served,
        shape,
        load: load(a, &names, trace.as_deref())?,
        zipf: a.zipf,
        slo_ms: a.slo_ms.map(|s| s as f64),
        duration_s: a.duration.as_secs_f64(),
        seed: a.seed,
        placement,
        local_disk_bytes_per_s: local_disk,
        train: train.clone(),
        timeline_interval_s: a.timeline.as_ref().map(|_| a.timeline_interval),
        mirror_dilation: a.mirror_dilation,
        round_trip_s: a.round_trip.map_or(0.0, |d| d.as_secs_f64()),
        serial_s: a.serial.map_or(0.0, |d| d.as_secs_f64()),
        host_refill: !a.no_host_refill && a.system.baseline().is_none() && a.gpus == 1,
    };
    let model_names = cfg.names.clone();
    let mut sim = Sim::new(cfg, d)?;
    sim.run()?;
    let counts = sim.counts.clone();
    let timeline = sim.timeline.take();
    let collector = std::mem::replace(&mut sim.collector, loadgen::stats::Collector::new(0));
    let report = Report::build(
        RunInfo {
            mode: a.mode.as_str(),
            target: "a simulated cluster",
            connections: if a.mode == loadgen::Mode::Closed {
                a.concurrency
            } else {
                a.connections
            },
            rate_rps: (a.mode == loadgen::Mode::Poisson).then_some(a.rate),
            duration_s: Some(a.duration.as_secs_f64()),
            elapsed_s: a.duration.as_secs_f64(),
            batch: a.batch,
            zipf_s: Some(a.zipf),
            slo_ms: a.slo_ms,
            seed: a.seed,
            interrupted: false,
            model_names: &model_names,
        },
        collector,
    );
    let wall = started.elapsed();
    let label = profile_label(&profile_path, &profile);
    println!(
        "simulate: {} on {} GPU server(s) x {} GPU(s), {} memory server(s), {} models of {}/{}, \
         every NIC {}, GPU time {label}; simulated, not measured",
        a.system.as_str(),
        a.gpu_servers,
        a.gpus,
        a.memservers,
        names.len(),
        a.family,
        a.scale,
        distmind_common::emulate::format_link(link),
    );
    print!("{}", report.render());
    println!(
        "simulate: {} events in {:.2} s of wall time; cold starts {}, host-cache hits {}, resident {}, \
         {:.1} GB fetched, {} evictions and {} prefetches ordered",
        counts.events,
        wall.as_secs_f64(),
        counts.cold,
        counts.host_hits,
        counts.resident,
        counts.fetched_bytes as f64 / 1e9,
        counts.evictions_ordered,
        counts.prefetches
    );
    if counts.disk_loads > 0 {
        println!(
            "simulate: {} whole-model reads from the GPU servers' local disks",
            counts.disk_loads
        );
    }
    if let Some(t) = &train {
        println!(
            "simulate: {} training iterations of {} ({:.1} ms each: 3 forward passes at batch {}, estimated)",
            counts.train_iterations,
            t.model,
            t.iteration_s * 1e3,
            a.train_batch
        );
    }
    if let (Some(path), Some(bins)) = (&a.timeline, timeline) {
        let gpus = a.gpu_servers * a.gpus;
        let compute_s = profile
            .get(a.family, a.scale, a.batch)
            .map(|m| m.total_s)
            .unwrap_or(f64::INFINITY);
        let train_s = profile
            .train_iteration_s(a.family, a.scale, a.train_batch)
            .unwrap_or(f64::INFINITY);
        let labels = crate::up::timeline::Labels {
            test: a.test.clone(),
            system: a.label.clone().unwrap_or_else(|| a.system.as_str().into()),
            link: distmind_common::emulate::format_link(link),
            dilation: 1.0,
            source: "simulator".into(),
            executor: "sim".into(),
            profile: profile_label(&profile_path, &profile),
        };
        crate::up::timeline::write(
            path,
            &labels,
            crate::up::timeline::Bounds::per_gpu(gpus, compute_s, train_s),
            &bins.samples(),
        )?;
        println!("simulate: timeline written to {}", path.display());
    }
    if let Some(path) = &a.csv {
        let row = crate::up::results::Row {
            test: a.test.clone(),
            system: a.label.clone().unwrap_or_else(|| a.system.as_str().into()),
            family: a.family.to_string(),
            models: names.len(),
            devices: (a.gpu_servers * a.gpus) as u32,
            zipf: a.zipf,
            period_s: a
                .period
                .unwrap_or(settings.controller.rescheduling_period_s),
            cache_bytes: cache,
            executor: "sim".into(),
            profile: label,
            runtime_rss_bytes: None,
            link: distmind_common::emulate::format_link(link),
            dilation: 1.0,
            loopback: "-".into(),
            source: "simulator".into(),
            serial_overhead_ms: None,
        };
        crate::up::results::append(path, &row, &report)?;
        println!("simulate: results appended to {}", path.display());
    }
    Ok(Outcome {
        report,
        counts,
        wall,
    })
}

/// `settings/profiles/x.json (estimated)`: a profile as figures name it
/// (the path relative where it can be).
pub fn profile_label(path: &std::path::Path, p: &Profile) -> String {
    format!(
        "{} ({})",
        crate::up::portable(path).display(),
        p.source.as_str()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: SimulateArgs,
    }

    fn args(extra: &[&str]) -> SimulateArgs {
        let settings = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("settings");
        let mut v = vec![
            "simulate".to_string(),
            "--settings".into(),
            settings.display().to_string(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        Cli::parse_from(v).a
    }

    fn v100() -> Profile {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(distmind_runtime::profile::SHIPPED_V100_ESTIMATED_PATH);
        Profile::load(p).unwrap()
    }

    /// One batch-1 request of ResNet-152 on the V100 profile, in seconds.
    fn resnet152_compute_s() -> f64 {
        shape(Family::Resnet152, Scale::Full, 1, 32_768_000, &v100())
            .unwrap()
            .compute_s()
    }

    #[test]
    fn the_shape_follows_the_package_layout_and_the_profile() {
        let p = v100();
        let s = shape(Family::Resnet152, Scale::Full, 1, 32_768_000, &p).unwrap();
        // 241.4 MB in 8 groups, as `model gen` packs it.
        assert_eq!(s.group_bytes.len(), 8);
        assert!(
            (s.stored_bytes() as f64 - 241.4e6).abs() < 0.1e6,
            "{}",
            s.stored_bytes()
        );
        let total = p.get(Family::Resnet152, Scale::Full, 1).unwrap().total_s;
        assert!((s.compute_s() - total).abs() < 1e-9);
        // Batch 8 takes the profile's batch-8 time.
        let s8 = shape(Family::Resnet152, Scale::Full, 8, 32_768_000, &p).unwrap();
        let total8 = p
            .get_exact(Family::Resnet152, Scale::Full, 8)
            .unwrap()
            .total_s;
        assert!((s8.compute_s() - total8).abs() < 1e-9);
        // A batch of 8 requests of batch 1 takes batch 8's time; 4 sit
        // between (interpolated).
        assert!((s.compute_s() * s.batch_factor[7] - total8).abs() < 1e-9);
        let f4 = s.batch_factor[3];
        assert!(f4 > 1.0 && f4 < s.batch_factor[7], "{:?}", s.batch_factor);
    }

    #[test]
    fn one_client_on_the_gpu_bound_runs_at_the_profile_rate() {
        let o = run(&args(&[
            "--system",
            "gpu",
            "--concurrency",
            "1",
            "--duration",
            "10s",
        ]))
        .unwrap();
        let per = resnet152_compute_s();
        let want = 1.0 / per;
        let got = o.report.throughput_rps;
        assert!((got - want).abs() / want < 0.01, "{got} vs {want} req/s");
        assert_eq!(o.counts.cold, 0);
    }

    #[test]
    fn the_round_trip_and_the_serial_path_take_their_time() {
        let per = resnet152_compute_s();
        let rate = |extra: &[&str]| {
            let mut a = vec!["--system", "gpu", "--duration", "10s"];
            a.extend_from_slice(extra);
            run(&args(&a)).unwrap().report.throughput_rps
        };
        // One client: each request waits for the round trip as well.
        let got = rate(&["--concurrency", "1", "--round-trip", "2ms"]);
        let want = 1.0 / (per + 0.002);
        assert!((got - want).abs() / want < 0.01, "{got} vs {want} req/s");
        // Four clients keep the device busy: the round trip hides behind
        // the next batch, the serial path does not.
        let got = rate(&["--concurrency", "4", "--round-trip", "2ms"]);
        let want = 1.0 / per;
        assert!((got - want).abs() / want < 0.02, "{got} vs {want} req/s");
        let got = rate(&["--concurrency", "4", "--serial", "1ms"]);
        let want = 1.0 / (per + 0.001);
        assert!((got - want).abs() / want < 0.02, "{got} vs {want} req/s");
        let e = run(&args(&["--round-trip", "2s"]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--round-trip must be at most 1000 ms"), "{e}");
    }

    #[test]
    fn without_a_cache_every_switch_pulls_over_the_network() {
        // DistMind with room for one model on the GPU and one in the host
        // cache, two models in turn: cold starts move whole models.
        let o = run(&args(&[
            "--models",
            "2",
            "--zipf",
            "0",
            "--device-memory",
            "240MB",
            "--cache",
            "244MiB",
            "--duration",
            "5s",
        ]))
        .unwrap();
        assert!(o.counts.cold > 0, "{:?}", o.counts);
        assert!(o.report.ok > 0);
        let stored = shape(Family::Resnet152, Scale::Full, 1, 32_768_000, &v100())
            .unwrap()
            .stored_bytes();
        // Whole models, but for the last, which may be on the wire when the
        // run ends.
        let f = o.counts.fetched_bytes;
        assert!(
            f <= o.counts.cold * stored && f > (o.counts.cold - 1) * stored,
            "{f}"
        );
        // The whole set cached: no fetches, more throughput.
        let warm = run(&args(&[
            "--models",
            "2",
            "--zipf",
            "0",
            "--device-memory",
            "240MB",
            "--warm-cache",
            "--duration",
            "5s",
        ]))
        .unwrap();
        assert_eq!(warm.counts.cold, 0);
        assert!(warm.report.throughput_rps > o.report.throughput_rps);
    }

    /// Eight ResNet-152 under Poisson load at 100 ms SLOs with the slo
    /// policy and the shipped H200 profile, for 3 s: `extra` gives the
    /// GPUs, memories and rate.
    fn run_h200_slo(extra: &[&str]) -> Outcome {
        let profile = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("settings/profiles/h200-estimated.json");
        let profile = profile.display().to_string();
        let mut a = vec![
            "--models",
            "8",
            "--policy",
            "slo",
            "--slo-ms",
            "100",
            "--mode",
            "poisson",
            "--duration",
            "3s",
            "--profile",
            &profile,
        ];
        a.extend_from_slice(extra);
        run(&args(&a)).unwrap()
    }

    #[test]
    fn gpus_that_need_a_model_being_fetched_wait_for_it_instead_of_fetching_it_again() {
        // Four GPUs of three models each, a host cache of four, eight
        // models, no warm cache, 1200 req/s: at the start every GPU misses
        // on models other GPUs are fetching. Each model comes over the
        // network about once (the runtime's cache has one fill per model;
        // a second miss takes its groups as they land). Fetching it again
        // per miss, one fetch at a time, took 158 cold starts in 3 s and
        // kept the link full.
        let o = run_h200_slo(&[
            "--gpus",
            "4",
            "--device-memory",
            "920MiB",
            "--cache",
            "960MiB",
            "--rate",
            "1200",
        ]);
        let stored = shape(Family::Resnet152, Scale::Full, 1, 32_768_000, &v100())
            .unwrap()
            .stored_bytes();
        assert!(o.counts.host_hits > 0, "{:?}", o.counts);
        assert!(o.counts.cold <= 16, "{:?}", o.counts);
        assert!(o.counts.fetched_bytes <= 16 * stored, "{:?}", o.counts);
    }

    #[test]
    fn host_memory_keeps_what_the_gpu_gave_up_rather_than_what_it_holds() {
        // One GPU of four models, a host cache of four (warm), eight
        // models, 200 req/s. The host cache lets go first of the models the
        // GPU keeps (all but its least recently used), so a model the GPU
        // evicted is often still in host memory: 68 host-cache hits against
        // 90 cold starts in 3 s. Plain LRU kept copies of what the GPU
        // held, and the GPU's evicted models went to the memory servers: 18
        // hits against 112.
        let o = run_h200_slo(&[
            "--gpus",
            "1",
            "--device-memory",
            "928MiB",
            "--cache",
            "936MiB",
            "--warm-cache",
            "--rate",
            "200",
        ]);
        assert!(o.counts.host_hits * 2 >= o.counts.cold, "{:?}", o.counts);
    }

    #[test]
    fn what_a_gpu_evicts_comes_back_into_host_memory_in_the_background() {
        // Test 2's shape: one GPU and a host cache of four models each,
        // eight models, four closed-loop clients. A host-cache hit makes the
        // GPU evict a model host memory lacks; refilled in place of one the
        // GPU keeps, host and GPU memory hold the whole set between them:
        // 149 cold starts in 10 s against 263 without, 96.6 req/s against
        // 94.0.
        let shape = [
            "--models",
            "8",
            "--mode",
            "closed",
            "--concurrency",
            "4",
            "--device-memory",
            "928MiB",
            "--cache",
            "936MiB",
            "--warm-cache",
            "--duration",
            "10s",
        ];
        let with = run(&args(&shape)).unwrap();
        let without = run(&args(&[&shape[..], &["--no-host-refill"]].concat())).unwrap();
        assert_eq!(without.counts.refills, 0);
        assert!(with.counts.refills > 0);
        assert!(
            with.counts.cold * 3 < without.counts.cold * 2,
            "{:?} against {:?}",
            with.counts,
            without.counts
        );
        assert!(with.report.ok > without.report.ok);
    }

    #[test]
    fn a_hot_model_is_copied_onto_gpus_that_have_room_for_it() {
        // Four GPUs with room for all eight models each, four closed-loop
        // clients, Zipf 0.9, the slo policy. Routing keeps a request on a
        // GPU that holds its model while it meets the deadline; held by one
        // GPU, the hot model queued there while the other GPUs idled (674
        // req/s in 10 s, 0.61 of four GPUs' bound). Idle GPUs now take
        // copies of it: 1054 req/s, 0.96.
        let o = run(&args(&[
            "--models",
            "8",
            "--gpus",
            "4",
            "--device-memory",
            "2400MiB",
            "--cache",
            "2000MiB",
            "--warm-cache",
            "--mode",
            "closed",
            "--concurrency",
            "4",
            "--policy",
            "slo",
            "--duration",
            "10s",
        ]))
        .unwrap();
        let per = resnet152_compute_s();
        let bound = 4.0 / per;
        assert!(o.counts.prefetches > 0, "{:?}", o.counts);
        assert_eq!(o.counts.cold, 0, "{:?}", o.counts);
        assert!(
            o.report.throughput_rps > 0.85 * bound,
            "{} req/s against a bound of {bound}",
            o.report.throughput_rps
        );
    }

    #[test]
    fn slo_with_training_longer_than_the_slo_keeps_gpus_for_inference() {
        // 8 GPUs, 16 models, 400 req/s with a 100 ms SLO (1.4 GPUs of
        // work), the training job on the V100 profile: 244 ms iterations.
        // Every GPU trained between requests, and a request that came
        // during an iteration waited it out: 0.0% within the SLO. Now GPUs
        // enough for the demand stay inference-only and the rest train:
        // 98.6% within the SLO and 3.8 GPUs training (the distmind policy
        // told to keep 4: 99.1%, 4.0).
        let o = run(&args(&[
            "--gpus",
            "8",
            "--models",
            "16",
            "--device-memory",
            "16GiB",
            "--cache",
            "4GiB",
            "--mode",
            "poisson",
            "--rate",
            "400",
            "--slo-ms",
            "100",
            "--duration",
            "20s",
            "--policy",
            "slo",
            "--use-train",
        ]))
        .unwrap();
        let slo = o.report.slo.as_ref().expect("an SLO was given");
        assert!(slo.attainment >= 0.97, "{slo:?} {:?}", o.counts);
        let iteration_s = v100()
            .train_iteration_s(Family::Resnet152, Scale::Full, 96)
            .unwrap();
        let training_gpus = o.counts.train_iterations as f64 * iteration_s / 20.0;
        assert!(
            training_gpus >= 3.0,
            "{training_gpus:.2} GPUs trained: {:?}",
            o.counts
        );
    }

    /// One GPU server of 4 GPUs on a `link` shared with one memory server,
    /// 64 ResNet-152 variants (more than the GPUs hold), 100 req/s Poisson,
    /// Zipf 0.9, 100 ms SLO, 30 s: the fraction within the SLO under
    /// `policy`, and the counts.
    fn on_a_shared_link(link: &str, policy: &str) -> (f64, String) {
        let profile = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(distmind_runtime::profile::SHIPPED_V100_ESTIMATED_PATH);
        let profile = profile.display().to_string();
        let o = run(&args(&[
            "--profile",
            &profile,
            "--link",
            link,
            "--gpu-servers",
            "1",
            "--gpus",
            "4",
            "--memservers",
            "1",
            "--device-memory",
            "16GiB",
            "--models",
            "64",
            "--cache",
            "2GiB",
            "--mode",
            "poisson",
            "--rate",
            "100",
            "--zipf",
            "0.9",
            "--slo-ms",
            "100",
            "--duration",
            "30s",
            "--policy",
            policy,
        ]))
        .unwrap();
        let slo = o.report.slo.as_ref().expect("an SLO was given");
        (slo.attainment, format!("{slo:?} {:?}", o.counts))
    }

    #[test]
    fn slo_loads_measured_on_a_shared_link_do_not_shut_models_out() {
        // At 50 Gbit/s the first loads share the link four ways. Learnt as
        // measured they rejected later loads for the run: 78.2% within the
        // SLO, against 93.6% for the mps balancer, which admits everything.
        // Learnt as one load alone, and a new load estimated with the other
        // GPUs loading beside it: 89.2% (seeds 0-7: 82.8% before, 89.9%
        // after, mps 93.3%, means); 96.2% since prefetches wait for a free
        // link.
        let (within, why) = on_a_shared_link("50gbit", "slo");
        assert!(within >= 0.85, "{why}");
    }

    #[test]
    fn slo_prefetches_wait_for_a_free_link() {
        // At 40 Gbit/s, prefetches that started while requests' loads
        // shared the link slowed them past the deadlines they were admitted
        // on: slo kept 76.3% within the SLO, below mps's 83.0%. Started
        // only on a free link: 94.3%.
        let (slo, why) = on_a_shared_link("40gbit", "slo");
        let (mps, _) = on_a_shared_link("40gbit", "mps");
        assert!(slo >= mps + 0.05, "slo {slo:.3}, mps {mps:.3}: {why}");
    }

    #[test]
    fn a_closed_loop_whose_every_request_is_rejected_still_moves_on() {
        // No GPU can meet a 1 ms SLO: each request is rejected at admission,
        // at the instant it is sent. The client sent again at that instant,
        // so simulated time never moved and the run never ended. It now
        // pays a loopback round trip per request: 4 clients, 1 s.
        let o = run(&args(&[
            "--slo-ms",
            "1",
            "--policy",
            "slo",
            "--mode",
            "closed",
            "--concurrency",
            "4",
            "--duration",
            "1s",
        ]))
        .unwrap();
        let per_client = 1.0 / super::engine::INSTANT_REPLY_TURNAROUND_S;
        let want = 4.0 * per_client;
        assert_eq!(o.report.ok, 0);
        assert_eq!(o.report.rejected, o.report.sent);
        assert!(
            (o.report.sent as f64 - want).abs() <= 8.0,
            "{} sent, about {want} wanted",
            o.report.sent
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let a = run(&args(&["--duration", "3s", "--cache", "1GiB"])).unwrap();
        let b = run(&args(&["--duration", "3s", "--cache", "1GiB"])).unwrap();
        assert_eq!(a.report.ok, b.report.ok);
        assert_eq!(a.report.latency.p99_ms, b.report.latency.p99_ms);
    }

    #[test]
    fn placement_follows_the_deploy_strategy() {
        let groups = shape(Family::Resnet152, Scale::Full, 1, 32_768_000, &v100())
            .unwrap()
            .group_bytes;
        let per_app = place(
            &groups,
            8,
            &args(&["--memservers", "4", "--strategy", "per-app"]),
        )
        .unwrap();
        let hybrid = place(&groups, 8, &args(&["--memservers", "4"])).unwrap();
        for m in 0..8 {
            // per-app: one server holds the whole model; hybrid: every group on 4.
            let servers: std::collections::BTreeSet<usize> =
                per_app[m].iter().flatten().map(|&(ms, _)| ms).collect();
            assert_eq!(servers.len(), 1, "model {m}: {servers:?}");
            assert!(hybrid[m].iter().all(|g| g.len() == 4));
            for (g, &b) in groups.iter().enumerate() {
                assert_eq!(per_app[m][g].iter().map(|&(_, n)| n).sum::<u64>(), b);
                assert_eq!(hybrid[m][g].iter().map(|&(_, n)| n).sum::<u64>(), b);
            }
        }
        // per-app spreads whole models over the servers, most free first.
        let homes: std::collections::BTreeSet<usize> = (0..8).map(|m| per_app[m][0][0].0).collect();
        assert_eq!(homes.len(), 4);
    }

    #[test]
    fn one_memory_server_per_model_is_the_bottleneck_of_many_cold_starts() {
        // Four GPU servers, no cache to speak of, uniform popularity: every
        // request pulls a model. Sharded over 4 servers, a model comes at
        // the GPU server's link rate; on one server (per-app), concurrent
        // pulls of models that share a home queue behind its NIC.
        let run_with = |strategy: &str| {
            run(&args(&[
                "--models",
                "8",
                "--zipf",
                "0",
                "--gpu-servers",
                "4",
                "--memservers",
                "4",
                "--strategy",
                strategy,
                "--concurrency",
                "16",
                "--device-memory",
                "250MB",
                "--cache",
                "244MiB",
                "--duration",
                "5s",
            ]))
            .unwrap()
        };
        let hybrid = run_with("hybrid");
        let per_app = run_with("per-app");
        assert!(hybrid.counts.cold > 50 && per_app.counts.cold > 50);
        assert!(
            hybrid.report.throughput_rps > per_app.report.throughput_rps,
            "hybrid {} vs per-app {}",
            hybrid.report.throughput_rps,
            per_app.report.throughput_rps
        );
    }

    #[test]
    fn training_fills_what_inference_leaves() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("timeline.csv");
        let o = run(&args(&[
            "--gpus",
            "2",
            "--models",
            "2",
            "--use-train",
            "--inference-workload",
            "2,1,0",
            "--duration",
            "6s",
            "--timeline",
            path.to_str().unwrap(),
            "--concurrency",
            "2",
        ]))
        .unwrap();
        assert!(o.counts.train_iterations > 0, "{:?}", o.counts);
        assert!(o.report.ok > 0);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().next(), Some(crate::up::timeline::HEADER));
        assert_eq!(text.lines().count(), 1 + 6);
        // A GPU trains for iterations of 3 forward passes at batch 96: at most
        // its bound of 1 / iteration per second each.
        let train_s = v100()
            .train_iteration_s(Family::Resnet152, Scale::Full, 96)
            .unwrap();
        assert!(o.counts.train_iterations as f64 <= 2.0 * 6.0 / train_s + 2.0);
        // Baselines never train.
        assert!(run(&args(&["--system", "mps", "--use-train"])).is_err());
    }

    #[test]
    fn baselines_at_equal_memory_read_misses_from_the_local_disk() {
        let common = [
            "--system",
            "mps",
            "--models",
            "8",
            "--zipf",
            "0",
            "--device-memory",
            "250MB",
            "--cache",
            "1GiB",
            "--duration",
            "5s",
        ];
        // The whole set must fit host memory unless a disk is given.
        assert!(run(&args(&common)).is_err());
        let mut with_disk = common.to_vec();
        with_disk.extend(["--local-disk", "3GB/s"]);
        let o = run(&args(&with_disk)).unwrap();
        assert!(o.counts.disk_loads > 0, "{:?}", o.counts);
        assert_eq!(o.counts.fetched_bytes, 0, "nothing over the network");
        // DistMind reads from the memory servers, never a local disk.
        assert!(run(&args(&["--local-disk", "3GB/s"])).is_err());
    }

    #[test]
    fn a_trace_is_replayed_as_the_client_would_send_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.csv");
        let a = distmind_models::variant_name(Family::Resnet152, Scale::Full, 0);
        let b = distmind_models::variant_name(Family::Resnet152, Scale::Full, 1);
        let mut text = String::from("time_s,model,slo_ms\n");
        for i in 0..100 {
            let m = if i % 4 == 0 { &b } else { &a };
            text.push_str(&format!("{},{m},\n", i as f64 * 0.02));
        }
        std::fs::write(&path, text).unwrap();
        let o = run(&args(&[
            "--mode",
            "trace",
            "--trace",
            path.to_str().unwrap(),
            "--duration",
            "5s",
        ]))
        .unwrap();
        assert_eq!(o.report.sent, 100);
        assert_eq!(o.report.ok, 100);
        assert!(
            run(&args(&["--mode", "trace"])).is_err(),
            "trace mode needs --trace"
        );
    }
}
