//! One model's fetch as a plain state machine: which slice to read next,
//! what a landed or failed read means, when a group is complete, when the
//! fetch is over. No transport, no clock of its own (`now` is an argument),
//! no locks: the driver ([`super::engine`]) posts what [`Job::next`] names
//! and feeds every outcome back.
//!
//! Items are the slices of every group, queued in group order; a read that
//! fails or does not verify is queued again at the front on the slice's next
//! replica, so the group it belongs to is not overtaken by later groups.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::checksum::{checksum, from_hex, to_hex};
use distmind_common::proto::ModelEntry;

use super::{FetchError, FetchOptions, FetchReport, POLL_STALL_LIMIT};

/// The most bytes a background job (see [`Job::is_background`]) has in
/// flight per memory server: a waited-for read that comes after it waits
/// for at most this much (0.7 ms at 100 Gbit/s).
pub const BACKGROUND_BYTES_IN_FLIGHT_MAX: u64 = 8 << 20;

/// Where one replica of a slice lives: an index into [`Job::addrs`] and the
/// offset in that memory server's arena.
#[derive(Debug, Clone, Copy)]
struct Replica {
    addr: usize,
    offset: u64,
}

/// One slice and the replica currently tried.
#[derive(Debug)]
struct Item {
    group: usize,
    slice: usize,
    len: u64,
    /// Offset of the slice in the destination region.
    local_offset: u64,
    /// The catalog's checksum, parsed once; `None` when the catalog's text
    /// is not a checksum (the slice then never verifies).
    checksum: Option<u64>,
    replicas: Vec<Replica>,
    replica: usize,
    errors: Vec<String>,
}

/// A read the driver should post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Read<'a> {
    pub item: usize,
    pub group: usize,
    pub addr: &'a str,
    pub remote_offset: u64,
    pub len: u64,
    pub local_offset: u64,
}

/// What a read's outcome did to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Landed {
    /// Verified; its group still waits for other slices.
    Pending,
    /// Verified, and it was the group's last slice: the group is complete.
    GroupReady(usize),
    /// Failed; queued again on the slice's next replica.
    Retried,
    /// Failed on its last replica: the job has failed (it posts nothing
    /// more and ends when its reads in flight have completed).
    Failed,
}

/// One model being fetched.
#[derive(Debug)]
pub(crate) struct Job {
    model: String,
    /// Distinct memory-server addresses of the entry.
    addrs: Vec<String>,
    items: Vec<Item>,
    /// Slices of each group not yet verified.
    remaining: Vec<usize>,
    /// Items to post, front first.
    queue: VecDeque<usize>,
    in_flight: usize,
    bytes: u64,
    opts: FetchOptions,
    started: Instant,
    /// Last completion, or the post that put the first read in flight.
    last_progress: Instant,
    group_ready: Vec<Duration>,
    retries: u32,
    /// Why the job failed, until the outcome is handed out.
    failure: Option<FetchError>,
    /// Failed or stalled: nothing more is posted.
    stopped: bool,
    /// No read completed for [`POLL_STALL_LIMIT`] while some were in flight.
    stalled: bool,
    /// The outcome was handed out ([`Job::take_outcome`]).
    reported: bool,
    /// Set while no one waits for the job (a background fill): its reads
    /// go after every waited-for job's, in a smaller window. Cleared by
    /// whoever comes to wait for it.
    background: Option<Arc<AtomicBool>>,
}

impl Job {
    /// Checks the entry (groups tile, every slice has a replica, the model
    /// fits the region from `base` on) and queues every slice in group order.
    pub fn new(
        entry: &ModelEntry,
        base: u64,
        region_len: u64,
        opts: FetchOptions,
        now: Instant,
    ) -> Result<Job, FetchError> {
        let model = entry.name.as_str();
        let bad = |why: String| FetchError::BadEntry {
            model: model.into(),
            why,
        };
        let mut addrs: Vec<String> = Vec::new();
        let mut items = Vec::new();
        let mut remaining = Vec::with_capacity(entry.groups.len());
        let mut at = 0u64;
        for (g, group) in entry.groups.iter().enumerate() {
            if group.index as usize != g {
                return Err(bad(format!("group {g} is labelled {}", group.index)));
            }
            if group.slices.is_empty() {
                return Err(bad(format!("group {g} has no slices")));
            }
            let mut covered = 0u64;
            for (s, slice) in group.slices.iter().enumerate() {
                if slice.group_offset != covered || slice.replicas.is_empty() {
                    return Err(bad(format!(
                        "group {g}: slices do not tile the group at offset {covered}"
                    )));
                }
                let replicas = slice
                    .replicas
                    .iter()
                    .map(|loc| {
                        let addr = match addrs.iter().position(|a| *a == loc.addr) {
                            Some(i) => i,
                            None => {
                                addrs.push(loc.addr.clone());
                                addrs.len() - 1
                            }
                        };
                        Replica {
                            addr,
                            offset: loc.offset,
                        }
                    })
                    .collect();
                items.push(Item {
                    group: g,
                    slice: s,
                    len: slice.len,
                    local_offset: base + at + slice.group_offset,
                    checksum: from_hex(&slice.checksum),
                    replicas,
                    replica: 0,
                    errors: Vec::new(),
                });
                covered += slice.len;
            }
            if covered != group.bytes {
                return Err(bad(format!(
                    "group {g}: slices cover {covered} of {} bytes",
                    group.bytes
                )));
            }
            remaining.push(group.slices.len());
            at += group.bytes;
        }
        if base.checked_add(at).is_none_or(|end| end > region_len) {
            return Err(FetchError::NoRoom {
                model: model.into(),
                need: at,
                base,
                have: region_len,
            });
        }
        Ok(Job {
            model: model.into(),
            addrs,
            queue: (0..items.len()).collect(),
            items,
            group_ready: vec![Duration::ZERO; remaining.len()],
            remaining,
            in_flight: 0,
            bytes: at,
            opts,
            started: now,
            last_progress: now,
            retries: 0,
            failure: None,
            stopped: false,
            stalled: false,
            reported: false,
            background: None,
        })
    }

    /// Marks the job a background one while `flag` is set (see
    /// [`Job::is_background`]).
    pub fn in_background(mut self, flag: Arc<AtomicBool>) -> Job {
        self.background = Some(flag);
        self
    }

    /// No one waits for the job yet: its reads go after every waited-for
    /// job's, and at most [`BACKGROUND_BYTES_IN_FLIGHT_MAX`] of them are
    /// in flight per memory server.
    pub fn is_background(&self) -> bool {
        self.background
            .as_ref()
            .is_some_and(|b| b.load(Ordering::Relaxed))
    }

    /// The most bytes this job lets a memory server have in flight.
    pub fn window(&self) -> u64 {
        if self.is_background() {
            self.opts
                .bytes_in_flight_max
                .min(BACKGROUND_BYTES_IN_FLIGHT_MAX)
        } else {
            self.opts.bytes_in_flight_max
        }
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn opts(&self) -> &FetchOptions {
        &self.opts
    }

    /// Reads posted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The read to post next, unless the job failed or everything is posted.
    pub fn next(&self) -> Option<Read<'_>> {
        if self.stopped {
            return None;
        }
        let &i = self.queue.front()?;
        Some(self.read(i))
    }

    /// Item `i`'s read on its current replica.
    pub fn read(&self, i: usize) -> Read<'_> {
        let it = &self.items[i];
        let r = it.replicas[it.replica];
        Read {
            item: i,
            group: it.group,
            addr: &self.addrs[r.addr],
            remote_offset: r.offset,
            len: it.len,
            local_offset: it.local_offset,
        }
    }

    /// The read [`Job::next`] named is in flight.
    pub fn posted(&mut self, now: Instant) {
        let i = self.queue.pop_front();
        debug_assert!(i.is_some(), "posted without a read to post");
        if self.in_flight == 0 {
            // The stall clock runs only while something is in flight.
            self.last_progress = now;
        }
        self.in_flight += 1;
    }

    /// The read [`Job::next`] named could not be posted (`why`).
    pub fn post_failed(&mut self, why: &str) -> Landed {
        let Some(i) = self.queue.pop_front() else {
            debug_assert!(false, "post_failed without a read to post");
            return Landed::Pending;
        };
        self.next_replica(i, why)
    }

    /// Whether the bytes that landed for item `i` are the catalog's.
    pub fn check(&self, i: usize, bytes: &[u8]) -> Result<(), String> {
        let want = self.items[i].checksum;
        match want {
            Some(want) if want == checksum(bytes) => Ok(()),
            Some(want) => Err(format!(
                "slice checksum mismatch (catalog says {})",
                to_hex(want)
            )),
            None => Err("slice checksum mismatch (the catalog's checksum is not hex)".into()),
        }
    }

    /// Item `i`'s read completed with `result` (verified already, when the
    /// options ask for it).
    pub fn landed(&mut self, i: usize, result: Result<(), String>, now: Instant) -> Landed {
        debug_assert!(self.in_flight > 0, "a completion without a read in flight");
        self.in_flight -= 1;
        self.last_progress = now;
        match result {
            // A failed job announces nothing more: its fill has failed.
            Ok(()) if self.stopped => Landed::Pending,
            Ok(()) => {
                let g = self.items[i].group;
                self.remaining[g] -= 1;
                if self.remaining[g] == 0 {
                    self.group_ready[g] = now.saturating_duration_since(self.started);
                    Landed::GroupReady(g)
                } else {
                    Landed::Pending
                }
            }
            Err(why) => self.next_replica(i, &why),
        }
    }

    /// Declares the job stalled when it has reads in flight and none of
    /// them completed for [`POLL_STALL_LIMIT`]. A stalled job posts nothing
    /// more; its reads in flight may still land, so whoever owns the
    /// destination must keep it until [`Job::in_flight`] is 0.
    pub fn check_stall(&mut self, now: Instant) -> bool {
        if self.in_flight == 0 || self.stalled || self.reported {
            return false;
        }
        if now.saturating_duration_since(self.last_progress) < POLL_STALL_LIMIT {
            return false;
        }
        self.stalled = true;
        self.fail(FetchError::Stalled {
            model: self.model.clone(),
        });
        true
    }

    /// The outcome is known: every slice verified, or the job failed and
    /// nothing of it is in flight, or it stalled (reads may still be in
    /// flight). False once [`Job::take_outcome`] handed it out.
    pub fn has_outcome(&self) -> bool {
        !self.reported && (self.stalled || self.is_over())
    }

    /// The outcome was handed out.
    pub fn is_reported(&self) -> bool {
        self.reported
    }

    /// Nothing of the job is in flight or left to post: the driver can
    /// forget it (after its outcome was handed out).
    pub fn is_over(&self) -> bool {
        self.in_flight == 0 && (self.queue.is_empty() || self.stopped)
    }

    /// The report or the error, once ([`Job::has_outcome`]).
    pub fn take_outcome(&mut self, now: Instant) -> Result<FetchReport, FetchError> {
        debug_assert!(self.has_outcome(), "the outcome is not known yet");
        self.reported = true;
        match self.failure.take() {
            Some(e) => Err(e),
            None => Ok(FetchReport {
                bytes: self.bytes,
                elapsed: now.saturating_duration_since(self.started),
                group_ready: self.group_ready.clone(),
                retries: self.retries,
            }),
        }
    }

    /// Fails the job (nothing more is posted) unless its outcome is out.
    pub fn abort(&mut self, error: FetchError) {
        if !self.reported {
            self.fail(error);
        }
    }

    /// Stops posting; the first failure is the one reported.
    fn fail(&mut self, error: FetchError) {
        self.stopped = true;
        self.failure.get_or_insert(error);
    }

    /// Moves item `i` to its next replica (queued at the front), or fails
    /// the job when none is left.
    fn next_replica(&mut self, i: usize, why: &str) -> Landed {
        let it = &mut self.items[i];
        let addr = &self.addrs[it.replicas[it.replica].addr];
        log::warn!(
            "{} group {} slice {}: read from {addr} failed: {why}",
            self.model,
            it.group,
            it.slice
        );
        it.errors.push(format!("{addr}: {why}"));
        it.replica += 1;
        if it.replica < it.replicas.len() {
            self.retries += 1;
            self.queue.push_front(i);
            return Landed::Retried;
        }
        let error = FetchError::AllReplicasFailed {
            model: self.model.clone(),
            group: it.group,
            slice: it.slice,
            errors: it.errors.join("; "),
        };
        self.fail(error);
        Landed::Failed
    }
}

#[cfg(test)]
mod tests {
    use distmind_common::proto::{GroupLocation, Location, Slice};

    use super::*;

    /// `groups` groups of `slices` slices of `len` bytes, every slice on
    /// "a" then "b"; the bytes of slice k are all k.
    fn entry(groups: usize, slices: usize, len: u64) -> ModelEntry {
        let mut k = 0u8;
        ModelEntry {
            name: "m".into(),
            family: "test".into(),
            total_bytes: groups as u64 * slices as u64 * len,
            strategy: "test".into(),
            replication: 2,
            version: 0,
            groups: (0..groups)
                .map(|g| GroupLocation {
                    index: g as u32,
                    bytes: slices as u64 * len,
                    checksum: String::new(),
                    slices: (0..slices)
                        .map(|s| {
                            k += 1;
                            Slice {
                                group_offset: s as u64 * len,
                                len,
                                checksum: to_hex(checksum(&vec![k; len as usize])),
                                replicas: ["a", "b"]
                                    .iter()
                                    .enumerate()
                                    .map(|(i, addr)| Location {
                                        memserver: i as u32,
                                        addr: addr.to_string(),
                                        offset: 1000 * u64::from(k),
                                    })
                                    .collect(),
                            }
                        })
                        .collect(),
                })
                .collect(),
            manifest: serde_json::Value::Null,
        }
    }

    fn job(groups: usize, slices: usize) -> (Job, Instant) {
        let now = Instant::now();
        let j = Job::new(
            &entry(groups, slices, 100),
            4096,
            1 << 20,
            FetchOptions::default(),
            now,
        )
        .unwrap();
        (j, now)
    }

    #[test]
    fn job_posts_in_group_order_at_the_packed_offsets() {
        let (mut j, now) = job(2, 2);
        let mut reads = Vec::new();
        while let Some(r) = j.next() {
            reads.push((r.item, r.group, r.addr.to_string(), r.local_offset));
            j.posted(now);
        }
        assert_eq!(
            reads,
            [
                (0, 0, "a".into(), 4096),
                (1, 0, "a".into(), 4196),
                (2, 1, "a".into(), 4296),
                (3, 1, "a".into(), 4396)
            ]
        );
        assert_eq!(j.in_flight(), 4);
        assert!(!j.has_outcome());
        // Completions in any order; a group is ready with its last slice.
        assert_eq!(j.landed(3, Ok(()), now), Landed::Pending);
        assert_eq!(j.landed(0, Ok(()), now), Landed::Pending);
        assert_eq!(j.landed(2, Ok(()), now), Landed::GroupReady(1));
        assert_eq!(j.landed(1, Ok(()), now), Landed::GroupReady(0));
        assert!(j.has_outcome() && j.is_over());
        let r = j.take_outcome(now).unwrap();
        assert_eq!((r.bytes, r.retries, r.group_ready.len()), (400, 0, 2));
        assert!(!j.has_outcome(), "the outcome is handed out once");
    }

    #[test]
    fn job_checks_each_slice_against_the_catalog() {
        let (j, _) = job(1, 2);
        assert!(j.check(0, &[1; 100]).is_ok());
        let e = j.check(1, &[1; 100]).unwrap_err();
        assert!(e.contains("checksum mismatch"), "{e}");
    }

    #[test]
    fn job_retries_a_failed_slice_first_on_its_next_replica() {
        let (mut j, now) = job(2, 1);
        j.posted(now);
        j.posted(now);
        assert_eq!(j.landed(0, Err("boom".into()), now), Landed::Retried);
        // Item 0 goes before anything else, on replica "b".
        let r = j.next().unwrap();
        assert_eq!((r.item, r.addr), (0, "b"));
        j.posted(now);
        assert_eq!(j.landed(1, Ok(()), now), Landed::GroupReady(1));
        assert_eq!(j.landed(0, Ok(()), now), Landed::GroupReady(0));
        assert_eq!(j.take_outcome(now).unwrap().retries, 1);
    }

    #[test]
    fn job_fails_when_every_replica_failed_and_only_after_its_reads_completed() {
        let (mut j, now) = job(3, 1);
        j.posted(now);
        j.posted(now);
        assert_eq!(j.post_failed("refused"), Landed::Retried);
        assert_eq!(j.landed(0, Err("lost".into()), now), Landed::Retried);
        j.posted(now); // item 0 on "b"
        assert_eq!(j.landed(0, Err("lost too".into()), now), Landed::Failed);
        assert!(j.next().is_none(), "a failed job posts nothing more");
        assert!(!j.has_outcome(), "item 1 is still in flight");
        assert_eq!(
            j.landed(1, Ok(()), now),
            Landed::Pending,
            "a failed job announces no group"
        );
        let e = j.take_outcome(now).unwrap_err().to_string();
        assert!(
            e.contains("group 0") && e.contains("a: lost") && e.contains("b: lost too"),
            "{e}"
        );
    }

    #[test]
    fn job_stalls_only_with_reads_in_flight_and_no_completion_for_the_limit() {
        let (mut j, t0) = job(1, 2);
        let late = t0 + POLL_STALL_LIMIT + Duration::from_secs(1);
        assert!(!j.check_stall(late), "nothing in flight, nothing stalls");
        j.posted(late);
        j.posted(late);
        assert!(!j.check_stall(late + POLL_STALL_LIMIT / 2));
        assert_eq!(
            j.landed(0, Ok(()), late + POLL_STALL_LIMIT / 2),
            Landed::Pending
        );
        assert!(!j.check_stall(late + POLL_STALL_LIMIT));
        let stuck = late + POLL_STALL_LIMIT * 2;
        assert!(j.check_stall(stuck));
        // Reported at once, while a read may still land.
        assert!(j.has_outcome() && !j.is_over());
        assert!(matches!(
            j.take_outcome(stuck),
            Err(FetchError::Stalled { .. })
        ));
        j.landed(1, Ok(()), stuck);
        assert!(j.is_over() && !j.has_outcome());
    }

    #[test]
    fn job_refuses_entries_that_do_not_tile_or_fit() {
        let now = Instant::now();
        let opts = FetchOptions::default();
        let mut e = entry(2, 2, 100);
        e.groups[1].slices[1].group_offset += 1;
        assert!(matches!(
            Job::new(&e, 0, 1 << 20, opts, now),
            Err(FetchError::BadEntry { .. })
        ));
        let e = entry(2, 2, 100);
        let err = Job::new(&e, 4000, 4300, opts, now).unwrap_err();
        assert!(matches!(err, FetchError::NoRoom { need: 400, .. }), "{err}");
    }
}
