//! The memory server's Prometheus metrics (prometheus-client), served on
//! `--metrics-listen` by [`distmind_common::metrics::serve`].
//!
//! Series (all prefixed `memserver_`):
//!
//! | name | type | meaning |
//! |---|---|---|
//! | `requests_total{op,status}` | counter | requests by `op` (`alloc`, `commit`, `free`, `stats`, `write`, `read`, `data_paths`, `verbs_connect`, `invalid`) and `status` (`ok`, or the error: an [`ErrorCode`] in snake case for control requests; `out_of_range`, `bad_request` or `aborted` (the reply could not be sent) for reads) |
//! | `reads_served_total` | counter | reads whose reply was sent in full (the same counter as `requests_total{op="read",status="ok"}`) |
//! | `bytes_served_total` | counter | bytes of those replies |
//! | `bytes_committed_total` | counter | bytes committed: the requested length of each extent whose checksum matched |
//! | `alloc_failures_total` | counter | allocations the arena refused (full, fragmented, bad size) |
//! | `connections` | gauge | open connections |
//! | `connections_refused_total` | counter | connections closed at once at the connection bound |
//! | `handshakes_refused_total` | counter | connections whose handshake failed |
//! | `read_bytes_in_flight` | gauge | bytes of read replies being sent |
//! | `capacity_bytes`, `used_bytes`, `largest_free_bytes` | gauge | the arena |
//! | `extents` | gauge | live extents (any state) |
//! | `one_sided_paths{path}` | gauge | 1 for each one-sided data path served (`fabric`, `verbs`) |
//! | `verbs_queue_pairs` | gauge | verbs queue pairs connected to clients |
//! | `free_grace_extents` | gauge | freed extents held for one-sided readers (`onesided::FREE_GRACE`) |
//! | `sample_requests_total{op,status}` | counter | sample-service requests by `op` (`prep`, `profile`, `extract`, `info`, `invalid`) and `status` (`ok` or the error) |
//! | `sample_bytes_sent_total{op}` | counter | bytes of the sample service's `Bytes` frames (payload only: the JSON replies and frame headers are not counted) |
//! | `samples_processed_total{op}`, `samples_failed_total{op}` | counter | samples preprocessed, profiled or extracted, and those that failed (corrupt, not an image) |
//!
//! The data path only adds to pre-created counters (one relaxed atomic add
//! each; no lock, no allocation, no label lookup). Control-request errors
//! look their series up by label (they parse JSON anyway). The arena gauges
//! are read from the extent table once per scrape.

use std::borrow::Cow;

use distmind_common::proto::ErrorCode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Prefix of every memory-server series.
pub const METRICS_PREFIX: &str = "memserver";

/// The request kinds counted in `memserver_requests_total`.
/// The `op` label of the sample service's series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SampleOpLabel {
    pub op: &'static str,
}

/// The `op` and `status` labels of `sample_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SampleRequestLabels {
    pub op: &'static str,
    pub status: Cow<'static, str>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Alloc,
    Commit,
    Free,
    Stats,
    /// A write-chunk frame (no reply; a rejection is reported at the commit).
    Write,
    /// A data-path read request.
    Read,
    /// A query of the one-sided data paths offered.
    DataPaths,
    /// A verbs queue-pair connection.
    VerbsConnect,
    /// A control frame that was not a memory-server request (never `ok`;
    /// keep it last: the ops before it index the pre-created `ok` counters).
    Invalid,
}

impl Op {
    /// Every op, in label order.
    pub const ALL: [Op; 9] = [
        Op::Alloc,
        Op::Commit,
        Op::Free,
        Op::Stats,
        Op::Write,
        Op::Read,
        Op::DataPaths,
        Op::VerbsConnect,
        Op::Invalid,
    ];

    /// The `op` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Alloc => "alloc",
            Op::Commit => "commit",
            Op::Free => "free",
            Op::Stats => "stats",
            Op::Write => "write",
            Op::Read => "read",
            Op::DataPaths => "data_paths",
            Op::VerbsConnect => "verbs_connect",
            Op::Invalid => "invalid",
        }
    }
}

/// The `status` label of a successful request.
pub const STATUS_OK: &str = "ok";
/// Read status: the range is not inside one committed extent.
pub const STATUS_OUT_OF_RANGE: &str = "out_of_range";
/// Read status: the request was malformed (the connection is closed).
pub const STATUS_BAD_REQUEST: &str = "bad_request";
/// Read status: the reply could not be sent in full (peer gone or too slow).
pub const STATUS_ABORTED: &str = "aborted";

/// Labels of `memserver_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    op: &'static str,
    status: Cow<'static, str>,
}

/// The `status` label of a control-request error: the [`ErrorCode`] in
/// snake case, as on the wire (`BadRequest` -> `bad_request`).
pub fn error_status(code: ErrorCode) -> String {
    code.as_str().to_string()
}

/// Every metric of one memory server, and the registry that encodes them.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    /// `requests_total{op,status="ok"}` of every op but `Invalid`, indexed
    /// like [`Op::ALL`].
    ok: [Counter; Op::ALL.len() - 1],
    pub reads_served: Counter,
    pub reads_out_of_range: Counter,
    pub reads_bad_request: Counter,
    pub reads_aborted: Counter,
    pub bytes_served: Counter,
    pub bytes_committed: Counter,
    pub alloc_failures: Counter,
    pub connections: Gauge,
    pub connections_refused: Counter,
    pub handshakes_refused: Counter,
    pub read_bytes_in_flight: Gauge,
    pub capacity_bytes: Gauge,
    pub used_bytes: Gauge,
    pub largest_free_bytes: Gauge,
    pub extents: Gauge,
    pub one_sided_paths: Family<PathLabels, Gauge>,
    pub verbs_queue_pairs: Gauge,
    pub free_grace_extents: Gauge,
    pub sample_requests: Family<SampleRequestLabels, Counter>,
    pub sample_bytes_sent: Family<SampleOpLabel, Counter>,
    pub samples_processed: Family<SampleOpLabel, Counter>,
    pub samples_failed: Family<SampleOpLabel, Counter>,
}

/// The label of `one_sided_paths`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PathLabels {
    pub path: &'static str,
}

fn labels(op: Op, status: impl Into<Cow<'static, str>>) -> RequestLabels {
    RequestLabels {
        op: op.as_str(),
        status: status.into(),
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let requests = Family::<RequestLabels, Counter>::default();
        let ok =
            std::array::from_fn(|i| requests.get_or_create_owned(&labels(Op::ALL[i], STATUS_OK)));
        let read = |status: &'static str| requests.get_or_create_owned(&labels(Op::Read, status));
        let mut m = Metrics {
            registry: Registry::with_prefix(METRICS_PREFIX),
            reads_served: read(STATUS_OK),
            reads_out_of_range: read(STATUS_OUT_OF_RANGE),
            reads_bad_request: read(STATUS_BAD_REQUEST),
            reads_aborted: read(STATUS_ABORTED),
            requests,
            ok,
            bytes_served: Counter::default(),
            bytes_committed: Counter::default(),
            alloc_failures: Counter::default(),
            connections: Gauge::default(),
            connections_refused: Counter::default(),
            handshakes_refused: Counter::default(),
            read_bytes_in_flight: Gauge::default(),
            capacity_bytes: Gauge::default(),
            used_bytes: Gauge::default(),
            largest_free_bytes: Gauge::default(),
            extents: Gauge::default(),
            one_sided_paths: Family::default(),
            verbs_queue_pairs: Gauge::default(),
            free_grace_extents: Gauge::default(),
            sample_requests: Family::default(),
            sample_bytes_sent: Family::default(),
            samples_processed: Family::default(),
            samples_failed: Family::default(),
        };
        let r = &mut m.registry;
        r.register(
            "requests",
            "Requests by op and status (ok, or the error)",
            m.requests.clone(),
        );
        r.register(
            "reads_served",
            "Reads whose reply was sent in full",
            m.reads_served.clone(),
        );
        r.register(
            "bytes_served",
            "Bytes of read replies sent in full",
            m.bytes_served.clone(),
        );
        r.register(
            "bytes_committed",
            "Bytes of extents committed after their checksum matched",
            m.bytes_committed.clone(),
        );
        r.register(
            "alloc_failures",
            "Allocations the arena refused",
            m.alloc_failures.clone(),
        );
        r.register("connections", "Open connections", m.connections.clone());
        r.register(
            "one_sided_paths",
            "1 for each one-sided data path served besides tcp",
            m.one_sided_paths.clone(),
        );
        r.register(
            "verbs_queue_pairs",
            "Verbs queue pairs connected to clients",
            m.verbs_queue_pairs.clone(),
        );
        r.register(
            "free_grace_extents",
            "Freed extents held for one-sided readers before their space is reused",
            m.free_grace_extents.clone(),
        );
        r.register(
            "sample_requests",
            "Sample-service requests by op and status (ok, or the error)",
            m.sample_requests.clone(),
        );
        r.register(
            "sample_bytes_sent",
            "Bytes of the sample service's data frames (payload only)",
            m.sample_bytes_sent.clone(),
        );
        r.register(
            "samples_processed",
            "Samples preprocessed, profiled or extracted",
            m.samples_processed.clone(),
        );
        r.register(
            "samples_failed",
            "Samples that could not be processed (corrupt, not an image)",
            m.samples_failed.clone(),
        );
        r.register(
            "connections_refused",
            "Connections closed at once because the connection bound was reached",
            m.connections_refused.clone(),
        );
        r.register(
            "handshakes_refused",
            "Connections whose cluster-key handshake failed",
            m.handshakes_refused.clone(),
        );
        r.register(
            "read_bytes_in_flight",
            "Bytes of read replies being sent",
            m.read_bytes_in_flight.clone(),
        );
        r.register(
            "capacity_bytes",
            "Size of the arena",
            m.capacity_bytes.clone(),
        );
        r.register(
            "used_bytes",
            "Bytes of the arena in extents",
            m.used_bytes.clone(),
        );
        r.register(
            "largest_free_bytes",
            "Largest free run of the arena",
            m.largest_free_bytes.clone(),
        );
        r.register(
            "extents",
            "Live extents (writing, committed or being freed)",
            m.extents.clone(),
        );
        m
    }

    /// Counts a successful request (lock-free).
    pub fn ok(&self, op: Op) {
        // `Op::ALL` lists every variant in declaration order.
        match self.ok.get(op as usize) {
            Some(counter) => counter.inc(),
            None => self.requests.get_or_create(&labels(op, STATUS_OK)).inc(),
        };
    }

    /// Counts a failed control request (takes the family's lock: not for
    /// the data path).
    pub fn error(&self, op: Op, code: ErrorCode) {
        self.requests
            .get_or_create(&labels(op, error_status(code)))
            .inc();
    }

    /// Counts one sample-service request.
    pub fn sample_request(&self, op: &'static str, status: impl Into<Cow<'static, str>>) {
        self.sample_requests
            .get_or_create(&SampleRequestLabels {
                op,
                status: status.into(),
            })
            .inc();
    }

    /// The OpenMetrics text of every series (set the gauges first).
    pub fn encode(&self) -> String {
        distmind_common::metrics::encode(&self.registry)
    }
}

/// Saturating conversion for gauges, which are `i64`.
pub(crate) fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::metrics::sample_value;

    #[test]
    fn ops_index_their_ok_counters() {
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{op:?}");
        }
        assert_eq!(Op::ALL.last(), Some(&Op::Invalid));
    }

    #[test]
    fn error_codes_are_snake_case_like_the_wire() {
        assert_eq!(error_status(ErrorCode::BadRequest), "bad_request");
        assert_eq!(error_status(ErrorCode::Full), "full");
        assert_eq!(
            error_status(ErrorCode::ChecksumMismatch),
            "checksum_mismatch"
        );
    }

    #[test]
    fn series_exist_from_the_start_and_count() {
        let m = Metrics::new();
        let text = m.encode();
        for op in &Op::ALL[..Op::ALL.len() - 1] {
            assert_eq!(
                sample_value(
                    &text,
                    "memserver_requests_total",
                    &[("op", op.as_str()), ("status", "ok")]
                ),
                Some(0.0),
                "{text}"
            );
        }
        m.ok(Op::Read);
        m.bytes_served.inc_by(4096);
        m.error(Op::Alloc, ErrorCode::Full);
        m.error(Op::Alloc, ErrorCode::Full);
        m.used_bytes.set(512);
        let text = m.encode();
        assert!(!text.contains("op=\"invalid\",status=\"ok\""), "{text}");
        let v = |name, labels: &[(&str, &str)]| sample_value(&text, name, labels);
        assert_eq!(v("memserver_reads_served_total", &[]), Some(1.0), "{text}");
        assert_eq!(
            v(
                "memserver_requests_total",
                &[("op", "read"), ("status", "ok")]
            ),
            Some(1.0)
        );
        assert_eq!(
            v(
                "memserver_requests_total",
                &[("op", "alloc"), ("status", "full")]
            ),
            Some(2.0)
        );
        assert_eq!(v("memserver_bytes_served_total", &[]), Some(4096.0));
        assert_eq!(v("memserver_used_bytes", &[]), Some(512.0));
        assert!(text.ends_with("# EOF\n"));
    }
}
