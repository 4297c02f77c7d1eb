#version 450
// Element-wise ops on `n` values, in place on `a`: ADD (a += b, residuals and biases; b repeats
// every `b_len` values) or
// SWIGLU (a = silu(a) * b, with a the gate and b the up projection).

layout(local_size_x = 256) in;

layout(std430, binding = 0) buffer A { float a[]; };
layout(std430, binding = 1) readonly buffer B { float b[]; };

layout(push_constant) uniform Params {
    uint n;
    uint b_len; // ADD: b's length, repeated over a (a bias for each token)
} p;

void main() {
    const uint i = gl_GlobalInvocationID.x;
    if (i >= p.n) {
        return;
    }
#if defined(OP_ADD)
    a[i] = a[i] + b[i % p.b_len];
#elif defined(OP_SWIGLU)
    const float g = a[i];
    a[i] = (g / (1.0 + exp(-g))) * b[i];
#else
#error "eltwise.comp needs OP_ADD or OP_SWIGLU"
#endif
}
