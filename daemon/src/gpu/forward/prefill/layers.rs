//! A chunk's attention and dense FFN: every token of the chunk through a layer at once.

use super::Batch;
use crate::gpu::error::Result;
use crate::gpu::forward::{GateUp, GpuLayer, GpuModel};
use crate::gpu::ops::{GpuMatrix, StepWord};
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
}
