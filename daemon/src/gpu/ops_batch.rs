//! Operations over several tokens at once, for prompts: the tiled matrix product
//! (`matvec_batch.comp`), which decodes each weight once per tile of tokens (64 for the f32
//! kernel; [`super::MatMulTile`]'s, 128 tuned, in the device's matrix units where it has
//! cooperative matrices).

use spillway_shaders::{
    DequantParams, Feature, GatherAddParams, MatVecBatchParams, MatVecColsParams,
    MatVecGroupedParams, MatVecRunsParams, Op, ScatterAddParams, ShaderId,
};

use super::buffer::Buffer;
use super::error::{GpuError, Result};
use super::ops::{grid, GpuMatrix, MatVecShape};
use super::record::{Binding, Recorder};

/// Rows and tokens of the tile one workgroup of the f32 `matvec_batch.comp` computes.
const TILE_ROWS: u32 = 64;
const TILE_TOKENS: u32 = 64;

/// Most input vectors one dispatch of `matvec.comp` with `COLS` takes (its sums, rows times
/// columns, are at most `MAX_ROWS`).
pub const MAX_MATVEC_COLS: u32 = MatVecShape::MAX_ROWS;

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
        self.batch_product(w, (first, n), x, (y, n), n_tok, false, None)
    }

    /// [`Recorder::matvec_batch_rows`] through `scratch` where the device has cooperative
    /// matrices: the rows are dequantized to f16 into it (as many as it holds at a time), then
    /// multiplied as an f16 matrix, whose tiles load eight weights a load instead of decoding
    /// them ([`Recorder::matmul_f16`]). Without cooperative matrices, the direct product.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_batch_rows_staged(
        &mut self,
        w: &GpuMatrix,
        first: usize,
        n: usize,
        x: &Buffer,
        y: &Buffer,
        n_tok: usize,
        scratch: &Buffer,
    ) -> Result<()> {
        self.batch_product(w, (first, n), x, (y, n), n_tok, false, Some(scratch))
    }

    /// [`Recorder::matvec_batch_add`] through `scratch`, as
    /// [`Recorder::matvec_batch_rows_staged`].
    pub fn matvec_batch_add_staged(
        &mut self,
        w: &GpuMatrix,
        x: &Buffer,
        y: &Buffer,
        n_tok: usize,
        scratch: &Buffer,
    ) -> Result<()> {
        self.batch_product(w, (0, w.n_out), x, (y, w.n_out), n_tok, true, Some(scratch))
    }

    /// `x[ids[first + i]] += w[first + i] * y[i]` for the `count` rows of `n` values of `y`:
    /// `route` holds the ids (token rows of `x`) from word 0 and the weights' f32 bits from word
    /// `weights_at`. An id must not repeat within the run.
    pub fn scatter_add(
        &mut self,
        x: &Buffer,
        y: &Buffer,
        route: &Buffer,
        (first, count, weights_at): (u32, u32, u32),
        n: u32,
    ) -> Result<()> {
        let end = u64::from(first) + u64::from(count);
        if end > u64::from(weights_at)
            || route.size() < (u64::from(weights_at) + end) * 4
            || y.size() < u64::from(count) * u64::from(n) * 4
            || count > 65535
        {
            return Err(GpuError::Unsupported(format!(
                "a scatter of {count} rows of {n} from entry {first} in buffers of {} and {} bytes",
                y.size(),
                route.size()
            )));
        }
        if count == 0 {
            return Ok(());
        }
        let push = ScatterAddParams {
            n,
            first,
            weights_at,
        };
        let bindings = [Binding::write(x), Binding::read(y), Binding::read(route)];
        self.dispatch(
            ShaderId::ScatterAdd,
            &bindings,
            &push,
            [n.div_ceil(256), count, 1],
        )
    }

    /// Whether `w`'s rows `first..` lie in one binding, as [`Recorder::matvec_batch_grouped`]
    /// needs.
    pub fn in_one_binding(&self, w: &GpuMatrix, first: usize) -> bool {
        self.row_chunks(w, first, w.n_out.saturating_sub(first))
            .is_ok_and(|c| c.len() == 1)
    }

    /// Several experts of the stack `w` (rows from `row0`, `rows` a expert) at once, each over
    /// its own rows of `x` into the same rows of `y` (`rows` floats a row): the runs are words
    /// `runs.1..` of `runs.0`, `runs.2` of them, each (slot, first row, rows); `span` rows of
    /// `x` and `y` in all, a run at most `max_count` of them. The stack from `row0` must be in
    /// one binding ([`Recorder::in_one_binding`]). Runs of at most [`crate::gpu::Kernels::matvec_cols`]
    /// rows take the several-column matrix-vector kernel (`matvec.comp` with COLS and RUNS)
    /// instead of tiles of 64.
    pub fn matvec_batch_grouped(
        &mut self,
        w: &GpuMatrix,
        (row0, rows): (usize, usize),
        x: &Buffer,
        y: &Buffer,
        (runs, runs_at, n_runs): (&Buffer, u32, u32),
        (span, max_count): (usize, usize),
    ) -> Result<()> {
        let floats = |b: &Buffer| b.size() / 4;
        let chunks = self.row_chunks(w, row0, w.n_out.saturating_sub(row0))?;
        if chunks.len() != 1
            || floats(x) < (span * w.n_in) as u64
            || floats(y) < (span * rows) as u64
            || runs.size() < (u64::from(runs_at) + 3 * u64::from(n_runs)) * 4
            || max_count > span
        {
            return Err(GpuError::Unsupported(format!(
                "{n_runs} experts of {rows} rows over {span} rows of {} inputs in buffers of \
                 {} and {} floats, from row {row0} of {} in {} bindings",
                w.n_in,
                floats(x),
                floats(y),
                w.n_out,
                chunks.len()
            )));
        }
        if n_runs == 0 || max_count == 0 {
            return Ok(());
        }
        let chunk = &chunks[0];
        if max_count <= self.matvec_cols() && w.n_in.is_multiple_of(4) {
            // A few rows an expert (a batched decode step): each expert's rows in one
            // workgroup's columns of the matrix-vector kernel, not in tiles of 64 tokens.
            let shape = (rows, span, max_count);
            return self.runs_product(w, chunk, (x, y), (runs, runs_at, n_runs), shape);
        }
        let id = self.variant(Op::MatVecBatchGrouped, Some(w.wtype))?;
        let (spec, tile_rows, tile_tokens) = self.batch_tile(id, false);
        let push = MatVecGroupedParams {
            n_in: w.n_in as u32,
            n_rows: rows as u32,
            w_offset: chunk.w_offset,
            y_offset: 0,
            n_tok: 0,
            x_stride: w.n_in as u32,
            y_stride: rows as u32,
            runs_at,
        };
        let groups = [
            (rows as u32).div_ceil(tile_rows),
            (max_count as u32).div_ceil(tile_tokens),
            n_runs,
        ];
        let bindings = [
            chunk.weights,
            Binding::read(x),
            Binding::write(y),
            Binding::read(runs),
        ];
        self.dispatch_spec(id, &spec, &bindings, &push, groups)
    }

    /// `x[t] += Σ w[first + e] * y[e]` for each of `n_tokens` tokens over the entries `e` its
    /// list gives (word `list_at` of `route`: the tokens, their `n_tokens + 1` starts, then the
    /// entries; the weights' bits from word `weights_at + first`); rows of `n` floats.
    pub fn gather_add(
        &mut self,
        x: &Buffer,
        y: &Buffer,
        route: &Buffer,
        (first, weights_at, list_at, n_tokens): (u32, u32, u32, u32),
        n: u32,
    ) -> Result<()> {
        if route.size() < (u64::from(list_at) + 2 * u64::from(n_tokens) + 1) * 4 || n_tokens > 65535
        {
            return Err(GpuError::Unsupported(format!(
                "a list of {n_tokens} tokens from word {list_at} in a route of {} bytes",
                route.size()
            )));
        }
        if n_tokens == 0 {
            return Ok(());
        }
        let push = GatherAddParams {
            n,
            first,
            weights_at,
            list_at,
            n_tokens,
        };
        let bindings = [Binding::write(x), Binding::read(y), Binding::read(route)];
        self.dispatch(
            ShaderId::GatherAdd,
            &bindings,
            &push,
            [n.div_ceil(256), n_tokens, 1],
        )
    }

    /// Rows `first..first + n` of `w` as f16 into `dst`, row-major from its start, two halves
    /// a word.
    pub fn dequant_f16_rows(
        &mut self,
        w: &GpuMatrix,
        first: usize,
        n: usize,
        dst: &Buffer,
    ) -> Result<()> {
        if dst.size() < (n * w.n_in * 2) as u64 {
            return Err(GpuError::Unsupported(format!(
                "{n} rows of {} halves into {} bytes",
                w.n_in,
                dst.size()
            )));
        }
        let id = self.variant(Op::DequantF16, Some(w.wtype))?;
        let units_per_row = (w.n_in / 32) as u32;
        for chunk in self.row_chunks(w, first, n)? {
            let push = DequantParams {
                n_blocks: chunk.rows * units_per_row,
                src_offset: chunk.w_offset,
                dst_offset: chunk.y_offset * w.n_in as u32,
            };
            let groups = grid((chunk.rows * units_per_row).div_ceil(64));
            self.dispatch(id, &[chunk.weights, Binding::write(dst)], &push, groups)?;
        }
        Ok(())
    }

    /// `y[t * y_stride + y_offset + r] (+)= a_r · x[t]` for the `n_rows` rows of an f16 matrix
    /// of `n_in` columns (as [`Recorder::dequant_f16_rows`] writes it), in cooperative matrices.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_f16(
        &mut self,
        a: &Buffer,
        (n_rows, n_in): (usize, usize),
        x: &Buffer,
        (y, y_offset, y_stride): (&Buffer, usize, usize),
        n_tok: usize,
        accumulate: bool,
    ) -> Result<()> {
        let floats = |b: &Buffer| b.size() / 4;
        if a.size() < (n_rows * n_in * 2) as u64
            || floats(x) < (n_tok * n_in) as u64
            || floats(y) < (n_tok * y_stride) as u64
            || !n_in.is_multiple_of(32)
        {
            return Err(GpuError::Unsupported(format!(
                "an f16 product of {n_rows} × {n_in} over {n_tok} tokens in buffers of {}, {} \
                 and {} bytes",
                a.size(),
                x.size(),
                y.size()
            )));
        }
        let id = self.variant(Op::Matmul, None)?;
        let t = self.matmul_tile();
        let spec = t.spec(self.subgroup_size(), accumulate);
        let push = MatVecBatchParams {
            n_in: n_in as u32,
            n_rows: n_rows as u32,
            w_offset: 0,
            y_offset: y_offset as u32,
            n_tok: n_tok as u32,
            x_stride: n_in as u32,
            y_stride: y_stride as u32,
        };
        let groups = [
            (n_rows as u32).div_ceil(t.rows),
            (n_tok as u32).div_ceil(t.tokens),
            1,
        ];
        let bindings = [Binding::read(a), Binding::read(x), Binding::write(y)];
        self.dispatch_spec(id, &spec, &bindings, &push, groups)
    }

    /// `Y[t] += W · X[t]` (the residual sums of a prompt's layers).
    pub fn matvec_batch_add(
        &mut self,
        w: &GpuMatrix,
        x: &Buffer,
        y: &Buffer,
        n_tok: usize,
    ) -> Result<()> {
        self.batch_product(w, (0, w.n_out), x, (y, w.n_out), n_tok, true, None)
    }

    /// [`Recorder::batch_product`] of a few tokens (at most [`MAX_MATVEC_COLS`]) in one
    /// dispatch of `matvec.comp` with `COLS` per binding of rows: each workgroup takes a few
    /// rows of every token, so each weight is read once for all of them.
    fn cols_product(
        &mut self,
        w: &GpuMatrix,
        chunks: Vec<super::ops::RowChunk<'_>>,
        x: &Buffer,
        (y, y_stride): (&Buffer, usize),
        n_tok: usize,
        accumulate: bool,
    ) -> Result<()> {
        let cols = n_tok as u32;
        if cols > MAX_MATVEC_COLS || !w.n_in.is_multiple_of(4) {
            return Err(GpuError::Unsupported(format!(
                "{cols} columns of {} inputs in one matrix-vector product",
                w.n_in
            )));
        }
        let vectors = (w.n_in, n_tok, w.n_in);
        let inputs =
            self.product_inputs((Op::MatVecCols, w.wtype, usize::MAX), x, 0, vectors, None)?;
        let (id, x_stride) = (inputs.id, inputs.x_stride);
        let n: usize = chunks.iter().map(|c| c.rows as usize).sum();
        let (spec, rows) = self.cols_shape((Op::MatVecCols, w), n, cols, accumulate);
        for chunk in chunks {
            let push = MatVecColsParams {
                n_in: w.n_in as u32,
                n_rows: chunk.rows,
                w_offset: chunk.w_offset,
                y_offset: chunk.y_offset,
                n_cols: cols,
                x_stride,
                y_stride: y_stride as u32,
                eps: 0.0,
            };
            let bindings = [
                chunk.weights,
                inputs.binding(Binding::read(x)),
                Binding::write(y),
                Binding::read(x),
            ];
            let groups = grid(chunk.rows.div_ceil(rows));
            self.dispatch_spec(id, &spec, &bindings, &push, groups)?;
        }
        Ok(())
    }

    /// [`Recorder::matvec_batch_grouped`] of runs of at most [`MAX_MATVEC_COLS`] rows
    /// (`max_count`) in one dispatch of `matvec.comp` with `COLS` and `RUNS`: workgroup layer z
    /// takes run z, each workgroup a few rows of its expert times every row of the run.
    fn runs_product(
        &mut self,
        w: &GpuMatrix,
        chunk: &super::ops::RowChunk<'_>,
        (x, y): (&Buffer, &Buffer),
        (runs, runs_at, n_runs): (&Buffer, u32, u32),
        (rows, span, max_count): (usize, usize, usize),
    ) -> Result<()> {
        let vectors = (w.n_in, span, w.n_in);
        let inputs =
            self.product_inputs((Op::MatVecRuns, w.wtype, usize::MAX), x, 0, vectors, None)?;
        let (id, x_stride) = (inputs.id, inputs.x_stride);
        let (spec, per_group) = self.cols_shape((Op::MatVecRuns, w), rows, max_count as u32, false);
        let push = MatVecRunsParams {
            n_in: w.n_in as u32,
            n_rows: rows as u32,
            w_offset: chunk.w_offset,
            y_offset: 0,
            runs_at,
            x_stride,
            y_stride: rows as u32,
            eps: 0.0,
        };
        let bindings = [
            chunk.weights,
            inputs.binding(Binding::read(x)),
            Binding::write(y),
            Binding::read(runs),
            Binding::read(x),
        ];
        let [gx, gy, _] = grid((rows as u32).div_ceil(per_group));
        self.dispatch_spec(id, &spec, &bindings, &push, [gx, gy, n_runs])
    }

    /// The specialization constants of `matvec.comp` with `COLS` for `cols` columns of
    /// `results` rows of `w` (`op` [`Op::MatVecCols`] or [`Op::MatVecRuns`]), and the rows a
    /// workgroup takes: the tuned shape's, fewer so that its rows times columns sums fit, a
    /// power of two.
    fn cols_shape(
        &self,
        (op, w): (Op, &GpuMatrix),
        results: usize,
        cols: u32,
        accumulate: bool,
    ) -> ([u32; 7], u32) {
        let shape = self.matvec_shape_for((op, w.wtype), (results, 1), false, w.n_in);
        let rows = (MAX_MATVEC_COLS / cols).min(shape.rows).max(1);
        let rows = 1 << rows.ilog2();
        let threads = shape.threads.max(MAX_MATVEC_COLS);
        ([threads, rows, u32::from(accumulate), 0, 0, 0, cols], rows)
    }

    /// The specialization constants (workgroup size, accumulate, depth, subgroups along rows
    /// and tokens), tile rows and tile tokens of `matvec_batch.comp`'s variant `id`: the
    /// cooperative-matrix tile, or the f32 kernel's fixed one.
    fn batch_tile(&self, id: ShaderId, accumulate: bool) -> ([u32; 5], u32, u32) {
        if id.info().feature == Feature::CoopMat {
            let t = self.matmul_tile();
            (t.spec(self.subgroup_size(), accumulate), t.rows, t.tokens)
        } else {
            ([256, accumulate as u32, 64, 2, 2], TILE_ROWS, TILE_TOKENS)
        }
    }

    /// Rows `rows.0..rows.0 + rows.1` of `w` times each token of `x` into `y.0`, whose tokens
    /// are `y.1` floats apart; through `scratch` in f16 where the device multiplies f16
    /// matrices ([`Recorder::matvec_batch_rows_staged`]).
    #[allow(clippy::too_many_arguments)]
    fn batch_product(
        &mut self,
        w: &GpuMatrix,
        (first, n): (usize, usize),
        x: &Buffer,
        (y, y_stride): (&Buffer, usize),
        n_tok: usize,
        accumulate: bool,
        scratch: Option<&Buffer>,
    ) -> Result<()> {
        let row_halves = w.n_in as u64 * 2;
        if let Some(scratch) = scratch.filter(|s| {
            self.variant(Op::Matmul, None).is_ok() && s.size().min(self.max_range) >= row_halves
        }) {
            let piece = (scratch.size().min(self.max_range) / row_halves) as usize;
            let mut p0 = first;
            while p0 < first + n {
                let pn = piece.min(first + n - p0);
                self.dequant_f16_rows(w, p0, pn, scratch)?;
                let out = (y, p0 - first, y_stride);
                self.matmul_f16(scratch, (pn, w.n_in), x, out, n_tok, accumulate)?;
                p0 += pn;
            }
            return Ok(());
        }
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
        if n_tok > 1 && n_tok <= self.matvec_cols() {
            return self.cols_product(w, chunks, x, (y, y_stride), n_tok, accumulate);
        }
        let id = self.variant(Op::MatVecBatch, Some(w.wtype))?;
        let (spec, tile_rows, tile_tokens) = self.batch_tile(id, accumulate);
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
                chunk.rows.div_ceil(tile_rows),
                (n_tok as u32).div_ceil(tile_tokens),
                1,
            ];
            let bindings = [chunk.weights, Binding::read(x), Binding::write(y)];
            self.dispatch_spec(id, &spec, &bindings, &push, groups)?;
        }
        Ok(())
    }
}
