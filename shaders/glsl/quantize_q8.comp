#version 450
#extension GL_EXT_control_flow_attributes : require
// Quantizes `n_vec` input vectors of `n_in` floats (`x_stride` floats apart) into blocks of 8-bit
// integers for the integer-dot-product kernels (`matvec.comp` with Q8_IN), one workgroup a
// vector: a decode step's products then read 48 bytes a block of 32 inputs, quantized once,
// instead of each workgroup loading 128 bytes of floats and quantizing them again. With NORM
// the blocks are of x times the RMSNorm weights and the header holds Σ x², from which the
// product scales its sums, as `matvec.comp` does when it quantizes in place.

layout(local_size_x = 128) in;
layout(constant_id = 0) const uint NORM = 0u;

layout(std430, binding = 0) readonly buffer X { vec4 x4[]; };
layout(std430, binding = 1) writeonly buffer Q { uvec4 q[]; };
// With NORM, the RMSNorm weights; otherwise unused (the host binds x in its place).
layout(std430, binding = 2) readonly buffer NormW { vec4 norm_w4[]; };

layout(push_constant) uniform Params {
    uint n_in;     // a multiple of 32
    uint n_vec;
    uint x_stride; // floats from one vector to the next (a multiple of 4)
    uint q_stride; // 16-byte units from one quantized vector to the next
} p;

#include "quant_q8.glsl"

shared float red[128];

void main() {
    const uint vec_ = gl_WorkGroupID.x;
    if (vec_ >= p.n_vec) {
        return; // the whole workgroup
    }
    const uint tid = gl_LocalInvocationID.x;
    const uint x0 = (vec_ * p.x_stride) >> 2;
    const uint q0 = vec_ * p.q_stride;
    float ss = 0.0;
    for (uint b = tid; b < p.n_in / 32u; b += 128u) {
        vec4 v[8];
        [[unroll]] for (uint k = 0u; k < 8u; ++k) {
            v[k] = x4[x0 + 8u * b + k];
            if (NORM != 0u) {
                ss += dot(v[k], v[k]);
                v[k] *= norm_w4[8u * b + k];
            }
        }
        const Q8Block qb = quantize_block(v);
        const uint at = q0 + 1u + 3u * b;
        q[at] = uvec4(qb.q[0], qb.q[1], qb.q[2], qb.q[3]);
        q[at + 1u] = uvec4(qb.q[4], qb.q[5], qb.q[6], qb.q[7]);
        q[at + 2u] = uvec4(floatBitsToUint(qb.d), uint(qb.sum), 0u, 0u);
    }
    if (NORM == 0u) {
        return;
    }
    red[tid] = ss;
    barrier();
    for (uint s = 64u; s > 0u; s >>= 1) {
        if (tid < s) {
            red[tid] += red[tid + s];
        }
        barrier();
    }
    if (tid == 0u) {
        q[q0] = uvec4(floatBitsToUint(red[0]), 0u, 0u, 0u);
    }
}
