//! Multi-head scaled dot-product attention (`OPS.md` `attention`): the
//! projections are separate `linear` layers, so this is only
//! `softmax(q k^T / sqrt(d) [+ causal mask]) v` per head.

use candle_core::{bail, Result, Tensor};

use super::ops::{from_f32, with_f32};
use crate::exec::candle_ops::attention_heads;

/// `args` is `[q, k, v]`, each `[N, L, hidden]`, or one fused `[N, L, 3 hidden]`.
pub(super) fn attention(
    args: &[Tensor],
    hidden: usize,
    heads: usize,
    causal: bool,
) -> Result<Tensor> {
    let [q, k, v] = attention_heads(args, hidden, heads)?;
    let (n, _, len, d) = q.dims4()?;
    let scores = q.matmul(&k.t()?)?;
    let probs = softmax_rows(&scores, len, (d as f32).sqrt(), causal)?;
    probs.matmul(&v)?.transpose(1, 2)?.reshape((n, len, hidden))
}

/// Softmax over the last dim of `scores / scale` (`[.., L, L]`); with
/// `causal`, key `j > i` of query `i` gets probability 0 (a -inf score).
pub(super) fn softmax_rows(
    scores: &Tensor,
    len: usize,
    scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let dims = scores.dims().to_vec();
    if dims.len() < 2 || dims[dims.len() - 1] != len || dims[dims.len() - 2] != len {
        bail!("attention scores of shape {dims:?} are not [.., {len}, {len}]");
    }
    with_f32(scores, |src| {
        let mut out = vec![0f32; src.len()];
        for (r, (row, dst)) in src
            .chunks_exact(len)
            .zip(out.chunks_exact_mut(len))
            .enumerate()
        {
            let query = r % len;
            let keys = if causal { query + 1 } else { len };
            let mut max = f32::NEG_INFINITY;
            for (o, &s) in dst[..keys].iter_mut().zip(&row[..keys]) {
                *o = s / scale;
                max = max.max(*o);
            }
            let mut sum = 0f32;
            for o in &mut dst[..keys] {
                *o = (*o - max).exp();
                sum += *o;
            }
            for o in &mut dst[..keys] {
                *o /= sum;
            }
        }
        from_f32(out, &dims)
    })
}
