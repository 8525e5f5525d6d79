//! The original DistMind placement policy.
//!
//! * GPUs are ordered interleaved across hosts (device 0 of every host,
//!   then device 1, ...), so consecutive reassignments land on different
//!   hosts.
//! * Every `period` one inference GPU, round robin in that order, is
//!   reassigned to a model drawn from Zipf(`zipf_s`) over the ranked model
//!   list (rank 0 = the first model by name, the same ranking clients draw
//!   popularity from).
//! * With training on, `inference_workload_s[second % len]` GPUs (the first
//!   ones in the interleaved order) do inference during that second and the
//!   rest train; without it every GPU does inference.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::zipf::{Zipf, ZipfError};
use super::{Gpu, Micros};
use distmind_common::proto::GpuRole;

#[derive(Debug, Clone, PartialEq)]
pub struct DistMindConfig {
    pub period: Micros,
    pub zipf_s: f64,
    pub inference_workload_s: Vec<u32>,
    pub use_train: bool,
    pub seed: u64,
}

impl DistMindConfig {
    /// Inference only, every GPU every second: a one-second period, Zipf
    /// 0.9 (the paper's skew), no training. What a dispatcher needs when the
    /// placement policy is not what is being looked at (benches, tests).
    pub fn inference_only(seed: u64) -> Self {
        DistMindConfig {
            period: 1_000_000,
            zipf_s: 0.9,
            inference_workload_s: vec![1],
            use_train: false,
            seed,
        }
    }
}

/// One GPU's assignment: its role and, for inference, its model's rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assigned {
    pub role: GpuRole,
    pub model: Option<usize>,
}

#[derive(Debug)]
pub struct DistMindPolicy {
    cfg: DistMindConfig,
    /// Interleaved across hosts.
    gpus: Vec<Gpu>,
    assigned: Vec<Assigned>,
    zipf: Option<Zipf>,
    rng: StdRng,
    cursor: usize,
    next_at: Micros,
    /// Reassignments made per model rank (for tests and the AE).
    draws: Vec<u64>,
    /// The length of one step of `inference_workload_s`: a second, or K
    /// seconds on a clock dilated by K (emulated links).
    second_us: Micros,
}

impl DistMindPolicy {
    pub fn new(cfg: DistMindConfig) -> Result<Self, String> {
        if cfg.period == 0 {
            return Err("rescheduling_period_s must be positive".into());
        }
        if cfg.use_train && cfg.inference_workload_s.is_empty() {
            return Err("inference_workload_s must not be empty when use_train is on".into());
        }
        Zipf::new(1, cfg.zipf_s).map_err(|e| e.to_string())?;
        Ok(DistMindPolicy {
            rng: StdRng::seed_from_u64(cfg.seed),
            cfg,
            gpus: Vec::new(),
            assigned: Vec::new(),
            zipf: None,
            cursor: 0,
            next_at: 0,
            draws: Vec::new(),
            second_us: 1_000_000,
        })
    }

    /// Runs the inference/training schedule on a clock dilated by `k`
    /// (emulated links): each step of `inference_workload_s` lasts `k`
    /// seconds. The period is the caller's to dilate.
    pub fn set_time_dilation(&mut self, k: f64) {
        self.second_us = ((1e6 * k).round() as Micros).max(1);
    }

    /// Sets the model count (ranks `0..n`); assignments beyond it are dropped.
    pub fn set_models(&mut self, n: usize) -> Result<(), ZipfError> {
        if self.zipf.as_ref().map(|z| z.len()) == Some(n) {
            return Ok(());
        }
        self.zipf = if n == 0 {
            None
        } else {
            Some(Zipf::new(n, self.cfg.zipf_s)?)
        };
        self.draws.resize(n, 0);
        for a in &mut self.assigned {
            if a.model.is_some_and(|m| m >= n) {
                a.model = None;
            }
        }
        Ok(())
    }

    /// Sets the GPUs; known ones keep their assignment.
    pub fn set_gpus(&mut self, gpus: &[Gpu]) {
        let mut by_host: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for g in gpus {
            by_host.entry(g.runtime).or_default().push(g.device);
        }
        for d in by_host.values_mut() {
            d.sort_unstable();
            d.dedup();
        }
        let mut order = Vec::with_capacity(gpus.len());
        let most = by_host.values().map(Vec::len).max().unwrap_or(0);
        for i in 0..most {
            for (&runtime, devices) in &by_host {
                if let Some(&device) = devices.get(i) {
                    order.push(Gpu { runtime, device });
                }
            }
        }
        if order == self.gpus {
            return;
        }
        let old: BTreeMap<Gpu, Assigned> = self
            .gpus
            .iter()
            .copied()
            .zip(self.assigned.iter().copied())
            .collect();
        self.assigned = order
            .iter()
            .map(|g| {
                old.get(g).copied().unwrap_or(Assigned {
                    role: GpuRole::Inference,
                    model: None,
                })
            })
            .collect();
        self.gpus = order;
        self.cursor = 0;
    }

    /// How many GPUs do inference at `now`.
    pub fn inference_gpus(&self, now: Micros) -> usize {
        let n = self.gpus.len();
        if !self.cfg.use_train {
            return n;
        }
        let w = &self.cfg.inference_workload_s;
        let second = (now / self.second_us) as usize;
        (w[second % w.len()] as usize).min(n)
    }

    /// Advances to `now`: applies the inference/training split of this
    /// second and, when a period has passed, reassigns one GPU (all of them
    /// on the first call). Returns true when an assignment changed.
    pub fn tick(&mut self, now: Micros) -> bool {
        let mut changed = false;
        let k = self.inference_gpus(now);
        for (i, a) in self.assigned.iter_mut().enumerate() {
            let role = if i < k {
                GpuRole::Inference
            } else {
                GpuRole::Training
            };
            if a.role != role {
                a.role = role;
                changed = true;
            }
        }
        let Some(zipf) = &self.zipf else {
            return changed;
        };
        // GPUs without a model get one at once.
        for i in 0..k {
            if self.assigned[i].model.is_none() {
                let m = zipf.sample(&mut self.rng);
                self.assigned[i].model = Some(m);
                self.draws[m] += 1;
                changed = true;
            }
        }
        if now < self.next_at || k == 0 {
            return changed;
        }
        self.next_at = now + self.cfg.period;
        let i = self.cursor % k;
        self.cursor = (i + 1) % k;
        let m = zipf.sample(&mut self.rng);
        self.draws[m] += 1;
        if self.assigned[i].model != Some(m) {
            self.assigned[i].model = Some(m);
            changed = true;
        }
        changed
    }

    /// Every GPU in the interleaved order with its assignment.
    pub fn assignments(&self) -> impl Iterator<Item = (Gpu, Assigned)> + '_ {
        self.gpus.iter().copied().zip(self.assigned.iter().copied())
    }

    pub fn assignment(&self, gpu: Gpu) -> Option<Assigned> {
        self.gpus
            .iter()
            .position(|&g| g == gpu)
            .map(|i| self.assigned[i])
    }

    /// Reassignments drawn per model rank so far.
    pub fn draws(&self) -> &[u64] {
        &self.draws
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Micros = 1_000_000;

    fn gpus(hosts: u32, per_host: u32) -> Vec<Gpu> {
        let mut v = Vec::new();
        for runtime in 0..hosts {
            for device in 0..per_host {
                v.push(Gpu { runtime, device });
            }
        }
        v
    }

    fn policy(use_train: bool, workload: Vec<u32>) -> DistMindPolicy {
        DistMindPolicy::new(DistMindConfig {
            period: S,
            zipf_s: 0.9,
            inference_workload_s: workload,
            use_train,
            seed: 3,
        })
        .unwrap()
    }

    #[test]
    fn gpus_are_interleaved_across_hosts_and_reassigned_round_robin() {
        let mut p = policy(false, vec![1]);
        p.set_gpus(&gpus(2, 2));
        p.set_models(10).unwrap();
        let order: Vec<Gpu> = p.assignments().map(|(g, _)| g).collect();
        assert_eq!(
            order,
            [(0, 0), (1, 0), (0, 1), (1, 1)].map(|(runtime, device)| Gpu { runtime, device })
        );
        assert!(p.tick(0));
        assert!(p.assignments().all(|(_, a)| a.model.is_some()));
        // One GPU per period, in order: count the draws.
        let before: u64 = p.draws().iter().sum();
        for t in 1..=8 {
            p.tick(t * S);
            // Half a period later nothing is reassigned.
            assert!(!p.tick(t * S + S / 2));
        }
        assert_eq!(p.draws().iter().sum::<u64>(), before + 8);
    }

    #[test]
    fn zipf_placement_frequencies() {
        let mut p = policy(false, vec![1]);
        p.set_gpus(&gpus(2, 1));
        p.set_models(8).unwrap();
        let n = 40_000;
        for t in 0..n {
            p.tick(t * S);
        }
        let total: u64 = p.draws().iter().sum();
        let z = Zipf::new(8, 0.9).unwrap();
        for (k, &c) in p.draws().iter().enumerate() {
            let expected = z.probability(k) * total as f64;
            let sd = (expected * (1.0 - z.probability(k))).sqrt();
            assert!(
                (c as f64 - expected).abs() < 5.0 * sd,
                "model rank {k}: {c} reassignments, expected {expected:.0}"
            );
        }
    }

    #[test]
    fn a_dilated_clock_stretches_each_step_of_the_workload() {
        let workload = vec![4, 1];
        let mut p = policy(true, workload);
        p.set_gpus(&gpus(2, 2));
        p.set_models(5).unwrap();
        p.set_time_dilation(2.5);
        // Step 0 lasts 2.5 s of the real clock, then step 1 as long.
        for (now, want) in [
            (0, 4),
            (2 * S, 4),
            (5 * S / 2 - 1, 4),
            (5 * S / 2, 1),
            (4 * S, 1),
            (5 * S, 4),
        ] {
            assert_eq!(p.inference_gpus(now), want, "at {now} us");
        }
    }

    #[test]
    fn inference_training_split_follows_the_workload_each_second() {
        let workload = vec![4, 1, 0, 2];
        let mut p = policy(true, workload.clone());
        p.set_gpus(&gpus(2, 2));
        p.set_models(5).unwrap();
        for t in 0..12u64 {
            for sub in [0, S / 3, 2 * S / 3] {
                let now = t * S + sub;
                p.tick(now);
                let k = workload[t as usize % workload.len()] as usize;
                let roles: Vec<GpuRole> = p.assignments().map(|(_, a)| a.role).collect();
                assert_eq!(
                    roles.iter().filter(|r| **r == GpuRole::Inference).count(),
                    k,
                    "second {t}"
                );
                // The inference GPUs are the first ones in interleaved order.
                assert!(roles[..k].iter().all(|r| *r == GpuRole::Inference));
            }
        }
        // Without training every GPU serves inference, whatever the list says.
        let mut p = policy(false, vec![0]);
        p.set_gpus(&gpus(1, 3));
        p.set_models(2).unwrap();
        p.tick(0);
        assert!(p.assignments().all(|(_, a)| a.role == GpuRole::Inference));
    }

    #[test]
    fn bad_configs_are_refused() {
        let mut c = DistMindConfig {
            period: 0,
            zipf_s: 0.9,
            inference_workload_s: vec![1],
            use_train: false,
            seed: 0,
        };
        assert!(DistMindPolicy::new(c.clone()).is_err());
        c.period = 1;
        c.zipf_s = -1.0;
        assert!(DistMindPolicy::new(c.clone()).is_err());
        c.zipf_s = 1.0;
        c.use_train = true;
        c.inference_workload_s.clear();
        assert!(DistMindPolicy::new(c).is_err());
    }
}
