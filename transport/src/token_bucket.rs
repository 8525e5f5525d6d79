//! A lock-free token bucket (GCRA form) that models a NIC's line rate.
//!
//! The state is one "theoretical arrival time" (`tat`): when the link would
//! be idle again if every byte granted so far were sent at `rate`. Taking `n`
//! bytes moves `tat` forward by `n / rate` and the caller waits until `tat`
//! is at most `burst` ahead of now. All callers share the link, so the
//! aggregate never exceeds `rate` by more than one burst.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How far ahead of now the bucket lets callers run: its depth, in time.
pub const TOKEN_BUCKET_BURST_NS: u64 = 10_000_000;

#[derive(Debug)]
pub struct TokenBucket {
    rate_bytes_per_s: u64,
    burst_ns: u64,
    /// Nanoseconds since `epoch`.
    tat_ns: AtomicU64,
    epoch: Instant,
}

impl TokenBucket {
    pub fn new(rate_bytes_per_s: u64) -> Self {
        Self::with_burst(
            rate_bytes_per_s,
            Duration::from_nanos(TOKEN_BUCKET_BURST_NS),
        )
    }

    pub fn with_burst(rate_bytes_per_s: u64, burst: Duration) -> Self {
        assert!(rate_bytes_per_s > 0, "a token bucket needs a positive rate");
        TokenBucket {
            rate_bytes_per_s,
            burst_ns: u64::try_from(burst.as_nanos()).unwrap_or(u64::MAX),
            tat_ns: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    pub fn rate_bytes_per_s(&self) -> u64 {
        self.rate_bytes_per_s
    }

    /// Takes `bytes` at time `now_ns` (nanoseconds on the bucket's clock) and
    /// returns how long the caller must wait before moving them. Pure apart
    /// from the one atomic, so it is tested on a fake clock.
    pub fn reserve_at(&self, bytes: u64, now_ns: u64) -> Duration {
        let cost_ns =
            u64::try_from(u128::from(bytes) * 1_000_000_000 / u128::from(self.rate_bytes_per_s))
                .unwrap_or(u64::MAX);
        let mut tat = self.tat_ns.load(Ordering::Acquire);
        loop {
            let new_tat = tat.max(now_ns).saturating_add(cost_ns);
            match self.tat_ns.compare_exchange_weak(
                tat,
                new_tat,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Duration::from_nanos(
                        new_tat.saturating_sub(self.burst_ns).saturating_sub(now_ns),
                    )
                }
                Err(cur) => tat = cur,
            }
        }
    }

    /// Takes `bytes` now and returns how long the caller must wait before
    /// moving them (for async callers, which sleep on their own timer).
    pub fn reserve(&self, bytes: u64) -> Duration {
        let now_ns = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.reserve_at(bytes, now_ns)
    }

    /// Takes `bytes`, sleeping as long as the link needs to carry them.
    pub fn acquire(&self, bytes: u64) {
        let wait = self.reserve(bytes);
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn burst_passes_then_rate_is_enforced() {
        // 1 MB/s: 1 byte per microsecond; 10 ms burst = 10 kB.
        let b = TokenBucket::with_burst(1_000_000, Duration::from_millis(10));
        assert_eq!(b.reserve_at(10_000, 0), Duration::ZERO);
        // The next 1 kB must wait 1 ms.
        assert_eq!(b.reserve_at(1_000, 0), Duration::from_millis(1));
        // Another 1 kB, asked 1 ms later: waits 1 ms more from then.
        assert_eq!(b.reserve_at(1_000, MS), Duration::from_millis(1));
    }

    #[test]
    fn idle_time_refills_only_up_to_the_burst() {
        let b = TokenBucket::with_burst(1_000_000, Duration::from_millis(10));
        b.reserve_at(5_000, 0);
        // A long idle period does not bank more than one burst.
        assert_eq!(b.reserve_at(10_000, 1_000 * MS), Duration::ZERO);
        assert_eq!(b.reserve_at(2_000, 1_000 * MS), Duration::from_millis(2));
    }

    #[test]
    fn aggregate_rate_over_many_callers() {
        // 100 chunks of 1 MB at 100 MB/s, all asked at t=0 by "different
        // threads": the last one may start at 1 s - burst.
        let b = TokenBucket::with_burst(100_000_000, Duration::from_millis(10));
        let waits: Vec<_> = (0..100).map(|_| b.reserve_at(1_000_000, 0)).collect();
        assert_eq!(*waits.last().unwrap(), Duration::from_millis(990));
        assert!(waits.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn huge_requests_saturate_instead_of_overflowing() {
        let b = TokenBucket::new(1);
        let w = b.reserve_at(u64::MAX, 0);
        assert!(w > Duration::from_secs(1 << 33));
        assert_eq!(b.rate_bytes_per_s(), 1);
    }
}
