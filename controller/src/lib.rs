//! The DistMind controller.
//!
//! The cluster's *metadata* endpoint (the first line of
//! `settings/storage_list.txt`): the model catalog and the memory-server
//! registry, served over the cluster protocol ([`distmind_common::proto`]),
//! plus the pure sharding planner the deploy tool uses.
//!
//! Code map:
//! * [`catalog`]: model name -> [`ModelEntry`](distmind_common::proto::ModelEntry), validated on put.
//! * [`registry`]: memory servers, their boot ids and heartbeats; time is passed in.
//! * [`runtimes`]: GPU servers (runtimes), same heartbeat rules, their devices and snapshots.
//! * [`policy`]: placement and routing policies, pure, on a virtual clock.
//! * [`dispatch`]: the dispatcher: decisions ([`dispatch::core`]), the client
//!   port and runtime links ([`dispatch::net`]), metrics.
//! * [`oip`]: the Open Inference Protocol (KServe v2 / Triton) front end on the dispatcher.
//! * [`jobs`]: distributed training jobs: registry, state machine, stage
//!   reports, where their stage workers run ([`jobs::placement`], pure),
//!   their two-step start ([`jobs::launch`]) and DynPipe's decisions
//!   ([`jobs::dynpipe`]).
//! * [`training`]: the pure planners and schedulers (1F1B simulator,
//!   re-partitioner, straggler monitor, group schedulers) and the sync-group
//!   service ([`training::groups`]).
//! * [`driver`]: the training jobs' IO: stage links to the GPU servers, the
//!   requests the state decides, their answers brought back.
//! * [`state`]: catalog + registries + jobs + sync groups, one request applied
//!   at a time (no IO; deferred replies and driver actions as values).
//! * [`placement`]: how a model's groups are sharded over memory servers (pure).
//! * [`prep`]: SOPHON's per-sample preprocessing offload planner (pure).
//! * [`server`]: the tokio listener, connection handling and expiry task.
//! * [`client`]: the blocking client used by the deploy tool, benches and tests.
//!
//! **Architecture invariant:** the controller knows nothing about CUDA, RDMA or
//! parameter bytes; it holds locations and checksums only.
//! **Architecture invariant:** [`state`], [`catalog`], [`registry`], [`jobs`] and
//! [`placement`] do no IO and never read the clock: the server passes `now` in.
#![forbid(unsafe_code)]

pub mod catalog;
pub mod client;
pub mod dispatch;
pub mod driver;
pub mod jobs;
pub mod oip;
pub mod placement;
pub mod policy;
pub mod prep;
pub mod registry;
pub mod runtimes;
pub mod server;
pub mod state;
pub mod training;

pub use client::{ClientError, ControllerClient};
pub use placement::{plan, PlanError, PlanOptions, SlicePlan, Strategy};
pub use server::{Controller, ControllerConfig, ControllerError};
