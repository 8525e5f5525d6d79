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
        "--work-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(ok, "distmind up failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("All threads finished."), "{stdout}");
    // Every child it started reports a clean exit.
    for who in ["controller", "runtime", "memserver-1", "memserver-2"] {
        assert!(
            stdout.contains(&format!("up: {who} (pid"))
                || stderr.contains(&format!("up: {who} (pid")),
            "no stop line for {who}:\n{stdout}\n{stderr}"
        );
    }
    let answered = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Total get: "))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .expect("a Total get line");
    assert!(answered > 0, "{stdout}");
}
