//! Profile estimates, the shipped file, loading and lookup.

use std::path::{Path, PathBuf};

use distmind_models::{BertConfig, Family, Scale};

use super::*;

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

fn rel_err(got: f64, want: f64) -> f64 {
    (got - want).abs() / want
}

/// Regenerates a shipped estimate in memory and compares it byte for byte
/// with the file, keeping the shipped date. With `DISTMIND_WRITE_PROFILES=1`
/// it rewrites the file instead (date from `DISTMIND_PROFILE_DATE`, else the
/// shipped one).
fn check_shipped(rel: &str, build: fn(&str) -> Profile, label: &str) {
    let path = repo_path(rel);
    let shipped = std::fs::read_to_string(&path).ok();
    let shipped_date = shipped
        .as_deref()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok())
        .and_then(|v| v["date"].as_str().map(str::to_string));
    if std::env::var_os("DISTMIND_WRITE_PROFILES").is_some() {
        let date = std::env::var("DISTMIND_PROFILE_DATE")
            .ok()
            .or(shipped_date)
            .expect("set DISTMIND_PROFILE_DATE=YYYY-MM-DD for a first write");
        build(&date).write(&path).unwrap();
        return;
    }
    let shipped = shipped.unwrap_or_else(|| panic!("{} is missing", path.display()));
    let date = shipped_date.expect("shipped profile has a date");
    let regenerated = build(&date).to_json_text();
    assert!(
        regenerated == shipped,
        "{} is stale: the estimator or the models changed. Regenerate it with \
         DISTMIND_WRITE_PROFILES=1 DISTMIND_PROFILE_DATE=$(date -u +%F) \
         cargo test -p distmind-runtime --release shipped_estimated_profile",
        path.display()
    );
    // And it loads, with the label every figure must carry.
    let p = Profile::load(&path).unwrap();
    assert_eq!(p.source, Source::Estimated);
    assert_eq!(p.source_label(), label);
    assert_eq!(p.path(), Some(path.as_path()));
    assert_eq!(p.models.len(), 15);
}

#[test]
fn shipped_estimated_profile_is_current() {
    check_shipped(
        SHIPPED_ESTIMATED_PATH,
        estimated_h200,
        "estimated (NVIDIA H200 peaks)",
    );
}

#[test]
fn shipped_estimated_profile_for_the_v100_is_current() {
    check_shipped(
        SHIPPED_V100_ESTIMATED_PATH,
        estimated_v100,
        "estimated (NVIDIA V100 SXM2 peaks)",
    );
}

#[test]
fn v100_estimate_is_slower_than_the_h200_one() {
    // Same math, lower peaks: every full-scale model takes longer.
    let v = estimated_v100("2026-01-01");
    let h = estimated_h200("2026-01-01");
    for (key, m) in &v.models {
        assert!(m.total_s > h.models[key].total_s, "{key}");
    }
}

#[test]
fn profile_resnet152_full_b8_flops_match_the_literature() {
    // torchvision: 11.5 G multiply-adds per 224x224 image.
    let m = estimate(Family::Resnet152, Scale::Full, 8);
    let want = 8.0 * 2.0 * 11.5e9;
    let got = m.total_flops() as f64;
    assert!(rel_err(got, want) < 0.10, "{got:e} vs {want:e}");
    // Batch 8 is 8 x batch 1 in FLOPs.
    let one = estimate(Family::Resnet152, Scale::Full, 1);
    assert_eq!(m.total_flops(), 8 * one.total_flops());
    assert!(m.total_s > one.total_s);
}

#[test]
fn profile_bert_base_seq512_flops() {
    // Per sequence: 2 x (encoder matmul weights) x 512 tokens + the two
    // attention matmuls of every layer. The brief's rough "2 x 110M x 512"
    // counts the 23.8M embedding params too, which are lookups, not matmuls.
    let c = BertConfig::full();
    let (h, i, l, s) = (
        c.hidden as f64,
        c.intermediate as f64,
        c.layers as f64,
        c.seq_len as f64,
    );
    let encoder_weights = l * (4.0 * h * h + 2.0 * h * i);
    let attention = l * 2.0 * 2.0 * s * s * h; // heads x head_dim = hidden
    let want = 2.0 * encoder_weights * s + attention;
    let m = estimate(Family::BertBase, Scale::Full, 1);
    let got = m.total_flops() as f64;
    assert!(rel_err(got, want) < 0.03, "{got:e} vs {want:e}");
    let rough = 2.0 * 110e6 * s + attention;
    assert!(
        got < rough && got > 0.75 * rough,
        "{got:e} vs rough {rough:e}"
    );
}

#[test]
fn profile_every_layer_present_and_positive() {
    for family in Family::ALL {
        for (scale, batch) in [(Scale::Full, 1), (Scale::Full, 8), (Scale::Tiny, 1)] {
            let arch = family.config(scale).build();
            let m = estimate(family, scale, batch);
            assert_eq!(m.layers.len(), arch.layers.len(), "{family} {scale}");
            for (p, l) in m.layers.iter().zip(&arch.layers) {
                assert_eq!(
                    (p.id, p.name.as_str(), p.op.as_str()),
                    (l.id, l.name.as_str(), l.op.name())
                );
                assert!(
                    p.time_s >= Peaks::H200_ESTIMATED.launch_overhead_s,
                    "{family} {}",
                    p.name
                );
            }
            assert!(m.total_s > 0.0 && m.total_flops() > 0, "{family} {scale}");
            let sum: f64 = m.layers.iter().map(|l| l.time_s).sum();
            assert!((m.total_s - sum).abs() < 1e-9 * m.layers.len() as f64);
        }
    }
}

#[test]
fn profile_full_scale_b8_totals_are_plausible() {
    // Between 1 ms and 200 ms per batch of 8 on an H200 at peak rates.
    for family in Family::ALL {
        let m = estimate(family, Scale::Full, 8);
        assert!(
            m.total_s > 1e-3 && m.total_s < 0.2,
            "{family}: {} s",
            m.total_s
        );
    }
}

#[test]
fn profile_get_interpolates_between_batches() {
    let p = estimated_h200("2026-01-01");
    let exact = p.get(Family::Gpt2, Scale::Full, 8).unwrap();
    assert!(matches!(exact, Cow::Borrowed(_)));
    let b1 = p.get_exact(Family::Gpt2, Scale::Full, 1).unwrap();
    let b8 = p.get_exact(Family::Gpt2, Scale::Full, 8).unwrap();
    // 6 lies 5/7 of the way from 1 to 8, layer by layer.
    let six = p.get(Family::Gpt2, Scale::Full, 6).unwrap();
    assert!(matches!(six, Cow::Owned(_)));
    assert_eq!(six.layers.len(), b8.layers.len());
    let want = b1.total_s + (b8.total_s - b1.total_s) * 5.0 / 7.0;
    assert!(
        rel_err(six.total_s, want) < 1e-9,
        "{} vs {want}",
        six.total_s
    );
    assert!(six.total_s > b1.total_s && six.total_s < b8.total_s);
    // 16 extrapolates along the line through 1 and 8.
    let sixteen = p.get(Family::Gpt2, Scale::Full, 16).unwrap();
    let want = b1.total_s + (b8.total_s - b1.total_s) * 15.0 / 7.0;
    assert!(rel_err(sixteen.total_s, want) < 1e-9);
    for (l16, l8) in sixteen.layers.iter().zip(&b8.layers) {
        assert!(l16.time_s >= l8.time_s, "{}", l16.name);
    }
    // Tiny has only batch 1: larger batches scale it.
    let tiny4 = p.get(Family::BertBase, Scale::Tiny, 4).unwrap();
    let tiny1 = p.get_exact(Family::BertBase, Scale::Tiny, 1).unwrap();
    assert!(rel_err(tiny4.total_s, 4.0 * tiny1.total_s) < 1e-9);
    // Below the smallest batch, the smallest's times are kept.
    let mut no_b1 = p.clone();
    no_b1
        .models
        .retain(|k, _| k != &model_key(Family::Gpt2, Scale::Full, 1));
    let one = no_b1.get(Family::Gpt2, Scale::Full, 1).unwrap();
    assert_eq!(one.total_s, b8.total_s);
    let mut none = p.clone();
    none.models.retain(|k, _| !k.starts_with("gpt2/"));
    assert!(none.get(Family::Gpt2, Scale::Full, 8).is_none());
}

#[test]
fn profile_model_keys_round_trip() {
    assert_eq!(
        model_key(Family::InceptionV3, Scale::Tiny, 1),
        "inception_v3/tiny/b1"
    );
    assert_eq!(
        parse_model_key("densenet201/full/b8"),
        Some((Family::Densenet201, Scale::Full, 8))
    );
    for bad in [
        "densenet201/full/8",
        "densenet201/full/b0",
        "vgg/full/b1",
        "gpt2/full/b1/x",
        "gpt2/huge/b1",
    ] {
        assert_eq!(parse_model_key(bad), None, "{bad}");
    }
}

#[test]
fn profile_measured_label_names_gpu_driver_and_date() {
    let mut p = estimated_h200("2026-11-21");
    p.source = Source::Measured;
    p.driver = Some("560.35.03".into());
    assert_eq!(
        p.source_label(),
        "measured on NVIDIA H200, driver 560.35.03, 2026-11-21"
    );
}

fn load_err(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    let e = Profile::load(&path).expect_err(name).to_string();
    assert!(e.contains(&path.display().to_string()), "{e}");
    e
}

#[test]
fn profile_load_errors_name_the_file_and_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.json");
    let e = Profile::load(&missing).unwrap_err();
    assert!(matches!(e, ProfileError::Read { .. }), "{e}");
    assert!(e.to_string().contains("missing.json"), "{e}");

    let e = load_err(dir.path(), "garbage.json", "{ not json");
    assert!(e.contains("line 1"), "{e}");

    let good = estimated_h200("2026-11-21");
    let text = good.to_json_text();
    // It round-trips through a file.
    let path = dir.path().join("good.json");
    good.write(&path).unwrap();
    let loaded = Profile::load(&path).unwrap();
    assert_eq!(
        loaded.models.keys().collect::<Vec<_>>(),
        good.models.keys().collect::<Vec<_>>()
    );
    for (a, b) in loaded.models.values().zip(good.models.values()) {
        assert_eq!(a.layers.len(), b.layers.len());
        assert!((a.total_s - b.total_s).abs() < 1e-12);
    }

    let e = load_err(
        dir.path(),
        "v2.json",
        &text.replacen("\"format_version\": 1", "\"format_version\": 2", 1),
    );
    assert!(e.contains("format_version 2"), "{e}");

    let e = load_err(
        dir.path(),
        "key.json",
        &text.replacen("\"bert_base/full/b1\"", "\"bert/full/b1\"", 1),
    );
    assert!(e.contains("\"bert/full/b1\""), "{e}");

    let e = load_err(
        dir.path(),
        "peak.json",
        &text.replacen(
            "\"h2d_bytes_per_s\": 50000000000.0",
            "\"h2d_bytes_per_s\": 0.0",
            1,
        ),
    );
    assert!(e.contains("peaks.h2d_bytes_per_s"), "{e}");

    let e = load_err(
        dir.path(),
        "nopeak.json",
        &text.replacen("\"h2d_bytes_per_s\": 50000000000.0,", "", 1),
    );
    assert!(e.contains("h2d_bytes_per_s"), "{e}");

    let total = serde_json::to_string(&good.models["bert_base/full/b1"].total_s).unwrap();
    let e = load_err(
        dir.path(),
        "total.json",
        &text.replacen(&format!("\"total_s\": {total}"), "\"total_s\": 1.5", 1),
    );
    assert!(
        e.contains("bert_base/full/b1") && e.contains("total_s"),
        "{e}"
    );

    let e = load_err(
        dir.path(),
        "negative.json",
        &text.replacen("\"time_s\":", "\"time_s\":-", 1),
    );
    assert!(e.contains("time_s"), "{e}");

    let e = load_err(
        dir.path(),
        "id.json",
        &text.replacen("{\"id\":1,", "{\"id\":7,", 1),
    );
    assert!(e.contains("has id 7"), "{e}");
}

fn layer(id: usize, op: &str, time_s: f64) -> LayerProfile {
    LayerProfile {
        id,
        name: format!("l{id}"),
        op: op.into(),
        flops: 1000,
        bytes: 400,
        time_s,
    }
}

/// Token scaling: the launch overhead stays, the rest scales with the
/// tokens (attention with their square), never below a layer's floor.
#[test]
fn layer_times_scale_with_the_tokens() {
    let o = 5e-6;
    let m = ModelProfile {
        total_s: 0.0,
        layers: vec![
            layer(0, "linear", o + 40e-6),
            layer(1, "attention", o + 32e-6),
            layer(2, "layer_norm", o + 8e-6),
        ],
    };
    let floors = [0.0, 0.0, o + 4e-6];
    let quarter = m.at_seq_len(512, 128, o, &floors);
    let t: Vec<f64> = quarter.layers.iter().map(|l| l.time_s).collect();
    assert!(rel_err(t[0], o + 10e-6) < 1e-12, "{t:?}");
    assert!(rel_err(t[1], o + 2e-6) < 1e-12, "attention: 1/16: {t:?}");
    assert!(rel_err(t[2], o + 4e-6) < 1e-12, "the floor: {t:?}");
    assert_eq!(quarter.layers[0].flops, 250);
    assert_eq!(quarter.layers[1].flops, 63, "1000 / 16, rounded");
    assert!(rel_err(quarter.total_s, t.iter().sum()) < 1e-12);
    let double = m.at_seq_len(512, 1024, o, &floors);
    assert!(rel_err(double.layers[0].time_s, o + 80e-6) < 1e-12);
    assert!(rel_err(double.layers[1].time_s, o + 128e-6) < 1e-12);
    // The profiled length gives the profile back.
    let same = m.at_seq_len(512, 512, o, &floors);
    for (a, b) in same.layers.iter().zip(&m.layers) {
        assert!(rel_err(a.time_s, b.time_s) < 1e-12);
    }
}

/// How far scaling the profiled length's times lands from the roofline
/// estimate made at the request's length (both estimates; the scaled one
/// is what the sim executor uses for a profile it cannot re-estimate, such
/// as a measured one). Printed with `--nocapture`; measured within 4%
/// (0.96 to 1.03), asserted within 1.25x either way.
#[test]
fn token_scaling_stays_near_the_roofline_at_other_lengths() {
    let peaks = Peaks::H200_ESTIMATED;
    for family in [Family::BertBase, Family::Gpt2] {
        let full = family.config(Scale::Full);
        let profiled = profiled_seq_len(family, Scale::Full).unwrap();
        assert_eq!(profiled, 512);
        let base = estimate_config(&full, &peaks);
        let arch = full.build();
        let mut floors = vec![peaks.launch_overhead_s; arch.layers.len()];
        for l in &arch.layers {
            for p in &l.params {
                let numel: usize = arch
                    .params
                    .iter()
                    .find(|d| &d.name == p)
                    .map(|d| d.shape.iter().product())
                    .unwrap();
                floors[l.id] += 4.0 * numel as f64 / peaks.memory_bytes_per_s;
            }
        }
        for len in [16, 64, 128, 1024] {
            if len
                > family.config(Scale::Full).build().inputs[0].variable[1]
                    .max
                    .unwrap()
            {
                continue;
            }
            let scaled = base.at_seq_len(profiled, len, peaks.launch_overhead_s, &floors);
            let roofline = estimate_config(&full.clone().with_seq_len(len), &peaks);
            let ratio = scaled.total_s / roofline.total_s;
            println!(
                "{family} full b8 L={len}: scaled {:.3} ms, roofline at L {:.3} ms, ratio {ratio:.3}",
                scaled.total_s * 1e3,
                roofline.total_s * 1e3
            );
            assert!((0.8..=1.25).contains(&ratio), "{family} L={len}: {ratio}");
        }
    }
}

/// Every measured profile shipped in settings/profiles/ loads, says where,
/// on what and when it was measured, and covers what the estimates cover
/// (the five families at full scale, batches 1 and 8, and tiny batch 1) with
/// layers that match the families' graphs (names, FLOPs and bytes).
#[test]
fn shipped_measured_profiles_load_and_cover_the_families() {
    let dir = repo_path("settings/profiles");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !name.contains("-measured-") || !name.ends_with(".json") {
            continue;
        }
        seen += 1;
        let p = Profile::load(&path).unwrap();
        assert_eq!(p.source, Source::Measured, "{name}");
        assert!(p.driver.is_some(), "{name}: no driver version");
        assert!(name.contains(&p.date), "{name}: dated {}", p.date);
        assert!(p.method.contains("distmind profile measure"), "{name}");
        for family in Family::ALL {
            for (scale, batch) in [(Scale::Full, 1), (Scale::Full, 8), (Scale::Tiny, 1)] {
                let m = p
                    .get_exact(family, scale, batch)
                    .unwrap_or_else(|| panic!("{name}: no {}", model_key(family, scale, batch)));
                let graph = estimate(family, scale, batch);
                assert_eq!(m.layers.len(), graph.layers.len(), "{name}");
                for (a, b) in m.layers.iter().zip(&graph.layers) {
                    assert_eq!((&a.name, a.flops, a.bytes), (&b.name, b.flops, b.bytes));
                }
            }
        }
    }
    assert!(seen >= 1, "no measured profile in {}", dir.display());
}
