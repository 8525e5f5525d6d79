//! Half-precision packages on the executors: the arena holds f32, the
//! upload widens the stored bf16/f16 bytes (the cpu executor in its upload
//! stage), and the sim executor's upload time counts the stored bytes, the
//! ones that cross the link.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distmind_models::{
    generate, write_package, Family, GenOptions, Package, PackageSpec, ParamDtype, Scale,
};
use distmind_runtime::exec::cpu::CpuExecutor;
use distmind_runtime::exec::sim::SimExecutor;
use distmind_runtime::exec::{all_ready, Arena, ExecError, Executor, HostTensor, Trace};
use distmind_runtime::infer::infer_package;
use distmind_runtime::profile::{Profile, SHIPPED_ESTIMATED_PATH};

fn half_package(dir: &Path, dtype: ParamDtype) -> Package {
    let mut opts = GenOptions::new(Family::Resnet152, dir);
    opts.scale = Scale::Tiny;
    opts.group_bytes = 4096;
    opts.dtype = dtype;
    Package::open(&generate(&opts).unwrap()[0]).unwrap()
}

/// The same model stored as f32: every parameter widened exactly.
fn widened(half: &Package, dir: &Path) -> Package {
    let m = &half.manifest;
    let arch = m.config.build();
    let data: Vec<Vec<u8>> = arch
        .params
        .iter()
        .map(|p| {
            half.param_f32(&p.name)
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect();
    let spec = PackageSpec {
        name: format!("{}-f32", m.name),
        config: m.config.clone(),
        scale: m.scale,
        seed: None,
        origin: None,
        group_bytes: 4096,
        dtype: ParamDtype::F32,
    };
    write_package(dir, &spec, &arch, &data).unwrap();
    let out: PathBuf = dir.join(&spec.name);
    Package::open(out).unwrap()
}

fn input(pkg: &Package) -> Vec<HostTensor> {
    let s = &pkg.manifest.inputs[0];
    let n: usize = s.shape.iter().product();
    vec![HostTensor::f32(
        s.shape.clone(),
        (0..n).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect(),
    )]
}

/// Compiles first, then uploads every group: the cpu executor prepares the
/// params from the stored bytes in the upload itself.
fn compile_then_upload(pkg: &Package, exec: &dyn Executor) -> Vec<HostTensor> {
    let m = &pkg.manifest;
    let arena = exec.alloc_arena(m.device_bytes()).unwrap();
    let mut program = exec.program(m, arena.clone()).unwrap();
    for g in &m.groups {
        let bytes = pkg.group_bytes(g.index).unwrap();
        arena
            .upload_stored(
                g.index,
                g.device_offset(m.param_dtype),
                m.param_dtype,
                &bytes,
            )
            .unwrap();
    }
    program
        .run(&input(pkg), &mut all_ready, &mut Trace::new())
        .unwrap()
}

#[test]
fn cpu_half_packages_compute_what_their_widened_f32_package_computes() {
    for dtype in [ParamDtype::BF16, ParamDtype::F16] {
        let dir = tempfile::tempdir().unwrap();
        let half = half_package(dir.path(), dtype);
        let wide = widened(&half, dir.path());
        assert_eq!(half.manifest.param_dtype, dtype);
        assert_eq!(
            half.manifest.device_bytes(),
            2 * half.manifest.stored_bytes,
            "{dtype}"
        );
        let exec = CpuExecutor::new();
        let want = infer_package(&wide, &exec, &input(&wide)).unwrap().0;
        // Uploaded into the arena's buffer before the program exists...
        let (buffered, _) = infer_package(&half, &exec, &input(&half)).unwrap();
        assert_eq!(buffered, want, "{dtype}: upload, then compile");
        // ...and converted straight into the program's params.
        assert_eq!(
            compile_then_upload(&half, &exec),
            want,
            "{dtype}: compile, then upload"
        );
    }
}

#[test]
fn an_upload_of_half_bytes_checks_the_device_range() {
    let dir = tempfile::tempdir().unwrap();
    let half = half_package(dir.path(), ParamDtype::BF16);
    let m = &half.manifest;
    let exec = CpuExecutor::new();
    // An arena of the stored size is too small for the widened model.
    let small = exec.alloc_arena(m.stored_bytes).unwrap();
    let last = m.groups.last().unwrap();
    let bytes = half.group_bytes(last.index).unwrap();
    let e = small
        .upload_stored(
            last.index,
            last.device_offset(m.param_dtype),
            m.param_dtype,
            &bytes,
        )
        .unwrap_err();
    assert!(matches!(e, ExecError::UploadOutOfRange { .. }), "{e}");
    let arena = exec.alloc_arena(m.device_bytes()).unwrap();
    let e = arena
        .upload_stored(0, 0, ParamDtype::BF16, &[0, 0, 0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 bytes") && e.contains("bf16"), "{e}");
}

/// Uploads every group of `pkg` to a fresh arena of `exec`; the wall time.
fn upload_all(pkg: &Package, exec: &dyn Executor) -> Duration {
    let m = &pkg.manifest;
    let arena: Arc<dyn Arena> = exec.alloc_arena(m.device_bytes()).unwrap();
    let groups: Vec<Vec<u8>> = m
        .groups
        .iter()
        .map(|g| pkg.group_bytes(g.index).unwrap())
        .collect();
    let start = Instant::now();
    for (g, bytes) in m.groups.iter().zip(&groups) {
        arena
            .upload_stored(
                g.index,
                g.device_offset(m.param_dtype),
                m.param_dtype,
                bytes,
            )
            .unwrap();
    }
    start.elapsed()
}

#[test]
fn sim_uploads_take_the_time_of_the_stored_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let half = half_package(dir.path(), ParamDtype::BF16);
    let wide = widened(&half, dir.path());
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(SHIPPED_ESTIMATED_PATH);
    let mut profile = Profile::load(path).unwrap();
    // The f32 model takes about 400 ms over the simulated link.
    profile.peaks.h2d_bytes_per_s = wide.manifest.stored_bytes as f64 / 0.4;
    let exec = SimExecutor::new(profile);
    let (h, w) = (upload_all(&half, &exec), upload_all(&wide, &exec));
    let ratio = h.as_secs_f64() / w.as_secs_f64();
    assert!(
        (0.35..0.75).contains(&ratio),
        "bf16 upload {h:?}, f32 {w:?}: ratio {ratio:.2}, expected about 0.5"
    );
}
