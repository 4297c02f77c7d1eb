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
//
// With ROUTER the router's product is in the same dispatch: workgroup r computes logit r, the
// dot of the F32 router row r with RMSNorm(x) times `norm_w`, writes it to `logits` and counts it
// done in `done[0]` (zero before the dispatch); the workgroup that counts last, seeing every
// logit, routes as above and sets the counter back to zero. One dependent dispatch fewer than a
// product and a routing. No shared expert with it.
//
// With `host_at` non-zero, some experts are not in VRAM (a model over its VRAM budget): expert
// i's slot is `slot_of[map_offset + i]` (0xFFFFFFFF where it has none). Entry r of `route` then
// holds the chosen expert's slot, or 0xFFFFFFFF where it has none, and entry `host_at + r` the
// expert itself where it has no slot, else 0xFFFFFFFF: the expert-indexed products run the first
// list on the VRAM slot stacks and the second on stacks in host memory, each leaving the other's
// entries empty. The log still gets the experts.
//
// With CHUNK, every token of a prompt chunk at once, one workgroup each (grid x): token t's
// logits are `logits[t * n_expert..]`, its k ids and k weights go to `route[t * 2k..]`, and
// nothing goes to the log (`moe_sort.comp` then lays the chunk's entries out by expert). No
// shared expert with it. With a slot map as well (a batched decode step's experts by entry),
// `host_at` is 2k and counts from the token's block, which is 3k words: its slots, its weights,
// then the experts without a slot.

#define WG 256u
layout(local_size_x = 256) in;

#if defined(ROUTER)
// Written by every workgroup, read by the last: coherent.
layout(std430, binding = 0) coherent buffer Logits { float logits[]; };
#else
layout(std430, binding = 0) readonly buffer Logits { float logits[]; };
#endif
layout(std430, binding = 1) readonly buffer SharedLogit { float shared_logit[]; };
layout(std430, binding = 2) writeonly buffer Route { float route[]; };
layout(std430, binding = 3) writeonly buffer Log { float log_[]; };
#if defined(ROUTER)
layout(std430, binding = 4) readonly buffer Router { vec4 router4[]; };
layout(std430, binding = 5) readonly buffer X { vec4 x4[]; };
layout(std430, binding = 6) readonly buffer NormW { vec4 norm_w4[]; };
layout(std430, binding = 7) coherent buffer Done { uint done[]; };
layout(std430, binding = 8) readonly buffer SlotOf { uint slot_of[]; };
#else
layout(std430, binding = 4) readonly buffer SlotOf { uint slot_of[]; };
#endif

layout(push_constant) uniform Params {
    uint n_expert;
    uint k;
    uint norm;       // 1: weights divided by their sum (Mixtral, Qwen3-MoE)
    uint has_shared; // 1: write the shared expert's gate at route[2k]
    uint log_offset;
    uint host_at;    // 0: every expert in VRAM; else where the host-memory list starts
    uint map_offset; // index in `slot_of` of expert 0's slot (with host_at)
#if defined(ROUTER)
    uint n_in;       // the router's width, a multiple of 4
    float eps;       // RMSNorm's
#endif
} p;

#include "reduce.glsl"

shared float vals[WG];
shared float chosen_w[WG];
#if defined(ROUTER)
shared bool last_row;
#endif

void main() {
    const uint i = gl_LocalInvocationID.x;
#if defined(ROUTER)
    {
        const uint r = gl_WorkGroupID.x;
        const uint n4 = p.n_in / 4u;
        float acc = 0.0, ss = 0.0;
        for (uint c = i; c < n4; c += WG) {
            const vec4 xv = x4[c];
            ss += dot(xv, xv);
            acc += dot(xv * norm_w4[c], router4[r * n4 + c]);
        }
        acc = wg_sum(acc);
        ss = wg_sum(ss);
        if (i == 0u) {
            logits[r] = acc * (1.0 / sqrt(ss / float(p.n_in) + p.eps));
        }
        memoryBarrierBuffer();
        barrier();
        if (i == 0u) {
            last_row = atomicAdd(done[0], 1u) + 1u == p.n_expert;
            if (last_row) {
                atomicExchange(done[0], 0u);
            }
        }
        barrier();
        if (!last_row) {
            return;
        }
        memoryBarrierBuffer();
    }
#endif
#if defined(CHUNK)
    const uint lbase = gl_WorkGroupID.x * p.n_expert;
    const uint rbase = gl_WorkGroupID.x * (p.host_at != 0u ? p.host_at + p.k : 2u * p.k);
#else
    const uint lbase = 0u, rbase = 0u;
#endif
    const bool live = i < p.n_expert;
    const float l = live ? logits[lbase + i] : uintBitsToFloat(0xFF800000u);
    const float m = wg_max(l);
    // The host's softmax computes the same difference (one correctly rounded subtraction);
    // ordering by it, two logits that round to one difference tie there and here alike.
    const float d = live ? l - m : uintBitsToFloat(0xFF800000u);
    vals[i] = d;
    const float e = live ? exp(d) : 0.0;
    const float sum = wg_sum(e); // contains barriers: `vals` is complete after it
    const float prob = e * (1.0 / sum);
    if (live) {
#if !defined(CHUNK)
        log_[p.log_offset + i] = l;
#endif
        uint rank = 0u;
        for (uint j = 0u; j < p.n_expert; ++j) {
            const float o = vals[j];
            rank += (o > d || (o == d && j < i)) ? 1u : 0u;
        }
        if (rank < p.k) {
            uint id = i;
            if (p.host_at != 0u) {
                const uint slot = slot_of[p.map_offset + i];
                route[rbase + p.host_at + rank] =
                    uintBitsToFloat(slot == 0xFFFFFFFFu ? i : 0xFFFFFFFFu);
                id = slot;
            }
            route[rbase + rank] = uintBitsToFloat(id);
#if !defined(CHUNK)
            log_[p.log_offset + p.n_expert + rank] = uintBitsToFloat(i);
#endif
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
            route[rbase + p.k + r] = w;
#if !defined(CHUNK)
            log_[p.log_offset + p.n_expert + p.k + r] = w;
#endif
        }
        if (p.has_shared != 0u) {
            const float g = 1.0 / (1.0 + exp(-shared_logit[0]));
            route[2u * p.k] = g;
            log_[p.log_offset + p.n_expert + 2u * p.k] = g;
        }
    }
}
