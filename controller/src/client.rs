//! Blocking client of the controller's metadata port, for the deploy tool,
//! memory servers' heartbeats, benches and tests.
//!
//! One request in flight per client; every call waits for its reply (bounded
//! by the timeout given to [`ControllerClient::connect`]). After an IO or
//! framing error the connection is unusable and every later call says so:
//! connect again.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use distmind_common::handshake::{self, ClusterKey, HandshakeError};
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{
    ControllerReply, ControllerRequest, ErrorCode, ErrorReply, MemserverInfo, ModelEntry,
    ModelSummary, RuntimeInfo,
};
use distmind_common::wire::{self, FrameHeader, FrameKind, Role, WireError};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("cannot connect to the controller at {addr}: {source} (is it running? check settings/storage_list.txt)")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("handshake with the controller at {addr} failed: {source}")]
    Handshake {
        addr: String,
        #[source]
        source: HandshakeError,
    },
    #[error("connection to the controller at {addr} failed: {source}")]
    Wire {
        addr: String,
        #[source]
        source: WireError,
    },
    #[error("the controller at {addr} refused the request: {reply}")]
    Server { addr: String, reply: ErrorReply },
    #[error("the request is {len} bytes, more than a control frame's {max} bytes")]
    RequestTooLarge { len: usize, max: u32 },
    #[error("the controller at {addr} answered {request} with an unexpected reply: {reply}")]
    UnexpectedReply {
        addr: String,
        request: &'static str,
        reply: String,
    },
    #[error("the connection to the controller at {addr} broke earlier; connect again")]
    Broken { addr: String },
}

impl ClientError {
    /// The controller's error, when it refused the request.
    pub fn error_reply(&self) -> Option<&ErrorReply> {
        match self {
            ClientError::Server { reply, .. } => Some(reply),
            _ => None,
        }
    }

    /// The controller's error code, when it refused the request.
    pub fn code(&self) -> Option<ErrorCode> {
        self.error_reply().map(|r| r.code)
    }
}

/// A blocking connection to the controller.
#[derive(Debug)]
pub struct ControllerClient {
    stream: TcpStream,
    addr: String,
    broken: bool,
}

impl ControllerClient {
    /// Connects (trying every address `addr` resolves to), proves the cluster
    /// key, and uses `timeout` for the connect and for every reply.
    pub fn connect(addr: &str, key: &ClusterKey, timeout: Duration) -> Result<Self, ClientError> {
        let connect_err = |source| ClientError::Connect {
            addr: addr.to_string(),
            source,
        };
        let mut stream = handshake::dial_sync(addr, timeout).map_err(connect_err)?;
        handshake::client_sync(&mut stream, key, Role::Control).map_err(|source| {
            ClientError::Handshake {
                addr: addr.to_string(),
                source,
            }
        })?;
        Ok(ControllerClient {
            stream,
            addr: addr.to_string(),
            broken: false,
        })
    }

    /// The address this client connected to, as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sends one request and waits for its reply; an `ErrorReply` becomes
    /// [`ClientError::Server`].
    pub fn request(&mut self, req: &ControllerRequest) -> Result<ControllerReply, ClientError> {
        if self.broken {
            return Err(ClientError::Broken {
                addr: self.addr.clone(),
            });
        }
        let payload = wire::encode_message(req);
        if payload.len() > CONTROL_FRAME_BYTES_MAX as usize {
            return Err(ClientError::RequestTooLarge {
                len: payload.len(),
                max: CONTROL_FRAME_BYTES_MAX,
            });
        }
        let header = FrameHeader {
            kind: FrameKind::Message,
            len: payload.len() as u32,
        }
        .encode();
        let mut frame = Vec::with_capacity(header.len() + payload.len());
        frame.extend_from_slice(&header);
        frame.extend_from_slice(&payload);
        let result = self
            .stream
            .write_all(&frame)
            .map_err(WireError::from)
            .and_then(|()| {
                wire::recv_message_sync::<_, ControllerReply>(
                    &mut self.stream,
                    CONTROL_FRAME_BYTES_MAX,
                )
            });
        match result {
            Ok(ControllerReply::Error(reply)) => Err(ClientError::Server {
                addr: self.addr.clone(),
                reply,
            }),
            Ok(reply) => Ok(reply),
            Err(source) => {
                self.broken = true;
                Err(ClientError::Wire {
                    addr: self.addr.clone(),
                    source,
                })
            }
        }
    }

    fn unexpected(&self, request: &'static str, reply: ControllerReply) -> ClientError {
        ClientError::UnexpectedReply {
            addr: self.addr.clone(),
            request,
            reply: format!("{reply:?}"),
        }
    }

    /// Registers a memory server; returns its id and the heartbeat interval.
    pub fn register_memserver(
        &mut self,
        addr: &str,
        capacity_bytes: u64,
        boot_id: u64,
    ) -> Result<(u32, Duration), ClientError> {
        let req = ControllerRequest::RegisterMemserver {
            addr: addr.to_string(),
            capacity_bytes,
            boot_id,
        };
        match self.request(&req)? {
            ControllerReply::Registered {
                memserver,
                heartbeat_interval_ms,
            } => Ok((memserver, Duration::from_millis(heartbeat_interval_ms))),
            r => Err(self.unexpected("RegisterMemserver", r)),
        }
    }

    pub fn heartbeat(
        &mut self,
        memserver: u32,
        boot_id: u64,
        used_bytes: u64,
    ) -> Result<(), ClientError> {
        match self.request(&ControllerRequest::Heartbeat {
            memserver,
            boot_id,
            used_bytes,
        })? {
            ControllerReply::HeartbeatOk => Ok(()),
            r => Err(self.unexpected("Heartbeat", r)),
        }
    }

    pub fn list_memservers(&mut self) -> Result<Vec<MemserverInfo>, ClientError> {
        match self.request(&ControllerRequest::ListMemservers)? {
            ControllerReply::Memservers { memservers } => Ok(memservers),
            r => Err(self.unexpected("ListMemservers", r)),
        }
    }

    /// Adds or replaces a model; returns the entry it replaced.
    pub fn put_model(&mut self, entry: ModelEntry) -> Result<Option<ModelEntry>, ClientError> {
        match self.request(&ControllerRequest::PutModel {
            entry: Box::new(entry),
        })? {
            ControllerReply::Put { replaced } => Ok(replaced.map(|b| *b)),
            r => Err(self.unexpected("PutModel", r)),
        }
    }

    /// A model's entry; `ErrorCode::UnknownModel` if it is not in the catalog.
    pub fn get_model(&mut self, name: &str) -> Result<ModelEntry, ClientError> {
        match self.request(&ControllerRequest::GetModel {
            name: name.to_string(),
        })? {
            ControllerReply::Model { entry } => Ok(*entry),
            r => Err(self.unexpected("GetModel", r)),
        }
    }

    /// Removes a model; returns its entry (whose extents the caller frees).
    pub fn remove_model(&mut self, name: &str) -> Result<ModelEntry, ClientError> {
        match self.request(&ControllerRequest::RemoveModel {
            name: name.to_string(),
        })? {
            ControllerReply::Removed { entry } => Ok(*entry),
            r => Err(self.unexpected("RemoveModel", r)),
        }
    }

    /// Every model in the catalog, sorted by name.
    pub fn list_models(&mut self) -> Result<Vec<ModelSummary>, ClientError> {
        match self.request(&ControllerRequest::ListModels)? {
            ControllerReply::Models { models } => Ok(models),
            r => Err(self.unexpected("ListModels", r)),
        }
    }

    /// Registers a GPU server (runtime); returns its id and the heartbeat interval.
    pub fn register_runtime(
        &mut self,
        addr: &str,
        devices: u32,
        executor: &str,
        boot_id: u64,
    ) -> Result<(u32, Duration), ClientError> {
        let req = ControllerRequest::RegisterRuntime {
            addr: addr.to_string(),
            devices,
            executor: executor.to_string(),
            boot_id,
            device_ids: Vec::new(),
            cache_bytes: 0,
            device_bytes: 0,
            resident_models_max: 0,
        };
        match self.request(&req)? {
            ControllerReply::RuntimeRegistered {
                runtime,
                heartbeat_interval_ms,
            } => Ok((runtime, Duration::from_millis(heartbeat_interval_ms))),
            r => Err(self.unexpected("RegisterRuntime", r)),
        }
    }

    pub fn runtime_heartbeat(
        &mut self,
        runtime: u32,
        boot_id: u64,
        queued: u64,
    ) -> Result<(), ClientError> {
        match self.request(&ControllerRequest::RuntimeHeartbeat {
            runtime,
            boot_id,
            queued,
            snapshot: None,
        })? {
            ControllerReply::HeartbeatOk => Ok(()),
            r => Err(self.unexpected("RuntimeHeartbeat", r)),
        }
    }

    /// Every registered GPU server, by id.
    pub fn list_runtimes(&mut self) -> Result<Vec<RuntimeInfo>, ClientError> {
        match self.request(&ControllerRequest::ListRuntimes)? {
            ControllerReply::Runtimes { runtimes } => Ok(runtimes),
            r => Err(self.unexpected("ListRuntimes", r)),
        }
    }
}
