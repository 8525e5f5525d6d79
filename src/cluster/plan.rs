//! What `cluster up` starts, in order, and every service's arguments: one
//! builder for both modes, the remote-only flags added where they differ.
//!
//! Local mode: services listen where `settings/` says (the controller and
//! the GPU server on their defaults), metrics on ephemeral loopback ports
//! learned from each service's `metrics listening on` line.
//!
//! Remote mode: every address is explicit, on the host that runs the
//! service, so it is known before the service starts:
//!
//! | service | runs on | listens on | metrics |
//! |---|---|---|---|
//! | controller | metadata host (storage_list.txt, first line) | metadata endpoint; dispatcher on `GLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT`; inference on `GLOBAL_INFERENCE_HTTP_PORT`, `GLOBAL_INFERENCE_GRPC_PORT` | metadata port + offset |
//! | memserver-N | its storage_list.txt line | that `host:port` | port + offset |
//! | runtime-N | its serverhost_list.txt line | `host:GLOBAL_CAHCE_PORT_FOR_SERVER`, `slots` devices | cache port + offset |
//!
//! (offset: `--metrics-port-offset`, default 1000.) A hostname (not an IP
//! literal) is listened on as `0.0.0.0:port` and advertised as
//! `host:port`. Two services that would use one port of one host are an
//! error before anything starts.

use std::collections::{BTreeMap, HashMap};

use anyhow::{bail, Context};
use distmind_common::settings::{Endpoint, Settings};

use super::UpArgs;

/// One service to start.
#[derive(Debug)]
pub(super) struct Planned {
    /// `controller`, `memserver-1`, `runtime` (local) / `runtime-1` (remote).
    pub name: String,
    /// Remote mode: the host it runs on (ssh destination); `None` here.
    pub host: Option<String>,
    /// `distmind` arguments.
    pub argv: Vec<String>,
    /// The `<label> listening on` lines it prints when ready.
    pub labels: Vec<&'static str>,
    /// Remote mode: label -> the address others reach it at.
    pub addrs: BTreeMap<String, String>,
}

impl Planned {
    fn new(name: String, host: Option<&str>, argv: &[&str], labels: &[&'static str]) -> Self {
        Planned {
            name,
            host: host.map(str::to_string),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            labels: labels.to_vec(),
            addrs: BTreeMap::new(),
        }
    }

    fn flag(&mut self, flag: &str, value: impl ToString) {
        self.argv.push(flag.to_string());
        self.argv.push(value.to_string());
    }

    /// `flag <bind address of ep>`; `ep` recorded under `label`.
    fn listen(
        &mut self,
        flag: &str,
        label: &str,
        ep: &Endpoint,
        ports: &mut Ports,
    ) -> anyhow::Result<()> {
        ports.claim(ep, &self.name)?;
        let bind = match ep.ip() {
            Some(_) => ep.to_string(),
            None => format!("0.0.0.0:{}", ep.port),
        };
        self.flag(flag, bind);
        self.addrs.insert(label.to_string(), ep.to_string());
        Ok(())
    }

    /// `--advertise host:port` when the host is a name (it listens on 0.0.0.0).
    fn advertise_if_named(&mut self, ep: &Endpoint) {
        if ep.ip().is_none() {
            self.flag("--advertise", ep);
        }
    }
}

/// Ports claimed per host, so that no two services collide.
#[derive(Default)]
struct Ports(HashMap<(String, u16), String>);

impl Ports {
    fn claim(&mut self, ep: &Endpoint, name: &str) -> anyhow::Result<()> {
        if let Some(other) = self.0.insert((ep.host.clone(), ep.port), name.to_string()) {
            bail!(
                "{ep} would be used by both {other} and {name}: change the ports in the settings \
                 or --metrics-port-offset"
            );
        }
        Ok(())
    }
}

fn metrics_endpoint(ep: &Endpoint, offset: u16) -> anyhow::Result<Endpoint> {
    let port = ep.port.checked_add(offset).with_context(|| {
        format!(
            "metrics port of {ep}: {} + --metrics-port-offset {offset} is more than 65535",
            ep.port
        )
    })?;
    Ok(Endpoint::new(ep.host.clone(), port))
}

/// The services of a cluster, in start order: the controller, the memory
/// servers, the GPU server(s). `settings_arg` is the `--settings` value the
/// services get; `remote` is `Some(metrics port offset)` in remote mode.
pub(super) fn plan(
    settings: &Settings,
    a: &UpArgs,
    settings_arg: &str,
    remote: Option<u16>,
) -> anyhow::Result<Vec<Planned>> {
    let s = settings_arg;
    let meta = settings.metadata_endpoint();
    // The same K and R for every service: explicit flags, so that a service
    // whose host has other settings still agrees.
    let emulated = match remote {
        None => a
            .emulate
            .resolve_measuring(Some(settings), settings.memservers().len() + 1)?,
        Some(_) => a.emulate.resolve(settings)?,
    };
    if emulated.is_some() && a.executor != "sim" {
        bail!(
            "an emulated link dilates the cluster's clock, and only the sim executor's times can be \
             dilated: use --executor sim (got --executor {})",
            a.executor
        );
    }
    let emulate_flags = |p: &mut Planned| {
        if let Some(e) = &emulated {
            let f = crate::emulate::EmulateArgs::flags_for(e);
            for pair in f.chunks(2) {
                p.flag(&pair[0], &pair[1]);
            }
        }
    };
    let on = |ep: &Endpoint| remote.map(|_| ep.host.clone());
    let mut ports = Ports::default();
    let mut plan = Vec::new();

    let mut c = Planned::new(
        "controller".into(),
        on(meta).as_deref(),
        &["controller", "--settings", s],
        &[
            "controller",
            "dispatcher",
            "metrics",
            "inference-http",
            "inference-grpc",
        ],
    );
    match remote {
        None => c.flag("--metrics", "127.0.0.1:0"),
        Some(offset) => {
            let client = Endpoint::new(
                meta.host.clone(),
                settings.config.load_balancer_port_for_client,
            );
            c.listen("--listen", "controller", meta, &mut ports)?;
            c.listen("--client-listen", "dispatcher", &client, &mut ports)?;
            for (flag, label, port) in [
                (
                    "--http-listen",
                    "inference-http",
                    settings.config.inference_http_port,
                ),
                (
                    "--grpc-listen",
                    "inference-grpc",
                    settings.config.inference_grpc_port,
                ),
            ] {
                let ep = Endpoint::new(meta.host.clone(), port);
                c.listen(flag, label, &ep, &mut ports)?;
            }
            c.listen(
                "--metrics",
                "metrics",
                &metrics_endpoint(meta, offset)?,
                &mut ports,
            )?;
        }
    }
    emulate_flags(&mut c);
    plan.push(c);

    for (i, m) in settings.memservers().iter().enumerate() {
        let mut p = Planned::new(
            format!("memserver-{}", i + 1),
            on(m).as_deref(),
            &["memserver", "--settings", s],
            &["memserver", "metrics"],
        );
        match remote {
            None => {
                let listen = m.socket_addr().with_context(|| {
                    format!("memory server {m} of storage_list.txt: local mode needs an IP address")
                })?;
                p.flag("--listen", listen);
                p.flag("--capacity", &a.memserver_capacity);
                p.flag("--metrics", "127.0.0.1:0");
            }
            Some(offset) => {
                p.listen("--listen", "memserver", m, &mut ports)?;
                p.advertise_if_named(m);
                p.flag("--capacity", &a.memserver_capacity);
                p.listen(
                    "--metrics",
                    "metrics",
                    &metrics_endpoint(m, offset)?,
                    &mut ports,
                )?;
                p.flag("--controller", meta);
            }
        }
        emulate_flags(&mut p);
        plan.push(p);
    }

    // Local: one GPU server with config.sh's GPUs. Remote: one per
    // serverhost_list.txt line, `slots` devices.
    let gpu_servers: Vec<(String, Option<(Endpoint, u32)>)> = match remote {
        None => vec![("runtime".into(), None)],
        Some(_) => {
            if settings.gpu_hosts.is_empty() {
                bail!(
                    "{} lists no GPU server: remote mode starts one `distmind runtime` per line \
                     (\"<address> slots=<num_gpus>\")",
                    settings.dir.join("serverhost_list.txt").display()
                );
            }
            settings
                .gpu_hosts
                .iter()
                .enumerate()
                .map(|(i, g)| {
                    let ep = Endpoint::new(g.host.clone(), settings.config.cache_port_for_server);
                    (format!("runtime-{}", i + 1), Some((ep, g.slots)))
                })
                .collect()
        }
    };
    for (name, at) in gpu_servers {
        let mut p = Planned::new(
            name,
            at.as_ref().map(|(ep, _)| ep.host.as_str()),
            &["runtime", "--settings", s],
            &["runtime", "metrics"],
        );
        p.flag("--executor", &a.executor);
        p.flag("--cache", &a.cache);
        match (&at, remote) {
            (Some((ep, slots)), Some(offset)) => {
                p.listen("--listen", "runtime", ep, &mut ports)?;
                p.advertise_if_named(ep);
                let devices: Vec<String> = (0..*slots).map(|d| d.to_string()).collect();
                p.flag("--devices", devices.join(","));
                p.flag("--controller", meta);
                p.listen(
                    "--metrics",
                    "metrics",
                    &metrics_endpoint(ep, offset)?,
                    &mut ports,
                )?;
            }
            _ => p.flag("--metrics", "127.0.0.1:0"),
        }
        emulate_flags(&mut p);
        plan.push(p);
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    fn planned(args: &[&str]) -> anyhow::Result<Vec<Planned>> {
        let cli = Cli::try_parse_from(std::iter::once("up").chain(args.iter().copied()))?;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("settings");
        let settings = crate::services::load_settings(&dir)?;
        plan(&settings, &cli.up, "settings", None)
    }

    #[test]
    fn every_service_gets_the_same_emulation() {
        let p = planned(&[
            "--executor",
            "sim",
            "--emulate-link",
            "100gbit",
            "--emulate-loopback",
            "1GB/s",
        ])
        .unwrap();
        assert!(p.len() >= 3);
        for s in &p {
            let at = s.argv.iter().position(|a| a == "--emulate-link");
            let at = at.unwrap_or_else(|| panic!("{}: {:?}", s.name, s.argv));
            assert_eq!(s.argv[at + 1], "12500MB/s", "{}", s.name);
            assert_eq!(s.argv[at + 2], "--emulate-loopback");
            assert_eq!(s.argv[at + 3], "1000MB/s", "{}", s.name);
        }
        // Without emulation, no service gets the flags.
        let p = planned(&["--executor", "sim"]).unwrap();
        assert!(p
            .iter()
            .all(|s| !s.argv.iter().any(|a| a.starts_with("--emulate"))));
    }

    #[test]
    fn an_emulated_cluster_needs_the_sim_executor() {
        let e = planned(&["--emulate-link", "100gbit", "--emulate-loopback", "1GB/s"]).unwrap_err();
        assert!(e.to_string().contains("--executor sim"), "{e}");
    }
}
