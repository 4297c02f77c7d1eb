// An input block quantized as ggml's block_q8_0, which is what the CPU engine (and ggml's CPU
// backend) multiplies Q4_0 and Q8_0 rows with: d = max|x| / 127 rounded to f16, q_j = x_j * 127 /
// max|x| rounded half away from zero, four to a word, and Σ q_j (for Q4_0's offset of 8). One
// function for `matvec.comp`, which quantizes the blocks it reads, and `quantize_q8.comp`, which
// quantizes a vector once for every product that reads it, so both give the same bits.

struct Q8Block { int q[8]; float d; int sum; };

int pack_bytes(ivec4 v) {
    return (v.x & 0xFF) | ((v.y & 0xFF) << 8) | ((v.z & 0xFF) << 16) | (v.w << 24);
}

Q8Block quantize_block(vec4 v[8]) {
    float amax = 0.0;
    [[unroll]] for (uint k = 0u; k < 8u; ++k) {
        const vec4 a = abs(v[k]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
    const float d = amax / 127.0;
    const float id = d != 0.0 ? 1.0 / d : 0.0;
    Q8Block b;
    b.d = unpackHalf2x16(packHalf2x16(vec2(d, 0.0))).x;
    ivec4 s = ivec4(0);
    [[unroll]] for (uint k = 0u; k < 8u; ++k) {
        const vec4 p = v[k] * id;
        const ivec4 q = ivec4(sign(p) * floor(abs(p) + 0.5));
        s += q;
        b.q[k] = pack_bytes(q);
    }
    b.sum = (s.x + s.y) + (s.z + s.w);
    return b;
}

// The layout `quantize_q8.comp` writes and `matvec.comp` with Q8_IN reads, in 16-byte units: a
// vector is a header (Σ x² of the raw inputs, for a fused RMSNorm) and then three units a block
// (q[0..4], q[4..8], (d, Σ q, 0, 0)).
uint q8_vector_units(uint n_in) {
    return 1u + 3u * (n_in / 32u);
}
