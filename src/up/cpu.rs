//! Where the host's CPU went during the workload: every process of the
//! cluster and this one (the load generator), and the host as a whole.
//!
//! On a small host every process of the cluster, and the load generator,
//! share the same cores: when the host is nearly all busy, requests wait
//! for a core, not for the GPU, and a latency measured there is the host's
//! as much as the system's. `up` prints this after the workload, and
//! `bench capacity` puts the host's busy share in its CSV.

use std::time::Duration;

use distmind_transport::priority::{host_cpu_ticks, pid_cpu_time, process_cpu_time};

/// The name this process has in the report.
pub const LOAD_GENERATOR: &str = "load generator";

/// CPU time so far: per process (name, pid, time), this one's, and the
/// host's ticks.
pub struct Snapshot {
    procs: Vec<(String, u32, Option<Duration>)>,
    own: Duration,
    host: Option<(u64, u64)>,
}

impl Snapshot {
    /// `procs`: the cluster's processes, by name and pid.
    pub fn take(procs: &[(String, u32)]) -> Snapshot {
        Snapshot {
            procs: procs
                .iter()
                .map(|(name, pid)| (name.clone(), *pid, pid_cpu_time(*pid)))
                .collect(),
            own: process_cpu_time(),
            host: host_cpu_ticks(),
        }
    }
}

/// The CPU used between two snapshots.
#[derive(Debug, Clone, PartialEq)]
pub struct Usage {
    /// Per process, this one last as [`LOAD_GENERATOR`]: its CPU time.
    pub per_process: Vec<(String, Duration)>,
    /// The host's busy share over every core, in [0, 1]; `None` when
    /// `/proc/stat` could not be read.
    pub host_busy: Option<f64>,
}

impl Usage {
    pub fn between(before: &Snapshot, after: &Snapshot) -> Usage {
        let mut per_process: Vec<(String, Duration)> = before
            .procs
            .iter()
            .filter_map(|(name, pid, t0)| {
                let t1 = after.procs.iter().find(|(_, p, _)| p == pid)?.2?;
                Some((name.clone(), t1.saturating_sub((*t0)?)))
            })
            .collect();
        per_process.push((
            LOAD_GENERATOR.to_string(),
            after.own.saturating_sub(before.own),
        ));
        let host_busy = match (before.host, after.host) {
            (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => {
                Some((b1.saturating_sub(b0)) as f64 / (t1 - t0) as f64)
            }
            _ => None,
        };
        Usage {
            per_process,
            host_busy,
        }
    }

    /// One line: the host's busy share and, per request answered, each
    /// process's CPU milliseconds.
    pub fn line(&self, answered: u64, cores: usize) -> String {
        let busy = self
            .host_busy
            .map_or("?".to_string(), |b| format!("{:.0}%", b * 100.0));
        let per = self
            .per_process
            .iter()
            .map(|(name, t)| {
                format!(
                    "{name} {:.2}",
                    t.as_secs_f64() * 1e3 / answered.max(1) as f64
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "up: host CPU during the workload: {busy} busy over {cores} cores; CPU ms per request answered: {per}"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_the_difference_per_process_and_of_the_host() {
        let ms = Duration::from_millis;
        let before = Snapshot {
            procs: vec![
                ("controller".into(), 10, Some(ms(100))),
                ("runtime".into(), 11, Some(ms(50))),
                ("memserver-1".into(), 12, None),
            ],
            own: ms(20),
            host: Some((1_000, 4_000)),
        };
        let after = Snapshot {
            procs: vec![
                ("controller".into(), 10, Some(ms(300))),
                ("runtime".into(), 11, Some(ms(450))),
                ("memserver-1".into(), 12, Some(ms(5))),
            ],
            own: ms(120),
            host: Some((1_900, 5_000)),
        };
        let u = Usage::between(&before, &after);
        assert_eq!(
            u.per_process,
            vec![
                ("controller".to_string(), ms(200)),
                ("runtime".to_string(), ms(400)),
                (LOAD_GENERATOR.to_string(), ms(100)),
            ],
            "a process unread before is left out"
        );
        assert_eq!(u.host_busy, Some(0.9));
        let line = u.line(100, 2);
        assert!(line.contains("90% busy over 2 cores"), "{line}");
        assert!(
            line.contains("controller 2.00, runtime 4.00, load generator 1.00"),
            "{line}"
        );
        // Nothing answered: no division by zero, and no host figure.
        let none = Usage {
            host_busy: None,
            ..u
        };
        assert!(none.line(0, 2).contains("? busy"));
    }

    #[test]
    fn a_live_snapshot_reads_this_process() {
        let me = std::process::id();
        let before = Snapshot::take(&[("me".into(), me)]);
        let mut x = 0u64;
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(x > 0);
        let u = Usage::between(&before, &Snapshot::take(&[("me".into(), me)]));
        assert_eq!(u.per_process.len(), 2);
        assert!(u.per_process[1].1 > Duration::ZERO, "{u:?}");
    }
}
