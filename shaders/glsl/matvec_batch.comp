#version 450
#extension GL_EXT_control_flow_attributes : require
#if defined(COOPMAT)
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#endif
// Y[t][r] = row_r(W) · X[t] for a batch of tokens (prompt processing): a matrix-matrix product,
// tiled. A workgroup computes a tile of BM rows × BN tokens; at each step along the inputs it
// decodes BK weights of each of its rows into shared memory once (`decode_unit`, as every other
// kernel) and loads the matching BK inputs of each of its tokens, so a weight is read once per
// BN tokens instead of once per token. X and Y are token-major. Rows are grid x, tokens grid y.
//
// The base variant multiplies in f32, each invocation a 4×4 block of the tile. The COOPMAT
// variant (VK_KHR_cooperative_matrix) rounds the decoded weights and the inputs to f16 and
// multiplies 16×16×16 blocks in the device's matrix units with f32 sums, as llama.cpp's Vulkan
// backend does: its results differ from the base variant by the rounding of the inputs.
//
// With F16_MATRIX (a COOPMAT variant, `Op::Matmul`) the matrix is f16, row-major, two halves a
// word, as `dequant.comp` writes it for a prompt's chunk: its tiles are loaded eight halves a
// load instead of decoded, `w_offset` counting halves (a multiple of 8).
//
// With the ACCUMULATE specialization constant the products are added to Y (the residual sums).

layout(local_size_x_id = 0) in; // base: 256; COOPMAT: ROW_GROUPS · COL_GROUPS subgroups
layout(constant_id = 1) const uint ACCUMULATE = 0u;


#if defined(F16_MATRIX)
layout(std430, binding = 0) readonly buffer Weights { uvec4 w8[]; };
#else
layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
#endif
#if defined(COOPMAT)
// Read four inputs a load: n_in and every step's start are multiples of 32.
layout(std430, binding = 1) readonly buffer X { vec4 x4[]; };
#else
layout(std430, binding = 1) readonly buffer X { float x[]; };
#endif
layout(std430, binding = 2) buffer Y { float y[]; };

layout(push_constant) uniform Params {
    uint n_in;
    uint n_rows;
    uint w_offset; // byte offset of row 0 in `weights`
    uint y_offset; // element offset of row 0's result for token 0 in `y`
    uint n_tok;
    uint x_stride; // floats from one token's vector to the next
    uint y_stride; // floats from one token's results to the next
#if defined(GROUPED)
    uint runs_at;  // word of the first run in `runs`
#endif
} p;

#if defined(GROUPED)
// Several experts' products in one dispatch, one run per workgroup layer (grid z): run i is
// words runs_at + 3i.. of `runs`: the expert's slot in the stack (rows slot · n_rows..), its
// first row of X and Y, and its rows (tokens). Each expert's tokens are rows of X gathered
// together, its results the same rows of Y.
layout(std430, binding = 3) readonly buffer Runs { uint runs[]; };
#endif

// This workgroup's product: its tokens, the byte (halves for F16_MATRIX) offset of its row 0,
// its first row of X and its first result in Y. `set_job` sets them at the start of `main`.
uint job_tok, job_w, job_x, job_y;

// Whether this workgroup has tokens to compute; false for a token tile past its run's tokens.
bool set_job(uint t0, uint row_len) {
#if defined(GROUPED)
    const uint at = p.runs_at + 3u * gl_WorkGroupID.z;
    const uint slot = runs[at], first = runs[at + 1u];
    job_tok = runs[at + 2u];
    job_w = p.w_offset + slot * p.n_rows * row_len;
    job_x = first;
    job_y = p.y_offset + first * p.y_stride;
#else
    job_tok = p.n_tok;
    job_w = p.w_offset;
    job_x = 0u;
    job_y = p.y_offset;
#endif
    return t0 < job_tok;
}

#if !defined(F16_MATRIX)
#include "common.glsl"
#include "decode.glsl"
#endif

void put(uint r, uint t, float v) {
    if (r < p.n_rows && t < job_tok) {
        const uint at = job_y + t * p.y_stride + r;
        y[at] = ACCUMULATE != 0u ? y[at] + v : v;
    }
}

#if !defined(COOPMAT)

#define BM 64u
#define BN 64u
#define BK 32u
// Weights k-major (ws[k * BM + r]), inputs k-major (xs[k * BN + t]).
shared float ws[BK * BM];
shared float xs[BK * BN];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint r0 = gl_WorkGroupID.x * BM;
    const uint t0 = gl_WorkGroupID.y * BN;
    const uint tr = (tid % 16u) * 4u; // this invocation's rows and tokens in the tile
    const uint tt = (tid / 16u) * 4u;
    const uint row_len = row_bytes(p.n_in);
    if (!set_job(t0, row_len)) {
        return;
    }
    float acc[4][4];
    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
        [[unroll]] for (uint j = 0u; j < 4u; ++j) {
            acc[i][j] = 0.0;
        }
    }
    for (uint k0 = 0u; k0 < p.n_in; k0 += BK) {
        if (tid < BM) {
            float v[32];
            if (r0 + tid < p.n_rows) {
#if defined(UNIT_WORDS)
                // Through the words the COOPMAT variant reads ahead, so that devices without
                // cooperative matrices (lavapipe in CI) test that decoding too.
                uint w[UNIT_WORDS];
                unit_words(job_w + (r0 + tid) * row_len, k0 / 32u, w);
                decode_words(job_w + (r0 + tid) * row_len, k0 / 32u, w, v);
#else
                decode_unit(job_w + (r0 + tid) * row_len, k0 / 32u, v);
#endif
            } else {
                [[unroll]] for (uint i = 0u; i < 32u; ++i) {
                    v[i] = 0.0;
                }
            }
            [[unroll]] for (uint i = 0u; i < 32u; ++i) {
                ws[i * BM + tid] = v[i];
            }
        }
        for (uint e = tid; e < BK * BN; e += gl_WorkGroupSize.x) {
            const uint t = e % BN, k = e / BN;
            xs[k * BN + t] = t0 + t < job_tok ? x[(job_x + t0 + t) * p.x_stride + k0 + k] : 0.0;
        }
        barrier();
        [[unroll]] for (uint k = 0u; k < BK; ++k) {
            const vec4 a = vec4(ws[k * BM + tr], ws[k * BM + tr + 1u], ws[k * BM + tr + 2u],
                                ws[k * BM + tr + 3u]);
            const vec4 b = vec4(xs[k * BN + tt], xs[k * BN + tt + 1u], xs[k * BN + tt + 2u],
                                xs[k * BN + tt + 3u]);
            [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                    acc[i][j] += a[i] * b[j];
                }
            }
        }
        barrier();
    }
    [[unroll]] for (uint j = 0u; j < 4u; ++j) {
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
            put(r0 + tr + i, t0 + tt + j, acc[i][j]);
        }
    }
}

#else // COOPMAT

// A workgroup's tile is ROW_GROUPS × COL_GROUPS subgroups, each CM_TM × CM_TN blocks of 16 × 16
// results: (16 · CM_TM · ROW_GROUPS) rows by (16 · CM_TN · COL_GROUPS) tokens. CM_TM and CM_TN
// come from `COOPMAT_BLOCKS` in `variants.rs` (build.rs defines them) and are compile-time, so
// each block is a named matrix: indexed arrays of them cost a third of the speed on the H200
// (`bench/RESULTS.md`). At each step along the inputs a subgroup loads its CM_TN input blocks
// once, then per row block one weight block and CM_TN products. The shared tiles are single
// buffers, filled and read between two barriers a step: double buffers (the next step's tiles
// filled while the matrix units work on this one's, one barrier a step) measured slower on the
// H200, 69 → 51 TFLOPS for Q4_0 4096 × 4096 (`bench/RESULTS.md`, 2026-12-04). Instead, each
// invocation reads its share of the next step's inputs (and, for Q4_0, Q8_0 and Q4_K, the
// words of its next weight units) into registers right after the first barrier, so those loads are in
// flight while the matrix units work; they reach shared memory after the second.
#if !defined(CM_TM) || !defined(CM_TN)
#error "CM_TM and CM_TN (blocks of a subgroup) must be defined"
#endif
// Inputs per step (32, 64 or 128).
layout(constant_id = 2) const uint BK = 64u;
// Subgroups along the tile's rows and along its tokens.
layout(constant_id = 3) const uint ROW_GROUPS = 2u;
layout(constant_id = 4) const uint COL_GROUPS = 2u;
const uint BM_ = 16u * CM_TM * ROW_GROUPS;
const uint BN_ = 16u * CM_TN * COL_GROUPS;
// Rows of the shared tiles are padded by 8 halves (16 bytes) against bank conflicts.
const uint BKP = BK + 8u;
// Four halves an element, so a tile is filled eight bytes a store, not two; the matrices are
// loaded from them in units of four halves.
shared f16vec4 ws[BM_ * BKP / 4u]; // half (r, k) at r * BKP + k: A, row-major
shared f16vec4 xs[BN_ * BKP / 4u]; // half (k, t) at t * BKP + k: B (k × tokens), column-major
// One 16×16 result block per subgroup on its way out, for blocks at the edge of Y only.
shared float cs[ROW_GROUPS * COL_GROUPS * 256u];

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>

// A block of results (rows r.., tokens t..) out to Y. Whole blocks whose start and stride are
// 16-byte aligned go straight to Y, which is column-major for a block (element (r, t) at
// t · y_stride + r); the others go through shared memory and `put`.
void put_block(ACC c, uint sg, uint lane, uint r, uint t) {
    const uint at = job_y + t * p.y_stride + r;
    if (r + 16u <= p.n_rows && t + 16u <= job_tok && at % 4u == 0u && p.y_stride % 4u == 0u) {
        if (ACCUMULATE != 0u) {
            ACC old;
            coopMatLoad(old, y, at, p.y_stride, gl_CooperativeMatrixLayoutColumnMajor);
            c = c + old;
        }
        coopMatStore(c, y, at, p.y_stride, gl_CooperativeMatrixLayoutColumnMajor);
        return;
    }
    coopMatStore(c, cs, sg * 256u, 16u, gl_CooperativeMatrixLayoutColumnMajor);
    subgroupMemoryBarrierShared();
    subgroupBarrier();
    for (uint e = lane; e < 256u; e += gl_SubgroupSize) {
        put(r + e % 16u, t + e / 16u, cs[sg * 256u + e]);
    }
    subgroupMemoryBarrierShared();
    subgroupBarrier();
}

// The per-row-block steps, written out for CM_TM and CM_TN at compile time.
#define LOAD_A(i) coopMatLoad(a, ws, ((rb + 16u * i) * BKP + kk) / 4u, BKP / 4u, gl_CooperativeMatrixLayoutRowMajor);
#define LOAD_B(j) coopMatLoad(b##j, xs, ((tb + 16u * j) * BKP + kk) / 4u, BKP / 4u, gl_CooperativeMatrixLayoutColumnMajor);
#define MMA(i, j) c##i##j = coopMatMulAdd(a, b##j, c##i##j);
#define PUT(i, j) put_block(c##i##j, sg, lane, r0 + rb + 16u * i, t0 + tb + 16u * j);
#if CM_TN == 1
#define ROW_DECL(i) ACC c##i##0 = ACC(0.0);
#define B_DECL MAT_B b0;
#define B_LOADS LOAD_B(0)
#define ROW_MMA(i) LOAD_A(i) MMA(i, 0)
#define ROW_PUT(i) PUT(i, 0)
#elif CM_TN == 2
#define ROW_DECL(i) ACC c##i##0 = ACC(0.0), c##i##1 = ACC(0.0);
#define B_DECL MAT_B b0, b1;
#define B_LOADS LOAD_B(0) LOAD_B(1)
#define ROW_MMA(i) LOAD_A(i) MMA(i, 0) MMA(i, 1)
#define ROW_PUT(i) PUT(i, 0) PUT(i, 1)
#elif CM_TN == 4
#define ROW_DECL(i) ACC c##i##0 = ACC(0.0), c##i##1 = ACC(0.0), c##i##2 = ACC(0.0), c##i##3 = ACC(0.0);
#define B_DECL MAT_B b0, b1, b2, b3;
#define B_LOADS LOAD_B(0) LOAD_B(1) LOAD_B(2) LOAD_B(3)
#define ROW_MMA(i) LOAD_A(i) MMA(i, 0) MMA(i, 1) MMA(i, 2) MMA(i, 3)
#define ROW_PUT(i) PUT(i, 0) PUT(i, 1) PUT(i, 2) PUT(i, 3)
#else
#error "CM_TN must be 1, 2 or 4"
#endif
#if CM_TM == 1
#define ALL_ROWS(M) M(0)
#elif CM_TM == 2
#define ALL_ROWS(M) M(0) M(1)
#elif CM_TM == 4
#define ALL_ROWS(M) M(0) M(1) M(2) M(3)
#else
#error "CM_TM must be 1, 2 or 4"
#endif

// Each invocation's share of a step's inputs, four a load, held in registers between the load
// and the store to shared memory.
const uint X_LOADS = BK * BN_ / 4u;
const uint X_PER = (X_LOADS + gl_WorkGroupSize.x - 1u) / gl_WorkGroupSize.x;
vec4 xr[X_PER];

void load_x(uint t0, uint k0) {
    [[unroll]] for (uint i = 0u; i < X_PER; ++i) {
        const uint e = gl_LocalInvocationID.x + i * gl_WorkGroupSize.x;
        const uint k = 4u * (e % (BK / 4u)), t = e / (BK / 4u);
        xr[i] = vec4(0.0);
        if (e < X_LOADS && t0 + t < job_tok && k0 + k < p.n_in) {
            xr[i] = x4[((job_x + t0 + t) * p.x_stride + k0 + k) / 4u];
        }
    }
}

void store_x(uint t0) {
    [[unroll]] for (uint i = 0u; i < X_PER; ++i) {
        const uint e = gl_LocalInvocationID.x + i * gl_WorkGroupSize.x;
        if (e < X_LOADS) {
            const uint k = 4u * (e % (BK / 4u)), t = e / (BK / 4u);
            xs[(t * BKP + k) / 4u] = f16vec4(xr[i]);
        }
    }
}

#if !defined(F16_MATRIX)
// BM rows × BK/32 units of weights a step, each decoded by one invocation into the shared tile.
const uint W_UNITS = BM_ * (BK / 32u);
const uint W_PER = (W_UNITS + gl_WorkGroupSize.x - 1u) / gl_WorkGroupSize.x;

#endif

#if defined(UNIT_WORDS) && !defined(F16_MATRIX)
#define W_PREFETCH
// The words of each invocation's units of the next step, in flight while this step multiplies.
uint wr[W_PER][UNIT_WORDS];

// Unit `e` of a step (row r of the tile, its h-th unit of 32 in the step) is in the matrix.
bool unit_in(uint e, uint r0, uint k0) {
    const uint r = e / (BK / 32u), h = e % (BK / 32u);
    return e < W_UNITS && r0 + r < p.n_rows && k0 + 32u * h < p.n_in;
}

void load_w(uint r0, uint k0, uint row_len) {
    [[unroll]] for (uint i = 0u; i < W_PER; ++i) {
        const uint e = gl_LocalInvocationID.x + i * gl_WorkGroupSize.x;
        const uint r = e / (BK / 32u), h = e % (BK / 32u);
        if (unit_in(e, r0, k0)) {
            unit_words(job_w + (r0 + r) * row_len, k0 / 32u + h, wr[i]);
        }
    }
}

void store_w(uint r0, uint k0, uint row_len) {
    [[unroll]] for (uint i = 0u; i < W_PER; ++i) {
        const uint e = gl_LocalInvocationID.x + i * gl_WorkGroupSize.x;
        const uint r = e / (BK / 32u), h = e % (BK / 32u);
        if (e < W_UNITS) {
            float v[32];
            if (unit_in(e, r0, k0)) {
                decode_words(job_w + (r0 + r) * row_len, k0 / 32u + h, wr[i], v);
            } else {
                [[unroll]] for (uint j = 0u; j < 32u; ++j) {
                    v[j] = 0.0;
                }
            }
            [[unroll]] for (uint j = 0u; j < 8u; ++j) {
                ws[(r * BKP + 32u * h) / 4u + j] =
                    f16vec4(v[4u * j], v[4u * j + 1u], v[4u * j + 2u], v[4u * j + 3u]);
            }
        }
    }
}
#endif

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint sg = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint r0 = gl_WorkGroupID.x * BM_;
    const uint t0 = gl_WorkGroupID.y * BN_;
    const uint rb = (sg % ROW_GROUPS) * (16u * CM_TM);
    const uint tb = (sg / ROW_GROUPS) * (16u * CM_TN);
#if defined(F16_MATRIX)
    const uint row_len = p.n_in; // halves
#else
    const uint row_len = row_bytes(p.n_in);
#endif
    if (!set_job(t0, row_len)) {
        return;
    }
    ALL_ROWS(ROW_DECL)
    load_x(t0, 0u);
#if defined(W_PREFETCH)
    load_w(r0, 0u, row_len);
#endif
    for (uint k0 = 0u; k0 < p.n_in; k0 += BK) {
#if defined(F16_MATRIX)
        // BM rows × BK/8 loads of eight halves, consecutive invocations along a row.
        for (uint e = tid; e < BM_ * (BK / 8u); e += gl_WorkGroupSize.x) {
            const uint r = e / (BK / 8u), c = 8u * (e % (BK / 8u));
            uvec4 w = uvec4(0u);
            if (r0 + r < p.n_rows && k0 + c < p.n_in) {
                w = w8[(job_w + (r0 + r) * p.n_in + k0 + c) / 8u];
            }
            ws[(r * BKP + c) / 4u] = f16vec4(unpackFloat2x16(w.x), unpackFloat2x16(w.y));
            ws[(r * BKP + c) / 4u + 1u] = f16vec4(unpackFloat2x16(w.z), unpackFloat2x16(w.w));
        }
#elif defined(W_PREFETCH)
        store_w(r0, k0, row_len);
#else
        for (uint e = tid; e < W_UNITS; e += gl_WorkGroupSize.x) {
            const uint r = e / (BK / 32u), h = e % (BK / 32u);
            float v[32];
            if (r0 + r < p.n_rows && k0 + 32u * h < p.n_in) {
                decode_unit(job_w + (r0 + r) * row_len, k0 / 32u + h, v);
            } else {
                [[unroll]] for (uint i = 0u; i < 32u; ++i) {
                    v[i] = 0.0;
                }
            }
            [[unroll]] for (uint i = 0u; i < 8u; ++i) {
                ws[(r * BKP + 32u * h) / 4u + i] =
                    f16vec4(v[4u * i], v[4u * i + 1u], v[4u * i + 2u], v[4u * i + 3u]);
            }
        }
#endif
        store_x(t0);
        barrier();
        // The next step's inputs (and Q4_0, Q8_0 or Q4_K weights) are read while the matrix units
        // work on this one's.
        if (k0 + BK < p.n_in) {
            load_x(t0, k0 + BK);
#if defined(W_PREFETCH)
            load_w(r0, k0 + BK, row_len);
#endif
        }
        [[unroll]] for (uint kk = 0u; kk < BK; kk += 16u) {
            MAT_A a;
            B_DECL
            B_LOADS
            ALL_ROWS(ROW_MMA)
        }
        barrier();
    }
    ALL_ROWS(ROW_PUT)
}

#endif
