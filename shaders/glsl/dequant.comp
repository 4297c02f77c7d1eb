#version 450
// Dequantizes `n_blocks` blocks of one weight type to f32: one invocation per block.
// Weight type chosen by a define from the variant table (WTYPE_F16, WTYPE_Q8_0, WTYPE_Q4_0).

layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
layout(std430, binding = 1) writeonly buffer Output { float dst[]; };

layout(push_constant) uniform Params {
    uint n_blocks;
    uint src_offset; // byte offset of the first block in `weights`
    uint dst_offset; // element offset in `dst`
} p;

#include "common.glsl"

void main() {
    const uint b = gl_GlobalInvocationID.x;
    if (b >= p.n_blocks) {
        return;
    }
#if defined(WTYPE_F16)
    dst[p.dst_offset + b] = load_f16(p.src_offset + 2u * b);
#elif defined(WTYPE_Q8_0)
    const uint base = p.src_offset + 34u * b;
    const float d = load_f16(base);
    for (uint i = 0u; i < 32u; ++i) {
        dst[p.dst_offset + 32u * b + i] = float(load_i8(base + 2u + i)) * d;
    }
#elif defined(WTYPE_Q4_0)
    const uint base = p.src_offset + 18u * b;
    const float d = load_f16(base);
    for (uint i = 0u; i < 16u; ++i) {
        const uint q = load_u8(base + 2u + i);
        dst[p.dst_offset + 32u * b + i] = float(int(q & 0xFu) - 8) * d;
        dst[p.dst_offset + 32u * b + i + 16u] = float(int(q >> 4) - 8) * d;
    }
#else
#error "dequant.comp needs a WTYPE_* define"
#endif
}
