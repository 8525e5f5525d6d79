//! Per-layer GPU time profiles: what the `sim` executor makes each layer
//! take, and what schedulers read to predict compute time.
//!
//! A profile is one JSON file under `settings/profiles/` (format in
//! `settings/profiles/README.md`): the GPU, where the numbers came from
//! (`"estimated"` from a roofline over the layer graph, or `"measured"` on the
//! GPU), the peaks the estimate used, and per model key
//! `"<family>/<scale>/b<batch>"` every layer's FLOPs, bytes and time.
//!
//! Every figure printed from a profile should carry [`Profile::source_label`]
//! so an estimate is never mistaken for a measurement.
//!
//! - [`Profile::load`] reads and validates a file; [`Profile::get`] looks a
//!   model up, interpolating between batches when the exact one is absent.
//! - Transformer entries are timed at the preset's sequence length
//!   ([`profiled_seq_len`]); a request of another length takes
//!   [`ModelProfile::at_seq_len`], the times scaled by its tokens (an
//!   interpolation, stated there).
//! - [`estimate`] (in `profile/estimate.rs`) computes a model's profile from
//!   its architecture and [`Peaks::H200_ESTIMATED`]; [`estimated_h200`] builds
//!   the shipped `settings/profiles/h200-estimated.json`, and
//!   [`Profile::to_json_text`] writes it byte for byte.
//! - [`measure`] times every layer on a real executor (`distmind profile
//!   measure`): the measured profiles.

mod estimate;
pub mod measure;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use distmind_models::{Family, Scale};
use serde::{Deserialize, Serialize};

pub use estimate::{
    estimate, estimate_config, estimate_with, estimated_h200, estimated_v100, ESTIMATED_METHOD,
    V100_ESTIMATED_METHOD,
};

/// Version of the profile format this build reads and writes.
pub const PROFILE_FORMAT_VERSION: u32 = 1;

/// The shipped H200 estimate (the default profile), relative to the
/// repository root.
pub const SHIPPED_ESTIMATED_PATH: &str = "settings/profiles/h200-estimated.json";

/// The shipped V100 estimate (the paper's GPU), relative to the repository
/// root.
pub const SHIPPED_V100_ESTIMATED_PATH: &str = "settings/profiles/v100-estimated.json";

/// Where a profile's numbers came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Computed from the layer graph and the GPU's peaks (no GPU involved).
    Estimated,
    /// Timed on the GPU named in the profile.
    Measured,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Estimated => "estimated",
            Source::Measured => "measured",
        }
    }
}

/// The GPU and host-link rates a profile assumes (estimated profiles) or
/// observed (measured ones).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Peaks {
    /// Tensor-core rate used for conv2d, linear and attention matmuls.
    pub matrix_flops_per_s: f64,
    /// Rate used for every other op (elementwise, norms, pools, softmax).
    pub vector_flops_per_s: f64,
    /// Device memory bandwidth.
    pub memory_bytes_per_s: f64,
    /// Host-to-device copies from pinned host memory (what `sim` uploads take).
    pub h2d_bytes_per_s: f64,
    /// Added to every layer: kernel launch and framework dispatch.
    pub launch_overhead_s: f64,
}

impl Peaks {
    /// NVIDIA H200 as used by the shipped estimate. Matrix and memory rates
    /// were measured on this project's GPU machine (bf16 tensor-core GEMM,
    /// device-to-device copy); the vector rate is 1/10 of the matrix rate, and
    /// the H2D rate and launch overhead are assumptions (see
    /// [`ESTIMATED_METHOD`]).
    pub const H200_ESTIMATED: Peaks = Peaks {
        matrix_flops_per_s: 7.9e14,
        vector_flops_per_s: 7.9e13,
        memory_bytes_per_s: 4.3e12,
        h2d_bytes_per_s: 5.0e10,
        launch_overhead_s: 5.0e-6,
    };

    /// NVIDIA V100 SXM2, the paper's GPU, from its datasheet (see
    /// `V100_ESTIMATED_METHOD`): FP16 tensor-core rate for matrix ops, FP32
    /// CUDA-core rate for the rest, HBM2 bandwidth, a typical PCIe Gen3 x16
    /// pinned host-to-device rate.
    pub const V100_ESTIMATED: Peaks = Peaks {
        matrix_flops_per_s: 1.25e14,
        vector_flops_per_s: 1.57e13,
        memory_bytes_per_s: 9.0e11,
        h2d_bytes_per_s: 1.2e10,
        launch_overhead_s: 5.0e-6,
    };

    fn fields(&self) -> [(&'static str, f64); 5] {
        [
            ("matrix_flops_per_s", self.matrix_flops_per_s),
            ("vector_flops_per_s", self.vector_flops_per_s),
            ("memory_bytes_per_s", self.memory_bytes_per_s),
            ("h2d_bytes_per_s", self.h2d_bytes_per_s),
            ("launch_overhead_s", self.launch_overhead_s),
        ]
    }
}

/// One layer's cost. `id` and `name` are the manifest's; `op` its op name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerProfile {
    pub id: usize,
    pub name: String,
    pub op: String,
    /// Floating-point operations (matrix + vector; a multiply-add is 2).
    pub flops: u64,
    /// Bytes moved to and from device memory.
    pub bytes: u64,
    /// Time on the GPU, launch overhead included.
    pub time_s: f64,
}

/// One model at one batch size: its layers in manifest order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    /// The sum of the layers' `time_s`: one forward pass.
    pub total_s: f64,
    pub layers: Vec<LayerProfile>,
}

impl ModelProfile {
    /// Sum of the layers' FLOPs.
    pub fn total_flops(&self) -> u64 {
        self.layers.iter().map(|l| l.flops).sum()
    }

    /// Sum of the layers' bytes.
    pub fn total_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes).sum()
    }

    /// The point `t` of the way from `lo` to `hi`, layer by layer (`t` above
    /// 1 extrapolates; with `floor`, no value falls below `hi`'s). `None`
    /// when the two have different layers.
    pub fn between(
        lo: &ModelProfile,
        hi: &ModelProfile,
        t: f64,
        floor: bool,
    ) -> Option<ModelProfile> {
        if lo.layers.len() != hi.layers.len() {
            return None;
        }
        let mix = |a: f64, b: f64| {
            let v = a + (b - a) * t;
            if floor {
                v.max(b)
            } else {
                v
            }
        };
        let mut layers = Vec::with_capacity(lo.layers.len());
        for (a, b) in lo.layers.iter().zip(&hi.layers) {
            if a.name != b.name || a.op != b.op {
                return None;
            }
            layers.push(LayerProfile {
                flops: mix(a.flops as f64, b.flops as f64).round() as u64,
                bytes: mix(a.bytes as f64, b.bytes as f64).round() as u64,
                time_s: mix(a.time_s, b.time_s),
                ..b.clone()
            });
        }
        Some(ModelProfile {
            total_s: layers.iter().map(|l| l.time_s).sum(),
            layers,
        })
    }

    /// Every layer's flops, bytes and time multiplied by `factor` (the
    /// single-batch fallback of [`Profile::get`]).
    pub fn scaled(&self, factor: f64) -> ModelProfile {
        let layers: Vec<LayerProfile> = self
            .layers
            .iter()
            .map(|l| LayerProfile {
                flops: (l.flops as f64 * factor).round() as u64,
                bytes: (l.bytes as f64 * factor).round() as u64,
                time_s: l.time_s * factor,
                ..l.clone()
            })
            .collect();
        ModelProfile {
            total_s: layers.iter().map(|l| l.time_s).sum(),
            layers,
        }
    }
}

impl ModelProfile {
    /// This profile at `len` tokens per sequence instead of the `profiled`
    /// length it was timed at (transformers; see [`profiled_seq_len`]).
    /// Per layer, `overhead_s` (the launch overhead) stays and the rest of
    /// its time scales with the tokens, `len / profiled`; attention layers
    /// scale with its square (their score matrix is `L x L` per head). No
    /// layer falls below `floors_s[i]` (its launch overhead and one read of
    /// its weights, which do not shrink with the tokens). FLOPs and bytes
    /// scale the same way.
    ///
    /// This is an interpolation (below `profiled`) or extrapolation (above)
    /// of one timed length, not a measurement: real kernels are less
    /// efficient on short sequences than linear scaling says, and attention
    /// sits between linear (memory-bound) and quadratic (compute-bound).
    pub fn at_seq_len(
        &self,
        profiled: usize,
        len: usize,
        overhead_s: f64,
        floors_s: &[f64],
    ) -> ModelProfile {
        let r = len as f64 / profiled.max(1) as f64;
        let layers: Vec<LayerProfile> = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let f = if l.op == "attention" { r * r } else { r };
                let rest = (l.time_s - overhead_s).max(0.0);
                let floor = floors_s.get(i).copied().unwrap_or(0.0);
                LayerProfile {
                    flops: (l.flops as f64 * f).round() as u64,
                    bytes: (l.bytes as f64 * f).round() as u64,
                    time_s: (overhead_s.min(l.time_s) + rest * f).max(floor),
                    ..l.clone()
                }
            })
            .collect();
        ModelProfile {
            total_s: layers.iter().map(|l| l.time_s).sum(),
            layers,
        }
    }
}

/// The sequence length a profile's transformer entries are timed at: the
/// preset's default length (`bert_base` and `gpt2`: 512 tokens full, 16
/// tiny), whatever length a package was generated or imported at. `None`
/// for the CNNs, whose requests choose only the batch.
pub fn profiled_seq_len(family: Family, scale: Scale) -> Option<usize> {
    family.config(scale).seq_len()
}

/// A training iteration takes this many forward passes at its batch: the
/// backward pass costs about twice the forward (a gradient for the
/// activations and one for the weights, each a GEMM of the forward's
/// size), and the SGD update reads and writes the parameters once, which is
/// small next to them. An estimate, stated wherever it is used.
pub const TRAIN_ITERATION_FORWARD_FACTOR: f64 = 3.0;

/// The key of a model in [`Profile::models`]: `"resnet152/full/b8"`.
pub fn model_key(family: Family, scale: Scale, batch: usize) -> String {
    format!("{family}/{scale}/b{batch}")
}

/// Splits a model key into its parts; `None` when it is not one.
pub fn parse_model_key(key: &str) -> Option<(Family, Scale, usize)> {
    let mut parts = key.split('/');
    let family = parts.next()?.parse().ok()?;
    let scale = parts.next()?.parse().ok()?;
    let batch: usize = parts.next()?.strip_prefix('b')?.parse().ok()?;
    if parts.next().is_some() || batch == 0 {
        return None;
    }
    Some((family, scale, batch))
}

/// A profile file's contents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub format_version: u32,
    /// `"NVIDIA H200"`.
    pub gpu: String,
    pub source: Source,
    /// When the numbers were obtained (`YYYY-MM-DD`).
    pub date: String,
    /// Driver version of a measurement; `None` for estimates.
    pub driver: Option<String>,
    /// How the numbers were obtained, with every assumption.
    pub method: String,
    pub peaks: Peaks,
    /// By [`model_key`].
    pub models: BTreeMap<String, ModelProfile>,
    /// The file it was loaded from (`None` when built in memory).
    #[serde(skip)]
    path: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProfileError {
    #[error("cannot read profile {}: {source}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write profile {}: {source}", .path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("profile {} is not a valid profile (format in settings/profiles/README.md): {source}", .path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("profile {}: {what}", .path.display())]
    Invalid { path: PathBuf, what: String },
}

#[derive(Deserialize)]
struct VersionOnly {
    format_version: u32,
}

impl Profile {
    /// A profile built in memory (no file).
    pub fn new(
        gpu: impl Into<String>,
        source: Source,
        date: impl Into<String>,
        driver: Option<String>,
        method: impl Into<String>,
        peaks: Peaks,
    ) -> Profile {
        Profile {
            format_version: PROFILE_FORMAT_VERSION,
            gpu: gpu.into(),
            source,
            date: date.into(),
            driver,
            method: method.into(),
            peaks,
            models: BTreeMap::new(),
            path: None,
        }
    }

    /// Reads and validates a profile file. Errors name the file and what is
    /// wrong with it (JSON errors with line and column).
    pub fn load(path: impl AsRef<Path>) -> Result<Profile, ProfileError> {
        let path = path.as_ref().to_path_buf();
        let text = std::fs::read_to_string(&path).map_err(|source| ProfileError::Read {
            path: path.clone(),
            source,
        })?;
        let parse = |source| ProfileError::Parse {
            path: path.clone(),
            source,
        };
        let version: VersionOnly = serde_json::from_str(&text).map_err(parse)?;
        if version.format_version != PROFILE_FORMAT_VERSION {
            return Err(ProfileError::Invalid {
                path,
                what: format!(
                    "format_version {} (this build reads {PROFILE_FORMAT_VERSION})",
                    version.format_version
                ),
            });
        }
        let mut profile: Profile = serde_json::from_str(&text).map_err(parse)?;
        profile.path = Some(path.clone());
        profile
            .validate()
            .map_err(|what| ProfileError::Invalid { path, what })?;
        Ok(profile)
    }

    /// Checks what serde cannot: peaks, keys, layer ids, times and totals.
    pub fn validate(&self) -> Result<(), String> {
        if self.format_version != PROFILE_FORMAT_VERSION {
            return Err(format!(
                "format_version {} (this build reads {PROFILE_FORMAT_VERSION})",
                self.format_version
            ));
        }
        if self.gpu.trim().is_empty() {
            return Err("gpu is empty".into());
        }
        for (name, v) in self.peaks.fields() {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("peaks.{name} is {v}, expected a positive number"));
            }
        }
        if self.models.is_empty() {
            return Err("models is empty".into());
        }
        for (key, m) in &self.models {
            if parse_model_key(key).is_none() {
                return Err(format!(
                    "model key {key:?} is not <family>/<scale>/b<batch> (e.g. \"resnet152/full/b8\")"
                ));
            }
            if m.layers.is_empty() {
                return Err(format!("model {key} has no layers"));
            }
            let mut sum = 0.0;
            for (i, l) in m.layers.iter().enumerate() {
                if l.id != i {
                    return Err(format!(
                        "model {key}: layer {i} ({}) has id {}",
                        l.name, l.id
                    ));
                }
                if !(l.time_s.is_finite() && l.time_s >= 0.0) {
                    return Err(format!(
                        "model {key}: layer {i} ({}) has time_s {}, expected a number >= 0",
                        l.name, l.time_s
                    ));
                }
                sum += l.time_s;
            }
            // Totals are written rounded to the nanosecond.
            let tolerance = 1e-9 * (m.layers.len() as f64 + 1.0);
            if !m.total_s.is_finite() || (m.total_s - sum).abs() > tolerance {
                return Err(format!(
                    "model {key}: total_s is {} but its layers sum to {sum}",
                    m.total_s
                ));
            }
        }
        Ok(())
    }

    /// The file this profile was loaded from.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The file for messages, or `(built in memory)`.
    pub fn origin(&self) -> String {
        match &self.path {
            Some(p) => p.display().to_string(),
            None => "(built in memory)".to_string(),
        }
    }

    /// Where the numbers came from, for every figure printed from them:
    /// `estimated (NVIDIA H200 peaks)` or
    /// `measured on NVIDIA H200, driver 560.35, 2026-11-21`.
    pub fn source_label(&self) -> String {
        match self.source {
            Source::Estimated => format!("estimated ({} peaks)", self.gpu),
            Source::Measured => format!(
                "measured on {}, driver {}, {}",
                self.gpu,
                self.driver.as_deref().unwrap_or("unknown"),
                self.date
            ),
        }
    }

    /// The model at exactly this batch size.
    pub fn get_exact(&self, family: Family, scale: Scale, batch: usize) -> Option<&ModelProfile> {
        self.models.get(&model_key(family, scale, batch))
    }

    /// Batch sizes present for a family and scale, ascending.
    pub fn batches(&self, family: Family, scale: Scale) -> Vec<usize> {
        let mut b: Vec<usize> = self
            .models
            .keys()
            .filter_map(|k| parse_model_key(k))
            .filter(|&(f, s, _)| f == family && s == scale)
            .map(|(_, _, b)| b)
            .collect();
        b.sort_unstable();
        b
    }

    /// The model at `batch`: borrowed when the profile has that batch;
    /// otherwise built layer by layer from the batches present for the same
    /// family and scale (owned):
    ///
    /// - between two batches present, each layer's flops, bytes and time are
    ///   interpolated linearly in the batch;
    /// - above the largest, extrapolated along the line through the two
    ///   largest (a layer's time never falls below the largest's);
    /// - below the smallest, the smallest's times are kept: a smaller batch
    ///   does not shrink a layer's launch overhead or its weight reads, so
    ///   scaling down would underestimate;
    /// - with a single batch present and a larger one asked for, every layer
    ///   is scaled by `batch / present` (overestimates: launch overhead and
    ///   weight reads scale too).
    ///
    /// `None` when the family and scale are absent.
    pub fn get(&self, family: Family, scale: Scale, batch: usize) -> Option<Cow<'_, ModelProfile>> {
        if let Some(m) = self.get_exact(family, scale, batch) {
            return Some(Cow::Borrowed(m));
        }
        let present = self.batches(family, scale);
        let (&smallest, &largest) = (present.first()?, present.last()?);
        let at = |b: usize| self.get_exact(family, scale, b);
        let m = if batch < smallest {
            at(smallest)?.clone()
        } else if present.len() == 1 {
            at(smallest)?.scaled(batch as f64 / smallest as f64)
        } else {
            let (lo, hi) = if batch > largest {
                (present[present.len() - 2], largest)
            } else {
                let i = present.partition_point(|&b| b < batch);
                (present[i - 1], present[i])
            };
            let t = (batch as f64 - lo as f64) / (hi as f64 - lo as f64);
            let floor = batch > largest;
            ModelProfile::between(at(lo)?, at(hi)?, t, floor)?
        };
        Some(Cow::Owned(m))
    }

    /// One training iteration (forward, backward, SGD update) of `batch`
    /// inputs, estimated as [`TRAIN_ITERATION_FORWARD_FACTOR`] forward
    /// passes at that batch (a profile holds forward times only). `None`
    /// when the family and scale are absent.
    pub fn train_iteration_s(&self, family: Family, scale: Scale, batch: usize) -> Option<f64> {
        Some(self.get(family, scale, batch)?.total_s * TRAIN_ITERATION_FORWARD_FACTOR)
    }

    /// The profile as written to disk: top-level fields one per line, one
    /// line per layer, models in key order. Deterministic, so a regenerated
    /// estimate can be compared with the shipped file byte for byte.
    pub fn to_json_text(&self) -> String {
        fn j<T: Serialize + ?Sized>(v: &T) -> String {
            serde_json::to_string(v).expect("profile values serialise")
        }
        let mut s = String::new();
        s.push_str("{\n");
        s.push_str(&format!("  \"format_version\": {},\n", self.format_version));
        s.push_str(&format!("  \"gpu\": {},\n", j(&self.gpu)));
        s.push_str(&format!("  \"source\": {},\n", j(&self.source)));
        s.push_str(&format!("  \"date\": {},\n", j(&self.date)));
        s.push_str(&format!("  \"driver\": {},\n", j(&self.driver)));
        s.push_str(&format!("  \"method\": {},\n", j(&self.method)));
        s.push_str("  \"peaks\": {\n");
        let peaks = self.peaks.fields();
        for (i, (name, v)) in peaks.iter().enumerate() {
            let comma = if i + 1 < peaks.len() { "," } else { "" };
            s.push_str(&format!("    \"{name}\": {}{comma}\n", j(v)));
        }
        s.push_str("  },\n");
        s.push_str("  \"models\": {\n");
        for (mi, (key, m)) in self.models.iter().enumerate() {
            s.push_str(&format!("    {}: {{\n", j(key)));
            s.push_str(&format!("      \"total_s\": {},\n", j(&m.total_s)));
            s.push_str("      \"layers\": [\n");
            for (li, l) in m.layers.iter().enumerate() {
                let comma = if li + 1 < m.layers.len() { "," } else { "" };
                s.push_str(&format!("        {}{comma}\n", j(l)));
            }
            s.push_str("      ]\n");
            let comma = if mi + 1 < self.models.len() { "," } else { "" };
            s.push_str(&format!("    }}{comma}\n"));
        }
        s.push_str("  }\n");
        s.push_str("}\n");
        s
    }

    /// Writes [`Profile::to_json_text`] to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), ProfileError> {
        let path = path.as_ref();
        std::fs::write(path, self.to_json_text()).map_err(|source| ProfileError::Write {
            path: path.to_path_buf(),
            source,
        })
    }
}
