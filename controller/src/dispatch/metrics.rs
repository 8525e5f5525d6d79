//! The controller's Prometheus metrics: requests by model and status,
//! latency and SLO attainment per model, decision time, and gauges of what
//! the dispatcher holds. Rendered with `prometheus-client`.

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Duration;

use distmind_common::proto::{DispatchInfo, ErrorCode};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::core::Dispatcher;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelStatus {
    model: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~16 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The controller's metric families, registered once.
pub struct DispatchMetrics {
    registry: Mutex<Registry>,
    requests: Family<ModelStatus, Counter>,
    latency: Family<ModelLabel, Histogram, fn() -> Histogram>,
    slo_met: Family<ModelLabel, Counter>,
    decision: Histogram,
    attainment: Gauge<f64, AtomicU64>,
    in_flight: Gauge,
    queued: Gauge,
    held_bytes: Gauge,
    rejected: Counter,
    retried: Gauge,
    runtimes_linked: Gauge,
    prefetches: Gauge,
    evictions: Gauge,
    batches: Gauge,
    batched_requests: Gauge,
    model_switches: Gauge,
    dispatch_overhead_ms: Gauge<f64, AtomicU64>,
    pub runtimes_alive: Gauge,
    pub memservers_alive: Gauge,
    pub models: Gauge,
}

impl Default for DispatchMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The model label of requests whose model name did not resolve: client
/// input never becomes a label, so a flood of made-up names cannot grow
/// the metric families.
pub const UNRESOLVED_MODEL: &str = "(unresolved)";

/// The status label of an outcome.
pub fn status_label(code: Option<ErrorCode>) -> String {
    match code {
        None => "ok".into(),
        Some(c) => c.as_str().to_string(),
    }
}

impl DispatchMetrics {
    pub fn new() -> Self {
        let m = DispatchMetrics {
            registry: Mutex::new(Registry::with_prefix("distmind_controller")),
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            slo_met: Family::default(),
            decision: Histogram::new(exponential_buckets(1e-7, 2.0, 20)),
            attainment: Gauge::default(),
            in_flight: Gauge::default(),
            queued: Gauge::default(),
            held_bytes: Gauge::default(),
            rejected: Counter::default(),
            retried: Gauge::default(),
            runtimes_linked: Gauge::default(),
            prefetches: Gauge::default(),
            evictions: Gauge::default(),
            batches: Gauge::default(),
            batched_requests: Gauge::default(),
            model_switches: Gauge::default(),
            dispatch_overhead_ms: Gauge::default(),
            runtimes_alive: Gauge::default(),
            memservers_alive: Gauge::default(),
            models: Gauge::default(),
        };
        {
            let mut r = m.registry.lock().expect("fresh");
            r.register(
                "requests",
                "Client requests answered by the dispatcher, by model and status (ok or the error code)",
                m.requests.clone(),
            );
            r.register(
                "request_latency_seconds",
                "Arrival at the dispatcher to the reply, requests answered ok",
                m.latency.clone(),
            );
            r.register(
                "slo_met",
                "Requests answered ok within their SLO",
                m.slo_met.clone(),
            );
            r.register(
                "slo_attainment_ratio",
                "Requests answered within their SLO over requests submitted, since start",
                m.attainment.clone(),
            );
            r.register(
                "rejected",
                "Requests rejected at admission (no GPU could meet the deadline)",
                m.rejected.clone(),
            );
            r.register(
                "decision_seconds",
                "Time the dispatcher took to route one request",
                m.decision.clone(),
            );
            r.register(
                "in_flight_requests",
                "Requests held by the dispatcher",
                m.in_flight.clone(),
            );
            r.register(
                "queued_requests",
                "Requests waiting at the dispatcher for a GPU",
                m.queued.clone(),
            );
            r.register(
                "held_input_bytes",
                "Input bytes of requests not yet answered",
                m.held_bytes.clone(),
            );
            r.register(
                "retried",
                "Requests in flight on a lost GPU server sent again to another, since start",
                m.retried.clone(),
            );
            r.register(
                "runtimes_linked",
                "GPU servers the dispatcher has a link to and may send requests to",
                m.runtimes_linked.clone(),
            );
            r.register(
                "prefetches",
                "Prefetches the policy sent, since start",
                m.prefetches.clone(),
            );
            r.register(
                "evictions",
                "Cache-outs the balancer sent, since start",
                m.evictions.clone(),
            );
            r.register(
                "batches",
                "Batches sent to GPUs (a lone request is a batch of one), since start",
                m.batches.clone(),
            );
            r.register(
                "batched_requests",
                "Requests the batches carried, since start (over batches: the mean batch size)",
                m.batched_requests.clone(),
            );
            r.register(
                "model_switches",
                "Batches sent to a GPU that had to load their model, since start",
                m.model_switches.clone(),
            );
            r.register(
                "runtimes_alive",
                "GPU servers heartbeating",
                m.runtimes_alive.clone(),
            );
            r.register(
                "memservers_alive",
                "Memory servers heartbeating",
                m.memservers_alive.clone(),
            );
            r.register("models", "Models in the catalog", m.models.clone());
            r.register(
                "dispatch_overhead_ms",
                "A request's round trip from the dispatcher to a GPU server and back beyond the \
                 server's own time, smoothed",
                m.dispatch_overhead_ms.clone(),
            );
        }
        m
    }

    /// One request finished: `Ok` with its dispatch record when it ran,
    /// else its error code. `model` must be a catalog name (or
    /// [`UNRESOLVED_MODEL`]) so that the label set stays bounded.
    pub fn finished(&self, model: &str, outcome: Result<&DispatchInfo, ErrorCode>) {
        let status = status_label(outcome.err());
        if outcome == Err(ErrorCode::Rejected) {
            self.rejected.inc();
        }
        self.requests
            .get_or_create(&ModelStatus {
                model: model.to_string(),
                status,
            })
            .inc();
        if let Ok(i) = outcome {
            let label = ModelLabel {
                model: model.to_string(),
            };
            self.latency.get_or_create(&label).observe(i.total_ms / 1e3);
            if i.total_ms <= i.slo_ms {
                self.slo_met.get_or_create(&label).inc();
            }
        }
    }

    pub fn decision(&self, d: Duration) {
        self.decision.observe(d.as_secs_f64());
    }

    /// Gauges from the dispatcher's state (each tick).
    pub fn observe_dispatcher(&self, d: &Dispatcher, held_bytes: u64) {
        let c = d.counters();
        if c.submitted > 0 {
            self.attainment
                .set(c.completed_within_slo as f64 / c.submitted as f64);
        }
        self.in_flight.set(d.in_flight() as i64);
        self.queued.set(d.queued() as i64);
        self.held_bytes.set(held_bytes as i64);
        self.retried.set(c.retried as i64);
        self.runtimes_linked.set(d.runtimes_linked() as i64);
        self.prefetches.set(c.prefetches as i64);
        self.evictions.set(c.evictions as i64);
        self.batches.set(c.batches as i64);
        self.batched_requests.set(c.batched_requests as i64);
        self.model_switches.set(c.model_switches as i64);
        self.dispatch_overhead_ms
            .set(d.dispatch_overhead_us() as f64 / 1e3);
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let r = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        distmind_common::metrics::encode(&r)
    }
}
