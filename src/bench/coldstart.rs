//! `distmind bench coldstart`: latency of the first request for a model that
//! is on no device and in no host cache, pipelined (network || H2D ||
//! compute, group by group) against load-then-run, in the same run, with
//! transfer-only and compute-only times measured too.
//!
//! Per family it prints `pipelined/sequential` and `to ideal` = pipelined /
//! the ideal pipeline: with G equal groups and stage times network, H2D and
//! compute, the slowest stage plus 1/G of each other one (the first group
//! must cross the stages before it, the last group those after it). Each
//! repeat runs load-then-run, compute-only and pipelined one after another;
//! `to ideal` is the median over the repeats of each pipelined run over the
//! ideal of its own repeat's stages (the JSON also has the ratio of the
//! medians). `--match-rate` rate-limits
//! the GPU server's link so that transfer-only is about compute-only, where
//! pipelining matters most. `noise` is the slowest compute-only run over
//! the fastest across the repeats: the same work each time, so how far the
//! host's speed moved while the row was measured.
//!
//! Real: memory servers, deploy, tcp transport, host cache, the pipeline,
//! and with `--executor cpu` the model math. With `--executor sim` each
//! layer and each H2D copy takes the time of a GPU profile, which the header
//! names (the shipped one is estimated from H200 peaks, not measured).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use distmind_common::emulate::{dilation, format_link, EmulatedLink};
use distmind_common::handshake::ClusterKey;
use distmind_controller::ControllerClient;
use distmind_models::{Dtype, Family, Package, Scale};
use distmind_runtime::cache::{CacheConfig, HostCache, BLOCK_BYTES_DEFAULT};
use distmind_runtime::device::Residency;
use distmind_runtime::exec::{Executor, ExecutorKind, HostTensor};
use distmind_runtime::fetch::FetchOptions;
use distmind_runtime::pipeline::{
    cold_start, sequential, PipelineOptions, Request, Stages, Timing,
};
use distmind_transport::priority::{process_cpu_time, threads_cpu_time};
use distmind_transport::tcp::{TcpOptions, TcpTransport};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::{local::LocalCluster, machine_line, median};
use crate::deploy;

pub mod concurrent;

#[derive(Args, Debug, Clone)]
pub struct ColdstartArgs {
    /// cpu (real math) or sim (layer times from --profile).
    #[arg(long, default_value = "sim")]
    pub executor: ExecutorKind,
    /// Families to measure, comma separated (default: all five).
    #[arg(long, value_delimiter = ',')]
    pub family: Vec<Family>,
    #[arg(long, default_value = "full")]
    pub scale: Scale,
    /// Batch size (default: 1 on cpu, the profile's 8 on sim for full scale).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Memory servers the models are sharded over.
    #[arg(long, default_value_t = 2)]
    pub memservers: usize,
    /// Measurements per figure, interleaved (the median is reported; on a
    /// small shared host two runs of the same model can differ by 20%).
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Limit the GPU server's link to this many Gbit/s.
    #[arg(long, conflicts_with = "match_rate")]
    pub rate_limit_gbps: Option<f64>,
    /// Also run each family with the link limited so that transfer-only ~= compute-only.
    #[arg(long)]
    pub match_rate: bool,
    /// GPU profile for the sim executor.
    #[arg(long, default_value = distmind_runtime::profile::SHIPPED_ESTIMATED_PATH)]
    pub profile: PathBuf,
    /// Bound on bytes a fetch has posted and not yet completed (MiB).
    #[arg(long, default_value_t = distmind_runtime::fetch::BYTES_IN_FLIGHT_DEFAULT >> 20)]
    pub in_flight_mib: u64,
    /// Parameter group sizes to measure, comma separated (bytes; 1 = one
    /// group per layer, 536870912 = the whole model in one group); each
    /// generates and deploys the families again (default: 32768000).
    #[arg(long, value_delimiter = ',')]
    pub group_bytes: Vec<u64>,
    /// Write the rows as JSON here too.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Append the rows to this CSV (created with its header), for `distmind plot`.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Print, per group, when it was in host memory, uploaded, and when its first layer started (last pipelined run).
    #[arg(long)]
    pub trace: bool,
    /// N devices cold-start N different models (variants of each family,
    /// default resnet152) at once from the same memory servers; prints
    /// `aggregate/transfer ratio`: their aggregate rate over one verified
    /// fetch's rate (bench transfer's `verified`), measured in the same run.
    #[arg(long, value_name = "N")]
    pub concurrent: Option<usize>,
    /// With --concurrent: also fill the same N models one after another
    /// (fetches one at a time) and print that aggregate next to it.
    #[arg(long, requires = "concurrent")]
    pub serial: bool,
    /// Emulated link (sim executor only): the memory servers' and this GPU server's links are held
    /// to the loopback rate (measured and chosen at start unless given), the GPU clock is dilated
    /// by K, and every figure is reported in emulated time.
    #[command(flatten)]
    pub emulate: crate::emulate::EmulateArgs,
}

#[derive(Serialize, Debug, Clone)]
pub struct Row {
    pub family: String,
    pub link: String,
    /// The package's group size (bytes) and the groups it made.
    pub group_bytes: u64,
    pub groups: usize,
    pub bytes: u64,
    /// Network only (memory servers to host cache), in emulated time.
    pub network_ms: f64,
    /// `bytes / link rate` when the link is emulated or limited.
    pub network_ideal_ms: Option<f64>,
    pub transfer_ms: f64,
    pub compute_ms: f64,
    pub pipelined_ms: f64,
    pub sequential_ms: f64,
    pub pipelined_over_sequential: f64,
    /// Pipelined over the ideal pipeline of its measured stages
    /// (`ideal_pipeline_ms`), paired: each repeat's pipelined run over the
    /// ideal of the stages measured in that repeat (the load-then-run and
    /// compute-only runs just before it), the median over the repeats. A
    /// host whose speed drifts between repeats moves both sides of a pair.
    pub ratio_to_ideal: f64,
    /// The same ratio unpaired: the median pipelined time over the ideal of
    /// the stages' medians, each taken over every repeat.
    pub ratio_of_medians_to_ideal: f64,
    /// Pipelined over the ideal pipeline of its groups as they are
    /// (`flow_shop_ms`: each group's share of the network and upload by its
    /// bytes, of compute by its layers' times in a warm run); `None` where
    /// the trace's layer times are not device times (cuda).
    pub ratio_to_flow_ideal: Option<f64>,
    /// The slowest compute-only run over the fastest, across the repeats:
    /// the same work each time, so how far this host's speed moved during
    /// the measurement (1.0 with `--repeat 1`). A ratio to ideal is no
    /// surer than this.
    pub compute_max_over_min: f64,
    /// CPU time of the whole bench process (every thread: this GPU
    /// server's and the in-process memory servers'), medians, in ms of real
    /// CPU time (never dilated): in the compute-only run, the load-then-run
    /// run and the pipelined run. `sequential_cpu_ms - compute_cpu_ms`
    /// estimates the data path's work, but two runs' compute differs by up
    /// to 20% on a noisy host: `pipelined_mover_cpu_ms` measures it.
    pub compute_cpu_ms: f64,
    pub sequential_cpu_ms: f64,
    pub pipelined_cpu_ms: f64,
    /// Of `pipelined_cpu_ms`, the threads that move bytes: this GPU
    /// server's (transport streams, fetch engine, upload stage) and the
    /// in-process memory servers' (which stand for other machines).
    pub pipelined_mover_cpu_ms: f64,
    pub pipelined_memserver_cpu_ms: f64,
    /// This host's cores (what the CPU times are shares of).
    pub cores: usize,
    /// `cpu` executor only: pipelined over the ideal pipeline plus the
    /// movers' CPU time (this GPU server's and the memory servers') spread
    /// over every core. The ideal counts network, upload and compute as
    /// three resources; with `cpu` they are the same cores, and this is
    /// what the pipeline reaches if moving bytes cannot hide in the cycles
    /// compute leaves idle. Not a bound where compute runs on a device.
    pub ratio_to_shared_core_ideal: Option<f64>,
}

/// Everything one family's measurements need, built once.
struct Bench<'a> {
    args: &'a ColdstartArgs,
    exec: &'a dyn Executor,
    cluster: &'a LocalCluster,
    key: &'a ClusterKey,
    emulated: Option<EmulatedLink>,
}

pub fn run(args: &ColdstartArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.repeat >= 1, "--repeat must be at least 1");
    // The memory servers and this GPU server: one bucket each.
    let emulated = args
        .emulate
        .resolve_measuring(None, args.memservers.max(1) + 1)?;
    anyhow::ensure!(
        emulated.is_none() || (args.rate_limit_gbps.is_none() && !args.match_rate),
        "--emulate-link sets the link: drop --rate-limit-gbps and --match-rate"
    );
    let exec =
        crate::services::executor(args.executor, &args.profile, dilation(emulated.as_ref()))?;
    let exec = exec.as_ref();
    if let Some(n) = args.concurrent {
        return concurrent::run(args, n, exec, emulated);
    }
    let families = if args.family.is_empty() {
        Family::ALL.to_vec()
    } else {
        args.family.clone()
    };
    let group_sizes = if args.group_bytes.is_empty() {
        vec![distmind_common::limits::GROUP_BYTES_DEFAULT]
    } else {
        args.group_bytes.clone()
    };
    anyhow::ensure!(
        group_sizes.iter().all(|&g| g > 0),
        "--group-bytes: every size must be at least 1 byte"
    );
    let dir = tempfile_dir()?;
    // The packages of one group size at a time: deploying the next size
    // replaces them in the catalog (same names), so the memory servers hold
    // at most two sizes at once.
    let generate = |group_bytes: u64| -> anyhow::Result<Vec<Package>> {
        let sub = dir.join(group_bytes.to_string());
        families
            .iter()
            .map(|&family| {
                let opts = distmind_models::GenOptions {
                    family,
                    variants: 1,
                    out_dir: sub.clone(),
                    scale: args.scale,
                    seed: 11,
                    group_bytes,
                    dtype: distmind_models::ParamDtype::F32,
                };
                Ok(Package::open(distmind_models::generate(&opts)?.remove(0))?)
            })
            .collect()
    };
    let mut packages = generate(group_sizes[0])?;
    let total: u64 = packages.iter().map(|p| p.manifest.stored_bytes).sum();
    let key = ClusterKey::from_secret(format!("coldstart-{}", rand::random::<u64>()).as_bytes());
    let n = args.memservers.max(1);
    let cluster = LocalCluster::start_with_nic(
        n,
        2 * total.div_ceil(n as u64) + (64 << 20) + total / 4,
        key.clone(),
        emulated.map(|e| e.loopback_bytes_per_s() as u64),
        other_machine_nice(exec.kind()),
    )?;
    let target = deploy::Target {
        controller: cluster.controller.clone(),
        key: key.clone(),
    };

    println!("coldstart bench: {}", machine_line());
    println!("executor: {}", exec.describe());
    if let Some(e) = &emulated {
        println!("link: {e}; every time below is emulated (measured / K)");
    }
    if exec.kind() == ExecutorKind::Sim {
        println!(
            "GPU time simulated from {} (transfers, cache and pipeline are real)",
            args.profile.display()
        );
    }
    println!(
        "{:<13} {:<10} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>6}",
        "family",
        "link",
        "groups",
        "MB",
        "network",
        "net/ideal",
        "transfer",
        "compute",
        "pipelined",
        "sequent.",
        "pip/seq",
        "to ideal",
        "to flow",
        "noise"
    );
    let bench = Bench {
        args,
        exec,
        cluster: &cluster,
        key: &key,
        emulated,
    };
    let mut rows = Vec::new();
    for (i, &group_bytes) in group_sizes.iter().enumerate() {
        if i > 0 {
            packages = generate(group_bytes)?;
        }
        for p in &packages {
            deploy::deploy_package(&target, p, &deploy::Options::default())?;
        }
        bench.measure_all(&packages, group_bytes, &mut rows)?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.csv {
        let profile = match exec.kind() {
            ExecutorKind::Sim => crate::simulate::profile_label(
                &args.profile,
                &distmind_runtime::profile::Profile::load(&args.profile)?,
            ),
            _ => "-".to_string(),
        };
        append_csv(
            path,
            &rows,
            &(exec.kind().to_string(), profile),
            emulated.as_ref(),
        )?;
    }
    Ok(())
}

impl Bench<'_> {
    /// Every package at its link (and at the matched rate, when asked).
    fn measure_all(
        &self,
        packages: &[Package],
        group_bytes: u64,
        rows: &mut Vec<Row>,
    ) -> anyhow::Result<()> {
        let (args, emulated) = (self.args, &self.emulated);
        for p in packages {
            let limit = match &emulated {
                Some(e) => Some(e.loopback_bytes_per_s()),
                None => args.rate_limit_gbps.map(|g| g * 1e9 / 8.0),
            };
            let base = self.measure(p, limit, group_bytes)?;
            rows.push(base.clone());
            if args.match_rate {
                if base.compute_ms < base.transfer_ms {
                    // A limit can only slow the link down.
                    println!(
                    "{:<13} (not rate-limited: compute-only {:.1} ms < transfer-only {:.1} ms at full speed; raise --batch to balance)",
                    base.family, base.compute_ms, base.transfer_ms
                );
                    continue;
                }
                // Bytes per second that makes the transfer take as long as compute.
                let rate = p.manifest.stored_bytes as f64 / (base.compute_ms / 1e3);
                rows.push(self.measure(p, Some(rate), group_bytes)?);
            }
        }
        Ok(())
    }

    /// Medians of `repeat` interleaved measurements for one package and link.
    fn measure(
        &self,
        pkg: &Package,
        rate_bytes_per_s: Option<f64>,
        group_bytes: u64,
    ) -> anyhow::Result<Row> {
        let m = &pkg.manifest;
        let kind = self.exec.kind();
        let transport = Arc::new(TcpTransport::new(TcpOptions {
            rate_limit_bytes_per_s: rate_bytes_per_s.map(|r| r as u64),
            thread_nice: kind.data_thread_nice(),
            ..TcpOptions::new(self.key.clone())
        })?);
        let block = BLOCK_BYTES_DEFAULT;
        let cache = HostCache::new(
            CacheConfig::new((m.stored_bytes.div_ceil(block) + 1) * block, block)
                .pinned_for(kind)
                .niced_for(kind),
            transport,
        )?;
        let residency = Residency::for_device(0, m.stored_bytes * 2, 2, kind.stage_thread_nice());
        let stages = Stages {
            cache: &cache,
            executor: self.exec,
            residency: &residency,
        };
        let entry =
            ControllerClient::connect(&self.cluster.controller, self.key, Duration::from_secs(10))?
                .get_model(&m.name)?;
        let inputs = vec![input_for(pkg, self.batch(pkg))];
        let opts = PipelineOptions {
            fetch: FetchOptions {
                bytes_in_flight_max: self.args.in_flight_mib << 20,
                ..FetchOptions::default()
            },
            ..PipelineOptions::default()
        };
        let request = || Request {
            entry: &entry,
            manifest: m,
            inputs: &inputs,
            arrived: Instant::now(),
        };
        let forget = || {
            cache.remove(&m.name);
            residency.evict(&m.name);
        };

        let (mut transfer, mut compute, mut pipelined, mut seq) = (vec![], vec![], vec![], vec![]);
        let mut network = vec![];
        let (mut seq_cpu, mut compute_cpu, mut pipelined_cpu) = (vec![], vec![], vec![]);
        let (mut mover_cpu, mut memserver_cpu) = (vec![], vec![]);
        // CPU time so far of the threads that move bytes: this GPU server's,
        // and the memory servers'.
        let movers = || {
            let ours: Duration = [
                distmind_transport::tcp::THREAD_PREFIX,
                distmind_runtime::fetch::engine::THREAD_PREFIX,
                residency.stage_threads().thread_prefix(),
            ]
            .iter()
            .map(|p| threads_cpu_time(p))
            .sum();
            (ours, threads_cpu_time(super::local::THREAD_NAME))
        };
        // CPU time of the process over `f` (real, never dilated), ms.
        let cpu = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
            let before = process_cpu_time();
            f()?;
            Ok(ms(process_cpu_time().saturating_sub(before)))
        };
        // Measured on the dilated clock, reported in emulated time.
        let k = dilation(self.emulated.as_ref());
        let ms = |d: Duration| ms(d) / k;
        let mut last_trace = None;
        let mut warm_trace = None;
        for _ in 0..self.args.repeat {
            forget();
            seq_cpu.push(cpu(&mut || {
                let (_, t, _) = sequential(&stages, &request(), &opts)?;
                seq.push(ms(t.total));
                network.push(ms(t.fetch));
                transfer.push(ms(t.fetch + t.h2d));
                Ok(())
            })?);
            // Resident now: a warm run is compute only.
            compute_cpu.push(cpu(&mut || {
                let (_, w, wt) = cold_start(&stages, &request(), &opts)?;
                compute.push(ms(w.compute));
                warm_trace = Some(wt);
                Ok(())
            })?);
            forget();
            let (ours, servers) = movers();
            pipelined_cpu.push(cpu(&mut || {
                let (_, t, tr): (_, Timing, _) = cold_start(&stages, &request(), &opts)?;
                pipelined.push(ms(t.total));
                last_trace = Some(tr);
                Ok(())
            })?);
            let (ours_after, servers_after) = movers();
            // Real CPU time, like `cpu`'s.
            mover_cpu.push(ours_after.saturating_sub(ours).as_secs_f64() * 1e3);
            memserver_cpu.push(servers_after.saturating_sub(servers).as_secs_f64() * 1e3);
        }
        forget();
        let paired =
            paired_ratio_to_ideal(&network, &transfer, &compute, &pipelined, m.groups.len());
        let network = median(network);
        // The link the bytes cross: emulated, or the limit's rate.
        let link_rate = match &self.emulated {
            Some(e) => Some(e.link_bytes_per_s()),
            None => rate_bytes_per_s,
        };
        let network_ideal = link_rate.map(|r| m.stored_bytes as f64 / r * 1e3);
        let compute_max_over_min = max_over_min(&compute);
        let (transfer, compute, pipelined, sequential) = (
            median(transfer),
            median(compute),
            median(pipelined),
            median(seq),
        );
        let ideal = ideal_pipeline_ms(&[network, transfer - network, compute], m.groups.len());
        let (mover_cpu, memserver_cpu) = (median(mover_cpu), median(memserver_cpu));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let row = Row {
            family: m.family.to_string(),
            link: match (&self.emulated, rate_bytes_per_s) {
                (Some(e), _) => format!("{} emu", format_link(e.link_bytes_per_s())),
                (None, Some(r)) => format!("{:.2} Gb/s", r * 8.0 / 1e9),
                (None, None) => "loopback".into(),
            },
            group_bytes,
            groups: m.groups.len(),
            bytes: m.stored_bytes,
            network_ms: network,
            network_ideal_ms: network_ideal,
            transfer_ms: transfer,
            compute_ms: compute,
            pipelined_ms: pipelined,
            sequential_ms: sequential,
            pipelined_over_sequential: pipelined / sequential,
            ratio_to_ideal: paired,
            ratio_of_medians_to_ideal: pipelined / ideal,
            ratio_to_flow_ideal: warm_trace
                .as_ref()
                .filter(|_| self.exec.kind() != ExecutorKind::Cuda)
                .and_then(|tr| group_compute_shares(m, tr))
                .map(|shares| {
                    let total = m.stored_bytes.max(1) as f64;
                    let by_bytes = |ms: f64| -> Vec<f64> {
                        m.groups
                            .iter()
                            .map(|g| ms * g.bytes as f64 / total)
                            .collect()
                    };
                    let comp: Vec<f64> = shares.iter().map(|s| s * compute).collect();
                    pipelined
                        / flow_shop_ms(&[by_bytes(network), by_bytes(transfer - network), comp])
                }),
            compute_max_over_min,
            compute_cpu_ms: median(compute_cpu),
            sequential_cpu_ms: median(seq_cpu),
            pipelined_cpu_ms: median(pipelined_cpu),
            pipelined_mover_cpu_ms: mover_cpu,
            pipelined_memserver_cpu_ms: memserver_cpu,
            cores,
            ratio_to_shared_core_ideal: (kind == ExecutorKind::Cpu)
                .then(|| pipelined / (ideal + (mover_cpu + memserver_cpu) / k / cores as f64)),
        };
        println!(
            "{:<13} {:<10} {:>6} {:>10.1} {:>10.2} {:>10} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>9.2} {:>9.2} {:>8} {:>6.2}",
            row.family,
            row.link,
            row.groups,
            row.bytes as f64 / 1e6,
            row.network_ms,
            row.network_ideal_ms
                .map_or("-".to_string(), |i| format!("{:.3}", row.network_ms / i)),
            row.transfer_ms,
            row.compute_ms,
            row.pipelined_ms,
            row.sequential_ms,
            row.pipelined_over_sequential,
            row.ratio_to_ideal,
            row.ratio_to_flow_ideal
                .map_or("-".to_string(), |r| format!("{r:.2}")),
            row.compute_max_over_min
        );
        if let (true, Some(tr)) = (self.args.trace, last_trace) {
            print_trace(m, &tr, warm_trace.as_ref());
            print_cpu(&row, k);
        }
        Ok(row)
    }

    fn batch(&self, pkg: &Package) -> usize {
        self.args.batch.unwrap_or(match self.exec.kind() {
            ExecutorKind::Cpu => 1,
            _ => pkg.manifest.inputs[0].shape[0],
        })
    }
}

/// The largest of `xs` over the smallest (1.0 for fewer than two, or a
/// zero minimum).
fn max_over_min(xs: &[f64]) -> f64 {
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if xs.len() < 2 || min <= 0.0 {
        1.0
    } else {
        max / min
    }
}

/// The shortest a pipeline of `groups` equal groups through stages taking
/// `stages` (ms, whole model each) can take: the slowest stage, plus one
/// group's worth of every other stage (filling and draining the pipeline).
fn ideal_pipeline_ms(stages: &[f64], groups: usize) -> f64 {
    let slowest = stages.iter().copied().fold(0.0, f64::max);
    let rest: f64 = stages.iter().sum::<f64>() - slowest;
    slowest + rest / groups.max(1) as f64
}

/// The median over the repeats of each one's pipelined time over the ideal
/// pipeline of the stages measured in that same repeat (`network`,
/// `transfer` = network + upload, `compute`; ms, one entry per repeat).
fn paired_ratio_to_ideal(
    network: &[f64],
    transfer: &[f64],
    compute: &[f64],
    pipelined: &[f64],
    groups: usize,
) -> f64 {
    let ratios = (0..pipelined.len())
        .map(|i| {
            let stages = [network[i], transfer[i] - network[i], compute[i]];
            pipelined[i] / ideal_pipeline_ms(&stages, groups)
        })
        .collect();
    median(ratios)
}

/// The shortest a pipeline of the groups as they are can take: stages in
/// order (network, upload, compute), each working on one group at a time,
/// group g entering a stage once it left the stage before and the stage
/// finished group g - 1 (a permutation flow shop in the groups' order).
/// `stages[s][g]`: stage s's time on group g (ms).
fn flow_shop_ms(stages: &[Vec<f64>]) -> f64 {
    let groups = stages.first().map_or(0, Vec::len);
    let mut done = vec![0.0f64; stages.len()];
    for g in 0..groups {
        let mut ready = 0.0f64;
        for (s, times) in stages.iter().enumerate() {
            done[s] = done[s].max(ready) + times.get(g).copied().unwrap_or(0.0);
            ready = done[s];
        }
    }
    done.last().copied().unwrap_or(0.0)
}

/// Each group's share of a warm run's compute: the layers from its first
/// layer to the next group's first (parameter-free layers go with the group
/// before them), timed by the trace's layer events. `None` when a layer's
/// events are missing or the run took no time.
fn group_compute_shares(
    m: &distmind_models::Manifest,
    tr: &distmind_runtime::pipeline::MergedTrace,
) -> Option<Vec<f64>> {
    use distmind_runtime::exec::TraceEvent;
    use distmind_runtime::pipeline::PipelineEvent;
    let mut start = vec![None; m.layers.len()];
    let mut end = vec![None; m.layers.len()];
    for &(t, e) in &tr.events {
        match e {
            PipelineEvent::Exec(TraceEvent::LayerStart { layer }) if layer < start.len() => {
                start[layer] = Some(t)
            }
            PipelineEvent::Exec(TraceEvent::LayerEnd { layer }) if layer < end.len() => {
                end[layer] = Some(t)
            }
            _ => {}
        }
    }
    let layer_ms: Vec<f64> = start
        .iter()
        .zip(&end)
        .map(|(s, e)| Some(ms(e.as_ref()?.saturating_sub(*s.as_ref()?))))
        .collect::<Option<_>>()?;
    let mut firsts: Vec<usize> = m.groups.iter().map(|g| g.first_layer).collect();
    firsts[0] = 0;
    let per_group: Vec<f64> = (0..firsts.len())
        .map(|g| {
            let to = firsts.get(g + 1).copied().unwrap_or(layer_ms.len());
            layer_ms[firsts[g]..to.max(firsts[g])].iter().sum()
        })
        .collect();
    let total: f64 = per_group.iter().sum();
    (total > 0.0).then(|| per_group.iter().map(|t| t / total).collect())
}

/// Nice value of the bench's in-process memory servers: they stand for
/// other machines, so where this GPU server computes on this host's cores
/// (`cpu`) they take only the cycles it leaves idle; elsewhere they run as
/// the process does.
pub(crate) fn other_machine_nice(kind: ExecutorKind) -> i32 {
    if kind.data_thread_nice() > 0 {
        distmind_transport::priority::NICE_OTHER_MACHINE
    } else {
        0
    }
}

/// How much of the host's cores the runs kept busy: where compute shares
/// the cores with the data path (`cpu`), the data path's work has only the
/// cycles compute leaves idle to hide in. `k`: the dilation the row's
/// times were divided by.
fn print_cpu(row: &Row, k: f64) {
    let busy = |cpu_ms: f64, wall_ms: f64| cpu_ms / (wall_ms * k * row.cores as f64) * 100.0;
    println!(
        "    CPU ms, every thread of this process, {} cores: compute-only run {:.0} ({:.0}% busy); \
pipelined run {:.0} ({:.0}% busy), of it moving bytes {:.0} in this GPU server (transport, fetch, \
upload) and {:.0} in the memory servers{}",
        row.cores,
        row.compute_cpu_ms,
        busy(row.compute_cpu_ms, row.compute_ms),
        row.pipelined_cpu_ms,
        busy(row.pipelined_cpu_ms, row.pipelined_ms),
        row.pipelined_mover_cpu_ms,
        row.pipelined_memserver_cpu_ms,
        row.ratio_to_shared_core_ideal
            .map_or(String::new(), |r| format!(
                "; to the ideal plus the movers' CPU over the cores: {r:.2}"
            )),
    );
}

/// Per group of the last pipelined run: when it was in host memory, uploaded,
/// its gate opened, its first layer started and its last layer ended; and how
/// long its layers took there (`cold`) and in the warm run before it (`warm`).
fn print_trace(
    m: &distmind_models::Manifest,
    tr: &distmind_runtime::pipeline::MergedTrace,
    warm: Option<&distmind_runtime::pipeline::MergedTrace>,
) {
    let f = |d: Option<Duration>| d.map_or("-".to_string(), |d| format!("{:.1}", ms(d)));
    let span = |tr: &distmind_runtime::pipeline::MergedTrace,
                g: &distmind_models::package::GroupEntry| {
        let first = tr.layer_start(g.first_layer)?;
        let end = tr.time_of(distmind_runtime::pipeline::PipelineEvent::Exec(
            distmind_runtime::exec::TraceEvent::LayerEnd {
                layer: g.last_layer,
            },
        ))?;
        Some((first, end))
    };
    let took = |s: Option<(Duration, Duration)>| f(s.map(|(a, b)| b.saturating_sub(a)));
    println!(
        "    group  in host  uploaded  gate open  first layer  last layer end (ms since start)  cold ms  warm ms"
    );
    for g in &m.groups {
        let cold = span(tr, g);
        println!(
            "    {:>5} {:>8} {:>9} {:>10} {:>12} {:>14} {:>25} {:>8}",
            g.index,
            f(tr.host_ready(g.index)),
            f(tr.uploaded(g.index)),
            f(tr.gate_opened(g.index)),
            f(cold.map(|c| c.0)),
            f(cold.map(|c| c.1)),
            took(cold),
            took(warm.and_then(|w| span(w, g)))
        );
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A seeded input of the manifest's shape with batch `batch`: images in
/// U(-1, 1), token ids in [0, vocab).
fn input_for(pkg: &Package, batch: usize) -> HostTensor {
    let spec = &pkg.manifest.inputs[0];
    let mut shape = spec.shape.clone();
    shape[0] = batch;
    let n: usize = shape.iter().product();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    match spec.dtype {
        Dtype::I64 => {
            let vocab = pkg
                .manifest
                .params
                .iter()
                .find(|p| p.name.ends_with("word_embeddings.weight") || p.name == "wte.weight")
                .map(|p| p.shape[0] as i64)
                .unwrap_or(2);
            HostTensor::i64(shape, (0..n).map(|_| rng.gen_range(0..vocab)).collect())
        }
        _ => HostTensor::f32(shape, (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()),
    }
}

/// The CSV columns of `--csv`.
pub const CSV_HEADER: &str =
    "family,group_bytes,groups,bytes,link,dilation,network_ms,transfer_ms,\
compute_ms,pipelined_ms,sequential_ms,ratio_to_ideal,executor,profile";

/// Appends `rows` to the CSV at `path` (the header first when it is new).
fn append_csv(
    path: &std::path::Path,
    rows: &[Row],
    (executor, profile): &(String, String),
    emulated: Option<&EmulatedLink>,
) -> anyhow::Result<()> {
    let mut text = String::new();
    for r in rows {
        text.push_str(&format!(
            "{},{},{},{},{},{:.4},{:.3},{:.3},{:.3},{:.3},{:.3},{:.4},{executor},{profile}\n",
            r.family,
            r.group_bytes,
            r.groups,
            r.bytes,
            r.link.replace(',', ";"),
            dilation(emulated),
            r.network_ms,
            r.transfer_ms,
            r.compute_ms,
            r.pipelined_ms,
            r.sequential_ms,
            r.ratio_to_ideal
        ));
    }
    super::append_csv(path, CSV_HEADER, &text)
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("distmind-coldstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::ideal_pipeline_ms;

    /// The whole bench on a tiny model with the cpu executor: real memory
    /// servers, transport, cache, pipeline and math, and the CPU time of
    /// the threads that move bytes found by their names.
    #[test]
    fn a_cpu_run_measures_the_cpu_time_of_the_threads_that_move_bytes() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: super::ColdstartArgs,
        }
        let dir = std::env::temp_dir().join(format!("distmind-cs-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = dir.join("rows.json");
        let cli = Cli::parse_from([
            "coldstart",
            "--executor",
            "cpu",
            "--scale",
            "tiny",
            "--family",
            "bert_base",
            "--repeat",
            "1",
            "--json",
            json.to_str().unwrap(),
        ]);
        super::run(&cli.args).unwrap();
        let rows: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let row = &rows[0];
        let f = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("{k} in {row}"));
        assert!(
            f("compute_cpu_ms") > 0.0 && f("pipelined_cpu_ms") > 0.0,
            "{row}"
        );
        // Both sides moved the model's bytes: the servers read and sent
        // them, this GPU server's threads received, checked and uploaded.
        assert!(f("pipelined_mover_cpu_ms") > 0.0, "{row}");
        assert!(f("pipelined_memserver_cpu_ms") > 0.0, "{row}");
        assert!(
            f("pipelined_mover_cpu_ms") + f("pipelined_memserver_cpu_ms")
                <= f("pipelined_cpu_ms") * 1.01,
            "a part of the process's CPU time is no larger than the whole: {row}"
        );
        // Charging the movers' CPU to the cores can only lower the ratio;
        // with one repeat, pairing changes nothing.
        assert!(
            f("ratio_to_shared_core_ideal") < f("ratio_of_medians_to_ideal"),
            "{row}"
        );
        assert_eq!(f("ratio_to_ideal"), f("ratio_of_medians_to_ideal"), "{row}");
        assert_eq!(
            row["cores"].as_u64(),
            std::thread::available_parallelism()
                .ok()
                .map(|n| n.get() as u64)
        );
    }

    #[test]
    fn a_paired_ratio_takes_each_pipelined_run_against_its_own_repeats_stages() {
        // Three repeats at host speeds 1, 1/2 and 2 (every stage scaled),
        // each pipelined run 1.0, 1.3 and 1.1 times its repeat's ideal
        // (8 groups: 100 + (40 + 20) / 8 = 107.5 ms at speed 1).
        let speed = [1.0, 2.0, 0.5];
        let over = [1.0, 1.3, 1.1];
        let scaled = |ms: f64| speed.map(|k| ms * k);
        let (net, transfer, compute) = (scaled(40.0), scaled(60.0), scaled(100.0));
        let pipelined: Vec<f64> = (0..3).map(|i| 107.5 * speed[i] * over[i]).collect();
        let paired = super::paired_ratio_to_ideal(&net, &transfer, &compute, &pipelined, 8);
        assert!((paired - 1.1).abs() < 1e-9, "{paired}");
        // Unpaired, the medians come from different repeats: the median
        // pipelined run is the fast repeat's and reads 1.0.
        let median = |xs: &[f64]| super::super::median(xs.to_vec());
        let stages = [
            median(&net),
            median(&transfer) - median(&net),
            median(&compute),
        ];
        let unpaired = median(&pipelined) / ideal_pipeline_ms(&stages, 8);
        assert!((unpaired - 1.0).abs() < 1e-9, "{unpaired}");
    }

    #[test]
    fn noise_is_the_slowest_run_over_the_fastest() {
        assert_eq!(super::max_over_min(&[120.0, 100.0, 150.0]), 1.5);
        assert_eq!(super::max_over_min(&[100.0]), 1.0);
        assert_eq!(super::max_over_min(&[0.0, 5.0]), 1.0);
    }

    #[test]
    fn the_flow_shop_of_equal_groups_is_the_ideal_pipeline() {
        // Equal groups: the two formulas agree.
        let g = 8;
        let stages = [vec![20.0 / 8.0; g], vec![16.0 / 8.0; g], vec![1.0; g]];
        assert!(
            (super::flow_shop_ms(&stages) - ideal_pipeline_ms(&[20.0, 16.0, 8.0], g)).abs() < 1e-9
        );
        // A large first group holds compute back for its whole transfer:
        // group 0 takes 6 + 3, then compute runs 10 + 2 + 2.
        let stages = [
            vec![6.0, 1.0, 1.0],
            vec![3.0, 0.5, 0.5],
            vec![10.0, 2.0, 2.0],
        ];
        assert_eq!(super::flow_shop_ms(&stages), 23.0);
        assert!(ideal_pipeline_ms(&[8.0, 4.0, 14.0], 3) < 23.0);
        assert_eq!(super::flow_shop_ms(&[]), 0.0);
    }

    #[test]
    fn the_ideal_pipeline_is_the_slowest_stage_plus_one_group_of_the_rest() {
        // Network 20, H2D 16, compute 8 over 8 groups: 20 + (16 + 8) / 8.
        assert_eq!(ideal_pipeline_ms(&[20.0, 16.0, 8.0], 8), 23.0);
        // One group: nothing overlaps, the stages add up.
        assert_eq!(ideal_pipeline_ms(&[20.0, 16.0, 8.0], 1), 44.0);
        assert_eq!(ideal_pipeline_ms(&[5.0], 0), 5.0);
    }
}
