//! An in-memory [`Transport`] for unit tests of callers.
//!
//! A [`MemFabric`] holds named "remote" arenas standing in for memory
//! servers; [`MemTransport`] reads from them by copying bytes, inline in
//! `post_reads`, and reports through the same bounded completion queue and
//! `poll` as the real transports. Faults are injected per peer with
//! [`MemFabric::fail_peer`], so replica and recovery logic can be tested.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::completion::{CompletionQueue, Regions, Target};
use crate::{
    Completion, HostBuffer, PeerId, ReadOp, RegionId, Transport, TransportError, TransportStats,
};

struct FabricPeer {
    arena: Arc<HostBuffer>,
    failed: AtomicBool,
}

/// Named remote arenas; clones share them.
#[derive(Clone, Default)]
pub struct MemFabric {
    peers: Arc<Mutex<HashMap<String, Arc<FabricPeer>>>>,
}

impl MemFabric {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the arena served under `name`, the address that
    /// `connect` takes. Whoever fills the arena must be done writing the
    /// ranges that are read, as with a real memory server's extents.
    pub fn add_peer(&self, name: &str, arena: Arc<HostBuffer>) {
        let p = Arc::new(FabricPeer {
            arena,
            failed: AtomicBool::new(false),
        });
        self.peers.lock().unwrap().insert(name.to_owned(), p);
    }

    /// From now on reads from `name` complete with `PeerLost` (and connects fail).
    pub fn fail_peer(&self, name: &str) {
        self.set_failed(name, true);
    }

    /// Undoes [`MemFabric::fail_peer`].
    pub fn heal_peer(&self, name: &str) {
        self.set_failed(name, false);
    }

    fn set_failed(&self, name: &str, failed: bool) {
        let peers = self.peers.lock().unwrap();
        let p = peers
            .get(name)
            .unwrap_or_else(|| panic!("no peer {name:?} on this fabric"));
        p.failed.store(failed, Ordering::Release);
    }

    fn get(&self, name: &str) -> Option<Arc<FabricPeer>> {
        self.peers.lock().unwrap().get(name).cloned()
    }
}

struct MemPeer {
    addr: String,
    peer: Arc<FabricPeer>,
}

/// The in-memory transport. Chunks do not exist here: an op is one copy.
pub struct MemTransport {
    fabric: MemFabric,
    regions: Regions,
    cq: CompletionQueue,
    peers: Mutex<(u32, HashMap<u32, MemPeer>)>,
}

impl MemTransport {
    pub fn new(fabric: MemFabric) -> Self {
        MemTransport {
            fabric,
            regions: Regions::default(),
            cq: CompletionQueue::new(),
            peers: Mutex::new((0, HashMap::new())),
        }
    }

    fn read_one(
        addr: &str,
        peer: &FabricPeer,
        op: &ReadOp,
        target: &Target,
    ) -> Result<(), TransportError> {
        if peer.failed.load(Ordering::Acquire) {
            return Err(TransportError::PeerLost {
                addr: addr.to_owned(),
                reason: "fault injected".into(),
            });
        }
        let arena_len = peer.arena.len() as u64;
        if op
            .remote_offset
            .checked_add(op.len)
            .is_none_or(|end| end > arena_len)
        {
            return Err(TransportError::RemoteOutOfRange {
                addr: addr.to_owned(),
                offset: op.remote_offset,
                len: op.len,
            });
        }
        // SAFETY: both ranges are in bounds (remote checked just above, local
        // by `Regions::validate`); post_reads' caller guarantees no one else
        // touches the local range, and the fabric's contract that no one
        // writes the remote range while it is read. `ptr::copy` tolerates the
        // two ranges overlapping when a test reads an arena into itself.
        unsafe {
            std::ptr::copy(
                peer.arena.as_ptr().add(op.remote_offset as usize),
                target.buf.as_ptr().add(op.local_offset as usize),
                op.len as usize,
            );
        }
        Ok(())
    }
}

impl Transport for MemTransport {
    fn name(&self) -> &'static str {
        "mem"
    }

    fn register(&self, buf: Arc<HostBuffer>) -> Result<RegionId, TransportError> {
        Ok(self.regions.register(buf))
    }

    fn deregister(&self, region: RegionId) -> Result<(), TransportError> {
        self.regions.deregister(region)
    }

    fn connect(&self, peer_addr: &str) -> Result<PeerId, TransportError> {
        let refused = |what: &str| TransportError::Connect {
            addr: peer_addr.to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::ConnectionRefused, what.to_owned()),
        };
        let fp = self
            .fabric
            .get(peer_addr)
            .ok_or_else(|| refused("no such peer on the fabric"))?;
        if fp.failed.load(Ordering::Acquire) {
            return Err(refused("peer failed (fault injected)"));
        }
        let mut g = self.peers.lock().unwrap();
        if let Some((id, _)) =
            g.1.iter()
                .find(|(_, p)| p.addr == peer_addr && Arc::ptr_eq(&p.peer, &fp))
        {
            return Ok(PeerId(*id));
        }
        g.0 += 1;
        let id = g.0;
        g.1.insert(
            id,
            MemPeer {
                addr: peer_addr.to_owned(),
                peer: fp,
            },
        );
        Ok(PeerId(id))
    }

    fn disconnect(&self, peer: PeerId) {
        self.peers.lock().unwrap().1.remove(&peer.0);
    }

    unsafe fn post_reads(&self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError> {
        let (addr, fp) = {
            let g = self.peers.lock().unwrap();
            let p = g.1.get(&peer.0).ok_or(TransportError::UnknownPeer(peer))?;
            (p.addr.clone(), p.peer.clone())
        };
        let mut targets = Vec::with_capacity(ops.len());
        // An op is one "chunk" here.
        self.regions
            .validate(ops, u64::MAX, &self.cq, &mut targets)?;
        for (op, t) in ops.iter().zip(&targets) {
            let result = Self::read_one(&addr, &fp, op, t);
            if result.is_ok() {
                self.cq.add_bytes(op.len);
            }
            self.cq.complete(op.wr_id, 1, result, &t.region_inflight);
        }
        Ok(())
    }

    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, TransportError> {
        Ok(self.cq.poll(out, max, timeout))
    }

    fn stats(&self) -> TransportStats {
        self.cq.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{read_blocking, HugePages, INFLIGHT_OPS_MAX};

    fn filled(len: usize, seed: u8) -> Arc<HostBuffer> {
        let b = HostBuffer::new(len, HugePages::No).unwrap();
        // SAFETY: the buffer is not shared yet.
        let s = unsafe { b.slice_mut(0..len) };
        for (i, x) in s.iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        Arc::new(b)
    }

    fn op(wr_id: u64, remote_offset: u64, len: u64, local: RegionId, local_offset: u64) -> ReadOp {
        ReadOp {
            wr_id,
            remote_offset,
            len,
            local,
            local_offset,
        }
    }

    #[test]
    fn reads_copy_bytes_and_complete_through_poll() {
        let fabric = MemFabric::new();
        let remote = filled(1 << 20, 3);
        fabric.add_peer("ms1", remote.clone());
        let t = MemTransport::new(fabric);
        let local = Arc::new(HostBuffer::new(1 << 20, HugePages::No).unwrap());
        let r = t.register(local.clone()).unwrap();
        let p = t.connect("ms1").unwrap();
        assert_eq!(t.connect("ms1").unwrap(), p);
        let ops = [op(1, 100, 1000, r, 0), op(2, 0, 4096, r, 8192)];
        // SAFETY: nothing else touches `local` during the call.
        unsafe { t.post_reads(p, &ops).unwrap() };
        let mut out = Vec::new();
        assert_eq!(t.poll(&mut out, 10, Duration::from_secs(1)).unwrap(), 2);
        assert!(out.iter().all(|c| c.result.is_ok()));
        // SAFETY: all reads completed; no writers remain.
        unsafe {
            assert_eq!(local.slice(0..1000), remote.slice(100..1100));
            assert_eq!(local.slice(8192..8192 + 4096), remote.slice(0..4096));
        }
        assert_eq!(
            t.stats(),
            TransportStats {
                bytes_read: 5096,
                ops_completed: 2,
                ops_failed: 0
            }
        );
        t.deregister(r).unwrap();
    }

    #[test]
    fn validation_errors_post_nothing() {
        let fabric = MemFabric::new();
        fabric.add_peer("ms1", filled(4096, 0));
        let t = MemTransport::new(fabric);
        let r = t
            .register(Arc::new(HostBuffer::new(4096, HugePages::No).unwrap()))
            .unwrap();
        let p = t.connect("ms1").unwrap();
        // SAFETY (all posts below): nothing else touches the local buffer.
        let e = unsafe { t.post_reads(PeerId(77), &[op(1, 0, 1, r, 0)]) }.unwrap_err();
        assert!(matches!(e, TransportError::UnknownPeer(PeerId(77))));
        let e =
            unsafe { t.post_reads(p, &[op(1, 0, 10, r, 0), op(2, 0, 10, r, 4090)]) }.unwrap_err();
        assert!(
            matches!(e, TransportError::OutOfBounds { wr_id: 2, .. }),
            "{e}"
        );
        let e = unsafe { t.post_reads(p, &[op(3, 0, 0, r, 0)]) }.unwrap_err();
        assert!(matches!(e, TransportError::EmptyRead { wr_id: 3 }));
        let mut out = Vec::new();
        assert_eq!(t.poll(&mut out, 10, Duration::from_millis(10)).unwrap(), 0);
        assert!(
            matches!(t.connect("nope"), Err(TransportError::Connect { addr, .. }) if addr == "nope")
        );
    }

    #[test]
    fn fault_injection_fails_reads_with_peer_lost() {
        let fabric = MemFabric::new();
        fabric.add_peer("ms1", filled(4096, 0));
        fabric.add_peer("ms2", filled(4096, 9));
        let t = MemTransport::new(fabric.clone());
        let local = Arc::new(HostBuffer::new(8192, HugePages::No).unwrap());
        let r = t.register(local.clone()).unwrap();
        let p1 = t.connect("ms1").unwrap();
        let p2 = t.connect("ms2").unwrap();
        fabric.fail_peer("ms1");
        // SAFETY (both calls): nothing else touches `local`.
        let e = unsafe { read_blocking(&t, p1, &[op(1, 0, 4096, r, 0)]) }.unwrap_err();
        assert!(
            matches!(&e, TransportError::PeerLost { addr, .. } if addr == "ms1"),
            "{e}"
        );
        unsafe { read_blocking(&t, p2, &[op(2, 0, 4096, r, 4096)]) }.unwrap();
        let e = unsafe { read_blocking(&t, p2, &[op(3, 4000, 200, r, 0)]) }.unwrap_err();
        assert!(matches!(
            e,
            TransportError::RemoteOutOfRange {
                offset: 4000,
                len: 200,
                ..
            }
        ));
        assert!(t.connect("ms1").is_err());
        fabric.heal_peer("ms1");
        unsafe { read_blocking(&t, p1, &[op(4, 0, 4096, r, 0)]) }.unwrap();
        assert_eq!(t.stats().ops_failed, 2);
    }

    #[test]
    fn queue_full_until_polled_and_read_blocking_backs_off() {
        let fabric = MemFabric::new();
        fabric.add_peer("ms1", filled(1 << 16, 1));
        let t = MemTransport::new(fabric);
        let local = Arc::new(HostBuffer::new(INFLIGHT_OPS_MAX * 16 + 16, HugePages::No).unwrap());
        let r = t.register(local.clone()).unwrap();
        let p = t.connect("ms1").unwrap();
        let ops: Vec<_> = (0..INFLIGHT_OPS_MAX as u64 + 1)
            .map(|i| op(i, i % 4096, 16, r, i * 16))
            .collect();
        // SAFETY (all calls): the ops' local ranges are disjoint and nothing else touches `local`.
        unsafe { t.post_reads(p, &ops[..INFLIGHT_OPS_MAX]).unwrap() };
        let e = unsafe { t.post_reads(p, &ops[INFLIGHT_OPS_MAX..]) }.unwrap_err();
        assert!(matches!(e, TransportError::QueueFull { .. }));
        let mut out = Vec::new();
        assert_eq!(
            t.poll(&mut out, usize::MAX, Duration::ZERO).unwrap(),
            INFLIGHT_OPS_MAX
        );
        // More ops than the bound, through the helper.
        let many: Vec<_> = (0..INFLIGHT_OPS_MAX as u64 + 1)
            .map(|i| op(i, 0, 16, r, i * 16))
            .collect();
        unsafe { read_blocking(&t, p, &many).unwrap() };
        t.deregister(r).unwrap();
    }
}
