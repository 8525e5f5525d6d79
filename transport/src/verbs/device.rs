//! Device access through libibverbs (feature `verbs`): RAII wrappers, posting
//! planned RDMA READ chains and polling their completions.
//!
//! Ownership: a [`QueuePair`] holds `Arc`s of its [`ProtectionDomain`] and
//! [`CompletionQueue`], a [`MemoryRegion`] holds its PD, and every one of them
//! holds the [`Context`]; so drops run QP/MR -> CQ/PD -> context, the reverse
//! of creation, whatever order the caller drops its handles in.
//!
//! All `unsafe` of the verbs transport lives in this file and in `attr.rs`.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_access_flags, ibv_alloc_pd, ibv_close_device, ibv_context, ibv_cq, ibv_create_cq,
    ibv_create_qp, ibv_dealloc_pd, ibv_dereg_mr, ibv_destroy_cq, ibv_destroy_qp,
    ibv_free_device_list, ibv_get_device_list, ibv_get_device_name, ibv_gid, ibv_modify_qp, ibv_mr,
    ibv_open_device, ibv_pd, ibv_poll_cq, ibv_port_attr, ibv_post_send, ibv_qp, ibv_qp_init_attr,
    ibv_qp_type, ibv_query_gid, ibv_reg_mr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wc,
    ibv_wc_status, ibv_wc_status_str, ibv_wr_opcode, rdma_t,
};

use super::attr::qp_attr;
use super::info::QpInfo;
use super::plan::{Chain, CompletionTracker, PlanLimits, ReadPlan, ReadResult, SendWindow};
pub use super::qp::RcConfig;
use super::qp::{
    Access, Gid, InitAttrs, PathMtu, QpState, QpStateMachine, RemoteAddress, RtrAttrs, RtsAttrs,
    Transition,
};
use super::VerbsError;
use crate::memory::HostBuffer;

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that rdma-sys does not bind).
pub const LINK_LAYER_ETHERNET: u8 = 2;
/// Work completions read per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

fn os_error() -> String {
    let e = std::io::Error::last_os_error();
    // "Function not implemented (os error 38)" -> "Function not implemented"
    let s = e.to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

fn call_err(call: &'static str) -> VerbsError {
    VerbsError::Call {
        call,
        detail: os_error(),
    }
}

fn rc_err(call: &'static str, rc: c_int) -> VerbsError {
    // Verbs calls return an errno value (positive) or -1 with errno set.
    let detail = if rc > 0 {
        let s = std::io::Error::from_raw_os_error(rc).to_string();
        s.split(" (os error").next().unwrap_or("").to_string()
    } else {
        os_error()
    };
    VerbsError::Call { call, detail }
}

/// Names of the RDMA devices present, or why they could not be listed.
pub fn list_devices() -> Result<Vec<String>, String> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(os_error());
    }
    let mut names = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: the list has `n` valid entries (NULL-terminated after them).
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: `dev` is a live device of the list; the name is a C string it owns.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(list) };
    Ok(names)
}

/// An open device (`ibv_context`).
pub struct Context {
    ctx: NonNull<ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts are thread-safe; the pointer is only freed in Drop.
unsafe impl Send for Context {}
// SAFETY: as above; every call through `&Context` is a thread-safe verbs call.
unsafe impl Sync for Context {}

/// What a port says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    pub lid: u16,
    pub active_mtu: Option<PathMtu>,
    /// `ibv_port_state` (4 = ACTIVE).
    pub state: u32,
    /// 1 = InfiniBand, 2 = Ethernet (RoCE: addressing needs a GID).
    pub link_layer: u8,
}

impl Context {
    /// Opens the device named `name` (e.g. `"mlx5_0"`, from settings).
    pub fn open(name: &str) -> Result<Arc<Context>, VerbsError> {
        let not_found =
            |list_error: Option<String>, present: Vec<String>| VerbsError::DeviceNotFound {
                name: name.to_string(),
                list_error,
                present,
            };
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed on every path below.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(not_found(Some(os_error()), Vec::new()));
        }
        let mut present = Vec::new();
        let mut found = ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list has `n` valid entries.
            let dev = unsafe { *list.add(i) };
            if dev.is_null() {
                break;
            }
            // SAFETY: `dev` is a live device; its name is a C string it owns.
            let dev_name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            if dev_name == name {
                found = dev;
            }
            present.push(dev_name);
        }
        let ctx = if found.is_null() {
            ptr::null_mut()
        } else {
            // SAFETY: `found` is a device of the still-live list.
            unsafe { ibv_open_device(found) }
        };
        let open_err = os_error();
        // SAFETY: freed once; an opened context stays valid after the list is freed.
        unsafe { ibv_free_device_list(list) };
        if found.is_null() {
            return Err(not_found(None, present));
        }
        match NonNull::new(ctx) {
            Some(ctx) => Ok(Arc::new(Context {
                ctx,
                name: name.to_string(),
            })),
            None => Err(VerbsError::Call {
                call: "ibv_open_device",
                detail: format!("{name}: {open_err}"),
            }),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn query_port(&self, port_num: u8) -> Result<PortInfo, VerbsError> {
        // SAFETY: ibv_port_attr is plain data; zero is valid.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer of the full (non-compat) struct size.
        let rc = unsafe { rdma_sys::___ibv_query_port(self.ctx.as_ptr(), port_num, &mut attr) };
        if rc != 0 {
            return Err(rc_err("ibv_query_port", rc));
        }
        Ok(PortInfo {
            lid: attr.lid,
            active_mtu: PathMtu::from_ibv(attr.active_mtu),
            state: attr.state,
            link_layer: attr.link_layer,
        })
    }

    pub fn query_gid(&self, port_num: u8, index: u8) -> Result<Gid, VerbsError> {
        let mut gid = ibv_gid { raw: [0; 16] };
        // SAFETY: live context, valid out-pointer.
        let rc =
            unsafe { ibv_query_gid(self.ctx.as_ptr(), port_num, c_int::from(index), &mut gid) };
        if rc != 0 {
            return Err(rc_err("ibv_query_gid", rc));
        }
        // SAFETY: every bit pattern is a valid [u8; 16].
        Ok(unsafe { gid.raw })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child holds an Arc of this context, so none is alive.
        let rc = unsafe { ibv_close_device(self.ctx.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "verbs: ibv_close_device({}) failed: {}",
                self.name,
                os_error()
            );
        }
    }
}

/// A protection domain.
pub struct ProtectionDomain {
    pd: NonNull<ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: PDs are usable from any thread; freed only in Drop.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: live context.
        let pd = unsafe { ibv_alloc_pd(ctx.ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| call_err("ibv_alloc_pd"))?;
        Ok(Arc::new(Self {
            pd,
            ctx: ctx.clone(),
        }))
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: QPs and MRs of this PD hold an Arc of it, so none is alive.
        if unsafe { ibv_dealloc_pd(self.pd.as_ptr()) } != 0 {
            log::warn!("verbs: ibv_dealloc_pd failed: {}", os_error());
        }
    }
}

/// A completion queue.
pub struct CompletionQueue {
    cq: NonNull<ibv_cq>,
    _ctx: Arc<Context>,
}

// SAFETY: CQs may be polled from any thread (libibverbs locks per CQ).
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    /// `ibv_wc_status` (0 = success, 5 = flushed).
    pub status: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
}

impl WorkCompletion {
    pub fn is_ok(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_SUCCESS
    }

    pub fn status_str(&self) -> String {
        // SAFETY: ibv_wc_status_str returns a static C string for any value.
        unsafe { CStr::from_ptr(ibv_wc_status_str(self.status)) }
            .to_string_lossy()
            .into_owned()
    }
}

impl CompletionQueue {
    pub fn new(ctx: &Arc<Context>, entries: u32) -> Result<Arc<Self>, VerbsError> {
        let cqe = c_int::try_from(entries)
            .map_err(|_| VerbsError::InvalidAttr(format!("{entries} CQ entries")))?;
        // SAFETY: live context; no channel, no context pointer.
        let cq =
            unsafe { ibv_create_cq(ctx.ctx.as_ptr(), cqe, ptr::null_mut(), ptr::null_mut(), 0) };
        let cq = NonNull::new(cq).ok_or_else(|| call_err("ibv_create_cq"))?;
        Ok(Arc::new(Self {
            cq,
            _ctx: ctx.clone(),
        }))
    }

    /// Appends up to `max` completions (non-blocking); returns how many.
    pub fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize, VerbsError> {
        // SAFETY: ibv_wc is plain data; zero is valid.
        let mut wcs: [ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
        let want = max.min(POLL_BATCH) as c_int;
        // SAFETY: live CQ; `wcs` has room for `want` entries.
        let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), want, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(rc_err("ibv_poll_cq", n));
        }
        for wc in &wcs[..n as usize] {
            out.push(WorkCompletion {
                wr_id: wc.wr_id,
                status: wc.status,
                vendor_err: wc.vendor_err,
                byte_len: wc.byte_len,
            });
        }
        Ok(n as usize)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: QPs using this CQ hold an Arc of it, so none is alive.
        if unsafe { ibv_destroy_cq(self.cq.as_ptr()) } != 0 {
            log::warn!("verbs: ibv_destroy_cq failed: {}", os_error());
        }
    }
}

/// A registered memory region.
pub struct MemoryRegion {
    mr: NonNull<ibv_mr>,
    _pd: Arc<ProtectionDomain>,
    _buf: Option<Arc<HostBuffer>>,
}

// SAFETY: an MR is a handle; the memory it covers is governed by the callers' contracts.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

fn access_flags(a: Access) -> c_int {
    let mut f = ibv_access_flags(0);
    if a.local_write {
        f |= ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
    }
    if a.remote_read {
        f |= ibv_access_flags::IBV_ACCESS_REMOTE_READ;
    }
    if a.remote_write {
        // Remote write requires local write (verbs rule).
        f = f
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
    }
    f.0 as c_int
}

impl MemoryRegion {
    /// Registers a whole [`HostBuffer`]; the MR keeps it alive.
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        buf: Arc<HostBuffer>,
        access: Access,
    ) -> Result<Self, VerbsError> {
        // SAFETY: the buffer's memory lives as long as the Arc kept in the MR.
        let mut mr = unsafe { Self::register_raw(pd, buf.as_ptr(), buf.len(), access)? };
        mr._buf = Some(buf);
        Ok(mr)
    }

    /// # Safety
    /// `[addr, addr+len)` must stay mapped until this MR is dropped.
    pub unsafe fn register_raw(
        pd: &Arc<ProtectionDomain>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self, VerbsError> {
        // SAFETY: live PD; the caller keeps the range mapped.
        let mr = unsafe { ibv_reg_mr(pd.pd.as_ptr(), addr.cast(), len, access_flags(access)) };
        let mr = NonNull::new(mr).ok_or_else(|| call_err("ibv_reg_mr"))?;
        Ok(Self {
            mr,
            _pd: pd.clone(),
            _buf: None,
        })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { self.mr.as_ref().lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { self.mr.as_ref().rkey }
    }

    pub fn addr(&self) -> u64 {
        // SAFETY: live MR.
        unsafe { self.mr.as_ref().addr as u64 }
    }

    pub fn len(&self) -> usize {
        // SAFETY: live MR.
        unsafe { self.mr.as_ref().length }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: the MR is deregistered once; reads into it are the caller's to finish first.
        if unsafe { ibv_dereg_mr(self.mr.as_ptr()) } != 0 {
            log::warn!("verbs: ibv_dereg_mr failed: {}", os_error());
        }
    }
}

/// An RC queue pair.
pub struct QueuePair {
    qp: NonNull<ibv_qp>,
    pd: Arc<ProtectionDomain>,
    _cq: Arc<CompletionQueue>,
    sm: QpStateMachine,
    max_send_wr: u32,
    /// Hardware wr_id of the next plan's seq 0 (plans never reuse ids on a QP).
    next_wr_base: u64,
    // Reused per chain so that posting does not allocate.
    sges: Vec<ibv_sge>,
    wrs: Vec<ibv_send_wr>,
}

// SAFETY: posting is done through `&mut self`; the QP handle is usable from any thread.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// Creates an RC QP with `max_send_wr` send slots, one SGE per work request.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        max_send_wr: u32,
    ) -> Result<Self, VerbsError> {
        // SAFETY: plain C struct; zero is valid and then filled in.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq.as_ptr();
        init.recv_cq = cq.cq.as_ptr();
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = max_send_wr;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: live PD and CQ (held by the QP below), valid init attributes.
        let qp = unsafe { ibv_create_qp(pd.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| call_err("ibv_create_qp"))?;
        Ok(Self {
            qp,
            pd: pd.clone(),
            _cq: cq.clone(),
            sm: QpStateMachine::new(),
            max_send_wr,
            next_wr_base: 0,
            sges: Vec::with_capacity(max_send_wr as usize),
            wrs: Vec::with_capacity(max_send_wr as usize),
        })
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { self.qp.as_ref().qp_num }
    }

    pub fn state(&self) -> QpState {
        self.sm.state()
    }

    /// One `ibv_modify_qp` step, checked against the state machine first.
    pub fn modify(&mut self, t: &Transition) -> Result<QpState, VerbsError> {
        self.sm.check(t)?;
        let (mut attr, mask) = qp_attr(t)?;
        // SAFETY: live QP; attr and mask describe a valid transition.
        let rc = unsafe { ibv_modify_qp(self.qp.as_ptr(), &mut attr, mask.0 as c_int) };
        if rc != 0 {
            return Err(rc_err("ibv_modify_qp", rc));
        }
        self.sm.apply(t)
    }

    /// This side's info for the peer: QP number, `psn`, port address and,
    /// when this side serves reads, its MR.
    pub fn local_info(
        &self,
        cfg: &RcConfig,
        psn: u32,
        region: Option<&MemoryRegion>,
    ) -> Result<QpInfo, VerbsError> {
        let ctx = self.pd.context();
        let port = ctx.query_port(cfg.port_num)?;
        let gid = ctx.query_gid(cfg.port_num, cfg.gid_index)?;
        let info = QpInfo {
            qpn: self.qpn(),
            psn,
            lid: port.lid,
            gid,
            rkey: region.map_or(0, |m| m.rkey()),
            addr: region.map_or(0, |m| m.addr()),
            len: region.map_or(0, |m| m.len() as u64),
        };
        info.validate()?;
        Ok(info)
    }

    /// Reset -> Init -> Rtr -> Rts against the peer's (validated) info.
    pub fn connect(
        &mut self,
        cfg: &RcConfig,
        local_psn: u32,
        remote: &QpInfo,
    ) -> Result<(), VerbsError> {
        remote.validate()?;
        let port = self.pd.context().query_port(cfg.port_num)?;
        let path_mtu = cfg.path_mtu.or(port.active_mtu).unwrap_or(PathMtu::Mtu1024);
        let use_gid = port.link_layer == LINK_LAYER_ETHERNET || remote.lid == 0;
        self.modify(&Transition::ToInit(InitAttrs {
            port_num: cfg.port_num,
            pkey_index: cfg.pkey_index,
            access: Access::REMOTE_READ,
        }))?;
        self.modify(&Transition::ToRtr(RtrAttrs {
            path_mtu,
            dest_qpn: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: cfg.max_rd_atomic,
            min_rnr_timer: cfg.min_rnr_timer,
            remote: RemoteAddress {
                lid: remote.lid,
                gid: use_gid.then_some(remote.gid),
                sgid_index: cfg.gid_index,
                hop_limit: cfg.hop_limit,
                service_level: 0,
                port_num: cfg.port_num,
            },
        }))?;
        self.modify(&Transition::ToRts(RtsAttrs {
            sq_psn: local_psn,
            timeout: cfg.timeout,
            retry_cnt: cfg.retry_cnt,
            rnr_retry: cfg.rnr_retry,
            max_rd_atomic: cfg.max_rd_atomic,
        }))?;
        Ok(())
    }

    /// Posts one chain as RDMA READs with a single `ibv_post_send`; work
    /// request `seq` gets hardware wr_id `base + seq`.
    ///
    /// # Safety
    /// Every local range must lie in a live MR with the given lkey and not be
    /// touched by anyone until its completion is polled; remote ranges must lie
    /// in the peer's MR with the given rkey.
    pub unsafe fn post_chain(&mut self, chain: &Chain, base: u64) -> Result<(), VerbsError> {
        if self.sm.state() != QpState::Rts {
            return Err(VerbsError::InvalidTransition {
                from: self.sm.state(),
                to: QpState::Rts,
            });
        }
        if chain.wrs.is_empty() {
            return Ok(());
        }
        if chain.wrs.len() > self.max_send_wr as usize {
            return Err(VerbsError::InvalidPlan(format!(
                "chain of {} work requests exceeds the QP's {} send slots",
                chain.wrs.len(),
                self.max_send_wr
            )));
        }
        self.sges.clear();
        self.wrs.clear();
        for w in &chain.wrs {
            self.sges.push(ibv_sge {
                addr: w.local_addr,
                length: w.len,
                lkey: w.lkey,
            });
        }
        for w in &chain.wrs {
            // SAFETY: plain C struct (unions of plain data); zero is valid.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = base + w.seq;
            wr.num_sge = 1;
            wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
            wr.send_flags = if w.signaled {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            wr.wr.rdma = rdma_t {
                remote_addr: w.remote_addr,
                rkey: w.rkey,
            };
            self.wrs.push(wr);
        }
        // Link after both vectors are complete: no reallocation moves them now.
        let n = self.wrs.len();
        let wr_base = self.wrs.as_mut_ptr();
        let sge_base = self.sges.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i < n = len of both vectors.
            unsafe {
                let wr = &mut *wr_base.add(i);
                wr.sg_list = sge_base.add(i);
                wr.next = if i + 1 < n {
                    wr_base.add(i + 1)
                } else {
                    ptr::null_mut()
                };
            }
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP in RTS; a well-formed NULL-terminated list; the caller
        // upholds the memory contract. The lists are copied by the driver.
        let rc = unsafe { ibv_post_send(self.qp.as_ptr(), wr_base, &mut bad) };
        if rc != 0 {
            return Err(rc_err("ibv_post_send", rc));
        }
        Ok(())
    }

    /// Runs a whole plan on this QP: posts chains while the window
    /// (`limits.max_rd_atomic`) allows, polls `cq`, and returns one result per
    /// request, by the caller's wr_id, in request order. On a failed work
    /// request the QP goes to Error and the remaining requests are flushed.
    ///
    /// # Safety
    /// As for [`Self::post_chain`], for every request of the plan, until this returns.
    pub unsafe fn execute(
        &mut self,
        cq: &CompletionQueue,
        plan: &ReadPlan,
        limits: &PlanLimits,
        timeout: Duration,
    ) -> Result<Vec<ReadResult>, VerbsError> {
        let base = self.next_wr_base;
        self.next_wr_base += plan.wr_count();
        let window_max = limits.max_rd_atomic.min(self.max_send_wr as usize);
        let mut window = SendWindow::new(window_max);
        let mut tracker = CompletionTracker::new(plan);
        let mut out = Vec::with_capacity(plan.requests.len());
        let mut wcs = Vec::with_capacity(POLL_BATCH);
        let mut chains = plan.chains.iter().peekable();
        let deadline = Instant::now() + timeout;
        let mut failed = false;
        let mut post_err: Option<VerbsError> = None;
        while !tracker.is_done() {
            while let Some(c) = chains.peek() {
                if failed || !window.can_post(c.wrs.len()) {
                    break;
                }
                // SAFETY: the caller's contract covers every chain of the plan.
                if let Err(e) = unsafe { self.post_chain(c, base) } {
                    // Nothing of this chain was posted as a whole; drain what
                    // is in flight, then fail the rest.
                    failed = true;
                    if window.outstanding() == 0 {
                        tracker.fail_all(&e, &mut out);
                    }
                    post_err = Some(e);
                    break;
                }
                window.on_posted(c.wrs.len());
                chains.next();
            }
            if tracker.is_done() {
                break;
            }
            wcs.clear();
            cq.poll(&mut wcs, POLL_BATCH)?;
            for wc in &wcs {
                if wc.wr_id < base || wc.wr_id >= base + plan.wr_count() {
                    continue; // an earlier plan's late flush
                }
                let seq = wc.wr_id - base;
                window.on_completed(seq);
                if wc.is_ok() {
                    tracker.on_success(seq, &mut out);
                } else {
                    failed = true;
                    self.sm.set_error();
                    let err = if wc.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                        VerbsError::Flushed { wr_id: wc.wr_id }
                    } else {
                        VerbsError::Completion {
                            wr_id: wc.wr_id,
                            status: wc.status,
                            detail: format!(
                                "{}, vendor error {:#x}",
                                wc.status_str(),
                                wc.vendor_err
                            ),
                        }
                    };
                    tracker.on_error(seq, err, &mut out);
                    window.reset_outstanding();
                }
            }
            if failed && window.outstanding() == 0 && !tracker.is_done() {
                let e = post_err.clone().unwrap_or(VerbsError::Call {
                    call: "ibv_post_send",
                    detail: "a chain could not be posted".into(),
                });
                tracker.fail_all(&e, &mut out);
            }
            if wcs.is_empty() && Instant::now() >= deadline {
                let e = VerbsError::Timeout(timeout);
                tracker.fail_all(&e, &mut out);
                // The QP may still write into the buffers: stop it.
                let _ = self.modify(&Transition::ToError);
                return Err(e);
            }
        }
        Ok(out)
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: destroyed once, before its PD and CQ (held by Arc here).
        if unsafe { ibv_destroy_qp(self.qp.as_ptr()) } != 0 {
            log::warn!("verbs: ibv_destroy_qp failed: {}", os_error());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HugePages;
    use crate::verbs::plan::{plan_reads, ReadReq};

    #[test]
    fn opening_an_absent_device_names_it() {
        let name = "distmind_absent_0";
        let e = match Context::open(name) {
            Ok(_) => panic!("device {name} should not exist"),
            Err(e) => e,
        };
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!("verbs: RDMA device \"{name}\" not found (")),
            "{msg}"
        );
        assert!(msg.contains("use the tcp or fabric transport"), "{msg}");
        match list_devices() {
            // This machine (no kernel RDMA support): the listing error is named.
            Err(why) => {
                assert!(
                    msg.contains(&format!(
                        "ibv_get_device_list: {why}; devices present: none"
                    )),
                    "{msg}"
                );
                assert!(!why.contains("os error"), "{why}");
            }
            Ok(devs) if devs.is_empty() => assert!(msg.contains("devices present: none"), "{msg}"),
            Ok(devs) => assert!(msg.contains(&devs.join(", ")), "{msg}"),
        }
    }

    #[test]
    fn opening_mlx5_0_here_fails_clearly_unless_present() {
        if list_devices().is_ok_and(|d| d.iter().any(|n| n == "mlx5_0")) {
            return; // a machine with that device
        }
        let msg = Context::open("mlx5_0")
            .err()
            .expect("no mlx5_0")
            .to_string();
        assert!(msg.contains("\"mlx5_0\" not found"), "{msg}");
        println!("{msg}");
    }

    #[test]
    fn not_found_message_format() {
        let e = VerbsError::DeviceNotFound {
            name: "mlx5_0".into(),
            list_error: Some("Function not implemented".into()),
            present: vec![],
        };
        assert_eq!(
            e.to_string(),
            "verbs: RDMA device \"mlx5_0\" not found (ibv_get_device_list: Function not implemented; devices present: none); use the tcp or fabric transport, or check the rdma-core installation"
        );
        let e = VerbsError::DeviceNotFound {
            name: "mlx5_9".into(),
            list_error: None,
            present: vec!["mlx5_0".into(), "mlx5_1".into()],
        };
        assert!(e.to_string().contains("(devices present: mlx5_0, mlx5_1)"));
    }

    fn hw_device() -> String {
        std::env::var("DISTMIND_RDMA_DEVICE")
            .expect("set DISTMIND_RDMA_DEVICE to an RDMA device name (e.g. mlx5_0)")
    }

    fn hw_config() -> RcConfig {
        let gid_index = std::env::var("DISTMIND_RDMA_GID_INDEX")
            .ok()
            .map(|s| s.parse().expect("DISTMIND_RDMA_GID_INDEX is a number"))
            .unwrap_or(0);
        RcConfig {
            gid_index,
            ..RcConfig::default()
        }
    }

    /// Two QPs on one device: the "memory server" exposes a region, the
    /// "GPU server" reads it with planned chains; data verified.
    #[test]
    #[ignore = "needs an RDMA device: DISTMIND_RDMA_DEVICE=mlx5_0"]
    fn hw_loopback_rdma_read() {
        let cfg = hw_config();
        let ctx = Context::open(&hw_device()).unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let cq = CompletionQueue::new(&ctx, 256).unwrap();
        let len = 8 << 20;
        let mut src = HostBuffer::new(len, HugePages::No).unwrap();
        for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
            *b = (i.wrapping_mul(31) ^ (i >> 9)) as u8;
        }
        let src = Arc::new(src);
        let dst = Arc::new(HostBuffer::new(len, HugePages::No).unwrap());
        let src_mr = MemoryRegion::register(&pd, src.clone(), Access::REMOTE_READ).unwrap();
        let dst_mr = MemoryRegion::register(&pd, dst.clone(), Access::LOCAL_WRITE).unwrap();
        let mut server = QueuePair::new(&pd, &cq, 64).unwrap();
        let mut client = QueuePair::new(&pd, &cq, 64).unwrap();
        // Exchanged as bytes, as over the control connection.
        let s_info = QpInfo::decode(
            &server
                .local_info(&cfg, 100, Some(&src_mr))
                .unwrap()
                .encode(),
        )
        .unwrap();
        let c_info = QpInfo::decode(&client.local_info(&cfg, 200, None).unwrap().encode()).unwrap();
        server.connect(&cfg, 100, &c_info).unwrap();
        client.connect(&cfg, 200, &s_info).unwrap();
        assert_eq!(client.state(), QpState::Rts);
        // Reads of odd sizes and places, some bigger than one chunk.
        let mut reqs = Vec::new();
        let mut off = 0u64;
        let mut i = 0u64;
        while off < len as u64 {
            let l = (4096 * (1 + i % 300) + i * 13).min(len as u64 - off);
            assert!(s_info.covers(s_info.addr + off, l));
            reqs.push(ReadReq {
                wr_id: 1000 + i,
                local_addr: dst_mr.addr() + off,
                lkey: dst_mr.lkey(),
                remote_addr: s_info.addr + off,
                rkey: s_info.rkey,
                len: l,
            });
            off += l;
            i += 1;
        }
        let limits = PlanLimits {
            max_wr_per_doorbell: 8,
            max_rd_atomic: 16,
            max_read_bytes: 256 << 10,
            signal_every: 0,
        };
        let plan = plan_reads(&reqs, &limits).unwrap();
        // SAFETY: dst is only read after execute returns; ranges do not overlap.
        let res = unsafe { client.execute(&cq, &plan, &limits, Duration::from_secs(10)) }.unwrap();
        assert_eq!(res.len(), reqs.len());
        for (r, (id, out)) in reqs.iter().zip(&res) {
            assert_eq!(*id, r.wr_id);
            out.as_ref().unwrap();
        }
        // SAFETY: no reads in flight any more.
        assert!(unsafe { dst.slice(0..len) } == unsafe { src.slice(0..len) });
        // A read outside the region fails with a completion error, and the QP goes to Error.
        let bad = [ReadReq {
            rkey: s_info.rkey ^ 0x55,
            ..reqs[0]
        }];
        let plan = plan_reads(&bad, &limits).unwrap();
        // SAFETY: as above.
        let res = unsafe { client.execute(&cq, &plan, &limits, Duration::from_secs(10)) }.unwrap();
        assert!(res[0].1.is_err(), "{:?}", res[0]);
        assert_eq!(client.state(), QpState::Error);
        drop((client, server, src_mr, dst_mr, cq, pd));
        assert_eq!(Arc::strong_count(&ctx), 1, "children released the context");
    }

    #[test]
    #[ignore = "needs an RDMA device: DISTMIND_RDMA_DEVICE=mlx5_0"]
    fn hw_open_and_query_port() {
        let ctx = Context::open(&hw_device()).unwrap();
        let port = ctx.query_port(1).unwrap();
        println!("{}: {port:?}", ctx.name());
        assert!(port.active_mtu.is_some());
        let mut qp = {
            let pd = ProtectionDomain::new(&ctx).unwrap();
            let cq = CompletionQueue::new(&ctx, 16).unwrap();
            QueuePair::new(&pd, &cq, 16).unwrap()
        };
        // Rtr before Init is refused before the driver is called.
        assert!(matches!(
            qp.modify(&Transition::ToRts(RtsAttrs {
                sq_psn: 0,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 1
            })),
            Err(VerbsError::InvalidTransition { .. })
        ));
    }
}
