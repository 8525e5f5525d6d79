//! Sets and maps keyed by the dispatcher's own integer ids.

use std::collections::{HashMap, HashSet};

/// FxHash-style hashing for the dispatcher's own integer ids (request and
/// model ids it assigns itself, so not attacker-chosen): SipHash is a
/// measurable share of a routing decision.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
}

pub(super) type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;
pub(super) type IdSet<K> = HashSet<K, std::hash::BuildHasherDefault<IdHasher>>;

/// A set of the dispatcher's model ids as a bitset: routing asks every GPU
/// whether it or its host holds the model, and a bit test is a load and a
/// shift where a hash set costs a hash and a probe (measured: the host
/// lookups were a quarter of a decision over 64 GPUs). At most
/// [`MODELS_MAX`](super::core::MODELS_MAX) bits, 8 KiB.
#[derive(Debug, Default, Clone)]
pub(super) struct ModelSet {
    words: Vec<u64>,
}

impl ModelSet {
    pub(super) fn contains(&self, model: &u32) -> bool {
        let m = *model as usize;
        self.words
            .get(m / 64)
            .is_some_and(|w| w >> (m % 64) & 1 == 1)
    }

    /// Adds `model`; false if it was there.
    pub(super) fn insert(&mut self, model: u32) -> bool {
        let m = model as usize;
        if self.words.len() <= m / 64 {
            self.words.resize(m / 64 + 1, 0);
        }
        let bit = 1u64 << (m % 64);
        let fresh = self.words[m / 64] & bit == 0;
        self.words[m / 64] |= bit;
        fresh
    }

    /// Removes `model`; false if it was not there.
    pub(super) fn remove(&mut self, model: &u32) -> bool {
        let m = *model as usize;
        let Some(w) = self.words.get_mut(m / 64) else {
            return false;
        };
        let bit = 1u64 << (m % 64);
        let had = *w & bit != 0;
        *w &= !bit;
        had
    }

    pub(super) fn clear(&mut self) {
        self.words.clear();
    }
}

impl FromIterator<u32> for ModelSet {
    fn from_iter<I: IntoIterator<Item = u32>>(it: I) -> Self {
        let mut s = ModelSet::default();
        for m in it {
            s.insert(m);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_set_inserts_removes_and_grows() {
        let mut s = ModelSet::default();
        assert!(!s.contains(&3));
        assert!(s.insert(3) && s.insert(200) && s.insert(64) && s.insert(0));
        assert!(!s.insert(64), "a second insert adds nothing");
        assert!([0, 3, 64, 200].iter().all(|m| s.contains(m)));
        assert!(s.remove(&64) && !s.remove(&64) && !s.remove(&100_000));
        assert!(!s.contains(&64) && s.contains(&200) && !s.contains(&100_000));
        s.clear();
        assert!(![0, 3, 200].iter().any(|m| s.contains(m)));
        let t: ModelSet = [5, 5, 70].into_iter().collect();
        assert!(t.contains(&5) && t.contains(&70) && !t.contains(&6));
    }
}
