//! `distmind model import` against PyTorch.
//!
//! `tests/golden/import/<case>/` holds checkpoints PyTorch wrote
//! (`tests/reference/torch_reference.py`: torchvision and Hugging Face
//! models, random init, reduced configs), a fixed input and PyTorch's
//! outputs. Each case is imported with the `distmind` binary, run with
//! `distmind infer --executor cpu`, and every output is compared with
//! PyTorch's: `max|a - b| / max|b| <= 1e-4`. The measured errors print with
//! `cargo test --release --test import -- --nocapture`.
//!
//! The full-size comparison builds the five full models in PyTorch on the
//! spot; it needs torch, torchvision, transformers and safetensors in the
//! Python named by `DISTMIND_TORCH_PYTHON` (default `python3`) and says that
//! it skipped, and why, where they are missing.
//!
//! Half-precision checkpoints (`resnet152_f16`, `gpt2_bf16`, `resnet152_bf16`,
//! and a full-size bf16 ResNet-152 where PyTorch is installed) are checked both ways: imported with
//! `--widen` (an f32 package) and kept half (PyTorch computes in f32 with the
//! half weights widened; so must the executor, widening on upload).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "support/npy.rs"]
mod npy;
mod support;
use npy::{compare, read_npy_f32};

/// The tolerance: float32 agreement with PyTorch.
const MAX_REL_ERR: f64 = 1e-4;

const FAMILIES: [&str; 5] = [
    "resnet152",
    "inception_v3",
    "densenet201",
    "bert_base",
    "gpt2",
];

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_distmind")
}

fn golden(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/import")
        .join(case)
}

fn distmind(args: &[&str]) -> Output {
    Command::new(bin())
        .args(["--log-level", "warn"])
        .args(args)
        .output()
        .expect("run distmind")
}

fn ok(out: Output, what: &str) -> String {
    let out = ok_output(out, what);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ok_output(out: Output, what: &str) -> Output {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn failed(out: Output, what: &str) -> String {
    assert!(
        !out.status.success(),
        "{what} should have failed:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `distmind infer` of `pkg` on `input` with the cpu executor.
fn infer_cpu(pkg: &Path, input: &Path, output: &Path) -> Output {
    distmind(&[
        "infer",
        "--model",
        s(pkg),
        "--input",
        s(input),
        "--output",
        s(output),
        "--executor",
        "cpu",
    ])
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A directory written by `torch_reference.py`: what to import and what
/// PyTorch answered.
struct Reference {
    dir: PathBuf,
    meta: serde_json::Value,
}

impl Reference {
    fn open(dir: PathBuf) -> Reference {
        let meta = read_json(&dir.join("meta.json"));
        Reference { dir, meta }
    }

    fn family(&self) -> &str {
        self.meta["family"].as_str().expect("meta.json: family")
    }

    /// `distmind model import` arguments for this checkpoint.
    fn import_args(&self, out: &Path) -> Vec<String> {
        let mut args: Vec<String> = ["model", "import", "--family", self.family(), "--weights"]
            .map(String::from)
            .to_vec();
        args.push(s(&self.dir.join("model.safetensors")).into());
        if let Some(c) = self.meta["config"].as_str() {
            args.push("--config".into());
            args.push(s(&self.dir.join(c)).into());
        }
        for a in self.meta["import_args"].as_array().expect("import_args") {
            args.push(a.as_str().expect("import_args: strings").into());
        }
        args.push("--out".into());
        args.push(s(out).into());
        args
    }

    /// Imports, runs `distmind infer` and compares every output with
    /// PyTorch's. Returns the largest relative error.
    fn check(&self, tmp: &Path, label: &str) -> f64 {
        self.check_with(tmp, label, &[])
    }

    /// [`Reference::check`] with extra `model import` arguments (`--widen`).
    fn check_with(&self, tmp: &Path, label: &str, extra: &[&str]) -> f64 {
        let pkg = tmp.join(format!("{label}-imported"));
        let mut args = self.import_args(&pkg);
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ok(distmind(&args), &format!("{label}: model import"));
        let out = tmp.join(format!("{label}-out.npy"));
        let input = self.dir.join("input.npy");
        ok(infer_cpu(&pkg, &input, &out), &format!("{label}: infer"));
        // `infer` writes the last output to --output and the others next to
        // it as <stem>.<name>.npy, as torch_reference.py names PyTorch's.
        let mut worst = 0f64;
        for o in self.meta["outputs"].as_array().expect("meta.json: outputs") {
            let name = o["name"].as_str().expect("output name");
            let file = o["file"].as_str().expect("output file");
            let ours = if file == "output.npy" {
                out.clone()
            } else {
                tmp.join(format!("{label}-out.{name}.npy"))
            };
            let want = read_npy_f32(&self.dir.join(file));
            let got = read_npy_f32(&ours);
            assert_eq!(got.shape, want.shape, "{label}: {name} shape");
            let e = compare(&got.data, &want.data);
            println!(
                "{label}: {name} {:?}: max rel err {:.2e} (max abs {:.2e}, max |torch| {:.3e})",
                want.shape,
                e.max_rel,
                e.max_abs,
                want.data.iter().fold(0f32, |m, v| m.max(v.abs()))
            );
            if let Some(f64_file) = o["f64_file"].as_str() {
                // Conditioning: how far both float32 results are from float64.
                let exact = read_npy_f32(&self.dir.join(f64_file));
                println!(
                    "{label}: {name} vs PyTorch float64: PyTorch float32 {:.2e}, distmind {:.2e}",
                    compare(&want.data, &exact.data).max_rel,
                    compare(&got.data, &exact.data).max_rel
                );
            }
            assert!(
                e.max_rel <= MAX_REL_ERR,
                "{label}: {name} differs from PyTorch: max rel err {:.3e} > {MAX_REL_ERR:.0e}",
                e.max_rel
            );
            worst = worst.max(e.max_rel);
        }
        worst
    }
}

fn check_golden(case: &str) {
    let tmp = tempfile::tempdir().unwrap();
    Reference::open(golden(case)).check(tmp.path(), case);
}

#[test]
fn imported_resnet152_matches_pytorch() {
    check_golden("resnet152");
}

#[test]
fn imported_inception_v3_matches_pytorch() {
    check_golden("inception_v3");
}

#[test]
fn imported_densenet201_matches_pytorch() {
    check_golden("densenet201");
}

#[test]
fn imported_bert_base_matches_pytorch() {
    check_golden("bert_base");
}

#[test]
fn imported_gpt2_matches_pytorch() {
    check_golden("gpt2");
}

/// One BERT and one GPT-2 package, imported once (default length 64, a
/// 128-row position table), answer requests of 16, 64 and 128 tokens with
/// what PyTorch computes at each length (`*_seqs` goldens); 129 tokens are
/// refused naming the bound.
#[test]
fn one_transformer_package_serves_every_length_like_pytorch() {
    let tmp = tempfile::tempdir().unwrap();
    for case in ["bert_base_seqs", "gpt2_seqs"] {
        let r = Reference::open(golden(case));
        let pkg = tmp.path().join(format!("{case}-imported"));
        let args = r.import_args(&pkg);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ok(distmind(&args), &format!("{case}: model import"));
        let manifest = read_json(&pkg.join("manifest.json"));
        assert_eq!(
            manifest["inputs"][0]["shape"],
            serde_json::json!([2, 64]),
            "{case}: the default shape"
        );
        assert_eq!(
            manifest["inputs"][0]["variable"][1],
            serde_json::json!({"dim": 1, "kind": "sequence", "max": 128}),
            "{case}: the manifest states the variable length"
        );
        let cases = r.meta["seq_cases"]
            .as_array()
            .expect("meta.json: seq_cases");
        let lens: Vec<u64> = cases
            .iter()
            .map(|c| c["seq_len"].as_u64().unwrap())
            .collect();
        assert_eq!(lens, [16, 64, 128], "{case}");
        for c in cases {
            let len = c["seq_len"].as_u64().unwrap();
            let label = format!("{case} L={len}");
            let out = tmp.path().join(format!("{case}-L{len}.npy"));
            let input = r.dir.join(c["input"]["file"].as_str().unwrap());
            ok(infer_cpu(&pkg, &input, &out), &format!("{label}: infer"));
            for o in c["outputs"].as_array().unwrap() {
                let name = o["name"].as_str().unwrap();
                let file = o["file"].as_str().unwrap();
                let ours = if file == format!("output.L{len}.npy") {
                    out.clone()
                } else {
                    tmp.path().join(format!("{case}-L{len}.{name}.npy"))
                };
                let want = read_npy_f32(&r.dir.join(file));
                let got = read_npy_f32(&ours);
                assert_eq!(got.shape, want.shape, "{label}: {name} shape");
                let e = compare(&got.data, &want.data);
                println!(
                    "{label}: {name} {:?}: max rel err {:.2e} (max abs {:.2e})",
                    want.shape, e.max_rel, e.max_abs
                );
                assert!(
                    e.max_rel <= MAX_REL_ERR,
                    "{label}: {name} differs from PyTorch: max rel err {:.3e} > {MAX_REL_ERR:.0e}",
                    e.max_rel
                );
            }
        }
        // One past the position table: refused, naming the model's bound.
        let long = tmp.path().join(format!("{case}-L129-input.npy"));
        write_tokens_npy(&long, 1, 129);
        let err = failed(
            infer_cpu(&pkg, &long, &tmp.path().join("never.npy")),
            &format!("{case}: 129 tokens"),
        );
        assert!(
            err.contains("[1, 129]") && err.contains("tokens 1..=128"),
            "{case}: {err}"
        );
    }
}

/// Writes an `int64` `.npy` of `rows x len` token ids (all 1).
fn write_tokens_npy(path: &Path, rows: usize, len: usize) {
    let mut header =
        format!("{{'descr': '<i8', 'fortran_order': False, 'shape': ({rows}, {len}), }}");
    // Magic, version, header length, then the header padded to 64 bytes.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for _ in 0..rows * len {
        bytes.extend_from_slice(&1i64.to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

const HALF_CASES: [(&str, &str); 3] = [
    ("resnet152_f16", "F16"),
    ("gpt2_bf16", "BF16"),
    ("resnet152_bf16", "BF16"),
];

/// Half-precision checkpoints with `--widen`: an f32 package, every value
/// widened exactly, PyTorch's outputs, and `model inspect` says so.
#[test]
fn half_precision_checkpoints_widen_on_request_and_say_so() {
    for (case, dtype) in HALF_CASES {
        let tmp = tempfile::tempdir().unwrap();
        let r = Reference::open(golden(case));
        r.check_with(tmp.path(), case, &["--widen"]);
        let m = read_json(&tmp.path().join(format!("{case}-imported/manifest.json")));
        assert_eq!(m["param_dtype"], "F32", "{case}");
        let shown = ok(
            distmind(&[
                "model",
                "inspect",
                s(&tmp.path().join(format!("{case}-imported"))),
            ]),
            "inspect",
        );
        assert!(
            shown.contains(&format!("({dtype})")) && shown.contains("widened exactly"),
            "{case}: inspect does not say the checkpoint was {dtype}:\n{}",
            &shown[..shown.len().min(600)]
        );
    }
}

/// Half-precision checkpoints keep their dtype: the package stores the
/// checkpoint's bytes (about half an f32 package's), and its values are
/// exactly those of the `--widen` import.
#[test]
fn half_precision_checkpoints_stay_half() {
    for (case, dtype) in HALF_CASES {
        let tmp = tempfile::tempdir().unwrap();
        let r = Reference::open(golden(case));
        let (half, wide) = (tmp.path().join("half"), tmp.path().join("wide"));
        for (out, extra) in [(&half, None), (&wide, Some("--widen"))] {
            let mut args = r.import_args(out);
            args.extend(extra.map(String::from));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let stderr =
                String::from_utf8_lossy(&ok_output(distmind(&args), case).stderr).into_owned();
            let want = match extra {
                None => format!("stored as {}", dtype.to_lowercase()),
                Some(_) => format!("stored as f32 (from {dtype}, widened exactly: --widen)"),
            };
            assert!(stderr.contains(&want), "{case}: {stderr}");
        }
        let half = distmind_models::Package::open(&half).unwrap();
        let wide = distmind_models::Package::open(&wide).unwrap();
        half.verify().unwrap();
        assert_eq!(half.manifest.param_dtype.safetensors_name(), dtype);
        let ratio = half.manifest.stored_bytes as f64 / wide.manifest.stored_bytes as f64;
        println!(
            "{case}: {} stored bytes kept {dtype}, {} widened (ratio {ratio:.3})",
            half.manifest.stored_bytes, wide.manifest.stored_bytes
        );
        assert!(ratio < 0.6, "{case}: ratio {ratio}");
        assert_eq!(half.manifest.device_bytes(), 2 * half.manifest.stored_bytes);
        // The checkpoint's own bytes, unchanged (these checkpoints carry no key prefix).
        let ck = load(&r.dir.join("model.safetensors"));
        for p in &half.manifest.params {
            let t = ck
                .get(&p.name)
                .unwrap_or_else(|| panic!("{case}: {} not in the checkpoint", p.name));
            assert_eq!(
                half.param_bytes(&p.name).unwrap(),
                t.data,
                "{case}: {}",
                p.name
            );
            assert_eq!(
                half.param_f32(&p.name).unwrap(),
                wide.param_f32(&p.name).unwrap(),
                "{case}: {}",
                p.name
            );
        }
    }
}

/// A checkpoint mixing F16 and F32 parameters is stored as f32, every value
/// widened exactly, and the importer says why.
#[test]
fn a_checkpoint_mixing_dtypes_is_widened_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Reference::open(golden("resnet152_f16"));
    let mut tensors = load(&r.dir.join("model.safetensors"));
    let fc = tensors.get_mut("fc.weight").unwrap();
    let wide: Vec<u8> = fc
        .data
        .chunks_exact(2)
        .flat_map(|c| {
            distmind_models::dtype::f16_to_f32(u16::from_le_bytes([c[0], c[1]])).to_le_bytes()
        })
        .collect();
    fc.dtype = safetensors::Dtype::F32;
    fc.data = wide;
    let mixed = Reference {
        dir: tmp.path().join("mixed"),
        meta: r.meta.clone(),
    };
    std::fs::create_dir_all(&mixed.dir).unwrap();
    save(&tensors, &mixed.dir.join("model.safetensors"));
    std::fs::copy(r.dir.join("input.npy"), mixed.dir.join("input.npy")).unwrap();
    std::fs::copy(r.dir.join("output.npy"), mixed.dir.join("output.npy")).unwrap();
    let out = tmp.path().join("pkg");
    let args = mixed.import_args(&out);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let stderr =
        String::from_utf8_lossy(&ok_output(distmind(&args), "mixed import").stderr).into_owned();
    assert!(
        stderr.contains("stored as f32 (from F16 + F32, widened exactly: mixed dtypes)"),
        "{stderr}"
    );
    let m = read_json(&out.join("manifest.json"));
    assert_eq!(m["param_dtype"], "F32");
    assert_eq!(m["origin"]["converted_to_f32"], true);
    // Same values as PyTorch's: the f32 package computes its outputs.
    let _ = std::fs::remove_dir_all(&out);
    mixed.check(tmp.path(), "mixed");
}

/// A half-precision package computes what PyTorch computes in f32 with the
/// half weights widened: `distmind infer --executor cpu` on the kept-half
/// import against PyTorch's outputs, to the f32 tolerance.
///
/// Needs the cpu executor to widen half-precision groups on upload
/// (`distmind_models::dtype::widen_to_le_bytes` into the device layout);
/// until then `infer` refuses the package and this test fails.
#[test]
fn half_precision_packages_compute_what_pytorch_computes() {
    for (case, _) in HALF_CASES {
        let tmp = tempfile::tempdir().unwrap();
        let worst = Reference::open(golden(case)).check(tmp.path(), case);
        println!("{case} kept half: worst rel err {worst:.2e}");
    }
}

// ---------------------------------------------------------------------------
// Checkpoint surgery (the safetensors crate: any reader can load what we write)
// ---------------------------------------------------------------------------

struct Tensor {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn load(path: &Path) -> HashMap<String, Tensor> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            (
                name,
                Tensor {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    data: v.data().to_vec(),
                },
            )
        })
        .collect()
}

fn save(tensors: &HashMap<String, Tensor>, path: &Path) {
    let views = tensors.iter().map(|(n, t)| {
        (
            n.clone(),
            safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// One tensor removed, one renamed, one reshaped: three errors, each naming
/// its tensor, and no package left behind.
#[test]
fn a_damaged_checkpoint_gives_one_clear_error_per_tensor() {
    for (case, removed, renamed, reshaped) in [
        (
            "resnet152",
            "layer2.0.bn1.weight",
            "layer3.0.conv2.weight",
            "fc.bias",
        ),
        (
            "gpt2",
            "h.0.ln_2.bias",
            "h.1.attn.c_attn.weight",
            "h.1.mlp.c_proj.bias",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let r = Reference::open(golden(case));
        let mut t = load(&r.dir.join("model.safetensors"));
        assert!(t.remove(removed).is_some(), "{removed}");
        let moved = t.remove(renamed).expect(renamed);
        let new_name = renamed.replace("weight", "wieght");
        t.insert(new_name.clone(), moved);
        let x = t.get_mut(reshaped).expect(reshaped);
        let n = x.shape[0];
        x.shape = vec![n - 1];
        x.data.truncate((n - 1) * 4);
        let damaged = Reference {
            dir: tmp.path().join("damaged"),
            meta: r.meta.clone(),
        };
        std::fs::create_dir(&damaged.dir).unwrap();
        save(&t, &damaged.dir.join("model.safetensors"));
        if let Some(c) = r.meta["config"].as_str() {
            std::fs::copy(r.dir.join(c), damaged.dir.join(c)).unwrap();
        }
        let pkg = tmp.path().join("pkg");
        let args = damaged.import_args(&pkg);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = failed(distmind(&args), &format!("{case}: damaged import"));
        println!("{case}:\n{err}");
        assert!(err.contains("3 problem(s)"), "{case}: {err}");
        assert!(
            err.contains(&format!("tensor `{removed}` is missing (expected [")),
            "{case}: {err}"
        );
        assert!(
            err.contains(&format!(
                "tensor `{new_name}` is not a parameter of {}; it looks like `{renamed}` renamed",
                r.family()
            )),
            "{case}: {err}"
        );
        assert!(
            err.contains(&format!(
                "tensor `{reshaped}` has shape [{}]; {} with this config needs [{n}]",
                n - 1,
                r.family()
            )),
            "{case}: {err}"
        );
        assert!(
            !pkg.exists(),
            "{case}: a failed import left {}",
            pkg.display()
        );
    }
}

/// A Hugging Face task model's checkpoint (`BertForMaskedLM`: names under
/// `bert.`, a `cls.*` head): the prefix is stripped; the head is an error
/// naming it, or left out with --ignore-extra, and the outputs still match.
#[test]
fn a_task_model_checkpoint_needs_ignore_extra_for_its_head() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Reference::open(golden("bert_base"));
    let t = load(&r.dir.join("model.safetensors"));
    let mut task: HashMap<String, Tensor> = t
        .into_iter()
        .map(|(n, v)| (format!("bert.{n}"), v))
        .collect();
    task.insert(
        "cls.predictions.bias".into(),
        Tensor {
            dtype: safetensors::Dtype::F32,
            shape: vec![100],
            data: vec![0; 400],
        },
    );
    let dir = tmp.path().join("task");
    std::fs::create_dir(&dir).unwrap();
    save(&task, &dir.join("model.safetensors"));
    for f in [
        "config.json",
        "input.npy",
        "output.npy",
        "output.last_hidden_state.npy",
    ] {
        std::fs::copy(r.dir.join(f), dir.join(f)).unwrap();
    }
    let task = Reference {
        dir,
        meta: r.meta.clone(),
    };
    let args = task.import_args(&tmp.path().join("refused"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let err = failed(distmind(&args), "import with a head");
    assert!(
        err.contains("1 problem(s)")
            && err.contains(
                "tensor `cls.predictions.bias` (F32 [100]) is not a parameter of bert_base"
            )
            && err.contains("--ignore-extra"),
        "{err}"
    );
    let mut with_flag = task.meta.clone();
    with_flag["import_args"]
        .as_array_mut()
        .unwrap()
        .push("--ignore-extra".into());
    let task = Reference {
        dir: task.dir,
        meta: with_flag,
    };
    task.check(tmp.path(), "bert_base-task");
    let shown = ok(
        distmind(&[
            "model",
            "inspect",
            s(&tmp.path().join("bert_base-task-imported")),
        ]),
        "inspect",
    );
    assert!(
        shown.contains("key prefix `bert.` stripped") && shown.contains("cls.predictions.bias"),
        "{shown}"
    );
}

/// `model gen` writes the frameworks' names: its packages' weights import
/// back into the same package (same config, same group checksums), for every
/// family, the transformers through a Hugging Face config.json; a bf16
/// package imports back as the same bf16 package.
#[test]
fn generated_packages_import_back_unchanged() {
    for (family, dtype) in FAMILIES.into_iter().flat_map(|f| [(f, "f32"), (f, "bf16")]) {
        let tmp = tempfile::tempdir().unwrap();
        let gen_dir = tmp.path().join("gen");
        ok(
            distmind(&[
                "model",
                "gen",
                "--family",
                family,
                "--scale",
                "tiny",
                "--seed",
                "11",
                "--dtype",
                dtype,
                "--out",
                s(&gen_dir),
            ]),
            "gen",
        );
        let pkg = gen_dir.join(format!("{family}-tiny-00000000"));
        let m = read_json(&pkg.join("manifest.json"));
        let c = &m["config"];
        let batch = c["batch_size"].to_string();
        let mut args: Vec<String> = ["model", "import", "--family", family, "--weights"]
            .map(String::from)
            .to_vec();
        args.push(s(&pkg.join("weights.safetensors")).into());
        args.extend(["--batch-size".into(), batch]);
        let hf = match family {
            "bert_base" => Some(serde_json::json!({
                "model_type": "bert", "vocab_size": c["vocab_size"], "hidden_size": c["hidden"],
                "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
                "intermediate_size": c["intermediate"], "max_position_embeddings": c["max_positions"],
                "type_vocab_size": c["type_vocab_size"], "layer_norm_eps": c["layer_norm_eps"],
                "hidden_act": "gelu",
            })),
            "gpt2" => Some(serde_json::json!({
                "model_type": "gpt2", "vocab_size": c["vocab_size"], "n_embd": c["hidden"],
                "n_layer": c["layers"], "n_head": c["heads"], "n_inner": c["intermediate"],
                "n_positions": c["max_positions"], "layer_norm_epsilon": c["layer_norm_eps"],
                "activation_function": "gelu_new",
            })),
            _ => None,
        };
        match hf {
            Some(hf) => {
                let path = tmp.path().join("config.json");
                std::fs::write(&path, hf.to_string()).unwrap();
                args.extend(["--config".into(), s(&path).into()]);
                args.extend(["--seq-len".into(), c["seq_len"].to_string()]);
            }
            None => args.extend(["--image-size".into(), c["image_size"].to_string()]),
        }
        let out = tmp.path().join("imported");
        args.extend(["--out".into(), s(&out).into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ok(
            distmind(&args),
            &format!("{family}: import of a generated package"),
        );
        let back = read_json(&out.join("manifest.json"));
        assert_eq!(back["config"], m["config"], "{family}: config");
        assert_eq!(
            back["scale"], "tiny",
            "{family}: a tiny config is the tiny preset"
        );
        assert_eq!(
            back["groups"], m["groups"],
            "{family}: groups and checksums"
        );
        assert_eq!(back["layers"], m["layers"], "{family}: layer graph");
        assert_eq!(
            back["param_dtype"],
            dtype.to_uppercase(),
            "{family}: kept {dtype}"
        );
        assert!(
            back["seed"].is_null() && back["origin"].is_object(),
            "{family}"
        );
    }
}

/// Missing configs, wrong flags, inconsistent configs and an occupied --out
/// are refused with a message that says what to do.
#[test]
fn bad_import_requests_are_refused_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden("gpt2");
    let weights = g.join("model.safetensors");
    let out = tmp.path().join("x");
    let import = |extra: &[&str]| {
        let mut a = vec![
            "model",
            "import",
            "--weights",
            s(&weights),
            "--out",
            s(&out),
        ];
        a.extend_from_slice(extra);
        distmind(&a)
    };
    let err = failed(import(&["--family", "gpt2"]), "no config");
    assert!(err.contains("needs --config config.json"), "{err}");

    let cfg = g.join("config.json");
    let err = failed(
        import(&[
            "--family",
            "gpt2",
            "--config",
            s(&cfg),
            "--image-size",
            "32",
        ]),
        "image size",
    );
    assert!(err.contains("--image-size does not apply to gpt2"), "{err}");

    let mut hf = read_json(&cfg);
    hf["n_head"] = 3.into();
    let bad_cfg = tmp.path().join("heads.json");
    std::fs::write(&bad_cfg, hf.to_string()).unwrap();
    let err = failed(
        import(&[
            "--family",
            "gpt2",
            "--config",
            s(&bad_cfg),
            "--seq-len",
            "16",
        ]),
        "3 heads",
    );
    assert!(
        err.contains("not a multiple of the 3 attention heads"),
        "{err}"
    );
    hf["n_head"] = 2.into();
    hf["model_type"] = "llama".into();
    std::fs::write(&bad_cfg, hf.to_string()).unwrap();
    let err = failed(
        import(&["--family", "gpt2", "--config", s(&bad_cfg)]),
        "model_type",
    );
    assert!(err.contains("`model_type` is \"llama\""), "{err}");

    let err = failed(
        import(&["--family", "resnet152", "--config", s(&cfg)]),
        "HF config for a CNN",
    );
    assert!(err.contains("torchvision saves none"), "{err}");

    // The family's anchor tensors are absent: the error says which.
    let err = failed(import(&["--family", "densenet201"]), "wrong family");
    assert!(
        err.contains("tensor `features.denseblock1.denselayer1.conv2.weight` is missing"),
        "{err}"
    );

    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "user data").unwrap();
    let err = failed(
        import(&["--family", "gpt2", "--config", s(&cfg)]),
        "occupied --out",
    );
    assert!(err.contains("already exists and is not empty"), "{err}");
    assert_eq!(
        std::fs::read_to_string(out.join("keep.txt")).unwrap(),
        "user data"
    );

    // An imported config of its own has no GPU profile: the sim executor says so.
    let r = Reference::open(golden("resnet152"));
    let pkg = tmp.path().join("narrow");
    let args = r.import_args(&pkg);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(distmind(&args), "import");
    let err = failed(
        distmind(&[
            "infer",
            "--model",
            s(&pkg),
            "--input",
            s(&r.dir.join("input.npy")),
            "--output",
            s(&tmp.path().join("o.npy")),
            "--executor",
            "sim",
        ]),
        "sim on a custom config",
    );
    assert!(err.contains("has a config of its own"), "{err}");
}

/// Imported packages deploy and serve like generated ones: BERT and GPT-2
/// from PyTorch checkpoints, cut into several groups, sharded over two
/// memory servers, fetched cold by a runtime, and answered with PyTorch's
/// outputs.
#[test]
fn imported_models_deploy_and_serve_pytorchs_outputs() {
    use distmind_runtime::client::RuntimeClient;
    use distmind_runtime::exec::TensorData;

    let tmp = tempfile::tempdir().unwrap();
    let mut imported = Vec::new();
    for case in ["bert_base", "gpt2"] {
        let r = Reference::open(golden(case));
        let pkg = tmp.path().join(format!("{case}-from-torch"));
        let mut args = r.import_args(&pkg);
        args.extend(["--group-bytes".into(), "16384".into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ok(distmind(&args), &format!("{case}: import"));
        imported.push((r, pkg));
    }
    let controller = support::spawn_controller();
    let _ms: Vec<support::Proc> = (0..2)
        .map(|_| support::spawn_memserver(&controller.addr, "64MiB"))
        .collect();
    support::wait_alive(&controller.addr, 2);
    let dirs: Vec<PathBuf> = imported.iter().map(|(_, p)| p.clone()).collect();
    let (deployed, _, stderr) = support::deploy(&controller.addr, &[], &dirs);
    assert!(deployed, "deploy: {stderr}");
    let rt = support::spawn_runtime(&controller.addr, &["--cache", "64MiB", "--devices", "0"]);
    support::wait_runtime_alive(&controller.addr, &rt.addr);
    let mut client = RuntimeClient::connect(
        &rt.addr,
        &support::cluster_key(),
        std::time::Duration::from_secs(120),
    )
    .unwrap();
    for (r, pkg) in &imported {
        let name = pkg.file_name().unwrap().to_str().unwrap();
        let groups = read_json(&pkg.join("manifest.json"))["groups"]
            .as_array()
            .unwrap()
            .len();
        assert!(
            groups > 1,
            "{name}: {groups} group(s); the test wants several"
        );
        let input = distmind_runtime::npy::read_npy(&r.dir.join("input.npy")).unwrap();
        let (outputs, _) = client.infer(name, &input).unwrap();
        let files: Vec<&str> = r.meta["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["file"].as_str().unwrap())
            .collect();
        assert_eq!(outputs.len(), files.len(), "{name}: outputs");
        for (got, file) in outputs.iter().zip(files) {
            let want = read_npy_f32(&r.dir.join(file));
            let TensorData::F32(got_data) = &got.data else {
                panic!("{name}: {file}: not f32");
            };
            assert_eq!(got.shape, want.shape, "{name}: {file}");
            let e = compare(got_data, &want.data);
            println!(
                "{name} served ({groups} groups): {file} max rel err {:.2e}",
                e.max_rel
            );
            assert!(e.max_rel <= MAX_REL_ERR, "{name}: {file}: {e:?}");
        }
    }
}

// ---------------------------------------------------------------------------
// Full size, where PyTorch is installed
// ---------------------------------------------------------------------------

fn torch_python() -> String {
    std::env::var("DISTMIND_TORCH_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Why PyTorch cannot be used here, or `None` when it can.
fn torch_missing(python: &str) -> Option<String> {
    let probe = Command::new(python)
        .args([
            "-c",
            "import torch, torchvision, transformers, safetensors, numpy",
        ])
        .output();
    match probe {
        Err(e) => Some(format!("cannot run {python}: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "{python} lacks torch, torchvision, transformers or safetensors ({})",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
                .trim()
        )),
        Ok(_) => None,
    }
}

/// All five families at full size (torchvision's resnet152, inception_v3 and
/// densenet201; Hugging Face's default BertConfig and GPT2Config), batch 2,
/// also printing how far PyTorch's and distmind's float32 outputs are from
/// PyTorch's float64 evaluation (the case's conditioning).
#[test]
fn full_size_checkpoints_match_pytorch_where_it_is_installed() {
    let python = torch_python();
    if let Some(why) = torch_missing(&python) {
        println!(
            "skipped: the full-size comparison needs PyTorch: {why}; install \
             tests/reference/requirements-torch.txt and set DISTMIND_TORCH_PYTHON"
        );
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/torch_reference.py");
    let tmp = tempfile::tempdir().unwrap();
    for family in FAMILIES {
        let dir = tmp.path().join(family);
        let run = Command::new(&python)
            .arg(&script)
            .args([
                "--family",
                family,
                "--size",
                "full",
                "--f64",
                "--out",
                s(&dir),
            ])
            .output()
            .expect("run torch_reference.py");
        ok(run, &format!("{family}: torch_reference.py --size full"));
        let worst = Reference::open(dir.clone()).check(tmp.path(), &format!("{family}-full"));
        println!("{family} full size: worst rel err {worst:.2e}");
        // Free the disk before the next family (full checkpoints are large).
        std::fs::remove_dir_all(&dir).unwrap();
        let _ = std::fs::remove_dir_all(tmp.path().join(format!("{family}-full-imported")));
    }
}

/// Full-size ResNet-152 with a bf16 checkpoint (torchvision's model, weights
/// and BatchNorm statistics rounded to bf16; PyTorch computes in f32 with
/// them widened): imported with `--widen`, and kept bf16, whose inference
/// needs the cpu executor to widen on upload (until it does, the kept-bf16
/// half of this test fails where PyTorch is installed).
#[test]
fn full_size_bf16_checkpoint_matches_pytorch_where_it_is_installed() {
    let python = torch_python();
    if let Some(why) = torch_missing(&python) {
        println!(
            "skipped: the full-size bf16 comparison needs PyTorch: {why}; install \
             tests/reference/requirements-torch.txt and set DISTMIND_TORCH_PYTHON"
        );
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/torch_reference.py");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("resnet152-bf16");
    let run = Command::new(&python)
        .arg(&script)
        .args([
            "--family",
            "resnet152",
            "--size",
            "full",
            "--dtype",
            "bf16",
            "--out",
            s(&dir),
        ])
        .output()
        .expect("run torch_reference.py");
    ok(
        run,
        "resnet152: torch_reference.py --size full --dtype bf16",
    );
    let r = Reference::open(dir);
    let widened = r.check_with(tmp.path(), "resnet152-full-bf16-widened", &["--widen"]);
    println!("resnet152 full bf16, widened to f32: worst rel err {widened:.2e}");
    let _ = std::fs::remove_dir_all(tmp.path().join("resnet152-full-bf16-widened-imported"));
    let kept = r.check(tmp.path(), "resnet152-full-bf16");
    println!("resnet152 full bf16, kept bf16: worst rel err {kept:.2e}");
}
