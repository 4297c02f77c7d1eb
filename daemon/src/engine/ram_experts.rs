//! Routed experts read through a RAM tier instead of the memory map: an [`ExpertCache`] bounded
//! by a RAM budget, whose misses are read from the model file (io_uring, O_DIRECT). Used by the
//! CPU engine for a MoE model under `--ram-budget`, and by a GPU model for the experts it
//! computes on the CPU; both compute with [`routed_experts_with`], so an expert's output is
//! the same bits whether its weights came from the map or from a read.
//!
//! A call's experts are held (pinned) in the cache while their products run, so a call takes
//! them a group at a time: as many as half the cache holds, never fewer than a token's `k`.
//! The hits of a group are pinned first, then every miss is issued at once (the disk sees the
//! whole group's reads together, not one expert's at a time), then the next group's are issued
//! as prefetches before the products run, so reading overlaps computing.
//!
//! A call can also name the experts the next layer is expected to choose (its router applied to
//! the current hidden state): those out of RAM start reading behind this layer's own reads and
//! go on while this layer computes. When that layer's routing is known, the predictions it did
//! not choose and that are still being read are cancelled. A wrong prediction costs the disk
//! a read and a right one only moves a read earlier, so predictions are read ahead only while
//! at least 60% of the recent ones out of RAM were chosen (the others are still counted).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::cpu::ThreadPool;
use crate::model::{MatRef, Model, MoeWeights};
use crate::stream::{expert_bytes, Expert, ExpertCache, ExpertKey, StreamError};

use super::experts::routed_experts_with;

/// A model's routed experts in a RAM cache read from its file.
pub struct RamExperts {
    cache: Mutex<ExpertCache>,
    /// Experts one group of a call holds at once.
    group: usize,
    /// Whether passes predict the next layer's experts and read them ahead.
    predict: bool,
    /// Time spent getting experts (waiting for their reads, mostly).
    wait_ns: AtomicU64,
    /// Experts whose reads were started ahead of their layer, and how many predictions the
    /// routing then chose and did not.
    predicted: Mutex<Predictions>,
}

#[derive(Default)]
struct Predictions {
    /// Each with whether it was out of RAM when predicted (a read it would start).
    pending: Vec<(ExpertKey, bool)>,
    right: u64,
    wrong: u64,
    /// Recent predictions of experts out of RAM that the routing chose, and did not (halved
    /// as they grow): whether reading ahead pays.
    recent_right: u32,
    recent_wrong: u32,
}

/// Predictions of experts out of RAM counted before their precision decides anything.
const PREDICTIONS_WARM_UP: u32 = 32;
/// Counts past which the recent ones are halved.
const PREDICTIONS_WINDOW: u32 = 512;
/// The share of predicted reads the routing must choose for reads to start ahead: a wrong one
/// takes the disk from a demand read, a right one only moves a read earlier.
const PREDICTIONS_PRECISION: f64 = 0.6;

impl Predictions {
    /// Whether predicted experts out of RAM are read ahead now.
    fn reading_ahead(&self) -> bool {
        let seen = self.recent_right + self.recent_wrong;
        seen < PREDICTIONS_WARM_UP
            || f64::from(self.recent_right) >= PREDICTIONS_PRECISION * f64::from(seen)
    }
}

/// What a RAM tier did: its counters over every layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct RamTierStats {
    /// RAM its buffers take.
    pub buffer_bytes: u64,
    /// Lookups of an expert already in RAM (or being read ahead), and of one read on demand.
    pub hits: u64,
    pub misses: u64,
    /// Bytes of experts read from the file, on demand and ahead.
    pub bytes_read: u64,
    /// Experts read ahead.
    pub prefetches: u64,
    /// Next-layer predictions its routing then chose, and did not.
    pub predicted_right: u64,
    pub predicted_wrong: u64,
    /// Milliseconds the computing thread waited to get experts (their reads, mostly).
    pub wait_ms: f64,
}

impl RamTierStats {
    /// One line for a person.
    pub fn summary(&self) -> String {
        let lookups = self.hits + self.misses;
        let mut line = format!(
            "RAM tier: {:.1} MiB of buffers; {lookups} expert lookups, {:.1}% in RAM; {:.1} MiB \
             read from the file ({} experts read ahead), {:.1} ms waited for experts",
            self.buffer_bytes as f64 / (1u64 << 20) as f64,
            100.0 * self.hits as f64 / lookups.max(1) as f64,
            self.bytes_read as f64 / (1u64 << 20) as f64,
            self.prefetches,
            self.wait_ms,
        );
        let predicted = self.predicted_right + self.predicted_wrong;
        if predicted > 0 {
            line += &format!(
                "; next-layer predictions {:.1}% right",
                100.0 * self.predicted_right as f64 / predicted as f64
            );
        }
        line
    }
}

impl std::fmt::Debug for RamExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RamExperts")
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl RamExperts {
    /// The experts of `model` through `cache` (see [`crate::stream::open_expert_cache`]);
    /// with `predict`, the CPU engine's decode steps read the next layer's expected experts
    /// ahead.
    pub fn new(model: &Model, cache: ExpertCache, predict: bool) -> RamExperts {
        let k = model.config.moe.map_or(1, |m| m.n_expert_used).max(1);
        let whole = (cache.capacity() / expert_bytes(model).max(1)) as usize;
        RamExperts {
            cache: Mutex::new(cache),
            group: (whole / 2).max(k),
            predict,
            wait_ns: AtomicU64::new(0),
            predicted: Mutex::new(Predictions::default()),
        }
    }

    /// Whether decode steps read the next layer's expected experts ahead.
    pub fn predicts(&self) -> bool {
        self.predict
    }

    /// The cache, for its counters and reader.
    pub fn cache(&self) -> parking_lot::MutexGuard<'_, ExpertCache> {
        self.cache.lock()
    }

    /// The unweighted outputs of experts `chosen` of MoE layer `layer` (weights `moe`) for the
    /// rows of `xn`, `k` chosen a row, as [`routed_experts`](super::experts::routed_experts)
    /// computes them from the memory map.
    ///
    /// `next` names experts of layer `layer + 1` to read ahead (the next layer's predicted
    /// choices), once this call's first experts are in.
    ///
    /// # Errors
    /// A read of an expert from the file failed; nothing of the call's output is returned.
    #[allow(clippy::too_many_arguments)]
    pub fn outputs(
        &self,
        pool: &ThreadPool,
        moe: &MoeWeights,
        layer: usize,
        xn: &[f32],
        chosen: &[usize],
        k: usize,
        next: &[usize],
    ) -> Result<Vec<f32>, StreamError> {
        let mut distinct = chosen.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        self.correct(layer, &distinct);
        let groups: Vec<&[usize]> = distinct.chunks(self.group).collect();
        let Some(&first) = groups.first() else {
            return Ok(Vec::new());
        };
        let ahead = self.ahead(layer + 1, next);
        let mut held = self.get_all(&keys(layer, first), &ahead)?;
        if groups.len() == 1 {
            return Ok(self.run(pool, moe, &held, first, xn, chosen, k));
        }
        // Several groups: each computes the slots that chose its experts, one row per slot.
        let e = moe.gate.n_in;
        let mut out = vec![0.0f32; chosen.len() * e];
        for (i, group) in groups.iter().enumerate() {
            if let Some(following) = groups.get(i + 1) {
                self.cache.lock().prefetch(&keys(layer, following));
            }
            let slots: Vec<usize> = (0..chosen.len())
                .filter(|&s| group.binary_search(&chosen[s]).is_ok())
                .collect();
            let rows: Vec<f32> = slots
                .iter()
                .flat_map(|&s| xn[s / k * e..(s / k + 1) * e].iter().copied())
                .collect();
            let picked: Vec<usize> = slots.iter().map(|&s| chosen[s]).collect();
            let y = self.run(pool, moe, &held, group, &rows, &picked, 1);
            for (&s, y) in slots.iter().zip(y.chunks_exact(e)) {
                out[s * e..(s + 1) * e].copy_from_slice(y);
            }
            if let Some(following) = groups.get(i + 1) {
                drop(std::mem::take(&mut held));
                held = self.get_all(&keys(layer, following), &[])?;
            }
        }
        Ok(out)
    }

    /// [`routed_experts_with`] over the experts `group` (sorted), held in `held` in that order.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        pool: &ThreadPool,
        moe: &MoeWeights,
        held: &[Arc<Expert>],
        group: &[usize],
        xn: &[f32],
        chosen: &[usize],
        k: usize,
    ) -> Vec<f32> {
        let mats = |ex: usize| -> [MatRef<'_>; 3] {
            let i = group.binary_search(&ex).expect("an expert of the group");
            let stacks = [&moe.gate, &moe.up, &moe.down];
            std::array::from_fn(|m| MatRef {
                ty: stacks[m].ty,
                n_in: stacks[m].n_in,
                n_out: stacks[m].n_out,
                data: held[i].part(m),
            })
        };
        routed_experts_with(pool, &mats, xn, chosen, k)
    }

    /// [`ExpertCache::get_all`], its time counted as waiting for reads.
    fn get_all(
        &self,
        keys: &[ExpertKey],
        ahead: &[ExpertKey],
    ) -> Result<Vec<Arc<Expert>>, StreamError> {
        let start = Instant::now();
        let held = self.cache.lock().get_all(keys, ahead);
        self.wait_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        held
    }

    /// Records the predictions `next` for `layer` and returns those to read ahead: the ones out
    /// of RAM, while recent predictions of such experts were right often enough.
    fn ahead(&self, layer: usize, next: &[usize]) -> Vec<ExpertKey> {
        if next.is_empty() {
            return Vec::new();
        }
        let mut predicted = self.predicted.lock();
        let cache = self.cache.lock();
        let reading = predicted.reading_ahead();
        let mut ahead = Vec::new();
        for key in keys(layer, next) {
            let out = !cache.has(key);
            predicted.pending.push((key, out));
            if out && reading {
                ahead.push(key);
            }
        }
        ahead
    }

    /// Cancels the predictions for `layer` that its routing did not choose (`distinct`,
    /// sorted) and that are still being read, and counts how many were right.
    fn correct(&self, layer: usize, distinct: &[usize]) {
        let mut predicted = self.predicted.lock();
        if predicted.pending.is_empty() {
            return;
        }
        let mut cache = self.cache.lock();
        let (mut right, mut wrong, mut out_right, mut out_wrong) = (0, 0, 0, 0);
        predicted.pending.retain(|&(key, out)| {
            if key.layer as usize != layer {
                return true;
            }
            let chosen = distinct.binary_search(&(key.expert as usize)).is_ok();
            if chosen {
                right += 1;
                out_right += u32::from(out);
            } else {
                wrong += 1;
                out_wrong += u32::from(out);
                cache.cancel_prefetch(key);
            }
            false
        });
        let p = &mut *predicted;
        p.right += right;
        p.wrong += wrong;
        p.recent_right += out_right;
        p.recent_wrong += out_wrong;
        if p.recent_right + p.recent_wrong > PREDICTIONS_WINDOW {
            p.recent_right /= 2;
            p.recent_wrong /= 2;
        }
    }

    /// Its counters so far.
    pub fn stats(&self) -> RamTierStats {
        // In `correct`'s order.
        let predicted = self.predicted.lock();
        let cache = self.cache.lock();
        let mut stats = RamTierStats {
            buffer_bytes: cache.buffer_bytes(),
            predicted_right: predicted.right,
            predicted_wrong: predicted.wrong,
            wait_ms: self.wait_ns.load(Ordering::Relaxed) as f64 / 1e6,
            ..RamTierStats::default()
        };
        for l in cache.layer_stats() {
            stats.hits += l.hits;
            stats.misses += l.misses;
            stats.bytes_read += l.bytes_read;
            stats.prefetches += l.prefetches;
        }
        stats
    }
}

fn keys(layer: usize, experts: &[usize]) -> Vec<ExpertKey> {
    experts
        .iter()
        .map(|&ex| ExpertKey::new(layer as u32, ex as u32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{argmax, BatchEngine, Engine, EngineError, EngineOptions};
    use crate::server::profile::costs::tests::tiny_moe;
    use crate::stream::{
        minimum_ram_budget, open_expert_cache_with, ReplacementPolicy, StorageFaults,
    };

    const OPTIONS: EngineOptions = EngineOptions {
        threads: 2,
        context: 128,
    };

    fn ram(model: &Model, budget: u64, predict: bool, faults: StorageFaults) -> Arc<RamExperts> {
        let cache = open_expert_cache_with(model, budget, ReplacementPolicy::Lru, faults).unwrap();
        Arc::new(RamExperts::new(model, cache, predict))
    }

    /// A prompt of `n` tokens (every logit), then `steps` greedy tokens (their logits).
    fn run(engine: &mut Engine, n: usize, steps: usize) -> Vec<u32> {
        let n_vocab = engine.model().config.n_vocab;
        let prompt: Vec<u32> = (0..n).map(|i| ((i * 7919 + 3) % n_vocab) as u32).collect();
        let logits = engine.eval_batch(&prompt, true).unwrap();
        let mut next = argmax(&logits[(n - 1) * n_vocab..]) as u32;
        let mut bits: Vec<u32> = logits.iter().map(|x| x.to_bits()).collect();
        for _ in 0..steps {
            let logits = engine.eval(next).unwrap();
            bits.extend(logits.iter().map(|x| x.to_bits()));
            next = argmax(logits) as u32;
        }
        bits
    }

    #[test]
    fn the_ram_tier_gives_the_memory_maps_logits_at_every_budget() {
        let (_dir, model) = tiny_moe();
        let model = Arc::new(model);
        let reference = run(&mut Engine::new(model.clone(), &OPTIONS), 40, 6);
        let least = minimum_ram_budget(&model);
        for (budget, predict) in [
            (least, false),
            (least, true),
            (3 * least, true),
            (u64::MAX / 2, false),
        ] {
            let engine = Engine::new(model.clone(), &OPTIONS);
            let mut engine =
                engine.with_ram_experts(ram(&model, budget, predict, StorageFaults::default()));
            assert_eq!(
                run(&mut engine, 40, 6),
                reference,
                "budget {budget}, predicting {predict}"
            );
            let stats = engine.ram_experts().unwrap().stats();
            assert!(stats.misses > 0 && stats.bytes_read > 0, "{stats:?}");
            assert!(stats.buffer_bytes <= budget, "{stats:?}");
            if predict {
                assert!(
                    stats.predicted_right + stats.predicted_wrong > 0,
                    "decode steps predict the second layer's experts: {stats:?}"
                );
                if budget == least {
                    // Every buffer holds the layer being computed: nothing is read ahead.
                    assert_eq!(stats.prefetches, 0, "{stats:?}");
                }
            } else {
                assert_eq!(
                    stats.predicted_right + stats.predicted_wrong,
                    0,
                    "{stats:?}"
                );
            }
        }
    }

    #[test]
    fn predictions_are_read_ahead_only_while_enough_of_them_are_right() {
        let mut p = Predictions::default();
        assert!(p.reading_ahead(), "before any is counted");
        (p.recent_right, p.recent_wrong) = (10, 21);
        assert!(p.reading_ahead(), "still warming up");
        (p.recent_right, p.recent_wrong) = (19, 13);
        assert!(!p.reading_ahead(), "59% right");
        (p.recent_right, p.recent_wrong) = (60, 40);
        assert!(p.reading_ahead(), "60% right");
    }

    #[test]
    fn a_shared_step_through_the_ram_tier_matches_the_memory_map() {
        let (_dir, model) = tiny_moe();
        let model = Arc::new(model);
        let least = minimum_ram_budget(&model);
        let step = |engine: &mut BatchEngine| -> Vec<u32> {
            for seq in 0..3 {
                let prompt: Vec<u32> = (0..5 + seq as u32).map(|t| t * 31 + seq as u32).collect();
                engine.eval_sequence(seq, &prompt, false).unwrap();
            }
            let logits = engine.step(&[(0, 11), (1, 12), (2, 13)]).unwrap();
            logits.iter().map(|x| x.to_bits()).collect()
        };
        let reference = step(&mut BatchEngine::new(model.clone(), &OPTIONS, 3));
        let engine = BatchEngine::new(model.clone(), &OPTIONS, 3).with_ram_experts(ram(
            &model,
            least,
            true,
            StorageFaults::default(),
        ));
        let mut engine = engine;
        assert_eq!(step(&mut engine), reference);
    }

    #[test]
    fn a_failed_read_fails_the_call_and_moves_nothing() {
        let (_dir, model) = tiny_moe();
        let model = Arc::new(model);
        let least = minimum_ram_budget(&model);
        let mut reference = Engine::new(model.clone(), &OPTIONS);
        let expected = reference.eval_batch(&[5, 6, 7], false).unwrap().to_vec();
        // The third chunk read fails, once.
        let faults = StorageFaults {
            eio_at: Some(3),
            ..StorageFaults::default()
        };
        let mut engine =
            Engine::new(model.clone(), &OPTIONS).with_ram_experts(ram(&model, least, true, faults));
        match engine.eval_batch(&[5, 6, 7], false) {
            Err(EngineError::Expert(e)) => {
                assert!(e.to_string().contains("m.gguf"), "names the file: {e}")
            }
            other => panic!("expected a read error, got {other:?}"),
        }
        assert_eq!(engine.position(), 0);
        assert_eq!(engine.eval_batch(&[5, 6, 7], false).unwrap(), &expected[..]);
    }
}
