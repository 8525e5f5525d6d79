//! One data connection: fixed 32-byte read requests in, reply header plus the
//! bytes straight from the arena out, answered in order.
//!
//! Per request: decode (bounded by [`READ_CHUNK_BYTES_MAX`]), take a read
//! lease (the range must lie in one Committed extent), take `len` permits of
//! the server-wide bytes-in-flight semaphore, `write_all` the header and the
//! leased bytes, release. Nothing is allocated and no JSON is parsed.

use std::net::SocketAddr;
use std::time::Duration;

use distmind_common::limits::READ_CHUNK_BYTES_MAX;
use distmind_common::wire::{ReadReply, ReadRequest, ReadStatus, READ_REQUEST_BYTES};
use log::{debug, info, warn};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::server::Shared;

/// A reader that does not drain a reply in this long is cut off, so that it
/// cannot pin a lease and bytes-in-flight permits forever.
const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(120);

enum Next {
    Request([u8; READ_REQUEST_BYTES]),
    Closed,
    Stop,
}

async fn next_request(
    stream: &mut TcpStream,
    peer: SocketAddr,
    stop: &mut watch::Receiver<bool>,
) -> Next {
    let mut b = [0u8; READ_REQUEST_BYTES];
    // Only the first read races shutdown: it is cancel-safe, and a request
    // already begun is read in full.
    let n = tokio::select! {
        biased;
        _ = stop.wait_for(|&s| s) => return Next::Stop,
        r = stream.read(&mut b) => match r {
            Ok(n) => n,
            Err(e) => {
                debug!("data connection from {peer}: {e}");
                return Next::Closed;
            }
        },
    };
    if n == 0 {
        return Next::Closed;
    }
    if let Err(e) = stream.read_exact(&mut b[n..]).await {
        warn!("data connection from {peer} ended in the middle of a read request: {e}");
        return Next::Closed;
    }
    Next::Request(b)
}

pub(crate) async fn serve(
    shared: &Shared,
    mut stream: TcpStream,
    peer: SocketAddr,
    stop: &mut watch::Receiver<bool>,
) {
    debug!("data connection from {peer}");
    loop {
        let raw = match next_request(&mut stream, peer, stop).await {
            Next::Request(raw) => raw,
            Next::Closed => return,
            Next::Stop => {
                // Tell a reader that waits for something why nothing comes.
                let r = ReadReply {
                    wr_id: 0,
                    status: ReadStatus::ShuttingDown,
                    len: 0,
                };
                let _ = stream.write_all(&r.encode()).await;
                return;
            }
        };
        let wr_id = u64::from_le_bytes(raw[8..16].try_into().expect("8 bytes"));
        let req = match ReadRequest::decode(&raw, READ_CHUNK_BYTES_MAX) {
            Ok(req) => req,
            Err(e) => {
                warn!("bad read request from {peer} (closing the connection): {e}");
                shared.metrics.reads_bad_request.inc();
                let r = ReadReply {
                    wr_id,
                    status: ReadStatus::BadRequest,
                    len: 0,
                };
                if stream.write_all(&r.encode()).await.is_ok() {
                    crate::server::close_after_error(&mut stream).await;
                }
                return;
            }
        };
        let lease = match shared.arena.read(req.offset, req.len) {
            Ok(lease) => lease,
            Err(e) => {
                info!("read from {peer} refused: {e}");
                shared.metrics.reads_out_of_range.inc();
                let r = ReadReply {
                    wr_id,
                    status: ReadStatus::OutOfRange,
                    len: 0,
                };
                if stream.write_all(&r.encode()).await.is_err() {
                    return;
                }
                continue;
            }
        };
        // Bounded by READ_CHUNK_BYTES_MAX <= read_bytes_in_flight_max (checked at bind).
        let permits = u32::try_from(req.len).expect("read length bounded by decode");
        let _in_flight = shared
            .read_bytes
            .acquire_many(permits)
            .await
            .expect("never closed");
        let header = ReadReply {
            wr_id,
            status: ReadStatus::Ok,
            len: req.len,
        }
        .encode();
        let send = async {
            // The host's NIC (an emulated link): one bucket for every connection.
            if let Some(nic) = &shared.nic {
                let wait = nic.reserve(req.len);
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
            }
            stream.write_all(&header).await?;
            stream.write_all(lease.bytes()).await
        };
        match tokio::time::timeout(REPLY_WRITE_TIMEOUT, send).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                debug!("data connection from {peer} closed during a reply: {e}");
                shared.metrics.reads_aborted.inc();
                return;
            }
            Err(_) => {
                warn!(
                    "reader {peer} did not take {} bytes in {REPLY_WRITE_TIMEOUT:?}; closing",
                    req.len
                );
                shared.metrics.reads_aborted.inc();
                return;
            }
        }
        // Pre-created counters: one relaxed atomic add each.
        shared.metrics.reads_served.inc();
        shared.metrics.bytes_served.inc_by(req.len);
    }
}
