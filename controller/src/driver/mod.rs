//! The training job driver: the IO edge of the controller's training jobs.
//!
//! The state decides (under its lock, no IO) and queues what must go to the
//! GPU servers as values ([`TrainAction`]); this task takes them, sends the
//! requests over its stage links ([`links`]), waits for each answer (or its
//! phase's timeout) and brings it back to the state
//! ([`ControllerState::stage_answered`]), which decides the next step. It
//! runs DynPipe's planner on a blocking thread and records the decision,
//! and frees the extents of abandoned checkpoint parts on their memory
//! servers ([`free_extents`], on a blocking thread too).
//!
//! ```text
//!  apply / expire --(lock)--> state: TrainAction queue --wake--> driver
//!  driver: per request a call on the runtime's stage link (no lock held)
//!  answers / timeouts / a link down --(lock)--> state --> next actions
//! ```
//!
//! **Why links of its own, not the dispatcher's:** the dispatcher is
//! optional (`controller --no-dispatcher` serves no clients but still runs
//! training jobs), its links belong to its core task (one owner of its
//! state, no locks on the inference path) and their loss re-routes
//! inference. A stage link is a second control connection to the GPU
//! servers that host stage workers, only while they do; its answers route
//! by request id (ids from `STAGE_REQUEST_ID_BASE`, a range of their own),
//! and its closing fails those servers' jobs as a missed heartbeat does.

pub mod links;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use distmind_common::handshake::ClusterKey;
use distmind_common::memserver_client::MemserverClient;
use distmind_common::proto::RepartitionDecision;
use distmind_common::train_spec::STAGE_WORKERS_MAX;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinSet;

use crate::jobs::{plan_repartition, OwnedExtent, StageRequest, JOBS_ACTIVE_MAX};
use crate::state::{ControllerState, StageAnswer, StagePhase, TrainAction};
use links::{LinkDown, StageLink};

/// Waiting for `TrainStageReady`: the worker loads its layers from the
/// memory servers first.
pub const STAGE_READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Waiting for `TrainStageStarted`: the worker connects its stage links.
pub const STAGE_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Waiting for the answer to `TrainStageStop` (only logged).
pub const STAGE_STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Stage requests waiting for their answer at once: every active job's
/// workers, a start step and a stop each.
pub const CALLS_IN_FLIGHT_MAX: usize = JOBS_ACTIVE_MAX * STAGE_WORKERS_MAX as usize * 2;
/// DynPipe plans running at once (one per job at most).
pub const PLANS_IN_FLIGHT_MAX: usize = JOBS_ACTIVE_MAX;
/// Frees of abandoned checkpoint parts running at once (one per job's
/// abandonment); past it a job's parts stay allocated, logged.
pub const FREES_IN_FLIGHT_MAX: usize = JOBS_ACTIVE_MAX;
/// Bounds the connect to a memory server and each request of a free.
pub const FREE_IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Link-down events waiting for the driver.
const LINK_EVENTS_MAX: usize = 256;

type Shared = Arc<Mutex<ControllerState>>;

fn lock(s: &Shared) -> MutexGuard<'_, ControllerState> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts the driver task on `tasks`; it ends on `stop`.
pub fn spawn(state: Shared, key: ClusterKey, tasks: &mut JoinSet<()>, stop: watch::Receiver<bool>) {
    let wake = lock(&state).train_wake();
    let (down_tx, down_rx) = mpsc::channel(LINK_EVENTS_MAX);
    let driver = Driver {
        state,
        key,
        links: HashMap::new(),
        in_flight: HashMap::new(),
        calls: JoinSet::new(),
        plans: JoinSet::new(),
        frees: JoinSet::new(),
        down_tx,
        next_instance: 0,
    };
    tasks.spawn(driver.run(wake, down_rx, stop));
}

type PlanDone = (String, u64, Result<RepartitionDecision, String>);

struct Driver {
    state: Shared,
    key: ClusterKey,
    /// By runtime id.
    links: HashMap<u32, StageLink>,
    /// Calls waiting for an answer, per runtime.
    in_flight: HashMap<u32, usize>,
    calls: JoinSet<StageAnswer>,
    plans: JoinSet<PlanDone>,
    frees: JoinSet<()>,
    down_tx: mpsc::Sender<LinkDown>,
    next_instance: u64,
}

impl Driver {
    async fn run(
        mut self,
        wake: Arc<Notify>,
        mut down: mpsc::Receiver<LinkDown>,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                _ = wake.notified() => {}
                Some(done) = self.calls.join_next(), if !self.calls.is_empty() => match done {
                    Ok(answer) => {
                        if let Some(n) = self.in_flight.get_mut(&answer.runtime) {
                            *n = n.saturating_sub(1);
                        }
                        lock(&self.state).stage_answered(answer, Instant::now());
                    }
                    Err(e) => log::error!("training driver: a stage call task failed: {e}"),
                },
                Some(done) = self.plans.join_next(), if !self.plans.is_empty() => match done {
                    Ok((job, generation, decision)) => {
                        lock(&self.state).repartition_planned(&job, generation, decision, Instant::now())
                    }
                    Err(e) => log::error!("training driver: a DynPipe plan failed: {e}"),
                },
                Some(done) = self.frees.join_next(), if !self.frees.is_empty() => {
                    if let Err(e) = done {
                        log::error!("training driver: freeing checkpoint parts failed: {e}");
                    }
                }
                Some(d) = down.recv() => {
                    if self.links.get(&d.runtime).is_some_and(|l| l.instance == d.instance) {
                        self.links.remove(&d.runtime);
                        lock(&self.state).stage_link_lost(d.runtime, &d.why, Instant::now());
                    }
                }
            }
            self.turn();
        }
        self.calls.shutdown().await;
        self.plans.shutdown().await;
        // Frees are short (each request bounded by FREE_IO_TIMEOUT): let
        // them finish rather than leave extents half-freed.
        while self.frees.join_next().await.is_some() {}
    }

    /// Takes the state's actions and carries them out; drops the links
    /// no job needs any more.
    fn turn(&mut self) {
        let (actions, keep) = {
            let mut s = lock(&self.state);
            (s.take_train_actions(), s.training_runtimes())
        };
        let mut refused = Vec::new();
        for a in actions {
            match a {
                TrainAction::Send {
                    job,
                    generation,
                    phase,
                    requests,
                } => {
                    for r in requests {
                        refused.extend(self.send(&job, generation, phase, r));
                    }
                }
                TrainAction::Plan(input) => {
                    if self.plans.len() >= PLANS_IN_FLIGHT_MAX {
                        log::error!(
                            "training driver: {PLANS_IN_FLIGHT_MAX} DynPipe plans run already \
                             (PLANS_IN_FLIGHT_MAX); job {}'s is dropped",
                            input.job
                        );
                        continue;
                    }
                    self.plans.spawn_blocking(move || {
                        let decision = plan_repartition(&input);
                        (input.job, input.generation, decision)
                    });
                }
                TrainAction::Free { job, extents } => {
                    if self.frees.len() >= FREES_IN_FLIGHT_MAX {
                        log::error!(
                            "training driver: {FREES_IN_FLIGHT_MAX} frees run already \
                             (FREES_IN_FLIGHT_MAX); the {} extents of job {job}'s abandoned \
                             checkpoint parts stay allocated: {extents:?}",
                            extents.len()
                        );
                        continue;
                    }
                    let key = self.key.clone();
                    self.frees.spawn_blocking(move || {
                        free_extents(&job, &key, &extents);
                    });
                }
            }
        }
        if !refused.is_empty() {
            let mut s = lock(&self.state);
            for a in refused {
                s.stage_answered(a, Instant::now());
            }
        }
        let in_flight = &self.in_flight;
        self.links
            .retain(|rt, _| keep.contains(rt) || in_flight.get(rt).is_some_and(|&n| n > 0));
        self.in_flight.retain(|_, n| *n > 0);
    }

    /// One request on its runtime's link (made if needed); the answer
    /// comes back through `calls`. Past [`CALLS_IN_FLIGHT_MAX`] it is
    /// answered at once with why: that answer is returned.
    fn send(
        &mut self,
        job: &str,
        generation: u64,
        phase: StagePhase,
        r: StageRequest,
    ) -> Option<StageAnswer> {
        let mut answer = StageAnswer {
            job: job.to_string(),
            generation,
            phase,
            pipeline: r.pipeline,
            stage: r.stage,
            runtime: r.runtime,
            reply: Err(String::new()),
        };
        if self.calls.len() >= CALLS_IN_FLIGHT_MAX {
            answer.reply = Err(format!(
                "the controller has {CALLS_IN_FLIGHT_MAX} stage requests in flight \
                 (CALLS_IN_FLIGHT_MAX); try again when jobs ended"
            ));
            return Some(answer);
        }
        let (timeout, timeout_name) = match phase {
            StagePhase::Setup => (STAGE_READY_TIMEOUT, "STAGE_READY_TIMEOUT"),
            StagePhase::Start => (STAGE_START_TIMEOUT, "STAGE_START_TIMEOUT"),
            StagePhase::Stop => (STAGE_STOP_TIMEOUT, "STAGE_STOP_TIMEOUT"),
        };
        if self.links.get(&r.runtime).is_some_and(|l| l.addr != r.addr) {
            // The runtime registered again at another address.
            self.links.remove(&r.runtime);
        }
        let link = match self.links.entry(r.runtime) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                self.next_instance += 1;
                e.insert(StageLink::open(
                    r.runtime,
                    &r.addr,
                    self.key.clone(),
                    self.next_instance,
                    self.down_tx.clone(),
                ))
            }
        };
        let caller = link.caller();
        *self.in_flight.entry(r.runtime).or_default() += 1;
        self.calls.spawn(async move {
            answer.reply = links::call(caller, r.request, timeout, timeout_name).await;
            answer
        });
        None
    }
}

/// Frees `extents` (job `job`'s abandoned checkpoint parts) on their
/// memory servers, one connection per server, each free naming the
/// extent's owner; best effort: an extent that cannot be freed (a server
/// gone, or the offset held by another owner now) is logged, naming where
/// it is, and stays allocated. Returns how many were freed.
pub fn free_extents(job: &str, key: &ClusterKey, extents: &[OwnedExtent]) -> usize {
    let mut by_server: Vec<(&str, Vec<(u64, &str)>)> = Vec::new();
    for e in extents {
        let one = (e.at.offset, e.owner.as_str());
        match by_server.iter_mut().find(|(a, _)| *a == e.at.addr) {
            Some((_, offsets)) => offsets.push(one),
            None => by_server.push((&e.at.addr, vec![one])),
        }
    }
    let mut freed = 0;
    for (addr, offsets) in by_server {
        let mut client = match MemserverClient::connect(addr, key, FREE_IO_TIMEOUT) {
            Ok(c) => c,
            Err(e) => {
                log::warn!(
                    "job {job}: cannot free the {} abandoned checkpoint extents (offset, \
                     checkpoint) {offsets:?}: {e}",
                    offsets.len()
                );
                continue;
            }
        };
        for (offset, owner) in offsets {
            match client.free(offset, owner) {
                Ok(()) => freed += 1,
                Err(e) => log::warn!(
                    "job {job}: cannot free the abandoned extent of checkpoint {owner} at \
                     offset {offset}: {e}"
                ),
            }
        }
    }
    log::info!(
        "job {job}: freed {freed} of {} abandoned checkpoint extents",
        extents.len()
    );
    freed
}
