//! The extent table: who owns which range of the arena, whether it is being
//! written or may be read, and who is using it right now. Pure bookkeeping,
//! no IO and no memory access; [`crate::arena`] turns its leases into bytes.
//!
//! Life of an extent: `alloc` -> **Writing** (write chunks land here, one at a
//! time) -> `commit` (checksum verified) -> **Committed** (reads served) ->
//! `free` -> space back to the [`Allocator`], deferred while leases are live.
//!
//! **Invariant (what makes the arena's `unsafe` accesses sound):** at any
//! moment each extent is in exactly one of
//! * no lease;
//! * one *exclusive* lease (a write chunk or a commit's checksum pass), only
//!   while the extent is Writing;
//! * any number of *shared* (read) leases, only while it is Committed.
//!
//! Extents never overlap (the allocator's invariant) and a leased range lies
//! inside its extent, so a range is never read while written, nor written by
//! two at once. A freed extent keeps its table entry (state `freeing`) until
//! its last lease drops, and only then is its space returned to the allocator:
//! a reused range is never read while it is being rewritten.

use std::collections::BTreeMap;
use std::ops::Range;

use distmind_common::proto::{ErrorCode, ErrorReply};

use crate::alloc::{AllocError, AllocStats, Allocator};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentState {
    Writing,
    Committed,
}

#[derive(Debug)]
struct Extent {
    owner: String,
    /// Bytes asked for: what is written, verified and readable.
    bytes: u64,
    state: ExtentState,
    /// Shared leases (Committed) or 0/1 exclusive lease (Writing).
    leases: u32,
    /// `free` was asked while leases were live: no new leases, and the space
    /// goes back to the allocator when the last lease drops.
    freeing: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExtentError {
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error("no live extent starts at offset {0}")]
    UnknownExtent(u64),
    #[error("range {start}..{end} is not inside one {wanted} extent")]
    OutOfRange {
        start: u64,
        end: u64,
        wanted: &'static str,
    },
    #[error("extent at {offset} is {state:?}, not Writing: it was already committed")]
    NotWriting { offset: u64, state: ExtentState },
    #[error("extent at {offset} is busy (another write or commit is in progress on it)")]
    Busy { offset: u64 },
    #[error("extent at {offset} is being freed")]
    Freeing { offset: u64 },
    #[error("extent at {offset} belongs to {owner}, not {asked}: not freed")]
    NotOwner {
        offset: u64,
        owner: String,
        asked: String,
    },
}

impl ExtentError {
    /// The reply a control client gets for this error.
    pub fn to_reply(&self) -> ErrorReply {
        let code = match self {
            ExtentError::Alloc(AllocError::Full { .. }) => ErrorCode::Full,
            ExtentError::Alloc(AllocError::Empty) => ErrorCode::BadRequest,
            ExtentError::Alloc(_) | ExtentError::UnknownExtent(_) => ErrorCode::UnknownExtent,
            ExtentError::Freeing { .. } | ExtentError::NotOwner { .. } => ErrorCode::UnknownExtent,
            ExtentError::OutOfRange { .. } | ExtentError::NotWriting { .. } => {
                ErrorCode::BadRequest
            }
            ExtentError::Busy { .. } => ErrorCode::Busy,
        };
        ErrorReply::new(code, self.to_string())
    }
}

/// What `free` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreeOutcome {
    /// The space is free now.
    Released,
    /// Reads were in flight; the space is freed when the last one ends.
    Deferred,
}

/// Counters of an [`ExtentTable`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    pub alloc: AllocStats,
    pub committed: u64,
    pub freeing: u64,
}

#[derive(Debug)]
pub struct ExtentTable {
    alloc: Allocator,
    extents: BTreeMap<u64, Extent>,
}

impl ExtentTable {
    pub fn new(capacity_bytes: u64) -> Self {
        ExtentTable {
            alloc: Allocator::new(capacity_bytes),
            extents: BTreeMap::new(),
        }
    }

    /// A new Writing extent of at least `bytes`; returns its offset.
    pub fn alloc(&mut self, bytes: u64, owner: &str) -> Result<u64, ExtentError> {
        let (offset, _reserved) = self.alloc.alloc(bytes)?;
        let e = Extent {
            owner: owner.to_owned(),
            bytes,
            state: ExtentState::Writing,
            leases: 0,
            freeing: false,
        };
        let prev = self.extents.insert(offset, e);
        assert!(prev.is_none(), "allocator handed out live offset {offset}");
        Ok(offset)
    }

    /// The extent containing `start..end` (not being freed), with its start.
    fn containing(&mut self, start: u64, end: u64) -> Option<(u64, &mut Extent)> {
        let (&off, e) = self.extents.range_mut(..=start).next_back()?;
        let inside = end >= start && start < off + e.bytes && end <= off + e.bytes;
        (inside && !e.freeing).then_some((off, e))
    }

    /// An exclusive lease on `start..start+len` for a write chunk. Returns the
    /// extent's offset, to give to [`Self::end_exclusive`].
    pub fn begin_write(&mut self, start: u64, len: u64) -> Result<u64, ExtentError> {
        let end = start.saturating_add(len);
        let out = ExtentError::OutOfRange {
            start,
            end,
            wanted: "writable",
        };
        let (off, e) = self.containing(start, end).ok_or(out)?;
        if e.state != ExtentState::Writing {
            return Err(ExtentError::NotWriting {
                offset: off,
                state: e.state,
            });
        }
        if e.leases != 0 {
            return Err(ExtentError::Busy { offset: off });
        }
        e.leases = 1;
        Ok(off)
    }

    /// An exclusive lease on a whole Writing extent, to verify its checksum.
    /// Returns its byte range.
    pub fn begin_commit(&mut self, offset: u64) -> Result<Range<u64>, ExtentError> {
        let e = self.live_mut(offset)?;
        if e.state != ExtentState::Writing {
            return Err(ExtentError::NotWriting {
                offset,
                state: e.state,
            });
        }
        if e.leases != 0 {
            return Err(ExtentError::Busy { offset });
        }
        e.leases = 1;
        Ok(offset..offset + e.bytes)
    }

    /// Ends an exclusive lease; `commit` makes the extent Committed. Returns
    /// the length released to the allocator if a deferred free completed.
    pub fn end_exclusive(&mut self, offset: u64, commit: bool) -> Option<u64> {
        let e = self
            .extents
            .get_mut(&offset)
            .expect("exclusive lease on a missing extent");
        assert!(
            e.state == ExtentState::Writing && e.leases == 1,
            "bad exclusive lease"
        );
        e.leases = 0;
        if commit {
            e.state = ExtentState::Committed;
        }
        self.release_if_freed(offset)
    }

    /// A shared lease on `start..start+len`, which must lie inside one
    /// Committed extent. Returns the extent's offset.
    pub fn begin_read(&mut self, start: u64, len: u64) -> Result<u64, ExtentError> {
        let end = start.saturating_add(len);
        let out = ExtentError::OutOfRange {
            start,
            end,
            wanted: "committed",
        };
        match self.containing(start, end) {
            Some((off, e)) if e.state == ExtentState::Committed => {
                e.leases = e.leases.checked_add(1).expect("read leases overflow");
                Ok(off)
            }
            _ => Err(out),
        }
    }

    /// Ends a shared lease; returns the length released if a deferred free
    /// completed.
    pub fn end_read(&mut self, offset: u64) -> Option<u64> {
        let e = self
            .extents
            .get_mut(&offset)
            .expect("read lease on a missing extent");
        assert!(
            e.state == ExtentState::Committed && e.leases > 0,
            "bad read lease"
        );
        e.leases -= 1;
        self.release_if_freed(offset)
    }

    /// Frees the extent at `offset` now, or when its last lease drops.
    /// With `owner`, only if the extent was allocated for that owner.
    pub fn free(&mut self, offset: u64, owner: Option<&str>) -> Result<FreeOutcome, ExtentError> {
        let e = self.live_mut(offset)?;
        if let Some(asked) = owner.filter(|o| *o != e.owner) {
            return Err(ExtentError::NotOwner {
                offset,
                owner: e.owner.clone(),
                asked: asked.to_string(),
            });
        }
        e.freeing = true;
        if self.release_if_freed(offset).is_some() {
            Ok(FreeOutcome::Released)
        } else {
            Ok(FreeOutcome::Deferred)
        }
    }

    /// Owner and state of the live extent at `offset`.
    pub fn describe(&self, offset: u64) -> Option<(&str, ExtentState, u64)> {
        let e = self.extents.get(&offset).filter(|e| !e.freeing)?;
        Some((&e.owner, e.state, e.bytes))
    }

    pub fn stats(&self) -> TableStats {
        let committed = self
            .extents
            .values()
            .filter(|e| e.state == ExtentState::Committed)
            .count() as u64;
        let freeing = self.extents.values().filter(|e| e.freeing).count() as u64;
        TableStats {
            alloc: self.alloc.stats(),
            committed,
            freeing,
        }
    }

    fn live_mut(&mut self, offset: u64) -> Result<&mut Extent, ExtentError> {
        match self.extents.get_mut(&offset) {
            None => Err(ExtentError::UnknownExtent(offset)),
            Some(e) if e.freeing => Err(ExtentError::Freeing { offset }),
            Some(e) => Ok(e),
        }
    }

    fn release_if_freed(&mut self, offset: u64) -> Option<u64> {
        let e = &self.extents[&offset];
        if !(e.freeing && e.leases == 0) {
            return None;
        }
        self.extents.remove(&offset);
        let len = self
            .alloc
            .free(offset)
            .expect("table and allocator disagree");
        Some(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::AllocError;

    fn committed(t: &mut ExtentTable, bytes: u64) -> u64 {
        let off = t.alloc(bytes, "m").unwrap();
        t.begin_commit(off).unwrap();
        t.end_exclusive(off, true);
        off
    }

    #[test]
    fn reads_only_inside_one_committed_extent() {
        let mut t = ExtentTable::new(8192);
        let a = committed(&mut t, 1024);
        let b = committed(&mut t, 1024);
        assert_eq!(b, a + 1024);
        let w = t.alloc(1024, "w").unwrap();
        // The rounding tail of an extent is neither written, verified nor read.
        let odd = t.alloc(1000, "odd").unwrap();
        assert_eq!(t.begin_commit(odd).unwrap(), odd..odd + 1000);
        t.end_exclusive(odd, true);
        assert!(t.begin_read(odd + 1000, 1).is_err());
        assert_eq!(t.begin_read(odd + 999, 1).unwrap(), odd);
        t.end_read(odd);
        assert_eq!(t.begin_read(a + 10, 100).unwrap(), a);
        t.end_read(a);
        assert_eq!(t.begin_read(a, 1024).unwrap(), a);
        t.end_read(a);
        // Spans two extents, not committed, past the end, unallocated.
        for (s, l) in [
            (a + 1000, 100),
            (w, 10),
            (b, 1025),
            (4096, 1),
            (u64::MAX - 1, 10),
        ] {
            assert!(
                matches!(t.begin_read(s, l), Err(ExtentError::OutOfRange { .. })),
                "{s}+{l}"
            );
        }
    }

    #[test]
    fn writes_only_into_writing_extents_one_at_a_time() {
        let mut t = ExtentTable::new(8192);
        let w = t.alloc(1024, "w").unwrap();
        assert_eq!(t.begin_write(w + 512, 512).unwrap(), w);
        assert!(matches!(
            t.begin_write(w, 10),
            Err(ExtentError::Busy { .. })
        ));
        assert!(matches!(t.begin_commit(w), Err(ExtentError::Busy { .. })));
        t.end_exclusive(w, false);
        assert!(matches!(
            t.begin_write(w + 512, 513),
            Err(ExtentError::OutOfRange { .. })
        ));
        t.begin_commit(w).unwrap();
        t.end_exclusive(w, true);
        assert!(matches!(
            t.begin_write(w, 1),
            Err(ExtentError::NotWriting { .. })
        ));
        assert!(matches!(
            t.begin_commit(w),
            Err(ExtentError::NotWriting { .. })
        ));
        assert!(matches!(
            t.begin_commit(w + 512),
            Err(ExtentError::UnknownExtent(_))
        ));
    }

    #[test]
    fn free_with_live_leases_is_deferred_until_the_last_one() {
        let mut t = ExtentTable::new(2048);
        let a = committed(&mut t, 2048);
        t.begin_read(a, 10).unwrap();
        t.begin_read(a, 10).unwrap();
        assert_eq!(t.free(a, None).unwrap(), FreeOutcome::Deferred);
        // No new leases, no double free, and the space is still taken.
        assert!(t.begin_read(a, 10).is_err());
        assert!(matches!(t.free(a, None), Err(ExtentError::Freeing { .. })));
        assert!(matches!(
            t.alloc(512, "x"),
            Err(ExtentError::Alloc(AllocError::Full { .. }))
        ));
        assert_eq!(t.end_read(a), None);
        assert_eq!(t.end_read(a), Some(2048));
        assert_eq!(t.alloc(2048, "x").unwrap(), a);
    }

    #[test]
    fn free_during_a_write_waits_for_it() {
        let mut t = ExtentTable::new(1024);
        let w = t.alloc(1024, "w").unwrap();
        t.begin_write(w, 10).unwrap();
        assert_eq!(t.free(w, None).unwrap(), FreeOutcome::Deferred);
        assert_eq!(t.end_exclusive(w, false), Some(1024));
        assert_eq!(t.stats().alloc.used_bytes, 0);
        assert_eq!(t.free(w, None), Err(ExtentError::UnknownExtent(w)));
    }

    #[test]
    fn errors_map_to_reply_codes() {
        let mut t = ExtentTable::new(1024);
        let e = t.alloc(4096, "big").unwrap_err();
        assert_eq!(e.to_reply().code, ErrorCode::Full);
        assert!(e
            .to_string()
            .contains("asked 4096 bytes, 1024 free (largest run 1024)"));
        assert_eq!(
            t.free(7, None).unwrap_err().to_reply().code,
            ErrorCode::UnknownExtent
        );
    }

    #[test]
    fn a_free_naming_another_owner_frees_nothing() {
        let mut t = ExtentTable::new(2048);
        let a = committed(&mut t, 1024);
        let e = t.free(a, Some("gpt2")).unwrap_err();
        assert_eq!(
            e,
            ExtentError::NotOwner {
                offset: a,
                owner: "m".into(),
                asked: "gpt2".into()
            }
        );
        assert!(e.to_string().contains("belongs to m, not gpt2"), "{e}");
        assert_eq!(e.to_reply().code, ErrorCode::UnknownExtent);
        // Still there and readable; its owner frees it.
        assert!(t.begin_read(a, 10).is_ok());
        assert_eq!(t.end_read(a), None);
        assert_eq!(t.free(a, Some("m")).unwrap(), FreeOutcome::Released);
        assert_eq!(t.stats().alloc.used_bytes, 0);
    }
}
