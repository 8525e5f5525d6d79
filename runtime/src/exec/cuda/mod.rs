//! The `cuda` executor: parameters in device memory, layers as NVRTC kernels
//! and cuBLAS GEMMs on a compute stream, group uploads on a copy stream.
//!
//! * [`CudaExecutor::new`] loads the driver (`libcuda`) at run time, retains
//!   the device's primary context, creates a compute stream and a copy stream
//!   and a cuBLAS handle, and compiles every kernel of [`kernels`] once with
//!   NVRTC. Without a driver it returns
//!   [`ExecError::Unavailable`](super::ExecError::Unavailable) naming the
//!   libraries it looked for (cudarc would panic; we check first).
//! * `CudaArena`: ONE `cuMemAlloc` of the model's packed bytes, or the
//!   memory of a dropped arena of about the same size (at most two are kept,
//!   ordered behind their last copy and kernel by events): a model switch
//!   pays no `cuMemFree` / `cuMemAlloc` on the serial path.
//!   [`Arena::upload_async`](super::Arena::upload_async) enqueues
//!   `cuMemcpyHtoDAsync` of the group's host bytes on the copy stream and
//!   records the group's event behind it;
//!   [`Arena::wait_uploaded`](super::Arena::wait_uploaded) synchronises with
//!   that event. The copy is truly asynchronous (overlapping compute) only
//!   from pinned host memory: the host cache pins its buffer through
//!   [`pin_hook`] (`cuMemHostRegister`). From pinned memory the copy reads
//!   the host bytes after `upload_async` returned, which is why it is an
//!   `unsafe fn`: the caller keeps them (the runtime's upload stage holds the
//!   model's host-cache pin) until `wait_uploaded` returned. From pageable
//!   memory the driver stages the bytes before `upload_async` returns.
//! * `CudaProgram::run`: before the first layer of group g it calls the
//!   runtime's host-side `gate(g)`, then makes the compute stream wait on
//!   group g's event (`cuStreamWaitEvent`): the device-side gate. Kernels of
//!   group g are thus enqueued as soon as the group is uploaded and run as
//!   soon as its copy landed, while later groups are still being copied.
//!   Activations live in device memory (stream-ordered `cuMemAllocAsync`)
//!   and are freed after their last reader, computed once per program.
//!   Outputs are copied back after a compute-stream sync.
//! * Trace timestamps are host times at which a layer was *enqueued*, not
//!   when it ran, unless [`CudaOptions::sync_per_layer`] is set: then the
//!   compute stream is synchronised after every layer and `LayerEnd` is the
//!   layer's completion (slower), or [`CudaOptions::layer_events`]: then
//!   layer timestamps are device times from CUDA events (per-layer
//!   profiles, `distmind profile measure`).
//!
//! Without the `cuda` cargo feature this module still exists (candle's
//! pattern): [`CudaExecutor::new`] then returns `Unavailable` saying how to
//! rebuild, and [`pin_hook`] / [`h2d_bench`] fail the same way.
//!
//! Op semantics are the `cpu` executor's (`models/OPS.md`); the index math
//! of the window kernels is [`geometry`]'s, unit-tested in Rust.
//!
//! **Architecture invariant:** `unsafe` blocks live only in `driver.rs` (the
//! FFI wrapper); the program and the arena go through its safe functions
//! (the arena declares the trait's `unsafe fn upload_async`, whose contract
//! its callers keep).

pub mod geometry;
pub mod kernels;
pub mod widen;

#[cfg(feature = "cuda")]
mod arena;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod program;

#[cfg(feature = "cuda")]
pub use arena::CudaArena;
#[cfg(feature = "cuda")]
pub use driver::{h2d_bench, pin_hook};
#[cfg(feature = "cuda")]
pub use program::{CudaExecutor, CudaProgram};

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::{h2d_bench, pin_hook, CudaExecutor};

/// Options of a [`CudaExecutor`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// Synchronise the compute stream after every layer, so that trace
    /// timestamps are completion times (per-layer profiles) instead of
    /// enqueue times. Off for serving: it removes all CPU/GPU overlap.
    pub sync_per_layer: bool,
    /// Record a timing event on the compute stream before the first layer
    /// and after every layer. After the run, every `LayerStart` /
    /// `LayerEnd` timestamp of the trace is the device time of its event
    /// (placed on the host clock at the instant the first event was
    /// enqueued), so a layer's duration is the GPU time from the end of the
    /// layer before it to its own end: its kernels plus any time the GPU sat
    /// waiting for the host to enqueue them (eager mode's launch cost). What
    /// `distmind profile measure` reads; no host synchronisation per layer,
    /// so CPU/GPU overlap stays as in serving.
    pub layer_events: bool,
    /// `cuMemAlloc` every arena and `cuMemFree` it when dropped, instead of
    /// keeping the memory of dropped arenas for the next ones (a model
    /// switch then pays both on the serial path). For comparisons.
    pub fresh_arenas: bool,
    /// Run a batch's convolutions as cuBLAS's strided batched GEMM, one
    /// matrix per image, instead of one GEMM over the images side by side
    /// (the default). For comparisons.
    pub per_image_conv: bool,
}

/// Host-to-device bandwidth from [`h2d_bench`], in GB/s (1e9 bytes/s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct H2dBandwidth {
    /// `cuMemcpyHtoDAsync` from page-locked (`cuMemHostAlloc`) memory.
    pub pinned_gbps: f64,
    /// `cuMemcpyHtoD` from ordinary pageable memory (a `Vec`).
    pub plain_memcpy_gbps: f64,
}

/// Why this build has no cuda executor.
pub const NOT_COMPILED: &str =
    "this binary was built without the cuda feature: rebuild with --features cuda";
