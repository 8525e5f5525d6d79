//! A driver for the group schedulers on a virtual clock, shared by their
//! tests: worker `w` computes `compute(w, k)` for its `k`-th step, then says
//! ready; a closed group releases its members at its close time.

use std::time::Duration;

use super::group::{Group, GroupScheduler};

/// Runs until nothing is left to happen or the next event is after
/// `until`; returns every closed group in order.
pub(crate) fn drive(
    sched: &mut dyn GroupScheduler,
    until: Duration,
    compute: impl Fn(usize, u64) -> Duration,
) -> Vec<Group> {
    let p = sched.workers();
    let mut next: Vec<Option<Duration>> = (0..p).map(|w| Some(compute(w, 0))).collect();
    let mut steps = vec![0u64; p];
    let mut groups = Vec::new();
    loop {
        let now = next
            .iter()
            .flatten()
            .copied()
            .chain(sched.next_deadline())
            .min();
        let Some(now) = now.filter(|&t| t <= until) else {
            break;
        };
        let mut closed = sched.poll(now);
        for (w, at) in next.iter_mut().enumerate() {
            if *at == Some(now) {
                *at = None;
                closed.extend(sched.ready(w, now).expect("a valid ready"));
            }
        }
        for g in &closed {
            for &m in &g.members {
                steps[m] += 1;
                next[m] = Some(g.closed_at + compute(m, steps[m]));
            }
        }
        groups.extend(closed);
    }
    groups
}
