//! The libfabric data path end to end with real processes on loopback
//! (feature `fabric`, provider `tcp;ofi_rxm`): memory servers that serve
//! their arena over libfabric, `distmind deploy`, and GPU-server reads with
//! `fi_read`, in a `distmind runtime` process and in this one.
//!
//! Proof that the bytes came over libfabric: the memory servers' tcp data
//! path (`bytes_served`) stays at zero while everything is read.
#![cfg(feature = "fabric")]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::checksum::checksum;
use distmind_controller::ControllerClient;
use distmind_models::Package;
use distmind_runtime::client::RuntimeClient;
use distmind_runtime::transports::{open_transport, TransportChoice};
use distmind_runtime::{fetch_model, Destination, FetchError, FetchOptions, Peers};
use distmind_transport::tcp::TcpOptions;
use distmind_transport::{HostBuffer, HugePages, Transport};
use rand::{RngCore, SeedableRng};
use support::*;

const PROVIDER: &str = "tcp;ofi_rxm";
const GROUP: usize = 32 << 20;
const FAMILIES: [&str; 5] = [
    "resnet152",
    "inception_v3",
    "densenet201",
    "bert_base",
    "gpt2",
];

fn spawn_fabric_memserver(controller: &str, capacity: &str) -> Proc {
    spawn_memserver_with(
        controller,
        capacity,
        &["--fabric-provider", PROVIDER, "--no-huge-pages"],
    )
}

/// Bytes a memory server sent over its tcp data path.
fn tcp_bytes_served(memserver: &str) -> u64 {
    let mut c = distmind_memserver::MemserverClient::connect(
        memserver,
        &cluster_key(),
        Duration::from_secs(5),
    )
    .unwrap();
    c.stats().unwrap().bytes_served
}

/// A model of `bytes` random bytes in 32 MiB groups, deployed with `replication`.
fn deploy_synthetic(
    controller: &str,
    name: &str,
    bytes: usize,
    replication: usize,
    seed: u64,
) -> Vec<Vec<u8>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let groups: Vec<Vec<u8>> = (0..bytes.div_ceil(GROUP))
        .map(|g| {
            let mut v = vec![0u8; GROUP.min(bytes - g * GROUP)];
            rng.fill_bytes(&mut v);
            v
        })
        .collect();
    let model = distmind::deploy::Model {
        name,
        family: "synthetic",
        manifest: serde_json::json!({ "name": name, "family": "synthetic", "bytes": bytes }),
        groups: groups.clone(),
    };
    let target = distmind::deploy::Target {
        controller: controller.to_string(),
        key: cluster_key(),
    };
    let opts = distmind::deploy::Options {
        replication,
        progress: false,
        ..Default::default()
    };
    distmind::deploy::deploy(&target, &model, &opts).expect("deploy synthetic model");
    groups
}

/// A GPU server's reader in this process: fabric only, no tcp fallback.
fn fabric_transport() -> Arc<dyn Transport> {
    let choice = TransportChoice {
        fallback_to_tcp: false,
        ..TransportChoice::fabric(PROVIDER)
    };
    let t = open_transport(&choice, TcpOptions::new(cluster_key())).expect("fabric transport");
    assert_eq!(t.name(), "fabric");
    t
}

/// Fetches `name` (slices checksummed as they land) into a fresh buffer and
/// returns the buffer.
fn fetch(
    t: &Arc<dyn Transport>,
    controller: &str,
    name: &str,
) -> Result<(HostBuffer, distmind_runtime::FetchReport), FetchError> {
    let mut c =
        ControllerClient::connect(controller, &cluster_key(), Duration::from_secs(5)).unwrap();
    let entry = c.get_model(name).unwrap();
    let buf = Arc::new(HostBuffer::new(entry.total_bytes as usize, HugePages::No).unwrap());
    let region = t.register(buf.clone()).unwrap();
    let report = fetch_model(
        &**t,
        &mut Peers::new(),
        &entry,
        Destination {
            region,
            buf: &buf,
            base: 0,
        },
        FetchOptions::default(),
        &mut |_| {},
    );
    t.deregister(region).unwrap();
    let report = report?;
    // Every read completed (fetch_model returns only then) and the region
    // is deregistered: the transport let go of the buffer.
    let buf = Arc::into_inner(buf).expect("the transport released the buffer");
    Ok((buf, report))
}

#[test]
fn every_family_and_a_1_gib_model_are_read_with_fi_read_by_concurrent_readers() {
    let tmp = tempfile::tempdir().unwrap();
    let controller = spawn_controller();
    let ms: Vec<Proc> = (0..2)
        .map(|_| spawn_fabric_memserver(&controller.addr, "700MiB"))
        .collect();
    wait_alive(&controller.addr, 2);
    // Each memory server offers its arena over the provider asked for.
    for m in &ms {
        let mut c = distmind_memserver::MemserverClient::connect(
            &m.addr,
            &cluster_key(),
            Duration::from_secs(5),
        )
        .unwrap();
        let offer = c.data_paths().unwrap().fabric.expect("a fabric offer");
        assert_eq!(offer.provider, PROVIDER);
        assert!(offer.len >= 700 << 20, "{offer:?}");
    }
    let mut pkgs = Vec::new();
    for f in FAMILIES {
        pkgs.extend(gen_tiny(tmp.path(), f, 1, 256 << 10));
    }
    let (ok, _, stderr) = deploy(&controller.addr, &[], &pkgs);
    assert!(ok, "{stderr}");
    let big = deploy_synthetic(&controller.addr, "synthetic-1gib", 1 << 30, 1, 7);
    let big_sum = {
        let mut h = distmind_common::checksum::Checksummer::new();
        big.iter().for_each(|g| h.update(g));
        h.finish()
    };
    drop(big);

    // A GPU server process reading over fabric only: every tiny family runs
    // (its cache-in checksums every slice).
    let rt = spawn_runtime(
        &controller.addr,
        &[
            "--transport",
            "fabric",
            "--fabric-provider",
            PROVIDER,
            "--no-tcp-fallback",
        ],
    );
    wait_runtime_alive(&controller.addr, &rt.addr);
    let mut client =
        RuntimeClient::connect(&rt.addr, &cluster_key(), Duration::from_secs(120)).unwrap();
    for p in &pkgs {
        let pkg = Package::open(p).unwrap();
        let (outputs, _) = client
            .infer(&pkg.manifest.name, &input_for(&pkg))
            .unwrap_or_else(|e| panic!("{}: {e}", pkg.manifest.name));
        assert!(!outputs.is_empty());
    }

    // This process: every tiny package read back byte for byte.
    let t = fabric_transport();
    for p in &pkgs {
        let pkg = Package::open(p).unwrap();
        let (mut buf, _) = fetch(&t, &controller.addr, &pkg.manifest.name).unwrap();
        let bytes = buf.as_mut_slice();
        let mut at = 0;
        for g in 0..pkg.manifest.groups.len() {
            let want = pkg.group_bytes(g).unwrap();
            assert!(
                bytes[at..at + want.len()] == want[..],
                "{} group {g}",
                pkg.manifest.name
            );
            at += want.len();
        }
        assert_eq!(at, bytes.len());
    }
    let started = Instant::now();
    let (mut buf, report) = fetch(&t, &controller.addr, "synthetic-1gib").unwrap();
    println!(
        "one 1 GiB read over {PROVIDER}: {:?} with allocation, the fetch {:.2} GB/s",
        started.elapsed(),
        report.gbps()
    );
    assert_eq!(checksum(buf.as_mut_slice()), big_sum);
    drop((t, buf));

    // The 1 GiB model (not a servable family, so read by the runtime's fetch
    // code in this process): three readers at once, each its own transport.
    let started = Instant::now();
    let sums: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    let t = fabric_transport();
                    let (mut buf, report) = fetch(&t, &controller.addr, "synthetic-1gib").unwrap();
                    assert_eq!(report.retries, 0);
                    checksum(buf.as_mut_slice())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    println!(
        "3 concurrent 1 GiB reads over {PROVIDER}: {:?}",
        started.elapsed()
    );
    assert!(
        sums.iter().all(|&s| s == big_sum),
        "every reader got the deployed bytes"
    );

    for m in &ms {
        assert_eq!(
            tcp_bytes_served(&m.addr),
            0,
            "nothing was read over tcp from {}",
            m.addr
        );
    }
    drop(rt);
}

#[test]
fn a_memory_server_killed_mid_transfer_gives_an_error_or_a_replica_never_wrong_bytes() {
    let controller = spawn_controller();
    let mut ms: Vec<Proc> = (0..2)
        .map(|_| spawn_fabric_memserver(&controller.addr, "1000MiB"))
        .collect();
    wait_alive(&controller.addr, 2);
    let replicated = deploy_synthetic(&controller.addr, "replicated", 512 << 20, 2, 1);
    let single = deploy_synthetic(&controller.addr, "single", 256 << 20, 1, 2);
    let want_replicated = replicated.concat();
    let want_single = single.concat();
    drop((replicated, single));

    let t = fabric_transport();
    let victim = ms[0].addr.clone();
    let (result, killed_after) = std::thread::scope(|s| {
        let reader = s.spawn(|| fetch(&t, &controller.addr, "replicated"));
        // Kill the server once bytes are flowing.
        let deadline = Instant::now() + Duration::from_secs(60);
        while t.stats().bytes_read < (16 << 20) && !reader.is_finished() {
            assert!(Instant::now() < deadline, "no bytes flowed");
            std::thread::sleep(Duration::from_micros(200));
        }
        let at = t.stats().bytes_read;
        ms[0].kill();
        (reader.join().unwrap(), at)
    });
    println!("killed {victim} after {killed_after} bytes");
    match result {
        Ok((mut buf, report)) => {
            assert!(
                buf.as_mut_slice() == &want_replicated[..],
                "a completed fetch has exactly the deployed bytes"
            );
            println!("finished from the replica ({} retries)", report.retries);
        }
        Err(e) => println!("failed cleanly: {e}"),
    }
    // Reading again: the replica serves everything.
    let (mut buf, _) = fetch(&t, &controller.addr, "replicated").expect("the replica serves");
    assert!(buf.as_mut_slice() == &want_replicated[..]);
    // A model without a replica on the live server: an error naming the failure, in bounded time.
    let started = Instant::now();
    match fetch(&t, &controller.addr, "single") {
        Ok((mut buf, _)) => panic!(
            "half of `single` lived on the killed server, yet the fetch succeeded (bytes equal: {})",
            buf.as_mut_slice() == &want_single[..]
        ),
        Err(e) => {
            let msg = e.to_string();
            println!("unreplicated model: {msg} (after {:?})", started.elapsed());
            assert!(msg.contains("every replica failed"), "{msg}");
        }
    }
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// The data paths come from `settings/transport.json` when no flag names
/// them: the memory server serves libfabric, the GPU server reads with it.
#[test]
fn transport_json_selects_the_data_path_without_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let settings = tmp.path().join("settings");
    std::fs::create_dir(&settings).unwrap();
    for f in std::fs::read_dir(settings_dir()).unwrap() {
        let f = f.unwrap();
        if f.file_type().unwrap().is_file() {
            std::fs::copy(f.path(), settings.join(f.file_name())).unwrap();
        }
    }
    std::fs::write(
        settings.join("transport.json"),
        format!(
            r#"{{
  "memserver": {{ "fabric_provider": "{PROVIDER}" }},
  "gpu_server": {{ "transport": "fabric", "fabric_provider": "{PROVIDER}", "fallback_to_tcp": false }}
}}"#
        ),
    )
    .unwrap();
    let s = settings.to_str().unwrap();
    let controller = spawn_controller();
    let ms = spawn_service(&[
        "memserver",
        "--settings",
        s,
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        "64MiB",
        "--controller",
        &controller.addr,
        "--no-huge-pages",
    ]);
    wait_alive(&controller.addr, 1);
    let pkgs = gen_tiny(tmp.path(), "gpt2", 1, 256 << 10);
    let (ok, _, stderr) = deploy(&controller.addr, &[], &pkgs);
    assert!(ok, "{stderr}");
    let rt = spawn_service(&[
        "runtime",
        "--settings",
        s,
        "--listen",
        "127.0.0.1:0",
        "--controller",
        &controller.addr,
        "--executor",
        "cpu",
    ]);
    wait_runtime_alive(&controller.addr, &rt.addr);
    let pkg = Package::open(&pkgs[0]).unwrap();
    let mut client =
        RuntimeClient::connect(&rt.addr, &cluster_key(), Duration::from_secs(60)).unwrap();
    client
        .infer(&pkg.manifest.name, &input_for(&pkg))
        .expect("inference over the settings' data path");
    assert_eq!(
        tcp_bytes_served(&ms.addr),
        0,
        "read over libfabric, not tcp"
    );
}
