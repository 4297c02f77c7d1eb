#version 450
// Dequantizes `n_units` units of 32 weights to f32: one invocation per unit (see decode.glsl).
// Weight type chosen by a define from the variant table.

layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
layout(std430, binding = 1) writeonly buffer Output { float dst[]; };

layout(push_constant) uniform Params {
    uint n_units; // DequantParams::n_blocks
    uint src_offset; // byte offset of the first block in `weights`
    uint dst_offset; // element offset in `dst`
} p;

#include "common.glsl"
#include "decode.glsl"

void main() {
    const uint u = gl_GlobalInvocationID.x;
    if (u >= p.n_units) {
        return;
    }
    float v[32];
    decode_unit(p.src_offset, u, v);
    for (uint i = 0u; i < 32u; ++i) {
        dst[p.dst_offset + 32u * u + i] = v[i];
    }
}
