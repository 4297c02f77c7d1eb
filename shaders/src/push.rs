//! Push-constant blocks, laid out as the shaders declare them. A test reads each shader's SPIR-V
//! and checks these layouts against it, so a change on one side cannot silently skew the other.

use std::mem::{offset_of, size_of};

/// `dequant.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DequantParams {
    /// Units of 32 weights: Q8_0/Q4_0 blocks, 32 halves of F16, eighths of a K-quant
    /// super-block.
    pub n_blocks: u32,
    /// Byte offset of the first block in the weight buffer.
    pub src_offset: u32,
    /// Element offset of the first output value.
    pub dst_offset: u32,
}

/// `matvec.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MatVecParams {
    pub n_in: u32,
    /// Rows of the matrix (with the GLU constant: of the gate matrix, and of the results).
    pub n_rows: u32,
    /// Byte offset of row 0 in the bound weight range.
    pub w_offset: u32,
    /// Element offset of row 0's result in the output.
    pub y_offset: u32,
    /// RMSNorm's eps, with the NORM constant.
    pub eps: f32,
}

/// `quantize_q8.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuantizeQ8Params {
    /// Inputs a vector (a multiple of 32).
    pub n_in: u32,
    pub n_vec: u32,
    /// Floats from one input vector to the next (a multiple of 4).
    pub x_stride: u32,
    /// 16-byte units from one quantized vector to the next.
    pub q_stride: u32,
}

/// `matvec.comp`'s `Params` with `COLS` (several input vectors).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MatVecColsParams {
    pub n_in: u32,
    pub n_rows: u32,
    /// Byte offset of row 0 in the bound weight range.
    pub w_offset: u32,
    /// Element offset of row 0's result of column 0 in the output.
    pub y_offset: u32,
    /// Columns computed (at most the `NCOLS` constant).
    pub n_cols: u32,
    /// Floats from one input column to the next (a multiple of 4).
    pub x_stride: u32,
    /// Floats from one column's results to the next.
    pub y_stride: u32,
    /// Unused (RMSNorm's eps in the kernel's other variants).
    pub eps: f32,
}

/// `matvec.comp`'s `Params` with `COLS` and `RUNS` (experts' runs of rows from a table).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MatVecRunsParams {
    pub n_in: u32,
    /// Rows of one expert (and of each result row).
    pub n_rows: u32,
    /// Byte offset of expert 0's row 0 in the bound weight range.
    pub w_offset: u32,
    pub y_offset: u32,
    /// Word of the runs buffer where the table of (slot, first row, rows) starts.
    pub runs_at: u32,
    /// Floats from one row of inputs to the next (a multiple of 4).
    pub x_stride: u32,
    /// Floats from one row of results to the next.
    pub y_stride: u32,
    /// Unused.
    pub eps: f32,
}

/// `matvec.comp`'s `Params` with `INDEXED` (experts chosen on the device).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MatVecIdParams {
    pub n_in: u32,
    /// Rows of one expert (and of each result).
    pub n_rows: u32,
    /// Byte offset of expert 0's row 0 in the bound weight range.
    pub w_offset: u32,
    pub y_offset: u32,
    /// Index in the ids buffer of the expert of workgroup layer 0.
    pub rank: u32,
    /// Floats from one layer's input vector to the next.
    pub x_stride: u32,
    /// Floats from one layer's results to the next.
    pub y_stride: u32,
    /// Bytes from an expert's gate row to its up row (the `GLU` constant).
    pub up_offset: u32,
    /// Experts summed by one workgroup (the `ID_SUM` constant).
    pub n_ids: u32,
    /// Index in the ids buffer of expert 0's weight (the `ID_SUM` constant).
    pub weights_at: u32,
    /// Entries of one token (the experts it chose): entry `z` is entry `z % per_tok` of token
    /// `z / per_tok`. Without several tokens, the dispatch's count (one token).
    pub per_tok: u32,
    /// Words of the ids buffer from one token's entries (and weights) to the next's.
    pub ids_tok: u32,
    /// Input units (floats, or 16-byte units of quantized inputs) from one token's first
    /// input to the next's; `x_stride` goes from one entry's to the next within a token.
    pub x_tok: u32,
    /// With `ID_SUM`, floats from one token's sum to the next's (workgroup layer `z` sums
    /// token `z`'s entries).
    pub y_tok: u32,
    /// RMSNorm's eps, with the `NORM` constant.
    pub eps: f32,
}

/// `moe_route.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MoeRouteParams {
    pub n_expert: u32,
    pub k: u32,
    /// 1: the k weights are divided by their sum.
    pub norm: u32,
    /// 1: the shared expert's gate is written after the weights.
    pub has_shared: u32,
    /// Float offset of this routing in the host-visible log.
    pub log_offset: u32,
    /// 0: every expert has a VRAM slot; else the entry of `route` where the experts without
    /// one are listed (`moe_route.comp`).
    pub host_at: u32,
    /// Index in the slot map of expert 0's slot (with `host_at`).
    pub map_offset: u32,
}

/// `moe_sort.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MoeSortParams {
    /// The chunk's tokens.
    pub n_tok: u32,
    pub k: u32,
    pub n_expert: u32,
    /// Words of the route buffer: the entries' weights, the runs, the gathered sum's list.
    pub weights_at: u32,
    pub runs_at: u32,
    pub list_at: u32,
    /// Word of expert 0's count in the counts buffer.
    pub counts_at: u32,
    /// 0: every expert resident; else the word of the runs in the stacks in system RAM.
    pub host_runs_at: u32,
    /// Index in the slot map of expert 0's slot (with `host_runs_at`).
    pub map_offset: u32,
}

/// `moe_route.comp`'s `Params` with `ROUTER`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MoeRouterParams {
    pub n_expert: u32,
    pub k: u32,
    pub norm: u32,
    /// Always 0: no shared expert with the router in the dispatch.
    pub has_shared: u32,
    pub log_offset: u32,
    /// As [`MoeRouteParams::host_at`].
    pub host_at: u32,
    pub map_offset: u32,
    /// The router's width.
    pub n_in: u32,
    /// RMSNorm's eps.
    pub eps: f32,
}

/// `scale_add.comp`'s `Params` with `ROUTED`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScaleAddRoutedParams {
    pub n: u32,
    /// Index of the first weight in the routing buffer.
    pub first: u32,
    pub count: u32,
    /// Floats from one term's `b` to the next.
    pub b_stride: u32,
}

/// `matvec_batch.comp`'s `Params` (`Op::MatVecBatch`, and `Op::Matmul`, whose `w_offset`
/// counts halves).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MatVecBatchParams {
    pub n_in: u32,
    pub n_rows: u32,
    /// Byte offset of row 0 in the bound weight range.
    pub w_offset: u32,
    /// Element offset of row 0's result for the first token.
    pub y_offset: u32,
    pub n_tok: u32,
    /// Floats from one token's input vector to the next.
    pub x_stride: u32,
    /// Floats from one token's results to the next.
    pub y_stride: u32,
}

/// `matvec_batch.comp`'s `Params` with `GROUPED` (`Op::MatVecBatchGrouped`): `n_rows` rows per
/// expert, `n_tok` unused (each run has its tokens).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MatVecGroupedParams {
    pub n_in: u32,
    pub n_rows: u32,
    pub w_offset: u32,
    pub y_offset: u32,
    pub n_tok: u32,
    pub x_stride: u32,
    pub y_stride: u32,
    /// Word of the first run (slot, first row, rows) in the runs buffer.
    pub runs_at: u32,
}

/// `scatter_add.comp`'s `Params` with `GATHER` (`Op::GatherAdd`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatherAddParams {
    /// Row width.
    pub n: u32,
    /// The group's first entry in the route buffer.
    pub first: u32,
    /// Word of entry 0's weight in the route buffer.
    pub weights_at: u32,
    /// Word of the group's token list.
    pub list_at: u32,
    /// Tokens in the list.
    pub n_tokens: u32,
}

/// `scatter_add.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScatterAddParams {
    /// Row width.
    pub n: u32,
    /// The run's first entry in the route buffer.
    pub first: u32,
    /// Word of entry 0's weight in the route buffer.
    pub weights_at: u32,
}

/// `get_rows.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GetRowsParams {
    pub n: u32,
    pub row_bytes: u32,
    /// The first row the bound weight range holds, and how many it holds.
    pub first_row: u32,
    pub n_rows: u32,
    /// Byte offset of `first_row` in the bound weight range.
    pub w_offset: u32,
    /// Word of the step buffer that holds the row (the token id).
    pub step_index: u32,
}

/// `rms_norm.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RmsNormParams {
    pub n: u32,
    pub eps: f32,
}

/// `rope.comp`'s `Params` (both layouts).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RopeParams {
    pub head_dim: u32,
    pub n_rot: u32,
    pub eps: f32,
    /// 1: RMSNorm each head first (QK-norm).
    pub qk_norm: u32,
    /// Positions the angle table holds.
    pub n_pos: u32,
    /// Word of the step buffer that holds the position.
    pub step_index: u32,
    /// With the STORE constant: halves per KV-cache row, and rows.
    pub kv_width: u32,
    pub capacity: u32,
}

/// `eltwise.comp`'s and `softmax.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EltwiseParams {
    pub n: u32,
    /// ADD: `b` holds this many values, repeated over `a` (a bias added to each token of a
    /// prompt); `n` for one vector. Unused by the other ops.
    pub b_len: u32,
}

/// `scale_add.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScaleAddParams {
    pub n: u32,
    pub scale: f32,
}

/// `kv_store.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStoreParams {
    pub kv_width: u32,
    /// Rows the caches hold.
    pub capacity: u32,
    /// Word of the step buffer that holds the position.
    pub step_index: u32,
}

/// `attention.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AttentionParams {
    pub head_dim: u32,
    pub kv_width: u32,
    pub group: u32,
    /// Positions the caches hold: the most that attend.
    pub capacity: u32,
    pub scale: f32,
    /// Word of the step buffer that holds the new token's position (positions `0..=pos`
    /// attend).
    pub step_index: u32,
}

/// `attention.comp`'s `Params` with `ROPE_IN`: the fields of [`AttentionParams`], then
/// RoPE's and the QK-norm's.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AttentionRopeParams {
    pub head_dim: u32,
    pub kv_width: u32,
    pub group: u32,
    pub capacity: u32,
    pub scale: f32,
    pub step_index: u32,
    /// Rotated dimensions of a head.
    pub n_rot: u32,
    /// Positions the angle table holds.
    pub n_pos: u32,
    pub eps: f32,
    /// 1: RMSNorm each head first (QK-norm).
    pub qk_norm: u32,
}

/// `attention_prefill.comp`'s `Params`: those of [`AttentionParams`] and the chunk's tokens.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AttentionPrefillParams {
    pub head_dim: u32,
    pub kv_width: u32,
    pub group: u32,
    pub capacity: u32,
    pub scale: f32,
    /// Word of the step buffer that holds the first token's position.
    pub step_index: u32,
    pub n_tok: u32,
}

/// A push-constant struct: its bytes and its fields' (offset, size) in declaration order.
pub trait PushConstants: Copy {
    fn layout() -> Vec<(u32, u32)>;
    fn bytes(&self) -> Vec<u8>;
}

macro_rules! push_constants {
    ($ty:ident { $($field:ident),* }) => {
        impl PushConstants for $ty {
            fn layout() -> Vec<(u32, u32)> {
                // Every field is a 32-bit scalar (u32 or f32).
                vec![$( (offset_of!($ty, $field) as u32, 4) ),*]
            }
            fn bytes(&self) -> Vec<u8> {
                let mut out = Vec::with_capacity(size_of::<$ty>());
                $( out.extend_from_slice(&self.$field.to_le_bytes()); )*
                out
            }
        }
    };
}

push_constants!(DequantParams {
    n_blocks,
    src_offset,
    dst_offset
});
push_constants!(MatVecParams {
    n_in,
    n_rows,
    w_offset,
    y_offset,
    eps
});
push_constants!(QuantizeQ8Params {
    n_in,
    n_vec,
    x_stride,
    q_stride
});
push_constants!(MatVecColsParams {
    n_in,
    n_rows,
    w_offset,
    y_offset,
    n_cols,
    x_stride,
    y_stride,
    eps
});
push_constants!(MatVecRunsParams {
    n_in,
    n_rows,
    w_offset,
    y_offset,
    runs_at,
    x_stride,
    y_stride,
    eps
});
push_constants!(MatVecBatchParams {
    n_in,
    n_rows,
    w_offset,
    y_offset,
    n_tok,
    x_stride,
    y_stride
});
push_constants!(GetRowsParams {
    n,
    row_bytes,
    first_row,
    n_rows,
    w_offset,
    step_index
});
push_constants!(RmsNormParams { n, eps });
push_constants!(RopeParams {
    head_dim,
    n_rot,
    eps,
    qk_norm,
    n_pos,
    step_index,
    kv_width,
    capacity
});
push_constants!(EltwiseParams { n, b_len });
push_constants!(MatVecGroupedParams {
    n_in,
    n_rows,
    w_offset,
    y_offset,
    n_tok,
    x_stride,
    y_stride,
    runs_at
});
push_constants!(GatherAddParams {
    n,
    first,
    weights_at,
    list_at,
    n_tokens
});
push_constants!(ScatterAddParams {
    n,
    first,
    weights_at
});
push_constants!(ScaleAddParams { n, scale });
push_constants!(KvStoreParams {
    kv_width,
    capacity,
    step_index
});
push_constants!(AttentionParams {
    head_dim,
    kv_width,
    group,
    capacity,
    scale,
    step_index
});
push_constants!(AttentionRopeParams {
    head_dim,
    kv_width,
    group,
    capacity,
    scale,
    step_index,
    n_rot,
    n_pos,
    eps,
    qk_norm
});
push_constants!(AttentionPrefillParams {
    head_dim,
    kv_width,
    group,
    capacity,
    scale,
    step_index,
    n_tok
});
push_constants!(MatVecIdParams {
    n_in,
    n_rows,
    w_offset,
    y_offset,
    rank,
    x_stride,
    y_stride,
    up_offset,
    n_ids,
    weights_at,
    per_tok,
    ids_tok,
    x_tok,
    y_tok,
    eps
});
push_constants!(MoeRouterParams {
    n_expert,
    k,
    norm,
    has_shared,
    log_offset,
    host_at,
    map_offset,
    n_in,
    eps
});
push_constants!(MoeSortParams {
    n_tok,
    k,
    n_expert,
    weights_at,
    runs_at,
    list_at,
    counts_at,
    host_runs_at,
    map_offset
});
push_constants!(MoeRouteParams {
    n_expert,
    k,
    norm,
    has_shared,
    log_offset,
    host_at,
    map_offset
});
push_constants!(ScaleAddRoutedParams {
    n,
    first,
    count,
    b_stride
});
