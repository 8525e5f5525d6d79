//! Training data near the memory servers: what a dataset is, how its samples
//! are preprocessed, and labelled image sets generated for tests.
//!
//! - [`format`](mod@format): sample formats (JPEG, PNG, `.npy`) by extension and magic.
//! - [`dir`]: dataset directories (`labels.txt` plus sample files), read for
//!   `distmind dataset put NAME DIR` and written by tests and generators.
//! - [`prep`]: torchvision's ImageNet training pipeline as five numbered
//!   steps, the wire form of a sample between steps, per-step profiling, the
//!   evaluation transform and f16 conversion.
//! - [`npy`]: a minimal `.npy` reader and writer.
//! - [`synth`]: deterministic labelled JPEG sets.
//! - [`rng`]: the seeded generator every random choice is drawn from.
//!
//! Everything random is a pure function of a `u64` seed, and the JPEG
//! decoder runs its scalar code paths, so the same (bytes, seed) give the
//! same output bit for bit on every machine.

pub mod dir;
pub mod format;
pub mod npy;
pub mod prep;
pub mod rng;
pub mod synth;

pub use dir::{
    read_dir, write_dir, DatasetError, RawSample, LABELS_FILE, SAMPLES_MAX, SAMPLE_BYTES_MAX,
};
pub use format::{FormatError, SampleFormat};
pub use prep::{
    can_stop_after, eval_tensor, f16_le_to_f32, f32_to_f16_le, profile, run, step_name, PrepConfig,
    PrepError, Prepped, StepCost, STEPS,
};
pub use synth::{generate, SynthSpec};
