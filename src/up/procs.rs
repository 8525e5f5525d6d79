//! Child `distmind` processes: spawned with piped stdout/stderr, ready when
//! their `<service> listening on <addr>` lines arrived (never after a fixed
//! sleep), stopped by pid: SIGTERM, a grace period, then SIGKILL.
//!
//! [`Cluster`] is the guard: dropping it stops every child it holds, in
//! reverse start order, on every exit path (errors, panics, Ctrl-C).

use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;

/// Log lines of a child kept for error messages.
const STDERR_TAIL_LINES: usize = 30;
/// How long a child may take to exit after SIGTERM before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
/// How often waits look at the stop flag and the child.
const POLL: Duration = Duration::from_millis(50);

/// `"memserver listening on 127.0.0.1:7778"` -> `("memserver", "127.0.0.1:7778")`.
/// The service is one word; anything else is not a readiness line.
pub fn parse_ready_line(line: &str) -> Option<(&str, &str)> {
    let (service, addr) = line.trim().split_once(" listening on ")?;
    let addr = addr.trim();
    (!service.is_empty()
        && !service.contains(char::is_whitespace)
        && !addr.is_empty()
        && !addr.contains(char::is_whitespace))
    .then_some((service, addr))
}

/// One running child.
pub struct Service {
    /// `controller`, `memserver-1`, ...
    pub name: String,
    child: Child,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// Service label -> address, from its readiness lines.
    pub addrs: BTreeMap<String, String>,
    stopped: Option<String>,
}

impl Service {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn addr(&self, label: &str) -> &str {
        self.addrs.get(label).map(String::as_str).unwrap_or("?")
    }

    /// The last lines the child wrote on stderr.
    pub fn stderr_tail(&self) -> String {
        let tail = self.stderr_tail.lock().unwrap();
        if tail.is_empty() {
            "(nothing on stderr)".into()
        } else {
            tail.iter()
                .map(|l| format!("    {l}"))
                .collect::<Vec<_>>()
                .join("\n")
        }
    }

    /// `Some(status)` when the child has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGTERM, up to `grace` to exit, then SIGKILL; returns what happened.
    fn stop(&mut self, grace: Duration) -> String {
        if let Some(s) = &self.stopped {
            return s.clone();
        }
        let what = match self.exited() {
            Some(status) => format!("had already exited ({status})"),
            None => {
                // The child is not reaped until we wait for it, so its pid
                // cannot have been reused.
                let pid = self.child.id();
                let termed = sigterm(pid);
                let deadline = Instant::now() + grace;
                let mut status = None;
                while termed && Instant::now() < deadline {
                    if let Some(s) = self.exited() {
                        status = Some(s);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                match status {
                    Some(s) => format!("stopped ({s})"),
                    None => {
                        let _ = self.child.kill();
                        let s = self.child.wait();
                        format!(
                            "killed with SIGKILL{} ({})",
                            if termed {
                                format!(" after {} s", grace.as_secs())
                            } else {
                                String::new()
                            },
                            s.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string())
                        )
                    }
                }
            }
        };
        self.stopped = Some(what.clone());
        what
    }
}

/// SIGTERM by pid, through `kill(1)`: the library forbids `unsafe`, so no
/// `libc::kill`. False when it could not be sent (then SIGKILL follows).
fn sigterm(pid: u32) -> bool {
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The guard over every child started: stops them in reverse order on drop.
pub struct Cluster {
    exe: std::path::PathBuf,
    /// `DISTMIND_LOG` of the children.
    child_log: String,
    /// Echo children's stderr lines (their warnings) to ours; off once
    /// the shutdown starts (what they log then is about each other going away).
    echo_stderr: Arc<AtomicBool>,
    services: Vec<Service>,
}

impl Cluster {
    pub fn new(exe: &Path, child_log: &str, echo_stderr: bool) -> Cluster {
        Cluster {
            exe: exe.to_path_buf(),
            child_log: child_log.to_string(),
            echo_stderr: Arc::new(AtomicBool::new(echo_stderr)),
            services: Vec::new(),
        }
    }

    pub fn services(&mut self) -> &mut [Service] {
        &mut self.services
    }

    /// Starts `distmind <args>` and waits until it printed a readiness line
    /// for every label of `ready` (in any order), within `timeout`. Returns
    /// its index. On failure the child is stopped and the error carries its
    /// stderr tail.
    pub fn start(
        &mut self,
        name: &str,
        args: &[OsString],
        ready: &[&str],
        timeout: Duration,
        stop: &AtomicBool,
    ) -> anyhow::Result<&Service> {
        let mut child = Command::new(&self.exe)
            .args(args)
            .env("DISTMIND_LOG", &self.child_log)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {name} ({}): {e}", self.exe.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let (tx, rx) = mpsc::channel::<String>();
        // Keeps draining stdout after readiness (sends then fail silently),
        // so the child never blocks on a full pipe.
        std::thread::Builder::new()
            .name(format!("{name}-stdout"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let _ = tx.send(line);
                }
            })?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (tail2, prefix, echo) = (tail.clone(), name.to_string(), self.echo_stderr.clone());
        std::thread::Builder::new()
            .name(format!("{name}-stderr"))
            .spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if echo.load(Ordering::Relaxed) {
                        let _ = writeln!(std::io::stderr().lock(), "[{prefix}] {line}");
                    }
                    let mut t = tail2.lock().unwrap();
                    if t.len() == STDERR_TAIL_LINES {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            })?;
        self.services.push(Service {
            name: name.to_string(),
            child,
            stderr_tail: tail,
            addrs: BTreeMap::new(),
            stopped: None,
        });
        let svc = self.services.last_mut().expect("just pushed");
        if let Err(e) = wait_ready(svc, &rx, ready, timeout, stop) {
            svc.stop(STOP_GRACE);
            return Err(e);
        }
        Ok(self.services.last().expect("just pushed"))
    }

    /// Stops every child, last started first; returns (name, pid, what happened).
    pub fn stop_all(&mut self) -> Vec<(String, u32, String)> {
        self.echo_stderr.store(false, Ordering::Relaxed);
        self.services
            .iter_mut()
            .rev()
            .map(|s| (s.name.clone(), s.pid(), s.stop(STOP_GRACE)))
            .collect()
    }

    /// Children that exited on their own: (name, status, stderr tail).
    pub fn exited(&mut self) -> Vec<(String, ExitStatus, String)> {
        self.services
            .iter_mut()
            .filter(|s| s.stopped.is_none())
            .filter_map(|s| s.exited().map(|st| (s.name.clone(), st, s.stderr_tail())))
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.services.iter().all(|s| s.stopped.is_some()) {
            return;
        }
        eprintln!("up: stopping the cluster");
        for (name, pid, what) in self.stop_all() {
            eprintln!("up: {name} (pid {pid}) {what}");
        }
    }
}

fn wait_ready(
    svc: &mut Service,
    lines: &Receiver<String>,
    ready: &[&str],
    timeout: Duration,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut other = Vec::new();
    while ready.iter().any(|l| !svc.addrs.contains_key(*l)) {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted while waiting for {} to start", svc.name);
        }
        let now = Instant::now();
        if now >= deadline {
            bail!(
                "{} (pid {}) is not ready after {} s: {}; its stderr ends with:\n{}",
                svc.name,
                svc.pid(),
                timeout.as_secs(),
                missing(svc, ready, &other),
                svc.stderr_tail()
            );
        }
        match lines.recv_timeout((deadline - now).min(POLL)) {
            Ok(line) => match parse_ready_line(&line) {
                Some((label, addr)) if ready.contains(&label) => {
                    svc.addrs.insert(label.to_string(), addr.to_string());
                }
                _ => other.push(line),
            },
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                // Stdout closed: the child is exiting. Give stderr a moment
                // to be read, then report.
                let status = wait_exit(svc, Duration::from_secs(2));
                if stop.load(Ordering::Relaxed) {
                    bail!("interrupted while waiting for {} to start", svc.name);
                }
                bail!(
                    "{} (pid {}) exited before it was ready ({}): {}; its stderr ends with:\n{}",
                    svc.name,
                    svc.pid(),
                    status
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| "stdout closed".into()),
                    missing(svc, ready, &other),
                    svc.stderr_tail()
                );
            }
        }
    }
    Ok(())
}

fn wait_exit(svc: &mut Service, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = svc.exited() {
            // Let the stderr thread catch the last lines.
            std::thread::sleep(Duration::from_millis(100));
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn missing(svc: &Service, ready: &[&str], other: &[String]) -> String {
    let missing: Vec<String> = ready
        .iter()
        .filter(|l| !svc.addrs.contains_key(**l))
        .map(|l| format!("'{l} listening on ...'"))
        .collect();
    let mut s = format!("no {} line on stdout", missing.join(" or "));
    if !svc.addrs.is_empty() {
        let got: Vec<String> = svc.addrs.keys().map(|k| format!("'{k}'")).collect();
        s += &format!(" (it printed {})", got.join(", "));
    }
    if let Some(l) = other.first() {
        s += &format!(" (other stdout: {l:?})");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_lines() {
        assert_eq!(
            parse_ready_line("controller listening on 127.0.0.1:7777\n"),
            Some(("controller", "127.0.0.1:7777"))
        );
        assert_eq!(
            parse_ready_line("dispatcher listening on [::1]:9999"),
            Some(("dispatcher", "[::1]:9999"))
        );
        assert_eq!(parse_ready_line("listening on 1.2.3.4:5"), None);
        assert_eq!(parse_ready_line("the memserver listening on x:1"), None);
        assert_eq!(parse_ready_line("metrics listening on "), None);
        assert_eq!(parse_ready_line("deployed resnet152"), None);
    }

    #[cfg(unix)]
    #[test]
    fn children_are_waited_for_and_stopped_by_the_guard() {
        // `sh` stands in for distmind: it prints two readiness lines, then
        // sleeps until SIGTERM.
        let stop = AtomicBool::new(false);
        let mut cluster = Cluster::new(Path::new("sh"), "warn", false);
        let script = "echo 'noise'; echo 'metrics listening on 127.0.0.1:2'; \
                      echo 'svc listening on 127.0.0.1:1'; exec sleep 30";
        let args = [OsString::from("-c"), OsString::from(script)];
        let svc = cluster
            .start(
                "svc",
                &args,
                &["svc", "metrics"],
                Duration::from_secs(10),
                &stop,
            )
            .unwrap();
        assert_eq!(svc.addr("svc"), "127.0.0.1:1");
        assert_eq!(svc.addr("metrics"), "127.0.0.1:2");
        let started = Instant::now();
        let stopped = cluster.stop_all();
        assert!(stopped[0].2.starts_with("stopped"), "{stopped:?}");
        assert!(started.elapsed() < STOP_GRACE);

        // A child that dies before it is ready: the error says so, with its stderr.
        let args = [
            OsString::from("-c"),
            OsString::from("echo boom >&2; exit 3"),
        ];
        let err = cluster
            .start("bad", &args, &["bad"], Duration::from_secs(10), &stop)
            .err()
            .unwrap();
        let msg = format!("{err:#}");
        assert!(msg.contains("bad"), "{msg}");
        assert!(msg.contains("exited before it was ready"), "{msg}");
        assert!(msg.contains("boom"), "{msg}");

        // A silent child: the timeout names the missing line.
        let args = [OsString::from("-c"), OsString::from("exec sleep 30")];
        let err = cluster
            .start("slow", &args, &["slow"], Duration::from_millis(300), &stop)
            .err()
            .unwrap();
        assert!(format!("{err:#}").contains("'slow listening on ...'"));
    }
}
