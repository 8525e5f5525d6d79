//! The arena's extent allocator: pure bookkeeping over `[0, capacity)`, no IO.
//!
//! Sizes are rounded up to [`PARAM_ALIGN_BYTES`], so every extent starts and
//! ends on that alignment. Free space is kept twice: by start (to coalesce a
//! freed range with its neighbours) and by (length, start) (for best fit in
//! O(log n)). Best fit keeps large runs intact for large models.
//!
//! **Invariant:** allocated extents and free runs are disjoint, together cover
//! `[0, capacity)`, and no two free runs touch (they would have been merged).

use std::collections::{BTreeMap, BTreeSet};

use distmind_common::limits::PARAM_ALIGN_BYTES;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    #[error(
        "memory server full: asked {asked_bytes} bytes, {free_bytes} free \
         (largest run {largest_free_bytes}); free models or add memory servers"
    )]
    Full {
        asked_bytes: u64,
        free_bytes: u64,
        largest_free_bytes: u64,
    },
    #[error("cannot allocate an extent of 0 bytes")]
    Empty,
    #[error("no extent starts at offset {0}")]
    UnknownExtent(u64),
}

/// Counters of an [`Allocator`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocStats {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    pub largest_free_bytes: u64,
    pub extents: u64,
}

#[derive(Debug)]
pub struct Allocator {
    capacity_bytes: u64,
    used_bytes: u64,
    /// Free runs: start -> length.
    free_by_start: BTreeMap<u64, u64>,
    /// The same runs keyed by (length, start), for best fit.
    free_by_len: BTreeSet<(u64, u64)>,
    /// Allocated extents: start -> length (rounded).
    extents: BTreeMap<u64, u64>,
}

/// `bytes` rounded up to the parameter alignment, or `None` on overflow.
pub fn round_up(bytes: u64) -> Option<u64> {
    bytes
        .checked_add(PARAM_ALIGN_BYTES - 1)
        .map(|b| b & !(PARAM_ALIGN_BYTES - 1))
}

impl Allocator {
    /// Manages `[0, capacity_bytes)` rounded down to the alignment.
    pub fn new(capacity_bytes: u64) -> Self {
        let capacity_bytes = capacity_bytes & !(PARAM_ALIGN_BYTES - 1);
        let mut a = Allocator {
            capacity_bytes,
            used_bytes: 0,
            free_by_start: BTreeMap::new(),
            free_by_len: BTreeSet::new(),
            extents: BTreeMap::new(),
        };
        if capacity_bytes > 0 {
            a.insert_free(0, capacity_bytes);
        }
        a
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Reserves `bytes` (rounded up); returns the start and the rounded length.
    pub fn alloc(&mut self, bytes: u64) -> Result<(u64, u64), AllocError> {
        if bytes == 0 {
            return Err(AllocError::Empty);
        }
        let full = || AllocError::Full {
            asked_bytes: bytes,
            free_bytes: self.capacity_bytes - self.used_bytes,
            largest_free_bytes: self.largest_free_bytes(),
        };
        let len = round_up(bytes).ok_or_else(full)?;
        let Some(&(run_len, run_start)) = self.free_by_len.range((len, 0)..).next() else {
            return Err(full());
        };
        self.remove_free(run_start, run_len);
        if run_len > len {
            self.insert_free(run_start + len, run_len - len);
        }
        self.extents.insert(run_start, len);
        self.used_bytes += len;
        debug_assert!(run_start % PARAM_ALIGN_BYTES == 0);
        debug_assert!(run_start + len <= self.capacity_bytes);
        Ok((run_start, len))
    }

    /// Returns the extent starting at `offset` to the free space, merging it
    /// with free neighbours. Returns its length.
    pub fn free(&mut self, offset: u64) -> Result<u64, AllocError> {
        let len = self
            .extents
            .remove(&offset)
            .ok_or(AllocError::UnknownExtent(offset))?;
        self.used_bytes -= len;
        let mut start = offset;
        let mut run_len = len;
        if let Some((&prev_start, &prev_len)) = self.free_by_start.range(..offset).next_back() {
            if prev_start + prev_len == offset {
                self.remove_free(prev_start, prev_len);
                start = prev_start;
                run_len += prev_len;
            }
        }
        let end = offset + len;
        if let Some(&next_len) = self.free_by_start.get(&end) {
            self.remove_free(end, next_len);
            run_len += next_len;
        }
        self.insert_free(start, run_len);
        Ok(len)
    }

    /// Length of the extent starting at `offset`, if there is one.
    pub fn extent_len(&self, offset: u64) -> Option<u64> {
        self.extents.get(&offset).copied()
    }

    pub fn largest_free_bytes(&self) -> u64 {
        self.free_by_len
            .iter()
            .next_back()
            .map_or(0, |&(len, _)| len)
    }

    pub fn stats(&self) -> AllocStats {
        AllocStats {
            capacity_bytes: self.capacity_bytes,
            used_bytes: self.used_bytes,
            free_bytes: self.capacity_bytes - self.used_bytes,
            largest_free_bytes: self.largest_free_bytes(),
            extents: self.extents.len() as u64,
        }
    }

    /// Free runs in address order (for tests and diagnostics).
    pub fn free_runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.free_by_start.iter().map(|(&s, &l)| (s, l))
    }

    fn insert_free(&mut self, start: u64, len: u64) {
        debug_assert!(len > 0);
        self.free_by_start.insert(start, len);
        self.free_by_len.insert((len, start));
    }

    fn remove_free(&mut self, start: u64, len: u64) {
        let a = self.free_by_start.remove(&start);
        let b = self.free_by_len.remove(&(len, start));
        debug_assert!(
            a == Some(len) && b,
            "free run {start}+{len} missing from an index"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    const A: u64 = PARAM_ALIGN_BYTES;

    #[test]
    fn rounds_up_and_best_fits() {
        let mut a = Allocator::new(100 * A + 7);
        assert_eq!(a.capacity_bytes(), 100 * A);
        assert_eq!(a.alloc(1).unwrap(), (0, A));
        assert_eq!(a.alloc(A + 1).unwrap(), (A, 2 * A));
        let (c, _) = a.alloc(10 * A).unwrap();
        let (_d, _) = a.alloc(A).unwrap();
        // Free a 2A hole and a 10A hole; a 2A request lands in the 2A hole.
        a.free(A).unwrap();
        a.free(c).unwrap();
        assert_eq!(a.alloc(2 * A).unwrap(), (A, 2 * A));
        assert_eq!(a.alloc(0), Err(AllocError::Empty));
        assert_eq!(a.free(12345), Err(AllocError::UnknownExtent(12345)));
    }

    #[test]
    fn full_names_asked_free_and_largest_run() {
        let mut a = Allocator::new(8 * A);
        let x = a.alloc(2 * A).unwrap().0;
        a.alloc(2 * A).unwrap();
        a.free(x).unwrap();
        // 6A free in total, but the largest run is 4A.
        let err = a.alloc(5 * A).unwrap_err();
        assert_eq!(
            err,
            AllocError::Full {
                asked_bytes: 5 * A,
                free_bytes: 6 * A,
                largest_free_bytes: 4 * A
            }
        );
        assert!(err.to_string().starts_with(&format!(
            "memory server full: asked {} bytes, {} free (largest run {})",
            5 * A,
            6 * A,
            4 * A
        )));
        assert!(matches!(a.alloc(u64::MAX), Err(AllocError::Full { .. })));
    }

    /// Random alloc/free sequences: extents never overlap, every byte is
    /// either used or free, and freeing everything coalesces to one run.
    #[test]
    fn random_sequences_conserve_space_and_coalesce() {
        for seed in 0..20u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let cap = 1000 * A;
            let mut a = Allocator::new(cap);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for _ in 0..2000 {
                if live.is_empty() || rng.gen_bool(0.55) {
                    let bytes = rng.gen_range(1..=40 * A);
                    match a.alloc(bytes) {
                        Ok((off, len)) => {
                            assert!(len >= bytes && len - bytes < A && off % A == 0);
                            live.push((off, len));
                        }
                        Err(AllocError::Full {
                            largest_free_bytes, ..
                        }) => {
                            assert!(largest_free_bytes < round_up(bytes).unwrap());
                        }
                        Err(e) => panic!("{e}"),
                    }
                } else {
                    let i = rng.gen_range(0..live.len());
                    let (off, len) = live.swap_remove(i);
                    assert_eq!(a.free(off).unwrap(), len);
                }
                check(&a, &live, cap);
            }
            for (off, _) in live.drain(..) {
                a.free(off).unwrap();
            }
            assert_eq!(a.free_runs().collect::<Vec<_>>(), vec![(0, cap)]);
            assert_eq!(a.stats().used_bytes, 0);
        }
    }

    fn check(a: &Allocator, live: &[(u64, u64)], cap: u64) {
        let mut all: Vec<(u64, u64, bool)> = live.iter().map(|&(o, l)| (o, l, true)).collect();
        all.extend(a.free_runs().map(|(o, l)| (o, l, false)));
        all.sort();
        let mut pos = 0;
        let mut prev_free = false;
        for (o, l, used) in all {
            assert_eq!(o, pos, "gap or overlap at {o}");
            assert!(used || !prev_free, "two free runs touch at {o}");
            prev_free = !used;
            pos = o + l;
        }
        assert_eq!(pos, cap);
        let used: u64 = live.iter().map(|&(_, l)| l).sum();
        let s = a.stats();
        assert_eq!(s.used_bytes, used);
        assert_eq!(s.free_bytes + s.used_bytes, cap);
        assert_eq!(s.extents, live.len() as u64);
    }
}
