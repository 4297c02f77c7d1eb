#version 450
// a += scale * b over `n` values: one routed expert's output added to the residual with its
// router weight (the weight is chosen on the host, so it comes as a push constant).
//
// With ROUTED the weights were chosen on the device (`moe_route.comp`): for r in 0..count,
// a += route[first + r] * b[r * b_stride + i], one term after another as the host adds experts;
// terms of weight zero are skipped (their experts may not have been computed).

layout(local_size_x = 256) in;

layout(std430, binding = 0) buffer A { float a[]; };
layout(std430, binding = 1) readonly buffer B { float b[]; };
#if defined(ROUTED)
layout(std430, binding = 2) readonly buffer Route { float route[]; };

layout(push_constant) uniform Params {
    uint n;
    uint first;
    uint count;
    uint b_stride;
} p;
#else
layout(push_constant) uniform Params {
    uint n;
    float scale;
} p;
#endif

void main() {
    const uint i = gl_GlobalInvocationID.x;
    if (i >= p.n) {
        return;
    }
    // Rounded as the CPU rounds it: the product, then the sum (no fused multiply-add).
#if defined(ROUTED)
    precise float acc = a[i];
    for (uint r = 0u; r < p.count; ++r) {
        // A zero weight adds nothing: its expert may not have been computed (an empty entry).
        const float w = route[p.first + r];
        if (w != 0.0) {
            precise float t = w * b[r * p.b_stride + i];
            acc = acc + t;
        }
    }
    a[i] = acc;
#else
    precise float t = p.scale * b[i];
    a[i] = a[i] + t;
#endif
}
