//! The crate's error type: every variant names the file, model, layer or
//! tensor concerned and what was expected.

use std::path::PathBuf;

/// Errors of the model zoo and the package format.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    #[error("{}: {what}: {source}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a valid package manifest: {source}", path.display())]
    ManifestParse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: inconsistent manifest: {what}", path.display())]
    BadManifest { path: PathBuf, what: String },
    #[error("{}: weights file does not match the manifest: {what}", path.display())]
    BadWeights { path: PathBuf, what: String },
    #[error(
        "{}: group {group} checksum mismatch: manifest says {expected}, the bytes give {actual}; \
         the weights are corrupted, regenerate or re-import the package",
        path.display()
    )]
    Checksum {
        path: PathBuf,
        group: usize,
        expected: String,
        actual: String,
    },
    #[error("model {model}: layer {layer} ({name}): {what}")]
    Graph {
        model: String,
        layer: usize,
        name: String,
        what: String,
    },
    #[error("group {group} does not exist: the package has {groups} group(s)")]
    NoSuchGroup { group: usize, groups: usize },
    #[error("unknown model family `{0}`; expected one of resnet152, inception_v3, densenet201, bert_base, gpt2")]
    UnknownFamily(String),
    #[error("unknown scale `{0}`; expected full or tiny")]
    UnknownScale(String),
    #[error("unknown parameter dtype `{0}`; expected f32, f16 or bf16")]
    UnknownDtype(String),
    #[error("{}: {what}", path.display())]
    ImportConfig { path: PathBuf, what: String },
    #[error(
        "{}: the checkpoint does not match {family} (hyper-parameters from {config_source}); \
         {} problem(s):{}",
        path.display(),
        problems.len(),
        crate::import::problem_list(problems)
    )]
    Checkpoint {
        path: PathBuf,
        family: crate::Family,
        config_source: String,
        problems: Vec<String>,
    },
    #[error("invalid option: {0}")]
    InvalidOption(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(
        path: impl Into<PathBuf>,
        what: &'static str,
    ) -> impl FnOnce(std::io::Error) -> ModelError {
        let path = path.into();
        move |source| ModelError::Io { path, what, source }
    }
}
