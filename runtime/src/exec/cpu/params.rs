//! A layer's params in the form its kernel wants, built once from views of
//! the arena's group memory and kept by the program for every later run:
//! weights stay views (no copy); only per-channel tables are computed.

use crate::exec::plan::param_count;
use candle_core::{bail, DType, Result, Tensor};
use distmind_models::graph::EmbeddingIds;
use distmind_models::Op;

/// Prepared params of one layer.
#[derive(Debug, Clone)]
pub(super) enum Prepared {
    Conv {
        /// `[out, in, kh, kw]`.
        weight: Tensor,
        /// `[1, out, 1, 1]`, ready to broadcast over NCHW.
        bias: Option<Tensor>,
    },
    /// `y = x * scale[c] + shift[c]`, with `scale = weight / sqrt(var + eps)`
    /// and `shift = bias - mean * scale` computed in f64 (PyTorch's CPU
    /// inference kernel folds the statistics the same way).
    BatchNorm { scale: Vec<f32>, shift: Vec<f32> },
    Linear {
        /// `[in, out]`: for `nn.Linear`'s `[out, in]` a transposed view
        /// (strides `[1, in]`), which the GEMM reads as it is, so preparing
        /// costs no transposing copy.
        weight_t: Tensor,
        /// `[out]`.
        bias: Option<Tensor>,
    },
    Embedding {
        /// `[num, dim]`, row-major.
        weight: Tensor,
        num: usize,
        dim: usize,
        ids: EmbeddingIds,
    },
    LayerNorm {
        weight: Vec<f32>,
        bias: Vec<f32>,
        eps: f64,
    },
}

/// One raw param: its name, shape and values (a 1-D f32 tensor, usually a
/// view of group memory), in op order.
pub(super) type RawParam<'a> = (&'a str, &'a [usize], Tensor);

/// Checks the params' count and shapes against `op`'s attributes, then
/// prepares them.
pub(super) fn prepare(op: &Op, params: Vec<RawParam<'_>>) -> Result<Prepared> {
    if params.len() != param_count(op) {
        bail!(
            "has {} params, the op wants {}",
            params.len(),
            param_count(op)
        );
    }
    let mut it = params.into_iter();
    let mut next = || it.next().expect("count checked");
    match *op {
        Op::Conv2d {
            in_channels,
            out_channels,
            kernel,
            bias,
            ..
        } => {
            let w = next();
            expect_shape(&w, &[out_channels, in_channels, kernel[0], kernel[1]])?;
            let weight = tensor(w)?;
            let bias = if bias {
                let b = next();
                expect_shape(&b, &[out_channels])?;
                Some(tensor(b)?.reshape((1, out_channels, 1, 1))?)
            } else {
                None
            };
            Ok(Prepared::Conv { weight, bias })
        }
        Op::BatchNorm { num_features, eps } => {
            let [w, b, mean, var] = [next(), next(), next(), next()];
            for p in [&w, &b, &mean, &var] {
                expect_shape(p, &[num_features])?;
            }
            let [w, b, mean, var] = [values(w)?, values(b)?, values(mean)?, values(var)?];
            let (scale, shift) = (0..num_features)
                .map(|c| {
                    let scale = f64::from(w[c]) / (f64::from(var[c]) + eps).sqrt();
                    let shift = f64::from(b[c]) - f64::from(mean[c]) * scale;
                    (scale as f32, shift as f32)
                })
                .unzip();
            Ok(Prepared::BatchNorm { scale, shift })
        }
        Op::Linear {
            in_features,
            out_features,
            bias,
            transposed,
        } => {
            let w = next();
            let weight_t = if transposed {
                expect_shape(&w, &[in_features, out_features])?;
                tensor(w)?
            } else {
                expect_shape(&w, &[out_features, in_features])?;
                tensor(w)?.t()?
            };
            let bias = if bias {
                let b = next();
                expect_shape(&b, &[out_features])?;
                Some(tensor(b)?)
            } else {
                None
            };
            Ok(Prepared::Linear { weight_t, bias })
        }
        Op::Embedding {
            num_embeddings,
            embedding_dim,
            ids,
        } => {
            let w = next();
            expect_shape(&w, &[num_embeddings, embedding_dim])?;
            Ok(Prepared::Embedding {
                weight: tensor(w)?,
                num: num_embeddings,
                dim: embedding_dim,
                ids,
            })
        }
        Op::LayerNorm {
            normalized_size,
            eps,
        } => {
            let [w, b] = [next(), next()];
            expect_shape(&w, &[normalized_size])?;
            expect_shape(&b, &[normalized_size])?;
            Ok(Prepared::LayerNorm {
                weight: values(w)?,
                bias: values(b)?,
                eps,
            })
        }
        _ => bail!("op {} takes no params", op.name()),
    }
}

fn expect_shape(param: &RawParam<'_>, want: &[usize]) -> Result<()> {
    if param.1 != want {
        bail!(
            "param {} has shape {:?}, the op's attributes want {want:?}",
            param.0,
            param.1
        );
    }
    Ok(())
}

/// The param at its shape: a view, no copy.
fn tensor(param: RawParam<'_>) -> Result<Tensor> {
    check_len(&param)?;
    param.2.reshape(param.1)
}

/// The param's values, copied (for small per-channel params).
fn values(param: RawParam<'_>) -> Result<Vec<f32>> {
    check_len(&param)?;
    param.2.to_vec1::<f32>()
}

fn check_len(param: &RawParam<'_>) -> Result<()> {
    let want: usize = param.1.iter().product();
    if param.2.dims() != [want] || param.2.dtype() != DType::F32 {
        bail!(
            "param {} holds {:?} {:?} values, its shape {:?} wants {want} f32",
            param.0,
            param.2.dtype(),
            param.2.dims(),
            param.1
        );
    }
    Ok(())
}
