//! The sync-group service on a virtual clock: groups reach the right
//! askers, deadlines close groups, a stop releases every waiter, a removed
//! pipeline unblocks a graph sync, generations and refusals.

use super::*;
use distmind_common::train_spec::{Adpsgd, Allreduce, Preduce};

const MS: Duration = Duration::from_millis(1);

/// A test's reply slot: who asked, and whether it went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    pipeline: u32,
    stage: u32,
    gone: bool,
}

impl Waiter for Slot {
    fn is_gone(&self) -> bool {
        self.gone
    }
}

fn slot(pipeline: u32, stage: u32) -> Slot {
    Slot {
        pipeline,
        stage,
        gone: false,
    }
}

fn ask(job: &str, pipeline: u32, stage: u32, iteration: u64) -> Ask<'_> {
    Ask {
        job,
        generation: 0,
        pipeline,
        stage,
        iteration,
    }
}

/// (asker's pipeline, stage, members, stop) of each delivery, the answer
/// checked against the slot it went to.
fn got(d: Vec<Delivery<Slot>>) -> Vec<(u32, u32, Vec<u32>, bool)> {
    let mut v: Vec<_> = d
        .into_iter()
        .map(|d| {
            assert_eq!(d.to.stage, d.answer.stage, "{d:?}");
            assert!(
                d.answer.stop || d.answer.members.contains(&d.to.pipeline),
                "{d:?}"
            );
            (
                d.to.pipeline,
                d.answer.stage,
                d.answer.members,
                d.answer.stop,
            )
        })
        .collect();
    v.sort();
    v
}

/// `GroupService::ask`, its deliveries returned (`ask1`: the inherent
/// method's name is taken).
trait AskOnce {
    fn ask1(
        &mut self,
        a: Ask<'_>,
        to: Slot,
        now: Duration,
    ) -> Result<Vec<Delivery<Slot>>, AskError>;
}

impl AskOnce for GroupService<Slot> {
    fn ask1(
        &mut self,
        a: Ask<'_>,
        to: Slot,
        now: Duration,
    ) -> Result<Vec<Delivery<Slot>>, AskError> {
        let mut out = Vec::new();
        GroupService::ask(self, a, to, now, &mut out).map(|()| out)
    }
}

fn service(pipelines: u32, stages: u32, sync: SyncMode) -> GroupService<Slot> {
    let mut s = GroupService::new();
    let scheme = SyncScheme::from_spec(&sync, pipelines).unwrap();
    assert!(s.open("j-1", 0, pipelines, stages, scheme).is_empty());
    s
}

fn preduce(wait_ms: u64, ssp_bound: Option<u32>) -> SyncMode {
    SyncMode::Preduce(Preduce {
        wait_ms_initial: Some(wait_ms),
        ssp_bound,
    })
}

#[test]
fn an_allreduce_group_reaches_every_asker_of_its_stage_only() {
    let mut s = service(3, 2, SyncMode::Allreduce(Allreduce {}));
    assert!(s
        .ask1(ask("j-1", 0, 0, 1), slot(0, 0), MS)
        .unwrap()
        .is_empty());
    assert!(s
        .ask1(ask("j-1", 2, 0, 1), slot(2, 0), MS)
        .unwrap()
        .is_empty());
    // Another stage is another group.
    assert!(s
        .ask1(ask("j-1", 1, 1, 1), slot(1, 1), MS)
        .unwrap()
        .is_empty());
    assert_eq!(s.waiting("j-1"), 3);
    assert_eq!(s.next_deadline(), None, "allreduce has no deadline");
    let d = s.ask1(ask("j-1", 1, 0, 1), slot(1, 0), 2 * MS).unwrap();
    let all = vec![0, 1, 2];
    assert_eq!(
        got(d),
        vec![
            (0, 0, all.clone(), false),
            (1, 0, all.clone(), false),
            (2, 0, all.clone(), false)
        ]
    );
    assert_eq!(s.waiting("j-1"), 1, "stage 1's ask still waits");
}

#[test]
fn each_answer_carries_its_askers_iteration() {
    let mut s = service(2, 1, SyncMode::Allreduce(Allreduce {}));
    s.ask1(ask("j-1", 0, 0, 7), slot(0, 0), MS).unwrap();
    let d = s.ask1(ask("j-1", 1, 0, 6), slot(1, 0), MS).unwrap();
    let mut its: Vec<(u32, u64)> = d
        .iter()
        .map(|d| (d.to.pipeline, d.answer.iteration))
        .collect();
    its.sort();
    assert_eq!(its, vec![(0, 7), (1, 6)]);
    assert!(d.iter().all(|d| d.answer.job == "j-1"));
}

#[test]
fn a_deadline_closes_a_partial_group_without_the_straggler() {
    let mut s = service(3, 1, preduce(5, None));
    assert!(s
        .ask1(ask("j-1", 0, 0, 1), slot(0, 0), Duration::ZERO)
        .unwrap()
        .is_empty());
    assert!(s
        .ask1(ask("j-1", 1, 0, 1), slot(1, 0), MS)
        .unwrap()
        .is_empty());
    assert_eq!(s.next_deadline(), Some(5 * MS), "the opener's wait");
    assert!(s.poll(4 * MS).is_empty(), "not yet");
    assert_eq!(
        got(s.poll(5 * MS)),
        vec![(0, 0, vec![0, 1], false), (1, 0, vec![0, 1], false)]
    );
    assert_eq!(s.next_deadline(), None);
    // The straggler comes late: it opens a group of its own.
    assert!(s
        .ask1(ask("j-1", 2, 0, 1), slot(2, 0), 6 * MS)
        .unwrap()
        .is_empty());
    assert_eq!(s.next_deadline(), Some(11 * MS));
    // A late poll closes the group all the same.
    assert_eq!(got(s.poll(50 * MS)), vec![(2, 0, vec![2], false)]);
}

#[test]
fn an_ask_after_a_passed_deadline_first_releases_that_group() {
    let mut s = service(2, 1, preduce(5, None));
    s.ask1(ask("j-1", 0, 0, 1), slot(0, 0), Duration::ZERO)
        .unwrap();
    // Nobody polled at 5 ms; pipeline 1 comes at 9 ms.
    let d = s.ask1(ask("j-1", 1, 0, 1), slot(1, 0), 9 * MS).unwrap();
    assert_eq!(got(d), vec![(0, 0, vec![0], false)]);
    assert_eq!(s.waiting("j-1"), 1, "pipeline 1 opened the next group");
}

#[test]
fn a_stop_answers_every_waiting_ask_with_stop() {
    let mut s = service(3, 2, SyncMode::Allreduce(Allreduce {}));
    s.ask1(ask("j-1", 0, 0, 4), slot(0, 0), MS).unwrap();
    s.ask1(ask("j-1", 2, 1, 4), slot(2, 1), MS).unwrap();
    let d = s.close("j-1");
    assert_eq!(got(d), vec![(0, 0, vec![], true), (2, 1, vec![], true)]);
    assert_eq!(s.waiting("j-1"), 0);
    assert_eq!(
        s.ask1(ask("j-1", 1, 0, 4), slot(1, 0), MS).unwrap_err(),
        AskError::NotOpen { job: "j-1".into() }
    );
    assert!(s.close("j-1").is_empty(), "closing twice is harmless");
}

#[test]
fn removing_a_pipeline_unblocks_a_graph_sync() {
    // ssp_bound 1 with 3 pipelines: a graph sync after every 3 updates.
    let mut s = service(3, 1, preduce(1, Some(1)));
    s.ask1(ask("j-1", 0, 0, 1), slot(0, 0), Duration::ZERO)
        .unwrap();
    s.ask1(ask("j-1", 1, 0, 1), slot(1, 0), MS / 2).unwrap();
    assert_eq!(
        got(s.poll(MS)),
        vec![(0, 0, vec![0, 1], false), (1, 0, vec![0, 1], false)]
    );
    s.ask1(ask("j-1", 2, 0, 1), slot(2, 0), 2 * MS).unwrap();
    assert_eq!(got(s.poll(10 * MS)), vec![(2, 0, vec![2], false)]);
    // Three updates: the next group is a graph sync, which waits with no
    // deadline until pipeline 2's set has a ready member.
    s.ask1(ask("j-1", 0, 0, 2), slot(0, 0), 20 * MS).unwrap();
    s.ask1(ask("j-1", 1, 0, 2), slot(1, 0), 21 * MS).unwrap();
    assert_eq!(s.next_deadline(), None, "a graph sync has no deadline");
    assert!(s.poll(10_000 * MS).is_empty(), "it waits for pipeline 2");
    // Pipeline 2's GPU server is lost: nothing waits for it any more.
    let d = s.remove("j-1", 2, 10_001 * MS);
    assert_eq!(
        got(d),
        vec![(0, 0, vec![0, 1], false), (1, 0, vec![0, 1], false)]
    );
    // Its later asks are answered stop; the others go on without it.
    let d = s
        .ask1(ask("j-1", 2, 0, 2), slot(2, 0), 10_002 * MS)
        .unwrap();
    assert_eq!(got(d), vec![(2, 0, vec![], true)]);
    s.ask1(ask("j-1", 0, 0, 3), slot(0, 0), 10_003 * MS)
        .unwrap();
    let d = s
        .ask1(ask("j-1", 1, 0, 3), slot(1, 0), 10_003 * MS)
        .unwrap();
    assert_eq!(got(d).len(), 2);
}

#[test]
fn removing_a_pipeline_answers_its_own_asks_stop_and_completes_allreduce() {
    let mut s = service(3, 2, SyncMode::Allreduce(Allreduce {}));
    s.ask1(ask("j-1", 0, 0, 1), slot(0, 0), MS).unwrap();
    s.ask1(ask("j-1", 1, 0, 1), slot(1, 0), MS).unwrap();
    s.ask1(ask("j-1", 2, 1, 1), slot(2, 1), MS).unwrap();
    let d = s.remove("j-1", 2, 2 * MS);
    assert_eq!(
        got(d),
        vec![
            (0, 0, vec![0, 1], false),
            (1, 0, vec![0, 1], false),
            (2, 1, vec![], true)
        ]
    );
    // A stage whose scheduler is made later starts without it too.
    s.ask1(ask("j-1", 0, 1, 1), slot(0, 1), 3 * MS).unwrap();
    let d = s.ask1(ask("j-1", 1, 1, 1), slot(1, 1), 3 * MS).unwrap();
    assert_eq!(
        got(d),
        vec![(0, 1, vec![0, 1], false), (1, 1, vec![0, 1], false)]
    );
    assert!(s.remove("j-1", 2, 4 * MS).is_empty(), "removing twice");
}

#[test]
fn one_ask_per_worker_unless_the_first_asker_went_away() {
    let mut s = service(2, 1, SyncMode::Allreduce(Allreduce {}));
    s.ask1(ask("j-1", 0, 0, 1), slot(0, 0), MS).unwrap();
    assert_eq!(
        s.ask1(ask("j-1", 0, 0, 1), slot(0, 0), MS).unwrap_err(),
        AskError::AlreadyWaiting {
            job: "j-1".into(),
            pipeline: 0,
            stage: 0,
            waiting: 1
        }
    );
    // Its connection closed; the worker asks again on a new one.
    let mut s = service(2, 1, SyncMode::Allreduce(Allreduce {}));
    let gone = Slot {
        gone: true,
        ..slot(0, 0)
    };
    s.ask1(ask("j-1", 0, 0, 1), gone, MS).unwrap();
    assert_eq!(s.waiting("j-1"), 0, "nobody listens");
    assert!(s
        .ask1(ask("j-1", 0, 0, 1), slot(0, 0), MS)
        .unwrap()
        .is_empty());
    let d = s.ask1(ask("j-1", 1, 0, 1), slot(1, 0), MS).unwrap();
    assert!(
        d.iter().all(|d| !d.to.gone),
        "the new asker got the answer: {d:?}"
    );
    assert_eq!(d.len(), 2);
}

#[test]
fn generations_and_bad_asks() {
    let mut s = service(2, 2, SyncMode::Allreduce(Allreduce {}));
    s.ask1(ask("j-1", 0, 1, 3), slot(0, 1), MS).unwrap();
    // A new generation (a re-partitioning) ends the old one's waits.
    let scheme = SyncScheme::AllReduce;
    let d = s.open("j-1", 1, 2, 2, scheme.clone());
    assert_eq!(got(d), vec![(0, 1, vec![], true)]);
    assert!(s.open("j-1", 1, 2, 2, scheme).is_empty(), "already open");
    // An ask of the old generation is told to stop at once.
    let d = s.ask1(ask("j-1", 1, 1, 3), slot(1, 1), MS).unwrap();
    assert_eq!(got(d), vec![(1, 1, vec![], true)]);
    let future = Ask {
        generation: 2,
        ..ask("j-1", 1, 1, 3)
    };
    assert!(matches!(
        s.ask1(future, slot(1, 1), MS),
        Err(AskError::FutureGeneration {
            asked: 2,
            current: 1,
            ..
        })
    ));
    let nowhere = Ask {
        generation: 1,
        ..ask("j-1", 2, 0, 3)
    };
    let e = s.ask1(nowhere, slot(2, 0), MS).unwrap_err();
    assert_eq!(
        e.to_string(),
        "job j-1 has pipelines 0..2 and stages 0..2: no pipeline 2 stage 0"
    );
    assert!(matches!(
        s.ask1(ask("x-9", 0, 0, 1), slot(0, 0), MS),
        Err(AskError::NotOpen { .. })
    ));
}

#[test]
fn adpsgd_pairs_by_its_seed_and_time_never_goes_back() {
    let mut s = service(2, 1, SyncMode::Adpsgd(Adpsgd { seed: 3 }));
    s.ask1(ask("j-1", 1, 0, 1), slot(1, 0), 5 * MS).unwrap();
    // An earlier time than the last one counts as the last one.
    let d = s.ask1(ask("j-1", 0, 0, 1), slot(0, 0), MS).unwrap();
    assert_eq!(
        got(d),
        vec![(0, 0, vec![0, 1], false), (1, 0, vec![0, 1], false)]
    );
}

#[test]
fn the_spec_maps_onto_the_schedulers() {
    let p = |wait, ssp| match SyncScheme::from_spec(&preduce(wait, ssp), 4).unwrap() {
        SyncScheme::PartialReduce(cfg) => cfg,
        s => panic!("{s:?}"),
    };
    let cfg = p(50, Some(0));
    assert_eq!((cfg.wait_initial, cfg.wait_max), (50 * MS, 50 * MS));
    assert_eq!(cfg.ssp_bound, 1, "a bound of 0 is a graph sync every round");
    let cfg = p(0, None);
    assert_eq!(cfg.wait_initial, cfg.wait_min, "0 ms is the shortest wait");
    assert_eq!(cfg.ssp_bound, SSP_BOUND_DEFAULT, "SD-Pipe's default window");
    assert!(SyncScheme::from_spec(
        &SyncMode::Hetpipe(distmind_common::train_spec::Hetpipe::default()),
        4
    )
    .unwrap_err()
    .contains("parameter server"));
}
