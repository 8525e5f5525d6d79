//! Training data near the memory servers: what a dataset is, how its samples
//! are preprocessed, and labelled image sets generated for tests.

pub mod dir;
pub mod format;
pub mod rng;

pub use dir::{read_dir, write_dir, DatasetError, RawSample, SAMPLES_MAX, SAMPLE_BYTES_MAX};
pub use format::{FormatError, SampleFormat};
