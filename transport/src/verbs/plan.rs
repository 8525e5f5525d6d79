//! RDMA READ planning, without hardware.
//!
//! [`plan_reads`] cuts a list of reads into work requests of at most
//! `max_read_bytes`, groups them into chains (one `ibv_post_send` doorbell
//! each) of at most `max_wr_per_doorbell` and at most `max_rd_atomic` work
//! requests, and signals the last one of every chain (and every Nth, if asked).
//! Work requests are numbered by a sequence (`seq`) in posting order; the
//! hardware `wr_id` of a work request is its `seq` plus the poster's base.
//!
//! An RC queue pair completes work in order, so a signalled completion of
//! `seq` means every earlier work request finished too. [`SendWindow`] uses
//! that to keep at most `max_rd_atomic` reads outstanding, and
//! [`CompletionTracker`] turns work completions back into one result per
//! caller request (by the caller's `wr_id`).

use super::VerbsError;

/// One read requested by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadReq {
    /// The caller's tag, returned with the read's result.
    pub wr_id: u64,
    /// Where the bytes land (inside an MR registered with `lkey`).
    pub local_addr: u64,
    pub lkey: u32,
    /// Where they come from (inside the peer's MR with `rkey`).
    pub remote_addr: u64,
    pub rkey: u32,
    pub len: u64,
}

/// Bounds of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLimits {
    /// Work requests linked into one `ibv_post_send` call.
    pub max_wr_per_doorbell: usize,
    /// RDMA READs outstanding per QP (the QP's initiator depth, and the send
    /// window [`SendWindow`] enforces); a chain never exceeds it.
    pub max_rd_atomic: usize,
    /// Bytes one work request reads (bigger reads are cut into chunks).
    pub max_read_bytes: u32,
    /// Also signal every Nth work request of a chain (0: only the last one).
    pub signal_every: usize,
}

impl PlanLimits {
    fn validate(&self) -> Result<(), VerbsError> {
        if self.max_wr_per_doorbell == 0 || self.max_rd_atomic == 0 || self.max_read_bytes == 0 {
            return Err(VerbsError::InvalidPlan(format!(
                "limits must be positive: max_wr_per_doorbell {}, max_rd_atomic {}, max_read_bytes {}",
                self.max_wr_per_doorbell, self.max_rd_atomic, self.max_read_bytes
            )));
        }
        Ok(())
    }

    /// Work requests per chain: the smaller of the doorbell and window bounds.
    pub fn chain_len(&self) -> usize {
        self.max_wr_per_doorbell.min(self.max_rd_atomic)
    }
}

/// One RDMA READ work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedWr {
    /// Position in posting order, from 0.
    pub seq: u64,
    /// The caller's `wr_id` of the request this chunk belongs to.
    pub req_wr_id: u64,
    pub local_addr: u64,
    pub lkey: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub len: u32,
    /// `IBV_SEND_SIGNALED`: this work request produces a completion.
    pub signaled: bool,
}

/// Work requests posted with one doorbell; the last one is signalled.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Chain {
    pub wrs: Vec<PlannedWr>,
}

/// The work-request range of one caller request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestSpan {
    pub wr_id: u64,
    pub first_seq: u64,
    pub last_seq: u64,
}

/// The output of [`plan_reads`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadPlan {
    pub chains: Vec<Chain>,
    /// In request order (which is posting order).
    pub requests: Vec<RequestSpan>,
}

impl ReadPlan {
    pub fn wr_count(&self) -> u64 {
        self.requests.last().map_or(0, |r| r.last_seq + 1)
    }
}

/// Plans `reqs` (posted in the given order) under `limits`.
///
/// Refuses zero-length reads, duplicate `wr_id`s and address ranges that wrap.
pub fn plan_reads(reqs: &[ReadReq], limits: &PlanLimits) -> Result<ReadPlan, VerbsError> {
    limits.validate()?;
    let mut ids: Vec<u64> = reqs.iter().map(|r| r.wr_id).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(VerbsError::InvalidPlan(format!(
            "wr_id {} appears twice: completions could not be told apart",
            w[0]
        )));
    }
    let chunk = u64::from(limits.max_read_bytes);
    let chain_len = limits.chain_len();
    let mut plan = ReadPlan {
        chains: Vec::new(),
        requests: Vec::with_capacity(reqs.len()),
    };
    let mut cur = Chain::default();
    let mut seq = 0u64;
    for r in reqs {
        if r.len == 0 {
            return Err(VerbsError::InvalidPlan(format!(
                "read {} has zero length: every read must move at least one byte",
                r.wr_id
            )));
        }
        if r.local_addr.checked_add(r.len).is_none() || r.remote_addr.checked_add(r.len).is_none() {
            return Err(VerbsError::InvalidPlan(format!(
                "read {} of {} bytes wraps the address space",
                r.wr_id, r.len
            )));
        }
        let first_seq = seq;
        let mut off = 0u64;
        while off < r.len {
            let len = chunk.min(r.len - off);
            if cur.wrs.len() == chain_len {
                plan.chains.push(std::mem::take(&mut cur));
            }
            let every = limits.signal_every;
            cur.wrs.push(PlannedWr {
                seq,
                req_wr_id: r.wr_id,
                local_addr: r.local_addr + off,
                lkey: r.lkey,
                remote_addr: r.remote_addr + off,
                rkey: r.rkey,
                len: len as u32,
                signaled: every != 0 && (cur.wrs.len() + 1) % every == 0,
            });
            seq += 1;
            off += len;
        }
        plan.requests.push(RequestSpan {
            wr_id: r.wr_id,
            first_seq,
            last_seq: seq - 1,
        });
    }
    if !cur.wrs.is_empty() {
        plan.chains.push(cur);
    }
    for c in &mut plan.chains {
        if let Some(last) = c.wrs.last_mut() {
            last.signaled = true;
        }
    }
    Ok(plan)
}

/// At most `max` work requests outstanding on a QP; a signalled completion of
/// `seq` retires every work request up to it (RC completes in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWindow {
    max: u64,
    posted: u64,
    retired: u64,
}

impl SendWindow {
    pub fn new(max: usize) -> Self {
        Self {
            max: max as u64,
            posted: 0,
            retired: 0,
        }
    }

    pub fn outstanding(&self) -> u64 {
        self.posted - self.retired
    }

    pub fn can_post(&self, n: usize) -> bool {
        self.outstanding() + n as u64 <= self.max
    }

    /// The next work request's `seq`.
    pub fn next_seq(&self) -> u64 {
        self.posted
    }

    pub fn on_posted(&mut self, n: usize) {
        self.posted += n as u64;
        debug_assert!(self.outstanding() <= self.max, "window overrun");
    }

    /// A signalled (or failed) work request `seq` completed.
    pub fn on_completed(&mut self, seq: u64) {
        debug_assert!(seq < self.posted, "completion of an unposted work request");
        self.retired = self.retired.max(seq + 1);
    }

    /// The QP went to Error: everything outstanding is gone.
    pub fn reset_outstanding(&mut self) {
        self.retired = self.posted;
    }
}

/// A caller request's outcome.
pub type ReadResult = (u64, Result<(), VerbsError>);

/// Maps work completions (by `seq`) back to caller requests.
#[derive(Debug, Clone)]
pub struct CompletionTracker {
    spans: Vec<RequestSpan>,
    next: usize,
    failed: bool,
}

impl CompletionTracker {
    pub fn new(plan: &ReadPlan) -> Self {
        Self {
            spans: plan.requests.clone(),
            next: 0,
            failed: false,
        }
    }

    /// Every request has its result.
    pub fn is_done(&self) -> bool {
        self.next == self.spans.len()
    }

    pub fn pending(&self) -> usize {
        self.spans.len() - self.next
    }

    /// Work request `seq` completed successfully (and so did every earlier one).
    pub fn on_success(&mut self, seq: u64, out: &mut Vec<ReadResult>) {
        if self.failed {
            return;
        }
        while let Some(s) = self.spans.get(self.next) {
            if s.last_seq > seq {
                break;
            }
            out.push((s.wr_id, Ok(())));
            self.next += 1;
        }
    }

    /// Work request `seq` failed with `err`: its request fails with `err`, the
    /// requests wholly before it succeeded, and every later one is flushed.
    pub fn on_error(&mut self, seq: u64, err: VerbsError, out: &mut Vec<ReadResult>) {
        if self.failed {
            return; // flush completions after the first error
        }
        if seq > 0 {
            self.on_success(seq - 1, out);
        }
        self.failed = true;
        let mut err = Some(err);
        while let Some(s) = self.spans.get(self.next) {
            let e = match err.take() {
                Some(e) if s.first_seq <= seq => e,
                other => {
                    err = other;
                    VerbsError::Flushed { wr_id: s.wr_id }
                }
            };
            out.push((s.wr_id, Err(e)));
            self.next += 1;
        }
    }

    /// Fails every pending request (a timeout or a lost QP).
    pub fn fail_all(&mut self, err: &VerbsError, out: &mut Vec<ReadResult>) {
        self.failed = true;
        while let Some(s) = self.spans.get(self.next) {
            out.push((s.wr_id, Err(err.clone())));
            self.next += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(doorbell: usize, rd: usize, bytes: u32, every: usize) -> PlanLimits {
        PlanLimits {
            max_wr_per_doorbell: doorbell,
            max_rd_atomic: rd,
            max_read_bytes: bytes,
            signal_every: every,
        }
    }

    fn reqs(lens: &[u64]) -> Vec<ReadReq> {
        let mut local = 0x1000u64;
        let mut remote = 0x9000_0000u64;
        lens.iter()
            .enumerate()
            .map(|(i, &len)| {
                let r = ReadReq {
                    wr_id: 100 + i as u64,
                    local_addr: local,
                    lkey: 11,
                    remote_addr: remote,
                    rkey: 22,
                    len,
                };
                local += len + 7;
                remote += len * 3;
                r
            })
            .collect()
    }

    /// Every byte of every request read exactly once, in order, bounds respected.
    fn check(reqs: &[ReadReq], l: &PlanLimits, plan: &ReadPlan) {
        let wrs: Vec<&PlannedWr> = plan.chains.iter().flat_map(|c| &c.wrs).collect();
        for (i, w) in wrs.iter().enumerate() {
            assert_eq!(w.seq, i as u64, "seq is posting order");
            assert!(w.len > 0 && w.len <= l.max_read_bytes);
        }
        for c in &plan.chains {
            assert!(!c.wrs.is_empty());
            assert!(c.wrs.len() <= l.max_wr_per_doorbell && c.wrs.len() <= l.max_rd_atomic);
            assert!(c.wrs.last().unwrap().signaled, "last of chain signalled");
            for (i, w) in c.wrs.iter().enumerate() {
                let every = l.signal_every != 0 && (i + 1) % l.signal_every == 0;
                assert_eq!(w.signaled, every || i + 1 == c.wrs.len());
            }
        }
        assert_eq!(plan.requests.len(), reqs.len());
        let mut it = wrs.iter().peekable();
        for (r, span) in reqs.iter().zip(&plan.requests) {
            assert_eq!(span.wr_id, r.wr_id, "requests keep their order");
            let mut off = 0u64;
            while let Some(w) = it.next_if(|w| w.req_wr_id == r.wr_id) {
                assert_eq!(w.local_addr, r.local_addr + off);
                assert_eq!(w.remote_addr, r.remote_addr + off);
                assert_eq!((w.lkey, w.rkey), (r.lkey, r.rkey));
                if off == 0 {
                    assert_eq!(w.seq, span.first_seq);
                }
                off += u64::from(w.len);
                if off == r.len {
                    assert_eq!(w.seq, span.last_seq);
                }
            }
            assert_eq!(off, r.len, "request {} covered exactly", r.wr_id);
        }
        assert!(it.next().is_none());
        assert_eq!(plan.wr_count(), wrs.len() as u64);
    }

    #[test]
    fn small_reads_are_chained_per_doorbell() {
        let l = limits(4, 16, 1 << 20, 0);
        let r = reqs(&[10; 10]);
        let p = plan_reads(&r, &l).unwrap();
        check(&r, &l, &p);
        assert_eq!(
            p.chains.iter().map(|c| c.wrs.len()).collect::<Vec<_>>(),
            [4, 4, 2]
        );
    }

    #[test]
    fn big_reads_are_chunked_and_chains_respect_rd_atomic() {
        let l = limits(32, 3, 1000, 0);
        let r = reqs(&[2500, 1, 1000, 999, 1001]);
        let p = plan_reads(&r, &l).unwrap();
        check(&r, &l, &p);
        let lens: Vec<u32> = p
            .chains
            .iter()
            .flat_map(|c| &c.wrs)
            .map(|w| w.len)
            .collect();
        assert_eq!(lens, [1000, 1000, 500, 1, 1000, 999, 1000, 1]);
        assert!(p.chains.iter().all(|c| c.wrs.len() <= 3));
    }

    #[test]
    fn signal_every_nth() {
        let l = limits(8, 8, 64, 3);
        let r = reqs(&[64 * 20]);
        let p = plan_reads(&r, &l).unwrap();
        check(&r, &l, &p);
        let sig: Vec<bool> = p.chains[0].wrs.iter().map(|w| w.signaled).collect();
        assert_eq!(sig, [false, false, true, false, false, true, false, true]);
    }

    #[test]
    fn many_shapes_cover_every_byte() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..300 {
            let n = (next() % 20) as usize;
            let lens: Vec<u64> = (0..n).map(|_| 1 + next() % 5000).collect();
            let l = limits(
                1 + (next() % 9) as usize,
                1 + (next() % 9) as usize,
                1 + (next() % 2048) as u32,
                (next() % 4) as usize,
            );
            let r = reqs(&lens);
            let p = plan_reads(&r, &l).unwrap();
            check(&r, &l, &p);
        }
    }

    #[test]
    fn refusals() {
        let l = limits(4, 4, 100, 0);
        let e = plan_reads(&reqs(&[1, 0]), &l).unwrap_err().to_string();
        assert!(e.contains("read 101 has zero length"), "{e}");
        let mut d = reqs(&[1, 2]);
        d[1].wr_id = d[0].wr_id;
        assert!(plan_reads(&d, &l)
            .unwrap_err()
            .to_string()
            .contains("appears twice"));
        let mut w = reqs(&[10]);
        w[0].remote_addr = u64::MAX - 5;
        assert!(plan_reads(&w, &l)
            .unwrap_err()
            .to_string()
            .contains("wraps"));
        assert!(plan_reads(&reqs(&[1]), &limits(0, 4, 100, 0)).is_err());
        assert!(plan_reads(&reqs(&[1]), &limits(4, 0, 100, 0)).is_err());
        assert!(plan_reads(&reqs(&[1]), &limits(4, 4, 0, 0)).is_err());
        assert_eq!(plan_reads(&[], &l).unwrap(), ReadPlan::default());
    }

    #[test]
    fn window_bounds_outstanding_reads() {
        let l = limits(4, 6, 10, 0);
        let p = plan_reads(&reqs(&[35, 20, 5]), &l).unwrap(); // 4 + 2 + 1 = 7 WRs
        let mut w = SendWindow::new(l.max_rd_atomic);
        let mut posted = 0;
        let mut peak = 0;
        let mut retire_queue = Vec::new();
        for c in &p.chains {
            while !w.can_post(c.wrs.len()) {
                let seq: u64 = retire_queue.remove(0);
                w.on_completed(seq);
            }
            assert_eq!(w.next_seq(), c.wrs[0].seq);
            w.on_posted(c.wrs.len());
            posted += c.wrs.len();
            peak = peak.max(w.outstanding());
            retire_queue.extend(c.wrs.iter().filter(|x| x.signaled).map(|x| x.seq));
        }
        assert_eq!(posted, 7);
        assert!(peak <= 6);
        for s in retire_queue {
            w.on_completed(s);
        }
        assert_eq!(w.outstanding(), 0);
    }

    #[test]
    fn tracker_reports_each_request_once_in_order() {
        let l = limits(3, 3, 10, 0);
        let p = plan_reads(&reqs(&[25, 5, 10, 30]), &l).unwrap(); // seqs: 0-2, 3, 4, 5-7
        let mut t = CompletionTracker::new(&p);
        let mut out = Vec::new();
        t.on_success(2, &mut out); // chain 0 = seqs 0..=2
        assert_eq!(out.iter().map(|r| r.0).collect::<Vec<_>>(), [100]);
        t.on_success(5, &mut out); // chain 1 = seqs 3..=5
        assert_eq!(out.iter().map(|r| r.0).collect::<Vec<_>>(), [100, 101, 102]);
        assert!(!t.is_done());
        t.on_success(7, &mut out);
        assert!(t.is_done());
        assert_eq!(out.len(), 4);
        assert!(out.iter().all(|r| r.1.is_ok()));
    }

    #[test]
    fn tracker_error_fails_its_request_and_flushes_the_rest() {
        let l = limits(8, 8, 10, 0);
        let p = plan_reads(&reqs(&[25, 5, 10, 30]), &l).unwrap();
        let mut t = CompletionTracker::new(&p);
        let mut out = Vec::new();
        let err = VerbsError::Completion {
            wr_id: 4,
            status: 10,
            detail: "remote access error".into(),
        };
        t.on_error(4, err.clone(), &mut out); // seq 4 is request 102
        assert!(t.is_done());
        assert_eq!(out.len(), 4);
        assert!(out[0].1.is_ok() && out[1].1.is_ok());
        assert_eq!(out[2], (102, Err(err)));
        assert_eq!(out[3], (103, Err(VerbsError::Flushed { wr_id: 103 })));
        // Flush completions that follow change nothing.
        t.on_error(6, VerbsError::Flushed { wr_id: 6 }, &mut out);
        t.on_success(7, &mut out);
        assert_eq!(out.len(), 4);
    }

    #[test]
    fn tracker_error_in_the_middle_of_a_chunked_request() {
        let l = limits(8, 8, 10, 0);
        let p = plan_reads(&reqs(&[25, 5]), &l).unwrap(); // 0-2, 3
        let mut t = CompletionTracker::new(&p);
        let mut out = Vec::new();
        t.on_error(1, VerbsError::Flushed { wr_id: 1 }, &mut out);
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|r| r.1.is_err()));
        let mut t = CompletionTracker::new(&p);
        let mut out = Vec::new();
        t.fail_all(
            &VerbsError::Timeout(std::time::Duration::from_secs(1)),
            &mut out,
        );
        assert_eq!(out.len(), 2);
        assert!(t.is_done());
    }
}
