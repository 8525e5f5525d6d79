//! The `cpu` executor: candle on the CPU, real numbers.
//!
//! * [`CpuArena`]: one [`HostBuffer`] in the manifest's packed layout. Once
//!   a program is compiled against the arena, an upload converts the group's
//!   bytes straight into the form the kernels want (candle tensors,
//!   per-channel tables) instead of copying them: that conversion is the
//!   CPU's share of an upload (what the copy engine does on a GPU), so it
//!   runs in the upload stage, overlapping the fetch of later groups, and
//!   compute finds every gated layer ready. Before any program (`distmind
//!   infer` uploads first) an upload is a memcpy into the buffer.
//! * [`CpuProgram`]: interprets `manifest.layers` in order with the params
//!   its arena's uploads prepared; a layer of a group uploaded into the
//!   buffer is prepared the first time a run reaches it, after
//!   `gate(group)` returned. Prepared params are kept for later runs:
//!   params never change once uploaded, and a program lives as long as its
//!   arena.
//! * Activations are dropped right after their last reader ran (last uses are
//!   computed once when the program is built), so a full-scale model at
//!   batch 8 holds only the live tensors.
//!
//! Op semantics are `models/OPS.md`'s (torchvision / Hugging Face in eval
//! mode); the kernels live in [`ops`] and [`attention`].
//!
//! **Architecture invariant:** the arena is read only in `CpuArena::read_f32`,
//! and only for a range inside a group whose gate returned in this run.

mod attention;
mod ops;
mod params;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{Device, Tensor};
use distmind_models::dtype::{widen_to_le_bytes, widen_to_vec};
use distmind_models::{Layer, Manifest, ParamDtype};
use distmind_transport::memory::{HostBuffer, HugePages};

use super::plan::{self, ParamLoc};
use super::{
    Arena, ExecError, Executor, ExecutorKind, HostTensor, Program, TensorData, Trace, TraceEvent,
};
use params::Prepared;

/// The candle CPU backend behind [`Executor`].
#[derive(Debug, Default)]
pub struct CpuExecutor {
    pool: Arc<Mutex<ArenaPool>>,
}

/// Most bytes of freed arena memory kept for reuse.
pub const ARENA_POOL_BYTES_MAX: u64 = 8 << 30;

/// Memory of dropped arenas, kept for the next ones: faulting in fresh pages
/// costs about ten times a copy on the machines we run on, and would sit on
/// the critical path of every cold start (a caching allocator, as GPU
/// frameworks keep one). Bounded by [`ARENA_POOL_BYTES_MAX`].
#[derive(Debug, Default)]
struct ArenaPool {
    free: Vec<HostBuffer>,
    bytes: u64,
}

impl ArenaPool {
    /// The smallest pooled buffer that holds `bytes` without wasting more
    /// than half of itself.
    fn take(&mut self, bytes: u64) -> Option<HostBuffer> {
        let fits = |b: &HostBuffer| {
            let len = b.len() as u64;
            len >= bytes && len <= bytes.saturating_mul(2)
        };
        let i = (0..self.free.len())
            .filter(|&i| fits(&self.free[i]))
            .min_by_key(|&i| self.free[i].len())?;
        let buf = self.free.swap_remove(i);
        self.bytes -= buf.len() as u64;
        Some(buf)
    }

    fn give(&mut self, buf: HostBuffer) {
        if self.bytes + buf.len() as u64 <= ARENA_POOL_BYTES_MAX {
            self.bytes += buf.len() as u64;
            self.free.push(buf);
        }
    }
}

impl CpuExecutor {
    pub fn new() -> Self {
        CpuExecutor::default()
    }
}

impl Executor for CpuExecutor {
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Cpu
    }

    fn describe(&self) -> String {
        format!(
            "cpu (candle, {} threads)",
            candle_core::utils::get_num_threads()
        )
    }

    /// A new cpu executor: its own arena pool.
    fn for_device(&self, _ordinal: u32) -> Result<Arc<dyn Executor>, ExecError> {
        Ok(Arc::new(CpuExecutor::new()))
    }

    fn alloc_arena(&self, bytes: u64) -> Result<Arc<dyn Arena>, ExecError> {
        let pooled = self
            .pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(bytes);
        let mut arena = match pooled {
            Some(buf) => CpuArena::with_buffer(buf, bytes),
            None => CpuArena::new(bytes)?,
        };
        arena.pool = Some(self.pool.clone());
        Ok(Arc::new(arena))
    }

    fn program(
        &self,
        manifest: &Manifest,
        arena: Arc<dyn Arena>,
    ) -> Result<Box<dyn Program>, ExecError> {
        let cpu_arena =
            crate::exec::downcast_arena::<CpuArena>(arena.clone()).ok_or_else(|| {
                ExecError::Model {
                    model: manifest.name.clone(),
                    why: "the arena was not allocated by this cpu executor".into(),
                }
            })?;
        Ok(Box::new(CpuProgram::new(manifest, cpu_arena)?))
    }
}

/// One model's parameters in host memory, in the packed layout.
#[derive(Debug)]
pub struct CpuArena {
    /// `Some` until dropped; may be longer than `len` when it came from the pool.
    buf: Option<HostBuffer>,
    len: u64,
    /// Where the buffer goes back on drop (arenas from an executor).
    pool: Option<Arc<Mutex<ArenaPool>>>,
    /// The params of the program compiled against this arena, which
    /// `upload` prepares group by group (`None` before any program).
    params: Mutex<Option<Arc<LayerParams>>>,
    /// Per group: its last upload went into `buf` (no program was attached
    /// then), so a program may prepare it from there.
    held: Mutex<Vec<bool>>,
}

impl Drop for CpuArena {
    fn drop(&mut self) {
        if let (Some(buf), Some(pool)) = (self.buf.take(), &self.pool) {
            pool.lock().unwrap_or_else(|e| e.into_inner()).give(buf);
        }
    }
}

impl CpuArena {
    pub fn new(bytes: u64) -> Result<Self, ExecError> {
        let alloc_err = |why: String| ExecError::Alloc { bytes, why };
        let len = usize::try_from(bytes)
            .map_err(|_| alloc_err("larger than the address space".into()))?;
        let buf = HostBuffer::new(len, HugePages::No).map_err(|e| alloc_err(e.to_string()))?;
        Ok(CpuArena::with_buffer(buf, bytes))
    }

    fn with_buffer(buf: HostBuffer, len: u64) -> Self {
        CpuArena {
            buf: Some(buf),
            len,
            pool: None,
            params: Mutex::new(None),
            held: Mutex::new(Vec::new()),
        }
    }

    fn buf(&self) -> &HostBuffer {
        self.buf
            .as_ref()
            .expect("an arena has its buffer until it is dropped")
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, ExecError> {
        let arena = self.len;
        match offset.checked_add(len) {
            Some(end) if end <= arena => Ok(offset as usize..end as usize),
            _ => Err(ExecError::UploadOutOfRange { offset, len, arena }),
        }
    }

    /// Copies `len` bytes at `offset` out of the arena, as little-endian f32.
    ///
    /// Callers read only inside a group whose `gate` returned in the current
    /// run, i.e. whose upload completed (see the safety comment).
    fn read_f32(&self, offset: u64, len: u64) -> Result<Vec<f32>, ExecError> {
        let range = self.check_range(offset, len)?;
        #[allow(unsafe_code)]
        // SAFETY: the range is inside the buffer (checked above and again by
        // `slice`). It belongs to one group, and the program reads a group only
        // after `gate(group)` returned, which the runtime calls only once that
        // group's `upload` finished; a group is uploaded once, by one thread at
        // a time, so no write to these bytes is in flight while we read them.
        let bytes = unsafe { self.buf().slice(range) };
        Ok(f32_from_le(bytes))
    }

    /// Whether group `group`'s last upload went into the buffer.
    fn holds(&self, group: usize) -> bool {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.get(group).copied().unwrap_or(false)
    }

    fn set_held(&self, group: usize, held: bool) {
        let mut h = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if h.len() <= group {
            h.resize(group + 1, false);
        }
        h[group] = held;
    }
}

impl Arena for CpuArena {
    fn len(&self) -> u64 {
        self.len
    }

    /// Synchronous: the bytes are converted (widened, for half precision)
    /// when it returns.
    #[allow(unsafe_code)]
    unsafe fn upload_async(
        &self,
        group: usize,
        offset: u64,
        stored: ParamDtype,
        bytes: &[u8],
    ) -> Result<(), ExecError> {
        let range = super::device_range(group, offset, stored, bytes, self.len)?;
        let range = range.start as usize..range.end as usize;
        let params = self
            .params
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(p) = params {
            // The program reads only prepared params: converting straight
            // from the host bytes is the whole upload (one pass over them).
            self.set_held(group, false);
            return p.prepare_group(group, offset, stored, bytes);
        }
        // SAFETY: in bounds (checked). The range is one group's, uploaded by
        // one thread at a time (the `Arena::upload_async` contract), and no
        // program reads a group before its gate, which opens after this copy
        // returned.
        let dst = unsafe { self.buf().slice_mut(range) };
        match stored {
            ParamDtype::F32 => dst.copy_from_slice(bytes),
            _ => widen_to_le_bytes(stored, bytes, dst),
        }
        self.set_held(group, true);
        Ok(())
    }
}

/// Prepared params of one program, per layer: filled by the arena's
/// uploads (group by group) or, for a group uploaded before the program
/// was compiled, by the first run that reaches the layer.
#[derive(Debug)]
struct LayerParams {
    model: String,
    layers: Vec<Layer>,
    /// Per layer: its params as (arena offset, bytes, shape), in op order.
    locs: Vec<Vec<ParamLoc>>,
    /// Per group: the layers with params in it.
    by_group: Vec<Vec<usize>>,
    /// Per layer: its prepared params, once prepared.
    prepared: Vec<Mutex<Option<Arc<Prepared>>>>,
}

impl LayerParams {
    fn new(manifest: &Manifest, locs: Vec<Vec<ParamLoc>>) -> Self {
        let mut by_group = vec![Vec::new(); manifest.groups.len()];
        for (i, layer) in manifest.layers.iter().enumerate() {
            if let (Some(g), false) = (layer.group, locs[i].is_empty()) {
                if let Some(layers) = by_group.get_mut(g) {
                    layers.push(i);
                }
            }
        }
        LayerParams {
            model: manifest.name.clone(),
            layers: manifest.layers.clone(),
            prepared: (0..locs.len()).map(|_| Mutex::new(None)).collect(),
            locs,
            by_group,
        }
    }

    fn slot(&self, i: usize) -> std::sync::MutexGuard<'_, Option<Arc<Prepared>>> {
        self.prepared[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Layer `i`'s params, prepared from the arena's buffer now unless an
    /// upload or an earlier run did. The caller guarantees no upload writes
    /// the layer's group meanwhile (its gate returned).
    fn get_or_prepare(&self, arena: &CpuArena, i: usize) -> Result<Arc<Prepared>, ExecError> {
        if let Some(p) = self.slot(i).as_ref() {
            return Ok(p.clone());
        }
        let group = self.layers[i].group;
        if !group.is_some_and(|g| arena.holds(g)) {
            return Err(plan::layer_error(
                &self.model,
                &self.layers[i],
                format!(
                    "its group {group:?} is not in the arena (never uploaded, or uploaded \
                     straight into the params of another program)"
                ),
            ));
        }
        let p = Arc::new(self.prepare(i, |loc| arena.read_f32(loc.offset, loc.nbytes))?);
        *self.slot(i) = Some(p.clone());
        Ok(p)
    }

    /// Prepares every layer of `group` from `bytes`, the group's stored
    /// bytes (values of `stored`), which go to arena offset `offset` (an
    /// upload: a second one replaces what the first prepared).
    fn prepare_group(
        &self,
        group: usize,
        offset: u64,
        stored: ParamDtype,
        bytes: &[u8],
    ) -> Result<(), ExecError> {
        // Device offsets and sizes are the stored ones times this.
        let factor = stored.widen_factor() as usize;
        for &i in self.by_group.get(group).map_or(&[][..], Vec::as_slice) {
            let p = self.prepare(i, |loc| {
                let start = loc.offset.checked_sub(offset).map(|s| s as usize / factor);
                let end = start.and_then(|s| s.checked_add(loc.nbytes as usize / factor));
                match (start, end) {
                    (Some(s), Some(e)) if e <= bytes.len() => {
                        Ok(widen_to_vec(stored, &bytes[s..e]))
                    }
                    _ => Err(ExecError::Gate {
                        group,
                        why: format!(
                            "param {} ({} bytes at arena offset {}) is outside the {} {stored} \
                             bytes uploaded at offset {offset}",
                            loc.name,
                            loc.nbytes,
                            loc.offset,
                            bytes.len()
                        ),
                    }),
                }
            })?;
            *self.slot(i) = Some(Arc::new(p));
        }
        Ok(())
    }

    fn prepare(
        &self,
        i: usize,
        mut values: impl FnMut(&ParamLoc) -> Result<Vec<f32>, ExecError>,
    ) -> Result<Prepared, ExecError> {
        let mut raw = Vec::with_capacity(self.locs[i].len());
        for loc in &self.locs[i] {
            raw.push((loc.name.as_str(), loc.shape.as_slice(), values(loc)?));
        }
        params::prepare(&self.layers[i].op, raw)
            .map_err(|e| plan::layer_error(&self.model, &self.layers[i], e.to_string()))
    }
}

/// Little-endian f32 values of `bytes` (a multiple of 4 long).
fn f32_from_le(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A model compiled for the CPU against one arena.
pub struct CpuProgram {
    model: String,
    layers: Vec<Layer>,
    inputs: Vec<distmind_models::TensorSpec>,
    /// Layer ids of the manifest outputs, in order.
    outputs: Vec<usize>,
    /// Per layer: the activations (layer ids) to drop once it ran.
    frees_after: Vec<Vec<usize>>,
    /// Per layer: its params, prepared by the arena's uploads (shared with
    /// the arena) or by the first run that reached it.
    params: Arc<LayerParams>,
    groups: usize,
    arena: Arc<CpuArena>,
    /// Param shapes by name, for the per-shape check.
    param_shapes: std::collections::HashMap<String, Vec<usize>>,
    /// Per request shape: every layer's output shape, inferred before the
    /// first run at that shape, so a shape the graph cannot take fails
    /// before any group is waited for. The kernels themselves read shapes
    /// from their tensors and keep nothing per shape.
    shapes: plan::PerShape<Vec<distmind_models::shape::Shape>>,
}

impl CpuProgram {
    fn new(manifest: &Manifest, arena: Arc<CpuArena>) -> Result<Self, ExecError> {
        let plan = plan::plan(manifest, arena.len)?;
        let params = Arc::new(LayerParams::new(manifest, plan.params));
        // From now on every upload to the arena prepares its group's params.
        *arena.params.lock().unwrap_or_else(|e| e.into_inner()) = Some(params.clone());
        Ok(CpuProgram {
            model: manifest.name.clone(),
            frees_after: plan.frees_after,
            layers: manifest.layers.clone(),
            inputs: manifest.inputs.clone(),
            outputs: plan.outputs,
            params,
            groups: manifest.groups.len(),
            arena,
            param_shapes: plan::param_shapes(manifest),
            shapes: plan::PerShape::default(),
        })
    }

    fn layer_error(&self, i: usize, why: String) -> ExecError {
        plan::layer_error(&self.model, &self.layers[i], why)
    }

    /// Checks the inputs against the manifest (the batch, and the length of
    /// token inputs, may differ) and the graph at their shapes, and wraps
    /// them as tensors.
    fn input_tensors(&mut self, inputs: &[HostTensor]) -> Result<Vec<Tensor>, ExecError> {
        plan::check_inputs(&self.model, &self.inputs, inputs)?;
        let key = plan::shape_key(inputs);
        let (model, layers, specs, params) =
            (&self.model, &self.layers, &self.inputs, &self.param_shapes);
        self.shapes.get_or_try_insert(&key, || {
            plan::layer_shapes(model, layers, specs, &key, params)
        })?;
        inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                match &t.data {
                    TensorData::F32(v) => Tensor::from_slice(v, t.shape.as_slice(), &Device::Cpu),
                    TensorData::I64(v) => Tensor::from_slice(v, t.shape.as_slice(), &Device::Cpu),
                }
                .map_err(|e| ExecError::BadInput {
                    model: self.model.clone(),
                    index: i,
                    got: t.describe(),
                    want: format!("a tensor candle accepts ({e})"),
                })
            })
            .collect()
    }

    /// The layer's prepared params (`None` for a layer without params);
    /// prepared now unless an upload or an earlier run did.
    fn prepared(&self, i: usize) -> Result<Option<Arc<Prepared>>, ExecError> {
        if self.params.locs[i].is_empty() {
            return Ok(None);
        }
        self.params.get_or_prepare(&self.arena, i).map(Some)
    }
}

impl Program for CpuProgram {
    fn run(
        &mut self,
        inputs: &[HostTensor],
        gate: &mut dyn FnMut(usize) -> Result<(), ExecError>,
        trace: &mut Trace,
    ) -> Result<Vec<HostTensor>, ExecError> {
        let start = Instant::now();
        let model_inputs = self.input_tensors(inputs)?;
        let mut values: Vec<Option<Tensor>> = vec![None; self.layers.len()];
        let mut gated = vec![false; self.groups];
        for i in 0..self.layers.len() {
            if let Some(g) = self.layers[i].group {
                if !self.params.locs[i].is_empty() && !gated[g] {
                    gate(g)?;
                    gated[g] = true;
                    trace.push((start.elapsed(), TraceEvent::GroupReady { group: g }));
                }
            }
            trace.push((start.elapsed(), TraceEvent::LayerStart { layer: i }));
            let prepared = self.prepared(i)?;
            let mut args = Vec::with_capacity(self.layers[i].inputs.len());
            for &input in &self.layers[i].inputs {
                let t = if input < 0 {
                    &model_inputs[(-input - 1) as usize]
                } else {
                    values[input as usize].as_ref().ok_or_else(|| {
                        self.layer_error(i, format!("input {input} was already freed"))
                    })?
                };
                args.push(t.clone());
            }
            let layer = &self.layers[i];
            let out = ops::apply(&layer.op, &args, prepared.as_deref())
                .map_err(|e| plan::layer_error(&self.model, layer, e.to_string()))?;
            drop(args);
            values[i] = Some(out);
            for &v in &self.frees_after[i] {
                values[v] = None;
            }
            trace.push((start.elapsed(), TraceEvent::LayerEnd { layer: i }));
        }
        self.outputs
            .iter()
            .map(|&o| {
                let t = values[o]
                    .as_ref()
                    .ok_or_else(|| self.layer_error(o, "output was freed".into()))?;
                ops::to_host(t)
                    .map_err(|e| self.layer_error(o, format!("cannot read the output: {e}")))
            })
            .collect()
    }
}
