//! One forward pass of a package on its own, without the fetch pipeline:
//! what `distmind infer --model DIR --input FILE.npy --output FILE.npy` runs,
//! and how the NumPy reference checks the executors.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use distmind_models::{ModelError, Package};

use crate::exec::{all_ready, ExecError, Executor, HostTensor, Trace};
use crate::npy::{read_npy, write_npy, NpyError};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InferError {
    #[error(transparent)]
    Package(#[from] ModelError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Npy(#[from] NpyError),
    #[error("model {model}: the executor returned {got} outputs, the manifest names {want}")]
    OutputCount {
        model: String,
        got: usize,
        want: usize,
    },
    #[error("--output {path}: needs a file name ending in .npy")]
    OutputPath { path: PathBuf },
}

/// Runs `pkg` on `inputs` with `exec`: allocates an arena of the model's
/// device bytes, uploads (and widens) every group, compiles and runs with
/// every group ready. Returns the manifest's outputs in order and the trace.
pub fn infer_package(
    pkg: &Package,
    exec: &dyn Executor,
    inputs: &[HostTensor],
) -> Result<(Vec<HostTensor>, Trace), InferError> {
    let m = &pkg.manifest;
    let arena = exec.alloc_arena(m.device_bytes())?;
    let stored = m.param_dtype;
    for g in &m.groups {
        let bytes = pkg.group_bytes(g.index)?;
        arena.upload_stored(g.index, g.device_offset(stored), stored, &bytes)?;
    }
    let mut program = exec.program(m, arena)?;
    let mut trace = Trace::new();
    let outputs = program.run(inputs, &mut all_ready, &mut trace)?;
    if outputs.len() != m.outputs.len() {
        return Err(InferError::OutputCount {
            model: m.name.clone(),
            got: outputs.len(),
            want: m.outputs.len(),
        });
    }
    Ok((outputs, trace))
}

/// One output file written by [`infer_files`].
#[derive(Debug, Clone)]
pub struct WrittenOutput {
    /// The manifest's output name (`logits`, `last_hidden_state`, ...).
    pub name: String,
    pub path: PathBuf,
    pub shape: Vec<usize>,
}

/// What [`infer_files`] did.
#[derive(Debug, Clone)]
pub struct InferReport {
    pub model: String,
    /// Every output, in manifest order (the last is `--output` itself).
    pub outputs: Vec<WrittenOutput>,
    /// Wall time of [`infer_package`] (upload, compile and the forward pass).
    pub elapsed: Duration,
    pub trace: Trace,
}

/// `distmind infer`: opens the package in `model_dir`, reads the model's
/// single input from the `.npy` file `input`, runs it with `exec`, and writes
/// the LAST manifest output (the model's final layer: `logits`,
/// `pooler_output`, GPT-2's `last_hidden_state`) to `output`.
///
/// Models with several outputs (BERT) also get every earlier output written
/// next to it as `<output stem>.<output name>.npy`: `--output out.npy` on
/// BERT writes `out.npy` (`pooler_output`) and `out.last_hidden_state.npy`.
pub fn infer_files(
    model_dir: &Path,
    input: &Path,
    output: &Path,
    exec: &dyn Executor,
) -> Result<InferReport, InferError> {
    let stem = match (output.file_stem(), output.extension()) {
        (Some(stem), Some(ext)) if ext == "npy" => stem.to_string_lossy().into_owned(),
        _ => {
            return Err(InferError::OutputPath {
                path: output.to_path_buf(),
            })
        }
    };
    let pkg = Package::open(model_dir)?;
    let x = read_npy(input)?;
    let start = Instant::now();
    let (outputs, trace) = infer_package(&pkg, exec, &[x])?;
    let elapsed = start.elapsed();
    let last = outputs.len().saturating_sub(1);
    let mut written = Vec::with_capacity(outputs.len());
    for (i, (t, spec)) in outputs.iter().zip(&pkg.manifest.outputs).enumerate() {
        let path = if i == last {
            output.to_path_buf()
        } else {
            output.with_file_name(format!("{stem}.{}.npy", spec.name))
        };
        write_npy(&path, t)?;
        written.push(WrittenOutput {
            name: spec.name.clone(),
            path,
            shape: t.shape.clone(),
        });
    }
    Ok(InferReport {
        model: pkg.manifest.name.clone(),
        outputs: written,
        elapsed,
        trace,
    })
}
