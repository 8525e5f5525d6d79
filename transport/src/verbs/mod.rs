//! RDMA verbs: the pieces of a verbs transport.
//!
//! The pure logic is always compiled and unit-tested without hardware:
//!
//! * [`qp`]: the RC queue-pair state machine (Reset -> Init -> Rtr -> Rts,
//!   Error) with the attributes each transition needs, validated;
//! * [`info`]: [`QpInfo`], what two peers exchange over the control connection
//!   to connect their queue pairs (fixed binary encoding, validated on receive);
//! * [`plan`]: the RDMA READ batch planner (chunks, chains per doorbell,
//!   signalling), the send window and the per-request completion tracker;
//! * [`book`]: the transport's bookkeeping (batch validation, per-peer queues
//!   of planned chains and send windows, hardware `wr_id` -> caller op,
//!   failing a lost peer's ops exactly once), and [`options`]: `VerbsOptions`.
//!
//! With the cargo feature `verbs` (rdma-sys, libibverbs), `device` opens a
//! device by name and wraps context, PD, CQ, QP and MR in RAII types, posts
//! planned chains with `ibv_post_send` and polls with `ibv_poll_cq`;
//! `transport` builds `VerbsTransport` (the client side of the [`crate::Transport`]
//! trait) and `VerbsServer` (the memory server's side) on them. On a machine
//! without RDMA devices, opening fails with an error naming the device.

pub mod book;
pub mod info;
pub mod options;
pub mod plan;
pub mod qp;

#[cfg(feature = "verbs")]
pub mod attr;
#[cfg(feature = "verbs")]
pub mod device;
#[cfg(feature = "verbs")]
pub mod transport;

pub use book::{Book, PEERS_MAX};
pub use info::{QpInfo, QP_INFO_WIRE_BYTES};
pub use options::VerbsOptions;
pub use plan::{
    plan_reads, Chain, CompletionTracker, PlanLimits, PlannedWr, ReadPlan, ReadReq, SendWindow,
};
pub use qp::{
    Access, Gid, InitAttrs, PathMtu, QpState, QpStateMachine, RcConfig, RemoteAddress, RtrAttrs,
    RtsAttrs, Transition,
};
#[cfg(feature = "verbs")]
pub use transport::{Connector, ServedQp, VerbsServer, VerbsTransport, SERVED_QPS_MAX};

/// Errors of the verbs transport.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    #[error("verbs: RDMA device \"{name}\" not found ({}devices present: {}); use the tcp or fabric transport, or check the rdma-core installation",
        .list_error.as_ref().map(|e| format!("ibv_get_device_list: {e}; ")).unwrap_or_default(),
        if .present.is_empty() { "none".to_string() } else { .present.join(", ") })]
    DeviceNotFound {
        name: String,
        /// Why listing failed, when it did (e.g. "Function not implemented").
        list_error: Option<String>,
        present: Vec<String>,
    },
    #[error("verbs: queue pair cannot go from {from:?} to {to:?} (allowed: Reset->Init->Rtr->Rts, any->Error, any->Reset)")]
    InvalidTransition { from: QpState, to: QpState },
    #[error("verbs: invalid queue-pair attribute: {0}")]
    InvalidAttr(String),
    #[error("verbs: invalid queue-pair info from peer: {0}")]
    InvalidQpInfo(String),
    #[error("verbs: invalid read plan: {0}")]
    InvalidPlan(String),
    #[error("verbs: {call} failed: {detail}")]
    Call { call: &'static str, detail: String },
    #[error("verbs: read {wr_id} failed with work completion status {status} ({detail})")]
    Completion {
        wr_id: u64,
        status: u32,
        detail: String,
    },
    #[error("verbs: read {wr_id} was flushed: an earlier read on the queue pair failed and it is in the Error state")]
    Flushed { wr_id: u64 },
    #[error("verbs: timed out after {0:?} waiting for completions")]
    Timeout(std::time::Duration),
}
