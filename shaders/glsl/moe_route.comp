#version 450
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// A MoE layer's routing on the device, as `engine::routing::route` does it on the host: softmax
// over the `n_expert` router logits (at most WG), the k most probable experts, most probable first
// (equal values go to the lower expert), and their weights, divided by their sum when `norm` is
// set. Softmax is monotonic, so the choice is made on `logit - max` rather than on the
// probabilities: the order does not depend on how this device rounds `exp`. (Where the host's
// `exp` rounds two different differences to one probability, within an ulp of the largest, the
// host takes the lower expert and this kernel the larger logit.) One workgroup; expert i's rank is
// the number of experts ahead of it, so no sort is needed.
//
// `route` receives k expert ids (as uint bits), then k weights, then the shared expert's gate
// (the sigmoid of `shared_logit[0]`, Qwen2-MoE) when `has_shared` is set. `log`, host-visible,
// receives the logits and the same k ids and k weights at `log_offset`, for the host to read once
// the step is done.

#define WG 256u
layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer Logits { float logits[]; };
layout(std430, binding = 1) readonly buffer SharedLogit { float shared_logit[]; };
layout(std430, binding = 2) writeonly buffer Route { float route[]; };
layout(std430, binding = 3) writeonly buffer Log { float log_[]; };

layout(push_constant) uniform Params {
    uint n_expert;
    uint k;
    uint norm;       // 1: weights divided by their sum (Mixtral, Qwen3-MoE)
    uint has_shared; // 1: write the shared expert's gate at route[2k]
    uint log_offset;
} p;

#include "reduce.glsl"

shared float vals[WG];
shared float chosen_w[WG];

void main() {
    const uint i = gl_LocalInvocationID.x;
    const bool live = i < p.n_expert;
    const float l = live ? logits[i] : uintBitsToFloat(0xFF800000u);
    const float m = wg_max(l);
    // The host's softmax computes the same difference (one correctly rounded subtraction);
    // ordering by it, two logits that round to one difference tie there and here alike.
    const float d = live ? l - m : uintBitsToFloat(0xFF800000u);
    vals[i] = d;
    const float e = live ? exp(d) : 0.0;
    const float sum = wg_sum(e); // contains barriers: `vals` is complete after it
    const float prob = e * (1.0 / sum);
    if (live) {
        log_[p.log_offset + i] = l;
        uint rank = 0u;
        for (uint j = 0u; j < p.n_expert; ++j) {
            const float o = vals[j];
            rank += (o > d || (o == d && j < i)) ? 1u : 0u;
        }
        if (rank < p.k) {
            route[rank] = uintBitsToFloat(i);
            log_[p.log_offset + p.n_expert + rank] = uintBitsToFloat(i);
            chosen_w[rank] = prob;
        }
    }
    barrier();
    if (i == 0u) {
        float s = 0.0;
        for (uint r = 0u; r < p.k; ++r) {
            s += chosen_w[r];
        }
        for (uint r = 0u; r < p.k; ++r) {
            const float w = p.norm != 0u ? chosen_w[r] / s : chosen_w[r];
            route[p.k + r] = w;
            log_[p.log_offset + p.n_expert + p.k + r] = w;
        }
        if (p.has_shared != 0u) {
            const float g = 1.0 / (1.0 + exp(-shared_logit[0]));
            route[2u * p.k] = g;
            log_[p.log_offset + p.n_expert + 2u * p.k] = g;
        }
    }
}
