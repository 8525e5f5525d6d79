//! One device's worker thread: takes tasks (inference with its model's
//! compiled plan, prefetch) from the device's bounded queue, runs the
//! pipeline and sends the replies (messages and output tensors, which the
//! connection encodes) back to the connection that asked. Its time on each
//! task beyond the executor's compute and copies is the device's
//! serial-path overhead.
//!
//! Between tasks it runs the device's background training job, if one is
//! set: ONE iteration whenever the queue is empty, then it looks at the
//! queue again, so a request waits for at most the iteration in progress
//! (never preempted inside). An iteration is a real SGD step (cpu, cuda) or,
//! with the `sim` executor, the profile's training time held on the device
//! ([`Executor::simulated_train_iteration`](crate::exec::Executor::simulated_train_iteration)). Without a job it blocks on the queue. `Train`
//! requests arrive on a separate bounded control channel that is checked at
//! every boundary (before the queue), so they never wait behind the
//! background loop or behind queued inference.
//!
//! Each task holds the device's lock ([`super::device_lock`]) with
//! priority, and each background iteration holds it as a training op, so a
//! training stage worker on the same device ([`super::stage`]) runs its
//! ops between tasks and a task waits for at most one of them. While a
//! stage worker holds the device, the background job pauses (no
//! iterations; tasks and controls are still taken): a job the controller
//! placed on the device is its training, and a background iteration
//! (batch 96 by default) between each of the stage's short ops would slow
//! the job several times over. It resumes when the stage worker ends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{self, TryRecvError};
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{
    ErrorCode, ErrorReply, RuntimeReply, ServePath, TimingMsg, TraceEntry, RUNTIME_OUTPUTS_MAX,
    TRACE_ENTRIES_MAX,
};
use distmind_models::{Dtype, Manifest};
use rand::Rng;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::device_lock::DEVICE_WAIT_POLL;
use super::plan::ModelPlan;
use super::stage::StageWorkerStatus;
use super::{batch, Core, TrainingStatus, TRAIN_ITERATION_EWMA_WEIGHT};
use crate::cache::CacheError;
use crate::device::DeviceError;
use crate::exec::{ExecError, HostTensor, TraceEvent};
use crate::npy::{encode_npy, encoded_len};
use crate::pipeline::{
    cache_in, cold_start, load, sequential, LoadPath, MergedTrace, PipelineError,
};
use crate::pipeline::{PipelineEvent, PipelineOptions, Request, Stages, Timing};
use crate::train::{check_trainable, sgd_step_with_state, SgdState};

/// A reply ready to write: the message and the outputs that follow it, one
/// `.npy` frame each (encoded by the connection's writer, off the device's
/// serial path; each was checked to fit a frame). The permit is the
/// connection's in-flight slot, released once written.
pub(crate) struct Outgoing {
    pub reply: RuntimeReply,
    pub frames: Vec<HostTensor>,
    pub permit: Option<OwnedSemaphorePermit>,
    /// The request's input (and its batch's), freed by the writer:
    /// freeing hundreds of kilobytes returns pages to the kernel, which is
    /// kept off the device's serial path.
    pub spent: Vec<HostTensor>,
}

/// The output frames of a reply, as `.npy` bytes.
pub(crate) fn encode_frames(outputs: &[HostTensor]) -> Vec<Vec<u8>> {
    outputs.iter().map(encode_npy).collect()
}

/// One queued inference: a request alone, or a batch of requests for the
/// same model that run as one per input shape (rows concatenated along
/// dimension 0; requests of different sequence lengths in separate runs)
/// and are answered one by one.
pub struct Job {
    pub(crate) model: String,
    /// The requests, in the order their input frames came: at least one,
    /// at most 1 + [`BATCH_MEMBERS_MAX`](distmind_common::proto::BATCH_MEMBERS_MAX).
    pub(crate) requests: Vec<Member>,
    pub(crate) arrived: Instant,
    /// Index into the runtime's devices, set by dispatch.
    pub(crate) device: usize,
    /// When it entered the device queue (its arrival at the worker), set by dispatch.
    pub(crate) queued_at: Instant,
    pub(crate) reply: mpsc::Sender<Outgoing>,
    /// The model as compiled from the catalog (resolved by the connection,
    /// so the worker never asks the controller for an inference).
    pub(crate) plan: Arc<ModelPlan>,
    /// Every request's input concatenated along dimension 0, in order, when
    /// there are several and they can batch (one shape past dimension 0):
    /// made by the connection, so the copy is off the device's serial path.
    /// The worker uses it when every request runs; else it concatenates
    /// those that do.
    pub(crate) batched: Option<HostTensor>,
}

/// One request of a [`Job`].
pub(crate) struct Member {
    pub id: u64,
    /// The input frame, parsed by the connection.
    pub input: HostTensor,
    pub deadline: Option<Duration>,
    pub trace: bool,
    /// The connection's in-flight slot, released once the reply is written.
    pub permit: Option<OwnedSemaphorePermit>,
}

impl Job {
    /// Requests this job answers.
    pub(crate) fn len(&self) -> usize {
        self.requests.len()
    }
}

/// A prefetch to a device: cache-in and upload, no compute.
pub(crate) struct PrefetchJob {
    pub id: u64,
    pub model: String,
    pub arrived: Instant,
    pub queued_at: Instant,
    pub reply: mpsc::Sender<Outgoing>,
    pub permit: Option<OwnedSemaphorePermit>,
}

/// What a device queue carries, served in order.
pub(crate) enum Task {
    Infer(Job),
    Prefetch(PrefetchJob),
}

impl Task {
    pub fn model(&self) -> &str {
        match self {
            Task::Infer(j) => &j.model,
            Task::Prefetch(p) => &p.model,
        }
    }

    /// Requests the task answers (a batch counts each of its requests).
    pub fn requests(&self) -> u64 {
        match self {
            Task::Infer(j) => j.len() as u64,
            Task::Prefetch(_) => 1,
        }
    }

    /// Records the device it is queued on and when.
    pub fn set_queued(&mut self, device: usize, at: Instant) {
        match self {
            Task::Infer(j) => {
                j.device = device;
                j.queued_at = at;
            }
            Task::Prefetch(p) => p.queued_at = at,
        }
    }
}

/// A `Train` request for one device: start or switch to `model`, or stop
/// (`None`).
pub(crate) struct TrainControl {
    pub id: u64,
    pub model: Option<String>,
    pub reply: mpsc::Sender<Outgoing>,
    pub permit: Option<OwnedSemaphorePermit>,
}

/// A device's background training job; what an iteration is was chosen
/// once, when the job started, by the executor.
struct Trainer {
    resolved: Arc<ModelPlan>,
    work: Work,
    iterations: u64,
}

/// What one iteration of a job does.
enum Work {
    /// cpu and cuda: a real SGD step.
    Sgd(Box<SgdJob>),
    /// sim: no math and no weights; the device is held for `iteration` (the
    /// profile's training time, dilated like every simulated time).
    Simulated { iteration: Duration },
}

/// A real job: a private working copy of the model's packed bytes (fetched
/// through the host cache, as for inference) that every SGD step updates,
/// the momentum buffers and one synthetic batch of random images and labels.
///
/// Trained weights are NOT written back to the memory servers (as in the
/// original, whose `resnet152_train` jobs only share the GPU): stopping or
/// switching the job drops them.
struct SgdJob {
    packed: Vec<u8>,
    state: SgdState,
    images: HostTensor,
    labels: Vec<i64>,
}

impl Trainer {
    fn name(&self) -> &str {
        &self.resolved.manifest.name
    }

    fn simulated(&self) -> bool {
        matches!(self.work, Work::Simulated { .. })
    }

    /// For logs: what becomes of the job's work when it stops.
    fn ending(&self) -> &'static str {
        match self.work {
            Work::Sgd(_) => "weights not written back",
            Work::Simulated { .. } => "simulated: no weights",
        }
    }

    /// For logs: what the job holds and does per iteration.
    fn describe(&self, batch: usize) -> String {
        match &self.work {
            Work::Sgd(j) => format!(
                "{} bytes of weights, batch {}",
                j.packed.len(),
                j.labels.len()
            ),
            Work::Simulated { iteration } => format!(
                "simulated: batch {batch}, {:.3} ms per iteration from the profile, no weights copied",
                ms(*iteration)
            ),
        }
    }
}

/// The background job's device waits are never cut short.
static NEVER_ABORTED: AtomicBool = AtomicBool::new(false);

/// One iteration's span, for the yield time of the requests that waited.
#[derive(Clone, Copy)]
struct Iteration {
    start: Instant,
    end: Instant,
}

/// The worker loop of device `index`: runs until the task queue is closed
/// and empty. Controls first, then tasks; with a training job and nothing
/// queued, one iteration; with neither, block.
pub(crate) fn run(
    core: &Core,
    index: usize,
    rx: channel::Receiver<Task>,
    control: channel::Receiver<TrainControl>,
) {
    let device = &core.devices[index];
    let mut trainer: Option<Trainer> = None;
    let mut last: Option<Iteration> = None;
    let mut controls_open = true;
    // The background job waits for a stage worker on this device.
    let mut paused = false;
    loop {
        if controls_open {
            match control.try_recv() {
                Ok(c) => {
                    apply_control(core, index, &mut trainer, c);
                    continue;
                }
                Err(TryRecvError::Disconnected) => controls_open = false,
                Err(TryRecvError::Empty) => {}
            }
        }
        paused &= trainer.is_some();
        let task = if let Some(t) = &trainer {
            match rx.try_recv() {
                Ok(t) => t,
                Err(TryRecvError::Empty) => {
                    let stage = core.stages.running_on(index);
                    if paused != stage.is_some() {
                        log_pause(device.id, t.name(), stage.as_ref());
                        paused = stage.is_some();
                    }
                    if !paused {
                        last = Some(iterate(core, index, &mut trainer));
                        continue;
                    }
                    // Paused: wait for a task or a control, looking again
                    // at the stage worker every poll.
                    match wait_paused(&rx, &control, controls_open) {
                        Paused::Task(t) => t,
                        Paused::Control(Some(c)) => {
                            apply_control(core, index, &mut trainer, c);
                            continue;
                        }
                        Paused::Control(None) => {
                            controls_open = false;
                            continue;
                        }
                        Paused::Poll => continue,
                        Paused::Closed => break,
                    }
                }
                Err(TryRecvError::Disconnected) => break,
            }
        } else if controls_open {
            crossbeam::select! {
                recv(control) -> c => {
                    match c {
                        Ok(c) => apply_control(core, index, &mut trainer, c),
                        Err(_) => controls_open = false,
                    }
                    continue;
                }
                recv(rx) -> t => match t {
                    Ok(t) => t,
                    Err(_) => break,
                },
            }
        } else {
            match rx.recv() {
                Ok(t) => t,
                Err(_) => break,
            }
        };
        let taken = Instant::now();
        // Ahead of any training op waiting for the device.
        let held = device.lock.serve();
        let work = handle(core, index, task, last);
        drop(held);
        device.add_serial(taken.elapsed(), work);
    }
    if let Some(t) = trainer.take() {
        log::info!(
            "device {}: training of {} stopped at shutdown after {} iterations ({})",
            device.id,
            t.name(),
            t.iterations,
            t.ending()
        );
        let mut s = device.training();
        s.model = None;
    }
    log::debug!("device {} worker stopped", device.id);
}

/// Serves one queued task and sends its replies; returns the device's own
/// time in it (see [`device_work`]).
fn handle(core: &Core, index: usize, task: Task, last: Option<Iteration>) -> Duration {
    let device = &core.devices[index];
    // Time from its arrival at the worker until the iteration it found
    // running ended; 0 when it arrived while no iteration ran.
    let yield_of = |queued_at: Instant| match last {
        Some(it) if queued_at >= it.start && queued_at <= it.end => it.end - queued_at,
        _ => Duration::ZERO,
    };
    match task {
        Task::Infer(mut job) => {
            let train_yield = yield_of(job.queued_at);
            let (outs, work) = serve(core, index, &job, train_yield);
            device.queued.fetch_sub(job.len() as u64, Ordering::Relaxed);
            // Freed with the first reply, by its writer.
            let mut batched = job.batched.take();
            for (out, mut m) in outs.into_iter().zip(job.requests.drain(..)) {
                let status = match &out.reply {
                    RuntimeReply::Output { timing, .. } => {
                        core.served.fetch_add(1, Ordering::Relaxed);
                        device.served.fetch_add(1, Ordering::Relaxed);
                        core.metrics.observe_path(timing.path);
                        None
                    }
                    RuntimeReply::Error { error, .. } => {
                        core.errors.fetch_add(1, Ordering::Relaxed);
                        log::debug!("device {}: request {} failed: {error}", device.id, m.id);
                        Some(error.code)
                    }
                    _ => None,
                };
                core.metrics
                    .observe_request(&job.model, status, job.arrived.elapsed());
                let out = Outgoing {
                    permit: m.permit.take(),
                    spent: std::iter::once(m.input).chain(batched.take()).collect(),
                    ..out
                };
                // The connection may be gone; its reply goes nowhere then
                // (and the input is freed here).
                let _ = job.reply.blocking_send(out);
            }
            work
        }
        Task::Prefetch(mut p) => {
            let (out, work) = prefetch_device(core, index, &p);
            if let RuntimeReply::Error { error, .. } = &out.reply {
                log::debug!("device {}: prefetch {} failed: {error}", device.id, p.id);
            }
            device.queued.fetch_sub(1, Ordering::Relaxed);
            let out = Outgoing {
                permit: p.permit.take(),
                ..out
            };
            let _ = p.reply.blocking_send(out);
            work
        }
    }
}

/// The device's own time in a pipeline run: its compute and its
/// host-to-device copies. Overlapped, they run at once (the copies under
/// the compute's gate waits); a whole-model load runs the fetch, the copies
/// and the compute one after the other, and its fetch counts too (it is
/// the network's time, not the server's).
fn device_work(t: &Timing, whole_model: bool) -> Duration {
    if whole_model {
        t.fetch + t.h2d + t.compute
    } else {
        t.compute.max(t.h2d)
    }
}

pub(crate) fn error(id: u64, code: ErrorCode, message: String) -> Outgoing {
    Outgoing {
        reply: RuntimeReply::Error {
            id,
            error: ErrorReply::new(code, message),
        },
        frames: Vec::new(),
        permit: None,
        spent: Vec::new(),
    }
}

/// Answers a pipeline failure, forgetting a catalog entry that may be stale.
fn pipeline_error(core: &Core, id: u64, model: &str, e: &PipelineError) -> Outgoing {
    let e = pipeline_error_reply(core, id, model, e);
    error(id, e.code, e.message)
}

pub(crate) fn pipeline_error_reply(
    core: &Core,
    id: u64,
    model: &str,
    e: &PipelineError,
) -> ErrorReply {
    let code = error_code(e);
    if code == ErrorCode::Internal {
        // A stale entry (the model moved) is re-read next time.
        core.catalog.forget(model);
    }
    ErrorReply::new(code, format!("request {id}: {e}"))
}

/// Serves an inference job: one reply per request, in the job's order. A
/// request whose deadline passed in the queue, or whose input does not fit
/// the model, is answered with its error and left out; the others run as
/// one batch.
fn serve(core: &Core, index: usize, job: &Job, train_yield: Duration) -> (Vec<Outgoing>, Duration) {
    let device = &core.devices[index];
    let n = job.len();
    let mut replies: Vec<Option<Outgoing>> = (0..n).map(|_| None).collect();
    // Names a request of a batch in its errors.
    let who = |k: usize| {
        let id = job.requests[k].id;
        if n == 1 {
            format!("request {id} for {}", job.model)
        } else {
            format!(
                "request {id} for {} (request {} of a batch of {n})",
                job.model,
                k + 1
            )
        }
    };
    let waited = job.arrived.elapsed();
    let mut ready: Vec<usize> = Vec::with_capacity(n);
    for (k, m) in job.requests.iter().enumerate() {
        match m.deadline.filter(|d| waited > *d) {
            None => ready.push(k),
            Some(deadline) => {
                replies[k] = Some(error(
                    m.id,
                    ErrorCode::DeadlineExceeded,
                    format!(
                        "{}: its deadline of {} ms passed after {} ms in the queue of device {}",
                        who(k),
                        deadline.as_millis(),
                        waited.as_millis(),
                        device.id
                    ),
                ))
            }
        }
    }
    let work = if ready.is_empty() {
        Duration::ZERO
    } else {
        run_batch(core, index, job, ready, train_yield, &who, &mut replies)
    };
    let replies = replies
        .into_iter()
        .map(|r| r.expect("every request of a job is answered"))
        .collect();
    (replies, work)
}

/// Runs the requests of `job` whose indices are `ready`: answers those
/// whose input does not fit the model, and runs the rest, one batch per
/// input shape ([`shape_groups`]); returns the device's own time in the
/// runs ([`device_work`]).
fn run_batch(
    core: &Core,
    index: usize,
    job: &Job,
    mut ready: Vec<usize>,
    train_yield: Duration,
    who: &dyn Fn(usize) -> String,
    replies: &mut [Option<Outgoing>],
) -> Duration {
    let id_of = |k: usize| job.requests[k].id;
    let m = &job.plan.manifest;
    ready.retain(|&k| match check_input(m, &job.requests[k].input) {
        Ok(()) => true,
        Err(why) => {
            replies[k] = Some(error(
                id_of(k),
                ErrorCode::BadRequest,
                format!("{}: {why}", who(k)),
            ));
            false
        }
    });
    // Requests of different shapes (sequence lengths) run as one batch per
    // shape, one after the other; each request gets its own rows back.
    let mut work = Duration::ZERO;
    for (i, mut group) in shape_groups(job, &ready).into_iter().enumerate() {
        if i > 0 {
            // A later group waited for the earlier ones as in a queue.
            let waited = job.arrived.elapsed();
            group.retain(
                |&k| match job.requests[k].deadline.filter(|d| waited > *d) {
                    None => true,
                    Some(deadline) => {
                        replies[k] = Some(error(
                            id_of(k),
                            ErrorCode::DeadlineExceeded,
                            format!(
                                "{}: its deadline of {} ms passed after {} ms, waiting for the \
                             batch's requests of other shapes to run on device {}",
                                who(k),
                                deadline.as_millis(),
                                waited.as_millis(),
                                core.devices[index].id
                            ),
                        ));
                        false
                    }
                },
            );
            if group.is_empty() {
                continue;
            }
        }
        work += run_group(core, index, job, group, train_yield, replies);
    }
    work
}

/// Runs the requests of `job` whose indices are `members`, all of one
/// input shape past dimension 0, as one batch and fills in their replies;
/// returns the device's own time in the run ([`device_work`]).
fn run_group(
    core: &Core,
    index: usize,
    job: &Job,
    members: Vec<usize>,
    train_yield: Duration,
    replies: &mut [Option<Outgoing>],
) -> Duration {
    let device = &core.devices[index];
    let id_of = |k: usize| job.requests[k].id;
    let resolved = &job.plan;
    let m = &resolved.manifest;
    let rows: Vec<usize> = members
        .iter()
        .map(|&k| job.requests[k].input.shape.first().copied().unwrap_or(1))
        .collect();
    let fail_all =
        |replies: &mut [Option<Outgoing>], code: ErrorCode, why: &dyn Fn(u64) -> String| {
            for &k in &members {
                replies[k] = Some(error(id_of(k), code, why(id_of(k))));
            }
        };
    // A request alone runs on its own input, uncopied; a whole job on the
    // batch its connection made.
    let whole = job
        .batched
        .as_ref()
        .filter(|_| members.len() > 1 && members.len() == job.len());
    let batched = if members.len() == 1 || whole.is_some() {
        None
    } else {
        let parts: Vec<&HostTensor> = members.iter().map(|&k| &job.requests[k].input).collect();
        match batch::concat_rows(&parts) {
            Ok(t) => Some(t),
            Err(why) => {
                fail_all(replies, ErrorCode::BadRequest, &|id| {
                    format!(
                        "request {id} for {}: cannot batch its inputs: {why}",
                        job.model
                    )
                });
                return Duration::ZERO;
            }
        }
    };
    let inputs = match (&batched, whole) {
        (Some(t), _) | (None, Some(t)) => std::slice::from_ref(t),
        (None, None) => std::slice::from_ref(&job.requests[members[0]].input),
    };
    let stages = Stages {
        cache: &core.cache,
        executor: &*device.executor,
        residency: &device.residency,
    };
    let request = Request {
        entry: &resolved.entry,
        manifest: m,
        inputs,
        arrived: job.arrived,
    };
    // The merged trace is built only when a member asked for it.
    let traced = members.iter().any(|&k| job.requests[k].trace);
    let opts = PipelineOptions {
        trace: traced,
        ..core.pipeline
    };
    let busy = Instant::now();
    let served = if core.whole_model {
        sequential(&stages, &request, &opts)
    } else {
        cold_start(&stages, &request, &opts)
    };
    let ran = busy.elapsed();
    device.add_busy(busy);
    let (outputs, timing, trace) = match served {
        Ok(v) => v,
        Err(e) => {
            let code = error_code(&e);
            if code == ErrorCode::Internal {
                // A stale entry (the model moved) is re-read next time.
                core.catalog.forget(&job.model);
            }
            fail_all(replies, code, &|id| format!("request {id}: {e}"));
            // No breakdown: the whole failed run counts as the device's.
            return ran;
        }
    };
    let work = device_work(&timing, core.whole_model);
    if outputs.len() > RUNTIME_OUTPUTS_MAX || outputs.len() != m.outputs.len() {
        fail_all(replies, ErrorCode::Internal, &|_| {
            format!(
                "model {}: {} outputs (the manifest names {}, at most {RUNTIME_OUTPUTS_MAX} per reply)",
                m.name,
                outputs.len(),
                m.outputs.len()
            )
        });
        return work;
    }
    // Per output, each request's rows (a request alone keeps the tensor).
    let per_output: Vec<Vec<HostTensor>> = if members.len() == 1 {
        outputs.into_iter().map(|t| vec![t]).collect()
    } else {
        let mut split = Vec::with_capacity(outputs.len());
        for (t, spec) in outputs.iter().zip(&m.outputs) {
            match batch::split_rows(t, &rows) {
                Ok(parts) => split.push(parts),
                Err(why) => {
                    fail_all(replies, ErrorCode::Internal, &|_| {
                        format!(
                            "model {} output {} cannot be split back over a batch of {} requests: {why}",
                            m.name,
                            spec.name,
                            members.len()
                        )
                    });
                    return work;
                }
            }
        }
        split
    };
    let (trace, trace_truncated) = if traced {
        let (t, cut) = trace_entries(&trace);
        (Some(t), cut)
    } else {
        (None, false)
    };
    let mut timing = timing_msg(&timing, device.id);
    timing.train_yield_ms = ms(train_yield);
    timing.batch_requests = members.len() as u32;
    timing.warmup = device.first_inference();
    let names: Vec<String> = m.outputs.iter().map(|o| o.name.clone()).collect();
    let resident = device.residency.resident_mru();
    let mut per_output: Vec<std::vec::IntoIter<HostTensor>> =
        per_output.into_iter().map(Vec::into_iter).collect();
    for &k in &members {
        let id = id_of(k);
        let frames: Vec<HostTensor> = per_output
            .iter_mut()
            .map(|parts| parts.next().expect("one part per request"))
            .collect();
        let too_big = frames.iter().zip(&m.outputs).find_map(|(t, spec)| {
            let len = encoded_len(t);
            (len > CONTROL_FRAME_BYTES_MAX as usize).then(|| {
                format!(
                    "model {} output {} ({}) is {len} bytes as .npy, more than a frame's {CONTROL_FRAME_BYTES_MAX}: use a smaller batch",
                    m.name,
                    spec.name,
                    t.describe(),
                )
            })
        });
        replies[k] = Some(match too_big {
            Some(why) => error(id, ErrorCode::Internal, why),
            None => Outgoing {
                reply: RuntimeReply::Output {
                    id,
                    timing: timing.clone(),
                    outputs: names.clone(),
                    trace: if job.requests[k].trace {
                        trace.clone()
                    } else {
                        None
                    },
                    trace_truncated: trace_truncated && job.requests[k].trace,
                    resident: resident.clone(),
                    dispatch: None,
                },
                frames,
                permit: None,
                spent: Vec::new(),
            },
        });
    }
    work
}

fn serve_path(p: LoadPath) -> ServePath {
    match p {
        LoadPath::Cold => ServePath::Cold,
        LoadPath::HostCached => ServePath::HostCached,
        LoadPath::DeviceResident => ServePath::DeviceResident,
    }
}

/// A prefetch to device `index`: fetch into the host cache if missing,
/// upload, leave the model resident; nothing runs.
fn prefetch_device(core: &Core, index: usize, p: &PrefetchJob) -> (Outgoing, Duration) {
    let device = &core.devices[index];
    let resolved = match core.catalog.resolve(&p.model, None) {
        Ok(r) => r,
        Err(e) => return (error(p.id, e.code, e.message), Duration::ZERO),
    };
    let stages = Stages {
        cache: &core.cache,
        executor: &*device.executor,
        residency: &device.residency,
    };
    let request = Request {
        entry: &resolved.entry,
        manifest: &resolved.manifest,
        inputs: &[],
        arrived: p.arrived,
    };
    let busy = Instant::now();
    let loaded = load(&stages, &request, &core.pipeline);
    let ran = busy.elapsed();
    device.add_busy(busy);
    match loaded {
        Ok(timing) => {
            log::debug!(
                "device {}: prefetched {} ({:?}) in {:?}",
                device.id,
                p.model,
                timing.path,
                timing.total
            );
            let out = Outgoing {
                reply: RuntimeReply::Prefetched {
                    id: p.id,
                    model: p.model.clone(),
                    path: serve_path(timing.path),
                    // The load's own time, not its wait in the device's
                    // queue: the dispatcher takes it as what a request
                    // that finds the model where it was pays beyond compute.
                    ms: ms(ran),
                },
                frames: Vec::new(),
                permit: None,
                spent: Vec::new(),
            };
            // A load overlaps its fetch and copies (never whole-model).
            (out, device_work(&timing, false))
        }
        Err(e) => (pipeline_error(core, p.id, &p.model, &e), ran),
    }
}

/// A prefetch into the host cache only (no device), on a blocking thread:
/// `Cold` when this fetched it, `HostCached` when it was there already (or
/// being filled by another request, which it waited for).
pub(crate) fn prefetch_host(core: &Core, id: u64, model: &str, arrived: Instant) -> Outgoing {
    let resolved = match core.catalog.resolve(model, None) {
        Ok(r) => r,
        Err(e) => return error(id, e.code, e.message),
    };
    match cache_in(
        &core.cache,
        &resolved.entry,
        &resolved.manifest,
        &core.pipeline,
    ) {
        Ok((_pinned, path, _)) => Outgoing {
            reply: RuntimeReply::Prefetched {
                id,
                model: model.to_string(),
                path: serve_path(path),
                ms: ms(arrived.elapsed()),
            },
            frames: Vec::new(),
            permit: None,
            spent: Vec::new(),
        },
        Err(e) => pipeline_error(core, id, model, &e),
    }
}

/// Applies a `Train` request at an iteration boundary and replies.
fn apply_control(core: &Core, index: usize, trainer: &mut Option<Trainer>, mut c: TrainControl) {
    let device = &core.devices[index];
    let busy = Instant::now();
    let out = match c.model.take() {
        None => {
            let iterations = stop(core, index, trainer.take());
            training_reply(c.id, device.id, None, iterations)
        }
        Some(model) if trainer.as_ref().is_some_and(|t| t.name() == model) => {
            // Already running: it keeps its weights and momentum; no job ended.
            training_reply(c.id, device.id, Some(model), 0)
        }
        Some(model) => match start(core, index, c.id, &model) {
            Ok(t) => {
                let iterations = stop(core, index, trainer.take());
                log::info!(
                    "device {}: training {model} between requests ({})",
                    device.id,
                    t.describe(core.train_batch)
                );
                let simulated = t.simulated();
                *trainer = Some(t);
                let mut s = device.training();
                *s = TrainingStatus {
                    model: Some(model.clone()),
                    total_iterations: s.total_iterations,
                    simulated,
                    ..TrainingStatus::default()
                };
                drop(s);
                training_reply(c.id, device.id, Some(model), iterations)
            }
            Err(e) => error(c.id, e.code, e.message),
        },
    };
    device.add_busy(busy);
    let out = Outgoing {
        permit: c.permit.take(),
        ..out
    };
    let _ = c.reply.blocking_send(out);
}

fn training_reply(id: u64, device: u32, model: Option<String>, iterations: u64) -> Outgoing {
    Outgoing {
        reply: RuntimeReply::Training {
            id,
            device,
            model,
            iterations,
        },
        frames: Vec::new(),
        permit: None,
        spent: Vec::new(),
    }
}

/// Ends a job (its weights are dropped); returns its iteration count.
fn stop(core: &Core, index: usize, trainer: Option<Trainer>) -> u64 {
    let device = &core.devices[index];
    let Some(t) = trainer else {
        return 0;
    };
    log::info!(
        "device {}: training of {} stopped after {} iterations ({})",
        device.id,
        t.name(),
        t.iterations,
        t.ending()
    );
    let mut s = device.training();
    s.model = None;
    t.iterations
}

/// Validates `model` for training and builds its job: resolve, check that
/// every op trains, fetch the packed bytes through the host cache; a real
/// job copies them, a simulated one (the sim executor) only times the
/// iteration.
fn start(core: &Core, index: usize, id: u64, model: &str) -> Result<Trainer, ErrorReply> {
    let device = &core.devices[index];
    let resolved = core.catalog.resolve(model, None)?;
    let m = &resolved.manifest;
    let refuse = |why: String| {
        ErrorReply::new(
            ErrorCode::BadRequest,
            format!(
                "request {id}: model {model} ({}) cannot train on device {}: {why}; only the CNN \
                 families (resnet152, inception_v3, densenet201) train",
                m.family.as_str(),
                device.id
            ),
        )
    };
    check_trainable(m).map_err(|e| refuse(e.to_string()))?;
    let classes = match (m.inputs.as_slice(), m.outputs.last()) {
        ([input], Some(out))
            if input.dtype == Dtype::F32 && !input.shape.is_empty() && out.shape.len() == 2 =>
        {
            out.shape[1]
        }
        _ => {
            return Err(refuse(
                "it needs one f32 image input and [N, classes] logits as its last output".into(),
            ))
        }
    };
    if classes == 0 {
        return Err(refuse("its logits have no classes".into()));
    }
    let batch = core.train_batch;
    // Chosen once for the job's lifetime.
    let simulated = device
        .executor
        .simulated_train_iteration(m, batch)
        .transpose()
        .map_err(|e| {
            ErrorReply::new(
                ErrorCode::BadRequest,
                format!(
                    "request {id}: model {model} cannot train on device {} with the {} executor: {e}",
                    device.id,
                    device.executor.kind()
                ),
            )
        })?;
    // As a real job starts: the model's bytes arrive in the host cache.
    let (cached, _, _) = cache_in(&core.cache, &resolved.entry, m, &core.pipeline)
        .map_err(|e| pipeline_error_reply(core, id, model, &e))?;
    let mut packed = Vec::with_capacity(if simulated.is_some() {
        0
    } else {
        m.stored_bytes as usize
    });
    for g in 0..cached.groups() {
        let bytes = cached
            .wait_group(g, core.pipeline.gate_timeout)
            .map_err(|e| ErrorReply::new(ErrorCode::Internal, format!("request {id}: {e}")))?;
        if simulated.is_none() {
            packed.extend_from_slice(bytes);
        }
    }
    drop(cached);
    if let Some(iteration) = simulated {
        return Ok(Trainer {
            resolved,
            work: Work::Simulated { iteration },
            iterations: 0,
        });
    }
    let mut shape = m.inputs[0].shape.clone();
    shape[0] = batch;
    let n: usize = shape.iter().product();
    let mut rng = rand::thread_rng();
    let images = HostTensor::f32(shape, (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect());
    let labels = (0..batch)
        .map(|_| rng.gen_range(0..classes as i64))
        .collect();
    Ok(Trainer {
        resolved,
        work: Work::Sgd(Box::new(SgdJob {
            packed,
            state: SgdState::new(),
            images,
            labels,
        })),
        iterations: 0,
    })
}

/// What a paused background job's wait ended with.
enum Paused {
    Task(Task),
    /// A control, or `None` when the control channel closed.
    Control(Option<TrainControl>),
    /// Time to look at the stage worker again.
    Poll,
    /// The task queue closed.
    Closed,
}

/// Waits, at most [`DEVICE_WAIT_POLL`], for a task or (while the channel
/// is open) a control.
fn wait_paused(
    rx: &channel::Receiver<Task>,
    control: &channel::Receiver<TrainControl>,
    controls_open: bool,
) -> Paused {
    if controls_open {
        crossbeam::select! {
            recv(control) -> c => Paused::Control(c.ok()),
            recv(rx) -> t => t.map_or(Paused::Closed, Paused::Task),
            default(DEVICE_WAIT_POLL) => Paused::Poll,
        }
    } else {
        match rx.recv_timeout(DEVICE_WAIT_POLL) {
            Ok(t) => Paused::Task(t),
            Err(channel::RecvTimeoutError::Timeout) => Paused::Poll,
            Err(channel::RecvTimeoutError::Disconnected) => Paused::Closed,
        }
    }
}

/// Logs the background job pausing for a stage worker (`Some`) or
/// resuming.
fn log_pause(device: u32, job: &str, stage: Option<&StageWorkerStatus>) {
    match stage {
        Some(s) => log::info!(
            "device {device}: background training of {job} paused while job {}'s stage worker \
             (pipeline {}, stage {}) trains here",
            s.job,
            s.pipeline,
            s.stage
        ),
        None => log::info!(
            "device {device}: background training of {job} resumes (no stage worker here now)"
        ),
    }
}

/// One iteration of the device's job (an SGD step, or the simulated time
/// held); a failed one ends the job.
fn iterate(core: &Core, index: usize, trainer: &mut Option<Trainer>) -> Iteration {
    let device = &core.devices[index];
    let start = Instant::now();
    let Some(t) = trainer.as_mut() else {
        return Iteration { start, end: start };
    };
    // A training op: after inference (this thread's own, so never waiting
    // on it) and among the device's stage worker's ops.
    let held = device
        .lock
        .train(&NEVER_ABORTED)
        .expect("a wait that is never aborted ends holding the device");
    let step = match &mut t.work {
        Work::Sgd(j) => sgd_step_with_state(
            &t.resolved.manifest,
            &mut j.packed,
            &j.images,
            &j.labels,
            &core.train_sgd,
            &mut j.state,
        )
        .map(|report| report.loss),
        Work::Simulated { iteration } => {
            std::thread::sleep(*iteration);
            // Nothing was computed: no loss.
            Ok(f32::NAN)
        }
    };
    drop(held);
    let end = Instant::now();
    device.add_busy(start);
    match step {
        Ok(loss) => {
            t.iterations += 1;
            let took = ms(end - start);
            let mut s = device.training();
            s.iterations = t.iterations;
            s.total_iterations += 1;
            s.iteration_ms_last = took;
            s.iteration_ms_ewma = if t.iterations == 1 {
                took
            } else {
                TRAIN_ITERATION_EWMA_WEIGHT * took
                    + (1.0 - TRAIN_ITERATION_EWMA_WEIGHT) * s.iteration_ms_ewma
            };
            s.iteration_ms_max = s.iteration_ms_max.max(took);
            s.loss = loss;
        }
        Err(e) => {
            let why = format!(
                "training of {} failed at iteration {}: {e}",
                t.name(),
                t.iterations + 1
            );
            log::warn!("device {}: {why}; the job stopped", device.id);
            let mut s = device.training();
            s.model = None;
            s.last_error = Some(why);
            *trainer = None;
        }
    }
    Iteration { start, end }
}

/// The executors' rule, checked before anything is fetched: one input of
/// the manifest's dtype and a shape its spec accepts (any batch >= 1 in
/// dimension 0; for token inputs any length up to the position table).
fn check_input(m: &Manifest, t: &HostTensor) -> Result<(), String> {
    let [spec] = m.inputs.as_slice() else {
        return Err(format!(
            "model {} takes {} inputs; this server passes one",
            m.name,
            m.inputs.len()
        ));
    };
    let why = if t.dtype_name() != spec.dtype_name() {
        "the element type differs".to_string()
    } else {
        match spec.check_shape(&t.shape) {
            Ok(()) => return Ok(()),
            Err(why) => why,
        }
    };
    Err(format!(
        "model {}: input {} is {}, expected {}: {why}",
        m.name,
        spec.name,
        t.describe(),
        spec.expected()
    ))
}

/// Splits `members` (indices into `job.requests`) into groups of the same
/// input shape past dimension 0, in the order each shape first came: the
/// requests of a group concatenate along the batch dimension and run as
/// one; requests of different sequence lengths cannot.
fn shape_groups(job: &Job, members: &[usize]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(&[usize], Vec<usize>)> = Vec::new();
    for &k in members {
        let shape = &job.requests[k].input.shape;
        let trailing = shape.get(1..).unwrap_or(&[]);
        match groups.iter_mut().find(|(t, _)| *t == trailing) {
            Some((_, g)) => g.push(k),
            None => groups.push((trailing, vec![k])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

fn error_code(e: &PipelineError) -> ErrorCode {
    match e {
        PipelineError::Cache(CacheError::Full { .. } | CacheError::TooBig { .. })
        | PipelineError::Device(DeviceError::Full { .. } | DeviceError::TooBig { .. }) => {
            ErrorCode::Full
        }
        PipelineError::Exec { error, .. } if matches!(**error, ExecError::BadInput { .. }) => {
            ErrorCode::BadRequest
        }
        _ => ErrorCode::Internal,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn timing_msg(t: &Timing, device: u32) -> TimingMsg {
    TimingMsg {
        queue_ms: ms(t.queue),
        fetch_ms: ms(t.fetch),
        h2d_ms: ms(t.h2d),
        compute_ms: ms(t.compute),
        total_ms: ms(t.total),
        path: serve_path(t.path),
        simulated: t.simulated,
        device,
        fetched_bytes: t.fetched_bytes,
        train_yield_ms: 0.0,
        batch_requests: 1,
        warmup: false,
    }
}

/// The merged trace as wire entries, cut at [`TRACE_ENTRIES_MAX`].
pub(crate) fn trace_entries(trace: &MergedTrace) -> (Vec<TraceEntry>, bool) {
    let entry = |at: Duration, event: &str, index: Option<usize>| TraceEntry {
        at_ms: ms(at),
        event: event.to_string(),
        index: index.map(|i| i as u64),
    };
    let out: Vec<TraceEntry> = trace
        .events
        .iter()
        .take(TRACE_ENTRIES_MAX)
        .map(|(at, e)| match *e {
            PipelineEvent::HostReady { group } => entry(*at, "host_ready", Some(group)),
            PipelineEvent::UploadStart { group } => entry(*at, "upload_start", Some(group)),
            PipelineEvent::Uploaded { group } => entry(*at, "uploaded", Some(group)),
            PipelineEvent::UploadsComplete => entry(*at, "uploads_complete", None),
            PipelineEvent::GateOpened { group } => entry(*at, "gate_opened", Some(group)),
            PipelineEvent::ComputeStart => entry(*at, "compute_start", None),
            PipelineEvent::ComputeEnd => entry(*at, "compute_end", None),
            PipelineEvent::Exec(TraceEvent::GroupReady { group }) => {
                entry(*at, "group_ready", Some(group))
            }
            PipelineEvent::Exec(TraceEvent::LayerStart { layer }) => {
                entry(*at, "layer_start", Some(layer))
            }
            PipelineEvent::Exec(TraceEvent::LayerEnd { layer }) => {
                entry(*at, "layer_end", Some(layer))
            }
        })
        .collect();
    (out, trace.events.len() > TRACE_ENTRIES_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::PipelineEvent as E;

    #[test]
    fn trace_entries_name_every_event_and_are_bounded() {
        let ms1 = Duration::from_millis(1);
        let t = MergedTrace {
            events: vec![
                (ms1, E::HostReady { group: 0 }),
                (2 * ms1, E::GateOpened { group: 0 }),
                (3 * ms1, E::Exec(TraceEvent::LayerStart { layer: 4 })),
            ],
        };
        let (e, cut) = trace_entries(&t);
        assert!(!cut);
        assert_eq!(e[0].event, "host_ready");
        assert_eq!((e[2].event.as_str(), e[2].index), ("layer_start", Some(4)));
        assert!((e[1].at_ms - 2.0).abs() < 1e-9);
        let long = MergedTrace {
            events: vec![(ms1, E::ComputeStart); TRACE_ENTRIES_MAX + 1],
        };
        let (e, cut) = trace_entries(&long);
        assert!(cut && e.len() == TRACE_ENTRIES_MAX);
    }
}
