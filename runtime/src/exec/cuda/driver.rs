//! The FFI wrapper of the `cuda` executor: every `unsafe` call of the module
//! lives here. cudarc's safe types own the context, streams, events and
//! modules; this file adds what they do not cover the way the executor needs
//! it: raw device buffers (one arena allocation, stream-ordered activations),
//! kernel launches with plain scalar arguments, cuBLAS GEMMs on raw
//! pointers, host-memory pinning and the H2D bandwidth probe.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaStream};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::kernels::{KERNEL_NAMES, KERNEL_SOURCE};
use super::widen::{widen_grid, widen_kernel, WIDEN_SOURCE, WIDEN_THREADS};
use super::H2dBandwidth;
use crate::cache::{PinHook, Pinned};
use crate::exec::{ExecError, ExecutorKind};
use distmind_models::ParamDtype;

/// Threads per block of the element-wise (grid-stride) kernels.
pub(super) const BLOCK_THREADS: u32 = 256;
/// Most blocks of a grid-stride launch: enough to fill an H200 many times.
pub(super) const GRID_BLOCKS_MAX: u64 = 1 << 16;

pub(super) fn unavailable(why: String) -> ExecError {
    ExecError::Unavailable {
        executor: ExecutorKind::Cuda,
        why,
    }
}

/// A driver, NVRTC or cuBLAS failure as text for an error message.
pub(super) fn cuda_err(what: &str, e: impl std::fmt::Display) -> String {
    format!("{what}: {e}")
}

/// Checks that the shared libraries cudarc loads lazily are present, so that
/// a machine without them gets an error naming them instead of a panic.
/// A library cudarc loads: its short name, what it is, where it comes from,
/// and cudarc's probe.
type LibraryCheck = (
    &'static str,
    &'static str,
    &'static str,
    unsafe fn() -> bool,
);

fn check_libraries() -> Result<(), ExecError> {
    let checks: [LibraryCheck; 3] = [
        (
            "cuda",
            "the NVIDIA driver library (libcuda)",
            "is this a GPU machine with the NVIDIA driver installed?",
            cudarc::driver::sys::is_culib_present,
        ),
        (
            "nvrtc",
            "the CUDA runtime compiler (libnvrtc)",
            "it comes with the CUDA toolkit (13.x)",
            cudarc::nvrtc::sys::is_culib_present,
        ),
        (
            "cublas",
            "cuBLAS (libcublas)",
            "it comes with the CUDA toolkit (13.x)",
            cudarc::cublas::sys::is_culib_present,
        ),
    ];
    for (lib, what, hint, present) in checks {
        // SAFETY: only tries `dlopen` on the candidate names (libloading);
        // loading a library runs its initialisers, which for these libraries
        // have no preconditions.
        if !unsafe { present() } {
            let mut tried = cudarc::get_lib_name_candidates(lib);
            tried.dedup();
            let mut seen = std::collections::HashSet::new();
            tried.retain(|n| seen.insert(n.clone()));
            return Err(unavailable(format!(
                "cannot load {what}: looked for {tried:?} on the loader path; {hint} \
                 Install it or point LD_LIBRARY_PATH at its directory"
            )));
        }
    }
    Ok(())
}

/// A kernel of [`KERNEL_NAMES`], by position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    Relu,
    Tanh,
    GeluErf,
    GeluTanh,
    Add,
    BiasAdd,
    BatchNorm,
    Im2col,
    MaxPool2d,
    AvgPool2d,
    AdaptiveAvgPool2d,
    ConcatCopy,
    Select,
    Embedding,
    LayerNorm,
    SoftmaxRows,
    SplitHeads,
    MergeHeads,
    SwapOuter,
}

impl Kernel {
    pub(super) fn name(self) -> &'static str {
        KERNEL_NAMES[self as usize]
    }
}

/// A kernel argument: device addresses, sizes (`long long`), flags (`int`),
/// floats. Matches the C parameter types of [`KERNEL_SOURCE`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Arg {
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
    F64(f64),
}

/// The device, its streams, cuBLAS and the compiled kernels.
pub(super) struct Gpu {
    /// Device memory of dropped arenas, kept for the next ones. First, so
    /// that it is freed before the streams and context go.
    spares: SparePool,
    pub(super) ctx: Arc<CudaContext>,
    /// Kernels, GEMMs, activation allocations, output copies.
    pub(super) compute: Arc<CudaStream>,
    /// Group uploads into arenas.
    pub(super) copy: Arc<CudaStream>,
    blas: Mutex<BlasHandle>,
    kernels: Vec<CudaFunction>,
    /// The widening kernels of `widen.rs`, by name.
    widen: Vec<(&'static str, CudaFunction)>,
    pub(super) name: String,
    pub(super) compute_capability: (i32, i32),
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

struct BlasHandle(blas_sys::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread, one at a time; the
// handle lives in a Mutex.
unsafe impl Send for BlasHandle {}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle`, destroyed once, here.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// The primary context of `device`, as `Unavailable` errors instead of
/// cudarc's panics and driver codes.
fn context(device: usize) -> Result<Arc<CudaContext>, ExecError> {
    check_libraries()?;
    let count = catch_unwind(CudaContext::device_count)
        .map_err(|_| unavailable("the CUDA driver panicked while counting devices".into()))?
        .map_err(|e| unavailable(cuda_err("cuInit / cuDeviceGetCount failed", e)))?;
    if device >= count.max(0) as usize {
        return Err(unavailable(format!(
            "CUDA device {device} does not exist: the driver sees {count} device(s)"
        )));
    }
    catch_unwind(AssertUnwindSafe(|| CudaContext::new(device)))
        .map_err(|_| unavailable(format!("the CUDA driver panicked opening device {device}")))?
        .map_err(|e| unavailable(cuda_err(&format!("cannot open CUDA device {device}"), e)))
}

impl Gpu {
    /// Opens `device`; with `reuse_arenas`, the memory of dropped arenas
    /// is kept (at most [`SPARES_MAX`]) and handed to the next arena that
    /// fits instead of a `cuMemFree` / `cuMemAlloc` pair per model switch.
    pub(super) fn open(device: usize, reuse_arenas: bool) -> Result<Arc<Gpu>, ExecError> {
        let ctx = context(device)?;
        let ctx_for_pool = ctx.clone();
        let fail = |what: &str, e: &dyn std::fmt::Display| unavailable(cuda_err(what, e));
        // SAFETY: we synchronise streams ourselves (events per group, one
        // compute stream) and never use cudarc's CudaSlice, whose automatic
        // event tracking this turns off.
        unsafe { ctx.disable_event_tracking() };
        if !ctx.has_async_alloc() {
            return Err(unavailable(format!(
                "device {device} has no stream-ordered allocator (cuMemAllocAsync), \
                 which the executor uses for activations"
            )));
        }
        // Keep freed activation memory in the device's pool across runs
        // instead of returning it to the driver at every sync.
        // SAFETY: the pool is the device's default one; the value is a u64
        // as the attribute requires.
        unsafe {
            let pool = result::device::get_default_mem_pool(ctx.cu_device())
                .map_err(|e| fail("cuDeviceGetDefaultMemPool", &e))?;
            let mut threshold = u64::MAX;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
            .map_err(|e| fail("cuMemPoolSetAttribute", &e))?;
        }
        let compute = ctx
            .new_stream()
            .map_err(|e| fail("creating the compute stream", &e))?;
        let copy = ctx
            .new_stream()
            .map_err(|e| fail("creating the copy stream", &e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let cc = ctx
            .compute_capability()
            .map_err(|e| fail("querying the compute capability", &e))?;
        let opts = CompileOptions {
            options: vec![format!("--gpu-architecture=compute_{}{}", cc.0, cc.1)],
            name: Some("distmind_kernels.cu".into()),
            ..Default::default()
        };
        // One module: the widening kernels' names collide with none of the
        // others (tested in widen.rs).
        let source = format!("{KERNEL_SOURCE}\n{WIDEN_SOURCE}");
        let ptx = compile_ptx_with_opts(source, opts)
            .map_err(|e| fail("NVRTC could not compile the executor's kernels", &e))?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| fail("loading the compiled kernels", &e))?;
        let kernels = KERNEL_NAMES
            .iter()
            .map(|k| {
                module
                    .load_function(k)
                    .map_err(|e| fail(&format!("kernel {k} is missing"), &e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let widen = [ParamDtype::BF16, ParamDtype::F16]
            .into_iter()
            .filter_map(widen_kernel)
            .map(|k| {
                module
                    .load_function(k)
                    .map(|f| (k, f))
                    .map_err(|e| fail(&format!("kernel {k} is missing"), &e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let handle = blas::create_handle().map_err(|e| fail("cublasCreate", &e))?;
        let handle = BlasHandle(handle);
        // SAFETY: the handle and stream are alive; the stream outlives the
        // handle (both are owned by this Gpu, the handle is dropped first).
        unsafe {
            blas::set_stream(handle.0, compute.cu_stream() as _)
                .map_err(|e| fail("cublasSetStream", &e))?;
            // Plain FP32 (no TF32): results must match the cpu executor.
            blas_sys::cublasSetMathMode(handle.0, blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
                .result()
                .map_err(|e| fail("cublasSetMathMode", &e))?;
        }
        Ok(Arc::new(Gpu {
            ctx,
            compute,
            copy,
            blas: Mutex::new(handle),
            kernels,
            widen,
            name,
            compute_capability: cc,
            spares: SparePool::new(&ctx_for_pool, reuse_arenas),
        }))
    }

    pub(super) fn bind(&self) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    /// Launches `kernel` over `n` elements, grid-stride, on the compute stream.
    pub(super) fn launch_elems(
        &self,
        kernel: Kernel,
        n: usize,
        args: &[Arg],
    ) -> Result<(), String> {
        if n == 0 {
            return Ok(());
        }
        let blocks = (n as u64)
            .div_ceil(BLOCK_THREADS as u64)
            .min(GRID_BLOCKS_MAX) as u32;
        self.launch(kernel, blocks, BLOCK_THREADS, args)
    }

    /// Launches `kernel` with `blocks` x `threads` on the compute stream.
    pub(super) fn launch(
        &self,
        kernel: Kernel,
        blocks: u32,
        threads: u32,
        args: &[Arg],
    ) -> Result<(), String> {
        let f = &self.kernels[kernel as usize];
        launch_on(f, kernel.name(), (blocks, threads), args, &self.compute)
    }

    /// Enqueues on `stream` the upload of `src`, little-endian values of
    /// `stored` (half precision), as f32 at device address `dst`: a copy
    /// into a stream-ordered staging buffer (the f32 output would overlap
    /// input not yet read), the widening kernel over it, and the staging
    /// buffer's free, all in stream order. `src` must stay unchanged until
    /// the copy completed, as for [`Gpu::htod_async`].
    pub(super) fn widen_htod_async(
        &self,
        stored: ParamDtype,
        dst: u64,
        src: &[u8],
        stream: &CudaStream,
    ) -> Result<(), String> {
        let name = widen_kernel(stored).ok_or_else(|| format!("{stored} needs no widening"))?;
        let f = self
            .widen
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, f)| f)
            .ok_or_else(|| format!("kernel {name} was not loaded"))?;
        if src.is_empty() {
            return Ok(());
        }
        let n = (src.len() / stored.size_bytes() as usize) as u64;
        // SAFETY: the stream is alive; the buffer is used only by the copy
        // and the kernel enqueued below on the same stream, and freed after
        // them in stream order.
        let staging = unsafe { result::malloc_async(stream.cu_stream(), src.len()) }
            .map_err(|e| cuda_err(&format!("cuMemAllocAsync of {} bytes", src.len()), e))?;
        // SAFETY: `staging` has room for `src.len()` bytes; `src` is valid
        // now and kept alive by the caller until the copy completed.
        let widened = unsafe { result::memcpy_htod_async(staging, src, stream.cu_stream()) }
            .map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))
            .and_then(|()| {
                launch_on(
                    f,
                    name,
                    (widen_grid(n), WIDEN_THREADS),
                    &[Arg::Ptr(staging), Arg::Ptr(dst), Arg::I64(n as i64)],
                    stream,
                )
            });
        // SAFETY: allocated above on this stream, freed once, after the
        // copy and the kernel in stream order.
        let freed = unsafe { result::free_async(staging, stream.cu_stream()) }
            .map_err(|e| cuda_err("cuMemFreeAsync", e));
        widened.and(freed)
    }
}

/// Launches `f` (named `name`, for errors) with `(blocks, threads)` on
/// `stream`; `args` match its C signature.
fn launch_on(
    f: &CudaFunction,
    name: &str,
    (blocks, threads): (u32, u32),
    args: &[Arg],
    stream: &CudaStream,
) -> Result<(), String> {
    let mut values: Vec<Arg> = args.to_vec();
    let mut params: Vec<*mut c_void> = values
        .iter_mut()
        .map(|a| match a {
            Arg::Ptr(v) => (v as *mut u64).cast(),
            Arg::I64(v) => (v as *mut i64).cast(),
            Arg::I32(v) => (v as *mut i32).cast(),
            Arg::F32(v) => (v as *mut f32).cast(),
            Arg::F64(v) => (v as *mut f64).cast(),
        })
        .collect();
    // SAFETY: `params` points into `values`, alive across the call (the
    // driver copies parameters at launch). The argument list matches the
    // kernel's C signature (each call site in ops.rs mirrors it), device
    // addresses point into live buffers that stay alive until the stream
    // passed them (stream-ordered frees), and every kernel bounds its
    // indices by the sizes passed.
    unsafe {
        result::launch_kernel(
            f.cu_function(),
            (blocks.max(1), 1, 1),
            (threads, 1, 1),
            0,
            stream.cu_stream(),
            &mut params,
        )
    }
    .map_err(|e| cuda_err(&format!("launching {name}"), e))
}

impl Gpu {
    /// Row-major `C[b] = A[b] (m x k) * B[b] (k x n)` for `batch` matrices at
    /// the given element strides (0 broadcasts), with `a_t` / `b_t` meaning
    /// the stored buffer is the transpose (`A` stored `k x m`, `B` `n x k`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &self,
        (m, n, k): (usize, usize, usize),
        (a, a_t, stride_a): (u64, bool, usize),
        (b, b_t, stride_b): (u64, bool, usize),
        (c, stride_c): (u64, usize),
        batch: usize,
    ) -> Result<(), String> {
        let int = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| format!("GEMM {what} {v} exceeds cuBLAS's 32-bit sizes"))
        };
        let (mi, ni, ki, bi) = (
            int(m, "m")?,
            int(n, "n")?,
            int(k, "k")?,
            int(batch, "batch")?,
        );
        // Row-major C = A B is column-major C^T = B^T A^T: cuBLAS sees the
        // stored row-major buffers as their transposes, so swap the operands.
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let ldb = if b_t { ki } else { ni };
        let lda = if a_t { mi } else { ki };
        let (alpha, beta) = (1f32, 0f32);
        let handle = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the handle is bound to the compute stream, on which every
        // buffer passed here was written and stays alive (stream-ordered
        // frees). Sizes, leading dimensions and strides describe buffers of
        // at least `batch` row-major matrices of the stated shapes (the
        // caller computed them from checked tensor shapes).
        unsafe {
            blas::sgemm_strided_batched(
                handle.0,
                op(b_t),
                op(a_t),
                ni,
                mi,
                ki,
                &alpha,
                b as *const f32,
                ldb,
                stride_b as i64,
                a as *const f32,
                lda,
                stride_a as i64,
                &beta,
                c as *mut f32,
                ni,
                stride_c as i64,
                bi,
            )
        }
        .map_err(|e| cuda_err("cublasSgemmStridedBatched", e))
    }

    /// Enqueues a copy of `src` to device address `dst` on `stream`.
    ///
    /// From pageable memory the driver stages `src` before returning; from
    /// pinned memory the copy reads `src` later, so the caller must keep it
    /// unchanged until `stream` passed the copy (see the module docs).
    pub(super) fn htod_async(
        &self,
        dst: u64,
        src: &[u8],
        stream: &CudaStream,
    ) -> Result<(), String> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` has room for `src.len()` bytes (callers check ranges
        // against their allocation); `src` is valid for reads now and, when
        // pinned, kept alive by the caller until the copy completed.
        unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))
    }

    /// Copies `dst.len()` bytes from device address `src` after everything
    /// enqueued on the compute stream (synchronises it).
    pub(super) fn dtoh_sync(&self, dst: &mut [u8], src: u64) -> Result<(), String> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` holds at least `dst.len()` bytes written on the
        // compute stream; the sync below completes the copy before `dst` is
        // used or dropped.
        unsafe { result::memcpy_dtoh_async(dst, src, self.compute.cu_stream()) }
            .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
        self.compute
            .synchronize()
            .map_err(|e| cuda_err("cuStreamSynchronize", e))
    }
}

/// Device memory ordered on one stream: `cuMemAllocAsync` on creation,
/// `cuMemFreeAsync` on drop, both on the compute stream, so a buffer may be
/// dropped on the host as soon as its last reader was *enqueued*.
pub(super) struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

impl DeviceBuffer {
    pub(super) fn new(gpu: &Gpu, bytes: usize) -> Result<Self, String> {
        // Never a zero-byte allocation: keep every pointer distinct and valid.
        let bytes = bytes.max(4);
        // SAFETY: the compute stream is alive; all uses of the memory are
        // enqueued on that stream (kernels, GEMMs, copies).
        let ptr = unsafe { result::malloc_async(gpu.compute.cu_stream(), bytes) }
            .map_err(|e| cuda_err(&format!("cuMemAllocAsync of {bytes} bytes"), e))?;
        Ok(DeviceBuffer {
            ptr,
            bytes,
            stream: gpu.compute.clone(),
        })
    }

    pub(super) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let ctx = self.stream.context();
        ctx.record_err(ctx.bind_to_thread());
        // SAFETY: allocated on this stream, freed once; the free is ordered
        // after every use already enqueued on the stream.
        ctx.record_err(unsafe { result::free_async(self.ptr, self.stream.cu_stream()) });
    }
}

/// An arena's device memory: one `cuMemAlloc`, or the memory of a dropped
/// arena of about the same size ([`SparePool`]).
pub(super) struct ArenaMemory {
    ptr: u64,
    /// What the arena asked for (the allocation may be up to
    /// [`SPARE_SLACK`] larger when reused).
    bytes: usize,
    /// The allocation's real size.
    allocated: usize,
    gpu: Arc<Gpu>,
}

impl ArenaMemory {
    pub(super) fn new(gpu: &Arc<Gpu>, bytes: usize) -> Result<Self, String> {
        gpu.bind()?;
        let want = bytes.max(4);
        if let Some((ptr, allocated)) = gpu.spares.take(want, gpu)? {
            return Ok(ArenaMemory {
                ptr,
                bytes,
                allocated,
                gpu: gpu.clone(),
            });
        }
        // SAFETY: plain allocation in the bound context.
        let ptr = match unsafe { result::malloc_sync(want) } {
            Ok(p) => p,
            Err(first) => {
                // Spares hold memory the allocator could use: give it back, retry once.
                if gpu.spares.release_all() == 0 {
                    return Err(cuda_err("cuMemAlloc", first));
                }
                // SAFETY: as above.
                unsafe { result::malloc_sync(want) }.map_err(|e| cuda_err("cuMemAlloc", e))?
            }
        };
        Ok(ArenaMemory {
            ptr,
            bytes,
            allocated: want,
            gpu: gpu.clone(),
        })
    }

    pub(super) fn ptr(&self) -> u64 {
        self.ptr
    }

    pub(super) fn len(&self) -> usize {
        self.bytes
    }
}

impl Drop for ArenaMemory {
    fn drop(&mut self) {
        let ctx = &self.gpu.ctx;
        ctx.record_err(ctx.bind_to_thread());
        // Programs hold the arena by Arc, so no kernel is enqueued against
        // it any more; copies and kernels already enqueued may still run.
        if self.gpu.spares.keep(self.ptr, self.allocated, &self.gpu) {
            return;
        }
        ctx.record_err(self.gpu.copy.synchronize());
        ctx.record_err(self.gpu.compute.synchronize());
        // SAFETY: allocated by `malloc_sync`, freed once, no work pending.
        ctx.record_err(unsafe { result::free_sync(self.ptr) });
    }
}

/// Most spare arenas a device keeps.
pub(super) const SPARES_MAX: usize = 2;
/// A spare serves an arena of at least `allocated / SPARE_SLACK` bytes:
/// reuse may waste at most a quarter.
const SPARE_SLACK: f64 = 1.25;

/// Memory of dropped arenas. A model switch (evict one model, load the
/// next) would otherwise pay a `cuMemFree` (which waits for the device) and
/// a `cuMemAlloc` on the device's serial path; the evaluation's models are
/// often the same size. A spare is handed out only after the device passed
/// every copy and kernel that used it: its two events, recorded on the copy
/// and compute streams when it was dropped, are made the copy stream's
/// dependencies (the new arena's uploads go there; its kernels run behind
/// their uploads). Spares are device memory the residency accounting does
/// not see: at most [`SPARES_MAX`], given back when an allocation fails and
/// when the executor goes.
pub(super) struct SparePool {
    ctx: Arc<CudaContext>,
    enabled: bool,
    spares: Mutex<Vec<Spare>>,
}

struct Spare {
    ptr: u64,
    bytes: usize,
    /// Recorded on the copy and the compute stream when the arena dropped.
    after_copies: CudaEvent,
    after_kernels: CudaEvent,
}

impl SparePool {
    fn new(ctx: &Arc<CudaContext>, enabled: bool) -> SparePool {
        SparePool {
            ctx: ctx.clone(),
            enabled,
            spares: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Spare>> {
        self.spares.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `ptr` as a spare; false when the pool is off or full, or the
    /// events cannot be recorded (then the caller frees it).
    fn keep(&self, ptr: u64, bytes: usize, gpu: &Gpu) -> bool {
        if !self.enabled {
            return false;
        }
        let mut spares = self.lock();
        if spares.len() >= SPARES_MAX {
            return false;
        }
        let record = |stream: &CudaStream| stream.record_event(None);
        match (record(&gpu.copy), record(&gpu.compute)) {
            (Ok(after_copies), Ok(after_kernels)) => {
                spares.push(Spare {
                    ptr,
                    bytes,
                    after_copies,
                    after_kernels,
                });
                true
            }
            _ => false,
        }
    }

    /// The smallest spare that holds `bytes` without wasting more than
    /// [`SPARE_SLACK`], ordered on the copy stream after its last users.
    fn take(&self, bytes: usize, gpu: &Gpu) -> Result<Option<(u64, usize)>, String> {
        let mut spares = self.lock();
        let fits = |s: &Spare| s.bytes >= bytes && s.bytes as f64 <= bytes as f64 * SPARE_SLACK;
        let Some(i) = spares
            .iter()
            .enumerate()
            .filter(|(_, s)| fits(s))
            .min_by_key(|(_, s)| s.bytes)
            .map(|(i, _)| i)
        else {
            return Ok(None);
        };
        let spare = spares.swap_remove(i);
        drop(spares);
        let ordered = gpu
            .copy
            .wait(&spare.after_copies)
            .and_then(|()| gpu.copy.wait(&spare.after_kernels));
        if let Err(e) = ordered {
            // Not ordered behind its last users: free it (after a full
            // sync) rather than hand it out.
            self.free(spare);
            return Err(cuda_err("cuStreamWaitEvent on a spare arena", e));
        }
        Ok(Some((spare.ptr, spare.bytes)))
    }

    /// Frees every spare; returns how many there were.
    fn release_all(&self) -> usize {
        let spares: Vec<Spare> = std::mem::take(&mut *self.lock());
        let n = spares.len();
        for s in spares {
            self.free(s);
        }
        n
    }

    fn free(&self, spare: Spare) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        self.ctx.record_err(spare.after_copies.synchronize());
        self.ctx.record_err(spare.after_kernels.synchronize());
        // SAFETY: allocated by `malloc_sync` for an arena that was dropped;
        // its last copy and kernel completed (the events above); freed once.
        self.ctx.record_err(unsafe { result::free_sync(spare.ptr) });
    }
}

impl Drop for SparePool {
    fn drop(&mut self) {
        self.release_all();
    }
}

/// The process-wide primary context of device 0 that pinned host memory is
/// registered with (kept retained for the life of the process, so that the
/// registration outlives every executor).
fn pinning_context() -> Result<&'static Arc<CudaContext>, String> {
    static CTX: OnceLock<Arc<CudaContext>> = OnceLock::new();
    if let Some(ctx) = CTX.get() {
        return Ok(ctx);
    }
    let ctx = context(0).map_err(|e| e.to_string())?;
    Ok(CTX.get_or_init(|| ctx))
}

/// A host-cache pin hook: `cuMemHostRegister` (portable: usable by every
/// context) on the cache buffer, so that uploads from it are true DMA and
/// overlap compute. The returned registration calls `cuMemHostUnregister`
/// when dropped; the cache drops it before its buffer can be unmapped.
pub fn pin_hook() -> PinHook {
    Box::new(|buf| {
        let ctx = pinning_context()?;
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        // SAFETY: `buf` is a live mapping of `buf.len()` bytes; the
        // registration only locks its pages and maps them for the device,
        // and the returned guard undoes it while the mapping still exists
        // (the cache keeps the buffer alive past the guard).
        unsafe {
            sys::cuMemHostRegister_v2(
                buf.as_ptr().cast(),
                buf.len(),
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
            .result()
        }
        .map_err(|e| cuda_err(&format!("cuMemHostRegister of {} bytes", buf.len()), e))?;
        Ok(Pinned(Box::new(HostRegistration {
            ptr: buf.as_ptr() as usize,
            ctx: ctx.clone(),
        })))
    })
}

/// Host memory registered by [`pin_hook`]; unregistered on drop.
struct HostRegistration {
    /// The registered address (kept as an integer: the guard never reads it).
    ptr: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `ptr` was registered by `pin_hook` and is unregistered
        // once, here, while still mapped; no copy from it is in flight (the
        // cache drops this only when no upload holds a pin).
        let r = unsafe { sys::cuMemHostUnregister(self.ptr as *mut c_void) }.result();
        if let Err(e) = r {
            log::warn!("cuMemHostUnregister of the host cache: {e}");
        }
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop.
struct PinnedHost {
    ptr: *mut c_void,
    bytes: usize,
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`, freed once.
        let _ = unsafe { result::free_host(self.ptr) };
    }
}

/// H2D bandwidth of device 0: `iters` copies of `bytes` with
/// `cuMemcpyHtoDAsync` from pinned memory (then one sync), and `iters`
/// synchronous `cuMemcpyHtoD` from a pageable `Vec`, in the same run. One
/// warm-up copy of each first.
pub fn h2d_bench(bytes: usize, iters: usize) -> Result<H2dBandwidth, ExecError> {
    if bytes == 0 || iters == 0 {
        return Err(unavailable(format!(
            "h2d_bench needs bytes > 0 and iters > 0, got {bytes} and {iters}"
        )));
    }
    let gpu = Gpu::open(0, false)?;
    let err = |what: &str, e: &dyn std::fmt::Display| unavailable(cuda_err(what, e));
    gpu.bind().map_err(unavailable)?;
    let dst = ArenaMemory::new(&gpu, bytes).map_err(unavailable)?;
    // SAFETY: plain page-locked allocation in the bound context.
    let pinned = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
        .map_err(|e| err("cuMemHostAlloc", &e))?;
    let pinned = PinnedHost { ptr: pinned, bytes };
    // SAFETY: `pinned` holds `bytes` writable bytes, alive until dropped below.
    let pinned_bytes =
        unsafe { std::slice::from_raw_parts_mut(pinned.ptr.cast::<u8>(), pinned.bytes) };
    pinned_bytes.fill(1); // fault the pages in before timing
    let pageable = vec![1u8; bytes];
    let gbps = |secs: f64| (bytes * iters) as f64 / secs / 1e9;

    gpu.htod_async(dst.ptr(), pinned_bytes, &gpu.copy)
        .map_err(unavailable)?;
    gpu.copy
        .synchronize()
        .map_err(|e| err("cuStreamSynchronize", &e))?;
    let start = Instant::now();
    for _ in 0..iters {
        gpu.htod_async(dst.ptr(), pinned_bytes, &gpu.copy)
            .map_err(unavailable)?;
    }
    gpu.copy
        .synchronize()
        .map_err(|e| err("cuStreamSynchronize", &e))?;
    let pinned_gbps = gbps(start.elapsed().as_secs_f64());

    let plain = |src: &[u8]| {
        // SAFETY: `dst` holds `bytes` bytes; the copy is synchronous.
        unsafe { result::memcpy_htod_sync(dst.ptr(), src) }.map_err(|e| err("cuMemcpyHtoD", &e))
    };
    plain(&pageable)?;
    let start = Instant::now();
    for _ in 0..iters {
        plain(&pageable)?;
    }
    let plain_memcpy_gbps = gbps(start.elapsed().as_secs_f64());
    drop(dst);
    Ok(H2dBandwidth {
        pinned_gbps,
        plain_memcpy_gbps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC needs no GPU: where libnvrtc loads (the CUDA toolkit, or
    /// `pip install nvidia-cuda-nvrtc` with LD_LIBRARY_PATH at its `lib`),
    /// every kernel must compile, as `Gpu::open` compiles them. Elsewhere
    /// the test says it skipped.
    #[test]
    fn nvrtc_compiles_every_kernel_where_it_is_installed() {
        // SAFETY: as in `check_libraries`: dlopen of the candidate names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: libnvrtc is not on the loader path");
            return;
        }
        for arch in ["compute_80", "compute_90"] {
            let opts = CompileOptions {
                options: vec![format!("--gpu-architecture={arch}")],
                name: Some("distmind_kernels.cu".into()),
                ..Default::default()
            };
            if let Err(e) = compile_ptx_with_opts(format!("{KERNEL_SOURCE}\n{WIDEN_SOURCE}"), opts)
            {
                panic!("NVRTC ({arch}) could not compile the kernels: {e:?}");
            }
        }
    }

    #[test]
    fn kernel_enum_follows_the_name_list() {
        let all = [
            (Kernel::Relu, "relu_f32"),
            (Kernel::Tanh, "tanh_f32"),
            (Kernel::GeluErf, "gelu_erf_f32"),
            (Kernel::GeluTanh, "gelu_tanh_f32"),
            (Kernel::Add, "add_f32"),
            (Kernel::BiasAdd, "bias_add_f32"),
            (Kernel::BatchNorm, "batch_norm_f32"),
            (Kernel::Im2col, "im2col_f32"),
            (Kernel::MaxPool2d, "max_pool2d_f32"),
            (Kernel::AvgPool2d, "avg_pool2d_f32"),
            (Kernel::AdaptiveAvgPool2d, "adaptive_avg_pool2d_f32"),
            (Kernel::ConcatCopy, "concat_copy_f32"),
            (Kernel::Select, "select_f32"),
            (Kernel::Embedding, "embedding_f32"),
            (Kernel::LayerNorm, "layer_norm_f32"),
            (Kernel::SoftmaxRows, "softmax_rows_f32"),
            (Kernel::SplitHeads, "split_heads_f32"),
            (Kernel::MergeHeads, "merge_heads_f32"),
            (Kernel::SwapOuter, "swap_outer_f32"),
        ];
        assert_eq!(all.len(), KERNEL_NAMES.len());
        for (k, name) in all {
            assert_eq!(k.name(), name);
        }
    }
}
