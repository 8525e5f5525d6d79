//! Full-scale ResNet-152 and BERT-base forwards on the cpu executor at
//! batch 1 (the manifests say 8; any batch is accepted). Release builds
//! only: unoptimised model math is ~40x slower.

use std::time::Instant;

use distmind_models::{generate, Dtype, Family, GenOptions, Package};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::{all_ready, Executor, HostTensor, TensorData, Trace, TraceEvent};
use distmind_runtime::infer::infer_package;

fn full_forward(family: Family) {
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let dirs = generate(&GenOptions::new(family, dir.path())).expect("generate");
    let pkg = Package::open(&dirs[0]).expect("open");
    let generated = start.elapsed();
    let m = &pkg.manifest;
    let spec = &m.inputs[0];
    let mut shape = spec.shape.clone();
    shape[0] = 1;
    let n: usize = shape.iter().product();
    let x = match spec.dtype {
        Dtype::F32 => HostTensor::f32(
            shape,
            (0..n)
                .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
                .collect(),
        ),
        Dtype::I64 => HostTensor::i64(
            shape,
            (0..n).map(|i| ((i * 7919) % 30_000) as i64).collect(),
        ),
    };
    let exec = CpuExecutor::new();
    let start = Instant::now();
    let (outputs, trace) = infer_package(&pkg, &exec, std::slice::from_ref(&x)).unwrap();
    let total = start.elapsed();
    let cold = trace.last().map(|(t, _)| *t).unwrap_or_default();
    // A second run of one program: params already prepared (cached).
    let arena = exec.alloc_arena(m.stored_bytes).unwrap();
    for g in &m.groups {
        arena
            .upload(g.index, g.offset, &pkg.group_bytes(g.index).unwrap())
            .unwrap();
    }
    let mut program = exec.program(m, arena).unwrap();
    program
        .run(std::slice::from_ref(&x), &mut all_ready, &mut Trace::new())
        .unwrap();
    let start = Instant::now();
    let again = program
        .run(&[x], &mut all_ready, &mut Trace::new())
        .unwrap();
    let warm = start.elapsed();
    assert_eq!(again, outputs, "a warm run computes the same numbers");
    println!(
        "{}: {} layers, {} groups, {} params; generate {:.1} s, infer_package {:.2} s \
         (cold forward {:.2} s), warm forward {:.2} s on {}",
        m.name,
        m.layers.len(),
        m.groups.len(),
        m.learnable_param_count,
        generated.as_secs_f64(),
        total.as_secs_f64(),
        cold.as_secs_f64(),
        warm.as_secs_f64(),
        exec.describe()
    );
    // Where the forward pass spends its time, by op.
    let mut by_op: Vec<(&str, f64)> = Vec::new();
    let mut started = vec![None; m.layers.len()];
    for &(at, ev) in &trace {
        match ev {
            TraceEvent::LayerStart { layer } => started[layer] = Some(at),
            TraceEvent::LayerEnd { layer } => {
                let secs = (at - started[layer].expect("start before end")).as_secs_f64();
                let op = m.layers[layer].op.name();
                match by_op.iter_mut().find(|(o, _)| *o == op) {
                    Some((_, t)) => *t += secs,
                    None => by_op.push((op, secs)),
                }
            }
            TraceEvent::GroupReady { .. } => {}
        }
    }
    by_op.sort_by(|a, b| b.1.total_cmp(&a.1));
    let top: Vec<String> = by_op
        .iter()
        .take(5)
        .map(|(o, t)| format!("{o} {t:.2} s"))
        .collect();
    println!("  by op: {}", top.join(", "));
    assert_eq!(outputs.len(), m.outputs.len());
    for (t, spec) in outputs.iter().zip(&m.outputs) {
        let mut want = spec.shape.clone();
        want[0] = 1;
        assert_eq!(t.shape, want, "{}", spec.name);
        let TensorData::F32(v) = &t.data else {
            panic!("{} is not f32", spec.name)
        };
        assert!(
            v.iter().all(|x| x.is_finite()),
            "{}: values not finite",
            spec.name
        );
        assert!(v.iter().any(|&x| x != 0.0), "{}: all zeros", spec.name);
    }
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "full-scale CPU forwards need a release build (cargo test --release)"
)]
fn full_scale_resnet152_batch1() {
    full_forward(Family::Resnet152);
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "full-scale CPU forwards need a release build (cargo test --release)"
)]
fn full_scale_bert_base_batch1() {
    full_forward(Family::BertBase);
}
