//! Training shares GPUs at iteration granularity: a training job runs one
//! iteration at a time and yields to inference only at an iteration
//! boundary (never preempted inside one, as in the original). The
//! dispatcher uses this to bound when a training GPU can start a request.

use super::Micros;

/// A training job on one GPU, as the dispatcher models it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainingJob {
    /// When its current run of back-to-back iterations started.
    pub started_at: Micros,
    /// One iteration's duration (observed; the runtime reports it).
    pub iteration: Micros,
}

impl TrainingJob {
    /// The first iteration boundary at or after `now`.
    pub fn next_boundary(&self, now: Micros) -> Micros {
        if self.iteration == 0 || now <= self.started_at {
            return now.max(self.started_at);
        }
        let done = (now - self.started_at).div_ceil(self.iteration);
        self.started_at + done * self.iteration
    }

    /// How long a request arriving at `now` waits for the GPU to yield.
    pub fn yield_delay(&self, now: Micros) -> Micros {
        self.next_boundary(now) - now
    }

    /// What the dispatcher adds when it cannot know the phase: a whole
    /// iteration (an upper bound on [`yield_delay`](Self::yield_delay)).
    pub fn worst_case_delay(&self) -> Micros {
        self.iteration
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_yields_within_one_iteration() {
        let job = TrainingJob {
            started_at: 1_000,
            iteration: 250,
        };
        // On a virtual clock, every arrival waits less than one iteration
        // and is served at a boundary.
        for now in 1_000..3_000 {
            let d = job.yield_delay(now);
            assert!(d < job.iteration, "arrival at {now} waits {d}");
            assert_eq!((now + d - job.started_at) % job.iteration, 0);
            assert!(d <= job.worst_case_delay());
        }
        assert_eq!(job.yield_delay(1_250), 0, "exactly on a boundary");
        assert_eq!(job.yield_delay(1_251), 249);
        assert_eq!(job.next_boundary(500), 1_000, "before it started");
    }
}
