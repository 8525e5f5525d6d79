//! A multi-host cluster on one machine: five network namespaces
//! (controller, two memory servers, two GPU servers) joined by a bridge,
//! each running Debian's OpenSSH server; `distmind cluster up` in remote
//! mode reaches every host with the real ssh client, tiny models are
//! deployed and a short workload sent from the test's own namespace, then
//! `cluster status` and `cluster down`, also over ssh.
//!
//! Every ssh file is the test's own, in its temporary directory (whose name
//! has a blank, so every path crosses the remote shell quoted): a host key
//! per sshd, a client key, `authorized_keys`, `known_hosts` and a client
//! config (`StrictHostKeyChecking yes`, `BatchMode yes`) passed as
//! `--ssh "ssh -F '<config>'"`. Each sshd runs `-D -e -f <its config>`
//! (`UsePAM no`, its own pid file) and is stopped by its pid when the test
//! ends, pass or fail.
//!
//! Links (tests/support/netns.rs: a `tbf` qdisc on both ends of a host's
//! veth): ms1, ms2 and gpu1 at 10 Gbit/s, gpu2 at 500 Mbit/s (a slower GPU
//! server NIC, as in a mixed cluster); the controller's link is not
//! limited. Needs root, `ip`, `tc`, `/usr/sbin/sshd`, `ssh` and
//! `ssh-keygen`; otherwise it prints `skipped: <reason>` and passes. Run
//! with `cargo test --release --test netns -- --nocapture`.

mod support;

#[path = "support/netns.rs"]
mod netns;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use distmind_common::metrics::{parse_samples, scrape};

use serde_json::Value;
use support::*;

const METADATA_PORT: u16 = 7777;
const MEMSERVER_PORT: u16 = 7778;
const CLIENT_PORT: u16 = 9999;
const CACHE_PORT: u16 = 10009;
/// The ssh user (username.txt); the test runs as root.
const USER: &str = "root";

/// The shipped settings in `dir/settings`, made remote: the controller on
/// ctl, memory servers on ms1 and ms2, GPU servers on gpu1 and gpu2, ssh
/// user root, config.sh's addresses on ctl. Ports are fixed: every host
/// has its own network namespace.
fn remote_settings(dir: &Path, lab: &netns::Lab) -> PathBuf {
    let ctl = &lab.host("ctl").ip;
    copy_settings(dir, |name, text| {
        Some(match name {
            "storage_list.txt" => format!(
                "storage_address, storage_port\n{ctl}, {METADATA_PORT}\n{}, {MEMSERVER_PORT}\n{}, {MEMSERVER_PORT}\n",
                lab.host("ms1").ip,
                lab.host("ms2").ip
            ),
            "serverhost_list.txt" => format!(
                "{} slots=1\n{} slots=1\n",
                lab.host("gpu1").ip,
                lab.host("gpu2").ip
            ),
            "username.txt" => format!("{USER}\n"),
            "controller.json" | "mps_controller.json" => text.replace("127.0.0.1", ctl),
            "config.sh" => {
                let t = text
                    .replace("=127.0.0.1", &format!("={ctl}"))
                    .replace("MODE='local'", "MODE='remote'");
                assert!(t.contains("MODE='remote'"), "config.sh: {t}");
                t
            }
            _ => return None,
        })
    })
}

/// Stops the recorded cluster (over the recorded ssh), pass or fail; drops
/// before the sshds and the lab, so both still exist.
struct Down(PathBuf);

impl Drop for Down {
    fn drop(&mut self) {
        if self.0.join("cluster.json").exists() {
            let _ = distmind::cluster::down(&self.0);
        }
    }
}

fn running(pid: u32) -> bool {
    distmind::cluster::start_ticks(pid).is_some()
}

#[test]
fn a_remote_cluster_on_five_namespaces_serves_a_workload() {
    if let Err(why) = netns::can_run().and_then(|()| netns::can_run_sshd(USER)) {
        eprintln!("skipped: {why}");
        return;
    }
    let t0 = Instant::now();
    let lab = netns::Lab::new(&[
        ("ctl", None),
        ("ms1", Some("10gbit")),
        ("ms2", Some("10gbit")),
        ("gpu1", Some("10gbit")),
        ("gpu2", Some("500mbit")),
    ])
    .unwrap_or_else(|e| panic!("building the namespaces: {e}"));
    let qdisc = lab
        .exec("gpu2", &["tc", "qdisc", "show", "dev", "eth0"])
        .unwrap();
    assert!(
        qdisc.contains("tbf") && qdisc.contains("500Mbit"),
        "{qdisc}"
    );
    // A blank in every path: the remote scripts must quote them all.
    let tmp = tempfile::Builder::new()
        .prefix("distmind netns ")
        .tempdir()
        .unwrap();
    let settings = remote_settings(tmp.path(), &lab);
    let sshds = lab
        .start_sshds(&tmp.path().join("ssh"), USER)
        .unwrap_or_else(|e| panic!("starting sshd on every host: {e}"));
    let ssh = sshds.ssh_command();
    for h in &lab.hosts {
        assert_eq!(
            sshds.pid_file(&h.role).trim(),
            sshds.pid(&h.role).to_string(),
            "sshd on {} wrote its own pid file",
            h.role
        );
    }
    let run = tmp.path().join("run");
    let _down = Down(run.clone());
    let ctl = lab.host("ctl").ip.clone();
    let metadata = format!("{ctl}:{METADATA_PORT}");
    eprintln!(
        "lab {} on {}.0/24 with an sshd on every host ready after {:?}",
        lab.prefix,
        lab.net,
        t0.elapsed()
    );

    // A GPU server that cannot start (its --cache, quotes and blank
    // included, reaches it as given and is refused): `up` names it, shows
    // the end of its log on its host, and stops over ssh the three
    // services it had started.
    let bad = "12 parsecs'";
    let up_args = |cache: &'static str| {
        [
            "--ssh",
            ssh.as_str(),
            "--executor",
            "cpu",
            "--memserver-capacity",
            "64MiB",
            "--cache",
            cache,
        ]
    };
    let (ok, out, err) = cluster("up", &settings, &run, &up_args(bad));
    assert!(!ok, "{out}\n{err}");
    assert!(
        err.contains(&format!("runtime-1 on {} (pid ", lab.host("gpu1").ip))
            && err.contains("exited during start-up")
            && err.contains(&format!("invalid size \"{bad}\""))
            && err.contains("the services started before it were stopped again"),
        "{err}"
    );
    let started: Vec<u32> = out
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2)?.parse().ok())
        .collect();
    assert_eq!(started.len(), 3, "controller and memory servers: {out}");
    assert!(started.iter().all(|&p| !running(p)), "{out}");
    assert!(!run.join("cluster.json").exists());
    eprintln!(
        "a GPU server that cannot start, handled after {:?}",
        t0.elapsed()
    );

    let (ok, out, err) = cluster("up", &settings, &run, &up_args("128MiB"));
    eprintln!("{out}{err}");
    assert!(ok, "cluster up failed:\n{out}\n{err}");
    assert!(out.contains("5 services healthy"), "{out}");
    eprintln!("cluster up after {:?}", t0.elapsed());
    // Every host let the test's client key in, and nothing else.
    for h in &lab.hosts {
        let log = sshds.log(&h.role);
        assert!(
            log.contains(&format!(
                "Accepted publickey for {USER} from {} ",
                lab.root_ip
            )),
            "sshd on {}:\n{log}",
            h.role
        );
        assert!(
            // `Accepted <method> for <user> from ...`, one per login.
            log.lines()
                .filter(|l| l.starts_with("Accepted ") && l.contains(" for "))
                .all(|l| l.starts_with("Accepted publickey for ")),
            "sshd on {}:\n{log}",
            h.role
        );
    }

    // cluster.json: mode, host and pid of every service, each on its own host.
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("cluster.json")).unwrap()).unwrap();
    let services = state.as_array().unwrap();
    let expect = [
        ("controller", "ctl"),
        ("memserver-1", "ms1"),
        ("memserver-2", "ms2"),
        ("runtime-1", "gpu1"),
        ("runtime-2", "gpu2"),
    ];
    assert_eq!(services.len(), expect.len(), "{state}");
    let mut pids = Vec::new();
    for (s, (name, role)) in services.iter().zip(expect) {
        assert_eq!(s["name"], name, "{s}");
        assert_eq!(s["mode"], "remote", "{s}");
        assert_eq!(s["remote"]["host"], lab.host(role).ip.as_str(), "{s}");
        let pid = s["pid"].as_u64().unwrap() as u32;
        assert!(running(pid), "{name} pid {pid}");
        // It runs inside its host's namespace.
        let in_ns = std::process::Command::new("ip")
            .args(["netns", "pids", &lab.host(role).ns])
            .output()
            .unwrap();
        let in_ns = String::from_utf8_lossy(&in_ns.stdout);
        assert!(
            in_ns.split_whitespace().any(|p| p == pid.to_string()),
            "{name} (pid {pid}) not in {}: {in_ns}",
            lab.host(role).ns
        );
        // Started by that host's sshd: sshd put the connection into its
        // environment, with the host's own address at port 22.
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let env = String::from_utf8_lossy(&env);
        let conn = env
            .split('\0')
            .find_map(|v| v.strip_prefix("SSH_CONNECTION="))
            .unwrap_or_else(|| panic!("{name} (pid {pid}) was not started over ssh"));
        let conn: Vec<&str> = conn.split(' ').collect();
        assert_eq!(
            (conn[0], conn[2], conn[3]),
            (lab.root_ip.as_str(), lab.host(role).ip.as_str(), "22"),
            "{name}: SSH_CONNECTION"
        );
        pids.push(pid);
    }

    // A second `up` finds the recorded services alive, over ssh, and starts
    // nothing.
    let (ok, out, err) = cluster("up", &settings, &run, &["--ssh", &ssh]);
    assert!(!ok && err.contains("is still running"), "{out}\n{err}");

    let (ok, out, err) = cluster("status", &settings, &run, &[]);
    assert!(ok, "{out}\n{err}");
    for (name, role) in expect {
        let line = out.lines().find(|l| l.starts_with(name)).expect(name);
        assert!(line.contains(" healthy "), "{line}");
        assert!(
            line.contains(&format!("root@{}", lab.host(role).ip)),
            "{line}"
        );
    }
    eprintln!("{out}");

    // Both memory servers and both GPU servers registered, at their
    // namespace addresses (reached from here over the bridge).
    wait_alive(&metadata, 2);
    for role in ["gpu1", "gpu2"] {
        let r = wait_runtime_alive(&metadata, &format!("{}:{CACHE_PORT}", lab.host(role).ip));
        assert_eq!(r.devices, 1);
    }

    // Tiny models, deployed from this namespace.
    let models = tmp.path().join("models");
    let mut pkgs = gen_tiny(&models, "resnet152", 2, 65536);
    pkgs.extend(gen_tiny(&models, "bert_base", 2, 65536));
    let mut args = vec![
        "deploy",
        "--quiet",
        "--settings",
        settings.to_str().unwrap(),
        "--controller",
        &metadata,
    ];
    args.extend(pkgs.iter().map(|p| p.to_str().unwrap()));
    let (ok, out, err) = support::run(&args);
    assert!(ok, "deploy failed:\n{out}\n{err}");
    eprintln!("deployed {} models after {:?}", pkgs.len(), t0.elapsed());

    // A short closed-loop workload at the dispatcher on ctl.
    let json = tmp.path().join("report.json");
    let client_addr = format!("{ctl}:{CLIENT_PORT}");
    let (ok, out, err) = support::run(&[
        "client",
        "--settings",
        settings.to_str().unwrap(),
        "--addr",
        &client_addr,
        "--controller",
        &metadata,
        "--mode",
        "closed",
        "--concurrency",
        "2",
        "--requests",
        "10",
        "--slo-ms",
        "10000",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(ok, "client failed:\n{out}\n{err}");
    let report: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["sent"].as_u64(), Some(20), "{report}");
    assert_eq!(
        report["ok"].as_u64(),
        Some(20),
        "every request succeeded: {report}"
    );
    eprintln!("workload done after {:?}", t0.elapsed());
    // The GPU servers' own counters (scraped over the bridge) add up.
    let mut served = Vec::new();
    for role in ["gpu1", "gpu2"] {
        let addr = format!("{}:{}", lab.host(role).ip, CACHE_PORT + 1000);
        let (status, text) = scrape(&addr, "/metrics", Duration::from_secs(5)).unwrap();
        assert_eq!(status, 200, "{role} /metrics");
        let n: f64 = parse_samples(&text)
            .iter()
            .filter(|(series, _)| series.starts_with("distmind_runtime_requests_total{"))
            .map(|(_, v)| v)
            .sum();
        served.push((role, n));
    }
    eprintln!("requests served per GPU server: {served:?}");
    assert_eq!(
        served.iter().map(|(_, n)| n).sum::<f64>(),
        20.0,
        "{served:?}"
    );

    // Hosts that cannot be reached (no sshd on that port): status and
    // down say so, naming ssh's failure, and stop nothing; the cluster
    // stays recorded.
    let wrong = format!("{ssh} -p 2222");
    let (ok, out, err) = cluster("status", &settings, &run, &["--ssh", &wrong]);
    assert!(!ok, "{out}\n{err}");
    assert_eq!(
        out.lines().filter(|l| l.contains(" unknown ")).count(),
        5,
        "{out}"
    );
    assert!(
        out.contains("exit 255") && out.contains("Connection refused"),
        "{out}"
    );
    let (ok, out, err) = cluster("down", &settings, &run, &["--ssh", &wrong]);
    assert!(!ok && err.contains("not stopped"), "{out}\n{err}");
    assert_eq!(
        out.lines().filter(|l| l.contains("NOT stopped")).count(),
        5,
        "{out}"
    );
    assert!(pids.iter().all(|&p| running(p)), "nothing stopped");
    assert!(run.join("cluster.json").exists());

    // The recorded ssh command stops them.
    let (ok, out, err) = cluster("down", &settings, &run, &[]);
    assert!(ok, "{out}\n{err}");
    eprintln!("{out}");
    assert_eq!(
        out.lines().filter(|l| l.contains("stopped")).count(),
        5,
        "{out}"
    );
    assert!(pids.iter().all(|&p| !running(p)), "every process stopped");
    assert!(!run.join("cluster.json").exists());
    eprintln!("cluster down after {:?}", t0.elapsed());
}
