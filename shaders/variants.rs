// The one table of shader variants: op × weight type × device feature. Read by `build.rs`, which
// compiles each row and generates `ShaderId`, and by the crate itself for the enums below.

/// What a kernel computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Weight blocks to f32.
    Dequant,
    /// Weights to f16, two to a word (a prompt's chunk: `Op::Matmul` multiplies them).
    DequantF16,
    /// f16 matrix (row-major, from `Op::DequantF16`) × a batch of f32 vectors, token-major, in
    /// cooperative matrices (prompts).
    Matmul,
    /// Quantized matrix × f32 vector (decode); specialization constants fuse an RMSNorm of the
    /// input, a SwiGLU of two stacked matrices and the residual sum into it.
    MatVec,
    /// Quantized matrix × f32 vector for experts of a stack chosen on the device (the ids
    /// buffer of [`Op::MoeRoute`]), one workgroup layer per expert.
    MatVecId,
    /// Quantized matrix × a few f32 vectors (at most 8: a decode step of several sequences),
    /// each weight read once for all of them, as [`Op::MatVec`] reads it for one.
    MatVecCols,
    /// [`Op::MatVecCols`] for several experts of a stack at once, each over its own few rows of
    /// inputs (at most 8), the runs read from a buffer as [`Op::MatVecBatchGrouped`] reads them.
    MatVecRuns,
    /// f32 vectors quantized to blocks of 8-bit integers once, for the `*Q8` products.
    QuantizeQ8,
    /// [`Op::MatVec`] in integer dot products over inputs [`Op::QuantizeQ8`] quantized.
    MatVecQ8,
    /// [`Op::MatVecId`] over inputs [`Op::QuantizeQ8`] quantized.
    MatVecIdQ8,
    /// [`Op::MatVecCols`] over inputs [`Op::QuantizeQ8`] quantized.
    MatVecColsQ8,
    /// [`Op::MatVecRuns`] over inputs [`Op::QuantizeQ8`] quantized.
    MatVecRunsQ8,
    /// Quantized matrix × a batch of f32 vectors, token-major (prompts).
    MatVecBatch,
    /// [`Op::MatVecBatch`] for several experts of a stack at once, each over its own rows of
    /// tokens (a prompt chunk's MoE layer), the runs read from a buffer.
    MatVecBatchGrouped,
    /// One weight row to f32 (the token embedding), the row read from the step buffer.
    GetRows,
    /// RMSNorm of rows, times a weight vector.
    RmsNorm,
    /// RoPE of adjacent pairs (llama), with optional per-head RMSNorm first; a specialization
    /// constant stores the result and V in the KV cache instead.
    RopeNorm,
    /// RoPE of halves (the Qwen family), as [`Op::RopeNorm`] otherwise.
    RopeNeox,
    /// `a += b`.
    Add,
    /// `a = silu(a) * b`.
    Swiglu,
    /// `a += s * b`, `s` a push constant (weighted sums of MoE experts).
    ScaleAdd,
    /// `a += Σ w[r] * b[r]` with the weights read from a routing buffer.
    ScaleAddRouted,
    /// A MoE layer's routing from its router logits: top-k expert ids and weights.
    MoeRoute,
    /// The router's product (F32, RMSNorm of the input fused) and then [`Op::MoeRoute`] by the
    /// last workgroup, in one dispatch.
    MoeRouter,
    /// [`Op::MoeRoute`] of every token of a prompt chunk, a workgroup each.
    MoeRouteChunk,
    /// A prompt chunk's routing (from [`Op::MoeRouteChunk`]) laid out by expert for
    /// [`Op::MatVecBatchGrouped`] and [`Op::GatherAdd`], with each expert's count.
    MoeSort,
    /// Softmax of rows in place.
    Softmax,
    /// `x[ids[i]] += w[i] * y[i]` over rows: one MoE expert's outputs for a prompt chunk's
    /// tokens, added to theirs.
    ScatterAdd,
    /// `x[t] += Σ w[e] * y[e]` over the entries `e` a list gives each token (several experts'
    /// outputs for a prompt chunk's tokens).
    GatherAdd,
    /// Appends one token's K and V to the f16 caches.
    KvStore,
    /// One token's attention over the f16 KV cache (GQA), a run of positions per workgroup,
    /// the runs joined by the last of each head's.
    Attention,
    /// [`Op::Attention`] of one token whose Q, K and V are not yet roped: QK-norm, RoPE (pairs
    /// adjacent) and the KV-cache append in the same dispatch.
    AttentionRopeNorm,
    /// [`Op::AttentionRopeNorm`] with RoPE over halves (the Qwen family).
    AttentionRopeNeox,
    /// A prompt chunk's attention over the f16 KV cache, causal, a tile of tokens per
    /// workgroup (flash attention).
    AttentionPrefill,
}

#[allow(dead_code)] // build.rs does not call it.
impl Op {
    /// Storage buffers the op binds, at bindings 0..n.
    pub const fn bindings(self) -> u32 {
        match self {
            Op::Softmax => 1,
            Op::Dequant | Op::DequantF16 | Op::Add | Op::Swiglu | Op::ScaleAdd => 2,
            Op::Matmul | Op::MatVecBatch | Op::RmsNorm | Op::GetRows => 3,
            Op::MatVec | Op::MatVecCols | Op::MatVecQ8 | Op::MatVecColsQ8 => 4,
            Op::QuantizeQ8 => 3,
            Op::ScaleAddRouted | Op::ScatterAdd | Op::GatherAdd => 3,
            Op::MatVecBatchGrouped => 4,
            Op::MoeRoute | Op::MoeRouteChunk => 5,
            Op::MoeSort => 4,
            Op::MoeRouter => 9,
            Op::MatVecId | Op::MatVecRuns | Op::MatVecIdQ8 | Op::MatVecRunsQ8 => 5,
            Op::RopeNorm | Op::RopeNeox => 7,
            Op::KvStore => 5,
            Op::Attention => 7,
            Op::AttentionRopeNorm | Op::AttentionRopeNeox => 12,
            Op::AttentionPrefill => 5,
        }
    }
}

/// The weight type a variant reads (the ggml type of the same name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightType {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4K,
    Q6K,
}

/// The device feature a variant needs beyond Vulkan 1.2 compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    /// Runs on every Vulkan 1.2 device.
    Base,
    /// Subgroup arithmetic in compute shaders (`subgroupAdd`, `subgroupMax`): the same kernels
    /// with their reductions across subgroups instead of through shared memory alone.
    Subgroup,
    /// `VK_KHR_cooperative_matrix` with 16×16×16 f16 → f32 at subgroup scope, and shader f16.
    CoopMat,
    /// Dot products of packed 8-bit integers (`shaderIntegerDotProduct`, core in Vulkan 1.3):
    /// Q4_0 and Q8_0 weights times inputs quantized to 8 bits, as ggml's CPU backend multiplies
    /// them.
    IntDot,
    /// [`Feature::IntDot`] with the reductions of [`Feature::Subgroup`].
    IntDotSubgroup,
}

#[allow(dead_code)] // build.rs reads every field; the library reads them through `ShaderInfo`.
pub struct Variant {
    pub name: &'static str,
    pub source: &'static str,
    pub op: Op,
    pub wtype: Option<WeightType>,
    pub feature: Feature,
    pub defines: &'static [(&'static str, &'static str)],
}

const fn v(
    name: &'static str,
    source: &'static str,
    op: Op,
    wtype: Option<WeightType>,
    feature: Feature,
    defines: &'static [(&'static str, &'static str)],
) -> Variant {
    Variant {
        name,
        source,
        op,
        wtype,
        feature,
        defines,
    }
}

/// The define that switches a kernel's reductions to subgroup operations.
const SG: (&str, &str) = ("USE_SUBGROUP", "1");

/// The define that switches `matvec_batch.comp` to cooperative matrices.
const CM: (&str, &str) = ("COOPMAT", "1");

/// Blocks of 16 × 16 results a subgroup of the cooperative-matrix products computes, along rows
/// and along tokens: `build.rs` defines them as `CM_TM` and `CM_TN` for every variant with
/// [`CM`], and the runtime sizes its tiles from them.
#[allow(dead_code)]
pub const COOPMAT_BLOCKS: (u32, u32) = (4, 2);

/// The define that makes `matvec_batch.comp` take several experts' runs in one dispatch.
const GR: (&str, &str) = ("GROUPED", "1");

/// The define that makes `dequant.comp` write f16.
const F16_OUT: (&str, &str) = ("F16_OUT", "1");

/// The define that makes `matvec.comp` multiply Q4_0 and Q8_0 weights with integer dot products.
const INT_DOT: (&str, &str) = ("INT_DOT", "1");

/// With [`INT_DOT`], the define that makes `matvec.comp` read inputs `quantize_q8.comp` quantized.
const Q8: (&str, &str) = ("Q8_IN", "1");

/// The define that makes `matvec.comp` read its expert from the device's routing.
const ID: (&str, &str) = ("INDEXED", "1");

/// The define that makes `matvec.comp` multiply several input vectors at once.
const COLS: (&str, &str) = ("COLS", "1");

/// With [`COLS`], the define that makes `matvec.comp` take a table of experts' runs of rows.
const RUNS: (&str, &str) = ("RUNS", "1");

#[rustfmt::skip]
pub const VARIANTS: &[Variant] = &[
    v("dequant_f32", "dequant.comp", Op::Dequant, Some(WeightType::F32), Feature::Base, &[("WTYPE_F32", "1")]),
    v("dequant_f16", "dequant.comp", Op::Dequant, Some(WeightType::F16), Feature::Base, &[("WTYPE_F16", "1")]),
    v("dequant_q8_0", "dequant.comp", Op::Dequant, Some(WeightType::Q8_0), Feature::Base, &[("WTYPE_Q8_0", "1")]),
    v("dequant_q4_0", "dequant.comp", Op::Dequant, Some(WeightType::Q4_0), Feature::Base, &[("WTYPE_Q4_0", "1")]),
    v("dequant_q4_k", "dequant.comp", Op::Dequant, Some(WeightType::Q4K), Feature::Base, &[("WTYPE_Q4_K", "1")]),
    v("dequant_q6_k", "dequant.comp", Op::Dequant, Some(WeightType::Q6K), Feature::Base, &[("WTYPE_Q6_K", "1")]),
    v("matvec_f32", "matvec.comp", Op::MatVec, Some(WeightType::F32), Feature::Base, &[("WTYPE_F32", "1")]),
    v("matvec_f16", "matvec.comp", Op::MatVec, Some(WeightType::F16), Feature::Base, &[("WTYPE_F16", "1")]),
    v("matvec_q8_0", "matvec.comp", Op::MatVec, Some(WeightType::Q8_0), Feature::Base, &[("WTYPE_Q8_0", "1")]),
    v("matvec_q4_0", "matvec.comp", Op::MatVec, Some(WeightType::Q4_0), Feature::Base, &[("WTYPE_Q4_0", "1")]),
    v("matvec_q4_k", "matvec.comp", Op::MatVec, Some(WeightType::Q4K), Feature::Base, &[("WTYPE_Q4_K", "1")]),
    v("matvec_q6_k", "matvec.comp", Op::MatVec, Some(WeightType::Q6K), Feature::Base, &[("WTYPE_Q6_K", "1")]),
    v("get_rows_f32", "get_rows.comp", Op::GetRows, Some(WeightType::F32), Feature::Base, &[("WTYPE_F32", "1")]),
    v("get_rows_f16", "get_rows.comp", Op::GetRows, Some(WeightType::F16), Feature::Base, &[("WTYPE_F16", "1")]),
    v("get_rows_q8_0", "get_rows.comp", Op::GetRows, Some(WeightType::Q8_0), Feature::Base, &[("WTYPE_Q8_0", "1")]),
    v("get_rows_q4_0", "get_rows.comp", Op::GetRows, Some(WeightType::Q4_0), Feature::Base, &[("WTYPE_Q4_0", "1")]),
    v("get_rows_q4_k", "get_rows.comp", Op::GetRows, Some(WeightType::Q4K), Feature::Base, &[("WTYPE_Q4_K", "1")]),
    v("get_rows_q6_k", "get_rows.comp", Op::GetRows, Some(WeightType::Q6K), Feature::Base, &[("WTYPE_Q6_K", "1")]),
    v("rms_norm", "rms_norm.comp", Op::RmsNorm, None, Feature::Base, &[]),
    v("rope_norm", "rope.comp", Op::RopeNorm, None, Feature::Base, &[]),
    v("rope_neox", "rope.comp", Op::RopeNeox, None, Feature::Base, &[("ROPE_NEOX", "1")]),
    v("add", "eltwise.comp", Op::Add, None, Feature::Base, &[("OP_ADD", "1")]),
    v("swiglu", "eltwise.comp", Op::Swiglu, None, Feature::Base, &[("OP_SWIGLU", "1")]),
    v("scale_add", "scale_add.comp", Op::ScaleAdd, None, Feature::Base, &[]),
    v("softmax", "softmax.comp", Op::Softmax, None, Feature::Base, &[]),
    v("kv_store", "kv_store.comp", Op::KvStore, None, Feature::Base, &[]),
    v("attention", "attention.comp", Op::Attention, None, Feature::Base, &[]),
    v("attention_rope_norm", "attention.comp", Op::AttentionRopeNorm, None, Feature::Base, &[("ROPE_IN", "1")]),
    v("attention_rope_neox", "attention.comp", Op::AttentionRopeNeox, None, Feature::Base, &[("ROPE_IN", "1"), ("ROPE_NEOX", "1")]),
    v("attention_prefill", "attention_prefill.comp", Op::AttentionPrefill, None, Feature::Base, &[]),
    v("matvec_f32_subgroup", "matvec.comp", Op::MatVec, Some(WeightType::F32), Feature::Subgroup, &[("WTYPE_F32", "1"), SG]),
    v("matvec_f16_subgroup", "matvec.comp", Op::MatVec, Some(WeightType::F16), Feature::Subgroup, &[("WTYPE_F16", "1"), SG]),
    v("matvec_q8_0_subgroup", "matvec.comp", Op::MatVec, Some(WeightType::Q8_0), Feature::Subgroup, &[("WTYPE_Q8_0", "1"), SG]),
    v("matvec_q4_0_subgroup", "matvec.comp", Op::MatVec, Some(WeightType::Q4_0), Feature::Subgroup, &[("WTYPE_Q4_0", "1"), SG]),
    v("matvec_q4_k_subgroup", "matvec.comp", Op::MatVec, Some(WeightType::Q4K), Feature::Subgroup, &[("WTYPE_Q4_K", "1"), SG]),
    v("matvec_q6_k_subgroup", "matvec.comp", Op::MatVec, Some(WeightType::Q6K), Feature::Subgroup, &[("WTYPE_Q6_K", "1"), SG]),
    v("matvec_cols_f32", "matvec.comp", Op::MatVecCols, Some(WeightType::F32), Feature::Base, &[("WTYPE_F32", "1"), COLS]),
    v("matvec_runs_f32", "matvec.comp", Op::MatVecRuns, Some(WeightType::F32), Feature::Base, &[("WTYPE_F32", "1"), COLS, RUNS]),
    v("matvec_cols_f16", "matvec.comp", Op::MatVecCols, Some(WeightType::F16), Feature::Base, &[("WTYPE_F16", "1"), COLS]),
    v("matvec_runs_f16", "matvec.comp", Op::MatVecRuns, Some(WeightType::F16), Feature::Base, &[("WTYPE_F16", "1"), COLS, RUNS]),
    v("matvec_cols_q8_0", "matvec.comp", Op::MatVecCols, Some(WeightType::Q8_0), Feature::Base, &[("WTYPE_Q8_0", "1"), COLS]),
    v("matvec_runs_q8_0", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q8_0), Feature::Base, &[("WTYPE_Q8_0", "1"), COLS, RUNS]),
    v("matvec_cols_q4_0", "matvec.comp", Op::MatVecCols, Some(WeightType::Q4_0), Feature::Base, &[("WTYPE_Q4_0", "1"), COLS]),
    v("matvec_runs_q4_0", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q4_0), Feature::Base, &[("WTYPE_Q4_0", "1"), COLS, RUNS]),
    v("matvec_cols_q4_k", "matvec.comp", Op::MatVecCols, Some(WeightType::Q4K), Feature::Base, &[("WTYPE_Q4_K", "1"), COLS]),
    v("matvec_runs_q4_k", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q4K), Feature::Base, &[("WTYPE_Q4_K", "1"), COLS, RUNS]),
    v("matvec_cols_q6_k", "matvec.comp", Op::MatVecCols, Some(WeightType::Q6K), Feature::Base, &[("WTYPE_Q6_K", "1"), COLS]),
    v("matvec_runs_q6_k", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q6K), Feature::Base, &[("WTYPE_Q6_K", "1"), COLS, RUNS]),
    v("matvec_cols_f32_subgroup", "matvec.comp", Op::MatVecCols, Some(WeightType::F32), Feature::Subgroup, &[("WTYPE_F32", "1"), COLS, SG]),
    v("matvec_runs_f32_subgroup", "matvec.comp", Op::MatVecRuns, Some(WeightType::F32), Feature::Subgroup, &[("WTYPE_F32", "1"), COLS, RUNS, SG]),
    v("matvec_cols_f16_subgroup", "matvec.comp", Op::MatVecCols, Some(WeightType::F16), Feature::Subgroup, &[("WTYPE_F16", "1"), COLS, SG]),
    v("matvec_runs_f16_subgroup", "matvec.comp", Op::MatVecRuns, Some(WeightType::F16), Feature::Subgroup, &[("WTYPE_F16", "1"), COLS, RUNS, SG]),
    v("matvec_cols_q8_0_subgroup", "matvec.comp", Op::MatVecCols, Some(WeightType::Q8_0), Feature::Subgroup, &[("WTYPE_Q8_0", "1"), COLS, SG]),
    v("matvec_runs_q8_0_subgroup", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q8_0), Feature::Subgroup, &[("WTYPE_Q8_0", "1"), COLS, RUNS, SG]),
    v("matvec_cols_q4_0_subgroup", "matvec.comp", Op::MatVecCols, Some(WeightType::Q4_0), Feature::Subgroup, &[("WTYPE_Q4_0", "1"), COLS, SG]),
    v("matvec_runs_q4_0_subgroup", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q4_0), Feature::Subgroup, &[("WTYPE_Q4_0", "1"), COLS, RUNS, SG]),
    v("matvec_cols_q4_k_subgroup", "matvec.comp", Op::MatVecCols, Some(WeightType::Q4K), Feature::Subgroup, &[("WTYPE_Q4_K", "1"), COLS, SG]),
    v("matvec_runs_q4_k_subgroup", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q4K), Feature::Subgroup, &[("WTYPE_Q4_K", "1"), COLS, RUNS, SG]),
    v("matvec_cols_q6_k_subgroup", "matvec.comp", Op::MatVecCols, Some(WeightType::Q6K), Feature::Subgroup, &[("WTYPE_Q6_K", "1"), COLS, SG]),
    v("matvec_runs_q6_k_subgroup", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q6K), Feature::Subgroup, &[("WTYPE_Q6_K", "1"), COLS, RUNS, SG]),
    v("rms_norm_subgroup", "rms_norm.comp", Op::RmsNorm, None, Feature::Subgroup, &[SG]),
    v("rope_norm_subgroup", "rope.comp", Op::RopeNorm, None, Feature::Subgroup, &[SG]),
    v("rope_neox_subgroup", "rope.comp", Op::RopeNeox, None, Feature::Subgroup, &[("ROPE_NEOX", "1"), SG]),
    v("softmax_subgroup", "softmax.comp", Op::Softmax, None, Feature::Subgroup, &[SG]),
    v("attention_subgroup", "attention.comp", Op::Attention, None, Feature::Subgroup, &[SG]),
    v("attention_rope_norm_subgroup", "attention.comp", Op::AttentionRopeNorm, None, Feature::Subgroup, &[("ROPE_IN", "1"), SG]),
    v("attention_rope_neox_subgroup", "attention.comp", Op::AttentionRopeNeox, None, Feature::Subgroup, &[("ROPE_IN", "1"), ("ROPE_NEOX", "1"), SG]),
    v("matvec_batch_f32", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::F32), Feature::Base, &[("WTYPE_F32", "1")]),
    v("matvec_batch_f16", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::F16), Feature::Base, &[("WTYPE_F16", "1")]),
    v("matvec_batch_q8_0", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::Q8_0), Feature::Base, &[("WTYPE_Q8_0", "1")]),
    v("matvec_batch_q4_0", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::Q4_0), Feature::Base, &[("WTYPE_Q4_0", "1")]),
    v("matvec_batch_q4_k", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::Q4K), Feature::Base, &[("WTYPE_Q4_K", "1")]),
    v("matvec_batch_q6_k", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::Q6K), Feature::Base, &[("WTYPE_Q6_K", "1")]),
    v("matvec_batch_f32_coopmat", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::F32), Feature::CoopMat, &[("WTYPE_F32", "1"), CM]),
    v("matvec_batch_f16_coopmat", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::F16), Feature::CoopMat, &[("WTYPE_F16", "1"), CM]),
    v("matvec_batch_q8_0_coopmat", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::Q8_0), Feature::CoopMat, &[("WTYPE_Q8_0", "1"), CM]),
    v("matvec_batch_q4_0_coopmat", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::Q4_0), Feature::CoopMat, &[("WTYPE_Q4_0", "1"), CM]),
    v("matvec_batch_q4_k_coopmat", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::Q4K), Feature::CoopMat, &[("WTYPE_Q4_K", "1"), CM]),
    v("matvec_batch_q6_k_coopmat", "matvec_batch.comp", Op::MatVecBatch, Some(WeightType::Q6K), Feature::CoopMat, &[("WTYPE_Q6_K", "1"), CM]),
    v("matvec_q4_0_intdot", "matvec.comp", Op::MatVec, Some(WeightType::Q4_0), Feature::IntDot, &[("WTYPE_Q4_0", "1"), INT_DOT]),
    v("matvec_q4_0_intdot_subgroup", "matvec.comp", Op::MatVec, Some(WeightType::Q4_0), Feature::IntDotSubgroup, &[("WTYPE_Q4_0", "1"), INT_DOT, SG]),
    v("matvec_id_q4_0_intdot", "matvec.comp", Op::MatVecId, Some(WeightType::Q4_0), Feature::IntDot, &[("WTYPE_Q4_0", "1"), ID, INT_DOT]),
    v("matvec_id_q4_0_intdot_subgroup", "matvec.comp", Op::MatVecId, Some(WeightType::Q4_0), Feature::IntDotSubgroup, &[("WTYPE_Q4_0", "1"), ID, INT_DOT, SG]),
    v("matvec_q8_0_intdot", "matvec.comp", Op::MatVec, Some(WeightType::Q8_0), Feature::IntDot, &[("WTYPE_Q8_0", "1"), INT_DOT]),
    v("matvec_q8_0_intdot_subgroup", "matvec.comp", Op::MatVec, Some(WeightType::Q8_0), Feature::IntDotSubgroup, &[("WTYPE_Q8_0", "1"), INT_DOT, SG]),
    v("matvec_cols_q4_0_intdot", "matvec.comp", Op::MatVecCols, Some(WeightType::Q4_0), Feature::IntDot, &[("WTYPE_Q4_0", "1"), COLS, INT_DOT]),
    v("matvec_runs_q4_0_intdot", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q4_0), Feature::IntDot, &[("WTYPE_Q4_0", "1"), COLS, RUNS, INT_DOT]),
    v("matvec_cols_q4_0_intdot_subgroup", "matvec.comp", Op::MatVecCols, Some(WeightType::Q4_0), Feature::IntDotSubgroup, &[("WTYPE_Q4_0", "1"), COLS, INT_DOT, SG]),
    v("matvec_runs_q4_0_intdot_subgroup", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q4_0), Feature::IntDotSubgroup, &[("WTYPE_Q4_0", "1"), COLS, RUNS, INT_DOT, SG]),
    v("matvec_cols_q8_0_intdot", "matvec.comp", Op::MatVecCols, Some(WeightType::Q8_0), Feature::IntDot, &[("WTYPE_Q8_0", "1"), COLS, INT_DOT]),
    v("matvec_runs_q8_0_intdot", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q8_0), Feature::IntDot, &[("WTYPE_Q8_0", "1"), COLS, RUNS, INT_DOT]),
    v("matvec_cols_q8_0_intdot_subgroup", "matvec.comp", Op::MatVecCols, Some(WeightType::Q8_0), Feature::IntDotSubgroup, &[("WTYPE_Q8_0", "1"), COLS, INT_DOT, SG]),
    v("matvec_runs_q8_0_intdot_subgroup", "matvec.comp", Op::MatVecRuns, Some(WeightType::Q8_0), Feature::IntDotSubgroup, &[("WTYPE_Q8_0", "1"), COLS, RUNS, INT_DOT, SG]),
    v("matvec_id_q8_0_intdot", "matvec.comp", Op::MatVecId, Some(WeightType::Q8_0), Feature::IntDot, &[("WTYPE_Q8_0", "1"), ID, INT_DOT]),
    v("matvec_id_q8_0_intdot_subgroup", "matvec.comp", Op::MatVecId, Some(WeightType::Q8_0), Feature::IntDotSubgroup, &[("WTYPE_Q8_0", "1"), ID, INT_DOT, SG]),
    v("quantize_q8", "quantize_q8.comp", Op::QuantizeQ8, None, Feature::Base, &[]),
    v("matvec_q4_0_q8in", "matvec.comp", Op::MatVecQ8, Some(WeightType::Q4_0), Feature::IntDot, &[("WTYPE_Q4_0", "1"), INT_DOT, Q8]),
    v("matvec_q4_0_q8in_subgroup", "matvec.comp", Op::MatVecQ8, Some(WeightType::Q4_0), Feature::IntDotSubgroup, &[("WTYPE_Q4_0", "1"), INT_DOT, Q8, SG]),
    v("matvec_id_q4_0_q8in", "matvec.comp", Op::MatVecIdQ8, Some(WeightType::Q4_0), Feature::IntDot, &[("WTYPE_Q4_0", "1"), ID, INT_DOT, Q8]),
    v("matvec_id_q4_0_q8in_subgroup", "matvec.comp", Op::MatVecIdQ8, Some(WeightType::Q4_0), Feature::IntDotSubgroup, &[("WTYPE_Q4_0", "1"), ID, INT_DOT, Q8, SG]),
    v("matvec_cols_q4_0_q8in", "matvec.comp", Op::MatVecColsQ8, Some(WeightType::Q4_0), Feature::IntDot, &[("WTYPE_Q4_0", "1"), COLS, INT_DOT, Q8]),
    v("matvec_cols_q4_0_q8in_subgroup", "matvec.comp", Op::MatVecColsQ8, Some(WeightType::Q4_0), Feature::IntDotSubgroup, &[("WTYPE_Q4_0", "1"), COLS, INT_DOT, Q8, SG]),
    v("matvec_runs_q4_0_q8in", "matvec.comp", Op::MatVecRunsQ8, Some(WeightType::Q4_0), Feature::IntDot, &[("WTYPE_Q4_0", "1"), COLS, RUNS, INT_DOT, Q8]),
    v("matvec_runs_q4_0_q8in_subgroup", "matvec.comp", Op::MatVecRunsQ8, Some(WeightType::Q4_0), Feature::IntDotSubgroup, &[("WTYPE_Q4_0", "1"), COLS, RUNS, INT_DOT, Q8, SG]),
    v("matvec_q8_0_q8in", "matvec.comp", Op::MatVecQ8, Some(WeightType::Q8_0), Feature::IntDot, &[("WTYPE_Q8_0", "1"), INT_DOT, Q8]),
    v("matvec_q8_0_q8in_subgroup", "matvec.comp", Op::MatVecQ8, Some(WeightType::Q8_0), Feature::IntDotSubgroup, &[("WTYPE_Q8_0", "1"), INT_DOT, Q8, SG]),
    v("matvec_id_q8_0_q8in", "matvec.comp", Op::MatVecIdQ8, Some(WeightType::Q8_0), Feature::IntDot, &[("WTYPE_Q8_0", "1"), ID, INT_DOT, Q8]),
    v("matvec_id_q8_0_q8in_subgroup", "matvec.comp", Op::MatVecIdQ8, Some(WeightType::Q8_0), Feature::IntDotSubgroup, &[("WTYPE_Q8_0", "1"), ID, INT_DOT, Q8, SG]),
    v("matvec_cols_q8_0_q8in", "matvec.comp", Op::MatVecColsQ8, Some(WeightType::Q8_0), Feature::IntDot, &[("WTYPE_Q8_0", "1"), COLS, INT_DOT, Q8]),
    v("matvec_cols_q8_0_q8in_subgroup", "matvec.comp", Op::MatVecColsQ8, Some(WeightType::Q8_0), Feature::IntDotSubgroup, &[("WTYPE_Q8_0", "1"), COLS, INT_DOT, Q8, SG]),
    v("matvec_runs_q8_0_q8in", "matvec.comp", Op::MatVecRunsQ8, Some(WeightType::Q8_0), Feature::IntDot, &[("WTYPE_Q8_0", "1"), COLS, RUNS, INT_DOT, Q8]),
    v("matvec_runs_q8_0_q8in_subgroup", "matvec.comp", Op::MatVecRunsQ8, Some(WeightType::Q8_0), Feature::IntDotSubgroup, &[("WTYPE_Q8_0", "1"), COLS, RUNS, INT_DOT, Q8, SG]),
    v("matvec_id_f32", "matvec.comp", Op::MatVecId, Some(WeightType::F32), Feature::Base, &[("WTYPE_F32", "1"), ID]),
    v("matvec_id_f16", "matvec.comp", Op::MatVecId, Some(WeightType::F16), Feature::Base, &[("WTYPE_F16", "1"), ID]),
    v("matvec_id_q8_0", "matvec.comp", Op::MatVecId, Some(WeightType::Q8_0), Feature::Base, &[("WTYPE_Q8_0", "1"), ID]),
    v("matvec_id_q4_0", "matvec.comp", Op::MatVecId, Some(WeightType::Q4_0), Feature::Base, &[("WTYPE_Q4_0", "1"), ID]),
    v("matvec_id_q4_k", "matvec.comp", Op::MatVecId, Some(WeightType::Q4K), Feature::Base, &[("WTYPE_Q4_K", "1"), ID]),
    v("matvec_id_q6_k", "matvec.comp", Op::MatVecId, Some(WeightType::Q6K), Feature::Base, &[("WTYPE_Q6_K", "1"), ID]),
    v("matvec_id_f32_subgroup", "matvec.comp", Op::MatVecId, Some(WeightType::F32), Feature::Subgroup, &[("WTYPE_F32", "1"), ID, SG]),
    v("matvec_id_f16_subgroup", "matvec.comp", Op::MatVecId, Some(WeightType::F16), Feature::Subgroup, &[("WTYPE_F16", "1"), ID, SG]),
    v("matvec_id_q8_0_subgroup", "matvec.comp", Op::MatVecId, Some(WeightType::Q8_0), Feature::Subgroup, &[("WTYPE_Q8_0", "1"), ID, SG]),
    v("matvec_id_q4_0_subgroup", "matvec.comp", Op::MatVecId, Some(WeightType::Q4_0), Feature::Subgroup, &[("WTYPE_Q4_0", "1"), ID, SG]),
    v("matvec_id_q4_k_subgroup", "matvec.comp", Op::MatVecId, Some(WeightType::Q4K), Feature::Subgroup, &[("WTYPE_Q4_K", "1"), ID, SG]),
    v("matvec_id_q6_k_subgroup", "matvec.comp", Op::MatVecId, Some(WeightType::Q6K), Feature::Subgroup, &[("WTYPE_Q6_K", "1"), ID, SG]),
    v("scale_add_routed", "scale_add.comp", Op::ScaleAddRouted, None, Feature::Base, &[("ROUTED", "1")]),
    v("scatter_add", "scatter_add.comp", Op::ScatterAdd, None, Feature::Base, &[]),
    v("gather_add", "scatter_add.comp", Op::GatherAdd, None, Feature::Base, &[("GATHER", "1")]),
    v("matvec_batch_grouped_f32", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::F32), Feature::Base, &[("WTYPE_F32", "1"), GR]),
    v("matvec_batch_grouped_f16", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::F16), Feature::Base, &[("WTYPE_F16", "1"), GR]),
    v("matvec_batch_grouped_q8_0", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::Q8_0), Feature::Base, &[("WTYPE_Q8_0", "1"), GR]),
    v("matvec_batch_grouped_q4_0", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::Q4_0), Feature::Base, &[("WTYPE_Q4_0", "1"), GR]),
    v("matvec_batch_grouped_q4_k", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::Q4K), Feature::Base, &[("WTYPE_Q4_K", "1"), GR]),
    v("matvec_batch_grouped_q6_k", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::Q6K), Feature::Base, &[("WTYPE_Q6_K", "1"), GR]),
    v("matvec_batch_grouped_f32_coopmat", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::F32), Feature::CoopMat, &[("WTYPE_F32", "1"), CM, GR]),
    v("matvec_batch_grouped_f16_coopmat", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::F16), Feature::CoopMat, &[("WTYPE_F16", "1"), CM, GR]),
    v("matvec_batch_grouped_q8_0_coopmat", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::Q8_0), Feature::CoopMat, &[("WTYPE_Q8_0", "1"), CM, GR]),
    v("matvec_batch_grouped_q4_0_coopmat", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::Q4_0), Feature::CoopMat, &[("WTYPE_Q4_0", "1"), CM, GR]),
    v("matvec_batch_grouped_q4_k_coopmat", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::Q4K), Feature::CoopMat, &[("WTYPE_Q4_K", "1"), CM, GR]),
    v("matvec_batch_grouped_q6_k_coopmat", "matvec_batch.comp", Op::MatVecBatchGrouped, Some(WeightType::Q6K), Feature::CoopMat, &[("WTYPE_Q6_K", "1"), CM, GR]),
    v("moe_route", "moe_route.comp", Op::MoeRoute, None, Feature::Base, &[]),
    v("moe_route_subgroup", "moe_route.comp", Op::MoeRoute, None, Feature::Subgroup, &[SG]),
    v("moe_route_chunk", "moe_route.comp", Op::MoeRouteChunk, None, Feature::Base, &[("CHUNK", "1")]),
    v("moe_route_chunk_subgroup", "moe_route.comp", Op::MoeRouteChunk, None, Feature::Subgroup, &[("CHUNK", "1"), SG]),
    v("moe_sort", "moe_sort.comp", Op::MoeSort, None, Feature::Base, &[]),
    v("moe_router", "moe_route.comp", Op::MoeRouter, None, Feature::Base, &[("ROUTER", "1")]),
    v("moe_router_subgroup", "moe_route.comp", Op::MoeRouter, None, Feature::Subgroup, &[("ROUTER", "1"), SG]),
    v("matmul_f16_coopmat", "matvec_batch.comp", Op::Matmul, None, Feature::CoopMat, &[CM, ("F16_MATRIX", "1")]),
    v("dequant_f16_f32", "dequant.comp", Op::DequantF16, Some(WeightType::F32), Feature::Base, &[("WTYPE_F32", "1"), F16_OUT]),
    v("dequant_f16_f16", "dequant.comp", Op::DequantF16, Some(WeightType::F16), Feature::Base, &[("WTYPE_F16", "1"), F16_OUT]),
    v("dequant_f16_q8_0", "dequant.comp", Op::DequantF16, Some(WeightType::Q8_0), Feature::Base, &[("WTYPE_Q8_0", "1"), F16_OUT]),
    v("dequant_f16_q4_0", "dequant.comp", Op::DequantF16, Some(WeightType::Q4_0), Feature::Base, &[("WTYPE_Q4_0", "1"), F16_OUT]),
    v("dequant_f16_q4_k", "dequant.comp", Op::DequantF16, Some(WeightType::Q4K), Feature::Base, &[("WTYPE_Q4_K", "1"), F16_OUT]),
    v("dequant_f16_q6_k", "dequant.comp", Op::DequantF16, Some(WeightType::Q6K), Feature::Base, &[("WTYPE_Q6_K", "1"), F16_OUT]),
];
