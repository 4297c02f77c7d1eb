//! One token's attention with its RoPE in the same dispatch (`attention.comp` with `ROPE_IN`):
//! decode's Q, K and V go from the products straight to attention, the QK-norm, RoPE and the
//! KV-cache append done by the attention's workgroups.

use spillway_shaders::{AttentionRopeParams, Op};

use super::buffer::Buffer;
use super::error::{GpuError, Result};
use super::ops::{attention_params, AttentionArgs, RopeArgs, StepWord, ATTENTION_SPLIT};
use super::record::{Binding, Recorder};
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
    /// (`n_heads` is not used: `a` has the heads).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_rope(
        &mut self,
        new: Unroped<'_>,
        (table, rope): (&Buffer, RopeArgs),
        (k_cache, v_cache): (&Buffer, &Buffer),
        (scratch, done): (&Buffer, &Buffer),
        out: &Buffer,
        a: AttentionArgs,
        pos: StepWord<'_>,
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
        let runs = base.capacity.div_ceil(ATTENTION_SPLIT);
        self.dispatch_spec(id, &[a.head_dim], &bindings, &push, [a.n_heads, runs, 1])
    }
}
