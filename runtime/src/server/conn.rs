//! One client connection: the cluster-key handshake, then a reader that
//! parses requests and queues inference and prefetches on a device (or a
//! host-cache prefetch on a blocking thread, or a training control), and a
//! writer that sends replies as they complete (any order; each carries its
//! request id).
//!
//! Every length is checked before allocation. A frame longer than the bound
//! is skipped (its bytes read and discarded) and answered with an error; a
//! message that is not a request, an input frame with no request, a request
//! with no input frame: an error reply each, and the connection goes on. Only
//! a broken frame header (unknown kind, nonzero reserved field) or a cut
//! stream ends the connection, after a best-effort error reply.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::handshake;
use distmind_common::limits::{CONTROL_FRAME_BYTES_MAX, NAME_BYTES_MAX};
use distmind_common::proto::{
    BatchMember, ErrorCode, ErrorReply, RuntimeReply, RuntimeRequest, BATCH_MEMBERS_MAX,
};
use distmind_common::wire::{self, FrameHeader, FrameKind, Role, WireError, FRAME_HEADER_BYTES};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use super::plan::ModelPlan;
use super::stage;
use super::worker::{self, encode_frames, Job, Member, Outgoing, PrefetchJob, Task, TrainControl};
use crate::npy::parse_npy;

use super::{
    DispatchError, Shared, BATCH_INPUT_BYTES_MAX, PREFETCHES_IN_FLIGHT_MAX,
    REQUESTS_IN_FLIGHT_PER_CONNECTION_MAX, TRAIN_CONTROLS_MAX,
};

/// How long a closing connection keeps discarding input so that the peer
/// reads our last reply (instead of a reset).
const LINGER_TIMEOUT: Duration = Duration::from_millis(500);
const LINGER_DRAIN_BYTES_MAX: u64 = 1 << 20;
/// Writes through a buffer of this size; flushed after every reply.
const WRITE_BUFFER_BYTES: usize = 64 << 10;

/// Decrements the open-connection count when a connection ends.
struct Open<'a>(&'a std::sync::atomic::AtomicU64);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(crate) async fn handle(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    peer: SocketAddr,
    mut stop: watch::Receiver<bool>,
) {
    shared.core.connections.fetch_add(1, Ordering::Relaxed);
    let _open = Open(&shared.core.connections);
    let _ = stream.set_nodelay(true);
    match handshake::server(&mut stream, &shared.key).await {
        Ok(Role::Control) => {}
        Ok(role) => {
            log::warn!("refused {peer}: asked for a {role:?} connection; the runtime serves control connections only");
            return;
        }
        Err(e) => {
            log::warn!("refused connection from {peer}: {e}");
            return;
        }
    }
    let (rd, wr) = stream.into_split();
    let (tx, rx) = mpsc::channel::<Outgoing>(REQUESTS_IN_FLIGHT_PER_CONNECTION_MAX + 1);
    let writer = write_loop(wr, rx, peer);
    tokio::pin!(writer);
    let reader = async {
        tokio::select! {
            r = read_loop(&shared, rd, tx, peer) => Some(r),
            _ = stop.wait_for(|s| *s) => None,
        }
    };
    let read_end = tokio::select! {
        r = reader => Some(r),
        _ = &mut writer => None,
    };
    // The reader is done: send what the workers still owe, then close.
    match read_end {
        Some(Some((rd, true))) => {
            let wr = (&mut writer).await;
            if let Ok(mut s) = rd.reunite(wr) {
                linger_close(&mut s).await;
            }
        }
        Some(_) => {
            let _ = (&mut writer).await;
        }
        None => {}
    }
}

/// Sends FIN, then discards input (bounded) until the peer closes, so the
/// last reply is read rather than lost to a reset.
async fn linger_close(s: &mut TcpStream) {
    let _ = s.shutdown().await;
    let drain = async {
        let _ = tokio::io::copy(&mut s.take(LINGER_DRAIN_BYTES_MAX), &mut tokio::io::sink()).await;
    };
    let _ = tokio::time::timeout(LINGER_TIMEOUT, drain).await;
}

async fn write_loop(
    wr: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Outgoing>,
    peer: SocketAddr,
) -> OwnedWriteHalf {
    let mut w = BufWriter::with_capacity(WRITE_BUFFER_BYTES, wr);
    while let Some(out) = rx.recv().await {
        let mut payload = wire::encode_message(&out.reply);
        // Encoded here, off the device's serial path (which checked their size).
        let mut frames = encode_frames(&out.frames);
        if payload.len() > CONTROL_FRAME_BYTES_MAX as usize {
            let message = format!(
                "the reply is {} bytes, more than a frame's {CONTROL_FRAME_BYTES_MAX} bytes (ask without trace?)",
                payload.len()
            );
            log::error!("cannot answer {peer}: {message}");
            payload = wire::encode_message(&RuntimeReply::Error {
                id: out.reply.id(),
                error: ErrorReply::new(ErrorCode::Internal, message),
            });
            frames.clear();
        }
        let sent = async {
            wire::write_frame(&mut w, FrameKind::Message, &[&payload]).await?;
            for f in &frames {
                wire::write_frame(&mut w, FrameKind::WriteChunk, &[f]).await?;
            }
            w.flush().await.map_err(WireError::from)
        };
        if let Err(e) = sent.await {
            log::warn!("closing connection from {peer}: cannot send a reply: {e}");
            break;
        }
        drop(out.permit);
        drop(out.spent);
    }
    w.into_inner()
}

/// A frame as the reader sees it.
enum Incoming {
    Frame(FrameKind, Vec<u8>),
    /// A frame longer than the bound; its payload was read and discarded.
    Oversized {
        kind: FrameKind,
        len: u32,
    },
    Eof,
    /// The stream cannot be trusted any more (bad header, cut short).
    Fatal(WireError),
}

async fn read_incoming(rd: &mut OwnedReadHalf) -> Incoming {
    let mut hb = [0u8; FRAME_HEADER_BYTES];
    match rd.read(&mut hb).await {
        Ok(0) => return Incoming::Eof,
        Ok(n) => {
            if let Err(e) = rd.read_exact(&mut hb[n..]).await {
                return Incoming::Fatal(e.into());
            }
        }
        Err(e) => return Incoming::Fatal(e.into()),
    }
    let h = match FrameHeader::decode(&hb, u32::MAX) {
        Ok(h) => h,
        Err(e) => return Incoming::Fatal(e),
    };
    if h.len > CONTROL_FRAME_BYTES_MAX {
        let skip = tokio::io::copy(&mut rd.take(h.len as u64), &mut tokio::io::sink()).await;
        return match skip {
            Ok(n) if n == h.len as u64 => Incoming::Oversized {
                kind: h.kind,
                len: h.len,
            },
            Ok(_) => Incoming::Fatal(WireError::Truncated),
            Err(e) => Incoming::Fatal(e.into()),
        };
    }
    match distmind_common::wire::read_payload(rd, h.len as usize).await {
        Ok(payload) => Incoming::Frame(h.kind, payload),
        Err(e) => Incoming::Fatal(e.into()),
    }
}

fn error_reply(
    id: u64,
    code: ErrorCode,
    message: String,
    permit: OwnedSemaphorePermit,
) -> Outgoing {
    Outgoing {
        reply: RuntimeReply::Error {
            id,
            error: ErrorReply::new(code, message),
        },
        frames: Vec::new(),
        permit: Some(permit),
        spent: Vec::new(),
    }
}

/// Reads requests until the peer closes; returns the read half and whether
/// the connection must close after a framing error.
async fn read_loop(
    shared: &Arc<Shared>,
    mut rd: OwnedReadHalf,
    tx: mpsc::Sender<Outgoing>,
    peer: SocketAddr,
) -> (OwnedReadHalf, bool) {
    let slots = Arc::new(Semaphore::new(REQUESTS_IN_FLIGHT_PER_CONNECTION_MAX));
    let mut carried: Option<Incoming> = None;
    // Input frames to drop silently: the one of a request we could not
    // parse, or every one of a refused batch.
    let mut skip_inputs = 0usize;
    loop {
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let frame = match carried.take() {
            Some(f) => f,
            None => read_incoming(&mut rd).await,
        };
        let out = match frame {
            Incoming::Eof => return (rd, false),
            Incoming::Fatal(e) => return farewell(&tx, rd, peer, e, permit).await,
            Incoming::Oversized { kind, len } => {
                skip_inputs = 0;
                error_reply(
                    0,
                    ErrorCode::BadRequest,
                    format!(
                        "a {kind:?} frame of {len} bytes exceeds the bound of {CONTROL_FRAME_BYTES_MAX} bytes; it was skipped"
                    ),
                    permit,
                )
            }
            Incoming::Frame(FrameKind::WriteChunk, payload) => {
                if skip_inputs > 0 {
                    skip_inputs -= 1;
                    continue;
                }
                error_reply(
                    0,
                    ErrorCode::BadRequest,
                    format!(
                        "an input frame of {} bytes that follows no infer request; skipped",
                        payload.len()
                    ),
                    permit,
                )
            }
            Incoming::Frame(FrameKind::Bytes, payload) => error_reply(
                0,
                ErrorCode::BadRequest,
                format!(
                    "a data frame of {} bytes on a GPU server's control connection; skipped \
                     (inputs go in write-chunk frames after their request)",
                    payload.len()
                ),
                permit,
            ),
            Incoming::Frame(FrameKind::Message, payload) => {
                skip_inputs = 0;
                match wire::decode_message::<RuntimeRequest>(&payload) {
                    Err(e) => {
                        skip_inputs = 1;
                        let id = salvage_id(&payload);
                        log::warn!("bad request from {peer}: {e}");
                        error_reply(
                            id,
                            ErrorCode::BadRequest,
                            format!("not a runtime request: {e}"),
                            permit,
                        )
                    }
                    Ok(RuntimeRequest::Stats { id }) => Outgoing {
                        reply: RuntimeReply::Stats {
                            id,
                            stats: shared.core.stats(),
                        },
                        frames: Vec::new(),
                        permit: Some(permit),
                        spent: Vec::new(),
                    },
                    Ok(RuntimeRequest::Evict {
                        id,
                        model,
                        host_only,
                    }) => evict(shared, id, model, host_only, permit),
                    Ok(RuntimeRequest::Prefetch { id, model, device }) => {
                        match prefetch(shared, &tx, id, model, device, permit) {
                            Some(out) => out,
                            None => continue,
                        }
                    }
                    // Training stage workers (the controller's job placement).
                    Ok(RuntimeRequest::TrainStage { id, assignment }) => {
                        match stage::train_stage(shared, &tx, id, *assignment, permit) {
                            Some(out) => out,
                            None => continue,
                        }
                    }
                    Ok(RuntimeRequest::TrainStageStart {
                        id,
                        job,
                        generation,
                        pipeline,
                        stage: at,
                        prev,
                        next,
                        replicas,
                    }) => {
                        let peers = stage::Peers {
                            prev,
                            next,
                            replicas,
                        };
                        match stage::train_stage_start(
                            shared, &tx, id, job, generation, pipeline, at, peers, permit,
                        ) {
                            Some(out) => out,
                            None => continue,
                        }
                    }
                    Ok(RuntimeRequest::TrainStageStop {
                        id,
                        job,
                        pipeline,
                        stage: at,
                        generation,
                    }) => {
                        match stage::train_stage_stop(
                            shared, &tx, id, job, pipeline, at, generation, permit,
                        ) {
                            Some(out) => out,
                            None => continue,
                        }
                    }
                    Ok(RuntimeRequest::Train { id, device, model }) => {
                        match train(shared, &tx, id, device, model, permit) {
                            Some(out) => out,
                            None => continue,
                        }
                    }
                    Ok(RuntimeRequest::Infer {
                        id,
                        model,
                        deadline_ms,
                        trace,
                        device,
                        batch,
                        catalog_version,
                    }) => {
                        let arrived = Instant::now();
                        let head = BatchMember {
                            id,
                            deadline_ms,
                            trace,
                        };
                        if batch.len() > BATCH_MEMBERS_MAX {
                            // Every request is refused, and their input frames skipped.
                            skip_inputs = 1 + batch.len();
                            let why = format!(
                                "a batch of {} requests for {model} (request {id} and {} more); at most {} run together",
                                1 + batch.len(),
                                batch.len(),
                                1 + BATCH_MEMBERS_MAX
                            );
                            let first = error_reply(id, ErrorCode::BadRequest, why.clone(), permit);
                            let rest = batch.iter().map(|b| Outgoing {
                                reply: RuntimeReply::Error {
                                    id: b.id,
                                    error: ErrorReply::new(ErrorCode::BadRequest, why.clone()),
                                },
                                frames: Vec::new(),
                                permit: None,
                                spent: Vec::new(),
                            });
                            for out in std::iter::once(first).chain(rest) {
                                if tx.send(out).await.is_err() {
                                    return (rd, false);
                                }
                            }
                            continue;
                        }
                        // One in-flight slot per request of the batch.
                        let mut permits = Vec::with_capacity(1 + batch.len());
                        permits.push(permit);
                        if !batch.is_empty() {
                            let mut more = slots
                                .clone()
                                .acquire_many_owned(batch.len() as u32)
                                .await
                                .expect("the semaphore is never closed");
                            for _ in 1..batch.len() {
                                permits.push(more.split(1).expect("permits left to split"));
                            }
                            permits.push(more);
                        }
                        let requests = std::iter::once(head).chain(batch);
                        let read = read_inputs(&mut rd, requests, permits, &model).await;
                        let (members, refused) = match read {
                            Inputs::Read { members, refused } => (members, refused),
                            Inputs::Eof => return (rd, false),
                            Inputs::Fatal(e, permit) => {
                                return farewell(&tx, rd, peer, e, permit).await
                            }
                            Inputs::Carried {
                                frame,
                                members,
                                refused,
                            } => {
                                carried = Some(frame);
                                (members, refused)
                            }
                        };
                        for out in refused {
                            if tx.send(out).await.is_err() {
                                return (rd, false);
                            }
                        }
                        if members.is_empty() {
                            continue;
                        }
                        let refused = infer(
                            shared,
                            &tx,
                            Infer {
                                model,
                                device,
                                catalog_version,
                                arrived,
                                members,
                            },
                        );
                        for out in refused {
                            if tx.send(out).await.is_err() {
                                return (rd, false);
                            }
                        }
                        continue;
                    }
                }
            }
        };
        if tx.send(out).await.is_err() {
            return (rd, false);
        }
    }
}

/// An inference request (alone or a batch) as read from the connection:
/// the requests whose input frames came.
struct Infer {
    model: String,
    device: Option<u32>,
    /// The catalog version the sender resolved the model at (`None`: the
    /// runtime's own view serves).
    catalog_version: Option<u64>,
    arrived: Instant,
    members: Vec<Member>,
}

/// The input frames of an `Infer`'s requests, as read.
enum Inputs {
    /// Every frame was read: the requests with a usable input, and the
    /// replies of those without.
    Read {
        members: Vec<Member>,
        refused: Vec<Outgoing>,
    },
    /// A message frame came where an input frame was due: it is handled
    /// next; the requests still missing their input are in `refused`.
    Carried {
        frame: Incoming,
        members: Vec<Member>,
        refused: Vec<Outgoing>,
    },
    Eof,
    Fatal(WireError, OwnedSemaphorePermit),
}

/// Reads one input frame per request (`requests` and `permits` pair up).
/// An oversized frame refuses its request; more than
/// [`BATCH_INPUT_BYTES_MAX`] bytes in all refuses every request, and frames
/// past the bound are dropped as they are read, so at most the bound plus
/// one frame is held.
async fn read_inputs(
    rd: &mut OwnedReadHalf,
    requests: impl Iterator<Item = BatchMember>,
    permits: Vec<OwnedSemaphorePermit>,
    model: &str,
) -> Inputs {
    let n = permits.len();
    let missing = |id: u64| {
        format!(
            "request {id}: an infer request must be followed by its input frame (.npy bytes), got a message frame"
        )
    };
    let mut got: Vec<(BatchMember, OwnedSemaphorePermit, Result<Vec<u8>, String>)> =
        Vec::with_capacity(n);
    let mut total = 0usize;
    let mut carried = None;
    let mut pending = requests.zip(permits);
    for (req, permit) in pending.by_ref() {
        let id = req.id;
        let input = match read_incoming(rd).await {
            Incoming::Frame(FrameKind::WriteChunk, bytes) => {
                total = total.saturating_add(bytes.len());
                // Past the bound the bytes are dropped; the reason is given below.
                if total > BATCH_INPUT_BYTES_MAX {
                    Err(String::new())
                } else {
                    Ok(bytes)
                }
            }
            Incoming::Eof => return Inputs::Eof,
            Incoming::Fatal(e) => return Inputs::Fatal(e, permit),
            Incoming::Oversized { kind, len } => Err(format!(
                "request {id}: its {kind:?} input frame is {len} bytes, more than the bound of \
                 {CONTROL_FRAME_BYTES_MAX} bytes; send a smaller batch"
            )),
            other @ Incoming::Frame(FrameKind::Message | FrameKind::Bytes, _) => {
                carried = Some(other);
                got.push((req, permit, Err(missing(id))));
                break;
            }
        };
        got.push((req, permit, input));
    }
    for (req, permit) in pending {
        let why = missing(req.id);
        got.push((req, permit, Err(why)));
    }
    let over = total > BATCH_INPUT_BYTES_MAX;
    let mut members = Vec::with_capacity(n);
    let mut refused = Vec::new();
    for (req, permit, input) in got {
        let input = if over {
            Err(format!(
                "request {}: its batch of {n} requests for {model} carries {total} input bytes, more than \
                 the bound of {BATCH_INPUT_BYTES_MAX}; send smaller batches",
                req.id
            ))
        } else {
            input
        };
        // Parsed here, on the connection's task, off the device's serial path.
        let input = input.and_then(|bytes| {
            parse_npy(&bytes, Path::new("the input frame"))
                .map_err(|e| format!("request {} for {model}: {e}", req.id))
        });
        match input {
            Ok(input) => members.push(Member {
                id: req.id,
                input,
                deadline: req.deadline_ms.map(Duration::from_millis),
                trace: req.trace,
                permit: Some(permit),
            }),
            Err(why) => refused.push(error_reply(req.id, ErrorCode::BadRequest, why, permit)),
        }
    }
    match carried {
        Some(frame) => Inputs::Carried {
            frame,
            members,
            refused,
        },
        None => Inputs::Read { members, refused },
    }
}

/// The name check every request naming a model gets: why it fails.
fn check_model_name(model: &str) -> Result<(), String> {
    if model.is_empty() || model.len() > NAME_BYTES_MAX {
        return Err(format!(
            "a model name is 1..={NAME_BYTES_MAX} bytes, got {}",
            model.len()
        ));
    }
    Ok(())
}

/// Answers each of `members` with the error `why(id)` (the request
/// metrics count them).
fn refuse(
    shared: &Shared,
    model: &str,
    arrived: Instant,
    members: Vec<Member>,
    code: ErrorCode,
    why: &dyn Fn(u64) -> String,
) -> Vec<Outgoing> {
    members
        .into_iter()
        .map(|mut m| {
            shared
                .core
                .metrics
                .observe_request(model, Some(code), arrived.elapsed());
            let permit = m.permit.take().expect("a queued request holds its permit");
            error_reply(m.id, code, why(m.id), permit)
        })
        .collect()
}

/// Queues an inference (on the device it names, else where dispatch puts
/// it) with the model's compiled plan; returns the replies to send at once
/// (one per request) when it was not queued. A model whose plan is missing
/// or older than `catalog_version` is resolved first on a blocking thread
/// (one controller call per model however many requests wait for it),
/// never on the device's serial path; the reader goes on meanwhile.
fn infer(shared: &Arc<Shared>, tx: &mpsc::Sender<Outgoing>, req: Infer) -> Vec<Outgoing> {
    if let Err(why) = check_model_name(&req.model) {
        return refuse(
            shared,
            &req.model,
            req.arrived,
            req.members,
            ErrorCode::BadRequest,
            &|id| format!("request {id}: {why}"),
        );
    }
    let index = match req.device.map(|d| shared.core.device_index(d)) {
        None => None,
        Some(Ok(i)) => Some(i),
        Some(Err(why)) => {
            let model = req.model.clone();
            return refuse(
                shared,
                &req.model,
                req.arrived,
                req.members,
                ErrorCode::BadRequest,
                &|id| format!("request {id} for {model}: {why}"),
            );
        }
    };
    if let Some(plan) = shared.core.catalog.cached(&req.model, req.catalog_version) {
        return queue(shared, tx, req, index, plan);
    }
    let shared = shared.clone();
    let tx = tx.clone();
    tokio::spawn(async move {
        let core = shared.core.clone();
        let (model, version) = (req.model.clone(), req.catalog_version);
        let resolved =
            tokio::task::spawn_blocking(move || core.catalog.resolve(&model, version)).await;
        let replies = match resolved {
            Ok(Ok(plan)) => queue(&shared, &tx, req, index, plan),
            Ok(Err(e)) => refuse(
                &shared,
                &req.model,
                req.arrived,
                req.members,
                e.code,
                &|id| format!("request {id}: {}", e.message),
            ),
            Err(e) => refuse(
                &shared,
                &req.model,
                req.arrived,
                req.members,
                ErrorCode::Internal,
                &|id| format!("request {id}: resolving the model failed: {e}"),
            ),
        };
        for out in replies {
            // The connection may be gone; its replies go nowhere then.
            if tx.send(out).await.is_err() {
                break;
            }
        }
    });
    Vec::new()
}

/// Queues a checked inference with its plan on device `index` (else where
/// dispatch puts it); the refusals when it was not queued.
fn queue(
    shared: &Shared,
    tx: &mpsc::Sender<Outgoing>,
    req: Infer,
    index: Option<usize>,
    plan: Arc<ModelPlan>,
) -> Vec<Outgoing> {
    let model = req.model;
    // Several inputs of one shape past dimension 0 batch here, on the
    // connection's task; else the worker batches what it can.
    let batched = (req.members.len() > 1)
        .then(|| {
            let parts: Vec<&crate::exec::HostTensor> =
                req.members.iter().map(|m| &m.input).collect();
            super::batch::concat_rows(&parts).ok()
        })
        .flatten();
    let job = Job {
        model: model.clone(),
        batched,
        requests: req.members,
        arrived: req.arrived,
        device: 0,
        queued_at: req.arrived,
        reply: tx.clone(),
        plan,
    };
    let queued = match index {
        Some(i) => shared.dispatch_to(i, Task::Infer(job)),
        None => shared.dispatch(job),
    };
    let (task, code) = match queued {
        Ok(()) => return Vec::new(),
        Err(DispatchError::Busy(task)) => (task, ErrorCode::Busy),
        Err(DispatchError::ShuttingDown(task)) => (task, ErrorCode::ShuttingDown),
    };
    let Task::Infer(job) = *task else {
        unreachable!("an inference was queued")
    };
    let devices = shared.core.devices.len();
    refuse(
        shared,
        &model,
        req.arrived,
        job.requests,
        code,
        &|id| {
            match (code, req.device) {
            (ErrorCode::ShuttingDown, _) => format!("request {id}: the runtime is shutting down"),
            (_, Some(d)) => {
                format!("request {id} for {model}: the queue of device {d} is full; retry later")
            }
            (_, None) => format!(
                "request {id} for {model}: every device queue is full ({devices} devices); retry later"
            ),
        }
        },
    )
}

/// Cache-in without running. With a device: queued there (ordered with
/// its inference). Without: a host-cache fetch on a blocking thread, at
/// most [`PREFETCHES_IN_FLIGHT_MAX`] at once per runtime. Returns the reply
/// to send at once when nothing was started.
fn prefetch(
    shared: &Shared,
    tx: &mpsc::Sender<Outgoing>,
    id: u64,
    model: String,
    device: Option<u32>,
    permit: OwnedSemaphorePermit,
) -> Option<Outgoing> {
    let arrived = Instant::now();
    if let Err(why) = check_model_name(&model) {
        return Some(error_reply(
            id,
            ErrorCode::BadRequest,
            format!("request {id}: {why}"),
            permit,
        ));
    }
    let core = &shared.core;
    let Some(d) = device else {
        let Ok(slot) = core.prefetch_slots.clone().try_acquire_owned() else {
            return Some(error_reply(
                id,
                ErrorCode::Busy,
                format!(
                    "request {id}: prefetch of {model}: {PREFETCHES_IN_FLIGHT_MAX} host-cache \
                     prefetches are in flight (the bound); retry later"
                ),
                permit,
            ));
        };
        let core = core.clone();
        let tx = tx.clone();
        tokio::task::spawn_blocking(move || {
            let out = worker::prefetch_host(&core, id, &model, arrived);
            drop(slot);
            let out = Outgoing {
                permit: Some(permit),
                ..out
            };
            // The connection may be gone; its reply goes nowhere then.
            let _ = tx.blocking_send(out);
        });
        return None;
    };
    let index = match core.device_index(d) {
        Ok(i) => i,
        Err(why) => {
            return Some(error_reply(
                id,
                ErrorCode::BadRequest,
                format!("request {id}: prefetch of {model}: {why}"),
                permit,
            ))
        }
    };
    let task = Task::Prefetch(PrefetchJob {
        id,
        model: model.clone(),
        arrived,
        queued_at: arrived,
        reply: tx.clone(),
        permit: Some(permit),
    });
    match shared.dispatch_to(index, task) {
        Ok(()) => None,
        Err(DispatchError::Busy(mut task)) => Some(error_reply(
            id,
            ErrorCode::Busy,
            format!(
                "request {id}: prefetch of {model}: the queue of device {d} is full; retry later"
            ),
            take_prefetch_permit(&mut task),
        )),
        Err(DispatchError::ShuttingDown(mut task)) => Some(error_reply(
            id,
            ErrorCode::ShuttingDown,
            format!("request {id}: the runtime is shutting down"),
            take_prefetch_permit(&mut task),
        )),
    }
}

/// The permit of a prefetch that was not queued.
fn take_prefetch_permit(task: &mut Task) -> OwnedSemaphorePermit {
    match task {
        Task::Prefetch(p) => p.permit.take().expect("the prefetch holds its permit"),
        Task::Infer(_) => unreachable!("a prefetch was queued"),
    }
}

/// Hands a training start/switch/stop to the device's worker, which
/// applies it at its next iteration boundary and replies.
fn train(
    shared: &Shared,
    tx: &mpsc::Sender<Outgoing>,
    id: u64,
    device: u32,
    model: Option<String>,
    permit: OwnedSemaphorePermit,
) -> Option<Outgoing> {
    if let Some(m) = &model {
        if let Err(why) = check_model_name(m) {
            return Some(error_reply(
                id,
                ErrorCode::BadRequest,
                format!("request {id}: {why}"),
                permit,
            ));
        }
    }
    let index = match shared.core.device_index(device) {
        Ok(i) => i,
        Err(why) => {
            return Some(error_reply(
                id,
                ErrorCode::BadRequest,
                format!("request {id}: train: {why}"),
                permit,
            ))
        }
    };
    let control = TrainControl {
        id,
        model,
        reply: tx.clone(),
        permit: Some(permit),
    };
    match shared.control(index, control) {
        Ok(()) => None,
        Err(DispatchError::Busy(mut c)) => Some(error_reply(
            id,
            ErrorCode::Busy,
            format!(
                "request {id}: device {device} already has {TRAIN_CONTROLS_MAX} train requests \
                 waiting for its next iteration boundary; retry later"
            ),
            c.permit.take().expect("the control holds its permit"),
        )),
        Err(DispatchError::ShuttingDown(mut c)) => Some(error_reply(
            id,
            ErrorCode::ShuttingDown,
            format!("request {id}: the runtime is shutting down"),
            c.permit.take().expect("the control holds its permit"),
        )),
    }
}

fn evict(
    shared: &Shared,
    id: u64,
    model: String,
    host_only: bool,
    permit: OwnedSemaphorePermit,
) -> Outgoing {
    let core = &shared.core;
    let host_cache = core.cache.remove(&model).is_some();
    let devices = if host_only {
        0
    } else {
        let n = core
            .devices
            .iter()
            .filter(|d| d.residency.evict(&model).is_some())
            .count() as u32;
        core.catalog.forget(&model);
        n
    };
    log::info!("evicted {model}: host cache {host_cache}, {devices} devices");
    Outgoing {
        reply: RuntimeReply::Evicted {
            id,
            model,
            host_cache,
            devices,
        },
        frames: Vec::new(),
        permit: Some(permit),
        spent: Vec::new(),
    }
}

/// The request id of a message that is JSON but not a request, else 0.
fn salvage_id(payload: &[u8]) -> u64 {
    serde_json::from_slice::<serde_json::Value>(payload)
        .ok()
        .and_then(|v| v.get("id")?.as_u64())
        .unwrap_or(0)
}

async fn farewell(
    tx: &mpsc::Sender<Outgoing>,
    rd: OwnedReadHalf,
    peer: SocketAddr,
    e: WireError,
    permit: OwnedSemaphorePermit,
) -> (OwnedReadHalf, bool) {
    if matches!(e, WireError::Truncated) {
        log::debug!("connection from {peer} cut in the middle of a frame");
        return (rd, false);
    }
    log::warn!("closing connection from {peer}: {e}");
    let out = error_reply(0, ErrorCode::BadRequest, format!("{e}; closing"), permit);
    let _ = tx.send(out).await;
    (rd, true)
}
