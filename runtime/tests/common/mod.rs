//! What the runtime's integration tests share: tiny variants of a model,
//! a controller and a memory server in the test's process, and deploying a
//! package by hand.

use std::future::Future;
use std::time::{Duration, Instant};

use distmind_common::checksum::{checksum, to_hex};
use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{GroupLocation, Location, ModelEntry, Slice};
use distmind_controller::{Controller, ControllerClient, ControllerConfig};
use distmind_memserver::{Memserver, MemserverClient, MemserverConfig};
use distmind_models::{generate, Family, GenOptions, Package, Scale};
use tokio::sync::watch;

/// `n` tiny variants of `family` in `dir`: the same size, different
/// weights and names.
#[allow(dead_code)] // Not every test crate uses it.
pub fn tiny_variants(
    dir: &std::path::Path,
    family: Family,
    n: usize,
    group_bytes: u64,
) -> Vec<Package> {
    let opts = GenOptions {
        scale: Scale::Tiny,
        group_bytes,
        variants: n,
        ..GenOptions::new(family, dir)
    };
    generate(&opts)
        .expect("generate")
        .iter()
        .map(|p| Package::open(p).expect("open"))
        .collect()
}

/// A controller and one memory server (64 MiB) in this process, on
/// 127.0.0.1 ephemeral ports, served on a tokio runtime of two workers
/// until `stop` is sent; what a test adds on `rt` with
/// [`ControlPlane::shutdown`] stops with them.
#[allow(dead_code)] // Not every test crate uses it.
pub struct ControlPlane {
    pub stop: watch::Sender<bool>,
    pub controller: String,
    pub memserver: String,
    /// Last: dropped after `stop` told the servers to finish.
    pub rt: tokio::runtime::Runtime,
}

#[allow(dead_code)]
impl ControlPlane {
    /// Starts both and waits (up to `timeout`) until the memory server has
    /// registered with the controller.
    pub fn start(key: &ClusterKey, timeout: Duration) -> ControlPlane {
        ControlPlane::start_with(key, timeout, |_| {})
    }

    /// As [`ControlPlane::start`], with the controller's configuration as
    /// `tweak` leaves it.
    pub fn start_with(
        key: &ClusterKey,
        timeout: Duration,
        tweak: impl FnOnce(&mut ControllerConfig),
    ) -> ControlPlane {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (stop, _) = watch::channel(false);
        let (c_stop, m_stop) = (stopped(&stop), stopped(&stop));
        let (controller, memserver) = rt.block_on(async {
            let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), key.clone());
            tweak(&mut cfg);
            let c = Controller::bind(cfg).await.unwrap();
            let controller = c.local_addr().to_string();
            tokio::spawn(c.serve(c_stop));
            let mut cfg =
                MemserverConfig::new("127.0.0.1:0".parse().unwrap(), 64 << 20, key.clone());
            cfg.controller = Some(controller.clone());
            cfg.huge_pages = false;
            let m = Memserver::bind(cfg).await.unwrap();
            let memserver = m.local_addr().to_string();
            tokio::spawn(m.serve(m_stop));
            (controller, memserver)
        });
        let plane = ControlPlane {
            stop,
            controller,
            memserver,
            rt,
        };
        let mut cc = plane.controller_client(key, timeout);
        let deadline = Instant::now() + timeout;
        while !cc.list_memservers().unwrap().iter().any(|m| m.alive) {
            assert!(
                Instant::now() < deadline,
                "the memory server never registered"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        plane
    }

    /// A future that ends once `stop` is sent: a server's shutdown signal.
    pub fn shutdown(&self) -> impl Future<Output = ()> + Send + 'static {
        stopped(&self.stop)
    }

    pub fn controller_client(&self, key: &ClusterKey, timeout: Duration) -> ControllerClient {
        ControllerClient::connect(&self.controller, key, timeout).unwrap()
    }
}

/// Ends once `stop` sends true (or is dropped).
fn stopped(stop: &watch::Sender<bool>) -> impl Future<Output = ()> + Send + 'static {
    let mut rx = stop.subscribe();
    async move {
        let _ = rx.wait_for(|s| *s).await;
    }
}

/// Writes every group of `pkg` as one slice on `memserver` and registers it.
pub fn deploy(
    controller: &mut ControllerClient,
    memserver: &str,
    pkg: &Package,
    key: &ClusterKey,
    timeout: Duration,
) {
    let m = &pkg.manifest;
    let mut ms = MemserverClient::connect(memserver, key, timeout).unwrap();
    let id = controller
        .list_memservers()
        .unwrap()
        .iter()
        .find(|s| s.addr == memserver)
        .expect("registered")
        .id;
    let groups = (0..m.groups.len())
        .map(|g| {
            let bytes = pkg.group_bytes(g).unwrap();
            let offset = ms.alloc(bytes.len() as u64, &m.name).unwrap();
            ms.write(offset, &bytes).unwrap();
            ms.commit(offset, checksum(&bytes)).unwrap();
            GroupLocation {
                index: g as u32,
                bytes: bytes.len() as u64,
                checksum: to_hex(checksum(&bytes)),
                slices: vec![Slice {
                    group_offset: 0,
                    len: bytes.len() as u64,
                    checksum: to_hex(checksum(&bytes)),
                    replicas: vec![Location {
                        memserver: id,
                        addr: memserver.to_string(),
                        offset,
                    }],
                }],
            }
        })
        .collect();
    controller
        .put_model(ModelEntry {
            name: m.name.clone(),
            family: m.family.to_string(),
            total_bytes: m.stored_bytes,
            strategy: "test".into(),
            replication: 1,
            version: 0,
            groups,
            manifest: serde_json::to_value(m).unwrap(),
        })
        .unwrap();
}
