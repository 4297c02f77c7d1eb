#version 450
// Appends one token's K and V (f32) to the f16 caches at its position, read on the device from
// word `step_index` of the step buffer, past the first row of its sequence (word
// `step_index + 1`): invocation i packs values 2i and 2i + 1 into one word. The caches are
// `capacity` rows of `kv_width` halves; a row past them stores nothing.

layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer K { float k[]; };
layout(std430, binding = 1) readonly buffer V { float v[]; };
layout(std430, binding = 2) writeonly buffer KCache { uint k_cache[]; };
layout(std430, binding = 3) writeonly buffer VCache { uint v_cache[]; };
layout(std430, binding = 4) readonly buffer Step { uint step[]; };

layout(push_constant) uniform Params {
    uint kv_width; // even
    uint capacity;
    uint step_index;
} p;

void main() {
    const uint i = gl_GlobalInvocationID.x;
    const uint row = step[p.step_index + 1u] + step[p.step_index];
    if (i >= p.kv_width / 2u || row >= p.capacity) {
        return;
    }
    const uint at = row * (p.kv_width / 2u) + i;
    k_cache[at] = packHalf2x16(vec2(k[2u * i], k[2u * i + 1u]));
    v_cache[at] = packHalf2x16(vec2(v[2u * i], v[2u * i + 1u]));
}
