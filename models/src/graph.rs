//! The layer graph: a model is a list of layers run in order, each reading
//! the outputs of earlier layers (or the model inputs) and its own params.
//! `OPS.md` gives the exact semantics of every [`Op`].

use serde::{Deserialize, Serialize};

/// Element type of a tensor as executors compute it. Parameters are `F32`
/// (however a package stores them: see [`crate::ParamDtype`]); token ids are `I64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dtype {
    F32,
    I64,
}

impl Dtype {
    pub fn size_bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::I64 => 8,
        }
    }
}

/// Shape and type of a model input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
}

/// A model output: the output of layer `layer`, with its shape and type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputSpec {
    pub name: String,
    pub layer: usize,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
}

/// What rows an `embedding` layer looks up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmbeddingIds {
    /// The ids of the layer's input tensor.
    Input,
    /// Row `j` for position `j` of the input's last dimension (0..L-1).
    Positions,
    /// Row 0 for every token (BERT's all-zero token type ids).
    Zeros,
}

/// Which approximation `gelu` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GeluApprox {
    /// `0.5 x (1 + erf(x / sqrt 2))` (BERT's `gelu`).
    Erf,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (GPT-2's `gelu_new`).
    Tanh,
}

/// One operation with its attributes. Serialised as `"op": "<name>"` plus
/// `"attrs": {...}` (absent for ops without attributes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "attrs", rename_all = "snake_case")]
pub enum Op {
    Conv2d {
        in_channels: usize,
        out_channels: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        bias: bool,
    },
    BatchNorm {
        num_features: usize,
        eps: f64,
    },
    Relu,
    MaxPool2d {
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        ceil_mode: bool,
    },
    AvgPool2d {
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        ceil_mode: bool,
        count_include_pad: bool,
    },
    AdaptiveAvgPool2d {
        output_size: [usize; 2],
    },
    Add,
    Concat {
        dim: usize,
    },
    Flatten {
        start_dim: usize,
    },
    Linear {
        in_features: usize,
        out_features: usize,
        bias: bool,
        /// Weight stored `[in, out]` (GPT-2 `Conv1D`) instead of `[out, in]`.
        transposed: bool,
    },
    Embedding {
        num_embeddings: usize,
        embedding_dim: usize,
        ids: EmbeddingIds,
    },
    LayerNorm {
        normalized_size: usize,
        eps: f64,
    },
    Gelu {
        approximate: GeluApprox,
    },
    Tanh,
    Attention {
        hidden: usize,
        heads: usize,
        causal: bool,
    },
    Select {
        dim: usize,
        index: usize,
    },
}

impl Op {
    /// The op's name as written in manifests.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Conv2d { .. } => "conv2d",
            Op::BatchNorm { .. } => "batch_norm",
            Op::Relu => "relu",
            Op::MaxPool2d { .. } => "max_pool2d",
            Op::AvgPool2d { .. } => "avg_pool2d",
            Op::AdaptiveAvgPool2d { .. } => "adaptive_avg_pool2d",
            Op::Add => "add",
            Op::Concat { .. } => "concat",
            Op::Flatten { .. } => "flatten",
            Op::Linear { .. } => "linear",
            Op::Embedding { .. } => "embedding",
            Op::LayerNorm { .. } => "layer_norm",
            Op::Gelu { .. } => "gelu",
            Op::Tanh => "tanh",
            Op::Attention { .. } => "attention",
            Op::Select { .. } => "select",
        }
    }
}

/// One layer of the graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    pub id: usize,
    pub name: String,
    #[serde(flatten)]
    pub op: Op,
    /// Ids of earlier layers; `-1` is model input 0, `-2` model input 1, ...
    pub inputs: Vec<i64>,
    /// Parameter names, in the order `OPS.md` gives for the op.
    pub params: Vec<String>,
    /// The group holding all of this layer's params (`None` without params).
    /// Groups are cut at layer boundaries, so a layer never spans groups.
    #[serde(default)]
    pub group: Option<usize>,
}

/// How a parameter's seeded random values are drawn (see `generate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// U(-b, b), b = 1/sqrt(fan_in): conv and linear weights and biases.
    FanIn(usize),
    /// U(lo, hi).
    Uniform(f32, f32),
    /// 1 + U(-0.1, 0.1): LayerNorm weights.
    AroundOne,
}

/// A parameter as an architecture declares it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamDecl {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// False for BatchNorm running statistics (stored, not learned).
    pub learnable: bool,
}

impl ParamDecl {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A model's graph and parameter declarations, as built from a config.
#[derive(Debug, Clone)]
pub struct Architecture {
    pub layers: Vec<Layer>,
    /// Every parameter, in layer order.
    pub params: Vec<ParamDecl>,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<OutputSpec>,
}

impl Architecture {
    pub fn learnable_param_count(&self) -> u64 {
        self.params
            .iter()
            .filter(|p| p.learnable)
            .map(|p| p.numel() as u64)
            .sum()
    }
}

/// Model input 0 as a layer reference.
pub const INPUT0: i64 = -1;

/// Appends layers and their params; the builders of every family use it.
#[derive(Default)]
pub(crate) struct Builder {
    layers: Vec<Layer>,
    params: Vec<ParamDecl>,
}

impl Builder {
    /// Appends a layer and returns its id as an input reference.
    pub fn push(&mut self, name: &str, op: Op, inputs: Vec<i64>, params: Vec<ParamDecl>) -> i64 {
        let id = self.layers.len();
        self.layers.push(Layer {
            id,
            name: name.to_string(),
            op,
            inputs,
            params: params.iter().map(|p| p.name.clone()).collect(),
            group: None,
        });
        self.params.extend(params);
        id as i64
    }

    pub fn finish(self, inputs: Vec<TensorSpec>, outputs: Vec<OutputSpec>) -> Architecture {
        Architecture {
            layers: self.layers,
            params: self.params,
            inputs,
            outputs,
        }
    }

    pub fn last_id(&self) -> usize {
        self.layers.len() - 1
    }

    #[allow(clippy::too_many_arguments)]
    pub fn conv(
        &mut self,
        module: &str,
        input: i64,
        in_channels: usize,
        out_channels: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        bias: bool,
    ) -> i64 {
        let fan_in = in_channels * kernel[0] * kernel[1];
        let mut params = vec![learnable(
            format!("{module}.weight"),
            vec![out_channels, in_channels, kernel[0], kernel[1]],
            Init::FanIn(fan_in),
        )];
        if bias {
            params.push(learnable(
                format!("{module}.bias"),
                vec![out_channels],
                Init::FanIn(fan_in),
            ));
        }
        let op = Op::Conv2d {
            in_channels,
            out_channels,
            kernel,
            stride,
            padding,
            bias,
        };
        self.push(module, op, vec![input], params)
    }

    pub fn batch_norm(&mut self, module: &str, input: i64, channels: usize, eps: f64) -> i64 {
        let shape = vec![channels];
        let params = vec![
            learnable(
                format!("{module}.weight"),
                shape.clone(),
                Init::Uniform(0.8, 1.2),
            ),
            learnable(
                format!("{module}.bias"),
                shape.clone(),
                Init::Uniform(-0.1, 0.1),
            ),
            stat(
                format!("{module}.running_mean"),
                shape.clone(),
                Init::Uniform(-0.1, 0.1),
            ),
            stat(
                format!("{module}.running_var"),
                shape,
                Init::Uniform(0.5, 1.5),
            ),
        ];
        let op = Op::BatchNorm {
            num_features: channels,
            eps,
        };
        self.push(module, op, vec![input], params)
    }

    pub fn unary(&mut self, name: &str, op: Op, input: i64) -> i64 {
        self.push(name, op, vec![input], Vec::new())
    }

    pub fn relu(&mut self, name: &str, input: i64) -> i64 {
        self.unary(name, Op::Relu, input)
    }

    pub fn add(&mut self, name: &str, a: i64, b: i64) -> i64 {
        self.push(name, Op::Add, vec![a, b], Vec::new())
    }

    pub fn concat(&mut self, name: &str, inputs: Vec<i64>) -> i64 {
        self.push(name, Op::Concat { dim: 1 }, inputs, Vec::new())
    }

    pub fn linear(
        &mut self,
        module: &str,
        input: i64,
        in_features: usize,
        out_features: usize,
        transposed: bool,
    ) -> i64 {
        let shape = if transposed {
            vec![in_features, out_features]
        } else {
            vec![out_features, in_features]
        };
        let params = vec![
            learnable(format!("{module}.weight"), shape, Init::FanIn(in_features)),
            learnable(
                format!("{module}.bias"),
                vec![out_features],
                Init::FanIn(in_features),
            ),
        ];
        let op = Op::Linear {
            in_features,
            out_features,
            bias: true,
            transposed,
        };
        self.push(module, op, vec![input], params)
    }

    pub fn layer_norm(&mut self, module: &str, input: i64, size: usize, eps: f64) -> i64 {
        let params = vec![
            learnable(format!("{module}.weight"), vec![size], Init::AroundOne),
            learnable(
                format!("{module}.bias"),
                vec![size],
                Init::Uniform(-0.1, 0.1),
            ),
        ];
        let op = Op::LayerNorm {
            normalized_size: size,
            eps,
        };
        self.push(module, op, vec![input], params)
    }

    pub fn embedding(
        &mut self,
        module: &str,
        input: i64,
        num_embeddings: usize,
        embedding_dim: usize,
        ids: EmbeddingIds,
    ) -> i64 {
        let params = vec![learnable(
            format!("{module}.weight"),
            vec![num_embeddings, embedding_dim],
            Init::Uniform(-0.05, 0.05),
        )];
        let op = Op::Embedding {
            num_embeddings,
            embedding_dim,
            ids,
        };
        self.push(module, op, vec![input], params)
    }
}

fn learnable(name: String, shape: Vec<usize>, init: Init) -> ParamDecl {
    ParamDecl {
        name,
        shape,
        init,
        learnable: true,
    }
}

fn stat(name: String, shape: Vec<usize>, init: Init) -> ParamDecl {
    ParamDecl {
        name,
        shape,
        init,
        learnable: false,
    }
}
