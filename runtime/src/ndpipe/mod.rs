//! NDPipe (ASPLOS'24): near-data feature extraction with pipelined
//! fine-tuning of the classifier head.
//!
//! * [`backbone`]: a model package's layers before its classifier head,
//!   frozen on the CPU; a memory server runs it next to its samples
//!   ([`distmind_memserver::FeatureExtractor`]) and ships f16 features
//!   instead of images.
//! * [`head`]: the trainer's linear head, fine-tuned chunk by chunk on the
//!   features as they arrive (NDPipe's schedule).
//!
//! The driver that pipelines extraction and fine-tuning across the memory
//! servers is the top crate's `distmind::ndpipe`.

pub mod backbone;
pub mod head;

#[cfg(test)]
mod tests;

pub use backbone::{Backbone, BackboneError, BACKBONE_BATCH_MAX, BACKBONE_INPUT_DEFAULT};
pub use head::{chunk_lr, ChunkStats, Head, HeadConfig, HeadError};
