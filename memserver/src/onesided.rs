//! One-sided data paths: the arena registered once with libfabric (feature
//! `fabric`) and/or RDMA verbs (feature `verbs`), so that GPU servers read it
//! without this process copying a byte. The tcp data path is always served
//! next to them, on the same port.
//!
//! What a client needs travels over the control connection:
//! * `DataPaths` answers the [`DataPaths`] offer: for libfabric the
//!   provider, endpoint name, key, base address and length of the arena;
//!   for verbs the device name.
//! * `VerbsConnect` carries the client's `QpInfo`; the server creates an RC
//!   queue pair for it, answers with its own (the arena's rkey, address and
//!   length) and destroys it when that control connection closes.
//!
//! **Read leases.** A one-sided read takes no lease: the server never sees
//! it. Two rules keep readers from ever using wrong bytes:
//! 1. Every slice a GPU server reads is checksummed against the catalog when
//!    it lands (`runtime::fetch`); a read that raced a rewrite fails the check
//!    and is retried on a replica. This is what guarantees correctness.
//! 2. While a one-sided path is on, a freed Committed extent is held by a read
//!    lease for [`FREE_GRACE`] before its space can be reused, so that reads
//!    posted before the catalog stopped naming it finish on the old bytes
//!    instead of failing their checksum. This keeps retries rare; it is not
//!    needed for correctness.
//!
//! **Progress.** Providers with manual progress (`tcp;ofi_rxm`) move data only
//! while someone drives them: a thread sleeps in `fi_cq_sread` on the serving
//! endpoint's completion queue, which wakes when the provider has work (no
//! idle spinning; measured on loopback: the same GB/s as a busy poll).

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use distmind_common::proto::{DataPaths, ErrorCode, ErrorReply};
use distmind_transport::HostBuffer;

/// How long a freed extent's bytes stay unchanged while one-sided paths are on.
pub const FREE_GRACE: Duration = Duration::from_secs(5);
/// Verbs queue pairs one control connection may hold.
pub const VERBS_QPS_PER_CONNECTION_MAX: usize = 16;

/// Which one-sided paths a memory server serves; both off by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OneSidedConfig {
    /// libfabric provider to serve the arena on: `tcp;ofi_rxm`,
    /// `verbs;ofi_rxm` or `efa`. Needs the `fabric` build feature.
    pub fabric_provider: Option<String>,
    /// Local address the libfabric endpoint binds (`FI_SOURCE`); `None`: the
    /// provider's first interface.
    pub fabric_source: Option<String>,
    /// RDMA device to serve the arena on (`mlx5_0`). Needs the `verbs` feature.
    pub verbs_device: Option<String>,
    /// The device port's GID index (RoCE v2: often 1 or 3).
    pub verbs_gid_index: u8,
}

impl OneSidedConfig {
    pub fn any(&self) -> bool {
        self.fabric_provider.is_some() || self.verbs_device.is_some()
    }
}

/// A serving path that could not start.
#[derive(Debug, thiserror::Error)]
pub enum OneSidedError {
    #[error("{path} data path requested, but this build has no {path} support: rebuild with `cargo build --release --features {path}`")]
    NotBuilt { path: &'static str },
    #[error("cannot serve the arena over libfabric provider {provider:?}: {detail}")]
    Fabric { provider: String, detail: String },
    #[error("cannot serve the arena over RDMA device {device:?}: {detail}")]
    Verbs { device: String, detail: String },
}

/// The running one-sided paths of one memory server.
pub(crate) struct OneSided {
    offer: DataPaths,
    #[cfg(feature = "fabric")]
    _fabric: Option<fabric::Serving>,
    #[cfg(feature = "verbs")]
    verbs: Option<distmind_transport::verbs::VerbsServer>,
}

impl std::fmt::Debug for OneSided {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OneSided")
            .field("offer", &self.offer)
            .finish()
    }
}

impl OneSided {
    /// Registers `arena` with every path `config` asks for (once, here).
    pub fn start(config: &OneSidedConfig, arena: &Arc<HostBuffer>) -> Result<Self, OneSidedError> {
        #[cfg_attr(not(any(feature = "fabric", feature = "verbs")), allow(unused_mut))]
        let mut offer = DataPaths::default();
        #[cfg(feature = "fabric")]
        let fabric = match &config.fabric_provider {
            None => None,
            Some(provider) => {
                let s = fabric::Serving::start(provider, config.fabric_source.as_deref(), arena)
                    .map_err(|e| OneSidedError::Fabric {
                        provider: provider.clone(),
                        detail: e.to_string(),
                    })?;
                offer.fabric = Some(s.offer.clone());
                log::info!(
                    "serving the arena over libfabric {} ({} bytes)",
                    s.offer.provider,
                    s.offer.len
                );
                Some(s)
            }
        };
        #[cfg(not(feature = "fabric"))]
        if config.fabric_provider.is_some() {
            return Err(OneSidedError::NotBuilt { path: "fabric" });
        }
        #[cfg(feature = "verbs")]
        let verbs = match &config.verbs_device {
            None => None,
            Some(device) => {
                use distmind_transport::verbs::{VerbsOptions, VerbsServer};
                let mut opts = VerbsOptions::new(device);
                opts.rc.gid_index = config.verbs_gid_index;
                let server = VerbsServer::new(&opts, Arc::clone(arena)).map_err(|e| {
                    OneSidedError::Verbs {
                        device: device.clone(),
                        detail: e.to_string(),
                    }
                })?;
                offer.verbs = Some(distmind_common::proto::VerbsOffer {
                    device: device.clone(),
                });
                log::info!("serving the arena over RDMA device {device}");
                Some(server)
            }
        };
        #[cfg(not(feature = "verbs"))]
        if config.verbs_device.is_some() {
            return Err(OneSidedError::NotBuilt { path: "verbs" });
        }
        #[cfg(not(any(feature = "fabric", feature = "verbs")))]
        let _ = arena;
        Ok(OneSided {
            offer,
            #[cfg(feature = "fabric")]
            _fabric: fabric,
            #[cfg(feature = "verbs")]
            verbs,
        })
    }

    pub fn offer(&self) -> &DataPaths {
        &self.offer
    }

    /// Whether any one-sided path is on (then frees get [`FREE_GRACE`]).
    pub fn enabled(&self) -> bool {
        self.offer.fabric.is_some() || self.offer.verbs.is_some()
    }

    /// Connects a queue pair to the client's (`qp_hex`: its `QpInfo`);
    /// returns ours, hex, and a guard that keeps the queue pair alive.
    pub fn verbs_connect(
        &self,
        qp_hex: &str,
    ) -> Result<(String, Box<dyn Any + Send + Sync>), ErrorReply> {
        #[cfg(feature = "verbs")]
        {
            use distmind_transport::verbs::{QpInfo, QP_INFO_WIRE_BYTES};
            let Some(server) = &self.verbs else {
                return Err(not_served("verbs"));
            };
            let bytes = distmind_common::hex::decode(qp_hex, QP_INFO_WIRE_BYTES).map_err(|e| {
                ErrorReply::new(ErrorCode::BadRequest, format!("verbs_connect qp: {e}"))
            })?;
            let client = QpInfo::decode(&bytes).map_err(|e| {
                ErrorReply::new(ErrorCode::BadRequest, format!("verbs_connect qp: {e}"))
            })?;
            let (ours, guard) = server
                .accept(&client)
                .map_err(|e| ErrorReply::new(ErrorCode::Internal, format!("verbs_connect: {e}")))?;
            Ok((
                distmind_common::hex::encode(&ours.encode()),
                Box::new(guard),
            ))
        }
        #[cfg(not(feature = "verbs"))]
        {
            let _ = qp_hex;
            Err(not_served("verbs"))
        }
    }
}

fn not_served(path: &str) -> ErrorReply {
    ErrorReply::new(
        ErrorCode::Unsupported,
        format!(
            "this memory server does not serve the {path} data path (start it with \
             --{path}-{}; tcp is always served)",
            if path == "verbs" {
                "device"
            } else {
                "provider"
            }
        ),
    )
}

#[cfg(feature = "fabric")]
mod fabric {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::thread::JoinHandle;
    use std::time::Duration;

    use distmind_common::proto::FabricOffer;
    use distmind_transport::fabric::{
        Access, AddressVector, CompletionQueue, Domain, Endpoint, Fabric, FabricError, Hints, Info,
        MemoryRegion, RemoteArena, CQ_SIZE_DEFAULT,
    };
    use distmind_transport::HostBuffer;

    /// How long the progress thread sleeps in `fi_cq_sread` at most; also
    /// how long shutdown waits for it.
    const PROGRESS_WAIT: Duration = Duration::from_millis(100);
    /// The arena registration's requested key (providers may choose their own).
    const ARENA_KEY: u64 = 1;

    /// An endpoint serving reads of the arena, and its progress thread.
    pub(super) struct Serving {
        pub offer: FabricOffer,
        stop: Arc<AtomicBool>,
        progress: Option<JoinHandle<()>>,
        // Dropped after the thread stopped (Drop below), children first.
        _arena: MemoryRegion,
        _ep: Endpoint,
    }

    impl Serving {
        pub fn start(
            provider: &str,
            source: Option<&str>,
            arena: &Arc<HostBuffer>,
        ) -> Result<Serving, FabricError> {
            let mut hints = Hints::new(provider);
            hints.source = source.map(|host| (host.to_string(), "0".to_string()));
            let info = Info::get(&hints)?;
            let fabric = Fabric::open(&info)?;
            let domain = Domain::open(&fabric)?;
            let av = AddressVector::open(&domain)?;
            let cq = CompletionQueue::open_waitable(&domain, CQ_SIZE_DEFAULT)?;
            let ep = Endpoint::open(&domain, &av, &cq)?;
            let mr =
                MemoryRegion::register(&domain, Arc::clone(arena), Access::RemoteRead, ARENA_KEY)?;
            let remote = RemoteArena::serving(&ep, &mr)?;
            let offer = FabricOffer {
                provider: info.provider_name(),
                name: distmind_common::hex::encode(&remote.name),
                key: remote.key,
                base: remote.base,
                len: remote.len,
            };
            let stop = Arc::new(AtomicBool::new(false));
            let flag = Arc::clone(&stop);
            let progress = std::thread::Builder::new()
                .name("fabric-progress".into())
                .spawn(move || {
                    let mut seen = Vec::new();
                    while !flag.load(Ordering::Relaxed) {
                        seen.clear();
                        if let Err(e) = cq.wait(&mut seen, PROGRESS_WAIT) {
                            log::error!("fabric progress: {e}; one-sided reads stop being served");
                            return;
                        }
                    }
                })
                .map_err(|e| FabricError {
                    call: "spawn progress thread",
                    code: e.raw_os_error().unwrap_or(0),
                    message: e.to_string(),
                })?;
            Ok(Serving {
                offer,
                stop,
                progress: Some(progress),
                _arena: mr,
                _ep: ep,
            })
        }
    }

    impl Drop for Serving {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            if let Some(t) = self.progress.take() {
                let _ = t.join();
            }
        }
    }
}
