//! A re-partitioning's checkpoint model (pure): the job's model with one
//! parameter group per stage of the partition drained, so that each
//! drained worker of pipeline 0 writes exactly one group (its layers'
//! params, nothing of its neighbours') and the next generation's workers
//! load their new layers from it like from any deployed model.
//!
//! Group `s` is the model's f32 packed bytes from the first param of stage
//! `s` to the first param of stage `s + 1` (the model's start for stage 0,
//! its end for the last): param offsets and sizes are the model's, only
//! re-cut. Needs an f32 model (a half-precision one would have to round
//! the trained weights) whose every stage holds params (a group is never
//! empty).

use std::ops::Range;

use distmind_common::checksum::checksum;
use distmind_common::train_spec::layer_ranges;
use distmind_models::{GroupEntry, Manifest, ParamDtype};

/// The checkpoint model a re-partitioning of job `job` into generation
/// `generation` writes.
pub fn checkpoint_name(job: &str, generation: u64) -> String {
    format!("{job}-g{generation}")
}

/// The periodic checkpoint model of job `job` (its spec's
/// `checkpoint_every`): one name per job, replaced in the catalog by each
/// newer periodic checkpoint, so a job keeps at most one (plus, while the
/// next one is being written, that one's parts).
pub fn periodic_checkpoint_name(job: &str) -> String {
    format!("{job}-ckpt")
}

/// Whether pipeline 0's workers write a periodic checkpoint once `done`
/// iterations are complete: every `every` iterations, not at the job's
/// last (the job is over by the time its parts would come in).
pub fn periodic_due(every: Option<u64>, done: u64, iterations: u64) -> bool {
    matches!(every, Some(k) if k > 0 && done > 0 && done.is_multiple_of(k) && done < iterations)
}

/// The stage each layer range of `partition` holds, for param `p`.
fn stage_of(ranges: &[Range<u32>], layer: usize) -> Option<usize> {
    ranges.iter().position(|r| r.contains(&(layer as u32)))
}

/// Each stage's group: its byte range in the model's packed layout.
pub fn stage_groups(m: &Manifest, partition: &[u32]) -> Result<Vec<Range<u64>>, String> {
    if m.param_dtype != ParamDtype::F32 {
        return Err(format!(
            "model {} stores its params as {:?}; a checkpoint keeps trained weights in f32 and \
             needs an f32 model",
            m.name, m.param_dtype
        ));
    }
    let ranges = layer_ranges(partition);
    if ranges.last().map_or(0, |r| r.end as usize) != m.layers.len() {
        return Err(format!(
            "partition {partition:?} does not cover model {}'s {} layers",
            m.name,
            m.layers.len()
        ));
    }
    let mut starts: Vec<Option<u64>> = vec![None; ranges.len()];
    let mut last_stage = 0;
    for p in &m.params {
        let s = stage_of(&ranges, p.layer).ok_or_else(|| {
            format!(
                "param {} is of layer {}, outside the model",
                p.name, p.layer
            )
        })?;
        if s < last_stage {
            return Err(format!(
                "model {}: param {} comes after a param of a later stage (params out of layer order)",
                m.name, p.name
            ));
        }
        last_stage = s;
        starts[s].get_or_insert(m.device_param_offset(p));
    }
    let mut out = Vec::with_capacity(ranges.len());
    for (s, start) in starts.iter().enumerate() {
        let Some(start) = start else {
            let r = &ranges[s];
            return Err(format!(
                "stage {s} (layers [{}, {})) holds no params: a checkpoint has one group per stage",
                r.start, r.end
            ));
        };
        let start = if s == 0 { 0 } else { *start };
        let end = starts[s + 1..]
            .iter()
            .flatten()
            .next()
            .copied()
            .unwrap_or(m.stored_bytes);
        if end <= start {
            return Err(format!(
                "model {}: stage {s}'s params span no bytes ({start}..{end})",
                m.name
            ));
        }
        out.push(start..end);
    }
    Ok(out)
}

/// The checkpoint's manifest: `m` named `name`, its groups re-cut by
/// `partition` with `group_checksums` (hex, one per stage) as the groups'.
pub fn checkpoint_manifest(
    m: &Manifest,
    partition: &[u32],
    name: &str,
    group_checksums: &[String],
) -> Result<Manifest, String> {
    let groups = stage_groups(m, partition)?;
    if group_checksums.len() != groups.len() {
        return Err(format!(
            "{} group checksums for {} stages",
            group_checksums.len(),
            groups.len()
        ));
    }
    let ranges = layer_ranges(partition);
    let mut out = m.clone();
    out.name = name.to_string();
    for p in &mut out.params {
        let at = m.device_param_offset(p);
        let s = stage_of(&ranges, p.layer).expect("stage_groups placed every param");
        p.group = s;
        p.offset = at - groups[s].start;
    }
    for l in &mut out.layers {
        if l.group.is_some() {
            l.group = stage_of(&ranges, l.id);
        }
    }
    out.groups = groups
        .iter()
        .zip(&ranges)
        .zip(group_checksums)
        .enumerate()
        .map(|(s, ((g, r), sum))| GroupEntry {
            index: s,
            offset: g.start,
            bytes: g.end - g.start,
            first_layer: r.start as usize,
            last_layer: (r.end as usize).saturating_sub(1),
            checksum: sum.clone(),
        })
        .collect();
    out.group_bytes = out.groups.iter().map(|g| g.bytes).max().unwrap_or(0);
    Ok(out)
}

/// One checksum over per-layer checksums in layer order (what a
/// checkpoint's written and reloaded params are compared by).
pub fn combine(layer_checksums: &[u64]) -> u64 {
    let bytes: Vec<u8> = layer_checksums
        .iter()
        .flat_map(|c| c.to_le_bytes())
        .collect();
    checksum(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    use distmind_models::graph::Dtype;
    use distmind_models::layout::plan;
    use distmind_models::{Family, ParamEntry, Scale};

    /// Tiny ResNet-152's manifest, packed as a package is (small groups,
    /// so groups span the stages' cuts), without the weights.
    fn tiny() -> Manifest {
        let config = Family::Resnet152.config(Scale::Tiny);
        let arch = config.build();
        let names: HashMap<&str, (usize, u64)> = arch
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.as_str(), (i, p.numel() as u64 * 4)))
            .collect();
        let layout = plan(
            &arch.layers,
            arch.params.len(),
            |n| names.get(n).copied(),
            64 << 10,
            512,
        )
        .unwrap();
        let owner: HashMap<&str, usize> = arch
            .layers
            .iter()
            .flat_map(|l| l.params.iter().map(move |p| (p.as_str(), l.id)))
            .collect();
        let mut order: Vec<usize> = (0..arch.params.len()).collect();
        order.sort_by_key(|&i| (layout.placements[i].group, layout.placements[i].offset));
        let mut layers = arch.layers.clone();
        for (l, g) in layers.iter_mut().zip(&layout.layer_groups) {
            l.group = *g;
        }
        Manifest {
            format_version: 1,
            name: "m".into(),
            family: Family::Resnet152,
            scale: Some(Scale::Tiny),
            seed: Some(0),
            origin: None,
            config,
            inputs: arch.inputs.clone(),
            outputs: arch.outputs.clone(),
            param_dtype: ParamDtype::F32,
            group_bytes: 64 << 10,
            alignment: 512,
            learnable_param_count: 0,
            stored_bytes: layout.stored_bytes(),
            layers,
            params: order
                .iter()
                .map(|&i| {
                    let p = &arch.params[i];
                    ParamEntry {
                        name: p.name.clone(),
                        shape: p.shape.clone(),
                        dtype: Dtype::F32,
                        layer: owner[p.name.as_str()],
                        group: layout.placements[i].group,
                        offset: layout.placements[i].offset,
                        nbytes: p.numel() as u64 * 4,
                        learnable: p.learnable,
                    }
                })
                .collect(),
            groups: layout
                .groups
                .iter()
                .enumerate()
                .map(|(i, g)| GroupEntry {
                    index: i,
                    offset: g.offset,
                    bytes: g.bytes,
                    first_layer: g.first_layer,
                    last_layer: g.last_layer,
                    checksum: "0000000000000000".into(),
                })
                .collect(),
        }
    }

    #[test]
    fn groups_are_re_cut_per_stage_keeping_every_param_where_it_was() {
        let m = tiny();
        let n = m.layers.len() as u32;
        let partition = vec![n / 3, n / 3, n - 2 * (n / 3)];
        let g = stage_groups(&m, &partition).unwrap();
        assert_eq!(g.len(), 3);
        assert_eq!(g[0].start, 0);
        assert_eq!(g[2].end, m.stored_bytes);
        assert_eq!(g[0].end, g[1].start);
        assert_eq!(g[1].end, g[2].start);
        let sums = vec!["0000000000000001".to_string(); 3];
        let c = checkpoint_manifest(&m, &partition, "j-1-g1", &sums).unwrap();
        assert_eq!(c.name, "j-1-g1");
        assert_eq!(c.groups.len(), 3);
        assert_eq!(c.stored_bytes, m.stored_bytes);
        assert!(m.groups.len() > 3, "groups span the cuts");
        for (a, b) in m.params.iter().zip(&c.params) {
            assert_eq!(
                m.device_param_offset(a),
                c.device_param_offset(b),
                "{}",
                a.name
            );
            assert!(b.offset + b.nbytes <= c.groups[b.group].bytes);
            assert_eq!(c.layers[b.layer].group, Some(b.group));
        }
        // A checkpoint of a checkpoint (a second re-partitioning) re-cuts
        // the same bytes.
        let again =
            checkpoint_manifest(&c, &[n / 2, n / 4, n - n / 2 - n / 4], "j-1-g2", &sums).unwrap();
        for (a, b) in m.params.iter().zip(&again.params) {
            assert_eq!(m.device_param_offset(a), again.device_param_offset(b));
        }
        assert!(checkpoint_manifest(&m, &partition, "x", &sums[..2]).is_err());
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let m = tiny();
        let n = m.layers.len() as u32;
        let e = stage_groups(&m, &[n - 1]).unwrap_err();
        assert!(e.contains("does not cover"), "{e}");
        // The last layer (the classifier's head) alone holds params; a
        // stage of only the last parameterless layers holds none.
        let last_with_params = m.params.last().unwrap().layer as u32;
        if last_with_params + 1 < n {
            let e =
                stage_groups(&m, &[last_with_params + 1, n - last_with_params - 1]).unwrap_err();
            assert!(e.contains("holds no params"), "{e}");
        }
        assert_ne!(combine(&[1, 2]), combine(&[2, 1]));
        assert_eq!(checkpoint_name("j-3", 2), "j-3-g2");
        assert_eq!(periodic_checkpoint_name("j-3"), "j-3-ckpt");
    }

    #[test]
    fn periodic_checkpoints_come_every_k_iterations_but_not_at_the_end() {
        let due: Vec<u64> = (0..=10).filter(|&d| periodic_due(Some(3), d, 10)).collect();
        assert_eq!(due, vec![3, 6, 9]);
        let due: Vec<u64> = (0..=10).filter(|&d| periodic_due(Some(5), d, 10)).collect();
        assert_eq!(due, vec![5], "not after the last iteration");
        assert!((0..=10).all(|d| !periodic_due(None, d, 10)));
        assert!((0..=10).all(|d| !periodic_due(Some(0), d, 10)));
        assert!((0..=10).all(|d| !periodic_due(Some(10), d, 10)));
        let due: Vec<u64> = (0..=4).filter(|&d| periodic_due(Some(1), d, 4)).collect();
        assert_eq!(due, vec![1, 2, 3]);
    }
}
