//! `settings/transport.json` (**new**, optional): which data paths memory
//! servers serve and GPU servers use. Without the file: tcp everywhere.
//!
//! ```json
//! {
//!   "memserver": { "fabric_provider": "tcp;ofi_rxm" },
//!   "memserver_overrides": { "10.0.0.7:7778": { "verbs_device": "mlx5_0" } },
//!   "gpu_server": { "transport": "fabric", "fabric_provider": "tcp;ofi_rxm",
//!                   "fallback_to_tcp": true },
//!   "gpu_server_overrides": { "10.0.0.9": { "transport": "tcp" } }
//! }
//! ```
//!
//! An override replaces the default section as a whole for that memory
//! server (`host:port`, as in `storage_list.txt`) or GPU server host.
//! Unknown keys are errors, like every JSON settings file here.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::controller_json::{from_json, Checker};
use super::error::{read_optional, Result};

/// The libfabric providers the data path is built and tested for.
pub const FABRIC_PROVIDERS: [&str; 3] = ["efa", "verbs;ofi_rxm", "tcp;ofi_rxm"];
/// The provider when settings name none: plain Ethernet.
pub const FABRIC_PROVIDER_DEFAULT: &str = "tcp;ofi_rxm";

/// A GPU server's data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// Streams of read requests over TCP; every memory server serves it.
    #[default]
    Tcp,
    /// libfabric `fi_read` (EFA, verbs or tcp providers).
    Fabric,
    /// RDMA READ over an RC queue pair (InfiniBand, RoCE).
    Verbs,
}

impl TransportKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Fabric => "fabric",
            TransportKind::Verbs => "verbs",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "tcp" => Ok(TransportKind::Tcp),
            "fabric" => Ok(TransportKind::Fabric),
            "verbs" => Ok(TransportKind::Verbs),
            _ => Err(format!(
                "unknown transport {s:?}: expected tcp, fabric or verbs"
            )),
        }
    }
}

/// What one memory server serves besides tcp.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemserverTransport {
    /// Serve the arena over this libfabric provider (default: off).
    #[serde(default)]
    pub fabric_provider: Option<String>,
    /// Serve the arena over this RDMA device, e.g. `mlx5_0` (default: off).
    #[serde(default)]
    pub verbs_device: Option<String>,
    /// GID index of the device's port 1 (default 0; RoCE v2: often 1 or 3).
    #[serde(default)]
    pub verbs_gid_index: u8,
}

/// How one GPU server reads memory servers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuServerTransport {
    /// Default `tcp`.
    #[serde(default)]
    pub transport: TransportKind,
    /// Default [`FABRIC_PROVIDER_DEFAULT`].
    #[serde(default = "default_provider")]
    pub fabric_provider: String,
    /// Required with `"transport": "verbs"`.
    #[serde(default)]
    pub verbs_device: Option<String>,
    #[serde(default)]
    pub verbs_gid_index: u8,
    /// Read over tcp where the chosen path cannot be used (not built, no
    /// device, a memory server that does not serve it); logged at warn
    /// level with the reason. Default true.
    #[serde(default = "default_true")]
    pub fallback_to_tcp: bool,
    /// Read parameters straight into registered GPU memory (FI_HMEM_CUDA /
    /// GPUDirect RDMA), skipping the host cache. Default false.
    #[serde(default)]
    pub gpu_direct: bool,
}

impl Default for GpuServerTransport {
    fn default() -> Self {
        GpuServerTransport {
            transport: TransportKind::Tcp,
            fabric_provider: default_provider(),
            verbs_device: None,
            verbs_gid_index: 0,
            fallback_to_tcp: true,
            gpu_direct: false,
        }
    }
}

fn default_provider() -> String {
    FABRIC_PROVIDER_DEFAULT.to_string()
}

fn default_true() -> bool {
    true
}

/// `transport.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportSettings {
    #[serde(default)]
    pub memserver: MemserverTransport,
    /// By `host:port` of a memory server (as `storage_list.txt` names it).
    #[serde(default)]
    pub memserver_overrides: BTreeMap<String, MemserverTransport>,
    #[serde(default)]
    pub gpu_server: GpuServerTransport,
    /// By GPU server host.
    #[serde(default)]
    pub gpu_server_overrides: BTreeMap<String, GpuServerTransport>,
    /// Emulate faster links by time dilation (default: off). Every process
    /// of the cluster reads it, so they all run on the same clock.
    #[serde(default)]
    pub emulate: Option<EmulateSection>,
}

/// `"emulate": {"link": "100gbit", "loopback": "1GB/s"}`: each host's data
/// path is held at `loopback` and the cluster's clock is dilated by
/// `link / loopback` (see [`crate::emulate`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmulateSection {
    /// The link rate emulated, e.g. `100gbit` or `400gbit`.
    pub link: String,
    /// The rate every host's token bucket holds its data path to on
    /// loopback, e.g. `1GB/s`; keep the sum of the hosts' rates under what
    /// loopback sustains.
    pub loopback: String,
}

/// Checks a provider name against [`FABRIC_PROVIDERS`].
pub fn check_fabric_provider(provider: &str) -> std::result::Result<(), String> {
    if FABRIC_PROVIDERS.contains(&provider) {
        Ok(())
    } else {
        Err(format!(
            "unknown libfabric provider {provider:?}: expected one of {}",
            FABRIC_PROVIDERS.join(", ")
        ))
    }
}

impl TransportSettings {
    pub fn load_optional(path: &Path) -> Result<Option<Self>> {
        read_optional(path)?
            .map(|text| Self::parse(path, &text))
            .transpose()
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let s: Self = from_json(path, text)?;
        let check = Checker { path, text };
        let memservers = std::iter::once(("memserver".to_string(), &s.memserver)).chain(
            s.memserver_overrides
                .iter()
                .map(|(k, v)| (format!("memserver_overrides.{k}"), v)),
        );
        for (field, m) in memservers {
            if let Some(p) = &m.fabric_provider {
                check_fabric_provider(p).map_err(|e| check.err(&field, e))?;
            }
            if m.verbs_device.as_deref().is_some_and(str::is_empty) {
                return Err(check.err(&field, "verbs_device is empty: name a device (mlx5_0)"));
            }
        }
        let gpus = std::iter::once(("gpu_server".to_string(), &s.gpu_server)).chain(
            s.gpu_server_overrides
                .iter()
                .map(|(k, v)| (format!("gpu_server_overrides.{k}"), v)),
        );
        for (field, g) in gpus {
            check_fabric_provider(&g.fabric_provider).map_err(|e| check.err(&field, e))?;
            if g.transport == TransportKind::Verbs
                && g.verbs_device.as_deref().is_none_or(str::is_empty)
            {
                return Err(check.err(
                    &field,
                    "\"transport\": \"verbs\" needs \"verbs_device\" (the RDMA device to use, e.g. mlx5_0)",
                ));
            }
            if g.gpu_direct && g.transport == TransportKind::Tcp {
                return Err(check.err(
                    &field,
                    "\"gpu_direct\": true needs a one-sided transport (fabric or verbs); tcp lands in host memory",
                ));
            }
        }
        for key in s.memserver_overrides.keys() {
            let ok = key
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return Err(check.err(
                    "memserver_overrides",
                    format!("key {key:?} is not \"host:port\" of a memory server"),
                ));
            }
        }
        if let Some(e) = &s.emulate {
            crate::emulate::EmulatedLink::parse(&e.link, &e.loopback)
                .map_err(|why| check.err("emulate", why))?;
        }
        Ok(s)
    }

    /// The emulated link of the `emulate` section (checked by [`Self::parse`]).
    pub fn emulated_link(&self) -> Option<crate::emulate::EmulatedLink> {
        self.emulate.as_ref().map(|e| {
            crate::emulate::EmulatedLink::parse(&e.link, &e.loopback)
                .expect("checked when the settings were parsed")
        })
    }

    /// What the memory server at `host:port` serves.
    pub fn memserver_for(&self, host_port: &str) -> &MemserverTransport {
        self.memserver_overrides
            .get(host_port)
            .unwrap_or(&self.memserver)
    }

    /// How the GPU server on `host` reads.
    pub fn gpu_server_for(&self, host: &str) -> &GpuServerTransport {
        self.gpu_server_overrides
            .get(host)
            .unwrap_or(&self.gpu_server)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<TransportSettings> {
        TransportSettings::parse(Path::new("settings/transport.json"), text)
    }

    #[test]
    fn emulate_section_is_checked() {
        let s = parse(r#"{"emulate": {"link": "100gbit", "loopback": "1GB/s"}}"#).unwrap();
        let e = s.emulated_link().unwrap();
        assert!((e.dilation() - 12.5).abs() < 1e-9);
        assert_eq!(parse("{}").unwrap().emulated_link(), None);
        let err = parse(r#"{"emulate": {"link": "1gbit", "loopback": "1GB/s"}}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("emulate") && err.contains("at least"), "{err}");
        let err = parse(r#"{"emulate": {"link": "100 furlongs", "loopback": "1GB/s"}}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown unit"), "{err}");
    }

    #[test]
    fn defaults_are_tcp_everywhere_with_fallback() {
        let s = parse("{}").unwrap();
        assert_eq!(s, TransportSettings::default());
        assert_eq!(s.gpu_server_for("h").transport, TransportKind::Tcp);
        assert!(s.gpu_server_for("h").fallback_to_tcp);
        assert_eq!(s.memserver_for("h:1").fabric_provider, None);
    }

    #[test]
    fn overrides_replace_the_default_section() {
        let s = parse(
            r#"{
  "memserver": {"fabric_provider": "tcp;ofi_rxm"},
  "memserver_overrides": {"10.0.0.7:7778": {"verbs_device": "mlx5_0", "verbs_gid_index": 3}},
  "gpu_server": {"transport": "fabric", "fabric_provider": "efa", "fallback_to_tcp": false},
  "gpu_server_overrides": {"10.0.0.9": {"transport": "verbs", "verbs_device": "mlx5_1"}}
}"#,
        )
        .unwrap();
        assert_eq!(
            s.memserver_for("10.0.0.8:7778").fabric_provider.as_deref(),
            Some("tcp;ofi_rxm")
        );
        let o = s.memserver_for("10.0.0.7:7778");
        assert_eq!((o.fabric_provider.as_deref(), o.verbs_gid_index), (None, 3));
        let g = s.gpu_server_for("10.0.0.1");
        assert_eq!(
            (g.transport, g.fabric_provider.as_str(), g.fallback_to_tcp),
            (TransportKind::Fabric, "efa", false)
        );
        let g = s.gpu_server_for("10.0.0.9");
        assert_eq!(
            (g.transport, g.verbs_device.as_deref(), g.fallback_to_tcp),
            (TransportKind::Verbs, Some("mlx5_1"), true)
        );
    }

    #[test]
    fn errors_name_the_field_and_what_is_wrong() {
        let e = parse(
            "{\n  \"gpu_server\": {\"transport\": \"fabric\", \"fabric_provider\": \"psm3\"}\n}",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("settings/transport.json:2"), "{e}");
        assert!(
            e.contains("\"psm3\"") && e.contains("efa, verbs;ofi_rxm, tcp;ofi_rxm"),
            "{e}"
        );
        let e = parse("{\"gpu_server\": {\"transport\": \"verbs\"}}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs \"verbs_device\""), "{e}");
        let e = parse("{\"gpu_server\": {\"gpu_direct\": true}}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("one-sided transport"), "{e}");
        let e = parse("{\"gpu_server\": {\"transport\": \"udp\"}}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("udp"), "{e}");
        let e = parse("{\"memserver\": {\"provider\": \"efa\"}}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("provider"), "{e}");
        let e = parse("{\"memserver_overrides\": {\"10.0.0.7\": {}}}")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not \\\"host:port\\\"") || e.contains("not \"host:port\""),
            "{e}"
        );
    }
}
