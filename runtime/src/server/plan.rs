//! A model as the request path uses it, compiled once per catalog version:
//! the typed manifest, the packed layout checked against the catalog's
//! groups and slices, and every checksum as a number; and the [`Catalog`]
//! of plans, which asks the controller only when a model is new to it,
//! forgotten, or older than the catalog version a request names.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use distmind_common::checksum::from_hex;
use distmind_common::handshake::ClusterKey;
use distmind_common::proto::{ErrorCode, ErrorReply, ModelEntry};
use distmind_common::samples::DATASET_FAMILY;
use distmind_controller::{ClientError, ControllerClient};
use distmind_models::Manifest;

/// A catalog entry compiled for serving. Built by [`ModelPlan::compile`],
/// which refuses an entry whose manifest does not parse or whose layout
/// does not add up, so a request never finds that out mid-pipeline.
#[derive(Debug)]
pub(crate) struct ModelPlan {
    /// The catalog entry (where the slices are; the fetch reads it).
    pub entry: ModelEntry,
    pub manifest: Manifest,
    /// The catalog version of `entry`.
    pub version: u64,
}

impl ModelPlan {
    /// Parses the manifest and checks the layout once: as many groups in
    /// the catalog as in the manifest, each of the manifest's size at the
    /// running offset, its slices covering it exactly in order on at least
    /// one memory server, every checksum hex. The error names the model and
    /// what is wrong.
    pub fn compile(entry: ModelEntry) -> Result<ModelPlan, String> {
        let model = entry.name.clone();
        let bad = |why: String| format!("model {model}: the catalog entry cannot be served: {why}");
        if entry.family == DATASET_FAMILY {
            return Err(bad("it is a dataset, not a model".into()));
        }
        let manifest: Manifest = serde_json::from_value(entry.manifest.clone())
            .map_err(|e| bad(format!("its manifest does not parse: {e}")))?;
        if manifest.name != entry.name {
            return Err(bad(format!(
                "its manifest is for model {:?}",
                manifest.name
            )));
        }
        if entry.groups.len() != manifest.groups.len() {
            return Err(bad(format!(
                "{} groups in the catalog, {} in the manifest",
                entry.groups.len(),
                manifest.groups.len()
            )));
        }
        let hex = |what: String, text: &str| {
            from_hex(text).ok_or_else(|| bad(format!("{what} has checksum {text:?}, not hex")))
        };
        let mut at = 0u64;
        for (g, (e, mg)) in entry.groups.iter().zip(&manifest.groups).enumerate() {
            if e.index as usize != g || e.bytes != mg.bytes || mg.offset != at {
                return Err(bad(format!(
                    "group {g}: the catalog has group {} of {} bytes at {at}, the manifest {} bytes at {}",
                    e.index, e.bytes, mg.bytes, mg.offset
                )));
            }
            hex(format!("group {g}"), &e.checksum)?;
            let mut covered = 0u64;
            for (s, slice) in e.slices.iter().enumerate() {
                if slice.group_offset != covered || slice.len == 0 || slice.replicas.is_empty() {
                    return Err(bad(format!(
                        "group {g} slice {s}: {} bytes at {} with {} replicas, expected bytes at {covered} \
                         on at least one memory server",
                        slice.len,
                        slice.group_offset,
                        slice.replicas.len()
                    )));
                }
                covered += slice.len;
                hex(format!("group {g} slice {s}"), &slice.checksum)?;
            }
            if covered != e.bytes {
                return Err(bad(format!(
                    "group {g}: its slices hold {covered} of its {} bytes",
                    e.bytes
                )));
            }
            at += e.bytes;
        }
        if at == 0 {
            return Err(bad("it has no parameter bytes".into()));
        }
        Ok(ModelPlan {
            version: entry.version,
            manifest,
            entry,
        })
    }

    /// Whether this plan serves a request that resolved the model at
    /// `version` (`None`: any plan does).
    pub fn serves(&self, version: Option<u64>) -> bool {
        version.is_none_or(|v| self.version >= v)
    }
}

/// Most compiled plans kept; the table is cleared when full.
pub const PLANS_MAX: usize = 4096;
/// Bounds the connect to the controller and each of its replies.
const CONTROLLER_TIMEOUT: Duration = Duration::from_secs(10);

/// One refresh of a model's plan in flight; everyone who needs it waits here.
#[derive(Default)]
struct Refresh {
    done: Mutex<Option<Result<Arc<ModelPlan>, ErrorReply>>>,
    cv: Condvar,
}

impl Refresh {
    fn finish(&self, result: Result<Arc<ModelPlan>, ErrorReply>) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
        self.cv.notify_all();
    }

    fn wait(&self) -> Result<Arc<ModelPlan>, ErrorReply> {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = &*done {
                return r.clone();
            }
            done = self.cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The controller's catalog as the runtime sees it: one compiled
/// [`ModelPlan`] per model, refreshed when a request names a newer catalog
/// version (or the plan was forgotten), one refresh per model at a time,
/// through one blocking controller connection shared (and reopened) by all.
pub(crate) struct Catalog {
    controller: String,
    key: ClusterKey,
    client: Mutex<Option<ControllerClient>>,
    plans: Mutex<HashMap<String, Arc<ModelPlan>>>,
    refreshing: Mutex<HashMap<String, Arc<Refresh>>>,
    /// `GetModel` calls made (each compiles one plan).
    refreshes: AtomicU64,
}

impl Catalog {
    pub fn new(controller: String, key: ClusterKey) -> Self {
        Catalog {
            controller,
            key,
            client: Mutex::new(None),
            plans: Mutex::new(HashMap::new()),
            refreshing: Mutex::new(HashMap::new()),
            refreshes: AtomicU64::new(0),
        }
    }

    fn plans(&self) -> MutexGuard<'_, HashMap<String, Arc<ModelPlan>>> {
        self.plans.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets a model's plan (after an eviction or a failed fetch: the
    /// model may have been deployed again elsewhere).
    pub fn forget(&self, model: &str) {
        self.plans().remove(model);
    }

    /// The plan of `model` if one is compiled that serves `version`
    /// (`None`: any); never asks the controller.
    pub fn cached(&self, model: &str, version: Option<u64>) -> Option<Arc<ModelPlan>> {
        self.plans()
            .get(model)
            .filter(|p| p.serves(version))
            .cloned()
    }

    /// `GetModel` calls this runtime made.
    pub fn refreshes(&self) -> u64 {
        self.refreshes.load(Ordering::Relaxed)
    }

    /// The plan of `model` that serves `version`: the compiled one, else a
    /// refresh from the controller (blocking). Concurrent callers for the
    /// same model share one refresh.
    pub fn resolve(&self, model: &str, version: Option<u64>) -> Result<Arc<ModelPlan>, ErrorReply> {
        // A refresh that was already running when this call came may have
        // asked before `version` existed: then one more, of our own.
        for _ in 0..2 {
            if let Some(p) = self.cached(model, version) {
                return Ok(p);
            }
            let (refresh, lead) = {
                let mut r = self.refreshing.lock().unwrap_or_else(|p| p.into_inner());
                match r.get(model) {
                    Some(f) => (f.clone(), false),
                    None => {
                        let f = Arc::new(Refresh::default());
                        r.insert(model.to_string(), f.clone());
                        (f, true)
                    }
                }
            };
            let result = if lead {
                let result = self.refresh(model, version);
                refresh.finish(result.clone());
                self.refreshing
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(model);
                result
            } else {
                refresh.wait()
            };
            match result {
                Ok(p) if !p.serves(version) && !lead => continue,
                other => return other,
            }
        }
        self.refresh(model, version)
    }

    /// Asks the controller and compiles the plan (kept unless the catalog
    /// gave an older version than one already compiled).
    fn refresh(&self, model: &str, version: Option<u64>) -> Result<Arc<ModelPlan>, ErrorReply> {
        if let Some(p) = self.cached(model, version) {
            return Ok(p);
        }
        self.refreshes.fetch_add(1, Ordering::Relaxed);
        let entry = self.fetch_entry(model)?;
        let plan = Arc::new(
            ModelPlan::compile(entry).map_err(|why| ErrorReply::new(ErrorCode::Internal, why))?,
        );
        let mut plans = self.plans();
        if plans.len() >= PLANS_MAX && !plans.contains_key(model) {
            plans.clear();
        }
        match plans.get(model) {
            Some(held) if held.version > plan.version => Ok(held.clone()),
            _ => {
                plans.insert(model.to_string(), plan.clone());
                Ok(plan)
            }
        }
    }

    /// `GetModel`, reconnecting once if the shared connection broke.
    fn fetch_entry(&self, model: &str) -> Result<ModelEntry, ErrorReply> {
        match self.call(|c| c.get_model(model)) {
            Ok(entry) => Ok(entry),
            Err(e @ ClientError::Server { .. }) => {
                let reply = e.error_reply().cloned().expect("a server error");
                Err(match reply.code {
                    ErrorCode::UnknownModel => ErrorReply::new(
                        ErrorCode::UnknownModel,
                        format!("unknown model {model:?}: it is not in the controller's catalog (deploy it first)"),
                    ),
                    _ => reply,
                })
            }
            Err(e) => Err(ErrorReply::new(
                ErrorCode::Internal,
                format!("model {model}: cannot ask the catalog: {e}"),
            )),
        }
    }

    /// Every model name in the catalog (`ListModels`).
    pub fn list(&self) -> Result<Vec<String>, ClientError> {
        // Datasets share the catalog; they are never models to load.
        self.call(|c| c.list_models()).map(|models| {
            models
                .into_iter()
                .filter(|m| m.family != DATASET_FAMILY)
                .map(|m| m.name)
                .collect()
        })
    }

    /// One request on the shared controller connection, reconnecting once
    /// if it broke (a server's error reply is returned as is).
    fn call<T>(
        &self,
        mut f: impl FnMut(&mut ControllerClient) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let mut client = self.client.lock().unwrap_or_else(|p| p.into_inner());
        let mut last = None;
        for _ in 0..2 {
            if client.is_none() {
                match ControllerClient::connect(&self.controller, &self.key, CONTROLLER_TIMEOUT) {
                    Ok(c) => *client = Some(c),
                    Err(e) => {
                        last = Some(e);
                        continue;
                    }
                }
            }
            match f(client.as_mut().expect("connected above")) {
                Ok(v) => return Ok(v),
                Err(e @ ClientError::Server { .. }) => return Err(e),
                Err(e) => {
                    *client = None;
                    last = Some(e);
                }
            }
        }
        Err(last.expect("each attempt failed with an error"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::checksum::{checksum, to_hex};
    use distmind_common::proto::{GroupLocation, Location, Slice};
    use distmind_models::{generate, Family, GenOptions, Package, Scale};

    fn entry(pkg: &Package, version: u64) -> ModelEntry {
        let m = &pkg.manifest;
        let groups = (0..m.groups.len())
            .map(|g| {
                let bytes = pkg.group_bytes(g).unwrap();
                let half = bytes.len() / 2;
                let slice = |at: usize, len: usize| Slice {
                    group_offset: at as u64,
                    len: len as u64,
                    checksum: to_hex(checksum(&bytes[at..at + len])),
                    replicas: vec![Location {
                        memserver: 1,
                        addr: "ms1:1".into(),
                        offset: 0,
                    }],
                };
                GroupLocation {
                    index: g as u32,
                    bytes: bytes.len() as u64,
                    checksum: to_hex(checksum(&bytes)),
                    slices: vec![slice(0, half), slice(half, bytes.len() - half)],
                }
            })
            .collect();
        ModelEntry {
            name: m.name.clone(),
            family: m.family.to_string(),
            total_bytes: m.stored_bytes,
            strategy: "test".into(),
            replication: 1,
            version,
            groups,
            manifest: serde_json::to_value(m).unwrap(),
        }
    }

    fn package(dir: &std::path::Path) -> Package {
        let opts = GenOptions {
            scale: Scale::Tiny,
            group_bytes: 16 << 10,
            ..GenOptions::new(Family::Resnet152, dir)
        };
        Package::open(&generate(&opts).unwrap()[0]).unwrap()
    }

    #[test]
    fn compiles_the_manifest_and_its_version() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = package(dir.path());
        let plan = ModelPlan::compile(entry(&pkg, 7)).unwrap();
        assert_eq!(plan.version, 7);
        assert_eq!(plan.manifest, pkg.manifest);
        assert!(plan.serves(None) && plan.serves(Some(7)) && plan.serves(Some(3)));
        assert!(
            !plan.serves(Some(8)),
            "a newer catalog version needs a refresh"
        );
    }

    #[test]
    fn refuses_entries_that_do_not_add_up_naming_what() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = package(dir.path());
        let mut e = entry(&pkg, 1);
        e.groups[1].slices[1].checksum = "not hex".into();
        let why = ModelPlan::compile(e).unwrap_err();
        assert!(
            why.contains("group 1 slice 1") && why.contains("not hex"),
            "{why}"
        );
        let mut e = entry(&pkg, 1);
        e.groups[0].slices[1].len -= 1;
        let why = ModelPlan::compile(e).unwrap_err();
        assert!(
            why.contains("group 0") && why.contains("slices hold"),
            "{why}"
        );
        let mut e = entry(&pkg, 1);
        e.groups.pop();
        let why = ModelPlan::compile(e).unwrap_err();
        assert!(why.contains("groups in the catalog"), "{why}");
        let mut e = entry(&pkg, 1);
        e.manifest = serde_json::json!({"name": 3});
        let why = ModelPlan::compile(e).unwrap_err();
        assert!(why.contains("does not parse"), "{why}");
    }
}
