//! `distmind cluster up|status|down` with real detached processes, on a copy
//! of the shipped settings moved to free ports.

mod support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};

use support::*;

/// Free loopback ports for the cluster's fixed addresses, checked free here
/// and bound by the services next. They come from below Linux's ephemeral
/// range (32768-60999), so no port-0 bind and no outgoing connection of
/// other processes can take one in between (a port that the kernel handed
/// out and took back could be), and no two tests of this binary get the
/// same one.
fn free_ports(n: usize) -> Vec<u16> {
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Another run of this binary at the same time starts elsewhere.
    let start = std::process::id() % SPAN;
    let mut ports = Vec::with_capacity(n);
    while ports.len() < n {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        assert!(k < SPAN, "no free loopback port in {LOW}..{}", LOW + SPAN);
        let port = (LOW + (start + k) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            ports.push(port);
        }
    }
    ports
}

/// One test's cluster at a time: a cluster's metrics ports sit at an
/// offset from its fixed ones ([`free_offset`]), which another test's
/// running cluster could hold.
fn one_cluster_at_a_time() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The shipped settings in `dir/settings`, the metadata endpoint, the two
/// memory servers, the client port, the cache port and the inference ports
/// (HTTP, gRPC) moved to `ports`.
fn settings_copy(dir: &Path, ports: &[u16]) -> PathBuf {
    copy_settings(dir, |name, text| {
        Some(match name {
            "storage_list.txt" => text
                .replace("7777", &ports[0].to_string())
                .replace("7778", &ports[1].to_string())
                .replace("7779", &ports[2].to_string()),
            "controller.json" | "mps_controller.json" => {
                text.replace("7777", &ports[0].to_string())
            }
            "config.sh" => text
                .replace("=7777", &format!("={}", ports[0]))
                .replace("=9999", &format!("={}", ports[3]))
                .replace("=10009", &format!("={}", ports[4]))
                .replace("=8000", &format!("={}", ports[5]))
                .replace("=8001", &format!("={}", ports[6])),
            _ => return None,
        })
    })
}

/// Pids in `cluster.json`.
fn recorded_pids(run: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(run.join("cluster.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s["pid"].as_u64().unwrap() as u32)
        .collect()
}

fn running(pid: u32) -> bool {
    distmind::cluster::start_ticks(pid).is_some()
}

/// Stops whatever a test's cluster left running (by the pids `cluster up`
/// recorded), pass or fail.
struct Down(PathBuf);

impl Drop for Down {
    fn drop(&mut self) {
        let _ = distmind::cluster::down(&self.0);
    }
}

const SMALL: [&str; 4] = ["--memserver-capacity", "64MiB", "--cache", "128MiB"];

#[test]
fn up_status_down_start_and_stop_exactly_the_cluster() {
    let _one = one_cluster_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let settings = settings_copy(tmp.path(), &free_ports(7));
    let run = tmp.path().join("run");
    let _down = Down(run.clone());
    let (ok, out, err) = cluster("up", &settings, &run, &SMALL);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("4 services healthy"), "{out}");
    let pids = recorded_pids(&run);
    assert_eq!(pids.len(), 4);
    assert!(pids.iter().all(|&p| running(p)));

    let (ok, out, err) = cluster("status", &settings, &run, &[]);
    assert!(ok, "{out}\n{err}");
    for name in ["controller", "memserver-1", "memserver-2", "runtime"] {
        let line = out.lines().find(|l| l.starts_with(name)).expect(name);
        assert!(line.contains("healthy"), "{line}");
    }
    // A second `up` refuses while this one runs.
    let (ok, _, err) = cluster("up", &settings, &run, &SMALL);
    assert!(!ok && err.contains("still running"), "{err}");

    let (ok, out, err) = cluster("down", &settings, &run, &[]);
    assert!(ok, "{out}\n{err}");
    assert_eq!(
        out.lines().filter(|l| l.contains("stopped")).count(),
        4,
        "{out}"
    );
    assert!(pids.iter().all(|&p| !running(p)), "every process stopped");
    let (ok, out, _) = cluster("status", &settings, &run, &[]);
    assert!(ok && out.contains("no cluster recorded"), "{out}");
}

#[test]
fn a_service_that_cannot_start_stops_the_bring_up_and_what_was_started() {
    let _one = one_cluster_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let ports = free_ports(7);
    let settings = settings_copy(tmp.path(), &ports);
    let run = tmp.path().join("run");
    let _down = Down(run.clone());
    // The second memory server's port is taken.
    let _taken = TcpListener::bind(("127.0.0.1", ports[2])).unwrap();
    let (ok, out, err) = cluster("up", &settings, &run, &SMALL);
    assert!(!ok, "{out}");
    assert!(err.contains("stopped at memserver-2"), "{err}");
    assert!(
        err.contains("cannot listen on"),
        "the service's own error is shown: {err}"
    );
    // The controller and the first memory server were started, then stopped.
    let started: Vec<u32> = out
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2)?.parse().ok())
        .collect();
    assert_eq!(started.len(), 2, "{out}");
    assert!(started.iter().all(|&p| !running(p)));
    assert!(!run.join("cluster.json").exists());
}

// ---------------------------------------------------------------------------
// MODE='remote' without other hosts: a stand-in ssh that runs the command
// here (tests/netns.rs runs it across network namespaces, as root).

/// `settings_copy` with MODE='remote' (GPU server and memory servers on
/// 127.0.0.1, ssh user `ubuntu` of the shipped username.txt).
fn remote_copy(dir: &Path, ports: &[u16]) -> PathBuf {
    let s = settings_copy(dir, ports);
    let config = std::fs::read_to_string(s.join("config.sh")).unwrap();
    assert!(config.contains("MODE='local'"));
    std::fs::write(
        s.join("config.sh"),
        config.replace("MODE='local'", "MODE='remote'"),
    )
    .unwrap();
    s
}

/// An executable `dir/ssh` with `body` after a line that logs its
/// arguments (up to the script's first line break) to `dir/ssh.log`.
fn fake_ssh(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("ssh");
    let log = dir.join("ssh.log");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\necho \"$*\" | head -n 1 >> '{}'\n{body}",
            log.display()
        ),
    )
    .unwrap();
    let ok = std::process::Command::new("chmod")
        .arg("+x")
        .arg(&path)
        .status()
        .unwrap();
    assert!(ok.success());
    path
}

/// An offset that puts every port's metrics twin on a free port.
fn free_offset(ports: &[u16]) -> u16 {
    (1..2000u16)
        .find(|off| {
            ports.iter().all(|p| match p.checked_add(*off) {
                Some(m) => !ports.contains(&m) && TcpListener::bind(("127.0.0.1", m)).is_ok(),
                None => false,
            })
        })
        .expect("a free metrics offset")
}

#[test]
fn remote_mode_needs_username_txt() {
    let _one = one_cluster_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let settings = remote_copy(tmp.path(), &free_ports(7));
    std::fs::remove_file(settings.join("username.txt")).unwrap();
    let run = tmp.path().join("run");
    let (ok, out, err) = cluster("up", &settings, &run, &SMALL);
    assert!(!ok, "{out}");
    assert!(
        err.contains("username.txt") && err.contains("remote mode needs it"),
        "{err}"
    );
}

#[test]
fn remote_mode_names_the_host_ssh_cannot_reach() {
    let _one = one_cluster_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let settings = remote_copy(tmp.path(), &free_ports(7));
    let run = tmp.path().join("run");
    let ssh = fake_ssh(
        tmp.path(),
        "echo \"ssh: connect to host 127.0.0.1 port 22: No route to host\" >&2\nexit 255\n",
    );
    let mut extra = vec!["--ssh", ssh.to_str().unwrap()];
    extra.extend_from_slice(&SMALL);
    let (ok, out, err) = cluster("up", &settings, &run, &extra);
    assert!(!ok, "{out}");
    assert!(err.contains("stopped at controller"), "{err}");
    assert!(
        err.contains("ubuntu@127.0.0.1")
            && err.contains("exit 255")
            && err.contains("No route to host"),
        "the host and ssh's message: {err}"
    );
    assert!(!run.join("cluster.json").exists());
    // A missing ssh command is named too.
    let (ok, _, err) = cluster("up", &settings, &run, &["--ssh", "/no/such/ssh -p 22"]);
    assert!(!ok && err.contains("/no/such/ssh -p 22"), "{err}");
}

#[test]
fn remote_mode_over_a_local_ssh_stand_in_starts_and_stops_by_pid() {
    let _one = one_cluster_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let ports = free_ports(7);
    let settings = remote_copy(tmp.path(), &ports);
    let run = tmp.path().join("run");
    let _down = Down(run.clone());
    // Drops options (-o X, -p X), and user@host; runs the command here.
    let ssh = fake_ssh(
        tmp.path(),
        "while [ \"$1\" = -o ] || [ \"$1\" = -p ]; do shift 2; done\nshift\nexec sh -c \"$*\"\n",
    );
    let ssh_cmd = format!("{} -p 2222", ssh.display());
    let offset = free_offset(&ports).to_string();
    let mut extra = vec!["--ssh", &ssh_cmd, "--metrics-port-offset", &offset];
    extra.extend_from_slice(&SMALL);
    let (ok, out, err) = cluster("up", &settings, &run, &extra);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("4 services healthy"), "{out}");
    let calls = std::fs::read_to_string(tmp.path().join("ssh.log")).unwrap();
    assert!(
        calls
            .lines()
            .all(|l| l == "-p 2222 -o BatchMode=yes ubuntu@127.0.0.1 sh -s"),
        "{calls}"
    );
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("cluster.json")).unwrap()).unwrap();
    let names: Vec<&str> = state
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            assert_eq!(s["mode"], "remote", "{s}");
            assert_eq!(s["remote"]["host"], "127.0.0.1", "{s}");
            s["name"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        names,
        ["controller", "memserver-1", "memserver-2", "runtime-1"]
    );
    // The addresses are the settings' (metrics: port + offset).
    let off: u16 = offset.parse().unwrap();
    let runtime = &state[3]["addrs"];
    assert_eq!(runtime["runtime"], format!("127.0.0.1:{}", ports[4]));
    assert_eq!(runtime["metrics"], format!("127.0.0.1:{}", ports[4] + off));
    assert_eq!(
        state[0]["addrs"]["dispatcher"],
        format!("127.0.0.1:{}", ports[3])
    );
    let pids = recorded_pids(&run);
    assert!(pids.iter().all(|&p| running(p)));

    let (ok, out, err) = cluster("status", &settings, &run, &[]);
    assert!(ok, "{out}\n{err}");
    for name in ["controller", "memserver-1", "memserver-2", "runtime-1"] {
        let line = out.lines().find(|l| l.starts_with(name)).expect(name);
        assert!(
            line.contains(" healthy ") && line.contains("on ubuntu@127.0.0.1"),
            "{line}"
        );
    }
    let (ok, _, err) = cluster("up", &settings, &run, &extra);
    assert!(!ok && err.contains("still running"), "{err}");

    let (ok, out, err) = cluster("down", &settings, &run, &[]);
    assert!(ok, "{out}\n{err}");
    assert_eq!(
        out.lines().filter(|l| l.contains("stopped")).count(),
        4,
        "{out}"
    );
    assert!(pids.iter().all(|&p| !running(p)), "every process stopped");
    assert!(!run.join("cluster.json").exists());
}

#[test]
fn remote_mode_shows_the_remote_log_of_a_service_that_fails_and_stops_the_rest() {
    let _one = one_cluster_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let ports = free_ports(7);
    let settings = remote_copy(tmp.path(), &ports);
    let run = tmp.path().join("run");
    let _down = Down(run.clone());
    let ssh = fake_ssh(
        tmp.path(),
        "while [ \"$1\" = -o ]; do shift 2; done\nshift\nexec sh -c \"$*\"\n",
    );
    let offset = free_offset(&ports).to_string();
    // The second memory server's port is taken.
    let _taken = TcpListener::bind(("127.0.0.1", ports[2])).unwrap();
    let mut extra = vec![
        "--ssh",
        ssh.to_str().unwrap(),
        "--metrics-port-offset",
        &offset,
    ];
    extra.extend_from_slice(&SMALL);
    let (ok, out, err) = cluster("up", &settings, &run, &extra);
    assert!(!ok, "{out}");
    assert!(err.contains("stopped at memserver-2"), "{err}");
    assert!(
        err.contains("exited during start-up") && err.contains("cannot listen on"),
        "the remote log's end is shown: {err}"
    );
    let started: Vec<u32> = out
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2)?.parse().ok())
        .collect();
    assert_eq!(started.len(), 2, "{out}");
    assert!(started.iter().all(|&p| !running(p)));
    assert!(!run.join("cluster.json").exists());
}
