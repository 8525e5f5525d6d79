//! Shape inference over a layer graph: the per-op shape rules of `OPS.md`,
//! plus the check that each layer's params have the shapes its op expects.

use crate::graph::{Dtype, EmbeddingIds, Layer, Op, TensorSpec};

/// Shape and element type of a layer output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    pub dims: Vec<usize>,
    pub dtype: Dtype,
}

/// Why a layer's shapes do not fit (the layer is named by the caller).
pub type ShapeError = String;

/// Infers every layer's output shape. `param_shape` looks a param up by name.
/// Errors name the layer and what was expected.
pub fn infer<'a>(
    layers: &[Layer],
    inputs: &[TensorSpec],
    param_shape: impl Fn(&str) -> Option<&'a [usize]>,
) -> Result<Vec<Shape>, (usize, ShapeError)> {
    let mut out: Vec<Shape> = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        if layer.id != i {
            return Err((i, format!("has id {} at position {i}", layer.id)));
        }
        let mut ins = Vec::with_capacity(layer.inputs.len());
        for &r in &layer.inputs {
            let s = if r < 0 {
                let k = (-r - 1) as usize;
                let spec = inputs
                    .get(k)
                    .ok_or_else(|| (i, format!("reads model input {k}, which does not exist")))?;
                Shape {
                    dims: spec.shape.clone(),
                    dtype: spec.dtype,
                }
            } else {
                let r = r as usize;
                if r >= i {
                    return Err((i, format!("reads layer {r}, which is not an earlier layer")));
                }
                out[r].clone()
            };
            ins.push(s);
        }
        let mut params = Vec::with_capacity(layer.params.len());
        for p in &layer.params {
            let s = param_shape(p)
                .ok_or_else(|| (i, format!("param {p} is not in the param table")))?;
            params.push(s.to_vec());
        }
        let s = layer_shape(&layer.op, &ins, &params).map_err(|e| (i, e))?;
        out.push(s);
    }
    Ok(out)
}

fn f32_shape(dims: Vec<usize>) -> Shape {
    Shape {
        dims,
        dtype: Dtype::F32,
    }
}

fn expect_inputs(ins: &[Shape], n: usize) -> Result<(), ShapeError> {
    if ins.len() != n {
        return Err(format!("expects {n} input(s), has {}", ins.len()));
    }
    Ok(())
}

fn expect_params(params: &[Vec<usize>], want: &[Vec<usize>]) -> Result<(), ShapeError> {
    if params != want {
        return Err(format!("expects params of shapes {want:?}, has {params:?}"));
    }
    Ok(())
}

fn expect_f32_rank(s: &Shape, rank: usize) -> Result<(), ShapeError> {
    if s.dtype != Dtype::F32 || s.dims.len() != rank {
        return Err(format!(
            "expects an f32 input of rank {rank}, got {:?} {:?}",
            s.dtype, s.dims
        ));
    }
    Ok(())
}

/// Output length of a sliding window (pooling/convolution, dilation 1),
/// with PyTorch's `ceil_mode` rule: the last window must start inside the
/// input or its left padding.
fn window_out(len: usize, k: usize, s: usize, p: usize, ceil: bool) -> Result<usize, ShapeError> {
    if len + 2 * p < k || s == 0 {
        return Err(format!(
            "window {k} stride {s} pad {p} does not fit length {len}"
        ));
    }
    let span = len + 2 * p - k;
    let mut n = if ceil {
        span.div_ceil(s) + 1
    } else {
        span / s + 1
    };
    if ceil && (n - 1) * s >= len + p {
        n -= 1;
    }
    Ok(n)
}

fn pool_shape(
    x: &Shape,
    k: [usize; 2],
    s: [usize; 2],
    p: [usize; 2],
    ceil: bool,
) -> Result<Shape, ShapeError> {
    expect_f32_rank(x, 4)?;
    let d = &x.dims;
    Ok(f32_shape(vec![
        d[0],
        d[1],
        window_out(d[2], k[0], s[0], p[0], ceil)?,
        window_out(d[3], k[1], s[1], p[1], ceil)?,
    ]))
}

/// The output shape of one op, checking its inputs and params.
pub fn layer_shape(op: &Op, ins: &[Shape], params: &[Vec<usize>]) -> Result<Shape, ShapeError> {
    match *op {
        Op::Conv2d {
            in_channels,
            out_channels,
            kernel,
            stride,
            padding,
            bias,
        } => {
            expect_inputs(ins, 1)?;
            let mut want = vec![vec![out_channels, in_channels, kernel[0], kernel[1]]];
            if bias {
                want.push(vec![out_channels]);
            }
            expect_params(params, &want)?;
            let x = &ins[0];
            expect_f32_rank(x, 4)?;
            if x.dims[1] != in_channels {
                return Err(format!(
                    "expects {in_channels} input channels, got {:?}",
                    x.dims
                ));
            }
            let mut s = pool_shape(x, kernel, stride, padding, false)?;
            s.dims[1] = out_channels;
            Ok(s)
        }
        Op::BatchNorm { num_features, .. } => {
            expect_inputs(ins, 1)?;
            expect_params(params, &vec![vec![num_features]; 4])?;
            let x = &ins[0];
            if x.dtype != Dtype::F32 || x.dims.len() < 2 || x.dims[1] != num_features {
                return Err(format!(
                    "expects f32 [N, {num_features}, ...], got {:?}",
                    x.dims
                ));
            }
            Ok(x.clone())
        }
        Op::Relu | Op::Tanh | Op::Gelu { .. } => {
            expect_inputs(ins, 1)?;
            expect_params(params, &[])?;
            if ins[0].dtype != Dtype::F32 {
                return Err("expects an f32 input".to_string());
            }
            Ok(ins[0].clone())
        }
        Op::MaxPool2d {
            kernel,
            stride,
            padding,
            ceil_mode,
        }
        | Op::AvgPool2d {
            kernel,
            stride,
            padding,
            ceil_mode,
            ..
        } => {
            expect_inputs(ins, 1)?;
            expect_params(params, &[])?;
            if padding[0] * 2 > kernel[0] || padding[1] * 2 > kernel[1] {
                return Err("padding must be at most half the kernel".to_string());
            }
            pool_shape(&ins[0], kernel, stride, padding, ceil_mode)
        }
        Op::AdaptiveAvgPool2d { output_size } => {
            expect_inputs(ins, 1)?;
            expect_params(params, &[])?;
            expect_f32_rank(&ins[0], 4)?;
            let d = &ins[0].dims;
            Ok(f32_shape(vec![d[0], d[1], output_size[0], output_size[1]]))
        }
        Op::Add => {
            expect_inputs(ins, 2)?;
            expect_params(params, &[])?;
            if ins[0] != ins[1] || ins[0].dtype != Dtype::F32 {
                return Err(format!(
                    "expects two equal f32 shapes, got {:?} and {:?}",
                    ins[0].dims, ins[1].dims
                ));
            }
            Ok(ins[0].clone())
        }
        Op::Concat { dim } => {
            expect_params(params, &[])?;
            let first = ins.first().ok_or("expects at least one input")?;
            if dim >= first.dims.len() {
                return Err(format!("dim {dim} out of range for {:?}", first.dims));
            }
            let mut dims = first.dims.clone();
            dims[dim] = 0;
            for s in ins {
                let same_rest = s.dims.len() == first.dims.len()
                    && s.dims
                        .iter()
                        .zip(&first.dims)
                        .enumerate()
                        .all(|(j, (a, b))| j == dim || a == b);
                if !same_rest || s.dtype != Dtype::F32 {
                    return Err(format!(
                        "inputs differ outside dim {dim}: {:?} vs {:?}",
                        first.dims, s.dims
                    ));
                }
                dims[dim] += s.dims[dim];
            }
            Ok(f32_shape(dims))
        }
        Op::Flatten { start_dim } => {
            expect_inputs(ins, 1)?;
            expect_params(params, &[])?;
            let d = &ins[0].dims;
            if start_dim >= d.len() {
                return Err(format!("start_dim {start_dim} out of range for {d:?}"));
            }
            let mut dims = d[..start_dim].to_vec();
            dims.push(d[start_dim..].iter().product());
            Ok(f32_shape(dims))
        }
        Op::Linear {
            in_features,
            out_features,
            bias,
            transposed,
        } => {
            expect_inputs(ins, 1)?;
            let mut want = vec![if transposed {
                vec![in_features, out_features]
            } else {
                vec![out_features, in_features]
            }];
            if bias {
                want.push(vec![out_features]);
            }
            expect_params(params, &want)?;
            let x = &ins[0];
            if x.dtype != Dtype::F32 || x.dims.last() != Some(&in_features) {
                return Err(format!(
                    "expects f32 [..., {in_features}], got {:?}",
                    x.dims
                ));
            }
            let mut dims = x.dims.clone();
            *dims.last_mut().expect("checked non-empty") = out_features;
            Ok(f32_shape(dims))
        }
        Op::Embedding {
            num_embeddings,
            embedding_dim,
            ids,
        } => {
            expect_inputs(ins, 1)?;
            expect_params(params, &[vec![num_embeddings, embedding_dim]])?;
            let x = &ins[0];
            if x.dtype != Dtype::I64 || x.dims.is_empty() {
                return Err(format!(
                    "expects i64 token ids, got {:?} {:?}",
                    x.dtype, x.dims
                ));
            }
            if ids == EmbeddingIds::Positions && x.dims[x.dims.len() - 1] > num_embeddings {
                return Err(format!(
                    "sequence {:?} longer than {num_embeddings} positions",
                    x.dims
                ));
            }
            let mut dims = x.dims.clone();
            dims.push(embedding_dim);
            Ok(f32_shape(dims))
        }
        Op::LayerNorm {
            normalized_size, ..
        } => {
            expect_inputs(ins, 1)?;
            expect_params(params, &[vec![normalized_size], vec![normalized_size]])?;
            let x = &ins[0];
            if x.dtype != Dtype::F32 || x.dims.last() != Some(&normalized_size) {
                return Err(format!(
                    "expects f32 [..., {normalized_size}], got {:?}",
                    x.dims
                ));
            }
            Ok(x.clone())
        }
        Op::Attention { hidden, heads, .. } => {
            expect_params(params, &[])?;
            if heads == 0 || hidden % heads != 0 {
                return Err(format!(
                    "hidden {hidden} is not a multiple of {heads} heads"
                ));
            }
            let width = match ins.len() {
                1 => 3 * hidden,
                3 => hidden,
                n => return Err(format!("expects 1 (fused qkv) or 3 inputs, has {n}")),
            };
            for x in ins {
                if x.dtype != Dtype::F32
                    || x.dims.len() != 3
                    || x.dims[2] != width
                    || x.dims[..2] != ins[0].dims[..2]
                {
                    return Err(format!(
                        "expects f32 [N, L, {width}] inputs, got {:?}",
                        x.dims
                    ));
                }
            }
            let d = &ins[0].dims;
            Ok(f32_shape(vec![d[0], d[1], hidden]))
        }
        Op::Select { dim, index } => {
            expect_inputs(ins, 1)?;
            expect_params(params, &[])?;
            let d = &ins[0].dims;
            if dim >= d.len() || index >= d[dim] {
                return Err(format!(
                    "cannot select index {index} of dim {dim} from {d:?}"
                ));
            }
            let mut dims = d.clone();
            dims.remove(dim);
            Ok(Shape {
                dims,
                dtype: ins[0].dtype,
            })
        }
    }
}
