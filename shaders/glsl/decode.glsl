// Decoding of one "unit" of 32 consecutive weights of a row, for every weight type: a whole block
// of Q8_0/Q4_0, 32 halves of F16, an eighth of a Q4_K/Q6_K super-block. Matrix-vector products,
// row lookups and dequantization all go through `decode_unit`, so they agree with each other and
// (bit for bit) with the CPU's `dequantize_row`: `precise` keeps the compiler from fusing the
// multiply-adds that the CPU rounds separately. Needs `weights` and common.glsl.

// For Q8_0, Q4_0 and Q4_K, a unit can also be read ahead of its decoding: `unit_words(row, u, w)`
// reads the UNIT_WORDS words that hold it and `decode_words(row, u, w, v)` decodes them later
// with `decode_unit`'s arithmetic, so prompt products keep the next step's weights in flight
// while they multiply. Q8_0 and Q4_0 units start on an even byte: their words are realigned to
// the unit's first byte before decoding, so that every later index is a constant. Q4_K
// super-blocks (144 bytes, rows of whole ones from an aligned start) start on a word.
#define words_u16(w, b) ((w[(b) >> 2] >> (((b) & 2u) * 8u)) & 0xFFFFu)

#if defined(WTYPE_F32)
// MoE routers stay F32 (llama.cpp never quantizes them); rows start on whole words.
uint row_bytes(uint n) { return 4u * n; }
void decode_unit(uint row, uint u, out float v[32]) {
    const uint base = (row >> 2) + 32u * u;
    for (uint i = 0u; i < 32u; ++i) {
        v[i] = uintBitsToFloat(weights[base + i]);
    }
}
#elif defined(WTYPE_F16)
// Bytes of a row of `n` weights.
uint row_bytes(uint n) { return 2u * n; }
void decode_unit(uint row, uint u, out float v[32]) {
    const uint base = row + 64u * u;
    for (uint i = 0u; i < 32u; ++i) {
        v[i] = load_f16(base + 2u * i);
    }
}
#elif defined(WTYPE_Q8_0)
uint row_bytes(uint n) { return (n / 32u) * 34u; }
void decode_unit(uint row, uint u, out float v[32]) {
    const uint base = row + 34u * u;
    const float d = load_f16(base);
    for (uint i = 0u; i < 32u; i += 2u) {
        const uint q = load_u16(base + 2u + i);
        v[i] = float(int(q << 24) >> 24) * d;
        v[i + 1u] = float(int(q << 16) >> 24) * d;
    }
}
#define UNIT_WORDS 9u
uint unit_at(uint row, uint u) { return row + 34u * u; }
void realign_words(uint at, inout uint w[UNIT_WORDS]);
void decode_words(uint row, uint u, uint w[UNIT_WORDS], out float v[32]) {
    realign_words(unit_at(row, u), w);
    const float d = unpackHalf2x16(w[0] & 0xFFFFu).x;
    for (uint i = 0u; i < 32u; i += 2u) {
        const uint q = words_u16(w, 2u + i);
        v[i] = float(int(q << 24) >> 24) * d;
        v[i + 1u] = float(int(q << 16) >> 24) * d;
    }
}
#elif defined(WTYPE_Q4_0)
uint row_bytes(uint n) { return (n / 32u) * 18u; }
void decode_unit(uint row, uint u, out float v[32]) {
    const uint base = row + 18u * u;
    const float d = load_f16(base);
    for (uint i = 0u; i < 16u; i += 2u) {
        const uint q = load_u16(base + 2u + i);
        v[i] = float(int(q & 0xFu) - 8) * d;
        v[i + 16u] = float(int((q >> 4) & 0xFu) - 8) * d;
        v[i + 1u] = float(int((q >> 8) & 0xFu) - 8) * d;
        v[i + 17u] = float(int((q >> 12) & 0xFu) - 8) * d;
    }
}
#define UNIT_WORDS 5u
uint unit_at(uint row, uint u) { return row + 18u * u; }
void realign_words(uint at, inout uint w[UNIT_WORDS]);
void decode_words(uint row, uint u, uint w[UNIT_WORDS], out float v[32]) {
    realign_words(unit_at(row, u), w);
    const float d = unpackHalf2x16(w[0] & 0xFFFFu).x;
    for (uint i = 0u; i < 16u; i += 2u) {
        const uint q = words_u16(w, 2u + i);
        v[i] = float(int(q & 0xFu) - 8) * d;
        v[i + 16u] = float(int((q >> 4) & 0xFu) - 8) * d;
        v[i + 1u] = float(int((q >> 8) & 0xFu) - 8) * d;
        v[i + 17u] = float(int((q >> 12) & 0xFu) - 8) * d;
    }
}
#elif defined(WTYPE_Q4_K)
// block_q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles.
uint row_bytes(uint n) { return (n / 256u) * 144u; }
void decode_unit(uint row, uint u, out float v[32]) {
    const uint base = row + 144u * (u / 8u);
    const uint j = u % 8u;
    const float d = load_f16(base);
    const float dmin = load_f16(base + 2u);
    const uint sc_at = base + 4u;
    uint sc, m;
    if (j < 4u) {
        sc = load_u8(sc_at + j) & 63u;
        m = load_u8(sc_at + j + 4u) & 63u;
    } else {
        sc = (load_u8(sc_at + j + 4u) & 0xFu) | ((load_u8(sc_at + j - 4u) >> 6) << 4);
        m = (load_u8(sc_at + j + 4u) >> 4) | ((load_u8(sc_at + j) >> 6) << 4);
    }
    precise float d1 = d * float(sc);
    precise float m1 = dmin * float(m);
    const uint qs = base + 16u + 32u * (j / 2u);
    const uint shift = (j & 1u) * 4u;
    for (uint l = 0u; l < 32u; l += 2u) {
        const uint q = load_u16(qs + l);
        precise float a = d1 * float((q >> shift) & 0xFu) - m1;
        precise float b = d1 * float((q >> (8u + shift)) & 0xFu) - m1;
        v[l] = a;
        v[l + 1u] = b;
    }
}
// Words 0-3: the super-block's d, dmin and scales; 4-11: the unit's 32 bytes of nibbles.
#define UNIT_WORDS 12u
#define UNIT_ALIGNED
void unit_words(uint row, uint u, out uint w[UNIT_WORDS]) {
    const uint b0 = (row + 144u * (u / 8u)) >> 2;
    for (uint i = 0u; i < 4u; ++i) {
        w[i] = weights[b0 + i];
    }
    const uint q0 = b0 + 4u + 8u * ((u % 8u) / 2u);
    for (uint i = 0u; i < 8u; ++i) {
        w[4u + i] = weights[q0 + i];
    }
}
void decode_words(uint row, uint u, uint w[UNIT_WORDS], out float v[32]) {
    const uint j = u % 8u;
    const float d = unpackHalf2x16(w[0] & 0xFFFFu).x;
    const float dmin = unpackHalf2x16(w[0] >> 16).x;
    // Scale bytes 0-3 are in word 1, 4-7 in word 2, 8-11 in word 3.
    const uint s = (j & 3u) * 8u;
    uint sc, m;
    if (j < 4u) {
        sc = (w[1] >> s) & 63u;
        m = (w[2] >> s) & 63u;
    } else {
        sc = ((w[3] >> s) & 0xFu) | ((((w[1] >> s) & 0xFFu) >> 6) << 4);
        m = (((w[3] >> s) & 0xFFu) >> 4) | ((((w[2] >> s) & 0xFFu) >> 6) << 4);
    }
    precise float d1 = d * float(sc);
    precise float m1 = dmin * float(m);
    const uint shift = (j & 1u) * 4u;
    for (uint l = 0u; l < 32u; l += 2u) {
        const uint q = words_u16(w, 16u + l);
        precise float a = d1 * float((q >> shift) & 0xFu) - m1;
        precise float b = d1 * float((q >> (8u + shift)) & 0xFu) - m1;
        v[l] = a;
        v[l + 1u] = b;
    }
}
#elif defined(WTYPE_Q6_K)
// block_q6_K: ql[128], qh[64], int8 scales[16], f16 d. Unit u%8 = 4 * half + quarter.
uint row_bytes(uint n) { return (n / 256u) * 210u; }
void decode_unit(uint row, uint u, out float v[32]) {
    const uint base = row + 210u * (u / 8u);
    const uint half_ = (u % 8u) / 4u;
    const uint k = u % 4u;
    const float d = load_f16(base + 208u);
    const uint ql = base + 64u * half_ + 32u * (k & 1u);
    const uint qh = base + 128u + 32u * half_;
    const uint lo_shift = (k / 2u) * 4u;
    const uint hi_shift = 2u * k;
    const uint sc = base + 192u + 8u * half_ + 2u * k;
    precise float d0 = d * float(load_i8(sc));
    precise float d1 = d * float(load_i8(sc + 1u));
    for (uint l = 0u; l < 32u; l += 2u) {
        const uint lo = load_u16(ql + l);
        const uint hi = load_u16(qh + l);
        const int q0 = int(((lo >> lo_shift) & 0xFu) | (((hi >> hi_shift) & 3u) << 4)) - 32;
        const int q1 = int(((lo >> (8u + lo_shift)) & 0xFu) | (((hi >> (8u + hi_shift)) & 3u) << 4)) - 32;
        const float ds = l < 16u ? d0 : d1;
        precise float a = ds * float(q0);
        precise float b = ds * float(q1);
        v[l] = a;
        v[l + 1u] = b;
    }
}
#else
#error "decode.glsl needs a WTYPE_* define"
#endif

#if defined(UNIT_WORDS) && !defined(UNIT_ALIGNED)
void unit_words(uint row, uint u, out uint w[UNIT_WORDS]) {
    const uint w0 = unit_at(row, u) >> 2;
    for (uint i = 0u; i < UNIT_WORDS; ++i) {
        w[i] = weights[w0 + i];
    }
}

// Words read from byte `at & ~3` moved so that word 0 starts at byte `at`.
void realign_words(uint at, inout uint w[UNIT_WORDS]) {
    if ((at & 2u) != 0u) {
        for (uint i = 0u; i + 1u < UNIT_WORDS; ++i) {
            w[i] = (w[i] >> 16) | (w[i + 1u] << 16);
        }
        w[UNIT_WORDS - 1u] >>= 16;
    }
}
#endif
