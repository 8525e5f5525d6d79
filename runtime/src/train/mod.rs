//! Training on the CPU (candle's autograd): a whole model's SGD step on
//! the packed bytes, and [`StageModel`], a contiguous range of a model's
//! layers that runs forward and backward per microbatch for pipelined
//! data-parallel training (PipeDream's 1F1B with weight stashing).
//!
//! The original's `resnet152_train` runs one SGD step per training request;
//! [`sgd_step`] is that step on the host: it builds the manifest's layer
//! graph with candle's differentiable ops in TRAINING mode, takes the loss,
//! back-propagates, and writes the updated learnable params and the
//! BatchNorm running statistics back into the packed bytes (little-endian
//! f32 at `groups[p.group].offset + p.offset`), so the result can go back to
//! the host cache, or to the memory servers group by group
//! ([`changed_groups`] names the groups to write back).
//!
//! Training-mode semantics are PyTorch's `model.train()`:
//! * `batch_norm` normalises with the batch statistics (mean and BIASED
//!   variance over N, H, W per channel) and updates
//!   `running = (1 - 0.1) running + 0.1 batch` with the UNBIASED batch
//!   variance; fewer than 2 values per channel is an error, as in PyTorch.
//! * No dropout in these graphs (the packages hold eval-mode graphs; BERT's
//!   and GPT-2's dropouts are left out, as `OPS.md` says).
//! * SGD as `torch.optim.SGD` (no dampening, no Nesterov):
//!   `g = grad + wd p`; with momentum `buf = m buf + g` (`buf = g` on the
//!   first step) and `g = buf`; `p -= lr g`. Weight decay applies to every
//!   learnable param, BatchNorm's gamma and beta, LayerNorm's and the
//!   embedding tables included (PyTorch's default).
//!
//! Every op of `models/OPS.md` trains, with the cpu executor's inference
//! semantics: `conv2d`, `batch_norm`, `relu`, `tanh`, `max_pool2d` and
//! `avg_pool2d` (exact -inf / zero padding, `count_include_pad`,
//! `ceil_mode`, with their own backward, `pool`), `adaptive_avg_pool2d`,
//! `add`, `concat`, `flatten`, `linear` (`layers`); `embedding` (the
//! gradient goes to the table, never to the ids), `layer_norm`, `gelu` (erf
//! and tanh, exact derivatives), `attention` (causal or not, three inputs
//! or fused qkv) and `select` (`transformer`).
//!
//! The loss ([`LossKind`], chosen from the manifest's family):
//! * CNNs: softmax cross-entropy of the logits (the last output,
//!   `[N, classes]`) against integer labels, mean over the batch.
//! * BERT and GPT-2: the packages hold no LM head and there is no dataset,
//!   so training is a SYNTHETIC REGRESSION task: the mean squared error
//!   (mean over every element, `torch.nn.MSELoss()`) of the model's LAST
//!   output (BERT `pooler_output` `[N, H]`, GPT-2 `last_hidden_state`
//!   `[N, L, H]`) against a target tensor of the same shape, drawn from a
//!   seed ([`LossKind::synthetic_target`]).
//!
//! Steps run in f32 ([`Precision::F32`]); every function can run the same
//! graph in f64 for gradient checks.
//!
//! Module map: [`boundary`](mod@boundary) (which tensors cross a cut of the layer list),
//! [`stage`] ([`StageModel`]), [`loss`], [`packed`] (params in the packed
//! layout), [`whole`] (the whole-model API the server and `distmind train`
//! call), [`sgd`] (the update rule).

pub mod boundary;
mod error;
mod layers;
pub mod loss;
pub mod packed;
mod pool;
pub mod sgd;
pub mod stage;
mod transformer;
pub mod whole;

#[cfg(test)]
mod tests;

use candle_core::DType;

pub use boundary::{boundary, live_tensors, stage_io, StageIo};
pub use error::TrainError;
pub use loss::{LossKind, Target};
pub use packed::PackedLayers;
pub use sgd::{SgdConfig, SgdState};
pub use stage::{
    tensor_to_host, LossBackward, StageModel, StageStepReport, StageTensor,
    STAGE_MICROBATCHES_IN_FLIGHT_MAX,
};
pub use whole::{
    changed_groups, check_trainable, loss_and_gradients, loss_and_gradients_of, sgd_step,
    sgd_step_of, sgd_step_with_state, training_loss, training_loss_of, Gradients, StepReport,
    TrainBatch,
};

/// BatchNorm's running-statistics momentum (PyTorch's default).
pub const BN_MOMENTUM: f64 = 0.1;

/// Arithmetic of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    F64,
}

impl Precision {
    fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F64 => DType::F64,
        }
    }
}
