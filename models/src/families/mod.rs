//! One builder per family: each turns a config into an [`Architecture`]
//! whose layer and parameter names are the framework's own.
//!
//! [`Architecture`]: crate::graph::Architecture

pub(crate) mod bert;
pub(crate) mod densenet;
pub(crate) mod gpt2;
pub(crate) mod inception;
pub(crate) mod resnet;

use crate::graph::{Builder, DimKind, Dtype, Op, OutputSpec, TensorSpec, VariableDim};

/// `[batch, channels, size, size]` f32 images; requests choose the batch.
fn image_input(batch: usize, channels: usize, size: usize) -> Vec<TensorSpec> {
    vec![TensorSpec::batched(
        "images",
        vec![batch, channels, size, size],
        Dtype::F32,
    )]
}

/// `[batch, seq_len]` i64 token ids; requests choose the batch and the
/// length, up to the `max_positions` rows of the position table.
fn token_input(batch: usize, seq_len: usize, max_positions: usize) -> Vec<TensorSpec> {
    let mut spec = TensorSpec::batched("input_ids", vec![batch, seq_len], Dtype::I64);
    spec.variable.push(VariableDim {
        dim: 1,
        kind: DimKind::Sequence,
        max: Some(max_positions),
    });
    vec![spec]
}

fn output(name: &str, layer: usize, shape: Vec<usize>) -> OutputSpec {
    OutputSpec {
        name: name.to_string(),
        layer,
        shape,
        dtype: Dtype::F32,
    }
}

/// The common CNN head: global average pool, flatten, linear classifier.
fn classifier_head(b: &mut Builder, input: i64, features: usize, classes: usize, fc: &str) -> i64 {
    let x = b.unary(
        "avgpool",
        Op::AdaptiveAvgPool2d {
            output_size: [1, 1],
        },
        input,
    );
    let x = b.unary("flatten", Op::Flatten { start_dim: 1 }, x);
    b.linear(fc, x, features, classes, false)
}
