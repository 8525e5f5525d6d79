//! The whole model as one stage: one SGD step on the packed bytes (what a
//! device's background training job and `distmind train` run), and the
//! loss and gradients for checks.
//!
//! The `*_of` functions take a [`TrainBatch`] (inputs and a [`Target`], any
//! family); [`sgd_step`], [`sgd_step_with_state`], [`loss_and_gradients`]
//! and [`training_loss`] take images and labels, the CNN families'
//! classification step, and refuse a model whose loss is not
//! cross-entropy.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use distmind_models::Manifest;

use super::layers;
use super::loss::{LossKind, Target};
use super::packed::write_f32;
use super::sgd::{SgdConfig, SgdState};
use super::stage::{StageModel, StageTensor};
use super::{Precision, TrainError};
use crate::exec::HostTensor;

/// One training batch: the model's inputs (in manifest order) and what the
/// loss compares the last output with.
#[derive(Debug, Clone)]
pub struct TrainBatch {
    pub inputs: Vec<HostTensor>,
    pub target: Target,
}

/// What one step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The loss over the batch (mean), before the update.
    pub loss: f32,
    pub batch: usize,
    /// Wall time of the whole step.
    pub elapsed: Duration,
    /// Building the graph and the forward pass (params read from `packed`).
    pub forward: Duration,
    pub backward: Duration,
    /// SGD update and writing back params and running statistics.
    pub update: Duration,
    /// Learnable params written back.
    pub params_updated: usize,
    /// BatchNorm running statistics written back (2 per BatchNorm layer).
    pub stats_updated: usize,
}

/// Loss, gradients and new running statistics of one forward/backward.
#[derive(Debug, Clone)]
pub struct Gradients {
    pub loss: f64,
    /// d loss / d param, per learnable param name (row-major, the param's shape).
    pub grads: HashMap<String, Vec<f64>>,
    /// Updated running statistics (`running_mean`, `running_var`), by name.
    pub running: HashMap<String, Vec<f64>>,
}

/// One SGD step in place on `packed` (the whole model in the packed layout),
/// from empty momentum buffers: cross-entropy of the logits against `labels`.
pub fn sgd_step(
    manifest: &Manifest,
    packed: &mut [u8],
    images: &HostTensor,
    labels: &[i64],
    cfg: &SgdConfig,
) -> Result<StepReport, TrainError> {
    sgd_step_with_state(manifest, packed, images, labels, cfg, &mut SgdState::new())
}

/// [`sgd_step`] carrying momentum buffers in `state` across steps.
pub fn sgd_step_with_state(
    manifest: &Manifest,
    packed: &mut [u8],
    images: &HostTensor,
    labels: &[i64],
    cfg: &SgdConfig,
    state: &mut SgdState,
) -> Result<StepReport, TrainError> {
    let batch = classification(manifest, images, labels)?;
    sgd_step_of(manifest, packed, &batch, cfg, state)
}

/// The training-mode loss and the gradient of every learnable param, without
/// changing `packed` (cross-entropy against `labels`).
pub fn loss_and_gradients(
    manifest: &Manifest,
    packed: &[u8],
    images: &HostTensor,
    labels: &[i64],
    precision: Precision,
) -> Result<Gradients, TrainError> {
    let batch = classification(manifest, images, labels)?;
    loss_and_gradients_of(manifest, packed, &batch, precision)
}

/// The training-mode loss (batch statistics in BatchNorm) only.
pub fn training_loss(
    manifest: &Manifest,
    packed: &[u8],
    images: &HostTensor,
    labels: &[i64],
    precision: Precision,
) -> Result<f64, TrainError> {
    let batch = classification(manifest, images, labels)?;
    training_loss_of(manifest, packed, &batch, precision)
}

/// One SGD step of any family in place on `packed` (f32 storage), momentum
/// buffers in `state`.
pub fn sgd_step_of(
    manifest: &Manifest,
    packed: &mut [u8],
    batch: &TrainBatch,
    cfg: &SgdConfig,
    state: &mut SgdState,
) -> Result<StepReport, TrainError> {
    let start = Instant::now();
    check_trainable(manifest)?;
    let mut stage = whole(manifest, packed, Precision::F32)?;
    stage
        .load_sgd_state(state)
        .map_err(TrainError::for_whole_model)?;
    stage
        .forward(0, inputs_of(batch))
        .map_err(TrainError::for_whole_model)?;
    let forward = start.elapsed();
    let t = Instant::now();
    let loss = stage
        .backward_from_loss(0, &batch.target)
        .map_err(TrainError::for_whole_model)?
        .loss;
    let backward = t.elapsed();
    let t = Instant::now();
    let report = stage.step(cfg).map_err(TrainError::for_whole_model)?;
    let values = stage.param_values().map_err(TrainError::for_whole_model)?;
    let new_state = stage.sgd_state().map_err(TrainError::for_whole_model)?;
    // Every check passed: now write.
    let mut stats_updated = 0;
    for (pi, v) in values {
        let p = &manifest.params[pi];
        let g = &manifest.groups[p.group];
        let at = (g.offset + p.offset) as usize;
        let dst =
            packed
                .get_mut(at..at + p.nbytes as usize)
                .ok_or_else(|| TrainError::PackedSize {
                    model: manifest.name.clone(),
                    got: at,
                    want: manifest.stored_bytes,
                })?;
        write_f32(dst, &v).map_err(|why| TrainError::Model {
            model: manifest.name.clone(),
            why: format!("param {}: {why}", p.name),
        })?;
        stats_updated += usize::from(!p.learnable);
    }
    state.merge(new_state);
    Ok(StepReport {
        loss: loss as f32,
        batch: batch
            .inputs
            .first()
            .and_then(|t| t.shape.first())
            .copied()
            .unwrap_or(0),
        elapsed: start.elapsed(),
        forward,
        backward,
        update: t.elapsed(),
        params_updated: report.params_updated,
        stats_updated,
    })
}

/// The training-mode loss and every learnable param's gradient, without
/// changing `packed` (any storage dtype).
pub fn loss_and_gradients_of(
    manifest: &Manifest,
    packed: &[u8],
    batch: &TrainBatch,
    precision: Precision,
) -> Result<Gradients, TrainError> {
    let mut stage = whole(manifest, packed, precision)?;
    stage
        .forward(0, inputs_of(batch))
        .map_err(TrainError::for_whole_model)?;
    let loss = stage
        .backward_from_loss(0, &batch.target)
        .map_err(TrainError::for_whole_model)?
        .loss;
    let grads = stage
        .gradients()
        .map_err(TrainError::for_whole_model)?
        .into_iter()
        .collect();
    let running = stage
        .running_stats()
        .map_err(TrainError::for_whole_model)?
        .into_iter()
        .collect();
    Ok(Gradients {
        loss,
        grads,
        running,
    })
}

/// The training-mode loss only (any storage dtype).
pub fn training_loss_of(
    manifest: &Manifest,
    packed: &[u8],
    batch: &TrainBatch,
    precision: Precision,
) -> Result<f64, TrainError> {
    let mut stage = whole(manifest, packed, precision)?;
    stage
        .training_loss(0, inputs_of(batch), &batch.target)
        .map_err(TrainError::for_whole_model)
}

/// The groups whose bytes differ between `before` and `after` (both the
/// whole model in the packed layout): the ones to write back.
pub fn changed_groups(before: &[u8], after: &[u8], manifest: &Manifest) -> Vec<usize> {
    manifest
        .groups
        .iter()
        .filter(|g| {
            let r = g.offset as usize..(g.offset + g.bytes) as usize;
            before.get(r.clone()) != after.get(r)
        })
        .map(|g| g.index)
        .collect()
}

/// Checks that a whole-model step can update `manifest` in its packed
/// bytes: every layer's op trains, and the params are stored as f32 (a
/// step writes f32 back; a package that stores half precision is refused,
/// since training would write the weights back in a dtype the optimizer
/// does not keep). A [`StageModel`] trains half-precision packages too
/// (widened to f32).
pub fn check_trainable(manifest: &Manifest) -> Result<(), TrainError> {
    if manifest.param_dtype.is_half() {
        return Err(TrainError::Model {
            model: manifest.name.clone(),
            why: format!(
                "its parameters are stored as {}; training updates f32 parameters (import \
                 the checkpoint with --widen, or generate it with --dtype f32)",
                manifest.param_dtype
            ),
        });
    }
    for layer in &manifest.layers {
        if !layers::trainable(&layer.op) {
            return Err(TrainError::Layer {
                model: manifest.name.clone(),
                layer: layer.id,
                name: layer.name.clone(),
                op: layer.op.name().into(),
                why: "op not supported in training".into(),
            });
        }
    }
    Ok(())
}

/// A classification batch, refused for a model whose loss is not
/// cross-entropy (the labels would mean nothing to it).
fn classification(
    manifest: &Manifest,
    images: &HostTensor,
    labels: &[i64],
) -> Result<TrainBatch, TrainError> {
    match LossKind::for_manifest(manifest)? {
        LossKind::CrossEntropy { .. } => Ok(TrainBatch {
            inputs: vec![images.clone()],
            target: Target::Labels(labels.to_vec()),
        }),
        kind => Err(TrainError::BadBatch {
            model: manifest.name.clone(),
            why: format!(
                "{} ({}) trains with {} against a target tensor, not labels: pass a \
                 TrainBatch with Target::Values (e.g. LossKind::synthetic_target)",
                manifest.name,
                manifest.family.as_str(),
                kind.name()
            ),
        }),
    }
}

fn whole(
    manifest: &Manifest,
    packed: &[u8],
    precision: Precision,
) -> Result<StageModel, TrainError> {
    StageModel::new(manifest, 0..manifest.layers.len(), packed, precision)
        .map_err(TrainError::for_whole_model)
}

/// The batch's inputs as the first stage takes them (`-1` is input 0).
fn inputs_of(batch: &TrainBatch) -> Vec<(i64, StageTensor)> {
    batch
        .inputs
        .iter()
        .enumerate()
        .map(|(i, t)| (-(i as i64) - 1, StageTensor::Host(t.clone())))
        .collect()
}
