//! `distmind ndpipe`: NDPipe's near-data fine-tuning, driven from here.
//!
//! The memory servers that hold a dataset's samples run a frozen backbone
//! next to them (`distmind memserver --backbone DIR`) and ship f16 features
//! instead of images; this process (the trainer) fine-tunes the classifier
//! head ([`distmind_runtime::ndpipe::Head`]) on them, in `R` chunks:
//!
//! * A seeded fraction of the samples is held out; the rest of every memory
//!   server's samples is shuffled (seeded) and cut into `R` near-equal
//!   chunks, so each chunk holds a share of every server's samples.
//! * One thread per memory server extracts chunk 0, 1, ..., R-1 and then
//!   the held-out samples, in requests of at most [`extract_request_max`]
//!   samples (their decoded inputs bounded), without waiting for the trainer:
//!   chunk `i + 1` is extracted while the trainer fine-tunes on chunk `i`.
//! * The trainer takes chunk `i` once every server delivered it and trains
//!   `E` epochs on it from chunk `i - 1`'s weights at `lr (R - i/2) / R`
//!   ([`Head::fine_tune_chunk`]); at the end it evaluates the head on the
//!   held-out features.
//!
//! [`Mode::ShipImages`] is the baseline: the same threads fetch every
//! sample's file (`Prep` with 0 steps), and decode (the eval transform,
//! [`distmind_data::prep::eval_tensor`]) and run the backbone here. Its
//! features go through f16 like the shipped ones, so the head sees the same
//! numbers in both modes (up to the summation order of the backbone's
//! batches) and only where the work runs and what crosses the network differ.
//!
//! Extraction throughput is NDPipe's (`Tuner/server.py`): every extracted
//! sample, held-out ones included, over the longest server's extraction
//! wall time (from the start to its last reply).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use distmind_common::handshake::ClusterKey;
use distmind_common::samples::{extract_request_max, ExtractorInfo, SampleFailure, SampleRef};
use distmind_data::format::SampleFormat;
use distmind_data::prep::{eval_tensor, f16_le_to_f32, f32_to_f16_le, PrepConfig};
use distmind_memserver::sample_client::Features;
use distmind_memserver::{FeatureExtractor, SampleClient};
use distmind_runtime::ndpipe::{Backbone, Head, HeadConfig, BACKBONE_INPUT_DEFAULT};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use crate::dataset::Located;

/// How long a connection to a memory server may take to open.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the backbone runs.
#[derive(Debug, Clone)]
pub enum Mode {
    /// On the memory servers (they must run `--backbone`); with `Some`,
    /// each server's backbone must be this package at this input side.
    NearData { check: Option<(PathBuf, u32)> },
    /// Baseline: ship the files, run the backbone in this package here.
    ShipImages { backbone: PathBuf, input: u32 },
}

/// What to run.
#[derive(Debug, Clone)]
pub struct NdpipeOptions {
    /// The controller's metadata address.
    pub controller: String,
    pub key: ClusterKey,
    pub dataset: String,
    /// `R`: chunks of the training samples.
    pub chunks: usize,
    /// Fraction of the samples held out for evaluation, `[0, 1)`.
    pub held_out: f64,
    /// The head's training: epochs per chunk, lr, momentum, batch, seed
    /// (which also seeds the held-out choice and the chunking).
    pub head: HeadConfig,
    pub mode: Mode,
}

impl NdpipeOptions {
    /// Near-data mode with NDPipe-like defaults: 4 chunks, 10% held out.
    pub fn new(controller: impl Into<String>, key: ClusterKey, dataset: impl Into<String>) -> Self {
        NdpipeOptions {
            controller: controller.into(),
            key,
            dataset: dataset.into(),
            chunks: 4,
            held_out: 0.1,
            head: HeadConfig::default(),
            mode: Mode::NearData { check: None },
        }
    }
}

/// One chunk, as the trainer saw it.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkReport {
    pub chunk: usize,
    /// Samples with features (failed ones left out).
    pub samples: usize,
    pub failed: usize,
    /// Longest server's extraction time of this chunk (its requests' wall
    /// time, including the transfer).
    pub extract_s: f64,
    /// Bytes that crossed the network for this chunk: features and labels
    /// (near data) or files (ship images).
    pub bytes: u64,
    /// The trainer's wait for the chunk's last server.
    pub wait_s: f64,
    pub train_s: f64,
    pub lr: f32,
    pub last_epoch_loss: f32,
}

/// What [`run`] did.
#[derive(Debug, Clone, Serialize)]
pub struct NdpipeReport {
    /// `near-data` or `ship-images`.
    pub mode: String,
    pub dataset: String,
    pub backbone: ExtractorInfo,
    pub memservers: usize,
    pub classes: usize,
    pub chunks: Vec<ChunkReport>,
    pub held_out: usize,
    pub held_out_bytes: u64,
    pub held_out_extract_s: f64,
    /// Of the held-out samples with features (NaN when none).
    pub held_out_accuracy: f32,
    /// Every sample that could not be extracted.
    pub failed: Vec<SampleFailure>,
    /// Samples extracted, training and held-out.
    pub extracted: usize,
    /// All bytes of every chunk and the held-out samples.
    pub bytes: u64,
    /// Longest server's extraction wall time, from the start to its last reply.
    pub extract_wall_s: f64,
    /// `extracted / extract_wall_s` (NDPipe's throughput).
    pub extract_samples_per_s: f64,
    pub train_s: f64,
    /// From the start (after the lookup) to the evaluation.
    pub wall_s: f64,
}

impl NdpipeReport {
    /// One line per chunk, then the totals.
    pub fn render(&self) -> String {
        let mut s = format!(
            "ndpipe {} on dataset {} ({} memory servers, {} classes): backbone {}, {} features \
             at {}x{}\n",
            self.mode,
            self.dataset,
            self.memservers,
            self.classes,
            self.backbone.backbone,
            self.backbone.feature_dim,
            self.backbone.input,
            self.backbone.input
        );
        for c in &self.chunks {
            s += &format!(
                "chunk {}: {} samples ({} failed), extract {:.3}s, {} bytes, wait {:.3}s, \
                 train {:.3}s at lr {:.5}, loss {:.4}\n",
                c.chunk,
                c.samples,
                c.failed,
                c.extract_s,
                c.bytes,
                c.wait_s,
                c.train_s,
                c.lr,
                c.last_epoch_loss
            );
        }
        s += &format!(
            "held out: {} samples, {} bytes, extract {:.3}s, accuracy {:.4}\n",
            self.held_out, self.held_out_bytes, self.held_out_extract_s, self.held_out_accuracy
        );
        s += &format!(
            "total: {} samples extracted ({} failed), {} bytes, extraction {:.3}s ({:.1} \
             samples/s), training {:.3}s, wall {:.3}s\n",
            self.extracted,
            self.failed.len(),
            self.bytes,
            self.extract_wall_s,
            self.extract_samples_per_s,
            self.train_s,
            self.wall_s
        );
        s
    }
}

/// Looks the dataset up and runs NDPipe ([`run_located`]).
pub fn run(opts: &NdpipeOptions) -> anyhow::Result<NdpipeReport> {
    let located = crate::dataset::locate(&opts.controller, &opts.key, &opts.dataset)
        .with_context(|| format!("cannot locate dataset {}", opts.dataset))?;
    run_located(opts, located)
}

/// One memory server's share: its address, then per chunk (and last, the
/// held-out samples) the samples it extracts.
struct Share {
    memserver: u32,
    addr: String,
    /// `chunks + 1` lists: the training chunks, then the held-out samples.
    parts: Vec<Vec<SampleRef>>,
}

/// The held-out samples (a seeded `held_out` fraction of all of them) and
/// each memory server's training samples, shuffled (seeded) and cut into
/// `chunks` near-equal chunks. Deterministic given the seed and the
/// samples (whatever order they came in).
fn plan(mut located: Vec<Located>, chunks: usize, held_out: f64, seed: u64) -> Vec<Share> {
    located.sort_by_key(|l| (l.sample.sample, l.memserver));
    let mut rng = StdRng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..located.len()).collect();
    order.shuffle(&mut rng);
    let held = ((located.len() as f64) * held_out).round() as usize;
    let mut is_held = vec![false; located.len()];
    for &i in &order[..held.min(located.len())] {
        is_held[i] = true;
    }
    let mut by_server: BTreeMap<u32, (String, Vec<SampleRef>, Vec<SampleRef>)> = BTreeMap::new();
    for (l, held) in located.into_iter().zip(is_held) {
        let e = by_server
            .entry(l.memserver)
            .or_insert_with(|| (l.addr.clone(), Vec::new(), Vec::new()));
        if held {
            e.2.push(l.sample);
        } else {
            e.1.push(l.sample);
        }
    }
    by_server
        .into_iter()
        .map(|(memserver, (addr, mut train, held))| {
            train.shuffle(&mut rng);
            let n = train.len();
            let mut parts: Vec<Vec<SampleRef>> = (0..chunks)
                .map(|i| train[i * n / chunks..(i + 1) * n / chunks].to_vec())
                .collect();
            parts.push(held);
            Share {
                memserver,
                addr,
                parts,
            }
        })
        .collect()
}

/// One part's features from one server.
struct Part {
    features: Features,
    extract_s: f64,
    /// Since the run's start, when the server finished this part.
    done_s: f64,
}

/// How a worker turns samples into features.
trait Extract: Send {
    fn part(&mut self, samples: &[SampleRef]) -> anyhow::Result<Features>;
}

/// Near data: the memory server's backbone, asked for at most
/// `per_request` samples at a time (`extract_request_max` of its input).
struct Remote {
    client: SampleClient,
    per_request: usize,
}

impl Extract for Remote {
    fn part(&mut self, samples: &[SampleRef]) -> anyhow::Result<Features> {
        let mut all: Option<Features> = None;
        for req in samples.chunks(self.per_request) {
            let f = self.client.extract(req)?;
            match &mut all {
                None => all = Some(f),
                Some(a) => {
                    ensure!(
                        a.feature_dim == f.feature_dim,
                        "{}: features of {} then {} values",
                        self.client.addr(),
                        a.feature_dim,
                        f.feature_dim
                    );
                    a.samples.extend(f.samples);
                    a.values.extend(f.values);
                    a.labels.extend(f.labels);
                    a.failed.extend(f.failed);
                    a.wire_bytes += f.wire_bytes;
                }
            }
        }
        Ok(all.unwrap_or_else(|| Features::empty(0)))
    }
}

/// The baseline: fetch files, decode and run the backbone here.
struct Local {
    client: SampleClient,
    backbone: Arc<Backbone>,
    seed: u64,
}

impl Extract for Local {
    fn part(&mut self, samples: &[SampleRef]) -> anyhow::Result<Features> {
        let side = self.backbone.side() as u32;
        let dim = self.backbone.feature_dim();
        let mut out = Features::empty(dim);
        for req in samples.chunks(extract_request_max(side)) {
            let mut inputs = Vec::new();
            for s in req {
                let file = self.client.prep(s, 0, self.seed)?;
                out.wire_bytes += file.len() as u64;
                let t = SampleFormat::from_name(&s.format).and_then(|f| {
                    eval_tensor(&file, f, side, &PrepConfig::default()).map_err(|e| e.to_string())
                });
                match t {
                    Ok(t) => {
                        inputs.extend_from_slice(&t);
                        out.samples.push(s.sample);
                        out.labels.push(s.label);
                    }
                    Err(why) => out.failed.push(SampleFailure {
                        sample: s.sample,
                        why: format!("sample {}: {why}", s.sample),
                    }),
                }
            }
            let n = inputs.len() / self.backbone.image_len();
            if n > 0 {
                let f = self
                    .backbone
                    .forward(&inputs, n)
                    .map_err(|e| anyhow::anyhow!("the local backbone failed: {e}"))?;
                // Through f16, as the memory servers ship them.
                out.values
                    .extend(f16_le_to_f32(&f32_to_f16_le(&f)).expect("whole f16 values"));
            }
        }
        Ok(out)
    }
}

/// Runs NDPipe over samples already located (see the module doc).
pub fn run_located(opts: &NdpipeOptions, located: Vec<Located>) -> anyhow::Result<NdpipeReport> {
    ensure!(opts.chunks >= 1, "--chunks must be at least 1");
    ensure!(
        (0.0..1.0).contains(&opts.held_out),
        "--held-out {} must be in [0, 1)",
        opts.held_out
    );
    ensure!(
        !located.is_empty(),
        "dataset {} has no samples",
        opts.dataset
    );
    let classes = located.iter().map(|l| l.sample.label).max().unwrap_or(0) as usize + 1;
    let r = opts.chunks;
    let shares = plan(located, r, opts.held_out, opts.head.seed);

    // The backbone: the memory servers' (checked to agree), or ours.
    let (local, mode_name) = match &opts.mode {
        Mode::ShipImages { backbone, input } => (
            Some(Arc::new(Backbone::open(backbone, *input).with_context(
                || format!("cannot open backbone {}", backbone.display()),
            )?)),
            "ship-images",
        ),
        Mode::NearData { .. } => (None, "near-data"),
    };
    let expected = match &opts.mode {
        Mode::NearData {
            check: Some((dir, input)),
        } => Some(
            Backbone::open(dir, *input)
                .with_context(|| format!("cannot open backbone {}", dir.display()))?
                .info(),
        ),
        _ => None,
    };
    let mut clients = Vec::with_capacity(shares.len());
    let mut info: Option<ExtractorInfo> = local.as_ref().map(|b| b.info());
    for s in &shares {
        let mut c =
            SampleClient::connect(&s.addr, &opts.key, CONNECT_TIMEOUT).with_context(|| {
                format!(
                    "cannot open a sample connection to memory server {} ({})",
                    s.memserver, s.addr
                )
            })?;
        if local.is_none() {
            let (_, theirs) = c.info()?;
            let Some(theirs) = theirs else {
                bail!(
                    "memory server {} ({}) runs no backbone: start it with --backbone DIR, or \
                     use --ship-images",
                    s.memserver,
                    s.addr
                );
            };
            if let Some(want) = &expected {
                ensure!(
                    &theirs == want,
                    "memory server {} ({}) runs backbone {theirs:?}, expected {want:?}",
                    s.memserver,
                    s.addr
                );
            }
            match &info {
                Some(i) => ensure!(
                    i == &theirs,
                    "memory servers run different backbones: {i:?} and {theirs:?} ({})",
                    s.addr
                ),
                None => info = Some(theirs),
            }
        }
        clients.push(c);
    }
    let info = info.context("no memory server holds samples")?;
    let dim = info.feature_dim as usize;

    let start = Instant::now();
    let mut receivers = Vec::with_capacity(shares.len());
    let mut handles = Vec::with_capacity(shares.len());
    for (share, client) in shares.into_iter().zip(clients) {
        let (tx, rx) = std::sync::mpsc::channel::<anyhow::Result<Part>>();
        let mut ex: Box<dyn Extract> = match &local {
            Some(b) => Box::new(Local {
                client,
                backbone: b.clone(),
                seed: opts.head.seed,
            }),
            None => Box::new(Remote {
                client,
                per_request: extract_request_max(info.input),
            }),
        };
        let name = format!("ndpipe-{}", share.memserver);
        let h = std::thread::Builder::new().name(name).spawn(move || {
            for part in &share.parts {
                let t = Instant::now();
                let r = ex.part(part).map(|features| Part {
                    features,
                    extract_s: t.elapsed().as_secs_f64(),
                    done_s: start.elapsed().as_secs_f64(),
                });
                let failed = r.is_err();
                let r = r
                    .with_context(|| format!("memory server {} ({})", share.memserver, share.addr));
                // The trainer hung up: it failed already.
                if tx.send(r).is_err() || failed {
                    return;
                }
            }
        })?;
        receivers.push(rx);
        handles.push(h);
    }

    let mut head = Head::new(dim, classes, opts.head.seed);
    let mut chunks = Vec::with_capacity(r);
    let mut failed = Vec::new();
    let mut extracted = 0usize;
    let mut bytes = 0u64;
    let mut extract_wall_s = 0f64;
    let mut train_s = 0f64;
    // Every part in order: the chunks, then the held-out samples.
    let mut gather = |failed: &mut Vec<SampleFailure>| -> anyhow::Result<(Features, f64, f64)> {
        let waited = Instant::now();
        let mut all = Features::empty(dim);
        let mut extract_s = 0f64;
        for rx in &receivers {
            let p = rx
                .recv()
                .context("a memory server's extraction thread ended early")??;
            let f = p.features;
            ensure!(
                f.samples.is_empty() || f.feature_dim == dim,
                "features of {} values, the backbone gives {dim}",
                f.feature_dim
            );
            extract_s = extract_s.max(p.extract_s);
            extract_wall_s = extract_wall_s.max(p.done_s);
            extracted += f.samples.len();
            bytes += f.wire_bytes;
            all.samples.extend(f.samples);
            all.values.extend(f.values);
            all.labels.extend(f.labels);
            all.wire_bytes += f.wire_bytes;
            failed.extend(f.failed.iter().cloned());
            all.failed.extend(f.failed);
        }
        Ok((all, extract_s, waited.elapsed().as_secs_f64()))
    };
    for i in 0..r {
        let (f, extract_s, wait_s) = gather(&mut failed)?;
        let t = Instant::now();
        let stats = head
            .fine_tune_chunk(i, r, &f.values, &f.labels, &opts.head)
            .map_err(|e| anyhow::anyhow!("chunk {i}: {e}"))?;
        let secs = t.elapsed().as_secs_f64();
        train_s += secs;
        chunks.push(ChunkReport {
            chunk: i,
            samples: f.samples.len(),
            failed: f.failed.len(),
            extract_s,
            bytes: f.wire_bytes,
            wait_s,
            train_s: secs,
            lr: stats.lr,
            last_epoch_loss: stats.last_epoch_loss,
        });
    }
    let (held, held_out_extract_s, _) = gather(&mut failed)?;
    let held_out_accuracy = head
        .accuracy(&held.values, &held.labels)
        .map_err(|e| anyhow::anyhow!("held-out samples: {e}"))?;
    let wall_s = start.elapsed().as_secs_f64();
    for h in handles {
        let _ = h.join();
    }
    Ok(NdpipeReport {
        mode: mode_name.into(),
        dataset: opts.dataset.clone(),
        backbone: info,
        memservers: receivers.len(),
        classes,
        chunks,
        held_out: held.samples.len(),
        held_out_bytes: held.wire_bytes,
        held_out_extract_s,
        held_out_accuracy,
        failed,
        extracted,
        bytes,
        extract_wall_s,
        extract_samples_per_s: if extract_wall_s > 0.0 {
            extracted as f64 / extract_wall_s
        } else {
            0.0
        },
        train_s,
        wall_s,
    })
}

/// `distmind ndpipe`.
#[derive(Debug, clap::Args)]
pub struct NdpipeCmd {
    /// Settings directory (cluster.key, storage_list.txt for the controller's address).
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// Controller metadata address (default: first line of storage_list.txt).
    #[arg(long)]
    pub controller: Option<String>,
    /// The dataset (as `distmind dataset put` named it).
    #[arg(long)]
    pub dataset: String,
    /// The backbone's model package: with --ship-images it runs here; otherwise every memory
    /// server's backbone is checked to be this package at --input (optional then).
    #[arg(long)]
    pub backbone: Option<PathBuf>,
    /// The backbone's input side (as the memory servers' --backbone-input).
    #[arg(long, default_value_t = BACKBONE_INPUT_DEFAULT)]
    pub input: u32,
    /// R: the training samples are extracted and fine-tuned on in this many pipelined chunks.
    #[arg(long, default_value_t = 4)]
    pub chunks: usize,
    /// Epochs over each chunk.
    #[arg(long, default_value_t = 10)]
    pub epochs: usize,
    /// Base learning rate; chunk i of R trains at lr (R - i/2) / R.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f32,
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    /// Minibatch size of the head's SGD.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Fraction of the samples held out and evaluated at the end.
    #[arg(long, default_value_t = 0.1)]
    pub held_out: f64,
    /// Seeds the held-out choice, the chunks, the head's weights and its epochs' orders.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Baseline: fetch every sample's file and run the backbone here (needs --backbone).
    #[arg(long)]
    pub ship_images: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `distmind ndpipe` and prints its report.
pub fn run_cmd(cmd: &NdpipeCmd) -> anyhow::Result<()> {
    let settings = crate::services::load_settings(&cmd.settings)?;
    let controller = cmd
        .controller
        .clone()
        .unwrap_or_else(|| settings.metadata_endpoint().to_string());
    let mode = match (&cmd.backbone, cmd.ship_images) {
        (Some(dir), true) => Mode::ShipImages {
            backbone: dir.clone(),
            input: cmd.input,
        },
        (None, true) => bail!("--ship-images runs the backbone here: name it with --backbone DIR"),
        (dir, false) => Mode::NearData {
            check: dir.clone().map(|d| (d, cmd.input)),
        },
    };
    let opts = NdpipeOptions {
        controller,
        key: crate::services::cluster_key(&settings),
        dataset: cmd.dataset.clone(),
        chunks: cmd.chunks,
        held_out: cmd.held_out,
        head: HeadConfig {
            epochs: cmd.epochs,
            lr: cmd.lr,
            momentum: cmd.momentum,
            weight_decay: 0.0,
            batch: cmd.batch,
            seed: cmd.seed,
        },
        mode,
    };
    let report = run(&opts)?;
    if cmd.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(())
}
