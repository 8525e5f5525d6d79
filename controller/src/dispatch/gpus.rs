//! The dispatcher's view of each GPU, and the packed summary that routing
//! scans.
//!
//! Routing a request under `slo` looks at every GPU. Read from the full
//! [`GpuState`] (a few hundred bytes each, its EDF queue a B-tree
//! elsewhere), that scan was half of a decision's time in a profile of
//! `distmind bench dispatch` (64 GPUs), spread over loads of scattered
//! fields. Each GPU's [`Lane`] holds, in 48 bytes of one array, what the
//! scan's cheap bound needs; the full state is read only for the GPUs the
//! bound does not rule out (with the bound from each GPU's exact service
//! time, decisions/s rose 1.5x).
//!
//! **Invariant:** a lane always equals [`Lane::of`] its GPU's state. The
//! state is mutable only through [`GpuMut`], which recomputes the lane
//! when it is dropped; [`Gpus`] has no `IndexMut`.

use std::ops::{Deref, DerefMut, Index};

use distmind_common::proto::GpuRole;

use super::core::ReqId;
use super::link::LoadMark;
use super::sets::{IdMap, ModelSet};
use crate::policy::edf::EdfQueue;
use crate::policy::training::TrainingJob;
use crate::policy::{Ewma, Gpu, Micros};

/// A GPU's resident models, most recently used first, with a set beside
/// the order: routing asks every GPU whether it holds the model, and a GPU
/// with a large memory holds dozens.
#[derive(Debug, Default)]
pub(super) struct Resident {
    order: Vec<u32>,
    set: ModelSet,
}

impl Resident {
    pub(super) fn contains(&self, model: &u32) -> bool {
        self.set.contains(model)
    }

    pub(super) fn iter(&self) -> std::slice::Iter<'_, u32> {
        self.order.iter()
    }

    pub(super) fn len(&self) -> usize {
        self.order.len()
    }

    pub(super) fn replace(&mut self, order: Vec<u32>) {
        self.set = order.iter().copied().collect();
        self.order = order;
    }

    /// `model` becomes the most recently used; the least recently used
    /// beyond `max` leave, and are returned.
    pub(super) fn touch(&mut self, model: u32, max: usize) -> Vec<u32> {
        if self.set.contains(&model) {
            if let Some(p) = self.order.iter().position(|&m| m == model) {
                self.order.remove(p);
            }
        } else {
            self.set.insert(model);
        }
        self.order.insert(0, model);
        let gone: Vec<u32> = self
            .order
            .drain(max.max(1).min(self.order.len())..)
            .collect();
        for m in &gone {
            self.set.remove(m);
        }
        gone
    }
}

#[derive(Debug)]
pub(super) struct GpuState {
    pub(super) gpu: Gpu,
    pub(super) role: GpuRole,
    /// Resident model ids, most recently used first.
    pub(super) resident: Resident,
    pub(super) resident_max: usize,
    /// Its parameter memory (0: not known).
    pub(super) device_bytes: u64,
    /// Batches sent and not answered.
    pub(super) outstanding: u32,
    /// The model of each of those batches, oldest first.
    pub(super) outstanding_models: Vec<u32>,
    pub(super) busy_until: Micros,
    /// Estimated device time of the outstanding batches and of a prefetch
    /// in progress: on every answer the GPU is busy until now plus these.
    pub(super) work_out: Micros,
    pub(super) prefetch_work: Micros,
    pub(super) queue: EdfQueue<ReqId>,
    /// Per model in `queue`: how many, and the latest deadline among them
    /// (at least: removals leave it, so a joiner is never overestimated).
    /// Stale after the queue is drained elsewhere: read only while the
    /// queue is not empty, reset when it is.
    pub(super) queued_models: IdMap<u32, (u32, Micros)>,
    /// Requests in `queue` with a priority above the default: only then
    /// does planning look for one to run before the EDF head.
    pub(super) queued_ranked: u32,
    pub(super) training: Option<TrainingJob>,
    /// A prefetch was sent and not yet confirmed by a snapshot.
    pub(super) prefetching: bool,
    /// That prefetch loads from the memory servers: where on its GPU
    /// server's link it started.
    pub(super) prefetch_load: Option<LoadMark>,
    /// Its batches and prefetch that load from the memory servers, sent
    /// and not yet answered: while any, it counts once on its GPU server's
    /// link.
    pub(super) link_loads: u32,
    /// The model the `distmind` policy assigned it.
    pub(super) assigned: Option<u32>,
    /// Its runtime's link is up (a copy of the host's flag, read per decision).
    pub(super) link_up: bool,
    /// It left a request unanswered past the request's deadline and grace,
    /// answering nothing for longer than that grace, and nothing since (a
    /// reply, or a heartbeat saying nothing waits on the device) said it
    /// works: no request is routed to it. A runtime that hangs is declared
    /// lost only after its missed heartbeats, seconds later; one whose
    /// device is stuck heartbeats on.
    pub(super) silent: bool,
    /// When it last answered a request (or was added): a GPU that answers
    /// is working through its backlog, not hung.
    pub(super) answered_at: Micros,
    /// Its runtime refused the training job: ask again from then on.
    pub(super) train_retry_at: Option<Micros>,
    /// When its last batch was answered with another still outstanding
    /// (the device went straight on to it): the start of a reply-to-reply
    /// interval, which measures what the device really spends per batch.
    pub(super) busy_since: Option<Micros>,
    /// Device time per request beyond the cost model's service estimate,
    /// from those intervals: the runtime's serial work around compute, and
    /// on a CPU the cores that compute shares with the servers. Admission
    /// counts it as service, or it would admit more than the device runs.
    pub(super) serial: Ewma,
    /// `serial` rounded to µs, kept beside it: read by every admission.
    pub(super) serial_us: Micros,
}

/// What routing's cheap bound reads of one GPU, derived from its
/// [`GpuState`] (see the module's invariant).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Lane {
    /// Its runtime (whose host cache routing asks about).
    pub(super) runtime: u32,
    /// It may take a request now: routable (link up; under the `distmind`
    /// policy, an inference GPU) and its queue not full.
    pub(super) open: bool,
    /// Its outstanding work ends then.
    pub(super) busy_until: Micros,
    /// Added to its free time while it is idle: a training iteration to
    /// yield first.
    pub(super) idle_delay: Micros,
    /// The latest deadline queued (0: none queued).
    pub(super) last_deadline: Micros,
    /// Queued work (the service estimates' sum).
    pub(super) work: Micros,
    /// Its measured serial time per request ([`GpuState::serial_us`]).
    pub(super) serial_us: Micros,
}

// The size the module docs give.
const _: () = assert!(std::mem::size_of::<Lane>() == 48);

impl Lane {
    pub(super) fn of(g: &GpuState, distmind_policy: bool) -> Lane {
        let idle = g.outstanding == 0 && g.queue.is_empty();
        Lane {
            runtime: g.gpu.runtime,
            open: g.routable(distmind_policy) && !g.queue.is_full(),
            busy_until: g.busy_until,
            idle_delay: match &g.training {
                Some(job) if idle => job.worst_case_delay(),
                _ => 0,
            },
            last_deadline: g.queue.last_deadline().unwrap_or(0),
            work: g.queue.work(),
            serial_us: g.serial_us,
        }
    }

    /// When the GPU can start new work: after what it has outstanding and,
    /// when it trains and is otherwise idle, after one training iteration.
    pub(super) fn free_at(&self, now: Micros) -> Micros {
        self.busy_until.max(now) + self.idle_delay
    }
}

impl GpuState {
    /// Requests may be routed to it: its link is up, it is not
    /// [`silent`](Self::silent), and under the `distmind` policy it is an
    /// inference GPU.
    pub(super) fn routable(&self, distmind_policy: bool) -> bool {
        self.link_up && !self.silent && (!distmind_policy || self.role == GpuRole::Inference)
    }
}

/// Every GPU's state, and beside it its [`Lane`].
#[derive(Debug)]
pub(super) struct Gpus {
    state: Vec<GpuState>,
    lanes: Vec<Lane>,
    distmind_policy: bool,
}

impl Gpus {
    pub(super) fn new(distmind_policy: bool) -> Self {
        Gpus {
            state: Vec::new(),
            lanes: Vec::new(),
            distmind_policy,
        }
    }

    pub(super) fn push(&mut self, g: GpuState) {
        self.lanes.push(Lane::of(&g, self.distmind_policy));
        self.state.push(g);
    }

    pub(super) fn len(&self) -> usize {
        self.state.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    pub(super) fn iter(&self) -> std::slice::Iter<'_, GpuState> {
        self.state.iter()
    }

    pub(super) fn lane(&self, gi: usize) -> &Lane {
        &self.lanes[gi]
    }

    pub(super) fn routable(&self, gi: usize) -> bool {
        self.state[gi].routable(self.distmind_policy)
    }

    /// GPU `gi`'s state to change; its lane follows when the guard drops.
    pub(super) fn get_mut(&mut self, gi: usize) -> GpuMut<'_> {
        GpuMut {
            g: &mut self.state[gi],
            lane: &mut self.lanes[gi],
            distmind_policy: self.distmind_policy,
        }
    }

    /// Whether every lane equals [`Lane::of`] its GPU (the invariant).
    #[cfg(test)]
    pub(super) fn lanes_match_state(&self) -> bool {
        let policy = self.distmind_policy;
        (self.state.iter().zip(&self.lanes)).all(|(g, l)| Lane::of(g, policy) == *l)
    }

    /// GPU `gi` answered a request at `now`: clears [`GpuState::silent`]
    /// and notes the time.
    pub(super) fn answered(&mut self, gi: usize, now: Micros) {
        let mut g = self.get_mut(gi);
        g.silent = false;
        g.answered_at = now;
    }

    /// Applies `f` to every GPU's state, lanes following.
    pub(super) fn for_each_mut(&mut self, mut f: impl FnMut(&mut GpuState)) {
        for gi in 0..self.state.len() {
            f(&mut self.get_mut(gi));
        }
    }
}

impl Index<usize> for Gpus {
    type Output = GpuState;

    fn index(&self, gi: usize) -> &GpuState {
        &self.state[gi]
    }
}

/// A GPU's state, borrowed to change; recomputes its lane when dropped.
pub(super) struct GpuMut<'a> {
    g: &'a mut GpuState,
    lane: &'a mut Lane,
    distmind_policy: bool,
}

impl Deref for GpuMut<'_> {
    type Target = GpuState;

    fn deref(&self) -> &GpuState {
        self.g
    }
}

impl DerefMut for GpuMut<'_> {
    fn deref_mut(&mut self) -> &mut GpuState {
        self.g
    }
}

impl Drop for GpuMut<'_> {
    fn drop(&mut self) {
        *self.lane = Lane::of(self.g, self.distmind_policy);
    }
}
