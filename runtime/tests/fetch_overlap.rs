//! Two devices of one runtime cold-start two different models at once, and
//! their fetches share the link instead of waiting for each other.
//!
//! In-process, real sockets: a controller, one memory server and a
//! `RuntimeServer` with 2 cpu devices whose data path is rate limited, so
//! that one model alone takes a few hundred milliseconds to arrive. Two
//! clients send one request each (model i on device i) at the same instant
//! with `trace: true`. Each reply's `host_ready` events are placed on the
//! client's clock: send time + the server's queue time + the event's time
//! since the pipeline start. The two fetch windows (first to last group in
//! host memory) must overlap for most of their length; with fetches one at
//! a time the second window starts only when the first ended.

mod common;

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use distmind_common::handshake::ClusterKey;
use distmind_common::proto::ServePath;
use distmind_controller::ControllerClient;
use distmind_models::{Family, Package};
use distmind_runtime::client::{InferOptions, Inference, RuntimeClient};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::HostTensor;
use distmind_runtime::server::{RuntimeConfig, RuntimeServer};

const TIMEOUT: Duration = Duration::from_secs(60);
const GROUP_BYTES: u64 = 16 << 10;
/// How long one model alone takes to cross the rate-limited link.
const ONE_FETCH: Duration = Duration::from_millis(400);

fn key() -> ClusterKey {
    ClusterKey::from_secret(b"fetch overlap test")
}

/// Two variants of a tiny model: same size, different weights and names.
fn packages(dir: &Path) -> Vec<Package> {
    common::tiny_variants(dir, Family::Resnet152, 2, GROUP_BYTES)
}

/// Writes every group of `pkg` as one slice on `memserver` and registers it.
fn deploy(controller: &mut ControllerClient, memserver: &str, pkg: &Package) {
    common::deploy(controller, memserver, pkg, &key(), TIMEOUT);
}

fn input(pkg: &Package) -> HostTensor {
    let spec = &pkg.manifest.inputs[0];
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

/// First and last `host_ready` of a reply, in ms on the client's clock.
fn fetch_window(sent_ms: f64, reply: &Inference, groups: usize) -> (f64, f64) {
    let trace = reply.trace.as_ref().expect("trace asked for");
    assert!(!reply.trace_truncated, "the trace was cut");
    let ready: Vec<f64> = trace
        .iter()
        .filter(|e| e.event == "host_ready")
        .map(|e| e.at_ms)
        .collect();
    assert_eq!(ready.len(), groups, "every group was fetched: {trace:?}");
    let at = sent_ms + reply.timing.queue_ms;
    let first = ready.iter().copied().fold(f64::INFINITY, f64::min);
    let last = ready.iter().copied().fold(0.0, f64::max);
    (at + first, at + last)
}

#[test]
fn two_devices_fetch_two_cold_models_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let pkgs = packages(dir.path());
    assert_eq!(pkgs.len(), 2);
    let model_bytes = pkgs[0].manifest.stored_bytes;
    let rate = (model_bytes as f64 / ONE_FETCH.as_secs_f64()) as u64;

    let plane = common::ControlPlane::start(&key(), TIMEOUT);
    let mut cc = plane.controller_client(&key(), TIMEOUT);
    for p in &pkgs {
        deploy(&mut cc, &plane.memserver, p);
    }
    let mut config = RuntimeConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        key(),
        plane.controller.clone(),
        Arc::new(CpuExecutor::new()),
    );
    config.devices = vec![0, 1];
    config.cache_bytes = 32 << 20;
    config.cache_block_bytes = 64 << 10;
    config.device_bytes = 32 << 20;
    config.huge_pages = false;
    config.rate_limit_bytes_per_s = Some(rate);
    // Reads already posted are served first come, first served; the window
    // is what lets a later fetch's group 0 in early. The default (32 MiB per
    // memory server) is a seventh of a full-scale ResNet-152 but larger
    // than this whole tiny model, so keep the same proportion here.
    config.pipeline.fetch.bytes_in_flight_max = 2 * GROUP_BYTES;
    let server = plane.rt.block_on(RuntimeServer::bind(config)).unwrap();
    let runtime = server.local_addr().to_string();
    plane.rt.spawn(server.serve(plane.shutdown()));

    // Both connections up first, then both requests at one instant.
    let barrier = Barrier::new(2);
    let t0 = Instant::now();
    let results: Vec<(f64, Inference)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2u32)
            .map(|d| {
                let (barrier, runtime, pkg) = (&barrier, &runtime, &pkgs[d as usize]);
                s.spawn(move || {
                    let mut client = RuntimeClient::connect(runtime, &key(), TIMEOUT).unwrap();
                    let x = input(pkg);
                    let opts = InferOptions {
                        device: Some(d),
                        trace: true,
                        ..InferOptions::default()
                    };
                    barrier.wait();
                    let sent = t0.elapsed().as_secs_f64() * 1e3;
                    let reply = client.infer_with(&pkg.manifest.name, &x, opts).unwrap();
                    (sent, reply)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let _ = plane.stop.send(true);

    let windows: Vec<(f64, f64)> = results
        .iter()
        .zip(&pkgs)
        .map(|((sent, reply), pkg)| {
            assert_eq!(reply.timing.path, ServePath::Cold, "both models were cold");
            assert_eq!(reply.timing.fetched_bytes, pkg.manifest.stored_bytes);
            fetch_window(*sent, reply, pkg.manifest.groups.len())
        })
        .collect();
    println!("fetch windows, ms on the client's clock: {windows:?}");
    let overlap = windows[0].1.min(windows[1].1) - windows[0].0.max(windows[1].0);
    let shorter = (windows[0].1 - windows[0].0).min(windows[1].1 - windows[1].0);
    // Alone, a fetch takes ONE_FETCH; sharing the link, each takes about
    // twice that and they overlap almost entirely. One after another, they
    // would not overlap at all.
    assert!(
        shorter > ONE_FETCH.as_secs_f64() * 1e3 / 2.0,
        "the link was not the bottleneck: fetch windows {windows:?} ms"
    );
    assert!(
        overlap > 0.5 * shorter,
        "the two fetches did not run at once: windows {windows:?} ms overlap {overlap:.1} ms"
    );
    drop(plane);
}
