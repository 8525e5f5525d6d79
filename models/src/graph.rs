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

/// Shape and type of a model input, and which of its dimensions each
/// request chooses.
///
/// `shape` is the default shape (the batch size and sequence length the
/// package was generated or imported at, which GPU profiles are taken at);
/// a request may differ from it in the dimensions `variable` names, within
/// their bounds, and must equal it in every other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    /// The dimensions a request chooses, in dimension order. Absent from
    /// manifests written before requests could choose more than the batch:
    /// then dimension 0 (the batch) only.
    #[serde(default = "batch_only")]
    pub variable: Vec<VariableDim>,
}

/// What a [`VariableDim`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DimKind {
    /// Inputs in one request (dimension 0 of every input).
    Batch,
    /// Tokens per sequence, bounded by the model's position table.
    Sequence,
}

impl DimKind {
    /// The dimension's name in messages: `batch` or `tokens`.
    pub fn as_str(self) -> &'static str {
        match self {
            DimKind::Batch => "batch",
            DimKind::Sequence => "tokens",
        }
    }
}

/// One input dimension a request chooses: any size from 1 to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VariableDim {
    /// Index into the input's shape.
    pub dim: usize,
    pub kind: DimKind,
    /// Largest size the model accepts (a sequence: its position table's
    /// rows); `None`: no bound of the model's own (a batch, bounded only by
    /// what a server accepts in one request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<usize>,
}

/// The variable dimensions of an input written before manifests stated
/// them: the batch, as every executor always accepted.
pub fn batch_only() -> Vec<VariableDim> {
    vec![VariableDim {
        dim: 0,
        kind: DimKind::Batch,
        max: None,
    }]
}

impl TensorSpec {
    /// A spec whose requests choose only the batch (dimension 0).
    pub fn batched(name: impl Into<String>, shape: Vec<usize>, dtype: Dtype) -> Self {
        TensorSpec {
            name: name.into(),
            shape,
            dtype,
            variable: batch_only(),
        }
    }

    /// The variable dimension `dim`, if requests choose it.
    pub fn variable_dim(&self, dim: usize) -> Option<&VariableDim> {
        self.variable.iter().find(|v| v.dim == dim)
    }

    /// The shape as the Open Inference Protocol (KServe v2 / Triton) reports
    /// it in model metadata: `-1` for every dimension a request chooses, the
    /// size for every other.
    pub fn protocol_shape(&self) -> Vec<i64> {
        self.shape
            .iter()
            .enumerate()
            .map(|(d, &n)| match self.variable_dim(d) {
                Some(_) => -1,
                None => n as i64,
            })
            .collect()
    }

    /// The element type's name in messages: `f32` or `i64`.
    pub fn dtype_name(&self) -> &'static str {
        match self.dtype {
            Dtype::F32 => "f32",
            Dtype::I64 => "i64",
        }
    }

    /// What a request must send, for messages: `i64 [batch, tokens]
    /// (batch >= 1, tokens 1..=128)`, `f32 [batch, 3, 224, 224] (batch >= 1)`.
    pub fn expected(&self) -> String {
        let dims: Vec<String> = self
            .shape
            .iter()
            .enumerate()
            .map(|(d, n)| match self.variable_dim(d) {
                Some(v) => v.kind.as_str().to_string(),
                None => n.to_string(),
            })
            .collect();
        let bounds: Vec<String> = self
            .variable
            .iter()
            .map(|v| match v.max {
                Some(max) => format!("{} 1..={max}", v.kind.as_str()),
                None => format!("{} >= 1", v.kind.as_str()),
            })
            .collect();
        if bounds.is_empty() {
            format!("{} [{}]", self.dtype_name(), dims.join(", "))
        } else {
            format!(
                "{} [{}] ({})",
                self.dtype_name(),
                dims.join(", "),
                bounds.join(", ")
            )
        }
    }

    /// Whether a request's shape fits: the same rank, every variable
    /// dimension within 1..=its bound, every other equal to `shape`'s. The
    /// error says which dimension is wrong (the caller names the model and
    /// adds [`TensorSpec::expected`]).
    pub fn check_shape(&self, shape: &[usize]) -> Result<(), String> {
        if shape.len() != self.shape.len() {
            return Err(format!(
                "{} dimensions instead of {}",
                shape.len(),
                self.shape.len()
            ));
        }
        for (d, (&got, &want)) in shape.iter().zip(&self.shape).enumerate() {
            match self.variable_dim(d) {
                Some(v) => {
                    if got == 0 {
                        return Err(format!("dimension {d} ({}) is 0", v.kind.as_str()));
                    }
                    if let Some(max) = v.max.filter(|&m| got > m) {
                        return Err(format!(
                            "dimension {d} ({}) is {got}, more than the model's {max}",
                            v.kind.as_str()
                        ));
                    }
                }
                None if got != want => {
                    return Err(format!("dimension {d} is {got}, the model's is {want}"));
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Checks the declaration itself: variable dimensions inside the rank,
    /// in order, each at most once, bounds >= 1 and the default shape
    /// within them.
    pub fn validate(&self) -> Result<(), String> {
        let mut last: Option<usize> = None;
        for v in &self.variable {
            if v.dim >= self.shape.len() {
                return Err(format!(
                    "input {}: variable dimension {} outside its {} dimensions",
                    self.name,
                    v.dim,
                    self.shape.len()
                ));
            }
            if last.is_some_and(|l| l >= v.dim) {
                return Err(format!(
                    "input {}: variable dimensions out of order or repeated at {}",
                    self.name, v.dim
                ));
            }
            last = Some(v.dim);
        }
        self.check_shape(&self.shape).map_err(|why| {
            format!(
                "input {}: the default shape {:?}: {why}",
                self.name, self.shape
            )
        })
    }
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
