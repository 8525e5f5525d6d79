//! `distmind up --csv`: one experiment's results as one CSV row, the input
//! of `distmind plot`. The header is written when the file is new; a file
//! with other columns is refused rather than mixed.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context};

use crate::loadgen::Report;

/// The columns, in order.
pub const HEADER: &str = "test,system,family,models,devices,zipf,period_s,cache_mib,mode,concurrency,rate_rps,duration_s,\
sent,ok,rejected,deadline_exceeded,busy,other_errors,throughput_rps,lat_mean_ms,lat_p50_ms,lat_p90_ms,lat_p95_ms,\
lat_p99_ms,slo_attainment,goodput_rps,runtime_rss_mib,executor,profile,batch,link,dilation,loopback,source,\
served_resident,served_host_cached,served_cold,lat_cold_mean_ms,serial_overhead_ms";

/// What the run was (the report says what happened).
#[derive(Debug, Clone)]
pub struct Row {
    pub test: String,
    /// The system's name or the run's label (e.g. distmind_cache).
    pub system: String,
    /// A family name, or `mixed`.
    pub family: String,
    pub models: usize,
    pub devices: u32,
    pub zipf: f64,
    pub period_s: f64,
    pub cache_bytes: u64,
    /// cpu, sim or cuda.
    pub executor: String,
    /// The sim executor's profile and its source, `-` otherwise.
    pub profile: String,
    /// The GPU server's resident memory at the end of the run.
    pub runtime_rss_bytes: Option<u64>,
    /// The network: `loopback` (real, unshaped) or the emulated link's rate
    /// (`100gbit`); times and rates of an emulated run are emulated time.
    pub link: String,
    /// K of the emulated link (1 on plain loopback).
    pub dilation: f64,
    /// The rate each host's bucket held on loopback (`-` without emulation).
    pub loopback: String,
    /// How the figures were produced: `processes` (real processes and
    /// sockets; GPU time per the executor column) or `simulated`
    /// (`distmind simulate`).
    pub source: String,
    /// Per request the GPU server answered with outputs, the time its
    /// devices' serial paths spent beyond the executor's compute and copy
    /// time ([`serial_overhead_ms`]), in the run's time like every time of
    /// the row (emulated: wall time / K); `None` (an empty cell) when not
    /// measured (the simulator has no serial path of its own).
    pub serial_overhead_ms: Option<f64>,
}

/// Milliseconds of serial-path overhead per request served, from a
/// runtime's `/metrics` text: `device_serial_overhead_seconds_total` summed
/// over its devices, over `requests_total{status="ok"}` summed over its
/// models. `None` when it served nothing or the text lacks either.
pub fn serial_overhead_ms(metrics_text: &str) -> Option<f64> {
    let samples = super::metrics::parse_samples(metrics_text);
    let sum = |name: &str, pred: &dyn Fn(&super::Sample) -> bool| {
        samples
            .iter()
            .filter(|s| s.name == name && pred(s))
            .map(|s| s.value)
            .fold(None, |acc: Option<f64>, v| Some(acc.unwrap_or(0.0) + v))
    };
    let overhead = sum(
        "distmind_runtime_device_serial_overhead_seconds_total",
        &|_| true,
    )?;
    let served = sum("distmind_runtime_requests_total", &|s| {
        s.has("status", "ok")
    })?;
    (served > 0.0).then(|| overhead * 1e3 / served)
}

/// The dispatcher's round trip to a GPU server beyond the server's own
/// time, ms, as the controller learnt it, from the controller's
/// `/metrics` text (`dispatch_overhead_ms`); `None` before any answer.
pub fn dispatch_overhead_ms(metrics_text: &str) -> Option<f64> {
    super::metrics::parse_samples(metrics_text)
        .iter()
        .find(|s| s.name == "distmind_controller_dispatch_overhead_ms")
        .map(|s| s.value)
        .filter(|&ms| ms > 0.0)
}

/// Refuses text that would break the row (commas, quotes, newlines).
fn field(name: &str, v: &str) -> anyhow::Result<String> {
    if v.is_empty() || v.contains([',', '"', '\n', '\r']) {
        bail!("the CSV column {name} cannot hold {v:?} (empty, or a comma, quote or newline)");
    }
    Ok(v.to_string())
}

/// The row's text, without a newline.
pub fn format(row: &Row, r: &Report) -> anyhow::Result<String> {
    let (attain, goodput) = r.slo.as_ref().map_or((String::new(), String::new()), |s| {
        (
            format!("{:.4}", s.attainment),
            format!("{:.3}", s.goodput_rps),
        )
    });
    let other: u64 = r.errors.values().sum::<u64>() + r.send_failed;
    let l = &r.latency;
    let cols = [
        field("test", &row.test)?,
        field("system", &row.system)?,
        field("family", &row.family)?,
        row.models.to_string(),
        row.devices.to_string(),
        row.zipf.to_string(),
        row.period_s.to_string(),
        (row.cache_bytes >> 20).to_string(),
        field("mode", &r.mode)?,
        r.connections.to_string(),
        r.rate_rps.map_or(String::new(), |x| x.to_string()),
        format!("{:.3}", r.elapsed_s),
        r.sent.to_string(),
        r.ok.to_string(),
        r.rejected.to_string(),
        r.deadline_exceeded.to_string(),
        r.busy.to_string(),
        other.to_string(),
        format!("{:.3}", r.throughput_rps),
        format!("{:.3}", l.mean_ms),
        format!("{:.3}", l.p50_ms),
        format!("{:.3}", l.p90_ms),
        format!("{:.3}", l.p95_ms),
        format!("{:.3}", l.p99_ms),
        attain,
        goodput,
        row.runtime_rss_bytes
            .map_or(String::new(), |b| (b >> 20).to_string()),
        field("executor", &row.executor)?,
        field("profile", &row.profile)?,
        r.batch.to_string(),
        field("link", &row.link)?,
        format!("{:.4}", row.dilation),
        field("loopback", &row.loopback)?,
        field("source", &row.source)?,
        r.paths.resident.to_string(),
        r.paths.host_cached.to_string(),
        r.paths.cold.to_string(),
        r.paths
            .cold_mean_ms()
            .map_or(String::new(), |m| format!("{m:.3}")),
        row.serial_overhead_ms
            .map_or(String::new(), |m| format!("{m:.4}")),
    ];
    Ok(cols.join(","))
}

/// Appends `row` to the CSV at `path` (created, with the header, when
/// missing; its directory too).
pub fn append(path: &Path, row: &Row, report: &Report) -> anyhow::Result<()> {
    let line = format(row, report)?;
    let existing = match std::fs::read_to_string(path) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    if let Some(t) = &existing {
        let first = t.lines().next().unwrap_or("");
        if !t.is_empty() && first != HEADER {
            bail!(
                "{} has other columns (its header is {first:?}); write to a new file",
                path.display()
            );
        }
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let mut text = String::new();
    if existing.as_deref().is_none_or(str::is_empty) {
        text.push_str(HEADER);
        text.push('\n');
    }
    text.push_str(&line);
    text.push('\n');
    f.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Row {
        Row {
            test: "fig6".into(),
            system: "mps".into(),
            family: "resnet152".into(),
            models: 24,
            devices: 1,
            zipf: 0.9,
            period_s: 1.0,
            cache_bytes: 4 << 30,
            executor: "sim".into(),
            profile: "settings/profiles/h200-estimated.json (estimated)".into(),
            runtime_rss_bytes: Some(3 << 30),
            link: "100gbit".into(),
            dilation: 12.5,
            loopback: "1.000GB/s".into(),
            source: "processes".into(),
            serial_overhead_ms: Some(0.05),
        }
    }

    fn report() -> Report {
        let mut r = Report {
            mode: "closed".into(),
            connections: 1,
            elapsed_s: 10.5,
            sent: 100,
            ok: 98,
            rejected: 1,
            ..Report::default()
        };
        r.errors.insert("internal".into(), 1);
        r.latency.mean_ms = 12.5;
        r.latency.p50_ms = 10.0;
        r.latency.p99_ms = 40.0;
        r.throughput_rps = 9.33;
        r
    }

    #[test]
    fn rows_match_the_header_and_refuse_bad_text() {
        let line = format(&row(), &report()).unwrap();
        assert_eq!(line.split(',').count(), HEADER.split(',').count());
        assert!(line.starts_with(
            "fig6,mps,resnet152,24,1,0.9,1,4096,closed,1,,10.500,100,98,1,0,0,1,9.330,12.500,"
        ));
        let mut bad = row();
        bad.system = "a,b".into();
        let e = format(&bad, &report()).unwrap_err().to_string();
        assert!(e.contains("system"), "{e}");
    }

    #[test]
    fn serial_overhead_is_per_request_served_over_every_device() {
        let text = "# TYPE distmind_runtime_device_serial_overhead_seconds counter\n\
distmind_runtime_device_serial_overhead_seconds_total{device=\"0\"} 0.25\n\
distmind_runtime_device_serial_overhead_seconds_total{device=\"1\"} 0.05\n\
distmind_runtime_requests_total{model=\"a\",status=\"ok\"} 1000\n\
distmind_runtime_requests_total{model=\"b\",status=\"ok\"} 500\n\
distmind_runtime_requests_total{model=\"b\",status=\"busy\"} 700\n";
        let ms = serial_overhead_ms(text).unwrap();
        assert!((ms - 0.2).abs() < 1e-12, "{ms}");
        assert_eq!(
            serial_overhead_ms("distmind_runtime_requests_total{status=\"ok\"} 3\n"),
            None
        );
        let idle = "distmind_runtime_device_serial_overhead_seconds_total{device=\"0\"} 0\n\
distmind_runtime_requests_total{model=\"a\",status=\"busy\"} 2\n";
        assert_eq!(serial_overhead_ms(idle), None, "nothing served");
        let line = format(&row(), &report()).unwrap();
        assert!(line.ends_with(",0.0500"), "{line}");
    }

    #[test]
    fn the_dispatch_overhead_is_the_controllers_gauge() {
        let text = "# TYPE distmind_controller_dispatch_overhead_ms gauge
distmind_controller_dispatch_overhead_ms 0.552
distmind_controller_models 8
";
        assert_eq!(dispatch_overhead_ms(text), Some(0.552));
        let before = "distmind_controller_dispatch_overhead_ms 0.0
";
        assert_eq!(dispatch_overhead_ms(before), None, "nothing answered yet");
        assert_eq!(
            dispatch_overhead_ms(
                "distmind_controller_models 8
"
            ),
            None
        );
    }

    #[test]
    fn append_writes_the_header_once_and_refuses_other_files() {
        let dir = std::env::temp_dir().join(format!("distmind-results-{}", std::process::id()));
        let path = dir.join("sub").join("r.csv");
        append(&path, &row(), &report()).unwrap();
        append(&path, &row(), &report()).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 3);
        assert_eq!(text.lines().next(), Some(HEADER));
        std::fs::write(&path, "a,b\n1,2\n").unwrap();
        let e = append(&path, &row(), &report()).unwrap_err().to_string();
        assert!(e.contains("other columns"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
