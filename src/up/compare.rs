//! `distmind up` without `--system` on a machine without a GPU: the
//! side-by-side that shows what DistMind is for.
//!
//! Two clusters of real processes, one after the other, on the same models
//! and workload: DistMind pulling from the memory servers with half the
//! model set in its GPU server's host cache, then the mps baseline holding
//! the whole set in host memory. Both on the same simulated GPU (the `sim`
//! executor: full-size models, GPU time from an estimated profile) behind
//! an emulated link (time dilation, see `distmind_common::emulate`). The
//! paper's balance by default: a V100 with PCIe 3 and a 100 Gbit/s link.

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::Context;
use distmind_models::{Family, Scale};
use distmind_runtime::exec::ExecutorKind;

use super::{generate, run_one, Models, Outcome, System, UpArgs, WorkDir};
use crate::services;

/// The models of the side-by-side, by default.
pub const MODELS_DEFAULT: usize = 8;
/// Emulated seconds of each workload, by default.
pub const DURATION_DEFAULT: Duration = Duration::from_secs(3);
/// Each workload's wall-clock budget when no `--duration` is given: the
/// emulated duration is this / K, within [`DURATION_MIN`, `DURATION_DEFAULT`],
/// so the first command a newcomer runs ends within minutes at any K.
pub const WALL_BUDGET: Duration = Duration::from_secs(40);
/// The shortest emulated workload `up` picks by itself.
pub const DURATION_MIN: Duration = Duration::from_millis(500);
/// Closed-loop clients, by default.
pub const CLIENTS_DEFAULT: usize = 4;
/// The latency objective, by default (ms, emulated).
pub const SLO_MS_DEFAULT: u64 = 100;
/// Zipf exponent of the model popularity, by default (the paper's).
pub const ZIPF_DEFAULT: f64 = 0.9;
/// The emulated link, by default (the paper's testbed).
pub const LINK_DEFAULT: &str = "100gbit";
/// The GPU profile, by default: the paper's V100 (PCIe 3), relative to
/// the settings directory.
pub const PROFILE_DEFAULT: &str = "profiles/v100-estimated.json";
const MIB: u64 = 1 << 20;

pub fn run(args: &UpArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let n = args.models.unwrap_or(MODELS_DEFAULT);
    anyhow::ensure!(
        n >= 2,
        "the side-by-side needs at least 2 models (half of them cached), got --models {n}"
    );
    let family = args.family.unwrap_or(Family::Resnet152);
    let settings = services::load_settings(&args.settings)?;
    let work = WorkDir::from_arg(args.work_dir.as_ref());
    // Generated once here; both runs find and reuse them.
    let model_dir = work.path.join("models");
    std::fs::create_dir_all(&model_dir)
        .with_context(|| format!("cannot create {}", model_dir.display()))?;
    let t = Instant::now();
    let dirs = generate(
        &model_dir,
        &Models {
            scale: args.scale.unwrap_or(Scale::Full),
            n,
            seed: args.seed,
            group_bytes: args.group_bytes.unwrap_or(settings.controller.group_bytes),
            family: Some(family),
        },
        &AtomicBool::new(false),
    )?;
    let block = distmind_runtime::cache::BLOCK_BYTES_DEFAULT;
    let per_model = dirs
        .iter()
        .map(|d| {
            distmind_models::Package::open(d)
                .map(|p| p.manifest.stored_bytes.div_ceil(block) * block)
                .with_context(|| format!("cannot open {}", d.display()))
        })
        .collect::<anyhow::Result<Vec<u64>>>()?
        .into_iter()
        .max()
        .unwrap_or(block);
    println!(
        "up: {n} {family} packages ready in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let half = (n / 2) as u64;

    let mut base = args.clone();
    base.work_dir = Some(work.path.clone());
    base.family = Some(family);
    base.models = Some(n);
    base.duration = args.duration;
    base.mode = crate::loadgen::Mode::Closed;
    if base.concurrency == 1 {
        base.concurrency = CLIENTS_DEFAULT;
    }
    base.zipf = Some(args.zipf.unwrap_or(ZIPF_DEFAULT));
    base.slo_ms = Some(args.slo_ms.unwrap_or(SLO_MS_DEFAULT));
    base.device_memory = Some(args.device_memory.unwrap_or(half * per_model));
    if base.emulate.emulate_link.is_none() && settings.transport.emulate.is_none() {
        base.emulate.emulate_link = Some(LINK_DEFAULT.to_string());
    }
    if base.profile.is_none() {
        base.profile = Some(args.settings.join(PROFILE_DEFAULT));
    }
    // Both clusters get the same bucket rate: measure (at most) once.
    let emulated = base
        .emulate
        .resolve_measuring(Some(&settings), args.memservers + 1)?;
    if let Some(e) = &emulated {
        base.emulate = crate::emulate::EmulateArgs {
            emulate_link: Some(format!("{}MB/s", e.link_bytes_per_s() / 1e6)),
            emulate_loopback: Some(format!("{}MB/s", e.loopback_bytes_per_s() / 1e6)),
        };
    }
    if args.duration.is_none() {
        let k = distmind_common::emulate::dilation(emulated.as_ref());
        let d = workload_duration(k);
        if d < DURATION_DEFAULT {
            println!(
                "up: each workload runs {:.2} s of emulated time ({:.0} s on this clock at K {k:.2}); \
                 --duration sets it",
                d.as_secs_f64(),
                d.as_secs_f64() * k
            );
        }
        base.duration = Some(d);
    }

    let mut distmind = base.clone();
    distmind.system = Some(System::Distmind);
    distmind.cache = Some(args.cache.unwrap_or(half * per_model + 8 * MIB));
    distmind.warm_cache = true;
    distmind.label = Some(args.label.clone().unwrap_or_else(|| "distmind".into()));
    let mut mps = base.clone();
    mps.system = Some(System::Mps);
    mps.cache = None;
    mps.label = None;

    let why = "the side-by-side runs the sim executor";
    println!("\nup: == 1 of 2: DistMind, {half} of the {n} models in its host cache, the rest pulled from the memory servers ==");
    let d = run_one(&distmind, ExecutorKind::Sim, why)?;
    println!("\nup: == 2 of 2: mps, all {n} models in the GPU server's host memory ==");
    let m = run_one(&mps, ExecutorKind::Sim, why)?;
    drop(work);
    print!("{}", side_by_side(&base, n, half, family, &d, &m));
    println!(
        "up: done in {:.0} s (both clusters stopped). Real math instead: distmind up --executor cpu",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The emulated duration of each workload at dilation `k` (see
/// [`WALL_BUDGET`]).
fn workload_duration(k: f64) -> Duration {
    WALL_BUDGET
        .div_f64(k.max(1.0))
        .clamp(DURATION_MIN, DURATION_DEFAULT)
}

fn side_by_side(
    base: &UpArgs,
    n: usize,
    half: u64,
    family: Family,
    d: &Outcome,
    m: &Outcome,
) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let link = d
        .emulated
        .map_or("loopback TCP (not emulated)".to_string(), |e| e.label());
    let _ = writeln!(
        s,
        "\n== DistMind vs MPS: {n} {family} ({} size) on one simulated GPU with parameter memory for {half}, 2 memory servers ==",
        base.scale.unwrap_or(Scale::Full)
    );
    let _ = writeln!(
        s,
        "   GPU time: {} (simulated, not measured); network: {link}",
        d.profile_label
    );
    let _ = writeln!(
        s,
        "   workload: closed loop, {} clients, zipf {}, batch {}, SLO {} ms, {:.2} s; times in emulated time",
        base.concurrency,
        base.zipf.unwrap_or(ZIPF_DEFAULT),
        base.batch,
        base.slo_ms.unwrap_or(SLO_MS_DEFAULT),
        base.duration.unwrap_or(DURATION_DEFAULT).as_secs_f64()
    );
    let attain = |o: &Outcome| {
        o.report
            .slo
            .as_ref()
            .map_or("-".to_string(), |x| format!("{:.1}%", 100.0 * x.attainment))
    };
    let rss = |o: &Outcome| {
        o.runtime_rss_bytes
            .map_or("-".to_string(), |b| format!("{}", b / MIB))
    };
    let row = |s: &mut String, what: &str, a: String, b: String| {
        let _ = writeln!(s, "  {what:<34}{a:>22}{b:>22}");
    };
    row(&mut s, "", "distmind".into(), "mps".into());
    row(
        &mut s,
        "models in GPU-server host memory",
        format!("{half} of {n} (cache)"),
        format!("{n} of {n}"),
    );
    row(
        &mut s,
        "throughput (req/s)",
        format!("{:.1}", d.report.throughput_rps),
        format!("{:.1}", m.report.throughput_rps),
    );
    row(
        &mut s,
        "p99 latency (ms)",
        format!("{:.1}", d.report.latency.p99_ms),
        format!("{:.1}", m.report.latency.p99_ms),
    );
    row(&mut s, "SLO attainment", attain(d), attain(m));
    row(
        &mut s,
        "host cache (MiB)",
        format!("{}", d.cache_bytes / MIB),
        format!("{}", m.cache_bytes / MIB),
    );
    row(&mut s, "GPU-server memory (RSS, MiB)", rss(d), rss(m));
    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            format!("{:.2}x", a / b)
        } else {
            "-".into()
        }
    };
    let mem_ratio = match (d.runtime_rss_bytes, m.runtime_rss_bytes) {
        (Some(a), Some(b)) => ratio(a as f64, b as f64),
        _ => "-".into(),
    };
    let _ = writeln!(
        s,
        "  distmind / mps: throughput {}, p99 {}, GPU-server memory {}",
        ratio(d.report.throughput_rps, m.report.throughput_rps),
        ratio(d.report.latency.p99_ms, m.report.latency.p99_ms),
        mem_ratio
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workload_fits_the_wall_budget_within_bounds() {
        assert_eq!(workload_duration(1.0), DURATION_DEFAULT);
        assert_eq!(workload_duration(20.0), Duration::from_secs(2));
        assert_eq!(workload_duration(1000.0), DURATION_MIN);
    }
}
