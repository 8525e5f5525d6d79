//! The partial-reduce scheduler on a virtual clock: full groups without
//! stragglers, a straggler left out yet merged every window, the adaptive
//! wait, pairs above 8 workers, graph syncs and removal.

use super::*;
use crate::training::group::WORKERS_MAX;
use crate::training::testkit::drive;

const MS: Duration = Duration::from_millis(1);
const US: Duration = Duration::from_micros(1);

fn scheduler(workers: usize) -> PartialReduce {
    PartialReduce::new(PReduceConfig::new(workers)).unwrap()
}

fn members(groups: &[Group]) -> Vec<Vec<WorkerId>> {
    groups.iter().map(|g| g.members.clone()).collect()
}

/// The test's own union-find, to check connectivity independently.
fn root(parent: &mut [usize], mut x: usize) -> usize {
    while parent[x] != x {
        x = parent[x];
    }
    x
}

#[test]
fn without_stragglers_every_group_is_everyone() {
    let mut s = scheduler(4);
    let groups = drive(&mut s, 500 * MS, |_, _| 5 * MS);
    assert_eq!(groups.len(), 100);
    for g in &groups {
        assert_eq!(g.members, [0, 1, 2, 3], "{g:?}");
        assert_eq!(g.reason, CloseReason::AllReady);
        assert_eq!(g.opened_at, g.closed_at, "nobody waits");
    }
    // Every group was large: every wait shrank to the floor.
    for w in 0..4 {
        assert_eq!(s.wait(w), Some(WAIT_MIN));
    }
}

#[test]
fn a_slow_worker_is_left_out_but_merged_within_every_window() {
    let p = 4;
    let mut s = scheduler(p);
    // Workers 0-2 take 5 ms per step, worker 3 takes 97 ms (after a first
    // short one, so that it has been seen before the first window ends).
    let groups = drive(&mut s, 3_000 * MS, |w, k| match (w, k) {
        (3, 0) => MS,
        (3, _) => 97 * MS,
        _ => 5 * MS,
    });
    assert!(
        groups.iter().any(|g| g.reason == CloseReason::Deadline
            && g.members.len() >= 2
            && !g.members.contains(&3)),
        "the straggler is left out of groups that close at their deadline"
    );
    // Replay the groups: at every window boundary (ssp_bound x P updates),
    // the next group either is a graph sync that, with the sets merged
    // since the last sync, connects everyone, or finds them connected.
    let window = (SSP_BOUND_DEFAULT as usize) * p;
    let mut parent: Vec<usize> = (0..p).collect();
    let (mut updates, mut due, mut windows, mut syncs) = (0, false, 0, 0);
    for g in &groups {
        if due {
            let mut roots: Vec<usize> = (0..p).map(|w| root(&mut parent, w)).collect();
            if g.reason == CloseReason::GraphSync {
                syncs += 1;
                for &m in &g.members {
                    let r = root(&mut parent, m);
                    roots.retain(|&x| x != r);
                }
                assert!(roots.is_empty(), "a graph sync left a set out: {g:?}");
            } else {
                roots.dedup();
                assert_eq!(roots.len(), 1, "a window ended without connecting everyone");
            }
            parent = (0..p).collect();
            due = false;
            windows += 1;
        }
        if g.reason != CloseReason::GraphSync {
            for pair in g.members.windows(2) {
                let (a, b) = (root(&mut parent, pair[0]), root(&mut parent, pair[1]));
                parent[a] = b;
            }
        }
        updates += g.members.len();
        if updates >= window {
            updates %= window;
            due = true;
        }
    }
    assert!(windows >= 10, "{windows} windows");
    assert!(
        syncs >= 1,
        "the straggler needed a graph sync at least once"
    );
    // Waits stayed within their bounds.
    for w in 0..p {
        let wait = s.wait(w).unwrap();
        assert!(
            (WAIT_MIN..=WAIT_MAX).contains(&wait),
            "worker {w}: {wait:?}"
        );
    }
}

#[test]
fn the_wait_adapts_as_specified_and_stays_in_bounds() {
    let mut s = scheduler(4);
    let mut now = Duration::ZERO;
    // Worker 0 alone: its wait doubles up to 10 ms.
    for want_ms in [1, 2, 4, 8, 10, 10] {
        assert_eq!(s.wait(0), Some(want_ms * MS));
        assert!(s.ready(0, now).unwrap().is_empty());
        let deadline = s.next_deadline().unwrap();
        assert_eq!(deadline, now + want_ms * MS, "the opener's wait sets it");
        assert!(s.poll(deadline - US).is_empty(), "not yet");
        let g = s.poll(deadline);
        assert_eq!(members(&g), [vec![0]]);
        assert_eq!(g[0].reason, CloseReason::Deadline);
        assert_eq!(g[0].closed_at, deadline);
        now = deadline + MS;
    }
    // Full groups: 0.9 of the wait each time, down to 0.01 ms.
    let mut expect = 10 * MS;
    for _ in 0..100 {
        for w in 0..4 {
            s.ready(w, now).unwrap();
        }
        expect = expect.mul_f64(WAIT_SHRINK).max(WAIT_MIN);
        assert_eq!(s.wait(0), Some(expect));
        now += MS;
    }
    assert_eq!(s.wait(0), Some(WAIT_MIN));
    // A group of two is large enough; it shrinks (floored).
    s.ready(1, now).unwrap();
    s.ready(2, now).unwrap();
    let g = s.poll(now + s.wait(1).unwrap());
    assert_eq!(members(&g), [vec![1, 2]]);
    assert_eq!(s.wait(1), Some(WAIT_MIN));
}

#[test]
fn a_late_poll_closes_at_the_deadline_and_a_late_arrival_opens_the_next() {
    let mut s = scheduler(3);
    s.ready(0, Duration::ZERO).unwrap();
    // Nobody polled at 1 ms; worker 1 comes at 5 ms.
    let g = s.ready(1, 5 * MS).unwrap();
    assert_eq!(members(&g), [vec![0]]);
    assert_eq!(g[0].closed_at, MS);
    assert_eq!(s.waiting(), [1]);
    assert_eq!(s.next_deadline(), Some(5 * MS + WAIT_INITIAL));
    // Worker 0, released by that group, may say ready again at once.
    assert!(s.ready(0, 5 * MS).unwrap().is_empty());
    assert_eq!(s.waiting(), [1, 0]);
}

#[test]
fn above_8_workers_groups_are_pairs() {
    // Ten workers, all ready: five pairs by sorted id.
    let mut s = scheduler(10);
    let mut g = Vec::new();
    for w in [7, 3, 9, 0, 5, 1, 8, 2, 6, 4] {
        g.extend(s.ready(w, MS).unwrap());
    }
    assert_eq!(
        members(&g),
        [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]].map(|p| p.to_vec())
    );
    assert!(g.iter().all(|g| g.reason == CloseReason::AllReady));
    // Nine: four pairs and one alone, whose wait grows.
    let mut s = scheduler(9);
    let mut g = Vec::new();
    for w in 0..9 {
        g.extend(s.ready(w, MS).unwrap());
    }
    assert_eq!(members(&g).last().unwrap(), &[8]);
    assert_eq!(g.len(), 5);
    assert_eq!(s.wait(8), Some(2 * WAIT_INITIAL));
    assert_eq!(s.wait(0), Some(WAIT_INITIAL.mul_f64(WAIT_SHRINK)));
    // Ten workers, three ready at the deadline: a pair and one alone.
    let mut s = scheduler(10);
    for w in [6, 2, 4] {
        s.ready(w, MS).unwrap();
    }
    let g = s.poll(MS + WAIT_INITIAL);
    assert_eq!(members(&g), [vec![2, 4], vec![6]]);
    // Eight workers: not split.
    let mut s = scheduler(8);
    let mut g = Vec::new();
    for w in 0..8 {
        g.extend(s.ready(w, MS).unwrap());
    }
    assert_eq!(members(&g), [(0..8).collect::<Vec<_>>()]);
}

/// Three workers, ssp_bound 1 (a window is 3 updates), brought to a graph
/// sync that opens with the sets {0, 1} and {2}.
fn at_a_graph_sync() -> (PartialReduce, Duration) {
    let mut s = PartialReduce::new(PReduceConfig {
        ssp_bound: 1,
        ..PReduceConfig::new(3)
    })
    .unwrap();
    // All three: a full group, 3 updates: the window ends.
    for w in 0..3 {
        s.ready(w, Duration::ZERO).unwrap();
    }
    assert!(s.graph_sync_due());
    // Everyone is connected already: no graph sync, a normal group of 0, 1.
    s.ready(0, MS).unwrap();
    assert!(!s.graph_sync_open() && !s.graph_sync_due());
    s.ready(1, MS).unwrap();
    let g = s.poll(s.next_deadline().unwrap());
    assert_eq!(members(&g), [vec![0, 1]]);
    // Worker 2 alone: 3 updates, the window ends with {0, 1} and {2}.
    s.ready(2, 3 * MS).unwrap();
    let g = s.poll(s.next_deadline().unwrap());
    assert_eq!(members(&g), [vec![2]]);
    assert!(s.graph_sync_due());
    assert_eq!(s.merged_with(0), [0, 1]);
    // The next group is a graph sync: no deadline, 0 and 1 cannot close it.
    let now = 10 * MS;
    assert!(s.ready(0, now).unwrap().is_empty());
    assert!(s.graph_sync_open());
    assert!(s.ready(1, now).unwrap().is_empty());
    assert_eq!(s.next_deadline(), None);
    assert!(
        s.poll(now + 1_000 * MS).is_empty(),
        "it waits with no timeout"
    );
    (s, now + 1_000 * MS)
}

#[test]
fn a_graph_sync_waits_until_every_set_has_a_ready_member() {
    let (mut s, now) = at_a_graph_sync();
    let g = s.ready(2, now).unwrap();
    assert_eq!(members(&g), [vec![0, 1, 2]]);
    assert_eq!(g[0].reason, CloseReason::GraphSync);
    // The union-find was reset.
    assert_eq!(s.merged_with(0), [0]);
}

#[test]
fn a_graph_sync_closes_once_covered_without_everyone() {
    // Four workers, sets {0, 1, 2} and {3}: 0 and 3 suffice.
    let mut s = PartialReduce::new(PReduceConfig {
        ssp_bound: 1,
        ..PReduceConfig::new(4)
    })
    .unwrap();
    for w in 0..4 {
        s.ready(w, Duration::ZERO).unwrap();
    }
    // Full group (4 updates: due) is connected; the next group skips the
    // sync: 0, 1, 2 then 3 alone bring 4 updates and the sets {0,1,2}, {3}.
    for w in 0..3 {
        s.ready(w, MS).unwrap();
    }
    s.poll(s.next_deadline().unwrap());
    s.ready(3, 3 * MS).unwrap();
    s.poll(s.next_deadline().unwrap());
    assert!(s.graph_sync_due());
    s.ready(0, 10 * MS).unwrap();
    assert!(s.graph_sync_open());
    let g = s.ready(3, 11 * MS).unwrap();
    assert_eq!(members(&g), [vec![0, 3]]);
    assert_eq!(g[0].reason, CloseReason::GraphSync);
    assert_eq!((g[0].opened_at, g[0].closed_at), (10 * MS, 11 * MS));
}

#[test]
fn removing_the_missing_worker_unblocks_a_graph_sync() {
    let (mut s, now) = at_a_graph_sync();
    let g = s.remove(2, now).unwrap();
    assert_eq!(members(&g), [vec![0, 1]]);
    assert_eq!(g[0].reason, CloseReason::GraphSync);
    // From now on groups are of the two live workers.
    s.ready(1, now + MS).unwrap();
    let g = s.ready(0, now + MS).unwrap();
    assert_eq!(members(&g), [vec![0, 1]]);
    assert_eq!(
        s.ready(2, now + 2 * MS),
        Err(GroupError::Removed { worker: 2 })
    );
}

#[test]
fn removal_completes_or_empties_the_open_group() {
    let mut s = scheduler(3);
    s.ready(0, MS).unwrap();
    s.ready(1, MS).unwrap();
    let g = s.remove(2, 2 * US + MS).unwrap();
    assert_eq!(members(&g), [vec![0, 1]]);
    assert_eq!(g[0].reason, CloseReason::AllReady);
    // A waiting worker removed: the group it opened is gone with it.
    s.ready(0, 2 * MS).unwrap();
    assert!(s.remove(0, 2 * MS).unwrap().is_empty());
    assert_eq!(s.next_deadline(), None);
    assert!(s.waiting().is_empty());
}

#[test]
fn bad_calls_are_refused_naming_the_worker() {
    assert_eq!(
        PartialReduce::new(PReduceConfig::new(0)).unwrap_err(),
        GroupError::Workers {
            workers: 0,
            max: WORKERS_MAX
        }
    );
    assert!(PartialReduce::new(PReduceConfig::new(WORKERS_MAX)).is_ok());
    assert!(matches!(
        PartialReduce::new(PReduceConfig::new(WORKERS_MAX + 1)),
        Err(GroupError::Workers { .. })
    ));
    for (cfg, field) in [
        (
            PReduceConfig {
                ssp_bound: 0,
                ..PReduceConfig::new(2)
            },
            "ssp_bound",
        ),
        (
            PReduceConfig {
                wait_min: Duration::ZERO,
                ..PReduceConfig::new(2)
            },
            "wait_min",
        ),
        (
            PReduceConfig {
                wait_initial: 20 * MS,
                ..PReduceConfig::new(2)
            },
            "wait_initial",
        ),
    ] {
        let e = PartialReduce::new(cfg).unwrap_err();
        assert!(
            matches!(e, GroupError::Config { field: f, .. } if f == field),
            "{e}"
        );
    }
    let mut s = scheduler(3);
    assert_eq!(
        s.ready(3, MS),
        Err(GroupError::UnknownWorker {
            worker: 3,
            workers: 3
        })
    );
    s.ready(0, 2 * MS).unwrap();
    assert_eq!(
        s.ready(0, 2 * MS),
        Err(GroupError::AlreadyWaiting { worker: 0 })
    );
    let e = s.ready(1, MS).unwrap_err();
    assert!(
        matches!(e, GroupError::ClockWentBack { worker: 1, .. }),
        "{e}"
    );
    assert!(s.poll(MS).is_empty(), "a poll in the past closes nothing");
    s.remove(2, 2 * MS).unwrap();
    assert_eq!(s.remove(2, 2 * MS), Err(GroupError::Removed { worker: 2 }));
}
