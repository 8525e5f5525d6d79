//! The synthetic samples of a job (`data: {"synthetic": {"seed": S}}`):
//! every stage that needs a model input, and the last stage for the
//! target, draws it from the same generator keyed by (seed, pipeline,
//! iteration, microbatch), so every stage and every run agree without a
//! byte of it crossing the network. Pipeline `p` draws from `seed + p`, as
//! the spec says.
//!
//! The samples carry a signal the model can learn, so a job's loss falls:
//!
//! * CNNs (cross-entropy): each sample has a class `c`, uniform in
//!   `0..min(classes, SYNTHETIC_CLASSES)`, and its image is noise
//!   `0.5 U(-1, 1)` shifted by a brightness that encodes `c` (the class's
//!   band of `(-0.5, 0.5)`, jittered within the band per sample, so no two
//!   images of a microbatch are alike, which batch norm over a few values
//!   per channel needs).
//! * Transformers (mean squared error on the last output): token ids are
//!   uniform over the vocabulary; the target of a position is a fixed
//!   vector per token id (a table in `[-1, 1)` drawn from the seed, the
//!   same for every pipeline): per position for a `[N, L, H]` output
//!   (GPT-2's hidden states), of the first token for `[N, H]` (BERT's
//!   pooler).
//!
//! Draws are SplitMix64 hashes, independent of `rand`'s versions.

use distmind_models::graph::EmbeddingIds;
use distmind_models::{Dtype, Manifest, Op};

use crate::exec::HostTensor;
use crate::train::{LossKind, Target};

/// Most classes a CNN's synthetic labels use.
pub(crate) const SYNTHETIC_CLASSES: usize = 10;

/// SplitMix64's finaliser of `a` combined with `b`: a well-mixed key.
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    let mut z = a
        .wrapping_add(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in `[0, 1)` from a key.
fn unit(key: u64) -> f64 {
    (key >> 11) as f64 / (1u64 << 53) as f64
}

/// A stream of draws from one key.
struct Draws {
    key: u64,
    n: u64,
}

impl Draws {
    fn new(key: u64) -> Self {
        Draws { key, n: 0 }
    }
    fn next(&mut self) -> u64 {
        self.n += 1;
        mix(self.key, self.n)
    }
    fn unit(&mut self) -> f64 {
        unit(self.next())
    }
}

/// What the samples look like: the manifest's inputs at `rows` samples.
#[derive(Debug, Clone)]
enum Kind {
    /// One f32 image input; `classes` of the logits; `labels` used.
    Images { classes: usize, labels: usize },
    /// One token-id input over `vocab`; the target's shape.
    Tokens { vocab: usize, target: Vec<usize> },
}

/// One pipeline's synthetic samples. See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct Synthetic {
    seed: u64,
    pipeline: u32,
    rows: usize,
    /// The model input's shape at `rows` samples.
    input: Vec<usize>,
    kind: Kind,
}

impl Synthetic {
    /// The generator of pipeline `pipeline` for microbatches of `rows`
    /// samples, or why `manifest` has no synthetic data.
    pub fn new(manifest: &Manifest, seed: u64, pipeline: u32, rows: usize) -> Result<Self, String> {
        let [spec] = manifest.inputs.as_slice() else {
            return Err(format!(
                "synthetic data makes one model input; {} has {}",
                manifest.name,
                manifest.inputs.len()
            ));
        };
        if rows == 0 || spec.shape.is_empty() {
            return Err(format!(
                "no samples of {rows} rows for input {} of shape {:?}",
                spec.name, spec.shape
            ));
        }
        let mut input = spec.shape.clone();
        input[0] = rows;
        let loss = LossKind::for_manifest(manifest).map_err(|e| e.to_string())?;
        let kind = match (loss, spec.dtype) {
            (LossKind::CrossEntropy { classes }, Dtype::F32) => Kind::Images {
                classes,
                labels: classes.min(SYNTHETIC_CLASSES),
            },
            (LossKind::MeanSquaredError, Dtype::I64) => {
                let vocab = manifest
                    .layers
                    .iter()
                    .find_map(|l| match l.op {
                        Op::Embedding {
                            num_embeddings,
                            ids: EmbeddingIds::Input,
                            ..
                        } if l.inputs == [-1] => Some(num_embeddings),
                        _ => None,
                    })
                    .ok_or_else(|| {
                        format!(
                            "{}: no embedding looks up the token ids of input {}",
                            manifest.name, spec.name
                        )
                    })?;
                let out = manifest
                    .outputs
                    .last()
                    .ok_or_else(|| format!("{} has no outputs", manifest.name))?;
                let mut target = out.shape.clone();
                if target.len() < 2 {
                    return Err(format!(
                        "{}: output {} of shape {:?} is not [N, ..., H]",
                        manifest.name, out.name, out.shape
                    ));
                }
                target[0] = rows;
                Kind::Tokens { vocab, target }
            }
            (loss, dtype) => {
                return Err(format!(
                    "{}: no synthetic samples for a {} loss on a {dtype:?} input",
                    manifest.name,
                    loss.name()
                ))
            }
        };
        Ok(Synthetic {
            seed,
            pipeline,
            rows,
            input,
            kind,
        })
    }

    /// The key of sample `row` of a microbatch.
    fn sample_key(&self, iteration: u64, microbatch: u64, row: usize) -> u64 {
        let pipeline_seed = self.seed.wrapping_add(self.pipeline.into());
        mix(mix(mix(pipeline_seed, iteration), microbatch), row as u64)
    }

    /// Sample `row`'s class (images) or token ids (tokens).
    fn class_of(&self, key: u64, labels: usize) -> (usize, f64) {
        let mut d = Draws::new(mix(key, 1));
        let c = (d.next() % labels as u64) as usize;
        (c, d.unit())
    }

    fn tokens_of(&self, key: u64, vocab: usize) -> Vec<i64> {
        let per = self.input[1..].iter().product::<usize>();
        let mut d = Draws::new(mix(key, 2));
        (0..per).map(|_| (d.next() % vocab as u64) as i64).collect()
    }

    /// Model input 0 of microbatch `microbatch` of `iteration`.
    pub fn input(&self, iteration: u64, microbatch: u64) -> HostTensor {
        match &self.kind {
            Kind::Images { labels, .. } => {
                let per: usize = self.input[1..].iter().product();
                let mut values = Vec::with_capacity(self.rows * per);
                for row in 0..self.rows {
                    let key = self.sample_key(iteration, microbatch, row);
                    let (c, jitter) = self.class_of(key, *labels);
                    // The class's band of (-0.5, 0.5), jittered within it.
                    let brightness = (c as f64 + 0.1 + 0.8 * jitter) / *labels as f64 - 0.5;
                    let mut d = Draws::new(mix(key, 3));
                    values.extend(
                        (0..per).map(|_| (0.5 * (2.0 * d.unit() - 1.0) + brightness) as f32),
                    );
                }
                HostTensor::f32(self.input.clone(), values)
            }
            Kind::Tokens { vocab, .. } => {
                let mut ids = Vec::with_capacity(self.input.iter().product());
                for row in 0..self.rows {
                    ids.extend(self.tokens_of(self.sample_key(iteration, microbatch, row), *vocab));
                }
                HostTensor::i64(self.input.clone(), ids)
            }
        }
    }

    /// The loss's target for microbatch `microbatch` of `iteration`.
    pub fn target(&self, iteration: u64, microbatch: u64) -> Target {
        match &self.kind {
            Kind::Images { labels, classes } => {
                debug_assert!(labels <= classes);
                Target::Labels(
                    (0..self.rows)
                        .map(|row| {
                            let key = self.sample_key(iteration, microbatch, row);
                            self.class_of(key, *labels).0 as i64
                        })
                        .collect(),
                )
            }
            Kind::Tokens { vocab, target } => {
                let hidden = *target.last().expect("checked: rank >= 2");
                let per_position = target.len() >= 3;
                let positions: usize = target[1..target.len() - 1].iter().product();
                let table_key = mix(self.seed, 0x0074_6162_6c65);
                let mut values = Vec::with_capacity(target.iter().product());
                for row in 0..self.rows {
                    let ids = self.tokens_of(self.sample_key(iteration, microbatch, row), *vocab);
                    for pos in 0..positions {
                        let id = if per_position {
                            ids[pos.min(ids.len() - 1)]
                        } else {
                            ids[0]
                        };
                        let row_key = mix(table_key, id as u64);
                        values.extend(
                            (0..hidden).map(|h| (2.0 * unit(mix(row_key, h as u64)) - 1.0) as f32),
                        );
                    }
                }
                Target::Values(HostTensor::f32(target.clone(), values))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::TensorData;
    use distmind_models::{Family, GenOptions, Package, Scale};

    fn manifest(family: Family) -> (tempfile::TempDir, Manifest) {
        let dir = tempfile::tempdir().unwrap();
        let opts = GenOptions {
            scale: Scale::Tiny,
            ..GenOptions::new(family, dir.path())
        };
        let path = distmind_models::generate(&opts).unwrap().remove(0);
        let m = Package::open(&path).unwrap().manifest;
        (dir, m)
    }

    #[test]
    fn every_stage_and_every_run_draws_the_same_samples() {
        for family in [Family::Resnet152, Family::Gpt2, Family::BertBase] {
            let (_d, m) = manifest(family);
            // Two stages' generators, made separately, agree.
            let a = Synthetic::new(&m, 42, 1, 3).unwrap();
            let b = Synthetic::new(&m, 42, 1, 3).unwrap();
            assert_eq!(a.input(5, 2), b.input(5, 2), "{family:?}");
            assert_eq!(a.target(5, 2), b.target(5, 2), "{family:?}");
            // Another microbatch, iteration or pipeline draws other samples.
            assert_ne!(a.input(5, 2), a.input(5, 3));
            assert_ne!(a.input(5, 2), a.input(6, 2));
            let other = Synthetic::new(&m, 42, 2, 3).unwrap();
            assert_ne!(a.input(5, 2), other.input(5, 2));
            // Pipeline p draws from seed + p.
            assert_eq!(
                other.input(5, 2),
                Synthetic::new(&m, 43, 1, 3).unwrap().input(5, 2)
            );
            let x = a.input(0, 0);
            assert_eq!(x.shape[0], 3);
            assert_eq!(x.shape[1..], m.inputs[0].shape[1..]);
        }
    }

    #[test]
    fn image_labels_are_few_and_encoded_in_the_brightness() {
        let (_d, m) = manifest(Family::Resnet152);
        let s = Synthetic::new(&m, 0, 0, 8).unwrap();
        let mut seen = std::collections::HashSet::new();
        for mb in 0..20 {
            let Target::Labels(labels) = s.target(0, mb) else {
                panic!("labels")
            };
            let TensorData::F32(x) = s.input(0, mb).data else {
                panic!("f32")
            };
            let per = x.len() / labels.len();
            for (row, &c) in labels.iter().enumerate() {
                assert!((0..SYNTHETIC_CLASSES as i64).contains(&c));
                seen.insert(c);
                let mean = x[row * per..(row + 1) * per].iter().sum::<f32>() / per as f32;
                // The mean is the brightness, within its class's band.
                let band = (c as f32 / SYNTHETIC_CLASSES as f32 - 0.5)
                    ..((c + 1) as f32 / SYNTHETIC_CLASSES as f32 - 0.5);
                assert!(
                    mean > band.start - 0.03 && mean < band.end + 0.03,
                    "class {c} mean {mean}"
                );
            }
        }
        assert_eq!(seen.len(), SYNTHETIC_CLASSES);
    }

    #[test]
    fn transformer_targets_follow_the_tokens() {
        let (_d, m) = manifest(Family::Gpt2);
        let s = Synthetic::new(&m, 9, 0, 2).unwrap();
        let TensorData::I64(ids) = s.input(3, 1).data else {
            panic!("ids")
        };
        let Target::Values(t) = s.target(3, 1) else {
            panic!("values")
        };
        let TensorData::F32(v) = t.data else { panic!() };
        let hidden = *t.shape.last().unwrap();
        assert_eq!(t.shape[0], 2);
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        // Equal token ids have equal target rows; the first row differs
        // from a row of another id.
        let row = |i: usize| &v[i * hidden..(i + 1) * hidden];
        for i in 0..ids.len() {
            for j in 0..ids.len() {
                assert_eq!(ids[i] == ids[j], row(i) == row(j), "positions {i}, {j}");
            }
        }
        // Another pipeline: other ids, the same table.
        let (_d, bert) = manifest(Family::BertBase);
        let b = Synthetic::new(&bert, 9, 0, 2).unwrap();
        let Target::Values(t) = b.target(0, 0) else {
            panic!()
        };
        assert_eq!(t.shape.len(), 2, "BERT's pooler: one row per sample");
    }
}
