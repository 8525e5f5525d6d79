//! How many loads from the memory servers share one GPU server's link and
//! the memory servers' links.
//!
//! The dispatcher counts, per GPU server, its GPUs that are loading a model
//! from the memory servers (a batch sent for a model its GPU finds on no
//! device and in no host cache, from the send to its first reply; a
//! prefetch of such a model, from the order to its report), and integrates
//! over time the share of a link a load there gets: the count on the GPU
//! server's link or, where the memory servers' links are the narrower, the
//! share they give ([`memservers_share`]). A GPU runs its jobs one at a
//! time, so its loads follow one another and count once. A load's measured time then
//! tells what it would have taken alone: its part beyond the host-cached
//! path divided by the mean share while it ran ([`LinkLoad::share_since`]).
//! A new load's estimate is that part again, times the share it would have.
//!
//! Without this, a load measured while every GPU of a server cold-started
//! at once (the start of a run) set the estimate of every later load, which
//! then rejected the requests that would have measured a load alone: a model
//! nothing held stayed shut out. Assumed: every NIC (GPU servers' and memory
//! servers') has the same rate and is shared fairly (the runtime's fetch
//! engine interleaves every waiting model's groups); each model's slices
//! are spread over the memory servers alike (as `deploy` spreads them);
//! the memory servers' count is that of those alive (the controller's
//! registry, read each tick).

use crate::policy::Micros;

/// One GPU server's GPUs that load, and their share integrated over time.
#[derive(Debug, Default, Clone)]
pub(super) struct LinkLoad {
    loads: u32,
    /// The memory servers' side ([`memservers_share`]; 0 when unknown).
    floor: f64,
    /// Share x microseconds, up to `at`.
    area: f64,
    at: Micros,
}

/// Where one load started: what [`LinkLoad::share_since`] takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct LoadMark {
    since: Micros,
    area: f64,
}

/// The share of a link each load gets on the memory servers' side, from
/// `loads`, the GPUs loading on each GPU server (its order is not kept),
/// and the `memservers`: the least s >= 1 with the sum over GPU servers of
/// min(loads / s, 1) at most `memservers`. Each memory server's link sends
/// every GPU server its part of that server's loads; a GPU server whose own
/// link carries more than s loads takes at most one link's worth, and the
/// memory servers share what is left among the other loads (max-min fair).
/// 1 while no more GPU servers load than there are memory servers: their
/// links are never the narrower then.
pub(super) fn memservers_share(loads: &mut [u32], memservers: u32) -> f64 {
    let m = memservers as usize;
    let loading = loads.iter().filter(|&&n| n > 0).count();
    if m == 0 || loading <= m {
        return 1.0;
    }
    loads.sort_unstable_by(|a, b| b.cmp(a));
    let mut rest: u64 = loads.iter().map(|&n| u64::from(n)).sum();
    // The k busiest GPU servers take a link each; the rest share what is left.
    for (k, &n) in loads.iter().enumerate().take(m) {
        let s = rest as f64 / (m - k) as f64;
        if f64::from(n) <= s {
            return s.max(1.0);
        }
        rest -= u64::from(n);
    }
    // Not reached: with more GPU servers loading than memory servers, the
    // (m-1)th busiest carries fewer loads than it and all after it.
    rest.max(1) as f64
}

impl LinkLoad {
    fn advance(&mut self, now: Micros) {
        if now > self.at {
            self.area += self.share() * (now - self.at) as f64;
            self.at = now;
        }
    }

    /// The share a load here has now: the count on this link, or the
    /// memory servers' side where that is more.
    fn share(&self) -> f64 {
        f64::from(self.loads).max(self.floor)
    }

    /// GPUs loading now.
    pub(super) fn loads(&self) -> u32 {
        self.loads
    }

    /// The memory servers' side changed at `now`.
    pub(super) fn set_floor(&mut self, now: Micros, floor: f64) {
        self.advance(now);
        self.floor = floor;
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

    /// The mean share from `mark` to `now`, the load of `mark` included (so
    /// at least 1); the share then when no time passed.
    pub(super) fn share_since(&mut self, mark: LoadMark, now: Micros) -> f64 {
        self.advance(now);
        let span = now.saturating_sub(mark.since);
        if span == 0 {
            return self.share().max(1.0);
        }
        ((self.area - mark.area) / span as f64).max(1.0)
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

    #[test]
    fn the_memory_servers_side_counts_where_it_is_more() {
        let mut l = LinkLoad::default();
        let a = l.mark(0);
        l.start(0);
        // Alone on this link, but 3 loads in the cluster on 1 memory server
        // for the second half.
        l.set_floor(100, 3.0);
        assert_eq!(l.share_since(a, 200), 2.0);
        // A floor under this link's count changes nothing.
        l.set_floor(200, 0.5);
        let b = l.mark(200);
        l.start(200);
        assert_eq!(l.share_since(b, 300), 2.0);
        assert_eq!(
            l.share_since(b, 300),
            2.0,
            "the same instant, the same share"
        );
    }

    #[test]
    fn the_memory_servers_share_is_max_min_fair() {
        // No more GPU servers load than there are memory servers.
        assert_eq!(memservers_share(&mut [3, 1, 0, 2], 4), 1.0);
        assert_eq!(memservers_share(&mut [9, 9], 2), 1.0);
        // One memory server: every load in the cluster shares its link.
        assert_eq!(memservers_share(&mut [1, 2, 1], 1), 4.0);
        // Two memory servers, four GPU servers of one load each: a link's
        // worth for two loads.
        assert_eq!(memservers_share(&mut [1, 1, 1, 1], 2), 2.0);
        // A GPU server of 6 loads is held back by its own link (one link's
        // worth); the three others' 3 loads share the other link.
        assert_eq!(memservers_share(&mut [1, 6, 1, 1], 2), 3.0);
        // Unknown memory servers count as wide links.
        assert_eq!(memservers_share(&mut [1, 1], 0), 1.0);
    }
}
