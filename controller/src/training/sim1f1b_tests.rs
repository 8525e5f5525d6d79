//! The 1F1B simulator against closed forms, DynPipe's own simulator's
//! figures, and the schedule's rules op by op.

use super::*;
use rand::{Rng, SeedableRng};

fn uniform(stages: usize, f: f64, b: f64) -> Vec<StageTime> {
    vec![StageTime::new(f, b); stages]
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-12)
}

/// The largest cycle mean of 1F1B (the module doc): over every run of
/// stages `s..=t`, its compute plus the round trips inside it, per
/// microbatch it carries.
fn cycle_bound(stages: &[StageTime], comm: &[BoundaryComm]) -> f64 {
    let mut best = 0.0f64;
    for s in 0..stages.len() {
        let mut sum = 0.0;
        for (t, st) in stages.iter().enumerate().skip(s) {
            sum += st.forward_s + st.backward_s;
            if t > s {
                if let Some(c) = comm.get(t - 1) {
                    sum += c.activation_s + c.gradient_s;
                }
            }
            best = best.max(sum / (t - s + 1) as f64);
        }
    }
    best
}

#[test]
fn uniform_stages_run_one_stage_time_per_microbatch() {
    for stages in [1, 2, 4, 8] {
        let r = simulate(&uniform(stages, 1.0, 2.0), &[], MICROBATCHES_DEFAULT).unwrap();
        assert!(r.steady_state);
        assert!(
            close(r.time_per_microbatch_s, 3.0, 1e-12),
            "{stages} stages: {}",
            r.time_per_microbatch_s
        );
    }
}

#[test]
fn the_slowest_stage_sets_the_pace_without_comm() {
    let stages = [
        StageTime::new(1.0, 2.0),
        StageTime::new(2.0, 5.0),
        StageTime::new(0.5, 0.5),
        StageTime::new(1.0, 1.0),
    ];
    let r = simulate(&stages, &[], MICROBATCHES_DEFAULT).unwrap();
    assert!(close(r.time_per_microbatch_s, 7.0, 1e-12), "{r:?}");
    // The bottleneck anywhere, first or last.
    for slow in 0..4 {
        let mut st = uniform(4, 1.0, 1.0);
        st[slow] = StageTime::new(3.0, 3.0);
        let r = simulate(&st, &[], MICROBATCHES_DEFAULT).unwrap();
        assert!(
            close(r.time_per_microbatch_s, 6.0, 1e-12),
            "slow {slow}: {r:?}"
        );
    }
}

#[test]
fn comm_shows_only_when_the_in_flight_window_cannot_hide_it() {
    // Stage 1 is the bottleneck (8 per microbatch); the boundary's cycle
    // carries two microbatches: (2 + 8 + round trip) / 2.
    // 401 microbatches: the span measured (microbatch 2 to 400) is a whole
    // number of the two-microbatch cycle, so the average is exact.
    let stages = [StageTime::new(1.0, 1.0), StageTime::new(4.0, 4.0)];
    let hidden = simulate(&stages, &[BoundaryComm::symmetric(2.0)], 401).unwrap();
    assert!(
        close(hidden.time_per_microbatch_s, 8.0, 1e-12),
        "{hidden:?}"
    );
    let exactly = simulate(&stages, &[BoundaryComm::symmetric(3.0)], 401).unwrap();
    assert!(
        close(exactly.time_per_microbatch_s, 8.0, 1e-12),
        "{exactly:?}"
    );
    let shows = simulate(&stages, &[BoundaryComm::symmetric(5.0)], 401).unwrap();
    assert!(close(shows.time_per_microbatch_s, 10.0, 1e-12), "{shows:?}");
    // Only the round trip counts, however it is split.
    let split = [BoundaryComm {
        activation_s: 9.0,
        gradient_s: 1.0,
    }];
    let r = simulate(&stages, &split, 401).unwrap();
    assert!(close(r.time_per_microbatch_s, 10.0, 1e-12), "{r:?}");
}

#[test]
fn steady_state_matches_the_largest_cycle_mean() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for case in 0..200 {
        let n = rng.gen_range(1..=6);
        let stages: Vec<_> = (0..n)
            .map(|_| StageTime::new(rng.gen_range(0.1..3.0), rng.gen_range(0.1..3.0)))
            .collect();
        let comm: Vec<_> = if rng.gen_bool(0.5) {
            (0..n - 1)
                .map(|_| BoundaryComm {
                    activation_s: rng.gen_range(0.0..2.0),
                    gradient_s: rng.gen_range(0.0..2.0),
                })
                .collect()
        } else {
            Vec::new()
        };
        let r = simulate(&stages, &comm, 1000).unwrap();
        let want = cycle_bound(&stages, &comm);
        assert!(
            close(r.time_per_microbatch_s, want, 1e-3),
            "case {case}: {stages:?} {comm:?}: simulated {} bound {want}",
            r.time_per_microbatch_s
        );
        // Never faster than the bound: the critical cycle repeats.
        let short = simulate(&stages, &comm, MICROBATCHES_DEFAULT).unwrap();
        assert!(short.makespan_s >= want * (MICROBATCHES_DEFAULT - n) as f64 - 1e-9);
    }
}

#[test]
fn one_microbatch_takes_every_op_and_every_transfer_in_turn() {
    let stages = [
        StageTime::new(1.0, 2.0),
        StageTime::new(3.0, 4.0),
        StageTime::new(0.5, 0.25),
    ];
    let r = simulate(&stages, &[], 1).unwrap();
    assert!(close(r.makespan_s, 10.75, 1e-12), "{r:?}");
    assert!(!r.steady_state);
    assert!(close(r.time_per_microbatch_s, r.makespan_s, 1e-12));
    let comm = [
        BoundaryComm {
            activation_s: 0.5,
            gradient_s: 0.25,
        },
        BoundaryComm::symmetric(1.0),
    ];
    let r = simulate(&stages, &comm, 1).unwrap();
    assert!(close(r.makespan_s, 10.75 + 2.75, 1e-12), "{r:?}");
}

#[test]
fn every_op_runs_once_in_1f1b_order_after_its_input() {
    let stages = [
        StageTime::new(1.0, 2.0),
        StageTime::new(2.0, 1.5),
        StageTime::new(0.5, 3.0),
        StageTime::new(1.0, 1.0),
    ];
    let comm = [
        BoundaryComm::symmetric(0.3),
        BoundaryComm {
            activation_s: 1.0,
            gradient_s: 0.1,
        },
        BoundaryComm::default(),
    ];
    for m in [1, 2, 3, 5, 17] {
        let (r, events) = simulate_with_events(&stages, &comm, m).unwrap();
        let s_n = stages.len();
        assert_eq!(events.len(), 2 * s_n * m);
        let find = |s: usize, i: usize, k: OpKind| {
            let hits: Vec<_> = events
                .iter()
                .filter(|e| e.stage == s && e.microbatch == i && e.kind == k)
                .collect();
            assert_eq!(
                hits.len(),
                1,
                "stage {s} mb {i} {k:?} ran {} times",
                hits.len()
            );
            *hits[0]
        };
        for s in 0..s_n {
            let mine: Vec<_> = events.iter().filter(|e| e.stage == s).collect();
            // The stage's order is 1F1B's, with S - s - 1 warm-up forwards,
            // and one op at a time.
            for (p, e) in mine.iter().enumerate() {
                assert_eq!((e.kind, e.microbatch), op_at(s_n, s, m, p));
                let dur = match e.kind {
                    OpKind::Forward => stages[s].forward_s,
                    OpKind::Backward => stages[s].backward_s,
                };
                assert!(close(e.end_s - e.start_s, dur, 1e-12));
                if p > 0 {
                    assert!(e.start_s >= mine[p - 1].end_s - 1e-12);
                }
            }
            let warm = mine
                .iter()
                .take_while(|e| e.kind == OpKind::Forward)
                .count();
            assert_eq!(
                warm,
                (s_n - s).min(m),
                "stage {s}: warm-up + the first 1F1B forward"
            );
            for i in 0..m {
                let f = find(s, i, OpKind::Forward);
                let b = find(s, i, OpKind::Backward);
                if s > 0 {
                    let up = find(s - 1, i, OpKind::Forward);
                    assert!(f.start_s >= up.end_s + comm[s - 1].activation_s - 1e-12);
                }
                if s + 1 < s_n {
                    let down = find(s + 1, i, OpKind::Backward);
                    assert!(b.start_s >= down.end_s + comm[s].gradient_s - 1e-12);
                } else {
                    assert!(b.start_s >= f.end_s - 1e-12);
                }
            }
        }
        let last = events.iter().map(|e| e.end_s).fold(0.0, f64::max);
        assert_eq!(r.makespan_s, last);
    }
}

#[test]
fn op_times_agree_with_dynpipes_simulator() {
    // Figures printed by DynPipe's own simulator (`main(stage_num, fwd, bwd,
    // comm, 99, 0, 0)` in calculate_new_placement) for these inputs; its
    // average starts at microbatch 0, warm-up included. Its warm-up reads
    // microbatch -1 (Python's last element, initialised to -1) as a stage's
    // previous forward, so there the first forward of a stage 0 < s < S - 1
    // starts no earlier than f_s - 1 s. Where that binds (its own example
    // [1, 9, 1] / [1, 3, 3]: 11.935 against our 11.860) the transient
    // differs; these cases avoid it.
    type Case = (&'static [f64], &'static [f64], &'static [f64], f64);
    let cases: [Case; 5] = [
        (&[1., 1.], &[3., 3.], &[1.], 5.0),
        (&[1., 4.], &[1., 4.], &[2.], 7.979166666666667),
        (&[1., 4.], &[1., 4.], &[5.], 10.0),
        (&[1., 1., 1., 1.], &[2., 2., 2., 2.], &[0., 0., 0.], 3.0),
        (
            &[1., 2., 3., 1.],
            &[2., 1., 4., 1.],
            &[0.5, 0.25, 1.0],
            6.896739130434782,
        ),
    ];
    for (f, b, c, dynpipe) in cases {
        let stages: Vec<_> = f
            .iter()
            .zip(b)
            .map(|(&f, &b)| StageTime::new(f, b))
            .collect();
        let comm: Vec<_> = c.iter().map(|&c| BoundaryComm::symmetric(c)).collect();
        let (_, events) = simulate_with_events(&stages, &comm, MICROBATCHES_DEFAULT).unwrap();
        let got = dynpipe_average(&events, stages.len(), MICROBATCHES_DEFAULT).unwrap();
        assert!(
            close(got, dynpipe, 1e-12),
            "{f:?} {b:?} {c:?}: {got} vs DynPipe's {dynpipe}"
        );
    }
}

#[test]
fn bad_input_is_refused_naming_the_field() {
    let two = uniform(2, 1.0, 1.0);
    assert_eq!(simulate(&[], &[], 5), Err(SimError::NoStages));
    assert_eq!(simulate(&two, &[], 0), Err(SimError::NoMicrobatches));
    assert!(matches!(
        simulate(&two, &[], MICROBATCHES_MAX + 1),
        Err(SimError::TooManyMicrobatches { .. })
    ));
    assert!(matches!(
        simulate(&uniform(STAGES_MAX + 1, 1.0, 1.0), &[], 5),
        Err(SimError::TooManyStages { .. })
    ));
    let e = simulate(&two, &[BoundaryComm::default(); 2], 5).unwrap_err();
    assert_eq!(
        e,
        SimError::CommLength {
            got: 2,
            expected: 1,
            stages: 2
        }
    );
    let mut bad = two.clone();
    bad[1].backward_s = -1.0;
    let e = simulate(&bad, &[], 5).unwrap_err();
    assert!(e.to_string().contains("backward_s of stage 1"), "{e}");
    let e = simulate(&two, &[BoundaryComm::symmetric(f64::NAN)], 5).unwrap_err();
    assert!(e.to_string().contains("activation_s of boundary 0"), "{e}");
}
