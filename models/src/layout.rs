//! The packed layout memory servers store and GPUs read: params in layer
//! order, each starting at a multiple of the alignment, cut into groups at
//! layer boundaries.
//!
//! Grouping rule (the original's): a layer's params join the current group
//! if the group stays within `group_bytes`, else a new group starts; a layer
//! whose params alone exceed `group_bytes` forms its own group. So
//! `group_bytes = 1` gives one group per layer with params, and a huge value
//! one group.

use crate::graph::Layer;

/// Where one param lies in the packed layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub group: usize,
    /// Byte offset within the group, a multiple of the alignment.
    pub offset: u64,
}

/// One group of the packed layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPlan {
    /// Byte offset of the group in the whole packed model.
    pub offset: u64,
    /// Padded length, a multiple of the alignment.
    pub bytes: u64,
    /// First and last layer (ids) whose params the group holds.
    pub first_layer: usize,
    pub last_layer: usize,
}

/// The layout of a whole model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Per layer: the group holding its params, `None` without params.
    pub layer_groups: Vec<Option<usize>>,
    /// Per param, in the order `param_nbytes` was given them.
    pub placements: Vec<Placement>,
    pub groups: Vec<GroupPlan>,
}

impl Layout {
    pub fn stored_bytes(&self) -> u64 {
        self.groups.iter().map(|g| g.bytes).sum()
    }
}

pub fn align_up(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

/// Computes the layout. `param_index(name)` gives the index and unpadded
/// byte size of a param; each layer's params are placed in the order listed.
pub fn plan(
    layers: &[Layer],
    param_count: usize,
    param_index: impl Fn(&str) -> Option<(usize, u64)>,
    group_bytes: u64,
    align: u64,
) -> Result<Layout, String> {
    assert!(align.is_power_of_two(), "alignment must be a power of two");
    let mut placements: Vec<Option<Placement>> = vec![None; param_count];
    let mut layer_groups = vec![None; layers.len()];
    let mut groups: Vec<GroupPlan> = Vec::new();
    let mut offset_total = 0u64;
    for (i, layer) in layers.iter().enumerate() {
        if layer.id != i {
            return Err(format!("layer at position {i} has id {}", layer.id));
        }
        if layer.params.is_empty() {
            continue;
        }
        let mut sizes = Vec::with_capacity(layer.params.len());
        for name in &layer.params {
            let (index, nbytes) = param_index(name)
                .ok_or_else(|| format!("layer {} names unknown param {name}", layer.id))?;
            sizes.push((index, align_up(nbytes, align)));
        }
        let layer_bytes: u64 = sizes.iter().map(|s| s.1).sum();
        let join = match groups.last() {
            Some(g) => g.bytes + layer_bytes <= group_bytes,
            None => false,
        };
        if !join {
            groups.push(GroupPlan {
                offset: offset_total,
                bytes: 0,
                first_layer: layer.id,
                last_layer: layer.id,
            });
        }
        let gi = groups.len() - 1;
        let g = &mut groups[gi];
        for (index, padded) in sizes {
            if placements[index].is_some() {
                return Err(format!(
                    "param {index} is used by more than one layer (again by layer {})",
                    layer.id
                ));
            }
            placements[index] = Some(Placement {
                group: gi,
                offset: g.bytes,
            });
            g.bytes += padded;
        }
        g.last_layer = layer.id;
        offset_total += layer_bytes;
        layer_groups[layer.id] = Some(gi);
    }
    let placements = placements
        .into_iter()
        .enumerate()
        .map(|(i, p)| p.ok_or_else(|| format!("param {i} is used by no layer")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Layout {
        layer_groups,
        placements,
        groups,
    })
}
