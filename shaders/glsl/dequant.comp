#version 450
// Dequantizes `n_units` units of 32 weights: one invocation per unit (see decode.glsl), to f32,
// or with F16_OUT to f16, two to a word (the f16 matrices of prompts' products, `Op::Matmul`).
// Weight type chosen by a define from the variant table. Units are the x and y workgroups.

layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
#if defined(F16_OUT)
layout(std430, binding = 1) writeonly buffer Output { uint dst[]; };
#else
layout(std430, binding = 1) writeonly buffer Output { float dst[]; };
#endif

layout(push_constant) uniform Params {
    uint n_units; // DequantParams::n_blocks
    uint src_offset; // byte offset of the first block in `weights`
    uint dst_offset; // element offset in `dst` (F16_OUT: in halves, even)
} p;

#include "common.glsl"
#include "decode.glsl"

void main() {
    const uint u = (gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x) * 64u
        + gl_LocalInvocationID.x;
    if (u >= p.n_units) {
        return;
    }
    float v[32];
    decode_unit(p.src_offset, u, v);
#if defined(F16_OUT)
    for (uint i = 0u; i < 16u; ++i) {
        dst[p.dst_offset / 2u + 16u * u + i] = packHalf2x16(vec2(v[2u * i], v[2u * i + 1u]));
    }
#else
    for (uint i = 0u; i < 32u; ++i) {
        dst[p.dst_offset + 32u * u + i] = v[i];
    }
#endif
}
