//! Prompt chunks through the routed experts a MoE model under its VRAM budget keeps off the
//! GPU. A decode step runs such an expert on the CPU (or fetches it); a chunk of a prompt runs
//! every expert its tokens chose on the GPU, once for all of them: at each MoE layer the
//! experts that are not resident are copied, a group at a time, into a few VRAM slots shaped
//! like the layer's (from the memory map, through upload staging) and run over their tokens
//! there, then the resident ones run from their own slots. Each missing expert's weights then
//! cross PCIe once per chunk (up to 512 tokens) where the CPU would multiply them with each
//! token that chose them.
//!
//! The slots and a chunk's activations take VRAM the budget would otherwise give resident
//! experts ([`super::super::placement`]); they are made when every MoE layer has the first
//! one's expert shapes and weight types and there is no shared expert (a model without them
//! keeps its prompts token by token). Prompt tokens are counted in the layers' expert counters
//! (a streamed expert as a miss fetched) and in the experts' demand, which decides what comes
//! into the resident slots after the prompt ([`super::promote`]).
//!
//! Partial: a group's copies and its products take turns (the next group's copies do not
//! overlap this group's products), and the copies go through the compute queue; the experts'
//! bytes come through the memory map (the page cache) even under a RAM budget, whose cache of
//! experts (`crate::stream`) serves only the decode steps' CPU experts.

use std::sync::Arc;

use super::chained::EMPTY_ENTRY;
use super::prefill::{Batch, OffVram};
use super::GpuModel;
use crate::engine::routing::RoutedExpert;
use crate::gpu::alloc::Allocator;
use crate::gpu::error::Result;
use crate::gpu::moe::{ChunkRouting, ExpertRun, GpuMoe};
use crate::gpu::placement::ExpertShape;
use crate::gpu::upload::Uploader;
use crate::model::{Ffn, Matrix, Model, MoeWeights};

/// VRAM for the slots a prompt's missing experts take in turn, when the caller does not ask
/// for a number of slots: as many experts as fit (at least one, at most all of a layer's).
const SLOT_BYTES: u64 = 64 << 20;

fn moe_layers(model: &Model) -> impl Iterator<Item = &MoeWeights> {
    model.layers.iter().filter_map(|l| match &l.ffn {
        Ffn::Moe(m) => Some(m),
        Ffn::Dense { .. } => None,
    })
}

/// Whether `model`'s routed experts can take turns in one set of slots: every MoE layer has
/// the first one's expert shapes and weight types, no shared expert, and experts of whole
/// words (uploads are whole words).
pub(crate) fn experts_streamable(model: &Model) -> bool {
    let mut layers = moe_layers(model);
    let Some(first) = layers.next() else {
        return false;
    };
    let key = |m: &Matrix| (m.ty, m.n_in, m.n_out, m.n_mat);
    let same = |m: &MoeWeights| {
        m.shared.is_none()
            && key(&m.gate) == key(&first.gate)
            && key(&m.up) == key(&first.up)
            && key(&m.down) == key(&first.down)
    };
    let words = ExpertShape::of(model)
        .is_some_and(|s| [s.gate, s.up, s.down].iter().all(|b| b.is_multiple_of(4)));
    words && same(first) && layers.all(same)
}

/// Slots for a prompt's missing experts: `asked` (0: as many as [`SLOT_BYTES`] holds, at most
/// a quarter of a layer's experts), at least one and at most a layer's experts.
pub(in crate::gpu) fn prompt_expert_slots(shape: &ExpertShape, asked: usize) -> usize {
    let n = match asked {
        0 => ((SLOT_BYTES / shape.expert_bytes().max(1)) as usize).min(shape.n_expert / 4),
        n => n,
    };
    n.clamp(1, shape.n_expert)
}

/// The slots a prompt chunk's missing experts take in turn, with their upload staging.
pub(super) struct ExpertStream {
    moe: GpuMoe,
    up: Uploader,
}

impl ExpertStream {
    /// `slots` slots shaped like `model`'s first MoE layer's experts, with staging for as
    /// many ([`ExpertShape::staging_bytes_for`]); the caller has checked [`experts_streamable`].
    pub(super) fn new(model: &Model, al: &Arc<Allocator>, slots: usize) -> Result<ExpertStream> {
        let shape = ExpertShape::of(model).expect("a MoE model");
        let mut up = Uploader::new(al, shape.staging_bytes_for(slots))?;
        let first = moe_layers(model).next().expect("a MoE model");
        let moe = GpuMoe::upload(model, al, &mut up, first, slots)?;
        up.flush()?;
        Ok(ExpertStream { moe, up })
    }
}

impl GpuModel {
    /// Runs MoE layer `il`'s experts that `routing` chose and that are not resident over their
    /// tokens of the chunk in `b` (its normalised rows in `b.moe.xn`, the routing written to
    /// `b.moe.route`), a group of slots at a time, adding their outputs to `b.x`; or, in a
    /// batched decode step whose misses go to the CPU ([`GpuModel::cpu_misses`]), on the CPU,
    /// each expert once for all the tokens that chose it, into `b.moe.cpu.sum` for the chunk's
    /// next command buffer to add, with each token's resident experts written to
    /// `b.moe.cpu.route` for it to run by entry where the scratch holds them. Counts every
    /// routed token in the layer's counters and returns the resident experts' runs as
    /// `(slot, first entry, entries)`, and where the others went. `n`: the chunk's tokens.
    pub(super) fn chunk_experts(
        &mut self,
        b: &mut Batch,
        (il, n): (usize, usize),
        routing: &ChunkRouting,
    ) -> Result<(Vec<ExpertRun>, OffVram)> {
        let on_cpu = b.cpu_turns();
        let (resident, missing) = self.place_chunk_experts(il, routing, on_cpu);
        if on_cpu {
            let off_vram = OffVram {
                cpu_sum: !missing.is_empty(),
                by_entry: self.write_entry_route(b, (n, routing), (&resident, &missing)),
            };
            if off_vram.cpu_sum {
                self.cpu_chunk_experts(b, (il, n), routing, &missing)?;
            }
            return Ok((resident, off_vram));
        }
        if missing.is_empty() {
            return Ok((resident, OffVram::default()));
        }
        let mut stream = self
            .expert_stream
            .take()
            .expect("a partial placement batches prompts only with an expert stream");
        let ran = self.stream_experts(&mut stream, b, il, (routing.weights_at(), &missing));
        self.expert_stream = Some(stream);
        let ex = self
            .experts
            .as_mut()
            .expect("MoE models track their experts");
        ex.stats[il].bytes_uploaded += ran?;
        Ok((resident, OffVram::default()))
    }

    /// Splits the `routing` of MoE layer `il` in a chunk into its resident experts' runs
    /// `(slot, first entry, entries)` and the others' `(expert, first entry, entries)`,
    /// counting every routed token in the layer's counters (the others as run on the CPU where
    /// `on_cpu`, else as fetched) and in the experts' demand.
    pub(super) fn place_chunk_experts(
        &mut self,
        il: usize,
        routing: &ChunkRouting,
        on_cpu: bool,
    ) -> (Vec<ExpertRun>, Vec<ExpertRun>) {
        let ex = self
            .experts
            .as_mut()
            .expect("MoE models track their experts");
        let slots = ex.slots[il].as_mut().expect("a MoE layer has slots");
        let stats = &mut ex.stats[il];
        let (mut resident, mut missing) = (Vec::new(), Vec::new());
        for &(expert, first, count) in &routing.runs {
            slots.note_uses(expert, count as u32);
            match slots.slot_of(expert) {
                Some(slot) => {
                    stats.hits += count as u64;
                    resident.push((slot, first, count));
                }
                None => {
                    stats.misses += count as u64;
                    match on_cpu {
                        true => stats.cpu += count as u64,
                        false => stats.fetched += count as u64,
                    }
                    missing.push((expert, first, count));
                }
            }
        }
        (resident, missing)
    }

    /// Writes each of the `n` tokens' k entries to `b.moe.cpu.route` (2k words a token: the
    /// slots of its `resident` experts and an empty entry for each `missing` one, then their
    /// weights), for the resident experts to run by entry; `false`, with nothing written, where
    /// the chunk's scratch does not hold every token's entries.
    pub(super) fn write_entry_route(
        &self,
        b: &mut Batch,
        (n, routing): (usize, &ChunkRouting),
        (resident, missing): (&[ExpertRun], &[ExpertRun]),
    ) -> bool {
        let c = &self.config;
        let k = c.moe.map_or(0, |m| m.n_expert_used);
        let Some(m) = b.moe.as_mut().filter(|m| m.holds_entries(n, c)) else {
            return false;
        };
        let Some(cpu) = m.cpu.as_mut() else {
            return false;
        };
        let weights_at = routing.weights_at();
        let mut words = vec![0u32; n * 2 * k];
        let mut filled = vec![0usize; n];
        for (runs, in_vram) in [(resident, true), (missing, false)] {
            for &(id, first, count) in runs {
                for i in first..first + count {
                    let t = routing.words[i] as usize;
                    let at = t * 2 * k + filled[t];
                    filled[t] += 1;
                    // An empty entry (its weight 0): the CPU ran that expert.
                    words[at] = if in_vram { id as u32 } else { EMPTY_ENTRY };
                    words[at + k] = if in_vram {
                        routing.words[weights_at + i]
                    } else {
                        0
                    };
                }
            }
        }
        debug_assert!(filled.iter().all(|&f| f == k), "k experts a token");
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        cpu.route.write(&bytes);
        true
    }

    /// The `missing` runs of a batched step's layer `il` on the CPU, from the `n` rows the
    /// chunk normalised into `b.moe.cpu.xn`; each token's weighted sum into `b.moe.cpu.sum`.
    pub(super) fn cpu_chunk_experts(
        &self,
        b: &mut Batch,
        (il, n): (usize, usize),
        routing: &ChunkRouting,
        missing: &[ExpertRun],
    ) -> Result<()> {
        let weights_at = routing.weights_at();
        let entries: Vec<(usize, RoutedExpert)> = missing
            .iter()
            .flat_map(|&(expert, first, count)| {
                (first..first + count).map(move |i| {
                    let weight = f32::from_bits(routing.words[weights_at + i]);
                    (routing.words[i] as usize, RoutedExpert { expert, weight })
                })
            })
            .collect();
        let e = self.config.n_embd;
        let cpu = self
            .experts
            .as_ref()
            .and_then(|ex| ex.cpu.as_ref())
            .expect("misses on the CPU have CPU experts");
        let scratch = b
            .moe
            .as_mut()
            .and_then(|m| m.cpu.as_mut())
            .expect("checked by chunk_experts");
        let xn = scratch.xn.read_f32(n * e);
        let sums = cpu.weighted_sums(il, &xn, &entries)?;
        scratch.sum.write_f32(&sums);
        Ok(())
    }

    /// The bytes copied.
    fn stream_experts(
        &self,
        s: &mut ExpertStream,
        b: &Batch,
        il: usize,
        (weights_at, missing): (usize, &[ExpertRun]),
    ) -> Result<u64> {
        let Ffn::Moe(weights) = &self.model.layers[il].ffn else {
            unreachable!("layer {il} is MoE");
        };
        let m = b.moe.as_ref().expect("MoE scratch");
        let mut bytes = 0;
        for group in missing.chunks(s.moe.n_slots()) {
            let mut runs = Vec::with_capacity(group.len());
            for (slot, &(expert, first, count)) in group.iter().enumerate() {
                bytes += s
                    .moe
                    .fill_slot(&self.model, weights, &mut s.up, slot, expert)?;
                runs.push((slot, first, count));
            }
            s.up.flush()?;
            let bufs = (&m.xg, &m.eg, &m.eu, &m.ed);
            self.kernels.record(|rec| {
                rec.after_earlier_submissions();
                s.moe
                    .record_chunk_experts(rec, &runs, (&m.route, weights_at), &m.xn, bufs, b.x())
            })?;
        }
        Ok(bytes)
    }
}
