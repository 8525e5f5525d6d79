//! The dispatcher: routes every client request to a GPU so that it meets
//! its latency SLO, or rejects it at once.
//!
//! * [`core`]: the decisions, pure (time passed in, actions out).
//! * [`net`]: the client port, one link per runtime, the tick task.
//! * [`outbox`]: bytes for one socket, written by the task that made them.
//! * `gpus`: the view of each GPU and the packed lanes routing scans;
//!   `link`: the loads sharing each GPU server's link;
//!   `sets`: sets and maps of the dispatcher's own ids.

pub mod core;
mod gpus;
mod link;
pub mod metrics;
pub mod net;
pub mod outbox;
mod sets;

pub use self::core::{Action, Completion, DispatchConfig, DispatchCounters, Dispatcher, ReqId};
pub use self::net::DispatchThread;
