//! A byte budget with least-recently-used eviction of unpinned entries:
//! the rule of the runtime's device residency (`runtime::device`: LRU
//! arenas within the device's parameter budget and at most N models), and
//! with an order given ([`Lru::admit_by`]) that of its host cache
//! (`runtime::cache`: models a device keeps first, then LRU). Those
//! structures hold real memory and arenas, so the simulator keeps the same
//! rule over model ids.

use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy)]
struct Entry {
    stamp: u64,
    bytes: u64,
    pins: u32,
}

#[derive(Debug)]
pub struct Lru {
    capacity: u64,
    max_entries: usize,
    used: u64,
    clock: u64,
    entries: HashMap<u32, Entry>,
    by_stamp: BTreeMap<u64, u32>,
}

impl Lru {
    pub fn new(capacity: u64, max_entries: usize) -> Lru {
        Lru {
            capacity,
            max_entries: max_entries.max(1),
            used: 0,
            clock: 0,
            entries: HashMap::new(),
            by_stamp: BTreeMap::new(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn contains(&self, id: u32) -> bool {
        self.entries.contains_key(&id)
    }

    /// Marks `id` most recently used; false when absent.
    pub fn touch(&mut self, id: u32) -> bool {
        let Some(e) = self.entries.get_mut(&id) else {
            return false;
        };
        self.by_stamp.remove(&e.stamp);
        self.clock += 1;
        e.stamp = self.clock;
        self.by_stamp.insert(self.clock, id);
        true
    }

    /// Admits `id` (most recently used), evicting least recently used
    /// unpinned entries until it fits. Returns the evicted ids, or `None`
    /// (nothing changed) when it cannot fit.
    pub fn admit(&mut self, id: u32, bytes: u64) -> Option<Vec<u32>> {
        self.admit_by(id, bytes, |_, stamp| (0, stamp))
    }

    /// [`Lru::admit`], evicting unpinned entries in the order of `key(id,
    /// stamp)`, lowest first (`stamp`: when the entry was last used, larger
    /// is more recent).
    pub fn admit_by(
        &mut self,
        id: u32,
        bytes: u64,
        key: impl Fn(u32, u64) -> (u8, u64),
    ) -> Option<Vec<u32>> {
        self.admit_within(id, bytes, key, u8::MAX)
    }

    /// [`Lru::admit_by`] that evicts only entries whose key's class (its
    /// first part) is at most `max_class`: `None`, and nothing evicted,
    /// when those would not make room.
    pub fn admit_within(
        &mut self,
        id: u32,
        bytes: u64,
        key: impl Fn(u32, u64) -> (u8, u64),
        max_class: u8,
    ) -> Option<Vec<u32>> {
        if self.touch(id) {
            return Some(Vec::new());
        }
        if bytes > self.capacity {
            return None;
        }
        let mut order: Vec<((u8, u64), u32)> = self
            .by_stamp
            .iter()
            .map(|(&stamp, &v)| (key(v, stamp), v))
            .filter(|&((class, _), v)| class <= max_class && self.entries[&v].pins == 0)
            .collect();
        order.sort_by_key(|&(k, _)| k);
        // Fail without evicting when even every entry it may evict would
        // not make room.
        let (mut used, mut n) = (self.used, self.entries.len());
        for &(_, v) in &order {
            if used + bytes <= self.capacity && n < self.max_entries {
                break;
            }
            used -= self.entries[&v].bytes;
            n -= 1;
        }
        if used + bytes > self.capacity || n >= self.max_entries {
            return None;
        }
        let mut evicted = Vec::new();
        for (_, v) in order {
            if self.used + bytes <= self.capacity && self.entries.len() < self.max_entries {
                break;
            }
            self.remove(v);
            evicted.push(v);
        }
        self.clock += 1;
        self.entries.insert(
            id,
            Entry {
                stamp: self.clock,
                bytes,
                pins: 0,
            },
        );
        self.by_stamp.insert(self.clock, id);
        self.used += bytes;
        Some(evicted)
    }

    pub fn remove(&mut self, id: u32) -> bool {
        match self.entries.remove(&id) {
            Some(e) => {
                self.by_stamp.remove(&e.stamp);
                self.used -= e.bytes;
                true
            }
            None => false,
        }
    }

    pub fn pin(&mut self, id: u32) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.pins += 1;
        }
    }

    pub fn unpin(&mut self, id: u32) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.pins = e.pins.saturating_sub(1);
        }
    }

    /// Ids, most recently used first.
    pub fn mru(&self) -> Vec<u32> {
        self.by_stamp.values().rev().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recently_used_unpinned() {
        let mut l = Lru::new(30, 10);
        assert_eq!(l.admit(1, 10), Some(vec![]));
        assert_eq!(l.admit(2, 10), Some(vec![]));
        assert_eq!(l.admit(3, 10), Some(vec![]));
        l.touch(1);
        l.pin(2);
        // 2 is the least recent but pinned: 3 goes.
        assert_eq!(l.admit(4, 10), Some(vec![3]));
        assert_eq!(l.mru(), vec![4, 1, 2]);
        l.unpin(2);
        assert_eq!(l.admit(5, 10), Some(vec![2]));
        assert_eq!(l.admit(6, 40), None);
    }

    #[test]
    fn admit_by_evicts_in_the_order_given() {
        let mut l = Lru::new(30, 10);
        for id in [1, 2, 3] {
            l.admit(id, 10);
        }
        // 2 first, then by recency.
        let key = |id: u32, stamp: u64| if id == 2 { (0, 0) } else { (1, stamp) };
        assert_eq!(l.admit_by(4, 10, key), Some(vec![2]));
        assert_eq!(l.admit_by(5, 20, key), Some(vec![1, 3]));
        assert_eq!(l.mru(), vec![5, 4]);
    }

    #[test]
    fn admit_within_evicts_only_the_classes_allowed_or_nothing() {
        let mut c = Lru::new(30, 8);
        for id in 1..=3 {
            c.admit(id, 10).unwrap();
        }
        // Class 0: entry 2 only.
        let key = |id: u32, stamp: u64| (u8::from(id != 2), stamp);
        assert_eq!(c.admit_within(4, 10, key, 0), Some(vec![2]));
        // No class-0 entry is left: nothing is evicted.
        assert_eq!(c.admit_within(5, 10, key, 0), None);
        assert!(c.contains(1) && c.contains(3) && c.contains(4));
        assert_eq!(c.admit_within(5, 10, key, 1), Some(vec![1]));
    }

    #[test]
    fn holds_at_most_max_entries() {
        let mut l = Lru::new(1000, 2);
        l.admit(1, 1);
        l.admit(2, 1);
        assert_eq!(l.admit(3, 1), Some(vec![1]));
        assert!(l.contains(2) && l.contains(3) && !l.contains(1));
    }

    #[test]
    fn all_pinned_means_no_room() {
        let mut l = Lru::new(10, 4);
        l.admit(1, 10);
        l.pin(1);
        assert_eq!(l.admit(2, 5), None);
        assert!(l.contains(1));
    }
}
