//! Training stage workers in real runtime servers, in-process on
//! 127.0.0.1: a controller, a memory server holding a tiny package, and two
//! `RuntimeServer`s with the cpu executor. The test submits the job to the
//! controller (`TrainSubmit`, which places it and takes its workers'
//! reports; its training driver is off) and plays the job's coordinator
//! itself, as the controller's driver does: `TrainStage` to every placed device, then `TrainStageStart` to
//! every worker with its neighbours' and replicas' data addresses.
//!
//! Covered: 2 pipelines x 3 stages of tiny ResNet-152 and of tiny GPT-2
//! with `allreduce` (the last stages' loss falls; after the final
//! all-reduce both replicas of every stage hold bit-identical weights: the
//! workers' `params_flat` checksums, read through the runtime's monitor);
//! bad assignments refused by name; a stop ends every worker; a worker
//! whose neighbour's runtime is shut down fails with a named error, and
//! nothing hangs.
//!
//! No test sleeps to wait for readiness or asserts a duration: waits poll
//! a condition under a generous deadline.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{
    ControllerReply, ControllerRequest, DataPeer, ErrorCode, LayerRange, RuntimeReply,
    RuntimeRequest, StageAssignment, StagePeer, StagePeers, TrainJobState, TrainJobStatus,
};
use distmind_common::train_spec::JobSpec;
use distmind_controller::ControllerClient;
use distmind_models::{generate, Family, GenOptions, Package, Scale};
use distmind_runtime::client::{InferOptions, Response, RuntimeClient, RuntimeClientError};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::HostTensor;
use distmind_runtime::server::{
    RuntimeConfig, RuntimeMonitor, RuntimeServer, StageEnd, StagePhase, StageWorkerStatus,
};
use tokio::sync::watch;

/// Generous: bounds a wait only when something is broken.
const TIMEOUT: Duration = Duration::from_secs(120);
const GROUP_BYTES: u64 = 16 << 10;

fn key() -> ClusterKey {
    ClusterKey::from_secret(b"stage worker tests")
}

fn tiny_package(dir: &Path, family: Family) -> Package {
    let opts = GenOptions {
        scale: Scale::Tiny,
        group_bytes: GROUP_BYTES,
        ..GenOptions::new(family, dir)
    };
    Package::open(&generate(&opts).expect("generate")[0]).expect("open")
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One runtime server and how to stop it.
struct Runtime {
    addr: String,
    monitor: RuntimeMonitor,
    stop: watch::Sender<bool>,
    served: Option<tokio::task::JoinHandle<()>>,
}

/// A controller, a memory server with one tiny package, and runtimes.
struct Cluster {
    runtimes: Vec<Runtime>,
    model: String,
    layers: usize,
    /// The model's input shape (batch 1).
    input: Vec<usize>,
    _dir: tempfile::TempDir,
    /// Last: dropped after every server finished.
    plane: common::ControlPlane,
}

impl Cluster {
    /// `devices[i]`: the device ordinals of runtime `i`.
    fn start(family: Family, devices: &[Vec<u32>]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let pkg = tiny_package(dir.path(), family);
        // The test plays the coordinator: the controller places the job,
        // forms its sync groups and takes its reports, and sends no stage
        // requests itself.
        let plane = common::ControlPlane::start_with(&key(), TIMEOUT, |cfg| {
            cfg.drive_training = false;
        });
        let shutdown = |rx: &watch::Receiver<bool>| {
            let mut rx = rx.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let mut c = plane.controller_client(&key(), TIMEOUT);
        common::deploy(&mut c, &plane.memserver, &pkg, &key(), TIMEOUT);
        let mut runtimes = Vec::new();
        for d in devices {
            let mut config = RuntimeConfig::new(
                "127.0.0.1:0".parse().unwrap(),
                key(),
                plane.controller.clone(),
                Arc::new(CpuExecutor::new()),
            );
            config.devices = d.clone();
            config.cache_bytes = 32 << 20;
            config.cache_block_bytes = 64 << 10;
            config.device_bytes = 32 << 20;
            config.huge_pages = false;
            let server = plane.rt.block_on(RuntimeServer::bind(config)).unwrap();
            let (rstop, rrx) = watch::channel(false);
            let addr = server.local_addr().to_string();
            let monitor = server.monitor();
            let served = plane.rt.spawn(async move {
                server.serve(shutdown(&rrx)).await.unwrap();
            });
            runtimes.push(Runtime {
                addr,
                monitor,
                stop: rstop,
                served: Some(served),
            });
        }
        wait_until("the runtimes to register", || {
            c.list_runtimes()
                .unwrap()
                .iter()
                .filter(|r| r.alive)
                .count()
                == devices.len()
        });
        Cluster {
            runtimes,
            model: pkg.manifest.name.clone(),
            layers: pkg.manifest.layers.len(),
            input: pkg.manifest.inputs[0].shape.clone(),
            _dir: dir,
            plane,
        }
    }

    fn controller(&self) -> ControllerClient {
        self.plane.controller_client(&key(), TIMEOUT)
    }

    fn client(&self, addr: &str) -> RuntimeClient {
        RuntimeClient::connect(addr, &key(), TIMEOUT).unwrap()
    }

    /// Shuts runtime `i` down and waits until `serve` returned (its stage
    /// workers aborted and joined).
    fn kill(&mut self, i: usize) {
        let r = &mut self.runtimes[i];
        let _ = r.stop.send(true);
        if let Some(h) = r.served.take() {
            self.plane.rt.block_on(h).unwrap();
        }
    }

    /// Every stage worker of every runtime, by (pipeline, stage).
    fn workers(&self) -> BTreeMap<(u32, u32), StageWorkerStatus> {
        self.runtimes
            .iter()
            .flat_map(|r| r.monitor.stage_workers())
            .map(|s| ((s.pipeline, s.stage), s))
            .collect()
    }

    fn job(&self, id: &str) -> TrainJobStatus {
        match self
            .controller()
            .request(&ControllerRequest::TrainStatus {
                job: Some(id.to_string()),
            })
            .unwrap()
        {
            ControllerReply::TrainJobs { mut jobs } => jobs.pop().unwrap(),
            other => panic!("{other:?}"),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.runtimes.len() {
            self.kill(i);
        }
        let _ = self.plane.stop.send(true);
    }
}

fn spec(name: &str, model: &str, lr: f64, iterations: u64) -> JobSpec {
    let spec = JobSpec::from_json(&format!(
        r#"{{"name": "{name}", "model": "{model}",
            "optimizer": {{"sgd": {{"lr": {lr}, "momentum": 0.9}}}},
            "batch": 8, "microbatches": 4, "pipelines": 2, "stages": 3,
            "sync": {{"allreduce": {{}}}}, "data": {{"synthetic": {{"seed": 11}}}},
            "iterations": {iterations}}}"#
    ))
    .unwrap();
    spec.validate().unwrap();
    spec
}

fn submit(c: &Cluster, spec: JobSpec) -> TrainJobStatus {
    match c
        .controller()
        .request(&ControllerRequest::TrainSubmit {
            spec: Box::new(spec),
        })
        .unwrap()
    {
        ControllerReply::TrainSubmitted { job } => {
            assert_eq!(job.state, TrainJobState::Placing, "{:?}", job.waiting);
            *job
        }
        other => panic!("{other:?}"),
    }
}

/// The job's workers as the controller placed them: each one's runtime
/// address and assignment.
fn assignments(job: &TrainJobStatus) -> BTreeMap<(u32, u32), (String, StageAssignment)> {
    let s = job.spec.stages;
    let placed = |p: u32, st: u32| {
        let w = &job.stages[(p * s + st) as usize];
        let at = w.placement.as_ref().expect("placed");
        StagePeer {
            pipeline: p,
            stage: st,
            runtime: at.runtime,
            addr: at.addr.clone(),
            device: at.device,
        }
    };
    job.stages
        .iter()
        .map(|w| {
            let (p, st) = (w.pipeline, w.stage);
            let me = placed(p, st);
            let a = StageAssignment {
                job: job.id.clone(),
                generation: job.generation,
                pipeline: p,
                stage: st,
                device: me.device,
                model: job.spec.model.clone(),
                catalog_version: job.catalog_version,
                layers: w.layers,
                partition: job.partition.clone(),
                start_iteration: 0,
                peers: StagePeers {
                    prev: (st > 0).then(|| placed(p, st - 1)),
                    next: (st + 1 < s).then(|| placed(p, st + 1)),
                    same_stage: (0..job.spec.pipelines)
                        .filter(|&q| q != p)
                        .map(|q| placed(q, st))
                        .collect(),
                },
                spec: job.spec.clone(),
            };
            ((p, st), (me.addr, a))
        })
        .collect()
}

/// Plays the coordinator: `TrainStage` everywhere (each answers its data
/// address), then every `TrainStageStart` before reading any reply (a
/// worker's start waits for its previous stage to dial it).
fn start_job(c: &Cluster, job: &TrainJobStatus) {
    let plan = assignments(job);
    let mut clients: BTreeMap<String, RuntimeClient> = BTreeMap::new();
    let mut data = BTreeMap::new();
    for (at, (addr, a)) in &plan {
        let client = clients
            .entry(addr.clone())
            .or_insert_with(|| c.client(addr));
        let data_addr = client.train_stage(a).unwrap();
        data.insert(
            *at,
            DataPeer {
                pipeline: at.0,
                stage: at.1,
                worker: at.0 * job.spec.stages + at.1,
                data_addr,
            },
        );
    }
    let mut owed: BTreeMap<String, usize> = BTreeMap::new();
    for (&(p, s), (addr, _)) in &plan {
        let client = clients.get_mut(addr).unwrap();
        let (prev, next) = (
            s.checked_sub(1).map(|q| data[&(p, q)].clone()),
            data.get(&(p, s + 1)).cloned(),
        );
        let replicas: Vec<DataPeer> = (0..job.spec.pipelines)
            .map(|q| data[&(q, s)].clone())
            .collect();
        client
            .send_request(&|id| RuntimeRequest::TrainStageStart {
                id,
                job: job.id.clone(),
                generation: job.generation,
                pipeline: p,
                stage: s,
                prev: prev.clone(),
                next: next.clone(),
                replicas: replicas.clone(),
            })
            .unwrap();
        *owed.entry(addr.clone()).or_default() += 1;
    }
    for (addr, n) in owed {
        let client = clients.get_mut(&addr).unwrap();
        for _ in 0..n {
            match client.recv().unwrap() {
                Response::TrainStage(RuntimeReply::TrainStageStarted { job: j, .. }) => {
                    assert_eq!(j, job.id)
                }
                other => panic!("start: {other:?}"),
            }
        }
    }
}

fn all_ended(c: &Cluster, n: usize) -> bool {
    let w = c.workers();
    w.len() == n && w.values().all(|s| s.phase == StagePhase::Ended)
}

/// A job of 2 pipelines x 3 stages, allreduce, on two runtimes of three
/// devices: every worker finishes, the last stages' loss falls, and after
/// the final all-reduce the replicas of every stage are bit-identical.
fn trains_with_allreduce(family: Family, lr: f64) {
    let c = Cluster::start(family, &[vec![0, 1, 2], vec![0, 1, 2]]);
    let iterations = 8;
    let job = submit(&c, spec("sw", &c.model, lr, iterations));
    assert_eq!(job.partition.iter().sum::<u32>() as usize, c.layers);
    start_job(&c, &job);
    wait_until("every worker to finish", || all_ended(&c, 6));
    let workers = c.workers();
    for (at, w) in &workers {
        assert_eq!(w.end, Some(StageEnd::Finished), "{at:?}: {w:?}");
        assert_eq!(w.iterations, iterations, "{at:?}");
    }
    for stage in 0..3 {
        let (a, b) = (&workers[&(0, stage)], &workers[&(1, stage)]);
        assert!(a.params_checksum.is_some());
        assert_eq!(
            a.params_checksum, b.params_checksum,
            "stage {stage}: the replicas differ after the final all-reduce"
        );
        assert_ne!(
            a.params_checksum_before_sync, b.params_checksum_before_sync,
            "stage {stage}: the replicas were equal before averaging: the test proves nothing"
        );
    }
    for p in 0..2 {
        let losses = &workers[&(p, 2)].losses;
        assert_eq!(losses.len() as u64, iterations);
        let (first, last) = (losses[0], *losses.last().unwrap());
        println!("{family:?} pipeline {p}: loss {losses:?}");
        assert!(
            last < first,
            "{family:?} pipeline {p}: the loss did not fall: {losses:?}"
        );
    }
    let status = c.job(&job.id);
    assert_eq!(status.state, TrainJobState::Finished, "{status:?}");
    for p in 0..2u32 {
        let s = &status.stages[(p * 3 + 2) as usize];
        assert_eq!(s.iteration, Some(iterations));
        assert_eq!(s.loss, workers[&(p, 2)].losses.last().copied());
    }
    let metrics = c.runtimes[0].monitor.render_metrics();
    assert!(
        metrics.contains("distmind_runtime_device_stage_iterations_total{device=\"0\"} 8"),
        "{metrics}"
    );
}

#[test]
fn resnet152_trains_with_allreduce() {
    trains_with_allreduce(Family::Resnet152, 0.05);
}

#[test]
fn gpt2_trains_with_allreduce() {
    trains_with_allreduce(Family::Gpt2, 0.05);
}

fn refused(r: Result<String, RuntimeClientError>) -> (ErrorCode, String) {
    match r {
        Err(RuntimeClientError::Server { reply, .. }) => (reply.code, reply.message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn bad_assignments_are_refused_by_name_and_a_stop_ends_an_unstarted_worker() {
    let c = Cluster::start(Family::Resnet152, &[vec![0, 1]]);
    let n = c.layers as u32;
    let spec = spec("bad", &c.model, 0.05, 5);
    let partition = vec![n / 3, n / 3, n - 2 * (n / 3)];
    let good = StageAssignment {
        job: "bad-1".into(),
        generation: 1,
        pipeline: 0,
        stage: 0,
        device: 0,
        model: c.model.clone(),
        catalog_version: 1,
        layers: LayerRange {
            first: 0,
            end: n / 3,
        },
        partition: partition.clone(),
        start_iteration: 0,
        peers: StagePeers::default(),
        spec: Box::new(spec),
    };
    let mut client = c.client(&c.runtimes[0].addr);

    // A device the runtime does not have.
    let mut a = good.clone();
    a.device = 7;
    let (code, msg) = refused(client.train_stage(&a));
    assert_eq!(code, ErrorCode::BadRequest);
    assert!(
        msg.contains("no device 7") && msg.contains("[0, 1]"),
        "{msg}"
    );

    // A layer range that is not the partition's, and a partition that is
    // not this model's.
    let mut a = good.clone();
    a.layers.end += 1;
    let (code, msg) = refused(client.train_stage(&a));
    assert_eq!(code, ErrorCode::BadRequest);
    assert!(msg.contains("layers") && msg.contains("partition"), "{msg}");
    let mut a = good.clone();
    a.partition = vec![n / 3, n / 3, n / 3 + 5];
    let (code, msg) = refused(client.train_stage(&a));
    assert_eq!(code, ErrorCode::BadRequest);
    assert!(msg.contains("not a stage of this model"), "{msg}");
    assert!(
        c.workers().values().all(|w| w.phase == StagePhase::Ended),
        "a refused load frees its device"
    );

    // An optimizer the workers do not run.
    let mut a = good.clone();
    a.spec.optimizer = serde_json::from_str(r#"{"adam": {"lr": 0.001}}"#).unwrap();
    let (code, msg) = refused(client.train_stage(&a));
    assert_eq!(code, ErrorCode::Unsupported);
    assert!(msg.contains("adam"), "{msg}");

    // A good one loads; the same again is answered the same way; another
    // worker on its device is refused.
    let data = client.train_stage(&good).unwrap();
    assert_eq!(
        client.train_stage(&good).unwrap(),
        data,
        "a retried TrainStage"
    );
    let mut second = good.clone();
    second.stage = 1;
    second.layers = LayerRange {
        first: n / 3,
        end: 2 * (n / 3),
    };
    let (code, msg) = refused(client.train_stage(&second));
    assert_eq!(code, ErrorCode::BadRequest);
    assert!(
        msg.contains("device 0 already runs the stage worker of job bad-1"),
        "{msg}"
    );

    // A start for a job or generation that is not here.
    for (job, generation) in [("other-1", 1), ("bad-1", 2)] {
        let id = client
            .send_request(&|id| RuntimeRequest::TrainStageStart {
                id,
                job: job.into(),
                generation,
                pipeline: 0,
                stage: 0,
                prev: None,
                next: None,
                replicas: vec![],
            })
            .unwrap();
        match client.recv().unwrap() {
            Response::Error { id: got, error } => {
                assert_eq!(got, id);
                assert_eq!(error.code, ErrorCode::BadRequest);
                assert!(
                    error.message.contains(&format!(
                        "no stage worker of job {job} generation {generation}"
                    )),
                    "{}",
                    error.message
                );
            }
            other => panic!("{other:?}"),
        }
    }

    // The ready worker stops, answering with its iterations (none).
    assert_eq!(client.train_stage_stop("bad-1", 0, 0, 1).unwrap(), 0);
    let w = &c.workers()[&(0, 0)];
    assert_eq!(w.phase, StagePhase::Ended);
    assert!(matches!(&w.end, Some(StageEnd::Stopped(_))), "{w:?}");
    // Its device is free again.
    assert!(client.train_stage(&second).is_ok());
    assert_eq!(client.train_stage_stop("bad-1", 0, 1, 1).unwrap(), 0);
}

/// A stage worker on a device pauses the device's background training job
/// (no background iteration between the worker's ops) until it ends; then
/// the background job resumes.
#[test]
fn a_stage_worker_pauses_the_devices_background_job_until_it_ends() {
    let c = Cluster::start(Family::Resnet152, &[vec![0]]);
    let r = &c.runtimes[0];
    let (running, _) = c.client(&r.addr).train(0, Some(&c.model)).unwrap();
    assert_eq!(running.as_deref(), Some(c.model.as_str()));
    let background = || r.monitor.training(0).unwrap().total_iterations;
    wait_until("the background job to iterate", || background() >= 2);
    let mut one = spec("pause", &c.model, 0.01, 100_000);
    (one.pipelines, one.stages) = (1, 1);
    let job = submit(&c, one);
    start_job(&c, &job);
    let worker = || c.workers()[&(0, 0)].iterations;
    // By its second iteration, a background iteration that began before
    // the worker existed has long been counted.
    wait_until("the worker's second iteration", || worker() >= 2);
    let during = background();
    wait_until("the worker's fifth iteration", || worker() >= 5);
    assert_eq!(
        background(),
        during,
        "the background job iterated while a stage worker held the device"
    );
    let iterations = c
        .client(&r.addr)
        .train_stage_stop(&job.id, 0, 0, job.generation)
        .unwrap();
    assert!(iterations >= 5, "{iterations}");
    wait_until("the background job to resume", || background() > during);
    assert_eq!(
        r.monitor.training(0).unwrap().model.as_deref(),
        Some(c.model.as_str())
    );
}

#[test]
fn a_stop_ends_every_worker_at_an_iteration_boundary() {
    let c = Cluster::start(Family::Resnet152, &[vec![0, 1, 2], vec![0, 1, 2]]);
    let job = submit(&c, spec("st", &c.model, 0.01, 100_000));
    start_job(&c, &job);
    wait_until("two iterations everywhere", || {
        let w = c.workers();
        w.len() == 6 && w.values().all(|s| s.iterations >= 2)
    });
    // Inference shares a device with a stage worker: served ahead of the
    // worker's next op; the heartbeat names the job as the device's
    // training, its longest op as the iteration a request may wait for.
    let r0 = &c.runtimes[0];
    let w = r0.monitor.stage_workers()[0].clone();
    let snapshot = r0.monitor.snapshot();
    let d = snapshot
        .devices
        .iter()
        .find(|d| d.device == w.device)
        .unwrap();
    assert_eq!(d.training.as_deref(), Some(job.id.as_str()));
    assert!(d.train_iteration_ms > 0.0);
    let n: usize = c.input.iter().product();
    let x = HostTensor::f32(c.input.clone(), vec![0.25; n]);
    let served = c
        .client(&r0.addr)
        .infer_with(
            &c.model,
            &x,
            InferOptions {
                device: Some(w.device),
                ..InferOptions::default()
            },
        )
        .unwrap();
    assert_eq!(served.timing.device, w.device);
    assert!(
        r0.monitor.stage_workers()[0].phase == StagePhase::Running,
        "the worker trains on"
    );
    // The controller's stop (its workers' next reports are told so), then
    // every worker's TrainStageStop, as the controller sends them: each
    // worker ends at its next boundary (one that a neighbour's stop cut
    // short mid-iteration stops too), and each reply comes once it ended.
    match c
        .controller()
        .request(&ControllerRequest::TrainStop {
            job: job.id.clone(),
        })
        .unwrap()
    {
        ControllerReply::TrainStopped { .. } => {}
        other => panic!("{other:?}"),
    }
    let plan = assignments(&job);
    let mut clients: BTreeMap<String, RuntimeClient> = BTreeMap::new();
    let mut owed: BTreeMap<String, usize> = BTreeMap::new();
    for ((p, s), (addr, _)) in &plan {
        let client = clients
            .entry(addr.clone())
            .or_insert_with(|| c.client(addr));
        client
            .send_request(&|id| RuntimeRequest::TrainStageStop {
                id,
                job: job.id.clone(),
                pipeline: *p,
                stage: *s,
                generation: job.generation,
            })
            .unwrap();
        *owed.entry(addr.clone()).or_default() += 1;
    }
    for (addr, n) in owed {
        let client = clients.get_mut(&addr).unwrap();
        for _ in 0..n {
            match client.recv().unwrap() {
                Response::Training {
                    model: None,
                    iterations,
                    ..
                } => assert!(iterations >= 2),
                other => panic!("stop: {other:?}"),
            }
        }
    }
    assert!(
        all_ended(&c, 6),
        "a TrainStageStop reply comes once the worker ended"
    );
    for (at, w) in c.workers() {
        assert!(
            matches!(&w.end, Some(StageEnd::Stopped(_))),
            "{at:?} did not stop cleanly: {:?}",
            w.end
        );
    }
    // Workers that heard the stop in a report's reply count as stopped
    // there; the controller takes the rest from their TrainStageStop
    // replies (its side).
    let state = c.job(&job.id).state;
    assert!(
        matches!(state, TrainJobState::Stopping | TrainJobState::Stopped),
        "{state:?}"
    );
}

#[test]
fn a_worker_whose_neighbour_is_lost_fails_naming_it() {
    // Four devices and two: pipeline 1 spans both runtimes.
    let mut c = Cluster::start(Family::Resnet152, &[vec![0, 1, 2, 3], vec![0, 1]]);
    let job = submit(&c, spec("kl", &c.model, 0.01, 100_000));
    let plan = assignments(&job);
    let victim = plan[&(1, 0)].0.clone();
    let survivor = if c.runtimes[0].addr == victim { 1 } else { 0 };
    assert!(
        plan.values().any(|(addr, _)| *addr != victim),
        "the placement left nothing on the other runtime"
    );
    start_job(&c, &job);
    wait_until("an iteration everywhere", || {
        let w = c.workers();
        w.len() == 6 && w.values().all(|s| s.iterations >= 1)
    });
    let killed = 1 - survivor;
    c.kill(killed);
    let left = c.runtimes[survivor].monitor.clone();
    wait_until("the surviving workers to end", || {
        left.stage_workers()
            .iter()
            .all(|w| w.phase == StagePhase::Ended)
    });
    // Each fails naming itself and why: its own link or all-reduce with the
    // lost runtime, or (had it finished an iteration meanwhile) the job's
    // failure as the controller's reply to its report names it.
    for w in left.stage_workers() {
        let Some(StageEnd::Failed(why)) = &w.end else {
            panic!("pipeline {} stage {}: {:?}", w.pipeline, w.stage, w.end)
        };
        println!("pipeline {} stage {} failed: {why}", w.pipeline, w.stage);
        assert!(
            why.contains(&format!(
                "job {} pipeline {} stage {}",
                job.id, w.pipeline, w.stage
            )),
            "{why}"
        );
        assert!(
            why.contains("stage link to stage")
                || why.contains("averaging the stage's weights")
                || why.contains("the job failed at pipeline"),
            "{why}"
        );
    }
    let status = c.job(&job.id);
    assert!(
        matches!(status.state, TrainJobState::Failed { .. }),
        "{:?}",
        status.state
    );
}
