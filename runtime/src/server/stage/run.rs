//! A stage worker's thread: load, wait for the start, connect, iterate,
//! end. See the module docs of [`super`] for the life cycle and the sync
//! modes.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, RecvTimeoutError};
use distmind_common::checksum::Checksummer;
use distmind_common::proto::{
    DrainOrder, ErrorCode, GroupLocation, Location, StageAssignment, TrainJobState,
};
use distmind_controller::jobs::checkpoint::{periodic_checkpoint_name, periodic_due};

use super::assignment::sgd_of;
use super::checkpoint;
use super::error::{At, StageError};
use super::interference::Injected;
use super::links::{sleep_unless, DataPlane};
use super::load::{load, Loaded};
use super::report::Reporter;
use super::requests::{ready_reply, started_reply};
use super::routing::{ComputeError, StageCompute};
use super::schedule::{one_f_one_b, Op};
use super::sync::{check_group, fixed_group};
use super::{
    Command, Control, Peers, Reply, StageConfig, StageEnd, StageKey, StagePhase, ABORT_POLL,
    LOSS_HISTORY_MAX, START_TIMEOUT,
};
use crate::exec::HostTensor;
use crate::server::Core;
use crate::train::SgdConfig;

/// How the iterations ended.
enum Outcome {
    /// The spec's iterations ran.
    Finished,
    /// Told to stop, at a boundary.
    Stopped(String),
    Failed(StageError),
}

/// The thread's body; `reply` answers the `TrainStage`.
pub(super) fn main(
    core: &Arc<Core>,
    config: &StageConfig,
    index: usize,
    a: &StageAssignment,
    control: &Control,
    inbox: &Receiver<Command>,
    reply: Reply,
) {
    let key = StageKey::of(a);
    let mut at = At {
        job: a.job.clone(),
        pipeline: a.pipeline,
        stage: a.stage,
        iteration: a.start_iteration,
    };
    let loaded = match load(core, config, reply.id, a) {
        Ok(l) => l,
        Err(e) => {
            log::warn!("stage worker of {key} not loaded: {}", e.message);
            control.end(StageEnd::Failed(e.message.clone()));
            reply.error(e.code, e.message);
            return;
        }
    };
    {
        let mut s = control.status();
        s.phase = StagePhase::Ready;
        s.data_addr = Some(loaded.data_addr.clone());
        s.layer_checksums = loaded.layer_checksums.clone();
    }
    log::info!(
        "device {}: stage worker of {key} ready: {} (catalog version {}), data on {}",
        core.devices[index].id,
        a.model,
        loaded.version,
        loaded.data_addr
    );
    let id = reply.id;
    reply.send(
        ready_reply(
            id,
            &key,
            loaded.data_addr.clone(),
            loaded.layer_checksums.clone(),
        )
        .reply,
    );
    let mut reporter = Reporter::new(
        config.controller.clone(),
        config.key.clone(),
        a.job.clone(),
        a.generation,
        a.pipeline,
        a.stage,
    );
    let outcome = match wait_start(&at, control, inbox) {
        Ok((peers, start)) => run(
            core,
            config,
            index,
            a,
            control,
            loaded,
            peers,
            start,
            &mut reporter,
            &mut at,
        ),
        Err(o) => {
            // The stage's weights and listener go before the end is told.
            drop(loaded);
            o
        }
    };
    let end = match outcome {
        Outcome::Finished => {
            log::info!(
                "stage worker of {key} finished its {} iterations",
                a.spec.iterations
            );
            StageEnd::Finished
        }
        Outcome::Stopped(why) => {
            log::info!(
                "stage worker of {key} stopped at iteration {}: {why}",
                at.iteration
            );
            StageEnd::Stopped(why)
        }
        Outcome::Failed(e) if control.stop.load(Ordering::Relaxed) => {
            // Told to stop, and a neighbour that stopped first ended the wait.
            log::info!("stage worker of {key} stopped: {e}");
            StageEnd::Stopped(e.to_string())
        }
        Outcome::Failed(e) => {
            let reason = e.to_string();
            if !matches!(e, StageError::JobFailed { .. }) {
                // (The controller knows of a failed job.)
                reporter.failed(&reason);
            }
            if let StageError::PeerStopped { .. } = e {
                log::info!("stage worker of {key} stopped: {reason}");
                StageEnd::Stopped(reason)
            } else {
                log::warn!("stage worker of {key} failed: {reason}");
                StageEnd::Failed(reason)
            }
        }
    };
    control.end(end);
}

/// Waits for the `TrainStageStart` (up to [`START_TIMEOUT`]), a stop or
/// an abort.
fn wait_start(
    at: &At,
    control: &Control,
    inbox: &Receiver<Command>,
) -> Result<(Peers, Reply), Outcome> {
    let since = Instant::now();
    loop {
        if control.abort.load(Ordering::Relaxed) {
            return Err(Outcome::Failed(StageError::Aborted {
                at: at.clone(),
                what: "waiting for TrainStageStart",
            }));
        }
        if control.stop.load(Ordering::Relaxed) {
            return Err(Outcome::Stopped("stopped before it started".into()));
        }
        match inbox.recv_timeout(ABORT_POLL) {
            Ok(Command::Start { peers, reply }) => return Ok((peers, reply)),
            Err(RecvTimeoutError::Timeout) if since.elapsed() < START_TIMEOUT => {}
            Err(_) => {
                return Err(Outcome::Failed(StageError::NeverStarted {
                    at: at.clone(),
                    waited: START_TIMEOUT,
                }))
            }
        }
    }
}

/// Connects, answers the start, iterates; the data plane is closed on
/// return (after telling the neighbours when the end is a stop).
#[allow(clippy::too_many_arguments)]
fn run(
    core: &Core,
    config: &StageConfig,
    index: usize,
    a: &StageAssignment,
    control: &Control,
    loaded: Loaded,
    peers: Peers,
    start: Reply,
    reporter: &mut Reporter,
    at: &mut At,
) -> Outcome {
    let key = StageKey::of(a);
    let plane = DataPlane::connect(
        at,
        &config.key,
        a.spec.stages,
        loaded.listener.clone(),
        peers.prev.as_ref(),
        peers.next.as_ref(),
        &peers.replicas,
        &control.abort,
    );
    let id = start.id;
    let plane = match plane {
        Ok(p) => p,
        Err(e) => {
            start.error(
                ErrorCode::Unavailable,
                format!("request {id}: start of {key}: {e}"),
            );
            return Outcome::Failed(e);
        }
    };
    control.status().phase = StagePhase::Running;
    start.send(started_reply(id, &key));
    log::info!("stage worker of {key} started");
    let spec = &a.spec;
    let data_seed = match &spec.data {
        distmind_common::train_spec::DataSource::Synthetic(s) => s.seed,
    };
    let mut w = Worker {
        core,
        config,
        index,
        a,
        control,
        compute: loaded.compute,
        data: loaded.data,
        plane,
        reporter,
        injected: Injected::for_worker(&spec.interference, data_seed, a.pipeline, a.stage),
        sgd: sgd_of(a),
        ops: one_f_one_b(spec.stages, a.stage, spec.microbatches),
        at: at.clone(),
    };
    let outcome = w.run();
    *at = w.at.clone();
    let graceful = !matches!(outcome, Outcome::Failed(_)) || control.stop.load(Ordering::Relaxed);
    if graceful {
        w.plane.say_stop();
    }
    // Links, rings, listener and the stage's weights go here.
    drop(w);
    drop(loaded.listener);
    outcome
}

/// What one iteration ended with.
enum Next {
    Continue,
    Stop(String),
}

struct Worker<'a> {
    core: &'a Core,
    config: &'a StageConfig,
    index: usize,
    a: &'a StageAssignment,
    control: &'a Control,
    compute: StageCompute,
    data: super::data::Synthetic,
    plane: DataPlane,
    reporter: &'a mut Reporter,
    injected: Injected,
    sgd: SgdConfig,
    ops: Vec<Op>,
    at: At,
}

/// What an iteration measured.
#[derive(Default)]
struct Times {
    forward: Duration,
    backward: Duration,
    op_max: Duration,
}

fn checksum_of(flat: &[f32]) -> u64 {
    let mut c = Checksummer::new();
    let mut buf = [0u8; 4096];
    for chunk in flat.chunks(buf.len() / 4) {
        for (i, v) in chunk.iter().enumerate() {
            buf[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        c.update(&buf[..4 * chunk.len()]);
    }
    c.finish()
}

impl Worker<'_> {
    /// The controller's word that the job failed, as this worker's error.
    fn fail_if_failed(&self, state: &TrainJobState) -> Result<(), StageError> {
        match state {
            TrainJobState::Failed {
                pipeline,
                stage,
                reason,
            } => Err(StageError::JobFailed {
                at: self.at.clone(),
                pipeline: *pipeline,
                stage: *stage,
                reason: reason.clone(),
            }),
            _ => Ok(()),
        }
    }

    fn run(&mut self) -> Outcome {
        let mut iteration = self.a.start_iteration;
        loop {
            self.at.iteration = iteration;
            if self.control.abort.load(Ordering::Relaxed) {
                return Outcome::Failed(StageError::Aborted {
                    at: self.at.clone(),
                    what: "between iterations",
                });
            }
            if self.control.stop.load(Ordering::Relaxed) {
                return Outcome::Stopped("told to stop (TrainStageStop)".into());
            }
            if let Some(d) = self.injected.hetero_sleep(iteration) {
                if !sleep_unless(&self.control.abort, d) {
                    return Outcome::Failed(StageError::Aborted {
                        at: self.at.clone(),
                        what: "sleeping as a straggler",
                    });
                }
            }
            let next = self.iteration(iteration);
            if next.is_ok() && iteration + 1 >= self.a.spec.iterations {
                // The last one (the controller's reply to its report may
                // say stop: the job just finished).
                self.at.iteration = iteration + 1;
                return Outcome::Finished;
            }
            match next {
                Ok(Next::Continue) => iteration += 1,
                Ok(Next::Stop(why)) => return Outcome::Stopped(why),
                Err(e) => return Outcome::Failed(e),
            }
        }
    }

    /// Runs `f` on the stage holding the device (a training op: inference
    /// goes first), then sleeps the op's injected slowdown with the device
    /// released. The time is the op's compute plus that sleep.
    fn on_device<T>(
        &mut self,
        f: impl FnOnce(&mut StageCompute) -> Result<T, ComputeError>,
    ) -> Result<(T, Duration), StageError> {
        let device = &self.core.devices[self.index];
        let abort = &self.control.abort;
        let guard = device
            .lock
            .train(abort)
            .ok_or_else(|| StageError::Aborted {
                at: self.at.clone(),
                what: "waiting for the device",
            })?;
        let started = Instant::now();
        let result = f(&mut self.compute);
        let took = started.elapsed();
        drop(guard);
        device.add_busy(started);
        let value = result.map_err(|source| StageError::Compute {
            at: self.at.clone(),
            source: Box::new(source),
        })?;
        let extra = self.injected.extra(self.at.iteration, took);
        if !extra.is_zero() && !sleep_unless(abort, extra) {
            return Err(StageError::Aborted {
                at: self.at.clone(),
                what: "sleeping an injected slowdown",
            });
        }
        Ok((value, took + extra))
    }

    /// The model inputs the stage draws itself for microbatch `k`.
    fn local_inputs(&self, iteration: u64, k: u64) -> Vec<(i64, HostTensor)> {
        if self.compute.routes().local_inputs.is_empty() {
            Vec::new()
        } else {
            // Synthetic data makes the one model input (-1).
            vec![(-1, self.data.input(iteration, k))]
        }
    }

    fn iteration(&mut self, iteration: u64) -> Result<Next, StageError> {
        let a = self.a;
        let spec = &a.spec;
        let microbatches = u64::from(spec.microbatches);
        let (first, last) = (self.a.stage == 0, self.compute.is_last());
        let mut times = Times::default();
        let mut losses = Vec::new();
        for op in self.ops.clone() {
            match op {
                Op::Forward(k) => {
                    let k = u64::from(k);
                    let mb = iteration * microbatches + k;
                    let received = if first {
                        Vec::new()
                    } else {
                        self.plane
                            .recv_activations(&self.at, mb, &self.control.abort)?
                    };
                    let local = self.local_inputs(iteration, k);
                    let (out, took) = self.on_device(|c| c.forward(mb, received, &local))?;
                    times.forward += took;
                    times.op_max = times.op_max.max(took);
                    if !last {
                        self.plane.send_activations(&self.at, mb, out)?;
                    }
                }
                Op::Backward(k) => {
                    let k = u64::from(k);
                    let mb = iteration * microbatches + k;
                    let (grads, took) = if last {
                        let target = self.data.target(iteration, k);
                        let ((loss, grads), took) =
                            self.on_device(|c| c.backward_from_loss(mb, &target))?;
                        losses.push(loss);
                        (grads, took)
                    } else {
                        let received =
                            self.plane
                                .recv_gradients(&self.at, mb, &self.control.abort)?;
                        self.on_device(|c| c.backward(mb, received))?
                    };
                    times.backward += took;
                    times.op_max = times.op_max.max(took);
                    if !first {
                        self.plane.send_gradients(&self.at, mb, grads)?;
                    }
                }
            }
        }
        let sgd = self.sgd;
        self.on_device(|c| c.model_mut().step(&sgd).map_err(ComputeError::from))?;
        let (flat, _) = self.on_device(|c| c.model().params_flat().map_err(ComputeError::from))?;
        let before = checksum_of(&flat);
        let after = match self.sync(iteration, flat)? {
            Some(sum) => sum,
            None => return Ok(Next::Stop("the controller's sync group said stop".into())),
        };
        let fwd_bwd = times.forward + times.backward;
        let loss =
            (last && !losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64);
        let done = iteration + 1;
        self.record(done, &times, loss, before, after);
        let (stop, state, drain) = self.reporter.report(
            &self.at,
            done,
            fwd_bwd.as_secs_f64(),
            loss,
            u64::from(spec.batch),
        )?;
        self.fail_if_failed(&state)?;
        if let Some(order) = drain.filter(|_| !stop) {
            if order.after_iteration <= done {
                return self.drained(done, &order);
            }
        }
        if !stop && a.pipeline == 0 && periodic_due(spec.checkpoint_every, done, spec.iterations) {
            self.periodic_checkpoint(done)?;
        }
        Ok(if stop {
            Next::Stop(format!(
                "the controller said stop in its reply to the report (job {})",
                state.name()
            ))
        } else {
            Next::Continue
        })
    }

    /// The drain's iteration is done: writes the checkpoint part when the
    /// order names one, then stops.
    fn drained(&mut self, done: u64, order: &DrainOrder) -> Result<Next, StageError> {
        let fail = |why: String| StageError::Checkpoint {
            at: self.at.clone(),
            why,
        };
        if order.after_iteration != done || order.generation != self.a.generation {
            return Err(fail(format!(
                "the drain of generation {} after iteration {} came after iteration {done} of \
                 generation {}",
                order.generation, order.after_iteration, self.a.generation
            )));
        }
        if let Some(name) = &order.checkpoint {
            let (group, sums) = checkpoint::write_part(
                self.config,
                self.compute.model(),
                self.a.stage,
                &order.partition,
                name,
            )
            .map_err(|why| fail(format!("writing its part of checkpoint {name}: {why}")))?;
            log::info!(
                "job {} pipeline {} stage {}: wrote its part of checkpoint {name} ({} bytes) \
                 after iteration {done}",
                self.a.job,
                self.a.pipeline,
                self.a.stage,
                group.bytes
            );
            let (state, _) = self.report_part(done, name, group, sums)?;
            if let TrainJobState::Failed {
                pipeline,
                stage,
                reason,
            } = state
            {
                return Err(StageError::JobFailed {
                    at: self.at.clone(),
                    pipeline,
                    stage,
                    reason,
                });
            }
        }
        Ok(Next::Stop(format!(
            "drained after iteration {done} for a re-partitioning"
        )))
    }

    /// Tells the controller this worker wrote `group` of checkpoint `name`
    /// after iteration `done`: the job's state and the extents the answer
    /// hands it to free. A part the controller refuses was never recorded
    /// and no one else knows of it: this worker frees it.
    fn report_part(
        &mut self,
        done: u64,
        name: &str,
        group: GroupLocation,
        sums: Vec<u64>,
    ) -> Result<(TrainJobState, Vec<Location>), StageError> {
        let written: Vec<Location> = group
            .slices
            .iter()
            .flat_map(|s| s.replicas.iter().cloned())
            .collect();
        let answer = self
            .reporter
            .checkpointed(&self.at, done, name, group, sums);
        if let Err(e) = &answer {
            if e.refused_by_controller() {
                log::warn!(
                    "job {}: freeing the {} extents of its refused part of checkpoint {name}",
                    self.a.job,
                    written.len()
                );
                checkpoint::free(self.config, name, &written);
            }
        }
        answer
    }

    /// A periodic checkpoint (`checkpoint_every`) is due after iteration
    /// `done`: writes this stage's part of the job's periodic checkpoint
    /// (the weights taken with the device held, written without it) and
    /// tells the controller; frees the replaced checkpoint's extents when
    /// the controller's answer hands them to this worker (its part came
    /// last). The job goes on.
    fn periodic_checkpoint(&mut self, done: u64) -> Result<(), StageError> {
        let name = periodic_checkpoint_name(&self.a.job);
        let fail = |at: &At, why: String| StageError::Checkpoint {
            at: at.clone(),
            why: format!("writing its part of periodic checkpoint {name}: {why}"),
        };
        let device = &self.core.devices[self.index];
        let guard = device
            .lock
            .train(&self.control.abort)
            .ok_or_else(|| StageError::Aborted {
                at: self.at.clone(),
                what: "waiting for the device to checkpoint",
            })?;
        let snapshot = checkpoint::snapshot(self.compute.model(), self.a.stage, &self.a.partition);
        drop(guard);
        let (bytes, sums) = snapshot.map_err(|why| fail(&self.at, why))?;
        let group = checkpoint::write_bytes(self.config, self.a.stage, &name, &bytes)
            .map_err(|why| fail(&self.at, why))?;
        log::info!(
            "job {} pipeline 0 stage {}: wrote its part of periodic checkpoint {name} ({} bytes) \
             after iteration {done}",
            self.a.job,
            self.a.stage,
            group.bytes
        );
        let (state, free) = self.report_part(done, &name, group, sums)?;
        if !free.is_empty() {
            log::info!(
                "job {}: freeing the {} extents of the periodic checkpoint {name} replaced",
                self.a.job,
                free.len()
            );
            checkpoint::free(self.config, &name, &free);
        }
        self.fail_if_failed(&state)?;
        Ok(())
    }

    /// Averages the stepped weights `flat` with the replicas the spec's
    /// mode names; the checksum after, or `None` when the controller's
    /// group said stop.
    fn sync(&mut self, iteration: u64, mut flat: Vec<f32>) -> Result<Option<u64>, StageError> {
        let p = self.a.spec.pipelines;
        let members = match fixed_group(&self.a.spec.sync, p) {
            Some(all) => all,
            None => {
                let group = self.reporter.group(&self.at, iteration + 1)?;
                if group.stop {
                    return Ok(None);
                }
                if let Err(why) = check_group(&group.members, p, self.a.pipeline) {
                    return Err(StageError::BadGroup {
                        at: self.at.clone(),
                        members: group.members,
                        why,
                    });
                }
                group.members
            }
        };
        if members.len() > 1 {
            self.plane.average(&self.at, &members, &mut flat)?;
            let flat = &flat;
            self.on_device(|c| {
                c.model_mut()
                    .set_params_flat(flat)
                    .map_err(ComputeError::from)
            })?;
        }
        Ok(Some(checksum_of(&flat)))
    }

    /// The iteration's status and counters.
    fn record(&self, done: u64, times: &Times, loss: Option<f64>, before: u64, after: u64) {
        let device = &self.core.devices[self.index];
        let c = &device.stage_counters;
        c.iterations.fetch_add(1, Ordering::Relaxed);
        c.samples
            .fetch_add(u64::from(self.a.spec.batch), Ordering::Relaxed);
        c.forward_ns
            .fetch_add(nanos(times.forward), Ordering::Relaxed);
        c.backward_ns
            .fetch_add(nanos(times.backward), Ordering::Relaxed);
        let mut s = self.control.status();
        s.iterations = done;
        if let Some(l) = loss {
            if s.losses.len() == LOSS_HISTORY_MAX {
                s.losses.remove(0);
            }
            s.losses.push(l);
        }
        s.params_checksum_before_sync = Some(before);
        s.params_checksum = Some(after);
        s.op_ms_max = times.op_max.as_secs_f64() * 1e3;
        log::debug!(
            "job {} pipeline {} stage {}: iteration {done} done, fwd+bwd {:.3} s, loss {loss:?}, \
             params {after:016x}",
            self.a.job,
            self.a.pipeline,
            self.a.stage,
            (times.forward + times.backward).as_secs_f64()
        );
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
