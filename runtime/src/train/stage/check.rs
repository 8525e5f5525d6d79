//! The shapes a stage's boundary tensors must have for a microbatch.
//!
//! A microbatch chooses the batch (and for a transformer the number of
//! tokens); every boundary tensor's shape follows from those two through
//! the layer graph (`models::shape`). Which dims of each boundary tensor
//! are the batch and which the tokens is found once, by inferring the
//! graph at the manifest's default shapes and again with each one grown
//! by one: the dims that moved.

use std::collections::HashMap;
use std::sync::Arc;

use distmind_models::shape::{self, Shape};
use distmind_models::{DimKind, Dtype, Manifest, TensorSpec};

/// Most (batch, tokens) pairs whose expected shapes a stage keeps.
const SHAPE_CACHE_MAX: usize = 16;

/// The request dims of a microbatch: batch and tokens (`None` for models
/// without a sequence dimension).
pub(super) type RequestDims = (usize, Option<usize>);

#[derive(Debug)]
pub(super) struct ShapeCheck {
    /// The stage's inputs.
    refs: Vec<i64>,
    /// Per input: its dims that are the batch, and those that are the tokens.
    batch_dims: HashMap<i64, Vec<usize>>,
    seq_dims: HashMap<i64, Vec<usize>>,
    default: RequestDims,
    /// The expected shape of every input, per request dims.
    cache: Vec<(RequestDims, Arc<HashMap<i64, Shape>>)>,
}

impl ShapeCheck {
    pub(super) fn new(manifest: &Manifest, refs: &[i64]) -> Result<Self, String> {
        let batch = dim_of(manifest, DimKind::Batch).map_or(1, |(_, _, n)| n);
        let seq = dim_of(manifest, DimKind::Sequence);
        let default = (batch, seq.map(|(_, _, n)| n));
        let base = shapes_at(manifest, refs, default)?;
        let moved = |at: RequestDims| -> Result<HashMap<i64, Vec<usize>>, String> {
            let other = shapes_at(manifest, refs, at)?;
            Ok(refs
                .iter()
                .map(|r| {
                    let (a, b) = (&base[r].dims, &other[r].dims);
                    let dims = (0..a.len().min(b.len()))
                        .filter(|&d| a[d] != b[d])
                        .collect();
                    (*r, dims)
                })
                .collect())
        };
        let batch_dims = moved((batch + 1, default.1))?;
        let seq_dims = match seq {
            // Shrink if the position table is full.
            Some((_, max, n)) => {
                let probe = if max.is_some_and(|m| n + 1 > m) && n > 1 {
                    n - 1
                } else {
                    n + 1
                };
                moved((batch, Some(probe)))?
            }
            None => HashMap::new(),
        };
        Ok(ShapeCheck {
            refs: refs.to_vec(),
            batch_dims,
            seq_dims,
            default,
            cache: vec![(default, Arc::new(base))],
        })
    }

    /// The request dims `inputs` show (the first input that has a batch,
    /// or tokens, dim says), defaults for what none shows.
    pub(super) fn request_dims(&self, inputs: &HashMap<i64, Vec<usize>>) -> RequestDims {
        let read = |which: &HashMap<i64, Vec<usize>>| {
            self.refs.iter().find_map(|r| {
                let d = *which.get(r)?.first()?;
                inputs.get(r)?.get(d).copied()
            })
        };
        (
            read(&self.batch_dims).unwrap_or(self.default.0),
            read(&self.seq_dims).or(self.default.1),
        )
    }

    /// The shape every input must have at `at`.
    pub(super) fn expected(
        &mut self,
        manifest: &Manifest,
        at: RequestDims,
    ) -> Result<Arc<HashMap<i64, Shape>>, String> {
        if let Some((_, s)) = self.cache.iter().find(|(k, _)| *k == at) {
            return Ok(s.clone());
        }
        let s = Arc::new(shapes_at(manifest, &self.refs, at)?);
        if self.cache.len() >= SHAPE_CACHE_MAX {
            self.cache.truncate(1);
        }
        self.cache.push((at, s.clone()));
        Ok(s)
    }
}

/// Input 0's variable dim of `kind`: (dim, its max, its default size).
fn dim_of(manifest: &Manifest, kind: DimKind) -> Option<(usize, Option<usize>, usize)> {
    let spec = manifest.inputs.first()?;
    let v = spec.variable.iter().find(|v| v.kind == kind)?;
    Some((v.dim, v.max, *spec.shape.get(v.dim)?))
}

/// The shapes of `refs` for a request of `at`.
fn shapes_at(
    manifest: &Manifest,
    refs: &[i64],
    (batch, seq): RequestDims,
) -> Result<HashMap<i64, Shape>, String> {
    let at = format!(
        "at batch {batch}{}",
        seq.map(|s| format!(" and {s} tokens")).unwrap_or_default()
    );
    let mut specs: Vec<TensorSpec> = Vec::with_capacity(manifest.inputs.len());
    for (k, spec) in manifest.inputs.iter().enumerate() {
        let mut s = spec.clone();
        for v in &spec.variable {
            let Some(d) = s.shape.get_mut(v.dim) else {
                continue;
            };
            *d = match v.kind {
                DimKind::Batch => batch,
                DimKind::Sequence => seq.unwrap_or(*d),
            };
            if *d == 0 || v.max.is_some_and(|m| *d > m) {
                return Err(format!(
                    "{at}: model input {k} ({}) takes {} {} in 1..={}",
                    spec.name,
                    v.kind.as_str(),
                    d,
                    v.max.map_or("any".to_string(), |m| m.to_string())
                ));
            }
        }
        specs.push(s);
    }
    // Only the layers before the last input matter.
    let upto = refs.iter().map(|&r| r + 1).max().unwrap_or(0).max(0) as usize;
    let params: HashMap<&str, &[usize]> = manifest
        .params
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    let layer_shapes = shape::infer(&manifest.layers[..upto], &specs, |n| params.get(n).copied())
        .map_err(|(i, why)| {
        format!(
            "{at}, layer {i} ({}) cannot run: {why}",
            manifest.layers[i].name
        )
    })?;
    refs.iter()
        .map(|&r| {
            let s = if r < 0 {
                let spec = &specs[(-r - 1) as usize];
                Shape {
                    dims: spec.shape.clone(),
                    dtype: spec.dtype,
                }
            } else {
                layer_shapes[r as usize].clone()
            };
            Ok((r, s))
        })
        .collect()
}

/// `f32 [2, 3]`.
pub(super) fn describe(s: &Shape) -> String {
    let dtype = match s.dtype {
        Dtype::F32 => "f32",
        Dtype::I64 => "i64",
    };
    format!("{dtype} {:?}", s.dims)
}
