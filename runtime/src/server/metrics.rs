//! The runtime's Prometheus metrics (`prometheus-client`), all prefixed
//! `distmind_runtime_`:
//!
//! * `requests_total{model, status}`: inference requests answered, `status`
//!   `ok` or the error code (`busy`, `bad_request`, `unknown_model`, ...);
//! * `request_duration_seconds{model}`: arrival to reply, buckets from 1 ms
//!   to 10 s ([`LATENCY_BUCKETS`]);
//! * `serve_path_total{path}`: served requests by path (`cold`,
//!   `host_cached`, `device_resident`);
//! * `host_cache_{hits,misses,evictions,refills}_total`, `host_cache_used_bytes`,
//!   `host_cache_capacity_bytes`, `fetched_bytes_total` (bytes read from
//!   memory servers);
//! * per `device`: `device_busy_seconds_total` (loading or computing:
//!   requests, prefetches, training), `device_serial_seconds_total` (the
//!   worker's time on queued requests and prefetches, dequeue to replies
//!   handed over), `device_serial_overhead_seconds_total` (the part of it
//!   that was neither the executor's compute nor its copies),
//!   `device_train_iterations_total`, `device_stage_iterations_total`,
//!   `device_stage_samples_total`, `device_stage_forward_seconds_total`,
//!   `device_stage_backward_seconds_total` (training stage workers, every
//!   job), `device_stage_worker` (1 while one holds the device),
//!   `device_queue_depth` (queued or running), `device_training` (1 while a
//!   job is set), `device_train_iteration_seconds` (the EWMA).
//!
//! Counters the request path owns live here; the rest is read from the
//! host cache and the devices at each scrape (a collector), so a scrape
//! never disagrees with a `Stats` reply.
//!
//! Bounded: at most [`MODEL_LABELS_MAX`] distinct `model` label values;
//! requests for further models are counted under `model="other"`.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distmind_common::proto::{ErrorCode, ServePath};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::Core;

/// Prefix of every runtime metric.
pub const PREFIX: &str = "distmind_runtime";
/// Request latency buckets, seconds: 1 ms .. 10 s.
pub const LATENCY_BUCKETS: [f64; 13] = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];
/// Most distinct `model` label values; beyond, `model="other"`.
pub const MODEL_LABELS_MAX: usize = 256;
/// The `model` label of requests beyond [`MODEL_LABELS_MAX`] models.
pub const OTHER_MODEL: &str = "other";

type ModelStatus = [(&'static str, String); 2];
type ModelOnly = [(&'static str, String); 1];
type PathLabel = [(&'static str, &'static str); 1];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The metrics the request path updates.
pub(crate) struct Metrics {
    requests: Family<ModelStatus, Counter>,
    latency: Family<ModelOnly, Histogram, fn() -> Histogram>,
    paths: Family<PathLabel, Counter>,
    models: Mutex<HashSet<String>>,
}

impl Metrics {
    pub fn new() -> Self {
        Metrics {
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            paths: Family::default(),
            models: Mutex::new(HashSet::new()),
        }
    }

    /// The `model` label for `model`: itself while fewer than
    /// [`MODEL_LABELS_MAX`] models were seen, else [`OTHER_MODEL`].
    fn model_label(&self, model: &str) -> String {
        let mut seen = self.models.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(model) {
            return model.to_string();
        }
        if seen.len() < MODEL_LABELS_MAX {
            seen.insert(model.to_string());
            return model.to_string();
        }
        OTHER_MODEL.to_string()
    }

    /// One inference request answered: `status` `None` for outputs, else
    /// the error code; `took` from its arrival.
    pub fn observe_request(&self, model: &str, status: Option<ErrorCode>, took: Duration) {
        let model = self.model_label(model);
        let status = status.map_or("ok", code_label);
        self.requests
            .get_or_create(&[("model", model.clone()), ("status", status.to_string())])
            .inc();
        self.latency
            .get_or_create(&[("model", model)])
            .observe(took.as_secs_f64());
    }

    /// A request served with outputs, by the path it took.
    pub fn observe_path(&self, path: ServePath) {
        let path = match path {
            ServePath::Cold => "cold",
            ServePath::HostCached => "host_cached",
            ServePath::DeviceResident => "device_resident",
        };
        self.paths.get_or_create(&[("path", path)]).inc();
    }
}

/// The `status` label of an error code (its wire name).
pub fn code_label(code: ErrorCode) -> &'static str {
    code.as_str()
}

/// The registry of one runtime: the request path's families and a
/// collector reading the host cache and devices at each scrape.
pub(crate) fn registry(core: &Arc<Core>) -> Registry {
    let mut r = Registry::with_prefix(PREFIX);
    let m = &core.metrics;
    r.register(
        "requests",
        "Inference requests answered, by model and status (ok or the error code)",
        m.requests.clone(),
    );
    r.register(
        "request_duration_seconds",
        "Inference request latency, arrival to reply, by model",
        m.latency.clone(),
    );
    r.register(
        "serve_path",
        "Inference requests served, by path (cold, host_cached, device_resident)",
        m.paths.clone(),
    );
    r.register_collector(Box::new(Sampled(core.clone())));
    r
}

/// Reads the host cache and the devices at scrape time.
struct Sampled(Arc<Core>);

impl std::fmt::Debug for Sampled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("runtime metrics collector")
    }
}

fn encode_one(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: &impl EncodeMetric,
) -> Result<(), std::fmt::Error> {
    let e = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(e)
}

fn encode_per_device<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    values: impl Iterator<Item = (u32, M)>,
) -> Result<(), std::fmt::Error> {
    let mut e = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (device, metric) in values {
        let labels = [("device", device.to_string())];
        metric.encode(e.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Sampled {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let core = &*self.0;
        let c = core.cache.stats();
        let e = &mut encoder;
        encode_one(
            e,
            "host_cache_hits",
            "Host cache lookups that found the model",
            &ConstCounter::new(c.hits),
        )?;
        encode_one(
            e,
            "host_cache_misses",
            "Host cache lookups that did not find the model",
            &ConstCounter::new(c.misses),
        )?;
        encode_one(
            e,
            "host_cache_evictions",
            "Models evicted from the host cache to make room",
            &ConstCounter::new(c.evictions),
        )?;
        encode_one(
            e,
            "host_cache_refills",
            "Models a device evicted, fetched back into the host cache in the background",
            &ConstCounter::new(c.refills),
        )?;
        encode_one(
            e,
            "host_cache_used_bytes",
            "Host cache bytes held by models",
            &ConstGauge::new(c.used_bytes),
        )?;
        encode_one(
            e,
            "host_cache_capacity_bytes",
            "Host cache size",
            &ConstGauge::new(c.capacity_bytes),
        )?;
        encode_one(
            e,
            "fetched_bytes",
            "Bytes read from memory servers into the host cache",
            &ConstCounter::new(c.fetched_bytes),
        )?;
        let devices = &core.devices;
        encode_per_device(
            e,
            "device_busy_seconds",
            "Time the device spent loading or computing (requests, prefetches, training)",
            MetricType::Counter,
            devices.iter().map(|d| {
                let ns = d.busy_ns.load(Ordering::Relaxed);
                (d.id, ConstCounter::new(ns as f64 / 1e9))
            }),
        )?;
        encode_per_device(
            e,
            "device_serial_seconds",
            "Time the device's worker (its serial path) spent on queued requests and prefetches",
            MetricType::Counter,
            devices.iter().map(|d| {
                let ns = d.serial_ns.load(Ordering::Relaxed);
                (d.id, ConstCounter::new(ns as f64 / 1e9))
            }),
        )?;
        encode_per_device(
            e,
            "device_serial_overhead_seconds",
            "Time the device's worker spent on queued requests and prefetches beyond the \
             executor's compute and copy time",
            MetricType::Counter,
            devices.iter().map(|d| {
                let ns = d.serial_overhead_ns.load(Ordering::Relaxed);
                (d.id, ConstCounter::new(ns as f64 / 1e9))
            }),
        )?;
        encode_per_device(
            e,
            "device_train_iterations",
            "Background training iterations the device ran",
            MetricType::Counter,
            devices
                .iter()
                .map(|d| (d.id, ConstCounter::new(d.training().total_iterations))),
        )?;
        encode_per_device(
            e,
            "device_stage_iterations",
            "Iterations training stage workers completed on the device, every job",
            MetricType::Counter,
            devices.iter().map(|d| {
                let n = d.stage_counters.iterations.load(Ordering::Relaxed);
                (d.id, ConstCounter::new(n))
            }),
        )?;
        encode_per_device(
            e,
            "device_stage_samples",
            "Samples of the iterations training stage workers completed on the device",
            MetricType::Counter,
            devices.iter().map(|d| {
                let n = d.stage_counters.samples.load(Ordering::Relaxed);
                (d.id, ConstCounter::new(n))
            }),
        )?;
        encode_per_device(
            e,
            "device_stage_forward_seconds",
            "Time training stage workers' forward ops took on the device (injected slowdowns \
             included)",
            MetricType::Counter,
            devices.iter().map(|d| {
                let ns = d.stage_counters.forward_ns.load(Ordering::Relaxed);
                (d.id, ConstCounter::new(ns as f64 / 1e9))
            }),
        )?;
        encode_per_device(
            e,
            "device_stage_backward_seconds",
            "Time training stage workers' backward ops took on the device (injected slowdowns \
             included)",
            MetricType::Counter,
            devices.iter().map(|d| {
                let ns = d.stage_counters.backward_ns.load(Ordering::Relaxed);
                (d.id, ConstCounter::new(ns as f64 / 1e9))
            }),
        )?;
        encode_per_device(
            e,
            "device_stage_worker",
            "1 while a training stage worker holds the device",
            MetricType::Gauge,
            devices.iter().enumerate().map(|(i, d)| {
                (
                    d.id,
                    ConstGauge::new(core.stages.running_on(i).is_some() as u64),
                )
            }),
        )?;
        encode_per_device(
            e,
            "device_queue_depth",
            "Requests queued or running on the device",
            MetricType::Gauge,
            devices
                .iter()
                .map(|d| (d.id, ConstGauge::new(d.queued.load(Ordering::Relaxed)))),
        )?;
        encode_per_device(
            e,
            "device_training",
            "1 while the device has a background training job",
            MetricType::Gauge,
            devices
                .iter()
                .map(|d| (d.id, ConstGauge::new(d.training().model.is_some() as u64))),
        )?;
        encode_per_device(
            e,
            "device_train_iteration_seconds",
            "EWMA of the current training job's iteration time (0 without a job)",
            MetricType::Gauge,
            devices.iter().map(|d| {
                let t = d.training();
                let s = if t.model.is_some() {
                    t.iteration_ms_ewma / 1e3
                } else {
                    0.0
                };
                (d.id, ConstGauge::new(s))
            }),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_labels_are_bounded() {
        let m = Metrics::new();
        for i in 0..MODEL_LABELS_MAX {
            assert_eq!(m.model_label(&format!("m{i}")), format!("m{i}"));
        }
        assert_eq!(m.model_label("one_too_many"), OTHER_MODEL);
        assert_eq!(m.model_label("m0"), "m0", "known models keep their label");
    }

    #[test]
    fn code_labels_are_the_wire_names() {
        for code in [
            ErrorCode::BadRequest,
            ErrorCode::UnknownModel,
            ErrorCode::Busy,
            ErrorCode::DeadlineExceeded,
            ErrorCode::Internal,
        ] {
            let wire = serde_json::to_value(code).unwrap();
            assert_eq!(wire.as_str(), Some(code_label(code)));
        }
    }
}
