//! The `sim` executor over real packages: gating order, traces, wall time at
//! least the profile's total, delayed gates and upload timing.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_models::{generate, Family, GenOptions, Package, Scale};
use distmind_runtime::exec::sim::SimExecutor;
use distmind_runtime::exec::{
    all_ready, Arena, ExecError, Executor, ExecutorKind, HostTensor, Trace, TraceEvent,
};
use distmind_runtime::profile::{estimated_h200, model_key, Profile, SHIPPED_ESTIMATED_PATH};

fn shipped() -> Profile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(SHIPPED_ESTIMATED_PATH);
    Profile::load(path).unwrap()
}

fn package(family: Family, scale: Scale, dir: &Path) -> Package {
    let mut opts = GenOptions::new(family, dir);
    opts.scale = scale;
    if scale == Scale::Tiny {
        opts.group_bytes = 4096;
    }
    let dirs: Vec<PathBuf> = generate(&opts).unwrap();
    Package::open(&dirs[0]).unwrap()
}

/// Zero inputs of the manifest's shapes.
fn inputs(pkg: &Package) -> Vec<HostTensor> {
    pkg.manifest
        .inputs
        .iter()
        .map(|s| {
            let n = s.shape.iter().product();
            match s.dtype {
                distmind_models::Dtype::F32 => HostTensor::f32(s.shape.clone(), vec![0.0; n]),
                distmind_models::Dtype::I64 => HostTensor::i64(s.shape.clone(), vec![0; n]),
            }
        })
        .collect()
}

/// Checks a trace against the manifest: every group ready exactly once, in
/// order, before its first layer starts; every layer started and ended once,
/// in order, back to back on the timeline. Returns GroupReady times.
fn check_trace(pkg: &Package, trace: &Trace) -> Vec<Duration> {
    let m = &pkg.manifest;
    let mut ready: Vec<Option<Duration>> = vec![None; m.groups.len()];
    let mut next_layer = 0;
    let mut last_end = Duration::ZERO;
    let mut started: Option<(usize, Duration)> = None;
    for &(t, ev) in trace {
        match ev {
            TraceEvent::GroupReady { group } => {
                assert!(ready[group].is_none(), "group {group} ready twice");
                assert!(
                    ready[..group].iter().all(Option::is_some),
                    "group {group} out of order"
                );
                assert_eq!(
                    m.groups[group].first_layer, next_layer,
                    "group {group} gated early or late"
                );
                ready[group] = Some(t);
            }
            TraceEvent::LayerStart { layer } => {
                assert_eq!(layer, next_layer);
                assert!(started.is_none());
                assert!(
                    t >= last_end,
                    "layer {layer} starts before the previous ended"
                );
                if let Some(g) = m.layers[layer].group {
                    let r = ready[g]
                        .unwrap_or_else(|| panic!("layer {layer} ran before group {g} was gated"));
                    assert!(
                        t >= r,
                        "layer {layer} starts at {t:?} before group {g} ready at {r:?}"
                    );
                }
                started = Some((layer, t));
            }
            TraceEvent::LayerEnd { layer } => {
                let (s, st) = started.take().expect("end without start");
                assert_eq!(s, layer);
                assert!(t >= st);
                last_end = t;
                next_layer += 1;
            }
        }
    }
    assert_eq!(next_layer, m.layers.len(), "not every layer ran");
    ready
        .into_iter()
        .map(|r| r.expect("every group gated"))
        .collect()
}

/// Uploads every group, runs once with `gate`, checks trace, outputs and
/// wall time. Returns the trace.
fn run_checked(
    exec: &SimExecutor,
    pkg: &Package,
    gate: &mut dyn FnMut(usize) -> Result<(), ExecError>,
) -> Trace {
    let m = &pkg.manifest;
    let arena = exec.alloc_arena(m.stored_bytes).unwrap();
    for g in &m.groups {
        let bytes = pkg.group_bytes(g.index).unwrap();
        arena.upload(g.index, g.offset, &bytes).unwrap();
    }
    let mut program = exec.program(m, arena).unwrap();
    assert!(program.simulated());
    let mut trace = Trace::new();
    let t0 = Instant::now();
    let out = program.run(&inputs(pkg), gate, &mut trace).unwrap();
    let wall = t0.elapsed();
    let batch = m.inputs[0].shape[0];
    let total = exec
        .profile()
        .get(m.family, m.scale.expect("a generated package"), batch)
        .unwrap()
        .total_s;
    // A lower bound only: the machine may be slower, never faster.
    assert!(
        wall >= Duration::from_secs_f64(total),
        "{}: ran in {wall:?}, profile total {total} s",
        m.name
    );
    eprintln!("{}: wall {wall:?}, profile total {total} s", m.name);
    check_trace(pkg, &trace);
    assert_eq!(out.len(), m.outputs.len());
    for (o, spec) in out.iter().zip(&m.outputs) {
        assert_eq!(o.shape, spec.shape);
        assert_eq!(
            o,
            &HostTensor::f32(spec.shape.clone(), vec![0.0; spec.shape.iter().product()])
        );
    }
    trace
}

/// Runs with a gate that holds group 1 back by `delay`; checks that no layer
/// of group 1 starts before GroupReady{1}, which comes after the delay.
fn check_delayed_group1(exec: &SimExecutor, pkg: &Package, delay: Duration) {
    assert!(pkg.manifest.groups.len() > 1, "needs two groups");
    let mut calls = Vec::new();
    let mut gate = |g: usize| {
        calls.push(g);
        if g == 1 {
            std::thread::sleep(delay);
        }
        Ok(())
    };
    let trace = run_checked(exec, pkg, &mut gate);
    assert_eq!(calls, (0..pkg.manifest.groups.len()).collect::<Vec<_>>());
    let ready1 = trace
        .iter()
        .find_map(|&(t, e)| (e == TraceEvent::GroupReady { group: 1 }).then_some(t))
        .unwrap();
    assert!(
        ready1 + Duration::from_millis(1) >= delay,
        "group 1 ready at {ready1:?}"
    );
    let first1 = pkg.manifest.groups[1].first_layer;
    for &(t, e) in &trace {
        if let TraceEvent::LayerStart { layer } = e {
            if layer >= first1 {
                assert!(
                    t >= ready1,
                    "layer {layer} at {t:?} before group 1 ready at {ready1:?}"
                );
            }
        }
    }
}

#[test]
fn sim_tiny_resnet152_runs_gated() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::Resnet152, Scale::Tiny, dir.path());
    let exec = SimExecutor::new(shipped());
    assert_eq!(exec.kind(), ExecutorKind::Sim);
    assert!(
        exec.describe().contains("estimated (NVIDIA H200 peaks)"),
        "{}",
        exec.describe()
    );
    run_checked(&exec, &pkg, &mut all_ready);
    check_delayed_group1(&exec, &pkg, Duration::from_millis(20));
}

#[test]
fn sim_tiny_every_family_runs() {
    let exec = SimExecutor::new(shipped());
    for family in Family::ALL {
        let dir = tempfile::tempdir().unwrap();
        let pkg = package(family, Scale::Tiny, dir.path());
        run_checked(&exec, &pkg, &mut all_ready);
    }
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "generates a 240 MB package; run with --release"
)]
fn sim_full_resnet152_runs_gated() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::Resnet152, Scale::Full, dir.path());
    let exec = SimExecutor::new(shipped());
    let t0 = Instant::now();
    run_checked(&exec, &pkg, &mut all_ready);
    let wall = t0.elapsed();
    let total = exec
        .profile()
        .get_exact(Family::Resnet152, Scale::Full, 8)
        .unwrap()
        .total_s;
    // Uploads: 240 MB at the assumed 50 GB/s is about 5 ms.
    let upload = pkg.manifest.stored_bytes as f64 / exec.profile().peaks.h2d_bytes_per_s;
    assert!(wall >= Duration::from_secs_f64(total + upload), "{wall:?}");
    check_delayed_group1(&exec, &pkg, Duration::from_millis(30));
}

#[test]
fn sim_gate_error_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::Gpt2, Scale::Tiny, dir.path());
    let exec = SimExecutor::new(shipped());
    let arena = exec.alloc_arena(pkg.manifest.stored_bytes).unwrap();
    let mut program = exec.program(&pkg.manifest, arena).unwrap();
    let mut gate = |g: usize| {
        if g == 1 {
            Err(ExecError::Gate {
                group: 1,
                why: "peer lost".into(),
            })
        } else {
            Ok(())
        }
    };
    let mut trace = Trace::new();
    let e = program
        .run(&inputs(&pkg), &mut gate, &mut trace)
        .unwrap_err();
    assert!(matches!(e, ExecError::Gate { group: 1, .. }), "{e}");
    let first1 = pkg.manifest.groups[1].first_layer;
    assert!(trace.iter().all(|&(_, e)| match e {
        TraceEvent::LayerStart { layer } => layer < first1,
        TraceEvent::GroupReady { group } => group == 0,
        _ => true,
    }));
    // Runs again, from scratch, once the gate works.
    trace.clear();
    program
        .run(&inputs(&pkg), &mut all_ready, &mut trace)
        .unwrap();
    check_trace(&pkg, &trace);
}

#[test]
fn sim_rejects_bad_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::BertBase, Scale::Tiny, dir.path());
    let exec = SimExecutor::new(shipped());
    let arena = exec.alloc_arena(pkg.manifest.stored_bytes).unwrap();
    let mut program = exec.program(&pkg.manifest, arena).unwrap();
    let wrong = vec![HostTensor::f32(vec![1, 16], vec![0.0; 16])];
    let e = program
        .run(&wrong, &mut all_ready, &mut Trace::new())
        .unwrap_err();
    assert!(matches!(e, ExecError::BadInput { index: 0, .. }), "{e}");
    let e = program
        .run(&[], &mut all_ready, &mut Trace::new())
        .unwrap_err();
    assert!(matches!(e, ExecError::BadInput { index: 0, .. }), "{e}");
}

#[test]
fn sim_program_errors_name_the_profile_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::Densenet201, Scale::Tiny, dir.path());
    let mut profile = estimated_h200("2026-11-21");
    profile.models.retain(|k, _| !k.starts_with("densenet201/"));
    let file = dir.path().join("partial.json");
    profile.write(&file).unwrap();
    let exec = SimExecutor::new(Profile::load(&file).unwrap());
    let arena = exec.alloc_arena(pkg.manifest.stored_bytes).unwrap();
    let e = exec
        .program(&pkg.manifest, arena)
        .err()
        .expect("no profile for densenet201");
    let msg = e.to_string();
    let key = model_key(Family::Densenet201, Scale::Tiny, 1);
    assert!(msg.contains(&key) && msg.contains("partial.json"), "{msg}");

    // An arena too small for the model.
    let exec = SimExecutor::new(shipped());
    let small = exec.alloc_arena(pkg.manifest.device_bytes() - 1).unwrap();
    let e = exec
        .program(&pkg.manifest, small)
        .err()
        .expect("arena too small");
    assert!(e.to_string().contains("bytes on a device"), "{e}");
}

#[test]
fn sim_program_checks_the_profiles_layers_once_per_model() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::Resnet152, Scale::Tiny, dir.path());
    let exec = SimExecutor::new(shipped());
    let program = |m: &distmind_models::Manifest| {
        let arena = exec.alloc_arena(m.device_bytes()).unwrap();
        exec.program(m, arena).map(|_| ())
    };
    // A manifest whose layer differs from the profile's is refused, with
    // the layer named, however often it is asked for.
    let mut renamed = pkg.manifest.clone();
    renamed.name = "renamed-layer".into();
    renamed.layers[3].name = "not-in-the-profile".into();
    for _ in 0..2 {
        let e = program(&renamed).expect_err("layer 3 differs");
        assert!(e.to_string().contains("not-in-the-profile"), "{e}");
    }
    // The real one passes, and so does its next switch, on another device
    // of the same executor too.
    program(&pkg.manifest).unwrap();
    program(&pkg.manifest).unwrap();
    let other = exec.for_device(1).unwrap();
    let arena = other.alloc_arena(pkg.manifest.device_bytes()).unwrap();
    other.program(&pkg.manifest, arena).unwrap();
    // Another model name is checked on its own.
    renamed.name = "another-name".into();
    assert!(program(&renamed).is_err());
}

#[test]
fn sim_upload_takes_the_h2d_time_and_checks_range() {
    let exec = SimExecutor::new(shipped());
    let h2d = exec.profile().peaks.h2d_bytes_per_s;
    let arena: Arc<dyn Arena> = exec.alloc_arena(64 << 20).unwrap();
    assert_eq!(arena.len(), 64 << 20);
    let bytes = vec![0u8; 16 << 20];
    let t0 = Instant::now();
    arena.upload(0, 0, &bytes).unwrap();
    assert!(t0.elapsed() >= Duration::from_secs_f64(bytes.len() as f64 / h2d));
    let e = arena.upload(1, (64 << 20) - 8, &bytes).unwrap_err();
    assert!(matches!(e, ExecError::UploadOutOfRange { .. }), "{e}");
    let e = arena.upload(1, u64::MAX, &bytes[..1]).unwrap_err();
    assert!(matches!(e, ExecError::UploadOutOfRange { .. }), "{e}");
}

/// Zero inputs of the manifest's shapes with the batch dimension set to `b`.
fn inputs_at(pkg: &Package, b: usize) -> Vec<HostTensor> {
    inputs(pkg)
        .into_iter()
        .map(|t| {
            let mut shape = t.shape.clone();
            shape[0] = b;
            let n = shape.iter().product();
            match t.data {
                distmind_runtime::exec::TensorData::F32(_) => HostTensor::f32(shape, vec![0.0; n]),
                distmind_runtime::exec::TensorData::I64(_) => HostTensor::i64(shape, vec![0; n]),
            }
        })
        .collect()
}

/// Runs `pkg` once at request batch `b` with every group uploaded; returns
/// the simulated timeline's end (the last LayerEnd).
fn timeline_end(exec: &SimExecutor, pkg: &Package, b: usize) -> Duration {
    let m = &pkg.manifest;
    let arena = exec.alloc_arena(m.stored_bytes).unwrap();
    let mut program = exec.program(m, arena).unwrap();
    let mut trace = Trace::new();
    let out = program
        .run(&inputs_at(pkg, b), &mut all_ready, &mut trace)
        .unwrap();
    assert_eq!(out[0].shape[0], b);
    trace
        .iter()
        .filter_map(|&(t, e)| matches!(e, TraceEvent::LayerEnd { .. }).then_some(t))
        .max()
        .unwrap()
}

/// `got` is `want_s` up to the per-layer nanosecond rounding.
fn assert_close(got: Duration, want_s: f64, layers: usize, what: &str) {
    let diff = (got.as_secs_f64() - want_s).abs();
    assert!(
        diff <= layers as f64 * 1e-9 + 1e-12,
        "{what}: timeline {got:?}, want {want_s} s"
    );
}

#[test]
fn sim_request_batches_take_the_profile_time_at_their_batch() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::Resnet152, Scale::Tiny, dir.path());
    assert_eq!(pkg.manifest.inputs[0].shape[0], 1);
    let layers = pkg.manifest.layers.len();
    // A profile with tiny ResNet-152 at batch 1 and 8.
    let mut profile = shipped();
    let b8 = distmind_runtime::profile::estimate(Family::Resnet152, Scale::Tiny, 8);
    profile
        .models
        .insert(model_key(Family::Resnet152, Scale::Tiny, 8), b8.clone());
    let b1 = profile
        .get_exact(Family::Resnet152, Scale::Tiny, 1)
        .unwrap()
        .clone();
    let exec = SimExecutor::new(profile);
    assert_close(timeline_end(&exec, &pkg, 1), b1.total_s, layers, "b1");
    assert_close(timeline_end(&exec, &pkg, 8), b8.total_s, layers, "b8");
    // Batch 4 lies 3/7 of the way from 1 to 8, not 4x batch 1.
    let want4 = b1.total_s + (b8.total_s - b1.total_s) * 3.0 / 7.0;
    assert_close(timeline_end(&exec, &pkg, 4), want4, layers, "b4");
    assert!(want4 < 4.0 * b1.total_s);
    // Back to batch 1 after another batch: the manifest's times again.
    assert_close(timeline_end(&exec, &pkg, 1), b1.total_s, layers, "b1 again");
}

#[test]
fn sim_dilation_stretches_layers_and_uploads() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::Resnet152, Scale::Tiny, dir.path());
    let layers = pkg.manifest.layers.len();
    let total = shipped()
        .get_exact(Family::Resnet152, Scale::Tiny, 1)
        .unwrap()
        .total_s;
    let exec = SimExecutor::with_dilation(shipped(), 4.0).unwrap();
    assert_eq!(exec.dilation(), 4.0);
    assert!(exec.describe().contains("x4"), "{}", exec.describe());
    assert_close(timeline_end(&exec, &pkg, 1), 4.0 * total, layers, "x4");
    // Uploads: 4 MB at a quarter of the profile's H2D rate.
    let h2d = exec.profile().peaks.h2d_bytes_per_s;
    let arena = exec.alloc_arena(8 << 20).unwrap();
    let t0 = Instant::now();
    arena.upload(0, 0, &vec![0u8; 4 << 20]).unwrap();
    assert!(t0.elapsed() >= Duration::from_secs_f64(4.0 * (4 << 20) as f64 / h2d));
    for bad in [0.5, 0.0, f64::NAN, f64::INFINITY, 1e6] {
        let e = SimExecutor::with_dilation(shipped(), bad).unwrap_err();
        assert!(e.to_string().contains("dilation"), "{bad}: {e}");
    }
}

#[test]
fn sim_training_iteration_is_the_profiles_train_time_dilated() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::Resnet152, Scale::Tiny, dir.path());
    let profile = shipped();
    let batch = 16;
    let want_s = profile
        .train_iteration_s(Family::Resnet152, Scale::Tiny, batch)
        .unwrap();
    // Three forward passes at the batch (the profile's stated estimate).
    let forward_s = profile
        .get(Family::Resnet152, Scale::Tiny, batch)
        .unwrap()
        .total_s;
    assert!(
        (want_s - 3.0 * forward_s).abs() < 1e-12,
        "{want_s} {forward_s}"
    );
    for k in [1.0, 4.0] {
        let exec = SimExecutor::with_dilation(profile.clone(), k).unwrap();
        let t = exec
            .simulated_train_iteration(&pkg.manifest, batch)
            .expect("the sim executor simulates training")
            .unwrap();
        // Rounded up to the nanosecond, never down.
        let s = t.as_secs_f64();
        assert!(
            s >= want_s * k - 1e-12 && s <= want_s * k + 1e-9,
            "x{k}: {s}"
        );
    }
    let exec = SimExecutor::new(profile);
    // An imported model without a preset scale cannot be timed, as for inference.
    let mut imported = pkg.manifest.clone();
    imported.scale = None;
    let e = exec
        .simulated_train_iteration(&imported, batch)
        .unwrap()
        .unwrap_err();
    assert!(e.to_string().contains("imported"), "{e}");
    let e = exec
        .simulated_train_iteration(&pkg.manifest, 0)
        .unwrap()
        .unwrap_err();
    assert!(e.to_string().contains("batch of 0"), "{e}");
    // Executors that compute train for real.
    let cpu = distmind_runtime::exec::cpu::CpuExecutor::new();
    assert!(cpu
        .simulated_train_iteration(&pkg.manifest, batch)
        .is_none());
}

/// Per layer, LayerEnd - LayerStart of a run's trace (the simulated timeline).
fn layer_times(trace: &Trace, layers: usize) -> Vec<Duration> {
    let mut start = vec![Duration::ZERO; layers];
    let mut times = vec![Duration::ZERO; layers];
    for &(t, e) in trace {
        match e {
            TraceEvent::LayerStart { layer } => start[layer] = t,
            TraceEvent::LayerEnd { layer } => times[layer] = t - start[layer],
            TraceEvent::GroupReady { .. } => {}
        }
    }
    times
}

/// A transformer request of another length than the profiled one takes the
/// profile's layer times scaled by its tokens (`ModelProfile::at_seq_len`,
/// never below a layer's launch and weight read), answers outputs of its
/// own shapes, and one past the position table is refused.
#[test]
fn sim_request_lengths_take_the_profile_time_scaled_by_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(Family::BertBase, Scale::Tiny, dir.path());
    let m = &pkg.manifest;
    assert_eq!(m.inputs[0].shape, [1, 16]);
    let profile = shipped();
    let at16 = profile
        .get_exact(Family::BertBase, Scale::Tiny, 1)
        .unwrap()
        .clone();
    let peaks = profile.peaks;
    let mut floors = vec![peaks.launch_overhead_s; m.layers.len()];
    for p in &m.params {
        floors[p.layer] += p.device_nbytes(m.param_dtype) as f64 / peaks.memory_bytes_per_s;
    }
    let exec = SimExecutor::new(profile);
    let arena = exec.alloc_arena(m.stored_bytes).unwrap();
    let mut program = exec.program(m, arena).unwrap();
    let mut totals = Vec::new();
    for len in [16, 64, 40, 16] {
        let mut trace = Trace::new();
        let out = program
            .run(
                &[HostTensor::i64(vec![2, len], vec![3; 2 * len])],
                &mut all_ready,
                &mut trace,
            )
            .unwrap();
        assert_eq!(out[0].shape, [2, len, 32], "last_hidden_state at {len}");
        assert_eq!(out[1].shape, [2, 32], "pooler_output at {len}");
        // Batch 2 of a profile that has batch 1 only: twice its times, then
        // the tokens' scaling.
        let want = at16
            .scaled(2.0)
            .at_seq_len(16, len, peaks.launch_overhead_s, &floors);
        let got = layer_times(&trace, m.layers.len());
        for (i, (g, w)) in got.iter().zip(&want.layers).enumerate() {
            let diff = (g.as_secs_f64() - w.time_s).abs();
            assert!(
                diff <= 1e-9,
                "L={len} layer {i} ({}): {g:?} vs {} s",
                w.name,
                w.time_s
            );
        }
        totals.push(got.iter().sum::<Duration>());
    }
    assert!(totals[1] > totals[2] && totals[2] > totals[0], "{totals:?}");
    assert_eq!(totals[0], totals[3], "the same length, the same plan");
    let e = program
        .run(
            &[HostTensor::i64(vec![1, 65], vec![3; 65])],
            &mut all_ready,
            &mut Trace::new(),
        )
        .unwrap_err();
    assert!(matches!(e, ExecError::BadInput { index: 0, .. }), "{e}");
    assert!(e.to_string().contains("tokens 1..=64"), "{e}");
}

/// Every family's outputs at a batch other than the manifest's have the
/// shapes shape inference gives (`plan::layer_shapes`, what the cpu and
/// cuda executors run by): a CNN's program answers them without inferring,
/// a transformer's infers them.
#[test]
fn sim_outputs_have_the_inferred_shapes_at_any_batch() {
    use distmind_runtime::exec::plan;
    let exec = SimExecutor::new(shipped());
    for family in Family::ALL {
        let dir = tempfile::tempdir().unwrap();
        let pkg = package(family, Scale::Tiny, dir.path());
        let m = &pkg.manifest;
        let arena = exec.alloc_arena(m.stored_bytes).unwrap();
        let mut program = exec.program(m, arena).unwrap();
        for b in [3, 1, 3] {
            let inputs = inputs_at(&pkg, b);
            let key = plan::shape_key(&inputs);
            let shapes =
                plan::layer_shapes(&m.name, &m.layers, &m.inputs, &key, &plan::param_shapes(m))
                    .unwrap();
            let out = program
                .run(&inputs, &mut all_ready, &mut Trace::new())
                .unwrap();
            assert_eq!(out.len(), m.outputs.len(), "{family}");
            for (o, spec) in out.iter().zip(&m.outputs) {
                assert_eq!(
                    o.shape, shapes[spec.layer].dims,
                    "{family} {} at batch {b}",
                    spec.name
                );
                assert_eq!(o.shape[0], b, "{family} {}", spec.name);
            }
        }
    }
}
