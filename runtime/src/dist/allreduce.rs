//! Ring all-reduce (average) and broadcast among an ordered group of
//! workers, gloo-style, over TCP.
//!
//! A group's members sorted by id form a ring: each member dials the next
//! one's listener and takes the connection the previous one dialled. An
//! all-reduce of `n` members cuts the buffer into `n` chunks (chunk `c` is
//! elements `c*len/n .. (c+1)*len/n`, so lengths not divisible by `n`, and
//! `n > len`, give chunks that differ by one element or are empty) and runs
//!
//! * reduce-scatter, `n-1` steps: at step `s` member `r` sends chunk
//!   `r-s` and adds the chunk `r-s-1` it receives to its own (received +
//!   local). Chunk `c` is summed in ring order starting at member `c`:
//!   `((x_c + x_{c+1}) + x_{c+2}) + ... + x_{c-1}`, once, by member `c-1`,
//!   which then divides it by `n`;
//! * all-gather, `n-1` steps: the means travel round the ring and are
//!   copied, never recomputed, so every member ends with the same bits.
//!
//! Every step's chunk goes in frames of at most
//! [`RING_SEGMENT_ELEMENTS`](super::limits::RING_SEGMENT_ELEMENTS);
//! a sender thread (one per operation, scoped) writes them while the
//! caller's thread reads and reduces, so no member waits on its own write
//! and the ring cannot deadlock on full socket buffers.
//!
//! ```text
//! ring frame header (40 bytes, little-endian)
//!   0..4    tag: "DMRS" start, "DMRA" ack, "DMRD" data, "DMRB" bye
//!   4..6    op u16: 1 all-reduce mean, 2 broadcast
//!   6..8    reserved u16, 0
//!   8..16   seq u64: operations done on this connection before this one
//!   16..40  start: elements u64, group fingerprint u64, root u64
//!           ack, bye: 0, 0, 0
//!           data:  step u64, first element u64, elements u64; then the f32s
//! ```
//!
//! Connections are cached per group (the sorted member ids), as SD-Pipe
//! caches a communicator per member tuple, in a least-recently-used cache of
//! at most [`RING_CACHE_MAX`] rings. Members evict independently, so a
//! member that evicts a ring sends a bye on both edges before closing them,
//! and every operation opens with a start/ack exchange on each edge: a
//! member that finds a cached edge retired (a bye, or a reset where the
//! close met a start it had written) moves to the connection the neighbour
//! dials for the group next time. The start frame also checks that all
//! members run the same operation on the same length.
//!
//! A member that dies closes its sockets; its neighbours fail, close theirs,
//! and the failure goes round the ring, so every member returns an error
//! naming a lost member. A member that hangs is caught by `io_timeout`, one
//! that never joins by `setup_timeout`.

use std::fmt;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::handshake::ClusterKey;
use distmind_transport::TokenBucket;

mod frame;
mod phase;

pub use frame::RING_FRAME_HEADER_BYTES;
pub use phase::chunk_range;

use frame::{fingerprint, read_header, EdgeError, FrameHeader, ACK_TAG, BYE_TAG, START_TAG};
use phase::{all_reduce_steps, broadcast_steps, PhaseError, Pipe};

use super::limits::{
    COLLECTIVE_ELEMENTS_MAX, GROUP_MEMBERS_MAX, RING_CACHE_MAX, RING_SEGMENTS_IN_FLIGHT,
};
use super::listener::{dial, ConnSlot, DialError, DistListener, Hello, Pending, PendingKey};

/// One member of a group: its worker id and its listener's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RingMember {
    pub id: u32,
    pub addr: SocketAddr,
}

/// A failure injected on purpose, to test how the others cope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InjectedFault {
    /// Drop every socket of the ring, as a dying process would, after
    /// handing this many data frames to the sender (0: before any).
    DieAfterSegments(u64),
}

#[derive(Debug, Clone)]
pub struct CollectiveOptions {
    pub key: ClusterKey,
    /// Bounds dialling a member, and waiting for a member to dial us or to
    /// replace a connection it closed.
    pub setup_timeout: Duration,
    /// Bounds one socket read or write: a member that stops is lost.
    pub io_timeout: Duration,
    /// Rings kept open, at most [`RING_CACHE_MAX`].
    pub cache_max: usize,
    /// Paces this member's sends, to emulate a slower network.
    pub rate_limit_bytes_per_s: Option<u64>,
    pub fault: Option<InjectedFault>,
}

impl CollectiveOptions {
    pub fn new(key: ClusterKey) -> Self {
        CollectiveOptions {
            key,
            setup_timeout: Duration::from_secs(30),
            io_timeout: Duration::from_secs(60),
            cache_max: RING_CACHE_MAX,
            rate_limit_bytes_per_s: None,
            fault: None,
        }
    }

    fn validate(&self) -> Result<(), String> {
        if self.cache_max == 0 || self.cache_max > RING_CACHE_MAX {
            return Err(format!(
                "cache_max {} outside 1..={RING_CACHE_MAX} (RING_CACHE_MAX)",
                self.cache_max
            ));
        }
        if self.setup_timeout.is_zero() || self.io_timeout.is_zero() {
            return Err("setup_timeout and io_timeout must be positive".into());
        }
        if self.rate_limit_bytes_per_s == Some(0) {
            return Err("rate_limit_bytes_per_s = 0: use None for no limit".into());
        }
        Ok(())
    }
}

/// A group as errors show it: its member ids in ring order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group(pub Vec<u32>);

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "group {:?}", self.0)
    }
}

/// What went wrong in a collective; every variant names the group and,
/// where one is to blame, the member and its address.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    #[error("invalid collective: {0}")]
    Invalid(String),
    #[error("job {job} {group}: cannot dial member {member} at {addr}: {source}")]
    Dial {
        job: u64,
        group: Group,
        member: u32,
        addr: SocketAddr,
        #[source]
        source: DialError,
    },
    #[error("job {job} {group}: member {member} at {addr} did not connect to this worker within {waited:?} (is it alive, and was it given the same group?)")]
    NeverConnected {
        job: u64,
        group: Group,
        member: u32,
        addr: SocketAddr,
        waited: Duration,
    },
    #[error("job {job} {group}: lost member {member} at {addr} while {what}: {detail}")]
    MemberLost {
        job: u64,
        group: Group,
        member: u32,
        addr: SocketAddr,
        what: &'static str,
        detail: String,
    },
    #[error("job {job} {group}: member {member} at {addr} sent nothing for {waited:?} while {what} (is it stuck or gone?)")]
    Timeout {
        job: u64,
        group: Group,
        member: u32,
        addr: SocketAddr,
        what: &'static str,
        waited: Duration,
    },
    #[error("job {job} {group}: member {member} at {addr} runs a different operation: {detail}")]
    Mismatch {
        job: u64,
        group: Group,
        member: u32,
        addr: SocketAddr,
        detail: String,
    },
    #[error("job {job} {group}: protocol violation by member {member} at {addr}: {detail}")]
    Protocol {
        job: u64,
        group: Group,
        member: u32,
        addr: SocketAddr,
        detail: String,
    },
    #[error("job {job} {group}: injected fault {fault:?}: this member dropped its sockets")]
    Injected {
        job: u64,
        group: Group,
        fault: InjectedFault,
    },
}

/// Counters of a collective since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectiveStats {
    /// All-reduces and broadcasts called, including single-member ones.
    pub ops: u64,
    /// Rings opened (new connections to both neighbours).
    pub rings_built: u64,
    /// Operations that ran on a cached ring.
    pub ring_reuses: u64,
    /// Connections this member dialled.
    pub connections_dialled: u64,
    /// Connections this member took from its listener.
    pub connections_taken: u64,
    /// Cached edges found closed by the neighbour and replaced.
    pub edges_replaced: u64,
    /// Rings dropped to keep the cache within `cache_max`.
    pub evictions: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
enum Op {
    AllReduceMean = 1,
    Broadcast = 2,
}

/// What every member must agree on before any data moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Start {
    op: Op,
    elements: u64,
    fingerprint: u64,
    root: u64,
}

struct Conn {
    stream: TcpStream,
    member: RingMember,
    /// Operations completed on this connection (both ends count alike).
    seq: u64,
    _slot: Option<ConnSlot>,
}

struct Ring {
    ids: Vec<u32>,
    members: Vec<RingMember>,
    rank: usize,
    next: Conn,
    prev: Conn,
    last_used: u64,
}

impl Ring {
    /// Closes both edges, so the neighbours see the end at once: this
    /// member failed.
    fn poison(&self) {
        let _ = self.next.stream.shutdown(Shutdown::Both);
        let _ = self.prev.stream.shutdown(Shutdown::Both);
    }

    /// Closes both edges after a bye: the ring is gone, not the member,
    /// and the neighbours that still cache it move to the connections this
    /// member dials for the group next time.
    fn retire(&self) {
        for conn in [&self.next, &self.prev] {
            let bye = FrameHeader {
                tag: BYE_TAG,
                op: 0,
                seq: conn.seq,
                a: 0,
                b: 0,
                c: 0,
            };
            let _ = (&conn.stream).write_all(&bye.encode());
        }
        self.poison();
    }
}

/// A worker's collectives: all-reduce and broadcast over rings of workers,
/// the rings cached per group.
pub struct Collective {
    listener: Arc<DistListener>,
    opts: CollectiveOptions,
    bucket: Option<TokenBucket>,
    rings: Vec<Ring>,
    tick: u64,
    stats: CollectiveStats,
    /// Encoded data frames, reused (at most RING_SEGMENTS_IN_FLIGHT).
    pool: Vec<Vec<u8>>,
    recv_scratch: Vec<u8>,
}

impl fmt::Debug for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Collective")
            .field("listener", &self.listener)
            .field("rings", &self.cached_groups())
            .field("stats", &self.stats)
            .finish()
    }
}

impl Collective {
    /// A collective for the worker `listener` belongs to (its id and job).
    pub fn new(
        listener: Arc<DistListener>,
        opts: CollectiveOptions,
    ) -> Result<Self, CollectiveError> {
        opts.validate().map_err(CollectiveError::Invalid)?;
        Ok(Collective {
            listener,
            bucket: opts.rate_limit_bytes_per_s.map(TokenBucket::new),
            opts,
            rings: Vec::with_capacity(RING_CACHE_MAX),
            tick: 0,
            stats: CollectiveStats::default(),
            pool: Vec::with_capacity(RING_SEGMENTS_IN_FLIGHT),
            recv_scratch: Vec::new(),
        })
    }

    pub fn stats(&self) -> CollectiveStats {
        self.stats
    }

    /// The groups whose rings are open, most recently used last.
    pub fn cached_groups(&self) -> Vec<Vec<u32>> {
        let mut r: Vec<_> = self
            .rings
            .iter()
            .map(|r| (r.last_used, r.ids.clone()))
            .collect();
        r.sort();
        r.into_iter().map(|(_, ids)| ids).collect()
    }

    fn me(&self) -> u32 {
        self.listener.identity().worker
    }

    fn job(&self) -> u64 {
        self.listener.identity().job
    }

    /// Replaces every element of `buf` by its mean over the group; every
    /// member ends with the same bits. All members call it with the same
    /// members and the same length.
    pub fn all_reduce_mean(
        &mut self,
        members: &[RingMember],
        buf: &mut [f32],
    ) -> Result<(), CollectiveError> {
        let members = self.check(members, buf.len())?;
        self.stats.ops += 1;
        if members.len() == 1 {
            return Ok(());
        }
        let start = Start {
            op: Op::AllReduceMean,
            elements: buf.len() as u64,
            fingerprint: fingerprint(&ids(&members)),
            root: 0,
        };
        self.run(&members, start, buf)
    }

    /// Copies member `root`'s `buf` into every member's.
    pub fn broadcast(
        &mut self,
        members: &[RingMember],
        root: u32,
        buf: &mut [f32],
    ) -> Result<(), CollectiveError> {
        let members = self.check(members, buf.len())?;
        if !members.iter().any(|m| m.id == root) {
            return Err(CollectiveError::Invalid(format!(
                "broadcast root {root} is not a member of {}",
                Group(ids(&members))
            )));
        }
        self.stats.ops += 1;
        if members.len() == 1 {
            return Ok(());
        }
        let start = Start {
            op: Op::Broadcast,
            elements: buf.len() as u64,
            fingerprint: fingerprint(&ids(&members)),
            root: root.into(),
        };
        self.run(&members, start, buf)
    }

    /// The members sorted by id, checked.
    fn check(
        &self,
        members: &[RingMember],
        len: usize,
    ) -> Result<Vec<RingMember>, CollectiveError> {
        let bad = |s: String| Err(CollectiveError::Invalid(s));
        if members.is_empty() || members.len() > GROUP_MEMBERS_MAX {
            return bad(format!(
                "{} members; a group has 1 to {GROUP_MEMBERS_MAX} (GROUP_MEMBERS_MAX)",
                members.len()
            ));
        }
        if len as u64 > COLLECTIVE_ELEMENTS_MAX {
            return bad(format!(
                "{len} elements, above COLLECTIVE_ELEMENTS_MAX = {COLLECTIVE_ELEMENTS_MAX}"
            ));
        }
        let mut sorted = members.to_vec();
        sorted.sort();
        if sorted.windows(2).any(|w| w[0].id == w[1].id) {
            return bad(format!("member ids repeat in {:?}", ids(&sorted)));
        }
        let me = self.me();
        if !sorted.iter().any(|m| m.id == me) {
            return bad(format!(
                "this worker (member {me}) is not in {}",
                Group(ids(&sorted))
            ));
        }
        Ok(sorted)
    }

    fn run(
        &mut self,
        members: &[RingMember],
        start: Start,
        buf: &mut [f32],
    ) -> Result<(), CollectiveError> {
        let mut ring = self.checkout(members)?;
        let result = self
            .open_op(&mut ring, &start)
            .and_then(|()| self.data_phase(&mut ring, &start, buf));
        match result {
            Ok(()) => {
                ring.next.seq += 1;
                ring.prev.seq += 1;
                self.tick += 1;
                ring.last_used = self.tick;
                self.rings.push(ring);
                Ok(())
            }
            Err(e) => {
                ring.poison();
                Err(e)
            }
        }
    }

    /// The group's cached ring, or a new one (evicting the least recently
    /// used ring to stay within `cache_max`).
    fn checkout(&mut self, members: &[RingMember]) -> Result<Ring, CollectiveError> {
        let ids = ids(members);
        if let Some(i) = self.rings.iter().position(|r| r.ids == ids) {
            let ring = self.rings.swap_remove(i);
            if ring.members == members {
                self.stats.ring_reuses += 1;
                return Ok(ring);
            }
            // Same ids, new addresses: a member restarted elsewhere.
            ring.retire();
        }
        while self.rings.len() >= self.opts.cache_max {
            let lru = (0..self.rings.len())
                .min_by_key(|&i| self.rings[i].last_used)
                .expect("non-empty");
            self.rings.swap_remove(lru).retire();
            self.stats.evictions += 1;
        }
        self.build(members.to_vec(), ids)
    }

    fn build(&mut self, members: Vec<RingMember>, ids: Vec<u32>) -> Result<Ring, CollectiveError> {
        let n = members.len();
        let rank = members
            .iter()
            .position(|m| m.id == self.me())
            .expect("checked");
        let deadline = Instant::now() + self.opts.setup_timeout;
        let next = self.dial(&ids, members[(rank + 1) % n])?;
        let prev = self.take(&ids, members[(rank + n - 1) % n], deadline)?;
        self.stats.rings_built += 1;
        Ok(Ring {
            ids,
            members,
            rank,
            next,
            prev,
            last_used: 0,
        })
    }

    fn adopt(
        &self,
        stream: TcpStream,
        member: RingMember,
        slot: Option<ConnSlot>,
    ) -> io::Result<Conn> {
        stream.set_read_timeout(Some(self.opts.io_timeout))?;
        stream.set_write_timeout(Some(self.opts.io_timeout))?;
        Ok(Conn {
            stream,
            member,
            seq: 0,
            _slot: slot,
        })
    }

    fn dial(&mut self, ids: &[u32], to: RingMember) -> Result<Conn, CollectiveError> {
        let hello = Hello::Ring {
            job: self.job(),
            group: ids.to_vec(),
            from: self.me(),
            to: to.id,
        };
        let err = |source| CollectiveError::Dial {
            job: self.job(),
            group: Group(ids.to_vec()),
            member: to.id,
            addr: to.addr,
            source,
        };
        let s = dial(to.addr, &self.opts.key, &hello, self.opts.setup_timeout).map_err(err)?;
        let conn = self
            .adopt(s, to, None)
            .map_err(|e| err(DialError::Connect(e)))?;
        self.stats.connections_dialled += 1;
        Ok(conn)
    }

    fn take(
        &mut self,
        ids: &[u32],
        from: RingMember,
        deadline: Instant,
    ) -> Result<Conn, CollectiveError> {
        let key = PendingKey::Ring {
            group: ids.to_vec(),
            from: from.id,
        };
        let never = || CollectiveError::NeverConnected {
            job: self.job(),
            group: Group(ids.to_vec()),
            member: from.id,
            addr: from.addr,
            waited: self.opts.setup_timeout,
        };
        let Pending { stream, slot, .. } = self.listener.take(&key, deadline).ok_or_else(never)?;
        let conn = self
            .adopt(stream, from, Some(slot))
            .map_err(|e| self.edge_error(ids, from, "taking its connection", e.into()))?;
        self.stats.connections_taken += 1;
        Ok(conn)
    }

    fn edge_error(
        &self,
        ids: &[u32],
        m: RingMember,
        what: &'static str,
        e: EdgeError,
    ) -> CollectiveError {
        let (job, group, member, addr) = (self.job(), Group(ids.to_vec()), m.id, m.addr);
        match e {
            EdgeError::Closed { detail, .. } => CollectiveError::MemberLost {
                job,
                group,
                member,
                addr,
                what,
                detail: format!("connection closed ({detail})"),
            },
            EdgeError::Io(e) => CollectiveError::MemberLost {
                job,
                group,
                member,
                addr,
                what,
                detail: e.to_string(),
            },
            EdgeError::TimedOut => CollectiveError::Timeout {
                job,
                group,
                member,
                addr,
                what,
                waited: self.opts.io_timeout,
            },
            EdgeError::Protocol(detail) => CollectiveError::Protocol {
                job,
                group,
                member,
                addr,
                detail: format!("{detail} (while {what})"),
            },
        }
    }

    /// The start/ack exchange on both edges. A cached edge that the
    /// neighbour retired (it evicted the group: a bye, or a reset where its
    /// close met a start we had written) is replaced by the connection it
    /// dials again, within `setup_timeout`; a cached edge that simply ended
    /// is a lost member, at once.
    fn open_op(&mut self, ring: &mut Ring, start: &Start) -> Result<(), CollectiveError> {
        let deadline = Instant::now() + self.opts.setup_timeout;
        let start_frame = |seq| FrameHeader {
            tag: START_TAG,
            op: start.op as u16,
            seq,
            a: start.elements,
            b: start.fingerprint,
            c: start.root,
        };
        let ack_frame = |seq| FrameHeader {
            tag: ACK_TAG,
            op: start.op as u16,
            seq,
            a: 0,
            b: 0,
            c: 0,
        };
        let ids = ring.ids.clone();
        let (next_m, prev_m) = (ring.next.member, ring.prev.member);
        // A redialled edge has seq 0: it is not cached, so it is never
        // redialled again in this operation.
        let redial = |this: &mut Self, ring: &mut Ring| -> Result<(), CollectiveError> {
            ring.next = this.dial(&ids, next_m)?;
            this.stats.edges_replaced += 1;
            (&ring.next.stream)
                .write_all(&start_frame(0).encode())
                .map_err(|e| this.edge_error(&ids, next_m, "sending the start", e.into()))
        };

        // Start to next. A retired edge may still take the write; the ack
        // below finds out.
        if let Err(e) = (&ring.next.stream).write_all(&start_frame(ring.next.seq).encode()) {
            match EdgeError::from(e) {
                EdgeError::Closed { .. } if ring.next.seq > 0 => redial(self, ring)?,
                e => return Err(self.edge_error(&ids, next_m, "sending the start", e)),
            }
        }

        // Start from prev.
        loop {
            let cached = ring.prev.seq > 0;
            let why = match read_header(&mut ring.prev.stream) {
                Ok(h) if h.tag == BYE_TAG => "it retired the ring".to_owned(),
                Ok(h) => {
                    h.expect(&start_frame(ring.prev.seq)).map_err(|detail| {
                        CollectiveError::Mismatch {
                            job: self.job(),
                            group: Group(ids.clone()),
                            member: prev_m.id,
                            addr: prev_m.addr,
                            detail,
                        }
                    })?;
                    break;
                }
                // A fresh edge that ended may be one a failed attempt left
                // in the listener; the member's new one replaces it.
                Err(EdgeError::Closed { reset, detail }) if reset || !cached => detail,
                Err(e) => return Err(self.edge_error(&ids, prev_m, "waiting for the start", e)),
            };
            let key = PendingKey::Ring {
                group: ids.clone(),
                from: prev_m.id,
            };
            let Some(p) = self.listener.take(&key, deadline) else {
                return Err(CollectiveError::MemberLost {
                    job: self.job(),
                    group: Group(ids.clone()),
                    member: prev_m.id,
                    addr: prev_m.addr,
                    what: "waiting for the start",
                    detail: format!(
                        "its edge closed ({why}) and no new one came within {:?}",
                        self.opts.setup_timeout
                    ),
                });
            };
            ring.prev = self
                .adopt(p.stream, prev_m, Some(p.slot))
                .map_err(|e| self.edge_error(&ids, prev_m, "taking its connection", e.into()))?;
            self.stats.connections_taken += 1;
            self.stats.edges_replaced += 1;
        }
        (&ring.prev.stream)
            .write_all(&ack_frame(ring.prev.seq).encode())
            .map_err(|e| self.edge_error(&ids, prev_m, "sending the ack", e.into()))?;

        // Ack from next.
        loop {
            let cached = ring.next.seq > 0;
            match read_header(&mut ring.next.stream) {
                Ok(h) if h.tag == BYE_TAG && cached => redial(self, ring)?,
                Ok(h) => {
                    return h.expect(&ack_frame(ring.next.seq)).map_err(|d| {
                        self.edge_error(&ids, next_m, "waiting for the ack", EdgeError::Protocol(d))
                    })
                }
                Err(EdgeError::Closed { reset: true, .. }) if cached => redial(self, ring)?,
                Err(e) => return Err(self.edge_error(&ids, next_m, "waiting for the ack", e)),
            }
        }
    }

    fn data_phase(
        &mut self,
        ring: &mut Ring,
        start: &Start,
        buf: &mut [f32],
    ) -> Result<(), CollectiveError> {
        let (n, r) = (ring.members.len(), ring.rank);
        let len = buf.len();
        let mut pool = std::mem::take(&mut self.pool);
        // Each frame grows to at most RING_FRAME_HEADER_BYTES +
        // 4 * RING_SEGMENT_ELEMENTS, and is kept for the next operation.
        pool.resize_with(RING_SEGMENTS_IN_FLIGHT, Vec::new);
        let (to_writer, writer_rx) =
            crossbeam::channel::bounded::<Vec<u8>>(RING_SEGMENTS_IN_FLIGHT);
        let (writer_tx, from_writer) = crossbeam::channel::bounded(RING_SEGMENTS_IN_FLIGHT);
        let next_stream = &ring.next.stream;
        let prev_stream = &mut ring.prev.stream;
        let bucket = self.bucket.as_ref();
        let mut recv_scratch = std::mem::take(&mut self.recv_scratch);
        let (result, pool) = std::thread::scope(|scope| {
            let writer = scope.spawn(move || {
                let mut w = next_stream;
                for b in writer_rx.iter() {
                    if let Some(bucket) = bucket {
                        bucket.acquire(b.len() as u64);
                    }
                    let r = w.write_all(&b).map(|()| b);
                    let failed = r.is_err();
                    if writer_tx.send(r).is_err() || failed {
                        return;
                    }
                }
            });
            let mut pipe = Pipe {
                to_writer: Some(to_writer),
                from_writer,
                free: pool,
                outstanding: 0,
                segments_sent: 0,
                fault: self.opts.fault,
                send_seq: ring.next.seq,
                recv_seq: ring.prev.seq,
                op: start.op,
                recv_scratch: &mut recv_scratch,
            };
            let mut result = match self.opts.fault {
                Some(f @ InjectedFault::DieAfterSegments(0)) => Err(PhaseError::Injected(f)),
                _ => Ok(()),
            };
            if result.is_ok() {
                result = match start.op {
                    Op::AllReduceMean => all_reduce_steps(&mut pipe, prev_stream, buf, n, r, len),
                    Op::Broadcast => {
                        let root = ring
                            .members
                            .iter()
                            .position(|m| u64::from(m.id) == start.root)
                            .expect("checked");
                        broadcast_steps(&mut pipe, prev_stream, buf, n, r, root)
                    }
                };
            }
            if result.is_err() {
                // Wake a writer blocked on a stuck peer.
                let _ = next_stream.shutdown(Shutdown::Both);
            }
            pipe.to_writer = None;
            while pipe.outstanding > 0 {
                match pipe.reclaim(true) {
                    Ok(()) => {}
                    Err(e) => {
                        if result.is_ok() {
                            result = Err(e);
                        }
                        break;
                    }
                }
            }
            let _ = writer.join();
            (result, pipe.free)
        });
        self.pool = pool;
        self.recv_scratch = recv_scratch;
        result.map_err(|e| match e {
            PhaseError::Next(e) => self.edge_error(&ring.ids, ring.next.member, "sending data", e),
            PhaseError::Prev(e) => {
                self.edge_error(&ring.ids, ring.prev.member, "receiving data", e)
            }
            PhaseError::Injected(fault) => CollectiveError::Injected {
                job: self.job(),
                group: Group(ring.ids.clone()),
                fault,
            },
        })
    }
}

fn ids(members: &[RingMember]) -> Vec<u32> {
    members.iter().map(|m| m.id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated() {
        let key = ClusterKey::from_secret(b"collective-options-00");
        let mut o = CollectiveOptions::new(key);
        o.validate().unwrap();
        o.cache_max = 0;
        assert!(o.validate().is_err());
        o.cache_max = RING_CACHE_MAX + 1;
        assert!(o.validate().is_err());
        o.cache_max = 1;
        o.io_timeout = Duration::ZERO;
        assert!(o.validate().is_err());
    }
}
