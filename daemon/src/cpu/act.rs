//! Activations converted to the format ggml's CPU backend multiplies each weight type with
//! (`type_traits_cpu[t].vec_dot_type`): F32 rows take f32, F16 and BF16 rows take their own
//! type, Q8_0/Q4_0 rows take Q8_0 blocks and the K-quants take Q8_K super-blocks. Mirroring
//! this is what makes our logits agree with llama.cpp's to a few 1e-4 on quantized models.

use half::{bf16, f16};

use crate::gguf::GgmlType;
use crate::quant::{fp32_to_fp16, BlockQ8_0};

/// Weights per Q8_K super-block.
pub const QK_K: usize = 256;

/// `block_q8_K { float d; int8_t qs[256]; int16_t bsums[16]; }`: ggml's activation format for
/// the K-quants; `bsums[j]` is the sum of `qs[16 j..16 j + 16]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl BlockQ8K {
    /// ggml's `quantize_row_q8_K_ref`: the scale maps the element of largest magnitude to
    /// -127 (keeping its sign), rounding half to even.
    #[inline(always)]
    pub fn quantize(x: &[f32]) -> BlockQ8K {
        assert_eq!(x.len(), QK_K, "Q8_K block size");
        let (mut max, mut amax) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let mut b = BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        };
        if amax == 0.0 {
            return b;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| i16::from(v)).sum();
        }
        b.d = 1.0 / iscale;
        b
    }
}

/// Quantizes 32 activations to Q8_0 as ggml's x86 `quantize_row_q8_0` does (the SIMD version
/// llama.cpp runs on x86, which differs from `quantize_row_q8_0_ref` in the last bit):
/// `id = 127 / amax` rather than `1 / d`, and halves rounded to even.
#[inline(always)]
pub fn quantize_q8_0(x: &[f32]) -> BlockQ8_0 {
    assert_eq!(x.len(), 32, "Q8_0 block size");
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    BlockQ8_0 {
        d: f16::from_bits(fp32_to_fp16(d)),
        qs: std::array::from_fn(|j| (x[j] * id).round_ties_even() as i8),
    }
}

/// Which activation format a weight type is multiplied with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActFormat {
    F32,
    F16,
    BF16,
    Q8_0,
    Q8K,
}

impl ActFormat {
    pub fn for_weights(ty: GgmlType) -> ActFormat {
        match ty {
            GgmlType::F16 => ActFormat::F16,
            GgmlType::BF16 => ActFormat::BF16,
            GgmlType::Q8_0 | GgmlType::Q4_0 => ActFormat::Q8_0,
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => ActFormat::Q8K,
            _ => ActFormat::F32,
        }
    }
}

/// One activation vector in the format a weight type needs.
#[derive(Debug, Clone)]
pub enum Activation<'a> {
    F32(&'a [f32]),
    /// Rounded to the weights' 16-bit type and widened back: the products are then exact.
    Rounded(Vec<f32>),
    Q8_0(Vec<BlockQ8_0>),
    Q8K(Vec<BlockQ8K>),
}

impl<'a> Activation<'a> {
    /// Converts `x` for multiplication with rows of `ty`; `x.len()` must be whole blocks.
    pub fn new(ty: GgmlType, x: &'a [f32]) -> Activation<'a> {
        #[cfg(target_arch = "x86_64")]
        if super::Isa::detect() == super::Isa::Avx2 {
            // SAFETY: the CPU has the features.
            return unsafe { Self::new_avx2(ty, x) };
        }
        Self::convert(ty, x)
    }

    /// [`Activation::new`] compiled for AVX2: rounding becomes one instruction instead of a
    /// call into libm, and the loops vectorize; the results are the same (no fused
    /// operations are introduced, and the rounding mode is the same).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn new_avx2(ty: GgmlType, x: &'a [f32]) -> Activation<'a> {
        match ActFormat::for_weights(ty) {
            ActFormat::Q8_0 => {
                let mut blocks = Vec::with_capacity(x.len() / 32);
                for chunk in x.chunks_exact(32) {
                    blocks.push(simd::quantize_q8_0(chunk));
                }
                Activation::Q8_0(blocks)
            }
            ActFormat::Q8K => {
                let mut blocks = Vec::with_capacity(x.len() / QK_K);
                for chunk in x.chunks_exact(QK_K) {
                    blocks.push(simd::quantize_q8_k(chunk));
                }
                Activation::Q8K(blocks)
            }
            _ => Self::convert(ty, x),
        }
    }

    #[inline(always)]
    fn convert(ty: GgmlType, x: &'a [f32]) -> Activation<'a> {
        match ActFormat::for_weights(ty) {
            ActFormat::F32 => Activation::F32(x),
            ActFormat::F16 => {
                Activation::Rounded(x.iter().map(|&v| f16::from_f32(v).to_f32()).collect())
            }
            ActFormat::BF16 => {
                Activation::Rounded(x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect())
            }
            // Plain loops: an iterator adapter would be compiled outside the caller's target
            // features, and round through libm again.
            ActFormat::Q8_0 => {
                let mut blocks = Vec::with_capacity(x.len() / 32);
                for chunk in x.chunks_exact(32) {
                    blocks.push(quantize_q8_0(chunk));
                }
                Activation::Q8_0(blocks)
            }
            ActFormat::Q8K => {
                let mut blocks = Vec::with_capacity(x.len() / QK_K);
                for chunk in x.chunks_exact(QK_K) {
                    blocks.push(BlockQ8K::quantize(chunk));
                }
                Activation::Q8K(blocks)
            }
        }
    }
}

impl Activation<'_> {
    /// The values the kernels actually multiply with (for tests and diagnostics).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Activation::F32(x) => x.to_vec(),
            Activation::Rounded(x) => x.clone(),
            Activation::Q8_0(blocks) => {
                let mut out = vec![0.0; blocks.len() * 32];
                for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
                    crate::quant::BlockFormat::dequantize(b, o);
                }
                out
            }
            Activation::Q8K(blocks) => blocks
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| f32::from(q) * b.d))
                .collect(),
        }
    }
}

/// The quantizers above with AVX2: the same scales, and the same rounding of the same
/// products (a `vroundps` to nearest even, where the scalar code would call `rintf` for every
/// element), so the same blocks bit for bit.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{BlockQ8K, QK_K};
    use crate::quant::{fp32_to_fp16, BlockQ8_0};

    const ROUND: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// `|v|` for every lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn abs(v: __m256) -> __m256 {
        _mm256_andnot_ps(_mm256_set1_ps(-0.0), v)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    }

    /// 32 products rounded to nearest even, as bytes in order (saturating like `as i8`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn round_to_bytes(x: &[f32], scale: f32) -> __m256i {
        let s = _mm256_set1_ps(scale);
        let mut q = [_mm256_setzero_si256(); 4];
        for (q, x) in q.iter_mut().zip(x[..32].chunks_exact(8)) {
            // SAFETY: eight floats.
            let v = _mm256_mul_ps(unsafe { _mm256_loadu_ps(x.as_ptr()) }, s);
            *q = _mm256_cvtps_epi32(_mm256_round_ps::<ROUND>(v));
        }
        let w01 = _mm256_packs_epi32(q[0], q[1]);
        let w23 = _mm256_packs_epi32(q[2], q[3]);
        let b = _mm256_packs_epi16(w01, w23);
        // The packs work within 128-bit halves: dwords come out as 0 2 4 6 1 3 5 7.
        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// [`super::quantize_q8_0`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize_q8_0(x: &[f32]) -> BlockQ8_0 {
        assert_eq!(x.len(), 32, "Q8_0 block size");
        let mut m = _mm256_setzero_ps();
        for v in x.chunks_exact(8) {
            // SAFETY: eight floats.
            m = _mm256_max_ps(m, abs(unsafe { _mm256_loadu_ps(v.as_ptr()) }));
        }
        let amax = hmax(m);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut b = BlockQ8_0 {
            d: f16::from_bits(fp32_to_fp16(d)),
            qs: [0; 32],
        };
        let q = round_to_bytes(x, id);
        // SAFETY: `qs` is 32 bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, q) };
        b
    }

    /// [`BlockQ8K::quantize`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize_q8_k(x: &[f32]) -> BlockQ8K {
        assert_eq!(x.len(), QK_K, "Q8_K block size");
        let mut m = _mm256_setzero_ps();
        for v in x.chunks_exact(8) {
            // SAFETY: eight floats.
            m = _mm256_max_ps(m, abs(unsafe { _mm256_loadu_ps(v.as_ptr()) }));
        }
        let amax = hmax(m);
        let mut b = BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        };
        if amax == 0.0 {
            return b;
        }
        // The first element of that magnitude, with its sign (the scalar loop keeps the first).
        let max = *x
            .iter()
            .find(|v| v.abs() == amax)
            .expect("amax is some |x|");
        let iscale = -127.0 / max;
        for (k, q) in b.qs.chunks_exact_mut(32).enumerate() {
            let v = round_to_bytes(&x[32 * k..32 * k + 32], iscale);
            // SAFETY: 32 bytes.
            unsafe { _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, v) };
            // Sums of each 16 bytes: widen to i16 and add pairs down to one per 16.
            let lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
            let hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(v));
            let ones = _mm256_set1_epi16(1);
            let (lo, hi) = (_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
            let s = _mm256_hadd_epi32(lo, hi); // [lo01 lo23 hi01 hi23 | lo45 lo67 hi45 hi67]
            let s = _mm256_hadd_epi32(s, s); // [lo0-3 hi0-3 .. | lo4-7 hi4-7 ..]
            let s0 = _mm256_castsi256_si128(s);
            let s1 = _mm256_extracti128_si256::<1>(s);
            let t = _mm_add_epi32(s0, s1); // [lo, hi, lo, hi]
            b.bsums[2 * k] = _mm_cvtsi128_si32(t) as i16;
            b.bsums[2 * k + 1] = _mm_extract_epi32::<1>(t) as i16;
        }
        b.d = 1.0 / iscale;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_quantizers_make_the_same_blocks() {
        if super::super::Isa::detect() != super::super::Isa::Avx2 {
            return;
        }
        let mut x = crate::cpu::matvec::tests::noise(4 * QK_K, 17);
        // Exact halves (ties), a repeated largest magnitude of both signs, and a zero block.
        x[3] = 2.5 / 127.0;
        x[40] = -1.0;
        x[41] = 1.0;
        x[300] = 0.99999;
        x[301] = -0.99999;
        x[2 * QK_K..3 * QK_K].fill(0.0);
        for (a, b) in x.chunks_exact(32).zip(x.chunks_exact(32)) {
            // SAFETY: the CPU has AVX2, FMA and F16C.
            let fast = unsafe { simd::quantize_q8_0(a) };
            let slow = quantize_q8_0(b);
            assert_eq!((fast.d.to_bits(), fast.qs), (slow.d.to_bits(), slow.qs));
        }
        for c in x.chunks_exact(QK_K) {
            // SAFETY: as above.
            let fast = unsafe { simd::quantize_q8_k(c) };
            assert_eq!(fast, BlockQ8K::quantize(c));
            assert_eq!(fast.d.to_bits(), BlockQ8K::quantize(c).d.to_bits());
        }
    }

    #[test]
    fn q8_k_keeps_the_largest_magnitude_at_127_and_sums_groups() {
        let x: Vec<f32> = (0..QK_K).map(|i| (i as f32 - 100.0) * 0.01).collect();
        let b = BlockQ8K::quantize(&x);
        // The largest magnitude maps to -127 whatever its sign (d takes the sign).
        assert_eq!(b.qs[QK_K - 1], -127);
        assert!(b.d < 0.0);
        for (i, &q) in b.qs.iter().enumerate() {
            assert!((f32::from(q) * b.d - x[i]).abs() <= b.d.abs() * 0.5 + 1e-6);
        }
        let s: i32 = b.qs[16..32].iter().map(|&v| i32::from(v)).sum();
        assert_eq!(i32::from(b.bsums[1]), s);
        assert_eq!(BlockQ8K::quantize(&[0.0; QK_K]).d, 0.0);
    }
}
