//! Executors: what runs a model's layers once its parameters are in the
//! executor's memory. One interface, three backends:
//!
//! * `cpu`  — candle on the CPU, real numbers (tests, laptops).
//! * `cuda` — cudarc memory, streams and events (cargo feature `cuda`).
//! * `sim`  — no math: each layer takes the time a profile recorded for it
//!   (`settings/profiles/<name>.json`); outputs are marked simulated.
//!
//! The pipeline (network -> host cache -> arena -> compute) is the runtime's,
//! not the executor's: the runtime uploads group g with [`Arena::upload`] as
//! soon as it arrived, and [`Program::run`] calls `gate(g)` before the first
//! layer whose parameters live in group g, so compute of group g starts while
//! later groups are still on their way.

pub(crate) mod candle_ops;
pub mod cpu;
pub mod cuda;
pub mod plan;
pub mod sim;
#[cfg(test)]
mod test_values;

use std::sync::Arc;
use std::time::Duration;

use distmind_models::{Manifest, ParamDtype};

/// Which backend, as named on the command line (`--executor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExecutorKind {
    Cpu,
    Cuda,
    Sim,
}

impl std::str::FromStr for ExecutorKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(ExecutorKind::Cpu),
            "cuda" => Ok(ExecutorKind::Cuda),
            "sim" => Ok(ExecutorKind::Sim),
            _ => Err(format!("unknown executor {s:?}: expected cpu, cuda or sim")),
        }
    }
}

impl ExecutorKind {
    /// Nice value of the threads that move bytes to this executor's devices
    /// (transport, fetch engine; the upload has
    /// [`stage_thread_nice`](Self::stage_thread_nice)): lowered where compute runs on the same
    /// host cores (`cpu`), so that compute, the cold start's critical path,
    /// comes first (see [`distmind_transport::priority`]); 0 elsewhere.
    pub fn data_thread_nice(self) -> i32 {
        match self {
            ExecutorKind::Cpu => distmind_transport::priority::DATA_THREAD_NICE_HOST_COMPUTE,
            ExecutorKind::Cuda | ExecutorKind::Sim => 0,
        }
    }

    /// Nice value of a device's stage threads (the fetch wait and the
    /// upload): where compute shares the host's cores (`cpu`), above
    /// compute's and below the transport's
    /// ([`UPLOAD_THREAD_NICE_HOST_COMPUTE`](distmind_transport::priority::UPLOAD_THREAD_NICE_HOST_COMPUTE));
    /// 0 elsewhere.
    pub fn stage_thread_nice(self) -> i32 {
        match self {
            ExecutorKind::Cpu => distmind_transport::priority::UPLOAD_THREAD_NICE_HOST_COMPUTE,
            ExecutorKind::Cuda | ExecutorKind::Sim => 0,
        }
    }
}

impl std::fmt::Display for ExecutorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExecutorKind::Cpu => "cpu",
            ExecutorKind::Cuda => "cuda",
            ExecutorKind::Sim => "sim",
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    #[error("executor {executor} is not available here: {why}")]
    Unavailable { executor: ExecutorKind, why: String },
    #[error("cannot allocate a {bytes}-byte parameter arena: {why}")]
    Alloc { bytes: u64, why: String },
    #[error("upload of {len} bytes at offset {offset} does not fit an arena of {arena} bytes")]
    UploadOutOfRange { offset: u64, len: u64, arena: u64 },
    #[error("model {model}: input {index} is {got}, expected {want}")]
    BadInput {
        model: String,
        index: usize,
        got: String,
        want: String,
    },
    #[error("model {model} layer {layer} ({name}, {op}): {why}")]
    Layer {
        model: String,
        layer: usize,
        name: String,
        op: String,
        why: String,
    },
    #[error("model {model}: {why}")]
    Model { model: String, why: String },
    #[error("waiting for parameter group {group}: {why}")]
    Gate { group: usize, why: String },
}

/// A tensor in host memory: the runtime's request and reply format.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: TensorData,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

impl HostTensor {
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?} vs {} values",
            data.len()
        );
        HostTensor {
            shape,
            data: TensorData::F32(data),
        }
    }

    pub fn i64(shape: Vec<usize>, data: Vec<i64>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?} vs {} values",
            data.len()
        );
        HostTensor {
            shape,
            data: TensorData::I64(data),
        }
    }

    pub fn dtype_name(&self) -> &'static str {
        match self.data {
            TensorData::F32(_) => "f32",
            TensorData::I64(_) => "i64",
        }
    }

    /// `"f32 [1, 3, 32, 32]"`, for error messages.
    pub fn describe(&self) -> String {
        format!("{} {:?}", self.dtype_name(), self.shape)
    }
}

/// One model's parameter memory in the executor's address space (device
/// memory for `cuda`): ONE contiguous allocation in the packed layout of the
/// manifest, so parameter `p` lives at `p.offset` bytes past the start of its
/// group, which starts at `manifest.groups[g].offset`.
///
/// Two ways in: [`Arena::upload`] (safe: the copy is done reading the host
/// bytes when it returns) and [`Arena::upload_async`] (unsafe: the copy may
/// go on reading them until [`Arena::wait_uploaded`]), which lets a host-side
/// stage move on while a DMA engine copies.
pub trait Arena: std::any::Any + Send + Sync {
    fn len(&self) -> u64;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts copying one group's bytes to `offset`: `bytes` are the
    /// group's stored bytes, little-endian values of `stored` (the
    /// manifest's `param_dtype`), and the arena receives them as f32
    /// (`stored.device_bytes(bytes.len())` bytes at the device offset
    /// `offset`, see `distmind_models::dtype`): half precision is widened on
    /// the way (`cpu`: in this call; `cuda`: by a kernel after the copy;
    /// `sim` takes the time of the stored bytes, the bytes that cross the
    /// link). When it returns, a later `Program::run` that gates on `group`
    /// sees the values: on `cpu` and `sim` the copy is done; on `cuda` it is
    /// enqueued on the copy stream and an event is recorded that the
    /// compute stream waits for. Groups may be uploaded from another thread
    /// than the one running the program, but each group is uploaded by one
    /// thread at a time.
    ///
    /// # Safety
    ///
    /// The copy may still be reading `bytes` after this returns (`cuda`,
    /// from page-locked memory: the DMA engine reads the host bytes until
    /// the copy completes). The caller must keep `bytes` allocated and
    /// unchanged until [`Arena::wait_uploaded`] for `group` returned, whether
    /// this call succeeded or not (a failed call may have enqueued part of
    /// the copy), and must call it before letting the memory go: for bytes
    /// in the host cache, hold the model's pin (a
    /// [`CachedModel`](crate::cache::CachedModel)) until then, so that no
    /// eviction or new reservation reuses the blocks under the DMA.
    #[allow(unsafe_code)]
    unsafe fn upload_async(
        &self,
        group: usize,
        offset: u64,
        stored: ParamDtype,
        bytes: &[u8],
    ) -> Result<(), ExecError>;

    /// Blocks until every copy [`Arena::upload_async`] started for `group`
    /// stopped reading its host bytes (a `cuda` copy's completion event).
    /// Synchronous arenas (`cpu`, `sim`) return at once.
    fn wait_uploaded(&self, _group: usize) -> Result<(), ExecError> {
        Ok(())
    }

    /// [`Arena::upload_async`] and [`Arena::wait_uploaded`]: when it
    /// returns, `bytes` may be dropped or reused.
    fn upload_stored(
        &self,
        group: usize,
        offset: u64,
        stored: ParamDtype,
        bytes: &[u8],
    ) -> Result<(), ExecError> {
        #[allow(unsafe_code)]
        // SAFETY: `bytes` is borrowed for this whole call, and the call
        // waits for the copy to stop reading it, failed or not.
        let started = unsafe { self.upload_async(group, offset, stored, bytes) };
        let done = self.wait_uploaded(group);
        started.and(done)
    }

    /// [`Arena::upload_stored`] of f32 bytes (a package stored as f32,
    /// whose device and stored layouts are the same).
    fn upload(&self, group: usize, offset: u64, bytes: &[u8]) -> Result<(), ExecError> {
        self.upload_stored(group, offset, ParamDtype::F32, bytes)
    }
}

/// The device bytes `bytes` stored bytes of `stored` take at `offset`, as
/// the range an upload writes; an error when they do not fit an arena of
/// `arena` bytes, or are not whole half-precision values.
pub fn device_range(
    group: usize,
    offset: u64,
    stored: ParamDtype,
    bytes: &[u8],
    arena: u64,
) -> Result<std::ops::Range<u64>, ExecError> {
    let len = bytes.len() as u64;
    let device_len = stored.device_bytes(len);
    let range = match offset.checked_add(device_len) {
        Some(end) if end <= arena => offset..end,
        _ => {
            return Err(ExecError::UploadOutOfRange {
                offset,
                len: device_len,
                arena,
            })
        }
    };
    // f32 bytes are copied as they are; half values are widened in pairs.
    if stored.is_half() && !len.is_multiple_of(stored.size_bytes()) {
        return Err(ExecError::Gate {
            group,
            why: format!("{len} bytes are not whole {stored} values"),
        });
    }
    Ok(range)
}

/// What happened when, for pipeline traces and the timing breakdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceEvent {
    /// `gate(group)` returned: the group's parameters are usable.
    GroupReady {
        group: usize,
    },
    LayerStart {
        layer: usize,
    },
    LayerEnd {
        layer: usize,
    },
}

/// Events with the time since the run started.
pub type Trace = Vec<(Duration, TraceEvent)>;

/// A model compiled for one executor against one arena.
pub trait Program: Send {
    /// Runs the forward pass. Before the first layer that reads group g it
    /// calls `gate(g)` (once per group per run), which blocks until group g
    /// was uploaded, or fails. Returns the manifest's outputs in order.
    /// Outputs of `sim` are zero-filled and `simulated()` is true.
    fn run(
        &mut self,
        inputs: &[HostTensor],
        gate: &mut dyn FnMut(usize) -> Result<(), ExecError>,
        trace: &mut Trace,
    ) -> Result<Vec<HostTensor>, ExecError>;

    /// True when outputs are not computed (the `sim` executor).
    fn simulated(&self) -> bool {
        false
    }
}

/// A backend: allocates arenas and compiles programs.
pub trait Executor: Send + Sync {
    fn kind(&self) -> ExecutorKind;

    /// One line for logs and bench headers, e.g. `cpu (candle, 2 threads)`.
    fn describe(&self) -> String;

    /// A new executor of this one's kind and settings for device
    /// `ordinal`, sharing no state with this one (pools, streams, queues): a
    /// runtime runs one per device. `cuda` opens GPU `ordinal` (an error
    /// names the ordinal when there is none); `cpu` and `sim` have no
    /// hardware behind the ordinal: every call makes an independent device.
    fn for_device(&self, ordinal: u32) -> Result<Arc<dyn Executor>, ExecError>;

    /// The device this executor runs on, when it is bound to one (`cuda`).
    fn ordinal(&self) -> Option<u32> {
        None
    }

    /// One contiguous parameter arena of `bytes`.
    fn alloc_arena(&self, bytes: u64) -> Result<Arc<dyn Arena>, ExecError>;

    /// Compiles `manifest`'s layer list against `arena`.
    fn program(
        &self,
        manifest: &Manifest,
        arena: Arc<dyn Arena>,
    ) -> Result<Box<dyn Program>, ExecError>;

    /// How long one training iteration (forward, backward and update of
    /// `batch` inputs) of `manifest` holds this executor's simulated GPU:
    /// `None` for executors that compute (cpu, cuda), whose training jobs
    /// run the real SGD step; `Some` for `sim`, whose jobs compute nothing
    /// and hold the device this long instead (an error when its profile
    /// cannot time the model, as for inference).
    fn simulated_train_iteration(
        &self,
        _manifest: &Manifest,
        _batch: usize,
    ) -> Option<Result<Duration, ExecError>> {
        None
    }
}

/// One executor per device of `devices` (the runtime's device ids, which
/// are the executors' ordinals: CUDA device numbers for `cuda`), in order:
/// `template` itself for the device it is bound to, if any, and
/// [`Executor::for_device`] of it for every other. The first failure is
/// returned naming its device.
pub fn per_device(
    template: &Arc<dyn Executor>,
    devices: &[u32],
) -> Result<Vec<Arc<dyn Executor>>, ExecError> {
    devices
        .iter()
        .map(|&ordinal| {
            if template.ordinal() == Some(ordinal) {
                return Ok(template.clone());
            }
            template.for_device(ordinal).map_err(|e| match e {
                ExecError::Unavailable { executor, why } if !why.contains("device") => {
                    ExecError::Unavailable {
                        executor,
                        why: format!("device {ordinal}: {why}"),
                    }
                }
                e => e,
            })
        })
        .collect()
}

/// The concrete arena behind `arena`, if it is a `T`: how an executor gets
/// its own arena type back in [`Executor::program`].
pub fn downcast_arena<T: Arena>(arena: Arc<dyn Arena>) -> Option<Arc<T>> {
    let any: Arc<dyn std::any::Any + Send + Sync> = arena;
    any.downcast::<T>().ok()
}

/// A gate that never waits: every group is already uploaded (warm runs,
/// `distmind infer`).
pub fn all_ready(_group: usize) -> Result<(), ExecError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn on_host_cores_the_upload_ranks_between_compute_and_the_transport() {
        let cpu = ExecutorKind::Cpu;
        assert!(0 < cpu.stage_thread_nice() && cpu.stage_thread_nice() < cpu.data_thread_nice());
        for kind in [ExecutorKind::Sim, ExecutorKind::Cuda] {
            assert_eq!((kind.stage_thread_nice(), kind.data_thread_nice()), (0, 0));
        }
    }

    /// A template that records the ordinals it is asked for, bound to
    /// `bound`, failing for `missing` as a GPU that is not there.
    struct Recorder {
        bound: Option<u32>,
        missing: Option<u32>,
        asked: Arc<Mutex<Vec<u32>>>,
    }

    impl Executor for Recorder {
        fn kind(&self) -> ExecutorKind {
            ExecutorKind::Cuda
        }
        fn describe(&self) -> String {
            format!("recorder on {:?}", self.bound)
        }
        fn for_device(&self, ordinal: u32) -> Result<Arc<dyn Executor>, ExecError> {
            self.asked.lock().unwrap().push(ordinal);
            if Some(ordinal) == self.missing {
                return Err(ExecError::Unavailable {
                    executor: ExecutorKind::Cuda,
                    why: "the driver sees 2 GPUs".into(),
                });
            }
            Ok(Arc::new(Recorder {
                bound: Some(ordinal),
                missing: None,
                asked: self.asked.clone(),
            }))
        }
        fn ordinal(&self) -> Option<u32> {
            self.bound
        }
        fn alloc_arena(&self, bytes: u64) -> Result<Arc<dyn Arena>, ExecError> {
            Err(ExecError::Alloc {
                bytes,
                why: "a recorder has no memory".into(),
            })
        }
        fn program(&self, m: &Manifest, _: Arc<dyn Arena>) -> Result<Box<dyn Program>, ExecError> {
            Err(ExecError::Model {
                model: m.name.clone(),
                why: "a recorder compiles nothing".into(),
            })
        }
    }

    #[test]
    fn per_device_maps_each_device_to_its_own_executor() {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let template: Arc<dyn Executor> = Arc::new(Recorder {
            bound: Some(0),
            missing: None,
            asked: asked.clone(),
        });
        let execs = per_device(&template, &[2, 0, 5]).unwrap();
        let ordinals: Vec<Option<u32>> = execs.iter().map(|e| e.ordinal()).collect();
        assert_eq!(ordinals, [Some(2), Some(0), Some(5)]);
        // The template serves the device it is bound to; the others are new.
        assert!(Arc::ptr_eq(&execs[1], &template));
        assert!(!Arc::ptr_eq(&execs[0], &execs[2]));
        assert_eq!(*asked.lock().unwrap(), [2, 5]);
    }

    #[test]
    fn per_device_names_the_device_that_is_missing() {
        let template: Arc<dyn Executor> = Arc::new(Recorder {
            bound: Some(0),
            missing: Some(7),
            asked: Arc::default(),
        });
        let e = per_device(&template, &[0, 7, 1])
            .err()
            .expect("device 7 is missing")
            .to_string();
        assert!(e.contains("device 7") && e.contains("2 GPUs"), "{e}");
    }

    #[test]
    fn cpu_and_sim_devices_are_independent_executors() {
        let cpu: Arc<dyn Executor> = Arc::new(cpu::CpuExecutor::new());
        let execs = per_device(&cpu, &[0, 1]).unwrap();
        assert_eq!(execs.len(), 2);
        assert!(!Arc::ptr_eq(&execs[0], &execs[1]) && !Arc::ptr_eq(&execs[0], &cpu));
        assert!(execs.iter().all(|e| e.kind() == ExecutorKind::Cpu));
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(crate::profile::SHIPPED_ESTIMATED_PATH);
        let profile = crate::profile::Profile::load(path).unwrap();
        let sim: Arc<dyn Executor> =
            Arc::new(sim::SimExecutor::with_dilation(profile, 2.0).unwrap());
        let execs = per_device(&sim, &[3, 4]).unwrap();
        assert!(!Arc::ptr_eq(&execs[0], &execs[1]));
        // Same profile and dilation on every device.
        assert!(execs.iter().all(|e| e.describe() == sim.describe()));
    }
}
