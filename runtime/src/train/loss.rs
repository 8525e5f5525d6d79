//! The training loss of each family, and its target.
//!
//! * CNNs ([`LossKind::CrossEntropy`]): mean softmax cross-entropy of the
//!   logits (the last output, `[N, classes]`) against integer labels.
//! * BERT and GPT-2 ([`LossKind::MeanSquaredError`]): the packages have no
//!   LM head and there is no dataset, so they train on a synthetic
//!   regression task: the mean over every element of `(y - t)^2`
//!   (`torch.nn.MSELoss()`), `y` the model's LAST output (BERT
//!   `pooler_output`, GPT-2 `last_hidden_state`), `t` a tensor of its shape
//!   drawn from a seed ([`LossKind::synthetic_target`]).

use candle_core::{bail, Tensor};
use distmind_models::{Family, Manifest};

use super::TrainError;
use crate::exec::{HostTensor, TensorData};

/// Which loss the last stage takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossKind {
    /// Softmax cross-entropy of `[N, classes]` logits against labels.
    CrossEntropy { classes: usize },
    /// Mean squared error against a target tensor of the output's shape.
    MeanSquaredError,
}

/// What the loss compares the last output with.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// One class id per sample ([`LossKind::CrossEntropy`]).
    Labels(Vec<i64>),
    /// A tensor of the last output's shape ([`LossKind::MeanSquaredError`]).
    Values(HostTensor),
}

impl Target {
    /// `"3 labels"` or `"f32 [2, 16, 32]"`, for messages.
    pub fn describe(&self) -> String {
        match self {
            Target::Labels(l) => format!("{} labels", l.len()),
            Target::Values(t) => format!("a target tensor {}", t.describe()),
        }
    }
}

impl LossKind {
    /// The loss of the manifest's family: cross-entropy for the CNNs (their
    /// last output must be `[N, classes]` logits), mean squared error for
    /// the transformers.
    pub fn for_manifest(manifest: &Manifest) -> Result<LossKind, TrainError> {
        let Some(out) = manifest.outputs.last() else {
            return Err(TrainError::Model {
                model: manifest.name.clone(),
                why: "has no outputs".into(),
            });
        };
        match manifest.family {
            Family::Resnet152 | Family::InceptionV3 | Family::Densenet201 => {
                match out.shape.as_slice() {
                    [_, k] if *k > 0 => Ok(LossKind::CrossEntropy { classes: *k }),
                    s => Err(TrainError::Model {
                        model: manifest.name.clone(),
                        why: format!(
                            "last output {} has shape {s:?}; cross-entropy wants [N, classes] \
                             logits",
                            out.name
                        ),
                    }),
                }
            }
            Family::BertBase | Family::Gpt2 => Ok(LossKind::MeanSquaredError),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            LossKind::CrossEntropy { .. } => "cross-entropy",
            LossKind::MeanSquaredError => "mean squared error",
        }
    }

    /// A seeded target for an output of shape `output_shape`: labels
    /// uniform in `0..classes` for cross-entropy; for mean squared error
    /// values uniform in `[-1, 1)` (the range of BERT's tanh pooler, and
    /// about a unit-variance LayerNorm output's).
    pub fn synthetic_target(self, output_shape: &[usize], seed: u64) -> Target {
        let mut rng = SplitMix64(seed);
        match self {
            LossKind::CrossEntropy { classes } => {
                let n = output_shape.first().copied().unwrap_or(0);
                Target::Labels(
                    (0..n)
                        .map(|_| (rng.next() % classes.max(1) as u64) as i64)
                        .collect(),
                )
            }
            LossKind::MeanSquaredError => {
                let n: usize = output_shape.iter().product();
                let values = (0..n)
                    .map(|_| ((rng.next() >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32)
                    .collect();
                Target::Values(HostTensor::f32(output_shape.to_vec(), values))
            }
        }
    }

    /// Checks `target` against the last output `out` (its shape and dtype).
    pub(crate) fn check(self, out: &Tensor, target: &Target) -> Result<(), String> {
        match (self, target) {
            (LossKind::CrossEntropy { classes }, Target::Labels(labels)) => {
                let n = match *out.dims() {
                    [n, k] if k == classes => n,
                    ref d => {
                        return Err(format!(
                            "logits have shape {d:?}, cross-entropy wants [N, {classes}]"
                        ))
                    }
                };
                if labels.len() != n {
                    return Err(format!("{} labels for {n} samples", labels.len()));
                }
                if let Some(bad) = labels.iter().find(|&&l| l < 0 || l as usize >= classes) {
                    return Err(format!("label {bad} outside 0..{classes}"));
                }
                Ok(())
            }
            (LossKind::MeanSquaredError, Target::Values(t)) => {
                if t.shape != out.dims() || !matches!(t.data, TensorData::F32(_)) {
                    return Err(format!(
                        "the target is {}, the last output is f32 {:?}",
                        t.describe(),
                        out.dims()
                    ));
                }
                Ok(())
            }
            (kind, t) => Err(format!(
                "the loss is {} and takes {}, not {}",
                kind.name(),
                match kind {
                    LossKind::CrossEntropy { .. } => "labels",
                    LossKind::MeanSquaredError => "a target tensor",
                },
                t.describe()
            )),
        }
    }

    /// The loss of `out` against `target` (checked with [`LossKind::check`]),
    /// a scalar in `out`'s dtype.
    pub(crate) fn loss(self, out: &Tensor, target: &Target) -> candle_core::Result<Tensor> {
        if let Err(why) = self.check(out, target) {
            bail!("{why}");
        }
        match (self, target) {
            (LossKind::CrossEntropy { classes }, Target::Labels(labels)) => {
                cross_entropy(out, labels, classes)
            }
            (LossKind::MeanSquaredError, Target::Values(t)) => {
                let TensorData::F32(v) = &t.data else {
                    bail!("the target is not f32");
                };
                let t = Tensor::from_slice(v, t.shape.as_slice(), out.device())?
                    .to_dtype(out.dtype())?;
                out.sub(&t)?.sqr()?.mean_all()
            }
            _ => bail!("checked above"),
        }
    }
}

/// Mean softmax cross-entropy of `logits` `[N, K]` against class ids.
fn cross_entropy(logits: &Tensor, labels: &[i64], classes: usize) -> candle_core::Result<Tensor> {
    let n = labels.len();
    let max = logits.max_keepdim(1)?.detach();
    let z = logits.broadcast_sub(&max)?;
    let lse = z.exp()?.sum_keepdim(1)?.log()?;
    let logp = z.broadcast_sub(&lse)?;
    let mut onehot = vec![0f64; n * classes];
    for (row, &l) in labels.iter().enumerate() {
        onehot[row * classes + l as usize] = 1.0;
    }
    let onehot =
        Tensor::from_vec(onehot, (n, classes), logits.device())?.to_dtype(logits.dtype())?;
    (logp * onehot)?.sum_all()?.affine(-1.0 / n as f64, 0.0)
}

/// SplitMix64: a small, well-mixed seeded generator (the targets must be
/// the same on every machine, independent of `rand`'s versions).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn mse_is_the_mean_over_every_element() {
        let y = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], (2, 2), &Device::Cpu).unwrap();
        let t = Target::Values(HostTensor::f32(vec![2, 2], vec![0.0, 2.0, 1.0, 4.0]));
        let l = LossKind::MeanSquaredError.loss(&y, &t).unwrap();
        assert_eq!(l.to_scalar::<f64>().unwrap(), (1.0 + 0.0 + 4.0 + 0.0) / 4.0);
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_log_k() {
        let y = Tensor::zeros((3, 4), DType::F64, &Device::Cpu).unwrap();
        let kind = LossKind::CrossEntropy { classes: 4 };
        let l = kind.loss(&y, &Target::Labels(vec![0, 3, 1])).unwrap();
        assert!((l.to_scalar::<f64>().unwrap() - 4f64.ln()).abs() < 1e-12);
        let err = kind.loss(&y, &Target::Labels(vec![0, 4, 1])).unwrap_err();
        assert!(err.to_string().contains("label 4 outside 0..4"), "{err}");
        let err = kind
            .loss(&y, &Target::Values(HostTensor::f32(vec![1], vec![0.0])))
            .unwrap_err();
        assert!(err.to_string().contains("takes labels"), "{err}");
    }

    #[test]
    fn synthetic_targets_are_seeded_and_in_range() {
        let a = LossKind::MeanSquaredError.synthetic_target(&[2, 3, 4], 7);
        let b = LossKind::MeanSquaredError.synthetic_target(&[2, 3, 4], 7);
        let c = LossKind::MeanSquaredError.synthetic_target(&[2, 3, 4], 8);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let Target::Values(t) = a else { panic!() };
        let TensorData::F32(v) = t.data else { panic!() };
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        let Target::Labels(l) =
            LossKind::CrossEntropy { classes: 10 }.synthetic_target(&[5, 10], 1)
        else {
            panic!()
        };
        assert_eq!(l.len(), 5);
        assert!(l.iter().all(|&x| (0..10).contains(&x)));
    }
}
