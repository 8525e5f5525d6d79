//! [`StageModel`]: a contiguous layer range `[first, end)` of a model that
//! trains per microbatch, for pipelined data-parallel training.
//!
//! * It holds the params its layers read (learnable ones and BatchNorm
//!   running statistics), built from the package's packed group bytes
//!   (half precision widened to f32), or from other stages' exported
//!   layers ([`PackedLayers`]) when the partition changes.
//! * [`StageModel::forward`] takes the boundary tensors of its first cut
//!   ([`super::boundary`](fn@super::boundary)) and returns those of its last, in training
//!   mode (BatchNorm batch statistics; running statistics updated as the
//!   forward runs, as PyTorch does), and keeps the microbatch's graph for
//!   its backward.
//! * [`StageModel::backward`] takes the gradients of its outputs (summed
//!   over every later stage that read them) and returns those of its
//!   inputs that are layer outputs; on the last stage
//!   [`StageModel::backward_from_loss`] starts from the loss against the
//!   target. Param gradients ACCUMULATE over an iteration's microbatches;
//!   [`StageModel::step`] applies SGD with their mean, then clears them.
//! * WEIGHT STASHING (PipeDream): a forward records the weight version it
//!   used (an immutable, shared set of tensors), and its backward
//!   differentiates with those weights even when a `step` came in between
//!   (1F1B runs several forwards ahead of their backwards); a version is
//!   freed when the last microbatch that used it finished its backward. At
//!   most [`STAGE_MICROBATCHES_IN_FLIGHT_MAX`] microbatches are in flight.
//!   The gradients are applied to the LATEST weights, as PipeDream does.

mod check;
mod run;
mod state;

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use distmind_models::{Manifest, Op};

use super::boundary::{check_graph, stage_io, StageIo};
use super::loss::LossKind;
use super::packed::{read_device, read_stored, PackedLayers};
use super::{layers, Precision, TrainError};
use crate::exec::{HostTensor, TensorData};
use check::ShapeCheck;

/// Most microbatches a stage keeps between their forward and their
/// backward (1F1B keeps at most the number of stages after it in flight;
/// PipeDream's deepest pipelines had 16 stages).
pub const STAGE_MICROBATCHES_IN_FLIGHT_MAX: usize = 32;
const _: () = assert!(STAGE_MICROBATCHES_IN_FLIGHT_MAX >= 2);

// A pipeline worker thread owns its stage.
const _: fn() = || {
    fn owned_by_a_thread<T: Send + Sync>() {}
    owned_by_a_thread::<StageModel>();
};

/// A boundary tensor as a stage takes it: a candle tensor (another stage's
/// output) or host memory (a model input, or bytes off the network).
#[derive(Debug, Clone)]
pub enum StageTensor {
    Candle(Tensor),
    Host(HostTensor),
}

impl From<Tensor> for StageTensor {
    fn from(t: Tensor) -> Self {
        StageTensor::Candle(t)
    }
}

impl From<HostTensor> for StageTensor {
    fn from(t: HostTensor) -> Self {
        StageTensor::Host(t)
    }
}

impl StageTensor {
    fn into_tensor(self) -> candle_core::Result<Tensor> {
        match self {
            StageTensor::Candle(t) => t.to_device(&Device::Cpu),
            StageTensor::Host(h) => match h.data {
                TensorData::F32(v) => Tensor::from_vec(v, h.shape, &Device::Cpu),
                TensorData::I64(v) => Tensor::from_vec(v, h.shape, &Device::Cpu),
            },
        }
    }
}

/// A stage's tensor in host memory, for the network: f32 (an f64 stage's
/// values rounded) or i64.
pub fn tensor_to_host(t: &Tensor) -> candle_core::Result<HostTensor> {
    let shape = t.dims().to_vec();
    let flat = t.flatten_all()?;
    match t.dtype() {
        DType::I64 => Ok(HostTensor::i64(shape, flat.to_vec1::<i64>()?)),
        _ => Ok(HostTensor::f32(
            shape,
            flat.to_dtype(DType::F32)?.to_vec1::<f32>()?,
        )),
    }
}

/// What [`StageModel::backward_from_loss`] gives.
#[derive(Debug, Clone)]
pub struct LossBackward {
    /// The microbatch's loss (mean over its samples), before any update.
    pub loss: f64,
    /// Gradients of the stage's inputs that are layer outputs (model
    /// inputs have none), in [`StageIo::inputs`] order.
    pub input_grads: Vec<(i64, Tensor)>,
}

/// What [`StageModel::step`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageStepReport {
    /// The weight version the step made (forwards from now on use it).
    pub version: u64,
    /// Microbatches whose gradients were averaged.
    pub microbatches: usize,
    /// Learnable params updated.
    pub params_updated: usize,
}

/// Where a stage param lives: the learnable weights (stashed per version)
/// or the running statistics (updated by forwards, never stashed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Learnable(usize),
    Stat(usize),
}

/// One version of the learnable weights: immutable once made; forwards
/// share it with the stage until a step or a load makes the next one.
#[derive(Debug)]
struct Weights {
    version: u64,
    /// Per learnable slot, a variable (gradients are tracked to it).
    values: Vec<Tensor>,
}

/// What a microbatch's backward needs from its forward.
struct InFlight {
    /// The weights its forward used (the stash).
    weights: Arc<Weights>,
    /// The inputs that are layer outputs, as the variables the graph read.
    inputs: Vec<(i64, Tensor)>,
    /// The stage's outputs, with their graph.
    outputs: Vec<(i64, Tensor)>,
}

/// A contiguous layer range of a model, training per microbatch. See the
/// module docs.
pub struct StageModel {
    manifest: Arc<Manifest>,
    layers: Range<usize>,
    precision: Precision,
    io: StageIo,
    loss: LossKind,
    /// Manifest indices of the stage's params, in packed order.
    params: Vec<usize>,
    /// Per stage param (as `params`): where its value lives.
    slots: Vec<Slot>,
    /// Per stage layer (`layer - first`): its params as positions in
    /// `params`, in the op's order.
    layer_params: Vec<Vec<usize>>,
    /// Per learnable slot, its position in `params`.
    learnable: Vec<usize>,
    /// Per stat slot, its position in `params`.
    stat_params: Vec<usize>,
    weights: Arc<Weights>,
    stats: Vec<Tensor>,
    /// Per learnable slot: the sum of the gradients since the last step.
    accum: Vec<Option<Tensor>>,
    accumulated: usize,
    momentum: Vec<Option<Tensor>>,
    in_flight: BTreeMap<u64, InFlight>,
    in_flight_limit: usize,
    /// Per tensor the stage reads: the last of its layers that reads it.
    last_use: HashMap<i64, usize>,
    shapes: ShapeCheck,
}

impl StageModel {
    /// The stage `layers` of `manifest`, its params read from `packed`,
    /// the whole model as the package stores it (groups at their offsets).
    pub fn new(
        manifest: &Manifest,
        layers: Range<usize>,
        packed: &[u8],
        precision: Precision,
    ) -> Result<Self, TrainError> {
        if (packed.len() as u64) < manifest.stored_bytes {
            return Err(TrainError::PackedSize {
                model: manifest.name.clone(),
                got: packed.len(),
                want: manifest.stored_bytes,
            });
        }
        StageModel::from_groups(
            manifest,
            layers,
            |g| {
                let e = manifest.groups.get(g)?;
                packed.get(e.offset as usize..(e.offset + e.bytes) as usize)
            },
            precision,
        )
    }

    /// The stage `layers`, its params read from the stored bytes of the
    /// groups its layers use (`group(g)`: group `g`'s whole padded bytes as
    /// the package stores them, f32 or half precision); other groups are
    /// never asked for.
    pub fn from_groups<'a>(
        manifest: &Manifest,
        layers: Range<usize>,
        group: impl Fn(usize) -> Option<&'a [u8]>,
        precision: Precision,
    ) -> Result<Self, TrainError> {
        StageModel::build(manifest, layers, precision, |p| {
            let e = &manifest.params[p];
            let bytes = group(e.group)
                .ok_or_else(|| format!("group {} (param {}) was not given", e.group, e.name))?;
            read_stored(manifest, e, bytes)
        })
    }

    /// The stage `layers`, its params from other stages' exported layers
    /// ([`StageModel::layer_params_packed`]): how a stage is rebuilt on the
    /// other side of a new cut. `parts` must hold every layer with params.
    pub fn from_layer_params(
        manifest: &Manifest,
        layers: Range<usize>,
        parts: &[PackedLayers],
        precision: Precision,
    ) -> Result<Self, TrainError> {
        if let Some(p) = parts.iter().find(|p| p.model != manifest.name) {
            return Err(TrainError::Stage {
                model: manifest.name.clone(),
                stage: layers,
                why: format!("params of layers {:?} are of model {}", p.layers, p.model),
            });
        }
        StageModel::build(manifest, layers, precision, |p| {
            let e = &manifest.params[p];
            let part = parts
                .iter()
                .find(|part| part.layers.contains(&e.layer))
                .ok_or_else(|| {
                    format!(
                        "no params were given for layer {} ({}), which holds {}",
                        e.layer, manifest.layers[e.layer].name, e.name
                    )
                })?;
            read_device(manifest, e, part)
        })
    }

    fn build(
        manifest: &Manifest,
        layers: Range<usize>,
        precision: Precision,
        mut values_of: impl FnMut(usize) -> Result<Vec<f32>, String>,
    ) -> Result<Self, TrainError> {
        let stage_err = |why: String| TrainError::Stage {
            model: manifest.name.clone(),
            stage: layers.clone(),
            why,
        };
        check_graph(manifest)?;
        let io = stage_io(manifest, layers.clone())?;
        let loss = LossKind::for_manifest(manifest)?;
        let by_name: HashMap<&str, usize> = manifest
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.as_str(), i))
            .collect();
        let mut params = Vec::new();
        let mut layer_param_ids = Vec::with_capacity(layers.len());
        for id in layers.clone() {
            let layer = &manifest.layers[id];
            let lerr = |why: String| {
                stage_err(format!(
                    "layer {id} ({}, {}): {why}",
                    layer.name,
                    layer.op.name()
                ))
            };
            if !layers::trainable(&layer.op) {
                return Err(lerr("op not supported in training".into()));
            }
            let mut ids = Vec::with_capacity(layer.params.len());
            for (k, name) in layer.params.iter().enumerate() {
                let &pi = by_name
                    .get(name.as_str())
                    .ok_or_else(|| lerr(format!("param {name} is not in the manifest")))?;
                let p = &manifest.params[pi];
                if p.layer != id {
                    return Err(lerr(format!(
                        "param {name} belongs to layer {}: a param must belong to the one \
                         layer that reads it",
                        p.layer
                    )));
                }
                let is_stat = matches!(layer.op, Op::BatchNorm { .. }) && k >= 2;
                if is_stat == p.learnable {
                    return Err(lerr(format!(
                        "param {name} is {}learnable, the op wants it {}",
                        if p.learnable { "" } else { "not " },
                        if is_stat {
                            "a running statistic"
                        } else {
                            "learnable"
                        }
                    )));
                }
                ids.push(pi);
                params.push(pi);
            }
            layer_param_ids.push(ids);
        }
        params.sort_unstable();
        let mut pos_of = HashMap::with_capacity(params.len());
        for (pos, &pi) in params.iter().enumerate() {
            if pos_of.insert(pi, pos).is_some() {
                return Err(stage_err(format!(
                    "param {} is read twice",
                    manifest.params[pi].name
                )));
            }
        }
        let layer_params = layer_param_ids
            .iter()
            .map(|ids| ids.iter().map(|pi| pos_of[pi]).collect())
            .collect();
        let dtype = precision.dtype();
        let (mut slots, mut learnable, mut stat_params) = (Vec::new(), Vec::new(), Vec::new());
        let (mut values, mut stats) = (Vec::new(), Vec::new());
        for (pos, &pi) in params.iter().enumerate() {
            let p = &manifest.params[pi];
            let data = values_of(pi).map_err(&stage_err)?;
            let t = Tensor::from_vec(data, p.shape.as_slice(), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .map_err(|e| stage_err(format!("param {}: {e}", p.name)))?;
            if p.learnable {
                slots.push(Slot::Learnable(learnable.len()));
                learnable.push(pos);
                values.push(variable(&t).map_err(|e| stage_err(e.to_string()))?);
            } else {
                slots.push(Slot::Stat(stat_params.len()));
                stat_params.push(pos);
                stats.push(t);
            }
        }
        let mut last_use = HashMap::new();
        for id in layers.clone() {
            for &r in &manifest.layers[id].inputs {
                last_use.insert(r, id);
            }
        }
        let shapes = ShapeCheck::new(manifest, &io.inputs).map_err(&stage_err)?;
        let n = learnable.len();
        Ok(StageModel {
            manifest: Arc::new(manifest.clone()),
            layers,
            precision,
            io,
            loss,
            params,
            slots,
            layer_params,
            learnable,
            stat_params,
            weights: Arc::new(Weights { version: 0, values }),
            stats,
            accum: vec![None; n],
            accumulated: 0,
            momentum: vec![None; n],
            in_flight: BTreeMap::new(),
            in_flight_limit: STAGE_MICROBATCHES_IN_FLIGHT_MAX,
            last_use,
            shapes,
        })
    }

    pub fn model(&self) -> &str {
        &self.manifest.name
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// `[first, end)`.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    pub fn io(&self) -> &StageIo {
        &self.io
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    pub fn loss_kind(&self) -> LossKind {
        self.loss
    }

    /// Whether the stage ends with the model's last layer (and so holds
    /// the loss).
    pub fn is_last(&self) -> bool {
        self.layers.end == self.manifest.layers.len()
    }

    /// The current weight version: 0 when built, one more per step or load.
    pub fn version(&self) -> u64 {
        self.weights.version
    }

    /// Microbatches forwarded and not yet backwarded.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The weight version microbatch `mb`'s forward used, while in flight.
    pub fn in_flight_version(&self, mb: u64) -> Option<u64> {
        self.in_flight.get(&mb).map(|f| f.weights.version)
    }

    /// Lowers (or restores) the in-flight bound, `1..=`
    /// [`STAGE_MICROBATCHES_IN_FLIGHT_MAX`].
    pub fn set_in_flight_limit(&mut self, limit: usize) -> Result<(), TrainError> {
        if limit == 0 || limit > STAGE_MICROBATCHES_IN_FLIGHT_MAX {
            return Err(self.stage_err(format!(
                "in-flight limit {limit} is outside 1..={STAGE_MICROBATCHES_IN_FLIGHT_MAX}"
            )));
        }
        self.in_flight_limit = limit;
        Ok(())
    }

    /// Drops microbatch `mb`'s forward without a backward (a failed
    /// iteration); whether it was in flight.
    pub fn discard(&mut self, mb: u64) -> bool {
        self.in_flight.remove(&mb).is_some()
    }

    /// Microbatches whose gradients accumulated since the last step.
    pub fn accumulated(&self) -> usize {
        self.accumulated
    }

    fn stage_err(&self, why: String) -> TrainError {
        TrainError::Stage {
            model: self.manifest.name.clone(),
            stage: self.layers.clone(),
            why,
        }
    }

    fn batch_err(&self, mb: u64, why: String) -> TrainError {
        TrainError::StageBatch {
            model: self.manifest.name.clone(),
            stage: self.layers.clone(),
            mb,
            why,
        }
    }

    fn layer_err(&self, mb: u64, id: usize, why: String) -> TrainError {
        let layer = &self.manifest.layers[id];
        TrainError::StageLayer {
            model: self.manifest.name.clone(),
            stage: self.layers.clone(),
            mb,
            layer: id,
            name: layer.name.clone(),
            op: layer.op.name(),
            why,
        }
    }
}

/// A fresh variable holding `t`'s values (gradients are tracked to it).
fn variable(t: &Tensor) -> candle_core::Result<Tensor> {
    Ok(Var::from_tensor(&t.detach())?.as_tensor().clone())
}
