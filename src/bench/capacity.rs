//! `distmind bench capacity`: capacity at SLO, the standard measure of
//! serving systems. The highest Poisson rate at which at least 99% of the
//! requests sent finish within a 100 ms SLO, found by a rate sweep, for the
//! mps baseline and for DistMind with the `slo` policy, on one
//! configuration and in one run; the ratio of the two is the figure.
//!
//! The configuration is the end-to-end test's (`ae/2_e2e`): ResNet-152
//! variants on one GPU (`--devices N`: N GPUs of one GPU server) with
//! parameter memory for half of them each (by default
//! simulated: the `sim` executor, GPU time from a profile; `--executor cuda`
//! runs real kernels on CUDA device 0), 2 memory servers, Zipf 0.9,
//! batch 1, and equal memory: every system holds the whole set in its GPU
//! server's host memory (`--half-cached`: DistMind holds half, warm). Every
//! point is a real cluster of processes (`distmind up`); `--emulate-link`
//! runs them on an emulated link.
//!
//! Per rate the CSV says why: the fraction within the SLO, the fraction
//! rejected at admission, the dispatcher's mean batch size and the model
//! switches (batches that had to load their model) per second.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser};
use distmind_common::metrics::sample_value;

use distmind_runtime::exec::ExecutorKind;

use crate::up::{self, UpArgs};

/// Stored MiB of one full-size ResNet-152 package (as `ae/lib.sh` sizes it).
const RESNET152_STORED_MIB: u64 = 232;

#[derive(Args, Debug, Clone)]
pub struct CapacityArgs {
    /// Settings directory (cluster.key, controller.json, profiles).
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// Offered rates (req/s, emulated under --emulate-link), swept in
    /// ascending order; each system's sweep ends at its first rate below
    /// the target.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "100,200,300,400,500,600,800,1000,1200"
    )]
    pub rates: Vec<f64>,
    /// Workload per rate (emulated time under --emulate-link).
    #[arg(long, default_value = "10s", value_parser = crate::loadgen::parse_duration)]
    pub duration: Duration,
    /// ResNet-152 variants.
    #[arg(long, default_value_t = 8)]
    pub models: u64,
    /// Latency SLO of every request, ms.
    #[arg(long, default_value_t = 100)]
    pub slo_ms: u64,
    /// Fraction of the requests sent that must finish within the SLO.
    #[arg(long, default_value_t = 0.99)]
    pub target: f64,
    /// Zipf exponent of model popularity.
    #[arg(long, default_value_t = 0.9)]
    pub zipf: f64,
    /// The GPU: sim (GPU time from a profile) or cuda (real kernels on
    /// CUDA device 0; needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "sim")]
    pub executor: GpuExecutor,
    /// GPU profile of the sim executor (default: `distmind up`'s).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// DistMind's host cache holds half the set (warm) instead of all of it.
    #[arg(long)]
    pub half_cached: bool,
    /// GPUs of the one GPU server, each with parameter memory for half the
    /// set (sim executor only: the cuda executor runs on CUDA device 0).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub devices: u32,
    /// Keep sweeping a system past its first rate below the target.
    #[arg(long)]
    pub full_sweep: bool,
    /// After a system's sweep, bisect this many times between its capacity
    /// and the next rate swept (whole req/s), so that a capacity is not
    /// just a point of the grid: 100 and 200 bracket a capacity of 150
    /// within 12.5 req/s after 3 steps. Each step is one more point.
    #[arg(long, default_value_t = 0, value_name = "STEPS")]
    pub refine: u32,
    /// Append one row per (system, rate) to this CSV.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Where the model packages go, reused by every point (default: a
    /// temporary directory, removed).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Seed of the model weights and of the workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub emulate: crate::emulate::EmulateArgs,
}

/// The executors the bench runs: full-size models on one GPU.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuExecutor {
    Sim,
    Cuda,
}

impl GpuExecutor {
    fn kind(self) -> ExecutorKind {
        match self {
            GpuExecutor::Sim => ExecutorKind::Sim,
            GpuExecutor::Cuda => ExecutorKind::Cuda,
        }
    }
}

/// One point of a sweep.
#[derive(Debug, Clone)]
struct Point {
    system: &'static str,
    rate: f64,
    sent: u64,
    within: f64,
    rejected: f64,
    p99_ms: f64,
    mean_batch: f64,
    switches_per_s: f64,
    /// The host's busy share of its cores during the point's workload: near
    /// 1, requests also waited for a core (every process of the cluster and
    /// the load generator share them).
    host_cpu_busy: Option<f64>,
}

/// `97%`, or `?` when it could not be read.
fn busy_pct(b: Option<f64>) -> String {
    b.map_or("?".into(), |b| format!("{:.0}%", b * 1e2))
}

const CSV_HEADER: &str = "system,rate_rps,sent,within_slo,rejected_frac,p99_ms,mean_batch,\
switches_per_s,models,slo_ms,memory,link,host_cpu_busy,devices";

/// `distmind up` as a parser, so every point runs with the flags `up` takes.
#[derive(Parser)]
struct UpCli {
    #[command(flatten)]
    up: UpArgs,
}

/// The highest rate of a sweep before its first miss, in rate order
/// (`None`: even the lowest missed).
fn capacity(points: &[Point], target: f64) -> Option<f64> {
    points
        .iter()
        .take_while(|p| p.within >= target)
        .map(|p| p.rate)
        .last()
}

/// The rate that halves the gap between a sweep's capacity and its first
/// miss (points in rate order), in whole req/s; `None` when there is no
/// such gap or it is down to 1 req/s.
fn bisect(points: &[Point], target: f64) -> Option<f64> {
    let lo = capacity(points, target)?;
    let hi = points.iter().find(|p| p.rate > lo)?.rate;
    let mid = ((lo + hi) / 2.0).round();
    (mid > lo && mid < hi).then_some(mid)
}

pub fn run(a: &CapacityArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!a.rates.is_empty(), "--rates needs at least one rate");
    anyhow::ensure!(
        a.rates.iter().all(|r| r.is_finite() && *r > 0.0),
        "every rate of --rates must be a positive number, got {:?}",
        a.rates
    );
    anyhow::ensure!(
        a.target > 0.0 && a.target <= 1.0,
        "--target is a fraction in (0, 1], got {}",
        a.target
    );
    anyhow::ensure!(
        a.models >= 2,
        "--models must be at least 2, got {}",
        a.models
    );
    let executor = a.executor.kind();
    if executor == ExecutorKind::Cuda {
        anyhow::ensure!(
            cfg!(feature = "cuda"),
            "--executor cuda: {}",
            distmind_runtime::exec::cuda::NOT_COMPILED
        );
        anyhow::ensure!(
            a.profile.is_none(),
            "--profile gives the sim executor its GPU times; the cuda executor times real kernels"
        );
        anyhow::ensure!(
            a.devices == 1,
            "--devices {}: the bench runs the cuda executor on CUDA device 0 only",
            a.devices
        );
        // Every point's `up` would refuse an emulated link (the flag, else
        // transport.json's) with real kernels: refused here, before any
        // package is generated.
        let settings = crate::services::load_settings(&a.settings)?;
        anyhow::ensure!(
            a.emulate.emulate_link.is_none() && settings.transport.emulate.is_none(),
            "--executor cuda cannot run on an emulated link's dilated clock (real kernels would \
             look K times faster): drop --emulate-link, or the `emulate` section of {}",
            a.settings.join("transport.json").display()
        );
    }
    let mut rates = a.rates.clone();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    let work = match &a.work_dir {
        Some(d) => Tmp::Kept(d.clone()),
        None => Tmp::Removed(
            std::env::temp_dir().join(format!("distmind-capacity-{}", std::process::id())),
        ),
    };
    let n = a.models;
    let mib = RESNET152_STORED_MIB;
    let whole = format!("{}MiB", n * mib + 64);
    let half = format!("{}MiB", n * mib / 2 + 8);
    let memory = if a.half_cached { "half" } else { "equal" };
    let link = a
        .emulate
        .emulate_link
        .clone()
        .unwrap_or_else(|| "loopback".into());
    println!(
        "capacity bench: {} ResNet-152 variants, {} {} GPU(s) (memory for half each), 2 memory servers, Zipf {}, \
         batch 1, {} ms SLO, target {:.1}% within; DistMind's host cache: {}; link: {link}; {:.0} s per rate",
        n,
        a.devices,
        if executor == ExecutorKind::Cuda { "CUDA" } else { "sim" },
        a.zipf,
        a.slo_ms,
        a.target * 1e2,
        if a.half_cached { "half the set" } else { "the whole set" },
        a.duration.as_secs_f64()
    );
    let executor_name = executor.to_string();
    let mut all = Vec::new();
    let mut caps = Vec::new();
    for (system, cache) in [
        ("mps", &whole),
        ("distmind", if a.half_cached { &half } else { &whole }),
    ] {
        let run_point = |rate: f64| -> anyhow::Result<Point> {
            let mut argv: Vec<String> = [
                "up",
                "--executor",
                &executor_name,
                "--family",
                "resnet152",
                "--mode",
                "poisson",
                "--batch",
                "1",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let dur_ms = a.duration.as_millis();
            argv.extend([
                "--settings".into(),
                a.settings.display().to_string(),
                "--models".into(),
                n.to_string(),
                "--rate".into(),
                rate.to_string(),
                "--duration".into(),
                format!("{dur_ms}ms"),
                "--zipf".into(),
                a.zipf.to_string(),
                "--slo-ms".into(),
                a.slo_ms.to_string(),
                "--seed".into(),
                a.seed.to_string(),
                "--capacity".into(),
                format!("{}MiB", n * mib * 11 / 20 + 64),
                "--device-memory".into(),
                format!("{}MiB", n * mib / 2),
                "--devices".into(),
                a.devices.to_string(),
                "--cache".into(),
                cache.clone(),
                "--work-dir".into(),
                work.path().display().to_string(),
                "--system".into(),
                system.into(),
            ]);
            if system == "distmind" {
                argv.extend(["--policy".into(), "slo".into(), "--warm-cache".into()]);
            }
            if let Some(p) = &a.profile {
                argv.extend(["--profile".into(), p.display().to_string()]);
            }
            if let Some(l) = &a.emulate.emulate_link {
                argv.extend(["--emulate-link".into(), l.clone()]);
            }
            if let Some(l) = &a.emulate.emulate_loopback {
                argv.extend(["--emulate-loopback".into(), l.clone()]);
            }
            let up_args = UpCli::try_parse_from(&argv)
                .map_err(|e| anyhow::anyhow!("the up flags of a point: {e}"))?
                .up;
            println!("\n== {system} at {rate} req/s ==");
            let o = up::run_one(&up_args, executor, "asked for by the capacity bench")?;
            let r = &o.report;
            let sent = r.sent.max(1) as f64;
            let within = r
                .slo
                .as_ref()
                .map_or(0.0, |s| s.ok_within_slo as f64 / sent);
            let m = &o.controller_metrics;
            let get = |name: &str| sample_value(m, name, &[]).unwrap_or(0.0);
            let batches = get("distmind_controller_batches");
            let p = Point {
                system,
                rate,
                sent: r.sent,
                within,
                rejected: r.rejected as f64 / sent,
                p99_ms: r.latency.p99_ms,
                mean_batch: if batches > 0.0 {
                    get("distmind_controller_batched_requests") / batches
                } else {
                    0.0
                },
                switches_per_s: get("distmind_controller_model_switches") / r.elapsed_s.max(1e-9),
                host_cpu_busy: o.host_cpu_busy,
            };
            println!(
                "capacity point: {system} {rate} req/s: {:.2}% within the SLO, {:.2}% rejected, p99 {:.1} ms, \
                 mean batch {:.2}, {:.1} model switches/s, host CPU {} busy",
                p.within * 1e2,
                p.rejected * 1e2,
                p.p99_ms,
                p.mean_batch,
                p.switches_per_s,
                busy_pct(p.host_cpu_busy)
            );
            Ok(p)
        };
        let mut points = Vec::new();
        for &rate in &rates {
            let p = run_point(rate)?;
            let below = p.within < a.target;
            points.push(p);
            if below && !a.full_sweep {
                break;
            }
        }
        for _ in 0..a.refine {
            let Some(rate) = bisect(&points, a.target) else {
                break;
            };
            points.push(run_point(rate)?);
            points.sort_by(|x, y| x.rate.total_cmp(&y.rate));
        }
        caps.push(capacity(&points, a.target));
        all.extend(points);
    }
    println!(
        "\n{:<9} {:>9} {:>8} {:>10} {:>9} {:>8} {:>10} {:>11} {:>9}",
        "system",
        "rate",
        "sent",
        "within",
        "rejected",
        "p99 ms",
        "mean batch",
        "switches/s",
        "host CPU"
    );
    for p in &all {
        println!(
            "{:<9} {:>9.0} {:>8} {:>9.2}% {:>8.2}% {:>8.1} {:>10.2} {:>11.1} {:>9}",
            p.system,
            p.rate,
            p.sent,
            p.within * 1e2,
            p.rejected * 1e2,
            p.p99_ms,
            p.mean_batch,
            p.switches_per_s,
            busy_pct(p.host_cpu_busy)
        );
    }
    let show = |c: Option<f64>| c.map_or_else(|| format!("below {}", rates[0]), |r| format!("{r}"));
    println!(
        "capacity at SLO (req/s, >= {:.1}% within {} ms): mps {}, distmind (slo) {}",
        a.target * 1e2,
        a.slo_ms,
        show(caps[0]),
        show(caps[1])
    );
    // Rejections where mps still keeps the target: slo should serve those.
    let mps_ok: Vec<f64> = all
        .iter()
        .filter(|p| p.system == "mps" && p.within >= a.target)
        .map(|p| p.rate)
        .collect();
    let worst_reject = all
        .iter()
        .filter(|p| p.system == "distmind" && mps_ok.contains(&p.rate))
        .map(|p| p.rejected)
        .fold(0.0, f64::max);
    println!(
        "slo rejects at most {:.2}% at the rates where mps keeps the target (goal: under 1%)",
        worst_reject * 1e2
    );
    match caps.as_slice() {
        [Some(m), Some(d)] => println!("capacity ratio {:.2}", d / m),
        [None, Some(_)] => println!(
            "capacity ratio undefined: mps missed the target at the lowest rate, {}",
            rates[0]
        ),
        [_, None] => println!("capacity ratio 0: distmind missed the target at the lowest rate"),
        _ => unreachable!("two systems"),
    }
    if caps[1] == rates.last().copied() {
        println!(
            "(distmind kept the target at the highest rate swept: its capacity is at least that)"
        );
    }
    if let Some(path) = &a.csv {
        let mut lines = String::new();
        for p in &all {
            lines.push_str(&format!(
                "{},{},{},{:.4},{:.4},{:.2},{:.3},{:.2},{},{},{},{},{},{}\n",
                p.system,
                p.rate,
                p.sent,
                p.within,
                p.rejected,
                p.p99_ms,
                p.mean_batch,
                p.switches_per_s,
                n,
                a.slo_ms,
                memory,
                link,
                p.host_cpu_busy.map_or(String::new(), |b| format!("{b:.3}")),
                a.devices,
            ));
        }
        super::append_csv(path, CSV_HEADER, &lines)?;
        println!(
            "capacity: {} rows appended to {}",
            all.len(),
            path.display()
        );
    }
    std::io::stdout().flush().ok();
    Ok(())
}

/// The packages' directory: a temporary one is removed at the end.
enum Tmp {
    Kept(PathBuf),
    Removed(PathBuf),
}

impl Tmp {
    fn path(&self) -> &PathBuf {
        match self {
            Tmp::Kept(p) | Tmp::Removed(p) => p,
        }
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        if let Tmp::Removed(p) = self {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(system: &'static str, rate: f64, within: f64) -> Point {
        Point {
            system,
            rate,
            sent: 100,
            within,
            rejected: 0.0,
            p99_ms: 1.0,
            mean_batch: 1.0,
            switches_per_s: 0.0,
            host_cpu_busy: None,
        }
    }

    #[test]
    fn refining_halves_the_gap_between_the_capacity_and_the_first_miss() {
        let mut pts = vec![p("mps", 100.0, 1.0), p("mps", 200.0, 0.5)];
        assert_eq!(bisect(&pts, 0.99), Some(150.0));
        pts.insert(1, p("mps", 150.0, 0.995));
        assert_eq!(bisect(&pts, 0.99), Some(175.0));
        pts.insert(2, p("mps", 175.0, 0.98));
        assert_eq!(bisect(&pts, 0.99), Some(163.0), "whole req/s");
        assert_eq!(capacity(&pts, 0.99), Some(150.0));
        // Down to 1 req/s, no miss above the capacity, or no capacity: done.
        assert_eq!(
            bisect(&[p("mps", 150.0, 1.0), p("mps", 151.0, 0.9)], 0.99),
            None
        );
        assert_eq!(bisect(&[p("mps", 150.0, 1.0)], 0.99), None);
        assert_eq!(bisect(&[p("mps", 150.0, 0.5)], 0.99), None);
    }

    #[test]
    fn capacity_is_the_last_rate_before_the_first_miss() {
        let pts = [
            p("mps", 100.0, 1.0),
            p("mps", 200.0, 0.995),
            p("mps", 300.0, 0.9),
            p("mps", 400.0, 1.0),
        ];
        assert_eq!(capacity(&pts, 0.99), Some(200.0));
        assert_eq!(capacity(&pts[2..], 0.99), None);
    }

    #[test]
    fn every_point_parses_as_up_flags() {
        let argv = [
            "up",
            "--executor",
            "sim",
            "--system",
            "mps",
            "--models",
            "8",
            "--rate",
            "150",
            "--duration",
            "1500ms",
            "--cache",
            "1920MiB",
            "--device-memory",
            "928MiB",
            "--capacity",
            "1084MiB",
            "--devices",
            "4",
        ];
        let a = UpCli::try_parse_from(argv).unwrap().up;
        assert_eq!(a.devices, 4);
        assert_eq!(a.rate, 150.0);
        assert_eq!(a.duration, Some(Duration::from_millis(1500)));
        assert_eq!(a.models, Some(8));
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        capacity: CapacityArgs,
    }

    #[test]
    fn cuda_is_refused_with_the_reason_before_any_point_runs() {
        let run_with = |extra: &[&str]| {
            let mut argv = vec!["capacity", "--executor", "cuda", "--rates", "100"];
            argv.extend_from_slice(extra);
            run(&Cli::try_parse_from(argv).unwrap().capacity)
                .unwrap_err()
                .to_string()
        };
        if cfg!(feature = "cuda") {
            let e = run_with(&["--profile", "settings/profiles/h200-estimated.json"]);
            assert!(e.contains("--profile"), "{e}");
        } else {
            let e = run_with(&[]);
            assert!(e.contains("--executor cuda"), "{e}");
        }
        assert!(Cli::try_parse_from(["capacity", "--executor", "cpu"]).is_err());
        assert!(Cli::try_parse_from(["capacity", "--devices", "0"]).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn an_emulated_link_is_refused_for_cuda_before_any_point_runs() {
        for link in [
            &["--emulate-link", "100gbit"][..],
            &["--emulate-link", "100gbit", "--emulate-loopback", "1GB/s"],
        ] {
            let mut argv = vec!["capacity", "--executor", "cuda", "--rates", "100"];
            argv.extend_from_slice(link);
            let e = run(&Cli::try_parse_from(argv).unwrap().capacity)
                .unwrap_err()
                .to_string();
            assert!(e.contains("dilated clock"), "{e}");
        }
    }
}
