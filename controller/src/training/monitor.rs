//! DynPipe's straggler monitor (the `--use_dynamic` block of the training
//! loop in `runtime/image_classification/main_with_runtime.py`), as a state
//! machine fed one iteration's per-stage times at a time.
//!
//! * Every `window` (50) iterations, each stage's forward + backward time
//!   summed over the window is recorded (DynPipe: every stage sends the
//!   last stage its `pre_real + pre_back`, `Send_Status`).
//! * When `baseline_at` (100) iterations have run, that window's vector is
//!   frozen as the baseline (`initial_status_cmp`).
//! * At every later window boundary, each stage's ratio to its baseline is
//!   taken; if any is `>= slow_ratio` (2.0) or `<= fast_ratio` (0.5), a
//!   re-partition is scheduled `delay` (60) iterations later
//!   (`i_for_initial = i + 60`), returned as a value. No second one is
//!   scheduled while one is pending.
//! * Once the caller has applied it, [`StragglerMonitor::reset_baseline`]
//!   starts over: windows count from there and a new baseline is frozen
//!   `baseline_at` iterations later (DynPipe restarts its training loop).
//!
//! **Assumption:** a stage's reported time is its own compute for the
//! iteration (forward + backward, as DynPipe's `pre_real + pre_back`), not
//! the time it waited for its neighbours; with waits in it, a slow stage's
//! neighbours would look slow too.
//!
//! Iterations count from 0; a boundary is "`n` iterations have run", so the
//! first window is iterations 0..50 and the baseline is iterations 50..100.
//! A stage whose baseline is 0 has ratio 1 while it stays 0, infinite once
//! it takes time. Pure: no IO, no clock.

use super::partition::{MeasuredRatio, PartitionError};
use super::sim1f1b::STAGES_MAX;

/// Iterations per monitoring window (DynPipe: `i % 50 == 0`).
pub const WINDOW_ITERATIONS_DEFAULT: u64 = 50;
/// Iterations after which the window is frozen as the baseline.
pub const BASELINE_AT_DEFAULT: u64 = 100;
/// Iterations between deciding a re-partition and applying it.
pub const DELAY_ITERATIONS_DEFAULT: u64 = 60;
/// A stage this many times slower than its baseline is a straggler.
pub const SLOW_RATIO_DEFAULT: f64 = 2.0;
/// A stage this fraction of its baseline (it sped up) triggers too.
pub const FAST_RATIO_DEFAULT: f64 = 0.5;

const _: () = assert!(BASELINE_AT_DEFAULT.is_multiple_of(WINDOW_ITERATIONS_DEFAULT));
const _: () = assert!(BASELINE_AT_DEFAULT >= WINDOW_ITERATIONS_DEFAULT);

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MonitorConfig {
    pub window: u64,
    /// A positive multiple of `window`.
    pub baseline_at: u64,
    pub delay: u64,
    /// Above 1.
    pub slow_ratio: f64,
    /// In (0, 1).
    pub fast_ratio: f64,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        MonitorConfig {
            window: WINDOW_ITERATIONS_DEFAULT,
            baseline_at: BASELINE_AT_DEFAULT,
            delay: DELAY_ITERATIONS_DEFAULT,
            slow_ratio: SLOW_RATIO_DEFAULT,
            fast_ratio: FAST_RATIO_DEFAULT,
        }
    }
}

/// A re-partition the monitor scheduled.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledRepartition {
    /// Iterations run when it was decided (a window boundary).
    pub decided_at: u64,
    /// The iteration before which to re-partition: `decided_at + delay`.
    pub at_iteration: u64,
    /// Each stage's window time over its baseline.
    pub ratios: Vec<f64>,
    /// The stages past a threshold, in order.
    pub stragglers: Vec<usize>,
}

impl ScheduledRepartition {
    /// The ratios as the re-partitioner's default predictor.
    pub fn predictor(&self) -> Result<MeasuredRatio, PartitionError> {
        MeasuredRatio::new(self.ratios.clone())
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MonitorError {
    #[error("monitor config {field} is {value}: {why}")]
    Config {
        field: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("a monitor needs 1 to {max} stages (STAGES_MAX), not {stages}")]
    Stages { stages: usize, max: usize },
    #[error("iteration {iteration} reported {got} stage times, expected {expected}")]
    StageCount {
        iteration: u64,
        got: usize,
        expected: usize,
    },
    #[error("iteration {iteration}: the time of stage {stage} is {value}: times must be finite and non-negative")]
    BadTime {
        iteration: u64,
        stage: usize,
        value: f64,
    },
}

/// DynPipe's straggler detection for one pipeline.
#[derive(Debug, Clone)]
pub struct StragglerMonitor {
    cfg: MonitorConfig,
    /// Iterations observed since the start.
    iterations: u64,
    /// Iterations observed when the windows (re)started.
    epoch_start: u64,
    window_sum: Vec<f64>,
    last_window: Option<Vec<f64>>,
    baseline: Option<Vec<f64>>,
    pending: Option<ScheduledRepartition>,
}

impl StragglerMonitor {
    pub fn new(stages: usize, cfg: MonitorConfig) -> Result<Self, MonitorError> {
        if stages == 0 || stages > STAGES_MAX {
            return Err(MonitorError::Stages {
                stages,
                max: STAGES_MAX,
            });
        }
        let bad = |field, value: String, why| Err(MonitorError::Config { field, value, why });
        if cfg.window == 0 {
            return bad(
                "window",
                "0".into(),
                "a window holds at least one iteration",
            );
        }
        if cfg.baseline_at == 0 || !cfg.baseline_at.is_multiple_of(cfg.window) {
            return bad(
                "baseline_at",
                cfg.baseline_at.to_string(),
                "it must be a positive multiple of window, so a window ends there",
            );
        }
        if !(cfg.slow_ratio.is_finite() && cfg.slow_ratio > 1.0) {
            return bad(
                "slow_ratio",
                cfg.slow_ratio.to_string(),
                "it must be finite and above 1",
            );
        }
        if !(cfg.fast_ratio > 0.0 && cfg.fast_ratio < 1.0) {
            return bad(
                "fast_ratio",
                cfg.fast_ratio.to_string(),
                "it must be between 0 and 1",
            );
        }
        Ok(StragglerMonitor {
            cfg,
            iterations: 0,
            epoch_start: 0,
            window_sum: vec![0.0; stages],
            last_window: None,
            baseline: None,
            pending: None,
        })
    }

    pub fn config(&self) -> &MonitorConfig {
        &self.cfg
    }

    pub fn stages(&self) -> usize {
        self.window_sum.len()
    }

    /// Iterations observed so far (the next one's number).
    pub fn iterations(&self) -> u64 {
        self.iterations
    }

    /// The frozen baseline (per stage, seconds per window), once frozen.
    pub fn baseline(&self) -> Option<&[f64]> {
        self.baseline.as_deref()
    }

    /// The last complete window's per-stage times.
    pub fn last_window(&self) -> Option<&[f64]> {
        self.last_window.as_deref()
    }

    /// The re-partition scheduled and not yet applied.
    pub fn pending(&self) -> Option<&ScheduledRepartition> {
        self.pending.as_ref()
    }

    /// One iteration's forward + backward time per stage, seconds. Returns
    /// the re-partition it schedules, if any (at most one until
    /// [`reset_baseline`](Self::reset_baseline)).
    pub fn observe(
        &mut self,
        stage_times_s: &[f64],
    ) -> Result<Option<ScheduledRepartition>, MonitorError> {
        let iteration = self.iterations;
        if stage_times_s.len() != self.stages() {
            return Err(MonitorError::StageCount {
                iteration,
                got: stage_times_s.len(),
                expected: self.stages(),
            });
        }
        if let Some(stage) = stage_times_s
            .iter()
            .position(|t| !(t.is_finite() && *t >= 0.0))
        {
            return Err(MonitorError::BadTime {
                iteration,
                stage,
                value: stage_times_s[stage],
            });
        }
        for (sum, t) in self.window_sum.iter_mut().zip(stage_times_s) {
            *sum += t;
        }
        self.iterations += 1;
        let run = self.iterations - self.epoch_start;
        if !run.is_multiple_of(self.cfg.window) {
            return Ok(None);
        }
        let stages = self.stages();
        let window = std::mem::replace(&mut self.window_sum, vec![0.0; stages]);
        self.last_window = Some(window.clone());
        if run == self.cfg.baseline_at {
            self.baseline = Some(window);
            return Ok(None);
        }
        let (Some(baseline), None) = (&self.baseline, &self.pending) else {
            return Ok(None);
        };
        let ratios: Vec<f64> = window
            .iter()
            .zip(baseline)
            .map(|(&now, &base)| match (now, base) {
                (n, b) if b > 0.0 => n / b,
                (n, _) if n > 0.0 => f64::INFINITY,
                _ => 1.0,
            })
            .collect();
        let stragglers: Vec<usize> = ratios
            .iter()
            .enumerate()
            .filter(|(_, &r)| r >= self.cfg.slow_ratio || r <= self.cfg.fast_ratio)
            .map(|(s, _)| s)
            .collect();
        if stragglers.is_empty() {
            return Ok(None);
        }
        let scheduled = ScheduledRepartition {
            decided_at: self.iterations,
            at_iteration: self.iterations + self.cfg.delay,
            ratios,
            stragglers,
        };
        self.pending = Some(scheduled.clone());
        Ok(Some(scheduled))
    }

    /// After a re-partition was applied (or to start over): drop the
    /// baseline, the pending re-partition and the open window; windows
    /// count from here and the next baseline is frozen `baseline_at`
    /// iterations later.
    pub fn reset_baseline(&mut self) {
        self.epoch_start = self.iterations;
        self.window_sum.iter_mut().for_each(|s| *s = 0.0);
        self.last_window = None;
        self.baseline = None;
        self.pending = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Feeds `iterations` iterations of `times(i)`, returning every
    /// re-partition scheduled with the iteration count it came at.
    fn feed(
        m: &mut StragglerMonitor,
        iterations: u64,
        mut times: impl FnMut(u64) -> Vec<f64>,
    ) -> Vec<(u64, ScheduledRepartition)> {
        let mut out = Vec::new();
        for _ in 0..iterations {
            let i = m.iterations();
            if let Some(r) = m.observe(&times(i)).unwrap() {
                out.push((m.iterations(), r));
            }
        }
        out
    }

    fn monitor(stages: usize) -> StragglerMonitor {
        StragglerMonitor::new(stages, MonitorConfig::default()).unwrap()
    }

    #[test]
    fn steady_times_never_trigger() {
        let mut m = monitor(4);
        assert!(feed(&mut m, 2_000, |_| vec![0.1, 0.2, 0.15, 0.1]).is_empty());
        assert_eq!(m.baseline().unwrap().len(), 4);
        // Noise of +-30% per iteration averages out over a window.
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut m = monitor(4);
        let noisy = feed(&mut m, 2_000, |_| {
            (0..4).map(|_| 0.1 * rng.gen_range(0.7..1.3)).collect()
        });
        assert!(noisy.is_empty(), "{noisy:?}");
    }

    #[test]
    fn a_slowdown_triggers_one_repartition_a_delay_after_the_next_boundary() {
        let mut m = monitor(4);
        let got = feed(&mut m, 1_000, |i| {
            let slow = if i >= 120 { 3.0 } else { 1.0 };
            vec![0.1, 0.1 * slow, 0.1, 0.1]
        });
        assert_eq!(got.len(), 1, "{got:?}");
        let (at, r) = &got[0];
        // The window of iterations 100..150: 20 normal, 30 at 3x.
        assert_eq!(*at, 150);
        assert_eq!(r.decided_at, 150);
        assert_eq!(r.at_iteration, 210);
        assert_eq!(r.stragglers, [1]);
        assert!((r.ratios[1] - 2.2).abs() < 1e-9, "{r:?}");
        assert!((r.ratios[0] - 1.0).abs() < 1e-9);
        assert_eq!(m.pending(), Some(r));
        let p = r.predictor().unwrap();
        assert!((p.ratios()[1] - 2.2).abs() < 1e-9);
    }

    #[test]
    fn a_speedup_triggers_too() {
        let mut m = monitor(3);
        let got = feed(&mut m, 400, |i| {
            let f = if i >= 100 { 0.4 } else { 1.0 };
            vec![0.2 * f, 0.2, 0.2]
        });
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].1.decided_at, 150);
        assert_eq!(got[0].1.at_iteration, 210);
        assert_eq!(got[0].1.stragglers, [0]);
        assert!((got[0].1.ratios[0] - 0.4).abs() < 1e-9);
        // Just inside both thresholds: nothing.
        let mut m = monitor(2);
        let got = feed(&mut m, 400, |i| {
            if i >= 100 {
                vec![0.51, 1.99]
            } else {
                vec![1.0, 1.0]
            }
        });
        assert!(got.is_empty(), "{got:?}");
    }

    #[test]
    fn nothing_triggers_before_the_baseline_is_frozen() {
        let mut m = monitor(2);
        // Wild swings during the first 100 iterations.
        let got = feed(&mut m, 99, |i| {
            vec![if i % 2 == 0 { 10.0 } else { 0.01 }, 1.0]
        });
        assert!(got.is_empty());
        assert!(m.baseline().is_none());
        assert!(m.last_window().is_some(), "the first window closed at 50");
        m.observe(&[1.0, 1.0]).unwrap();
        assert_eq!(m.iterations(), 100);
        assert!(m.baseline().is_some());
    }

    #[test]
    fn after_a_reset_a_new_baseline_is_frozen_and_can_trigger_again() {
        let mut m = monitor(2);
        let got = feed(&mut m, 210, |i| vec![if i >= 100 { 3.0 } else { 1.0 }, 1.0]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1.at_iteration, 210);
        assert_eq!(m.iterations(), 210);
        // Re-partitioned: the slow stage now runs at 1.0 again.
        m.reset_baseline();
        assert!(m.pending().is_none() && m.baseline().is_none());
        // The new baseline is frozen 100 iterations later (310); a new
        // slowdown at 330 is seen at the boundary 360 (30 of 50 at 4x:
        // ratio 2.8).
        let got = feed(&mut m, 300, |i| vec![1.0, if i >= 330 { 4.0 } else { 1.0 }]);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].1.decided_at, 360);
        assert_eq!(got[0].1.at_iteration, 420);
        assert_eq!(got[0].1.stragglers, [1]);
    }

    #[test]
    fn a_stage_with_a_zero_baseline() {
        let mut m = monitor(2);
        let got = feed(&mut m, 200, |i| vec![1.0, if i >= 150 { 0.5 } else { 0.0 }]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1.ratios[1], f64::INFINITY);
        assert!(
            got[0].1.predictor().is_err(),
            "an infinite ratio is no predictor"
        );
    }

    #[test]
    fn bad_input_is_refused_naming_the_field() {
        let cfg = MonitorConfig::default();
        assert!(matches!(
            StragglerMonitor::new(0, cfg),
            Err(MonitorError::Stages { stages: 0, .. })
        ));
        for (c, field) in [
            (MonitorConfig { window: 0, ..cfg }, "window"),
            (
                MonitorConfig {
                    baseline_at: 120,
                    ..cfg
                },
                "baseline_at",
            ),
            (
                MonitorConfig {
                    slow_ratio: 1.0,
                    ..cfg
                },
                "slow_ratio",
            ),
            (
                MonitorConfig {
                    fast_ratio: 1.5,
                    ..cfg
                },
                "fast_ratio",
            ),
        ] {
            let e = StragglerMonitor::new(2, c).unwrap_err();
            assert!(
                matches!(e, MonitorError::Config { field: f, .. } if f == field),
                "{e}"
            );
        }
        let mut m = monitor(2);
        m.observe(&[1.0, 1.0]).unwrap();
        assert_eq!(
            m.observe(&[1.0]).unwrap_err(),
            MonitorError::StageCount {
                iteration: 1,
                got: 1,
                expected: 2
            }
        );
        let e = m.observe(&[1.0, -2.0]).unwrap_err();
        assert!(e.to_string().contains("stage 1 is -2"), "{e}");
        assert_eq!(m.iterations(), 1, "refused iterations are not counted");
    }
}
