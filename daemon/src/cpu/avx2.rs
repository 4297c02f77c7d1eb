//! AVX2 dot products of weight rows with quantized activations: the same integer sums as the
//! scalar kernels in [`super::dot`] (so results agree to float rounding), eight or sixteen
//! lanes at a time, after ggml's `ggml_vec_dot_*` for AVX2.
//!
//! Every function here requires AVX2, FMA and F16C; [`super::kernels`] checks for them at run time
//! before handing these out.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::quant::BlockQ8_0;

use super::act::BlockQ8K;

/// IEEE half to f32 with F16C (exact, like the scalar conversion, for every non-NaN value).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn half_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// `d_w · d_x` for a weight block starting with its f16 scale at `w` and a Q8_0 activation block
/// (scale first) at `x`, broadcast to eight lanes. Both halves go through one general register
/// into a `vmovd`, which writes the whole vector register: converting a 16-bit insert instead
/// (what LLVM makes of a single half) leaves the register's other lanes live, and LLVM may pick
/// the loop's accumulator for it, which chains every block's conversion behind the previous
/// block's FMA (about 1.5x slower decoding on Zen).
///
/// # Safety
/// The CPU must support F16C and AVX2; `w` and `x` must each be readable for 2 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block_scale(w: *const u8, x: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 2 readable bytes at each.
    let (hw, hx) = unsafe {
        (
            (w as *const u16).read_unaligned(),
            (x as *const u16).read_unaligned(),
        )
    };
    let both = u32::from(u16::from_le(hw)) | (u32::from(u16::from_le(hx)) << 16);
    let d = _mm_cvtph_ps(_mm_cvtsi32_si128(both as i32));
    _mm256_broadcastss_ps(_mm_mul_ss(d, _mm_movehdup_ps(d)))
}

/// Bytes ahead of the block being multiplied that a row's loop asks the cache for. A decode
/// step reads each weight once, from DRAM (a model, or a layer's experts, is larger than the
/// caches), and the loops do enough per byte that the hardware prefetchers fall behind: the
/// loads then stall for DRAM's latency (about 2 GB/s a thread here for Q4_0 from DRAM, against
/// 9 GB/s from the caches). Asking for the line two rows or so ahead keeps DRAM busy. It changes
/// no arithmetic.
const PREFETCH_DISTANCE: usize = 2048;

/// Asks for the cache line `PREFETCH_DISTANCE` bytes past `p` (possibly past the row: a
/// prefetch never faults).
#[inline(always)]
pub(super) fn prefetch_ahead(p: *const u8) {
    prefetch_lines(p, 1);
}

/// [`prefetch_ahead`] for `n` consecutive cache lines (a block longer than one line).
#[inline(always)]
fn prefetch_lines(p: *const u8, n: usize) {
    for k in 0..n {
        let at = p.wrapping_add(PREFETCH_DISTANCE + 64 * k);
        // SAFETY: a prefetch has no architectural effect and never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at as *const i8) };
    }
}

/// Sum of the eight f32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_ps(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Signed bytes `x · y` summed in pairs then fours: eight i32 lanes as f32 (ggml's
/// `mul_sum_i8_pairs_float`). `maddubs` needs an unsigned operand, so |x| multiplies y with
/// x's sign; |x| <= 127 for Q8 activations, which keeps the pair sums within i16.
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_i8_pairs_float(x: __m256i, y: __m256i) -> __m256 {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    let dot = _mm256_maddubs_epi16(ax, sy);
    let sums = _mm256_madd_epi16(dot, _mm256_set1_epi16(1));
    _mm256_cvtepi32_ps(sums)
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C. `row` holds whole Q8_0 blocks, `y` at least as many.
#[target_feature(enable = "avx2,fma,f16c")]
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
        acc = _mm256_fmadd_ps(d, mul_sum_i8_pairs_float(qx, qy), acc);
    }
    hsum_ps(acc)
}

/// The 32 weights of a Q4_0 block whose nibbles start at `p`, as signed bytes (minus 8): weights
/// 0..16 from the low nibbles, 16..32 from the high ones.
///
/// # Safety
/// The CPU must support AVX2; `p` must be readable for 16 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_0_weights(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes.
    let nib = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let both = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(nib), _mm_srli_epi16::<4>(nib));
    _mm256_sub_epi8(
        _mm256_and_si256(both, _mm256_set1_epi8(0x0f)),
        _mm256_set1_epi8(8),
    )
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C. `row` holds whole Q4_0 blocks, `y` at least as many.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    assert!(y.len() * 18 >= row.len());
    let mut acc = _mm256_setzero_ps();
    for (b, y) in row.chunks_exact(18).zip(y) {
        // SAFETY: `b` is 18 bytes and `y` 34 (scale then `qs`, `repr(C)`): 2 bytes at each
        // start, 16 bytes after the scale in `b`, and `qs` is 32 bytes.
        prefetch_ahead(b.as_ptr());
        let (d, qx, qy) = unsafe {
            (
                block_scale(b.as_ptr(), (y as *const BlockQ8_0).cast()),
                q4_0_weights(b.as_ptr().add(2)),
                _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i),
            )
        };
        acc = _mm256_fmadd_ps(d, mul_sum_i8_pairs_float(qx, qy), acc);
    }
    hsum_ps(acc)
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C. `row` holds whole Q4_K blocks, `y` at least as many.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    assert!(y.len() * 144 >= row.len());
    let low = _mm256_set1_epi8(0x0f);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for (b, y) in row.chunks_exact(144).zip(y) {
        prefetch_lines(b.as_ptr(), 3);
        let (scales, mins) = unpack_q4_k_scales(&b[4..16]);
        // SAFETY: `bsums` is 16 i16 = 32 bytes.
        let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i) };
        // Activation sums per 32-element sub-block, times the mins.
        let pair_sums = _mm_hadd_epi16(
            _mm256_castsi256_si128(bsums),
            _mm256_extracti128_si256::<1>(bsums),
        );
        let m = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64)), pair_sums);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(half_at(b, 2) * y.d), _mm_cvtepi32_ps(m), acc_m);
        // Eight i16 scales in each 128-bit lane, broadcast one at a time by a shuffle.
        let sc128 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64));
        let sc = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(sc128), sc128);
        let mut isum = _mm256_setzero_si256();
        for i in 0..4 {
            // SAFETY: 32 bytes of nibbles at 16 + 32 i < 144; 64 activations at 64 i < 256.
            let (bits, y0, y1) = unsafe {
                (
                    _mm256_loadu_si256(b.as_ptr().add(16 + 32 * i) as *const __m256i),
                    _mm256_loadu_si256(y.qs.as_ptr().add(64 * i) as *const __m256i),
                    _mm256_loadu_si256(y.qs.as_ptr().add(64 * i + 32) as *const __m256i),
                )
            };
            let s0 = _mm256_shuffle_epi8(sc, broadcast_i16(2 * i));
            let s1 = _mm256_shuffle_epi8(sc, broadcast_i16(2 * i + 1));
            // Nibbles (< 16) times Q8 in pairs stay within i16; then scaled into i32.
            let q0 = _mm256_and_si256(bits, low);
            let q1 = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), low);
            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, y0), s0);
            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, y1), s1);
            isum = _mm256_add_epi32(isum, _mm256_add_epi32(p0, p1));
        }
        let d = _mm256_set1_ps(half_at(b, 0) * y.d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
    }
    let m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    let m = _mm_add_ss(m, _mm_movehdup_ps(m));
    hsum_ps(acc) - _mm_cvtss_f32(m)
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C. `row` holds whole Q5_K blocks, `y` at least as many.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    assert!(y.len() * 176 >= row.len());
    let low = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for (b, y) in row.chunks_exact(176).zip(y) {
        prefetch_lines(b.as_ptr(), 3);
        let (scales, mins) = unpack_q4_k_scales(&b[4..16]);
        // SAFETY: `bsums` is 16 i16 = 32 bytes; the fifth bits are b[16..48].
        let (bsums, hbits) = unsafe {
            (
                _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i),
                _mm256_loadu_si256(b.as_ptr().add(16) as *const __m256i),
            )
        };
        let pair_sums = _mm_hadd_epi16(
            _mm256_castsi256_si128(bsums),
            _mm256_extracti128_si256::<1>(bsums),
        );
        let m = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64)), pair_sums);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(half_at(b, 2) * y.d), _mm_cvtepi32_ps(m), acc_m);
        let sc128 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64));
        let sc = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(sc128), sc128);
        let mut isum = _mm256_setzero_si256();
        for i in 0..4 {
            // SAFETY: 32 bytes of nibbles at 48 + 32 i < 176; 64 activations at 64 i < 256.
            let (bits, y0, y1) = unsafe {
                (
                    _mm256_loadu_si256(b.as_ptr().add(48 + 32 * i) as *const __m256i),
                    _mm256_loadu_si256(y.qs.as_ptr().add(64 * i) as *const __m256i),
                    _mm256_loadu_si256(y.qs.as_ptr().add(64 * i + 32) as *const __m256i),
                )
            };
            // Bit 2i (2i + 1) of each qh byte is the fifth bit of sub-block 2i (2i + 1); a
            // 16-bit shift then a byte mask isolates it without crossing bytes.
            let fifth = |bit: i32| {
                let v = _mm256_srl_epi16(hbits, _mm_cvtsi32_si128(bit));
                _mm256_slli_epi16::<4>(_mm256_and_si256(v, one))
            };
            let q0 = _mm256_or_si256(_mm256_and_si256(bits, low), fifth(2 * i as i32));
            let q1 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(bits), low),
                fifth(2 * i as i32 + 1),
            );
            let s0 = _mm256_shuffle_epi8(sc, broadcast_i16(2 * i));
            let s1 = _mm256_shuffle_epi8(sc, broadcast_i16(2 * i + 1));
            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, y0), s0);
            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, y1), s1);
            isum = _mm256_add_epi32(isum, _mm256_add_epi32(p0, p1));
        }
        let d = _mm256_set1_ps(half_at(b, 0) * y.d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
    }
    let m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    let m = _mm_add_ss(m, _mm_movehdup_ps(m));
    hsum_ps(acc) - _mm_cvtss_f32(m)
}

/// The eight 6-bit scales and eight 6-bit mins of a Q4_K block, one per byte (ggml's `utmp`
/// shuffle; the same values as `dot::scale_min_k4`).
pub(super) fn unpack_q4_k_scales(q: &[u8]) -> (u64, u64) {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let scales_lo = u0 & K1;
    let scales_hi = (u2 & K2) | (((u0 >> 6) & K3) << 4);
    let mins_lo = u1 & K1;
    let mins_hi = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
    (
        u64::from(scales_lo) | (u64::from(scales_hi) << 32),
        u64::from(mins_lo) | (u64::from(mins_hi) << 32),
    )
}

/// A shuffle that copies i16 element `i` (0..8) of each 128-bit lane to all of its lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn broadcast_i16(i: usize) -> __m256i {
    let lo = (2 * i) as i8;
    let pair = i16::from_le_bytes([lo as u8, lo as u8 + 1]);
    _mm256_set1_epi16(pair)
}

/// Byte shuffles that spread Q6_K scales `2 k` and `2 k + 1` over eight bytes each, so that
/// after sign extension the low 128-bit lane holds the first and the high lane the second.
pub(super) const Q6K_SCALE_SHUFFLE: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut k = 0;
    while k < 8 {
        let mut j = 0;
        while j < 16 {
            t[k][j] = (2 * k + j / 8) as u8;
            j += 1;
        }
        k += 1;
    }
    t
};

/// The four 32-weight quarters of half `n` of a Q6_K block, as unsigned bytes (0..64), from
/// its low bits `l0`, `l1` (ql[64 n..64 n + 64]) and high bits `h` (qh[32 n..32 n + 32]), in
/// the element order of `dot::unpack_q6_k`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6_k_quarters(l0: __m256i, l1: __m256i, h: __m256i) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(3);
    let hi0 = _mm256_slli_epi16::<4>(_mm256_and_si256(h, m2));
    let hi1 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(h), m2));
    let hi2 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(h), m2));
    let hi3 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(h), m2));
    [
        _mm256_or_si256(_mm256_and_si256(l0, m4), hi0),
        _mm256_or_si256(_mm256_and_si256(l1, m4), hi1),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4), hi2),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4), hi3),
    ]
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C. `row` holds whole Q6_K blocks, `y` at least as many.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q6_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    assert!(y.len() * 210 >= row.len());
    let m32 = _mm256_set1_epi8(32);
    let mut acc = _mm256_setzero_ps();
    for (b, y) in row.chunks_exact(210).zip(y) {
        prefetch_lines(b.as_ptr(), 4);
        // SAFETY: the 16 scale bytes are b[192..208].
        let scales = unsafe { _mm_loadu_si128(b.as_ptr().add(192) as *const __m128i) };
        let mut isum = _mm256_setzero_si256();
        for n in 0..2 {
            // SAFETY: ql[64 n..64 n + 64] < 128, qh at 128 + 32 n (32 bytes) < 192, and
            // activations 128 n..128 n + 128 < 256.
            let (l0, l1, h, ys) = unsafe {
                let p = b.as_ptr();
                let q8 = y.qs.as_ptr().add(128 * n);
                (
                    _mm256_loadu_si256(p.add(64 * n) as *const __m256i),
                    _mm256_loadu_si256(p.add(64 * n + 32) as *const __m256i),
                    _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i),
                    [
                        _mm256_loadu_si256(q8 as *const __m256i),
                        _mm256_loadu_si256(q8.add(32) as *const __m256i),
                        _mm256_loadu_si256(q8.add(64) as *const __m256i),
                        _mm256_loadu_si256(q8.add(96) as *const __m256i),
                    ],
                )
            };
            let q = q6_k_quarters(l0, l1, h);
            for k in 0..4 {
                // (q - 32) · y = q · y - 32 · y, both within i16 per pair.
                let p16 = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(q[k], ys[k]),
                    _mm256_maddubs_epi16(m32, ys[k]),
                );
                // SAFETY: a 16-byte row of the table.
                let shuffle = unsafe {
                    _mm_loadu_si128(Q6K_SCALE_SHUFFLE[4 * n + k].as_ptr() as *const __m128i)
                };
                let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, shuffle));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, sc));
            }
        }
        let d = _mm256_set1_ps(half_at(b, 208) * y.d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
    }
    hsum_ps(acc)
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `row` holds `x.len()` little-endian f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    assert!(row.len() >= 4 * x.len());
    let n = x.len();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: every load reads lanes i..i + 8 <= n of both.
    unsafe {
        let w = row.as_ptr() as *const f32;
        while i + 32 <= n {
            prefetch_lines(w.add(i) as *const u8, 2);
            for (k, a) in acc.iter_mut().enumerate() {
                let j = i + 8 * k;
                *a = _mm256_fmadd_ps(
                    _mm256_loadu_ps(w.add(j)),
                    _mm256_loadu_ps(x.as_ptr().add(j)),
                    *a,
                );
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(w.add(i)),
                _mm256_loadu_ps(x.as_ptr().add(i)),
                acc[0],
            );
            i += 8;
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut sum = hsum_ps(v);
    for j in i..n {
        let b = &row[4 * j..4 * j + 4];
        sum += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x[j];
    }
    sum
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `row` holds `x.len()` little-endian halves.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    assert!(row.len() >= 2 * x.len());
    let n = x.len();
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    // SAFETY: every load reads elements i..i + 8 <= n of both.
    unsafe {
        let w = row.as_ptr();
        while i + 16 <= n {
            prefetch_ahead(w.add(2 * i));
            for (k, a) in acc.iter_mut().enumerate() {
                let j = i + 8 * k;
                let h = _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * j) as *const __m128i));
                *a = _mm256_fmadd_ps(h, _mm256_loadu_ps(x.as_ptr().add(j)), *a);
            }
            i += 16;
        }
        while i + 8 <= n {
            let h = _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * i) as *const __m128i));
            acc[0] = _mm256_fmadd_ps(h, _mm256_loadu_ps(x.as_ptr().add(i)), acc[0]);
            i += 8;
        }
    }
    let mut sum = hsum_ps(_mm256_add_ps(acc[0], acc[1]));
    for j in i..n {
        sum += f16_to_f32(u16::from_le_bytes([row[2 * j], row[2 * j + 1]])) * x[j];
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_scale_unpacking_matches_the_reference() {
        let q: Vec<u8> = (0..12u32).map(|i| (i * 97 + 13) as u8).collect();
        let (scales, mins) = unpack_q4_k_scales(&q);
        for j in 0..8 {
            let (s, m) = super::super::dot::scale_min_k4(j, &q);
            assert_eq!(((scales >> (8 * j)) & 0xff) as i32, s, "scale {j}");
            assert_eq!(((mins >> (8 * j)) & 0xff) as i32, m, "min {j}");
        }
    }
}
