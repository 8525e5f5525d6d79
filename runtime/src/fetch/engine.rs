//! Running fetch jobs on a transport: the `Driver` posts the reads of
//! every active `Job` and routes each completion back to its job by
//! `wr_id`; the `Engine` is the long-lived thread of one host cache that
//! owns its transport's completions and runs a driver over the jobs it takes
//! from a bounded channel.
//!
//! Posting order across jobs: the job whose next read has the lowest group
//! index first, then the oldest job, so that group 0 of every waiting model
//! goes before anyone's later groups; a background job (a host-cache refill
//! no one waits for yet) after every other, with a smaller window. Bytes in flight are bounded per memory
//! server, shared by every job that reads from it (each job applies its own
//! `bytes_in_flight_max` to the server's total), with at least
//! [`READS_IN_FLIGHT_MIN`] reads per server whatever their size, except
//! that a read never joins one of an earlier group in a full window (a read
//! larger than the window, such as a transformer's token-embedding table,
//! has its server to itself). A read is never posted to a server ahead of a
//! higher-priority read waiting for room on that same server. A poll gives
//! the room of the reads it completed back and posts the next reads before
//! it checksums them, so a server's link does not idle while a slice is
//! verified.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, Sender, TryRecvError};
use distmind_transport::{Completion, HostBuffer, ReadOp, RegionId, Transport, TransportError};

use super::job::{Job, Landed};
use super::{FetchError, FetchOptions, FetchReport, Peers, POLL_STALL_LIMIT, READS_IN_FLIGHT_MIN};

/// Fetch jobs waiting in an engine's channel; a full channel blocks the
/// thread that submits the next one (a host cache's fill).
pub const JOBS_QUEUED_MAX: usize = 64;
/// Jobs an engine runs at once (more wait in the channel).
pub const JOBS_ACTIVE_MAX: usize = 64;
/// Completions taken per poll.
const POLL_BATCH: usize = 64;
/// How long the engine waits for a completion before it looks at its
/// channel again while jobs are active: the most a new job waits for its
/// first read when every read in flight is slow.
const POLL_SLICE: Duration = Duration::from_millis(1);
/// How an engine's thread is called: this, a space and the engine's name.
pub const THREAD_PREFIX: &str = "fetch";
/// Back-off after the transport's poll failed.
const POLL_ERROR_BACKOFF: Duration = Duration::from_millis(10);

/// Bits of a `wr_id` that carry the item index; the job id is above them.
const ITEM_BITS: u32 = 32;

/// What a job tells its submitter, on the thread that runs the driver.
pub(crate) trait JobSink {
    /// Group `g` landed and verified.
    fn group_ready(&mut self, group: usize);
    /// The job's outcome; called once. `settled`: none of the job's reads
    /// is in flight, and the sink is dropped right after this call; a
    /// stalled job reports before that, and its sink is dropped when its
    /// last read completed.
    fn finished(&mut self, result: Result<FetchReport, FetchError>, settled: bool);
}

impl<T: JobSink + ?Sized> JobSink for Box<T> {
    fn group_ready(&mut self, group: usize) {
        (**self).group_ready(group)
    }
    fn finished(&mut self, result: Result<FetchReport, FetchError>, settled: bool) {
        (**self).finished(result, settled)
    }
}

struct Active<S> {
    id: u32,
    job: Job,
    sink: S,
}

/// Bytes and reads in flight to one memory server.
#[derive(Debug, Default, Clone)]
struct Load {
    bytes: u64,
    reads: usize,
    /// The group of each read in flight here (as many as `reads`; its
    /// capacity is kept, so posting allocates only while it grows).
    groups: Vec<usize>,
    /// The posting round in which a read found no room here.
    blocked: u64,
}

impl Load {
    /// Whether a read of `len` bytes of `group` waits for room here: the
    /// window is full, unless fewer than [`READS_IN_FLIGHT_MIN`] reads are in
    /// flight; and once it is full a read never joins one of an earlier group
    /// (a read larger than the window, group 0's token-embedding table, gets
    /// the link to itself).
    fn full_for(&self, group: usize, len: u64, window: u64) -> bool {
        if self.reads == 0 {
            return false;
        }
        let earlier_in_flight = self.groups.iter().any(|&g| g < group);
        (self.bytes >= window && earlier_in_flight)
            || (self.reads >= READS_IN_FLIGHT_MIN && self.bytes + len > window)
    }

    fn posted(&mut self, group: usize, len: u64) {
        self.bytes += len;
        self.reads += 1;
        self.groups.push(group);
    }

    fn completed(&mut self, group: usize, len: u64) {
        self.bytes -= len;
        self.reads -= 1;
        if let Some(i) = self.groups.iter().position(|&g| g == group) {
            self.groups.swap_remove(i);
        }
    }
}

/// Posts and completes the reads of a set of jobs into one registered
/// region. It must be the only consumer of `t`'s completions.
pub(crate) struct Driver<'t, S> {
    t: &'t dyn Transport,
    region: RegionId,
    buf: &'t HostBuffer,
    peers: Peers,
    /// Oldest first.
    jobs: Vec<Active<S>>,
    load: HashMap<String, Load>,
    completions: Vec<Completion>,
    next_id: u32,
    /// Calls of [`Driver::post`].
    round: u64,
}

impl<'t, S: JobSink> Driver<'t, S> {
    pub fn new(t: &'t dyn Transport, region: RegionId, buf: &'t HostBuffer, peers: Peers) -> Self {
        Driver {
            t,
            region,
            buf,
            peers,
            jobs: Vec::new(),
            load: HashMap::new(),
            completions: Vec::with_capacity(POLL_BATCH),
            next_id: 0,
            round: 0,
        }
    }

    /// The peer connections, for the next driver.
    pub fn into_peers(self) -> Peers {
        self.peers
    }

    /// Jobs held: running, or failed and waiting for their reads in flight.
    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Jobs whose outcome is not out yet.
    pub fn unreported(&self) -> usize {
        self.jobs.len() - self.jobs.iter().filter(|a| a.job.is_reported()).count()
    }

    pub fn add(&mut self, job: Job, sink: S) {
        // Ids of live jobs are unique: a job lives until its last read
        // completed, and there are far fewer than 2^32 of them.
        let mut id = self.next_id;
        while self.jobs.iter().any(|a| a.id == id) {
            id = id.wrapping_add(1);
        }
        self.next_id = id.wrapping_add(1);
        self.jobs.push(Active { id, job, sink });
    }

    /// Fails every job that has not reported (`why`); their reads in flight
    /// still complete.
    pub fn abort_all(&mut self, why: &str) {
        for a in &mut self.jobs {
            a.job.abort(FetchError::Aborted {
                model: a.job.model().into(),
                why: why.into(),
            });
        }
        self.reap(Instant::now());
    }

    /// Posts reads, best first, while memory servers have room.
    pub fn post(&mut self) {
        // Servers a better read waits for in this round: nothing overtakes
        // it there.
        self.round += 1;
        let round = self.round;
        loop {
            let load = &self.load;
            let best = self
                .jobs
                .iter()
                .enumerate()
                .filter_map(|(k, a)| {
                    let r = a.job.next()?;
                    let blocked = load.get(r.addr).is_some_and(|l| l.blocked == round);
                    (!blocked).then_some((a.job.is_background(), r.group, k))
                })
                .min();
            let Some((_, _, k)) = best else { return };
            let a = &self.jobs[k];
            let r = a.job.next().expect("chosen for its next read");
            let l = match self.load.get_mut(r.addr) {
                Some(l) => l,
                None => self.load.entry(r.addr.to_string()).or_default(),
            };
            if l.full_for(r.group, r.len, a.job.window()) {
                l.blocked = round;
                continue;
            }
            let op = ReadOp {
                wr_id: (u64::from(a.id) << ITEM_BITS) | r.item as u64,
                remote_offset: r.remote_offset,
                len: r.len,
                local: self.region,
                local_offset: r.local_offset,
            };
            let t = self.t;
            let posted = self.peers.get(t, r.addr).and_then(|peer| {
                // SAFETY: the destination range belongs to this job alone
                // (its model's blocks, held for it until every one of its
                // reads completed) and nothing reads it until this op's
                // completion is polled and verified.
                #[allow(unsafe_code)]
                unsafe {
                    t.post_reads(peer, std::slice::from_ref(&op))
                }
            });
            match posted {
                Ok(()) => {
                    if let Some(l) = self.load.get_mut(r.addr) {
                        l.posted(r.group, r.len);
                    }
                    self.jobs[k].job.posted(Instant::now());
                }
                // Full: completions make room; every posted op completes.
                Err(TransportError::QueueFull { .. }) if self.in_flight() > 0 => return,
                Err(e) => {
                    let addr = r.addr.to_string();
                    self.jobs[k].job.post_failed(&e.to_string());
                    // The next use asks the transport again, which replaces
                    // a lost connection with a fresh one.
                    self.peers.unlearn(&addr);
                }
            }
        }
    }

    /// Reads in flight, over every job.
    pub fn in_flight(&self) -> usize {
        self.jobs.iter().map(|a| a.job.in_flight()).sum()
    }

    /// Waits up to `timeout` for completions and hands each to its job,
    /// then reports the jobs whose outcome is known and drops those with
    /// nothing in flight.
    pub fn poll(&mut self, timeout: Duration) {
        self.completions.clear();
        match self.t.poll(&mut self.completions, POLL_BATCH, timeout) {
            Ok(_) => {}
            Err(e) => {
                log::error!("fetch: polling the {} transport: {e}", self.t.name());
                let why = format!("polling the transport: {e}");
                self.abort_all(&why);
                std::thread::sleep(POLL_ERROR_BACKOFF);
                return;
            }
        }
        let now = Instant::now();
        let mut completions = std::mem::take(&mut self.completions);
        // Room first: the next reads go out before these are verified, so
        // a server's link does not idle while a slice is checksummed.
        for c in &completions {
            self.release(c);
        }
        if !completions.is_empty() {
            self.post();
        }
        for c in completions.drain(..) {
            self.complete(c, now);
        }
        self.completions = completions;
        for a in &mut self.jobs {
            a.job.check_stall(now);
        }
        self.reap(now);
    }

    /// Gives the room of a completed read back to its memory server.
    fn release(&mut self, c: &Completion) {
        let Some((a, item)) = owner(&mut self.jobs, c) else {
            return;
        };
        let r = a.job.read(item);
        let (group, len) = (r.group, r.len);
        if let Some(l) = self.load.get_mut(r.addr) {
            l.completed(group, len);
        }
    }

    /// Verifies a completed read (its room given back by [`Self::release`])
    /// and tells its job.
    fn complete(&mut self, c: Completion, now: Instant) {
        let Some((a, item)) = owner(&mut self.jobs, &c) else {
            log::error!(
                "fetch: a completion for no job (wr_id {:#x}) was dropped",
                c.wr_id
            );
            return;
        };
        let r = a.job.read(item);
        let (addr, start, len) = (r.addr, r.local_offset as usize, r.len as usize);
        let read_failed = c.result.is_err();
        let result = c.result.map_err(|e| e.to_string()).and_then(|()| {
            if !a.job.opts().verify {
                return Ok(());
            }
            // SAFETY: this read has completed and no other read in flight
            // targets its range (each job owns its blocks, each item its
            // slice of them).
            #[allow(unsafe_code)]
            let bytes = unsafe { self.buf.slice(start..start + len) };
            a.job.check(item, bytes)
        });
        let failed_addr = result.is_err().then(|| addr.to_string());
        match a.job.landed(item, result, now) {
            Landed::GroupReady(g) => a.sink.group_ready(g),
            Landed::Pending | Landed::Retried | Landed::Failed => {}
        }
        if let Some(addr) = failed_addr {
            if read_failed {
                // The server failed a read (lost, or refused it): drop the
                // connection, which fails every read still in flight to it
                // at once (a one-sided path to a dead server may never
                // complete them otherwise); they retry on their replicas.
                self.peers.forget(self.t, &addr);
            } else {
                // Bytes that did not verify: ask the transport again.
                self.peers.unlearn(&addr);
            }
        }
    }

    /// Hands out known outcomes; forgets jobs that are over and reported.
    fn reap(&mut self, now: Instant) {
        for a in &mut self.jobs {
            if a.job.has_outcome() {
                let outcome = a.job.take_outcome(now);
                a.sink.finished(outcome, a.job.is_over());
            }
        }
        self.jobs
            .retain(|a| !(a.job.is_reported() && a.job.is_over()));
    }
}

/// The job and item a completion belongs to.
fn owner<'a, S>(jobs: &'a mut [Active<S>], c: &Completion) -> Option<(&'a mut Active<S>, usize)> {
    let (id, item) = (
        (c.wr_id >> ITEM_BITS) as u32,
        (c.wr_id & 0xffff_ffff) as usize,
    );
    let a = jobs.iter_mut().find(|a| a.id == id)?;
    Some((a, item))
}

/// A submitted job and where its events go.
struct Submit {
    job: Job,
    sink: Box<dyn JobSink + Send>,
}

/// The fetch engine of one registered region (one host cache) on one
/// transport: a thread that owns the transport's completions and runs every
/// fetch into the region at once. Dropping it stops taking jobs, fails the
/// jobs still held, waits for their reads in flight (up to
/// [`POLL_STALL_LIMIT`]) and joins the thread.
pub(crate) struct Engine {
    tx: Option<Sender<Submit>>,
    thread: Option<JoinHandle<bool>>,
    region_len: u64,
    drained: bool,
}

impl Engine {
    /// Starts the engine thread for `region` (`buf`, registered with `t`),
    /// at nice value `nice` (0: the process's own; see
    /// [`distmind_transport::priority`]). Nothing else may poll `t`'s
    /// completions while the engine lives.
    pub fn start(
        name: &str,
        t: Arc<dyn Transport>,
        region: RegionId,
        buf: Arc<HostBuffer>,
        nice: i32,
    ) -> std::io::Result<Engine> {
        let (tx, rx) = channel::bounded(JOBS_QUEUED_MAX);
        let region_len = buf.len() as u64;
        let thread = std::thread::Builder::new()
            .name(format!("{THREAD_PREFIX} {name}"))
            .spawn(move || {
                distmind_transport::priority::lower_current_thread(nice);
                run(&*t, region, &buf, rx)
            })?;
        Ok(Engine {
            tx: Some(tx),
            thread: Some(thread),
            region_len,
            drained: true,
        })
    }

    /// Queues a fetch of `entry` into the region from byte `base` on;
    /// `sink` hears of its groups and its outcome on the engine thread.
    /// Blocks while [`JOBS_QUEUED_MAX`] jobs wait already.
    /// `background`: the job is a background one while it is set (see
    /// [`Job::is_background`]).
    pub(crate) fn submit(
        &self,
        entry: &distmind_common::proto::ModelEntry,
        base: u64,
        opts: FetchOptions,
        background: Option<Arc<AtomicBool>>,
        sink: Box<dyn JobSink + Send>,
    ) -> Result<(), FetchError> {
        let mut job = Job::new(entry, base, self.region_len, opts, Instant::now())?;
        if let Some(flag) = background {
            job = job.in_background(flag);
        }
        let tx = self.tx.as_ref().ok_or_else(|| stopped(&entry.name))?;
        tx.send(Submit { job, sink })
            .map_err(|_| stopped(&entry.name))
    }

    /// Stops the engine (see [`Engine`]); true when every read it posted
    /// completed, so the region may be deregistered.
    pub fn shutdown(&mut self) -> bool {
        self.tx = None;
        if let Some(h) = self.thread.take() {
            self.drained = h.join().unwrap_or_else(|_| {
                log::error!("fetch engine: its thread panicked");
                false
            });
        }
        self.drained
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn stopped(model: &str) -> FetchError {
    FetchError::Aborted {
        model: model.into(),
        why: "the fetch engine has stopped".into(),
    }
}

/// The engine thread: take jobs, post, poll; returns whether every read
/// completed.
fn run(t: &dyn Transport, region: RegionId, buf: &HostBuffer, rx: Receiver<Submit>) -> bool {
    let mut d: Driver<'_, Box<dyn JobSink + Send>> = Driver::new(t, region, buf, Peers::new());
    let mut open = true;
    while open {
        if d.jobs() == 0 {
            // Idle: sleep on the channel, not on the transport.
            match rx.recv() {
                Ok(s) => d.add(s.job, s.sink),
                Err(_) => break,
            }
        }
        while d.jobs() < JOBS_ACTIVE_MAX {
            match rx.try_recv() {
                Ok(s) => d.add(s.job, s.sink),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        d.post();
        d.poll(POLL_SLICE);
    }
    // Shutting down: no new jobs; the ones held fail, their reads complete.
    d.abort_all("the host cache is shutting down");
    let deadline = Instant::now() + POLL_STALL_LIMIT;
    while d.jobs() > 0 && Instant::now() < deadline {
        d.poll(POLL_SLICE);
    }
    if d.jobs() > 0 {
        log::error!(
            "fetch engine: {} reads still in flight after {POLL_STALL_LIMIT:?}; leaving the region registered",
            d.in_flight()
        );
        return false;
    }
    true
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Mutex;

    use distmind_common::checksum::{checksum, to_hex};
    use distmind_common::proto::{GroupLocation, Location, ModelEntry, Slice};
    use distmind_transport::mem::{MemFabric, MemTransport};
    use distmind_transport::HugePages;

    use super::*;

    /// `n` models ("m0", "m1", ...) of `groups` one-slice groups of `len`
    /// bytes, all in one arena served by both `peers` (the first is every
    /// slice's primary): model k at `k * groups * len`.
    fn models(
        fabric: &MemFabric,
        peers: [&str; 2],
        n: usize,
        groups: usize,
        len: usize,
    ) -> (Vec<ModelEntry>, Vec<u8>) {
        let size = groups * len;
        let bytes: Vec<u8> = (0..n * size).map(|i| (i * 13 % 251) as u8).collect();
        for p in peers {
            let mut a = HostBuffer::new(bytes.len(), HugePages::No).unwrap();
            a.as_mut_slice().copy_from_slice(&bytes);
            fabric.add_peer(p, Arc::new(a));
        }
        let entries = (0..n)
            .map(|k| ModelEntry {
                name: format!("m{k}"),
                family: "test".into(),
                total_bytes: size as u64,
                strategy: "test".into(),
                replication: 2,
                version: 0,
                groups: (0..groups)
                    .map(|g| {
                        let at = k * size + g * len;
                        let sum = to_hex(checksum(&bytes[at..at + len]));
                        GroupLocation {
                            index: g as u32,
                            bytes: len as u64,
                            checksum: sum.clone(),
                            slices: vec![Slice {
                                group_offset: 0,
                                len: len as u64,
                                checksum: sum,
                                replicas: peers
                                    .iter()
                                    .enumerate()
                                    .map(|(i, p)| Location {
                                        memserver: i as u32,
                                        addr: p.to_string(),
                                        offset: at as u64,
                                    })
                                    .collect(),
                            }],
                        }
                    })
                    .collect(),
                manifest: serde_json::Value::Null,
            })
            .collect();
        (entries, bytes)
    }

    /// A job's group (`Ok(g)`), report (`Ok(usize::MAX)`) or error, tagged
    /// with the job's index.
    type Event = (usize, Result<usize, String>);

    /// Records what jobs said.
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<Event>>>);

    struct Tagged(usize, Log);

    impl JobSink for Tagged {
        fn group_ready(&mut self, group: usize) {
            self.1 .0.lock().unwrap().push((self.0, Ok(group)));
        }
        fn finished(&mut self, result: Result<FetchReport, FetchError>, _: bool) {
            let r = result.map(|_| usize::MAX).map_err(|e| e.to_string());
            self.1 .0.lock().unwrap().push((self.0, r));
        }
    }

    fn opts(bytes_in_flight_max: u64) -> FetchOptions {
        FetchOptions {
            bytes_in_flight_max,
            ..FetchOptions::default()
        }
    }

    fn run_to_end<S: JobSink>(d: &mut Driver<'_, S>) {
        while d.jobs() > 0 {
            d.post();
            d.poll(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_read_larger_than_the_window_has_its_server_to_itself() {
        let fabric = MemFabric::new();
        let (entries, bytes) = models(&fabric, ["ms0", "ms1"], 2, 3, 1000);
        let t = MemTransport::new(fabric);
        let buf = Arc::new(HostBuffer::new(bytes.len(), HugePages::No).unwrap());
        let region = t.register(buf.clone()).unwrap();
        let log = Log::default();
        let mut d = Driver::new(&t, region, &buf, Peers::new());
        let job = |k: usize| {
            Job::new(
                &entries[k],
                (k * 3000) as u64,
                bytes.len() as u64,
                opts(500),
                Instant::now(),
            )
            .unwrap()
        };
        d.add(job(0), Tagged(0, log.clone()));
        d.post();
        assert_eq!(
            d.load["ms0"].groups,
            [0],
            "group 1 waits: group 0's read alone fills the window"
        );
        d.add(job(1), Tagged(1, log.clone()));
        d.post();
        assert_eq!(
            d.load["ms0"].groups,
            [0, 0],
            "another model's group 0 joins it (READS_IN_FLIGHT_MIN)"
        );
        // The poll that takes both completions posts the next reads before
        // it verifies them.
        while log.0.lock().unwrap().len() < 2 {
            d.poll(Duration::from_secs(5));
        }
        assert_eq!(d.load["ms0"].groups, [1, 1]);
        run_to_end(&mut d);
        let ok = log
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, r)| r.is_ok())
            .count();
        assert_eq!(
            ok,
            2 * 3 + 2,
            "every group of both models verified, then both reports"
        );
    }

    #[test]
    fn driver_posts_group_0_of_every_job_before_later_groups() {
        let fabric = MemFabric::new();
        let (entries, bytes) = models(&fabric, ["ms0", "ms1"], 3, 4, 1000);
        let t = MemTransport::new(fabric);
        let buf = Arc::new(HostBuffer::new(bytes.len(), HugePages::No).unwrap());
        let region = t.register(buf.clone()).unwrap();
        let log = Log::default();
        let mut d = Driver::new(&t, region, &buf, Peers::new());
        let now = Instant::now();
        for (k, e) in entries.iter().enumerate() {
            // One read per server in flight at most (the minimum is 2).
            let job = Job::new(e, (k * 4000) as u64, bytes.len() as u64, opts(1), now).unwrap();
            d.add(job, Tagged(k, log.clone()));
        }
        d.post();
        assert_eq!(
            d.load["ms0"].reads, READS_IN_FLIGHT_MIN,
            "the bound is per memory server, over every job"
        );
        run_to_end(&mut d);
        // Lowest group first across jobs, the oldest job first within a group.
        let want: Vec<(usize, usize)> = (0..4).flat_map(|g| (0..3).map(move |k| (k, g))).collect();
        assert_eq!(group_order(&log), want);
        assert_eq!(
            log.0
                .lock()
                .unwrap()
                .iter()
                .filter(|(_, r)| r == &Ok(usize::MAX))
                .count(),
            3
        );
        drop(d);
        t.deregister(region).unwrap();
        // SAFETY: every read completed.
        #[allow(unsafe_code)]
        let landed = unsafe { buf.slice(0..bytes.len()) };
        assert_eq!(landed, &bytes[..]);
    }

    /// The groups each job reported, in the order they verified.
    fn group_order(log: &Log) -> Vec<(usize, usize)> {
        log.0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(k, r)| {
                r.as_ref()
                    .ok()
                    .filter(|g| **g != usize::MAX)
                    .map(|g| (*k, *g))
            })
            .collect()
    }

    #[test]
    fn a_background_job_waits_for_every_waited_for_one_until_someone_waits_for_it() {
        let fabric = MemFabric::new();
        let (entries, bytes) = models(&fabric, ["ms0", "ms1"], 2, 3, 1000);
        let t = MemTransport::new(fabric);
        let buf = Arc::new(HostBuffer::new(bytes.len(), HugePages::No).unwrap());
        let region = t.register(buf.clone()).unwrap();
        let run = |promote: bool| {
            let log = Log::default();
            let mut d = Driver::new(&t, region, &buf, Peers::new());
            let now = Instant::now();
            // Job 0 is the older one, and a background one.
            let flag = Arc::new(AtomicBool::new(true));
            let job = |k: usize| {
                Job::new(
                    &entries[k],
                    (k * 3000) as u64,
                    bytes.len() as u64,
                    opts(1),
                    now,
                )
                .unwrap()
            };
            d.add(job(0).in_background(flag.clone()), Tagged(0, log.clone()));
            d.add(job(1), Tagged(1, log.clone()));
            if promote {
                // Someone came to wait for it.
                flag.store(false, Ordering::Relaxed);
            }
            run_to_end(&mut d);
            group_order(&log)
        };
        let jobs_groups = |order: &[usize]| -> Vec<(usize, usize)> {
            order
                .iter()
                .flat_map(|&k| (0..3).map(move |g| (k, g)))
                .collect()
        };
        assert_eq!(
            run(false),
            jobs_groups(&[1, 0]),
            "every group of the waited-for job first"
        );
        // Promoted: the lowest group first, the older job first within one.
        let want: Vec<(usize, usize)> = (0..3).flat_map(|g| (0..2).map(move |k| (k, g))).collect();
        assert_eq!(run(true), want);
        t.deregister(region).unwrap();
        // SAFETY: every read completed (each driver ran its jobs to the end).
        #[allow(unsafe_code)]
        let landed = unsafe { buf.slice(0..bytes.len()) };
        assert_eq!(landed, &bytes[..]);
    }

    #[test]
    fn driver_fails_only_the_job_whose_replicas_all_failed() {
        let fabric = MemFabric::new();
        let (good, good_bytes) = models(&fabric, ["ms0", "ms1"], 1, 3, 1000);
        let (bad, _) = models(&fabric, ["bad0", "bad1"], 1, 3, 1000);
        fabric.fail_peer("bad0");
        fabric.fail_peer("bad1");
        let t = MemTransport::new(fabric);
        let buf = Arc::new(HostBuffer::new(6000, HugePages::No).unwrap());
        let region = t.register(buf.clone()).unwrap();
        let log = Log::default();
        let mut d = Driver::new(&t, region, &buf, Peers::new());
        let now = Instant::now();
        let o = FetchOptions::default();
        d.add(
            Job::new(&bad[0], 0, 6000, o, now).unwrap(),
            Tagged(0, log.clone()),
        );
        d.add(
            Job::new(&good[0], 3000, 6000, o, now).unwrap(),
            Tagged(1, log.clone()),
        );
        run_to_end(&mut d);
        let events = log.0.lock().unwrap().clone();
        let bad_end: Vec<&Result<usize, String>> = events
            .iter()
            .filter(|(k, _)| *k == 0)
            .map(|(_, r)| r)
            .collect();
        assert_eq!(
            bad_end.len(),
            1,
            "no group of the bad job was announced: {events:?}"
        );
        let e = bad_end[0].as_ref().unwrap_err();
        assert!(e.contains("bad0") && e.contains("bad1"), "{e}");
        assert_eq!(
            events.iter().filter(|(k, _)| *k == 1).count(),
            4,
            "3 groups and the report of the good job: {events:?}"
        );
        assert!(events.contains(&(1, Ok(usize::MAX))));
        drop(d);
        t.deregister(region).unwrap();
        // SAFETY: every read completed.
        #[allow(unsafe_code)]
        let landed = unsafe { buf.slice(3000..6000) };
        assert_eq!(landed, &good_bytes[..]);
    }

    #[test]
    fn engine_runs_jobs_from_many_threads_and_stops_cleanly() {
        let fabric = MemFabric::new();
        let (entries, bytes) = models(&fabric, ["ms0", "ms1"], 4, 5, 3000);
        let t: Arc<dyn Transport> = Arc::new(MemTransport::new(fabric));
        let buf = Arc::new(HostBuffer::new(bytes.len(), HugePages::No).unwrap());
        let region = t.register(buf.clone()).unwrap();
        let mut engine = Engine::start("test", t.clone(), region, buf.clone(), 0).unwrap();
        let log = Log::default();
        std::thread::scope(|s| {
            for (k, e) in entries.iter().enumerate() {
                let (engine, log) = (&engine, log.clone());
                s.spawn(move || {
                    let sink = Box::new(Tagged(k, log));
                    engine
                        .submit(e, (k * 15000) as u64, FetchOptions::default(), None, sink)
                        .unwrap();
                });
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while log.0.lock().unwrap().len() < 4 * 6 {
            assert!(Instant::now() < deadline, "the engine did not finish");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(engine.shutdown(), "every read completed");
        assert_eq!(
            Arc::strong_count(&buf),
            2,
            "the engine thread let go of the buffer"
        );
        t.deregister(region).unwrap();
        // SAFETY: every read completed and the engine is gone.
        #[allow(unsafe_code)]
        let landed = unsafe { buf.slice(0..bytes.len()) };
        assert_eq!(landed, &bytes[..]);
        let e = engine
            .submit(
                &entries[0],
                0,
                FetchOptions::default(),
                None,
                Box::new(Tagged(9, log)),
            )
            .unwrap_err();
        assert!(e.to_string().contains("stopped"), "{e}");
    }
}
