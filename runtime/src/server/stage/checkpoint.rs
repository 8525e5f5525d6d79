//! A stage worker's checkpoint part, of a drained worker (a
//! re-partitioning, see the controller's `jobs::repartition`) or of a
//! periodic checkpoint (`checkpoint_every`, the controller's
//! `jobs::periodic`): its layers' params (learnable and
//! BatchNorm statistics, f32, in the model's packed layout) become group
//! `stage` of the checkpoint model (`jobs::checkpoint`: one group per
//! stage of the partition the worker runs), written to the memory servers the way
//! `distmind deploy` writes a group (the controller's placement plan,
//! alloc, write, commit with the checksum); the controller puts the
//! catalog entry once every stage's part is in. SGD momentum is not
//! written: a generation loading a checkpoint starts it at zero.
//!
//! Layer checksums (xxh3-64 of each layer's params in the packed layout,
//! padding included) are taken here and on every load, so a reload can be
//! checked bit for bit against what was written.

use std::time::Duration;

use distmind_common::checksum::{checksum, to_hex};
use distmind_common::proto::{GroupLocation, Location, MemserverInfo, Slice};
use distmind_controller::jobs::checkpoint::stage_groups;
use distmind_controller::{plan, ControllerClient, PlanOptions};
use distmind_memserver::MemserverClient;

use super::StageConfig;
use crate::train::StageModel;

/// Bounds connecting to a memory server or the controller, and each call.
pub const CHECKPOINT_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Each layer's checksum, in layer order.
pub(crate) fn layer_checksums(model: &StageModel) -> Result<Vec<u64>, String> {
    model
        .layers()
        .map(|l| {
            model
                .layer_params_packed(l..l + 1)
                .map(|p| checksum(&p.bytes))
                .map_err(|e| format!("layer {l}: {e}"))
        })
        .collect()
}

/// Group `stage` of checkpoint `name` for `model`'s layers in `partition`,
/// and the group's bytes.
fn group_bytes(model: &StageModel, stage: u32, partition: &[u32]) -> Result<Vec<u8>, String> {
    let groups = stage_groups(model.manifest(), partition)?;
    let g = groups
        .get(stage as usize)
        .ok_or_else(|| format!("stage {stage} is not a stage of partition {partition:?}"))?;
    let part = model
        .layer_params_packed(model.layers())
        .map_err(|e| e.to_string())?;
    let r = part.range();
    if r.start < g.start || r.end > g.end {
        return Err(format!(
            "the stage's params are bytes {r:?}, outside its checkpoint group {g:?}"
        ));
    }
    let mut bytes = vec![0u8; (g.end - g.start) as usize];
    let at = (r.start - g.start) as usize;
    bytes[at..at + part.bytes.len()].copy_from_slice(&part.bytes);
    Ok(bytes)
}

/// The stage's part of a checkpoint of `partition`: its group's bytes and
/// the stage's layer checksums (taken with the device held, so the
/// weights do not move under it; written with [`write_bytes`]).
pub(crate) fn snapshot(
    model: &StageModel,
    stage: u32,
    partition: &[u32],
) -> Result<(Vec<u8>, Vec<u64>), String> {
    Ok((
        group_bytes(model, stage, partition)?,
        layer_checksums(model)?,
    ))
}

/// Writes the stage's part of checkpoint `name`; returns the group's
/// location and the stage's layer checksums. A failed write frees what it
/// allocated.
pub(crate) fn write_part(
    config: &StageConfig,
    model: &StageModel,
    stage: u32,
    partition: &[u32],
    name: &str,
) -> Result<(GroupLocation, Vec<u64>), String> {
    let (bytes, sums) = snapshot(model, stage, partition)?;
    let group = write_bytes(config, stage, name, &bytes)?;
    Ok((group, sums))
}

/// Writes `bytes` as group `stage` of checkpoint `name` (placed by the
/// controller's plan over the live memory servers); returns the group's
/// location. A failed write frees what it allocated.
pub(crate) fn write_bytes(
    config: &StageConfig,
    stage: u32,
    name: &str,
    bytes: &[u8],
) -> Result<GroupLocation, String> {
    let servers: Vec<MemserverInfo> =
        ControllerClient::connect(&config.controller, &config.key, CHECKPOINT_IO_TIMEOUT)
            .and_then(|mut c| c.list_memservers())
            .map_err(|e| {
                format!(
                    "listing the memory servers at the controller {}: {e}",
                    config.controller
                )
            })?
            .into_iter()
            .filter(|s| s.alive)
            .collect();
    let opts = PlanOptions {
        seed: u64::from(stage),
        ..PlanOptions::default()
    };
    let slices = plan(&[bytes.len() as u64], &servers, &opts)
        .map_err(|e| format!("placing {} bytes: {e}", bytes.len()))?
        .remove(0);
    let mut written: Vec<Location> = Vec::new();
    let mut out = Vec::with_capacity(slices.len());
    for sp in &slices {
        let data = &bytes[sp.group_offset as usize..(sp.group_offset + sp.len) as usize];
        let mut replicas = Vec::with_capacity(sp.replicas.len());
        for &ms in &sp.replicas {
            let addr = servers
                .iter()
                .find(|s| s.id == ms)
                .map(|s| s.addr.clone())
                .expect("the plan uses listed servers");
            match write_slice(config, &addr, name, data, &mut written, ms) {
                Ok(l) => replicas.push(l),
                Err(e) => {
                    free(config, name, &written);
                    return Err(format!("memory server {ms} at {addr}: {e}"));
                }
            }
        }
        out.push(Slice {
            group_offset: sp.group_offset,
            len: sp.len,
            checksum: to_hex(checksum(data)),
            replicas,
        });
    }
    let group = GroupLocation {
        index: stage,
        bytes: bytes.len() as u64,
        checksum: to_hex(checksum(bytes)),
        slices: out,
    };
    Ok(group)
}

fn write_slice(
    config: &StageConfig,
    addr: &str,
    name: &str,
    data: &[u8],
    written: &mut Vec<Location>,
    memserver: u32,
) -> Result<Location, String> {
    let mut c = MemserverClient::connect(addr, &config.key, CHECKPOINT_IO_TIMEOUT)
        .map_err(|e| e.to_string())?;
    let offset = c
        .alloc(data.len() as u64, name)
        .map_err(|e| format!("allocating {} bytes: {e}", data.len()))?;
    let l = Location {
        memserver,
        addr: addr.to_string(),
        offset,
    };
    written.push(l.clone());
    c.write(offset, data)
        .map_err(|e| format!("writing {} bytes: {e}", data.len()))?;
    c.commit(offset, checksum(data))
        .map_err(|e| format!("committing: {e}"))?;
    Ok(l)
}

/// Frees extents of checkpoint `name` (their owner on the memory servers),
/// best effort (logged).
pub(crate) fn free(config: &StageConfig, name: &str, locations: &[Location]) {
    for l in locations {
        let r = MemserverClient::connect(&l.addr, &config.key, CHECKPOINT_IO_TIMEOUT)
            .and_then(|mut c| c.free(l.offset, name));
        if let Err(e) = r {
            log::warn!(
                "memory server {} at {}: cannot free an extent of checkpoint {name} at {}: {e}",
                l.memserver,
                l.addr,
                l.offset
            );
        }
    }
}
