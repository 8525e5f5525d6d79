//! The interference a stage worker injects into itself (the spec's
//! `interference`, SD-Pipe's and DynPipe's experiment knobs):
//!
//! * `hetero_s` / `hetero_p` (SD-Pipe's `--hetero`): at the start of each
//!   iteration, with probability `hetero_p`, the worker sleeps `hetero_s`
//!   seconds (a straggler). The draw is a hash of (data seed, pipeline,
//!   stage, iteration), so a rerun straggles at the same iterations and
//!   workers straggle independently. The sleep is not compute: it delays
//!   the iteration but is not in the reported `fwd_bwd_s`.
//! * `slowdowns` (DynPipe's slowed GPU): from `at_iteration` on, each
//!   forward and backward op of the named stage (in the named pipeline, or
//!   every pipeline) takes `factor` times its compute: the worker sleeps
//!   `(factor - 1)` times the op's measured compute after it, with the
//!   device released (inference is not held up by an emulated slowdown).
//!   The slept time counts in `fwd_bwd_s`, as a slower GPU's would. Of
//!   several events for one stage, the one with the latest `at_iteration`
//!   that has come applies (ties: the last listed), so a later event with
//!   factor 1 ends a slowdown.

use std::time::Duration;

use distmind_common::train_spec::Interference;

use super::data::mix;

/// One stage worker's share of the spec's interference.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Injected {
    hetero_s: f64,
    hetero_p: f64,
    /// Hash key of this worker's straggler draws.
    key: u64,
    /// (at_iteration, factor) of the events naming this worker, in spec order.
    slowdowns: Vec<(u64, f64)>,
}

impl Injected {
    pub fn for_worker(spec: &Interference, data_seed: u64, pipeline: u32, stage: u32) -> Self {
        Injected {
            hetero_s: spec.hetero_s,
            hetero_p: spec.hetero_p,
            key: mix(
                mix(mix(data_seed, 0x6865_7465_726f), pipeline.into()),
                stage.into(),
            ),
            slowdowns: spec
                .slowdowns
                .iter()
                .filter(|s| s.stage == stage && s.pipeline.is_none_or(|p| p == pipeline))
                .map(|s| (s.at_iteration, s.factor))
                .collect(),
        }
    }

    /// The straggler sleep at the start of `iteration`, if it draws one.
    pub fn hetero_sleep(&self, iteration: u64) -> Option<Duration> {
        if self.hetero_s <= 0.0 || self.hetero_p <= 0.0 {
            return None;
        }
        let u = (mix(self.key, iteration) >> 11) as f64 / (1u64 << 53) as f64;
        (u < self.hetero_p).then(|| Duration::from_secs_f64(self.hetero_s))
    }

    /// The slowdown factor of the ops of `iteration` (1: none).
    pub fn factor(&self, iteration: u64) -> f64 {
        let mut best: Option<(u64, f64)> = None;
        for &(at, factor) in &self.slowdowns {
            if at <= iteration && best.is_none_or(|(b, _)| at >= b) {
                best = Some((at, factor));
            }
        }
        best.map_or(1.0, |(_, f)| f)
    }

    /// The sleep after an op of `iteration` that computed for `compute`.
    pub fn extra(&self, iteration: u64, compute: Duration) -> Duration {
        let f = self.factor(iteration);
        if f > 1.0 {
            compute.mul_f64(f - 1.0)
        } else {
            Duration::ZERO
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::train_spec::Slowdown;

    fn spec(hetero_s: f64, hetero_p: f64, slowdowns: Vec<Slowdown>) -> Interference {
        Interference {
            hetero_s,
            hetero_p,
            slowdowns,
        }
    }

    fn slow(pipeline: Option<u32>, stage: u32, factor: f64, at_iteration: u64) -> Slowdown {
        Slowdown {
            pipeline,
            stage,
            factor,
            at_iteration,
        }
    }

    #[test]
    fn stragglers_are_seeded_per_worker_at_about_the_rate() {
        let s = spec(0.25, 0.1, vec![]);
        let a = Injected::for_worker(&s, 7, 0, 1);
        let draws: Vec<bool> = (0..4000).map(|i| a.hetero_sleep(i).is_some()).collect();
        let again: Vec<bool> = (0..4000)
            .map(|i| Injected::for_worker(&s, 7, 0, 1).hetero_sleep(i).is_some())
            .collect();
        assert_eq!(draws, again, "the same worker draws the same iterations");
        let rate = draws.iter().filter(|d| **d).count() as f64 / draws.len() as f64;
        assert!((0.08..0.12).contains(&rate), "rate {rate}");
        let other: Vec<bool> = (0..4000)
            .map(|i| Injected::for_worker(&s, 7, 1, 1).hetero_sleep(i).is_some())
            .collect();
        assert_ne!(draws, other, "workers straggle independently");
        assert!((0..100)
            .filter_map(|i| a.hetero_sleep(i))
            .all(|d| d == Duration::from_secs_f64(0.25)));
        assert!(Injected::for_worker(&spec(0.0, 0.5, vec![]), 7, 0, 1)
            .hetero_sleep(0)
            .is_none());
        let always = Injected::for_worker(&spec(0.5, 1.0, vec![]), 1, 0, 0);
        assert!((0..100).all(|i| always.hetero_sleep(i) == Some(Duration::from_millis(500))));
    }

    #[test]
    fn slowdowns_apply_to_the_named_stage_from_their_iteration() {
        let s = spec(
            0.0,
            0.1,
            vec![
                slow(None, 2, 3.0, 100),
                slow(Some(1), 2, 5.0, 150),
                slow(None, 2, 1.0, 200),
                slow(None, 0, 2.0, 0),
            ],
        );
        let p0 = Injected::for_worker(&s, 0, 0, 2);
        let p1 = Injected::for_worker(&s, 0, 1, 2);
        assert_eq!(p0.factor(99), 1.0);
        assert_eq!(p0.factor(100), 3.0);
        assert_eq!(
            p0.factor(160),
            3.0,
            "pipeline 1's event is not pipeline 0's"
        );
        assert_eq!(p1.factor(160), 5.0);
        assert_eq!(p1.factor(200), 1.0, "a later factor 1 ends it");
        let ms = Duration::from_millis(10);
        assert_eq!(p0.extra(120, ms), Duration::from_millis(20));
        assert_eq!(p0.extra(50, ms), Duration::ZERO);
        assert_eq!(Injected::for_worker(&s, 0, 3, 0).factor(0), 2.0);
        assert_eq!(Injected::for_worker(&s, 0, 0, 1).factor(1000), 1.0);
    }
}
