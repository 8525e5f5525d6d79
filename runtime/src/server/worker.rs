//! One device's worker thread: takes jobs from the device's bounded queue,
//! resolves the model through the controller's catalog, runs the pipeline
//! and sends the reply (message and output frames, already encoded) back to
//! the connection that asked.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam::channel;
use distmind_common::handshake::ClusterKey;
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{
    ErrorCode, ErrorReply, ModelEntry, RuntimeReply, ServePath, TimingMsg, TraceEntry,
    RUNTIME_OUTPUTS_MAX, TRACE_ENTRIES_MAX,
};
use distmind_controller::{ClientError, ControllerClient};
use distmind_models::{Dtype, Manifest};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::Core;
use crate::cache::CacheError;
use crate::device::DeviceError;
use crate::exec::{ExecError, HostTensor, TraceEvent};
use crate::npy::{encode_npy, parse_npy};
use crate::pipeline::{cold_start, LoadPath, MergedTrace, PipelineError, PipelineEvent, Request};
use crate::pipeline::{Stages, Timing};

/// A reply ready to write: the message and the frames that follow it. The
/// permit is the connection's in-flight slot, released once written.
pub(crate) struct Outgoing {
    pub reply: RuntimeReply,
    pub frames: Vec<Vec<u8>>,
    pub permit: Option<OwnedSemaphorePermit>,
}

/// One queued inference request.
pub struct Job {
    pub(crate) id: u64,
    pub(crate) model: String,
    /// The input frame, `.npy` bytes (parsed by the worker, off the async threads).
    pub(crate) input: Vec<u8>,
    pub(crate) deadline: Option<Duration>,
    pub(crate) trace: bool,
    pub(crate) arrived: Instant,
    /// Index into the runtime's devices, set by dispatch.
    pub(crate) device: usize,
    pub(crate) reply: mpsc::Sender<Outgoing>,
    pub(crate) permit: Option<OwnedSemaphorePermit>,
}

/// Most catalog entries kept resolved; the table is cleared when full.
const RESOLVED_MODELS_MAX: usize = 4096;
/// Bounds the connect to the controller and each of its replies.
const CONTROLLER_TIMEOUT: Duration = Duration::from_secs(10);

/// A catalog entry with its manifest parsed.
pub(crate) struct Resolved {
    pub entry: ModelEntry,
    pub manifest: Manifest,
}

/// The controller's catalog as the workers see it: entries cached per model
/// name, one blocking controller connection shared (and reopened) by all.
pub(crate) struct Catalog {
    controller: String,
    key: ClusterKey,
    client: Mutex<Option<ControllerClient>>,
    models: Mutex<HashMap<String, Arc<Resolved>>>,
}

impl Catalog {
    pub fn new(controller: String, key: ClusterKey) -> Self {
        Catalog {
            controller,
            key,
            client: Mutex::new(None),
            models: Mutex::new(HashMap::new()),
        }
    }

    fn models(&self) -> MutexGuard<'_, HashMap<String, Arc<Resolved>>> {
        self.models.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets a cached entry (after an eviction or a failed fetch: the
    /// model may have been deployed again elsewhere).
    pub fn forget(&self, model: &str) {
        self.models().remove(model);
    }

    pub fn resolve(&self, model: &str) -> Result<Arc<Resolved>, ErrorReply> {
        if let Some(r) = self.models().get(model) {
            return Ok(r.clone());
        }
        let entry = self.fetch_entry(model)?;
        let manifest: Manifest = serde_json::from_value(entry.manifest.clone()).map_err(|e| {
            ErrorReply::new(
                ErrorCode::Internal,
                format!("model {model}: the catalog's manifest does not parse: {e}"),
            )
        })?;
        let resolved = Arc::new(Resolved { entry, manifest });
        let mut models = self.models();
        if models.len() >= RESOLVED_MODELS_MAX {
            models.clear();
        }
        models.insert(model.to_string(), resolved.clone());
        Ok(resolved)
    }

    /// `GetModel`, reconnecting once if the shared connection broke.
    fn fetch_entry(&self, model: &str) -> Result<ModelEntry, ErrorReply> {
        let mut client = self.client.lock().unwrap_or_else(|p| p.into_inner());
        let mut last = None;
        for _ in 0..2 {
            if client.is_none() {
                match ControllerClient::connect(&self.controller, &self.key, CONTROLLER_TIMEOUT) {
                    Ok(c) => *client = Some(c),
                    Err(e) => {
                        last = Some(e);
                        continue;
                    }
                }
            }
            let c = client.as_mut().expect("connected above");
            match c.get_model(model) {
                Ok(entry) => return Ok(entry),
                Err(e @ ClientError::Server { .. }) => {
                    let reply = e.error_reply().cloned().expect("a server error");
                    return Err(match reply.code {
                        ErrorCode::UnknownModel => ErrorReply::new(
                            ErrorCode::UnknownModel,
                            format!("unknown model {model:?}: it is not in the controller's catalog (deploy it first)"),
                        ),
                        _ => reply,
                    });
                }
                Err(e) => {
                    *client = None;
                    last = Some(e);
                }
            }
        }
        Err(ErrorReply::new(
            ErrorCode::Internal,
            format!(
                "model {model}: cannot ask the catalog: {}",
                last.map_or_else(|| "no attempt made".to_string(), |e| e.to_string())
            ),
        ))
    }
}

/// The worker loop of device `index`: runs until the queue is closed and empty.
pub(crate) fn run(core: &Core, index: usize, rx: channel::Receiver<Job>) {
    let device = &core.devices[index];
    for mut job in rx {
        let out = serve(core, index, &job);
        match &out.reply {
            RuntimeReply::Output { .. } => {
                core.served.fetch_add(1, Ordering::Relaxed);
                device.served.fetch_add(1, Ordering::Relaxed);
            }
            RuntimeReply::Error { error, .. } => {
                core.errors.fetch_add(1, Ordering::Relaxed);
                log::debug!("device {}: request {} failed: {error}", device.id, job.id);
            }
            _ => {}
        }
        device.queued.fetch_sub(1, Ordering::Relaxed);
        let out = Outgoing {
            permit: job.permit.take(),
            ..out
        };
        // The connection may be gone; its reply goes nowhere then.
        let _ = job.reply.blocking_send(out);
    }
    log::debug!("device {} worker stopped", device.id);
}

fn error(id: u64, code: ErrorCode, message: String) -> Outgoing {
    Outgoing {
        reply: RuntimeReply::Error {
            id,
            error: ErrorReply::new(code, message),
        },
        frames: Vec::new(),
        permit: None,
    }
}

fn serve(core: &Core, index: usize, job: &Job) -> Outgoing {
    let device = &core.devices[index];
    let waited = job.arrived.elapsed();
    if let Some(deadline) = job.deadline.filter(|d| waited > *d) {
        return error(
            job.id,
            ErrorCode::DeadlineExceeded,
            format!(
                "request {} for {}: its deadline of {} ms passed after {} ms in the queue of device {}",
                job.id,
                job.model,
                deadline.as_millis(),
                waited.as_millis(),
                device.id
            ),
        );
    }
    let input = match parse_npy(&job.input, Path::new("the input frame")) {
        Ok(t) => t,
        Err(e) => {
            return error(
                job.id,
                ErrorCode::BadRequest,
                format!("request {} for {}: {e}", job.id, job.model),
            )
        }
    };
    let resolved = match core.catalog.resolve(&job.model) {
        Ok(r) => r,
        Err(e) => return error(job.id, e.code, e.message),
    };
    let m = &resolved.manifest;
    if let Err(why) = check_input(m, &input) {
        return error(job.id, ErrorCode::BadRequest, why);
    }
    let stages = Stages {
        cache: &core.cache,
        executor: &*core.executor,
        residency: &device.residency,
    };
    let inputs = [input];
    let request = Request {
        entry: &resolved.entry,
        manifest: m,
        inputs: &inputs,
        arrived: job.arrived,
    };
    let (outputs, timing, trace) = match cold_start(&stages, &request, &core.pipeline) {
        Ok(v) => v,
        Err(e) => {
            let code = error_code(&e);
            if code == ErrorCode::Internal {
                // A stale entry (the model moved) is re-read next time.
                core.catalog.forget(&job.model);
            }
            return error(job.id, code, format!("request {}: {e}", job.id));
        }
    };
    if outputs.len() > RUNTIME_OUTPUTS_MAX || outputs.len() != m.outputs.len() {
        return error(
            job.id,
            ErrorCode::Internal,
            format!(
                "model {}: {} outputs (the manifest names {}, at most {RUNTIME_OUTPUTS_MAX} per reply)",
                m.name,
                outputs.len(),
                m.outputs.len()
            ),
        );
    }
    let mut frames = Vec::with_capacity(outputs.len());
    for (t, spec) in outputs.iter().zip(&m.outputs) {
        let bytes = encode_npy(t);
        if bytes.len() > CONTROL_FRAME_BYTES_MAX as usize {
            return error(
                job.id,
                ErrorCode::Internal,
                format!(
                    "model {} output {} ({}) is {} bytes as .npy, more than a frame's {CONTROL_FRAME_BYTES_MAX}: use a smaller batch",
                    m.name,
                    spec.name,
                    t.describe(),
                    bytes.len()
                ),
            );
        }
        frames.push(bytes);
    }
    let (trace, trace_truncated) = if job.trace {
        let (t, cut) = trace_entries(&trace);
        (Some(t), cut)
    } else {
        (None, false)
    };
    Outgoing {
        reply: RuntimeReply::Output {
            id: job.id,
            timing: timing_msg(&timing, device.id),
            outputs: m.outputs.iter().map(|o| o.name.clone()).collect(),
            trace,
            trace_truncated,
            resident: Vec::new(),
            dispatch: None,
        },
        frames,
        permit: None,
    }
}

/// The executors' rule, checked before anything is fetched: one input of
/// the manifest's dtype and shape, any batch size >= 1 in dimension 0.
fn check_input(m: &Manifest, t: &HostTensor) -> Result<(), String> {
    let [spec] = m.inputs.as_slice() else {
        return Err(format!(
            "model {} takes {} inputs; this server passes one",
            m.name,
            m.inputs.len()
        ));
    };
    let want_dtype = match spec.dtype {
        Dtype::F32 => "f32",
        Dtype::I64 => "i64",
    };
    let shape_ok = t.shape.len() == spec.shape.len()
        && t.shape.first().is_none_or(|&b| b >= 1)
        && t.shape.iter().skip(1).eq(spec.shape.iter().skip(1));
    if t.dtype_name() != want_dtype || !shape_ok {
        return Err(format!(
            "model {}: input {} is {}, expected {want_dtype} {:?} (any batch size >= 1 in dimension 0)",
            m.name,
            spec.name,
            t.describe(),
            spec.shape
        ));
    }
    Ok(())
}

fn error_code(e: &PipelineError) -> ErrorCode {
    match e {
        PipelineError::Cache(CacheError::Full { .. } | CacheError::TooBig { .. })
        | PipelineError::Device(DeviceError::Full { .. } | DeviceError::TooBig { .. }) => {
            ErrorCode::Full
        }
        PipelineError::Exec { error, .. } if matches!(**error, ExecError::BadInput { .. }) => {
            ErrorCode::BadRequest
        }
        _ => ErrorCode::Internal,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn timing_msg(t: &Timing, device: u32) -> TimingMsg {
    TimingMsg {
        queue_ms: ms(t.queue),
        fetch_ms: ms(t.fetch),
        h2d_ms: ms(t.h2d),
        compute_ms: ms(t.compute),
        total_ms: ms(t.total),
        path: match t.path {
            LoadPath::Cold => ServePath::Cold,
            LoadPath::HostCached => ServePath::HostCached,
            LoadPath::DeviceResident => ServePath::DeviceResident,
        },
        simulated: t.simulated,
        device,
        fetched_bytes: t.fetched_bytes,
        train_yield_ms: 0.0,
    }
}

/// The merged trace as wire entries, cut at [`TRACE_ENTRIES_MAX`].
pub(crate) fn trace_entries(trace: &MergedTrace) -> (Vec<TraceEntry>, bool) {
    let entry = |at: Duration, event: &str, index: Option<usize>| TraceEntry {
        at_ms: ms(at),
        event: event.to_string(),
        index: index.map(|i| i as u64),
    };
    let out: Vec<TraceEntry> = trace
        .events
        .iter()
        .take(TRACE_ENTRIES_MAX)
        .map(|(at, e)| match *e {
            PipelineEvent::HostReady { group } => entry(*at, "host_ready", Some(group)),
            PipelineEvent::UploadStart { group } => entry(*at, "upload_start", Some(group)),
            PipelineEvent::Uploaded { group } => entry(*at, "uploaded", Some(group)),
            PipelineEvent::GateOpened { group } => entry(*at, "gate_opened", Some(group)),
            PipelineEvent::ComputeStart => entry(*at, "compute_start", None),
            PipelineEvent::ComputeEnd => entry(*at, "compute_end", None),
            PipelineEvent::Exec(TraceEvent::GroupReady { group }) => {
                entry(*at, "group_ready", Some(group))
            }
            PipelineEvent::Exec(TraceEvent::LayerStart { layer }) => {
                entry(*at, "layer_start", Some(layer))
            }
            PipelineEvent::Exec(TraceEvent::LayerEnd { layer }) => {
                entry(*at, "layer_end", Some(layer))
            }
        })
        .collect();
    (out, trace.events.len() > TRACE_ENTRIES_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::PipelineEvent as E;

    #[test]
    fn trace_entries_name_every_event_and_are_bounded() {
        let ms1 = Duration::from_millis(1);
        let t = MergedTrace {
            events: vec![
                (ms1, E::HostReady { group: 0 }),
                (2 * ms1, E::GateOpened { group: 0 }),
                (3 * ms1, E::Exec(TraceEvent::LayerStart { layer: 4 })),
            ],
        };
        let (e, cut) = trace_entries(&t);
        assert!(!cut);
        assert_eq!(e[0].event, "host_ready");
        assert_eq!((e[2].event.as_str(), e[2].index), ("layer_start", Some(4)));
        assert!((e[1].at_ms - 2.0).abs() < 1e-9);
        let long = MergedTrace {
            events: vec![(ms1, E::ComputeStart); TRACE_ENTRIES_MAX + 1],
        };
        let (e, cut) = trace_entries(&long);
        assert!(cut && e.len() == TRACE_ENTRIES_MAX);
    }
}
