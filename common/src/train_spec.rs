//! A distributed training job's spec: P pipelines x S stages of one model
//! package, 1F1B within a pipeline, a sync mode across pipelines, optional
//! DynPipe re-partitioning, and the interference knobs of the experiments.
//!
//! The spec is JSON (`distmind train submit --spec FILE`, documented field
//! by field in `settings/README.md`); every struct refuses unknown fields.
//! [`JobSpec::from_json`] parses, [`JobSpec::validate`] checks everything
//! that needs no catalog, and [`JobSpec::partition_for`] checks the spec
//! against the model's layer count and returns the partition in effect.
//! Every error is a [`SpecError`] that names the field by its JSON path
//! (`partition[2]`, `sync.preduce.ssp_bound`) and the value found.
//!
//! A *layer* is one entry of the package manifest's `layers` list (an op of
//! `models/OPS.md`), in manifest order; a stage runs a contiguous run of them.

mod path;
mod validate;

pub use validate::{balanced_partition, check_partition, layer_ranges};

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::limits::NAME_BYTES_MAX;

/// Most pipelines (data-parallel replicas) of one job.
pub const PIPELINES_MAX: u32 = 64;
/// Most stages of one pipeline.
pub const STAGES_MAX: u32 = 64;
/// Most stage workers (pipelines x stages) of one job: one GPU each.
pub const STAGE_WORKERS_MAX: u32 = 512;
/// Most microbatches one iteration's batch is cut into.
pub const MICROBATCHES_MAX: u32 = 1024;
/// Largest batch (samples per pipeline per iteration).
pub const BATCH_MAX: u32 = 1 << 16;
/// Most iterations a job may ask for.
pub const ITERATIONS_MAX: u64 = 1_000_000_000;
/// Longest job name, in bytes.
pub const JOB_NAME_BYTES_MAX: usize = 64;
/// Most layers one stage (and so one partition entry) may hold.
pub const LAYERS_MAX: u32 = 1 << 20;
/// Most slowdown events of `interference.slowdowns`.
pub const SLOWDOWNS_MAX: usize = 64;
/// Largest slowdown factor.
pub const SLOWDOWN_FACTOR_MAX: f64 = 1000.0;
/// Longest injected sleep of `interference.hetero_s`.
pub const HETERO_S_MAX: f64 = 3600.0;
/// Largest learning rate accepted (a guard against a mistyped exponent).
pub const LR_MAX: f64 = 100.0;
/// Longest initial wait of the partial reduce.
pub const PREDUCE_WAIT_MS_MAX: u64 = 600_000;
/// Largest staleness bound of the partial reduce.
pub const SSP_BOUND_MAX: u32 = 1000;
/// Largest `sync.hetpipe.push_every`.
pub const PUSH_EVERY_MAX: u32 = 100_000;
/// Largest DynPipe monitoring window.
pub const DYNAMIC_WINDOW_MAX: u32 = 100_000;
/// Largest spec file.
pub const SPEC_BYTES_MAX: usize = 1 << 20;

const _: () = assert!(STAGE_WORKERS_MAX <= PIPELINES_MAX * STAGES_MAX);
const _: () = assert!(STAGE_WORKERS_MAX >= PIPELINES_MAX && STAGE_WORKERS_MAX >= STAGES_MAX);
// `microbatches >= stages` is always satisfiable within the bounds.
const _: () = assert!(STAGES_MAX <= MICROBATCHES_MAX && MICROBATCHES_MAX <= BATCH_MAX);
const _: () = assert!(JOB_NAME_BYTES_MAX <= NAME_BYTES_MAX);

/// A training job as submitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// 1..=64 bytes of `[A-Za-z0-9._-]`, starting with a letter or digit;
    /// the job id is `<name>-<n>`.
    pub name: String,
    /// A model in the controller's catalog (a deployed package).
    pub model: String,
    pub optimizer: Optimizer,
    /// Samples per pipeline per iteration.
    pub batch: u32,
    /// The batch is cut into this many microbatches (1F1B's unit).
    pub microbatches: u32,
    /// P: data-parallel replicas of the pipeline.
    pub pipelines: u32,
    /// S: stages per pipeline, one GPU each.
    pub stages: u32,
    /// Layers per stage (S entries summing to the model's layer count);
    /// absent: balanced by layer count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<Vec<u32>>,
    /// How the pipelines synchronize; default allreduce.
    #[serde(default)]
    pub sync: SyncMode,
    /// DynPipe's re-partitioning; default off.
    #[serde(default)]
    pub dynamic: Dynamic,
    /// Where the samples come from; default synthetic with seed 0.
    #[serde(default)]
    pub data: DataSource,
    /// The job finishes after this many iterations.
    pub iterations: u64,
    /// Injected interference (experiments); default none.
    #[serde(default)]
    pub interference: Interference,
    /// Checkpoint every this many iterations (1..=`iterations`; not after
    /// the last); absent: never. Pipeline 0's workers write their stage's
    /// weights to the memory servers at the iteration boundary, without
    /// draining; the controller then puts the checkpoint model `<job>-ckpt`
    /// in its catalog, replacing (and freeing) the previous one. See the
    /// controller's `jobs::periodic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<u64>,
}

/// The optimizer and its hyper-parameters: `{"sgd": {...}}` or `{"adam": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    Sgd(Sgd),
    Adam(Adam),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sgd {
    pub lr: f64,
    /// In [0, 1); default 0.
    #[serde(default)]
    pub momentum: f64,
    /// >= 0; default 0.
    #[serde(default)]
    pub weight_decay: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adam {
    pub lr: f64,
    /// In [0, 1); default 0.9.
    #[serde(default = "defaults::beta1")]
    pub beta1: f64,
    /// In [0, 1); default 0.999.
    #[serde(default = "defaults::beta2")]
    pub beta2: f64,
    /// > 0; default 1e-8.
    #[serde(default = "defaults::eps")]
    pub eps: f64,
    /// >= 0 (decoupled, AdamW); default 0.
    #[serde(default)]
    pub weight_decay: f64,
}

/// How pipelines synchronize their gradients, one object keyed by the mode:
/// `{"allreduce": {}}`, `{"preduce": {...}}`, `{"adpsgd": {...}}`,
/// `{"hetpipe": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncMode {
    /// Every pipeline's gradients averaged every iteration.
    Allreduce(Allreduce),
    /// SD-Pipe's partial reduce: each stage's group scheduler reduces among
    /// the replicas that arrived, with an adaptive wait.
    Preduce(Preduce),
    /// AD-PSGD: each replica averages with a random peer.
    Adpsgd(Adpsgd),
    /// HetPipe: wave synchronization through a parameter server.
    Hetpipe(Hetpipe),
}

impl Default for SyncMode {
    fn default() -> Self {
        SyncMode::Allreduce(Allreduce {})
    }
}

impl SyncMode {
    /// The mode's JSON key.
    pub fn name(&self) -> &'static str {
        match self {
            SyncMode::Allreduce(_) => "allreduce",
            SyncMode::Preduce(_) => "preduce",
            SyncMode::Adpsgd(_) => "adpsgd",
            SyncMode::Hetpipe(_) => "hetpipe",
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allreduce {}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preduce {
    /// The group scheduler's first wait for stragglers (ms); absent: the
    /// scheduler's own default. It adapts from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms_initial: Option<u64>,
    /// SD-Pipe's `ssp_bound`: after every `ssp_bound x P` updates of a
    /// stage's replicas, the next grouping is a graph sync (it waits until
    /// every replica has been averaged in, transitively); absent: 10.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssp_bound: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adpsgd {
    /// Seed of the random peer choices.
    #[serde(default)]
    pub seed: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hetpipe {
    /// Iterations between pushes to the parameter server; default 10.
    #[serde(default = "defaults::push_every")]
    pub push_every: u32,
}

impl Default for Hetpipe {
    fn default() -> Self {
        Hetpipe {
            push_every: defaults::push_every(),
        }
    }
}

/// DynPipe's dynamic re-partitioning, with its defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Dynamic {
    pub enabled: bool,
    /// Iterations per stage-time measurement (a moving window).
    pub window: u32,
    /// The iteration at which each stage's baseline time is taken (the
    /// window ending there).
    pub baseline_at: u64,
    /// Re-partition when a stage's time exceeds this multiple of its baseline.
    pub threshold_up: f64,
    /// Re-partition when a stage takes at most this multiple of its
    /// baseline (it got faster: give it layers back).
    pub threshold_down: f64,
    /// Iterations from the decision (a window boundary) to the
    /// re-partition; afterwards the monitor starts over (a new baseline
    /// `baseline_at` iterations later).
    pub delay: u64,
}

impl Default for Dynamic {
    fn default() -> Self {
        Dynamic {
            enabled: false,
            window: 50,
            baseline_at: 100,
            threshold_up: 2.0,
            threshold_down: 0.5,
            delay: 60,
        }
    }
}

/// Where samples come from: `{"synthetic": {"seed": 0}}` (a dataset on the
/// memory servers comes with the data-loading work).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataSource {
    /// Seeded random inputs of the model's input shape and labels; pipeline
    /// `p` draws from `seed + p`.
    Synthetic(Synthetic),
}

impl Default for DataSource {
    fn default() -> Self {
        DataSource::Synthetic(Synthetic::default())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Synthetic {
    #[serde(default)]
    pub seed: u64,
}

/// Interference injected into the stage workers (SD-Pipe's and DynPipe's
/// experiment knobs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Interference {
    /// Each step of a stage sleeps this long with probability `hetero_p`
    /// (SD-Pipe's `--hetero`); default 0.
    #[serde(default)]
    pub hetero_s: f64,
    /// Default 0.1.
    #[serde(default = "defaults::hetero_p")]
    pub hetero_p: f64,
    /// Stages made slower from an iteration on.
    #[serde(default)]
    pub slowdowns: Vec<Slowdown>,
}

impl Default for Interference {
    fn default() -> Self {
        Interference {
            hetero_s: 0.0,
            hetero_p: defaults::hetero_p(),
            slowdowns: Vec::new(),
        }
    }
}

/// From iteration `at_iteration` on, stage `stage`'s compute takes `factor`
/// times as long (in pipeline `pipeline`, or in every pipeline).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slowdown {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<u32>,
    pub stage: u32,
    pub factor: f64,
    pub at_iteration: u64,
}

impl FromStr for Slowdown {
    type Err = String;

    /// `STAGE:FACTOR@ITER` or `PIPELINE/STAGE:FACTOR@ITER`, e.g. `2:3.0@100`.
    fn from_str(s: &str) -> Result<Self, String> {
        let form = "expected STAGE:FACTOR@ITER or PIPELINE/STAGE:FACTOR@ITER, e.g. 2:3.0@100";
        let (who, rest) = s
            .split_once(':')
            .ok_or_else(|| format!("slowdown {s:?}: no ':'; {form}"))?;
        let (factor, at) = rest
            .split_once('@')
            .ok_or_else(|| format!("slowdown {s:?}: no '@'; {form}"))?;
        let (pipeline, stage) = match who.split_once('/') {
            Some((p, st)) => (Some(p), st),
            None => (None, who),
        };
        let num =
            |what: &str, v: &str| format!("slowdown {s:?}: {what} {v:?} is not a number; {form}");
        Ok(Slowdown {
            pipeline: pipeline
                .map(|p| p.trim().parse().map_err(|_| num("pipeline", p)))
                .transpose()?,
            stage: stage.trim().parse().map_err(|_| num("stage", stage))?,
            factor: factor.trim().parse().map_err(|_| num("factor", factor))?,
            at_iteration: at.trim().parse().map_err(|_| num("iteration", at))?,
        })
    }
}

mod defaults {
    pub fn beta1() -> f64 {
        0.9
    }
    pub fn beta2() -> f64 {
        0.999
    }
    pub fn eps() -> f64 {
        1e-8
    }
    pub fn push_every() -> u32 {
        10
    }
    pub fn hetero_p() -> f64 {
        0.1
    }
}

/// A spec that cannot run, naming the field by its JSON path.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The text is not a spec: bad JSON, an unknown field or mode, a wrong
    /// type, a missing field.
    #[error(
        "training spec: {}: {message} (line {line}, column {column})",
        shown(path)
    )]
    Json {
        path: String,
        line: usize,
        column: usize,
        message: String,
    },
    /// A field's value breaks a rule.
    #[error("training spec: {field} = {value}: {rule}")]
    Invalid {
        field: String,
        value: String,
        rule: String,
    },
}

fn shown(path: &str) -> &str {
    if path.is_empty() {
        "(top level)"
    } else {
        path
    }
}

impl SpecError {
    /// The JSON path of the field at fault (empty: the whole spec).
    pub fn field(&self) -> &str {
        match self {
            SpecError::Json { path, .. } => path,
            SpecError::Invalid { field, .. } => field,
        }
    }
}

impl JobSpec {
    /// Parses a spec from JSON text (at most [`SPEC_BYTES_MAX`] bytes).
    /// Does not [`validate`](Self::validate).
    pub fn from_json(text: &str) -> Result<JobSpec, SpecError> {
        if text.len() > SPEC_BYTES_MAX {
            return Err(SpecError::Json {
                path: String::new(),
                line: 1,
                column: 1,
                message: format!(
                    "the spec is {} bytes, more than {SPEC_BYTES_MAX}",
                    text.len()
                ),
            });
        }
        serde_json::from_str(text).map_err(|e| SpecError::Json {
            path: path::at(text, e.line(), e.column()),
            line: e.line(),
            column: e.column(),
            message: hint(strip_position(&e.to_string())),
        })
    }
}

/// serde_json's message, with what to write where it says only what it
/// expected.
fn hint(m: String) -> String {
    if m.starts_with("invalid type: unit variant")
        || m.starts_with("invalid type: string") && m.contains("variant")
    {
        format!(
            "{m}; a choice (optimizer, sync, data) is an object keyed by its name, e.g. \
             {{\"sgd\": {{\"lr\": 0.1}}}} or {{\"allreduce\": {{}}}}"
        )
    } else {
        m
    }
}

/// serde_json's message without its " at line L column C" suffix (the
/// error carries them as fields).
fn strip_position(m: &str) -> String {
    match m.rfind(" at line ") {
        Some(i) => m[..i].to_string(),
        None => m.to_string(),
    }
}

#[cfg(test)]
mod tests;
