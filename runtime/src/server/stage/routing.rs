//! Which tensors a stage takes, makes, passes through and sends, and one
//! microbatch's forward and backward in those terms.
//!
//! A cut carries every live tensor ([`crate::train::boundary`]); a stage
//! `[first, end)` of a pipeline:
//!
//! * gets from the previous stage, with each forward, the layer outputs
//!   live at `first` ([`Routes::from_prev`]); model inputs live there are
//!   never sent: every stage that needs one draws it from the job's seeded
//!   generator ([`Routes::local_inputs`], [`super::data`]);
//! * sends the next stage the layer outputs live at `end`
//!   ([`Routes::to_next`]): the ones it made, and the ones made before it
//!   that a later stage reads ([`Routes::passed`]: they PASS THROUGH it,
//!   copied from what it got);
//! * gets back from the next stage the gradient of everything it sent and
//!   sends the previous stage the gradient of everything it got: its own
//!   layers' gradient of each input, PLUS, for a tensor that passed
//!   through, the gradient that came back for it (a tensor read by several
//!   stages gets the sum of their gradients; one this stage does not read
//!   gets what came back, exactly).
//!
//! [`StageCompute`] does that on a [`StageModel`] with the wire's tensors
//! ([`crate::dist::Tensor`], f32): the stage worker moves them over its
//! links; the tests here chain stages in one process.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{Device, Tensor};
use distmind_models::Manifest;

use crate::dist::Tensor as WireTensor;
use crate::exec::{HostTensor, TensorData};
use crate::train::boundary::{boundary, describe_ref};
use crate::train::{tensor_to_host, StageModel, StageTensor, Target, TrainError};

/// A stage's tensors by role; every list ascending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Routes {
    /// Model inputs live at `first` (refs `< 0`): drawn locally.
    pub local_inputs: Vec<i64>,
    /// Layer outputs live at `first`: each forward's message from the
    /// previous stage (empty for stage 0).
    pub from_prev: Vec<i64>,
    /// Layer outputs live at `end`: each forward's message to the next
    /// stage (empty for the last stage).
    pub to_next: Vec<i64>,
    /// The part of `to_next` made before `first`: passed through.
    pub passed: Vec<i64>,
}

impl Routes {
    /// The routes of stage `layers` of `manifest`.
    pub fn of(manifest: &Manifest, layers: Range<usize>) -> Result<Routes, TrainError> {
        let start = boundary(manifest, layers.start)?;
        let last = layers.end == manifest.layers.len();
        let end = if last {
            Vec::new()
        } else {
            boundary(manifest, layers.end)?
        };
        let first = layers.start as i64;
        Ok(Routes {
            local_inputs: start.iter().copied().filter(|&r| r < 0).collect(),
            from_prev: start.iter().copied().filter(|&r| r >= 0).collect(),
            to_next: end.iter().copied().filter(|&r| r >= 0).collect(),
            passed: end
                .iter()
                .copied()
                .filter(|&r| (0..first).contains(&r))
                .collect(),
        })
    }
}

/// What a microbatch brought that does not fit the routes (a peer's
/// message with the wrong tensors), or the stage's own failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum ComputeError {
    #[error("microbatch {mb}: the {what} carried tensors {got:?}, the stage expects {want:?} ({detail})")]
    Tensors {
        mb: u64,
        what: &'static str,
        got: Vec<i64>,
        want: Vec<i64>,
        detail: String,
    },
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("microbatch {mb}: {detail}")]
    Convert { mb: u64, detail: String },
}

/// A stage's model with its routes: one microbatch's forward and backward
/// in wire tensors.
pub(crate) struct StageCompute {
    model: StageModel,
    routes: Routes,
}

/// The tensors of a message by reference, checked against `want` (same
/// set, each once).
fn by_ref(
    mb: u64,
    what: &'static str,
    tensors: Vec<WireTensor>,
    want: &[i64],
    manifest: &Manifest,
) -> Result<HashMap<i64, WireTensor>, ComputeError> {
    let got: Vec<i64> = tensors.iter().map(|t| t.reference).collect();
    let mut map = HashMap::with_capacity(tensors.len());
    for t in tensors {
        map.insert(t.reference, t);
    }
    if map.len() != got.len()
        || map.len() != want.len()
        || want.iter().any(|r| !map.contains_key(r))
    {
        let missing: Vec<String> = want
            .iter()
            .filter(|r| !map.contains_key(r))
            .map(|r| describe_ref(manifest, *r))
            .collect();
        return Err(ComputeError::Tensors {
            mb,
            what,
            got,
            want: want.to_vec(),
            detail: if missing.is_empty() {
                "extra or repeated tensors".into()
            } else {
                format!("missing {}", missing.join(", "))
            },
        });
    }
    Ok(map)
}

fn host_of(t: WireTensor) -> HostTensor {
    // The wire decoder checked that the data fills the shape.
    HostTensor {
        shape: t.shape,
        data: TensorData::F32(t.data),
    }
}

fn candle_of(mb: u64, t: WireTensor) -> Result<(i64, Tensor), ComputeError> {
    let r = t.reference;
    Tensor::from_vec(t.data, t.shape, &Device::Cpu)
        .map(|g| (r, g))
        .map_err(|e| ComputeError::Convert {
            mb,
            detail: format!("gradient of {r}: {e}"),
        })
}

fn wire_of(mb: u64, r: i64, t: &Tensor) -> Result<WireTensor, ComputeError> {
    let convert = |detail: String| ComputeError::Convert { mb, detail };
    let h = tensor_to_host(t).map_err(|e| convert(format!("tensor {r}: {e}")))?;
    match h.data {
        TensorData::F32(data) => Ok(WireTensor {
            reference: r,
            shape: h.shape,
            data,
        }),
        TensorData::I64(_) => Err(convert(format!(
            "tensor {r} is i64; stage links carry f32 layer outputs only"
        ))),
    }
}

impl StageCompute {
    pub fn new(model: StageModel) -> Result<Self, TrainError> {
        let routes = Routes::of(model.manifest(), model.layers())?;
        Ok(StageCompute { model, routes })
    }

    pub fn routes(&self) -> &Routes {
        &self.routes
    }

    pub fn model(&self) -> &StageModel {
        &self.model
    }

    pub fn model_mut(&mut self) -> &mut StageModel {
        &mut self.model
    }

    pub fn is_last(&self) -> bool {
        self.model.is_last()
    }

    /// Microbatch `mb`'s forward: `received` is the previous stage's
    /// message (exactly [`Routes::from_prev`]), `local` the model inputs
    /// by reference (at least [`Routes::local_inputs`]). Returns the
    /// message for the next stage ([`Routes::to_next`] order; empty for
    /// the last stage).
    pub fn forward(
        &mut self,
        mb: u64,
        received: Vec<WireTensor>,
        local: &[(i64, HostTensor)],
    ) -> Result<Vec<WireTensor>, ComputeError> {
        let manifest = self.model.manifest();
        let mut got = by_ref(
            mb,
            "activation message",
            received,
            &self.routes.from_prev,
            manifest,
        )?;
        let mut passed = Vec::with_capacity(self.routes.passed.len());
        for r in &self.routes.passed {
            passed.push(got[r].clone());
        }
        let mut inputs: Vec<(i64, StageTensor)> =
            Vec::with_capacity(self.routes.local_inputs.len() + got.len());
        for r in &self.routes.local_inputs {
            let t = local
                .iter()
                .find(|(l, _)| l == r)
                .map(|(_, t)| t.clone())
                .ok_or_else(|| ComputeError::Convert {
                    mb,
                    detail: format!("model input {r} was not drawn"),
                })?;
            inputs.push((*r, t.into()));
        }
        for r in &self.routes.from_prev {
            let t = got.remove(r).expect("checked by by_ref");
            inputs.push((*r, host_of(t).into()));
        }
        let outputs = self.model.forward(mb, inputs)?;
        if self.is_last() {
            return Ok(Vec::new());
        }
        let mut made: HashMap<i64, WireTensor> = HashMap::with_capacity(outputs.len());
        for (r, t) in &outputs {
            made.insert(*r, wire_of(mb, *r, t)?);
        }
        for t in passed {
            made.insert(t.reference, t);
        }
        self.routes
            .to_next
            .iter()
            .map(|r| {
                made.remove(r).ok_or_else(|| ComputeError::Convert {
                    mb,
                    detail: format!("the stage made no {r} to send on"),
                })
            })
            .collect()
    }

    /// Microbatch `mb`'s backward from the next stage's gradients (exactly
    /// [`Routes::to_next`]); returns the gradients for the previous stage
    /// ([`Routes::from_prev`] order; empty for stage 0).
    pub fn backward(
        &mut self,
        mb: u64,
        received: Vec<WireTensor>,
    ) -> Result<Vec<WireTensor>, ComputeError> {
        let manifest = self.model.manifest();
        let mut got = by_ref(
            mb,
            "gradient message",
            received,
            &self.routes.to_next,
            manifest,
        )?;
        let mut passed = HashMap::with_capacity(self.routes.passed.len());
        for r in &self.routes.passed {
            passed.insert(*r, got.remove(r).expect("checked by by_ref"));
        }
        let own = got
            .into_values()
            .map(|t| candle_of(mb, t))
            .collect::<Result<Vec<_>, _>>()?;
        let grads = self.model.backward(mb, own)?;
        self.merge(mb, grads, passed)
    }

    /// The last stage's backward of microbatch `mb` from the loss against
    /// `target`: the loss, and the gradients for the previous stage.
    pub fn backward_from_loss(
        &mut self,
        mb: u64,
        target: &Target,
    ) -> Result<(f64, Vec<WireTensor>), ComputeError> {
        let lb = self.model.backward_from_loss(mb, target)?;
        let grads = self.merge(mb, lb.input_grads, HashMap::new())?;
        Ok((lb.loss, grads))
    }

    /// The stage's input gradients plus what came back for the tensors
    /// that passed through, in [`Routes::from_prev`] order.
    fn merge(
        &self,
        mb: u64,
        grads: Vec<(i64, Tensor)>,
        mut passed: HashMap<i64, WireTensor>,
    ) -> Result<Vec<WireTensor>, ComputeError> {
        let mut own: HashMap<i64, Tensor> = grads.into_iter().collect();
        self.routes
            .from_prev
            .iter()
            .map(|r| {
                let mine = own.remove(r).ok_or_else(|| ComputeError::Convert {
                    mb,
                    detail: format!("the stage gave no gradient of its input {r}"),
                })?;
                let mut w = wire_of(mb, *r, &mine)?;
                if let Some(back) = passed.remove(r) {
                    if back.shape != w.shape {
                        return Err(ComputeError::Tensors {
                            mb,
                            what: "gradient message",
                            got: vec![*r],
                            want: vec![*r],
                            detail: format!(
                                "the gradient of {r} is {:?}, the tensor {:?}",
                                back.shape, w.shape
                            ),
                        });
                    }
                    for (a, b) in w.data.iter_mut().zip(&back.data) {
                        *a += *b;
                    }
                }
                Ok(w)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::stage::data::Synthetic;
    use crate::train::{Precision, SgdConfig};
    use distmind_models::{Family, GenOptions, Package, ParamDtype, Scale};

    fn package(dir: &std::path::Path, family: Family) -> Package {
        let opts = GenOptions {
            scale: Scale::Tiny,
            group_bytes: 16 << 10,
            dtype: ParamDtype::F32,
            ..GenOptions::new(family, dir)
        };
        Package::open(&distmind_models::generate(&opts).unwrap()[0]).unwrap()
    }

    fn layer(m: &Manifest, name: &str) -> usize {
        m.layers.iter().position(|l| l.name == name).unwrap()
    }

    #[test]
    fn a_block_input_passes_through_the_stage_between() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = package(dir.path(), Family::Resnet152);
        let m = &pkg.manifest;
        let conv1 = layer(m, "layer1.0.conv1");
        let bn1 = layer(m, "layer1.0.bn1");
        let maxpool = layer(m, "maxpool") as i64;
        // The middle stage is layer1.0's conv1 output through its bn1; the
        // block input (the max pool) skips it, read by the downsample later.
        let r = Routes::of(m, conv1 + 1..bn1 + 1).unwrap();
        assert_eq!(r.local_inputs, Vec::<i64>::new());
        assert_eq!(r.from_prev, vec![maxpool, conv1 as i64]);
        assert_eq!(r.to_next, vec![maxpool, bn1 as i64]);
        assert_eq!(r.passed, vec![maxpool]);
        let first = Routes::of(m, 0..conv1 + 1).unwrap();
        assert_eq!(first.local_inputs, vec![-1]);
        assert!(first.from_prev.is_empty() && first.passed.is_empty());
        let last = Routes::of(m, bn1 + 1..m.layers.len()).unwrap();
        assert!(last.to_next.is_empty() && last.passed.is_empty());

        // GPT-2 cut after wte: the position embedding reads the token ids,
        // a model input, drawn locally by the second stage.
        let pkg = package(dir.path(), Family::Gpt2);
        let wte = layer(&pkg.manifest, "wte");
        let r = Routes::of(&pkg.manifest, wte + 1..pkg.manifest.layers.len()).unwrap();
        assert_eq!(r.local_inputs, vec![-1]);
        assert_eq!(r.from_prev, vec![wte as i64]);
    }

    /// The stages of a pipeline, chained in one process as the links would.
    fn run_pipeline(
        stages: &mut [StageCompute],
        data: &Synthetic,
        mb: u64,
    ) -> (f64, Vec<Vec<WireTensor>>) {
        let input = data.input(0, mb);
        let local = [(-1i64, input)];
        let mut msg = Vec::new();
        for s in stages.iter_mut() {
            msg = s.forward(mb, msg, &local).unwrap();
        }
        let (last, rest) = stages.split_last_mut().unwrap();
        let (loss, mut back) = last.backward_from_loss(mb, &data.target(0, mb)).unwrap();
        let mut sent = vec![back.clone()];
        for s in rest.iter_mut().rev() {
            back = s.backward(mb, back).unwrap();
            sent.push(back.clone());
        }
        (loss, sent)
    }

    /// Three stages of tiny ResNet, the middle one a tensor passes
    /// through, give the loss and every param gradient of the whole model.
    #[test]
    fn routed_stages_give_the_whole_models_gradients() {
        let dir = tempfile::tempdir().unwrap();
        for family in [Family::Resnet152, Family::Gpt2] {
            let pkg = package(&dir.path().join(family.as_str()), family);
            let m = &pkg.manifest;
            let packed = pkg.packed().unwrap().concat();
            let n = m.layers.len();
            let cuts = match family {
                Family::Resnet152 => [layer(m, "layer1.0.conv1") + 1, layer(m, "layer1.0.bn1") + 1],
                _ => [layer(m, "wte") + 1, n / 2],
            };
            let edges = [0, cuts[0], cuts[1], n];
            let mut split: Vec<StageCompute> = edges
                .windows(2)
                .map(|w| {
                    StageCompute::new(
                        StageModel::new(m, w[0]..w[1], &packed, Precision::F64).unwrap(),
                    )
                    .unwrap()
                })
                .collect();
            let mut whole =
                vec![
                    StageCompute::new(StageModel::new(m, 0..n, &packed, Precision::F64).unwrap())
                        .unwrap(),
                ];
            let data = Synthetic::new(m, 3, 0, 2).unwrap();
            for mb in 0..2 {
                let (ls, sent) = run_pipeline(&mut split, &data, mb);
                let (lw, _) = run_pipeline(&mut whole, &data, mb);
                assert!(
                    (ls - lw).abs() <= 1e-5 * lw.abs(),
                    "{family:?}: {ls} vs {lw}"
                );
                assert!(
                    sent.last().unwrap().is_empty(),
                    "stage 0 sends nothing back"
                );
            }
            let gw: HashMap<_, _> = whole[0].model().gradients().unwrap().into_iter().collect();
            let mut count = 0;
            for s in &split {
                for (name, g) in s.model().gradients().unwrap() {
                    let w = &gw[&name];
                    let scale = w.iter().fold(1e-3f64, |a, x| a.max(x.abs()));
                    let diff = g.iter().zip(w).fold(0f64, |a, (x, y)| a.max((x - y).abs()));
                    // Activations and gradients cross the cuts as f32; a
                    // routing mistake (a pass-through gradient lost or
                    // counted twice) is a difference of the gradient's size.
                    assert!(
                        diff <= 1e-3 * scale,
                        "{family:?} {name}: {diff:e} of {scale:e}"
                    );
                    count += 1;
                }
            }
            assert_eq!(count, gw.len(), "{family:?}");
            for s in &mut split {
                s.model_mut().step(&SgdConfig::default()).unwrap();
            }
        }
    }

    #[test]
    fn a_message_with_the_wrong_tensors_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = package(dir.path(), Family::Resnet152);
        let m = &pkg.manifest;
        let packed = pkg.packed().unwrap().concat();
        let conv1 = layer(m, "layer1.0.conv1");
        let mut s = StageCompute::new(
            StageModel::new(m, conv1 + 1..m.layers.len(), &packed, Precision::F32).unwrap(),
        )
        .unwrap();
        let err = s
            .forward(
                4,
                vec![WireTensor {
                    reference: conv1 as i64,
                    shape: vec![1],
                    data: vec![0.0],
                }],
                &[],
            )
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("microbatch 4") && err.contains("missing") && err.contains("maxpool"),
            "{err}"
        );
    }
}
