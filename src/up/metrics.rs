//! Reading the services' `/metrics` endpoints (Prometheus text format,
//! fetched with `distmind_common::metrics::scrape`) and picking a few
//! headline figures to print after the workload.

use std::time::Duration;

use distmind_common::metrics::{self, scrape};

/// Most lines printed per endpoint (a runtime with two devices and a
/// training job prints about 20: tests read its training counters here).
pub const HEADLINE_LINES_MAX: usize = 24;

/// One sample of the text format: `name{labels} value`, label values
/// unescaped.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// Whether the sample has label `key` with value `value`.
    pub fn has(&self, key: &str, value: &str) -> bool {
        self.labels.iter().any(|(k, v)| k == key && v == value)
    }
}

/// The samples of a text exposition (comments and unparsable lines skipped).
pub fn parse_samples(text: &str) -> Vec<Sample> {
    metrics::parse_samples(text)
        .into_iter()
        .filter_map(|(series, value)| {
            let (name, labels) = metrics::parse_series(&series)?;
            Some(Sample {
                name: name.to_string(),
                labels,
                value,
            })
        })
        .collect()
}

/// The figures worth a line: histogram buckets, `_created` timestamps and
/// process/build info left out; series summed over their `model` label (a
/// line per model would drown the rest); a histogram's `_sum` and `_count`
/// folded into one line with its mean; labelled series at zero left out.
/// In exposition order.
pub fn headline(samples: &[Sample]) -> Vec<String> {
    let skip = |s: &Sample| {
        s.name.ends_with("_bucket")
            || s.name.ends_with("_created")
            || s.name.starts_with("process_")
            || s.name.ends_with("_info")
            || s.labels.iter().any(|(k, _)| k == "quantile")
    };
    // (name, labels without model) -> summed value, first-seen order.
    let mut keys: Vec<(String, String)> = Vec::new();
    let mut sums: std::collections::HashMap<(String, String), f64> = Default::default();
    for s in samples.iter().filter(|s| !skip(s)) {
        let kept: Vec<String> = s
            .labels
            .iter()
            .filter(|(k, _)| k != "model")
            .map(|(k, v)| format!("{k}={v:?}"))
            .collect();
        let labels = if kept.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", kept.join(","))
        };
        let key = (s.name.clone(), labels);
        match sums.get_mut(&key) {
            Some(v) => *v += s.value,
            None => {
                sums.insert(key.clone(), s.value);
                keys.push(key);
            }
        }
    }
    let mut out = Vec::new();
    for (name, labels) in &keys {
        if let Some(stem) = name.strip_suffix("_count") {
            if sums.contains_key(&(format!("{stem}_sum"), labels.clone())) {
                continue; // Folded into the _sum line.
            }
        }
        let v = sums[&(name.clone(), labels.clone())];
        if let Some(stem) = name.strip_suffix("_sum") {
            if let Some(&n) = sums.get(&(format!("{stem}_count"), labels.clone())) {
                let mean = if n > 0.0 { v / n } else { 0.0 };
                out.push(match stem.strip_suffix("_seconds") {
                    Some(base) => format!(
                        "{base}{labels}: {} observed, mean {:.3} ms",
                        fmt_value(n),
                        mean * 1e3
                    ),
                    None => format!(
                        "{stem}{labels}: {} observed, mean {:.4}",
                        fmt_value(n),
                        mean
                    ),
                });
                continue;
            }
        }
        if v == 0.0 && !labels.is_empty() {
            continue; // A zero among labelled series: noise (unlabelled zeros stay).
        }
        out.push(format!("{name}{labels} {}", fmt_value(v)));
    }
    out
}

/// Prints `what`'s headline figures, or why there are none.
pub fn print_headline(what: &str, addr: &str, timeout: Duration) {
    match scrape(addr, "/metrics", timeout) {
        Ok((200, body)) => {
            let samples = parse_samples(&body);
            let lines = headline(&samples);
            println!(
                "  {what} (http://{addr}/metrics, {} samples):",
                samples.len()
            );
            for l in lines.iter().take(HEADLINE_LINES_MAX) {
                println!("    {l}");
            }
            if lines.len() > HEADLINE_LINES_MAX {
                println!("    ... {} more", lines.len() - HEADLINE_LINES_MAX);
            }
        }
        Ok((status, _)) => println!("  {what}: http://{addr}/metrics answered HTTP {status}"),
        Err(e) => println!("  {what}: cannot read http://{addr}/metrics: {e}"),
    }
}

fn fmt_value(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP requests Requests.\n# TYPE requests counter\n\
requests_total{model=\"a\",status=\"ok\"} 12\nrequests_total{model=\"b\",status=\"ok\"} 3\n\
requests_total{status=\"rejected\",model=\"b\"} 1\nrequests_total{status=\"lost\"} 0\n\
requests_created 1.7e9\nqueue_depth 3\nerrors_total 0\n\
latency_seconds_bucket{le=\"0.1\"} 4\nlatency_seconds_sum 0.52\nlatency_seconds_count 13\n\
size_sum{model=\"a\"} 10\nsize_count{model=\"a\"} 4\n\
process_cpu_seconds_total 1\nbroken line\n# EOF\n";

    #[test]
    fn samples_and_headline() {
        let s = parse_samples(TEXT);
        assert_eq!(s.len(), 13);
        assert_eq!(s[0].name, "requests_total");
        assert_eq!(
            s[0].labels,
            [("model".into(), "a".into()), ("status".into(), "ok".into())]
        );
        assert!(s[0].has("status", "ok") && !s[0].has("status", "lost"));
        assert_eq!(s[0].value, 12.0);
        assert_eq!(
            headline(&s),
            [
                "requests_total{status=\"ok\"} 15",
                "requests_total{status=\"rejected\"} 1",
                "queue_depth 3",
                "errors_total 0",
                "latency: 13 observed, mean 40.000 ms",
                "size: 4 observed, mean 2.5000",
            ]
        );
        assert_eq!(fmt_value(12.0), "12");
        assert_eq!(fmt_value(0.52), "0.5200");
    }
}
