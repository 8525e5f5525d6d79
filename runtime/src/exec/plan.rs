//! What every executor checks and works out from a manifest before it runs
//! it: where each layer's parameters sit in the arena (validated against the
//! manifest and the arena's length), which layers are outputs, and after
//! which layer each activation can be freed. Backends map the result onto
//! their own memory (host offsets, device pointers).
//!
//! A [`Compiled`] model is that work done once per manifest and shared by
//! every program made from it: a device makes a program whenever a model
//! becomes resident, on its serial path, so a model that keeps switching in
//! and out is compiled once ([`Compiler`]), and its layer shapes are
//! inferred once per request shape, not once per switch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use distmind_models::shape::{self, Shape};
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

/// A manifest checked and laid out once ([`plan`] against its own device
/// size, so any arena at least that large takes it), with what every run
/// needs of it, shared by the programs of every arena it is made for.
#[derive(Debug)]
pub struct Compiled {
    /// What it was compiled from: the layers, inputs and name that runs
    /// read, and what a later manifest of the same name is compared with.
    pub manifest: Manifest,
    /// Per layer: its params, located in the arena.
    pub params: Vec<Vec<ParamLoc>>,
    /// Layer ids of the manifest's outputs, in order.
    pub outputs: Vec<usize>,
    /// Per layer: the activations (layer ids) to drop once it ran.
    pub frees_after: Vec<Vec<usize>>,
    /// Per group: the layers with params in it, in order.
    pub by_group: Vec<Vec<usize>>,
    /// Param shapes by name, for [`layer_shapes`].
    pub param_shapes: HashMap<String, Vec<usize>>,
    /// Per request shape: every layer's output shape.
    shapes: Mutex<PerShape<Vec<Shape>>>,
}

impl Compiled {
    /// Checks and lays out `manifest` ([`plan`]) and infers its shapes at
    /// the manifest's own input shapes, so a graph that cannot run fails
    /// here, naming the layer.
    pub fn new(manifest: &Manifest) -> Result<Compiled, ExecError> {
        let plan = plan(manifest, manifest.device_bytes())?;
        let mut by_group = vec![Vec::new(); manifest.groups.len()];
        for (i, layer) in manifest.layers.iter().enumerate() {
            if let (Some(g), false) = (layer.group, plan.params[i].is_empty()) {
                if let Some(layers) = by_group.get_mut(g) {
                    layers.push(i);
                }
            }
        }
        let compiled = Compiled {
            manifest: manifest.clone(),
            params: plan.params,
            outputs: plan.outputs,
            frees_after: plan.frees_after,
            by_group,
            param_shapes: param_shapes(manifest),
            shapes: Mutex::new(PerShape::default()),
        };
        let key: ShapeKey = manifest.inputs.iter().map(|s| s.shape.clone()).collect();
        compiled.layer_shapes(&key)?;
        Ok(compiled)
    }

    pub fn name(&self) -> &str {
        &self.manifest.name
    }

    pub fn layers(&self) -> &[Layer] {
        &self.manifest.layers
    }

    pub fn inputs(&self) -> &[TensorSpec] {
        &self.manifest.inputs
    }

    pub fn groups(&self) -> usize {
        self.manifest.groups.len()
    }

    /// Refuses an arena too small for the model's device bytes (every param
    /// lies inside those, [`plan`] checked).
    pub fn check_arena(&self, arena_len: u64) -> Result<(), ExecError> {
        let need = self.manifest.device_bytes();
        if arena_len < need {
            return Err(ExecError::Model {
                model: self.manifest.name.clone(),
                why: format!("the arena has {arena_len} bytes, the model takes {need} on a device"),
            });
        }
        Ok(())
    }

    /// Every layer's output shape for inputs of the shapes `key` (checked
    /// with [`check_inputs`] first), inferred on the first request of that
    /// shape by any program of this model and kept ([`PerShape`]).
    pub fn layer_shapes(&self, key: &[Vec<usize>]) -> Result<Arc<Vec<Shape>>, ExecError> {
        let mut shapes = self.shapes.lock().unwrap_or_else(|p| p.into_inner());
        shapes.get_or_try_insert(key, || {
            layer_shapes(
                &self.manifest.name,
                &self.manifest.layers,
                &self.manifest.inputs,
                key,
                &self.param_shapes,
            )
        })
    }
}

/// Most models an executor (one device) keeps compiled; past it the least
/// recently used is dropped (programs of it keep their own reference). A
/// device switches among the few models its memory holds and the ones it
/// evicts for them; each kept model holds a copy of its manifest.
pub const COMPILED_MAX: usize = 64;

/// An executor's compiled models by name, each reused while the manifest
/// it was compiled from equals the one asked for (a model re-registered
/// with another manifest is compiled afresh). Bounded by [`COMPILED_MAX`].
#[derive(Debug, Default)]
pub struct Compiler {
    /// Least recently used first.
    models: Mutex<Vec<Arc<Compiled>>>,
}

impl Compiler {
    /// `manifest` compiled: the kept one when its manifest is equal, else
    /// compiled now (outside the lock) and kept in place of any other of
    /// that name.
    pub fn compile(&self, manifest: &Manifest) -> Result<Arc<Compiled>, ExecError> {
        if let Some(c) = self.find(manifest) {
            return Ok(c);
        }
        let compiled = Arc::new(Compiled::new(manifest)?);
        let mut models = self.lock();
        models.retain(|c| c.manifest.name != manifest.name);
        if models.len() >= COMPILED_MAX {
            models.remove(0);
        }
        models.push(compiled.clone());
        Ok(compiled)
    }

    fn find(&self, manifest: &Manifest) -> Option<Arc<Compiled>> {
        let mut models = self.lock();
        let i = models
            .iter()
            .rposition(|c| c.manifest.name == manifest.name)?;
        if models[i].manifest != *manifest {
            return None;
        }
        let c = models.remove(i);
        models.push(c.clone());
        Some(c)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Compiled>>> {
        self.models.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many models are kept compiled.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

/// Checks a request's inputs against the manifest's: the same count, and
/// each of the spec's dtype and a shape [`TensorSpec::check_shape`] accepts
/// (any batch >= 1 in dimension 0; for token inputs any length up to the
/// position table). Returns the request's batch size. The error names the
/// model, the input, the expected shape with its variable dimensions, and
/// what came.
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
        if t.dtype_name() != spec.dtype_name() {
            return Err(bad(
                i,
                t.describe(),
                format!("{} (the element type differs)", spec.expected()),
            ));
        }
        if let Err(why) = spec.check_shape(&t.shape) {
            return Err(bad(i, t.describe(), format!("{}: {why}", spec.expected())));
        }
        if i == 0 {
            batch = t.shape.first().copied().unwrap_or(1);
        }
    }
    Ok(batch)
}

/// The shapes of a request's inputs: what per-shape plans are keyed by.
pub type ShapeKey = Vec<Vec<usize>>;

/// The key of `inputs`.
pub fn shape_key(inputs: &[HostTensor]) -> ShapeKey {
    inputs.iter().map(|t| t.shape.clone()).collect()
}

/// Every layer's output shape for a request whose inputs have the shapes
/// `key` (checked with [`check_inputs`] first): [`shape::infer`] over the
/// layers with the specs at those shapes. An error names the layer that
/// cannot take them.
pub fn layer_shapes(
    model: &str,
    layers: &[Layer],
    specs: &[TensorSpec],
    key: &[Vec<usize>],
    param_shapes: &HashMap<String, Vec<usize>>,
) -> Result<Vec<Shape>, ExecError> {
    let at: Vec<TensorSpec> = specs
        .iter()
        .zip(key)
        .map(|(spec, shape)| TensorSpec {
            shape: shape.clone(),
            ..spec.clone()
        })
        .collect();
    shape::infer(layers, &at, |n| param_shapes.get(n).map(Vec::as_slice))
        .map_err(|(i, why)| layer_error(model, &layers[i], why))
}

/// Param shapes by name, for [`layer_shapes`].
pub fn param_shapes(manifest: &Manifest) -> HashMap<String, Vec<usize>> {
    manifest
        .params
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect()
}

/// Most request shapes a program keeps a plan for; past it the least
/// recently used is dropped (a plan is cheap to redo: shape inference or
/// a profile lookup, never a kernel compile).
pub const SHAPE_PLANS_MAX: usize = 32;

/// What a program works out per request shape (layer shapes, layer times),
/// kept for the [`SHAPE_PLANS_MAX`] shapes it ran last: a transformer
/// serves every sequence length up to its position table, and requests of
/// one length usually come in runs.
#[derive(Debug)]
pub struct PerShape<T> {
    /// Least recently used first.
    entries: Vec<(ShapeKey, std::sync::Arc<T>)>,
}

impl<T> Default for PerShape<T> {
    fn default() -> Self {
        PerShape {
            entries: Vec::new(),
        }
    }
}

impl<T> PerShape<T> {
    /// The plan for `key`, made with `make` unless it is kept.
    pub fn get_or_try_insert<E>(
        &mut self,
        key: &[Vec<usize>],
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<std::sync::Arc<T>, E> {
        if let Some(i) = self.entries.iter().position(|(k, _)| k.as_slice() == key) {
            let e = self.entries.remove(i);
            let plan = e.1.clone();
            self.entries.push(e);
            return Ok(plan);
        }
        let plan = std::sync::Arc::new(make()?);
        if self.entries.len() >= SHAPE_PLANS_MAX {
            self.entries.remove(0);
        }
        self.entries.push((key.to_vec(), plan.clone()));
        Ok(plan)
    }

    /// How many shapes have a plan.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_models::{DimKind, Dtype, VariableDim};

    fn tokens(max: usize) -> TensorSpec {
        let mut spec = TensorSpec::batched("input_ids", vec![1, 16], Dtype::I64);
        spec.variable.push(VariableDim {
            dim: 1,
            kind: DimKind::Sequence,
            max: Some(max),
        });
        spec
    }

    #[test]
    fn inputs_of_any_allowed_shape_pass_and_others_are_named() {
        let specs = [tokens(128)];
        for (n, l) in [(1, 16), (3, 64), (2, 128), (1, 1)] {
            let t = HostTensor::i64(vec![n, l], vec![0; n * l]);
            assert_eq!(check_inputs("bert", &specs, &[t]).unwrap(), n);
        }
        let long = HostTensor::i64(vec![1, 129], vec![0; 129]);
        let e = check_inputs("bert", &specs, &[long])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model bert")
                && e.contains("i64 [1, 129]")
                && e.contains("i64 [batch, tokens] (batch >= 1, tokens 1..=128)")
                && e.contains("more than the model's 128"),
            "{e}"
        );
        let floats = HostTensor::f32(vec![1, 16], vec![0.0; 16]);
        let e = check_inputs("bert", &specs, &[floats])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("f32 [1, 16]") && e.contains("element type"),
            "{e}"
        );
        let images = [TensorSpec::batched("images", vec![1, 3, 4, 4], Dtype::F32)];
        let wrong = HostTensor::f32(vec![2, 3, 5, 4], vec![0.0; 120]);
        let e = check_inputs("cnn", &images, &[wrong])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("f32 [batch, 3, 4, 4] (batch >= 1)") && e.contains("dimension 2 is 5"),
            "{e}"
        );
    }

    /// A tiny BERT manifest (`variants` of them, the same layout).
    fn manifests(dir: &std::path::Path, variants: usize) -> Vec<Manifest> {
        use distmind_models::{generate, Family, GenOptions, Package, Scale};
        generate(&GenOptions {
            scale: Scale::Tiny,
            variants,
            ..GenOptions::new(Family::BertBase, dir)
        })
        .unwrap()
        .iter()
        .map(|d| Package::open(d).unwrap().manifest)
        .collect()
    }

    #[test]
    fn a_manifest_is_compiled_once_until_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let ms = manifests(dir.path(), 2);
        let compiler = Compiler::default();
        let a = compiler.compile(&ms[0]).unwrap();
        assert!(Arc::ptr_eq(&a, &compiler.compile(&ms[0]).unwrap()));
        let b = compiler.compile(&ms[1]).unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(compiler.len(), 2);
        // Shapes inferred through one program's handle serve every other.
        let key = vec![vec![3, 5]];
        let shapes = a.layer_shapes(&key).unwrap();
        assert_eq!(shapes.len(), ms[0].layers.len());
        let again = compiler
            .compile(&ms[0])
            .unwrap()
            .layer_shapes(&key)
            .unwrap();
        assert!(Arc::ptr_eq(&shapes, &again));

        // The same name with another manifest (re-registered, say) is
        // compiled afresh and replaces the old one.
        let mut other = ms[1].clone();
        other.name = ms[0].name.clone();
        let c = compiler.compile(&other).unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(c.manifest, other);
        assert_eq!(compiler.len(), 2);
        assert!(Arc::ptr_eq(&c, &compiler.compile(&other).unwrap()));

        // A manifest that does not plan fails every time and is not kept.
        let mut bad = ms[0].clone();
        bad.name = "broken".into();
        bad.layers[1].params.push("no.such.param".into());
        for _ in 0..2 {
            let e = compiler.compile(&bad).unwrap_err().to_string();
            assert!(e.contains("broken"), "{e}");
        }
        assert_eq!(compiler.len(), 2);
    }

    #[test]
    fn the_compiler_keeps_the_latest_models() {
        let dir = tempfile::tempdir().unwrap();
        let m = manifests(dir.path(), 1).remove(0);
        let compiler = Compiler::default();
        let named = |i: usize| Manifest {
            name: format!("m{i}"),
            ..m.clone()
        };
        let first = compiler.compile(&named(0)).unwrap();
        for i in 1..=COMPILED_MAX {
            compiler.compile(&named(i)).unwrap();
        }
        assert_eq!(compiler.len(), COMPILED_MAX);
        // m0 was the least recently used: compiled again, a new one.
        assert!(!Arc::ptr_eq(&first, &compiler.compile(&named(0)).unwrap()));
        // An arena smaller than the model is refused by name.
        let e = first
            .check_arena(m.device_bytes() - 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("m0") && e.contains("arena"), "{e}");
        assert!(first.check_arena(m.device_bytes()).is_ok());
    }

    #[test]
    fn per_shape_plans_are_kept_for_the_latest_shapes() {
        let mut plans: PerShape<usize> = PerShape::default();
        let mut made = 0;
        for round in 0..2 {
            for l in 0..SHAPE_PLANS_MAX {
                let key = vec![vec![1, l + 1]];
                let got = plans
                    .get_or_try_insert(&key, || {
                        made += 1;
                        Ok::<_, ()>(l)
                    })
                    .unwrap();
                assert_eq!(*got, l);
            }
            assert_eq!(made, SHAPE_PLANS_MAX, "round {round} reuses every plan");
        }
        // One more shape drops the least recently used (length 1).
        plans
            .get_or_try_insert(&[vec![1, 999]], || Ok::<_, ()>(999))
            .unwrap();
        assert_eq!(plans.len(), SHAPE_PLANS_MAX);
        plans
            .get_or_try_insert(&[vec![1, 1]], || {
                made += 1;
                Ok::<_, ()>(0)
            })
            .unwrap();
        assert_eq!(made, SHAPE_PLANS_MAX + 1);
        // A failed plan is not kept.
        assert!(plans.get_or_try_insert(&[vec![7]], || Err("no")).is_err());
        assert!(plans
            .get_or_try_insert(&[vec![7]], || Ok::<_, ()>(7))
            .is_ok());
    }
}
