//! `distmind bench ...`: every bench prints its figures next to a baseline
//! measured in the same run, as a ratio (the machines are shared and noisy,
//! so absolute numbers from different runs do not compare).

pub mod capacity;
pub mod coldstart;
pub mod dispatch;
pub mod load;
pub mod local;
pub mod transfer;

/// Median of a non-empty sample.
pub fn median(mut xs: Vec<f64>) -> f64 {
    assert!(!xs.is_empty(), "median of nothing");
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Appends `lines` (each ending in a newline) to the CSV at `path`, with
/// `header` first when the file is new; a file with another header is
/// refused rather than mixed.
pub fn append_csv(path: &std::path::Path, header: &str, lines: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let existing = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    anyhow::ensure!(
        existing.is_empty() || existing.lines().next() == Some(header),
        "{} has other columns; write to a new file",
        path.display()
    );
    let mut text = String::new();
    if existing.is_empty() {
        text.push_str(header);
        text.push('\n');
    }
    text.push_str(lines);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| format!("writing {}", path.display()))
}

/// One line describing the machine, printed with every bench's figures.
pub fn machine_line() -> String {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / (1024.0 * 1024.0))
        .unwrap_or(0.0);
    format!("{cores} cores ({cpu}), {mem_gib:.0} GiB RAM, loopback TCP")
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_odd_even() {
        assert_eq!(super::median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
