//! How a model's parameter groups are sharded over memory servers.
//!
//! Pure: the deploy tool calls [`plan`] with the group sizes and the
//! registry's view of the memory servers, then allocates and writes what the
//! plan says. Strategies are those compared by the original's test 9.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use distmind_common::limits::PARAM_ALIGN_BYTES;
use distmind_common::proto::MemserverInfo;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// The shard width used when [`PlanOptions::shard_width`] is 0 (and there
/// are at least this many alive servers), as in the original.
pub const SHARD_WIDTH_DEFAULT_MAX: usize = 4;

/// Slice boundaries inside a group fall on multiples of this.
pub const SLICE_ALIGN_BYTES: u64 = PARAM_ALIGN_BYTES;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Every group split into `width` near-equal slices, one per server (the
    /// original's "DNN-aware" sharding).
    #[default]
    Hybrid,
    /// The whole model on one server.
    PerApp,
    /// Group i on server i mod width.
    Horizontal,
    /// The model's bytes split into `width` contiguous, near-equal ranges.
    Vertical,
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::Hybrid,
        Strategy::PerApp,
        Strategy::Horizontal,
        Strategy::Vertical,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            Strategy::Hybrid => "hybrid",
            Strategy::PerApp => "per-app",
            Strategy::Horizontal => "horizontal",
            Strategy::Vertical => "vertical",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown sharding strategy {0:?}: expected one of hybrid, per-app, horizontal, vertical")]
pub struct UnknownStrategy(pub String);

impl FromStr for Strategy {
    type Err = UnknownStrategy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Strategy::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownStrategy(s.to_string()))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanOptions {
    pub strategy: Strategy,
    /// Servers a model is spread over; 0 = min(alive servers, 4).
    pub shard_width: usize,
    /// Copies of every slice, on distinct servers; at least 1.
    pub replication: usize,
    /// Breaks ties between servers with the same free space.
    pub seed: u64,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            strategy: Strategy::Hybrid,
            shard_width: 0,
            replication: 1,
            seed: 0,
        }
    }
}

/// One slice of a group and where its copies go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePlan {
    pub group_offset: u64,
    pub len: u64,
    /// Memory server ids, all distinct; the first is the primary.
    pub replicas: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    #[error("no memory server is alive: start memory servers (and check their heartbeats) before deploying")]
    NoAliveServers,
    #[error("replication must be at least 1")]
    ZeroReplication,
    #[error("replication {replication} needs {replication} distinct memory servers but only {alive} are alive")]
    ReplicationTooHigh { replication: usize, alive: usize },
    #[error("shard width {width} is more than the {alive} alive memory servers")]
    WidthTooLarge { width: usize, alive: usize },
    #[error("group {group} is empty (0 bytes)")]
    EmptyGroup { group: usize },
    #[error(
        "memory server {memserver} ({addr}) would need {needed_bytes} bytes but has {free_bytes} free: \
         add memory servers, remove models, or lower the replication"
    )]
    Capacity {
        memserver: u32,
        addr: String,
        needed_bytes: u64,
        free_bytes: u64,
    },
}

/// Plans where every slice of every group goes; `result[g]` lists group
/// `g`'s slices in order, covering `[0, group_bytes[g])` exactly.
pub fn plan(
    group_bytes: &[u64],
    servers: &[MemserverInfo],
    opts: &PlanOptions,
) -> Result<Vec<Vec<SlicePlan>>, PlanError> {
    if let Some(group) = group_bytes.iter().position(|&b| b == 0) {
        return Err(PlanError::EmptyGroup { group });
    }
    let order = rank_servers(servers, opts.seed);
    let alive = order.len();
    if alive == 0 {
        return Err(PlanError::NoAliveServers);
    }
    if opts.replication == 0 {
        return Err(PlanError::ZeroReplication);
    }
    if opts.replication > alive {
        return Err(PlanError::ReplicationTooHigh {
            replication: opts.replication,
            alive,
        });
    }
    let width = match (opts.strategy, opts.shard_width) {
        (Strategy::PerApp, _) => 1,
        (_, 0) => alive.min(SHARD_WIDTH_DEFAULT_MAX),
        (_, w) if w > alive => return Err(PlanError::WidthTooLarge { width: w, alive }),
        (_, w) => w,
    };
    // Each piece: (group offset, len, position of the primary in `order`).
    let pieces: Vec<Vec<(u64, u64, usize)>> = match opts.strategy {
        Strategy::PerApp => group_bytes.iter().map(|&b| vec![(0, b, 0)]).collect(),
        Strategy::Horizontal => group_bytes
            .iter()
            .enumerate()
            .map(|(g, &b)| vec![(0, b, g % width)])
            .collect(),
        Strategy::Hybrid => group_bytes
            .iter()
            .enumerate()
            .map(|(g, &b)| {
                split_even(b, width)
                    .into_iter()
                    .enumerate()
                    .map(|(k, (o, l))| (o, l, (g + k) % width))
                    .collect()
            })
            .collect(),
        Strategy::Vertical => vertical(group_bytes, width),
    };
    // Replica k sits k positions after the primary, within the chosen set
    // when it is wide enough, else within the first `replication` servers.
    let span = width.max(opts.replication);
    let result: Vec<Vec<SlicePlan>> = pieces
        .into_iter()
        .map(|g| {
            g.into_iter()
                .map(|(group_offset, len, p)| SlicePlan {
                    group_offset,
                    len,
                    replicas: (0..opts.replication)
                        .map(|k| order[(p + k) % span].id)
                        .collect(),
                })
                .collect()
        })
        .collect();
    check_capacity(&result, &order)?;
    Ok(result)
}

/// Alive servers, most free space first, ties in a seeded random order.
fn rank_servers(servers: &[MemserverInfo], seed: u64) -> Vec<&MemserverInfo> {
    let mut order: Vec<&MemserverInfo> = servers.iter().filter(|s| s.alive).collect();
    order.sort_by_key(|s| s.id); // the input order must not matter
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    order.sort_by_key(|s| std::cmp::Reverse(free_bytes(s))); // stable: keeps the shuffle among ties
    order
}

fn free_bytes(s: &MemserverInfo) -> u64 {
    s.capacity_bytes.saturating_sub(s.used_bytes)
}

/// Cuts `[0, bytes)` into at most `n` slices whose boundaries are multiples of
/// [`SLICE_ALIGN_BYTES`] and whose sizes differ by at most that. Never
/// yields an empty slice.
fn split_even(bytes: u64, n: usize) -> Vec<(u64, u64)> {
    let units = bytes.div_ceil(SLICE_ALIGN_BYTES);
    let n = (n as u64).min(units).max(1);
    // floor(units*k/n) gives the last slice the extra unit, so the one
    // partial unit at the group's end is absorbed by the largest slice.
    let start =
        |k: u64| ((units as u128 * k as u128 / n as u128) as u64 * SLICE_ALIGN_BYTES).min(bytes);
    (0..n)
        .map(|k| (start(k), start(k + 1) - start(k)))
        .collect()
}

fn align_down(x: u64) -> u64 {
    x - x % SLICE_ALIGN_BYTES
}

/// The model's bytes in `width` contiguous ranges; a group that straddles a
/// range boundary is cut there (aligned down within the group).
fn vertical(group_bytes: &[u64], width: usize) -> Vec<Vec<(u64, u64, usize)>> {
    let total: u128 = group_bytes.iter().map(|&b| b as u128).sum();
    // Range r starts at bound(r) in model coordinates.
    let bound = |r: usize| align_down((total * r as u128 / width as u128) as u64);
    let mut out = Vec::with_capacity(group_bytes.len());
    let mut gstart: u64 = 0;
    let mut range = 0usize; // the range the current position is in
    for &b in group_bytes {
        let gend = gstart + b;
        while range + 1 < width && bound(range + 1) <= gstart {
            range += 1;
        }
        let mut slices: Vec<(u64, u64, usize)> = Vec::new();
        let mut cut = 0u64; // start of the open slice, in group coordinates
        let mut owner = range;
        while range + 1 < width && bound(range + 1) < gend {
            range += 1;
            let next = align_down(bound(range) - gstart);
            if next > cut {
                slices.push((cut, next - cut, owner));
                cut = next;
            }
            owner = range;
        }
        slices.push((cut, b - cut, owner));
        out.push(slices);
        gstart = gend;
    }
    out
}

fn check_capacity(plan: &[Vec<SlicePlan>], order: &[&MemserverInfo]) -> Result<(), PlanError> {
    let mut needed: HashMap<u32, u64> = HashMap::new();
    for s in plan.iter().flatten() {
        for &id in &s.replicas {
            *needed.entry(id).or_default() += s.len;
        }
    }
    for s in order {
        let need = needed.get(&s.id).copied().unwrap_or(0);
        if need > free_bytes(s) {
            return Err(PlanError::Capacity {
                memserver: s.id,
                addr: s.addr.clone(),
                needed_bytes: need,
                free_bytes: free_bytes(s),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "placement_tests.rs"]
mod tests;
