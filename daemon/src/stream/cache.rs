//! [`ExpertCache`]: routed experts kept in the reader's buffers, bounded in bytes, loaded on
//! demand or ahead of time.
//!
//! An expert is the list of file extents the [`ExpertLocator`] names (its gate, up and down
//! slices, which live in three tensors), one tile each. A lookup hands out an
//! `Arc<Expert>`: while any clone is alive the expert is pinned and cannot be evicted.
//! Cached tiles stay in the pool's buffers (no copy), so the pool needs a buffer per cached
//! tile plus some for reads in flight; when the pool runs dry the cache evicts to free one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::error::StreamError;
use super::policy::{ExpertKey, LayerStats, ReplacementPolicy, Residency};
use super::reader::TileReader;
use super::request::{Priority, ReadHandle, ReadTimes, Tile, TileRequest};

/// `len` bytes of the file at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: usize,
}

/// Where an expert's bytes are in the file.
pub trait ExpertLocator: Send + Sync {
    fn extents(&self, key: ExpertKey) -> Vec<Extent>;
}

impl<F: Fn(ExpertKey) -> Vec<Extent> + Send + Sync> ExpertLocator for F {
    fn extents(&self, key: ExpertKey) -> Vec<Extent> {
        self(key)
    }
}

/// A loaded expert: its tiles in the order the locator listed the extents.
#[derive(Debug)]
pub struct Expert {
    key: ExpertKey,
    tiles: Vec<Tile>,
}

impl Expert {
    pub fn key(&self) -> ExpertKey {
        self.key
    }

    pub fn tiles(&self) -> &[Tile] {
        &self.tiles
    }

    /// The bytes of extent `i`.
    pub fn part(&self, i: usize) -> &[u8] {
        self.tiles[i].bytes()
    }
}

/// Read tags of the cache carry this bit, so a reader shared with other users can tell them
/// apart.
const TAG_BIT: u64 = 1 << 63;

fn tag(key: ExpertKey) -> u64 {
    TAG_BIT | (key.layer as u64) << 32 | key.expert as u64
}

enum Entry {
    Ready(Arc<Expert>),
    /// Reads issued (as prefetches, or a demand read waited on elsewhere).
    Loading(Vec<ReadHandle>),
}

pub struct ExpertCache {
    reader: Arc<TileReader>,
    locator: Box<dyn ExpertLocator>,
    capacity: u64,
    residency: Residency,
    entries: HashMap<ExpertKey, Entry>,
    stats: Vec<LayerStats>,
    /// The loads finished since the last [`ExpertCache::take_reads`], while tracing.
    reads: Option<Vec<ExpertRead>>,
    /// Experts no eviction may choose while [`ExpertCache::get_all`] reads ahead: the ones it
    /// is loading to hold.
    spared: Vec<ExpertKey>,
}

/// One expert's load from the file, for traces: from its first read's issue to its last read's
/// end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertRead {
    pub key: ExpertKey,
    /// Bytes of its tiles that arrived.
    pub bytes: u64,
    pub issued: Instant,
    pub done: Instant,
}

impl ExpertCache {
    /// A cache of at most `capacity` bytes of expert data read through `reader`.
    pub fn new(
        reader: Arc<TileReader>,
        locator: Box<dyn ExpertLocator>,
        capacity: u64,
        policy: ReplacementPolicy,
    ) -> ExpertCache {
        ExpertCache {
            reader,
            locator,
            capacity,
            residency: Residency::new(policy),
            entries: HashMap::new(),
            stats: Vec::new(),
            reads: None,
            spared: Vec::new(),
        }
    }

    /// Records each load's times from now on ([`ExpertCache::take_reads`]), or stops.
    pub fn set_tracing(&mut self, on: bool) {
        self.reads = on.then(Vec::new);
    }

    /// The loads finished since the last call, while tracing.
    pub fn take_reads(&mut self) -> Vec<ExpertRead> {
        self.reads.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The expert, from the cache or read now as a demand read (overtaking prefetches).
    /// An expert being prefetched is promoted and waited for; that counts as a hit.
    pub fn get_or_load(&mut self, key: ExpertKey) -> Result<Arc<Expert>, StreamError> {
        let mut held = self.get_all(&[key], &[])?;
        Ok(held.pop().expect("one expert asked, one held"))
    }

    /// The experts `keys`, in that order, held together: the cached ones first (so that no
    /// read evicts them), then the reads of every other one issued at once as demand reads
    /// and waited for. Counts as [`ExpertCache::get_or_load`] of each.
    ///
    /// `ahead` are prefetched ([`ExpertCache::prefetch`]) once the reads of `keys` are issued,
    /// without evicting any of `keys`: the experts a later layer is expected to choose, read
    /// while these are waited for and used.
    ///
    /// # Errors
    /// As [`ExpertCache::get_or_load`]; the reads already issued go on as prefetches.
    pub fn get_all(
        &mut self,
        keys: &[ExpertKey],
        ahead: &[ExpertKey],
    ) -> Result<Vec<Arc<Expert>>, StreamError> {
        let mut held: Vec<Option<Arc<Expert>>> = vec![None; keys.len()];
        for (h, &key) in held.iter_mut().zip(keys) {
            if let Some(Entry::Ready(expert)) = self.entries.get(&key) {
                *h = Some(Arc::clone(expert));
                self.stats_mut(key.layer).hits += 1;
                self.residency.touch(key);
            }
        }
        for (h, &key) in held.iter().zip(keys) {
            if h.is_some() {
                continue;
            }
            if self.entries.contains_key(&key) {
                self.stats_mut(key.layer).hits += 1;
                self.reader.promote(tag(key));
                self.residency.touch(key);
            } else {
                self.stats_mut(key.layer).misses += 1;
                let handles = self.start_load(key, Priority::Demand)?;
                self.entries.insert(key, Entry::Loading(handles));
            }
        }
        if !ahead.is_empty() {
            // Behind this call's demand reads, so the disk has the next ones queued while
            // these finish; no eviction chooses an expert this call is loading.
            self.spared = keys.to_vec();
            self.prefetch(ahead);
            self.spared.clear();
        }
        for (h, &key) in held.iter_mut().zip(keys) {
            if h.is_some() {
                continue;
            }
            // Making room for a later key can have finished this one's load, or (rarely)
            // evicted it once finished.
            *h = Some(match self.entries.get(&key) {
                Some(Entry::Ready(expert)) => Arc::clone(expert),
                Some(Entry::Loading(_)) => self.finish_load(key)?,
                None => {
                    let handles = self.start_load(key, Priority::Demand)?;
                    self.entries.insert(key, Entry::Loading(handles));
                    self.finish_load(key)?
                }
            });
        }
        Ok(held
            .into_iter()
            .map(|h| h.expect("every key held"))
            .collect())
    }

    /// Starts prefetch reads for the experts not cached yet, as far as room allows without
    /// waiting: only unpinned, loaded experts are evicted for them. Returns how many started.
    pub fn prefetch(&mut self, keys: &[ExpertKey]) -> usize {
        self.settle();
        let mut started = 0;
        for &key in keys {
            if self.entries.contains_key(&key) {
                continue;
            }
            match self.start_load(key, Priority::Prefetch) {
                Ok(handles) => {
                    self.entries.insert(key, Entry::Loading(handles));
                    self.stats_mut(key.layer).prefetches += 1;
                    started += 1;
                }
                Err(_) => break,
            }
        }
        started
    }

    /// Drops a prefetch that turned out wrong; returns whether one was in progress.
    pub fn cancel_prefetch(&mut self, key: ExpertKey) -> bool {
        if !matches!(self.entries.get(&key), Some(Entry::Loading(_))) {
            return false;
        }
        self.reader.cancel(tag(key));
        self.entries.remove(&key);
        self.residency.remove(key);
        true
    }

    /// Whether `key` is in RAM or being read.
    pub fn has(&self, key: ExpertKey) -> bool {
        self.entries.contains_key(&key)
    }

    pub fn contains(&self, key: ExpertKey) -> bool {
        matches!(self.entries.get(&key), Some(Entry::Ready(_)))
    }

    /// Whether `key` is loaded and held outside the cache.
    pub fn is_pinned(&self, key: ExpertKey) -> bool {
        matches!(self.entries.get(&key), Some(Entry::Ready(e)) if Arc::strong_count(e) > 1)
    }

    /// Bytes of cached and loading experts.
    pub fn resident_bytes(&self) -> u64 {
        self.residency.bytes()
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// RAM the cache's reader allocated for its buffers (cached tiles and reads in flight).
    pub fn buffer_bytes(&self) -> u64 {
        let pool = self.reader.pool();
        (pool.count() * pool.buffer_size()) as u64
    }

    /// The reader the cache loads through.
    pub fn reader(&self) -> &Arc<TileReader> {
        &self.reader
    }

    pub fn stats(&self, layer: u32) -> LayerStats {
        self.stats.get(layer as usize).copied().unwrap_or_default()
    }

    /// Every layer's counters, by layer index.
    pub fn layer_stats(&self) -> &[LayerStats] {
        &self.stats
    }

    fn stats_mut(&mut self, layer: u32) -> &mut LayerStats {
        let i = layer as usize;
        if self.stats.len() <= i {
            self.stats.resize(i + 1, LayerStats::default());
        }
        &mut self.stats[i]
    }

    /// Makes room and issues the reads of `key`'s extents.
    fn start_load(
        &mut self,
        key: ExpertKey,
        priority: Priority,
    ) -> Result<Vec<ReadHandle>, StreamError> {
        let extents = self.locator.extents(key);
        let bytes: u64 = extents.iter().map(|e| e.len as u64).sum();
        while self.residency.bytes() + bytes > self.capacity {
            // Room comes from a loaded expert no one holds, or, for a demand read, from a
            // prefetch finished so that it can be one.
            let demand = priority == Priority::Demand;
            if !(self.evict_one() || demand && self.wait_one_load(key)) {
                return Err(StreamError::CacheFull {
                    needed: bytes,
                    capacity: self.capacity,
                    pinned: self.residency.bytes(),
                });
            }
        }
        self.residency
            .insert(key, bytes, priority == Priority::Demand);
        let mut handles = Vec::with_capacity(extents.len());
        for e in extents {
            let buf = loop {
                if let Some(buf) = self.reader.pool().try_acquire() {
                    break Ok(buf);
                }
                if self.evict_one() || (priority == Priority::Demand && self.wait_one_load(key)) {
                    continue;
                }
                break Err(StreamError::BuffersExhausted {
                    buffers: self.reader.pool().count(),
                });
            };
            let buf = match buf {
                Ok(buf) => buf,
                Err(e) => {
                    self.reader.cancel(tag(key));
                    self.residency.remove(key);
                    return Err(e);
                }
            };
            let request = TileRequest {
                offset: e.offset,
                len: e.len,
                priority,
                tag: tag(key),
            };
            handles.push(self.reader.read(request, buf));
        }
        Ok(handles)
    }

    /// Waits for `key`'s reads and makes it ready; a failed load leaves no entry.
    fn finish_load(&mut self, key: ExpertKey) -> Result<Arc<Expert>, StreamError> {
        let Some(Entry::Loading(handles)) = self.entries.remove(&key) else {
            unreachable!("finish_load of an expert that is not loading");
        };
        let (results, times): (Vec<Result<Tile, StreamError>>, Vec<ReadTimes>) =
            handles.into_iter().map(|h| h.wait_timed()).unzip();
        let read: u64 = results.iter().flatten().map(|t| t.len() as u64).sum();
        self.stats_mut(key.layer).bytes_read += read;
        if let (Some(reads), Some(first)) = (self.reads.as_mut(), times.first()) {
            reads.push(ExpertRead {
                key,
                bytes: read,
                issued: times.iter().map(|t| t.issued).min().unwrap_or(first.issued),
                done: times.iter().map(|t| t.done).max().unwrap_or(first.done),
            });
        }
        let tiles: Result<Vec<Tile>, StreamError> = results.into_iter().collect();
        match tiles {
            Ok(tiles) => {
                let expert = Arc::new(Expert { key, tiles });
                self.entries.insert(key, Entry::Ready(Arc::clone(&expert)));
                Ok(expert)
            }
            Err(e) => {
                self.residency.remove(key);
                Err(e)
            }
        }
    }

    /// Evicts the policy's choice among loaded, unpinned experts; false when there is none.
    fn evict_one(&mut self) -> bool {
        self.settle();
        let (entries, spared) = (&self.entries, &self.spared);
        let victim = self.residency.victim(|k| {
            matches!(entries.get(&k), Some(Entry::Ready(e)) if Arc::strong_count(e) == 1)
                && !spared.contains(&k)
        });
        let Some(victim) = victim else {
            return false;
        };
        self.entries.remove(&victim);
        self.residency.remove(victim);
        self.stats_mut(victim.layer).evictions += 1;
        true
    }

    /// Completes some other expert's load (a prefetch holding buffers) so it can be evicted;
    /// false when nothing else is loading.
    fn wait_one_load(&mut self, except: ExpertKey) -> bool {
        let other = self
            .entries
            .iter()
            .find(|(&k, e)| k != except && matches!(e, Entry::Loading(_)))
            .map(|(&k, _)| k);
        let Some(other) = other else {
            return false;
        };
        self.reader.promote(tag(other));
        let _ = self.finish_load(other);
        true
    }

    /// Turns loads whose reads have all landed into ready entries; failed prefetches leave.
    fn settle(&mut self) {
        let done: Vec<ExpertKey> = self
            .entries
            .iter()
            .filter(|(_, e)| matches!(e, Entry::Loading(h) if h.iter().all(|h| h.is_done())))
            .map(|(&k, _)| k)
            .collect();
        for key in done {
            if let Err(e) = self.finish_load(key) {
                tracing::debug!(
                    "prefetch of layer {} expert {} failed: {e}",
                    key.layer,
                    key.expert
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::tests::{pattern, test_dir, write_file};
    use crate::stream::{BackendChoice, ReaderOptions, StorageFaults};

    /// Each expert: two extents (6000 and 4000 bytes) at offsets off alignment.
    const EXPERT: usize = 10_000;
    const EXPERTS: u32 = 8;
    const LAYERS: u32 = 4;

    struct Fixture {
        _dir: tempfile::TempDir,
        data: Vec<u8>,
        cache: ExpertCache,
    }

    fn fixture(policy: ReplacementPolicy, capacity_experts: u64, buffers: usize) -> Fixture {
        let dir = test_dir();
        let data = pattern(LAYERS as usize * EXPERTS as usize * EXPERT + 17, 20);
        let path = write_file(dir.path(), "experts.bin", &data);
        let options = ReaderOptions {
            backend: BackendChoice::Auto,
            queue_depth: 2,
            chunk_size: 64 << 10,
            buffers,
            max_tile: 6000,
            faults: StorageFaults::default(),
        };
        let reader = Arc::new(TileReader::open(&path, &options).unwrap());
        let locator = |k: ExpertKey| {
            let base = 17 + ((k.layer * EXPERTS + k.expert) as usize * EXPERT) as u64;
            vec![
                Extent {
                    offset: base,
                    len: 6000,
                },
                Extent {
                    offset: base + 6000,
                    len: 4000,
                },
            ]
        };
        let cache = ExpertCache::new(
            reader,
            Box::new(locator),
            capacity_experts * EXPERT as u64,
            policy,
        );
        Fixture {
            _dir: dir,
            data,
            cache,
        }
    }

    fn k(layer: u32, expert: u32) -> ExpertKey {
        ExpertKey::new(layer, expert)
    }

    impl Fixture {
        fn get(&mut self, layer: u32, expert: u32) -> Arc<Expert> {
            let e = self.cache.get_or_load(k(layer, expert)).unwrap();
            let base = 17 + ((layer * EXPERTS + expert) as usize * EXPERT);
            assert!(e.part(0) == &self.data[base..base + 6000]);
            assert!(e.part(1) == &self.data[base + 6000..base + EXPERT]);
            e
        }

        fn resident(&self, layer: u32) -> Vec<u32> {
            (0..EXPERTS)
                .filter(|&e| self.cache.contains(k(layer, e)))
                .collect()
        }
    }

    #[test]
    fn lru_evicts_the_least_recently_used_expert() {
        let mut f = fixture(ReplacementPolicy::Lru, 3, 16);
        for e in [0, 1, 2, 0, 3] {
            f.get(0, e);
        }
        assert_eq!(f.resident(0), [0, 2, 3]);
        f.get(0, 1);
        assert_eq!(f.resident(0), [0, 1, 3]);
        let s = f.cache.stats(0);
        assert_eq!((s.hits, s.misses, s.evictions), (1, 5, 2));
        assert_eq!(f.cache.resident_bytes(), 3 * EXPERT as u64);
    }

    #[test]
    fn lfu_evicts_the_least_frequently_used_expert() {
        let mut f = fixture(ReplacementPolicy::LFU, 3, 16);
        for e in [0, 0, 0, 1, 2, 2, 3] {
            f.get(0, e);
        }
        // Uses: 0 three times, 1 once, 2 twice: 1 went for 3.
        assert_eq!(f.resident(0), [0, 2, 3]);
        f.get(0, 1);
        // 3 and the new 1 were used once each; 3 is older.
        assert_eq!(f.resident(0), [0, 1, 2]);
        let s = f.cache.stats(0);
        assert_eq!((s.hits, s.misses, s.evictions), (3, 5, 2));
    }

    #[test]
    fn counters_are_kept_per_layer() {
        let mut f = fixture(ReplacementPolicy::Lru, 2, 16);
        f.get(0, 0);
        f.get(1, 0);
        f.get(0, 0);
        f.get(2, 5);
        assert_eq!(
            f.cache.stats(0),
            LayerStats {
                hits: 1,
                misses: 1,
                evictions: 0,
                prefetches: 0,
                bytes_read: EXPERT as u64,
            }
        );
        // Each miss read one expert, and the reader delivered just those bytes.
        let read: u64 = f.cache.layer_stats().iter().map(|s| s.bytes_read).sum();
        assert_eq!(read, 3 * EXPERT as u64);
        assert_eq!(f.cache.reader().delivered(), (read, 6));
        // Layer 2's load evicted layer 1's expert, the least recently used.
        assert_eq!(f.cache.stats(1).evictions, 1);
        assert_eq!(f.cache.stats(2).misses, 1);
        assert_eq!(f.cache.stats(3), LayerStats::default());
        assert_eq!(f.cache.layer_stats().len(), 3);
        assert_eq!(f.cache.stats(0).hit_rate(), 0.5);
    }

    #[test]
    fn a_pinned_expert_is_not_evicted() {
        let mut f = fixture(ReplacementPolicy::Lru, 2, 16);
        let held = f.get(0, 0);
        f.get(0, 1);
        f.get(0, 2);
        assert!(f.cache.is_pinned(k(0, 0)));
        assert_eq!(f.resident(0), [0, 2]);
        drop(held);
        f.get(0, 3);
        assert_eq!(f.resident(0), [2, 3]);
    }

    #[test]
    fn a_cache_full_of_pinned_experts_refuses_more() {
        let mut f = fixture(ReplacementPolicy::Lru, 2, 16);
        let _a = f.get(0, 0);
        let _b = f.get(0, 1);
        assert!(matches!(
            f.cache.get_or_load(k(0, 2)),
            Err(StreamError::CacheFull { .. })
        ));
        assert_eq!(f.resident(0), [0, 1]);
    }

    #[test]
    fn a_prefetched_expert_is_a_hit() {
        let mut f = fixture(ReplacementPolicy::Lru, 4, 16);
        assert_eq!(f.cache.prefetch(&[k(1, 4), k(1, 5)]), 2);
        f.get(1, 5);
        f.get(1, 4);
        let s = f.cache.stats(1);
        assert_eq!((s.hits, s.misses, s.prefetches), (2, 0, 2));
        // Already cached: nothing to prefetch.
        assert_eq!(f.cache.prefetch(&[k(1, 4)]), 0);
    }

    #[test]
    fn get_all_holds_its_experts_and_reads_ahead_without_evicting_them() {
        // Room for four experts: two cached, two held by get_all, the rest read ahead.
        let mut f = fixture(ReplacementPolicy::Lru, 4, 16);
        f.get(0, 0);
        f.get(0, 1);
        let keys = [k(0, 1), k(0, 2), k(0, 3)];
        let held = f.cache.get_all(&keys, &[k(1, 0), k(1, 1)]).unwrap();
        for (e, key) in held.iter().zip(keys) {
            assert_eq!(e.key(), key);
            let base = 17 + ((key.layer * EXPERTS + key.expert) as usize * EXPERT);
            assert!(e.part(0) == &f.data[base..base + 6000]);
            assert!(e.part(1) == &f.data[base + 6000..base + EXPERT]);
        }
        let s = f.cache.stats(0);
        assert_eq!(
            (s.hits, s.misses),
            (1, 2 + 2),
            "get's two misses, get_all's two"
        );
        // Expert 0, held by no one, made room for one read ahead; the held ones stayed.
        assert_eq!(f.resident(0), [1, 2, 3]);
        assert_eq!(f.cache.stats(1).prefetches, 1);
        drop(held);
        f.get(1, 0);
        assert_eq!(f.cache.stats(1).hits, 1);
    }

    #[test]
    fn a_cancelled_prefetch_leaves_nothing_behind() {
        let mut f = fixture(ReplacementPolicy::Lru, 4, 16);
        assert_eq!(f.cache.prefetch(&[k(2, 6)]), 1);
        assert!(f.cache.cancel_prefetch(k(2, 6)));
        assert!(!f.cache.contains(k(2, 6)));
        assert_eq!(f.cache.resident_bytes(), 0);
        f.get(2, 6);
        assert_eq!(f.cache.stats(2).misses, 1);
    }

    #[test]
    fn running_out_of_buffers_evicts() {
        // Room for ten experts by bytes, but buffers for two (two tiles each).
        let mut f = fixture(ReplacementPolicy::Lru, 10, 4);
        f.get(0, 0);
        f.get(0, 1);
        f.get(0, 2);
        assert_eq!(f.resident(0), [1, 2]);
        assert_eq!(f.cache.stats(0).evictions, 1);
        // With every buffer pinned, a load cannot proceed.
        let _a = f.get(0, 1);
        let _b = f.get(0, 2);
        assert!(matches!(
            f.cache.get_or_load(k(0, 3)),
            Err(StreamError::BuffersExhausted { buffers: 4 })
        ));
        assert_eq!(f.cache.resident_bytes(), 2 * EXPERT as u64);
    }

    #[test]
    fn a_failed_load_leaves_no_entry() {
        let mut f = fixture(ReplacementPolicy::Lru, 4, 16);
        // Past the end of the file.
        match f.cache.get_or_load(k(LAYERS + 1, 0)) {
            Err(StreamError::ShortRead { .. }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(f.cache.resident_bytes(), 0);
        f.get(0, 0);
    }
}
