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
//! `MODE='remote'` starts the same services on other hosts over ssh, as the
//! user of `username.txt`: the controller on the metadata host (first line
//! of `storage_list.txt`), each memory server on its `storage_list.txt`
//! host, one GPU server per `serverhost_list.txt` host (`slots` devices).
//! Every host runs the same binary path (this one's) with the same settings
//! directory path, from the settings' parent, its output and log in the
//! same run directory path on that host (`nohup`, stdin from /dev/null);
//! ssh is invoked as `<--ssh...> -o BatchMode=yes <user>@<host> sh -s`,
//! the script (every argument in it single-quoted) on its stdin. Addresses
//! are explicit (see `plan`): metrics on the service's port +
//! `--metrics-port-offset`.
//! Readiness is the same rule, checked over the network (`/health`) plus
//! the ready lines read back over ssh; a service that fails shows the tail
//! of its remote log (`tail -c 4096`).
//!
//! The run directory (default `<repository>/run`) holds `cluster.json`: name,
//! mode, host (remote), pid, the pid's start time (so a reused pid is never
//! signalled), addresses and metrics address of every service started.
//! `down` stops exactly those (SIGTERM, a grace period polling, SIGKILL;
//! over ssh in remote mode), last started first; `status` prints each one's
//! pid, host, addresses and health.

mod plan;
mod remote;

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

use plan::Planned;
use remote::Target;

/// How long a service may take to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);
/// Remote mode: how often a starting service's pid is checked over ssh.
const REMOTE_ALIVE_EVERY: Duration = Duration::from_secs(1);
/// The state file in the run directory.
const STATE_FILE: &str = "cluster.json";
/// Bytes of a service's log shown when it fails.
const LOG_TAIL_BYTES: u64 = 4096;

#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Start the cluster `settings/` describes and return once every service is healthy.
    ///
    /// MODE='local' (config.sh): every service on this host. MODE='remote': over ssh as the user
    /// of username.txt, the controller on the metadata host (first line of storage_list.txt), a
    /// memory server on each later storage_list.txt line, a GPU server (`distmind runtime`,
    /// `slots` devices) on each serverhost_list.txt host, listening on
    /// `<host>:GLOBAL_CAHCE_PORT_FOR_SERVER`; the dispatcher on
    /// `<metadata host>:GLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT`. Every host needs this binary and the
    /// settings directory at the same paths as here (the run directory path is created there).
    /// Metrics (/health, /metrics) listen on each service's port + --metrics-port-offset.
    Up(UpArgs),
    /// Stop exactly the processes `cluster up` started (from the run directory's cluster.json).
    ///
    /// By recorded pid (and the pid's start time), never by name: SIGTERM, up to 10 s, SIGKILL;
    /// last started first. Remote services are stopped over ssh with `kill` on their host;
    /// services whose host cannot be reached stay in cluster.json (and the command fails) so a
    /// later `down` can retry.
    Down(CommonArgs),
    /// Each started process: host, pid, addresses, health (/health over the network).
    Status(CommonArgs),
}

#[derive(Args, Debug)]
pub struct CommonArgs {
    /// Settings directory.
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// Where pids, logs and cluster.json go (default: `<repository>/run`, next to settings/). In
    /// remote mode the same path holds each host's logs on that host.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Remote mode: the ssh command with its options (port, identity file, config file), split
    /// like a shell splits it, quotes keeping a path with blanks whole: e.g. "ssh -p 2222 -i
    /// key" or "ssh -F '/etc/distmind/ssh config'". Run as `<ssh...> -o BatchMode=yes
    /// <user>@<host> sh -s` (the script on stdin), so it never waits for a password and works
    /// whatever the user's login shell. Default: `ssh` for `up`; for `status` and `down`, the
    /// command `up` used (recorded in cluster.json).
    #[arg(long)]
    pub ssh: Option<String>,
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
    /// Host cache of the GPU server (of each, in remote mode).
    #[arg(long, default_value = "4GiB")]
    pub cache: String,
    /// `DISTMIND_LOG` of the services.
    #[arg(long, default_value = "info")]
    pub service_log: String,
    /// Remote mode: each service's metrics endpoint (/health, /metrics) listens on its own host
    /// at its port + this offset: controller metadata port + N, memory server port + N, GPU
    /// server GLOBAL_CAHCE_PORT_FOR_SERVER + N. (Local mode: ephemeral loopback ports.)
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u16).range(1..))]
    pub metrics_port_offset: u16,
    /// Seconds one service may take to become healthy.
    #[arg(long, default_value_t = 60)]
    pub ready_timeout: u64,
    /// Every service gets the same emulation (needs --executor sim). Without
    /// --emulate-loopback and an `emulate` section in transport.json, local mode measures this
    /// machine's loopback and picks the bucket rate.
    #[command(flatten)]
    pub emulate: crate::emulate::EmulateArgs,
}

/// Where a service runs.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RunMode {
    /// This host: signals and `/proc` directly.
    #[default]
    Local,
    /// Another host, over ssh.
    Remote,
}

/// How a remote service is reached again.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RemoteHost {
    pub host: String,
    pub user: String,
    /// The ssh command `up` used, one argument per element.
    pub ssh: Vec<String>,
}

/// One started service, as `cluster.json` records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Started {
    pub name: String,
    #[serde(default)]
    pub mode: RunMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteHost>,
    pub pid: u32,
    /// Field 22 of `/proc/<pid>/stat` at start: identifies the process, not just the pid
    /// (0: unknown, the pid alone is checked).
    pub start_ticks: u64,
    /// Label -> address, from its `<label> listening on <addr>` lines (remote: the addresses
    /// others reach it at).
    pub addrs: BTreeMap<String, String>,
    /// Its stderr (on its host).
    pub log: PathBuf,
}

/// Whether a recorded process runs.
#[derive(Debug, Clone, PartialEq)]
enum Live {
    Yes,
    No,
    /// Its host could not be asked (ssh failed).
    Unknown(String),
}

impl Started {
    fn metrics(&self) -> Option<&str> {
        self.addrs.get("metrics").map(String::as_str)
    }

    /// Whether the recorded process still runs (same pid, same start
    /// time); over ssh for a remote one (false when its host cannot be
    /// asked).
    pub fn alive(&self) -> bool {
        self.liveness(None) == Live::Yes
    }

    /// The ssh target of a remote service; `ssh` overrides the recorded command.
    fn target<'a>(&'a self, ssh: Option<&'a [String]>) -> Option<Target<'a>> {
        self.remote.as_ref().map(|r| Target {
            ssh: ssh.unwrap_or(&r.ssh),
            user: &r.user,
            host: &r.host,
        })
    }

    fn liveness(&self, ssh: Option<&[String]>) -> Live {
        match self.target(ssh) {
            None => {
                let up = start_ticks(self.pid)
                    .is_some_and(|t| self.start_ticks == 0 || t == self.start_ticks);
                if up {
                    Live::Yes
                } else {
                    Live::No
                }
            }
            Some(t) => match t.alive(self.pid, self.start_ticks) {
                Ok(true) => Live::Yes,
                Ok(false) => Live::No,
                Err(e) => Live::Unknown(format!("{e:#}")),
            },
        }
    }

    /// ` on user@host` for remote services, else nothing.
    fn on(&self) -> String {
        self.remote
            .as_ref()
            .map(|r| format!(" on {}@{}", r.user, r.host))
            .unwrap_or_default()
    }
}

pub fn run(cmd: &ClusterCommand) -> anyhow::Result<()> {
    match cmd {
        ClusterCommand::Up(a) => up(a),
        ClusterCommand::Down(a) => {
            let dir = run_dir(a)?;
            let ssh = a.ssh.as_deref().map(remote::parse_ssh).transpose()?;
            let stopped = down_with(&dir, ssh.as_deref())?;
            if stopped.is_empty() {
                println!("no cluster recorded in {}", dir.display());
            }
            let mut failed = Vec::new();
            for (name, pid, what) in stopped {
                if what.starts_with("NOT stopped") {
                    failed.push(name.clone());
                }
                println!("{name:<12} pid {pid:<8} {what}");
            }
            if !failed.is_empty() {
                bail!(
                    "{} not stopped (host not reachable?); they stay in {}: run `distmind cluster \
                     down` again",
                    failed.join(", "),
                    dir.join(STATE_FILE).display()
                );
            }
            Ok(())
        }
        ClusterCommand::Status(a) => {
            let dir = run_dir(a)?;
            let ssh = a.ssh.as_deref().map(remote::parse_ssh).transpose()?;
            let state = load_state(&dir)?;
            if state.is_empty() {
                println!("no cluster recorded in {}", dir.display());
                return Ok(());
            }
            let mut all_ok = true;
            for s in &state {
                let (health, why) = health(s, ssh.as_deref());
                all_ok &= health == "healthy";
                let addrs: Vec<String> = s
                    .addrs
                    .iter()
                    .filter(|(k, _)| k.as_str() != "metrics")
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                println!(
                    "{:<12} pid {:<8} {:<10} {} (metrics {}){}",
                    s.name,
                    s.pid,
                    health,
                    addrs.join(", "),
                    s.metrics().unwrap_or("-"),
                    s.on()
                );
                if let Some(why) = why {
                    println!("    {why}");
                }
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

/// `healthy`, `unhealthy`, `running` (no metrics endpoint), `dead` or
/// `unknown` (host not reachable, with the reason).
fn health(s: &Started, ssh: Option<&[String]>) -> (&'static str, Option<String>) {
    match s.liveness(ssh) {
        Live::No => return ("dead", None),
        Live::Unknown(e) => return ("unknown", Some(e)),
        Live::Yes => {}
    }
    (metrics_health(s.metrics()), None)
}

fn metrics_health(metrics: Option<&str>) -> &'static str {
    match metrics.map(|m| distmind_common::metrics::scrape(m, "/health", Duration::from_secs(2))) {
        Some(Ok((200, _))) => "healthy",
        Some(_) => "unhealthy",
        None => "running",
    }
}

/// Remote mode's fixed parts.
struct RemoteCtx {
    ssh: Vec<String>,
    user: String,
    /// The settings directory's parent: services start there.
    root: PathBuf,
}

fn up(a: &UpArgs) -> anyhow::Result<()> {
    let settings = settings(&a.common)?;
    let remote = match settings.config.mode {
        Mode::Local => None,
        Mode::Remote => {
            let user = settings.require_username()?.to_string();
            let ssh = remote::parse_ssh(a.common.ssh.as_deref().unwrap_or("ssh"))?;
            let root = settings.root().to_path_buf();
            Some(RemoteCtx { ssh, user, root })
        }
    };
    let dir = run_dir(&a.common)?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut running = Vec::new();
    for s in load_state(&dir)? {
        match s.liveness(None) {
            Live::No => {}
            Live::Yes => running.push(format!("{} {}{}", s.name, s.pid, s.on())),
            Live::Unknown(e) => {
                running.push(format!("{} {}{} (unknown: {e})", s.name, s.pid, s.on()))
            }
        }
    }
    if !running.is_empty() {
        bail!(
            "a cluster from {} is still running ({}): `distmind cluster down` first",
            dir.display(),
            running.join(", ")
        );
    }
    let exe = std::env::current_exe().context("locating the distmind binary")?;
    let (plan, dir) = match &remote {
        None => {
            let settings_arg = a.common.settings.to_string_lossy();
            (plan::plan(&settings, a, &settings_arg, None)?, dir)
        }
        Some(_) => {
            // The same absolute paths on every host.
            let abs = a
                .common
                .settings
                .canonicalize()
                .with_context(|| format!("resolving {}", a.common.settings.display()))?;
            let dir = dir
                .canonicalize()
                .with_context(|| format!("resolving {}", dir.display()))?;
            let lb = &settings.config.load_balancer_ip;
            let meta = settings.metadata_endpoint();
            if *lb != meta.host {
                eprintln!(
                    "note: the dispatcher runs on the metadata host {}, but config.sh's \
                     GLOBAL_LOAD_BALANCER_IP is {lb} (where `distmind client` sends by default)",
                    meta.host
                );
            }
            let offset = Some(a.metrics_port_offset);
            (
                plan::plan(&settings, a, &abs.to_string_lossy(), offset)?,
                dir,
            )
        }
    };
    up_services(a, &exe, &dir, &plan, remote.as_ref())
}

fn up_services(
    a: &UpArgs,
    exe: &Path,
    dir: &Path,
    plan: &[Planned],
    remote: Option<&RemoteCtx>,
) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(a.ready_timeout);
    let mut state: Vec<Started> = Vec::new();
    for p in plan {
        let name = &p.name;
        let result = match (remote, &p.host) {
            (Some(r), Some(host)) => start_remote(r, host, exe, dir, p, &a.service_log, timeout),
            _ => start(exe, dir, name, &p.argv, &p.labels, &a.service_log, timeout),
        };
        match result {
            Ok(started) => {
                let what: Vec<String> = started
                    .addrs
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                println!(
                    "{name:<12} pid {:<8} {}{}",
                    started.pid,
                    what.join(", "),
                    started.on()
                );
                state.push(started);
                save_state(dir, &state)?;
            }
            Err(e) => {
                save_state(dir, &state)?;
                let _ = down(dir);
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

/// Starts one detached service and waits until it printed every label of
/// `labels` and its health endpoint answers 200.
fn start(
    exe: &Path,
    dir: &Path,
    name: &str,
    argv: &[String],
    labels: &[&str],
    log_level: &str,
    timeout: Duration,
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
        mode: RunMode::Local,
        remote: None,
        pid,
        start_ticks: ticks,
        addrs: BTreeMap::new(),
        log: log.clone(),
    };
    let deadline = Instant::now() + timeout;
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
        if printed && metrics_health(started.metrics()) == "healthy" {
            return Ok(started);
        }
        if Instant::now() >= deadline {
            stop(&started, None);
            bail!(
                "{name} was not healthy after {:?} (ready lines seen: {:?}); the end of {}:\n{}",
                timeout,
                started.addrs.keys().collect::<Vec<_>>(),
                log.display(),
                tail(&log)
            );
        }
        std::thread::sleep(POLL);
    }
}

/// Starts one service on its host over ssh and waits until its `/health`
/// answers 200 over the network and its output shows every ready line.
fn start_remote(
    r: &RemoteCtx,
    host: &str,
    exe: &Path,
    dir: &Path,
    p: &Planned,
    log_level: &str,
    timeout: Duration,
) -> anyhow::Result<Started> {
    let name = &p.name;
    let out = dir.join(format!("{name}.out"));
    let log = dir.join(format!("{name}.log"));
    let t = Target {
        ssh: &r.ssh,
        user: &r.user,
        host,
    };
    let (pid, ticks) = t
        .start(
            &r.root,
            exe,
            &p.argv,
            &[("DISTMIND_LOG", log_level)],
            &out,
            &log,
        )
        .with_context(|| format!("starting {name} on {host}"))?;
    let started = Started {
        name: name.clone(),
        mode: RunMode::Remote,
        remote: Some(RemoteHost {
            host: host.to_string(),
            user: r.user.clone(),
            ssh: r.ssh.clone(),
        }),
        pid,
        start_ticks: ticks,
        addrs: p.addrs.clone(),
        log: log.clone(),
    };
    let fail = |why: String| -> anyhow::Error {
        let stopped = stop(&started, None);
        anyhow::anyhow!(
            "{name} on {host} (pid {pid}) {why} ({stopped}); the end of {} on {host}:\n{}",
            log.display(),
            t.tail(&log, LOG_TAIL_BYTES)
        )
    };
    let deadline = Instant::now() + timeout;
    let mut next_alive_check = Instant::now() + REMOTE_ALIVE_EVERY;
    loop {
        if metrics_health(started.metrics()) == "healthy" {
            let text = t
                .read(&out)
                .with_context(|| format!("reading {name}'s output on {host}"))?;
            let printed: Vec<&str> = text
                .lines()
                .filter_map(|l| crate::up::procs::parse_ready_line(l).map(|(label, _)| label))
                .collect();
            if p.labels.iter().all(|l| printed.contains(l)) {
                return Ok(started);
            }
        }
        if Instant::now() >= next_alive_check {
            match t.alive(pid, ticks) {
                Ok(true) => {}
                Ok(false) => return Err(fail("exited during start-up".into())),
                Err(e) => return Err(fail(format!("could not be checked: {e:#}"))),
            }
            next_alive_check = Instant::now() + REMOTE_ALIVE_EVERY;
        }
        if Instant::now() >= deadline {
            return Err(fail(format!(
                "was not healthy after {timeout:?} (its /health at {})",
                started.metrics().unwrap_or("-")
            )));
        }
        std::thread::sleep(POLL);
    }
}

/// Stops every recorded service, last started first, and removes the state.
pub fn down(dir: &Path) -> anyhow::Result<Vec<(String, u32, String)>> {
    down_with(dir, None)
}

/// [`down`], remote services reached with `ssh` instead of the recorded
/// command. Services that could not be reached (`NOT stopped: ...`) stay
/// in the state file.
pub fn down_with(dir: &Path, ssh: Option<&[String]>) -> anyhow::Result<Vec<(String, u32, String)>> {
    let state = load_state(dir)?;
    let mut left = Vec::new();
    let mut done = Vec::new();
    for s in state.iter().rev() {
        let what = stop(s, ssh);
        if what.starts_with("NOT stopped") {
            left.push(s.clone());
        }
        done.push((s.name.clone(), s.pid, what));
    }
    let path = dir.join(STATE_FILE);
    if !left.is_empty() {
        left.reverse();
        save_state(dir, &left)?;
    } else if path.exists() {
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    }
    Ok(done)
}

/// SIGTERM, up to [`STOP_GRACE`], then SIGKILL; only if the pid is still
/// the process that was started. Remote: the same, over ssh.
fn stop(s: &Started, ssh: Option<&[String]>) -> String {
    if let Some(t) = s.target(ssh) {
        return match t.stop(s.pid, s.start_ticks, STOP_GRACE) {
            Ok(what) => what,
            Err(e) => format!("NOT stopped: {e:#}"),
        };
    }
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
    let fields = distmind_transport::priority::proc_stat_fields(pid)?;
    if matches!(fields.first()?.as_str(), "Z" | "X") {
        return None;
    }
    // Field 22, the start time.
    fields.get(19)?.parse().ok()
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
    indent(&String::from_utf8_lossy(&text[from..]))
}

/// Every line indented by four blanks.
fn indent(text: &str) -> String {
    text.lines()
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
            mode: RunMode::Local,
            remote: None,
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
            mode: RunMode::Local,
            remote: None,
            addrs: BTreeMap::from([("memserver".into(), "127.0.0.1:7778".into())]),
            log: dir.path().join("memserver-1.log"),
        }];
        save_state(dir.path(), &s).unwrap();
        assert_eq!(load_state(dir.path()).unwrap(), s);
        // A remote record keeps how its host is reached; an old record
        // (no mode) reads as local.
        let mut r = s.clone();
        r[0].mode = RunMode::Remote;
        r[0].remote = Some(RemoteHost {
            host: "10.0.0.7".into(),
            user: "root".into(),
            ssh: vec!["ssh".into(), "-p".into(), "2222".into()],
        });
        save_state(dir.path(), &r).unwrap();
        let text = std::fs::read_to_string(dir.path().join(STATE_FILE)).unwrap();
        assert!(
            text.contains("\"mode\": \"remote\"") && text.contains("10.0.0.7"),
            "{text}"
        );
        assert_eq!(load_state(dir.path()).unwrap(), r);
        std::fs::write(
            dir.path().join(STATE_FILE),
            r#"[{"name":"x","pid":1,"start_ticks":2,"addrs":{},"log":"x.log"}]"#,
        )
        .unwrap();
        assert_eq!(load_state(dir.path()).unwrap()[0].mode, RunMode::Local);
        std::fs::write(dir.path().join(STATE_FILE), "{").unwrap();
        let e = format!("{:#}", load_state(dir.path()).unwrap_err());
        assert!(
            e.contains("cluster.json is not a cluster state file"),
            "{e}"
        );
    }
}
