#version 450
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// Y[t][r] = row_r(W) · X[t] for up to TILE tokens per workgroup (prompt processing): the same
// work split as matvec.comp, but each unit of 32 weights is decoded once and dotted with every
// token of the tile, so a prompt reads the weights once per TILE tokens instead of once per
// token. X and Y are token-major. Rows use a 2-D grid (x, y) as matvec.comp does; the token
// tile is the z index.

#define WG 64u
#define TILE 8u
layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

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
#include "reduce.glsl"

void main() {
    const uint r = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (r >= p.n_rows) {
        return; // whole workgroups leave together, so the barriers below stay uniform
    }
    const uint t0 = gl_WorkGroupID.z * TILE;
    const uint nt = min(TILE, p.n_tok - t0);
    const uint row = p.w_offset + r * row_bytes(p.n_in);
    float acc[TILE];
    for (uint t = 0u; t < TILE; ++t) {
        acc[t] = 0.0;
    }
    float v[32];
    for (uint u = gl_LocalInvocationID.x; u < p.n_in / 32u; u += WG) {
        decode_unit(row, u, v);
        for (uint t = 0u; t < nt; ++t) {
            const uint xb = (t0 + t) * p.x_stride + 32u * u;
            float a = acc[t];
            for (uint i = 0u; i < 32u; ++i) {
                a += v[i] * x[xb + i];
            }
            acc[t] = a;
        }
    }
    for (uint t = 0u; t < TILE; ++t) {
        const float s = wg_sum(acc[t]);
        if (gl_LocalInvocationID.x == 0u && t < nt) {
            y[p.y_offset + (t0 + t) * p.y_stride + r] = s;
        }
    }
}
