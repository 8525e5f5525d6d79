//! `distmind model inspect`: a readable view of a package.

use std::fmt::Write;

use crate::package::Package;

/// A table of layers (id, name, op, params, bytes, group) and groups
/// (index, bytes, layers, checksum), plus totals.
pub fn inspect(pkg: &Package) -> String {
    let m = &pkg.manifest;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model {} (family {}, scale {}, seed {})",
        m.name,
        m.family,
        m.scale.map_or("custom (imported config)", |s| s.as_str()),
        m.seed.map_or("none".to_string(), |v| v.to_string())
    );
    if let Some(o) = &m.origin {
        let _ = writeln!(
            s,
            "imported from {} ({}); hyper-parameters from {}",
            o.checkpoint,
            o.checkpoint_dtypes.join(" + "),
            o.config_source
        );
        if o.converted_to_f32 {
            let _ = writeln!(
                s,
                "stored as F32: the half-precision values were widened exactly at import"
            );
        }
        if !o.stripped_prefix.is_empty() {
            let _ = writeln!(s, "key prefix `{}` stripped", o.stripped_prefix);
        }
        if !o.dropped.is_empty() {
            let shown: Vec<&str> = o.dropped.iter().take(3).map(String::as_str).collect();
            let _ = writeln!(
                s,
                "{} checkpoint tensors not used by inference left out ({}{})",
                o.dropped.len(),
                shown.join(", "),
                if o.dropped.len() > 3 { ", ..." } else { "" }
            );
        }
    }
    for i in &m.inputs {
        // What a request may send, then the default shape profiles time.
        let _ = writeln!(
            s,
            "input  {}: {}, default {:?}",
            i.name,
            i.expected(),
            i.shape
        );
    }
    for o in &m.outputs {
        let _ = writeln!(
            s,
            "output {}: {:?} {:?} (layer {})",
            o.name, o.dtype, o.shape, o.layer
        );
    }
    let _ = writeln!(
        s,
        "\n{:>5}  {:<48} {:<20} {:>12} {:>12} {:>6}",
        "id", "layer", "op", "params", "bytes", "group"
    );
    for l in &m.layers {
        let params = m.params.iter().filter(|p| p.layer == l.id);
        let (count, bytes) = params.fold((0u64, 0u64), |(c, b), p| (c + p.numel(), b + p.nbytes));
        let group = l.group.map_or("-".to_string(), |g| g.to_string());
        let _ = writeln!(
            s,
            "{:>5}  {:<48} {:<20} {:>12} {:>12} {:>6}",
            l.id,
            l.name,
            l.op.name(),
            count,
            bytes,
            group
        );
    }
    let _ = writeln!(
        s,
        "\n{:>5}  {:>12} {:>12}  {:<12} {:<16}",
        "group", "offset", "bytes", "layers", "checksum"
    );
    for g in &m.groups {
        let layers = format!("{}..{}", g.first_layer, g.last_layer);
        let _ = writeln!(
            s,
            "{:>5}  {:>12} {:>12}  {:<12} {}",
            g.index, g.offset, g.bytes, layers, g.checksum
        );
    }
    let all: u64 = m.params.iter().map(|p| p.numel()).sum();
    let _ = writeln!(
        s,
        "\ntotal: {} layers, {} params ({} values, {} learnable), {} groups, {} stored bytes as {} \
         ({} on a device as f32; group_bytes {}, alignment {})",
        m.layers.len(),
        m.params.len(),
        all,
        m.learnable_param_count,
        m.groups.len(),
        m.stored_bytes,
        m.param_dtype.safetensors_name(),
        m.device_bytes(),
        m.group_bytes,
        m.alignment
    );
    s
}
