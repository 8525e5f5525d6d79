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

/// Completion queue entries of a transport: enough for every op in flight.
const CQ_ENTRIES: usize = INFLIGHT_OPS_MAX;
/// Completions read per `fi_cq_read` round in `poll`.
const POLL_BATCH: usize = 256;

struct Region {
    mr: MemoryRegion,
    in_flight: usize,
}

struct Peer {
    addr: String,
    fi_addr: PeerAddr,
    arena: RemoteArena,
}

#[derive(Clone, Copy)]
struct Pending {
    peer: PeerId,
    op: ReadOp,
}

struct State {
    regions: HashMap<u32, Region>,
    next_region: u32,
    peers: HashMap<u32, Peer>,
    by_addr: HashMap<String, PeerId>,
    next_peer: u32,
    /// Validated ops not yet accepted by the provider (it answered EAGAIN).
    queued: VecDeque<Pending>,
    /// Ops handed to `fi_read`, indexed by their context.
    posted: Vec<Option<Pending>>,
    free_slots: Vec<usize>,
    /// Ops failed without reaching the provider (disconnect), to report.
    failed: VecDeque<Completion>,
    stats: TransportStats,
}

impl State {
    fn outstanding(&self) -> usize {
        self.queued.len() + (self.posted.len() - self.free_slots.len()) + self.failed.len()
    }
}

/// The [`Transport`] over libfabric (`tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`, ...).
pub struct FabricTransport {
    domain: Domain,
    cq: CompletionQueue,
    ep: Endpoint,
    resolver: Resolver,
    state: Mutex<State>,
}

impl FabricTransport {
    /// Opens a fabric, domain, address vector, completion queue and endpoint of `provider`.
    pub fn new(provider: &str, resolver: Resolver) -> Result<Self, FabricError> {
        let info = Info::get(&Hints::new(provider))?;
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
            state: Mutex::new(State {
                regions: HashMap::new(),
                next_region: 1,
                peers: HashMap::new(),
                by_addr: HashMap::new(),
                next_peer: 1,
                queued: VecDeque::new(),
                posted: Vec::new(),
                free_slots: Vec::new(),
                failed: VecDeque::new(),
                stats: TransportStats::default(),
            }),
        })
    }

    pub fn info(&self) -> &Info {
        self.domain.info()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands queued ops to the provider until it answers EAGAIN.
    fn flush(&self, st: &mut State) {
        while let Some(p) = st.queued.front().copied() {
            let Some(peer) = st.peers.get(&p.peer.0) else {
                st.queued.pop_front();
                Self::fail_now(st, p, TransportError::UnknownPeer(p.peer));
                continue;
            };
            let slot = st.free_slots.pop().unwrap_or_else(|| {
                st.posted.push(None);
                st.posted.len() - 1
            });
            let region = st
                .regions
                .get(&p.op.local.0)
                .expect("regions with queued ops stay registered");
            // SAFETY: validated in post_reads (bounds, region of our domain);
            // the region stays registered while ops into it are outstanding
            // (deregister answers Busy), and the caller of post_reads
            // guarantees exclusive use of the local range until completion.
            let r = unsafe {
                self.ep.read(
                    &region.mr,
                    p.op.local_offset as usize,
                    p.op.len as usize,
                    peer.fi_addr,
                    peer.arena.base + p.op.remote_offset,
                    peer.arena.key,
                    slot as u64,
                )
            };
            match r {
                Ok(()) => {
                    st.queued.pop_front();
                    st.posted[slot] = Some(p);
                }
                Err(e) => {
                    st.free_slots.push(slot);
                    if e.is_again() {
                        return;
                    }
                    let addr = peer.addr.clone();
                    st.queued.pop_front();
                    Self::fail_now(
                        st,
                        p,
                        TransportError::PeerLost {
                            addr,
                            reason: e.to_string(),
                        },
                    );
                }
            }
        }
    }

    /// An op that never reached the provider: account it now, report it at the next poll.
    fn fail_now(st: &mut State, p: Pending, err: TransportError) {
        if let Some(r) = st.regions.get_mut(&p.op.local.0) {
            r.in_flight -= 1;
        }
        st.stats.ops_completed += 1;
        st.stats.ops_failed += 1;
        st.failed.push_back(Completion {
            wr_id: p.op.wr_id,
            result: Err(err),
        });
    }

    fn finish(
        st: &mut State,
        out: &mut Vec<Completion>,
        p: Pending,
        result: Result<(), TransportError>,
    ) {
        if let Some(r) = st.regions.get_mut(&p.op.local.0) {
            r.in_flight -= 1;
        }
        st.stats.ops_completed += 1;
        match &result {
            Ok(()) => st.stats.bytes_read += p.op.len,
            Err(_) => st.stats.ops_failed += 1,
        }
        out.push(Completion {
            wr_id: p.op.wr_id,
            result,
        });
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
        // Queued ops fail now; posted ones complete through the CQ.
        let (gone, keep): (VecDeque<Pending>, VecDeque<Pending>) =
            st.queued.drain(..).partition(|q| q.peer == peer);
        st.queued = keep;
        for q in gone {
            let err = TransportError::PeerLost {
                addr: p.addr.clone(),
                reason: "disconnected".into(),
            };
            Self::fail_now(&mut st, q, err);
        }
    }

    unsafe fn post_reads(&self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError> {
        let mut st = self.lock();
        let Some(p) = st.peers.get(&peer.0) else {
            return Err(TransportError::UnknownPeer(peer));
        };
        for op in ops {
            let region = st
                .regions
                .get(&op.local.0)
                .ok_or(TransportError::UnknownRegion(op.local))?;
            if op.len == 0 {
                return Err(TransportError::EmptyRead { wr_id: op.wr_id });
            }
            let region_len = region.mr.len() as u64;
            if op
                .local_offset
                .checked_add(op.len)
                .is_none_or(|end| end > region_len)
            {
                return Err(TransportError::OutOfBounds {
                    wr_id: op.wr_id,
                    region: op.local,
                    offset: op.local_offset,
                    len: op.len,
                    region_len,
                });
            }
            if op
                .remote_offset
                .checked_add(op.len)
                .is_none_or(|end| end > p.arena.len)
            {
                return Err(TransportError::RemoteOutOfRange {
                    addr: p.addr.clone(),
                    offset: op.remote_offset,
                    len: op.len,
                });
            }
        }
        if st.outstanding() + ops.len() > INFLIGHT_OPS_MAX {
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
            st.queued.push_back(Pending { peer, op: *op });
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
        let mut entries: Vec<CqEntry> = Vec::with_capacity(POLL_BATCH);
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
                    entries.clear();
                    self.cq
                        .poll(&mut entries, want)
                        .map_err(|e| TransportError::Protocol {
                            addr: "local completion queue".into(),
                            detail: e.to_string(),
                        })?;
                    for e in entries.drain(..) {
                        let slot = e.context as usize;
                        let Some(p) = st.posted.get_mut(slot).and_then(Option::take) else {
                            log::warn!("fabric completion with unknown context {slot}");
                            continue;
                        };
                        st.free_slots.push(slot);
                        let result = e.result.map_err(|fe| TransportError::PeerLost {
                            addr: st
                                .peers
                                .get(&p.peer.0)
                                .map_or_else(|| "disconnected peer".into(), |q| q.addr.clone()),
                            reason: fe.to_string(),
                        });
                        Self::finish(&mut st, out, p, result);
                    }
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
