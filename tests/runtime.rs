//! The GPU server (`distmind runtime`) end to end with real processes on
//! loopback: a controller, memory servers, `distmind deploy`, one runtime
//! with the cpu executor, and the blocking `RuntimeClient` (plus raw frames
//! for the malformed cases).

mod support;

use std::collections::BTreeSet;
use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use distmind_common::handshake;
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{ErrorCode, RuntimeReply, ServePath, TraceEntry};
use distmind_common::wire::{self, FrameHeader, FrameKind, Role};
use distmind_models::Package;
use distmind_runtime::client::{InferOptions, Response, RuntimeClient};
use distmind_runtime::exec::{HostTensor, TensorData};
use distmind_runtime::npy::{read_npy, write_npy};
use support::*;

const TIMEOUT: Duration = Duration::from_secs(120);

/// The outputs of `distmind infer --executor cpu` on the same package and
/// input, in manifest order.
fn reference(pkg_dir: &Path, pkg: &Package, input: &HostTensor, tmp: &Path) -> Vec<HostTensor> {
    let name = &pkg.manifest.name;
    let inp = tmp.join(format!("{name}.in.npy"));
    let out = tmp.join(format!("{name}.out.npy"));
    write_npy(&inp, input).unwrap();
    let (ok, _, stderr) = run(&[
        "infer",
        "--model",
        pkg_dir.to_str().unwrap(),
        "--input",
        inp.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--executor",
        "cpu",
    ]);
    assert!(ok, "distmind infer {name}: {stderr}");
    let outputs = &pkg.manifest.outputs;
    outputs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let path: PathBuf = if i + 1 == outputs.len() {
                out.clone()
            } else {
                tmp.join(format!("{name}.out.{}.npy", o.name))
            };
            read_npy(&path).unwrap()
        })
        .collect()
}

fn assert_close(got: &[HostTensor], want: &[HostTensor], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: output count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.shape, w.shape, "{what}: output {i} shape");
        match (&g.data, &w.data) {
            (TensorData::F32(a), TensorData::F32(b)) => {
                for (j, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                        "{what}: output {i}[{j}] = {x}, distmind infer says {y}"
                    );
                }
            }
            (a, b) => assert_eq!(a, b, "{what}: output {i}"),
        }
    }
}

/// When `event` first happened for `index`, in ms since the pipeline started.
fn at(trace: &[TraceEntry], event: &str, index: usize) -> Option<f64> {
    trace
        .iter()
        .find(|e| e.event == event && e.index == Some(index as u64))
        .map(|e| e.at_ms)
}

/// The pipeline overlapped: compute of some group g started before group
/// g + 1 was in host memory, and compute began before the last arrival.
fn assert_overlapped(pkg: &Package, trace: &[TraceEntry]) {
    let groups = pkg.manifest.groups.len();
    let name = &pkg.manifest.name;
    assert!(
        groups >= 3,
        "{name} has {groups} groups: too few to pipeline"
    );
    let mut overlapped = Vec::new();
    for g in 0..groups {
        let ready = at(trace, "host_ready", g)
            .unwrap_or_else(|| panic!("{name}: no host_ready for group {g} in a cold trace"));
        let gate = at(trace, "gate_opened", g)
            .unwrap_or_else(|| panic!("{name}: compute never gated on group {g}"));
        assert!(
            ready <= gate,
            "{name}: group {g} computed before it arrived"
        );
        if g + 1 < groups {
            let next = at(trace, "host_ready", g + 1).unwrap();
            if gate < next {
                overlapped.push(g);
            }
        }
    }
    // Groups are requested in order but arrive in whatever order the
    // memory servers' streams deliver them: "last" is the latest arrival.
    let last = (0..groups)
        .filter_map(|g| at(trace, "host_ready", g))
        .fold(0.0, f64::max);
    let first_compute = at(trace, "gate_opened", 0).unwrap();
    assert!(
        !overlapped.is_empty() && first_compute < last,
        "{name}: no group's compute started before the next group arrived; trace: {trace:?}"
    );
}

#[test]
fn runtime_serves_cold_then_resident_with_the_pipeline_overlapped() {
    let tmp = tempfile::tempdir().unwrap();
    let mut dirs = Vec::new();
    for family in ["resnet152", "bert_base", "gpt2", "densenet201"] {
        dirs.extend(gen_tiny(tmp.path(), family, 1, 16 << 10));
    }
    let pkgs: Vec<Package> = dirs.iter().map(|d| Package::open(d).unwrap()).collect();

    let controller = spawn_controller();
    let _ms: Vec<Proc> = (0..2)
        .map(|_| spawn_memserver(&controller.addr, "64MiB"))
        .collect();
    wait_alive(&controller.addr, 2);
    let (ok, _, stderr) = deploy(&controller.addr, &[], &dirs);
    assert!(ok, "deploy: {stderr}");
    // 0.02 Gbit/s = 2.5 MB/s: a 16 KiB group every ~6.5 ms, and the smallest
    // tiny model (~100 KB) takes ~40 ms to arrive: room enough, even on a
    // loaded 2-core machine, to see compute start while later groups are on
    // their way (at 0.05 Gbit/s the whole fetch of a 100 KB model, ~15 ms,
    // sometimes ended before compute started).
    let rt = spawn_runtime(
        &controller.addr,
        &[
            "--cache",
            "64MiB",
            "--devices",
            "0",
            "--rate-limit-gbps",
            "0.02",
        ],
    );
    let info = wait_runtime_alive(&controller.addr, &rt.addr);
    assert_eq!((info.devices, info.executor.as_str()), (1, "cpu"));

    let mut c = RuntimeClient::connect(&rt.addr, &cluster_key(), TIMEOUT).unwrap();
    let traced = InferOptions {
        trace: true,
        ..InferOptions::default()
    };
    for (dir, pkg) in dirs.iter().zip(&pkgs) {
        let name = &pkg.manifest.name;
        let input = input_for(pkg);
        let want = reference(dir, pkg, &input, tmp.path());

        let cold = c.infer_with(name, &input, traced).unwrap();
        assert_eq!(cold.timing.path, ServePath::Cold, "{name}: first request");
        assert_eq!(cold.timing.fetched_bytes, pkg.manifest.stored_bytes);
        let names: Vec<&str> = pkg
            .manifest
            .outputs
            .iter()
            .map(|o| o.name.as_str())
            .collect();
        assert_eq!(cold.names, names);
        assert_close(&cold.outputs, &want, &format!("{name} cold"));
        let trace = cold.trace.as_deref().expect("a trace was asked for");
        assert!(!cold.trace_truncated);
        assert_overlapped(pkg, trace);

        let (outputs, timing) = c.infer(name, &input).unwrap();
        assert_eq!(
            timing.path,
            ServePath::DeviceResident,
            "{name}: second request"
        );
        assert_eq!(timing.fetched_bytes, 0);
        assert_close(&outputs, &want, &format!("{name} resident"));
    }

    // The controller's cache-out (host cache only) leaves the device's copy
    // serving; a whole eviction makes the next request cold again.
    let (first_dir, first) = (&dirs[0], &pkgs[0]);
    let name = &first.manifest.name;
    assert_eq!(c.evict(name, true).unwrap(), (true, 0));
    let (_, timing) = c.infer(name, &input_for(first)).unwrap();
    assert_eq!(timing.path, ServePath::DeviceResident, "after a cache-out");
    assert_eq!(c.evict(name, false).unwrap(), (false, 1));
    assert_eq!(c.evict(name, false).unwrap(), (false, 0), "already gone");
    let input = input_for(first);
    let (outputs, timing) = c.infer(name, &input).unwrap();
    assert_eq!(timing.path, ServePath::Cold, "after eviction");
    assert_close(
        &outputs,
        &reference(first_dir, first, &input, tmp.path()),
        "after eviction",
    );

    // Pipelined requests on one connection: every reply comes back, by id.
    let mut ids = BTreeSet::new();
    for pkg in &pkgs {
        ids.insert(
            c.send_infer(&pkg.manifest.name, &input_for(pkg), InferOptions::default())
                .unwrap(),
        );
    }
    for _ in 0..pkgs.len() {
        match c.recv().unwrap() {
            Response::Output(i) => {
                assert_eq!(i.timing.path, ServePath::DeviceResident);
                assert!(ids.remove(&i.id), "reply for an unknown id {}", i.id);
            }
            r => panic!("{r:?}"),
        }
    }

    let stats = c.stats().unwrap();
    assert_eq!(stats.devices.len(), 1);
    assert_eq!(stats.devices[0].queued, 0);
    // Two per package, one after the cache-out, one after the eviction.
    assert_eq!(stats.served, 2 * pkgs.len() as u64 + 2 + pkgs.len() as u64);
    assert_eq!(stats.errors, 0);
    assert_eq!(stats.cache.models, pkgs.len() as u64);
}

/// A raw control connection to the runtime, for frames the client never sends.
fn raw(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    handshake::client_sync(&mut s, &cluster_key(), Role::Control).unwrap();
    s
}

fn send_json(s: &mut TcpStream, json: &str) {
    wire::write_frame_sync(s, FrameKind::Message, &[json.as_bytes()]).unwrap();
}

fn recv_error(s: &mut TcpStream) -> (u64, ErrorCode, String) {
    match wire::recv_message_sync::<_, RuntimeReply>(s, CONTROL_FRAME_BYTES_MAX).unwrap() {
        RuntimeReply::Error { id, error } => (id, error.code, error.message),
        r => panic!("expected an error reply, got {r:?}"),
    }
}

fn recv_stats_ok(s: &mut TcpStream, want_id: u64) {
    match wire::recv_message_sync::<_, RuntimeReply>(s, CONTROL_FRAME_BYTES_MAX).unwrap() {
        RuntimeReply::Stats { id, .. } => assert_eq!(id, want_id),
        r => panic!("expected stats, got {r:?}"),
    }
}

#[test]
fn bad_requests_get_error_replies_and_the_runtime_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = gen_tiny(tmp.path(), "gpt2", 1, 16 << 10);
    let pkg = Package::open(&dirs[0]).unwrap();
    let name = pkg.manifest.name.clone();
    let controller = spawn_controller();
    let _ms = spawn_memserver(&controller.addr, "32MiB");
    wait_alive(&controller.addr, 1);
    let (ok, _, stderr) = deploy(&controller.addr, &[], &dirs);
    assert!(ok, "deploy: {stderr}");
    let rt = spawn_runtime(&controller.addr, &["--cache", "32MiB"]);
    let key = cluster_key();
    let mut c = RuntimeClient::connect(&rt.addr, &key, TIMEOUT).unwrap();
    let input = input_for(&pkg);

    // Unknown model: an error naming it.
    let e = c.infer("no-such-model", &input).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownModel), "{e}");
    assert!(e.to_string().contains("no-such-model"), "{e}");

    // Wrong dtype and wrong shape: named, before anything is fetched.
    let images = HostTensor::f32(vec![1, 16], vec![0.0; 16]);
    let e = c.infer(&name, &images).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    assert!(
        e.to_string().contains("f32 [1, 16]") && e.to_string().contains("expected i64"),
        "{e}"
    );
    // Any length up to the position table (64 tiny) is served; 65 is not.
    let long = HostTensor::i64(vec![1, 65], vec![1; 65]);
    let e = c.infer(&name, &long).unwrap_err();
    assert!(
        e.to_string().contains("[1, 65]") && e.to_string().contains("tokens 1..=64"),
        "{e}"
    );
    assert_eq!(
        c.stats().unwrap().cache.models,
        0,
        "nothing fetched for bad inputs"
    );

    // The same connection still serves.
    let (_, timing) = c.infer(&name, &input).unwrap();
    assert_eq!(timing.path, ServePath::Cold);

    let mut s = raw(&rt.addr);
    // Not .npy bytes.
    send_json(
        &mut s,
        &format!(r#"{{"op":"infer","id":5,"model":"{name}"}}"#),
    );
    wire::write_frame_sync(&mut s, FrameKind::WriteChunk, &[b"garbage"]).unwrap();
    let (id, code, msg) = recv_error(&mut s);
    assert_eq!((id, code), (5, ErrorCode::BadRequest));
    assert!(msg.contains("not a .npy file"), "{msg}");
    // Not JSON, then a message that is not a request: errors, same connection.
    send_json(&mut s, "{not json");
    let (_, code, _) = recv_error(&mut s);
    assert_eq!(code, ErrorCode::BadRequest);
    send_json(&mut s, r#"{"op":"launch","id":6}"#);
    let (id, code, msg) = recv_error(&mut s);
    assert_eq!((id, code), (6, ErrorCode::BadRequest), "{msg}");
    // An infer with no input frame: named, and the next request is served.
    send_json(
        &mut s,
        &format!(r#"{{"op":"infer","id":7,"model":"{name}"}}"#),
    );
    send_json(&mut s, r#"{"op":"stats","id":8}"#);
    let (id, _, msg) = recv_error(&mut s);
    assert!(id == 7 && msg.contains("input frame"), "{msg}");
    recv_stats_ok(&mut s, 8);
    // An input frame over the bound is skipped with an error.
    send_json(
        &mut s,
        &format!(r#"{{"op":"infer","id":9,"model":"{name}"}}"#),
    );
    let len = CONTROL_FRAME_BYTES_MAX + 1;
    let header = FrameHeader {
        kind: FrameKind::WriteChunk,
        len,
    }
    .encode();
    s.write_all(&header).unwrap();
    s.write_all(&vec![0u8; len as usize]).unwrap();
    let (id, _, msg) = recv_error(&mut s);
    assert!(id == 9 && msg.contains("send a smaller batch"), "{msg}");
    send_json(&mut s, r#"{"op":"stats","id":10}"#);
    recv_stats_ok(&mut s, 10);
    // A broken frame header: an error, then the connection closes.
    s.write_all(&[4, 0, 0, 0, 9, 0, 0, 0, 1, 2, 3, 4]).unwrap();
    let (_, _, msg) = recv_error(&mut s);
    assert!(msg.contains("unknown frame kind 9"), "{msg}");
    assert!(wire::read_frame_sync(&mut s, CONTROL_FRAME_BYTES_MAX)
        .map(|f| f.is_none())
        .unwrap_or(true));

    // Others are served throughout.
    let (_, timing) = c.infer(&name, &input).unwrap();
    assert_eq!(timing.path, ServePath::DeviceResident);
    let mut fresh = RuntimeClient::connect(&rt.addr, &key, TIMEOUT).unwrap();
    assert!(fresh.infer(&name, &input).is_ok());
    // The client checks the bound before sending.
    let huge = HostTensor::f32(vec![5, 1 << 20], vec![0.0; 5 << 20]);
    let e = fresh.infer(&name, &huge).unwrap_err();
    assert!(e.to_string().contains("send a smaller batch"), "{e}");
    assert!(fresh.infer(&name, &input).is_ok());
}
