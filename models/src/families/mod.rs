//! One builder per family: each turns a config into an [`Architecture`]
//! whose layer and parameter names are the framework's own.
//!
//! [`Architecture`]: crate::graph::Architecture

pub(crate) mod bert;
pub(crate) mod densenet;
pub(crate) mod gpt2;
pub(crate) mod inception;
pub(crate) mod resnet;

use crate::graph::{Builder, Dtype, Op, OutputSpec, TensorSpec};

/// `[batch, channels, size, size]` f32 images.
fn image_input(batch: usize, channels: usize, size: usize) -> Vec<TensorSpec> {
    vec![TensorSpec {
        name: "images".to_string(),
        shape: vec![batch, channels, size, size],
        dtype: Dtype::F32,
    }]
}

/// `[batch, seq_len]` i64 token ids.
fn token_input(batch: usize, seq_len: usize) -> Vec<TensorSpec> {
    vec![TensorSpec {
        name: "input_ids".to_string(),
        shape: vec![batch, seq_len],
        dtype: Dtype::I64,
    }]
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
