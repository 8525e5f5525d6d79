//! The TCP transport: one-sided reads emulated over plain sockets.
//!
//! Per peer, `streams_per_peer` connections, each after the Data-role
//! handshake. `post_reads` cuts ops into `chunk_bytes` chunks and gives each
//! to the stream with the fewest unfinished bytes (so a slow stream takes
//! fewer chunks), on that stream's own queue. A stream answers in order, so
//! an op posted before another, whose chunks spread over the same streams,
//! lands first, and at the whole link's rate rather than beside the later op
//! (with one queue that every writer drained, a writer took a run of chunks
//! at once: a fetch's group 0 shared the link with group 1 and landed with
//! it). Per stream:
//!
//! * a writer thread pops a chunk, hands it to its reader through a bounded
//!   channel (which caps the requests outstanding on the wire at
//!   `inflight_per_stream`) and sends the 32-byte `ReadRequest`;
//! * a reader thread takes chunks in the same order (the server answers in
//!   order), checks each reply header against the request, and reads the
//!   payload straight into the destination range of the registered buffer:
//!   no intermediate buffer, no allocation per chunk.
//!
//! An op completes when its last chunk finished; a chunk error fails the op
//! (the first error is reported). A peer that dies (EOF, reset, `io_timeout`,
//! or a protocol error that leaves the stream out of step) is marked dead, all
//! its sockets are shut down, and every in-flight and queued chunk of it fails
//! with `PeerLost`; other peers are unaffected.

use std::collections::HashMap;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::Sender;
use distmind_common::handshake::{self, ClusterKey};
use distmind_common::limits::READ_CHUNK_BYTES_MAX;
use distmind_common::wire::Role;

mod stream;

use stream::{reader, writer, Chunk, Link, OpState, Shared};

use crate::completion::{chunk_count, Chunks, CompletionQueue, Regions};
use crate::token_bucket::TokenBucket;
use crate::{
    Completion, HostBuffer, PeerId, ReadOp, RegionId, Transport, TransportError, TransportStats,
    INFLIGHT_PER_STREAM_MAX, STREAMS_PER_PEER_MAX,
};

/// What the names of a transport's stream threads start with
/// (`dm-tcp-w{peer}.{stream}` writes requests, `dm-tcp-r..` reads replies).
pub const THREAD_PREFIX: &str = "dm-tcp";

/// Default size of the pieces ops are cut into.
pub const TCP_CHUNK_BYTES_DEFAULT: u64 = 4 << 20;

#[derive(Debug, Clone)]
pub struct TcpOptions {
    pub key: ClusterKey,
    /// Connections per memory server (1..=STREAMS_PER_PEER_MAX).
    pub streams_per_peer: usize,
    /// Largest request sent (1..=READ_CHUNK_BYTES_MAX).
    pub chunk_bytes: u64,
    /// Requests outstanding per connection (1..=INFLIGHT_PER_STREAM_MAX).
    pub inflight_per_stream: usize,
    /// Shared by all peers: models the GPU server's NIC. `None`: unlimited.
    pub rate_limit_bytes_per_s: Option<u64>,
    /// Bounds the TCP connect and the handshake.
    pub connect_timeout: Duration,
    /// A reply that makes no progress for this long means the peer is lost.
    pub io_timeout: Duration,
    /// `SO_RCVBUF`/`SO_SNDBUF`; `None` leaves Linux's autotuning on, which
    /// grows buffers up to `net.ipv4.tcp_rmem` (larger than `rmem_max` allows
    /// an explicit setting to reach).
    pub socket_buffer_bytes: Option<usize>,
    /// Nice value of the per-stream threads (see [`crate::priority`]); 0
    /// leaves them at the creating process's priority.
    pub thread_nice: i32,
}

impl TcpOptions {
    pub fn new(key: ClusterKey) -> Self {
        TcpOptions {
            key,
            streams_per_peer: 4,
            chunk_bytes: TCP_CHUNK_BYTES_DEFAULT,
            inflight_per_stream: 4,
            rate_limit_bytes_per_s: None,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            socket_buffer_bytes: None,
            thread_nice: 0,
        }
    }

    fn check(&self) -> Result<(), TransportError> {
        let bad = |s: String| Err(TransportError::InvalidOption(s));
        if !(1..=STREAMS_PER_PEER_MAX).contains(&self.streams_per_peer) {
            return bad(format!(
                "streams_per_peer = {} must be in 1..={STREAMS_PER_PEER_MAX}",
                self.streams_per_peer
            ));
        }
        if !(1..=READ_CHUNK_BYTES_MAX).contains(&self.chunk_bytes) {
            return bad(format!(
                "chunk_bytes = {} must be in 1..={READ_CHUNK_BYTES_MAX}",
                self.chunk_bytes
            ));
        }
        if !(1..=INFLIGHT_PER_STREAM_MAX).contains(&self.inflight_per_stream) {
            return bad(format!(
                "inflight_per_stream = {} must be in 1..={INFLIGHT_PER_STREAM_MAX}",
                self.inflight_per_stream
            ));
        }
        if self.rate_limit_bytes_per_s == Some(0) {
            return bad("rate_limit_bytes_per_s = 0: use None for no limit".into());
        }
        if self.io_timeout.is_zero() || self.connect_timeout.is_zero() {
            return bad("timeouts must be positive".into());
        }
        Ok(())
    }
}

/// Where a peer's chunks go: one stream's queue, and its bytes given and
/// not yet finished.
struct StreamQueue {
    tx: Sender<Chunk>,
    bytes: Arc<AtomicU64>,
}

struct Peer {
    link: Arc<Link>,
    streams: Vec<StreamQueue>,
    /// Where the search for the least loaded stream starts (turns with every
    /// chunk, so that ties spread).
    next: AtomicUsize,
    threads: Vec<JoinHandle<()>>,
}

impl Peer {
    /// The stream for the next chunk: the fewest unfinished bytes, ties to
    /// the first from the turning start.
    fn pick_stream(&self) -> &StreamQueue {
        let n = self.streams.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let mut best = (u64::MAX, start);
        for k in (start..n).chain(0..start) {
            let bytes = self.streams[k].bytes.load(Ordering::Acquire);
            if bytes < best.0 {
                best = (bytes, k);
            }
        }
        &self.streams[best.1]
    }

    fn shut(self) {
        self.link.kill("disconnected by this client");
        drop(self.streams);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

pub struct TcpTransport {
    opts: TcpOptions,
    shared: Arc<Shared>,
    regions: Regions,
    peers: RwLock<HashMap<u32, Peer>>,
    next_peer: AtomicU32,
}

impl TcpTransport {
    pub fn new(opts: TcpOptions) -> Result<Self, TransportError> {
        opts.check()?;
        let shared = Arc::new(Shared {
            cq: CompletionQueue::new(),
            bucket: opts.rate_limit_bytes_per_s.map(TokenBucket::new),
        });
        Ok(TcpTransport {
            opts,
            shared,
            regions: Regions::default(),
            peers: RwLock::new(HashMap::new()),
            next_peer: AtomicU32::new(1),
        })
    }

    pub fn options(&self) -> &TcpOptions {
        &self.opts
    }

    /// Bytes read, ops completed and failed, since creation.
    pub fn stats(&self) -> TransportStats {
        self.shared.cq.stats()
    }

    fn open_stream(&self, addr: &str) -> Result<TcpStream, TransportError> {
        let conn_err = |source| TransportError::Connect {
            addr: addr.to_owned(),
            source,
        };
        let mut last = None;
        for sa in addr.to_socket_addrs().map_err(conn_err)? {
            match TcpStream::connect_timeout(&sa, self.opts.connect_timeout) {
                Ok(s) => {
                    let mut s = s;
                    self.tune(&s).map_err(conn_err)?;
                    s.set_read_timeout(Some(self.opts.connect_timeout))
                        .map_err(conn_err)?;
                    s.set_write_timeout(Some(self.opts.connect_timeout))
                        .map_err(conn_err)?;
                    handshake::client_sync(&mut s, &self.opts.key, Role::Data).map_err(
                        |source| TransportError::Handshake {
                            addr: addr.to_owned(),
                            source,
                        },
                    )?;
                    s.set_read_timeout(Some(self.opts.io_timeout))
                        .map_err(conn_err)?;
                    s.set_write_timeout(Some(self.opts.io_timeout))
                        .map_err(conn_err)?;
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        let e = last.unwrap_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "address resolved to nothing")
        });
        Err(conn_err(e))
    }

    fn tune(&self, s: &TcpStream) -> std::io::Result<()> {
        s.set_nodelay(true)?;
        if let Some(bytes) = self.opts.socket_buffer_bytes {
            // The kernel takes a C int; larger asks are capped (it caps them
            // lower still, at net.core.[rw]mem_max).
            let bytes = bytes.min(i32::MAX as usize);
            let sock = socket2::SockRef::from(s);
            sock.set_recv_buffer_size(bytes)?;
            sock.set_send_buffer_size(bytes)?;
        }
        Ok(())
    }

    /// Opens every stream of a peer and starts its threads.
    fn open_peer(&self, id: u32, addr: &str) -> Result<Peer, TransportError> {
        let n = self.opts.streams_per_peer;
        let mut streams = Vec::with_capacity(n);
        for _ in 0..n {
            streams.push(self.open_stream(addr)?);
        }
        let conn_err = |source| TransportError::Connect {
            addr: addr.to_owned(),
            source,
        };
        let mut sockets = Vec::with_capacity(n);
        for s in &streams {
            sockets.push(s.try_clone().map_err(conn_err)?);
        }
        let link = Arc::new(Link {
            addr: addr.to_owned(),
            dead: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            sockets,
        });
        let mut threads = Vec::with_capacity(2 * n);
        let mut queues = Vec::with_capacity(n);
        for (i, s) in streams.into_iter().enumerate() {
            let w = s.try_clone().map_err(conn_err)?;
            let (itx, irx) = crossbeam::channel::bounded(self.opts.inflight_per_stream - 1);
            // Unbounded here: every chunk posted and not finished counts
            // against the transport's `INFLIGHT_CHUNKS_MAX` (`validate`), so
            // a stream's queue never holds more.
            let (tx, q) = crossbeam::channel::unbounded::<Chunk>();
            queues.push(StreamQueue {
                tx,
                bytes: Arc::new(AtomicU64::new(0)),
            });
            let (l, sh) = (link.clone(), self.shared.clone());
            let spawn_err = |source| TransportError::Connect {
                addr: addr.to_owned(),
                source,
            };
            let nice = self.opts.thread_nice;
            threads.push(
                std::thread::Builder::new()
                    .name(format!("{THREAD_PREFIX}-w{id}.{i}"))
                    .spawn(move || {
                        crate::priority::lower_current_thread(nice);
                        writer(&l, &sh, &q, &itx, w)
                    })
                    .map_err(spawn_err)?,
            );
            let (l, sh) = (link.clone(), self.shared.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("{THREAD_PREFIX}-r{id}.{i}"))
                    .spawn(move || {
                        crate::priority::lower_current_thread(nice);
                        reader(&l, &sh, &irx, s)
                    })
                    .map_err(spawn_err)?,
            );
        }
        Ok(Peer {
            link,
            streams: queues,
            next: AtomicUsize::new(0),
            threads,
        })
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn register(&self, buf: Arc<HostBuffer>) -> Result<RegionId, TransportError> {
        Ok(self.regions.register(buf))
    }

    fn deregister(&self, region: RegionId) -> Result<(), TransportError> {
        self.regions.deregister(region)
    }

    fn connect(&self, peer_addr: &str) -> Result<PeerId, TransportError> {
        let find = |peers: &HashMap<u32, Peer>| {
            peers
                .iter()
                .find(|(_, p)| p.link.addr == peer_addr)
                .map(|(id, _)| *id)
        };
        {
            let peers = self.peers.read().unwrap();
            if let Some(id) = find(&peers).filter(|id| !peers[id].link.is_dead()) {
                return Ok(PeerId(id));
            }
        }
        let id = self.next_peer.fetch_add(1, Ordering::Relaxed);
        let fresh = self.open_peer(id, peer_addr)?;
        let mut peers = self.peers.write().unwrap();
        let old = match find(&peers) {
            Some(old) if !peers[&old].link.is_dead() => {
                drop(peers);
                fresh.shut(); // Another caller connected first.
                return Ok(PeerId(old));
            }
            Some(dead) => peers.remove(&dead),
            None => None,
        };
        peers.insert(id, fresh);
        drop(peers);
        if let Some(p) = old {
            p.shut();
        }
        log::info!(
            "transport tcp: connected to memory server {peer_addr} over {} streams",
            self.opts.streams_per_peer
        );
        Ok(PeerId(id))
    }

    fn disconnect(&self, peer: PeerId) {
        let p = self.peers.write().unwrap().remove(&peer.0);
        if let Some(p) = p {
            p.shut();
        }
    }

    unsafe fn post_reads(&self, peer: PeerId, ops: &[ReadOp]) -> Result<(), TransportError> {
        let peers = self.peers.read().unwrap();
        let p = peers
            .get(&peer.0)
            .ok_or(TransportError::UnknownPeer(peer))?;
        if p.link.is_dead() {
            return Err(p.link.lost());
        }
        let mut targets = Vec::with_capacity(ops.len());
        self.regions
            .validate(ops, self.opts.chunk_bytes, &self.shared.cq, &mut targets)?;
        for (op, target) in ops.iter().zip(targets) {
            let chunks = chunk_count(op.len, self.opts.chunk_bytes) as usize;
            let state = Arc::new(OpState {
                wr_id: op.wr_id,
                chunks,
                remaining: AtomicUsize::new(chunks),
                failed: AtomicBool::new(false),
                error: Mutex::new(None),
                target,
            });
            for (off, len) in Chunks::new(op.len, self.opts.chunk_bytes) {
                let stream = p.pick_stream();
                stream.bytes.fetch_add(len, Ordering::AcqRel);
                let c = Chunk {
                    op: state.clone(),
                    remote_offset: op.remote_offset + off,
                    local_offset: op.local_offset + off,
                    len,
                    stream_bytes: stream.bytes.clone(),
                };
                // Its writer thread is gone (it panicked): fail here.
                if let Err(e) = stream.tx.send(c) {
                    self.shared.finish(e.into_inner(), Err(p.link.lost()));
                }
            }
        }
        Ok(())
    }

    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, TransportError> {
        Ok(self.shared.cq.poll(out, max, timeout))
    }

    fn stats(&self) -> TransportStats {
        self.shared.cq.stats()
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        let peers: Vec<Peer> = self
            .peers
            .get_mut()
            .unwrap()
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in peers {
            p.shut();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked() {
        let key = ClusterKey::from_secret(b"k");
        assert!(TcpTransport::new(TcpOptions::new(key.clone())).is_ok());
        for f in [
            (|o: &mut TcpOptions| o.streams_per_peer = 0) as fn(&mut TcpOptions),
            |o| o.chunk_bytes = READ_CHUNK_BYTES_MAX + 1,
            |o| o.chunk_bytes = 0,
            |o| o.inflight_per_stream = 0,
            |o| o.rate_limit_bytes_per_s = Some(0),
            |o| o.io_timeout = Duration::ZERO,
        ] {
            let mut o = TcpOptions::new(key.clone());
            f(&mut o);
            assert!(matches!(
                TcpTransport::new(o),
                Err(TransportError::InvalidOption(_))
            ));
        }
    }

    #[test]
    fn socket_buffers_are_set_when_asked() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let sizes = |s: &TcpStream| {
            let r = socket2::SockRef::from(s);
            (r.recv_buffer_size().unwrap(), r.send_buffer_size().unwrap())
        };
        let autotuned = sizes(&s);
        let mut o = TcpOptions::new(ClusterKey::from_secret(b"k"));
        // Small, so that no rmem_max/wmem_max caps it.
        o.socket_buffer_bytes = Some(24 << 10);
        TcpTransport::new(o).unwrap().tune(&s).unwrap();
        assert!(s.nodelay().unwrap());
        // Linux reports twice what was set (the doubling covers its overhead).
        assert_eq!(sizes(&s), (48 << 10, 48 << 10), "autotuned: {autotuned:?}");
    }

    #[test]
    fn unreachable_peer_is_a_connect_error_naming_it() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        drop(l);
        let t = TcpTransport::new(TcpOptions::new(ClusterKey::from_secret(b"k"))).unwrap();
        let e = t.connect(&addr).unwrap_err();
        assert!(
            matches!(&e, TransportError::Connect { addr: a, .. } if *a == addr),
            "{e}"
        );
        assert!(e.to_string().contains(&addr));
        assert!(matches!(
            t.connect("no-such-host.invalid:1"),
            Err(TransportError::Connect { .. })
        ));
    }
}
