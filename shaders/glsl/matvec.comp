#version 450
#extension GL_EXT_control_flow_attributes : require
#if defined(INT_DOT)
#extension GL_EXT_integer_dot_product : require
#endif
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// y[r] = row_r(W) · x (decode: a batch of one), NROWS rows per workgroup of WG invocations, both
// specialization constants so the host tunes them per weight type. The row is cut into "items"
// (matvec_dot.glsl: 4 to 32 weights read as a few words); invocation t takes items t, t + WG, ...
// so neighbours read neighbouring bytes and every load of a subgroup is one run of memory. The
// inputs of an item are loaded once and used for all NROWS rows. Workgroups come in a 2-D grid
// because a vocabulary can exceed the 65535 groups of one dimension.
//
// Three specialization constants fuse the ops around a product into it: ACCUMULATE adds the
// results to `y` (a residual sum); NORM takes RMSNorm(x) times the weights `norm_w` as the input,
// each workgroup summing the squares of the x it loads anyway and scaling its sums once
// (W (x * s * w) = s W (x * w)); GLU reads two matrices, gate rows and up rows, and writes
// silu(gate · x) * (up · x), half of a workgroup's rows being gate rows and half up rows. Without
// INDEXED the up rows follow the gate rows (a stack of 2 * n_rows rows).
//
// With INDEXED (ggml's mul_mat_vec_id): `weights` is a stack of experts of `n_rows` rows each and
// the expert is read on the device, `ids[rank + z]` for workgroup layer z, so the routing need not
// come back to the host. Layer z reads x at `z * x_stride` and writes y at `y_offset + z *
// y_stride`: the k experts of a token are one dispatch. An id of 0xFFFFFFFF is an empty entry:
// nothing is computed or written for it. With GLU an expert's up rows lie `up_offset` bytes after
// its gate rows (the up stack after the gate stack in one buffer). With ID_SUM there is one layer
// (a token):
// each workgroup runs its rows of all `n_ids` experts, taking the (expert, item) pairs in turn so
// that short rows still give every invocation work, and writes Σ_z w_z (W_z · x_z), w_z being
// the float at `ids[weights_at + z]` (a MoE layer's down products, summed with the routing's
// weights, with ACCUMULATE straight into the residual). Several tokens' entries go in one
// dispatch (a decode step of several sequences): entry z is entry `z % per_tok` of token
// `z / per_tok`, whose ids (and weights) start `ids_tok` words after the previous token's and
// whose inputs start `x_tok` after its; with ID_SUM workgroup layer z sums token z's `n_ids`
// entries into `y_offset + z * y_tok`.
//
// With Q8_IN (and INT_DOT), binding 1 holds the inputs quantized by `quantize_q8.comp` rather
// than floats: x offsets and strides are in its 16-byte units, and NORM reads Σ x² from the
// vector's header; otherwise the kernel is unchanged, and its results are the same bits.
//
// With COLS (ggml's mul_mat_vec with several columns: a decode step of several sequences, a
// prompt of a few tokens): x holds `n_cols` vectors `x_stride` floats apart and y gets each one's
// results `y_stride` floats apart. A workgroup takes NROWS rows of all NCOLS columns, so each
// weight is read from memory once for every column; columns past `n_cols` repeat the last one so
// that every column's dot of an item runs the same straight-line code (the compiler can share an
// item's loads and decoding between them), and are not written. NROWS * NCOLS <= MAX_ROWS; no
// NORM or GLU. With RUNS as well (a prompt chunk's or batched step's MoE layer, a few tokens an
// expert): `weights` is a stack of experts of `n_rows` rows and workgroup layer z takes run z of
// the table at word `runs_at` of `runs`, (slot, first row, rows): the expert in that slot over
// rows first.. of x into the same rows of y, at most NCOLS of them; a run of no rows leaves.

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint NROWS = 4u;
layout(constant_id = 2) const uint ACCUMULATE = 0u;
layout(constant_id = 3) const uint NORM = 0u;
layout(constant_id = 4) const uint GLU = 0u;
layout(constant_id = 5) const uint ID_SUM = 0u;
// The host keeps WG <= MAX_WG and NROWS <= MAX_ROWS (ops.rs, `MatVecShape`), NROWS even with GLU.
#define MAX_WG 256u
#define MAX_ROWS 8u
#if defined(COLS)
layout(constant_id = 6) const uint NCOLS = 1u;
// Sums a workgroup keeps: a row's for each column.
#define SLOTS (NROWS * NCOLS)
#else
#define SLOTS NROWS
#endif

// One binding, two views: words for blocks that start on any even byte, 16-byte vectors for rows
// that the host keeps 16-byte aligned (F32, F16, Q4_K).
layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
layout(std430, binding = 0) readonly buffer Weights4 { uvec4 weights4[]; };
#if defined(Q8_IN)
// The inputs already quantized (quantize_q8.comp; with INT_DOT): offsets and strides of x are
// in 16-byte units of this layout, a vector's header first.
layout(std430, binding = 1) readonly buffer XQ { uvec4 xq[]; };
#else
layout(std430, binding = 1) readonly buffer X { vec4 x4[]; };
#endif
layout(std430, binding = 2) buffer Y { float y[]; };
// With NORM, the RMSNorm weights; otherwise unused (the host binds x in its place).
#if defined(RUNS)
layout(std430, binding = 3) readonly buffer Runs { uint runs[]; };
layout(std430, binding = 4) readonly buffer NormW { vec4 norm_w4[]; };
#elif defined(INDEXED)
layout(std430, binding = 3) readonly buffer Ids { uint ids[]; };
layout(std430, binding = 4) readonly buffer NormW { vec4 norm_w4[]; };
#else
layout(std430, binding = 3) readonly buffer NormW { vec4 norm_w4[]; };
#endif

layout(push_constant) uniform Params {
    uint n_in;
    uint n_rows;   // rows of one matrix (with GLU: of the gate matrix, and of the results)
    uint w_offset; // byte offset of row 0 in `weights`
    uint y_offset; // element offset of row 0's result in `y`
#if defined(INDEXED)
    uint rank;     // index in `ids` of layer 0's expert
    uint x_stride; // floats from one layer's input to the next (a multiple of 4)
    uint y_stride; // floats from one layer's results to the next
    uint up_offset;  // bytes from an expert's gate row to its up row (GLU)
    uint n_ids;      // experts summed (ID_SUM)
    uint weights_at; // index in `ids` of expert 0's weight (ID_SUM)
    uint per_tok;    // entries of one token: entry z is entry z % per_tok of token z / per_tok
    uint ids_tok;    // words of `ids` from one token's entries (and weights) to the next's
    uint x_tok;      // from one token's first input to the next's (x_stride: entry to entry)
    uint y_tok;      // ID_SUM: floats from one token's sum to the next's (layer z: token z)
#endif
#if defined(RUNS)
    uint runs_at;  // word of `runs` where the table starts
    uint x_stride; // floats from one row of x to the next (a multiple of 4)
    uint y_stride; // floats from one row of y to the next
#elif defined(COLS)
    uint n_cols;   // columns of x (and of y) to compute, at most NCOLS
    uint x_stride; // floats from one column of x to the next (a multiple of 4)
    uint y_stride; // floats from one column's results to the next
#endif
    float eps;     // RMSNorm's, with NORM
} p;

// Σ x² of the inputs this invocation loaded (NORM).
float sumsq = 0.0;
// With Q8_IN, the 16-byte unit of the header of the vector a NORM product reads.
uint x_base = 0u;

#if !defined(Q8_IN)
// Four inputs of the product: x, or with NORM x times the norm weights.
vec4 xin(uint i) {
    vec4 v = x4[i];
    if (NORM != 0u) {
        sumsq += dot(v, v);
        v *= norm_w4[i];
    }
    return v;
}
#endif

#include "matvec_dot.glsl"

#if defined(USE_SUBGROUP)
shared float red[(MAX_ROWS + 1u) * MAX_WG / 4u];
#else
shared float red[(MAX_ROWS + 1u) * MAX_WG];
#endif

// Writes result `i` from a row's sum `g`, the up row's `u` (GLU) and Σ x² (NORM).
void emit(uint i, float g, float u, float ss) {
    if (NORM != 0u) {
        const float scale = 1.0 / sqrt(ss / float(p.n_in) + p.eps);
        g *= scale;
        u *= scale;
    }
    float v = g;
    if (GLU != 0u) {
        v = (g / (1.0 + exp(-g))) * u;
    }
    y[i] = ACCUMULATE != 0u ? y[i] + v : v;
}

#if defined(COLS)
// Writes sum slot `s` (row r0 + s / NCOLS of column s % NCOLS, column 0's results from y0)
// where both exist.
void emit_col(uint s, uint y0, uint r0, uint nr, uint n_cols, float v) {
    const uint j = s / NCOLS, c = s % NCOLS;
    if (j < nr && c < n_cols) {
        emit(y0 + c * p.y_stride + r0 + j, v, 0.0, 0.0);
    }
}
#endif

void main() {
    const uint WG = gl_WorkGroupSize.x;
    const uint tid = gl_LocalInvocationID.x;
    // Results per workgroup: with GLU each takes a gate row and an up row.
    const uint OUT = GLU != 0u ? NROWS / 2u : NROWS;
    const uint r0 = OUT * (gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x);
    if (r0 >= p.n_rows) {
        return; // whole workgroups leave together, so the barriers below stay uniform
    }
    const uint nr = min(OUT, p.n_rows - r0);
    const uint rb = row_bytes(p.n_in);
    const uint n_items = p.n_in / ITEM_WEIGHTS;
    // Rows past the last (a partial last workgroup) repeat it, so every row slot runs the same
    // straight-line code; their sums are not written. With GLU, slots OUT.. are the up rows.
    uint row[NROWS];
    float acc[SLOTS + 1u];
#if defined(INDEXED)
    const uint up_bytes = p.up_offset;
    uint y0 = p.y_offset;
    if (ID_SUM != 0u) {
        // Rows relative to an expert's first; the expert changes along the loop.
        [[unroll]] for (uint j = 0u; j < NROWS; ++j) {
            row[j] = min(r0 + j, p.n_rows - 1u) * rb;
            acc[j] = 0.0;
        }
        const uint expert_bytes = p.n_rows * rb;
        const uint tok = gl_WorkGroupID.z;
        const uint ids0 = tok * p.ids_tok;
        const uint x_tok0 = tok * p.x_tok;
        y0 += tok * p.y_tok;
        for (uint t = tid; t < n_items * p.n_ids; t += WG) {
            const uint z = t / n_items;
            const uint i = t - z * n_items;
            const uint id = ids[p.rank + ids0 + z];
            if (id == 0xFFFFFFFFu) {
                continue;
            }
            const float wz = uintBitsToFloat(ids[p.weights_at + ids0 + z]);
            const uint e0 = p.w_offset + id * expert_bytes;
            Inputs xi = load_inputs(x_tok0 + z * p.x_stride, i);
            [[unroll]] for (uint j = 0u; j < NROWS; ++j) {
                acc[j] = fma(wz, dot_item(e0 + row[j], i, xi), acc[j]);
            }
        }
    } else {
        const uint z = gl_WorkGroupID.z;
        const uint tok = z / p.per_tok;
        const uint e = z - tok * p.per_tok;
        const uint id = ids[p.rank + tok * p.ids_tok + e];
        // An entry the host left empty (its expert runs elsewhere): the whole workgroup leaves.
        if (id == 0xFFFFFFFFu) {
            return;
        }
        const uint w0 = p.w_offset + id * p.n_rows * rb;
        const uint x0 = tok * p.x_tok + e * p.x_stride;
        x_base = x0;
        y0 += z * p.y_stride;
#elif defined(RUNS)
    const uint up_bytes = 0u;
    const uint run = p.runs_at + 3u * gl_WorkGroupID.z;
    const uint n_cols = min(runs[run + 2u], NCOLS);
    if (n_cols == 0u) {
        return; // the whole workgroup: its expert has no rows
    }
    const uint first = runs[run + 1u];
    const uint y0 = p.y_offset + first * p.y_stride;
    {
        const uint w0 = p.w_offset + runs[run] * p.n_rows * rb;
        const uint x0 = first * p.x_stride;
#else
    const uint up_bytes = p.n_rows * rb;
    const uint y0 = p.y_offset;
#if defined(COLS)
    const uint n_cols = p.n_cols;
#endif
    {
        const uint w0 = p.w_offset;
        const uint x0 = 0u;
#endif
        [[unroll]] for (uint j = 0u; j < NROWS; ++j) {
            const uint up = j >= OUT ? up_bytes : 0u;
            row[j] = w0 + up + min(r0 + j % OUT, p.n_rows - 1u) * rb;
        }
        [[unroll]] for (uint s = 0u; s < SLOTS; ++s) {
            acc[s] = 0.0;
        }
        for (uint i = tid; i < n_items; i += WG) {
#if defined(COLS)
            [[unroll]] for (uint c = 0u; c < NCOLS; ++c) {
                Inputs xi = load_inputs(x0 + min(c, n_cols - 1u) * p.x_stride, i);
                [[unroll]] for (uint j = 0u; j < NROWS; ++j) {
                    acc[j * NCOLS + c] += dot_item(row[j], i, xi);
                }
            }
#else
            Inputs xi = load_inputs(x0, i);
            [[unroll]] for (uint j = 0u; j < NROWS; ++j) {
                acc[j] += dot_item(row[j], i, xi);
            }
#endif
        }
    }
#if defined(Q8_IN)
    // The header's Σ x², counted once in the workgroup's sum.
    sumsq = NORM != 0u && tid == 0u ? uintBitsToFloat(xq[x_base].x) : 0.0;
#endif
    acc[SLOTS] = sumsq;
    const uint up = min(OUT, NROWS); // slot of result 0's up row (GLU)

#if defined(USE_SUBGROUP)
    [[unroll]] for (uint j = 0u; j <= SLOTS; ++j) {
        acc[j] = subgroupAdd(acc[j]);
    }
    if (gl_NumSubgroups == 1u) {
        if (tid == 0u) {
#if defined(COLS)
            [[unroll]] for (uint s = 0u; s < SLOTS; ++s) {
                emit_col(s, y0, r0, nr, n_cols, acc[s]);
            }
#else
            [[unroll]] for (uint j = 0u; j < OUT; ++j) {
                if (j < nr) {
                    emit(y0 + r0 + j, acc[j], acc[min(j + up, NROWS)], acc[NROWS]);
                }
            }
#endif
        }
        return;
    }
    const uint ns = gl_NumSubgroups;
    if (subgroupElect()) {
        [[unroll]] for (uint j = 0u; j <= SLOTS; ++j) {
            red[j * ns + gl_SubgroupID] = acc[j];
        }
    }
    barrier();
#if defined(COLS)
    if (tid < SLOTS) {
        float sum = 0.0;
        for (uint k = 0u; k < ns; ++k) {
            sum += red[tid * ns + k];
        }
        emit_col(tid, y0, r0, nr, n_cols, sum);
    }
    return;
#endif
    if (tid < nr) {
        float s[3] = float[3](0.0, 0.0, 0.0);
        const uint at[3] = uint[3](tid, min(tid + up, NROWS), NROWS);
        for (uint k = 0u; k < ns; ++k) {
            [[unroll]] for (uint q = 0u; q < 3u; ++q) {
                s[q] += red[at[q] * ns + k];
            }
        }
        emit(y0 + r0 + tid, s[0], s[1], s[2]);
    }
#else
    [[unroll]] for (uint j = 0u; j <= SLOTS; ++j) {
        red[j * WG + tid] = acc[j];
    }
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            [[unroll]] for (uint j = 0u; j <= SLOTS; ++j) {
                red[j * WG + tid] += red[j * WG + tid + s];
            }
        }
        barrier();
    }
#if defined(COLS)
    if (tid < SLOTS) {
        emit_col(tid, y0, r0, nr, n_cols, red[tid * WG]);
    }
    return;
#endif
    if (tid < nr) {
        emit(y0 + r0 + tid, red[tid * WG], red[min(tid + up, NROWS) * WG], red[NROWS * WG]);
    }
#endif
}
