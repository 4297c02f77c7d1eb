//! Which cached expert to evict: the bookkeeping of the expert cache's replacement policies,
//! without any I/O.
//!
//! Whether recency or frequency wins depends on the model (some have a stable hot set, others
//! only short-term reuse), so the policy is a choice and the cache reports hit rates per layer.

use std::collections::HashMap;

/// One routed expert of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    pub layer: u32,
    pub expert: u32,
}

impl ExpertKey {
    pub fn new(layer: u32, expert: u32) -> ExpertKey {
        ExpertKey { layer, expert }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplacementPolicy {
    /// Evict the least recently used.
    Lru,
    /// Evict the least frequently used, the least recent among equals. Every `halve_every`
    /// uses all counts are halved, so yesterday's hot set does not stay forever.
    Lfu { halve_every: u64 },
}

impl ReplacementPolicy {
    /// LFU halving counts every 4096 uses (a few hundred decode steps of a 128-expert,
    /// top-8 model).
    pub const LFU: ReplacementPolicy = ReplacementPolicy::Lfu { halve_every: 4096 };
}

/// Lookups of one layer's experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Prefetch reads issued (a later lookup of the same expert counts as a hit).
    pub prefetches: u64,
    /// Bytes of this layer's experts read from the file (demand reads and prefetches).
    pub bytes_read: u64,
}

impl LayerStats {
    pub fn hit_rate(&self) -> f64 {
        let lookups = self.hits + self.misses;
        if lookups == 0 {
            0.0
        } else {
            self.hits as f64 / lookups as f64
        }
    }
}

struct Meta {
    bytes: u64,
    last_use: u64,
    uses: u64,
}

/// The resident set as the policy sees it: sizes, recency and use counts.
pub(crate) struct Residency {
    policy: ReplacementPolicy,
    entries: HashMap<ExpertKey, Meta>,
    clock: u64,
    since_halving: u64,
    bytes: u64,
}

impl Residency {
    pub(crate) fn new(policy: ReplacementPolicy) -> Residency {
        Residency {
            policy,
            entries: HashMap::new(),
            clock: 0,
            since_halving: 0,
            bytes: 0,
        }
    }

    /// Adds `key`; `used` says whether this is a use (a demand load) or a guess (a prefetch,
    /// which should not make a mispredicted expert look popular).
    pub(crate) fn insert(&mut self, key: ExpertKey, bytes: u64, used: bool) {
        self.clock += 1;
        let meta = Meta {
            bytes,
            last_use: self.clock,
            uses: 0,
        };
        if let Some(old) = self.entries.insert(key, meta) {
            self.bytes -= old.bytes;
        }
        self.bytes += bytes;
        if used {
            self.touch(key);
        }
    }

    pub(crate) fn touch(&mut self, key: ExpertKey) {
        self.clock += 1;
        if let Some(m) = self.entries.get_mut(&key) {
            m.last_use = self.clock;
            m.uses += 1;
        }
        if let ReplacementPolicy::Lfu { halve_every } = self.policy {
            self.since_halving += 1;
            if self.since_halving >= halve_every.max(1) {
                self.since_halving = 0;
                for m in self.entries.values_mut() {
                    m.uses /= 2;
                }
            }
        }
    }

    pub(crate) fn remove(&mut self, key: ExpertKey) {
        if let Some(m) = self.entries.remove(&key) {
            self.bytes -= m.bytes;
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The entry the policy would evict first among those `evictable` allows. A linear scan:
    /// a cache holds at most a few thousand experts, and a miss costs a disk read anyway.
    pub(crate) fn victim(&self, evictable: impl Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        let candidates = self.entries.iter().filter(|(&k, _)| evictable(k));
        match self.policy {
            ReplacementPolicy::Lru => candidates.min_by_key(|(_, m)| m.last_use),
            ReplacementPolicy::Lfu { .. } => candidates.min_by_key(|(_, m)| (m.uses, m.last_use)),
        }
        .map(|(&k, _)| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(e: u32) -> ExpertKey {
        ExpertKey::new(0, e)
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut r = Residency::new(ReplacementPolicy::Lru);
        for e in 0..4 {
            r.insert(k(e), 10, true);
        }
        r.touch(k(0));
        r.touch(k(2));
        assert_eq!(r.victim(|_| true), Some(k(1)));
        assert_eq!(r.victim(|key| key != k(1)), Some(k(3)));
        r.remove(k(1));
        r.remove(k(3));
        assert_eq!(r.victim(|_| true), Some(k(0)));
        assert_eq!(r.bytes(), 20);
    }

    #[test]
    fn lfu_evicts_the_least_used_then_the_oldest() {
        let mut r = Residency::new(ReplacementPolicy::LFU);
        for e in 0..3 {
            r.insert(k(e), 10, true);
        }
        for _ in 0..3 {
            r.touch(k(0));
        }
        r.touch(k(2));
        // uses: 0 → 4, 1 → 1, 2 → 2.
        assert_eq!(r.victim(|_| true), Some(k(1)));
        r.touch(k(1));
        // 1 and 2 both used twice: the one used longer ago goes.
        assert_eq!(r.victim(|_| true), Some(k(2)));
    }

    #[test]
    fn lfu_ages_counts_so_a_past_hot_set_can_leave() {
        let mut r = Residency::new(ReplacementPolicy::Lfu { halve_every: 4 });
        r.insert(k(0), 1, true); // uses 1
        r.touch(k(0)); // 2
        r.touch(k(0)); // 3
        r.insert(k(1), 1, true); // 4th use: halved, k0 1, k1 0
        assert_eq!(r.victim(|_| true), Some(k(1)));
        r.touch(k(1));
        r.touch(k(1)); // k1 2
        assert_eq!(r.victim(|_| true), Some(k(0)));
        // Without aging, k0's three early uses would keep it.
        let mut r = Residency::new(ReplacementPolicy::Lfu {
            halve_every: u64::MAX,
        });
        r.insert(k(0), 1, true);
        r.touch(k(0));
        r.touch(k(0));
        r.insert(k(1), 1, true);
        r.touch(k(1));
        assert_eq!(r.victim(|_| true), Some(k(1)));
    }

    #[test]
    fn a_prefetched_entry_has_no_uses_until_used() {
        let mut r = Residency::new(ReplacementPolicy::LFU);
        r.insert(k(0), 1, true);
        r.insert(k(1), 1, false);
        assert_eq!(r.victim(|_| true), Some(k(1)));
        r.touch(k(1));
        r.touch(k(1));
        assert_eq!(r.victim(|_| true), Some(k(0)));
    }
}
