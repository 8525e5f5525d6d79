//! PipeDream's 1F1B order of one stage's ops in one iteration.
//!
//! Stage `s` of `S` runs `w = min(S - s - 1, M)` warm-up forwards, then
//! alternates one forward and one backward until every forward ran, then
//! drains the remaining backwards: microbatches go forward and backward in
//! order `0..M`. Stage `s` holds at most `min(S - s, M)` microbatches
//! between their forward and their backward ([`in_flight_max`]), so the
//! stage link from `s` to `s + 1` never carries more unread activations
//! (nor gradients the other way) than a window of `S` messages.
//!
//! With blocking sends and receives, every stage running its own order
//! finishes (no stage waits for a message that comes only after its own
//! wait): `every_stage_order_runs_to_completion` below executes the orders
//! of whole pipelines against each other.

/// One op of a stage's iteration: the forward or the backward of a
/// microbatch (`0..microbatches`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    Forward(u32),
    Backward(u32),
}

/// The warm-up forwards of stage `stage` of `stages`.
pub(crate) fn warm_up(stages: u32, stage: u32, microbatches: u32) -> u32 {
    (stages - stage - 1).min(microbatches)
}

/// Stage `stage`'s 1F1B order for one iteration of `microbatches`.
pub(crate) fn one_f_one_b(stages: u32, stage: u32, microbatches: u32) -> Vec<Op> {
    assert!(stage < stages, "stage {stage} of {stages}");
    let w = warm_up(stages, stage, microbatches);
    let mut ops = Vec::with_capacity(2 * microbatches as usize);
    ops.extend((0..w).map(Op::Forward));
    for i in 0..microbatches - w {
        ops.push(Op::Forward(w + i));
        ops.push(Op::Backward(i));
    }
    ops.extend((microbatches - w..microbatches).map(Op::Backward));
    ops
}

/// Microbatches stage `stage` holds at most between forward and backward.
pub(crate) fn in_flight_max(stages: u32, stage: u32, microbatches: u32) -> u32 {
    (warm_up(stages, stage, microbatches) + 1).min(microbatches)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn four_stages_eight_microbatches() {
        use Op::{Backward as B, Forward as F};
        assert_eq!(
            one_f_one_b(4, 0, 8),
            vec![
                F(0),
                F(1),
                F(2),
                F(3),
                B(0),
                F(4),
                B(1),
                F(5),
                B(2),
                F(6),
                B(3),
                F(7),
                B(4),
                B(5),
                B(6),
                B(7)
            ]
        );
        assert_eq!(
            one_f_one_b(4, 3, 8)[..4],
            [F(0), B(0), F(1), B(1)],
            "the last stage alternates from the start"
        );
        assert_eq!(
            one_f_one_b(4, 2, 3),
            vec![F(0), F(1), B(0), F(2), B(1), B(2)]
        );
        // Fewer microbatches than warm-up slots: all forwards, then all backwards.
        assert_eq!(one_f_one_b(5, 0, 2), vec![F(0), F(1), B(0), B(1)]);
    }

    #[test]
    fn every_microbatch_once_each_way_in_order_within_the_bound() {
        for stages in 1..=6 {
            for microbatches in 1..=9 {
                for stage in 0..stages {
                    let ops = one_f_one_b(stages, stage, microbatches);
                    assert_eq!(ops.len(), 2 * microbatches as usize);
                    let fwd: Vec<u32> = ops
                        .iter()
                        .filter_map(|o| match o {
                            Op::Forward(m) => Some(*m),
                            _ => None,
                        })
                        .collect();
                    let bwd: Vec<u32> = ops
                        .iter()
                        .filter_map(|o| match o {
                            Op::Backward(m) => Some(*m),
                            _ => None,
                        })
                        .collect();
                    let order: Vec<u32> = (0..microbatches).collect();
                    assert_eq!((fwd, bwd), (order.clone(), order));
                    let mut open = HashSet::new();
                    let mut most = 0;
                    for op in &ops {
                        match op {
                            Op::Forward(m) => {
                                open.insert(*m);
                            }
                            Op::Backward(m) => assert!(open.remove(m), "B({m}) before F({m})"),
                        }
                        most = most.max(open.len());
                    }
                    assert_eq!(
                        most as u32,
                        in_flight_max(stages, stage, microbatches),
                        "S={stages} s={stage} M={microbatches}"
                    );
                    assert!(most as u32 <= stages - stage);
                }
            }
        }
    }

    /// Runs every stage's order against the others as blocking sends and
    /// receives would: F(m) on stage s needs s-1's F(m); B(m) needs s+1's
    /// B(m) (the last stage's B(m) only its own F(m)). Each round every
    /// stage runs its next op if it can; the pipeline must finish.
    #[test]
    fn every_stage_order_runs_to_completion() {
        for stages in 1..=6u32 {
            for microbatches in 1..=8u32 {
                let orders: Vec<Vec<Op>> = (0..stages)
                    .map(|s| one_f_one_b(stages, s, microbatches))
                    .collect();
                let mut next = vec![0usize; stages as usize];
                let mut done: HashSet<(u32, Op)> = HashSet::new();
                loop {
                    let mut moved = false;
                    for s in 0..stages {
                        let Some(&op) = orders[s as usize].get(next[s as usize]) else {
                            continue;
                        };
                        let ready = match op {
                            Op::Forward(m) => s == 0 || done.contains(&(s - 1, Op::Forward(m))),
                            Op::Backward(m) => {
                                if s + 1 == stages {
                                    done.contains(&(s, Op::Forward(m)))
                                } else {
                                    done.contains(&(s + 1, Op::Backward(m)))
                                }
                            }
                        };
                        if ready {
                            done.insert((s, op));
                            next[s as usize] += 1;
                            moved = true;
                        }
                    }
                    if !moved {
                        break;
                    }
                }
                assert!(
                    next.iter().all(|&n| n == 2 * microbatches as usize),
                    "S={stages} M={microbatches}: stuck at {next:?}"
                );
            }
        }
    }
}
