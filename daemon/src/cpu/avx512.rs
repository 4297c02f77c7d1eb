//! One-row dot products with AVX-512 VNNI (on 256-bit registers, AVX-512 VL) for Q8_0 and Q4_0
//! rows, the decode kernels of CPUs that have it.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes and adds each four products into an i32 lane:
//! the same lanes, with the same integer sums, as AVX2's `maddubs` then `madd` by ones, in one
//! instruction and without the pair sums' trip through i16. The float operations per block
//! are [`super::avx2`]'s, so results are bit-identical to the AVX2 kernels (and so to the
//! batched prompt kernels): a prompt still gives the same logits batched or token by token.
//!
//! - Q8_0: `|w| · (y with w's sign)`, as AVX2 does, in one `vpdpbusd`.
//! - Q4_0: the nibbles unsigned, `Σ n y - Σ 8 y`: two `vpdpbusd` and a subtraction, where AVX2
//!   subtracts 8 from the nibbles, takes two signs, `maddubs` and `madd`.
//!
//! Every function here requires what [`super::gemm_avx512::available`] checks for.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::quant::BlockQ8_0;

use super::avx2::{block_scale, hsum_ps, prefetch_ahead};

/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI, and AVX2, FMA, F16C. `row` holds whole
/// Q8_0 blocks, `y` at least as many.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_q8_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    assert!(y.len() * 34 >= row.len());
    let mut acc = _mm256_setzero_ps();
    for (b, y) in row.chunks_exact(34).zip(y) {
        prefetch_ahead(b.as_ptr());
        // SAFETY: `b` is 34 bytes, and so is `y` (scale then `qs`, `repr(C)`): 2 bytes at
        // each start, 32 bytes after the scale in `b`, and `qs` is 32 bytes.
        let (d, qx, qy) = unsafe {
            (
                block_scale(b.as_ptr(), (y as *const BlockQ8_0).cast()),
                _mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i),
                _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i),
            )
        };
        let sums = _mm256_dpbusd_epi32(
            _mm256_setzero_si256(),
            _mm256_sign_epi8(qx, qx),
            _mm256_sign_epi8(qy, qx),
        );
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums), acc);
    }
    hsum_ps(acc)
}

/// # Safety
/// As [`dot_q8_0`], for Q4_0 rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    assert!(y.len() * 18 >= row.len());
    let low = _mm256_set1_epi8(0x0f);
    let eight = _mm256_set1_epi8(8);
    let mut acc = _mm256_setzero_ps();
    for (b, y) in row.chunks_exact(18).zip(y) {
        prefetch_ahead(b.as_ptr());
        // SAFETY: `b` is 18 bytes and `y` 34 (scale then `qs`, `repr(C)`): 2 bytes at each
        // start, 16 bytes after the scale in `b`, and `qs` is 32 bytes.
        let (d, nib, qy) = unsafe {
            (
                block_scale(b.as_ptr(), (y as *const BlockQ8_0).cast()),
                _mm_loadu_si128(b.as_ptr().add(2) as *const __m128i),
                _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i),
            )
        };
        // Weights 0..16 from the low nibbles, 16..32 from the high ones, unsigned.
        let both =
            _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(nib), _mm_srli_epi16::<4>(nib));
        let w = _mm256_and_si256(both, low);
        let zero = _mm256_setzero_si256();
        let sums = _mm256_sub_epi32(
            _mm256_dpbusd_epi32(zero, w, qy),
            _mm256_dpbusd_epi32(zero, eight, qy),
        );
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums), acc);
    }
    hsum_ps(acc)
}
