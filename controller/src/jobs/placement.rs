//! Where a training job's stage workers run: a pure choice over the live GPU
//! servers' devices (no IO, no clock).
//!
//! The rule, in order:
//! 1. **Candidates** ([`candidates`]): every device of a live runtime that
//!    no other job's stage worker holds, classed by its use
//!    ([`DeviceUse`]): given to training by the inference policy (its
//!    published assignment says `training`), idle (an inference GPU with no
//!    model assigned or resident and nothing queued, by the assignment and
//!    the runtime's last snapshot), or serving.
//! 2. **Which classes**: the P x S best by class, training, then idle,
//!    then serving (training on a serving GPU yields to its requests at
//!    every iteration boundary: the last resort, never refused). Every
//!    candidate of a class better than the worst one needed is used; of the
//!    worst class, as many as are still needed, in the order of step 3.
//! 3. **Which stage where**: pipelines in order, stages in order. A
//!    pipeline's consecutive stages stay on one host while it has usable
//!    devices left (activations and gradients cross no network there). A
//!    pipeline starts on, or moves on to, the host that (a) can hold all
//!    its remaining stages, else (b) holds no other pipeline of the job yet
//!    (pipelines spread across hosts: one host's inference burst or loss
//!    touches fewer replicas), else (c) has the most usable devices left,
//!    then (d) has the lowest runtime id. A host's devices go in ordinal
//!    order.
//!
//! Not enough candidates is [`PlacementError::NotEnoughDevices`], with the
//! counts that explain it.

use std::collections::{BTreeMap, BTreeSet};

use distmind_common::proto::{DeviceUse, GpuAssignment, GpuRole, StagePlacement};

use crate::policy::Gpu;
use crate::runtimes::RuntimeView;

/// A device a stage worker could run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub runtime: u32,
    /// The runtime's request address.
    pub addr: String,
    pub device: u32,
    pub usage: DeviceUse,
}

/// The candidates and the counts an error explains itself with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Candidates {
    pub list: Vec<Candidate>,
    pub runtimes_live: usize,
    pub devices_live: usize,
    /// Live devices other jobs' stage workers hold.
    pub held: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    #[error(
        "needs {needed} GPUs ({pipelines} pipelines x {stages} stages) and {free} are free \
         ({devices_live} devices on {runtimes_live} live GPU servers, {held} held by other training jobs); \
         start more GPU servers, stop a job, or lower pipelines or stages"
    )]
    NotEnoughDevices {
        needed: u32,
        pipelines: u32,
        stages: u32,
        free: usize,
        devices_live: usize,
        runtimes_live: usize,
        held: usize,
    },
}

/// Every device of `runtimes` (the live ones) not in `held`, classed by
/// what the inference policy does with it now (`assignments`, as the
/// dispatcher published them; empty without a dispatcher) and what the
/// runtime last reported.
pub fn candidates(
    runtimes: &[RuntimeView],
    assignments: &[GpuAssignment],
    held: &BTreeSet<Gpu>,
) -> Candidates {
    let assigned: BTreeMap<Gpu, &GpuAssignment> = assignments
        .iter()
        .map(|a| {
            (
                Gpu {
                    runtime: a.runtime,
                    device: a.device,
                },
                a,
            )
        })
        .collect();
    let mut out = Candidates {
        runtimes_live: runtimes.len(),
        ..Candidates::default()
    };
    for r in runtimes {
        for &device in &r.shape.device_ids {
            out.devices_live += 1;
            let gpu = Gpu {
                runtime: r.id,
                device,
            };
            if held.contains(&gpu) {
                out.held += 1;
                continue;
            }
            let reported = r
                .snapshot
                .as_ref()
                .and_then(|s| s.devices.iter().find(|d| d.device == device));
            let busy_now = reported.is_some_and(|d| d.queued > 0 || !d.resident.is_empty());
            let usage = match assigned.get(&gpu) {
                Some(a) if a.role == GpuRole::Training => DeviceUse::Training,
                Some(a) if !a.models.is_empty() => DeviceUse::Serving,
                _ if busy_now => DeviceUse::Serving,
                _ => DeviceUse::Idle,
            };
            out.list.push(Candidate {
                runtime: r.id,
                addr: r.addr.clone(),
                device,
                usage,
            });
        }
    }
    out
}

/// Chooses a device per stage worker by the rule of the module: the
/// result is pipeline-major (`pipeline * stages + stage`), every device
/// distinct.
pub fn place(
    pipelines: u32,
    stages: u32,
    candidates: &Candidates,
) -> Result<Vec<StagePlacement>, PlacementError> {
    assert!(pipelines > 0 && stages > 0, "a job has at least one stage");
    let needed = pipelines * stages;
    if candidates.list.len() < needed as usize {
        return Err(PlacementError::NotEnoughDevices {
            needed,
            pipelines,
            stages,
            free: candidates.list.len(),
            devices_live: candidates.devices_live,
            runtimes_live: candidates.runtimes_live,
            held: candidates.held,
        });
    }
    // Which classes: all of the better ones, `budget` of the worst needed.
    let mut by_class: Vec<DeviceUse> = candidates.list.iter().map(|c| c.usage).collect();
    by_class.sort_unstable();
    let worst = by_class[needed as usize - 1];
    let mut budget = needed as usize - by_class.iter().filter(|&&u| u < worst).count();
    let mut hosts: BTreeMap<u32, Vec<&Candidate>> = BTreeMap::new();
    for c in candidates.list.iter().filter(|c| c.usage <= worst) {
        hosts.entry(c.runtime).or_default().push(c);
    }
    for devices in hosts.values_mut() {
        devices.sort_by_key(|c| c.device);
    }
    let usable = |devices: &[&Candidate], budget: usize| {
        let better = devices.iter().filter(|c| c.usage < worst).count();
        better + (devices.len() - better).min(budget)
    };
    // Which stage where. Invariant: the devices still needed are exactly
    // the better-class ones left plus `budget`, so a usable host exists
    // while a stage is left.
    let mut used_by: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    let mut out = Vec::with_capacity(needed as usize);
    for p in 0..pipelines {
        let mut left = stages as usize;
        while left > 0 {
            let host = hosts
                .iter()
                .map(|(&runtime, d)| (runtime, usable(d, budget)))
                .filter(|&(_, n)| n > 0)
                .max_by_key(|&(runtime, n)| {
                    let unshared = used_by
                        .get(&runtime)
                        .is_none_or(|ps| ps.iter().all(|&q| q == p));
                    (n >= left, unshared, n, std::cmp::Reverse(runtime))
                })
                .map(|(runtime, _)| runtime)
                .expect("the devices still needed are usable somewhere");
            used_by.entry(host).or_default().insert(p);
            let devices = hosts.get_mut(&host).expect("chosen above");
            let mut i = 0;
            while left > 0 && i < devices.len() {
                let c = devices[i];
                if c.usage == worst {
                    if budget == 0 {
                        i += 1;
                        continue;
                    }
                    budget -= 1;
                }
                devices.remove(i);
                out.push(StagePlacement {
                    runtime: c.runtime,
                    addr: c.addr.clone(),
                    device: c.device,
                    usage: c.usage,
                });
                left -= 1;
            }
        }
    }
    debug_assert_eq!(out.len(), needed as usize);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtimes::RuntimeShape;
    use distmind_common::proto::{DeviceSnapshot, RuntimeSnapshot};

    fn host(id: u32, devices: u32) -> RuntimeView {
        RuntimeView {
            id,
            addr: format!("10.0.0.{id}:10009"),
            boot_id: 1,
            executor: "sim".into(),
            shape: RuntimeShape {
                device_ids: (0..devices).collect(),
                ..RuntimeShape::default()
            },
            snapshot: None,
            snapshot_seq: 0,
        }
    }

    fn assignment(runtime: u32, device: u32, role: GpuRole, models: &[&str]) -> GpuAssignment {
        GpuAssignment {
            runtime,
            device,
            role,
            models: models.iter().map(|m| m.to_string()).collect(),
        }
    }

    /// (runtime, device) per stage, pipeline-major.
    fn where_(p: &[StagePlacement]) -> Vec<(u32, u32)> {
        p.iter().map(|s| (s.runtime, s.device)).collect()
    }

    fn free(hosts: &[RuntimeView]) -> Candidates {
        candidates(hosts, &[], &BTreeSet::new())
    }

    #[test]
    fn devices_are_classed_by_the_policy_and_the_snapshot() {
        let mut h = host(0, 4);
        h.snapshot = Some(RuntimeSnapshot {
            devices: vec![
                DeviceSnapshot {
                    device: 2,
                    queued: 3,
                    ..DeviceSnapshot::default()
                },
                DeviceSnapshot {
                    device: 3,
                    resident: vec!["m".into()],
                    ..DeviceSnapshot::default()
                },
            ],
            ..RuntimeSnapshot::default()
        });
        let a = [
            assignment(0, 0, GpuRole::Training, &["job"]),
            assignment(0, 1, GpuRole::Inference, &["m"]),
        ];
        let held = BTreeSet::from([Gpu {
            runtime: 1,
            device: 0,
        }]);
        let c = candidates(&[h, host(1, 2)], &a, &held);
        let usage: Vec<_> = c
            .list
            .iter()
            .map(|c| (c.runtime, c.device, c.usage))
            .collect();
        assert_eq!(
            usage,
            vec![
                (0, 0, DeviceUse::Training),
                (0, 1, DeviceUse::Serving),
                (0, 2, DeviceUse::Serving),
                (0, 3, DeviceUse::Serving),
                (1, 1, DeviceUse::Idle),
            ]
        );
        assert_eq!((c.runtimes_live, c.devices_live, c.held), (2, 6, 1));
    }

    #[test]
    fn a_pipeline_stays_on_one_host_and_pipelines_spread() {
        // Two hosts of 8: one pipeline per host.
        let p = place(2, 4, &free(&[host(0, 8), host(1, 8)])).unwrap();
        assert_eq!(
            where_(&p),
            vec![
                (0, 0),
                (0, 1),
                (0, 2),
                (0, 3),
                (1, 0),
                (1, 1),
                (1, 2),
                (1, 3)
            ]
        );
        // One host of 8: both pipelines there, in device order.
        let p = place(2, 4, &free(&[host(0, 8)])).unwrap();
        assert_eq!(where_(&p), (0..8).map(|d| (0, d)).collect::<Vec<_>>());
        // 4 + 2 + 2: pipeline 0 fills host 0; pipeline 1 crosses hosts once.
        let p = place(2, 4, &free(&[host(0, 4), host(1, 2), host(2, 2)])).unwrap();
        assert_eq!(
            where_(&p),
            vec![
                (0, 0),
                (0, 1),
                (0, 2),
                (0, 3),
                (1, 0),
                (1, 1),
                (2, 0),
                (2, 1)
            ]
        );
        // Four hosts of 2, stages of 2: each pipeline on a host of its own.
        let hosts: Vec<_> = (0..4).map(|i| host(i, 2)).collect();
        let p = place(4, 2, &free(&hosts)).unwrap();
        for (i, s) in p.iter().enumerate() {
            assert_eq!(
                s.runtime,
                i as u32 / 2,
                "pipeline {} on its own host",
                i / 2
            );
        }
    }

    #[test]
    fn training_devices_first_then_idle_then_serving() {
        let hosts = [host(0, 2), host(1, 2)];
        let a = [
            assignment(0, 0, GpuRole::Inference, &["m"]),
            assignment(0, 1, GpuRole::Inference, &[]),
            assignment(1, 0, GpuRole::Inference, &["m"]),
            assignment(1, 1, GpuRole::Training, &[]),
        ];
        let c = candidates(&hosts, &a, &BTreeSet::new());
        let p = place(1, 2, &c).unwrap();
        let mut got = where_(&p);
        got.sort();
        assert_eq!(got, vec![(0, 1), (1, 1)], "the training and the idle GPU");
        assert_eq!(
            p.iter().map(|s| s.usage).collect::<BTreeSet<_>>(),
            BTreeSet::from([DeviceUse::Training, DeviceUse::Idle])
        );
        // Three stages: one serving GPU is the last resort.
        let p = place(1, 3, &c).unwrap();
        assert_eq!(
            p.iter().filter(|s| s.usage == DeviceUse::Serving).count(),
            1
        );
        // Every device distinct, whatever the shape.
        let p = place(2, 2, &c).unwrap();
        assert_eq!(where_(&p).into_iter().collect::<BTreeSet<_>>().len(), 4);
    }

    #[test]
    fn not_enough_devices_is_refused_with_the_counts() {
        let held = BTreeSet::from([Gpu {
            runtime: 0,
            device: 0,
        }]);
        let c = candidates(&[host(0, 2), host(1, 1)], &[], &held);
        let e = place(2, 2, &c).unwrap_err();
        assert_eq!(
            e,
            PlacementError::NotEnoughDevices {
                needed: 4,
                pipelines: 2,
                stages: 2,
                free: 2,
                devices_live: 3,
                runtimes_live: 2,
                held: 1,
            }
        );
        assert!(
            e.to_string().starts_with(
                "needs 4 GPUs (2 pipelines x 2 stages) and 2 are free (3 devices on 2 live GPU servers, \
                 1 held by other training jobs)"
            ),
            "{e}"
        );
        assert!(place(1, 1, &free(&[])).is_err());
    }
}
