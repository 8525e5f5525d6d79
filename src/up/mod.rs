//! `distmind up` (alias `demo`): a whole cluster on this machine, as real
//! processes, and a one-minute mixed workload against it.
//!
//! 1. Generates model packages (`--models`, spread over the five families)
//!    into a work directory.
//! 2. Starts `distmind controller` (metadata port, dispatcher client port,
//!    metrics), two `distmind memserver`s and one `distmind runtime`, each on
//!    127.0.0.1 ephemeral ports, and waits for their readiness lines and
//!    their registration with the controller.
//! 3. Deploys every package (`crate::deploy`), sharded over the memory servers.
//! 4. Runs the load generator ([`crate::loadgen`]) in this process: Poisson
//!    arrivals at `--rate`, Zipf popularity over all models, through the
//!    dispatcher, for `--duration`; prints its report, then a few figures
//!    from each service's `/metrics`.
//! 5. Stops every process (SIGTERM, then SIGKILL after a grace period), on
//!    every exit path: the normal end, an error, a panic, Ctrl-C.
//!
//! With `--use-train` a background training job shares the GPUs (the
//! distmind policy's inference/training split, `training`); with
//! `--timeline` a thread samples the runtime's `/metrics` during step 4
//! ([`sampler`]) into the CSV of [`timeline`].
//!
//! Sizes, chosen to finish in about a minute and a half on 2 cores:
//! * `cpu` executor (the default without a GPU): 20 tiny models (about
//!   12 MB in all), real numbers.
//! * `sim` and `cuda`: full-scale models, 6 by default (two ResNet-152 and
//!   one of each other family, about 1.6 GB): generating one takes under a
//!   second, but each costs its size on disk, in the memory servers' DRAM
//!   and in the runtime's host cache, so 20 of them (about 5.5 GB, three
//!   times) is left to `--models 20` on a machine with the memory.

mod compare;
pub mod cpu;
mod metrics;
pub(crate) mod procs;
pub mod results;
pub mod sampler;
pub mod timeline;
mod training;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use distmind_common::handshake::ClusterKey;
use distmind_controller::ControllerClient;
use distmind_models::{Family, Scale};
use distmind_runtime::exec::ExecutorKind;

use crate::loadgen::{self, parse_duration};
use crate::services;

pub use metrics::{headline, parse_samples, Sample};
pub use procs::{parse_ready_line, STOP_GRACE};

/// Default models at tiny scale.
pub const MODELS_TINY_DEFAULT: usize = 20;
/// Default models at full scale (see the module doc).
pub const MODELS_FULL_DEFAULT: usize = 6;
/// Most models `up` generates.
pub const MODELS_MAX: usize = 1000;
/// Most memory servers `up` starts.
pub const MEMSERVERS_MAX: usize = 16;
/// Default open-loop rate: tiny models on the cpu executor take a few ms
/// each, so 20/s keeps 2 cores busy without queueing.
pub const RATE_DEFAULT: f64 = 20.0;
/// The runtime's host cache at most (the original's 4 GB).
pub const CACHE_BYTES_MAX_DEFAULT: u64 = 4 << 30;
const MIB: u64 = 1 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A baseline's setup loads whole models: allow for a slow one.
const PREFETCH_TIMEOUT: Duration = Duration::from_secs(120);

/// `--executor` of `up`: `auto` picks cuda when this build has it and a
/// device answers, else cpu.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExecutorChoice {
    Auto,
    Cpu,
    Sim,
    Cuda,
}

/// `distmind up` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct UpArgs {
    /// Settings directory (cluster.key, config.sh, controller.json; ports are ephemeral, not the files').
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// auto (cuda if built with it and a device is present, else sim: full-size models, GPU time
    /// from a profile), cpu (tiny models, real math), sim or cuda.
    #[arg(long, value_enum, default_value = "auto")]
    pub executor: ExecutorChoice,
    /// Model scale: tiny or full (default: tiny for cpu, full for sim and cuda).
    #[arg(long)]
    pub scale: Option<Scale>,
    /// Models to generate, spread over the five families (default: 20 tiny, 6 full).
    #[arg(long)]
    pub models: Option<usize>,
    /// How long the workload runs, e.g. 60s, 10s, 2m (emulated time under --emulate-link;
    /// default: 60 s, 3 s for the side-by-side).
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Requests per second of the Poisson workload.
    #[arg(long, default_value_t = RATE_DEFAULT)]
    pub rate: f64,
    /// Zipf exponent of model popularity (default: zipf_s of controller.json).
    #[arg(long)]
    pub zipf: Option<f64>,
    /// Latency SLO of every request in ms (default: the dispatcher's per-family slo_ms).
    #[arg(long)]
    pub slo_ms: Option<u64>,
    /// Controller policy (default: policy of controller.json).
    #[arg(long)]
    pub policy: Option<String>,
    /// Memory servers to start.
    #[arg(long, default_value_t = 2)]
    pub memservers: usize,
    /// Arena of each memory server (default: room for its share of the models, with slack).
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// The runtime's host cache (default: room for every model in whole cache blocks, at most 4 GiB).
    #[arg(long, value_parser = parse_size)]
    pub cache: Option<u64>,
    /// GPU profile for the sim executor (default: `<settings>/profiles/h200-estimated.json`).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Where the model packages go; kept afterwards (default: a temporary directory, removed).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Also write the load report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Seed of the model weights and of the workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Log level of the started processes (their stderr is shown prefixed with their name).
    #[arg(long, default_value = "warn")]
    pub child_log: String,
    /// How long each process may take to become ready.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub ready_timeout: Duration,
    /// The system under test: distmind (the controller's --policy), or a baseline of the
    /// evaluation: mps, ray, gpu (the one-model bound; implies --models 1). The same models and
    /// workload run against each.
    /// Default: without a GPU (the sim executor), the side-by-side of DistMind and mps; otherwise
    /// distmind.
    #[arg(long, value_enum)]
    pub system: Option<System>,
    /// Generate models of this family only (default: the five families in turn).
    #[arg(long)]
    pub family: Option<Family>,
    /// GPUs (devices) of the GPU server, one worker each.
    #[arg(long, default_value_t = 1)]
    pub devices: u32,
    /// Workload: poisson (open loop at --rate) or closed (--concurrency clients, one request
    /// outstanding each, as the original's client).
    #[arg(long, value_enum, default_value = "poisson")]
    pub mode: loadgen::Mode,
    /// Closed-loop clients.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Seconds between the distmind policy's reassignments (default: controller.json's
    /// rescheduling_period_s).
    #[arg(long)]
    pub period: Option<f64>,
    /// Append the results as one row to this CSV file (written with a header when new): the
    /// input of `distmind plot`.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// The row's `system` column (default: the system's name), e.g. distmind_cache.
    #[arg(long)]
    pub label: Option<String>,
    /// The row's `test` column (which experiment it belongs to).
    #[arg(long, default_value = "up")]
    pub test: String,
    /// Balancer of the distmind policy: lor or lfu (the controller's --balancer).
    #[arg(long)]
    pub balancer: Option<String>,
    /// Sharding of the deploy: hybrid, per-app, horizontal or vertical (default: controller.json's).
    #[arg(long)]
    pub strategy: Option<distmind_controller::placement::Strategy>,
    /// Parameter memory of each GPU (the runtime's --device-memory; default: its host cache size):
    /// a smaller simulated GPU holds fewer models resident.
    #[arg(long, value_parser = parse_size)]
    pub device_memory: Option<u64>,
    /// Before the workload, load every model into the GPU server's host cache (not timed), so
    /// DistMind starts from a warm cache; the mps and ray baselines always start so.
    #[arg(long)]
    pub warm_cache: bool,
    /// Before the workload, run one inference on every device of the GPU server, directly (not
    /// through the dispatcher, not timed): a device's first run pays one-time costs (on an H200
    /// the cuda executor's first ResNet-152 took 150 ms, about 5 ms after). Default: on for
    /// cuda, off for cpu and sim.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub warm_devices: Option<bool>,
    /// Largest parameter group of the generated models in bytes (default: controller.json's
    /// group_bytes; 1 = one group per layer).
    #[arg(long)]
    pub group_bytes: Option<u64>,
    /// Batch size of every request (the sim executor takes the profile's time for this batch).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Share the GPUs with a background training job (the controller's --use-train; distmind
    /// system, implied without --system): the distmind policy moves GPUs between inference and
    /// training each second following inference_workload_s (--inference-workload); the slo
    /// policy trains between requests, or, where an iteration is over half the SLO, on the GPUs
    /// that the demand leaves.
    #[arg(long)]
    pub use_train: bool,
    /// The training job (with --use-train): one of the run's models, or by default the
    /// `<family>_train` model up generates and deploys (resnet152_train unless --family names
    /// another CNN), at the run's scale.
    #[arg(long)]
    pub train_model: Option<String>,
    /// Images per training iteration (the runtime's --train-batch; default 96 with the sim
    /// executor, the original's one SGD step on 96 images, else the runtime's default).
    #[arg(long)]
    pub train_batch: Option<usize>,
    /// A distributed training job next to the workload (with --use-train): a spec as `train
    /// submit` takes it (e.g. settings/train_tiny.json), its `model` replaced by the run's
    /// training model. up submits it once the models are deployed; the controller places its
    /// stage workers on GPUs inference leaves idle. After the workload up prints its status and
    /// stops it if it still runs.
    #[arg(long, value_name = "FILE")]
    pub train_spec: Option<PathBuf>,
    /// GPUs doing inference in each second of the controller's clock, e.g. 2,1,0,1, each at most
    /// --devices (with --use-train; overrides controller.json's inference_workload_s; emulated
    /// seconds under --emulate-link).
    #[arg(long)]
    pub inference_workload: Option<services::InferenceWorkload>,
    /// Write utilization over time (figure 9) to this CSV: the runtime's /metrics scraped every
    /// --timeline-interval during the workload. Bounds from the sim executor's profile (forward
    /// time at --batch under the workload's Zipf popularity, training iteration at the train
    /// batch); with a real executor the bounds and utilization columns are 0.
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Seconds between timeline samples (emulated time under --emulate-link).
    #[arg(long, default_value_t = 0.5)]
    pub timeline_interval: f64,
    /// Emulated link for every process of the cluster (sim executor only); without
    /// --emulate-loopback the bucket rate is chosen from a measurement of this machine's loopback.
    #[command(flatten)]
    pub emulate: crate::emulate::EmulateArgs,
}

/// What `distmind up --system` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum System {
    /// DistMind: models pulled from the memory servers group by group, pipelined.
    Distmind,
    /// Baseline: NVIDIA MPS (whole model set in host memory, 12 resident per GPU, whole loads).
    Mps,
    /// Baseline: Ray Serve (whole model set in host memory, one resident per GPU).
    Ray,
    /// The GPU bound: one model, never switched.
    Gpu,
}

impl System {
    pub fn as_str(self) -> &'static str {
        match self {
            System::Distmind => "distmind",
            System::Mps => "mps",
            System::Ray => "ray",
            System::Gpu => "gpu",
        }
    }

    pub fn baseline(self) -> Option<services::Baseline> {
        match self {
            System::Distmind => None,
            System::Mps => Some(services::Baseline::Mps),
            System::Ray => Some(services::Baseline::Ray),
            System::Gpu => Some(services::Baseline::Gpu),
        }
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    distmind_memserver::parse_size(s).map_err(|e| e.to_string())
}

/// The executor `up` runs, and why. `probe_cuda` is asked only for `auto`
/// in a build with the `cuda` feature.
pub fn choose_executor(
    requested: ExecutorChoice,
    cuda_compiled: bool,
    probe_cuda: impl FnOnce() -> Result<(), String>,
) -> Result<(ExecutorKind, String), String> {
    match requested {
        ExecutorChoice::Cpu => Ok((ExecutorKind::Cpu, "asked for".into())),
        ExecutorChoice::Sim => Ok((
            ExecutorKind::Sim,
            "asked for: GPU times from a profile, zero outputs".into(),
        )),
        ExecutorChoice::Cuda if !cuda_compiled => Err(format!(
            "--executor cuda: {}",
            distmind_runtime::exec::cuda::NOT_COMPILED
        )),
        ExecutorChoice::Cuda => Ok((ExecutorKind::Cuda, "asked for".into())),
        ExecutorChoice::Auto if !cuda_compiled => Ok((
            ExecutorKind::Sim,
            "auto: this build has no cuda feature; full-size models, GPU time from a profile \
             (--executor cpu: tiny models, real numbers)"
                .into(),
        )),
        ExecutorChoice::Auto => match probe_cuda() {
            Ok(()) => Ok((ExecutorKind::Cuda, "auto: CUDA device 0 answered".into())),
            Err(why) => Ok((
                ExecutorKind::Sim,
                format!(
                    "auto: no usable CUDA device ({why}); full-size models, GPU time from a profile \
                     (--executor cpu: tiny models, real numbers)"
                ),
            )),
        },
    }
}

/// Default scale: tiny for cpu, full where compute is cheap (sim, cuda).
pub fn default_scale(executor: ExecutorKind) -> Scale {
    match executor {
        ExecutorKind::Cpu => Scale::Tiny,
        ExecutorKind::Sim | ExecutorKind::Cuda => Scale::Full,
    }
}

/// Model `i` of `n`: the families in turn, so every family is present.
/// Returns (family, variant index within it).
pub fn family_of(i: usize) -> (Family, usize) {
    (Family::ALL[i % Family::ALL.len()], i / Family::ALL.len())
}

/// Room for `share` bytes with 50% slack plus 64 MiB, in whole MiB.
pub fn with_slack(share: u64) -> u64 {
    (share + share / 2 + 64 * MIB).div_ceil(MIB) * MIB
}

fn size_arg(bytes: u64) -> String {
    format!("{}MiB", bytes.div_ceil(MIB))
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// Removes a temporary work directory on drop (a given one is kept).
struct WorkDir {
    path: PathBuf,
    remove: bool,
}

impl WorkDir {
    /// `--work-dir` (kept), else a fresh directory under the system's
    /// temporary one (removed when dropped).
    fn from_arg(work_dir: Option<&PathBuf>) -> WorkDir {
        match work_dir {
            Some(d) => WorkDir {
                path: d.clone(),
                remove: false,
            },
            None => WorkDir {
                path: std::env::temp_dir().join(format!("distmind-up-{}", std::process::id())),
                remove: true,
            },
        }
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Default duration of a single run's workload.
pub const DURATION_DEFAULT: Duration = Duration::from_secs(60);

/// Runs `distmind up`: see the module documentation. Without `--system` on
/// the sim executor (no GPU here), the side-by-side of `compare`.
pub fn run(args: &UpArgs) -> anyhow::Result<()> {
    let (executor, why) = choose_executor(args.executor, cfg!(feature = "cuda"), || {
        println!("up: probing CUDA device 0 ...");
        distmind_runtime::exec::cuda::CudaExecutor::new(0)
            .map(drop)
            .map_err(|e| e.to_string())
    })
    .map_err(anyhow::Error::msg)?;
    // Training and timelines are DistMind's: no side-by-side then.
    if args.system.is_none()
        && executor == ExecutorKind::Sim
        && !args.use_train
        && args.timeline.is_none()
    {
        return compare::run(args);
    }
    run_one(args, executor, &why).map(drop)
}

/// What one run measured, for the side-by-side.
pub struct Outcome {
    pub report: loadgen::Report,
    pub runtime_rss_bytes: Option<u64>,
    /// The GPU server's host cache.
    pub cache_bytes: u64,
    pub profile_label: String,
    pub emulated: Option<distmind_common::emulate::EmulatedLink>,
    /// The controller's `/metrics` text at the end of the workload (empty
    /// when it could not be read).
    pub controller_metrics: String,
    /// The host's busy share of its cores during the workload (every
    /// process of the cluster and the load generator share them).
    pub host_cpu_busy: Option<f64>,
}

/// One cluster, one system, one workload.
pub fn run_one(args: &UpArgs, executor: ExecutorKind, why: &str) -> anyhow::Result<Outcome> {
    let stop = loadgen::interrupt_flag();
    let started = Instant::now();
    let system = args.system.unwrap_or(System::Distmind);
    let duration = args.duration.unwrap_or(DURATION_DEFAULT);
    if !(1..=MEMSERVERS_MAX).contains(&args.memservers) {
        bail!(
            "--memservers must be 1..={MEMSERVERS_MAX}, got {}",
            args.memservers
        );
    }
    if !(args.rate.is_finite() && args.rate > 0.0 && args.rate <= loadgen::RATE_MAX) {
        bail!(
            "--rate must be more than 0 and at most {}",
            loadgen::RATE_MAX
        );
    }
    let settings = services::load_settings(&args.settings)?;
    let key = services::cluster_key(&settings);
    let exe = std::env::current_exe().context("cannot find this program's path")?;
    // Every memory server and the GPU server hold a bucket.
    let emulated = args
        .emulate
        .resolve_measuring(Some(&settings), args.memservers + 1)?;
    let emulate_flags: Vec<OsString> = emulated
        .as_ref()
        .map(|e| {
            crate::emulate::EmulateArgs::flags_for(e)
                .into_iter()
                .map(OsString::from)
                .collect()
        })
        .unwrap_or_default();

    let scale = args.scale.unwrap_or(default_scale(executor));
    let n_models = args.models.unwrap_or(match (system, scale) {
        (System::Gpu, _) => 1,
        (_, Scale::Tiny) => MODELS_TINY_DEFAULT,
        (_, Scale::Full) => MODELS_FULL_DEFAULT,
    });
    if !(1..=MODELS_MAX).contains(&n_models) {
        bail!("--models must be 1..={MODELS_MAX}, got {n_models}");
    }
    if system == System::Gpu && n_models != 1 {
        bail!("--system gpu is the one-model bound: --models must be 1, got {n_models}");
    }
    if !(1..=distmind_runtime::server::DEVICES_MAX as u32).contains(&args.devices) {
        bail!(
            "--devices must be 1..={}, got {}",
            distmind_runtime::server::DEVICES_MAX,
            args.devices
        );
    }
    if args.mode == loadgen::Mode::Trace {
        bail!("--mode trace is not available in up: run `distmind client --mode trace` against a cluster");
    }
    let policy = match (system.baseline(), &args.policy) {
        (None, p) => p.clone(),
        (Some(_), Some(p)) if p != system.as_str() => bail!(
            "--system {} runs the controller with --policy {}; --policy {p} contradicts it",
            system.as_str(),
            system.as_str()
        ),
        (Some(_), _) => Some(system.as_str().to_string()),
    };
    if emulated.is_some() && executor != ExecutorKind::Sim {
        bail!(
            "--emulate-link needs --executor sim: only simulated GPU time can run on the dilated clock \
             (a real executor would look K times faster)"
        );
    }
    training::check_flags(args, system)?;
    let k = distmind_common::emulate::dilation(emulated.as_ref());
    if args.timeline.is_some() {
        let interval = args.timeline_interval;
        if !(interval.is_finite() && interval > 0.0) {
            bail!("--timeline-interval must be a positive number of seconds, got {interval}");
        }
        let n = duration.as_secs_f64() / interval;
        if n > timeline::SAMPLES_MAX as f64 {
            bail!(
                "--timeline-interval {interval} s cuts --duration {:.0} s into {n:.0} intervals, more than a \
                 timeline holds ({}): use longer intervals",
                duration.as_secs_f64(),
                timeline::SAMPLES_MAX
            );
        }
    }
    println!("up: system {}", system.as_str());
    if let Some(e) = &emulated {
        println!(
            "up: {e}: every process runs on a clock {:.2}x slower; results in emulated time",
            e.dilation()
        );
    }
    println!("up: executor {executor} ({why}), {n_models} {scale} models");
    if executor == ExecutorKind::Cpu && scale == Scale::Full {
        println!("up: note: full-scale models on the cpu executor take seconds per request; expect rejections and few answers");
    }

    // 1. Models.
    let work = WorkDir::from_arg(args.work_dir.as_ref());
    let model_dir = work.path.join("models");
    std::fs::create_dir_all(&model_dir)
        .with_context(|| format!("cannot create {}", model_dir.display()))?;
    let t = Instant::now();
    let packages = generate(
        &model_dir,
        &Models {
            scale,
            n: n_models,
            seed: args.seed,
            group_bytes: args.group_bytes.unwrap_or(settings.controller.group_bytes),
            family: args.family,
        },
        stop,
    )?;
    let mut total_bytes = 0u64;
    // What the models take in the runtime's host cache: whole blocks each.
    let block = distmind_runtime::cache::BLOCK_BYTES_DEFAULT;
    let mut cached_bytes = 0u64;
    let mut largest = 0u64;
    let mut names = Vec::with_capacity(packages.len());
    let mut opened = Vec::with_capacity(packages.len());
    for dir in &packages {
        let pkg = distmind_models::Package::open(dir)
            .with_context(|| format!("cannot open the generated package {}", dir.display()))?;
        names.push(pkg.manifest.name.clone());
        opened.push(pkg);
    }
    // The training job: one of the models, or one more package of up's own.
    let train = if args.use_train {
        let plan = training::plan(args, executor, &opened)?;
        let train_pkg = match plan.generate {
            Some(family) => Some(training::generate(
                &model_dir,
                &plan.model,
                family,
                scale,
                args.seed,
                args.group_bytes.unwrap_or(settings.controller.group_bytes),
            )?),
            None => None,
        };
        Some((plan, train_pkg))
    } else {
        None
    };
    // The distributed training job, checked before anything starts.
    let job_spec = match (&args.train_spec, &train) {
        (Some(path), Some((plan, _))) => {
            let mut spec = crate::train::load_spec(path, None, &[])?;
            spec.model = plan.model.clone();
            Some(spec)
        }
        _ => None,
    };
    for pkg in opened
        .iter()
        .chain(train.as_ref().and_then(|(_, p)| p.as_ref()))
    {
        let stored = pkg.manifest.stored_bytes;
        total_bytes += stored;
        cached_bytes += stored.div_ceil(block) * block;
        largest = largest.max(stored.div_ceil(block) * block);
    }
    let n_packages = n_models + usize::from(train.as_ref().is_some_and(|(_, p)| p.is_some()));
    println!(
        "up: generated {n_packages} packages ({:.1} MB) in {} in {:.1} s",
        total_bytes as f64 / 1e6,
        model_dir.display(),
        t.elapsed().as_secs_f64()
    );
    if let Some((plan, _)) = &train {
        println!("up: training: {}", plan.describe());
    }

    // 2. Processes.
    let replication = settings.controller.replication.max(1) as u64;
    let capacity = args
        .capacity
        .unwrap_or_else(|| with_slack(total_bytes * replication / args.memservers as u64));
    // The baselines hold the whole model set in host memory, uncapped.
    let cache = args.cache.unwrap_or_else(|| match system {
        System::Mps | System::Ray => with_slack(cached_bytes),
        _ => with_slack(cached_bytes).min(CACHE_BYTES_MAX_DEFAULT.max(with_slack(largest))),
    });
    let settings_arg = args.settings.as_os_str().to_owned();
    let mut cluster = procs::Cluster::new(&exe, &args.child_log, true);
    let timeout = args.ready_timeout;

    let mut a = vec![
        OsString::from("controller"),
        "--settings".into(),
        settings_arg.clone(),
    ];
    a.extend(os(&[
        "--listen",
        "127.0.0.1:0",
        "--client-listen",
        "127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
    ]));
    if let Some(p) = &policy {
        a.extend(os(&["--policy", p]));
    }
    if let Some(p) = args.period {
        a.extend(os(&["--period", &p.to_string()]));
    }
    if let Some(z) = args.zipf {
        a.extend(os(&["--zipf", &z.to_string()]));
    }
    if let Some(b) = &args.balancer {
        a.extend(os(&["--balancer", b]));
    }
    if let Some((plan, _)) = &train {
        a.extend(os(&["--use-train", "true", "--train-model", &plan.model]));
    }
    if let Some(w) = &args.inference_workload {
        a.extend(os(&["--inference-workload", &w.to_string()]));
    }
    a.extend(emulate_flags.iter().cloned());
    let c = cluster.start(
        "controller",
        &a,
        &["controller", "dispatcher", "metrics"],
        timeout,
        stop,
    )?;
    let (ctl, dispatcher) = (
        c.addr("controller").to_string(),
        c.addr("dispatcher").to_string(),
    );
    println!(
        "up: controller   pid {:>7}  metadata {ctl}  dispatcher {dispatcher}  metrics {}",
        c.pid(),
        c.addr("metrics")
    );
    let mut memservers = Vec::new();
    for i in 1..=args.memservers {
        let mut a = vec![
            OsString::from("memserver"),
            "--settings".into(),
            settings_arg.clone(),
        ];
        a.extend(os(&[
            "--listen",
            "127.0.0.1:0",
            "--capacity",
            &size_arg(capacity),
            "--controller",
            &ctl,
            "--metrics",
            "127.0.0.1:0",
        ]));
        a.extend(emulate_flags.iter().cloned());
        let m = cluster.start(
            &format!("memserver-{i}"),
            &a,
            &["memserver", "metrics"],
            timeout,
            stop,
        )?;
        println!(
            "up: memserver-{i}  pid {:>7}  data {}  arena {}  metrics {}",
            m.pid(),
            m.addr("memserver"),
            size_arg(capacity),
            m.addr("metrics")
        );
        memservers.push(m.addr("memserver").to_string());
    }
    let target = crate::deploy::Target {
        controller: ctl.clone(),
        key: key.clone(),
    };
    let deploy_opts =
        crate::deploy::Options::from_settings(&settings, args.strategy, None, None, false);
    if let Some(pkg) = train.as_ref().and_then(|(_, p)| p.as_ref()) {
        // Before the runtime registers: the dispatcher sends Train as soon as
        // it does, and a Train for a model not yet in the catalog fails and
        // is asked for again only a (dilated) second later.
        wait_registered(&ctl, &key, &memservers, None, timeout, stop, &mut cluster)?;
        let out = crate::deploy::deploy_package(&target, pkg, &deploy_opts)?;
        println!("up: {} (the training job)", out.summary());
    }
    let mut a = vec![
        OsString::from("runtime"),
        "--settings".into(),
        settings_arg.clone(),
    ];
    a.extend(os(&[
        "--listen",
        "127.0.0.1:0",
        "--controller",
        &ctl,
        "--executor",
        &executor.to_string(),
        "--cache",
        &size_arg(cache),
        "--metrics",
        "127.0.0.1:0",
        "--devices",
        &(0..args.devices)
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(","),
    ]));
    if let Some(m) = args.device_memory {
        a.extend(os(&["--device-memory", &size_arg(m)]));
    }
    if let Some(b) = train.as_ref().and_then(|(plan, _)| plan.batch) {
        a.extend(os(&["--train-batch", &b.to_string()]));
    }
    a.extend(emulate_flags.iter().cloned());
    if let Some(b) = system.baseline() {
        a.extend(os(&["--baseline", system.as_str()]));
        let (resident, _, _) = b.preset();
        println!(
            "up: baseline {}: {resident} model(s) resident per GPU, whole-model loads{}",
            system.as_str(),
            if b.preset().2 {
                ", every model in the GPU server's host memory"
            } else {
                ""
            }
        );
    }
    let mut profile_label = "-".to_string();
    let mut sim_profile = None;
    if executor == ExecutorKind::Sim {
        let profile = args.profile.clone().unwrap_or_else(|| {
            let p = args.settings.join("profiles").join("h200-estimated.json");
            if p.exists() {
                p
            } else {
                PathBuf::from(distmind_runtime::profile::SHIPPED_ESTIMATED_PATH)
            }
        });
        let p = distmind_runtime::profile::Profile::load(&profile)
            .with_context(|| format!("the sim executor's profile {}", profile.display()))?;
        println!(
            "up: sim executor: GPU times of {} from {} (source: {}), outputs are zeros; latencies below are not measurements",
            p.gpu,
            profile.display(),
            p.source.as_str()
        );
        profile_label = format!("{} ({})", portable(&profile).display(), p.source.as_str());
        a.push("--profile".into());
        a.push(profile.into_os_string());
        sim_profile = Some(p);
    }
    if args.timeline.is_some() && sim_profile.is_none() {
        println!(
            "up: note: the {executor} executor has no profile: the timeline's bounds and utilization columns are 0, its rates are measured"
        );
    }
    let timeline_bounds = match &args.timeline {
        Some(_) => Some(training::bounds(
            sim_profile.as_ref(),
            &opened,
            args.batch,
            ca_zipf(args, &settings),
            args.devices,
            train
                .as_ref()
                .map(|(plan, _)| (plan.family, plan.effective_batch())),
            scale,
        )?),
        None => None,
    };
    let r = cluster.start("runtime", &a, &["runtime", "metrics"], timeout, stop)?;
    let runtime = r.addr("runtime").to_string();
    let runtime_metrics = r.addr("metrics").to_string();
    let runtime_pid = r.pid();
    println!(
        "up: runtime      pid {:>7}  requests {runtime}  executor {executor}  host cache {}  metrics {}",
        r.pid(),
        size_arg(cache),
        r.addr("metrics")
    );
    wait_registered(
        &ctl,
        &key,
        &memservers,
        Some(&runtime),
        timeout,
        stop,
        &mut cluster,
    )?;
    println!(
        "up: {} memory server(s) and the runtime are registered with the controller",
        memservers.len()
    );

    // 3. Deploy.
    let t = Instant::now();
    for pkg in &opened {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted during the deploy; every process was stopped");
        }
        let out = crate::deploy::deploy_package(&target, pkg, &deploy_opts)?;
        println!("up: {}", out.summary());
    }
    // The most popular model (the client draws rank k as the k-th) warms
    // the devices.
    let warm_with = opened.first().map(|p| p.manifest.clone());
    drop(opened);
    drop(train);
    println!(
        "up: deployed {n_models} models ({:.1} MB) in {:.1} s",
        total_bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    let warm_host = system != System::Distmind || args.warm_cache;
    if warm_host {
        warm(args, system, &runtime, &key, &names, stop)?;
    }
    let warm_devices = args.warm_devices.unwrap_or(executor == ExecutorKind::Cuda);
    if let (true, Some(m)) = (warm_devices, &warm_with) {
        warm_each_device(args, &runtime, &key, m)?;
    }
    if warm_host || warm_devices {
        // The dispatcher sees a host cache and residency in the runtime's
        // heartbeats: let one (and the controller's tick) pass, or the
        // first requests find the warm cache cold in the dispatcher's view.
        std::thread::sleep(
            distmind_controller::registry::HEARTBEAT_INTERVAL_DEFAULT + Duration::from_millis(200),
        );
    }

    let job = match job_spec {
        Some(spec) => Some(training::submit_job(&ctl, &key, spec)?),
        None => None,
    };

    // 4. Workload.
    let mut ca = loadgen::ClientArgs::with_settings(args.settings.clone());
    ca.addr = Some(dispatcher.clone());
    ca.controller = Some(ctl.clone());
    ca.mode = Some(args.mode);
    match args.mode {
        loadgen::Mode::Closed => {
            ca.concurrency = Some(args.concurrency);
            // The run lasts --duration, not GLOBAL_NUM_REQUEST requests.
            ca.requests = Some(0);
        }
        _ => ca.rate = Some(args.rate),
    }
    ca.duration = Some(duration);
    ca.zipf = args.zipf;
    ca.slo_ms = args.slo_ms;
    ca.batch = args.batch;
    if let Some(e) = &emulated {
        let flags = crate::emulate::EmulateArgs::flags_for(e);
        ca.emulate = crate::emulate::EmulateArgs {
            emulate_link: Some(flags[1].clone()),
            emulate_loopback: Some(flags[3].clone()),
        };
    }
    ca.seed = args.seed;
    ca.json = args.json.clone();
    // Most popular first, families interleaved, as generated.
    ca.models = names;
    let shape = match args.mode {
        loadgen::Mode::Closed => format!("closed loop, {} client(s)", args.concurrency),
        _ => format!("poisson {} req/s", args.rate),
    };
    println!(
        "up: workload: {shape}, batch {}, for {:.0} s{} through the dispatcher at {dispatcher} (Ctrl-C stops early)",
        args.batch,
        duration.as_secs_f64(),
        if emulated.is_some() { " (emulated time)" } else { "" }
    );
    // Time 0 of the timeline: the workload's start.
    let sampler = match &args.timeline {
        Some(_) => Some(sampler::Sampler::start(
            runtime_metrics.clone(),
            args.timeline_interval,
            k,
        )?),
        None => None,
    };
    let procs: Vec<(String, u32)> = cluster
        .services()
        .iter()
        .map(|s| (s.name.clone(), s.pid()))
        .collect();
    let cpu_before = cpu::Snapshot::take(&procs);
    let report = loadgen::run_until(&ca, stop);
    let cpu_used = cpu::Usage::between(&cpu_before, &cpu::Snapshot::take(&procs));
    // Stopped and joined on every path, the workload's errors included.
    let recorded = sampler.map(sampler::Sampler::finish);
    let report = report?;
    if stop.load(Ordering::Relaxed) {
        bail!("interrupted during the workload; every process was stopped");
    }
    if let Some(id) = &job {
        training::finish_job(&ctl, &key, id)?;
    }

    // 5. Metrics, then shutdown.
    println!("\n== metrics ==");
    let scrape_timeout = Duration::from_secs(5);
    let mut controller_metrics = String::new();
    for s in cluster.services() {
        if let Some(addr) = s.addrs.get("metrics").cloned() {
            metrics::print_headline(&s.name, &addr, scrape_timeout);
            if s.name == "controller" {
                if let Ok((200, body)) =
                    distmind_common::metrics::scrape(&addr, "/metrics", scrape_timeout)
                {
                    controller_metrics = body;
                }
            }
        }
    }
    // The GPU server's host memory, measured before it stops (figure 10).
    let runtime_rss = rss_bytes(runtime_pid);
    // Wall time on the runtime's clock; the row holds the run's time (emulated: / K).
    let serial_overhead_wall_ms =
        match distmind_common::metrics::scrape(&runtime_metrics, "/metrics", scrape_timeout) {
            Ok((200, text)) => results::serial_overhead_ms(&text),
            _ => None,
        };
    let serial_overhead_ms = serial_overhead_wall_ms.map(|ms| ms / k);
    if let Some(ms) = serial_overhead_wall_ms {
        println!(
            "up: the GPU server's serial path: {ms:.4} ms of wall time per request beyond compute and copy{}",
            if k == 1.0 {
                String::new()
            } else {
                format!(" ({:.4} ms emulated)", ms / k)
            }
        );
    }
    // What `distmind simulate` takes to mirror this run's processes (it
    // refuses a zero duration: a flag that rounds to 0 is left out).
    let mirror: Vec<String> = [
        (
            "--round-trip",
            results::dispatch_overhead_ms(&controller_metrics).map(|ms| ms / k),
        ),
        ("--serial", serial_overhead_ms),
    ]
    .into_iter()
    .filter_map(|(flag, ms)| {
        ms.filter(|&ms| ms >= 0.0005)
            .map(|ms| format!("{flag} {ms:.3}ms"))
    })
    .collect();
    if !mirror.is_empty() {
        println!(
            "up: to mirror this run in `distmind simulate`: {} (the dispatcher's round trip beyond \
             the GPU server's time, the GPU server's serial path per request)",
            mirror.join(" ")
        );
    }
    println!(
        "{}",
        cpu_used.line(
            report.ok,
            std::thread::available_parallelism().map_or(1, |n| n.get())
        )
    );
    let died = cluster.exited();
    println!();
    for (name, pid, what) in cluster.stop_all() {
        println!("up: {name} (pid {pid}) {what}");
    }
    drop(work);
    if let Some((name, status, tail)) = died.into_iter().next() {
        bail!("{name} exited during the run ({status}); its stderr ends with:\n{tail}");
    }
    if report.ok == 0 {
        bail!(
            "no request was answered with outputs ({} sent); see the errors above",
            report.sent
        );
    }
    if let (Some(path), Some(r), Some(bounds)) = (&args.timeline, &recorded, timeline_bounds) {
        let labels = timeline::Labels {
            test: args.test.clone(),
            system: args
                .label
                .clone()
                .unwrap_or_else(|| system.as_str().to_string()),
            link: emulated.as_ref().map_or("loopback".to_string(), |e| {
                distmind_common::emulate::format_link(e.link_bytes_per_s())
            }),
            dilation: k,
            source: "processes".into(),
            executor: executor.to_string(),
            profile: profile_label.clone(),
        };
        timeline::write(path, &labels, bounds, &r.samples)?;
        println!(
            "up: timeline: {} intervals of {} s{} written to {} ({} scrapes, {} failed{})",
            r.samples.len(),
            args.timeline_interval,
            if emulated.is_some() {
                " (emulated)"
            } else {
                ""
            },
            path.display(),
            r.scrapes,
            r.failed,
            if r.truncated {
                ", cut at the limit"
            } else {
                ""
            }
        );
    }
    if let Some(path) = &args.csv {
        let row = results::Row {
            test: args.test.clone(),
            system: args
                .label
                .clone()
                .unwrap_or_else(|| system.as_str().to_string()),
            family: args
                .family
                .map_or_else(|| "mixed".to_string(), |f| f.to_string()),
            models: n_models,
            devices: args.devices,
            zipf: ca_zipf(args, &settings),
            period_s: args
                .period
                .unwrap_or(settings.controller.rescheduling_period_s),
            cache_bytes: cache,
            executor: executor.to_string(),
            profile: profile_label.clone(),
            runtime_rss_bytes: runtime_rss,
            link: emulated.as_ref().map_or("loopback".to_string(), |e| {
                distmind_common::emulate::format_link(e.link_bytes_per_s())
            }),
            dilation: distmind_common::emulate::dilation(emulated.as_ref()),
            loopback: emulated.as_ref().map_or("-".to_string(), |e| {
                distmind_common::emulate::format_rate(e.loopback_bytes_per_s())
            }),
            source: "processes".into(),
            serial_overhead_ms,
        };
        results::append(path, &row, &report)?;
        println!("up: results appended to {}", path.display());
    }
    println!(
        "up: done in {:.1} s: {} of {} requests answered",
        started.elapsed().as_secs_f64(),
        report.ok,
        report.sent
    );
    Ok(Outcome {
        report,
        runtime_rss_bytes: runtime_rss,
        cache_bytes: cache,
        profile_label,
        emulated,
        controller_metrics,
        host_cpu_busy: cpu_used.host_busy,
    })
}

/// Which packages `up` generates.
struct Models {
    scale: Scale,
    n: usize,
    seed: u64,
    group_bytes: u64,
    /// One family only; `None`: the five in turn.
    family: Option<Family>,
}

/// The family and variant index of model `i`.
fn model_family(m: &Models, i: usize) -> (Family, usize) {
    match m.family {
        Some(f) => (f, i),
        None => family_of(i),
    }
}

/// Writes the packages; returns their directories in model order (the
/// families interleaved). Packages already in `dir` with the same name,
/// seed and group size are kept (a given --work-dir is reused across runs).
fn generate(dir: &Path, m: &Models, stop: &AtomicBool) -> anyhow::Result<Vec<PathBuf>> {
    let mut per_family: Vec<Vec<PathBuf>> = Vec::new();
    for (f, family) in Family::ALL.iter().enumerate() {
        let variants = (0..m.n)
            .filter(|&i| model_family(m, i).0 == *family)
            .count();
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted while generating models");
        }
        let seed = m.seed.wrapping_add(1000 * f as u64);
        let expected: Vec<PathBuf> = (0..variants)
            .map(|v| dir.join(distmind_models::variant_name(*family, m.scale, v)))
            .collect();
        let reusable = expected.iter().enumerate().all(|(v, d)| {
            distmind_models::Package::open(d).is_ok_and(|p| {
                p.manifest.seed == Some(seed.wrapping_add(v as u64))
                    && p.manifest.group_bytes == m.group_bytes
            })
        });
        if reusable {
            per_family.push(expected);
            continue;
        }
        let opts = distmind_models::GenOptions {
            family: *family,
            variants,
            out_dir: dir.to_path_buf(),
            scale: m.scale,
            seed,
            group_bytes: m.group_bytes,
            dtype: distmind_models::ParamDtype::F32,
        };
        per_family.push(
            distmind_models::generate(&opts)
                .with_context(|| format!("generating {variants} {family} packages"))?,
        );
    }
    Ok((0..m.n)
        .map(|i| {
            let (family, v) = model_family(m, i);
            let f = Family::ALL
                .iter()
                .position(|x| *x == family)
                .expect("listed");
            per_family[f][v].clone()
        })
        .collect())
}

/// A process's resident memory (VmRSS of /proc/<pid>/status), if readable.
fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// The zipf exponent the workload uses (the client's default).
fn ca_zipf(args: &UpArgs, settings: &distmind_common::settings::Settings) -> f64 {
    args.zipf.unwrap_or(settings.controller.zipf_s)
}

/// Brings a system to the state the paper measures it in (setup, not
/// timed): mps and ray (and distmind with --warm-cache) with every model in
/// the GPU server's host memory, or as many of the most popular as its
/// cache holds; the gpu bound with its model resident on every device.
fn warm(
    args: &UpArgs,
    system: System,
    runtime: &str,
    key: &ClusterKey,
    names: &[String],
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    let t = Instant::now();
    let mut c = distmind_runtime::client::RuntimeClient::connect(runtime, key, PREFETCH_TIMEOUT)
        .with_context(|| format!("cannot reach the runtime at {runtime}"))?;
    // Least popular first: the client draws rank k of its Zipf as the k-th
    // model, so when the host cache holds only part of the set, LRU keeps
    // the most popular ones (the state a cache reaches under the workload).
    for name in names.iter().rev() {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted while warming the GPU server");
        }
        if system == System::Gpu {
            for d in 0..args.devices {
                c.prefetch(name, Some(d))
                    .with_context(|| format!("loading {name} onto device {d}"))?;
            }
        } else {
            c.prefetch(name, None)
                .with_context(|| format!("loading {name} into the host memory of {runtime}"))?;
        }
    }
    println!(
        "up: {} warmed: {} in {:.1} s (setup, not timed)",
        system.as_str(),
        if system == System::Gpu {
            "its model resident on every device".to_string()
        } else {
            format!(
                "{} models prefetched into host memory, most popular last",
                names.len()
            )
        },
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs one inference of `model` on every device of the runtime, straight
/// to the runtime (setup, not timed): each device pays its first run's
/// one-time costs here instead of in the workload.
fn warm_each_device(
    args: &UpArgs,
    runtime: &str,
    key: &ClusterKey,
    model: &distmind_models::Manifest,
) -> anyhow::Result<()> {
    let t = Instant::now();
    let input = loadgen::input_for(model, args.batch, args.seed)?;
    let mut c = distmind_runtime::client::RuntimeClient::connect(runtime, key, PREFETCH_TIMEOUT)
        .with_context(|| format!("cannot reach the runtime at {runtime}"))?;
    let mut firsts = Vec::with_capacity(args.devices as usize);
    for d in 0..args.devices {
        let opts = distmind_runtime::client::InferOptions {
            device: Some(d),
            ..Default::default()
        };
        let r = c
            .infer_with(&model.name, &input, opts)
            .with_context(|| format!("the warm-up inference of {} on device {d}", model.name))?;
        firsts.push(format!("{:.1}", r.timing.total_ms));
    }
    println!(
        "up: warmed {} device(s): one inference of {} each, first runs {} ms, in {:.1} s (setup, not timed)",
        args.devices,
        model.name,
        firsts.join(", "),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Polls the controller until every memory server and the runtime (when
/// given) are registered and alive (no fixed sleeps).
fn wait_registered(
    ctl: &str,
    key: &ClusterKey,
    memservers: &[String],
    runtime: Option<&str>,
    limit: Duration,
    stop: &AtomicBool,
    cluster: &mut procs::Cluster,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    let mut c = ControllerClient::connect(ctl, key, CONNECT_TIMEOUT)
        .with_context(|| format!("cannot reach the controller at {ctl}"))?;
    loop {
        let alive_ms: Vec<String> = c
            .list_memservers()?
            .into_iter()
            .filter(|m| m.alive)
            .map(|m| m.addr)
            .collect();
        let runtime_missing = match runtime {
            Some(rt) => (!c.list_runtimes()?.iter().any(|r| r.alive && r.addr == rt)).then_some(rt),
            None => None,
        };
        let missing: Vec<&str> = memservers
            .iter()
            .filter(|m| !alive_ms.contains(m))
            .map(String::as_str)
            .chain(runtime_missing)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        if let Some((name, status, tail)) = cluster.exited().into_iter().next() {
            bail!("{name} exited ({status}) before registering; its stderr ends with:\n{tail}");
        }
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted while waiting for registrations");
        }
        if Instant::now() > deadline {
            bail!(
                "not registered with the controller at {ctl} after {} s: {}",
                limit.as_secs(),
                missing.join(", ")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `path` as results and captions carry it: relative to the working
/// directory when it lies under it, else its file name, so that no CSV or
/// figure names a directory of the machine that made it.
pub fn portable(path: &Path) -> PathBuf {
    if path.is_relative() {
        return path.to_path_buf();
    }
    std::env::current_dir()
        .ok()
        .and_then(|cwd| path.strip_prefix(cwd).ok().map(Path::to_path_buf))
        .or_else(|| path.file_name().map(PathBuf::from))
        .unwrap_or_else(|| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn executor_choice() {
        let never = || -> Result<(), String> { panic!("probed") };
        assert_eq!(
            choose_executor(ExecutorChoice::Cpu, true, never).unwrap().0,
            ExecutorKind::Cpu
        );
        assert_eq!(
            choose_executor(ExecutorChoice::Sim, false, never)
                .unwrap()
                .0,
            ExecutorKind::Sim
        );
        assert!(choose_executor(ExecutorChoice::Cuda, false, never)
            .unwrap_err()
            .contains("--features cuda"));
        assert_eq!(
            choose_executor(ExecutorChoice::Cuda, true, never)
                .unwrap()
                .0,
            ExecutorKind::Cuda
        );
        // auto: cuda only when compiled in and a device answers, else sim.
        assert_eq!(
            choose_executor(ExecutorChoice::Auto, false, never)
                .unwrap()
                .0,
            ExecutorKind::Sim
        );
        assert_eq!(
            choose_executor(ExecutorChoice::Auto, true, || Ok(()))
                .unwrap()
                .0,
            ExecutorKind::Cuda
        );
        let (kind, why) =
            choose_executor(ExecutorChoice::Auto, true, || Err("no libcuda".into())).unwrap();
        assert_eq!(kind, ExecutorKind::Sim);
        assert!(why.contains("no libcuda"));
        assert_eq!(default_scale(ExecutorKind::Cpu), Scale::Tiny);
        assert_eq!(default_scale(ExecutorKind::Sim), Scale::Full);
    }

    #[test]
    fn models_spread_over_families_and_sizes_have_slack() {
        let fams: Vec<Family> = (0..7).map(|i| family_of(i).0).collect();
        assert_eq!(&fams[..5], &Family::ALL);
        assert_eq!(family_of(5), (Family::Resnet152, 1));
        assert_eq!(family_of(6), (Family::InceptionV3, 1));
        assert_eq!(with_slack(0), 64 * MIB);
        assert_eq!(with_slack(100 * MIB), 214 * MIB);
        assert_eq!(with_slack(1) % MIB, 0);
        assert_eq!(size_arg(64 * MIB), "64MiB");
        assert_eq!(
            parse_size(&size_arg(with_slack(12_345_678))).unwrap(),
            with_slack(12_345_678)
        );
    }

    #[test]
    fn generate_interleaves_families() {
        let dir = std::env::temp_dir().join(format!("distmind-up-test-{}", std::process::id()));
        let stop = AtomicBool::new(false);
        let m = Models {
            scale: Scale::Tiny,
            n: 7,
            seed: 0,
            group_bytes: 1 << 20,
            family: None,
        };
        let dirs = generate(&dir, &m, &stop).unwrap();
        let names: Vec<String> = dirs
            .iter()
            .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names[0], "resnet152-tiny-00000000");
        assert_eq!(names[1], "inception_v3-tiny-00000000");
        assert_eq!(names[5], "resnet152-tiny-00000001");
        assert!(dirs.iter().all(|d| d.join("manifest.json").exists()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn results_carry_no_absolute_path() {
        let cwd = std::env::current_dir().unwrap();
        let inside = cwd.join("settings/profiles/v100-estimated.json");
        assert_eq!(
            portable(&inside),
            Path::new("settings/profiles/v100-estimated.json")
        );
        assert_eq!(
            portable(Path::new("/elsewhere/p/h200.json")),
            Path::new("h200.json")
        );
        assert_eq!(portable(Path::new("rel/x.json")), Path::new("rel/x.json"));
    }
}
