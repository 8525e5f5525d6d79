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
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::handshake;
use distmind_common::limits::{CONTROL_FRAME_BYTES_MAX, NAME_BYTES_MAX};
use distmind_common::proto::{ErrorCode, ErrorReply, RuntimeReply, RuntimeRequest};
use distmind_common::wire::{self, FrameHeader, FrameKind, Role, WireError, FRAME_HEADER_BYTES};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use super::worker::{self, Job, Outgoing, PrefetchJob, Task, TrainControl};
use super::{
    DispatchError, Shared, PREFETCHES_IN_FLIGHT_MAX, REQUESTS_IN_FLIGHT_PER_CONNECTION_MAX,
    TRAIN_CONTROLS_MAX,
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
        let mut frames = out.frames;
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
    let mut payload = vec![0u8; h.len as usize];
    if let Err(e) = rd.read_exact(&mut payload).await {
        return Incoming::Fatal(e.into());
    }
    Incoming::Frame(h.kind, payload)
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
    }
}

/// Reads requests until the peer closes; returns the read half and whether
/// the connection must close after a framing error.
async fn read_loop(
    shared: &Shared,
    mut rd: OwnedReadHalf,
    tx: mpsc::Sender<Outgoing>,
    peer: SocketAddr,
) -> (OwnedReadHalf, bool) {
    let slots = Arc::new(Semaphore::new(REQUESTS_IN_FLIGHT_PER_CONNECTION_MAX));
    let mut carried: Option<Incoming> = None;
    // The input frame of a request we could not parse is dropped silently.
    let mut skip_input = false;
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
                skip_input = false;
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
                if std::mem::take(&mut skip_input) {
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
            Incoming::Frame(FrameKind::Message, payload) => {
                skip_input = false;
                match wire::decode_message::<RuntimeRequest>(&payload) {
                    Err(e) => {
                        skip_input = true;
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
                        batch: _,
                        catalog_version: _,
                    }) => {
                        let arrived = Instant::now();
                        let input = match read_incoming(&mut rd).await {
                            Incoming::Frame(FrameKind::WriteChunk, bytes) => bytes,
                            Incoming::Eof => return (rd, false),
                            Incoming::Fatal(e) => return farewell(&tx, rd, peer, e, permit).await,
                            Incoming::Oversized { kind, len } => {
                                let out = error_reply(
                                    id,
                                    ErrorCode::BadRequest,
                                    format!(
                                        "request {id}: its {kind:?} input frame is {len} bytes, more than the bound of \
                                         {CONTROL_FRAME_BYTES_MAX} bytes; send a smaller batch"
                                    ),
                                    permit,
                                );
                                if tx.send(out).await.is_err() {
                                    return (rd, false);
                                }
                                continue;
                            }
                            other @ Incoming::Frame(FrameKind::Message, _) => {
                                carried = Some(other);
                                let out = error_reply(
                                    id,
                                    ErrorCode::BadRequest,
                                    format!("request {id}: an infer request must be followed by its input frame (.npy bytes), got a message frame"),
                                    permit,
                                );
                                if tx.send(out).await.is_err() {
                                    return (rd, false);
                                }
                                continue;
                            }
                        };
                        match infer(
                            shared,
                            &tx,
                            Infer {
                                id,
                                model,
                                deadline_ms,
                                trace,
                                device,
                                arrived,
                                input,
                            },
                            permit,
                        ) {
                            Some(out) => out,
                            None => continue,
                        }
                    }
                }
            }
        };
        if tx.send(out).await.is_err() {
            return (rd, false);
        }
    }
}

/// An inference request as read from the connection.
struct Infer {
    id: u64,
    model: String,
    deadline_ms: Option<u64>,
    trace: bool,
    device: Option<u32>,
    arrived: Instant,
    input: Vec<u8>,
}

/// The name check every request naming a model gets.
fn check_model_name(id: u64, model: &str) -> Result<(), String> {
    if model.is_empty() || model.len() > NAME_BYTES_MAX {
        return Err(format!(
            "request {id}: a model name is 1..={NAME_BYTES_MAX} bytes, got {}",
            model.len()
        ));
    }
    Ok(())
}

/// Queues an inference (on the device it names, else where dispatch puts
/// it); returns the reply to send at once when it was not queued.
fn infer(
    shared: &Shared,
    tx: &mpsc::Sender<Outgoing>,
    req: Infer,
    permit: OwnedSemaphorePermit,
) -> Option<Outgoing> {
    let id = req.id;
    let metrics = &shared.core.metrics;
    let refuse = |code: ErrorCode, message: String, permit| {
        metrics.observe_request(&req.model, Some(code), req.arrived.elapsed());
        Some(error_reply(id, code, message, permit))
    };
    if let Err(why) = check_model_name(id, &req.model) {
        return refuse(ErrorCode::BadRequest, why, permit);
    }
    let index = match req.device.map(|d| shared.core.device_index(d)) {
        None => None,
        Some(Ok(i)) => Some(i),
        Some(Err(why)) => {
            return refuse(
                ErrorCode::BadRequest,
                format!("request {id} for {}: {why}", req.model),
                permit,
            )
        }
    };
    let job = Job {
        id,
        model: req.model.clone(),
        input: req.input,
        deadline: req.deadline_ms.map(Duration::from_millis),
        trace: req.trace,
        arrived: req.arrived,
        device: 0,
        queued_at: req.arrived,
        reply: tx.clone(),
        permit: Some(permit),
    };
    let queued = match index {
        Some(i) => shared.dispatch_to(i, Task::Infer(job)),
        None => shared.dispatch(job),
    };
    match queued {
        Ok(()) => None,
        Err(DispatchError::Busy(mut task)) => {
            let message = match req.device {
                Some(d) => format!(
                    "request {id} for {}: the queue of device {d} is full; retry later",
                    req.model
                ),
                None => format!(
                    "request {id} for {}: every device queue is full ({} devices); retry later",
                    req.model,
                    shared.core.devices.len()
                ),
            };
            let permit = task.take_permit().expect("the task holds its permit");
            refuse(ErrorCode::Busy, message, permit)
        }
        Err(DispatchError::ShuttingDown(mut task)) => refuse(
            ErrorCode::ShuttingDown,
            format!("request {id}: the runtime is shutting down"),
            task.take_permit().expect("the task holds its permit"),
        ),
    }
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
    if let Err(why) = check_model_name(id, &model) {
        return Some(error_reply(id, ErrorCode::BadRequest, why, permit));
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
            task.take_permit().expect("the task holds its permit"),
        )),
        Err(DispatchError::ShuttingDown(mut task)) => Some(error_reply(
            id,
            ErrorCode::ShuttingDown,
            format!("request {id}: the runtime is shutting down"),
            task.take_permit().expect("the task holds its permit"),
        )),
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
        if let Err(why) = check_model_name(id, m) {
            return Some(error_reply(id, ErrorCode::BadRequest, why, permit));
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
