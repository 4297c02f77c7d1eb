// The inner products of matvec.comp, one weight type each: a row is a run of items of
// ITEM_WEIGHTS weights; `load_inputs` reads an item's inputs (and the sums of them that the
// offsets of the quantized types need) once for all rows, `dot_item` reads the item's bytes of one
// row as whole words and returns its share of the row's dot product. Needs `weights`, `weights4`
// and `xin(i)`, the i-th four inputs.
//
// Quants become floats without an int-to-float conversion (a quarter-rate instruction on NVIDIA):
// a value v of at most 23 bits or'ed into the mantissa of 2^23 is the float 2^23 + v, and one
// exact subtraction leaves v. A nibble or byte taken in place at bit 8 (or 4, 12) comes out
// multiplied by 256 (16, 4096); such products go to their own sum, scaled back once per item.
// Every step is exact but the multiply-adds, so the results are f32 rounding of the exact dot.

const float MAGIC = 8388608.0; // 2^23

// Bits 0..22 of `bits` as a float: `bits` must fit the mantissa.
float mant(uint bits) {
    return uintBitsToFloat(bits | 0x4B000000u) - MAGIC;
}

// Words of bytes [b, b + 8), b even: blocks of 18, 34 and 210 bytes start on any even byte.
uvec2 words2(uint b) {
    const uint i = b >> 2;
    const uint a0 = weights[i], a1 = weights[i + 1u];
    if ((b & 2u) == 0u) {
        return uvec2(a0, a1);
    }
    const uint a2 = weights[i + 2u];
    return uvec2((a0 >> 16) | (a1 << 16), (a1 >> 16) | (a2 << 16));
}

// Words of bytes [b, b + 16), b even.
uvec4 words4(uint b) {
    const uint i = b >> 2;
    const uvec4 a = uvec4(weights[i], weights[i + 1u], weights[i + 2u], weights[i + 3u]);
    if ((b & 2u) == 0u) {
        return a;
    }
    const uint a4 = weights[i + 4u];
    return (a >> 16) | (uvec4(a.yzw, a4) << 16);
}

// The f16 at even byte `b`.
float half_at(uint b) {
    return unpackHalf2x16(weights[b >> 2] >> ((b & 2u) * 8u)).x;
}

// Σ over a word's 8 nibbles times their inputs: low nibbles of bytes 0..3 with `lo`, high nibbles
// with `hi`. Returns (Σ lo, Σ hi) of the nibble values.
vec2 dot_nibbles(uint q, vec4 lo, vec4 hi) {
    const uint q2 = q >> 16;
    float a1 = mant(q & 0xFu) * lo.x;
    a1 = fma(mant(q2 & 0xFu), lo.z, a1);
    float a256 = mant(q & 0xF00u) * lo.y;
    a256 = fma(mant(q2 & 0xF00u), lo.w, a256);
    float a16 = mant(q & 0xF0u) * hi.x;
    a16 = fma(mant(q2 & 0xF0u), hi.z, a16);
    float a4096 = mant(q & 0xF000u) * hi.y;
    a4096 = fma(mant(q2 & 0xF000u), hi.w, a4096);
    return vec2(fma(a256, 1.0 / 256.0, a1), fma(a4096, 1.0 / 4096.0, a16 * (1.0 / 16.0)));
}

// Σ over a word's 4 unsigned bytes times their inputs.
float dot_u8(uint q, vec4 x) {
    const uint q2 = q >> 16;
    float a1 = mant(q & 0xFFu) * x.x;
    a1 = fma(mant(q2 & 0xFFu), x.z, a1);
    float a256 = mant(q & 0xFF00u) * x.y;
    a256 = fma(mant(q2 & 0xFF00u), x.w, a256);
    return fma(a256, 1.0 / 256.0, a1);
}

float vsum(vec4 v) {
    return (v.x + v.y) + (v.z + v.w);
}

#if defined(INT_DOT)
// Integer dot products (Q4_0 and Q8_0 rows): an item is a block of 32 weights, and its inputs are
// quantized as ggml's block_q8_0 (quant_q8.glsl); once per item for all rows, or, with Q8_IN, once
// per vector by `quantize_q8.comp` before the product, which then reads the blocks (the vector's
// header at 16-byte unit x0). A block's dot is then d_w d_x times an integer sum, exact, four
// products an instruction.
#define ITEM_WEIGHTS 32u
#include "quant_q8.glsl"
#define Inputs Q8Block
#if defined(Q8_IN)
Inputs load_inputs(uint x0, uint i) {
    const uint at = x0 + 1u + 3u * i;
    const uvec4 a = xq[at], b = xq[at + 1u];
    const uvec2 c = xq[at + 2u].xy;
    Inputs xi;
    xi.q = int[8](int(a.x), int(a.y), int(a.z), int(a.w), int(b.x), int(b.y), int(b.z), int(b.w));
    xi.d = uintBitsToFloat(c.x);
    xi.sum = int(c.y);
    return xi;
}
#else
Inputs load_inputs(uint x0, uint i) {
    const uint at = (x0 >> 2) + 8u * i;
    vec4 v[8];
    [[unroll]] for (uint k = 0u; k < 8u; ++k) {
        v[k] = xin(at + k);
    }
    return quantize_block(v);
}
#endif
#endif

#if defined(WTYPE_F32)
// MoE routers stay F32 (llama.cpp never quantizes them). Item: 4 weights, one 16-byte load.
#define ITEM_WEIGHTS 4u
uint row_bytes(uint n) { return 4u * n; }
struct Inputs { vec4 x; };
Inputs load_inputs(uint x0, uint i) {
    return Inputs(xin((x0 >> 2) + i));
}
float dot_item(uint row, uint i, Inputs xi) {
    return dot(uintBitsToFloat(weights4[(row >> 4) + i]), xi.x);
}

#elif defined(WTYPE_Q4_0) && defined(INT_DOT)
// block_q4_0 times the quantized inputs: d_w d_x Σ (n_j - 8) q_j.
uint row_bytes(uint n) { return (n / 32u) * 18u; }
float dot_item(uint row, uint i, Inputs xi) {
    const uint base = row + 18u * i;
    const uvec4 q = words4(base + 2u);
    const uint m = 0x0F0F0F0Fu;
    // Bytes 4c..4c+3 hold weights 4c.. (low nibbles) and 16 + 4c.. (high nibbles).
    int s = dotPacked4x8EXT(int(q.x & m), xi.q[0]);
    s += dotPacked4x8EXT(int(q.y & m), xi.q[1]);
    s += dotPacked4x8EXT(int(q.z & m), xi.q[2]);
    s += dotPacked4x8EXT(int(q.w & m), xi.q[3]);
    s += dotPacked4x8EXT(int((q.x >> 4) & m), xi.q[4]);
    s += dotPacked4x8EXT(int((q.y >> 4) & m), xi.q[5]);
    s += dotPacked4x8EXT(int((q.z >> 4) & m), xi.q[6]);
    s += dotPacked4x8EXT(int((q.w >> 4) & m), xi.q[7]);
    return (half_at(base) * xi.d) * float(s - 8 * xi.sum);
}

#elif defined(WTYPE_Q8_0) && defined(INT_DOT)
// block_q8_0 (f16 d, 32 signed bytes) times the quantized inputs: d_w d_x Σ w_j q_j.
uint row_bytes(uint n) { return (n / 32u) * 34u; }
float dot_item(uint row, uint i, Inputs xi) {
    const uint base = row + 34u * i;
    const uvec4 a = words4(base + 2u);
    const uvec4 b = words4(base + 18u);
    int s = dotPacked4x8EXT(int(a.x), xi.q[0]);
    s += dotPacked4x8EXT(int(a.y), xi.q[1]);
    s += dotPacked4x8EXT(int(a.z), xi.q[2]);
    s += dotPacked4x8EXT(int(a.w), xi.q[3]);
    s += dotPacked4x8EXT(int(b.x), xi.q[4]);
    s += dotPacked4x8EXT(int(b.y), xi.q[5]);
    s += dotPacked4x8EXT(int(b.z), xi.q[6]);
    s += dotPacked4x8EXT(int(b.w), xi.q[7]);
    return (half_at(base) * xi.d) * float(s);
}

#elif defined(WTYPE_F16)
// Item: 8 halves, one 16-byte load.
#define ITEM_WEIGHTS 8u
uint row_bytes(uint n) { return 2u * n; }
struct Inputs { vec4 a; vec4 b; };
Inputs load_inputs(uint x0, uint i) {
    const uint at = (x0 >> 2) + 2u * i;
    return Inputs(xin(at), xin(at + 1u));
}
float dot_item(uint row, uint i, Inputs xi) {
    const uvec4 w = weights4[(row >> 4) + i];
    const vec4 a = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
    const vec4 b = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
    return fma(a.x, xi.a.x, fma(a.y, xi.a.y, fma(a.z, xi.a.z, a.w * xi.a.w)))
        + fma(b.x, xi.b.x, fma(b.y, xi.b.y, fma(b.z, xi.b.z, b.w * xi.b.w)));
}

#elif defined(WTYPE_Q8_0)
// block_q8_0: f16 d, 32 int8. Item: half a block, 16 weights.
#define ITEM_WEIGHTS 16u
uint row_bytes(uint n) { return (n / 32u) * 34u; }
struct Inputs { vec4 x[4]; float sum; };
Inputs load_inputs(uint x0, uint i) {
    Inputs xi;
    const uint at = (x0 >> 2) + 4u * i;
    [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        xi.x[k] = xin(at + k);
    }
    xi.sum = (vsum(xi.x[0]) + vsum(xi.x[1])) + (vsum(xi.x[2]) + vsum(xi.x[3]));
    return xi;
}
float dot_item(uint row, uint i, Inputs xi) {
    const uint base = row + 34u * (i >> 1);
    const uvec4 q = words4(base + 2u + 16u * (i & 1u));
    // Signed bytes flipped to unsigned (q + 128): Σ q·x = Σ (q + 128)·x - 128 Σ x.
    const uvec4 u = q ^ 0x80808080u;
    float s = dot_u8(u.x, xi.x[0]);
    s += dot_u8(u.y, xi.x[1]);
    s += dot_u8(u.z, xi.x[2]);
    s += dot_u8(u.w, xi.x[3]);
    return half_at(base) * fma(-128.0, xi.sum, s);
}

#elif defined(WTYPE_Q4_0)
// block_q4_0: f16 d, 16 bytes of nibbles (low: weights 0..15, high: 16..31). Item: a block.
#define ITEM_WEIGHTS 32u
uint row_bytes(uint n) { return (n / 32u) * 18u; }
struct Inputs { vec4 x[8]; float sum; };
Inputs load_inputs(uint x0, uint i) {
    Inputs xi;
    const uint at = (x0 >> 2) + 8u * i;
    float s = 0.0;
    [[unroll]] for (uint k = 0u; k < 8u; ++k) {
        xi.x[k] = xin(at + k);
        s += vsum(xi.x[k]);
    }
    xi.sum = s;
    return xi;
}
float dot_item(uint row, uint i, Inputs xi) {
    const uint base = row + 18u * i;
    const uvec4 q = words4(base + 2u);
    vec2 s = dot_nibbles(q.x, xi.x[0], xi.x[4]);
    s += dot_nibbles(q.y, xi.x[1], xi.x[5]);
    s += dot_nibbles(q.z, xi.x[2], xi.x[6]);
    s += dot_nibbles(q.w, xi.x[3], xi.x[7]);
    return half_at(base) * fma(-8.0, xi.sum, s.x + s.y);
}

#elif defined(WTYPE_Q4_K)
// block_q4_K (144 bytes, so rows stay 16-byte aligned): f16 d, f16 dmin, 12 bytes of 6-bit
// scales and mins, 128 bytes of nibbles; byte l of the 32-byte group g holds weight 64g + l
// (low nibble, sub-block 2g) and 64g + 32 + l (high, sub-block 2g + 1). Item c of a block: its
// 16-byte chunk c of nibbles, 32 weights of two sub-blocks.
#define ITEM_WEIGHTS 32u
uint row_bytes(uint n) { return (n / 256u) * 144u; }
struct Inputs { vec4 lo[4]; vec4 hi[4]; float sum_lo; float sum_hi; };
Inputs load_inputs(uint x0, uint i) {
    Inputs xi;
    const uint c = i & 7u;
    const uint at = (x0 >> 2) + 64u * (i >> 3) + 16u * (c >> 1) + 4u * (c & 1u);
    [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        xi.lo[k] = xin(at + k);
        xi.hi[k] = xin(at + 8u + k);
    }
    xi.sum_lo = (vsum(xi.lo[0]) + vsum(xi.lo[1])) + (vsum(xi.lo[2]) + vsum(xi.lo[3]));
    xi.sum_hi = (vsum(xi.hi[0]) + vsum(xi.hi[1])) + (vsum(xi.hi[2]) + vsum(xi.hi[3]));
    return xi;
}
float dot_item(uint row, uint i, Inputs xi) {
    const uint c = i & 7u;
    const uint blk = (row >> 4) + 9u * (i >> 3);
    const uvec4 h = weights4[blk];
    const uvec4 q = weights4[blk + 1u + c];
    // Scales and mins of sub-blocks j and j + 1, j = 2 * (c / 2), as byte pairs.
    const uint sh = 8u * (c & 2u);
    uint sc, m;
    if (c < 4u) {
        sc = (h.y >> sh) & 0x3F3Fu;
        m = (h.z >> sh) & 0x3F3Fu;
    } else {
        sc = ((h.w >> sh) & 0x0F0Fu) | (((h.y >> (sh + 6u)) & 0x0303u) << 4);
        m = ((h.w >> (sh + 4u)) & 0x0F0Fu) | (((h.z >> (sh + 6u)) & 0x0303u) << 4);
    }
    const vec2 dm = unpackHalf2x16(h.x);
    vec2 s = dot_nibbles(q.x, xi.lo[0], xi.hi[0]);
    s += dot_nibbles(q.y, xi.lo[1], xi.hi[1]);
    s += dot_nibbles(q.z, xi.lo[2], xi.hi[2]);
    s += dot_nibbles(q.w, xi.lo[3], xi.hi[3]);
    const float d0 = dm.x * mant(sc & 0xFFu), d1 = dm.x * mant(sc >> 8);
    const float m0 = dm.y * mant(m & 0xFFu), m1 = dm.y * mant(m >> 8);
    return fma(d0, s.x, fma(-m0, xi.sum_lo, fma(d1, s.y, -m1 * xi.sum_hi)));
}

#elif defined(WTYPE_Q6_K)
// block_q6_K (210 bytes): ql[128], qh[64], int8 scales[16], f16 d. Half h (128 weights), byte
// l < 32: ql[64h + l] low/high nibbles and ql[64h + 32 + l] low/high nibbles are the low 4 bits
// of weights 128h + l + 32k for k = 0, 2, 1, 3; bits 2k..2k+1 of qh[32h + l] their high 2 bits;
// scale 8h + 2k + l / 16. Item (h, g): bytes l = 8g..8g+7 of half h, 32 weights.
#define ITEM_WEIGHTS 32u
uint row_bytes(uint n) { return (n / 256u) * 210u; }
struct Inputs { vec4 x[8]; vec4 sums; };
Inputs load_inputs(uint x0, uint i) {
    Inputs xi;
    const uint at = (x0 >> 2) + 64u * (i >> 3) + 32u * ((i >> 2) & 1u) + 2u * (i & 3u);
    [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        xi.x[2u * k] = xin(at + 8u * k);
        xi.x[2u * k + 1u] = xin(at + 8u * k + 1u);
        xi.sums[k] = vsum(xi.x[2u * k]) + vsum(xi.x[2u * k + 1u]);
    }
    return xi;
}
float dot_item(uint row, uint i, Inputs xi) {
    const uint half_ = (i >> 2) & 1u;
    const uint g = i & 3u;
    const uint base = row + 210u * (i >> 3);
    const uint l = base + 64u * half_ + 8u * g;
    const uvec2 qa = words2(l);
    const uvec2 qb = words2(l + 32u);
    const uvec2 qh = words2(base + 128u + 32u * half_ + 8u * g);
    // Scales 8h + g/2 + {0, 2, 4, 6}: bytes 0 and 2 of each word after the shift.
    const uvec2 sw = words2(base + 192u + 8u * half_) >> (8u * (g >> 1));
    vec4 s = vec4(0.0);
    [[unroll]] for (uint w = 0u; w < 2u; ++w) {
        const uint a = qa[w], b = qb[w], hb = qh[w];
        s.x += dot_u8((a & 0x0F0F0F0Fu) | ((hb << 4) & 0x30303030u), xi.x[w]);
        s.y += dot_u8((b & 0x0F0F0F0Fu) | ((hb << 2) & 0x30303030u), xi.x[2u + w]);
        s.z += dot_u8(((a >> 4) & 0x0F0F0F0Fu) | (hb & 0x30303030u), xi.x[4u + w]);
        s.w += dot_u8(((b >> 4) & 0x0F0F0F0Fu) | ((hb >> 2) & 0x30303030u), xi.x[6u + w]);
    }
    const vec4 sc = vec4(bitfieldExtract(int(sw.x), 0, 8), bitfieldExtract(int(sw.x), 16, 8),
                         bitfieldExtract(int(sw.y), 0, 8), bitfieldExtract(int(sw.y), 16, 8));
    // q - 32 with q the 6-bit value: Σ (q - 32)·x = Σ q·x - 32 Σ x.
    return half_at(base + 208u) * dot(sc, s - 32.0 * xi.sums);
}
#else
#error "matvec_dot.glsl needs a WTYPE_* define"
#endif
