//! `train::StageModel` at tiny scale, every family: a model split into 3
//! stages (cuts that carry several tensors) gives the loss and the param
//! gradients of the whole model (f64); weight stashing under 1F1B with a
//! step between a microbatch's forward and its backward; the loss falling
//! over 20 pipelined SGD steps; params round-tripping bit-exactly through
//! the packed layout and moving to the other side of a new cut; errors
//! naming what was wrong; f64 gradient checks of the transformer ops; the
//! transformers' training forward equal to the cpu executor's inference.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use distmind_models::dtype::widen_to_vec;
use distmind_models::{generate, Family, GenOptions, Manifest, Package, ParamDtype, Scale};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::{all_ready, Executor, HostTensor, TensorData, Trace};
use distmind_runtime::train::{
    boundary, loss_and_gradients_of, training_loss_of, LossKind, Precision, SgdConfig, StageModel,
    StageTensor, Target, TrainBatch, TrainError, STAGE_MICROBATCHES_IN_FLIGHT_MAX,
};

const GROUP_BYTES: u64 = 16 << 10;

fn tiny_package(dir: &Path, family: Family, dtype: ParamDtype) -> Package {
    let opts = GenOptions {
        scale: Scale::Tiny,
        group_bytes: GROUP_BYTES,
        dtype,
        ..GenOptions::new(family, dir)
    };
    Package::open(&generate(&opts).expect("generate")[0]).expect("open")
}

fn packed_of(pkg: &Package) -> Vec<u8> {
    pkg.packed().unwrap().concat()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn is_cnn(family: Family) -> bool {
    !matches!(family, Family::BertBase | Family::Gpt2)
}

/// A model input of `batch` rows: images in U(-1, 1), each image shifted
/// by its own brightness (noise images give near-identical deep features,
/// which batch norm over a 1x1 map blows up), or token ids.
fn model_input(m: &Manifest, batch: usize, seed: u64) -> HostTensor {
    let mut shape = m.inputs[0].shape.clone();
    shape[0] = batch;
    let n: usize = shape.iter().product();
    let mut rng = Rng(seed);
    if is_cnn(m.family) {
        let per = n / batch;
        HostTensor::f32(
            shape,
            (0..n)
                .map(|i| (0.5 * (rng.unit() * 2.0 - 1.0) + 0.5 * (i / per) as f64 - 0.5) as f32)
                .collect(),
        )
    } else {
        let vocab = match m.layers[0].op {
            distmind_models::Op::Embedding { num_embeddings, .. } => num_embeddings,
            _ => panic!("a transformer starts with its token embedding"),
        };
        HostTensor::i64(shape, (0..n).map(|_| rng.below(vocab) as i64).collect())
    }
}

/// The loss's seeded target for the last output at `batch` rows.
fn target(m: &Manifest, batch: usize, seed: u64) -> Target {
    let mut shape = m.outputs.last().unwrap().shape.clone();
    shape[0] = batch;
    LossKind::for_manifest(m)
        .unwrap()
        .synthetic_target(&shape, seed)
}

/// A pipeline driver: routes each boundary tensor from the stage (or model
/// input) that made it to every stage that takes it, and sums a tensor's
/// gradients over the stages that read it.
struct Pipeline {
    stages: Vec<StageModel>,
}

impl Pipeline {
    fn split(m: &Manifest, packed: &[u8], cuts: &[usize], precision: Precision) -> Pipeline {
        let mut edges = vec![0];
        edges.extend_from_slice(cuts);
        edges.push(m.layers.len());
        let stages = edges
            .windows(2)
            .map(|w| StageModel::new(m, w[0]..w[1], packed, precision).unwrap())
            .collect();
        Pipeline { stages }
    }

    /// Every stage's forward of microbatch `mb`; the last stage's outputs.
    fn forward(&mut self, mb: u64, input: &HostTensor) -> Vec<(i64, Tensor)> {
        let mut live: HashMap<i64, StageTensor> = HashMap::new();
        live.insert(-1, input.clone().into());
        let mut last = Vec::new();
        for s in &mut self.stages {
            let ins = s
                .io()
                .inputs
                .iter()
                .map(|r| (*r, live[r].clone()))
                .collect();
            last = s.forward(mb, ins).unwrap();
            for (r, t) in &last {
                live.insert(*r, t.clone().into());
            }
        }
        last
    }

    /// Every stage's backward of `mb`, last to first; the loss.
    fn backward(&mut self, mb: u64, target: &Target) -> f64 {
        let mut grads: HashMap<i64, Tensor> = HashMap::new();
        let add = |grads: &mut HashMap<i64, Tensor>, gs: Vec<(i64, Tensor)>| {
            for (r, g) in gs {
                let sum = match grads.remove(&r) {
                    Some(acc) => acc.add(&g).unwrap(),
                    None => g,
                };
                grads.insert(r, sum);
            }
        };
        let (last, rest) = self.stages.split_last_mut().unwrap();
        let lb = last.backward_from_loss(mb, target).unwrap();
        add(&mut grads, lb.input_grads);
        for s in rest.iter_mut().rev() {
            let outs = s
                .io()
                .outputs
                .iter()
                .map(|r| (*r, grads.remove(r).expect("a gradient for every output")))
                .collect();
            let gs = s.backward(mb, outs).unwrap();
            add(&mut grads, gs);
        }
        lb.loss
    }

    fn step(&mut self, cfg: &SgdConfig) {
        for s in &mut self.stages {
            s.step(cfg).unwrap();
        }
    }

    fn gradients(&self) -> HashMap<String, Vec<f64>> {
        self.stages
            .iter()
            .flat_map(|s| s.gradients().unwrap())
            .collect()
    }
}

/// Two cuts for a 3-stage split: in the first and the second half, each
/// the first from a seeded starting point that carries several tensors
/// (every family has such cuts), or that point.
fn three_stage_cuts(m: &Manifest, seed: u64) -> [usize; 2] {
    let n = m.layers.len();
    let mut rng = Rng(seed);
    let pick = |lo: usize, hi: usize, rng: &mut Rng| {
        let start = lo + rng.below(hi - lo);
        (start..hi)
            .chain(lo..start)
            .find(|&c| boundary(m, c).unwrap().len() >= 2)
            .unwrap_or(start)
    };
    let c1 = pick(1, n / 2, &mut rng);
    let c2 = pick(n / 2 + 1, n - 1, &mut rng);
    [c1, c2]
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0f64, |m, x| m.max(x.abs()))
}

/// Split into 3 stages at cuts carrying several tensors, two microbatches
/// in flight (1F1B order: forward 0, forward 1, backward 1, backward 0):
/// per-microbatch losses and the accumulated gradients equal the whole
/// model's, in f64, to 1e-9 of each param's largest gradient (only the
/// order of the sums of a tensor read by several stages differs).
fn stages_match_whole(family: Family) {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), family, ParamDtype::F32);
    let m = &pkg.manifest;
    let packed = packed_of(&pkg);
    let batch = 2;
    let cuts = three_stage_cuts(m, family as u64 + 1);
    let carried: Vec<usize> = cuts
        .iter()
        .map(|&c| boundary(m, c).unwrap().len())
        .collect();
    println!(
        "{}: {} layers, cuts {cuts:?} carry {carried:?} tensors",
        m.name,
        m.layers.len()
    );
    assert!(carried.iter().any(|&k| k >= 2), "{}: {carried:?}", m.name);
    let mut whole = Pipeline::split(m, &packed, &[], Precision::F64);
    let mut split = Pipeline::split(m, &packed, &cuts, Precision::F64);
    let inputs = [model_input(m, batch, 21), model_input(m, batch, 22)];
    let targets = [target(m, batch, 31), target(m, batch, 32)];
    for p in [&mut whole, &mut split] {
        p.forward(0, &inputs[0]);
        p.forward(1, &inputs[1]);
    }
    for mb in [1u64, 0] {
        let lw = whole.backward(mb, &targets[mb as usize]);
        let ls = split.backward(mb, &targets[mb as usize]);
        assert!(
            (lw - ls).abs() <= 1e-12 * lw.abs(),
            "{}: microbatch {mb} loss {ls} split, {lw} whole",
            m.name
        );
    }
    let gw = whole.gradients();
    let gs = split.gradients();
    assert_eq!(
        gw.len(),
        m.params.iter().filter(|p| p.learnable).count(),
        "a gradient per learnable param"
    );
    assert_eq!(gs.len(), gw.len());
    // A param whose gradient is zero in exact arithmetic (BERT's key
    // biases: softmax ignores what a key bias adds to every score of a
    // query) is compared at 1e-6 of the model's largest gradient.
    let floor = 1e-6 * gw.values().map(|g| max_abs(g)).fold(0f64, f64::max);
    let mut worst = 0f64;
    for (name, a) in &gw {
        let b = &gs[name];
        let scale = max_abs(a).max(floor);
        let diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f64, f64::max);
        worst = worst.max(diff / scale);
        assert!(
            diff <= 1e-9 * scale,
            "{}: gradient of {name} differs by {diff:e} (largest {scale:e})",
            m.name
        );
    }
    println!(
        "{}: split vs whole, worst relative gradient difference {worst:e}",
        m.name
    );
    // Running statistics saw the same batches.
    let rw: HashMap<_, _> = whole.stages[0]
        .running_stats()
        .unwrap()
        .into_iter()
        .collect();
    for s in &split.stages {
        for (name, v) in s.running_stats().unwrap() {
            let d = v
                .iter()
                .zip(&rw[&name])
                .map(|(a, b)| (a - b).abs())
                .fold(0f64, f64::max);
            assert!(d <= 1e-12 * (1.0 + max_abs(&v)), "{name}: {d:e}");
        }
    }
}

#[test]
fn stages_match_whole_resnet152() {
    stages_match_whole(Family::Resnet152);
}

#[test]
fn stages_match_whole_inception_v3() {
    stages_match_whole(Family::InceptionV3);
}

#[test]
fn stages_match_whole_densenet201() {
    stages_match_whole(Family::Densenet201);
}

#[test]
fn stages_match_whole_bert_base() {
    stages_match_whole(Family::BertBase);
}

#[test]
fn stages_match_whole_gpt2() {
    stages_match_whole(Family::Gpt2);
}

/// PipeDream's weight stashing on GPT-2 in two stages: stage A runs the
/// forwards of microbatches 1 and 2 (two in flight), then a step makes
/// version 1; microbatch 1's backward on A must differentiate with version
/// 0, the weights its forward used. The reference is a stage built from
/// the original bytes (version 0) given the same input and the same
/// gradient from stage B: its gradient is the same, bit for bit; one built
/// from version 1 differs.
#[test]
fn weight_stashing_backward_uses_the_forwards_weights() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Gpt2, ParamDtype::F32);
    let m = &pkg.manifest;
    let packed = packed_of(&pkg);
    let n = m.layers.len();
    let cut = n / 2;
    let mut a = StageModel::new(m, 0..cut, &packed, Precision::F64).unwrap();
    let mut b = StageModel::new(m, cut..n, &packed, Precision::F64).unwrap();
    let cfg = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 1e-4,
    };
    let x: Vec<HostTensor> = (0..4).map(|i| model_input(m, 2, 40 + i)).collect();
    let t: Vec<Target> = (0..4).map(|i| target(m, 2, 50 + i)).collect();
    let fwd_a = |a: &mut StageModel, mb: u64| {
        let ins = a
            .io()
            .inputs
            .iter()
            .map(|&r| {
                assert_eq!(r, -1);
                (r, StageTensor::from(x[mb as usize].clone()))
            })
            .collect();
        a.forward(mb, ins).unwrap()
    };
    let through_b = |b: &mut StageModel, mb: u64, outs: Vec<(i64, Tensor)>| {
        let ins = outs.into_iter().map(|(r, t)| (r, t.into())).collect();
        b.forward(mb, ins).unwrap();
        b.backward_from_loss(mb, &t[mb as usize])
            .unwrap()
            .input_grads
    };
    // Microbatch 0 all the way: both stages accumulate a gradient.
    let out0 = fwd_a(&mut a, 0);
    let g0 = through_b(&mut b, 0, out0);
    a.backward(0, g0).unwrap();
    // Two forwards in flight on A at version 0, then the step.
    let out1 = fwd_a(&mut a, 1);
    let out2 = fwd_a(&mut a, 2);
    assert_eq!(a.in_flight(), 2);
    assert_eq!(a.in_flight_version(1), Some(0));
    a.step(&cfg).unwrap();
    b.step(&cfg).unwrap();
    assert_eq!(a.version(), 1);
    let v1 = a.params_flat().unwrap();
    // Microbatch 1's backward on A, with B's gradient at version 1.
    let g1 = through_b(&mut b, 1, out1.clone());
    a.backward(1, g1.clone()).unwrap();
    let stashed: HashMap<_, _> = a.gradients().unwrap().into_iter().collect();
    assert_eq!(a.in_flight(), 1, "microbatch 1's stash is freed");

    let reference = |params: Option<&[f32]>| {
        let mut r = StageModel::new(m, 0..cut, &packed, Precision::F64).unwrap();
        if let Some(p) = params {
            r.set_params_flat(p).unwrap();
        }
        let outs = fwd_a(&mut r, 1);
        // The same forward outputs at version 0.
        if params.is_none() {
            for ((_, o), (_, w)) in outs.iter().zip(&out1) {
                assert_eq!(
                    o.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
                    w.flatten_all().unwrap().to_vec1::<f64>().unwrap()
                );
            }
        }
        r.backward(1, g1.clone()).unwrap();
        r.gradients()
            .unwrap()
            .into_iter()
            .collect::<HashMap<_, _>>()
    };
    let old = reference(None);
    for (name, g) in &old {
        assert_eq!(&stashed[name], g, "{name}: not the gradient at version 0");
    }
    let new = reference(Some(&v1));
    let differs = new.iter().any(|(name, g)| &stashed[name] != g);
    assert!(
        differs,
        "version 1 gives the same gradient: the test proves nothing"
    );

    // Microbatch 2 also kept version 0; microbatch 3 runs at version 1.
    assert_eq!(a.in_flight_version(2), Some(0));
    fwd_a(&mut a, 3);
    assert_eq!(a.in_flight_version(3), Some(1));
    let g2 = through_b(&mut b, 2, out2);
    a.backward(2, g2).unwrap();
    assert_eq!(a.accumulated(), 2);
    assert!(a.discard(3));
    assert_eq!(a.in_flight(), 0);
}

/// A step applies the MEAN of the microbatches' gradients: two
/// microbatches accumulated give `(g0 + g1) / 2` (each `g` a fresh stage's
/// gradient of one microbatch), and plain SGD moves every param by
/// `-lr (g0 + g1) / 2`; the accumulator is empty after the step.
#[test]
fn step_applies_the_mean_of_the_microbatch_gradients() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::BertBase, ParamDtype::F32);
    let m = &pkg.manifest;
    let packed = packed_of(&pkg);
    let n = m.layers.len();
    let x = [model_input(m, 2, 111), model_input(m, 3, 112)];
    let t = [target(m, 2, 113), target(m, 3, 114)];
    let one = |mb: usize| {
        let mut s = StageModel::new(m, 0..n, &packed, Precision::F64).unwrap();
        s.forward(0, vec![(-1, x[mb].clone().into())]).unwrap();
        s.backward_from_loss(0, &t[mb]).unwrap();
        s.gradients()
            .unwrap()
            .into_iter()
            .collect::<HashMap<_, _>>()
    };
    let (g0, g1) = (one(0), one(1));
    let mut s = StageModel::new(m, 0..n, &packed, Precision::F64).unwrap();
    let before = s.params_flat().unwrap();
    for mb in [0usize, 1] {
        s.forward(mb as u64, vec![(-1, x[mb].clone().into())])
            .unwrap();
    }
    for mb in [1usize, 0] {
        s.backward_from_loss(mb as u64, &t[mb]).unwrap();
    }
    assert_eq!(s.accumulated(), 2);
    let mean: HashMap<_, _> = s.gradients().unwrap().into_iter().collect();
    for (name, g) in &mean {
        for (i, v) in g.iter().enumerate() {
            let want = (g0[name][i] + g1[name][i]) / 2.0;
            assert!(
                (v - want).abs() <= 1e-14 * (1.0 + want.abs()),
                "{name}[{i}]"
            );
        }
    }
    let lr = 0.5;
    let cfg = SgdConfig {
        lr,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    let report = s.step(&cfg).unwrap();
    assert_eq!((report.microbatches, report.version), (2, 1));
    assert_eq!(s.accumulated(), 0);
    let after = s.params_flat().unwrap();
    let mut at = 0;
    for (name, len) in s.flat_layout() {
        for i in 0..len {
            let want = before[at + i] as f64 - lr as f64 * mean[&name][i];
            let got = after[at + i] as f64;
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{name}[{i}]"
            );
        }
        at += len;
    }
}

/// Pipelined SGD on every family: 3 stages, 2 microbatches per iteration,
/// 20 steps on a fixed batch; the loss falls.
#[test]
fn loss_falls_over_pipelined_sgd_steps() {
    let mut report = Vec::new();
    for family in Family::ALL {
        let dir = tempfile::tempdir().unwrap();
        let pkg = tiny_package(dir.path(), family, ParamDtype::F32);
        let m = &pkg.manifest;
        let packed = packed_of(&pkg);
        let cuts = three_stage_cuts(m, 7);
        let mut p = Pipeline::split(m, &packed, &cuts, Precision::F32);
        let (batch, lr) = match family {
            // Tiny DenseNet ends in 1x1 maps: batch norm over a few values
            // per channel makes its loss very curved (see train_step.rs).
            Family::Densenet201 => (4, 0.03),
            Family::Resnet152 | Family::InceptionV3 => (4, 0.02),
            Family::BertBase | Family::Gpt2 => (2, 0.05),
        };
        let cfg = SgdConfig {
            lr,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        let x = [model_input(m, batch, 61), model_input(m, batch, 62)];
        let t = [target(m, batch, 71), target(m, batch, 72)];
        let mut losses = Vec::new();
        for _ in 0..20 {
            p.forward(0, &x[0]);
            p.forward(1, &x[1]);
            let l1 = p.backward(1, &t[1]);
            let l0 = p.backward(0, &t[0]);
            p.step(&cfg);
            losses.push((l0 + l1) / 2.0);
        }
        let first = losses[0];
        let last = *losses.last().unwrap();
        println!("{}: loss over 20 steps {losses:.4?}", m.name);
        assert!(
            losses.iter().all(|l| l.is_finite()),
            "{}: {losses:?}",
            m.name
        );
        assert!(
            last < 0.6 * first,
            "{}: loss {first} -> {last} fell too little: {losses:?}",
            m.name
        );
        report.push((m.name.clone(), first, last));
    }
    println!("{report:?}");
}

/// The packed round trip: a stage's exported layers are the package's own
/// bytes (f32 package: the device layout is the stored one), loading them
/// back is bit-exact, and after training, moving layers to the other side
/// of a new cut gives stages with identical outputs. Flat params round-trip
/// too, and a half-precision package loads widened.
#[test]
fn params_round_trip_and_move_between_stages() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Resnet152, ParamDtype::F32);
    let m = &pkg.manifest;
    let packed = packed_of(&pkg);
    let n = m.layers.len();
    let cut = n / 2;
    let mut p = Pipeline::split(m, &packed, &[cut], Precision::F32);
    let part = p.stages[1].layer_params_packed(cut..n).unwrap();
    assert_eq!(part.layers, cut..n);
    assert_eq!(
        part.bytes,
        packed[part.offset as usize..part.range().end as usize],
        "exported layers are the package's packed bytes"
    );
    // Train two steps (running statistics move too).
    let cfg = SgdConfig::default();
    let x = model_input(m, 4, 81);
    let t = target(m, 4, 82);
    for _ in 0..2 {
        p.forward(0, &x);
        p.backward(0, &t);
        p.step(&cfg);
    }
    // Round trip through a fresh stage built from the original bytes.
    let trained = p.stages[1].layer_params_packed(cut..n).unwrap();
    assert_ne!(trained.bytes, part.bytes);
    let mut fresh = StageModel::new(m, cut..n, &packed, Precision::F32).unwrap();
    fresh.load_layer_params(&trained).unwrap();
    assert_eq!(fresh.layer_params_packed(cut..n).unwrap(), trained);
    assert_eq!(
        fresh.params_flat().unwrap(),
        p.stages[1].params_flat().unwrap()
    );
    assert_eq!(fresh.version(), 1);

    // A new cut, earlier: layers [new_cut, cut) move from stage 0 to stage 1.
    let new_cut = (1..cut)
        .rev()
        .find(|&c| {
            boundary(m, c).unwrap().len() >= 2
                && m.params.iter().any(|p| (c..cut).contains(&p.layer))
        })
        .unwrap();
    let a = &p.stages[0];
    let b_part = p.stages[1].layer_params_packed(cut..n).unwrap();
    let moved = Pipeline {
        stages: vec![
            StageModel::from_layer_params(
                m,
                0..new_cut,
                &[a.layer_params_packed(0..new_cut).unwrap()],
                Precision::F32,
            )
            .unwrap(),
            StageModel::from_layer_params(
                m,
                new_cut..n,
                &[a.layer_params_packed(new_cut..cut).unwrap(), b_part.clone()],
                Precision::F32,
            )
            .unwrap(),
        ],
    };
    let mut moved = moved;
    let probe = model_input(m, 2, 83);
    let before = p.forward(5, &probe);
    let after = moved.forward(5, &probe);
    assert_eq!(before.len(), after.len());
    for ((r1, t1), (r2, t2)) in before.iter().zip(&after) {
        assert_eq!(r1, r2);
        assert_eq!(
            t1.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            t2.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "outputs differ after moving layers [{new_cut}, {cut})"
        );
    }
    // A layer range missing from the parts is named.
    let err =
        StageModel::from_layer_params(m, new_cut..n, std::slice::from_ref(&b_part), Precision::F32)
            .err()
            .unwrap()
            .to_string();
    let first_moved = m.params.iter().find(|p| p.layer >= new_cut).unwrap();
    assert!(
        err.contains("no params were given") && err.contains(&m.layers[first_moved.layer].name),
        "{err}"
    );

    // Flat params: another replica takes them, and an average is exact.
    let flat = p.stages[0].params_flat().unwrap();
    let mut replica = StageModel::new(m, 0..cut, &packed, Precision::F32).unwrap();
    let orig = replica.params_flat().unwrap();
    let avg: Vec<f32> = flat.iter().zip(&orig).map(|(a, b)| 0.5 * (a + b)).collect();
    replica.set_params_flat(&avg).unwrap();
    assert_eq!(replica.params_flat().unwrap(), avg);
    let layout = replica.flat_layout();
    assert_eq!(layout.iter().map(|(_, k)| k).sum::<usize>(), avg.len());
    assert!(replica.set_params_flat(&avg[1..]).is_err());

    // Half precision: the params are the stored bf16 values, widened.
    let half = tiny_package(&dir.path().join("bf16"), Family::Gpt2, ParamDtype::BF16);
    let hm = &half.manifest;
    let hp = packed_of(&half);
    let stage = StageModel::new(hm, 0..3, &hp, Precision::F32).unwrap();
    let mut want = Vec::new();
    for (name, _) in stage.flat_layout() {
        want.extend(widen_to_vec(
            ParamDtype::BF16,
            &half.param_bytes(&name).unwrap(),
        ));
    }
    assert_eq!(stage.params_flat().unwrap(), want);
}

fn stage_of(m: &Manifest, packed: &[u8], layers: std::ops::Range<usize>) -> StageModel {
    StageModel::new(m, layers, packed, Precision::F32).unwrap()
}

#[test]
fn bad_inputs_are_refused_naming_the_tensor_and_microbatch() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), Family::Resnet152, ParamDtype::F32);
    let m = &pkg.manifest;
    let packed = packed_of(&pkg);
    let n = m.layers.len();
    let conv1 = m
        .layers
        .iter()
        .position(|l| l.name == "layer1.0.conv1")
        .unwrap();
    let cut = conv1 + 1;
    let carried = boundary(m, cut).unwrap();
    assert_eq!(carried.len(), 2);
    // The real boundary tensors, from the first stage.
    let mut first = stage_of(m, &packed, 0..cut);
    let outs = first
        .forward(0, vec![(-1, model_input(m, 2, 1).into())])
        .unwrap();
    let mut second = stage_of(m, &packed, cut..n);
    let where_ = format!("{} stage [{cut}, {n}) microbatch 7", m.name);

    // A missing boundary tensor is named.
    let err = second
        .forward(7, vec![(outs[1].0, outs[1].1.clone().into())])
        .unwrap_err();
    let missing = &m.layers[outs[0].0 as usize].name;
    let text = err.to_string();
    assert!(matches!(err, TrainError::StageBatch { mb: 7, .. }), "{err}");
    assert!(
        text.contains(&where_) && text.contains(missing) && text.contains("missing"),
        "{text}"
    );

    // A wrong shape: the tensor, what came and what was expected.
    let wrong = Tensor::zeros((2, 3, 8, 8), DType::F32, &Device::Cpu).unwrap();
    let err = second
        .forward(
            7,
            vec![
                (outs[0].0, wrong.into()),
                (outs[1].0, outs[1].1.clone().into()),
            ],
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&where_) && err.contains(missing) && err.contains("expected f32"),
        "{err}"
    );
    // An inconsistent batch between the two tensors.
    let half_batch = outs[1].1.narrow(0, 0, 1).unwrap();
    let err = second
        .forward(
            7,
            vec![
                (outs[0].0, outs[0].1.clone().into()),
                (outs[1].0, half_batch.into()),
            ],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("expected f32 [2,"), "{err}");
    // A tensor the stage does not take.
    let err = second
        .forward(7, vec![(-1, model_input(m, 2, 1).into())])
        .unwrap_err()
        .to_string();
    assert!(err.contains("not an input of the stage"), "{err}");
    assert_eq!(second.in_flight(), 0, "refused forwards keep nothing");

    // Backward: unknown microbatch, a missing gradient (the microbatch stays
    // in flight), a wrong shape, a loss asked of a middle stage.
    let ins: Vec<(i64, StageTensor)> = outs.iter().map(|(r, t)| (*r, t.clone().into())).collect();
    let mut middle = stage_of(m, &packed, cut..n - 3);
    let mid_out = middle.forward(7, ins.clone()).unwrap();
    let err = middle.backward(8, vec![]).unwrap_err().to_string();
    assert!(
        err.contains("microbatch 8") && err.contains("no forward"),
        "{err}"
    );
    let err = middle.backward(7, vec![]).unwrap_err().to_string();
    assert!(
        err.contains("gradient of") && err.contains("missing"),
        "{err}"
    );
    let bad: Vec<(i64, Tensor)> = mid_out
        .iter()
        .map(|(r, t)| (*r, t.narrow(0, 0, 1).unwrap()))
        .collect();
    assert!(middle.backward(7, bad).is_err());
    let err = middle
        .backward_from_loss(7, &target(m, 2, 1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("last stage"), "{err}");
    assert_eq!(middle.in_flight(), 1);
    let good: Vec<(i64, Tensor)> = mid_out
        .iter()
        .map(|(r, t)| (*r, t.ones_like().unwrap()))
        .collect();
    let grads = middle.backward(7, good).unwrap();
    assert_eq!(
        grads.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        carried,
        "a gradient per layer-output input"
    );
    let err = middle.step(&SgdConfig::default());
    assert!(err.is_ok());
    assert!(
        middle.step(&SgdConfig::default()).is_err(),
        "a step needs a backward first"
    );

    // The last stage: a target of the wrong kind or shape.
    second.forward(7, ins.clone()).unwrap();
    let err = second
        .backward_from_loss(7, &Target::Labels(vec![0]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("1 labels for 2 samples"), "{err}");
    let err = second
        .backward_from_loss(7, &Target::Values(HostTensor::f32(vec![1], vec![0.0])))
        .unwrap_err()
        .to_string();
    assert!(err.contains("takes labels"), "{err}");

    // The in-flight bound: a duplicate, then the limit.
    let err = second.forward(7, ins.clone()).unwrap_err().to_string();
    assert!(err.contains("already in flight"), "{err}");
    second.set_in_flight_limit(2).unwrap();
    second.forward(8, ins.clone()).unwrap();
    let err = second.forward(9, ins.clone()).unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::InFlightFull {
                mb: 9,
                in_flight: 2,
                limit: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(second
        .set_in_flight_limit(STAGE_MICROBATCHES_IN_FLIGHT_MAX + 1)
        .is_err());
    second
        .set_in_flight_limit(STAGE_MICROBATCHES_IN_FLIGHT_MAX)
        .unwrap();
    for mb in 9..STAGE_MICROBATCHES_IN_FLIGHT_MAX as u64 + 7 {
        second.forward(mb, ins.clone()).unwrap();
    }
    let err = second.forward(1000, ins.clone()).unwrap_err().to_string();
    assert!(
        err.contains(&format!("the limit is {STAGE_MICROBATCHES_IN_FLIGHT_MAX}")),
        "{err}"
    );

    // Token ids of the wrong dtype, and too many tokens.
    let gpt = tiny_package(&dir.path().join("gpt2"), Family::Gpt2, ParamDtype::F32);
    let gm = &gpt.manifest;
    let mut s = stage_of(gm, &packed_of(&gpt), 0..4);
    let err = s
        .forward(
            3,
            vec![(-1, HostTensor::f32(vec![2, 16], vec![0.0; 32]).into())],
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model input 0") && err.contains("i64"),
        "{err}"
    );
    let err = s
        .forward(
            3,
            vec![(-1, HostTensor::i64(vec![1, 65], vec![0; 65]).into())],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("65 tokens"), "{err}");
    let err = s
        .forward(
            3,
            vec![(-1, HostTensor::i64(vec![1, 4], vec![0, 1, 2, 100]).into())],
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::StageLayer {
                layer: 0,
                mb: 3,
                ..
            }
        ) && err.to_string().contains("outside the vocabulary"),
        "{err}"
    );
    // Any batch and any length up to the position table run.
    s.forward(
        4,
        vec![(-1, HostTensor::i64(vec![3, 5], vec![1; 15]).into())],
    )
    .unwrap();
}

/// Central finite differences in f64 against backward for the transformer
/// families: the params of every transformer op (embeddings, layer norms,
/// the projections around attention, the gelu MLP, the pooler), the
/// largest-gradient element half of the time.
fn transformer_gradient_check(family: Family, names: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let pkg = tiny_package(dir.path(), family, ParamDtype::F32);
    let m = &pkg.manifest;
    let mut packed = packed_of(&pkg);
    let batch = TrainBatch {
        inputs: vec![model_input(m, 2, 91)],
        target: target(m, 2, 92),
    };
    let grads = loss_and_gradients_of(m, &packed, &batch, Precision::F64).unwrap();
    let mut rng = Rng(93);
    let mut worst = 0f64;
    for &name in names {
        let p = m
            .params
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("{name}"));
        let start = (m.groups[p.group].offset + p.offset) as usize;
        let g = &grads.grads[name];
        assert!(g.iter().any(|v| *v != 0.0), "{name}: zero gradient");
        for pick in 0..2 {
            let i = if pick == 0 {
                (0..g.len())
                    .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
                    .unwrap()
            } else {
                rng.below(g.len())
            };
            let at = start + 4 * i;
            let get = |b: &[u8]| f32::from_le_bytes(b[at..at + 4].try_into().unwrap());
            let v = get(&packed);
            let h = 1e-4 * v.abs().max(0.1);
            let mut loss_at = |x: f32| {
                packed[at..at + 4].copy_from_slice(&x.to_le_bytes());
                let delta = get(&packed) as f64 - v as f64;
                (
                    training_loss_of(m, &packed, &batch, Precision::F64).unwrap(),
                    delta,
                )
            };
            let (lp, dp) = loss_at(v + h);
            let (lm, dm) = loss_at(v - h);
            loss_at(v);
            let fd = (lp - lm) / (dp - dm);
            let err = (fd - g[i]).abs() / (fd.abs().max(g[i].abs()) + 1e-9);
            worst = worst.max(err);
            assert!(
                err < 1e-4,
                "{}: d loss / d {name}[{i}]: finite difference {fd:e}, backward {:e}",
                m.name,
                g[i]
            );
        }
    }
    println!(
        "{}: transformer gradient check worst relative error {worst:e}",
        m.name
    );
}

#[test]
fn gradient_check_bert_base() {
    transformer_gradient_check(
        Family::BertBase,
        &[
            "embeddings.word_embeddings.weight",
            "embeddings.position_embeddings.weight",
            "embeddings.token_type_embeddings.weight",
            "embeddings.LayerNorm.weight",
            "encoder.layer.0.attention.self.query.weight",
            "encoder.layer.0.attention.self.key.weight",
            "encoder.layer.0.attention.self.value.bias",
            "encoder.layer.0.attention.self.value.weight",
            "encoder.layer.0.attention.output.LayerNorm.bias",
            "encoder.layer.0.intermediate.dense.weight",
            "encoder.layer.1.output.dense.weight",
            "encoder.layer.1.output.LayerNorm.weight",
            "pooler.dense.weight",
            "pooler.dense.bias",
        ],
    );
}

#[test]
fn gradient_check_gpt2() {
    transformer_gradient_check(
        Family::Gpt2,
        &[
            "wte.weight",
            "wpe.weight",
            "h.0.ln_1.weight",
            "h.0.attn.c_attn.weight",
            "h.0.attn.c_attn.bias",
            "h.0.attn.c_proj.weight",
            "h.0.ln_2.bias",
            "h.0.mlp.c_fc.weight",
            "h.1.mlp.c_proj.weight",
            "ln_f.weight",
            "ln_f.bias",
        ],
    );
}

/// Without batch norm or dropout, a transformer's training forward is its
/// inference: the stage's outputs equal the cpu executor's (to f32
/// rounding: the executor's layer norm sums in f64).
#[test]
fn transformer_training_forward_equals_inference() {
    for family in [Family::BertBase, Family::Gpt2] {
        let dir = tempfile::tempdir().unwrap();
        let pkg = tiny_package(dir.path(), family, ParamDtype::F32);
        let m = &pkg.manifest;
        let packed = packed_of(&pkg);
        let x = model_input(m, 2, 101);
        let exec = CpuExecutor::new();
        let arena = exec.alloc_arena(m.stored_bytes).unwrap();
        for g in &m.groups {
            let r = g.offset as usize..(g.offset + g.bytes) as usize;
            arena.upload(g.index, g.offset, &packed[r]).unwrap();
        }
        let mut program = exec.program(m, arena).unwrap();
        let want = program
            .run(std::slice::from_ref(&x), &mut all_ready, &mut Trace::new())
            .unwrap();
        let mut stage = stage_of(m, &packed, 0..m.layers.len());
        let got = stage.forward(0, vec![(-1, x.into())]).unwrap();
        assert_eq!(got.len(), want.len());
        for ((_, t), w) in got.iter().zip(&want) {
            let TensorData::F32(w) = &w.data else {
                panic!()
            };
            let t = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let worst = t
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-4, "{}: output differs by {worst}", m.name);
        }
    }
}
