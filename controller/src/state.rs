//! Everything the controller knows, and how one request changes it.
//!
//! [`ControllerState::apply`] is synchronous, does no IO and takes the time as
//! an argument: the server calls it under a lock held for exactly one request,
//! and tests call it directly. Replies that carry a model hold an `Arc` so the
//! (possibly large) entry is cloned and serialised after the lock is released.
//! A reply that waits for something (a training sync group) is
//! [`Outcome::Deferred`]: the server awaits it after the lock is released.
//! What must go to the GPU servers for training jobs is queued as values
//! ([`TrainAction`]) for the driver task, which brings the answers back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::proto::{
    ControllerReply, ControllerRequest, ErrorCode, ErrorReply, GpuAssignment, ModelEntry,
};
use tokio::sync::{oneshot, Notify};

mod groups;
mod train;

pub use groups::{GroupSlot, GROUP_REPLY_WAIT_MAX};
pub use train::{StageAnswer, StagePhase, TrainAction, TRAIN_ACTIONS_MAX};

use crate::catalog::Catalog;
use crate::jobs::{JobRegistry, StageReport};
use crate::registry::{Registration, Registry};
use crate::runtimes::{RuntimeRegistry, RuntimeShape};
use crate::training::GroupService;

/// The first request id of the stage-worker requests the controller sends
/// to runtimes: a range of their own, above any id the dispatcher's links
/// reach (they count up from 0).
pub const STAGE_REQUEST_ID_BASE: u64 = 1 << 62;

/// A reply whose model entries are still shared with the catalog, or one
/// that comes later.
#[derive(Debug)]
pub enum Outcome {
    Reply(ControllerReply),
    Put {
        replaced: Option<Arc<ModelEntry>>,
    },
    Model(Arc<ModelEntry>),
    Removed(Arc<ModelEntry>),
    /// The reply comes when something happens (a `TrainGroupReady`: when
    /// its group closes); await it with [`Outcome::resolve`], outside the
    /// lock.
    Deferred(oneshot::Receiver<ControllerReply>),
}

impl Outcome {
    /// The wire reply (clones shared entries; call it outside the lock). A
    /// deferred reply that has not come yet is an `internal` error: await
    /// it with [`resolve`](Self::resolve).
    pub fn into_reply(self) -> ControllerReply {
        let own = |e: Arc<ModelEntry>| Box::new(Arc::unwrap_or_clone(e));
        match self {
            Outcome::Reply(r) => r,
            Outcome::Put { replaced } => ControllerReply::Put {
                replaced: replaced.map(own),
            },
            Outcome::Model(e) => ControllerReply::Model { entry: own(e) },
            Outcome::Removed(e) => ControllerReply::Removed { entry: own(e) },
            Outcome::Deferred(mut rx) => rx.try_recv().unwrap_or_else(|_| {
                ControllerReply::Error(ErrorReply::new(
                    ErrorCode::Internal,
                    "the reply was deferred and has not come yet; await it (Outcome::resolve)",
                ))
            }),
        }
    }

    /// A deferred reply, once it came (`None` while it has not, and for
    /// every other outcome: use [`into_reply`](Self::into_reply)).
    pub fn try_reply(&mut self) -> Option<ControllerReply> {
        match self {
            Outcome::Deferred(rx) => rx.try_recv().ok(),
            _ => None,
        }
    }

    /// The wire reply, waiting at most `wait_max` for a deferred one (then
    /// `deadline_exceeded`; `shutting_down` when the controller dropped it).
    pub async fn resolve(self, wait_max: Duration) -> ControllerReply {
        let Outcome::Deferred(rx) = self else {
            return self.into_reply();
        };
        let err = |code, message: String| ControllerReply::Error(ErrorReply::new(code, message));
        match tokio::time::timeout(wait_max, rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => err(
                ErrorCode::ShuttingDown,
                "the controller dropped the request before answering it (shutting down?)".into(),
            ),
            Err(_) => err(
                ErrorCode::DeadlineExceeded,
                format!(
                    "no answer within {wait_max:?} (GROUP_REPLY_WAIT_MAX): the group still waits \
                     for other workers; ask again to keep waiting in it"
                ),
            ),
        }
    }
}

impl From<ErrorReply> for Outcome {
    fn from(e: ErrorReply) -> Self {
        Outcome::Reply(ControllerReply::Error(e))
    }
}

#[derive(Debug)]
pub struct ControllerState {
    catalog: Catalog,
    registry: Registry,
    runtimes: RuntimeRegistry,
    /// What the policy decided last, published by the dispatcher.
    assignments: Published,
    /// Distributed training jobs.
    jobs: JobRegistry,
    /// The next stage-worker request id (from [`STAGE_REQUEST_ID_BASE`]).
    next_stage_request_id: u64,
    /// What the driver must send to the GPU servers, oldest first.
    train_actions: train::TrainActions,
    /// Wakes the driver when an action is queued.
    train_wake: Arc<Notify>,
    /// The training jobs' sync groups and the asks waiting in them.
    groups: GroupService<GroupSlot>,
    /// The group schedulers' clock origin (the first ask).
    group_origin: Option<Instant>,
    /// Wakes the group timer when an ask may have set a new deadline.
    group_wake: Arc<Notify>,
}

/// The assignment the dispatcher published for subscribers.
#[derive(Debug, Clone, Default)]
struct Published {
    epoch: u64,
    policy: String,
    gpus: Vec<GpuAssignment>,
}

impl ControllerState {
    pub fn new(heartbeat_interval: Duration) -> Self {
        ControllerState {
            catalog: Catalog::new(),
            registry: Registry::new(heartbeat_interval),
            runtimes: RuntimeRegistry::new(heartbeat_interval),
            assignments: Published::default(),
            jobs: JobRegistry::new(),
            next_stage_request_id: STAGE_REQUEST_ID_BASE,
            train_actions: train::TrainActions::new(),
            train_wake: Arc::new(Notify::new()),
            groups: GroupService::new(),
            group_origin: None,
            group_wake: Arc::new(Notify::new()),
        }
    }

    /// Publishes a new assignment to subscribers (bumps the epoch when it
    /// changed).
    pub fn publish_assignments(&mut self, policy: &str, gpus: Vec<GpuAssignment>) {
        let a = &mut self.assignments;
        if a.policy != policy || a.gpus != gpus {
            a.epoch += 1;
            a.policy = policy.to_string();
            a.gpus = gpus;
        }
    }

    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The GPU servers (runtimes).
    pub fn runtimes(&self) -> &RuntimeRegistry {
        &self.runtimes
    }

    /// Memory servers alive at `now`.
    pub fn memservers_alive(&self, now: Instant) -> usize {
        self.registry.alive(now)
    }

    /// The distributed training jobs.
    pub fn jobs(&self) -> &JobRegistry {
        &self.jobs
    }

    /// Wakes the training driver when there are actions to take.
    pub fn train_wake(&self) -> Arc<Notify> {
        self.train_wake.clone()
    }

    /// Serves one request at time `now`.
    pub fn apply(&mut self, req: ControllerRequest, now: Instant) -> Outcome {
        match req {
            ControllerRequest::RegisterMemserver {
                addr,
                capacity_bytes,
                boot_id,
            } => match self.register(&addr, capacity_bytes, boot_id, now) {
                Ok(id) => Outcome::Reply(ControllerReply::Registered {
                    memserver: id,
                    heartbeat_interval_ms: self.registry.heartbeat_interval().as_millis() as u64,
                }),
                Err(e) => e.into(),
            },
            ControllerRequest::Heartbeat {
                memserver,
                boot_id,
                used_bytes,
            } => match self.registry.heartbeat(memserver, boot_id, used_bytes, now) {
                Ok(came_back) => {
                    if came_back {
                        log::warn!(
                            "memory server {memserver} ({}) is alive again",
                            self.registry.addr(memserver).unwrap_or("?")
                        );
                    }
                    Outcome::Reply(ControllerReply::HeartbeatOk)
                }
                Err(e) => e.into(),
            },
            ControllerRequest::ListMemservers => Outcome::Reply(ControllerReply::Memservers {
                memservers: self.registry.list(now),
            }),
            ControllerRequest::PutModel { entry } => {
                let name = entry.name.clone();
                let registry = &self.registry;
                match self.catalog.put(*entry, |id| registry.addr(id)) {
                    Ok(replaced) => {
                        log::info!(
                            "model '{name}' {} ({} models in the catalog)",
                            if replaced.is_some() {
                                "replaced"
                            } else {
                                "added"
                            },
                            self.catalog.len()
                        );
                        Outcome::Put { replaced }
                    }
                    Err(e) => {
                        log::warn!("refused model '{name}': {}", e.message);
                        e.into()
                    }
                }
            }
            ControllerRequest::GetModel { name } => match self.catalog.get(&name) {
                Ok(e) => Outcome::Model(e),
                Err(e) => e.into(),
            },
            ControllerRequest::RemoveModel { name } => match self.catalog.remove(&name) {
                Ok(e) => {
                    log::info!(
                        "model '{name}' removed ({} models in the catalog)",
                        self.catalog.len()
                    );
                    Outcome::Removed(e)
                }
                Err(e) => e.into(),
            },
            ControllerRequest::ListModels => Outcome::Reply(ControllerReply::Models {
                models: self.catalog.list(),
            }),
            ControllerRequest::RegisterRuntime {
                addr,
                devices,
                executor,
                boot_id,
                device_ids,
                cache_bytes,
                device_bytes,
                resident_models_max,
            } => match self
                .runtimes
                .register(&addr, devices, &executor, boot_id, now)
                .and_then(|reg| {
                    let shape = RuntimeShape {
                        device_ids,
                        cache_bytes,
                        device_bytes,
                        resident_models_max,
                    };
                    self.runtimes.set_shape(reg.id(), shape).map(|()| reg)
                }) {
                Ok(reg) => {
                    let id = reg.id();
                    match reg {
                        Registration::New { .. } => log::info!(
                            "runtime {id} registered at {addr}: {devices} devices, executor {executor}"
                        ),
                        Registration::Again { .. } => {
                            log::info!("runtime {id} ({addr}) registered again")
                        }
                        Registration::Restarted { old_boot_id, .. } => {
                            log::warn!(
                                "runtime {id} ({addr}) restarted (boot id {old_boot_id:#x} -> {boot_id:#x}): \
                                 its caches are empty"
                            );
                            let why =
                                format!("restarted (boot id {old_boot_id:#x} -> {boot_id:#x})");
                            self.runtime_gone(id, &why, now);
                        }
                    }
                    self.place_pending(now);
                    Outcome::Reply(ControllerReply::RuntimeRegistered {
                        runtime: id,
                        heartbeat_interval_ms: self.runtimes.heartbeat_interval().as_millis()
                            as u64,
                    })
                }
                Err(e) => e.into(),
            },
            ControllerRequest::RuntimeHeartbeat {
                runtime,
                boot_id,
                queued,
                snapshot,
            } => match self
                .runtimes
                .heartbeat(runtime, boot_id, queued, snapshot, now)
            {
                Ok(came_back) => {
                    if came_back {
                        log::warn!(
                            "runtime {runtime} ({}) is alive again",
                            self.runtimes.addr(runtime).unwrap_or("?")
                        );
                    }
                    Outcome::Reply(ControllerReply::HeartbeatOk)
                }
                Err(e) => e.into(),
            },
            ControllerRequest::ListRuntimes => Outcome::Reply(ControllerReply::Runtimes {
                runtimes: self.runtimes.list(now),
            }),
            ControllerRequest::Assignments => Outcome::Reply(ControllerReply::Assignments {
                epoch: self.assignments.epoch,
                policy: self.assignments.policy.clone(),
                gpus: self.assignments.gpus.clone(),
            }),
            ControllerRequest::TrainSubmit { spec } => match self.train_submit(*spec, now) {
                Ok(job) => Outcome::Reply(ControllerReply::TrainSubmitted { job: Box::new(job) }),
                Err(e) => {
                    log::warn!("refused a training job: {}", e.message);
                    e.into()
                }
            },
            ControllerRequest::TrainStatus { job } => {
                match self.train_status(job.as_deref(), now) {
                    Ok(jobs) => Outcome::Reply(ControllerReply::TrainJobs { jobs }),
                    Err(e) => ErrorReply::from(e).into(),
                }
            }
            ControllerRequest::TrainStop { job } => match self.train_stop(&job, now) {
                Ok(job) => Outcome::Reply(ControllerReply::TrainStopped { job: Box::new(job) }),
                Err(e) => ErrorReply::from(e).into(),
            },
            ControllerRequest::TrainReport {
                job,
                pipeline,
                stage,
                iteration,
                fwd_bwd_s,
                loss,
                samples,
            } => {
                let r = StageReport {
                    pipeline,
                    stage,
                    iteration,
                    fwd_bwd_s,
                    loss,
                    samples,
                };
                match self.jobs.report(&job, r, now) {
                    Ok(o) => {
                        if o.stop {
                            self.job_changed(&job);
                        }
                        if o.state.is_terminal() {
                            self.place_pending(now);
                        }
                        if let Some(trigger) = o.repartition {
                            self.plan_repartition(&job, trigger);
                        }
                        Outcome::Reply(ControllerReply::TrainReported {
                            job,
                            state: o.state,
                            stop: o.stop,
                            drain: o.drain,
                            free: Vec::new(),
                        })
                    }
                    Err(e) => ErrorReply::from(e).into(),
                }
            }
            ControllerRequest::TrainFailed {
                job,
                pipeline,
                stage,
                reason,
            } => match self.train_failed(&job, pipeline, stage, &reason, now) {
                Ok(state) => Outcome::Reply(ControllerReply::TrainReported {
                    job,
                    state,
                    stop: true,
                    drain: None,
                    free: Vec::new(),
                }),
                Err(e) => ErrorReply::from(e).into(),
            },
            ControllerRequest::TrainCheckpointed {
                job,
                generation,
                pipeline,
                stage,
                iteration,
                model,
                group,
                layer_checksums,
            } => match self.train_checkpointed(
                &job,
                generation,
                pipeline,
                stage,
                iteration,
                &model,
                group,
                layer_checksums,
                now,
            ) {
                Ok((state, free)) => Outcome::Reply(ControllerReply::TrainReported {
                    stop: state.is_terminal(),
                    job,
                    state,
                    drain: None,
                    free,
                }),
                Err(e) => {
                    log::warn!("training job {job}: a checkpoint part refused: {e}");
                    ErrorReply::from(e).into()
                }
            },
            ControllerRequest::TrainGroupReady {
                job,
                generation,
                pipeline,
                stage,
                iteration,
            } => self.group_ready(&job, generation, pipeline, stage, iteration, now),
        }
    }

    fn register(
        &mut self,
        addr: &str,
        capacity_bytes: u64,
        boot_id: u64,
        now: Instant,
    ) -> Result<u32, ErrorReply> {
        let reg = self.registry.register(addr, capacity_bytes, boot_id, now)?;
        match reg {
            Registration::New { id } => {
                log::info!("memory server {id} registered at {addr} with {capacity_bytes} bytes")
            }
            Registration::Again { id } => {
                log::info!("memory server {id} ({addr}) registered again")
            }
            Registration::Restarted { id, old_boot_id } => {
                let dropped = self.catalog.drop_replicas_on(id);
                let models: Vec<&str> = dropped.iter().map(|d| d.model.as_str()).collect();
                log::warn!(
                    "memory server {id} ({addr}) restarted (boot id {old_boot_id:#x} -> {boot_id:#x}) and lost its \
                     arena; dropped its replicas from {} models: {models:?}",
                    dropped.len()
                );
                for d in dropped.iter().filter(|d| d.unreadable_slices > 0) {
                    log::error!(
                        "model '{}' is unreadable until it is deployed again: {} of its slices had their only copy \
                         on memory server {id} ({addr})",
                        d.model,
                        d.unreadable_slices
                    );
                }
            }
        }
        Ok(reg.id())
    }

    /// Marks silent memory servers dead (logged); returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<u32> {
        let died = self.registry.expire(now);
        for (id, addr) in &died {
            log::warn!(
                "memory server {id} ({addr}) is dead: no heartbeat for more than {:?}",
                self.registry.dead_after()
            );
        }
        for (id, addr) in self.runtimes.expire(now) {
            let why = format!(
                "no heartbeat for more than {:?}",
                self.runtimes.dead_after()
            );
            log::warn!("runtime {id} ({addr}) is dead: {why}");
            self.runtime_gone(id, &why, now);
        }
        for job in self.jobs.expire(now) {
            self.job_changed(&job);
        }
        self.place_pending(now);
        died.into_iter().map(|(id, _)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::tests::entry;
    use distmind_common::proto::ErrorCode;

    pub(super) fn reply(
        s: &mut ControllerState,
        req: ControllerRequest,
        now: Instant,
    ) -> ControllerReply {
        s.apply(req, now).into_reply()
    }

    pub(super) fn register(s: &mut ControllerState, port: u32, boot_id: u64, now: Instant) -> u32 {
        let req = ControllerRequest::RegisterMemserver {
            addr: format!("127.0.0.1:{}", 7000 + port),
            capacity_bytes: 1 << 20,
            boot_id,
        };
        match reply(s, req, now) {
            ControllerReply::Registered {
                memserver,
                heartbeat_interval_ms,
            } => {
                assert_eq!(heartbeat_interval_ms, 100);
                memserver
            }
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn restart_with_a_new_boot_id_drops_replicas_from_the_catalog() {
        let t0 = Instant::now();
        let mut s = ControllerState::new(Duration::from_millis(100));
        for i in 0..3 {
            assert_eq!(register(&mut s, i, 1, t0), i);
        }
        let put = ControllerRequest::PutModel {
            entry: Box::new(entry("m", 2)),
        };
        assert_eq!(
            reply(&mut s, put, t0),
            ControllerReply::Put { replaced: None }
        );
        // Same boot id: nothing lost.
        register(&mut s, 2, 1, t0);
        assert_eq!(
            s.catalog().get("m").unwrap().groups[0].slices[0]
                .replicas
                .len(),
            2
        );
        // New boot id on server 2 (the replica of every slice).
        register(&mut s, 2, 2, t0);
        let m = s.catalog().get("m").unwrap();
        for slice in m.groups.iter().flat_map(|g| &g.slices) {
            assert_eq!(slice.replicas.len(), 1);
            assert_ne!(slice.replicas[0].memserver, 2);
        }
        // Server 0 restarts too: the slices that lived only there are now unreadable.
        register(&mut s, 0, 5, t0);
        let m = s.catalog().get("m").unwrap();
        assert!(m.groups[0].slices[0].replicas.is_empty());
        assert_eq!(m.groups[0].slices[1].replicas.len(), 1);
    }

    #[test]
    fn put_needs_registered_memservers_and_get_reports_unknown_models() {
        let t0 = Instant::now();
        let mut s = ControllerState::new(Duration::from_millis(100));
        register(&mut s, 0, 1, t0);
        let put = ControllerRequest::PutModel {
            entry: Box::new(entry("m", 1)),
        };
        match reply(&mut s, put, t0) {
            ControllerReply::Error(e) => {
                assert_eq!(e.code, ErrorCode::BadRequest);
                assert!(
                    e.message.contains("memory server 2 is not registered"),
                    "{e}"
                );
            }
            r => panic!("{r:?}"),
        }
        match reply(&mut s, ControllerRequest::GetModel { name: "m".into() }, t0) {
            ControllerReply::Error(e) => assert_eq!(e.code, ErrorCode::UnknownModel),
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn expiry_and_return_through_requests() {
        let t0 = Instant::now();
        let mut s = ControllerState::new(Duration::from_millis(100));
        let id = register(&mut s, 0, 1, t0);
        assert!(s.expire(t0 + Duration::from_millis(250)).is_empty());
        assert_eq!(s.expire(t0 + Duration::from_millis(301)), vec![id]);
        let hb = ControllerRequest::Heartbeat {
            memserver: id,
            boot_id: 1,
            used_bytes: 9,
        };
        assert_eq!(
            reply(&mut s, hb, t0 + Duration::from_millis(400)),
            ControllerReply::HeartbeatOk
        );
        match reply(
            &mut s,
            ControllerRequest::ListMemservers,
            t0 + Duration::from_millis(400),
        ) {
            ControllerReply::Memservers { memservers } => {
                assert!(memservers[0].alive);
                assert_eq!(memservers[0].used_bytes, 9);
            }
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn runtimes_register_heartbeat_expire_and_list() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut s = ControllerState::new(ms(100));
        let req = ControllerRequest::RegisterRuntime {
            addr: "127.0.0.1:10009".into(),
            devices: 2,
            executor: "cpu".into(),
            boot_id: 4,
            device_ids: vec![3, 5],
            cache_bytes: 1 << 30,
            device_bytes: 1 << 30,
            resident_models_max: 4,
        };
        let id = match reply(&mut s, req, t0) {
            ControllerReply::RuntimeRegistered {
                runtime,
                heartbeat_interval_ms,
            } => {
                assert_eq!(heartbeat_interval_ms, 100);
                runtime
            }
            r => panic!("{r:?}"),
        };
        let hb = |queued| ControllerRequest::RuntimeHeartbeat {
            runtime: id,
            boot_id: 4,
            queued,
            snapshot: None,
        };
        assert_eq!(
            reply(&mut s, hb(3), t0 + ms(50)),
            ControllerReply::HeartbeatOk
        );
        s.expire(t0 + ms(351));
        let list = |s: &mut ControllerState, at| match reply(s, ControllerRequest::ListRuntimes, at)
        {
            ControllerReply::Runtimes { runtimes } => runtimes,
            r => panic!("{r:?}"),
        };
        let l = list(&mut s, t0 + ms(351));
        assert_eq!(l.len(), 1);
        assert!(!l[0].alive, "3 missed intervals");
        assert_eq!((l[0].devices, l[0].queued), (2, 3));
        assert!(s.runtimes().live(t0 + ms(351)).is_empty());
        let live = s.runtimes().live(t0 + ms(50));
        assert_eq!(live[0].shape.device_ids, vec![3, 5]);
        assert_eq!(
            reply(&mut s, hb(0), t0 + ms(400)),
            ControllerReply::HeartbeatOk
        );
        assert!(
            list(&mut s, t0 + ms(400))[0].alive,
            "back after a heartbeat"
        );
        // Memory servers and runtimes are separate registries.
        match reply(&mut s, ControllerRequest::ListMemservers, t0) {
            ControllerReply::Memservers { memservers } => assert!(memservers.is_empty()),
            r => panic!("{r:?}"),
        }
        let stale = ControllerRequest::RuntimeHeartbeat {
            runtime: id,
            boot_id: 5,
            queued: 0,
            snapshot: None,
        };
        match reply(&mut s, stale, t0 + ms(400)) {
            ControllerReply::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest),
            r => panic!("{r:?}"),
        }
    }
}
