//! NEON dot products of weight rows with quantized activations, for aarch64: the integer sums
//! of the scalar kernels in [`super::dot`] sixteen lanes at a time (widening `i8 × i8` products
//! to i16, then pairwise into i32), and the same float operations per block in the same order,
//! so a row's result is the scalar kernel's to the bit for the quantized types.
//!
//! Only base NEON (`vmull_s8`, `vpadalq_s16`), which every aarch64 CPU has: the `sdot`
//! instruction of the dot-product extension would halve the integer work but its intrinsics
//! are not stable in Rust yet. F16 rows convert their halves with the scalar conversion (the
//! half-precision intrinsics are not stable either) and multiply with NEON.

#![cfg(target_arch = "aarch64")]

use std::arch::aarch64::*;

use crate::quant::{fp16_to_fp32, BlockQ8_0};

use super::act::BlockQ8K;
use super::dot::scale_min_k4;

fn half_at(b: &[u8], at: usize) -> f32 {
    fp16_to_fp32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// `Σ a_i · b_i` over 16 signed bytes, as an i32 (the products fit i16: |a|, |b| <= 128, and
/// one of them <= 127 in every caller).
#[inline(always)]
fn dot16(a: int8x16_t, b: int8x16_t) -> i32 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
        let hi = vmull_high_s8(a, b);
        vaddvq_s32(vpadalq_s16(vpaddlq_s16(lo), hi))
    }
}

/// 16 bytes at `p` as signed lanes.
///
/// # Safety
/// `p` must be readable for 16 bytes.
#[inline(always)]
unsafe fn load_i8(p: *const i8) -> int8x16_t {
    // SAFETY: the caller guarantees 16 readable bytes.
    unsafe { vld1q_s8(p) }
}

/// Q8_0 rows: `block { f16 d; i8 qs[32]; }`.
pub fn dot_q8_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    assert!(y.len() * 34 >= row.len());
    let mut sum = 0.0f32;
    for (b, y) in row.chunks_exact(34).zip(y) {
        // SAFETY: `b` has 32 bytes after its scale; `y.qs` is 32 bytes.
        let isum = unsafe {
            let w = b.as_ptr().add(2) as *const i8;
            let x = y.qs.as_ptr();
            dot16(load_i8(w), load_i8(x)) + dot16(load_i8(w.add(16)), load_i8(x.add(16)))
        };
        sum += isum as f32 * (half_at(b, 0) * fp16_to_fp32(y.d.to_bits()));
    }
    sum
}

/// Q4_0 rows: `block { f16 d; u8 qs[16]; }`, weight `j` in the low nibble of byte `j`, weight
/// `j + 16` in the high nibble, both offset by 8.
pub fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    assert!(y.len() * 18 >= row.len());
    let mut sum = 0.0f32;
    for (b, y) in row.chunks_exact(18).zip(y) {
        // SAFETY: `b` has 16 bytes of nibbles after its scale; `y.qs` is 32 bytes.
        let isum = unsafe {
            let nib = vld1q_u8(b.as_ptr().add(2));
            let eight = vdupq_n_s8(8);
            let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(nib, vdupq_n_u8(0x0f))), eight);
            let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(nib)), eight);
            let x = y.qs.as_ptr();
            dot16(lo, load_i8(x)) + dot16(hi, load_i8(x.add(16)))
        };
        sum += isum as f32 * (half_at(b, 0) * fp16_to_fp32(y.d.to_bits()));
    }
    sum
}

/// `Σ q_l · y_l` over 32 weights whose low 4 bits are the low (or high, `high`) nibbles of the
/// 32 bytes at `q`, plus 16 where bit `fifth` of the matching byte at `qh` is set (Q5_K).
///
/// # Safety
/// `q` and `y` must be readable for 32 bytes, and `qh` too when given.
#[inline(always)]
unsafe fn nibble_dot32(q: *const u8, high: bool, qh: Option<(*const u8, u8)>, y: *const i8) -> i32 {
    let mut total = 0;
    for half in 0..2 {
        // SAFETY: the caller guarantees 32 readable bytes at each pointer.
        unsafe {
            let bytes = vld1q_u8(q.add(16 * half));
            let mut w = if high {
                vshrq_n_u8::<4>(bytes)
            } else {
                vandq_u8(bytes, vdupq_n_u8(0x0f))
            };
            if let Some((qh, bit)) = qh {
                let set = vtstq_u8(vld1q_u8(qh.add(16 * half)), vdupq_n_u8(1 << bit));
                w = vorrq_u8(w, vandq_u8(set, vdupq_n_u8(16)));
            }
            total += dot16(vreinterpretq_s8_u8(w), load_i8(y.add(16 * half)));
        }
    }
    total
}

/// Q4_K (`fifth_bits` false, 144-byte super-blocks) and Q5_K (true, 176 bytes) rows: the
/// scalar kernels' sums with the sub-block products in NEON.
fn dot_k4(row: &[u8], y: &[BlockQ8K], fifth_bits: bool) -> f32 {
    let (bb, qs_at) = if fifth_bits { (176, 48) } else { (144, 16) };
    assert!(y.len() * bb >= row.len());
    let mut sum = 0.0f32;
    for (b, y) in row.chunks_exact(bb).zip(y) {
        let (d, dmin) = (half_at(b, 0), half_at(b, 2));
        let scales = &b[4..16];
        let (mut isum, mut msum) = (0i32, 0i32);
        for i in 0..4 {
            let (s0, m0) = scale_min_k4(2 * i, scales);
            let (s1, m1) = scale_min_k4(2 * i + 1, scales);
            // SAFETY: 32 bytes of nibbles at qs_at + 32 i < bb, 32 fifth bits at 16..48, and
            // 64 activations at 64 i < 256.
            let (d0, d1) = unsafe {
                let q = b.as_ptr().add(qs_at + 32 * i);
                let qh = |bit: usize| fifth_bits.then(|| (b.as_ptr().add(16), bit as u8));
                let yq = y.qs.as_ptr().add(64 * i);
                (
                    nibble_dot32(q, false, qh(2 * i), yq),
                    nibble_dot32(q, true, qh(2 * i + 1), yq.add(32)),
                )
            };
            isum += s0 * d0 + s1 * d1;
            let bs = |k: usize| i32::from(y.bsums[k]);
            msum += m0 * (bs(4 * i) + bs(4 * i + 1)) + m1 * (bs(4 * i + 2) + bs(4 * i + 3));
        }
        sum += d * y.d * isum as f32 - dmin * y.d * msum as f32;
    }
    sum
}

/// Q4_K rows.
pub fn dot_q4_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    dot_k4(row, y, false)
}

/// Q5_K rows.
pub fn dot_q5_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    dot_k4(row, y, true)
}

/// Q6_K rows (210-byte super-blocks: ql, qh, 16 signed scales, d). Each 16 lanes unpacked
/// below are one scale group of 16 weights.
pub fn dot_q6_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    assert!(y.len() * 210 >= row.len());
    let mut sum = 0.0f32;
    for (b, y) in row.chunks_exact(210).zip(y) {
        let mut isum = 0i32;
        for n in 0..2 {
            for c in [0, 16] {
                // SAFETY: ql[64 n + c..][..48] < 128, qh[128 + 32 n + c..][..16] < 192, and
                // activations 128 n + 32 k + c + 16 <= 256.
                unsafe {
                    let p = b.as_ptr();
                    let l0 = vld1q_u8(p.add(64 * n + c));
                    let l1 = vld1q_u8(p.add(64 * n + 32 + c));
                    let h = vld1q_u8(p.add(128 + 32 * n + c));
                    let m4 = vdupq_n_u8(0x0f);
                    let m2 = vdupq_n_u8(3);
                    let quarters = [
                        vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8::<4>(vandq_u8(h, m2))),
                        vorrq_u8(
                            vandq_u8(l1, m4),
                            vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<2>(h), m2)),
                        ),
                        vorrq_u8(
                            vshrq_n_u8::<4>(l0),
                            vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<4>(h), m2)),
                        ),
                        vorrq_u8(vshrq_n_u8::<4>(l1), vshlq_n_u8::<4>(vshrq_n_u8::<6>(h))),
                    ];
                    for (k, q) in quarters.into_iter().enumerate() {
                        let at = 128 * n + 32 * k + c;
                        let w = vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(32));
                        let scale = i32::from(b[192 + at / 16] as i8);
                        isum += scale * dot16(w, load_i8(y.qs.as_ptr().add(at)));
                    }
                }
            }
        }
        sum += half_at(b, 208) * y.d * isum as f32;
    }
    sum
}

/// F32 rows: four accumulators of four lanes, then the tail in scalar.
pub fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    assert!(row.len() >= 4 * x.len());
    let n = x.len();
    let mut i = 0;
    // SAFETY: every load reads lanes i..i + 4 <= n of both (`row` is at least 4 n bytes).
    let mut sum = unsafe {
        let w = row.as_ptr() as *const f32;
        let mut acc = [vdupq_n_f32(0.0); 4];
        while i + 16 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let j = i + 4 * k;
                *a = vfmaq_f32(*a, vld1q_f32(w.add(j)), vld1q_f32(x.as_ptr().add(j)));
            }
            i += 16;
        }
        while i + 4 <= n {
            acc[0] = vfmaq_f32(acc[0], vld1q_f32(w.add(i)), vld1q_f32(x.as_ptr().add(i)));
            i += 4;
        }
        vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ))
    };
    for j in i..n {
        let b = &row[4 * j..4 * j + 4];
        sum += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x[j];
    }
    sum
}

/// F16 rows: eight halves converted at a time, multiplied in two accumulators.
pub fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    assert!(row.len() >= 2 * x.len());
    let n = x.len();
    let mut i = 0;
    let mut wide = [0.0f32; 8];
    // SAFETY: the loads read `wide` (8 lanes) and x[i..i + 8] with i + 8 <= n.
    let mut sum = unsafe {
        let mut acc = [vdupq_n_f32(0.0); 2];
        while i + 8 <= n {
            for (k, w) in wide.iter_mut().enumerate() {
                *w = half_at(row, 2 * (i + k));
            }
            acc[0] = vfmaq_f32(
                acc[0],
                vld1q_f32(wide.as_ptr()),
                vld1q_f32(x.as_ptr().add(i)),
            );
            acc[1] = vfmaq_f32(
                acc[1],
                vld1q_f32(wide.as_ptr().add(4)),
                vld1q_f32(x.as_ptr().add(i + 4)),
            );
            i += 8;
        }
        vaddvq_f32(vaddq_f32(acc[0], acc[1]))
    };
    for (j, &xj) in x.iter().enumerate().skip(i) {
        sum += half_at(row, 2 * j) * xj;
    }
    sum
}
