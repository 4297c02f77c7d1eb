#version 450
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// RoPE of every head of one token in place (one workgroup per head), optionally after an RMSNorm
// of the head (Qwen3's QK-norm). Pairs are adjacent (llama) or halves (ROPE_NEOX, the Qwen
// family). Angles come from a table that the host fills with the CPU's own `rope_cache`:
// `table[(pos * n_rot/2 + i) * 2]` = cos, `+ 1` = sin. Positions are read on the device, so a
// recorded step can be replayed at each new position: token t's position is word
// `step_index + 2t` of the step buffer (clamped to the table) and the first cache row of its
// sequence word `step_index + 2t + 1`. Several tokens are the workgroup rows (y): token t's
// heads follow token t - 1's. They may be a prompt's, at consecutive positions of one sequence,
// or one token of each of several sequences (a batched decode step).
//
// With the STORE specialization constant (for K) the result is not written back: it goes
// straight to the f16 K cache at the sequence's first row plus the position, and V's head goes
// to the V cache beside it (the KV-cache append of `kv_store.comp` in the same dispatch; nothing
// past `capacity` rows). Without
// it the bindings 4..6 are unused (the host binds stand-ins).

#define WG 64u
#define MAX_HEAD_DIM 512u
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint STORE = 0u;

layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer Norm { float norm_w[]; };
layout(std430, binding = 2) readonly buffer Table { float table[]; };
layout(std430, binding = 3) readonly buffer Step { uint step[]; };
layout(std430, binding = 4) readonly buffer V { float v[]; };
layout(std430, binding = 5) writeonly buffer KCache { uint k_cache[]; };
layout(std430, binding = 6) writeonly buffer VCache { uint v_cache[]; };

layout(push_constant) uniform Params {
    uint head_dim;
    uint n_rot;
    float eps;
    uint qk_norm; // 1: RMSNorm the head with `norm_w` first
    uint n_pos;   // positions in the table
    uint step_index;
    uint kv_width; // with STORE: halves per cache row
    uint capacity; // with STORE: rows of the caches
} p;

#include "reduce.glsl"

shared float h[MAX_HEAD_DIM];

void main() {
    const uint t = gl_WorkGroupID.y;
    const uint base = (t * gl_NumWorkGroups.x + gl_WorkGroupID.x) * p.head_dim;
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
    const uint pos = min(step[p.step_index + 2u * t], p.n_pos - 1u);
    for (uint i = gl_LocalInvocationID.x; i < half_rot; i += WG) {
#if defined(ROPE_NEOX)
        const uint a = i, b = i + half_rot;
#else
        const uint a = 2u * i, b = 2u * i + 1u;
#endif
        const float c = table[(pos * half_rot + i) * 2u];
        const float sn = table[(pos * half_rot + i) * 2u + 1u];
        const float x0 = h[a], x1 = h[b];
        const float y0 = x0 * c - x1 * sn, y1 = x0 * sn + x1 * c;
        if (STORE != 0u) {
            h[a] = y0; // this invocation alone reads and writes a and b
            h[b] = y1;
        } else {
            x[base + a] = y0;
            x[base + b] = y1;
        }
    }
    if (STORE == 0u) {
        for (uint i = p.n_rot + gl_LocalInvocationID.x; i < p.head_dim; i += WG) {
            x[base + i] = h[i];
        }
        return;
    }
    barrier();
    const uint at = step[p.step_index + 2u * t + 1u] + step[p.step_index + 2u * t];
    if (at >= p.capacity) {
        return;
    }
    const uint row = at * (p.kv_width / 2u) + gl_WorkGroupID.x * (p.head_dim / 2u);
    for (uint w = gl_LocalInvocationID.x; w < p.head_dim / 2u; w += WG) {
        k_cache[row + w] = packHalf2x16(vec2(h[2u * w], h[2u * w + 1u]));
        v_cache[row + w] = packHalf2x16(vec2(v[base + 2u * w], v[base + 2u * w + 1u]));
    }
}
