//! Control-plane messages (JSON in [`crate::wire`] message frames).
//!
//! Every request gets exactly one reply, in order, on the same connection.
//! A request that cannot be served gets [`ErrorReply`] naming what was wrong;
//! the connection stays usable unless the framing itself broke.

use serde::{Deserialize, Serialize};

/// Why a request failed, for callers that branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadRequest,
    UnknownModel,
    UnknownExtent,
    Full,
    ChecksumMismatch,
    Busy,
    ShuttingDown,
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
}

impl ErrorReply {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorReply {
            code,
            message: message.into(),
        }
    }
}

/// Requests on a memory server's control connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum MemserverRequest {
    /// Reserve `bytes` of the arena for `owner` (a model name, for accounting).
    /// Replies `Allocated`. The extent is writable and not yet readable.
    Alloc {
        bytes: u64,
        owner: String,
    },
    /// Ends the writes into an extent (sent as write-chunk frames after
    /// `Alloc`): the server checks the bytes against `checksum` and makes the
    /// extent readable. Replies `Committed`, or `ChecksumMismatch` and the
    /// extent stays unreadable. Any earlier rejected write chunk is reported here.
    Commit {
        offset: u64,
        checksum: String,
    },
    /// Releases an extent; its space is reused once in-flight reads finish.
    Free {
        offset: u64,
    },
    Stats,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum MemserverReply {
    Allocated { offset: u64 },
    Committed { offset: u64 },
    Freed { offset: u64 },
    Stats(MemserverStats),
    Error(ErrorReply),
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemserverStats {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub largest_free_bytes: u64,
    pub extents: u64,
    pub connections: u64,
    pub bytes_served: u64,
    pub reads_served: u64,
}

/// Where one copy of a slice lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    pub memserver: u32,
    /// The memory server's address, as it registered (host:port).
    pub addr: String,
    /// Offset of the slice in that memory server's arena.
    pub offset: u64,
}

/// A contiguous piece of a group stored on one memory server (and replicas).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    /// Offset of the slice within its group.
    pub group_offset: u64,
    pub len: u64,
    /// xxh3-64 of the slice bytes, hex ([`crate::checksum::to_hex`]).
    pub checksum: String,
    /// First entry is the primary; the others are replicas.
    pub replicas: Vec<Location>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLocation {
    pub index: u32,
    pub bytes: u64,
    /// xxh3-64 of the whole group, hex.
    pub checksum: String,
    pub slices: Vec<Slice>,
}

/// The catalog's entry for a deployed model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelEntry {
    pub name: String,
    pub family: String,
    pub total_bytes: u64,
    /// Sharding strategy and replication it was deployed with.
    pub strategy: String,
    pub replication: u32,
    pub groups: Vec<GroupLocation>,
    /// The package manifest (layers, params, groups), so that GPU servers
    /// need nothing but the catalog to run the model.
    pub manifest: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSummary {
    pub name: String,
    pub family: String,
    pub total_bytes: u64,
    pub groups: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemserverInfo {
    pub id: u32,
    pub addr: String,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub alive: bool,
    pub last_heartbeat_ms_ago: u64,
}

/// Requests on the controller's metadata (catalog) port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControllerRequest {
    /// A memory server announces itself. `boot_id` changes on every start:
    /// a new one means the server's arena (and every slice on it) is gone.
    RegisterMemserver {
        addr: String,
        capacity_bytes: u64,
        boot_id: u64,
    },
    Heartbeat {
        memserver: u32,
        boot_id: u64,
        used_bytes: u64,
    },
    ListMemservers,
    /// Adds or replaces a model; replies `Put` with the entry it replaced.
    PutModel {
        entry: Box<ModelEntry>,
    },
    GetModel {
        name: String,
    },
    RemoveModel {
        name: String,
    },
    ListModels,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum ControllerReply {
    Registered {
        memserver: u32,
        heartbeat_interval_ms: u64,
    },
    HeartbeatOk,
    Memservers {
        memservers: Vec<MemserverInfo>,
    },
    Put {
        replaced: Option<Box<ModelEntry>>,
    },
    Model {
        entry: Box<ModelEntry>,
    },
    Removed {
        entry: Box<ModelEntry>,
    },
    Models {
        models: Vec<ModelSummary>,
    },
    Error(ErrorReply),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_through_json() {
        let r = MemserverRequest::Alloc {
            bytes: 10,
            owner: "m".into(),
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(s, r#"{"op":"alloc","bytes":10,"owner":"m"}"#);
        assert_eq!(serde_json::from_str::<MemserverRequest>(&s).unwrap(), r);
        let e = ControllerReply::Error(ErrorReply::new(ErrorCode::UnknownModel, "no model x"));
        let s = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<ControllerReply>(&s).unwrap(), e);
    }
}
