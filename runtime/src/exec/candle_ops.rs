//! Graph pieces written once on candle tensors, for the `cpu` executor's
//! inference and for training (on whatever device its tensors live; every
//! op here is one candle differentiates).

use candle_core::{bail, Result, Tensor};

/// `torch.nn.functional.conv2d` with dilation 1 and groups 1, on NCHW `x`;
/// `bias`, if any, broadcast onto the output (`[1, C, 1, 1]`).
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: [usize; 2],
    padding: [usize; 2],
) -> Result<Tensor> {
    let &[_, c, h, w] = x.dims() else {
        bail!("conv2d wants an NCHW input, got shape {:?}", x.dims());
    };
    let (_, c_in, kh, kw) = weight.dims4()?;
    if c != c_in {
        bail!("input has {c} channels, the weight wants {c_in}");
    }
    if h + 2 * padding[0] < kh || w + 2 * padding[1] < kw {
        bail!("input {h}x{w} with padding {padding:?} is smaller than the kernel {kh}x{kw}");
    }
    if stride[0] == 0 || stride[1] == 0 {
        bail!("stride {stride:?} must be positive");
    }
    let out = if padding[0] == padding[1] && stride[0] == stride[1] {
        x.conv2d(weight, padding[0], stride[0], 1, 1)?
    } else {
        // candle takes one padding and one stride for both dims: pad here,
        // and subsample rows or columns of a stride-1 result if needed.
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
    match bias {
        Some(b) => out.broadcast_add(b),
        None => Ok(out),
    }
}

/// Every `step`-th index of `dim`, from 0.
fn subsample(x: &Tensor, dim: usize, step: usize) -> Result<Tensor> {
    if step == 1 {
        return Ok(x.clone());
    }
    let len = x.dims()[dim];
    let ids: Vec<u32> = (0..len).step_by(step).map(|i| i as u32).collect();
    let ids = Tensor::from_vec(ids, len.div_ceil(step), x.device())?;
    x.index_select(&ids, dim)
}

/// Attention's inputs (`OPS.md` `attention`) split into heads: `args` is
/// `[q, k, v]`, each `[N, L, hidden]`, or one fused `[N, L, 3 hidden]`;
/// returns q, k and v as `[N, heads, L, hidden / heads]`, contiguous.
pub(crate) fn attention_heads(args: &[Tensor], hidden: usize, heads: usize) -> Result<[Tensor; 3]> {
    if heads == 0 || !hidden.is_multiple_of(heads) {
        bail!("hidden size {hidden} is not a multiple of {heads} heads");
    }
    let (q, k, v) = match args {
        [qkv] => {
            if !matches!(*qkv.dims(), [_, _, w] if w == 3 * hidden) {
                bail!(
                    "fused qkv input has shape {:?}, expected [N, L, {}]",
                    qkv.dims(),
                    3 * hidden
                );
            }
            (
                qkv.narrow(2, 0, hidden)?,
                qkv.narrow(2, hidden, hidden)?,
                qkv.narrow(2, 2 * hidden, hidden)?,
            )
        }
        [q, k, v] => {
            let ok = q.rank() == 3
                && q.dims()[2] == hidden
                && k.dims() == q.dims()
                && v.dims() == q.dims();
            if !ok {
                let shapes: Vec<_> = args.iter().map(|a| a.dims().to_vec()).collect();
                bail!("q, k, v have shapes {shapes:?}, expected three equal [N, L, {hidden}]");
            }
            (q.clone(), k.clone(), v.clone())
        }
        _ => bail!(
            "has {} inputs, expected q, k, v or one fused qkv",
            args.len()
        ),
    };
    let (n, len, _) = q.dims3()?;
    let d = hidden / heads;
    // [N, L, H] -> [N, h, L, d]
    let split = |t: &Tensor| t.reshape((n, len, heads, d))?.transpose(1, 2)?.contiguous();
    Ok([split(&q)?, split(&k)?, split(&v)?])
}

/// Joins `args` along `dim`; every other dim must match.
pub(crate) fn concat(args: &[Tensor], dim: usize) -> Result<Tensor> {
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

/// `y = x W^T + b` over the last dim, with `weight_t = W^T` (`[in, out]`).
pub(crate) fn linear(
    x: &Tensor,
    in_features: usize,
    weight_t: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    if dims.last() != Some(&in_features) {
        bail!("input of shape {dims:?} does not end in {in_features} features");
    }
    let out_features = weight_t.dims()[1];
    let rows = x.elem_count() / in_features;
    let mut y = x.reshape((rows, in_features))?.matmul(weight_t)?;
    if let Some(b) = bias {
        y = y.broadcast_add(b)?;
    }
    let mut out_dims = dims;
    *out_dims.last_mut().expect("non-empty") = out_features;
    y.reshape(out_dims)
}
