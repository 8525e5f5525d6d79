//! Distributed training jobs through a real controller: `distmind train
//! submit|status|stop` against a controller, a memory server and a GPU
//! server on loopback, a tiny model deployed. A real GPU server runs a job
//! to its end; a GPU server played by the test over the real protocol
//! checks the two-step start, and test clients play the workers'
//! sync-group asks and reports.

mod support;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use distmind_common::handshake;
use distmind_common::proto::{
    ControllerReply, ControllerRequest, DataPeer, ErrorCode, ErrorReply, GroupLocation, Location,
    RuntimeReply, RuntimeRequest, Slice, StageAssignment, TrainJobState, TrainJobStatus,
};
use distmind_common::train_spec::JobSpec;
use distmind_common::wire::{self, Role};
use distmind_controller::ControllerClient;
use distmind_memserver::MemserverClient;
use distmind_models::Package;
use support::*;

fn spec_json(name: &str, model: &str, extra: &str) -> String {
    format!(
        r#"{{"name": "{name}", "model": "{model}", "optimizer": {{"sgd": {{"lr": 0.05, "momentum": 0.9}}}},
            "batch": 4, "microbatches": 2, "pipelines": 1, "stages": 2, "iterations": 3{extra}}}"#
    )
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn jobs_run_on_the_gpu_servers_and_refuse_bad_specs() {
    let tmp = tempfile::tempdir().unwrap();
    let pkgs = gen_tiny(tmp.path(), "resnet152", 1, 64 << 10);
    let pkg = Package::open(&pkgs[0]).unwrap();
    let model = pkg.manifest.name.clone();
    let layers = pkg.manifest.layers.len();
    let controller = spawn_controller();
    let _ms = spawn_memserver(&controller.addr, "32MiB");
    wait_alive(&controller.addr, 1);
    let (ok, _, stderr) = deploy(&controller.addr, &[], &pkgs);
    assert!(ok, "{stderr}");
    let runtime = spawn_runtime(&controller.addr, &["--devices", "0,1", "--cache", "64MiB"]);
    let rt = wait_runtime_alive(&controller.addr, &runtime.addr);
    let key = cluster_key();
    let mut c = ControllerClient::connect(&controller.addr, &key, Duration::from_secs(5)).unwrap();

    // A good spec: placed on the runtime's two devices at once, and the
    // controller sends their TrainStage.
    let good = write(tmp.path(), "good.json", &spec_json("tiny", &model, ""));
    let (ok, stdout, stderr) = train_cli(&controller.addr, &["submit", "--spec", &good]);
    assert!(ok, "submit failed: {stderr}");
    let id = stdout
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("submitted "))
        .unwrap_or_else(|| panic!("no job id in {stdout:?}"))
        .to_string();
    assert_eq!(id, "tiny-1");
    assert!(stdout.contains("tiny-1  placing"), "{stdout}");
    // Placing, or failed already (see below).
    let (ok, stdout, stderr) = train_cli(&controller.addr, &["status"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.starts_with("tiny-1  ")
            && stdout.contains(&format!("  model {model} ({layers} layers)")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("{} {}", rt.id, runtime.addr)),
        "the placement names the runtime: {stdout}"
    );
    let half = layers.div_ceil(2);
    assert!(
        stdout.contains(&format!("0..{half}")) && stdout.contains(&format!("{half}..{layers}")),
        "{stdout}"
    );

    // Inconsistent specs are refused, naming the field.
    let cases = [
        (
            "sum.json",
            spec_json("bad", &model, r#", "partition": [20, 20]"#),
            format!("partition = [20, 20] (sum 40): must sum to the model's {layers} layers"),
        ),
        (
            "ring.json",
            spec_json("bad", &model, r#", "sync": {"ring": {}}"#),
            "sync.ring: unknown variant `ring`".to_string(),
        ),
        (
            "huge.json",
            spec_json("bad", &model, "")
                .replace(
                    r#""pipelines": 1, "stages": 2"#,
                    r#""pipelines": 64, "stages": 16"#,
                )
                .replace(
                    r#""batch": 4, "microbatches": 2"#,
                    r#""batch": 16, "microbatches": 16"#,
                ),
            "pipelines x stages = 64 x 16 = 1024".to_string(),
        ),
    ];
    for (file, text, says) in &cases {
        let path = write(tmp.path(), file, text);
        let (ok, stdout, stderr) = train_cli(&controller.addr, &["submit", "--spec", &path]);
        assert!(!ok, "{file} was accepted: {stdout}");
        assert!(stderr.contains(says.as_str()), "{file}: {stderr}");
    }
    // The controller checks specs itself too (other clients than the CLI).
    let mut huge: JobSpec = serde_json::from_str(&cases[2].1).unwrap();
    huge.name = "raw".into();
    let e = c
        .request(&ControllerRequest::TrainSubmit {
            spec: Box::new(huge),
        })
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest));
    assert!(
        e.to_string().contains("pipelines x stages = 64 x 16"),
        "{e}"
    );
    let mut unknown: JobSpec = serde_json::from_str(&spec_json("raw", "nope", "")).unwrap();
    unknown.name = "raw".into();
    let e = c
        .request(&ControllerRequest::TrainSubmit {
            spec: Box::new(unknown),
        })
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownModel), "{e}");

    // The GPU server runs the two stage workers: they load their layers
    // from the memory server, train the spec's iterations on the cpu
    // executor, report, and the job finishes.
    let done = wait_job(&mut c, &id, |s| s.is_terminal());
    assert!(done.state == TrainJobState::Finished, "{done:?}");
    let (ok, stdout, stderr) = train_cli(&controller.addr, &["status", "--job", &id]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("tiny-1  finished"), "{stdout}");
    let (ok, _, stderr) = train_cli(&controller.addr, &["stop", "--job", &id]);
    assert!(
        !ok && stderr.contains("job tiny-1 is finished: cannot stop"),
        "{stderr}"
    );
    let (ok, _, stderr) = train_cli(&controller.addr, &["status", "--job", "nope-7"]);
    assert!(
        !ok && stderr.contains("no training job \"nope-7\""),
        "{stderr}"
    );
}

/// DynPipe carried out on a real GPU server: 1 x 3 stage workers of tiny
/// ResNet-152 on the cpu executor; stage 1 turns 3x slower at iteration 4,
/// the monitor (window 2, baseline at 4) triggers at 6 and the job drains,
/// checkpoints pipeline 0's stages to the memory server, and generation 1
/// reloads them on the new partition and runs to the end.
#[test]
fn dynpipe_repartitions_a_running_job_through_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let pkgs = gen_tiny(tmp.path(), "resnet152", 1, 64 << 10);
    let pkg = Package::open(&pkgs[0]).unwrap();
    let model = pkg.manifest.name.clone();
    let controller = spawn_controller();
    let _ms = spawn_memserver(&controller.addr, "64MiB");
    wait_alive(&controller.addr, 1);
    let (ok, _, stderr) = deploy(&controller.addr, &[], &pkgs);
    assert!(ok, "{stderr}");
    let runtime = spawn_runtime(
        &controller.addr,
        &["--devices", "0,1,2", "--cache", "128MiB"],
    );
    wait_runtime_alive(&controller.addr, &runtime.addr);
    let key = cluster_key();
    let mut c = ControllerClient::connect(&controller.addr, &key, Duration::from_secs(5)).unwrap();

    let spec = spec_json(
        "dyn",
        &model,
        r#", "dynamic": {"enabled": true, "window": 2, "baseline_at": 4, "delay": 2},
            "interference": {"slowdowns": [{"stage": 1, "factor": 3.0, "at_iteration": 4}]}"#,
    )
    .replace(
        r#""stages": 2, "iterations": 3"#,
        r#""stages": 3, "iterations": 12"#,
    )
    .replace(
        r#""batch": 4, "microbatches": 2"#,
        r#""batch": 6, "microbatches": 3"#,
    );
    let path = write(tmp.path(), "dyn.json", &spec);
    let (ok, stdout, stderr) = train_cli(&controller.addr, &["submit", "--spec", &path]);
    assert!(ok, "submit failed: {stderr}");
    assert!(stdout.starts_with("submitted dyn-1"), "{stdout}");
    let first = train_status(&mut c, "dyn-1").partition;

    let deadline = Instant::now() + Duration::from_secs(90);
    let mut saw_repartitioning = false;
    let done = loop {
        let st = train_status(&mut c, "dyn-1");
        saw_repartitioning |= st.state == TrainJobState::Repartitioning;
        if st.state.is_terminal() {
            break st;
        }
        assert!(Instant::now() < deadline, "the job stays {st:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(done.state, TrainJobState::Finished, "{done:?}");
    assert!(saw_repartitioning, "the job re-partitioned: {done:?}");
    // Exactly one re-partitioning: generation 1, on the decision's
    // partition, which moved layers.
    assert_eq!(done.generation, 1, "{done:?}");
    let d = done.repartition.as_ref().expect("DynPipe's decision");
    assert_eq!(d.generation, 0);
    assert_eq!(d.old_partition, first);
    assert_ne!(d.new_partition, first);
    assert_eq!(done.partition, d.new_partition);
    // The checkpoint: written by the 3 stages, put in the catalog,
    // reloaded bit for bit by the new partition's workers.
    let ck = done.checkpoint.as_ref().expect("the checkpoint");
    assert_eq!(ck.model, "dyn-1-g1");
    assert_eq!(ck.generation, 0);
    assert!(ck.after_iteration >= d.at_iteration && ck.after_iteration < 12);
    assert!(ck.catalog_version.is_some(), "{ck:?}");
    let written = ck.written.expect("every stage wrote its part");
    assert_eq!(ck.loaded, vec![Some(written)], "reloaded params differ");
    let e = c.get_model("dyn-1-g1").unwrap();
    assert_eq!(e.groups.len(), 3, "one group per drained stage");
    // Generation 1 ran from the drained iteration to the end.
    for s in &done.stages {
        assert_eq!(s.iteration, Some(12), "{s:?}");
    }
    let (ok, stdout, stderr) = train_cli(&controller.addr, &["status", "--job", "dyn-1"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains(&format!("partition {:?} (generation 1)", d.new_partition))
            && stdout.contains("checkpoint: dyn-1-g1"),
        "{stdout}"
    );
}

/// Polls the job's status until `done` says so (bounded, no fixed sleep).
fn wait_job(
    c: &mut ControllerClient,
    id: &str,
    done: impl Fn(&TrainJobState) -> bool,
) -> TrainJobStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = train_status(c, id);
        if done(&st.state) {
            return st;
        }
        assert!(Instant::now() < deadline, "job {id} stays {:?}", st);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What the fake GPU server was asked.
#[derive(Debug)]
enum Asked {
    Stage(Box<StageAssignment>),
    Start {
        pipeline: u32,
        stage: u32,
        prev: Option<DataPeer>,
        next: Option<DataPeer>,
        replicas: Vec<DataPeer>,
    },
    Stop {
        job: String,
        pipeline: u32,
        stage: u32,
    },
}

/// The data address the fake GPU server gives worker `worker` of a job.
fn data_addr(worker: u32) -> String {
    format!("127.0.0.1:{}", 41000 + worker)
}

/// A GPU server played by the test over the real protocol: registered with
/// the controller (4 devices) and heartbeating, it answers every stage
/// worker's `TrainStage` ready, `TrainStageStart` started and
/// `TrainStageStop` stopped, and tells the test what it was asked.
struct FakeRuntime {
    addr: String,
    asked: mpsc::Receiver<Asked>,
    stop: Arc<AtomicBool>,
}

impl Drop for FakeRuntime {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl FakeRuntime {
    fn start(controller: &str) -> FakeRuntime {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, asked) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let Ok((s, _)) = listener.accept().await else {
                        return;
                    };
                    tokio::spawn(serve_fake(s, tx.clone()));
                }
            });
        });
        let key = cluster_key();
        let mut c = ControllerClient::connect(controller, &key, Duration::from_secs(5)).unwrap();
        let boot_id = u64::from(std::process::id()) << 16 | 0xfa;
        let (runtime, interval_ms) = match c
            .request(&ControllerRequest::RegisterRuntime {
                addr: addr.clone(),
                devices: 4,
                executor: "fake".into(),
                boot_id,
                device_ids: Vec::new(),
                cache_bytes: 0,
                device_bytes: 0,
                resident_models_max: 0,
            })
            .unwrap()
        {
            ControllerReply::RuntimeRegistered {
                runtime,
                heartbeat_interval_ms,
            } => (runtime, heartbeat_interval_ms),
            r => panic!("{r:?}"),
        };
        let beating = stop.clone();
        std::thread::spawn(move || {
            while !beating.load(Ordering::Relaxed) {
                let beat = ControllerRequest::RuntimeHeartbeat {
                    runtime,
                    boot_id,
                    queued: 0,
                    snapshot: None,
                };
                if c.request(&beat).is_err() {
                    return;
                }
                // Periodic work, not a wait for readiness.
                std::thread::sleep(Duration::from_millis(interval_ms / 3));
            }
        });
        FakeRuntime { addr, asked, stop }
    }

    fn next(&self) -> Asked {
        self.asked
            .recv_timeout(Duration::from_secs(30))
            .expect("the controller asked the fake GPU server nothing for 30 s")
    }
}

async fn serve_fake(mut s: tokio::net::TcpStream, asked: mpsc::Sender<Asked>) {
    if handshake::server(&mut s, &cluster_key()).await.is_err() {
        return;
    }
    while let Ok(req) = wire::recv_message::<_, RuntimeRequest>(&mut s, 16 << 20).await {
        let reply = match req {
            RuntimeRequest::TrainStage { id, assignment } => {
                let a = &*assignment;
                let reply = RuntimeReply::TrainStageReady {
                    id,
                    job: a.job.clone(),
                    generation: a.generation,
                    pipeline: a.pipeline,
                    stage: a.stage,
                    data_addr: data_addr(a.pipeline * a.spec.stages + a.stage),
                    layer_checksums: Vec::new(),
                };
                let _ = asked.send(Asked::Stage(assignment));
                reply
            }
            RuntimeRequest::TrainStageStart {
                id,
                job,
                generation,
                pipeline,
                stage,
                prev,
                next,
                replicas,
            } => {
                let _ = asked.send(Asked::Start {
                    pipeline,
                    stage,
                    prev,
                    next,
                    replicas,
                });
                RuntimeReply::TrainStageStarted {
                    id,
                    job,
                    generation,
                    pipeline,
                    stage,
                }
            }
            RuntimeRequest::TrainStageStop {
                id,
                job,
                pipeline,
                stage,
                ..
            } => {
                let _ = asked.send(Asked::Stop {
                    job,
                    pipeline,
                    stage,
                });
                RuntimeReply::Training {
                    id,
                    device: 0,
                    model: None,
                    iterations: 0,
                }
            }
            other => RuntimeReply::Error {
                id: 0,
                error: ErrorReply::new(ErrorCode::Unsupported, format!("fake: {other:?}")),
            },
        };
        if wire::send_message(&mut s, &reply).await.is_err() {
            return;
        }
    }
}

/// Submits `spec` and answers its start as the fake GPU server; returns
/// the job id once it runs.
fn start_job(c: &mut ControllerClient, fake: &FakeRuntime, spec: &str) -> String {
    let spec = JobSpec::from_json(spec).unwrap();
    let (p, s) = (spec.pipelines, spec.stages);
    let id = match c
        .request(&ControllerRequest::TrainSubmit {
            spec: Box::new(spec),
        })
        .unwrap()
    {
        ControllerReply::TrainSubmitted { job } => job.id,
        r => panic!("{r:?}"),
    };
    for _ in 0..p * s {
        match fake.next() {
            Asked::Stage(a) => assert_eq!(a.job, id),
            a => panic!("{a:?}"),
        }
    }
    let peer = |pipeline: u32, stage: u32| DataPeer {
        pipeline,
        stage,
        worker: pipeline * s + stage,
        data_addr: data_addr(pipeline * s + stage),
    };
    for _ in 0..p * s {
        match fake.next() {
            Asked::Start {
                pipeline,
                stage,
                prev,
                next,
                replicas,
            } => {
                assert_eq!(prev, (stage > 0).then(|| peer(pipeline, stage - 1)));
                assert_eq!(next, (stage + 1 < s).then(|| peer(pipeline, stage + 1)));
                assert_eq!(replicas, (0..p).map(|q| peer(q, stage)).collect::<Vec<_>>());
            }
            a => panic!("{a:?}"),
        }
    }
    wait_job(c, &id, |s| *s == TrainJobState::Running);
    id
}

/// Asks for worker (`pipeline`, `stage`)'s group on a connection of its
/// own, in a thread: the reply comes when the group closes.
fn ask_group(
    controller: &str,
    job: &str,
    pipeline: u32,
    stage: u32,
    iteration: u64,
) -> std::thread::JoinHandle<(Vec<u32>, bool)> {
    let mut c =
        ControllerClient::connect(controller, &cluster_key(), Duration::from_secs(30)).unwrap();
    let req = ControllerRequest::TrainGroupReady {
        job: job.to_string(),
        generation: 0,
        pipeline,
        stage,
        iteration,
    };
    std::thread::spawn(move || match c.request(&req).unwrap() {
        ControllerReply::TrainGroup {
            members,
            stop,
            stage: st,
            iteration: it,
            ..
        } => {
            assert_eq!((st, it), (stage, iteration));
            (members, stop)
        }
        r => panic!("{r:?}"),
    })
}

/// A controller (no dispatcher), a memory server with a tiny ResNet-152
/// deployed, and a [`FakeRuntime`] registered with them; each stopped when
/// dropped (bind every field: one left to `..` is dropped at once).
struct FakeCluster {
    model: String,
    controller: Proc,
    ms: Proc,
    fake: FakeRuntime,
    c: ControllerClient,
    _tmp: tempfile::TempDir,
}

impl FakeCluster {
    fn start() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let pkgs = gen_tiny(tmp.path(), "resnet152", 1, 64 << 10);
        let model = Package::open(&pkgs[0]).unwrap().manifest.name.clone();
        // No dispatcher: training jobs do not need one.
        let s = settings_dir();
        let controller = spawn_service(&[
            "controller",
            "--settings",
            s.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--no-dispatcher",
        ]);
        let ms = spawn_memserver(&controller.addr, "32MiB");
        wait_alive(&controller.addr, 1);
        let (ok, _, stderr) = deploy(&controller.addr, &[], &pkgs);
        assert!(ok, "{stderr}");
        let fake = FakeRuntime::start(&controller.addr);
        wait_runtime_alive(&controller.addr, &fake.addr);
        let c = ControllerClient::connect(&controller.addr, &cluster_key(), Duration::from_secs(5))
            .unwrap();
        FakeCluster {
            model,
            controller,
            ms,
            fake,
            c,
            _tmp: tmp,
        }
    }
}

#[test]
fn stage_workers_start_in_two_steps_and_sync_in_groups() {
    let FakeCluster {
        model,
        controller,
        ms: _ms,
        fake,
        mut c,
        _tmp,
    } = FakeCluster::start();

    // allreduce, 2 pipelines x 2 stages: started in two steps (the peers'
    // data addresses checked in start_job), then every pipeline's replica
    // of a stage averages together.
    let spec = |name: &str, p: u32, st: u32, sync: &str| {
        format!(
            r#"{{"name": "{name}", "model": "{model}", "optimizer": {{"sgd": {{"lr": 0.05}}}},
                "batch": 4, "microbatches": 2, "pipelines": {p}, "stages": {st},
                "iterations": 3, "sync": {sync}}}"#
        )
    };
    let id = start_job(&mut c, &fake, &spec("ar", 2, 2, r#"{"allreduce": {}}"#));
    let asks = [0, 1].map(|p| ask_group(&controller.addr, &id, p, 0, 1));
    for a in asks {
        assert_eq!(a.join().unwrap(), (vec![0, 1], false));
    }
    // A worker whose connection drops while it waits asks again on a new
    // one and takes its own place in the group.
    let waiting = |c: &mut ControllerClient, n: u32| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while train_status(c, &id).group_asks_waiting != n {
            assert!(Instant::now() < deadline, "{n} asks never waited");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut raw = std::net::TcpStream::connect(&controller.addr).unwrap();
    handshake::client_sync(&mut raw, &cluster_key(), Role::Control).unwrap();
    let ask = ControllerRequest::TrainGroupReady {
        job: id.clone(),
        generation: 0,
        pipeline: 0,
        stage: 1,
        iteration: 1,
    };
    wire::send_message_sync(&mut raw, &ask).unwrap();
    waiting(&mut c, 1);
    drop(raw);
    waiting(&mut c, 0);
    let again = ask_group(&controller.addr, &id, 0, 1, 1);
    waiting(&mut c, 1);
    let other = ask_group(&controller.addr, &id, 1, 1, 1);
    assert_eq!(again.join().unwrap(), (vec![0, 1], false));
    assert_eq!(other.join().unwrap(), (vec![0, 1], false));

    // The workers report; `train status` shows them.
    for (p, st) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        match c
            .request(&ControllerRequest::TrainReport {
                job: id.clone(),
                pipeline: p,
                stage: st,
                iteration: 1,
                fwd_bwd_s: 0.02,
                loss: (st == 1).then_some(2.25),
                samples: 4,
            })
            .unwrap()
        {
            ControllerReply::TrainReported { state, stop, .. } => {
                assert_eq!((state, stop), (TrainJobState::Running, false))
            }
            r => panic!("{r:?}"),
        }
    }
    let (ok, stdout, stderr) = train_cli(&controller.addr, &["status", "--job", &id]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("ar-1  running") && stdout.contains("iteration 1/3"),
        "{stdout}"
    );
    assert!(stdout.contains("2.2500"), "the last stage's loss: {stdout}");

    // A stop releases an ask waiting for pipeline 1, and every worker is
    // told by its GPU server.
    let parked = ask_group(&controller.addr, &id, 0, 1, 2);
    waiting(&mut c, 1);
    let (ok, stdout, stderr) = train_cli(&controller.addr, &["stop", "--job", &id]);
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with("ar-1: stop"), "{stdout}");
    assert_eq!(parked.join().unwrap(), (vec![], true));
    let mut told = Vec::new();
    for _ in 0..4 {
        match fake.next() {
            Asked::Stop {
                job,
                pipeline,
                stage,
            } => {
                assert_eq!(job, id);
                told.push((pipeline, stage));
            }
            a => panic!("{a:?}"),
        }
    }
    told.sort();
    assert_eq!(told, vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
    // Their GPU server's answers count as heard: stopped, devices free.
    wait_job(&mut c, &id, |s| *s == TrainJobState::Stopped);

    // preduce, 3 pipelines: pipeline 2 is withheld, so the group closes at
    // its deadline without it.
    let id = start_job(
        &mut c,
        &fake,
        &spec("pr", 3, 1, r#"{"preduce": {"wait_ms_initial": 1500}}"#),
    );
    let asks = [0, 1].map(|p| ask_group(&controller.addr, &id, p, 0, 1));
    for a in asks {
        assert_eq!(a.join().unwrap(), (vec![0, 1], false));
    }
    let (ok, _, stderr) = train_cli(&controller.addr, &["stop", "--job", &id]);
    assert!(ok, "{stderr}");
}

/// Writes `bytes` as a checkpoint part of job `job` on memory server
/// `addr` (id 0), as a stage worker does: its group, for `TrainCheckpointed`.
fn write_part(addr: &str, job: &str, stage: u32, bytes: usize) -> GroupLocation {
    let data = vec![stage as u8 + 1; bytes];
    let mut m = MemserverClient::connect(addr, &cluster_key(), Duration::from_secs(5)).unwrap();
    let offset = m.alloc(bytes as u64, &format!("{job}-ckpt")).unwrap();
    m.write(offset, &data).unwrap();
    let sum = distmind_common::checksum::checksum(&data);
    m.commit(offset, sum).unwrap();
    let hex = distmind_common::checksum::to_hex(sum);
    GroupLocation {
        index: stage,
        bytes: bytes as u64,
        checksum: hex.clone(),
        slices: vec![Slice {
            group_offset: 0,
            len: bytes as u64,
            checksum: hex,
            replicas: vec![Location {
                memserver: 0,
                addr: addr.to_string(),
                offset,
            }],
        }],
    }
}

#[test]
fn checkpoint_parts_that_never_complete_are_freed_on_the_memory_server() {
    let FakeCluster {
        model,
        controller: _controller,
        ms,
        fake,
        mut c,
        _tmp,
    } = FakeCluster::start();
    // One pipeline of two stages, a periodic checkpoint every iteration.
    let id = start_job(
        &mut c,
        &fake,
        &spec_json("ck", &model, r#", "checkpoint_every": 1"#)
            .replace(r#""iterations": 3"#, r#""iterations": 10"#),
    );
    let layers: Vec<usize> = train_status(&mut c, &id)
        .stages
        .iter()
        .map(|s| (s.layers.end - s.layers.first) as usize)
        .collect();
    let checkpointed = |c: &mut ControllerClient, stage: u32, iteration: u64, group| {
        c.request(&ControllerRequest::TrainCheckpointed {
            job: id.clone(),
            generation: 0,
            pipeline: 0,
            stage,
            iteration,
            model: format!("{id}-ckpt"),
            group,
            layer_checksums: vec![1; layers[stage as usize]],
        })
    };
    let used = || used_bytes(&ms.addr);
    let freed_down_to = |want: u64| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while used() != want {
            assert!(
                Instant::now() < deadline,
                "{} bytes used on the memory server, {want} expected",
                used()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let base = used();
    // Stage 0's part of the checkpoint after iteration 1.
    let first = write_part(&ms.addr, &id, 0, 64 << 10);
    let with_first = used();
    assert!(with_first > base);
    let r = checkpointed(&mut c, 0, 1, first).unwrap();
    assert!(matches!(r, ControllerReply::TrainReported { .. }), "{r:?}");
    // Stage 1's part of the one after iteration 2 comes first: the older
    // one will never complete, and the controller frees its part.
    let second = write_part(&ms.addr, &id, 1, 64 << 10);
    let with_both = used();
    let r = checkpointed(&mut c, 1, 2, second).unwrap();
    assert!(matches!(r, ControllerReply::TrainReported { .. }), "{r:?}");
    freed_down_to(with_both - (with_first - base));
    // A refused part was never recorded: the controller leaves it to the
    // worker that wrote it (which frees it).
    let refused = write_part(&ms.addr, &id, 0, 64 << 10);
    let with_refused = used();
    assert!(checkpointed(&mut c, 0, 1, refused).is_err());
    // The job fails: the part of the checkpoint being written is freed.
    let r = c
        .request(&ControllerRequest::TrainFailed {
            job: id.clone(),
            pipeline: 0,
            stage: 1,
            reason: "test".into(),
        })
        .unwrap();
    assert!(matches!(r, ControllerReply::TrainReported { .. }), "{r:?}");
    freed_down_to(with_refused - (with_both - with_first));
    assert!(matches!(
        train_status(&mut c, &id).state,
        TrainJobState::Failed { .. }
    ));
}

#[test]
fn the_train_command_keeps_its_steps_and_explains_its_subcommands() {
    let (ok, stdout, _) = run(&["train", "--help"]);
    assert!(ok);
    for word in ["submit", "status", "stop", "--model", "--writeback"] {
        assert!(stdout.contains(word), "train --help lacks {word}: {stdout}");
    }
    let (ok, stdout, _) = run(&["train", "submit", "--help"]);
    assert!(
        ok && stdout.contains("--spec") && stdout.contains("--slowdown"),
        "{stdout}"
    );
    // Without a subcommand, --model is required as before.
    let (ok, _, stderr) = run(&["train"]);
    assert!(!ok && stderr.contains("--model"), "{stderr}");
    // A step's flags and a subcommand do not mix.
    let (ok, _, stderr) = run(&["train", "--model", "x", "status"]);
    assert!(!ok, "{stderr}");
}
