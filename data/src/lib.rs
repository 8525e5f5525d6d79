//! Training data near the memory servers: what a dataset is, how its samples
//! are preprocessed, and labelled image sets generated for tests.

pub mod dir;
pub mod format;
pub mod rng;

pub use dir::{read_dir, write_dir, DatasetError, RawSample, SAMPLES_MAX, SAMPLE_BYTES_MAX};
pub use format::{FormatError, SampleFormat};
pub mod npy;
pub mod prep;

pub use prep::{
    eval_tensor, f16_le_to_f32, f32_to_f16_le, profile, run, step_name, PrepConfig, PrepError,
    Prepped, StepCost, STEPS,
};
pub mod synth;

pub use synth::{generate, SynthSpec};
