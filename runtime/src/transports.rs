//! The GPU server's data path, chosen in settings (`transport.json`,
//! `gpu_server` section, or the `runtime` command's flags): tcp, libfabric
//! (`fabric`, `fi_read`) or RDMA verbs (`verbs`, RDMA READ).
//!
//! What a one-sided transport needs from a memory server travels over its
//! control connection: `DataPaths` names the libfabric endpoint and key of
//! its arena, `VerbsConnect` exchanges queue-pair info (the control
//! connection then stays open as long as the queue pair lives).
//!
//! Falling back to tcp happens only where settings allow it
//! (`fallback_to_tcp`, the default), and is logged at warn level with the
//! reason, in two places:
//! * the chosen transport cannot start here (not built in, no provider, no
//!   RDMA device): the whole GPU server reads over tcp;
//! * one memory server does not serve the chosen data path: that memory
//!   server is read over tcp ([`Fallback`]), the others one-sided.
//!
//! Without permission, both are errors that say what was missing.

use std::sync::Arc;
use std::time::Duration;

use distmind_common::handshake::ClusterKey;
use distmind_common::proto::DataPaths;
use distmind_common::settings::{GpuServerTransport, TransportKind, FABRIC_PROVIDER_DEFAULT};
use distmind_memserver::{ClientError, MemserverClient};
use distmind_transport::tcp::{TcpOptions, TcpTransport};
use distmind_transport::{Fallback, Transport, TransportError};

/// Bounds connecting to a memory server's control port and each reply.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);

/// How a GPU server reads memory servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportChoice {
    pub kind: TransportKind,
    pub fabric_provider: String,
    pub verbs_device: Option<String>,
    pub verbs_gid_index: u8,
    pub fallback_to_tcp: bool,
    pub gpu_direct: bool,
}

impl Default for TransportChoice {
    fn default() -> Self {
        TransportChoice::from(&GpuServerTransport::default())
    }
}

impl From<&GpuServerTransport> for TransportChoice {
    fn from(g: &GpuServerTransport) -> Self {
        TransportChoice {
            kind: g.transport,
            fabric_provider: g.fabric_provider.clone(),
            verbs_device: g.verbs_device.clone(),
            verbs_gid_index: g.verbs_gid_index,
            fallback_to_tcp: g.fallback_to_tcp,
            gpu_direct: g.gpu_direct,
        }
    }
}

impl TransportChoice {
    /// One-sided reads over libfabric with `provider`.
    pub fn fabric(provider: &str) -> Self {
        TransportChoice {
            kind: TransportKind::Fabric,
            fabric_provider: provider.to_string(),
            ..TransportChoice::default()
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportOpenError {
    #[error("the {kind} transport cannot start: {why} (allow \"fallback_to_tcp\" in transport.json to read over tcp instead)")]
    Unavailable { kind: TransportKind, why: String },
    #[error("gpu_direct: {0}")]
    GpuDirect(String),
    #[error("cannot create the tcp transport: {0}")]
    Tcp(#[source] TransportError),
}

/// Opens the transport `choice` names; `tcp` carries the cluster key and
/// the tcp options (also used for fallbacks).
pub fn open_transport(
    choice: &TransportChoice,
    tcp: TcpOptions,
) -> Result<Arc<dyn Transport>, TransportOpenError> {
    if choice.gpu_direct {
        return Err(TransportOpenError::GpuDirect(gpu_direct_refusal(choice)));
    }
    let key = tcp.key.clone();
    let new_tcp = |tcp| -> Result<Arc<dyn Transport>, TransportOpenError> {
        Ok(Arc::new(
            TcpTransport::new(tcp).map_err(TransportOpenError::Tcp)?,
        ))
    };
    let primary: Result<Arc<dyn Transport>, String> = match choice.kind {
        TransportKind::Tcp => return new_tcp(tcp),
        TransportKind::Fabric => open_fabric(&choice.fabric_provider, key),
        TransportKind::Verbs => open_verbs(choice, key),
    };
    match primary {
        Ok(p) if choice.fallback_to_tcp => {
            log::info!(
                "data path: {} (memory servers that do not serve it are read over tcp)",
                choice.kind
            );
            Ok(Arc::new(Fallback::new(p, new_tcp(tcp)?, true)))
        }
        Ok(p) => {
            log::info!("data path: {} (no tcp fallback)", choice.kind);
            Ok(p)
        }
        Err(why) if choice.fallback_to_tcp => {
            log::warn!(
                "the {} transport cannot start: {why}; reading every memory server over tcp \
                 (settings allow the fallback)",
                choice.kind
            );
            new_tcp(tcp)
        }
        Err(why) => Err(TransportOpenError::Unavailable {
            kind: choice.kind,
            why,
        }),
    }
}

/// Why GPU-direct reads are refused here, in words.
fn gpu_direct_refusal(choice: &TransportChoice) -> String {
    let base = "reading parameters straight into GPU memory needs a provider with FI_HMEM_CUDA \
                (fabric) or GPUDirect RDMA (verbs, nvidia-peermem)";
    match choice.kind {
        TransportKind::Tcp => format!("{base}; tcp lands in host memory"),
        TransportKind::Fabric => {
            #[cfg(feature = "fabric")]
            let support = match distmind_transport::fabric::Info::get(&{
                let mut h = distmind_transport::fabric::Hints::new(&choice.fabric_provider);
                h.hmem = true;
                h
            }) {
                Ok(_) => "it reports FI_HMEM, but device-memory targets are not wired into the \
                          fetch path of this build"
                    .to_string(),
                Err(e) => format!("it reports no FI_HMEM support ({e})"),
            };
            #[cfg(not(feature = "fabric"))]
            let support = "this build has no fabric support".to_string();
            format!(
                "{base}; libfabric provider {:?}: {support}",
                choice.fabric_provider
            )
        }
        TransportKind::Verbs => {
            let peermem = std::path::Path::new("/sys/module/nvidia_peermem").exists();
            format!(
                "{base}; the nvidia_peermem kernel module is {}, and device-memory targets are \
                 not wired into the fetch path of this build",
                if peermem { "loaded" } else { "not loaded" }
            )
        }
    }
}

/// Asks the memory server at `addr` which one-sided paths it serves.
#[cfg_attr(not(any(feature = "fabric", feature = "verbs")), allow(dead_code))]
fn data_paths(
    addr: &str,
    key: &ClusterKey,
) -> Result<(MemserverClient, DataPaths), TransportError> {
    let mut c = MemserverClient::connect(addr, key, CONTROL_TIMEOUT).map_err(|e| match e {
        ClientError::Connect { source, .. } => TransportError::Connect {
            addr: addr.to_string(),
            source,
        },
        ClientError::Handshake { source, .. } => TransportError::Handshake {
            addr: addr.to_string(),
            source,
        },
        e => TransportError::Protocol {
            addr: addr.to_string(),
            detail: e.to_string(),
        },
    })?;
    let paths = c.data_paths().map_err(|e| TransportError::Protocol {
        addr: addr.to_string(),
        detail: format!("asking for its data paths: {e}"),
    })?;
    Ok((c, paths))
}

#[cfg(feature = "fabric")]
fn open_fabric(provider: &str, key: ClusterKey) -> Result<Arc<dyn Transport>, String> {
    use distmind_transport::fabric::{FabricTransport, RemoteArena, Resolver};
    /// Endpoint names are a sockaddr or a NIC address: far below this.
    const NAME_BYTES_MAX: usize = 4096;
    let want = provider.to_string();
    let resolver: Resolver = Box::new(move |addr: &str| {
        let (_, paths) = data_paths(addr, &key)?;
        let not_offered = |detail: String| TransportError::NotOffered {
            addr: addr.to_string(),
            detail,
        };
        let offer = paths.fabric.ok_or_else(|| {
            not_offered(
                "it serves no libfabric endpoint (start it with --fabric-provider, or set \
                 fabric_provider in transport.json)"
                    .into(),
            )
        })?;
        if offer.provider != want {
            return Err(not_offered(format!(
                "it serves libfabric provider {:?}, this GPU server uses {want:?}",
                offer.provider
            )));
        }
        let name = distmind_common::hex::decode(&offer.name, NAME_BYTES_MAX).map_err(|e| {
            TransportError::Protocol {
                addr: addr.to_string(),
                detail: format!("its fabric endpoint name: {e}"),
            }
        })?;
        Ok(RemoteArena {
            name,
            key: offer.key,
            base: offer.base,
            len: offer.len,
        })
    });
    FabricTransport::new(provider, resolver)
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .map_err(|e| format!("libfabric provider {provider:?}: {e}"))
}

#[cfg(not(feature = "fabric"))]
fn open_fabric(provider: &str, _key: ClusterKey) -> Result<Arc<dyn Transport>, String> {
    Err(format!(
        "this build has no libfabric support (provider {provider:?} asked for): rebuild with \
         `cargo build --release --features fabric` (needs libfabric-dev and libclang-dev)"
    ))
}

#[cfg(feature = "verbs")]
fn open_verbs(choice: &TransportChoice, key: ClusterKey) -> Result<Arc<dyn Transport>, String> {
    use distmind_transport::verbs::{
        Connector, QpInfo, VerbsOptions, VerbsTransport, QP_INFO_WIRE_BYTES,
    };
    let Some(device) = choice.verbs_device.as_deref() else {
        return Err(
            "no RDMA device named (verbs_device in transport.json, or --verbs-device)".into(),
        );
    };
    let connector: Connector = Box::new(move |addr: &str, ours: &QpInfo| {
        let (mut c, paths) = data_paths(addr, &key)?;
        if paths.verbs.is_none() {
            return Err(TransportError::NotOffered {
                addr: addr.to_string(),
                detail: "it serves no RDMA device (start it with --verbs-device, or set \
                         verbs_device in transport.json)"
                    .into(),
            });
        }
        let protocol = |detail: String| TransportError::Protocol {
            addr: addr.to_string(),
            detail,
        };
        let theirs = c
            .verbs_connect(&distmind_common::hex::encode(&ours.encode()))
            .map_err(|e| protocol(format!("verbs_connect: {e}")))?;
        let bytes = distmind_common::hex::decode(&theirs, QP_INFO_WIRE_BYTES)
            .map_err(|e| protocol(format!("its queue-pair info: {e}")))?;
        let info =
            QpInfo::decode(&bytes).map_err(|e| protocol(format!("its queue-pair info: {e}")))?;
        // The server's queue pair lives as long as this control connection.
        Ok((info, Box::new(c) as Box<dyn std::any::Any + Send + Sync>))
    });
    let mut opts = VerbsOptions::new(device);
    opts.rc.gid_index = choice.verbs_gid_index;
    VerbsTransport::new(opts, connector)
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "verbs"))]
fn open_verbs(choice: &TransportChoice, _key: ClusterKey) -> Result<Arc<dyn Transport>, String> {
    Err(format!(
        "this build has no RDMA verbs support (device {:?} asked for): rebuild with \
         `cargo build --release --features verbs` (needs libibverbs-dev and libclang-dev)",
        choice.verbs_device.as_deref().unwrap_or("none")
    ))
}

/// The provider used when a command-line flag names none.
pub fn default_provider() -> &'static str {
    FABRIC_PROVIDER_DEFAULT
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp() -> TcpOptions {
        TcpOptions::new(ClusterKey::from_secret(b"transports-test-key-0123456789"))
    }

    #[test]
    fn tcp_is_the_default() {
        let t = open_transport(&TransportChoice::default(), tcp()).unwrap();
        assert_eq!(t.name(), "tcp");
    }

    #[test]
    fn an_unavailable_transport_falls_back_only_when_allowed() {
        // No RDMA device here (and maybe no verbs build): either way it cannot start.
        let mut choice = TransportChoice {
            kind: TransportKind::Verbs,
            verbs_device: Some("distmind_absent_0".into()),
            ..TransportChoice::default()
        };
        let t = open_transport(&choice, tcp()).unwrap();
        assert_eq!(t.name(), "tcp", "fell back");
        choice.fallback_to_tcp = false;
        let e = open_transport(&choice, tcp())
            .err()
            .expect("refused")
            .to_string();
        assert!(e.starts_with("the verbs transport cannot start: "), "{e}");
        assert!(e.contains("distmind_absent_0"), "{e}");
        assert!(e.contains("fallback_to_tcp"), "{e}");
    }

    #[test]
    fn gpu_direct_is_refused_with_the_reason() {
        let choice = TransportChoice {
            gpu_direct: true,
            ..TransportChoice::fabric("tcp;ofi_rxm")
        };
        let e = open_transport(&choice, tcp())
            .err()
            .expect("refused")
            .to_string();
        assert!(e.starts_with("gpu_direct: "), "{e}");
        assert!(e.contains("FI_HMEM"), "{e}");
        assert!(e.contains("\"tcp;ofi_rxm\""), "{e}");
    }
}
