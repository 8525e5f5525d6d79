//! What every executor checks and works out from a manifest before it runs
//! it: where each layer's parameters sit in the arena (validated against the
//! manifest and the arena's length), which layers are outputs, and after
//! which layer each activation can be freed. Backends map the result onto
//! their own memory (host offsets, device pointers).

use std::collections::HashMap;

use distmind_models::{Dtype, Layer, Manifest, Op, ParamEntry, TensorSpec};

use super::{ExecError, HostTensor};

/// One parameter of a layer, located in the arena (the device layout: every
/// parameter f32, see `distmind_models::dtype`).
#[derive(Debug, Clone)]
pub struct ParamLoc {
    pub name: String,
    /// Device bytes from the start of the arena.
    pub offset: u64,
    /// Device (f32) bytes.
    pub nbytes: u64,
    pub shape: Vec<usize>,
}

/// The checked layout of a model, shared by all backends.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Per layer: its params in `OPS.md`'s order.
    pub params: Vec<Vec<ParamLoc>>,
    /// Layer ids of the manifest's outputs, in order.
    pub outputs: Vec<usize>,
    /// Per layer: the activations (layer ids) to drop once it ran.
    pub frees_after: Vec<Vec<usize>>,
}

/// How many params `op` reads, in `OPS.md`'s order.
pub fn param_count(op: &Op) -> usize {
    match *op {
        Op::Conv2d { bias, .. } | Op::Linear { bias, .. } => 1 + usize::from(bias),
        Op::BatchNorm { .. } => 4,
        Op::Embedding { .. } => 1,
        Op::LayerNorm { .. } => 2,
        _ => 0,
    }
}

pub fn layer_error(model: &str, layer: &Layer, why: String) -> ExecError {
    ExecError::Layer {
        model: model.to_string(),
        layer: layer.id,
        name: layer.name.clone(),
        op: layer.op.name().into(),
        why,
    }
}

/// Per layer, the activations whose last reader it is (its own output too
/// when nothing reads it and it is not a model output).
pub fn frees_after(layers: &[Layer], outputs: &[usize]) -> Vec<Vec<usize>> {
    let mut last_use: Vec<Option<usize>> = (0..layers.len()).map(Some).collect();
    for layer in layers {
        for &input in &layer.inputs {
            if input >= 0 {
                last_use[input as usize] = Some(layer.id);
            }
        }
    }
    for &o in outputs {
        last_use[o] = None;
    }
    let mut frees = vec![Vec::new(); layers.len()];
    for (value, last) in last_use.iter().enumerate() {
        if let Some(l) = *last {
            frees[l].push(value);
        }
    }
    frees
}

/// Checks `manifest` against itself and an arena of `arena_len` bytes and
/// locates every layer's params: layer ids in order, inputs that name
/// earlier layers or model inputs, the op's param count, f32 params inside
/// the layer's own group and inside the arena, outputs that exist.
pub fn plan(manifest: &Manifest, arena_len: u64) -> Result<Plan, ExecError> {
    let model_err = |why: String| ExecError::Model {
        model: manifest.name.clone(),
        why,
    };
    if arena_len < manifest.device_bytes() {
        return Err(model_err(format!(
            "the arena has {arena_len} bytes, the model takes {} on a device",
            manifest.device_bytes()
        )));
    }
    let stored = manifest.param_dtype;
    let by_name: HashMap<&str, &ParamEntry> = manifest
        .params
        .iter()
        .map(|p| (p.name.as_str(), p))
        .collect();
    let mut params = Vec::with_capacity(manifest.layers.len());
    for (i, layer) in manifest.layers.iter().enumerate() {
        let layer_err = |why: String| layer_error(&manifest.name, layer, why);
        if layer.id != i {
            return Err(layer_err(format!("has id {} at position {i}", layer.id)));
        }
        for &input in &layer.inputs {
            let ok = if input < 0 {
                ((-input - 1) as usize) < manifest.inputs.len()
            } else {
                (input as usize) < i
            };
            if !ok {
                return Err(layer_err(format!(
                    "reads {input}, which is neither an earlier layer nor a model input"
                )));
            }
        }
        if layer.params.len() != param_count(&layer.op) {
            return Err(layer_err(format!(
                "has {} params, the op wants {}",
                layer.params.len(),
                param_count(&layer.op)
            )));
        }
        let mut locs = Vec::with_capacity(layer.params.len());
        for name in &layer.params {
            let p = by_name
                .get(name.as_str())
                .ok_or_else(|| layer_err(format!("param {name} is not in the manifest")))?;
            if p.dtype != Dtype::F32 || p.device_nbytes(stored) != 4 * p.numel() {
                return Err(layer_err(format!(
                    "param {name} is {:?} {:?} with {} bytes stored as {stored}: expected f32 \
                     on the device",
                    p.dtype, p.shape, p.nbytes
                )));
            }
            if Some(p.group) != layer.group {
                return Err(layer_err(format!(
                    "param {name} lives in group {} but the layer is gated on {:?}",
                    p.group, layer.group
                )));
            }
            let group = manifest.groups.get(p.group).ok_or_else(|| {
                layer_err(format!("param {name} names missing group {}", p.group))
            })?;
            let offset = group.device_offset(stored) + p.device_offset(stored);
            let nbytes = p.device_nbytes(stored);
            if p.offset + p.nbytes > group.bytes || offset + nbytes > arena_len {
                return Err(layer_err(format!(
                    "param {name} overruns group {}",
                    p.group
                )));
            }
            locs.push(ParamLoc {
                name: name.clone(),
                offset,
                nbytes,
                shape: p.shape.clone(),
            });
        }
        params.push(locs);
    }
    let mut outputs = Vec::with_capacity(manifest.outputs.len());
    for o in &manifest.outputs {
        if o.layer >= manifest.layers.len() {
            return Err(model_err(format!(
                "output {} names missing layer {}",
                o.name, o.layer
            )));
        }
        outputs.push(o.layer);
    }
    Ok(Plan {
        frees_after: frees_after(&manifest.layers, &outputs),
        params,
        outputs,
    })
}

/// Checks a request's inputs against the manifest's: the same count, and
/// each the same dtype and shape except the batch (dimension 0, >= 1), which
/// every backend accepts. Returns the request's batch size.
pub fn check_inputs(
    model: &str,
    specs: &[TensorSpec],
    inputs: &[HostTensor],
) -> Result<usize, ExecError> {
    let bad = |index: usize, got: String, want: String| ExecError::BadInput {
        model: model.to_string(),
        index,
        got,
        want,
    };
    if inputs.len() != specs.len() {
        return Err(bad(
            inputs.len(),
            format!("{} inputs", inputs.len()),
            format!("{} inputs", specs.len()),
        ));
    }
    let mut batch = specs
        .first()
        .and_then(|s| s.shape.first().copied())
        .unwrap_or(1);
    for (i, (t, spec)) in inputs.iter().zip(specs).enumerate() {
        let want_dtype = match spec.dtype {
            Dtype::F32 => "f32",
            Dtype::I64 => "i64",
        };
        let shape_ok = t.shape.len() == spec.shape.len()
            && t.shape.first().is_none_or(|&b| b >= 1)
            && t.shape.iter().skip(1).eq(spec.shape.iter().skip(1));
        if t.dtype_name() != want_dtype || !shape_ok {
            let want = format!(
                "{want_dtype} {:?} (any batch size >= 1 in dimension 0)",
                spec.shape
            );
            return Err(bad(i, t.describe(), want));
        }
        if i == 0 {
            batch = t.shape.first().copied().unwrap_or(1);
        }
    }
    Ok(batch)
}
