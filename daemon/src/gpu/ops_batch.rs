//! Operations over several tokens at once, for prompts: today the batched matrix product,
//! which decodes each weight once per tile of eight tokens (`matvec_batch.comp`).
//!
//! Partial: correct, but not yet fast. On the H200 a tile of eight tokens took about three times
//! as long as eight one-token products (`bench/RESULTS.md`): one row per workgroup with eight
//! accumulators leaves too little parallelism; it needs shared-memory tiles of rows and tokens.
//! The rest of a batched forward step (norms, RoPE, the KV append, causal attention over several
//! positions) is still per token, so `GpuModel` does not use this yet.

use spillway_shaders::{MatVecBatchParams, Op};

use super::buffer::Buffer;
use super::error::{GpuError, Result};
use super::ops::{grid, GpuMatrix};
use super::record::{Binding, Recorder};

/// Tokens one workgroup of `matvec_batch.comp` serves (its `TILE`).
pub const TOKEN_TILE: u32 = 8;

impl Recorder<'_> {
    /// `Y[t] = W · X[t]` for `n_tok` tokens; `x` holds them token-major (`n_tok × n_in`), `y`
    /// receives `n_tok × n_out`, token-major.
    pub fn matvec_batch(
        &mut self,
        w: &GpuMatrix,
        x: &Buffer,
        y: &Buffer,
        n_tok: usize,
    ) -> Result<()> {
        self.matvec_batch_rows(w, 0, w.n_out, x, y, n_tok)
    }

    /// [`Recorder::matvec_batch`] over rows `first..first + n` of `w` only (one expert of a
    /// stack); token `t`'s results land at `y[t * n..(t + 1) * n]`.
    pub fn matvec_batch_rows(
        &mut self,
        w: &GpuMatrix,
        first: usize,
        n: usize,
        x: &Buffer,
        y: &Buffer,
        n_tok: usize,
    ) -> Result<()> {
        let floats = |b: &Buffer| b.size() / 4;
        if floats(x) < (n_tok * w.n_in) as u64 || floats(y) < (n_tok * n) as u64 {
            return Err(GpuError::Unsupported(format!(
                "{n_tok} tokens of {} inputs and {n} outputs do not fit buffers of {} and {} floats",
                w.n_in,
                floats(x),
                floats(y)
            )));
        }
        let chunks = self.row_chunks(w, first, n)?;
        if n_tok == 0 {
            return Ok(());
        }
        let id = self.variant(Op::MatVecBatch, Some(w.wtype))?;
        for chunk in chunks {
            let push = MatVecBatchParams {
                n_in: w.n_in as u32,
                n_rows: chunk.rows,
                w_offset: chunk.w_offset,
                y_offset: chunk.y_offset,
                n_tok: n_tok as u32,
                x_stride: w.n_in as u32,
                y_stride: n as u32,
            };
            let [gx, gy, _] = grid(chunk.rows);
            let groups = [gx, gy, (n_tok as u32).div_ceil(TOKEN_TILE)];
            let bindings = [chunk.weights, Binding::read(x), Binding::write(y)];
            self.dispatch(id, &bindings, &push, groups)?;
        }
        Ok(())
    }
}
