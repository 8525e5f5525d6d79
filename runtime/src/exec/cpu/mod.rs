//! The `cpu` executor: candle on the CPU, real numbers.
//!
//! * [`CpuArena`]: the cpu's device memory for one model. An upload writes
//!   a group's bytes (widened, for half precision) into that group's own f32
//!   storage, the storage the kernels' tensors view: a layer's weights are
//!   views into it, never copies. When a program is compiled against the
//!   arena, the upload also prepares the group's layers (views, batch norm's
//!   folded tables), so compute finds every gated layer ready; a group
//!   uploaded before any program (`distmind infer` uploads first) is
//!   prepared the first time a run reaches it, after `gate(group)` returned.
//!   This copy is the cpu's H2D (what the copy engine does on a GPU): it
//!   runs in the upload stage, overlapping the fetch of later groups.
//! * Group memory comes from the executor's pool of freed group memory, as
//!   a GPU framework's caching allocator hands out device memory: a copy
//!   into fresh pages costs several times a copy into pages already
//!   faulted in, and that cost would sit on the critical path of every
//!   cold start (`bench coldstart --executor cpu`'s upload stage for GPT-2
//!   on a 2-core VM: 461 ms into fresh tensors, 82 ms into pooled memory).
//! * [`CpuProgram`]: interprets `manifest.layers` in order with the params
//!   its arena's uploads prepared. Prepared params are kept for later runs:
//!   params never change once uploaded, and a program lives as long as its
//!   arena.
//! * Activations are dropped right after their last reader ran (last uses are
//!   computed once when the program is built), so a full-scale model at
//!   batch 8 holds only the live tensors.
//!
//! Op semantics are `models/OPS.md`'s (torchvision / Hugging Face in eval
//! mode); the kernels live in `ops` and `attention`.
//!
//! **Architecture invariants:** no view of a group's memory exists before
//! that group's upload returned; no group memory goes back to the pool while
//! a program's params may still view it (only an arena whose params nobody
//! else holds gives its memory back, on drop).

mod attention;
mod ops;
mod params;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{CpuStorage, Device, InplaceOp1, Layout, Tensor};
use distmind_models::dtype::widen;
use distmind_models::{Manifest, ParamDtype};

use super::plan::{self, ParamLoc};
use super::{
    Arena, ExecError, Executor, ExecutorKind, HostTensor, Program, TensorData, Trace, TraceEvent,
};
use params::Prepared;

/// The candle CPU backend behind [`Executor`].
#[derive(Debug, Default)]
pub struct CpuExecutor {
    pool: Arc<Mutex<MemPool>>,
    /// Models compiled once, for every program made of them.
    compiler: plan::Compiler,
}

/// Most bytes of freed group memory kept for reuse, per executor.
pub const ARENA_POOL_BYTES_MAX: u64 = 8 << 30;

/// Freed group memory (1-D f32 tensors that nothing else views), kept for
/// the next uploads, and the group memory the executor's arenas hold.
///
/// The pool never makes the executor hold more than the most group memory
/// its arenas ever held at once (`peak`): before a fresh allocation it
/// frees pooled memory until pooled + live + the new one fit under that
/// peak (raised by the new one if it must be), so pooling costs no memory
/// a run without it would not have used at its peak. Also bounded by
/// [`ARENA_POOL_BYTES_MAX`].
#[derive(Debug, Default)]
struct MemPool {
    free: Vec<Tensor>,
    /// Bytes in `free`.
    bytes: u64,
    /// Bytes of group memory the executor's arenas hold.
    live: u64,
    /// The most `live` ever was.
    peak: u64,
}

impl MemPool {
    /// The shortest pooled storage of at least `elems` f32 values that
    /// wastes at most half of itself, now live.
    fn take(&mut self, elems: usize) -> Option<Tensor> {
        let fits = |t: &Tensor| {
            let len = t.elem_count();
            len >= elems && len <= elems.saturating_mul(2)
        };
        let i = (0..self.free.len())
            .filter(|&i| fits(&self.free[i]))
            .min_by_key(|&i| self.free[i].elem_count())?;
        let t = self.free.swap_remove(i);
        let bytes = storage_bytes(&t);
        self.bytes -= bytes;
        self.live += bytes;
        Some(t)
    }

    /// Counts `bytes` of fresh memory as live, first freeing pooled memory
    /// so that pooled + live stays within the peak.
    fn make_room(&mut self, bytes: u64) {
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        while self.bytes + self.live > self.peak {
            let Some(t) = self.free.pop() else { break };
            self.bytes -= storage_bytes(&t);
        }
    }

    /// Takes back a live storage that nothing views any more.
    fn give(&mut self, storage: Tensor) {
        let bytes = storage_bytes(&storage);
        self.live = self.live.saturating_sub(bytes);
        if self.bytes + bytes <= ARENA_POOL_BYTES_MAX {
            self.bytes += bytes;
            self.free.push(storage);
        }
    }

    /// A live storage that is dropped instead (it may still be viewed, or
    /// its allocation failed).
    fn forget(&mut self, bytes: u64) {
        self.live = self.live.saturating_sub(bytes);
    }
}

impl CpuExecutor {
    pub fn new() -> Self {
        CpuExecutor::default()
    }
}

/// The variable candle's CPU backend reads for its thread count.
pub const THREADS_ENV: &str = "RAYON_NUM_THREADS";

/// Fixes candle's CPU thread count for this process and its children, so
/// that kernels stop counting cores.
///
/// Candle (0.11) asks for its thread count on every matrix product and
/// convolution. Without [`THREADS_ENV`] it counts the physical cores by
/// parsing `/proc/cpuinfo` each time: about 30 us on a 2-core host, more
/// with more cores, 155 times per ResNet-152 inference. Setting the
/// variable to the count candle would pick (computed here once) makes each
/// ask an environment lookup. A value already set is kept. (Rayon's
/// global pool reads the variable too; candle runs in a pool of its own,
/// and nothing in this program uses the global one.)
///
/// Call it first thing in `main`, before any thread starts: it changes the
/// process's environment, which another thread must not read meanwhile.
pub fn settle_thread_count() {
    let current = std::env::var(THREADS_ENV).ok();
    if let Some(n) = thread_count_to_set(current.as_deref(), candle_core::utils::get_num_threads) {
        std::env::set_var(THREADS_ENV, n.to_string());
    }
}

/// What [`settle_thread_count`] sets, given the variable's value now:
/// nothing when it holds a count candle uses (parsed as candle parses it),
/// else candle's default, which candle would use anyway.
fn thread_count_to_set(current: Option<&str>, default: impl FnOnce() -> usize) -> Option<usize> {
    match current.map(|v| v.parse::<usize>()) {
        Some(Ok(n)) if n > 0 => None,
        _ => Some(default().max(1)),
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

    /// A new cpu executor: its own memory pool.
    fn for_device(&self, _ordinal: u32) -> Result<Arc<dyn Executor>, ExecError> {
        Ok(Arc::new(CpuExecutor::new()))
    }

    fn alloc_arena(&self, bytes: u64) -> Result<Arc<dyn Arena>, ExecError> {
        let mut arena = CpuArena::new(bytes)?;
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
        Ok(Box::new(CpuProgram::new(
            self.compiler.compile(manifest)?,
            cpu_arena,
        )?))
    }
}

/// One uploaded group's memory.
#[derive(Debug)]
struct GroupMem {
    /// Arena (device) offset of its first byte.
    offset: u64,
    /// Device bytes uploaded.
    len: u64,
    /// 1-D f32 values; longer than `len / 4` when it came from the pool.
    storage: Tensor,
}

impl GroupMem {
    /// A view of `loc`'s values (1-D), which must lie inside this group.
    fn view(&self, group: usize, loc: &ParamLoc) -> Result<Tensor, ExecError> {
        let start = loc.offset.checked_sub(self.offset);
        let inside = start.is_some_and(|s| {
            s.is_multiple_of(4)
                && loc.nbytes.is_multiple_of(4)
                && s.checked_add(loc.nbytes).is_some_and(|e| e <= self.len)
        });
        let (Some(start), true) = (start, inside) else {
            return Err(ExecError::Gate {
                group,
                why: format!(
                    "param {} ({} bytes at arena offset {}) is not whole f32 values inside \
                     the {} bytes uploaded at offset {}",
                    loc.name, loc.nbytes, loc.offset, self.len, self.offset
                ),
            });
        };
        self.storage
            .narrow(0, start as usize / 4, loc.nbytes as usize / 4)
            .map_err(|e| ExecError::Gate {
                group,
                why: format!("param {}: {e}", loc.name),
            })
    }
}

/// Bytes of a 1-D f32 storage.
fn storage_bytes(storage: &Tensor) -> u64 {
    4 * storage.elem_count() as u64
}

/// Writes a group's stored bytes, widened to f32, into the storage range a
/// tensor views: the one write to group memory.
struct Write<'a> {
    stored: ParamDtype,
    bytes: &'a [u8],
}

impl InplaceOp1 for Write<'_> {
    fn name(&self) -> &'static str {
        "upload"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(values) = storage else {
            candle_core::bail!("group memory is not f32");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("group memory is not contiguous");
        };
        widen(self.stored, self.bytes, &mut values[start..end]);
        Ok(())
    }
}

/// `elems` zeroed f32 values, or an error when the allocator has no room
/// (instead of the abort a failed `vec!` is). Fresh pages are zeroed by
/// the kernel when first touched, so this costs no pass over them.
fn zeroed_f32(elems: usize) -> Result<Vec<f32>, ExecError> {
    let bytes = elems as u64 * 4;
    let layout = std::alloc::Layout::array::<f32>(elems).map_err(|_| ExecError::Alloc {
        bytes,
        why: "larger than the address space".into(),
    })?;
    if elems == 0 {
        return Ok(Vec::new());
    }
    #[allow(unsafe_code)]
    // SAFETY: `layout` is non-zero-sized (checked); a non-null pointer from
    // `alloc_zeroed` with the layout of `[f32; elems]` is exactly what
    // `Vec::from_raw_parts` takes with capacity and length `elems`, and
    // all-zero bytes are valid f32 values (0.0).
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<f32>();
        if ptr.is_null() {
            return Err(ExecError::Alloc {
                bytes,
                why: "out of memory".into(),
            });
        }
        Ok(Vec::from_raw_parts(ptr, elems, elems))
    }
}

/// One model's parameters on the cpu device: per group, its memory.
#[derive(Debug)]
pub struct CpuArena {
    len: u64,
    /// Where group memory comes from and goes back to (arenas from an
    /// executor).
    pool: Option<Arc<Mutex<MemPool>>>,
    /// The params of the program compiled against this arena, which
    /// `upload` prepares group by group (`None` before any program).
    params: Mutex<Option<Arc<LayerParams>>>,
    /// Per group: its memory, once uploaded.
    groups: Mutex<Vec<Option<GroupMem>>>,
}

impl Drop for CpuArena {
    fn drop(&mut self) {
        // Views of group memory live only in the params (and, during a
        // run, in the program that holds this arena): once the params are
        // ours alone, dropping them drops every view.
        let params = self
            .params
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let sole = params.is_none_or(|p| Arc::strong_count(&p) == 1);
        let groups = std::mem::take(self.groups.get_mut().unwrap_or_else(|e| e.into_inner()));
        let Some(pool) = self.pool.as_ref() else {
            return;
        };
        let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
        for g in groups.into_iter().flatten() {
            if sole {
                pool.give(g.storage);
            } else {
                pool.forget(storage_bytes(&g.storage));
            }
        }
    }
}

impl CpuArena {
    pub fn new(bytes: u64) -> Result<Self, ExecError> {
        if usize::try_from(bytes).is_err() {
            return Err(ExecError::Alloc {
                bytes,
                why: "larger than the address space".into(),
            });
        }
        Ok(CpuArena {
            len: bytes,
            pool: None,
            params: Mutex::new(None),
            groups: Mutex::new(Vec::new()),
        })
    }

    /// Storage for `elems` f32 values: pooled when the pool has some.
    fn storage(&self, elems: usize) -> Result<Tensor, ExecError> {
        let bytes = elems as u64 * 4;
        if let Some(pool) = &self.pool {
            let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(t) = pool.take(elems) {
                return Ok(t);
            }
            pool.make_room(bytes);
        }
        let fresh = zeroed_f32(elems).and_then(|values| {
            Tensor::from_vec(values, elems, &Device::Cpu).map_err(|e| ExecError::Alloc {
                bytes,
                why: e.to_string(),
            })
        });
        if let (Err(_), Some(pool)) = (&fresh, &self.pool) {
            pool.lock().unwrap_or_else(|e| e.into_inner()).forget(bytes);
        }
        fresh
    }

    /// Hands back a live storage this arena no longer holds, which views
    /// may still read: dropped, not pooled.
    fn drop_storage(&self, storage: Tensor) {
        if let Some(pool) = &self.pool {
            let bytes = storage_bytes(&storage);
            drop(storage);
            pool.lock().unwrap_or_else(|e| e.into_inner()).forget(bytes);
        }
    }

    /// A view of `loc`'s values in group `group`'s memory.
    fn view(&self, group: usize, loc: &ParamLoc) -> Result<Tensor, ExecError> {
        let groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        match groups.get(group).and_then(Option::as_ref) {
            Some(mem) => mem.view(group, loc),
            None => Err(ExecError::Gate {
                group,
                why: "never uploaded".into(),
            }),
        }
    }
}

impl Arena for CpuArena {
    fn len(&self) -> u64 {
        self.len
    }

    /// Synchronous: the bytes are in the group's memory (widened, for half
    /// precision) when it returns.
    #[allow(unsafe_code)]
    unsafe fn upload_async(
        &self,
        group: usize,
        offset: u64,
        stored: ParamDtype,
        bytes: &[u8],
    ) -> Result<(), ExecError> {
        let range = super::device_range(group, offset, stored, bytes, self.len)?;
        let len = range.end - range.start;
        if !len.is_multiple_of(4) {
            return Err(ExecError::Gate {
                group,
                why: format!("{len} bytes are not whole f32 values"),
            });
        }
        let elems = (len / 4) as usize;
        let storage = self.storage(elems)?;
        let write = Write { stored, bytes };
        let written = storage
            .narrow(0, 0, elems)
            .and_then(|dst| dst.inplace_op1(&write));
        if let Err(e) = written {
            self.drop_storage(storage);
            return Err(ExecError::Gate {
                group,
                why: format!("upload: {e}"),
            });
        }
        let mem = GroupMem {
            offset,
            len,
            storage,
        };
        let params = self
            .params
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        // Prepared from this upload's memory, so a second upload of the
        // group replaces what the first prepared.
        if let Some(Err(e)) = params.map(|p| p.prepare_group(group, &mem)) {
            // Layers prepared before the failure may view it.
            self.drop_storage(mem.storage);
            return Err(e);
        }
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        if groups.len() <= group {
            groups.resize_with(group + 1, || None);
        }
        // The memory it replaces may still be viewed: it is dropped, not pooled.
        if let Some(old) = groups[group].replace(mem) {
            self.drop_storage(old.storage);
        }
        Ok(())
    }
}

/// Prepared params of one program, per layer: filled by the arena's
/// uploads (group by group) or, for a group uploaded before the program
/// was compiled, by the first run that reaches the layer.
#[derive(Debug)]
struct LayerParams {
    /// Where each layer's params are (shared by every program of the model).
    compiled: Arc<plan::Compiled>,
    /// Per layer: its prepared params, once prepared.
    prepared: Vec<Mutex<Option<Arc<Prepared>>>>,
}

impl LayerParams {
    fn new(compiled: Arc<plan::Compiled>) -> Self {
        LayerParams {
            prepared: (0..compiled.params.len())
                .map(|_| Mutex::new(None))
                .collect(),
            compiled,
        }
    }

    fn layer_error(&self, i: usize, why: String) -> ExecError {
        plan::layer_error(self.compiled.name(), &self.compiled.layers()[i], why)
    }

    fn slot(&self, i: usize) -> std::sync::MutexGuard<'_, Option<Arc<Prepared>>> {
        self.prepared[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Layer `i`'s params, prepared now from its group's memory unless an
    /// upload or an earlier run did. The caller guarantees the group's
    /// upload returned (its gate did).
    fn get_or_prepare(&self, arena: &CpuArena, i: usize) -> Result<Arc<Prepared>, ExecError> {
        if let Some(p) = self.slot(i).as_ref() {
            return Ok(p.clone());
        }
        let Some(group) = self.compiled.layers()[i].group else {
            return Err(self.layer_error(i, "has params but no group".into()));
        };
        let p = Arc::new(self.prepare(i, |loc| arena.view(group, loc))?);
        *self.slot(i) = Some(p.clone());
        Ok(p)
    }

    /// Prepares every layer of `group` from `mem`, the group's memory.
    fn prepare_group(&self, group: usize, mem: &GroupMem) -> Result<(), ExecError> {
        for &i in self
            .compiled
            .by_group
            .get(group)
            .map_or(&[][..], Vec::as_slice)
        {
            let p = self.prepare(i, |loc| mem.view(group, loc))?;
            *self.slot(i) = Some(Arc::new(p));
        }
        Ok(())
    }

    fn prepare(
        &self,
        i: usize,
        mut values: impl FnMut(&ParamLoc) -> Result<Tensor, ExecError>,
    ) -> Result<Prepared, ExecError> {
        let locs = &self.compiled.params[i];
        let mut raw = Vec::with_capacity(locs.len());
        for loc in locs {
            raw.push((loc.name.as_str(), loc.shape.as_slice(), values(loc)?));
        }
        params::prepare(&self.compiled.layers()[i].op, raw)
            .map_err(|e| self.layer_error(i, e.to_string()))
    }
}

/// A model compiled for the CPU against one arena.
pub struct CpuProgram {
    /// The model's layers, outputs, frees and per-shape layer shapes,
    /// shared with every other program of it.
    compiled: Arc<plan::Compiled>,
    /// Per layer: its params, prepared by the arena's uploads (shared with
    /// the arena) or by the first run that reached it.
    params: Arc<LayerParams>,
    arena: Arc<CpuArena>,
}

impl CpuProgram {
    fn new(compiled: Arc<plan::Compiled>, arena: Arc<CpuArena>) -> Result<Self, ExecError> {
        compiled.check_arena(arena.len)?;
        let params = Arc::new(LayerParams::new(compiled.clone()));
        // From now on every upload to the arena prepares its group's params.
        *arena.params.lock().unwrap_or_else(|e| e.into_inner()) = Some(params.clone());
        Ok(CpuProgram {
            compiled,
            params,
            arena,
        })
    }

    fn layer_error(&self, i: usize, why: String) -> ExecError {
        self.params.layer_error(i, why)
    }

    /// Checks the inputs against the manifest (the batch, and the length of
    /// token inputs, may differ) and the graph at their shapes (inferred
    /// before the first run at a shape, so a shape the graph cannot take
    /// fails before any group is waited for; the kernels read shapes from
    /// their tensors), and wraps them as tensors.
    fn input_tensors(&self, inputs: &[HostTensor]) -> Result<Vec<Tensor>, ExecError> {
        let model = self.compiled.name();
        plan::check_inputs(model, self.compiled.inputs(), inputs)?;
        self.compiled.layer_shapes(&plan::shape_key(inputs))?;
        inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                match &t.data {
                    TensorData::F32(v) => Tensor::from_slice(v, t.shape.as_slice(), &Device::Cpu),
                    TensorData::I64(v) => Tensor::from_slice(v, t.shape.as_slice(), &Device::Cpu),
                }
                .map_err(|e| ExecError::BadInput {
                    model: model.to_string(),
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
        if self.compiled.params[i].is_empty() {
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
        let layers = self.compiled.layers();
        let mut values: Vec<Option<Tensor>> = vec![None; layers.len()];
        let mut gated = vec![false; self.compiled.groups()];
        for (i, layer) in layers.iter().enumerate() {
            if let Some(g) = layer.group {
                if !self.compiled.params[i].is_empty() && !gated[g] {
                    gate(g)?;
                    gated[g] = true;
                    trace.push((start.elapsed(), TraceEvent::GroupReady { group: g }));
                }
            }
            trace.push((start.elapsed(), TraceEvent::LayerStart { layer: i }));
            let prepared = self.prepared(i)?;
            let mut args = Vec::with_capacity(layer.inputs.len());
            for &input in &layer.inputs {
                let t = if input < 0 {
                    &model_inputs[(-input - 1) as usize]
                } else {
                    values[input as usize].as_ref().ok_or_else(|| {
                        self.layer_error(i, format!("input {input} was already freed"))
                    })?
                };
                args.push(t.clone());
            }
            let out = ops::apply(&layer.op, &args, prepared.as_deref())
                .map_err(|e| self.layer_error(i, e.to_string()))?;
            drop(args);
            values[i] = Some(out);
            for &v in &self.compiled.frees_after[i] {
                values[v] = None;
            }
            trace.push((start.elapsed(), TraceEvent::LayerEnd { layer: i }));
        }
        self.compiled
            .outputs
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
