//! DynPipe's decision path, pure: iterations assembled from reports, the
//! slowest replica per stage, the bound on held iterations, layer costs by
//! FLOPs, and the planner's decision.

use super::*;

fn spec(pipelines: u32, stages: u32, dynamic: &str) -> JobSpec {
    JobSpec::from_json(&format!(
        r#"{{"name": "d", "model": "m", "optimizer": {{"sgd": {{"lr": 0.1}}}},
            "batch": 8, "microbatches": 4, "pipelines": {pipelines}, "stages": {stages},
            "iterations": 1000, "dynamic": {dynamic}}}"#
    ))
    .unwrap()
}

const FAST: &str = r#"{"enabled": true, "window": 2, "baseline_at": 2, "delay": 5}"#;

#[test]
fn an_iteration_is_fed_once_every_worker_reported_it_and_the_slowest_replica_counts() {
    let mut w = DynPipeWatch::new(&spec(2, 2, FAST), 0).unwrap();
    let mut triggers = Vec::new();
    for it in 1..=4u64 {
        // Pipeline 1's stage 0 is three times slower from iteration 3.
        let slow = if it > 2 { 0.3 } else { 0.1 };
        for (p, s, t) in [(1, 1, 0.1), (0, 0, 0.1), (1, 0, slow), (0, 1, 0.1)] {
            // Reports of later iterations may come first.
            if let Some(t) = w.observe(p, s, it, t) {
                triggers.push((it, p, s, t));
            }
        }
    }
    assert_eq!(triggers.len(), 1, "{triggers:?}");
    let (it, p, s, t) = &triggers[0];
    assert_eq!((*it, *p, *s), (4, 0, 1), "the last report of iteration 4");
    assert_eq!((t.decided_at_iteration, t.at_iteration), (4, 9));
    assert_eq!(t.stragglers, vec![0]);
    assert!((t.ratios[0] - 3.0).abs() < 1e-9 && (t.ratios[1] - 1.0).abs() < 1e-9);
    assert!(
        t.baseline_s.iter().all(|b| (b - 0.1).abs() < 1e-9),
        "per iteration: {:?}",
        t.baseline_s
    );
    // Old and foreign reports are ignored.
    assert!(w.observe(0, 0, 2, 50.0).is_none());
    assert!(w.observe(5, 0, 9, 1.0).is_none());
}

#[test]
fn a_silent_worker_does_not_hold_the_monitor_forever() {
    let mut w = DynPipeWatch::new(&spec(1, 2, FAST), 0).unwrap();
    assert!(w.observe(0, 1, 1, 0.1).is_none());
    let mut fired = None;
    for it in 1..=80u64 {
        let t = if it > 2 { 0.5 } else { 0.1 };
        if let Some(trigger) = w.observe(0, 0, it, t) {
            fired.get_or_insert((it, trigger));
        }
        assert!(w.open_iterations() <= OPEN_ITERATIONS_MAX);
    }
    // Stage 1 keeps its last time; iteration 4 was fed once 64 newer ones
    // were held.
    let (at, trigger) = fired.expect("the monitor went on without stage 1");
    assert_eq!(at, 4 + OPEN_ITERATIONS_MAX as u64);
    assert_eq!(trigger.decided_at_iteration, 4);
    assert_eq!(trigger.stragglers, vec![0]);
    assert!(
        (trigger.ratios[0] - 5.0).abs() < 1e-9,
        "{:?}",
        trigger.ratios
    );
}

#[test]
fn the_monitor_settings_are_checked_naming_the_field() {
    let e = DynPipeWatch::new(
        &spec(
            1,
            2,
            r#"{"enabled": true, "window": 40, "baseline_at": 100}"#,
        ),
        0,
    )
    .unwrap_err();
    assert_eq!(e.field(), "dynamic.baseline_at");
    assert!(
        e.to_string()
            .contains("must be a multiple of dynamic.window = 40"),
        "{e}"
    );
}

#[test]
fn a_stages_time_is_spread_over_its_layers_by_flops() {
    let costs = layer_costs(&[3.0, 1.0], &[2, 2], Some(&[1, 2, 0, 0]));
    let total: Vec<f64> = costs.iter().map(|c| c.forward_s + c.backward_s).collect();
    assert_eq!(
        total,
        vec![1.0, 2.0, 0.5, 0.5],
        "a stage of no FLOPs: evenly"
    );
    for c in &costs {
        assert!((c.backward_s - BACKWARD_PER_FORWARD * c.forward_s).abs() < 1e-12);
        assert_eq!((c.comm_in_s, c.comm_out_s), (0.0, 0.0));
    }
    let even = layer_costs(&[3.0, 1.0], &[2, 2], None);
    let total: Vec<f64> = even.iter().map(|c| c.forward_s + c.backward_s).collect();
    assert_eq!(total, vec![1.5, 1.5, 0.5, 0.5]);
}

fn input(model: Option<Arc<ModelEntry>>) -> RepartitionInput {
    RepartitionInput {
        job: "d-1".into(),
        generation: 0,
        trigger: Trigger {
            decided_at_iteration: 150,
            at_iteration: 210,
            ratios: vec![1.0, 3.0],
            stragglers: vec![1],
            baseline_s: vec![0.2, 0.2],
        },
        microbatches: 2,
        partition: vec![5, 5],
        model,
    }
}

#[test]
fn the_planner_moves_layers_off_the_slow_stage_and_predicts_the_gain() {
    let d = plan_repartition(&input(None)).unwrap();
    // Even costs (no manifest): candidates are the current cut and after
    // each stage's two first (tied) layers: 1, 2, 5, 6, 7. A 3x stage 1
    // wants 7.5 layers on stage 0; 7 is the best candidate.
    assert_eq!(d.new_partition, vec![7, 3]);
    assert_eq!(d.old_partition, vec![5, 5]);
    assert_eq!(
        (d.generation, d.decided_at_iteration, d.at_iteration),
        (0, 150, 210)
    );
    assert!(
        d.layer_costs
            .starts_with("layers: the catalog holds another version"),
        "{}",
        d.layer_costs
    );
    // 0.1 s per microbatch per stage; stage 1 runs 3x: 5 layers of 0.02 s
    // there take 0.3 s now, 3 take 0.18 s; stage 0's 7 take 0.14 s.
    assert!(
        (d.current_s_per_microbatch - 0.3).abs() < 0.02,
        "{}",
        d.current_s_per_microbatch
    );
    assert!(
        (d.predicted_s_per_microbatch - 0.18).abs() < 0.02,
        "{}",
        d.predicted_s_per_microbatch
    );
    // A trigger that does not match the partition is refused.
    let mut bad = input(None);
    bad.partition = vec![4, 3, 3];
    assert!(plan_repartition(&bad)
        .unwrap_err()
        .contains("the monitor measured 2 stages, the partition has 3"));
}
