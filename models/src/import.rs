//! `distmind model import`: a package from a checkpoint a framework saved.
//!
//! The checkpoint is a safetensors file with the framework's own parameter
//! names: torchvision `state_dict` names for the CNNs, Hugging Face
//! `BertModel` / `GPT2Model` names for the transformers (the families build
//! their graphs with exactly those names, so generated and imported packages
//! are interchangeable).
//!
//! The hyper-parameters come from a config, never from constants:
//! - transformers: Hugging Face's `config.json` (`--config`), which holds what
//!   the tensors cannot say (heads, eps, activation);
//! - CNNs: the tensor shapes (torchvision saves no config): stage and block
//!   counts from the names, widths from the shapes, BatchNorm eps at
//!   torchvision's defaults; or a distmind config (`--config`, the `config`
//!   object of a manifest) that states them all.
//!
//! Every expected tensor must be present with its shape and a float dtype;
//! all problems are reported at once (a missing, an extra, a renamed or a
//! misshaped tensor, each named). Buffers inference does not use
//! (`num_batches_tracked`, Inception's `AuxLogits`, attention mask buffers)
//! are left out and listed in the manifest's `origin`.
//!
//! The package keeps the checkpoint's dtype: an all-F16 or all-BF16
//! checkpoint gives a half-precision package (half the bytes to store and
//! move; devices widen on upload, exactly). A checkpoint mixing dtypes, or
//! `--widen`, gives an f32 package, every value widened exactly, and the
//! manifest's `origin` says so.

use std::collections::{BTreeSet, HashMap};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use distmind_common::limits::NAME_BYTES_MAX;

use crate::config::{
    BertConfig, DensenetConfig, Family, Gpt2Config, InceptionConfig, ModelConfig, ResnetConfig,
};
use crate::dtype::{self, ParamDtype};
use crate::graph::{Architecture, GeluApprox};
use crate::package::{
    read_safetensors_header, write_package, Manifest, Origin, Package, PackageSpec,
    SafetensorsEntry,
};
use crate::{shape, ModelError, Result};

/// Largest `--config` file read.
const CONFIG_BYTES_MAX: u64 = 1 << 20;
/// Largest layer or block count a config may ask for (bounds the graph built
/// before any tensor is checked).
const DEPTH_MAX: usize = 4096;
/// Problems listed in one error; the rest are counted.
const PROBLEMS_SHOWN_MAX: usize = 30;
/// Key prefixes a checkpoint may put before the base model's names
/// (`nn.DataParallel`, Hugging Face task models).
const PREFIXES: [&str; 5] = ["", "module.", "model.", "bert.", "transformer."];

/// What `import` reads and writes.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    pub family: Family,
    /// The checkpoint (`.safetensors`).
    pub weights: PathBuf,
    /// Hugging Face `config.json`, or a distmind config (`{"family": ...}`).
    pub config: Option<PathBuf>,
    /// The package directory to create: `DIR/<name>`.
    pub out: PathBuf,
    /// Input batch size (default: the config's, else 8).
    pub batch_size: Option<usize>,
    /// CNN input height and width (default: the config's, else 224; Inception 299).
    pub image_size: Option<usize>,
    /// Transformer default sequence length (default: the config's, else
    /// min(512, positions)); requests choose any length up to the positions.
    pub seq_len: Option<usize>,
    pub group_bytes: u64,
    /// Leave out tensors that are not part of the base model (task heads)
    /// instead of failing on them.
    pub ignore_extra: bool,
    /// Store f32 even when the checkpoint is all half precision.
    pub widen: bool,
}

/// The default input shape of imports: the evaluation's (`model gen --scale full`).
const BATCH_DEFAULT: usize = 8;
const SEQ_LEN_DEFAULT: usize = 512;

/// Imports `opts.weights` as the package `opts.out`; returns its manifest.
pub fn import(opts: &ImportOptions) -> Result<Manifest> {
    let name = package_name(&opts.out)?;
    let out_dir = match opts.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if opts.out.exists() && std::fs::read_dir(&opts.out).map_or(true, |mut d| d.next().is_some()) {
        return Err(ModelError::InvalidOption(format!(
            "--out {}: already exists and is not empty; remove it or choose another name",
            opts.out.display()
        )));
    }
    if opts.group_bytes == 0 {
        return Err(ModelError::InvalidOption(
            "--group-bytes must be at least 1".into(),
        ));
    }
    let ck = Checkpoint::open(&opts.weights, opts.family)?;
    let (config, config_source) = resolve_config(opts, &ck)?;
    let arch = config.build();
    check_shapes(&arch, &config, &opts.weights)?;
    let matched = match_tensors(opts, &ck, &arch, &config_source)?;
    let dtypes: BTreeSet<&str> = matched.sources.iter().map(|e| e.dtype.as_str()).collect();
    let stored = storage_dtype(&dtypes, opts.widen);
    let data = ck.read_params(&matched.sources, stored)?;
    check_finite(&ck.path, &arch, &data, stored)?;
    let origin = Origin {
        checkpoint: opts
            .weights
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        converted_to_f32: stored == ParamDtype::F32 && dtypes.iter().any(|&d| d != "F32"),
        checkpoint_dtypes: dtypes.into_iter().map(str::to_string).collect(),
        stripped_prefix: ck.prefix.clone(),
        dropped: matched.dropped,
        config_source,
    };
    let spec = PackageSpec {
        name: name.clone(),
        scale: config.preset(),
        config,
        seed: None,
        origin: Some(origin),
        group_bytes: opts.group_bytes,
        dtype: stored,
    };
    let written = write_package(&out_dir, &spec, &arch, &data).and_then(|_| {
        // The package must open and verify like any other before it counts.
        let pkg = Package::open(&opts.out)?;
        pkg.verify()?;
        Ok(pkg.manifest)
    });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&opts.out);
    }
    written
}

/// How the package stores a checkpoint whose parameters have `dtypes`
/// (safetensors names, all valid float dtypes): the one dtype they share,
/// else f32 (a mix); f32 with `widen`.
fn storage_dtype(dtypes: &BTreeSet<&str>, widen: bool) -> ParamDtype {
    match (widen, dtypes.len()) {
        (false, 1) => dtypes
            .first()
            .and_then(|d| ParamDtype::from_safetensors(d))
            .unwrap_or(ParamDtype::F32),
        _ => ParamDtype::F32,
    }
}

/// The last component of `--out`, checked against the model-name rules.
fn package_name(out: &Path) -> Result<String> {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ok = !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.');
    if ok {
        Ok(name)
    } else {
        Err(ModelError::InvalidOption(format!(
            "--out {}: the last component is the model's name: 1..={NAME_BYTES_MAX} letters, \
             digits, '_', '-' or '.', not starting with '.'",
            out.display()
        )))
    }
}

// ---------------------------------------------------------------------------
// The checkpoint
// ---------------------------------------------------------------------------

/// An opened checkpoint: its header, with the base model's key prefix found.
struct Checkpoint {
    path: PathBuf,
    file: std::fs::File,
    file_len: u64,
    data_start: u64,
    /// The prefix every base-model name carries ("" for a plain state_dict).
    prefix: String,
    /// Tensors under the prefix, by their name without it.
    tensors: HashMap<String, SafetensorsEntry>,
    /// Tensors outside the prefix (task heads of a Hugging Face task model).
    outside: Vec<(String, SafetensorsEntry)>,
}

impl Checkpoint {
    fn open(path: &Path, family: Family) -> Result<Checkpoint> {
        let h = read_safetensors_header(path)?;
        let anchor = anchor_tensor(family);
        let prefix = PREFIXES
            .iter()
            .find(|p| h.tensors.contains_key(&format!("{p}{anchor}")))
            .copied()
            .unwrap_or("")
            .to_string();
        let mut tensors = HashMap::with_capacity(h.tensors.len());
        let mut outside = Vec::new();
        for (name, e) in h.tensors {
            match name.strip_prefix(prefix.as_str()) {
                Some(rest) => {
                    tensors.insert(rest.to_string(), e);
                }
                None => outside.push((name, e)),
            }
        }
        outside.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Checkpoint {
            path: path.to_path_buf(),
            file: h.file,
            file_len: h.file_len,
            data_start: h.data_start,
            prefix,
            tensors,
            outside,
        })
    }

    fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// Dimension `dim` of tensor `name`, for inferring a hyper-parameter.
    fn dim(&self, name: &str, dim: usize, rank: usize) -> Result<usize, String> {
        match self.shape(name) {
            Some(s) if s.len() == rank => Ok(s[dim]),
            Some(s) => Err(format!(
                "tensor `{name}` has shape {s:?}; a rank-{rank} tensor was expected"
            )),
            None => Err(format!("tensor `{name}` is missing")),
        }
    }

    /// Reads each tensor as little-endian bytes of `stored`: unchanged when
    /// it is already in that dtype, else (`stored` is then f32) widened exactly.
    fn read_params(
        &self,
        sources: &[SafetensorsEntry],
        stored: ParamDtype,
    ) -> Result<Vec<Vec<u8>>> {
        sources
            .iter()
            .map(|e| {
                let [s, t] = e.data_offsets;
                let mut raw = vec![0u8; (t - s) as usize];
                self.file
                    .read_exact_at(&mut raw, self.data_start + s)
                    .map_err(ModelError::io(&self.path, "cannot read tensor bytes"))?;
                let from = ParamDtype::from_safetensors(&e.dtype)
                    .expect("match_tensors admits only float dtypes");
                if from == stored {
                    return Ok(raw);
                }
                assert_eq!(stored, ParamDtype::F32, "only widening converts");
                let mut out = vec![0u8; raw.len() * 4 / from.size_bytes() as usize];
                dtype::widen_to_le_bytes(from, &raw, &mut out);
                Ok(out)
            })
            .collect()
    }
}

/// A tensor every checkpoint of the family has, to find the key prefix by.
fn anchor_tensor(family: Family) -> &'static str {
    match family {
        Family::Resnet152 => "conv1.weight",
        Family::InceptionV3 => "Conv2d_1a_3x3.conv.weight",
        Family::Densenet201 => "features.conv0.weight",
        Family::BertBase => "embeddings.word_embeddings.weight",
        Family::Gpt2 => "wte.weight",
    }
}

/// Bytes per element of the float dtypes a parameter may have.
fn float_size(dtype: &str) -> Option<u64> {
    ParamDtype::from_safetensors(dtype).map(ParamDtype::size_bytes)
}

/// Checkpoint tensors inference never reads: left out, not errors.
fn unused_buffer(family: Family, name: &str) -> bool {
    match family {
        Family::Resnet152 | Family::Densenet201 => name.ends_with(".num_batches_tracked"),
        Family::InceptionV3 => {
            name.ends_with(".num_batches_tracked") || name.starts_with("AuxLogits.")
        }
        // Position ids and token type ids registered as buffers.
        Family::BertBase => {
            name == "embeddings.position_ids" || name == "embeddings.token_type_ids"
        }
        // The causal mask (`bias`) and its fill value (`masked_bias`).
        Family::Gpt2 => name
            .strip_prefix("h.")
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(i, rest)| {
                i.parse::<usize>().is_ok() && matches!(rest, "attn.bias" | "attn.masked_bias")
            }),
    }
}

// ---------------------------------------------------------------------------
// The config
// ---------------------------------------------------------------------------

/// The model's hyper-parameters and a phrase saying where they came from.
fn resolve_config(opts: &ImportOptions, ck: &Checkpoint) -> Result<(ModelConfig, String)> {
    let family = opts.family;
    let cnn = matches!(
        family,
        Family::Resnet152 | Family::InceptionV3 | Family::Densenet201
    );
    let (config, source) = match &opts.config {
        Some(path) => {
            let value = read_config_json(path)?;
            let bad = |what: String| ModelError::ImportConfig {
                path: path.clone(),
                what,
            };
            if value.get("family").is_some() {
                let c: ModelConfig = serde_json::from_value(value)
                    .map_err(|e| bad(format!("not a distmind model config: {e}")))?;
                if c.family() != family {
                    return Err(bad(format!(
                        "is a config of {}, but --family is {family}",
                        c.family()
                    )));
                }
                (c, format!("distmind config {}", path.display()))
            } else if cnn {
                return Err(bad(format!(
                    "{family} checkpoints come without a config.json (torchvision saves none); \
                     leave --config out to read the hyper-parameters from the tensor shapes, \
                     or give a distmind config ({{\"family\": \"{family}\", ...}}, the `config` \
                     object of a manifest)"
                )));
            } else {
                let hf = HfConfig {
                    path,
                    value: &value,
                };
                let c = match family {
                    Family::BertBase => ModelConfig::BertBase(hf.bert().map_err(bad)?),
                    _ => ModelConfig::Gpt2(hf.gpt2().map_err(bad)?),
                };
                (c, format!("Hugging Face {}", path.display()))
            }
        }
        None if cnn => {
            let c = infer_cnn_config(family, ck).map_err(|what| ModelError::ImportConfig {
                path: ck.path.clone(),
                what: format!(
                    "cannot read {family}'s hyper-parameters from the tensors: {what} \
                     (or give them with --config)"
                ),
            })?;
            (
                c,
                "the checkpoint's tensor shapes (BatchNorm eps: torchvision's default)".into(),
            )
        }
        None => {
            return Err(ModelError::InvalidOption(format!(
                "--family {family} needs --config config.json: Hugging Face's config holds \
                 what the tensors cannot say (attention heads, layer-norm eps, activation)"
            )))
        }
    };
    let config = with_input_size(config, opts)?;
    validate(&config).map_err(|what| ModelError::ImportConfig {
        path: opts.config.clone().unwrap_or_else(|| opts.weights.clone()),
        what,
    })?;
    Ok((config, source))
}

fn read_config_json(path: &Path) -> Result<serde_json::Value> {
    let len = std::fs::metadata(path)
        .map_err(ModelError::io(path, "cannot read --config"))?
        .len();
    if len > CONFIG_BYTES_MAX {
        return Err(ModelError::ImportConfig {
            path: path.to_path_buf(),
            what: format!("is {len} bytes; a model config is at most {CONFIG_BYTES_MAX}"),
        });
    }
    let text = std::fs::read(path).map_err(ModelError::io(path, "cannot read --config"))?;
    let value: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| ModelError::ImportConfig {
            path: path.to_path_buf(),
            what: format!("not valid JSON: {e}"),
        })?;
    if !value.is_object() {
        return Err(ModelError::ImportConfig {
            path: path.to_path_buf(),
            what: "is not a JSON object".into(),
        });
    }
    Ok(value)
}

/// Applies `--batch-size`, `--image-size` and `--seq-len`; an option that does
/// not apply to the family is an error rather than silently ignored.
fn with_input_size(mut config: ModelConfig, opts: &ImportOptions) -> Result<ModelConfig> {
    let family = config.family();
    let wrong =
        |flag: &str| ModelError::InvalidOption(format!("{flag} does not apply to {family}"));
    match &mut config {
        ModelConfig::Resnet152(ResnetConfig { image_size, .. })
        | ModelConfig::InceptionV3(InceptionConfig { image_size, .. })
        | ModelConfig::Densenet201(DensenetConfig { image_size, .. }) => {
            if opts.seq_len.is_some() {
                return Err(wrong("--seq-len"));
            }
            if let Some(s) = opts.image_size {
                *image_size = s;
            }
        }
        ModelConfig::BertBase(BertConfig { seq_len, .. })
        | ModelConfig::Gpt2(Gpt2Config { seq_len, .. }) => {
            if opts.image_size.is_some() {
                return Err(wrong("--image-size"));
            }
            if let Some(l) = opts.seq_len {
                *seq_len = l;
            }
        }
    }
    Ok(match opts.batch_size {
        Some(b) => config.with_batch_size(b),
        None => config,
    })
}

/// Limits that keep the graph builders and shape rules well-defined.
fn validate(config: &ModelConfig) -> Result<(), String> {
    let eps = |v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(format!("eps {v} must be a positive number"))
        }
    };
    all_positive(&[("batch size", config.batch_size())])?;
    match config {
        ModelConfig::Resnet152(c) => {
            all_positive(&[
                ("base width", c.base_width),
                ("expansion", c.expansion),
                ("classes", c.num_classes),
                ("input channels", c.in_channels),
            ])?;
            stage_counts("blocks per stage", &c.blocks)?;
            eps(c.bn_eps)
        }
        ModelConfig::InceptionV3(c) => {
            all_positive(&[
                ("width divisor", c.width_divisor),
                ("classes", c.num_classes),
                ("input channels", c.in_channels),
            ])?;
            eps(c.bn_eps)
        }
        ModelConfig::Densenet201(c) => {
            all_positive(&[
                ("growth rate", c.growth_rate),
                ("initial features", c.init_features),
                ("bottleneck size", c.bn_size),
                ("transition divisor", c.transition_divisor),
                ("classes", c.num_classes),
                ("input channels", c.in_channels),
            ])?;
            stage_counts("dense layers per block", &c.blocks)?;
            eps(c.bn_eps)
        }
        ModelConfig::BertBase(BertConfig {
            hidden,
            heads,
            layers,
            seq_len,
            max_positions,
            vocab_size,
            intermediate,
            layer_norm_eps,
            ..
        })
        | ModelConfig::Gpt2(Gpt2Config {
            hidden,
            heads,
            layers,
            seq_len,
            max_positions,
            vocab_size,
            intermediate,
            layer_norm_eps,
            ..
        }) => {
            if let ModelConfig::BertBase(c) = config {
                all_positive(&[("token type vocabulary", c.type_vocab_size)])?;
            }
            all_positive(&[
                ("hidden size", *hidden),
                ("attention heads", *heads),
                ("vocabulary size", *vocab_size),
                ("intermediate size", *intermediate),
                ("sequence length", *seq_len),
            ])?;
            if *layers > DEPTH_MAX {
                return Err(format!("the layer count is {layers}; at most {DEPTH_MAX}"));
            }
            if !hidden.is_multiple_of(*heads) {
                return Err(format!(
                    "hidden size {hidden} is not a multiple of the {heads} attention heads"
                ));
            }
            if seq_len > max_positions {
                return Err(format!(
                    "sequence length {seq_len} exceeds the {max_positions} position embeddings"
                ));
            }
            eps(*layer_norm_eps)
        }
    }
}

fn all_positive(fields: &[(&str, usize)]) -> Result<(), String> {
    match fields.iter().find(|(_, v)| *v == 0) {
        Some((what, _)) => Err(format!("{what} is 0")),
        None => Ok(()),
    }
}

/// Block or layer counts per stage: at least one stage, none empty, bounded in total.
fn stage_counts(what: &str, counts: &[usize]) -> Result<(), String> {
    if counts.is_empty() || counts.contains(&0) {
        return Err(format!("{what} {counts:?}: every stage needs at least one"));
    }
    let total: usize = counts.iter().sum();
    if total > DEPTH_MAX {
        return Err(format!(
            "{what} {counts:?}: {total} in all, at most {DEPTH_MAX}"
        ));
    }
    Ok(())
}

/// Runs the shape rules over the built graph: an input too small for the
/// architecture (an image below Inception's 75 pixels) fails here, naming the layer.
fn check_shapes(arch: &Architecture, config: &ModelConfig, path: &Path) -> Result<()> {
    let shapes: HashMap<&str, &[usize]> = arch
        .params
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    shape::infer(&arch.layers, &arch.inputs, |n| shapes.get(n).copied())
        .map(|_| ())
        .map_err(|(l, what)| ModelError::ImportConfig {
            path: path.to_path_buf(),
            what: format!(
                "{} with input {:?}: layer {l} ({}): {what}",
                config.family(),
                arch.inputs
                    .first()
                    .map(|i| i.shape.clone())
                    .unwrap_or_default(),
                arch.layers[l].name
            ),
        })
}

/// A Hugging Face `config.json`, read key by key with Hugging Face's
/// defaults (those of `bert-base-uncased` and `gpt2`) for absent keys.
struct HfConfig<'a> {
    path: &'a Path,
    value: &'a serde_json::Value,
}

impl HfConfig<'_> {
    fn usize(&self, key: &str, default: usize) -> Result<usize, String> {
        match self.value.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| format!("`{key}` is {v}, expected a non-negative integer")),
        }
    }

    fn f64(&self, key: &str, default: f64) -> Result<f64, String> {
        match self.value.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| format!("`{key}` is {v}, expected a number")),
        }
    }

    fn str(&self, key: &str, default: &str) -> Result<String, String> {
        match self.value.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("`{key}` is {v}, expected a string")),
        }
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.value.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| format!("`{key}` is {v}, expected true or false")),
        }
    }

    fn model_type(&self, want: &str) -> Result<(), String> {
        let t = self.str("model_type", want)?;
        if t == want {
            Ok(())
        } else {
            Err(format!(
                "`model_type` is \"{t}\"; this family imports \"{want}\" checkpoints ({})",
                self.path.display()
            ))
        }
    }

    /// Hugging Face activation names to the two GELUs the executors run.
    fn activation(&self, key: &str, default: &str) -> Result<GeluApprox, String> {
        let a = self.str(key, default)?;
        match a.as_str() {
            "gelu" => Ok(GeluApprox::Erf),
            // Three spellings of the same tanh approximation.
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(GeluApprox::Tanh),
            _ => Err(format!(
                "`{key}` is \"{a}\"; supported: gelu (erf), gelu_new / gelu_pytorch_tanh (tanh)"
            )),
        }
    }

    fn bert(&self) -> Result<BertConfig, String> {
        self.model_type("bert")?;
        let pos = self.str("position_embedding_type", "absolute")?;
        if pos != "absolute" {
            return Err(format!(
                "`position_embedding_type` is \"{pos}\"; only absolute position embeddings are supported"
            ));
        }
        for key in ["is_decoder", "add_cross_attention"] {
            if self.bool(key, false)? {
                return Err(format!(
                    "`{key}` is true; only the BERT encoder is supported"
                ));
            }
        }
        let d = BertConfig::full();
        let max_positions = self.usize("max_position_embeddings", d.max_positions)?;
        Ok(BertConfig {
            vocab_size: self.usize("vocab_size", d.vocab_size)?,
            hidden: self.usize("hidden_size", d.hidden)?,
            layers: self.usize("num_hidden_layers", d.layers)?,
            heads: self.usize("num_attention_heads", d.heads)?,
            intermediate: self.usize("intermediate_size", d.intermediate)?,
            max_positions,
            type_vocab_size: self.usize("type_vocab_size", d.type_vocab_size)?,
            layer_norm_eps: self.f64("layer_norm_eps", d.layer_norm_eps)?,
            activation: self.activation("hidden_act", "gelu")?,
            batch_size: BATCH_DEFAULT,
            seq_len: SEQ_LEN_DEFAULT.min(max_positions),
        })
    }

    fn gpt2(&self) -> Result<Gpt2Config, String> {
        self.model_type("gpt2")?;
        if !self.bool("scale_attn_weights", true)? {
            return Err("`scale_attn_weights` is false; only scaled attention is supported".into());
        }
        if self.bool("scale_attn_by_inverse_layer_idx", false)? {
            return Err("`scale_attn_by_inverse_layer_idx` is true; not supported".into());
        }
        let d = Gpt2Config::full();
        let hidden = self.usize("n_embd", d.hidden)?;
        let positions = match self.value.get("n_positions") {
            Some(_) => self.usize("n_positions", d.max_positions)?,
            None => self.usize("n_ctx", d.max_positions)?,
        };
        Ok(Gpt2Config {
            vocab_size: self.usize("vocab_size", d.vocab_size)?,
            hidden,
            layers: self.usize("n_layer", d.layers)?,
            heads: self.usize("n_head", d.heads)?,
            // `n_inner: null` means 4 * n_embd.
            intermediate: self.usize("n_inner", 4 * hidden)?,
            max_positions: positions,
            layer_norm_eps: self.f64("layer_norm_epsilon", d.layer_norm_eps)?,
            activation: self.activation("activation_function", "gelu_new")?,
            batch_size: BATCH_DEFAULT,
            seq_len: SEQ_LEN_DEFAULT.min(positions),
        })
    }
}

/// Largest index `i` such that some tensor starts with `{prefix}{i}.`, plus one.
fn count_indexed(ck: &Checkpoint, prefix: &str) -> usize {
    ck.tensors
        .keys()
        .filter_map(|k| {
            k.strip_prefix(prefix)?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max()
        .map_or(0, |m| m + 1)
}

/// A torchvision CNN's hyper-parameters from its tensor names and shapes.
fn infer_cnn_config(family: Family, ck: &Checkpoint) -> Result<ModelConfig, String> {
    let ratio = |num: usize, den: usize, what: &str| {
        if den != 0 && num.is_multiple_of(den) {
            Ok(num / den)
        } else {
            Err(format!("{what}: {num} is not a multiple of {den}"))
        }
    };
    match family {
        Family::Resnet152 => {
            let base_width = ck.dim("conv1.weight", 0, 4)?;
            let in_channels = ck.dim("conv1.weight", 1, 4)?;
            let blocks: Vec<usize> = (1..)
                .map(|s| count_indexed(ck, &format!("layer{s}.")))
                .take_while(|&n| n > 0)
                .collect();
            let expansion = ratio(
                ck.dim("layer1.0.conv3.weight", 0, 4)?,
                ck.dim("layer1.0.conv1.weight", 0, 4)?,
                "expansion (layer1.0.conv3 out / layer1.0.conv1 out)",
            )?;
            Ok(ModelConfig::Resnet152(ResnetConfig {
                blocks,
                base_width,
                expansion,
                num_classes: ck.dim("fc.weight", 0, 2)?,
                in_channels,
                image_size: 224,
                batch_size: BATCH_DEFAULT,
                bn_eps: 1e-5,
            }))
        }
        Family::Densenet201 => {
            let first = "features.denseblock1.denselayer1";
            let growth_rate = ck.dim(&format!("{first}.conv2.weight"), 0, 4)?;
            let bn_size = ratio(
                ck.dim(&format!("{first}.conv1.weight"), 0, 4)?,
                growth_rate,
                "bottleneck size (denselayer1.conv1 out / growth rate)",
            )?;
            // Dense layers are numbered from 1: the count is the largest index.
            let blocks: Vec<usize> = (1..)
                .map(|b| {
                    count_indexed(ck, &format!("features.denseblock{b}.denselayer"))
                        .saturating_sub(1)
                })
                .take_while(|&n| n > 0)
                .collect();
            let transition_divisor = match ck.shape("features.transition1.conv.weight") {
                Some(_) => ratio(
                    ck.dim("features.transition1.conv.weight", 1, 4)?,
                    ck.dim("features.transition1.conv.weight", 0, 4)?,
                    "transition compression (transition1.conv in / out)",
                )?,
                None => 2,
            };
            Ok(ModelConfig::Densenet201(DensenetConfig {
                growth_rate,
                blocks,
                init_features: ck.dim("features.conv0.weight", 0, 4)?,
                bn_size,
                transition_divisor,
                num_classes: ck.dim("classifier.weight", 0, 2)?,
                in_channels: ck.dim("features.conv0.weight", 1, 4)?,
                image_size: 224,
                batch_size: BATCH_DEFAULT,
                bn_eps: 1e-5,
            }))
        }
        Family::InceptionV3 => {
            // Every channel count is torchvision's divided by `width_divisor`
            // (rounded up); the stem's 32 channels narrow it to a few
            // candidates, and the one whose graph fits most tensors wins.
            let stem = ck.dim("Conv2d_1a_3x3.conv.weight", 0, 4)?;
            let base = InceptionConfig {
                num_classes: ck.dim("fc.weight", 0, 2)?,
                in_channels: ck.dim("Conv2d_1a_3x3.conv.weight", 1, 4)?,
                image_size: 299,
                batch_size: BATCH_DEFAULT,
                ..InceptionConfig::full()
            };
            (1..=32)
                .filter(|d| 32usize.div_ceil(*d) == stem)
                .map(|width_divisor| InceptionConfig {
                    width_divisor,
                    ..base.clone()
                })
                .min_by_key(|c| {
                    let arch = ModelConfig::InceptionV3(c.clone()).build();
                    arch.params
                        .iter()
                        .filter(|p| ck.shape(&p.name) != Some(p.shape.as_slice()))
                        .count()
                })
                .map(ModelConfig::InceptionV3)
                .ok_or_else(|| {
                    format!(
                        "Conv2d_1a_3x3 has {stem} output channels; torchvision's 32 divided by \
                         any width divisor gives none of that"
                    )
                })
        }
        Family::BertBase | Family::Gpt2 => unreachable!("transformers read a config.json"),
    }
}

// ---------------------------------------------------------------------------
// Matching tensors to parameters
// ---------------------------------------------------------------------------

struct Matched {
    /// Per `arch.params[i]`, its checkpoint entry.
    sources: Vec<SafetensorsEntry>,
    /// Full names of the checkpoint tensors left out.
    dropped: Vec<String>,
}

/// Pairs every expected parameter with a checkpoint tensor; collects every
/// problem (missing, extra, renamed, misshaped, wrong dtype, bad extent) into one error.
fn match_tensors(
    opts: &ImportOptions,
    ck: &Checkpoint,
    arch: &Architecture,
    config_source: &str,
) -> Result<Matched> {
    let family = opts.family;
    // (parameter index, message): reported in parameter order, extras last.
    let mut problems: Vec<(usize, String)> = Vec::new();
    let mut missing: Vec<usize> = Vec::new();
    let mut sources = Vec::with_capacity(arch.params.len());
    let data_len = ck.file_len - ck.data_start;
    for (i, p) in arch.params.iter().enumerate() {
        let Some(e) = ck.tensors.get(&p.name) else {
            missing.push(i);
            continue;
        };
        let name = format!("{}{}", ck.prefix, p.name);
        let Some(size) = float_size(&e.dtype) else {
            problems.push((
                i,
                format!(
                    "tensor `{name}` has dtype {}; parameters must be F32, F16 or BF16",
                    e.dtype
                ),
            ));
            continue;
        };
        if e.shape != p.shape {
            problems.push((
                i,
                format!(
                    "tensor `{name}` has shape {:?}; {family} with this config needs {:?}",
                    e.shape, p.shape
                ),
            ));
            continue;
        }
        let [s, t] = e.data_offsets;
        let want = p.numel() as u64 * size;
        if t < s || t - s != want || t > data_len {
            problems.push((
                i,
                format!(
                    "tensor `{name}`: the header's byte range {s}..{t} does not hold {} {:?} \
                     ({want} bytes) inside the file's {data_len} data bytes",
                    e.dtype, p.shape
                ),
            ));
            continue;
        }
        sources.push(e.clone());
    }
    let expected: HashMap<&str, usize> = arch
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    let mut dropped = Vec::new();
    let mut extras: Vec<(String, &SafetensorsEntry)> = Vec::new();
    let mut inside: Vec<(&String, &SafetensorsEntry)> = ck
        .tensors
        .iter()
        .filter(|(n, _)| !expected.contains_key(n.as_str()))
        .collect();
    inside.sort_by(|a, b| a.0.cmp(b.0));
    for (n, e) in inside {
        let full = format!("{}{n}", ck.prefix);
        if unused_buffer(family, n) || opts.ignore_extra {
            dropped.push(full);
        } else {
            extras.push((full, e));
        }
    }
    for (n, e) in &ck.outside {
        if opts.ignore_extra {
            dropped.push(n.clone());
        } else {
            extras.push((n.clone(), e));
        }
    }
    // A missing parameter and an extra tensor of the same shape with a
    // similar name are one mistake: a rename.
    let mut renamed = vec![None; extras.len()];
    for (x, (extra, e)) in extras.iter().enumerate() {
        let best = missing
            .iter()
            .filter(|&&i| arch.params[i].shape == e.shape)
            .filter(|&&i| !renamed.contains(&Some(i)))
            .map(|&i| (edit_distance(extra, &arch.params[i].name), i))
            .min();
        if let Some((d, i)) = best {
            if d <= extra.len().max(arch.params[i].name.len()) / 2 {
                renamed[x] = Some(i);
            }
        }
    }
    for &i in &missing {
        if !renamed.contains(&Some(i)) {
            let p = &arch.params[i];
            problems.push((
                i,
                format!(
                    "tensor `{}{}` is missing (expected {:?})",
                    ck.prefix, p.name, p.shape
                ),
            ));
        }
    }
    for ((extra, e), r) in extras.iter().zip(&renamed) {
        problems.push(match r {
            Some(i) => (
                *i,
                format!(
                    "tensor `{extra}` is not a parameter of {family}; it looks like `{}{}` \
                     renamed (same shape {:?}), which is missing",
                    ck.prefix, arch.params[*i].name, e.shape
                ),
            ),
            None => (
                usize::MAX,
                format!(
                    "tensor `{extra}` ({} {:?}) is not a parameter of {family} \
                     (a task head? --ignore-extra leaves such tensors out)",
                    e.dtype, e.shape
                ),
            ),
        });
    }
    if !problems.is_empty() {
        // Stable: extras keep their name order.
        problems.sort_by_key(|(i, _)| *i);
        return Err(ModelError::Checkpoint {
            path: ck.path.clone(),
            family,
            config_source: config_source.to_string(),
            problems: problems.into_iter().map(|(_, p)| p).collect(),
        });
    }
    Ok(Matched { sources, dropped })
}

/// A checkpoint with NaN or infinite parameters would serve garbage: refused.
/// `data` holds the values as stored (`stored`).
fn check_finite(
    path: &Path,
    arch: &Architecture,
    data: &[Vec<u8>],
    stored: ParamDtype,
) -> Result<()> {
    let problems: Vec<String> = arch
        .params
        .iter()
        .zip(data)
        .filter_map(|(p, d)| {
            let bad = stored.count_non_finite(d);
            (bad > 0).then(|| format!("tensor `{}` holds {bad} NaN or infinite values", p.name))
        })
        .collect();
    if problems.is_empty() {
        return Ok(());
    }
    Err(ModelError::ImportConfig {
        path: path.to_path_buf(),
        what: format!("non-finite parameters:{}", problem_list(&problems)),
    })
}

/// Levenshtein distance over bytes (names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, &ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// The problems of a [`ModelError::Checkpoint`], one per line, bounded.
pub(crate) fn problem_list(problems: &[String]) -> String {
    let mut s = String::new();
    for p in problems.iter().take(PROBLEMS_SHOWN_MAX) {
        s.push_str("\n  - ");
        s.push_str(p);
    }
    if problems.len() > PROBLEMS_SHOWN_MAX {
        s.push_str(&format!(
            "\n  ... and {} more",
            problems.len() - PROBLEMS_SHOWN_MAX
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_single_edits() {
        assert_eq!(edit_distance("fc.bias", "fc.bias"), 0);
        assert_eq!(edit_distance("fc.bias", "fc.biass"), 1);
        assert_eq!(edit_distance("fc.weight", "fc.wieght"), 2);
        assert_eq!(edit_distance("", "abc"), 3);
    }

    #[test]
    fn unused_buffers_are_only_the_known_ones() {
        assert!(unused_buffer(Family::Resnet152, "bn1.num_batches_tracked"));
        assert!(!unused_buffer(Family::Resnet152, "bn1.running_mean"));
        assert!(unused_buffer(Family::InceptionV3, "AuxLogits.fc.weight"));
        assert!(unused_buffer(Family::Gpt2, "h.11.attn.bias"));
        assert!(unused_buffer(Family::Gpt2, "h.0.attn.masked_bias"));
        assert!(!unused_buffer(Family::Gpt2, "h.0.attn.c_attn.bias"));
        assert!(!unused_buffer(Family::Gpt2, "hx.0.attn.bias"));
        assert!(unused_buffer(Family::BertBase, "embeddings.position_ids"));
        assert!(!unused_buffer(Family::BertBase, "pooler.dense.bias"));
    }

    #[test]
    fn the_package_keeps_one_checkpoint_dtype_and_widens_a_mix() {
        let set = |d: &[&'static str]| d.iter().copied().collect::<BTreeSet<&str>>();
        assert_eq!(storage_dtype(&set(&["BF16"]), false), ParamDtype::BF16);
        assert_eq!(storage_dtype(&set(&["F16"]), false), ParamDtype::F16);
        assert_eq!(storage_dtype(&set(&["F32"]), false), ParamDtype::F32);
        assert_eq!(storage_dtype(&set(&["BF16"]), true), ParamDtype::F32);
        assert_eq!(storage_dtype(&set(&["F16", "F32"]), false), ParamDtype::F32);
        assert_eq!(
            storage_dtype(&set(&["BF16", "F16"]), false),
            ParamDtype::F32
        );
    }

    #[test]
    fn problem_list_is_bounded() {
        let many: Vec<String> = (0..100).map(|i| format!("p{i}")).collect();
        let s = problem_list(&many);
        assert_eq!(s.lines().count(), 1 + PROBLEMS_SHOWN_MAX + 1);
        assert!(s.ends_with("... and 70 more"), "{s}");
    }
}
