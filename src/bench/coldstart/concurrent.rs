//! `distmind bench coldstart --concurrent N`: N devices of one GPU server
//! cold-start N different models at once from the same memory servers,
//! through one host cache (one transport, one fetch engine), each device
//! running the full pipeline.
//!
//! Printed per family: `aggregate/transfer ratio X`, where the aggregate
//! rate is the bytes of the N models over the wall time from the first
//! request to the last model complete in host memory (every group landed
//! and verified), and the transfer rate is what `bench transfer` measures
//! as `verified` (one fetch, every slice checksummed) for one of the same
//! models from the same servers, interleaved in the same run. With
//! `--serial`, the same N models are also filled one after another (fetches
//! one at a time, as a host did before fills shared the links) and that
//! aggregate is printed next to it.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::Context;
use distmind_common::emulate::{dilation, format_link, EmulatedLink};
use distmind_common::handshake::ClusterKey;
use distmind_common::proto::ModelEntry;
use distmind_controller::ControllerClient;
use distmind_models::{Family, Package};
use distmind_runtime::cache::{CacheConfig, HostCache, BLOCK_BYTES_DEFAULT};
use distmind_runtime::device::Residency;
use distmind_runtime::exec::{Executor, ExecutorKind};
use distmind_runtime::fetch::FetchOptions;
use distmind_runtime::pipeline::{cache_in, cold_start, PipelineOptions, Request, Stages};
use distmind_runtime::Peers;
use distmind_transport::tcp::{TcpOptions, TcpTransport};
use distmind_transport::{HostBuffer, HugePages, Transport};
use serde::Serialize;

use super::super::{local::LocalCluster, machine_line, median, transfer};
use super::{input_for, ColdstartArgs};
use crate::deploy;

/// Devices (and models) one run may cold-start at once.
pub const CONCURRENT_MAX: usize = 64;

/// One family's figures.
#[derive(Serialize, Debug, Clone)]
pub struct ConcurrentRow {
    pub family: String,
    pub link: String,
    pub models: usize,
    /// Bytes of the N models together.
    pub bytes: u64,
    /// One verified fetch (`bench transfer`'s `verified`), GB/s.
    pub transfer_gbps: f64,
    /// Bytes of the N models over first request to last model in host memory.
    pub concurrent_gbps: f64,
    pub aggregate_transfer_ratio: f64,
    /// First request to the last device's reply, ms.
    pub concurrent_served_ms: f64,
    /// First request to each model's group 0 in host memory (when its
    /// device can start computing), mean over the N models, ms.
    pub concurrent_group0_ms: f64,
    /// The same with the fills one after another (`--serial`).
    pub serial_group0_ms: Option<f64>,
    /// The same N models filled one after another (`--serial`).
    pub serial_gbps: Option<f64>,
    pub serial_transfer_ratio: Option<f64>,
}

/// Everything the measurements of one family share.
struct Setup<'a> {
    args: &'a ColdstartArgs,
    exec: &'a dyn Executor,
    cluster: &'a LocalCluster,
    key: &'a ClusterKey,
    emulated: Option<EmulatedLink>,
    /// Rate limit of this GPU server's link, bytes/s.
    limit: Option<f64>,
}

pub fn run(
    args: &ColdstartArgs,
    n: usize,
    exec: &dyn Executor,
    emulated: Option<EmulatedLink>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=CONCURRENT_MAX).contains(&n),
        "--concurrent takes 1 to {CONCURRENT_MAX} devices, not {n}"
    );
    anyhow::ensure!(
        !args.match_rate,
        "--match-rate does not apply to --concurrent"
    );
    let families = if args.family.is_empty() {
        vec![Family::Resnet152]
    } else {
        args.family.clone()
    };
    let group_bytes = match args.group_bytes.as_slice() {
        [] => distmind_common::limits::GROUP_BYTES_DEFAULT,
        [g] if *g > 0 => *g,
        _ => anyhow::bail!("--concurrent measures one --group-bytes size (at least 1 byte)"),
    };
    let dir = super::tempfile_dir()?;
    // N variants per family: N different models of the same size.
    let mut packages: Vec<Vec<Package>> = Vec::new();
    for &family in &families {
        let opts = distmind_models::GenOptions {
            family,
            variants: n,
            out_dir: dir.join(family.to_string()),
            scale: args.scale,
            seed: 11,
            group_bytes,
            dtype: distmind_models::ParamDtype::F32,
        };
        let pkgs = distmind_models::generate(&opts)?
            .iter()
            .map(Package::open)
            .collect::<Result<Vec<_>, _>>()?;
        packages.push(pkgs);
    }
    let total: u64 = packages
        .iter()
        .flatten()
        .map(|p| p.manifest.stored_bytes)
        .sum();
    let key = ClusterKey::from_secret(format!("coldstart-{}", rand::random::<u64>()).as_bytes());
    let servers = args.memservers.max(1);
    let cluster = LocalCluster::start_with_nic(
        servers,
        2 * total.div_ceil(servers as u64) + (64 << 20) + total / 4,
        key.clone(),
        emulated.map(|e| e.loopback_bytes_per_s() as u64),
        super::other_machine_nice(exec.kind()),
    )?;
    let target = deploy::Target {
        controller: cluster.controller.clone(),
        key: key.clone(),
    };
    for p in packages.iter().flatten() {
        deploy::deploy_package(&target, p, &deploy::Options::default())?;
    }

    println!("coldstart bench (concurrent): {}", machine_line());
    println!("executor: {}", exec.describe());
    if let Some(e) = &emulated {
        println!("link: {e}; rates below are emulated (measured x K)");
    }
    println!(
        "{n} devices cold-start {n} different models at once through one host cache and one tcp \
         transport from {servers} memory servers; transfer: one verified fetch of one of the models \
         (bench transfer's `verified`); aggregate: the N models' bytes over first request to last \
         model in host memory; group0: mean time to each model's first group in host memory{}",
        if args.serial {
            "; serial: the same fills one after another"
        } else {
            ""
        }
    );
    println!(
        "{:<13} {:<10} {:>6} {:>8} {:>9} {:>10} {:>7} {:>9} {:>9} {:>7} {:>8} {:>9} {:>9}",
        "family",
        "link",
        "models",
        "MB",
        "transfer",
        "concurrent",
        "ratio",
        "group0 ms",
        "served ms",
        "serial",
        "ratio",
        "conc/ser",
        "group0 ms"
    );
    let limit = match &emulated {
        Some(e) => Some(e.loopback_bytes_per_s()),
        None => args.rate_limit_gbps.map(|g| g * 1e9 / 8.0),
    };
    let setup = Setup {
        args,
        exec,
        cluster: &cluster,
        key: &key,
        emulated,
        limit,
    };
    let mut rows = Vec::new();
    for pkgs in &packages {
        let row = setup.measure(pkgs)?;
        println!(
            "{:<13} {:<10} {:>6} {:>8.1} {:>9.2} {:>10.2} {:>7.3} {:>9.1} {:>9.1} {:>7} {:>8} {:>9} {:>9}",
            row.family,
            row.link,
            row.models,
            row.bytes as f64 / 1e6,
            row.transfer_gbps,
            row.concurrent_gbps,
            row.aggregate_transfer_ratio,
            row.concurrent_group0_ms,
            row.concurrent_served_ms,
            opt(row.serial_gbps, 2),
            opt(row.serial_transfer_ratio, 3),
            opt(row.serial_gbps.map(|s| row.concurrent_gbps / s), 3),
            opt(row.serial_group0_ms, 1),
        );
        rows.push(row);
    }
    for r in &rows {
        print!(
            "{}: aggregate/transfer ratio {:.3}",
            r.family, r.aggregate_transfer_ratio
        );
        match (r.serial_transfer_ratio, r.serial_gbps) {
            (Some(sr), Some(sg)) => println!(
                " (fills one at a time: aggregate/transfer ratio {sr:.3}; concurrent/serial {:.3})",
                r.concurrent_gbps / sg
            ),
            _ => println!(),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.csv {
        append_csv(path, &rows, exec.kind(), setup.emulated.as_ref())?;
    }
    Ok(())
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |x| format!("{x:.digits$}"))
}

impl Setup<'_> {
    fn transport(&self) -> anyhow::Result<TcpTransport> {
        Ok(TcpTransport::new(TcpOptions {
            rate_limit_bytes_per_s: self.limit.map(|r| r as u64),
            thread_nice: self.exec.kind().data_thread_nice(),
            ..TcpOptions::new(self.key.clone())
        })?)
    }

    /// Medians of `repeat` interleaved rounds: one transfer, the serial
    /// fills (when asked) and the concurrent cold starts.
    fn measure(&self, pkgs: &[Package]) -> anyhow::Result<ConcurrentRow> {
        let n = pkgs.len();
        let mut controller =
            ControllerClient::connect(&self.cluster.controller, self.key, Duration::from_secs(10))?;
        let entries = pkgs
            .iter()
            .map(|p| controller.get_model(&p.manifest.name))
            .collect::<Result<Vec<ModelEntry>, _>>()?;
        let bytes: u64 = pkgs.iter().map(|p| p.manifest.stored_bytes).sum();
        let largest = pkgs
            .iter()
            .map(|p| p.manifest.stored_bytes)
            .max()
            .unwrap_or(0);
        let in_flight = self.args.in_flight_mib << 20;

        // The transfer baseline: its own transport and buffer, one fetch at a time.
        let transfer_t = self.transport()?;
        let transfer_buf = Arc::new(HostBuffer::new(largest as usize, HugePages::No)?);
        let transfer_region = transfer_t.register(transfer_buf.clone())?;
        let mut transfer_peers = Peers::new();

        // The GPU server: one host cache for all N models, one residency per device.
        let block = BLOCK_BYTES_DEFAULT;
        let blocks: u64 = pkgs
            .iter()
            .map(|p| p.manifest.stored_bytes.div_ceil(block) + 1)
            .sum();
        let cache = HostCache::new(
            CacheConfig::new(blocks * block, block)
                .pinned_for(self.exec.kind())
                .niced_for(self.exec.kind()),
            Arc::new(self.transport()?),
        )?;
        let devices: Vec<Residency> = pkgs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                Residency::for_device(
                    i as u32,
                    p.manifest.stored_bytes * 2,
                    2,
                    self.exec.kind().stage_thread_nice(),
                )
            })
            .collect();
        let inputs: Vec<_> = pkgs
            .iter()
            .map(|p| vec![input_for(p, self.batch(p))])
            .collect();
        let opts = PipelineOptions {
            fetch: FetchOptions {
                bytes_in_flight_max: in_flight,
                ..FetchOptions::default()
            },
            ..PipelineOptions::default()
        };
        let forget = || {
            for (p, d) in pkgs.iter().zip(&devices) {
                cache.remove(&p.manifest.name);
                d.evict(&p.manifest.name);
            }
        };

        let k = dilation(self.emulated.as_ref());
        let gbps = |bytes: u64, d: Duration| bytes as f64 / d.as_secs_f64() / 1e9 * k;
        let (mut transfer, mut concurrent, mut served, mut serial) =
            (vec![], vec![], vec![], vec![]);
        let (mut group0, mut serial_group0) = (vec![], vec![]);
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / k;
        // Warm-up, not measured: both transports connect to every server.
        transfer::fetch_gbps(
            &transfer_t,
            &mut transfer_peers,
            &entries[0],
            transfer_region,
            &transfer_buf,
            true,
            in_flight,
        )?;
        cache_in(&cache, &entries[0], &pkgs[0].manifest, &opts)?;
        for round in 0..self.args.repeat {
            let e = &entries[round % n];
            transfer.push(
                transfer::fetch_gbps(
                    &transfer_t,
                    &mut transfer_peers,
                    e,
                    transfer_region,
                    &transfer_buf,
                    true,
                    in_flight,
                )? * k,
            );
            if self.args.serial {
                forget();
                let started = Instant::now();
                for (p, e) in pkgs.iter().zip(&entries) {
                    cache_in(&cache, e, &p.manifest, &opts)?;
                }
                let (g0, done) = in_host(&cache, pkgs)?;
                serial.push(gbps(bytes, done.saturating_duration_since(started)));
                serial_group0.push(mean_ms(&g0, started, ms));
            }
            forget();
            // Every device starts its request at once.
            let barrier = Barrier::new(n + 1);
            let runs = std::thread::scope(|s| -> anyhow::Result<Vec<(Instant, Instant)>> {
                let handles: Vec<_> = (0..n)
                    .map(|d| {
                        let (barrier, cache, opts) = (&barrier, &cache, &opts);
                        let (p, e, input, residency) =
                            (&pkgs[d], &entries[d], &inputs[d], &devices[d]);
                        s.spawn(move || -> anyhow::Result<(Instant, Instant)> {
                            let stages = Stages {
                                cache,
                                executor: self.exec,
                                residency,
                            };
                            barrier.wait();
                            let request = Request {
                                entry: e,
                                manifest: &p.manifest,
                                inputs: input,
                                arrived: Instant::now(),
                            };
                            cold_start(&stages, &request, opts).with_context(|| {
                                format!("device {d}: cold start of {}", p.manifest.name)
                            })?;
                            Ok((request.arrived, Instant::now()))
                        })
                    })
                    .collect();
                barrier.wait();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a device thread panicked"))
                    .collect()
            })?;
            let started = runs.iter().map(|r| r.0).min().expect("n >= 1");
            let last_reply = runs.iter().map(|r| r.1).max().expect("n >= 1");
            let (g0, done) = in_host(&cache, pkgs)?;
            concurrent.push(gbps(bytes, done.saturating_duration_since(started)));
            group0.push(mean_ms(&g0, started, ms));
            served.push(ms(last_reply.saturating_duration_since(started)));
        }
        forget();
        drop(cache);
        transfer_t.deregister(transfer_region)?;

        let transfer = median(transfer);
        let concurrent = median(concurrent);
        let serial = (!serial.is_empty()).then(|| median(serial));
        Ok(ConcurrentRow {
            family: pkgs[0].manifest.family.to_string(),
            link: match (&self.emulated, self.limit) {
                (Some(e), _) => format!("{} emu", format_link(e.link_bytes_per_s())),
                (None, Some(r)) => format!("{:.2} Gb/s", r * 8.0 / 1e9),
                (None, None) => "loopback".into(),
            },
            models: n,
            bytes,
            transfer_gbps: transfer,
            concurrent_gbps: concurrent,
            aggregate_transfer_ratio: concurrent / transfer,
            concurrent_served_ms: median(served),
            concurrent_group0_ms: median(group0),
            serial_group0_ms: (!serial_group0.is_empty()).then(|| median(serial_group0)),
            serial_gbps: serial,
            serial_transfer_ratio: serial.map(|s| s / transfer),
        })
    }

    fn batch(&self, pkg: &Package) -> usize {
        self.args.batch.unwrap_or(match self.exec.kind() {
            ExecutorKind::Cpu => 1,
            _ => pkg.manifest.inputs[0].shape[0],
        })
    }
}

/// When each of `pkgs` had its group 0 in the host cache, and when the last
/// group of any of them became visible.
fn in_host(cache: &HostCache, pkgs: &[Package]) -> anyhow::Result<(Vec<Instant>, Instant)> {
    let mut group0 = Vec::with_capacity(pkgs.len());
    let mut last: Option<Instant> = None;
    for p in pkgs {
        let name = &p.manifest.name;
        let m = cache
            .get(name)
            .with_context(|| format!("{name} is not in the host cache after its cold start"))?;
        for g in 0..m.groups() {
            let at = m
                .ready_at(g)
                .with_context(|| format!("{name} group {g} never became visible"))?;
            if g == 0 {
                group0.push(at);
            }
            last = last.max(Some(at));
        }
    }
    Ok((group0, last.context("no model measured")?))
}

/// Mean of `times` after `start`, in ms as `ms` reports them.
fn mean_ms(times: &[Instant], start: Instant, ms: impl Fn(Duration) -> f64) -> f64 {
    let sum: f64 = times
        .iter()
        .map(|t| ms(t.saturating_duration_since(start)))
        .sum();
    sum / times.len().max(1) as f64
}

/// The CSV columns of `--concurrent` with `--csv` (another file than the
/// single-model rows).
pub const CSV_HEADER: &str = "family,models,bytes,link,dilation,transfer_gbps,concurrent_gbps,\
aggregate_transfer_ratio,concurrent_group0_ms,concurrent_served_ms,serial_gbps,serial_transfer_ratio,\
serial_group0_ms,executor";

fn append_csv(
    path: &std::path::Path,
    rows: &[ConcurrentRow],
    executor: ExecutorKind,
    emulated: Option<&EmulatedLink>,
) -> anyhow::Result<()> {
    let opt = |x: Option<f64>| x.map_or(String::new(), |x| format!("{x:.4}"));
    let mut text = String::new();
    for r in rows {
        text.push_str(&format!(
            "{},{},{},{},{:.4},{:.4},{:.4},{:.4},{:.3},{:.3},{},{},{},{executor}\n",
            r.family,
            r.models,
            r.bytes,
            r.link.replace(',', ";"),
            dilation(emulated),
            r.transfer_gbps,
            r.concurrent_gbps,
            r.aggregate_transfer_ratio,
            r.concurrent_group0_ms,
            r.concurrent_served_ms,
            opt(r.serial_gbps),
            opt(r.serial_transfer_ratio),
            opt(r.serial_group0_ms),
        ));
    }
    super::super::append_csv(path, CSV_HEADER, &text)
}
