//! The per-stream threads of the TCP transport and the state they share.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam::channel::{Receiver, Sender};
use distmind_common::limits::READ_CHUNK_BYTES_MAX;
use distmind_common::wire::{ReadReply, ReadRequest, ReadStatus, READ_REPLY_BYTES};

use crate::completion::{CompletionQueue, Target};
use crate::token_bucket::TokenBucket;
use crate::TransportError;

/// State shared by the transport and its threads.
pub(super) struct Shared {
    pub(super) cq: CompletionQueue,
    pub(super) bucket: Option<TokenBucket>,
}

/// One posted op; its chunks finish on any of the peer's streams.
pub(super) struct OpState {
    pub(super) wr_id: u64,
    pub(super) chunks: usize,
    pub(super) remaining: AtomicUsize,
    pub(super) failed: AtomicBool,
    /// The first error; touched only on the error path and at completion.
    pub(super) error: Mutex<Option<TransportError>>,
    pub(super) target: Target,
}

pub(super) struct Chunk {
    pub(super) op: Arc<OpState>,
    pub(super) remote_offset: u64,
    pub(super) local_offset: u64,
    pub(super) len: u64,
    /// The unfinished bytes of the stream it was given to, which count it
    /// until it finishes.
    pub(super) stream_bytes: Arc<AtomicU64>,
}

impl Shared {
    pub(super) fn finish(&self, c: Chunk, result: Result<(), TransportError>) {
        c.stream_bytes.fetch_sub(c.len, Ordering::AcqRel);
        let op = &c.op;
        match result {
            Ok(()) => self.cq.add_bytes(c.len),
            Err(e) => {
                if !op.failed.swap(true, Ordering::AcqRel) {
                    *op.error.lock().unwrap() = Some(e);
                }
            }
        }
        if op.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let result = match op.failed.load(Ordering::Acquire) {
                false => Ok(()),
                true => Err(op
                    .error
                    .lock()
                    .unwrap()
                    .take()
                    .expect("a failed op records its error")),
            };
            self.cq
                .complete(op.wr_id, op.chunks, result, &op.target.region_inflight);
        }
    }
}

/// A peer's liveness and its sockets (kept to shut them down).
pub(super) struct Link {
    pub(super) addr: String,
    pub(super) dead: AtomicBool,
    pub(super) reason: Mutex<String>,
    pub(super) sockets: Vec<TcpStream>,
}

impl Link {
    pub(super) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Marks the peer lost (the first reason wins) and wakes every thread
    /// blocked on its sockets.
    pub(super) fn kill(&self, reason: &str) {
        {
            let mut r = self.reason.lock().unwrap();
            if !self.dead.load(Ordering::Acquire) {
                *r = reason.to_owned();
                self.dead.store(true, Ordering::Release);
            }
        }
        if reason != "disconnected by this client" {
            log::warn!("transport tcp: memory server {} lost: {reason}", self.addr);
        }
        for s in &self.sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    pub(super) fn lost(&self) -> TransportError {
        TransportError::PeerLost {
            addr: self.addr.clone(),
            reason: self.reason.lock().unwrap().clone(),
        }
    }
}

/// Sends requests for its stream's chunks, in the order its reader expects them.
pub(super) fn writer(
    link: &Link,
    sh: &Shared,
    queue: &Receiver<Chunk>,
    to_reader: &Sender<(u64, Chunk)>,
    mut sock: TcpStream,
) {
    let mut seq = 0u64;
    for c in queue.iter() {
        if link.is_dead() {
            sh.finish(c, Err(link.lost()));
            continue;
        }
        seq += 1;
        let req = ReadRequest {
            wr_id: seq,
            offset: c.remote_offset,
            len: c.len,
        }
        .encode();
        // Blocks while `inflight_per_stream` requests are outstanding.
        if let Err(e) = to_reader.send((seq, c)) {
            let (_, c) = e.into_inner();
            sh.finish(c, Err(link.lost()));
            continue;
        }
        // On failure the reader fails the chunk it was just handed, because
        // `kill` shuts the socket down under it.
        if let Err(e) = sock.write_all(&req) {
            link.kill(&format!("sending a read request failed: {e}"));
        }
    }
}

/// Why a chunk failed: only for this op, or for the whole connection.
enum ChunkError {
    Op(TransportError),
    Fatal { op: TransportError, reason: String },
}

fn io_reason(e: &std::io::Error, what: &str) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            format!("connection closed by the server while {what}")
        }
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("no data for the io timeout while {what}")
        }
        _ => format!("{e} while {what}"),
    }
}

/// Reads the reply to request `seq` (chunk `c`) into its destination.
fn read_chunk(
    link: &Link,
    sh: &Shared,
    sock: &mut TcpStream,
    seq: u64,
    c: &Chunk,
) -> Result<(), ChunkError> {
    let addr = &link.addr;
    let lost = |reason: String| ChunkError::Fatal {
        op: TransportError::PeerLost {
            addr: addr.clone(),
            reason: reason.clone(),
        },
        reason,
    };
    let protocol = |detail: String| ChunkError::Fatal {
        op: TransportError::Protocol {
            addr: addr.clone(),
            detail: detail.clone(),
        },
        reason: format!("protocol error: {detail}"),
    };
    let mut hb = [0u8; READ_REPLY_BYTES];
    sock.read_exact(&mut hb)
        .map_err(|e| lost(io_reason(&e, "reading a reply header")))?;
    let h = ReadReply::decode(&hb, READ_CHUNK_BYTES_MAX)
        .map_err(|e| protocol(format!("bad reply header: {e}")))?;
    if h.wr_id != seq {
        return Err(protocol(format!(
            "reply for request {} while expecting request {seq}",
            h.wr_id
        )));
    }
    match h.status {
        ReadStatus::Ok if h.len == c.len => {}
        ReadStatus::Ok => {
            return Err(protocol(format!(
                "reply of {} bytes to a request for {}",
                h.len, c.len
            )))
        }
        ReadStatus::OutOfRange if h.len == 0 => {
            return Err(ChunkError::Op(TransportError::RemoteOutOfRange {
                addr: addr.clone(),
                offset: c.remote_offset,
                len: c.len,
            }))
        }
        ReadStatus::OutOfRange => {
            return Err(protocol(format!(
                "out-of-range reply carrying {} bytes",
                h.len
            )))
        }
        ReadStatus::BadRequest => {
            return Err(protocol(
                "the server rejected our request as malformed".into(),
            ))
        }
        ReadStatus::ShuttingDown => return Err(lost("the server is shutting down".into())),
    }
    if let Some(b) = &sh.bucket {
        b.acquire(c.len);
    }
    let start = c.local_offset as usize;
    // SAFETY: the range was checked to lie inside the buffer by `validate`;
    // post_reads' caller guarantees no one else touches it until the op
    // completes, which is after this chunk finishes; chunks of one op are
    // disjoint and ops in flight do not overlap (post_reads' contract).
    let dst = unsafe { c.op.target.buf.slice_mut(start..start + c.len as usize) };
    sock.read_exact(dst)
        .map_err(|e| lost(io_reason(&e, "reading a payload")))
}

/// Finishes the stream's chunks in request order.
pub(super) fn reader(
    link: &Link,
    sh: &Shared,
    from_writer: &Receiver<(u64, Chunk)>,
    mut sock: TcpStream,
) {
    let mut in_step = true;
    for (seq, c) in from_writer.iter() {
        if !in_step || link.is_dead() {
            in_step = false;
            sh.finish(c, Err(link.lost()));
            continue;
        }
        match read_chunk(link, sh, &mut sock, seq, &c) {
            Ok(()) => sh.finish(c, Ok(())),
            Err(ChunkError::Op(e)) => sh.finish(c, Err(e)),
            Err(ChunkError::Fatal { op, reason }) => {
                in_step = false;
                link.kill(&reason);
                sh.finish(c, Err(op));
            }
        }
    }
}
