//! End to end over loopback with real processes: a controller, memory
//! servers, `distmind deploy`, and reads back through the tcp transport.

mod support;

use std::sync::Arc;
use std::time::Duration;

use distmind_controller::ControllerClient;
use distmind_models::Package;
use distmind_runtime::{fetch_model, Destination, FetchOptions, Peers};
use distmind_transport::tcp::{TcpOptions, TcpTransport};
use distmind_transport::{HostBuffer, HugePages, Transport};
use support::*;

/// Reads every group of `pkg` back from the cluster and compares the bytes
/// with the package's own packed groups.
fn read_back_and_compare(controller: &str, pkg: &Package) -> distmind_runtime::FetchReport {
    let key = cluster_key();
    let mut c = ControllerClient::connect(controller, &key, Duration::from_secs(5)).unwrap();
    let entry = c.get_model(&pkg.manifest.name).unwrap();
    let buf = Arc::new(HostBuffer::new(entry.total_bytes as usize, HugePages::No).unwrap());
    let t = TcpTransport::new(TcpOptions {
        streams_per_peer: 2,
        ..TcpOptions::new(key)
    })
    .unwrap();
    let region = t.register(buf.clone()).unwrap();
    let mut order = Vec::new();
    let report = fetch_model(
        &t,
        &mut Peers::new(),
        &entry,
        Destination {
            region,
            buf: &buf,
            base: 0,
        },
        FetchOptions::default(),
        &mut |g| order.push(g),
    )
    .unwrap_or_else(|e| panic!("fetching {}: {e}", pkg.manifest.name));
    assert_eq!(
        order.len(),
        entry.groups.len(),
        "every group became visible once"
    );
    t.deregister(region).unwrap();
    // Dropping the transport joins its stream threads, which may still hold
    // their handle of the buffer for a moment after the last completion.
    drop(t);
    let mut buf = Arc::into_inner(buf).expect("transport released the buffer");
    let mut at = 0usize;
    for g in 0..pkg.manifest.groups.len() {
        let want = pkg.group_bytes(g).unwrap();
        let got = read_range(&mut buf, at, want.len());
        assert!(
            got == want,
            "{} group {g}: bytes differ from the package",
            pkg.manifest.name
        );
        at += want.len();
    }
    assert_eq!(at as u64, entry.total_bytes);
    report
}

fn read_range(buf: &mut HostBuffer, at: usize, len: usize) -> Vec<u8> {
    // The buffer is owned here and no transport holds it any more.
    buf.as_mut_slice()[at..at + len].to_vec()
}

#[test]
fn deploy_two_tiny_models_with_each_strategy_and_read_them_back() {
    let tmp = tempfile::tempdir().unwrap();
    // Small groups so that every strategy really spreads a model over servers.
    let mut pkgs = gen_tiny(tmp.path(), "resnet152", 1, 16 << 10);
    pkgs.extend(gen_tiny(tmp.path(), "bert_base", 1, 16 << 10));
    let packages: Vec<Package> = pkgs.iter().map(|p| Package::open(p).unwrap()).collect();
    for p in &packages {
        assert!(
            p.manifest.groups.len() >= 3,
            "{} has {} groups",
            p.manifest.name,
            p.manifest.groups.len()
        );
    }

    let controller = spawn_controller();
    let ms: Vec<Proc> = (0..3)
        .map(|_| spawn_memserver(&controller.addr, "64MiB"))
        .collect();
    wait_alive(&controller.addr, 3);
    let mut client =
        ControllerClient::connect(&controller.addr, &cluster_key(), Duration::from_secs(5))
            .unwrap();

    for strategy in ["hybrid", "per-app", "horizontal", "vertical"] {
        let (ok, stdout, stderr) = deploy(
            &controller.addr,
            &["--strategy", strategy, "--shard-width", "3"],
            &pkgs,
        );
        assert!(ok, "deploy --strategy {strategy} failed: {stderr}");
        assert_eq!(
            stdout
                .lines()
                .filter(|l| l.starts_with("deployed "))
                .count(),
            2,
            "{stdout}"
        );
        for pkg in &packages {
            let entry = client.get_model(&pkg.manifest.name).unwrap();
            assert_eq!(entry.strategy, strategy);
            let servers: std::collections::BTreeSet<u32> = entry
                .groups
                .iter()
                .flat_map(|g| g.slices.iter().map(|s| s.replicas[0].memserver))
                .collect();
            match strategy {
                "per-app" => assert_eq!(servers.len(), 1, "per-app keeps a model on one server"),
                _ => assert_eq!(
                    servers.len(),
                    3,
                    "{strategy} spreads {} over 3 servers",
                    pkg.manifest.name
                ),
            }
            read_back_and_compare(&controller.addr, pkg);
        }
        if strategy == "per-app" {
            // Deploy plans on the servers' current free space, so the second
            // model goes to another server than the first.
            let mut home = |name: &str| {
                client.get_model(name).unwrap().groups[0].slices[0].replicas[0].memserver
            };
            assert_ne!(
                home(&packages[0].manifest.name),
                home(&packages[1].manifest.name)
            );
        }
    }

    // Re-deploying replaces: the memory servers' used bytes do not grow.
    let used = || ms.iter().map(|m| used_bytes(&m.addr)).sum::<u64>();
    let before = used();
    let (ok, _, stderr) = deploy(&controller.addr, &[], &pkgs[..1]);
    assert!(ok, "{stderr}");
    assert_eq!(before, used(), "re-deploy must free the replaced extents");
}

#[test]
fn a_replica_serves_when_a_memory_server_dies() {
    let tmp = tempfile::tempdir().unwrap();
    let pkgs = gen_tiny(tmp.path(), "gpt2", 1, 64 << 10);
    let pkg = Package::open(&pkgs[0]).unwrap();
    let controller = spawn_controller();
    let mut ms: Vec<Proc> = (0..2)
        .map(|_| spawn_memserver(&controller.addr, "32MiB"))
        .collect();
    wait_alive(&controller.addr, 2);
    let (ok, _, stderr) = deploy(&controller.addr, &["--replication", "2"], &pkgs);
    assert!(ok, "{stderr}");
    ms[0].kill();
    let report = read_back_and_compare(&controller.addr, &pkg);
    assert!(
        report.retries > 0,
        "reads that hit the dead server were retried on the replica"
    );
}

#[test]
fn trained_weights_are_written_back_to_the_memory_servers() {
    let tmp = tempfile::tempdir().unwrap();
    let pkgs = gen_tiny(tmp.path(), "resnet152", 1, 64 << 10);
    let pkg = Package::open(&pkgs[0]).unwrap();
    let controller = spawn_controller();
    let ms: Vec<Proc> = (0..2)
        .map(|_| spawn_memserver(&controller.addr, "32MiB"))
        .collect();
    wait_alive(&controller.addr, 2);
    let (ok, _, stderr) = deploy(&controller.addr, &[], &pkgs);
    assert!(ok, "{stderr}");
    let used_before: u64 = ms.iter().map(|m| used_bytes(&m.addr)).sum();

    let settings = settings_dir();
    let (ok, stdout, stderr) = run(&[
        "train",
        "--model",
        pkgs[0].to_str().unwrap(),
        "--steps",
        "2",
        "--batch",
        "4",
        "--writeback",
        "--settings",
        settings.to_str().unwrap(),
        "--controller",
        &controller.addr,
    ]);
    assert!(ok, "train failed: {stderr}");
    assert!(
        stdout.contains("step 1: loss") && stdout.contains("written back"),
        "{stdout}"
    );

    // The catalog now serves the trained weights: every group with
    // parameters differs from the package, and the old version's extents
    // were freed (one version stored, not two).
    let key = cluster_key();
    let mut c = ControllerClient::connect(&controller.addr, &key, Duration::from_secs(5)).unwrap();
    let entry = c.get_model(&pkg.manifest.name).unwrap();
    let buf = Arc::new(HostBuffer::new(entry.total_bytes as usize, HugePages::No).unwrap());
    let t = TcpTransport::new(TcpOptions::new(key)).unwrap();
    let region = t.register(buf.clone()).unwrap();
    fetch_model(
        &t,
        &mut Peers::new(),
        &entry,
        Destination {
            region,
            buf: &buf,
            base: 0,
        },
        FetchOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    t.deregister(region).unwrap();
    drop(t);
    let mut buf = Arc::into_inner(buf).unwrap();
    let trained = buf.as_mut_slice();
    for g in &pkg.manifest.groups {
        let range = g.offset as usize..(g.offset + g.bytes) as usize;
        assert_ne!(
            trained[range].to_vec(),
            pkg.group_bytes(g.index).unwrap(),
            "group {} was not updated",
            g.index
        );
    }
    assert_eq!(
        ms.iter().map(|m| used_bytes(&m.addr)).sum::<u64>(),
        used_before
    );
}
