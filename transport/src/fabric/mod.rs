//! Safe wrappers over libfabric (feature `fabric`): RDM endpoints, registered
//! memory and one-sided `fi_read`, polled through a completion queue.
//!
//! The objects form a tree and each child keeps its parent alive through an
//! `Arc`, so closing always runs child first:
//!
//! ```text
//! Info -> Fabric -> Domain -> { AddressVector, CompletionQueue, MemoryRegion }
//!                          -> Endpoint (bound to one AddressVector and one CompletionQueue)
//! ```
//!
//! Every object is `Send + Sync`: [`Info::get`] asks for `FI_THREAD_SAFE`
//! domains, so the provider serialises concurrent calls itself. One exception
//! is handled here: closing an object while another thread polls a completion
//! queue of the same domain crashes `ofi_rxm` 1.17, so closes take a
//! domain-wide write lock that [`CompletionQueue::poll`] holds for reading.
//!
//! Providers with manual progress (`tcp;ofi_rxm`) move data only while someone
//! polls: the side that serves reads must keep polling its own completion
//! queue ([`CompletionQueue::poll`]) even though no completions appear there.
//!
//! All `unsafe` code of the libfabric data path is in this module; no raw
//! pointer crosses its boundary.

use std::ffi::{CStr, CString};
use std::fmt;
use std::os::raw::{c_char, c_void};
use std::ptr::{self, NonNull};
use std::sync::{Arc, RwLock};

use libfabric_sys as sys;

use crate::memory::HostBuffer;

mod transport;
pub use transport::{
    FabricOptions, FabricTransport, RemoteArena, Resolver, CHUNK_BYTES_DEFAULT,
    READS_IN_FLIGHT_DEFAULT,
};

/// The provider the memory servers and GPU servers use on plain Ethernet.
pub const DEFAULT_PROVIDER: &str = "tcp;ofi_rxm";
/// Completion queue entries when the caller does not choose.
pub const CQ_SIZE_DEFAULT: usize = 1024;
/// Entries read from a completion queue per `fi_cq_read` call.
const CQ_READ_BATCH: usize = 64;
/// Endpoint names are a few dozen bytes (a sockaddr); this bounds the retry.
const NAME_LEN_MAX: usize = 4096;

/// A failed libfabric call: which call, its error number (positive, libfabric
/// or errno numbering) and `fi_strerror`'s text (with context where we have it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricError {
    pub call: &'static str,
    pub code: i32,
    pub message: String,
}

impl fmt::Display for FabricError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed: {} (error {})",
            self.call, self.message, self.code
        )
    }
}

impl std::error::Error for FabricError {}

impl FabricError {
    /// From a negative return value of a libfabric call.
    fn from_ret(call: &'static str, ret: isize) -> Self {
        let code = i32::try_from(ret.unsigned_abs()).unwrap_or(i32::MAX);
        FabricError {
            call,
            code,
            message: strerror(code),
        }
    }

    fn with_context(mut self, context: impl fmt::Display) -> Self {
        self.message = format!("{context}: {}", self.message);
        self
    }

    /// The provider's queue is full (`-FI_EAGAIN`): poll the completion
    /// queue (which also drives progress) and post again.
    pub fn is_again(&self) -> bool {
        self.code == sys::FI_EAGAIN
    }
}

fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror accepts any number and returns a static string (or
    // null on bizarre inputs, which we check).
    let p = unsafe { sys::dm_fi_strerror(code) };
    if p.is_null() {
        return format!("unknown libfabric error {code}");
    }
    // SAFETY: non-null, NUL-terminated static string owned by libfabric.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Return values of libfabric calls: `int` or `ssize_t`.
trait Ret: Copy {
    fn widen(self) -> isize;
}

impl Ret for i32 {
    fn widen(self) -> isize {
        self as isize
    }
}

impl Ret for isize {
    fn widen(self) -> isize {
        self
    }
}

fn check(call: &'static str, ret: impl Ret) -> Result<(), FabricError> {
    let ret = ret.widen();
    if ret < 0 {
        Err(FabricError::from_ret(call, ret))
    } else {
        Ok(())
    }
}

fn invalid(call: &'static str, message: String) -> FabricError {
    FabricError {
        call,
        code: sys::FI_EINVAL,
        message,
    }
}

/// Memory registration modes (`FI_MR_*`) an application supports, or that a
/// provider requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MrMode(u64);

impl MrMode {
    /// Local buffers of data transfers must be registered and their
    /// descriptor passed (this wrapper always does both).
    pub const LOCAL: MrMode = MrMode(sys::FI_MR_LOCAL);
    /// Remote addresses are virtual addresses, not offsets into the region.
    pub const VIRT_ADDR: MrMode = MrMode(sys::FI_MR_VIRT_ADDR);
    /// Only allocated (backed) memory may be registered.
    pub const ALLOCATED: MrMode = MrMode(sys::FI_MR_ALLOCATED);
    /// The provider chooses the keys; read them with [`MemoryRegion::key`].
    pub const PROV_KEY: MrMode = MrMode(sys::FI_MR_PROV_KEY);

    /// The modes this wrapper handles (everything but endpoint-bound MRs, raw
    /// keys, HMEM and the MMU-notify / RMA-event modes).
    pub const SUPPORTED: MrMode = MrMode(
        sys::FI_MR_LOCAL | sys::FI_MR_VIRT_ADDR | sys::FI_MR_ALLOCATED | sys::FI_MR_PROV_KEY,
    );
    /// Keys chosen by the application and offsets as remote addresses.
    pub const NONE: MrMode = MrMode(0);

    pub fn bits(self) -> u64 {
        self.0
    }

    pub fn contains(self, other: MrMode) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for MrMode {
    type Output = MrMode;
    fn bitor(self, rhs: MrMode) -> MrMode {
        MrMode(self.0 | rhs.0)
    }
}

/// What to ask `fi_getinfo` for: an RDM endpoint with one-sided reads.
#[derive(Debug, Clone)]
pub struct Hints {
    /// Provider name as libfabric spells it, e.g. `"tcp;ofi_rxm"`, `"verbs;ofi_rxm"`, `"efa"`.
    pub provider: String,
    /// Registration modes this application supports ([`MrMode::SUPPORTED`]).
    pub mr_mode: MrMode,
    /// With `Some((node, service))`, the local address to bind (`FI_SOURCE`),
    /// e.g. `("127.0.0.1", "0")`.
    pub source: Option<(String, String)>,
    /// Ask for `FI_HMEM` (registering device memory, e.g. CUDA); providers
    /// built without it then report no match.
    pub hmem: bool,
}

impl Hints {
    pub fn new(provider: &str) -> Self {
        Hints {
            provider: provider.to_string(),
            mr_mode: MrMode::SUPPORTED,
            source: None,
            hmem: false,
        }
    }
}

/// Owns the `fi_info` list `fi_getinfo` returned; the wrapper uses its first
/// entry.
struct InfoInner {
    ptr: NonNull<sys::fi_info>,
}

// SAFETY: the fi_info list is only read after creation (and freed once, in
// Drop); libfabric itself keeps no reference to it.
unsafe impl Send for InfoInner {}
// SAFETY: as above: shared access is read-only.
unsafe impl Sync for InfoInner {}

impl Drop for InfoInner {
    fn drop(&mut self) {
        // SAFETY: the list came from fi_getinfo and is freed exactly once.
        unsafe { sys::dm_fi_freeinfo(self.ptr.as_ptr()) };
    }
}

/// A provider's description of a fabric, domain and endpoint type that match
/// the [`Hints`] (`fi_getinfo`).
#[derive(Clone)]
pub struct Info {
    inner: Arc<InfoInner>,
}

impl Info {
    /// `fi_getinfo` for an RDM endpoint with `FI_RMA | FI_READ | FI_REMOTE_READ`
    /// from `hints.provider`, thread-safe domain, registration modes limited to
    /// `hints.mr_mode`.
    pub fn get(hints: &Hints) -> Result<Info, FabricError> {
        const CALL: &str = "fi_getinfo";
        let prov = CString::new(hints.provider.as_str()).map_err(|_| {
            invalid(
                CALL,
                format!("provider name {:?} contains NUL", hints.provider),
            )
        })?;
        let source = match &hints.source {
            Some((node, service)) => Some((
                CString::new(node.as_str())
                    .map_err(|_| invalid(CALL, format!("node {node:?} contains NUL")))?,
                CString::new(service.as_str())
                    .map_err(|_| invalid(CALL, format!("service {service:?} contains NUL")))?,
            )),
            None => None,
        };
        // SAFETY: fi_allocinfo returns a zeroed fi_info with allocated
        // sub-attributes (or null, checked); we only write plain fields of it
        // and free it with fi_freeinfo once, on every path below.
        let raw_hints = unsafe { sys::dm_fi_allocinfo() };
        let Some(raw_hints) = NonNull::new(raw_hints) else {
            return Err(FabricError {
                call: "fi_allocinfo",
                code: sys::FI_ENOMEM,
                message: strerror(sys::FI_ENOMEM),
            });
        };
        let hints_guard = InfoInner { ptr: raw_hints };
        let h = raw_hints.as_ptr();
        // SAFETY: `h` and its ep_attr / domain_attr come from fi_allocinfo
        // (non-null on success per the libfabric docs, checked anyway).
        unsafe {
            if (*h).ep_attr.is_null() || (*h).domain_attr.is_null() || (*h).fabric_attr.is_null() {
                return Err(invalid("fi_allocinfo", "attributes not allocated".into()));
            }
            (*h).caps = sys::FI_RMA | sys::FI_READ | sys::FI_REMOTE_READ;
            if hints.hmem {
                (*h).caps |= sys::FI_HMEM;
            }
            (*h).mode = 0;
            (*(*h).ep_attr).type_ = sys::FI_EP_RDM;
            (*(*h).domain_attr).mr_mode = hints.mr_mode.bits() as i32;
            if hints.hmem {
                (*(*h).domain_attr).mr_mode |= sys::FI_MR_HMEM as i32;
            }
            (*(*h).domain_attr).threading = sys::FI_THREAD_SAFE;
            check(
                "fi_getinfo (setting the provider)",
                sys::dm_fi_info_set_prov_name(h, prov.as_ptr()),
            )?;
        }
        let (node, service, flags) = match &source {
            Some((n, s)) => (n.as_ptr(), s.as_ptr(), sys::FI_SOURCE),
            None => (ptr::null(), ptr::null(), 0),
        };
        let mut out: *mut sys::fi_info = ptr::null_mut();
        // SAFETY: valid hints, NUL-terminated strings that outlive the call,
        // and an out pointer; the result is owned below.
        let ret =
            unsafe { sys::dm_fi_getinfo(sys::dm_fi_version(), node, service, flags, h, &mut out) };
        drop(hints_guard);
        let context = || {
            format!(
                "no usable provider {:?} (RDM endpoint, RMA reads, thread-safe domain, mr_mode within {:#x}{}); \
                 `fi_info -l` lists the providers installed",
                hints.provider,
                hints.mr_mode.bits(),
                hints
                    .source
                    .as_ref()
                    .map(|(n, s)| format!(", source {n}:{s}"))
                    .unwrap_or_default()
            )
        };
        check(CALL, ret).map_err(|e| e.with_context(context()))?;
        let ptr = NonNull::new(out).ok_or_else(|| FabricError {
            call: CALL,
            code: sys::FI_ENODATA,
            message: format!("{}: {}", context(), strerror(sys::FI_ENODATA)),
        })?;
        let info = Info {
            inner: Arc::new(InfoInner { ptr }),
        };
        let got = info.mr_mode();
        if !hints.mr_mode.contains(got) {
            return Err(invalid(
                CALL,
                format!(
                    "provider {} requires mr_mode {:#x}, beyond the supported {:#x}",
                    info.provider_name(),
                    got.bits(),
                    hints.mr_mode.bits()
                ),
            ));
        }
        Ok(info)
    }

    fn raw(&self) -> *mut sys::fi_info {
        self.inner.ptr.as_ptr()
    }

    fn c_str(p: *const c_char) -> String {
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null NUL-terminated string inside the fi_info we own.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// The provider's name, e.g. `"tcp;ofi_rxm"`.
    pub fn provider_name(&self) -> String {
        // SAFETY: fi_getinfo fills fabric_attr for every entry; checked non-null.
        unsafe {
            let fa = (*self.raw()).fabric_attr;
            if fa.is_null() {
                return String::new();
            }
            Self::c_str((*fa).prov_name)
        }
    }

    /// The domain's name (an interface or device).
    pub fn domain_name(&self) -> String {
        // SAFETY: as in provider_name.
        unsafe {
            let da = (*self.raw()).domain_attr;
            if da.is_null() {
                return String::new();
            }
            Self::c_str((*da).name)
        }
    }

    /// The registration modes the provider requires.
    pub fn mr_mode(&self) -> MrMode {
        // SAFETY: as in provider_name.
        unsafe {
            let da = (*self.raw()).domain_attr;
            if da.is_null() {
                return MrMode::NONE;
            }
            MrMode((*da).mr_mode as u32 as u64)
        }
    }

    /// The largest message (one `fi_read`) the endpoint takes.
    pub fn max_msg_size(&self) -> usize {
        // SAFETY: as in provider_name.
        unsafe {
            let ea = (*self.raw()).ep_attr;
            if ea.is_null() {
                0
            } else {
                (*ea).max_msg_size
            }
        }
    }

    /// Whether the provider needs someone to poll for data to move
    /// (`FI_PROGRESS_MANUAL` data progress).
    pub fn manual_progress(&self) -> bool {
        // SAFETY: as in provider_name.
        unsafe {
            let da = (*self.raw()).domain_attr;
            !da.is_null() && (*da).data_progress == sys::FI_PROGRESS_MANUAL
        }
    }
}

impl fmt::Debug for Info {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Info")
            .field("provider", &self.provider_name())
            .field("domain", &self.domain_name())
            .field("mr_mode", &self.mr_mode())
            .field("manual_progress", &self.manual_progress())
            .finish()
    }
}

/// Declares an owner of one libfabric object: the object, what keeps it alive
/// (its parents), and `fi_close` on drop before the parents are released.
macro_rules! fid_owner {
    ($name:ident, $raw:ty $(, guard $g:ident)? { $($field:ident : $ty:ty),* $(,)? }) => {
        struct $name {
            ptr: NonNull<$raw>,
            $($field: $ty,)*
        }

        // SAFETY: the domain is FI_THREAD_SAFE (requested in Info::get), so
        // libfabric serialises calls on this object from any thread.
        unsafe impl Send for $name {}
        // SAFETY: as above.
        unsafe impl Sync for $name {}

        impl Drop for $name {
            fn drop(&mut self) {
                // Closing an object of the domain while another thread polls
                // one of its completion queues crashes ofi_rxm (1.17): wait
                // for polls to finish and keep new ones out during the close.
                $(let _closing = self.$g.closing.write().unwrap_or_else(|p| p.into_inner());)?
                // SAFETY: the object is open (created successfully, closed only
                // here); its children hold an Arc to us, so none is left open.
                // The parents in our fields are released after this call.
                let ret = unsafe { sys::dm_fi_close(ptr::addr_of_mut!((*self.ptr.as_ptr()).fid)) };
                if ret < 0 {
                    log::warn!(
                        "fi_close({}) failed: {}",
                        stringify!($raw),
                        FabricError::from_ret("fi_close", ret as isize)
                    );
                }
            }
        }
    };
}

fid_owner!(FabricInner, sys::fid_fabric { info: Info });
fid_owner!(DomainInner, sys::fid_domain {
    fabric: Arc<FabricInner>,
    closing: RwLock<()>,
});
fid_owner!(CqInner, sys::fid_cq, guard domain { domain: Arc<DomainInner> });
fid_owner!(AvInner, sys::fid_av, guard domain { domain: Arc<DomainInner> });
fid_owner!(EpInner, sys::fid_ep, guard domain {
    domain: Arc<DomainInner>,
    av: Arc<AvInner>,
    _cq: Arc<CqInner>,
});
fid_owner!(MrInner, sys::fid_mr, guard domain {
    domain: Arc<DomainInner>,
    buf: Arc<HostBuffer>,
    desc: usize,
    key: u64,
    remote_base: u64,
});

/// An open fabric (`fi_fabric`).
#[derive(Clone)]
pub struct Fabric {
    inner: Arc<FabricInner>,
}

impl Fabric {
    pub fn open(info: &Info) -> Result<Fabric, FabricError> {
        let mut out: *mut sys::fid_fabric = ptr::null_mut();
        // SAFETY: fabric_attr belongs to the info we own; out is written on success.
        let ret =
            unsafe { sys::dm_fi_fabric((*info.raw()).fabric_attr, &mut out, ptr::null_mut()) };
        check("fi_fabric", ret)?;
        let ptr =
            NonNull::new(out).ok_or_else(|| invalid("fi_fabric", "returned no fabric".into()))?;
        Ok(Fabric {
            inner: Arc::new(FabricInner {
                ptr,
                info: info.clone(),
            }),
        })
    }

    pub fn info(&self) -> &Info {
        &self.inner.info
    }
}

/// An open access domain (`fi_domain`): a NIC, or a loopback interface.
#[derive(Clone)]
pub struct Domain {
    inner: Arc<DomainInner>,
}

impl Domain {
    pub fn open(fabric: &Fabric) -> Result<Domain, FabricError> {
        let mut out: *mut sys::fid_domain = ptr::null_mut();
        // SAFETY: open fabric and its info; out is written on success.
        let ret = unsafe {
            sys::dm_fi_domain(
                fabric.inner.ptr.as_ptr(),
                fabric.info().raw(),
                &mut out,
                ptr::null_mut(),
            )
        };
        check("fi_domain", ret)?;
        let ptr =
            NonNull::new(out).ok_or_else(|| invalid("fi_domain", "returned no domain".into()))?;
        Ok(Domain {
            inner: Arc::new(DomainInner {
                ptr,
                fabric: fabric.inner.clone(),
                closing: RwLock::new(()),
            }),
        })
    }

    pub fn info(&self) -> &Info {
        &self.inner.fabric.info
    }
}

/// A completion queue in `FI_CQ_FORMAT_CONTEXT`, polled (no wait object).
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

/// One completed operation: the `context` it was posted with, and its outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CqEntry {
    pub context: u64,
    pub result: Result<(), FabricError>,
}

impl CompletionQueue {
    /// `size` entries (0: the provider's default), polled only.
    pub fn open(domain: &Domain, size: usize) -> Result<CompletionQueue, FabricError> {
        Self::open_with(domain, size, sys::FI_WAIT_NONE)
    }

    /// Like [`Self::open`], with a wait object, so that [`Self::wait`] can
    /// sleep until the provider has work (a serving side's progress loop).
    pub fn open_waitable(domain: &Domain, size: usize) -> Result<CompletionQueue, FabricError> {
        Self::open_with(domain, size, sys::FI_WAIT_UNSPEC)
    }

    fn open_with(
        domain: &Domain,
        size: usize,
        wait_obj: sys::fi_wait_obj,
    ) -> Result<CompletionQueue, FabricError> {
        let mut attr = sys::fi_cq_attr {
            size,
            format: sys::FI_CQ_FORMAT_CONTEXT,
            wait_obj,
            ..Default::default()
        };
        let mut out: *mut sys::fid_cq = ptr::null_mut();
        // SAFETY: open domain, attr lives across the call; out is written on success.
        let ret = unsafe {
            sys::dm_fi_cq_open(
                domain.inner.ptr.as_ptr(),
                &mut attr,
                &mut out,
                ptr::null_mut(),
            )
        };
        check("fi_cq_open", ret)?;
        let ptr =
            NonNull::new(out).ok_or_else(|| invalid("fi_cq_open", "returned no queue".into()))?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ptr,
                domain: domain.inner.clone(),
            }),
        })
    }

    /// Reads up to `max` completions (without waiting) and appends them to
    /// `out`; returns how many. An operation that failed comes back as an
    /// entry with an error (`fi_cq_readerr`); an `Err` means the queue itself
    /// failed. With manual progress, this call is also what moves data.
    pub fn poll(&self, out: &mut Vec<CqEntry>, max: usize) -> Result<usize, FabricError> {
        let _polling = self
            .inner
            .domain
            .closing
            .read()
            .unwrap_or_else(|p| p.into_inner());
        let mut got = 0;
        let mut entries = [sys::fi_cq_entry::default(); CQ_READ_BATCH];
        while got < max {
            let want = (max - got).min(CQ_READ_BATCH);
            // SAFETY: `entries` has room for `want` fi_cq_entry values, the
            // format this queue was opened with.
            let ret = unsafe {
                sys::dm_fi_cq_read(
                    self.inner.ptr.as_ptr(),
                    entries.as_mut_ptr().cast::<c_void>(),
                    want,
                )
            };
            if ret > 0 {
                let n = ret as usize;
                for e in &entries[..n] {
                    out.push(CqEntry {
                        context: e.op_context as u64,
                        result: Ok(()),
                    });
                }
                got += n;
                if n < want {
                    break;
                }
            } else if ret == -(sys::FI_EAGAIN as isize) || ret == 0 {
                break;
            } else if ret == -(sys::FI_EAVAIL as isize) {
                out.push(self.read_error()?);
                got += 1;
            } else {
                return Err(FabricError::from_ret("fi_cq_read", ret));
            }
        }
        Ok(got)
    }

    /// Drives progress and sleeps up to `timeout` until a completion arrives
    /// (`fi_cq_sread`; the queue must come from [`Self::open_waitable`]);
    /// appends what arrived. Returns 0 on timeout. Closing an object of the
    /// domain waits for a call in progress, so keep `timeout` short.
    pub fn wait(
        &self,
        out: &mut Vec<CqEntry>,
        timeout: std::time::Duration,
    ) -> Result<usize, FabricError> {
        let _polling = self
            .inner
            .domain
            .closing
            .read()
            .unwrap_or_else(|p| p.into_inner());
        let mut entry = sys::fi_cq_entry::default();
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: room for one fi_cq_entry, the format this queue was opened with.
        let ret = unsafe {
            sys::dm_fi_cq_sread(
                self.inner.ptr.as_ptr(),
                (&mut entry as *mut sys::fi_cq_entry).cast::<c_void>(),
                1,
                ms,
            )
        };
        if ret > 0 {
            out.push(CqEntry {
                context: entry.op_context as u64,
                result: Ok(()),
            });
            Ok(1)
        } else if ret == 0 || ret == -(sys::FI_EAGAIN as isize) {
            Ok(0)
        } else if ret == -(sys::FI_EAVAIL as isize) {
            out.push(self.read_error()?);
            Ok(1)
        } else {
            Err(FabricError::from_ret("fi_cq_sread", ret))
        }
    }

    fn read_error(&self) -> Result<CqEntry, FabricError> {
        let mut e = sys::fi_cq_err_entry::default();
        // SAFETY: `e` is a zeroed fi_cq_err_entry (err_data_size 0: the
        // provider points err_data at its own buffer, valid until the next
        // readerr on this queue, and we use it before returning).
        let ret = unsafe { sys::dm_fi_cq_readerr(self.inner.ptr.as_ptr(), &mut e, 0) };
        if ret < 0 {
            return Err(FabricError::from_ret("fi_cq_readerr", ret));
        }
        let mut text = [0 as c_char; 256];
        // SAFETY: prov_errno and err_data come from the entry just read; the
        // buffer has the length we pass; the result is NUL-terminated or null.
        let detail = unsafe {
            let p = sys::dm_fi_cq_strerror(
                self.inner.ptr.as_ptr(),
                e.prov_errno,
                e.err_data,
                text.as_mut_ptr(),
                text.len(),
            );
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        let code = e.err.abs();
        Ok(CqEntry {
            context: e.op_context as u64,
            result: Err(FabricError {
                call: "fi_read (completion)",
                code,
                message: format!(
                    "{} (provider error {}: {detail})",
                    strerror(code),
                    e.prov_errno
                ),
            }),
        })
    }
}

/// An address vector (`fi_av_open`): peers' addresses, by insertion.
#[derive(Clone)]
pub struct AddressVector {
    inner: Arc<AvInner>,
}

/// A peer inserted into an [`AddressVector`] (an `fi_addr_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerAddr(u64);

impl AddressVector {
    pub fn open(domain: &Domain) -> Result<AddressVector, FabricError> {
        let mut attr = sys::fi_av_attr {
            type_: sys::FI_AV_UNSPEC,
            ..Default::default()
        };
        let mut out: *mut sys::fid_av = ptr::null_mut();
        // SAFETY: open domain, attr lives across the call; out is written on success.
        let ret = unsafe {
            sys::dm_fi_av_open(
                domain.inner.ptr.as_ptr(),
                &mut attr,
                &mut out,
                ptr::null_mut(),
            )
        };
        check("fi_av_open", ret)?;
        let ptr = NonNull::new(out)
            .ok_or_else(|| invalid("fi_av_open", "returned no address vector".into()))?;
        Ok(AddressVector {
            inner: Arc::new(AvInner {
                ptr,
                domain: domain.inner.clone(),
            }),
        })
    }

    /// Inserts a peer's address (the bytes of its [`Endpoint::name`]).
    pub fn insert(&self, addr: &[u8]) -> Result<PeerAddr, FabricError> {
        if addr.is_empty() {
            return Err(invalid("fi_av_insert", "empty address".into()));
        }
        // SAFETY: returns a constant.
        let mut fi_addr: sys::fi_addr_t = unsafe { sys::dm_fi_addr_unspec() };
        // SAFETY: one address of the provider's format (it was produced by
        // fi_getname of the same provider; a foreign or short one is rejected
        // by the provider); the AV has no event queue, so the call is synchronous.
        let ret = unsafe {
            sys::dm_fi_av_insert(
                self.inner.ptr.as_ptr(),
                addr.as_ptr().cast::<c_void>(),
                1,
                &mut fi_addr,
                0,
                ptr::null_mut(),
            )
        };
        check("fi_av_insert", ret)?;
        if ret != 1 {
            return Err(invalid(
                "fi_av_insert",
                format!("inserted {ret} of 1 addresses"),
            ));
        }
        Ok(PeerAddr(fi_addr))
    }
}

/// Access a registration grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Peers read this memory with `fi_read` (a memory server's arena).
    RemoteRead,
    /// Local reads land in this memory (a GPU server's cache).
    LocalReadTarget,
}

/// A registered [`HostBuffer`] (`fi_mr_reg`); it keeps the buffer alive.
pub struct MemoryRegion {
    inner: MrInner,
}

impl MemoryRegion {
    /// Registers all of `buf`. `requested_key` is the key peers use, unless the
    /// provider chooses keys ([`MrMode::PROV_KEY`]): always use [`Self::key`].
    pub fn register(
        domain: &Domain,
        buf: Arc<HostBuffer>,
        access: Access,
        requested_key: u64,
    ) -> Result<MemoryRegion, FabricError> {
        let acc = match access {
            Access::RemoteRead => sys::FI_REMOTE_READ,
            Access::LocalReadTarget => sys::FI_READ,
        };
        let mut out: *mut sys::fid_mr = ptr::null_mut();
        // SAFETY: `buf` is a live mapping of `buf.len()` bytes that we keep
        // alive (in MrInner) until after fi_close of the registration.
        let ret = unsafe {
            sys::dm_fi_mr_reg(
                domain.inner.ptr.as_ptr(),
                buf.as_ptr().cast::<c_void>(),
                buf.len(),
                acc,
                0,
                requested_key,
                0,
                &mut out,
                ptr::null_mut(),
            )
        };
        check("fi_mr_reg", ret)
            .map_err(|e| e.with_context(format!("{} bytes, key {requested_key}", buf.len())))?;
        let ptr =
            NonNull::new(out).ok_or_else(|| invalid("fi_mr_reg", "returned no region".into()))?;
        // SAFETY: open registration.
        let (key, desc) = unsafe {
            (
                sys::dm_fi_mr_key(ptr.as_ptr()),
                sys::dm_fi_mr_desc(ptr.as_ptr()),
            )
        };
        let remote_base = if domain.info().mr_mode().contains(MrMode::VIRT_ADDR) {
            buf.as_ptr() as u64
        } else {
            0
        };
        let inner = MrInner {
            ptr,
            domain: domain.inner.clone(),
            buf,
            desc: desc as usize,
            key,
            remote_base,
        };
        // FI_KEY_NOTAVAIL: the key is not known yet (asynchronous registration).
        if key == u64::MAX {
            return Err(invalid(
                "fi_mr_key",
                "the provider did not return a key".into(),
            ));
        }
        Ok(MemoryRegion { inner })
    }

    /// The key peers pass to `fi_read` of this memory.
    pub fn key(&self) -> u64 {
        self.inner.key
    }

    /// The remote address peers pass for byte `offset` of this memory: the
    /// offset itself, or the virtual address with [`MrMode::VIRT_ADDR`].
    pub fn remote_addr(&self, offset: u64) -> u64 {
        self.inner.remote_base + offset
    }

    pub fn len(&self) -> usize {
        self.inner.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn buffer(&self) -> &Arc<HostBuffer> {
        &self.inner.buf
    }
}

/// An enabled RDM endpoint bound to one address vector and one completion
/// queue (for both directions).
pub struct Endpoint {
    inner: EpInner,
}

impl Endpoint {
    pub fn open(
        domain: &Domain,
        av: &AddressVector,
        cq: &CompletionQueue,
    ) -> Result<Endpoint, FabricError> {
        if !Arc::ptr_eq(&av.inner.domain, &domain.inner)
            || !Arc::ptr_eq(&cq.inner.domain, &domain.inner)
        {
            return Err(invalid(
                "fi_endpoint",
                "the address vector and completion queue must belong to the endpoint's domain"
                    .into(),
            ));
        }
        let mut out: *mut sys::fid_ep = ptr::null_mut();
        // SAFETY: open domain and its info; out is written on success.
        let ret = unsafe {
            sys::dm_fi_endpoint(
                domain.inner.ptr.as_ptr(),
                domain.info().raw(),
                &mut out,
                ptr::null_mut(),
            )
        };
        check("fi_endpoint", ret)?;
        let ptr = NonNull::new(out)
            .ok_or_else(|| invalid("fi_endpoint", "returned no endpoint".into()))?;
        // From here on the endpoint is closed by EpInner's Drop on every path.
        let ep = Endpoint {
            inner: EpInner {
                ptr,
                domain: domain.inner.clone(),
                av: av.inner.clone(),
                _cq: cq.inner.clone(),
            },
        };
        // SAFETY: open endpoint, AV and CQ of the same domain (checked); the
        // endpoint keeps both alive (Arcs in EpInner) and is closed first.
        unsafe {
            check(
                "fi_ep_bind (address vector)",
                sys::dm_fi_ep_bind(
                    ptr.as_ptr(),
                    ptr::addr_of_mut!((*av.inner.ptr.as_ptr()).fid),
                    0,
                ),
            )?;
            check(
                "fi_ep_bind (completion queue)",
                sys::dm_fi_ep_bind(
                    ptr.as_ptr(),
                    ptr::addr_of_mut!((*cq.inner.ptr.as_ptr()).fid),
                    sys::FI_TRANSMIT | sys::FI_RECV,
                ),
            )?;
            check("fi_enable", sys::dm_fi_enable(ptr.as_ptr()))?;
        }
        Ok(ep)
    }

    /// This endpoint's address (`fi_getname`), for peers to insert into their
    /// address vectors.
    pub fn name(&self) -> Result<Vec<u8>, FabricError> {
        let mut buf = vec![0u8; 64];
        loop {
            let mut len = buf.len();
            // SAFETY: open endpoint; `buf` has `len` writable bytes; the
            // provider writes at most `len` and reports the size it needs.
            let ret = unsafe {
                sys::dm_fi_getname(
                    ptr::addr_of_mut!((*self.inner.ptr.as_ptr()).fid),
                    buf.as_mut_ptr().cast::<c_void>(),
                    &mut len,
                )
            };
            if ret == -(sys::FI_ETOOSMALL as i32) && len > buf.len() && len <= NAME_LEN_MAX {
                buf.resize(len, 0);
                continue;
            }
            check("fi_getname", ret)?;
            buf.truncate(len);
            return Ok(buf);
        }
    }

    /// Inserts a peer's address into this endpoint's address vector.
    pub fn insert_peer(&self, addr: &[u8]) -> Result<PeerAddr, FabricError> {
        AddressVector {
            inner: self.inner.av.clone(),
        }
        .insert(addr)
    }

    /// Posts `fi_read`: `len` bytes at `remote_addr` (see
    /// [`MemoryRegion::remote_addr`]) of the peer's region `key` into
    /// `local[local_offset..local_offset + len]`. `context` comes back in the
    /// [`CqEntry`]. An error with [`FabricError::is_again`] means: poll and post again.
    ///
    /// # Safety
    /// Until the completion with `context` was polled, no one may read or
    /// write the local range, no other read in flight may target an
    /// overlapping range, and `local` must not be dropped.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn read(
        &self,
        local: &MemoryRegion,
        local_offset: usize,
        len: usize,
        peer: PeerAddr,
        remote_addr: u64,
        key: u64,
        context: u64,
    ) -> Result<(), FabricError> {
        const CALL: &str = "fi_read";
        if !Arc::ptr_eq(&local.inner.domain, &self.inner.domain) {
            return Err(invalid(
                CALL,
                "the local region belongs to another domain".into(),
            ));
        }
        if len == 0
            || local_offset
                .checked_add(len)
                .is_none_or(|end| end > local.len())
        {
            return Err(invalid(
                CALL,
                format!(
                    "local range {local_offset}+{len} is empty or outside the {} registered bytes",
                    local.len()
                ),
            ));
        }
        // SAFETY: in bounds (checked); the region is registered in this
        // endpoint's domain (checked); exclusivity and lifetime of the range
        // until completion are the caller's contract; `context` is an opaque
        // value (no FI_CONTEXT mode was accepted in Info::get).
        let ret = unsafe {
            sys::dm_fi_read(
                self.inner.ptr.as_ptr(),
                local.inner.buf.as_ptr().add(local_offset).cast::<c_void>(),
                len,
                local.inner.desc as *mut c_void,
                peer.0,
                remote_addr,
                key,
                context as *mut c_void,
            )
        };
        check(CALL, ret)
    }
}
/// One range of a peer's registered memory, for [`read_ranges`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRange {
    pub peer: PeerAddr,
    /// [`MemoryRegion::remote_addr`] of the range's first byte on the peer.
    pub addr: u64,
    pub key: u64,
    pub len: u64,
}

/// Reads `ranges` back to back into `dest` (from offset 0, in order) with
/// plain `fi_read`s of at most `piece` bytes, at most `depth` of them in
/// flight, polling `cq` (the endpoint's): the raw loop benches compare the
/// transports with. Returns after every posted read completed; the first
/// error, if any.
pub fn read_ranges(
    ep: &Endpoint,
    cq: &CompletionQueue,
    dest: &mut MemoryRegion,
    ranges: &[RemoteRange],
    piece: usize,
    depth: usize,
) -> Result<(), FabricError> {
    const CALL: &str = "read_ranges";
    if !Arc::ptr_eq(&ep.inner._cq, &cq.inner) {
        return Err(invalid(
            CALL,
            "the completion queue is not the endpoint's".into(),
        ));
    }
    if piece == 0 || depth == 0 {
        return Err(invalid(CALL, "piece and depth must be positive".into()));
    }
    let total: u64 = ranges.iter().map(|r| r.len).sum();
    if total > dest.len() as u64 {
        return Err(invalid(
            CALL,
            format!("{total} bytes do not fit the {} registered", dest.len()),
        ));
    }
    let (mut range, mut within, mut local) = (0usize, 0u64, 0usize);
    let mut in_flight = 0usize;
    let mut first_err: Option<FabricError> = None;
    let mut done = Vec::with_capacity(depth);
    loop {
        while first_err.is_none() && in_flight < depth && range < ranges.len() {
            let r = ranges[range];
            if r.len == 0 {
                range += 1;
                continue;
            }
            let len = (r.len - within).min(piece as u64) as usize;
            // SAFETY: `dest` is borrowed exclusively for this call and every
            // read posted here completes before it returns; the pieces tile
            // `dest` without overlapping (each starts where the last ended).
            let posted = unsafe { ep.read(dest, local, len, r.peer, r.addr + within, r.key, 0) };
            match posted {
                Ok(()) => {
                    in_flight += 1;
                    local += len;
                    within += len as u64;
                    if within == r.len {
                        range += 1;
                        within = 0;
                    }
                }
                Err(e) if e.is_again() && in_flight > 0 => break,
                Err(e) if e.is_again() => {}
                Err(e) => first_err = Some(e),
            }
        }
        if in_flight == 0 && (range == ranges.len() || first_err.is_some()) {
            break;
        }
        done.clear();
        cq.poll(&mut done, in_flight.max(1))?;
        in_flight -= done.len();
        if done.is_empty() {
            // Nothing arrived: let the serving side's progress thread run
            // (on a loopback host it shares the cores with this loop).
            std::thread::yield_now();
        }
        for e in done.drain(..) {
            if let (Err(e), None) = (e.result, &first_err) {
                first_err = Some(e);
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}
