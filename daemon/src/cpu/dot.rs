//! Scalar dot products of one weight row (in the file's encoding) with an activation in the
//! matching format. These are the reference the SIMD kernels are tested against; they follow
//! ggml's generic `ggml_vec_dot_*` (integer sums per block, one float multiply-add per block).
//! [`super::kernels::dot_kernel`] picks between these and the SIMD versions.

use crate::quant::{fp16_to_fp32, BlockQ8_0};

use super::act::{BlockQ8K, QK_K};

pub fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    row.chunks_exact(4)
        .zip(x)
        .map(|(b, &x)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x)
        .sum()
}

pub fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    row.chunks_exact(2)
        .zip(x)
        .map(|(b, &x)| fp16_to_fp32(u16::from_le_bytes([b[0], b[1]])) * x)
        .sum()
}

pub fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    row.chunks_exact(2)
        .zip(x)
        .map(|(b, &x)| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16) * x)
        .sum()
}

fn half_at(b: &[u8], at: usize) -> f32 {
    fp16_to_fp32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Q8_0 rows: `block { f16 d; i8 qs[32]; }`.
pub fn dot_q8_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in row.chunks_exact(34).zip(y) {
        let isum: i32 = b[2..]
            .iter()
            .zip(&y.qs)
            .map(|(&q, &v)| i32::from(q as i8) * i32::from(v))
            .sum();
        sum += isum as f32 * (half_at(b, 0) * fp16_to_fp32(y.d.to_bits()));
    }
    sum
}

/// Q4_0 rows: `block { f16 d; u8 qs[16]; }`, weight `j` in the low nibble of byte `j`, weight
/// `j + 16` in the high nibble, both offset by 8.
pub fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in row.chunks_exact(18).zip(y) {
        let mut isum = 0i32;
        for j in 0..16 {
            let q = b[2 + j];
            isum += (i32::from(q & 0x0f) - 8) * i32::from(y.qs[j]);
            isum += (i32::from(q >> 4) - 8) * i32::from(y.qs[j + 16]);
        }
        sum += isum as f32 * (half_at(b, 0) * fp16_to_fp32(y.d.to_bits()));
    }
    sum
}

/// Scale and min of Q4_K sub-block `j` from the 12 packed bytes, widened for the integer sums.
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (i32, i32) {
    let (s, m) = crate::quant::scale_min_k4(j, q);
    (i32::from(s), i32::from(m))
}

/// Q4_K rows (144-byte super-blocks: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
/// nibbles; each 32 bytes hold sub-block 2i in the low nibbles and 2i + 1 in the high ones).
pub fn dot_q4_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in row.chunks_exact(144).zip(y) {
        let (d, dmin) = (half_at(b, 0), half_at(b, 2));
        let scales = &b[4..16];
        let qs = &b[16..144];
        let (mut isum, mut msum) = (0i32, 0i32);
        for i in 0..4 {
            let q = &qs[32 * i..32 * i + 32];
            let (s0, m0) = scale_min_k4(2 * i, scales);
            let (s1, m1) = scale_min_k4(2 * i + 1, scales);
            let y0 = &y.qs[64 * i..64 * i + 32];
            let y1 = &y.qs[64 * i + 32..64 * i + 64];
            let mut d0 = 0i32;
            let mut d1 = 0i32;
            for l in 0..32 {
                d0 += i32::from(q[l] & 0x0f) * i32::from(y0[l]);
                d1 += i32::from(q[l] >> 4) * i32::from(y1[l]);
            }
            isum += s0 * d0 + s1 * d1;
            let bs = |k: usize| i32::from(y.bsums[k]);
            msum += m0 * (bs(4 * i) + bs(4 * i + 1)) + m1 * (bs(4 * i + 2) + bs(4 * i + 3));
        }
        sum += d * y.d * isum as f32 - dmin * y.d * msum as f32;
    }
    sum
}

/// Q5_K rows (176-byte super-blocks: d, dmin, 12 bytes of 6-bit scales and mins as Q4_K's,
/// 32 bytes of fifth bits, 128 bytes of nibbles). Sub-block `s` takes its low 4 bits from the
/// nibbles as in Q4_K and its fifth bit from bit `s` of `qh[l]`.
pub fn dot_q5_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in row.chunks_exact(176).zip(y) {
        let (d, dmin) = (half_at(b, 0), half_at(b, 2));
        let scales = &b[4..16];
        let qh = &b[16..48];
        let qs = &b[48..176];
        let (mut isum, mut msum) = (0i32, 0i32);
        for i in 0..4 {
            let q = &qs[32 * i..32 * i + 32];
            let (s0, m0) = scale_min_k4(2 * i, scales);
            let (s1, m1) = scale_min_k4(2 * i + 1, scales);
            let y0 = &y.qs[64 * i..64 * i + 32];
            let y1 = &y.qs[64 * i + 32..64 * i + 64];
            let (mut d0, mut d1) = (0i32, 0i32);
            for l in 0..32 {
                let h0 = i32::from((qh[l] >> (2 * i)) & 1) << 4;
                let h1 = i32::from((qh[l] >> (2 * i + 1)) & 1) << 4;
                d0 += (i32::from(q[l] & 0x0f) + h0) * i32::from(y0[l]);
                d1 += (i32::from(q[l] >> 4) + h1) * i32::from(y1[l]);
            }
            isum += s0 * d0 + s1 * d1;
            let bs = |k: usize| i32::from(y.bsums[k]);
            msum += m0 * (bs(4 * i) + bs(4 * i + 1)) + m1 * (bs(4 * i + 2) + bs(4 * i + 3));
        }
        sum += d * y.d * isum as f32 - dmin * y.d * msum as f32;
    }
    sum
}

/// Expands Q5_K rows to f32 (ggml's `dequantize_row_q5_K`), for tests and for embeddings.
pub fn dequantize_q5_k(row: &[u8], out: &mut [f32]) {
    for (b, y) in row.chunks_exact(176).zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (half_at(b, 0), half_at(b, 2));
        let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
        for i in 0..4 {
            let (sc0, mn0) = scale_min_k4(2 * i, scales);
            let (sc1, mn1) = scale_min_k4(2 * i + 1, scales);
            let (d0, m0) = (d * sc0 as f32, dmin * mn0 as f32);
            let (d1, m1) = (d * sc1 as f32, dmin * mn1 as f32);
            for l in 0..32 {
                let q = qs[32 * i + l];
                let h0 = if qh[l] & (1 << (2 * i)) != 0 {
                    16.0
                } else {
                    0.0
                };
                let h1 = if qh[l] & (2 << (2 * i)) != 0 {
                    16.0
                } else {
                    0.0
                };
                y[64 * i + l] = d0 * (f32::from(q & 0x0f) + h0) - m0;
                y[64 * i + 32 + l] = d1 * (f32::from(q >> 4) + h1) - m1;
            }
        }
    }
}

/// Decodes one Q6_K super-block's 6-bit weights (minus 32) in element order.
pub(crate) fn unpack_q6_k(b: &[u8], out: &mut [i8; QK_K]) {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    for n in 0..2 {
        let (ql, qh) = (&ql[64 * n..64 * n + 64], &qh[32 * n..32 * n + 32]);
        let o = &mut out[128 * n..128 * n + 128];
        for l in 0..32 {
            o[l] = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
            o[l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            o[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            o[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
}

/// Q6_K rows (210-byte super-blocks: ql, qh, 16 signed scales, d).
pub fn dot_q6_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sum = 0.0f32;
    let mut q = [0i8; QK_K];
    for (b, y) in row.chunks_exact(210).zip(y) {
        unpack_q6_k(b, &mut q);
        let mut isum = 0i32;
        for g in 0..16 {
            let s: i32 = q[16 * g..16 * g + 16]
                .iter()
                .zip(&y.qs[16 * g..16 * g + 16])
                .map(|(&a, &b)| i32::from(a) * i32::from(b))
                .sum();
            isum += i32::from(b[192 + g] as i8) * s;
        }
        sum += half_at(b, 208) * y.d * isum as f32;
    }
    sum
}
