//! Cache-in of models: every slice of every group is read at once (group 0
//! first, bytes in flight bounded per memory server), each slice is
//! checksummed when it lands, and a failed or corrupted read is retried on
//! the slice's next replica.
//!
//! * `job`: one model's fetch as a plain state machine (what to read next,
//!   what a completion means, when a group is complete).
//! * [`engine`]: the driver that posts the reads of many jobs on one
//!   transport and routes completions by `wr_id`, and the engine thread a
//!   host cache runs it on, so that fetches of different models share the
//!   links at once.
//! * [`fetch_model`]: one job driven on the calling thread, for tools and
//!   benches that own a transport.
//!
//! A group becomes visible when its last slice has landed and verified. The
//! slices tile the group and their checksums were taken from the same bytes
//! as the group's at deploy, so every byte is verified exactly once: hashing
//! the whole group again would double the CPU cost of the fetch (measured:
//! it is the difference between 0.7 and 0.95 of a raw socket copy on a
//! 2-core loopback, where copying already uses every core).
//!
//! The model lands in the packed layout: group g at `base + sum(bytes of
//! groups < g)`, so parameter offsets from the manifest apply unchanged.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use distmind_common::proto::ModelEntry;
use distmind_transport::{HostBuffer, PeerId, RegionId, Transport, TransportError};

pub mod engine;
pub(crate) mod job;

use engine::{Driver, JobSink};
use job::Job;

/// Default bound of bytes posted and not yet completed per memory server:
/// one default group. Reads share the link, so everything in flight slows group
/// 0, which compute waits for first; measured on a 4.7 Gb/s limited link,
/// 256 MiB in flight delayed group 0 of ResNet-152 from 67 ms to 256 ms,
/// while loopback throughput is the same from 32 to 256 MiB
/// (`distmind bench transfer --in-flight-mib N`).
pub const BYTES_IN_FLIGHT_DEFAULT: u64 = 32 << 20;
/// Reads kept in flight per memory server even when they exceed the byte
/// bound: with one read in flight the link idles between a completion and
/// the next post (measured: 0.84 of a raw copy from one memory server
/// instead of 0.95, when the engine still checksummed a slice before it
/// posted the next read). Not for a read of a later group than one in
/// flight that fills the window alone: sharing the link with it delayed
/// BERT's 94 MB group 0 behind group 1.
pub const READS_IN_FLIGHT_MIN: usize = 2;
/// How long a fetch with reads in flight waits for one of them to complete
/// before declaring the transport stuck.
pub const POLL_STALL_LIMIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy)]
pub struct FetchOptions {
    /// Bytes posted and not yet completed per memory server, counting the
    /// reads of every fetch from that server (at least
    /// [`READS_IN_FLIGHT_MIN`] reads whatever their size). Reads share the
    /// link, so a deep window delays the group compute needs first; each
    /// server's streams need reads of their own to stay busy (measured: a
    /// model over 4 servers pulled at 0.65 of a raw copy with one 32 MiB
    /// window for all, 0.8 with one per server).
    pub bytes_in_flight_max: u64,
    /// Checksum every slice (default). Off only where the link already
    /// guarantees integrity end to end; the transfer bench turns it off to
    /// measure the data path alone, next to the verified fetch.
    pub verify: bool,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            bytes_in_flight_max: BYTES_IN_FLIGHT_DEFAULT,
            verify: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    #[error("model {model} needs {need} bytes at offset {base} but the host buffer holds {have}")]
    NoRoom {
        model: String,
        need: u64,
        base: u64,
        have: u64,
    },
    #[error("model {model}: catalog entry is inconsistent: {why}")]
    BadEntry { model: String, why: String },
    #[error("model {model} group {group} slice {slice}: every replica failed: {errors}")]
    AllReplicasFailed {
        model: String,
        group: usize,
        slice: usize,
        errors: String,
    },
    #[error(
        "model {model}: no read completed for {0:?}; the transport is stuck",
        POLL_STALL_LIMIT
    )]
    Stalled { model: String },
    #[error("model {model}: fetch abandoned: {why}")]
    Aborted { model: String, why: String },
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
}

/// What a fetch did; `group_ready[g]` is when group g became visible.
#[derive(Debug, Clone)]
pub struct FetchReport {
    pub bytes: u64,
    pub elapsed: Duration,
    pub group_ready: Vec<Duration>,
    /// Reads that failed and were retried on another replica.
    pub retries: u32,
}

impl FetchReport {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64() / 1e9
    }
}

/// Connections to memory servers, made on first use and reused.
#[derive(Default)]
pub struct Peers {
    by_addr: HashMap<String, PeerId>,
}

impl Peers {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&mut self, t: &dyn Transport, addr: &str) -> Result<PeerId, TransportError> {
        if let Some(p) = self.by_addr.get(addr) {
            return Ok(*p);
        }
        let p = t.connect(addr)?;
        self.by_addr.insert(addr.to_string(), p);
        Ok(p)
    }

    /// Forgets a peer and closes its connection (failing its reads in
    /// flight), so the next use reconnects.
    pub fn forget(&mut self, t: &dyn Transport, addr: &str) {
        if let Some(p) = self.by_addr.remove(addr) {
            t.disconnect(p);
        }
    }

    /// Forgets a peer's id but keeps its connection: after a failed read the
    /// next use asks the transport again, which returns the same connection
    /// while it is alive and a fresh one for a lost peer. Reads of other
    /// fetches from the same server are not disturbed.
    pub fn unlearn(&mut self, addr: &str) {
        self.by_addr.remove(addr);
    }
}

/// Where a fetched model lands: `buf` (registered with the transport as
/// `region`) from byte `base` on, in the packed layout.
#[derive(Clone, Copy)]
pub struct Destination<'a> {
    pub region: RegionId,
    pub buf: &'a HostBuffer,
    pub base: u64,
}

/// Reads the whole model into `dest`. `on_group_ready(g)` runs as soon as group g is
/// complete and verified, before later groups finish: the compute pipeline
/// hangs off it. Returns once every read it posted completed, except when
/// the transport stalls ([`FetchError::Stalled`]): then reads may still land
/// in `dest`.
///
/// This fetch must be the only user of `t`'s completions while it runs (a
/// host cache's fetch engine runs many fetches at once instead).
pub fn fetch_model(
    t: &dyn Transport,
    peers: &mut Peers,
    entry: &ModelEntry,
    dest: Destination<'_>,
    opts: FetchOptions,
    on_group_ready: &mut dyn FnMut(usize),
) -> Result<FetchReport, FetchError> {
    let Destination { region, buf, base } = dest;
    let job = Job::new(entry, base, buf.len() as u64, opts, Instant::now())?;
    let mut result = None;
    let mut driver = Driver::new(t, region, buf, std::mem::take(peers));
    driver.add(
        job,
        Inline {
            on_group_ready,
            result: &mut result,
        },
    );
    while driver.unreported() > 0 {
        driver.post();
        driver.poll(INLINE_POLL);
    }
    *peers = driver.into_peers();
    result.expect("the job reported its outcome")
}

/// How long [`fetch_model`] waits in one poll (stalls are detected per job).
const INLINE_POLL: Duration = Duration::from_millis(100);

/// [`fetch_model`]'s sink: the caller's callback, and the outcome.
struct Inline<'a> {
    on_group_ready: &'a mut dyn FnMut(usize),
    result: &'a mut Option<Result<FetchReport, FetchError>>,
}

impl JobSink for Inline<'_> {
    fn group_ready(&mut self, group: usize) {
        (self.on_group_ready)(group);
    }
    fn finished(&mut self, result: Result<FetchReport, FetchError>, _settled: bool) {
        *self.result = Some(result);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use distmind_common::checksum::{checksum, to_hex};
    use distmind_common::proto::{GroupLocation, Location, Slice};
    use distmind_transport::mem::{MemFabric, MemTransport};

    use super::*;

    /// Two in-memory "memory servers", each holding a full copy of a model of
    /// `groups` groups of `group_len` bytes, laid out back to back.
    struct World {
        fabric: MemFabric,
        arenas: Vec<Arc<HostBuffer>>,
        model: Vec<u8>,
        entry: ModelEntry,
    }

    fn world(groups: usize, group_len: usize, slices_per_group: usize) -> World {
        let model: Vec<u8> = (0..groups * group_len)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let fabric = MemFabric::new();
        let mut arenas = Vec::new();
        for name in ["ms0", "ms1"] {
            let mut arena =
                HostBuffer::new(model.len(), distmind_transport::HugePages::No).unwrap();
            arena.as_mut_slice().copy_from_slice(&model);
            let arena = Arc::new(arena);
            fabric.add_peer(name, arena.clone());
            arenas.push(arena);
        }
        let slice_len = group_len / slices_per_group;
        let entry = ModelEntry {
            name: "m".into(),
            family: "test".into(),
            total_bytes: model.len() as u64,
            strategy: "hybrid".into(),
            replication: 2,
            version: 0,
            groups: (0..groups)
                .map(|g| GroupLocation {
                    index: g as u32,
                    bytes: group_len as u64,
                    checksum: to_hex(checksum(&model[g * group_len..(g + 1) * group_len])),
                    slices: (0..slices_per_group)
                        .map(|s| {
                            let at = g * group_len + s * slice_len;
                            Slice {
                                group_offset: (s * slice_len) as u64,
                                len: slice_len as u64,
                                checksum: to_hex(checksum(&model[at..at + slice_len])),
                                replicas: ["ms0", "ms1"]
                                    .iter()
                                    .enumerate()
                                    .map(|(i, a)| Location {
                                        memserver: i as u32,
                                        addr: a.to_string(),
                                        offset: at as u64,
                                    })
                                    .collect(),
                            }
                        })
                        .collect(),
                })
                .collect(),
            manifest: serde_json::Value::Null,
        };
        World {
            fabric,
            arenas,
            model,
            entry,
        }
    }

    fn fetch(
        w: &World,
        opts: FetchOptions,
    ) -> (Result<FetchReport, FetchError>, Vec<usize>, Vec<u8>) {
        let t = MemTransport::new(w.fabric.clone());
        let buf =
            Arc::new(HostBuffer::new(w.model.len(), distmind_transport::HugePages::No).unwrap());
        let region = t.register(buf.clone()).unwrap();
        let mut order = Vec::new();
        let r = fetch_model(
            &t,
            &mut Peers::new(),
            &w.entry,
            Destination {
                region,
                buf: &buf,
                base: 0,
            },
            opts,
            &mut |g| order.push(g),
        );
        t.deregister(region).unwrap();
        drop(t);
        let mut buf = Arc::into_inner(buf).expect("the transport let go of the buffer");
        (r, order, buf.as_mut_slice().to_vec())
    }

    #[test]
    fn every_group_arrives_verified_and_in_order() {
        let w = world(8, 4096, 2);
        let (r, order, bytes) = fetch(&w, FetchOptions::default());
        let r = r.unwrap();
        assert_eq!(bytes, w.model);
        assert_eq!(r.bytes, w.model.len() as u64);
        assert_eq!(order.len(), 8, "each group announced once");
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..8).collect::<Vec<_>>());
        assert_eq!(r.retries, 0);
    }

    #[test]
    fn a_one_read_window_still_finishes_in_group_order() {
        let w = world(6, 2048, 1);
        // Bytes in flight bounded to one slice: groups complete strictly in order.
        let (r, order, bytes) = fetch(
            &w,
            FetchOptions {
                bytes_in_flight_max: 1,
                ..FetchOptions::default()
            },
        );
        r.unwrap();
        assert_eq!(order, (0..6).collect::<Vec<_>>());
        assert_eq!(bytes, w.model);
    }

    #[test]
    fn a_dead_primary_falls_back_to_the_replica() {
        let w = world(4, 4096, 2);
        w.fabric.fail_peer("ms0");
        let (r, _, bytes) = fetch(&w, FetchOptions::default());
        let r = r.unwrap();
        assert_eq!(bytes, w.model);
        assert!(r.retries >= 1);
    }

    #[test]
    fn corrupted_bytes_are_never_exposed_and_the_replica_is_used() {
        let w = world(4, 4096, 2);
        // Corrupt one byte of group 2 on the primary.
        // SAFETY: no read is in flight in this single-threaded setup.
        #[allow(unsafe_code)]
        #[allow(unsafe_code)]
        unsafe {
            w.arenas[0].slice_mut(2 * 4096 + 10..2 * 4096 + 11)[0] ^= 0xff
        };
        let (r, order, bytes) = fetch(&w, FetchOptions::default());
        let r = r.unwrap();
        assert_eq!(bytes, w.model, "the good copy replaced the corrupted slice");
        assert!(r.retries >= 1);
        assert_eq!(order.len(), 4);
    }

    #[test]
    fn when_every_replica_fails_the_error_names_group_slice_and_servers() {
        let w = world(3, 4096, 1);
        w.fabric.fail_peer("ms0");
        w.fabric.fail_peer("ms1");
        let (r, order, _) = fetch(&w, FetchOptions::default());
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("group 0") && e.contains("ms0") && e.contains("ms1"),
            "{e}"
        );
        assert!(
            order.is_empty(),
            "no group is announced when its bytes never arrived"
        );
    }

    #[test]
    fn an_entry_whose_slices_do_not_tile_is_refused() {
        let mut w = world(2, 4096, 2);
        w.entry.groups[1].slices[1].group_offset += 512;
        let (r, _, _) = fetch(&w, FetchOptions::default());
        assert!(matches!(r, Err(FetchError::BadEntry { .. })), "{r:?}");
    }
}
