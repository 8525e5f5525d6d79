//! Training input near the data, on real processes over loopback: a
//! controller and memory servers started from the `distmind` binary, a
//! dataset of real JPEGs generated here and stored with `dataset put`, the
//! memory servers' sample service, the runtime's data loader.
//!
//! - SOPHON: with a rate-limited link (the memory server's NIC held to a
//!   low rate) and one preprocessing worker, the sophon plan's epoch is no
//!   slower than shipping files (`none`) or preprocessing everything
//!   remotely (`all`); its traffic against `none` is printed.
//! - Bad input: a corrupt JPEG is reported by sample id and skipped (or
//!   fails its batch) while the memory server keeps serving; an over-size
//!   sample is refused; a plan for a dataset that has changed is refused.

mod support;

use std::path::Path;

use support::*;

/// The tests compare times: one at a time, so that no other test's
/// processes share the cores with the runs compared.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A controller and one memory server with `extra` flags; (procs, controller addr).
fn cluster_with(extra: &[&str]) -> (Vec<Proc>, String) {
    let c = spawn_controller();
    let addr = c.addr.clone();
    let m = spawn_memserver_with(&addr, "512MiB", extra);
    wait_alive(&addr, 1);
    (vec![m, c], addr)
}

/// `distmind ARGS --settings .. --controller CONTROLLER`: (ok, stdout, stderr).
fn dm_run(controller: &str, args: &[&str]) -> (bool, String, String, Vec<String>) {
    let s = settings_dir();
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend(
        [
            "--settings",
            s.to_str().unwrap(),
            "--controller",
            controller,
        ]
        .map(String::from),
    );
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let (ok, out, err) = run(&refs);
    (ok, out, err, all)
}

fn dm(controller: &str, args: &[&str]) -> String {
    let (ok, out, err, all) = dm_run(controller, args);
    assert!(ok, "distmind {all:?} failed:\n{out}\n{err}");
    out
}

fn dm_fails(controller: &str, args: &[&str]) -> String {
    let (ok, out, err, all) = dm_run(controller, args);
    assert!(!ok, "distmind {all:?} should have failed:\n{out}");
    err
}

fn synth(dir: &Path, samples: usize, sizes: &str, quality: u8) {
    let (ok, out, err) = run(&[
        "dataset",
        "synth",
        "--out",
        dir.to_str().unwrap(),
        "--samples",
        &samples.to_string(),
        "--classes",
        "4",
        "--sizes",
        sizes,
        "--quality",
        &quality.to_string(),
    ]);
    assert!(ok, "synth failed: {out}{err}");
}

fn epoch(controller: &str, name: &str, how: &[&str]) -> serde_json::Value {
    let mut args = vec!["dataset", "epoch", name, "--json", "--batch", "8"];
    args.extend_from_slice(how);
    let out = dm(controller, &args);
    serde_json::from_str(out.lines().last().expect("a report line")).expect("json report")
}

#[test]
fn sophon_is_no_slower_than_none_or_all_when_link_and_cpu_are_scarce() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("set");
    // Small images (their files are smaller than any preprocessed form:
    // never worth offloading) and large photos (a 224 x 224 crop is
    // smaller than the file).
    synth(&data, 36, "64x64,96x128,900x700", 95);
    // The memory server's NIC held to 80 Mbit/s; one preprocessing worker.
    let (_procs, ctl) = cluster_with(&[
        "--prep-workers",
        "1",
        "--emulate-link",
        "80mbit",
        "--emulate-loopback",
        "80mbit",
    ]);
    dm(
        &ctl,
        &["dataset", "put", "--name", "photos", data.to_str().unwrap()],
    );
    let plan = dir.path().join("plan.json");
    let out = dm(
        &ctl,
        &[
            "dataset",
            "plan",
            "photos",
            "--mode",
            "sophon",
            "--bandwidth",
            "80mbit",
            "--out",
            plan.to_str().unwrap(),
        ],
    );
    println!("{out}");
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).unwrap()).unwrap();
    let steps: Vec<u64> = p["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_u64().unwrap())
        .collect();
    // Every third sample is a large photo; only those are worth offloading.
    for (i, &k) in steps.iter().enumerate() {
        if i % 3 != 2 {
            assert_eq!(k, 0, "sample {i} (small) must not be offloaded: {steps:?}");
        }
    }
    assert!(steps.iter().any(|&k| k > 0), "nothing offloaded: {steps:?}");

    let none = epoch(&ctl, "photos", &["--mode", "none"]);
    let all = epoch(&ctl, "photos", &["--mode", "all"]);
    let sophon = epoch(&ctl, "photos", &["--plan", plan.to_str().unwrap()]);
    let t = |r: &serde_json::Value| r["seconds"].as_f64().unwrap();
    let b = |r: &serde_json::Value| r["bytes"].as_u64().unwrap();
    for r in [&none, &all, &sophon] {
        assert_eq!(r["samples"], 36, "{r}");
    }
    println!(
        "epoch: none {:.3}s {} B, all {:.3}s {} B, sophon {:.3}s {} B; sophon moves {:.2}x less than none",
        t(&none),
        b(&none),
        t(&all),
        b(&all),
        t(&sophon),
        b(&sophon),
        b(&none) as f64 / b(&sophon) as f64
    );
    assert!(b(&sophon) < b(&none), "sophon moved more than none");
    assert!(
        t(&sophon) <= t(&none).min(t(&all)),
        "sophon's epoch ({:.3}s) is slower than min(none {:.3}s, all {:.3}s)",
        t(&sophon),
        t(&none),
        t(&all)
    );
}

#[test]
fn bad_samples_are_named_and_the_service_keeps_serving() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("set");
    synth(&data, 8, "64x64", 90);
    // Corrupt sample 3: keep the JPEG header, cut the rest to garbage.
    let labels = std::fs::read_to_string(data.join("labels.txt")).unwrap();
    let third = labels
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .nth(3)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    let path = data.join(&third);
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    for b in &mut bytes[n / 3..n - 2] {
        *b = 0xAB;
    }
    bytes.truncate(n / 2);
    std::fs::write(&path, &bytes).unwrap();

    let (_procs, ctl) = cluster_with(&["--prep-workers", "1"]);
    dm(
        &ctl,
        &["dataset", "put", "--name", "d", data.to_str().unwrap()],
    );
    let inspect = dm(&ctl, &["dataset", "inspect", "d"]);
    assert!(inspect.contains("8 samples"), "{inspect}");

    // Skipped by default, named by its index; the other 7 load.
    let r = epoch(&ctl, "d", &["--mode", "all"]);
    assert_eq!(r["samples"], 7, "{r}");
    assert_eq!(r["skipped"], 1, "{r}");
    // With the failing policy the epoch fails naming sample 3.
    let err = dm_fails(
        &ctl,
        &[
            "dataset",
            "epoch",
            "d",
            "--mode",
            "split:2",
            "--fail-bad-samples",
        ],
    );
    assert!(err.contains("sample 3"), "{err}");
    // The memory server still serves every good sample, locally decoded too.
    let r = epoch(&ctl, "d", &["--mode", "none"]);
    assert_eq!(r["samples"], 7, "{r}");

    // A plan made for this content is refused once the dataset changes.
    let plan = dir.path().join("plan.json");
    dm(
        &ctl,
        &[
            "dataset",
            "plan",
            "d",
            "--mode",
            "split:1",
            "--out",
            plan.to_str().unwrap(),
        ],
    );
    std::fs::write(
        &path,
        std::fs::read(
            data.join(
                labels
                    .lines()
                    .find(|l| !l.starts_with('#'))
                    .unwrap()
                    .split_whitespace()
                    .next()
                    .unwrap(),
            ),
        )
        .unwrap(),
    )
    .unwrap();
    dm(
        &ctl,
        &["dataset", "put", "--name", "d", data.to_str().unwrap()],
    );
    let err = dm_fails(
        &ctl,
        &["dataset", "epoch", "d", "--plan", plan.to_str().unwrap()],
    );
    assert!(err.contains("make a new plan"), "{err}");

    // An over-size sample is refused at put, naming the file.
    let big = dir.path().join("big");
    std::fs::create_dir_all(&big).unwrap();
    let mut jpeg = vec![0xFF, 0xD8, 0xFF, 0xE0];
    jpeg.resize((32 << 20) + 1, 0);
    std::fs::write(big.join("huge.jpg"), &jpeg).unwrap();
    std::fs::write(big.join("labels.txt"), "huge.jpg 0\n").unwrap();
    let err = dm_fails(
        &ctl,
        &["dataset", "put", "--name", "big", big.to_str().unwrap()],
    );
    assert!(err.contains("huge.jpg"), "{err}");

    // ls and rm.
    let ls = dm(&ctl, &["dataset", "ls"]);
    assert!(ls.contains('d'), "{ls}");
    dm(&ctl, &["dataset", "rm", "d"]);
    let ls = dm(&ctl, &["dataset", "ls"]);
    assert!(ls.contains("no datasets"), "{ls}");
}

/// `memserver_sample_bytes_sent_total{op="extract"}` of a memory server.
fn extract_bytes(metrics: &str) -> u64 {
    let (code, text) =
        distmind_common::metrics::scrape(metrics, "/metrics", std::time::Duration::from_secs(5))
            .expect("scrape the memory server");
    assert_eq!(code, 200);
    distmind_common::metrics::sample_value(
        &text,
        "memserver_sample_bytes_sent_total",
        &[("op", "extract")],
    )
    .unwrap_or(0.0) as u64
}

#[test]
fn ndpipe_ships_features_and_chunks_finish_sooner_at_the_same_accuracy() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("set");
    synth(&data, 240, "64x64,80x96", 90);
    // The backbone: a generated tiny ResNet-152 without its head.
    let pkgs = gen_tiny(&dir.path().join("pk"), "resnet152", 1, 1 << 16);
    let backbone = pkgs[0].to_str().unwrap();
    let c = spawn_controller();
    let ctl = c.addr.clone();
    let s = settings_dir();
    let (_m, addrs) = spawn_service_lines(
        &[
            "memserver",
            "--settings",
            s.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--capacity",
            "256MiB",
            "--controller",
            &ctl,
            "--metrics",
            "127.0.0.1:0",
            // One core extracts, the other trains: on this 2-core machine
            // the memory server and the trainer share the CPUs, and the
            // overlap NDPipe's chunks buy needs each its own.
            "--prep-workers",
            "1",
            "--backbone",
            backbone,
        ],
        2,
    );
    let metrics = addrs[1].clone();
    wait_alive(&ctl, 1);
    dm(
        &ctl,
        &["dataset", "put", "--name", "d", data.to_str().unwrap()],
    );

    let ndpipe = |chunks: &str| -> serde_json::Value {
        let before = extract_bytes(&metrics);
        let out = dm(
            &ctl,
            &[
                "ndpipe",
                "--dataset",
                "d",
                "--chunks",
                chunks,
                "--epochs",
                "3000",
                "--batch",
                "45",
                "--lr",
                "2",
                "--held-out",
                "0.25",
                "--json",
            ],
        );
        let r: serde_json::Value =
            serde_json::from_str(out.lines().last().expect("a report")).expect("json report");
        let sent = extract_bytes(&metrics) - before;
        // Everything extracted, training chunks and held-out set alike,
        // crossed the wire as f16 features and a u32 label, nothing else.
        let n = r["extracted"].as_u64().unwrap();
        let dim = r["backbone"]["feature_dim"].as_u64().unwrap();
        assert_eq!(n, 240, "{r}");
        assert_eq!(sent, n * (dim * 2 + 4), "{r}");
        assert_eq!(r["bytes"].as_u64().unwrap(), sent, "{r}");
        r
    };
    // The wall times are compared by their minimum over interleaved rounds:
    // on a shared 2-core machine a busy neighbour only ever slows a run, and
    // one slowed run must not decide the comparison.
    let rounds: Vec<(serde_json::Value, serde_json::Value)> =
        (0..3).map(|_| (ndpipe("1"), ndpipe("4"))).collect();
    for r in rounds.iter().flat_map(|(a, b)| [a, b]) {
        println!(
            "R={}: extraction {:.3}s ({:.0} samples/s), training {:.3}s, wall {:.3}s",
            r["chunks"].as_array().unwrap().len(),
            r["extract_wall_s"].as_f64().unwrap(),
            r["extract_samples_per_s"].as_f64().unwrap(),
            r["train_s"].as_f64().unwrap(),
            r["wall_s"].as_f64().unwrap()
        );
    }
    let acc = |r: &serde_json::Value| r["held_out_accuracy"].as_f64().unwrap();
    let wall = |r: &serde_json::Value| r["wall_s"].as_f64().unwrap();
    let fastest = |pick: fn(&(serde_json::Value, serde_json::Value)) -> &serde_json::Value| {
        rounds
            .iter()
            .map(pick)
            .map(wall)
            .fold(f64::INFINITY, f64::min)
    };
    let (w1, w4) = (fastest(|p| &p.0), fastest(|p| &p.1));
    let (r1, r4) = &rounds[0];
    println!(
        "ndpipe with backbone {}: R=1 {w1:.3}s accuracy {:.3}, R=4 {w4:.3}s accuracy {:.3} \
         (fastest of {} rounds)",
        r1["backbone"]["backbone"],
        acc(r1),
        acc(r4),
        rounds.len()
    );
    for (r1, r4) in &rounds {
        // Chance is 0.25: the features carry the classes.
        assert!(acc(r1) > 0.5, "{r1}");
        assert!(
            (acc(r1) - acc(r4)).abs() <= 0.02,
            "R=1 {} against R=4 {}",
            acc(r1),
            acc(r4)
        );
    }
    assert!(w4 < w1, "R=4 took {w4} s at best, R=1 {w1} s");
}
