//! A chunk's command buffers: every token of the chunk through a layer at once (attention,
//! the dense FFN, a MoE layer's router and, resumed after the host routed it, its experts).

use super::{Batch, ChunkResume};
use crate::gpu::error::Result;
use crate::gpu::forward::{profile, GateUp, GpuFfn, GpuLayer, GpuModel};
use crate::gpu::ops::{Fused, GpuMatrix, StepWord};
use crate::gpu::record::{Grid, Recorder};

impl GpuModel {
    /// A dense layer's FFN for the chunk's tokens, its output added to `x`.
    pub(in crate::gpu::forward) fn record_chunk_ffn(
        &self,
        rec: &mut Recorder<'_>,
        b: &Batch,
        l: &GpuLayer,
        (gate_up, down): (&GateUp, &GpuMatrix),
        n: usize,
    ) -> Result<()> {
        let c = &self.config;
        let (e, eps, nt) = (c.n_embd as u32, c.rms_eps, n as u32);
        rec.rms_norm(&b.x, &l.ffn_norm, &b.xn, e, nt, eps)?;
        let n_ff = gate_up.n_ff();
        match gate_up {
            GateUp::Stacked(m) => {
                rec.matvec_batch_rows(m, 0, n_ff, &b.xn, &b.gate, n)?;
                rec.matvec_batch_rows(m, n_ff, n_ff, &b.xn, &b.up, n)?;
            }
            GateUp::Apart { gate, up } => {
                rec.matvec_batch(gate, &b.xn, &b.gate, n)?;
                rec.matvec_batch(up, &b.xn, &b.up, n)?;
            }
        }
        rec.swiglu(&b.gate, &b.up, (n * n_ff) as u32)?;
        rec.matvec_batch_add(down, &b.gate, &b.x, n)
    }

    /// Attention of layer `l` for the chunk's tokens, its output added to `x`.
    pub(in crate::gpu::forward) fn record_chunk_attention(
        &self,
        rec: &mut Recorder<'_>,
        b: &Batch,
        l: &GpuLayer,
        n: usize,
    ) -> Result<()> {
        let c = &self.config;
        let (e, eps, nt) = (c.n_embd as u32, c.rms_eps, n as u32);
        let (qw, kvw) = (c.q_width() as u32, c.kv_width() as u32);
        // Each token's position and first row, after the chunk's token ids.
        let pos = StepWord {
            buffer: &b.step,
            index: n as u32,
        };
        let rope = |n_heads| self.rope_args(n_heads);
        let attn_args = self.attention_args();
        let end = b.end as u32;
        rec.rms_norm(&b.x, &l.attn_norm, &b.xn, e, nt, eps)?;
        rec.matvec_batch(&l.wq, &b.xn, &b.q, n)?;
        rec.matvec_batch(&l.wk, &b.xn, &b.k, n)?;
        rec.matvec_batch(&l.wv, &b.xn, &b.v, n)?;
        for (x, bias, w) in [(&b.q, &l.bq, qw), (&b.k, &l.bk, kvw), (&b.v, &l.bv, kvw)] {
            if let Some(bias) = bias {
                rec.add_repeated(x, bias, w * nt, w)?;
            }
        }
        let (qn, kn) = (l.q_norm.as_ref(), l.k_norm.as_ref());
        rec.rope_into(&b.q, qn, &self.rope, rope(c.n_head), pos, nt, None)?;
        let store = Some((&b.v, &l.k_cache, &l.v_cache));
        rec.rope_into(&b.k, kn, &self.rope, rope(c.n_head_kv), pos, nt, store)?;
        let caches = (&l.k_cache, &l.v_cache);
        if self.flash_prompts() && !b.ragged {
            rec.attention_prefill(&b.q, caches, &b.attn, attn_args, pos, nt)?;
        } else {
            let scratch = (&b.scores, &b.attn_done);
            // The grid the step words give: a replayed step, recorded for the capacity, launches
            // only the runs up to its tokens' positions.
            let grid = Grid::Indirect(StepWord {
                buffer: &b.step,
                index: 3 * nt,
            });
            rec.attention_n_grid(
                &b.q,
                caches,
                scratch,
                &b.attn,
                attn_args,
                pos,
                (nt, end),
                grid,
            )?;
        }
        rec.matvec_batch_add(&l.wo, &b.attn, &b.x, n)
    }

    /// Records a chunk's command buffer: from the embedding, or from a paused MoE layer's
    /// resident experts and shared expert ([`ChunkResume`]), to the next MoE layer's router
    /// (setting `paused` to its layer) or to the logits.
    pub(in crate::gpu::forward) fn record_chunk(
        &self,
        rec: &mut Recorder<'_>,
        b: &Batch,
        (n, all_logits): (usize, bool),
        resume: Option<ChunkResume<'_>>,
        (paused, on_device): (&mut Option<usize>, &mut Vec<usize>),
    ) -> Result<()> {
        let c = &self.config;
        let (e, nt) = (c.n_embd as u32, n as u32);
        if resume.is_none() {
            self.mark_start(rec);
        }
        let start = match resume {
            // The chunk's first layers ran through the stream slot ([`super::stream`]).
            None if b.x_ready => {
                rec.after_earlier_submissions();
                0
            }
            None => {
                let ids = StepWord {
                    buffer: &b.step,
                    index: 0,
                };
                let rows = b.input.as_ref().unwrap_or(&self.input_rows);
                rec.get_rows_n(rows, ids, nt, &b.x)?;
                0
            }
            Some(r) => {
                rec.after_earlier_submissions();
                let il = r.layer;
                let GpuFfn::Moe(moe) = &self.layers[il].ffn else {
                    unreachable!("layer {il} paused at its router")
                };
                let m = b.moe.as_ref().expect("MoE scratch");
                let bufs = (&m.xg, &m.eg, &m.eu, &m.ed);
                let route = (&m.route, r.weights_at);
                let fits = moe.groups_fit(rec);
                match (
                    r.off_vram.by_entry && fits,
                    &m.cpu,
                    r.groups.filter(|_| fits),
                ) {
                    (true, Some(cpu), _) => {
                        let k = c.moe.expect("MoE layers have a MoE config").n_expert_used;
                        let scratch = (&m.eg, &m.eu, &m.xg, &m.ed);
                        let route = (&cpu.route, 2 * k, false);
                        moe.record_tokens(rec, route, (n, k), &m.xn.buffer, scratch, &b.x)?
                    }
                    (_, _, Some(groups)) => {
                        moe.record_chunk_groups(rec, groups, route, &m.xn, bufs, &b.x)?
                    }
                    _ => moe.record_chunk_experts(rec, r.runs, route, &m.xn, bufs, &b.x)?,
                }
                if let (Some(from), Some(sh)) = (r.shared_from, &m.shared) {
                    let route = (&m.route, r.weights_at, from);
                    let bufs = (&sh.gate, &sh.up, &m.ed);
                    moe.record_chunk_shared(rec, n, route, &m.xn, bufs, &b.x)?;
                }
                if let (true, Some(cpu)) = (r.off_vram.cpu_sum, &m.cpu) {
                    rec.scale_add(&b.x, &cpu.sum, 1.0, e * nt)?;
                }
                il + 1
            }
        };
        self.record_chunk_layers(rec, b, (n, all_logits), start, (paused, on_device))
    }

    /// [`GpuModel::record_chunk`] from layer `start` on: the layers to the next MoE layer's
    /// router (setting `paused` to its layer) or to the logits.
    pub(in crate::gpu::forward) fn record_chunk_layers(
        &self,
        rec: &mut Recorder<'_>,
        b: &Batch,
        (n, all_logits): (usize, bool),
        start: usize,
        (paused, on_device): (&mut Option<usize>, &mut Vec<usize>),
    ) -> Result<()> {
        let c = &self.config;
        let (e, eps, nt) = (c.n_embd as u32, c.rms_eps, n as u32);
        // Whether the MoE layers run by entry: the same answer for every layer of the chunk.
        let by_entry =
            self.moe_by_entry(n) && b.moe.as_ref().is_some_and(|m| m.holds_entries(n, c));
        for (il, l) in self.layers.iter().enumerate().skip(start) {
            self.mark(rec, profile::attention(il));
            self.record_chunk_attention(rec, b, l, n)?;
            self.mark(rec, profile::ffn(il));
            match &l.ffn {
                GpuFfn::Dense { gate_up, down } => {
                    self.record_chunk_ffn(rec, b, l, (gate_up, down), n)?;
                }
                GpuFfn::Moe(moe) => {
                    let m = b.moe.as_ref().expect("MoE scratch");
                    rec.rms_norm(&b.x, &l.ffn_norm, &m.xn.buffer, e, nt, eps)?;
                    if let Some(d) = m.device.as_ref().filter(|_| moe.groups_fit(rec)) {
                        if by_entry {
                            self.record_tokens_routed(rec, (m, d), moe, (il, n), &b.x)?;
                            on_device.push(il);
                            continue;
                        }
                        self.record_chunk_routed(rec, (m, d), moe, (il, n), &b.x)?;
                        on_device.push(il);
                        continue;
                    }
                    rec.matvec_batch(moe.router(), &m.xn.buffer, &m.logits, n)?;
                    if let (Some(gate_inp), Some(sh)) = (moe.shared_gate_inp(), &m.shared) {
                        rec.matvec_batch(gate_inp, &m.xn.buffer, &sh.logits, n)?;
                    }
                    if let (true, Some(cpu)) = (b.cpu_turns, &m.cpu) {
                        // The same norm again, into memory the CPU's experts read.
                        rec.rms_norm(&b.x, &l.ffn_norm, &cpu.xn, e, nt, eps)?;
                    }
                    *paused = Some(il);
                    return Ok(());
                }
            }
        }
        self.mark(rec, profile::head(self.layers.len()));
        let head = self.output.as_ref().unwrap_or(&self.input_rows);
        match (&b.logits, all_logits) {
            (Some(logits), true) => {
                rec.rms_norm(&b.x, &self.output_norm, &b.xn, e, nt, eps)?;
                rec.matvec_batch(head, &b.xn, logits, n)?;
            }
            _ => {
                let last = Fused {
                    norm: Some((&self.output_norm, eps)),
                    x_offset: ((n - 1) * c.n_embd * 4) as u64,
                    ..Fused::default()
                };
                rec.matvec_fused(head, &b.x, &self.act.logits, last)?;
            }
        }
        self.mark_end(rec);
        Ok(())
    }
}
