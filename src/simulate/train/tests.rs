//! The training simulator on synthetic costs (uniform layers) and on the
//! shipped measured profile.

use super::*;

/// `layers` identical layers: forward 1 ms, backward 2 ms, 1 MB of params,
/// 1 MB across every cut.
fn uniform(layers: usize) -> ModelCosts {
    ModelCosts {
        forward_s: vec![1e-3; layers],
        backward_s: vec![2e-3; layers],
        param_bytes: vec![1_000_000; layers],
        boundary_bytes: vec![1_000_000; layers + 1],
    }
}

fn spec(pipelines: u32, sync: &str, iterations: u64, extra: &str) -> JobSpec {
    JobSpec::from_json(&format!(
        r#"{{"name": "sim", "model": "m", "optimizer": {{"sgd": {{"lr": 0.1}}}}, "batch": 32,
            "microbatches": 8, "pipelines": {pipelines}, "stages": 4, "iterations": {iterations},
            "sync": {{"{sync}": {{}}}} {extra}}}"#
    ))
    .unwrap()
}

fn opts(mode: RepartitionMode) -> SimOptions {
    SimOptions {
        link_bytes_per_s: 12.5e9,
        mode,
        restart_s: 0.0,
        seed: 7,
    }
}

#[test]
fn one_pipeline_runs_the_1f1b_makespan_every_iteration() {
    let costs = uniform(40);
    let s = spec(1, "allreduce", 5, "");
    let r = simulate(&costs, &s, &opts(RepartitionMode::Static)).unwrap();
    assert_eq!(r.iterations.len(), 5);
    // 10 layers per stage: f 10 ms, b 20 ms; comm 1 MB / 12.5 GB/s.
    let stages = vec![StageTime::new(0.01, 0.02); 4];
    let comm = vec![BoundaryComm::symmetric(1e6 / 12.5e9); 3];
    let (want, _) = simulate_with_events(&stages, &comm, 8).unwrap();
    for &(_, d) in &r.iterations {
        assert!(
            (d - want.makespan_s).abs() < 1e-9,
            "{d} vs {}",
            want.makespan_s
        );
    }
    assert!((r.samples_per_s - 32.0 / want.makespan_s).abs() / r.samples_per_s < 1e-9);
}

#[test]
fn without_stragglers_partial_reduce_forms_full_groups_as_allreduce_does() {
    let costs = uniform(40);
    let a = simulate(
        &costs,
        &spec(4, "allreduce", 20, ""),
        &opts(RepartitionMode::Static),
    )
    .unwrap();
    let p = simulate(
        &costs,
        &spec(4, "preduce", 20, ""),
        &opts(RepartitionMode::Static),
    )
    .unwrap();
    assert_eq!(a.mean_group, 4.0);
    assert_eq!(p.mean_group, 4.0);
    assert!((a.samples_per_s - p.samples_per_s).abs() / a.samples_per_s < 1e-6);
}

#[test]
fn under_hetero_stragglers_partial_reduce_outruns_allreduce() {
    let costs = uniform(40);
    let hetero = r#", "interference": {"hetero_s": 0.3, "hetero_p": 0.1}"#;
    let run = |sync| {
        simulate(
            &costs,
            &spec(8, sync, 60, hetero),
            &opts(RepartitionMode::Static),
        )
        .unwrap()
    };
    let (a, p, g) = (run("allreduce"), run("preduce"), run("adpsgd"));
    assert!(p.mean_group < 8.0, "partial reduce left no straggler out");
    assert!(
        p.samples_per_s > 1.3 * a.samples_per_s,
        "preduce {} vs allreduce {} samples/s",
        p.samples_per_s,
        a.samples_per_s
    );
    assert!(g.samples_per_s > a.samples_per_s);
}

#[test]
fn a_slow_stage_is_repartitioned_once_and_iterations_get_faster_than_static() {
    let costs = uniform(40);
    let slow = r#", "dynamic": {"enabled": true},
        "interference": {"slowdowns": [{"stage": 1, "factor": 3.0, "at_iteration": 120}]}"#;
    let s = spec(2, "allreduce", 300, slow);
    let st = simulate(&costs, &s, &opts(RepartitionMode::Static)).unwrap();
    let dy = simulate(&costs, &s, &opts(RepartitionMode::Dynamic)).unwrap();
    let re = simulate(&costs, &s, &opts(RepartitionMode::Restart)).unwrap();
    assert!(st.repartitions.is_empty());
    assert_eq!(dy.repartitions.len(), 1, "{:?}", dy.repartitions);
    let r = &dy.repartitions[0];
    assert!(r.after[1] < r.before[1], "stage 1 kept its layers: {r:?}");
    assert_eq!(r.after.iter().sum::<usize>(), 40);
    // After the re-partition, iterations are faster than the static plan's.
    // (DynPipe's candidates are the 2 costliest layers of each stage: with
    // identical layers those are each stage's first two, so the new plan can
    // move only a few layers; real models, whose layers differ, move more.)
    let tail =
        |rep: &TrainSimReport| median(rep.iterations[250..].iter().map(|&(_, d)| d).collect());
    assert!(
        tail(&dy) < 0.9 * tail(&st),
        "dynamic {} vs static {}",
        tail(&dy),
        tail(&st)
    );
    // Restart reloads everything: a longer pause, same partition.
    assert_eq!(re.repartitions[0].after, r.after);
    assert!(re.repartitions[0].pause_s > r.pause_s);
    assert!(dy.samples_per_s > st.samples_per_s);
}

#[test]
fn costs_from_the_measured_profile_cover_the_model() {
    let profile = Profile::load(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("settings/profiles/h100-measured-2026-11-26.json"),
    )
    .unwrap();
    let c = ModelCosts::from_profile(&profile, Family::Resnet152, Scale::Full, 4, 2.0).unwrap();
    assert_eq!(c.layers(), 515);
    assert!(c.forward_s.iter().all(|&t| t > 0.0));
    assert_eq!(c.backward_s[7], 2.0 * c.forward_s[7]);
    // ResNet-152: about 60 M f32 params; the input (4 x 3 x 224 x 224 f32) crosses cut 0.
    let params: u64 = c.param_bytes.iter().sum();
    assert!((230_000_000..250_000_000).contains(&params), "{params}");
    assert_eq!(c.boundary_bytes[0], 4 * 3 * 224 * 224 * 4);
    assert!(c.boundary_bytes.iter().all(|&b| b > 0));
}
