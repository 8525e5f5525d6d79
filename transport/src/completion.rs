//! Pieces every transport shares: the registered-region table, the bounded
//! completion queue with its in-flight accounting, batch validation, and the
//! chunking of ops.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender};

use crate::{
    Completion, HostBuffer, ReadOp, RegionId, TransportError, TransportStats, INFLIGHT_CHUNKS_MAX,
    INFLIGHT_OPS_MAX,
};

/// How many `chunk_bytes` pieces an op of `len` bytes is cut into.
pub fn chunk_count(len: u64, chunk_bytes: u64) -> u64 {
    assert!(chunk_bytes > 0, "chunk_bytes must be positive");
    len.div_ceil(chunk_bytes)
}

/// Checks one op against its local region (`region_len` bytes), the
/// remote range the peer serves (`remote`: its address and length, where
/// the transport knows it) and the chunk bound; returns its chunk count.
/// Every transport validates a batch with this before posting any of it.
pub(crate) fn check_op(
    op: &ReadOp,
    region_len: u64,
    remote: Option<(&str, u64)>,
    chunk_bytes: u64,
) -> Result<u64, TransportError> {
    if op.len == 0 {
        return Err(TransportError::EmptyRead { wr_id: op.wr_id });
    }
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
    if let Some((addr, remote_len)) = remote {
        if op
            .remote_offset
            .checked_add(op.len)
            .is_none_or(|end| end > remote_len)
        {
            return Err(TransportError::RemoteOutOfRange {
                addr: addr.to_string(),
                offset: op.remote_offset,
                len: op.len,
            });
        }
    }
    let chunks = chunk_count(op.len, chunk_bytes);
    if chunks > INFLIGHT_CHUNKS_MAX as u64 {
        return Err(TransportError::OpTooLarge {
            wr_id: op.wr_id,
            len: op.len,
            chunks,
            max: INFLIGHT_CHUNKS_MAX as u64,
        });
    }
    Ok(chunks)
}

/// The `(offset within the op, len)` of each chunk of an op, in order; every
/// chunk but the last is `chunk_bytes` long.
#[derive(Debug, Clone)]
pub struct Chunks {
    len: u64,
    chunk_bytes: u64,
    pos: u64,
}

impl Chunks {
    pub fn new(len: u64, chunk_bytes: u64) -> Self {
        assert!(chunk_bytes > 0, "chunk_bytes must be positive");
        Chunks {
            len,
            chunk_bytes,
            pos: 0,
        }
    }
}

impl Iterator for Chunks {
    type Item = (u64, u64);
    fn next(&mut self) -> Option<(u64, u64)> {
        if self.pos >= self.len {
            return None;
        }
        let n = self.chunk_bytes.min(self.len - self.pos);
        let item = (self.pos, n);
        self.pos += n;
        Some(item)
    }
}

/// A registered buffer and the number of ops in flight into it.
pub(crate) struct Region {
    pub buf: Arc<HostBuffer>,
    pub inflight_ops: Arc<AtomicUsize>,
}

/// Registered regions, looked up once per posted batch.
#[derive(Default)]
pub(crate) struct Regions {
    map: RwLock<HashMap<u32, Region>>,
    next_id: AtomicU64,
}

/// What `validate` hands back per op: the destination and its in-flight counter.
pub(crate) struct Target {
    pub buf: Arc<HostBuffer>,
    pub region_inflight: Arc<AtomicUsize>,
}

impl Regions {
    pub fn register(&self, buf: Arc<HostBuffer>) -> RegionId {
        let id = u32::try_from(self.next_id.fetch_add(1, Ordering::Relaxed))
            .expect("region ids exhausted");
        let r = Region {
            buf,
            inflight_ops: Arc::new(AtomicUsize::new(0)),
        };
        self.map.write().unwrap().insert(id, r);
        RegionId(id)
    }

    pub fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        let mut map = self.map.write().unwrap();
        let r = map.get(&id.0).ok_or(TransportError::UnknownRegion(id))?;
        // Ops are counted under the read lock in `validate`, so with the write
        // lock held the count cannot rise.
        if r.inflight_ops.load(Ordering::Acquire) != 0 {
            return Err(TransportError::Busy(id));
        }
        map.remove(&id.0);
        Ok(())
    }

    /// Checks every op of a batch (region known, local range inside it, non
    /// empty, not too many chunks) and, only if all pass and `cq` has room,
    /// reserves their slots in `cq`, counts them as in flight on their regions
    /// and returns their targets in order, and the batch's chunk count.
    pub fn validate(
        &self,
        ops: &[ReadOp],
        chunk_bytes: u64,
        cq: &CompletionQueue,
        targets: &mut Vec<Target>,
    ) -> Result<u64, TransportError> {
        let map = self.map.read().unwrap();
        let mut chunks = 0u64;
        for op in ops {
            let r = map
                .get(&op.local.0)
                .ok_or(TransportError::UnknownRegion(op.local))?;
            let n = check_op(op, r.buf.len() as u64, None, chunk_bytes)?;
            chunks += n;
        }
        cq.reserve(ops.len(), usize::try_from(chunks).unwrap_or(usize::MAX))?;
        targets.clear();
        for op in ops {
            let r = &map[&op.local.0];
            r.inflight_ops.fetch_add(1, Ordering::AcqRel);
            targets.push(Target {
                buf: r.buf.clone(),
                region_inflight: r.inflight_ops.clone(),
            });
        }
        Ok(chunks)
    }
}

/// The completion queue, with the transport-wide bounds on ops and chunks in
/// flight. An op's slot is taken by `reserve` and given back when `poll`
/// returns its completion, so the bounded channel can never be full.
pub(crate) struct CompletionQueue {
    tx: Sender<Completion>,
    rx: Receiver<Completion>,
    ops_inflight: AtomicUsize,
    chunks_inflight: AtomicUsize,
    bytes_read: AtomicU64,
    ops_completed: AtomicU64,
    ops_failed: AtomicU64,
}

fn try_reserve(counter: &AtomicUsize, n: usize, max: usize) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
            cur.checked_add(n).filter(|&v| v <= max)
        })
        .is_ok()
}

impl CompletionQueue {
    pub fn new() -> Self {
        let (tx, rx) = crossbeam::channel::bounded(INFLIGHT_OPS_MAX);
        CompletionQueue {
            tx,
            rx,
            ops_inflight: AtomicUsize::new(0),
            chunks_inflight: AtomicUsize::new(0),
            bytes_read: AtomicU64::new(0),
            ops_completed: AtomicU64::new(0),
            ops_failed: AtomicU64::new(0),
        }
    }

    /// Takes slots for `ops` ops made of `chunks` chunks, or none at all.
    pub fn reserve(&self, ops: usize, chunks: usize) -> Result<(), TransportError> {
        let full = TransportError::QueueFull {
            ops_max: INFLIGHT_OPS_MAX,
            chunks_max: INFLIGHT_CHUNKS_MAX,
        };
        if !try_reserve(&self.ops_inflight, ops, INFLIGHT_OPS_MAX) {
            return Err(full);
        }
        if !try_reserve(&self.chunks_inflight, chunks, INFLIGHT_CHUNKS_MAX) {
            self.ops_inflight.fetch_sub(ops, Ordering::AcqRel);
            return Err(full);
        }
        Ok(())
    }

    #[cfg(test)]
    fn unreserve(&self, ops: usize, chunks: usize) {
        self.ops_inflight.fetch_sub(ops, Ordering::AcqRel);
        self.chunks_inflight.fetch_sub(chunks, Ordering::AcqRel);
    }

    pub fn add_bytes(&self, n: u64) {
        self.bytes_read.fetch_add(n, Ordering::Relaxed);
    }

    /// Completes an op whose `chunks` chunks are all finished.
    pub fn complete(
        &self,
        wr_id: u64,
        chunks: usize,
        result: Result<(), TransportError>,
        region_inflight: &AtomicUsize,
    ) {
        self.chunks_inflight.fetch_sub(chunks, Ordering::AcqRel);
        region_inflight.fetch_sub(1, Ordering::AcqRel);
        if result.is_err() {
            self.ops_failed.fetch_add(1, Ordering::Relaxed);
        }
        self.ops_completed.fetch_add(1, Ordering::Relaxed);
        let sent = self.tx.try_send(Completion { wr_id, result });
        assert!(
            sent.is_ok(),
            "completion queue overflow: the in-flight op bound is broken"
        );
    }

    pub fn poll(&self, out: &mut Vec<Completion>, max: usize, timeout: Duration) -> usize {
        if max == 0 {
            return 0;
        }
        let first = match self.rx.try_recv() {
            Ok(c) => c,
            Err(_) => match self.rx.recv_timeout(timeout) {
                Ok(c) => c,
                Err(RecvTimeoutError::Timeout) => return 0,
                Err(RecvTimeoutError::Disconnected) => {
                    unreachable!("the queue holds its own sender")
                }
            },
        };
        out.push(first);
        let mut n = 1;
        while n < max {
            match self.rx.try_recv() {
                Ok(c) => {
                    out.push(c);
                    n += 1;
                }
                Err(_) => break,
            }
        }
        self.ops_inflight.fetch_sub(n, Ordering::AcqRel);
        n
    }

    pub fn stats(&self) -> TransportStats {
        TransportStats {
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            ops_completed: self.ops_completed.load(Ordering::Relaxed),
            ops_failed: self.ops_failed.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HugePages;

    #[test]
    fn chunking_math() {
        assert_eq!(chunk_count(1, 4), 1);
        assert_eq!(chunk_count(4, 4), 1);
        assert_eq!(chunk_count(5, 4), 2);
        assert_eq!(chunk_count(0, 4), 0);
        assert_eq!(
            Chunks::new(10, 4).collect::<Vec<_>>(),
            vec![(0, 4), (4, 4), (8, 2)]
        );
        assert_eq!(Chunks::new(8, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4)]);
        assert_eq!(Chunks::new(3, 64 << 20).collect::<Vec<_>>(), vec![(0, 3)]);
        for (len, cb) in [(1u64 << 30, 4u64 << 20), (12345, 100), (7, 7)] {
            let c: Vec<_> = Chunks::new(len, cb).collect();
            assert_eq!(c.len() as u64, chunk_count(len, cb));
            assert_eq!(c.iter().map(|x| x.1).sum::<u64>(), len);
        }
    }

    fn op(wr_id: u64, local: RegionId, local_offset: u64, len: u64) -> ReadOp {
        ReadOp {
            wr_id,
            remote_offset: 0,
            len,
            local,
            local_offset,
        }
    }

    #[test]
    fn validation_is_all_or_nothing() {
        let regions = Regions::default();
        let cq = CompletionQueue::new();
        let r = regions.register(Arc::new(HostBuffer::new(1 << 16, HugePages::No).unwrap()));
        let mut t = Vec::new();
        let bad = RegionId(99);
        assert!(
            matches!(regions.validate(&[op(1, bad, 0, 1)], 10, &cq, &mut t), Err(TransportError::UnknownRegion(x)) if x == bad)
        );
        assert!(matches!(
            regions.validate(&[op(1, r, 0, 0)], 10, &cq, &mut t),
            Err(TransportError::EmptyRead { wr_id: 1 })
        ));
        let e = regions
            .validate(&[op(1, r, 0, 10), op(2, r, 65530, 10)], 10, &cq, &mut t)
            .unwrap_err();
        assert!(
            matches!(
                e,
                TransportError::OutOfBounds {
                    wr_id: 2,
                    region_len: 65536,
                    ..
                }
            ),
            "{e}"
        );
        assert!(matches!(
            regions.validate(&[op(3, r, u64::MAX, 2)], 10, &cq, &mut t),
            Err(TransportError::OutOfBounds { .. })
        ));
        assert!(matches!(
            regions.validate(&[op(4, r, 0, 1 << 16)], 1, &cq, &mut t),
            Err(TransportError::OpTooLarge { .. })
        ));
        // Nothing was counted by the failed batches: deregister is allowed.
        let chunks = regions
            .validate(&[op(5, r, 0, 1000), op(6, r, 10, 15)], 10, &cq, &mut t)
            .unwrap();
        assert_eq!((chunks, t.len()), (102, 2));
        assert!(matches!(
            regions.deregister(r),
            Err(TransportError::Busy(_))
        ));
        assert!(matches!(
            regions.validate(
                &[op(7, r, 0, 1)],
                INFLIGHT_OPS_MAX as u64,
                &cq,
                &mut Vec::new()
            ),
            Ok(1)
        ));
        assert_eq!(cq.ops_inflight.load(Ordering::Relaxed), 3);
        for x in &t {
            x.region_inflight.fetch_sub(1, Ordering::AcqRel);
        }
        assert!(matches!(
            regions.deregister(r),
            Err(TransportError::Busy(_))
        ));
        let all = regions.map.read().unwrap()[&r.0].inflight_ops.clone();
        all.store(0, Ordering::Relaxed);
        regions.deregister(r).unwrap();
        assert!(matches!(
            regions.deregister(r),
            Err(TransportError::UnknownRegion(_))
        ));
    }

    #[test]
    fn queue_bounds_and_release_on_poll() {
        let q = CompletionQueue::new();
        q.reserve(INFLIGHT_OPS_MAX, 10).unwrap();
        assert!(matches!(
            q.reserve(1, 1),
            Err(TransportError::QueueFull { .. })
        ));
        q.unreserve(INFLIGHT_OPS_MAX - 1, 9);
        assert!(matches!(
            q.reserve(1, INFLIGHT_CHUNKS_MAX),
            Err(TransportError::QueueFull { .. })
        ));
        let inflight = AtomicUsize::new(1);
        q.complete(7, 1, Ok(()), &inflight);
        let mut out = Vec::new();
        assert_eq!(q.poll(&mut out, 10, Duration::from_millis(1)), 1);
        assert_eq!(out[0].wr_id, 7);
        assert_eq!(inflight.load(Ordering::Relaxed), 0);
        q.reserve(INFLIGHT_OPS_MAX, INFLIGHT_CHUNKS_MAX).unwrap();
        assert_eq!(q.poll(&mut out, 10, Duration::from_millis(1)), 0);
        assert_eq!(
            q.stats(),
            TransportStats {
                bytes_read: 0,
                ops_completed: 1,
                ops_failed: 0
            }
        );
    }
}
