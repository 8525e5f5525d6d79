//! What can go wrong in training, naming the model and, for a stage, its
//! layer range, the microbatch and the layer.

use std::ops::Range;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    #[error("model {model} layer {layer} ({name}, {op}): {why}")]
    Layer {
        model: String,
        layer: usize,
        name: String,
        op: String,
        why: String,
    },
    #[error("model {model}: {why}")]
    Model { model: String, why: String },
    #[error("model {model}: bad training batch: {why}")]
    BadBatch { model: String, why: String },
    #[error("model {model}: packed buffer of {got} bytes, the model stores {want}")]
    PackedSize {
        model: String,
        got: usize,
        want: u64,
    },
    #[error("model {model}: backward pass failed: {why}")]
    Backward { model: String, why: String },
    /// A layer of a stage failed in a microbatch's forward or backward.
    #[error(
        "model {model} stage [{}, {}) microbatch {mb}: layer {layer} ({name}, {op}): {why}",
        stage.start, stage.end
    )]
    StageLayer {
        model: String,
        stage: Range<usize>,
        mb: u64,
        layer: usize,
        name: String,
        op: &'static str,
        why: String,
    },
    /// What a microbatch brought does not fit the stage: a missing or
    /// extra boundary tensor, a shape, a gradient, a target.
    #[error("model {model} stage [{}, {}) microbatch {mb}: {why}", stage.start, stage.end)]
    StageBatch {
        model: String,
        stage: Range<usize>,
        mb: u64,
        why: String,
    },
    /// More forwards without their backward than the stage keeps.
    #[error(
        "model {model} stage [{}, {}) microbatch {mb}: {in_flight} microbatches are in flight \
         (forward done, backward not yet), the limit is {limit}: run a backward first",
        stage.start, stage.end
    )]
    InFlightFull {
        model: String,
        stage: Range<usize>,
        mb: u64,
        in_flight: usize,
        limit: usize,
    },
    /// The stage itself: its range, its params, a step, packed bytes.
    #[error("model {model} stage [{}, {}): {why}", stage.start, stage.end)]
    Stage {
        model: String,
        stage: Range<usize>,
        why: String,
    },
}

impl TrainError {
    /// The error as the whole-model API reports it (a whole model is a
    /// stage of every layer): a stage's layer error becomes a
    /// [`TrainError::Layer`], a bad microbatch a [`TrainError::BadBatch`].
    pub(crate) fn for_whole_model(self) -> TrainError {
        match self {
            TrainError::StageLayer {
                model,
                layer,
                name,
                op,
                why,
                ..
            } => TrainError::Layer {
                model,
                layer,
                name,
                op: op.into(),
                why,
            },
            TrainError::StageBatch { model, why, .. } => TrainError::BadBatch { model, why },
            TrainError::Stage { model, why, .. } => TrainError::Model { model, why },
            other => other,
        }
    }
}
