//! Test harness: real `distmind` processes on 127.0.0.1 ephemeral ports.
//! Every child is stopped by its pid when its guard drops, pass or fail.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use distmind_common::handshake::ClusterKey;
use distmind_controller::ControllerClient;

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_distmind")
}

pub fn settings_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("settings")
}

pub fn cluster_key() -> ClusterKey {
    let s =
        distmind_common::settings::Settings::load(&settings_dir()).expect("shipped settings load");
    ClusterKey::from_secret(s.cluster_key.as_bytes())
}

/// A running service; killed (SIGKILL by pid) and reaped on drop.
pub struct Proc {
    pub child: Child,
    pub addr: String,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `distmind <args>` and waits for its `... listening on ADDR` line.
pub fn spawn_service(args: &[&str]) -> Proc {
    spawn_service_lines(args, 1).0
}

/// Starts `distmind <args>` and waits for `lines` readiness lines
/// (`<what> listening on ADDR`); returns the addresses in order.
pub fn spawn_service_lines(args: &[&str], lines: usize) -> (Proc, Vec<String>) {
    let mut child = Command::new(bin())
        .args(args)
        .env("DISTMIND_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn distmind");
    let stdout = child.stdout.take().unwrap();
    let mut reader = BufReader::new(stdout);
    let mut addrs = Vec::new();
    for _ in 0..lines {
        let mut line = String::new();
        reader
            .read_line(&mut line)
            .expect("read the readiness line");
        match line.trim().rsplit_once(" listening on ") {
            Some((_, a)) => addrs.push(a.to_string()),
            None => {
                let _ = child.kill();
                panic!("distmind {args:?} did not report readiness; line: {line:?}");
            }
        }
    }
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in reader.lines() {});
    let addr = addrs[0].clone();
    (Proc { child, addr }, addrs)
}

pub fn spawn_controller() -> Proc {
    let s = settings_dir();
    spawn_service(&[
        "controller",
        "--settings",
        s.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--client-listen",
        "127.0.0.1:0",
    ])
}

/// A controller with its dispatcher (`policy`) and metrics on ephemeral
/// ports: (process, metadata addr, client addr, metrics addr).
pub fn spawn_dispatching_controller(
    policy: &str,
    extra: &[&str],
) -> (Proc, String, String, String) {
    let s = settings_dir();
    let mut args = vec![
        "controller",
        "--settings",
        s.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--client-listen",
        "127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
        "--policy",
        policy,
    ];
    args.extend_from_slice(extra);
    let (p, a) = spawn_service_lines(&args, 3);
    (p, a[0].clone(), a[1].clone(), a[2].clone())
}

/// Resident memory of a process, from /proc (bytes).
pub fn rss_bytes(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

pub fn spawn_memserver(controller: &str, capacity: &str) -> Proc {
    spawn_memserver_with(controller, capacity, &[])
}

/// [`spawn_memserver`] with extra flags (e.g. `--fabric-provider`).
pub fn spawn_memserver_with(controller: &str, capacity: &str, extra: &[&str]) -> Proc {
    let s = settings_dir();
    let mut args = vec![
        "memserver",
        "--settings",
        s.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        capacity,
        "--controller",
        controller,
    ];
    args.extend_from_slice(extra);
    spawn_service(&args)
}

/// Polls the controller until `n` memory servers are alive (no fixed sleeps).
pub fn wait_alive(controller: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c = ControllerClient::connect(controller, &cluster_key(), Duration::from_secs(5))
        .expect("controller reachable");
    loop {
        let alive = c
            .list_memservers()
            .expect("list")
            .iter()
            .filter(|m| m.alive)
            .count();
        if alive == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{alive} of {n} memory servers alive after 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `distmind <args>` to completion: (success, stdout, stderr).
pub fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin())
        .args(args)
        .env("DISTMIND_LOG", "warn")
        .output()
        .expect("run distmind");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `distmind train <args> --settings <shipped> --controller <controller>`.
pub fn train_cli(controller: &str, args: &[&str]) -> (bool, String, String) {
    let s = settings_dir();
    let mut all = vec!["train"];
    all.extend_from_slice(args);
    all.extend_from_slice(&[
        "--settings",
        s.to_str().unwrap(),
        "--controller",
        controller,
    ]);
    run(&all)
}

/// The controller's status of training job `id`.
pub fn train_status(c: &mut ControllerClient, id: &str) -> distmind_common::proto::TrainJobStatus {
    use distmind_common::proto::{ControllerReply, ControllerRequest};
    match c
        .request(&ControllerRequest::TrainStatus {
            job: Some(id.to_string()),
        })
        .unwrap()
    {
        ControllerReply::TrainJobs { mut jobs } => jobs.pop().unwrap(),
        r => panic!("{r:?}"),
    }
}

/// Generates tiny packages with the real CLI; returns their directories.
pub fn gen_tiny(out: &Path, family: &str, variants: usize, group_bytes: u64) -> Vec<PathBuf> {
    let (ok, stdout, stderr) = run(&[
        "model",
        "gen",
        "--family",
        family,
        "--scale",
        "tiny",
        "--variants",
        &variants.to_string(),
        "--group-bytes",
        &group_bytes.to_string(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "model gen failed: {stderr}");
    stdout.lines().map(PathBuf::from).collect()
}

/// Runs `distmind deploy --quiet` against `controller` with extra flags.
pub fn deploy(controller: &str, extra: &[&str], packages: &[PathBuf]) -> (bool, String, String) {
    let settings = settings_dir();
    let mut args = vec![
        "deploy",
        "--quiet",
        "--settings",
        settings.to_str().unwrap(),
        "--controller",
        controller,
    ];
    args.extend_from_slice(extra);
    args.extend(packages.iter().map(|p| p.to_str().unwrap()));
    run(&args)
}

/// Bytes in use on a memory server, asked of the server itself (exact, no
/// heartbeat lag).
pub fn used_bytes(memserver: &str) -> u64 {
    let mut c = distmind_memserver::MemserverClient::connect(
        memserver,
        &cluster_key(),
        Duration::from_secs(5),
    )
    .unwrap();
    c.stats().unwrap().used_bytes
}

/// Starts `distmind runtime` on an ephemeral port with `--executor cpu`,
/// registered with `controller`; `extra` adds flags (e.g. `--cache 64MiB`).
pub fn spawn_runtime(controller: &str, extra: &[&str]) -> Proc {
    let s = settings_dir();
    let mut args = vec![
        "runtime",
        "--settings",
        s.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--controller",
        controller,
        "--executor",
        "cpu",
    ];
    args.extend_from_slice(extra);
    spawn_service(&args)
}

/// Polls the controller until the runtime at `addr` is registered and alive.
pub fn wait_runtime_alive(controller: &str, addr: &str) -> distmind_common::proto::RuntimeInfo {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c = ControllerClient::connect(controller, &cluster_key(), Duration::from_secs(5))
        .expect("controller reachable");
    loop {
        let found = c
            .list_runtimes()
            .expect("list runtimes")
            .into_iter()
            .find(|r| r.addr == addr && r.alive);
        if let Some(r) = found {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "runtime {addr} not alive at the controller after 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A deterministic input of the manifest's shape (batch 1): images in
/// [-1, 1), token ids in [0, 50).
pub fn input_for(pkg: &distmind_models::Package) -> distmind_runtime::exec::HostTensor {
    let spec = &pkg.manifest.inputs[0];
    let n: usize = spec.shape.iter().product();
    match spec.dtype {
        distmind_models::Dtype::F32 => distmind_runtime::exec::HostTensor::f32(
            spec.shape.clone(),
            (0..n)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect(),
        ),
        distmind_models::Dtype::I64 => distmind_runtime::exec::HostTensor::i64(
            spec.shape.clone(),
            (0..n).map(|i| ((i * 31 + 7) % 50) as i64).collect(),
        ),
    }
}

/// A copy of the shipped settings in `dir/settings`: `edit(name, text)`
/// returns a file's new text, or `None` to copy it unchanged (binary files
/// such as `cluster.key` included). Subdirectories are not copied.
pub fn copy_settings(dir: &Path, mut edit: impl FnMut(&str, &str) -> Option<String>) -> PathBuf {
    let out = dir.join("settings");
    std::fs::create_dir(&out).unwrap();
    for f in std::fs::read_dir(settings_dir()).unwrap() {
        let f = f.unwrap();
        if !f.file_type().unwrap().is_file() {
            continue;
        }
        let name = f.file_name().into_string().unwrap();
        let text = std::fs::read_to_string(f.path()).unwrap_or_default();
        match edit(&name, &text) {
            Some(t) => std::fs::write(out.join(&name), t).unwrap(),
            None => {
                std::fs::copy(f.path(), out.join(&name)).unwrap();
            }
        }
    }
    out
}

/// `distmind cluster <cmd> --settings S --run-dir R <extra>`.
pub fn cluster(
    cmd: &str,
    settings: &Path,
    run_dir: &Path,
    extra: &[&str],
) -> (bool, String, String) {
    let mut args = vec![
        "cluster",
        cmd,
        "--settings",
        settings.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run(&args)
}
