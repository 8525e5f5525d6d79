//! `distmind up`, the main job: a whole cluster as child processes, a short
//! workload, a clean stop.

mod support;

use support::*;

#[test]
fn up_runs_a_workload_and_stops_everything() {
    let dir = tempfile::tempdir().unwrap();
    let s = settings_dir();
    let (ok, stdout, stderr) = run(&[
        "up",
        "--settings",
        s.to_str().unwrap(),
        "--duration",
        "3s",
        "--models",
        "5",
        "--executor",
        "cpu",
        "--warm-devices",
        "--work-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(ok, "distmind up failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("All threads finished."), "{stdout}");
    // The device ran its first inference before the workload, straight to
    // the runtime.
    assert!(
        stdout.contains("up: warmed 1 device(s): one inference of "),
        "{stdout}"
    );
    // Every child it started reports a clean exit.
    for who in ["controller", "runtime", "memserver-1", "memserver-2"] {
        assert!(
            stdout.contains(&format!("up: {who} (pid"))
                || stderr.contains(&format!("up: {who} (pid")),
            "no stop line for {who}:\n{stdout}\n{stderr}"
        );
    }
    let answered = total_get(&stdout);
    assert!(answered > 0, "{stdout}");
    // The flags that mirror the run in the simulator: the round trip the
    // dispatcher learnt through real sockets.
    assert!(
        stdout.contains("up: to mirror this run in `distmind simulate`: --round-trip "),
        "{stdout}"
    );
}

/// Requests answered, from the client report's `Total get: N` line.
fn total_get(stdout: &str) -> u64 {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("Total get: "))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no Total get line in:\n{stdout}"))
}

/// Runs `up` with `extra` on tiny models (cpu executor, real math), closed
/// loop, writing a row to `csv`; returns stdout.
fn up_row(work: &std::path::Path, csv: &std::path::Path, extra: &[&str]) -> String {
    let s = settings_dir();
    let mut args = vec![
        "up",
        "--settings",
        s.to_str().unwrap(),
        "--executor",
        "cpu",
        "--work-dir",
        work.to_str().unwrap(),
        "--mode",
        "closed",
        "--concurrency",
        "2",
        "--duration",
        "2s",
        "--devices",
        "2",
        "--csv",
        csv.to_str().unwrap(),
        "--test",
        "baselines",
    ];
    args.extend_from_slice(extra);
    let (ok, stdout, stderr) = run(&args);
    assert!(ok, "distmind up {extra:?} failed:\n{stdout}\n{stderr}");
    stdout
}

/// The counter `name` of the runtime in `up`'s headline metrics.
fn runtime_counter(stdout: &str, name: &str) -> f64 {
    let runtime = stdout
        .split("  runtime (")
        .nth(1)
        .unwrap_or_else(|| panic!("no runtime metrics in:\n{stdout}"));
    runtime
        .lines()
        .find_map(|l| l.trim().strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn the_same_workload_runs_against_distmind_and_each_baseline_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("results").join("r.csv");
    let work = dir.path().join("work");
    // DistMind pulls models on demand.
    let out = up_row(&work, &csv, &["--models", "3", "--family", "densenet201"]);
    assert!(out.contains("up: system distmind"), "{out}");
    // MPS: the whole set in host memory before the workload, 12 resident.
    let out = up_row(
        &work,
        &csv,
        &[
            "--models",
            "3",
            "--family",
            "densenet201",
            "--system",
            "mps",
        ],
    );
    assert!(
        out.contains("up: mps warmed: 3 models prefetched into host memory"),
        "{out}"
    );
    assert!(
        out.contains("12 model(s) resident per GPU, whole-model loads"),
        "{out}"
    );
    // Every request found its model in host memory or on the device: the
    // workload fetched nothing over the network.
    let cold = runtime_counter(&out, "distmind_runtime_serve_path_total{path=\"cold\"}");
    assert_eq!(cold, 0.0, "{out}");
    // Ray: one resident per GPU.
    let out = up_row(
        &work,
        &csv,
        &[
            "--models",
            "3",
            "--family",
            "densenet201",
            "--system",
            "ray",
        ],
    );
    assert!(out.contains("1 model(s) resident per GPU"), "{out}");
    // The GPU bound: one model, resident on both devices before the workload.
    let out = up_row(&work, &csv, &["--family", "densenet201", "--system", "gpu"]);
    assert!(out.contains("its model resident on every device"), "{out}");
    let resident = runtime_counter(
        &out,
        "distmind_runtime_serve_path_total{path=\"device_resident\"}",
    );
    let total = runtime_counter(&out, "distmind_runtime_requests_total{status=\"ok\"}");
    assert!(total > 0.0 && resident == total, "{out}");

    let text = std::fs::read_to_string(&csv).unwrap();
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let systems: Vec<&str> = rows.iter().map(|r| r[col("system")]).collect();
    assert_eq!(systems, ["distmind", "mps", "ray", "gpu"]);
    for r in &rows {
        let ok: u64 = r[col("ok")].parse().unwrap();
        assert!(ok > 0, "{r:?}");
        assert_eq!(r[col("executor")], "cpu");
        assert!(r[col("lat_mean_ms")].parse::<f64>().unwrap() > 0.0);
        assert!(r[col("runtime_rss_mib")].parse::<u64>().unwrap() > 0);
    }

    // The rows draw as a figure.
    let png = dir.path().join("fig.png");
    let (ok, stdout, stderr) = run(&[
        "plot",
        "bars",
        "--csv",
        csv.to_str().unwrap(),
        "--out",
        png.to_str().unwrap(),
        "--x",
        "family",
        "--series",
        "system",
        "--y",
        "lat_mean_ms",
        "--reference",
        "gpu",
    ]);
    assert!(ok, "plot failed:\n{stdout}\n{stderr}");
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
}

#[test]
fn up_refuses_contradicting_flags_clearly() {
    let s = settings_dir();
    let (ok, _, stderr) = run(&[
        "up",
        "--settings",
        s.to_str().unwrap(),
        "--system",
        "gpu",
        "--models",
        "3",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("one-model bound: --models must be 1"),
        "{stderr}"
    );
    let (ok, _, stderr) = run(&[
        "up",
        "--settings",
        s.to_str().unwrap(),
        "--system",
        "mps",
        "--policy",
        "slo",
    ]);
    assert!(!ok);
    assert!(stderr.contains("--policy slo contradicts it"), "{stderr}");
}

/// The default without a GPU: two clusters one after the other (DistMind
/// with half the set cached, mps with all of it), sim executor, emulated
/// link, a side-by-side table. Tiny models and a short workload here; the
/// README's command runs 8 full-size ResNet-152s.
#[test]
fn up_without_a_system_runs_the_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let s = settings_dir();
    let (ok, stdout, stderr) = run(&[
        "up",
        "--settings",
        s.to_str().unwrap(),
        "--models",
        "2",
        "--scale",
        "tiny",
        "--duration",
        "0.5s",
        "--emulate-link",
        "100gbit",
        "--emulate-loopback",
        "1GB/s",
        "--work-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(ok, "distmind up failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("== DistMind vs MPS: 2 resnet152 (tiny size)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("emulated 100gbit link (K 12.50, loopback 1.000GB/s)"),
        "{stdout}"
    );
    let ratios = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("distmind / mps: throughput"))
        .unwrap_or_else(|| panic!("no ratio line:\n{stdout}"));
    assert!(ratios.contains("x, p99"), "{ratios}");
    // Both clusters answered requests.
    let tput = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("throughput (req/s)"))
        .expect("a throughput row");
    let v: Vec<f64> = tput
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(v.len(), 2, "{tput}");
    assert!(v.iter().all(|&x| x > 0.0), "{tput}");
    assert!(stdout.contains("both clusters stopped"), "{stdout}");
}

/// The `slo` policy with a training job whose iterations outlast the SLO
/// (the V100 profile's ResNet-152 iteration, 244 ms; a 100 ms SLO), as
/// processes: one GPU stays for the demand (50 requests/s) and the other
/// trains. With every GPU training between requests, no request met it.
#[test]
fn up_slo_keeps_a_gpu_for_inference_when_iterations_outlast_the_slo() {
    let dir = tempfile::tempdir().unwrap();
    let s = settings_dir();
    let csv = dir.path().join("r.csv");
    let profile = s.join("profiles").join("v100-estimated.json");
    let (ok, stdout, stderr) = run(&[
        "up",
        "--settings",
        s.to_str().unwrap(),
        "--executor",
        "sim",
        "--profile",
        profile.to_str().unwrap(),
        "--models",
        "2",
        "--family",
        "resnet152",
        "--devices",
        "2",
        "--device-memory",
        "1200MiB",
        "--cache",
        "1000MiB",
        "--warm-cache",
        "--system",
        "distmind",
        "--policy",
        "slo",
        "--use-train",
        "--mode",
        "poisson",
        "--rate",
        "50",
        "--slo-ms",
        "100",
        "--duration",
        "4s",
        "--csv",
        csv.to_str().unwrap(),
        "--work-dir",
        dir.path().join("work").to_str().unwrap(),
    ]);
    assert!(ok, "distmind up failed:\n{stdout}\n{stderr}");
    let text = std::fs::read_to_string(&csv).unwrap();
    let header: Vec<&str> = distmind::up::results::HEADER.split(',').collect();
    let row: Vec<&str> = text.lines().nth(1).expect("a row").split(',').collect();
    let col = |name: &str| -> f64 {
        let i = header.iter().position(|h| *h == name).unwrap();
        row[i].parse().unwrap()
    };
    // The first requests find both GPUs training (nothing asked for
    // inference yet) and wait for one to yield.
    assert!(col("slo_attainment") >= 0.8, "{text}\n{stdout}");
    let trained: f64 = ["0", "1"]
        .iter()
        .map(|d| {
            runtime_counter(
                &stdout,
                &format!("distmind_runtime_device_train_iterations_total{{device=\"{d}\"}}"),
            )
        })
        .sum();
    assert!(trained >= 4.0, "{trained} iterations:\n{stdout}");
}

/// Figure 9's run as processes: two simulated GPUs shared between inference
/// and a background training job that follows `--inference-workload`, on an
/// emulated link, with the runtime's /metrics sampled into a timeline CSV.
#[test]
fn up_shares_gpus_with_training_and_writes_a_timeline() {
    let dir = tempfile::tempdir().unwrap();
    let s = settings_dir();
    let csv = dir.path().join("timeline.csv");
    let (ok, stdout, stderr) = run(&[
        "up",
        "--settings",
        s.to_str().unwrap(),
        "--executor",
        "sim",
        "--scale",
        "tiny",
        "--models",
        "2",
        "--family",
        "resnet152",
        "--devices",
        "2",
        "--use-train",
        "--inference-workload",
        "1,2",
        "--mode",
        "closed",
        "--concurrency",
        "2",
        "--duration",
        "3s",
        "--emulate-link",
        "10gbit",
        "--emulate-loopback",
        "1GB/s",
        "--timeline",
        csv.to_str().unwrap(),
        "--timeline-interval",
        "0.5",
        "--test",
        "sharing",
        "--work-dir",
        dir.path().join("work").to_str().unwrap(),
    ]);
    assert!(ok, "distmind up failed:\n{stdout}\n{stderr}");
    // No --system: training implies a single DistMind run, no side-by-side.
    assert!(stdout.contains("up: system distmind"), "{stdout}");
    assert!(
        stdout.contains(
            "up: training: resnet152_train (resnet152, generated and deployed by up), batch 96"
        ),
        "{stdout}"
    );
    let answered = total_get(&stdout);
    assert!(answered > 0, "{stdout}");
    let iterations = runtime_counter(
        &stdout,
        "distmind_runtime_device_train_iterations_total{device=\"1\"}",
    );
    assert!(
        iterations > 0.0,
        "device 1 trains in the 1-GPU seconds:\n{stdout}"
    );

    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(distmind::up::timeline::HEADER), "{text}");
    let header: Vec<&str> = distmind::up::timeline::HEADER.split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    // 3 emulated seconds in half-second intervals (the last may be dropped
    // when it is a sliver).
    assert!((5..=7).contains(&rows.len()), "{text}");
    let num = |r: &Vec<&str>, c: &str| r[col(c)].parse::<f64>().unwrap();
    assert!(rows.iter().any(|r| num(r, "training_ips") > 0.0), "{text}");
    assert!(rows.iter().any(|r| num(r, "inference_rps") > 0.0), "{text}");
    for r in &rows {
        assert_eq!(r.len(), header.len(), "{r:?}");
        assert_eq!(
            (r[col("test")], r[col("system")], r[col("source")]),
            ("sharing", "distmind", "processes")
        );
        assert_eq!((r[col("link")], r[col("dilation")]), ("10gbit", "1.2500"));
        // Bounds from the profile: two GPUs.
        assert!(num(r, "inference_bound_rps") > 0.0 && num(r, "training_bound_ips") > 0.0);
        // One GPU trains at most: never more than half the training bound
        // (a ratio, with room for a sample's edges).
        assert!(num(r, "training_util") <= 0.75, "{r:?}");
    }
}

#[test]
fn up_refuses_training_flags_that_cannot_apply() {
    let s = settings_dir();
    let up = |extra: &[&str]| {
        let mut args = vec!["up", "--settings", s.to_str().unwrap(), "--executor", "cpu"];
        args.extend_from_slice(extra);
        let (ok, _, stderr) = run(&args);
        assert!(!ok, "{extra:?} ran");
        stderr
    };
    let e = up(&["--train-model", "resnet152_train"]);
    assert!(e.contains("--train-model needs --use-train"), "{e}");
    let e = up(&[
        "--use-train",
        "--devices",
        "2",
        "--inference-workload",
        "1,3",
    ]);
    assert!(
        e.contains("--inference-workload entry 2 asks for 3 GPUs"),
        "{e}"
    );
    let e = up(&["--use-train", "--system", "mps"]);
    assert!(e.contains("the mps baseline does not share GPUs"), "{e}");
    let e = up(&["--use-train", "--inference-workload", "1,x"]);
    assert!(e.contains("--inference-workload entry 2"), "{e}");
}
