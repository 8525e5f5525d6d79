//! A training worker's one listener, and the opening of every dist
//! connection.
//!
//! A connection opens with the cluster-key handshake
//! ([`distmind_common::handshake`], role [`Role::Control`]), then one JSON
//! frame ([`distmind_common::wire`]) from the side that dialled saying what
//! the connection is for (`Hello`: a stage link of a job's pipeline, or a
//! ring edge of an all-reduce group), and one JSON frame back (`Verdict`).
//! The listener checks the hello against the worker it belongs to
//! ([`WorkerIdentity`]) and refuses a wrong job, pipeline, stage or worker
//! with a named [`Refusal`] that the dialling side returns as its error.
//!
//! Accepted connections wait in a bounded table until a
//! [`super::StageLink::accept`] or a ring takes them, so a peer may dial as
//! soon as the listener is bound, before anyone waits for it.
//!
//! The accept thread handshakes one connection at a time, each bounded by
//! [`HELLO_TIMEOUT`]; `common::handshake` offers its server side only as an
//! async function, so the thread drives it on a current-thread tokio runtime
//! of its own. Everything after the handshake is blocking std::net.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use distmind_common::handshake::{self, ClusterKey, HandshakeError};
use distmind_common::wire::{self, Role, WireError};
use serde::{Deserialize, Serialize};

use super::limits::{
    GROUP_MEMBERS_MAX, HELLO_FRAME_BYTES_MAX, HELLO_TIMEOUT, LISTENER_CONNECTIONS_MAX,
    PENDING_CONNECTIONS_MAX,
};

/// Pause after a failed `accept` (out of descriptors, say) before the next.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(10);

/// Who a listener belongs to: one stage of one pipeline of one job, and
/// its worker id in all-reduce groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerIdentity {
    pub job: u64,
    /// The worker's id in all-reduce groups ([`super::RingMember::id`]).
    pub worker: u32,
    pub pipeline: u32,
    pub stage: u32,
}

/// What a dialling side says its connection is for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "dist", rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum Hello {
    /// A link from stage `from` to stage `to` of one pipeline.
    StageLink {
        job: u64,
        pipeline: u32,
        from: u32,
        to: u32,
    },
    /// The ring edge from member `from` to member `to` of a group (its
    /// member ids, ascending).
    Ring {
        job: u64,
        group: Vec<u32>,
        from: u32,
        to: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub(crate) enum Verdict {
    Accepted,
    Refused { refusal: Refusal },
}

/// Why a listener refused a connection; the dialling side gets it back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "reason", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Refusal {
    #[error("the worker runs job {ours}, the connection is for job {theirs}")]
    WrongJob { ours: u64, theirs: u64 },
    #[error("the worker is in pipeline {ours}, the link is for pipeline {theirs}")]
    WrongPipeline { ours: u32, theirs: u32 },
    #[error("the worker is stage {ours}, the link is for stage {theirs}")]
    WrongStage { ours: u32, theirs: u32 },
    #[error("stages {from} and {to} are not adjacent: links join neighbouring stages only")]
    NotAdjacent { from: u32, to: u32 },
    #[error("the worker is member {ours}, the ring edge is for member {theirs}")]
    WrongWorker { ours: u32, theirs: u32 },
    #[error("ring group {group:?}: {detail}")]
    BadGroup { group: Vec<u32>, detail: String },
    #[error(
        "the worker already holds {open} connections, its bound (LISTENER_CONNECTIONS_MAX = {max})"
    )]
    Busy { open: usize, max: usize },
    #[error("malformed hello: {detail}")]
    Malformed { detail: String },
}

/// Why dialling a worker failed (before any link or ring context is added).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DialError {
    #[error("cannot connect: {0}")]
    Connect(#[source] io::Error),
    #[error("cluster-key handshake failed: {0}")]
    Handshake(#[source] HandshakeError),
    #[error("the opening hello failed: {0}")]
    Hello(#[source] WireError),
    #[error("refused: {0}")]
    Refused(Refusal),
}

/// Checks a ring group as [`Hello::Ring`] states it: 2 to
/// [`GROUP_MEMBERS_MAX`] ids, strictly ascending.
pub(crate) fn check_group(group: &[u32]) -> Result<(), String> {
    if group.len() < 2 || group.len() > GROUP_MEMBERS_MAX {
        return Err(format!(
            "{} members; a ring has 2 to {GROUP_MEMBERS_MAX}",
            group.len()
        ));
    }
    if group.windows(2).any(|w| w[0] >= w[1]) {
        return Err("member ids are not strictly ascending".into());
    }
    Ok(())
}

/// The member after `id` in ring order (ascending ids, wrapping).
pub(crate) fn ring_next(group: &[u32], id: u32) -> Option<u32> {
    let i = group.iter().position(|&m| m == id)?;
    Some(group[(i + 1) % group.len()])
}

impl WorkerIdentity {
    /// Whether this worker takes a connection that says `hello`.
    fn admits(&self, hello: &Hello) -> Result<(), Refusal> {
        match hello {
            Hello::StageLink {
                job,
                pipeline,
                from,
                to,
            } => {
                if *job != self.job {
                    return Err(Refusal::WrongJob {
                        ours: self.job,
                        theirs: *job,
                    });
                }
                if *pipeline != self.pipeline {
                    return Err(Refusal::WrongPipeline {
                        ours: self.pipeline,
                        theirs: *pipeline,
                    });
                }
                if *to != self.stage {
                    return Err(Refusal::WrongStage {
                        ours: self.stage,
                        theirs: *to,
                    });
                }
                if from.abs_diff(*to) != 1 {
                    return Err(Refusal::NotAdjacent {
                        from: *from,
                        to: *to,
                    });
                }
                Ok(())
            }
            Hello::Ring {
                job,
                group,
                from,
                to,
            } => {
                if *job != self.job {
                    return Err(Refusal::WrongJob {
                        ours: self.job,
                        theirs: *job,
                    });
                }
                if *to != self.worker {
                    return Err(Refusal::WrongWorker {
                        ours: self.worker,
                        theirs: *to,
                    });
                }
                let bad = |detail: String| Refusal::BadGroup {
                    group: group.clone(),
                    detail,
                };
                check_group(group).map_err(bad)?;
                if ring_next(group, *from) != Some(*to) {
                    return Err(bad(format!(
                        "member {to} does not follow member {from} in the ring"
                    )));
                }
                Ok(())
            }
        }
    }
}

/// Which waiting connection a taker wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PendingKey {
    Stage { from: u32 },
    Ring { group: Vec<u32>, from: u32 },
}

impl PendingKey {
    fn of(hello: &Hello) -> Self {
        match hello {
            Hello::StageLink { from, .. } => PendingKey::Stage { from: *from },
            Hello::Ring { group, from, .. } => PendingKey::Ring {
                group: group.clone(),
                from: *from,
            },
        }
    }
}

/// Holds one of the listener's connection slots until dropped.
#[derive(Debug)]
pub(crate) struct ConnSlot(Arc<AtomicUsize>);

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An accepted, authenticated connection that no one has taken yet.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) key: PendingKey,
    pub(crate) stream: TcpStream,
    pub(crate) peer: SocketAddr,
    pub(crate) slot: ConnSlot,
}

/// Counters of a listener since it was bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListenerStats {
    /// Connections that passed the handshake and the hello.
    pub accepted: u64,
    /// Connections refused (wrong key, wrong identity, busy, malformed).
    pub refused: u64,
    /// Accepted connections dropped untaken (replaced by a newer one from
    /// the same peer, or pushed out of a full table).
    pub dropped_untaken: u64,
}

struct Shared {
    identity: WorkerIdentity,
    key: ClusterKey,
    pending: Mutex<VecDeque<Pending>>,
    arrived: Condvar,
    closing: AtomicBool,
    /// Accepted connections still open, pending or taken.
    open: Arc<AtomicUsize>,
    accepted: AtomicU64,
    refused: AtomicU64,
    dropped_untaken: AtomicU64,
}

/// A worker's listener: bound at start, accepting at most
/// [`LISTENER_CONNECTIONS_MAX`] open connections. Dropping it stops its
/// thread and closes the connections no one took.
pub struct DistListener {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for DistListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistListener")
            .field("addr", &self.addr)
            .field("identity", &self.shared.identity)
            .finish()
    }
}

impl DistListener {
    /// Binds `addr` (port 0 picks one) and starts accepting.
    pub fn bind(addr: SocketAddr, key: ClusterKey, identity: WorkerIdentity) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let shared = Arc::new(Shared {
            identity,
            key,
            pending: Mutex::new(VecDeque::with_capacity(PENDING_CONNECTIONS_MAX)),
            arrived: Condvar::new(),
            closing: AtomicBool::new(false),
            open: Arc::new(AtomicUsize::new(0)),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            dropped_untaken: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("dm-dist-accept-{}", addr.port()))
            .spawn(move || accept_loop(&listener, &sh, &rt))?;
        Ok(DistListener {
            addr,
            shared,
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn identity(&self) -> WorkerIdentity {
        self.shared.identity
    }

    pub fn stats(&self) -> ListenerStats {
        ListenerStats {
            accepted: self.shared.accepted.load(Ordering::Relaxed),
            refused: self.shared.refused.load(Ordering::Relaxed),
            dropped_untaken: self.shared.dropped_untaken.load(Ordering::Relaxed),
        }
    }

    /// Connections accepted and still open (pending or taken).
    pub fn open_connections(&self) -> usize {
        self.shared.open.load(Ordering::Acquire)
    }

    /// Takes the connection for `key`, waiting until `deadline`.
    pub(crate) fn take(&self, key: &PendingKey, deadline: Instant) -> Option<Pending> {
        let mut pending = self.shared.pending.lock().unwrap();
        loop {
            if let Some(i) = pending.iter().position(|p| &p.key == key) {
                return pending.remove(i);
            }
            let now = Instant::now();
            if now >= deadline || self.shared.closing.load(Ordering::Acquire) {
                return None;
            }
            pending = self
                .shared
                .arrived
                .wait_timeout(pending, deadline - now)
                .unwrap()
                .0;
        }
    }
}

impl Drop for DistListener {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.shared.arrived.notify_all();
        // Wake the blocking accept with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        match TcpStream::connect_timeout(&wake, HELLO_TIMEOUT) {
            Ok(s) => {
                drop(s);
                if let Some(t) = self.thread.take() {
                    let _ = t.join();
                }
            }
            // The thread is left to exit on its next connection.
            Err(e) => log::warn!(
                "dist listener {}: cannot wake the accept thread to stop it: {e}",
                self.addr
            ),
        }
        self.shared.pending.lock().unwrap().clear();
    }
}

fn accept_loop(listener: &TcpListener, sh: &Shared, rt: &tokio::runtime::Runtime) {
    loop {
        let conn = listener.accept();
        if sh.closing.load(Ordering::Acquire) {
            return;
        }
        match conn {
            Ok((stream, peer)) => admit(sh, rt, stream, peer),
            Err(e) => {
                log::warn!("dist listener: accept failed: {e}");
                std::thread::sleep(ACCEPT_ERROR_BACKOFF);
            }
        }
    }
}

fn send_verdict(stream: &mut TcpStream, verdict: &Verdict) {
    let _ = wire::send_message_sync(stream, verdict);
}

/// Handshake, hello, identity check; an accepted connection goes to the
/// pending table.
fn admit(sh: &Shared, rt: &tokio::runtime::Runtime, stream: TcpStream, peer: SocketAddr) {
    // The slot is taken before the handshake so that the bound holds for
    // connections in the middle of one too.
    let open = sh.open.fetch_add(1, Ordering::AcqRel) + 1;
    let slot = ConnSlot(sh.open.clone());
    let refuse = |stream: &mut TcpStream, refusal: Refusal| {
        sh.refused.fetch_add(1, Ordering::Relaxed);
        log::warn!("dist listener: refused {peer}: {refusal}");
        send_verdict(stream, &Verdict::Refused { refusal });
    };
    let setup = || -> io::Result<TcpStream> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        let stream = rt.block_on(async {
            let mut s = tokio::net::TcpStream::from_std(stream)?;
            match handshake::server(&mut s, &sh.key).await {
                Ok(Role::Control) => s.into_std(),
                Ok(role) => Err(io::Error::other(format!(
                    "asked for a {role:?} connection; dist listeners serve control connections"
                ))),
                Err(e) => Err(io::Error::other(e)),
            }
        })?;
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
        stream.set_write_timeout(Some(HELLO_TIMEOUT))?;
        Ok(stream)
    };
    let mut stream = match setup() {
        Ok(s) => s,
        Err(e) => {
            sh.refused.fetch_add(1, Ordering::Relaxed);
            log::warn!("dist listener: refused {peer}: {e}");
            return;
        }
    };
    let hello: Hello = match wire::recv_message_sync(&mut stream, HELLO_FRAME_BYTES_MAX) {
        Ok(h) => h,
        Err(e) => {
            return refuse(
                &mut stream,
                Refusal::Malformed {
                    detail: e.to_string(),
                },
            )
        }
    };
    if let Err(refusal) = sh.identity.admits(&hello) {
        return refuse(&mut stream, refusal);
    }
    if open > LISTENER_CONNECTIONS_MAX {
        return refuse(
            &mut stream,
            Refusal::Busy {
                open: open - 1,
                max: LISTENER_CONNECTIONS_MAX,
            },
        );
    }
    if let Err(e) = wire::send_message_sync(&mut stream, &Verdict::Accepted) {
        log::warn!("dist listener: {peer} left before its verdict: {e}");
        return;
    }
    sh.accepted.fetch_add(1, Ordering::Relaxed);
    let key = PendingKey::of(&hello);
    let mut pending = sh.pending.lock().unwrap();
    // The newest connection from a peer wins: the older one is from an
    // attempt the peer gave up.
    if let Some(i) = pending.iter().position(|p| p.key == key) {
        let old = pending.remove(i).expect("found");
        let _ = old.stream.shutdown(Shutdown::Both);
        sh.dropped_untaken.fetch_add(1, Ordering::Relaxed);
    }
    if pending.len() == PENDING_CONNECTIONS_MAX {
        let old = pending.pop_front().expect("full");
        log::warn!(
            "dist listener: {} pending connections, the bound; dropped the oldest, from {}",
            PENDING_CONNECTIONS_MAX,
            old.peer
        );
        let _ = old.stream.shutdown(Shutdown::Both);
        sh.dropped_untaken.fetch_add(1, Ordering::Relaxed);
    }
    pending.push_back(Pending {
        key,
        stream,
        peer,
        slot,
    });
    drop(pending);
    sh.arrived.notify_all();
}

/// Dials a worker's listener: connect, handshake, hello, verdict. The
/// stream comes back with the timeouts of the opening still set.
pub(crate) fn dial(
    addr: SocketAddr,
    key: &ClusterKey,
    hello: &Hello,
    timeout: Duration,
) -> Result<TcpStream, DialError> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(DialError::Connect)?;
    let setup = |s: &TcpStream| -> io::Result<()> {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))
    };
    setup(&s).map_err(DialError::Connect)?;
    handshake::client_sync(&mut s, key, Role::Control).map_err(DialError::Handshake)?;
    wire::send_message_sync(&mut s, hello).map_err(DialError::Hello)?;
    match wire::recv_message_sync::<_, Verdict>(&mut s, HELLO_FRAME_BYTES_MAX)
        .map_err(DialError::Hello)?
    {
        Verdict::Accepted => Ok(s),
        Verdict::Refused { refusal } => Err(DialError::Refused(refusal)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> WorkerIdentity {
        WorkerIdentity {
            job: 7,
            worker: 20,
            pipeline: 1,
            stage: 2,
        }
    }

    fn link(job: u64, pipeline: u32, from: u32, to: u32) -> Hello {
        Hello::StageLink {
            job,
            pipeline,
            from,
            to,
        }
    }

    #[test]
    fn stage_links_must_match_job_pipeline_stage_and_be_adjacent() {
        let w = me();
        assert_eq!(w.admits(&link(7, 1, 1, 2)), Ok(()));
        assert_eq!(w.admits(&link(7, 1, 3, 2)), Ok(()));
        assert!(matches!(
            w.admits(&link(8, 1, 1, 2)),
            Err(Refusal::WrongJob { ours: 7, theirs: 8 })
        ));
        assert!(matches!(
            w.admits(&link(7, 0, 1, 2)),
            Err(Refusal::WrongPipeline { .. })
        ));
        assert!(matches!(
            w.admits(&link(7, 1, 2, 3)),
            Err(Refusal::WrongStage { ours: 2, theirs: 3 })
        ));
        assert!(matches!(
            w.admits(&link(7, 1, 0, 2)),
            Err(Refusal::NotAdjacent { .. })
        ));
        assert!(matches!(
            w.admits(&link(7, 1, 2, 2)),
            Err(Refusal::NotAdjacent { .. })
        ));
    }

    #[test]
    fn ring_edges_must_follow_the_group_order() {
        let w = me();
        let ring = |group: Vec<u32>, from, to| Hello::Ring {
            job: 7,
            group,
            from,
            to,
        };
        assert_eq!(w.admits(&ring(vec![5, 20, 30], 5, 20)), Ok(()));
        // 20 is the first member: its predecessor is the last one.
        assert_eq!(w.admits(&ring(vec![20, 30, 40], 40, 20)), Ok(()));
        assert_eq!(w.admits(&ring(vec![3, 20], 3, 20)), Ok(()));
        for bad in [
            ring(vec![5, 20, 30], 30, 20),
            ring(vec![20, 5], 5, 20),
            ring(vec![20], 20, 20),
            ring(vec![5, 5, 20], 5, 20),
            ring((0..GROUP_MEMBERS_MAX as u32 + 1).collect(), 19, 20),
        ] {
            assert!(
                matches!(w.admits(&bad), Err(Refusal::BadGroup { .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            w.admits(&ring(vec![5, 21, 30], 5, 21)),
            Err(Refusal::WrongWorker { .. })
        ));
        let mut other_job = ring(vec![5, 20], 5, 20);
        if let Hello::Ring { job, .. } = &mut other_job {
            *job = 1;
        }
        assert!(matches!(
            w.admits(&other_job),
            Err(Refusal::WrongJob { .. })
        ));
    }

    #[test]
    fn hello_and_verdict_json_round_trip() {
        let h = Hello::Ring {
            job: 1,
            group: vec![1, 2, 3],
            from: 3,
            to: 1,
        };
        let s = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<Hello>(&s).unwrap(), h);
        let v = Verdict::Refused {
            refusal: Refusal::Busy { open: 3, max: 4 },
        };
        let s = serde_json::to_string(&v).unwrap();
        assert_eq!(serde_json::from_str::<Verdict>(&s).unwrap(), v);
        // The largest ring hello fits in a hello frame.
        let h = Hello::Ring {
            job: u64::MAX,
            group: (u32::MAX - GROUP_MEMBERS_MAX as u32..u32::MAX).collect(),
            from: u32::MAX,
            to: u32::MAX,
        };
        assert!(serde_json::to_vec(&h).unwrap().len() <= HELLO_FRAME_BYTES_MAX as usize);
    }

    #[test]
    fn a_refused_dial_names_the_refusal_and_the_listener_stops_on_drop() {
        let key = ClusterKey::from_secret(b"listener-test-key-000");
        let l = DistListener::bind("127.0.0.1:0".parse().unwrap(), key.clone(), me()).unwrap();
        let e = dial(
            l.local_addr(),
            &key,
            &link(9, 1, 1, 2),
            Duration::from_secs(5),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                DialError::Refused(Refusal::WrongJob { ours: 7, theirs: 9 })
            ),
            "{e}"
        );
        let s = dial(
            l.local_addr(),
            &key,
            &link(7, 1, 1, 2),
            Duration::from_secs(5),
        )
        .unwrap();
        let p = l
            .take(
                &PendingKey::Stage { from: 1 },
                Instant::now() + Duration::from_secs(5),
            )
            .unwrap();
        assert_eq!(p.peer, s.local_addr().unwrap());
        assert_eq!(l.open_connections(), 1);
        drop(p);
        assert_eq!(l.open_connections(), 0);
        assert_eq!(
            l.stats(),
            ListenerStats {
                accepted: 1,
                refused: 1,
                dropped_untaken: 0
            }
        );
        // Nothing else is coming: take times out.
        assert!(l
            .take(&PendingKey::Stage { from: 3 }, Instant::now())
            .is_none());
        let addr = l.local_addr();
        drop(l);
        assert!(dial(addr, &key, &link(7, 1, 1, 2), Duration::from_secs(5)).is_err());
    }
}
