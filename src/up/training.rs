//! `up --use-train`: the run's background training job (which model, which
//! batch, the package up generates for it) and the bounds of its timeline.

use std::path::Path;

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{ControllerReply, ControllerRequest, TrainJobStatus};
use distmind_common::train_spec::JobSpec;
use distmind_controller::policy::zipf::Zipf;
use distmind_controller::ControllerClient;
use distmind_models::{Family, Package, Scale};
use distmind_runtime::exec::ExecutorKind;
use distmind_runtime::profile::Profile;
use distmind_runtime::server::{TRAIN_BATCH_DEFAULT, TRAIN_BATCH_MAX};

use super::timeline::Bounds;
use super::{System, UpArgs};

/// Images per training iteration on the sim executor, by default: the
/// original's job, one SGD step on 96 images.
pub const TRAIN_BATCH_SIM_DEFAULT: usize = 96;

/// Added to `--seed` for the weights of the training package, so they
/// differ from every inference model's.
const TRAIN_SEED_OFFSET: u64 = 1_000_000;

/// The families whose packages train (the runtime refuses the others).
pub fn trains(family: Family) -> bool {
    matches!(
        family,
        Family::Resnet152 | Family::InceptionV3 | Family::Densenet201
    )
}

/// The family of up's own training model: `--family` when it trains, else
/// the original's resnet152.
pub fn default_family(family: Option<Family>) -> Family {
    family.filter(|f| trains(*f)).unwrap_or(Family::Resnet152)
}

/// The name of up's own training model, as the original's `resnet152_train`.
pub fn default_name(family: Family) -> String {
    format!("{family}_train")
}

/// The training job of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// What the controller gives training GPUs (`--train-model`).
    pub model: String,
    pub family: Family,
    /// `Some(family)`: up generates and deploys the model (it is not one of
    /// the workload's).
    pub generate: Option<Family>,
    /// The runtime's `--train-batch`, when up sets it.
    pub batch: Option<usize>,
}

impl Plan {
    /// The batch the runtime trains with.
    pub fn effective_batch(&self) -> usize {
        self.batch.unwrap_or(TRAIN_BATCH_DEFAULT)
    }

    pub fn describe(&self) -> String {
        format!(
            "{} ({}{}), batch {} per iteration; the distmind policy moves GPUs between inference \
             and training each second, the slo policy trains the GPUs that the demand leaves",
            self.model,
            self.family,
            if self.generate.is_some() {
                ", generated and deployed by up"
            } else {
                ", one of the workload's models"
            },
            self.effective_batch()
        )
    }
}

/// Checks the training flags before anything starts.
pub fn check_flags(args: &UpArgs, system: System) -> anyhow::Result<()> {
    if !args.use_train {
        for (flag, given) in [
            ("--train-model", args.train_model.is_some()),
            ("--train-batch", args.train_batch.is_some()),
            ("--train-spec", args.train_spec.is_some()),
            ("--inference-workload", args.inference_workload.is_some()),
        ] {
            if given {
                bail!("{flag} needs --use-train (without training every GPU does inference)");
            }
        }
        return Ok(());
    }
    if system.baseline().is_some() {
        bail!(
            "--use-train: the {} baseline does not share GPUs with training; use --system distmind",
            system.as_str()
        );
    }
    if let Some(b) = args.train_batch {
        if !(2..=TRAIN_BATCH_MAX).contains(&b) {
            bail!(
                "--train-batch must be 2..={TRAIN_BATCH_MAX} (BatchNorm in training mode needs two images), got {b}"
            );
        }
    }
    if let Some(w) = &args.inference_workload {
        w.check_gpus(args.devices)?;
    }
    Ok(())
}

/// Submits the run's distributed training job; returns its id.
pub fn submit_job(ctl: &str, key: &ClusterKey, spec: JobSpec) -> anyhow::Result<String> {
    let mut c = ControllerClient::connect(ctl, key, JOB_CALL_TIMEOUT)
        .with_context(|| format!("cannot reach the controller at {ctl}"))?;
    let reply = c
        .request(&ControllerRequest::TrainSubmit {
            spec: Box::new(spec),
        })
        .context("submitting the training job (--train-spec)")?;
    let ControllerReply::TrainSubmitted { job } = reply else {
        bail!("the controller answered a training submit with {reply:?}");
    };
    println!("up: training job {} submitted", job.id);
    print!("{}", crate::train::render_jobs(std::slice::from_ref(&job)));
    Ok(job.id)
}

/// After the workload: prints the job's status, and stops it (waiting,
/// bounded, until every worker heard) if it still runs.
pub fn finish_job(ctl: &str, key: &ClusterKey, id: &str) -> anyhow::Result<()> {
    let mut c = ControllerClient::connect(ctl, key, JOB_CALL_TIMEOUT)
        .with_context(|| format!("cannot reach the controller at {ctl}"))?;
    let mut status = || -> anyhow::Result<TrainJobStatus> {
        match c.request(&ControllerRequest::TrainStatus {
            job: Some(id.to_string()),
        })? {
            ControllerReply::TrainJobs { mut jobs } if jobs.len() == 1 => Ok(jobs.remove(0)),
            r => bail!("the controller answered a training status with {r:?}"),
        }
    };
    let job = status()?;
    println!("\n== training job ==");
    print!("{}", crate::train::render_jobs(std::slice::from_ref(&job)));
    if job.state.is_terminal() {
        return Ok(());
    }
    let mut c2 = ControllerClient::connect(ctl, key, JOB_CALL_TIMEOUT)?;
    c2.request(&ControllerRequest::TrainStop {
        job: id.to_string(),
    })
    .with_context(|| format!("stopping the training job {id}"))?;
    let deadline = Instant::now() + JOB_STOP_WAIT;
    loop {
        let job = status()?;
        if job.state.is_terminal() {
            println!("up: training job {id}: {}", job.state.name());
            return Ok(());
        }
        if Instant::now() > deadline {
            println!(
                "up: training job {id} still {} after {JOB_STOP_WAIT:?}; its GPU server stops with the cluster",
                job.state.name()
            );
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Bounds each controller call about the training job.
const JOB_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long up waits for the training job's workers to hear a stop.
const JOB_STOP_WAIT: Duration = Duration::from_secs(30);

/// Which model trains: `--train-model` when it names one of `models` (the
/// workload's), else up's own `<family>_train`.
pub fn plan(args: &UpArgs, executor: ExecutorKind, models: &[Package]) -> anyhow::Result<Plan> {
    let batch = args
        .train_batch
        .or((executor == ExecutorKind::Sim).then_some(TRAIN_BATCH_SIM_DEFAULT));
    let family = default_family(args.family);
    let own = default_name(family);
    let named = args.train_model.as_deref().filter(|n| *n != own);
    let Some(name) = named else {
        return Ok(Plan {
            model: own,
            family,
            generate: Some(family),
            batch,
        });
    };
    let Some(pkg) = models.iter().find(|p| p.manifest.name == name) else {
        let listed: Vec<&str> = models
            .iter()
            .take(5)
            .map(|p| p.manifest.name.as_str())
            .collect();
        bail!(
            "--train-model {name}: not a model this run deploys (its models: {}{}); leave \
             --train-model out for up's own {own}",
            listed.join(", "),
            if models.len() > listed.len() {
                ", ..."
            } else {
                ""
            }
        );
    };
    let family = pkg.manifest.family;
    if !trains(family) {
        bail!(
            "--train-model {name} is a {family} model: only the CNN families (resnet152, \
             inception_v3, densenet201) train"
        );
    }
    Ok(Plan {
        model: name.to_string(),
        family,
        generate: None,
        batch,
    })
}

/// Writes (or finds, from an earlier run in the same work directory) the
/// package `name` of `family` at `scale` and opens it.
pub fn generate(
    dir: &Path,
    name: &str,
    family: Family,
    scale: Scale,
    seed: u64,
    group_bytes: u64,
) -> anyhow::Result<Package> {
    let seed = seed.wrapping_add(TRAIN_SEED_OFFSET);
    let path = dir.join(name);
    let reusable = Package::open(&path).is_ok_and(|p| {
        p.manifest.family == family
            && p.manifest.scale == Some(scale)
            && p.manifest.seed == Some(seed)
            && p.manifest.group_bytes == group_bytes
    });
    if !reusable {
        let opts = distmind_models::GenOptions {
            family,
            variants: 1,
            out_dir: dir.to_path_buf(),
            scale,
            seed,
            group_bytes,
            dtype: distmind_models::ParamDtype::F32,
        };
        distmind_models::generate_named(&opts, name)
            .with_context(|| format!("generating the training package {name}"))?;
    }
    Package::open(&path)
        .with_context(|| format!("cannot open the training package {}", path.display()))
}

/// The timeline's bounds: `devices` GPUs each answering requests in the
/// mean forward time of the models at `batch` under the workload's Zipf
/// popularity (`models` most popular first), or each training `train`
/// (family, batch) in [`Profile::train_iteration_s`]. With no profile (a
/// real executor) both are 0; without training the training bound is 0.
pub fn bounds(
    profile: Option<&Profile>,
    models: &[Package],
    batch: usize,
    zipf_s: f64,
    devices: u32,
    train: Option<(Family, usize)>,
    scale: Scale,
) -> anyhow::Result<Bounds> {
    let Some(profile) = profile else {
        return Ok(Bounds {
            inference_rps: 0.0,
            training_ips: 0.0,
        });
    };
    let origin = profile.origin();
    let zipf = Zipf::new(models.len(), zipf_s)
        .map_err(|e| anyhow::anyhow!("the workload's popularity: {e}"))?;
    let mut compute_s = 0.0;
    for (rank, p) in models.iter().enumerate() {
        let m = &p.manifest;
        let at = m.scale.unwrap_or(scale);
        let t = profile
            .get(m.family, at, batch)
            .with_context(|| {
                format!(
                    "--timeline: profile {origin} has no forward time for {} ({}/{at}, batch {batch})",
                    m.name, m.family
                )
            })?
            .total_s;
        compute_s += zipf.probability(rank) * t;
    }
    Ok(match train {
        Some((family, b)) => {
            let t = profile.train_iteration_s(family, scale, b).with_context(|| {
                format!("--timeline: profile {origin} has no time for {family}/{scale} (training batch {b})")
            })?;
            Bounds::per_gpu(devices as usize, compute_s, t)
        }
        None => Bounds {
            inference_rps: f64::from(devices) / compute_s,
            training_ips: 0.0,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_training_model_follows_the_family_when_it_trains() {
        assert_eq!(default_family(None), Family::Resnet152);
        assert_eq!(
            default_family(Some(Family::Densenet201)),
            Family::Densenet201
        );
        assert_eq!(default_family(Some(Family::BertBase)), Family::Resnet152);
        assert_eq!(default_name(Family::Resnet152), "resnet152_train");
        assert!(!trains(Family::Gpt2));
    }

    #[test]
    fn bounds_come_from_the_profile_and_are_zero_without_one() {
        let dir = tempfile::tempdir().unwrap();
        let profile = Profile::load(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(distmind_runtime::profile::SHIPPED_V100_ESTIMATED_PATH),
        )
        .unwrap();
        let pkg = generate(
            dir.path(),
            "resnet152_train",
            Family::Resnet152,
            Scale::Tiny,
            0,
            4096,
        )
        .unwrap();
        assert_eq!(pkg.manifest.name, "resnet152_train");
        // Found again, not rewritten.
        let again = generate(
            dir.path(),
            "resnet152_train",
            Family::Resnet152,
            Scale::Tiny,
            0,
            4096,
        )
        .unwrap();
        assert_eq!(again.manifest, pkg.manifest);
        let models = [pkg];
        let b = bounds(
            Some(&profile),
            &models,
            1,
            0.9,
            2,
            Some((Family::Resnet152, 96)),
            Scale::Tiny,
        )
        .unwrap();
        let fwd = profile
            .get(Family::Resnet152, Scale::Tiny, 1)
            .unwrap()
            .total_s;
        let train = profile
            .train_iteration_s(Family::Resnet152, Scale::Tiny, 96)
            .unwrap();
        assert!((b.inference_rps - 2.0 / fwd).abs() < 1e-9 * b.inference_rps);
        assert!((b.training_ips - 2.0 / train).abs() < 1e-9 * b.training_ips);
        let b = bounds(None, &models, 1, 0.9, 2, None, Scale::Tiny).unwrap();
        assert_eq!((b.inference_rps, b.training_ips), (0.0, 0.0));
        let b = bounds(Some(&profile), &models, 1, 0.9, 2, None, Scale::Tiny).unwrap();
        assert_eq!(b.training_ips, 0.0);
    }
}
