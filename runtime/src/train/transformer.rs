//! The transformer ops in training mode, with `OPS.md`'s semantics (those
//! of the cpu executor's inference kernels), built from candle ops that
//! carry gradients, or with their own exact backward (`gelu`).

use candle_core::op::{Gelu as GeluTanhOp, GeluErf as GeluErfOp, UnaryOpT};
use candle_core::{
    bail, CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, WithDType, D,
};
use distmind_models::graph::{EmbeddingIds, GeluApprox};

/// Rows of `weight` (`[num, dim]`, a variable): the output is
/// `ids.shape + [dim]`. The gradient goes to the table's rows (summed over
/// repeated ids), never to the ids.
pub(super) fn embedding(
    ids: &Tensor,
    weight: &Tensor,
    num: usize,
    dim: usize,
    mode: EmbeddingIds,
) -> Result<Tensor> {
    let mut out_dims = ids.dims().to_vec();
    let Some(&len) = out_dims.last() else {
        bail!("token ids must have at least one dimension");
    };
    out_dims.push(dim);
    match mode {
        EmbeddingIds::Input => {
            if ids.dtype() != DType::I64 {
                bail!(
                    "input is {:?} {:?}, expected i64 token ids",
                    ids.dtype(),
                    ids.dims()
                );
            }
            let flat = ids.flatten_all()?;
            let values = flat.to_vec1::<i64>()?;
            if let Some(id) = values.iter().find(|&&id| id < 0 || id as u64 >= num as u64) {
                bail!("token id {id} is outside the vocabulary 0..{num}");
            }
            weight.index_select(&flat, 0)?.reshape(out_dims)
        }
        EmbeddingIds::Positions => {
            if len > num {
                bail!("sequence length {len} exceeds the {num} positions");
            }
            weight.narrow(0, 0, len)?.broadcast_as(out_dims)
        }
        EmbeddingIds::Zeros => weight.narrow(0, 0, 1)?.broadcast_as(out_dims),
    }
}

/// Normalises over the last dim with the biased variance:
/// `(x - mean) / sqrt(var + eps) * weight + bias`.
pub(super) fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let d = weight.dims1()?;
    if x.dims().last() != Some(&d) || d == 0 {
        bail!("input of shape {:?} does not end in {d} features", x.dims());
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = var.affine(1.0, eps)?.sqrt()?.recip()?;
    xc.broadcast_mul(&rstd)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
}

/// `gelu` with candle's forward (the inference kernel's, to the bit) and
/// the exact derivative (candle's own backward rounds its constants to 6
/// digits, which an f64 gradient check sees).
#[derive(Debug, Clone, Copy)]
pub(super) struct Gelu(pub(super) GeluApprox);

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_TANH_CUBIC: f64 = 0.044715;

impl Gelu {
    fn value<T: WithDType>(self, v: T) -> T {
        // Same kernels as `Tensor::gelu` / `Tensor::gelu_erf`.
        match (self.0, T::DTYPE) {
            (GeluApprox::Erf, DType::F32) => {
                T::from_f64(f64::from(GeluErfOp::f32(v.to_f64() as f32)))
            }
            (GeluApprox::Erf, _) => T::from_f64(GeluErfOp::f64(v.to_f64())),
            (GeluApprox::Tanh, DType::F32) => {
                T::from_f64(f64::from(GeluTanhOp::f32(v.to_f64() as f32)))
            }
            (GeluApprox::Tanh, _) => T::from_f64(GeluTanhOp::f64(v.to_f64())),
        }
    }

    /// d gelu / dx at `x`, in f64.
    fn derivative(self, x: f64) -> f64 {
        match self.0 {
            // Phi(x) + x phi(x).
            GeluApprox::Erf => {
                let cdf =
                    0.5 * (1.0 + candle_core::cpu::erf::erf_f64(x / std::f64::consts::SQRT_2));
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                cdf + x * pdf
            }
            // y = x/2 (1 + tanh(u)), u = k (x + c x^3).
            GeluApprox::Tanh => {
                let t = (SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x)).tanh();
                0.5 * (1.0 + t)
                    + 0.5
                        * x
                        * (1.0 - t * t)
                        * SQRT_2_OVER_PI
                        * (1.0 + 3.0 * GELU_TANH_CUBIC * x * x)
            }
        }
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        match self.0 {
            GeluApprox::Erf => "train-gelu-erf",
            GeluApprox::Tanh => "train-gelu-tanh",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("gelu input is not contiguous");
        };
        let out = match s {
            CpuStorage::F32(v) => {
                CpuStorage::F32(v[start..end].iter().map(|&x| self.value(x)).collect())
            }
            CpuStorage::F64(v) => {
                CpuStorage::F64(v[start..end].iter().map(|&x| self.value(x)).collect())
            }
            _ => bail!("gelu supports f32 and f64 only"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let x = arg
            .detach()
            .flatten_all()?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let g = grad
            .detach()
            .flatten_all()?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let d: Vec<f64> = x
            .iter()
            .zip(&g)
            .map(|(&x, &g)| g * self.derivative(x))
            .collect();
        Ok(Some(
            Tensor::from_vec(d, arg.shape(), arg.device())?.to_dtype(arg.dtype())?,
        ))
    }
}

pub(super) fn gelu(x: &Tensor, approximate: GeluApprox) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu(approximate))
}

/// Multi-head scaled dot-product attention: `args` is `[q, k, v]`, each
/// `[N, L, hidden]`, or one fused `[N, L, 3 hidden]`. With `causal`, key
/// `j > i` of query `i` gets a -inf score (probability 0, gradient 0).
pub(super) fn attention(
    args: &[Tensor],
    hidden: usize,
    heads: usize,
    causal: bool,
) -> Result<Tensor> {
    let [q, k, v] = crate::exec::candle_ops::attention_heads(args, hidden, heads)?;
    let (n, _, len, d) = q.dims4()?;
    let mut scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    if causal {
        scores = scores.broadcast_add(&causal_mask(len, scores.dtype(), scores.device())?)?;
    }
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&max)?.exp()?;
    let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    probs.matmul(&v)?.transpose(1, 2)?.reshape((n, len, hidden))
}

/// `[L, L]`: 0 where key `j <= i`, -inf after.
fn causal_mask(len: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let mask: Vec<f64> = (0..len * len)
        .map(|i| {
            if i % len > i / len {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(mask, (len, len), dev)?.to_dtype(dtype)
}

/// Index `index` of dim `dim`, the dim removed.
pub(super) fn select(x: &Tensor, dim: usize, index: usize) -> Result<Tensor> {
    if dim >= x.rank() || index >= x.dims()[dim] {
        bail!(
            "selects index {index} of dim {dim} of a tensor of shape {:?}",
            x.dims()
        );
    }
    x.narrow(dim, index, 1)?.squeeze(dim)
}
