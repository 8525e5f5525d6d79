use super::*;

/// A sample of `raw` bytes whose steps make `sizes` and take `times`.
fn sample(id: u64, raw: u64, sizes: [u64; 5], times: [f64; 5]) -> SampleProfile {
    SampleProfile {
        id,
        raw_bytes: raw,
        bytes_after: sizes,
        step_s: times,
    }
}

/// A JPEG of `raw` bytes as SOPHON's profile sees one: decoding makes a
/// large bitmap, the crop a 150 KB one, ToTensor quadruples it.
fn jpeg(id: u64, raw: u64, decode_s: f64) -> SampleProfile {
    sample(
        id,
        raw,
        [raw * 6, 150_528, 150_528, 602_112, 602_112],
        [decode_s, 0.002, 0.0001, 0.001, 0.001],
    )
}

fn res(mbit: f64, cpus: u32) -> Resources {
    Resources {
        bandwidth_bytes_per_s: mbit * 1e6 / 8.0,
        remote_cpus: cpus,
    }
}

/// A seeded profile of `n` JPEGs from 50 KB to 1 MB.
fn profile(n: usize, seed: u64) -> Vec<SampleProfile> {
    let mut x = seed;
    let mut next = || {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) as f64 / u64::MAX as f64
    };
    (0..n as u64)
        .map(|id| {
            let raw = 50_000 + (next() * 950_000.0) as u64;
            jpeg(id, raw, 0.002 + raw as f64 * 1e-8 * (0.5 + next()))
        })
        .collect()
}

fn offloaded(p: &Plan) -> Vec<usize> {
    (0..p.steps.len()).filter(|&i| p.steps[i] > 0).collect()
}

#[test]
fn a_sample_no_step_shrinks_is_never_offloaded() {
    // Small JPEGs (below the 150 KB crop) save nothing, however many CPUs.
    let small: Vec<_> = (0..20).map(|i| jpeg(i, 40_000 + i * 1000, 0.001)).collect();
    let p = plan(&small, Mode::Sophon, &res(1.0, 64)).unwrap();
    assert_eq!(p.offloaded(), 0);
    assert_eq!(p.bytes, small.iter().map(|s| s.raw_bytes).sum::<u64>());
    // Mixed with large ones, only the large ones go.
    let mut mixed = small.clone();
    mixed.extend((100..110).map(|i| jpeg(i, 800_000, 0.004)));
    let p = plan(&mixed, Mode::Sophon, &res(1.0, 64)).unwrap();
    assert_eq!(offloaded(&p), (20..30).collect::<Vec<_>>());
    // Each stops after the crop: the smallest output below the raw size.
    assert!(p.steps[20..].iter().all(|&k| k == 2), "{:?}", p.steps);
}

#[test]
fn samples_go_in_efficiency_order_and_the_plan_stops_exactly_when_the_network_is_no_longer_the_bottleneck(
) {
    let prof = profile(500, 7);
    // Efficiency of each eligible sample.
    let eff = |s: &SampleProfile| {
        let (_, saved, cost) = s.best_step().unwrap();
        saved as f64 / cost
    };
    let mut stopped = 0;
    for (mbit, cpus) in [
        (500.0, 1),
        (500.0, 4),
        (1000.0, 2),
        (2000.0, 8),
        (4000.0, 4),
    ] {
        let r = res(mbit, cpus);
        let p = plan(&prof, Mode::Sophon, &r).unwrap();
        let chosen = offloaded(&p);
        assert!(!chosen.is_empty());
        // A prefix of the efficiency order: every offloaded sample is at
        // least as efficient as every eligible one left out.
        let worst_in = chosen
            .iter()
            .map(|&i| eff(&prof[i]))
            .fold(f64::INFINITY, f64::min);
        let best_out = (0..prof.len())
            .filter(|i| p.steps[*i] == 0 && prof[*i].best_step().is_some())
            .map(|i| eff(&prof[i]))
            .fold(0.0, f64::max);
        assert!(worst_in >= best_out, "{worst_in} < {best_out}");
        let eligible = prof.iter().filter(|s| s.best_step().is_some()).count();
        if chosen.len() == eligible {
            // Every sample that saves bytes went, and the network stayed
            // the bottleneck throughout.
            assert!(
                p.net_s >= p.remote_cpu_s,
                "{mbit} Mbit/s, {cpus} CPUs: {p:?}"
            );
            continue;
        }
        stopped += 1;
        // It stopped because net_time < remote_cpu_time, and not a
        // sample earlier: without the last one the network still was the
        // bottleneck (net >= cpu).
        assert!(
            p.net_s < p.remote_cpu_s,
            "{mbit} Mbit/s, {cpus} CPUs: {p:?}"
        );
        let last = chosen
            .iter()
            .copied()
            .min_by(|&a, &b| eff(&prof[a]).total_cmp(&eff(&prof[b])))
            .unwrap();
        let mut before = p.steps.clone();
        before[last] = 0;
        let wire: u64 = prof
            .iter()
            .zip(&before)
            .map(|(s, &k)| s.bytes_at(usize::from(k)))
            .sum();
        let cpu: f64 = prof
            .iter()
            .zip(&before)
            .map(|(s, &k)| s.cost_at(usize::from(k)))
            .sum();
        assert!(wire as f64 / r.bandwidth_bytes_per_s >= cpu / f64::from(cpus));
    }
    assert!(
        stopped >= 3,
        "only {stopped} settings stopped before the last sample"
    );
}

#[test]
fn more_cpus_or_less_bandwidth_offloads_a_superset() {
    let prof = profile(400, 11);
    let set = |r: Resources| offloaded(&plan(&prof, Mode::Sophon, &r).unwrap());
    let subset = |a: &[usize], b: &[usize]| a.iter().all(|i| b.contains(i));
    for cpus in 1..8 {
        let (a, b) = (set(res(500.0, cpus)), set(res(500.0, cpus + 1)));
        assert!(subset(&a, &b), "{cpus} CPUs: {a:?} not within {b:?}");
    }
    for mbit in [2000.0, 1000.0, 500.0, 250.0, 100.0] {
        let (a, b) = (set(res(mbit, 2)), set(res(mbit / 2.0, 2)));
        assert!(subset(&a, &b), "{mbit} Mbit/s: {a:?} not within {b:?}");
    }
    // With a slow enough link every sample that saves bytes goes.
    let all = set(res(0.001, 1));
    assert_eq!(
        all.len(),
        prof.iter().filter(|s| s.best_step().is_some()).count()
    );
}

#[test]
fn fixed_modes_run_the_same_steps_for_every_sample() {
    let prof = profile(50, 3);
    let r = res(500.0, 2);
    let none = plan(&prof, Mode::None, &r).unwrap();
    assert!(none.steps.iter().all(|&k| k == 0));
    assert_eq!(none.remote_cpu_s, 0.0);
    assert_eq!(none.bytes, prof.iter().map(|s| s.raw_bytes).sum::<u64>());
    let all = plan(&prof, Mode::All, &r).unwrap();
    assert!(all.steps.iter().all(|&k| k == 5));
    assert_eq!(all.bytes, 50 * 602_112);
    let crop = plan(&prof, Mode::Split(2), &r).unwrap();
    assert_eq!(crop.bytes, 50 * 150_528);
    let cpu: f64 = prof.iter().map(|s| s.step_s[0] + s.step_s[1]).sum();
    assert!((crop.remote_cpu_s - cpu / 2.0).abs() < 1e-12);
    assert!((crop.net_s - crop.bytes as f64 / r.bandwidth_bytes_per_s).abs() < 1e-12);
}

#[test]
fn modes_parse_and_bad_input_is_named() {
    assert_eq!("none".parse::<Mode>(), Ok(Mode::None));
    assert_eq!("all".parse::<Mode>(), Ok(Mode::All));
    assert_eq!("sophon".parse::<Mode>(), Ok(Mode::Sophon));
    assert_eq!("split:3".parse::<Mode>(), Ok(Mode::Split(3)));
    assert!("split:6"
        .parse::<Mode>()
        .unwrap_err()
        .contains("K in 0..=5"));
    assert!("some".parse::<Mode>().is_err());

    let prof = profile(3, 1);
    assert_eq!(
        plan(&prof, Mode::Split(6), &res(1.0, 1)),
        Err(PrepError::Split(6))
    );
    assert_eq!(
        plan(&prof, Mode::Sophon, &res(1.0, 0)),
        Err(PrepError::NoCpus)
    );
    assert!(matches!(
        plan(&prof, Mode::Sophon, &res(f64::NAN, 1)),
        Err(PrepError::Bandwidth(_))
    ));
    let mut bad = prof.clone();
    bad[1].step_s[3] = -1.0;
    let e = plan(&bad, Mode::Sophon, &res(1.0, 1)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "sample 1: to_tensor took -1 s: a time must be finite and >= 0"
    );
    // An empty profile is an empty plan.
    let p = plan(&[], Mode::Sophon, &res(1.0, 1)).unwrap();
    assert_eq!((p.steps.len(), p.bytes), (0, 0));
}
