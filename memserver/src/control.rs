//! One control connection: JSON [`MemserverRequest`]s, each answered by one
//! [`MemserverReply`], and write-chunk frames (`u64 LE offset` + bytes), which
//! get no reply: the first chunk rejected since the last `Commit` is reported
//! by the next `Commit`, which then does not commit.
//!
//! Bad input gets an `ErrorReply`; where the framing itself is lost (bad
//! header, frame over the bound) the connection is closed after it.

use std::net::SocketAddr;

use distmind_common::checksum;
use distmind_common::limits::{CONTROL_FRAME_BYTES_MAX, NAME_BYTES_MAX};
use distmind_common::proto::{ErrorCode, ErrorReply, MemserverReply, MemserverRequest};
use distmind_common::wire::{self, FrameKind, WireError};
use log::{debug, info, warn};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::metrics::Op;
use crate::server::Shared;

/// Write chunks rejected since the last commit.
#[derive(Default)]
struct Rejected {
    first: Option<ErrorReply>,
    count: u64,
}

/// What one control connection holds: rejected writes, and the verbs queue
/// pairs it connected (destroyed when the connection ends).
#[derive(Default)]
struct Conn {
    rejected: Rejected,
    verbs_qps: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

pub(crate) async fn serve(
    shared: &Shared,
    stream: TcpStream,
    peer: SocketAddr,
    stop: &mut watch::Receiver<bool>,
) {
    debug!("control connection from {peer}");
    let mut conn = Conn::default();
    serve_requests(shared, stream, peer, stop, &mut conn).await;
    // The connection's verbs queue pairs are destroyed with it.
    let qps = conn.verbs_qps.len();
    if qps > 0 {
        shared.metrics.verbs_queue_pairs.dec_by(qps as i64);
        info!("{peer}: control connection closed; {qps} verbs queue pair(s) destroyed");
    }
}

async fn serve_requests(
    shared: &Shared,
    mut stream: TcpStream,
    peer: SocketAddr,
    stop: &mut watch::Receiver<bool>,
    conn: &mut Conn,
) {
    loop {
        let frame = tokio::select! {
            biased;
            _ = stop.wait_for(|&s| s) => return,
            f = wire::read_frame(&mut stream, CONTROL_FRAME_BYTES_MAX) => f,
        };
        let reply = match frame {
            Ok(None) => return,
            Ok(Some((FrameKind::WriteChunk, payload))) => {
                write_chunk(shared, peer, &payload, &mut conn.rejected);
                continue;
            }
            Ok(Some((FrameKind::Message, payload))) => {
                match wire::decode_message::<MemserverRequest>(&payload) {
                    Ok(req) => {
                        let op = op_of(&req);
                        let reply = handle(shared, peer, req, conn).await;
                        match &reply {
                            MemserverReply::Error(e) => shared.metrics.error(op, e.code),
                            _ => shared.metrics.ok(op),
                        }
                        reply
                    }
                    Err(e) => {
                        warn!("control request from {peer} is not a memory server request: {e}");
                        shared.metrics.error(Op::Invalid, ErrorCode::BadRequest);
                        error(
                            ErrorCode::BadRequest,
                            format!("not a memory server request: {e}"),
                        )
                    }
                }
            }
            Ok(Some((FrameKind::Bytes, _))) => {
                shared.metrics.error(Op::Invalid, ErrorCode::BadRequest);
                error(
                    ErrorCode::BadRequest,
                    "a control connection takes requests and write chunks, not data frames",
                )
            }
            Err(WireError::Truncated) => {
                warn!("control connection from {peer} ended in the middle of a frame");
                return;
            }
            Err(WireError::Io(e)) => {
                debug!("control connection from {peer}: {e}");
                return;
            }
            Err(e) => {
                // The framing is lost: say why, then close.
                warn!("bad frame from {peer} (closing the connection): {e}");
                shared.metrics.error(Op::Invalid, ErrorCode::BadRequest);
                let reply = error(ErrorCode::BadRequest, format!("bad frame: {e}"));
                if wire::send_message(&mut stream, &reply).await.is_ok() {
                    crate::server::close_after_error(&mut stream).await;
                }
                return;
            }
        };
        if let Err(e) = wire::send_message(&mut stream, &reply).await {
            debug!("control connection from {peer} closed before its reply: {e}");
            return;
        }
    }
}

/// The metrics label of a request.
fn op_of(req: &MemserverRequest) -> Op {
    match req {
        MemserverRequest::Alloc { .. } => Op::Alloc,
        MemserverRequest::Commit { .. } => Op::Commit,
        MemserverRequest::Free { .. } => Op::Free,
        MemserverRequest::Stats => Op::Stats,
        MemserverRequest::DataPaths => Op::DataPaths,
        MemserverRequest::VerbsConnect { .. } => Op::VerbsConnect,
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> MemserverReply {
    MemserverReply::Error(ErrorReply::new(code, message))
}

fn write_chunk(shared: &Shared, peer: SocketAddr, payload: &[u8], rejected: &mut Rejected) {
    let result = match payload.split_first_chunk::<8>() {
        None => Err(ErrorReply::new(
            ErrorCode::BadRequest,
            format!(
                "write chunk of {} bytes has no 8-byte offset",
                payload.len()
            ),
        )),
        Some((offset, data)) => {
            let offset = u64::from_le_bytes(*offset);
            shared.arena.write(offset, data).map_err(|e| {
                let mut r = e.to_reply();
                r.message = format!("write of {} bytes at {offset} rejected: {}", data.len(), e);
                r
            })
        }
    };
    match &result {
        Ok(()) => shared.metrics.ok(Op::Write),
        Err(e) => shared.metrics.error(Op::Write, e.code),
    }
    if let Err(e) = result {
        if rejected.first.is_none() {
            warn!(
                "write chunk from {peer} rejected (reported at its commit): {}",
                e.message
            );
            rejected.first = Some(e);
        }
        rejected.count += 1;
    }
}

async fn handle(
    shared: &Shared,
    peer: SocketAddr,
    req: MemserverRequest,
    conn: &mut Conn,
) -> MemserverReply {
    let rejected = &mut conn.rejected;
    match req {
        MemserverRequest::Alloc { bytes, owner } => {
            if owner.len() > NAME_BYTES_MAX {
                return error(
                    ErrorCode::BadRequest,
                    format!(
                        "owner name of {} bytes exceeds {NAME_BYTES_MAX}",
                        owner.len()
                    ),
                );
            }
            match shared.arena.alloc(bytes, &owner) {
                Ok(offset) => {
                    debug!("{peer}: allocated {bytes} bytes at {offset} for {owner:?}");
                    MemserverReply::Allocated { offset }
                }
                Err(e) => {
                    warn!("{peer}: alloc of {bytes} bytes for {owner:?} failed: {e}");
                    shared.metrics.alloc_failures.inc();
                    MemserverReply::Error(e.to_reply())
                }
            }
        }
        MemserverRequest::Commit { offset, checksum } => {
            if let Some(mut first) = rejected.first.take() {
                let n = std::mem::take(&mut rejected.count);
                first.message = format!(
                    "extent at {offset} not committed: {n} write chunk(s) were rejected since \
                     the last commit; the first: {}",
                    first.message
                );
                return MemserverReply::Error(first);
            }
            commit(shared, peer, offset, &checksum).await
        }
        MemserverRequest::Free { offset, owner } => {
            // One-sided reads take no lease: hold one for them a while (see
            // `onesided`), so reads posted before the free finish on the old bytes.
            let grace = shared
                .one_sided
                .enabled()
                .then(|| shared.arena.committed_len(offset))
                .flatten()
                .and_then(|len| shared.arena.read(offset, len).ok());
            match shared.arena.free(offset, owner.as_deref()) {
                Ok(outcome) => {
                    debug!("{peer}: freed extent at {offset} ({outcome:?})");
                    if let Some(lease) = grace {
                        let held = shared.metrics.free_grace_extents.clone();
                        held.inc();
                        tokio::spawn(async move {
                            tokio::time::sleep(crate::onesided::FREE_GRACE).await;
                            drop(lease);
                            held.dec();
                        });
                    }
                    MemserverReply::Freed { offset }
                }
                Err(e) => {
                    warn!("{peer}: free of {offset} failed: {e}");
                    MemserverReply::Error(e.to_reply())
                }
            }
        }
        MemserverRequest::Stats => MemserverReply::Stats(shared.stats()),
        MemserverRequest::DataPaths => MemserverReply::DataPaths(shared.one_sided.offer().clone()),
        MemserverRequest::VerbsConnect { qp } => {
            if conn.verbs_qps.len() >= crate::onesided::VERBS_QPS_PER_CONNECTION_MAX {
                return error(
                    ErrorCode::Full,
                    format!(
                        "this control connection already holds {} verbs queue pairs (the bound); \
                         open another connection",
                        conn.verbs_qps.len()
                    ),
                );
            }
            match shared.one_sided.verbs_connect(&qp) {
                Ok((qp, guard)) => {
                    conn.verbs_qps.push(guard);
                    shared.metrics.verbs_queue_pairs.inc();
                    info!("{peer}: verbs queue pair connected");
                    MemserverReply::VerbsConnected { qp }
                }
                Err(e) => {
                    warn!("{peer}: verbs_connect refused: {}", e.message);
                    MemserverReply::Error(e)
                }
            }
        }
    }
}

async fn commit(shared: &Shared, peer: SocketAddr, offset: u64, want_hex: &str) -> MemserverReply {
    let Some(want) = checksum::from_hex(want_hex) else {
        return error(
            ErrorCode::BadRequest,
            format!("checksum {want_hex:?} is not 16 hex digits (xxh3-64)"),
        );
    };
    let lease = match shared.arena.begin_commit(offset) {
        Ok(lease) => lease,
        Err(e) => {
            warn!("{peer}: commit of {offset} refused: {e}");
            return MemserverReply::Error(e.to_reply());
        }
    };
    // Hashing a large extent takes milliseconds: keep it off the async workers.
    let (lease, got) = tokio::task::spawn_blocking(move || {
        let got = checksum::checksum(lease.bytes());
        (lease, got)
    })
    .await
    .expect("checksum task panicked");
    if got != want {
        let len = lease.bytes().len();
        drop(lease);
        warn!("{peer}: commit of {offset} ({len} bytes): checksum mismatch");
        return error(
            ErrorCode::ChecksumMismatch,
            format!(
                "extent at {offset} ({len} bytes): checksum of the bytes written is {}, the \
                 commit says {want_hex}; the extent stays writable (rewrite it or free it)",
                checksum::to_hex(got)
            ),
        );
    }
    let len = lease.bytes().len() as u64;
    lease.commit();
    shared.metrics.bytes_committed.inc_by(len);
    info!("{peer}: committed extent at {offset} ({len} bytes)");
    MemserverReply::Committed { offset }
}
