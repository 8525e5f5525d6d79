//! [`Fallback`]: a one-sided transport (libfabric, verbs) with tcp for the
//! memory servers that do not serve it, where settings allow that.
//!
//! Every buffer is registered with both transports; each peer is connected
//! through the primary first and, only when that fails with
//! [`TransportError::NotOffered`] (the memory server does not serve the
//! primary's data path) and fallback is allowed, through the fallback,
//! logged at warn level with the reason. Later calls on that peer go to the
//! transport that connected it; `wr_id`s pass through unchanged. With
//! fallback off, the primary's error is returned as it is.
//!
//! The wrapped transports keep their own bounds; one lock guards the id
//! maps and is taken once per call, never per op.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{
    Completion, HostBuffer, PeerId, ReadOp, RegionId, Transport, TransportError, TransportStats,
};

/// How long `poll` waits on one transport before looking at the other, when
/// both have peers.
const POLL_SLICE: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Primary,
    Fallback,
}

struct Region {
    buf: Arc<HostBuffer>,
    primary: RegionId,
    fallback: RegionId,
}

#[derive(Default)]
struct State {
    regions: HashMap<u32, Region>,
    next_region: u32,
    peers: HashMap<u32, (Side, PeerId)>,
    next_peer: u32,
    /// Peers connected through the fallback, now or before (poll looks there).
    fallback_used: bool,
}

pub struct Fallback {
    primary: Arc<dyn Transport>,
    fallback: Arc<dyn Transport>,
    allow: bool,
    state: Mutex<State>,
}

impl Fallback {
    /// `allow`: whether a peer that does not serve the primary's data path
    /// may be read through `fallback`.
    pub fn new(primary: Arc<dyn Transport>, fallback: Arc<dyn Transport>, allow: bool) -> Self {
        Fallback {
            primary,
            fallback,
            allow,
            state: Mutex::new(State {
                next_region: 1,
                next_peer: 1,
                ..State::default()
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn side(&self, s: Side) -> &dyn Transport {
        match s {
            Side::Primary => &*self.primary,
            Side::Fallback => &*self.fallback,
        }
    }

    /// The transport a peer was connected through (`None`: unknown peer).
    pub fn route(&self, peer: PeerId) -> Option<&'static str> {
        let st = self.lock();
        st.peers.get(&peer.0).map(|(s, _)| self.side(*s).name())
    }
}

impl Transport for Fallback {
    fn name(&self) -> &'static str {
        self.primary.name()
    }

    fn register(&self, buf: Arc<HostBuffer>) -> Result<RegionId, TransportError> {
        let primary = self.primary.register(buf.clone())?;
        let fallback = match self.fallback.register(buf.clone()) {
            Ok(r) => r,
            Err(e) => {
                let _ = self.primary.deregister(primary);
                return Err(e);
            }
        };
        let mut st = self.lock();
        let id = st.next_region;
        st.next_region += 1;
        st.regions.insert(
            id,
            Region {
                buf,
                primary,
                fallback,
            },
        );
        Ok(RegionId(id))
    }

    fn deregister(&self, region: RegionId) -> Result<(), TransportError> {
        let mut st = self.lock();
        let r = st
            .regions
            .get(&region.0)
            .ok_or(TransportError::UnknownRegion(region))?;
        let (p, f, buf) = (r.primary, r.fallback, r.buf.clone());
        match self.primary.deregister(p) {
            Err(TransportError::Busy(_)) => return Err(TransportError::Busy(region)),
            r => r?,
        }
        match self.fallback.deregister(f) {
            Ok(()) => {
                st.regions.remove(&region.0);
                Ok(())
            }
            Err(e) => {
                // Keep the region whole: register it with the primary again.
                let p = self.primary.register(buf)?;
                st.regions.get_mut(&region.0).expect("present").primary = p;
                Err(match e {
                    TransportError::Busy(_) => TransportError::Busy(region),
                    e => e,
                })
            }
        }
    }

    fn connect(&self, peer_addr: &str) -> Result<PeerId, TransportError> {
        let (side, inner) = match self.primary.connect(peer_addr) {
            Ok(p) => (Side::Primary, p),
            Err(e @ TransportError::NotOffered { .. }) if self.allow => {
                log::warn!(
                    "{e}; reading {peer_addr} over {} instead (settings allow the fallback)",
                    self.fallback.name()
                );
                (Side::Fallback, self.fallback.connect(peer_addr)?)
            }
            Err(e) => return Err(e),
        };
        let mut st = self.lock();
        if let Some((id, _)) = st.peers.iter().find(|(_, v)| **v == (side, inner)) {
            return Ok(PeerId(*id));
        }
        let id = st.next_peer;
        st.next_peer += 1;
        st.peers.insert(id, (side, inner));
        st.fallback_used |= side == Side::Fallback;
        Ok(PeerId(id))
    }

    fn disconnect(&self, peer: PeerId) {
        let gone = self.lock().peers.remove(&peer.0);
        if let Some((side, inner)) = gone {
            self.side(side).disconnect(inner);
        }
    }

    unsafe fn post_reads(&self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError> {
        let st = self.lock();
        let &(side, inner) = st
            .peers
            .get(&peer.0)
            .ok_or(TransportError::UnknownPeer(peer))?;
        // Translate region ids into the side's; one small copy per batch.
        let mut mapped = Vec::with_capacity(ops.len());
        for op in ops {
            let r = st
                .regions
                .get(&op.local.0)
                .ok_or(TransportError::UnknownRegion(op.local))?;
            let local = match side {
                Side::Primary => r.primary,
                Side::Fallback => r.fallback,
            };
            mapped.push(ReadOp { local, ..*op });
        }
        drop(st);
        // SAFETY: the caller's contract for `ops` carries over unchanged.
        unsafe { self.side(side).post_reads(inner, &mapped) }.map_err(|e| match e {
            TransportError::UnknownRegion(r) => {
                let st = self.lock();
                let ours = st
                    .regions
                    .iter()
                    .find(|(_, v)| v.primary == r || v.fallback == r)
                    .map_or(r, |(id, _)| RegionId(*id));
                TransportError::UnknownRegion(ours)
            }
            e => e,
        })
    }

    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, TransportError> {
        if !self.lock().fallback_used {
            return self.primary.poll(out, max, timeout);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let mut got = self.primary.poll(out, max, Duration::ZERO)?;
            if got < max {
                let wait = POLL_SLICE.min(deadline.saturating_duration_since(Instant::now()));
                got += self.fallback.poll(out, max - got, wait)?;
            }
            if got > 0 || Instant::now() >= deadline {
                return Ok(got);
            }
        }
    }

    fn stats(&self) -> TransportStats {
        let (a, b) = (self.primary.stats(), self.fallback.stats());
        TransportStats {
            bytes_read: a.bytes_read + b.bytes_read,
            ops_completed: a.ops_completed + b.ops_completed,
            ops_failed: a.ops_failed + b.ops_failed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{MemFabric, MemTransport};
    use crate::{read_blocking, HugePages};

    /// A primary that serves only some memory servers, like a libfabric
    /// transport in a cluster where not every memory server runs a provider.
    struct Picky {
        inner: MemTransport,
        /// `None`: serves every memory server.
        serves: Option<&'static [&'static str]>,
        /// Deregistering answers Busy while set.
        busy: std::sync::atomic::AtomicBool,
    }

    impl Picky {
        fn new(fabric: MemFabric, serves: Option<&'static [&'static str]>) -> Self {
            Picky {
                inner: MemTransport::new(fabric),
                serves,
                busy: Default::default(),
            }
        }
    }

    impl Transport for Picky {
        fn name(&self) -> &'static str {
            "picky"
        }
        fn register(&self, buf: Arc<HostBuffer>) -> Result<RegionId, TransportError> {
            self.inner.register(buf)
        }
        fn deregister(&self, region: RegionId) -> Result<(), TransportError> {
            if self.busy.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(TransportError::Busy(region));
            }
            self.inner.deregister(region)
        }
        fn connect(&self, addr: &str) -> Result<PeerId, TransportError> {
            if self.serves.is_none_or(|s| s.contains(&addr)) {
                self.inner.connect(addr)
            } else {
                Err(TransportError::NotOffered {
                    addr: addr.into(),
                    detail: "no provider".into(),
                })
            }
        }
        fn disconnect(&self, peer: PeerId) {
            self.inner.disconnect(peer)
        }
        unsafe fn post_reads(&self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError> {
            // SAFETY: forwarded contract.
            unsafe { self.inner.post_reads(peer, ops) }
        }
        fn poll(
            &self,
            out: &mut Vec<Completion>,
            max: usize,
            timeout: Duration,
        ) -> Result<usize, TransportError> {
            self.inner.poll(out, max, timeout)
        }
        fn stats(&self) -> TransportStats {
            self.inner.stats()
        }
    }

    fn arena(fill: u8) -> Arc<HostBuffer> {
        let mut b = HostBuffer::new(1 << 16, HugePages::No).unwrap();
        b.as_mut_slice().fill(fill);
        Arc::new(b)
    }

    fn setup(allow: bool) -> (Fallback, Arc<Picky>, Arc<Picky>) {
        let fabric = MemFabric::new();
        fabric.add_peer("fast:1", arena(0xAA));
        fabric.add_peer("slow:1", arena(0x55));
        let primary = Arc::new(Picky::new(fabric.clone(), Some(&["fast:1"])));
        let tcp = Arc::new(Picky::new(fabric, None));
        (
            Fallback::new(primary.clone(), tcp.clone(), allow),
            primary,
            tcp,
        )
    }

    fn op(wr_id: u64, local: RegionId, local_offset: u64) -> ReadOp {
        ReadOp {
            wr_id,
            remote_offset: 0,
            len: 4096,
            local,
            local_offset,
        }
    }

    #[test]
    fn peers_without_the_primary_path_are_read_over_the_fallback() {
        let (t, primary, tcp) = setup(true);
        let dst = Arc::new(HostBuffer::new(8192, HugePages::No).unwrap());
        let r = t.register(dst.clone()).unwrap();
        let fast = t.connect("fast:1").unwrap();
        let slow = t.connect("slow:1").unwrap();
        assert_eq!(t.connect("slow:1").unwrap(), slow, "idempotent");
        assert_eq!(t.route(fast), Some("picky"));
        assert_eq!(t.route(slow), Some("picky"));
        // SAFETY: disjoint ranges, dst untouched until the reads complete.
        unsafe {
            read_blocking(&t, fast, &[op(1, r, 0)]).unwrap();
            read_blocking(&t, slow, &[op(2, r, 4096)]).unwrap();
        }
        // SAFETY: no reads in flight.
        let got = unsafe { dst.slice(0..8192) };
        assert!(got[..4096].iter().all(|&b| b == 0xAA));
        assert!(got[4096..].iter().all(|&b| b == 0x55));
        assert_eq!(primary.stats().bytes_read, 4096);
        assert_eq!(tcp.stats().bytes_read, 4096);
        assert_eq!(t.stats().bytes_read, 8192);
        assert_eq!(t.stats().ops_completed, 2);
        t.disconnect(slow);
        // SAFETY: as above.
        let e = unsafe { t.post_reads(slow, &[op(3, r, 0)]) }.unwrap_err();
        assert!(
            matches!(e, TransportError::UnknownPeer(p) if p == slow),
            "{e}"
        );
        t.deregister(r).unwrap();
        assert!(matches!(
            t.deregister(r),
            Err(TransportError::UnknownRegion(x)) if x == r
        ));
    }

    #[test]
    fn without_permission_the_primary_error_stands() {
        let (t, _, _) = setup(false);
        let e = t.connect("slow:1").unwrap_err();
        assert!(
            matches!(&e, TransportError::NotOffered { addr, .. } if addr == "slow:1"),
            "{e}"
        );
        assert!(t.connect("fast:1").is_ok());
    }

    #[test]
    fn a_busy_region_stays_registered_on_both_sides() {
        let (t, _, tcp) = setup(true);
        let dst = Arc::new(HostBuffer::new(8192, HugePages::No).unwrap());
        let r = t.register(dst.clone()).unwrap();
        tcp.busy.store(true, std::sync::atomic::Ordering::Relaxed);
        // The primary lets go, the fallback refuses: the primary registers again.
        assert!(matches!(t.deregister(r), Err(TransportError::Busy(x)) if x == r));
        tcp.busy.store(false, std::sync::atomic::Ordering::Relaxed);
        let fast = t.connect("fast:1").unwrap();
        // SAFETY: nobody else touches the buffer until the read completed.
        unsafe { read_blocking(&t, fast, &[op(8, r, 4096)]) }.unwrap();
        // SAFETY: no reads in flight.
        assert!(unsafe { dst.slice(4096..8192) }.iter().all(|&b| b == 0xAA));
        t.deregister(r).unwrap();
    }
}
