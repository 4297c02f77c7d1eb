#version 450
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// y[r] = row_r(W) · x for quantized rows, one workgroup per row (decode: a batch of one).
// Each invocation takes units of 32 weights in turn, so neighbours read neighbouring blocks.
// Rows come in a 2-D grid because a vocabulary can exceed the 65535 groups of one dimension.

#define WG 64u
layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Params {
    uint n_in;
    uint n_rows;
    uint w_offset; // byte offset of row 0 in `weights`
    uint y_offset; // element offset of row 0's result in `y`
} p;

#include "common.glsl"
#include "decode.glsl"
#include "reduce.glsl"

void main() {
    const uint r = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (r >= p.n_rows) {
        return; // whole workgroups leave together, so the barriers below stay uniform
    }
    const uint row = p.w_offset + r * row_bytes(p.n_in);
    float acc = 0.0;
    float v[32];
    for (uint u = gl_LocalInvocationID.x; u < p.n_in / 32u; u += WG) {
        decode_unit(row, u, v);
        for (uint i = 0u; i < 32u; ++i) {
            acc += v[i] * x[32u * u + i];
        }
    }
    acc = wg_sum(acc);
    if (gl_LocalInvocationID.x == 0u) {
        y[p.y_offset + r] = acc;
    }
}
