//! The simulator against real processes, small: the same configuration run
//! as a cluster of processes on an emulated link (`distmind up`) and in
//! `distmind simulate`, request for request (the client's seed, the same
//! emulated duration, the dilated run's timers mirrored), and their figures
//! compared. `ae/validate/run.sh` is the full-size version.

mod support;

use support::*;

/// One CSV row as column -> value.
fn row(csv: &std::path::Path, source: &str) -> std::collections::HashMap<String, String> {
    let text = std::fs::read_to_string(csv).unwrap();
    let mut lines = text.lines();
    let header: Vec<String> = lines
        .next()
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect();
    let found = lines
        .map(|l| {
            header
                .iter()
                .cloned()
                .zip(l.split(',').map(str::to_string))
                .collect::<std::collections::HashMap<_, _>>()
        })
        .find(|r| r["source"] == source);
    found.unwrap_or_else(|| panic!("no {source} row in {}:\n{text}", csv.display()))
}

fn num(r: &std::collections::HashMap<String, String>, col: &str) -> f64 {
    r[col]
        .parse()
        .unwrap_or_else(|_| panic!("column {col} is {:?}", r[col]))
}

#[test]
fn the_simulator_predicts_a_time_dilated_real_run() {
    let work = tempfile::tempdir().unwrap();
    let csv = work.path().join("validate.csv");
    let s = settings_dir();
    // 4 full-size ResNet-152 variants (the mps baseline holds them all in host
    // memory), a simulated V100 with parameter memory for 2, emulated
    // 100 Gbit/s on a 1 GB/s loopback bucket (K 12.5), 2 closed-loop clients.
    let profile = s.join("profiles").join("v100-estimated.json");
    let common = [
        "--family",
        "resnet152",
        "--models",
        "4",
        "--mode",
        "closed",
        "--concurrency",
        "2",
        "--zipf",
        "0.9",
        "--batch",
        "1",
        "--slo-ms",
        "1000",
        "--period",
        "1",
        "--device-memory",
        "464MiB",
        "--system",
        "mps",
        "--cache",
        "1GiB",
        "--duration",
        "2s",
        "--csv",
        csv.to_str().unwrap(),
        "--profile",
        profile.to_str().unwrap(),
    ];
    let mut real = vec![
        "up",
        "--settings",
        s.to_str().unwrap(),
        "--executor",
        "sim",
        "--work-dir",
        work.path().to_str().unwrap(),
        "--emulate-link",
        "100gbit",
        "--emulate-loopback",
        "1GB/s",
        "--capacity",
        "600MiB",
    ];
    real.extend_from_slice(&common);
    let (ok, stdout, stderr) = run(&real);
    assert!(ok, "distmind up failed:\n{stdout}\n{stderr}");
    let mut sim = vec![
        "simulate",
        "--settings",
        s.to_str().unwrap(),
        "--link",
        "100gbit",
        "--memservers",
        "2",
        "--mirror-dilation",
        "12.5",
    ];
    sim.extend_from_slice(&common);
    let (ok, stdout, stderr) = run(&sim);
    assert!(ok, "distmind simulate failed:\n{stdout}\n{stderr}");

    let (r, p) = (row(&csv, "processes"), row(&csv, "simulator"));
    let rel = |col: &str| (num(&p, col) - num(&r, col)) / num(&r, col);
    let misses = |x: &std::collections::HashMap<String, String>| {
        let loads = num(x, "served_host_cached") + num(x, "served_cold");
        loads / (loads + num(x, "served_resident"))
    };
    let report = format!(
        "throughput {:+.1}%, mean {:+.1}%, device misses real {:.3} simulated {:.3}\n{}",
        100.0 * rel("throughput_rps"),
        100.0 * rel("lat_mean_ms"),
        misses(&r),
        misses(&p),
        std::fs::read_to_string(&csv).unwrap()
    );
    println!("{report}");
    // The same requests meet the same GPU: a short run (about 200 requests)
    // agrees to well within 20%, the full-size validation to 10%.
    assert!(rel("throughput_rps").abs() < 0.2, "{report}");
    assert!(rel("lat_mean_ms").abs() < 0.2, "{report}");
    assert!((misses(&r) - misses(&p)).abs() < 0.1, "{report}");
}
