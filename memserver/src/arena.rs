//! The arena: one [`HostBuffer`] plus the [`ExtentTable`] that says who may
//! touch which of its bytes. The only module of this crate with `unsafe`.
//!
//! Every access to the buffer goes through a lease taken from the table:
//! [`ReadLease`] (shared, Committed extents only) or an exclusive lease
//! (a write chunk in [`Arena::write`], or [`CommitLease`] for the checksum
//! pass, Writing extents only). The table's invariant (see
//! [`crate::extents`]) guarantees that a range under a shared lease has no
//! exclusive lease on any of its bytes and that exclusive leases never
//! overlap, which is exactly the contract of [`HostBuffer::slice`] and
//! [`HostBuffer::slice_mut`]. A lease is released in its `Drop`, after the
//! slice it handed out (which borrows the lease) is gone.
#![allow(unsafe_code)]

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use distmind_transport::{HostBuffer, HugePages, MemoryError};

use crate::extents::{ExtentError, ExtentTable, FreeOutcome, TableStats};

#[derive(Debug)]
pub struct Arena {
    /// Shared with one-sided data paths that register it (libfabric, verbs):
    /// their NICs or providers read it directly, as the read lease rules
    /// describe in [`crate::onesided`].
    buf: Arc<HostBuffer>,
    table: Mutex<ExtentTable>,
}

fn to_range(r: Range<u64>) -> Range<usize> {
    // Offsets come from the table, whose capacity is at most the buffer's
    // length, a usize.
    r.start as usize..r.end as usize
}

impl Arena {
    /// Maps and faults in `capacity_bytes` of memory (slow for big arenas:
    /// call it once, at start-up).
    pub fn new(capacity_bytes: u64, huge_pages: bool) -> Result<Arena, MemoryError> {
        let len = usize::try_from(capacity_bytes).map_err(|_| MemoryError::Map {
            bytes: usize::MAX,
            source: std::io::Error::other("capacity does not fit in the address space"),
        })?;
        let huge = if huge_pages {
            HugePages::Try
        } else {
            HugePages::No
        };
        let buf = Arc::new(HostBuffer::new(len, huge)?);
        Ok(Arena {
            buf,
            table: Mutex::new(ExtentTable::new(capacity_bytes)),
        })
    }

    /// The arena's memory, for registering it with a one-sided data path.
    pub fn buffer(&self) -> &Arc<HostBuffer> {
        &self.buf
    }

    /// Whether the buffer got explicit huge pages.
    pub fn huge_pages(&self) -> bool {
        self.buf.huge_pages()
    }

    fn table(&self) -> MutexGuard<'_, ExtentTable> {
        // A panic while holding the lock means the table may be inconsistent;
        // serving on would risk exactly the overlaps the table prevents.
        self.table
            .lock()
            .expect("extent table lock poisoned by an earlier panic")
    }

    pub fn alloc(&self, bytes: u64, owner: &str) -> Result<u64, ExtentError> {
        self.table().alloc(bytes, owner)
    }

    /// Frees the extent at `offset` (see [`ExtentTable::free`]).
    pub fn free(&self, offset: u64, owner: Option<&str>) -> Result<FreeOutcome, ExtentError> {
        self.table().free(offset, owner)
    }

    /// Bytes of the live, Committed extent starting at `offset`.
    pub fn committed_len(&self, offset: u64) -> Option<u64> {
        match self.table().describe(offset) {
            Some((_, crate::extents::ExtentState::Committed, bytes)) => Some(bytes),
            _ => None,
        }
    }

    pub fn stats(&self) -> TableStats {
        self.table().stats()
    }

    /// Copies `data` to `offset`, which with its length must lie inside one
    /// Writing extent that nobody else is writing or verifying right now.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), ExtentError> {
        let extent = self.table().begin_write(offset, data.len() as u64)?;
        let range = to_range(offset..offset + data.len() as u64);
        // SAFETY: the table granted an exclusive lease on the extent holding
        // `range` (Writing, no other lease), so no one else reads or writes
        // these bytes until `end_exclusive` below; the slice dies before it.
        unsafe { self.buf.slice_mut(range) }.copy_from_slice(data);
        self.table().end_exclusive(extent, false);
        Ok(())
    }

    /// Takes the extent at `offset` for its checksum pass.
    pub fn begin_commit(self: &Arc<Self>, offset: u64) -> Result<CommitLease, ExtentError> {
        let range = self.table().begin_commit(offset)?;
        Ok(CommitLease {
            arena: Arc::clone(self),
            extent: offset,
            range,
            verified: false,
        })
    }

    /// A shared lease on `len` bytes at `offset`, inside one Committed extent.
    pub fn read(self: &Arc<Self>, offset: u64, len: u64) -> Result<ReadLease, ExtentError> {
        let extent = self.table().begin_read(offset, len)?;
        Ok(ReadLease {
            arena: Arc::clone(self),
            extent,
            range: offset..offset + len,
        })
    }
}

/// Bytes of a Committed extent that cannot be freed or rewritten while this
/// lives.
#[derive(Debug)]
pub struct ReadLease {
    arena: Arc<Arena>,
    extent: u64,
    range: Range<u64>,
}

impl ReadLease {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: this lease is a shared lease on a Committed extent holding
        // `range`; no exclusive lease can exist on it until every shared lease
        // (this one included, which the slice borrows) has dropped.
        unsafe { self.arena.buf.slice(to_range(self.range.clone())) }
    }

    pub fn len(&self) -> u64 {
        self.range.end - self.range.start
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for ReadLease {
    fn drop(&mut self) {
        self.arena.table().end_read(self.extent);
    }
}

/// Exclusive hold on a whole Writing extent while its checksum is verified.
/// Dropping it without [`CommitLease::commit`] leaves the extent Writing.
#[derive(Debug)]
pub struct CommitLease {
    arena: Arc<Arena>,
    extent: u64,
    range: Range<u64>,
    verified: bool,
}

impl CommitLease {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: an exclusive lease on the extent: nobody writes (or reads)
        // it until this lease, which the slice borrows, drops.
        unsafe { self.arena.buf.slice(to_range(self.range.clone())) }
    }

    pub fn offset(&self) -> u64 {
        self.extent
    }

    /// Makes the extent Committed (readable) as the lease ends.
    pub fn commit(mut self) {
        self.verified = true;
    }
}

impl Drop for CommitLease {
    fn drop(&mut self) {
        self.arena.table().end_exclusive(self.extent, self.verified);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::checksum::checksum;

    #[test]
    fn write_commit_read_free_reuse() {
        let arena = Arc::new(Arena::new(4096, false).unwrap());
        let a = arena.alloc(1000, "m").unwrap();
        arena.write(a + 10, b"hello").unwrap();
        assert!(arena.read(a, 10).is_err(), "not committed yet");
        let lease = arena.begin_commit(a).unwrap();
        assert!(arena.write(a, b"x").is_err(), "busy while verifying");
        let sum = checksum(lease.bytes());
        lease.commit();
        let r = arena.read(a + 10, 5).unwrap();
        assert_eq!(r.bytes(), b"hello");
        assert_ne!(sum, 0);
        arena.free(a, Some("m")).unwrap();
        // Still leased: the space is not reused yet.
        let b = arena.alloc(4096, "n");
        assert!(b.is_err());
        drop(r);
        assert_eq!(arena.alloc(4096, "n").unwrap(), a);
    }
}
