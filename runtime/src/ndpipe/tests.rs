use distmind_memserver::FeatureExtractor;
use distmind_models::{Family, GenOptions, Package, Scale};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::exec::cpu::CpuExecutor;
use crate::exec::{HostTensor, TensorData};

fn tiny(family: Family) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let opts = GenOptions {
        scale: Scale::Tiny,
        ..GenOptions::new(family, dir.path())
    };
    let path = distmind_models::generate(&opts).unwrap().remove(0);
    (dir, path)
}

fn images(n: usize, side: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n * 3 * side * side)
        .map(|_| rng.gen_range(-2.0f32..2.0))
        .collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tol * (1.0 + x.abs().max(y.abs())))
}

#[test]
fn resnet_backbone_is_the_model_before_its_head() {
    let (_d, path) = tiny(Family::Resnet152);
    let pkg = Package::open(&path).unwrap();
    let side = match pkg.manifest.inputs[0].shape.as_slice() {
        [_, 3, h, _] => *h,
        s => panic!("{s:?}"),
    };
    let bb = Backbone::from_package(&pkg, side as u32).unwrap();
    let head = &pkg.manifest.layers[bb.head()];
    let distmind_models::Op::Linear {
        in_features,
        out_features,
        ..
    } = head.op
    else {
        panic!("{:?}", head.op)
    };
    assert_eq!(bb.feature_dim(), in_features);
    let info = bb.info();
    assert_eq!(info.feature_dim as usize, in_features);
    assert_eq!(info.input as usize, side);
    assert!(info.backbone.contains("resnet152"), "{}", info.backbone);
    assert!(info.backbone.contains("generated"), "{}", info.backbone);
    assert!(
        info.backbone
            .ends_with(&format!("layers [0, {})", bb.head())),
        "{}",
        info.backbone
    );

    // The head applied to the features gives the whole model's logits.
    let n = 2;
    let x = images(n, side, 7);
    let f = bb.extract(&x, n).unwrap();
    assert_eq!(f.len(), n * in_features);
    let w = pkg.param_f32(&head.params[0]).unwrap();
    let b = pkg.param_f32(&head.params[1]).unwrap();
    let (out, _) = crate::infer::infer_package(
        &pkg,
        &CpuExecutor::new(),
        &[HostTensor::f32(vec![n, 3, side, side], x)],
    )
    .unwrap();
    let TensorData::F32(logits) = &out.last().unwrap().data else {
        panic!()
    };
    let mut ours = Vec::new();
    for i in 0..n {
        let fi = &f[i * in_features..(i + 1) * in_features];
        for c in 0..out_features {
            let row = &w[c * in_features..(c + 1) * in_features];
            ours.push(b[c] + row.iter().zip(fi).map(|(w, x)| w * x).sum::<f32>());
        }
    }
    assert!(close(&ours, logits, 1e-4), "{ours:?} vs {logits:?}");
}

#[test]
fn backbone_is_deterministic_and_batches_like_single_images() {
    let (_d, path) = tiny(Family::Resnet152);
    let bb = Backbone::open(&path, BACKBONE_INPUT_DEFAULT).unwrap();
    let side = BACKBONE_INPUT_DEFAULT as usize;
    // More than one internal batch.
    let n = BACKBONE_BATCH_MAX + 3;
    let x = images(n, side, 11);
    let a = bb.extract(&x, n).unwrap();
    let b = bb.extract(&x, n).unwrap();
    assert_eq!(a, b, "two runs differ");
    let dim = bb.feature_dim();
    assert_eq!(a.len(), n * dim);
    for i in [0, 1, n - 1] {
        let one = bb
            .extract(&x[i * 3 * side * side..(i + 1) * 3 * side * side], 1)
            .unwrap();
        assert!(
            close(&one, &a[i * dim..(i + 1) * dim], 1e-5),
            "image {i}: alone {one:?}, in the batch {:?}",
            &a[i * dim..(i + 1) * dim]
        );
    }
    // A wrong number of values is an error, not a panic.
    assert!(bb.extract(&x[1..], n).is_err());
}

#[test]
fn every_cnn_family_cuts_before_its_head_and_transformers_are_refused() {
    for family in [Family::Densenet201, Family::InceptionV3] {
        let (_d, path) = tiny(family);
        let pkg = Package::open(&path).unwrap();
        let native = pkg.manifest.inputs[0].shape[2];
        let side = native.max(BACKBONE_INPUT_DEFAULT as usize);
        let bb = Backbone::from_package(&pkg, side as u32)
            .unwrap_or_else(|e| panic!("{family} at {side}: {e}"));
        let f = bb.extract(&images(2, side, 3), 2).unwrap();
        assert_eq!(f.len(), 2 * bb.feature_dim(), "{family}");
        assert!(f.iter().all(|v| v.is_finite()), "{family}");
    }
    // An input the strides reduce to nothing is refused up front.
    let (_d, path) = tiny(Family::InceptionV3);
    let e = Backbone::open(&path, 8).unwrap_err().to_string();
    assert!(e.contains("does not take 8x8 inputs"), "{e}");
    let (_d, path) = tiny(Family::BertBase);
    let e = Backbone::open(&path, 64).unwrap_err().to_string();
    assert!(e.contains("not a CNN"), "{e}");
}

/// `k` Gaussian clusters in `dim` dimensions, well apart.
fn clusters(n: usize, dim: usize, k: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut rng = StdRng::seed_from_u64(1000);
    let centres: Vec<f32> = (0..k * dim).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut x = Vec::with_capacity(n * dim);
    let mut y = Vec::with_capacity(n);
    for i in 0..n {
        let c = i % k;
        y.push(c as u32);
        for d in 0..dim {
            x.push(centres[c * dim + d] + rng.gen_range(-0.3f32..0.3));
        }
    }
    (x, y)
}

#[test]
fn head_learns_a_separable_problem() {
    let (dim, k) = (16, 4);
    let (x, y) = clusters(400, dim, k, 1);
    let (tx, ty) = clusters(200, dim, k, 2);
    let cfg = HeadConfig {
        epochs: 20,
        lr: 0.1,
        batch: 32,
        seed: 5,
        ..HeadConfig::default()
    };
    let mut head = Head::new(dim, k, cfg.seed);
    let before = head.accuracy(&tx, &ty).unwrap();
    let loss = head.train(&x, &y, &cfg, cfg.lr).unwrap();
    let after = head.accuracy(&tx, &ty).unwrap();
    assert!(after >= 0.98, "accuracy {before} -> {after}, loss {loss}");
    assert!(loss < 0.2, "last epoch's loss {loss}");

    // Deterministic given the seed.
    let mut again = Head::new(dim, k, cfg.seed);
    again.train(&x, &y, &cfg, cfg.lr).unwrap();
    assert_eq!(head, again);

    // Chunked (R = 4) reaches the accuracy of one chunk.
    let r = 4;
    let per = y.len() / r;
    let chunks: Vec<(Vec<f32>, Vec<u32>)> = (0..r)
        .map(|i| {
            (
                x[i * per * dim..(i + 1) * per * dim].to_vec(),
                y[i * per..(i + 1) * per].to_vec(),
            )
        })
        .collect();
    let mut chunked = Head::new(dim, k, cfg.seed);
    let stats = chunked.fine_tune_chunked(&chunks, &cfg).unwrap();
    assert_eq!(stats.len(), r);
    assert!(stats.iter().all(|s| s.samples == per));
    let acc = chunked.accuracy(&tx, &ty).unwrap();
    assert!((acc - after).abs() <= 0.03, "R = 4: {acc}, R = 1: {after}");

    // Bad inputs are errors.
    assert!(matches!(
        head.train(&x[1..], &y, &cfg, 0.1),
        Err(HeadError::Shape { .. })
    ));
    assert!(matches!(
        head.accuracy(&x[..dim], &[k as u32]),
        Err(HeadError::Label { .. })
    ));
}

#[test]
fn chunk_learning_rates_follow_ndpipes_schedule() {
    let lrs: Vec<f32> = (0..4).map(|i| chunk_lr(0.08, i, 4)).collect();
    let want = [0.08, 0.07, 0.06, 0.05];
    for (got, want) in lrs.iter().zip(want) {
        assert!((got - want).abs() < 1e-7, "{lrs:?}");
    }
    assert_eq!(chunk_lr(0.1, 0, 1), 0.1);
    // The stats report the chunk's rate.
    let (x, y) = clusters(8, 4, 2, 3);
    let cfg = HeadConfig {
        epochs: 1,
        lr: 0.08,
        ..HeadConfig::default()
    };
    let mut head = Head::new(4, 2, 0);
    let s = head.fine_tune_chunk(2, 4, &x, &y, &cfg).unwrap();
    assert_eq!((s.chunk, s.samples), (2, 8));
    assert!((s.lr - 0.06).abs() < 1e-7);
    assert!(head.fine_tune_chunk(4, 4, &x, &y, &cfg).is_err());
}
