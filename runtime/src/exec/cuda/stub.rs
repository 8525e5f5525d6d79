//! The `cuda` executor in a build without the `cuda` feature: the same names,
//! each failing with [`NOT_COMPILED`].

use std::convert::Infallible;
use std::sync::Arc;

use distmind_models::Manifest;

use super::{CudaOptions, H2dBandwidth, NOT_COMPILED};
use crate::cache::PinHook;
use crate::exec::{Arena, ExecError, Executor, ExecutorKind, Program};

fn unavailable() -> ExecError {
    ExecError::Unavailable {
        executor: ExecutorKind::Cuda,
        why: NOT_COMPILED.into(),
    }
}

/// Cannot be constructed in this build: [`CudaExecutor::new`] says why.
#[derive(Debug)]
pub struct CudaExecutor {
    never: Infallible,
}

impl CudaExecutor {
    /// Always `Unavailable`: this build has no CUDA support.
    pub fn new(device: usize) -> Result<Self, ExecError> {
        Self::with_options(device, CudaOptions::default())
    }

    /// Always `Unavailable`: this build has no CUDA support.
    pub fn with_options(_device: usize, _options: CudaOptions) -> Result<Self, ExecError> {
        Err(unavailable())
    }

    /// Never called: no value of this type exists in this build.
    pub fn device_name(&self) -> String {
        match self.never {}
    }
}

impl Executor for CudaExecutor {
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Cuda
    }

    fn describe(&self) -> String {
        match self.never {}
    }

    fn for_device(&self, _ordinal: u32) -> Result<Arc<dyn Executor>, ExecError> {
        match self.never {}
    }

    fn alloc_arena(&self, _bytes: u64) -> Result<Arc<dyn Arena>, ExecError> {
        match self.never {}
    }

    fn program(
        &self,
        _manifest: &Manifest,
        _arena: Arc<dyn Arena>,
    ) -> Result<Box<dyn Program>, ExecError> {
        match self.never {}
    }
}

/// A pin hook that fails with [`NOT_COMPILED`] (do not install it in
/// CPU-only builds: nothing needs pinning there).
pub fn pin_hook() -> PinHook {
    Box::new(|_buf| Err(NOT_COMPILED.to_string()))
}

/// Always `Unavailable`: this build has no CUDA support.
pub fn h2d_bench(_bytes: usize, _iters: usize) -> Result<H2dBandwidth, ExecError> {
    Err(unavailable())
}
