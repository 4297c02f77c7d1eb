#version 450
#extension GL_EXT_control_flow_attributes : require
// Attention of a prompt chunk's tokens, flash-attention style: a workgroup per query head and
// tile of BQ consecutive tokens walks the keys of positions 0..=the tile's last in tiles of BKV,
// each tile of f16 keys and values read into shared memory once for all BQ queries (the decode
// kernel, attention.comp, reads them once per token). The softmax is online: per query a running
// maximum m and sum l, the output rescaled by exp(m_old - m_new) when the maximum grows. Causal:
// token t attends to positions 0..=its own (all the cache holds when that is past it). Rounding as attention.comp: queries to f16, f32 scores and
// probabilities, f16 keys and values; the sums run in another order. Positions as attention.comp
// reads them: token t's is word `step_index + 2t` of the step buffer and its sequence's first
// cache row word `step_index + 2t + 1`; the tokens of a tile must be consecutive positions of one
// sequence (a prompt's), so that they share its keys.

#define WG 128u
#define BQ 16u
#define BKV 32u
layout(local_size_x = 128) in;
// A power of two from 8 to 128 (the host checks), so that it divides WG.
layout(constant_id = 0) const uint HEAD_DIM = 128u;

layout(std430, binding = 0) readonly buffer Q { float q[]; };
layout(std430, binding = 1) readonly buffer KCache { uint k_cache[]; };
layout(std430, binding = 2) readonly buffer VCache { uint v_cache[]; };
layout(std430, binding = 3) readonly buffer Step { uint step[]; };
layout(std430, binding = 4) writeonly buffer Out { float dst[]; };

layout(push_constant) uniform Params {
    uint head_dim;  // HEAD_DIM
    uint kv_width;  // halves per cache row
    uint group;     // query heads per KV head
    uint capacity;  // positions the caches hold
    float scale;
    uint step_index;
    uint n_tok;     // tokens of the chunk
} p;

const uint KP = HEAD_DIM + 1u; // key rows padded against bank conflicts
shared float qs[BQ * HEAD_DIM];
shared float ks[BKV * KP];
shared float vs[BKV * HEAD_DIM];
shared float ps[BQ * BKV];
shared float m_s[BQ];
shared float l_s[BQ];
shared float alpha_s[BQ];
shared float red[WG];

float round_f16(float v) {
    return unpackHalf2x16(packHalf2x16(vec2(v, 0.0))).x;
}

void main() {
    const uint h = gl_WorkGroupID.x;
    const uint tq0 = gl_WorkGroupID.y * BQ;
    const uint n_heads = gl_NumWorkGroups.x;
    const uint tid = gl_LocalInvocationID.x;
    const uint kv_off = (h / p.group) * HEAD_DIM; // in halves, within a cache row
    const uint rows = min(BQ, p.n_tok - tq0);
    // The tile's sequence's first cache row, and the last position any query of it attends to.
    const uint seq_row = step[p.step_index + 2u * tq0 + 1u];
    const uint last = min(step[p.step_index + 2u * (tq0 + rows - 1u)], p.capacity - 1u);

    for (uint e = tid; e < BQ * HEAD_DIM; e += WG) {
        const uint r = e / HEAD_DIM, d = e % HEAD_DIM;
        qs[e] = r < rows ? round_f16(q[((tq0 + r) * n_heads + h) * HEAD_DIM + d]) : 0.0;
    }
    if (tid < BQ) {
        m_s[tid] = uintBitsToFloat(0xFF800000u); // -inf
        l_s[tid] = 0.0;
    }
    // Scores: invocation tid has query row tid / 8 and key columns tid % 8 + 8j.
    const uint sr = tid / 8u;
    // Outputs: invocation tid has dimension tid % HEAD_DIM of RPT query rows.
    const uint RPT = BQ * HEAD_DIM / WG;
    const uint od = tid % HEAD_DIM;
    const uint or0 = tid / HEAD_DIM;
    const uint ROW_STEP = WG / HEAD_DIM;
    float o[BQ];
    [[unroll]] for (uint i = 0u; i < BQ; ++i) {
        o[i] = 0.0;
    }
    // Query row r attends to positions 0..=limit(r).
    const uint limit = min(step[p.step_index + 2u * (tq0 + min(sr, rows - 1u))], p.capacity - 1u);

    for (uint k0 = 0u; k0 <= last; k0 += BKV) {
        barrier(); // the previous tile's keys, values and probabilities are used
        for (uint w = tid; w < BKV * HEAD_DIM / 2u; w += WG) {
            const uint c = w / (HEAD_DIM / 2u), d = 2u * (w % (HEAD_DIM / 2u));
            vec2 kk = vec2(0.0), vv = vec2(0.0);
            if (k0 + c <= last) {
                const uint at = ((seq_row + k0 + c) * p.kv_width + kv_off + d) / 2u;
                kk = unpackHalf2x16(k_cache[at]);
                vv = unpackHalf2x16(v_cache[at]);
            }
            ks[c * KP + d] = kk.x;
            ks[c * KP + d + 1u] = kk.y;
            vs[c * HEAD_DIM + d] = vv.x;
            vs[c * HEAD_DIM + d + 1u] = vv.y;
        }
        barrier();
        // Scores of row sr, columns tid % 8 + 8j: each query element read once for the four.
        float sc[BKV / 8u];
        [[unroll]] for (uint j = 0u; j < BKV / 8u; ++j) {
            sc[j] = 0.0;
        }
        for (uint d = 0u; d < HEAD_DIM; d += 2u) {
            const float q0 = qs[sr * HEAD_DIM + d], q1 = qs[sr * HEAD_DIM + d + 1u];
            [[unroll]] for (uint j = 0u; j < BKV / 8u; ++j) {
                const uint c = tid % 8u + 8u * j;
                sc[j] += q0 * ks[c * KP + d] + q1 * ks[c * KP + d + 1u];
            }
        }
        float mx_own = uintBitsToFloat(0xFF800000u);
        [[unroll]] for (uint j = 0u; j < BKV / 8u; ++j) {
            const uint c = tid % 8u + 8u * j;
            sc[j] = k0 + c <= limit && sr < rows ? sc[j] * p.scale : uintBitsToFloat(0xFF800000u);
            mx_own = max(mx_own, sc[j]);
        }
        // The row's maximum and sum over its eight invocations, through shared memory.
        red[tid] = mx_own;
        barrier();
        const float m_old = m_s[sr];
        float mx = m_old;
        [[unroll]] for (uint i = 0u; i < 8u; ++i) {
            mx = max(mx, red[sr * 8u + i]);
        }
        float sum_own = 0.0;
        [[unroll]] for (uint j = 0u; j < BKV / 8u; ++j) {
            const uint c = tid % 8u + 8u * j;
            // A row with nothing to attend to yet (-inf everywhere) keeps its zeros.
            const float e = sc[j] == uintBitsToFloat(0xFF800000u) ? 0.0 : exp(sc[j] - mx);
            ps[sr * BKV + c] = e;
            sum_own += e;
        }
        barrier(); // every maximum read
        red[tid] = sum_own;
        barrier();
        if (tid % 8u == 0u) {
            float sum = 0.0;
            [[unroll]] for (uint i = 0u; i < 8u; ++i) {
                sum += red[sr * 8u + i];
            }
            const float a = mx == m_old ? 1.0 : exp(m_old - mx);
            alpha_s[sr] = a;
            m_s[sr] = mx;
            l_s[sr] = l_s[sr] * a + sum;
        }
        barrier();
        // Unrolled to BQ with RPT a constant once specialized: `o` stays in registers; each
        // value read once for all of the invocation's rows.
        [[unroll]] for (uint i = 0u; i < BQ; ++i) {
            if (i < RPT) {
                o[i] *= alpha_s[or0 + i * ROW_STEP];
            }
        }
        for (uint c = 0u; c < BKV; ++c) {
            const float v = vs[c * HEAD_DIM + od];
            [[unroll]] for (uint i = 0u; i < BQ; ++i) {
                if (i < RPT) {
                    o[i] += ps[(or0 + i * ROW_STEP) * BKV + c] * v;
                }
            }
        }
    }
    barrier();
    [[unroll]] for (uint i = 0u; i < BQ; ++i) {
        const uint r = or0 + i * ROW_STEP;
        if (i < RPT && r < rows) {
            dst[((tq0 + r) * n_heads + h) * HEAD_DIM + od] = o[i] / l_s[r];
        }
    }
}
