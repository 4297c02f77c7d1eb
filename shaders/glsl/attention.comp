#version 450
#extension GL_EXT_control_flow_attributes : require
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// Attention of one new token over the f16 KV cache, split over positions (flash decoding): a
// workgroup per query head and run of SPLIT positions (GQA: head h reads KV head h / group). As
// the CPU engine, Q is rounded to f16 and dotted with the f16 keys and scaled; each workgroup then
// takes its run's maximum m, its exponentials e_t = exp(s_t - m) (kept in shared memory), their sum
// l, and o = Σ e_t v_t, and writes (o, m, l) to `part`. The runs are joined in the same dispatch
// (flash decoding's second step): each workgroup counts its run done in `done` (one counter per
// token and head, zero before the dispatch), and the head's last run to finish, seeing every other
// run's part, writes out = Σ_r exp(m_r - M) o_r / Σ_r exp(m_r - M) l_r, M the largest m_r, and
// sets the counter back to zero for the next dispatch. No second dispatch waits on the first.
// Unlike the CPU engine the probabilities stay f32: they are not rounded to f16 before weighing
// the values. The new token's position is read on the device, from word `step_index` of the step
// buffer (positions 0..=pos attend, at most `capacity`), so a recorded step can be replayed at
// each position; runs past the position leave at once. Its sequence's positions start at the
// cache row of word `step_index + 1` (one cache holds several sequences, one after another).
// Several tokens are the workgroup layers (z): token t's position and first row are words
// `step_index + 2t` and `+ 2t + 1`, its query and its partial results follow token t - 1's. They
// may be a prompt's tokens or one token of each of several sequences (a batched decode step).

#define WG 128u
#define SPLIT 128u
layout(local_size_x = 128) in;
// The head size is a specialization constant (a multiple of 8, at most 512), so the loops over a
// key are unrolled and its 16-byte loads are all in flight at once instead of one after another.
layout(constant_id = 0) const uint HEAD_DIM = 128u;

layout(std430, binding = 0) readonly buffer Q { float q[]; };
#if defined(ROPE_IN)
// The new token's K and V are written here (by one workgroup per KV head): not read-only.
layout(std430, binding = 1) buffer KCache { uvec4 k4[]; };
layout(std430, binding = 1) buffer KCacheWords { uint k_words[]; };
layout(std430, binding = 2) buffer VCache { uint v_cache[]; };
#else
layout(std430, binding = 1) readonly buffer KCache { uvec4 k4[]; };
layout(std430, binding = 2) readonly buffer VCache { uint v_cache[]; };
#endif
// The same V cache as 16-byte units: eight halves of a head's row a load.
layout(std430, binding = 2) readonly buffer VCache4 { uvec4 v4[]; };
// Read back by the head's last run: coherent, so the reads see other workgroups' writes.
layout(std430, binding = 3) coherent buffer Part { float part[]; };
layout(std430, binding = 4) readonly buffer Step { uint step[]; };
layout(std430, binding = 5) writeonly buffer Out { float dst[]; };
layout(std430, binding = 6) coherent buffer Done { uint done[]; };

#if defined(ROPE_IN)
layout(std430, binding = 7) readonly buffer KNew { float k_new[]; };
layout(std430, binding = 8) readonly buffer VNew { float v_new[]; };
layout(std430, binding = 9) readonly buffer QNorm { float q_norm[]; };
layout(std430, binding = 10) readonly buffer KNorm { float k_norm[]; };
layout(std430, binding = 11) readonly buffer Table { float table[]; };
#endif

layout(push_constant) uniform Params {
    uint head_dim;  // HEAD_DIM
    uint kv_width;  // halves per cache row
    uint group;     // query heads per KV head
    uint capacity;  // positions the caches hold
    float scale;
    uint step_index;
#if defined(ROPE_IN)
    uint n_rot;     // rotated dimensions of a head
    uint n_pos;     // positions in the angle table
    float eps;      // the QK-norm's
    uint qk_norm;   // 1: RMSNorm each head with q_norm / k_norm first
#endif
} p;

#include "reduce.glsl"

shared float qh[HEAD_DIM];
shared float e[SPLIT];
// Σ_j e_j v_j of each group of positions (at most 8 · WG floats: groups · HEAD_DIM).
shared float vsum[8u * WG];
shared bool last_run;

float round_f16(float v) {
    return unpackHalf2x16(packHalf2x16(vec2(v, 0.0))).x;
}

#if defined(ROPE_IN)
// With ROPE_IN (one token: decode) the kernel takes Q, K and V as the products wrote them and
// does what `rope.comp` does before it: the QK-norm of each head, RoPE at the position (pairs
// adjacent, or halves with ROPE_NEOX), and the KV-cache append. Every workgroup ropes its query
// head; the workgroups of the run that holds the new position also rope their KV head's new key,
// in the same steps as the query (one load, one norm, one pass over the angles), and take the
// new key and value from registers rather than from the cache, which the first query head of
// each KV head writes in the same dispatch (no workgroup reads that row). One dependent dispatch
// fewer a layer than RoPE, then attention.
shared float kh[HEAD_DIM];

#if defined(ROPE_NEOX)
#define ROPE_A(i) (i)
#define ROPE_B(i) ((i) + half_rot)
#else
#define ROPE_A(i) (2u * (i))
#define ROPE_B(i) (2u * (i) + 1u)
#endif

// Rotates the pair of `h` (qh or kh) for angle i: (x_a, x_b) by (c, sn).
#define ROTATE(H, i, c, sn)                                                                     \
    {                                                                                           \
        const uint a = ROPE_A(i), b = ROPE_B(i);                                                \
        const float x0 = H[a], x1 = H[b];                                                       \
        H[a] = x0 * c - x1 * sn;                                                                \
        H[b] = x0 * sn + x1 * c;                                                                \
    }

// The query head at `q_base` of q into qh and, where `fresh`, the new key at `k_base` of k_new
// into kh: QK-normed, roped at `pos` and rounded to f16 as the cache and the query are.
// Uniform control flow (`fresh` is the workgroup's).
void rope_heads(uint q_base, uint k_base, bool fresh, uint pos) {
    const uint tid = gl_LocalInvocationID.x;
    const uint half_rot = p.n_rot / 2u;
    const uint at = min(pos, p.n_pos - 1u);
    // This invocation's first angle, loaded beside the heads.
    const uint first = (at * half_rot + min(tid, max(half_rot, 1u) - 1u)) * 2u;
    const float c0 = half_rot > 0u ? table[first] : 1.0;
    const float sn0 = half_rot > 0u ? table[first + 1u] : 0.0;
    float sq = 0.0, sk = 0.0;
    for (uint d = tid; d < HEAD_DIM; d += WG) {
        const float v = q[q_base + d];
        qh[d] = v;
        sq += v * v;
        if (fresh) {
            const float k = k_new[k_base + d];
            kh[d] = k;
            sk += k * k;
        }
    }
    if (p.qk_norm != 0u) {
        const float q_scale = 1.0 / sqrt(wg_sum(sq) / float(HEAD_DIM) + p.eps);
        const float k_scale = fresh ? 1.0 / sqrt(wg_sum(sk) / float(HEAD_DIM) + p.eps) : 0.0;
        for (uint d = tid; d < HEAD_DIM; d += WG) {
            qh[d] = (qh[d] * q_scale) * q_norm[d];
            if (fresh) {
                kh[d] = (kh[d] * k_scale) * k_norm[d];
            }
        }
    }
    barrier();
    for (uint i = tid; i < half_rot; i += WG) {
        const float c = i == tid ? c0 : table[(at * half_rot + i) * 2u];
        const float sn = i == tid ? sn0 : table[(at * half_rot + i) * 2u + 1u];
        ROTATE(qh, i, c, sn)
        if (fresh) {
            ROTATE(kh, i, c, sn)
        }
    }
    barrier();
    for (uint d = tid; d < HEAD_DIM; d += WG) {
        qh[d] = round_f16(qh[d]);
        if (fresh) {
            kh[d] = round_f16(kh[d]);
        }
    }
    barrier();
}
#endif

// Output dimension d of the run before its scale: the groups' sums of e_j v_j, and where
// `fresh` the new position's e times its value.
float v_out(uint d, uint groups, uint cached, bool fresh, uint kv_off) {
    float acc = 0.0;
    for (uint g = 0u; g < groups; ++g) {
        acc += vsum[g * HEAD_DIM + d];
    }
#if defined(ROPE_IN)
    if (fresh) {
        acc += e[cached] * round_f16(v_new[kv_off + d]);
    }
#endif
    return acc;
}

void main() {
    const uint h = gl_WorkGroupID.x;
    const uint split = gl_WorkGroupID.y;
    const uint tok = gl_WorkGroupID.z;
    const uint n_heads = gl_NumWorkGroups.x;
    const uint n_splits = (p.capacity + SPLIT - 1u) / SPLIT;
    const uint n_kv = min(step[p.step_index + 2u * tok] + 1u, p.capacity);
    // The sequence's first row in the caches.
    const uint seq_row = step[p.step_index + 2u * tok + 1u];
    const uint t0 = split * SPLIT;
    if (t0 >= n_kv) {
        return; // the whole workgroup: its run is past the position
    }
    const uint count = min(SPLIT, n_kv - t0);
    const uint tid = gl_LocalInvocationID.x;
    const uint kv_off = (h / p.group) * HEAD_DIM; // in halves, within a cache row
#if defined(ROPE_IN)
    const uint pos = step[p.step_index];
    // This run holds the new position (the last of the positions that attend): its key and
    // value come from k_new and v_new, and the cache row is written, not read.
    const bool fresh = pos < p.capacity && t0 + count == pos + 1u;
    // Positions read from the cache.
    const uint cached = fresh ? count - 1u : count;
#else
    const bool fresh = false;
    const uint cached = count;
#endif
    // This invocation's key (position t0 + tid), loaded before the query is ready: its loads
    // are in flight while the query is normed and roped. Eight halves a load: kv_width and the
    // offset are multiples of 8 halves.
    uvec4 kw[HEAD_DIM / 8u];
    if (tid < cached) {
        const uint row = ((seq_row + t0 + tid) * p.kv_width + kv_off) / 8u;
        [[unroll]] for (uint c = 0u; c < HEAD_DIM / 8u; ++c) {
            kw[c] = k4[row + c];
        }
    }
#if defined(ROPE_IN)
    rope_heads(h * HEAD_DIM, kv_off, fresh, pos);
    if (fresh && h % p.group == 0u) {
        const uint row = ((seq_row + pos) * p.kv_width + kv_off) / 2u;
        for (uint w = tid; w < HEAD_DIM / 2u; w += WG) {
            k_words[row + w] = packHalf2x16(vec2(kh[2u * w], kh[2u * w + 1u]));
            v_cache[row + w] = packHalf2x16(vec2(v_new[kv_off + 2u * w], v_new[kv_off + 2u * w + 1u]));
        }
    }
#else
    for (uint d = tid; d < HEAD_DIM; d += WG) {
        qh[d] = round_f16(q[(tok * n_heads + h) * HEAD_DIM + d]);
    }
    barrier();
#endif

    float s = uintBitsToFloat(0xFF800000u); // -inf
#if defined(ROPE_IN)
    if (fresh) {
        // The new key's score, summed by the whole workgroup rather than by one invocation.
        float part_s = 0.0;
        for (uint d = tid; d < HEAD_DIM; d += WG) {
            part_s += qh[d] * kh[d];
        }
        const float fresh_s = wg_sum(part_s) * p.scale;
        if (tid == cached) {
            s = fresh_s;
        }
    }
#endif
    if (tid < cached) {
        // Four sums, so that the multiply-adds do not wait on one another.
        vec4 acc = vec4(0.0);
        [[unroll]] for (uint c = 0u; c < HEAD_DIM / 8u; ++c) {
            [[unroll]] for (uint w = 0u; w < 4u; ++w) {
                const vec2 kk = unpackHalf2x16(kw[c][w]);
                const uint d = 8u * c + 2u * w;
                acc[w] += qh[d] * kk.x + qh[d + 1u] * kk.y;
            }
        }
        s = ((acc.x + acc.y) + (acc.z + acc.w)) * p.scale;
    }
    const float m = wg_max(s);
    const float ex = tid < count ? exp(s - m) : 0.0;
    e[tid] = ex;
    const float l = wg_sum(ex); // its barriers also order the writes to `e` before the reads

    // Σ_j e_j v_j. An invocation takes eight dimensions (one 16-byte load of the f16 cache) of
    // every VG-th position from its group's first, four positions' loads in flight at once; the
    // VG groups' sums are then added for each dimension.
    const uint VD = HEAD_DIM / 8u;   // invocations across a head's dimensions
    const uint VG = WG / VD;         // groups of positions
    const uint vd = tid % VD, vg = tid / VD;
    if (vg < VG) {
        float acc[8] = float[8](0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
        const uint col = kv_off / 8u + vd;
        const uint row0 = seq_row + t0;
        uint j = vg;
        for (; j + 3u * VG < cached; j += 4u * VG) {
            uvec4 w[4];
            [[unroll]] for (uint u = 0u; u < 4u; ++u) {
                w[u] = v4[((row0 + j + u * VG) * p.kv_width) / 8u + col];
            }
            [[unroll]] for (uint u = 0u; u < 4u; ++u) {
                const float ej = e[j + u * VG];
                [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                    const vec2 vv = unpackHalf2x16(w[u][c]);
                    acc[2u * c] += ej * vv.x;
                    acc[2u * c + 1u] += ej * vv.y;
                }
            }
        }
        for (; j < cached; j += VG) {
            const uvec4 w = v4[((row0 + j) * p.kv_width) / 8u + col];
            const float ej = e[j];
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                const vec2 vv = unpackHalf2x16(w[c]);
                acc[2u * c] += ej * vv.x;
                acc[2u * c + 1u] += ej * vv.y;
            }
        }
        [[unroll]] for (uint i = 0u; i < 8u; ++i) {
            vsum[vg * HEAD_DIM + 8u * vd + i] = acc[i];
        }
    }
    barrier();
    const uint runs = (n_kv + SPLIT - 1u) / SPLIT;
    const uint head = tok * n_heads + h;
    if (runs == 1u) {
        // The head's only run: its output needs no join, as the join of one run would give.
        const float inv = 1.0 / l;
        for (uint d = tid; d < HEAD_DIM; d += WG) {
            dst[head * HEAD_DIM + d] = v_out(d, VG, cached, fresh, kv_off) * inv;
        }
        return;
    }
    const uint base = (head * n_splits + split) * (HEAD_DIM + 2u);
    for (uint d = tid; d < HEAD_DIM; d += WG) {
        part[base + d] = v_out(d, VG, cached, fresh, kv_off);
    }
    if (tid == 0u) {
        part[base + HEAD_DIM] = m;
        part[base + HEAD_DIM + 1u] = l;
    }

    // This run's part is written; count it. Every run of the head counts once, so the one that
    // sees `runs - 1` before it is the last, and every other part is visible to it.
    memoryBarrierBuffer();
    barrier();
    if (tid == 0u) {
        last_run = atomicAdd(done[head], 1u) + 1u == runs;
        if (last_run) {
            atomicExchange(done[head], 0u);
        }
    }
    barrier();
    if (!last_run) {
        return;
    }
    memoryBarrierBuffer();
    const uint stride = HEAD_DIM + 2u;
    const uint head_base = head * n_splits * stride;
    float big = uintBitsToFloat(0xFF800000u);
    for (uint r = 0u; r < runs; ++r) {
        big = max(big, part[head_base + r * stride + HEAD_DIM]);
    }
    float total = 0.0;
    for (uint r = 0u; r < runs; ++r) {
        const uint at = head_base + r * stride + HEAD_DIM;
        total += exp(part[at] - big) * part[at + 1u];
    }
    const float inv = 1.0 / total;
    for (uint d = tid; d < HEAD_DIM; d += WG) {
        float acc = 0.0;
        for (uint r = 0u; r < runs; ++r) {
            const uint at = head_base + r * stride;
            acc += exp(part[at + HEAD_DIM] - big) * part[at + d];
        }
        dst[head * HEAD_DIM + d] = acc * inv;
    }
}
