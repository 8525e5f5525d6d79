//! The AllReduce baseline of SD-Pipe's evaluation (its runs without
//! `--preduce`): every group is every live worker, with no deadline, so the
//! slowest pipeline paces all of them.

use std::time::Duration;

use super::group::{CloseReason, Group, GroupError, GroupScheduler, Roster, WorkerId};

/// Every live worker averages together, every time.
#[derive(Debug, Clone)]
pub struct AllReduce {
    roster: Roster,
    waiting: Vec<bool>,
    members: Vec<WorkerId>,
    opened_at: Duration,
}

impl AllReduce {
    pub fn new(workers: usize) -> Result<Self, GroupError> {
        Ok(AllReduce {
            roster: Roster::new(workers)?,
            waiting: vec![false; workers],
            members: Vec::new(),
            opened_at: Duration::ZERO,
        })
    }

    /// The workers waiting for the others, in arrival order.
    pub fn waiting(&self) -> &[WorkerId] {
        &self.members
    }

    fn close_if_complete(&mut self, now: Duration) -> Vec<Group> {
        if self.members.is_empty() || self.members.len() < self.roster.live_count() {
            return Vec::new();
        }
        let mut members = std::mem::take(&mut self.members);
        members.sort_unstable();
        for &m in &members {
            self.waiting[m] = false;
        }
        vec![Group {
            members,
            opened_at: self.opened_at,
            closed_at: now,
            reason: CloseReason::AllReady,
        }]
    }
}

impl GroupScheduler for AllReduce {
    fn workers(&self) -> usize {
        self.roster.workers()
    }

    fn ready(&mut self, worker: WorkerId, now: Duration) -> Result<Vec<Group>, GroupError> {
        self.roster.check(worker)?;
        self.roster.check_time(worker, now)?;
        if self.waiting[worker] {
            return Err(GroupError::AlreadyWaiting { worker });
        }
        self.roster.advance(now);
        if self.members.is_empty() {
            self.opened_at = now;
        }
        self.members.push(worker);
        self.waiting[worker] = true;
        Ok(self.close_if_complete(now))
    }

    fn poll(&mut self, now: Duration) -> Vec<Group> {
        self.roster.advance(now);
        Vec::new()
    }

    fn next_deadline(&self) -> Option<Duration> {
        None
    }

    fn remove(&mut self, worker: WorkerId, now: Duration) -> Result<Vec<Group>, GroupError> {
        self.roster.check(worker)?;
        self.roster.check_time(worker, now)?;
        self.roster.advance(now);
        self.roster.remove(worker)?;
        if std::mem::take(&mut self.waiting[worker]) {
            self.members.retain(|&m| m != worker);
        }
        Ok(self.close_if_complete(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::training::testkit::drive;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn every_group_is_everyone_and_the_slowest_sets_the_pace() {
        let mut s = AllReduce::new(4).unwrap();
        let groups = drive(
            &mut s,
            200 * MS,
            |w, _| if w == 3 { 20 * MS } else { 5 * MS },
        );
        assert!(!groups.is_empty());
        for (k, g) in groups.iter().enumerate() {
            assert_eq!(g.members, [0, 1, 2, 3]);
            assert_eq!(g.reason, CloseReason::AllReady);
            assert_eq!(g.closed_at, 20 * MS * (k as u32 + 1), "paced by worker 3");
        }
    }

    #[test]
    fn removing_the_last_missing_worker_closes_the_group() {
        let mut s = AllReduce::new(3).unwrap();
        assert!(s.ready(0, MS).unwrap().is_empty());
        assert!(s.ready(2, 2 * MS).unwrap().is_empty());
        assert_eq!(s.next_deadline(), None);
        let g = s.remove(1, 5 * MS).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].members, [0, 2]);
        assert_eq!((g[0].opened_at, g[0].closed_at), (MS, 5 * MS));
        assert_eq!(s.ready(1, 6 * MS), Err(GroupError::Removed { worker: 1 }));
        // A waiting worker removed stops counting as ready.
        assert!(s.ready(0, 6 * MS).unwrap().is_empty());
        assert!(s.remove(0, 7 * MS).unwrap().is_empty());
        assert!(s.waiting().is_empty());
        assert_eq!(s.ready(2, 8 * MS).unwrap()[0].members, [2]);
    }
}
