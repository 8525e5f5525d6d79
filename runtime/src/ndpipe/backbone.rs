//! A frozen CNN backbone: a model package's layers up to (not including)
//! its classifier head, run forward on the CPU in eval mode.
//!
//! The backbone is the package's own manifest cut before the head (the
//! final `linear` layer): the same layers, params and groups, one output
//! (the head's input: the globally average-pooled, flattened features), and
//! an input of `[batch, 3, side, side]` for the side asked for. It runs on
//! the `cpu` executor ([`crate::exec::cpu`]), whose kernels have
//! `models/OPS.md`'s eval-mode semantics: batch norm with the running
//! statistics, nothing updated. The head's params stay in the arena, unused.

use std::path::Path;
use std::sync::Mutex;

use distmind_common::samples::ExtractorInfo;
use distmind_memserver::FeatureExtractor;
use distmind_models::{Dtype, Family, Manifest, Op, OutputSpec, Package};

use crate::exec::cpu::CpuExecutor;
use crate::exec::{all_ready, ExecError, Executor, HostTensor, Program, TensorData, Trace};

/// The input side a backbone takes unless told otherwise: small, to keep
/// CPU time down (the families' global average pooling takes any side their
/// strides leave at least one pixel of).
pub const BACKBONE_INPUT_DEFAULT: u32 = 64;
/// Images run through the backbone at once: a larger request is cut into
/// batches of this many, bounding the live activations.
pub const BACKBONE_BATCH_MAX: usize = 32;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackboneError {
    #[error(transparent)]
    Package(#[from] distmind_models::ModelError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("model {model}: {why}")]
    Unsuitable { model: String, why: String },
}

/// A model package's layers `[0, head)`, frozen, on the CPU.
pub struct Backbone {
    info: ExtractorInfo,
    model: String,
    family: Family,
    /// Index of the head (the first layer left out).
    head: usize,
    feature_dim: usize,
    side: usize,
    /// One program, run by one caller at a time (a run needs `&mut`).
    program: Mutex<Box<dyn Program>>,
}

impl std::fmt::Debug for Backbone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backbone")
            .field("info", &self.info)
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

/// Where a package's weights came from, for [`ExtractorInfo::backbone`].
fn provenance(m: &Manifest) -> String {
    match (&m.origin, m.seed) {
        (Some(o), _) => format!("imported from {}", o.checkpoint),
        (None, Some(seed)) => match m.scale {
            Some(scale) => format!("generated, {scale} scale, seed {seed}"),
            None => format!("generated, seed {seed}"),
        },
        (None, None) => "generated".to_string(),
    }
}

/// The manifest cut before its head, taking `[1, 3, side, side]` inputs,
/// with the head's index and the feature width.
pub fn cut_before_head(m: &Manifest, side: usize) -> Result<(Manifest, usize, usize), String> {
    if !matches!(
        m.family,
        Family::Resnet152 | Family::InceptionV3 | Family::Densenet201
    ) {
        return Err(format!(
            "family {} is not a CNN: a backbone is cut from resnet152, inception_v3 or \
             densenet201",
            m.family
        ));
    }
    let head = m
        .outputs
        .last()
        .map(|o| o.layer)
        .ok_or("the manifest names no output")?;
    let layer = m
        .layers
        .get(head)
        .ok_or_else(|| format!("the output names missing layer {head}"))?;
    let Op::Linear { in_features, .. } = layer.op else {
        return Err(format!(
            "the last output is layer {head} ({}), not a linear classifier head",
            layer.name
        ));
    };
    if head + 1 != m.layers.len() {
        return Err(format!(
            "the head {} is layer {head} of {}: layers after it would be lost",
            layer.name,
            m.layers.len()
        ));
    }
    let features = match layer.inputs.as_slice() {
        [i] if *i >= 0 => *i as usize,
        other => return Err(format!("the head {} reads {other:?}", layer.name)),
    };
    if m.inputs.len() != 1 || m.inputs[0].shape.len() != 4 || m.inputs[0].shape[1] != 3 {
        return Err(format!(
            "expected one [batch, 3, H, W] image input, the manifest has {:?}",
            m.inputs.iter().map(|i| &i.shape).collect::<Vec<_>>()
        ));
    }
    let mut cut = m.clone();
    cut.layers.truncate(head);
    cut.inputs[0].shape = vec![1, 3, side, side];
    cut.outputs = vec![OutputSpec {
        name: "features".into(),
        layer: features,
        shape: vec![1, in_features],
        dtype: Dtype::F32,
    }];
    let shapes = cut
        .output_shapes(&[&[1, 3, side, side]])
        .map_err(|e| format!("{} does not take {side}x{side} inputs: {e}", m.family))?;
    if shapes != [vec![1, in_features]] {
        return Err(format!(
            "at {side}x{side} the head's input is {:?}, not [1, {in_features}]",
            shapes[0]
        ));
    }
    cut.outputs[0].shape = shapes[0].clone();
    Ok((cut, head, in_features))
}

impl Backbone {
    /// Opens the package in `dir` and prepares its layers before the head
    /// for `side x side` inputs (checked against the family's graph here).
    pub fn open(dir: impl AsRef<Path>, side: u32) -> Result<Backbone, BackboneError> {
        let pkg = Package::open(dir)?;
        Backbone::from_package(&pkg, side)
    }

    /// [`Backbone::open`] on an opened package.
    pub fn from_package(pkg: &Package, side: u32) -> Result<Backbone, BackboneError> {
        let m = &pkg.manifest;
        let unsuitable = |why: String| BackboneError::Unsuitable {
            model: m.name.clone(),
            why,
        };
        if side == 0 {
            return Err(unsuitable("an input side of 0".into()));
        }
        let (cut, head, feature_dim) = cut_before_head(m, side as usize).map_err(unsuitable)?;
        let exec = CpuExecutor::new();
        let arena = exec.alloc_arena(cut.device_bytes())?;
        let stored = cut.param_dtype;
        for g in &cut.groups {
            let bytes = pkg.group_bytes(g.index)?;
            arena.upload_stored(g.index, g.device_offset(stored), stored, &bytes)?;
        }
        let program = exec.program(&cut, arena)?;
        let info = ExtractorInfo {
            backbone: format!(
                "{} ({}, {}), layers [0, {head})",
                m.name,
                m.family,
                provenance(m)
            ),
            feature_dim: feature_dim as u32,
            input: side,
        };
        Ok(Backbone {
            info,
            model: m.name.clone(),
            family: m.family,
            head,
            feature_dim,
            side: side as usize,
            program: Mutex::new(program),
        })
    }

    pub fn feature_dim(&self) -> usize {
        self.feature_dim
    }

    /// The side of the square inputs it takes.
    pub fn side(&self) -> usize {
        self.side
    }

    pub fn family(&self) -> Family {
        self.family
    }

    /// The head's layer index: the backbone is layers `[0, head)`.
    pub fn head(&self) -> usize {
        self.head
    }

    /// Values of one input image: `3 x side x side`.
    pub fn image_len(&self) -> usize {
        3 * self.side * self.side
    }

    /// Features of `n` images (`n x 3 x side x side` f32, one after
    /// another): `n x feature_dim` f32, in batches of [`BACKBONE_BATCH_MAX`].
    pub fn forward(&self, inputs: &[f32], n: usize) -> Result<Vec<f32>, BackboneError> {
        let per = self.image_len();
        let unsuitable = |why: String| BackboneError::Unsuitable {
            model: self.model.clone(),
            why,
        };
        if inputs.len() != n * per {
            return Err(unsuitable(format!(
                "{} input values for {n} images of 3x{s}x{s}",
                inputs.len(),
                s = self.side
            )));
        }
        let mut out = Vec::with_capacity(n * self.feature_dim);
        let mut program = self.program.lock().unwrap_or_else(|e| e.into_inner());
        for batch in inputs.chunks(BACKBONE_BATCH_MAX * per) {
            let b = batch.len() / per;
            let x = HostTensor::f32(vec![b, 3, self.side, self.side], batch.to_vec());
            let mut trace = Trace::new();
            let y = program.run(&[x], &mut all_ready, &mut trace)?;
            match y.into_iter().next() {
                Some(HostTensor {
                    shape,
                    data: TensorData::F32(v),
                }) if shape == [b, self.feature_dim] => out.extend_from_slice(&v),
                other => {
                    return Err(unsuitable(format!(
                        "the backbone returned {:?} for a batch of {b}, expected f32 [{b}, {}]",
                        other.map(|t| t.describe()),
                        self.feature_dim
                    )))
                }
            }
        }
        Ok(out)
    }
}

impl FeatureExtractor for Backbone {
    fn info(&self) -> ExtractorInfo {
        self.info.clone()
    }

    fn extract(&self, inputs: &[f32], n: usize) -> Result<Vec<f32>, String> {
        self.forward(inputs, n).map_err(|e| e.to_string())
    }
}
