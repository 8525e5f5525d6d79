//! [`VerbsTransport`]: the [`Transport`] trait over RDMA READs on RC queue
//! pairs (the GPU server's side), and [`VerbsServer`] (the memory server's).
//!
//! One device, one protection domain and one completion queue per side.
//!
//! * The server registers its arena once with [`Access::REMOTE_READ`]; for
//!   every client, [`VerbsServer::accept`] creates a queue pair, connects it
//!   to the client's [`QpInfo`] and answers its own (which carries the
//!   arena's rkey, address and length). The responder side of RDMA READ
//!   needs no CPU: the server never polls.
//! * The client's [`VerbsTransport::connect`] creates a queue pair and hands
//!   its [`QpInfo`] to the caller's [`Connector`], which carries it over the
//!   memory server's control connection and returns the server's info and a
//!   guard (dropping the guard closes the control connection, and the server
//!   destroys its queue pair). Reads are planned into chains (one doorbell
//!   each) and posted as the peer's send window allows; completions are
//!   mapped back to the caller's ops by [`Book`], which holds every piece of
//!   bookkeeping and is tested without hardware.
//!
//! One lock guards the state; it is taken once per `post_reads` batch and
//! once per `poll` round, never per work request. A failed completion loses
//! the peer (the queue pair is in Error): all its remaining ops fail with
//! [`TransportError::PeerLost`], and `connect` gives a fresh queue pair.
//! `disconnect` fails queued ops at once and moves the queue pair to Error so
//! in-flight work flushes; those ops are reported once the flush arrived (or
//! the queue pair was destroyed), never while the device may still write.
//!
//! The completion queue cannot overflow: every queue pair has at most
//! `limits.max_rd_atomic` work requests outstanding, and
//! [`VerbsOptions::validate`] requires `cq_entries >= max_rd_atomic x PEERS_MAX`.

use std::any::Any;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use super::book::{check_server_info, Book, LocalRegion};
use super::device::{
    CompletionQueue, Context, MemoryRegion, ProtectionDomain, QueuePair, WorkCompletion,
};
use super::info::QpInfo;
pub use super::options::VerbsOptions;
use super::qp::{Access, RcConfig, Transition, PSN_MAX};
use super::VerbsError;
use crate::{
    Completion, HostBuffer, PeerId, ReadOp, RegionId, Transport, TransportError, TransportStats,
};

/// Connects this side's queue pair to a memory server: given the server's
/// address and this side's [`QpInfo`], returns the server's info and a guard
/// to keep while connected (dropping it closes the control connection).
pub type Connector = Box<
    dyn Fn(&str, &QpInfo) -> Result<(QpInfo, Box<dyn Any + Send + Sync>), TransportError>
        + Send
        + Sync,
>;

/// Queue pairs a [`VerbsServer`] serves at once.
pub const SERVED_QPS_MAX: usize = 1024;
/// Send slots of a served queue pair (it only answers READs; verbs wants one).
const SERVED_QP_SEND_WR: u32 = 1;
/// Entries of the server's completion queue (a READ responder produces none).
const SERVER_CQ_ENTRIES: u32 = 64;
/// Work completions read per `poll` round.
const POLL_BATCH: usize = 32;

/// A random initial packet sequence number (24 bits).
fn random_psn() -> u32 {
    // RandomState is seeded from the OS once per thread and advanced per
    // instance; the time makes instances of different processes differ too.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(t);
    (h.finish() as u32) & PSN_MAX
}

fn wc_result(wc: &WorkCompletion) -> Result<(), String> {
    if wc.is_ok() {
        Ok(())
    } else {
        Err(format!(
            "RDMA READ completed with status {} ({}), vendor error {:#x}",
            wc.status,
            wc.status_str(),
            wc.vendor_err
        ))
    }
}

/// A connected memory server. Fields drop in order: the queue pair first,
/// then the guard (which lets the server destroy its side).
struct Conn {
    /// `None` once destroyed (a failed post, or a drain that timed out).
    qp: Option<QueuePair>,
    _guard: Box<dyn Any + Send + Sync>,
}

struct State {
    book: Book,
    mrs: HashMap<RegionId, MemoryRegion>,
    conns: HashMap<PeerId, Conn>,
}

impl State {
    /// Applies what the book asks of the device: posts queued chains as
    /// windows allow, moves failed queue pairs to Error, destroys those that
    /// did not drain in time, and drops finished peers.
    fn drive(&mut self) {
        let State { book, conns, .. } = self;
        book.post_all_ready(|id, chain, base| {
            let Some(conn) = conns.get_mut(&id) else {
                return Err("no queue pair".into());
            };
            let Some(qp) = conn.qp.as_mut() else {
                return Err("the queue pair was destroyed".into());
            };
            // SAFETY: the book validated every work request of the chain: its
            // local range lies in a region registered with this PD (lkey of
            // that MR), which stays registered while ops into it are
            // unreported (deregister answers Busy); the remote range lies in
            // the region the server advertised with that rkey. The caller of
            // post_reads keeps the local ranges untouched until their
            // completion is polled, and the book reports an op only once the
            // device is done with it.
            match unsafe { qp.post_chain(chain, base) } {
                Ok(()) => Ok(()),
                Err(e) => {
                    // A chain may be posted in part: stop the queue pair for good.
                    conn.qp = None;
                    Err(e.to_string())
                }
            }
        });
        loop {
            let stop = book.take_to_stop();
            if stop.is_empty() {
                break;
            }
            for id in stop {
                let conn = conns.get_mut(&id);
                let Some(qp) = conn.and_then(|c| c.qp.as_mut()) else {
                    book.qp_destroyed(id);
                    continue;
                };
                if let Err(e) = qp.modify(&Transition::ToError) {
                    log::warn!(
                        "transport verbs: cannot move a queue pair to Error ({e}); destroying it"
                    );
                    if let Some(c) = conns.get_mut(&id) {
                        c.qp = None;
                    }
                    book.qp_destroyed(id);
                }
            }
        }
        for id in book.overdue(Instant::now()) {
            log::warn!(
                "transport verbs: queue pair of {} did not flush within {:?}; destroying it",
                book.peer_addr(id).unwrap_or("?"),
                super::book::DRAIN_TIMEOUT
            );
            if let Some(c) = conns.get_mut(&id) {
                c.qp = None;
            }
            book.qp_destroyed(id);
        }
        for id in book.take_finished() {
            conns.remove(&id);
        }
    }
}

/// The [`Transport`] over RDMA verbs (RC queue pairs, RDMA READ).
pub struct VerbsTransport {
    opts: VerbsOptions,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    connector: Connector,
    state: Mutex<State>,
}

impl VerbsTransport {
    /// Validates `opts`, opens the device by name (failing with
    /// [`VerbsError::DeviceNotFound`] naming it), a PD and one CQ.
    pub fn new(opts: VerbsOptions, connector: Connector) -> Result<Self, VerbsError> {
        opts.validate()?;
        let ctx = Context::open(&opts.device)?;
        let pd = ProtectionDomain::new(&ctx)?;
        let cq = CompletionQueue::new(&ctx, opts.cq_entries)?;
        Ok(VerbsTransport {
            state: Mutex::new(State {
                book: Book::new(opts.limits),
                mrs: HashMap::new(),
                conns: HashMap::new(),
            }),
            opts,
            pd,
            cq,
            connector,
        })
    }

    pub fn options(&self) -> &VerbsOptions {
        &self.opts
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        // Queue pairs first: once destroyed the device writes no local
        // memory, so the MRs (and the buffers they keep alive) may go.
        st.conns.clear();
        st.mrs.clear();
    }
}

impl Transport for VerbsTransport {
    fn name(&self) -> &'static str {
        "verbs"
    }

    fn register(&self, buf: Arc<HostBuffer>) -> Result<RegionId, TransportError> {
        let mr = MemoryRegion::register(&self.pd, buf, Access::LOCAL_WRITE).map_err(|e| {
            TransportError::InvalidOption(format!(
                "cannot register the buffer with RDMA device {}: {e}",
                self.opts.device
            ))
        })?;
        let info = LocalRegion {
            addr: mr.addr(),
            lkey: mr.lkey(),
            len: mr.len() as u64,
        };
        let mut st = self.lock();
        let id = st.book.add_region(info);
        st.mrs.insert(id, mr);
        Ok(id)
    }

    fn deregister(&self, region: RegionId) -> Result<(), TransportError> {
        let mut st = self.lock();
        st.book.remove_region(region)?;
        st.mrs.remove(&region);
        Ok(())
    }

    fn connect(&self, peer_addr: &str) -> Result<PeerId, TransportError> {
        {
            let st = self.lock();
            if let Some(id) = st.book.lookup(peer_addr) {
                return Ok(id);
            }
            st.book.check_room(peer_addr)?;
        }
        let err = |e: VerbsError| TransportError::Connect {
            addr: peer_addr.to_string(),
            source: std::io::Error::other(e),
        };
        let rc = &self.opts.rc;
        let mut qp = QueuePair::new(&self.pd, &self.cq, self.opts.max_send_wr).map_err(err)?;
        let psn = random_psn();
        let local = qp.local_info(rc, psn, None).map_err(err)?;
        // The control connection: no lock held.
        let (remote, guard) = (self.connector)(peer_addr, &local)?;
        check_server_info(peer_addr, &remote)?;
        qp.connect(rc, psn, &remote).map_err(err)?;
        let mut st = self.lock();
        let (id, fresh) = st.book.add_peer(peer_addr, remote)?;
        if fresh {
            st.conns.insert(
                id,
                Conn {
                    qp: Some(qp),
                    _guard: guard,
                },
            );
            // A lost peer this one replaced may need stopping.
            st.drive();
            log::info!(
                "transport verbs: connected to memory server {peer_addr} (qpn {} -> {}) on {}",
                local.qpn,
                remote.qpn,
                self.opts.device
            );
        }
        Ok(id)
    }

    fn disconnect(&self, peer: PeerId) {
        let mut st = self.lock();
        st.book.disconnect(peer);
        st.drive();
    }

    unsafe fn post_reads(&self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError> {
        let mut st = self.lock();
        st.book.enqueue(peer, ops)?;
        st.drive();
        Ok(())
    }

    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, TransportError> {
        let deadline = Instant::now() + timeout;
        let start = out.len();
        let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(POLL_BATCH);
        loop {
            wcs.clear();
            {
                let mut st = self.lock();
                self.cq
                    .poll(&mut wcs, POLL_BATCH)
                    .map_err(|e| TransportError::Protocol {
                        addr: "local completion queue".into(),
                        detail: e.to_string(),
                    })?;
                for wc in &wcs {
                    if !st.book.on_completion(wc.wr_id, wc_result(wc)) {
                        log::debug!(
                            "transport verbs: late completion {:#x} of a gone queue pair",
                            wc.wr_id
                        );
                    }
                }
                st.drive();
                st.book.take_done(out, max - (out.len() - start));
            }
            let got = out.len() - start;
            if got > 0 || max == 0 || Instant::now() >= deadline {
                return Ok(got);
            }
            if wcs.is_empty() {
                std::thread::yield_now();
            }
        }
    }

    fn stats(&self) -> TransportStats {
        self.lock().book.stats()
    }
}

/// A counted place among [`SERVED_QPS_MAX`]; given back on drop.
struct ServedSlot(Arc<AtomicUsize>);

impl ServedSlot {
    fn take(count: &Arc<AtomicUsize>) -> Result<Self, VerbsError> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < SERVED_QPS_MAX).then_some(n + 1)
            })
            .map_err(|_| VerbsError::Call {
                call: "VerbsServer::accept",
                detail: format!(
                    "already serving SERVED_QPS_MAX = {SERVED_QPS_MAX} queue pairs; a client must disconnect first"
                ),
            })?;
        Ok(ServedSlot(count.clone()))
    }
}

impl Drop for ServedSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A queue pair a [`VerbsServer`] serves; destroyed on drop.
pub struct ServedQp {
    // Drops first: the queue pair is destroyed before its slot is given back.
    qp: Mutex<QueuePair>,
    _slot: ServedSlot,
}

impl ServedQp {
    pub fn qpn(&self) -> u32 {
        self.qp.lock().unwrap_or_else(|p| p.into_inner()).qpn()
    }
}

impl std::fmt::Debug for ServedQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedQp")
            .field("qpn", &self.qpn())
            .finish()
    }
}

/// The memory server's side: its arena, readable by connected clients.
pub struct VerbsServer {
    rc: RcConfig,
    device: String,
    arena: MemoryRegion,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    served: Arc<AtomicUsize>,
}

impl VerbsServer {
    /// Validates `opts`, opens the device, a PD and one CQ, and registers
    /// `arena` once with [`Access::REMOTE_READ`].
    pub fn new(opts: &VerbsOptions, arena: Arc<HostBuffer>) -> Result<Self, VerbsError> {
        opts.validate()?;
        let ctx = Context::open(&opts.device)?;
        let pd = ProtectionDomain::new(&ctx)?;
        let cq = CompletionQueue::new(&ctx, SERVER_CQ_ENTRIES)?;
        let arena = MemoryRegion::register(&pd, arena, Access::REMOTE_READ)?;
        Ok(VerbsServer {
            rc: opts.rc,
            device: opts.device.clone(),
            arena,
            pd,
            cq,
            served: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Creates a queue pair connected to `client`'s; returns this side's
    /// info (with the arena's rkey, address and length) and the guard that
    /// keeps the queue pair alive. At most [`SERVED_QPS_MAX`] at once.
    pub fn accept(&self, client: &QpInfo) -> Result<(QpInfo, ServedQp), VerbsError> {
        client.validate()?;
        let slot = ServedSlot::take(&self.served)?;
        let mut qp = QueuePair::new(&self.pd, &self.cq, SERVED_QP_SEND_WR)?;
        let psn = random_psn();
        let info = qp.local_info(&self.rc, psn, Some(&self.arena))?;
        qp.connect(&self.rc, psn, client)?;
        log::debug!(
            "verbs server on {}: queue pair {} serves client qpn {}",
            self.device,
            info.qpn,
            client.qpn
        );
        Ok((
            info,
            ServedQp {
                qp: Mutex::new(qp),
                _slot: slot,
            },
        ))
    }

    /// Queue pairs served now.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::Acquire)
    }

    /// Arena bytes readable by clients.
    pub fn arena_len(&self) -> u64 {
        self.arena.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HugePages;
    use crate::read_blocking;
    use std::sync::atomic::AtomicBool;

    fn no_connector() -> Connector {
        Box::new(|addr, _| {
            Err(TransportError::Protocol {
                addr: addr.to_string(),
                detail: "no control connection in this test".into(),
            })
        })
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn types_are_send_and_sync() {
        assert_send_sync::<VerbsTransport>();
        assert_send_sync::<VerbsServer>();
        assert_send_sync::<ServedQp>();
    }

    #[test]
    fn an_absent_device_is_named() {
        let name = "distmind_absent_0";
        let msg = match VerbsTransport::new(VerbsOptions::new(name), no_connector()) {
            Ok(_) => panic!("device {name} should not exist"),
            Err(e) => {
                assert!(matches!(e, VerbsError::DeviceNotFound { .. }), "{e:?}");
                e.to_string()
            }
        };
        assert!(
            msg.contains(&format!("RDMA device \"{name}\" not found")),
            "{msg}"
        );
        let arena = Arc::new(HostBuffer::new(4096, HugePages::No).unwrap());
        let msg = match VerbsServer::new(&VerbsOptions::new(name), arena) {
            Ok(_) => panic!("device {name} should not exist"),
            Err(e) => e.to_string(),
        };
        assert!(
            msg.contains(&format!("RDMA device \"{name}\" not found")),
            "{msg}"
        );
    }

    #[test]
    fn bad_options_are_refused_before_the_device_is_opened() {
        let mut o = VerbsOptions::new("distmind_absent_0");
        o.cq_entries = 1;
        let msg = match VerbsTransport::new(o, no_connector()) {
            Ok(_) => panic!("bad options accepted"),
            Err(e) => e.to_string(),
        };
        assert!(msg.contains("VerbsOptions.cq_entries"), "{msg}");
    }

    fn hw_options() -> VerbsOptions {
        let device = std::env::var("DISTMIND_RDMA_DEVICE")
            .expect("set DISTMIND_RDMA_DEVICE to an RDMA device name (e.g. mlx5_0)");
        let mut o = VerbsOptions::new(device);
        if let Ok(s) = std::env::var("DISTMIND_RDMA_GID_INDEX") {
            o.rc.gid_index = s.parse().expect("DISTMIND_RDMA_GID_INDEX is a number");
        }
        o
    }

    fn pattern(len: usize) -> Arc<HostBuffer> {
        let mut b = HostBuffer::new(len, HugePages::No).unwrap();
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ (i >> 20) as u8;
        }
        Arc::new(b)
    }

    /// A server and a transport on one device; the connector calls
    /// `accept` in-process (and corrupts the rkey while `lie` is set).
    fn hw_pair(arena_len: usize) -> (Arc<VerbsServer>, VerbsTransport, Arc<AtomicBool>) {
        let opts = hw_options();
        let server = Arc::new(VerbsServer::new(&opts, pattern(arena_len)).unwrap());
        let lie = Arc::new(AtomicBool::new(false));
        let (s, l) = (server.clone(), lie.clone());
        let connector: Connector = Box::new(move |_addr, client| {
            // Exchanged as bytes, as over the control connection.
            let client = QpInfo::decode(&client.encode()).expect("valid client info");
            let (mut info, guard) = s.accept(&client).map_err(|e| TransportError::Protocol {
                addr: "in-process server".into(),
                detail: e.to_string(),
            })?;
            if l.load(Ordering::Relaxed) {
                info.rkey ^= 0x55;
            }
            Ok((info, Box::new(guard) as Box<dyn Any + Send + Sync>))
        });
        let t = VerbsTransport::new(opts, connector).unwrap();
        (server, t, lie)
    }

    /// Ops of odd sizes tiling `[0, len)` of both sides.
    fn tiling_ops(region: RegionId, len: u64) -> Vec<ReadOp> {
        let mut ops = Vec::new();
        let (mut off, mut i) = (0u64, 0u64);
        while off < len {
            let l = (4096 * (1 + i % 64) + i * 13).min(len - off);
            ops.push(ReadOp {
                wr_id: i,
                remote_offset: off,
                len: l,
                local: region,
                local_offset: off,
            });
            off += l;
            i += 1;
        }
        ops
    }

    #[test]
    #[ignore = "needs an RDMA device: DISTMIND_RDMA_DEVICE=mlx5_0"]
    fn hw_reads_64_mib_and_recovers_from_a_lost_peer() {
        let len = 64usize << 20;
        let (server, t, lie) = hw_pair(len);
        let dst = Arc::new(HostBuffer::new(len, HugePages::No).unwrap());
        let region = t.register(dst.clone()).unwrap();
        let peer = t.connect("mem-0").unwrap();
        assert_eq!(t.connect("mem-0").unwrap(), peer, "idempotent");
        assert_eq!(server.served(), 1);
        let ops = tiling_ops(region, len as u64);
        assert!(ops.len() > 256, "several read_blocking batches");
        let started = Instant::now();
        // SAFETY: dst is read only after read_blocking returned; ops do not overlap.
        unsafe { read_blocking(&t, peer, &ops) }.unwrap();
        let secs = started.elapsed().as_secs_f64();
        println!(
            "{} ops, {len} bytes in {secs:.3} s ({:.2} GB/s)",
            ops.len(),
            len as f64 / secs / 1e9
        );
        let src = pattern(len);
        // SAFETY: nothing is in flight any more.
        assert!(unsafe { dst.slice(0..len) } == unsafe { src.slice(0..len) });
        let s = t.stats();
        assert_eq!(s.bytes_read, len as u64);
        assert_eq!(s.ops_completed, ops.len() as u64);
        assert_eq!(s.ops_failed, 0);
        // Outside the advertised arena: refused before posting.
        let bad = ReadOp {
            remote_offset: len as u64 - 10,
            len: 11,
            ..ops[0]
        };
        // SAFETY: refused synchronously, nothing is posted.
        let e = unsafe { t.post_reads(peer, &[bad]) }.unwrap_err();
        assert!(matches!(e, TransportError::RemoteOutOfRange { .. }), "{e}");
        assert!(matches!(t.deregister(region), Ok(())));
        let region = t.register(dst.clone()).unwrap();
        // A wrong rkey: a remote access error loses the peer, every op fails once.
        t.disconnect(peer);
        lie.store(true, Ordering::Relaxed);
        let liar = t.connect("mem-0").unwrap();
        assert_ne!(liar, peer);
        let some: Vec<ReadOp> = tiling_ops(region, 8 << 20);
        assert!(some.len() <= 256, "one read_blocking batch: all are posted");
        // SAFETY: as above.
        let e = unsafe { read_blocking(&t, liar, &some) }.unwrap_err();
        assert!(matches!(e, TransportError::PeerLost { .. }), "{e}");
        assert_eq!(t.stats().ops_failed, some.len() as u64);
        // SAFETY: refused synchronously.
        let e = unsafe { t.post_reads(liar, &some[..1]) }.unwrap_err();
        assert!(matches!(e, TransportError::PeerLost { .. }), "{e}");
        // connect replaces the lost peer with a fresh queue pair.
        lie.store(false, Ordering::Relaxed);
        let fresh = t.connect("mem-0").unwrap();
        assert_ne!(fresh, liar);
        // SAFETY: as above.
        unsafe { read_blocking(&t, fresh, &some) }.unwrap();
        drop(t);
        assert_eq!(server.served(), 0, "guards dropped, server QPs destroyed");
    }

    #[test]
    #[ignore = "needs an RDMA device: DISTMIND_RDMA_DEVICE=mlx5_0"]
    fn hw_disconnect_with_reads_in_flight_reports_each_once() {
        let len = 32usize << 20;
        let (server, t, _) = hw_pair(len);
        let dst = Arc::new(HostBuffer::new(len, HugePages::No).unwrap());
        let region = t.register(dst).unwrap();
        let peer = t.connect("mem-0").unwrap();
        let ops = tiling_ops(region, len as u64);
        let n = ops.len().min(1000);
        // SAFETY: dst is never read; ranges do not overlap.
        unsafe { t.post_reads(peer, &ops[..n]) }.unwrap();
        t.disconnect(peer);
        assert!(matches!(
            t.deregister(region),
            Err(TransportError::Busy(_)) | Ok(())
        ));
        let mut seen = vec![false; n];
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = 0;
        while got < n && Instant::now() < deadline {
            out.clear();
            t.poll(&mut out, n, Duration::from_millis(100)).unwrap();
            for c in &out {
                assert!(!seen[c.wr_id as usize], "op {} reported twice", c.wr_id);
                seen[c.wr_id as usize] = true;
                got += 1;
            }
        }
        assert_eq!(got, n);
        assert!(t.poll(&mut out, 1, Duration::from_millis(50)).unwrap() == 0);
        // SAFETY: refused synchronously.
        let e = unsafe { t.post_reads(peer, &ops[..1]) }.unwrap_err();
        assert!(matches!(e, TransportError::UnknownPeer(_)), "{e}");
        let again = t.connect("mem-0").unwrap();
        assert_ne!(again, peer);
        drop(t);
        assert_eq!(server.served(), 0);
    }
}
