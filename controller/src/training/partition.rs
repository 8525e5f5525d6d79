//! DynPipe's re-partitioner (`calculate_new_placement` in
//! `runtime/image_classification/main_with_runtime.py`): where to cut a
//! pipeline's layers into stages when some GPUs slow down. Pure: profiles
//! and predictions in, a partition out.
//!
//! The rule:
//! 1. A layer's cost is its forward + backward + communication in and out.
//! 2. Candidate cuts: inside each current stage, the `k` costliest layers
//!    (ties: the earlier layer, as `heapq.nlargest` keeps them); a cut goes
//!    right **after** such a layer (DynPipe's `x + 1`). A cut after the
//!    model's last layer is no cut and is dropped.
//! 3. Every combination of `S - 1` cuts among the candidates is tried, in
//!    lexicographic order (`itertools.combinations`).
//! 4. For each, stage `s`'s forward and backward sums are multiplied by the
//!    predicted slowdown of stage `s` running those layers
//!    ([`SlowdownPredictor`]); each boundary costs the communication time
//!    of the last layer before it, both ways.
//! 5. The 1F1B simulator ([`super::sim1f1b`], 99 microbatches) gives each
//!    candidate's steady-state time per microbatch; the fastest wins.
//!
//! Where this differs from DynPipe's code, and why:
//! * The current cuts are candidates too. DynPipe's candidates need not
//!   contain them, so it could not keep a partition that is already best
//!   (with uniform costs its ties put every candidate at a stage's start);
//!   with them, the result is never predicted slower than the current
//!   partition. DynPipe also drops its last candidate (it merges the tail
//!   into the last block); here every candidate is kept.
//! * Ties (within [`TIE_REL`]) go to the current partition if it is among
//!   the fastest, else to the lexicographically smallest partition.
//!   DynPipe takes the first minimum (`record.index(min(record))`).
//! * The combinations are bounded ([`COMBINATIONS_MAX`]): when `k` would
//!   give more, `k` is lowered until they fit (the plan says which `k` it
//!   used), and below `k = 1` the planner refuses with an error.
//!
//! **Assumption:** layer costs are solo times (the GPU without
//! interference, as DynPipe's per-layer profile files); the predictor says
//! how much slower each stage's GPU runs now. DynPipe predicts that with a
//! random forest (`rf.pkl`, 500 trees) over 26 GPU counters from `nsys` and
//! the candidate stage's model features (MACs, parameters, layer-type
//! counts); the default here, [`MeasuredRatio`], is the ratio the monitor
//! measured per stage (its time now over its frozen baseline), whatever
//! layers it would hold.

use std::ops::Range;

use super::sim1f1b::{
    BoundaryComm, SimError, Simulator, StageTime, MICROBATCHES_DEFAULT, STAGES_MAX,
};

/// Candidate cut points per current stage (DynPipe's `top_k`).
pub const TOP_K_DEFAULT: usize = 2;
/// Most candidate partitions one re-partitioning simulates.
pub const COMBINATIONS_MAX: u64 = 200_000;
/// Most layers a model may have.
pub const LAYERS_MAX: usize = 4096;
/// Predicted times this close (relative) count as a tie.
pub const TIE_REL: f64 = 1e-9;

// Every stage keeps a layer, so a model with LAYERS_MAX layers can fill
// STAGES_MAX stages; one candidate list per stage holds at most
// TOP_K_DEFAULT + 1 cuts.
const _: () = assert!(LAYERS_MAX >= STAGES_MAX);
const _: () = assert!(COMBINATIONS_MAX >= 1 && TOP_K_DEFAULT >= 1);

/// One layer's profiled (solo) times, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LayerCost {
    pub forward_s: f64,
    pub backward_s: f64,
    /// Receiving its input from the previous layer's stage.
    pub comm_in_s: f64,
    /// Sending its output to the next layer's stage (and its gradient
    /// back): what a cut right after this layer costs, each way.
    pub comm_out_s: f64,
}

impl LayerCost {
    pub fn new(forward_s: f64, backward_s: f64) -> Self {
        LayerCost {
            forward_s,
            backward_s,
            ..LayerCost::default()
        }
    }

    /// DynPipe's ranking cost: forward + backward + communication in and out.
    pub fn cost_s(&self) -> f64 {
        self.forward_s + self.backward_s + self.comm_in_s + self.comm_out_s
    }
}

/// How many times slower than its layers' solo times a stage would run.
pub trait SlowdownPredictor {
    /// The predicted slowdown (1.0: none) of `stage`'s GPU running the
    /// layers `layers`. Must be finite and positive.
    fn slowdown(&self, stage: usize, layers: Range<usize>) -> f64;
}

/// The measured ratio per stage: its time now over its frozen baseline,
/// whatever layers it would hold. Stages past the end have ratio 1.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredRatio {
    ratios: Vec<f64>,
}

impl MeasuredRatio {
    /// From the ratios themselves (each finite and positive).
    pub fn new(ratios: Vec<f64>) -> Result<Self, PartitionError> {
        if ratios.len() > STAGES_MAX {
            return Err(PartitionError::TooManyStages {
                stages: ratios.len(),
                max: STAGES_MAX,
            });
        }
        if let Some(stage) = ratios.iter().position(|r| !(r.is_finite() && *r > 0.0)) {
            return Err(PartitionError::BadSlowdown {
                stage,
                value: ratios[stage],
            });
        }
        Ok(MeasuredRatio { ratios })
    }

    /// No slowdown on any stage.
    pub fn none() -> Self {
        MeasuredRatio { ratios: Vec::new() }
    }

    /// Each stage's time now over its baseline time (same length, both
    /// positive).
    pub fn from_times(now_s: &[f64], baseline_s: &[f64]) -> Result<Self, PartitionError> {
        if now_s.len() != baseline_s.len() {
            return Err(PartitionError::LengthMismatch {
                field: "baseline_s",
                got: baseline_s.len(),
                expected: now_s.len(),
            });
        }
        Self::new(now_s.iter().zip(baseline_s).map(|(n, b)| n / b).collect())
    }

    pub fn ratios(&self) -> &[f64] {
        &self.ratios
    }
}

impl SlowdownPredictor for MeasuredRatio {
    fn slowdown(&self, stage: usize, _layers: Range<usize>) -> f64 {
        self.ratios.get(stage).copied().unwrap_or(1.0)
    }
}

/// The knobs of [`repartition`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepartitionOptions {
    /// Candidate cuts per current stage (at least 1).
    pub top_k: usize,
    /// Microbatches simulated per candidate.
    pub microbatches: usize,
    /// Most candidate partitions to simulate (at most [`COMBINATIONS_MAX`]).
    pub combinations_max: u64,
}

impl Default for RepartitionOptions {
    fn default() -> Self {
        RepartitionOptions {
            top_k: TOP_K_DEFAULT,
            microbatches: MICROBATCHES_DEFAULT,
            combinations_max: COMBINATIONS_MAX,
        }
    }
}

/// The re-partitioner's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct RepartitionPlan {
    /// Layers per stage, in order.
    pub partition: Vec<usize>,
    /// Its predicted steady-state time per microbatch.
    pub time_per_microbatch_s: f64,
    /// The current partition's, under the same prediction.
    pub current_time_per_microbatch_s: f64,
    /// The current partition won (it was among the fastest).
    pub kept_current: bool,
    /// The `k` used: the asked one, or lower to fit the combinations.
    pub top_k: usize,
    /// The candidate cuts (a cut `c` puts layers `..c` and `c..` apart).
    pub candidates: Vec<usize>,
    /// Candidate partitions simulated.
    pub evaluated: u64,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PartitionError {
    #[error("layers is empty: a model needs at least one layer")]
    NoLayers,
    #[error("{layers} layers is more than the limit of {max} (LAYERS_MAX)")]
    TooManyLayers { layers: usize, max: usize },
    #[error("{field} of layer {layer} is {value}: times must be finite and non-negative")]
    BadLayerCost {
        layer: usize,
        field: &'static str,
        value: f64,
    },
    #[error("partition is empty: a pipeline needs at least one stage")]
    NoStages,
    #[error("partition has {stages} stages, more than the limit of {max} (STAGES_MAX)")]
    TooManyStages { stages: usize, max: usize },
    #[error("partition has {stages} stages but the model has only {layers} layers: every stage needs one")]
    StagesExceedLayers { stages: usize, layers: usize },
    #[error("partition[{stage}] is 0: every stage must keep at least one layer")]
    EmptyStage { stage: usize },
    #[error("partition sums to {sum} layers but the model has {layers}")]
    PartitionSum { sum: usize, layers: usize },
    #[error("{field} has {got} entries, expected {expected}")]
    LengthMismatch {
        field: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("top_k is 0: give at least 1 candidate cut per stage")]
    ZeroTopK,
    #[error("combinations_max is {got}: give 1 to {max} (COMBINATIONS_MAX)")]
    BadCombinationsMax { got: u64, max: u64 },
    #[error("the predicted slowdown of stage {stage} is {value}: it must be finite and positive")]
    BadSlowdown { stage: usize, value: f64 },
    #[error(
        "{stages} stages over {candidates} candidate cuts (top_k 1) give {combinations} \
         partitions, more than the limit of {max}: use fewer stages"
    )]
    TooManyCombinations {
        stages: usize,
        candidates: usize,
        combinations: u64,
        max: u64,
    },
    #[error("simulating a candidate: {0}")]
    Sim(#[from] SimError),
}

/// DynPipe's re-partitioning of `layers` (solo costs), currently cut as
/// `current` (layers per stage), under `predictor`'s slowdowns.
pub fn repartition(
    layers: &[LayerCost],
    current: &[usize],
    predictor: &dyn SlowdownPredictor,
    opts: &RepartitionOptions,
) -> Result<RepartitionPlan, PartitionError> {
    validate(layers, current)?;
    if opts.top_k == 0 {
        return Err(PartitionError::ZeroTopK);
    }
    if opts.combinations_max == 0 || opts.combinations_max > COMBINATIONS_MAX {
        return Err(PartitionError::BadCombinationsMax {
            got: opts.combinations_max,
            max: COMBINATIONS_MAX,
        });
    }
    let stages = current.len();
    let cuts = stages - 1;

    // The largest k (up to the asked one) whose combinations fit.
    let mut top_k = opts.top_k.min(layers.len());
    let (candidates, combinations) = loop {
        let c = cut_candidates(layers, current, top_k);
        let n = binomial(c.len() as u64, cuts as u64);
        if n <= opts.combinations_max {
            break (c, n);
        }
        if top_k == 1 {
            return Err(PartitionError::TooManyCombinations {
                stages,
                candidates: c.len(),
                combinations: n,
                max: opts.combinations_max,
            });
        }
        top_k -= 1;
    };

    let mut eval = Evaluator::new(layers, predictor, opts.microbatches);
    let current_cuts = cuts_of(current);
    let current_time = eval.time(&current_cuts)?;

    // Every combination's time, in lexicographic order of the cuts (which
    // is also the partitions' lexicographic order).
    let mut times = Vec::with_capacity(combinations as usize);
    let mut pick = Combinations::new(candidates.len(), cuts);
    let mut chosen = vec![0; cuts];
    while let Some(idx) = pick.next_indices() {
        for (c, &i) in chosen.iter_mut().zip(idx) {
            *c = candidates[i];
        }
        times.push(eval.time(&chosen)?);
    }
    debug_assert_eq!(times.len() as u64, combinations);
    let best = times.iter().copied().fold(f64::INFINITY, f64::min);
    let tied = |t: f64| t <= best + TIE_REL * best.abs();

    let (partition, time, kept_current) = if tied(current_time) {
        (current.to_vec(), current_time, true)
    } else {
        let first = times.iter().position(|&t| tied(t)).expect("a minimum");
        let mut pick = Combinations::new(candidates.len(), cuts);
        for _ in 0..first {
            pick.next_indices();
        }
        let idx = pick.next_indices().expect("the winner's combination");
        let cut: Vec<usize> = idx.iter().map(|&i| candidates[i]).collect();
        (partition_of(&cut, layers.len()), times[first], false)
    };
    Ok(RepartitionPlan {
        partition,
        time_per_microbatch_s: time,
        current_time_per_microbatch_s: current_time,
        kept_current,
        top_k,
        candidates,
        evaluated: combinations,
    })
}

/// The predicted steady-state time per microbatch of `partition`.
pub fn predict(
    layers: &[LayerCost],
    partition: &[usize],
    predictor: &dyn SlowdownPredictor,
    microbatches: usize,
) -> Result<f64, PartitionError> {
    validate(layers, partition)?;
    Evaluator::new(layers, predictor, microbatches).time(&cuts_of(partition))
}

/// The candidate cuts (sorted, distinct, each in `1..layers.len()`): the
/// current cuts, and right after each of the `k` costliest layers of every
/// current stage. `current` must be valid (see [`repartition`]).
pub fn cut_candidates(layers: &[LayerCost], current: &[usize], k: usize) -> Vec<usize> {
    let mut out = cuts_of(current);
    let mut start = 0;
    let mut order: Vec<usize> = Vec::new();
    for &n in current {
        order.clear();
        order.extend(start..start + n);
        // Costliest first; equal costs: the earlier layer first.
        order.sort_by(|&a, &b| {
            layers[b]
                .cost_s()
                .total_cmp(&layers[a].cost_s())
                .then(a.cmp(&b))
        });
        out.extend(
            order
                .iter()
                .take(k)
                .map(|&l| l + 1)
                .filter(|&c| c < layers.len()),
        );
        start += n;
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The cut positions of a partition (layers per stage).
fn cuts_of(partition: &[usize]) -> Vec<usize> {
    partition
        .iter()
        .take(partition.len().saturating_sub(1))
        .scan(0, |acc, &n| {
            *acc += n;
            Some(*acc)
        })
        .collect()
}

/// Layers per stage from sorted cuts.
fn partition_of(cuts: &[usize], layers: usize) -> Vec<usize> {
    let mut prev = 0;
    let mut out: Vec<usize> = cuts
        .iter()
        .map(|&c| {
            let n = c - prev;
            prev = c;
            n
        })
        .collect();
    out.push(layers - prev);
    out
}

/// Simulates candidate cuts with prefix sums and one reused simulator.
struct Evaluator<'a> {
    layers: &'a [LayerCost],
    predictor: &'a dyn SlowdownPredictor,
    microbatches: usize,
    forward_prefix: Vec<f64>,
    backward_prefix: Vec<f64>,
    stages: Vec<StageTime>,
    comm: Vec<BoundaryComm>,
    sim: Simulator,
}

impl<'a> Evaluator<'a> {
    fn new(
        layers: &'a [LayerCost],
        predictor: &'a dyn SlowdownPredictor,
        microbatches: usize,
    ) -> Self {
        let prefix = |f: fn(&LayerCost) -> f64| {
            let mut acc = 0.0;
            std::iter::once(0.0)
                .chain(layers.iter().map(|l| {
                    acc += f(l);
                    acc
                }))
                .collect::<Vec<_>>()
        };
        Evaluator {
            layers,
            predictor,
            microbatches,
            forward_prefix: prefix(|l| l.forward_s),
            backward_prefix: prefix(|l| l.backward_s),
            stages: Vec::new(),
            comm: Vec::new(),
            sim: Simulator::default(),
        }
    }

    /// The time per microbatch with the model cut at `cuts` (sorted).
    fn time(&mut self, cuts: &[usize]) -> Result<f64, PartitionError> {
        self.stages.clear();
        self.comm.clear();
        let n = self.layers.len();
        for s in 0..=cuts.len() {
            let lo = if s == 0 { 0 } else { cuts[s - 1] };
            let hi = cuts.get(s).copied().unwrap_or(n);
            let slow = self.predictor.slowdown(s, lo..hi);
            if !(slow.is_finite() && slow > 0.0) {
                return Err(PartitionError::BadSlowdown {
                    stage: s,
                    value: slow,
                });
            }
            self.stages.push(StageTime::new(
                slow * (self.forward_prefix[hi] - self.forward_prefix[lo]),
                slow * (self.backward_prefix[hi] - self.backward_prefix[lo]),
            ));
        }
        self.comm.extend(
            cuts.iter()
                .map(|&c| BoundaryComm::symmetric(self.layers[c - 1].comm_out_s)),
        );
        Ok(self
            .sim
            .run(&self.stages, &self.comm, self.microbatches, None)?
            .time_per_microbatch_s)
    }
}

/// `r`-of-`n` index combinations in lexicographic order.
struct Combinations {
    n: usize,
    idx: Vec<usize>,
    started: bool,
}

impl Combinations {
    fn new(n: usize, r: usize) -> Self {
        Combinations {
            n,
            idx: (0..r).collect(),
            started: false,
        }
    }

    fn next_indices(&mut self) -> Option<&[usize]> {
        let r = self.idx.len();
        if !self.started {
            self.started = true;
            return (r <= self.n).then_some(&self.idx[..]);
        }
        // The rightmost index that can still move right.
        let i = (0..r).rev().find(|&i| self.idx[i] < self.n - r + i)?;
        self.idx[i] += 1;
        for j in i + 1..r {
            self.idx[j] = self.idx[j - 1] + 1;
        }
        Some(&self.idx[..])
    }
}

/// `n` choose `r`, saturating at `u64::MAX`.
fn binomial(n: u64, r: u64) -> u64 {
    if r > n {
        return 0;
    }
    let r = r.min(n - r);
    let mut acc: u128 = 1;
    for i in 0..r {
        // Exact at every step: acc is C(n, i) * ... a binomial itself.
        acc = acc * u128::from(n - i) / u128::from(i + 1);
        if acc > u128::from(u64::MAX) {
            return u64::MAX;
        }
    }
    acc as u64
}

fn validate(layers: &[LayerCost], partition: &[usize]) -> Result<(), PartitionError> {
    if layers.is_empty() {
        return Err(PartitionError::NoLayers);
    }
    if layers.len() > LAYERS_MAX {
        return Err(PartitionError::TooManyLayers {
            layers: layers.len(),
            max: LAYERS_MAX,
        });
    }
    for (layer, l) in layers.iter().enumerate() {
        for (field, value) in [
            ("forward_s", l.forward_s),
            ("backward_s", l.backward_s),
            ("comm_in_s", l.comm_in_s),
            ("comm_out_s", l.comm_out_s),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(PartitionError::BadLayerCost {
                    layer,
                    field,
                    value,
                });
            }
        }
    }
    if partition.is_empty() {
        return Err(PartitionError::NoStages);
    }
    if partition.len() > STAGES_MAX {
        return Err(PartitionError::TooManyStages {
            stages: partition.len(),
            max: STAGES_MAX,
        });
    }
    if partition.len() > layers.len() {
        return Err(PartitionError::StagesExceedLayers {
            stages: partition.len(),
            layers: layers.len(),
        });
    }
    if let Some(stage) = partition.iter().position(|&n| n == 0) {
        return Err(PartitionError::EmptyStage { stage });
    }
    // Each entry is at most LAYERS_MAX-ish only if the sum is right; add
    // saturating so a huge entry cannot wrap.
    let sum = partition.iter().fold(0usize, |a, &n| a.saturating_add(n));
    if sum != layers.len() {
        return Err(PartitionError::PartitionSum {
            sum,
            layers: layers.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
#[path = "partition_tests.rs"]
mod tests;
