//! Model families, scales and the hyper-parameters each architecture is built
//! from. Every number an architecture uses lives in its config, so smaller or
//! larger variants are a config away.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::families;
use crate::graph::{Architecture, GeluApprox};
use crate::ModelError;

/// The five model families of the evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    Resnet152,
    InceptionV3,
    Densenet201,
    BertBase,
    Gpt2,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Resnet152,
        Family::InceptionV3,
        Family::Densenet201,
        Family::BertBase,
        Family::Gpt2,
    ];

    /// The CLI and manifest spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Resnet152 => "resnet152",
            Family::InceptionV3 => "inception_v3",
            Family::Densenet201 => "densenet201",
            Family::BertBase => "bert_base",
            Family::Gpt2 => "gpt2",
        }
    }

    /// The config of this family at `scale`.
    pub fn config(self, scale: Scale) -> ModelConfig {
        let full = scale == Scale::Full;
        match self {
            Family::Resnet152 => ModelConfig::Resnet152(if full {
                ResnetConfig::full()
            } else {
                ResnetConfig::tiny()
            }),
            Family::InceptionV3 => ModelConfig::InceptionV3(if full {
                InceptionConfig::full()
            } else {
                InceptionConfig::tiny()
            }),
            Family::Densenet201 => ModelConfig::Densenet201(if full {
                DensenetConfig::full()
            } else {
                DensenetConfig::tiny()
            }),
            Family::BertBase => ModelConfig::BertBase(if full {
                BertConfig::full()
            } else {
                BertConfig::tiny()
            }),
            Family::Gpt2 => ModelConfig::Gpt2(if full {
                Gpt2Config::full()
            } else {
                Gpt2Config::tiny()
            }),
        }
    }

    /// Learnable parameters (BatchNorm running statistics excluded).
    pub fn learnable_params(self, scale: Scale) -> u64 {
        self.config(scale).build().learnable_param_count()
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Family {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Family::ALL
            .into_iter()
            .find(|f| f.as_str() == s)
            .ok_or_else(|| ModelError::UnknownFamily(s.to_string()))
    }
}

/// Full size (the evaluation's models) or tiny (same structure and names,
/// small enough for tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scale {
    Full,
    Tiny,
}

impl Scale {
    pub fn as_str(self) -> &'static str {
        match self {
            Scale::Full => "full",
            Scale::Tiny => "tiny",
        }
    }
}

impl fmt::Display for Scale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Scale {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "full" => Ok(Scale::Full),
            "tiny" => Ok(Scale::Tiny),
            _ => Err(ModelError::UnknownScale(s.to_string())),
        }
    }
}

/// A family's hyper-parameters, tagged with the family in JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "snake_case")]
pub enum ModelConfig {
    Resnet152(ResnetConfig),
    InceptionV3(InceptionConfig),
    Densenet201(DensenetConfig),
    BertBase(BertConfig),
    Gpt2(Gpt2Config),
}

impl ModelConfig {
    pub fn family(&self) -> Family {
        match self {
            ModelConfig::Resnet152(_) => Family::Resnet152,
            ModelConfig::InceptionV3(_) => Family::InceptionV3,
            ModelConfig::Densenet201(_) => Family::Densenet201,
            ModelConfig::BertBase(_) => Family::BertBase,
            ModelConfig::Gpt2(_) => Family::Gpt2,
        }
    }

    /// The batch size of the model's input.
    pub fn batch_size(&self) -> usize {
        match self {
            ModelConfig::Resnet152(c) => c.batch_size,
            ModelConfig::InceptionV3(c) => c.batch_size,
            ModelConfig::Densenet201(c) => c.batch_size,
            ModelConfig::BertBase(c) => c.batch_size,
            ModelConfig::Gpt2(c) => c.batch_size,
        }
    }

    /// The same config with another batch size.
    pub fn with_batch_size(mut self, batch: usize) -> Self {
        match &mut self {
            ModelConfig::Resnet152(c) => c.batch_size = batch,
            ModelConfig::InceptionV3(c) => c.batch_size = batch,
            ModelConfig::Densenet201(c) => c.batch_size = batch,
            ModelConfig::BertBase(c) => c.batch_size = batch,
            ModelConfig::Gpt2(c) => c.batch_size = batch,
        }
        self
    }

    /// The default sequence length of a transformer's token input; `None`
    /// for the CNNs.
    pub fn seq_len(&self) -> Option<usize> {
        match self {
            ModelConfig::BertBase(c) => Some(c.seq_len),
            ModelConfig::Gpt2(c) => Some(c.seq_len),
            _ => None,
        }
    }

    /// The same config with another default sequence length (CNNs have
    /// none and are returned unchanged).
    pub fn with_seq_len(mut self, len: usize) -> Self {
        match &mut self {
            ModelConfig::BertBase(c) => c.seq_len = len,
            ModelConfig::Gpt2(c) => c.seq_len = len,
            _ => {}
        }
        self
    }

    /// The preset this config equals, batch size and sequence length aside
    /// (requests choose both): `Full`, `Tiny`, or `None` for a config of its
    /// own (an imported smaller or larger variant).
    pub fn preset(&self) -> Option<Scale> {
        [Scale::Full, Scale::Tiny].into_iter().find(|&s| {
            let mut preset = self.family().config(s).with_batch_size(self.batch_size());
            if let Some(len) = self.seq_len() {
                preset = preset.with_seq_len(len);
            }
            preset == *self
        })
    }

    /// Builds the layer graph and parameter declarations.
    pub fn build(&self) -> Architecture {
        match self {
            ModelConfig::Resnet152(c) => families::resnet::build(c),
            ModelConfig::InceptionV3(c) => families::inception::build(c),
            ModelConfig::Densenet201(c) => families::densenet::build(c),
            ModelConfig::BertBase(c) => families::bert::build(c),
            ModelConfig::Gpt2(c) => families::gpt2::build(c),
        }
    }
}

/// torchvision ResNet with bottleneck blocks (v1.5: stride on the 3x3 conv).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResnetConfig {
    /// Bottleneck blocks per stage (`layer1..layerN`).
    pub blocks: Vec<usize>,
    /// Stem channels and the width of stage 1; stage i has width `base_width * 2^i`.
    pub base_width: usize,
    /// Bottleneck output channels = width * expansion.
    pub expansion: usize,
    pub num_classes: usize,
    pub in_channels: usize,
    pub image_size: usize,
    pub batch_size: usize,
    pub bn_eps: f64,
}

impl ResnetConfig {
    pub fn full() -> Self {
        ResnetConfig {
            blocks: vec![3, 8, 36, 3],
            base_width: 64,
            expansion: 4,
            num_classes: 1000,
            in_channels: 3,
            image_size: 224,
            batch_size: 8,
            bn_eps: 1e-5,
        }
    }
    pub fn tiny() -> Self {
        ResnetConfig {
            blocks: vec![1, 1, 1, 1],
            base_width: 8,
            image_size: 32,
            batch_size: 1,
            ..Self::full()
        }
    }
}

/// torchvision Inception-v3 without the AuxLogits branch
/// (`transform_input = False`). Every channel count of torchvision's
/// definition is divided by `width_divisor` (rounded up).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InceptionConfig {
    pub width_divisor: usize,
    pub num_classes: usize,
    pub in_channels: usize,
    pub image_size: usize,
    pub batch_size: usize,
    pub bn_eps: f64,
}

impl InceptionConfig {
    pub fn full() -> Self {
        InceptionConfig {
            width_divisor: 1,
            num_classes: 1000,
            in_channels: 3,
            image_size: 299,
            batch_size: 8,
            bn_eps: 1e-3,
        }
    }
    pub fn tiny() -> Self {
        InceptionConfig {
            width_divisor: 16,
            image_size: 75,
            batch_size: 1,
            ..Self::full()
        }
    }
}

/// torchvision DenseNet (BC: bottleneck layers and compression 0.5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DensenetConfig {
    pub growth_rate: usize,
    /// Dense layers per block.
    pub blocks: Vec<usize>,
    pub init_features: usize,
    /// Bottleneck width = bn_size * growth_rate.
    pub bn_size: usize,
    /// A transition maps c channels to c / transition_divisor.
    pub transition_divisor: usize,
    pub num_classes: usize,
    pub in_channels: usize,
    pub image_size: usize,
    pub batch_size: usize,
    pub bn_eps: f64,
}

impl DensenetConfig {
    pub fn full() -> Self {
        DensenetConfig {
            growth_rate: 32,
            blocks: vec![6, 12, 48, 32],
            init_features: 64,
            bn_size: 4,
            transition_divisor: 2,
            num_classes: 1000,
            in_channels: 3,
            image_size: 224,
            batch_size: 8,
            bn_eps: 1e-5,
        }
    }
    pub fn tiny() -> Self {
        DensenetConfig {
            growth_rate: 4,
            blocks: vec![1, 2, 2, 1],
            init_features: 8,
            image_size: 32,
            batch_size: 1,
            ..Self::full()
        }
    }
}

/// Hugging Face `BertModel` (encoder + pooler, no heads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub max_positions: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    pub activation: GeluApprox,
    /// The default batch size (of the manifest's input shape).
    pub batch_size: usize,
    /// The default sequence length: the manifest's input shape and the
    /// length GPU profiles time. Requests choose any length from 1 to
    /// `max_positions`.
    pub seq_len: usize,
}

impl BertConfig {
    pub fn full() -> Self {
        BertConfig {
            vocab_size: 30522,
            hidden: 768,
            layers: 12,
            heads: 12,
            intermediate: 3072,
            max_positions: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            activation: GeluApprox::Erf,
            batch_size: 8,
            seq_len: 512,
        }
    }
    pub fn tiny() -> Self {
        BertConfig {
            vocab_size: 100,
            hidden: 32,
            layers: 2,
            heads: 2,
            intermediate: 64,
            max_positions: 64,
            batch_size: 1,
            seq_len: 16,
            ..Self::full()
        }
    }
}

/// Hugging Face `GPT2Model` (no LM head), causal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpt2Config {
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub max_positions: usize,
    pub layer_norm_eps: f64,
    pub activation: GeluApprox,
    /// The default batch size (of the manifest's input shape).
    pub batch_size: usize,
    /// The default sequence length: the manifest's input shape and the
    /// length GPU profiles time. Requests choose any length from 1 to
    /// `max_positions`.
    pub seq_len: usize,
}

impl Gpt2Config {
    pub fn full() -> Self {
        Gpt2Config {
            vocab_size: 50257,
            hidden: 768,
            layers: 12,
            heads: 12,
            intermediate: 3072,
            max_positions: 1024,
            layer_norm_eps: 1e-5,
            activation: GeluApprox::Tanh,
            batch_size: 8,
            seq_len: 512,
        }
    }
    pub fn tiny() -> Self {
        Gpt2Config {
            vocab_size: 100,
            hidden: 32,
            layers: 2,
            heads: 2,
            intermediate: 64,
            max_positions: 64,
            batch_size: 1,
            seq_len: 16,
            ..Self::full()
        }
    }
}
