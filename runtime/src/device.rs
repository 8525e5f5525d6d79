//! Device residency: which models have a parameter arena (and a compiled
//! program) on one device, with LRU eviction of arenas when the device's
//! budget for parameters is full. Several models may be resident at once
//! (beyond the original's one).
//!
//! A [`Residency`] also holds the device's [`StageThreads`], the long-lived
//! threads that fetch and upload its models (see [`crate::pipeline`]).
//!
//! A [`Resident`] handle pins a model: while one lives, its arena is neither
//! evicted nor freed. A resident model carries its [`GroupGates`]: a request
//! that finds a model still being uploaded by another request simply waits
//! on the same gates.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::exec::{Arena, ExecError, Program};
use crate::pipeline::{GroupGates, StageThreads};

/// Default number of models resident on one device at once (the `mps`
/// baseline of the evaluation keeps up to 12 per GPU).
pub const RESIDENT_MODELS_MAX_DEFAULT: usize = 12;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    #[error("model {model} needs a {bytes}-byte arena, more than the device's whole parameter budget of {capacity} bytes")]
    TooBig {
        model: String,
        bytes: u64,
        capacity: u64,
    },
    #[error("model {model} needs a {bytes}-byte arena but the device ({capacity} bytes, {used} used, at most {max_models} models) holds only models in use: {in_use}")]
    Full {
        model: String,
        bytes: u64,
        capacity: u64,
        used: u64,
        max_models: usize,
        in_use: String,
    },
    #[error("making model {model} resident: {source}")]
    Exec {
        model: String,
        source: Box<ExecError>,
    },
}

/// A model's arena, program and upload gates on one device.
pub struct ResidentModel {
    name: String,
    bytes: u64,
    arena: Arc<dyn Arena>,
    program: Mutex<Box<dyn Program>>,
    gates: GroupGates,
}

impl ResidentModel {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn arena(&self) -> &Arc<dyn Arena> {
        &self.arena
    }

    /// The compiled program; one request runs it at a time.
    pub fn program(&self) -> MutexGuard<'_, Box<dyn Program>> {
        self.program.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Per-group upload state: all open once the model is fully uploaded.
    pub fn gates(&self) -> &GroupGates {
        &self.gates
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResidencyStats {
    pub capacity_bytes: u64,
    /// Bytes of arenas alive (including evicted ones still in use).
    pub used_bytes: u64,
    pub models: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

struct Entry {
    model: Arc<ResidentModel>,
    pins: usize,
    last_used: u64,
    doomed: bool,
}

#[derive(Default)]
struct Table {
    entries: HashMap<u64, Entry>,
    by_name: HashMap<String, u64>,
    used_bytes: u64,
    next_id: u64,
    tick: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl Table {
    fn doom(&mut self, id: u64) -> bool {
        let Some(e) = self.entries.get_mut(&id) else {
            return false;
        };
        e.doomed = true;
        let name = e.model.name.clone();
        let free_now = e.pins == 0;
        if self.by_name.get(&name) == Some(&id) {
            self.by_name.remove(&name);
        }
        if free_now {
            self.release(id);
        }
        free_now
    }

    fn release(&mut self, id: u64) {
        if let Some(e) = self.entries.remove(&id) {
            self.used_bytes -= e.model.bytes;
        }
    }
}

struct Inner {
    capacity_bytes: u64,
    max_models: usize,
    table: Mutex<Table>,
    /// The device's ordinal, as [`DeviceUses`] records it.
    ordinal: u32,
    uses: OnceLock<Arc<DeviceUses>>,
    /// Told the name of each model evicted to make room for another.
    on_evict: OnceLock<EvictHook>,
}

/// What [`Residency::on_evict`] calls.
pub type EvictHook = Box<dyn Fn(&str) + Send + Sync>;

impl Inner {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn used(&self, model: &str) {
        if let Some(u) = self.uses.get() {
            u.used(model, self.ordinal);
        }
    }

    /// [`Table::doom`], reported to the [`DeviceUses`].
    fn doom(&self, t: &mut Table, id: u64) -> bool {
        if let (Some(u), Some(e)) = (self.uses.get(), t.entries.get(&id)) {
            if !e.doomed {
                u.left(&e.model.name, self.ordinal);
            }
        }
        t.doom(id)
    }
}

/// Which models the devices of one GPU server hold, and in what order they
/// last ran there: the host cache's eviction rule reads it
/// ([`crate::cache`]: a model a device will keep past its next eviction is
/// evicted from host memory before the others). Each device's [`Residency`]
/// reports to it (see [`Residency::report_uses_to`]). Bounded by the models
/// resident on the server's devices: a model leaves when no device holds it.
#[derive(Debug, Default)]
pub struct DeviceUses(Mutex<UsesTable>);

#[derive(Debug, Default)]
struct UsesTable {
    tick: u64,
    /// Per model, the devices that hold it and when it last ran on each.
    models: HashMap<String, Vec<(u32, u64)>>,
    /// Per device, its models by when they last ran there (oldest first).
    devices: HashMap<u32, BTreeMap<u64, String>>,
}

impl UsesTable {
    fn forget(&mut self, model: &str, device: u32) {
        let Some(on) = self.models.get_mut(model) else {
            return;
        };
        if let Some(i) = on.iter().position(|&(d, _)| d == device) {
            let (_, tick) = on.swap_remove(i);
            if let Some(order) = self.devices.get_mut(&device) {
                order.remove(&tick);
                if order.is_empty() {
                    self.devices.remove(&device);
                }
            }
        }
        if on.is_empty() {
            self.models.remove(model);
        }
    }
}

impl DeviceUses {
    fn table(&self) -> MutexGuard<'_, UsesTable> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `model` was loaded onto, or ran on, `device`. Called twice per
    /// request (when it takes the model and when it lets go): a model
    /// already on the device only moves in the device's order, with no
    /// allocation.
    pub fn used(&self, model: &str, device: u32) {
        let mut t = self.table();
        t.tick += 1;
        let tick = t.tick;
        let UsesTable {
            models, devices, ..
        } = &mut *t;
        let order = devices.entry(device).or_default();
        if let Some(on) = models.get_mut(model) {
            if let Some(at) = on.iter_mut().find(|(d, _)| *d == device) {
                let name = order.remove(&at.1).unwrap_or_else(|| model.to_string());
                order.insert(tick, name);
                at.1 = tick;
                return;
            }
            on.push((device, tick));
        } else {
            models.insert(model.to_string(), vec![(device, tick)]);
        }
        order.insert(tick, model.to_string());
    }

    /// `device` no longer holds `model` (evicted or discarded).
    pub fn left(&self, model: &str, device: u32) {
        self.table().forget(model, device);
    }

    /// When `model` last ran on a device of this server that will keep it
    /// past that device's next eviction (one where another model ran less
    /// recently; a device evicts its least recently used model first), a
    /// larger value more recent; `None` when no device holds it so. A device
    /// of one model, or a model its device used least recently, is about to
    /// lose it: its host copy is worth keeping.
    pub fn kept_on_device(&self, model: &str) -> Option<u64> {
        let t = self.table();
        t.models
            .get(model)?
            .iter()
            .filter(|&&(d, tick)| {
                t.devices
                    .get(&d)
                    .and_then(|order| order.keys().next())
                    .is_some_and(|&oldest| oldest < tick)
            })
            .map(|&(_, tick)| tick)
            .max()
    }

    /// Models some device holds.
    pub fn len(&self) -> usize {
        self.table().models.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The resident models of one device, and its stage threads.
pub struct Residency {
    inner: Arc<Inner>,
    stages: StageThreads,
}

impl Residency {
    /// `capacity_bytes`: device memory for parameter arenas; at most
    /// `max_models` resident at once (at least 1). Starts the device's
    /// stage threads (named after no device: see [`Residency::for_device`]).
    pub fn new(capacity_bytes: u64, max_models: usize) -> Self {
        Residency::named("device", 0, capacity_bytes, max_models, 0)
    }

    /// [`Residency::new`] for device `ordinal`, whose stage threads are
    /// named `device {ordinal} stage {i}`.
    /// Its stage threads run at nice value `stage_nice` (0: the process's
    /// own; see [`distmind_transport::priority`]).
    pub fn for_device(
        ordinal: u32,
        capacity_bytes: u64,
        max_models: usize,
        stage_nice: i32,
    ) -> Self {
        Residency::named(
            &format!("device {ordinal}"),
            ordinal,
            capacity_bytes,
            max_models,
            stage_nice,
        )
    }

    fn named(
        name: &str,
        ordinal: u32,
        capacity_bytes: u64,
        max_models: usize,
        stage_nice: i32,
    ) -> Self {
        Residency {
            inner: Arc::new(Inner {
                capacity_bytes,
                max_models: max_models.max(1),
                table: Mutex::new(Table::default()),
                ordinal,
                uses: OnceLock::new(),
                on_evict: OnceLock::new(),
            }),
            stages: StageThreads::new(name, stage_nice),
        }
    }

    /// Reports every load, run and eviction on this device to `uses` (the
    /// host cache's, [`HostCache::device_uses`](crate::cache::HostCache::device_uses)),
    /// from now on; a second call changes nothing.
    pub fn report_uses_to(&self, uses: Arc<DeviceUses>) {
        let _ = self.inner.uses.set(uses);
    }

    /// Calls `hook` with the name of every model evicted to make room for
    /// another ([`Residency::get_or_admit`]), after the eviction, outside
    /// the residency's lock, on the thread that admitted the other; a
    /// second call changes nothing. The GPU server refills its host cache
    /// with what a device gave up ([`HostCache::refill`](crate::cache::HostCache::refill)).
    pub fn on_evict(&self, hook: EvictHook) {
        let _ = self.inner.on_evict.set(hook);
    }

    /// The threads that run this device's fetch-wait and upload stages.
    pub fn stage_threads(&self) -> &StageThreads {
        &self.stages
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes
    }

    pub fn contains(&self, model: &str) -> bool {
        self.inner.table().by_name.contains_key(model)
    }

    /// Whether `model` is resident with every group uploaded.
    pub fn is_ready(&self, model: &str) -> bool {
        let t = self.inner.table();
        t.by_name
            .get(model)
            .is_some_and(|id| t.entries[id].model.gates.all_open())
    }

    pub fn stats(&self) -> ResidencyStats {
        let t = self.inner.table();
        ResidencyStats {
            capacity_bytes: self.inner.capacity_bytes,
            used_bytes: t.used_bytes,
            models: t.by_name.len() as u64,
            hits: t.hits,
            misses: t.misses,
            evictions: t.evictions,
        }
    }

    /// Most models resident at once (the `max_models` given to [`Residency::new`]).
    pub fn max_models(&self) -> usize {
        self.inner.max_models
    }

    /// The names of the resident models, most recently used first (a model
    /// counts as used when a request pins it and again when it lets go).
    /// At most [`Residency::max_models`] names; evicted models still in use
    /// are not listed.
    pub fn resident_mru(&self) -> Vec<String> {
        let t = self.inner.table();
        let mut named: Vec<(u64, &str)> = t
            .by_name
            .iter()
            .map(|(name, id)| (t.entries[id].last_used, name.as_str()))
            .collect();
        named.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
        named
            .into_iter()
            .take(self.inner.max_models)
            .map(|(_, name)| name.to_string())
            .collect()
    }

    /// Pins `model` if resident (possibly still uploading); counts a hit or miss.
    pub fn get(&self, model: &str) -> Option<Resident> {
        let mut t = self.inner.table();
        self.get_locked(&mut t, model)
    }

    fn get_locked(&self, t: &mut Table, model: &str) -> Option<Resident> {
        let Some(&id) = t.by_name.get(model) else {
            t.misses += 1;
            return None;
        };
        t.hits += 1;
        t.tick += 1;
        let tick = t.tick;
        let e = t.entries.get_mut(&id).expect("by_name points at an entry");
        e.pins += 1;
        e.last_used = tick;
        self.inner.used(model);
        Some(Resident {
            model: e.model.clone(),
            id,
            inner: self.inner.clone(),
        })
    }

    /// The resident model (`true`: found), or a new one (`false`) whose arena
    /// and program `make` builds after LRU models not in use were evicted to
    /// make room; its gates are all pending: the caller uploads its groups.
    pub fn get_or_admit(
        &self,
        model: &str,
        bytes: u64,
        groups: usize,
        make: impl FnOnce() -> Result<(Arc<dyn Arena>, Box<dyn Program>), ExecError>,
    ) -> Result<(Resident, bool), DeviceError> {
        let mut t = self.inner.table();
        if let Some(r) = self.get_locked(&mut t, model) {
            return Ok((r, true));
        }
        let capacity = self.inner.capacity_bytes;
        let max_models = self.inner.max_models;
        if bytes > capacity {
            return Err(DeviceError::TooBig {
                model: model.into(),
                bytes,
                capacity,
            });
        }
        let mut evicted = Vec::new();
        while t.used_bytes + bytes > capacity || t.by_name.len() >= max_models {
            let victim = t
                .entries
                .iter()
                .filter(|(_, e)| e.pins == 0 && !e.doomed)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(id, _)| *id);
            let Some(victim) = victim else {
                let mut in_use: Vec<String> = t
                    .entries
                    .values()
                    .map(|e| format!("{} ({} bytes)", e.model.name, e.model.bytes))
                    .collect();
                in_use.sort();
                return Err(DeviceError::Full {
                    model: model.into(),
                    bytes,
                    capacity,
                    used: t.used_bytes,
                    max_models,
                    in_use: in_use.join(", "),
                });
            };
            log::debug!(
                "device: evicting {} to make room for {model}",
                t.entries[&victim].model.name
            );
            evicted.push(t.entries[&victim].model.name.clone());
            self.inner.doom(&mut t, victim);
            t.evictions += 1;
        }
        // Built under the lock: evicted arenas are gone (no pins) and a
        // second request for the same model finds this one.
        let (arena, program) = make().map_err(|source| DeviceError::Exec {
            model: model.into(),
            source: Box::new(source),
        })?;
        t.next_id += 1;
        t.tick += 1;
        let id = t.next_id;
        let resident = Arc::new(ResidentModel {
            name: model.into(),
            bytes,
            arena,
            program: Mutex::new(program),
            gates: GroupGates::new(groups),
        });
        t.used_bytes += bytes;
        let last_used = t.tick;
        t.entries.insert(
            id,
            Entry {
                model: resident.clone(),
                pins: 1,
                last_used,
                doomed: false,
            },
        );
        t.by_name.insert(model.into(), id);
        self.inner.used(model);
        drop(t);
        if let Some(hook) = self.inner.on_evict.get() {
            for name in &evicted {
                hook(name);
            }
        }
        Ok((
            Resident {
                model: resident,
                id,
                inner: self.inner.clone(),
            },
            false,
        ))
    }

    /// Drops this resident copy (e.g. after a failed upload) so the next
    /// request loads the model again; the arena is freed with the last pin.
    pub fn discard(&self, r: &Resident) {
        let mut t = self.inner.table();
        self.inner.doom(&mut t, r.id);
    }

    /// Evicts `model`: `None` if not resident, `Some(true)` if its arena was
    /// freed now, `Some(false)` if when the requests using it finish.
    pub fn evict(&self, model: &str) -> Option<bool> {
        let mut t = self.inner.table();
        let id = *t.by_name.get(model)?;
        Some(self.inner.doom(&mut t, id))
    }
}

/// A pinned resident model.
pub struct Resident {
    model: Arc<ResidentModel>,
    id: u64,
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Resident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resident")
            .field("name", &self.model.name)
            .field("bytes", &self.model.bytes)
            .field("uploaded", &self.model.gates.all_open())
            .finish()
    }
}

impl std::ops::Deref for Resident {
    type Target = ResidentModel;
    fn deref(&self) -> &ResidentModel {
        &self.model
    }
}

/// Another pin on the same resident model.
impl Clone for Resident {
    fn clone(&self) -> Self {
        let mut t = self.inner.table();
        let e = t
            .entries
            .get_mut(&self.id)
            .expect("a pinned resident model stays in the table");
        e.pins += 1;
        Resident {
            model: self.model.clone(),
            id: self.id,
            inner: self.inner.clone(),
        }
    }
}

impl Drop for Resident {
    fn drop(&mut self) {
        let mut t = self.inner.table();
        t.tick += 1;
        let tick = t.tick;
        let Some(e) = t.entries.get_mut(&self.id) else {
            return;
        };
        e.pins -= 1;
        e.last_used = tick;
        if e.pins == 0 && e.doomed {
            t.release(self.id);
        } else if !e.doomed {
            self.inner.used(&self.model.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{HostTensor, Trace};

    struct NoArena(u64);
    impl Arena for NoArena {
        fn len(&self) -> u64 {
            self.0
        }
        #[allow(unsafe_code)]
        unsafe fn upload_async(
            &self,
            _: usize,
            _: u64,
            _: distmind_models::ParamDtype,
            _: &[u8],
        ) -> Result<(), ExecError> {
            Ok(())
        }
    }
    struct NoProgram;
    impl Program for NoProgram {
        fn run(
            &mut self,
            _: &[HostTensor],
            _: &mut dyn FnMut(usize) -> Result<(), ExecError>,
            _: &mut Trace,
        ) -> Result<Vec<HostTensor>, ExecError> {
            Ok(Vec::new())
        }
    }

    fn admit(r: &Residency, name: &str, bytes: u64) -> Result<(Resident, bool), DeviceError> {
        r.get_or_admit(name, bytes, 1, || {
            Ok((
                Arc::new(NoArena(bytes)) as Arc<dyn Arena>,
                Box::new(NoProgram) as Box<dyn Program>,
            ))
        })
    }

    #[test]
    fn pipeline_residency_evicts_lru_arenas_not_in_use() {
        let r = Residency::new(100, 3);
        drop(admit(&r, "a", 40).unwrap());
        drop(admit(&r, "b", 40).unwrap());
        drop(r.get("a").unwrap());
        let (c, found) = admit(&r, "c", 40).unwrap();
        assert!(!found);
        assert!(
            r.contains("a") && !r.contains("b"),
            "b was least recently used"
        );
        let e = admit(&r, "d", 70).unwrap_err().to_string();
        // "a" is evicted, but "c" is pinned: 40 + 70 > 100.
        assert!(e.contains("c (40 bytes)"), "{e}");
        drop(c);
        let (_d, _) = admit(&r, "d", 70).unwrap();
        let s = r.stats();
        assert_eq!((s.used_bytes, s.models, s.evictions), (70, 1, 3));
        assert!(admit(&r, "e", 101)
            .unwrap_err()
            .to_string()
            .contains("whole parameter budget"));
        let (d2, found) = admit(&r, "d", 70).unwrap();
        assert!(found);
        assert_eq!(r.evict("d"), Some(false), "pinned twice");
        drop(d2);
        assert_eq!(r.stats().used_bytes, 70);
    }

    #[test]
    fn the_evict_hook_hears_of_each_model_evicted_to_make_room_only() {
        let r = Residency::new(100, 3);
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        r.on_evict(Box::new(move |name| {
            h.lock().unwrap().push(name.to_string());
        }));
        for m in ["a", "b"] {
            drop(admit(&r, m, 40).unwrap());
        }
        assert!(heard.lock().unwrap().is_empty());
        // 40 + 70 > 100: both go, the least recently used first.
        drop(admit(&r, "c", 70).unwrap());
        assert_eq!(*heard.lock().unwrap(), ["a", "b"]);
        // An eviction asked for is not one to make room.
        assert_eq!(r.evict("c"), Some(true));
        assert_eq!(heard.lock().unwrap().len(), 2);
    }

    #[test]
    fn devices_report_what_they_hold_and_what_they_will_keep() {
        let uses = Arc::new(DeviceUses::default());
        let (r0, r1) = (
            Residency::for_device(0, 100, 2, 0),
            Residency::for_device(1, 100, 2, 0),
        );
        r0.report_uses_to(uses.clone());
        r1.report_uses_to(uses.clone());
        drop(admit(&r0, "a", 40).unwrap());
        // Alone on its device, "a" goes with the device's next load.
        assert_eq!(uses.kept_on_device("a"), None);
        drop(admit(&r0, "b", 40).unwrap());
        assert!(uses.kept_on_device("b").is_some() && uses.kept_on_device("a").is_none());
        drop(r0.get("a").unwrap());
        assert!(uses.kept_on_device("a").is_some() && uses.kept_on_device("b").is_none());
        // Device 1 holds "b" after "c": kept there.
        drop(admit(&r1, "c", 40).unwrap());
        drop(admit(&r1, "b", 40).unwrap());
        assert!(uses.kept_on_device("b") > uses.kept_on_device("a"));
        // "b" leaves device 0 (its LRU) but device 1 keeps it.
        drop(admit(&r0, "d", 40).unwrap());
        assert!(!r0.contains("b") && uses.kept_on_device("b").is_some());
        assert!(r1.evict("b").is_some());
        assert_eq!(uses.kept_on_device("b"), None);
        // A discarded copy leaves too.
        let (d, _) = admit(&r0, "d", 40).unwrap();
        r0.discard(&d);
        drop(d);
        assert_eq!(uses.len(), 2, "a on device 0, c on device 1");
    }

    #[test]
    fn resident_mru_lists_most_recently_used_first_bounded_by_the_cap() {
        let r = Residency::new(1000, 3);
        assert!(r.resident_mru().is_empty());
        drop(admit(&r, "a", 1).unwrap());
        drop(admit(&r, "b", 1).unwrap());
        drop(admit(&r, "c", 1).unwrap());
        assert_eq!(r.resident_mru(), ["c", "b", "a"]);
        drop(r.get("a").unwrap());
        assert_eq!(r.resident_mru(), ["a", "c", "b"]);
        // A fourth model evicts the LRU one ("b"): still at most 3 names.
        drop(admit(&r, "d", 1).unwrap());
        assert_eq!(r.resident_mru(), ["d", "a", "c"]);
        assert_eq!(r.max_models(), 3);
        r.evict("a");
        assert_eq!(r.resident_mru(), ["d", "c"]);
    }

    #[test]
    fn pipeline_residency_bounds_model_count_and_discards() {
        let r = Residency::new(1000, 2);
        drop(admit(&r, "a", 1).unwrap());
        drop(admit(&r, "b", 1).unwrap());
        drop(admit(&r, "c", 1).unwrap());
        assert_eq!(r.stats().models, 2);
        assert!(!r.contains("a"));
        let (c, _) = admit(&r, "c", 1).unwrap();
        r.discard(&c);
        assert!(!r.contains("c"));
        assert_eq!(r.stats().used_bytes, 2);
        drop(c);
        assert_eq!(r.stats().used_bytes, 1);
    }
}
