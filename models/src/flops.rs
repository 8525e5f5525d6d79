//! Floating-point operations per layer of a model's forward pass, from the
//! layer graph and the shapes [`crate::shape::infer`] gives: what a
//! controller needs to weigh layers against each other (DynPipe's layer
//! costs) without a GPU profile, and what a roofline estimate divides by a
//! GPU's rates.
//!
//! The counts (per forward pass of the manifest's input batch):
//! * matrix: conv2d `2 * N*Cout*Ho*Wo * Cin*kh*kw`, linear `2 * M*K*N`,
//!   attention two matmuls of `2 * N*heads*L*L*dh` each (the full `L x L`
//!   score matrix even when causal);
//! * vector, per output element: conv and linear bias 1, BatchNorm 2
//!   (inference: a per-channel scale and shift), LayerNorm 8, GELU 8 (erf) or
//!   10 (tanh), tanh 4, relu and add 1, pools one per window element (avg
//!   one more), softmax 6 per attention score; an adaptive pool reads every
//!   input element once; concat, flatten, select and embedding lookups
//!   compute nothing.
//!
//! `runtime::profile::estimate` takes its FLOPs from here (and adds bytes).
//! Backward passes are not counted: a layer's backward is commonly taken as
//! about twice its forward, which keeps the proportions between layers.

use std::collections::HashMap;

use crate::graph::{GeluApprox, Layer, Op, TensorSpec};
use crate::package::Manifest;
use crate::shape::{self, Shape};

/// Vector FLOPs per element (rough counts; these ops are memory-bound, so
/// the exact numbers barely matter).
pub const RELU_FLOPS: u64 = 1;
pub const ADD_FLOPS: u64 = 1;
/// Inference BatchNorm folded into a per-channel scale and shift.
pub const BATCH_NORM_FLOPS: u64 = 2;
/// Mean, variance, normalise, scale, shift.
pub const LAYER_NORM_FLOPS: u64 = 8;
pub const TANH_FLOPS: u64 = 4;
pub const GELU_ERF_FLOPS: u64 = 8;
pub const GELU_TANH_FLOPS: u64 = 10;
/// Per attention score: scale, max, subtract, exp, sum, divide.
pub const SOFTMAX_FLOPS: u64 = 6;

/// One layer's forward FLOPs, split by the units that run them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerFlops {
    /// Matrix products (tensor cores on a GPU).
    pub matrix: u64,
    /// Element-wise and reduction work.
    pub vector: u64,
}

impl LayerFlops {
    pub fn total(&self) -> u64 {
        self.matrix + self.vector
    }
}

fn numel(dims: &[usize]) -> u64 {
    dims.iter().map(|&d| d as u64).product()
}

/// The forward FLOPs of `layer` with input shapes `ins` and output `out`.
pub fn layer_flops(layer: &Layer, ins: &[Shape], out: &Shape) -> LayerFlops {
    let out_n = numel(&out.dims);
    let vector = |per_element: u64| LayerFlops {
        matrix: 0,
        vector: per_element * out_n,
    };
    match &layer.op {
        Op::Conv2d {
            in_channels,
            kernel,
            bias,
            ..
        } => LayerFlops {
            matrix: 2 * out_n * (*in_channels as u64) * (kernel[0] * kernel[1]) as u64,
            vector: if *bias { out_n } else { 0 },
        },
        Op::Linear {
            in_features, bias, ..
        } => LayerFlops {
            matrix: 2 * out_n * *in_features as u64,
            vector: if *bias { out_n } else { 0 },
        },
        Op::Attention { hidden, heads, .. } => {
            // out is [N, L, hidden]; scores are [N, heads, L, L].
            let n = out.dims.first().copied().unwrap_or(1) as u64;
            let l = out.dims.get(1).copied().unwrap_or(1) as u64;
            let head_dim = (hidden / (*heads).max(1)) as u64;
            let scores = n * *heads as u64 * l * l;
            LayerFlops {
                matrix: 2 * (2 * scores * head_dim),
                vector: SOFTMAX_FLOPS * scores,
            }
        }
        Op::BatchNorm { .. } => vector(BATCH_NORM_FLOPS),
        Op::LayerNorm { .. } => vector(LAYER_NORM_FLOPS),
        Op::Relu => vector(RELU_FLOPS),
        Op::Add => vector(ADD_FLOPS),
        Op::Tanh => vector(TANH_FLOPS),
        Op::Gelu { approximate } => vector(match approximate {
            GeluApprox::Erf => GELU_ERF_FLOPS,
            GeluApprox::Tanh => GELU_TANH_FLOPS,
        }),
        Op::MaxPool2d { kernel, .. } => vector((kernel[0] * kernel[1]) as u64),
        Op::AvgPool2d { kernel, .. } => vector((kernel[0] * kernel[1]) as u64 + 1),
        Op::AdaptiveAvgPool2d { .. } => LayerFlops {
            matrix: 0,
            vector: ins.iter().map(|s| numel(&s.dims)).sum::<u64>() + out_n,
        },
        Op::Concat { .. } | Op::Flatten { .. } | Op::Select { .. } | Op::Embedding { .. } => {
            LayerFlops::default()
        }
    }
}

/// Every layer's forward FLOPs, in manifest order, at the manifest's input
/// shapes. Fails, naming the model and the layer, when the graph does not
/// infer.
pub fn manifest_flops(m: &Manifest) -> Result<Vec<LayerFlops>, String> {
    let params: HashMap<&str, &[usize]> = m
        .params
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    graph_flops(&m.layers, &m.inputs, |n| params.get(n).copied())
        .map_err(|(l, e)| format!("model {}: layer {l}: {e}", m.name))
}

/// Every layer's forward FLOPs of a layer graph (`param_shape` looks a
/// param up by name, as in [`shape::infer`]).
pub fn graph_flops<'a>(
    layers: &[Layer],
    inputs: &[TensorSpec],
    param_shape: impl Fn(&str) -> Option<&'a [usize]>,
) -> Result<Vec<LayerFlops>, (usize, shape::ShapeError)> {
    let shapes = shape::infer(layers, inputs, param_shape)?;
    Ok(layers
        .iter()
        .map(|layer| {
            let ins: Vec<Shape> = layer
                .inputs
                .iter()
                .map(|&r| {
                    if r < 0 {
                        let spec = &inputs[(-r - 1) as usize];
                        Shape {
                            dims: spec.shape.clone(),
                            dtype: spec.dtype,
                        }
                    } else {
                        shapes[r as usize].clone()
                    }
                })
                .collect();
            layer_flops(layer, &ins, &shapes[layer.id])
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Family, Scale};

    #[test]
    fn every_family_counts_and_matrix_work_dominates() {
        for family in Family::ALL {
            let arch = family.config(Scale::Tiny).build();
            let params: HashMap<&str, &[usize]> = arch
                .params
                .iter()
                .map(|p| (p.name.as_str(), p.shape.as_slice()))
                .collect();
            let f = graph_flops(&arch.layers, &arch.inputs, |n| params.get(n).copied()).unwrap();
            assert_eq!(f.len(), arch.layers.len(), "{family}");
            let total: u64 = f.iter().map(LayerFlops::total).sum();
            let matrix: u64 = f.iter().map(|l| l.matrix).sum();
            assert!(
                total > 0 && matrix > total / 2,
                "{family}: {matrix} of {total}"
            );
        }
    }

    #[test]
    fn a_linear_layer_is_two_m_k_n_plus_its_bias() {
        let layer = Layer {
            id: 0,
            name: "fc".into(),
            op: Op::Linear {
                in_features: 8,
                out_features: 3,
                bias: true,
                transposed: false,
            },
            inputs: vec![-1],
            params: vec![],
            group: None,
        };
        let shape = |dims: Vec<usize>| Shape {
            dims,
            dtype: crate::Dtype::F32,
        };
        let f = layer_flops(&layer, &[shape(vec![4, 8])], &shape(vec![4, 3]));
        assert_eq!(
            f,
            LayerFlops {
                matrix: 2 * 4 * 8 * 3,
                vector: 12
            }
        );
        let relu = Layer {
            op: Op::Relu,
            ..layer
        };
        assert_eq!(
            layer_flops(&relu, &[shape(vec![4, 3])], &shape(vec![4, 3])).total(),
            12
        );
    }
}
