//! Host memory that transports read into and serve from.
//!
//! A [`HostBuffer`] is one anonymous mapping, page-aligned, faulted in once
//! at creation (first-touch page faults cost ~10x a copy on the machines we
//! run on, so the data path must never take them), and never moved. It is the
//! memory server's arena and the GPU server's cache; RDMA transports register
//! it once.
//!
//! Its bytes are shared between threads through raw pointers, exactly like
//! registered RDMA memory: the owner of a range (the extent allocator, the
//! block cache) guarantees that no one reads a range while it is written.
//! That contract is why the accessors are `unsafe`.

use std::ops::Range;
use std::ptr::NonNull;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot map {bytes} bytes of host memory: {source}")]
    Map {
        bytes: usize,
        source: std::io::Error,
    },
    #[error("a host buffer cannot be empty")]
    Empty,
}

/// Whether to ask for explicit huge pages (hugetlbfs) first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePages {
    /// Try `MAP_HUGETLB`, fall back to normal pages (with transparent huge pages advised).
    Try,
    /// Normal pages, transparent huge pages advised.
    No,
}

pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    mapped_len: usize,
    huge: bool,
}

// SAFETY: HostBuffer owns its mapping; concurrent access to its bytes goes
// through the unsafe accessors, whose callers uphold the no-overlapping-writes
// contract described in the module docs.
unsafe impl Send for HostBuffer {}
// SAFETY: as above.
unsafe impl Sync for HostBuffer {}

const HUGE_PAGE_BYTES: usize = 2 << 20;

impl HostBuffer {
    /// Maps `len` bytes, zeroed and faulted in.
    pub fn new(len: usize, huge: HugePages) -> Result<Self, MemoryError> {
        if len == 0 {
            return Err(MemoryError::Empty);
        }
        if huge == HugePages::Try {
            let mapped_len = len.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES;
            if let Ok(ptr) = Self::map(mapped_len, libc::MAP_HUGETLB) {
                return Ok(HostBuffer {
                    ptr,
                    len,
                    mapped_len,
                    huge: true,
                });
            }
        }
        let ptr = Self::map(len, 0).map_err(|source| MemoryError::Map { bytes: len, source })?;
        // SAFETY: ptr/len is the mapping just created. Advice is best effort.
        unsafe {
            libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE);
        }
        let buf = HostBuffer {
            ptr,
            len,
            mapped_len: len,
            huge: false,
        };
        buf.touch();
        Ok(buf)
    }

    fn map(len: usize, extra_flags: libc::c_int) -> Result<NonNull<u8>, std::io::Error> {
        // SAFETY: an anonymous private mapping has no preconditions; the
        // result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE | extra_flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(NonNull::new(p.cast()).expect("mmap never returns null on success"))
    }

    /// Writes one byte per page so every page is resident before use, even
    /// where MAP_POPULATE was ignored.
    fn touch(&self) {
        const PAGE: usize = 4096;
        let mut off = 0;
        while off < self.len {
            // SAFETY: off < len, inside our mapping; nothing else holds it yet.
            unsafe { self.ptr.as_ptr().add(off).write_volatile(0) };
            off += PAGE;
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether the mapping got explicit huge pages.
    pub fn huge_pages(&self) -> bool {
        self.huge
    }

    /// Start of the buffer, for registering with a NIC or a GPU driver.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, range: &Range<usize>) {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} outside a host buffer of {} bytes",
            self.len
        );
    }

    /// Shared view of `range`.
    ///
    /// # Safety
    /// No one may write any byte of `range` while the returned slice lives.
    pub unsafe fn slice(&self, range: Range<usize>) -> &[u8] {
        self.check(&range);
        // SAFETY: in bounds (checked); no concurrent writers (caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(range.start), range.len()) }
    }

    /// Exclusive view of `range`.
    ///
    /// # Safety
    /// No one else may read or write any byte of `range` while the returned
    /// slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, range: Range<usize>) -> &mut [u8] {
        self.check(&range);
        // SAFETY: in bounds (checked); exclusive access (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(range.start), range.len()) }
    }
}

impl HostBuffer {
    /// All bytes, through exclusive ownership: `&mut self` proves no transport
    /// or other thread holds this buffer (they hold it through an `Arc`), so
    /// no read can be in flight into it.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: in bounds by construction; `&mut self` excludes every other view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping we created; no slices outlive
        // self because they borrow it.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.mapped_len);
        }
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .field("huge", &self.huge)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_writable_and_bounded() {
        let b = HostBuffer::new(10_000, HugePages::No).unwrap();
        assert_eq!(b.len(), 10_000);
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        // SAFETY: single-threaded test, no overlapping views.
        unsafe {
            assert!(b.slice(0..10_000).iter().all(|&x| x == 0));
            b.slice_mut(100..200).fill(7);
            assert_eq!(b.slice(99..101), &[0, 7]);
        }
        assert!(HostBuffer::new(0, HugePages::No).is_err());
    }

    #[test]
    #[should_panic(expected = "outside a host buffer")]
    fn out_of_range_panics() {
        let b = HostBuffer::new(100, HugePages::Try).unwrap();
        // SAFETY: the call panics before making a slice.
        let _ = unsafe { b.slice(50..101) };
    }
}
