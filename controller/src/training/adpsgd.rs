//! The AD-PSGD baseline of SD-Pipe's evaluation (`ADPSGD.get_partner` in
//! `python/hetu/preduce.py`): random pairwise gossip with a seeded RNG.
//!
//! The rule, as SD-Pipe's code has it: every worker keeps a round counter;
//! its `k`-th ready belongs to round `k`. Each round has one random perfect
//! matching of the workers: the live workers (by id) shuffled by the seeded
//! RNG, then positions (0, 1), (2, 3), ... are partners. In SD-Pipe every
//! worker shuffles the same list with `random.Random(0)`, so all agree on
//! it; here the scheduler draws round `k`'s permutation once, when the
//! first worker reaches round `k`, from one `StdRng` seeded with `seed`. A
//! ready worker is paired with its partner of its round: the pair closes
//! when both are ready (the earlier one waits, as SD-Pipe's NCCL call
//! blocks, with no deadline). A worker with no partner (an odd count: the
//! last position) or whose partner was removed goes on alone.
//!
//! Differences: SD-Pipe asserts an even worker count; here an odd one
//! leaves one worker alone per round. Removal is ours. So a schedule is a
//! function of the seed and the order of calls: the same calls give the
//! same groups.
//!
//! (Pairing a ready worker with another *ready* worker picked at random
//! would, with arrivals one call at a time, always find at most one other
//! waiting: no randomness would be left. The round matching is what makes
//! the gossip random.)

use std::collections::VecDeque;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::group::{CloseReason, Group, GroupError, GroupScheduler, Roster, WorkerId, WORKERS_MAX};

/// Most rounds kept between the slowest live worker's and the newest drawn.
pub const ROUNDS_AHEAD_MAX: u64 = 1024;

/// No partner this round (a matching's entry).
const NO_PARTNER: u32 = u32::MAX;

// A worker id fits a matching's entry, and the matchings kept stay within
// 4 MiB (ROUNDS_AHEAD_MAX x WORKERS_MAX entries of 4 bytes).
const _: () = assert!((WORKERS_MAX as u64) < NO_PARTNER as u64);
const _: () = assert!(ROUNDS_AHEAD_MAX * WORKERS_MAX as u64 * 4 <= 4 << 20);

/// Random pairwise gossip for one stage key.
#[derive(Debug, Clone)]
pub struct AdPsgd {
    roster: Roster,
    rng: StdRng,
    /// Each worker's current round.
    round: Vec<u64>,
    /// When a waiting worker said ready.
    waiting_since: Vec<Option<Duration>>,
    /// The matchings of rounds `first_round..`: partner per worker, or
    /// [`NO_PARTNER`].
    matchings: VecDeque<Vec<u32>>,
    first_round: u64,
}

impl AdPsgd {
    pub fn new(workers: usize, seed: u64) -> Result<Self, GroupError> {
        Ok(AdPsgd {
            roster: Roster::new(workers)?,
            rng: StdRng::seed_from_u64(seed),
            round: vec![0; workers],
            waiting_since: vec![None; workers],
            matchings: VecDeque::new(),
            first_round: 0,
        })
    }

    /// `worker`'s current round.
    pub fn round(&self, worker: WorkerId) -> Option<u64> {
        self.round.get(worker).copied()
    }

    /// `worker`'s partner in `round`, drawing matchings up to it.
    fn partner(&mut self, worker: WorkerId, round: u64) -> Result<Option<WorkerId>, GroupError> {
        // Forget the rounds every live worker has passed.
        let slowest = self
            .roster
            .live()
            .map(|w| self.round[w])
            .min()
            .unwrap_or(round);
        while self.first_round < slowest && !self.matchings.is_empty() {
            self.matchings.pop_front();
            self.first_round += 1;
        }
        if self.matchings.is_empty() {
            self.first_round = self.first_round.max(slowest);
        }
        let ahead = round + 1 - self.first_round;
        if ahead > ROUNDS_AHEAD_MAX {
            return Err(GroupError::RoundsAhead {
                worker,
                rounds: ahead,
                max: ROUNDS_AHEAD_MAX,
            });
        }
        while self.first_round + (self.matchings.len() as u64) <= round {
            let mut order: Vec<WorkerId> = self.roster.live().collect();
            order.shuffle(&mut self.rng);
            let mut partner = vec![NO_PARTNER; self.roster.workers()];
            for pair in order.chunks_exact(2) {
                // Ids are below WORKERS_MAX, so below NO_PARTNER.
                partner[pair[0]] = pair[1] as u32;
                partner[pair[1]] = pair[0] as u32;
            }
            self.matchings.push_back(partner);
        }
        let idx = (round - self.first_round) as usize;
        Ok(self.partner_in(idx, worker))
    }

    /// `worker`'s live partner in the `idx`-th kept matching.
    fn partner_in(&self, idx: usize, worker: WorkerId) -> Option<WorkerId> {
        let p = *self.matchings.get(idx)?.get(worker)?;
        (p != NO_PARTNER)
            .then_some(p as WorkerId)
            .filter(|&p| self.roster.is_live(p))
    }

    fn alone(&mut self, worker: WorkerId, since: Duration, now: Duration) -> Group {
        self.round[worker] += 1;
        Group {
            members: vec![worker],
            opened_at: since,
            closed_at: now,
            reason: CloseReason::Alone,
        }
    }
}

impl GroupScheduler for AdPsgd {
    fn workers(&self) -> usize {
        self.roster.workers()
    }

    fn ready(&mut self, worker: WorkerId, now: Duration) -> Result<Vec<Group>, GroupError> {
        self.roster.check(worker)?;
        self.roster.check_time(worker, now)?;
        if self.waiting_since[worker].is_some() {
            return Err(GroupError::AlreadyWaiting { worker });
        }
        let round = self.round[worker];
        let partner = self.partner(worker, round)?;
        self.roster.advance(now);
        let Some(p) = partner else {
            return Ok(vec![self.alone(worker, now, now)]);
        };
        match self.waiting_since[p] {
            Some(since) if self.round[p] == round => {
                self.waiting_since[p] = None;
                self.round[p] += 1;
                self.round[worker] += 1;
                Ok(vec![Group {
                    members: vec![p.min(worker), p.max(worker)],
                    opened_at: since,
                    closed_at: now,
                    reason: CloseReason::Paired,
                }])
            }
            _ => {
                self.waiting_since[worker] = Some(now);
                Ok(Vec::new())
            }
        }
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
        self.waiting_since[worker] = None;
        // Whoever waits for it this round goes on alone.
        let mut out = Vec::new();
        let waiting: Vec<(WorkerId, Duration)> = self
            .waiting_since
            .iter()
            .enumerate()
            .filter_map(|(w, s)| s.map(|s| (w, s)))
            .collect();
        for (w, since) in waiting {
            // Its partner this round, read before the removal hid it.
            let idx = self.round[w].checked_sub(self.first_round);
            let partner = idx
                .and_then(|i| self.matchings.get(i as usize))
                .map(|m| m[w]);
            if partner == Some(worker as u32) {
                self.waiting_since[w] = None;
                out.push(self.alone(w, since, now));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::training::testkit::drive;

    const MS: Duration = Duration::from_millis(1);

    fn run(seed: u64) -> Vec<Group> {
        let mut s = AdPsgd::new(6, seed).unwrap();
        drive(&mut s, 300 * MS, |w, k| {
            MS * (3 + (w as u32 * 7 + k as u32 * 3) % 5)
        })
    }

    #[test]
    fn the_same_seed_gives_the_same_gossip() {
        let a = run(1);
        assert!(a.len() > 50, "{}", a.len());
        assert_eq!(a, run(1));
        assert_ne!(a, run(2));
        for g in &a {
            assert_eq!(g.reason, CloseReason::Paired);
            assert_eq!(g.members.len(), 2);
            assert!(g.members[0] < g.members[1]);
        }
    }

    #[test]
    fn each_round_is_a_perfect_matching() {
        let mut s = AdPsgd::new(4, 9).unwrap();
        let mut seen_partners = std::collections::BTreeSet::new();
        for r in 0..20u32 {
            let now = MS * r;
            let mut groups = Vec::new();
            for w in [3, 0, 2, 1] {
                groups.extend(s.ready(w, now).unwrap());
            }
            assert_eq!(groups.len(), 2, "round {r}: {groups:?}");
            let mut all: Vec<_> = groups.iter().flat_map(|g| g.members.clone()).collect();
            all.sort_unstable();
            assert_eq!(all, [0, 1, 2, 3]);
            seen_partners.insert(groups[0].members.clone());
            for w in 0..4 {
                assert_eq!(s.round(w), Some(u64::from(r) + 1));
            }
        }
        assert!(
            seen_partners.len() > 1,
            "the matching changes from round to round"
        );
    }

    #[test]
    fn an_odd_worker_or_a_removed_partner_goes_alone() {
        let mut s = AdPsgd::new(3, 4).unwrap();
        let mut groups = Vec::new();
        for w in 0..3 {
            groups.extend(s.ready(w, MS).unwrap());
        }
        let sizes: Vec<_> = groups.iter().map(|g| g.members.len()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 3);
        assert!(groups.iter().any(|g| g.reason == CloseReason::Alone));

        // Four workers; whoever waits for a removed partner is released.
        let mut s = AdPsgd::new(4, 4).unwrap();
        let first = s.ready(0, MS).unwrap();
        assert!(first.is_empty(), "0 waits for its partner");
        let partner = (1..4)
            .find(|&w| s.matchings[0][w] == 0)
            .expect("0 has a partner");
        let g = s.remove(partner, 2 * MS).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].members, [0]);
        assert_eq!(g[0].reason, CloseReason::Alone);
        assert_eq!((g[0].opened_at, g[0].closed_at), (MS, 2 * MS));
        assert_eq!(
            s.ready(partner, 3 * MS),
            Err(GroupError::Removed { worker: partner })
        );
    }

    #[test]
    fn a_waiting_worker_cannot_say_ready_again() {
        // Worker 0's partner never shows up: it waits in round 0, and a
        // second ready is refused rather than starting round 1.
        let mut s = AdPsgd::new(2, 1).unwrap();
        assert!(s.ready(0, MS).unwrap().is_empty());
        assert_eq!(
            s.ready(0, 2 * MS),
            Err(GroupError::AlreadyWaiting { worker: 0 })
        );
    }
}
