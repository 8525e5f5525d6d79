//! The sync-group service: every training job's group schedulers, one per
//! (job, generation, stage), and the stage workers waiting for their group.
//!
//! A stage worker that finished an iteration's backward passes asks with
//! whom to average this stage's weights (`TrainGroupReady`); the answer
//! comes only when its group closes. So an ask is parked with a waiter `W`
//! (the caller's reply slot: a oneshot sender in the server, a plain value
//! in tests) and every call returns the [`Delivery`]s it released, as
//! values: the caller sends them. Pure: no IO, no clock; time is a
//! `Duration` since an origin the caller picks, kept monotone here (a time
//! before the last one counts as the last one).
//!
//! * The scheduler of a stage is made at its first ask, by the job's sync
//!   mode ([`SyncScheme`]): `allreduce` -> [`AllReduce`], `preduce` ->
//!   [`PartialReduce`] with the spec's first wait and staleness bound,
//!   `adpsgd` -> [`AdPsgd`] with its seed. Workers are pipelines.
//! * At most one ask per worker is outstanding (a second one is refused,
//!   unless the first asker went away, its connection closed: the second
//!   then takes the first one's place in its group), and at most
//!   [`GROUP_ASKS_PER_JOB_MAX`] per job.
//! * [`GroupService::poll`] closes the groups whose deadline passed; the
//!   caller polls at [`GroupService::next_deadline`].
//! * [`GroupService::close`] (the job stopped, failed or finished) answers
//!   every waiting ask with `stop`; a newer generation does so for the older
//!   one's asks, and an ask of an older generation is answered `stop` at
//!   once.
//! * [`GroupService::remove`] takes a pipeline out of every stage's
//!   scheduler (its GPU server was lost): groups stop waiting for it, and
//!   its own waiting asks are answered `stop`.

use std::collections::BTreeMap;
use std::time::Duration;

use distmind_common::train_spec::{SyncMode, PIPELINES_MAX, STAGE_WORKERS_MAX};

use super::group::{GroupError, GroupScheduler, WorkerId};
use super::preduce::{PReduceConfig, SSP_BOUND_DEFAULT, WAIT_MAX};
use super::{AdPsgd, AllReduce, Group, PartialReduce};

/// Most asks waiting in one job: one per stage worker.
pub const GROUP_ASKS_PER_JOB_MAX: usize = STAGE_WORKERS_MAX as usize;
// A job's pipelines fit one scheduler.
const _: () = assert!(PIPELINES_MAX as usize <= super::WORKERS_MAX);

/// A reply slot that can tell whether its asker still listens.
pub trait Waiter {
    /// The asker went away (its connection closed): nobody reads an answer.
    fn is_gone(&self) -> bool;
}

/// How one job's stage replicas group, from its spec.
#[derive(Debug, Clone, PartialEq)]
pub enum SyncScheme {
    AllReduce,
    PartialReduce(PReduceConfig),
    AdPsgd { seed: u64 },
}

impl SyncScheme {
    /// The scheme of `sync` for `pipelines` pipelines, or why there is none.
    pub fn from_spec(sync: &SyncMode, pipelines: u32) -> Result<SyncScheme, String> {
        let workers = pipelines as usize;
        Ok(match sync {
            SyncMode::Allreduce(_) => SyncScheme::AllReduce,
            SyncMode::Adpsgd(a) => SyncScheme::AdPsgd { seed: a.seed },
            SyncMode::Preduce(p) => {
                let mut cfg = PReduceConfig::new(workers);
                if let Some(ms) = p.wait_ms_initial {
                    // The spec's first wait is taken as asked, within
                    // [wait_min, max(wait_max, it)].
                    cfg.wait_initial = Duration::from_millis(ms).max(cfg.wait_min);
                    cfg.wait_max = cfg.wait_max.max(cfg.wait_initial).max(WAIT_MAX);
                }
                // Updates per worker between graph syncs (SD-Pipe's
                // ssp_bound), at least 1; absent: SD-Pipe's 10.
                cfg.ssp_bound = p
                    .ssp_bound
                    .map_or(SSP_BOUND_DEFAULT, |b| u64::from(b.max(1)));
                SyncScheme::PartialReduce(cfg)
            }
            SyncMode::Hetpipe(_) => {
                return Err(
                    "sync hetpipe pushes to a parameter server; it forms no averaging groups"
                        .to_string(),
                )
            }
        })
    }

    fn scheduler(&self, workers: usize) -> Result<Box<dyn GroupScheduler + Send>, GroupError> {
        Ok(match self {
            SyncScheme::AllReduce => Box::new(AllReduce::new(workers)?),
            SyncScheme::PartialReduce(cfg) => {
                Box::new(PartialReduce::new(PReduceConfig { workers, ..*cfg })?)
            }
            SyncScheme::AdPsgd { seed } => Box::new(AdPsgd::new(workers, *seed)?),
        })
    }
}

/// The answer to one ask: the pipelines whose replicas of `stage` average
/// now (sorted, the asker's own included), or `stop`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupAnswer {
    pub job: String,
    pub stage: u32,
    /// The iteration the asker asked for.
    pub iteration: u64,
    pub members: Vec<u32>,
    /// The job ended (or this generation did, or the asker's pipeline is
    /// gone): do not average, stop.
    pub stop: bool,
}

/// An answer and where it goes.
#[derive(Debug)]
pub struct Delivery<W> {
    pub to: W,
    pub answer: GroupAnswer,
}

/// One `TrainGroupReady`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask<'a> {
    pub job: &'a str,
    pub generation: u64,
    pub pipeline: u32,
    pub stage: u32,
    pub iteration: u64,
}

/// Why an ask was refused (the asker gets it as an error reply).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AskError {
    #[error("job {job}: no sync groups are open for it (it is not running)")]
    NotOpen { job: String },
    #[error(
        "job {job}: an ask of generation {asked}, but the job runs generation {current}; \
         a worker takes its generation from its assignment"
    )]
    FutureGeneration {
        job: String,
        asked: u64,
        current: u64,
    },
    #[error(
        "job {job} has pipelines 0..{pipelines} and stages 0..{stages}: no pipeline {pipeline} stage {stage}"
    )]
    NoSuchWorker {
        job: String,
        pipeline: u32,
        stage: u32,
        pipelines: u32,
        stages: u32,
    },
    #[error(
        "job {job} pipeline {pipeline} stage {stage} already waits for its group of iteration \
         {waiting}: one ask per worker at a time; wait for its answer"
    )]
    AlreadyWaiting {
        job: String,
        pipeline: u32,
        stage: u32,
        waiting: u64,
    },
    #[error("job {job}: {waiting} asks wait already, the most one job may have (GROUP_ASKS_PER_JOB_MAX)")]
    TooManyAsks { job: String, waiting: usize },
    #[error("job {job} stage {stage}: {what}")]
    Scheduler {
        job: String,
        stage: u32,
        what: String,
    },
}

/// One job's schedulers and waiting asks.
struct JobGroups<W> {
    generation: u64,
    pipelines: u32,
    stages: u32,
    scheme: SyncScheme,
    /// Per stage, made at its first ask.
    schedulers: Vec<Option<Box<dyn GroupScheduler + Send>>>,
    /// Pipelines taken out (made schedulers start without them too).
    removed: Vec<bool>,
    /// (stage, pipeline) -> the iteration asked for and the reply slot.
    waiting: BTreeMap<(u32, u32), (u64, W)>,
}

/// Every job's sync groups; see the module docs.
pub struct GroupService<W> {
    jobs: BTreeMap<String, JobGroups<W>>,
    /// The latest time seen: time never goes back.
    last: Duration,
}

impl<W> Default for GroupService<W> {
    fn default() -> Self {
        GroupService {
            jobs: BTreeMap::new(),
            last: Duration::ZERO,
        }
    }
}

impl<W> std::fmt::Debug for GroupService<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupService")
            .field("jobs", &self.jobs.keys().collect::<Vec<_>>())
            .field(
                "waiting",
                &self.jobs.values().map(|j| j.waiting.len()).sum::<usize>(),
            )
            .field("last", &self.last)
            .finish()
    }
}

impl<W: Waiter> GroupService<W> {
    pub fn new() -> Self {
        Self::default()
    }

    fn clock(&mut self, now: Duration) -> Duration {
        self.last = self.last.max(now);
        self.last
    }

    /// The generation whose groups are open for `job`, if any.
    pub fn generation(&self, job: &str) -> Option<u64> {
        self.jobs.get(job).map(|j| j.generation)
    }

    /// Asks waiting in `job` whose asker still listens (one that went
    /// away keeps its place in its group until it asks again, unseen here).
    pub fn waiting(&self, job: &str) -> usize {
        self.jobs.get(job).map_or(0, |j| {
            j.waiting.values().filter(|(_, w)| !w.is_gone()).count()
        })
    }

    /// Opens `job`'s groups for `generation` (P pipelines x S stages). A job
    /// open at an older generation is closed first: its asks are answered
    /// `stop`. Opening the generation already open changes nothing.
    pub fn open(
        &mut self,
        job: &str,
        generation: u64,
        pipelines: u32,
        stages: u32,
        scheme: SyncScheme,
    ) -> Vec<Delivery<W>> {
        if self.generation(job) == Some(generation) {
            return Vec::new();
        }
        let out = self.close(job);
        self.jobs.insert(
            job.to_string(),
            JobGroups {
                generation,
                pipelines,
                stages,
                scheme,
                schedulers: (0..stages).map(|_| None).collect(),
                removed: vec![false; pipelines as usize],
                waiting: BTreeMap::new(),
            },
        );
        out
    }

    /// Answers every ask waiting in `job` with `stop` and forgets the job.
    pub fn close(&mut self, job: &str) -> Vec<Delivery<W>> {
        let Some(j) = self.jobs.remove(job) else {
            return Vec::new();
        };
        j.waiting
            .into_iter()
            .map(|((stage, _), (iteration, to))| Delivery {
                to,
                answer: stop_answer(job, stage, iteration),
            })
            .collect()
    }

    /// Worker (`ask.pipeline`, `ask.stage`) is ready at `now`: parks `to`
    /// until its group closes. Appends to `out` what this released, even
    /// when the ask itself is refused: groups whose deadline had passed
    /// (the asker may be in one), the asker's own answer when its group
    /// closed at once, others' whose group it completed.
    pub fn ask(
        &mut self,
        ask: Ask<'_>,
        to: W,
        now: Duration,
        out: &mut Vec<Delivery<W>>,
    ) -> Result<(), AskError> {
        let now = self.clock(now);
        let job_id = ask.job;
        let Some(j) = self.jobs.get_mut(job_id) else {
            return Err(AskError::NotOpen {
                job: job_id.to_string(),
            });
        };
        if ask.pipeline >= j.pipelines || ask.stage >= j.stages {
            return Err(AskError::NoSuchWorker {
                job: job_id.to_string(),
                pipeline: ask.pipeline,
                stage: ask.stage,
                pipelines: j.pipelines,
                stages: j.stages,
            });
        }
        if ask.generation < j.generation || j.removed[ask.pipeline as usize] {
            // That generation is over, or its pipeline is gone.
            out.push(Delivery {
                to,
                answer: stop_answer(job_id, ask.stage, ask.iteration),
            });
            return Ok(());
        }
        if ask.generation > j.generation {
            return Err(AskError::FutureGeneration {
                job: job_id.to_string(),
                asked: ask.generation,
                current: j.generation,
            });
        }
        let key = (ask.stage, ask.pipeline);
        let sched_err = |what: String| AskError::Scheduler {
            job: job_id.to_string(),
            stage: ask.stage,
            what,
        };
        if j.schedulers[ask.stage as usize].is_none() {
            let mut s = j
                .scheme
                .scheduler(j.pipelines as usize)
                .map_err(|e| sched_err(e.to_string()))?;
            for (w, _) in j.removed.iter().enumerate().filter(|(_, &r)| r) {
                // Nothing waits yet, so removal closes nothing.
                let _ = s.remove(w, now);
            }
            j.schedulers[ask.stage as usize] = Some(s);
        }
        let sched = j.schedulers[ask.stage as usize]
            .as_mut()
            .expect("made above");
        // A deadline that passed closes first: the asker may be in it.
        let due = sched.poll(now);
        deliver(job_id, ask.stage, &mut j.waiting, due, out);
        if let Some((waiting, prev)) = j.waiting.get(&key) {
            if prev.is_gone() {
                // The asker came back (a new connection): it takes the
                // place of its own earlier ask, still waiting in its group.
                j.waiting.insert(key, (ask.iteration, to));
                return Ok(());
            }
            return Err(AskError::AlreadyWaiting {
                job: job_id.to_string(),
                pipeline: ask.pipeline,
                stage: ask.stage,
                waiting: *waiting,
            });
        }
        if j.waiting.len() >= GROUP_ASKS_PER_JOB_MAX {
            return Err(AskError::TooManyAsks {
                job: job_id.to_string(),
                waiting: j.waiting.len(),
            });
        }
        // A refusal leaves the scheduler as it was.
        let groups = sched
            .ready(ask.pipeline as WorkerId, now)
            .map_err(|e| sched_err(format!("pipeline {}: {e}", ask.pipeline)))?;
        j.waiting.insert(key, (ask.iteration, to));
        deliver(job_id, ask.stage, &mut j.waiting, groups, out);
        Ok(())
    }

    /// Closes every group whose deadline passed by `now`.
    pub fn poll(&mut self, now: Duration) -> Vec<Delivery<W>> {
        let now = self.clock(now);
        let mut out = Vec::new();
        for (id, j) in &mut self.jobs {
            for (stage, s) in j.schedulers.iter_mut().enumerate() {
                let Some(s) = s else { continue };
                if s.next_deadline().is_some_and(|d| d <= now) {
                    let groups = s.poll(now);
                    deliver(id, stage as u32, &mut j.waiting, groups, &mut out);
                }
            }
        }
        out
    }

    /// The earliest deadline of any open group: when to [`poll`](Self::poll).
    pub fn next_deadline(&self) -> Option<Duration> {
        self.jobs
            .values()
            .flat_map(|j| j.schedulers.iter().flatten())
            .filter_map(|s| s.next_deadline())
            .min()
    }

    /// Pipeline `pipeline` of `job` is gone: every stage's scheduler stops
    /// waiting for it (the groups its absence completes are released) and
    /// its own waiting asks are answered `stop`.
    pub fn remove(&mut self, job: &str, pipeline: u32, now: Duration) -> Vec<Delivery<W>> {
        let now = self.clock(now);
        let mut out = Vec::new();
        let Some(j) = self.jobs.get_mut(job) else {
            return out;
        };
        if pipeline >= j.pipelines || j.removed[pipeline as usize] {
            return out;
        }
        j.removed[pipeline as usize] = true;
        for stage in 0..j.stages {
            if let Some((iteration, to)) = j.waiting.remove(&(stage, pipeline)) {
                out.push(Delivery {
                    to,
                    answer: stop_answer(job, stage, iteration),
                });
            }
            let Some(s) = j.schedulers[stage as usize].as_mut() else {
                continue;
            };
            match s.remove(pipeline as WorkerId, now) {
                Ok(groups) => deliver(job, stage, &mut j.waiting, groups, &mut out),
                Err(e) => log::warn!("job {job} stage {stage}: removing pipeline {pipeline}: {e}"),
            }
        }
        out
    }
}

fn stop_answer(job: &str, stage: u32, iteration: u64) -> GroupAnswer {
    GroupAnswer {
        job: job.to_string(),
        stage,
        iteration,
        members: Vec::new(),
        stop: true,
    }
}

/// Each member of each closed group gets its group.
fn deliver<W>(
    job: &str,
    stage: u32,
    waiting: &mut BTreeMap<(u32, u32), (u64, W)>,
    groups: Vec<Group>,
    out: &mut Vec<Delivery<W>>,
) {
    for g in groups {
        let members: Vec<u32> = g.members.iter().map(|&m| m as u32).collect();
        for &m in &members {
            match waiting.remove(&(stage, m)) {
                Some((iteration, to)) => out.push(Delivery {
                    to,
                    answer: GroupAnswer {
                        job: job.to_string(),
                        stage,
                        iteration,
                        members: members.clone(),
                        stop: false,
                    },
                }),
                None => log::warn!(
                    "job {job} stage {stage}: a group {members:?} closed with pipeline {m}, \
                     which has no waiting ask"
                ),
            }
        }
    }
}

#[cfg(test)]
#[path = "groups_tests.rs"]
mod tests;
