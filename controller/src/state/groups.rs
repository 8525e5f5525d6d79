//! The sync-group service in the controller's state: `TrainGroupReady`
//! parks its reply slot in the [`GroupService`] and `apply` returns
//! [`Outcome::Deferred`]; the server awaits it outside the lock. Groups
//! close on an ask, on [`ControllerState::poll_groups`] (the server's
//! timer task calls it at [`ControllerState::next_group_deadline`]), when a
//! GPU server is lost (its pipelines are removed), and a job that stops,
//! fails or finishes answers every waiting ask with `stop`.
//!
//! The schedulers' clock is the controller's: the `Instant` of the first
//! ask is the origin, every later `now` the `Duration` since it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_common::proto::{ControllerReply, ErrorCode, ErrorReply, TrainJobState};
use tokio::sync::{oneshot, Notify};

use super::{ControllerState, Outcome};
use crate::jobs::JobError;
use crate::training::{Ask, AskError, Delivery, SyncScheme, Waiter};

/// Longest the server keeps a `TrainGroupReady` open: past it the ask is
/// answered `deadline_exceeded` (an allreduce group waits for every
/// pipeline, and a worker that stays silent that long is lost or stuck);
/// the worker may ask again and takes its own place in the group.
pub const GROUP_REPLY_WAIT_MAX: Duration = Duration::from_secs(600);

/// A waiting ask's reply slot.
#[derive(Debug)]
pub struct GroupSlot(oneshot::Sender<ControllerReply>);

impl Waiter for GroupSlot {
    fn is_gone(&self) -> bool {
        self.0.is_closed()
    }
}

impl ControllerState {
    /// The Duration since the group clock's origin (the first ask).
    pub(super) fn group_clock(&mut self, now: Instant) -> Duration {
        let origin = *self.group_origin.get_or_insert(now);
        now.saturating_duration_since(origin)
    }

    /// Wakes the server's group timer when an ask may have set an earlier
    /// deadline.
    pub fn group_wake(&self) -> Arc<Notify> {
        self.group_wake.clone()
    }

    /// When the next group deadline passes, if any group waits on one.
    pub fn next_group_deadline(&self) -> Option<Instant> {
        let origin = self.group_origin?;
        self.groups.next_deadline().map(|d| origin + d)
    }

    /// Closes the groups whose deadline passed by `now` and answers their
    /// members.
    pub fn poll_groups(&mut self, now: Instant) {
        let at = self.group_clock(now);
        let out = self.groups.poll(at);
        self.deliver(out);
    }

    /// Asks waiting for a group in `job`.
    pub fn group_asks_waiting(&self, job: &str) -> usize {
        self.groups.waiting(job)
    }

    /// `TrainGroupReady`: parks the ask until its group closes.
    pub(super) fn group_ready(
        &mut self,
        job: &str,
        generation: u64,
        pipeline: u32,
        stage: u32,
        iteration: u64,
        now: Instant,
    ) -> Outcome {
        let Some(j) = self.jobs.get(job) else {
            return ErrorReply::from(JobError::UnknownJob {
                job: job.to_string(),
            })
            .into();
        };
        let (pipelines, stages) = (j.spec().pipelines, j.spec().stages);
        if pipeline >= pipelines || stage >= stages {
            return ErrorReply::from(JobError::NoSuchStage {
                job: job.to_string(),
                pipeline,
                stage,
                pipelines,
                stages,
            })
            .into();
        }
        let stop = || {
            Outcome::Reply(ControllerReply::TrainGroup {
                job: job.to_string(),
                stage,
                iteration,
                members: Vec::new(),
                stop: true,
            })
        };
        match j.state() {
            TrainJobState::Pending => {
                return ErrorReply::new(
                    ErrorCode::BadRequest,
                    format!(
                        "job {job} is pending: none of its stage workers was started; \
                         a worker asks for groups once its TrainStageStart came"
                    ),
                )
                .into()
            }
            s if s.is_terminal() || *s == TrainJobState::Stopping => return stop(),
            _ => {}
        }
        let scheme = match SyncScheme::from_spec(&j.spec().sync, pipelines) {
            Ok(s) => s,
            Err(why) => {
                return ErrorReply::new(ErrorCode::Unsupported, format!("job {job}: {why}")).into()
            }
        };
        let current = j.generation();
        let closed = self.groups.open(job, current, pipelines, stages, scheme);
        self.deliver(closed);
        let at = self.group_clock(now);
        let (tx, rx) = oneshot::channel();
        let ask = Ask {
            job,
            generation,
            pipeline,
            stage,
            iteration,
        };
        let mut out = Vec::new();
        let asked = self.groups.ask(ask, GroupSlot(tx), at, &mut out);
        self.deliver(out);
        match asked {
            Ok(()) => {
                self.group_wake.notify_one();
                Outcome::Deferred(rx)
            }
            Err(e) => {
                let code = match e {
                    AskError::TooManyAsks { .. } => ErrorCode::Full,
                    AskError::NotOpen { .. } => ErrorCode::Internal,
                    _ => ErrorCode::BadRequest,
                };
                ErrorReply::new(code, e.to_string()).into()
            }
        }
    }

    /// A job changed state: stopping or ended, its waiting asks are
    /// answered `stop` and its schedulers dropped, and the driver frees the
    /// checkpoint parts it abandoned.
    pub(super) fn job_changed(&mut self, id: &str) {
        self.free_abandoned_soon();
        let ended = self
            .jobs
            .get(id)
            .is_none_or(|j| j.state().is_terminal() || *j.state() == TrainJobState::Stopping);
        if ended {
            let out = self.groups.close(id);
            self.deliver(out);
        }
    }

    /// Sends each answer to its slot (a oneshot: no IO, never blocks). An
    /// answer for a job that is stopping or ended by now says `stop`.
    pub(super) fn deliver(&mut self, out: Vec<Delivery<GroupSlot>>) {
        for d in out {
            let a = d.answer;
            let over = self
                .jobs
                .get(&a.job)
                .is_none_or(|j| j.state().is_terminal() || *j.state() == TrainJobState::Stopping);
            let stop = a.stop || over;
            let reply = ControllerReply::TrainGroup {
                members: if stop { Vec::new() } else { a.members },
                job: a.job,
                stage: a.stage,
                iteration: a.iteration,
                stop,
            };
            // The asker may have gone; nothing to do then.
            let _ = d.to.0.send(reply);
        }
    }
}
