//! The cuda executor on a real GPU: every family at tiny scale against the
//! cpu executor, gating (host gate + device event), lazy and pipelined
//! uploads from pinned memory, full-scale ResNet-152 at batch 8 cold vs warm,
//! the H2D bandwidth probe, half-precision widening and per-layer device
//! timing (`layer_events`). All `#[ignore]`d: run on a GPU machine with
//! `cargo test -p distmind-runtime --release --features cuda --test cuda_gpu -- --ignored --nocapture`.
#![cfg(feature = "cuda")]

use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use distmind_models::graph::EmbeddingIds;
use distmind_models::{
    generate, Dtype, Family, GenOptions, Manifest, Op, Package, ParamDtype, Scale,
};
use distmind_runtime::cache::{PinHook, Pinned};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::cuda::{h2d_bench, pin_hook, CudaExecutor, CudaOptions};
use distmind_runtime::exec::{all_ready, Executor, HostTensor, TensorData, Trace, TraceEvent};
use distmind_runtime::infer::infer_package;
use distmind_transport::memory::{HostBuffer, HugePages};

/// Small groups, so that tiny models have several.
const GROUP_BYTES: u64 = 16 << 10;
/// Largest difference allowed, relative to the output's largest magnitude.
const REL_TOL: f32 = 1e-4;

fn package(dir: &Path, family: Family, scale: Scale, group_bytes: Option<u64>) -> Package {
    let mut opts = GenOptions {
        scale,
        ..GenOptions::new(family, dir)
    };
    if let Some(g) = group_bytes {
        opts.group_bytes = g;
    }
    let dirs = generate(&opts).expect("generate");
    Package::open(&dirs[0]).expect("open")
}

/// Deterministic input: images in [-1, 1), token ids in the vocabulary.
fn input(m: &Manifest, batch: usize, seed: u64) -> HostTensor {
    let spec = &m.inputs[0];
    let mut shape = spec.shape.clone();
    shape[0] = batch;
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    match spec.dtype {
        Dtype::F32 => HostTensor::f32(shape, (0..n).map(|_| (next() * 2.0 - 1.0) as f32).collect()),
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
                (0..n).map(|_| (next() * vocab as f64) as i64).collect(),
            )
        }
    }
}

fn f32s(t: &HostTensor) -> &[f32] {
    match &t.data {
        TensorData::F32(v) => v,
        TensorData::I64(_) => panic!("expected f32, got {}", t.describe()),
    }
}

/// `got` within `tol` of `want`, relative to `want`'s largest magnitude.
fn assert_close(what: &str, got: &HostTensor, want: &HostTensor, tol: f32) {
    assert_eq!(got.shape, want.shape, "{what}: shapes");
    let (g, w) = (f32s(got), f32s(want));
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let worst = g
        .iter()
        .zip(w)
        .map(|(a, b)| (a - b).abs() / scale)
        .fold(0f32, f32::max);
    assert!(
        g.iter().all(|v| v.is_finite()) && worst <= tol,
        "{what}: worst difference {worst:e} of the largest magnitude {scale} (tolerance {tol:e})"
    );
    println!("{what}: worst relative difference {worst:e}");
}

/// Runs `pkg` on `exec` with each group uploaded inside its gate; returns
/// the outputs, the gate calls and the trace.
fn run_lazy(
    exec: &CudaExecutor,
    pkg: &Package,
    x: &HostTensor,
) -> (Vec<HostTensor>, Vec<usize>, Trace) {
    let m = &pkg.manifest;
    let arena = exec.alloc_arena(m.stored_bytes).unwrap();
    let mut program = exec.program(m, arena.clone()).unwrap();
    let mut calls = Vec::new();
    let mut trace = Trace::new();
    let out = program
        .run(
            std::slice::from_ref(x),
            &mut |g| {
                calls.push(g);
                arena.upload(g, m.groups[g].offset, &pkg.group_bytes(g).unwrap())
            },
            &mut trace,
        )
        .unwrap();
    // A warm run of the same program computes the same numbers.
    let again = program
        .run(std::slice::from_ref(x), &mut all_ready, &mut Trace::new())
        .unwrap();
    assert_eq!(again, out, "{}: warm run differs from the cold one", m.name);
    (out, calls, trace)
}

fn param_groups(m: &Manifest) -> Vec<usize> {
    let mut gs: Vec<usize> = m.params.iter().map(|p| p.group).collect();
    gs.sort_unstable();
    gs.dedup();
    gs
}

fn check_trace(m: &Manifest, trace: &Trace) {
    let mut ready = vec![false; m.groups.len()];
    let mut started = 0;
    for &(_, ev) in trace {
        match ev {
            TraceEvent::GroupReady { group } => ready[group] = true,
            TraceEvent::LayerStart { layer } => {
                assert_eq!(layer, started);
                started += 1;
                if let Some(g) = m.layers[layer].group {
                    assert!(ready[g], "{}: layer {layer} before group {g}", m.name);
                }
            }
            TraceEvent::LayerEnd { .. } => {}
        }
    }
    assert_eq!(started, m.layers.len());
}

#[test]
#[ignore = "requires an NVIDIA GPU"]
fn cuda_every_family_at_tiny_scale_matches_the_cpu_executor() {
    let dir = tempfile::tempdir().unwrap();
    let cpu = CpuExecutor::new();
    let gpu = CudaExecutor::new(0).expect("a CUDA device");
    let profiled = CudaExecutor::with_options(
        0,
        CudaOptions {
            sync_per_layer: true,
            ..CudaOptions::default()
        },
    )
    .unwrap();
    // A batch's convolutions one GEMM per image, as before they were
    // stacked into one GEMM.
    let per_image = CudaExecutor::with_options(
        0,
        CudaOptions {
            per_image_conv: true,
            ..CudaOptions::default()
        },
    )
    .unwrap();
    println!("{}", gpu.describe());
    for family in Family::ALL {
        let pkg = package(dir.path(), family, Scale::Tiny, Some(GROUP_BYTES));
        let m = &pkg.manifest;
        for batch in [1, 3] {
            let x = input(m, batch, 7 + batch as u64);
            let (want, _) = infer_package(&pkg, &cpu, std::slice::from_ref(&x)).unwrap();
            for exec in [&gpu, &profiled, &per_image] {
                let (got, calls, trace) = run_lazy(exec, &pkg, &x);
                assert_eq!(calls, param_groups(m), "{}: gate calls", m.name);
                check_trace(m, &trace);
                for ((g, w), spec) in got.iter().zip(&want).zip(&m.outputs) {
                    let what = format!(
                        "{} batch {batch} {} ({})",
                        m.name,
                        spec.name,
                        exec.describe()
                    );
                    assert_close(&what, g, w, REL_TOL);
                }
            }
        }
    }
}

/// A pinned host copy of the whole packed model (what the host cache holds).
fn pinned_model(pkg: &Package, hook: &PinHook) -> (HostBuffer, Pinned) {
    let m = &pkg.manifest;
    let buf = HostBuffer::new(m.stored_bytes as usize, HugePages::No).unwrap();
    let pinned = hook(&buf).expect("pin the host copy");
    for g in &m.groups {
        let bytes = pkg.group_bytes(g.index).unwrap();
        let range = g.offset as usize..g.offset as usize + bytes.len();
        // SAFETY: this test is the only user of the buffer; ranges of
        // different groups do not overlap.
        unsafe { buf.slice_mut(range) }.copy_from_slice(&bytes);
    }
    (buf, pinned)
}

/// Cold: arena + program + a run whose groups are uploaded by another
/// thread from pinned memory while earlier groups compute. Warm: a second
/// run of the same program. Checked against the cpu executor on image 0.
#[test]
#[ignore = "requires an NVIDIA GPU"]
fn cuda_resnet152_full_scale_batch8_cold_vs_warm() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = Arc::new(package(dir.path(), Family::Resnet152, Scale::Full, None));
    let m = pkg.manifest.clone();
    let (host, pinned) = pinned_model(&pkg, &pin_hook());
    let host = Arc::new(host);
    let x = input(&m, 8, 1);
    let exec = CudaExecutor::new(0).expect("a CUDA device");

    let start = Instant::now();
    let arena = exec.alloc_arena(m.stored_bytes).unwrap();
    let mut program = exec.program(&m, arena.clone()).unwrap();
    let (tx, rx) = mpsc::channel::<usize>();
    let uploader = {
        let (arena, host, m) = (arena.clone(), host.clone(), m.clone());
        std::thread::spawn(move || {
            let mut started = 0;
            for g in &m.groups {
                let range = g.offset as usize..(g.offset + g.bytes) as usize;
                // SAFETY: nothing writes the pinned copy any more.
                let bytes = unsafe { host.slice(range) };
                started = g.index + 1;
                // SAFETY: `host` (an Arc this thread holds) stays allocated
                // and unchanged until the waits below returned.
                unsafe { arena.upload_async(g.index, g.offset, ParamDtype::F32, bytes) }.unwrap();
                if tx.send(g.index).is_err() {
                    break;
                }
            }
            for g in 0..started {
                arena.wait_uploaded(g).unwrap();
            }
        })
    };
    let mut uploaded: Option<usize> = None;
    let mut trace = Trace::new();
    let cold_out = program
        .run(
            std::slice::from_ref(&x),
            &mut |g| {
                while uploaded.is_none_or(|u| u < g) {
                    uploaded = Some(rx.recv().expect("uploader alive"));
                }
                Ok(())
            },
            &mut trace,
        )
        .unwrap();
    let cold = start.elapsed();
    uploader.join().unwrap();
    // Every copy completed: unregister while the buffer is still mapped.
    drop(pinned);

    let start = Instant::now();
    let warm_out = program
        .run(std::slice::from_ref(&x), &mut all_ready, &mut Trace::new())
        .unwrap();
    let warm = start.elapsed();
    assert_eq!(warm_out, cold_out, "warm and cold runs agree");
    check_trace(&m, &trace);
    println!(
        "{} batch 8 on {}: cold (alloc + upload {} groups, {:.0} MB, pipelined) {:.1} ms, warm {:.1} ms",
        m.name,
        exec.describe(),
        m.groups.len(),
        m.stored_bytes as f64 / 1e6,
        cold.as_secs_f64() * 1e3,
        warm.as_secs_f64() * 1e3
    );

    // Image 0 against the cpu executor at batch 1.
    let per_image: usize = x.shape[1..].iter().product();
    let x0 = HostTensor::f32(
        [&[1], &x.shape[1..]].concat(),
        f32s(&x)[..per_image].to_vec(),
    );
    let (want, _) = infer_package(&pkg, &CpuExecutor::new(), &[x0]).unwrap();
    let classes = want[0].shape[1];
    let got0 = HostTensor::f32(vec![1, classes], f32s(&cold_out[0])[..classes].to_vec());
    assert_close(
        "resnet152 full scale logits, image 0",
        &got0,
        &want[0],
        1e-3,
    );
}

#[test]
#[ignore = "requires an NVIDIA GPU"]
fn cuda_h2d_bench_pinned_vs_pageable() {
    let bw = h2d_bench(256 << 20, 10).expect("a CUDA device");
    println!(
        "H2D 256 MiB x 10: pinned {:.1} GB/s, pageable cuMemcpyHtoD {:.1} GB/s",
        bw.pinned_gbps, bw.plain_memcpy_gbps
    );
    assert!(bw.pinned_gbps > 0.0 && bw.plain_memcpy_gbps > 0.0);
}

/// Half-precision packages: the copy stream carries the stored bf16 / f16
/// bytes and the widening kernel writes f32 into the arena; the outputs
/// equal the cpu executor's, which widens the same bytes on the host.
#[test]
#[ignore = "requires an NVIDIA GPU"]
fn cuda_half_precision_packages_widen_on_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let cpu = CpuExecutor::new();
    let gpu = CudaExecutor::new(0).expect("a CUDA device");
    for dtype in [ParamDtype::BF16, ParamDtype::F16] {
        for family in [Family::Resnet152, Family::Gpt2] {
            let sub = dir.path().join(format!("{dtype}-{family}"));
            let dirs = generate(&GenOptions {
                scale: Scale::Tiny,
                group_bytes: GROUP_BYTES,
                dtype,
                ..GenOptions::new(family, &sub)
            })
            .expect("generate");
            let pkg = Package::open(&dirs[0]).expect("open");
            assert_eq!(pkg.manifest.param_dtype, dtype);
            let x = input(&pkg.manifest, 2, 3);
            let (want, _) = infer_package(&pkg, &cpu, std::slice::from_ref(&x)).unwrap();
            let (got, _) = infer_package(&pkg, &gpu, std::slice::from_ref(&x)).unwrap();
            for ((g, w), spec) in got.iter().zip(&want).zip(&pkg.manifest.outputs) {
                let what = format!("{} {dtype} {}", pkg.manifest.name, spec.name);
                assert_close(&what, g, w, REL_TOL);
            }
        }
    }
}

/// `layer_events`: every layer gets a device time, the layers' span fits
/// inside the host's wall time of the same runs, and the numbers computed
/// are those of a plain executor (events change no kernel).
#[test]
#[ignore = "requires an NVIDIA GPU"]
fn cuda_layer_events_time_every_layer_on_the_device() {
    use distmind_runtime::profile::measure::{time_layers, MeasureOptions};
    let dir = tempfile::tempdir().unwrap();
    let pkg = package(dir.path(), Family::Resnet152, Scale::Full, None);
    let x = input(&pkg.manifest, 8, 5);
    let timed = CudaExecutor::with_options(
        0,
        CudaOptions {
            layer_events: true,
            ..CudaOptions::default()
        },
    )
    .unwrap();
    let plain = CudaExecutor::new(0).unwrap();
    let opts = MeasureOptions { warmup: 2, runs: 5 };
    let t = time_layers(&timed, &pkg, std::slice::from_ref(&x), opts).unwrap();
    let p = time_layers(&plain, &pkg, std::slice::from_ref(&x), opts).unwrap();
    assert_eq!(t.layer_s.len(), pkg.manifest.layers.len());
    assert!(t.layer_s.iter().all(|&s| s > 0.0), "a layer took no time");
    // Per run the span is inside the wall time; medians of 5 runs get a 5% margin.
    assert!(
        t.layers_total_s() <= t.run_s * 1.05,
        "the layers' device span {} s exceeds the runs' wall time {} s",
        t.layers_total_s(),
        t.run_s
    );
    println!(
        "resnet152 b8 on {}: layers (events) {:.3} ms, plain run {:.3} ms (ratio {:.3})",
        plain.describe(),
        t.layers_total_s() * 1e3,
        p.run_s * 1e3,
        t.layers_total_s() / p.run_s
    );
    let (a, _) = infer_package(&pkg, &timed, std::slice::from_ref(&x)).unwrap();
    let (b, _) = infer_package(&pkg, &plain, std::slice::from_ref(&x)).unwrap();
    assert_eq!(a, b, "layer events changed the outputs");
}

/// Model switches on one device: arena, program, upload, two runs, drop,
/// alternating two ResNet-152s of the same shape. With fresh arenas every
/// switch pays `cuMemAlloc` and `cuMemFree`; by default the dropped arena's
/// memory serves the next one. Both give each model its own numbers (no
/// stale parameters), and the per-step times print side by side.
#[test]
#[ignore = "requires an NVIDIA GPU"]
fn cuda_model_switches_reuse_arena_memory() {
    let dir = tempfile::tempdir().unwrap();
    let dirs = generate(&GenOptions {
        variants: 2,
        ..GenOptions::new(Family::Resnet152, dir.path())
    })
    .expect("generate");
    let pkgs: Vec<Package> = dirs.iter().map(|d| Package::open(d).unwrap()).collect();
    let x = input(&pkgs[0].manifest, 1, 9);
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let mut reference: Vec<Option<Vec<HostTensor>>> = vec![None, None];
    for fresh in [true, false] {
        let exec = CudaExecutor::with_options(
            0,
            CudaOptions {
                fresh_arenas: fresh,
                ..CudaOptions::default()
            },
        )
        .unwrap();
        let (mut alloc, mut prog, mut first, mut warm, mut free) =
            (vec![], vec![], vec![], vec![], vec![]);
        for i in 0..8 {
            let pkg = &pkgs[i % 2];
            let m = &pkg.manifest;
            let t = Instant::now();
            let arena = exec.alloc_arena(m.stored_bytes).unwrap();
            alloc.push(ms(t.elapsed()));
            let t = Instant::now();
            let mut program = exec.program(m, arena.clone()).unwrap();
            prog.push(ms(t.elapsed()));
            for g in &m.groups {
                arena
                    .upload(g.index, g.offset, &pkg.group_bytes(g.index).unwrap())
                    .unwrap();
            }
            let t = Instant::now();
            let out = program
                .run(std::slice::from_ref(&x), &mut all_ready, &mut Trace::new())
                .unwrap();
            first.push(ms(t.elapsed()));
            let t = Instant::now();
            program
                .run(std::slice::from_ref(&x), &mut all_ready, &mut Trace::new())
                .unwrap();
            warm.push(ms(t.elapsed()));
            match &reference[i % 2] {
                None => reference[i % 2] = Some(out),
                Some(want) => assert_eq!(&out, want, "{} (switch {i}, fresh {fresh})", m.name),
            }
            let t = Instant::now();
            drop(program);
            drop(arena);
            free.push(ms(t.elapsed()));
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "switches, {} arenas: alloc {:.3} ms, program {:.3} ms, first run {:.3} ms, warm run {:.3} ms, drop {:.3} ms (medians of 8)",
            if fresh { "fresh" } else { "reused" },
            med(&mut alloc),
            med(&mut prog),
            med(&mut first),
            med(&mut warm),
            med(&mut free)
        );
    }
    assert_ne!(
        reference[0], reference[1],
        "the two models compute different numbers"
    );
}
