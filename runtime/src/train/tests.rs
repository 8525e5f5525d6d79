//! The training ops one by one in f64: backward against central finite
//! differences, and forward values against `OPS.md`'s definitions.

use candle_core::{DType, Device, Tensor, Var};
use distmind_models::graph::{EmbeddingIds, GeluApprox};
use distmind_models::Op;

use super::layers::apply;
use super::transformer::{attention, embedding, gelu, layer_norm, select};

fn rand_tensor(shape: &[usize], seed: u64, scale: f64) -> Tensor {
    let mut s = seed;
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// `f(inputs)` is a tensor; the loss is `sum(f * r)` for a fixed random
/// `r`. Checks d loss / d input for every element of every input against
/// central differences; returns the worst relative error.
fn grad_check(inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Tensor) -> f64 {
    let vars: Vec<Tensor> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap().as_tensor().clone())
        .collect();
    let out = f(&vars);
    let r = rand_tensor(out.dims(), 99, 1.0);
    let loss_of = |ins: &[Tensor]| -> f64 {
        f(ins)
            .mul(&r)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let store = out.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let mut worst = 0f64;
    for (i, v) in vars.iter().enumerate() {
        let g = values(store.get(v).expect("a gradient per input"));
        let base = values(&inputs[i]);
        for (j, gj) in g.iter().enumerate() {
            let h = 1e-6 * base[j].abs().max(1.0);
            let at = |delta: f64| {
                let mut moved = base.clone();
                moved[j] += delta;
                let mut ins = inputs.to_vec();
                ins[i] = Tensor::from_vec(moved, inputs[i].dims(), &Device::Cpu).unwrap();
                loss_of(&ins)
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            let err = (fd - gj).abs() / (fd.abs().max(gj.abs()) + 1e-6);
            assert!(
                err < 1e-6,
                "input {i}[{j}]: finite difference {fd:e}, backward {gj:e}"
            );
            worst = worst.max(err);
        }
    }
    worst
}

#[test]
fn gelu_has_exact_derivatives_and_the_inference_forward() {
    for approx in [GeluApprox::Erf, GeluApprox::Tanh] {
        let x = rand_tensor(&[3, 7], 1, 4.0);
        let worst = grad_check(std::slice::from_ref(&x), |a| gelu(&a[0], approx).unwrap());
        println!("gelu {approx:?}: worst relative error {worst:e}");
        // f32 forward: the same bits as candle's kernels (the executor's).
        let x32 = x.to_dtype(DType::F32).unwrap();
        let ours = gelu(&x32, approx).unwrap().flatten_all().unwrap();
        let theirs = match approx {
            GeluApprox::Erf => x32.gelu_erf(),
            GeluApprox::Tanh => x32.gelu(),
        }
        .unwrap()
        .flatten_all()
        .unwrap();
        assert_eq!(
            ours.to_vec1::<f32>().unwrap(),
            theirs.to_vec1::<f32>().unwrap()
        );
    }
}

#[test]
fn layer_norm_matches_its_definition_and_differentiates() {
    let x = rand_tensor(&[2, 3, 5], 2, 2.0);
    let w = rand_tensor(&[5], 3, 1.0);
    let b = rand_tensor(&[5], 4, 1.0);
    let eps = 1e-5;
    let y = values(&layer_norm(&x, &w, &b, eps).unwrap());
    let (xv, wv, bv) = (values(&x), values(&w), values(&b));
    for (row, out) in xv.chunks(5).zip(y.chunks(5)) {
        let mean = row.iter().sum::<f64>() / 5.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5.0;
        for d in 0..5 {
            let want = (row[d] - mean) / (var + eps).sqrt() * wv[d] + bv[d];
            assert!((out[d] - want).abs() < 1e-12);
        }
    }
    grad_check(&[x, w, b], |a| {
        layer_norm(&a[0], &a[1], &a[2], eps).unwrap()
    });
}

#[test]
fn attention_differentiates_fused_causal_and_separate() {
    let (n, len, hidden, heads) = (2, 4, 6, 2);
    let qkv = rand_tensor(&[n, len, 3 * hidden], 5, 1.5);
    let worst = grad_check(std::slice::from_ref(&qkv), |a| {
        attention(a, hidden, heads, true).unwrap()
    });
    println!("causal fused attention: worst relative error {worst:e}");
    let q = rand_tensor(&[n, len, hidden], 6, 1.5);
    let k = rand_tensor(&[n, len, hidden], 7, 1.5);
    let v = rand_tensor(&[n, len, hidden], 8, 1.5);
    grad_check(&[q.clone(), k.clone(), v.clone()], |a| {
        attention(a, hidden, heads, false).unwrap()
    });

    // Causal: query 0 sees only key 0, so its output is v's row 0 per head.
    let out = attention(std::slice::from_ref(&qkv), hidden, heads, true).unwrap();
    let first = out.narrow(1, 0, 1).unwrap();
    let v0 = qkv
        .narrow(2, 2 * hidden, hidden)
        .unwrap()
        .narrow(1, 0, 1)
        .unwrap();
    let diff = first.sub(&v0).unwrap().abs().unwrap().max_all().unwrap();
    assert!(diff.to_scalar::<f64>().unwrap() < 1e-12);
    // Non-causal against a direct softmax(q k^T / sqrt d) v.
    let out = values(&attention(&[q.clone(), k.clone(), v.clone()], hidden, heads, false).unwrap());
    let (qv, kv, vv) = (values(&q), values(&k), values(&v));
    let d = hidden / heads;
    let at = |t: &[f64], b: usize, l: usize, c: usize| t[(b * len + l) * hidden + c];
    for b in 0..n {
        for h in 0..heads {
            for i in 0..len {
                let scores: Vec<f64> = (0..len)
                    .map(|j| {
                        (0..d)
                            .map(|c| at(&qv, b, i, h * d + c) * at(&kv, b, j, h * d + c))
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..d {
                    let want: f64 = (0..len).map(|j| e[j] / z * at(&vv, b, j, h * d + c)).sum();
                    let got = at(&out, b, i, h * d + c);
                    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
                }
            }
        }
    }
}

#[test]
fn embedding_gradients_go_to_the_table_rows() {
    let (num, dim) = (5, 3);
    let table = rand_tensor(&[num, dim], 9, 1.0);
    let ids = Tensor::from_vec(vec![1i64, 3, 1, 0], (2, 2), &Device::Cpu).unwrap();
    for mode in [
        EmbeddingIds::Input,
        EmbeddingIds::Positions,
        EmbeddingIds::Zeros,
    ] {
        let out = values(&embedding(&ids, &table, num, dim, mode).unwrap());
        let t = values(&table);
        for (i, row) in out.chunks(dim).enumerate() {
            let r = match mode {
                EmbeddingIds::Input => [1, 3, 1, 0][i],
                EmbeddingIds::Positions => i % 2,
                EmbeddingIds::Zeros => 0,
            };
            assert_eq!(row, &t[r * dim..(r + 1) * dim], "{mode:?} row {i}");
        }
        grad_check(std::slice::from_ref(&table), |a| {
            embedding(&ids, &a[0], num, dim, mode).unwrap()
        });
    }
    // Row 1 is read twice: its gradient is the sum of both reads'.
    let var = Var::from_tensor(&table).unwrap();
    let out = embedding(&ids, var.as_tensor(), num, dim, EmbeddingIds::Input).unwrap();
    let g = out.sum_all().unwrap().backward().unwrap();
    let g = values(g.get(var.as_tensor()).unwrap());
    assert_eq!(
        g,
        vec![1., 1., 1., 2., 2., 2., 0., 0., 0., 1., 1., 1., 0., 0., 0.]
    );
    let bad = Tensor::from_vec(vec![5i64], (1, 1), &Device::Cpu).unwrap();
    let err = embedding(&bad, &table, num, dim, EmbeddingIds::Input).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}

#[test]
fn select_and_adaptive_pool_differentiate() {
    let x = rand_tensor(&[2, 3, 4], 10, 1.0);
    grad_check(std::slice::from_ref(&x), |a| select(&a[0], 1, 0).unwrap());
    assert_eq!(select(&x, 1, 2).unwrap().dims(), &[2, 4]);
    assert!(select(&x, 1, 3).is_err());

    // Adaptive bins of a 5x4 map into 2x3: PyTorch's overlapping bins.
    let x = rand_tensor(&[1, 2, 5, 4], 11, 1.0);
    let op = Op::AdaptiveAvgPool2d {
        output_size: [2, 3],
    };
    let out = apply(&op, std::slice::from_ref(&x), &[]).unwrap().out;
    assert_eq!(out.dims(), &[1, 2, 2, 3]);
    let xv = values(&x);
    let ov = values(&out);
    let bin = |i: usize, len: usize, o: usize| (i * len) / o..((i + 1) * len).div_ceil(o);
    for c in 0..2 {
        for oy in 0..2 {
            for ox in 0..3 {
                let (rows, cols) = (bin(oy, 5, 2), bin(ox, 4, 3));
                let mut sum = 0.0;
                for y in rows.clone() {
                    for x in cols.clone() {
                        sum += xv[(c * 5 + y) * 4 + x];
                    }
                }
                let want = sum / (rows.len() * cols.len()) as f64;
                assert!((ov[(c * 2 + oy) * 3 + ox] - want).abs() < 1e-12);
            }
        }
    }
    grad_check(&[x], |a| apply(&op, a, &[]).unwrap().out);
}
