//! The data plane between training workers: stage links that carry
//! activations forward and gradients backward between adjacent pipeline
//! stages, and ring all-reduce (average) and broadcast among a group of
//! workers (a partial-reduce group, or every pipeline's replica of a stage).
//!
//! * [`tensor`]: the wire form of a stage message (header, tensors named by
//!   layer reference, shape, f32 data), bounded by [`MessageLimits`].
//! * [`listener`]: a worker's one listener and the opening of every dist
//!   connection (cluster-key handshake, then a hello naming the job,
//!   pipeline, stages or group, refused with a named [`Refusal`] if wrong).
//! * [`link`]: [`StageLink`], credit-based flow control: at most `window`
//!   messages in flight per direction.
//! * [`allreduce`]: [`Collective`], gloo-style ring reduce-scatter +
//!   all-gather over cached per-group rings; every member ends with the same
//!   bits.
//! * [`limits`]: every bound, with the relations between them checked at
//!   compile time.
//!
//! Blocking std::net and threads throughout: training stage workers are
//! threads, not async tasks, and a blocking socket per link keeps the data
//! path free of an executor; only the listener's handshake runs on a small
//! current-thread tokio runtime, because `common::handshake` offers its
//! server side as an async function.

pub mod allreduce;
pub mod limits;
pub mod link;
pub mod listener;
pub mod tensor;

pub use allreduce::{
    Collective, CollectiveError, CollectiveOptions, CollectiveStats, Group, InjectedFault,
    RingMember,
};
pub use link::{LinkError, LinkId, LinkOptions, StageLink};
pub use listener::{DialError, DistListener, ListenerStats, Refusal, WorkerIdentity};
pub use tensor::{MessageError, MessageHeader, MessageKind, MessageLimits, StageMessage, Tensor};
