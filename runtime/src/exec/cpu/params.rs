//! A layer's params in the form its kernel wants, built once from the arena
//! bytes and kept by the program for every later run.

use crate::exec::plan::param_count;
use candle_core::{bail, Device, Result, Tensor};
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
        weight: Vec<f32>,
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

/// One raw param: its name, shape and values, in op order.
pub(super) type RawParam<'a> = (&'a str, &'a [usize], Vec<f32>);

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
            let (scale, shift) = (0..num_features)
                .map(|c| {
                    let scale = f64::from(w.2[c]) / (f64::from(var.2[c]) + eps).sqrt();
                    let shift = f64::from(b.2[c]) - f64::from(mean.2[c]) * scale;
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
                weight: w.2,
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
                weight: w.2,
                bias: b.2,
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

fn tensor(param: RawParam<'_>) -> Result<Tensor> {
    Tensor::from_vec(param.2, param.1, &Device::Cpu)
}
