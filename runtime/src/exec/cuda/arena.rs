//! [`CudaArena`]: one model's parameters in device memory, one allocation,
//! with one event per group that the compute stream waits on.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaEvent;

use super::driver::{cuda_err, ArenaMemory, Gpu};
use crate::exec::{Arena, ExecError};
use distmind_models::ParamDtype;

/// One `cuMemAlloc` of the model's device bytes (every parameter f32).
/// `upload_async` enqueues `cuMemcpyHtoDAsync` on the copy stream (for a
/// half-precision package into a staging buffer, then the widening kernel of
/// `widen.rs` into the arena) and records the group's event;
/// `wait_uploaded` synchronises with that event.
///
/// From page-locked memory (the host cache's, through [`super::pin_hook`])
/// the DMA engine reads the host bytes until the event completes: the
/// caller keeps them (the cache pin) until `wait_uploaded` returned, as
/// [`Arena::upload_async`]'s contract says. From pageable memory the
/// driver has staged them when `upload_async` returns.
pub struct CudaArena {
    mem: ArenaMemory,
    gpu: Arc<Gpu>,
    /// Per group: the event recorded after its last upload, created on the
    /// group's first upload.
    events: Mutex<Vec<Option<Arc<CudaEvent>>>>,
}

impl std::fmt::Debug for CudaArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaArena")
            .field("bytes", &self.mem.len())
            .field("gpu", &self.gpu)
            .finish_non_exhaustive()
    }
}

impl CudaArena {
    pub(super) fn new(gpu: &Arc<Gpu>, bytes: u64) -> Result<Self, ExecError> {
        let alloc_err = |why: String| ExecError::Alloc { bytes, why };
        let len = usize::try_from(bytes)
            .map_err(|_| alloc_err("larger than the address space".into()))?;
        let mem = ArenaMemory::new(gpu, len).map_err(alloc_err)?;
        Ok(CudaArena {
            mem,
            gpu: gpu.clone(),
            events: Mutex::new(Vec::new()),
        })
    }

    /// Device address of byte `offset`.
    pub(super) fn device_ptr(&self, offset: u64) -> u64 {
        self.mem.ptr() + offset
    }

    /// The event behind group `group`'s last upload, if it was uploaded.
    pub(super) fn group_event(&self, group: usize) -> Option<Arc<CudaEvent>> {
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        events.get(group).cloned().flatten()
    }

    pub(super) fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Arena for CudaArena {
    fn len(&self) -> u64 {
        self.mem.len() as u64
    }

    #[allow(unsafe_code)]
    unsafe fn upload_async(
        &self,
        group: usize,
        offset: u64,
        stored: ParamDtype,
        bytes: &[u8],
    ) -> Result<(), ExecError> {
        crate::exec::device_range(group, offset, stored, bytes, self.len())?;
        let gate_err = |why: String| ExecError::Gate { group, why };
        self.gpu.bind().map_err(gate_err)?;
        // Hold the lock across copy + record so that the event a program
        // waits on is always recorded after this group's copy.
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if events.len() <= group {
            events.resize(group + 1, None);
        }
        let event = match &events[group] {
            Some(e) => e.clone(),
            None => {
                let e = self
                    .gpu
                    .ctx
                    .new_event(None)
                    .map_err(|e| gate_err(cuda_err("cuEventCreate", e)))?;
                let e = Arc::new(e);
                events[group] = Some(e.clone());
                e
            }
        };
        let dst = self.device_ptr(offset);
        match stored {
            ParamDtype::F32 => self.gpu.htod_async(dst, bytes, &self.gpu.copy),
            // Half precision: the stored bytes cross PCIe, a kernel widens.
            _ => self
                .gpu
                .widen_htod_async(stored, dst, bytes, &self.gpu.copy),
        }
        .map_err(gate_err)?;
        event.record(&self.gpu.copy).map_err(|e| {
            // No event stands behind the copy: wait for it here, so that
            // `wait_uploaded` may return at once and the host bytes go.
            let _ = self.gpu.copy.synchronize();
            gate_err(cuda_err("cuEventRecord", e))
        })
    }

    fn wait_uploaded(&self, group: usize) -> Result<(), ExecError> {
        let Some(event) = self.group_event(group) else {
            // Never enqueued (the first upload failed before its copy).
            return Ok(());
        };
        self.gpu
            .bind()
            .map_err(|why| ExecError::Gate { group, why })?;
        event.synchronize().map_err(|e| ExecError::Gate {
            group,
            why: cuda_err("cuEventSynchronize", e),
        })
    }
}
