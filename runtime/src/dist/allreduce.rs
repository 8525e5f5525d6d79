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
//! Every step's chunk goes in frames of at most [`RING_SEGMENT_ELEMENTS`];
//! a sender thread (one per operation, scoped) writes them while the
//! caller's thread reads and reduces, so no member waits on its own write
//! and the ring cannot deadlock on full socket buffers.
//!
//! ```text
//! ring frame header (40 bytes, little-endian)
//!   0..4    tag: "DMRS" start, "DMRA" ack, "DMRD" data
//!   4..6    op u16: 1 all-reduce mean, 2 broadcast
//!   6..8    reserved u16, 0
//!   8..16   seq u64: operations done on this connection before this one
//!   16..40  start: elements u64, group fingerprint u64, root u64
//!           ack:   0, 0, 0
//!           data:  step u64, first element u64, elements u64; then the f32s
//! ```
//!
//! Connections are cached per group (the sorted member ids), as SD-Pipe
//! caches a communicator per member tuple, in a least-recently-used cache of
//! at most [`RING_CACHE_MAX`] rings. Members evict independently, so every
//! operation opens with a start/ack exchange on each edge: a member that
//! finds its cached edge closed by the peer (which evicted the group and
//! dialled again) moves to the peer's new connection, and the start frame
//! checks that all members run the same operation on the same length.
//!
//! A member that dies closes its sockets; its neighbours fail, close theirs,
//! and the failure goes round the ring, so every member returns an error
//! naming a lost member. A member that hangs is caught by `io_timeout`, one
//! that never joins by `setup_timeout`.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender};
use distmind_common::handshake::ClusterKey;
use distmind_transport::TokenBucket;

use super::limits::{
    COLLECTIVE_ELEMENTS_MAX, GROUP_MEMBERS_MAX, RING_CACHE_MAX, RING_SEGMENTS_IN_FLIGHT,
    RING_SEGMENT_ELEMENTS,
};
use super::listener::{dial, ConnSlot, DialError, DistListener, Hello, Pending, PendingKey};
use super::tensor::{f32s_to_le, le_to_f32s};

const START_TAG: [u8; 4] = *b"DMRS";
const ACK_TAG: [u8; 4] = *b"DMRA";
const DATA_TAG: [u8; 4] = *b"DMRD";
pub const RING_FRAME_HEADER_BYTES: usize = 40;
const SEGMENT_BYTES_MAX: usize = RING_FRAME_HEADER_BYTES + RING_SEGMENT_ELEMENTS * 4;

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
    /// Closes both edges, so the neighbours see the end at once.
    fn poison(&self) {
        let _ = self.next.stream.shutdown(Shutdown::Both);
        let _ = self.prev.stream.shutdown(Shutdown::Both);
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

/// Chunk `c` of `n` over `len` elements.
pub fn chunk_range(len: usize, n: usize, c: usize) -> Range<usize> {
    debug_assert!(c < n);
    let at = |i: usize| (i as u128 * len as u128 / n as u128) as usize;
    at(c)..at(c + 1)
}

/// Reduce-scatter step `s` for rank `r` of `n`: (chunk sent, chunk received).
fn reduce_scatter_chunks(r: usize, s: usize, n: usize) -> (usize, usize) {
    ((r + n - s) % n, (r + 2 * n - s - 1) % n)
}

/// All-gather step `s` for rank `r` of `n`: (chunk sent, chunk received).
fn all_gather_chunks(r: usize, s: usize, n: usize) -> (usize, usize) {
    ((r + 1 + n - s) % n, (r + n - s) % n)
}

/// The chunk rank `r` owns (sums and divides) after reduce-scatter.
fn owned_chunk(r: usize, n: usize) -> usize {
    (r + 1) % n
}

fn fingerprint(ids: &[u32]) -> u64 {
    // FNV-1a over the count and the ids.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in (ids.len() as u64)
        .to_le_bytes()
        .into_iter()
        .chain(ids.iter().flat_map(|i| i.to_le_bytes()))
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FrameHeader {
    tag: [u8; 4],
    op: u16,
    seq: u64,
    a: u64,
    b: u64,
    c: u64,
}

impl FrameHeader {
    fn encode(&self) -> [u8; RING_FRAME_HEADER_BYTES] {
        let mut out = [0u8; RING_FRAME_HEADER_BYTES];
        out[0..4].copy_from_slice(&self.tag);
        out[4..6].copy_from_slice(&self.op.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.a.to_le_bytes());
        out[24..32].copy_from_slice(&self.b.to_le_bytes());
        out[32..40].copy_from_slice(&self.c.to_le_bytes());
        out
    }

    fn decode(b: &[u8; RING_FRAME_HEADER_BYTES]) -> Result<Self, String> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let reserved = u16::from_le_bytes([b[6], b[7]]);
        if reserved != 0 {
            return Err(format!("ring frame reserved field is {reserved}"));
        }
        Ok(FrameHeader {
            tag: b[0..4].try_into().expect("4 bytes"),
            op: u16::from_le_bytes([b[4], b[5]]),
            seq: u64_at(8),
            a: u64_at(16),
            b: u64_at(24),
            c: u64_at(32),
        })
    }

    /// Checks a frame against the one expected, field by field.
    fn expect(&self, want: &FrameHeader) -> Result<(), String> {
        let name = |t: &[u8; 4]| String::from_utf8_lossy(t).into_owned();
        if self.tag != want.tag {
            return Err(format!(
                "frame tag {:?} where {:?} was due",
                name(&self.tag),
                name(&want.tag)
            ));
        }
        for (field, got, exp) in [
            ("op", u64::from(self.op), u64::from(want.op)),
            ("seq", self.seq, want.seq),
        ] {
            if got != exp {
                return Err(format!("field `{field}` is {got}, expected {exp}"));
            }
        }
        let fields: [&str; 3] = match self.tag {
            START_TAG => ["elements", "group fingerprint", "root"],
            DATA_TAG => ["step", "first element", "elements"],
            _ => ["a", "b", "c"],
        };
        for (field, got, exp) in [
            (fields[0], self.a, want.a),
            (fields[1], self.b, want.b),
            (fields[2], self.c, want.c),
        ] {
            if got != exp {
                return Err(format!("field `{field}` is {got}, expected {exp}"));
            }
        }
        Ok(())
    }
}

/// How a read or write on an edge failed.
enum EdgeError {
    /// The neighbour closed the connection (end of stream, reset, broken pipe).
    Closed(String),
    TimedOut,
    Io(io::Error),
    Protocol(String),
}

impl From<io::Error> for EdgeError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof => EdgeError::Closed("end of stream".into()),
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => EdgeError::Closed(e.to_string()),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => EdgeError::TimedOut,
            _ => EdgeError::Io(e),
        }
    }
}

fn read_header(s: &mut TcpStream) -> Result<FrameHeader, EdgeError> {
    let mut b = [0u8; RING_FRAME_HEADER_BYTES];
    s.read_exact(&mut b)?;
    FrameHeader::decode(&b).map_err(EdgeError::Protocol)
}

/// How received values meet the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Combine {
    /// `buf = received + buf` (reduce-scatter).
    Add,
    /// `buf = received` (all-gather, broadcast).
    Copy,
}

/// The sender thread's two channels and the frames the caller holds.
struct Pipe<'a> {
    to_writer: Option<Sender<Vec<u8>>>,
    from_writer: Receiver<io::Result<Vec<u8>>>,
    free: Vec<Vec<u8>>,
    outstanding: usize,
    segments_sent: u64,
    fault: Option<InjectedFault>,
    /// `seq` of the next edge (frames sent) and of the prev edge (received).
    send_seq: u64,
    recv_seq: u64,
    op: Op,
    recv_scratch: &'a mut Vec<u8>,
}

/// Why a data phase stopped, and on which edge.
enum PhaseError {
    Next(EdgeError),
    Prev(EdgeError),
    Injected(InjectedFault),
}

impl Pipe<'_> {
    fn reclaim(&mut self, block: bool) -> Result<(), PhaseError> {
        loop {
            let got = if block {
                self.from_writer.recv().ok()
            } else {
                self.from_writer.try_recv().ok()
            };
            match got {
                Some(Ok(b)) => {
                    self.outstanding -= 1;
                    self.free.push(b);
                    if block {
                        return Ok(());
                    }
                }
                Some(Err(e)) => return Err(PhaseError::Next(e.into())),
                None if block => {
                    return Err(PhaseError::Next(EdgeError::Closed(
                        "sender thread stopped".into(),
                    )))
                }
                None => return Ok(()),
            }
        }
    }

    fn hand(&mut self, step: u64, at: usize, values: &[f32]) -> Result<(), PhaseError> {
        let mut b = self.free.pop().expect("a free frame");
        b.clear();
        b.extend_from_slice(
            &FrameHeader {
                tag: DATA_TAG,
                op: self.op as u16,
                seq: self.send_seq,
                a: step,
                b: at as u64,
                c: values.len() as u64,
            }
            .encode(),
        );
        b.resize(RING_FRAME_HEADER_BYTES + values.len() * 4, 0);
        f32s_to_le(values, &mut b[RING_FRAME_HEADER_BYTES..]);
        let tx = self.to_writer.as_ref().expect("open during the phase");
        if tx.send(b).is_err() {
            return Err(PhaseError::Next(EdgeError::Closed(
                "sender thread stopped".into(),
            )));
        }
        self.outstanding += 1;
        self.segments_sent += 1;
        if let Some(f @ InjectedFault::DieAfterSegments(k)) = self.fault {
            if self.segments_sent >= k {
                return Err(PhaseError::Injected(f));
            }
        }
        Ok(())
    }

    fn receive(
        &mut self,
        prev: &mut TcpStream,
        step: u64,
        at: usize,
        dst: &mut [f32],
        combine: Combine,
    ) -> Result<(), PhaseError> {
        let want = FrameHeader {
            tag: DATA_TAG,
            op: self.op as u16,
            seq: self.recv_seq,
            a: step,
            b: at as u64,
            c: dst.len() as u64,
        };
        let h = read_header(prev).map_err(PhaseError::Prev)?;
        h.expect(&want)
            .map_err(|d| PhaseError::Prev(EdgeError::Protocol(d)))?;
        // Sized by what we expect, never by the peer: at most one segment.
        self.recv_scratch.resize(dst.len() * 4, 0);
        prev.read_exact(self.recv_scratch)
            .map_err(|e| PhaseError::Prev(e.into()))?;
        match combine {
            Combine::Copy => le_to_f32s(self.recv_scratch, dst),
            Combine::Add => {
                for (d, s) in dst.iter_mut().zip(self.recv_scratch.chunks_exact(4)) {
                    *d += f32::from_le_bytes(s.try_into().expect("4 bytes"));
                }
            }
        }
        Ok(())
    }

    /// One step: send `send` (if any) while receiving into `recv` (if any);
    /// with `forward`, `send` is `recv`'s range and each segment goes on
    /// once it has arrived.
    fn step(
        &mut self,
        prev: &mut TcpStream,
        buf: &mut [f32],
        step: u64,
        send: Option<Range<usize>>,
        recv: Option<(Range<usize>, Combine)>,
        forward: bool,
    ) -> Result<(), PhaseError> {
        let segments = |r: &Range<usize>| r.len().div_ceil(RING_SEGMENT_ELEMENTS);
        let seg = |r: &Range<usize>, i: usize| {
            let start = r.start + i * RING_SEGMENT_ELEMENTS;
            start..(start + RING_SEGMENT_ELEMENTS).min(r.end)
        };
        let (send_n, recv_n) = (
            send.as_ref().map_or(0, segments),
            recv.as_ref().map_or(0, |(r, _)| segments(r)),
        );
        let (mut si, mut ri) = (0, 0);
        while si < send_n || ri < recv_n {
            self.reclaim(false)?;
            let may_send = si < send_n && (!forward || si < ri);
            if may_send && !self.free.is_empty() {
                let r = seg(send.as_ref().expect("sending"), si);
                self.hand(step, r.start, &buf[r.clone()])?;
                si += 1;
            } else if ri < recv_n {
                let (range, combine) = recv.as_ref().expect("receiving");
                let r = seg(range, ri);
                self.receive(prev, step, r.start, &mut buf[r], *combine)?;
                ri += 1;
            } else {
                self.reclaim(true)?;
            }
        }
        Ok(())
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
            ring.poison();
        }
        while self.rings.len() >= self.opts.cache_max {
            let lru = (0..self.rings.len())
                .min_by_key(|&i| self.rings[i].last_used)
                .expect("non-empty");
            self.rings.swap_remove(lru).poison();
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
            EdgeError::Closed(detail) => CollectiveError::MemberLost {
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
    /// neighbour closed (it evicted the group and dialled again) is replaced
    /// within `setup_timeout`; everything else is an error.
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

        // Start to next. A write into a connection the peer closed may still
        // succeed; the ack below catches that.
        let mut redialled = false;
        if let Err(e) = (&ring.next.stream).write_all(&start_frame(ring.next.seq).encode()) {
            match EdgeError::from(e) {
                EdgeError::Closed(_) if ring.next.seq > 0 => {
                    ring.next = self.dial(&ids, next_m)?;
                    self.stats.edges_replaced += 1;
                    redialled = true;
                    (&ring.next.stream)
                        .write_all(&start_frame(0).encode())
                        .map_err(|e| {
                            self.edge_error(&ids, next_m, "sending the start", e.into())
                        })?;
                }
                e => return Err(self.edge_error(&ids, next_m, "sending the start", e)),
            }
        }

        // Start from prev: a closed edge means prev dialled a new one (or is
        // gone, and then nothing arrives before the deadline).
        loop {
            match read_header(&mut ring.prev.stream) {
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
                Err(EdgeError::Closed(detail)) => {
                    let lost = self.edge_error(
                        &ids,
                        prev_m,
                        "waiting for the start",
                        EdgeError::Closed(detail),
                    );
                    let key = PendingKey::Ring {
                        group: ids.clone(),
                        from: prev_m.id,
                    };
                    let Some(p) = self.listener.take(&key, deadline) else {
                        return Err(lost);
                    };
                    ring.prev = self.adopt(p.stream, prev_m, Some(p.slot)).map_err(|e| {
                        self.edge_error(&ids, prev_m, "taking its connection", e.into())
                    })?;
                    self.stats.connections_taken += 1;
                    self.stats.edges_replaced += 1;
                }
                Err(e) => return Err(self.edge_error(&ids, prev_m, "waiting for the start", e)),
            }
        }
        (&ring.prev.stream)
            .write_all(&ack_frame(ring.prev.seq).encode())
            .map_err(|e| self.edge_error(&ids, prev_m, "sending the ack", e.into()))?;

        // Ack from next; a cached edge found closed here is dialled again once.
        loop {
            match read_header(&mut ring.next.stream) {
                Ok(h) => {
                    return h.expect(&ack_frame(ring.next.seq)).map_err(|d| {
                        self.edge_error(&ids, next_m, "waiting for the ack", EdgeError::Protocol(d))
                    })
                }
                Err(EdgeError::Closed(_)) if !redialled && ring.next.seq > 0 => {
                    ring.next = self.dial(&ids, next_m)?;
                    self.stats.edges_replaced += 1;
                    redialled = true;
                    (&ring.next.stream)
                        .write_all(&start_frame(0).encode())
                        .map_err(|e| {
                            self.edge_error(&ids, next_m, "sending the start", e.into())
                        })?;
                }
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
        while pool.len() < RING_SEGMENTS_IN_FLIGHT {
            pool.push(Vec::with_capacity(SEGMENT_BYTES_MAX));
        }
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

fn all_reduce_steps(
    pipe: &mut Pipe,
    prev: &mut TcpStream,
    buf: &mut [f32],
    n: usize,
    r: usize,
    len: usize,
) -> Result<(), PhaseError> {
    let chunk = |c| chunk_range(len, n, c);
    for s in 0..n - 1 {
        let (send, recv) = reduce_scatter_chunks(r, s, n);
        pipe.step(
            prev,
            buf,
            s as u64,
            Some(chunk(send)),
            Some((chunk(recv), Combine::Add)),
            false,
        )?;
    }
    let n_f32 = n as f32;
    for v in &mut buf[chunk(owned_chunk(r, n))] {
        *v /= n_f32;
    }
    for s in 0..n - 1 {
        let (send, recv) = all_gather_chunks(r, s, n);
        let step = (n - 1 + s) as u64;
        pipe.step(
            prev,
            buf,
            step,
            Some(chunk(send)),
            Some((chunk(recv), Combine::Copy)),
            false,
        )?;
    }
    Ok(())
}

fn broadcast_steps(
    pipe: &mut Pipe,
    prev: &mut TcpStream,
    buf: &mut [f32],
    n: usize,
    r: usize,
    root: usize,
) -> Result<(), PhaseError> {
    let all = 0..buf.len();
    let d = (r + n - root) % n;
    let (send, recv) = match d {
        0 => (Some(all), None),
        _ if d == n - 1 => (None, Some((all, Combine::Copy))),
        _ => (Some(all.clone()), Some((all, Combine::Copy))),
    };
    let forward = d != 0 && d != n - 1;
    pipe.step(prev, buf, 0, send, recv, forward)
}

fn ids(members: &[RingMember]) -> Vec<u32> {
    members.iter().map(|m| m.id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The schedule, run on vectors instead of sockets: every member ends
    /// with the same bits, equal to the chunk sums in ring order / n.
    fn simulate(inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let n = inputs.len();
        let len = inputs[0].len();
        let mut bufs = inputs.to_vec();
        for s in 0..n - 1 {
            let sent: Vec<(usize, Vec<f32>)> = (0..n)
                .map(|r| {
                    let c = reduce_scatter_chunks(r, s, n).0;
                    (c, bufs[r][chunk_range(len, n, c)].to_vec())
                })
                .collect();
            for r in 0..n {
                let (c, data) = &sent[(r + n - 1) % n];
                assert_eq!(*c, reduce_scatter_chunks(r, s, n).1);
                for (d, v) in bufs[r][chunk_range(len, n, *c)].iter_mut().zip(data) {
                    *d += v;
                }
            }
        }
        for (r, b) in bufs.iter_mut().enumerate() {
            for v in &mut b[chunk_range(len, n, owned_chunk(r, n))] {
                *v /= n as f32;
            }
        }
        for s in 0..n - 1 {
            let sent: Vec<(usize, Vec<f32>)> = (0..n)
                .map(|r| {
                    let c = all_gather_chunks(r, s, n).0;
                    (c, bufs[r][chunk_range(len, n, c)].to_vec())
                })
                .collect();
            for r in 0..n {
                let (c, data) = &sent[(r + n - 1) % n];
                assert_eq!(*c, all_gather_chunks(r, s, n).1);
                bufs[r][chunk_range(len, n, *c)].copy_from_slice(data);
            }
        }
        bufs
    }

    #[test]
    fn the_schedule_sums_each_chunk_once_in_ring_order() {
        for n in 2..=6 {
            for len in [0, 1, 5, 7, 13] {
                let inputs: Vec<Vec<f32>> = (0..n)
                    .map(|m| (0..len).map(|j| 0.1 * (m * 31 + j) as f32 + 1e-3).collect())
                    .collect();
                let out = simulate(&inputs);
                for c in 0..n {
                    for j in chunk_range(len, n, c) {
                        let mut sum = inputs[c][j];
                        for k in 1..n {
                            sum += inputs[(c + k) % n][j];
                        }
                        let mean = sum / n as f32;
                        for o in &out {
                            assert_eq!(o[j].to_bits(), mean.to_bits(), "n={n} len={len} j={j}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn chunks_cover_the_buffer_for_any_length() {
        for n in 1..=7 {
            for len in [0, 1, 2, 6, 7, 8, 1000, 1_000_003] {
                let mut at = 0;
                for c in 0..n {
                    let r = chunk_range(len, n, c);
                    assert_eq!(r.start, at);
                    assert!(r.len() == len / n || r.len() == len / n + 1);
                    at = r.end;
                }
                assert_eq!(at, len);
            }
        }
    }

    #[test]
    fn ring_frames_round_trip_and_name_the_wrong_field() {
        let h = FrameHeader {
            tag: DATA_TAG,
            op: Op::AllReduceMean as u16,
            seq: 3,
            a: 1,
            b: 1000,
            c: 77,
        };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        h.expect(&h).unwrap();
        let e = h.expect(&FrameHeader { c: 78, ..h }).unwrap_err();
        assert!(e.contains("`elements`"), "{e}");
        let e = h.expect(&FrameHeader { seq: 4, ..h }).unwrap_err();
        assert!(e.contains("`seq`"), "{e}");
        let e = h
            .expect(&FrameHeader {
                tag: START_TAG,
                ..h
            })
            .unwrap_err();
        assert!(e.contains("DMRS"), "{e}");
        let s = FrameHeader {
            tag: START_TAG,
            ..h
        };
        let e = s.expect(&FrameHeader { a: 5, ..s }).unwrap_err();
        assert!(e.contains("`elements`"), "{e}");
        let mut b = h.encode();
        b[7] = 1;
        assert!(FrameHeader::decode(&b).is_err());
        assert_ne!(fingerprint(&[1, 2, 3]), fingerprint(&[1, 2, 4]));
        assert_ne!(fingerprint(&[1, 2]), fingerprint(&[1, 2, 0]));
    }

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
