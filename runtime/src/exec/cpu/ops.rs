//! The kernels of every op but `attention`, with `OPS.md`'s semantics.
//!
//! Heavy ops (conv2d, linear) go through candle (im2col + gemm, all cores);
//! cheap per-element ops whose exact PyTorch semantics candle lacks (pooling
//! with padding and `ceil_mode`, batch norm, layer norm, embedding) are plain
//! loops over the contiguous f32 data.

use candle_core::{bail, CpuStorage, DType, Device, Result, Storage, Tensor};
use distmind_models::graph::{EmbeddingIds, GeluApprox};
use distmind_models::Op;

use super::attention::attention;
use super::params::Prepared;
use crate::exec::candle_ops::{self, conv2d};
use crate::exec::HostTensor;

/// Runs one layer: `op` on `args` (its inputs in order) with its prepared params.
pub(super) fn apply(op: &Op, args: &[Tensor], params: Option<&Prepared>) -> Result<Tensor> {
    let arity = |want: usize| -> Result<&Tensor> {
        if args.len() != want {
            bail!("has {} inputs, the op wants {want}", args.len());
        }
        Ok(&args[0])
    };
    match (op, params) {
        (
            &Op::Conv2d {
                stride, padding, ..
            },
            Some(Prepared::Conv { weight, bias }),
        ) => conv2d(float(arity(1)?)?, weight, bias.as_ref(), stride, padding),
        (&Op::BatchNorm { .. }, Some(Prepared::BatchNorm { scale, shift })) => {
            batch_norm(arity(1)?, scale, shift)
        }
        (&Op::Relu, None) => map_f32(arity(1)?, |v| v.max(0.0)),
        (&Op::Tanh, None) => float(arity(1)?)?.tanh(),
        (&Op::Gelu { approximate }, None) => match approximate {
            GeluApprox::Erf => float(arity(1)?)?.gelu_erf(),
            GeluApprox::Tanh => float(arity(1)?)?.gelu(),
        },
        (
            &Op::MaxPool2d {
                kernel,
                stride,
                padding,
                ceil_mode,
            },
            None,
        ) => max_pool2d(arity(1)?, kernel, stride, padding, ceil_mode),
        (
            &Op::AvgPool2d {
                kernel,
                stride,
                padding,
                ceil_mode,
                count_include_pad,
            },
            None,
        ) => avg_pool2d(
            arity(1)?,
            kernel,
            stride,
            padding,
            ceil_mode,
            count_include_pad,
        ),
        (&Op::AdaptiveAvgPool2d { output_size }, None) => {
            adaptive_avg_pool2d(arity(1)?, output_size)
        }
        (&Op::Add, None) => {
            let a = float(arity(2)?)?;
            let b = float(&args[1])?;
            if a.dims() != b.dims() {
                bail!(
                    "adds {:?} and {:?}: shapes must be equal",
                    a.dims(),
                    b.dims()
                );
            }
            add(a, b)
        }
        (&Op::Concat { dim }, None) => concat(args, dim),
        (&Op::Flatten { start_dim }, None) => {
            let x = arity(1)?;
            if start_dim >= x.rank() {
                bail!(
                    "flattens from dim {start_dim} a tensor of shape {:?}",
                    x.dims()
                );
            }
            x.flatten_from(start_dim)
        }
        (&Op::Linear { in_features, .. }, Some(Prepared::Linear { weight_t, bias })) => {
            linear(arity(1)?, in_features, weight_t, bias.as_ref())
        }
        (
            &Op::Embedding { .. },
            Some(Prepared::Embedding {
                weight,
                num,
                dim,
                ids,
            }),
        ) => {
            let ids_in = arity(1)?;
            with_f32(weight, |w| embedding(ids_in, w, *num, *dim, *ids))
        }
        (&Op::LayerNorm { .. }, Some(Prepared::LayerNorm { weight, bias, eps })) => {
            layer_norm(arity(1)?, weight, bias, *eps)
        }
        (
            &Op::Attention {
                hidden,
                heads,
                causal,
            },
            None,
        ) => attention(args, hidden, heads, causal),
        (&Op::Select { dim, index }, None) => {
            let x = arity(1)?;
            if dim >= x.rank() || index >= x.dims()[dim] {
                bail!(
                    "selects index {index} of dim {dim} of a tensor of shape {:?}",
                    x.dims()
                );
            }
            x.narrow(dim, index, 1)?.squeeze(dim)?.contiguous()
        }
        (op, _) => bail!(
            "op {} got params it does not take, or lacks its params",
            op.name()
        ),
    }
}

/// `x` itself, checked to be f32.
fn float(x: &Tensor) -> Result<&Tensor> {
    if x.dtype() != DType::F32 {
        bail!("input is {:?} {:?}, expected f32", x.dtype(), x.dims());
    }
    Ok(x)
}

/// Calls `f` on the row-major f32 values of `x`.
pub(super) fn with_f32<R>(x: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let x = float(x)?.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        bail!("input is not an f32 tensor in host memory");
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("input is not contiguous after a contiguous copy");
    };
    f(&data[start..end])
}

/// Calls `f` on the row-major i64 values of `x`.
fn with_i64<R>(x: &Tensor, f: impl FnOnce(&[i64]) -> Result<R>) -> Result<R> {
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    let Storage::Cpu(CpuStorage::I64(data)) = &*storage else {
        bail!(
            "input is {:?} {:?}, expected i64 token ids",
            x.dtype(),
            x.dims()
        );
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("input is not contiguous after a contiguous copy");
    };
    f(&data[start..end])
}

/// `f` on every element (a plain loop: candle's relu and add were 10x
/// slower than this on ResNet-152's activations).
fn map_f32(x: &Tensor, f: impl Fn(f32) -> f32) -> Result<Tensor> {
    with_f32(x, |src| {
        from_f32(src.iter().map(|&v| f(v)).collect(), x.dims())
    })
}

fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    with_f32(a, |a_vals| {
        with_f32(b, |b_vals| {
            from_f32(
                a_vals.iter().zip(b_vals).map(|(x, y)| x + y).collect(),
                a.dims(),
            )
        })
    })
}

pub(super) fn from_f32(data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// A tensor's values as a [`HostTensor`] (f32 or i64).
pub(super) fn to_host(t: &Tensor) -> Result<HostTensor> {
    let shape = t.dims().to_vec();
    match t.dtype() {
        DType::F32 => Ok(HostTensor::f32(shape, t.flatten_all()?.to_vec1::<f32>()?)),
        DType::I64 => Ok(HostTensor::i64(shape, t.flatten_all()?.to_vec1::<i64>()?)),
        other => bail!("tensor of dtype {other:?} has no host form"),
    }
}

fn dims4(x: &Tensor, what: &str) -> Result<(usize, usize, usize, usize)> {
    match *x.dims() {
        [n, c, h, w] => Ok((n, c, h, w)),
        _ => bail!("{what} wants an NCHW input, got shape {:?}", x.dims()),
    }
}

fn batch_norm(x: &Tensor, scale: &[f32], shift: &[f32]) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    if dims.len() < 2 || dims[1] != scale.len() {
        bail!(
            "input of shape {dims:?} does not have {} channels in dim 1",
            scale.len()
        );
    }
    let plane: usize = dims[2..].iter().product();
    with_f32(x, |src| {
        let mut out = Vec::with_capacity(src.len());
        for (i, chunk) in src.chunks_exact(plane.max(1)).enumerate() {
            let c = i % scale.len();
            let (a, b) = (scale[c], shift[c]);
            out.extend(chunk.iter().map(|&v| v * a + b));
        }
        from_f32(out, &dims)
    })
}

/// PyTorch's pooled length, `ceil_mode` rule included.
pub(super) fn pool_out_len(
    len: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    ceil_mode: bool,
) -> Result<usize> {
    if kernel == 0 || stride == 0 {
        bail!("kernel {kernel} and stride {stride} must be positive");
    }
    if pad > kernel / 2 {
        bail!("padding {pad} exceeds half the kernel {kernel}");
    }
    let Some(span) = (len + 2 * pad).checked_sub(kernel) else {
        bail!("input length {len} with padding {pad} is smaller than the kernel {kernel}");
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

/// Geometry of a 2-d pooling over NCHW.
struct Pool {
    planes: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
}

impl Pool {
    fn new(
        x: &Tensor,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        ceil_mode: bool,
    ) -> Result<Pool> {
        let (n, c, h, w) = dims4(x, "pooling")?;
        Ok(Pool {
            planes: n * c,
            h,
            w,
            oh: pool_out_len(h, kernel[0], stride[0], padding[0], ceil_mode)?,
            ow: pool_out_len(w, kernel[1], stride[1], padding[1], ceil_mode)?,
            kernel,
            stride,
            padding,
        })
    }

    /// Window `o` along axis `a`: (start, end) in padded coordinates (end
    /// clipped to `len + pad`, as PyTorch's avg_pool does), as signed values.
    fn window(&self, a: usize, o: usize) -> (isize, isize) {
        let len = [self.h, self.w][a] as isize;
        let pad = self.padding[a] as isize;
        let start = (o * self.stride[a]) as isize - pad;
        let end = (start + self.kernel[a] as isize).min(len + pad);
        (start, end)
    }

    /// Runs `f(plane, window rows, window cols, padded window size)` for every
    /// output element; rows and columns are clipped to the input.
    fn map(
        &self,
        src: &[f32],
        mut f: impl FnMut(&[f32], std::ops::Range<usize>, std::ops::Range<usize>, usize) -> f32,
    ) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.planes * self.oh * self.ow);
        let clip =
            |(s, e): (isize, isize), len: usize| s.max(0) as usize..(e.max(0) as usize).min(len);
        for plane in src.chunks_exact(self.h * self.w) {
            for oy in 0..self.oh {
                let ry = self.window(0, oy);
                for ox in 0..self.ow {
                    let rx = self.window(1, ox);
                    let padded = ((ry.1 - ry.0) * (rx.1 - rx.0)) as usize;
                    out.push(f(plane, clip(ry, self.h), clip(rx, self.w), padded));
                }
            }
        }
        out
    }
}

/// Max pooling; padding counts as -inf, a NaN in a window wins (PyTorch).
pub(super) fn max_pool2d(
    x: &Tensor,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    ceil_mode: bool,
) -> Result<Tensor> {
    let pool = Pool::new(float(x)?, kernel, stride, padding, ceil_mode)?;
    let w = pool.w;
    let n_c = x.dims()[..2].to_vec();
    with_f32(x, |src| {
        let out = pool.map(src, |plane, rows, cols, _| {
            let mut m = f32::NEG_INFINITY;
            for y in rows {
                for &v in &plane[y * w + cols.start..y * w + cols.end] {
                    if v > m || v.is_nan() {
                        m = v;
                    }
                }
            }
            m
        });
        from_f32(out, &[n_c[0], n_c[1], pool.oh, pool.ow])
    })
}

/// Average pooling. With `count_include_pad` the divisor is the window
/// clipped to the padded input (`kh * kw` unless a `ceil_mode` window hangs
/// past the padding, PyTorch's rule); without, the in-bounds count.
pub(super) fn avg_pool2d(
    x: &Tensor,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    ceil_mode: bool,
    count_include_pad: bool,
) -> Result<Tensor> {
    let pool = Pool::new(float(x)?, kernel, stride, padding, ceil_mode)?;
    let w = pool.w;
    let n_c = x.dims()[..2].to_vec();
    with_f32(x, |src| {
        let out = pool.map(src, |plane, rows, cols, padded| {
            let count = if count_include_pad {
                padded
            } else {
                rows.len() * cols.len()
            };
            let mut sum = 0f32;
            for y in rows {
                sum += plane[y * w + cols.start..y * w + cols.end]
                    .iter()
                    .sum::<f32>();
            }
            sum / count as f32
        });
        from_f32(out, &[n_c[0], n_c[1], pool.oh, pool.ow])
    })
}

/// PyTorch's adaptive bins: `[floor(i L / o), ceil((i + 1) L / o))`.
pub(super) fn adaptive_avg_pool2d(x: &Tensor, output_size: [usize; 2]) -> Result<Tensor> {
    let (n, c, h, w) = dims4(float(x)?, "adaptive_avg_pool2d")?;
    let [oh, ow] = output_size;
    if oh == 0 || ow == 0 || h == 0 || w == 0 {
        bail!("output size {output_size:?} of an input {h}x{w}: both must be positive");
    }
    let bin = |i: usize, len: usize, o: usize| (i * len) / o..((i + 1) * len).div_ceil(o);
    with_f32(x, |src| {
        let mut out = Vec::with_capacity(n * c * oh * ow);
        for plane in src.chunks_exact(h * w) {
            for oy in 0..oh {
                let rows = bin(oy, h, oh);
                for ox in 0..ow {
                    let cols = bin(ox, w, ow);
                    let count = rows.len() * cols.len();
                    let mut sum = 0f32;
                    for y in rows.clone() {
                        sum += plane[y * w + cols.start..y * w + cols.end]
                            .iter()
                            .sum::<f32>();
                    }
                    out.push(sum / count as f32);
                }
            }
        }
        from_f32(out, &[n, c, oh, ow])
    })
}

fn concat(args: &[Tensor], dim: usize) -> Result<Tensor> {
    for a in args {
        float(a)?;
    }
    candle_ops::concat(args, dim)
}

/// `y = x W^T + b` over the last dim, with `weight_t = W^T` (`[in, out]`).
fn linear(
    x: &Tensor,
    in_features: usize,
    weight_t: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    candle_ops::linear(float(x)?, in_features, weight_t, bias)
}

/// Looks up rows of `weight` (`[num, dim]`); the output is `ids.shape + [dim]`.
pub(super) fn embedding(
    ids: &Tensor,
    weight: &[f32],
    num: usize,
    dim: usize,
    mode: EmbeddingIds,
) -> Result<Tensor> {
    let mut out_dims = ids.dims().to_vec();
    let Some(&len) = out_dims.last() else {
        bail!("token ids must have at least one dimension");
    };
    out_dims.push(dim);
    let count = ids.elem_count();
    let row = |r: usize| &weight[r * dim..(r + 1) * dim];
    let mut out = Vec::with_capacity(count * dim);
    match mode {
        EmbeddingIds::Input => with_i64(ids, |ids| {
            for &id in ids {
                if id < 0 || id as u64 >= num as u64 {
                    bail!("token id {id} is outside the vocabulary 0..{num}");
                }
                out.extend_from_slice(row(id as usize));
            }
            Ok(())
        })?,
        EmbeddingIds::Positions => {
            if len > num {
                bail!("sequence length {len} exceeds the {num} positions");
            }
            for i in 0..count {
                out.extend_from_slice(row(i % len));
            }
        }
        EmbeddingIds::Zeros => {
            for _ in 0..count {
                out.extend_from_slice(row(0));
            }
        }
    }
    from_f32(out, &out_dims)
}

/// Normalises over the last dim with the biased variance.
pub(super) fn layer_norm(x: &Tensor, weight: &[f32], bias: &[f32], eps: f64) -> Result<Tensor> {
    let dims = float(x)?.dims().to_vec();
    let d = weight.len();
    if dims.last() != Some(&d) || d == 0 {
        bail!("input of shape {dims:?} does not end in {d} features");
    }
    with_f32(x, |src| {
        let mut out = Vec::with_capacity(src.len());
        for row in src.chunks_exact(d) {
            let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
            let var = row
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / d as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            out.extend(
                row.iter()
                    .zip(weight.iter().zip(bias))
                    .map(|(&v, (&g, &b))| ((f64::from(v) - mean) * rstd) as f32 * g + b),
            );
        }
        from_f32(out, &dims)
    })
}
