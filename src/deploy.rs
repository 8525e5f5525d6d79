//! `distmind deploy`: shard a model's parameter groups over memory servers and
//! register where every slice landed in the controller's catalog.
//!
//! Order matters for readers: slices are written and committed (each memory
//! server verifies the slice checksum) before the catalog entry is put, and a
//! replaced entry's extents are freed only after the new entry is visible, so
//! a reader never finds a catalog entry pointing at unwritten bytes.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use distmind_common::checksum::{checksum, to_hex};
use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{GroupLocation, Location, MemserverInfo, ModelEntry, Slice};
use distmind_common::settings::{Settings, ShardStrategy};
use distmind_controller::placement::{self, PlanOptions, SlicePlan, Strategy};
use distmind_controller::ControllerClient;
use distmind_memserver::MemserverClient;
use indicatif::{ProgressBar, ProgressStyle};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where to deploy: the controller's metadata endpoint and the cluster key.
#[derive(Clone, Debug)]
pub struct Target {
    pub controller: String,
    pub key: ClusterKey,
}

#[derive(Clone, Debug)]
pub struct Options {
    pub strategy: Strategy,
    pub replication: usize,
    /// 0 = min(#alive memory servers, 4).
    pub shard_width: usize,
    pub seed: u64,
    pub progress: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            strategy: Strategy::Hybrid,
            replication: 1,
            shard_width: 0,
            seed: 0,
            progress: false,
        }
    }
}

impl Options {
    /// Defaults from `controller.json`, overridden by command-line flags.
    pub fn from_settings(
        settings: &Settings,
        strategy: Option<Strategy>,
        replication: Option<usize>,
        shard_width: Option<usize>,
        progress: bool,
    ) -> Options {
        let c = &settings.controller;
        Options {
            strategy: strategy.unwrap_or(match c.strategy {
                ShardStrategy::Hybrid => Strategy::Hybrid,
                ShardStrategy::PerApp => Strategy::PerApp,
                ShardStrategy::Horizontal => Strategy::Horizontal,
                ShardStrategy::Vertical => Strategy::Vertical,
            }),
            replication: replication.unwrap_or(c.replication as usize),
            shard_width: shard_width.unwrap_or(c.shard_width as usize),
            seed: 0,
            progress,
        }
    }
}

/// A model to deploy: its packed groups, in order, and its manifest.
pub struct Model<'a> {
    pub name: &'a str,
    pub family: &'a str,
    pub manifest: serde_json::Value,
    pub groups: Vec<Vec<u8>>,
}

/// What a deploy did.
#[derive(Debug)]
pub struct Deployed {
    pub entry: ModelEntry,
    pub replaced: bool,
    pub elapsed: Duration,
}

impl Deployed {
    pub fn summary(&self) -> String {
        let servers: std::collections::BTreeSet<u32> = self
            .entry
            .groups
            .iter()
            .flat_map(|g| {
                g.slices
                    .iter()
                    .flat_map(|s| s.replicas.iter().map(|r| r.memserver))
            })
            .collect();
        format!(
            "deployed {} ({} groups, {:.1} MB, {} x{} over memservers {:?}) in {:.2}s{}",
            self.entry.name,
            self.entry.groups.len(),
            self.entry.total_bytes as f64 / 1e6,
            self.entry.strategy,
            self.entry.replication,
            servers,
            self.elapsed.as_secs_f64(),
            if self.replaced {
                ", replacing the previous version"
            } else {
                ""
            }
        )
    }
}

/// Deploys a package from disk.
pub fn deploy_package(
    target: &Target,
    pkg: &distmind_models::Package,
    opts: &Options,
) -> anyhow::Result<Deployed> {
    let m = &pkg.manifest;
    let groups = (0..m.groups.len())
        .map(|g| {
            pkg.group_bytes(g)
                .with_context(|| format!("reading group {g} of {}", pkg.dir.display()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let family = m.family.to_string();
    let model = Model {
        name: &m.name,
        family: &family,
        manifest: serde_json::to_value(m).context("serialising the manifest")?,
        groups,
    };
    deploy(target, &model, opts)
}

/// One slice copy to write: group, slice index, replica index, server.
struct Job {
    group: usize,
    slice: usize,
    replica: usize,
}

/// Deploys a model whose groups are in memory.
pub fn deploy(target: &Target, model: &Model<'_>, opts: &Options) -> anyhow::Result<Deployed> {
    let started = Instant::now();
    let mut controller =
        ControllerClient::connect(&target.controller, &target.key, CONNECT_TIMEOUT)
            .with_context(|| format!("cannot reach the controller at {}", target.controller))?;
    let mut servers: Vec<MemserverInfo> = controller
        .list_memservers()?
        .into_iter()
        .filter(|s| s.alive)
        .collect();
    if servers.is_empty() {
        bail!("no live memory server is registered with the controller at {}: start some with `distmind memserver`", target.controller);
    }
    refresh_used_bytes(&target.key, &mut servers);
    let sizes: Vec<u64> = model.groups.iter().map(|g| g.len() as u64).collect();
    let plan = placement::plan(
        &sizes,
        &servers,
        &PlanOptions {
            strategy: opts.strategy,
            shard_width: opts.shard_width,
            replication: opts.replication,
            seed: opts.seed,
        },
    )
    .with_context(|| format!("cannot place {}", model.name))?;

    // Jobs per memory server, so each server gets one connection and one thread.
    let mut per_server: BTreeMap<u32, Vec<Job>> = BTreeMap::new();
    for (g, slices) in plan.iter().enumerate() {
        for (s, sp) in slices.iter().enumerate() {
            for (r, &ms) in sp.replicas.iter().enumerate() {
                per_server.entry(ms).or_default().push(Job {
                    group: g,
                    slice: s,
                    replica: r,
                });
            }
        }
    }
    let addr_of = |id: u32| {
        servers
            .iter()
            .find(|s| s.id == id)
            .map(|s| s.addr.clone())
            .expect("plan uses listed servers")
    };
    let total: u64 = plan
        .iter()
        .flatten()
        .map(|sp| sp.len * sp.replicas.len() as u64)
        .sum();
    let bar = progress_bar(opts.progress, total, model.name);

    // Written copies: (group, slice, replica) -> location. On any failure every
    // copy written so far is freed again, so a failed deploy leaks nothing.
    let written: Mutex<BTreeMap<(usize, usize, usize), Location>> = Mutex::new(BTreeMap::new());
    let result: anyhow::Result<()> = std::thread::scope(|scope| {
        let handles: Vec<_> = per_server
            .iter()
            .map(|(&ms, jobs)| {
                let addr = addr_of(ms);
                let (written, bar, plan) = (&written, &bar, &plan);
                scope.spawn(move || -> anyhow::Result<()> {
                    let mut client = MemserverClient::connect(&addr, &target.key, CONNECT_TIMEOUT)
                        .with_context(|| format!("cannot reach memory server {ms} at {addr}"))?;
                    for job in jobs {
                        let sp: &SlicePlan = &plan[job.group][job.slice];
                        let start = sp.group_offset as usize;
                        let bytes = &model.groups[job.group][start..start + sp.len as usize];
                        let offset = client.alloc(sp.len, model.name).with_context(|| {
                            format!(
                                "memory server {ms} at {addr}: allocating {} bytes for {} group {}",
                                sp.len, model.name, job.group
                            )
                        })?;
                        written.lock().unwrap().insert(
                            (job.group, job.slice, job.replica),
                            Location {
                                memserver: ms,
                                addr: addr.clone(),
                                offset,
                            },
                        );
                        client.write(offset, bytes)?;
                        client.commit(offset, checksum(bytes)).with_context(|| {
                            format!(
                                "memory server {ms} at {addr}: committing {} group {}",
                                model.name, job.group
                            )
                        })?;
                        bar.inc(sp.len);
                    }
                    Ok(())
                })
            })
            .collect();
        let mut first_err = None;
        for h in handles {
            if let Err(e) = h.join().expect("deploy worker panicked") {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    });
    let written = written.into_inner().unwrap();
    if let Err(e) = result {
        bar.abandon();
        free_locations(&target.key, model.name, written.values());
        return Err(e);
    }

    let groups = plan
        .iter()
        .enumerate()
        .map(|(g, slices)| GroupLocation {
            index: g as u32,
            bytes: sizes[g],
            checksum: to_hex(checksum(&model.groups[g])),
            slices: slices
                .iter()
                .enumerate()
                .map(|(s, sp)| {
                    let start = sp.group_offset as usize;
                    Slice {
                        group_offset: sp.group_offset,
                        len: sp.len,
                        checksum: to_hex(checksum(
                            &model.groups[g][start..start + sp.len as usize],
                        )),
                        replicas: (0..sp.replicas.len())
                            .map(|r| written[&(g, s, r)].clone())
                            .collect(),
                    }
                })
                .collect(),
        })
        .collect();
    let entry = ModelEntry {
        name: model.name.to_string(),
        family: model.family.to_string(),
        total_bytes: sizes.iter().sum(),
        strategy: opts.strategy.to_string(),
        replication: opts.replication as u32,
        version: 0,
        groups,
        manifest: model.manifest.clone(),
    };
    let replaced = match controller.put_model(entry.clone()) {
        Ok(r) => r,
        Err(e) => {
            free_locations(&target.key, model.name, written.values());
            return Err(
                anyhow::Error::new(e).context(format!("registering {} in the catalog", model.name))
            );
        }
    };
    bar.finish_and_clear();
    if let Some(old) = &replaced {
        let old_locs: Vec<&Location> = old
            .groups
            .iter()
            .flat_map(|g| g.slices.iter().flat_map(|s| s.replicas.iter()))
            .collect();
        free_locations(&target.key, &old.name, old_locs.into_iter());
    }
    Ok(Deployed {
        entry,
        replaced: replaced.is_some(),
        elapsed: started.elapsed(),
    })
}

/// The controller learns used bytes from heartbeats, up to an interval late;
/// ask each memory server itself so that back-to-back deploys plan on what
/// is really free. A server that does not answer keeps the controller's view.
fn refresh_used_bytes(key: &ClusterKey, servers: &mut [MemserverInfo]) {
    for s in servers {
        match MemserverClient::connect(&s.addr, key, CONNECT_TIMEOUT).and_then(|mut c| c.stats()) {
            Ok(stats) => s.used_bytes = stats.used_bytes,
            Err(e) => log::warn!(
                "memory server {} at {}: no fresh stats ({e}); planning on the controller's view",
                s.id,
                s.addr
            ),
        }
    }
}

/// Frees every extent of a removed catalog entry, best effort; returns how
/// many copies it asked to free.
pub fn free_entry(key: &ClusterKey, entry: &ModelEntry) -> usize {
    let locs: Vec<&Location> = entry
        .groups
        .iter()
        .flat_map(|g| g.slices.iter().flat_map(|s| s.replicas.iter()))
        .collect();
    let n = locs.len();
    free_locations(key, &entry.name, locs.into_iter());
    n
}

/// Frees extents allocated for `owner`, best effort: a memory server that is
/// gone has lost them anyway, and one refuses an extent that another owner
/// holds now.
fn free_locations<'a>(key: &ClusterKey, owner: &str, locs: impl Iterator<Item = &'a Location>) {
    let mut by_addr: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for l in locs {
        by_addr.entry(&l.addr).or_default().push(l.offset);
    }
    for (addr, offsets) in by_addr {
        match MemserverClient::connect(addr, key, CONNECT_TIMEOUT) {
            Ok(mut c) => {
                for off in offsets {
                    if let Err(e) = c.free(off, owner) {
                        log::warn!(
                            "memory server {addr}: cannot free {owner}'s extent at {off}: {e}"
                        );
                    }
                }
            }
            Err(e) => log::warn!(
                "memory server {addr}: cannot free {} extents: {e}",
                offsets.len()
            ),
        }
    }
}

fn progress_bar(enabled: bool, total: u64, name: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:32} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(name.to_string());
    bar
}
