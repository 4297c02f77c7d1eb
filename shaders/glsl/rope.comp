#version 450
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// RoPE of every head of one token in place (one workgroup per head), optionally after an RMSNorm
// of the head (Qwen3's QK-norm). Pairs are adjacent (llama) or halves (ROPE_NEOX, the Qwen
// family). Angles come from a table that the host fills with the CPU's own `rope_cache`:
// `table[(pos * n_rot/2 + i) * 2]` = cos, `+ 1` = sin. The position is read on the device, from
// word `step_index` of the step buffer (clamped to the table), so a recorded step can be replayed
// at each new position.

#define WG 64u
#define MAX_HEAD_DIM 512u
layout(local_size_x = 64) in;

layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer Norm { float norm_w[]; };
layout(std430, binding = 2) readonly buffer Table { float table[]; };
layout(std430, binding = 3) readonly buffer Step { uint step[]; };

layout(push_constant) uniform Params {
    uint head_dim;
    uint n_rot;
    float eps;
    uint qk_norm; // 1: RMSNorm the head with `norm_w` first
    uint n_pos;   // positions in the table
    uint step_index;
} p;

#include "reduce.glsl"

shared float h[MAX_HEAD_DIM];

void main() {
    const uint base = gl_WorkGroupID.x * p.head_dim;
    float s = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < p.head_dim; i += WG) {
        h[i] = x[base + i];
        s += h[i] * h[i];
    }
    if (p.qk_norm != 0u) {
        const float scale = 1.0 / sqrt(wg_sum(s) / float(p.head_dim) + p.eps);
        for (uint i = gl_LocalInvocationID.x; i < p.head_dim; i += WG) {
            h[i] = (h[i] * scale) * norm_w[i];
        }
    }
    barrier();
    const uint half_rot = p.n_rot / 2u;
    const uint pos = min(step[p.step_index], p.n_pos - 1u);
    for (uint i = gl_LocalInvocationID.x; i < half_rot; i += WG) {
#if defined(ROPE_NEOX)
        const uint a = i, b = i + half_rot;
#else
        const uint a = 2u * i, b = 2u * i + 1u;
#endif
        const float c = table[(pos * half_rot + i) * 2u];
        const float sn = table[(pos * half_rot + i) * 2u + 1u];
        const float x0 = h[a], x1 = h[b];
        x[base + a] = x0 * c - x1 * sn;
        x[base + b] = x0 * sn + x1 * c;
    }
    for (uint i = p.n_rot + gl_LocalInvocationID.x; i < p.head_dim; i += WG) {
        x[base + i] = h[i];
    }
}
