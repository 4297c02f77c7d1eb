#version 450
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// Softmax in place over each row of `n` values (one workgroup per row): max subtracted.

#define WG 256u
layout(local_size_x = 256) in;

layout(std430, binding = 0) buffer X { float x[]; };

layout(push_constant) uniform Params {
    uint n;
    uint b_len; // unused: eltwise.comp's push block
} p;

#include "reduce.glsl"

void main() {
    const uint base = gl_WorkGroupID.x * p.n;
    float m = uintBitsToFloat(0xFF800000u); // -inf
    for (uint i = gl_LocalInvocationID.x; i < p.n; i += WG) {
        m = max(m, x[base + i]);
    }
    m = wg_max(m);
    float s = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < p.n; i += WG) {
        const float e = exp(x[base + i] - m);
        x[base + i] = e;
        s += e;
    }
    const float inv = 1.0 / wg_sum(s);
    for (uint i = gl_LocalInvocationID.x; i < p.n; i += WG) {
        x[base + i] *= inv;
    }
}
