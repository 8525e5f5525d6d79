//! The controller's dispatcher end to end, with real processes on
//! loopback: a controller (dispatcher + metrics), two memory servers, one
//! GPU server (cpu executor, tiny models) and `distmind client`.
//!
//! * 20 models over a host cache that holds about 5: every request is
//!   answered or explicitly rejected (none lost), SLO attainment is
//!   reported, and every metrics endpoint is scraped and checked.
//! * Overload: a client at 10x the measured capacity gets rejections; the
//!   admitted requests meet their SLO; the controller's memory stays bounded.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use distmind_common::metrics::{parse_samples, sample_value, scrape};
use distmind_controller::ControllerClient;
use serde_json::Value;
use support::*;

struct Cluster {
    runtime: String,
    _procs: Vec<Proc>,
    controller_pid: u32,
    metadata: String,
    client: String,
    metrics: Vec<(String, String)>,
    _dir: tempfile::TempDir,
}

/// Sum of every sample of `name` (any labels) in an exposition.
fn total(text: &str, name: &str) -> f64 {
    parse_samples(text)
        .iter()
        .filter(|(series, _)| series == name || series.starts_with(&format!("{name}{{")))
        .map(|(_, v)| v)
        .sum()
}

fn metrics_text(addr: &str) -> String {
    let (status, body) = scrape(addr, "/metrics", Duration::from_secs(5)).expect("scrape");
    assert_eq!(status, 200, "GET /metrics on {addr}");
    body
}

/// Tiny packages of every family, `per_family` variants each.
fn packages(dir: &Path, per_family: usize) -> Vec<PathBuf> {
    let mut all = Vec::new();
    for f in [
        "resnet152",
        "inception_v3",
        "densenet201",
        "bert_base",
        "gpt2",
    ] {
        all.extend(gen_tiny(dir, f, per_family, 65536));
    }
    all
}

fn stored_bytes(pkg: &Path) -> u64 {
    let m: Value =
        serde_json::from_slice(&std::fs::read(pkg.join("manifest.json")).unwrap()).unwrap();
    m["stored_bytes"].as_u64().expect("manifest stored_bytes")
}

fn start(policy: &str, per_family: usize, cache_models: u64) -> Cluster {
    start_with(policy, per_family, cache_models, &[], "0")
}

/// [`start`] with `controller_args` for the controller and a runtime of
/// `devices` (cpu devices, e.g. "0,1").
fn start_with(
    policy: &str,
    per_family: usize,
    cache_models: u64,
    controller_args: &[&str],
    devices: &str,
) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let pkgs = packages(dir.path(), per_family);
    let largest = pkgs.iter().map(|p| stored_bytes(p)).max().unwrap();
    // Blocks of 64 KiB; a cache that holds `cache_models` of the largest.
    let cache = (largest.div_ceil(65536) * 65536 * cache_models).to_string();
    let (ctl, metadata, client, ctl_metrics) =
        spawn_dispatching_controller(policy, controller_args);
    let controller_pid = ctl.pid();
    let s = settings_dir();
    let mut procs = vec![ctl];
    let mut metrics = vec![("controller".to_string(), ctl_metrics)];
    for _ in 0..2 {
        let (p, a) = spawn_service_lines(
            &[
                "memserver",
                "--settings",
                s.to_str().unwrap(),
                "--listen",
                "127.0.0.1:0",
                "--capacity",
                "256MiB",
                "--controller",
                &metadata,
                "--metrics",
                "127.0.0.1:0",
            ],
            2,
        );
        metrics.push(("memserver".into(), a[1].clone()));
        procs.push(p);
    }
    wait_alive(&metadata, 2);
    let (ok, _, err) = deploy(&metadata, &[], &pkgs);
    assert!(ok, "deploy: {err}");
    let (rt, a) = spawn_service_lines(
        &[
            "runtime",
            "--settings",
            s.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--controller",
            &metadata,
            "--executor",
            "cpu",
            "--devices",
            devices,
            "--cache",
            &cache,
            "--device-memory",
            &cache,
            "--metrics",
            "127.0.0.1:0",
        ],
        2,
    );
    metrics.push(("runtime".into(), a[1].clone()));
    procs.push(rt);
    // The dispatcher links to the runtime once it has registered.
    let mut c =
        ControllerClient::connect(&metadata, &cluster_key(), Duration::from_secs(5)).unwrap();
    let t0 = Instant::now();
    while !c.list_runtimes().unwrap().iter().any(|r| r.alive) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "runtime never registered"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Not waiting for the dispatcher to link to it: a request that comes
    // before waits for the link.
    Cluster {
        runtime: a[0].clone(),
        _procs: procs,
        controller_pid,
        metadata,
        client,
        metrics,
        _dir: dir,
    }
}

/// Two closed-loop clients for 3 s with a 10 s SLO (every request can be
/// admitted), and `extra`; returns the report.
fn closed_loop(c: &Cluster, extra: &[&str]) -> Value {
    let mut args = vec![
        "--mode",
        "closed",
        "--concurrency",
        "2",
        "--requests",
        "0",
        "--duration",
        "3s",
        "--slo-ms",
        "10000",
    ];
    args.extend_from_slice(extra);
    client(c, &args)
}

/// Runs `distmind client` with `args`; returns its JSON report.
fn client(c: &Cluster, args: &[&str]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let s = settings_dir();
    let mut all = vec![
        "client",
        "--settings",
        s.to_str().unwrap(),
        "--addr",
        &c.client,
        "--controller",
        &c.metadata,
        "--json",
        json.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let (ok, stdout, stderr) = run(&all);
    assert!(ok, "client failed: {stderr}\n{stdout}");
    assert!(
        stdout.trim_end().ends_with("All threads finished."),
        "the client's last line: {stdout}"
    );
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

fn n(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("report field {k}: {v}"))
}

#[test]
fn every_request_is_answered_or_rejected_and_metrics_add_up() {
    let c = start("slo", 4, 5); // 20 models, a cache of 5
    let r = client(
        &c,
        &[
            "--mode",
            "poisson",
            "--rate",
            "40",
            "--duration",
            "6s",
            "--zipf",
            "0.9",
            "--slo-ms",
            "2000",
            "--seed",
            "3",
        ],
    );
    let sent = n(&r, "sent");
    assert!(sent > 100, "{r}");
    let errors: u64 = r["errors"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    let accounted =
        n(&r, "ok") + n(&r, "rejected") + n(&r, "deadline_exceeded") + n(&r, "busy") + errors;
    assert_eq!(accounted, sent, "every request answered or rejected: {r}");
    assert_eq!(
        r["errors"].get("lost").and_then(Value::as_u64).unwrap_or(0),
        0
    );
    // The client started as soon as the GPU server registered: requests
    // before the dispatcher linked to it waited for the link.
    let unavailable = r["errors"].get("unavailable").and_then(Value::as_u64);
    assert_eq!(unavailable.unwrap_or(0), 0, "{r}");
    assert!(n(&r, "ok") > 0);
    let slo = &r["slo"];
    let attainment = slo["attainment"].as_f64().expect("SLO attainment reported");
    assert!((0.0..=1.0).contains(&attainment));
    // More than 5 models were used: the host cache had to evict.
    let used_models = r["models"].as_array().unwrap().len();
    assert!(used_models > 5, "{used_models} models requested");

    // The metrics endpoints agree with the client.
    let mut seen = 0;
    for (what, addr) in &c.metrics {
        let (status, body) = scrape(addr, "/health", Duration::from_secs(5)).unwrap();
        assert_eq!((status, body.trim()), (200, "ok"), "{what} health");
        let text = metrics_text(addr);
        match what.as_str() {
            "controller" => {
                let answered = total(&text, "distmind_controller_requests_total");
                assert_eq!(answered as u64, sent, "controller requests_total:\n{text}");
                let ok = sample_value(&text, "distmind_controller_slo_attainment_ratio", &[])
                    .expect("slo attainment gauge");
                assert!((0.0..=1.0).contains(&ok));
                assert!(total(&text, "distmind_controller_request_latency_seconds_count") > 0.0);
                assert_eq!(total(&text, "distmind_controller_runtimes_alive"), 1.0);
                // Real sockets: a round trip beyond the GPU server's time.
                let overhead = sample_value(&text, "distmind_controller_dispatch_overhead_ms", &[])
                    .expect("dispatch overhead gauge");
                assert!(overhead > 0.0 && overhead < 1000.0, "{overhead} ms");
                seen += 1;
            }
            "runtime" => {
                assert!(
                    total(&text, "distmind_runtime_requests_total") >= n(&r, "ok") as f64,
                    "{text}"
                );
                assert!(
                    total(&text, "distmind_runtime_host_cache_evictions_total") > 0.0,
                    "{text}"
                );
                assert!(
                    total(&text, "distmind_runtime_fetched_bytes_total") > 0.0,
                    "{text}"
                );
                seen += 1;
            }
            _ => {
                // Every memory server exports the series (served bytes are
                // summed over both below: one may hold no slice read here).
                assert!(
                    parse_samples(&text)
                        .iter()
                        .any(|(series, _)| series == "memserver_bytes_served_total"),
                    "{text}"
                );
                seen += 1;
            }
        }
    }
    assert_eq!(seen, 4);
    // Between them the memory servers served the cold starts.
    let served: f64 = c
        .metrics
        .iter()
        .filter(|(w, _)| w == "memserver")
        .map(|(_, a)| total(&metrics_text(a), "memserver_bytes_served_total"))
        .sum();
    assert!(served > 0.0);
}

#[test]
fn overload_is_rejected_admitted_requests_meet_their_slo_memory_bounded() {
    let c = start("slo", 1, 5); // 5 models, all fit
                                // Capacity: a closed loop with two threads.
    let warm = closed_loop(&c, &[]);
    let capacity = warm["throughput_rps"].as_f64().unwrap();
    let p50 = warm["latency"]["p50_ms"].as_f64().unwrap();
    assert!(capacity > 0.0);
    // An SLO a few services long: feasible when the GPU is free, not behind
    // a long queue.
    let slo = (p50 * 6.0).max(30.0).ceil() as u64;
    let rss_before = rss_bytes(c.controller_pid);
    let rate = (capacity * 10.0).ceil();
    let r = client(
        &c,
        &[
            "--mode",
            "poisson",
            "--rate",
            &rate.to_string(),
            "--duration",
            "5s",
            "--slo-ms",
            &slo.to_string(),
        ],
    );
    let sent = n(&r, "sent");
    let ok = n(&r, "ok");
    let rejected = n(&r, "rejected");
    eprintln!(
        "capacity {capacity:.0} req/s, offered {rate} req/s, SLO {slo} ms: sent {sent}, ok {ok}, rejected {rejected}, \
         p99 of ok {:.1} ms",
        r["latency"]["p99_ms"].as_f64().unwrap()
    );
    assert!(
        rejected > sent / 4,
        "10x overload must be rejected at admission: {r}"
    );
    assert!(ok > 0);
    // Admitted requests meet their SLO: the estimates are live
    // observations, so allow a few misses, never a collapse.
    let within = r["slo"]["ok_within_slo"].as_u64().unwrap();
    assert!(
        within as f64 >= 0.9 * ok as f64,
        "{within} of {ok} admitted requests within {slo} ms: {r}"
    );
    // The controller's memory stays bounded (queues and inputs are capped).
    let rss_after = rss_bytes(c.controller_pid);
    assert!(
        rss_after < rss_before + (64 << 20),
        "controller RSS grew from {rss_before} to {rss_after} bytes"
    );
    let text = metrics_text(&c.metrics[0].1);
    assert!(total(&text, "distmind_controller_rejected_total") >= rejected as f64);
    assert!(
        total(&text, "distmind_controller_in_flight_requests") <= 256.0,
        "{text}"
    );
}

#[test]
fn training_fills_the_gpu_between_requests_and_assignments_are_published() {
    let train = "resnet152-tiny-00000000";
    let c = start_with(
        "slo",
        1,
        5,
        &["--use-train", "true", "--train-model", train],
        "0",
    );
    // The dispatcher starts the training job on the runtime by itself.
    let mut rt = distmind_runtime::client::RuntimeClient::connect(
        &c.runtime,
        &cluster_key(),
        Duration::from_secs(10),
    )
    .unwrap();
    let t0 = Instant::now();
    loop {
        let d = &rt.stats().unwrap().devices[0];
        if d.training.as_deref() == Some(train) && d.train_iterations >= 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "training never started: {d:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Inference still gets through: requests wait at most one iteration.
    let r = client(
        &c,
        &[
            "--mode",
            "closed",
            "--concurrency",
            "1",
            "--requests",
            "20",
            "--slo-ms",
            "10000",
        ],
    );
    assert_eq!(n(&r, "ok"), 20, "{r}");
    let before = rt.stats().unwrap().devices[0].train_iterations;
    let t1 = Instant::now();
    while rt.stats().unwrap().devices[0].train_iterations <= before {
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "training did not resume"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The subscriber channel says who does what.
    let mut ctl =
        ControllerClient::connect(&c.metadata, &cluster_key(), Duration::from_secs(5)).unwrap();
    match ctl
        .request(&distmind_common::proto::ControllerRequest::Assignments)
        .unwrap()
    {
        distmind_common::proto::ControllerReply::Assignments {
            epoch,
            policy,
            gpus,
        } => {
            assert!(epoch >= 1);
            assert_eq!(policy, "slo");
            assert_eq!(gpus.len(), 1, "{gpus:?}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_client_port_refuses_bad_input_clearly_and_keeps_serving() {
    use distmind_common::proto::ErrorCode;
    use distmind_runtime::client::{InferOptions, RuntimeClient};
    let c = start("slo", 1, 5);
    let key = cluster_key();
    let mut rc = RuntimeClient::connect(&c.client, &key, Duration::from_secs(10)).unwrap();
    let models = ControllerClient::connect(&c.metadata, &key, Duration::from_secs(5))
        .unwrap()
        .list_models()
        .unwrap();
    let model = &models[0].name;
    let entry = ControllerClient::connect(&c.metadata, &key, Duration::from_secs(5))
        .unwrap()
        .get_model(model)
        .unwrap();
    let manifest: distmind_models::Manifest = serde_json::from_value(entry.manifest).unwrap();
    let input = distmind::loadgen::input_for(&manifest, 1, 1).unwrap();
    let code = |e: distmind_runtime::client::RuntimeClientError| match e {
        distmind_runtime::client::RuntimeClientError::Server { reply, .. } => {
            Some((reply.code, reply.message))
        }
        other => panic!("expected an error reply, got {other}"),
    };

    // The dispatcher links to the runtime within a tick of its
    // registration; until then requests are refused ("no GPU server").
    let t0 = Instant::now();
    while let Err(e) = rc.infer_with(model, &input, InferOptions::default()) {
        assert!(t0.elapsed() < Duration::from_secs(20), "never served: {e}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // An unknown model: named in the error.
    let e = rc
        .infer_with("no-such-model", &input, InferOptions::default())
        .unwrap_err();
    let (c1, m1) = code(e).expect("an error reply");
    assert_eq!(c1, ErrorCode::UnknownModel);
    assert!(m1.contains("no-such-model"), "{m1}");
    // The device is the dispatcher's choice.
    let opts = InferOptions {
        device: Some(0),
        ..Default::default()
    };
    let (c2, m2) = code(rc.infer_with(model, &input, opts).unwrap_err()).unwrap();
    assert_eq!(c2, ErrorCode::BadRequest);
    assert!(m2.contains("device"), "{m2}");
    // Runtime-only requests are refused, naming what the port takes.
    let (c3, m3) = code(rc.stats().unwrap_err()).unwrap();
    assert_eq!(c3, ErrorCode::BadRequest);
    assert!(m3.contains("infer requests only"), "{m3}");
    // The same connection still serves a good request.
    let ok = rc
        .infer_with(model, &input, InferOptions::default())
        .unwrap();
    assert!(
        ok.dispatch.is_some(),
        "the reply carries its dispatch record"
    );

    // A broken frame header: an error, then the connection is closed.
    let mut s = TcpStream::connect(&c.client).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    distmind_common::handshake::client_sync(&mut s, &key, distmind_common::wire::Role::Control)
        .unwrap();
    s.write_all(&[0xff; 8]).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("bad_request"), "{text}");
    // JSON that is not a request: an error, and the connection stays open.
    let mut s = TcpStream::connect(&c.client).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    distmind_common::handshake::client_sync(&mut s, &key, distmind_common::wire::Role::Control)
        .unwrap();
    distmind_common::wire::send_message_sync(&mut s, &serde_json::json!({"op": "fly"})).unwrap();
    let reply: distmind_common::proto::RuntimeReply =
        distmind_common::wire::recv_message_sync(&mut s, 1 << 20).unwrap();
    match reply {
        distmind_common::proto::RuntimeReply::Error { error, .. } => {
            assert_eq!(error.code, ErrorCode::BadRequest);
            assert!(error.message.contains("not a request"), "{}", error.message);
        }
        r => panic!("{r:?}"),
    }

    // After all that, a fresh client is served, and the metrics did not
    // turn the made-up model name into a label.
    let mut fresh = RuntimeClient::connect(&c.client, &key, Duration::from_secs(10)).unwrap();
    fresh
        .infer_with(model, &input, InferOptions::default())
        .unwrap();
    let text = metrics_text(&c.metrics[0].1);
    assert!(
        !text.contains("no-such-model"),
        "client input became a label:\n{text}"
    );
    assert!(text.contains("(unresolved)"), "{text}");
}

/// Two cpu devices with room for every model, two closed-loop clients on one
/// model: the device that loaded it first would serve every request (a
/// holder that meets the deadline wins the request), while the other idled.
/// The `slo` policy copies the model onto the idle device, and both serve.
#[test]
fn a_hot_model_is_copied_onto_an_idle_device_and_both_serve_it() {
    let c = start_with("slo", 1, 5, &[], "0,1");
    let model = "resnet152-tiny-00000000";
    let r = closed_loop(&c, &["--models", model]);
    assert_eq!(n(&r, "ok"), n(&r, "sent"), "{r}");
    let ctl = metrics_text(&c.metrics[0].1);
    assert!(
        total(&ctl, "distmind_controller_prefetches") >= 1.0,
        "no prefetch: {ctl}"
    );
    let rt = c
        .metrics
        .iter()
        .find(|(w, _)| w == "runtime")
        .map(|(_, a)| metrics_text(a))
        .unwrap();
    let busy = |d: u32| {
        let series = format!("distmind_runtime_device_busy_seconds_total{{device=\"{d}\"}}");
        parse_samples(&rt)
            .iter()
            .find(|(s, _)| *s == series)
            .map(|(_, v)| *v)
            .unwrap_or(0.0)
    };
    let (b0, b1) = (busy(0), busy(1));
    assert!(
        b0.min(b1) > 0.2 * b0.max(b1),
        "device busy seconds {b0:.3} and {b1:.3}: one device served nearly all"
    );
}
