//! The training data loader: samples of a dataset on the memory servers,
//! each fetched after the number of preprocessing steps its plan gives
//! (`k`: the memory server runs steps `1..=k`, see
//! `distmind_controller::prep`), the remaining steps run here, and batches of
//! normalised `3 x crop x crop` images handed to the consumer (a training
//! stage).
//!
//! Threads: `connections` fetchers per memory server, each with its own
//! sample connection, taking that server's samples from two shared queues
//! (files, and samples the server preprocesses; each fetcher prefers one,
//! in turn, so a sample waiting for the server's workers never stalls the
//! files behind it); the
//! local steps run on the fetcher that received the bytes (the trainer's
//! CPUs); one batcher thread groups finished samples. Every queue between
//! them is bounded (`prefetch_batches` batches of samples), so a slow
//! consumer stops the fetches instead of buffering an epoch.
//!
//! A sample's random crop and flip depend only on the epoch seed and the
//! sample's index, so the same sample comes out bit-identical whatever its
//! `k`: where a step runs changes the bytes on the wire, never the data.
//!
//! A sample that fails (a corrupt JPEG, a sample the memory server cannot
//! read) is reported with its index; by [`OnBadSample`] it is skipped (and
//! listed in its batch's `skipped`) or fails its batch.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{bounded, Receiver, Sender};
use distmind_common::handshake::ClusterKey;
use distmind_common::samples::{SampleFailure, SampleRef, PREP_STEPS};
use distmind_data::prep::{self, PrepConfig, Prepped};
use distmind_memserver::SampleClient;

/// The most fetcher connections per memory server.
pub const CONNECTIONS_MAX: usize = 64;
/// The most batches queued ahead of the consumer.
pub const PREFETCH_BATCHES_MAX: usize = 64;

/// What to do with a sample that cannot be loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnBadSample {
    /// Leave it out of its batch (it is listed in `Batch::skipped`).
    Skip,
    /// Fail the batch it would have been in.
    FailBatch,
}

#[derive(Debug, Clone)]
pub struct LoaderConfig {
    pub batch: usize,
    pub prefetch_batches: usize,
    /// Sample connections (and fetcher threads) per memory server.
    pub connections: usize,
    /// The epoch's seed: every sample's crop and flip derive from it.
    pub seed: u64,
    pub on_bad_sample: OnBadSample,
    pub prep: PrepConfig,
    pub timeout: Duration,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            batch: 32,
            prefetch_batches: 4,
            connections: 4,
            seed: 0,
            on_bad_sample: OnBadSample::Skip,
            prep: PrepConfig::default(),
            timeout: Duration::from_secs(30),
        }
    }
}

/// One sample to load: where it is, and the steps its memory server runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedSample {
    pub addr: String,
    pub sample: SampleRef,
    /// 0 (the file) to [`PREP_STEPS`].
    pub steps: u8,
}

/// A batch: `labels.len()` images of `3 x crop x crop` f32, in `images`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub images: Vec<f32>,
    pub labels: Vec<u32>,
    pub samples: Vec<u64>,
    /// Samples of this batch left out ([`OnBadSample::Skip`]).
    pub skipped: Vec<SampleFailure>,
}

#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error("loader configuration: {0}")]
    Config(String),
    #[error("batch {batch}: {failure}")]
    BadSample { batch: usize, failure: String },
    #[error("memory server {addr}: {why}")]
    Server { addr: String, why: String },
}

/// Counters of an epoch so far.
#[derive(Debug, Default)]
pub struct LoaderStats {
    /// Bytes of samples received (the sample service's data frames).
    pub bytes_received: AtomicU64,
    pub samples: AtomicU64,
    pub skipped: AtomicU64,
    /// Nanoseconds the trainer's CPUs spent on the local steps.
    pub local_prep_ns: AtomicU64,
}

/// A sample finished (or failed) by a fetcher.
type Done = Result<(u64, u32, Vec<f32>), SampleFailure>;

/// One epoch over `plan`'s samples, in its order (batches fill in the order
/// samples finish).
pub struct Loader {
    /// `None` only while dropping.
    batches: Option<Receiver<Result<Batch, LoaderError>>>,
    stats: Arc<LoaderStats>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Loader {
    pub fn start(
        plan: Vec<PlannedSample>,
        key: &ClusterKey,
        cfg: LoaderConfig,
    ) -> Result<Loader, LoaderError> {
        if cfg.batch == 0 {
            return Err(LoaderError::Config("batch must be at least 1".into()));
        }
        if !(1..=PREFETCH_BATCHES_MAX).contains(&cfg.prefetch_batches) {
            return Err(LoaderError::Config(format!(
                "prefetch_batches must be 1 to {PREFETCH_BATCHES_MAX}"
            )));
        }
        if !(1..=CONNECTIONS_MAX).contains(&cfg.connections) {
            return Err(LoaderError::Config(format!(
                "connections must be 1 to {CONNECTIONS_MAX}"
            )));
        }
        if let Some(p) = plan.iter().find(|p| usize::from(p.steps) > PREP_STEPS) {
            return Err(LoaderError::Config(format!(
                "sample {}: {} steps planned; there are {PREP_STEPS}",
                p.sample.sample, p.steps
            )));
        }
        let total = plan.len();
        let stats = Arc::new(LoaderStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (done_tx, done_rx) = bounded::<Done>(cfg.batch * cfg.prefetch_batches);
        let (batch_tx, batch_rx) = bounded(cfg.prefetch_batches);
        let mut per_server: BTreeMap<String, Vec<PlannedSample>> = BTreeMap::new();
        for p in plan {
            per_server.entry(p.addr.clone()).or_default().push(p);
        }
        let mut threads = Vec::new();
        for (addr, samples) in per_server {
            // Files and preprocessed samples queue apart, and fetchers
            // prefer one or the other in turn: a sample waiting for the
            // memory server's workers never holds back the files behind it.
            let (prepped, files): (Vec<_>, Vec<_>) = samples.into_iter().partition(|p| p.steps > 0);
            let queues = [
                Arc::new(Mutex::new(files.into_iter())),
                Arc::new(Mutex::new(prepped.into_iter())),
            ];
            for c in 0..cfg.connections {
                let f = Fetcher {
                    addr: addr.clone(),
                    key: key.clone(),
                    queues: queues.clone(),
                    prefer: c % 2,
                    done: done_tx.clone(),
                    batches: batch_tx.clone(),
                    stats: stats.clone(),
                    stop: stop.clone(),
                    cfg: cfg.clone(),
                };
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("loader-{c}"))
                        .spawn(move || f.run())
                        .map_err(|e| LoaderError::Config(format!("cannot start a fetcher: {e}")))?,
                );
            }
        }
        drop(done_tx);
        let (b_stats, b_cfg) = (stats.clone(), cfg.clone());
        threads.push(
            std::thread::Builder::new()
                .name("loader-batch".into())
                .spawn(move || batcher(done_rx, batch_tx, total, &b_cfg, &b_stats))
                .map_err(|e| LoaderError::Config(format!("cannot start the batcher: {e}")))?,
        );
        Ok(Loader {
            batches: Some(batch_rx),
            stats,
            stop,
            threads,
        })
    }

    /// The next batch; `None` once the epoch is over.
    pub fn next_batch(&self) -> Option<Result<Batch, LoaderError>> {
        self.batches.as_ref()?.recv().ok()
    }

    pub fn stats(&self) -> &LoaderStats {
        &self.stats
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // Fetchers stop taking samples; the batcher's send fails once the
        // receiver is gone, which closes the fetchers' channel in turn: each
        // thread ends after at most the request it is in.
        self.stop.store(true, Ordering::Relaxed);
        drop(self.batches.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The seed of one sample's random steps in an epoch.
pub fn sample_seed(epoch_seed: u64, sample: u64) -> u64 {
    // SplitMix64's finaliser over the pair: distinct samples, distinct seeds.
    let mut z = epoch_seed ^ sample.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The steps left after the memory server's `k` (pure): the sample as
/// training sees it.
pub fn finish_sample(
    wire: &[u8],
    k: u8,
    format: distmind_data::format::SampleFormat,
    cfg: &PrepConfig,
    seed: u64,
) -> Result<Vec<f32>, String> {
    let input = if k == 0 {
        Prepped::Encoded {
            format,
            bytes: wire.to_vec(),
        }
    } else {
        Prepped::from_bytes(usize::from(k), wire).map_err(|e| e.to_string())?
    };
    match prep::run(input, usize::from(k), PREP_STEPS, cfg, seed).map_err(|e| e.to_string())? {
        Prepped::Tensor { data, .. } => Ok(data),
        other => Err(format!(
            "the last step gave {:?}, not a tensor",
            std::mem::discriminant(&other)
        )),
    }
}

struct Fetcher {
    addr: String,
    key: ClusterKey,
    /// This server's files (k = 0) and samples it preprocesses (k > 0).
    queues: [Arc<Mutex<std::vec::IntoIter<PlannedSample>>>; 2],
    /// The queue this fetcher takes from first.
    prefer: usize,
    done: Sender<Done>,
    batches: Sender<Result<Batch, LoaderError>>,
    stats: Arc<LoaderStats>,
    stop: Arc<AtomicBool>,
    cfg: LoaderConfig,
}

impl Fetcher {
    fn next(&self) -> Option<PlannedSample> {
        if self.stop.load(Ordering::Relaxed) {
            return None;
        }
        let take = |q: &Mutex<std::vec::IntoIter<PlannedSample>>| {
            q.lock().unwrap_or_else(|p| p.into_inner()).next()
        };
        take(&self.queues[self.prefer]).or_else(|| take(&self.queues[1 - self.prefer]))
    }

    /// Without its connection this server's samples cannot load: say so
    /// once and stop every fetcher; the batcher ends the epoch short.
    fn lost(&self, e: distmind_memserver::ClientError) {
        let _ = self.batches.send(Err(LoaderError::Server {
            addr: self.addr.clone(),
            why: e.to_string(),
        }));
        self.stop.store(true, Ordering::Relaxed);
    }

    fn run(self) {
        let mut client = match SampleClient::connect(&self.addr, &self.key, self.cfg.timeout) {
            Ok(c) => c,
            Err(e) => return self.lost(e),
        };
        while let Some(p) = self.next() {
            let id = p.sample.sample;
            let seed = sample_seed(self.cfg.seed, id);
            let fail = |why: String| SampleFailure { sample: id, why };
            let out = match client.prep(&p.sample, p.steps, seed) {
                Ok(wire) => {
                    self.stats
                        .bytes_received
                        .fetch_add(wire.len() as u64, Ordering::Relaxed);
                    let t = Instant::now();
                    let r = distmind_data::format::SampleFormat::from_name(&p.sample.format)
                        .and_then(|f| finish_sample(&wire, p.steps, f, &self.cfg.prep, seed));
                    self.stats
                        .local_prep_ns
                        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    r.map(|img| (id, p.sample.label, img))
                        .map_err(|e| fail(format!("sample {id}: {e}")))
                }
                // The server refused this sample (corrupt, unreadable): the
                // connection is still good.
                Err(e) if e.server_error().is_some() => Err(fail(e.to_string())),
                Err(e) => return self.lost(e),
            };
            if self.done.send(out).is_err() {
                return;
            }
        }
    }
}

fn batcher(
    done: Receiver<Done>,
    out: Sender<Result<Batch, LoaderError>>,
    total: usize,
    cfg: &LoaderConfig,
    stats: &LoaderStats,
) {
    let empty = || Batch {
        images: Vec::new(),
        labels: Vec::new(),
        samples: Vec::new(),
        skipped: Vec::new(),
    };
    let mut b = empty();
    let mut failed: Option<String> = None;
    let mut seen = 0usize;
    let mut index = 0usize;
    for d in done.iter() {
        seen += 1;
        match d {
            Ok((id, label, img)) => {
                b.images.extend_from_slice(&img);
                b.labels.push(label);
                b.samples.push(id);
                stats.samples.fetch_add(1, Ordering::Relaxed);
            }
            Err(f) => {
                stats.skipped.fetch_add(1, Ordering::Relaxed);
                if cfg.on_bad_sample == OnBadSample::FailBatch && failed.is_none() {
                    failed = Some(f.why.clone());
                }
                b.skipped.push(f);
            }
        }
        let full = b.labels.len() + b.skipped.len() >= cfg.batch;
        if full || seen == total {
            let batch = std::mem::replace(&mut b, empty());
            let r = match failed.take() {
                Some(failure) => Err(LoaderError::BadSample {
                    batch: index,
                    failure,
                }),
                None => Ok(batch),
            };
            index += 1;
            if out.send(r).is_err() {
                return;
            }
        }
    }
    if !b.labels.is_empty() || !b.skipped.is_empty() {
        let _ = out.send(Ok(b));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_seeds_differ_by_sample_and_epoch() {
        let a = sample_seed(1, 0);
        assert_ne!(a, sample_seed(1, 1));
        assert_ne!(a, sample_seed(2, 0));
        assert_eq!(a, sample_seed(1, 0));
    }
}
