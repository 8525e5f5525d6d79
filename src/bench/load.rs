//! `distmind bench load`: the time to make a model runnable once its bytes
//! are in host memory (the paper's figure 11b), next to PyTorch loading the
//! same weights from a checkpoint, in the same run on the same CPU.
//!
//! DistMind: a package's parameter groups are raw bytes laid out as the
//! executor uses them, so making a model runnable is an arena, one copy per
//! group and a plan over the layer list; nothing is parsed or converted on
//! the request path. Measured with the `cpu` executor (real math): the first
//! request's latency from bytes in memory (arena, copies, plan, forward
//! pass) minus a warm request's (the forward pass alone), medians of
//! `--repeat`.
//!
//! PyTorch (where it is installed: `--torch-python` or
//! `DISTMIND_TORCH_PYTHON`): `tests/reference/torch_load_time.py` builds the
//! family's torchvision / Hugging Face model on the CPU, fills it with the
//! package's weights, and times `torch.load` of the whole pickled model (how
//! the MPS baseline of the paper keeps its models) and `torch.load` of the
//! state dict plus `load_state_dict`, both from bytes in memory.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use distmind_models::{Family, Package, Scale};
use distmind_runtime::exec::{all_ready, cpu::CpuExecutor, Executor, HostTensor, Trace};
use serde::{Deserialize, Serialize};

use super::{machine_line, median};

/// The script that times PyTorch (relative to the repository).
pub const TORCH_SCRIPT: &str = "tests/reference/torch_load_time.py";

#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// Families to measure, comma separated (default: all five).
    #[arg(long, value_delimiter = ',')]
    pub family: Vec<Family>,
    #[arg(long, default_value = "full")]
    pub scale: Scale,
    /// Measurements per figure (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Python with PyTorch, torchvision, transformers and safetensors
    /// (tests/reference/requirements-torch.txt) for the PyTorch column.
    #[arg(long, env = "DISTMIND_TORCH_PYTHON")]
    pub torch_python: Option<PathBuf>,
    /// Append the rows to this CSV (created with its header), for `distmind plot`.
    #[arg(long)]
    pub csv: Option<PathBuf>,
}

/// One family's figures, ms.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub family: String,
    pub bytes: u64,
    /// Arena and one copy per group.
    pub distmind_copy_ms: f64,
    /// The plan over the layer list.
    pub distmind_plan_ms: f64,
    /// First request from bytes in memory minus a warm one.
    pub distmind_load_ms: f64,
    pub forward_ms: f64,
    pub torch: Option<TorchTimes>,
}

/// What the PyTorch script reports, ms.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TorchTimes {
    /// `torch.load` of `torch.save(model)` from memory.
    pub whole_model_load_ms: f64,
    /// `torch.load` of the state dict and `load_state_dict` into a built model.
    pub state_dict_load_ms: f64,
    pub torch_version: String,
}

/// The CSV columns of `--csv`: one row per family and way of loading.
pub const CSV_HEADER: &str = "family,system,load_ms,bytes,executor,profile";

pub fn run(args: &LoadArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.repeat >= 1, "--repeat must be at least 1");
    let families = if args.family.is_empty() {
        Family::ALL.to_vec()
    } else {
        args.family.clone()
    };
    let torch = match &args.torch_python {
        Some(p) => Some(check_torch(p)?),
        None => {
            println!(
                "load bench: PyTorch column skipped: give --torch-python (or DISTMIND_TORCH_PYTHON) a Python \
                 with tests/reference/requirements-torch.txt"
            );
            None
        }
    };
    let dir = std::env::temp_dir().join(format!("distmind-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let exec = CpuExecutor::new();
    println!("load bench: {}", machine_line());
    println!("executor: {}", exec.describe());
    println!(
        "{:<13} {:>9} {:>10} {:>9} {:>10} {:>10} {:>14} {:>14}",
        "family", "MB", "copy", "plan", "load", "forward", "torch whole", "torch state"
    );
    let mut rows = Vec::new();
    for &family in &families {
        let pkg = Package::open(
            distmind_models::generate(&distmind_models::GenOptions {
                family,
                variants: 1,
                out_dir: dir.clone(),
                scale: args.scale,
                seed: 11,
                group_bytes: distmind_common::limits::GROUP_BYTES_DEFAULT,
                dtype: distmind_models::ParamDtype::F32,
            })?
            .remove(0),
        )?;
        let row = measure(&exec, &pkg, args.repeat, torch.as_deref())?;
        let t = |f: fn(&TorchTimes) -> f64| {
            row.torch
                .as_ref()
                .map_or("-".into(), |x| format!("{:.1}", f(x)))
        };
        println!(
            "{:<13} {:>9.1} {:>10.1} {:>9.1} {:>10.1} {:>10.1} {:>14} {:>14}",
            row.family,
            row.bytes as f64 / 1e6,
            row.distmind_copy_ms,
            row.distmind_plan_ms,
            row.distmind_load_ms,
            row.forward_ms,
            t(|x| x.whole_model_load_ms),
            t(|x| x.state_dict_load_ms)
        );
        if let Some(x) = &row.torch {
            println!(
                "{:<13} torch whole / distmind load {:.1}x, torch state dict / distmind load {:.1}x",
                "",
                x.whole_model_load_ms / row.distmind_load_ms,
                x.state_dict_load_ms / row.distmind_load_ms
            );
        }
        rows.push(row);
        std::fs::remove_dir_all(&pkg.dir).ok();
    }
    std::fs::remove_dir_all(&dir).ok();
    if let Some(path) = &args.csv {
        append_csv(path, &rows)?;
        println!("load bench: rows appended to {}", path.display());
    }
    Ok(())
}

/// The Python with PyTorch, or an error naming what is missing.
fn check_torch(python: &Path) -> anyhow::Result<PathBuf> {
    let out = std::process::Command::new(python)
        .args([
            "-c",
            "import torch, torchvision, transformers, safetensors; print(torch.__version__)",
        ])
        .output()
        .with_context(|| format!("cannot run {}", python.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} lacks PyTorch, torchvision, transformers or safetensors ({}); install \
         tests/reference/requirements-torch.txt",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
    );
    Ok(python.to_path_buf())
}

fn measure(
    exec: &CpuExecutor,
    pkg: &Package,
    repeat: usize,
    torch: Option<&Path>,
) -> anyhow::Result<Row> {
    let m = &pkg.manifest;
    let groups = pkg.packed()?;
    let input = input_for(pkg);
    let (mut copy, mut plan, mut load, mut forward) = (vec![], vec![], vec![], vec![]);
    for _ in 0..repeat {
        let t0 = Instant::now();
        let arena = exec.alloc_arena(m.stored_bytes)?;
        for (g, bytes) in m.groups.iter().zip(&groups) {
            arena.upload(g.index, g.offset, bytes)?;
        }
        let t1 = Instant::now();
        let mut program = exec.program(m, arena)?;
        let t2 = Instant::now();
        let mut trace = Trace::new();
        program.run(std::slice::from_ref(&input), &mut all_ready, &mut trace)?;
        let cold = t0.elapsed();
        let t3 = Instant::now();
        program.run(
            std::slice::from_ref(&input),
            &mut all_ready,
            &mut Trace::new(),
        )?;
        let warm = t3.elapsed();
        copy.push((t1 - t0).as_secs_f64() * 1e3);
        plan.push((t2 - t1).as_secs_f64() * 1e3);
        load.push((cold.saturating_sub(warm)).as_secs_f64() * 1e3);
        forward.push(warm.as_secs_f64() * 1e3);
    }
    let torch = torch.map(|py| torch_times(py, pkg, repeat)).transpose()?;
    Ok(Row {
        family: m.family.to_string(),
        bytes: m.stored_bytes,
        distmind_copy_ms: median(copy),
        distmind_plan_ms: median(plan),
        distmind_load_ms: median(load),
        forward_ms: median(forward),
        torch,
    })
}

/// Runs the PyTorch script on the package's weights.
fn torch_times(python: &Path, pkg: &Package, repeat: usize) -> anyhow::Result<TorchTimes> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(TORCH_SCRIPT);
    let weights = pkg.dir.join("weights.safetensors");
    let out = std::process::Command::new(python)
        .arg(&script)
        .args(["--family", &pkg.manifest.family.to_string()])
        .arg("--weights")
        .arg(&weights)
        .args(["--repeat", &repeat.to_string()])
        .output()
        .with_context(|| format!("cannot run {} {}", python.display(), script.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} failed on {}: {}",
        script.display(),
        pkg.manifest.name,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or("");
    serde_json::from_str(last)
        .with_context(|| format!("{} printed {last:?}, not its JSON line", script.display()))
}

/// A seeded input of the manifest's shape at batch 1.
fn input_for(pkg: &Package) -> HostTensor {
    use rand::{Rng, SeedableRng};
    let spec = &pkg.manifest.inputs[0];
    let mut shape = spec.shape.clone();
    shape[0] = 1;
    let n: usize = shape.iter().product();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    match spec.dtype {
        distmind_models::Dtype::I64 => {
            HostTensor::i64(shape, (0..n).map(|_| rng.gen_range(0..100)).collect())
        }
        _ => HostTensor::f32(shape, (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()),
    }
}

fn append_csv(path: &Path, rows: &[Row]) -> anyhow::Result<()> {
    let mut text = String::new();
    for r in rows {
        text.push_str(&format!(
            "{},distmind,{:.3},{},cpu,-\n",
            r.family, r.distmind_load_ms, r.bytes
        ));
        if let Some(t) = &r.torch {
            text.push_str(&format!(
                "{},pytorch_whole_model,{:.3},{},cpu,-\n{},pytorch_state_dict,{:.3},{},cpu,-\n",
                r.family, t.whole_model_load_ms, r.bytes, r.family, t.state_dict_load_ms, r.bytes
            ));
        }
    }
    super::append_csv(path, CSV_HEADER, &text)
}
