//! What the runtime's integration tests share: tiny variants of a model,
//! and deploying a package by hand.

use std::time::Duration;

use distmind_common::checksum::{checksum, to_hex};
use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{GroupLocation, Location, ModelEntry, Slice};
use distmind_controller::ControllerClient;
use distmind_memserver::MemserverClient;
use distmind_models::{generate, Family, GenOptions, Package, Scale};

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
