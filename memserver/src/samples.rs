//! The sample service: one connection of role `Sample` (JSON
//! [`SampleRequest`]s, each answered by a [`SampleReply`] and, for `Prepped`
//! and `Extracted`, one `Bytes` frame). Samples are read in place from the
//! arena under a read lease, exactly like the data path reads them.
//!
//! Preprocessing and feature extraction run on the server's own pool of
//! `--prep-workers` threads (`PrepPool`), never on the tasks that serve
//! reads: a slow decode delays only the sample requests queued behind it.
//! Requests wait for a queue slot (bounded), so a client that sends faster
//! than the workers decode is slowed down, not buffered without limit.
//!
//! A sample that cannot be processed (a corrupt JPEG, a `.npy` asked for an
//! image step) gets an error naming its index; the connection goes on.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{ErrorCode, ErrorReply};
use distmind_common::samples::{
    extract_request_max, ExtractorInfo, SampleCost, SampleFailure, SampleRef, SampleReply,
    SampleRequest, PREP_STEPS, SAMPLES_PER_REQUEST_MAX, SAMPLE_BYTES_MAX,
};
use distmind_common::wire::{self, FrameKind};
use distmind_data::format::SampleFormat;
use distmind_data::prep::{self, PrepConfig, Prepped};
use log::{debug, warn};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch, Semaphore};

use crate::arena::ReadLease;
use crate::server::Shared;

/// Jobs queued per preprocessing worker before requests wait for a slot.
pub const PREP_QUEUE_PER_WORKER: usize = 4;
/// The most preprocessing workers a memory server runs.
pub const PREP_WORKERS_MAX: usize = 256;

/// A frozen backbone a memory server runs next to its samples (NDPipe):
/// images in, one feature vector per image out.
pub trait FeatureExtractor: Send + Sync + std::fmt::Debug + 'static {
    /// Which backbone, its feature width and its input side.
    fn info(&self) -> ExtractorInfo;
    /// `inputs` holds `n` images of `3 x input x input` f32 (normalised,
    /// channel-major), one after another; returns `n x feature_dim` f32.
    fn extract(&self, inputs: &[f32], n: usize) -> Result<Vec<f32>, String>;
}

type Job = Box<dyn FnOnce() + Send>;

/// The preprocessing workers: `workers` threads fed by one channel, with at
/// most `workers x PREP_QUEUE_PER_WORKER` jobs queued or running.
#[derive(Debug)]
pub(crate) struct PrepPool {
    tx: crossbeam::channel::Sender<Job>,
    slots: Arc<Semaphore>,
    workers: usize,
}

/// A job's result, once a worker has run it.
type Pending<T> = oneshot::Receiver<std::thread::Result<T>>;

impl PrepPool {
    pub fn new(workers: usize) -> std::io::Result<PrepPool> {
        let (tx, rx) = crossbeam::channel::unbounded::<Job>();
        for i in 0..workers {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("prep-{i}"))
                // Ends when the pool (the only sender) is dropped.
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })?;
        }
        Ok(PrepPool {
            tx,
            slots: Arc::new(Semaphore::new(workers * PREP_QUEUE_PER_WORKER)),
            workers,
        })
    }

    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Queues `f` once a slot is free (the slot is held until `f` returns);
    /// a panic in `f` is caught, and the worker lives on.
    async fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Pending<T> {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        let (done_tx, done_rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            drop(slot);
            let _ = done_tx.send(r);
        });
        // The workers hold the receiver as long as the pool lives.
        let _ = self.tx.send(job);
        done_rx
    }

    /// Runs `f` on a worker and waits for it.
    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, String> {
        finish(self.submit(f).await).await
    }
}

async fn finish<T>(pending: Pending<T>) -> Result<T, String> {
    match pending.await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err("a preprocessing worker panicked on this sample".into()),
        Err(_) => Err("the preprocessing worker dropped the job".into()),
    }
}

fn op_of(req: &SampleRequest) -> &'static str {
    match req {
        SampleRequest::Prep { .. } => "prep",
        SampleRequest::Profile { .. } => "profile",
        SampleRequest::Extract { .. } => "extract",
        SampleRequest::Info => "info",
    }
}

/// What one request produced: a reply and, maybe, the bytes that follow it.
struct Answer {
    reply: SampleReply,
    bytes: Option<Vec<u8>>,
}

impl Answer {
    fn error(code: ErrorCode, message: impl Into<String>) -> Answer {
        Answer {
            reply: SampleReply::Error(ErrorReply::new(code, message)),
            bytes: None,
        }
    }
}

pub(crate) async fn serve(
    shared: &Shared,
    mut stream: TcpStream,
    peer: SocketAddr,
    stop: &mut watch::Receiver<bool>,
) {
    debug!("sample connection from {peer}");
    loop {
        let frame = tokio::select! {
            biased;
            _ = stop.wait_for(|&s| s) => return,
            f = wire::read_frame(&mut stream, CONTROL_FRAME_BYTES_MAX) => f,
        };
        let (op, answer) = match frame {
            Ok(None) => return,
            Ok(Some((FrameKind::Message, payload))) => {
                match wire::decode_message::<SampleRequest>(&payload) {
                    Ok(req) => {
                        let op = op_of(&req);
                        (op, handle(shared, req).await)
                    }
                    Err(e) => (
                        "invalid",
                        Answer::error(ErrorCode::BadRequest, format!("not a sample request: {e}")),
                    ),
                }
            }
            Ok(Some((kind, _))) => (
                "invalid",
                Answer::error(
                    ErrorCode::BadRequest,
                    format!("a sample connection takes JSON requests only, not {kind:?} frames"),
                ),
            ),
            Err(e) => {
                warn!("sample connection from {peer}: {e}; closing it");
                let a = Answer::error(ErrorCode::BadRequest, e.to_string());
                let _ = wire::send_message(&mut stream, &a.reply).await;
                crate::server::close_after_error(&mut stream).await;
                return;
            }
        };
        let status: Cow<'static, str> = match &answer.reply {
            SampleReply::Error(e) => Cow::Owned(e.code.as_str().to_string()),
            _ => Cow::Borrowed("ok"),
        };
        shared.metrics.sample_request(op, status);
        if let Err(e) = send(shared, &mut stream, op, answer).await {
            debug!("sample connection from {peer} closed during a reply: {e}");
            return;
        }
    }
}

/// Sends a reply and its bytes; the bytes wait for the host's NIC bucket
/// (an emulated link) like every data-path reply does.
async fn send(
    shared: &Shared,
    stream: &mut TcpStream,
    op: &'static str,
    answer: Answer,
) -> Result<(), wire::WireError> {
    wire::send_message(stream, &answer.reply).await?;
    if let Some(bytes) = answer.bytes {
        if let Some(nic) = &shared.nic {
            let wait = nic.reserve(bytes.len() as u64);
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
        }
        wire::write_frame(stream, FrameKind::Bytes, &[&bytes]).await?;
        stream.flush().await?;
        shared
            .metrics
            .sample_bytes_sent
            .get_or_create(&crate::metrics::SampleOpLabel { op })
            .inc_by(bytes.len() as u64);
    }
    Ok(())
}

/// The arena bytes of one sample, leased, with its format parsed.
fn lease(shared: &Shared, s: &SampleRef) -> Result<(ReadLease, SampleFormat), String> {
    if s.len == 0 || s.len > SAMPLE_BYTES_MAX {
        return Err(format!(
            "sample {}: {} bytes; a sample holds 1 to {SAMPLE_BYTES_MAX} bytes",
            s.sample, s.len
        ));
    }
    let format =
        SampleFormat::from_name(&s.format).map_err(|e| format!("sample {}: {e}", s.sample))?;
    let lease = shared.arena.read(s.offset, s.len).map_err(|e| {
        format!(
            "sample {}: no committed bytes at arena offset {} (+{}): {e}",
            s.sample, s.offset, s.len
        )
    })?;
    Ok((lease, format))
}

fn count(shared: &Shared, op: &'static str, processed: usize, failed: usize) {
    let label = crate::metrics::SampleOpLabel { op };
    shared
        .metrics
        .samples_processed
        .get_or_create(&label)
        .inc_by(processed as u64);
    if failed > 0 {
        shared
            .metrics
            .samples_failed
            .get_or_create(&label)
            .inc_by(failed as u64);
    }
}

async fn handle(shared: &Shared, req: SampleRequest) -> Answer {
    match req {
        SampleRequest::Info => Answer {
            reply: SampleReply::Info {
                prep_workers: shared.prep.workers() as u32,
                extractor: shared.extractor.as_ref().map(|x| x.info()),
            },
            bytes: None,
        },
        SampleRequest::Prep {
            sample,
            steps,
            seed,
        } => prep_one(shared, sample, steps, seed).await,
        SampleRequest::Profile { samples, seed } => profile(shared, samples, seed).await,
        SampleRequest::Extract { samples } => extract(shared, samples).await,
    }
}

async fn prep_one(shared: &Shared, s: SampleRef, steps: u8, seed: u64) -> Answer {
    if usize::from(steps) > PREP_STEPS {
        return Answer::error(
            ErrorCode::BadRequest,
            format!(
                "sample {}: steps {steps}: there are {PREP_STEPS} preprocessing steps",
                s.sample
            ),
        );
    }
    let (lease, format) = match lease(shared, &s) {
        Ok(l) => l,
        Err(e) => return Answer::error(ErrorCode::BadRequest, e),
    };
    let id = s.sample;
    let out = shared
        .prep
        .run(move || -> Result<Vec<u8>, String> {
            if steps == 0 {
                return Ok(lease.bytes().to_vec());
            }
            let input = Prepped::Encoded {
                format,
                bytes: lease.bytes().to_vec(),
            };
            drop(lease);
            prep::run(input, 0, usize::from(steps), &PrepConfig::default(), seed)
                .map(|p| p.to_bytes_k(usize::from(steps)))
                .map_err(|e| e.to_string())
        })
        .await
        .and_then(|r| r);
    match out {
        Ok(bytes) => {
            count(shared, "prep", 1, 0);
            Answer {
                reply: SampleReply::Prepped {
                    sample: id,
                    steps,
                    bytes: bytes.len() as u64,
                },
                bytes: Some(bytes),
            }
        }
        Err(e) => {
            count(shared, "prep", 0, 1);
            Answer::error(ErrorCode::BadRequest, format!("sample {id}: {e}"))
        }
    }
}

fn check_batch(samples: &[SampleRef]) -> Result<(), Answer> {
    if samples.is_empty() || samples.len() > SAMPLES_PER_REQUEST_MAX {
        return Err(Answer::error(
            ErrorCode::BadRequest,
            format!(
                "{} samples: a request names 1 to {SAMPLES_PER_REQUEST_MAX}",
                samples.len()
            ),
        ));
    }
    Ok(())
}

/// Runs `f` on every sample on the pool, as many at once as the pool's
/// slots allow; results in request order.
async fn per_sample<T: Send + 'static>(
    shared: &Shared,
    samples: &[SampleRef],
    f: impl Fn(ReadLease, SampleFormat) -> Result<T, String> + Send + Sync + Clone + 'static,
) -> Vec<Result<T, SampleFailure>> {
    let mut queued = Vec::with_capacity(samples.len());
    for s in samples {
        queued.push(match lease(shared, s) {
            Ok((l, format)) => {
                let f = f.clone();
                Ok(shared.prep.submit(move || f(l, format)).await)
            }
            Err(why) => Err(why),
        });
    }
    let mut out = Vec::with_capacity(samples.len());
    for (s, q) in samples.iter().zip(queued) {
        let id = s.sample;
        let r = match q {
            Ok(pending) => finish(pending)
                .await
                .and_then(|r| r)
                .map_err(|why| format!("sample {id}: {why}")),
            Err(why) => Err(why),
        };
        out.push(r.map_err(|why| SampleFailure { sample: id, why }));
    }
    out
}

async fn profile(shared: &Shared, samples: Vec<SampleRef>, seed: u64) -> Answer {
    if let Err(a) = check_batch(&samples) {
        return a;
    }
    let results = per_sample(shared, &samples, move |l, format| {
        let costs = prep::profile(l.bytes(), format, &PrepConfig::default(), seed)
            .map_err(|e| e.to_string())?;
        Ok((l.len(), costs))
    })
    .await;
    let mut costs = Vec::new();
    let mut failed = Vec::new();
    for (s, r) in samples.iter().zip(results) {
        match r {
            Ok((raw, c)) => {
                // c[0] is the raw file; c[k] is step k's output.
                let mut bytes_after = [0u64; PREP_STEPS];
                let mut step_s = [0f64; PREP_STEPS];
                for k in 0..PREP_STEPS {
                    bytes_after[k] = c[k + 1].bytes_after;
                    step_s[k] = c[k + 1].secs;
                }
                costs.push(SampleCost {
                    sample: s.sample,
                    raw_bytes: raw,
                    bytes_after,
                    step_s,
                });
            }
            Err(f) => failed.push(f),
        }
    }
    count(shared, "profile", costs.len(), failed.len());
    Answer {
        reply: SampleReply::Profiled { costs, failed },
        bytes: None,
    }
}

async fn extract(shared: &Shared, samples: Vec<SampleRef>) -> Answer {
    let Some(extractor) = shared.extractor.clone() else {
        return Answer::error(
            ErrorCode::Unsupported,
            "this memory server runs no backbone: start it with --backbone DIR to extract features",
        );
    };
    if let Err(a) = check_batch(&samples) {
        return a;
    }
    let info = extractor.info();
    let side = info.input;
    let most = extract_request_max(side);
    if samples.len() > most {
        return Answer::error(
            ErrorCode::BadRequest,
            format!(
                "{} samples: at this backbone's {side} x {side} input a request names at most {most}",
                samples.len()
            ),
        );
    }
    let started = Instant::now();
    let results = per_sample(shared, &samples, move |l, format| {
        prep::eval_tensor(l.bytes(), format, side, &PrepConfig::default())
            .map_err(|e| e.to_string())
    })
    .await;
    let mut ids = Vec::new();
    let mut labels = Vec::new();
    let mut inputs = Vec::new();
    let mut failed = Vec::new();
    for (s, r) in samples.iter().zip(results) {
        match r {
            Ok(t) => {
                ids.push(s.sample);
                labels.push(s.label);
                inputs.extend_from_slice(&t);
            }
            Err(f) => failed.push(f),
        }
    }
    let n = ids.len();
    let dim = info.feature_dim as usize;
    let features = if n == 0 {
        Ok(Vec::new())
    } else {
        let x = extractor.clone();
        shared
            .prep
            .run(move || x.extract(&inputs, n))
            .await
            .and_then(|r| r)
    };
    let features = match features {
        Ok(f) if f.len() == n * dim => f,
        Ok(f) => {
            return Answer::error(
                ErrorCode::Internal,
                format!(
                    "the backbone returned {} values for {n} samples of {dim} features",
                    f.len()
                ),
            )
        }
        Err(e) => return Answer::error(ErrorCode::Internal, format!("the backbone failed: {e}")),
    };
    let mut bytes = prep::f32_to_f16_le(&features);
    for l in &labels {
        bytes.extend_from_slice(&l.to_le_bytes());
    }
    count(shared, "extract", n, failed.len());
    debug!(
        "extracted {n} samples ({} failed) in {:.3}s",
        failed.len(),
        started.elapsed().as_secs_f64()
    );
    Answer {
        reply: SampleReply::Extracted {
            samples: ids,
            feature_dim: info.feature_dim,
            bytes: bytes.len() as u64,
            failed,
        },
        bytes: Some(bytes),
    }
}
