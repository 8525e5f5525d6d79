//! Half-precision packages move half the bytes: `distmind deploy` writes a
//! bf16 package's stored bytes unchanged, the memory servers hold them, and a
//! GPU server's cold start reads exactly those bytes (the memory servers'
//! `bytes_served`), about half of what the same model stored as f32 costs.
//! Widening to f32 happens on the device, after the fetch.

use std::path::Path;
use std::time::Duration;

use distmind_models::{generate_named, Family, GenOptions, Package, ParamDtype, Scale};
use distmind_runtime::client::RuntimeClient;

mod support;
use support::*;

/// Several groups, so the fetch is the real multi-slice one.
const GROUP_BYTES: u64 = 64 << 10;

fn gen(dir: &Path, name: &str, dtype: ParamDtype) -> Package {
    let opts = GenOptions {
        scale: Scale::Tiny,
        seed: 3,
        group_bytes: GROUP_BYTES,
        dtype,
        ..GenOptions::new(Family::Resnet152, dir)
    };
    Package::open(generate_named(&opts, name).unwrap()).unwrap()
}

fn memserver_stats(ms: &[Proc]) -> (u64, u64) {
    ms.iter()
        .map(|m| {
            let mut c = distmind_memserver::MemserverClient::connect(
                &m.addr,
                &cluster_key(),
                Duration::from_secs(5),
            )
            .unwrap();
            let s = c.stats().unwrap();
            (s.used_bytes, s.bytes_served)
        })
        .fold((0, 0), |(u, b), (du, db)| (u + du, b + db))
}

#[test]
fn bf16_packages_are_stored_and_served_at_half_the_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let packages = [
        gen(tmp.path(), "r152-f32", ParamDtype::F32),
        gen(tmp.path(), "r152-bf16", ParamDtype::BF16),
    ];
    let controller = spawn_controller();
    let ms: Vec<Proc> = (0..2)
        .map(|_| spawn_memserver(&controller.addr, "32MiB"))
        .collect();
    wait_alive(&controller.addr, 2);
    let s = settings_dir();
    let rt = spawn_service(&[
        "runtime",
        "--settings",
        s.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--controller",
        &controller.addr,
        "--executor",
        "sim",
        "--devices",
        "0",
        "--cache",
        "64MiB",
    ]);
    wait_runtime_alive(&controller.addr, &rt.addr);
    let mut catalog = distmind_controller::ControllerClient::connect(
        &controller.addr,
        &cluster_key(),
        Duration::from_secs(5),
    )
    .unwrap();
    let mut client =
        RuntimeClient::connect(&rt.addr, &cluster_key(), Duration::from_secs(60)).unwrap();

    // Per package: (stored bytes, bytes the memory servers hold, bytes they served).
    let mut moved = Vec::new();
    for pkg in &packages {
        let m = &pkg.manifest;
        let (used_before, served_before) = memserver_stats(&ms);
        let (ok, _, stderr) = deploy(&controller.addr, &[], std::slice::from_ref(&pkg.dir));
        assert!(ok, "{}: deploy: {stderr}", m.name);
        let entry = catalog.get_model(&m.name).unwrap();
        assert_eq!(entry.total_bytes, m.stored_bytes, "{}", m.name);
        for (g, want) in entry.groups.iter().zip(&m.groups) {
            assert_eq!(
                (g.bytes, &g.checksum),
                (want.bytes, &want.checksum),
                "{} group {}: deploy must carry the stored bytes unchanged",
                m.name,
                want.index
            );
        }
        let (used, _) = memserver_stats(&ms);
        let held = used - used_before;
        assert!(
            held >= m.stored_bytes * u64::from(entry.replication),
            "{}: memory servers hold {held} bytes for {} stored x{}",
            m.name,
            m.stored_bytes,
            entry.replication
        );
        // A cold start: every group fetched once from the memory servers.
        client.infer(&m.name, &input_for(pkg)).unwrap();
        let (_, served) = memserver_stats(&ms);
        moved.push((m.stored_bytes, held, served - served_before));
    }
    let [(f32_stored, f32_held, f32_served), (bf16_stored, bf16_held, bf16_served)] = moved[..]
    else {
        unreachable!()
    };
    println!(
        "resnet152 tiny: stored f32 {f32_stored} B, bf16 {bf16_stored} B; held {f32_held} / \
         {bf16_held} B; served {f32_served} / {bf16_served} B (bf16/f32 served ratio {:.3})",
        bf16_served as f64 / f32_served as f64
    );
    assert_eq!(
        f32_served, f32_stored,
        "f32: a cold start reads each stored byte once"
    );
    assert_eq!(
        bf16_served, bf16_stored,
        "bf16: a cold start reads each stored byte once"
    );
    // Every value takes half the bytes; what is left over is the 512-byte
    // alignment of params smaller than an aligned block.
    let f32_values: u64 = packages[0].manifest.params.iter().map(|p| p.nbytes).sum();
    let bf16_values: u64 = packages[1].manifest.params.iter().map(|p| p.nbytes).sum();
    assert_eq!(2 * bf16_values, f32_values);
    assert!(
        (bf16_served as f64) < 0.52 * f32_served as f64,
        "bf16 served {bf16_served} B, f32 {f32_served} B"
    );
    assert!(bf16_held < f32_held, "held {bf16_held} vs {f32_held}");
}
