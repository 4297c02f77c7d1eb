#version 450
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// Attention of one new token over the f16 KV cache, one workgroup per query head (GQA: head h
// reads KV head h / group). As the CPU engine (and llama.cpp): Q is rounded to f16 and dotted
// with the f16 keys, scaled, softmaxed, and the probabilities are rounded to f16 before they
// weigh the f16 values. Scores go through a scratch buffer of `scores_stride` per head. The new
// token's position is read on the device, from word `step_index` of the step buffer (positions
// 0..=pos attend, at most `scores_stride`), so a recorded step can be replayed at each position.

#define WG 128u
#define MAX_HEAD_DIM 512u
layout(local_size_x = 128) in;

layout(std430, binding = 0) readonly buffer Q { float q[]; };
layout(std430, binding = 1) readonly buffer KCache { uint k_cache[]; };
layout(std430, binding = 2) readonly buffer VCache { uint v_cache[]; };
layout(std430, binding = 3) coherent buffer Scores { float scores[]; };
layout(std430, binding = 4) writeonly buffer Out { float dst[]; };
layout(std430, binding = 5) readonly buffer Step { uint step[]; };

layout(push_constant) uniform Params {
    uint head_dim;  // even
    uint kv_width;  // halves per cache row
    uint group;     // query heads per KV head
    uint scores_stride;
    float scale;
    uint step_index;
} p;

#include "reduce.glsl"

shared float qh[MAX_HEAD_DIM];

float round_f16(float v) {
    return unpackHalf2x16(packHalf2x16(vec2(v, 0.0))).x;
}

void main() {
    const uint h = gl_WorkGroupID.x;
    const uint kv_off = (h / p.group) * p.head_dim; // in halves, within a cache row
    const uint sbase = h * p.scores_stride;
    const uint n_kv = min(step[p.step_index] + 1u, p.scores_stride);
    for (uint d = gl_LocalInvocationID.x; d < p.head_dim; d += WG) {
        qh[d] = round_f16(q[h * p.head_dim + d]);
    }
    barrier();

    float m = uintBitsToFloat(0xFF800000u); // -inf
    for (uint t = gl_LocalInvocationID.x; t < n_kv; t += WG) {
        const uint row = (t * p.kv_width + kv_off) / 2u;
        float s = 0.0;
        for (uint d = 0u; d < p.head_dim; d += 2u) {
            const vec2 kk = unpackHalf2x16(k_cache[row + d / 2u]);
            s += qh[d] * kk.x + qh[d + 1u] * kk.y;
        }
        s *= p.scale;
        scores[sbase + t] = s;
        m = max(m, s);
    }
    m = wg_max(m);
    float sum = 0.0;
    for (uint t = gl_LocalInvocationID.x; t < n_kv; t += WG) {
        const float e = exp(scores[sbase + t] - m);
        scores[sbase + t] = e;
        sum += e;
    }
    const float inv = 1.0 / wg_sum(sum);
    // Each invocation wrote its own scores; the others read them below.
    memoryBarrierBuffer();
    barrier();

    for (uint d = gl_LocalInvocationID.x; d < p.head_dim; d += WG) {
        const uint e = kv_off + d;
        float acc = 0.0;
        for (uint t = 0u; t < n_kv; ++t) {
            const float pr = round_f16(scores[sbase + t] * inv);
            const uint w = v_cache[(t * p.kv_width + e) / 2u];
            acc += pr * unpackHalf2x16(w)[e & 1u];
        }
        dst[h * p.head_dim + d] = acc;
    }
}
