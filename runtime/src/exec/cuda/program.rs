//! [`CudaExecutor`] and [`CudaProgram`]: a manifest's layer list run on the
//! compute stream, gated per group on the host (`gate(g)`) and on the device
//! (`cuStreamWaitEvent` on the group's upload event).

use std::sync::Arc;
use std::time::Instant;

use distmind_models::{Dtype, Manifest, Op, TensorSpec};

use cudarc::driver::{sys, CudaEvent};

use super::arena::CudaArena;
use super::driver::{cuda_err, Gpu};
use super::ops::{self, dtype_bytes, DevTensor, LayerParams};
use super::CudaOptions;
use crate::exec::plan;
use crate::exec::{
    Arena, ExecError, Executor, ExecutorKind, HostTensor, Program, TensorData, Trace, TraceEvent,
};

/// The CUDA backend behind [`Executor`]: one device, its streams, cuBLAS
/// handle and compiled kernels, shared by every arena and program it makes.
pub struct CudaExecutor {
    gpu: Arc<Gpu>,
    options: CudaOptions,
    /// Models compiled once, for every program made of them.
    compiler: plan::Compiler,
}

impl std::fmt::Debug for CudaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExecutor")
            .field("gpu", &self.gpu)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl CudaExecutor {
    /// Opens CUDA device `device` (loading the driver, NVRTC and cuBLAS at
    /// run time) and compiles the kernels. `Unavailable` when a library or
    /// the device is missing.
    pub fn new(device: usize) -> Result<Self, ExecError> {
        Self::with_options(device, CudaOptions::default())
    }

    /// [`CudaExecutor::new`] with `options`; an error names the device.
    pub fn with_options(device: usize, options: CudaOptions) -> Result<Self, ExecError> {
        let gpu = Gpu::open(device, !options.fresh_arenas).map_err(|e| name_device(device, e))?;
        Ok(CudaExecutor {
            gpu,
            options,
            compiler: plan::Compiler::default(),
        })
    }

    /// The GPU's name as the driver reports it, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn device_name(&self) -> String {
        self.gpu.name.clone()
    }
}

/// `e`, saying which CUDA device it is about unless it does already.
fn name_device(device: usize, e: ExecError) -> ExecError {
    match e {
        ExecError::Unavailable { executor, why } if !why.contains(&format!("device {device}")) => {
            ExecError::Unavailable {
                executor,
                why: format!("CUDA device {device}: {why}"),
            }
        }
        e => e,
    }
}

impl Executor for CudaExecutor {
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Cuda
    }

    fn describe(&self) -> String {
        let (major, minor) = self.gpu.compute_capability;
        format!(
            "cuda ({}, sm_{major}{minor}, device {}{}{})",
            self.gpu.name,
            self.gpu.ctx.ordinal(),
            match (self.options.sync_per_layer, self.options.layer_events) {
                (true, true) => ", sync per layer, layer events",
                (true, false) => ", sync per layer",
                (false, true) => ", layer events",
                (false, false) => "",
            },
            if self.options.per_image_conv {
                ", a GEMM per image"
            } else {
                ""
            }
        )
    }

    /// Opens GPU `ordinal` with this executor's options: its own context
    /// binding, streams, cuBLAS handle and kernels.
    fn for_device(&self, ordinal: u32) -> Result<Arc<dyn Executor>, ExecError> {
        Ok(Arc::new(CudaExecutor::with_options(
            ordinal as usize,
            self.options,
        )?))
    }

    fn ordinal(&self) -> Option<u32> {
        u32::try_from(self.gpu.ctx.ordinal()).ok()
    }

    fn alloc_arena(&self, bytes: u64) -> Result<Arc<dyn Arena>, ExecError> {
        Ok(Arc::new(CudaArena::new(&self.gpu, bytes)?))
    }

    fn program(
        &self,
        manifest: &Manifest,
        arena: Arc<dyn Arena>,
    ) -> Result<Box<dyn Program>, ExecError> {
        let cuda_arena =
            crate::exec::downcast_arena::<CudaArena>(arena.clone()).ok_or_else(|| {
                ExecError::Model {
                    model: manifest.name.clone(),
                    why: "the arena was not allocated by this cuda executor".into(),
                }
            })?;
        Ok(Box::new(CudaProgram::new(
            self.compiler.compile(manifest)?,
            cuda_arena,
            self.options,
        )?))
    }
}

/// A model compiled for one GPU against one arena.
pub struct CudaProgram {
    /// The model's layers, params, outputs, frees and per-shape layer
    /// shapes (what kernel launches and activations are sized by), shared
    /// with every other program of it.
    compiled: Arc<plan::Compiled>,
    /// Device addresses of every layer's params, layer after layer, each
    /// layer's in op order (`param_at` says where a layer's start).
    param_ptrs: Vec<u64>,
    /// Per layer: the index in `param_ptrs` of its first param (one more
    /// entry at the end).
    param_at: Vec<usize>,
    arena: Arc<CudaArena>,
    gpu: Arc<Gpu>,
    options: CudaOptions,
}

impl CudaProgram {
    fn new(
        compiled: Arc<plan::Compiled>,
        arena: Arc<CudaArena>,
        options: CudaOptions,
    ) -> Result<Self, ExecError> {
        compiled.check_arena(arena.len())?;
        let mut param_at = Vec::with_capacity(compiled.params.len() + 1);
        let mut param_ptrs = Vec::new();
        for locs in &compiled.params {
            param_at.push(param_ptrs.len());
            param_ptrs.extend(locs.iter().map(|p| arena.device_ptr(p.offset)));
        }
        param_at.push(param_ptrs.len());
        let gpu = arena.gpu().clone();
        Ok(CudaProgram {
            compiled,
            param_ptrs,
            param_at,
            arena,
            gpu,
            options,
        })
    }

    fn layer_error(&self, i: usize, why: String) -> ExecError {
        plan::layer_error(self.compiled.name(), &self.compiled.layers()[i], why)
    }

    /// Checks the inputs against the manifest (the batch dimension may
    /// differ) and the token ids against every embedding that reads them;
    /// returns the specs at the actual shapes.
    fn check_inputs(&self, inputs: &[HostTensor]) -> Result<Vec<TensorSpec>, ExecError> {
        let model = self.compiled.name();
        plan::check_inputs(model, self.compiled.inputs(), inputs)?;
        let specs: Vec<TensorSpec> = inputs
            .iter()
            .zip(self.compiled.inputs())
            .map(|(t, spec)| TensorSpec {
                shape: t.shape.clone(),
                ..spec.clone()
            })
            .collect();
        // Out-of-vocabulary ids: the cpu executor fails the layer; the kernel
        // cannot, so check on the host, where the ids still are.
        for layer in self.compiled.layers() {
            if let Op::Embedding {
                num_embeddings,
                ids: distmind_models::graph::EmbeddingIds::Input,
                ..
            } = layer.op
            {
                for &input in &layer.inputs {
                    if input >= 0 {
                        continue;
                    }
                    if let TensorData::I64(ids) = &inputs[(-input - 1) as usize].data {
                        if let Some(id) = ids
                            .iter()
                            .find(|&&id| id < 0 || id as u64 >= num_embeddings as u64)
                        {
                            return Err(plan::layer_error(
                                model,
                                layer,
                                format!(
                                    "token id {id} is outside the vocabulary 0..{num_embeddings}"
                                ),
                            ));
                        }
                    }
                }
            }
        }
        Ok(specs)
    }

    fn upload_input(&self, t: &HostTensor, dtype: Dtype) -> Result<DevTensor, String> {
        let dev = DevTensor::new(&self.gpu, t.shape.clone(), dtype)?;
        let bytes: Vec<u8> = match &t.data {
            TensorData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        debug_assert_eq!(bytes.len(), dev.elems() * dtype_bytes(dtype));
        // Pageable: staged by the driver before this returns.
        self.gpu
            .htod_async(dev.buf.ptr(), &bytes, &self.gpu.compute)?;
        Ok(dev)
    }

    fn read_output(&self, t: &DevTensor) -> Result<HostTensor, String> {
        let mut bytes = vec![0u8; t.elems() * dtype_bytes(t.dtype)];
        self.gpu.dtoh_sync(&mut bytes, t.buf.ptr())?;
        Ok(match t.dtype {
            Dtype::F32 => HostTensor::f32(
                t.shape.clone(),
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            Dtype::I64 => HostTensor::i64(
                t.shape.clone(),
                bytes
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect(),
            ),
        })
    }
}

impl Program for CudaProgram {
    fn run(
        &mut self,
        inputs: &[HostTensor],
        gate: &mut dyn FnMut(usize) -> Result<(), ExecError>,
        trace: &mut Trace,
    ) -> Result<Vec<HostTensor>, ExecError> {
        let start = Instant::now();
        let compiled = self.compiled.clone();
        let model_err = |why: String| ExecError::Model {
            model: compiled.name().to_string(),
            why,
        };
        let specs = self.check_inputs(inputs)?;
        let shapes = compiled.layer_shapes(&plan::shape_key(inputs))?;
        let layers = compiled.layers();
        self.gpu.bind().map_err(model_err)?;
        let model_inputs = inputs
            .iter()
            .zip(&specs)
            .map(|(t, spec)| self.upload_input(t, spec.dtype))
            .collect::<Result<Vec<_>, _>>()
            .map_err(model_err)?;
        let mut values: Vec<Option<DevTensor>> = vec![None; layers.len()];
        let mut gated = vec![false; compiled.groups()];
        let mut timing = if self.options.layer_events {
            Some(LayerEvents::start(&self.gpu, start.elapsed(), trace.len()).map_err(model_err)?)
        } else {
            None
        };
        for (i, layer) in layers.iter().enumerate() {
            if let Some(g) = layer.group {
                if !compiled.params[i].is_empty() && !gated[g] {
                    gate(g)?;
                    gated[g] = true;
                    trace.push((start.elapsed(), TraceEvent::GroupReady { group: g }));
                    let event = self.arena.group_event(g).ok_or_else(|| ExecError::Gate {
                        group: g,
                        why: "the gate opened but the group was never uploaded to this arena"
                            .into(),
                    })?;
                    // The device-side gate: kernels enqueued from here on
                    // run only after group g's copy landed.
                    self.gpu.compute.wait(&event).map_err(|e| ExecError::Gate {
                        group: g,
                        why: cuda_err("cuStreamWaitEvent", e),
                    })?;
                }
            }
            trace.push((start.elapsed(), TraceEvent::LayerStart { layer: i }));
            let mut args = Vec::with_capacity(layer.inputs.len());
            for &input in &layer.inputs {
                let t = if input < 0 {
                    &model_inputs[(-input - 1) as usize]
                } else {
                    values[input as usize].as_ref().ok_or_else(|| {
                        self.layer_error(i, format!("input {input} was already freed"))
                    })?
                };
                args.push(t);
            }
            let params = LayerParams {
                ptrs: &self.param_ptrs[self.param_at[i]..self.param_at[i + 1]],
            };
            let out = ops::run_layer(
                &self.gpu,
                &layer.op,
                &args,
                &shapes[i].dims,
                params,
                self.options.per_image_conv,
            )
            .map_err(|why| plan::layer_error(compiled.name(), layer, why))?;
            drop(args);
            values[i] = Some(out);
            for &v in &compiled.frees_after[i] {
                values[v] = None;
            }
            if self.options.sync_per_layer {
                self.gpu
                    .compute
                    .synchronize()
                    .map_err(|e| self.layer_error(i, cuda_err("cuStreamSynchronize", e)))?;
            }
            if let Some(t) = &mut timing {
                t.record(&self.gpu)
                    .map_err(|why| self.layer_error(i, why))?;
            }
            trace.push((start.elapsed(), TraceEvent::LayerEnd { layer: i }));
        }
        let outputs = compiled
            .outputs
            .iter()
            .map(|&o| {
                let t = values[o]
                    .as_ref()
                    .ok_or_else(|| self.layer_error(o, "output was freed".into()))?;
                self.read_output(t)
                    .map_err(|e| self.layer_error(o, format!("cannot read the output: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Every run ends with the compute stream drained (the output copies
        // synchronise it), so inputs and freed activations are quiescent.
        self.gpu
            .compute
            .synchronize()
            .map_err(|e| model_err(cuda_err("cuStreamSynchronize", e)))?;
        if let Some(t) = timing {
            t.restamp(trace).map_err(model_err)?;
        }
        Ok(outputs)
    }
}

/// [`CudaOptions::layer_events`]: one timing event before the first layer
/// and one after each layer, on the compute stream.
struct LayerEvents {
    /// Host time (since the run's start) at which `first` was enqueued.
    origin: std::time::Duration,
    /// The trace's length when the run began: entries before it belong to
    /// earlier runs and keep their times.
    first_entry: usize,
    first: CudaEvent,
    /// After layer i, in layer order.
    after: Vec<CudaEvent>,
}

impl LayerEvents {
    fn start(
        gpu: &Gpu,
        origin: std::time::Duration,
        first_entry: usize,
    ) -> Result<LayerEvents, String> {
        let first = gpu
            .compute
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err("cuEventRecord", e))?;
        Ok(LayerEvents {
            origin,
            first_entry,
            first,
            after: Vec::new(),
        })
    }

    fn record(&mut self, gpu: &Gpu) -> Result<(), String> {
        let event = gpu
            .compute
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err("cuEventRecord", e))?;
        self.after.push(event);
        Ok(())
    }

    /// Rewrites the trace's layer timestamps to device times (the stream
    /// has been synchronised): `LayerStart` of layer i is the event before
    /// it (the previous layer's end), `LayerEnd` its own event.
    fn restamp(self, trace: &mut Trace) -> Result<(), String> {
        let at = |event: &CudaEvent| -> Result<std::time::Duration, String> {
            let ms = self
                .first
                .elapsed_ms(event)
                .map_err(|e| cuda_err("cuEventElapsedTime", e))?;
            Ok(self.origin + std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
        };
        let ends = self.after.iter().map(at).collect::<Result<Vec<_>, _>>()?;
        for (t, ev) in trace.iter_mut().skip(self.first_entry) {
            match *ev {
                TraceEvent::LayerStart { layer } => {
                    *t = if layer == 0 {
                        self.origin
                    } else {
                        ends[layer - 1]
                    }
                }
                TraceEvent::LayerEnd { layer } => *t = ends[layer],
                TraceEvent::GroupReady { .. } => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs without a GPU: an ordinal no machine has is refused, the error
    /// naming it (with or without a driver: "device 4096").
    #[test]
    fn opening_a_missing_gpu_names_its_ordinal() {
        let e = CudaExecutor::with_options(4096, CudaOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("device 4096"), "{e}");
        assert!(matches!(
            name_device(3, ExecError::Unavailable {
                executor: ExecutorKind::Cuda,
                why: "libcuda.so not found".into(),
            }),
            ExecError::Unavailable { why, .. } if why == "CUDA device 3: libcuda.so not found"
        ));
    }
}
