//! Several "hosts" on one machine: Linux network namespaces joined by a
//! bridge, for tests of multi-host clusters (tests/netns.rs).
//!
//! [`Lab::new`] creates, under a prefix unique to this process (`dm<pid>`):
//! a switch namespace `<prefix>-sw` holding a bridge `br0`; one namespace
//! `<prefix>-<role>` per host, its `eth0` a veth into the bridge with
//! `10.213.X.<10+i>/24` (X derived from the pid, skipping subnets already
//! on this machine's interfaces), `lo` up; and a veth `<prefix>t` from the
//! test's own namespace into the bridge with `10.213.X.1`, so the test
//! reaches every host directly. A host's optional rate is a `tbf` qdisc on
//! both ends of its link (egress of its `eth0` and of the bridge port
//! toward it), so it limits both directions.
//!
//! [`Lab::start_sshds`] runs Debian's OpenSSH server in every host
//! namespace, with keys, `known_hosts` and configs the test makes
//! ([`Sshds`]), so a test reaches each host with the real ssh client.
//!
//! Dropping the [`Lab`] removes everything, pass or fail: processes still
//! in its namespaces (found with `ip netns pids`, killed by pid), the
//! namespaces, the veth in the test's namespace. Include with
//! `#[path = "support/netns.rs"] mod netns;`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// One host of the lab.
#[derive(Debug, Clone)]
pub struct Host {
    /// `ctl`, `ms1`, ...
    pub role: String,
    /// Its network namespace.
    pub ns: String,
    pub ip: String,
}

pub struct Lab {
    pub prefix: String,
    /// `10.213.X`
    pub net: String,
    pub switch: String,
    pub hosts: Vec<Host>,
    /// The test's own address on the bridge.
    pub root_ip: String,
    root_link: Option<String>,
    namespaces: Vec<String>,
}

/// Runs a command; its stdout, or an error with its stderr.
fn cmd(argv: &[&str]) -> Result<String, String> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .map_err(|e| format!("{}: {e}", argv.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{}` failed ({}): {}",
            argv.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Why a lab cannot be built here, if it cannot: not root, no `ip` or
/// `tc`, or `ip netns add` refused (no CAP_SYS_ADMIN / CAP_NET_ADMIN).
pub fn can_run() -> Result<(), String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next().map(str::to_string));
    if uid.as_deref() != Some("0") {
        return Err(format!(
            "network namespaces need root (uid {})",
            uid.unwrap_or_else(|| "unknown".into())
        ));
    }
    for tool in ["ip", "tc"] {
        cmd(&[tool, "-V"]).map_err(|e| format!("`{tool}` is not usable: {e}"))?;
    }
    let probe = format!("dm{}probe", std::process::id());
    cmd(&["ip", "netns", "add", &probe]).map_err(|e| format!("cannot create a namespace: {e}"))?;
    let r = cmd(&[
        "ip", "-n", &probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1",
    ])
    .map_err(|e| format!("cannot create a veth pair: {e}"));
    let _ = cmd(&["ip", "netns", "del", &probe]);
    r.map(|_| ())
}

impl Lab {
    /// Builds the lab: `hosts` are (role, optional tbf rate like `10gbit`).
    pub fn new(hosts: &[(&str, Option<&str>)]) -> Result<Lab, String> {
        let pid = std::process::id();
        let prefix = format!("dm{pid}");
        let used = cmd(&["ip", "-o", "-4", "addr", "show"]).unwrap_or_default();
        let mut x = 16 + pid % 200;
        while used.contains(&format!(" 10.213.{x}.")) {
            x = 16 + (x - 15) % 200;
        }
        let net = format!("10.213.{x}");
        let mut lab = Lab {
            switch: format!("{prefix}-sw"),
            prefix: prefix.clone(),
            root_ip: format!("{net}.1"),
            net,
            hosts: Vec::new(),
            root_link: None,
            namespaces: Vec::new(),
        };
        // On any error `lab` drops here and removes what was made.
        let sw = lab.switch.clone();
        lab.add_ns(&sw)?;
        cmd(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        cmd(&["ip", "-n", &sw, "link", "set", "br0", "up"])?;
        for (i, (role, rate)) in hosts.iter().enumerate() {
            let ns = format!("{prefix}-{role}");
            let ip = format!("{}.{}", lab.net, 10 + i);
            lab.add_ns(&ns)?;
            cmd(&[
                "ip", "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", role,
                "netns", &sw,
            ])?;
            cmd(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                "eth0",
            ])?;
            cmd(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            cmd(&["ip", "-n", &sw, "link", "set", role, "master", "br0"])?;
            cmd(&["ip", "-n", &sw, "link", "set", role, "up"])?;
            if let Some(rate) = rate {
                for (n, dev) in [(&ns, "eth0"), (&sw, *role)] {
                    cmd(&[
                        "ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                        "rate", rate, "burst", "4mb", "latency", "50ms",
                    ])?;
                }
            }
            lab.hosts.push(Host {
                role: role.to_string(),
                ns,
                ip,
            });
        }
        let root_link = format!("{prefix}t");
        cmd(&[
            "ip", "link", "add", &root_link, "type", "veth", "peer", "name", "root", "netns", &sw,
        ])?;
        lab.root_link = Some(root_link.clone());
        cmd(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", lab.root_ip),
            "dev",
            &root_link,
        ])?;
        cmd(&["ip", "link", "set", &root_link, "up"])?;
        cmd(&["ip", "-n", &sw, "link", "set", "root", "master", "br0"])?;
        cmd(&["ip", "-n", &sw, "link", "set", "root", "up"])?;
        Ok(lab)
    }

    fn add_ns(&mut self, ns: &str) -> Result<(), String> {
        cmd(&["ip", "netns", "add", ns])?;
        self.namespaces.push(ns.to_string());
        cmd(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        Ok(())
    }

    pub fn host(&self, role: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.role == role)
            .unwrap_or_else(|| panic!("no host {role} in the lab"))
    }

    /// Runs `argv` inside a host's namespace.
    pub fn exec(&self, role: &str, argv: &[&str]) -> Result<String, String> {
        let ns = &self.host(role).ns;
        let mut all = vec!["ip", "netns", "exec", ns.as_str()];
        all.extend_from_slice(argv);
        cmd(&all)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in self.namespaces.iter().rev() {
            // Whatever still runs in our namespaces was started by this test.
            let pids = cmd(&["ip", "netns", "pids", ns]).unwrap_or_default();
            for pid in pids.split_whitespace() {
                eprintln!("netns lab: killing pid {pid} left in {ns}");
                let _ = cmd(&["kill", "-KILL", pid]);
            }
            if let Err(e) = cmd(&["ip", "netns", "del", ns]) {
                eprintln!("netns lab: {e}");
            }
        }
        if let Some(link) = &self.root_link {
            // Usually gone with its peer in the switch namespace.
            let _ = cmd(&["ip", "link", "del", link]);
        }
    }
}

/// Debian's OpenSSH server.
pub const SSHD: &str = "/usr/sbin/sshd";

/// sshd's privilege separation directory (compiled in; Debian's ssh.service
/// creates it at boot, a bare container may lack it).
const PRIVSEP_DIR: &str = "/run/sshd";

/// `tool`'s path in `PATH`, if it is there.
fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// Why a real OpenSSH server and client cannot be used here, if they
/// cannot: no `sshd`, `ssh` or `ssh-keygen`, or `user`'s password field is
/// locked (`!` in /etc/shadow: sshd without PAM refuses every login of a
/// locked account, keys included). Call after [`can_run`].
pub fn can_run_sshd(user: &str) -> Result<(), String> {
    if !Path::new(SSHD).is_file() {
        return Err(format!(
            "no OpenSSH server at {SSHD} (Debian: apt-get install openssh-server)"
        ));
    }
    for tool in ["ssh", "ssh-keygen"] {
        if which(tool).is_none() {
            return Err(format!(
                "no `{tool}` in PATH (Debian: apt-get install openssh-client)"
            ));
        }
    }
    let shadow = std::fs::read_to_string("/etc/shadow").unwrap_or_default();
    let locked = shadow.lines().any(|l| {
        l.strip_prefix(user)
            .and_then(|r| r.strip_prefix(':'))
            .is_some_and(|pw| pw.starts_with('!'))
    });
    if locked {
        return Err(format!(
            "{user}'s password is locked ('!' in /etc/shadow), and sshd with UsePAM no refuses \
             every login of a locked account"
        ));
    }
    Ok(())
}

/// One sshd of [`Sshds`].
struct Daemon {
    role: String,
    child: std::process::Child,
    log: PathBuf,
}

/// A real OpenSSH server in every host namespace of a [`Lab`]
/// ([`Lab::start_sshds`]), with every file it and the client use under one
/// directory of the test: host keys, the client key, `authorized_keys`,
/// `known_hosts`, each sshd's config, pid file and log. Nothing in
/// `~/.ssh` or `/etc/ssh` is read or written. Dropping it stops each sshd
/// by its pid (SIGTERM, then SIGKILL), pass or fail.
pub struct Sshds {
    /// The client's config, for `ssh -F`: the client key only, the test's
    /// `known_hosts` with `StrictHostKeyChecking yes`, `BatchMode yes`.
    pub client_config: PathBuf,
    dir: PathBuf,
    daemons: Vec<Daemon>,
    /// [`PRIVSEP_DIR`] was made here (and is removed again on drop).
    made_privsep_dir: bool,
}

/// `s` as one double-quoted word of an ssh or sshd config file.
fn conf_quote(s: &Path) -> String {
    let s = s.to_string_lossy();
    assert!(!s.contains('"'), "a config path with a double quote: {s}");
    format!("\"{s}\"")
}

fn keygen(path: &Path, comment: &str) -> Result<String, String> {
    let p = path.to_str().ok_or("a key path that is not UTF-8")?;
    cmd(&[
        "ssh-keygen",
        "-q",
        "-t",
        "ed25519",
        "-N",
        "",
        "-C",
        comment,
        "-f",
        p,
    ])?;
    std::fs::read_to_string(path.with_extension("pub"))
        .map_err(|e| format!("reading {}.pub: {e}", path.display()))
}

impl Lab {
    /// Starts `sshd -D -e -f <its config>` in every host's namespace, on the
    /// host's address, port 22, admitting `user` with the client key the
    /// test makes (public key only, `UsePAM no`); returns once every host
    /// accepted an `ssh -F <client_config> <user>@<ip> true`.
    pub fn start_sshds(&self, dir: &Path, user: &str) -> Result<Sshds, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let mut sshds = Sshds {
            client_config: dir.join("ssh_config"),
            dir: dir.to_path_buf(),
            daemons: Vec::new(),
            made_privsep_dir: false,
        };
        if !Path::new(PRIVSEP_DIR).is_dir() {
            // What ssh.service's RuntimeDirectory would have made.
            std::fs::create_dir(PRIVSEP_DIR)
                .map_err(|e| format!("creating sshd's {PRIVSEP_DIR}: {e}"))?;
            sshds.made_privsep_dir = true;
            cmd(&["chmod", "755", PRIVSEP_DIR])?;
        }
        // On any error `sshds` drops here and stops what was started.
        let client_key = dir.join("client_key");
        let authorized = keygen(&client_key, "distmind netns test client")?;
        let authorized_keys = dir.join("authorized_keys");
        std::fs::write(&authorized_keys, authorized).map_err(|e| e.to_string())?;
        let mut known_hosts = String::new();
        for h in &self.hosts {
            let key = dir.join(format!("{}_host_key", h.role));
            let public = keygen(&key, &format!("distmind netns test host {}", h.role))?;
            // `<ip> <type> <key>` (port 22: no brackets).
            let mut words = public.split_whitespace();
            let (ty, k) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
            known_hosts.push_str(&format!("{} {ty} {k}\n", h.ip));
            let config = dir.join(format!("{}_sshd_config", h.role));
            std::fs::write(
                &config,
                format!(
                    "# sshd of the netns test's host {role}: its own files only\n\
                     ListenAddress {ip}:22\n\
                     HostKey {key}\n\
                     PidFile {pid}\n\
                     AuthorizedKeysFile {authorized}\n\
                     AllowUsers {user}\n\
                     PermitRootLogin prohibit-password\n\
                     PubkeyAuthentication yes\n\
                     PasswordAuthentication no\n\
                     KbdInteractiveAuthentication no\n\
                     UsePAM no\n\
                     # Its files sit under /tmp (mode 1777), which StrictModes refuses.\n\
                     StrictModes no\n\
                     X11Forwarding no\n\
                     AllowTcpForwarding no\n\
                     AllowAgentForwarding no\n\
                     PermitTunnel no\n\
                     PrintMotd no\n\
                     PrintLastLog no\n\
                     LogLevel VERBOSE\n",
                    role = h.role,
                    ip = h.ip,
                    key = conf_quote(&key),
                    pid = conf_quote(&dir.join(format!("{}_sshd.pid", h.role))),
                    authorized = conf_quote(&authorized_keys),
                ),
            )
            .map_err(|e| e.to_string())?;
            let log = dir.join(format!("{}_sshd.log", h.role));
            let out = std::fs::File::create(&log).map_err(|e| e.to_string())?;
            let err = out.try_clone().map_err(|e| e.to_string())?;
            // `ip netns exec` execs sshd: the child's pid is sshd's.
            let child = Command::new("ip")
                .args(["netns", "exec", &h.ns, SSHD, "-D", "-e", "-f"])
                .arg(&config)
                .stdin(std::process::Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .map_err(|e| format!("starting {SSHD} in {}: {e}", h.ns))?;
            sshds.daemons.push(Daemon {
                role: h.role.clone(),
                child,
                log,
            });
        }
        let known = dir.join("known_hosts");
        std::fs::write(&known, known_hosts).map_err(|e| e.to_string())?;
        std::fs::write(
            &sshds.client_config,
            format!(
                "# ssh client of the netns test: its own key and known_hosts only\n\
                 Host *\n\
                 \x20   IdentityFile {key}\n\
                 \x20   IdentitiesOnly yes\n\
                 \x20   UserKnownHostsFile {known}\n\
                 \x20   GlobalKnownHostsFile /dev/null\n\
                 \x20   StrictHostKeyChecking yes\n\
                 \x20   UpdateHostKeys no\n\
                 \x20   BatchMode yes\n\
                 \x20   PasswordAuthentication no\n\
                 \x20   KbdInteractiveAuthentication no\n\
                 \x20   ConnectTimeout 10\n\
                 \x20   LogLevel ERROR\n",
                key = conf_quote(&client_key),
                known = conf_quote(&known),
            ),
        )
        .map_err(|e| e.to_string())?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        for i in 0..sshds.daemons.len() {
            let ip = self.host(&sshds.daemons[i].role).ip.clone();
            loop {
                let d = &mut sshds.daemons[i];
                if let Ok(Some(status)) = d.child.try_wait() {
                    return Err(format!(
                        "sshd on {} exited ({status}): {}",
                        d.role,
                        std::fs::read_to_string(&d.log).unwrap_or_default().trim()
                    ));
                }
                let probe = sshds.ssh(user, &ip, "true");
                match probe {
                    Ok(_) => break,
                    Err(e) if std::time::Instant::now() >= deadline => {
                        let d = &sshds.daemons[i];
                        return Err(format!(
                            "sshd on {} ({ip}) does not let {user} in: {e}; its log:\n{}",
                            d.role,
                            std::fs::read_to_string(&d.log).unwrap_or_default().trim()
                        ));
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
                }
            }
        }
        Ok(sshds)
    }
}

impl Sshds {
    /// `--ssh` for distmind: the real client with the test's config.
    pub fn ssh_command(&self) -> String {
        let path = self.client_config.to_string_lossy();
        assert!(!path.contains('\''), "{path}");
        format!("ssh -F '{path}'")
    }

    /// Runs `command` on `user@ip` with the real client; its stdout.
    pub fn ssh(&self, user: &str, ip: &str, command: &str) -> Result<String, String> {
        let config = self
            .client_config
            .to_str()
            .ok_or("a config path that is not UTF-8")?;
        cmd(&["ssh", "-F", config, &format!("{user}@{ip}"), command])
    }

    /// The pid of the sshd on `role`.
    pub fn pid(&self, role: &str) -> u32 {
        self.daemon(role).child.id()
    }

    /// What the sshd on `role` logged so far.
    pub fn log(&self, role: &str) -> String {
        std::fs::read_to_string(&self.daemon(role).log).unwrap_or_default()
    }

    /// What the sshd on `role` wrote to its own pid file.
    pub fn pid_file(&self, role: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{role}_sshd.pid"))).unwrap_or_default()
    }

    fn daemon(&self, role: &str) -> &Daemon {
        self.daemons
            .iter()
            .find(|d| d.role == role)
            .unwrap_or_else(|| panic!("no sshd on {role}"))
    }
}

impl Drop for Sshds {
    fn drop(&mut self) {
        for d in &mut self.daemons {
            let pid = d.child.id();
            let _ = cmd(&["kill", "-TERM", &pid.to_string()]);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let mut exited = false;
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = d.child.try_wait() {
                    exited = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            if !exited {
                eprintln!("sshd on {} (pid {pid}) ignored SIGTERM: SIGKILL", d.role);
                let _ = d.child.kill();
                let _ = d.child.wait();
            }
        }
        if self.made_privsep_dir {
            let _ = std::fs::remove_dir(PRIVSEP_DIR);
        }
    }
}
