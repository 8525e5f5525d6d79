//! A stage's forward and backward per microbatch.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use distmind_models::Dtype;

use super::check::describe;
use super::{variable, InFlight, LossBackward, Slot, StageModel, StageTensor, Weights};
use crate::train::boundary::describe_ref;
use crate::train::layers;
use crate::train::loss::Target;
use crate::train::TrainError;

/// What the layers of one forward gave.
struct Ran {
    outputs: Vec<(i64, Tensor)>,
    /// (stat slot, new value) per running statistic.
    running: Vec<(usize, Tensor)>,
}

impl StageModel {
    /// Runs microbatch `mb` forward in training mode. `inputs` are the
    /// stage's input tensors ([`super::StageIo::inputs`], any order), each
    /// of the shape the graph gives it at the microbatch's batch (and
    /// tokens). Returns the outputs ([`super::StageIo::outputs`] order),
    /// detached, in the stage's precision. The graph, and the weight
    /// version it used, stay until [`StageModel::backward`] (or
    /// [`StageModel::discard`]). Updates BatchNorm running statistics;
    /// a failed forward changes nothing.
    pub fn forward(
        &mut self,
        mb: u64,
        inputs: Vec<(i64, StageTensor)>,
    ) -> Result<Vec<(i64, Tensor)>, TrainError> {
        if self.in_flight.contains_key(&mb) {
            return Err(self.batch_err(
                mb,
                "is already in flight (its forward ran, its backward did not)".into(),
            ));
        }
        if self.in_flight.len() >= self.in_flight_limit {
            return Err(TrainError::InFlightFull {
                model: self.manifest.name.clone(),
                stage: self.layers.clone(),
                mb,
                in_flight: self.in_flight.len(),
                limit: self.in_flight_limit,
            });
        }
        let mut values = self.take_inputs(mb, inputs)?;
        let mut input_vars = Vec::new();
        for r in &self.io.inputs {
            if *r >= 0 {
                let v = variable(&values[r]).map_err(|e| self.batch_err(mb, e.to_string()))?;
                values.insert(*r, v.clone());
                input_vars.push((*r, v));
            }
        }
        let weights = self.weights.clone();
        let ran = self.run_layers(mb, values, &weights)?;
        for (slot, t) in ran.running {
            self.stats[slot] = t;
        }
        let detached = ran.outputs.iter().map(|(r, t)| (*r, t.detach())).collect();
        self.in_flight.insert(
            mb,
            InFlight {
                weights,
                inputs: input_vars,
                outputs: ran.outputs,
            },
        );
        Ok(detached)
    }

    /// Microbatch `mb`'s backward from the gradients of the stage's outputs
    /// (every one of them, each the sum over the later stages that read
    /// it). Accumulates the param gradients (w.r.t. the weights the
    /// microbatch's forward used) and returns the gradients of the inputs
    /// that are layer outputs ([`super::StageIo::inputs`] order; zeros for
    /// one the outputs do not depend on). Frees the microbatch's stash. A
    /// refused call leaves the microbatch in flight.
    pub fn backward(
        &mut self,
        mb: u64,
        output_grads: Vec<(i64, Tensor)>,
    ) -> Result<Vec<(i64, Tensor)>, TrainError> {
        let flight = self.flight(mb)?;
        let mut given: HashMap<i64, Tensor> = HashMap::with_capacity(output_grads.len());
        for (r, g) in output_grads {
            if !flight.outputs.iter().any(|(o, _)| *o == r) {
                return Err(self.batch_err(
                    mb,
                    format!(
                        "got a gradient for {}, which is not an output of the stage (outputs: \
                         {:?})",
                        describe_ref(&self.manifest, r),
                        self.io.outputs
                    ),
                ));
            }
            if given.insert(r, g).is_some() {
                return Err(self.batch_err(
                    mb,
                    format!("got two gradients for {}", describe_ref(&self.manifest, r)),
                ));
            }
        }
        let mut root: Option<Tensor> = None;
        for (r, out) in &flight.outputs {
            let g = given.get(r).ok_or_else(|| {
                self.batch_err(
                    mb,
                    format!(
                        "the gradient of {} is missing",
                        describe_ref(&self.manifest, *r)
                    ),
                )
            })?;
            if g.dims() != out.dims() || !g.dtype().is_float() {
                return Err(self.batch_err(
                    mb,
                    format!(
                        "the gradient of {} is {:?} {:?}, the output is {:?} {:?}",
                        describe_ref(&self.manifest, *r),
                        g.dtype(),
                        g.dims(),
                        out.dtype(),
                        out.dims()
                    ),
                ));
            }
            let term = g
                .to_dtype(out.dtype())
                .and_then(|g| out.mul(&g.detach())?.sum_all())
                .and_then(|t| match &root {
                    Some(acc) => acc.add(&t),
                    None => Ok(t),
                })
                .map_err(|e| self.batch_err(mb, e.to_string()))?;
            root = Some(term);
        }
        let root = root.ok_or_else(|| self.batch_err(mb, "the stage has no outputs".into()))?;
        self.finish_backward(mb, &root)
    }

    /// The last stage's backward: the loss ([`super::LossKind`]) of the
    /// model's last output against `target`, back-propagated as
    /// [`StageModel::backward`] does.
    pub fn backward_from_loss(
        &mut self,
        mb: u64,
        target: &Target,
    ) -> Result<LossBackward, TrainError> {
        let out = self.last_output(mb)?;
        let loss = self.loss_of(mb, &out, target)?;
        let value = scalar(&loss).map_err(|e| self.batch_err(mb, format!("loss: {e}")))?;
        let input_grads = self.finish_backward(mb, &loss)?;
        Ok(LossBackward {
            loss: value,
            input_grads,
        })
    }

    /// The training-mode loss of `inputs` against `target` on the last
    /// stage, with the current weights, changing nothing (no stash, no
    /// running statistics): for gradient checks and reports.
    pub fn training_loss(
        &mut self,
        mb: u64,
        inputs: Vec<(i64, StageTensor)>,
        target: &Target,
    ) -> Result<f64, TrainError> {
        self.require_last(mb)?;
        let values = self.take_inputs(mb, inputs)?;
        let weights = self.weights.clone();
        let ran = self.run_layers(mb, values, &weights)?;
        let last = self.last_ref();
        let out = ran
            .outputs
            .iter()
            .find(|(r, _)| *r == last)
            .map(|(_, t)| t.clone())
            .ok_or_else(|| self.batch_err(mb, "the last output is missing".into()))?;
        let loss = self.loss_of(mb, &out, target)?;
        scalar(&loss).map_err(|e| self.batch_err(mb, format!("loss: {e}")))
    }

    fn flight(&self, mb: u64) -> Result<&InFlight, TrainError> {
        self.in_flight.get(&mb).ok_or_else(|| {
            self.batch_err(
                mb,
                format!(
                    "no forward of it is in flight (in flight: {:?})",
                    self.in_flight.keys().collect::<Vec<_>>()
                ),
            )
        })
    }

    fn last_ref(&self) -> i64 {
        self.manifest.outputs.last().map_or(-1, |o| o.layer as i64)
    }

    fn require_last(&self, mb: u64) -> Result<(), TrainError> {
        if self.is_last() {
            return Ok(());
        }
        Err(self.batch_err(
            mb,
            format!(
                "the loss is taken by the last stage (the one ending at layer {}); this one \
                 takes the gradients of its outputs",
                self.manifest.layers.len()
            ),
        ))
    }

    fn last_output(&self, mb: u64) -> Result<Tensor, TrainError> {
        self.require_last(mb)?;
        let last = self.last_ref();
        self.flight(mb)?
            .outputs
            .iter()
            .find(|(r, _)| *r == last)
            .map(|(_, t)| t.clone())
            .ok_or_else(|| self.batch_err(mb, "the last output is missing".into()))
    }

    fn loss_of(&self, mb: u64, out: &Tensor, target: &Target) -> Result<Tensor, TrainError> {
        self.loss
            .check(out, target)
            .map_err(|why| self.batch_err(mb, why))?;
        self.loss
            .loss(out, target)
            .map_err(|e| self.batch_err(mb, format!("{}: {e}", self.loss.name())))
    }

    /// Back-propagates from `root` through microbatch `mb`'s graph,
    /// accumulates the param gradients, frees the stash, and returns the
    /// gradients of the layer-output inputs.
    fn finish_backward(
        &mut self,
        mb: u64,
        root: &Tensor,
    ) -> Result<Vec<(i64, Tensor)>, TrainError> {
        let store = root
            .backward()
            .map_err(|e| self.batch_err(mb, format!("backward pass failed: {e}")))?;
        let flight = self.flight(mb)?;
        let mut sums = Vec::with_capacity(self.accum.len());
        for (k, w) in flight.weights.values.iter().enumerate() {
            let sum = match (store.get(w), &self.accum[k]) {
                (Some(g), Some(acc)) => Some(acc.add(&g.detach())),
                (Some(g), None) => Some(Ok(g.detach())),
                (None, acc) => acc.clone().map(Ok),
            };
            sums.push(
                sum.transpose()
                    .map_err(|e| self.batch_err(mb, e.to_string()))?,
            );
        }
        let mut input_grads = Vec::with_capacity(flight.inputs.len());
        for (r, v) in &flight.inputs {
            let g = match store.get(v) {
                Some(g) => g.detach(),
                None => v
                    .zeros_like()
                    .map_err(|e| self.batch_err(mb, e.to_string()))?,
            };
            input_grads.push((*r, g));
        }
        self.accum = sums;
        self.accumulated += 1;
        self.in_flight.remove(&mb);
        Ok(input_grads)
    }

    /// Checks `inputs` against the stage's input set and the shapes the
    /// graph gives them, and converts them to the stage's precision.
    fn take_inputs(
        &mut self,
        mb: u64,
        inputs: Vec<(i64, StageTensor)>,
    ) -> Result<HashMap<i64, Tensor>, TrainError> {
        let mut values = HashMap::with_capacity(inputs.len());
        for (r, t) in inputs {
            if !self.io.inputs.contains(&r) {
                return Err(self.batch_err(
                    mb,
                    format!(
                        "got {}, which is not an input of the stage (inputs: {:?})",
                        describe_ref(&self.manifest, r),
                        self.io.inputs
                    ),
                ));
            }
            let t = t.into_tensor().map_err(|e| {
                self.batch_err(mb, format!("{}: {e}", describe_ref(&self.manifest, r)))
            })?;
            if values.insert(r, t).is_some() {
                return Err(
                    self.batch_err(mb, format!("got {} twice", describe_ref(&self.manifest, r)))
                );
            }
        }
        if let Some(r) = self.io.inputs.iter().find(|r| !values.contains_key(r)) {
            return Err(self.batch_err(
                mb,
                format!(
                    "the boundary tensor {} is missing (the stage takes {:?})",
                    describe_ref(&self.manifest, *r),
                    self.io.inputs
                ),
            ));
        }
        let dims: HashMap<i64, Vec<usize>> = values
            .iter()
            .map(|(r, t)| (*r, t.dims().to_vec()))
            .collect();
        let at = self.shapes.request_dims(&dims);
        let expected = self
            .shapes
            .expected(&self.manifest, at)
            .map_err(|why| self.batch_err(mb, why))?;
        let dtype = self.precision.dtype();
        for r in self.io.inputs.clone() {
            let t = &values[&r];
            let want = &expected[&r];
            let dtype_ok = match want.dtype {
                Dtype::F32 => t.dtype().is_float(),
                Dtype::I64 => t.dtype() == DType::I64,
            };
            if !dtype_ok || t.dims() != want.dims.as_slice() {
                return Err(self.batch_err(
                    mb,
                    format!(
                        "the boundary tensor {} is {:?} {:?}, expected {} (batch {}{})",
                        describe_ref(&self.manifest, r),
                        t.dtype(),
                        t.dims(),
                        describe(want),
                        at.0,
                        at.1.map(|s| format!(", {s} tokens")).unwrap_or_default()
                    ),
                ));
            }
            if want.dtype == Dtype::F32 && t.dtype() != dtype {
                let converted = t
                    .to_dtype(dtype)
                    .map_err(|e| self.batch_err(mb, e.to_string()))?;
                values.insert(r, converted);
            }
        }
        Ok(values)
    }

    /// The stage's layers on `values` (its inputs) with `weights`.
    fn run_layers(
        &self,
        mb: u64,
        mut values: HashMap<i64, Tensor>,
        weights: &Arc<Weights>,
    ) -> Result<Ran, TrainError> {
        let mut running = Vec::new();
        for id in self.layers.clone() {
            let layer = &self.manifest.layers[id];
            let mut args = Vec::with_capacity(layer.inputs.len());
            for r in &layer.inputs {
                let t = values.get(r).ok_or_else(|| {
                    self.layer_err(mb, id, format!("its input {r} is not available"))
                })?;
                args.push(t.clone());
            }
            let local = id - self.layers.start;
            let mut params = Vec::with_capacity(self.layer_params[local].len());
            for &pos in &self.layer_params[local] {
                let name = self.manifest.params[self.params[pos]].name.as_str();
                let t = match self.slots[pos] {
                    Slot::Learnable(k) => weights.values[k].clone(),
                    Slot::Stat(k) => self.stats[k].clone(),
                };
                params.push((name, t));
            }
            let applied = layers::apply(&layer.op, &args, &params)
                .map_err(|e| self.layer_err(mb, id, e.to_string()))?;
            if let Some((mean, var)) = applied.running {
                for (pos, t) in self.layer_params[local][2..4].iter().zip([mean, var]) {
                    if let Slot::Stat(k) = self.slots[*pos] {
                        running.push((k, t));
                    }
                }
            }
            values.insert(id as i64, applied.out);
            for r in &layer.inputs {
                if self.last_use.get(r) == Some(&id) && !self.io.outputs.contains(r) {
                    values.remove(r);
                }
            }
        }
        let outputs =
            self.io
                .outputs
                .iter()
                .map(|r| {
                    values.remove(r).map(|t| (*r, t)).ok_or_else(|| {
                        self.layer_err(mb, *r as usize, "its output was dropped".into())
                    })
                })
                .collect::<Result<_, _>>()?;
        Ok(Ran { outputs, running })
    }
}

fn scalar(t: &Tensor) -> candle_core::Result<f64> {
    t.to_dtype(DType::F64)?.to_scalar::<f64>()
}
