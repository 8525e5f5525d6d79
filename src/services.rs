//! Long-running services started from the CLI: each builds its config from
//! flags and `settings/`, binds, prints one `<service> listening on <addr>`
//! line on stdout (scripts and tests wait for it instead of sleeping), and
//! serves until Ctrl-C or SIGTERM.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context;
use distmind_common::handshake::ClusterKey;
use distmind_common::settings::Settings;

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => log::info!("interrupted: shutting down"),
        _ = term => log::info!("terminated: shutting down"),
    }
}

pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    runtime_named("distmind", 0)
}

/// [`runtime`] whose threads are called `name` and run at nice value `nice`
/// (0: the process's own; see [`distmind_transport::priority`]).
pub fn runtime_named(name: &str, nice: i32) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(name)
        .on_thread_start(move || distmind_transport::priority::lower_current_thread(nice))
        .build()
        .context("cannot start the async runtime")
}

pub fn load_settings(dir: &Path) -> anyhow::Result<Settings> {
    Settings::load(dir).with_context(|| format!("cannot load settings from {}", dir.display()))
}

pub fn cluster_key(settings: &Settings) -> ClusterKey {
    ClusterKey::from_secret(settings.cluster_key.as_bytes())
}

/// Builds the executor named on the command line, on device 0.
/// `time_dilation`: K of an emulated link (1: none); only the sim executor's
/// modelled times stretch, real executors take the time they take.
pub fn executor(
    kind: distmind_runtime::exec::ExecutorKind,
    profile: &std::path::Path,
    time_dilation: f64,
) -> anyhow::Result<Box<dyn distmind_runtime::exec::Executor>> {
    executor_on(kind, profile, time_dilation, 0)
}

/// [`executor`] on device `ordinal` (the GPU a cuda executor opens; cpu and
/// sim have no hardware behind it). A runtime builds one executor per device
/// from this one ([`distmind_runtime::exec::per_device`]), reusing it for
/// the device it is on.
pub fn executor_on(
    kind: distmind_runtime::exec::ExecutorKind,
    profile: &std::path::Path,
    time_dilation: f64,
    ordinal: u32,
) -> anyhow::Result<Box<dyn distmind_runtime::exec::Executor>> {
    use distmind_runtime::exec::{cpu::CpuExecutor, sim::SimExecutor, ExecutorKind};
    anyhow::ensure!(
        time_dilation == 1.0 || kind == ExecutorKind::Sim,
        "an emulated link dilates the clock by {time_dilation:.2}, and only the sim executor's times can be \
         dilated: the {kind} executor computes in real time, which would look \
         {time_dilation:.2}x faster; use --executor sim or drop the emulation"
    );
    match kind {
        ExecutorKind::Cpu => Ok(Box::new(CpuExecutor::new())),
        ExecutorKind::Sim => {
            let p = distmind_runtime::profile::Profile::load(profile)?;
            Ok(Box::new(SimExecutor::with_dilation(p, time_dilation)?))
        }
        // Without the `cuda` feature this returns a clear "rebuild with
        // --features cuda" error; without a driver, one naming libcuda.
        ExecutorKind::Cuda => Ok(Box::new(distmind_runtime::exec::cuda::CudaExecutor::new(
            ordinal as usize,
        )?)),
    }
}

pub struct MemserverArgs<'a> {
    pub settings: &'a Path,
    pub listen: SocketAddr,
    pub capacity_bytes: u64,
    pub controller: Option<String>,
    pub advertise: Option<String>,
    pub max_connections: usize,
    pub huge_pages: bool,
    pub metrics: Option<SocketAddr>,
    /// Override transport.json's memserver section.
    pub fabric_provider: Option<String>,
    pub verbs_device: Option<String>,
    pub verbs_gid_index: Option<u8>,
    /// The sample service's preprocessing workers.
    pub prep_workers: usize,
    /// NDPipe: a model package whose layers before the head extract features.
    pub backbone: Option<std::path::PathBuf>,
    /// The backbone's input side.
    pub backbone_input: u32,
    /// Emulated link: the tcp data path is held to its loopback rate.
    pub emulate: crate::emulate::EmulateArgs,
}

pub fn run_memserver(args: MemserverArgs<'_>) -> anyhow::Result<()> {
    let settings = load_settings(args.settings)?;
    let emulated = args.emulate.resolve(&settings)?;
    let controller = args
        .controller
        .unwrap_or_else(|| settings.metadata_endpoint().to_string());
    let mut config = distmind_memserver::MemserverConfig::new(
        args.listen,
        args.capacity_bytes,
        cluster_key(&settings),
    );
    config.controller = Some(controller);
    config.advertise = args.advertise;
    config.max_connections = args.max_connections;
    config.huge_pages = args.huge_pages;
    config.metrics_listen = args.metrics;
    config.prep_workers = args.prep_workers;
    if let Some(dir) = &args.backbone {
        let b = distmind_runtime::ndpipe::Backbone::open(dir, args.backbone_input)
            .with_context(|| format!("--backbone {}", dir.display()))?;
        log::info!(
            "backbone: {:?}",
            distmind_memserver::FeatureExtractor::info(&b)
        );
        config.extractor = Some(std::sync::Arc::new(b));
    }
    if let Some(e) = &emulated {
        config.nic_bytes_per_s = Some(e.loopback_bytes_per_s() as u64);
        log::info!("{e}: tcp replies held to the loopback rate");
    }
    let me = config
        .advertise
        .clone()
        .unwrap_or_else(|| args.listen.to_string());
    let from_settings = settings.transport.memserver_for(&me);
    let fabric_provider = args
        .fabric_provider
        .or_else(|| from_settings.fabric_provider.clone());
    if let Some(p) = &fabric_provider {
        distmind_common::settings::check_fabric_provider(p)
            .map_err(|e| anyhow::anyhow!("--fabric-provider: {e}"))?;
    }
    config.one_sided = distmind_memserver::OneSidedConfig {
        fabric_provider,
        // Bind the endpoint where the tcp port is, unless that is every interface.
        fabric_source: (!args.listen.ip().is_unspecified()).then(|| args.listen.ip().to_string()),
        verbs_device: args
            .verbs_device
            .or_else(|| from_settings.verbs_device.clone()),
        verbs_gid_index: args
            .verbs_gid_index
            .unwrap_or(from_settings.verbs_gid_index),
    };
    runtime()?.block_on(async move {
        let server = distmind_memserver::Memserver::bind(config).await?;
        println!("memserver listening on {}", server.local_addr());
        if let Some(a) = server.metrics_addr() {
            println!("metrics listening on {a}");
        }
        server.serve(shutdown_signal()).await?;
        anyhow::Ok(())
    })
}

pub struct ControllerArgs<'a> {
    pub settings: &'a Path,
    pub listen: Option<SocketAddr>,
    /// The dispatcher's client port; default 127.0.0.1:<GLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT>.
    pub client_listen: Option<SocketAddr>,
    /// The Open Inference Protocol over HTTP; default
    /// <GLOBAL_LOCAL_IP>:<GLOBAL_INFERENCE_HTTP_PORT>, or port 0 when
    /// `client_listen` has port 0.
    pub http_listen: Option<SocketAddr>,
    /// The same over gRPC (<GLOBAL_INFERENCE_GRPC_PORT>).
    pub grpc_listen: Option<SocketAddr>,
    /// Run the catalog only, no dispatcher.
    pub no_dispatcher: bool,
    /// Where the dispatcher's tasks run.
    pub dispatch_thread: distmind_controller::dispatch::DispatchThread,
    pub metrics: Option<SocketAddr>,
    /// Default: controller.json's `policy`.
    pub policy: Option<String>,
    pub balancer: Option<String>,
    /// Training job for `use_train` (a CNN model in the catalog).
    pub train_model: Option<String>,
    /// Overrides controller.json's `use_train`.
    pub use_train: Option<bool>,
    /// Overrides controller.json's `rescheduling_period_s`.
    pub period_s: Option<f64>,
    /// Overrides controller.json's `zipf_s` (the `distmind` policy's draws).
    pub zipf_s: Option<f64>,
    pub seed: u64,
    /// Emulated link: SLOs, the period and timeouts are dilated by its K.
    pub emulate: crate::emulate::EmulateArgs,
}

/// The dispatcher's configuration from controller.json and the flags.
pub fn dispatch_config(
    settings: &Settings,
    args: &ControllerArgs<'_>,
) -> anyhow::Result<distmind_controller::dispatch::DispatchConfig> {
    use distmind_controller::policy::distmind::DistMindConfig;
    use distmind_controller::policy::{Balancer, PolicyKind};
    let policy: PolicyKind = args
        .policy
        .as_deref()
        .unwrap_or(&settings.controller.policy)
        .parse()
        .map_err(|e: String| anyhow::anyhow!("{e} (controller.json `policy` or --policy)"))?;
    // The MPS baseline reads mps_controller.json (the keys of controller.json)
    // when the settings have one, as the original's MPS controller did.
    let (c, file) = match (&settings.mps_controller, policy) {
        (Some(m), PolicyKind::Mps) => (m, "mps_controller.json"),
        _ => (&settings.controller, "controller.json"),
    };
    let emulated = args.emulate.resolve(settings)?;
    let k = distmind_common::emulate::dilation(emulated.as_ref());
    let period_s = args.period_s.unwrap_or(c.rescheduling_period_s);
    anyhow::ensure!(
        period_s.is_finite() && period_s > 0.0,
        "{file}: rescheduling_period_s (or --period) must be positive, got {period_s}"
    );
    let zipf_s = args.zipf_s.unwrap_or(c.zipf_s);
    anyhow::ensure!(
        zipf_s.is_finite() && zipf_s >= 0.0,
        "{file}: zipf_s (or --zipf) must be 0 or more, got {zipf_s}"
    );
    let mut use_train = args.use_train.unwrap_or(c.use_train);
    if policy.is_baseline() && use_train {
        anyhow::ensure!(
            args.use_train != Some(true),
            "--use-train: the {policy} baseline does not share GPUs with training"
        );
        log::warn!("{file}: use_train is ignored by the {policy} baseline");
        use_train = false;
    }
    let mut cfg = distmind_controller::dispatch::DispatchConfig::new(
        policy,
        DistMindConfig {
            // In emulated seconds: K real seconds each.
            period: (period_s * k * 1e6) as u64,
            zipf_s,
            inference_workload_s: c.inference_workload_s.clone(),
            use_train,
            seed: args.seed,
        },
    );
    if let Some(b) = &args.balancer {
        cfg.balancer = b
            .parse::<Balancer>()
            .map_err(|e| anyhow::anyhow!("--balancer: {e}"))?;
    }
    cfg.slo_ms_by_family = c.slo_ms.clone().unwrap_or_default();
    if let Some(e) = &emulated {
        // Every time the dispatcher is told or assumes is on the dilated clock.
        cfg.time_dilation = k;
        for slo in cfg.slo_ms_by_family.values_mut() {
            *slo *= k;
        }
        cfg.slo_ms_default *= k;
        cfg.priors.net_bytes_per_s = e.loopback_bytes_per_s();
        cfg.priors.h2d_bytes_per_s /= k;
        cfg.priors.compute_ms *= k;
        log::info!("{e}: SLOs, the period and timeouts are dilated by K");
    }
    cfg.train_model = args.train_model.clone();
    anyhow::ensure!(
        !cfg.distmind.use_train || cfg.train_model.is_some(),
        "use_train is on: name the training job with --train-model (a CNN model in the catalog, e.g. the \
         original's resnet152_train)"
    );
    Ok(cfg)
}

/// Most entries of an inference/training schedule (a day of seconds).
pub const INFERENCE_WORKLOAD_ENTRIES_MAX: usize = 86_400;

/// `--inference-workload`: GPUs doing inference in each second of the
/// controller's clock (the rest train), as controller.json's
/// `inference_workload_s`; written comma-separated, e.g. `2,1,0,1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferenceWorkload(pub Vec<u32>);

impl std::str::FromStr for InferenceWorkload {
    type Err = String;

    /// Non-empty, at most [`INFERENCE_WORKLOAD_ENTRIES_MAX`] entries, each a
    /// count of GPUs (0 or more).
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Err(
                "--inference-workload is empty: give GPUs doing inference per second, e.g. 2,1,0,1"
                    .into(),
            );
        }
        let entries: Vec<&str> = s.split(',').collect();
        if entries.len() > INFERENCE_WORKLOAD_ENTRIES_MAX {
            return Err(format!(
                "--inference-workload has {} entries, at most {INFERENCE_WORKLOAD_ENTRIES_MAX}",
                entries.len()
            ));
        }
        entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                e.trim().parse::<u32>().map_err(|_| {
                    format!(
                        "--inference-workload entry {} is {e:?}: expected a number of GPUs (0 or more), \
                         e.g. 2,1,0,1",
                        i + 1
                    )
                })
            })
            .collect::<Result<Vec<u32>, String>>()
            .map(InferenceWorkload)
    }
}

impl InferenceWorkload {
    /// Checks that no second asks for more GPUs than the cluster's `gpus`.
    pub fn check_gpus(&self, gpus: u32) -> anyhow::Result<()> {
        if let Some((i, &n)) = self.0.iter().enumerate().find(|(_, &n)| n > gpus) {
            anyhow::bail!(
                "--inference-workload entry {} asks for {n} GPUs doing inference; the cluster has {gpus} \
                 (--devices)",
                i + 1
            );
        }
        Ok(())
    }
}

impl std::fmt::Display for InferenceWorkload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(u32::to_string).collect();
        f.write_str(&parts.join(","))
    }
}

/// Runs the controller. `inference_workload` (`--inference-workload`)
/// replaces `inference_workload_s` of controller.json (and of
/// mps_controller.json) before the dispatcher's configuration is built.
/// The controller cannot check it against the number of GPUs: runtimes
/// register after it starts; the distmind policy counts an entry above the
/// GPUs registered as all of them.
pub fn run_controller(
    args: ControllerArgs<'_>,
    inference_workload: Option<InferenceWorkload>,
) -> anyhow::Result<()> {
    let mut settings = load_settings(args.settings)?;
    if let Some(w) = inference_workload {
        log::info!(
            "--inference-workload {w}: replaces inference_workload_s {:?} of controller.json",
            settings.controller.inference_workload_s
        );
        if let Some(m) = settings.mps_controller.as_mut() {
            m.inference_workload_s = w.0.clone();
        }
        settings.controller.inference_workload_s = w.0;
    }
    let listen = match args.listen {
        Some(a) => a,
        None => settings
            .metadata_endpoint()
            .socket_addr()
            .context("the metadata endpoint (first line of storage_list.txt) is not a local address to listen on; pass --listen")?,
    };
    let mut config = distmind_controller::ControllerConfig::new(listen, cluster_key(&settings));
    if !args.no_dispatcher {
        let client = args.client_listen.unwrap_or_else(|| {
            SocketAddr::from((
                [127, 0, 0, 1],
                settings.config.load_balancer_port_for_client,
            ))
        });
        config.dispatch = Some((client, dispatch_config(&settings, &args)?));
        config.dispatch_thread = args.dispatch_thread;
        let (http, grpc) = inference_listen(&settings, &args)?;
        config.inference_http = Some(http);
        config.inference_grpc = Some(grpc);
        config.api_key = load_api_key(&settings.dir)?;
        if config.api_key.is_some() {
            log::info!(
                "{}: inference requests need `authorization: Bearer <key>`",
                settings.dir.join(API_KEY_FILE).display()
            );
        }
    } else if args.http_listen.is_some() || args.grpc_listen.is_some() {
        anyhow::bail!(
            "--http-listen and --grpc-listen serve inference through the dispatcher; drop them or --no-dispatcher"
        );
    }
    config.metrics_listen = args.metrics;
    runtime()?.block_on(async move {
        let server = distmind_controller::Controller::bind(config).await?;
        println!("controller listening on {}", server.local_addr());
        if let Some(a) = server.client_addr() {
            println!("dispatcher listening on {a}");
        }
        if let Some(a) = server.metrics_addr() {
            println!("metrics listening on {a}");
        }
        if let Some(a) = server.inference_http_addr() {
            println!("inference-http listening on {a}");
        }
        if let Some(a) = server.inference_grpc_addr() {
            println!("inference-grpc listening on {a}");
        }
        server.serve(shutdown_signal()).await?;
        anyhow::Ok(())
    })
}

/// The optional api key of the inference endpoints, in the settings directory.
pub const API_KEY_FILE: &str = "api.key";
/// Longest accepted api key.
const API_KEY_BYTES_MAX: usize = 4096;

/// `settings/api.key`, trimmed: `None` when the file does not exist. A key
/// goes in an HTTP header, so it must be visible ASCII without spaces.
pub fn load_api_key(dir: &Path) -> anyhow::Result<Option<String>> {
    let path = dir.join(API_KEY_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let key = text.trim();
    anyhow::ensure!(
        !key.is_empty() && key.len() <= API_KEY_BYTES_MAX,
        "{}: the key is {} bytes; it must be 1..={API_KEY_BYTES_MAX} (remove the file to serve without a key)",
        path.display(),
        key.len()
    );
    anyhow::ensure!(
        key.bytes().all(|b| b.is_ascii_graphic()),
        "{}: the key must be visible ASCII without spaces (it is sent as `authorization: Bearer <key>`); \
         e.g. `head -c 32 /dev/urandom | base64 > {}`",
        path.display(),
        path.display()
    );
    Ok(Some(key.to_string()))
}

/// Where the Open Inference Protocol endpoints listen: the flags, else
/// GLOBAL_LOCAL_IP and the config.sh ports; port 0 (ephemeral) when the
/// dispatcher's client port is ephemeral, so that clusters started side by
/// side (`distmind up`, tests) never collide.
fn inference_listen(
    settings: &Settings,
    args: &ControllerArgs<'_>,
) -> anyhow::Result<(SocketAddr, SocketAddr)> {
    let ephemeral = args.client_listen.is_some_and(|a| a.port() == 0);
    let default = |port: u16| -> anyhow::Result<SocketAddr> {
        let ip: std::net::IpAddr = settings.config.local_ip.parse().with_context(|| {
            format!(
                "GLOBAL_LOCAL_IP {:?} of config.sh is not an IP address to listen on; pass --http-listen and --grpc-listen",
                settings.config.local_ip
            )
        })?;
        Ok(SocketAddr::new(ip, if ephemeral { 0 } else { port }))
    };
    let http = match args.http_listen {
        Some(a) => a,
        None => default(settings.config.inference_http_port)?,
    };
    let grpc = match args.grpc_listen {
        Some(a) => a,
        None => default(settings.config.inference_grpc_port)?,
    };
    Ok((http, grpc))
}

pub struct RuntimeArgs<'a> {
    pub settings: &'a Path,
    /// Default: 127.0.0.1:<GLOBAL_CAHCE_PORT_FOR_SERVER of config.sh>.
    pub listen: Option<SocketAddr>,
    /// Default: the GPUs of config.sh (the first WORLD_SIZE of GPU_LIST).
    pub devices: Vec<u32>,
    pub executor: std::sync::Arc<dyn distmind_runtime::exec::Executor>,
    pub cache_bytes: u64,
    /// Default: the host cache size.
    pub device_bytes: Option<u64>,
    pub controller: Option<String>,
    pub advertise: Option<String>,
    pub rate_limit_gbps: Option<f64>,
    pub max_connections: usize,
    pub queue_depth: usize,
    pub metrics: Option<SocketAddr>,
    /// Images per training iteration.
    pub train_batch: usize,
    /// Override transport.json's gpu_server section.
    pub transport: Option<distmind_common::settings::TransportKind>,
    pub fabric_provider: Option<String>,
    pub verbs_device: Option<String>,
    pub verbs_gid_index: Option<u8>,
    pub no_tcp_fallback: bool,
    /// Serve as a baseline of the evaluation (presets below).
    pub baseline: Option<Baseline>,
    /// Most models resident per device (default: the baseline's, else 12).
    pub resident_max: Option<usize>,
    /// Load whole models, no pipelining (default: the baseline's, else off).
    pub whole_model: bool,
    /// Keep every catalog model in the host cache (default: the baseline's, else off).
    pub preload: bool,
    /// No background refills of the host cache (always off for baselines).
    pub no_host_refill: bool,
    /// Emulated link (resolved by the caller, which also built the executor
    /// with its dilation): the tcp reads are held to its loopback rate.
    pub emulate: Option<distmind_common::emulate::EmulatedLink>,
}

/// How a GPU server of a baseline of the evaluation serves (the paper's
/// MPS and Ray Serve setups, and the one-model GPU bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Baseline {
    /// NVIDIA MPS: the whole model set in host memory, up to 12 models
    /// resident per GPU (LRU), whole-model loads.
    Mps,
    /// Ray Serve: the whole model set in host memory, one model resident
    /// per GPU, a whole-model switch.
    Ray,
    /// The GPU bound: one model, resident once loaded, never switched.
    Gpu,
}

impl Baseline {
    /// (models resident per device, whole-model loads, preload the catalog).
    pub fn preset(self) -> (usize, bool, bool) {
        match self {
            Baseline::Mps => (MPS_RESIDENT_PER_GPU, true, true),
            Baseline::Ray => (1, true, true),
            Baseline::Gpu => (1, true, false),
        }
    }
}

/// The MPS baseline's processes per GPU (the paper's setting).
pub const MPS_RESIDENT_PER_GPU: usize = 12;

/// `distmind runtime`: the GPU server's request port.
pub fn run_runtime(args: RuntimeArgs<'_>) -> anyhow::Result<()> {
    let settings = load_settings(args.settings)?;
    let listen = args.listen.unwrap_or_else(|| {
        SocketAddr::from(([127, 0, 0, 1], settings.config.cache_port_for_server))
    });
    let controller = args
        .controller
        .unwrap_or_else(|| settings.metadata_endpoint().to_string());
    let mut config = distmind_runtime::server::RuntimeConfig::new(
        listen,
        cluster_key(&settings),
        controller,
        args.executor,
    );
    config.devices = if args.devices.is_empty() {
        settings.config.gpus().to_vec()
    } else {
        args.devices
    };
    if config.devices.is_empty() {
        config.devices = vec![0];
    }
    config.cache_bytes = args.cache_bytes;
    config.device_bytes = args.device_bytes.unwrap_or(args.cache_bytes);
    if let Some(g) = args.rate_limit_gbps {
        anyhow::ensure!(
            g.is_finite() && g > 0.0,
            "--rate-limit-gbps must be a positive number of Gbit/s, got {g}"
        );
        config.rate_limit_bytes_per_s = Some((g * 1e9 / 8.0).max(1.0) as u64);
    }
    if let Some(e) = &args.emulate {
        anyhow::ensure!(
            args.rate_limit_gbps.is_none(),
            "--rate-limit-gbps and an emulated link both limit the NIC: give one"
        );
        config.rate_limit_bytes_per_s = Some(e.loopback_bytes_per_s() as u64);
        log::info!("{e}: tcp reads held to the loopback rate");
    }
    config.advertise = args.advertise;
    config.max_connections = args.max_connections;
    config.queue_depth_max = args.queue_depth;
    config.metrics_listen = args.metrics;
    config.train_batch = args.train_batch;
    let (resident, whole, preload) = args.baseline.map_or(
        (
            distmind_runtime::device::RESIDENT_MODELS_MAX_DEFAULT,
            false,
            false,
        ),
        Baseline::preset,
    );
    config.resident_models_max = args.resident_max.unwrap_or(resident);
    anyhow::ensure!(
        config.resident_models_max >= 1,
        "--resident-max must be at least 1"
    );
    config.whole_model = args.whole_model || whole;
    config.preload = args.preload || preload;
    config.host_refill = !args.no_host_refill && args.baseline.is_none();
    let host = config
        .advertise
        .as_deref()
        .and_then(|a| a.rsplit_once(':').map(|(h, _)| h.to_string()))
        .unwrap_or_else(|| listen.ip().to_string());
    let mut choice = distmind_runtime::transports::TransportChoice::from(
        settings.transport.gpu_server_for(&host),
    );
    if let Some(k) = args.transport {
        choice.kind = k;
    }
    if let Some(p) = args.fabric_provider {
        distmind_common::settings::check_fabric_provider(&p)
            .map_err(|e| anyhow::anyhow!("--fabric-provider: {e}"))?;
        choice.fabric_provider = p;
    }
    if let Some(d) = args.verbs_device {
        choice.verbs_device = Some(d);
    }
    if let Some(g) = args.verbs_gid_index {
        choice.verbs_gid_index = g;
    }
    if args.no_tcp_fallback {
        choice.fallback_to_tcp = false;
    }
    config.transport = choice;
    runtime()?.block_on(async move {
        let server = distmind_runtime::server::RuntimeServer::bind(config).await?;
        println!("runtime listening on {}", server.local_addr());
        if let Some(a) = server.metrics_addr() {
            println!("metrics listening on {a}");
        }
        server.serve(shutdown_signal()).await?;
        anyhow::Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inference_workload_parses_and_names_the_flag() {
        let w: InferenceWorkload = "2, 1,0,1".parse().unwrap();
        assert_eq!(w.0, [2, 1, 0, 1]);
        assert_eq!(w.to_string(), "2,1,0,1");
        w.check_gpus(2).unwrap();
        let e = w.check_gpus(1).unwrap_err().to_string();
        assert!(
            e.contains("--inference-workload entry 1 asks for 2 GPUs") && e.contains("has 1"),
            "{e}"
        );
        for bad in ["", " ", "1,,2", "1,-1", "two"] {
            let e = bad.parse::<InferenceWorkload>().unwrap_err();
            assert!(e.contains("--inference-workload"), "{bad:?}: {e}");
        }
        let long = vec!["1"; INFERENCE_WORKLOAD_ENTRIES_MAX + 1].join(",");
        assert!(long.parse::<InferenceWorkload>().is_err());
    }
}
