//! [`FabricTransport`]: the [`Transport`] trait over libfabric `fi_read`
//! (client side: a GPU server reading memory servers' arenas).
//!
//! A memory server serves reads by registering its arena with
//! [`Access::RemoteRead`] on an endpoint of the same provider and polling that
//! endpoint's completion queue (manual progress). What a client needs to read
//! it, a [`RemoteArena`] (endpoint name, key, remote address of offset 0,
//! length), travels over the control connection; until the memory server
//! publishes it, the caller supplies a [`Resolver`] that maps a data address
//! (`"host:port"`) to it.
//!
//! One lock guards the state; it is taken once per `post_reads` batch and
//! once per `poll` call, never per byte. An op is one `fi_read` (no chunking:
//! ops up to the provider's maximum message size).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{
    Access, AddressVector, CompletionQueue, CqEntry, Domain, Endpoint, Fabric, FabricError, Hints,
    Info, MemoryRegion, PeerAddr,
};
use crate::{
    Completion, HostBuffer, PeerId, ReadOp, RegionId, Transport, TransportError, TransportStats,
    INFLIGHT_OPS_MAX,
};

/// What a client needs to read a memory server's arena over libfabric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteArena {
    /// The serving endpoint's [`Endpoint::name`].
    pub name: Vec<u8>,
    /// The arena registration's [`MemoryRegion::key`].
    pub key: u64,
    /// [`MemoryRegion::remote_addr`] of offset 0.
    pub base: u64,
    /// Arena bytes; reads beyond are refused before posting.
    pub len: u64,
}

impl RemoteArena {
    /// What a serving endpoint publishes for `arena` (registered with
    /// [`Access::RemoteRead`] in the endpoint's domain).
    pub fn serving(ep: &Endpoint, arena: &MemoryRegion) -> Result<RemoteArena, FabricError> {
        Ok(RemoteArena {
            name: ep.name()?,
            key: arena.key(),
            base: arena.remote_addr(0),
            len: arena.len() as u64,
        })
    }
}

/// Maps a memory server's data address to its [`RemoteArena`] (today: an
/// in-process table; later: a query over the control connection).
pub type Resolver = Box<dyn Fn(&str) -> Result<RemoteArena, TransportError> + Send + Sync>;

/// Completion queue entries of a transport: enough for every read in flight.
const CQ_ENTRIES: usize = INFLIGHT_OPS_MAX;
/// Completions read per `fi_cq_read` round in `poll`.
const POLL_BATCH: usize = 256;
/// Default size of one `fi_read`: an op is cut into reads of this size.
/// Measured on `tcp;ofi_rxm` loopback: 4 MiB reads, 8 in flight, move 1.9x
/// the bytes of 16 MiB reads, 2 in flight.
pub const CHUNK_BYTES_DEFAULT: u64 = 4 << 20;
/// Default bound on `fi_read`s handed to the provider and not completed.
pub const READS_IN_FLIGHT_DEFAULT: usize = 64;

/// How a [`FabricTransport`] cuts and paces reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FabricOptions {
    /// Bytes per `fi_read` (capped at the provider's `max_msg_size`).
    pub chunk_bytes: u64,
    /// `fi_read`s posted and not completed, at most; the rest wait in order.
    pub reads_in_flight_max: usize,
}

impl Default for FabricOptions {
    fn default() -> Self {
        FabricOptions {
            chunk_bytes: CHUNK_BYTES_DEFAULT,
            reads_in_flight_max: READS_IN_FLIGHT_DEFAULT,
        }
    }
}

struct Region {
    mr: MemoryRegion,
    in_flight: usize,
}

struct Peer {
    addr: String,
    fi_addr: PeerAddr,
    arena: RemoteArena,
}

/// A caller's op, until its last chunk completed.
struct Op {
    op: ReadOp,
    chunks_left: u64,
    /// The first chunk error; the op fails with it.
    error: Option<TransportError>,
}

/// One `fi_read` of an op (slot `op` in `State::ops`).
#[derive(Clone, Copy)]
struct Chunk {
    op: usize,
    peer: PeerId,
    /// Offset within the op.
    at: u64,
    len: u64,
}

struct State {
    regions: HashMap<u32, Region>,
    next_region: u32,
    peers: HashMap<u32, Peer>,
    by_addr: HashMap<String, PeerId>,
    next_peer: u32,
    /// Ops with chunks outstanding, by slot.
    ops: Vec<Option<Op>>,
    free_ops: Vec<usize>,
    live_ops: usize,
    /// Chunks not yet handed to the provider (bounded in flight, or EAGAIN).
    queued: VecDeque<Chunk>,
    /// Chunks handed to `fi_read`, indexed by their context.
    posted: Vec<Option<Chunk>>,
    free_posted: Vec<usize>,
    /// Ops finished without a completion to read (failed before posting).
    failed: VecDeque<Completion>,
    /// Reused by every `poll` (no allocation per call).
    entries: Vec<CqEntry>,
    stats: TransportStats,
}

impl State {
    fn outstanding_ops(&self) -> usize {
        self.live_ops + self.failed.len()
    }

    fn posted_now(&self) -> usize {
        self.posted.len() - self.free_posted.len()
    }

    /// One chunk of op `slot` ended with `result`; finishes the op after its
    /// last chunk (into `out`, or into `failed` when `out` is `None`).
    fn chunk_done(
        &mut self,
        slot: usize,
        result: Result<(), TransportError>,
        out: Option<&mut Vec<Completion>>,
    ) {
        let o = self.ops[slot].as_mut().expect("a chunk's op is live");
        if let Err(e) = result {
            o.error.get_or_insert(e);
        }
        o.chunks_left -= 1;
        if o.chunks_left > 0 {
            return;
        }
        let o = self.ops[slot].take().expect("live");
        self.free_ops.push(slot);
        self.live_ops -= 1;
        if let Some(r) = self.regions.get_mut(&o.op.local.0) {
            r.in_flight -= 1;
        }
        self.stats.ops_completed += 1;
        let result = match o.error {
            None => {
                self.stats.bytes_read += o.op.len;
                Ok(())
            }
            Some(e) => {
                self.stats.ops_failed += 1;
                Err(e)
            }
        };
        let c = Completion {
            wr_id: o.op.wr_id,
            result,
        };
        match out {
            Some(out) => out.push(c),
            None => self.failed.push_back(c),
        }
    }
}

/// The [`Transport`] over libfabric (`tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`, ...).
///
/// An op is cut into `chunk_bytes` reads; at most `reads_in_flight_max` of
/// them are with the provider at once, the rest wait in posting order (so a
/// batch's first op lands first). An op completes when its last read did,
/// with the first error any of them saw.
pub struct FabricTransport {
    domain: Domain,
    cq: CompletionQueue,
    ep: Endpoint,
    resolver: Resolver,
    chunk_bytes: u64,
    reads_in_flight_max: usize,
    state: Mutex<State>,
}

impl FabricTransport {
    /// Opens a fabric, domain, address vector, completion queue and endpoint
    /// of `provider`, with [`FabricOptions::default`].
    pub fn new(provider: &str, resolver: Resolver) -> Result<Self, FabricError> {
        Self::with_options(provider, resolver, FabricOptions::default())
    }

    pub fn with_options(
        provider: &str,
        resolver: Resolver,
        options: FabricOptions,
    ) -> Result<Self, FabricError> {
        if options.chunk_bytes == 0 || options.reads_in_flight_max == 0 {
            return Err(FabricError {
                call: "FabricTransport::with_options",
                code: 0,
                message: format!(
                    "chunk_bytes ({}) and reads_in_flight_max ({}) must be positive",
                    options.chunk_bytes, options.reads_in_flight_max
                ),
            });
        }
        let info = Info::get(&Hints::new(provider))?;
        let max_msg = info.max_msg_size() as u64;
        let chunk_bytes = if max_msg > 0 {
            options.chunk_bytes.min(max_msg)
        } else {
            options.chunk_bytes
        };
        let fabric = Fabric::open(&info)?;
        let domain = Domain::open(&fabric)?;
        let av = AddressVector::open(&domain)?;
        let cq = CompletionQueue::open(&domain, CQ_ENTRIES)?;
        let ep = Endpoint::open(&domain, &av, &cq)?;
        Ok(FabricTransport {
            domain,
            cq,
            ep,
            resolver,
            chunk_bytes,
            reads_in_flight_max: options.reads_in_flight_max.min(CQ_ENTRIES),
            state: Mutex::new(State {
                regions: HashMap::new(),
                next_region: 1,
                peers: HashMap::new(),
                by_addr: HashMap::new(),
                next_peer: 1,
                ops: Vec::new(),
                free_ops: Vec::new(),
                live_ops: 0,
                queued: VecDeque::new(),
                posted: Vec::new(),
                free_posted: Vec::new(),
                failed: VecDeque::new(),
                entries: Vec::with_capacity(POLL_BATCH),
                stats: TransportStats::default(),
            }),
        })
    }

    pub fn info(&self) -> &Info {
        self.domain.info()
    }

    /// Bytes per `fi_read` in effect.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands queued chunks to the provider while fewer than
    /// `reads_in_flight_max` are posted and it does not answer EAGAIN.
    fn flush(&self, st: &mut State) {
        while st.posted_now() < self.reads_in_flight_max {
            let Some(c) = st.queued.front().copied() else {
                return;
            };
            let Some(peer) = st.peers.get(&c.peer.0) else {
                st.queued.pop_front();
                st.chunk_done(c.op, Err(TransportError::UnknownPeer(c.peer)), None);
                continue;
            };
            let op = st.ops[c.op]
                .as_ref()
                .expect("a queued chunk's op is live")
                .op;
            let slot = st.free_posted.pop().unwrap_or_else(|| {
                st.posted.push(None);
                st.posted.len() - 1
            });
            let region = st
                .regions
                .get(&op.local.0)
                .expect("regions with queued ops stay registered");
            // SAFETY: validated in post_reads (bounds, region of our domain);
            // the region stays registered while ops into it are outstanding
            // (deregister answers Busy), and the caller of post_reads
            // guarantees exclusive use of the local range until completion.
            let r = unsafe {
                self.ep.read(
                    &region.mr,
                    (op.local_offset + c.at) as usize,
                    c.len as usize,
                    peer.fi_addr,
                    peer.arena.base + op.remote_offset + c.at,
                    peer.arena.key,
                    slot as u64,
                )
            };
            match r {
                Ok(()) => {
                    st.queued.pop_front();
                    st.posted[slot] = Some(c);
                }
                Err(e) => {
                    st.free_posted.push(slot);
                    if e.is_again() {
                        return;
                    }
                    let addr = peer.addr.clone();
                    st.queued.pop_front();
                    let err = TransportError::PeerLost {
                        addr,
                        reason: e.to_string(),
                    };
                    st.chunk_done(c.op, Err(err), None);
                }
            }
        }
    }
}

impl Transport for FabricTransport {
    fn name(&self) -> &'static str {
        "fabric"
    }

    fn register(&self, buf: Arc<HostBuffer>) -> Result<RegionId, TransportError> {
        let mut st = self.lock();
        let id = st.next_region;
        let mr = MemoryRegion::register(&self.domain, buf, Access::LocalReadTarget, u64::from(id))
            .map_err(|e| TransportError::InvalidOption(e.to_string()))?;
        st.next_region += 1;
        st.regions.insert(id, Region { mr, in_flight: 0 });
        Ok(RegionId(id))
    }

    fn deregister(&self, region: RegionId) -> Result<(), TransportError> {
        let mut st = self.lock();
        match st.regions.get(&region.0) {
            None => Err(TransportError::UnknownRegion(region)),
            Some(r) if r.in_flight > 0 => Err(TransportError::Busy(region)),
            Some(_) => {
                st.regions.remove(&region.0);
                Ok(())
            }
        }
    }

    fn connect(&self, peer_addr: &str) -> Result<PeerId, TransportError> {
        if let Some(id) = self.lock().by_addr.get(peer_addr) {
            return Ok(*id);
        }
        let arena = (self.resolver)(peer_addr)?;
        let fi_addr = self
            .ep
            .insert_peer(&arena.name)
            .map_err(|e| TransportError::Connect {
                addr: peer_addr.to_string(),
                source: std::io::Error::other(e),
            })?;
        let mut st = self.lock();
        if let Some(id) = st.by_addr.get(peer_addr) {
            return Ok(*id);
        }
        let id = PeerId(st.next_peer);
        st.next_peer += 1;
        st.peers.insert(
            id.0,
            Peer {
                addr: peer_addr.to_string(),
                fi_addr,
                arena,
            },
        );
        st.by_addr.insert(peer_addr.to_string(), id);
        Ok(id)
    }

    fn disconnect(&self, peer: PeerId) {
        let mut st = self.lock();
        let Some(p) = st.peers.remove(&peer.0) else {
            return;
        };
        st.by_addr.remove(&p.addr);
        // Queued chunks fail now; posted ones complete through the CQ.
        let (gone, keep): (VecDeque<Chunk>, VecDeque<Chunk>) =
            st.queued.drain(..).partition(|c| c.peer == peer);
        st.queued = keep;
        for c in gone {
            let err = TransportError::PeerLost {
                addr: p.addr.clone(),
                reason: "disconnected".into(),
            };
            st.chunk_done(c.op, Err(err), None);
        }
    }

    unsafe fn post_reads(&self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError> {
        let mut st = self.lock();
        let Some(p) = st.peers.get(&peer.0) else {
            return Err(TransportError::UnknownPeer(peer));
        };
        let mut chunks = 0u64;
        for op in ops {
            let region = st
                .regions
                .get(&op.local.0)
                .ok_or(TransportError::UnknownRegion(op.local))?;
            chunks += crate::completion::check_op(
                op,
                region.mr.len() as u64,
                Some((&p.addr, p.arena.len)),
                self.chunk_bytes,
            )?;
        }
        if st.outstanding_ops() + ops.len() > INFLIGHT_OPS_MAX
            || st.queued.len() + st.posted_now() + chunks as usize > crate::INFLIGHT_CHUNKS_MAX
        {
            return Err(TransportError::QueueFull {
                ops_max: INFLIGHT_OPS_MAX,
                chunks_max: crate::INFLIGHT_CHUNKS_MAX,
            });
        }
        for op in ops {
            st.regions
                .get_mut(&op.local.0)
                .expect("validated")
                .in_flight += 1;
            let n = crate::chunk_count(op.len, self.chunk_bytes);
            let entry = Op {
                op: *op,
                chunks_left: n,
                error: None,
            };
            let slot = match st.free_ops.pop() {
                Some(i) => {
                    st.ops[i] = Some(entry);
                    i
                }
                None => {
                    st.ops.push(Some(entry));
                    st.ops.len() - 1
                }
            };
            st.live_ops += 1;
            for (at, len) in crate::Chunks::new(op.len, self.chunk_bytes) {
                st.queued.push_back(Chunk {
                    op: slot,
                    peer,
                    at,
                    len,
                });
            }
        }
        self.flush(&mut st);
        Ok(())
    }

    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, TransportError> {
        let deadline = Instant::now() + timeout;
        let start = out.len();
        loop {
            {
                let mut st = self.lock();
                while out.len() - start < max {
                    match st.failed.pop_front() {
                        Some(c) => out.push(c),
                        None => break,
                    }
                }
                self.flush(&mut st);
                let want = (max - (out.len() - start)).min(POLL_BATCH);
                if want > 0 {
                    let mut entries = std::mem::take(&mut st.entries);
                    entries.clear();
                    let polled = self.cq.poll(&mut entries, want);
                    if let Err(e) = polled {
                        st.entries = entries;
                        return Err(TransportError::Protocol {
                            addr: "local completion queue".into(),
                            detail: e.to_string(),
                        });
                    }
                    for e in entries.drain(..) {
                        let slot = e.context as usize;
                        let Some(c) = st.posted.get_mut(slot).and_then(Option::take) else {
                            log::warn!("fabric completion with unknown context {slot}");
                            continue;
                        };
                        st.free_posted.push(slot);
                        let result = e.result.map_err(|fe| TransportError::PeerLost {
                            addr: st
                                .peers
                                .get(&c.peer.0)
                                .map_or_else(|| "disconnected peer".into(), |q| q.addr.clone()),
                            reason: fe.to_string(),
                        });
                        st.chunk_done(c.op, result, Some(out));
                    }
                    st.entries = entries;
                    // Room freed: hand the provider the next chunks now.
                    self.flush(&mut st);
                }
            }
            let got = out.len() - start;
            if got > 0 || max == 0 || Instant::now() >= deadline {
                return Ok(got);
            }
            std::thread::yield_now();
        }
    }

    fn stats(&self) -> TransportStats {
        self.lock().stats
    }
}
