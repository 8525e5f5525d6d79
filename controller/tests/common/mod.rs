//! A real controller on 127.0.0.1:0 in a background runtime, and helpers.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use distmind_common::handshake::{self, ClusterKey};
use distmind_common::proto::{GroupLocation, Location, MemserverInfo, ModelEntry, Slice};
use distmind_common::wire::Role;
use distmind_controller::{Controller, ControllerClient, ControllerConfig, ControllerError};

pub const TIMEOUT: Duration = Duration::from_secs(10);

pub fn key() -> ClusterKey {
    ClusterKey::from_secret(b"integration-test-cluster-key")
}

pub struct TestServer {
    pub addr: SocketAddr,
    /// The dispatcher's client port, when the config runs it.
    pub client_addr: Option<SocketAddr>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), ControllerError>>>,
}

impl TestServer {
    pub fn start(configure: impl FnOnce(&mut ControllerConfig) + Send + 'static) -> TestServer {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut config = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), key());
                configure(&mut config);
                let controller = Controller::bind(config).await?;
                addr_tx
                    .send((controller.local_addr(), controller.client_addr()))
                    .unwrap();
                controller
                    .serve(async {
                        let _ = stop_rx.await;
                    })
                    .await
            })
        });
        let (addr, client_addr) = addr_rx
            .recv_timeout(TIMEOUT)
            .expect("controller did not start");
        TestServer {
            addr,
            client_addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn client(&self) -> ControllerClient {
        ControllerClient::connect(&self.addr.to_string(), &key(), TIMEOUT).expect("connect")
    }

    /// A control connection that passed the handshake, for sending raw bytes.
    pub fn raw(&self) -> TcpStream {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        handshake::client_sync(&mut s, &key(), Role::Control).unwrap();
        s
    }

    /// Stops the server and returns what `serve` returned.
    pub fn stop(mut self) -> Result<(), ControllerError> {
        self.stop_inner().unwrap()
    }

    fn stop_inner(&mut self) -> Option<Result<(), ControllerError>> {
        let _ = self.stop.take()?.send(());
        Some(self.thread.take()?.join().expect("server thread panicked"))
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// Polls `f` until it returns true; panics after a generous deadline.
pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A model of `groups` groups of 2048 bytes, each in two slices: the first
/// on `servers[0]`, the second on `servers[1]`, replicated on the other.
pub fn model(name: &str, groups: u32, servers: &[MemserverInfo]) -> ModelEntry {
    let loc = |s: &MemserverInfo, offset| Location {
        memserver: s.id,
        addr: s.addr.clone(),
        offset,
    };
    let sum = "00112233445566ff".to_string();
    ModelEntry {
        name: name.into(),
        family: "bert_base".into(),
        total_bytes: 2048 * groups as u64,
        strategy: "hybrid".into(),
        replication: 2,
        version: 0,
        groups: (0..groups)
            .map(|index| GroupLocation {
                index,
                bytes: 2048,
                checksum: sum.clone(),
                slices: (0..2usize)
                    .map(|j| Slice {
                        group_offset: 1024 * j as u64,
                        len: 1024,
                        checksum: sum.clone(),
                        replicas: vec![
                            loc(&servers[j], 4096 * index as u64),
                            loc(&servers[1 - j], 4096 * index as u64 + 1024),
                        ],
                    })
                    .collect(),
            })
            .collect(),
        manifest: serde_json::json!({"family": "bert_base", "layers": [{"op": "linear"}]}),
    }
}
