//! What every synchronisation scheme of data-parallel pipelines shares: the
//! workers (one per pipeline, for one stage key), the groups they average
//! in, and the scheduler interface on a virtual clock.
//!
//! A scheduler is fed "worker `w` is ready at `now`" (it finished a
//! backward pass and wants to average), "worker `w` is gone" (its pipeline
//! died), and `poll(now)` at the times it asks for (`next_deadline`). It
//! answers with the groups that closed, as values; the caller makes each
//! group average its weights. Time is a `Duration` since any fixed origin
//! the caller picks; nothing here sleeps or reads a clock.

use std::time::Duration;

/// A worker: one pipeline's replica of a stage, numbered `0..workers`.
pub type WorkerId = usize;

/// Most workers (pipelines) one scheduler serves.
pub const WORKERS_MAX: usize = 1024;

const _: () = assert!(WORKERS_MAX >= 2);

/// Why a group closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseReason {
    /// Every live worker was ready.
    AllReady,
    /// Its deadline passed (partial reduce).
    Deadline,
    /// A graph sync: the ready workers, with the union-find sets, connected
    /// every live worker (partial reduce).
    GraphSync,
    /// Both gossip partners were ready (AD-PSGD).
    Paired,
    /// A gossip worker with no live partner this round goes on alone.
    Alone,
}

/// A closed group: its members average together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Sorted, distinct.
    pub members: Vec<WorkerId>,
    /// When its first member said ready.
    pub opened_at: Duration,
    /// When it closed (a deadline closes at the deadline itself, however
    /// late `poll` came).
    pub closed_at: Duration,
    pub reason: CloseReason,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GroupError {
    #[error("a scheduler needs 1 to {max} workers (WORKERS_MAX), not {workers}")]
    Workers { workers: usize, max: usize },
    #[error("scheduler config {field} is {value}: {why}")]
    Config {
        field: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("worker {worker} is unknown: this scheduler has workers 0..{workers}")]
    UnknownWorker { worker: WorkerId, workers: usize },
    #[error("worker {worker} was removed (its pipeline is gone)")]
    Removed { worker: WorkerId },
    #[error("worker {worker} said ready twice: it is already waiting for a group")]
    AlreadyWaiting { worker: WorkerId },
    #[error("worker {worker} said ready at {now:?}, before the scheduler's last event at {last:?}: time must not go back")]
    ClockWentBack {
        worker: WorkerId,
        now: Duration,
        last: Duration,
    },
    #[error("worker {worker} would be {rounds} gossip rounds ahead of the slowest, more than {max} (ROUNDS_AHEAD_MAX)")]
    RoundsAhead {
        worker: WorkerId,
        rounds: u64,
        max: u64,
    },
}

/// A grouping scheme for one stage key.
pub trait GroupScheduler {
    /// Workers it was made for (live or removed).
    fn workers(&self) -> usize;
    /// `worker` is ready at `now`; returns the groups that closed (a due
    /// deadline first, then any this arrival completes).
    fn ready(&mut self, worker: WorkerId, now: Duration) -> Result<Vec<Group>, GroupError>;
    /// Closes the groups due at `now`. A `now` before the last event closes
    /// nothing.
    fn poll(&mut self, now: Duration) -> Vec<Group>;
    /// When to call `poll` next, if anything is waiting on a deadline.
    fn next_deadline(&self) -> Option<Duration>;
    /// `worker`'s pipeline is gone: nothing waits for it from now on;
    /// returns the groups its absence completes.
    fn remove(&mut self, worker: WorkerId, now: Duration) -> Result<Vec<Group>, GroupError>;
}

/// Which workers are live, and the scheduler's clock: checks every call.
#[derive(Debug, Clone)]
pub(crate) struct Roster {
    live: Vec<bool>,
    live_count: usize,
    last: Duration,
}

impl Roster {
    pub(crate) fn new(workers: usize) -> Result<Self, GroupError> {
        if workers == 0 || workers > WORKERS_MAX {
            return Err(GroupError::Workers {
                workers,
                max: WORKERS_MAX,
            });
        }
        Ok(Roster {
            live: vec![true; workers],
            live_count: workers,
            last: Duration::ZERO,
        })
    }

    pub(crate) fn workers(&self) -> usize {
        self.live.len()
    }

    pub(crate) fn live_count(&self) -> usize {
        self.live_count
    }

    pub(crate) fn is_live(&self, w: WorkerId) -> bool {
        self.live.get(w).copied().unwrap_or(false)
    }

    pub(crate) fn live(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.live
            .iter()
            .enumerate()
            .filter_map(|(w, &l)| l.then_some(w))
    }

    /// A known, live worker.
    pub(crate) fn check(&self, worker: WorkerId) -> Result<(), GroupError> {
        match self.live.get(worker) {
            None => Err(GroupError::UnknownWorker {
                worker,
                workers: self.live.len(),
            }),
            Some(false) => Err(GroupError::Removed { worker }),
            Some(true) => Ok(()),
        }
    }

    /// Time moves forward (or stays); records nothing.
    pub(crate) fn check_time(&self, worker: WorkerId, now: Duration) -> Result<(), GroupError> {
        if now < self.last {
            return Err(GroupError::ClockWentBack {
                worker,
                now,
                last: self.last,
            });
        }
        Ok(())
    }

    /// Records `now`; false (and nothing recorded) if it went back.
    pub(crate) fn advance(&mut self, now: Duration) -> bool {
        if now < self.last {
            return false;
        }
        self.last = now;
        true
    }

    pub(crate) fn remove(&mut self, worker: WorkerId) -> Result<(), GroupError> {
        self.check(worker)?;
        self.live[worker] = false;
        self.live_count -= 1;
        Ok(())
    }
}
