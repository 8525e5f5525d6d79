//! The model catalog: model name -> where every slice of every group lives.
//!
//! Entries are validated as a whole before they replace anything, so a reader
//! never sees a half-updated model. They are kept behind `Arc` so that a
//! reply can be built outside the controller's lock.

use std::collections::BTreeMap;
use std::sync::Arc;

use distmind_common::limits::NAME_BYTES_MAX;
use distmind_common::proto::{ErrorCode, ErrorReply, ModelEntry, ModelSummary};

/// Most models the catalog holds.
pub const CATALOG_MODELS_MAX: usize = 100_000;
/// Most parameter groups per model (group size 1 = one group per layer).
pub const GROUPS_PER_MODEL_MAX: usize = 1 << 16;
/// Most slices a group is cut into.
pub const SLICES_PER_GROUP_MAX: usize = 1024;
/// Most copies of one slice.
pub const REPLICAS_PER_SLICE_MAX: usize = 16;

/// What dropping a memory server's replicas did to one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedReplicas {
    pub model: String,
    /// Slices that had a copy on the server.
    pub slices: usize,
    /// Slices left with no copy at all: the model cannot be read until it is
    /// deployed again.
    pub unreadable_slices: usize,
}

#[derive(Debug, Default)]
pub struct Catalog {
    models: BTreeMap<String, Arc<ModelEntry>>,
    /// The last version given to an entry (see [`ModelEntry::version`]).
    version: u64,
}

impl Catalog {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.models.len()
    }

    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// Adds or replaces a model after checking it; returns the entry it
    /// replaced (whose extents the deploy tool then frees).
    /// `memserver_addr` says where a registered memory server lives.
    pub fn put<'a>(
        &mut self,
        mut entry: ModelEntry,
        memserver_addr: impl Fn(u32) -> Option<&'a str>,
    ) -> Result<Option<Arc<ModelEntry>>, ErrorReply> {
        validate(&entry, memserver_addr).map_err(|m| ErrorReply::new(ErrorCode::BadRequest, m))?;
        if !self.models.contains_key(&entry.name) && self.models.len() >= CATALOG_MODELS_MAX {
            return Err(ErrorReply::new(
                ErrorCode::Full,
                format!(
                    "the catalog is full ({CATALOG_MODELS_MAX} models); remove a model before adding '{}'",
                    entry.name
                ),
            ));
        }
        entry.version = self.bump();
        Ok(self.models.insert(entry.name.clone(), Arc::new(entry)))
    }

    /// A fresh entry version: every change to an entry gets one.
    fn bump(&mut self) -> u64 {
        self.version += 1;
        self.version
    }

    pub fn get(&self, name: &str) -> Result<Arc<ModelEntry>, ErrorReply> {
        self.models
            .get(name)
            .cloned()
            .ok_or_else(|| self.unknown(name))
    }

    pub fn remove(&mut self, name: &str) -> Result<Arc<ModelEntry>, ErrorReply> {
        self.models.remove(name).ok_or_else(|| self.unknown(name))
    }

    /// Every model, sorted by name.
    pub fn list(&self) -> Vec<ModelSummary> {
        self.models
            .values()
            .map(|e| ModelSummary {
                name: e.name.clone(),
                family: e.family.clone(),
                total_bytes: e.total_bytes,
                groups: e.groups.len() as u32,
            })
            .collect()
    }

    /// Removes every replica on `memserver` (its arena is gone); reports the
    /// models that had slices there, by name.
    pub fn drop_replicas_on(&mut self, memserver: u32) -> Vec<DroppedReplicas> {
        let mut report = Vec::new();
        for (name, entry) in self.models.iter_mut() {
            let touches = entry
                .groups
                .iter()
                .flat_map(|g| &g.slices)
                .any(|s| s.replicas.iter().any(|l| l.memserver == memserver));
            if !touches {
                continue;
            }
            let entry = Arc::make_mut(entry);
            self.version += 1;
            entry.version = self.version;
            let mut d = DroppedReplicas {
                model: name.clone(),
                slices: 0,
                unreadable_slices: 0,
            };
            for slice in entry.groups.iter_mut().flat_map(|g| g.slices.iter_mut()) {
                let before = slice.replicas.len();
                slice.replicas.retain(|l| l.memserver != memserver);
                if slice.replicas.len() != before {
                    d.slices += 1;
                    if slice.replicas.is_empty() {
                        d.unreadable_slices += 1;
                    }
                }
            }
            report.push(d);
        }
        report
    }

    fn unknown(&self, name: &str) -> ErrorReply {
        ErrorReply::new(
            ErrorCode::UnknownModel,
            format!(
                "unknown model '{name}': the catalog holds {} models (deploy it first, or list them with ListModels)",
                self.models.len()
            ),
        )
    }
}

fn is_checksum(s: &str) -> bool {
    s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Checks an entry before it enters the catalog; the error names what is wrong.
pub fn validate<'a>(
    e: &ModelEntry,
    memserver_addr: impl Fn(u32) -> Option<&'a str>,
) -> Result<(), String> {
    if e.name.is_empty() || e.name.len() > NAME_BYTES_MAX {
        return Err(format!(
            "model name must be 1..={NAME_BYTES_MAX} bytes, got {} bytes",
            e.name.len()
        ));
    }
    let m = &e.name;
    if e.family.len() > NAME_BYTES_MAX {
        return Err(format!(
            "model '{m}': family name is longer than {NAME_BYTES_MAX} bytes"
        ));
    }
    if e.strategy.len() > NAME_BYTES_MAX {
        return Err(format!(
            "model '{m}': strategy name is longer than {NAME_BYTES_MAX} bytes"
        ));
    }
    if e.groups.len() > GROUPS_PER_MODEL_MAX {
        return Err(format!(
            "model '{m}' has {} groups, more than {GROUPS_PER_MODEL_MAX}",
            e.groups.len()
        ));
    }
    let mut total: u64 = 0;
    for (i, g) in e.groups.iter().enumerate() {
        let at = format!("model '{m}' group {i}");
        if g.index as usize != i {
            return Err(format!(
                "{at}: has index {}; groups must be listed with indices 0..n in order",
                g.index
            ));
        }
        if g.bytes == 0 {
            return Err(format!("{at}: is empty (0 bytes)"));
        }
        if !is_checksum(&g.checksum) {
            return Err(format!(
                "{at}: checksum {:?} is not 16 hex digits",
                g.checksum
            ));
        }
        if g.slices.is_empty() || g.slices.len() > SLICES_PER_GROUP_MAX {
            return Err(format!(
                "{at}: has {} slices, expected 1..={SLICES_PER_GROUP_MAX}",
                g.slices.len()
            ));
        }
        let mut end: u64 = 0;
        for (j, s) in g.slices.iter().enumerate() {
            let at = format!("{at} slice {j}");
            if s.group_offset != end {
                return Err(format!(
                    "{at}: starts at {} but the slices before it end at {end}; slices must be in order and cover \
                     [0, {}) without gap or overlap",
                    s.group_offset, g.bytes
                ));
            }
            if s.len == 0 {
                return Err(format!("{at}: is empty (0 bytes)"));
            }
            end = match s.group_offset.checked_add(s.len) {
                Some(end) if end <= g.bytes => end,
                _ => {
                    return Err(format!(
                        "{at}: [{}, +{}) runs past the group's end at {}",
                        s.group_offset, s.len, g.bytes
                    ))
                }
            };
            if !is_checksum(&s.checksum) {
                return Err(format!(
                    "{at}: checksum {:?} is not 16 hex digits",
                    s.checksum
                ));
            }
            if s.replicas.is_empty() || s.replicas.len() > REPLICAS_PER_SLICE_MAX {
                return Err(format!(
                    "{at}: has {} replicas, expected 1..={REPLICAS_PER_SLICE_MAX}",
                    s.replicas.len()
                ));
            }
            for (k, l) in s.replicas.iter().enumerate() {
                match memserver_addr(l.memserver) {
                    None => {
                        return Err(format!(
                            "{at} replica {k}: memory server {} is not registered",
                            l.memserver
                        ))
                    }
                    Some(addr) if addr != l.addr => {
                        return Err(format!(
                            "{at} replica {k}: memory server {} registered as {addr}, not {}",
                            l.memserver, l.addr
                        ))
                    }
                    Some(_) => {}
                }
                if s.replicas[..k].iter().any(|o| o.memserver == l.memserver) {
                    return Err(format!(
                        "{at} replica {k}: memory server {} holds two copies",
                        l.memserver
                    ));
                }
            }
        }
        if end != g.bytes {
            return Err(format!(
                "{at}: slices cover [0, {end}) but the group has {} bytes",
                g.bytes
            ));
        }
        total = total.saturating_add(g.bytes);
    }
    if total != e.total_bytes {
        return Err(format!(
            "model '{m}': total_bytes is {} but its groups add up to {total}",
            e.total_bytes
        ));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use distmind_common::proto::{GroupLocation, Location, Slice};

    pub(crate) fn loc(memserver: u32) -> Location {
        Location {
            memserver,
            addr: format!("127.0.0.1:{}", 7000 + memserver),
            offset: 0,
        }
    }

    /// A model of `groups` groups of 1024 bytes, each in two 512-byte slices
    /// on memservers 0 and 1, replicated on 2.
    pub(crate) fn entry(name: &str, groups: u32) -> ModelEntry {
        let sum = "0123456789abcdef".to_string();
        ModelEntry {
            name: name.into(),
            family: "resnet152".into(),
            total_bytes: 1024 * groups as u64,
            strategy: "hybrid".into(),
            replication: 2,
            version: 0,
            groups: (0..groups)
                .map(|index| GroupLocation {
                    index,
                    bytes: 1024,
                    checksum: sum.clone(),
                    slices: (0..2)
                        .map(|j| Slice {
                            group_offset: 512 * j as u64,
                            len: 512,
                            checksum: sum.clone(),
                            replicas: vec![loc(j), loc(2)],
                        })
                        .collect(),
                })
                .collect(),
            manifest: serde_json::json!({"layers": []}),
        }
    }

    pub(crate) fn known(id: u32) -> Option<&'static str> {
        ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]
            .get(id as usize)
            .copied()
    }

    fn bad(e: &ModelEntry) -> String {
        validate(e, known).unwrap_err()
    }

    #[test]
    fn put_get_replace_remove_list() {
        let mut c = Catalog::new();
        assert!(c.put(entry("b", 2), known).unwrap().is_none());
        assert!(c.put(entry("a", 1), known).unwrap().is_none());
        let old = c.put(entry("b", 3), known).unwrap().unwrap();
        assert_eq!(old.groups.len(), 2);
        assert_eq!(c.get("b").unwrap().groups.len(), 3);
        // Every put gets a newer version, whatever the sender set.
        assert!(old.version >= 1 && c.get("b").unwrap().version > old.version);
        assert!(c.get("b").unwrap().version > c.get("a").unwrap().version);
        let names: Vec<_> = c.list().into_iter().map(|s| (s.name, s.groups)).collect();
        assert_eq!(names, vec![("a".to_string(), 1), ("b".to_string(), 3)]);
        assert_eq!(c.remove("a").unwrap().name, "a");
        let e = c.get("a").unwrap_err();
        assert_eq!(e.code, ErrorCode::UnknownModel);
        assert!(
            e.message.contains("'a'") && e.message.contains("holds 1 models"),
            "{e}"
        );
        assert_eq!(c.remove("a").unwrap_err().code, ErrorCode::UnknownModel);
    }

    #[test]
    fn valid_entry_passes() {
        validate(&entry("m", 3), known).unwrap();
    }

    #[test]
    fn names_and_indices_are_checked() {
        assert!(bad(&entry("", 1)).contains("model name"));
        assert!(bad(&entry(&"n".repeat(NAME_BYTES_MAX + 1), 1)).contains("model name"));
        let mut e = entry("m", 3);
        e.groups.swap(1, 2);
        assert!(bad(&e).contains("group 1: has index 2"), "{}", bad(&e));
        let mut e = entry("m", 2);
        e.total_bytes += 1;
        assert!(bad(&e).contains("total_bytes"));
    }

    #[test]
    fn slices_must_tile_the_group() {
        let mut e = entry("m", 2);
        e.groups[1].slices[1].group_offset = 500; // overlap
        assert!(
            bad(&e).contains("group 1 slice 1: starts at 500"),
            "{}",
            bad(&e)
        );
        let mut e = entry("m", 2);
        e.groups[0].slices[1].len = 100; // gap at the end
        assert!(
            bad(&e).contains("group 0: slices cover [0, 612)"),
            "{}",
            bad(&e)
        );
        let mut e = entry("m", 2);
        e.groups[0].slices[1].len = 1000; // past the end
        assert!(
            bad(&e).contains("group 0 slice 1: [512, +1000) runs past"),
            "{}",
            bad(&e)
        );
        let mut e = entry("m", 2);
        e.groups[0].slices[1].len = u64::MAX;
        assert!(bad(&e).contains("runs past"));
        let mut e = entry("m", 2);
        e.groups[0].slices.swap(0, 1); // out of order
        assert!(bad(&e).contains("group 0 slice 0: starts at 512"));
        let mut e = entry("m", 1);
        e.groups[0].slices.clear();
        assert!(bad(&e).contains("group 0: has 0 slices"));
    }

    #[test]
    fn replicas_and_checksums_are_checked() {
        let mut e = entry("m", 2);
        e.groups[1].slices[0].replicas.clear();
        assert!(bad(&e).contains("group 1 slice 0: has 0 replicas"));
        let mut e = entry("m", 2);
        e.groups[1].slices[1].replicas[1] = loc(9);
        assert!(
            bad(&e).contains("group 1 slice 1 replica 1: memory server 9 is not registered"),
            "{}",
            bad(&e)
        );
        let mut e = entry("m", 2);
        e.groups[1].slices[1].replicas[1].addr = "elsewhere:1".into();
        assert!(
            bad(&e).contains("registered as 127.0.0.1:7002"),
            "{}",
            bad(&e)
        );
        let mut e = entry("m", 2);
        e.groups[0].slices[0].replicas[1] = loc(0);
        assert!(bad(&e).contains("holds two copies"));
        let mut e = entry("m", 2);
        e.groups[1].checksum = "xyz".into();
        assert!(bad(&e).contains("group 1: checksum"));
        let mut e = entry("m", 2);
        e.groups[0].slices[1].checksum = "+123456789abcdef".into();
        assert!(bad(&e).contains("group 0 slice 1: checksum"));
    }

    #[test]
    fn a_full_catalog_refuses_new_models_but_accepts_replacements() {
        let mut c = Catalog::new();
        let e = Arc::new(entry("m", 1));
        for i in 0..CATALOG_MODELS_MAX {
            c.models.insert(format!("m{i}"), e.clone());
        }
        assert_eq!(
            c.put(entry("new", 1), known).unwrap_err().code,
            ErrorCode::Full
        );
        assert!(c.put(entry("m7", 1), known).unwrap().is_some());
    }

    #[test]
    fn dropping_a_server_removes_its_replicas() {
        let mut c = Catalog::new();
        c.put(entry("a", 2), known).unwrap();
        let mut single = entry("b", 1);
        for s in &mut single.groups[0].slices {
            s.replicas.truncate(1);
        }
        c.put(single, known).unwrap();
        let mut other = entry("c", 1);
        for s in &mut other.groups[0].slices {
            s.replicas = vec![loc(2)];
        }
        c.put(other, known).unwrap();
        let r = c.drop_replicas_on(0);
        assert_eq!(
            r,
            vec![
                DroppedReplicas {
                    model: "a".into(),
                    slices: 2,
                    unreadable_slices: 0
                },
                DroppedReplicas {
                    model: "b".into(),
                    slices: 1,
                    unreadable_slices: 1
                },
            ]
        );
        let a = c.get("a").unwrap();
        assert_eq!(a.groups[0].slices[0].replicas, vec![loc(2)]);
        assert_eq!(a.groups[0].slices[1].replicas, vec![loc(1), loc(2)]);
        assert!(c.get("b").unwrap().groups[0].slices[0].replicas.is_empty());
        assert!(c.drop_replicas_on(0).is_empty());
    }
}
