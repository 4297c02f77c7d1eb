//! One token's attention with its RoPE in the same dispatch (`attention.comp` with `ROPE_IN`):
//! decode's Q, K and V go from the products straight to attention, the QK-norm, RoPE and the
//! KV-cache append done by the attention's workgroups. And a prompt chunk's attention, flash
//! attention style (`attention_prefill.comp`).

use spillway_shaders::{AttentionPrefillParams, AttentionRopeParams, Op};

use super::buffer::Buffer;
use super::error::{GpuError, Result};
use super::ops::{attention_params, AttentionArgs, RopeArgs, StepWord, ATTENTION_SPLIT};
use super::record::{Binding, Grid, Recorder};
use crate::model::RopeLayout;

/// The new token's Q, K and V as the products wrote them, and the QK-norm weights of Q and K
/// (Qwen3), for [`Recorder::attention_rope`].
#[derive(Clone, Copy)]
pub struct Unroped<'b> {
    pub q: &'b Buffer,
    pub k: &'b Buffer,
    pub v: &'b Buffer,
    pub qk_norm: Option<(&'b Buffer, &'b Buffer)>,
}

impl Recorder<'_> {
    /// [`Recorder::rope`] of Q, [`Recorder::rope_store`] of K and V, then
    /// [`Recorder::attention`], in one dispatch: the same values up to the order of the QK-norm's
    /// sum (a workgroup of 128 sums the squares, not one of 64). `rope` describes the query heads
    /// (`n_heads` is not used: `a` has the heads). With `grid`, the dispatch's grid is read from
    /// those three words when it runs ([`attention_grid`] of the position, written with it):
    /// only the runs up to the position are launched, not every run of the capacity, which
    /// the grid must cover otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_rope(
        &mut self,
        new: Unroped<'_>,
        (table, rope): (&Buffer, RopeArgs),
        (k_cache, v_cache): (&Buffer, &Buffer),
        (scratch, done): (&Buffer, &Buffer),
        out: &Buffer,
        a: AttentionArgs,
        (pos, grid): (StepWord<'_>, Option<StepWord<'_>>),
    ) -> Result<()> {
        let caches = (k_cache, v_cache);
        let base = attention_params(new.q, caches, (scratch, done), out, a, pos, (1, a.capacity))?;
        let kv_bytes = u64::from(a.n_kv_heads * a.head_dim) * 4;
        if rope.head_dim != a.head_dim
            || rope.n_rot > a.head_dim
            || !rope.n_rot.is_multiple_of(2)
            || new.k.size().min(new.v.size()) < kv_bytes
            || new
                .qk_norm
                .is_some_and(|(q, k)| q.size().min(k.size()) < u64::from(a.head_dim) * 4)
        {
            return Err(GpuError::Unsupported(format!(
                "attention with RoPE of {} dims, heads of {}, K and V in {} and {} bytes",
                rope.n_rot,
                a.head_dim,
                new.k.size(),
                new.v.size()
            )));
        }
        let n_pos = table.size() / (u64::from(rope.n_rot) * 4).max(4);
        if n_pos == 0 {
            return Err(GpuError::Unsupported("an empty RoPE table".into()));
        }
        let push = AttentionRopeParams {
            head_dim: base.head_dim,
            kv_width: base.kv_width,
            group: base.group,
            capacity: base.capacity,
            scale: base.scale,
            step_index: base.step_index,
            n_rot: rope.n_rot,
            n_pos: n_pos.min(u64::from(u32::MAX)) as u32,
            eps: rope.eps,
            qk_norm: u32::from(new.qk_norm.is_some()),
        };
        // Without a QK-norm the table stands in for its weights.
        let (q_norm, k_norm) = new.qk_norm.unwrap_or((table, table));
        let bindings = [
            Binding::read(new.q),
            Binding::write(k_cache),
            Binding::write(v_cache),
            Binding::write(scratch),
            pos.binding(),
            Binding::write(out),
            Binding::write(done),
            Binding::read(new.k),
            Binding::read(new.v),
            Binding::read(q_norm),
            Binding::read(k_norm),
            Binding::read(table),
        ];
        let op = match rope.layout {
            RopeLayout::Normal => Op::AttentionRopeNorm,
            RopeLayout::Neox => Op::AttentionRopeNeox,
        };
        let id = self.variant(op, None)?;
        let grid = match grid {
            Some(words) => Grid::Indirect(words),
            None => Grid::Fixed(attention_grid(a, base.capacity - 1)),
        };
        self.dispatch_grid(id, &[a.head_dim], &bindings, &push, grid)
    }

    /// [`Recorder::attention_n`] of a prompt chunk's `n_tok` tokens (causal: token `t`, at the
    /// position of its pair of words from `pos`, attends to its sequence's positions up to it),
    /// a workgroup per query head and tile of 16 tokens reading each key and value once for the
    /// tile: no scratch, no counters. The tokens must be consecutive positions of one sequence.
    /// Heads of 8 to 128 dimensions, a power of two ([`flash_attention_fits`]).
    pub fn attention_prefill(
        &mut self,
        q: &Buffer,
        (k_cache, v_cache): (&Buffer, &Buffer),
        out: &Buffer,
        a: AttentionArgs,
        pos: StepWord<'_>,
        n_tok: u32,
    ) -> Result<()> {
        let cache_bytes = u64::from(a.capacity) * u64::from(a.n_kv_heads * a.head_dim) * 2;
        let io_bytes = u64::from(n_tok) * u64::from(a.n_heads * a.head_dim) * 4;
        if !flash_attention_fits(a)
            || n_tok == 0
            || n_tok.div_ceil(PREFILL_TILE) > 65535
            || q.size().min(out.size()) < io_bytes
            || k_cache.size().min(v_cache.size()) < cache_bytes
        {
            return Err(GpuError::Unsupported(format!(
                "prompt attention of {n_tok} tokens of {a:?}"
            )));
        }
        pos.check_positions(n_tok)?;
        let push = AttentionPrefillParams {
            head_dim: a.head_dim,
            kv_width: a.n_kv_heads * a.head_dim,
            group: a.n_heads / a.n_kv_heads,
            capacity: a.capacity,
            scale: 1.0 / (a.head_dim as f32).sqrt(),
            step_index: pos.index,
            n_tok,
        };
        let bindings = [
            Binding::read(q),
            Binding::read(k_cache),
            Binding::read(v_cache),
            pos.binding(),
            Binding::write(out),
        ];
        let id = self.variant(Op::AttentionPrefill, None)?;
        let groups = [a.n_heads, n_tok.div_ceil(PREFILL_TILE), 1];
        self.dispatch_spec(id, &[a.head_dim], &bindings, &push, groups)
    }
}

/// Tokens per workgroup of [`Recorder::attention_prefill`] (`attention_prefill.comp`'s `BQ`).
pub const PREFILL_TILE: u32 = 16;

/// The grid of [`Recorder::attention_rope`] for a token at `pos`: a workgroup per head and run
/// of [`ATTENTION_SPLIT`] positions up to it.
pub fn attention_grid(a: AttentionArgs, pos: u32) -> [u32; 3] {
    let n_kv = pos.saturating_add(1).min(a.capacity);
    [a.n_heads, n_kv.div_ceil(ATTENTION_SPLIT).max(1), 1]
}

/// Whether [`Recorder::attention_prefill`] takes heads of this shape: a power of two from 8 to
/// 128 dimensions (its tiles of keys and values fill shared memory at 128), GQA groups whole.
pub fn flash_attention_fits(a: AttentionArgs) -> bool {
    a.head_dim.is_power_of_two()
        && (8..=128).contains(&a.head_dim)
        && a.n_kv_heads > 0
        && a.n_heads.is_multiple_of(a.n_kv_heads)
        && a.capacity > 0
}
