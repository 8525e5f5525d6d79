//! `distmind train`: SGD steps on a model package (the original's
//! `resnet152_train` job: a training request is one step), on a seeded
//! synthetic batch, and, on request, the trained weights written back to the
//! memory servers: a new version deployed and swapped into the catalog, the
//! old extents freed (the original only copied them into the host cache).
//!
//! `distmind train submit|status|stop`: distributed training jobs (P
//! pipelines x S stages, a JSON spec: `common::train_spec`) run by the
//! controller on the GPUs inference leaves idle (`jobs`).

mod jobs;

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use distmind_models::Package;
use distmind_runtime::exec::HostTensor;
use distmind_runtime::train::{changed_groups, sgd_step_with_state, SgdConfig, SgdState};
use rand::{Rng, SeedableRng};

use crate::{deploy, services};

pub use jobs::{load_spec, render_jobs, JobCommand};

/// `distmind train`: one-process SGD steps on a package (`--model`), or a
/// distributed job on the cluster (a subcommand).
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct TrainCmd {
    #[command(subcommand)]
    pub job: Option<JobCommand>,
    #[command(flatten)]
    pub step: TrainArgs,
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// The package directory (`DIR/<name>`) of a CNN family.
    #[arg(long, required = true)]
    pub model: Option<PathBuf>,
    /// SGD steps (one per training request in the original).
    #[arg(long, default_value_t = 1)]
    pub steps: usize,
    /// Images per step (the original used 96 on a GPU; the CPU is slower).
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    #[arg(long, default_value_t = 0.01)]
    pub lr: f32,
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    #[arg(long, default_value_t = 1e-4)]
    pub weight_decay: f32,
    /// Seed of the synthetic images and labels.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the trained weights back to the memory servers (redeploy under the same name).
    #[arg(long)]
    pub writeback: bool,
    /// Settings directory (for --writeback).
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// Controller metadata address (for --writeback; default: first line of storage_list.txt).
    #[arg(long)]
    pub controller: Option<String>,
}

/// Runs `distmind train`: a job subcommand, or the steps of `--model`.
pub fn run_cmd(cmd: &TrainCmd) -> anyhow::Result<()> {
    match &cmd.job {
        Some(job) => jobs::run(job),
        None => run(&cmd.step),
    }
}

pub fn run(args: &TrainArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.steps >= 1 && args.batch >= 2,
        "--steps must be >= 1 and --batch >= 2 (BatchNorm needs two samples)"
    );
    let model = args.model.as_ref().context(
        "distmind train needs --model DIR (SGD steps on a package) or a subcommand: submit, status, stop",
    )?;
    let pkg =
        Package::open(model).with_context(|| format!("cannot open package {}", model.display()))?;
    let m = &pkg.manifest;
    let groups = pkg.packed()?;
    let before: Vec<u8> = groups.concat();
    let mut packed = before.clone();
    let (images, labels) = synthetic_batch(&pkg, args.batch, args.seed);
    let cfg = SgdConfig {
        lr: args.lr,
        momentum: args.momentum,
        weight_decay: args.weight_decay,
    };
    let mut state = SgdState::new();
    for step in 0..args.steps {
        let r = sgd_step_with_state(m, &mut packed, &images, &labels, &cfg, &mut state)?;
        println!(
            "step {step}: loss {:.4} ({} images, {:.2}s)",
            r.loss,
            r.batch,
            r.elapsed.as_secs_f64()
        );
    }
    let changed = changed_groups(&before, &packed, m);
    println!("{} of {} groups changed", changed.len(), m.groups.len());
    if args.writeback {
        let settings = services::load_settings(&args.settings)?;
        let target = deploy::Target {
            controller: args
                .controller
                .clone()
                .unwrap_or_else(|| settings.metadata_endpoint().to_string()),
            key: services::cluster_key(&settings),
        };
        let groups = m
            .groups
            .iter()
            .map(|g| packed[g.offset as usize..(g.offset + g.bytes) as usize].to_vec())
            .collect();
        let family = m.family.to_string();
        let model = deploy::Model {
            name: &m.name,
            family: &family,
            manifest: serde_json::to_value(m)?,
            groups,
        };
        let opts = deploy::Options::from_settings(&settings, None, None, None, false);
        let out = deploy::deploy(&target, &model, &opts)
            .context("writing the trained weights back to the memory servers")?;
        println!("written back: {}", out.summary());
    }
    Ok(())
}

/// Seeded images in U(-1, 1) of the manifest's input shape with `batch`
/// rows, and labels in [0, classes).
fn synthetic_batch(pkg: &Package, batch: usize, seed: u64) -> (HostTensor, Vec<i64>) {
    let mut shape = pkg.manifest.inputs[0].shape.clone();
    shape[0] = batch;
    let classes = pkg
        .manifest
        .outputs
        .last()
        .and_then(|o| o.shape.last().copied())
        .unwrap_or(2) as i64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    let images = HostTensor::f32(shape, (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect());
    let labels = (0..batch).map(|_| rng.gen_range(0..classes)).collect();
    (images, labels)
}
