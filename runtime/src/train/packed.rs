//! Params in the packed layout: read from a package's stored group bytes
//! (f32, or half precision widened exactly), and a layer range's params as
//! f32 bytes at their device offsets ([`PackedLayers`]).
//!
//! The device layout is the stored one with every offset and size times
//! the storage dtype's widen factor (`models::dtype`): for an f32 package
//! the two are the same bytes, so a [`PackedLayers`] of an f32 package can
//! be written straight into its packed model (a checkpoint). Trained
//! params stay f32 here: narrowing them back to a half-precision package
//! would round away the training, so that is left to whoever writes a half
//! package.

use std::ops::Range;

use distmind_models::dtype::widen_to_vec;
use distmind_models::{Manifest, ParamEntry};

/// The params of the layers `layers` of model `model`, in the f32 packed
/// (device) layout: `bytes` go at device byte `offset` of the whole model
/// and span from the first param of the first layer to the end of the last
/// param of the last layer (alignment padding between params is zeros).
/// Learnable params and BatchNorm running statistics alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedLayers {
    pub model: String,
    pub layers: Range<usize>,
    pub offset: u64,
    pub bytes: Vec<u8>,
}

impl PackedLayers {
    /// `[offset, offset + bytes)` in the whole model's device layout.
    pub fn range(&self) -> Range<u64> {
        self.offset..self.offset + self.bytes.len() as u64
    }
}

/// The device byte range of `p` in the whole model.
pub(crate) fn device_range(manifest: &Manifest, p: &ParamEntry) -> Result<Range<u64>, String> {
    let g = manifest.groups.get(p.group).ok_or_else(|| {
        format!(
            "param {} is in group {}, which does not exist",
            p.name, p.group
        )
    })?;
    if p.offset + p.nbytes > g.bytes {
        return Err(format!("param {} overruns its group {}", p.name, p.group));
    }
    let start = manifest.device_param_offset(p);
    Ok(start..start + p.device_nbytes(manifest.param_dtype))
}

/// The device byte range the params of `params` (manifest indices, in
/// packed order) span: from the first one's start to the last one's end.
/// Empty (at 0) without params.
pub(crate) fn span(manifest: &Manifest, params: &[usize]) -> Result<Range<u64>, String> {
    let (Some(&first), Some(&last)) = (params.first(), params.last()) else {
        return Ok(0..0);
    };
    let start = device_range(manifest, &manifest.params[first])?.start;
    let end = device_range(manifest, &manifest.params[last])?.end;
    if end < start {
        return Err(format!(
            "params {} and {} are out of packed order",
            manifest.params[first].name, manifest.params[last].name
        ));
    }
    Ok(start..end)
}

/// The f32 values of `p` from its group's STORED bytes (`group`, the
/// whole padded group as the package stores it), widened if half.
pub(crate) fn read_stored(
    manifest: &Manifest,
    p: &ParamEntry,
    group: &[u8],
) -> Result<Vec<f32>, String> {
    let r = p.offset as usize..(p.offset + p.nbytes) as usize;
    let bytes = group.get(r).ok_or_else(|| {
        format!(
            "param {} ({} bytes at {} in group {}) is outside the {} bytes given for its group",
            p.name,
            p.nbytes,
            p.offset,
            p.group,
            group.len()
        )
    })?;
    let values = widen_to_vec(manifest.param_dtype, bytes);
    if values.len() as u64 != p.numel() {
        return Err(format!(
            "param {} has {} values, its shape {:?} wants {}",
            p.name,
            values.len(),
            p.shape,
            p.numel()
        ));
    }
    Ok(values)
}

/// The f32 values of `p` from `part` (device layout).
pub(crate) fn read_device(
    manifest: &Manifest,
    p: &ParamEntry,
    part: &PackedLayers,
) -> Result<Vec<f32>, String> {
    let r = device_range(manifest, p)?;
    let inside = r.start >= part.offset && r.end <= part.range().end;
    if !inside {
        return Err(format!(
            "param {} (device bytes {r:?}) is outside the bytes {:?} given for layers [{}, {})",
            p.name,
            part.range(),
            part.layers.start,
            part.layers.end
        ));
    }
    let s = (r.start - part.offset) as usize;
    Ok(f32_from_le(&part.bytes[s..s + (r.end - r.start) as usize]))
}

/// Little-endian f32 values of `bytes` (a multiple of 4 long).
pub(crate) fn f32_from_le(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Writes `values` as little-endian f32 into `dst` (exactly as long).
pub(crate) fn write_f32(dst: &mut [u8], values: &[f32]) -> Result<(), String> {
    if dst.len() != 4 * values.len() {
        return Err(format!("{} values for {} bytes", values.len(), dst.len()));
    }
    for (d, v) in dst.chunks_exact_mut(4).zip(values) {
        d.copy_from_slice(&v.to_le_bytes());
    }
    Ok(())
}
