#version 450
// One row of a weight matrix to f32 (ggml's get_rows: the token embedding). One invocation per
// unit of 32 weights.

layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
layout(std430, binding = 1) writeonly buffer Output { float dst[]; };

layout(push_constant) uniform Params {
    uint n;        // row width
    uint w_offset; // byte offset of the row in `weights`
    uint dst_offset;
} p;

#include "common.glsl"
#include "decode.glsl"

void main() {
    const uint u = gl_GlobalInvocationID.x;
    if (u >= p.n / 32u) {
        return;
    }
    float v[32];
    decode_unit(p.w_offset, u, v);
    for (uint i = 0u; i < 32u; ++i) {
        dst[p.dst_offset + 32u * u + i] = v[i];
    }
}
