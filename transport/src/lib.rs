//! The data path: one-sided reads from memory servers into registered host memory.
//!
//! A [`Transport`] is shaped like the verbs / libfabric model so that RDMA
//! implementations fit behind it without changing callers:
//!
//! * [`Transport::register`] a [`HostBuffer`] once (an MR), get a [`RegionId`];
//! * [`Transport::connect`] to a memory server's data port, get a [`PeerId`];
//! * [`Transport::post_reads`] a batch of [`ReadOp`]s (like `ibv_post_send` of
//!   RDMA READs or `fi_read`), which validates synchronously and returns;
//! * [`Transport::poll`] the completion queue (like `ibv_poll_cq` / `fi_cq_read`):
//!   every posted op completes exactly once, successfully or with an error.
//!
//! Implementations: [`tcp::TcpTransport`] (several streams per peer, chunked,
//! zero-copy receive), `fabric::FabricTransport` (libfabric `fi_read`,
//! feature `fabric`), `verbs::VerbsTransport` (RDMA READ, feature `verbs`),
//! [`Fallback`] (a one-sided transport with tcp for the memory servers that
//! do not serve it) and [`mem::MemTransport`] (in-memory, with fault
//! injection, for unit tests of callers).
//!
//! **Architecture invariant:** nothing here allocates per chunk, parses JSON
//! or takes a lock per chunk on the data path; every queue has a named bound.

use std::sync::Arc;
use std::time::Duration;

pub mod completion;
#[cfg(feature = "fabric")]
pub mod fabric;
pub mod fallback;
pub mod mem;
pub mod memory;
pub mod priority;
pub mod tcp;
pub mod token_bucket;
pub mod verbs;

pub use completion::{chunk_count, Chunks};
pub use fallback::Fallback;
pub use mem::{MemFabric, MemTransport};
pub use memory::{HostBuffer, HugePages, MemoryError};
pub use tcp::{TcpOptions, TcpTransport};
pub use token_bucket::TokenBucket;

/// Posted-but-not-yet-polled read ops per transport. Over it, `post_reads`
/// answers [`TransportError::QueueFull`] and the caller polls and retries.
pub const INFLIGHT_OPS_MAX: usize = 4096;
/// Posted-but-not-yet-finished chunks per transport (an op is cut into
/// `chunk_bytes` pieces); bounds the per-peer work queues.
pub const INFLIGHT_CHUNKS_MAX: usize = 16384;
/// Connections per peer a transport may open.
pub const STREAMS_PER_PEER_MAX: usize = 64;
/// Requests a stream may have outstanding on the wire.
pub const INFLIGHT_PER_STREAM_MAX: usize = 64;

const _: () = assert!(INFLIGHT_CHUNKS_MAX >= INFLIGHT_OPS_MAX);
const _: () = assert!(STREAMS_PER_PEER_MAX * INFLIGHT_PER_STREAM_MAX <= INFLIGHT_CHUNKS_MAX);

/// A registered local buffer (an MR).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionId(pub u32);

/// A connected memory server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerId(pub u32);

/// Read `len` bytes at `remote_offset` of the peer's arena into
/// `local[local_offset..local_offset + len]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOp {
    /// The caller's tag, returned in the op's [`Completion`].
    pub wr_id: u64,
    pub remote_offset: u64,
    pub len: u64,
    pub local: RegionId,
    pub local_offset: u64,
}

/// The outcome of one posted [`ReadOp`].
#[derive(Debug)]
pub struct Completion {
    pub wr_id: u64,
    pub result: Result<(), TransportError>,
}

/// Counters for metrics; monotonic since the transport was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Payload bytes landed in local memory.
    pub bytes_read: u64,
    pub ops_completed: u64,
    /// Ops that completed with an error (a subset of `ops_completed`).
    pub ops_failed: u64,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    #[error("unknown local region {0:?}: register the buffer first (or it was deregistered)")]
    UnknownRegion(RegionId),
    #[error("unknown peer {0:?}: connect to the memory server first (or it was disconnected)")]
    UnknownPeer(PeerId),
    #[error("read op {wr_id}: local range {offset}+{len} is outside region {region:?} of {region_len} bytes")]
    OutOfBounds {
        wr_id: u64,
        region: RegionId,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error("read op {wr_id} has zero length: every op must move at least one byte")]
    EmptyRead { wr_id: u64 },
    #[error("read op {wr_id} of {len} bytes needs {chunks} chunks, more than the {max} a transport keeps in flight: use larger chunk_bytes or split the op")]
    OpTooLarge {
        wr_id: u64,
        len: u64,
        chunks: u64,
        max: u64,
    },
    #[error("too many reads in flight (bounds: {ops_max} ops, {chunks_max} chunks): poll completions and post again")]
    QueueFull { ops_max: usize, chunks_max: usize },
    #[error("cannot connect to memory server {addr}: {source} (is it running and is this its data port?)")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("handshake with memory server {addr} failed: {source}")]
    Handshake {
        addr: String,
        source: distmind_common::handshake::HandshakeError,
    },
    #[error("memory server {addr} does not serve this data path: {detail}")]
    NotOffered { addr: String, detail: String },
    #[error("lost memory server {addr}: {reason}; read from a replica or reconnect")]
    PeerLost { addr: String, reason: String },
    #[error("memory server {addr} has no committed extent covering {offset}+{len}: the catalog is stale or the model was removed")]
    RemoteOutOfRange { addr: String, offset: u64, len: u64 },
    #[error("protocol error from memory server {addr}: {detail}; the connection was dropped")]
    Protocol { addr: String, detail: String },
    #[error("region {0:?} still has reads in flight: poll their completions before deregistering")]
    Busy(RegionId),
    #[error("invalid transport option: {0}")]
    InvalidOption(String),
    #[error("the transport is shut down")]
    Closed,
}

/// One-sided reads from memory servers into registered local memory.
pub trait Transport: Send + Sync {
    fn name(&self) -> &'static str;
    /// Registers a buffer; the transport keeps the `Arc` alive until deregistered.
    fn register(&self, buf: Arc<HostBuffer>) -> Result<RegionId, TransportError>;
    /// Refused with [`TransportError::Busy`] while reads into it are in flight.
    fn deregister(&self, region: RegionId) -> Result<(), TransportError>;
    /// `peer_addr` is `"host:port"` of a memory server's data port.
    /// Idempotent per address while the peer is alive; a lost peer is replaced
    /// by a fresh connection with a new id.
    fn connect(&self, peer_addr: &str) -> Result<PeerId, TransportError>;
    /// Fails the peer's queued and in-flight ops (they still complete through
    /// `poll`) and releases its connections.
    fn disconnect(&self, peer: PeerId);
    /// Posts reads; each op completes exactly once (success or error) via
    /// [`Transport::poll`]. A batch that fails validation (unknown region or
    /// peer, local range outside the buffer, zero length, queue full) posts
    /// nothing.
    ///
    /// # Safety
    /// Until an op's completion is returned by `poll`, no one else may read or
    /// write its local range (the transport writes it from other threads), and
    /// the local ranges of ops in flight must not overlap.
    unsafe fn post_reads(&self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError>;
    /// Appends up to `max` completions to `out`, waiting up to `timeout` for
    /// the first one; returns how many were appended (0 on timeout).
    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, TransportError>;
    /// Counters for metrics.
    fn stats(&self) -> TransportStats;
}

/// Ops posted per call by [`read_blocking`].
const READ_BLOCKING_BATCH_OPS: usize = 256;

/// Posts `ops` (backing off on [`TransportError::QueueFull`]) and polls until
/// every one of them completed; returns the first error seen.
///
/// For single-user transports (benches, tests, tools): it counts completions
/// without looking at their `wr_id`, so it would take other callers' ones.
/// Even on error it returns only after every posted op completed.
///
/// # Safety
/// As for [`Transport::post_reads`], for the duration of the call.
pub unsafe fn read_blocking(
    t: &dyn Transport,
    peer: PeerId,
    ops: &[ReadOp],
) -> Result<(), TransportError> {
    let mut next = 0;
    let mut outstanding = 0usize;
    let mut batch = READ_BLOCKING_BATCH_OPS;
    let mut first_err: Option<TransportError> = None;
    let mut done = Vec::with_capacity(READ_BLOCKING_BATCH_OPS);
    while (next < ops.len() && first_err.is_none()) || outstanding > 0 {
        if next < ops.len() && first_err.is_none() {
            let end = ops.len().min(next + batch);
            // SAFETY: the caller upholds post_reads' contract for all of `ops`.
            match unsafe { t.post_reads(peer, &ops[next..end]) } {
                Ok(()) => {
                    outstanding += end - next;
                    next = end;
                    batch = READ_BLOCKING_BATCH_OPS;
                }
                Err(TransportError::QueueFull { .. }) if outstanding > 0 || batch > 1 => {
                    batch = (batch / 2).max(1);
                }
                Err(e) => first_err = Some(e),
            }
        }
        if outstanding == 0 {
            continue;
        }
        done.clear();
        t.poll(&mut done, outstanding, Duration::from_millis(100))?;
        outstanding -= done.len();
        for c in done.drain(..) {
            if let (Err(e), None) = (c.result, &first_err) {
                first_err = Some(e);
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}
