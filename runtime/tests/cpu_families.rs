//! The cpu executor on every family at tiny scale: packages generated into a
//! tempdir, seeded random inputs, output shapes and finiteness, gating order,
//! lazy uploads from inside the gate, param caching across runs, batch sizes,
//! bad inputs and `infer_files`.

use std::path::Path;

use distmind_models::graph::EmbeddingIds;
use distmind_models::{generate, Dtype, Family, GenOptions, Manifest, Op, Package, Scale};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::{
    all_ready, ExecError, Executor, HostTensor, Program, TensorData, Trace, TraceEvent,
};
use distmind_runtime::infer::{infer_files, infer_package};
use distmind_runtime::npy::{read_npy, write_npy};

/// Small groups, so that tiny models have several.
const GROUP_BYTES: u64 = 16 << 10;

fn tiny_package(dir: &Path, family: Family) -> Package {
    let opts = GenOptions {
        scale: Scale::Tiny,
        group_bytes: GROUP_BYTES,
        ..GenOptions::new(family, dir)
    };
    let dirs = generate(&opts).expect("generate");
    Package::open(&dirs[0]).expect("open")
}

/// SplitMix64 draws in [0, 1).
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Images U(-1, 1); token ids uniform in the vocabulary. `batch` replaces
/// the manifest's batch size.
fn random_input(m: &Manifest, batch: usize, seed: u64) -> HostTensor {
    let spec = &m.inputs[0];
    let mut shape = spec.shape.clone();
    shape[0] = batch;
    let n: usize = shape.iter().product();
    let mut rng = Rng(seed);
    match spec.dtype {
        Dtype::F32 => HostTensor::f32(
            shape,
            (0..n).map(|_| (rng.unit() * 2.0 - 1.0) as f32).collect(),
        ),
        Dtype::I64 => {
            let vocab = m
                .layers
                .iter()
                .find_map(|l| match l.op {
                    Op::Embedding {
                        num_embeddings,
                        ids: EmbeddingIds::Input,
                        ..
                    } => Some(num_embeddings),
                    _ => None,
                })
                .expect("a token model has a word embedding");
            HostTensor::i64(
                shape,
                (0..n).map(|_| (rng.unit() * vocab as f64) as i64).collect(),
            )
        }
    }
}

fn f32s(t: &HostTensor) -> &[f32] {
    match &t.data {
        TensorData::F32(v) => v,
        TensorData::I64(_) => panic!("expected an f32 output, got {}", t.describe()),
    }
}

fn check_outputs(m: &Manifest, outputs: &[HostTensor], batch: usize) {
    assert_eq!(outputs.len(), m.outputs.len(), "{}", m.name);
    for (t, spec) in outputs.iter().zip(&m.outputs) {
        let mut want = spec.shape.clone();
        want[0] = batch;
        assert_eq!(t.shape, want, "{} output {}", m.name, spec.name);
        let bad = f32s(t).iter().filter(|v| !v.is_finite()).count();
        assert_eq!(
            bad, 0,
            "{} output {}: {bad} values not finite",
            m.name, spec.name
        );
        assert!(
            f32s(t).iter().any(|&v| v != 0.0),
            "{} output {} is all zeros",
            m.name,
            spec.name
        );
    }
}

/// Groups that hold params, in increasing order.
fn param_groups(m: &Manifest) -> Vec<usize> {
    let mut gs: Vec<usize> = m.params.iter().map(|p| p.group).collect();
    gs.sort_unstable();
    gs.dedup();
    gs
}

fn uploaded_program(exec: &CpuExecutor, pkg: &Package) -> Box<dyn Program> {
    let m = &pkg.manifest;
    let arena = exec.alloc_arena(m.stored_bytes).unwrap();
    for g in &m.groups {
        arena
            .upload(g.index, g.offset, &pkg.group_bytes(g.index).unwrap())
            .unwrap();
    }
    exec.program(m, arena).unwrap()
}

/// Gate calls, once per group and increasing, and every layer of group g
/// starting after `GroupReady { g }`.
fn check_gating(m: &Manifest, calls: &[usize], trace: &Trace) {
    assert_eq!(calls, param_groups(m), "{}: gate calls", m.name);
    let mut ready = vec![false; m.groups.len()];
    let mut last = std::time::Duration::ZERO;
    let mut started = 0;
    for &(at, ev) in trace {
        assert!(at >= last, "trace times go back");
        last = at;
        match ev {
            TraceEvent::GroupReady { group } => {
                assert!(!ready[group], "group {group} ready twice");
                ready[group] = true;
            }
            TraceEvent::LayerStart { layer } => {
                assert_eq!(layer, started, "layers start in order");
                started += 1;
                if let Some(g) = m.layers[layer].group {
                    assert!(
                        ready[g],
                        "{}: layer {layer} of group {g} started before its GroupReady",
                        m.name
                    );
                }
            }
            TraceEvent::LayerEnd { .. } => {}
        }
    }
    assert_eq!(started, m.layers.len());
}

#[test]
fn every_family_runs_with_correct_shapes_and_gating() {
    let dir = tempfile::tempdir().unwrap();
    let exec = CpuExecutor::new();
    assert!(exec.describe().starts_with("cpu (candle"));
    for family in Family::ALL {
        let pkg = tiny_package(dir.path(), family);
        let m = &pkg.manifest;
        assert!(
            param_groups(m).len() > 1,
            "{}: the test wants several groups",
            m.name
        );
        let x = random_input(m, m.inputs[0].shape[0], 7);

        let (outputs, trace) = infer_package(&pkg, &exec, std::slice::from_ref(&x)).unwrap();
        check_outputs(m, &outputs, m.inputs[0].shape[0]);
        assert_eq!(
            trace
                .iter()
                .filter(|(_, e)| matches!(e, TraceEvent::LayerEnd { .. }))
                .count(),
            m.layers.len()
        );

        // Gating, twice on one program: the second run reads cached params
        // and must gate again, and compute the same numbers.
        let mut program = uploaded_program(&exec, &pkg);
        for run in 0..2 {
            let mut calls = Vec::new();
            let mut trace = Trace::new();
            let again = program
                .run(
                    std::slice::from_ref(&x),
                    &mut |g| {
                        calls.push(g);
                        Ok(())
                    },
                    &mut trace,
                )
                .unwrap();
            check_gating(m, &calls, &trace);
            assert_eq!(
                again, outputs,
                "{} run {run} differs from infer_package",
                m.name
            );
        }
    }
}

/// Groups uploaded only when the program asks for them: the executor must
/// not read a group before its gate.
#[test]
fn groups_uploaded_inside_the_gate_give_the_same_result() {
    let dir = tempfile::tempdir().unwrap();
    let exec = CpuExecutor::new();
    for family in [Family::Resnet152, Family::Gpt2] {
        let pkg = tiny_package(dir.path(), family);
        let m = &pkg.manifest;
        let x = random_input(m, 1, 3);
        let (want, _) = infer_package(&pkg, &exec, std::slice::from_ref(&x)).unwrap();
        let arena = exec.alloc_arena(m.stored_bytes).unwrap();
        let mut program = exec.program(m, arena.clone()).unwrap();
        let mut gate = |g: usize| {
            let e = &m.groups[g];
            arena.upload(g, e.offset, &pkg.group_bytes(g).unwrap())
        };
        let got = program
            .run(std::slice::from_ref(&x), &mut gate, &mut Trace::new())
            .unwrap();
        assert_eq!(got, want, "{}", m.name);
    }
}

#[test]
fn other_batch_sizes_are_accepted_and_rows_are_independent() {
    let dir = tempfile::tempdir().unwrap();
    let exec = CpuExecutor::new();
    for family in [Family::Densenet201, Family::BertBase] {
        let pkg = tiny_package(dir.path(), family);
        let m = &pkg.manifest;
        let x3 = random_input(m, 3, 11);
        let (out3, _) = infer_package(&pkg, &exec, std::slice::from_ref(&x3)).unwrap();
        check_outputs(m, &out3, 3);
        // Row 1 of the batch alone gives row 1 of the batched outputs.
        let per_row = x3.shape[1..].iter().product::<usize>();
        let row1 = match &x3.data {
            TensorData::F32(v) => HostTensor::f32(
                [&[1], &x3.shape[1..]].concat(),
                v[per_row..2 * per_row].to_vec(),
            ),
            TensorData::I64(v) => HostTensor::i64(
                [&[1], &x3.shape[1..]].concat(),
                v[per_row..2 * per_row].to_vec(),
            ),
        };
        let (out1, _) = infer_package(&pkg, &exec, &[row1]).unwrap();
        for (a, b) in out3.iter().zip(&out1) {
            let n = b.shape.iter().product::<usize>();
            let batched = &f32s(a)[n..2 * n];
            for (x, y) in batched.iter().zip(f32s(b)) {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                    "{}: {x} vs {y}",
                    m.name
                );
            }
        }
    }
}

#[test]
fn bad_inputs_and_gate_failures_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let exec = CpuExecutor::new();
    let pkg = tiny_package(dir.path(), Family::Resnet152);
    let m = &pkg.manifest;
    let mut program = uploaded_program(&exec, &pkg);
    let wrong = HostTensor::f32(vec![1, 3, 16, 16], vec![0.0; 3 * 16 * 16]);
    let e = program
        .run(&[wrong], &mut all_ready, &mut Trace::new())
        .unwrap_err();
    assert!(matches!(e, ExecError::BadInput { index: 0, .. }), "{e}");
    assert!(
        e.to_string().contains("[1, 3, 16, 16]") && e.to_string().contains(&m.name),
        "{e}"
    );
    let ids = HostTensor::i64(
        m.inputs[0].shape.clone(),
        vec![0; m.inputs[0].shape.iter().product()],
    );
    assert!(matches!(
        program.run(&[ids], &mut all_ready, &mut Trace::new()),
        Err(ExecError::BadInput { .. })
    ));
    assert!(program.run(&[], &mut all_ready, &mut Trace::new()).is_err());

    let x = random_input(m, 1, 1);
    let mut failing = |g: usize| {
        if g == 1 {
            Err(ExecError::Gate {
                group: g,
                why: "peer gone".into(),
            })
        } else {
            Ok(())
        }
    };
    let e = program
        .run(std::slice::from_ref(&x), &mut failing, &mut Trace::new())
        .unwrap_err();
    assert!(matches!(e, ExecError::Gate { group: 1, .. }), "{e}");
    // The program still works afterwards.
    program
        .run(&[x], &mut all_ready, &mut Trace::new())
        .unwrap();

    // Token ids outside the vocabulary name the layer.
    let bert = tiny_package(dir.path(), Family::BertBase);
    let bad_ids = HostTensor::i64(bert.manifest.inputs[0].shape.clone(), vec![1_000_000; 16]);
    let e = infer_package(&bert, &exec, &[bad_ids])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("word_embeddings") && e.contains("embedding") && e.contains("token id 1000000"),
        "{e}"
    );

    // An arena of another backend is refused; a cpu arena from another cpu
    // executor is plain host memory and works.
    struct Foreign(u64);
    impl distmind_runtime::exec::Arena for Foreign {
        fn len(&self) -> u64 {
            self.0
        }
        unsafe fn upload_async(
            &self,
            _: usize,
            _: u64,
            _: distmind_models::ParamDtype,
            _: &[u8],
        ) -> Result<(), ExecError> {
            Ok(())
        }
    }
    let foreign: std::sync::Arc<dyn distmind_runtime::exec::Arena> =
        std::sync::Arc::new(Foreign(m.stored_bytes));
    assert!(matches!(
        exec.program(m, foreign),
        Err(ExecError::Model { .. })
    ));
    let other = CpuExecutor::new().alloc_arena(m.stored_bytes).unwrap();
    assert!(exec.program(m, other).is_ok());
    let small = exec.alloc_arena(m.stored_bytes / 2).unwrap();
    assert!(matches!(
        exec.program(m, small.clone()),
        Err(ExecError::Model { .. })
    ));
    assert!(matches!(
        small.upload(0, m.stored_bytes / 2 - 1, &[0, 0]),
        Err(ExecError::UploadOutOfRange { .. })
    ));
}

#[test]
fn infer_files_writes_the_last_output_and_names_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let exec = CpuExecutor::new();
    let pkg = tiny_package(dir.path(), Family::BertBase);
    let m = &pkg.manifest;
    let input = dir.path().join("in.npy");
    let x = random_input(m, 1, 5);
    write_npy(&input, &x).unwrap();
    let output = dir.path().join("out.npy");
    let report = infer_files(&pkg.dir, &input, &output, &exec).unwrap();
    let (want, _) = infer_package(&pkg, &exec, &[x]).unwrap();
    assert_eq!(report.outputs.len(), 2);
    assert_eq!(report.outputs[1].path, output);
    assert_eq!(report.outputs[1].name, "pooler_output");
    assert_eq!(
        report.outputs[0].path,
        dir.path().join("out.last_hidden_state.npy")
    );
    assert_eq!(read_npy(&output).unwrap(), want[1]);
    assert_eq!(read_npy(&report.outputs[0].path).unwrap(), want[0]);
    let e = infer_files(&pkg.dir, &input, &dir.path().join("out.bin"), &exec).unwrap_err();
    assert!(e.to_string().contains(".npy"), "{e}");
}

/// GPT-2 is causal: position `j` sees tokens `0..=j` only, so the first 16
/// positions of a 64-token run equal a 16-token run of the same prefix
/// (the position table rows are the same too), whichever length ran first
/// on the program. Another prefix gives other rows, and one token past the
/// position table is refused before any layer runs.
#[test]
fn a_causal_model_gives_a_prefix_the_same_rows_at_every_length() {
    let dir = tempfile::tempdir().unwrap();
    let exec = CpuExecutor::new();
    let pkg = tiny_package(dir.path(), Family::Gpt2);
    let m = &pkg.manifest;
    let mut program = uploaded_program(&exec, &pkg);
    let max = m.inputs[0].variable[1].max.expect("a bounded length");
    let ids: Vec<i64> = (0..max as i64).map(|k| (k * 37 + 11) % 100).collect();
    let run = |program: &mut Box<dyn Program>, len: usize, ids: &[i64]| {
        let x = HostTensor::i64(vec![1, len], ids[..len].to_vec());
        let out = program
            .run(&[x], &mut all_ready, &mut Trace::new())
            .unwrap();
        assert_eq!(out[0].shape, [1, len, 32]);
        f32s(&out[0]).to_vec()
    };
    let whole = run(&mut program, max, &ids);
    let hidden = 32;
    for len in [16, 1, 40, 16] {
        let short = run(&mut program, len, &ids);
        let worst = short
            .iter()
            .zip(&whole[..len * hidden])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-5, "length {len}: prefix rows differ by {worst}");
    }
    let mut other = ids.clone();
    other[0] = (other[0] + 1) % 100;
    let changed = run(&mut program, 16, &other);
    let moved = changed
        .iter()
        .zip(&whole[..16 * hidden])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 1e-3,
        "another first token must change the rows ({moved})"
    );
    let mut gated = 0;
    let e = program
        .run(
            &[HostTensor::i64(vec![1, max + 1], vec![1; max + 1])],
            &mut |_| {
                gated += 1;
                Ok(())
            },
            &mut Trace::new(),
        )
        .unwrap_err();
    assert!(matches!(e, ExecError::BadInput { index: 0, .. }), "{e}");
    assert!(e.to_string().contains(&format!("tokens 1..={max}")), "{e}");
    assert_eq!(gated, 0, "refused before any group was waited for");
}
