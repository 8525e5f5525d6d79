//! The roofline estimate: per layer FLOPs and bytes from the shapes
//! `shape::infer` gives over the architecture, and
//! `time = max(matrix_flops / matrix rate + vector_flops / vector rate,
//! bytes / memory rate) + launch overhead`.
//!
//! This is an estimate, not a measurement; it assumes kernels at peak, so its
//! times are optimistic. The text in [`ESTIMATED_METHOD`] travels with every
//! estimated profile file.

use std::collections::HashMap;

use distmind_models::flops::layer_flops;
use distmind_models::graph::EmbeddingIds;
use distmind_models::shape::{self, Shape};
use distmind_models::{Family, Layer, ModelConfig, Op, Scale};

use super::{model_key, LayerProfile, ModelProfile, Peaks, Profile, Source};

/// The part of every estimated profile's `method` that does not depend on
/// the GPU (a macro so that `concat!` can build the constants below).
macro_rules! roofline_method {
    () => {
        "Roofline estimate from the layer graph; no GPU was used and nothing was timed. \
Per layer: time_s = max(matrix_flops / matrix_flops_per_s + vector_flops / vector_flops_per_s, bytes / memory_bytes_per_s) + launch_overhead_s, \
with flops = matrix_flops + vector_flops and shapes from shape::infer over ModelConfig::build(). \
Matrix FLOPs: conv2d 2*N*Cout*Ho*Wo*Cin*kh*kw, linear 2*M*K*N, attention 2 matmuls of 2*N*heads*L*L*dh each (the full L x L score matrix even when causal). \
Vector FLOPs: conv and linear bias adds, softmax (6 per score), BatchNorm 2, LayerNorm 8, GELU 8 (erf) or 10 (tanh), tanh 4, relu and add 1 per element, pools one per window element. \
bytes: every input read once + params read once + output written once, 4 bytes per f32 element, 8 per i64 token id; \
embeddings read only the gathered rows; flatten is a view (0 bytes); select copies its output (2 x output); attention is assumed fused (scores never written to memory)."
    };
}

/// The shipped H200 profile's `method`.
pub const ESTIMATED_METHOD: &str = concat!(
    roofline_method!(),
    " \
Peaks: matrix 7.9e14 FLOP/s and memory 4.3e12 B/s were measured on this project's H200 (bf16 tensor-core GEMM, device copy). \
ASSUMPTION: the model weights are f32 and we assume the executor runs matrix ops on tensor cores at the measured bf16 rate (bf16 or TF32 math); \
TF32 runs at about half the bf16 rate on Hopper, so matrix-bound layers could take up to 2x longer, and real kernels rarely reach peak, so these times are optimistic. \
Vector rate assumed 1/10 of the matrix rate (7.9e13 FLOP/s, near the H200's f32 CUDA-core peak). \
Launch overhead assumed 5 us per layer (eager-mode kernel launch and framework dispatch, one kernel per layer). \
h2d_bytes_per_s assumed 5.0e10 (PCIe Gen5 x16 from pinned host memory, about 80% of the 64 GB/s link), not measured. \
Times are rounded to the nanosecond."
);

/// The shipped V100 profile's `method`: the paper's GPU (p3dn.24xlarge,
/// V100 SXM2), from its datasheet; nothing measured.
pub const V100_ESTIMATED_METHOD: &str = concat!(
    roofline_method!(),
    " \
Peaks from the V100 SXM2 datasheet, not measured: matrix 1.25e14 FLOP/s is the tensor-core FP16 multiply / FP32 accumulate rate \
(V100 has no TF32 or BF16; f32 weights would run at the 1.57e13 CUDA-core rate unless cast to FP16, so matrix-bound layers could take up to 8x longer), \
vector 1.57e13 FLOP/s (FP32 CUDA cores), memory 9.0e11 B/s (HBM2). \
h2d_bytes_per_s 1.2e10 is a typical measured PCIe Gen3 x16 host-to-device rate from pinned memory (the link is 15.75 GB/s). \
Launch overhead assumed 5 us per layer. Real kernels rarely reach peak, so these times are optimistic. \
Times are rounded to the nanosecond."
);

/// The profile of `family` at `scale` with `batch` inputs per request, from
/// the family's default config at that scale and [`Peaks::H200_ESTIMATED`].
pub fn estimate(family: Family, scale: Scale, batch: usize) -> ModelProfile {
    estimate_with(family, scale, batch, &Peaks::H200_ESTIMATED)
}

/// The profile of `family` at `scale` and `batch` under `peaks`.
pub fn estimate_with(family: Family, scale: Scale, batch: usize, peaks: &Peaks) -> ModelProfile {
    let config = with_batch(family.config(scale), batch);
    estimate_config(&config, peaks)
}

/// The profile of any config (its own batch size) under `peaks`.
pub fn estimate_config(config: &ModelConfig, peaks: &Peaks) -> ModelProfile {
    let arch = config.build();
    let params: HashMap<&str, &[usize]> = arch
        .params
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    let shapes = shape::infer(&arch.layers, &arch.inputs, |n| params.get(n).copied())
        .unwrap_or_else(|(l, e)| {
            panic!(
                "{} layer {l}: the built architecture does not infer: {e}",
                config.family()
            )
        });
    let layers: Vec<LayerProfile> = arch
        .layers
        .iter()
        .map(|layer| {
            let ins: Vec<Shape> = layer
                .inputs
                .iter()
                .map(|&r| {
                    if r < 0 {
                        let spec = &arch.inputs[(-r - 1) as usize];
                        Shape {
                            dims: spec.shape.clone(),
                            dtype: spec.dtype,
                        }
                    } else {
                        shapes[r as usize].clone()
                    }
                })
                .collect();
            let param_bytes: u64 = layer
                .params
                .iter()
                .map(|p| numel(params[p.as_str()]) * 4)
                .sum();
            let cost = layer_cost(layer, &ins, &shapes[layer.id], param_bytes);
            let compute_s = cost.matrix_flops as f64 / peaks.matrix_flops_per_s
                + cost.vector_flops as f64 / peaks.vector_flops_per_s;
            let memory_s = cost.bytes as f64 / peaks.memory_bytes_per_s;
            LayerProfile {
                id: layer.id,
                name: layer.name.clone(),
                op: layer.op.name().to_string(),
                flops: cost.matrix_flops + cost.vector_flops,
                bytes: cost.bytes,
                time_s: round_ns(compute_s.max(memory_s) + peaks.launch_overhead_s),
            }
        })
        .collect();
    ModelProfile {
        total_s: round_ns(layers.iter().map(|l| l.time_s).sum()),
        layers,
    }
}

/// The shipped H200 estimate (`settings/profiles/h200-estimated.json`).
pub fn estimated_h200(date: &str) -> Profile {
    estimated("NVIDIA H200", Peaks::H200_ESTIMATED, ESTIMATED_METHOD, date)
}

/// The shipped V100 estimate (`settings/profiles/v100-estimated.json`): the
/// paper's GPU, which the emulated-link evaluation pairs with its 100 Gbps
/// network.
pub fn estimated_v100(date: &str) -> Profile {
    estimated(
        "NVIDIA V100 SXM2",
        Peaks::V100_ESTIMATED,
        V100_ESTIMATED_METHOD,
        date,
    )
}

/// An estimated profile: the five families at full scale for batch 1 and 8,
/// and at tiny scale for batch 1.
fn estimated(gpu: &str, peaks: Peaks, method: &str, date: &str) -> Profile {
    let mut p = Profile::new(gpu, Source::Estimated, date, None, method, peaks);
    for family in Family::ALL {
        for (scale, batch) in [(Scale::Full, 1), (Scale::Full, 8), (Scale::Tiny, 1)] {
            p.models.insert(
                model_key(family, scale, batch),
                estimate_with(family, scale, batch, &peaks),
            );
        }
    }
    p
}

fn with_batch(config: ModelConfig, batch: usize) -> ModelConfig {
    assert!(batch > 0, "batch size 0");
    config.with_batch_size(batch)
}

pub(super) fn round_ns(s: f64) -> f64 {
    (s * 1e9).round() / 1e9
}

fn numel(dims: &[usize]) -> u64 {
    dims.iter().map(|&d| d as u64).product()
}

fn bytes_of(s: &Shape) -> u64 {
    numel(&s.dims) * s.dtype.size_bytes()
}

#[derive(Debug, Default)]
struct Cost {
    matrix_flops: u64,
    vector_flops: u64,
    bytes: u64,
}

/// FLOPs and bytes of one layer (see [`ESTIMATED_METHOD`]): the FLOPs as
/// [`distmind_models::flops`] counts them, the bytes here.
fn layer_cost(layer: &Layer, ins: &[Shape], out: &Shape, param_bytes: u64) -> Cost {
    let flops = layer_flops(layer, ins, out);
    let in_bytes: u64 = ins.iter().map(bytes_of).sum();
    let bytes = match &layer.op {
        Op::Flatten { .. } => 0,
        Op::Select { .. } => 2 * bytes_of(out),
        Op::Embedding {
            embedding_dim, ids, ..
        } => {
            // Only the gathered rows are read, never more than the table.
            let dim = *embedding_dim as u64;
            let (ids_bytes, rows) = match ids {
                EmbeddingIds::Input => (in_bytes, numel(&out.dims) / dim),
                // Positions 0..L-1 of the input's last dim.
                EmbeddingIds::Positions => (0, *ins[0].dims.last().unwrap_or(&1) as u64),
                EmbeddingIds::Zeros => (0, 1),
            };
            let gathered = (rows * dim * 4).min(param_bytes);
            ids_bytes + gathered + bytes_of(out)
        }
        // Inputs read once, params read once, output written once.
        _ => in_bytes + param_bytes + bytes_of(out),
    };
    Cost {
        matrix_flops: flops.matrix,
        vector_flops: flops.vector,
        bytes,
    }
}
