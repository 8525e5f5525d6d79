//! The DistMind model zoo: the five families of the evaluation as layer
//! graphs with their frameworks' exact parameter names and shapes, the
//! package format (`manifest.json` + a standard `weights.safetensors`) and
//! the packed layout memory servers store and GPU servers read group by group.
//!
//! - [`config`]: [`Family`], [`Scale`] and the hyper-parameters every
//!   architecture is built from.
//! - [`graph`]: layers and ops (semantics in `OPS.md`); [`shape`]: shape rules;
//!   [`flops`]: forward FLOPs per layer.
//! - [`layout`]: params in layer order, 512-byte aligned, grouped at layer boundaries.
//! - [`dtype`]: the storage dtype of a package's params ([`ParamDtype`]: f32,
//!   f16 or bf16), the stored-to-device layout mapping and the exact,
//!   fast widening of half precision to f32 that uploads use.
//! - [`package`]: [`Package::open`], [`Package::group_bytes`], [`Package::verify`].
//! - [`generate()`]: seeded packages; [`import()`]: packages from PyTorch /
//!   Hugging Face safetensors checkpoints; [`inspect()`]: a readable table.
//!
//! **Architecture invariant:** nothing here executes a graph or does IO
//! beyond the package directory; executors live in `runtime`.
#![forbid(unsafe_code)]

pub mod config;
pub mod dtype;
mod error;
mod families;
pub mod flops;
pub mod generate;
pub mod graph;
pub mod import;
pub mod inspect;
pub mod layout;
pub mod package;
pub mod shape;

pub use config::{
    BertConfig, DensenetConfig, Family, Gpt2Config, InceptionConfig, ModelConfig, ResnetConfig,
    Scale,
};
pub use dtype::ParamDtype;
pub use error::{ModelError, Result};
pub use generate::{generate, generate_named, variant_name, GenOptions};
pub use graph::{Architecture, DimKind, Dtype, Layer, Op, OutputSpec, TensorSpec, VariableDim};
pub use import::{import, ImportOptions};
pub use inspect::inspect;
pub use package::{write_package, GroupEntry, Manifest, Origin, Package, PackageSpec, ParamEntry};

#[cfg(test)]
mod tests;
