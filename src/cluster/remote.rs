//! Remote mode's only way to a host: one ssh invocation per action,
//! `<ssh...> -o BatchMode=yes <user>@<host> sh -s`, the script on ssh's
//! stdin. The login shell of the remote user (bash, zsh, tcsh, fish) only
//! ever parses `sh -s`, so its quoting rules never touch the script; the
//! script is read by `sh`.
//!
//! Every argument in a script is single-quoted ([`quote`]), so paths and
//! flags reach the service as they are. Processes are found again only by
//! the pid (and the pid's start time, field 22 of `/proc/<pid>/stat`)
//! recorded when they were started, never by name. What a script answers
//! is read from its last output line, so whatever the remote user's shell
//! start-up files print before it is ignored.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// How long one ssh invocation may take (login included) before it is
/// killed and the host reported unreachable.
pub(super) const SSH_TIMEOUT: Duration = Duration::from_secs(30);

/// One host, reached over ssh.
#[derive(Debug, Clone, Copy)]
pub(super) struct Target<'a> {
    /// The ssh command, one argument per element (`["ssh", "-p", "2222"]`).
    pub ssh: &'a [String],
    pub user: &'a str,
    pub host: &'a str,
}

/// `--ssh "ssh -p 2222"` -> `["ssh", "-p", "2222"]`: split like a POSIX
/// shell does (`"ssh -F '/my keys/config'"` keeps the quoted path whole).
pub(super) fn parse_ssh(cmd: &str) -> anyhow::Result<Vec<String>> {
    let Some(argv) = shlex::split(cmd) else {
        bail!("--ssh {cmd:?}: an unclosed quote or a trailing backslash");
    };
    if argv.is_empty() {
        bail!("--ssh is empty: give the ssh command, e.g. \"ssh\" or \"ssh -p 2222\"");
    }
    Ok(argv)
}

/// One argument for a POSIX shell: single-quoted, embedded `'` as `'\''`.
pub(super) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn quote_path(p: &Path) -> String {
    quote(&p.to_string_lossy())
}

impl Target<'_> {
    fn dest(&self) -> String {
        format!("{}@{}", self.user, self.host)
    }

    /// Runs `script` with `sh -s` on the host (the script on ssh's stdin);
    /// its stdout on success. Exit 255 is ssh's own failure (unreachable
    /// host, login refused) and names the host and ssh's stderr; any other
    /// failure names the host and the script's stderr.
    pub fn exec(&self, script: &str, timeout: Duration) -> anyhow::Result<String> {
        let mut child = Command::new(&self.ssh[0])
            .args(&self.ssh[1..])
            .args(["-o", "BatchMode=yes"])
            .arg(self.dest())
            .args(["sh", "-s"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!(
                    "cannot run the ssh command {:?} (--ssh) to reach {}",
                    self.ssh.join(" "),
                    self.host
                )
            })?;
        // Scripts are a few hundred bytes: they fit the pipe, so this never
        // blocks. An ssh that already failed closed it; its exit status
        // says why.
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(script.as_bytes());
        }
        let (tx, rx) = mpsc::channel();
        for (i, pipe) in [
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .enumerate()
        {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                if let Some(mut p) = pipe {
                    let _ = p.read_to_end(&mut buf);
                }
                let _ = tx.send((i, buf));
            });
        }
        drop(tx);
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = child.try_wait().context("waiting for ssh")? {
                break status;
            }
            if Instant::now() >= deadline {
                // Our own child, by its pid.
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "ssh {} did not finish within {} s (is {} reachable?); the ssh command was stopped",
                    self.dest(),
                    timeout.as_secs(),
                    self.host
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // The pipes close when the remote command ends; a background process
        // that kept them open would not hold us for long.
        let mut out = [Vec::new(), Vec::new()];
        let until = Instant::now() + Duration::from_secs(5);
        for _ in 0..2 {
            let left = until.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((i, buf)) => out[i] = buf,
                Err(_) => break,
            }
        }
        let stdout = String::from_utf8_lossy(&out[0]).into_owned();
        let stderr = String::from_utf8_lossy(&out[1]).trim().to_string();
        match status.code() {
            Some(0) => Ok(stdout),
            Some(255) => bail!(
                "ssh {} failed (exit 255: host not reachable or login refused; BatchMode=yes never \
                 asks for a password): {}",
                self.dest(),
                if stderr.is_empty() { "(no message)" } else { &stderr }
            ),
            code => bail!(
                "on {}: the remote command failed ({}): {}",
                self.host,
                code.map_or_else(|| status.to_string(), |c| format!("exit {c}")),
                if stderr.is_empty() {
                    "(no message)"
                } else {
                    &stderr
                }
            ),
        }
    }

    /// Starts `exe argv` detached on the host (`nohup`, stdin from
    /// /dev/null, stdout and stderr into `out` and `log`), from `cwd`;
    /// returns its pid and the pid's start time (0 when `/proc` could not
    /// be read).
    pub fn start(
        &self,
        cwd: &Path,
        exe: &Path,
        argv: &[String],
        env: &[(&str, &str)],
        out: &Path,
        log: &Path,
    ) -> anyhow::Result<(u32, u64)> {
        let run_dir = log.parent().unwrap_or(Path::new("/"));
        let mut cmd: Vec<String> = env
            .iter()
            .map(|(k, v)| format!("{k}={}", quote(v)))
            .collect();
        cmd.push("nohup".into());
        cmd.push(quote_path(exe));
        cmd.extend(argv.iter().map(|a| quote(a)));
        let exe_q = quote_path(exe);
        let script = format!(
            "[ -x {exe_q} ] || {{ echo {} >&2; exit 3; }}\n\
             cd {} || exit 3\n\
             mkdir -p {} || exit 3\n\
             {} > {} 2> {} < /dev/null &\n\
             p=$!\n\
             echo \"pid $p\"\n\
             echo \"ticks $(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f20)\"\n",
            quote(&format!(
                "{}: no such executable here (remote mode runs the same binary path on every host)",
                exe.display()
            )),
            quote_path(cwd),
            quote_path(run_dir),
            cmd.join(" "),
            quote_path(out),
            quote_path(log),
        );
        let text = self.exec(&script, SSH_TIMEOUT)?;
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok())
        };
        let pid = field("pid ").with_context(|| {
            format!(
                "on {}: the start command printed no pid (output: {:?})",
                self.host,
                text.trim()
            )
        })?;
        let pid = u32::try_from(pid).with_context(|| format!("pid {pid} from {}", self.host))?;
        Ok((pid, field("ticks ").unwrap_or(0)))
    }

    /// Whether the recorded process still runs there.
    pub fn alive(&self, pid: u32, ticks: u64) -> anyhow::Result<bool> {
        let script = format!(
            "{}\nif alive; then echo alive; else echo dead; fi\n",
            alive_fn(pid, ticks)
        );
        Ok(last_line(&self.exec(&script, SSH_TIMEOUT)?) == "alive")
    }

    /// `kill -TERM`, up to `grace` polling `kill -0`, then `kill -KILL`;
    /// only while the pid is the process that was started. Returns what
    /// happened: `not running`, `stopped`, `killed with SIGKILL ...`.
    pub fn stop(&self, pid: u32, ticks: u64, grace: Duration) -> anyhow::Result<String> {
        let tenths = grace.as_millis().div_ceil(100);
        let script = format!(
            "{}\n\
             alive || {{ echo 'not running'; exit 0; }}\n\
             kill -TERM {pid} 2>/dev/null\n\
             i=0\n\
             while [ $i -lt {tenths} ]; do alive || {{ echo stopped; exit 0; }}; sleep 0.1; i=$((i+1)); done\n\
             kill -KILL {pid} 2>/dev/null\n\
             i=0\n\
             while [ $i -lt 50 ] && alive; do sleep 0.1; i=$((i+1)); done\n\
             if alive; then echo 'still running after SIGKILL'; else echo 'killed with SIGKILL after {} s'; fi\n",
            alive_fn(pid, ticks),
            grace.as_secs()
        );
        let text = self.exec(&script, grace + SSH_TIMEOUT)?;
        Ok(last_line(&text).to_string())
    }

    /// The file's text (`cat`).
    pub fn read(&self, path: &Path) -> anyhow::Result<String> {
        self.exec(&format!("cat {}", quote_path(path)), SSH_TIMEOUT)
    }

    /// The last `bytes` of a log, indented; or why it could not be read.
    pub fn tail(&self, path: &Path, bytes: u64) -> String {
        match self.exec(
            &format!("tail -c {bytes} {}", quote_path(path)),
            SSH_TIMEOUT,
        ) {
            Ok(text) => super::indent(&text),
            Err(e) => format!("    (could not read it over ssh: {e:#})"),
        }
    }
}

/// The last non-blank line of a script's output, trimmed: its answer.
fn last_line(text: &str) -> &str {
    text.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
}

/// A shell function `alive`: the pid exists (`kill -0`), is no zombie and,
/// when `ticks` is known, started at that time (so a reused pid is never
/// taken for the service).
fn alive_fn(pid: u32, ticks: u64) -> String {
    let same_start = if ticks == 0 {
        "return 0".to_string()
    } else {
        format!("[ \"$(echo \"$s\" | cut -d' ' -f20)\" = {ticks} ]")
    };
    format!(
        "alive() {{ kill -0 {pid} 2>/dev/null || return 1; \
         s=$(sed 's/.*) //' /proc/{pid}/stat 2>/dev/null) || return 0; \
         st=${{s%% *}}; [ \"$st\" != Z ] && [ \"$st\" != X ] || return 1; {same_start}; }}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_the_shell() {
        for s in [
            "plain",
            "with space",
            "it's",
            "'",
            "$HOME `x` \"y\" \\ ;|&",
            "",
        ] {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", quote(s)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout), s);
        }
    }

    #[test]
    fn ssh_command_is_split_like_a_shell() {
        assert_eq!(parse_ssh(" ssh  -p 2222 ").unwrap(), ["ssh", "-p", "2222"]);
        assert_eq!(
            parse_ssh(r#"ssh -F '/my keys/config' -i "/a b/id" -o User=x\ y"#).unwrap(),
            [
                "ssh",
                "-F",
                "/my keys/config",
                "-i",
                "/a b/id",
                "-o",
                "User=x y"
            ]
        );
        assert!(parse_ssh("  ").is_err());
        let e = parse_ssh("ssh -F 'unclosed").unwrap_err().to_string();
        assert!(e.contains("unclosed quote"), "{e}");
    }

    /// A stand-in for ssh that drops `-o X` and `user@host` and runs the
    /// command here, its stdin passed on, after a greeting on stdout (as a
    /// chatty shell start-up file would print).
    fn local_ssh(dir: &Path) -> Vec<String> {
        let path = dir.join("ssh");
        std::fs::write(
            &path,
            "#!/bin/sh\nwhile [ \"$1\" = -o ]; do shift 2; done\ncase \"$1\" in *@unreachable) \
             echo 'ssh: connect to host unreachable port 22: No route to host' >&2; exit 255;; esac\n\
             shift\necho 'Welcome: alive and well'\nexec sh -c \"$*\"\n",
        )
        .unwrap();
        Command::new("chmod").arg("+x").arg(&path).status().unwrap();
        vec![path.to_string_lossy().into_owned()]
    }

    #[test]
    fn start_alive_stop_by_pid_and_errors_name_the_host() {
        let dir = tempfile::tempdir().unwrap();
        let ssh = local_ssh(dir.path());
        let t = Target {
            ssh: &ssh,
            user: "me",
            host: "here",
        };
        let (pid, ticks) = t
            .start(
                dir.path(),
                Path::new("/bin/sleep"),
                &["30".into()],
                &[("X", "it's")],
                &dir.path().join("run/s.out"),
                &dir.path().join("run/s.log"),
            )
            .unwrap();
        assert!(ticks > 0);
        assert!(t.alive(pid, ticks).unwrap());
        assert!(!t.alive(pid, ticks + 1).unwrap(), "another start time");
        assert_eq!(
            t.stop(pid, ticks + 1, Duration::from_secs(1)).unwrap(),
            "not running"
        );
        assert_eq!(
            t.stop(pid, ticks, Duration::from_secs(5)).unwrap(),
            "stopped"
        );
        assert!(!t.alive(pid, ticks).unwrap());

        let bad = Target {
            host: "unreachable",
            ..t
        };
        let e = format!("{:#}", bad.alive(1, 0).unwrap_err());
        assert!(
            e.contains("me@unreachable") && e.contains("No route to host"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            t.exec("echo oops >&2; exit 4", SSH_TIMEOUT).unwrap_err()
        );
        assert!(
            e.contains("on here") && e.contains("exit 4") && e.contains("oops"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            t.start(
                dir.path(),
                Path::new("/no/such/distmind"),
                &[],
                &[],
                &dir.path().join("x.out"),
                &dir.path().join("x.log")
            )
            .unwrap_err()
        );
        assert!(e.contains("no such executable here"), "{e}");
    }
}
