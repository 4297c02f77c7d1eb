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
        Self::convert(ty, x)
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

#[cfg(test)]
mod tests {
    use super::*;

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
