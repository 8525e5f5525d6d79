//! The runtime's request path in-process (a controller, a memory server
//! and a runtime on 127.0.0.1 ephemeral ports, the cpu executor).
//!
//! Catalog plans: requests for a model new to the runtime share one
//! catalog call, and one naming a newer catalog version refreshes it once.
//!
//! Batched `Infer`: a batch
//! answers every request under its own id with the rows it gets alone
//! (to float rounding, see [`ROW_TOLERANCE`]); a request whose input does not fit, or whose deadline passed,
//! is answered with its error while the rest of its batch still runs; a
//! batch of transformer requests of different lengths runs one group per
//! length.

mod common;

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::handshake::{self, ClusterKey};
use distmind_common::proto::{
    BatchMember, ErrorCode, RuntimeReply, RuntimeRequest, BATCH_MEMBERS_MAX,
};
use distmind_common::wire::{self, FrameKind, Role};
use distmind_controller::ControllerClient;
use distmind_models::{generate, Family, GenOptions, Package, Scale};
use distmind_runtime::client::{BatchInput, InferOptions, Response, RuntimeClient};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::sim::SimExecutor;
use distmind_runtime::exec::Executor;
use distmind_runtime::exec::{HostTensor, TensorData};
use distmind_runtime::npy::encode_npy;
use distmind_runtime::profile::{Profile, SHIPPED_ESTIMATED_PATH};
use distmind_runtime::server::{RuntimeConfig, RuntimeMonitor, RuntimeServer};

const TIMEOUT: Duration = Duration::from_secs(60);
const GROUP_BYTES: u64 = 16 << 10;

fn key() -> ClusterKey {
    ClusterKey::from_secret(b"runtime batch tests")
}

/// A controller, a memory server holding one tiny ResNet-152 package, and a
/// runtime with the cpu executor, all in this process.
struct Cluster {
    runtime: String,
    monitor: RuntimeMonitor,
    package: Package,
    _dir: tempfile::TempDir,
    /// Last: dropped after `stop` told the servers to finish.
    plane: common::ControlPlane,
}

impl Cluster {
    fn start() -> Cluster {
        Cluster::start_with(Family::Resnet152)
    }

    /// The cluster serving a tiny package of `family` on the cpu executor.
    fn start_with(family: Family) -> Cluster {
        Cluster::start_on(family, Arc::new(CpuExecutor::new()))
    }

    /// The cluster serving a tiny package of `family` on `executor`.
    fn start_on(family: Family, executor: Arc<dyn Executor>) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let opts = GenOptions {
            scale: Scale::Tiny,
            group_bytes: GROUP_BYTES,
            ..GenOptions::new(family, dir.path())
        };
        let package = Package::open(&generate(&opts).unwrap()[0]).unwrap();
        let plane = common::ControlPlane::start(&key(), TIMEOUT);
        let mut cc = plane.controller_client(&key(), TIMEOUT);
        deploy(&mut cc, &plane.memserver, &package);
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
        let server = plane.rt.block_on(RuntimeServer::bind(config)).unwrap();
        let runtime = server.local_addr().to_string();
        let monitor = server.monitor();
        plane.rt.spawn(server.serve(plane.shutdown()));
        Cluster {
            runtime,
            monitor,
            package,
            _dir: dir,
            plane,
        }
    }

    fn client(&self) -> RuntimeClient {
        RuntimeClient::connect(&self.runtime, &key(), TIMEOUT).unwrap()
    }

    fn model(&self) -> &str {
        &self.package.manifest.name
    }

    /// An input of `rows` rows whose values depend on `seed`.
    fn input(&self, rows: usize, seed: usize) -> HostTensor {
        let mut shape = self.package.manifest.inputs[0].shape.clone();
        shape[0] = rows;
        let n: usize = shape.iter().product();
        HostTensor::f32(
            shape,
            (0..n)
                .map(|k| (((k + 13 * seed) * 37 % 101) as f32 / 50.0) - 1.0)
                .collect(),
        )
    }

    /// `rows` sequences of `len` token ids that depend on `seed`.
    fn tokens(&self, rows: usize, len: usize, seed: usize) -> HostTensor {
        HostTensor::i64(
            vec![rows, len],
            (0..rows * len)
                .map(|k| ((k * 7 + seed * 13) % 100) as i64)
                .collect(),
        )
    }

    /// What `input` gives when it runs alone.
    fn alone(&self, client: &mut RuntimeClient, input: &HostTensor) -> Vec<HostTensor> {
        let i = client
            .infer_with(self.model(), input, InferOptions::default())
            .unwrap();
        assert_eq!(i.timing.batch_requests, 1);
        i.outputs
    }

    /// Sends `requests` as one batch and returns every reply by id.
    fn batch(
        &self,
        client: &mut RuntimeClient,
        requests: &[BatchInput<'_>],
    ) -> (Vec<u64>, HashMap<u64, Response>) {
        let ids = client
            .send_infer_batch(self.model(), None, requests)
            .unwrap();
        let mut replies = HashMap::new();
        for _ in 0..ids.len() {
            let r = client.recv().unwrap();
            assert!(
                ids.contains(&r.id()),
                "a reply to {}, not in {ids:?}",
                r.id()
            );
            assert!(replies.insert(r.id(), r).is_none(), "two replies to one id");
        }
        (ids, replies)
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

fn output(r: &Response) -> &distmind_runtime::client::Inference {
    match r {
        Response::Output(i) => i,
        other => panic!("expected outputs, got {other:?}"),
    }
}

fn error(r: &Response) -> (ErrorCode, &str) {
    match r {
        Response::Error { error, .. } => (error.code, error.message.as_str()),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// Largest absolute difference between two lists of outputs of the same
/// shapes (panics, short, when shapes or dtypes differ).
fn max_diff(a: &[HostTensor], b: &[HostTensor]) -> f32 {
    assert_eq!(a.len(), b.len(), "output counts");
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.shape, y.shape, "output shapes");
        match (&x.data, &y.data) {
            (TensorData::F32(p), TensorData::F32(q)) => {
                for (u, v) in p.iter().zip(q) {
                    worst = worst.max((u - v).abs());
                }
            }
            (TensorData::I64(p), TensorData::I64(q)) => assert_eq!(p, q),
            _ => panic!("output dtypes differ"),
        }
    }
    worst
}

/// The cpu executor's kernels may sum in another order at another batch
/// size (candle's conv and matmul tile by the batch), so a row computed in a
/// batch may differ from the same row alone in the last bits: within this,
/// where outputs of different inputs differ by orders of magnitude more
/// (checked in each test, so a mixed-up row fails).
const ROW_TOLERANCE: f32 = 1e-5;

/// `got` matches `want` within [`ROW_TOLERANCE`] and is farther than that
/// from every output in `others`.
fn assert_rows(what: &str, got: &[HostTensor], want: &[HostTensor], others: &[&[HostTensor]]) {
    let d = max_diff(got, want);
    assert!(
        d <= ROW_TOLERANCE,
        "{what}: differs from its run alone by {d}"
    );
    for o in others {
        let d = max_diff(got, o);
        assert!(
            d > 100.0 * ROW_TOLERANCE,
            "{what}: as close to another request's outputs ({d})"
        );
    }
}

fn plain(input: &HostTensor) -> BatchInput<'_> {
    BatchInput {
        input,
        deadline_ms: None,
        trace: false,
    }
}

#[test]
fn a_batch_gives_each_request_the_rows_it_gets_alone() {
    let c = Cluster::start();
    let mut client = c.client();
    // Row counts 1, 2, 1: the split follows each request's own rows.
    let inputs = [c.input(1, 1), c.input(2, 2), c.input(1, 3)];
    let alone: Vec<Vec<HostTensor>> = inputs.iter().map(|x| c.alone(&mut client, x)).collect();
    let mut requests: Vec<BatchInput<'_>> = inputs.iter().map(plain).collect();
    requests[1].trace = true;
    let (ids, replies) = c.batch(&mut client, &requests);
    for (k, id) in ids.iter().enumerate() {
        let i = output(&replies[id]);
        assert_eq!(i.timing.batch_requests, 3, "request {k}");
        let others: Vec<&[HostTensor]> = (0..3)
            .filter(|&j| j != k && alone[j][0].shape == alone[k][0].shape)
            .map(|j| alone[j].as_slice())
            .collect();
        assert_rows(&format!("request {k}"), &i.outputs, &alone[k], &others);
        assert_eq!(
            i.trace.is_some(),
            k == 1,
            "only request 1 asked for a trace"
        );
    }
    // One run for all three: the same timing in every reply.
    let t0 = &output(&replies[&ids[0]]).timing;
    assert!(ids
        .iter()
        .all(|id| output(&replies[id]).timing.compute_ms == t0.compute_ms));
}

#[test]
fn a_request_whose_input_does_not_fit_is_refused_and_the_rest_run() {
    let c = Cluster::start();
    let mut client = c.client();
    let good = [c.input(1, 4), c.input(1, 5)];
    let alone: Vec<Vec<HostTensor>> = good.iter().map(|x| c.alone(&mut client, x)).collect();
    let spec = c.package.manifest.inputs[0].shape.clone();
    let mut wrong_shape = spec.clone();
    wrong_shape[0] = 1;
    *wrong_shape.last_mut().unwrap() += 1;
    let n: usize = wrong_shape.iter().product();
    let wrong = HostTensor::f32(wrong_shape.clone(), vec![0.5; n]);
    let (ids, replies) = c.batch(
        &mut client,
        &[plain(&good[0]), plain(&wrong), plain(&good[1])],
    );
    let (code, message) = error(&replies[&ids[1]]);
    assert_eq!(code, ErrorCode::BadRequest);
    let expected = format!(
        "f32 [batch, {}, {}, {}] (batch >= 1)",
        spec[1], spec[2], spec[3]
    );
    assert!(
        message.contains(&format!("request {}", ids[1]))
            && message.contains("request 2 of a batch of 3")
            && message.contains(&format!("{wrong_shape:?}"))
            && message.contains(&expected),
        "the error names the request, what came and what is expected: {message}"
    );
    for (k, id) in [ids[0], ids[2]].iter().enumerate() {
        let i = output(&replies[id]);
        assert_eq!(i.timing.batch_requests, 2, "the two that fit ran together");
        assert_rows(
            &format!("request {k}"),
            &i.outputs,
            &alone[k],
            &[&alone[1 - k]],
        );
    }
}

/// A batch whose requests have different sequence lengths (the dispatcher
/// coalesces without looking at shapes) runs one group per length: every
/// request gets the rows it gets alone, those of one length share a run,
/// and one past the position table is refused while the rest run.
#[test]
fn a_batch_of_different_lengths_runs_one_group_per_length() {
    for family in [Family::Gpt2, Family::BertBase] {
        let c = Cluster::start_with(family);
        let mut client = c.client();
        // Lengths 16, 40, 16, 64 (the table's last row), with 1 or 2 rows each.
        let inputs = [
            c.tokens(1, 16, 1),
            c.tokens(2, 40, 2),
            c.tokens(1, 16, 3),
            c.tokens(1, 64, 4),
        ];
        let alone: Vec<Vec<HostTensor>> = inputs.iter().map(|x| c.alone(&mut client, x)).collect();
        let too_long = c.tokens(1, 65, 5);
        let mut requests: Vec<BatchInput<'_>> = inputs.iter().map(plain).collect();
        requests.insert(2, plain(&too_long));
        let (ids, replies) = c.batch(&mut client, &requests);
        let (code, message) = error(&replies[&ids[2]]);
        assert_eq!(code, ErrorCode::BadRequest, "{family}");
        assert!(
            message.contains("request 3 of a batch of 5")
                && message.contains("i64 [1, 65]")
                && message.contains("i64 [batch, tokens] (batch >= 1, tokens 1..=64)"),
            "{family}: {message}"
        );
        let answered: Vec<u64> = ids.iter().copied().filter(|&id| id != ids[2]).collect();
        // (request, rows, length, requests in its run)
        let want = [(0, 1, 16, 2), (1, 2, 40, 1), (2, 1, 16, 2), (3, 1, 64, 1)];
        for (k, rows, len, together) in want {
            let i = output(&replies[&answered[k]]);
            assert_eq!(i.outputs[0].shape, [rows, len, 32], "{family} request {k}");
            assert_eq!(
                i.timing.batch_requests, together,
                "{family} request {k}: only requests of its length share its run"
            );
            let others: Vec<&[HostTensor]> = (0..4)
                .filter(|&j| j != k && alone[j][0].shape == alone[k][0].shape)
                .map(|j| alone[j].as_slice())
                .collect();
            assert_rows(
                &format!("{family} request {k}"),
                &i.outputs,
                &alone[k],
                &others,
            );
        }
        // The two length-16 requests ran together: one timing for both.
        assert_eq!(
            output(&replies[&answered[0]]).timing.compute_ms,
            output(&replies[&answered[2]]).timing.compute_ms
        );
    }
}

/// The groups of a mixed-length batch run one after the other: a request
/// of a later group whose deadline passes while an earlier group runs is
/// answered with `DeadlineExceeded` saying so, not run. The sim executor at
/// a 1000x dilated clock makes the first group take about a second, and
/// the deadline is a third of its measured time alone.
#[test]
fn a_later_length_group_whose_deadline_passes_meanwhile_is_not_run() {
    let profile = Profile::load(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(SHIPPED_ESTIMATED_PATH),
    )
    .unwrap();
    let sim = SimExecutor::with_dilation(profile, 1000.0).unwrap();
    let c = Cluster::start_on(Family::Gpt2, Arc::new(sim));
    let mut client = c.client();
    let first = c.tokens(2, 64, 1);
    let later = c.tokens(1, 16, 2);
    // Alone (and warm: the model resident after the first run).
    c.alone(&mut client, &first);
    let start = Instant::now();
    c.alone(&mut client, &first);
    let first_alone = start.elapsed();
    assert!(
        first_alone > Duration::from_millis(300),
        "the first group must take long enough to outlast the deadline: {first_alone:?}"
    );
    let deadline_ms = (first_alone.as_millis() / 3) as u64;
    println!("first group alone: {first_alone:?}; the later request's deadline: {deadline_ms} ms");
    let requests = [
        plain(&first),
        BatchInput {
            input: &later,
            deadline_ms: Some(deadline_ms),
            trace: false,
        },
    ];
    let (ids, replies) = c.batch(&mut client, &requests);
    let i = output(&replies[&ids[0]]);
    assert_eq!(i.outputs[0].shape, [2, 64, 32]);
    assert_eq!(i.timing.batch_requests, 1);
    let (code, message) = error(&replies[&ids[1]]);
    assert_eq!(code, ErrorCode::DeadlineExceeded, "{message}");
    assert!(
        message.contains(&format!("deadline of {deadline_ms} ms"))
            && message.contains("requests of other shapes"),
        "{message}"
    );
}

#[test]
fn an_expired_request_is_left_out_of_its_batch() {
    let c = Cluster::start();
    let mut client = c.client();
    let inputs = [c.input(1, 6), c.input(1, 7), c.input(1, 8)];
    let alone = c.alone(&mut client, &inputs[2]);
    let requests = [
        // A deadline of 0 ms has passed by the time any batch starts.
        BatchInput {
            deadline_ms: Some(0),
            ..plain(&inputs[0])
        },
        BatchInput {
            deadline_ms: Some(0),
            ..plain(&inputs[1])
        },
        BatchInput {
            deadline_ms: Some(60_000),
            ..plain(&inputs[2])
        },
    ];
    let (ids, replies) = c.batch(&mut client, &requests);
    for id in &ids[..2] {
        let (code, message) = error(&replies[id]);
        assert_eq!(code, ErrorCode::DeadlineExceeded);
        assert!(message.contains(&format!("request {id}")), "{message}");
    }
    let i = output(&replies[&ids[2]]);
    assert_eq!(i.timing.batch_requests, 1, "it ran alone");
    assert_eq!(
        i.outputs, alone,
        "alone both times: the same kernels, the same bits"
    );
}

#[test]
fn a_full_batch_runs_and_one_over_the_bound_is_refused_whole() {
    let c = Cluster::start();
    let mut client = c.client();
    let x = c.input(1, 9);
    let full: Vec<BatchInput<'_>> = (0..=BATCH_MEMBERS_MAX).map(|_| plain(&x)).collect();
    let (ids, replies) = c.batch(&mut client, &full);
    let alone = c.alone(&mut client, &x);
    for id in &ids {
        let i = output(&replies[id]);
        assert_eq!(i.timing.batch_requests as usize, 1 + BATCH_MEMBERS_MAX);
        assert_rows("a request of the full batch", &i.outputs, &alone, &[]);
    }
    let over: Vec<BatchInput<'_>> = (0..BATCH_MEMBERS_MAX + 2).map(|_| plain(&x)).collect();
    let e = client.send_infer_batch(c.model(), None, &over).unwrap_err();
    assert!(e.to_string().contains("a batch of 65 requests"), "{e}");

    // The server's own check, on a raw connection: every request refused,
    // every input frame skipped, and the connection goes on.
    let addr: std::net::SocketAddr = c.runtime.parse().unwrap();
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    handshake::client_sync(&mut s, &key(), Role::Control).unwrap();
    let members: Vec<BatchMember> = (2..=BATCH_MEMBERS_MAX as u64 + 2)
        .map(|id| BatchMember {
            id,
            deadline_ms: None,
            trace: false,
        })
        .collect();
    let frame = encode_npy(&x);
    wire::send_message_sync(
        &mut s,
        &RuntimeRequest::Infer {
            id: 1,
            model: c.model().to_string(),
            deadline_ms: None,
            trace: false,
            device: None,
            batch: members,
            catalog_version: None,
        },
    )
    .unwrap();
    for _ in 0..BATCH_MEMBERS_MAX + 2 {
        wire::write_frame_sync(&mut s, FrameKind::WriteChunk, &[&frame]).unwrap();
    }
    wire::send_message_sync(&mut s, &RuntimeRequest::Stats { id: 1000 }).unwrap();
    let mut refused = Vec::new();
    loop {
        let reply: RuntimeReply = wire::recv_message_sync(&mut s, 16 << 20).unwrap();
        match reply {
            RuntimeReply::Error { id, error } => {
                assert_eq!(error.code, ErrorCode::BadRequest);
                assert!(
                    error.message.contains("at most 64 run together"),
                    "{}",
                    error.message
                );
                refused.push(id);
            }
            RuntimeReply::Stats { id, .. } => {
                assert_eq!(id, 1000);
                break;
            }
            other => panic!("unexpected reply {other:?}"),
        }
    }
    refused.sort_unstable();
    assert_eq!(
        refused,
        (1..=BATCH_MEMBERS_MAX as u64 + 2).collect::<Vec<_>>()
    );
}

#[test]
fn requests_share_one_catalog_refresh_and_a_newer_version_refreshes_once() {
    let c = Cluster::start();
    let x = c.input(1, 10);
    assert_eq!(c.monitor.catalog_refreshes(), 0);
    // Four connections, two requests each in flight, for a model the
    // runtime has never resolved.
    let run = |opts: InferOptions| {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let mut client = c.client();
                        let ids = [
                            client.send_infer(c.model(), &x, opts).unwrap(),
                            client.send_infer(c.model(), &x, opts).unwrap(),
                        ];
                        for _ in ids {
                            let r = client.recv().unwrap();
                            assert!(ids.contains(&r.id()));
                            output(&r);
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        })
    };
    run(InferOptions::default());
    assert_eq!(
        c.monitor.catalog_refreshes(),
        1,
        "one catalog call for 8 requests"
    );
    let mut cc = c.plane.controller_client(&key(), TIMEOUT);
    let v0 = cc.get_model(c.model()).unwrap().version;
    run(InferOptions {
        catalog_version: Some(v0),
        ..InferOptions::default()
    });
    assert_eq!(
        c.monitor.catalog_refreshes(),
        1,
        "the plan serves its own version"
    );
    // Deployed again: the catalog's version grows.
    deploy(&mut cc, &c.plane.memserver, &c.package);
    let v1 = cc.get_model(c.model()).unwrap().version;
    assert!(v1 > v0, "versions {v0} then {v1}");
    run(InferOptions {
        catalog_version: Some(v1),
        ..InferOptions::default()
    });
    assert_eq!(
        c.monitor.catalog_refreshes(),
        2,
        "one refresh for the newer version"
    );
    run(InferOptions::default());
    assert_eq!(c.monitor.catalog_refreshes(), 2);
}
