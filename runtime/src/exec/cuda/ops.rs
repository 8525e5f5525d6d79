//! One layer on the device: the kernel launches and GEMMs of every op, with
//! the `cpu` executor's semantics (`models/OPS.md`). Everything is enqueued
//! on the compute stream; nothing here waits.

use std::sync::Arc;

use distmind_models::graph::{EmbeddingIds, GeluApprox};
use distmind_models::{Dtype, Op};

use super::driver::{Arg, DeviceBuffer, Gpu, Kernel};
use super::geometry::Window2d;
use super::kernels::REDUCE_THREADS;

/// Most blocks of a row-reduction launch (rows are grid-strided).
const ROW_BLOCKS_MAX: usize = 1 << 16;

/// An activation in device memory (row-major). `flatten` shares the buffer.
#[derive(Debug, Clone)]
pub(super) struct DevTensor {
    pub(super) buf: Arc<DeviceBuffer>,
    pub(super) shape: Vec<usize>,
    pub(super) dtype: Dtype,
}

impl DevTensor {
    pub(super) fn new(gpu: &Gpu, shape: Vec<usize>, dtype: Dtype) -> Result<Self, String> {
        let elems: usize = shape.iter().product();
        let buf = DeviceBuffer::new(gpu, elems * dtype_bytes(dtype))?;
        Ok(DevTensor {
            buf: Arc::new(buf),
            shape,
            dtype,
        })
    }

    pub(super) fn elems(&self) -> usize {
        self.shape.iter().product()
    }

    fn ptr(&self) -> Arg {
        Arg::Ptr(self.buf.ptr())
    }
}

pub(super) fn dtype_bytes(dtype: Dtype) -> usize {
    match dtype {
        Dtype::F32 => 4,
        Dtype::I64 => 8,
    }
}

fn n(v: usize) -> Arg {
    Arg::I64(v as i64)
}

/// A layer's params on the device: addresses in the arena, in op order.
pub(super) struct LayerParams<'a> {
    pub(super) ptrs: &'a [u64],
}

fn want_f32(x: &DevTensor) -> Result<(), String> {
    match x.dtype {
        Dtype::F32 => Ok(()),
        Dtype::I64 => Err(format!("input is i64 {:?}, expected f32", x.shape)),
    }
}

fn arity<'t>(args: &[&'t DevTensor], want: usize) -> Result<&'t DevTensor, String> {
    if args.len() != want {
        return Err(format!("has {} inputs, the op wants {want}", args.len()));
    }
    Ok(args[0])
}

fn dims4(x: &DevTensor) -> Result<[usize; 4], String> {
    match *x.shape.as_slice() {
        [n, c, h, w] => Ok([n, c, h, w]),
        _ => Err(format!("wants an NCHW input, got shape {:?}", x.shape)),
    }
}

fn param(p: &LayerParams<'_>, i: usize) -> Result<u64, String> {
    p.ptrs
        .get(i)
        .copied()
        .ok_or_else(|| format!("lacks param {i}"))
}

/// Enqueues `op` on `args`; `out_shape` is the shape inference's answer.
/// `per_image_conv`: a batch's convolutions as one GEMM per image
/// ([`CudaOptions::per_image_conv`](super::CudaOptions::per_image_conv)).
pub(super) fn run_layer(
    gpu: &Gpu,
    op: &Op,
    args: &[&DevTensor],
    out_shape: &[usize],
    params: LayerParams<'_>,
    per_image_conv: bool,
) -> Result<DevTensor, String> {
    let out = |shape: &[usize]| DevTensor::new(gpu, shape.to_vec(), Dtype::F32);
    let check_shape = |got: &[usize]| {
        if got != out_shape {
            return Err(format!(
                "computes shape {got:?}, the shape inference says {out_shape:?}"
            ));
        }
        Ok(())
    };
    match *op {
        Op::Conv2d {
            out_channels,
            kernel,
            stride,
            padding,
            bias,
            ..
        } => {
            let x = arity(args, 1)?;
            want_f32(x)?;
            let [batch, c, h, w] = dims4(x)?;
            let g = Window2d::conv(h, w, kernel, stride, padding)?;
            check_shape(&[batch, out_channels, g.oh, g.ow])?;
            let y = out(out_shape)?;
            let k = c * kernel[0] * kernel[1];
            let p = g.oh * g.ow;
            let pointwise = kernel == [1, 1] && stride == [1, 1] && padding == [0, 0];
            // More than one image: im2col lays the images side by side
            // ([c kh kw, batch, oh ow]) and one GEMM covers them all, then
            // its output [out, batch, oh ow] is swapped back to NCHW. cuBLAS
            // runs one wide GEMM far better than a strided batch of narrow
            // ones: as a batch of 2, ResNet-152's 3x3 convolutions took 3.4x
            // their time at batch 1 on an H200.
            let stacked = batch > 1 && !per_image_conv;
            let col = if pointwise && !stacked {
                None
            } else {
                let col = DeviceBuffer::new(gpu, batch * k * p * 4)?;
                gpu.launch_elems(
                    Kernel::Im2col,
                    batch * k * p,
                    &[
                        x.ptr(),
                        Arg::Ptr(col.ptr()),
                        n(batch),
                        n(c),
                        n(h),
                        n(w),
                        n(kernel[0]),
                        n(kernel[1]),
                        n(stride[0]),
                        n(stride[1]),
                        n(padding[0]),
                        n(padding[1]),
                        n(g.oh),
                        n(g.ow),
                    ],
                )?;
                Some(col)
            };
            let col_ptr = col.as_ref().map_or(x.buf.ptr(), DeviceBuffer::ptr);
            if stacked {
                // wide (out x batch P) = W (out x K) * col (K x batch P)
                let wide = DeviceBuffer::new(gpu, out_channels * batch * p * 4)?;
                gpu.gemm(
                    (out_channels, batch * p, k),
                    (param(&params, 0)?, false, 0),
                    (col_ptr, false, 0),
                    (wide.ptr(), 0),
                    1,
                )?;
                gpu.launch_elems(
                    Kernel::SwapOuter,
                    y.elems(),
                    &[
                        Arg::Ptr(wide.ptr()),
                        y.ptr(),
                        n(out_channels),
                        n(batch),
                        n(p),
                    ],
                )?;
                drop(wide); // stream-ordered: freed after the swap ran
            } else {
                // y[img] (out x P) = W (out x K) * col[img] (K x P); with
                // one image the layouts above are the same.
                gpu.gemm(
                    (out_channels, p, k),
                    (param(&params, 0)?, false, 0),
                    (col_ptr, false, k * p),
                    (y.buf.ptr(), out_channels * p),
                    batch,
                )?;
            }
            drop(col); // stream-ordered: freed after the GEMM ran
            if bias {
                gpu.launch_elems(
                    Kernel::BiasAdd,
                    y.elems(),
                    &[
                        y.ptr(),
                        Arg::Ptr(param(&params, 1)?),
                        n(y.elems()),
                        n(p),
                        n(out_channels),
                    ],
                )?;
            }
            Ok(y)
        }
        Op::BatchNorm { num_features, eps } => {
            let x = arity(args, 1)?;
            want_f32(x)?;
            if x.shape.len() < 2 || x.shape[1] != num_features {
                return Err(format!(
                    "input of shape {:?} does not have {num_features} channels in dim 1",
                    x.shape
                ));
            }
            check_shape(&x.shape)?;
            let y = out(out_shape)?;
            let plane: usize = x.shape[2..].iter().product();
            gpu.launch_elems(
                Kernel::BatchNorm,
                x.elems(),
                &[
                    x.ptr(),
                    Arg::Ptr(param(&params, 0)?),
                    Arg::Ptr(param(&params, 1)?),
                    Arg::Ptr(param(&params, 2)?),
                    Arg::Ptr(param(&params, 3)?),
                    Arg::F64(eps),
                    y.ptr(),
                    n(x.elems()),
                    n(plane),
                    n(num_features),
                ],
            )?;
            Ok(y)
        }
        Op::Relu | Op::Tanh | Op::Gelu { .. } => {
            let kernel = match *op {
                Op::Relu => Kernel::Relu,
                Op::Tanh => Kernel::Tanh,
                Op::Gelu {
                    approximate: GeluApprox::Erf,
                } => Kernel::GeluErf,
                _ => Kernel::GeluTanh,
            };
            let x = arity(args, 1)?;
            want_f32(x)?;
            check_shape(&x.shape)?;
            let y = out(out_shape)?;
            gpu.launch_elems(kernel, x.elems(), &[x.ptr(), y.ptr(), n(x.elems())])?;
            Ok(y)
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
            let x = arity(args, 1)?;
            want_f32(x)?;
            let [batch, c, h, w] = dims4(x)?;
            let g = Window2d::pool(h, w, kernel, stride, padding, ceil_mode)?;
            check_shape(&[batch, c, g.oh, g.ow])?;
            let y = out(out_shape)?;
            let mut a = vec![
                x.ptr(),
                y.ptr(),
                n(batch * c),
                n(h),
                n(w),
                n(g.oh),
                n(g.ow),
                n(kernel[0]),
                n(kernel[1]),
                n(stride[0]),
                n(stride[1]),
                n(padding[0]),
                n(padding[1]),
            ];
            let kernel = match *op {
                Op::AvgPool2d {
                    count_include_pad, ..
                } => {
                    a.push(Arg::I32(i32::from(count_include_pad)));
                    Kernel::AvgPool2d
                }
                _ => Kernel::MaxPool2d,
            };
            gpu.launch_elems(kernel, y.elems(), &a)?;
            Ok(y)
        }
        Op::AdaptiveAvgPool2d { output_size } => {
            let x = arity(args, 1)?;
            want_f32(x)?;
            let [batch, c, h, w] = dims4(x)?;
            let [oh, ow] = output_size;
            if oh == 0 || ow == 0 || h == 0 || w == 0 {
                return Err(format!(
                    "output size {output_size:?} of an input {h}x{w}: both must be positive"
                ));
            }
            check_shape(&[batch, c, oh, ow])?;
            let y = out(out_shape)?;
            gpu.launch_elems(
                Kernel::AdaptiveAvgPool2d,
                y.elems(),
                &[x.ptr(), y.ptr(), n(batch * c), n(h), n(w), n(oh), n(ow)],
            )?;
            Ok(y)
        }
        Op::Add => {
            let a = arity(args, 2)?;
            let b = args[1];
            want_f32(a)?;
            want_f32(b)?;
            if a.shape != b.shape {
                return Err(format!(
                    "adds {:?} and {:?}: shapes must be equal",
                    a.shape, b.shape
                ));
            }
            check_shape(&a.shape)?;
            let y = out(out_shape)?;
            gpu.launch_elems(
                Kernel::Add,
                a.elems(),
                &[a.ptr(), b.ptr(), y.ptr(), n(a.elems())],
            )?;
            Ok(y)
        }
        Op::Concat { dim } => {
            let Some(first) = args.first() else {
                return Err("concatenates no inputs".into());
            };
            for a in args {
                want_f32(a)?;
                let same = a.shape.len() == first.shape.len()
                    && dim < a.shape.len()
                    && a.shape
                        .iter()
                        .zip(&first.shape)
                        .enumerate()
                        .all(|(d, (x, y))| d == dim || x == y);
                if !same {
                    let shapes: Vec<_> = args.iter().map(|a| a.shape.clone()).collect();
                    return Err(format!(
                        "cannot concatenate shapes {shapes:?} along dim {dim}"
                    ));
                }
            }
            let mut shape = first.shape.clone();
            shape[dim] = args.iter().map(|a| a.shape[dim]).sum();
            check_shape(&shape)?;
            let y = out(out_shape)?;
            let outer: usize = shape[..dim].iter().product();
            let dst_inner: usize = shape[dim..].iter().product();
            let mut offset = 0;
            for a in args {
                let src_inner: usize = a.shape[dim..].iter().product();
                gpu.launch_elems(
                    Kernel::ConcatCopy,
                    outer * src_inner,
                    &[
                        a.ptr(),
                        y.ptr(),
                        n(outer),
                        n(src_inner),
                        n(dst_inner),
                        n(offset),
                    ],
                )?;
                offset += src_inner;
            }
            Ok(y)
        }
        Op::Flatten { start_dim } => {
            let x = arity(args, 1)?;
            if start_dim >= x.shape.len() {
                return Err(format!(
                    "flattens from dim {start_dim} a tensor of shape {:?}",
                    x.shape
                ));
            }
            let mut shape = x.shape[..start_dim].to_vec();
            shape.push(x.shape[start_dim..].iter().product());
            check_shape(&shape)?;
            Ok(DevTensor {
                buf: x.buf.clone(),
                shape,
                dtype: x.dtype,
            })
        }
        Op::Linear {
            in_features,
            out_features,
            bias,
            transposed,
        } => {
            let x = arity(args, 1)?;
            want_f32(x)?;
            if x.shape.last() != Some(&in_features) {
                return Err(format!(
                    "input of shape {:?} does not end in {in_features} features",
                    x.shape
                ));
            }
            let mut shape = x.shape.clone();
            *shape.last_mut().expect("non-empty") = out_features;
            check_shape(&shape)?;
            let y = out(out_shape)?;
            let rows = x.elems() / in_features;
            // y (rows x out) = x (rows x in) * W^T; W is stored [out, in]
            // (the transpose of the right operand) unless `transposed`.
            gpu.gemm(
                (rows, out_features, in_features),
                (x.buf.ptr(), false, 0),
                (param(&params, 0)?, !transposed, 0),
                (y.buf.ptr(), 0),
                1,
            )?;
            if bias {
                gpu.launch_elems(
                    Kernel::BiasAdd,
                    y.elems(),
                    &[
                        y.ptr(),
                        Arg::Ptr(param(&params, 1)?),
                        n(y.elems()),
                        n(1),
                        n(out_features),
                    ],
                )?;
            }
            Ok(y)
        }
        Op::Embedding {
            num_embeddings,
            embedding_dim,
            ids,
        } => {
            let x = arity(args, 1)?;
            let Some(&len) = x.shape.last() else {
                return Err("token ids must have at least one dimension".into());
            };
            let (mode, ids_ptr) = match ids {
                EmbeddingIds::Input => {
                    if x.dtype != Dtype::I64 {
                        return Err(format!(
                            "input is f32 {:?}, expected i64 token ids",
                            x.shape
                        ));
                    }
                    (0, x.buf.ptr())
                }
                EmbeddingIds::Positions => {
                    if len > num_embeddings {
                        return Err(format!(
                            "sequence length {len} exceeds the {num_embeddings} positions"
                        ));
                    }
                    (1, 0)
                }
                EmbeddingIds::Zeros => (2, 0),
            };
            let mut shape = x.shape.clone();
            shape.push(embedding_dim);
            check_shape(&shape)?;
            let y = out(out_shape)?;
            gpu.launch_elems(
                Kernel::Embedding,
                y.elems(),
                &[
                    Arg::Ptr(ids_ptr),
                    Arg::Ptr(param(&params, 0)?),
                    y.ptr(),
                    n(x.elems()),
                    n(len),
                    n(embedding_dim),
                    n(num_embeddings),
                    Arg::I32(mode),
                ],
            )?;
            Ok(y)
        }
        Op::LayerNorm {
            normalized_size,
            eps,
        } => {
            let x = arity(args, 1)?;
            want_f32(x)?;
            if x.shape.last() != Some(&normalized_size) || normalized_size == 0 {
                return Err(format!(
                    "input of shape {:?} does not end in {normalized_size} features",
                    x.shape
                ));
            }
            check_shape(&x.shape)?;
            let y = out(out_shape)?;
            let rows = x.elems() / normalized_size;
            gpu.launch(
                Kernel::LayerNorm,
                rows.clamp(1, ROW_BLOCKS_MAX) as u32,
                REDUCE_THREADS,
                &[
                    x.ptr(),
                    Arg::Ptr(param(&params, 0)?),
                    Arg::Ptr(param(&params, 1)?),
                    y.ptr(),
                    n(rows),
                    n(normalized_size),
                    Arg::F64(eps),
                ],
            )?;
            Ok(y)
        }
        Op::Attention {
            hidden,
            heads,
            causal,
        } => attention(gpu, args, hidden, heads, causal, out_shape),
        Op::Select { dim, index } => {
            let x = arity(args, 1)?;
            want_f32(x)?;
            if dim >= x.shape.len() || index >= x.shape[dim] {
                return Err(format!(
                    "selects index {index} of dim {dim} of a tensor of shape {:?}",
                    x.shape
                ));
            }
            let mut shape = x.shape.clone();
            shape.remove(dim);
            check_shape(&shape)?;
            let y = out(out_shape)?;
            let outer: usize = x.shape[..dim].iter().product();
            let inner: usize = x.shape[dim + 1..].iter().product();
            gpu.launch_elems(
                Kernel::Select,
                outer * inner,
                &[
                    x.ptr(),
                    y.ptr(),
                    n(outer),
                    n(x.shape[dim]),
                    n(inner),
                    n(index),
                ],
            )?;
            Ok(y)
        }
    }
}

/// `softmax(q k^T / sqrt(d) [+ causal mask]) v` per head: split heads into
/// `[N, h, L, d]`, two strided-batched GEMMs around the softmax kernel,
/// merge heads back to `[N, L, H]`.
fn attention(
    gpu: &Gpu,
    args: &[&DevTensor],
    hidden: usize,
    heads: usize,
    causal: bool,
    out_shape: &[usize],
) -> Result<DevTensor, String> {
    if heads == 0 || !hidden.is_multiple_of(heads) {
        return Err(format!(
            "hidden size {hidden} is not a multiple of {heads} heads"
        ));
    }
    // (tensor, row stride, column offset) of q, k and v.
    let (sources, batch, len) = match args {
        [qkv] => {
            want_f32(qkv)?;
            let &[batch, len, width] = qkv.shape.as_slice() else {
                return Err(format!(
                    "fused qkv input has shape {:?}, expected [N, L, {}]",
                    qkv.shape,
                    3 * hidden
                ));
            };
            if width != 3 * hidden {
                return Err(format!(
                    "fused qkv input has shape {:?}, expected [N, L, {}]",
                    qkv.shape,
                    3 * hidden
                ));
            }
            let w = 3 * hidden;
            (
                [(*qkv, w, 0), (*qkv, w, hidden), (*qkv, w, 2 * hidden)],
                batch,
                len,
            )
        }
        [q, k, v] => {
            for t in [q, k, v] {
                want_f32(t)?;
            }
            let ok = q.shape.len() == 3
                && q.shape[2] == hidden
                && k.shape == q.shape
                && v.shape == q.shape;
            if !ok {
                return Err(format!(
                    "q, k, v have shapes {:?}, {:?}, {:?}, expected three equal [N, L, {hidden}]",
                    q.shape, k.shape, v.shape
                ));
            }
            (
                [(*q, hidden, 0), (*k, hidden, 0), (*v, hidden, 0)],
                q.shape[0],
                q.shape[1],
            )
        }
        _ => {
            return Err(format!(
                "has {} inputs, expected q, k, v or one fused qkv",
                args.len()
            ))
        }
    };
    if out_shape != [batch, len, hidden] {
        return Err(format!(
            "computes shape {:?}, the shape inference says {out_shape:?}",
            [batch, len, hidden]
        ));
    }
    let d = hidden / heads;
    let b = batch * heads;
    let head_elems = b * len * d;
    let split = |(t, row_stride, col): (&DevTensor, usize, usize)| -> Result<DeviceBuffer, String> {
        let dst = DeviceBuffer::new(gpu, head_elems * 4)?;
        gpu.launch_elems(
            Kernel::SplitHeads,
            head_elems,
            &[
                t.ptr(),
                Arg::Ptr(dst.ptr()),
                n(batch),
                n(len),
                n(heads),
                n(d),
                n(row_stride),
                n(col),
            ],
        )?;
        Ok(dst)
    };
    let [qs, ks, vs] = sources;
    let (q, k, v) = (split(qs)?, split(ks)?, split(vs)?);
    // scores[b] (L x L) = q[b] (L x d) * k[b]^T; k is stored L x d, the
    // transpose of the right operand.
    let scores = DeviceBuffer::new(gpu, b * len * len * 4)?;
    gpu.gemm(
        (len, len, d),
        (q.ptr(), false, len * d),
        (k.ptr(), true, len * d),
        (scores.ptr(), len * len),
        b,
    )?;
    let rows = b * len;
    gpu.launch(
        Kernel::SoftmaxRows,
        rows.clamp(1, ROW_BLOCKS_MAX) as u32,
        REDUCE_THREADS,
        &[
            Arg::Ptr(scores.ptr()),
            n(rows),
            n(len),
            Arg::F32((d as f32).sqrt()),
            Arg::I32(i32::from(causal)),
        ],
    )?;
    // heads[b] (L x d) = probs[b] (L x L) * v[b] (L x d); reuse q's memory.
    gpu.gemm(
        (len, d, len),
        (scores.ptr(), false, len * len),
        (v.ptr(), false, len * d),
        (q.ptr(), len * d),
        b,
    )?;
    let y = DevTensor::new(gpu, out_shape.to_vec(), Dtype::F32)?;
    gpu.launch_elems(
        Kernel::MergeHeads,
        head_elems,
        &[Arg::Ptr(q.ptr()), y.ptr(), n(batch), n(len), n(heads), n(d)],
    )?;
    Ok(y)
}
