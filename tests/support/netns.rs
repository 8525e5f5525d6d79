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

    /// Writes `dir/ssh`: a stand-in for ssh that skips options (`-o X`,
    /// `-p X`, `-i X`, `-l X`, other `-x`), maps `user@<ip>` to that host's
    /// namespace and runs the command there with `sh -c` (like sshd, the
    /// arguments joined by blanks); an unknown host is ssh's exit 255.
    /// Every invocation's arguments (to the first line break) are appended
    /// to `dir/ssh.log`.
    pub fn ssh_script(&self, dir: &Path) -> PathBuf {
        let path = dir.join("ssh");
        let log = dir.join("ssh.log");
        let mut table = String::new();
        for h in &self.hosts {
            table.push_str(&format!("  {}) ns={} ;;\n", h.ip, h.ns));
        }
        let script = format!(
            "#!/bin/sh\n\
             # ssh stand-in for tests/netns.rs: user@<ip> -> ip netns exec <ns>\n\
             echo \"$*\" | head -n 1 >> '{log}'\n\
             while [ $# -gt 0 ]; do\n\
             \x20 case \"$1\" in\n\
             \x20   -o|-p|-i|-l) shift 2 ;;\n\
             \x20   -*) shift ;;\n\
             \x20   *) break ;;\n\
             \x20 esac\n\
             done\n\
             dest=\"$1\"; shift\n\
             case \"${{dest#*@}}\" in\n\
             {table}\
             \x20 *) echo \"ssh: connect to host ${{dest#*@}} port 22: No route to host\" >&2; exit 255 ;;\n\
             esac\n\
             exec ip netns exec \"$ns\" sh -c \"$*\"\n",
            log = log.display()
        );
        std::fs::write(&path, script).unwrap();
        cmd(&["chmod", "+x", path.to_str().unwrap()]).unwrap();
        path
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
