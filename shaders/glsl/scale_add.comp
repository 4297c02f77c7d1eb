#version 450
// a += scale * b over `n` values: one routed expert's output added to the residual with its
// router weight (the weight is chosen on the host, so it comes as a push constant).

layout(local_size_x = 256) in;

layout(std430, binding = 0) buffer A { float a[]; };
layout(std430, binding = 1) readonly buffer B { float b[]; };

layout(push_constant) uniform Params {
    uint n;
    float scale;
} p;

void main() {
    const uint i = gl_GlobalInvocationID.x;
    if (i >= p.n) {
        return;
    }
    // Rounded as the CPU rounds it: the product, then the sum (no fused multiply-add).
    precise float t = p.scale * b[i];
    a[i] = a[i] + t;
}
