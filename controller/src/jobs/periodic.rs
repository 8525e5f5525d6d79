//! Periodic checkpoints (pure, like the registry): a job whose spec sets
//! `checkpoint_every = k` has pipeline 0's workers write their stage's
//! weights every `k` iterations ([`periodic_due`]), at an iteration
//! boundary, without draining: each worker writes its part (group `stage`
//! of the checkpoint model, laid out as a re-partitioning's, see
//! [`checkpoint`](super::checkpoint)) after its iteration's report and
//! says `TrainCheckpointed`; the job goes on meanwhile.
//!
//! Every periodic checkpoint of a job is the model
//! [`periodic_checkpoint_name`] (`<job>-ckpt`): once every stage's part is
//! in, the controller puts it in its catalog, replacing the previous one,
//! and hands the replaced entry's extents to the worker whose part came
//! last, to free them (the new entry is visible by then, as `distmind
//! deploy` frees a replaced entry). A job so holds at most one periodic
//! checkpoint, plus the parts of the one being written. The last complete
//! checkpoint, periodic or a re-partitioning's, is the job's
//! `last_checkpoint` in `train status`, and a failure's reason names it.
//!
//! Parts of a checkpoint that never completes (the job failed or stopped
//! while pipeline 0 wrote it, a newer periodic checkpoint began before it
//! completed, or the catalog refused it) are abandoned ([`Job::abandon`]):
//! the controller's training driver frees their extents on the memory
//! servers, each free naming the checkpoint as the extent's owner. A part
//! the controller refuses was never recorded, so the worker that wrote it
//! frees it; a part whose worker died before its notice came in is known
//! to no one and stays allocated.

use distmind_common::proto::{GroupLocation, LastCheckpoint, TrainJobState};

use super::checkpoint::{combine, periodic_checkpoint_name, periodic_due};
use super::{CheckpointParts, Job, JobError, OwnedExtent};

/// One worker's part, as its `TrainCheckpointed` says.
#[derive(Debug, Clone)]
pub(super) struct Part {
    pub generation: u64,
    pub pipeline: u32,
    pub stage: u32,
    pub iteration: u64,
    pub group: GroupLocation,
    pub layer_checksums: Vec<u64>,
}

/// A periodic checkpoint being written.
#[derive(Debug, Clone)]
pub(crate) struct Periodic {
    generation: u64,
    iteration: u64,
    /// Per stage of pipeline 0: its written group and per-layer checksums.
    parts: Vec<Option<(GroupLocation, Vec<u64>)>>,
}

impl Job {
    /// The last complete checkpoint in the catalog.
    pub fn last_checkpoint(&self) -> Option<&LastCheckpoint> {
        self.last_checkpoint.as_ref()
    }

    /// Whether the job takes checkpoint parts in its state: it runs (or
    /// is placed, or re-partitions).
    pub(super) fn takes_checkpoint_parts(&self) -> bool {
        matches!(
            self.state,
            TrainJobState::Placing | TrainJobState::Running | TrainJobState::Repartitioning
        )
    }

    /// Checkpoint parts that will never be in the catalog: their extents
    /// (every replica of every slice) wait in [`Job::abandoned`] for the
    /// controller to free them. `owner` is the checkpoint's name (what its
    /// extents were allocated for), `what` names the checkpoint and `why`
    /// says why it will never be in the catalog, for the log.
    pub(super) fn abandon(
        &mut self,
        owner: &str,
        what: &str,
        why: &str,
        parts: impl IntoIterator<Item = GroupLocation>,
    ) {
        let (mut n, before) = (0, self.abandoned.len());
        for g in parts {
            n += 1;
            self.abandoned
                .extend(
                    g.slices
                        .into_iter()
                        .flat_map(|s| s.replicas)
                        .map(|at| OwnedExtent {
                            owner: owner.to_string(),
                            at,
                        }),
                );
        }
        if n > 0 {
            log::warn!(
                "training job {}: freeing the {n} parts ({} extents) of {what}, which will \
                 never be in the catalog: {why}",
                self.id,
                self.abandoned.len() - before
            );
        }
    }

    /// The job no longer takes checkpoint parts: those of the periodic
    /// checkpoint being written, and of a re-partitioning's still
    /// draining, are abandoned.
    pub(super) fn abandon_unfinished_checkpoints(&mut self) {
        let why = format!("the job is {}", self.state.name());
        if let Some(w) = self.periodic.take() {
            let name = periodic_checkpoint_name(&self.id);
            let what = format!("periodic checkpoint {name} after iteration {}", w.iteration);
            self.abandon(
                &name,
                &what,
                &why,
                w.parts.into_iter().flatten().map(|(g, _)| g),
            );
        }
        let draining = self
            .drain
            .as_mut()
            .filter(|d| d.phase == super::DrainPhase::Draining);
        if let Some(d) = draining {
            let owner = d.checkpoint.clone();
            let what = format!("re-partitioning checkpoint {owner}");
            let parts: Vec<GroupLocation> = d
                .parts
                .iter_mut()
                .filter_map(Option::take)
                .map(|(g, _)| g)
                .collect();
            self.abandon(&owner, &what, &why, parts);
        }
    }

    /// A failure's reason as the job keeps it: `reason`, then the last
    /// checkpoint to resume from (or that there is none yet), within
    /// [`REASON_BYTES_MAX`](super::REASON_BYTES_MAX).
    pub(super) fn failure_reason(&self, reason: &str) -> String {
        let max = super::REASON_BYTES_MAX;
        let last = match &self.last_checkpoint {
            Some(c) => format!("; last checkpoint: {c}"),
            None => "; no checkpoint yet".to_string(),
        };
        let reason = super::cut(reason, max.saturating_sub(last.len())) + &last;
        super::cut(&reason, max)
    }

    /// A worker's part of the periodic checkpoint: every part once the
    /// last one came. Refuses a part the job did not ask for.
    pub(super) fn periodic_part(&mut self, p: Part) -> Result<Option<CheckpointParts>, JobError> {
        self.check_stage(p.pipeline, p.stage)?;
        let id = self.id.clone();
        let bad = |what: String| JobError::BadReport {
            job: id.clone(),
            pipeline: p.pipeline,
            stage: p.stage,
            what,
        };
        let name = periodic_checkpoint_name(&self.id);
        if !self.takes_checkpoint_parts() || p.generation != self.generation {
            return Err(bad(format!(
                "a part of periodic checkpoint {name} from generation {}, but the job is {} \
                     in generation {}",
                p.generation,
                self.state.name(),
                self.generation
            )));
        }
        let every = self.spec.checkpoint_every;
        if p.pipeline != 0
            || p.group.index != p.stage
            || !periodic_due(every, p.iteration, self.spec.iterations)
        {
            return Err(bad(format!(
                "a part of pipeline {} as group {} of {name} after iteration {}; the job asks \
                     pipeline 0 for group {} every {every:?} iterations",
                p.pipeline, p.group.index, p.iteration, p.stage
            )));
        }
        let ranges = distmind_common::train_spec::layer_ranges(&self.partition);
        let layers = ranges[p.stage as usize].len();
        if p.layer_checksums.len() != layers {
            return Err(bad(format!(
                "{} layer checksums for the stage's {layers} layers",
                p.layer_checksums.len()
            )));
        }
        let stages = self.spec.stages as usize;
        let at = (p.generation, p.iteration);
        match &self.periodic {
            Some(w) if (w.generation, w.iteration) == at => {}
            Some(w) if (w.generation, w.iteration) > at => {
                return Err(bad(format!(
                    "a part of {name} after iteration {}, but the one after iteration {} is \
                         being written",
                    p.iteration, w.iteration
                )))
            }
            _ => {
                if let Some(w) = self.periodic.take() {
                    let what = format!(
                        "periodic checkpoint {name} after iteration {} of generation {}",
                        w.iteration, w.generation
                    );
                    let why = format!(
                        "the one after iteration {} of generation {} began before it completed",
                        p.iteration, p.generation
                    );
                    let parts = w.parts.into_iter().flatten().map(|(g, _)| g);
                    self.abandon(&name, &what, &why, parts);
                }
                self.periodic = Some(Periodic {
                    generation: p.generation,
                    iteration: p.iteration,
                    parts: vec![None; stages],
                });
            }
        }
        let w = self.periodic.as_mut().expect("set above");
        let slot = &mut w.parts[p.stage as usize];
        if slot.is_some() {
            return Err(bad(format!(
                "a second part of {name} after iteration {} from this stage",
                p.iteration
            )));
        }
        log::info!(
            "training job {}: stage {} wrote its part of periodic checkpoint {name} after \
             iteration {} ({} bytes)",
            self.id,
            p.stage,
            p.iteration,
            p.group.bytes
        );
        *slot = Some((p.group, p.layer_checksums));
        if w.parts.iter().any(Option::is_none) {
            return Ok(None);
        }
        let w = self.periodic.take().expect("complete");
        let sums: Vec<u64> = w
            .parts
            .iter()
            .flatten()
            .flat_map(|(_, c)| c.iter().copied())
            .collect();
        let (base_model, base_version) = self.model_now();
        Ok(Some(CheckpointParts {
            name,
            base: (base_model.to_string(), base_version),
            partition: self.partition.clone(),
            groups: w.parts.into_iter().flatten().map(|(g, _)| g).collect(),
            generation: w.generation,
            iteration: w.iteration,
            written: combine(&sums),
            periodic: true,
        }))
    }

    /// Checkpoint `parts` is in the catalog as `version`: the job's last
    /// checkpoint, unless a later one already is.
    pub(super) fn checkpoint_saved(&mut self, parts: &CheckpointParts, version: u64) {
        let later = self
            .last_checkpoint
            .as_ref()
            .is_some_and(|c| (c.generation, c.iteration) > (parts.generation, parts.iteration));
        if later {
            return;
        }
        self.last_checkpoint = Some(LastCheckpoint {
            model: parts.name.clone(),
            catalog_version: version,
            generation: parts.generation,
            iteration: parts.iteration,
            written: parts.written,
            group_checksums: parts.groups.iter().map(|g| g.checksum.clone()).collect(),
        });
    }
}

impl super::JobRegistry {
    /// Takes the extents of every job's abandoned checkpoint parts, to
    /// free: per job, its id and the extents.
    pub fn take_abandoned(&mut self) -> Vec<(String, Vec<OwnedExtent>)> {
        self.jobs
            .values_mut()
            .filter(|j| !j.abandoned.is_empty())
            .map(|j| (j.id.clone(), std::mem::take(&mut j.abandoned)))
            .collect()
    }

    /// Whether a job has abandoned checkpoint parts not yet taken.
    pub fn has_abandoned(&self) -> bool {
        self.jobs.values().any(|j| !j.abandoned.is_empty())
    }

    /// Checkpoint `parts` of job `id` will never be in the catalog (it
    /// refused them): abandoned, to free (false: no such job).
    pub fn abandon_checkpoint(&mut self, id: &str, parts: &CheckpointParts) -> bool {
        match self.get_mut(id) {
            Ok(job) => {
                let what = format!(
                    "checkpoint {} after iteration {}",
                    parts.name, parts.iteration
                );
                job.abandon(
                    &parts.name,
                    &what,
                    "the catalog refused it",
                    parts.groups.iter().cloned(),
                );
                true
            }
            Err(_) => false,
        }
    }

    /// Checkpoint `parts` of job `id` is in the catalog as `version`; it
    /// becomes the job's last checkpoint (false: no such job).
    pub fn checkpoint_saved(&mut self, id: &str, parts: &CheckpointParts, version: u64) -> bool {
        match self.get_mut(id) {
            Ok(job) => {
                job.checkpoint_saved(parts, version);
                true
            }
            Err(_) => false,
        }
    }
}
