//! The VRAM expert cache of a [`GpuModel`](super::forward::GpuModel): per MoE layer, which
//! expert each of the layer's slots holds, where each routed expert of a token runs (a slot on
//! the GPU, the CPU, or a slot it is fetched into), which resident to give up on a fetch (LRU or
//! LFU, the bookkeeping of [`crate::stream`]'s cache), and counters per layer. Pure
//! bookkeeping: the copies into slots are [`super::moe::GpuMoe::fill_slot`]'s, the CPU's
//! experts [`super::cpu_experts`]'.
//!
//! Which experts the slots hold follows demand: every routed expert (decode steps and prompt
//! tokens) counts a use of it, and between steps [`LayerSlots::promotions`] gives the most
//! used experts that miss VRAM the slots of residents the policy would evict, when they were
//! used more. With misses on the CPU ([`MoeMiss::Cpu`]) this is how the slots come to hold a
//! layer's hot experts; the copies are `GpuModel`'s, a few a step.
//!
//! Partial: a fetched expert's bytes come from the memory-mapped file (the page cache); experts
//! not in RAM would come from the SSD through [`crate::stream::ExpertCache::get_or_load`], whose
//! buffers would feed the same upload (the seam is `GpuModel`'s fetch, which asks the model for
//! the expert's bytes). No prefetch of the next layer's likely experts; a fetch or a promotion
//! waits for its copy (no transfer queue).

use super::placement::MoeMiss;
use crate::engine::routing::RoutedExpert;
use crate::stream::{ExpertKey, ReplacementPolicy, Residency};

/// Counters of one layer's routed experts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerExpertStats {
    /// Routed experts found in a VRAM slot.
    pub hits: u64,
    /// Routed experts not in a slot when routed.
    pub misses: u64,
    /// Misses computed on the CPU.
    pub cpu: u64,
    /// Misses copied into a slot and run on the GPU.
    pub fetched: u64,
    /// Misses run on the GPU from system RAM, read over the bus ([`MoeMiss::Pcie`]).
    pub pcie: u64,
    /// Residents given up for a fetch or a promotion.
    pub evictions: u64,
    /// Experts copied into a slot between steps because they were used more than the
    /// resident they replaced ([`LayerSlots::promotions`]).
    pub promoted: u64,
    /// Expert weight bytes copied into slots.
    pub bytes_uploaded: u64,
}

impl LayerExpertStats {
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }

    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &LayerExpertStats) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.cpu += o.cpu;
        self.fetched += o.fetched;
        self.pcie += o.pcie;
        self.evictions += o.evictions;
        self.promoted += o.promoted;
        self.bytes_uploaded += o.bytes_uploaded;
    }
}

/// Where a MoE model's routed experts ran since it was loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertStats {
    pub miss: MoeMiss,
    /// VRAM slots per MoE layer.
    pub slots: usize,
    pub n_expert: usize,
    /// One per layer of the model (zeros for dense layers).
    pub layers: Vec<LayerExpertStats>,
}

impl ExpertStats {
    pub fn total(&self) -> LayerExpertStats {
        let mut t = LayerExpertStats::default();
        self.layers.iter().for_each(|l| t.add(l));
        t
    }

    /// One line for a person: hit rate, where the misses went, bytes copied.
    pub fn summary(&self) -> String {
        let t = self.total();
        format!(
            "experts: {} of {} per layer in VRAM, misses {}; {} routed, {:.1}% hits, {} on \
             the CPU, {} fetched, {} read over PCIe, {} promoted ({:.1} MiB uploaded, {} \
             evictions)",
            self.slots,
            self.n_expert,
            self.miss,
            t.hits + t.misses,
            100.0 * t.hit_rate(),
            t.cpu,
            t.fetched,
            t.pcie,
            t.promoted,
            t.bytes_uploaded as f64 / (1u64 << 20) as f64,
            t.evictions
        )
    }
}

/// A routed expert in a VRAM slot, with its weight in the layer's sum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlotExpert {
    pub slot: usize,
    pub weight: f32,
}

/// Where one token's routed experts of one layer run.
#[derive(Debug, Default, PartialEq)]
pub struct TokenExperts {
    /// In rank order: residents, and misses fetched into slots.
    pub gpu: Vec<SlotExpert>,
    /// Misses computed on the CPU, in rank order.
    pub cpu: Vec<RoutedExpert>,
    /// (slot, expert) copies to make before the GPU part runs.
    pub fetch: Vec<(usize, usize)>,
}

/// One MoE layer's slots: which expert each holds, and the replacement policy's view of them.
pub struct LayerSlots {
    layer: u32,
    slot_of: Vec<Option<usize>>,
    residency: Residency,
    /// Uses of each expert of the layer, resident or not, halved every
    /// [`HALVE_EVERY_STEPS`] × `n_expert` uses so that the counts follow a drifting hot set.
    demand: Vec<u32>,
    uses_since_halving: u64,
}

/// How often [`LayerSlots`]' demand counts are halved, in uses per expert of the layer: about
/// 16 × `n_expert` / `k` tokens (256 tokens of a 128-expert, top-8 model).
const HALVE_EVERY_STEPS: u64 = 16;

impl LayerSlots {
    /// `n_slots` slots of `n_expert` experts, slot `i` holding expert `i`.
    pub fn new(
        layer: usize,
        n_expert: usize,
        n_slots: usize,
        policy: ReplacementPolicy,
    ) -> LayerSlots {
        let mut residency = Residency::new(policy);
        let n_slots = n_slots.min(n_expert);
        for e in 0..n_slots {
            residency.insert(ExpertKey::new(layer as u32, e as u32), 1, false);
        }
        LayerSlots {
            layer: layer as u32,
            slot_of: (0..n_expert).map(|e| (e < n_slots).then_some(e)).collect(),
            residency,
            demand: vec![0; n_expert],
            uses_since_halving: 0,
        }
    }

    /// Counts `count` uses of `expert` (tokens that chose it) in its demand.
    pub fn note_uses(&mut self, expert: usize, count: u32) {
        self.demand[expert] = self.demand[expert].saturating_add(count);
        self.uses_since_halving += count as u64;
        if self.uses_since_halving >= HALVE_EVERY_STEPS * self.demand.len() as u64 {
            self.uses_since_halving = 0;
            self.demand.iter_mut().for_each(|d| *d /= 2);
        }
    }

    /// Up to `limit` (slot, expert) copies that put the most used experts missing VRAM in the
    /// slots of the residents the policy would give up first, each only where the newcomer was
    /// used more than the resident it replaces (so equals never trade places); the slots are
    /// reassigned here, counted in `stats`, and the caller copies the weights before the slots
    /// are next read.
    pub fn promotions(
        &mut self,
        limit: usize,
        stats: &mut LayerExpertStats,
    ) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        if limit == 0 {
            return out;
        }
        let mut missing: Vec<usize> = (0..self.demand.len())
            .filter(|&e| self.slot_of[e].is_none() && self.demand[e] > 0)
            .collect();
        missing.sort_by_key(|&e| std::cmp::Reverse(self.demand[e]));
        let mut promoted: Vec<usize> = Vec::new();
        for e in missing {
            if out.len() == limit {
                break;
            }
            let Some(victim) = self
                .residency
                .victim(|k| !promoted.contains(&(k.expert as usize)))
            else {
                break;
            };
            let v = victim.expert as usize;
            if self.demand[e] <= self.demand[v] {
                // The same victim for every less used one.
                break;
            }
            let slot = self.slot_of[v].take().expect("a resident has a slot");
            self.residency.remove(victim);
            self.slot_of[e] = Some(slot);
            self.residency.insert(self.key(e), 1, true);
            promoted.push(e);
            stats.promoted += 1;
            stats.evictions += 1;
            out.push((slot, e));
        }
        out
    }

    fn key(&self, expert: usize) -> ExpertKey {
        ExpertKey::new(self.layer, expert as u32)
    }

    /// The slot holding `expert`, if any.
    pub fn slot_of(&self, expert: usize) -> Option<usize> {
        self.slot_of[expert]
    }

    /// The slot of each expert of the layer, `None` for those without one.
    pub fn slot_table(&self) -> &[Option<usize>] {
        &self.slot_of
    }

    /// Decides where each of `routed` runs, counting into `stats`: residents on the GPU; misses
    /// on the CPU, or with [`MoeMiss::Fetch`] into a slot no expert of this token uses (on the
    /// CPU when every slot is taken by this token's own experts), or with [`MoeMiss::Pcie`]
    /// on the GPU from system RAM (in neither list: the device ran them already).
    pub fn place(
        &mut self,
        routed: &[RoutedExpert],
        miss: MoeMiss,
        stats: &mut LayerExpertStats,
    ) -> TokenExperts {
        let mut slots: Vec<Option<usize>> = routed.iter().map(|r| self.slot_of[r.expert]).collect();
        for r in routed {
            self.note_uses(r.expert, 1);
        }
        for (r, s) in routed.iter().zip(&slots) {
            if s.is_some() {
                stats.hits += 1;
                self.residency.touch(self.key(r.expert));
            } else {
                stats.misses += 1;
            }
        }
        let mut out = TokenExperts::default();
        for i in 0..routed.len() {
            if slots[i].is_some() {
                continue;
            }
            let r = routed[i];
            let fetched = match miss {
                MoeMiss::Fetch => self.admit(r.expert, &slots, stats),
                // The model resolves `Auto` at load; were it here, the CPU would take it.
                MoeMiss::Cpu | MoeMiss::Auto | MoeMiss::Split => None,
                MoeMiss::Pcie => {
                    stats.pcie += 1;
                    continue;
                }
            };
            match fetched {
                Some(slot) => {
                    slots[i] = Some(slot);
                    out.fetch.push((slot, r.expert));
                    stats.fetched += 1;
                }
                None => {
                    out.cpu.push(r);
                    stats.cpu += 1;
                }
            }
        }
        out.gpu = routed
            .iter()
            .zip(&slots)
            .filter_map(|(r, s)| {
                s.map(|slot| SlotExpert {
                    slot,
                    weight: r.weight,
                })
            })
            .collect();
        out
    }

    /// Gives `expert` the slot of the resident the policy evicts first among those `busy`
    /// (this token's) does not hold.
    fn admit(
        &mut self,
        expert: usize,
        busy: &[Option<usize>],
        stats: &mut LayerExpertStats,
    ) -> Option<usize> {
        let slot_of = &self.slot_of;
        let victim = self
            .residency
            .victim(|k| !busy.contains(&slot_of[k.expert as usize]))?;
        let slot = self.slot_of[victim.expert as usize].take()?;
        self.residency.remove(victim);
        stats.evictions += 1;
        self.slot_of[expert] = Some(slot);
        self.residency.insert(self.key(expert), 1, true);
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(experts: &[usize]) -> Vec<RoutedExpert> {
        experts
            .iter()
            .enumerate()
            .map(|(i, &expert)| RoutedExpert {
                expert,
                weight: 1.0 / (i + 1) as f32,
            })
            .collect()
    }

    #[test]
    fn residents_hit_and_misses_go_to_the_cpu() {
        let mut s = LayerSlots::new(0, 8, 3, ReplacementPolicy::Lru);
        let mut st = LayerExpertStats::default();
        let t = s.place(&routed(&[5, 1]), MoeMiss::Cpu, &mut st);
        assert_eq!(
            t.gpu,
            vec![SlotExpert {
                slot: 1,
                weight: 0.5
            }]
        );
        assert_eq!(t.cpu, vec![routed(&[5])[0]]);
        assert!(t.fetch.is_empty());
        assert_eq!((st.hits, st.misses, st.cpu, st.fetched), (1, 1, 1, 0));
        // CPU mode never changes the residents.
        assert_eq!(s.slot_of(5), None);
    }

    #[test]
    fn fetch_evicts_the_least_recently_used_keeping_rank_order() {
        let mut s = LayerSlots::new(3, 8, 3, ReplacementPolicy::Lru);
        let mut st = LayerExpertStats::default();
        s.place(&routed(&[0, 2]), MoeMiss::Fetch, &mut st);
        // Expert 1 is the least recently used resident.
        let t = s.place(&routed(&[6, 0]), MoeMiss::Fetch, &mut st);
        assert_eq!(t.fetch, vec![(1, 6)]);
        assert_eq!(
            t.gpu,
            vec![
                SlotExpert {
                    slot: 1,
                    weight: 1.0
                },
                SlotExpert {
                    slot: 0,
                    weight: 0.5
                }
            ]
        );
        assert!(t.cpu.is_empty());
        assert_eq!((s.slot_of(6), s.slot_of(1)), (Some(1), None));
        assert_eq!((st.hits, st.misses, st.fetched, st.evictions), (3, 1, 1, 1));
    }

    #[test]
    fn a_fetch_never_evicts_an_expert_of_the_same_token() {
        let mut s = LayerSlots::new(0, 8, 1, ReplacementPolicy::LFU);
        let mut st = LayerExpertStats::default();
        // Slot 0 holds expert 0, which this token uses: the miss goes to the CPU.
        let t = s.place(&routed(&[0, 4]), MoeMiss::Fetch, &mut st);
        assert_eq!(t.gpu.len(), 1);
        assert_eq!(t.cpu, vec![routed(&[0, 4])[1]]);
        // Two misses, one slot: the first is fetched, the second computed on the CPU.
        let t = s.place(&routed(&[5, 6]), MoeMiss::Fetch, &mut st);
        assert_eq!(t.fetch, vec![(0, 5)]);
        assert_eq!(t.cpu.len(), 1);
        assert_eq!(t.cpu[0].expert, 6);
    }

    #[test]
    fn promotions_bring_the_most_used_misses_in_place_of_the_least_used() {
        for policy in [ReplacementPolicy::Lru, ReplacementPolicy::LFU] {
            let mut s = LayerSlots::new(0, 8, 2, policy);
            let mut st = LayerExpertStats::default();
            // Expert 0 is used once, expert 1 never; 5 three times, 6 twice, 7 once.
            s.place(&routed(&[5, 0]), MoeMiss::Cpu, &mut st);
            s.place(&routed(&[5, 6]), MoeMiss::Cpu, &mut st);
            s.place(&routed(&[6, 5]), MoeMiss::Cpu, &mut st);
            s.place(&routed(&[7]), MoeMiss::Cpu, &mut st);
            // CPU mode: the slots did not change while placing.
            assert_eq!((s.slot_of(5), s.slot_of(0)), (None, Some(0)), "{policy:?}");
            // One copy allowed: the most used miss takes the slot of the policy's victim
            // (expert 1, unused, for both policies).
            let p = s.promotions(1, &mut st);
            assert_eq!(p, vec![(1, 5)], "{policy:?}");
            assert_eq!((s.slot_of(5), s.slot_of(1)), (Some(1), None), "{policy:?}");
            // Then 6 (two uses) replaces 0 (one use); 7 (one use) does not replace an equal.
            let p = s.promotions(8, &mut st);
            assert_eq!(p, vec![(0, 6)], "{policy:?}");
            assert_eq!(s.slot_of(7), None, "{policy:?}");
            assert_eq!((st.promoted, st.evictions), (2, 2), "{policy:?}");
            // Nothing more to gain: nothing moves.
            assert!(s.promotions(8, &mut st).is_empty(), "{policy:?}");
            let t = s.place(&routed(&[6, 5]), MoeMiss::Cpu, &mut st);
            assert!(t.cpu.is_empty(), "{policy:?}: both now hit");
        }
    }

    #[test]
    fn demand_is_halved_so_a_new_hot_set_takes_over() {
        let mut s = LayerSlots::new(0, 4, 1, ReplacementPolicy::LFU);
        let mut st = LayerExpertStats::default();
        // Expert 0 (resident) was hot long ago: more uses than expert 3 has since, but they
        // count for less after two halvings.
        s.note_uses(0, 100);
        let since = HALVE_EVERY_STEPS * 4;
        for _ in 0..since {
            s.place(&routed(&[3]), MoeMiss::Cpu, &mut st);
        }
        assert!(since < 100);
        assert_eq!(s.promotions(1, &mut st), vec![(0, 3)]);
    }

    #[test]
    fn all_slots_means_all_hits() {
        let mut s = LayerSlots::new(0, 4, 4, ReplacementPolicy::Lru);
        let mut st = LayerExpertStats::default();
        let t = s.place(&routed(&[3, 2, 1]), MoeMiss::Cpu, &mut st);
        assert_eq!(t.gpu.iter().map(|g| g.slot).collect::<Vec<_>>(), [3, 2, 1]);
        assert_eq!((st.hits, st.misses), (3, 0));
        let stats = ExpertStats {
            miss: MoeMiss::Cpu,
            slots: 4,
            n_expert: 4,
            layers: vec![st, LayerExpertStats::default()],
        };
        assert_eq!(stats.total().hits, 3);
        assert!(
            stats.summary().contains("100.0% hits"),
            "{}",
            stats.summary()
        );
    }
}
