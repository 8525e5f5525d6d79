//! A real memory server on 127.0.0.1:0 in its own runtime thread, and raw
//! protocol helpers for the tests.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use distmind_common::checksum::checksum;
use distmind_common::handshake::{self, ClusterKey};
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{MemserverReply, MemserverRequest};
use distmind_common::wire::{self, ReadReply, ReadRequest, ReadStatus, Role, READ_REPLY_BYTES};
use distmind_memserver::{Memserver, MemserverClient, MemserverConfig, StatsHandle};

pub const TIMEOUT: Duration = Duration::from_secs(20);

pub fn key() -> ClusterKey {
    ClusterKey::from_secret(b"memserver-test-cluster-key")
}

pub struct TestServer {
    pub addr: SocketAddr,
    /// The metrics endpoint, when the config asked for one.
    pub metrics: Option<SocketAddr>,
    pub stats: StatsHandle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

pub fn start(capacity_bytes: u64) -> TestServer {
    start_with(capacity_bytes, |_| {})
}

pub fn start_with(capacity_bytes: u64, tweak: impl FnOnce(&mut MemserverConfig)) -> TestServer {
    let mut config = MemserverConfig::new("127.0.0.1:0".parse().unwrap(), capacity_bytes, key());
    config.huge_pages = false;
    tweak(&mut config);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let server = Memserver::bind(config).await.expect("bind");
            ready_tx
                .send((
                    server.local_addr(),
                    server.metrics_addr(),
                    server.stats_handle(),
                ))
                .unwrap();
            server
                .serve(async {
                    let _ = stop_rx.await;
                })
                .await
                .unwrap();
        });
    });
    let (addr, metrics, stats) = ready_rx.recv().expect("server started");
    TestServer {
        addr,
        metrics,
        stats,
        stop: Some(stop_tx),
        thread: Some(thread),
    }
}

impl TestServer {
    /// Triggers shutdown and waits for `serve` to return.
    pub fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join().expect("server thread");
        }
    }

    pub fn client(&self) -> MemserverClient {
        MemserverClient::connect(&self.addr.to_string(), &key(), TIMEOUT).expect("connect")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A raw connection after a successful handshake for `role`.
pub fn raw(addr: SocketAddr, role: Role) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    handshake::client_sync(&mut s, &key(), role).expect("handshake");
    s
}

/// Sends one read request and returns its reply and bytes.
pub fn read(s: &mut TcpStream, wr_id: u64, offset: u64, len: u64) -> (ReadReply, Vec<u8>) {
    s.write_all(&ReadRequest { wr_id, offset, len }.encode())
        .unwrap();
    read_reply(s)
}

pub fn read_reply(s: &mut TcpStream) -> (ReadReply, Vec<u8>) {
    let mut h = [0u8; READ_REPLY_BYTES];
    s.read_exact(&mut h).unwrap();
    let reply = ReadReply::decode(&h, u64::MAX).unwrap();
    let mut data = vec![
        0u8;
        if reply.status == ReadStatus::Ok {
            reply.len as usize
        } else {
            0
        }
    ];
    s.read_exact(&mut data).unwrap();
    (reply, data)
}

/// Allocates, writes and commits `bytes`; returns the offset.
pub fn deploy(c: &mut MemserverClient, bytes: &[u8], owner: &str) -> u64 {
    let off = c.alloc(bytes.len() as u64, owner).unwrap();
    c.write(off, bytes).unwrap();
    c.commit(off, checksum(bytes)).unwrap();
    off
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

/// Proof that the server still serves a new client end to end.
pub fn assert_still_serving(server: &TestServer) {
    let mut c = server.client();
    let data = pattern(3000, 77);
    let off = deploy(&mut c, &data, "liveness");
    let mut d = raw(server.addr, Role::Data);
    let (r, got) = read(&mut d, 1, off, data.len() as u64);
    assert_eq!(r.status, ReadStatus::Ok);
    assert_eq!(got, data);
    c.free(off, "liveness").unwrap();
}

/// Sends a raw control request and returns the reply.
pub fn control_request(s: &mut TcpStream, req: &MemserverRequest) -> MemserverReply {
    wire::send_message_sync(s, req).unwrap();
    wire::recv_message_sync(s, CONTROL_FRAME_BYTES_MAX).unwrap()
}

/// Polls `cond` until it holds (the server reacts asynchronously).
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}
