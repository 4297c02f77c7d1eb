#version 450
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// out = x * (1 / sqrt(mean(x²) + eps)) * w for each row of `n` (one workgroup per row).

#define WG 256u
layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer W { float w[]; };
layout(std430, binding = 2) writeonly buffer Out { float dst[]; };

layout(push_constant) uniform Params {
    uint n;
    float eps;
} p;

#include "reduce.glsl"

void main() {
    const uint base = gl_WorkGroupID.x * p.n;
    float s = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < p.n; i += WG) {
        s += x[base + i] * x[base + i];
    }
    const float mean = wg_sum(s) / float(p.n);
    const float scale = 1.0 / sqrt(mean + p.eps);
    for (uint i = gl_LocalInvocationID.x; i < p.n; i += WG) {
        dst[base + i] = (x[base + i] * scale) * w[i];
    }
}
