//! `up --timeline`: a background thread that scrapes the runtime's
//! `/metrics` while the workload runs and turns the counters' deltas into
//! per-second rates in emulated time, the samples of [`super::timeline`].
//!
//! * Counters: inference requests answered with outputs
//!   ([`ANSWERED`]`{status="ok"}`, summed over models) and background
//!   training iterations ([`TRAIN_ITERATIONS`], summed over devices).
//! * Every `interval x K` of real time (K: the emulated link's dilation, 1
//!   without one), on a fixed grid from the start, so sleeps do not drift.
//!   A sample's rates are its deltas over the time since the previous
//!   successful scrape, in emulated seconds (real / K), so a failed scrape
//!   (logged at warn level and counted, never fatal) makes the next sample
//!   cover both intervals instead of losing their events.
//! * The thread ends when the sampler is finished or dropped (every exit
//!   path of `up`), after one last scrape; it keeps at most
//!   [`timeline::SAMPLES_MAX`](super::timeline::SAMPLES_MAX) samples.

use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use distmind_common::metrics::scrape;

use super::metrics::parse_samples;
use super::timeline::{Sample, SAMPLES_MAX};

/// Inference requests the runtime answered, by model and status.
pub const ANSWERED: &str = "distmind_runtime_requests_total";
/// Background training iterations, by device.
pub const TRAIN_ITERATIONS: &str = "distmind_runtime_device_train_iterations_total";
/// How long one scrape may take.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);
/// The shortest real time between scrapes.
pub const PERIOD_MIN: Duration = Duration::from_millis(10);
/// A last interval shorter than this share of an interval is dropped (its
/// rates would be noise).
const LAST_INTERVAL_SHARE_MIN: f64 = 0.1;

/// The counters of one scrape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counts {
    /// Requests answered with outputs.
    pub answered: f64,
    pub iterations: f64,
}

impl Counts {
    /// The counters in a `/metrics` text; `None` when neither family is
    /// present (not a runtime's endpoint).
    pub fn parse(text: &str) -> Option<Counts> {
        let mut found = false;
        let mut c = Counts {
            answered: 0.0,
            iterations: 0.0,
        };
        for s in parse_samples(text) {
            if s.name == ANSWERED {
                found = true;
                if s.has("status", "ok") {
                    c.answered += s.value;
                }
            } else if s.name == TRAIN_ITERATIONS {
                found = true;
                c.iterations += s.value;
            }
        }
        found.then_some(c)
    }
}

/// The rates between two scrapes `real_s` apart on a clock dilated by `k`;
/// a counter that went down (a restarted runtime) counts as 0.
pub fn rates(t_s: f64, before: Counts, after: Counts, real_s: f64, k: f64) -> Sample {
    let emulated_s = real_s / k;
    let rate = |a: f64, b: f64| {
        if emulated_s > 0.0 {
            (b - a).max(0.0) / emulated_s
        } else {
            0.0
        }
    };
    Sample {
        t_s,
        inference_rps: rate(before.answered, after.answered),
        training_ips: rate(before.iterations, after.iterations),
    }
}

/// What the thread recorded.
#[derive(Debug, Clone, Default)]
pub struct Recorded {
    pub samples: Vec<Sample>,
    pub scrapes: u64,
    pub failed: u64,
    /// Stopped early at [`SAMPLES_MAX`].
    pub truncated: bool,
}

/// The scraping thread; stopped and joined by [`Sampler::finish`] or on drop.
pub struct Sampler {
    stop: Option<SyncSender<()>>,
    handle: Option<JoinHandle<Recorded>>,
}

impl Sampler {
    /// Starts scraping `http://<addr>/metrics` every `interval_s` emulated
    /// seconds on a clock dilated by `k`; time 0 is now.
    pub fn start(addr: String, interval_s: f64, k: f64) -> anyhow::Result<Sampler> {
        anyhow::ensure!(
            interval_s.is_finite() && interval_s > 0.0,
            "--timeline-interval must be a positive number of seconds, got {interval_s}"
        );
        anyhow::ensure!(k.is_finite() && k >= 1.0, "time dilation {k} is below 1");
        let period = Duration::try_from_secs_f64(interval_s * k)
            .ok()
            .filter(|p| *p >= PERIOD_MIN)
            .with_context(|| {
                format!(
                    "--timeline-interval {interval_s} s x K {k:.2} is under {} ms of real time between scrapes",
                    PERIOD_MIN.as_millis()
                )
            })?;
        let (stop, stopped) = mpsc::sync_channel::<()>(1);
        let handle = std::thread::Builder::new()
            .name("up-timeline".into())
            .spawn(move || record(&addr, period, k, &stopped))
            .context("cannot start the timeline thread")?;
        Ok(Sampler {
            stop: Some(stop),
            handle: Some(handle),
        })
    }

    /// Stops the thread (after one last scrape) and returns what it recorded.
    pub fn finish(mut self) -> Recorded {
        self.join()
    }

    fn join(&mut self) -> Recorded {
        // Dropping the sender wakes the thread at once.
        self.stop.take();
        match self.handle.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => {
                log::warn!("up: the timeline thread panicked; no timeline");
                Recorded::default()
            }
            None => Recorded::default(),
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        if self.handle.is_some() {
            self.join();
        }
    }
}

fn scrape_counts(addr: &str) -> Result<Counts, String> {
    match scrape(addr, "/metrics", SCRAPE_TIMEOUT) {
        Ok((200, body)) => {
            Counts::parse(&body).ok_or_else(|| format!("http://{addr}/metrics has no {ANSWERED}"))
        }
        Ok((status, _)) => Err(format!("http://{addr}/metrics answered HTTP {status}")),
        Err(e) => Err(format!("cannot read http://{addr}/metrics: {e}")),
    }
}

/// The thread: scrapes on a fixed grid until `stopped` says so (a message
/// or the sender dropped), then once more.
fn record(addr: &str, period: Duration, k: f64, stopped: &mpsc::Receiver<()>) -> Recorded {
    let start = Instant::now();
    let mut out = Recorded::default();
    let mut prev: Option<(Instant, Counts)> = None;
    let mut tick: u32 = 0;
    loop {
        let last = if tick == 0 {
            false
        } else {
            let due = start + period * tick;
            let wait = due.saturating_duration_since(Instant::now());
            !matches!(stopped.recv_timeout(wait), Err(RecvTimeoutError::Timeout))
        };
        tick = tick.saturating_add(1);
        let at = Instant::now();
        out.scrapes += 1;
        match scrape_counts(addr) {
            Ok(now) => {
                if let Some((then, before)) = prev {
                    let real_s = (at - then).as_secs_f64();
                    if !last || real_s >= LAST_INTERVAL_SHARE_MIN * period.as_secs_f64() {
                        let t_s = (at - start).as_secs_f64() / k;
                        out.samples.push(rates(t_s, before, now, real_s, k));
                    }
                }
                prev = Some((at, now));
            }
            Err(e) => {
                out.failed += 1;
                log::warn!("up: timeline scrape {} failed: {e}", out.scrapes);
            }
        }
        if last {
            break;
        }
        if out.samples.len() >= SAMPLES_MAX {
            out.truncated = true;
            log::warn!("up: the timeline holds {SAMPLES_MAX} intervals; it stops here");
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# TYPE distmind_runtime_requests counter\n\
distmind_runtime_requests_total{model=\"a\",status=\"ok\"} 10\n\
distmind_runtime_requests_total{model=\"b\",status=\"ok\"} 5\n\
distmind_runtime_requests_total{model=\"b\",status=\"busy\"} 7\n\
distmind_runtime_device_train_iterations_total{device=\"0\"} 3\n\
distmind_runtime_device_train_iterations_total{device=\"1\"} 4\n\
distmind_runtime_device_training{device=\"1\"} 1\n# EOF\n";

    #[test]
    fn counts_sum_answers_with_outputs_and_iterations() {
        let c = Counts::parse(TEXT).unwrap();
        assert_eq!(c.answered, 15.0, "errors are not answers with outputs");
        assert_eq!(c.iterations, 7.0);
        assert_eq!(Counts::parse("other_total 1\n"), None);
    }

    #[test]
    fn rates_are_per_emulated_second() {
        let a = Counts {
            answered: 10.0,
            iterations: 2.0,
        };
        let b = Counts {
            answered: 30.0,
            iterations: 6.0,
        };
        // 2 real seconds at K 4: half an emulated second.
        let s = rates(1.5, a, b, 2.0, 4.0);
        assert_eq!((s.t_s, s.inference_rps, s.training_ips), (1.5, 40.0, 8.0));
        // A counter that went back (restart) is no negative rate.
        let s = rates(2.0, b, a, 1.0, 1.0);
        assert_eq!((s.inference_rps, s.training_ips), (0.0, 0.0));
    }

    #[test]
    fn a_sampler_stops_when_finished_and_counts_failed_scrapes() {
        // Nothing listens on a port of a freshly dropped listener.
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let s = Sampler::start(addr, 0.02, 1.0).unwrap();
        std::thread::sleep(Duration::from_millis(70));
        let t = Instant::now();
        let r = s.finish();
        assert!(t.elapsed() < SCRAPE_TIMEOUT * 2, "{:?}", t.elapsed());
        assert!(r.scrapes >= 2, "{r:?}");
        assert_eq!(r.failed, r.scrapes);
        assert!(r.samples.is_empty());
        assert!(Sampler::start("127.0.0.1:1".into(), 0.0, 1.0).is_err());
        assert!(Sampler::start("127.0.0.1:1".into(), 0.001, 1.0).is_err());
    }
}
