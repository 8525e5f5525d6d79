//! How many loads from the memory servers share one GPU server's link.
//!
//! The dispatcher counts, per GPU server, its GPUs that are loading a model
//! from the memory servers (a batch sent for a model its GPU finds on no
//! device and in no host cache, from the send to its first reply; a
//! prefetch of such a model, from the order to its report), and integrates
//! the count over time. A GPU runs its jobs one at a time, so its loads
//! follow one another and count once. A load's measured time then tells
//! what it would have taken alone: its part beyond the host-cached path
//! divided by the mean number of GPUs that loaded while it ran
//! ([`LinkLoad::share_since`]). A new load's estimate is that part again,
//! times the loads it would share the link with: the other GPUs loading.
//!
//! Without this, a load measured while every GPU of a server cold-started
//! at once (the start of a run) set the estimate of every later load, which
//! then rejected the requests that would have measured a load alone: a model
//! nothing held stayed shut out. Assumed: the GPU server's NIC is the link
//! its loads share, fairly (the runtime's fetch engine interleaves every
//! waiting model's groups). The memory servers' NICs, which loads of many
//! GPU servers share, are not counted.

use crate::policy::Micros;

/// One GPU server's GPUs that load, and their count integrated over time.
#[derive(Debug, Default, Clone)]
pub(super) struct LinkLoad {
    loads: u32,
    /// Loads x microseconds, up to `at`.
    area: u128,
    at: Micros,
}

/// Where one load started: what [`LinkLoad::share_since`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LoadMark {
    since: Micros,
    area: u128,
}

impl LinkLoad {
    fn advance(&mut self, now: Micros) {
        if now > self.at {
            self.area += u128::from(self.loads) * u128::from(now - self.at);
            self.at = now;
        }
    }

    /// GPUs loading now.
    pub(super) fn loads(&self) -> u32 {
        self.loads
    }

    /// Where a load starting at `now` starts.
    pub(super) fn mark(&mut self, now: Micros) -> LoadMark {
        self.advance(now);
        LoadMark {
            since: now,
            area: self.area,
        }
    }

    /// One more GPU loads from `now`.
    pub(super) fn start(&mut self, now: Micros) {
        self.advance(now);
        self.loads += 1;
    }

    /// One GPU fewer loads from `now`.
    pub(super) fn end(&mut self, now: Micros) {
        self.advance(now);
        self.loads = self.loads.saturating_sub(1);
    }

    /// The mean number of GPUs loading from `mark` to `now`, the load of
    /// `mark` included (so at least 1); the count then when no time passed.
    pub(super) fn share_since(&mut self, mark: LoadMark, now: Micros) -> f64 {
        self.advance(now);
        let span = now.saturating_sub(mark.since);
        if span == 0 {
            return f64::from(self.loads.max(1));
        }
        ((self.area - mark.area) as f64 / span as f64).max(1.0)
    }

    /// No GPU loads (the GPU server was lost; the dispatcher drops the
    /// marks).
    pub(super) fn reset(&mut self, now: Micros) {
        self.advance(now);
        self.loads = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_is_the_mean_count_over_the_loads_life() {
        let mut l = LinkLoad::default();
        let a = l.mark(0);
        l.start(0);
        // Alone for 100 us, then with a second load for 100 us.
        let b = l.mark(100);
        l.start(100);
        assert_eq!(l.loads(), 2);
        assert_eq!(l.share_since(a, 200), 1.5);
        l.end(200);
        // b: shared for its first 100 us, alone for the next 100.
        assert_eq!(l.share_since(b, 300), 1.5);
        l.end(300);
        assert_eq!(l.loads(), 0);
        // No time passed: the count at that instant, at least one.
        let c = l.mark(400);
        l.start(400);
        assert_eq!(l.share_since(c, 400), 1.0);
        l.reset(500);
        assert_eq!(l.loads(), 0);
        l.end(600);
        assert_eq!(l.loads(), 0, "never below zero");
    }
}
