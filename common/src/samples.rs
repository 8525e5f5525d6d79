//! Datasets on the memory servers: the catalog entry's manifest, and the
//! protocol of every memory server's sample service (connection role
//! [`crate::wire::Role::Sample`]).
//!
//! A dataset is deployed like a model (write, commit, catalog): its samples
//! are packed into groups, each group whole on one memory server, and the
//! catalog entry (family [`DATASET_FAMILY`]) carries a [`DatasetManifest`]
//! saying where in its group every sample lies. A client turns that into
//! arena offsets ([`SampleRef`]) and asks the memory server holding a sample
//! to preprocess it ([`SampleRequest::Prep`]), to profile it
//! ([`SampleRequest::Profile`]) or to run a frozen backbone over it
//! ([`SampleRequest::Extract`]).
//!
//! Every request gets one JSON [`SampleReply`]; `Prepped` and `Extracted`
//! are followed by exactly one [`crate::wire::FrameKind::Bytes`] frame of the
//! length they state.

use serde::{Deserialize, Serialize};

use crate::proto::ErrorReply;

/// The catalog family of a dataset entry: never a model to serve.
pub const DATASET_FAMILY: &str = "dataset";
/// The largest sample a dataset may hold, in bytes.
pub const SAMPLE_BYTES_MAX: u64 = 32 << 20;
/// The most samples one dataset may hold: its manifest travels in one
/// control frame with the catalog entry.
pub const DATASET_SAMPLES_MAX: usize = 100_000;
/// The most samples one `Profile` or `Extract` request may name.
pub const SAMPLES_PER_REQUEST_MAX: usize = 1024;
/// The most bytes of backbone input one `Extract` request may decode
/// (`samples x 3 x input x input` f32).
pub const EXTRACT_INPUT_BYTES_MAX: u64 = 256 << 20;

/// The most samples one `Extract` request may name for a backbone whose
/// input side is `input`: [`SAMPLES_PER_REQUEST_MAX`], fewer where their
/// decoded inputs would pass [`EXTRACT_INPUT_BYTES_MAX`]; at least 1.
pub fn extract_request_max(input: u32) -> usize {
    let per = 3 * u64::from(input) * u64::from(input) * 4;
    let fit = EXTRACT_INPUT_BYTES_MAX / per.max(1);
    (fit as usize).clamp(1, SAMPLES_PER_REQUEST_MAX)
}

/// The largest `Bytes` frame of the sample service (a decoded image of the
/// largest size a memory server decodes fits).
pub const SAMPLE_FRAME_BYTES_MAX: u32 = 256 << 20;
/// The number of preprocessing steps (decode, RandomResizedCrop,
/// RandomHorizontalFlip, ToTensor, Normalize).
pub const PREP_STEPS: usize = 5;

/// What a dataset's catalog entry holds in its `manifest` field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetManifest {
    pub name: String,
    /// xxh3-64 (hex) over every sample's name, label and checksum, in
    /// order: it changes whenever any sample does, so a plan made for one
    /// content is refused for another.
    pub content: String,
    /// Distinct labels: the labels run over `0..classes`.
    pub classes: u32,
    pub samples: Vec<SampleMeta>,
}

/// One sample of a dataset and where it lies in its group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleMeta {
    /// Its file name in the directory it was put from.
    pub name: String,
    pub label: u32,
    /// `jpeg`, `png` or `npy`.
    pub format: String,
    /// The group (shard) holding it.
    pub group: u32,
    /// Its first byte within the group.
    pub offset: u64,
    pub len: u64,
    /// xxh3-64 of its bytes, hex.
    pub checksum: String,
}

/// A sample as one memory server holds it: the arena offset of its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleRef {
    /// Its index in the dataset (named in every error about it).
    pub sample: u64,
    /// Arena offset of its first byte on the memory server asked.
    pub offset: u64,
    pub len: u64,
    /// `jpeg`, `png` or `npy`.
    pub format: String,
    pub label: u32,
}

/// Requests on a memory server's sample connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SampleRequest {
    /// Run the first `steps` preprocessing steps (0: the file itself) on one
    /// sample with the given seed (the random crop and flip are functions
    /// of the seed only). Replies `Prepped` and the bytes.
    Prep {
        sample: SampleRef,
        steps: u8,
        seed: u64,
    },
    /// SOPHON's profiling: run every step on each sample, recording the
    /// bytes after each and each one's time. Replies `Profiled`.
    Profile { samples: Vec<SampleRef>, seed: u64 },
    /// NDPipe: the frozen backbone's features for these samples (eval
    /// transform, then the backbone). Replies `Extracted` and the bytes:
    /// the features (f16, little-endian, one row per extracted sample),
    /// then each extracted sample's label (u32, little-endian).
    Extract { samples: Vec<SampleRef> },
    /// The service's resources. Replies `Info`.
    Info,
}

/// A sample that could not be processed, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleFailure {
    pub sample: u64,
    pub why: String,
}

/// One sample's profile: bytes after every step and every step's seconds
/// on one of the memory server's preprocessing workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleCost {
    pub sample: u64,
    pub raw_bytes: u64,
    pub bytes_after: [u64; PREP_STEPS],
    pub step_s: [f64; PREP_STEPS],
}

/// The frozen backbone a memory server extracts features with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtractorInfo {
    /// Which backbone, and where it came from.
    pub backbone: String,
    pub feature_dim: u32,
    /// The side of the square input it takes.
    pub input: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum SampleReply {
    /// A `Bytes` frame of `bytes` bytes follows: step `steps`'s output.
    Prepped {
        sample: u64,
        steps: u8,
        bytes: u64,
    },
    /// Profiles in request order; samples that failed are listed apart.
    Profiled {
        costs: Vec<SampleCost>,
        failed: Vec<SampleFailure>,
    },
    /// A `Bytes` frame of `bytes` bytes follows: `samples.len()` rows of
    /// `feature_dim` f16 values, then as many u32 labels.
    Extracted {
        samples: Vec<u64>,
        feature_dim: u32,
        bytes: u64,
        failed: Vec<SampleFailure>,
    },
    Info {
        prep_workers: u32,
        extractor: Option<ExtractorInfo>,
    },
    Error(ErrorReply),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extract_requests_are_bounded_by_their_decoded_bytes() {
        assert_eq!(extract_request_max(64), SAMPLES_PER_REQUEST_MAX);
        // 224 x 224: 602,112 bytes each.
        assert_eq!(extract_request_max(224), 445);
        assert_eq!(extract_request_max(u32::MAX / 2), 1);
    }

    #[test]
    fn requests_round_trip_through_json() {
        let r = SampleRequest::Prep {
            sample: SampleRef {
                sample: 7,
                offset: 4096,
                len: 100,
                format: "jpeg".into(),
                label: 3,
            },
            steps: 2,
            seed: 9,
        };
        let s = serde_json::to_string(&r).unwrap();
        assert!(s.starts_with(r#"{"op":"prep","#), "{s}");
        assert_eq!(serde_json::from_str::<SampleRequest>(&s).unwrap(), r);
        let r = SampleReply::Extracted {
            samples: vec![1, 2],
            feature_dim: 4,
            bytes: 24,
            failed: vec![SampleFailure {
                sample: 3,
                why: "decode: truncated".into(),
            }],
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<SampleReply>(&s).unwrap(), r);
    }
}
