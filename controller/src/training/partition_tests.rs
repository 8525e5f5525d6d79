//! The re-partitioner: balance, shedding load off a slow stage, keeping a
//! partition that is already best, coverage, bounds and refusals.

use super::*;
use rand::{Rng, SeedableRng};

fn uniform_layers(n: usize) -> Vec<LayerCost> {
    vec![LayerCost::new(1.0, 2.0); n]
}

fn stage_costs(layers: &[LayerCost], partition: &[usize], slow: &[f64]) -> Vec<f64> {
    let mut start = 0;
    partition
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            let c: f64 = layers[start..start + n]
                .iter()
                .map(|l| l.forward_s + l.backward_s)
                .sum();
            start += n;
            c * slow.get(s).copied().unwrap_or(1.0)
        })
        .collect()
}

/// Every layer in exactly one stage, in order, every stage non-empty.
fn assert_covers(partition: &[usize], layers: usize, stages: usize) {
    assert_eq!(partition.len(), stages, "{partition:?}");
    assert!(partition.iter().all(|&n| n >= 1), "{partition:?}");
    assert_eq!(partition.iter().sum::<usize>(), layers, "{partition:?}");
}

#[test]
fn uniform_costs_without_slowdown_balance_the_stages() {
    let layers = uniform_layers(12);
    // Unbalanced starts whose candidates (each stage's first k layers on
    // ties, plus the current cuts) reach a balanced split.
    for current in [[2, 4, 3, 3], [2, 3, 4, 3], [2, 2, 4, 4]] {
        let plan = repartition(
            &layers,
            &current,
            &MeasuredRatio::none(),
            &RepartitionOptions::default(),
        )
        .unwrap();
        assert_covers(&plan.partition, 12, 4);
        let costs = stage_costs(&layers, &plan.partition, &[]);
        let spread = costs.iter().copied().fold(0.0, f64::max)
            - costs.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(spread <= 3.0 + 1e-9, "{current:?} -> {:?}", plan.partition);
        assert!((plan.time_per_microbatch_s - 9.0).abs() < 1e-9, "{plan:?}");
        assert!(plan.time_per_microbatch_s < plan.current_time_per_microbatch_s);
        assert!(!plan.kept_current);
    }
}

#[test]
fn a_stage_three_times_slower_sheds_layers_to_its_neighbours() {
    let layers = uniform_layers(16);
    let current = [4, 4, 4, 4];
    let slow = MeasuredRatio::new(vec![1.0, 3.0, 1.0, 1.0]).unwrap();
    let plan = repartition(&layers, &current, &slow, &RepartitionOptions::default()).unwrap();
    assert_covers(&plan.partition, 16, 4);
    assert!(plan.partition[1] < 4, "{plan:?}");
    assert!(
        plan.partition[0] + plan.partition[2] + plan.partition[3] > 12,
        "{plan:?}"
    );
    // 4 layers at 3x was 36 per microbatch; the best reachable split is 18.
    assert!(
        (plan.current_time_per_microbatch_s - 36.0).abs() < 1e-9,
        "{plan:?}"
    );
    assert!((plan.time_per_microbatch_s - 18.0).abs() < 1e-9, "{plan:?}");
    // The prediction of the chosen partition is what the plan says.
    let again = predict(&layers, &plan.partition, &slow, MICROBATCHES_DEFAULT).unwrap();
    assert_eq!(again, plan.time_per_microbatch_s);
}

#[test]
fn a_partition_that_is_already_best_is_kept() {
    let layers = uniform_layers(12);
    let plan = repartition(
        &layers,
        &[3, 3, 3, 3],
        &MeasuredRatio::none(),
        &RepartitionOptions::default(),
    )
    .unwrap();
    assert!(plan.kept_current, "{plan:?}");
    assert_eq!(plan.partition, [3, 3, 3, 3]);
    // Kept too when another split ties with it: a slow stage 0 of one layer
    // is the bottleneck whatever the rest does.
    let mut layers = uniform_layers(8);
    layers[0] = LayerCost::new(10.0, 10.0);
    for current in [[1, 2, 5], [1, 4, 3], [1, 3, 4]] {
        let plan = repartition(
            &layers,
            &current,
            &MeasuredRatio::none(),
            &RepartitionOptions::default(),
        )
        .unwrap();
        assert!(plan.kept_current, "{current:?}: {plan:?}");
        assert_eq!(plan.partition, current);
    }
}

#[test]
fn the_plan_is_the_fastest_candidate_and_never_slower_than_now() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for case in 0..40 {
        let n = rng.gen_range(3..14);
        let layers: Vec<_> = (0..n)
            .map(|_| LayerCost {
                forward_s: rng.gen_range(0.1..2.0),
                backward_s: rng.gen_range(0.1..4.0),
                comm_in_s: rng.gen_range(0.0..0.3),
                comm_out_s: rng.gen_range(0.0..0.3),
            })
            .collect();
        let stages = rng.gen_range(1..=n.min(5));
        // A random valid partition: stages - 1 distinct cuts.
        let mut cuts: Vec<usize> = (1..n).collect();
        while cuts.len() > stages - 1 {
            cuts.remove(rng.gen_range(0..cuts.len()));
        }
        let current = partition_of(&cuts, n);
        let slow =
            MeasuredRatio::new((0..stages).map(|_| rng.gen_range(0.4..3.5)).collect()).unwrap();
        let plan = repartition(&layers, &current, &slow, &RepartitionOptions::default()).unwrap();
        assert_covers(&plan.partition, n, stages);
        assert!(
            plan.time_per_microbatch_s <= plan.current_time_per_microbatch_s * (1.0 + TIE_REL),
            "case {case}: {plan:?}"
        );
        // Brute force over the same candidates: nothing is faster.
        let mut best = f64::INFINITY;
        let mut pick = Combinations::new(plan.candidates.len(), stages - 1);
        let mut count = 0;
        while let Some(idx) = pick.next_indices() {
            let cut: Vec<usize> = idx.iter().map(|&i| plan.candidates[i]).collect();
            let p = partition_of(&cut, n);
            assert_covers(&p, n, stages);
            best = best.min(predict(&layers, &p, &slow, MICROBATCHES_DEFAULT).unwrap());
            count += 1;
        }
        assert_eq!(count, plan.evaluated);
        assert!(
            plan.time_per_microbatch_s <= best * (1.0 + TIE_REL),
            "case {case}"
        );
    }
}

#[test]
fn candidates_are_the_current_cuts_and_after_each_stages_costliest_layers() {
    let costs = [5.0, 1.0, 3.0, 2.0, 9.0, 1.0, 1.0, 4.0];
    let layers: Vec<_> = costs.iter().map(|&c| LayerCost::new(c, 0.0)).collect();
    // Stages [0..3) [3..6) [6..8): costliest two of each: {0, 2}, {4, 3},
    // {7, 6}; cuts right after them (8 is the model's end: dropped), plus
    // the current cuts 3 and 6.
    assert_eq!(cut_candidates(&layers, &[3, 3, 2], 2), [1, 3, 4, 5, 6, 7]);
    assert_eq!(cut_candidates(&layers, &[3, 3, 2], 1), [1, 3, 5, 6]);
    // Communication counts in the ranking.
    let mut layers = layers;
    layers[1].comm_out_s = 10.0;
    assert_eq!(cut_candidates(&layers, &[3, 3, 2], 1), [2, 3, 5, 6]);
}

#[test]
fn communication_at_a_cut_counts_in_the_prediction() {
    // Two stages over four equal layers; the boundary after layer 1 is
    // expensive, the one after layer 2 is free: the planner moves the cut.
    let mut layers = uniform_layers(4);
    layers[1].comm_out_s = 20.0;
    let plan = repartition(
        &layers,
        &[2, 2],
        &MeasuredRatio::none(),
        &RepartitionOptions::default(),
    )
    .unwrap();
    assert_ne!(plan.partition, [2, 2], "{plan:?}");
    assert!(plan.time_per_microbatch_s < plan.current_time_per_microbatch_s);
}

#[test]
fn too_many_combinations_lower_k_or_are_refused() {
    // 8 stages over 64 uniform layers: k = 2 gives 23 candidates, C(23, 7)
    // = 245157 > 200000; k = 1 gives 15, C(15, 7) = 6435.
    let layers = uniform_layers(64);
    let plan = repartition(
        &layers,
        &[8; 8],
        &MeasuredRatio::none(),
        &RepartitionOptions::default(),
    )
    .unwrap();
    assert_eq!(plan.top_k, 1);
    assert_eq!(plan.candidates.len(), 15);
    assert_eq!(plan.evaluated, 6435);
    assert!(plan.kept_current);
    // 24 stages: even k = 1 gives C(47, 23), far above the limit.
    let layers = uniform_layers(96);
    let e = repartition(
        &layers,
        &[4; 24],
        &MeasuredRatio::none(),
        &RepartitionOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(e, PartitionError::TooManyCombinations { stages: 24, .. }),
        "{e}"
    );
    assert!(
        e.to_string().contains("more than the limit of 200000"),
        "{e}"
    );
    assert_eq!(binomial(23, 7), 245_157);
    assert_eq!(binomial(3, 5), 0);
    assert_eq!(binomial(200, 100), u64::MAX);
}

#[test]
fn bad_input_is_refused_naming_the_field() {
    let layers = uniform_layers(6);
    let none = MeasuredRatio::none();
    let opts = RepartitionOptions::default();
    let err = |l: &[LayerCost], p: &[usize]| repartition(l, p, &none, &opts).unwrap_err();
    assert_eq!(
        err(&layers, &[2, 2, 1]),
        PartitionError::PartitionSum { sum: 5, layers: 6 }
    );
    assert_eq!(
        err(&layers, &[3, 0, 3]),
        PartitionError::EmptyStage { stage: 1 }
    );
    assert_eq!(
        err(&layers, &[1; 7]),
        PartitionError::StagesExceedLayers {
            stages: 7,
            layers: 6
        }
    );
    assert_eq!(err(&layers, &[]), PartitionError::NoStages);
    assert_eq!(err(&[], &[1]), PartitionError::NoLayers);
    assert_eq!(
        err(&layers, &[usize::MAX, 1]),
        PartitionError::PartitionSum {
            sum: usize::MAX,
            layers: 6
        }
    );
    let mut bad = layers.clone();
    bad[4].comm_in_s = f64::INFINITY;
    assert!(err(&bad, &[3, 3])
        .to_string()
        .contains("comm_in_s of layer 4"));

    let e = repartition(
        &layers,
        &[3, 3],
        &none,
        &RepartitionOptions { top_k: 0, ..opts },
    );
    assert_eq!(e.unwrap_err(), PartitionError::ZeroTopK);
    let e = repartition(
        &layers,
        &[3, 3],
        &none,
        &RepartitionOptions {
            microbatches: 0,
            ..opts
        },
    );
    assert!(matches!(
        e,
        Err(PartitionError::Sim(SimError::NoMicrobatches))
    ));

    assert_eq!(
        MeasuredRatio::new(vec![1.0, 0.0]).unwrap_err(),
        PartitionError::BadSlowdown {
            stage: 1,
            value: 0.0
        }
    );
    assert!(matches!(
        MeasuredRatio::from_times(&[1.0, 2.0], &[1.0]),
        Err(PartitionError::LengthMismatch {
            field: "baseline_s",
            ..
        })
    ));
    let r = MeasuredRatio::from_times(&[3.0, 1.0], &[1.0, 2.0]).unwrap();
    assert_eq!(r.ratios(), [3.0, 0.5]);

    // A predictor that answers nonsense is caught, naming the stage.
    struct Broken;
    impl SlowdownPredictor for Broken {
        fn slowdown(&self, stage: usize, _: Range<usize>) -> f64 {
            if stage == 1 {
                f64::NAN
            } else {
                1.0
            }
        }
    }
    let e = repartition(&layers, &[3, 3], &Broken, &opts).unwrap_err();
    assert!(
        matches!(e, PartitionError::BadSlowdown { stage: 1, .. }),
        "{e}"
    );
}

#[test]
fn a_predictor_sees_the_layers_a_stage_would_hold() {
    // A predictor that slows a stage holding layer 0 together with others
    // (say, memory pressure): the planner isolates layer 0.
    struct Crowded;
    impl SlowdownPredictor for Crowded {
        fn slowdown(&self, _stage: usize, layers: Range<usize>) -> f64 {
            if layers.start == 0 && layers.len() > 1 {
                4.0
            } else {
                1.0
            }
        }
    }
    let layers = uniform_layers(6);
    let plan = repartition(&layers, &[3, 3], &Crowded, &RepartitionOptions::default()).unwrap();
    assert_eq!(plan.partition, [1, 5], "{plan:?}");
}
