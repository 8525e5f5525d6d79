//! `distmind profile`: measure a GPU profile on real hardware, or compare two.
//!
//! `measure` generates each family's package (seeded weights; times do not
//! depend on the values), uploads it once, and times every layer over
//! warm runs with [`distmind_runtime::profile::measure`]: on the `cuda`
//! executor with CUDA events after every layer (device times), on `cpu`
//! with the host clock (it computes synchronously). It measures the pinned
//! host-to-device rate in the same run and writes a profile with
//! `"source": "measured"`, the GPU, its driver and the date, whose `method`
//! says all of that. `compare` prints two profiles' totals side by side with
//! their ratio (e.g. a measured profile against the estimate it replaces).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use distmind_models::{generate, Family, GenOptions, Package, Scale};
use distmind_runtime::exec::cuda::{CudaExecutor, CudaOptions};
use distmind_runtime::exec::{Executor, ExecutorKind};
use distmind_runtime::profile::measure::{
    model_profile, observed_peaks, time_layers, LayerTimes, MeasureOptions,
};
use distmind_runtime::profile::{model_key, parse_model_key, ModelProfile, Peaks, Profile, Source};

use crate::bench::machine_line;

#[derive(Subcommand, Debug)]
pub enum ProfileCommand {
    /// Time every layer of the five families on this machine's GPU (or CPU) and write a
    /// measured profile for the sim executor and the schedulers.
    Measure(MeasureArgs),
    /// Print two profiles' per-model totals and their ratio (B / A).
    Compare(CompareArgs),
}

#[derive(Args, Debug)]
#[command(after_help = "\
Each layer's time is the median over --runs warm runs of the time from the end of the layer
before it to its own end: on cuda, CUDA events recorded on the compute stream after every
layer (kernels plus any wait for the host to enqueue them, as in serving); on cpu, the host
clock. A plain run's wall time (no events; input and output copies included) is printed next
to the layers' sum. Peaks are what the measured layers reached; h2d_bytes_per_s is measured
from pinned memory (cuda) or through the executor's upload (cpu).

Example (on a GPU machine, with a build that has --features cuda):
  distmind profile measure --out settings/profiles/h100-measured-2026-11-26.json \\
      --batch 1,2,4,8,16")]
pub struct MeasureArgs {
    /// cuda (a GPU, CUDA events) or cpu (candle, the host clock).
    #[arg(long, default_value = "cuda")]
    pub executor: ExecutorKind,
    /// The CUDA device to measure.
    #[arg(long, default_value_t = 0)]
    pub device: u32,
    /// Families to measure, comma separated (default: all five).
    #[arg(long, value_delimiter = ',')]
    pub family: Vec<Family>,
    /// Batch sizes of the full-scale models, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8])]
    pub batch: Vec<usize>,
    /// Skip the tiny-scale models at batch 1 (measured by default: tests and `up --scale tiny`
    /// read them, and their layers give the launch overhead).
    #[arg(long)]
    pub no_tiny: bool,
    /// Skip the full-scale models (with the tiny ones only, a quick check of the method).
    #[arg(long)]
    pub no_full: bool,
    /// Untimed runs before the timed ones.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed runs per model and batch (medians are kept).
    #[arg(long, default_value_t = 20)]
    pub runs: usize,
    /// Bytes per copy of the host-to-device probe (MiB).
    #[arg(long, default_value_t = 256)]
    pub h2d_mib: usize,
    /// The driver version to record (default: read from /proc/driver/nvidia/version).
    #[arg(long)]
    pub driver: Option<String>,
    /// The date to record (default: today, UTC).
    #[arg(long)]
    pub date: Option<String>,
    /// cuda: run a batch's convolutions as one GEMM per image (cuBLAS's
    /// strided batch), the way before one GEMM over the images side by side;
    /// to compare the two.
    #[arg(long)]
    pub per_image_conv: bool,
    /// Where to write the profile (JSON).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// The reference profile (A).
    pub a: PathBuf,
    /// The profile compared with it (B).
    pub b: PathBuf,
}

pub fn run(cmd: &ProfileCommand) -> anyhow::Result<()> {
    match cmd {
        ProfileCommand::Measure(a) => measure(a),
        ProfileCommand::Compare(a) => compare(a),
    }
}

/// The executor that is timed, the plain one whose whole runs are timed,
/// the hardware's name and the host-to-device rate in bytes/s.
struct Devices {
    timed: Box<dyn Executor>,
    plain: Option<Box<dyn Executor>>,
    name: String,
    h2d_bytes_per_s: f64,
    h2d_note: String,
}

fn open_devices(args: &MeasureArgs) -> anyhow::Result<Devices> {
    let mib = args.h2d_mib.max(1);
    match args.executor {
        ExecutorKind::Cuda => {
            let device = args.device as usize;
            let conv = CudaOptions {
                per_image_conv: args.per_image_conv,
                ..CudaOptions::default()
            };
            let timed = CudaExecutor::with_options(
                device,
                CudaOptions {
                    layer_events: true,
                    ..conv
                },
            )?;
            let plain = CudaExecutor::with_options(device, conv)?;
            let name = timed.device_name();
            let bw = distmind_runtime::exec::cuda::h2d_bench(mib << 20, 10)?;
            Ok(Devices {
                timed: Box::new(timed),
                plain: Some(Box::new(plain)),
                name,
                h2d_bytes_per_s: bw.pinned_gbps * 1e9,
                h2d_note: format!(
                    "h2d_bytes_per_s: 10 cuMemcpyHtoDAsync of {mib} MiB from pinned memory \
                     (cuMemHostAlloc) on device 0, after one warm-up ({:.1} GB/s; pageable \
                     cuMemcpyHtoD measured {:.1} GB/s in the same run).",
                    bw.pinned_gbps, bw.plain_memcpy_gbps
                ),
            })
        }
        ExecutorKind::Cpu => {
            let exec = distmind_runtime::exec::cpu::CpuExecutor::new();
            let rate = upload_rate(&exec, mib << 20)?;
            Ok(Devices {
                name: format!("CPU: {}", machine_line()),
                timed: Box::new(exec),
                plain: None,
                h2d_bytes_per_s: rate,
                h2d_note: format!(
                    "h2d_bytes_per_s: 5 uploads of {mib} MiB into the cpu executor's arena ({:.1} GB/s).",
                    rate / 1e9
                ),
            })
        }
        ExecutorKind::Sim => {
            bail!("--executor sim replays a profile; measure on cuda (a GPU) or cpu")
        }
    }
}

/// Bytes per second through the executor's arena upload, from a `Vec`.
fn upload_rate(exec: &dyn Executor, bytes: usize) -> anyhow::Result<f64> {
    let arena = exec.alloc_arena(bytes as u64)?;
    let src = vec![0u8; bytes];
    arena.upload(0, 0, &src)?;
    let start = Instant::now();
    for _ in 0..5 {
        arena.upload(0, 0, &src)?;
    }
    Ok(5.0 * bytes as f64 / start.elapsed().as_secs_f64())
}

/// The NVIDIA kernel module's version, from /proc (None off NVIDIA machines).
fn nvidia_driver_version() -> Option<String> {
    driver_from_proc(&std::fs::read_to_string("/proc/driver/nvidia/version").ok()?)
}

/// The version in the first line of /proc/driver/nvidia/version: the first
/// word after "Kernel Module" made of digits and dots ("NVRM version: NVIDIA
/// UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...").
fn driver_from_proc(text: &str) -> Option<String> {
    let after = text.lines().next()?.split("Kernel Module").nth(1)?;
    after
        .split_whitespace()
        .find(|w| {
            w.contains('.')
                && w.chars().next().is_some_and(|c| c.is_ascii_digit())
                && w.chars().all(|c| c.is_ascii_digit() || c == '.')
        })
        .map(str::to_string)
}

/// Today's date (UTC) as YYYY-MM-DD.
fn today_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    civil_date((secs / 86_400) as i64)
}

/// Days since 1970-01-01 as a proleptic Gregorian date (H. Hinnant's
/// `civil_from_days`).
fn civil_date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// The package's input at `batch`, seeded: images U(-1, 1), token ids
/// uniform over the vocabulary of the input embedding (any size: nothing
/// crosses a socket here).
fn measure_input(
    m: &distmind_models::Manifest,
    batch: usize,
    seed: u64,
) -> anyhow::Result<distmind_runtime::exec::HostTensor> {
    use distmind_runtime::exec::{HostTensor, TensorData};
    // The load generator's values at batch 1, repeated: same spread of
    // values and ids, no frame bound.
    let one = crate::loadgen::input_for(m, 1, seed)?;
    let mut shape = one.shape.clone();
    shape[0] = batch;
    Ok(match one.data {
        TensorData::F32(v) => HostTensor::f32(shape, v.repeat(batch)),
        TensorData::I64(v) => HostTensor::i64(shape, v.repeat(batch)),
    })
}

/// A directory for the generated packages, removed on drop (every exit path).
struct PackageDir(PathBuf);

impl PackageDir {
    fn create() -> anyhow::Result<PackageDir> {
        let dir = std::env::temp_dir().join(format!("distmind-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(PackageDir(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for PackageDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One family's package at `scale`, generated under `dir`.
fn package(dir: &Path, family: Family, scale: Scale) -> anyhow::Result<Package> {
    let opts = GenOptions {
        scale,
        seed: 5,
        ..GenOptions::new(family, dir)
    };
    let mut dirs = generate(&opts).with_context(|| format!("generating {family} ({scale})"))?;
    Ok(Package::open(dirs.remove(0))?)
}

fn measure(args: &MeasureArgs) -> anyhow::Result<()> {
    if args.batch.is_empty() || args.batch.contains(&0) {
        bail!(
            "--batch needs batch sizes of at least 1, got {:?}",
            args.batch
        );
    }
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if args.no_full && args.no_tiny {
        bail!("--no-full and --no-tiny leave nothing to measure");
    }
    if args.per_image_conv && args.executor != ExecutorKind::Cuda {
        bail!(
            "--per-image-conv chooses how the cuda executor runs convolutions; --executor {} has no such choice",
            args.executor
        );
    }
    let families: Vec<Family> = if args.family.is_empty() {
        Family::ALL.to_vec()
    } else {
        args.family.clone()
    };
    let devices = open_devices(args)?;
    let opts = MeasureOptions {
        warmup: args.warmup,
        runs: args.runs,
    };
    println!("profile measure: {}", machine_line());
    println!(
        "device: {} ({}); {} warm-up + {} timed runs, medians",
        devices.name,
        devices.timed.describe(),
        opts.warmup,
        opts.runs
    );
    println!("{}", devices.h2d_note);
    println!(
        "{:<26} {:>7} {:>12} {:>12} {:>10}",
        "model", "layers", "layer sum ms", "plain run ms", "sum/run"
    );

    let dir = PackageDir::create()?;
    let mut models: Vec<(String, ModelProfile)> = Vec::new();
    let mut tiny_keys = Vec::new();
    let mut ratios: Vec<f64> = Vec::new();
    for &family in &families {
        let mut plan: Vec<(Scale, Vec<usize>)> = Vec::new();
        if !args.no_full {
            plan.push((Scale::Full, args.batch.clone()));
        }
        if !args.no_tiny {
            plan.push((Scale::Tiny, vec![1]));
        }
        for (scale, batches) in plan {
            let pkg = package(dir.path(), family, scale)?;
            let names: Vec<&str> = pkg
                .manifest
                .layers
                .iter()
                .map(|l| l.name.as_str())
                .collect();
            for &batch in &batches {
                let input = measure_input(&pkg.manifest, batch, 17)?;
                let inputs = std::slice::from_ref(&input);
                let times = time_layers(devices.timed.as_ref(), &pkg, inputs, opts)
                    .with_context(|| format!("timing {family} ({scale}) at batch {batch}"))?;
                let plain: LayerTimes = match &devices.plain {
                    Some(p) => time_layers(p.as_ref(), &pkg, inputs, opts)
                        .with_context(|| format!("running {family} ({scale}) at batch {batch}"))?,
                    None => times.clone(),
                };
                // Events cost host time per layer (launch-bound small
                // batches look slower) and leave out the input and output
                // copies: the layers keep their shares of a plain run.
                let ratio = times.layers_total_s() / plain.run_s;
                let scaled = LayerTimes {
                    layer_s: times.layer_s.iter().map(|t| t / ratio).collect(),
                    run_s: plain.run_s,
                };
                let m = model_profile(family, scale, batch, &names, &scaled)
                    .map_err(anyhow::Error::msg)?;
                let key = model_key(family, scale, batch);
                ratios.push(ratio);
                println!(
                    "{:<26} {:>7} {:>12.3} {:>12.3} {:>10.3}",
                    key,
                    m.layers.len(),
                    times.layers_total_s() * 1e3,
                    plain.run_s * 1e3,
                    ratio
                );
                if scale == Scale::Tiny {
                    tiny_keys.push(key.clone());
                }
                models.push((key, m));
            }
            // Each package is read once per batch; drop its files before the next.
            let _ = std::fs::remove_dir_all(&pkg.dir);
        }
    }

    let all: Vec<&ModelProfile> = models.iter().map(|(_, m)| m).collect();
    let fixed: Vec<&ModelProfile> = models
        .iter()
        .filter(|(k, _)| tiny_keys.contains(k))
        .map(|(_, m)| m)
        .collect();
    let peaks: Peaks = observed_peaks(&all, &fixed, devices.h2d_bytes_per_s)
        .context("no layer took any time: nothing to derive peaks from")?;
    let (lo, hi) = ratios
        .iter()
        .fold((f64::INFINITY, 0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
    let method = format!(
        "Measured with `distmind profile measure` on {device} ({exec}). Per model: the family's package \
         generated with seeded weights (times do not depend on the values), every group uploaded once, \
         {warmup} untimed warm-up runs, then {runs} timed runs at the batch of the key (inputs: seeded \
         U(-1,1) images or uniform token ids; transformers at the preset's length). {clock} \
         Each layer's median over the timed runs is its share; the layers' sum was {lo:.3}x to {hi:.3}x \
         the median wall time of a plain run (a second executor without events, input and output \
         copies included, the same runs) and time_s is each share of that plain run, so total_s is \
         the plain run's time (events add host time per layer, which shows at small batches where \
         the GPU waits for the host). flops and bytes are the estimator's counts from the \
         layer graph (not measured). Peaks are what the measured layers reached, from those counts: \
         matrix = the highest FLOP rate of a conv2d/linear/attention layer, vector = of any other layer, \
         memory = the highest byte rate of any layer (a layer served from cache can exceed the DRAM \
         rate), launch_overhead_s = the median layer time of the tiny-scale models at batch 1 (their \
         work is negligible) or, without them, the shortest layer. {h2d} Batches not listed are \
         interpolated by Profile::get (linear in the batch between measured points); transformer \
         lengths other than the preset's are scaled (ModelProfile::at_seq_len), not measured.",
        device = devices.name,
        exec = devices.timed.describe(),
        warmup = opts.warmup,
        runs = opts.runs,
        clock = match args.executor {
            ExecutorKind::Cuda => "Layer times are device times: a CUDA event is recorded on the compute \
                stream before the first layer and after every layer (no host synchronisation between \
                layers), so a layer's time runs from the previous layer's end to its own end: its \
                kernels and cuBLAS GEMMs (FP32, no TF32) plus any time the GPU waited for the host to \
                enqueue them (eager mode, as in serving). Convolutions at a batch over 1 run as one GEMM over \
                the batch's images side by side.",
            _ => "Layer times are host-clock times around each layer (the cpu executor computes \
                synchronously).",
        },
        h2d = devices.h2d_note,
    );
    let method = if args.per_image_conv && args.executor == ExecutorKind::Cuda {
        method.replace(
            "one GEMM over the batch's images side by side",
            "one GEMM per image (a strided batched GEMM, --per-image-conv)",
        )
    } else {
        method
    };
    let driver = args.driver.clone().or_else(|| match args.executor {
        ExecutorKind::Cuda => nvidia_driver_version(),
        _ => None,
    });
    let date = args.date.clone().unwrap_or_else(today_utc);
    let mut profile = Profile::new(
        devices.name.clone(),
        Source::Measured,
        date,
        driver,
        method,
        peaks,
    );
    profile.models = models.into_iter().collect();
    profile
        .validate()
        .map_err(|e| anyhow::anyhow!("the measured profile does not validate: {e}"))?;
    profile.write(&args.out)?;
    println!(
        "peaks observed: matrix {:.3e} FLOP/s, vector {:.3e} FLOP/s, memory {:.3e} B/s, \
         h2d {:.3e} B/s, launch overhead {:.1} us",
        peaks.matrix_flops_per_s,
        peaks.vector_flops_per_s,
        peaks.memory_bytes_per_s,
        peaks.h2d_bytes_per_s,
        peaks.launch_overhead_s * 1e6
    );
    println!(
        "wrote {} ({} models; {})",
        args.out.display(),
        profile.models.len(),
        profile.source_label()
    );
    Ok(())
}

fn compare(args: &CompareArgs) -> anyhow::Result<()> {
    let a = Profile::load(&args.a)?;
    let b = Profile::load(&args.b)?;
    println!("A: {} ({})", args.a.display(), a.source_label());
    println!("B: {} ({})", args.b.display(), b.source_label());
    println!(
        "{:<26} {:>12} {:>12} {:>8}",
        "model", "A total ms", "B total ms", "B/A"
    );
    let mut shown = 0;
    for (key, mb) in &b.models {
        let Some((family, scale, batch)) = parse_model_key(key) else {
            continue;
        };
        let Some(ma) = a.get(family, scale, batch) else {
            continue;
        };
        let exact = a.get_exact(family, scale, batch).is_some();
        println!(
            "{:<26} {:>12.3} {:>12.3} {:>8.2}{}",
            key,
            ma.total_s * 1e3,
            mb.total_s * 1e3,
            mb.total_s / ma.total_s,
            if exact { "" } else { "  (A interpolated)" }
        );
        shown += 1;
    }
    if shown == 0 {
        bail!("the two profiles share no family and scale");
    }
    println!(
        "h2d: A {:.1} GB/s, B {:.1} GB/s (B/A {:.2})",
        a.peaks.h2d_bytes_per_s / 1e9,
        b.peaks.h2d_bytes_per_s / 1e9,
        b.peaks.h2d_bytes_per_s / a.peaks.h2d_bytes_per_s
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_versions_from_proc() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \nGCC version: 13\n";
        assert_eq!(driver_from_proc(open).as_deref(), Some("580.159.04"));
        let closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n";
        assert_eq!(driver_from_proc(closed).as_deref(), Some("535.129.03"));
        assert_eq!(driver_from_proc("no driver here"), None);
    }

    #[test]
    fn per_image_conv_is_refused_off_the_cuda_executor() {
        let args = MeasureArgs {
            executor: ExecutorKind::Cpu,
            device: 0,
            family: vec![Family::Resnet152],
            batch: vec![1],
            no_tiny: false,
            no_full: true,
            warmup: 0,
            runs: 1,
            h2d_mib: 1,
            driver: None,
            date: None,
            per_image_conv: true,
            out: PathBuf::from("never-written.json"),
        };
        let e = measure(&args).unwrap_err().to_string();
        assert!(
            e.contains("--per-image-conv") && e.contains("--executor cpu"),
            "{e}"
        );
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(59), "1970-03-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
        assert_eq!(civil_date(20_783), "2026-11-26");
    }
}
