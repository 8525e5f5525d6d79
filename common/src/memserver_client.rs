//! Blocking control client for a memory server: allocate an extent, write
//! its bytes, commit it with its checksum, free it. The deploy tool, the GPU
//! servers' checkpoint writers and the controller (which frees the parts of
//! checkpoints that never completed) use it; `distmind_memserver::client`
//! is this module.

use std::io::{BufWriter, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::checksum;
use crate::handshake::{self, ClusterKey, HandshakeError};
use crate::limits::{CONTROL_FRAME_BYTES_MAX, WRITE_CHUNK_BYTES_MAX};
use crate::proto::{DataPaths, ErrorReply, MemserverReply, MemserverRequest, MemserverStats};
use crate::wire::{self, FrameKind, Role, WireError};

/// Bytes of parameters per write-chunk frame: the frame payload (offset
/// included) stays within [`WRITE_CHUNK_BYTES_MAX`].
pub const WRITE_CHUNK_DATA_BYTES_MAX: usize = WRITE_CHUNK_BYTES_MAX as usize - 8;
const _: () = assert!(WRITE_CHUNK_BYTES_MAX <= CONTROL_FRAME_BYTES_MAX as u64);

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("cannot connect to memory server {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("handshake with memory server {addr} failed: {source}")]
    Handshake {
        addr: String,
        #[source]
        source: HandshakeError,
    },
    #[error("connection to memory server {addr} failed: {source}")]
    Wire {
        addr: String,
        #[source]
        source: WireError,
    },
    #[error("memory server {addr} refused: {reply}")]
    Server { addr: String, reply: ErrorReply },
    #[error("memory server {addr} sent an unexpected reply: {reply}")]
    Unexpected { addr: String, reply: String },
}

impl ClientError {
    /// The server's error, when the server refused the request.
    pub fn server_error(&self) -> Option<&ErrorReply> {
        match self {
            ClientError::Server { reply, .. } => Some(reply),
            _ => None,
        }
    }
}

/// Connects to `addr`, proves the cluster key and declares `role`;
/// `timeout` bounds the connect and every later read and write.
pub fn connect_role(
    addr: &str,
    key: &ClusterKey,
    timeout: Duration,
    role: Role,
) -> Result<TcpStream, ClientError> {
    let connect_err = |source| ClientError::Connect {
        addr: addr.to_owned(),
        source,
    };
    let mut s = handshake::dial_sync(addr, timeout).map_err(connect_err)?;
    handshake::client_sync(&mut s, key, role).map_err(|source| ClientError::Handshake {
        addr: addr.to_owned(),
        source,
    })?;
    Ok(s)
}

pub struct MemserverClient {
    addr: String,
    stream: BufWriter<TcpStream>,
}

impl MemserverClient {
    /// Connects, proves the cluster key and opens a control connection.
    /// `timeout` bounds the connect and every later read and write.
    pub fn connect(addr: &str, key: &ClusterKey, timeout: Duration) -> Result<Self, ClientError> {
        let s = connect_role(addr, key, timeout, Role::Control)?;
        Ok(MemserverClient {
            addr: addr.to_owned(),
            stream: BufWriter::new(s),
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn wire_err(&self, source: WireError) -> ClientError {
        ClientError::Wire {
            addr: self.addr.clone(),
            source,
        }
    }

    fn request(&mut self, req: &MemserverRequest) -> Result<MemserverReply, ClientError> {
        wire::send_message_sync(&mut self.stream, req).map_err(|e| self.wire_err(e))?;
        self.stream.flush().map_err(|e| self.wire_err(e.into()))?;
        let reply: MemserverReply =
            wire::recv_message_sync(self.stream.get_mut(), CONTROL_FRAME_BYTES_MAX)
                .map_err(|e| self.wire_err(e))?;
        match reply {
            MemserverReply::Error(reply) => Err(ClientError::Server {
                addr: self.addr.clone(),
                reply,
            }),
            r => Ok(r),
        }
    }

    fn unexpected(&self, reply: MemserverReply) -> ClientError {
        ClientError::Unexpected {
            addr: self.addr.clone(),
            reply: format!("{reply:?}"),
        }
    }

    /// Reserves an extent of `bytes` for `owner`; returns its offset.
    pub fn alloc(&mut self, bytes: u64, owner: &str) -> Result<u64, ClientError> {
        match self.request(&MemserverRequest::Alloc {
            bytes,
            owner: owner.to_owned(),
        })? {
            MemserverReply::Allocated { offset } => Ok(offset),
            r => Err(self.unexpected(r)),
        }
    }

    /// Writes `data` at arena `offset` (inside an allocated, uncommitted
    /// extent). No reply: a rejected write is reported by [`Self::commit`].
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        let mut at = offset;
        for chunk in data.chunks(WRITE_CHUNK_DATA_BYTES_MAX) {
            wire::write_frame_sync(
                &mut self.stream,
                FrameKind::WriteChunk,
                &[&at.to_le_bytes(), chunk],
            )
            .map_err(|e| self.wire_err(e))?;
            at += chunk.len() as u64;
        }
        self.stream.flush().map_err(|e| self.wire_err(e.into()))
    }

    /// Makes the extent at `offset` readable if its bytes hash to `checksum`
    /// (xxh3-64, [`crate::checksum::checksum`]).
    pub fn commit(&mut self, offset: u64, checksum: u64) -> Result<(), ClientError> {
        let req = MemserverRequest::Commit {
            offset,
            checksum: checksum::to_hex(checksum),
        };
        match self.request(&req)? {
            MemserverReply::Committed { offset: o } if o == offset => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// Frees the extent at `offset`, allocated for `owner` (its space is
    /// reused once reads end). The server refuses, freeing nothing, when
    /// the extent there belongs to another owner.
    pub fn free(&mut self, offset: u64, owner: &str) -> Result<(), ClientError> {
        let req = MemserverRequest::Free {
            offset,
            owner: Some(owner.to_owned()),
        };
        match self.request(&req)? {
            MemserverReply::Freed { offset: o } if o == offset => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    pub fn stats(&mut self) -> Result<MemserverStats, ClientError> {
        match self.request(&MemserverRequest::Stats)? {
            MemserverReply::Stats(s) => Ok(s),
            r => Err(self.unexpected(r)),
        }
    }

    /// The one-sided data paths the server offers besides tcp.
    pub fn data_paths(&mut self) -> Result<DataPaths, ClientError> {
        match self.request(&MemserverRequest::DataPaths)? {
            MemserverReply::DataPaths(d) => Ok(d),
            r => Err(self.unexpected(r)),
        }
    }

    /// Sends this side's verbs `QpInfo` (hex) and returns the server's. The
    /// server's queue pair lives as long as this connection: keep the client.
    pub fn verbs_connect(&mut self, qp_hex: &str) -> Result<String, ClientError> {
        match self.request(&MemserverRequest::VerbsConnect {
            qp: qp_hex.to_owned(),
        })? {
            MemserverReply::VerbsConnected { qp } => Ok(qp),
            r => Err(self.unexpected(r)),
        }
    }
}
