use std::collections::{BTreeMap, BTreeSet};

use super::*;

const MIB: u64 = 1 << 20;

fn server(id: u32, capacity_bytes: u64, used_bytes: u64, alive: bool) -> MemserverInfo {
    MemserverInfo {
        id,
        addr: format!("127.0.0.1:{}", 7000 + id),
        capacity_bytes,
        used_bytes,
        alive,
        last_heartbeat_ms_ago: 0,
    }
}

fn servers(n: u32) -> Vec<MemserverInfo> {
    (0..n).map(|i| server(i, 1 << 40, 0, true)).collect()
}

fn opts(strategy: Strategy, shard_width: usize, replication: usize) -> PlanOptions {
    PlanOptions {
        strategy,
        shard_width,
        replication,
        seed: 42,
    }
}

/// Group sizes like a real package: full groups, a ragged last one, one not a
/// multiple of 512 and one smaller than width * 512.
fn groups() -> Vec<u64> {
    vec![32 * MIB, 32 * MIB, 7 * MIB + 3 * 512, 1000, 5 * MIB + 77]
}

fn per_server_bytes(p: &[Vec<SlicePlan>], primary_only: bool) -> BTreeMap<u32, u64> {
    let mut m = BTreeMap::new();
    for s in p.iter().flatten() {
        let n = if primary_only { 1 } else { s.replicas.len() };
        for &id in &s.replicas[..n] {
            *m.entry(id).or_default() += s.len;
        }
    }
    m
}

/// The invariants every plan keeps, whatever the strategy.
fn check_plan(g: &[u64], p: &[Vec<SlicePlan>], replication: usize) {
    assert_eq!(p.len(), g.len());
    for (gi, (slices, &bytes)) in p.iter().zip(g).enumerate() {
        let mut end = 0;
        for s in slices {
            assert_eq!(s.group_offset, end, "group {gi} is not tiled: {slices:?}");
            assert!(s.len > 0, "empty slice in group {gi}");
            assert_eq!(
                s.group_offset % SLICE_ALIGN_BYTES,
                0,
                "unaligned slice start in group {gi}"
            );
            end += s.len;
            assert_eq!(s.replicas.len(), replication);
            let distinct: BTreeSet<_> = s.replicas.iter().collect();
            assert_eq!(
                distinct.len(),
                replication,
                "replicas not distinct: {:?}",
                s.replicas
            );
        }
        assert_eq!(end, bytes, "group {gi} not covered");
    }
}

#[test]
fn every_strategy_covers_every_group_with_distinct_replicas() {
    let g = groups();
    for strategy in Strategy::ALL {
        for (n, width, replication) in [
            (1, 0, 1),
            (3, 0, 1),
            (6, 0, 2),
            (6, 2, 3),
            (5, 5, 2),
            (8, 3, 8),
        ] {
            let p = plan(&g, &servers(n), &opts(strategy, width, replication))
                .unwrap_or_else(|e| panic!("{strategy} n={n} w={width} r={replication}: {e}"));
            check_plan(&g, &p, replication);
        }
    }
}

#[test]
fn strategy_names_round_trip() {
    for s in Strategy::ALL {
        assert_eq!(s.to_string().parse::<Strategy>().unwrap(), s);
    }
    assert_eq!("per-app".parse::<Strategy>().unwrap(), Strategy::PerApp);
    assert_eq!(Strategy::default(), Strategy::Hybrid);
    let e = "dnn".parse::<Strategy>().unwrap_err();
    assert!(e.to_string().contains("\"dnn\"") && e.to_string().contains("per-app"));
}

#[test]
fn per_app_uses_one_server() {
    let p = plan(&groups(), &servers(6), &opts(Strategy::PerApp, 4, 1)).unwrap();
    assert_eq!(per_server_bytes(&p, false).len(), 1);
    assert!(p.iter().all(|g| g.len() == 1));
    // With replication every slice has the same replica set.
    let p = plan(&groups(), &servers(6), &opts(Strategy::PerApp, 0, 2)).unwrap();
    let sets: BTreeSet<_> = p.iter().flatten().map(|s| s.replicas.clone()).collect();
    assert_eq!(sets.len(), 1);
}

#[test]
fn horizontal_cycles_over_the_width() {
    let g = vec![MIB; 10];
    let p = plan(&g, &servers(6), &opts(Strategy::Horizontal, 3, 1)).unwrap();
    let primaries: Vec<u32> = p
        .iter()
        .map(|s| {
            assert_eq!(s.len(), 1, "horizontal keeps groups whole");
            s[0].replicas[0]
        })
        .collect();
    let first3: BTreeSet<_> = primaries[..3].iter().collect();
    assert_eq!(first3.len(), 3);
    for i in 3..10 {
        assert_eq!(primaries[i], primaries[i % 3]);
    }
}

#[test]
fn vertical_ranges_are_contiguous_and_balanced() {
    for g in [
        groups(),
        vec![32 * MIB; 7],
        vec![MIB + 512; 13],
        vec![100 * MIB],
    ] {
        for width in [2, 3, 4] {
            let p = plan(&g, &servers(4), &opts(Strategy::Vertical, width, 1)).unwrap();
            // Walking the model in order, the primary changes `width - 1`
            // times at most and never returns to an earlier server.
            let mut seen: Vec<u32> = Vec::new();
            for s in p.iter().flatten() {
                let id = s.replicas[0];
                if seen.last() != Some(&id) {
                    assert!(
                        !seen.contains(&id),
                        "range of server {id} is not contiguous"
                    );
                    seen.push(id);
                }
            }
            assert!(seen.len() <= width);
            let total: u64 = g.iter().sum();
            let bytes = per_server_bytes(&p, true);
            let biggest_group = *g.iter().max().unwrap();
            for (&id, &b) in &bytes {
                let even = total / width as u64;
                assert!(
                    b.abs_diff(even) <= biggest_group,
                    "server {id}: {b} vs {even}"
                );
                // In fact within two alignment units.
                assert!(
                    b.abs_diff(even) <= 2 * SLICE_ALIGN_BYTES + width as u64,
                    "server {id}: {b} vs {even}"
                );
            }
        }
    }
}

#[test]
fn hybrid_slices_are_balanced_within_512_bytes() {
    let g = groups();
    let p = plan(&g, &servers(4), &opts(Strategy::Hybrid, 0, 1)).unwrap();
    for (slices, &bytes) in p.iter().zip(&g) {
        let expected = 4.min(bytes.div_ceil(512) as usize);
        assert_eq!(slices.len(), expected, "group of {bytes} bytes");
        let lens: Vec<u64> = slices.iter().map(|s| s.len).collect();
        let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
        assert!(hi - lo <= 512, "{lens:?}");
        let primaries: BTreeSet<_> = slices.iter().map(|s| s.replicas[0]).collect();
        assert_eq!(primaries.len(), slices.len(), "one slice per server");
    }
    // A group smaller than width * 512 gets fewer slices.
    let p = plan(&[1000], &servers(4), &opts(Strategy::Hybrid, 4, 1)).unwrap();
    assert_eq!(
        p[0].iter()
            .map(|s| (s.group_offset, s.len))
            .collect::<Vec<_>>(),
        vec![(0, 512), (512, 488)]
    );
    let p = plan(&[512], &servers(4), &opts(Strategy::Hybrid, 4, 1)).unwrap();
    assert_eq!(p[0].len(), 1);
}

#[test]
fn default_width_is_at_most_four_and_picks_the_freest_servers() {
    let mut s = servers(6);
    s[2].used_bytes = s[2].capacity_bytes / 2;
    s[4].used_bytes = s[4].capacity_bytes / 3;
    s[5].alive = false;
    let p = plan(&groups(), &s, &opts(Strategy::Hybrid, 0, 1)).unwrap();
    let used: BTreeSet<u32> = per_server_bytes(&p, false).into_keys().collect();
    assert_eq!(
        used,
        BTreeSet::from([0, 1, 3, 4]),
        "dead server 5 and the fullest (2) are left out"
    );
    let p = plan(&groups(), &s[..2], &opts(Strategy::Hybrid, 0, 1)).unwrap();
    assert_eq!(per_server_bytes(&p, false).len(), 2);
}

#[test]
fn ties_are_broken_by_the_seed_and_plans_are_deterministic() {
    let g = vec![MIB];
    let s = servers(8);
    let pick = |seed| {
        let p = plan(
            &g,
            &s,
            &PlanOptions {
                strategy: Strategy::PerApp,
                seed,
                ..Default::default()
            },
        )
        .unwrap();
        p[0][0].replicas[0]
    };
    assert_eq!(pick(7), pick(7));
    let distinct: BTreeSet<u32> = (0..32).map(pick).collect();
    assert!(distinct.len() > 1, "the seed never changed the pick");
    // The order servers are listed in does not matter.
    let mut rev = s.clone();
    rev.reverse();
    let o = PlanOptions {
        seed: 3,
        ..Default::default()
    };
    assert_eq!(plan(&g, &s, &o).unwrap(), plan(&g, &rev, &o).unwrap());
}

#[test]
fn replicas_extend_beyond_the_width() {
    let p = plan(&[MIB; 4], &servers(5), &opts(Strategy::Horizontal, 2, 4)).unwrap();
    check_plan(&[MIB; 4], &p, 4);
    let primaries: BTreeSet<u32> = p.iter().flatten().map(|s| s.replicas[0]).collect();
    assert_eq!(primaries.len(), 2, "primaries stay within the width");
}

#[test]
fn errors_are_explicit() {
    let g = groups();
    let e = plan(&g, &[], &PlanOptions::default()).unwrap_err();
    assert_eq!(e, PlanError::NoAliveServers);
    let mut dead = servers(2);
    dead.iter_mut().for_each(|s| s.alive = false);
    assert_eq!(
        plan(&g, &dead, &PlanOptions::default()).unwrap_err(),
        PlanError::NoAliveServers
    );
    assert_eq!(
        plan(&g, &servers(3), &opts(Strategy::Hybrid, 0, 0)).unwrap_err(),
        PlanError::ZeroReplication
    );
    let e = plan(&g, &servers(3), &opts(Strategy::Hybrid, 0, 4)).unwrap_err();
    assert_eq!(
        e,
        PlanError::ReplicationTooHigh {
            replication: 4,
            alive: 3
        }
    );
    assert!(e.to_string().contains("only 3 are alive"));
    let e = plan(&g, &servers(3), &opts(Strategy::Vertical, 5, 1)).unwrap_err();
    assert_eq!(e, PlanError::WidthTooLarge { width: 5, alive: 3 });
    assert_eq!(
        plan(&[MIB, 0], &servers(3), &PlanOptions::default()).unwrap_err(),
        PlanError::EmptyGroup { group: 1 }
    );
    let s = vec![
        server(0, 10 * MIB, 0, true),
        server(1, 10 * MIB, 9 * MIB, true),
    ];
    let e = plan(&[8 * MIB], &s, &opts(Strategy::Hybrid, 0, 1)).unwrap_err();
    assert_eq!(
        e,
        PlanError::Capacity {
            memserver: 1,
            addr: "127.0.0.1:7001".into(),
            needed_bytes: 4 * MIB,
            free_bytes: MIB
        }
    );
    assert!(
        e.to_string().contains("4194304 bytes but has 1048576 free"),
        "{e}"
    );
    assert!(plan(&[], &servers(1), &PlanOptions::default())
        .unwrap()
        .is_empty());
}
