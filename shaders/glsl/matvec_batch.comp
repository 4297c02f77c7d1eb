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

layout(local_size_x_id = 0) in; // base: 256; COOPMAT: 2 · ROW_GROUPS subgroups
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
} p;

#if !defined(F16_MATRIX)
#include "common.glsl"
#include "decode.glsl"
#endif

void put(uint r, uint t, float v) {
    if (r < p.n_rows && t < p.n_tok) {
        const uint at = p.y_offset + t * p.y_stride + r;
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
                decode_unit(p.w_offset + (r0 + tid) * row_len, k0 / 32u, v);
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
            xs[k * BN + t] = t0 + t < p.n_tok ? x[(t0 + t) * p.x_stride + k0 + k] : 0.0;
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

// Subgroups in a ROW_GROUPS × 2 grid, each 2 × 2 blocks of 16 × 16 results: a tile of 32 ·
// ROW_GROUPS rows by 64 tokens. The blocks are four named matrices, not an array: indexed ones
// cost a third of the speed on the H200 (`bench/RESULTS.md`). The shared tiles are single
// buffers, filled and read between two barriers a step: double buffers (the next step's tiles
// filled while the matrix units work on this one's, one barrier a step) measured slower on the
// H200, 69 → 51 TFLOPS for Q4_0 4096 × 4096 (`bench/RESULTS.md`, 2026-12-04).
// Inputs per step (32, 64 or 128).
layout(constant_id = 2) const uint BK = 64u;
// Subgroup rows of the tile (2 or 4).
layout(constant_id = 3) const uint ROW_GROUPS = 2u;
const uint BM_ = 32u * ROW_GROUPS;
#define BN_ 64u
// Rows of the shared tiles are padded by 8 halves (16 bytes) against bank conflicts.
const uint BKP = BK + 8u;
shared float16_t ws[BM_ * BKP]; // ws[r * BKP + k]: A, row-major
shared float16_t xs[BN_ * BKP]; // xs[t * BKP + k]: B (k × tokens), column-major
shared float cs[2u * ROW_GROUPS * 256u]; // one 16×16 result block per subgroup, on its way out

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>

// Block (i, j) of this subgroup's results (rows rb + 16i, tokens tb + 16j) out to Y.
void put_block(ACC c, uint sg, uint lane, uint r, uint t) {
    // Column-major: element (r, t) of the block at t * 16 + r.
    coopMatStore(c, cs, sg * 256u, 16u, gl_CooperativeMatrixLayoutColumnMajor);
    subgroupMemoryBarrierShared();
    subgroupBarrier();
    for (uint e = lane; e < 256u; e += gl_SubgroupSize) {
        put(r + e % 16u, t + e / 16u, cs[sg * 256u + e]);
    }
    subgroupMemoryBarrierShared();
    subgroupBarrier();
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint sg = gl_SubgroupID; // its 32 × 32 results of the tile
    const uint lane = gl_SubgroupInvocationID;
    const uint r0 = gl_WorkGroupID.x * BM_;
    const uint t0 = gl_WorkGroupID.y * BN_;
    const uint rb = (sg % ROW_GROUPS) * 32u;
    const uint tb = (sg / ROW_GROUPS) * 32u;
#if !defined(F16_MATRIX)
    const uint row_len = row_bytes(p.n_in);
#endif
    ACC c00 = ACC(0.0), c01 = ACC(0.0), c10 = ACC(0.0), c11 = ACC(0.0);
    for (uint k0 = 0u; k0 < p.n_in; k0 += BK) {
#if defined(F16_MATRIX)
        // BM rows × BK/8 loads of eight halves, consecutive invocations along a row.
        for (uint e = tid; e < BM_ * (BK / 8u); e += gl_WorkGroupSize.x) {
            const uint r = e / (BK / 8u), c = 8u * (e % (BK / 8u));
            uvec4 w = uvec4(0u);
            if (r0 + r < p.n_rows && k0 + c < p.n_in) {
                w = w8[(p.w_offset + (r0 + r) * p.n_in + k0 + c) / 8u];
            }
            [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                const vec2 h = unpackHalf2x16(w[i]);
                ws[r * BKP + c + 2u * i] = float16_t(h.x);
                ws[r * BKP + c + 2u * i + 1u] = float16_t(h.y);
            }
        }
#else
        // BM rows × BK/32 units, each decoded by one invocation.
        for (uint u = tid; u < BM_ * (BK / 32u); u += gl_WorkGroupSize.x) {
            const uint r = u / (BK / 32u), h = u % (BK / 32u);
            float v[32];
            if (r0 + r < p.n_rows && k0 + 32u * h < p.n_in) {
                decode_unit(p.w_offset + (r0 + r) * row_len, k0 / 32u + h, v);
            } else {
                [[unroll]] for (uint i = 0u; i < 32u; ++i) {
                    v[i] = 0.0;
                }
            }
            [[unroll]] for (uint i = 0u; i < 32u; ++i) {
                ws[r * BKP + 32u * h + i] = float16_t(v[i]);
            }
        }
#endif
        // Four inputs a load (n_in and k0 are multiples of 32).
        for (uint e = tid; e < BK * BN_ / 4u; e += gl_WorkGroupSize.x) {
            const uint k = 4u * (e % (BK / 4u)), t = e / (BK / 4u);
            vec4 v = vec4(0.0);
            if (t0 + t < p.n_tok && k0 + k < p.n_in) {
                v = x4[((t0 + t) * p.x_stride + k0 + k) / 4u];
            }
            [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                xs[t * BKP + k + i] = float16_t(v[i]);
            }
        }
        barrier();
        [[unroll]] for (uint kk = 0u; kk < BK; kk += 16u) {
            MAT_A a0, a1;
            MAT_B b0, b1;
            coopMatLoad(a0, ws, rb * BKP + kk, BKP, gl_CooperativeMatrixLayoutRowMajor);
            coopMatLoad(a1, ws, (rb + 16u) * BKP + kk, BKP, gl_CooperativeMatrixLayoutRowMajor);
            coopMatLoad(b0, xs, tb * BKP + kk, BKP, gl_CooperativeMatrixLayoutColumnMajor);
            coopMatLoad(b1, xs, (tb + 16u) * BKP + kk, BKP, gl_CooperativeMatrixLayoutColumnMajor);
            c00 = coopMatMulAdd(a0, b0, c00);
            c01 = coopMatMulAdd(a0, b1, c01);
            c10 = coopMatMulAdd(a1, b0, c10);
            c11 = coopMatMulAdd(a1, b1, c11);
        }
        barrier();
    }
    put_block(c00, sg, lane, r0 + rb, t0 + tb);
    put_block(c01, sg, lane, r0 + rb, t0 + tb + 16u);
    put_block(c10, sg, lane, r0 + rb + 16u, t0 + tb);
    put_block(c11, sg, lane, r0 + rb + 16u, t0 + tb + 16u);
}

#endif
