//! The Open Inference Protocol (KServe v2 / Triton) with its standard
//! Python client: a real cluster (controller, memory server, GPU server on
//! the cpu executor) with one tiny model of each family, and `tritonclient`
//! from PyPI in a venv under the build directory.
//!
//! Every `tests/oip/check_*.py` runs against it with
//! `--url HOST:PORT --models-dir DIR --expected-dir DIR --token T`
//! (`--url`: the gRPC endpoint for `check_grpc*.py`, else the HTTP one).
//! `DIR` of `--expected-dir` holds, per model `M`: `M.input.npy` (batch 1)
//! and `M.<output>.npy`, what `distmind infer --executor cpu` computes from
//! that input; and `models.json`: every model's inputs and outputs (name,
//! datatype, shape) from its package manifest.
//!
//! Without PyPI (no network) the test prints `skipped: <why>` and passes.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use distmind_models::{Dtype, Package};
use distmind_runtime::npy::write_npy;
use support::*;

const FAMILIES: [&str; 5] = [
    "resnet152",
    "densenet201",
    "inception_v3",
    "bert_base",
    "gpt2",
];
const API_KEY: &str = "oip-test-key-0123456789";

/// The venv, reused by later runs: under the build directory, nothing
/// cached outside the repository.
fn venv_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("oip-venv")
}

fn venv_python() -> PathBuf {
    venv_dir().join("bin").join("python")
}

fn sh(cmd: &mut Command) -> (bool, String) {
    match cmd.output() {
        Ok(o) => (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        ),
        Err(e) => (false, format!("cannot run {cmd:?}: {e}")),
    }
}

/// The venv's python with tritonclient and numpy: `Ok(path)`, or
/// `Err(why)` when PyPI cannot be reached (the only reason to skip).
fn python_with_tritonclient() -> Result<PathBuf, String> {
    let py = venv_python();
    let imports = "import tritonclient.http, tritonclient.grpc, numpy";
    if py.exists() && sh(Command::new(&py).args(["-c", imports])).0 {
        return Ok(py);
    }
    let (ok, out) = sh(Command::new("python3")
        .args(["-m", "venv", "--clear"])
        .arg(venv_dir()));
    assert!(
        ok,
        "python3 -m venv failed (Debian: apt-get install python3-venv):\n{out}"
    );
    // Is the package index reachable at all? Only that may skip the test.
    let index =
        std::env::var("PIP_INDEX_URL").unwrap_or_else(|_| "https://pypi.org/simple/".into());
    let probe = format!(
        "import urllib.request; urllib.request.urlopen({:?} + 'tritonclient/', timeout=15).read(1)",
        index.trim_end_matches('/').to_string() + "/"
    );
    let (reachable, why) = sh(Command::new(&py).args(["-c", &probe]));
    if !reachable {
        let last = why.lines().last().unwrap_or("").to_string();
        return Err(format!(
            "the package index {index} cannot be reached: {last}"
        ));
    }
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pip-cache");
    let (ok, out) = sh(Command::new(&py)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "tritonclient[http,grpc]",
            "numpy",
        ])
        .env("PIP_CACHE_DIR", &cache));
    assert!(
        ok,
        "pip install tritonclient[http,grpc] numpy failed:\n{out}"
    );
    let (ok, out) = sh(Command::new(&py).args(["-c", imports]));
    assert!(ok, "tritonclient installed but does not import:\n{out}");
    Ok(py)
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "FP32",
        Dtype::I64 => "INT64",
    }
}

/// Writes `M.input.npy`, `M.<output>.npy` (from `distmind infer`) and
/// returns the model's entry of `models.json`.
fn expected_for(pkg_dir: &Path, dir: &Path) -> serde_json::Value {
    let pkg = Package::open(pkg_dir).unwrap();
    let m = &pkg.manifest;
    let input = dir.join(format!("{}.input.npy", m.name));
    write_npy(&input, &input_for(&pkg)).unwrap();
    let out = dir.join(format!("{}.out.npy", m.name));
    let (ok, _, stderr) = run(&[
        "infer",
        "--model",
        pkg_dir.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--executor",
        "cpu",
    ]);
    assert!(ok, "distmind infer {}: {stderr}", m.name);
    // `distmind infer` writes the last output to --output, earlier ones
    // next to it as <stem>.<name>.npy.
    for (i, o) in m.outputs.iter().enumerate() {
        let written = if i + 1 == m.outputs.len() {
            out.clone()
        } else {
            dir.join(format!("{}.out.{}.npy", m.name, o.name))
        };
        std::fs::rename(&written, dir.join(format!("{}.{}.npy", m.name, o.name))).unwrap();
    }
    // `shape`: the package's default; `protocol_shape`: what model metadata
    // must report (-1 for every dimension a request chooses).
    let tensor = |name: &str, d: Dtype, shape: &[usize], protocol: Vec<i64>| serde_json::json!({"name": name, "datatype": dtype_name(d), "shape": shape, "protocol_shape": protocol});
    let out_protocol = m.output_protocol_shapes();
    serde_json::json!({
        "name": m.name,
        "family": serde_json::to_value(m.family).unwrap(),
        "inputs": m.inputs.iter().map(|t| tensor(&t.name, t.dtype, &t.shape, t.protocol_shape())).collect::<Vec<_>>(),
        "outputs": m.outputs.iter().zip(out_protocol).map(|(t, p)| tensor(&t.name, t.dtype, &t.shape, p)).collect::<Vec<_>>(),
    })
}

#[test]
fn tritonclient_speaks_to_the_cluster() {
    let py = match python_with_tritonclient() {
        Ok(py) => py,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    // The shipped settings plus an api key: every request needs the token.
    let settings = copy_settings(tmp.path(), |_, _| None);
    std::fs::write(settings.join("api.key"), format!("{API_KEY}\n")).unwrap();

    let (_ctl, addrs) = spawn_service_lines(
        &[
            "controller",
            "--settings",
            settings.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--client-listen",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ],
        5,
    );
    let (ctl, http, grpc) = (&addrs[0], &addrs[3], &addrs[4]);
    let _mem = spawn_memserver(ctl, "256MiB");
    wait_alive(ctl, 1);

    let models = tmp.path().join("models");
    let mut packages = Vec::new();
    for family in FAMILIES {
        packages.extend(gen_tiny(&models, family, 1, 1 << 16));
    }
    let (ok, _, stderr) = deploy(ctl, &[], &packages);
    assert!(ok, "deploy: {stderr}");
    let rt = spawn_runtime(ctl, &["--cache", "256MiB"]);
    wait_runtime_alive(ctl, &rt.addr);

    let expected = tmp.path().join("expected");
    std::fs::create_dir(&expected).unwrap();
    let index: Vec<serde_json::Value> = packages
        .iter()
        .map(|p| expected_for(p, &expected))
        .collect();
    std::fs::write(
        expected.join("models.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();

    let scripts_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oip");
    let mut scripts: Vec<PathBuf> = std::fs::read_dir(&scripts_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("check_") && n.ends_with(".py"))
        })
        .collect();
    scripts.sort();
    assert!(
        !scripts.is_empty(),
        "no check_*.py in {}",
        scripts_dir.display()
    );
    for script in &scripts {
        let name = script.file_name().unwrap().to_string_lossy().into_owned();
        let url = if name.starts_with("check_grpc") {
            grpc
        } else {
            http
        };
        let out = Command::new(&py)
            .arg(script)
            .args(["--url", url, "--models-dir"])
            .arg(&models)
            .arg("--expected-dir")
            .arg(&expected)
            .args(["--token", API_KEY])
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("--- {name} against {url}:\n{text}");
        assert!(
            out.status.success(),
            "{name} failed ({}):\n{text}",
            out.status
        );
    }
}
