//! The operations of a decode step, recorded through a [`Recorder`]: each picks its variant from
//! the shader table, fills its push constants and sizes its grid. Weight matrices larger than one
//! binding may cover (`maxStorageBufferRange`) are bound a range of rows at a time.

use std::sync::Arc;

use spillway_shaders::{
    AttentionParams, EltwiseParams, GetRowsParams, KvStoreParams, MatVecParams, Op, RmsNormParams,
    RopeParams, ScaleAddParams, ShaderId,
};

use super::alloc::{Allocator, MemoryUse};
use super::buffer::Buffer;
use super::error::{GpuError, Result};
use super::record::{Access, Binding, Grid, Recorder};
use crate::model::RopeLayout;

// Weights on the device and the products' shapes have files of their own; named here too.
pub(crate) use super::matrix::{f32_bytes, fill_parts};
pub use super::matrix::{upload_f32, weight_type, GpuMatrix};
pub use super::matvec_shape::MatVecShape;

// The MoE layer's operations live in `ops_moe`; their arguments are named here too.
pub use super::ops_moe::{
    route_floats, route_log_floats, route_split_floats, ChunkLayout, IdFused, MoeRouteArgs,
    MOE_ROUTE_MAX_EXPERTS,
};

/// Byte alignment of every row start [`Recorder::matvec`] passes to `matvec.comp`, where rows
/// are a whole number of 16 bytes (F32, F16, Q4_K): the kernel reads those 16 bytes at a time.
const ROW_ALIGN: u64 = 16;

/// A grid of `n` workgroups, folded into two dimensions past 65535 (the smallest limit Vulkan
/// guarantees per dimension); kernels that use it rebuild the index from both.
pub(crate) fn grid(n: u32) -> [u32; 3] {
    const MAX: u32 = 65535;
    if n <= MAX {
        [n.max(1), 1, 1]
    } else {
        [MAX, n.div_ceil(MAX), 1]
    }
}

/// Parameters of RoPE for one set of heads.
#[derive(Debug, Clone, Copy)]
pub struct RopeArgs {
    pub layout: RopeLayout,
    pub n_heads: u32,
    pub head_dim: u32,
    pub n_rot: u32,
    /// RMSNorm eps, used with a QK-norm weight.
    pub eps: f32,
}

/// Parameters of one token's attention.
#[derive(Debug, Clone, Copy)]
pub struct AttentionArgs {
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Positions the caches hold: the most that attend.
    pub capacity: u32,
}

/// Positions per workgroup of the attention kernel (`attention.comp`'s `SPLIT`).
pub const ATTENTION_SPLIT: u32 = 128;

/// Floats of scratch [`Recorder::attention`] needs: per head and run of positions, a partial
/// output, its maximum and its sum.
pub fn attention_scratch_floats(n_heads: usize, head_dim: usize, capacity: usize) -> usize {
    n_heads * capacity.div_ceil(ATTENTION_SPLIT as usize) * (head_dim + 2)
}

/// The counters [`Recorder::attention`] joins its runs with, one per head and token of
/// `n_tok` ([`zeroed_counters`]).
pub fn attention_counters(
    allocator: &Arc<Allocator>,
    n_heads: usize,
    n_tok: usize,
) -> Result<Buffer> {
    zeroed_counters(allocator, n_heads * n_tok)
}

/// `n` counters for the kernels whose last workgroup to finish completes their work (the
/// attention's join, [`Recorder::moe_router`]'s routing), zero as they need them (each
/// dispatch leaves them zero): host-visible memory, written here, so that no command has to
/// clear them.
pub fn zeroed_counters(allocator: &Arc<Allocator>, n: usize) -> Result<Buffer> {
    let n = n.max(1);
    let mut b = Buffer::new_in(allocator, n as u64 * 4, MemoryUse::DeviceMapped)?;
    b.write(&vec![0u8; n * 4]);
    Ok(b)
}

/// What a matrix-vector product does besides `W · x`, in its own dispatch (`matvec.comp`).
#[derive(Clone, Copy, Default)]
pub struct Fused<'b> {
    /// Add the results to `y` (a residual sum) instead of storing them.
    pub accumulate: bool,
    /// Take RMSNorm(x) times these weights, with this eps, as the input: no separate norm.
    pub norm: Option<(&'b Buffer, f32)>,
    /// The matrix is a stack of gate rows then up rows, and the results are
    /// `silu(gate · x) * (up · x)` (SwiGLU).
    pub glu: bool,
    /// Bytes into `x` where the input vector starts (one token of a prompt's activations); a
    /// multiple of the device's storage-buffer offset alignment.
    pub x_offset: u64,
}

/// A `u32` the device reads when a dispatch runs, not when it is recorded: word `index` of
/// `buffer` (a token id, a position), so that one recording serves every step of a sequence
/// ([`super::replay`]).
///
/// Where it gives positions (RoPE, the KV-cache append, attention) it starts a pair of words
/// per token: token `t`'s position is word `index + 2t` and the KV cache row where its
/// sequence's position 0 lives is word `index + 2t + 1`. A cache holds several sequences one
/// after another ([`crate::gpu::forward::GpuModel::sequences`]); a single sequence's row is 0.
#[derive(Clone, Copy)]
pub struct StepWord<'b> {
    pub buffer: &'b Buffer,
    pub index: u32,
}

impl<'b> StepWord<'b> {
    pub(crate) fn binding(self) -> Binding<'b> {
        Binding::read(self.buffer)
    }

    /// Checks that the buffer holds the position and first row of `n_tok` tokens from here.
    pub(crate) fn check_positions(self, n_tok: u32) -> Result<()> {
        let words = u64::from(self.index) + 2 * u64::from(n_tok);
        if self.buffer.size() < words * 4 {
            return Err(GpuError::Unsupported(format!(
                "positions of {n_tok} tokens from word {} of a {}-byte step buffer",
                self.index,
                self.buffer.size()
            )));
        }
        Ok(())
    }
}

/// One binding's run of a matrix's rows (see [`Recorder::row_chunks`]).
pub(crate) struct RowChunk<'w> {
    pub weights: Binding<'w>,
    pub rows: u32,
    /// Byte offset of the run's first row within the binding.
    pub w_offset: u32,
    /// Index of the run's first row among the rows asked for.
    pub y_offset: u32,
}

impl Recorder<'_> {
    /// `y = W · x` (f32 vectors of `n_in` and `n_out`).
    pub fn matvec(&mut self, w: &GpuMatrix, x: &Buffer, y: &Buffer) -> Result<()> {
        self.matvec_into(w, 0, w.n_out, x, y, Fused::default())
    }

    /// `y += W · x`: a product added to a residual sum in the same dispatch (each sum is
    /// `y + (W · x)`, as an `add` after the product would give).
    pub fn matvec_add(&mut self, w: &GpuMatrix, x: &Buffer, y: &Buffer) -> Result<()> {
        let fused = Fused {
            accumulate: true,
            ..Fused::default()
        };
        self.matvec_into(w, 0, w.n_out, x, y, fused)
    }

    /// `W · x` with the ops `fused` names done in the same dispatch (see [`Fused`]). With
    /// `glu`, `w` is a stack of gate rows then as many up rows, which must fit one binding
    /// (`maxStorageBufferRange`), and `y` gets half as many results as `w` has rows.
    pub fn matvec_fused(
        &mut self,
        w: &GpuMatrix,
        x: &Buffer,
        y: &Buffer,
        fused: Fused<'_>,
    ) -> Result<()> {
        self.matvec_into(w, 0, w.n_out, x, y, fused)
    }

    /// `y = W[first..first + n] · x`: rows `first..first + n` of `w` only, their results at
    /// `y[0..n]` (one expert of a stack uploaded as one matrix). Rows need not start on a
    /// binding-offset boundary: the binding starts at the boundary below and the kernel skips
    /// to the row.
    pub fn matvec_rows(
        &mut self,
        w: &GpuMatrix,
        first: usize,
        n: usize,
        x: &Buffer,
        y: &Buffer,
    ) -> Result<()> {
        self.matvec_into(w, first, n, x, y, Fused::default())
    }

    fn matvec_into(
        &mut self,
        w: &GpuMatrix,
        first: usize,
        n: usize,
        x: &Buffer,
        y: &Buffer,
        fused: Fused<'_>,
    ) -> Result<()> {
        let chunks = self.row_chunks(w, first, n)?;
        if fused.glu && (chunks.len() != 1 || first != 0 || !n.is_multiple_of(2)) {
            return Err(GpuError::Unsupported(format!(
                "a GLU stack of {n} rows of {} bytes in {} bindings",
                w.row_bytes,
                chunks.len()
            )));
        }
        let norm = fused.norm.map(|(b, _)| b);
        let inputs = self.product_inputs(
            (Op::MatVec, w.wtype, n),
            x,
            fused.x_offset,
            (w.n_in, 1, w.n_in),
            norm,
        )?;
        // With GLU a workgroup's rows are half gate rows, half up rows.
        let glu_rows = if fused.glu { 2 } else { 1 };
        let results = (n / glu_rows as usize, glu_rows);
        // Quantized inputs carry their norm's Σ x²: no workgroup rereads the norm weights.
        let rereads_norm = norm.is_some() && !inputs.quantized();
        let shape = self.matvec_shape_for((Op::MatVec, w.wtype), results, rereads_norm, w.n_in);
        let rows = shape.rows.max(glu_rows) & !(glu_rows - 1);
        let per_group = rows / glu_rows;
        let spec = [
            shape.threads,
            rows,
            u32::from(fused.accumulate),
            u32::from(fused.norm.is_some()),
            u32::from(fused.glu),
        ];
        let (norm_w, eps) = match fused.norm {
            Some((w, eps)) => (w, eps),
            None => (x, 0.0), // unused: x stands in for the binding
        };
        for chunk in chunks {
            let n_rows = if fused.glu {
                chunk.rows / 2
            } else {
                chunk.rows
            };
            let push = MatVecParams {
                n_in: w.n_in as u32,
                n_rows,
                w_offset: chunk.w_offset,
                y_offset: chunk.y_offset,
                eps,
            };
            let x_binding = inputs.binding(Binding {
                offset: fused.x_offset,
                range: (w.n_in as u64 * 4).min(x.size().saturating_sub(fused.x_offset)),
                ..Binding::read(x)
            });
            let bindings = [
                chunk.weights,
                x_binding,
                Binding::write(y),
                Binding::read(norm_w),
            ];
            let groups = grid(n_rows.div_ceil(per_group));
            self.dispatch_spec(inputs.id, &spec, &bindings, &push, groups)?;
        }
        Ok(())
    }

    /// Rows `first..first + n` of `w` cut into runs that one binding covers (at most
    /// `maxStorageBufferRange` bytes, starting on the offset boundary below the run's first
    /// row, which is also a multiple of 16 bytes), for the row-wise products.
    pub(crate) fn row_chunks<'w>(
        &self,
        w: &'w GpuMatrix,
        first: usize,
        n: usize,
    ) -> Result<Vec<RowChunk<'w>>> {
        if first + n > w.n_out {
            return Err(GpuError::Unsupported(format!(
                "rows {first}..{} of a matrix of {} rows",
                first + n,
                w.n_out
            )));
        }
        // Both are powers of two, so the larger is a multiple of the other.
        let (rb, align) = (w.row_bytes, self.align.max(ROW_ALIGN));
        let max_rows = (self.max_range.saturating_sub(align) / rb).max(1);
        let end = (first + n) as u64;
        let mut r0 = first as u64;
        let mut chunks = Vec::new();
        while r0 < end {
            let start = r0 * rb;
            let bound = start / align * align;
            let rows = (end - r0).min(max_rows);
            let range = (start - bound + rows * rb)
                .next_multiple_of(4)
                .min(w.buffer.size() - bound);
            chunks.push(RowChunk {
                weights: Binding {
                    buffer: &w.buffer,
                    offset: bound,
                    range,
                    access: Access::Read,
                },
                rows: rows as u32,
                w_offset: (start - bound) as u32,
                y_offset: (r0 - first as u64) as u32,
            });
            r0 += rows;
        }
        Ok(chunks)
    }

    /// The row of `w` that `row` holds when the dispatch runs, as f32 into `dst` (the
    /// embedding lookup). A matrix larger than one binding takes a dispatch per run of rows.
    pub fn get_rows(&mut self, w: &GpuMatrix, row: StepWord<'_>, dst: &Buffer) -> Result<()> {
        self.get_rows_n(w, row, 1, dst)
    }

    /// [`Recorder::get_rows`] of `n_tok` rows, words `rows.index..` of the buffer, one after
    /// another into `dst`.
    pub(crate) fn get_rows_n(
        &mut self,
        w: &GpuMatrix,
        row: StepWord<'_>,
        n_tok: u32,
        dst: &Buffer,
    ) -> Result<()> {
        if dst.size() < u64::from(n_tok) * w.n_in as u64 * 4
            || row.buffer.size() < (u64::from(row.index) + u64::from(n_tok)) * 4
            || n_tok > 65535
        {
            return Err(GpuError::Unsupported(format!(
                "{n_tok} rows of {} values into {} bytes",
                w.n_in,
                dst.size()
            )));
        }
        let id = self.variant(Op::GetRows, Some(w.wtype))?;
        let units = (w.n_in / 32) as u32;
        for chunk in self.row_chunks(w, 0, w.n_out)? {
            let push = GetRowsParams {
                n: w.n_in as u32,
                row_bytes: w.row_bytes as u32,
                first_row: chunk.y_offset,
                n_rows: chunk.rows,
                w_offset: chunk.w_offset,
                step_index: row.index,
            };
            let bindings = [chunk.weights, Binding::write(dst), row.binding()];
            self.dispatch(id, &bindings, &push, [units.div_ceil(64), n_tok, 1])?;
        }
        Ok(())
    }

    /// RMSNorm of `rows` rows of `n` values of `x`, times `w`, into `out`.
    pub fn rms_norm(
        &mut self,
        x: &Buffer,
        w: &Buffer,
        out: &Buffer,
        n: u32,
        rows: u32,
        eps: f32,
    ) -> Result<()> {
        let bindings = [Binding::read(x), Binding::read(w), Binding::write(out)];
        let push = RmsNormParams { n, eps };
        let id = self.variant(Op::RmsNorm, None)?;
        self.dispatch(id, &bindings, &push, [rows, 1, 1])
    }

    /// RoPE of `args.n_heads` heads of `x` in place, at the position `pos` holds when the
    /// dispatch runs, with angles from `table` (see [`rope_table`]); with `norm`, each head is
    /// RMS-normalised by it first (QK-norm).
    pub fn rope(
        &mut self,
        x: &Buffer,
        norm: Option<&Buffer>,
        table: &Buffer,
        args: RopeArgs,
        pos: StepWord<'_>,
    ) -> Result<()> {
        self.rope_into(x, norm, table, args, pos, 1, None)
    }

    /// [`Recorder::rope`] of K whose result goes to the f16 K cache at the position instead of
    /// back to `k`, with V's values stored beside it in the V cache: RoPE and
    /// [`Recorder::kv_store`] in one dispatch, the same values (`k` is left as it was).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_store(
        &mut self,
        (k, v): (&Buffer, &Buffer),
        norm: Option<&Buffer>,
        table: &Buffer,
        args: RopeArgs,
        pos: StepWord<'_>,
        (k_cache, v_cache): (&Buffer, &Buffer),
    ) -> Result<()> {
        let kv_width = args.n_heads * args.head_dim;
        if kv_width == 0 || v_cache.size() < k_cache.size() {
            return Err(GpuError::Unsupported(format!(
                "KV store of width {kv_width} in {}- and {}-byte caches",
                k_cache.size(),
                v_cache.size()
            )));
        }
        self.rope_into(k, norm, table, args, pos, 1, Some((v, k_cache, v_cache)))
    }

    /// RoPE of `n_tok` tokens' heads, one token's after another's, token `t` at the position
    /// of its pair of words from `pos` ([`StepWord`]); with `store`, (V, K cache, V cache) as
    /// in [`Recorder::rope_store`], each at its sequence's rows.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_into(
        &mut self,
        x: &Buffer,
        norm: Option<&Buffer>,
        table: &Buffer,
        args: RopeArgs,
        pos: StepWord<'_>,
        n_tok: u32,
        store: Option<(&Buffer, &Buffer, &Buffer)>,
    ) -> Result<()> {
        let floats = u64::from(n_tok) * u64::from(args.n_heads * args.head_dim);
        if x.size() < floats * 4
            || store.is_some_and(|(v, _, _)| v.size() < floats * 4)
            || n_tok > 65535
        {
            return Err(GpuError::Unsupported(format!(
                "RoPE of {n_tok} tokens of {} heads in {} bytes",
                args.n_heads,
                x.size()
            )));
        }
        pos.check_positions(n_tok)?;
        let id = self.variant(
            match args.layout {
                RopeLayout::Normal => Op::RopeNorm,
                RopeLayout::Neox => Op::RopeNeox,
            },
            None,
        )?;
        if args.head_dim > 512 || args.n_rot > args.head_dim || !args.n_rot.is_multiple_of(2) {
            return Err(GpuError::Unsupported(format!(
                "RoPE of {} dims in heads of {}",
                args.n_rot, args.head_dim
            )));
        }
        let n_pos = table.size() / (u64::from(args.n_rot) * 4).max(4);
        if n_pos == 0 {
            return Err(GpuError::Unsupported("an empty RoPE table".into()));
        }
        let kv_width = args.n_heads * args.head_dim;
        let capacity = store.map_or(0, |(_, k_cache, _)| {
            (k_cache.size() / (u64::from(kv_width) * 2)).min(u64::from(u32::MAX)) as u32
        });
        let push = RopeParams {
            head_dim: args.head_dim,
            n_rot: args.n_rot,
            eps: args.eps,
            qk_norm: u32::from(norm.is_some()),
            n_pos: n_pos.min(u64::from(u32::MAX)) as u32,
            step_index: pos.index,
            kv_width,
            capacity,
        };
        // Unused bindings get stand-ins: the table for the norm, `x` for V and the caches.
        let x_binding = if store.is_some() {
            Binding::read(x)
        } else {
            Binding::write(x)
        };
        let (v, k_cache, v_cache) = match store {
            Some((v, k_cache, v_cache)) => (
                Binding::read(v),
                Binding::write(k_cache),
                Binding::write(v_cache),
            ),
            None => (Binding::read(x), Binding::write(x), Binding::write(x)),
        };
        let bindings = [
            x_binding,
            Binding::read(norm.unwrap_or(table)),
            Binding::read(table),
            pos.binding(),
            v,
            k_cache,
            v_cache,
        ];
        let spec = [u32::from(store.is_some())];
        self.dispatch_spec(id, &spec, &bindings, &push, [args.n_heads, n_tok, 1])
    }

    /// `a += b` over `n` values.
    pub fn add(&mut self, a: &Buffer, b: &Buffer, n: u32) -> Result<()> {
        self.add_repeated(a, b, n, n)
    }

    /// `a[i] += b[i % b_len]` over `n` values (a bias added to each token of a prompt).
    pub fn add_repeated(&mut self, a: &Buffer, b: &Buffer, n: u32, b_len: u32) -> Result<()> {
        if b_len == 0 || b.size() < u64::from(b_len) * 4 || a.size() < u64::from(n) * 4 {
            return Err(GpuError::Unsupported(format!(
                "{n} values plus {b_len} repeated in buffers of {} and {} bytes",
                a.size(),
                b.size()
            )));
        }
        let push = EltwiseParams { n, b_len };
        let bindings = [Binding::write(a), Binding::read(b)];
        self.dispatch(ShaderId::Add, &bindings, &push, [n.div_ceil(256), 1, 1])
    }

    /// `a += scale * b` over `n` values.
    pub fn scale_add(&mut self, a: &Buffer, b: &Buffer, scale: f32, n: u32) -> Result<()> {
        let push = ScaleAddParams { n, scale };
        let bindings = [Binding::write(a), Binding::read(b)];
        self.dispatch(
            ShaderId::ScaleAdd,
            &bindings,
            &push,
            [n.div_ceil(256), 1, 1],
        )
    }

    /// `gate = silu(gate) * up` over `n` values.
    pub fn swiglu(&mut self, gate: &Buffer, up: &Buffer, n: u32) -> Result<()> {
        let push = EltwiseParams { n, b_len: n };
        let bindings = [Binding::write(gate), Binding::read(up)];
        self.dispatch(ShaderId::Swiglu, &bindings, &push, [n.div_ceil(256), 1, 1])
    }

    /// Softmax of `rows` rows of `n` values of `x`, in place.
    pub fn softmax(&mut self, x: &Buffer, n: u32, rows: u32) -> Result<()> {
        let push = EltwiseParams { n, b_len: n };
        let id = self.variant(Op::Softmax, None)?;
        self.dispatch(id, &[Binding::write(x)], &push, [rows, 1, 1])
    }

    /// Stores `k` and `v` (f32, `kv_width` each) at the position `pos` holds when the
    /// dispatch runs, past its sequence's first row, in the f16 caches (nothing past their
    /// last row).
    pub fn kv_store(
        &mut self,
        (k, v): (&Buffer, &Buffer),
        (k_cache, v_cache): (&Buffer, &Buffer),
        kv_width: u32,
        pos: StepWord<'_>,
    ) -> Result<()> {
        let row = u64::from(kv_width) * 2;
        if kv_width == 0 || !kv_width.is_multiple_of(2) || v_cache.size() < k_cache.size() {
            return Err(GpuError::Unsupported(format!(
                "KV store of width {kv_width} in {}- and {}-byte caches",
                k_cache.size(),
                v_cache.size()
            )));
        }
        pos.check_positions(1)?;
        let push = KvStoreParams {
            kv_width,
            capacity: (k_cache.size() / row).min(u64::from(u32::MAX)) as u32,
            step_index: pos.index,
        };
        let bindings = [
            Binding::read(k),
            Binding::read(v),
            Binding::write(k_cache),
            Binding::write(v_cache),
            pos.binding(),
        ];
        self.dispatch(
            ShaderId::KvStore,
            &bindings,
            &push,
            [(kv_width / 2).div_ceil(64), 1, 1],
        )
    }

    /// One token's attention: `out` (heads × head_dim) from `q` over positions `0..=pos` of
    /// the caches, `pos` read when the dispatch runs. One dispatch: runs of [`ATTENTION_SPLIT`]
    /// positions, each workgroup's partial result into `scratch.0` (at least
    /// [`attention_scratch_floats`]), joined by the last run of each head to finish, which the
    /// counters `scratch.1` ([`attention_counters`], zero before and after) tell.
    pub fn attention(
        &mut self,
        q: &Buffer,
        (k_cache, v_cache): (&Buffer, &Buffer),
        scratch: (&Buffer, &Buffer),
        out: &Buffer,
        a: AttentionArgs,
        pos: StepWord<'_>,
    ) -> Result<()> {
        self.attention_n(q, (k_cache, v_cache), scratch, out, a, pos, (1, a.capacity))
    }

    /// [`Recorder::attention`] of `tokens.0` tokens, token `t` at the position of its pair of
    /// words from `pos` ([`StepWord`]; it attends to its sequence's positions up to its own: a
    /// prompt's tokens or one token of each of several sequences), queries and outputs one
    /// token's after another's, `scratch.0` [`attention_scratch_floats`] of `tokens.1` positions per token
    /// and `scratch.1` counters for `tokens.0` tokens ([`attention_counters`]). No
    /// token's position reaches `tokens.1`: the grid and the scratch cover the runs of positions
    /// below it.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_n(
        &mut self,
        q: &Buffer,
        (k_cache, v_cache): (&Buffer, &Buffer),
        (scratch, done): (&Buffer, &Buffer),
        out: &Buffer,
        a: AttentionArgs,
        pos: StepWord<'_>,
        (n_tok, positions): (u32, u32),
    ) -> Result<()> {
        let runs = positions.min(a.capacity).max(1).div_ceil(ATTENTION_SPLIT);
        let grid = Grid::Fixed([a.n_heads, runs, n_tok]);
        self.attention_n_grid(
            q,
            (k_cache, v_cache),
            (scratch, done),
            out,
            a,
            pos,
            (n_tok, positions),
            grid,
        )
    }

    /// [`Recorder::attention_n`] with its grid read when it runs ([`Grid::Indirect`]), which must
    /// cover each token's runs up to its position, or fixed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_n_grid(
        &mut self,
        q: &Buffer,
        (k_cache, v_cache): (&Buffer, &Buffer),
        (scratch, done): (&Buffer, &Buffer),
        out: &Buffer,
        a: AttentionArgs,
        pos: StepWord<'_>,
        (n_tok, positions): (u32, u32),
        grid: Grid<'_>,
    ) -> Result<()> {
        let push = attention_params(
            q,
            (k_cache, v_cache),
            (scratch, done),
            out,
            a,
            pos,
            (n_tok, positions),
        )?;
        let bindings = [
            Binding::read(q),
            Binding::read(k_cache),
            Binding::read(v_cache),
            Binding::write(scratch),
            pos.binding(),
            Binding::write(out),
            Binding::write(done),
        ];
        let id = self.variant(Op::Attention, None)?;
        self.dispatch_grid(id, &[a.head_dim], &bindings, &push, grid)
    }
}

/// The checks of [`Recorder::attention_n`] and its push constants (`capacity` the bound of the
/// positions that attend).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_params(
    q: &Buffer,
    (k_cache, v_cache): (&Buffer, &Buffer),
    (scratch, done): (&Buffer, &Buffer),
    out: &Buffer,
    a: AttentionArgs,
    pos: StepWord<'_>,
    (n_tok, positions): (u32, u32),
) -> Result<AttentionParams> {
    let cache_bytes = u64::from(a.capacity) * u64::from(a.n_kv_heads * a.head_dim) * 2;
    // The runs of positions below `positions` are laid out in the scratch, not the capacity's.
    let bound = positions.min(a.capacity).max(1);
    let scratch_floats = n_tok as usize
        * attention_scratch_floats(a.n_heads as usize, a.head_dim as usize, bound as usize);
    let io_bytes = u64::from(n_tok) * u64::from(a.n_heads * a.head_dim) * 4;
    let n_splits = a.capacity.div_ceil(ATTENTION_SPLIT);
    pos.check_positions(n_tok)?;
    if q.size() < io_bytes || out.size() < io_bytes || n_tok > 65535 {
        return Err(GpuError::Unsupported(format!(
            "attention of {n_tok} tokens of {a:?} in {} and {} bytes",
            q.size(),
            out.size()
        )));
    }
    if a.head_dim > 512
        || a.head_dim == 0
        || !a.head_dim.is_multiple_of(8)
        || a.n_kv_heads == 0
        || a.capacity == 0
        || n_splits > 65535
        || !a.n_heads.is_multiple_of(a.n_kv_heads)
        || k_cache.size().min(v_cache.size()) < cache_bytes
        || scratch.size() < scratch_floats as u64 * 4
        || done.size() < u64::from(n_tok * a.n_heads) * 4
    {
        return Err(GpuError::Unsupported(format!("attention shape {a:?}")));
    }
    let push = AttentionParams {
        head_dim: a.head_dim,
        kv_width: a.n_kv_heads * a.head_dim,
        group: a.n_heads / a.n_kv_heads,
        capacity: bound,
        scale: 1.0 / (a.head_dim as f32).sqrt(),
        step_index: pos.index,
    };
    Ok(push)
}

/// RoPE angles of positions `0..positions` as the CPU computes them (`engine::ops::rope_cache`),
/// interleaved `cos, sin` per rotated pair, for [`Recorder::rope`].
pub fn rope_table(
    positions: usize,
    n_rot: usize,
    base: f32,
    freq_scale: f32,
    factors: Option<&[f32]>,
) -> Vec<f32> {
    let half = n_rot / 2;
    let (mut cos, mut sin) = (vec![0.0; half], vec![0.0; half]);
    let mut table = Vec::with_capacity(positions * n_rot);
    for pos in 0..positions {
        crate::engine::ops::rope_cache(pos, n_rot, base, freq_scale, factors, &mut cos, &mut sin);
        for i in 0..half {
            table.push(cos[i]);
            table.push(sin[i]);
        }
    }
    table
}
