//! `train::sgd_step` at tiny scale: f64 gradient checks (finite differences
//! against backward, first-order loss change along -grad) on ResNet,
//! Inception and DenseNet; the f32 step equal to `p - lr (g + wd p)`;
//! momentum across steps; loss decreasing while overfitting 4 images;
//! BatchNorm running statistics as PyTorch's `train()` updates them; the
//! inference output changing after a step; `changed_groups`; errors.

use std::collections::BTreeSet;
use std::path::Path;

use distmind_models::{
    generate, write_package, Family, GenOptions, Manifest, Package, PackageSpec, Scale,
};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::{all_ready, Executor, HostTensor, TensorData, Trace};
use distmind_runtime::infer::infer_package;
use distmind_runtime::train::{
    changed_groups, loss_and_gradients, sgd_step, sgd_step_with_state, training_loss, Precision,
    SgdConfig, SgdState, TrainError, BN_MOMENTUM,
};

const GROUP_BYTES: u64 = 16 << 10;

fn tiny_package(dir: &Path, family: Family) -> Package {
    let opts = GenOptions {
        scale: Scale::Tiny,
        group_bytes: GROUP_BYTES,
        ..GenOptions::new(family, dir)
    };
    Package::open(&generate(&opts).expect("generate")[0]).expect("open")
}

/// The whole model in the packed layout.
fn packed_of(pkg: &Package) -> Vec<u8> {
    let m = &pkg.manifest;
    let mut out = vec![0u8; m.stored_bytes as usize];
    for g in &m.groups {
        let bytes = pkg.group_bytes(g.index).unwrap();
        out[g.offset as usize..g.offset as usize + bytes.len()].copy_from_slice(&bytes);
    }
    out
}

struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: usize) -> usize {
        ((self.unit() * n as f64) as usize).min(n - 1)
    }
}

fn images(m: &Manifest, batch: usize, seed: u64) -> HostTensor {
    let mut shape = m.inputs[0].shape.clone();
    shape[0] = batch;
    let n: usize = shape.iter().product();
    let mut rng = Rng(seed);
    HostTensor::f32(
        shape,
        (0..n).map(|_| (rng.unit() * 2.0 - 1.0) as f32).collect(),
    )
}

fn labels(batch: usize) -> Vec<i64> {
    (0..batch as i64).map(|i| (i * 137 + 11) % 1000).collect()
}

fn param_offset(m: &Manifest, name: &str) -> (usize, usize) {
    let p = m.params.iter().find(|p| p.name == name).expect(name);
    let start = (m.groups[p.group].offset + p.offset) as usize;
    (start, (p.nbytes / 4) as usize)
}

fn get(packed: &[u8], at: usize) -> f32 {
    f32::from_le_bytes(packed[at..at + 4].try_into().unwrap())
}

fn set(packed: &mut [u8], at: usize, v: f32) {
    packed[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn values(m: &Manifest, packed: &[u8], name: &str) -> Vec<f32> {
    let (start, n) = param_offset(m, name);
    (0..n).map(|i| get(packed, start + 4 * i)).collect()
}

/// Central finite differences in f64 for `count` random elements of
/// learnable params (always including the first and last learnable param),
/// compared with backward's gradient.
fn gradient_check(pkg: &Package, batch: usize, count: usize, seed: u64) {
    let m = &pkg.manifest;
    let mut packed = packed_of(pkg);
    let x = images(m, batch, seed);
    let y = labels(batch);
    let grads = loss_and_gradients(m, &packed, &x, &y, Precision::F64).unwrap();
    assert!(grads.loss.is_finite());
    let learnable: Vec<&str> = m
        .params
        .iter()
        .filter(|p| p.learnable)
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        grads.grads.len(),
        learnable.len(),
        "a gradient per learnable param"
    );
    let mut rng = Rng(seed ^ 0xABCD);
    let mut picks = vec![learnable[0], learnable[learnable.len() - 1]];
    while picks.len() < count {
        picks.push(learnable[rng.below(learnable.len())]);
    }
    let mut worst = 0f64;
    for name in picks {
        let (start, n) = param_offset(m, name);
        let g = &grads.grads[name];
        // The element with the largest gradient half of the time, else a random one.
        let i = if rng.unit() < 0.5 {
            (0..n)
                .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
                .unwrap()
        } else {
            rng.below(n)
        };
        let at = start + 4 * i;
        let v = get(&packed, at);
        let h = 1e-6 * v.abs().max(0.1);
        set(&mut packed, at, v + h);
        let plus_delta = get(&packed, at) as f64 - v as f64;
        let lp = training_loss(m, &packed, &x, &y, Precision::F64).unwrap();
        set(&mut packed, at, v - h);
        let minus_delta = get(&packed, at) as f64 - v as f64;
        let lm = training_loss(m, &packed, &x, &y, Precision::F64).unwrap();
        set(&mut packed, at, v);
        let fd = (lp - lm) / (plus_delta - minus_delta);
        let err = (fd - g[i]).abs() / (fd.abs().max(g[i].abs()) + 1e-7);
        worst = worst.max(err);
        assert!(
            err < 2e-3,
            "{}: d loss / d {name}[{i}]: finite difference {fd:e}, backward {:e} (rel err {err:e})",
            m.name,
            g[i]
        );
    }
    println!("{}: gradient check worst relative error {worst:e}", m.name);

    // First order along -grad: L(p - lr g) - L(p) ~= sum g * (actual change).
    let mut norm2 = 0f64;
    for g in grads.grads.values() {
        norm2 += g.iter().map(|v| v * v).sum::<f64>();
    }
    // A step that changes the loss by about 1e-4 of itself.
    let lr = 1e-4 * grads.loss / norm2;
    let mut predicted = 0f64;
    for name in &learnable {
        let (start, n) = param_offset(m, name);
        let g = &grads.grads[*name];
        for (i, gi) in g.iter().enumerate().take(n) {
            let at = start + 4 * i;
            let v = get(&packed, at);
            set(&mut packed, at, (v as f64 - lr * gi) as f32);
            predicted += gi * (get(&packed, at) as f64 - v as f64);
        }
    }
    let after = training_loss(m, &packed, &x, &y, Precision::F64).unwrap();
    let actual = after - grads.loss;
    assert!(actual < 0.0, "{}: loss went up along -grad", m.name);
    assert!(
        (actual - predicted).abs() < 0.05 * predicted.abs(),
        "{}: loss change {actual:e}, first order predicts {predicted:e} (lr |g|^2 = {:e})",
        m.name,
        lr * norm2
    );
}

#[test]
fn train_gradient_check_resnet152() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Resnet152);
    gradient_check(&pkg, 4, 16, 1);
}

#[test]
fn train_gradient_check_inception_v3() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::InceptionV3);
    gradient_check(&pkg, 4, 10, 2);
}

#[test]
fn train_gradient_check_densenet201() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Densenet201);
    gradient_check(&pkg, 4, 10, 3);
}

/// The f32 step writes `p - lr (g + wd p)` for every learnable param.
#[test]
fn train_step_applies_sgd_update() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Resnet152);
    let m = &pkg.manifest;
    let before = packed_of(&pkg);
    let x = images(m, 4, 5);
    let y = labels(4);
    let grads = loss_and_gradients(m, &before, &x, &y, Precision::F32).unwrap();
    let cfg = SgdConfig {
        lr: 0.05,
        momentum: 0.0,
        weight_decay: 1e-3,
    };
    let mut after = before.clone();
    let report = sgd_step(m, &mut after, &x, &y, &cfg).unwrap();
    assert!((report.loss as f64 - grads.loss).abs() < 1e-5 * grads.loss.abs());
    assert_eq!(report.batch, 4);
    let learnable = m.params.iter().filter(|p| p.learnable).count();
    assert_eq!(report.params_updated, learnable);
    assert_eq!(report.stats_updated, m.params.len() - learnable);
    for p in m.params.iter().filter(|p| p.learnable) {
        let old = values(m, &before, &p.name);
        let new = values(m, &after, &p.name);
        let g = &grads.grads[&p.name];
        for i in 0..old.len() {
            let want = old[i] - cfg.lr * (g[i] as f32 + cfg.weight_decay * old[i]);
            assert!(
                (new[i] - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{}[{i}]: {} after the step, expected {want}",
                p.name,
                new[i]
            );
        }
    }
}

/// Momentum as torch.optim.SGD: buf = g on the first step, then m buf + g.
#[test]
fn train_momentum_carries_across_steps() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Resnet152);
    let m = &pkg.manifest;
    let mut packed = packed_of(&pkg);
    let x = images(m, 4, 6);
    let y = labels(4);
    let cfg = SgdConfig {
        lr: 0.02,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let g1 = loss_and_gradients(m, &packed, &x, &y, Precision::F32).unwrap();
    let mut state = SgdState::new();
    sgd_step_with_state(m, &mut packed, &x, &y, &cfg, &mut state).unwrap();
    assert_eq!(
        state.buffers(),
        m.params.iter().filter(|p| p.learnable).count()
    );
    let p1 = packed.clone();
    let g2 = loss_and_gradients(m, &p1, &x, &y, Precision::F32).unwrap();
    sgd_step_with_state(m, &mut packed, &x, &y, &cfg, &mut state).unwrap();
    for name in ["conv1.weight", "fc.bias", "layer2.0.bn2.weight"] {
        let old = values(m, &p1, name);
        let new = values(m, &packed, name);
        for i in 0..old.len() {
            let buf = cfg.momentum * g1.grads[name][i] as f32 + g2.grads[name][i] as f32;
            let want = old[i] - cfg.lr * buf;
            assert!(
                (new[i] - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{name}[{i}]: {} vs {want}",
                new[i]
            );
        }
    }
}

/// Overfitting 4 images: the loss falls over 5 steps.
#[test]
fn train_loss_decreases_over_steps() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Resnet152);
    let m = &pkg.manifest;
    let mut packed = packed_of(&pkg);
    let x = images(m, 4, 7);
    let y = labels(4);
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    let mut losses = Vec::new();
    for _ in 0..5 {
        let r = sgd_step(m, &mut packed, &x, &y, &cfg).unwrap();
        assert!(r.loss.is_finite());
        losses.push(r.loss);
    }
    let last = training_loss(m, &packed, &x, &y, Precision::F32).unwrap() as f32;
    losses.push(last);
    println!("tiny resnet152 losses over 5 steps: {losses:?}");
    for w in losses.windows(2) {
        assert!(w[1] < w[0], "loss did not fall at every step: {losses:?}");
    }
    assert!(last < 0.5 * losses[0], "loss fell too little: {losses:?}");
}

/// bn1's running statistics after one step equal a hand computation over
/// conv1's output: 0.9 old + 0.1 batch mean / UNBIASED batch variance.
#[test]
fn train_running_stats_like_pytorch() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Resnet152);
    let m = &pkg.manifest;
    let before = packed_of(&pkg);
    let batch = 2;
    let x = images(m, batch, 8);
    let y = labels(batch);
    let mut after = before.clone();
    sgd_step(m, &mut after, &x, &y, &SgdConfig::default()).unwrap();
    // conv1: 7x7, stride 2, padding 3, no bias.
    let w = values(m, &before, "conv1.weight");
    let (cout, cin, k, s, p) = (w.len() / (3 * 49), 3usize, 7usize, 2usize, 3isize);
    let (h, wd) = (x.shape[2], x.shape[3]);
    let (oh, ow) = ((h + 6 - k) / s + 1, (wd + 6 - k) / s + 1);
    let TensorData::F32(px) = &x.data else {
        unreachable!()
    };
    let old_mean = values(m, &before, "bn1.running_mean");
    let old_var = values(m, &before, "bn1.running_var");
    let new_mean = values(m, &after, "bn1.running_mean");
    let new_var = values(m, &after, "bn1.running_var");
    assert_eq!(old_mean.len(), cout);
    for c in 0..cout {
        let mut outs = Vec::new();
        for n in 0..batch {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = 0f64;
                    for ci in 0..cin {
                        for ky in 0..k {
                            for kx in 0..k {
                                let iy = (oy * s + ky) as isize - p;
                                let ix = (ox * s + kx) as isize - p;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xv = px[((n * cin + ci) * h + iy as usize) * wd + ix as usize];
                                let wv = w[((c * cin + ci) * k + ky) * k + kx];
                                acc += xv as f64 * wv as f64;
                            }
                        }
                    }
                    outs.push(acc);
                }
            }
        }
        let cnt = outs.len() as f64;
        let mean = outs.iter().sum::<f64>() / cnt;
        let var = outs.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (cnt - 1.0);
        let want_mean = (1.0 - BN_MOMENTUM) * old_mean[c] as f64 + BN_MOMENTUM * mean;
        let want_var = (1.0 - BN_MOMENTUM) * old_var[c] as f64 + BN_MOMENTUM * var;
        assert!(
            (new_mean[c] as f64 - want_mean).abs() < 1e-5,
            "running_mean[{c}] {} vs {want_mean}",
            new_mean[c]
        );
        assert!(
            (new_var[c] as f64 - want_var).abs() < 1e-5 * (1.0 + want_var),
            "running_var[{c}] {} vs {want_var}",
            new_var[c]
        );
    }
}

fn infer_packed(m: &Manifest, packed: &[u8], x: &HostTensor) -> Vec<f32> {
    let exec = CpuExecutor::new();
    let arena = exec.alloc_arena(m.stored_bytes).unwrap();
    for g in &m.groups {
        let r = g.offset as usize..(g.offset + g.bytes) as usize;
        arena.upload(g.index, g.offset, &packed[r]).unwrap();
    }
    let mut program = exec.program(m, arena).unwrap();
    let out = program
        .run(std::slice::from_ref(x), &mut all_ready, &mut Trace::new())
        .unwrap();
    match &out.last().unwrap().data {
        TensorData::F32(v) => v.clone(),
        TensorData::I64(_) => panic!("f32 logits expected"),
    }
}

/// After a step the executor's eval-mode output changes and stays finite;
/// the changed groups are exactly those holding params; a package rewritten
/// from the new bytes verifies and infers the same numbers.
#[test]
fn train_step_changes_inference_and_groups() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Resnet152);
    let m = &pkg.manifest;
    assert!(m.groups.len() > 1, "several groups at {GROUP_BYTES} bytes");
    let before = packed_of(&pkg);
    let mut after = before.clone();
    let x = images(m, 4, 9);
    sgd_step(m, &mut after, &x, &labels(4), &SgdConfig::default()).unwrap();
    let probe = images(m, 2, 10);
    let out_before = infer_packed(m, &before, &probe);
    let out_after = infer_packed(m, &after, &probe);
    assert!(out_after.iter().all(|v| v.is_finite()));
    assert_ne!(out_before, out_after);
    let with_params: BTreeSet<usize> = m.params.iter().map(|p| p.group).collect();
    let changed = changed_groups(&before, &after, m);
    assert_eq!(
        changed.iter().copied().collect::<BTreeSet<_>>(),
        with_params
    );
    assert!(changed_groups(&before, &before, m).is_empty());

    // Rewrite as a package from the new packed bytes.
    let arch = m.config.build();
    let data: Vec<Vec<u8>> = arch
        .params
        .iter()
        .map(|p| {
            let (start, n) = param_offset(m, &p.name);
            after[start..start + 4 * n].to_vec()
        })
        .collect();
    let spec = PackageSpec {
        name: format!("{}-trained", m.name),
        config: m.config.clone(),
        scale: m.scale,
        seed: None,
        origin: None,
        group_bytes: m.group_bytes,
        dtype: distmind_models::ParamDtype::F32,
    };
    let out_dir = tempfile::tempdir().unwrap();
    write_package(out_dir.path(), &spec, &arch, &data).unwrap();
    let trained = Package::open(out_dir.path().join(&spec.name)).unwrap();
    trained.verify().unwrap();
    assert_eq!(packed_of(&trained), after);
    let (outs, _) = infer_package(&trained, &CpuExecutor::new(), &[probe]).unwrap();
    assert_eq!(outs.last().unwrap().data, TensorData::F32(out_after));
}

/// lr 0 and no weight decay: only the running statistics move.
#[test]
fn train_zero_lr_moves_only_running_stats() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Resnet152);
    let m = &pkg.manifest;
    let before = packed_of(&pkg);
    let mut after = before.clone();
    let cfg = SgdConfig {
        lr: 0.0,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    sgd_step(m, &mut after, &images(m, 2, 11), &labels(2), &cfg).unwrap();
    for p in &m.params {
        let same = values(m, &before, &p.name) == values(m, &after, &p.name);
        assert_eq!(same, p.learnable, "{}", p.name);
    }
}

#[test]
fn train_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let resnet = tiny_package(dir.path(), Family::Resnet152);
    let m = &resnet.manifest;
    let mut packed = packed_of(&resnet);
    let cfg = SgdConfig::default();
    // Batch 1 at 32x32 reaches layer4 at 1x1: one value per channel.
    let err = sgd_step(m, &mut packed, &images(m, 1, 1), &labels(1), &cfg).unwrap_err();
    assert!(
        matches!(err, TrainError::Layer { ref name, ref op, .. } if name.starts_with("layer4") && op == "batch_norm"),
        "{err}"
    );
    assert!(
        err.to_string().contains("more than 1 value per channel"),
        "{err}"
    );
    let err = sgd_step(m, &mut packed, &images(m, 2, 1), &[0, 1000], &cfg).unwrap_err();
    assert!(matches!(err, TrainError::BadBatch { .. }), "{err}");
    let err = sgd_step(m, &mut packed, &images(m, 2, 1), &[0], &cfg).unwrap_err();
    assert!(matches!(err, TrainError::BadBatch { .. }), "{err}");
    let err = sgd_step(m, &mut packed[..100], &images(m, 2, 1), &[0, 1], &cfg).unwrap_err();
    assert!(matches!(err, TrainError::PackedSize { .. }), "{err}");
    assert_eq!(packed, packed_of(&resnet), "failed steps write nothing");

    // Transformers train with mean squared error against a target tensor
    // (`sgd_step_of`): labels are refused, naming the loss.
    let bert = tiny_package(dir.path(), Family::BertBase);
    let mut packed = packed_of(&bert);
    let ids = HostTensor::i64(vec![2, 16], vec![0; 32]);
    let err = sgd_step(&bert.manifest, &mut packed, &ids, &[0, 1], &cfg).unwrap_err();
    assert!(
        matches!(err, TrainError::BadBatch { ref why, .. } if why.contains("mean squared error")),
        "{err}"
    );
    assert_eq!(packed, packed_of(&bert), "failed steps write nothing");
}

/// Inception-v3 and DenseNet-201 step too: finite loss, params move.
#[test]
fn train_step_inception_and_densenet() {
    for family in [Family::InceptionV3, Family::Densenet201] {
        let dir = tempfile::tempdir().unwrap();
        let pkg = tiny_package(dir.path(), family);
        let m = &pkg.manifest;
        let before = packed_of(&pkg);
        let mut packed = before.clone();
        // Noise images give near-identical deep features, which batch norm
        // over a 1x1 map blows up; per-image brightness keeps them apart.
        let mut x = images(m, 4, 12);
        if let TensorData::F32(v) = &mut x.data {
            let per_image = v.len() / 4;
            for (i, px) in v.iter_mut().enumerate() {
                *px = 0.5 * *px + (i / per_image) as f32 * 0.5 - 0.75;
            }
        }
        let y = labels(4);
        // Tiny DenseNet reaches a 1x1 map in its last two blocks: batch norm
        // over 4 values per channel makes the loss very curved (the gradient
        // itself is checked above), so it takes a small step.
        let lr = if family == Family::Densenet201 {
            1e-4
        } else {
            0.01
        };
        let cfg = SgdConfig {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
        };
        let r1 = sgd_step(m, &mut packed, &x, &y, &cfg).unwrap();
        let r2 = sgd_step(m, &mut packed, &x, &y, &cfg).unwrap();
        println!(
            "{}: losses {} -> {} ({:.0} ms/step)",
            m.name,
            r1.loss,
            r2.loss,
            r2.elapsed.as_secs_f64() * 1e3
        );
        assert!(r2.loss.is_finite() && r2.loss < r1.loss, "{}", m.name);
        assert_eq!(
            changed_groups(&before, &packed, m).len(),
            m.params
                .iter()
                .map(|p| p.group)
                .collect::<BTreeSet<_>>()
                .len()
        );
    }
}

#[test]
fn half_precision_packages_are_refused_for_training() {
    let dir = tempfile::tempdir().unwrap();
    let opts = GenOptions {
        scale: Scale::Tiny,
        group_bytes: GROUP_BYTES,
        dtype: distmind_models::ParamDtype::BF16,
        ..GenOptions::new(Family::Resnet152, dir.path())
    };
    let pkg = Package::open(&generate(&opts).expect("generate")[0]).expect("open");
    let e = distmind_runtime::train::check_trainable(&pkg.manifest)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&pkg.manifest.name) && e.contains("bf16") && e.contains("--widen"),
        "{e}"
    );
    // The same model stored as f32 trains.
    let f32_pkg = tiny_package(&dir.path().join("f32"), Family::Resnet152);
    distmind_runtime::train::check_trainable(&f32_pkg.manifest).unwrap();
}
