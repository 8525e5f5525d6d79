//! One layer in training mode: every op of `OPS.md` with candle ops that
//! carry gradients (pools and gelu with their own backward).

use candle_core::{bail, DType, Result, Tensor};
use distmind_models::Op;

use super::pool::Pool2d;
use super::transformer;
use super::BN_MOMENTUM;
use crate::exec::candle_ops::{concat, conv2d, linear};

/// A layer's output, and for `batch_norm` the new running statistics
/// (mean, variance), in the params' dtype, detached.
pub(super) struct Applied {
    pub out: Tensor,
    pub running: Option<(Tensor, Tensor)>,
}

/// Whether the op trains here: every op of `OPS.md` (the match is
/// exhaustive, so a new op must be considered here).
pub(super) fn trainable(op: &Op) -> bool {
    match op {
        Op::Conv2d { .. }
        | Op::BatchNorm { .. }
        | Op::Relu
        | Op::MaxPool2d { .. }
        | Op::AvgPool2d { .. }
        | Op::AdaptiveAvgPool2d { .. }
        | Op::Add
        | Op::Concat { .. }
        | Op::Flatten { .. }
        | Op::Linear { .. }
        | Op::Embedding { .. }
        | Op::LayerNorm { .. }
        | Op::Gelu { .. }
        | Op::Tanh
        | Op::Attention { .. }
        | Op::Select { .. } => true,
    }
}

/// Runs `op` on `args` with `params` (name, tensor) in the op's order.
pub(super) fn apply(op: &Op, args: &[Tensor], params: &[(&str, Tensor)]) -> Result<Applied> {
    let one = || -> Result<&Tensor> {
        if args.len() != 1 {
            bail!("has {} inputs, the op wants 1", args.len());
        }
        Ok(&args[0])
    };
    let want_params = |k: usize| -> Result<()> {
        if params.len() != k {
            bail!("has {} params, the op wants {k}", params.len());
        }
        Ok(())
    };
    let shape = |i: usize, want: &[usize]| -> Result<()> {
        let got = params[i].1.dims();
        if got != want {
            bail!(
                "param {} has shape {got:?}, the op wants {want:?}",
                params[i].0
            );
        }
        Ok(())
    };
    let float = |x: &Tensor| -> Result<()> {
        if !x.dtype().is_float() {
            bail!(
                "input is {:?} {:?}, expected a float tensor",
                x.dtype(),
                x.dims()
            );
        }
        Ok(())
    };
    for a in args {
        if !matches!(op, Op::Embedding { .. }) {
            float(a)?;
        }
    }
    let plain = |out: Tensor| Ok(Applied { out, running: None });
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
            let b = if bias {
                shape(1, &[out_channels])?;
                Some(params[1].1.reshape((1, out_channels, 1, 1))?)
            } else {
                None
            };
            let x = one()?;
            plain(conv2d(x, &params[0].1, b.as_ref(), stride, padding)?)
        }
        Op::BatchNorm { num_features, eps } => {
            want_params(4)?;
            for i in 0..4 {
                shape(i, &[num_features])?;
            }
            batch_norm(one()?, params, num_features, eps)
        }
        Op::Relu => {
            want_params(0)?;
            plain(one()?.relu()?)
        }
        Op::Tanh => {
            want_params(0)?;
            plain(one()?.tanh()?)
        }
        Op::Gelu { approximate } => {
            want_params(0)?;
            plain(transformer::gelu(one()?, approximate)?)
        }
        Op::MaxPool2d {
            kernel,
            stride,
            padding,
            ceil_mode,
        } => {
            want_params(0)?;
            plain(pool(
                one()?,
                true,
                kernel,
                stride,
                padding,
                ceil_mode,
                false,
            )?)
        }
        Op::AvgPool2d {
            kernel,
            stride,
            padding,
            ceil_mode,
            count_include_pad,
        } => {
            want_params(0)?;
            plain(pool(
                one()?,
                false,
                kernel,
                stride,
                padding,
                ceil_mode,
                count_include_pad,
            )?)
        }
        Op::AdaptiveAvgPool2d { output_size } => {
            want_params(0)?;
            plain(adaptive_avg_pool2d(one()?, output_size)?)
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
            plain(args[0].add(&args[1])?)
        }
        Op::Concat { dim } => {
            want_params(0)?;
            plain(concat(args, dim)?)
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
            plain(x.flatten_from(start_dim)?)
        }
        Op::Linear {
            in_features,
            out_features,
            bias,
            transposed,
        } => {
            want_params(1 + usize::from(bias))?;
            let weight_t = if transposed {
                shape(0, &[in_features, out_features])?;
                params[0].1.clone()
            } else {
                shape(0, &[out_features, in_features])?;
                params[0].1.t()?
            };
            let b = if bias {
                shape(1, &[out_features])?;
                Some(&params[1].1)
            } else {
                None
            };
            plain(linear(one()?, in_features, &weight_t, b)?)
        }
        Op::Embedding {
            num_embeddings,
            embedding_dim,
            ids,
        } => {
            want_params(1)?;
            shape(0, &[num_embeddings, embedding_dim])?;
            plain(transformer::embedding(
                one()?,
                &params[0].1,
                num_embeddings,
                embedding_dim,
                ids,
            )?)
        }
        Op::LayerNorm {
            normalized_size,
            eps,
        } => {
            want_params(2)?;
            shape(0, &[normalized_size])?;
            shape(1, &[normalized_size])?;
            plain(transformer::layer_norm(
                one()?,
                &params[0].1,
                &params[1].1,
                eps,
            )?)
        }
        Op::Attention {
            hidden,
            heads,
            causal,
        } => {
            want_params(0)?;
            plain(transformer::attention(args, hidden, heads, causal)?)
        }
        Op::Select { dim, index } => {
            want_params(0)?;
            plain(transformer::select(one()?, dim, index)?)
        }
    }
}

/// Training-mode batch norm: batch mean and biased variance over every dim
/// but 1; the running statistics move by [`BN_MOMENTUM`] towards the batch
/// mean and the UNBIASED batch variance (computed in f64, stored in the
/// params' dtype).
fn batch_norm(
    x: &Tensor,
    params: &[(&str, Tensor)],
    num_features: usize,
    eps: f64,
) -> Result<Applied> {
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
        bail!("expected more than 1 value per channel when training, got input of shape {dims:?}");
    }
    let reduce: Vec<usize> = (0..dims.len()).filter(|&d| d != 1).collect();
    let mut bshape = vec![1usize; dims.len()];
    bshape[1] = num_features;
    let mean = x.mean_keepdim(reduce.as_slice())?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(reduce.as_slice())?;
    let inv_std = var.affine(1.0, eps)?.sqrt()?.recip()?;
    let scale = inv_std.broadcast_mul(&params[0].1.reshape(bshape.as_slice())?)?;
    let out = xc
        .broadcast_mul(&scale)?
        .broadcast_add(&params[1].1.reshape(bshape.as_slice())?)?;
    let f64s = |t: &Tensor| t.detach().flatten_all()?.to_dtype(DType::F64);
    let dtype = params[2].1.dtype();
    let m = BN_MOMENTUM;
    let unbias = count as f64 / (count - 1) as f64;
    let new_mean = f64s(&params[2].1)?
        .affine(1.0 - m, 0.0)?
        .add(&f64s(&mean)?.affine(m, 0.0)?)?
        .to_dtype(dtype)?;
    let new_var = f64s(&params[3].1)?
        .affine(1.0 - m, 0.0)?
        .add(&f64s(&var)?.affine(m * unbias, 0.0)?)?
        .to_dtype(dtype)?;
    Ok(Applied {
        out,
        running: Some((new_mean, new_var)),
    })
}

fn pool(
    x: &Tensor,
    max: bool,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    ceil_mode: bool,
    count_include_pad: bool,
) -> Result<Tensor> {
    let pool = Pool2d {
        max,
        kernel,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
    };
    pool.geometry(x.dims())?;
    x.contiguous()?.apply_op1(pool)
}

/// PyTorch's adaptive bins, `[floor(i L / o), ceil((i + 1) L / o))`: each
/// output the mean of its bin (for `[1, 1]`, the mean over H and W).
fn adaptive_avg_pool2d(x: &Tensor, output_size: [usize; 2]) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    let [oh, ow] = output_size;
    if oh == 0 || ow == 0 || h == 0 || w == 0 {
        bail!("output size {output_size:?} of an input {h}x{w}: both must be positive");
    }
    if output_size == [1, 1] {
        return x.mean_keepdim((2, 3));
    }
    let bin = |i: usize, len: usize, o: usize| {
        let start = (i * len) / o;
        (start, ((i + 1) * len).div_ceil(o) - start)
    };
    let mut rows = Vec::with_capacity(oh);
    for oy in 0..oh {
        let (y0, ny) = bin(oy, h, oh);
        let band = x.narrow(2, y0, ny)?;
        let mut cols = Vec::with_capacity(ow);
        for ox in 0..ow {
            let (x0, nx) = bin(ox, w, ow);
            cols.push(band.narrow(3, x0, nx)?.mean_keepdim((2, 3))?);
        }
        rows.push(Tensor::cat(&cols, 3)?);
    }
    Tensor::cat(&rows, 2)
}
