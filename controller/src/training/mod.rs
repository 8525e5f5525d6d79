//! Distributed training that survives interference: the pure planners and
//! schedulers (no IO, no threads, no clock; time is passed in).
//!
//! From DynPipe (interference-aware re-partitioning of a 1F1B pipeline,
//! `runtime/image_classification/main_with_runtime.py`):
//! * [`sim1f1b`]: the event-level simulator of PipeDream's 1F1B schedule
//!   that DynPipe's re-partitioner scores candidates with.
//! * [`partition`]: the re-partitioner (`calculate_new_placement`):
//!   candidate cuts after each stage's costliest layers, every combination
//!   simulated under a pluggable slowdown predictor.
//! * [`monitor`]: the straggler monitor: per-window stage times, a frozen
//!   baseline, the 2x / 0.5x trigger and the delayed re-partition.
//!
//! From SD-Pipe (partial reduce for pipelined data parallelism,
//! `ps-lite/src/preduce_handler.cc`, `python/hetu/preduce.py`):
//! * [`group`]: workers, groups and the [`GroupScheduler`] interface the
//!   three schemes below share.
//! * [`preduce`]: the partial-reduce group scheduler: deadlines with an
//!   adaptive wait, a union-find and graph syncs, pairs above 8 workers.
//! * [`allreduce`]: the AllReduce baseline: every group is every worker.
//! * [`adpsgd`]: the AD-PSGD baseline: random pairwise gossip, seeded.
//! * [`groups`]: the sync-group service: a scheduler per (job, generation,
//!   stage) by the job's sync mode, the workers' asks parked until their
//!   group closes, deadlines, stops and removed pipelines.

pub mod adpsgd;
pub mod allreduce;
pub mod group;
pub mod groups;
pub mod monitor;
pub mod partition;
pub mod preduce;
pub mod sim1f1b;

#[cfg(test)]
pub(crate) mod testkit;

pub use adpsgd::AdPsgd;
pub use allreduce::AllReduce;
pub use group::{CloseReason, Group, GroupError, GroupScheduler, WorkerId, WORKERS_MAX};
pub use groups::{Ask, AskError, Delivery, GroupAnswer, GroupService, SyncScheme, Waiter};
pub use monitor::{MonitorConfig, MonitorError, ScheduledRepartition, StragglerMonitor};
pub use partition::{
    predict, repartition, LayerCost, MeasuredRatio, PartitionError, RepartitionOptions,
    RepartitionPlan, SlowdownPredictor,
};
pub use preduce::{PReduceConfig, PartialReduce};
pub use sim1f1b::{
    simulate, simulate_with_events, BoundaryComm, OpEvent, OpKind, SimError, SimResult, StageTime,
};
