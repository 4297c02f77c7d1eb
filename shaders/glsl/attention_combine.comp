#version 450
// Joins the runs of `attention.comp` (flash decoding's second step): for each query head, with M
// the largest of the runs' maxima, out = Σ_r exp(m_r - M) o_r / Σ_r exp(m_r - M) l_r over the runs
// that hold positions (0..=pos, pos read from the step buffer). One workgroup per head; a
// prompt's tokens are the workgroup rows (y), token t at the position plus t.

#define WG 64u
layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Part { float part[]; };
layout(std430, binding = 1) writeonly buffer Out { float dst[]; };
layout(std430, binding = 2) readonly buffer Step { uint step[]; };

layout(push_constant) uniform Params {
    uint head_dim;
    uint kv_width;  // unused: the push block is attention.comp's
    uint group;     // unused
    uint capacity;
    float scale;    // unused
    uint step_index;
} p;

// attention.comp's run length.
#define SPLIT 128u

void main() {
    const uint h = gl_WorkGroupID.x;
    const uint tok = gl_WorkGroupID.y;
    const uint head = tok * gl_NumWorkGroups.x + h; // (token, head) pairs, token-major
    const uint n_splits = (p.capacity + SPLIT - 1u) / SPLIT;
    const uint n_kv = min(step[p.step_index] + tok + 1u, p.capacity);
    const uint runs = (n_kv + SPLIT - 1u) / SPLIT;
    const uint stride = p.head_dim + 2u;
    const uint base = head * n_splits * stride;
    float big = uintBitsToFloat(0xFF800000u);
    for (uint r = 0u; r < runs; ++r) {
        big = max(big, part[base + r * stride + p.head_dim]);
    }
    float l = 0.0;
    for (uint r = 0u; r < runs; ++r) {
        const uint at = base + r * stride + p.head_dim;
        l += exp(part[at] - big) * part[at + 1u];
    }
    const float inv = 1.0 / l;
    for (uint d = gl_LocalInvocationID.x; d < p.head_dim; d += WG) {
        float acc = 0.0;
        for (uint r = 0u; r < runs; ++r) {
            const uint at = base + r * stride;
            acc += exp(part[at + p.head_dim] - big) * part[at + d];
        }
        dst[head * p.head_dim + d] = acc * inv;
    }
}
