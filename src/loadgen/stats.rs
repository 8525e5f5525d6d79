//! Outcome counting and the report: exact percentiles from sorted
//! latencies, SLO attainment and goodput, per-model counts. No IO.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};

use distmind_common::proto::{ErrorCode, ServePath};
use serde::Serialize;

/// Most latencies kept for percentiles (8 bytes each: 80 MB). Beyond it the
/// mean and counts stay exact and the report says the percentiles are of
/// the first ones.
pub const LATENCIES_STORED_MAX: usize = 10_000_000;

/// Models listed in the printed table (the JSON report has all of them).
pub const TABLE_MODELS_MAX: usize = 10;

/// What became of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Outputs came back after `latency_ms`; `slo_ms` is the objective it
    /// was held to, when known.
    Ok {
        latency_ms: f64,
        slo_ms: Option<f64>,
        /// Outputs and GPU time came from the `sim` executor (a profile).
        simulated: bool,
        /// Where the GPU server found the model (resident, host cache,
        /// memory servers), when the reply says.
        path: Option<ServePath>,
    },
    /// An error reply.
    Refused { code: ErrorCode, message: String },
    /// No reply: the connection broke or timed out with the request outstanding.
    Lost { why: String },
    /// A reply that is neither outputs nor an error.
    Unexpected { what: String },
}

/// Per-model counters, indexed like the model list.
#[derive(Debug, Clone, Default)]
pub struct ModelCounts {
    pub sent: u64,
    pub ok: u64,
    pub rejected: u64,
    pub errors: u64,
    pub latency_sum_ms: f64,
}

/// One thread's counts; merged at the end (no sharing while running).
#[derive(Debug, Clone)]
pub struct Collector {
    pub sent: u64,
    pub ok: u64,
    pub rejected: u64,
    pub deadline_exceeded: u64,
    pub busy: u64,
    /// Other error replies by code (snake_case), and `lost`, `unexpected_reply`.
    pub errors: BTreeMap<String, u64>,
    /// The first message seen per error code, to show what went wrong.
    pub error_examples: BTreeMap<String, String>,
    /// Requests that could not be sent (the connection was broken).
    pub send_failed: u64,
    /// Requests not sent because too many were outstanding (open loop).
    pub dropped_by_client: u64,
    pub latency_sum_ms: f64,
    pub latencies_ms: Vec<f64>,
    pub latencies_capped: bool,
    pub ok_slo_known: u64,
    pub ok_within_slo: u64,
    /// Ok replies marked simulated (the `sim` executor).
    pub simulated: u64,
    /// Ok replies by where the model was found.
    pub paths: PathCounts,
    pub models: Vec<ModelCounts>,
}

/// Ok replies by where the GPU server found the model: on the device, in
/// its host cache, or on the memory servers (a cold start), and the cold
/// starts' latency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PathCounts {
    pub resident: u64,
    pub host_cached: u64,
    pub cold: u64,
    pub cold_latency_sum_ms: f64,
}

impl PathCounts {
    pub fn add(&mut self, p: ServePath, latency_ms: f64) {
        match p {
            ServePath::DeviceResident => self.resident += 1,
            ServePath::HostCached => self.host_cached += 1,
            ServePath::Cold => {
                self.cold += 1;
                self.cold_latency_sum_ms += latency_ms;
            }
        }
    }

    pub fn merge(&mut self, o: PathCounts) {
        self.resident += o.resident;
        self.host_cached += o.host_cached;
        self.cold += o.cold;
        self.cold_latency_sum_ms += o.cold_latency_sum_ms;
    }

    /// Mean latency of the cold starts (`None`: there were none).
    pub fn cold_mean_ms(&self) -> Option<f64> {
        (self.cold > 0).then(|| self.cold_latency_sum_ms / self.cold as f64)
    }

    /// Replies that loaded their model onto the device (host cache or cold).
    pub fn loads(&self) -> u64 {
        self.host_cached + self.cold
    }

    pub fn total(&self) -> u64 {
        self.resident + self.loads()
    }
}

pub fn code_name(code: ErrorCode) -> String {
    code.as_str().to_string()
}

impl Collector {
    /// Turns latencies measured on a clock dilated by `k` (an emulated
    /// link) into emulated time.
    pub fn undilate(&mut self, k: f64) {
        if k == 1.0 {
            return;
        }
        self.latency_sum_ms /= k;
        self.paths.cold_latency_sum_ms /= k;
        for l in &mut self.latencies_ms {
            *l /= k;
        }
        for m in &mut self.models {
            m.latency_sum_ms /= k;
        }
    }

    pub fn new(models: usize) -> Collector {
        Collector {
            sent: 0,
            ok: 0,
            rejected: 0,
            deadline_exceeded: 0,
            busy: 0,
            errors: BTreeMap::new(),
            error_examples: BTreeMap::new(),
            send_failed: 0,
            dropped_by_client: 0,
            latency_sum_ms: 0.0,
            latencies_ms: Vec::new(),
            latencies_capped: false,
            ok_slo_known: 0,
            ok_within_slo: 0,
            simulated: 0,
            paths: PathCounts::default(),
            models: vec![ModelCounts::default(); models],
        }
    }

    pub fn sent(&mut self, model: usize) {
        self.sent += 1;
        self.models[model].sent += 1;
    }

    fn error(&mut self, key: String, message: String) {
        *self.errors.entry(key.clone()).or_default() += 1;
        self.error_examples.entry(key).or_insert(message);
    }

    /// Records one request's outcome; `stored` counts latencies kept over
    /// all collectors, to bound memory.
    pub fn record(&mut self, model: usize, outcome: Outcome, stored: &AtomicUsize) {
        let m = &mut self.models[model];
        match outcome {
            Outcome::Ok {
                latency_ms,
                slo_ms,
                simulated,
                path,
            } => {
                self.ok += 1;
                self.simulated += u64::from(simulated);
                if let Some(p) = path {
                    self.paths.add(p, latency_ms);
                }
                m.ok += 1;
                m.latency_sum_ms += latency_ms;
                self.latency_sum_ms += latency_ms;
                if stored.fetch_add(1, Ordering::Relaxed) < LATENCIES_STORED_MAX {
                    self.latencies_ms.push(latency_ms);
                } else {
                    self.latencies_capped = true;
                }
                if let Some(slo) = slo_ms {
                    self.ok_slo_known += 1;
                    if latency_ms <= slo {
                        self.ok_within_slo += 1;
                    }
                }
            }
            Outcome::Refused { code, message } => match code {
                ErrorCode::Rejected => {
                    self.rejected += 1;
                    m.rejected += 1;
                    self.error_examples
                        .entry("rejected".into())
                        .or_insert(message);
                }
                ErrorCode::DeadlineExceeded => {
                    self.deadline_exceeded += 1;
                    m.errors += 1;
                    self.error_examples
                        .entry("deadline_exceeded".into())
                        .or_insert(message);
                }
                ErrorCode::Busy => {
                    self.busy += 1;
                    m.errors += 1;
                    self.error_examples.entry("busy".into()).or_insert(message);
                }
                other => {
                    m.errors += 1;
                    self.error(code_name(other), message);
                }
            },
            Outcome::Lost { why } => {
                m.errors += 1;
                self.error("lost".into(), why);
            }
            Outcome::Unexpected { what } => {
                m.errors += 1;
                self.error("unexpected_reply".into(), what);
            }
        }
    }

    pub fn merge(&mut self, o: Collector) {
        self.sent += o.sent;
        self.ok += o.ok;
        self.rejected += o.rejected;
        self.deadline_exceeded += o.deadline_exceeded;
        self.busy += o.busy;
        for (k, v) in o.errors {
            *self.errors.entry(k).or_default() += v;
        }
        for (k, v) in o.error_examples {
            self.error_examples.entry(k).or_insert(v);
        }
        self.send_failed += o.send_failed;
        self.dropped_by_client += o.dropped_by_client;
        self.latency_sum_ms += o.latency_sum_ms;
        self.latencies_ms.extend(o.latencies_ms);
        self.latencies_capped |= o.latencies_capped;
        self.ok_slo_known += o.ok_slo_known;
        self.ok_within_slo += o.ok_within_slo;
        self.simulated += o.simulated;
        self.paths.merge(o.paths);
        for (m, x) in self.models.iter_mut().zip(o.models) {
            m.sent += x.sent;
            m.ok += x.ok;
            m.rejected += x.rejected;
            m.errors += x.errors;
            m.latency_sum_ms += x.latency_sum_ms;
        }
    }
}

/// Exact nearest-rank percentile of an ascending sample: the smallest value
/// with at least `p`% of the sample at or below it. `None` for no sample.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Latency of the requests answered with outputs, in ms.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LatencySummary {
    /// Requests the mean is over (all ok requests).
    pub count: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p75_ms: f64,
    pub p90_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Latencies the percentiles are over (fewer than `count` when capped).
    pub samples: u64,
    /// More than [`LATENCIES_STORED_MAX`] ok requests: percentiles are of the first ones.
    pub capped: bool,
}

impl LatencySummary {
    /// Sorts `latencies` (the stored sample) and summarises; `count` and
    /// `sum_ms` are over every ok request.
    pub fn new(mut latencies: Vec<f64>, count: u64, sum_ms: f64, capped: bool) -> Self {
        latencies.sort_by(|a, b| a.total_cmp(b));
        let p = |q| percentile(&latencies, q).unwrap_or(0.0);
        LatencySummary {
            count,
            mean_ms: if count == 0 {
                0.0
            } else {
                sum_ms / count as f64
            },
            p50_ms: p(50.0),
            p75_ms: p(75.0),
            p90_ms: p(90.0),
            p95_ms: p(95.0),
            p99_ms: p(99.0),
            max_ms: latencies.last().copied().unwrap_or(0.0),
            samples: latencies.len() as u64,
            capped,
        }
    }
}

/// SLO attainment: ok within its SLO over everything sent.
#[derive(Debug, Clone, Serialize)]
pub struct SloSummary {
    /// `ok_within_slo / sent` (0 when nothing was sent).
    pub attainment: f64,
    /// Ok within SLO per second of the run.
    pub goodput_rps: f64,
    pub ok_within_slo: u64,
    /// Ok requests whose SLO was unknown (neither the dispatcher's record
    /// nor --slo-ms / the trace named one); they count as misses.
    pub ok_slo_unknown: u64,
}

/// `(attainment, goodput)`: ok within SLO over sent, and per second.
pub fn attainment_goodput(ok_within_slo: u64, sent: u64, elapsed_s: f64) -> (f64, f64) {
    let attainment = if sent == 0 {
        0.0
    } else {
        ok_within_slo as f64 / sent as f64
    };
    let goodput = if elapsed_s > 0.0 {
        ok_within_slo as f64 / elapsed_s
    } else {
        0.0
    };
    (attainment, goodput)
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    pub model: String,
    pub sent: u64,
    pub ok: u64,
    pub rejected: u64,
    /// Every other outcome that is not ok (errors, lost).
    pub errors: u64,
    pub mean_ms: f64,
}

/// What a load-generator run measured (`--json` writes it).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// closed, poisson or trace.
    pub mode: String,
    /// The dispatcher's client address.
    pub target: String,
    /// Closed-loop threads or open-loop connections.
    pub connections: usize,
    /// Requests per second asked for (poisson).
    pub rate_rps: Option<f64>,
    /// The sending window asked for (`None`: the whole trace / until the request count).
    pub duration_s: Option<f64>,
    /// Start to the last reply (or give-up).
    pub elapsed_s: f64,
    pub batch: usize,
    pub zipf_s: Option<f64>,
    pub slo_ms: Option<u64>,
    pub seed: u64,
    /// Stopped early by Ctrl-C.
    pub interrupted: bool,
    pub sent: u64,
    pub ok: u64,
    pub rejected: u64,
    pub deadline_exceeded: u64,
    pub busy: u64,
    /// Other error replies by code, plus `lost` (no reply) and `unexpected_reply`.
    pub errors: BTreeMap<String, u64>,
    /// One message per error kind, as received.
    pub error_examples: BTreeMap<String, String>,
    pub send_failed: u64,
    /// Not sent: the outstanding bound was reached (open loop only).
    pub dropped_by_client: u64,
    /// Ok replies whose GPU time was simulated from a profile (`sim`
    /// executor): their latencies are not measurements of a GPU.
    pub simulated: u64,
    /// Ok replies by where the model was found (replies that said).
    pub paths: PathCounts,
    /// Ok requests per second of `elapsed_s`.
    pub throughput_rps: f64,
    /// The emulated link the times are reported for (`None`: real time).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub emulated_link: Option<String>,
    pub latency: LatencySummary,
    /// Present when some SLO was known (the dispatcher's record, --slo-ms or the trace).
    pub slo: Option<SloSummary>,
    /// Every model that was sent to, most requests first.
    pub models: Vec<ModelReport>,
}

/// What the run was, for [`Report::build`].
pub struct RunInfo<'a> {
    pub mode: &'a str,
    pub target: &'a str,
    pub connections: usize,
    pub rate_rps: Option<f64>,
    pub duration_s: Option<f64>,
    pub elapsed_s: f64,
    pub batch: usize,
    pub zipf_s: Option<f64>,
    pub slo_ms: Option<u64>,
    pub seed: u64,
    pub interrupted: bool,
    pub model_names: &'a [String],
}

impl Report {
    pub fn build(info: RunInfo<'_>, c: Collector) -> Report {
        let mut models: Vec<ModelReport> = info
            .model_names
            .iter()
            .zip(&c.models)
            .filter(|(_, m)| m.sent > 0)
            .map(|(name, m)| ModelReport {
                model: name.clone(),
                sent: m.sent,
                ok: m.ok,
                rejected: m.rejected,
                errors: m.errors,
                mean_ms: if m.ok == 0 {
                    0.0
                } else {
                    m.latency_sum_ms / m.ok as f64
                },
            })
            .collect();
        models.sort_by(|a, b| b.sent.cmp(&a.sent).then_with(|| a.model.cmp(&b.model)));
        let slo = (c.ok_slo_known > 0 || info.slo_ms.is_some()).then(|| {
            let (attainment, goodput_rps) =
                attainment_goodput(c.ok_within_slo, c.sent, info.elapsed_s);
            SloSummary {
                attainment,
                goodput_rps,
                ok_within_slo: c.ok_within_slo,
                ok_slo_unknown: c.ok - c.ok_slo_known,
            }
        });
        Report {
            mode: info.mode.to_string(),
            target: info.target.to_string(),
            connections: info.connections,
            rate_rps: info.rate_rps,
            duration_s: info.duration_s,
            elapsed_s: info.elapsed_s,
            batch: info.batch,
            zipf_s: info.zipf_s,
            slo_ms: info.slo_ms,
            seed: info.seed,
            interrupted: info.interrupted,
            sent: c.sent,
            ok: c.ok,
            rejected: c.rejected,
            deadline_exceeded: c.deadline_exceeded,
            busy: c.busy,
            errors: c.errors,
            error_examples: c.error_examples,
            send_failed: c.send_failed,
            dropped_by_client: c.dropped_by_client,
            simulated: c.simulated,
            paths: c.paths,
            emulated_link: None,
            throughput_rps: if info.elapsed_s > 0.0 {
                c.ok as f64 / info.elapsed_s
            } else {
                0.0
            },
            latency: LatencySummary::new(
                c.latencies_ms,
                c.ok,
                c.latency_sum_ms,
                c.latencies_capped,
            ),
            slo,
            models,
        }
    }

    /// Every error reply that is not a rejection, plus lost requests.
    pub fn other_errors(&self) -> u64 {
        self.deadline_exceeded + self.busy + self.errors.values().sum::<u64>()
    }

    /// The printed report: a table, then the original client's lines, then
    /// `All threads finished.` alone on the last line.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let l = &self.latency;
        let _ = writeln!(
            s,
            "\n== load: {} against {}, {} connection{}{}{}, {:.1} s{} ==",
            self.mode,
            self.target,
            self.connections,
            if self.connections == 1 { "" } else { "s" },
            self.rate_rps
                .map(|r| format!(", {r} req/s"))
                .unwrap_or_default(),
            self.zipf_s
                .map(|z| format!(", zipf {z}"))
                .unwrap_or_default(),
            self.elapsed_s,
            if self.interrupted {
                " (interrupted)"
            } else {
                ""
            }
        );
        if let Some(e) = &self.emulated_link {
            let _ = writeln!(
                s,
                "  times and rates in emulated time: {e} (measured latencies / K, rates x K)"
            );
        }
        let _ = writeln!(s, "  {:<22}{:>10}", "sent", self.sent);
        let _ = writeln!(s, "  {:<22}{:>10}", "ok", self.ok);
        let _ = writeln!(s, "  {:<22}{:>10}", "rejected (admission)", self.rejected);
        let _ = writeln!(s, "  {:<22}{:>10}", "other errors", self.other_errors());
        let mut by_code: Vec<(String, u64)> = self.errors.clone().into_iter().collect();
        if self.deadline_exceeded > 0 {
            by_code.push(("deadline_exceeded".into(), self.deadline_exceeded));
        }
        if self.busy > 0 {
            by_code.push(("busy".into(), self.busy));
        }
        by_code.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        for (code, n) in &by_code {
            let example = self
                .error_examples
                .get(code)
                .map(|m| format!("  e.g. {}", truncate(m, 100)))
                .unwrap_or_default();
            let _ = writeln!(s, "    {code:<20}{n:>10}{example}");
        }
        if let Some(m) = self.error_examples.get("rejected") {
            let _ = writeln!(s, "    (rejected, e.g. {})", truncate(m, 100));
        }
        if self.send_failed > 0 {
            let _ = writeln!(s, "  {:<22}{:>10}", "send failed", self.send_failed);
        }
        if self.dropped_by_client > 0 || self.rate_rps.is_some() {
            let _ = writeln!(
                s,
                "  {:<22}{:>10}  (not sent: too many outstanding)",
                "dropped by client", self.dropped_by_client
            );
        }
        let _ = writeln!(
            s,
            "  {:<22}{:>10.2} ok/s",
            "throughput", self.throughput_rps
        );
        let _ = writeln!(
            s,
            "  {:<22}mean {:.2}  p50 {:.2}  p90 {:.2}  p95 {:.2}  p99 {:.2}  max {:.2}{}",
            "latency of ok (ms)",
            l.mean_ms,
            l.p50_ms,
            l.p90_ms,
            l.p95_ms,
            l.p99_ms,
            l.max_ms,
            if l.capped {
                format!(" (percentiles of the first {} only)", l.samples)
            } else {
                String::new()
            }
        );
        let p = &self.paths;
        if p.total() > 0 {
            let pct = |n: u64| 100.0 * n as f64 / p.total() as f64;
            let _ = writeln!(
                s,
                "  {:<22}{:>10}  resident {:.1}%, host cache {:.1}%, cold (memory servers) {:.1}%",
                "model found",
                p.total(),
                pct(p.resident),
                pct(p.host_cached),
                pct(p.cold)
            );
        }
        if self.simulated > 0 {
            let _ = writeln!(
                s,
                "  {:<22}{:>10}  of the ok replies: sim executor, GPU time from a profile, not measured",
                "simulated", self.simulated
            );
        }
        match &self.slo {
            Some(slo) => {
                let _ = writeln!(
                    s,
                    "  {:<22}{:>9.1}%  ({} of {} sent finished within their SLO{})",
                    "SLO attainment",
                    slo.attainment * 100.0,
                    slo.ok_within_slo,
                    self.sent,
                    if slo.ok_slo_unknown > 0 {
                        format!("; {} ok without a known SLO", slo.ok_slo_unknown)
                    } else {
                        String::new()
                    }
                );
                let _ = writeln!(
                    s,
                    "  {:<22}{:>10.2} ok/s within SLO",
                    "goodput", slo.goodput_rps
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    "  {:<22}      n/a  (no SLO known: pass --slo-ms or set slo_ms in controller.json)",
                    "SLO attainment"
                );
            }
        }
        if !self.models.is_empty() {
            let shown = self.models.len().min(TABLE_MODELS_MAX);
            let _ = writeln!(
                s,
                "  per model (top {shown} of {} by requests):",
                self.models.len()
            );
            let _ = writeln!(
                s,
                "    {:<32}{:>8}{:>8}{:>10}{:>8}{:>10}",
                "model", "sent", "ok", "rejected", "errors", "mean ms"
            );
            for m in &self.models[..shown] {
                let _ = writeln!(
                    s,
                    "    {:<32}{:>8}{:>8}{:>10}{:>8}{:>10.2}",
                    m.model, m.sent, m.ok, m.rejected, m.errors, m.mean_ms
                );
            }
        }
        let _ = writeln!(
            s,
            "Average Throughput ({}/{}): {:.2} rps",
            self.ok, self.sent, self.throughput_rps
        );
        let _ = writeln!(s, "Average Latency: {:.2} ms", l.mean_ms);
        for (name, v) in [
            ("99th", l.p99_ms),
            ("95th", l.p95_ms),
            ("90th", l.p90_ms),
            ("75th", l.p75_ms),
            ("50th", l.p50_ms),
        ] {
            let _ = writeln!(s, "{name} Latency: {v:.2} ms");
        }
        let _ = writeln!(s, "Total get: {}", self.ok);
        let _ = writeln!(s, "Total sent: {}", self.sent);
        let _ = writeln!(s, "All threads finished.");
        s
    }
}

fn truncate(s: &str, max: usize) -> String {
    let one_line = s.replace('\n', " ");
    if one_line.chars().count() <= max {
        one_line
    } else {
        let cut: String = one_line.chars().take(max).collect();
        format!("{cut}...")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&xs, 50.0), Some(50.0));
        assert_eq!(percentile(&xs, 99.0), Some(99.0));
        assert_eq!(percentile(&xs, 100.0), Some(100.0));
        assert_eq!(percentile(&xs, 0.0), Some(1.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        let xs = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&xs, 50.0), Some(2.0));
        assert_eq!(percentile(&xs, 75.0), Some(3.0));
        assert_eq!(percentile(&xs, 76.0), Some(4.0));
        let s = LatencySummary::new(vec![3.0, 1.0, 2.0], 3, 6.0, false);
        assert_eq!(
            (s.mean_ms, s.p50_ms, s.max_ms, s.samples),
            (2.0, 2.0, 3.0, 3)
        );
    }

    #[test]
    fn attainment_and_goodput() {
        assert_eq!(attainment_goodput(90, 100, 10.0), (0.9, 9.0));
        assert_eq!(attainment_goodput(0, 0, 0.0), (0.0, 0.0));

        let stored = AtomicUsize::new(0);
        let mut a = Collector::new(2);
        let mut b = Collector::new(2);
        for _ in 0..4 {
            a.sent(0);
        }
        b.sent(1);
        let ok = |latency_ms, slo_ms| Outcome::Ok {
            latency_ms,
            slo_ms,
            simulated: false,
            path: None,
        };
        a.record(0, ok(10.0, Some(20.0)), &stored);
        a.record(0, ok(30.0, Some(20.0)), &stored);
        a.record(
            0,
            Outcome::Refused {
                code: ErrorCode::Rejected,
                message: "no GPU can finish it in 20 ms".into(),
            },
            &stored,
        );
        a.record(
            0,
            Outcome::Refused {
                code: ErrorCode::Internal,
                message: "boom".into(),
            },
            &stored,
        );
        b.record(1, ok(5.0, None), &stored);
        a.merge(b);
        let r = Report::build(
            RunInfo {
                mode: "poisson",
                target: "x",
                connections: 1,
                rate_rps: Some(1.0),
                duration_s: Some(2.0),
                elapsed_s: 2.0,
                batch: 1,
                zipf_s: Some(0.9),
                slo_ms: None,
                seed: 0,
                interrupted: false,
                model_names: &["a".to_string(), "b".to_string()],
            },
            a,
        );
        assert_eq!((r.sent, r.ok, r.rejected, r.other_errors()), (5, 3, 1, 1));
        assert_eq!(r.errors["internal"], 1);
        let slo = r.slo.as_ref().unwrap();
        // One of the five sent finished within its SLO; b's had none.
        assert_eq!(slo.ok_within_slo, 1);
        assert_eq!(slo.ok_slo_unknown, 1);
        assert!((slo.attainment - 0.2).abs() < 1e-12);
        assert!((slo.goodput_rps - 0.5).abs() < 1e-12);
        assert_eq!(r.throughput_rps, 1.5);
        assert_eq!(r.latency.mean_ms, 15.0);
        assert_eq!(r.models[0].model, "a");
        assert_eq!(r.models[0].mean_ms, 20.0);
        let text = r.render();
        assert!(text.contains("Average Throughput (3/5): 1.50 rps"));
        assert!(text.contains("Total get: 3\nTotal sent: 5\nAll threads finished.\n"));
        assert!(text.ends_with("All threads finished.\n"));
    }

    #[test]
    fn latencies_are_capped_not_unbounded() {
        let stored = AtomicUsize::new(LATENCIES_STORED_MAX);
        let mut c = Collector::new(1);
        c.record(
            0,
            Outcome::Ok {
                latency_ms: 1.0,
                slo_ms: None,
                simulated: true,
                path: Some(ServePath::Cold),
            },
            &stored,
        );
        assert!(c.latencies_capped);
        assert!(c.latencies_ms.is_empty());
        assert_eq!((c.ok, c.simulated, c.paths.cold), (1, 1, 1));
    }
}
