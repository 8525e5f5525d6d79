//! The `sim` executor: no math, no device memory. Each layer takes the time
//! a [`Profile`] gives for it, and uploads take the time the profile's
//! host-to-device rate gives for their bytes, so a machine without a GPU can
//! run the pipeline with honest GPU timing, labelled as simulated.
//!
//! - [`SimArena`] holds no bytes: `alloc_arena` allocates nothing, and
//!   `upload` checks the range and sleeps `bytes / h2d_bytes_per_s` for
//!   the stored bytes it is given (a synchronous copy at the assumed PCIe
//!   rate of the bytes that cross it: half of a half-precision group's
//!   device bytes; the bytes are dropped). Copies keep a timeline, as
//!   compute does ([`CopyTimeline`]): a copy asked for as soon as the one
//!   before it returned starts where that one ended, so the sleeps'
//!   overshoot does not add up over a model's groups (a GPU's copy engine
//!   runs copies queued on its stream back to back).
//! - [`SimProgram::run`] gates exactly like a real executor: `gate(g)` once
//!   per group, before the first layer whose params live in group g, and
//!   records `GroupReady`, `LayerStart`, `LayerEnd`.
//! - Layer times per request shape (kept for the latest shapes): the
//!   profile at the request's batch ([`Profile::get`], interpolated between
//!   profiled batches), and for a transformer scaled by its tokens from the
//!   profiled sequence length ([`ModelProfile::at_seq_len`]: an
//!   interpolation of one timed length, not a measurement). Outputs have
//!   the request's shapes, zero-filled.
//!
//! - [`SimExecutor::train_iteration`] (what
//!   [`Executor::simulated_train_iteration`] answers): a background training
//!   iteration computes nothing and holds the device for
//!   [`Profile::train_iteration_s`] times the dilation.
//!
//! Timing: the run keeps a simulated GPU timeline since run start. A layer
//! starts when the previous one ended, or when its gate returned if that is
//! later, and ends its profiled time after. The run does not sleep layer by
//! layer: it calls each gate as soon as it reaches it on the timeline (a
//! gate that blocks returns when its group arrived, whenever it was called),
//! and waits once, at the end, until the timeline's end ([`wait_until`]: a
//! sleep with the thread's timer slack tightened to 1 ns). So a run's wall
//! time is its profile's total plus the gates' waits and one wakeup:
//! neither the per-layer cost of timers (models have hundreds of
//! microsecond-scale layers) nor Linux's default 50 us of timer slack per
//! sleep is added to it. Copies wait the same way.
//!
//! Gates: a gate that blocks (returns after more than [`GATE_INSTANT_MAX`],
//! 20 us) marks its group ready when it returned, and the layer starts then
//! if that is after the previous layer's end. A gate that returns at once
//! found its group already uploaded, so the group counts as ready no later
//! than the previous layer's end: otherwise every gate would bake the
//! wall clock's sleep overshoot into the timeline (tiny packages have a
//! group per layer). Trace times are the timeline's; a `GroupReady` may be
//! stamped before the previous layer's `LayerEnd` (the group arrived while
//! that layer ran, as a copy-done event fires on a GPU while earlier kernels
//! run), never after the `LayerStart` of a layer of its group.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distmind_models::{DimKind, Dtype, Manifest, OutputSpec, ParamDtype, Scale, TensorSpec};

use super::plan::{self, PerShape};
use super::{Arena, ExecError, Executor, ExecutorKind, HostTensor, Program, Trace, TraceEvent};
use crate::profile::{model_key, profiled_seq_len, ModelProfile, Profile};

/// A gate that returns within this long did not wait: its group was
/// uploaded before it was asked for.
pub const GATE_INSTANT_MAX: Duration = Duration::from_micros(20);

/// An upload asked for within this long of the previous one's return
/// follows it back to back (its caller did nothing else in between): it
/// starts where the previous copy ended on the timeline, not when the
/// previous wait's wakeup let its caller go on.
pub const COPY_BACK_TO_BACK_MAX: Duration = Duration::from_micros(50);

/// The largest time dilation a sim executor accepts (as
/// [`distmind_common::emulate::DILATION_MAX`]).
pub const DILATION_MAX: f64 = distmind_common::emulate::DILATION_MAX;

/// Runs models with the layer times of a profile.
#[derive(Debug, Clone)]
pub struct SimExecutor {
    profile: Arc<Profile>,
    /// Every layer and upload time is multiplied by this (1: real time).
    dilation: f64,
    /// Model keys already warned about as interpolated (a training job
    /// starts again at every role change; one warning per key is enough).
    interpolated: Arc<Mutex<HashSet<String>>>,
    /// Models whose layers were checked against the profile ([`checked_key`]),
    /// shared by every device of this executor: a program is made on every
    /// model switch, on the device's serial path, and comparing a
    /// ResNet-152's 515 layer names there cost about 0.1 ms a switch.
    checked: Arc<Mutex<HashSet<String>>>,
}

/// Most interpolated keys remembered; beyond, every one is warned about.
const INTERPOLATED_KEYS_MAX: usize = 1024;
/// Most checked models remembered; beyond, every new one is checked on
/// each switch.
const CHECKED_MODELS_MAX: usize = 4096;

/// What a layer check holds for: the model's name, its profile key (family,
/// preset, batch) and its layer count. A preset's layers are a function of
/// its family and scale, so a model of that name, key and count has the
/// layers that were checked; a model deployed again under the same name
/// as another preset or architecture has another key, and is checked again.
fn checked_key(manifest: &Manifest, key: &str) -> String {
    format!("{}\0{key}\0{}", manifest.name, manifest.layers.len())
}

impl SimExecutor {
    pub fn new(profile: Profile) -> Self {
        SimExecutor {
            profile: Arc::new(profile),
            dilation: 1.0,
            interpolated: Arc::default(),
            checked: Arc::default(),
        }
    }

    /// A sim executor whose GPU runs `k` times slower than the profile says:
    /// layer and upload times are multiplied by `k`. Used with an emulated
    /// link (`common::emulate`), where the network is slowed by the same
    /// factor, so every ratio between GPU and network time stays the
    /// hardware's. Refuses `k` below 1, above [`DILATION_MAX`] or not finite.
    pub fn with_dilation(profile: Profile, k: f64) -> Result<Self, ExecError> {
        if !k.is_finite() || !(1.0..=DILATION_MAX).contains(&k) {
            return Err(ExecError::Unavailable {
                executor: ExecutorKind::Sim,
                why: format!("time dilation {k} is outside 1..={DILATION_MAX}"),
            });
        }
        Ok(SimExecutor {
            profile: Arc::new(profile),
            dilation: k,
            interpolated: Arc::default(),
            checked: Arc::default(),
        })
    }

    /// The factor every simulated time is multiplied by.
    pub fn dilation(&self) -> f64 {
        self.dilation
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }
}

/// Converts a profiled time to a duration, rounding up to the nanosecond
/// (a simulated layer never takes less than its profile says).
fn duration_ceil(s: f64) -> Duration {
    Duration::from_nanos((s.max(0.0) * 1e9).ceil() as u64)
}

impl Executor for SimExecutor {
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Sim
    }

    fn describe(&self) -> String {
        let dilated = if self.dilation == 1.0 {
            String::new()
        } else {
            format!("; every time x{:.2} (dilated clock)", self.dilation)
        };
        format!(
            "sim (no math, zero outputs; layer times {}, from {}{dilated})",
            self.profile.source_label(),
            self.profile.origin()
        )
    }

    /// Another simulated GPU of the same profile and dilation.
    fn for_device(&self, _ordinal: u32) -> Result<Arc<dyn Executor>, ExecError> {
        Ok(Arc::new(SimExecutor {
            profile: self.profile.clone(),
            dilation: self.dilation,
            interpolated: Arc::default(),
            checked: self.checked.clone(),
        }))
    }

    fn alloc_arena(&self, bytes: u64) -> Result<Arc<dyn Arena>, ExecError> {
        Ok(Arc::new(SimArena {
            len: bytes,
            h2d_bytes_per_s: self.profile.peaks.h2d_bytes_per_s / self.dilation,
            copies: Mutex::default(),
        }))
    }

    fn program(
        &self,
        manifest: &Manifest,
        arena: Arc<dyn Arena>,
    ) -> Result<Box<dyn Program>, ExecError> {
        let model_err = |why: String| ExecError::Model {
            model: manifest.name.clone(),
            why,
        };
        let batch = manifest
            .inputs
            .first()
            .and_then(|i| i.shape.first().copied())
            .ok_or_else(|| model_err("has no input with a batch dimension".into()))?;
        let (scale, profile) = self.model_profile(manifest, batch)?;
        let key = model_key(manifest.family, scale, batch);
        let checked_as = checked_key(manifest, &key);
        let lock = || self.checked.lock().unwrap_or_else(|p| p.into_inner());
        if !lock().contains(&checked_as) {
            for (p, l) in profile.layers.iter().zip(&manifest.layers) {
                if p.name != l.name || p.op != l.op.name() {
                    return Err(model_err(format!(
                        "profile {} {key} layer {} is {} ({}), the manifest's is {} ({})",
                        self.profile.origin(),
                        l.id,
                        p.name,
                        p.op,
                        l.name,
                        l.op.name()
                    )));
                }
            }
            let mut checked = lock();
            if checked.len() < CHECKED_MODELS_MAX {
                checked.insert(checked_as);
            }
        }
        let mut layers = Vec::with_capacity(manifest.layers.len());
        for l in &manifest.layers {
            if let Some(g) = l.group {
                if g >= manifest.groups.len() {
                    return Err(model_err(format!(
                        "layer {} ({}) is in group {g} of {}",
                        l.id,
                        l.name,
                        manifest.groups.len()
                    )));
                }
            }
            layers.push(SimLayer { group: l.group });
        }
        if arena.len() < manifest.device_bytes() {
            return Err(model_err(format!(
                "arena of {} bytes is smaller than the model's {} bytes on a device",
                arena.len(),
                manifest.device_bytes()
            )));
        }
        let seq_dim = manifest.inputs.first().and_then(|i| {
            i.variable
                .iter()
                .find(|v| v.kind == DimKind::Sequence)
                .map(|v| v.dim)
        });
        // A layer never takes less than its launch and one read of its
        // weights (device bytes), whatever the tokens. Only token inputs
        // scale layer times, so only a model with them needs the floors.
        let peaks = &self.profile.peaks;
        let mut floors_s = Vec::new();
        if seq_dim.is_some() {
            floors_s = vec![peaks.launch_overhead_s; manifest.layers.len()];
            for p in &manifest.params {
                if let Some(f) = floors_s.get_mut(p.layer) {
                    *f += p.device_nbytes(manifest.param_dtype) as f64 / peaks.memory_bytes_per_s;
                }
            }
        }
        let timing = SimTiming {
            profile: self.profile.clone(),
            family: manifest.family,
            scale,
            dilation: self.dilation,
            default_batch: batch,
            layer_count: profile.layers.len(),
            seq_dim,
            profiled_len: profiled_seq_len(manifest.family, scale),
            floors_s,
        };
        // Only a model whose inputs vary past the batch (tokens) needs the
        // graph to work out its output shapes; a program is made on every
        // model switch, on the device's serial path, so a CNN's skips the
        // copy of its layers and the shape inference.
        let varies = manifest
            .inputs
            .iter()
            .any(|i| i.variable.iter().any(|v| v.kind != DimKind::Batch));
        let graph = varies.then(|| ShapeGraph {
            layers: manifest.layers.clone(),
            param_shapes: plan::param_shapes(manifest),
        });
        Ok(Box::new(SimProgram {
            model: manifest.name.clone(),
            timing,
            shapes: PerShape::default(),
            graph,
            layers,
            gated: vec![false; manifest.groups.len()],
            inputs: manifest.inputs.clone(),
            outputs: manifest.outputs.clone(),
            _arena: arena,
        }))
    }

    /// [`Profile::train_iteration_s`] (three forward passes at `batch`, an
    /// estimate stated there) times the dilation.
    fn simulated_train_iteration(
        &self,
        manifest: &Manifest,
        batch: usize,
    ) -> Option<Result<Duration, ExecError>> {
        Some(self.train_iteration(manifest, batch))
    }
}

impl SimExecutor {
    /// The scale preset of `manifest` and its profile at `batch`, checked
    /// against its layer count; errors say what to do.
    fn model_profile(
        &self,
        manifest: &Manifest,
        batch: usize,
    ) -> Result<(Scale, Cow<'_, ModelProfile>), ExecError> {
        let model_err = |why: String| ExecError::Model {
            model: manifest.name.clone(),
            why,
        };
        let scale = manifest.scale.ok_or_else(|| {
            model_err(format!(
                "has a config of its own (imported; neither the full nor the tiny {} preset), \
                 and GPU profiles cover only the presets; import it with the preset's \
                 input size or run it with the cpu or cuda executor",
                manifest.family
            ))
        })?;
        let key = model_key(manifest.family, scale, batch);
        // Formatted only for a message: this runs on every model switch.
        let origin = || self.profile.origin();
        let profile = self
            .profile
            .get(manifest.family, scale, batch)
            .ok_or_else(|| {
                model_err(format!(
                    "profile {} has no layer times for {key} (it has {}); \
                     pick a profile that covers this model or add it",
                    origin(),
                    self.profile
                        .models
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        if let Cow::Owned(_) = profile {
            let mut seen = self.interpolated.lock().unwrap_or_else(|p| p.into_inner());
            if !seen.contains(&key) {
                if seen.len() < INTERPOLATED_KEYS_MAX {
                    seen.insert(key.clone());
                }
                log::warn!(
                    "{}: profile {} has no {key}; layer times interpolated from its other batches",
                    manifest.name,
                    origin()
                );
            }
        }
        if profile.layers.len() != manifest.layers.len() {
            return Err(model_err(format!(
                "profile {} gives {} layers for {key}, the manifest has {} (a different architecture?)",
                origin(),
                profile.layers.len(),
                manifest.layers.len()
            )));
        }
        Ok((scale, profile))
    }

    /// One training iteration of `batch` inputs of `manifest`, dilated.
    pub fn train_iteration(
        &self,
        manifest: &Manifest,
        batch: usize,
    ) -> Result<Duration, ExecError> {
        if batch == 0 {
            return Err(ExecError::Model {
                model: manifest.name.clone(),
                why: "a training batch of 0 images has no GPU time".into(),
            });
        }
        let (scale, _) = self.model_profile(manifest, batch)?;
        let s = self
            .profile
            .train_iteration_s(manifest.family, scale, batch)
            .ok_or_else(|| ExecError::Model {
                model: manifest.name.clone(),
                why: format!(
                    "profile {} has no training time for {}",
                    self.profile.origin(),
                    model_key(manifest.family, scale, batch)
                ),
            })?;
        Ok(duration_ceil(s * self.dilation))
    }
}

/// An arena that holds nothing: uploads take the time of the copy.
#[derive(Debug)]
pub struct SimArena {
    len: u64,
    h2d_bytes_per_s: f64,
    copies: Mutex<CopyTimeline>,
}

/// The simulated copy engine of one arena: when its last copy ends, and
/// when that copy's caller got control back.
#[derive(Debug, Default, Clone, Copy)]
pub struct CopyTimeline {
    due: Option<Instant>,
    returned: Option<Instant>,
}

impl CopyTimeline {
    /// Books a copy of `time` asked for at `now` and returns when it ends:
    /// behind a copy still running; right after the last one when its
    /// caller asks within [`COPY_BACK_TO_BACK_MAX`] of that one's return
    /// (whatever the sleep overshot); else from `now`.
    pub fn book(&mut self, now: Instant, time: Duration) -> Instant {
        let start = match (self.due, self.returned) {
            (Some(due), _) if due >= now => due,
            (Some(due), Some(ret))
                if ret >= due && now.saturating_duration_since(ret) <= COPY_BACK_TO_BACK_MAX =>
            {
                due
            }
            _ => now,
        };
        let due = start + time;
        self.due = Some(due);
        due
    }

    /// The caller of the copy ending at `due` got control back at `at`.
    pub fn returned(&mut self, due: Instant, at: Instant) {
        if self.due == Some(due) {
            self.returned = Some(at);
        }
    }
}

impl SimArena {
    /// The time an upload of `bytes` takes.
    pub fn upload_time(&self, bytes: u64) -> Duration {
        duration_ceil(bytes as f64 / self.h2d_bytes_per_s)
    }
}

impl Arena for SimArena {
    fn len(&self) -> u64 {
        self.len
    }

    /// Synchronous: it takes the copy's time and returns when it is done.
    #[allow(unsafe_code)]
    unsafe fn upload_async(
        &self,
        group: usize,
        offset: u64,
        stored: ParamDtype,
        bytes: &[u8],
    ) -> Result<(), ExecError> {
        super::device_range(group, offset, stored, bytes, self.len)?;
        // The stored bytes are what crosses the link; a GPU widens half
        // precision in device memory, at a rate far above PCIe's.
        let time = self.upload_time(bytes.len() as u64);
        let due = self
            .copies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .book(Instant::now(), time);
        wait_until(due);
        self.copies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .returned(due, Instant::now());
        Ok(())
    }
}

/// Returns at `due`, or at once if it has passed: sleeps with the thread's
/// timer slack tightened to 1 ns, so the wait ends when the device's
/// kernel or copy would, not up to 50 us later (Linux's default slack).
pub fn wait_until(due: Instant) {
    distmind_transport::priority::tighten_timer_slack();
    let now = Instant::now();
    if due > now {
        std::thread::sleep(due - now);
    }
}

#[derive(Debug, Clone, Copy)]
struct SimLayer {
    group: Option<usize>,
}

/// Layer times per request shape, from the profile: its batch (the
/// profile's entry, or [`Profile::get`]'s interpolation between batches)
/// and, for a transformer, its tokens ([`ModelProfile::at_seq_len`]:
/// scaled from the profiled length, an interpolation).
struct SimTiming {
    profile: Arc<Profile>,
    family: distmind_models::Family,
    scale: Scale,
    dilation: f64,
    /// The manifest's batch, and the layer count of the profile at it
    /// (whose layers were checked against the manifest's when the program
    /// was made; nothing of it is copied: a program is made on every model
    /// switch).
    default_batch: usize,
    layer_count: usize,
    /// The token input's sequence dimension (transformers).
    seq_dim: Option<usize>,
    /// The length the profile timed ([`profiled_seq_len`]).
    profiled_len: Option<usize>,
    /// Per layer: the least time it takes (launch + one weight read), s;
    /// empty without a sequence dimension (nothing is scaled).
    floors_s: Vec<f64>,
}

impl SimTiming {
    /// Every layer's simulated time for a request of input shapes `key`.
    fn times(&self, model: &str, key: &[Vec<usize>]) -> Result<Vec<Duration>, ExecError> {
        let model_err = |why: String| ExecError::Model {
            model: model.to_string(),
            why,
        };
        let first = key.first().map(Vec::as_slice).unwrap_or(&[]);
        let batch = first.first().copied().unwrap_or(self.default_batch);
        // Borrowed where the profile has the batch; interpolated once per
        // request shape otherwise.
        let at_batch: Cow<'_, ModelProfile> = self
            .profile
            .get(self.family, self.scale, batch)
            .ok_or_else(|| {
                model_err(format!("the profile has no layer times for batch {batch}"))
            })?;
        if at_batch.layers.len() != self.layer_count {
            return Err(model_err(format!(
                "the profile's batch {batch} has a different layer count"
            )));
        }
        let scaled = match (self.seq_dim.and_then(|d| first.get(d)), self.profiled_len) {
            (Some(&len), Some(profiled)) if len != profiled => {
                log::debug!(
                    "{model}: {len} tokens: layer times scaled from the profile's {profiled} \
                     (an interpolation, not a measurement)"
                );
                Cow::Owned(at_batch.at_seq_len(
                    profiled,
                    len,
                    self.profile.peaks.launch_overhead_s,
                    &self.floors_s,
                ))
            }
            _ => at_batch,
        };
        Ok(scaled
            .layers
            .iter()
            .map(|l| duration_ceil(l.time_s * self.dilation))
            .collect())
    }
}

/// What a [`SimProgram`] works out once per request shape.
struct SimShape {
    times: Vec<Duration>,
    /// The outputs' shapes at this request shape (zero-filled on return).
    outputs: Vec<Vec<usize>>,
}

/// A model's layer times against a [`SimArena`].
pub struct SimProgram {
    model: String,
    timing: SimTiming,
    /// Per request shape: layer times and output shapes.
    shapes: PerShape<SimShape>,
    /// What output shapes are inferred from, where inputs vary past the
    /// batch; `None`: only the batch varies, and every output is the
    /// manifest's with the request's batch in dimension 0.
    graph: Option<ShapeGraph>,
    layers: Vec<SimLayer>,
    /// Per group: gated in this run (reset at the start of each run).
    gated: Vec<bool>,
    inputs: Vec<TensorSpec>,
    outputs: Vec<OutputSpec>,
    /// Kept alive as a real program keeps its arena.
    _arena: Arc<dyn Arena>,
}

/// The manifest's layers and param shapes, for [`plan::layer_shapes`].
struct ShapeGraph {
    layers: Vec<distmind_models::Layer>,
    param_shapes: std::collections::HashMap<String, Vec<usize>>,
}

impl SimProgram {
    /// Checks the inputs against the manifest (the batch, and the length of
    /// token inputs, may differ, as on the cpu executor) and returns the
    /// plan for their shape: layer times and output shapes.
    fn plan(&mut self, inputs: &[HostTensor]) -> Result<Arc<SimShape>, ExecError> {
        plan::check_inputs(&self.model, &self.inputs, inputs)?;
        let key = plan::shape_key(inputs);
        let (model, timing, graph, specs, outputs) = (
            &self.model,
            &self.timing,
            &self.graph,
            &self.inputs,
            &self.outputs,
        );
        self.shapes.get_or_try_insert(&key, || {
            let times = timing.times(model, &key)?;
            let Some(graph) = graph else {
                let batch = key.first().and_then(|s| s.first().copied()).unwrap_or(1);
                let outputs = outputs
                    .iter()
                    .map(|o| {
                        let mut shape = o.shape.clone();
                        if let Some(n) = shape.first_mut() {
                            *n = batch;
                        }
                        shape
                    })
                    .collect();
                return Ok(SimShape { times, outputs });
            };
            let shapes =
                plan::layer_shapes(model, &graph.layers, specs, &key, &graph.param_shapes)?;
            let outputs = outputs
                .iter()
                .map(|o| {
                    shapes
                        .get(o.layer)
                        .map(|s| s.dims.clone())
                        .ok_or_else(|| ExecError::Model {
                            model: model.clone(),
                            why: format!("output {} reads missing layer {}", o.name, o.layer),
                        })
                })
                .collect::<Result<_, _>>()?;
            Ok(SimShape { times, outputs })
        })
    }
}

impl Program for SimProgram {
    fn run(
        &mut self,
        inputs: &[HostTensor],
        gate: &mut dyn FnMut(usize) -> Result<(), ExecError>,
        trace: &mut Trace,
    ) -> Result<Vec<HostTensor>, ExecError> {
        let shape = self.plan(inputs)?;
        let times = &shape.times;
        self.gated.fill(false);
        trace.reserve(2 * self.layers.len() + self.gated.len());
        let start = Instant::now();
        // End of the previous layer on the simulated timeline.
        let mut due = Duration::ZERO;
        for (i, layer) in self.layers.iter().enumerate() {
            if let Some(g) = layer.group {
                if !self.gated[g] {
                    self.gated[g] = true;
                    let called = start.elapsed();
                    gate(g)?;
                    let returned = start.elapsed();
                    let ready = if returned - called <= GATE_INSTANT_MAX {
                        // Already uploaded when asked: ready no later than
                        // the previous layer's end, whatever the sleep overshoot.
                        called.min(due)
                    } else {
                        returned
                    };
                    trace.push((ready, TraceEvent::GroupReady { group: g }));
                    due = due.max(ready);
                }
            }
            trace.push((due, TraceEvent::LayerStart { layer: i }));
            due += times[i];
            trace.push((due, TraceEvent::LayerEnd { layer: i }));
        }
        wait_until(start + due);
        Ok(self
            .outputs
            .iter()
            .zip(&shape.outputs)
            .map(|(o, shape)| {
                let shape = shape.clone();
                let n = shape.iter().product();
                match o.dtype {
                    Dtype::F32 => HostTensor::f32(shape, vec![0.0; n]),
                    Dtype::I64 => HostTensor::i64(shape, vec![0; n]),
                }
            })
            .collect())
    }

    fn simulated(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn copies_asked_for_back_to_back_do_not_add_up_their_sleeps_overshoot() {
        let t0 = Instant::now();
        let mut c = CopyTimeline::default();
        // The first copy starts when it is asked for.
        let due = c.book(t0, MS);
        assert_eq!(due, t0 + MS);
        // Its sleep overshot by 80 us; the next copy, asked for right after
        // the return, starts where the first ended.
        let back = due + Duration::from_micros(80);
        c.returned(due, back);
        let due2 = c.book(back + Duration::from_micros(10), MS);
        assert_eq!(due2, t0 + 2 * MS);
        // A copy asked for long after the last return (its bytes were still
        // on their way) starts when asked for.
        c.returned(due2, due2 + Duration::from_micros(80));
        let late = due2 + 3 * MS;
        assert_eq!(c.book(late, MS), late + MS);
        // One asked for while another runs queues behind it.
        let t1 = late + Duration::from_micros(300);
        assert_eq!(c.book(t1, MS), late + 2 * MS);
    }

    #[test]
    fn a_return_for_a_copy_that_is_no_longer_the_last_is_ignored() {
        let t0 = Instant::now();
        let mut c = CopyTimeline::default();
        let first = c.book(t0, MS);
        let second = c.book(t0, MS);
        assert_eq!(second, t0 + 2 * MS);
        // The first copy's caller returning says nothing of the second.
        c.returned(first, first);
        let next = second + Duration::from_micros(500);
        assert_eq!(c.book(next, MS), next + MS);
    }

    #[test]
    fn a_wait_never_returns_before_its_due_and_tightens_the_slack() {
        std::thread::spawn(|| {
            for wait in [Duration::ZERO, Duration::from_micros(30), 2 * MS] {
                let due = Instant::now() + wait;
                wait_until(due);
                assert!(
                    Instant::now() >= due,
                    "returned before the due of a {wait:?} wait"
                );
            }
            if cfg!(target_os = "linux") {
                assert_eq!(
                    distmind_transport::priority::current_timer_slack_ns(),
                    Some(1)
                );
            }
        })
        .join()
        .unwrap();
    }
}
