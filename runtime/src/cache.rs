//! The host block cache: where models land from the memory servers before
//! they are copied to a device.
//!
//! One [`HostBuffer`] (default [`CACHE_BYTES_DEFAULT`]) is mapped, faulted in
//! and registered with the transport ONCE, then cut into fixed blocks
//! (default [`BLOCK_BYTES_DEFAULT`]). A cached model occupies a run of
//! contiguous blocks, so its packed layout stays contiguous in host memory:
//! group g is one slice, handed as is to `Arena::upload` (and, with CUDA, to
//! one `cudaMemcpyAsync` from pinned memory).
//!
//! * [`HostCache::reserve`] finds a free run first-fit over a free-block
//!   bitmap, evicting models that no reader holds until one fits: first
//!   those a device of this server will keep past its next eviction, the
//!   one that ran there most recently first, then the least recently used
//!   ([`HostCache::device_uses`] says what the devices hold). A model a
//!   device holds needs no host copy until the device evicts it, and a
//!   device evicts its least recently used model: so host memory keeps the
//!   models device memory does not, and those it gives up next (together
//!   they hold more of the set than with plain LRU, where host memory
//!   mostly repeats what the devices hold). A device of one model gives it
//!   up at its next load, so for such devices the rule is plain LRU. A model
//!   larger than the cache, or a cache whose models are all in use, is a
//!   clear error naming the sizes.
//! * [`HostCache::refill`] takes back in the background what a device
//!   evicted ([`Residency::on_evict`](crate::device::Residency::on_evict);
//!   the server does so when it has one device),
//!   in place of copies of models a device keeps and only while no other
//!   fill is under way (one refill at a time): host memory then holds what the
//!   devices gave up, and together they hold more of the set. Its reads go
//!   after every waited-for fill's, in a smaller window, until a request
//!   finds the model and waits for it.
//! * [`HostCache::fill`] fetches a reserved model into its run through the
//!   cache's fetch engine ([`crate::fetch::engine`]: one thread per cache
//!   that owns the transport's completions; fills of different models from
//!   different threads run at once and share the links); each group becomes
//!   visible ([`CachedModel::group`], [`CachedModel::wait_group`]) only once
//!   all its slices arrived and verified. A failed fetch fails every group
//!   still pending (waiters get the reason at once) and drops the model from
//!   the cache, so the next request fetches it again.
//! * A [`CachedModel`] is a pin: while one lives, the model's blocks are
//!   neither evicted nor reused. [`HostCache::remove`] (cache-out) frees the
//!   blocks at once, or when the last pin is dropped.
//!
//! State of a cached model: `Reserved` -> `Filling` (groups arriving) ->
//! `Complete` (evictable when unpinned), or `Failed` (gone from the lookup
//! table; blocks freed with the last pin).
//!
//! Bounds: at most one model per block, so the tables are bounded by the
//! block count; the engine holds at most
//! [`JOBS_ACTIVE_MAX`](crate::fetch::engine::JOBS_ACTIVE_MAX) fills (more
//! wait in its bounded channel) with bytes in flight bounded per memory
//! server. Dropping the cache stops the engine once its reads in flight
//! completed, then deregisters the buffer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam::channel;
use distmind_common::proto::ModelEntry;
use distmind_transport::{HostBuffer, HugePages, MemoryError, RegionId, Transport, TransportError};

use crate::device::DeviceUses;
use crate::fetch::engine::{Engine, JobSink};
use crate::fetch::{FetchError, FetchOptions, FetchReport};

/// Default size of the host cache.
pub const CACHE_BYTES_DEFAULT: u64 = 4 << 30;
/// Default block size (the original cut its cache into 4,096,000-byte blocks,
/// [`BLOCK_BYTES_ORIGINAL`]; a power of two keeps blocks huge-page aligned).
pub const BLOCK_BYTES_DEFAULT: u64 = 4 << 20;
/// The original's block size, accepted as a setting.
pub const BLOCK_BYTES_ORIGINAL: u64 = 4_096_000;
/// Smallest block accepted: one page, so every block start is page aligned.
pub const BLOCK_BYTES_MIN: u64 = 4096;

/// Called once on the cache's buffer after it is mapped and before it is
/// registered with the transport. This is where `cudaHostRegister` (pinning
/// the cache for asynchronous H2D copies) goes when the `cuda` executor is
/// present; nothing pins on CPU-only builds.
/// The hook returns a [`Pinned`] registration, which the cache keeps until it
/// is dropped and then releases (`cuMemHostUnregister`) before the buffer can
/// be unmapped.
pub type PinHook = Box<dyn Fn(&HostBuffer) -> Result<Pinned, String> + Send + Sync>;

/// A registration of host memory with a device driver, undone on drop.
pub struct Pinned(pub Box<dyn Send + Sync>);

impl std::fmt::Debug for Pinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pinned")
    }
}

pub struct CacheConfig {
    pub capacity_bytes: u64,
    pub block_bytes: u64,
    pub huge_pages: HugePages,
    pub pin: Option<PinHook>,
    /// Nice value of the fetch engine's thread (see
    /// [`distmind_transport::priority`]); 0: the process's own.
    pub thread_nice: i32,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            capacity_bytes: CACHE_BYTES_DEFAULT,
            block_bytes: BLOCK_BYTES_DEFAULT,
            huge_pages: HugePages::Try,
            pin: None,
            thread_nice: 0,
        }
    }
}

impl CacheConfig {
    /// `capacity_bytes` in blocks of `block_bytes`, normal pages, no pinning.
    pub fn new(capacity_bytes: u64, block_bytes: u64) -> Self {
        CacheConfig {
            capacity_bytes,
            block_bytes,
            huge_pages: HugePages::No,
            pin: None,
            thread_nice: 0,
        }
    }

    /// Pins the buffer when `executor` uploads from it by DMA (`cuda`:
    /// page-locked memory lets copies overlap compute); others need nothing.
    pub fn pinned_for(mut self, executor: crate::exec::ExecutorKind) -> Self {
        self.pin = (executor == crate::exec::ExecutorKind::Cuda).then(crate::exec::cuda::pin_hook);
        self
    }

    /// Runs the fetch engine at `executor`'s data-thread priority
    /// ([`ExecutorKind::data_thread_nice`](crate::exec::ExecutorKind::data_thread_nice)).
    pub fn niced_for(mut self, executor: crate::exec::ExecutorKind) -> Self {
        self.thread_nice = executor.data_thread_nice();
        self
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    #[error("host cache: {0}")]
    Config(String),
    #[error("host cache: {0}")]
    Memory(#[from] MemoryError),
    #[error("host cache: pinning the cache buffer failed: {0}")]
    Pin(String),
    #[error("host cache: registering with the {transport} transport: {source}")]
    Register {
        transport: &'static str,
        source: TransportError,
    },
    #[error("model {model} ({bytes} bytes, {blocks} blocks of {block_bytes}) is larger than the whole host cache ({capacity} bytes)")]
    TooBig {
        model: String,
        bytes: u64,
        blocks: u64,
        block_bytes: u64,
        capacity: u64,
    },
    #[error("model {model} needs {blocks} contiguous blocks ({bytes} bytes) but the host cache ({capacity} bytes, {used} used, {free_blocks} blocks free) holds only models in use: {in_use}")]
    Full {
        model: String,
        bytes: u64,
        blocks: u64,
        capacity: u64,
        used: u64,
        free_blocks: u64,
        in_use: String,
    },
    #[error("model {model} has no bytes: nothing to cache")]
    Empty { model: String },
    #[error("model {0} is already in the host cache")]
    Exists(String),
    #[error("model {model}: {why}")]
    Layout { model: String, why: String },
    #[error("model {model}: cannot fill: it is {state}, not freshly reserved")]
    NotReserved { model: String, state: &'static str },
    #[error("model {model}: fetch into the host cache failed: {source}")]
    Fetch { model: String, source: FetchError },
    #[error("model {model} group {group}: {why}")]
    Group {
        model: String,
        group: usize,
        why: String,
    },
}

/// Counters and occupancy, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub capacity_bytes: u64,
    /// Bytes of blocks held by models (including removed ones still pinned).
    pub used_bytes: u64,
    /// Models that lookups find.
    pub models: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Bytes read from memory servers by completed fills.
    pub fetched_bytes: u64,
    /// Background refills begun ([`HostCache::refill`]).
    pub refills: u64,
}

/// Whether a lookup found the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// In the cache, complete or still filling (wait on its groups).
    Hit,
    /// Freshly reserved: the caller must [`HostCache::fill`] it.
    Miss,
}

/// Where a cached model stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FillState {
    Reserved,
    Filling,
    Complete,
    Failed(String),
}

impl FillState {
    fn name(&self) -> &'static str {
        match self {
            FillState::Reserved => "reserved",
            FillState::Filling => "filling",
            FillState::Complete => "complete",
            FillState::Failed(_) => "failed",
        }
    }
}

struct Fill {
    state: FillState,
    /// When each group became visible; `None` while pending.
    ready: Vec<Option<Instant>>,
}

/// One cached model's blocks, layout and fill state.
struct Slot {
    id: u64,
    name: String,
    /// Byte offset of the model's first block in the cache buffer.
    base: u64,
    first_block: usize,
    blocks: usize,
    /// Packed layout: start and length of each group, from the model's start.
    groups: Vec<(u64, u64)>,
    bytes: u64,
    fill: Mutex<Fill>,
    cv: Condvar,
    /// Set while the slot is refilled in the background and no one waits
    /// for it (the fetch engine reads it; see [`HostCache::refill`]).
    background: Arc<AtomicBool>,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, Fill> {
        self.fill.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Entry {
    slot: Arc<Slot>,
    pins: usize,
    last_used: u64,
    /// Removed from the lookup table; blocks are freed when `pins` reaches 0.
    doomed: bool,
}

#[derive(Default)]
struct Table {
    /// `free[b]`: block b holds no model.
    free: Vec<bool>,
    entries: HashMap<u64, Entry>,
    by_name: HashMap<String, u64>,
    next_id: u64,
    tick: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl Table {
    fn touch(&mut self, id: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(&id) {
            e.last_used = tick;
        }
    }

    fn release_blocks(&mut self, id: u64) {
        if let Some(e) = self.entries.remove(&id) {
            for b in &mut self.free[e.slot.first_block..e.slot.first_block + e.slot.blocks] {
                debug_assert!(!*b);
                *b = true;
            }
            if self.by_name.get(&e.slot.name) == Some(&id) {
                self.by_name.remove(&e.slot.name);
            }
        }
    }

    /// First-fit run of `n` free blocks.
    fn find_run(&self, n: usize) -> Option<usize> {
        first_fit(&self.free, n)
    }

    /// Whether a run of `n` blocks would be free once every unpinned model
    /// that `may_evict` names were evicted.
    fn fits_evicting(&self, n: usize, may_evict: impl Fn(&Slot) -> bool) -> bool {
        let mut free = self.free.clone();
        for e in self.entries.values() {
            if e.pins == 0 && !e.doomed && may_evict(&e.slot) {
                free[e.slot.first_block..e.slot.first_block + e.slot.blocks].fill(true);
            }
        }
        first_fit(&free, n).is_some()
    }

    /// Takes the model out of the lookup table; frees its blocks now if no
    /// one holds it. Returns whether the blocks were freed.
    fn doom(&mut self, id: u64) -> bool {
        let Some(e) = self.entries.get_mut(&id) else {
            return false;
        };
        e.doomed = true;
        let name = e.slot.name.clone();
        let free_now = e.pins == 0;
        if self.by_name.get(&name) == Some(&id) {
            self.by_name.remove(&name);
        }
        if free_now {
            self.release_blocks(id);
        }
        free_now
    }
}

/// First-fit run of `n` free blocks in `free`.
fn first_fit(free: &[bool], n: usize) -> Option<usize> {
    let mut run = 0;
    for (b, &free) in free.iter().enumerate() {
        if free {
            run += 1;
            if run == n {
                return Some(b + 1 - n);
            }
        } else {
            run = 0;
        }
    }
    None
}

struct Inner {
    /// Declared before `buf`: the registration is undone before this
    /// `Inner`'s reference to the buffer goes (no upload is in flight by
    /// then: each holds a pin, which holds this `Inner`).
    _pinned: Option<Pinned>,
    buf: Arc<HostBuffer>,
    block_bytes: u64,
    blocks: usize,
    transport: Arc<dyn Transport>,
    region: RegionId,
    table: Mutex<Table>,
    /// Bytes read by completed fills.
    fetched_bytes: AtomicU64,
    /// Refills begun ([`HostCache::refill`]).
    refills: AtomicU64,
    /// What the server's devices hold (the eviction order reads it).
    device_uses: Arc<DeviceUses>,
}

impl Inner {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn capacity(&self) -> u64 {
        self.blocks as u64 * self.block_bytes
    }
}

/// The host block cache of one GPU server worker. Cheap to share by reference
/// between threads.
pub struct HostCache {
    inner: Arc<Inner>,
    /// Runs every fill; not in `Inner`, so that dropping the cache stops it
    /// while pins may still be held.
    engine: Engine,
}

impl HostCache {
    /// Maps, faults in, pins (when a hook is given) and registers the cache
    /// buffer with `transport`.
    pub fn new(config: CacheConfig, transport: Arc<dyn Transport>) -> Result<Self, CacheError> {
        if config.block_bytes < BLOCK_BYTES_MIN
            || !config.block_bytes.is_multiple_of(BLOCK_BYTES_MIN)
        {
            return Err(CacheError::Config(format!(
                "block size {} is not a positive multiple of {BLOCK_BYTES_MIN}",
                config.block_bytes
            )));
        }
        let blocks = config.capacity_bytes / config.block_bytes;
        if blocks == 0 {
            return Err(CacheError::Config(format!(
                "capacity {} is smaller than one block of {}",
                config.capacity_bytes, config.block_bytes
            )));
        }
        let len = usize::try_from(blocks * config.block_bytes).map_err(|_| {
            CacheError::Config(format!(
                "capacity {} does not fit this address space",
                config.capacity_bytes
            ))
        })?;
        let buf = Arc::new(HostBuffer::new(len, config.huge_pages)?);
        let pinned = match &config.pin {
            Some(pin) => Some(pin(&buf).map_err(CacheError::Pin)?),
            None => None,
        };
        let region = transport
            .register(buf.clone())
            .map_err(|source| CacheError::Register {
                transport: transport.name(),
                source,
            })?;
        let table = Table {
            free: vec![true; blocks as usize],
            ..Table::default()
        };
        log::info!(
            "host cache: {} bytes in {blocks} blocks of {} ({}), registered with {}",
            len,
            config.block_bytes,
            if buf.huge_pages() {
                "huge pages"
            } else {
                "normal pages"
            },
            transport.name()
        );
        let engine = match Engine::start(
            "host cache",
            transport.clone(),
            region,
            buf.clone(),
            config.thread_nice,
        ) {
            Ok(e) => e,
            Err(e) => {
                let _ = transport.deregister(region);
                return Err(CacheError::Config(format!(
                    "starting the fetch engine thread: {e}"
                )));
            }
        };
        Ok(HostCache {
            inner: Arc::new(Inner {
                _pinned: pinned,
                buf,
                block_bytes: config.block_bytes,
                blocks: blocks as usize,
                transport,
                region,
                table: Mutex::new(table),
                fetched_bytes: AtomicU64::new(0),
                refills: AtomicU64::new(0),
                device_uses: Arc::default(),
            }),
            engine,
        })
    }

    /// Where this server's devices report the models they hold
    /// ([`Residency::report_uses_to`](crate::device::Residency::report_uses_to)):
    /// the cache evicts those first (see the module's doc).
    pub fn device_uses(&self) -> &Arc<DeviceUses> {
        &self.inner.device_uses
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.inner.capacity()
    }

    pub fn block_bytes(&self) -> u64 {
        self.inner.block_bytes
    }

    pub fn blocks(&self) -> usize {
        self.inner.blocks
    }

    /// The cache buffer (for registering it elsewhere, e.g. with a GPU driver).
    pub fn buffer(&self) -> &Arc<HostBuffer> {
        &self.inner.buf
    }

    pub fn stats(&self) -> CacheStats {
        let t = self.inner.table();
        let used_blocks = t.free.iter().filter(|f| !**f).count() as u64;
        CacheStats {
            capacity_bytes: self.inner.capacity(),
            used_bytes: used_blocks * self.inner.block_bytes,
            models: t.by_name.len() as u64,
            hits: t.hits,
            misses: t.misses,
            evictions: t.evictions,
            fetched_bytes: self.inner.fetched_bytes.load(Ordering::Relaxed),
            refills: self.inner.refills.load(Ordering::Relaxed),
        }
    }

    /// The models whose every group is in the cache (fill complete), most
    /// recently used first, at most `limit` of them; `true` when more were
    /// left out. Pins nothing and counts no hit.
    pub fn complete_models(&self, limit: usize) -> (Vec<String>, bool) {
        // Slot locks are taken after the table lock is released.
        let slots: Vec<(u64, Arc<Slot>)> = {
            let t = self.inner.table();
            t.by_name
                .values()
                .map(|id| (t.entries[id].last_used, t.entries[id].slot.clone()))
                .collect()
        };
        let mut complete: Vec<(u64, String)> = slots
            .into_iter()
            .filter(|(_, slot)| slot.lock().state == FillState::Complete)
            .map(|(used, slot)| (used, slot.name.clone()))
            .collect();
        complete.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        let truncated = complete.len() > limit;
        complete.truncate(limit);
        (complete.into_iter().map(|(_, n)| n).collect(), truncated)
    }

    /// Whether `model` is in the cache (any state but failed), without
    /// pinning it or counting a hit.
    pub fn contains(&self, model: &str) -> bool {
        self.inner.table().by_name.contains_key(model)
    }

    /// Pins `model` if it is cached (complete or still filling); counts a hit
    /// or a miss.
    pub fn get(&self, model: &str) -> Option<CachedModel> {
        let mut t = self.inner.table();
        self.get_locked(&mut t, model)
    }

    fn get_locked(&self, t: &mut Table, model: &str) -> Option<CachedModel> {
        let Some(&id) = t.by_name.get(model) else {
            t.misses += 1;
            return None;
        };
        t.hits += 1;
        t.touch(id);
        let e = t.entries.get_mut(&id).expect("by_name points at an entry");
        e.pins += 1;
        // Someone waits for it now: a background refill goes at full speed.
        e.slot.background.store(false, Ordering::Relaxed);
        Some(CachedModel {
            slot: e.slot.clone(),
            cache: self.inner.clone(),
        })
    }

    /// Reserves a contiguous run of blocks for `model`, whose packed groups
    /// have the lengths `group_bytes` (in order), evicting LRU models not in
    /// use until a run fits. The model is `Reserved`: fill it with
    /// [`HostCache::fill`]. Fails if the name is cached already.
    pub fn reserve(&self, model: &str, group_bytes: &[u64]) -> Result<CachedModel, CacheError> {
        let mut t = self.inner.table();
        if t.by_name.contains_key(model) {
            return Err(CacheError::Exists(model.into()));
        }
        self.reserve_locked(&mut t, model, group_bytes, Evict::Any)
    }

    /// The model if cached ([`Lookup::Hit`]), otherwise a fresh reservation
    /// ([`Lookup::Miss`]) that the caller must fill; atomic, so two requests
    /// for the same model never both fetch it.
    pub fn lookup_or_reserve(
        &self,
        model: &str,
        group_bytes: &[u64],
    ) -> Result<(CachedModel, Lookup), CacheError> {
        let mut t = self.inner.table();
        if let Some(id) = t.by_name.get(model) {
            let slot = &t.entries[id].slot;
            if slot.groups.len() != group_bytes.len()
                || slot.groups.iter().zip(group_bytes).any(|(g, b)| g.1 != *b)
            {
                return Err(CacheError::Layout {
                    model: model.into(),
                    why: "the cached copy has another group layout than the request's; remove it first".into(),
                });
            }
        }
        // No handle may be dropped while `t` is held: dropping one locks the table.
        if let Some(m) = self.get_locked(&mut t, model) {
            return Ok((m, Lookup::Hit));
        }
        Ok((
            self.reserve_locked(&mut t, model, group_bytes, Evict::Any)?,
            Lookup::Miss,
        ))
    }

    fn reserve_locked(
        &self,
        t: &mut Table,
        model: &str,
        group_bytes: &[u64],
        evict: Evict,
    ) -> Result<CachedModel, CacheError> {
        let inner = &self.inner;
        let mut groups = Vec::with_capacity(group_bytes.len());
        let mut bytes = 0u64;
        for (g, &len) in group_bytes.iter().enumerate() {
            if len == 0 {
                return Err(CacheError::Layout {
                    model: model.into(),
                    why: format!("group {g} is empty"),
                });
            }
            groups.push((bytes, len));
            bytes += len;
        }
        if bytes == 0 {
            return Err(CacheError::Empty {
                model: model.into(),
            });
        }
        let n = bytes.div_ceil(inner.block_bytes);
        if n > inner.blocks as u64 {
            return Err(CacheError::TooBig {
                model: model.into(),
                bytes,
                blocks: n,
                block_bytes: inner.block_bytes,
                capacity: inner.capacity(),
            });
        }
        let n = n as usize;
        let uses = &inner.device_uses;
        if evict == Evict::KeptOnly
            && !t.fits_evicting(n, |s| uses.kept_on_device(&s.name).is_some())
        {
            return Err(CacheError::Full {
                model: model.into(),
                bytes,
                blocks: n as u64,
                capacity: inner.capacity(),
                used: t.free.iter().filter(|f| !**f).count() as u64 * inner.block_bytes,
                free_blocks: t.free.iter().filter(|f| **f).count() as u64,
                in_use: "(a refill evicts only copies of models a device keeps)".into(),
            });
        }
        let first = loop {
            if let Some(b) = t.find_run(n) {
                break b;
            }
            // Evict a model no one holds: one a device keeps first, the
            // most recently run there first, else the least recently used.
            let victim = t
                .entries
                .iter()
                .filter(|(_, e)| e.pins == 0 && !e.doomed)
                .map(|(id, e)| match uses.kept_on_device(&e.slot.name) {
                    Some(ran) => ((0, u64::MAX - ran), *id),
                    None => ((1, e.last_used), *id),
                })
                .filter(|((class, _), _)| evict == Evict::Any || *class == 0)
                .min()
                .map(|(_, id)| id);
            let Some(victim) = victim else {
                let mut in_use: Vec<String> = t
                    .entries
                    .values()
                    .map(|e| format!("{} ({} bytes)", e.slot.name, e.slot.bytes))
                    .collect();
                in_use.sort();
                let used_blocks = t.free.iter().filter(|f| !**f).count() as u64;
                return Err(CacheError::Full {
                    model: model.into(),
                    bytes,
                    blocks: n as u64,
                    capacity: inner.capacity(),
                    used: used_blocks * inner.block_bytes,
                    free_blocks: inner.blocks as u64 - used_blocks,
                    in_use: in_use.join(", "),
                });
            };
            log::debug!(
                "host cache: evicting {} to make room for {model}",
                t.entries[&victim].slot.name
            );
            t.doom(victim);
            t.evictions += 1;
        };
        for b in &mut t.free[first..first + n] {
            *b = false;
        }
        t.next_id += 1;
        t.tick += 1;
        let id = t.next_id;
        let slot = Arc::new(Slot {
            id,
            name: model.into(),
            base: first as u64 * inner.block_bytes,
            first_block: first,
            blocks: n,
            bytes,
            fill: Mutex::new(Fill {
                state: FillState::Reserved,
                ready: vec![None; groups.len()],
            }),
            groups,
            cv: Condvar::new(),
            background: Arc::new(AtomicBool::new(false)),
        });
        t.entries.insert(
            id,
            Entry {
                slot: slot.clone(),
                pins: 1,
                last_used: t.tick,
                doomed: false,
            },
        );
        t.by_name.insert(model.into(), id);
        Ok(CachedModel {
            slot,
            cache: inner.clone(),
        })
    }

    /// Fetches a freshly reserved model into its blocks. Each group is made
    /// visible (and waiters woken) as soon as it verified, then
    /// `on_group_ready(g)` runs. On failure every pending group fails with
    /// the reason and the model leaves the cache.
    ///
    /// Blocks until the fill is over; fills of different models from
    /// different threads run at once in the cache's fetch engine.
    pub fn fill(
        &self,
        model: &CachedModel,
        entry: &ModelEntry,
        opts: FetchOptions,
        on_group_ready: &mut dyn FnMut(usize),
    ) -> Result<FetchReport, CacheError> {
        let slot = &model.slot;
        if !Arc::ptr_eq(&model.cache, &self.inner) {
            return Err(CacheError::Config(format!(
                "model {} belongs to another host cache",
                slot.name
            )));
        }
        self.start_fill(model, entry)?;
        // One event per group and the outcome: the engine never waits on it.
        let (tx, rx) = channel::bounded(slot.groups.len() + 1);
        self.submit(model, entry, opts, None, tx)?;
        loop {
            match rx.recv() {
                Ok(FillEvent::Group(g)) => on_group_ready(g),
                Ok(FillEvent::Done(Ok(report))) => return Ok(report),
                Ok(FillEvent::Done(Err(source))) => {
                    return Err(CacheError::Fetch {
                        model: slot.name.clone(),
                        source,
                    })
                }
                Err(_) => {
                    // The sink went without an outcome: the engine died.
                    let source = FetchError::Aborted {
                        model: slot.name.clone(),
                        why: "the fetch engine stopped during the fill".into(),
                    };
                    fail_slot(&self.inner, slot, source.to_string());
                    return Err(CacheError::Fetch {
                        model: slot.name.clone(),
                        source,
                    });
                }
            }
        }
    }

    /// Fetches `entry`'s model into host memory in the background, when it
    /// is not there and room can be made without evicting anything but
    /// copies of models a device keeps past its next eviction (see the
    /// module's doc), and while no other fill runs (a request's, or another
    /// refill: one at a time, so that background work stays bounded). For a model
    /// a device just evicted: host memory then holds it in place of a model
    /// that device holds, and its next request uploads it from here instead
    /// of pulling it over the network. The fill's reads go after every
    /// waited-for fill's; a request that finds the model filling waits for
    /// its groups and lifts it to full speed. Returns whether a refill
    /// began, without waiting for its bytes.
    pub fn refill(&self, entry: &ModelEntry, opts: FetchOptions) -> Result<bool, CacheError> {
        // Fills under way: held reservations, a request's or another
        // refill's (slot locks are taken after the table lock is released).
        let slots: Vec<Arc<Slot>> = {
            let t = self.inner.table();
            t.entries
                .values()
                .filter(|e| e.pins > 0 && !e.doomed)
                .map(|e| e.slot.clone())
                .collect()
        };
        if slots
            .iter()
            .any(|s| matches!(s.lock().state, FillState::Reserved | FillState::Filling))
        {
            return Ok(false);
        }
        let group_bytes: Vec<u64> = entry.groups.iter().map(|g| g.bytes).collect();
        let model = {
            let mut t = self.inner.table();
            if t.by_name.contains_key(&entry.name) {
                return Ok(false);
            }
            let m = match self.reserve_locked(&mut t, &entry.name, &group_bytes, Evict::KeptOnly) {
                Ok(m) => m,
                Err(CacheError::Full { .. }) => return Ok(false),
                Err(e) => return Err(e),
            };
            // Under the table lock: a lookup that finds it clears it.
            m.slot.background.store(true, Ordering::Relaxed);
            m
        };
        let slot = &model.slot;
        self.start_fill(&model, entry)?;
        // No one listens: the sink's pin keeps the blocks until the fill
        // is over.
        let (tx, _) = channel::bounded(1);
        self.submit(&model, entry, opts, Some(slot.background.clone()), tx)?;
        self.inner.refills.fetch_add(1, Ordering::Relaxed);
        log::debug!("host cache: refilling {} in the background", entry.name);
        Ok(true)
    }

    /// Hands a filling model's fetch to the engine; its sink pins the model
    /// until the fetch is over and tells `events` of it. A fetch the engine
    /// does not take fails the model.
    fn submit(
        &self,
        model: &CachedModel,
        entry: &ModelEntry,
        opts: FetchOptions,
        background: Option<Arc<AtomicBool>>,
        events: channel::Sender<FillEvent>,
    ) -> Result<(), CacheError> {
        let slot = &model.slot;
        let sink = FillSink {
            model: Some(model.clone()),
            events,
        };
        self.engine
            .submit(entry, slot.base, opts, background, Box::new(sink))
            .map_err(|source| {
                fail_slot(&self.inner, slot, source.to_string());
                CacheError::Fetch {
                    model: slot.name.clone(),
                    source,
                }
            })
    }

    /// Checks a reservation against its catalog entry and marks it
    /// filling; a mismatch fails the reservation.
    fn start_fill(&self, model: &CachedModel, entry: &ModelEntry) -> Result<(), CacheError> {
        let slot = &model.slot;
        {
            let mut f = slot.lock();
            if f.state != FillState::Reserved {
                return Err(CacheError::NotReserved {
                    model: slot.name.clone(),
                    state: f.state.name(),
                });
            }
            if entry.name != slot.name
                || entry.groups.len() != slot.groups.len()
                || entry
                    .groups
                    .iter()
                    .zip(&slot.groups)
                    .any(|(g, s)| g.bytes != s.1)
            {
                let why = format!(
                    "catalog entry {} ({} groups) does not match the reservation ({} groups)",
                    entry.name,
                    entry.groups.len(),
                    slot.groups.len()
                );
                f.state = FillState::Failed(why.clone());
                drop(f);
                self.inner.table().doom(slot.id);
                return Err(CacheError::Layout {
                    model: slot.name.clone(),
                    why,
                });
            }
            f.state = FillState::Filling;
        }
        Ok(())
    }

    /// Cache-out: the model leaves the lookup table now; its blocks are freed
    /// now if no one holds it, else when the last [`CachedModel`] is dropped.
    /// Returns `None` if it was not cached, `Some(true)` if freed now.
    pub fn remove(&self, model: &str) -> Option<bool> {
        let mut t = self.inner.table();
        let id = *t.by_name.get(model)?;
        Some(t.doom(id))
    }
}

impl Drop for HostCache {
    fn drop(&mut self) {
        // No fill runs (they borrow the cache); the engine waits for the
        // reads of fills it still holds (failed or stalled ones) to complete.
        if !self.engine.shutdown() {
            log::error!("host cache: reads still in flight; its buffer stays registered");
            return;
        }
        if let Err(e) = self.inner.transport.deregister(self.inner.region) {
            log::warn!("host cache: deregistering its buffer: {e}");
        }
    }
}

/// What a fill hears from the engine.
enum FillEvent {
    Group(usize),
    Done(Result<FetchReport, FetchError>),
}

/// A fill's end of an engine job, run on the engine thread: makes groups
/// visible and settles the model's state as soon as the engine knows, then
/// tells the filling thread. Its pin keeps the model's blocks from reuse
/// until the job's last read completed.
/// What a reservation may evict to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evict {
    /// Any model no one holds (the module's order).
    Any,
    /// Only copies of models a device keeps past its next eviction.
    KeptOnly,
}

struct FillSink {
    model: Option<CachedModel>,
    events: channel::Sender<FillEvent>,
}

impl JobSink for FillSink {
    fn group_ready(&mut self, group: usize) {
        let Some(model) = &self.model else { return };
        let slot = &model.slot;
        slot.lock().ready[group] = Some(Instant::now());
        slot.cv.notify_all();
        // Bounded by one event per group and the outcome: never full.
        let _ = self.events.try_send(FillEvent::Group(group));
    }

    fn finished(&mut self, result: Result<FetchReport, FetchError>, settled: bool) {
        let Some(model) = &self.model else { return };
        let slot = &model.slot;
        match &result {
            Ok(report) => {
                model
                    .cache
                    .fetched_bytes
                    .fetch_add(report.bytes, Ordering::Relaxed);
                slot.lock().state = FillState::Complete;
                slot.cv.notify_all();
            }
            Err(e) => fail_slot(&model.cache, slot, e.to_string()),
        }
        if settled {
            // Unpinned before the filler hears of it: a failed model's
            // blocks are free once its fill returned and its pins dropped.
            self.model = None;
        }
        let _ = self.events.try_send(FillEvent::Done(result));
    }
}

/// A failed fill: every pending group fails with `why` (waiters are woken)
/// and the model leaves the lookup table.
fn fail_slot(inner: &Inner, slot: &Slot, why: String) {
    slot.lock().state = FillState::Failed(why);
    slot.cv.notify_all();
    inner.table().doom(slot.id);
}

/// A pinned cached model: its blocks stay put while this handle lives.
/// Clones pin again.
pub struct CachedModel {
    slot: Arc<Slot>,
    cache: Arc<Inner>,
}

impl CachedModel {
    pub fn name(&self) -> &str {
        &self.slot.name
    }

    /// Packed bytes of the model.
    pub fn bytes(&self) -> u64 {
        self.slot.bytes
    }

    pub fn groups(&self) -> usize {
        self.slot.groups.len()
    }

    /// Offset of the model's first block in the cache buffer.
    pub fn base(&self) -> u64 {
        self.slot.base
    }

    /// Blocks held (`first`, `count`).
    pub fn blocks(&self) -> (usize, usize) {
        (self.slot.first_block, self.slot.blocks)
    }

    pub fn state(&self) -> FillState {
        self.slot.lock().state.clone()
    }

    pub fn is_complete(&self) -> bool {
        self.slot.lock().state == FillState::Complete
    }

    /// When group `g` became visible, if it has.
    pub fn ready_at(&self, g: usize) -> Option<Instant> {
        self.slot.lock().ready.get(g).copied().flatten()
    }

    /// Group `g`'s bytes, only once all its slices arrived and verified.
    pub fn group(&self, g: usize) -> Option<&[u8]> {
        let (start, len) = *self.slot.groups.get(g)?;
        self.slot.lock().ready[g]?;
        let start = (self.slot.base + start) as usize;
        // SAFETY: the group is ready, so every read into its range completed
        // and no one writes it again while a pin (this handle) keeps the
        // model's blocks from being reused.
        #[allow(unsafe_code)]
        let bytes = unsafe { self.cache.buf.slice(start..start + len as usize) };
        Some(bytes)
    }

    /// Blocks until group `g` is visible; fails at once if the fill failed,
    /// and after `timeout` otherwise.
    pub fn wait_group(&self, g: usize, timeout: Duration) -> Result<&[u8], CacheError> {
        let err = |why: String| CacheError::Group {
            model: self.slot.name.clone(),
            group: g,
            why,
        };
        if g >= self.slot.groups.len() {
            return Err(err(format!(
                "the model has {} groups",
                self.slot.groups.len()
            )));
        }
        let deadline = Instant::now() + timeout;
        let mut f = self.slot.lock();
        loop {
            if f.ready[g].is_some() {
                break;
            }
            match &f.state {
                FillState::Failed(why) => return Err(err(format!("fetch failed: {why}"))),
                FillState::Complete => return Err(err("fill completed without this group".into())),
                FillState::Reserved | FillState::Filling => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(err(format!(
                    "not in host memory after {timeout:?} (model is {})",
                    f.state.name()
                )));
            }
            f = self
                .slot
                .cv
                .wait_timeout(f, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(f);
        Ok(self.group(g).expect("the group is ready"))
    }
}

impl Clone for CachedModel {
    fn clone(&self) -> Self {
        let mut t = self.cache.table();
        if let Some(e) = t.entries.get_mut(&self.slot.id) {
            e.pins += 1;
        }
        drop(t);
        CachedModel {
            slot: self.slot.clone(),
            cache: self.cache.clone(),
        }
    }
}

impl Drop for CachedModel {
    fn drop(&mut self) {
        let mut t = self.cache.table();
        let id = self.slot.id;
        let Some(e) = t.entries.get_mut(&id) else {
            return;
        };
        e.pins -= 1;
        let release = e.pins == 0 && e.doomed;
        if release {
            t.release_blocks(id);
        } else {
            t.touch(id);
        }
    }
}

impl std::fmt::Debug for CachedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedModel")
            .field("name", &self.slot.name)
            .field("bytes", &self.slot.bytes)
            .field("blocks", &(self.slot.first_block, self.slot.blocks))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use distmind_common::checksum::{checksum, to_hex};
    use distmind_common::proto::{GroupLocation, Location, Slice};
    use distmind_transport::{MemFabric, MemTransport};

    use super::*;

    const BLOCK: u64 = 4096;

    fn cache(blocks: u64) -> (HostCache, MemFabric) {
        let fabric = MemFabric::new();
        let t: Arc<dyn Transport> = Arc::new(MemTransport::new(fabric.clone()));
        (
            HostCache::new(CacheConfig::new(blocks * BLOCK, BLOCK), t).unwrap(),
            fabric,
        )
    }

    /// A model of `groups` groups of `len` bytes on peer "ms0" (and "ms1").
    fn model(fabric: &MemFabric, name: &str, groups: usize, len: usize) -> (ModelEntry, Vec<u8>) {
        let bytes: Vec<u8> = (0..groups * len).map(|i| (i * 7 % 253) as u8).collect();
        for peer in ["ms0", "ms1"] {
            let mut b = HostBuffer::new(bytes.len(), HugePages::No).unwrap();
            b.as_mut_slice().copy_from_slice(&bytes);
            fabric.add_peer(peer, Arc::new(b));
        }
        let entry = ModelEntry {
            name: name.into(),
            family: "test".into(),
            total_bytes: bytes.len() as u64,
            strategy: "hybrid".into(),
            replication: 2,
            version: 0,
            groups: (0..groups)
                .map(|g| {
                    let range = g * len..(g + 1) * len;
                    GroupLocation {
                        index: g as u32,
                        bytes: len as u64,
                        checksum: to_hex(checksum(&bytes[range.clone()])),
                        slices: vec![Slice {
                            group_offset: 0,
                            len: len as u64,
                            checksum: to_hex(checksum(&bytes[range])),
                            replicas: ["ms0", "ms1"]
                                .iter()
                                .enumerate()
                                .map(|(i, a)| Location {
                                    memserver: i as u32,
                                    addr: a.to_string(),
                                    offset: (g * len) as u64,
                                })
                                .collect(),
                        }],
                    }
                })
                .collect(),
            manifest: serde_json::Value::Null,
        };
        (entry, bytes)
    }

    #[test]
    fn cache_reserve_is_first_fit_and_contiguous() {
        let (c, _) = cache(8);
        let a = c.reserve("a", &[BLOCK, 100]).unwrap();
        let b = c.reserve("b", &[3 * BLOCK]).unwrap();
        assert_eq!(a.blocks(), (0, 2));
        assert_eq!(b.blocks(), (2, 3));
        assert_eq!(b.base(), 2 * BLOCK);
        assert!(matches!(c.reserve("a", &[1]), Err(CacheError::Exists(_))));
        let s = c.stats();
        assert_eq!(
            (s.capacity_bytes, s.used_bytes, s.models),
            (8 * BLOCK, 5 * BLOCK, 2)
        );
        drop(a);
        // Still cached (complete or not) until evicted or removed.
        assert_eq!(c.stats().used_bytes, 5 * BLOCK);
        assert_eq!(c.remove("a"), Some(true));
        assert_eq!(c.remove("a"), None);
        // The hole left by "a" is reused first.
        let d = c.reserve("d", &[10]).unwrap();
        assert_eq!(d.blocks(), (0, 1));
    }

    #[test]
    fn cache_evicts_lru_models_not_in_use() {
        let (c, _) = cache(4);
        drop(c.reserve("a", &[BLOCK]).unwrap());
        drop(c.reserve("b", &[BLOCK]).unwrap());
        drop(c.reserve("c", &[2 * BLOCK]).unwrap());
        // Touch "a": "b" becomes the least recently used.
        drop(c.get("a").unwrap());
        let d = c.reserve("d", &[BLOCK]).unwrap();
        assert_eq!(d.blocks(), (1, 1), "b's block");
        assert!(!c.contains("b") && c.contains("a") && c.contains("c"));
        assert_eq!(c.stats().evictions, 1);
        // Touch "c": "a" is the LRU now. "e" needs 2 contiguous blocks; "a"'s
        // block 0 is not enough next to "d" (pinned), so "c" goes as well.
        drop(c.get("c").unwrap());
        let e = c.reserve("e", &[2 * BLOCK]).unwrap();
        assert_eq!(e.blocks(), (2, 2));
        assert!(c.contains("d") && c.contains("e") && !c.contains("a") && !c.contains("c"));
        assert_eq!(c.stats().evictions, 3);
    }

    #[test]
    fn cache_evicts_what_a_device_keeps_first_the_most_recently_run_first() {
        let (c, _) = cache(4);
        for m in ["a", "b", "c", "d"] {
            drop(c.reserve(m, &[BLOCK]).unwrap());
        }
        // Device 0 ran "x", then "b" and "c" ("c" last): it keeps both past
        // its next eviction (of "x"). "a" is the host's LRU.
        let uses = c.device_uses();
        for m in ["x", "b", "c"] {
            uses.used(m, 0);
        }
        drop(c.reserve("e", &[BLOCK]).unwrap());
        assert!(
            !c.contains("c"),
            "the model that ran on a device last goes first"
        );
        drop(c.reserve("f", &[BLOCK]).unwrap());
        assert!(!c.contains("b") && c.contains("a") && c.contains("d"));
        // Off its device, "b" is worth a host copy again. Device 1 holds
        // "d" alone: it gives "d" up at its next load, so "d" counts as on
        // no device, and plain LRU takes "a" before "d".
        uses.left("b", 0);
        uses.used("d", 1);
        drop(c.reserve("b", &[BLOCK]).unwrap());
        assert!(!c.contains("a") && c.contains("d") && c.contains("b"));
        assert_eq!(c.stats().evictions, 3);
    }

    #[test]
    fn refill_takes_only_the_place_of_what_a_device_keeps_and_waits_for_waited_fills() {
        let (c, fabric) = cache(3);
        let fill = |name: &str| {
            let (entry, _) = model(&fabric, name, 1, BLOCK as usize);
            let m = c.reserve(name, &[BLOCK]).unwrap();
            c.fill(&m, &entry, FetchOptions::default(), &mut |_| {})
                .unwrap();
        };
        for m in ["a", "b", "c"] {
            fill(m);
        }
        // Device 0 ran "x" then "b": it keeps "b" past its next eviction.
        let uses = c.device_uses();
        uses.used("x", 0);
        uses.used("b", 0);
        let (d, bytes) = model(&fabric, "d", 1, BLOCK as usize);
        assert!(c.refill(&d, FetchOptions::default()).unwrap());
        assert!(!c.contains("b") && c.contains("a") && c.contains("c"));
        let got = c.get("d").expect("being refilled");
        assert!(
            !got.slot.background.load(Ordering::Relaxed),
            "a lookup lifts a refill to full speed"
        );
        assert_eq!(
            got.wait_group(0, Duration::from_secs(30)).unwrap(),
            &bytes[..]
        );
        // Its group is visible a moment before the fill is over.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !got.is_complete() {
            assert!(Instant::now() < deadline, "the refill never completed");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(got);
        let s = c.stats();
        assert_eq!((s.refills, s.evictions, s.models), (1, 1, 3));
        // No host copy of a kept model left: "e" would take a model no
        // device holds, so it is not refilled, and nothing is evicted.
        let (e, _) = model(&fabric, "e", 1, BLOCK as usize);
        assert!(!c.refill(&e, FetchOptions::default()).unwrap());
        assert!(c.contains("a") && c.contains("c") && c.contains("d"));
        // Already here: nothing to do.
        assert!(!c.refill(&d, FetchOptions::default()).unwrap());
        // While a fill someone waits for is reserved, none begins.
        uses.used("c", 0);
        let waited = c.reserve("f", &[BLOCK]).unwrap();
        assert!(!c.contains("c"), "the reservation took the kept copy");
        uses.used("a", 0);
        assert!(!c.refill(&e, FetchOptions::default()).unwrap());
        assert!(c.contains("a"));
        drop(waited);
        assert!(c.refill(&e, FetchOptions::default()).unwrap());
        assert!(!c.contains("a") && c.contains("e"));
        assert_eq!(c.stats().refills, 2);
    }

    #[test]
    fn cache_never_evicts_models_in_use_and_names_sizes() {
        let (c, _) = cache(4);
        let _a = c.reserve("a", &[2 * BLOCK]).unwrap();
        let b = c.reserve("b", &[BLOCK]).unwrap();
        let e = c.reserve("c", &[3 * BLOCK]).unwrap_err().to_string();
        assert!(
            e.contains("c needs 3 contiguous blocks") && e.contains("a (8192 bytes)"),
            "{e}"
        );
        // A second pin keeps "b" after the first one is gone.
        let b2 = b.clone();
        drop(b);
        assert!(c.reserve("c", &[2 * BLOCK]).is_err());
        drop(b2);
        let c3 = c.reserve("c", &[2 * BLOCK]).unwrap();
        assert_eq!(c3.blocks(), (2, 2));
        let e = c.reserve("huge", &[5 * BLOCK]).unwrap_err().to_string();
        assert!(
            e.contains("larger than the whole host cache (16384 bytes)"),
            "{e}"
        );
        assert!(matches!(c.reserve("z", &[]), Err(CacheError::Empty { .. })));
    }

    #[test]
    fn cache_remove_while_pinned_frees_on_last_drop() {
        let (c, _) = cache(2);
        let a = c.reserve("a", &[2 * BLOCK]).unwrap();
        assert_eq!(c.remove("a"), Some(false));
        assert!(!c.contains("a") && c.get("a").is_none());
        assert_eq!(c.stats().used_bytes, 2 * BLOCK, "still pinned");
        assert!(c.reserve("b", &[BLOCK]).is_err());
        drop(a);
        assert_eq!(c.stats().used_bytes, 0);
        c.reserve("b", &[BLOCK]).unwrap();
        let s = c.stats();
        assert_eq!((s.hits, s.misses), (0, 1), "reserve alone counts nothing");
    }

    #[test]
    fn cache_fill_makes_groups_visible_only_when_verified() {
        let (c, fabric) = cache(16);
        let (entry, bytes) = model(&fabric, "m", 3, 5000);
        let (m, hit) = c.lookup_or_reserve("m", &[5000; 3]).unwrap();
        assert_eq!(hit, Lookup::Miss);
        assert!(m.group(0).is_none(), "nothing visible before the fill");
        assert!(m
            .wait_group(0, Duration::from_millis(10))
            .unwrap_err()
            .to_string()
            .contains("not in host memory"));
        let mut seen = Vec::new();
        let mut visible_at_callback = Vec::new();
        let report = c
            .fill(&m, &entry, FetchOptions::default(), &mut |g| {
                seen.push(g);
                visible_at_callback.push(m.group(g).is_some());
            })
            .unwrap();
        assert_eq!(report.bytes, 15000);
        assert_eq!(c.stats().fetched_bytes, 15000);
        assert_eq!(seen.len(), 3);
        assert!(visible_at_callback.iter().all(|v| *v));
        assert!(m.is_complete());
        for g in 0..3 {
            assert_eq!(m.group(g).unwrap(), &bytes[g * 5000..(g + 1) * 5000]);
        }
        assert!(matches!(
            c.fill(&m, &entry, FetchOptions::default(), &mut |_| {}),
            Err(CacheError::NotReserved { .. })
        ));
        let (again, hit) = c.lookup_or_reserve("m", &[5000; 3]).unwrap();
        assert_eq!(hit, Lookup::Hit);
        assert_eq!(
            again.wait_group(2, Duration::ZERO).unwrap(),
            &bytes[10000..]
        );
        assert!(
            c.lookup_or_reserve("m", &[15000]).is_err(),
            "another layout"
        );
    }

    #[test]
    fn complete_models_lists_filled_models_most_recent_first_and_bounded() {
        let (c, fabric) = cache(16);
        let (ea, _) = model(&fabric, "a", 1, 100);
        let (eb, _) = model(&fabric, "b", 1, 100);
        for e in [&ea, &eb] {
            let (m, _) = c.lookup_or_reserve(&e.name, &[100]).unwrap();
            c.fill(&m, e, FetchOptions::default(), &mut |_| {}).unwrap();
        }
        // Reserved, never filled: not complete, not listed.
        let _pending = c.reserve("pending", &[100]).unwrap();
        assert_eq!(c.complete_models(10), (vec!["b".into(), "a".into()], false));
        drop(c.get("a").unwrap());
        assert_eq!(c.complete_models(10).0, ["a", "b"]);
        assert_eq!(c.complete_models(1), (vec!["a".into()], true));
        assert_eq!(c.complete_models(0), (Vec::<String>::new(), true));
    }

    #[test]
    fn cache_failed_fill_wakes_waiters_and_leaves_the_cache() {
        let (c, fabric) = cache(16);
        let (entry, _) = model(&fabric, "m", 2, 5000);
        fabric.fail_peer("ms0");
        fabric.fail_peer("ms1");
        let m = c.reserve("m", &[5000; 2]).unwrap();
        let waiter = m.clone();
        let e = std::thread::scope(|s| {
            let h = s.spawn(move || waiter.wait_group(1, Duration::from_secs(30)).map(|_| ()));
            std::thread::sleep(Duration::from_millis(20));
            let e = c
                .fill(&m, &entry, FetchOptions::default(), &mut |_| {})
                .unwrap_err();
            assert!(e.to_string().contains("every replica failed"), "{e}");
            h.join().unwrap().unwrap_err()
        });
        assert!(
            e.to_string().contains("group 1") && e.to_string().contains("fetch failed"),
            "{e}"
        );
        assert!(matches!(m.state(), FillState::Failed(_)));
        assert!(!c.contains("m"), "a failed model is not found again");
        drop(m);
        assert_eq!(c.stats().used_bytes, 0);
        fabric.heal_peer("ms0");
        let (m, hit) = c.lookup_or_reserve("m", &[5000; 2]).unwrap();
        assert_eq!(hit, Lookup::Miss);
        c.fill(&m, &entry, FetchOptions::default(), &mut |_| {})
            .unwrap();
    }

    #[test]
    fn cache_fills_of_different_models_from_different_threads_run_at_once() {
        let (c, fabric) = cache(64);
        // Both models in one arena per peer, "b" after "a".
        let (ea, a) = model(&fabric, "a", 6, 4096);
        let (mut eb, _) = model(&fabric, "b", 6, 4096);
        let mut arena = a.clone();
        let b: Vec<u8> = (0..a.len()).map(|i| (i * 3 % 241) as u8).collect();
        arena.extend_from_slice(&b);
        for peer in ["ms0", "ms1"] {
            let mut buf = HostBuffer::new(arena.len(), HugePages::No).unwrap();
            buf.as_mut_slice().copy_from_slice(&arena);
            fabric.add_peer(peer, Arc::new(buf));
        }
        for (g, group) in eb.groups.iter_mut().enumerate() {
            let sum = to_hex(checksum(&b[g * 4096..(g + 1) * 4096]));
            group.checksum = sum.clone();
            group.slices[0].checksum = sum;
            for r in &mut group.slices[0].replicas {
                r.offset += a.len() as u64;
            }
        }
        let ma = c.reserve("a", &[4096; 6]).unwrap();
        let mb = c.reserve("b", &[4096; 6]).unwrap();
        // Each fill waits in its callback for the other's first group: with
        // fills one at a time this would deadlock (and time out).
        let (ga, gb) = (ma.clone(), mb.clone());
        std::thread::scope(|s| {
            let fa = s.spawn(|| {
                c.fill(&ma, &ea, FetchOptions::default(), &mut |g| {
                    if g == 0 {
                        gb.wait_group(0, Duration::from_secs(10)).unwrap();
                    }
                })
            });
            let fb = s.spawn(|| {
                c.fill(&mb, &eb, FetchOptions::default(), &mut |g| {
                    if g == 0 {
                        ga.wait_group(0, Duration::from_secs(10)).unwrap();
                    }
                })
            });
            fa.join().unwrap().unwrap();
            fb.join().unwrap().unwrap();
        });
        for g in 0..6 {
            assert_eq!(ma.group(g).unwrap(), &a[g * 4096..(g + 1) * 4096]);
            assert_eq!(mb.group(g).unwrap(), &b[g * 4096..(g + 1) * 4096]);
        }
        assert_eq!(c.stats().fetched_bytes, 2 * 6 * 4096);
        let buf = c.buffer().clone();
        drop((ma, mb, ga, gb));
        drop(c);
        assert_eq!(
            Arc::strong_count(&buf),
            1,
            "the engine stopped and the transport let go of the buffer"
        );
    }

    #[test]
    fn the_fetch_engine_runs_at_the_configured_nice_value() {
        let t: Arc<dyn Transport> = Arc::new(MemTransport::new(MemFabric::new()));
        let config = CacheConfig::new(4 * BLOCK, BLOCK).niced_for(crate::exec::ExecutorKind::Cpu);
        let nice = crate::exec::ExecutorKind::Cpu.data_thread_nice();
        assert!(nice > 0);
        assert_eq!(
            CacheConfig::new(4 * BLOCK, BLOCK)
                .niced_for(crate::exec::ExecutorKind::Sim)
                .thread_nice,
            0,
            "a device that does not compute on host cores leaves the priority alone"
        );
        let _cache = HostCache::new(config, t).unwrap();
        // Other tests' engines run at the process's own value: this one is
        // the thread with the configured value, once it started.
        let want = nice.max(distmind_transport::priority::current_thread_nice());
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut found = Vec::new();
        while !found.contains(&want) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            found = distmind_transport::priority::threads_nice("fetch host");
        }
        assert!(
            found.contains(&want),
            "engine threads' nice values: {found:?}"
        );
    }

    #[test]
    fn cache_rejects_bad_configs() {
        let t: Arc<dyn Transport> = Arc::new(MemTransport::new(MemFabric::new()));
        assert!(HostCache::new(CacheConfig::new(100, 4096), t.clone()).is_err());
        assert!(HostCache::new(CacheConfig::new(1 << 20, 1000), t.clone()).is_err());
        let c = HostCache::new(
            CacheConfig::new(10 * BLOCK_BYTES_ORIGINAL, BLOCK_BYTES_ORIGINAL),
            t,
        )
        .unwrap();
        assert_eq!(c.blocks(), 10);
    }
}
