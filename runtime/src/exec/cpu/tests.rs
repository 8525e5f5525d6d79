//! Every op on tiny cases computed by hand (or by a naive loop written from
//! `OPS.md`), plus the activation-freeing plan.

use candle_core::{Device, Tensor};
use distmind_models::graph::{EmbeddingIds, GeluApprox};
use distmind_models::{Layer, Op};

use super::attention::attention;
use super::ops::{self, apply, pool_out_len};
use super::params::prepare;
use crate::exec::test_values::noise;

fn t(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::from_slice(data, shape, &Device::Cpu).unwrap()
}

fn vals(x: &Tensor) -> Vec<f32> {
    x.flatten_all().unwrap().to_vec1().unwrap()
}

fn close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: {g} vs {w}\n{got:?}\n{want:?}"
        );
    }
}

fn range(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

fn conv_op(
    cin: usize,
    cout: usize,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    bias: bool,
) -> Op {
    Op::Conv2d {
        in_channels: cin,
        out_channels: cout,
        kernel,
        stride,
        padding,
        bias,
    }
}

/// Runs `op` with raw params given as (shape, values).
fn run(op: &Op, args: &[Tensor], params: &[(&[usize], Vec<f32>)]) -> candle_core::Result<Tensor> {
    let raw = params
        .iter()
        .map(|(s, v)| ("p", *s, Tensor::new(v.as_slice(), &Device::Cpu).unwrap()))
        .collect();
    let prepared = if params.is_empty() {
        None
    } else {
        Some(prepare(op, raw)?)
    };
    apply(op, args, prepared.as_ref())
}

#[test]
fn conv2d_padding_stride_by_hand() {
    let x = t(&[1, 1, 3, 3], &[1., 2., 3., 4., 5., 6., 7., 8., 9.]);
    let op = conv_op(1, 1, [2, 2], [2, 2], [1, 1], true);
    let y = run(
        &op,
        &[x],
        &[(&[1, 1, 2, 2], vec![1., 2., 3., 4.]), (&[1], vec![0.5])],
    )
    .unwrap();
    assert_eq!(y.dims(), &[1, 1, 2, 2]);
    // Padded input windows at (0,0), (0,2), (2,0), (2,2), cross-correlated.
    close(&vals(&y), &[4.5, 18.5, 36.5, 77.5], 0.0);
}

/// `torch.nn.functional.conv2d` written as loops, from OPS.md.
#[allow(clippy::too_many_arguments)]
fn naive_conv(
    x: &[f32],
    [n, c, h, w]: [usize; 4],
    wt: &[f32],
    [o, kh, kw]: [usize; 3],
    b: &[f32],
    s: [usize; 2],
    p: [usize; 2],
) -> (Vec<f32>, [usize; 4]) {
    let ho = (h + 2 * p[0] - kh) / s[0] + 1;
    let wo = (w + 2 * p[1] - kw) / s[1] + 1;
    let mut out = vec![0f32; n * o * ho * wo];
    for ni in 0..n {
        for oi in 0..o {
            for y in 0..ho {
                for xo in 0..wo {
                    let mut acc = b[oi];
                    for ci in 0..c {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (y * s[0] + ky) as isize - p[0] as isize;
                                let ix = (xo * s[1] + kx) as isize - p[1] as isize;
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                    acc += x[((ni * c + ci) * h + iy as usize) * w + ix as usize]
                                        * wt[((oi * c + ci) * kh + ky) * kw + kx];
                                }
                            }
                        }
                    }
                    out[((ni * o + oi) * ho + y) * wo + xo] = acc;
                }
            }
        }
    }
    (out, [n, o, ho, wo])
}

#[test]
fn conv2d_matches_naive_loops_incl_asymmetric_padding_and_stride() {
    let cases: [([usize; 2], [usize; 2], [usize; 2]); 6] = [
        ([3, 3], [1, 1], [1, 1]),
        ([3, 3], [2, 2], [1, 1]),
        ([1, 7], [1, 1], [0, 3]),
        ([7, 1], [1, 1], [3, 0]),
        ([3, 2], [2, 1], [1, 0]),
        ([1, 1], [2, 2], [0, 0]),
    ];
    for (i, (k, s, p)) in cases.into_iter().enumerate() {
        let shape = [2, 3, 7, 6];
        let x = noise(shape.iter().product(), i as u32);
        let wt = noise(4 * 3 * k[0] * k[1], 100 + i as u32);
        let b = noise(4, 200 + i as u32);
        let (want, want_shape) = naive_conv(&x, shape, &wt, [4, k[0], k[1]], &b, s, p);
        let op = conv_op(3, 4, k, s, p, true);
        let y = run(
            &op,
            &[t(&shape, &x)],
            &[(&[4, 3, k[0], k[1]], wt), (&[4], b)],
        )
        .unwrap();
        assert_eq!(y.dims(), &want_shape, "case {i}");
        close(&vals(&y), &want, 1e-5);
    }
}

#[test]
fn conv2d_rejects_wrong_channels() {
    let op = conv_op(2, 1, [1, 1], [1, 1], [0, 0], false);
    let e = run(
        &op,
        &[t(&[1, 3, 2, 2], &[0.; 12])],
        &[(&[1, 2, 1, 1], vec![1., 1.])],
    )
    .unwrap_err();
    assert!(e.to_string().contains("3 channels"), "{e}");
}

#[test]
fn batch_norm_uses_running_stats() {
    let op = Op::BatchNorm {
        num_features: 2,
        eps: 1e-5,
    };
    let x = t(&[1, 2, 1, 2], &[1., 2., 3., 4.]);
    let params: [(&[usize], Vec<f32>); 4] = [
        (&[2], vec![2., 1.]),
        (&[2], vec![0.5, -1.]),
        (&[2], vec![1., 2.]),
        (&[2], vec![4., 0.25]),
    ];
    let y = run(&op, &[x], &params).unwrap();
    let f = |x: f32, m: f32, v: f32, g: f32, b: f32| (x - m) / (v + 1e-5).sqrt() * g + b;
    let want = [
        f(1., 1., 4., 2., 0.5),
        f(2., 1., 4., 2., 0.5),
        f(3., 2., 0.25, 1., -1.),
        f(4., 2., 0.25, 1., -1.),
    ];
    close(&vals(&y), &want, 1e-6);
}

#[test]
fn pool_lengths_follow_pytorch() {
    assert_eq!(pool_out_len(112, 3, 2, 1, false).unwrap(), 56);
    assert_eq!(pool_out_len(147, 3, 2, 0, false).unwrap(), 73);
    assert_eq!(pool_out_len(4, 3, 2, 1, false).unwrap(), 2);
    assert_eq!(pool_out_len(4, 3, 2, 1, true).unwrap(), 3);
    // The last window would start in the padding: dropped.
    assert_eq!(pool_out_len(2, 2, 3, 1, true).unwrap(), 1);
    assert!(pool_out_len(2, 3, 1, 0, false).is_err());
    assert!(
        pool_out_len(8, 2, 2, 2, false).is_err(),
        "padding over half the kernel"
    );
}

#[test]
fn max_pool2d_padding_and_ceil_mode_by_hand() {
    let x = t(&[1, 1, 4, 4], &range(16));
    let pool = |ceil_mode| Op::MaxPool2d {
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
        ceil_mode,
    };
    let y = run(&pool(false), std::slice::from_ref(&x), &[]).unwrap();
    assert_eq!(y.dims(), &[1, 1, 2, 2]);
    close(&vals(&y), &[5., 7., 13., 15.], 0.0);
    let y = run(&pool(true), &[x], &[]).unwrap();
    assert_eq!(y.dims(), &[1, 1, 3, 3]);
    close(&vals(&y), &[5., 7., 7., 13., 15., 15., 13., 15., 15.], 0.0);
    // Padding is -inf, not 0: an all-negative input keeps its maxima.
    let neg = t(&[1, 1, 2, 2], &[-4., -3., -2., -1.]);
    let op = Op::MaxPool2d {
        kernel: [2, 2],
        stride: [1, 1],
        padding: [1, 1],
        ceil_mode: false,
    };
    close(
        &vals(&run(&op, &[neg], &[]).unwrap()),
        &[-4., -3., -3., -2., -1., -1., -2., -1., -1.],
        0.0,
    );
}

#[test]
fn avg_pool2d_count_include_pad_by_hand() {
    let x = t(&[1, 1, 3, 3], &[1., 2., 3., 4., 5., 6., 7., 8., 9.]);
    let pool = |count_include_pad| Op::AvgPool2d {
        kernel: [3, 3],
        stride: [1, 1],
        padding: [1, 1],
        ceil_mode: false,
        count_include_pad,
    };
    let y = run(&pool(true), std::slice::from_ref(&x), &[]).unwrap();
    assert_eq!(y.dims(), &[1, 1, 3, 3]);
    let sums = [12., 21., 16., 27., 45., 33., 24., 39., 28.];
    close(&vals(&y), &sums.map(|s| s / 9.), 1e-6);
    let y = run(&pool(false), std::slice::from_ref(&x), &[]).unwrap();
    let counts = [4., 6., 4., 6., 9., 6., 4., 6., 4.];
    let want: Vec<f32> = sums.iter().zip(counts).map(|(s, c)| s / c).collect();
    close(&vals(&y), &want, 1e-6);
    // DenseNet transition: 2x2 stride 2; ceil_mode windows hanging past the
    // input divide by their clipped size (PyTorch).
    let op = Op::AvgPool2d {
        kernel: [2, 2],
        stride: [2, 2],
        padding: [0, 0],
        ceil_mode: true,
        count_include_pad: true,
    };
    let y = run(&op, &[x], &[]).unwrap();
    assert_eq!(y.dims(), &[1, 1, 2, 2]);
    close(&vals(&y), &[3., 4.5, 7.5, 9.], 1e-6);
}

#[test]
fn adaptive_avg_pool2d_bins() {
    let x = t(&[1, 2, 2, 3], &range(12));
    let op = Op::AdaptiveAvgPool2d {
        output_size: [1, 1],
    };
    let y = run(&op, std::slice::from_ref(&x), &[]).unwrap();
    assert_eq!(y.dims(), &[1, 2, 1, 1]);
    close(&vals(&y), &[2.5, 8.5], 1e-6);
    // Overlapping bins: 3 columns into 2 -> [0, 2) and [1, 3).
    let op = Op::AdaptiveAvgPool2d {
        output_size: [1, 2],
    };
    let y = run(&op, &[t(&[1, 1, 1, 3], &[1., 2., 4.])], &[]).unwrap();
    close(&vals(&y), &[1.5, 3.], 1e-6);
}

#[test]
fn layer_norm_by_hand() {
    let op = Op::LayerNorm {
        normalized_size: 4,
        eps: 1e-5,
    };
    let x = t(&[2, 4], &[1., 2., 3., 4., 2., 2., 2., 2.]);
    let y = run(
        &op,
        &[x],
        &[(&[4], vec![1., 2., 1., 1.]), (&[4], vec![0., 0., 1., 0.])],
    )
    .unwrap();
    let s = (1.25f32 + 1e-5).sqrt();
    let want = [
        -1.5 / s,
        2. * -0.5 / s,
        0.5 / s + 1.,
        1.5 / s,
        0.,
        0.,
        1.,
        0.,
    ];
    close(&vals(&y), &want, 1e-6);
}

#[test]
fn gelu_erf_and_tanh() {
    let x = t(&[4], &[-1., 0., 1., 3.]);
    let erf = run(
        &Op::Gelu {
            approximate: GeluApprox::Erf,
        },
        std::slice::from_ref(&x),
        &[],
    )
    .unwrap();
    close(
        &vals(&erf),
        &[-0.158_655_26, 0., 0.841_344_7, 2.995_950_2],
        1e-6,
    );
    let tanh = run(
        &Op::Gelu {
            approximate: GeluApprox::Tanh,
        },
        &[x],
        &[],
    )
    .unwrap();
    close(
        &vals(&tanh),
        &[-0.158_808, 0., 0.841_192, 2.996_362_6],
        1e-6,
    );
}

#[test]
fn elementwise_and_shape_ops() {
    let x = t(&[1, 2, 1, 1], &[-1., 2.]);
    close(
        &vals(&run(&Op::Relu, std::slice::from_ref(&x), &[]).unwrap()),
        &[0., 2.],
        0.0,
    );
    close(
        &vals(&run(&Op::Tanh, std::slice::from_ref(&x), &[]).unwrap()),
        &[(-1f32).tanh(), 2f32.tanh()],
        1e-7,
    );
    close(
        &vals(&run(&Op::Add, &[x.clone(), x.clone()], &[]).unwrap()),
        &[-2., 4.],
        0.0,
    );
    assert!(
        run(&Op::Add, &[x.clone(), t(&[2], &[1., 1.])], &[]).is_err(),
        "no broadcasting"
    );
    let cat = run(
        &Op::Concat { dim: 1 },
        &[x.clone(), t(&[1, 1, 1, 1], &[5.]), x.clone()],
        &[],
    )
    .unwrap();
    assert_eq!(cat.dims(), &[1, 5, 1, 1]);
    close(&vals(&cat), &[-1., 2., 5., -1., 2.], 0.0);
    let flat = run(&Op::Flatten { start_dim: 1 }, &[cat], &[]).unwrap();
    assert_eq!(flat.dims(), &[1, 5]);
    let seq = t(&[2, 3, 2], &range(12));
    let sel = run(&Op::Select { dim: 1, index: 0 }, &[seq], &[]).unwrap();
    assert_eq!(sel.dims(), &[2, 2]);
    close(&vals(&sel), &[0., 1., 6., 7.], 0.0);
}

#[test]
fn linear_plain_and_transposed() {
    let x = t(&[1, 2, 3], &[1., 2., 3., 4., 5., 6.]);
    // W [out 2, in 3]
    let w = vec![1., 0., -1., 0.5, 0.5, 0.5];
    let op = |transposed| Op::Linear {
        in_features: 3,
        out_features: 2,
        bias: true,
        transposed,
    };
    let want = [1. - 3. + 10., 3. + 20., 4. - 6. + 10., 7.5 + 20.];
    let y = run(
        &op(false),
        std::slice::from_ref(&x),
        &[(&[2, 3], w.clone()), (&[2], vec![10., 20.])],
    )
    .unwrap();
    assert_eq!(y.dims(), &[1, 2, 2]);
    close(&vals(&y), &want, 1e-6);
    // Conv1D stores W^T [in 3, out 2].
    let wt = vec![1., 0.5, 0., 0.5, -1., 0.5];
    let y = run(
        &op(true),
        std::slice::from_ref(&x),
        &[(&[3, 2], wt), (&[2], vec![10., 20.])],
    )
    .unwrap();
    close(&vals(&y), &want, 1e-6);
    let e = run(&op(false), &[x], &[(&[3, 2], w), (&[2], vec![0., 0.])]).unwrap_err();
    assert!(e.to_string().contains("shape [3, 2]"), "{e}");
}

#[test]
fn embedding_modes() {
    let weight = vec![0., 1., 2., 3., 4., 5.];
    let ids = Tensor::from_slice(&[2i64, 0], (1, 2), &Device::Cpu).unwrap();
    let emb = |ids_mode| Op::Embedding {
        num_embeddings: 3,
        embedding_dim: 2,
        ids: ids_mode,
    };
    let cases = [
        (EmbeddingIds::Input, [4., 5., 0., 1.]),
        (EmbeddingIds::Positions, [0., 1., 2., 3.]),
        (EmbeddingIds::Zeros, [0., 1., 0., 1.]),
    ];
    for (mode, want) in cases {
        let y = run(
            &emb(mode),
            std::slice::from_ref(&ids),
            &[(&[3, 2], weight.clone())],
        )
        .unwrap();
        assert_eq!(y.dims(), &[1, 2, 2]);
        close(&vals(&y), &want, 0.0);
    }
    let bad = Tensor::from_slice(&[3i64], (1, 1), &Device::Cpu).unwrap();
    let e = run(
        &emb(EmbeddingIds::Input),
        &[bad],
        &[(&[3, 2], weight.clone())],
    )
    .unwrap_err();
    assert!(e.to_string().contains("token id 3"), "{e}");
    let long = Tensor::from_slice(&[0i64; 4], (1, 4), &Device::Cpu).unwrap();
    assert!(ops::embedding(&long, &weight, 3, 2, EmbeddingIds::Positions).is_err());
}

#[test]
fn causal_attention_two_tokens_by_hand() {
    let q = t(&[1, 2, 2], &[1., 0., 0., 1.]);
    let k = t(&[1, 2, 2], &[1., 0., 1., 1.]);
    let v = t(&[1, 2, 2], &[1., 2., 3., 4.]);
    let y = attention(&[q.clone(), k.clone(), v.clone()], 2, 1, true).unwrap();
    assert_eq!(y.dims(), &[1, 2, 2]);
    // Token 1: scores (0, 1) / sqrt 2.
    let p1 = 1. / (1. + (-std::f32::consts::FRAC_1_SQRT_2).exp());
    let p0 = 1. - p1;
    close(&vals(&y), &[1., 2., p0 + 3. * p1, 2. * p0 + 4. * p1], 1e-6);
    // Not causal: token 0 sees equal scores for both keys.
    let y = attention(&[q.clone(), k.clone(), v.clone()], 2, 1, false).unwrap();
    close(&vals(&y)[..2], &[2., 3.], 1e-6);
    // Fused qkv gives the same as separate inputs.
    let fused = Tensor::cat(&[q, k, v], 2).unwrap();
    let yf = attention(&[fused], 2, 1, false).unwrap();
    close(&vals(&yf), &vals(&y), 1e-7);
}

/// Attention written as loops, from OPS.md.
#[allow(clippy::too_many_arguments)]
fn naive_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    l: usize,
    heads: usize,
    d: usize,
    causal: bool,
) -> Vec<f32> {
    let hidden = heads * d;
    let mut out = vec![0f32; n * l * hidden];
    for b in 0..n {
        for h in 0..heads {
            for i in 0..l {
                let at = |x: &[f32], t: usize, j: usize| x[(b * l + t) * hidden + h * d + j];
                let keys = if causal { i + 1 } else { l };
                let scores: Vec<f32> = (0..keys)
                    .map(|t| {
                        (0..d).map(|j| at(q, i, j) * at(k, t, j)).sum::<f32>() / (d as f32).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f32 = e.iter().sum();
                for j in 0..d {
                    out[(b * l + i) * hidden + h * d + j] =
                        (0..keys).map(|t| e[t] / z * at(v, t, j)).sum();
                }
            }
        }
    }
    out
}

#[test]
fn multi_head_attention_matches_naive_loops() {
    let (n, l, heads, d) = (2, 5, 3, 4);
    let h = heads * d;
    for causal in [false, true] {
        let [q, k, v] = [1, 2, 3].map(|s| noise(n * l * h, s));
        let want = naive_attention(&q, &k, &v, n, l, heads, d, causal);
        let shape = [n, l, h];
        let y = attention(
            &[t(&shape, &q), t(&shape, &k), t(&shape, &v)],
            h,
            heads,
            causal,
        )
        .unwrap();
        assert_eq!(y.dims(), &shape);
        close(&vals(&y), &want, 1e-5);
    }
    assert!(attention(&[t(&[1, 2, 6], &[0.; 12])], 3, 2, false).is_err());
}

#[test]
fn activations_are_freed_after_their_last_reader() {
    let layer = |id: usize, inputs: Vec<i64>| Layer {
        id,
        name: format!("l{id}"),
        op: Op::Relu,
        inputs,
        params: vec![],
        group: None,
    };
    // 0 <- input; 1 <- 0; 2 <- 0, 1; 3 <- 2 (unread but an output); 4 <- 2 (dead end)
    let layers = vec![
        layer(0, vec![-1]),
        layer(1, vec![0]),
        layer(2, vec![0, 1]),
        layer(3, vec![2]),
        layer(4, vec![2]),
    ];
    let frees = crate::exec::plan::frees_after(&layers, &[3]);
    assert_eq!(frees, vec![vec![], vec![], vec![0, 1], vec![], vec![2, 4]]);
}

/// Two variants of a tiny model (different weights, the same layout) and an
/// input for them.
fn two_variants(dir: &std::path::Path) -> (Vec<distmind_models::Package>, crate::exec::HostTensor) {
    use distmind_models::{generate, Family, GenOptions, Package, Scale};
    let dirs = generate(&GenOptions {
        scale: Scale::Tiny,
        variants: 2,
        group_bytes: 16 << 10,
        ..GenOptions::new(Family::BertBase, dir)
    })
    .unwrap();
    let pkgs: Vec<Package> = dirs.iter().map(|d| Package::open(d).unwrap()).collect();
    let shape = pkgs[0].manifest.inputs[0].shape.clone();
    let n: usize = shape.iter().product();
    let ids = (0..n as i64).map(|i| (i * 7) % 50).collect();
    (pkgs, crate::exec::HostTensor::i64(shape, ids))
}

/// Uploads every group of `pkg` into a new arena of `exec`, with the
/// program compiled first (uploads prepare the params) or after.
fn load(
    exec: &super::CpuExecutor,
    pkg: &distmind_models::Package,
    program_first: bool,
) -> (
    std::sync::Arc<dyn crate::exec::Arena>,
    Box<dyn crate::exec::Program>,
) {
    use crate::exec::Executor;
    let m = &pkg.manifest;
    let arena = exec.alloc_arena(m.stored_bytes).unwrap();
    let program = program_first.then(|| exec.program(m, arena.clone()).unwrap());
    for g in &m.groups {
        arena
            .upload(g.index, g.offset, &pkg.group_bytes(g.index).unwrap())
            .unwrap();
    }
    let program = program.unwrap_or_else(|| exec.program(m, arena.clone()).unwrap());
    (arena, program)
}

fn outputs(
    program: &mut Box<dyn crate::exec::Program>,
    input: &crate::exec::HostTensor,
) -> Vec<f32> {
    let out = program
        .run(
            std::slice::from_ref(input),
            &mut crate::exec::all_ready,
            &mut Vec::new(),
        )
        .unwrap();
    match &out[0].data {
        crate::exec::TensorData::F32(v) => v.clone(),
        other => panic!("f32 output expected, got {other:?}"),
    }
}

fn pooled_bytes(exec: &super::CpuExecutor) -> u64 {
    exec.pool.lock().unwrap().bytes
}

#[test]
fn group_memory_is_reused_only_once_nothing_views_it() {
    let dir = tempfile::tempdir().unwrap();
    let (pkgs, input) = two_variants(dir.path());
    // Each variant's outputs on a fresh executor, whose memory is all new.
    let want: Vec<Vec<f32>> = pkgs
        .iter()
        .map(|p| outputs(&mut load(&super::CpuExecutor::new(), p, true).1, &input))
        .collect();
    assert_ne!(
        want[0], want[1],
        "the variants must differ for this test to mean anything"
    );

    let exec = super::CpuExecutor::new();
    for program_first in [true, false] {
        let (arena, mut program) = load(&exec, &pkgs[0], program_first);
        assert_eq!(outputs(&mut program, &input), want[0]);
        drop((arena, program));
        let pooled = pooled_bytes(&exec);
        assert!(
            pooled >= pkgs[0].manifest.stored_bytes,
            "{pooled} bytes pooled"
        );

        // The second variant reuses every group's memory and computes its
        // own outputs from it, not the first one's.
        let (arena, mut program) = load(&exec, &pkgs[1], program_first);
        assert_eq!(pooled_bytes(&exec), 0);
        assert_eq!(outputs(&mut program, &input), want[1]);

        // Views still held elsewhere: the memory is not pooled.
        let cpu = crate::exec::downcast_arena::<super::CpuArena>(arena.clone()).unwrap();
        let params = cpu.params.lock().unwrap().clone();
        assert!(params.is_some());
        drop((cpu, arena, program));
        assert_eq!(pooled_bytes(&exec), 0);
        drop(params);
    }
}

#[test]
fn group_memory_views_refuse_a_param_outside_the_upload() {
    use super::{GroupMem, Tensor};
    use crate::exec::plan::ParamLoc;
    let mem = GroupMem {
        offset: 1024,
        len: 64,
        storage: Tensor::new(&[0f32; 32], &candle_core::Device::Cpu).unwrap(),
    };
    let loc = |offset, nbytes| ParamLoc {
        name: "w".into(),
        offset,
        nbytes,
        shape: vec![nbytes as usize / 4],
    };
    assert_eq!(mem.view(3, &loc(1024 + 16, 48)).unwrap().dims(), [12]);
    for bad in [
        loc(1000, 16),
        loc(1024 + 16, 52),
        loc(1026, 8),
        loc(1024, 6),
    ] {
        let e = mem.view(3, &bad).unwrap_err().to_string();
        assert!(e.contains("group 3") && e.contains("param w"), "{e}");
    }
}

#[test]
fn pooled_plus_live_memory_never_exceeds_the_live_peak() {
    use crate::exec::{Arena, Executor};
    let exec = super::CpuExecutor::new();
    let check = |what: &str| {
        let p = exec.pool.lock().unwrap();
        assert!(
            p.bytes + p.live <= p.peak,
            "{what}: pooled {} + live {} > peak {}",
            p.bytes,
            p.live,
            p.peak
        );
        (p.bytes, p.live, p.peak)
    };
    // An arena of `groups` groups of the given f32 counts, uploaded.
    let arena = |elems: &[usize]| -> std::sync::Arc<dyn Arena> {
        let total: usize = elems.iter().sum();
        let a = exec.alloc_arena(4 * total as u64).unwrap();
        let mut offset = 0u64;
        for (g, &n) in elems.iter().enumerate() {
            a.upload(g, offset, &vec![1u8; 4 * n]).unwrap();
            offset += 4 * n as u64;
        }
        a
    };
    let a = arena(&[1000, 2000]);
    assert_eq!(check("two groups live"), (0, 12_000, 12_000));
    drop(a);
    assert_eq!(check("dropped"), (12_000, 0, 12_000));
    // Reuses the 2000 (within 2x), then needs fresh memory for 5000: the
    // pooled 1000 is freed first so the total stays within the new peak.
    let b = arena(&[1500, 5000]);
    let (pooled, live, peak) = check("reuse, then a larger group");
    assert_eq!((pooled, live), (0, 28_000));
    assert_eq!(peak, 28_000);
    // Re-uploading a group drops the memory it replaces.
    b.upload(1, 6000, &vec![2u8; 20_000]).unwrap();
    let (_, live, _) = check("re-upload");
    assert_eq!(live, 28_000);
    drop(b);
    let (pooled, live, _) = check("dropped again");
    assert_eq!(live, 0);
    assert!(pooled <= 28_000);
}

#[test]
fn a_usable_thread_count_is_kept_and_anything_else_gets_candles_default() {
    use super::thread_count_to_set;
    let default = || 6;
    assert_eq!(thread_count_to_set(Some("3"), default), None);
    // Candle does not trim: it would ignore this one.
    assert_eq!(thread_count_to_set(Some(" 3 "), default), Some(6));
    assert_eq!(thread_count_to_set(None, default), Some(6));
    assert_eq!(thread_count_to_set(Some("0"), default), Some(6));
    assert_eq!(thread_count_to_set(Some("many"), default), Some(6));
    assert_eq!(thread_count_to_set(None, || 0), Some(1));
}
