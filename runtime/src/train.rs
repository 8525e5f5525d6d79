//! Training: one SGD step of a CNN package on the CPU, in the packed layout.
//!
//! The original's `resnet152_train` runs one SGD step per training request;
//! [`sgd_step`] is that step on the host: it builds the manifest's layer graph
//! with candle's differentiable ops in TRAINING mode, takes the softmax
//! cross-entropy of the logits (the last manifest output, `[N, classes]`)
//! against the labels, back-propagates, and writes the updated learnable
//! params and the BatchNorm running statistics back into the packed bytes
//! (little-endian f32 at `groups[p.group].offset + p.offset`), so the result
//! can go back to the host cache, or to the memory servers group by group
//! ([`changed_groups`] names the groups to write back).
//!
//! Training-mode semantics are PyTorch's `model.train()`:
//! * `batch_norm` normalises with the batch statistics (mean and BIASED
//!   variance over N, H, W per channel) and updates
//!   `running = (1 - 0.1) running + 0.1 batch` with the UNBIASED batch
//!   variance; fewer than 2 values per channel is an error, as in PyTorch.
//! * No dropout in these graphs.
//! * SGD as `torch.optim.SGD` (no dampening, no Nesterov):
//!   `g = grad + wd p`; with momentum `buf = m buf + g` (`buf = g` on the
//!   first step) and `g = buf`; `p -= lr g`. Weight decay applies to every
//!   learnable param, BatchNorm's gamma and beta included (PyTorch's default).
//!
//! Ops: `conv2d`, `batch_norm`, `relu`, `max_pool2d` and `avg_pool2d` (any
//! padding, exact -inf / zero padding and PyTorch's `count_include_pad` and
//! `ceil_mode` rules, with their own backward), `adaptive_avg_pool2d` to
//! `[1, 1]`, `add`, `concat`, `flatten`, `linear`, `tanh`: ResNet,
//! Inception-v3 and DenseNet train. The transformer ops (`embedding`,
//! `layer_norm`, `gelu`, `attention`, `select`) are rejected with the layer
//! named, and so are models whose last output is not `[N, classes]` logits.
//!
//! The step runs in f32 ([`Precision::F32`]); [`loss_and_gradients`] and
//! [`training_loss`] can run the same graph in f64 for gradient checks.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, Var, WithDType};
use distmind_models::{Dtype, Manifest, Op, ParamEntry};

use crate::exec::{HostTensor, TensorData};

/// BatchNorm's running-statistics momentum (PyTorch's default).
pub const BN_MOMENTUM: f64 = 0.1;

/// `torch.optim.SGD`'s hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    pub lr: f32,
    /// 0 = plain SGD. Momentum buffers live in an [`SgdState`]; [`sgd_step`]
    /// starts from empty buffers, which makes one step plain SGD.
    pub momentum: f32,
    pub weight_decay: f32,
}

impl Default for SgdConfig {
    /// torchvision's ImageNet recipe: lr 0.1, momentum 0.9, weight decay 1e-4.
    fn default() -> Self {
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 1e-4,
        }
    }
}

/// What persists between steps: momentum buffers, by param name.
#[derive(Debug, Clone, Default)]
pub struct SgdState {
    momentum: HashMap<String, Vec<f32>>,
}

impl SgdState {
    pub fn new() -> Self {
        SgdState::default()
    }

    /// Number of params holding a momentum buffer.
    pub fn buffers(&self) -> usize {
        self.momentum.len()
    }
}

/// What one step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Mean cross-entropy over the batch, before the update.
    pub loss: f32,
    pub batch: usize,
    /// Wall time of the whole step.
    pub elapsed: Duration,
    /// Building the graph and the forward pass (params read from `packed`).
    pub forward: Duration,
    pub backward: Duration,
    /// SGD update and writing back params and running statistics.
    pub update: Duration,
    /// Learnable params written back.
    pub params_updated: usize,
    /// BatchNorm running statistics written back (2 per BatchNorm layer).
    pub stats_updated: usize,
}

/// Arithmetic of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    F64,
}

impl Precision {
    fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F64 => DType::F64,
        }
    }
}

/// Loss, gradients and new running statistics of one forward/backward.
#[derive(Debug, Clone)]
pub struct Gradients {
    pub loss: f64,
    /// d loss / d param, per learnable param name (row-major, the param's shape).
    pub grads: HashMap<String, Vec<f64>>,
    /// Updated running statistics (`running_mean`, `running_var`), by name.
    pub running: HashMap<String, Vec<f64>>,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    #[error("model {model} layer {layer} ({name}, {op}): {why}")]
    Layer {
        model: String,
        layer: usize,
        name: String,
        op: String,
        why: String,
    },
    #[error("model {model}: {why}")]
    Model { model: String, why: String },
    #[error("model {model}: bad training batch: {why}")]
    BadBatch { model: String, why: String },
    #[error("model {model}: packed buffer of {got} bytes, the model stores {want}")]
    PackedSize {
        model: String,
        got: usize,
        want: u64,
    },
    #[error("model {model}: backward pass failed: {why}")]
    Backward { model: String, why: String },
}

/// One SGD step in place on `packed` (the whole model in the packed layout),
/// from empty momentum buffers. See the module docs for the semantics.
pub fn sgd_step(
    manifest: &Manifest,
    packed: &mut [u8],
    images: &HostTensor,
    labels: &[i64],
    cfg: &SgdConfig,
) -> Result<StepReport, TrainError> {
    sgd_step_with_state(manifest, packed, images, labels, cfg, &mut SgdState::new())
}

/// [`sgd_step`] carrying momentum buffers in `state` across steps.
pub fn sgd_step_with_state(
    manifest: &Manifest,
    packed: &mut [u8],
    images: &HostTensor,
    labels: &[i64],
    cfg: &SgdConfig,
    state: &mut SgdState,
) -> Result<StepReport, TrainError> {
    let start = Instant::now();
    let fwd = forward(manifest, packed, images, labels, Precision::F32, true)?;
    let forward_time = start.elapsed();
    let t = Instant::now();
    let loss = scalar(&fwd.loss).map_err(|e| model_err(manifest, format!("loss: {e}")))?;
    let grads = fwd.loss.backward().map_err(|e| TrainError::Backward {
        model: manifest.name.clone(),
        why: e.to_string(),
    })?;
    let backward_time = t.elapsed();
    let t = Instant::now();
    let mut params_updated = 0;
    for (i, var) in &fwd.vars {
        let p = &manifest.params[*i];
        let mut values = read_param(manifest, packed, p)?;
        let grad = match grads.get(var.as_tensor()) {
            Some(g) => to_f32_vec(g).map_err(|e| model_err(manifest, e.to_string()))?,
            None => vec![0.0; values.len()],
        };
        if grad.len() != values.len() {
            return Err(model_err(
                manifest,
                format!("gradient of {} has {} values", p.name, grad.len()),
            ));
        }
        let mut step: Vec<f32> = grad
            .iter()
            .zip(&values)
            .map(|(g, v)| g + cfg.weight_decay * v)
            .collect();
        if cfg.momentum != 0.0 {
            match state.momentum.get_mut(&p.name) {
                Some(buf) if buf.len() == step.len() => {
                    for (b, s) in buf.iter_mut().zip(&mut step) {
                        *b = cfg.momentum * *b + *s;
                        *s = *b;
                    }
                }
                _ => {
                    state.momentum.insert(p.name.clone(), step.clone());
                }
            }
        }
        for (v, s) in values.iter_mut().zip(&step) {
            *v -= cfg.lr * s;
        }
        write_param(manifest, packed, p, values.iter().map(|&v| v as f64))?;
        params_updated += 1;
    }
    for (i, values) in &fwd.running {
        write_param(
            manifest,
            packed,
            &manifest.params[*i],
            values.iter().copied(),
        )?;
    }
    Ok(StepReport {
        loss: loss as f32,
        batch: labels.len(),
        elapsed: start.elapsed(),
        forward: forward_time,
        backward: backward_time,
        update: t.elapsed(),
        params_updated,
        stats_updated: fwd.running.len(),
    })
}

/// The training-mode loss and the gradient of every learnable param, without
/// changing `packed`.
pub fn loss_and_gradients(
    manifest: &Manifest,
    packed: &[u8],
    images: &HostTensor,
    labels: &[i64],
    precision: Precision,
) -> Result<Gradients, TrainError> {
    let fwd = forward(manifest, packed, images, labels, precision, true)?;
    let loss = scalar(&fwd.loss).map_err(|e| model_err(manifest, format!("loss: {e}")))?;
    let store = fwd.loss.backward().map_err(|e| TrainError::Backward {
        model: manifest.name.clone(),
        why: e.to_string(),
    })?;
    let mut grads = HashMap::new();
    for (i, var) in &fwd.vars {
        let p = &manifest.params[*i];
        let g = match store.get(var.as_tensor()) {
            Some(g) => to_f64_vec(g).map_err(|e| model_err(manifest, e.to_string()))?,
            None => vec![0.0; p.shape.iter().product()],
        };
        grads.insert(p.name.clone(), g);
    }
    let running = fwd
        .running
        .into_iter()
        .map(|(i, v)| (manifest.params[i].name.clone(), v))
        .collect();
    Ok(Gradients {
        loss,
        grads,
        running,
    })
}

/// The training-mode loss (batch statistics in BatchNorm) only.
pub fn training_loss(
    manifest: &Manifest,
    packed: &[u8],
    images: &HostTensor,
    labels: &[i64],
    precision: Precision,
) -> Result<f64, TrainError> {
    let fwd = forward(manifest, packed, images, labels, precision, false)?;
    scalar(&fwd.loss).map_err(|e| model_err(manifest, format!("loss: {e}")))
}

/// The groups whose bytes differ between `before` and `after` (both the
/// whole model in the packed layout): the ones to write back.
pub fn changed_groups(before: &[u8], after: &[u8], manifest: &Manifest) -> Vec<usize> {
    manifest
        .groups
        .iter()
        .filter(|g| {
            let r = g.offset as usize..(g.offset + g.bytes) as usize;
            before.get(r.clone()) != after.get(r)
        })
        .map(|g| g.index)
        .collect()
}

/// Checks that every layer's op can be trained here; names the first that
/// cannot. The packed bytes a step updates are f32: a package that stores
/// half precision is refused (training would write the weights back in a
/// dtype the optimizer does not keep).
pub fn check_trainable(manifest: &Manifest) -> Result<(), TrainError> {
    if manifest.param_dtype.is_half() {
        return Err(model_err(
            manifest,
            format!(
                "its parameters are stored as {}; training updates f32 parameters (import \
                 the checkpoint with --widen, or generate it with --dtype f32)",
                manifest.param_dtype
            ),
        ));
    }
    for layer in &manifest.layers {
        if !trainable_op(&layer.op) {
            return Err(TrainError::Layer {
                model: manifest.name.clone(),
                layer: layer.id,
                name: layer.name.clone(),
                op: layer.op.name().into(),
                why: "op not supported in training".into(),
            });
        }
    }
    Ok(())
}

fn trainable_op(op: &Op) -> bool {
    match *op {
        Op::Conv2d { .. }
        | Op::BatchNorm { .. }
        | Op::Relu
        | Op::MaxPool2d { .. }
        | Op::AvgPool2d { .. }
        | Op::Add
        | Op::Concat { .. }
        | Op::Flatten { .. }
        | Op::Linear { .. }
        | Op::Tanh => true,
        Op::AdaptiveAvgPool2d { output_size } => output_size == [1, 1],
        _ => false,
    }
}

fn model_err(manifest: &Manifest, why: String) -> TrainError {
    TrainError::Model {
        model: manifest.name.clone(),
        why,
    }
}

fn scalar(t: &Tensor) -> candle_core::Result<f64> {
    t.to_dtype(DType::F64)?.to_scalar::<f64>()
}

fn to_f32_vec(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

fn to_f64_vec(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()
}

/// Byte range of `p` in the whole packed model.
fn param_range(
    manifest: &Manifest,
    len: usize,
    p: &ParamEntry,
) -> Result<std::ops::Range<usize>, TrainError> {
    let g = manifest
        .groups
        .get(p.group)
        .ok_or_else(|| model_err(manifest, format!("param {} in missing group", p.name)))?;
    let start = g.offset + p.offset;
    let end = start + p.nbytes;
    if p.offset + p.nbytes > g.bytes || end > len as u64 {
        return Err(model_err(
            manifest,
            format!("param {} overruns its group or the buffer", p.name),
        ));
    }
    Ok(start as usize..end as usize)
}

fn read_param(manifest: &Manifest, packed: &[u8], p: &ParamEntry) -> Result<Vec<f32>, TrainError> {
    let r = param_range(manifest, packed.len(), p)?;
    Ok(packed[r]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

fn write_param(
    manifest: &Manifest,
    packed: &mut [u8],
    p: &ParamEntry,
    values: impl Iterator<Item = f64>,
) -> Result<(), TrainError> {
    let r = param_range(manifest, packed.len(), p)?;
    let mut n = 0;
    for (dst, v) in packed[r.clone()].chunks_exact_mut(4).zip(values) {
        dst.copy_from_slice(&(v as f32).to_le_bytes());
        n += 1;
    }
    if n * 4 != r.len() {
        return Err(model_err(
            manifest,
            format!("wrote {n} values into param {}", p.name),
        ));
    }
    Ok(())
}

/// The graph after the forward pass.
struct Forward {
    loss: Tensor,
    /// (manifest param index, its variable) for every learnable param.
    vars: Vec<(usize, Var)>,
    /// (manifest param index, new values) for every running statistic.
    running: Vec<(usize, Vec<f64>)>,
}

fn forward(
    manifest: &Manifest,
    packed: &[u8],
    images: &HostTensor,
    labels: &[i64],
    precision: Precision,
    track: bool,
) -> Result<Forward, TrainError> {
    let name = &manifest.name;
    check_trainable(manifest)?;
    if (packed.len() as u64) < manifest.stored_bytes {
        return Err(TrainError::PackedSize {
            model: name.clone(),
            got: packed.len(),
            want: manifest.stored_bytes,
        });
    }
    let bad_batch = |why: String| TrainError::BadBatch {
        model: name.clone(),
        why,
    };
    let [spec] = manifest.inputs.as_slice() else {
        return Err(model_err(
            manifest,
            format!(
                "has {} inputs; training takes one image input",
                manifest.inputs.len()
            ),
        ));
    };
    let TensorData::F32(pixels) = &images.data else {
        return Err(bad_batch(format!(
            "images are {}, expected f32",
            images.describe()
        )));
    };
    let shape_ok = spec.dtype == Dtype::F32
        && images.shape.len() == spec.shape.len()
        && images.shape.iter().skip(1).eq(spec.shape.iter().skip(1))
        && images.shape.first().is_some_and(|&n| n >= 1);
    if !shape_ok {
        return Err(bad_batch(format!(
            "images are {}, the model takes {:?} {:?} (any batch size)",
            images.describe(),
            spec.dtype,
            spec.shape
        )));
    }
    let n = images.shape[0];
    if labels.len() != n {
        return Err(bad_batch(format!("{} labels for {n} images", labels.len())));
    }
    let Some(out_spec) = manifest.outputs.last() else {
        return Err(model_err(manifest, "has no outputs".into()));
    };
    let classes = match out_spec.shape.as_slice() {
        [_, k] if *k > 0 => *k,
        s => {
            return Err(model_err(
                manifest,
                format!(
                    "last output {} has shape {s:?}; training wants [N, classes] logits",
                    out_spec.name
                ),
            ))
        }
    };
    if let Some(bad) = labels.iter().find(|&&l| l < 0 || l as usize >= classes) {
        return Err(bad_batch(format!("label {bad} outside 0..{classes}")));
    }
    let dtype = precision.dtype();
    let dev = Device::Cpu;
    let by_name: HashMap<&str, usize> = manifest
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    let x0 = Tensor::from_slice(pixels, images.shape.as_slice(), &dev)
        .and_then(|t| t.to_dtype(dtype))
        .map_err(|e| bad_batch(e.to_string()))?;
    let layers = &manifest.layers;
    // Last reader of every activation, so values can be dropped early.
    let mut last_use: Vec<usize> = (0..layers.len()).collect();
    for l in layers {
        for &i in &l.inputs {
            if i >= 0 && (i as usize) < layers.len() {
                last_use[i as usize] = last_use[i as usize].max(l.id);
            }
        }
    }
    last_use[out_spec.layer.min(layers.len().saturating_sub(1))] = usize::MAX;
    let mut values: Vec<Option<Tensor>> = vec![None; layers.len()];
    let mut vars = Vec::new();
    let mut running = Vec::new();
    for (id, layer) in layers.iter().enumerate() {
        let err = |why: String| TrainError::Layer {
            model: name.clone(),
            layer: id,
            name: layer.name.clone(),
            op: layer.op.name().into(),
            why,
        };
        if layer.id != id {
            return Err(err(format!("has id {} at position {id}", layer.id)));
        }
        let mut args = Vec::with_capacity(layer.inputs.len());
        for &i in &layer.inputs {
            let t = if i == -1 {
                x0.clone()
            } else if i >= 0 && (i as usize) < id {
                values[i as usize]
                    .clone()
                    .ok_or_else(|| err(format!("input {i} was already freed")))?
            } else {
                return Err(err(format!(
                    "reads {i}, which is neither an earlier layer nor the model input"
                )));
            };
            args.push(t);
        }
        // The layer's params: learnable ones as variables, statistics as values.
        let mut params = Vec::with_capacity(layer.params.len());
        for pname in &layer.params {
            let &pi = by_name
                .get(pname.as_str())
                .ok_or_else(|| err(format!("param {pname} is not in the manifest")))?;
            let p = &manifest.params[pi];
            let data = read_param(manifest, packed, p)?;
            let t = Tensor::from_vec(data, p.shape.as_slice(), &dev)
                .and_then(|t| t.to_dtype(dtype))
                .map_err(|e| err(format!("param {pname}: {e}")))?;
            let t = if p.learnable && track {
                let v = Var::from_tensor(&t).map_err(|e| err(e.to_string()))?;
                let t = v.as_tensor().clone();
                vars.push((pi, v));
                t
            } else {
                t
            };
            params.push((pi, t));
        }
        let out = apply(manifest, &layer.op, &args, &params, &mut running)
            .map_err(|e| err(e.to_string()))?;
        values[id] = Some(out);
        for &i in &layer.inputs {
            if i >= 0 && last_use[i as usize] == id {
                values[i as usize] = None;
            }
        }
    }
    let logits = values
        .get(out_spec.layer)
        .cloned()
        .flatten()
        .ok_or_else(|| model_err(manifest, "the logits layer produced nothing".into()))?;
    if logits.dims() != [n, classes] {
        return Err(model_err(
            manifest,
            format!(
                "logits have shape {:?}, expected [{n}, {classes}]",
                logits.dims()
            ),
        ));
    }
    let loss = cross_entropy(&logits, labels, classes)
        .map_err(|e| model_err(manifest, format!("cross-entropy: {e}")))?;
    Ok(Forward {
        loss,
        vars,
        running,
    })
}

/// Mean softmax cross-entropy of `logits` `[N, K]` against class ids.
fn cross_entropy(logits: &Tensor, labels: &[i64], classes: usize) -> candle_core::Result<Tensor> {
    let n = labels.len();
    let max = logits.max_keepdim(1)?.detach();
    let z = logits.broadcast_sub(&max)?;
    let lse = z.exp()?.sum_keepdim(1)?.log()?;
    let logp = z.broadcast_sub(&lse)?;
    let mut onehot = vec![0f64; n * classes];
    for (row, &l) in labels.iter().enumerate() {
        onehot[row * classes + l as usize] = 1.0;
    }
    let onehot =
        Tensor::from_vec(onehot, (n, classes), logits.device())?.to_dtype(logits.dtype())?;
    (logp * onehot)?.sum_all()?.affine(-1.0 / n as f64, 0.0)
}

/// One layer in training mode. `params` are (manifest index, tensor) in op order.
fn apply(
    manifest: &Manifest,
    op: &Op,
    args: &[Tensor],
    params: &[(usize, Tensor)],
    running: &mut Vec<(usize, Vec<f64>)>,
) -> candle_core::Result<Tensor> {
    use candle_core::bail;
    let one = || -> candle_core::Result<&Tensor> {
        if args.len() != 1 {
            bail!("has {} inputs, the op wants 1", args.len());
        }
        Ok(&args[0])
    };
    let want_params = |k: usize| -> candle_core::Result<()> {
        if params.len() != k {
            bail!("has {} params, the op wants {k}", params.len());
        }
        Ok(())
    };
    let shape = |i: usize, want: &[usize]| -> candle_core::Result<()> {
        let got = params[i].1.dims();
        if got != want {
            bail!(
                "param {} has shape {got:?}, the op wants {want:?}",
                manifest.params[params[i].0].name
            );
        }
        Ok(())
    };
    match *op {
        Op::Conv2d {
            in_channels,
            out_channels,
            kernel,
            stride,
            padding,
            bias,
        } => {
            want_params(1 + usize::from(bias))?;
            shape(0, &[out_channels, in_channels, kernel[0], kernel[1]])?;
            let x = one()?;
            let (_, c, h, w) = x.dims4()?;
            if c != in_channels {
                bail!("input has {c} channels, the op wants {in_channels}");
            }
            if h + 2 * padding[0] < kernel[0] || w + 2 * padding[1] < kernel[1] {
                bail!("input {h}x{w} with padding {padding:?} is smaller than the kernel");
            }
            if stride[0] == 0 || stride[1] == 0 {
                bail!("stride {stride:?} must be positive");
            }
            let weight = &params[0].1;
            let out = if padding[0] == padding[1] && stride[0] == stride[1] {
                x.conv2d(weight, padding[0], stride[0], 1, 1)?
            } else {
                let padded = x
                    .pad_with_zeros(2, padding[0], padding[0])?
                    .pad_with_zeros(3, padding[1], padding[1])?;
                if stride[0] == stride[1] {
                    padded.conv2d(weight, 0, stride[0], 1, 1)?
                } else {
                    let full = padded.conv2d(weight, 0, 1, 1, 1)?;
                    subsample(&subsample(&full, 2, stride[0])?, 3, stride[1])?
                }
            };
            if bias {
                shape(1, &[out_channels])?;
                out.broadcast_add(&params[1].1.reshape((1, out_channels, 1, 1))?)
            } else {
                Ok(out)
            }
        }
        Op::BatchNorm { num_features, eps } => {
            want_params(4)?;
            for i in 0..4 {
                shape(i, &[num_features])?;
            }
            for (pi, _) in &params[2..4] {
                if manifest.params[*pi].learnable {
                    bail!(
                        "running statistic {} is marked learnable",
                        manifest.params[*pi].name
                    );
                }
            }
            let x = one()?;
            let dims = x.dims().to_vec();
            if dims.len() < 2 || dims[1] != num_features {
                bail!("input of shape {dims:?} does not have {num_features} channels in dim 1");
            }
            let count: usize = dims
                .iter()
                .enumerate()
                .filter(|(d, _)| *d != 1)
                .map(|(_, s)| s)
                .product();
            if count < 2 {
                bail!(
                    "expected more than 1 value per channel when training, got input of shape {dims:?}"
                );
            }
            let reduce: Vec<usize> = (0..dims.len()).filter(|&d| d != 1).collect();
            let mut bshape = vec![1usize; dims.len()];
            bshape[1] = num_features;
            let mean = x.mean_keepdim(reduce.as_slice())?;
            let xc = x.broadcast_sub(&mean)?;
            let var = xc.sqr()?.mean_keepdim(reduce.as_slice())?;
            let inv_std = var.affine(1.0, eps)?.sqrt()?.recip()?;
            let scale = inv_std.broadcast_mul(&params[0].1.reshape(bshape.as_slice())?)?;
            let y = xc
                .broadcast_mul(&scale)?
                .broadcast_add(&params[1].1.reshape(bshape.as_slice())?)?;
            // Running statistics, from the detached batch statistics.
            let batch_mean = to_f64_vec(&mean.detach())?;
            let batch_var = to_f64_vec(&var.detach())?;
            let old_mean = to_f64_vec(&params[2].1)?;
            let old_var = to_f64_vec(&params[3].1)?;
            let unbias = count as f64 / (count - 1) as f64;
            let m = BN_MOMENTUM;
            running.push((
                params[2].0,
                old_mean
                    .iter()
                    .zip(&batch_mean)
                    .map(|(o, b)| (1.0 - m) * o + m * b)
                    .collect(),
            ));
            running.push((
                params[3].0,
                old_var
                    .iter()
                    .zip(&batch_var)
                    .map(|(o, b)| (1.0 - m) * o + m * b * unbias)
                    .collect(),
            ));
            Ok(y)
        }
        Op::Relu => {
            want_params(0)?;
            one()?.relu()
        }
        Op::Tanh => {
            want_params(0)?;
            one()?.tanh()
        }
        Op::MaxPool2d {
            kernel,
            stride,
            padding,
            ceil_mode,
        } => {
            want_params(0)?;
            let pool = Pool2d {
                max: true,
                kernel,
                stride,
                padding,
                ceil_mode,
                count_include_pad: false,
            };
            pool.geometry(one()?.dims())?;
            one()?.contiguous()?.apply_op1(pool)
        }
        Op::AvgPool2d {
            kernel,
            stride,
            padding,
            ceil_mode,
            count_include_pad,
        } => {
            want_params(0)?;
            let pool = Pool2d {
                max: false,
                kernel,
                stride,
                padding,
                ceil_mode,
                count_include_pad,
            };
            pool.geometry(one()?.dims())?;
            one()?.contiguous()?.apply_op1(pool)
        }
        Op::AdaptiveAvgPool2d { output_size } => {
            want_params(0)?;
            if output_size != [1, 1] {
                bail!("only output_size [1, 1] is supported in training, got {output_size:?}");
            }
            let x = one()?;
            x.dims4()?;
            x.mean_keepdim((2, 3))
        }
        Op::Add => {
            want_params(0)?;
            if args.len() != 2 {
                bail!("has {} inputs, the op wants 2", args.len());
            }
            if args[0].dims() != args[1].dims() {
                bail!(
                    "adds {:?} and {:?}: shapes must be equal",
                    args[0].dims(),
                    args[1].dims()
                );
            }
            args[0].add(&args[1])
        }
        Op::Concat { dim } => {
            want_params(0)?;
            let Some(first) = args.first() else {
                bail!("concatenates no inputs");
            };
            for a in args {
                let same = a.rank() == first.rank()
                    && dim < a.rank()
                    && a.dims()
                        .iter()
                        .zip(first.dims())
                        .enumerate()
                        .all(|(d, (x, y))| d == dim || x == y);
                if !same {
                    let shapes: Vec<_> = args.iter().map(|a| a.dims().to_vec()).collect();
                    bail!("cannot concatenate shapes {shapes:?} along dim {dim}");
                }
            }
            Tensor::cat(args, dim)
        }
        Op::Flatten { start_dim } => {
            want_params(0)?;
            let x = one()?;
            if start_dim >= x.rank() {
                bail!(
                    "flattens from dim {start_dim} a tensor of shape {:?}",
                    x.dims()
                );
            }
            x.flatten_from(start_dim)
        }
        Op::Linear {
            in_features,
            out_features,
            bias,
            transposed,
        } => {
            want_params(1 + usize::from(bias))?;
            let x = one()?;
            let dims = x.dims().to_vec();
            if dims.last() != Some(&in_features) {
                bail!("input of shape {dims:?} does not end in {in_features} features");
            }
            let weight_t = if transposed {
                shape(0, &[in_features, out_features])?;
                params[0].1.clone()
            } else {
                shape(0, &[out_features, in_features])?;
                params[0].1.t()?
            };
            let rows = x.elem_count() / in_features;
            let mut y = x.reshape((rows, in_features))?.matmul(&weight_t)?;
            if bias {
                shape(1, &[out_features])?;
                y = y.broadcast_add(&params[1].1)?;
            }
            let mut out_dims = dims;
            *out_dims.last_mut().expect("non-empty") = out_features;
            y.reshape(out_dims)
        }
        ref other => bail!("op {} is not supported in training", other.name()),
    }
}

/// Every `step`-th index of `dim`, from 0 (differentiable: index_select).
fn subsample(x: &Tensor, dim: usize, step: usize) -> candle_core::Result<Tensor> {
    if step == 1 {
        return Ok(x.clone());
    }
    let len = x.dims()[dim];
    let ids: Vec<u32> = (0..len).step_by(step).map(|i| i as u32).collect();
    let ids = Tensor::from_vec(ids, len.div_ceil(step), x.device())?;
    x.index_select(&ids, dim)
}

/// PyTorch's pooled length, `ceil_mode` rule included.
fn pool_out_len(
    len: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    ceil_mode: bool,
) -> candle_core::Result<usize> {
    if kernel == 0 || stride == 0 {
        candle_core::bail!("kernel {kernel} and stride {stride} must be positive");
    }
    if pad > kernel / 2 {
        candle_core::bail!("padding {pad} exceeds half the kernel {kernel}");
    }
    let Some(span) = (len + 2 * pad).checked_sub(kernel) else {
        candle_core::bail!(
            "input length {len} with padding {pad} is smaller than the kernel {kernel}"
        );
    };
    let mut out = if ceil_mode {
        span.div_ceil(stride) + 1
    } else {
        span / stride + 1
    };
    if ceil_mode && (out - 1) * stride >= len + pad {
        out -= 1;
    }
    Ok(out)
}

/// Max or average pooling over NCHW with PyTorch's padding rules, as a
/// candle op with its own backward: max pads with -inf and routes the
/// gradient to the first maximum of each window (PyTorch's argmax); average
/// divides by the padded window (`count_include_pad`) or the in-bounds count.
#[derive(Debug, Clone, Copy)]
struct Pool2d {
    max: bool,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    ceil_mode: bool,
    count_include_pad: bool,
}

/// `(n * c planes, h, w, oh, ow)`.
type Geometry = (usize, usize, usize, usize, usize);

impl Pool2d {
    fn geometry(&self, dims: &[usize]) -> candle_core::Result<Geometry> {
        let &[n, c, h, w] = dims else {
            candle_core::bail!("pooling wants an NCHW input, got shape {dims:?}");
        };
        let oh = pool_out_len(
            h,
            self.kernel[0],
            self.stride[0],
            self.padding[0],
            self.ceil_mode,
        )?;
        let ow = pool_out_len(
            w,
            self.kernel[1],
            self.stride[1],
            self.padding[1],
            self.ceil_mode,
        )?;
        Ok((n * c, h, w, oh, ow))
    }

    /// Window `o` along axis `a` (0 = rows): in-bounds range and padded length.
    fn window(&self, a: usize, o: usize, len: usize) -> (std::ops::Range<usize>, usize) {
        let pad = self.padding[a] as isize;
        let start = (o * self.stride[a]) as isize - pad;
        let end = (start + self.kernel[a] as isize).min(len as isize + pad);
        let padded = (end - start).max(0) as usize;
        let lo = start.max(0) as usize;
        let hi = (end.max(0) as usize).min(len);
        (lo..hi.max(lo), padded)
    }

    /// Calls `f(output index, plane offset, rows, cols, divisor)` per output.
    fn for_each(
        &self,
        (planes, h, w, oh, ow): Geometry,
        mut f: impl FnMut(usize, usize, std::ops::Range<usize>, std::ops::Range<usize>, usize),
    ) {
        for plane in 0..planes {
            for oy in 0..oh {
                let (rows, ph) = self.window(0, oy, h);
                for ox in 0..ow {
                    let (cols, pw) = self.window(1, ox, w);
                    let divisor = if self.count_include_pad {
                        ph * pw
                    } else {
                        rows.len() * cols.len()
                    };
                    f(
                        (plane * oh + oy) * ow + ox,
                        plane * h * w,
                        rows.clone(),
                        cols,
                        divisor,
                    );
                }
            }
        }
    }

    /// Index (in `src`) of the first maximum of a window; NaN wins. `None`
    /// for a window entirely in the padding.
    fn argmax<T: WithDType>(
        src: &[T],
        base: usize,
        w: usize,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Option<usize> {
        let mut best: Option<(T, usize)> = None;
        for y in rows {
            for x in cols.clone() {
                let i = base + y * w + x;
                let v = src[i];
                match best {
                    Some((m, _)) if m.to_f64().is_nan() => return best.map(|b| b.1),
                    Some((m, _)) if !(v > m || v.to_f64().is_nan()) => {}
                    _ => best = Some((v, i)),
                }
            }
        }
        best.map(|b| b.1)
    }

    fn fwd<T: WithDType>(&self, src: &[T], g: Geometry) -> Vec<T> {
        let (planes, _, w, oh, ow) = g;
        let mut out = vec![T::from_f64(0.0); planes * oh * ow];
        self.for_each(g, |o, base, rows, cols, divisor| {
            out[o] = if self.max {
                match Self::argmax(src, base, w, rows, cols) {
                    Some(i) => src[i],
                    None => T::from_f64(f64::NEG_INFINITY),
                }
            } else {
                let mut sum = T::from_f64(0.0);
                for y in rows {
                    for &v in &src[base + y * w + cols.start..base + y * w + cols.end] {
                        sum += v;
                    }
                }
                sum / T::from_f64(divisor.max(1) as f64)
            };
        });
        out
    }

    fn bwd_values<T: WithDType>(&self, src: &[T], grad: &[T], g: Geometry) -> Vec<T> {
        let (_, _, w, _, _) = g;
        let mut out = vec![T::from_f64(0.0); src.len()];
        self.for_each(g, |o, base, rows, cols, divisor| {
            if self.max {
                if let Some(i) = Self::argmax(src, base, w, rows, cols) {
                    out[i] += grad[o];
                }
            } else {
                let share = grad[o] / T::from_f64(divisor.max(1) as f64);
                for y in rows {
                    for v in &mut out[base + y * w + cols.start..base + y * w + cols.end] {
                        *v += share;
                    }
                }
            }
        });
        out
    }
}

impl CustomOp1 for Pool2d {
    fn name(&self) -> &'static str {
        if self.max {
            "train-max-pool2d"
        } else {
            "train-avg-pool2d"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = self.geometry(l.dims())?;
        let dims = l.dims();
        let out_shape = Shape::from((dims[0], dims[1], g.3, g.4));
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("pooling input is not contiguous");
        };
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(self.fwd(&v[start..end], g)),
            CpuStorage::F64(v) => CpuStorage::F64(self.fwd(&v[start..end], g)),
            _ => candle_core::bail!("pooling supports f32 and f64 only"),
        };
        Ok((out, out_shape))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = self.geometry(arg.dims())?;
        let arg_flat = arg.flatten_all()?;
        let grad_flat = grad.to_dtype(arg.dtype())?.flatten_all()?;
        let out = match arg.dtype() {
            DType::F32 => {
                let v =
                    self.bwd_values(&arg_flat.to_vec1::<f32>()?, &grad_flat.to_vec1::<f32>()?, g);
                Tensor::from_vec(v, arg.shape(), arg.device())?
            }
            DType::F64 => {
                let v =
                    self.bwd_values(&arg_flat.to_vec1::<f64>()?, &grad_flat.to_vec1::<f64>()?, g);
                Tensor::from_vec(v, arg.shape(), arg.device())?
            }
            other => candle_core::bail!("pooling of {other:?} is not supported"),
        };
        Ok(Some(out))
    }
}
