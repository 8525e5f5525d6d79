//! The runtime server in-process: a controller and a memory server on
//! 127.0.0.1 ephemeral ports (real sockets, real handshakes), tiny packages
//! deployed one slice per group, and a `RuntimeServer` with the cpu
//! executor. Covers placement on a named device, the resident list in
//! replies, prefetch (host cache and device), background training that
//! yields to inference at iteration boundaries, the heartbeat snapshot and
//! the Prometheus metrics.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{ErrorCode, ServePath};
use distmind_controller::ControllerClient;
use distmind_models::{generate, Family, GenOptions, Package, Scale};
use distmind_runtime::client::{InferOptions, RuntimeClient};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::sim::SimExecutor;
use distmind_runtime::exec::{Executor, HostTensor};
use distmind_runtime::profile::{Profile, SHIPPED_V100_ESTIMATED_PATH};
use distmind_runtime::server::{RuntimeConfig, RuntimeMonitor, RuntimeServer};

const TIMEOUT: Duration = Duration::from_secs(60);
const GROUP_BYTES: u64 = 16 << 10;

fn key() -> ClusterKey {
    ClusterKey::from_secret(b"runtime server tests")
}

fn tiny_package(dir: &Path, family: Family) -> Package {
    let opts = GenOptions {
        scale: Scale::Tiny,
        group_bytes: GROUP_BYTES,
        ..GenOptions::new(family, dir)
    };
    Package::open(&generate(&opts).expect("generate")[0]).expect("open")
}

/// A controller, one memory server and one runtime, all in this process.
struct Cluster {
    runtime: String,
    metrics: Option<std::net::SocketAddr>,
    monitor: RuntimeMonitor,
    packages: Vec<Package>,
    _dir: tempfile::TempDir,
    /// Last: dropped after `stop` told the servers to finish.
    plane: common::ControlPlane,
}

impl Cluster {
    /// Generates and deploys one tiny package per family, then starts a
    /// runtime on `devices` with `train_batch` images per iteration (cpu
    /// executor).
    fn start(families: &[Family], devices: Vec<u32>, train_batch: usize) -> Cluster {
        Cluster::start_with(families, devices, train_batch, Arc::new(CpuExecutor::new()))
    }

    /// As [`Cluster::start`], on `executor`.
    fn start_with(
        families: &[Family],
        devices: Vec<u32>,
        train_batch: usize,
        executor: Arc<dyn Executor>,
    ) -> Cluster {
        Cluster::start_config(
            |dir| families.iter().map(|&f| tiny_package(dir, f)).collect(),
            executor,
            |config, _| {
                config.devices = devices;
                config.train_batch = train_batch;
            },
        )
    }

    /// Deploys the packages `make` writes into a scratch directory, then
    /// starts a runtime on `executor` with the test's configuration as
    /// `tweak` leaves it (told the packages).
    fn start_config(
        make: impl FnOnce(&Path) -> Vec<Package>,
        executor: Arc<dyn Executor>,
        tweak: impl FnOnce(&mut RuntimeConfig, &[Package]),
    ) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let packages = make(dir.path());
        let plane = common::ControlPlane::start(&key(), TIMEOUT);
        let mut cluster_controller = plane.controller_client(&key(), TIMEOUT);
        for pkg in &packages {
            deploy(&mut cluster_controller, &plane.memserver, pkg);
        }
        let mut config = RuntimeConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            key(),
            plane.controller.clone(),
            executor,
        );
        config.cache_bytes = 32 << 20;
        config.cache_block_bytes = 64 << 10;
        config.device_bytes = 32 << 20;
        config.huge_pages = false;
        config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
        tweak(&mut config, &packages);
        let server = plane.rt.block_on(RuntimeServer::bind(config)).unwrap();
        let runtime = server.local_addr().to_string();
        let metrics = server.metrics_addr();
        let monitor = server.monitor();
        plane.rt.spawn(server.serve(plane.shutdown()));
        Cluster {
            runtime,
            metrics,
            monitor,
            packages,
            _dir: dir,
            plane,
        }
    }

    fn client(&self) -> RuntimeClient {
        RuntimeClient::connect(&self.runtime, &key(), TIMEOUT).unwrap()
    }

    fn name(&self, i: usize) -> &str {
        &self.packages[i].manifest.name
    }

    /// A random-ish input of batch 1 for package `i`.
    fn input(&self, i: usize) -> HostTensor {
        let spec = &self.packages[i].manifest.inputs[0];
        let mut shape = spec.shape.clone();
        shape[0] = 1;
        let n: usize = shape.iter().product();
        HostTensor::f32(
            shape,
            (0..n)
                .map(|k| ((k * 37 % 101) as f32 / 50.0) - 1.0)
                .collect(),
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.plane.stop.send(true);
    }
}

/// Writes every group of `pkg` as one slice on `memserver` and registers it.
fn deploy(controller: &mut ControllerClient, memserver: &str, pkg: &Package) {
    common::deploy(controller, memserver, pkg, &key(), TIMEOUT);
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn infer_on_a_named_device_lists_resident_models_and_prefetches() {
    let c = Cluster::start(
        &[Family::Resnet152, Family::InceptionV3, Family::Densenet201],
        vec![0, 3],
        8,
    );
    let (a, b, d) = (
        c.name(0).to_string(),
        c.name(1).to_string(),
        c.name(2).to_string(),
    );
    let mut client = c.client();
    let on = |device| InferOptions {
        device: Some(device),
        ..InferOptions::default()
    };

    // Placement follows the request's device.
    let r = client.infer_with(&a, &c.input(0), on(3)).unwrap();
    assert_eq!((r.timing.device, r.timing.path), (3, ServePath::Cold));
    assert_eq!(r.resident, [a.as_str()]);
    assert_eq!(r.timing.train_yield_ms, 0.0, "no training job");
    assert!(r.timing.warmup, "device 3's first inference is its warm-up");
    let e = client.infer_with(&a, &c.input(0), on(7)).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest));
    let text = e.to_string();
    assert!(
        text.contains("no device 7") && text.contains("[0, 3]"),
        "{text}"
    );

    // Host-cache prefetch: fetched once, then found.
    assert_eq!(client.prefetch(&b, None).unwrap().0, ServePath::Cold);
    assert_eq!(client.prefetch(&b, None).unwrap().0, ServePath::HostCached);
    // Device prefetch: only an upload now, then nothing to do.
    assert_eq!(
        client.prefetch(&b, Some(0)).unwrap().0,
        ServePath::HostCached
    );
    assert_eq!(
        client.prefetch(&b, Some(0)).unwrap().0,
        ServePath::DeviceResident
    );
    // A cold device prefetch fetches and uploads.
    assert_eq!(client.prefetch(&d, Some(0)).unwrap().0, ServePath::Cold);
    let r = client.infer_with(&b, &c.input(1), on(0)).unwrap();
    assert_eq!(r.timing.path, ServePath::DeviceResident, "prefetched");
    assert_eq!(r.timing.fetched_bytes, 0);
    assert!(
        r.timing.warmup,
        "prefetches run nothing: device 0's first inference"
    );
    assert_eq!(
        r.resident,
        [b.clone(), d.clone()],
        "most recently used first"
    );
    let r = client.infer_with(&a, &c.input(0), on(0)).unwrap();
    assert_eq!(r.timing.path, ServePath::HostCached);
    assert!(!r.timing.warmup, "device 0 ran one already");
    assert_eq!(r.resident, [a.clone(), b.clone(), d.clone()]);

    // Errors name what was wrong.
    let e = client.prefetch("no_such_model", None).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownModel), "{e}");
    let e = client.prefetch("no_such_model", Some(0)).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownModel), "{e}");
    let e = client.prefetch(&b, Some(9)).unwrap_err();
    assert!(
        e.code() == Some(ErrorCode::BadRequest) && e.to_string().contains("no device 9"),
        "{e}"
    );

    // The heartbeat snapshot: queues, resident models, the host cache.
    let snap = c.monitor.snapshot();
    assert_eq!(snap.devices.len(), 2);
    assert_eq!(snap.devices[0].device, 0);
    assert_eq!(snap.devices[0].resident, [a.clone(), b.clone(), d.clone()]);
    assert_eq!(snap.devices[1].resident, [a.as_str()]);
    assert!(snap
        .devices
        .iter()
        .all(|d| d.queued == 0 && d.training.is_none()));
    let mut cached = snap.host_cached.clone();
    cached.sort();
    let mut want = vec![a.clone(), b.clone(), d.clone()];
    want.sort();
    assert_eq!(cached, want);
    assert!(!snap.host_cached_truncated);
    assert_eq!(snap.host_cached[0], a, "most recently used first");

    // The runtime registered with its budgets.
    let mut ctl = c.plane.controller_client(&key(), TIMEOUT);
    wait_until("the runtime to register", || {
        ctl.list_runtimes()
            .unwrap()
            .iter()
            .any(|r| r.addr == c.runtime && r.alive)
    });
}

/// One device holds 3 of 4 same-size models and host memory 3: a model the
/// device evicts comes back into host memory in the background in place of
/// one the device keeps, so host and device together hold all 4 and the
/// next request for it is not a cold start.
#[test]
fn a_model_the_device_evicts_is_refilled_into_host_memory() {
    let serve = |refill: bool| {
        let c = Cluster::start_config(
            |dir| common::tiny_variants(dir, Family::Resnet152, 4, GROUP_BYTES),
            Arc::new(CpuExecutor::new()),
            |config, packages| {
                // Host memory for 3 of them and half of a 4th.
                let block = config.cache_block_bytes;
                let blocks = |p: &Package| p.manifest.stored_bytes.div_ceil(block);
                assert!(packages.iter().all(|p| blocks(p) == blocks(&packages[0])));
                config.cache_bytes = (3 * blocks(&packages[0]) + blocks(&packages[0]) / 2) * block;
                config.resident_models_max = 3;
                config.host_refill = refill;
            },
        );
        let mut client = c.client();
        let mut paths = Vec::new();
        // 0, 1, 2 cold; 3 cold (host memory lets go of 2, which the device
        // keeps; the device lets go of 0); 0 and 1 from host memory (the
        // device lets go of 1, then of 2, which host memory lacks).
        for i in [0, 1, 2, 3, 0, 1, 2] {
            let (_, timing) = client.infer(c.name(i), &c.input(i)).unwrap();
            paths.push(timing.path);
        }
        (paths, client.stats().unwrap().cache.refills)
    };
    use ServePath::{Cold, HostCached};
    let (without, refills) = serve(false);
    assert_eq!(refills, 0);
    assert_eq!(
        without,
        [Cold, Cold, Cold, Cold, HostCached, HostCached, Cold]
    );
    let (with, refills) = serve(true);
    assert_eq!(refills, 1, "2, when the device evicted it");
    assert_eq!(
        with,
        [Cold, Cold, Cold, Cold, HostCached, HostCached, HostCached]
    );
}

#[test]
fn training_yields_to_inference_at_iteration_boundaries() {
    let c = Cluster::start(&[Family::Resnet152, Family::BertBase], vec![0], 4);
    let (resnet, bert) = (c.name(0).to_string(), c.name(1).to_string());
    let mut client = c.client();

    // Only CNN families train; devices must exist.
    let e = client.train(0, Some(&bert)).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    assert!(e.to_string().contains("cannot train on device 0"), "{e}");
    let e = client.train(5, Some(&resnet)).unwrap_err();
    assert!(
        e.code() == Some(ErrorCode::BadRequest) && e.to_string().contains("no device 5"),
        "{e}"
    );
    let e = client.train(0, Some("no_such_model")).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownModel), "{e}");
    assert_eq!(client.train(0, None).unwrap(), (None, 0), "nothing to stop");

    assert_eq!(
        client.train(0, Some(&resnet)).unwrap(),
        (Some(resnet.clone()), 0)
    );
    let iterations = || c.monitor.training(0).unwrap().iterations;
    wait_until("two training iterations", || iterations() >= 2);
    assert_eq!(
        c.monitor.snapshot().devices[0].training.as_deref(),
        Some(resnet.as_str())
    );

    let mut yields = Vec::new();
    for _ in 0..6 {
        let r = client
            .infer_with(&resnet, &c.input(0), InferOptions::default())
            .unwrap();
        let served_at = iterations();
        let status = c.monitor.training(0).unwrap();
        // A request waits for at most the iteration in progress: never more
        // than the longest iteration seen (a ratio, not an absolute time).
        assert!(
            r.timing.train_yield_ms <= 1.5 * status.iteration_ms_max,
            "waited {} ms for training; the longest iteration took {} ms",
            r.timing.train_yield_ms,
            status.iteration_ms_max
        );
        assert!(r.timing.queue_ms >= r.timing.train_yield_ms);
        yields.push(r.timing.train_yield_ms);
        // Training resumes once the request is served.
        wait_until("training to continue after a request", || {
            iterations() > served_at
        });
    }
    let status = c.monitor.training(0).unwrap();
    eprintln!(
        "train_yield_ms per request {yields:?}; iterations {} (last {:.2} ms, EWMA {:.2} ms, max {:.2} ms, loss {})",
        status.iterations,
        status.iteration_ms_last,
        status.iteration_ms_ewma,
        status.iteration_ms_max,
        status.loss
    );
    assert!(
        yields.iter().any(|y| *y > 0.0),
        "requests sent while training found an iteration running: {yields:?}"
    );

    // Re-asserting the job keeps it; stopping reports its iterations.
    assert_eq!(
        client.train(0, Some(&resnet)).unwrap(),
        (Some(resnet.clone()), 0)
    );
    let ran = iterations();
    let (now, stopped_after) = client.train(0, None).unwrap();
    assert_eq!(now, None);
    assert!(
        stopped_after >= ran && stopped_after >= 8,
        "{stopped_after}"
    );
    let status = c.monitor.training(0).unwrap();
    assert_eq!(status.model, None);
    assert!(status.total_iterations >= stopped_after);
    let snap = c.monitor.snapshot();
    assert_eq!(snap.devices[0].training, None);
    assert_eq!(snap.devices[0].train_iteration_ms, 0.0);

    // Without a job the worker blocks: no busy time accrues while idle.
    let busy = c.monitor.busy(0).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        c.monitor.busy(0).unwrap(),
        busy,
        "an idle worker does nothing"
    );
    assert!(busy > Duration::ZERO);
    assert_eq!(
        c.monitor.training(0).unwrap().total_iterations,
        status.total_iterations
    );
}

/// With the sim executor a training iteration computes nothing: it holds
/// the device for the profile's training time times the dilation, counts,
/// reports its time like a real one (no loss), and still yields to
/// inference at its end.
#[test]
fn sim_training_holds_the_device_for_the_profiles_time() {
    const K: f64 = 3.0;
    const BATCH: usize = 32;
    let profile = Profile::load(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(SHIPPED_V100_ESTIMATED_PATH),
    )
    .unwrap();
    let exec = Arc::new(SimExecutor::with_dilation(profile.clone(), K).unwrap());
    let c = Cluster::start_with(&[Family::Resnet152], vec![0], BATCH, exec.clone());
    let resnet = c.name(0).to_string();
    let m = &c.packages[0].manifest;
    let want = exec.train_iteration(m, BATCH).unwrap();
    let want_s = profile
        .train_iteration_s(Family::Resnet152, Scale::Tiny, BATCH)
        .unwrap()
        * K;
    assert!(
        (want.as_secs_f64() - want_s).abs() < 1e-6,
        "{want:?} vs {want_s}"
    );
    let want_ms = want.as_secs_f64() * 1e3;

    let mut client = c.client();
    assert_eq!(
        client.train(0, Some(&resnet)).unwrap(),
        (Some(resnet.clone()), 0)
    );
    let started = Instant::now();
    // A real job's first step: the model's bytes are in the host cache.
    assert!(
        c.monitor.snapshot().host_cached.contains(&resnet),
        "{:?}",
        c.monitor.snapshot().host_cached
    );
    let iterations = || c.monitor.training(0).unwrap().iterations;
    wait_until("three simulated iterations", || iterations() >= 3);
    let elapsed = started.elapsed();
    let status = c.monitor.training(0).unwrap();
    eprintln!(
        "sim training: want {want_ms:.3} ms per iteration; {} iterations in {:.1} ms (last {:.3}, EWMA {:.3}, max {:.3} ms)",
        status.iterations,
        elapsed.as_secs_f64() * 1e3,
        status.iteration_ms_last,
        status.iteration_ms_ewma,
        status.iteration_ms_max
    );
    assert!(status.simulated);
    assert!(status.loss.is_nan(), "no loss: nothing was computed");
    assert_eq!(status.model.as_deref(), Some(resnet.as_str()));
    assert!(status.total_iterations >= 3);
    // Never less than the profile's time; at most a sleep's overshoot more.
    for t in [
        status.iteration_ms_last,
        status.iteration_ms_ewma,
        status.iteration_ms_max,
    ] {
        assert!(t >= want_ms && t < 3.0 * want_ms, "{t} ms vs {want_ms} ms");
    }
    // Two whole iterations at least lie between the reply and the third end.
    assert!(
        elapsed.as_secs_f64() * 1e3 >= 2.0 * want_ms,
        "{elapsed:?} for 3 iterations of {want_ms} ms"
    );
    assert!(
        c.monitor.snapshot().devices[0].train_iteration_ms >= want_ms,
        "the heartbeat reports the iteration time"
    );

    // Requests still wait for at most the iteration in progress.
    let mut yields = Vec::new();
    for _ in 0..4 {
        let r = client
            .infer_with(&resnet, &c.input(0), InferOptions::default())
            .unwrap();
        let max = c.monitor.training(0).unwrap().iteration_ms_max;
        assert!(
            r.timing.train_yield_ms <= 1.5 * max,
            "waited {} ms for training; the longest iteration took {max} ms",
            r.timing.train_yield_ms
        );
        assert!(r.timing.queue_ms >= r.timing.train_yield_ms);
        yields.push(r.timing.train_yield_ms);
        let served_at = iterations();
        wait_until("training to continue after a request", || {
            iterations() > served_at
        });
    }
    assert!(
        yields.iter().any(|y| *y > 0.0),
        "requests sent while training found an iteration running: {yields:?}"
    );
    let (_, ran) = client.train(0, None).unwrap();
    assert!(ran >= 7, "{ran}");
}

#[test]
fn metrics_count_requests_by_model_and_status() {
    let c = Cluster::start(&[Family::Resnet152], vec![0], 8);
    let name = c.name(0).to_string();
    let mut client = c.client();
    client.infer(&name, &c.input(0)).unwrap();
    client.infer(&name, &c.input(0)).unwrap();
    let e = client.infer("no_such_model", &c.input(0)).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownModel));

    let addr = c.metrics.expect("a metrics port").to_string();
    let (status, text) =
        distmind_common::metrics::scrape(&addr, "/metrics", TIMEOUT).expect("scrape");
    assert_eq!(status, 200, "{text}");
    let value = |metric: &str, labels: &[(&str, &str)]| {
        distmind_common::metrics::sample_value(&text, metric, labels)
    };
    assert_eq!(
        value(
            "distmind_runtime_requests_total",
            &[("model", &name), ("status", "ok")]
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        value(
            "distmind_runtime_requests_total",
            &[("model", "no_such_model"), ("status", "unknown_model")]
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(
            "distmind_runtime_request_duration_seconds_count",
            &[("model", &name)]
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        value("distmind_runtime_serve_path_total", &[("path", "cold")]),
        Some(1.0)
    );
    assert_eq!(
        value(
            "distmind_runtime_serve_path_total",
            &[("path", "device_resident")]
        ),
        Some(1.0)
    );
    let stored = c.packages[0].manifest.stored_bytes as f64;
    assert_eq!(
        value("distmind_runtime_fetched_bytes_total", &[]),
        Some(stored)
    );
    assert_eq!(
        value("distmind_runtime_host_cache_misses_total", &[]),
        Some(1.0)
    );
    assert!(value("distmind_runtime_host_cache_used_bytes", &[]).unwrap() >= stored);
    assert!(
        value(
            "distmind_runtime_device_busy_seconds_total",
            &[("device", "0")]
        )
        .unwrap()
            > 0.0
    );
    assert_eq!(
        value("distmind_runtime_device_queue_depth", &[("device", "0")]),
        Some(0.0)
    );
    assert_eq!(
        value(
            "distmind_runtime_device_train_iterations_total",
            &[("device", "0")]
        ),
        Some(0.0)
    );
    // The same text without HTTP.
    let rendered = c.monitor.render_metrics();
    assert_eq!(
        distmind_common::metrics::sample_value(
            &rendered,
            "distmind_runtime_requests_total",
            &[("model", &name), ("status", "ok")]
        ),
        Some(2.0)
    );
    let (status, body) = distmind_common::metrics::scrape(&addr, "/health", TIMEOUT).unwrap();
    assert_eq!((status, body.trim()), (200, "ok"));
}
