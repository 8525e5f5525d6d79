//! The sending loops: closed (one request at a time per connection) and
//! open (requests sent at scheduled instants, replies read by a second
//! thread per connection, a bound on outstanding requests).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use distmind_common::handshake::ClusterKey;
use distmind_runtime::client::{
    InferOptions, Response, RuntimeClient, RuntimeReceiver, RuntimeSender,
};
use distmind_runtime::exec::HostTensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::stats::{Collector, Outcome};
use distmind_controller::policy::zipf::Zipf;

/// Most requests outstanding at once in open-loop modes; a request due
/// while this many wait is not sent and counted as `dropped_by_client`.
pub const OUTSTANDING_MAX: usize = 4096;

/// Longest sleep between checks of the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// What every loop shares.
pub struct Common<'a> {
    pub addr: &'a str,
    pub key: &'a ClusterKey,
    /// Reply timeout (also the connect timeout).
    pub timeout: Duration,
    /// Inputs, indexed like the model list.
    pub inputs: &'a [Arc<HostTensor>],
    pub models: &'a [String],
    pub stop: &'a AtomicBool,
    /// Latencies stored over all collectors (memory bound).
    pub stored: &'a AtomicUsize,
}

/// Draws model indices: rank k of Zipf(s) is the k-th model of the list.
pub struct ModelDraw {
    zipf: Zipf,
}

impl ModelDraw {
    pub fn new(models: usize, s: f64) -> anyhow::Result<ModelDraw> {
        Ok(ModelDraw {
            zipf: Zipf::new(models, s)?,
        })
    }

    pub fn pick(&self, rng: &mut impl Rng) -> usize {
        self.zipf.sample(rng)
    }
}

/// A seeded generator per thread: runs with the same seed draw the same
/// models and arrival times.
pub fn thread_rng(seed: u64, thread: usize) -> StdRng {
    StdRng::seed_from_u64(seed ^ (thread as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Sleeps until `at`, waking to check `stop`; false when stopped.
fn wait_until(at: Instant, stop: &AtomicBool) -> bool {
    loop {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        let now = Instant::now();
        if now >= at {
            return true;
        }
        std::thread::sleep((at - now).min(STOP_POLL));
    }
}

fn outcome_of(resp: Response, slo_ms: Option<f64>, sent_at: Instant) -> Outcome {
    match resp {
        Response::Output(inf) => Outcome::Ok {
            latency_ms: ms_since(sent_at),
            slo_ms: inf.dispatch.as_ref().map(|d| d.slo_ms).or(slo_ms),
            simulated: inf.timing.simulated,
            path: Some(inf.timing.path),
        },
        Response::Error { error, .. } => Outcome::Refused {
            code: error.code,
            message: error.message,
        },
        other => Outcome::Unexpected {
            what: format!("{other:?}"),
        },
    }
}

// ---------------------------------------------------------------------------
// Closed loop
// ---------------------------------------------------------------------------

/// One thread per client: send, wait for the reply, repeat, until
/// `requests` (0: no limit) or `duration` or the stop flag.
pub fn closed(
    c: &Common<'_>,
    clients: Vec<RuntimeClient>,
    requests: u64,
    duration: Duration,
    slo_ms: Option<u64>,
    draw: &ModelDraw,
    seed: u64,
) -> Vec<Collector> {
    let start = Instant::now();
    let end = start + duration;
    std::thread::scope(|scope| {
        let handles: Vec<_> = clients
            .into_iter()
            .enumerate()
            .map(|(t, client)| {
                scope.spawn(move || {
                    closed_thread(c, client, requests, end, slo_ms, draw, thread_rng(seed, t))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("load generator thread panicked"))
            .collect()
    })
}

fn closed_thread(
    c: &Common<'_>,
    mut client: RuntimeClient,
    requests: u64,
    end: Instant,
    slo_ms: Option<u64>,
    draw: &ModelDraw,
    mut rng: StdRng,
) -> Collector {
    let mut col = Collector::new(c.models.len());
    let opts = InferOptions {
        deadline_ms: slo_ms,
        ..Default::default()
    };
    let mut attempted = 0u64;
    while (requests == 0 || attempted < requests)
        && Instant::now() < end
        && !c.stop.load(Ordering::Relaxed)
    {
        attempted += 1;
        let m = draw.pick(&mut rng);
        let sent_at = Instant::now();
        let failure = match client.send_infer(&c.models[m], &c.inputs[m], opts) {
            Err(e) => {
                col.send_failed += 1;
                col.error_examples
                    .entry("send_failed".into())
                    .or_insert(e.to_string());
                e
            }
            Ok(id) => {
                col.sent(m);
                match client.recv() {
                    Ok(resp) if resp.id() == id || resp.id() == 0 => {
                        let outcome = outcome_of(resp, slo_ms.map(|s| s as f64), sent_at);
                        col.record(m, outcome, c.stored);
                        continue;
                    }
                    Ok(resp) => {
                        let what = format!("reply {} to request {id}", resp.id());
                        col.record(m, Outcome::Unexpected { what }, c.stored);
                        continue;
                    }
                    Err(e) => {
                        col.record(m, Outcome::Lost { why: e.to_string() }, c.stored);
                        e
                    }
                }
            }
        };
        // The connection is unusable after an IO or framing error: connect again.
        log::warn!(
            "load generator: connection to {} failed ({failure}); reconnecting",
            c.addr
        );
        match RuntimeClient::connect(c.addr, c.key, c.timeout) {
            Ok(fresh) => client = fresh,
            Err(e) => {
                log::warn!("load generator: cannot reconnect to {}: {e}", c.addr);
                col.error_examples
                    .entry("reconnect".into())
                    .or_insert(e.to_string());
                break;
            }
        }
    }
    col
}

// ---------------------------------------------------------------------------
// Open loop
// ---------------------------------------------------------------------------

/// One request due at `at_s` seconds after the start.
#[derive(Debug, Clone, Copy)]
pub struct Due {
    pub at_s: f64,
    pub model: usize,
    pub slo_ms: Option<u64>,
}

/// Where a connection's requests come from. The client and the simulator
/// (`distmind simulate`) draw from the same generators, so a simulation
/// with the client's seed sees the client's requests.
pub enum Arrivals {
    /// Exponential gaps at `rate` per second, models drawn from `draw`,
    /// until `duration_s`.
    Poisson {
        rate: f64,
        duration_s: f64,
        draw: Arc<ModelDraw>,
        slo_ms: Option<u64>,
        rng: Box<StdRng>,
        /// Seconds after the start of the last arrival.
        clock_s: f64,
    },
    /// Fixed requests, in time order.
    Fixed(std::vec::IntoIter<Due>),
}

impl Arrivals {
    pub fn poisson(
        rate: f64,
        duration_s: f64,
        draw: Arc<ModelDraw>,
        slo_ms: Option<u64>,
        rng: StdRng,
    ) -> Self {
        Arrivals::Poisson {
            rate,
            duration_s,
            draw,
            slo_ms,
            rng: Box::new(rng),
            clock_s: 0.0,
        }
    }
}

impl Iterator for Arrivals {
    type Item = Due;
    fn next(&mut self) -> Option<Due> {
        match self {
            Arrivals::Poisson {
                rate,
                duration_s,
                draw,
                slo_ms,
                rng,
                clock_s,
            } => {
                // Inverse transform: -ln(U) / rate with U in (0, 1].
                let u: f64 = 1.0 - rng.gen::<f64>();
                *clock_s += -u.ln() / *rate;
                (*clock_s < *duration_s).then(|| Due {
                    at_s: *clock_s,
                    model: draw.pick(&mut **rng),
                    slo_ms: *slo_ms,
                })
            }
            Arrivals::Fixed(it) => it.next(),
        }
    }
}

/// A trace's requests spread over `connections` in turn, up to `limit_s`
/// (trace time), each at its time x `k` (an emulated link's dilation) with
/// its own SLO x `k`, or `slo_ms` (already dilated). `models` is the sorted
/// list the trace's names index into.
pub fn trace_arrivals(
    rows: &[super::TraceRow],
    models: &[String],
    connections: usize,
    limit_s: Option<f64>,
    k: f64,
    slo_ms: Option<u64>,
) -> Vec<Vec<Due>> {
    let n = connections.max(1);
    let mut per_conn: Vec<Vec<Due>> = vec![Vec::new(); n];
    for (i, r) in rows
        .iter()
        .filter(|r| limit_s.is_none_or(|l| r.time_s < l))
        .enumerate()
    {
        per_conn[i % n].push(Due {
            at_s: r.time_s * k,
            model: models
                .binary_search(&r.model)
                .expect("the model list holds every name of the trace"),
            slo_ms: r.slo_ms.map(|s| (s * k).ceil() as u64).or(slo_ms),
        });
    }
    per_conn
}

/// Bookkeeping of one connection, shared by its sender and receiver.
struct Conn {
    state: Mutex<ConnState>,
    changed: Condvar,
}

struct ConnState {
    /// Request id -> (model, sent at, SLO).
    pending: HashMap<u64, (usize, Instant, Option<f64>)>,
    sender_done: bool,
    /// The receiver saw the connection fail: later sends count as failed.
    broken: Option<String>,
}

/// Runs the open loop over `clients` (one sender and one receiver thread
/// each); `arrivals[i]` feeds client i.
pub fn open(
    c: &Common<'_>,
    clients: Vec<RuntimeClient>,
    arrivals: Vec<Arrivals>,
) -> Vec<Collector> {
    let outstanding = AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (client, arrivals) in clients.into_iter().zip(arrivals) {
            let conn = Arc::new(Conn {
                state: Mutex::new(ConnState {
                    pending: HashMap::new(),
                    sender_done: false,
                    broken: None,
                }),
                changed: Condvar::new(),
            });
            let (tx, rx) = client.split();
            let (conn2, outstanding) = (conn.clone(), &outstanding);
            handles.push(scope.spawn(move || sender(c, tx, conn, arrivals, start, outstanding)));
            handles.push(scope.spawn(move || receiver(c, rx, conn2, outstanding)));
        }
        handles
            .into_iter()
            .map(|h| h.join().expect("load generator thread panicked"))
            .collect()
    })
}

fn sender(
    c: &Common<'_>,
    mut tx: RuntimeSender,
    conn: Arc<Conn>,
    arrivals: Arrivals,
    start: Instant,
    outstanding: &AtomicUsize,
) -> Collector {
    let mut col = Collector::new(c.models.len());
    let mut next_id = 1u64;
    for due in arrivals {
        if !wait_until(start + Duration::from_secs_f64(due.at_s), c.stop) {
            break;
        }
        if outstanding.load(Ordering::Relaxed) >= OUTSTANDING_MAX {
            col.dropped_by_client += 1;
            continue;
        }
        let id = next_id;
        {
            let mut st = conn.state.lock().unwrap();
            if let Some(why) = &st.broken {
                col.send_failed += 1;
                col.error_examples
                    .entry("send_failed".into())
                    .or_insert_with(|| format!("the connection failed earlier: {why}"));
                continue;
            }
            let slo = due.slo_ms.map(|s| s as f64);
            st.pending.insert(id, (due.model, Instant::now(), slo));
        }
        next_id += 1;
        outstanding.fetch_add(1, Ordering::Relaxed);
        conn.changed.notify_all();
        let opts = InferOptions {
            deadline_ms: due.slo_ms,
            ..Default::default()
        };
        match tx.send_infer(&c.models[due.model], &c.inputs[due.model], opts) {
            Ok(got) => {
                debug_assert_eq!(got, id, "request ids are numbered from 1");
                col.sent(due.model);
            }
            Err(e) => {
                let mut st = conn.state.lock().unwrap();
                st.broken.get_or_insert_with(|| e.to_string());
                if st.pending.remove(&id).is_some() {
                    outstanding.fetch_sub(1, Ordering::Relaxed);
                    col.send_failed += 1;
                } else {
                    // The receiver saw the failure first and counted it lost.
                    col.sent(due.model);
                }
                drop(st);
                log::warn!("load generator: sending to {} failed: {e}", c.addr);
                col.error_examples
                    .entry("send_failed".into())
                    .or_insert(e.to_string());
            }
        }
    }
    conn.state.lock().unwrap().sender_done = true;
    conn.changed.notify_all();
    col
}

fn receiver(
    c: &Common<'_>,
    mut rx: RuntimeReceiver,
    conn: Arc<Conn>,
    outstanding: &AtomicUsize,
) -> Collector {
    let mut col = Collector::new(c.models.len());
    loop {
        {
            let mut st = conn.state.lock().unwrap();
            while st.pending.is_empty() && !st.sender_done {
                st = conn.changed.wait(st).unwrap();
            }
            if st.pending.is_empty() && st.sender_done {
                break;
            }
        }
        match rx.recv() {
            Ok(resp) => {
                let id = resp.id();
                let entry = conn.state.lock().unwrap().pending.remove(&id);
                match entry {
                    Some((m, sent_at, slo)) => {
                        outstanding.fetch_sub(1, Ordering::Relaxed);
                        col.record(m, outcome_of(resp, slo, sent_at), c.stored);
                    }
                    None => {
                        log::warn!(
                            "load generator: reply {id} from {} matches no request",
                            c.addr
                        );
                        *col.errors.entry("unmatched_reply".into()).or_default() += 1;
                        col.error_examples
                            .entry("unmatched_reply".into())
                            .or_insert(format!("{resp:?}"));
                    }
                }
            }
            Err(e) => {
                // Everything outstanding on this connection is lost, and
                // the sender counts its later requests as failed.
                let lost: Vec<_> = {
                    let mut st = conn.state.lock().unwrap();
                    st.broken.get_or_insert_with(|| e.to_string());
                    st.pending.drain().collect()
                };
                outstanding.fetch_sub(lost.len(), Ordering::Relaxed);
                for (_, (m, _, _)) in lost {
                    col.record(m, Outcome::Lost { why: e.to_string() }, c.stored);
                }
                break;
            }
        }
    }
    col
}
