//! Numerics: the CPU executor against an independent NumPy reference.
//!
//! `tests/golden/<family>/` holds a seeded input, the output of
//! `tests/reference/forward.py` (a NumPy implementation of `models/OPS.md`
//! written without looking at the executor) and `meta.json`. Each test
//! regenerates the tiny package with `distmind model gen --seed 7`, checks the
//! generator still produces the same weights (group checksums), runs
//! `distmind infer --executor cpu` and compares the last output.
//!
//! Regenerate the goldens after a deliberate generator change with
//! `cargo build --release && python3 tests/reference/make_golden.py`.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "support/npy.rs"]
mod npy;
use npy::{compare, header_field, parse_npy_f32, read_npy_f32};

/// Largest accepted `max|a - b| / max(max|b|, 1e-6)`. Float32 evaluation
/// against the float64 reference measured <= 3e-7 on every family; 1e-5
/// leaves 30x room and still catches a GELU erf/tanh mix-up in BERT
/// (7.7e-5), which 1e-4 would not.
const MAX_REL_ERR: f64 = 1e-5;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_distmind")
}

fn golden_dir(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("golden")
        .join(family)
}

// ---------------------------------------------------------------------------
// Golden metadata and the package
// ---------------------------------------------------------------------------

fn read_meta(family: &str) -> serde_json::Value {
    let path = golden_dir(family).join("meta.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn json_strings(v: &serde_json::Value, what: &str) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what} is not an array"))
        .iter()
        .map(|s| {
            s.as_str()
                .unwrap_or_else(|| panic!("{what}: not a string"))
                .to_string()
        })
        .collect()
}

fn json_shape(v: &serde_json::Value, what: &str) -> Vec<usize> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what} is not an array"))
        .iter()
        .map(|s| {
            s.as_u64()
                .unwrap_or_else(|| panic!("{what}: not an integer")) as usize
        })
        .collect()
}

/// Generates the family's tiny package (seed from meta.json) under `out`;
/// returns the package directory (the one holding manifest.json).
fn gen_package(family: &str, seed: u64, out: &Path) -> PathBuf {
    let status = Command::new(bin())
        .args(["--log-level", "warn", "model", "gen", "--family", family])
        .args(["--scale", "tiny", "--seed", &seed.to_string()])
        .arg("--out")
        .arg(out)
        .output()
        .expect("run distmind model gen");
    assert!(
        status.status.success(),
        "distmind model gen --family {family} failed: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let dirs: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(
        dirs.len(),
        1,
        "expected one package under {}: {dirs:?}",
        out.display()
    );
    dirs.into_iter().next().unwrap()
}

/// Regenerates the package and fails unless its group checksums are the
/// goldens'. Returns the package directory.
fn package_matching_golden(family: &str, meta: &serde_json::Value, out: &Path) -> PathBuf {
    let seed = meta["seed"].as_u64().expect("meta.json: seed");
    let pkg = gen_package(family, seed, out);
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(pkg.join("manifest.json")).unwrap()).unwrap();
    let got: Vec<String> = manifest["groups"]
        .as_array()
        .expect("manifest groups")
        .iter()
        .map(|g| g["checksum"].as_str().expect("group checksum").to_string())
        .collect();
    let want = json_strings(&meta["group_checksums"], "meta.json group_checksums");
    assert_eq!(
        got, want,
        "{family}: the model generator changed (group checksums of `distmind model gen \
         --family {family} --scale tiny --seed {seed}` differ from tests/golden/{family}/meta.json); \
         the goldens are stale: re-run `cargo build --release && python3 tests/reference/make_golden.py` \
         and check in tests/golden/"
    );
    assert_eq!(
        manifest["name"], meta["package"],
        "{family}: package name changed; re-run tests/reference/make_golden.py"
    );
    pkg
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

const FAMILIES: [&str; 5] = [
    "resnet152",
    "inception_v3",
    "densenet201",
    "bert_base",
    "gpt2",
];

fn check_cpu_executor(family: &str) {
    let meta = read_meta(family);
    let tmp = tempfile::tempdir().unwrap();
    let pkg = package_matching_golden(family, &meta, &tmp.path().join("pkg"));
    let golden = read_npy_f32(&golden_dir(family).join("output.npy"));
    let out = tmp.path().join("out.npy");
    let run = Command::new(bin())
        .args(["--log-level", "warn", "infer", "--model"])
        .arg(&pkg)
        .arg("--input")
        .arg(golden_dir(family).join("input.npy"))
        .arg("--output")
        .arg(&out)
        .args(["--executor", "cpu"])
        .output()
        .expect("run distmind infer");
    assert!(
        run.status.success(),
        "{family}: distmind infer failed ({}):\n{}{}",
        run.status,
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let got = read_npy_f32(&out);
    assert_eq!(
        got.shape, golden.shape,
        "{family}: output shape {:?}, reference {:?}",
        got.shape, golden.shape
    );
    let e = compare(&got.data, &golden.data);
    println!(
        "{family}: shape {:?}  max rel err {:.3e}  max abs err {:.3e}",
        golden.shape, e.max_rel, e.max_abs
    );
    assert!(
        e.max_rel <= MAX_REL_ERR,
        "{family}: CPU executor disagrees with the NumPy reference: max rel err {:.3e} > {MAX_REL_ERR:.0e} \
         (max abs err {:.3e}, max |ref| {:.3e})",
        e.max_rel,
        e.max_abs,
        golden.data.iter().fold(0f32, |m, v| m.max(v.abs()))
    );
}

#[test]
fn cpu_executor_matches_reference_resnet152() {
    check_cpu_executor("resnet152");
}

#[test]
fn cpu_executor_matches_reference_inception_v3() {
    check_cpu_executor("inception_v3");
}

#[test]
fn cpu_executor_matches_reference_densenet201() {
    check_cpu_executor("densenet201");
}

#[test]
fn cpu_executor_matches_reference_bert_base() {
    check_cpu_executor("bert_base");
}

#[test]
fn cpu_executor_matches_reference_gpt2() {
    check_cpu_executor("gpt2");
}

/// The goldens are well-formed: shapes agree with meta.json and the outputs
/// are finite and not trivially zero.
#[test]
fn golden_files_are_consistent() {
    for family in FAMILIES {
        let meta = read_meta(family);
        let out = read_npy_f32(&golden_dir(family).join("output.npy"));
        assert_eq!(
            out.shape,
            json_shape(&meta["output"]["shape"], "meta.json output.shape"),
            "{family}"
        );
        assert!(
            out.data.iter().all(|v| v.is_finite()),
            "{family}: non-finite golden"
        );
        assert!(
            out.data.iter().any(|&v| v != 0.0),
            "{family}: all-zero golden"
        );
        let input_shape = json_shape(&meta["input"]["shape"], "meta.json input.shape");
        if meta["input"]["dtype"] == "float32" {
            let x = read_npy_f32(&golden_dir(family).join("input.npy"));
            assert_eq!(x.shape, input_shape, "{family}");
        } else {
            assert_eq!(meta["input"]["dtype"], "int64", "{family}");
            let n: usize = input_shape.iter().product();
            let len = std::fs::metadata(golden_dir(family).join("input.npy"))
                .unwrap()
                .len() as usize;
            assert!(
                len >= n * 8,
                "{family}: input.npy too short for {input_shape:?} i64"
            );
        }
        assert!(
            !json_strings(&meta["group_checksums"], "group_checksums").is_empty(),
            "{family}: meta.json has no group checksums"
        );
    }
}

/// The generator still writes the weights the goldens were computed from.
#[test]
fn generator_matches_golden_checksums() {
    for family in FAMILIES {
        let meta = read_meta(family);
        let tmp = tempfile::tempdir().unwrap();
        package_matching_golden(family, &meta, tmp.path());
    }
}

/// The comparison flags a perturbation above the tolerance and passes one
/// below it; the .npy reader round-trips a hand-written file.
#[test]
fn comparison_and_npy_reader_self_check() {
    let golden = read_npy_f32(&golden_dir("resnet152").join("output.npy"));
    let e = compare(&golden.data, &golden.data);
    assert_eq!((e.max_abs, e.max_rel), (0.0, 0.0));

    let scale = golden.data.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let mut small = golden.data.clone();
    small[17] += (scale * 1e-6) as f32;
    let e = compare(&small, &golden.data);
    assert!(e.max_rel <= MAX_REL_ERR && e.max_rel > 0.0, "{e:?}");
    let mut big = golden.data.clone();
    big[3] -= (scale * 1e-3) as f32;
    let e = compare(&big, &golden.data);
    assert!(e.max_rel > MAX_REL_ERR, "{e:?}");
    let mut nan = golden.data.clone();
    nan[0] = f32::NAN;
    assert!(compare(&nan, &golden.data).max_rel > MAX_REL_ERR);
    assert!(compare(&golden.data[1..], &golden.data).max_rel > MAX_REL_ERR);

    // Hand-written v1 .npy: shape (2, 3), values 0..6.
    let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
    let mut h = header.to_string();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(h.len() as u16).to_le_bytes());
    bytes.extend_from_slice(h.as_bytes());
    for i in 0..6 {
        bytes.extend_from_slice(&(i as f32).to_le_bytes());
    }
    let a = parse_npy_f32(&bytes).unwrap();
    assert_eq!(a.shape, vec![2, 3]);
    assert_eq!(a.data, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    // Truncated bodies and non-f32 dtypes are refused; a 1-d shape parses.
    let h1 = bytes.clone();
    assert!(parse_npy_f32(&h1[..h1.len() - 1]).is_err());
    let i64_header = header.replace("<f4", "<i8");
    let mut b2 = b"\x93NUMPY\x01\x00".to_vec();
    b2.extend_from_slice(&(i64_header.len() as u16).to_le_bytes());
    b2.extend_from_slice(i64_header.as_bytes());
    assert!(parse_npy_f32(&b2).unwrap_err().contains("<i8"));
    assert_eq!(
        header_field(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }",
            "shape"
        )
        .unwrap(),
        "(5,)"
    );
}
