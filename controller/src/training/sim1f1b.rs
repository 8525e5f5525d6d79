//! An event-level simulator of PipeDream's 1F1B schedule, as DynPipe's
//! re-partitioner uses it (the `main` nested in `calculate_new_placement`,
//! `runtime/image_classification/main_with_runtime.py`).
//!
//! `S` stages, stage `s` taking `forward_s` and `backward_s` per microbatch,
//! `M` microbatches. Stage `s` runs `S - s - 1` warm-up forwards, then
//! alternates one forward and one backward, then drains its backwards (the
//! last stage has no warm-up: F0 B0 F1 B1 ...). An op starts when its stage
//! is free and its input has arrived:
//! * the forward of microbatch `i` at stage `s > 0` after the forward of `i`
//!   at `s - 1` ended plus the boundary's activation time;
//! * the backward of `i` at stage `s < S - 1` after the backward of `i` at
//!   `s + 1` ended plus the boundary's gradient time; at the last stage
//!   after its own forward of `i`.
//!
//! Communication is a latency on the dependency, not a resource: transfers
//! on one boundary may overlap, and they never occupy a stage (as in
//! DynPipe's simulator, whose `get_comm_cost` adds the boundary's time to
//! both directions). So a boundary's time is hidden only while 1F1B's
//! in-flight window covers it. Stage `s` holds at most `S - s` microbatches
//! in flight, so every run of stages `s..=t` forms a cycle that carries
//! `t - s + 1` microbatches, and the steady-state time per microbatch is
//! the largest cycle mean: the maximum over `s <= t` of
//! `(sum_{u in s..=t} (f_u + b_u) + the round trips (activation +
//! gradient) of the boundaries inside s..=t) / (t - s + 1)`. Without
//! communication that is the slowest stage's `f + b`; a boundary's round
//! trip shows up once it exceeds what its neighbours leave of the
//! bottleneck (`2 * max - (f + b)_s - (f + b)_{s+1}` for the boundary
//! `s -> s + 1` alone). The tests check the simulator against this bound.
//!
//! The steady-state time per microbatch is measured at stage 0, from the
//! forward of microbatch `S` (the first one that waited for a backward) to
//! the forward of microbatch `M - 1` (the last), so warm-up and drain are
//! left out. Where the critical cycle carries several microbatches, the
//! spacing repeats over that many rather than per microbatch, so the
//! average can be off by up to one cycle's time over the span (at most
//! `S / (M - S - 1)` relative). DynPipe averages stage 0's forward spacing
//! from microbatch 0, warm-up included; [`dynpipe_average`] is that
//! figure, kept so the two can be compared.
//!
//! **Assumption (DynPipe's):** a stage runs one op at a time, its times do
//! not vary from microbatch to microbatch, and an op's input is usable the
//! moment it has arrived (no queueing on the link).
//!
//! Pure: no IO, no clock; times are seconds of a virtual clock.

/// Microbatches DynPipe simulates per candidate partition.
pub const MICROBATCHES_DEFAULT: usize = 99;
/// Most stages a simulated pipeline may have.
pub const STAGES_MAX: usize = 64;
/// Most microbatches one simulation may run.
pub const MICROBATCHES_MAX: usize = 4096;
/// Most ops (forwards and backwards) one simulation records.
pub const OPS_MAX: usize = 2 * STAGES_MAX * MICROBATCHES_MAX;

const _: () = assert!(MICROBATCHES_DEFAULT <= MICROBATCHES_MAX);
const _: () = assert!(STAGES_MAX >= 1);
// Every op fits the event list, and op counts fit a u32 comfortably.
const _: () = assert!(OPS_MAX <= u32::MAX as usize);

/// One stage's compute time per microbatch, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageTime {
    pub forward_s: f64,
    pub backward_s: f64,
}

impl StageTime {
    pub fn new(forward_s: f64, backward_s: f64) -> Self {
        StageTime {
            forward_s,
            backward_s,
        }
    }
}

/// The transfer times on the boundary between stage `s` and `s + 1`,
/// seconds: the activation forward and the gradient back.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BoundaryComm {
    pub activation_s: f64,
    pub gradient_s: f64,
}

impl BoundaryComm {
    /// The same time both ways (DynPipe's one time per boundary).
    pub fn symmetric(s: f64) -> Self {
        BoundaryComm {
            activation_s: s,
            gradient_s: s,
        }
    }
}

/// A forward or a backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    Forward,
    Backward,
}

/// One op as it ran on the virtual clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpEvent {
    pub stage: usize,
    pub microbatch: usize,
    pub kind: OpKind,
    pub start_s: f64,
    pub end_s: f64,
}

/// What a simulation says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimResult {
    /// The end of the last op (stage 0's last backward).
    pub makespan_s: f64,
    /// The steady-state time per microbatch (see the module doc); when
    /// there are too few microbatches for a steady state (`M < S + 2`),
    /// `makespan_s / M`.
    pub time_per_microbatch_s: f64,
    /// Whether `time_per_microbatch_s` is a steady-state figure.
    pub steady_state: bool,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    #[error("a pipeline needs at least one stage")]
    NoStages,
    #[error("{stages} stages is more than the simulator's limit of {max} (STAGES_MAX)")]
    TooManyStages { stages: usize, max: usize },
    #[error("microbatches must be at least 1")]
    NoMicrobatches,
    #[error("{microbatches} microbatches is more than the simulator's limit of {max} (MICROBATCHES_MAX)")]
    TooManyMicrobatches { microbatches: usize, max: usize },
    #[error("comm has {got} boundaries but {stages} stages have {expected} (or give none)")]
    CommLength {
        got: usize,
        expected: usize,
        stages: usize,
    },
    #[error("{field} of stage {stage} is {value}: times must be finite and non-negative")]
    BadStageTime {
        stage: usize,
        field: &'static str,
        value: f64,
    },
    #[error("{field} of boundary {boundary} (stage {boundary} -> {}) is {value}: times must be finite and non-negative", boundary + 1)]
    BadCommTime {
        boundary: usize,
        field: &'static str,
        value: f64,
    },
}

/// Simulates `microbatches` microbatches (DynPipe's:
/// [`MICROBATCHES_DEFAULT`]) through `stages` under 1F1B. `comm` is empty
/// (no communication) or has one entry per boundary.
pub fn simulate(
    stages: &[StageTime],
    comm: &[BoundaryComm],
    microbatches: usize,
) -> Result<SimResult, SimError> {
    Simulator::default().run(stages, comm, microbatches, None)
}

/// [`simulate`], also returning every op (stage by stage, each stage's ops
/// in the order they ran).
pub fn simulate_with_events(
    stages: &[StageTime],
    comm: &[BoundaryComm],
    microbatches: usize,
) -> Result<(SimResult, Vec<OpEvent>), SimError> {
    let mut events = Vec::new();
    let r = Simulator::default().run(stages, comm, microbatches, Some(&mut events))?;
    Ok((r, events))
}

/// Stage `stage`'s `p`-th op under 1F1B (of `2 * microbatches`): warm-up
/// forwards, then one forward and one backward in turn, then the drain.
pub fn op_at(stages: usize, stage: usize, microbatches: usize, p: usize) -> (OpKind, usize) {
    debug_assert!(stage < stages && p < 2 * microbatches);
    let warmup = (stages - stage - 1).min(microbatches);
    if p < warmup {
        return (OpKind::Forward, p);
    }
    let q = p - warmup;
    let steady = 2 * (microbatches - warmup);
    if q < steady {
        if q.is_multiple_of(2) {
            (OpKind::Forward, warmup + q / 2)
        } else {
            (OpKind::Backward, q / 2)
        }
    } else {
        (OpKind::Backward, microbatches - warmup + (q - steady))
    }
}

/// DynPipe's figure: stage 0's forward starts, every `S`-th microbatch from
/// 0 while more than `S` microbatches remain, averaged per microbatch
/// (`show_batches_time`). `None` without such a span.
pub fn dynpipe_average(events: &[OpEvent], stages: usize, microbatches: usize) -> Option<f64> {
    if stages == 0 {
        return None;
    }
    let last = (microbatches.checked_sub(stages + 1)? / stages) * stages;
    if last == 0 {
        return None;
    }
    let start = |i: usize| {
        events
            .iter()
            .find(|e| e.stage == 0 && e.kind == OpKind::Forward && e.microbatch == i)
            .map(|e| e.start_s)
    };
    Some((start(last)? - start(0)?) / last as f64)
}

/// The simulator with its buffers, reused across runs (the re-partitioner
/// simulates every candidate with one).
#[derive(Debug, Default)]
pub struct Simulator {
    microbatches: usize,
    /// Per stage and microbatch (`s * M + i`); NaN until it ran.
    forward_end: Vec<f64>,
    backward_end: Vec<f64>,
    /// Stage 0's forward starts, for the steady-state figure.
    forward_start0: Vec<f64>,
    /// When each stage is free.
    free_at: Vec<f64>,
}

impl Simulator {
    /// [`simulate`] (and, with `events`, [`simulate_with_events`]) on this
    /// simulator's buffers.
    pub fn run(
        &mut self,
        stages: &[StageTime],
        comm: &[BoundaryComm],
        microbatches: usize,
        mut events: Option<&mut Vec<OpEvent>>,
    ) -> Result<SimResult, SimError> {
        validate(stages, comm, microbatches)?;
        let s_n = stages.len();
        let m = microbatches;
        self.microbatches = m;
        self.forward_end.clear();
        self.forward_end.resize(s_n * m, f64::NAN);
        self.backward_end.clear();
        self.backward_end.resize(s_n * m, f64::NAN);
        self.forward_start0.clear();
        self.forward_start0.resize(m, f64::NAN);
        self.free_at.clear();
        self.free_at.resize(s_n, 0.0);
        if let Some(ev) = events.as_deref_mut() {
            ev.clear();
            ev.reserve(2 * s_n * m);
        }

        // One order that respects every dependency, so no op waits to be
        // ready: the warm-up forwards stage by stage (stage s - 1 runs one
        // more than s), then rounds r = 0.. of one forward per stage going
        // down (stage s - 1 is a forward ahead) and the backward of
        // microbatch r per stage going up. Each stage still runs its own
        // ops in 1F1B order ([`op_at`]).
        let warmup = |s: usize| (s_n - s - 1).min(m);
        for s in 0..s_n {
            for i in 0..warmup(s) {
                self.exec(stages, comm, s, OpKind::Forward, i, events.as_deref_mut());
            }
        }
        for r in 0..m {
            for s in 0..s_n {
                let i = warmup(s) + r;
                if i < m {
                    self.exec(stages, comm, s, OpKind::Forward, i, events.as_deref_mut());
                }
            }
            for s in (0..s_n).rev() {
                self.exec(stages, comm, s, OpKind::Backward, r, events.as_deref_mut());
            }
        }
        if let Some(ev) = events {
            // Stage by stage, each in its own order (the sort is stable).
            ev.sort_by_key(|e| e.stage);
        }

        let makespan_s = self.free_at.iter().copied().fold(0.0, f64::max);
        let (lo, hi) = (s_n, m.saturating_sub(1));
        let (time_per_microbatch_s, steady_state) = if hi > lo {
            let start0 = &self.forward_start0;
            ((start0[hi] - start0[lo]) / (hi - lo) as f64, true)
        } else {
            (makespan_s / m as f64, false)
        };
        Ok(SimResult {
            makespan_s,
            time_per_microbatch_s,
            steady_state,
        })
    }

    /// Runs stage `s`'s `kind` of microbatch `i` as soon as the stage is
    /// free and its input has arrived (which the caller's order ensures
    /// has been simulated).
    fn exec(
        &mut self,
        stages: &[StageTime],
        comm: &[BoundaryComm],
        s: usize,
        kind: OpKind,
        i: usize,
        events: Option<&mut Vec<OpEvent>>,
    ) {
        let m = self.microbatches;
        let last = stages.len() - 1;
        let boundary = |b: usize| comm.get(b).copied().unwrap_or_default();
        let input_at = match kind {
            OpKind::Forward if s == 0 => 0.0,
            OpKind::Forward => self.forward_end[(s - 1) * m + i] + boundary(s - 1).activation_s,
            OpKind::Backward if s == last => self.forward_end[s * m + i],
            OpKind::Backward => self.backward_end[(s + 1) * m + i] + boundary(s).gradient_s,
        };
        debug_assert!(
            !input_at.is_nan(),
            "stage {s} {kind:?} {i} before its input"
        );
        let start_s = self.free_at[s].max(input_at);
        let end_s = match kind {
            OpKind::Forward => {
                if s == 0 {
                    self.forward_start0[i] = start_s;
                }
                let end = start_s + stages[s].forward_s;
                self.forward_end[s * m + i] = end;
                end
            }
            OpKind::Backward => {
                let end = start_s + stages[s].backward_s;
                self.backward_end[s * m + i] = end;
                end
            }
        };
        self.free_at[s] = end_s;
        if let Some(ev) = events {
            ev.push(OpEvent {
                stage: s,
                microbatch: i,
                kind,
                start_s,
                end_s,
            });
        }
    }
}

fn validate(stages: &[StageTime], comm: &[BoundaryComm], m: usize) -> Result<(), SimError> {
    if stages.is_empty() {
        return Err(SimError::NoStages);
    }
    if stages.len() > STAGES_MAX {
        return Err(SimError::TooManyStages {
            stages: stages.len(),
            max: STAGES_MAX,
        });
    }
    if m == 0 {
        return Err(SimError::NoMicrobatches);
    }
    if m > MICROBATCHES_MAX {
        return Err(SimError::TooManyMicrobatches {
            microbatches: m,
            max: MICROBATCHES_MAX,
        });
    }
    if !comm.is_empty() && comm.len() != stages.len() - 1 {
        return Err(SimError::CommLength {
            got: comm.len(),
            expected: stages.len() - 1,
            stages: stages.len(),
        });
    }
    let ok = |v: f64| v.is_finite() && v >= 0.0;
    for (stage, st) in stages.iter().enumerate() {
        for (field, value) in [("forward_s", st.forward_s), ("backward_s", st.backward_s)] {
            if !ok(value) {
                return Err(SimError::BadStageTime {
                    stage,
                    field,
                    value,
                });
            }
        }
    }
    for (boundary, c) in comm.iter().enumerate() {
        for (field, value) in [
            ("activation_s", c.activation_s),
            ("gradient_s", c.gradient_s),
        ] {
            if !ok(value) {
                return Err(SimError::BadCommTime {
                    boundary,
                    field,
                    value,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "sim1f1b_tests.rs"]
mod tests;
