//! With whom a stage's replica averages its weights after an iteration.
//!
//! Every mode steps locally first (the optimizer on the replica's own
//! gradient), then averages the weights (`params_flat`: learnable params
//! and BatchNorm running statistics; momentum buffers stay local) with a
//! group of replicas by ring all-reduce, so the modes differ only in the
//! group:
//!
//! * `allreduce`: every pipeline, every iteration (model averaging after
//!   each local step); the controller is not asked;
//! * `preduce` (SD-Pipe's partial reduce) and `adpsgd` (AD-PSGD's random
//!   peer): the group the controller's scheduler returns for
//!   `TrainGroupReady` ([`check_group`] checks it); a group of one goes on
//!   without averaging.

use distmind_common::train_spec::SyncMode;

/// The group of a mode that needs no controller: every pipeline for
/// `allreduce`; `None` for the modes whose group the controller forms.
pub(crate) fn fixed_group(sync: &SyncMode, pipelines: u32) -> Option<Vec<u32>> {
    match sync {
        SyncMode::Allreduce(_) => Some((0..pipelines).collect()),
        SyncMode::Preduce(_) | SyncMode::Adpsgd(_) | SyncMode::Hetpipe(_) => None,
    }
}

/// A group from the controller must be a strictly ascending set of the
/// job's pipelines holding this worker's (`me`); why not, otherwise.
pub(crate) fn check_group(members: &[u32], pipelines: u32, me: u32) -> Result<(), String> {
    if !members.contains(&me) {
        return Err(format!("leaves out this worker's pipeline {me}"));
    }
    if members.iter().any(|&m| m >= pipelines) || members.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!(
            "is not a strictly ascending set of the pipelines 0..{pipelines} of the job"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::train_spec::{Adpsgd, Allreduce, Preduce};

    #[test]
    fn allreduce_takes_every_pipeline_the_others_ask() {
        assert_eq!(
            fixed_group(&SyncMode::Allreduce(Allreduce {}), 3),
            Some(vec![0, 1, 2])
        );
        assert_eq!(fixed_group(&SyncMode::Preduce(Preduce::default()), 3), None);
        assert_eq!(fixed_group(&SyncMode::Adpsgd(Adpsgd::default()), 3), None);
    }

    #[test]
    fn a_group_must_hold_the_worker_and_only_the_jobs_pipelines() {
        assert_eq!(check_group(&[1], 4, 1), Ok(()));
        assert_eq!(check_group(&[0, 2, 3], 4, 2), Ok(()));
        assert!(check_group(&[0, 2], 4, 1)
            .unwrap_err()
            .contains("pipeline 1"));
        assert!(check_group(&[1, 4], 4, 1).unwrap_err().contains("0..4"));
        assert!(check_group(&[2, 1], 4, 1).is_err());
        assert!(check_group(&[1, 1], 4, 1).is_err());
    }
}
