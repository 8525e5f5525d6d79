//! `distmind cluster up|down|status`: a cluster from `settings/`, left
//! running in the background.
//!
//! `MODE='local'` (config.sh) starts every service on this host, detached
//! (its own process group, stdin closed, stdout and stderr into the run
//! directory): the controller on the metadata endpoint, one memory server
//! per `storage_list.txt` line, one GPU server on the cache port. Each is
//! ready when it printed its `listening on` lines and its `/health`
//! answers 200 (never a fixed sleep); a service that does not get there
//! stops the bring-up, and everything started so far is stopped again.
//!
//! The run directory (default `<repository>/run`) holds `cluster.json`: name,
//! pid, the pid's start time (so a reused pid is never signalled), addresses
//! and metrics address of every service started. `down` stops exactly
//! those (SIGTERM, a grace period, SIGKILL), last started first; `status`
//! prints each one's pid, addresses and health.
//!
//! `MODE='remote'` (ssh to the hosts of `storage_list.txt` and
//! `serverhost_list.txt`) is refused with a clear message for now.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use distmind_common::settings::{Mode, Settings};
use serde::{Deserialize, Serialize};

/// How long one service may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a service may take to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);
/// The state file in the run directory.
const STATE_FILE: &str = "cluster.json";
/// Bytes of a service's log shown when it fails.
const LOG_TAIL_BYTES: u64 = 4096;

#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Start the cluster `settings/` describes and return once every service is healthy.
    Up(UpArgs),
    /// Stop exactly the processes `cluster up` started (from the run directory's cluster.json).
    Down(CommonArgs),
    /// Each started process: pid, addresses, health.
    Status(CommonArgs),
}

#[derive(Args, Debug)]
pub struct CommonArgs {
    /// Settings directory.
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// Where pids, logs and cluster.json go (default: <repository>/run, next to settings/).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Executor of the GPU server: cpu, sim or cuda.
    #[arg(long, default_value = "cpu")]
    pub executor: String,
    /// Arena of each memory server.
    #[arg(long, default_value = "1GiB")]
    pub memserver_capacity: String,
    /// Host cache of the GPU server.
    #[arg(long, default_value = "4GiB")]
    pub cache: String,
    /// `DISTMIND_LOG` of the services.
    #[arg(long, default_value = "info")]
    pub service_log: String,
}

/// One started service, as `cluster.json` records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Started {
    pub name: String,
    pub pid: u32,
    /// Field 22 of `/proc/<pid>/stat` at start: identifies the process, not just the pid.
    pub start_ticks: u64,
    /// Label -> address, from its `<label> listening on <addr>` lines.
    pub addrs: BTreeMap<String, String>,
    pub log: PathBuf,
}

impl Started {
    fn metrics(&self) -> Option<&str> {
        self.addrs.get("metrics").map(String::as_str)
    }

    /// Whether the recorded process still runs (same pid, same start time).
    pub fn alive(&self) -> bool {
        start_ticks(self.pid).is_some_and(|t| t == self.start_ticks)
    }
}

pub fn run(cmd: &ClusterCommand) -> anyhow::Result<()> {
    match cmd {
        ClusterCommand::Up(a) => up(a),
        ClusterCommand::Down(a) => {
            let dir = run_dir(a)?;
            let stopped = down(&dir)?;
            if stopped.is_empty() {
                println!("no cluster recorded in {}", dir.display());
            }
            for (name, pid, what) in stopped {
                println!("{name:<12} pid {pid:<8} {what}");
            }
            Ok(())
        }
        ClusterCommand::Status(a) => {
            let dir = run_dir(a)?;
            let state = load_state(&dir)?;
            if state.is_empty() {
                println!("no cluster recorded in {}", dir.display());
                return Ok(());
            }
            let mut all_ok = true;
            for s in &state {
                let health = health(s);
                all_ok &= health == "healthy";
                let addrs: Vec<String> = s
                    .addrs
                    .iter()
                    .filter(|(k, _)| k.as_str() != "metrics")
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                println!(
                    "{:<12} pid {:<8} {:<10} {} (metrics {})",
                    s.name,
                    s.pid,
                    health,
                    addrs.join(", "),
                    s.metrics().unwrap_or("-")
                );
            }
            if !all_ok {
                bail!("not every service is healthy (logs in {})", dir.display());
            }
            Ok(())
        }
    }
}

fn settings(a: &CommonArgs) -> anyhow::Result<Settings> {
    Settings::load(&a.settings).map_err(anyhow::Error::from)
}

fn run_dir(a: &CommonArgs) -> anyhow::Result<PathBuf> {
    Ok(match &a.run_dir {
        Some(d) => d.clone(),
        None => settings(a)?.root().join("run"),
    })
}

fn health(s: &Started) -> &'static str {
    if !s.alive() {
        return "dead";
    }
    match s
        .metrics()
        .map(|m| distmind_common::metrics::scrape(m, "/health", Duration::from_secs(2)))
    {
        Some(Ok((200, _))) => "healthy",
        Some(_) => "unhealthy",
        None => "running",
    }
}

fn up(a: &UpArgs) -> anyhow::Result<()> {
    let settings = settings(&a.common)?;
    if settings.config.mode != Mode::Local {
        bail!(
            "MODE={:?} in {}: `cluster up` starts local clusters only so far (MODE='local'); on \
             remote hosts start `distmind memserver` and `distmind runtime` by hand",
            settings.config.mode,
            settings.dir.join("config.sh").display()
        );
    }
    let dir = run_dir(&a.common)?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let running: Vec<Started> = load_state(&dir)?
        .into_iter()
        .filter(Started::alive)
        .collect();
    if !running.is_empty() {
        let pids: Vec<String> = running
            .iter()
            .map(|s| format!("{} {}", s.name, s.pid))
            .collect();
        bail!(
            "a cluster from {} is still running ({}): `distmind cluster down` first",
            dir.display(),
            pids.join(", ")
        );
    }
    let exe = std::env::current_exe().context("locating the distmind binary")?;
    let s = a.common.settings.to_string_lossy().into_owned();
    let mut plan: Vec<(String, Vec<String>, Vec<&str>)> = vec![(
        "controller".into(),
        args(&["controller", "--settings", &s, "--metrics", "127.0.0.1:0"]),
        vec!["controller", "dispatcher", "metrics"],
    )];
    for (i, m) in settings.memservers().iter().enumerate() {
        let listen = m.socket_addr().with_context(|| {
            format!("memory server {m} of storage_list.txt: local mode needs an IP address")
        })?;
        plan.push((
            format!("memserver-{}", i + 1),
            args(&[
                "memserver",
                "--settings",
                &s,
                "--listen",
                &listen.to_string(),
                "--capacity",
                &a.memserver_capacity,
                "--metrics",
                "127.0.0.1:0",
            ]),
            vec!["memserver", "metrics"],
        ));
    }
    plan.push((
        "runtime".into(),
        args(&[
            "runtime",
            "--settings",
            &s,
            "--executor",
            &a.executor,
            "--cache",
            &a.cache,
            "--metrics",
            "127.0.0.1:0",
        ]),
        vec!["runtime", "metrics"],
    ));
    let mut state: Vec<Started> = Vec::new();
    for (name, argv, labels) in &plan {
        match start(&exe, &dir, name, argv, labels, &a.service_log) {
            Ok(started) => {
                let what: Vec<String> = started
                    .addrs
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                println!("{name:<12} pid {:<8} {}", started.pid, what.join(", "));
                state.push(started);
                save_state(&dir, &state)?;
            }
            Err(e) => {
                save_state(&dir, &state)?;
                let _ = down(&dir);
                return Err(e.context(format!(
                    "cluster up stopped at {name}; the services started before it were stopped again"
                )));
            }
        }
    }
    println!(
        "cluster up: {} services healthy; `distmind cluster status` / `distmind cluster down` (state in {})",
        state.len(),
        dir.display()
    );
    Ok(())
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// Starts one detached service and waits until it printed every label of
/// `labels` and its health endpoint answers 200.
fn start(
    exe: &Path,
    dir: &Path,
    name: &str,
    argv: &[String],
    labels: &[&str],
    log_level: &str,
) -> anyhow::Result<Started> {
    let out_path = dir.join(format!("{name}.out"));
    let log = dir.join(format!("{name}.log"));
    let out =
        File::create(&out_path).with_context(|| format!("creating {}", out_path.display()))?;
    let err = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut child = Command::new(exe)
        .args(argv)
        .env("DISTMIND_LOG", log_level)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        // Its own process group: a Ctrl-C at this terminal does not reach it.
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {name} ({})", exe.display()))?;
    let pid = child.id();
    let ticks = start_ticks(pid).unwrap_or(0);
    let mut started = Started {
        name: name.to_string(),
        pid,
        start_ticks: ticks,
        addrs: BTreeMap::new(),
        log: log.clone(),
    };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            bail!(
                "{name} exited during start-up ({status}); the end of {}:\n{}",
                log.display(),
                tail(&log)
            );
        }
        let text = std::fs::read_to_string(&out_path).unwrap_or_default();
        for line in text.lines() {
            if let Some((label, addr)) = crate::up::procs::parse_ready_line(line) {
                started.addrs.insert(label.to_string(), addr.to_string());
            }
        }
        let printed = labels.iter().all(|l| started.addrs.contains_key(*l));
        if printed && health(&started) == "healthy" {
            return Ok(started);
        }
        if Instant::now() >= deadline {
            stop(&started);
            bail!(
                "{name} was not healthy after {:?} (ready lines seen: {:?}); the end of {}:\n{}",
                READY_TIMEOUT,
                started.addrs.keys().collect::<Vec<_>>(),
                log.display(),
                tail(&log)
            );
        }
        std::thread::sleep(POLL);
    }
}

/// Stops every recorded service, last started first, and removes the state.
pub fn down(dir: &Path) -> anyhow::Result<Vec<(String, u32, String)>> {
    let state = load_state(dir)?;
    let done = state
        .iter()
        .rev()
        .map(|s| (s.name.clone(), s.pid, stop(s)))
        .collect();
    let path = dir.join(STATE_FILE);
    if path.exists() {
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    }
    Ok(done)
}

/// SIGTERM, up to [`STOP_GRACE`], then SIGKILL; only if the pid is still
/// the process that was started.
fn stop(s: &Started) -> String {
    if !s.alive() {
        return "not running".into();
    }
    let termed = signal(s.pid, "TERM");
    let deadline = Instant::now() + STOP_GRACE;
    while termed && Instant::now() < deadline {
        if !s.alive() {
            return "stopped".into();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if s.alive() {
        signal(s.pid, "KILL");
        let deadline = Instant::now() + Duration::from_secs(5);
        while s.alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        return format!("killed with SIGKILL after {} s", STOP_GRACE.as_secs());
    }
    "stopped".into()
}

/// Sends a signal by pid with `kill(1)` (this crate forbids `unsafe`).
fn signal(pid: u32, sig: &str) -> bool {
    Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Field 22 of `/proc/<pid>/stat` (start time in clock ticks); `None` when
/// there is no such process or it is a zombie.
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain blanks.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    // `rest` starts at field 3; field 22 is the 20th from here.
    fields.nth(18)?.parse().ok()
}

fn load_state(dir: &Path) -> anyhow::Result<Vec<Started>> {
    let path = dir.join(STATE_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .with_context(|| format!("{} is not a cluster state file", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

fn save_state(dir: &Path, state: &[Started]) -> anyhow::Result<()> {
    let path = dir.join(STATE_FILE);
    let tmp = dir.join(format!("{STATE_FILE}.tmp"));
    std::fs::write(&tmp, serde_json::to_string_pretty(state)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))
}

/// The last [`LOG_TAIL_BYTES`] of a log, indented.
fn tail(path: &Path) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let from = text.len().saturating_sub(LOG_TAIL_BYTES as usize);
    String::from_utf8_lossy(&text[from..])
        .lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_a_start_time_and_a_dead_pid_none() {
        let me = std::process::id();
        let t = start_ticks(me).expect("our own stat");
        assert_eq!(start_ticks(me), Some(t), "stable");
        assert_eq!(start_ticks(u32::MAX - 1), None);
        let s = Started {
            name: "x".into(),
            pid: me,
            start_ticks: t + 1,
            addrs: BTreeMap::new(),
            log: PathBuf::new(),
        };
        assert!(!s.alive(), "same pid, other start time: another process");
    }

    #[test]
    fn state_round_trips_and_a_bad_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load_state(dir.path()).unwrap().is_empty());
        let s = vec![Started {
            name: "memserver-1".into(),
            pid: 42,
            start_ticks: 7,
            addrs: BTreeMap::from([("memserver".into(), "127.0.0.1:7778".into())]),
            log: dir.path().join("memserver-1.log"),
        }];
        save_state(dir.path(), &s).unwrap();
        assert_eq!(load_state(dir.path()).unwrap(), s);
        std::fs::write(dir.path().join(STATE_FILE), "{").unwrap();
        let e = format!("{:#}", load_state(dir.path()).unwrap_err());
        assert!(
            e.contains("cluster.json is not a cluster state file"),
            "{e}"
        );
    }
}
