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
// With the ACCUMULATE specialization constant the products are added to Y (the residual sums).

layout(local_size_x_id = 0) in; // base: 256; COOPMAT: 4 subgroups
layout(constant_id = 1) const uint ACCUMULATE = 0u;

#define BM 64u
#define BN 64u

layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
layout(std430, binding = 1) readonly buffer X { float x[]; };
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

#include "common.glsl"
#include "decode.glsl"

void put(uint r, uint t, float v) {
    if (r < p.n_rows && t < p.n_tok) {
        const uint at = p.y_offset + t * p.y_stride + r;
        y[at] = ACCUMULATE != 0u ? y[at] + v : v;
    }
}

#if !defined(COOPMAT)

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

#define BK 64u
// Rows of the shared tiles are padded by 8 halves (16 bytes) against bank conflicts.
#define BKP 72u
shared float16_t ws[BM * BKP]; // ws[r * BKP + k]: A, row-major
shared float16_t xs[BN * BKP]; // xs[t * BKP + k]: B (k × tokens), column-major
shared float cs[4u * 256u];    // one 16×16 result tile per subgroup, on its way out

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint sg = gl_SubgroupID;          // 0..3: a 32×32 quarter of the tile
    const uint lane = gl_SubgroupInvocationID;
    const uint r0 = gl_WorkGroupID.x * BM;
    const uint t0 = gl_WorkGroupID.y * BN;
    const uint rb = (sg % 2u) * 32u;
    const uint tb = (sg / 2u) * 32u;
    const uint row_len = row_bytes(p.n_in);
    ACC acc[2][2];
    [[unroll]] for (uint i = 0u; i < 2u; ++i) {
        [[unroll]] for (uint j = 0u; j < 2u; ++j) {
            acc[i][j] = ACC(0.0);
        }
    }
    for (uint k0 = 0u; k0 < p.n_in; k0 += BK) {
        // BM rows × BK/32 units, each decoded by one invocation.
        for (uint u = tid; u < BM * (BK / 32u); u += gl_WorkGroupSize.x) {
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
        for (uint e = tid; e < BK * BN; e += gl_WorkGroupSize.x) {
            const uint k = e % BK, t = e / BK;
            const bool inside = t0 + t < p.n_tok && k0 + k < p.n_in;
            xs[t * BKP + k] = float16_t(inside ? x[(t0 + t) * p.x_stride + k0 + k] : 0.0);
        }
        barrier();
        [[unroll]] for (uint kk = 0u; kk < BK; kk += 16u) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a[2];
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b[2];
            [[unroll]] for (uint i = 0u; i < 2u; ++i) {
                coopMatLoad(a[i], ws, (rb + 16u * i) * BKP + kk, BKP,
                            gl_CooperativeMatrixLayoutRowMajor);
                coopMatLoad(b[i], xs, (tb + 16u * i) * BKP + kk, BKP,
                            gl_CooperativeMatrixLayoutColumnMajor);
            }
            [[unroll]] for (uint i = 0u; i < 2u; ++i) {
                [[unroll]] for (uint j = 0u; j < 2u; ++j) {
                    acc[i][j] = coopMatMulAdd(a[i], b[j], acc[i][j]);
                }
            }
        }
        barrier();
    }
    [[unroll]] for (uint i = 0u; i < 2u; ++i) {
        [[unroll]] for (uint j = 0u; j < 2u; ++j) {
            // Column-major: element (r, t) of the 16×16 tile at t * 16 + r.
            coopMatStore(acc[i][j], cs, sg * 256u, 16u, gl_CooperativeMatrixLayoutColumnMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            for (uint e = lane; e < 256u; e += gl_SubgroupSize) {
                put(r0 + rb + 16u * i + e % 16u, t0 + tb + 16u * j + e / 16u, cs[sg * 256u + e]);
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();
        }
    }
}

#endif
