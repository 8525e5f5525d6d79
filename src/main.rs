//! `distmind`: one binary, one subcommand per role. Thin: parse arguments,
//! install logging, call the library.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use distmind::{bench, deploy, logging, services};

#[derive(Parser)]
#[command(
    name = "distmind",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("DISTMIND_GIT_REV"), ")"),
    about = "DistMind in Rust: memory servers hold model parameters; GPU servers pull them on demand",
    long_about = "DistMind in Rust. Memory servers keep many models' parameters in DRAM; GPU servers pull a \
model's parameter groups over RDMA, EFA or TCP when a request needs it and compute group by group while \
the rest arrives; a controller keeps the catalog and places work.\n\n\
Typical local session:\n  distmind model gen --family resnet152 --variants 2 --scale tiny --out models-out\n  \
distmind controller --settings settings/ &\n  distmind memserver --settings settings/ --listen 127.0.0.1:7778 --capacity 1GiB &\n  \
distmind deploy --settings settings/ models-out/*\n  distmind bench transfer"
)]
struct Cli {
    /// Log level: off, error, warn, info, debug, trace (also DISTMIND_LOG).
    #[arg(long, global = true, env = "DISTMIND_LOG", default_value = "info")]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The main job: start a controller, two memory servers and a GPU server on this machine, deploy
    /// models, run a workload, print the results and stop everything (without a GPU: DistMind and
    /// MPS side by side on an emulated 100 Gbit/s link).
    #[command(alias = "demo")]
    Up(distmind::up::UpArgs),
    /// Simulate a cluster on a virtual clock: the controller's own dispatcher, GPU time from a
    /// profile, max-min fair links, the runtime's cache rules; the client's workload and report.
    /// For scales this machine cannot run as processes. A flag given twice takes its last value.
    #[command(args_override_self = true)]
    Simulate(distmind::simulate::SimulateArgs),
    /// Start (up), inspect (status) or stop (down) the cluster settings/ describes, left running
    /// in the background; pids, logs and state in the run directory.
    #[command(subcommand)]
    Cluster(distmind::cluster::ClusterCommand),
    /// Send inference requests to the controller's dispatcher (closed loop, Poisson or a trace) and
    /// report throughput, latency percentiles, SLO attainment and goodput.
    Client(distmind::loadgen::ClientArgs),
    /// Generate or inspect model packages (manifest.json + weights.safetensors).
    #[command(subcommand)]
    Model(ModelCommand),
    /// Run a memory server: one DRAM arena serving one-sided reads of parameter slices.
    Memserver(MemserverCmd),
    /// Run the controller: catalog, registries, placement policy and the dispatcher that routes client requests.
    Controller(ControllerCmd),
    /// Shard model packages over the memory servers and register them in the catalog.
    Deploy(DeployCmd),
    /// Benchmarks that print a ratio against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Run one package on one .npy input in this process (a numerical check, no cluster).
    Infer(InferCmd),
    /// Training. With --model: SGD steps on a CNN package in this process (the original's
    /// resnet152_train job; --writeback redeploys the trained weights). With a subcommand
    /// (submit, status, stop): distributed jobs, P pipelines x S stages, that the controller
    /// places on the GPUs inference leaves idle.
    Train(distmind::train::TrainCmd),
    /// Training datasets on the memory servers: put a directory of labelled JPEG/PNG/.npy
    /// samples, list, inspect, remove; synth writes a generated labelled JPEG set.
    Dataset(distmind::dataset::DatasetCmd),
    /// NDPipe: fine-tune a classifier head on a dataset's features, which the memory servers
    /// holding its samples extract with a frozen backbone (memserver --backbone) and ship in
    /// R pipelined chunks; --ship-images: the baseline that ships the files instead.
    Ndpipe(distmind::ndpipe::NdpipeCmd),
    /// Run a GPU server: pulls models from the memory servers on demand and serves inference requests.
    Runtime(RuntimeCmd),
    /// Draw PNG figures (grouped bars, lines, stacked areas) from experiment CSVs (`up --csv`).
    #[command(subcommand)]
    Plot(distmind::plot::PlotCommand),
    /// GPU time profiles: measure one on this machine's GPU (every layer of the five
    /// families, CUDA events), or compare two.
    #[command(subcommand)]
    Profile(distmind::profile::ProfileCommand),
}

#[derive(Args)]
struct RuntimeCmd {
    /// Settings directory (cluster.key, config.sh, storage_list.txt for the controller's address).
    #[arg(long, default_value = "settings")]
    settings: PathBuf,
    /// Address for requests (default: 127.0.0.1:GLOBAL_CAHCE_PORT_FOR_SERVER of config.sh).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Devices to serve, one worker each, e.g. 0,1 (default: config.sh's GPUs).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<u32>,
    /// cpu (real numbers), sim (times from a GPU profile, zero outputs) or cuda.
    #[arg(long, default_value = "cpu")]
    executor: distmind_runtime::exec::ExecutorKind,
    /// GPU profile for the sim executor.
    #[arg(long, default_value = distmind_runtime::profile::SHIPPED_ESTIMATED_PATH)]
    profile: PathBuf,
    /// Host cache size, shared by the devices (e.g. 4GiB, 64MiB).
    #[arg(long, default_value = "4GiB", value_parser = parse_size)]
    cache: u64,
    /// Parameter memory per device (default: the host cache size).
    #[arg(long, value_parser = parse_size)]
    device_memory: Option<u64>,
    /// Controller metadata address (default: first line of storage_list.txt).
    #[arg(long)]
    controller: Option<String>,
    /// Address to register with the controller, if not the listening one.
    #[arg(long)]
    advertise: Option<String>,
    /// Limit this server's tcp reads from memory servers to this many Gbit/s (models its NIC; one-sided transports are limited by the real NIC).
    #[arg(long)]
    rate_limit_gbps: Option<f64>,
    /// Most simultaneous connections; more are refused.
    #[arg(long, default_value_t = distmind_runtime::server::CONNECTIONS_MAX_DEFAULT)]
    max_connections: usize,
    /// Requests waiting per device; more are answered Busy.
    #[arg(long, default_value_t = distmind_runtime::server::QUEUE_DEPTH_MAX_DEFAULT)]
    queue_depth: usize,
    /// Prometheus endpoint (GET /metrics, GET /health), e.g. 127.0.0.1:9102; off by default.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Images per training iteration of a background training job (the original used 96).
    #[arg(long, default_value_t = distmind_runtime::server::TRAIN_BATCH_DEFAULT)]
    train_batch: usize,
    /// Data path: tcp, fabric (libfabric fi_read) or verbs (RDMA READ); default: transport.json's
    /// gpu_server section, else tcp.
    #[arg(long)]
    transport: Option<distmind_common::settings::TransportKind>,
    /// libfabric provider of --transport fabric (efa, "verbs;ofi_rxm", "tcp;ofi_rxm").
    #[arg(long)]
    fabric_provider: Option<String>,
    /// RDMA device of --transport verbs (e.g. mlx5_0).
    #[arg(long)]
    verbs_device: Option<String>,
    /// GID index of the RDMA device's port.
    #[arg(long)]
    verbs_gid_index: Option<u8>,
    /// Refuse to start (or to read a memory server) when the chosen data path is unavailable,
    /// instead of reading over tcp.
    #[arg(long)]
    no_tcp_fallback: bool,
    /// Serve as a baseline of the evaluation: mps (whole model set in host memory, up to 12
    /// resident per GPU, whole-model loads), ray (the same, one resident), gpu (one model, no
    /// switching). Run the controller with the same --policy.
    #[arg(long, value_enum)]
    baseline: Option<services::Baseline>,
    /// Most models resident per device, LRU (default: the baseline's, else 12).
    #[arg(long)]
    resident_max: Option<usize>,
    /// Load each model whole (fetch, upload, then compute) instead of pipelining group by group.
    #[arg(long)]
    whole_model: bool,
    /// Keep every model of the catalog in the host cache, fetched as soon as it is deployed
    /// (the host cache must hold them all).
    #[arg(long)]
    preload: bool,
    /// Do not fetch a model the device evicted back into the host cache in the background (by
    /// default a GPU server of one device does, one at a time while no other fetch runs, in
    /// place of a copy of a model the device keeps; servers of several devices and baselines
    /// never do).
    #[arg(long)]
    no_host_refill: bool,
    #[command(flatten)]
    emulate: distmind::emulate::EmulateArgs,
}

#[derive(Args)]
struct InferCmd {
    /// The package directory (DIR/<name>, the one holding manifest.json).
    #[arg(long)]
    model: PathBuf,
    /// Input tensor (.npy: float32 images NCHW or int64 token ids [N, L]).
    #[arg(long)]
    input: PathBuf,
    /// Where the model's last output goes (.npy); other outputs go next to it as <stem>.<name>.npy.
    #[arg(long)]
    output: PathBuf,
    /// cpu (real numbers) or sim (times from a GPU profile, zero outputs).
    #[arg(long, default_value = "cpu")]
    executor: distmind_runtime::exec::ExecutorKind,
    /// GPU profile for the sim executor.
    #[arg(long, default_value = distmind_runtime::profile::SHIPPED_ESTIMATED_PATH)]
    profile: PathBuf,
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Write packages of a model family with its exact parameter shapes and seeded random weights.
    Gen(GenCmd),
    /// Make a package from a PyTorch / Hugging Face checkpoint (.safetensors with the
    /// framework's parameter names), checking every tensor against the architecture.
    Import(ImportCmd),
    /// Print a package's layer and group table.
    Inspect {
        /// The package directory (DIR/<name>).
        package: PathBuf,
    },
}

#[derive(Args)]
struct GenCmd {
    /// resnet152, inception_v3, densenet201, bert_base or gpt2.
    #[arg(long)]
    family: distmind_models::Family,
    /// How many variants (different weights, same shapes) to write.
    #[arg(long, default_value_t = 1)]
    variants: usize,
    /// Output directory; each variant goes to OUT/<name>/.
    #[arg(long)]
    out: PathBuf,
    /// full: the evaluation's exact shapes; tiny: same structure, a few MB at most, for tests.
    /// Requests choose the batch size, and for bert_base and gpt2 the sequence length up to
    /// the position table (full: 512 and 1024 tokens, tiny: 64); the preset's length (full
    /// 512, tiny 16) is the default the profiles time.
    #[arg(long, default_value = "full")]
    scale: distmind_models::Scale,
    /// Seed of the random weights (variant i uses seed + i).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Largest parameter group in bytes (1 = one group per layer; a layer larger than this is a group of its own).
    #[arg(long, default_value_t = distmind_common::limits::GROUP_BYTES_DEFAULT)]
    group_bytes: u64,
    /// How the weights are stored: f32, or f16 / bf16 (the same seeded values rounded to
    /// nearest; half the bytes to store and move, widened to f32 exactly on the device).
    #[arg(long, default_value = "f32")]
    dtype: distmind_models::ParamDtype,
}

#[derive(Args)]
#[command(after_help = "\
Names: torchvision `state_dict` names (resnet152, inception_v3, densenet201) and Hugging Face
`BertModel` / `GPT2Model` names (bert_base, gpt2); a `module.`, `model.`, `bert.` or
`transformer.` prefix is stripped. Buffers inference does not read (num_batches_tracked,
Inception's AuxLogits, attention mask buffers) are left out and listed by `model inspect`.
An all-F16 or all-BF16 checkpoint gives a package stored in that dtype (half the bytes to store
and move; devices widen to f32 exactly on upload); --widen stores f32 instead. A checkpoint
mixing dtypes is stored as f32, every value widened exactly.

Hyper-parameters: for bert_base and gpt2 from Hugging Face's config.json (--config, required);
for the CNNs from the tensor shapes (stage and block counts, widths, classes; BatchNorm eps
at torchvision's defaults), or from a distmind config (--config, a manifest's `config` object).
Smaller and larger variants of each architecture import the same way.

Input shapes: every package serves any batch size; a bert_base or gpt2 package serves any
sequence length up to its position table (--seq-len only sets the default length), and a
CNN package its --image-size.

Example:
  distmind model import --family gpt2 --weights model.safetensors --config config.json \\
      --out models/gpt2-finetuned --seq-len 128")]
struct ImportCmd {
    /// resnet152, inception_v3, densenet201, bert_base or gpt2: the architecture.
    #[arg(long)]
    family: distmind_models::Family,
    /// The checkpoint (.safetensors), e.g. `safetensors.torch.save_file(model.state_dict(), F)`.
    #[arg(long)]
    weights: PathBuf,
    /// Hugging Face config.json (bert_base, gpt2), or a distmind config for the CNNs.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The package directory to create, DIR/<name>; <name> is the model's name.
    #[arg(long)]
    out: PathBuf,
    /// Input batch size of the package [default: the config's, else 8].
    #[arg(long)]
    batch_size: Option<usize>,
    /// CNN input height and width [default: 224; inception_v3 299].
    #[arg(long)]
    image_size: Option<usize>,
    /// Transformer default sequence length: the manifest's input shape and the length GPU
    /// profiles are scaled from; requests may send any length up to the config's positions
    /// [default: min(512, the config's positions)].
    #[arg(long)]
    seq_len: Option<usize>,
    /// Largest parameter group in bytes (as for `model gen`).
    #[arg(long, default_value_t = distmind_common::limits::GROUP_BYTES_DEFAULT)]
    group_bytes: u64,
    /// Leave out tensors that are not part of the base model (a task head such as
    /// `cls.*` or `lm_head.weight`) instead of failing on them.
    #[arg(long)]
    ignore_extra: bool,
    /// Store f32 even when the checkpoint is all f16 or all bf16 (values widened exactly).
    #[arg(long)]
    widen: bool,
}

#[derive(Args)]
struct MemserverCmd {
    /// Settings directory (cluster.key, storage_list.txt for the controller's address).
    #[arg(long, default_value = "settings")]
    settings: PathBuf,
    /// Address to listen on for control and data connections.
    #[arg(long, default_value = "127.0.0.1:7778")]
    listen: SocketAddr,
    /// Arena size, allocated and touched once at start (e.g. 4GiB, 512MiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    capacity: u64,
    /// Controller metadata address to register with (default: first line of storage_list.txt).
    #[arg(long)]
    controller: Option<String>,
    /// Address to register with the controller, if not the listening one.
    #[arg(long)]
    advertise: Option<String>,
    /// Most simultaneous connections; more are refused.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Do not try explicit huge pages for the arena (by default they are tried, with a fallback to normal pages).
    #[arg(long)]
    no_huge_pages: bool,
    /// Prometheus endpoint (GET /metrics, GET /health), e.g. 127.0.0.1:9101; off by default.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Also serve the arena over this libfabric provider (efa, "verbs;ofi_rxm", "tcp;ofi_rxm");
    /// default: transport.json's memserver section; needs a build with --features fabric.
    #[arg(long)]
    fabric_provider: Option<String>,
    /// Also serve the arena over this RDMA device (e.g. mlx5_0); default: transport.json;
    /// needs a build with --features verbs.
    #[arg(long)]
    verbs_device: Option<String>,
    /// GID index of the RDMA device's port (RoCE v2: often 1 or 3); default: transport.json, else 0.
    #[arg(long)]
    verbs_gid_index: Option<u8>,
    /// Threads of the sample service's preprocessing pool (datasets' samples decoded, cropped
    /// or run through a backbone here), apart from the tasks that serve reads.
    #[arg(long, default_value_t = distmind_memserver::server::PREP_WORKERS_DEFAULT)]
    prep_workers: usize,
    /// A CNN model package whose layers before the classifier head this server runs over its
    /// datasets' samples when asked for features (NDPipe); none by default.
    #[arg(long)]
    backbone: Option<PathBuf>,
    /// The side of the square images --backbone takes (the eval transform resizes to it).
    #[arg(long, default_value_t = distmind_runtime::ndpipe::BACKBONE_INPUT_DEFAULT)]
    backbone_input: u32,
    #[command(flatten)]
    emulate: distmind::emulate::EmulateArgs,
}

#[derive(Args)]
struct ControllerCmd {
    #[arg(long, default_value = "settings")]
    settings: PathBuf,
    /// Catalog and registration address (default: the metadata endpoint, first line of storage_list.txt).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// The dispatcher's client port (default: 127.0.0.1:GLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT of config.sh).
    #[arg(long)]
    client_listen: Option<SocketAddr>,
    /// The Open Inference Protocol (KServe v2 / Triton) over HTTP (default:
    /// GLOBAL_LOCAL_IP:GLOBAL_INFERENCE_HTTP_PORT of config.sh; port 0 when --client-listen has port 0).
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// The Open Inference Protocol over gRPC (default: GLOBAL_LOCAL_IP:GLOBAL_INFERENCE_GRPC_PORT;
    /// port 0 when --client-listen has port 0).
    #[arg(long)]
    grpc_listen: Option<SocketAddr>,
    /// Serve the catalog and registries only: no dispatcher, no client port.
    #[arg(long)]
    no_dispatcher: bool,
    /// Where the dispatcher's tasks (routing, its links to the GPU servers, the client
    /// connections) run: own (a thread of their own), pool (the controller's thread pool), or
    /// auto (own on hosts of at most 4 cores, pool on larger ones).
    #[arg(long, default_value = "auto")]
    dispatcher_thread: distmind_controller::dispatch::DispatchThread,
    /// Prometheus endpoint (GET /metrics, GET /health), e.g. 127.0.0.1:9100; off by default.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// distmind (the original's Zipf reassignment, least-outstanding routing), slo (deadline-aware
    /// admission, EDF queues, demand-driven placement), or a baseline of the evaluation: mps (reads
    /// mps_controller.json when present), ray, gpu (one model) — run the GPU servers with the same
    /// `--baseline`. Default: controller.json's `policy`.
    #[arg(long)]
    policy: Option<String>,
    /// Balancer of the distmind policy: lor (least outstanding, cache-aware) or lfu.
    #[arg(long)]
    balancer: Option<String>,
    /// Training job when training is on (a CNN model in the catalog, like the original's resnet152_train).
    #[arg(long)]
    train_model: Option<String>,
    /// Share GPUs with training (overrides controller.json's use_train).
    #[arg(long)]
    use_train: Option<bool>,
    /// GPUs doing inference in each second of the controller's clock (emulated seconds under
    /// --emulate-link), comma-separated, e.g. 2,1,0,1; the rest train. Overrides controller.json's
    /// inference_workload_s; an entry above the GPUs registered counts as all of them.
    #[arg(long)]
    inference_workload: Option<services::InferenceWorkload>,
    /// Seconds between the distmind policy's reassignments (overrides rescheduling_period_s).
    #[arg(long)]
    period: Option<f64>,
    /// Zipf exponent of the distmind policy's model draws (overrides zipf_s).
    #[arg(long)]
    zipf: Option<f64>,
    /// Seed of the policy's random draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    emulate: distmind::emulate::EmulateArgs,
}

#[derive(Args)]
struct DeployCmd {
    #[arg(long, default_value = "settings")]
    settings: PathBuf,
    /// hybrid (every group over all shards), per-app, horizontal or vertical (default: controller.json's strategy).
    #[arg(long)]
    strategy: Option<distmind_controller::placement::Strategy>,
    /// Copies of every slice on distinct memory servers (default: controller.json's replication).
    #[arg(long)]
    replication: Option<usize>,
    /// Memory servers per model; 0 = min(#memservers, 4) (default: controller.json's shard_width).
    #[arg(long)]
    shard_width: Option<usize>,
    /// Controller metadata address (default: first line of storage_list.txt).
    #[arg(long)]
    controller: Option<String>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Package directories (DIR/<name>) to deploy.
    #[arg(required = true)]
    packages: Vec<PathBuf>,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// GB/s pulling a model from 1, 2 and 4 local memory servers into host memory, vs a plain socket copy loop.
    Transfer(bench::transfer::TransferArgs),
    /// First-request latency of a model on no device: pipelined vs load-then-run, per family.
    Coldstart(bench::coldstart::ColdstartArgs),
    /// Controller routing decisions per second on one core, and the latency the dispatcher adds per request.
    Dispatch(bench::dispatch::DispatchArgs),
    /// Time to make a model runnable from bytes in host memory, next to PyTorch loading a checkpoint.
    Load(bench::load::LoadArgs),
    /// Capacity at SLO: the highest Poisson rate with 99% within a 100 ms SLO, mps vs distmind (slo).
    Capacity(bench::capacity::CapacityArgs),
    /// This machine's loopback TCP rate, and the bucket rate emulated links would hold each host to.
    Loopback(distmind::emulate::LoopbackArgs),
}

fn parse_size(s: &str) -> Result<u64, String> {
    distmind_memserver::parse_size(s).map_err(|e| e.to_string())
}

fn main() {
    // Before any thread starts: it sets an environment variable.
    distmind_runtime::exec::cpu::settle_thread_count();
    let cli = Cli::parse();
    let level = match logging::parse_level(&cli.log_level) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = logging::init(level) {
        eprintln!("error: cannot start logging: {e:#}");
        std::process::exit(1);
    }
    if let Err(e) = run(cli.command) {
        // Printed, not logged: the reason must show even with logging off.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Model(ModelCommand::Gen(g)) => {
            let opts = distmind_models::GenOptions {
                family: g.family,
                variants: g.variants,
                out_dir: g.out,
                scale: g.scale,
                seed: g.seed,
                group_bytes: g.group_bytes,
                dtype: g.dtype,
            };
            for dir in distmind_models::generate(&opts)? {
                println!("{}", dir.display());
            }
            Ok(())
        }
        Command::Model(ModelCommand::Import(c)) => {
            let m = distmind_models::import(&distmind_models::ImportOptions {
                family: c.family,
                weights: c.weights.clone(),
                config: c.config,
                out: c.out.clone(),
                batch_size: c.batch_size,
                image_size: c.image_size,
                seq_len: c.seq_len,
                group_bytes: c.group_bytes,
                ignore_extra: c.ignore_extra,
                widen: c.widen,
            })?;
            let origin = m.origin.as_ref();
            let widened = if origin.is_some_and(|o| o.converted_to_f32) {
                let from = origin.map_or(String::new(), |o| o.checkpoint_dtypes.join(" + "));
                let why = if c.widen { "--widen" } else { "mixed dtypes" };
                format!(" (from {from}, widened exactly: {why})")
            } else {
                String::new()
            };
            eprintln!(
                "imported {} {} params ({} values) into {} groups, stored as {}{widened}; \
                 {} checkpoint tensors left out",
                m.family,
                m.params.len(),
                m.params.iter().map(|p| p.numel()).sum::<u64>(),
                m.groups.len(),
                m.param_dtype,
                origin.map_or(0, |o| o.dropped.len())
            );
            println!("{}", c.out.display());
            Ok(())
        }
        Command::Model(ModelCommand::Inspect { package }) => {
            let pkg = distmind_models::Package::open(&package)
                .with_context(|| format!("cannot open package {}", package.display()))?;
            print!("{}", distmind_models::inspect(&pkg));
            Ok(())
        }
        Command::Memserver(m) => services::run_memserver(services::MemserverArgs {
            settings: &m.settings,
            listen: m.listen,
            capacity_bytes: m.capacity,
            controller: m.controller,
            advertise: m.advertise,
            max_connections: m.max_connections,
            huge_pages: !m.no_huge_pages,
            metrics: m.metrics,
            fabric_provider: m.fabric_provider,
            verbs_device: m.verbs_device,
            verbs_gid_index: m.verbs_gid_index,
            prep_workers: m.prep_workers,
            backbone: m.backbone,
            backbone_input: m.backbone_input,
            emulate: m.emulate,
        }),
        Command::Controller(c) => services::run_controller(
            services::ControllerArgs {
                settings: &c.settings,
                listen: c.listen,
                client_listen: c.client_listen,
                http_listen: c.http_listen,
                grpc_listen: c.grpc_listen,
                no_dispatcher: c.no_dispatcher,
                dispatch_thread: c.dispatcher_thread,
                metrics: c.metrics,
                policy: c.policy,
                balancer: c.balancer,
                train_model: c.train_model,
                use_train: c.use_train,
                period_s: c.period,
                zipf_s: c.zipf,
                seed: c.seed,
                emulate: c.emulate,
            },
            c.inference_workload,
        ),
        Command::Deploy(d) => {
            let settings = services::load_settings(&d.settings)?;
            let target = deploy::Target {
                controller: d
                    .controller
                    .unwrap_or_else(|| settings.metadata_endpoint().to_string()),
                key: services::cluster_key(&settings),
            };
            let opts = deploy::Options::from_settings(
                &settings,
                d.strategy,
                d.replication,
                d.shard_width,
                !d.quiet,
            );
            for dir in &d.packages {
                let pkg = distmind_models::Package::open(dir)
                    .with_context(|| format!("cannot open package {}", dir.display()))?;
                let out = deploy::deploy_package(&target, &pkg, &opts)?;
                println!("{}", out.summary());
            }
            Ok(())
        }
        Command::Up(a) => distmind::up::run(&a),
        Command::Simulate(a) => distmind::simulate::run(&a).map(|_| ()),
        Command::Cluster(c) => distmind::cluster::run(&c),
        Command::Client(a) => distmind::loadgen::run(&a).map(|_| ()),
        Command::Bench(BenchCommand::Transfer(a)) => bench::transfer::run(&a),
        Command::Bench(BenchCommand::Dispatch(a)) => bench::dispatch::run(&a),
        Command::Bench(BenchCommand::Loopback(a)) => distmind::emulate::run_loopback(&a),
        Command::Bench(BenchCommand::Coldstart(a)) => bench::coldstart::run(&a),
        Command::Bench(BenchCommand::Load(a)) => bench::load::run(&a),
        Command::Bench(BenchCommand::Capacity(a)) => bench::capacity::run(&a),
        Command::Runtime(r) => {
            let settings = services::load_settings(&r.settings)?;
            let emulated = r.emulate.resolve(&settings)?;
            // On the first device named (every other device gets its own
            // executor when the runtime binds).
            let exec = services::executor_on(
                r.executor,
                &r.profile,
                distmind_common::emulate::dilation(emulated.as_ref()),
                r.devices.first().copied().unwrap_or(0),
            )?;
            services::run_runtime(services::RuntimeArgs {
                settings: &r.settings,
                listen: r.listen,
                devices: r.devices,
                executor: std::sync::Arc::from(exec),
                cache_bytes: r.cache,
                device_bytes: r.device_memory,
                controller: r.controller,
                advertise: r.advertise,
                rate_limit_gbps: r.rate_limit_gbps,
                max_connections: r.max_connections,
                queue_depth: r.queue_depth,
                metrics: r.metrics,
                train_batch: r.train_batch,
                transport: r.transport,
                fabric_provider: r.fabric_provider,
                verbs_device: r.verbs_device,
                verbs_gid_index: r.verbs_gid_index,
                no_tcp_fallback: r.no_tcp_fallback,
                baseline: r.baseline,
                resident_max: r.resident_max,
                whole_model: r.whole_model,
                preload: r.preload,
                no_host_refill: r.no_host_refill,
                emulate: emulated,
            })
        }
        Command::Train(t) => distmind::train::run_cmd(&t),
        Command::Dataset(d) => distmind::dataset::run(&d),
        Command::Ndpipe(n) => distmind::ndpipe::run_cmd(&n),
        Command::Plot(p) => distmind::plot::run(&p),
        Command::Profile(p) => distmind::profile::run(&p),
        Command::Infer(i) => {
            let exec = services::executor(i.executor, &i.profile, 1.0)?;
            let report =
                distmind_runtime::infer::infer_files(&i.model, &i.input, &i.output, exec.as_ref())?;
            for o in &report.outputs {
                println!("{} {:?} -> {}", o.name, o.shape, o.path.display());
            }
            println!(
                "{} on {} in {:.3}s",
                report.model,
                exec.describe(),
                report.elapsed.as_secs_f64()
            );
            Ok(())
        }
    }
}
