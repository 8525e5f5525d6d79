//! Unit tests over all families: counts, graphs, layouts, packages.

use std::collections::HashMap;
use std::path::Path;

use crate::config::{Family, Scale};
use crate::graph::{Architecture, Dtype};
use crate::layout::{align_up, plan};
use crate::package::{Package, MANIFEST_FILE, WEIGHTS_FILE};
use crate::{generate, inspect, shape, GenOptions, ModelError, ParamDtype};

const SCALES: [Scale; 2] = [Scale::Full, Scale::Tiny];

fn tiny_opts(family: Family, dir: &Path) -> GenOptions {
    GenOptions {
        family,
        variants: 1,
        out_dir: dir.to_path_buf(),
        scale: Scale::Tiny,
        seed: 7,
        group_bytes: 4096,
        dtype: ParamDtype::F32,
    }
}

fn open_err(dir: &Path) -> ModelError {
    match Package::open(dir) {
        Ok(_) => panic!("{} opened despite the damage", dir.display()),
        Err(e) => e,
    }
}

fn stored_bytes(arch: &Architecture) -> u64 {
    arch.params
        .iter()
        .map(|p| align_up(p.numel() as u64 * 4, 512))
        .sum()
}

#[test]
fn learnable_counts_match_the_frameworks() {
    let want = [
        (Family::Resnet152, 60_192_808),
        (Family::InceptionV3, 23_834_568),
        (Family::Densenet201, 20_013_928),
        (Family::BertBase, 109_482_240),
        (Family::Gpt2, 124_439_808),
    ];
    for (family, count) in want {
        assert_eq!(family.learnable_params(Scale::Full), count, "{family}");
    }
}

#[test]
fn stored_sizes_are_near_the_originals() {
    let want_mb = [
        (Family::Resnet152, 241.4),
        (Family::InceptionV3, 95.6),
        (Family::Densenet201, 81.0),
        (Family::BertBase, 437.9),
        (Family::Gpt2, 497.8),
    ];
    for (family, mb) in want_mb {
        let got = stored_bytes(&family.config(Scale::Full).build()) as f64 / 1e6;
        eprintln!("{family}: {got:.1} MB stored");
        assert!(
            (got - mb).abs() / mb < 0.01,
            "{family}: {got:.1} MB, original {mb} MB"
        );
    }
}

#[test]
fn tiny_models_are_small() {
    for family in Family::ALL {
        let bytes = stored_bytes(&family.config(Scale::Tiny).build());
        eprintln!("{family} tiny: {bytes} bytes");
        assert!(bytes < 2_000_000, "{family} tiny is {bytes} bytes");
    }
}

#[test]
fn family_names_round_trip() {
    for family in Family::ALL {
        assert_eq!(family.to_string().parse::<Family>().unwrap(), family);
    }
    assert_eq!("tiny".parse::<Scale>().unwrap(), Scale::Tiny);
    let err = "resnet50".parse::<Family>().unwrap_err().to_string();
    assert!(
        err.contains("resnet50") && err.contains("inception_v3"),
        "{err}"
    );
}

#[test]
fn shapes_infer_for_every_family_and_scale() {
    for family in Family::ALL {
        for scale in SCALES {
            let arch = family.config(scale).build();
            let by_name: HashMap<&str, &[usize]> = arch
                .params
                .iter()
                .map(|p| (p.name.as_str(), p.shape.as_slice()))
                .collect();
            assert_eq!(
                by_name.len(),
                arch.params.len(),
                "{family} {scale}: duplicate param names"
            );
            let shapes = shape::infer(&arch.layers, &arch.inputs, |n| by_name.get(n).copied())
                .unwrap_or_else(|(l, e)| {
                    panic!("{family} {scale}: layer {l} ({}): {e}", arch.layers[l].name)
                });
            let n = arch.inputs[0].shape[0];
            let last = shapes.last().unwrap();
            match family {
                Family::BertBase | Family::Gpt2 => {
                    let l = arch.inputs[0].shape[1];
                    assert_eq!(arch.inputs[0].dtype, Dtype::I64);
                    let hidden = &arch.outputs[0];
                    assert_eq!(hidden.name, "last_hidden_state");
                    assert_eq!(shapes[hidden.layer].dims, vec![n, l, hidden.shape[2]]);
                }
                _ => assert_eq!(last.dims, vec![n, 1000], "{family} {scale}"),
            }
            for o in &arch.outputs {
                assert_eq!(
                    shapes[o.layer].dims, o.shape,
                    "{family} {scale} output {}",
                    o.name
                );
            }
            assert_eq!(arch.outputs.last().unwrap().layer, arch.layers.len() - 1);
            // Every param is used by exactly one layer; layer names are unique.
            let mut uses: HashMap<&str, usize> = HashMap::new();
            for l in &arch.layers {
                for p in &l.params {
                    *uses.entry(p.as_str()).or_default() += 1;
                }
            }
            for p in &arch.params {
                assert_eq!(
                    uses.get(p.name.as_str()),
                    Some(&1),
                    "{family} {scale}: {}",
                    p.name
                );
            }
            assert_eq!(uses.len(), arch.params.len());
            let mut names: Vec<&str> = arch.layers.iter().map(|l| l.name.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(
                names.len(),
                arch.layers.len(),
                "{family} {scale}: duplicate layer names"
            );
        }
    }
}

#[test]
fn cnn_input_specs() {
    let spec = |f: Family, s: Scale| f.config(s).build().inputs[0].shape.clone();
    assert_eq!(spec(Family::Resnet152, Scale::Full), vec![8, 3, 224, 224]);
    assert_eq!(spec(Family::InceptionV3, Scale::Full), vec![8, 3, 299, 299]);
    assert_eq!(spec(Family::Densenet201, Scale::Tiny), vec![1, 3, 32, 32]);
    assert_eq!(spec(Family::InceptionV3, Scale::Tiny), vec![1, 3, 75, 75]);
    assert_eq!(spec(Family::Gpt2, Scale::Full), vec![8, 512]);
    assert_eq!(spec(Family::BertBase, Scale::Tiny), vec![1, 16]);
}

fn layout_for(arch: &Architecture, group_bytes: u64) -> crate::layout::Layout {
    let index: HashMap<&str, (usize, u64)> = arch
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), (i, p.numel() as u64 * 4)))
        .collect();
    plan(
        &arch.layers,
        arch.params.len(),
        |n| index.get(n).copied(),
        group_bytes,
        512,
    )
    .unwrap()
}

#[test]
fn groups_respect_the_size_rule_and_alignment() {
    for family in Family::ALL {
        let arch = family.config(Scale::Full).build();
        for group_bytes in [1, 1 << 20, 32_768_000, u64::MAX / 4] {
            let layout = layout_for(&arch, group_bytes);
            let mut end = 0;
            for (g, plan) in layout.groups.iter().enumerate() {
                assert_eq!(plan.offset, end, "{family}: group {g} not contiguous");
                end += plan.bytes;
                assert_eq!(plan.bytes % 512, 0);
                let one_layer = plan.first_layer == plan.last_layer;
                assert!(
                    plan.bytes <= group_bytes || one_layer,
                    "{family}: group {g} too big"
                );
            }
            for p in &layout.placements {
                assert_eq!(p.offset % 512, 0);
            }
            let with_params = arch.layers.iter().filter(|l| !l.params.is_empty()).count();
            if group_bytes == 1 {
                assert_eq!(
                    layout.groups.len(),
                    with_params,
                    "{family}: one group per layer"
                );
            }
            if group_bytes == u64::MAX / 4 {
                assert_eq!(layout.groups.len(), 1, "{family}: one group");
            }
            // Greedy: a group followed by another could not take its first layer.
            for w in layout.groups.windows(2) {
                let next_first: u64 = arch.layers[w[1].first_layer]
                    .params
                    .iter()
                    .map(|n| {
                        let p = arch.params.iter().find(|p| &p.name == n).unwrap();
                        align_up(p.numel() as u64 * 4, 512)
                    })
                    .sum();
                assert!(w[0].bytes + next_first > group_bytes);
            }
        }
    }
}

#[test]
fn every_tiny_family_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    for family in Family::ALL {
        let dirs = generate(&tiny_opts(family, dir.path())).unwrap();
        assert_eq!(
            dirs,
            vec![dir.path().join(format!("{family}-tiny-00000000"))]
        );
        let pkg = Package::open(&dirs[0]).unwrap();
        pkg.verify().unwrap();
        let m = &pkg.manifest;
        assert_eq!(m.family, family);
        assert_eq!(
            m.learnable_param_count,
            family.learnable_params(Scale::Tiny)
        );
        assert!(
            m.groups.len() > 1,
            "{family}: 4096-byte groups should give several"
        );
        let packed = pkg.packed().unwrap();
        assert_eq!(
            packed.iter().map(|g| g.len() as u64).sum::<u64>(),
            m.stored_bytes
        );
        // Packed bytes hold each param at its offset, matching the safetensors data.
        for p in m.params.iter().take(5) {
            let bytes = pkg.param_bytes(&p.name).unwrap();
            let g = &packed[p.group];
            assert_eq!(
                &g[p.offset as usize..(p.offset + p.nbytes) as usize],
                &bytes[..]
            );
        }
        let text = inspect(&pkg);
        assert!(text.contains(&m.layers[0].name) && text.contains(&m.groups[0].checksum));
        let input = format!(
            "input  {}: {}, default {:?}",
            m.inputs[0].name,
            m.inputs[0].expected(),
            m.inputs[0].shape
        );
        assert!(text.contains(&input), "{text}");
        // The weights file is standard safetensors.
        let raw = std::fs::read(dirs[0].join(WEIGHTS_FILE)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
        assert_eq!(st.len(), m.params.len());
    }
}

#[test]
fn group_size_extremes() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = tiny_opts(Family::Resnet152, dir.path());
    opts.group_bytes = 1;
    let pkg = Package::open(&generate(&opts).unwrap()[0]).unwrap();
    let with_params = pkg
        .manifest
        .layers
        .iter()
        .filter(|l| !l.params.is_empty())
        .count();
    assert_eq!(pkg.group_count(), with_params);
    opts.group_bytes = 1 << 40;
    let pkg = Package::open(&generate(&opts).unwrap()[0]).unwrap();
    assert_eq!(pkg.group_count(), 1);
    pkg.verify().unwrap();
}

#[test]
fn variants_differ_and_are_deterministic() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let mut opts = tiny_opts(Family::Gpt2, a.path());
    opts.variants = 2;
    let da = generate(&opts).unwrap();
    opts.out_dir = b.path().to_path_buf();
    let db = generate(&opts).unwrap();
    let sums = |d: &Path| -> Vec<String> {
        let p = Package::open(d).unwrap();
        p.manifest
            .groups
            .iter()
            .map(|g| g.checksum.clone())
            .collect()
    };
    assert_eq!(da[1].file_name().unwrap(), "gpt2-tiny-00000001");
    assert_ne!(sums(&da[0]), sums(&da[1]));
    assert_eq!(sums(&da[0]), sums(&db[0]));
    let full = crate::variant_name(Family::Resnet152, Scale::Full, 3);
    assert_eq!(full, "resnet152-alter-1-00000003");
}

#[test]
fn corrupted_weights_are_detected() {
    let dir = tempfile::tempdir().unwrap();
    let pkg_dir = generate(&tiny_opts(Family::BertBase, dir.path()))
        .unwrap()
        .remove(0);
    let weights = pkg_dir.join(WEIGHTS_FILE);
    let mut raw = std::fs::read(&weights).unwrap();
    let last = raw.len() - 3;
    raw[last] ^= 0x40;
    std::fs::write(&weights, &raw).unwrap();
    let err = Package::open(&pkg_dir).unwrap().verify().unwrap_err();
    assert!(matches!(err, ModelError::Checksum { .. }), "{err}");
    assert!(err.to_string().contains("weights.safetensors"), "{err}");
    // Truncated.
    std::fs::write(&weights, &raw[..raw.len() - 100]).unwrap();
    let err = open_err(&pkg_dir);
    assert!(matches!(err, ModelError::BadWeights { .. }), "{err}");
    assert!(err.to_string().contains("weights.safetensors"), "{err}");
    // Missing.
    std::fs::remove_file(&weights).unwrap();
    let err = open_err(&pkg_dir);
    assert!(err.to_string().contains("weights.safetensors"), "{err}");
}

#[test]
fn corrupted_manifests_are_detected() {
    let dir = tempfile::tempdir().unwrap();
    let pkg_dir = generate(&tiny_opts(Family::Densenet201, dir.path()))
        .unwrap()
        .remove(0);
    let path = pkg_dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    let err = open_err(&pkg_dir);
    assert!(matches!(err, ModelError::ManifestParse { .. }), "{err}");
    assert!(err.to_string().contains("manifest.json"), "{err}");
    // Valid JSON, wrong layout.
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["params"][2]["offset"] = serde_json::json!(0);
    std::fs::write(&path, m.to_string()).unwrap();
    let err = open_err(&pkg_dir);
    assert!(matches!(err, ModelError::BadManifest { .. }), "{err}");
    assert!(err.to_string().contains("manifest.json"), "{err}");
    // Wrong shape in a layer attribute.
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["layers"][0]["attrs"]["out_channels"] = serde_json::json!(9);
    std::fs::write(&path, m.to_string()).unwrap();
    let err = open_err(&pkg_dir).to_string();
    assert!(err.contains("features.conv0"), "{err}");
}

/// Half-precision packages: the f32 package's values rounded to nearest,
/// half the value bytes, one storage dtype checked everywhere.
#[test]
fn half_precision_packages_hold_the_rounded_f32_values() {
    let dir = tempfile::tempdir().unwrap();
    for family in [Family::Resnet152, Family::Gpt2] {
        let f32_opts = tiny_opts(family, &dir.path().join("f32"));
        let f32_pkg = Package::open(&generate(&f32_opts).unwrap()[0]).unwrap();
        for dtype in [ParamDtype::F16, ParamDtype::BF16] {
            let opts = GenOptions {
                out_dir: dir.path().join(dtype.as_str()),
                dtype,
                ..f32_opts.clone()
            };
            let pkg = Package::open(&generate(&opts).unwrap()[0]).unwrap();
            pkg.verify().unwrap();
            let m = &pkg.manifest;
            assert_eq!(m.param_dtype, dtype);
            assert_eq!(
                m.learnable_param_count,
                f32_pkg.manifest.learnable_param_count
            );
            let value_bytes = |m: &crate::Manifest| m.params.iter().map(|p| p.nbytes).sum::<u64>();
            assert_eq!(
                2 * value_bytes(m),
                value_bytes(&f32_pkg.manifest),
                "{family} {dtype}"
            );
            assert!(m.stored_bytes < f32_pkg.manifest.stored_bytes);
            println!(
                "{family} tiny {dtype}: {} stored bytes, f32 {} (ratio {:.3}; padding to 512 \
                 bytes keeps small params from halving)",
                m.stored_bytes,
                f32_pkg.manifest.stored_bytes,
                m.stored_bytes as f64 / f32_pkg.manifest.stored_bytes as f64
            );
            // The weights file is standard safetensors in the storage dtype.
            let raw = std::fs::read(pkg.dir.join(WEIGHTS_FILE)).unwrap();
            let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
            let want = match dtype {
                ParamDtype::F16 => safetensors::Dtype::F16,
                _ => safetensors::Dtype::BF16,
            };
            assert!(st.tensors().iter().all(|(_, v)| v.dtype() == want));
            for p in &m.params {
                let exact = f32_pkg.param_f32(&p.name).unwrap();
                let mut rounded = Vec::new();
                for v in &exact {
                    dtype.push_narrowed(*v, &mut rounded);
                }
                assert_eq!(pkg.param_bytes(&p.name).unwrap(), rounded, "{}", p.name);
            }
            assert!(
                inspect(&pkg).contains(&format!("stored bytes as {}", dtype.safetensors_name()))
            );
        }
    }
}

/// The device layout of a half package is its stored layout doubled, and
/// widening a whole stored group gives the device group: every param's f32
/// values at its device offset, zeros in the padding.
#[test]
fn widening_a_stored_group_gives_the_device_group() {
    let dir = tempfile::tempdir().unwrap();
    let opts = GenOptions {
        dtype: ParamDtype::BF16,
        ..tiny_opts(Family::InceptionV3, dir.path())
    };
    let pkg = Package::open(&generate(&opts).unwrap()[0]).unwrap();
    let m = &pkg.manifest;
    assert_eq!(m.widen_factor(), 2);
    assert_eq!(m.device_bytes(), 2 * m.stored_bytes);
    let mut device_total = 0;
    for (g, entry) in m.groups.iter().enumerate() {
        assert_eq!(entry.device_offset(m.param_dtype), device_total);
        device_total += entry.device_bytes(m.param_dtype);
        let stored = pkg.group_bytes(g).unwrap();
        let mut device = vec![0u8; entry.device_bytes(m.param_dtype) as usize];
        crate::dtype::widen_to_le_bytes(m.param_dtype, &stored, &mut device);
        let mut covered = vec![false; device.len()];
        for p in m.group_params(g) {
            let (off, len) = (
                p.device_offset(m.param_dtype),
                p.device_nbytes(m.param_dtype),
            );
            assert_eq!(off % m.alignment, 0, "{}: device offset {off}", p.name);
            assert_eq!(len, 4 * p.numel(), "{}", p.name);
            assert_eq!(
                m.device_param_offset(p),
                entry.device_offset(m.param_dtype) + off
            );
            let values: Vec<f32> = device[off as usize..(off + len) as usize]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(values, pkg.param_f32(&p.name).unwrap(), "{}", p.name);
            covered[off as usize..(off + len) as usize].fill(true);
        }
        assert!(
            device.iter().zip(&covered).all(|(b, c)| *c || *b == 0),
            "group {g}: padding must widen to zeros"
        );
    }
    assert_eq!(device_total, m.device_bytes());
    // An f32 package's device layout is its stored layout.
    let f32_pkg = Package::open(
        &generate(&tiny_opts(Family::InceptionV3, &dir.path().join("f"))).unwrap()[0],
    )
    .unwrap();
    assert_eq!(
        f32_pkg.manifest.device_bytes(),
        f32_pkg.manifest.stored_bytes
    );
}

/// `Package::open` checks sizes against the storage dtype and names the
/// param; a manifest without `param_dtype` (written before half precision)
/// opens as f32.
#[test]
fn the_storage_dtype_is_validated() {
    let dir = tempfile::tempdir().unwrap();
    let f32_dir = generate(&tiny_opts(Family::Resnet152, &dir.path().join("a")))
        .unwrap()
        .remove(0);
    let path = f32_dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(m["param_dtype"], "F32");
    m.as_object_mut().unwrap().remove("param_dtype");
    std::fs::write(&path, m.to_string()).unwrap();
    let old = Package::open(&f32_dir).unwrap();
    assert_eq!(old.manifest.param_dtype, ParamDtype::F32);
    old.verify().unwrap();
    // An f32 manifest claiming bf16: the sizes name the first param.
    m["param_dtype"] = serde_json::json!("BF16");
    std::fs::write(&path, m.to_string()).unwrap();
    let err = open_err(&f32_dir).to_string();
    assert!(
        err.contains("param conv1.weight has nbytes") && err.contains("stored as BF16"),
        "{err}"
    );
    // A bf16 manifest over an f16 weights file: the tensor is named.
    let bf16_dir = generate(&GenOptions {
        dtype: ParamDtype::BF16,
        ..tiny_opts(Family::Resnet152, &dir.path().join("b"))
    })
    .unwrap()
    .remove(0);
    let f16_dir = generate(&GenOptions {
        dtype: ParamDtype::F16,
        ..tiny_opts(Family::Resnet152, &dir.path().join("c"))
    })
    .unwrap()
    .remove(0);
    std::fs::copy(f16_dir.join(WEIGHTS_FILE), bf16_dir.join(WEIGHTS_FILE)).unwrap();
    let err = open_err(&bf16_dir);
    assert!(matches!(err, ModelError::BadWeights { .. }), "{err}");
    assert!(err.to_string().contains("is F16"), "{err}");
    assert!(err.to_string().contains("expected BF16"), "{err}");
    let err = "double".parse::<ParamDtype>().unwrap_err().to_string();
    assert!(err.contains("f32, f16 or bf16"), "{err}");
}

#[test]
fn manifest_layers_use_op_and_attrs_keys() {
    let arch = Family::Gpt2.config(Scale::Tiny).build();
    let v = serde_json::to_value(&arch.layers).unwrap();
    let attn = v
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["op"] == "attention")
        .unwrap();
    assert_eq!(attn["attrs"]["causal"], true);
    assert_eq!(attn["inputs"].as_array().unwrap().len(), 1);
    let relu =
        serde_json::to_value(&Family::Resnet152.config(Scale::Tiny).build().layers[2]).unwrap();
    assert_eq!(relu["op"], "relu");
    let back: crate::Layer = serde_json::from_value(relu).unwrap();
    assert_eq!(back.op, crate::Op::Relu);
}

/// Full-scale packages: slow unoptimised, so release builds only
/// (`cargo test --release -p distmind-models`).
#[cfg(not(debug_assertions))]
#[test]
fn full_scale_packages_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    for family in Family::ALL {
        let mut opts = GenOptions::new(family, dir.path());
        opts.seed = 1;
        let t = std::time::Instant::now();
        let d = generate(&opts).unwrap().remove(0);
        let gen_s = t.elapsed().as_secs_f64();
        let pkg = Package::open(&d).unwrap();
        pkg.verify().unwrap();
        eprintln!(
            "{family}: {} bytes stored, {} groups, generated in {gen_s:.2}s",
            pkg.manifest.stored_bytes,
            pkg.group_count()
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}

/// Requests choose the batch of every input and the length of token
/// inputs up to the position table: the manifest says so, checks shapes
/// against it, reports -1 for those dimensions and infers output shapes.
#[test]
fn inputs_state_which_dimensions_requests_choose() {
    let dir = tempfile::tempdir().unwrap();
    for family in [Family::BertBase, Family::Gpt2] {
        let pkg =
            Package::open(generate(&tiny_opts(family, dir.path())).unwrap().remove(0)).unwrap();
        let m = &pkg.manifest;
        let spec = &m.inputs[0];
        assert_eq!(spec.shape, [1, 16], "{family}: the default shape");
        assert_eq!(spec.protocol_shape(), [-1, -1], "{family}");
        assert_eq!(
            spec.expected(),
            "i64 [batch, tokens] (batch >= 1, tokens 1..=64)"
        );
        for ok in [[1usize, 1], [3, 16], [2, 64]] {
            m.check_input_shapes(&[&ok]).unwrap();
        }
        let too_long = m.check_input_shapes(&[&[1, 65]]).unwrap_err();
        assert!(
            too_long.contains(&m.name)
                && too_long.contains("[1, 65]")
                && too_long.contains("tokens 1..=64")
                && too_long.contains("more than the model's 64"),
            "{too_long}"
        );
        let rank = m.check_input_shapes(&[&[16]]).unwrap_err();
        assert!(rank.contains("1 dimensions instead of 2"), "{rank}");
        assert!(m
            .check_input_shapes(&[&[0, 16]])
            .unwrap_err()
            .contains("(batch) is 0"));
        // Output shapes follow the request's; metadata reports them as -1.
        let out = m.output_shapes(&[&[3, 40]]).unwrap();
        let protocol = m.output_protocol_shapes();
        match family {
            Family::Gpt2 => {
                assert_eq!(out, vec![vec![3, 40, 32]]);
                assert_eq!(protocol, vec![vec![-1, -1, 32]]);
            }
            _ => {
                assert_eq!(out, vec![vec![3, 40, 32], vec![3, 32]]);
                assert_eq!(protocol, vec![vec![-1, -1, 32], vec![-1, 32]]);
            }
        }
    }
    let pkg = Package::open(
        generate(&tiny_opts(Family::Resnet152, dir.path()))
            .unwrap()
            .remove(0),
    )
    .unwrap();
    let m = &pkg.manifest;
    assert_eq!(m.inputs[0].protocol_shape(), [-1, 3, 32, 32]);
    assert_eq!(m.output_protocol_shapes(), vec![vec![-1, 1000]]);
    m.check_input_shapes(&[&[5, 3, 32, 32]]).unwrap();
    let e = m.check_input_shapes(&[&[1, 3, 64, 64]]).unwrap_err();
    assert!(
        e.contains("f32 [batch, 3, 32, 32] (batch >= 1)")
            && e.contains("dimension 2 is 64, the model's is 32"),
        "{e}"
    );
}

/// A manifest written before inputs stated their variable dimensions
/// serves any batch at its one length; a declared bound beyond the
/// position table is refused when the package opens.
#[test]
fn variable_dimensions_default_to_the_batch_and_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let pkg_dir = generate(&tiny_opts(Family::Gpt2, dir.path()))
        .unwrap()
        .remove(0);
    let path = pkg_dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["inputs"][0].as_object_mut().unwrap().remove("variable");
    std::fs::write(&path, m.to_string()).unwrap();
    let old = Package::open(&pkg_dir).unwrap();
    assert_eq!(old.manifest.inputs[0].protocol_shape(), [-1, 16]);
    assert!(old.manifest.check_input_shapes(&[&[1, 17]]).is_err());
    old.manifest.check_input_shapes(&[&[4, 16]]).unwrap();

    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["inputs"][0]["variable"][1]["max"] = serde_json::json!(65);
    std::fs::write(&path, m.to_string()).unwrap();
    let err = open_err(&pkg_dir).to_string();
    assert!(
        err.contains("largest shapes") && err.contains("longer than 64 positions"),
        "{err}"
    );
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["inputs"][0]["variable"][1]["dim"] = serde_json::json!(2);
    std::fs::write(&path, m.to_string()).unwrap();
    let err = open_err(&pkg_dir).to_string();
    assert!(err.contains("variable dimension 2 outside"), "{err}");
}

/// The default length is not part of the architecture: a transformer at
/// another length is still its preset (the profiles cover it, scaled).
#[test]
fn the_default_length_does_not_change_the_preset() {
    for family in [Family::BertBase, Family::Gpt2] {
        let c = family
            .config(Scale::Full)
            .with_seq_len(128)
            .with_batch_size(2);
        assert_eq!(c.preset(), Some(Scale::Full));
        assert_eq!(c.seq_len(), Some(128));
    }
    assert_eq!(Family::Resnet152.config(Scale::Tiny).seq_len(), None);
}
