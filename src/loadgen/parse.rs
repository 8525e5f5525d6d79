//! The load generator's pure parsers: durations (`60s`, `500ms`, `2m`) and
//! trace files (CSV `time_s,model[,slo_ms]`).

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};

/// Most rows a trace file may hold (each row is a request).
pub const TRACE_ROWS_MAX: usize = 10_000_000;

/// Longest accepted duration: a week, far beyond any benchmark run.
pub const DURATION_MAX: Duration = Duration::from_secs(7 * 24 * 3600);

/// Parses `60s`, `500ms`, `2m`, `1h` or a bare number of seconds (`1.5`).
/// Zero, negative and non-finite values are refused.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    let scale_s = match unit {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "bad duration {s:?}: unknown unit {unit:?}; write e.g. 60s, 500ms, 2m or 1h"
            ))
        }
    };
    let v: f64 = num.parse().map_err(|_| {
        format!("bad duration {s:?}: expected a number and a unit, e.g. 60s, 500ms, 2m or 1h")
    })?;
    let secs = v * scale_s;
    if !secs.is_finite() || secs <= 0.0 {
        return Err(format!("bad duration {s:?}: it must be more than zero"));
    }
    if secs > DURATION_MAX.as_secs_f64() {
        return Err(format!(
            "bad duration {s:?}: at most {} h",
            DURATION_MAX.as_secs() / 3600
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// One request of a trace: when (seconds after the start), which model, and
/// optionally its own latency objective.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRow {
    pub time_s: f64,
    pub model: String,
    pub slo_ms: Option<f64>,
    /// 1-based line in the file, for messages.
    pub line: usize,
}

/// Reads and parses a trace file.
pub fn load_trace(path: &Path) -> anyhow::Result<Vec<TraceRow>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the trace {}", path.display()))?;
    parse_trace(path, &text)
}

/// Parses a trace: a header `time_s,model` or `time_s,model,slo_ms`, then
/// one request per line, in time order. Blank lines and lines starting with
/// `#` are skipped; an empty `slo_ms` field means "no SLO of its own".
/// Errors name `file:line`.
pub fn parse_trace(path: &Path, text: &str) -> anyhow::Result<Vec<TraceRow>> {
    let p = path.display();
    let mut columns = 0usize;
    let mut rows: Vec<TraceRow> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = l.split(',').map(str::trim).collect();
        if columns == 0 {
            columns = match fields.as_slice() {
                ["time_s", "model"] => 2,
                ["time_s", "model", "slo_ms"] => 3,
                _ => bail!("{p}:{line}: expected the header time_s,model or time_s,model,slo_ms, found {l:?}"),
            };
            continue;
        }
        if fields.len() != columns {
            bail!(
                "{p}:{line}: expected {columns} comma-separated fields ({}), found {}: {l:?}",
                if columns == 2 {
                    "time_s,model"
                } else {
                    "time_s,model,slo_ms"
                },
                fields.len()
            );
        }
        let time_s: f64 = fields[0]
            .parse()
            .ok()
            .filter(|t: &f64| t.is_finite() && *t >= 0.0)
            .with_context(|| {
                format!(
                    "{p}:{line}: time_s must be a number of seconds >= 0, found {:?}",
                    fields[0]
                )
            })?;
        if let Some(prev) = rows.last() {
            if time_s < prev.time_s {
                bail!(
                    "{p}:{line}: time_s {time_s} is before the previous row's {} (line {}): rows must be in time order",
                    prev.time_s,
                    prev.line
                );
            }
        }
        let model = fields[1];
        if model.is_empty() || model.contains(char::is_whitespace) {
            bail!("{p}:{line}: expected a model name, found {model:?}");
        }
        let slo_ms = match fields.get(2) {
            None | Some(&"") => None,
            Some(s) => Some(
                s.parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .with_context(|| {
                        format!("{p}:{line}: slo_ms must be a number of milliseconds > 0 (or empty), found {s:?}")
                    })?,
            ),
        };
        if rows.len() == TRACE_ROWS_MAX {
            bail!("{p}:{line}: more than {TRACE_ROWS_MAX} requests; split the trace");
        }
        rows.push(TraceRow {
            time_s,
            model: model.to_string(),
            slo_ms,
            line,
        });
    }
    if columns == 0 {
        bail!(
            "{p}: empty trace: expected the header time_s,model[,slo_ms] and one request per line"
        );
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("60s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(
            parse_duration(" 1.5 ").unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(parse_duration("0.25s").unwrap(), Duration::from_millis(250));
        for bad in [
            "", "s", "0s", "-1s", "10x", "1.2.3s", "nan", "1e400s", "999h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_duration("10x").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn trace_with_and_without_slo() {
        let p = Path::new("t.csv");
        let rows = parse_trace(p, "# a comment\ntime_s,model\n0,a\n\n0.5, b\n0.5,a\n").unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[1].model, "b");
        assert_eq!(rows[1].time_s, 0.5);
        assert_eq!(rows[1].line, 5);
        assert_eq!(rows[0].slo_ms, None);

        let rows = parse_trace(p, "time_s,model,slo_ms\n0.1,a,50\n0.2,b,\n").unwrap();
        assert_eq!(rows[0].slo_ms, Some(50.0));
        assert_eq!(rows[1].slo_ms, None);
    }

    #[test]
    fn trace_errors_name_file_and_line() {
        let p = Path::new("dir/trace.csv");
        let err = |text: &str| format!("{:#}", parse_trace(p, text).unwrap_err());
        assert!(err("time,model\n").contains("dir/trace.csv:1: expected the header"));
        assert!(err("time_s,model\n0,a\nx,b\n").contains("dir/trace.csv:3: time_s"));
        assert!(err("time_s,model\n1,a\n0.5,b\n").contains("dir/trace.csv:3: time_s 0.5 is before"));
        assert!(err("time_s,model\n0,a,5\n").contains("dir/trace.csv:2: expected 2"));
        assert!(err("time_s,model,slo_ms\n0,a,-5\n").contains("dir/trace.csv:2: slo_ms"));
        assert!(err("time_s,model\n0,\n").contains("dir/trace.csv:2: expected a model name"));
        assert!(err("time_s,model\n-1,a\n").contains(":2: time_s"));
        assert!(err("\n# only comments\n").contains("empty trace"));
    }
}
