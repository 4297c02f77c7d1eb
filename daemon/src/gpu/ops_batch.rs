//! Operations over several tokens at once, for prompts: the tiled matrix product
//! (`matvec_batch.comp`), which decodes each weight once per tile of 64 tokens and multiplies in
//! the device's matrix units where it has cooperative matrices.

use spillway_shaders::{Feature, MatVecBatchParams, Op};

use super::buffer::Buffer;
use super::error::{GpuError, Result};
use super::ops::GpuMatrix;
use super::record::{Binding, Recorder};

/// Rows and tokens of the tile one workgroup of `matvec_batch.comp` computes.
const TILE_ROWS: u32 = 64;
pub const TOKEN_TILE: u32 = 64;

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
        self.batch_product(w, (first, n), x, (y, n), n_tok, false)
    }

    /// `Y[t] += W · X[t]` (the residual sums of a prompt's layers).
    pub fn matvec_batch_add(
        &mut self,
        w: &GpuMatrix,
        x: &Buffer,
        y: &Buffer,
        n_tok: usize,
    ) -> Result<()> {
        self.batch_product(w, (0, w.n_out), x, (y, w.n_out), n_tok, true)
    }

    /// Rows `rows.0..rows.0 + rows.1` of `w` times each token of `x` into `y.0`, whose tokens
    /// are `y.1` floats apart.
    fn batch_product(
        &mut self,
        w: &GpuMatrix,
        (first, n): (usize, usize),
        x: &Buffer,
        (y, y_stride): (&Buffer, usize),
        n_tok: usize,
        accumulate: bool,
    ) -> Result<()> {
        let floats = |b: &Buffer| b.size() / 4;
        if floats(x) < (n_tok * w.n_in) as u64 || floats(y) < (n_tok * y_stride) as u64 {
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
        let wg = if id.info().feature == Feature::CoopMat {
            4 * self.subgroup_size()
        } else {
            256
        };
        for chunk in chunks {
            let push = MatVecBatchParams {
                n_in: w.n_in as u32,
                n_rows: chunk.rows,
                w_offset: chunk.w_offset,
                y_offset: chunk.y_offset,
                n_tok: n_tok as u32,
                x_stride: w.n_in as u32,
                y_stride: y_stride as u32,
            };
            let groups = [
                chunk.rows.div_ceil(TILE_ROWS),
                (n_tok as u32).div_ceil(TOKEN_TILE),
                1,
            ];
            let bindings = [chunk.weights, Binding::read(x), Binding::write(y)];
            self.dispatch_spec(id, &[wg, accumulate as u32], &bindings, &push, groups)?;
        }
        Ok(())
    }
}
