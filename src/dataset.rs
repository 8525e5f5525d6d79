//! `distmind dataset put|ls|inspect|rm|synth`: training datasets on the
//! memory servers.
//!
//! A dataset is deployed with the model deploy path (write, commit,
//! catalog, replicas; all-or-nothing): its samples are packed, whole, into
//! groups of about equal size, one group per memory server and group
//! (`horizontal` sharding, so a sample never straddles two servers), and the
//! catalog entry (family [`DATASET_FAMILY`]) carries a [`DatasetManifest`]
//! that says where every sample lies. [`open`] turns that into the arena
//! offsets the memory servers' sample service reads.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use clap::{Args, Subcommand};
use distmind_common::checksum::{checksum, to_hex};
use distmind_common::proto::ModelEntry;
use distmind_common::samples::{
    DatasetManifest, SampleMeta, SampleRef, DATASET_FAMILY, DATASET_SAMPLES_MAX,
};
use distmind_controller::placement::Strategy;
use distmind_controller::prep::Mode;
use distmind_controller::ControllerClient;
use distmind_data::dir::RawSample;

use crate::{deploy, services};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest group a dataset is packed into (fewer, larger groups when
/// there are few memory servers).
pub const DATASET_GROUP_BYTES_MAX: u64 = 64 << 20;

/// `distmind dataset`: labelled training samples stored on the memory servers.
#[derive(Args, Debug)]
pub struct DatasetCmd {
    #[command(subcommand)]
    pub op: DatasetOp,
}

#[derive(Subcommand, Debug)]
pub enum DatasetOp {
    /// Store a directory of samples (JPEG, PNG or .npy files and a
    /// labels.txt of `<file> <label>` lines) on the memory servers.
    Put {
        #[command(flatten)]
        at: At,
        /// The dataset's name in the catalog (replaces a dataset of that name).
        #[arg(long)]
        name: String,
        /// Copies of every shard, on distinct memory servers (default: the settings').
        #[arg(long)]
        replication: Option<usize>,
        /// The directory holding the samples and labels.txt.
        dir: PathBuf,
    },
    /// List the datasets in the catalog.
    Ls {
        #[command(flatten)]
        at: At,
    },
    /// Show a dataset: samples, classes, formats, bytes per memory server.
    Inspect {
        #[command(flatten)]
        at: At,
        name: String,
        /// Print the whole manifest as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove a dataset from the catalog and free its bytes.
    Rm {
        #[command(flatten)]
        at: At,
        name: String,
    },
    /// SOPHON's profiling epoch and plan: every sample profiled on the memory server that
    /// holds it, then how many preprocessing steps each memory server runs per sample.
    Plan {
        #[command(flatten)]
        at: At,
        name: String,
        /// none, all, split:K or sophon.
        #[arg(long, default_value = "sophon")]
        mode: String,
        /// Each memory server's link to the trainer (e.g. 500mbit, 1GB/s).
        #[arg(long, default_value = "500mbit")]
        bandwidth: String,
        /// Where to write the plan (JSON).
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// One epoch over a dataset through the training data loader: with a plan (--plan FILE)
    /// or a fixed mode (--mode none|all|split:K); prints the time and the bytes moved.
    Epoch {
        #[command(flatten)]
        at: At,
        name: String,
        #[arg(long, conflicts_with = "mode")]
        plan: Option<PathBuf>,
        #[arg(long)]
        mode: Option<String>,
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Sample connections per memory server: each a fetcher thread that also runs the
        /// sample's remaining steps, so this is the trainer's preprocessing parallelism too.
        #[arg(long, default_value_t = 4)]
        connections: usize,
        /// Fail the batch of a sample that cannot be loaded (default: skip it).
        #[arg(long)]
        fail_bad_samples: bool,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Print the report as one JSON line.
        #[arg(long)]
        json: bool,
    },
    /// Write a generated, labelled set of real JPEGs into a directory
    /// (class-dependent colour and stripes, per-sample noise; deterministic).
    Synth {
        /// Where to write the files and labels.txt (created).
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 200)]
        samples: usize,
        #[arg(long, default_value_t = 4)]
        classes: u32,
        /// Image sizes WxH, used in turn (e.g. 64x64,900x700).
        #[arg(long, default_value = "64x64,96x128,900x700")]
        sizes: String,
        /// JPEG quality, 1 to 100.
        #[arg(long, default_value_t = 90)]
        quality: u8,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

/// Which cluster a dataset command talks to.
#[derive(Args, Debug, Clone)]
pub struct At {
    /// Settings directory (the controller's address and the cluster key).
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// Controller metadata address (default: first line of storage_list.txt).
    #[arg(long)]
    pub controller: Option<String>,
}

impl At {
    pub fn target(&self) -> anyhow::Result<(deploy::Target, distmind_common::settings::Settings)> {
        let settings = services::load_settings(&self.settings)?;
        let target = deploy::Target {
            controller: self
                .controller
                .clone()
                .unwrap_or_else(|| settings.metadata_endpoint().to_string()),
            key: services::cluster_key(&settings),
        };
        Ok((target, settings))
    }
}

pub fn run(cmd: &DatasetCmd) -> anyhow::Result<()> {
    match &cmd.op {
        DatasetOp::Put {
            at,
            name,
            replication,
            dir,
        } => {
            let (target, settings) = at.target()?;
            let samples = distmind_data::dir::read_dir(dir)
                .with_context(|| format!("reading dataset directory {}", dir.display()))?;
            let replication = replication.unwrap_or(settings.controller.replication as usize);
            let out = put(&target, name, &samples, replication)?;
            println!("{}", out.summary());
        }
        DatasetOp::Ls { at } => {
            let (target, _) = at.target()?;
            let mut c = connect(&target)?;
            let sets: Vec<_> = c
                .list_models()?
                .into_iter()
                .filter(|m| m.family == DATASET_FAMILY)
                .collect();
            if sets.is_empty() {
                println!("no datasets (store one with `distmind dataset put`)");
            }
            for m in sets {
                println!(
                    "{:32} {:>12} bytes  {:>4} shards",
                    m.name, m.total_bytes, m.groups
                );
            }
        }
        DatasetOp::Inspect { at, name, json } => {
            let (target, _) = at.target()?;
            let d = open(&target, name)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&d.manifest)?);
            } else {
                print!("{}", d.describe());
            }
        }
        DatasetOp::Rm { at, name } => {
            let (target, _) = at.target()?;
            let mut c = connect(&target)?;
            let entry = c
                .get_model(name)
                .with_context(|| format!("no dataset {name} in the catalog"))?;
            ensure!(
                entry.family == DATASET_FAMILY,
                "{name} is a model ({}), not a dataset: remove models with their own tools",
                entry.family
            );
            let removed = c.remove_model(name)?;
            let n = deploy::free_entry(&target.key, &removed);
            println!(
                "removed dataset {name} ({} bytes; {n} extents freed)",
                removed.total_bytes
            );
        }
        DatasetOp::Plan {
            at,
            name,
            mode,
            bandwidth,
            out,
            seed,
        } => {
            let (target, _) = at.target()?;
            let mode: Mode = mode.parse().map_err(anyhow::Error::msg)?;
            let bw = distmind_common::emulate::parse_rate(bandwidth)
                .map_err(|e| anyhow::anyhow!("--bandwidth: {e}"))?;
            let ds = open(&target, name)?;
            let plan = if mode == Mode::Sophon {
                let workers = crate::prep::prep_workers(&target, &ds)?;
                let costs = crate::prep::profile(&target, &ds, *seed)?;
                crate::prep::make_plan(&ds, &costs, &workers, mode, bw)?
            } else {
                crate::prep::fixed_plan(&ds, mode)?
            };
            plan.save(out)?;
            for s in &plan.servers {
                println!(
                    "memory server {}: {} of {} samples offloaded, {} bytes, net {:.3}s, remote cpu {:.3}s ({} workers)",
                    s.memserver, s.offloaded, s.samples, s.bytes, s.net_s, s.remote_cpu_s, s.prep_workers
                );
            }
            println!("plan ({}) written to {}", plan.mode, out.display());
        }
        DatasetOp::Epoch {
            at,
            name,
            plan,
            mode,
            batch,
            connections,
            fail_bad_samples,
            seed,
            json,
        } => {
            let (target, _) = at.target()?;
            let ds = open(&target, name)?;
            let plan = match (plan, mode) {
                (Some(p), _) => crate::prep::PlanFile::load(p)?,
                (None, m) => {
                    let mode: Mode = m
                        .as_deref()
                        .unwrap_or("none")
                        .parse()
                        .map_err(anyhow::Error::msg)?;
                    crate::prep::fixed_plan(&ds, mode)?
                }
            };
            let cfg = distmind_runtime::loader::LoaderConfig {
                batch: *batch,
                connections: *connections,
                seed: *seed,
                on_bad_sample: if *fail_bad_samples {
                    distmind_runtime::loader::OnBadSample::FailBatch
                } else {
                    distmind_runtime::loader::OnBadSample::Skip
                },
                ..Default::default()
            };
            let r = crate::prep::run_epoch(&target, &ds, &plan, cfg)?;
            if *json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "epoch ({}): {} samples ({} skipped, {} offloaded) in {:.3}s, {} bytes received, local prep {:.3}s",
                    r.mode, r.samples, r.skipped, r.offloaded, r.seconds, r.bytes, r.local_prep_s
                );
            }
        }
        DatasetOp::Synth {
            out,
            samples,
            classes,
            sizes,
            quality,
            seed,
        } => {
            let spec = distmind_data::synth::SynthSpec {
                samples: *samples,
                classes: *classes,
                seed: *seed,
                sizes: parse_sizes(sizes)?,
                quality: *quality,
            };
            ensure!(
                *samples > 0 && *classes > 0,
                "--samples and --classes must be positive"
            );
            ensure!((1..=100).contains(quality), "--quality must be 1 to 100");
            let set = distmind_data::synth::generate(&spec);
            std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
            distmind_data::dir::write_dir(out, &set)?;
            let bytes: usize = set.iter().map(|s| s.bytes.len()).sum();
            println!(
                "wrote {} JPEGs ({bytes} bytes, {classes} classes) and labels.txt to {}",
                set.len(),
                out.display()
            );
        }
    }
    Ok(())
}

/// Parses `WxH[,WxH...]`.
pub fn parse_sizes(s: &str) -> anyhow::Result<Vec<(u32, u32)>> {
    s.split(',')
        .map(|p| {
            let (w, h) = p
                .trim()
                .split_once('x')
                .with_context(|| format!("size {p:?}: expected WxH, e.g. 224x224"))?;
            let (w, h): (u32, u32) = (
                w.parse()
                    .with_context(|| format!("size {p:?}: bad width"))?,
                h.parse()
                    .with_context(|| format!("size {p:?}: bad height"))?,
            );
            ensure!(
                (1..=16384).contains(&w) && (1..=16384).contains(&h),
                "size {p:?}: each side must be 1 to 16384"
            );
            Ok((w, h))
        })
        .collect()
}

fn connect(target: &deploy::Target) -> anyhow::Result<ControllerClient> {
    ControllerClient::connect(&target.controller, &target.key, CONNECT_TIMEOUT)
        .with_context(|| format!("cannot reach the controller at {}", target.controller))
}

/// How samples are packed: each group at most `group_max` bytes (a sample
/// larger than that has a group of its own); returns each sample's group and
/// offset in it, and the groups' sizes.
pub fn pack(lens: &[u64], group_max: u64) -> (Vec<(u32, u64)>, Vec<u64>) {
    let mut at = Vec::with_capacity(lens.len());
    let mut groups: Vec<u64> = Vec::new();
    for &len in lens {
        let last = groups.len().wrapping_sub(1);
        match groups.last_mut() {
            Some(g) if *g > 0 && *g + len <= group_max => {
                at.push((last as u32, *g));
                *g += len;
            }
            _ => {
                at.push((groups.len() as u32, 0));
                groups.push(len);
            }
        }
    }
    (at, groups)
}

/// The content hash of a dataset: xxh3-64 over every sample's name, label
/// and checksum, in order.
pub fn content_hash(samples: &[SampleMeta]) -> String {
    let mut buf = Vec::new();
    for s in samples {
        buf.extend_from_slice(s.name.as_bytes());
        buf.push(0);
        buf.extend_from_slice(&s.label.to_le_bytes());
        buf.extend_from_slice(s.checksum.as_bytes());
    }
    to_hex(checksum(&buf))
}

/// Stores `samples` as dataset `name`.
pub fn put(
    target: &deploy::Target,
    name: &str,
    samples: &[RawSample],
    replication: usize,
) -> anyhow::Result<deploy::Deployed> {
    ensure!(!samples.is_empty(), "dataset {name}: no samples");
    ensure!(
        samples.len() <= DATASET_SAMPLES_MAX,
        "dataset {name}: {} samples, more than the {DATASET_SAMPLES_MAX} a dataset holds",
        samples.len()
    );
    let mut c = connect(target)?;
    if let Ok(old) = c.get_model(name) {
        ensure!(
            old.family == DATASET_FAMILY,
            "{name} is a model ({}) in the catalog: pick another name for the dataset",
            old.family
        );
    }
    let alive = c.list_memservers()?.iter().filter(|s| s.alive).count();
    if alive == 0 {
        bail!(
            "no live memory server is registered with the controller at {}",
            target.controller
        );
    }
    // About one group per memory server the dataset spreads over.
    let width = alive.min(distmind_controller::placement::SHARD_WIDTH_DEFAULT_MAX) as u64;
    let total: u64 = samples.iter().map(|s| s.bytes.len() as u64).sum();
    let group_max = total.div_ceil(width).clamp(1, DATASET_GROUP_BYTES_MAX);
    let lens: Vec<u64> = samples.iter().map(|s| s.bytes.len() as u64).collect();
    let (at, sizes) = pack(&lens, group_max);
    let mut groups: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&b| Vec::with_capacity(b as usize))
        .collect();
    let mut metas = Vec::with_capacity(samples.len());
    for (s, &(g, off)) in samples.iter().zip(&at) {
        groups[g as usize].extend_from_slice(&s.bytes);
        metas.push(SampleMeta {
            name: s.name.clone(),
            label: s.label,
            format: s.format.name().to_string(),
            group: g,
            offset: off,
            len: s.bytes.len() as u64,
            checksum: to_hex(checksum(&s.bytes)),
        });
    }
    let manifest = DatasetManifest {
        name: name.to_string(),
        content: content_hash(&metas),
        classes: samples.iter().map(|s| s.label).max().unwrap_or(0) + 1,
        samples: metas,
    };
    let model = deploy::Model {
        name,
        family: DATASET_FAMILY,
        manifest: serde_json::to_value(&manifest)?,
        groups,
    };
    let opts = deploy::Options {
        strategy: Strategy::Horizontal,
        replication,
        shard_width: 0,
        seed: 0,
        progress: false,
    };
    deploy::deploy(target, &model, &opts).with_context(|| format!("storing dataset {name}"))
}

/// One sample and the memory server that serves it (the first replica).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub memserver: u32,
    pub addr: String,
    pub sample: SampleRef,
}

/// A dataset as the catalog has it now.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub manifest: DatasetManifest,
    /// The catalog entry's version: it grows with every put.
    pub version: u64,
    pub total_bytes: u64,
    /// Every sample, in the manifest's order.
    pub located: Vec<Located>,
}

impl Dataset {
    /// Samples per memory server (by id and address).
    pub fn per_server(&self) -> BTreeMap<(u32, String), Vec<&Located>> {
        let mut m: BTreeMap<(u32, String), Vec<&Located>> = BTreeMap::new();
        for l in &self.located {
            m.entry((l.memserver, l.addr.clone())).or_default().push(l);
        }
        m
    }

    pub fn describe(&self) -> String {
        let m = &self.manifest;
        let mut formats: BTreeMap<&str, usize> = BTreeMap::new();
        for s in &m.samples {
            *formats.entry(s.format.as_str()).or_default() += 1;
        }
        let mut out = format!(
            "dataset {} (catalog version {}, content {})\n  {} samples, {} classes, {} bytes, formats {:?}\n",
            m.name,
            self.version,
            m.content,
            m.samples.len(),
            m.classes,
            self.total_bytes,
            formats
        );
        for ((id, addr), ls) in self.per_server() {
            let bytes: u64 = ls.iter().map(|l| l.sample.len).sum();
            out += &format!(
                "  memory server {id} ({addr}): {} samples, {bytes} bytes\n",
                ls.len()
            );
        }
        out
    }
}

/// Looks dataset `name` up and says where every sample lies.
pub fn open(target: &deploy::Target, name: &str) -> anyhow::Result<Dataset> {
    let entry = connect(target)?
        .get_model(name)
        .with_context(|| format!("no dataset {name} in the catalog at {}", target.controller))?;
    from_entry(&entry)
}

/// Every sample of dataset `name` and the memory server holding it.
pub fn locate(
    controller: &str,
    key: &distmind_common::handshake::ClusterKey,
    name: &str,
) -> anyhow::Result<Vec<Located>> {
    let target = deploy::Target {
        controller: controller.to_string(),
        key: key.clone(),
    };
    Ok(open(&target, name)?.located)
}

/// A catalog entry read as a dataset (pure).
pub fn from_entry(entry: &ModelEntry) -> anyhow::Result<Dataset> {
    let name = &entry.name;
    ensure!(
        entry.family == DATASET_FAMILY,
        "{name} is a model ({}), not a dataset",
        entry.family
    );
    let manifest: DatasetManifest = serde_json::from_value(entry.manifest.clone())
        .with_context(|| format!("dataset {name}: its manifest does not parse"))?;
    let mut located = Vec::with_capacity(manifest.samples.len());
    for (i, s) in manifest.samples.iter().enumerate() {
        let g = entry.groups.get(s.group as usize).with_context(|| {
            format!(
                "dataset {name}: sample {i} is in group {}, which the catalog lacks",
                s.group
            )
        })?;
        let slice = g
            .slices
            .iter()
            .find(|sl| sl.group_offset <= s.offset && s.offset + s.len <= sl.group_offset + sl.len)
            .with_context(|| {
                format!(
                    "dataset {name}: sample {i} straddles two slices of group {}",
                    s.group
                )
            })?;
        let r = slice.replicas.first().with_context(|| {
            format!(
                "dataset {name}: group {} has a slice with no copy left",
                s.group
            )
        })?;
        located.push(Located {
            memserver: r.memserver,
            addr: r.addr.clone(),
            sample: SampleRef {
                sample: i as u64,
                offset: r.offset + (s.offset - slice.group_offset),
                len: s.len,
                format: s.format.clone(),
                label: s.label,
            },
        });
    }
    Ok(Dataset {
        version: entry.version,
        total_bytes: entry.total_bytes,
        manifest,
        located,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_keeps_samples_whole_and_groups_bounded() {
        let (at, groups) = pack(&[10, 20, 30, 100, 5], 40);
        assert_eq!(at, vec![(0, 0), (0, 10), (1, 0), (2, 0), (3, 0)]);
        assert_eq!(groups, vec![30, 30, 100, 5]);
        // Every sample lies inside its group.
        for (&(g, off), len) in at.iter().zip([10u64, 20, 30, 100, 5]) {
            assert!(off + len <= groups[g as usize]);
        }
    }

    #[test]
    fn parse_sizes_names_the_bad_one() {
        assert_eq!(
            parse_sizes("64x64, 900x700").unwrap(),
            vec![(64, 64), (900, 700)]
        );
        let e = parse_sizes("64x64,9x").unwrap_err().to_string();
        assert!(e.contains("9x"), "{e}");
        assert!(parse_sizes("0x5").is_err());
    }

    #[test]
    fn the_content_hash_changes_with_any_sample() {
        let s = |name: &str, label, sum: &str| SampleMeta {
            name: name.into(),
            label,
            format: "jpeg".into(),
            group: 0,
            offset: 0,
            len: 1,
            checksum: sum.into(),
        };
        let a = content_hash(&[s("a", 0, "01"), s("b", 1, "02")]);
        assert_eq!(a, content_hash(&[s("a", 0, "01"), s("b", 1, "02")]));
        assert_ne!(a, content_hash(&[s("a", 0, "01"), s("b", 2, "02")]));
        assert_ne!(a, content_hash(&[s("a", 0, "01"), s("b", 1, "03")]));
        assert_ne!(a, content_hash(&[s("b", 1, "02"), s("a", 0, "01")]));
    }
}
