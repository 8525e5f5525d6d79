//! SD-Pipe's partial-reduce group scheduler for one stage key
//! (`ReduceStat::getPartner` / `getPartnerPairWise` in
//! `ps-lite/src/preduce_handler.cc`; the adaptive wait of
//! `PartialReduce.async_wait` in `python/hetu/preduce.py`), on a virtual
//! clock.
//!
//! * The first ready worker opens a group with a deadline of now + its
//!   wait; the group closes when every live worker is ready or when the
//!   deadline passes. Its members (sorted) average together; a group of one
//!   is returned too (that worker goes on alone).
//! * Adaptive wait, per worker as in SD-Pipe (each worker keeps its own, and
//!   the wait of the worker that opens a group sets its deadline): a worker whose group had
//!   fewer than 2 members doubles its wait, up to 10 ms; otherwise it takes
//!   0.9 of it, down to 0.01 ms. It starts at 1 ms.
//! * Connectivity: a union-find over the workers merges the members of
//!   every closed group. After every `ssp_bound x P` updates (an update is
//!   one worker's membership in a closed group; `P` the live workers) the
//!   next group that opens, once every live worker has been ready at least
//!   once, is a graph sync: it has no deadline and closes only when the
//!   ready workers, together with the union-find sets, connect every live
//!   worker: when every set has a ready member. Then the union-find resets.
//!   So within each window every worker is averaged in, transitively.
//! * Above 8 workers (the configured `workers`, removed ones included:
//!   SD-Pipe's handler switches to `getPartnerPairWise` on `max_workers`,
//!   not on how many are ready), a closing group is split into pairs: its members sorted, then (1st,
//!   2nd), (3rd, 4th), ...; an odd last member goes alone. A graph sync is
//!   not split.
//!
//! **Assumption:** the caller reports events in time order and calls
//! `poll` at `next_deadline` (or later: a late poll closes the group at its
//! deadline, and a `ready` after a passed deadline first closes that
//! group). A group is a set of workers to average; how they average
//! (SD-Pipe: an NCCL AllReduce with `ncclAvg` over the weights) is the
//! caller's.
//!
//! Where this differs from SD-Pipe's code, and why:
//! * `remove` (a pipeline died) takes a worker out: nothing waits for it,
//!   `P` is the live workers from then on, and the graph sync connects the
//!   live ones. SD-Pipe has no removal.
//! * When the union-find already connects every live worker as the graph
//!   sync would open, the window is done: the union-find resets and the
//!   group forms as usual. SD-Pipe opens the graph sync anyway and closes it
//!   at once with the opener alone, splitting a round that would have been
//!   whole.
//! * SD-Pipe's pairwise path never merges its union-find (only `getPartner`
//!   does), so there a graph sync needs every worker ready at once; here
//!   every returned pair merges, as the groups of `getPartner` do.
//! * SD-Pipe lets one stage key at a time do a graph sync (a static lock
//!   across keys) and counts its epoch stop (`sync_every`); both span keys
//!   and are the caller's (one scheduler per key).

use std::time::Duration;

use super::group::{CloseReason, Group, GroupError, GroupScheduler, Roster, WorkerId};

/// Updates per worker between graph syncs (SD-Pipe's `ssp_bound`).
pub const SSP_BOUND_DEFAULT: u64 = 10;
/// A worker's first wait.
pub const WAIT_INITIAL: Duration = Duration::from_millis(1);
/// The shortest wait.
pub const WAIT_MIN: Duration = Duration::from_micros(10);
/// The longest wait.
pub const WAIT_MAX: Duration = Duration::from_millis(10);
/// A group smaller than this makes its members wait longer next time.
pub const GROUP_MIN_MEMBERS: usize = 2;
/// The wait after a group too small: this times the wait.
pub const WAIT_GROW: f64 = 2.0;
/// The wait after a group large enough: this times the wait.
pub const WAIT_SHRINK: f64 = 0.9;
/// Above this many workers, groups are split into pairs.
pub const PAIRWISE_ABOVE_WORKERS: usize = 8;

const _: () = assert!(WAIT_MIN.as_nanos() > 0);
const _: () = assert!(WAIT_MIN.as_nanos() <= WAIT_INITIAL.as_nanos());
const _: () = assert!(WAIT_INITIAL.as_nanos() <= WAIT_MAX.as_nanos());
const _: () = assert!(SSP_BOUND_DEFAULT >= 1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PReduceConfig {
    /// `P`: the pipelines (data-parallel degree), at most `WORKERS_MAX`.
    pub workers: usize,
    /// At least 1.
    pub ssp_bound: u64,
    pub wait_initial: Duration,
    pub wait_min: Duration,
    pub wait_max: Duration,
}

impl PReduceConfig {
    /// SD-Pipe's defaults for `workers` pipelines.
    pub fn new(workers: usize) -> Self {
        PReduceConfig {
            workers,
            ssp_bound: SSP_BOUND_DEFAULT,
            wait_initial: WAIT_INITIAL,
            wait_min: WAIT_MIN,
            wait_max: WAIT_MAX,
        }
    }
}

/// The group being formed.
#[derive(Debug, Clone)]
struct Open {
    members: Vec<WorkerId>,
    opened_at: Duration,
    /// None: a graph sync, which waits for connectivity.
    deadline: Option<Duration>,
}

/// The partial-reduce scheduler of one stage key.
#[derive(Debug, Clone)]
pub struct PartialReduce {
    cfg: PReduceConfig,
    roster: Roster,
    wait: Vec<Duration>,
    /// Has been ready at least once (SD-Pipe's `avail_workers_`).
    seen: Vec<bool>,
    waiting: Vec<bool>,
    open: Option<Open>,
    sets: UnionFind,
    /// Updates since the last window boundary.
    updates: u64,
    graph_sync_due: bool,
    /// Scratch for the coverage test: a root has a ready member.
    covered: Vec<bool>,
}

impl PartialReduce {
    pub fn new(cfg: PReduceConfig) -> Result<Self, GroupError> {
        let roster = Roster::new(cfg.workers)?;
        let bad = |field, value: String, why| Err(GroupError::Config { field, value, why });
        if cfg.ssp_bound == 0 {
            return bad("ssp_bound", "0".into(), "it must be at least 1");
        }
        if cfg.wait_min.is_zero() || cfg.wait_min > cfg.wait_max {
            return bad(
                "wait_min",
                format!("{:?}", cfg.wait_min),
                "it must be positive and at most wait_max",
            );
        }
        if cfg.wait_initial < cfg.wait_min || cfg.wait_initial > cfg.wait_max {
            return bad(
                "wait_initial",
                format!("{:?}", cfg.wait_initial),
                "it must lie within [wait_min, wait_max]",
            );
        }
        let p = cfg.workers;
        Ok(PartialReduce {
            cfg,
            roster,
            wait: vec![cfg.wait_initial; p],
            seen: vec![false; p],
            waiting: vec![false; p],
            open: None,
            sets: UnionFind::new(p),
            updates: 0,
            graph_sync_due: false,
            covered: vec![false; p],
        })
    }

    pub fn config(&self) -> &PReduceConfig {
        &self.cfg
    }

    /// `worker`'s current wait (it sets the deadline of a group it opens).
    pub fn wait(&self, worker: WorkerId) -> Option<Duration> {
        self.wait.get(worker).copied()
    }

    /// The next group that opens will be a graph sync (once every live
    /// worker has been ready).
    pub fn graph_sync_due(&self) -> bool {
        self.graph_sync_due
    }

    /// Whether the group being formed is a graph sync.
    pub fn graph_sync_open(&self) -> bool {
        self.open.as_ref().is_some_and(|o| o.deadline.is_none())
    }

    /// The workers waiting in the group being formed, in arrival order.
    pub fn waiting(&self) -> &[WorkerId] {
        self.open.as_ref().map_or(&[], |o| &o.members)
    }

    /// Updates since the last window boundary (`ssp_bound x P` apart).
    pub fn updates_in_window(&self) -> u64 {
        self.updates
    }

    /// The live workers that `worker` has been averaged with, transitively,
    /// since the last graph sync (itself included), sorted.
    pub fn merged_with(&mut self, worker: WorkerId) -> Vec<WorkerId> {
        if !self.roster.is_live(worker) {
            return Vec::new();
        }
        let root = self.sets.find(worker);
        self.roster
            .live()
            .filter(|&v| self.sets.find(v) == root)
            .collect()
    }

    /// Every live worker is in one union-find set.
    fn connected(&mut self) -> bool {
        let Some(first) = self.roster.live().next() else {
            return true;
        };
        let root = self.sets.find(first);
        self.roster.live().all(|v| self.sets.find(v) == root)
    }

    /// Why the open group closes now, if it does.
    fn closes(&mut self) -> Option<CloseReason> {
        let open = self.open.as_ref()?;
        let graph = open.deadline.is_none();
        if open.members.len() == self.roster.live_count() {
            return Some(if graph {
                CloseReason::GraphSync
            } else {
                CloseReason::AllReady
            });
        }
        if !graph {
            return None;
        }
        // Every live worker's set has a ready member.
        self.covered.iter_mut().for_each(|c| *c = false);
        for &m in &open.members {
            let r = self.sets.find(m);
            self.covered[r] = true;
        }
        self.roster
            .live()
            .all(|v| {
                let r = self.sets.find(v);
                self.covered[r]
            })
            .then_some(CloseReason::GraphSync)
    }

    fn close(&mut self, at: Duration, reason: CloseReason) -> Vec<Group> {
        let Some(open) = self.open.take() else {
            return Vec::new();
        };
        let mut members = open.members;
        members.sort_unstable();
        for &m in &members {
            self.waiting[m] = false;
        }
        // A graph sync is done: every worker was averaged in. Then count
        // the updates; crossing a window boundary makes the next group a
        // graph sync (in SD-Pipe's order: reset first, then count).
        let graph = reason == CloseReason::GraphSync;
        if graph {
            self.sets.reset();
            self.graph_sync_due = false;
        }
        self.updates += members.len() as u64;
        let window = self.cfg.ssp_bound * self.roster.live_count().max(1) as u64;
        if self.updates >= window {
            self.updates %= window;
            self.graph_sync_due = true;
        }
        let parts: Vec<Vec<WorkerId>> = if graph {
            vec![members]
        } else if self.cfg.workers > PAIRWISE_ABOVE_WORKERS {
            members.chunks(2).map(<[WorkerId]>::to_vec).collect()
        } else {
            vec![members]
        };
        let mut out = Vec::with_capacity(parts.len());
        for part in parts {
            if !graph {
                for w in part.windows(2) {
                    self.sets.union(w[0], w[1]);
                }
            }
            for &m in &part {
                let w = self.wait[m];
                self.wait[m] = if part.len() < GROUP_MIN_MEMBERS {
                    w.mul_f64(WAIT_GROW).min(self.cfg.wait_max)
                } else {
                    w.mul_f64(WAIT_SHRINK).max(self.cfg.wait_min)
                };
            }
            out.push(Group {
                members: part,
                opened_at: open.opened_at,
                closed_at: at,
                reason,
            });
        }
        out
    }

    fn close_if_complete(&mut self, now: Duration, out: &mut Vec<Group>) {
        if let Some(reason) = self.closes() {
            out.extend(self.close(now, reason));
        }
    }
}

impl GroupScheduler for PartialReduce {
    fn workers(&self) -> usize {
        self.roster.workers()
    }

    fn ready(&mut self, worker: WorkerId, now: Duration) -> Result<Vec<Group>, GroupError> {
        self.roster.check(worker)?;
        self.roster.check_time(worker, now)?;
        // Still waiting, unless its group's deadline has passed.
        let due = self.next_deadline().is_some_and(|d| now >= d);
        if self.waiting[worker] && !due {
            return Err(GroupError::AlreadyWaiting { worker });
        }
        let mut out = self.poll(now);
        self.seen[worker] = true;
        if self.open.is_none() {
            let mut graph = self.graph_sync_due && self.roster.live().all(|v| self.seen[v]);
            if graph && self.connected() {
                // Every live worker was averaged in already: the window is
                // done without a graph sync.
                self.sets.reset();
                self.graph_sync_due = false;
                graph = false;
            }
            self.open = Some(Open {
                members: Vec::new(),
                opened_at: now,
                deadline: (!graph).then(|| now + self.wait[worker]),
            });
        }
        if let Some(open) = self.open.as_mut() {
            open.members.push(worker);
        }
        self.waiting[worker] = true;
        self.close_if_complete(now, &mut out);
        Ok(out)
    }

    fn poll(&mut self, now: Duration) -> Vec<Group> {
        if !self.roster.advance(now) {
            return Vec::new();
        }
        match self.open.as_ref().and_then(|o| o.deadline) {
            Some(deadline) if now >= deadline => self.close(deadline, CloseReason::Deadline),
            _ => Vec::new(),
        }
    }

    fn next_deadline(&self) -> Option<Duration> {
        self.open.as_ref().and_then(|o| o.deadline)
    }

    fn remove(&mut self, worker: WorkerId, now: Duration) -> Result<Vec<Group>, GroupError> {
        self.roster.check(worker)?;
        self.roster.check_time(worker, now)?;
        let mut out = self.poll(now);
        self.roster.remove(worker)?;
        if self.waiting[worker] {
            self.waiting[worker] = false;
            if let Some(open) = self.open.as_mut() {
                open.members.retain(|&m| m != worker);
                if open.members.is_empty() {
                    self.open = None;
                }
            }
        }
        self.close_if_complete(now, &mut out);
        Ok(out)
    }
}

/// Union-find over worker ids, path halving and union by size.
#[derive(Debug, Clone)]
struct UnionFind {
    parent: Vec<usize>,
    size: Vec<usize>,
}

impl UnionFind {
    fn new(n: usize) -> Self {
        UnionFind {
            parent: (0..n).collect(),
            size: vec![1; n],
        }
    }

    fn find(&mut self, mut x: usize) -> usize {
        while self.parent[x] != x {
            self.parent[x] = self.parent[self.parent[x]];
            x = self.parent[x];
        }
        x
    }

    fn union(&mut self, a: usize, b: usize) {
        let (mut a, mut b) = (self.find(a), self.find(b));
        if a == b {
            return;
        }
        if self.size[a] < self.size[b] {
            std::mem::swap(&mut a, &mut b);
        }
        self.parent[b] = a;
        self.size[a] += self.size[b];
    }

    fn reset(&mut self) {
        for (i, p) in self.parent.iter_mut().enumerate() {
            *p = i;
        }
        self.size.iter_mut().for_each(|s| *s = 1);
    }
}

#[cfg(test)]
#[path = "preduce_tests.rs"]
mod tests;
