//! A GPU server lost under load, with real processes on loopback: a
//! controller (dispatcher), a memory server, GPU servers on the `sim`
//! executor (profiled GPU time, tiny packages), and an open-loop Poisson
//! client written here so that every request's wait is timed, whatever
//! its outcome. One GPU server is killed (SIGKILL, by pid) or stopped
//! (SIGSTOP) mid-run.
//!
//! * Two GPU servers, one killed: nobody waits past their deadline for the
//!   dead one; every request is answered ok, rejected or failed with a
//!   named reason, and the counts add up.
//! * The only GPU server killed: the requests it would have served fail at
//!   once with `unavailable` naming it, rather than waiting out their SLO.
//! * One stopped (hung, its connections open): its requests are answered
//!   by their deadline and grace, not by its missed heartbeats; given up,
//!   it gets nothing; woken, it is linked again, serves, and its late
//!   replies answer nobody twice.

mod support;

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use distmind_common::metrics::{sample_value, scrape};
use distmind_common::proto::ErrorCode;
use distmind_controller::ControllerClient;
use distmind_runtime::client::{InferOptions, Response, RuntimeClient};
use rand::{Rng, SeedableRng};
use support::*;

/// How one request ended, and how long its client waited for it.
#[derive(Debug, Clone)]
struct Ended {
    /// `ok`, an error code's wire name, or `lost` (no reply at all).
    outcome: String,
    message: String,
    sent_at: Duration,
    waited: Duration,
    /// The GPU server that answered it (from the dispatch record).
    runtime: Option<u32>,
}

struct Cluster {
    procs: Vec<Proc>,
    runtimes: Vec<Proc>,
    metadata: String,
    client: String,
    metrics: String,
    _dir: tempfile::TempDir,
}

/// A copy of the shipped H200 profile with every layer `slower` times
/// slower, written to `dir`: a tiny model then keeps a simulated GPU busy
/// for milliseconds, so requests queue and run while a server is killed.
fn slowed_profile(dir: &std::path::Path, slower: f64) -> std::path::PathBuf {
    let shipped = settings_dir().join("profiles").join("h200-estimated.json");
    let mut p: serde_json::Value =
        serde_json::from_slice(&std::fs::read(shipped).unwrap()).unwrap();
    for m in p["models"].as_object_mut().unwrap().values_mut() {
        let mut total = 0.0;
        for l in m["layers"].as_array_mut().unwrap() {
            let t = l["time_s"].as_f64().unwrap() * slower;
            l["time_s"] = t.into();
            total += t;
        }
        m["total_s"] = total.into();
    }
    let method = format!(
        "{} For a test: every layer {slower}x slower.",
        p["method"].as_str().unwrap()
    );
    p["method"] = method.into();
    let out = dir.join("slowed-profile.json");
    std::fs::write(&out, serde_json::to_vec(&p).unwrap()).unwrap();
    out
}

/// A controller running `policy`, one memory server, 3 tiny ResNet-152
/// variants deployed, and `runtimes` single-device GPU servers on the sim
/// executor (GPU times `slower` times the H200 profile's), every one
/// linked to the dispatcher.
fn start(policy: &str, runtimes: usize, slower: f64, controller_args: &[&str]) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let pkgs = gen_tiny(dir.path(), "resnet152", 3, 65536);
    let (ctl, metadata, client, metrics) = spawn_dispatching_controller(policy, controller_args);
    let mut procs = vec![ctl];
    procs.push(spawn_memserver(&metadata, "64MiB"));
    wait_alive(&metadata, 1);
    let (ok, _, err) = deploy(&metadata, &[], &pkgs);
    assert!(ok, "deploy: {err}");
    let s = settings_dir();
    let profile = slowed_profile(dir.path(), slower);
    let mut rts = Vec::new();
    for _ in 0..runtimes {
        let rt = spawn_service(&[
            "runtime",
            "--settings",
            s.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--controller",
            &metadata,
            "--executor",
            "sim",
            "--profile",
            profile.to_str().unwrap(),
            "--devices",
            "0",
            "--cache",
            "64MiB",
        ]);
        wait_runtime_alive(&metadata, &rt.addr);
        rts.push(rt);
    }
    // The dispatcher links to a runtime within a tick of its registration.
    let t0 = Instant::now();
    loop {
        let (_, text) = scrape(&metrics, "/metrics", Duration::from_secs(5)).unwrap();
        let linked = sample_value(&text, "distmind_controller_runtimes_linked", &[]);
        if linked == Some(runtimes as f64) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{linked:?} of {runtimes} GPU servers linked after 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Cluster {
        procs,
        runtimes: rts,
        metadata,
        client,
        metrics,
        _dir: dir,
    }
}

/// The models in the catalog and an input for each.
fn models(c: &Cluster) -> Vec<(String, distmind_runtime::exec::HostTensor)> {
    let mut ctl =
        ControllerClient::connect(&c.metadata, &cluster_key(), Duration::from_secs(5)).unwrap();
    let names: Vec<String> = ctl
        .list_models()
        .unwrap()
        .into_iter()
        .map(|m| m.name)
        .collect();
    names
        .into_iter()
        .map(|name| {
            let entry = ctl.get_model(&name).unwrap();
            let manifest: distmind_models::Manifest =
                serde_json::from_value(entry.manifest).unwrap();
            let input = distmind::loadgen::input_for(&manifest, 1, 1).unwrap();
            (name, input)
        })
        .collect()
}

/// The GPU server (index into `c.runtimes`) that served the most of a
/// short warm-up (every model once, twice): the one whose loss hurts.
fn busiest(c: &Cluster, ms: &[(String, distmind_runtime::exec::HostTensor)]) -> usize {
    let mut rc =
        RuntimeClient::connect(&c.client, &cluster_key(), Duration::from_secs(10)).unwrap();
    let mut served: BTreeMap<u32, u32> = BTreeMap::new();
    for (model, input) in ms.iter().chain(ms) {
        let opts = InferOptions {
            deadline_ms: Some(10_000),
            ..Default::default()
        };
        let r = rc.infer_with(model, input, opts).expect("warm-up request");
        *served
            .entry(r.dispatch.expect("a dispatch record").runtime)
            .or_default() += 1;
    }
    let (&id, _) = served.iter().max_by_key(|(_, n)| **n).unwrap();
    let mut ctl =
        ControllerClient::connect(&c.metadata, &cluster_key(), Duration::from_secs(5)).unwrap();
    let addr = ctl
        .list_runtimes()
        .unwrap()
        .into_iter()
        .find(|r| r.id == id)
        .expect("registered")
        .addr;
    c.runtimes.iter().position(|p| p.addr == addr).unwrap()
}

/// An open-loop Poisson client on one connection to the dispatcher at
/// `client`: `rate` req/s for `duration`, every request with deadline
/// `slo_ms`, models drawn uniformly from `ms`; `at_kill` runs once,
/// `kill_after` into the run. Returns every request's end, and when the
/// kill happened.
fn poisson(
    client: &str,
    ms: &[(String, distmind_runtime::exec::HostTensor)],
    load: Load,
    at_kill: impl FnOnce(),
) -> (Vec<Ended>, Duration) {
    let conn = RuntimeClient::connect(client, &cluster_key(), Duration::from_secs(10)).unwrap();
    let (mut tx, mut rx) = conn.split();
    let (sent_tx, sent_rx) = mpsc::channel::<(u64, Duration)>();
    let start = Instant::now();
    // The receiver learns of each send over the channel; a reply may come
    // before its note, so it reads notes until it knows the id.
    let receiver = std::thread::spawn(move || {
        let mut pending: BTreeMap<u64, Duration> = BTreeMap::new();
        let mut ended = Vec::new();
        loop {
            if pending.is_empty() {
                match sent_rx.recv() {
                    Ok((id, at)) => {
                        pending.insert(id, at);
                    }
                    Err(_) => return ended, // the sender is done, all answered
                }
            }
            let got = rx.recv();
            let now = start.elapsed();
            let resp = match got {
                Ok(r) => r,
                Err(e) => {
                    // Everything outstanding is lost (the test fails on it).
                    while let Ok((id, at)) = sent_rx.try_recv() {
                        pending.insert(id, at);
                    }
                    for (_, at) in std::mem::take(&mut pending) {
                        ended.push(Ended {
                            outcome: "lost".into(),
                            message: e.to_string(),
                            sent_at: at,
                            waited: now.saturating_sub(at),
                            runtime: None,
                        });
                    }
                    return ended;
                }
            };
            let id = resp.id();
            while !pending.contains_key(&id) {
                let (i, at) = sent_rx.recv().unwrap_or_else(|_| {
                    panic!("a reply to request {id}, which was never sent or was answered already")
                });
                pending.insert(i, at);
            }
            let at = pending.remove(&id).expect("looked up");
            let (outcome, message, runtime) = match resp {
                Response::Output(i) => (
                    "ok".to_string(),
                    String::new(),
                    i.dispatch.map(|d| d.runtime),
                ),
                Response::Error { error, .. } => {
                    (error.code.as_str().to_string(), error.message, None)
                }
                other => ("unexpected_reply".to_string(), format!("{other:?}"), None),
            };
            ended.push(Ended {
                outcome,
                message,
                sent_at: at,
                waited: now.saturating_sub(at),
                runtime,
            });
        }
    });
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut due = Duration::ZERO;
    let mut at_kill = Some(at_kill);
    let mut killed_at = load.duration;
    loop {
        // Exponential gaps: a Poisson process at the rate.
        let gap = -(1.0 - rng.gen::<f64>()).ln() / load.rate;
        due += Duration::from_secs_f64(gap);
        if due >= load.duration {
            break;
        }
        if due >= load.kill_after {
            if let Some(kill) = at_kill.take() {
                sleep_until(start, load.kill_after);
                kill();
                killed_at = start.elapsed();
            }
        }
        sleep_until(start, due);
        let (model, input) = &ms[rng.gen_range(0..ms.len())];
        let opts = InferOptions {
            deadline_ms: Some(load.slo_ms),
            ..Default::default()
        };
        let sent_at = start.elapsed();
        let id = tx
            .send_infer(model, input, opts)
            .expect("the dispatcher takes requests");
        sent_tx.send((id, sent_at)).unwrap();
    }
    drop(sent_tx);
    (receiver.join().expect("receiver thread"), killed_at)
}

fn sleep_until(start: Instant, at: Duration) {
    if let Some(d) = at.checked_sub(start.elapsed()) {
        std::thread::sleep(d);
    }
}

#[derive(Debug, Clone, Copy)]
struct Load {
    rate: f64,
    duration: Duration,
    slo_ms: u64,
    kill_after: Duration,
}

/// Counts per outcome, and the longest wait per outcome.
fn summary(ended: &[Ended]) -> BTreeMap<String, (u64, Duration)> {
    let mut s: BTreeMap<String, (u64, Duration)> = BTreeMap::new();
    for e in ended {
        let v = s.entry(e.outcome.clone()).or_default();
        v.0 += 1;
        v.1 = v.1.max(e.waited);
    }
    s
}

/// Per outcome: count, median and longest wait, and one message.
fn print_summary(what: &str, ended: &[Ended]) {
    eprintln!("{what}: {} requests", ended.len());
    for (k, (n, max)) in summary(ended) {
        let mut waits: Vec<f64> = ended
            .iter()
            .filter(|e| e.outcome == k)
            .map(|e| e.waited.as_secs_f64() * 1e3)
            .collect();
        waits.sort_by(f64::total_cmp);
        let p50 = waits[waits.len() / 2];
        let example = ended
            .iter()
            .find(|e| e.outcome == k)
            .map_or("", |e| e.message.as_str());
        eprintln!(
            "  {k:>17}: {n:>5}  wait p50 {p50:>7.1} ms  max {:>7.1} ms  {example}",
            max.as_secs_f64() * 1e3
        );
    }
}

/// Every request sent was answered with a known outcome (ok, rejected, or
/// a named failure) and none waited past its deadline plus `margin`.
fn assert_accounted(ended: &[Ended], sent: usize, slo_ms: u64, margin: Duration) {
    assert_eq!(ended.len(), sent, "one end per request sent");
    let s = summary(ended);
    let named = [
        "ok",
        ErrorCode::Rejected.as_str(),
        ErrorCode::Unavailable.as_str(),
        ErrorCode::DeadlineExceeded.as_str(),
        ErrorCode::Busy.as_str(),
    ];
    let counted: u64 = named.iter().map(|k| s.get(*k).map_or(0, |v| v.0)).sum();
    assert_eq!(
        counted as usize, sent,
        "every request ends ok, rejected or failed with a named reason: {s:?}"
    );
    let limit = Duration::from_millis(slo_ms) + margin;
    for e in ended {
        assert!(
            e.waited <= limit,
            "a request sent {:?} into the run waited {:?}, past its {slo_ms} ms deadline: {} {}",
            e.sent_at,
            e.waited,
            e.outcome,
            e.message
        );
    }
}

/// The dispatcher's id of the GPU server listening at `addr`.
fn runtime_id(c: &Cluster, addr: &str) -> u32 {
    let mut ctl =
        ControllerClient::connect(&c.metadata, &cluster_key(), Duration::from_secs(5)).unwrap();
    ctl.list_runtimes()
        .unwrap()
        .into_iter()
        .find(|r| r.addr == addr)
        .map(|r| r.id)
        .expect("registered")
}

/// Requests the dispatcher sent again after their GPU server was lost.
fn retried(c: &Cluster) -> f64 {
    let (_, text) = scrape(&c.metrics, "/metrics", Duration::from_secs(5)).unwrap();
    sample_value(&text, "distmind_controller_retried", &[]).expect("the retried gauge")
}

/// Two GPU servers under `slo` (about 8 ms per request), the models and
/// their inputs, and the id and pid of the server that served the most of
/// a warm-up: the one whose loss hurts.
fn slo_pair_and_victim() -> (
    Cluster,
    Vec<(String, distmind_runtime::exec::HostTensor)>,
    u32,
    u32,
) {
    let c = start("slo", 2, 30.0, &[]);
    let ms = models(&c);
    let victim = busiest(&c, &ms);
    let victim_id = runtime_id(&c, &c.runtimes[victim].addr);
    let pid = c.runtimes[victim].pid();
    (c, ms, victim_id, pid)
}

/// Sends `sig` (`-STOP`, `-CONT`) to the process `pid`, one this test
/// started.
fn signal(sig: &str, pid: u32) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// Runs the load on `c`, killing `c.runtimes[victim]` (SIGKILL) on time.
fn run_with_kill(
    c: &mut Cluster,
    ms: &[(String, distmind_runtime::exec::HostTensor)],
    victim: usize,
    load: Load,
) -> (Vec<Ended>, Duration) {
    let Cluster {
        client, runtimes, ..
    } = c;
    let dead = &mut runtimes[victim];
    poisson(client, ms, load, || dead.kill())
}

#[test]
fn one_of_two_gpu_servers_killed_under_load_costs_nobody_their_slo() {
    for policy in ["slo", "distmind"] {
        // distmind: both GPUs serve (none trains).
        let extra: &[&str] = if policy == "distmind" {
            &["--inference-workload", "2"]
        } else {
            &[]
        };
        // About 8 ms per request: at 100 req/s the two GPU servers are
        // each about 40% busy, so some requests are queued or running on
        // the one killed.
        let mut c = start(policy, 2, 30.0, extra);
        let ms = models(&c);
        let victim = busiest(&c, &ms);
        let victim_id = runtime_id(&c, &c.runtimes[victim].addr);
        let load = Load {
            rate: 100.0,
            duration: Duration::from_secs(4),
            slo_ms: 200,
            kill_after: Duration::from_millis(1500),
        };
        let (ended, killed_at) = run_with_kill(&mut c, &ms, victim, load);
        print_summary(
            &format!(
                "{policy}: runtime {victim_id} killed at {killed_at:?}, {} request(s) in flight \
                 there sent again",
                retried(&c)
            ),
            &ended,
        );
        let sent = ended.len();
        assert!(
            sent > 200,
            "{policy}: {sent} requests in {:?}",
            load.duration
        );
        // Nobody waited past their deadline (plus a generous margin for a
        // loaded test machine) for the dead one, or for anything.
        assert_accounted(&ended, sent, load.slo_ms, Duration::from_secs(1));
        // Lost requests were sent again or failed `unavailable` naming the
        // runtime that was lost; never `internal`.
        for e in ended.iter().filter(|e| e.outcome == "unavailable") {
            assert!(
                e.message.contains(&format!("runtime {victim_id}")),
                "{policy}: {}",
                e.message
            );
        }
        // The survivor served what came after.
        let after: Vec<&Ended> = ended.iter().filter(|e| e.sent_at > killed_at).collect();
        assert!(after.iter().all(|e| e.runtime != Some(victim_id)));
        let ok_after = after.iter().filter(|e| e.outcome == "ok").count();
        assert!(
            ok_after * 2 > after.len(),
            "{policy}: {ok_after} of {} served after the kill",
            after.len()
        );
        for p in &mut c.procs {
            p.kill();
        }
    }
}

#[test]
fn the_only_gpu_server_killed_fails_its_requests_at_once_as_unavailable() {
    // The distmind policy holds requests until a GPU has room: with its
    // only GPU server gone, they must not wait out their SLO for it.
    let mut c = start("distmind", 1, 1.0, &[]);
    let ms = models(&c);
    let victim_id = runtime_id(&c, &c.runtimes[0].addr);
    let load = Load {
        rate: 100.0,
        duration: Duration::from_secs(4),
        slo_ms: 1000,
        kill_after: Duration::from_millis(1000),
    };
    let (ended, killed_at) = run_with_kill(&mut c, &ms, 0, load);
    print_summary(
        &format!("distmind, its one runtime {victim_id} killed at {killed_at:?}"),
        &ended,
    );
    let sent = ended.len();
    assert_accounted(&ended, sent, load.slo_ms, Duration::from_secs(1));
    let after: Vec<&Ended> = ended.iter().filter(|e| e.sent_at > killed_at).collect();
    assert!(after.len() > 100, "{} requests after the kill", after.len());
    for e in &after {
        assert_eq!(e.outcome, "unavailable", "sent after the kill: {e:?}");
        assert!(
            e.message.contains(&format!("runtime {victim_id} was lost")),
            "{}",
            e.message
        );
    }
    // Failing at once is the point: after the kill, requests end well
    // within their SLO (measured against the SLO, not an absolute time).
    let slowest = after.iter().map(|e| e.waited).max().unwrap();
    assert!(
        slowest < Duration::from_millis(load.slo_ms) / 2,
        "a request waited {slowest:?} for a GPU server that is gone"
    );
    for p in &mut c.procs {
        p.kill();
    }
}

#[test]
fn a_gpu_server_that_hangs_silently_is_given_up_within_its_heartbeat_timeout() {
    // SIGSTOP: the process keeps its connections open and answers
    // nothing, as a host that lost power or its network would. Only the
    // missed heartbeats tell: 3 intervals of the controller's 1 s default.
    let dead_after = Duration::from_secs(3);
    let (mut c, ms, victim_id, pid) = slo_pair_and_victim();
    let load = Load {
        rate: 100.0,
        duration: Duration::from_secs(6),
        slo_ms: 200,
        kill_after: Duration::from_millis(1000),
    };
    let (ended, stopped_at) = {
        let Cluster { client, .. } = &c;
        poisson(client, &ms, load, || signal("-STOP", pid))
    };
    print_summary(
        &format!(
            "slo: runtime {victim_id} stopped at {stopped_at:?}, {} request(s) in flight there sent again",
            retried(&c)
        ),
        &ended,
    );
    let sent = ended.len();
    // Bounded by the deadline, not by the heartbeat timeout (3 s): a
    // request the hung server holds is given up past its deadline by its
    // grace (its SLO here), one queued for it at its deadline; plus a
    // generous margin for a loaded test machine.
    assert_accounted(
        &ended,
        sent,
        load.slo_ms,
        Duration::from_millis(load.slo_ms) + Duration::from_secs(1),
    );
    for e in ended.iter().filter(|e| e.outcome == "unavailable") {
        assert!(
            e.message.contains(&format!("runtime {victim_id} ")),
            "{}",
            e.message
        );
    }
    // Before its heartbeats are missed, the first request it leaves
    // unanswered past its deadline and grace silences it: from a second
    // after the stop, the other serves what comes. (Routed to the hung
    // server until its heartbeats are missed, 89% of these were served.)
    let silent: Vec<&Ended> = ended
        .iter()
        .filter(|e| e.sent_at > stopped_at + Duration::from_secs(1))
        .filter(|e| e.sent_at < stopped_at + dead_after)
        .collect();
    let ok_silent = silent.iter().filter(|e| e.outcome == "ok").count();
    eprintln!(
        "{ok_silent} of {} served while runtime {victim_id} was silent, not yet given up",
        silent.len()
    );
    assert!(
        ok_silent * 100 >= silent.len() * 97,
        "{ok_silent} of {} served while runtime {victim_id} was silent, not yet given up",
        silent.len()
    );
    // Once given up, the hung server gets nothing and the other serves.
    let given_up = stopped_at + dead_after + Duration::from_secs(1);
    let after: Vec<&Ended> = ended.iter().filter(|e| e.sent_at > given_up).collect();
    assert!(!after.is_empty());
    assert!(after.iter().all(|e| e.runtime != Some(victim_id)));
    let ok_after = after.iter().filter(|e| e.outcome == "ok").count();
    assert!(
        ok_after * 2 > after.len(),
        "{ok_after} of {} served once the hung server was given up",
        after.len()
    );
    for p in c.procs.iter_mut().chain(&mut c.runtimes) {
        p.kill();
    }
}

#[test]
fn a_hung_gpu_server_that_wakes_is_linked_again_and_answers_nobody_twice() {
    // SIGSTOP, given up after its missed heartbeats, then SIGCONT: the
    // process wakes with the requests it held and replies to them on a
    // connection the dispatcher has dropped. Those requests were already
    // sent again or failed; each is answered once. The server heartbeats
    // again and, with the same boot id, is linked again and serves.
    let dead_after = Duration::from_secs(3);
    let (mut c, ms, victim_id, pid) = slo_pair_and_victim();
    let load = Load {
        rate: 100.0,
        duration: Duration::from_secs(9),
        slo_ms: 200,
        kill_after: Duration::from_millis(1000),
    };
    // Woken once given up (its heartbeat timeout and a tick past it).
    let asleep = dead_after + Duration::from_millis(1500);
    let mut waker = None;
    let (ended, stopped_at) = {
        let Cluster { client, .. } = &c;
        poisson(client, &ms, load, || {
            signal("-STOP", pid);
            waker = Some(std::thread::spawn(move || {
                std::thread::sleep(asleep);
                signal("-CONT", pid);
            }));
        })
    };
    waker.expect("stopped").join().expect("woken");
    let woken_at = stopped_at + asleep;
    print_summary(
        &format!(
            "slo: runtime {victim_id} stopped at {stopped_at:?}, woken at {woken_at:?}, \
             {} request(s) in flight there sent again",
            retried(&c)
        ),
        &ended,
    );
    // One end per request (a second answer to one would fail the client
    // thread), each ok, rejected or failed with a named reason.
    let sent = ended.len();
    assert_accounted(
        &ended,
        sent,
        load.slo_ms,
        Duration::from_millis(load.slo_ms) + Duration::from_secs(1),
    );
    // Woken and linked again, it serves: within the last seconds of the
    // run, some requests are answered by it.
    let back = woken_at + Duration::from_secs(2);
    let served_after: Vec<&Ended> = ended
        .iter()
        .filter(|e| e.sent_at > back && e.outcome == "ok")
        .collect();
    let by_victim = served_after
        .iter()
        .filter(|e| e.runtime == Some(victim_id))
        .count();
    assert!(
        by_victim > 0,
        "none of the {} requests served after {back:?} ran on runtime {victim_id}, woken at \
         {woken_at:?}",
        served_after.len()
    );
    for p in c.procs.iter_mut().chain(&mut c.runtimes) {
        p.kill();
    }
}
