//! A chunk's MoE layers routed on the device ([`GpuModel::routes_chunks_on_device`]): the
//! router's product and each token's top-k in the chunk's submission, then either every
//! expert's product over its entries laid out by expert, or, for the few tokens of a batched
//! decode step, each token's experts by entry as a decode step runs them; and afterwards the
//! experts each layer ran, in its counters.

use super::{Batch, BatchMoe, ChunkOnDevice};
use crate::gpu::buffer::Buffer;
use crate::gpu::error::Result;
use crate::gpu::forward::{GpuFfn, GpuModel};
use crate::gpu::moe::GpuMoe;
use crate::gpu::ops::{ChunkLayout, MoeRouteArgs};
use crate::gpu::ops_batch::MAX_MATVEC_COLS;
use crate::gpu::record::Recorder;

impl GpuModel {
    /// MoE layer `il`'s experts for the chunk's `n` tokens, routed on the device (its input
    /// normalised in `m.xn`, [`GpuModel::route_on_device`]), then every expert's products in
    /// one dispatch a matrix and stack ([`GpuMoe::record_chunk_sorted`]), added to `x`.
    pub(super) fn record_chunk_routed(
        &self,
        rec: &mut Recorder<'_>,
        (m, d): (&BatchMoe, &ChunkOnDevice),
        moe: &GpuMoe,
        (il, n): (usize, usize),
        x: &Buffer,
    ) -> Result<()> {
        let k = self
            .config
            .moe
            .expect("MoE layers have a MoE config")
            .n_expert_used;
        let (_, layout) = self.route_on_device(rec, (m, d), moe, (il, n))?;
        let bufs = (&m.xg, &m.eg, &m.eu, &m.ed);
        moe.record_chunk_sorted(rec, (&m.route, layout), (n, k), &m.xn, bufs, x)
    }

    /// MoE layer `il`'s routing of the chunk's `n` tokens on the device, its input normalised
    /// in `m.xn`: the router's product, each token's routing into `d.sel`, and the entries laid
    /// out by expert into `m.route` (each expert's slot from the slot map where some are read
    /// from system RAM) with the layer's count per expert in `d.counts`. The routing's
    /// arguments (with the slot map where there is one) and the layout.
    fn route_on_device<'s>(
        &'s self,
        rec: &mut Recorder<'_>,
        (m, d): (&BatchMoe, &ChunkOnDevice),
        moe: &GpuMoe,
        (il, n): (usize, usize),
    ) -> Result<(MoeRouteArgs<'s>, ChunkLayout)> {
        let cfg = self.config.moe.expect("MoE layers have a MoE config");
        let (k, n_expert) = (cfg.n_expert_used, cfg.n_expert);
        rec.matvec_batch(moe.router(), &m.xn.buffer, &d.logits, n)?;
        let args = MoeRouteArgs {
            n_expert: n_expert as u32,
            k: k as u32,
            norm_weights: cfg.norm_weights,
            log_offset: 0,
            slots: None,
        };
        rec.moe_route_chunk(&d.logits, &d.sel, n as u32, args)?;
        let host = moe.has_host_experts();
        let layout = ChunkLayout::new(n, k, n_expert, il * n_expert, host);
        let slots = match host {
            true => {
                let map = self
                    .moe_scratch()
                    .slot_map()
                    .expect("a slot map with host experts");
                Some((map, (il * n_expert) as u32))
            }
            false => None,
        };
        let sizes = (n as u32, k as u32, n_expert as u32);
        rec.moe_sort(&d.sel, (&m.route, &d.counts), sizes, (layout, slots))?;
        Ok((MoeRouteArgs { slots, ..args }, layout))
    }

    /// Whether a chunk of `n` tokens routed on the device runs its MoE layers' experts by
    /// entry, as decode steps run a token's ([`GpuMoe::record_tokens`]), rather than laid out
    /// by expert: a few tokens ([`MAX_MATVEC_COLS`], a batched decode step), every MoE layer
    /// routable as a decode step routes it (every expert resident, or in system RAM for the
    /// GPU, each stack in one binding), no shared expert, and
    /// [`super::GpuModelOptions::moe_by_entry`].
    pub(super) fn moe_by_entry(&self, n: usize) -> bool {
        let max_range = self.allocator.device().max_storage_buffer_range();
        let Some(cfg) = &self.config.moe else {
            return false;
        };
        self.moe_by_entry
            && n <= MAX_MATVEC_COLS as usize
            && self.layers.iter().all(|l| match &l.ffn {
                GpuFfn::Moe(m) => m.shared_ff() == 0 && m.routes_on_device(cfg, max_range),
                GpuFfn::Dense { .. } => true,
            })
    }

    /// MoE layer `il`'s experts for a few tokens by entry ([`GpuModel::moe_by_entry`]), its
    /// input normalised in `m.xn`: the routing on the device as a chunk's
    /// ([`GpuModel::route_on_device`]; its layout by expert only gives the layer's counts, and
    /// nothing waits for it); with experts in system RAM the routing again, split between slots
    /// and those, into `d.split`; then [`GpuMoe::record_tokens`], added to `x`.
    pub(super) fn record_tokens_routed(
        &self,
        rec: &mut Recorder<'_>,
        (m, d): (&BatchMoe, &ChunkOnDevice),
        moe: &GpuMoe,
        (il, n): (usize, usize),
        x: &Buffer,
    ) -> Result<()> {
        let k = self
            .config
            .moe
            .expect("MoE layers have a MoE config")
            .n_expert_used;
        let (args, _) = self.route_on_device(rec, (m, d), moe, (il, n))?;
        let route = match (args.slots, &d.split) {
            (Some(_), Some(split)) => {
                rec.moe_route_chunk(&d.logits, split, n as u32, args)?;
                (split, 3 * k, true)
            }
            (Some(_), None) => unreachable!("a split routing buffer where experts are in RAM"),
            (None, _) => (&d.sel, 2 * k, false),
        };
        // The chunk's gathered rows and outputs are not used by entry: the scratch of the
        // stacks in system RAM (n * k rows of the expert width, within theirs).
        let scratch = (&m.eg, &m.eu, &m.xg, &m.ed);
        moe.record_tokens(rec, route, (n, k), &m.xn.buffer, scratch, x)
    }

    /// After a chunk: the experts its device-routed MoE layers ran (their counts), in the
    /// layers' counters and demand, as the host's routing counts them.
    pub(in crate::gpu::forward) fn count_routed_on_device(
        &mut self,
        batch: &Batch,
        layers: &[usize],
    ) {
        let (Some(cfg), Some(m)) = (self.config.moe, batch.moe.as_ref()) else {
            return;
        };
        let Some(d) = m.device.as_ref().filter(|_| !layers.is_empty()) else {
            return;
        };
        let counts: Vec<u32> = d.counts.bytes()[..self.config.n_layer * cfg.n_expert * 4]
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        let ex = self
            .experts
            .as_mut()
            .expect("MoE models track their experts");
        for &il in layers {
            let slots = ex.slots[il].as_mut().expect("a MoE layer has slots");
            let stats = &mut ex.stats[il];
            let row = &counts[il * cfg.n_expert..(il + 1) * cfg.n_expert];
            for (expert, &c) in row.iter().enumerate() {
                slots.note_uses(expert, c);
                let c = u64::from(c);
                match slots.slot_of(expert) {
                    Some(_) => stats.hits += c,
                    // Read by the GPU from system RAM ([`crate::gpu::placement::MoeMiss::Pcie`]).
                    None => {
                        stats.misses += c;
                        stats.pcie += c;
                    }
                }
            }
        }
    }
}
