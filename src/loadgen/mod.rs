//! `distmind client`: the load generator. It sends inference requests to
//! the controller's dispatcher (its client port) and reports what came back.
//!
//! * `closed` (the original's client): N threads, each with its own
//!   connection, send one request, wait for the reply, repeat.
//! * `poisson`: open loop at `--rate` requests/s. Arrivals are exponential;
//!   each of `--connections` connections carries an independent Poisson
//!   stream at rate/connections (their superposition is Poisson at the
//!   rate), pipelined: a sender thread sends at the scheduled instant
//!   whatever the replies, a receiver thread reads replies in any order. At
//!   most [`OUTSTANDING_MAX`] requests wait at once; one due beyond that is
//!   not sent and is counted as `dropped_by_client`.
//! * `trace`: like poisson, with times, models and optional SLOs from a
//!   CSV file (`time_s,model[,slo_ms]`).
//!
//! Models are drawn Zipf(s) over the model list (rank 0 = the first model).
//! Each model's input is built once from its manifest (images: float32 NCHW
//! in U(-1, 1); token ids: int64 in [0, vocab)) and reused. Latency is
//! measured by the client, from the send to the reply.

pub mod drive;
pub mod parse;
pub mod stats;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::ErrorCode;
use distmind_controller::ControllerClient;
use distmind_models::{Dtype, Manifest, ModelConfig};
use distmind_runtime::client::RuntimeClient;
use distmind_runtime::exec::HostTensor;
use rand::{Rng, SeedableRng};

pub use drive::{ModelDraw, OUTSTANDING_MAX};
pub use parse::{load_trace, parse_duration, parse_trace, TraceRow, TRACE_ROWS_MAX};
pub use stats::{
    attainment_goodput, percentile, LatencySummary, ModelReport, Report, SloSummary,
    LATENCIES_STORED_MAX,
};

/// Most closed-loop threads.
pub const CONCURRENCY_MAX: usize = 1024;
/// Most open-loop connections.
pub const CONNECTIONS_MAX: usize = 64;
/// Highest open-loop rate (requests/s).
pub const RATE_MAX: f64 = 1e6;
/// Largest batch (the input must also fit one frame).
pub const BATCH_MAX: usize = 1024;
/// Default duration of closed and poisson runs.
pub const DURATION_DEFAULT: Duration = Duration::from_secs(60);

/// How requests are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// N threads, one request outstanding each (the original's client).
    Closed,
    /// Open loop: exponential inter-arrival times at --rate.
    Poisson,
    /// Open loop: requests at the times of a CSV file (--trace).
    Trace,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Closed => "closed",
            Mode::Poisson => "poisson",
            Mode::Trace => "trace",
        }
    }
}

/// `distmind client` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct ClientArgs {
    /// Settings directory (cluster.key, config.sh, storage_list.txt, controller.json).
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// The dispatcher's client address (default: GLOBAL_LOAD_BALANCER_IP:GLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT of config.sh).
    #[arg(long)]
    pub addr: Option<String>,
    /// Controller metadata address, for the model list and manifests (default: first line of storage_list.txt).
    #[arg(long)]
    pub controller: Option<String>,
    /// closed (default; trace when --trace is given), poisson or trace.
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// Requests per second (poisson).
    #[arg(long)]
    pub rate: Option<f64>,
    /// How long to send, e.g. 60s, 500ms, 2m (default 60s; trace: the whole trace).
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Closed-loop threads, one connection each (default: WORLD_SIZE of config.sh).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Closed loop: requests per thread; 0 = until --duration (default: GLOBAL_NUM_REQUEST of config.sh).
    #[arg(long)]
    pub requests: Option<u64>,
    /// Open loop: connections the requests are spread over.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Latency SLO of every request in ms, sent as its deadline (default: the dispatcher's per-family slo_ms of controller.json).
    #[arg(long)]
    pub slo_ms: Option<u64>,
    /// Zipf exponent of model popularity; 0 = uniform (default: zipf_s of controller.json).
    #[arg(long)]
    pub zipf: Option<f64>,
    /// Models to request, most popular first (default: every model in the catalog, by name).
    #[arg(long, value_delimiter = ',')]
    pub models: Vec<String>,
    /// CSV trace: header `time_s,model[,slo_ms]`, then one request per line in time order.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Seed of model draws, arrival times and inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Batch size of every request.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Give up on a reply after this long (the connection is then counted lost).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Emulated link: --slo-ms, --duration, --timeout and trace times are emulated time (x K on
    /// the real clock), --rate is per emulated second, and the report is in emulated time.
    #[command(flatten)]
    pub emulate: crate::emulate::EmulateArgs,
}

impl ClientArgs {
    /// The flags' defaults with the given settings directory (for callers
    /// that run the load generator in-process).
    pub fn with_settings(settings: PathBuf) -> ClientArgs {
        ClientArgs {
            settings,
            addr: None,
            controller: None,
            mode: None,
            rate: None,
            duration: None,
            concurrency: None,
            requests: None,
            connections: 4,
            slo_ms: None,
            zipf: None,
            models: Vec::new(),
            trace: None,
            seed: 0,
            json: None,
            batch: 1,
            timeout: Duration::from_secs(30),
            emulate: crate::emulate::EmulateArgs::default(),
        }
    }
}

/// Runs the load generator, prints the report and returns it. Ctrl-C stops
/// sending early; the report then covers what was sent.
pub fn run(args: &ClientArgs) -> anyhow::Result<Report> {
    run_until(args, interrupt_flag())
}

/// [`run`] that stops sending when `stop` becomes true.
pub fn run_until(args: &ClientArgs, stop: &AtomicBool) -> anyhow::Result<Report> {
    let settings = crate::services::load_settings(&args.settings)?;
    let key = crate::services::cluster_key(&settings);
    let addr = args.addr.clone().unwrap_or_else(|| {
        format!(
            "{}:{}",
            settings.config.load_balancer_ip, settings.config.load_balancer_port_for_client
        )
    });
    let controller = args
        .controller
        .clone()
        .unwrap_or_else(|| settings.metadata_endpoint().to_string());
    let mode = args.mode.unwrap_or(if args.trace.is_some() {
        Mode::Trace
    } else {
        Mode::Closed
    });
    check_flags(args, mode)?;
    // On an emulated link every stated time runs K times longer on the real
    // clock and every stated rate K times slower; the report is converted back.
    let emulated = args.emulate.resolve(&settings)?;
    let k = distmind_common::emulate::dilation(emulated.as_ref());
    let dilate_ms = |ms: u64| (ms as f64 * k).round() as u64;
    let slo_ms_real = args.slo_ms.map(dilate_ms);
    let timeout = args.timeout.mul_f64(k);
    if let Some(e) = &emulated {
        println!("client: {e}: stated times x K on the real clock, the report in emulated time");
    }
    let trace = match (&args.trace, mode) {
        (Some(path), Mode::Trace) => Some(load_trace(path)?),
        _ => None,
    };

    // The model list and one input per model, from the catalog.
    let mut catalog = ControllerClient::connect(&controller, &key, timeout).with_context(|| {
        format!("cannot reach the controller at {controller} for the model list")
    })?;
    let models: Vec<String> = match &trace {
        Some(rows) => {
            let mut names: Vec<String> = rows.iter().map(|r| r.model.clone()).collect();
            names.sort();
            names.dedup();
            names
        }
        None if !args.models.is_empty() => {
            let mut seen = std::collections::BTreeSet::new();
            for m in &args.models {
                if !seen.insert(m.as_str()) {
                    bail!("--models names {m} twice");
                }
            }
            args.models.clone()
        }
        None => catalog
            .list_models()
            .with_context(|| format!("listing the models of the catalog at {controller}"))?
            .into_iter()
            .filter(|m| m.family != distmind_common::samples::DATASET_FAMILY)
            .map(|m| m.name)
            .collect(),
    };
    if models.is_empty() {
        bail!(
            "no models to request: the catalog at {controller} is empty (deploy some with `distmind deploy`) and no trace names any"
        );
    }
    let mut inputs = Vec::with_capacity(models.len());
    for (i, name) in models.iter().enumerate() {
        let entry = catalog.get_model(name).map_err(|e| {
            let hint = match (&trace, e.code()) {
                (Some(rows), Some(ErrorCode::UnknownModel)) => {
                    let row = rows
                        .iter()
                        .find(|r| &r.model == name)
                        .expect("named by the trace");
                    format!(
                        " ({}:{} names it)",
                        args.trace.as_ref().expect("trace mode").display(),
                        row.line
                    )
                }
                _ => String::new(),
            };
            anyhow::Error::new(e).context(format!("model {name}{hint}: not usable"))
        })?;
        let manifest: Manifest = serde_json::from_value(entry.manifest)
            .with_context(|| format!("model {name}: the catalog's manifest does not parse"))?;
        let input = input_for(&manifest, args.batch, args.seed.wrapping_add(i as u64))?;
        inputs.push(Arc::new(input));
    }
    drop(catalog);

    let zipf_s = args.zipf.unwrap_or(settings.controller.zipf_s);
    let draw = std::sync::Arc::new(
        ModelDraw::new(models.len(), zipf_s)
            .with_context(|| format!("bad Zipf exponent {zipf_s}"))?,
    );
    let stored = AtomicUsize::new(0);
    let common = drive::Common {
        addr: &addr,
        key: &key,
        timeout,
        inputs: &inputs,
        models: &models,
        stop,
        stored: &stored,
    };
    let connect = |n: usize| -> anyhow::Result<Vec<RuntimeClient>> {
        (0..n)
            .map(|_| {
                RuntimeClient::connect(&addr, &key, timeout).with_context(|| {
                    format!("cannot reach the dispatcher at {addr} (the controller's client port; is the controller running?)")
                })
            })
            .collect()
    };
    let duration = args.duration.or(match mode {
        Mode::Trace => None,
        _ => Some(DURATION_DEFAULT),
    });
    let slo_note = args
        .slo_ms
        .map(|s| format!("SLO {s} ms"))
        .unwrap_or_else(|| "SLO from the dispatcher".into());
    let started;
    let (collectors, connections) = match mode {
        Mode::Closed => {
            let threads = args
                .concurrency
                .unwrap_or(settings.config.world_size as usize);
            let requests = args.requests.unwrap_or(settings.config.num_request);
            let clients = connect(threads)?;
            let d = duration.unwrap_or(DURATION_DEFAULT).mul_f64(k);
            println!(
                "client: closed loop, {threads} thread(s) x {} against {addr}, {} models (zipf {zipf_s}), {slo_note}, for at most {:.1} s",
                if requests == 0 {
                    "unlimited requests".to_string()
                } else {
                    format!("{requests} requests")
                },
                models.len(),
                d.as_secs_f64()
            );
            started = Instant::now();
            let c = drive::closed(&common, clients, requests, d, slo_ms_real, &draw, args.seed);
            (c, threads)
        }
        Mode::Poisson => {
            let rate = args.rate.expect("checked") / k;
            let n = args.connections;
            let d = duration.unwrap_or(DURATION_DEFAULT).as_secs_f64() * k;
            let arrivals = (0..n)
                .map(|i| {
                    drive::Arrivals::poisson(
                        rate / n as f64,
                        d,
                        draw.clone(),
                        slo_ms_real,
                        drive::thread_rng(args.seed, i),
                    )
                })
                .collect();
            let clients = connect(n)?;
            println!(
                "client: poisson at {rate} req/s over {n} connection(s) against {addr}, {} models (zipf {zipf_s}), {slo_note}, for {d:.1} s",
                models.len()
            );
            started = Instant::now();
            (drive::open(&common, clients, arrivals), n)
        }
        Mode::Trace => {
            let rows = trace.as_ref().expect("trace mode");
            let n = args.connections;
            let limit_s = duration.map(|d| d.as_secs_f64());
            let per_conn = drive::trace_arrivals(rows, &models, n, limit_s, k, slo_ms_real);
            let total: usize = per_conn.iter().map(Vec::len).sum();
            let clients = connect(n)?;
            println!(
                "client: trace {} ({total} requests over {:.1} s, {} models) over {n} connection(s) against {addr}",
                args.trace.as_ref().expect("trace mode").display(),
                rows.last().map(|r| r.time_s).unwrap_or(0.0).min(limit_s.unwrap_or(f64::MAX)),
                models.len()
            );
            let arrivals = per_conn
                .into_iter()
                .map(|d| drive::Arrivals::Fixed(d.into_iter()))
                .collect();
            started = Instant::now();
            (drive::open(&common, clients, arrivals), n)
        }
    };
    let elapsed_s = started.elapsed().as_secs_f64() / k;
    let mut all = stats::Collector::new(models.len());
    for c in collectors {
        all.merge(c);
    }
    all.undilate(k);
    let mut report = Report::build(
        stats::RunInfo {
            mode: mode.as_str(),
            target: &addr,
            connections,
            rate_rps: (mode == Mode::Poisson).then_some(args.rate).flatten(),
            duration_s: duration.map(|d| d.as_secs_f64()),
            elapsed_s,
            batch: args.batch,
            zipf_s: (mode != Mode::Trace).then_some(zipf_s),
            slo_ms: args.slo_ms,
            seed: args.seed,
            interrupted: stop.load(Ordering::Relaxed),
            model_names: &models,
        },
        all,
    );
    report.emulated_link = emulated.as_ref().map(|e| e.label());
    print!("{}", report.render());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).context("serialising the report")?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write the report to {}", path.display()))?;
    }
    Ok(report)
}

/// Flags that contradict the mode are errors, not silently ignored.
fn check_flags(args: &ClientArgs, mode: Mode) -> anyhow::Result<()> {
    match (mode, &args.trace) {
        (Mode::Trace, None) => bail!("--mode trace needs --trace FILE"),
        (Mode::Closed | Mode::Poisson, Some(_)) => {
            bail!("--trace is for --mode trace (leave --mode out to use it)")
        }
        _ => {}
    }
    match (mode, args.rate) {
        (Mode::Poisson, None) => bail!("--mode poisson needs --rate (requests per second)"),
        (Mode::Poisson, Some(r)) if !(r.is_finite() && r > 0.0 && r <= RATE_MAX) => {
            bail!("--rate must be more than 0 and at most {RATE_MAX} requests/s, got {r}")
        }
        (Mode::Closed | Mode::Trace, Some(_)) => bail!("--rate is for --mode poisson"),
        _ => {}
    }
    if mode != Mode::Closed && (args.concurrency.is_some() || args.requests.is_some()) {
        bail!(
            "--concurrency and --requests are for --mode closed; the open loop uses --connections"
        );
    }
    if mode == Mode::Trace && (!args.models.is_empty() || args.zipf.is_some()) {
        bail!("--models and --zipf do not apply to --mode trace: the trace names the models");
    }
    if let Some(n) = args.concurrency {
        if !(1..=CONCURRENCY_MAX).contains(&n) {
            bail!("--concurrency must be 1..={CONCURRENCY_MAX}, got {n}");
        }
    }
    if !(1..=CONNECTIONS_MAX).contains(&args.connections) {
        bail!(
            "--connections must be 1..={CONNECTIONS_MAX}, got {}",
            args.connections
        );
    }
    if !(1..=BATCH_MAX).contains(&args.batch) {
        bail!("--batch must be 1..={BATCH_MAX}, got {}", args.batch);
    }
    if args.slo_ms == Some(0) {
        bail!("--slo-ms must be more than 0");
    }
    Ok(())
}

/// The model's input with batch `batch`, seeded: images U(-1, 1), token
/// ids uniform in [0, vocab).
pub fn input_for(m: &Manifest, batch: usize, seed: u64) -> anyhow::Result<HostTensor> {
    let [spec] = m.inputs.as_slice() else {
        bail!(
            "model {} takes {} inputs; the load generator sends one",
            m.name,
            m.inputs.len()
        );
    };
    let mut shape = spec.shape.clone();
    if shape.is_empty() {
        bail!(
            "model {}: input {} has no batch dimension",
            m.name,
            spec.name
        );
    }
    shape[0] = batch;
    let n: usize = shape.iter().product();
    let bytes = n as u64 * spec.dtype.size_bytes() + 128;
    if bytes > CONTROL_FRAME_BYTES_MAX as u64 {
        bail!(
            "model {}: a batch of {batch} is {bytes} bytes, more than a frame's {CONTROL_FRAME_BYTES_MAX}: use a smaller --batch",
            m.name
        );
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    Ok(match spec.dtype {
        Dtype::F32 => HostTensor::f32(shape, (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()),
        Dtype::I64 => {
            let vocab = match &m.config {
                ModelConfig::BertBase(c) => c.vocab_size,
                ModelConfig::Gpt2(c) => c.vocab_size,
                _ => 2,
            }
            .max(1) as i64;
            HostTensor::i64(shape, (0..n).map(|_| rng.gen_range(0..vocab)).collect())
        }
    })
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static WATCH_SIGNALS: Once = Once::new();

/// A flag that becomes true on the first Ctrl-C (SIGINT) or SIGTERM; a
/// second one exits the process at once (status 130). The handler is
/// installed on the first call.
pub fn interrupt_flag() -> &'static AtomicBool {
    WATCH_SIGNALS.call_once(|| {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let spawned = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || watch_signals(ready_tx));
        match spawned {
            Ok(_) => match ready_rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => log::warn!("Ctrl-C will not stop cleanly: {e}"),
                Err(_) => log::warn!("Ctrl-C will not stop cleanly: no signal handler"),
            },
            Err(e) => log::warn!("Ctrl-C will not stop cleanly: {e}"),
        }
    });
    &INTERRUPTED
}

fn on_signal(count: u32) {
    if count == 1 {
        INTERRUPTED.store(true, Ordering::SeqCst);
        eprintln!("\ninterrupted: stopping (press Ctrl-C again to exit at once)");
    } else {
        eprintln!("interrupted again: exiting now");
        std::process::exit(130);
    }
}

fn watch_signals(ready: std::sync::mpsc::Sender<Result<(), String>>) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot start the signal watcher: {e}")));
            return;
        }
    };
    rt.block_on(async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let (mut int, mut term) = match (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) {
                (Ok(i), Ok(t)) => (i, t),
                (Err(e), _) | (_, Err(e)) => {
                    let _ = ready.send(Err(format!("cannot watch signals: {e}")));
                    return;
                }
            };
            let _ = ready.send(Ok(()));
            let mut count = 0;
            loop {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
                count += 1;
                on_signal(count);
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ready.send(Ok(()));
            let mut count = 0;
            while tokio::signal::ctrl_c().await.is_ok() {
                count += 1;
                on_signal(count);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_models::{Family, Scale};

    fn manifest(family: Family) -> Manifest {
        let dir = std::env::temp_dir().join(format!(
            "distmind-loadgen-test-{}-{family}",
            std::process::id()
        ));
        let opts = distmind_models::GenOptions {
            scale: Scale::Tiny,
            ..distmind_models::GenOptions::new(family, &dir)
        };
        let pkg = distmind_models::generate(&opts).unwrap().remove(0);
        let m = distmind_models::Package::open(&pkg).unwrap().manifest;
        let _ = std::fs::remove_dir_all(&dir);
        m
    }

    #[test]
    fn inputs_follow_the_manifest() {
        let m = manifest(Family::Resnet152);
        let t = input_for(&m, 3, 1).unwrap();
        assert_eq!(t.dtype_name(), "f32");
        assert_eq!(t.shape[0], 3);
        assert_eq!(t.shape[1..], m.inputs[0].shape[1..]);

        let m = manifest(Family::Gpt2);
        let t = input_for(&m, 2, 1).unwrap();
        assert_eq!(t.dtype_name(), "i64");
        assert_eq!(t.shape[0], 2);
        let vocab = match &m.config {
            ModelConfig::Gpt2(c) => c.vocab_size as i64,
            _ => unreachable!(),
        };
        match &t.data {
            distmind_runtime::exec::TensorData::I64(ids) => {
                assert!(ids.iter().all(|&i| (0..vocab).contains(&i)))
            }
            _ => unreachable!(),
        }
        // Same seed, same input.
        assert_eq!(input_for(&m, 2, 1).unwrap(), t);
        assert!(input_for(&m, 1 << 30, 1).is_err());
    }

    #[test]
    fn zipf_rank_zero_is_the_first_model() {
        let draw = ModelDraw::new(5, 3.0).unwrap();
        let mut rng = drive::thread_rng(7, 0);
        let mut counts = [0u32; 5];
        for _ in 0..10_000 {
            counts[draw.pick(&mut rng)] += 1;
        }
        // 1 / (1 + 2^-3 + 3^-3 + 4^-3 + 5^-3) ~ 83% on rank 0.
        assert!(counts[0] > 8000, "{counts:?}");
        assert!(counts.windows(2).all(|w| w[0] >= w[1]), "{counts:?}");
        // Uniform at s = 0, and the same seed draws the same sequence.
        let uniform = ModelDraw::new(4, 0.0).unwrap();
        let seq = |seed| {
            let mut rng = drive::thread_rng(seed, 1);
            (0..50).map(|_| uniform.pick(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(seq(3), seq(3));
        assert!(seq(3).iter().all(|&k| k < 4));
        assert!(ModelDraw::new(0, 1.0).is_err());
    }

    #[test]
    fn poisson_arrivals_have_the_rate_and_stop_at_the_duration() {
        let draw = std::sync::Arc::new(ModelDraw::new(3, 0.9).unwrap());
        let arrivals =
            drive::Arrivals::poisson(200.0, 50.0, draw, Some(7), drive::thread_rng(1, 0));
        let times: Vec<f64> = arrivals.map(|d| d.at_s).collect();
        // 10,000 expected; 5 standard deviations is 500.
        assert!(
            (times.len() as f64 - 10_000.0).abs() < 500.0,
            "{}",
            times.len()
        );
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        assert!(*times.last().unwrap() < 50.0);
    }

    #[test]
    fn contradicting_flags_are_refused() {
        let mut a = ClientArgs::with_settings("settings".into());
        assert!(check_flags(&a, Mode::Closed).is_ok());
        assert!(format!("{:#}", check_flags(&a, Mode::Poisson).unwrap_err()).contains("--rate"));
        a.rate = Some(10.0);
        assert!(check_flags(&a, Mode::Poisson).is_ok());
        assert!(check_flags(&a, Mode::Closed).is_err());
        a.rate = Some(-1.0);
        assert!(check_flags(&a, Mode::Poisson).is_err());
        let mut a = ClientArgs::with_settings("settings".into());
        assert!(check_flags(&a, Mode::Trace).is_err());
        a.trace = Some("t.csv".into());
        assert!(check_flags(&a, Mode::Trace).is_ok());
        a.zipf = Some(1.0);
        assert!(check_flags(&a, Mode::Trace).is_err());
        let mut a = ClientArgs::with_settings("settings".into());
        a.batch = 0;
        assert!(check_flags(&a, Mode::Closed).is_err());
    }
}
