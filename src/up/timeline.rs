//! Utilization over time (the paper's figure 9): per interval, inference
//! requests answered and training iterations done, each as a share of what
//! the cluster's GPUs could do of it alone. `distmind up --timeline` (real
//! processes) and `distmind simulate --timeline` write the same CSV, which
//! `distmind plot lines --stacked` draws.

use std::io::Write;
use std::path::Path;

use anyhow::Context;

/// The columns, in order.
pub const HEADER: &str = "test,system,t_s,inference_rps,training_ips,inference_util,training_util,\
inference_bound_rps,training_bound_ips,link,dilation,source,executor,profile";

/// Most intervals one file holds (a bound on what a run writes).
pub const SAMPLES_MAX: usize = 100_000;

/// One interval, in emulated (or simulated) time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// The interval's end, seconds since the workload started.
    pub t_s: f64,
    /// Inference requests answered per second in the interval.
    pub inference_rps: f64,
    /// Training iterations per second in the interval.
    pub training_ips: f64,
}

/// What the whole cluster does at most: every GPU serving one resident
/// model (the `gpu` bound), or every GPU training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    pub inference_rps: f64,
    pub training_ips: f64,
}

impl Bounds {
    /// `gpus` GPUs, each answering a request in `compute_s` or doing a
    /// training iteration in `train_iteration_s`.
    pub fn per_gpu(gpus: usize, compute_s: f64, train_iteration_s: f64) -> Bounds {
        Bounds {
            inference_rps: gpus as f64 / compute_s,
            training_ips: gpus as f64 / train_iteration_s,
        }
    }
}

/// How the samples were produced, for every row.
#[derive(Debug, Clone)]
pub struct Labels {
    pub test: String,
    pub system: String,
    /// `loopback` or the emulated / simulated link.
    pub link: String,
    pub dilation: f64,
    /// `processes` or `simulator`.
    pub source: String,
    /// sim, cpu or cuda.
    pub executor: String,
    /// The sim executor's profile and its source, `-` otherwise.
    pub profile: String,
}

/// Writes `samples` (replacing the file); the header first.
pub fn write(
    path: &Path,
    labels: &Labels,
    bounds: Bounds,
    samples: &[Sample],
) -> anyhow::Result<()> {
    anyhow::ensure!(
        samples.len() <= SAMPLES_MAX,
        "{} intervals, more than a timeline holds ({SAMPLES_MAX}): use longer intervals",
        samples.len()
    );
    for (name, v) in [
        ("test", &labels.test),
        ("system", &labels.system),
        ("link", &labels.link),
        ("source", &labels.source),
        ("executor", &labels.executor),
        ("profile", &labels.profile),
    ] {
        anyhow::ensure!(
            !v.is_empty() && !v.contains([',', '"', '\n', '\r']),
            "the timeline column {name} cannot hold {v:?}"
        );
    }
    let mut text = String::from(HEADER);
    text.push('\n');
    for s in samples {
        let share = |x: f64, bound: f64| if bound > 0.0 { x / bound } else { 0.0 };
        text.push_str(&format!(
            "{},{},{:.3},{:.3},{:.4},{:.4},{:.4},{:.3},{:.4},{},{:.4},{},{},{}\n",
            labels.test,
            labels.system,
            s.t_s,
            s.inference_rps,
            s.training_ips,
            share(s.inference_rps, bounds.inference_rps),
            share(s.training_ips, bounds.training_ips),
            bounds.inference_rps,
            bounds.training_ips,
            labels.link,
            labels.dilation,
            labels.source,
            labels.executor,
            labels.profile
        ));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let mut f =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Counts of events (answers, iterations) in intervals of `interval_s`,
/// from `0` to `end_s`, as per-second rates.
#[derive(Debug, Clone)]
pub struct Bins {
    interval_s: f64,
    inference: Vec<u64>,
    training: Vec<u64>,
}

impl Bins {
    pub fn new(interval_s: f64, end_s: f64) -> anyhow::Result<Bins> {
        anyhow::ensure!(
            interval_s.is_finite() && interval_s > 0.0,
            "the timeline interval must be positive, got {interval_s}"
        );
        let n = (end_s / interval_s).ceil().max(1.0);
        anyhow::ensure!(
            n <= SAMPLES_MAX as f64,
            "{n} intervals of {interval_s} s, more than a timeline holds ({SAMPLES_MAX})"
        );
        Ok(Bins {
            interval_s,
            inference: vec![0; n as usize],
            training: vec![0; n as usize],
        })
    }

    fn slot(&self, t_s: f64) -> Option<usize> {
        let i = (t_s / self.interval_s).floor();
        (i >= 0.0 && (i as usize) < self.inference.len()).then_some(i as usize)
    }

    /// An inference request answered at `t_s` (outside the bins: ignored).
    pub fn inference(&mut self, t_s: f64) {
        if let Some(i) = self.slot(t_s) {
            self.inference[i] += 1;
        }
    }

    /// A training iteration finished at `t_s`.
    pub fn training(&mut self, t_s: f64) {
        if let Some(i) = self.slot(t_s) {
            self.training[i] += 1;
        }
    }

    pub fn samples(&self) -> Vec<Sample> {
        (0..self.inference.len())
            .map(|i| Sample {
                t_s: (i + 1) as f64 * self.interval_s,
                inference_rps: self.inference[i] as f64 / self.interval_s,
                training_ips: self.training[i] as f64 / self.interval_s,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_count_per_interval_as_rates() {
        let mut b = Bins::new(0.5, 2.0).unwrap();
        for t in [0.1, 0.2, 0.6, 1.9, 2.5, -1.0] {
            b.inference(t);
        }
        b.training(1.0);
        let s = b.samples();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].inference_rps, 4.0);
        assert_eq!(s[1].inference_rps, 2.0);
        assert_eq!(s[2].training_ips, 2.0);
        assert_eq!(s[3].inference_rps, 2.0);
        assert!(Bins::new(0.0, 1.0).is_err());
        assert!(Bins::new(1e-9, 1e9).is_err());
    }

    #[test]
    fn rows_carry_utilization_and_labels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.csv");
        let labels = Labels {
            test: "sharing".into(),
            system: "distmind".into(),
            link: "100gbit".into(),
            dilation: 12.5,
            source: "simulator".into(),
            executor: "sim".into(),
            profile: "settings/profiles/v100-estimated.json (estimated)".into(),
        };
        let bounds = Bounds::per_gpu(2, 0.004, 0.25);
        let s = [Sample {
            t_s: 1.0,
            inference_rps: 250.0,
            training_ips: 4.0,
        }];
        write(&path, &labels, bounds, &s).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let row = text.lines().nth(1).unwrap();
        assert_eq!(text.lines().next(), Some(HEADER));
        // 250 of 500 req/s and 4 of 8 iterations/s: half and half.
        assert!(
            row.contains(",0.5000,0.5000,500.000,8.0000,100gbit,"),
            "{row}"
        );
        let bad = Labels {
            system: "a,b".into(),
            ..labels
        };
        assert!(write(&path, &bad, bounds, &s).is_err());
    }
}
