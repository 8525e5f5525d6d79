//! Which samples a memory server preprocesses before it ships them, and how
//! far: SOPHON's per-sample offload planner (HotStorage'24, `main.py`'s
//! `spof_opt`). Pure: a profile and the resources in, a plan out.
//!
//! A training sample goes through [`STEPS`] (decode, RandomResizedCrop(224),
//! RandomHorizontalFlip, ToTensor, Normalize). The memory server may run
//! the first `k` of them and send what step `k` made (`k = 0`: the file
//! itself); the trainer runs the rest. Running steps remotely costs the
//! memory server's CPU and can shrink or grow the bytes on the wire (a
//! decoded image is larger than its JPEG; a 224 x 224 crop of a large
//! photo is smaller; ToTensor quadruples a crop).
//!
//! SOPHON's rule ([`Mode::Sophon`]), from a profiling epoch that recorded
//! each sample's size after every step and every step's time:
//!
//! 1. Per sample, the step `j` whose output is the smallest of those
//!    strictly below the raw size; `saved = raw - size(j)`, `cost` = the
//!    time of steps `0..=j`, `efficiency = saved / cost`. A sample with no
//!    such step saves nothing and is never offloaded.
//! 2. Samples in decreasing efficiency (ties: the smaller id first) are
//!    offloaded (`k = j + 1`) one by one while `net_time >=
//!    remote_cpu_time`, where `net_time = (total raw - sum saved) /
//!    bandwidth` and `remote_cpu_time = sum cost / remote CPUs`: it stops as
//!    soon as the network is no longer the bottleneck.
//!
//! The fixed modes are the comparisons: [`Mode::None`] ships every file,
//! [`Mode::All`] runs every step remotely, [`Mode::Split`] the first `K`.

use thiserror::Error;

/// The preprocessing steps, in order.
pub const STEPS: [&str; 5] = [
    "decode",
    "random_resized_crop",
    "random_horizontal_flip",
    "to_tensor",
    "normalize",
];

/// Most samples one plan covers (a dataset's; larger sets plan per shard).
pub const SAMPLES_MAX: usize = 1 << 22;

/// One sample's profile: its size before and after each step, and each
/// step's time on the memory server's CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleProfile {
    pub id: u64,
    /// The file's bytes.
    pub raw_bytes: u64,
    /// Bytes of step `i`'s output.
    pub bytes_after: [u64; STEPS.len()],
    /// Seconds step `i` takes on one memory-server CPU.
    pub step_s: [f64; STEPS.len()],
}

impl SampleProfile {
    /// The step SOPHON would stop after (its index), with the bytes it
    /// saves and the CPU time it costs; `None` when no step's output is
    /// smaller than the file.
    pub fn best_step(&self) -> Option<(usize, u64, f64)> {
        let (j, size) = self
            .bytes_after
            .iter()
            .enumerate()
            .filter(|&(_, &b)| b < self.raw_bytes)
            // The smallest output; of equal ones, the earliest (cheapest).
            .min_by_key(|&(i, &b)| (b, i))?;
        let cost = self.step_s[..=j].iter().sum();
        Some((j, self.raw_bytes - size, cost))
    }

    /// Bytes on the wire when the memory server runs the first `k` steps.
    pub fn bytes_at(&self, k: usize) -> u64 {
        if k == 0 {
            self.raw_bytes
        } else {
            self.bytes_after[k - 1]
        }
    }

    /// The memory server's CPU time for the first `k` steps.
    pub fn cost_at(&self, k: usize) -> f64 {
        self.step_s[..k].iter().sum()
    }
}

/// How the planner chooses each sample's `k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every file as it is (`k = 0`).
    None,
    /// Every step on the memory server (`k = 5`).
    All,
    /// The first `K` steps on the memory server for every sample.
    Split(u8),
    /// SOPHON's per-sample choice.
    Sophon,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Mode::None),
            "all" => Ok(Mode::All),
            "sophon" => Ok(Mode::Sophon),
            _ => match s.strip_prefix("split:").map(str::parse::<u8>) {
                Some(Ok(k)) if usize::from(k) <= STEPS.len() => Ok(Mode::Split(k)),
                _ => Err(format!(
                    "prep mode {s:?}: expected none, all, sophon or split:K with K in 0..={}",
                    STEPS.len()
                )),
            },
        }
    }
}

/// What the planner knows of the hardware.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resources {
    /// The link from the memory server to the trainer, bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// The memory server's CPUs for preprocessing (its `--prep-workers`).
    pub remote_cpus: u32,
}

/// Each sample's `k`, and what the plan predicts.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Steps the memory server runs, per sample, in the profile's order.
    pub steps: Vec<u8>,
    /// Bytes on the wire for one epoch.
    pub bytes: u64,
    /// `bytes / bandwidth`.
    pub net_s: f64,
    /// The memory server's CPU time over its CPUs.
    pub remote_cpu_s: f64,
}

impl Plan {
    /// Samples the memory server preprocesses at all.
    pub fn offloaded(&self) -> usize {
        self.steps.iter().filter(|&&k| k > 0).count()
    }
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum PrepError {
    #[error("the profile has {0} samples, more than a plan's {SAMPLES_MAX}")]
    TooManySamples(usize),
    #[error("bandwidth {0} B/s: must be finite and positive")]
    Bandwidth(f64),
    #[error("remote CPUs 0: the memory server needs at least one to preprocess")]
    NoCpus,
    #[error("split:{0}: there are {n} steps", n = STEPS.len())]
    Split(u8),
    #[error("sample {id}: {what}")]
    Sample { id: u64, what: String },
}

fn check(profile: &[SampleProfile], res: &Resources) -> Result<(), PrepError> {
    if profile.len() > SAMPLES_MAX {
        return Err(PrepError::TooManySamples(profile.len()));
    }
    if !(res.bandwidth_bytes_per_s.is_finite() && res.bandwidth_bytes_per_s > 0.0) {
        return Err(PrepError::Bandwidth(res.bandwidth_bytes_per_s));
    }
    if res.remote_cpus == 0 {
        return Err(PrepError::NoCpus);
    }
    for s in profile {
        if let Some((i, t)) = s
            .step_s
            .iter()
            .enumerate()
            .find(|(_, t)| !(t.is_finite() && **t >= 0.0))
        {
            return Err(PrepError::Sample {
                id: s.id,
                what: format!("{} took {t} s: a time must be finite and >= 0", STEPS[i]),
            });
        }
    }
    Ok(())
}

/// The plan of `mode` for `profile` under `res`.
pub fn plan(profile: &[SampleProfile], mode: Mode, res: &Resources) -> Result<Plan, PrepError> {
    check(profile, res)?;
    let steps: Vec<u8> = match mode {
        Mode::None => vec![0; profile.len()],
        Mode::All => vec![STEPS.len() as u8; profile.len()],
        Mode::Split(k) if usize::from(k) <= STEPS.len() => vec![k; profile.len()],
        Mode::Split(k) => return Err(PrepError::Split(k)),
        Mode::Sophon => sophon(profile, res),
    };
    let bytes = profile
        .iter()
        .zip(&steps)
        .map(|(s, &k)| s.bytes_at(usize::from(k)))
        .sum::<u64>();
    let cpu: f64 = profile
        .iter()
        .zip(&steps)
        .map(|(s, &k)| s.cost_at(usize::from(k)))
        .sum();
    Ok(Plan {
        steps,
        bytes,
        net_s: bytes as f64 / res.bandwidth_bytes_per_s,
        remote_cpu_s: cpu / f64::from(res.remote_cpus),
    })
}

/// SOPHON's greedy choice (the module's rule).
fn sophon(profile: &[SampleProfile], res: &Resources) -> Vec<u8> {
    let mut candidates: Vec<(usize, usize, u64, f64)> = profile
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.best_step().map(|(j, saved, cost)| (i, j, saved, cost)))
        .collect();
    let efficiency = |saved: u64, cost: f64| {
        if cost > 0.0 {
            saved as f64 / cost
        } else {
            f64::INFINITY
        }
    };
    candidates.sort_by(|a, b| {
        efficiency(b.2, b.3)
            .total_cmp(&efficiency(a.2, a.3))
            .then(profile[a.0].id.cmp(&profile[b.0].id))
    });
    let mut steps = vec![0u8; profile.len()];
    let mut wire = profile.iter().map(|s| s.raw_bytes as f64).sum::<f64>();
    let mut cpu = 0.0;
    let cpus = f64::from(res.remote_cpus);
    for (i, j, saved, cost) in candidates {
        if wire / res.bandwidth_bytes_per_s < cpu / cpus {
            break;
        }
        steps[i] = (j + 1) as u8;
        wire -= saved as f64;
        cpu += cost;
    }
    steps
}

#[cfg(test)]
#[path = "prep_tests.rs"]
mod tests;
