//! `distmind dataset plan|epoch`: SOPHON on a dataset of the memory servers.
//!
//! `plan` runs the profiling epoch (every sample's size after each step and
//! each step's time, measured on the memory server that holds it, by its own
//! preprocessing workers), then the controller's pure planner
//! (`distmind_controller::prep`) per memory server with that server's link
//! rate and workers; the plan names the dataset's content hash and catalog
//! version. `epoch` loads every sample once through the runtime's loader
//! with a plan (or a fixed mode) and reports the time and the bytes moved.
//! A plan whose dataset has changed since is refused.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use distmind_common::samples::{SampleCost, SAMPLES_PER_REQUEST_MAX};
use distmind_controller::prep::{self as planner, Mode, Resources, SampleProfile};
use distmind_memserver::SampleClient;
use distmind_runtime::loader::{Loader, LoaderConfig, PlannedSample};
use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, Located};
use crate::deploy::Target;

const TIMEOUT: Duration = Duration::from_secs(120);
/// Samples per profiling request (each is decoded and resampled once).
const PROFILE_CHUNK: usize = 32;
const _: () = assert!(PROFILE_CHUNK <= SAMPLES_PER_REQUEST_MAX);

/// A plan: each sample's `k`, for one content of one dataset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanFile {
    pub dataset: String,
    /// The dataset's content hash when planned.
    pub content: String,
    pub version: u64,
    pub mode: String,
    /// Steps the memory server runs, per sample (manifest order).
    pub steps: Vec<u8>,
    pub bandwidth_bytes_per_s: f64,
    /// Per memory server: its preprocessing workers and the plan's
    /// prediction for its samples.
    pub servers: Vec<ServerPlan>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerPlan {
    pub memserver: u32,
    pub prep_workers: u32,
    pub samples: usize,
    pub offloaded: usize,
    pub bytes: u64,
    pub net_s: f64,
    pub remote_cpu_s: f64,
}

impl PlanFile {
    /// Refuses a plan made for another content of the dataset.
    pub fn check(&self, ds: &Dataset) -> anyhow::Result<()> {
        ensure!(
            self.dataset == ds.manifest.name,
            "the plan is for dataset {}, not {}",
            self.dataset,
            ds.manifest.name
        );
        ensure!(
            self.content == ds.manifest.content && self.steps.len() == ds.located.len(),
            "the plan was made for dataset {} with content {} ({} samples, catalog version {}); \
             it now has content {} ({} samples, version {}): make a new plan",
            self.dataset,
            self.content,
            self.steps.len(),
            self.version,
            ds.manifest.content,
            ds.located.len(),
            ds.version
        );
        Ok(())
    }

    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        std::fs::write(path, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing the plan to {}", path.display()))
    }

    pub fn load(path: &Path) -> anyhow::Result<PlanFile> {
        let b = std::fs::read(path).with_context(|| format!("reading plan {}", path.display()))?;
        serde_json::from_slice(&b)
            .with_context(|| format!("plan {} does not parse", path.display()))
    }
}

/// Each memory server's samples, by server id and address.
fn by_server(ds: &Dataset) -> BTreeMap<(u32, String), Vec<&Located>> {
    ds.per_server()
}

/// Every memory server's preprocessing workers (the sample service's Info).
pub fn prep_workers(target: &Target, ds: &Dataset) -> anyhow::Result<BTreeMap<u32, u32>> {
    let mut out = BTreeMap::new();
    for (id, addr) in by_server(ds).keys() {
        let mut c = SampleClient::connect(addr, &target.key, TIMEOUT)
            .with_context(|| format!("memory server {id} at {addr}"))?;
        out.insert(*id, c.info()?.0);
    }
    Ok(out)
}

/// SOPHON's profiling epoch: every sample profiled by the memory server
/// holding it (servers in parallel). Samples that fail are reported and
/// left out (they are shipped as files, k = 0).
pub fn profile(
    target: &Target,
    ds: &Dataset,
    seed: u64,
) -> anyhow::Result<Vec<Option<SampleCost>>> {
    let groups = by_server(ds);
    let results: Vec<anyhow::Result<Vec<SampleCost>>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .iter()
            .map(|((id, addr), located)| {
                s.spawn(move || -> anyhow::Result<Vec<SampleCost>> {
                    let mut c = SampleClient::connect(addr, &target.key, TIMEOUT)
                        .with_context(|| format!("memory server {id} at {addr}"))?;
                    let mut costs = Vec::new();
                    for chunk in located.chunks(PROFILE_CHUNK) {
                        let refs: Vec<_> = chunk.iter().map(|l| l.sample.clone()).collect();
                        let (got, failed) = c.profile(&refs, seed).with_context(|| {
                            format!("profiling on memory server {id} at {addr}")
                        })?;
                        for f in failed {
                            log::warn!("profiling: {} (it will be shipped as a file)", f.why);
                        }
                        costs.extend(got);
                    }
                    Ok(costs)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("profiling thread panicked"))
            .collect()
    });
    let mut out = vec![None; ds.located.len()];
    for r in results {
        for c in r? {
            let i = c.sample as usize;
            ensure!(i < out.len(), "a memory server profiled unknown sample {i}");
            out[i] = Some(c);
        }
    }
    Ok(out)
}

/// The plan of `mode`, per memory server with its workers, over `bandwidth`
/// (each memory server's link to the trainer).
pub fn make_plan(
    ds: &Dataset,
    costs: &[Option<SampleCost>],
    workers: &BTreeMap<u32, u32>,
    mode: Mode,
    bandwidth_bytes_per_s: f64,
) -> anyhow::Result<PlanFile> {
    let mut steps = vec![0u8; ds.located.len()];
    let mut servers = Vec::new();
    for ((id, _addr), located) in by_server(ds) {
        // Samples without a profile (they failed) stay files.
        let profiled: Vec<(usize, SampleProfile)> = located
            .iter()
            .filter_map(|l| {
                let i = l.sample.sample as usize;
                costs.get(i)?.as_ref().map(|c| {
                    (
                        i,
                        SampleProfile {
                            id: i as u64,
                            raw_bytes: c.raw_bytes,
                            bytes_after: c.bytes_after,
                            step_s: c.step_s,
                        },
                    )
                })
            })
            .collect();
        let prof: Vec<SampleProfile> = profiled.iter().map(|(_, p)| p.clone()).collect();
        let res = Resources {
            bandwidth_bytes_per_s,
            remote_cpus: *workers.get(&id).unwrap_or(&1),
        };
        let plan = planner::plan(&prof, mode, &res)
            .with_context(|| format!("planning memory server {id}'s samples"))?;
        for ((i, _), k) in profiled.iter().zip(&plan.steps) {
            steps[*i] = *k;
        }
        servers.push(ServerPlan {
            memserver: id,
            prep_workers: res.remote_cpus,
            samples: located.len(),
            offloaded: plan.offloaded(),
            bytes: plan.bytes,
            net_s: plan.net_s,
            remote_cpu_s: plan.remote_cpu_s,
        });
    }
    Ok(PlanFile {
        dataset: ds.manifest.name.clone(),
        content: ds.manifest.content.clone(),
        version: ds.version,
        mode: mode_name(mode),
        steps,
        bandwidth_bytes_per_s,
        servers,
    })
}

/// A fixed mode's plan, which needs no profile.
pub fn fixed_plan(ds: &Dataset, mode: Mode) -> anyhow::Result<PlanFile> {
    let k = match mode {
        Mode::None => 0,
        Mode::All => distmind_common::samples::PREP_STEPS as u8,
        Mode::Split(k) => k,
        Mode::Sophon => bail!("sophon needs a profile: use `distmind dataset plan`"),
    };
    Ok(PlanFile {
        dataset: ds.manifest.name.clone(),
        content: ds.manifest.content.clone(),
        version: ds.version,
        mode: mode_name(mode),
        steps: vec![k; ds.located.len()],
        bandwidth_bytes_per_s: 0.0,
        servers: Vec::new(),
    })
}

pub fn mode_name(m: Mode) -> String {
    match m {
        Mode::None => "none".into(),
        Mode::All => "all".into(),
        Mode::Split(k) => format!("split:{k}"),
        Mode::Sophon => "sophon".into(),
    }
}

/// What one epoch did.
#[derive(Debug, Clone, Serialize)]
pub struct EpochReport {
    pub mode: String,
    pub samples: u64,
    pub skipped: u64,
    pub batches: u64,
    pub offloaded: usize,
    pub seconds: f64,
    /// Bytes of samples the trainer received.
    pub bytes: u64,
    /// Seconds the trainer's CPUs spent on the steps left to them.
    pub local_prep_s: f64,
}

/// Loads every sample of `ds` once, as `plan` says, and drops the batches
/// (the consumer a training stage would be).
pub fn run_epoch(
    target: &Target,
    ds: &Dataset,
    plan: &PlanFile,
    cfg: LoaderConfig,
) -> anyhow::Result<EpochReport> {
    plan.check(ds)?;
    let planned: Vec<PlannedSample> = ds
        .located
        .iter()
        .zip(&plan.steps)
        .map(|(l, &k)| PlannedSample {
            addr: l.addr.clone(),
            sample: l.sample.clone(),
            steps: k,
        })
        .collect();
    let started = Instant::now();
    let loader = Loader::start(planned, &target.key, cfg)?;
    let mut batches = 0u64;
    while let Some(b) = loader.next_batch() {
        let b = b?;
        for s in &b.skipped {
            log::warn!("skipped {}", s.why);
        }
        batches += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    let st = loader.stats();
    use std::sync::atomic::Ordering::Relaxed;
    let samples = st.samples.load(Relaxed);
    let skipped = st.skipped.load(Relaxed);
    ensure!(
        samples + skipped == ds.located.len() as u64,
        "the epoch ended after {} of {} samples",
        samples + skipped,
        ds.located.len()
    );
    Ok(EpochReport {
        mode: plan.mode.clone(),
        samples,
        skipped,
        batches,
        offloaded: plan.steps.iter().filter(|&&k| k > 0).count(),
        seconds,
        bytes: st.bytes_received.load(Relaxed),
        local_prep_s: st.local_prep_ns.load(Relaxed) as f64 / 1e9,
    })
}
