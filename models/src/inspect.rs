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
        m.scale,
        m.seed.map_or("none".to_string(), |v| v.to_string())
    );
    for i in &m.inputs {
        let _ = writeln!(s, "input  {}: {:?} {:?}", i.name, i.dtype, i.shape);
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
        let (count, bytes) =
            params.fold((0u64, 0u64), |(c, b), p| (c + p.nbytes / 4, b + p.nbytes));
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
    let all: u64 = m.params.iter().map(|p| p.nbytes / 4).sum();
    let _ = writeln!(
        s,
        "\ntotal: {} layers, {} params ({} values, {} learnable), {} groups, {} stored bytes (group_bytes {}, alignment {})",
        m.layers.len(),
        m.params.len(),
        all,
        m.learnable_param_count,
        m.groups.len(),
        m.stored_bytes,
        m.group_bytes,
        m.alignment
    );
    s
}
