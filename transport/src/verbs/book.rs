//! The bookkeeping of the verbs transport, without hardware.
//!
//! [`Book`] is everything `VerbsTransport` (feature `verbs`) knows besides its device
//! handles: registered regions (address, lkey, length, reads in flight),
//! peers (address, the server's [`QpInfo`], a per-peer queue of planned
//! chains, the [`SendWindow`], the caller ops in flight as work-request
//! spans), the completions waiting to be polled, and the counters. The
//! transport holds it under its one lock and drives the device around it:
//!
//! * [`Book::enqueue`] validates a whole batch (and accepts none of it on any
//!   error), plans it with [`plan_reads`] and queues the chains on the peer;
//! * [`Book::post_ready`] hands queued chains to a poster (`ibv_post_send`)
//!   while the peer's window allows;
//! * [`Book::on_completion`] maps a hardware `wr_id` back to the peer
//!   (its high [`TAG_BITS`] bits are the peer's tag) and the work request
//!   (its low [`SEQ_BITS`] bits); an RC queue pair completes in order, so a
//!   signalled completion of `seq` also completes every earlier, unsignalled
//!   work request;
//! * a failed completion fails the peer: ops wholly before the failed work
//!   request succeeded, every other op of the peer fails with
//!   [`TransportError::PeerLost`] — ops never posted at once, ops with work
//!   requests in the hardware once it has drained them (the flush completion
//!   of the last posted work request, which is always signalled), so no op is
//!   reported while the device may still write its memory;
//! * [`Book::disconnect`] fails a peer the same way and asks the transport to
//!   move its queue pair to Error ([`Book::take_to_stop`]) so in-flight work
//!   flushes; a peer that does not drain within [`DRAIN_TIMEOUT`] is reported
//!   by [`Book::overdue`], the transport destroys its queue pair and calls
//!   [`Book::qp_destroyed`]; a detached peer that drained comes out of
//!   [`Book::take_finished`] and the transport drops its queue pair and
//!   control-connection guard.
//!
//! Every accepted op completes exactly once, through [`Book::take_done`].

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::info::QpInfo;
use super::plan::{plan_reads, Chain, PlanLimits, ReadReq, SendWindow};
use crate::{
    Completion, PeerId, ReadOp, RegionId, TransportError, TransportStats, INFLIGHT_CHUNKS_MAX,
    INFLIGHT_OPS_MAX,
};

/// Memory servers a transport is connected to at once (queue pairs still
/// draining after a disconnect count too).
pub const PEERS_MAX: usize = 256;
/// Low bits of a hardware `wr_id`: the work request's sequence number on its
/// queue pair.
pub const SEQ_BITS: u32 = 40;
/// High bits of a hardware `wr_id`: the tag of the peer (queue pair).
pub const TAG_BITS: u32 = 64 - SEQ_BITS;
/// Work requests one queue pair may carry over its life (then reconnect).
pub const SEQ_LIMIT: u64 = 1 << SEQ_BITS;
const TAG_LIMIT: u32 = 1 << TAG_BITS;
/// How long a failed or disconnected queue pair may take to flush its work
/// requests before the transport destroys it.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

const _: () = assert!(PEERS_MAX < TAG_LIMIT as usize);

/// The hardware `wr_id` of work request `seq` on the queue pair tagged `tag`.
pub fn hw_wr_id(tag: u32, seq: u64) -> u64 {
    debug_assert!(tag < TAG_LIMIT && seq < SEQ_LIMIT);
    (u64::from(tag) << SEQ_BITS) | seq
}

fn split_wr_id(wr_id: u64) -> (u32, u64) {
    ((wr_id >> SEQ_BITS) as u32, wr_id & (SEQ_LIMIT - 1))
}

/// What the book needs of a registered local buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRegion {
    /// Address of the buffer's first byte (the MR's `addr`).
    pub addr: u64,
    pub lkey: u32,
    pub len: u64,
}

struct RegionEntry {
    info: LocalRegion,
    in_flight: usize,
}

/// One caller op and its work requests `first_seq..=last_seq`.
#[derive(Debug, Clone, Copy)]
struct Span {
    op: ReadOp,
    first_seq: u64,
    last_seq: u64,
}

impl Span {
    fn wrs(&self) -> usize {
        (self.last_seq - self.first_seq + 1) as usize
    }
}

struct PeerBook {
    addr: String,
    tag: u32,
    remote: QpInfo,
    window: SendWindow,
    /// `seq` of the next planned work request.
    next_seq: u64,
    /// Planned chains not posted yet (absolute `seq`s).
    queued: VecDeque<Chain>,
    /// Unreported ops, in `seq` order.
    spans: VecDeque<Span>,
    /// Why the peer is lost; its queue pair takes no more work.
    failed: Option<String>,
    /// Disconnected (or replaced): unreachable by id and address.
    detached: bool,
    /// The transport was asked to move the queue pair to Error.
    stop_asked: bool,
    /// The queue pair was destroyed: nothing of it runs any more.
    qp_gone: bool,
    /// When the drain of a failed queue pair was first seen waiting.
    drain_since: Option<Instant>,
}

/// Everything spans report into (split from the peers for borrowing).
#[derive(Default)]
struct Acct {
    regions: HashMap<RegionId, RegionEntry>,
    done: VecDeque<Completion>,
    /// Accepted ops not yet taken by [`Book::take_done`].
    ops_outstanding: usize,
    /// Planned work requests of unreported ops.
    wrs_outstanding: usize,
    stats: TransportStats,
    /// Peers to move to Error ([`Book::take_to_stop`]).
    to_stop: Vec<PeerId>,
    /// Failed peers still holding work in the hardware.
    draining: Vec<PeerId>,
    /// Detached peers that may have drained.
    maybe_finished: Vec<PeerId>,
}

impl Acct {
    fn finish(&mut self, s: Span, result: Result<(), TransportError>) {
        if let Some(r) = self.regions.get_mut(&s.op.local) {
            r.in_flight -= 1;
        }
        self.wrs_outstanding -= s.wrs();
        self.stats.ops_completed += 1;
        match &result {
            Ok(()) => self.stats.bytes_read += s.op.len,
            Err(_) => self.stats.ops_failed += 1,
        }
        self.done.push_back(Completion {
            wr_id: s.op.wr_id,
            result,
        });
    }
}

/// Fails what of a failed peer the hardware no longer touches: every op once
/// the window drained, otherwise the ops none of whose work requests was posted.
fn settle(id: PeerId, p: &mut PeerBook, acct: &mut Acct) {
    let Some(reason) = &p.failed else {
        return;
    };
    p.queued.clear();
    let lost = || TransportError::PeerLost {
        addr: p.addr.clone(),
        reason: reason.clone(),
    };
    if p.window.outstanding() == 0 {
        for s in p.spans.drain(..) {
            acct.finish(s, Err(lost()));
        }
        acct.draining.retain(|d| *d != id);
        if p.detached {
            acct.maybe_finished.push(id);
        }
    } else {
        let posted = p.window.next_seq();
        let keep = p.spans.iter().take_while(|s| s.first_seq < posted).count();
        for s in p.spans.drain(keep..) {
            acct.finish(s, Err(lost()));
        }
        if !acct.draining.contains(&id) {
            acct.draining.push(id);
        }
    }
}

fn fail(id: PeerId, p: &mut PeerBook, acct: &mut Acct, reason: String) {
    if p.failed.is_none() {
        log::warn!("transport verbs: memory server {} lost: {reason}", p.addr);
        p.failed = Some(reason);
    }
    if !p.stop_asked && !p.qp_gone {
        p.stop_asked = true;
        acct.to_stop.push(id);
    }
    settle(id, p, acct);
}

/// The verbs transport's state, without device handles.
pub struct Book {
    limits: PlanLimits,
    next_region: u32,
    peers: HashMap<PeerId, PeerBook>,
    by_addr: HashMap<String, PeerId>,
    by_tag: HashMap<u32, PeerId>,
    next_peer: u32,
    next_tag: u32,
    acct: Acct,
}

impl Book {
    /// `limits.max_rd_atomic` is every peer's send window.
    pub fn new(limits: PlanLimits) -> Self {
        Book {
            limits,
            next_region: 1,
            peers: HashMap::new(),
            by_addr: HashMap::new(),
            by_tag: HashMap::new(),
            next_peer: 1,
            next_tag: 1,
            acct: Acct::default(),
        }
    }

    pub fn stats(&self) -> TransportStats {
        self.acct.stats
    }

    /// Accepted ops whose completion was not taken yet.
    pub fn ops_outstanding(&self) -> usize {
        self.acct.ops_outstanding
    }

    /// Peers held (connected, lost, or draining after a disconnect).
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    pub fn add_region(&mut self, info: LocalRegion) -> RegionId {
        let id = RegionId(self.next_region);
        self.next_region += 1;
        self.acct
            .regions
            .insert(id, RegionEntry { info, in_flight: 0 });
        id
    }

    /// Refused with [`TransportError::Busy`] while ops into it are unreported.
    pub fn remove_region(&mut self, id: RegionId) -> Result<(), TransportError> {
        match self.acct.regions.get(&id) {
            None => Err(TransportError::UnknownRegion(id)),
            Some(r) if r.in_flight > 0 => Err(TransportError::Busy(id)),
            Some(_) => {
                self.acct.regions.remove(&id);
                Ok(())
            }
        }
    }

    /// The connected, healthy peer at `addr`.
    pub fn lookup(&self, addr: &str) -> Option<PeerId> {
        let id = *self.by_addr.get(addr)?;
        self.peers[&id].failed.is_none().then_some(id)
    }

    /// Whether one more peer fits (checked before connecting, again in
    /// [`Self::add_peer`]).
    pub fn check_room(&self, addr: &str) -> Result<(), TransportError> {
        // A lost peer at the same address is replaced, but it holds its slot
        // until it drained.
        if self.peers.len() >= PEERS_MAX {
            return Err(TransportError::Connect {
                addr: addr.to_string(),
                source: std::io::Error::other(format!(
                    "this transport already holds PEERS_MAX = {PEERS_MAX} memory-server queue pairs; disconnect one first"
                )),
            });
        }
        Ok(())
    }

    /// Adds a connected peer; returns its id and whether it is new (`false`:
    /// another caller connected `addr` first, and its peer is returned).
    /// A lost peer at `addr` is detached (as by [`Self::disconnect`]) and
    /// replaced.
    pub fn add_peer(
        &mut self,
        addr: &str,
        remote: QpInfo,
    ) -> Result<(PeerId, bool), TransportError> {
        if let Some(id) = self.lookup(addr) {
            return Ok((id, false));
        }
        check_server_info(addr, &remote)?;
        if let Some(old) = self.by_addr.get(addr).copied() {
            self.disconnect(old);
        }
        self.check_room(addr)?;
        let mut tag = self.next_tag;
        while tag == 0 || self.by_tag.contains_key(&tag) {
            tag = (tag + 1) % TAG_LIMIT;
        }
        self.next_tag = (tag + 1) % TAG_LIMIT;
        let mut n = self.next_peer;
        while n == 0 || self.peers.contains_key(&PeerId(n)) {
            n = n.wrapping_add(1);
        }
        self.next_peer = n.wrapping_add(1);
        let id = PeerId(n);
        self.peers.insert(
            id,
            PeerBook {
                addr: addr.to_string(),
                tag,
                remote,
                window: SendWindow::new(self.limits.max_rd_atomic),
                next_seq: 0,
                queued: VecDeque::new(),
                spans: VecDeque::new(),
                failed: None,
                detached: false,
                stop_asked: false,
                qp_gone: false,
                drain_since: None,
            },
        );
        self.by_addr.insert(addr.to_string(), id);
        self.by_tag.insert(tag, id);
        Ok((id, true))
    }

    /// Validates `ops` as a whole (nothing is accepted if one fails), plans
    /// them and queues the chains on `peer`. Posts nothing: call
    /// [`Self::post_ready`].
    pub fn enqueue(&mut self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError> {
        let Some(p) = self.peers.get_mut(&peer).filter(|p| !p.detached) else {
            return Err(TransportError::UnknownPeer(peer));
        };
        if let Some(reason) = &p.failed {
            return Err(TransportError::PeerLost {
                addr: p.addr.clone(),
                reason: format!("{reason} (connect again for a fresh queue pair)"),
            });
        }
        let acct = &mut self.acct;
        let chunk = u64::from(self.limits.max_read_bytes);
        let mut wrs = 0u64;
        for op in ops {
            let region = acct
                .regions
                .get(&op.local)
                .ok_or(TransportError::UnknownRegion(op.local))?;
            let chunks = crate::completion::check_op(
                op,
                region.info.len,
                Some((&p.addr, p.remote.len)),
                chunk,
            )?;
            wrs += chunks;
        }
        if acct.ops_outstanding + ops.len() > INFLIGHT_OPS_MAX
            || acct.wrs_outstanding as u64 + wrs > INFLIGHT_CHUNKS_MAX as u64
        {
            return Err(TransportError::QueueFull {
                ops_max: INFLIGHT_OPS_MAX,
                chunks_max: INFLIGHT_CHUNKS_MAX,
            });
        }
        if p.next_seq + wrs > SEQ_LIMIT {
            return Err(TransportError::PeerLost {
                addr: p.addr.clone(),
                reason: format!(
                    "the queue pair used up its {SEQ_LIMIT} work-request ids; connect again"
                ),
            });
        }
        if ops.is_empty() {
            return Ok(());
        }
        // The planner's wr_id is the op's index: callers' wr_ids may repeat.
        let reqs: Vec<ReadReq> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| {
                let local = &acct.regions[&op.local].info;
                ReadReq {
                    wr_id: i as u64,
                    local_addr: local.addr + op.local_offset,
                    lkey: local.lkey,
                    remote_addr: p.remote.addr + op.remote_offset,
                    rkey: p.remote.rkey,
                    len: op.len,
                }
            })
            .collect();
        let plan = plan_reads(&reqs, &self.limits)
            .map_err(|e| TransportError::InvalidOption(e.to_string()))?;
        debug_assert_eq!(plan.wr_count(), wrs);
        let base = p.next_seq;
        for mut c in plan.chains {
            for w in &mut c.wrs {
                w.seq += base;
            }
            p.queued.push_back(c);
        }
        for (i, (op, r)) in ops.iter().zip(&plan.requests).enumerate() {
            debug_assert_eq!(r.wr_id, i as u64);
            p.spans.push_back(Span {
                op: *op,
                first_seq: base + r.first_seq,
                last_seq: base + r.last_seq,
            });
            acct.regions
                .get_mut(&op.local)
                .expect("validated")
                .in_flight += 1;
        }
        p.next_seq += wrs;
        acct.ops_outstanding += ops.len();
        acct.wrs_outstanding += wrs as usize;
        Ok(())
    }

    /// Hands `peer`'s queued chains to `post(chain, base)` while its window
    /// allows; `base` is the hardware `wr_id` of `seq` 0 (so work request
    /// `seq` gets `base + seq`, as `QueuePair::post_chain` numbers them).
    ///
    /// `post` returning `Err(reason)` must have destroyed the queue pair
    /// (a chain may have been posted in part): the peer fails, all its ops.
    pub fn post_ready(
        &mut self,
        peer: PeerId,
        mut post: impl FnMut(&Chain, u64) -> Result<(), String>,
    ) {
        if let Some(p) = self.peers.get_mut(&peer) {
            post_peer(peer, p, &mut self.acct, &mut |_, c, b| post(c, b));
        }
    }

    /// [`Self::post_ready`] for every peer with queued chains.
    pub fn post_all_ready(
        &mut self,
        mut post: impl FnMut(PeerId, &Chain, u64) -> Result<(), String>,
    ) {
        for (&id, p) in self.peers.iter_mut() {
            if !p.queued.is_empty() {
                post_peer(id, p, &mut self.acct, &mut post);
            }
        }
    }

    /// One work completion; `result` is `Err(reason)` for any failed status
    /// (flushes included). Returns whether it belonged to a known queue pair
    /// (late completions of destroyed ones are ignored).
    pub fn on_completion(&mut self, wr_id: u64, result: Result<(), String>) -> bool {
        let (tag, seq) = split_wr_id(wr_id);
        let Some(&id) = self.by_tag.get(&tag) else {
            return false;
        };
        let p = self.peers.get_mut(&id).expect("tags map to peers");
        if seq >= p.window.next_seq() || p.qp_gone {
            return false;
        }
        p.window.on_completed(seq);
        let acct = &mut self.acct;
        if p.failed.is_none() {
            // In order: everything before `seq` succeeded, and `seq` too if Ok.
            let done_below = match &result {
                Ok(()) => seq + 1,
                Err(_) => seq,
            };
            while p.spans.front().is_some_and(|s| s.last_seq < done_below) {
                let s = p.spans.pop_front().expect("front exists");
                acct.finish(s, Ok(()));
            }
            if let Err(reason) = result {
                fail(id, p, acct, reason);
                return true;
            }
        }
        settle(id, p, acct);
        true
    }

    /// Detaches `peer` (its id and address stop working at once), fails its
    /// queued ops now and its in-flight ones once the queue pair flushed
    /// them (the transport moves it to Error: [`Self::take_to_stop`]).
    pub fn disconnect(&mut self, peer: PeerId) {
        let Some(p) = self.peers.get_mut(&peer).filter(|p| !p.detached) else {
            return;
        };
        p.detached = true;
        if self.by_addr.get(&p.addr) == Some(&peer) {
            self.by_addr.remove(&p.addr);
        }
        fail(peer, p, &mut self.acct, "disconnected by this side".into());
    }

    /// Peers whose queue pair must be moved to Error now (a failed
    /// completion, a disconnect). If that fails, destroy the queue pair and
    /// call [`Self::qp_destroyed`].
    pub fn take_to_stop(&mut self) -> Vec<PeerId> {
        std::mem::take(&mut self.acct.to_stop)
    }

    /// The queue pair of `peer` was destroyed: nothing of it runs any more,
    /// every op of it fails now.
    pub fn qp_destroyed(&mut self, peer: PeerId) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        p.qp_gone = true;
        p.window.reset_outstanding();
        fail(
            peer,
            p,
            &mut self.acct,
            "its queue pair was destroyed".into(),
        );
    }

    /// Failed peers whose queue pair has not flushed within [`DRAIN_TIMEOUT`]
    /// of being first seen here: destroy their queue pairs and call
    /// [`Self::qp_destroyed`].
    pub fn overdue(&mut self, now: Instant) -> Vec<PeerId> {
        let mut late = Vec::new();
        for id in &self.acct.draining {
            let Some(p) = self.peers.get_mut(id) else {
                continue;
            };
            let since = *p.drain_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= DRAIN_TIMEOUT {
                late.push(*id);
            }
        }
        late
    }

    /// Detached peers with nothing left in the hardware, removed from the
    /// book: drop their queue pair, then their control-connection guard.
    pub fn take_finished(&mut self) -> Vec<PeerId> {
        let mut out = Vec::new();
        for id in std::mem::take(&mut self.acct.maybe_finished) {
            let Some(p) = self.peers.get(&id) else {
                continue;
            };
            if p.detached && p.spans.is_empty() && p.window.outstanding() == 0 {
                self.by_tag.remove(&p.tag);
                self.peers.remove(&id);
                self.acct.draining.retain(|d| *d != id);
                out.push(id);
            }
        }
        out
    }

    /// Moves up to `max` completions to `out`; returns how many.
    pub fn take_done(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let n = max.min(self.acct.done.len());
        out.extend(self.acct.done.drain(..n));
        self.acct.ops_outstanding -= n;
        n
    }

    /// Whether completions wait for [`Self::take_done`].
    pub fn has_done(&self) -> bool {
        !self.acct.done.is_empty()
    }

    /// The address `peer` was connected to (also while it drains).
    pub fn peer_addr(&self, peer: PeerId) -> Option<&str> {
        self.peers.get(&peer).map(|p| p.addr.as_str())
    }
}

fn post_peer(
    id: PeerId,
    p: &mut PeerBook,
    acct: &mut Acct,
    post: &mut dyn FnMut(PeerId, &Chain, u64) -> Result<(), String>,
) {
    if p.failed.is_some() || p.qp_gone {
        return;
    }
    let base = hw_wr_id(p.tag, 0);
    while let Some(c) = p.queued.front() {
        if !p.window.can_post(c.wrs.len()) {
            return;
        }
        debug_assert_eq!(c.wrs.first().map(|w| w.seq), Some(p.window.next_seq()));
        match post(id, c, base) {
            Ok(()) => {
                let n = c.wrs.len();
                p.queued.pop_front();
                p.window.on_posted(n);
            }
            Err(reason) => {
                p.qp_gone = true;
                p.window.reset_outstanding();
                fail(id, p, acct, format!("posting reads failed: {reason}"));
                return;
            }
        }
    }
}

/// What a client requires of the server's [`QpInfo`]: valid, with a region.
pub fn check_server_info(addr: &str, info: &QpInfo) -> Result<(), TransportError> {
    let bad = |detail: String| TransportError::Protocol {
        addr: addr.to_string(),
        detail,
    };
    info.validate().map_err(|e| bad(e.to_string()))?;
    if info.len == 0 {
        return Err(bad(
            "the memory server's queue-pair info advertises no readable region".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::plan::PlannedWr;
    use std::collections::HashSet;

    const REMOTE_ADDR: u64 = 0x7f00_0000_0000;
    const LOCAL_ADDR: u64 = 0x5500_0000_0000;

    fn limits(doorbell: usize, window: usize, bytes: u32) -> PlanLimits {
        PlanLimits {
            max_wr_per_doorbell: doorbell,
            max_rd_atomic: window,
            max_read_bytes: bytes,
            signal_every: 0,
        }
    }

    fn server(len: u64) -> QpInfo {
        QpInfo {
            qpn: 0x42,
            psn: 7,
            lid: 3,
            gid: [0; 16],
            rkey: 0xbeef,
            addr: REMOTE_ADDR,
            len,
        }
    }

    fn op(wr_id: u64, region: RegionId, off: u64, len: u64) -> ReadOp {
        ReadOp {
            wr_id,
            remote_offset: off,
            len,
            local: region,
            local_offset: off,
        }
    }

    /// A book with one region (`region_len`) and one peer (`remote_len`).
    fn setup(l: PlanLimits, region_len: u64, remote_len: u64) -> (Book, RegionId, PeerId) {
        let mut b = Book::new(l);
        let r = b.add_region(LocalRegion {
            addr: LOCAL_ADDR,
            lkey: 0x11,
            len: region_len,
        });
        let (p, fresh) = b.add_peer("mem-0:7000", server(remote_len)).unwrap();
        assert!(fresh);
        (b, r, p)
    }

    /// Queue pairs as the hardware sees them: posted work requests in order.
    #[derive(Default)]
    struct Sim {
        sq: HashMap<PeerId, VecDeque<PlannedWr>>,
        bases: HashMap<PeerId, u64>,
        window: usize,
        posted_wrs: usize,
        fail_next_post: bool,
    }

    impl Sim {
        fn new(window: usize) -> Self {
            Sim {
                window,
                ..Sim::default()
            }
        }

        fn post(&mut self, b: &mut Book) {
            b.post_all_ready(|id, c, base| {
                if std::mem::take(&mut self.fail_next_post) {
                    self.sq.remove(&id);
                    return Err("ENOMEM".into());
                }
                *self.bases.entry(id).or_insert(base) = base;
                let q = self.sq.entry(id).or_default();
                q.extend(c.wrs.iter().copied());
                assert!(q.len() <= self.window, "window overrun: {}", q.len());
                assert!(c.wrs.last().unwrap().signaled);
                self.posted_wrs += c.wrs.len();
                Ok(())
            });
        }

        fn outstanding(&self, p: PeerId) -> usize {
            self.sq.get(&p).map_or(0, VecDeque::len)
        }

        /// The next `n` work requests of `p` succeed (completions for the signalled ones).
        fn complete(&mut self, b: &mut Book, p: PeerId, n: usize) {
            let base = self.bases[&p];
            let q = self.sq.get_mut(&p).unwrap();
            for _ in 0..n.min(q.len()) {
                let w = q.pop_front().unwrap();
                if w.signaled {
                    assert!(b.on_completion(base + w.seq, Ok(())));
                }
            }
        }

        /// The `k`th outstanding work request of `p` fails; the rest flush
        /// (completions only for the signalled ones, as some drivers do).
        fn fail_at(&mut self, b: &mut Book, p: PeerId, k: usize) {
            self.complete(b, p, k);
            let base = self.bases[&p];
            let q = self.sq.remove(&p).unwrap_or_default();
            for (i, w) in q.into_iter().enumerate() {
                if i == 0 {
                    b.on_completion(base + w.seq, Err("remote access error".into()));
                } else if w.signaled {
                    b.on_completion(base + w.seq, Err("flushed".into()));
                }
            }
        }

        /// Moved to Error: everything outstanding flushes.
        fn flush(&mut self, b: &mut Book, p: PeerId) {
            let base = self.bases.get(&p).copied().unwrap_or(0);
            for w in self.sq.remove(&p).unwrap_or_default() {
                if w.signaled {
                    b.on_completion(base + w.seq, Err("flushed".into()));
                }
            }
        }
    }

    fn take_all(b: &mut Book) -> Vec<Completion> {
        let mut out = Vec::new();
        b.take_done(&mut out, usize::MAX);
        out
    }

    fn ids(c: &[Completion]) -> Vec<u64> {
        c.iter().map(|c| c.wr_id).collect()
    }

    #[test]
    fn a_bad_op_refuses_the_whole_batch() {
        let (mut b, r, p) = setup(limits(4, 8, 100), 1000, 5000);
        let good = op(1, r, 0, 10);
        let cases: Vec<(ReadOp, &str)> = vec![
            (op(2, RegionId(99), 0, 10), "UnknownRegion"),
            (op(2, r, 0, 0), "EmptyRead"),
            (op(2, r, 990, 20), "OutOfBounds"),
            (
                ReadOp {
                    local_offset: u64::MAX,
                    ..op(2, r, 0, 2)
                },
                "OutOfBounds",
            ),
            (
                ReadOp {
                    local_offset: 0,
                    ..op(2, r, 4990, 20)
                },
                "RemoteOutOfRange",
            ),
            (
                ReadOp {
                    local_offset: 0,
                    ..op(2, r, u64::MAX, 2)
                },
                "RemoteOutOfRange",
            ),
        ];
        for (bad, want) in cases {
            let e = b.enqueue(p, &[good, bad]).unwrap_err();
            assert!(format!("{e:?}").starts_with(want), "{e:?} should be {want}");
            assert_eq!(b.ops_outstanding(), 0);
        }
        let e = b.enqueue(PeerId(77), &[good]).unwrap_err();
        assert!(matches!(e, TransportError::UnknownPeer(PeerId(77))));
        // Nothing was accepted: nothing to post, the region is free.
        let mut sim = Sim::new(8);
        sim.post(&mut b);
        assert_eq!(sim.posted_wrs, 0);
        b.remove_region(r).unwrap();
        assert!(matches!(
            b.remove_region(r),
            Err(TransportError::UnknownRegion(_))
        ));
        // An empty batch is fine and does nothing.
        b.enqueue(p, &[]).unwrap();
    }

    #[test]
    fn queue_bounds_ops_and_work_requests() {
        let (mut b, r, p) = setup(limits(8, 8, 100), 1 << 40, 1 << 40);
        let big = INFLIGHT_CHUNKS_MAX as u64 * 100;
        let e = b.enqueue(p, &[op(1, r, 0, big + 1)]).unwrap_err();
        assert!(matches!(e, TransportError::OpTooLarge { .. }), "{e:?}");
        b.enqueue(p, &[op(1, r, 0, big)]).unwrap();
        let e = b.enqueue(p, &[op(2, r, big, 1)]).unwrap_err();
        assert!(matches!(e, TransportError::QueueFull { .. }), "{e:?}");
        // Drain it: 16384 work requests through a window of 8.
        let mut sim = Sim::new(8);
        while b.ops_outstanding() > 0 {
            sim.post(&mut b);
            sim.complete(&mut b, p, 8);
            take_all(&mut b);
        }
        let ops: Vec<ReadOp> = (0..INFLIGHT_OPS_MAX as u64)
            .map(|i| op(i, r, i, 1))
            .collect();
        b.enqueue(p, &ops).unwrap();
        let e = b.enqueue(p, &[op(9, r, 0, 1)]).unwrap_err();
        assert!(matches!(e, TransportError::QueueFull { .. }), "{e:?}");
        // Completed but not yet taken still counts, as in the other transports.
        while sim.posted_wrs < INFLIGHT_CHUNKS_MAX + INFLIGHT_OPS_MAX {
            sim.post(&mut b);
            sim.complete(&mut b, p, 8);
        }
        assert!(b.enqueue(p, &[op(9, r, 0, 1)]).is_err());
        assert_eq!(take_all(&mut b).len(), INFLIGHT_OPS_MAX);
        b.enqueue(p, &[op(9, r, 0, 1)]).unwrap();
    }

    #[test]
    fn chains_are_posted_only_as_the_window_allows() {
        // 3 work requests per op, chains of 2, at most 4 outstanding.
        let (mut b, r, p) = setup(limits(2, 4, 100), 10_000, 10_000);
        let ops: Vec<ReadOp> = (0..10).map(|i| op(100 + i, r, i * 250, 250)).collect();
        b.enqueue(p, &ops).unwrap();
        let mut sim = Sim::new(4);
        sim.post(&mut b);
        assert_eq!(sim.outstanding(p), 4, "two chains fill the window");
        let first: Vec<PlannedWr> = sim.sq[&p].iter().copied().collect();
        assert_eq!(first[0].remote_addr, REMOTE_ADDR);
        assert_eq!(first[0].local_addr, LOCAL_ADDR);
        assert_eq!((first[0].lkey, first[0].rkey), (0x11, 0xbeef));
        assert_eq!(first[2].len, 50, "op 100 is cut 100 + 100 + 50");
        assert_eq!(first[3].remote_addr, REMOTE_ADDR + 250);
        assert_eq!(first[3].local_addr, LOCAL_ADDR + 250);
        assert_eq!(first[3].len, 100);
        // An unsignalled work request completing frees nothing visible.
        sim.complete(&mut b, p, 1);
        sim.post(&mut b);
        assert_eq!(sim.outstanding(p), 3);
        assert!(!b.has_done());
        // The signalled one retires the chain: room for one more chain.
        sim.complete(&mut b, p, 1);
        sim.post(&mut b);
        assert_eq!(sim.outstanding(p), 4);
        assert!(!b.has_done(), "op 100 has a third work request in flight");
        let mut done = Vec::new();
        while done.len() < ops.len() {
            sim.complete(&mut b, p, 2);
            sim.post(&mut b);
            assert!(sim.outstanding(p) <= 4);
            b.take_done(&mut done, 3);
        }
        assert_eq!(ids(&done), (100..110).collect::<Vec<_>>(), "in order, once");
        assert!(done.iter().all(|c| c.result.is_ok()));
        assert_eq!(sim.posted_wrs, 30);
        let s = b.stats();
        assert_eq!((s.bytes_read, s.ops_completed, s.ops_failed), (2500, 10, 0));
        assert_eq!(b.ops_outstanding(), 0);
        b.remove_region(r).unwrap();
    }

    #[test]
    fn hardware_wr_ids_name_the_peer_and_the_work_request() {
        let mut b = Book::new(limits(4, 4, 100));
        let r = b.add_region(LocalRegion {
            addr: LOCAL_ADDR,
            lkey: 1,
            len: 1000,
        });
        let (p1, _) = b.add_peer("a", server(1000)).unwrap();
        let (p2, _) = b.add_peer("b", server(1000)).unwrap();
        assert_ne!(p1, p2);
        b.enqueue(p1, &[op(1, r, 0, 10)]).unwrap();
        b.enqueue(p2, &[op(1, r, 10, 10)]).unwrap();
        let mut sim = Sim::new(4);
        sim.post(&mut b);
        assert_ne!(sim.bases[&p1], sim.bases[&p2]);
        assert_eq!(sim.bases[&p1] & (SEQ_LIMIT - 1), 0);
        // Unknown tags and work requests never posted are ignored.
        assert!(!b.on_completion(0, Ok(())));
        assert!(!b.on_completion(sim.bases[&p1] + 1, Ok(())));
        assert!(!b.has_done());
        sim.complete(&mut b, p2, 1);
        let d = take_all(&mut b);
        assert_eq!(d.len(), 1);
        assert_eq!(b.stats().bytes_read, 10);
        // Callers' wr_ids may repeat: ops are told apart by position.
        b.enqueue(p1, &[op(7, r, 20, 5), op(7, r, 25, 5)]).unwrap();
        sim.post(&mut b);
        sim.complete(&mut b, p1, 3);
        assert_eq!(ids(&take_all(&mut b)), [1, 7, 7]);
    }

    #[test]
    fn an_error_mid_chain_fails_its_op_and_the_rest_exactly_once() {
        // One chain of 8: A = 0..=2, B = 3, C = 4..=6, D = 7; E = 8 stays queued.
        let (mut b, r, p) = setup(limits(8, 8, 100), 10_000, 10_000);
        let ops = [
            op(0xA, r, 0, 250),
            op(0xB, r, 250, 50),
            op(0xC, r, 300, 300),
            op(0xD, r, 600, 100),
            op(0xE, r, 700, 100),
        ];
        b.enqueue(p, &ops).unwrap();
        let mut sim = Sim::new(8);
        sim.post(&mut b);
        assert_eq!(sim.outstanding(p), 8);
        let base = sim.bases[&p];
        // Seq 5 (inside C) fails; the driver flushes seq 7 a little later.
        assert!(b.on_completion(base + 5, Err("remote access error".into())));
        assert_eq!(b.take_to_stop(), [p], "the queue pair is moved to Error");
        let d = take_all(&mut b);
        assert_eq!(ids(&d), [0xA, 0xB, 0xE]);
        assert!(d[0].result.is_ok() && d[1].result.is_ok());
        assert!(d[2].result.is_err(), "never posted: failed at once");
        // C and D have work requests the device may still hold (seqs 6, 7):
        // they are reported once it flushed them.
        assert!(b.remove_region(r).is_err());
        assert_eq!(b.overdue(Instant::now()), Vec::<PeerId>::new());
        b.on_completion(base + 7, Err("flushed".into()));
        let d = take_all(&mut b);
        assert_eq!(ids(&d), [0xC, 0xD]);
        for c in &d {
            match &c.result {
                Err(TransportError::PeerLost { addr, reason }) => {
                    assert_eq!(addr, "mem-0:7000");
                    assert!(reason.contains("remote access error"), "{reason}");
                }
                other => panic!("{other:?}"),
            }
        }
        // Late completions change nothing.
        b.on_completion(base + 6, Err("flushed".into()));
        b.on_completion(base + 7, Ok(()));
        assert!(!b.has_done());
        let s = b.stats();
        assert_eq!((s.ops_completed, s.ops_failed, s.bytes_read), (5, 3, 300));
        b.remove_region(r).unwrap();
        let r = b.add_region(LocalRegion {
            addr: LOCAL_ADDR,
            lkey: 2,
            len: 1000,
        });
        // The lost peer refuses work until replaced.
        let e = b.enqueue(p, &[op(1, r, 0, 1)]).unwrap_err();
        assert!(matches!(e, TransportError::PeerLost { .. }), "{e:?}");
        assert_eq!(b.lookup("mem-0:7000"), None);
        let (p2, fresh) = b.add_peer("mem-0:7000", server(10_000)).unwrap();
        assert!(fresh && p2 != p);
        assert_eq!(b.take_finished(), [p], "the old one drained: drop its QP");
        assert_eq!(b.peer_count(), 1);
        assert!(!b.on_completion(base + 7, Ok(())), "its tag is gone");
        assert!(matches!(
            b.enqueue(p, &[op(1, r, 0, 1)]),
            Err(TransportError::UnknownPeer(_))
        ));
        b.enqueue(p2, &[op(1, r, 0, 1)]).unwrap();
        sim.post(&mut b);
        sim.complete(&mut b, p2, 1);
        assert!(take_all(&mut b)[0].result.is_ok());
    }

    #[test]
    fn an_error_on_the_first_work_request_fails_everything() {
        let (mut b, r, p) = setup(limits(2, 4, 100), 10_000, 10_000);
        let ops: Vec<ReadOp> = (0..6).map(|i| op(i, r, i * 100, 100)).collect();
        b.enqueue(p, &ops).unwrap();
        let mut sim = Sim::new(4);
        sim.post(&mut b);
        sim.fail_at(&mut b, p, 0);
        let d = take_all(&mut b);
        let mut got = ids(&d);
        got.sort_unstable();
        assert_eq!(got, (0..6).collect::<Vec<_>>());
        assert!(d.iter().all(|c| c.result.is_err()));
        assert_eq!(b.stats().ops_failed, 6);
    }

    #[test]
    fn disconnect_fails_queued_ops_now_and_in_flight_ones_after_the_flush() {
        // Window 2: ops 0, 1 in flight, 2, 3 queued.
        let (mut b, r, p) = setup(limits(8, 2, 100), 10_000, 10_000);
        let ops: Vec<ReadOp> = (0..4).map(|i| op(i, r, i * 100, 100)).collect();
        b.enqueue(p, &ops).unwrap();
        let mut sim = Sim::new(2);
        sim.post(&mut b);
        assert_eq!(sim.outstanding(p), 2);
        b.disconnect(p);
        assert_eq!(b.take_to_stop(), [p]);
        let d = take_all(&mut b);
        assert_eq!(ids(&d), [2, 3]);
        assert!(d.iter().all(|c| matches!(
            &c.result,
            Err(TransportError::PeerLost { reason, .. }) if reason.contains("disconnected")
        )));
        assert!(matches!(
            b.enqueue(p, &[op(9, r, 0, 1)]),
            Err(TransportError::UnknownPeer(_))
        ));
        assert_eq!(b.lookup("mem-0:7000"), None);
        assert!(
            b.take_finished().is_empty(),
            "its work is still in the device"
        );
        assert_eq!(b.peer_count(), 1, "a draining queue pair holds its slot");
        // A success that raced the disconnect still fails the op: disconnect fails in-flight ops.
        sim.complete(&mut b, p, 1);
        assert!(!b.has_done());
        sim.flush(&mut b, p);
        let d = take_all(&mut b);
        assert_eq!(ids(&d), [0, 1]);
        assert!(d.iter().all(|c| c.result.is_err()));
        assert_eq!(b.take_finished(), [p]);
        assert_eq!(b.peer_count(), 0);
        b.disconnect(p); // again: nothing
        assert!(b.take_to_stop().is_empty());
        b.remove_region(r).unwrap();
    }

    #[test]
    fn disconnect_of_an_idle_peer_finishes_at_once() {
        let (mut b, _, p) = setup(limits(8, 2, 100), 10_000, 10_000);
        b.disconnect(p);
        assert_eq!(b.take_to_stop(), [p]);
        assert_eq!(b.take_finished(), [p], "nothing to flush: done at once");
        let (p2, fresh) = b.add_peer("mem-0:7000", server(100)).unwrap();
        assert!(fresh && p2 != p);
    }

    #[test]
    fn a_queue_pair_that_never_flushes_is_destroyed_after_the_timeout() {
        let (mut b, r, p) = setup(limits(8, 4, 100), 10_000, 10_000);
        b.enqueue(p, &[op(1, r, 0, 100), op(2, r, 100, 100)])
            .unwrap();
        let mut sim = Sim::new(4);
        sim.post(&mut b);
        b.disconnect(p);
        let t0 = Instant::now();
        assert!(b.overdue(t0).is_empty());
        assert!(b.overdue(t0 + DRAIN_TIMEOUT / 2).is_empty());
        assert_eq!(b.overdue(t0 + DRAIN_TIMEOUT), [p]);
        assert!(!b.has_done());
        b.qp_destroyed(p);
        assert_eq!(ids(&take_all(&mut b)), [1, 2]);
        assert!(b.overdue(t0 + DRAIN_TIMEOUT * 2).is_empty());
        assert_eq!(b.take_finished(), [p]);
        assert!(!b.on_completion(sim.bases[&p] + 1, Err("flushed".into())));
    }

    #[test]
    fn a_failed_post_fails_every_op_of_the_peer() {
        let (mut b, r, p) = setup(limits(2, 4, 100), 10_000, 10_000);
        let ops: Vec<ReadOp> = (0..6).map(|i| op(i, r, i * 100, 100)).collect();
        b.enqueue(p, &ops).unwrap();
        let mut sim = Sim::new(4);
        sim.fail_next_post = true;
        sim.post(&mut b);
        assert!(
            b.take_to_stop().is_empty(),
            "the poster destroyed the queue pair"
        );
        let d = take_all(&mut b);
        assert_eq!(ids(&d), (0..6).collect::<Vec<_>>());
        assert!(d.iter().all(|c| matches!(
            &c.result,
            Err(TransportError::PeerLost { reason, .. }) if reason.contains("posting reads failed: ENOMEM")
        )));
        assert!(matches!(
            b.enqueue(p, &ops[..1]),
            Err(TransportError::PeerLost { .. })
        ));
    }

    #[test]
    fn peers_are_bounded_and_server_info_checked() {
        let mut b = Book::new(limits(8, 8, 100));
        let mut ids = Vec::new();
        for i in 0..PEERS_MAX {
            let (id, fresh) = b.add_peer(&format!("m{i}"), server(100)).unwrap();
            assert!(fresh);
            ids.push(id);
        }
        assert_eq!(b.add_peer("m0", server(100)).unwrap(), (ids[0], false));
        let e = b.add_peer("extra", server(100)).unwrap_err().to_string();
        assert!(e.contains("PEERS_MAX = 256") && e.contains("extra"), "{e}");
        assert!(b.check_room("extra").is_err());
        b.disconnect(ids[5]);
        assert_eq!(b.take_finished(), [ids[5]]);
        b.check_room("extra").unwrap();
        let (id, _) = b.add_peer("extra", server(100)).unwrap();
        assert!(!ids.contains(&id), "ids are not reused");
        let empty = QpInfo {
            rkey: 0,
            addr: 0,
            len: 0,
            ..server(0)
        };
        let e = b.add_peer("empty", empty).unwrap_err().to_string();
        assert!(e.contains("no readable region"), "{e}");
        let bad = QpInfo {
            qpn: 1,
            ..server(100)
        };
        assert!(check_server_info("x", &bad).is_err());
    }

    #[test]
    fn regions_are_busy_while_ops_into_them_are_unreported() {
        let (mut b, r, p) = setup(limits(8, 8, 100), 1000, 1000);
        b.enqueue(p, &[op(1, r, 0, 10)]).unwrap();
        assert!(matches!(b.remove_region(r), Err(TransportError::Busy(_))));
        let mut sim = Sim::new(8);
        sim.post(&mut b);
        sim.complete(&mut b, p, 1);
        // Reported (queued for poll): the device is done with the memory.
        b.remove_region(r).unwrap();
        assert_eq!(take_all(&mut b).len(), 1);
    }

    /// Random batches, progress, errors, disconnects and reconnects on
    /// several peers: every accepted op is reported exactly once, windows
    /// hold, counters add up.
    #[test]
    fn random_schedules_report_every_op_exactly_once() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let (mut total_ok, mut total_failed) = (0u64, 0u64);
        for round in 0..40 {
            let window = 1 + rnd(8) as usize;
            let l = limits(1 + rnd(6) as usize, window, 1 + rnd(300) as u32);
            let mut b = Book::new(l);
            let r = b.add_region(LocalRegion {
                addr: LOCAL_ADDR,
                lkey: 5,
                len: 1 << 20,
            });
            let addrs = ["a", "b", "c"];
            let mut sim = Sim::new(window);
            let mut accepted: HashSet<u64> = HashSet::new();
            let mut reported: HashSet<u64> = HashSet::new();
            let mut next_id = 0u64;
            let mut out = Vec::new();
            let mut ok_bytes = 0u64;
            let mut lens: HashMap<u64, u64> = HashMap::new();
            for _step in 0..400 {
                let a = addrs[rnd(3) as usize];
                match rnd(10) {
                    0..=3 => {
                        let peer = match b.lookup(a) {
                            Some(p) => p,
                            None => match b.add_peer(a, server(1 << 20)) {
                                Ok((p, _)) => p,
                                Err(_) => continue,
                            },
                        };
                        let n = 1 + rnd(6);
                        let ops: Vec<ReadOp> = (0..n)
                            .map(|_| {
                                next_id += 1;
                                let len = 1 + rnd(1000);
                                lens.insert(next_id, len);
                                op(next_id, r, rnd(1 << 19), len)
                            })
                            .collect();
                        if b.enqueue(peer, &ops).is_ok() {
                            accepted.extend(ops.iter().map(|o| o.wr_id));
                        }
                    }
                    4..=6 => {
                        let peers: Vec<PeerId> = sim.sq.keys().copied().collect();
                        if let Some(&p) = peers.get(rnd(peers.len().max(1) as u64) as usize) {
                            let n = rnd(window as u64 + 1) as usize;
                            sim.complete(&mut b, p, n);
                        }
                    }
                    7 => {
                        let peers: Vec<PeerId> = sim.sq.keys().copied().collect();
                        if let Some(&p) = peers.get(rnd(peers.len().max(1) as u64) as usize) {
                            let k = rnd(sim.outstanding(p) as u64 + 1) as usize;
                            if k < sim.outstanding(p) {
                                sim.fail_at(&mut b, p, k);
                            }
                        }
                    }
                    8 => {
                        if let Some(p) = b.by_addr.get(a).copied() {
                            b.disconnect(p);
                        }
                    }
                    _ => sim.fail_next_post = rnd(4) == 0,
                }
                sim.post(&mut b);
                for p in b.take_to_stop() {
                    // Moved to Error: it flushes now or (sometimes) never.
                    if rnd(5) == 0 {
                        sim.sq.remove(&p);
                    } else {
                        sim.flush(&mut b, p);
                    }
                }
                let later = Instant::now() + DRAIN_TIMEOUT * 2;
                b.overdue(Instant::now());
                for p in b.overdue(later) {
                    sim.sq.remove(&p);
                    b.qp_destroyed(p);
                }
                for p in b.take_finished() {
                    assert_eq!(
                        sim.outstanding(p),
                        0,
                        "a finished peer has nothing in the device"
                    );
                    sim.sq.remove(&p);
                }
                out.clear();
                b.take_done(&mut out, 1 + rnd(8) as usize);
                for c in &out {
                    assert!(
                        accepted.contains(&c.wr_id),
                        "round {round}: unknown {}",
                        c.wr_id
                    );
                    assert!(reported.insert(c.wr_id), "round {round}: {} twice", c.wr_id);
                    if c.result.is_ok() {
                        ok_bytes += lens[&c.wr_id];
                    }
                }
            }
            // Wind down: finish everything in the device, disconnect all.
            for a in addrs {
                if let Some(p) = b.by_addr.get(a).copied() {
                    b.disconnect(p);
                }
            }
            for _ in 0..3 {
                sim.post(&mut b);
                for p in b.take_to_stop() {
                    sim.flush(&mut b, p);
                }
                let peers: Vec<PeerId> = sim.sq.keys().copied().collect();
                for p in peers {
                    sim.flush(&mut b, p);
                }
                let later = Instant::now() + DRAIN_TIMEOUT * 2;
                b.overdue(Instant::now());
                for p in b.overdue(later) {
                    b.qp_destroyed(p);
                }
                b.take_finished();
            }
            out.clear();
            b.take_done(&mut out, usize::MAX);
            for c in &out {
                assert!(reported.insert(c.wr_id), "round {round}: {} twice", c.wr_id);
                if c.result.is_ok() {
                    ok_bytes += lens[&c.wr_id];
                }
            }
            assert_eq!(reported, accepted, "round {round}: every op reported");
            assert_eq!(b.ops_outstanding(), 0);
            assert_eq!(b.acct.wrs_outstanding, 0);
            assert_eq!(b.peer_count(), 0, "round {round}: every peer finished");
            let s = b.stats();
            assert_eq!(s.ops_completed, accepted.len() as u64);
            assert_eq!(s.bytes_read, ok_bytes);
            total_ok += s.ops_completed - s.ops_failed;
            total_failed += s.ops_failed;
            b.remove_region(r).unwrap();
        }
        assert!(
            total_ok > 1000 && total_failed > 1000,
            "{total_ok} ok, {total_failed} failed"
        );
    }
}
