//! `distmind model gen`: packages with seeded, deterministic random weights.

use std::path::PathBuf;

use distmind_common::checksum::checksum;
use distmind_common::limits::GROUP_BYTES_DEFAULT;

use crate::config::{Family, ModelConfig, Scale};
use crate::dtype::ParamDtype;
use crate::graph::{Architecture, Init, ParamDecl};
use crate::package::{write_package, PackageSpec};
use crate::{ModelError, Result};

/// What `generate` writes.
#[derive(Debug, Clone)]
pub struct GenOptions {
    pub family: Family,
    /// Number of variants (each with different weights: seed + i).
    pub variants: usize,
    pub out_dir: PathBuf,
    pub scale: Scale,
    pub seed: u64,
    pub group_bytes: u64,
    /// How the weights are stored: the same seeded f32 values, rounded to
    /// nearest (ties to even) for f16 and bf16.
    pub dtype: ParamDtype,
}

impl GenOptions {
    /// One full-scale variant, seed 0, the default group size, f32.
    pub fn new(family: Family, out_dir: impl Into<PathBuf>) -> Self {
        GenOptions {
            family,
            variants: 1,
            out_dir: out_dir.into(),
            scale: Scale::Full,
            seed: 0,
            group_bytes: GROUP_BYTES_DEFAULT,
            dtype: ParamDtype::F32,
        }
    }
}

/// The original's model names: `resnet152-alter-1-00000000` at full scale,
/// `resnet152-tiny-00000000` at tiny scale.
pub fn variant_name(family: Family, scale: Scale, i: usize) -> String {
    match scale {
        Scale::Full => format!("{family}-alter-1-{i:08}"),
        Scale::Tiny => format!("{family}-tiny-{i:08}"),
    }
}

/// Writes `opts.variants` packages under `opts.out_dir`; returns their directories.
pub fn generate(opts: &GenOptions) -> Result<Vec<PathBuf>> {
    let config = opts.family.config(opts.scale);
    let arch = config.build();
    (0..opts.variants)
        .map(|i| {
            let name = variant_name(opts.family, opts.scale, i);
            write_variant(opts, &config, &arch, name, opts.seed.wrapping_add(i as u64))
        })
        .collect()
}

/// Writes one package of `opts.family` at `opts.scale` with the weights of
/// seed `opts.seed`, named `name` instead of a variant name (e.g. the
/// original's training job `resnet152_train`); `opts.variants` is ignored.
/// Returns its directory.
pub fn generate_named(opts: &GenOptions, name: &str) -> Result<PathBuf> {
    if name.is_empty() || name.contains(['/', '\\']) || name == "." || name == ".." {
        return Err(ModelError::InvalidOption(format!(
            "package name {name:?} must be non-empty and name no directory"
        )));
    }
    let config = opts.family.config(opts.scale);
    let arch = config.build();
    write_variant(opts, &config, &arch, name.to_string(), opts.seed)
}

fn write_variant(
    opts: &GenOptions,
    config: &ModelConfig,
    arch: &Architecture,
    name: String,
    seed: u64,
) -> Result<PathBuf> {
    let data: Vec<Vec<u8>> = arch
        .params
        .iter()
        .map(|p| random_param(p, seed, opts.dtype))
        .collect();
    let spec = PackageSpec {
        name,
        config: config.clone(),
        scale: Some(opts.scale),
        seed: Some(seed),
        origin: None,
        group_bytes: opts.group_bytes,
        dtype: opts.dtype,
    };
    write_package(&opts.out_dir, &spec, arch, &data)?;
    Ok(opts.out_dir.join(&spec.name))
}

/// SplitMix64: tiny, fast and good enough for weights.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
}

/// The little-endian bytes of one param stored as `dtype`. A param's values
/// depend only on the seed and its name; a half-precision package holds the
/// f32 package's values rounded to nearest, ties to even.
pub(crate) fn random_param(p: &ParamDecl, seed: u64, dtype: ParamDtype) -> Vec<u8> {
    let mut rng = SplitMix64(seed ^ checksum(p.name.as_bytes()));
    let (lo, hi) = match p.init {
        Init::FanIn(fan_in) => {
            let b = 1.0 / (fan_in.max(1) as f32).sqrt();
            (-b, b)
        }
        Init::Uniform(lo, hi) => (lo, hi),
        Init::AroundOne => (0.9, 1.1),
    };
    let n = p.numel();
    let mut out = Vec::with_capacity(n * dtype.size_bytes() as usize);
    for _ in 0..n {
        dtype.push_narrowed(lo + (hi - lo) * rng.unit(), &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_package_is_variant_zero_under_its_own_name() {
        let dir = tempfile::tempdir().unwrap();
        let opts = GenOptions {
            scale: Scale::Tiny,
            seed: 7,
            ..GenOptions::new(Family::Resnet152, dir.path())
        };
        let named = generate_named(&opts, "resnet152_train").unwrap();
        let variant = generate(&opts).unwrap().remove(0);
        let a = crate::Package::open(&named).unwrap();
        let b = crate::Package::open(&variant).unwrap();
        assert_eq!(a.manifest.name, "resnet152_train");
        assert_eq!(a.manifest.scale, Some(Scale::Tiny));
        assert_eq!(a.manifest.seed, Some(7));
        assert_eq!(a.group_bytes(0).unwrap(), b.group_bytes(0).unwrap());
        for bad in ["", "a/b", ".."] {
            let e = generate_named(&opts, bad).unwrap_err();
            assert!(e.to_string().contains("name no directory"), "{bad}: {e}");
        }
    }
}
