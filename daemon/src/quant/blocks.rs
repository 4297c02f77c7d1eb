//! The 32-weight formats with one scale per block: Q8_0 and Q4_0 (ggml-quants.c).
//!
//! Their reference quantizers copy ggml's `quantize_row_*_ref` operation for operation, with
//! every product and sum rounded separately: that is what the C source means without
//! floating-point contraction, and what gguf-py computes. (A C compiler allowed to fuse
//! `x*id + 8.5f` into one FMA could differ in the last bit of an intermediate and, rarely, in
//! a quant.)

use half::f16;

use super::float::{fp16_to_fp32, fp32_to_fp16};
use super::{BlockFormat, QuantizeBlock};
use crate::gguf::GgmlType;

/// Weights per block of the 32-weight formats (`QK8_0`, `QK4_0`).
const QK: usize = 32;

/// `block_q8_0 { ggml_half d; int8_t qs[32]; }`: weight `i` is `qs[i] * d`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

const _: () = assert!(size_of::<BlockQ8_0>() == 34);

/// `block_q4_0 { ggml_half d; uint8_t qs[16]; }`: byte `j` holds weight `j` in its low nibble
/// and weight `j + 16` in its high nibble, each stored with an offset of 8.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

const _: () = assert!(size_of::<BlockQ4_0>() == 18);

/// The half at `bytes[at..at + 2]`, little-endian.
pub(super) fn read_f16(bytes: &[u8], at: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

impl BlockFormat for BlockQ8_0 {
    const TYPE: GgmlType = GgmlType::Q8_0;
    const BLOCK_SIZE: usize = QK;
    const BLOCK_BYTES: usize = size_of::<Self>();

    fn from_bytes(bytes: &[u8]) -> Self {
        assert_eq!(bytes.len(), Self::BLOCK_BYTES, "Q8_0 block length");
        Self {
            d: read_f16(bytes, 0),
            qs: std::array::from_fn(|i| bytes[2 + i] as i8),
        }
    }

    fn write_bytes(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BLOCK_BYTES, "Q8_0 block length");
        out[..2].copy_from_slice(&self.d.to_bits().to_le_bytes());
        for (o, &q) in out[2..].iter_mut().zip(&self.qs) {
            *o = q as u8;
        }
    }

    fn dequantize(&self, out: &mut [f32]) {
        assert_eq!(out.len(), QK, "Q8_0 block size");
        let d = fp16_to_fp32(self.d.to_bits());
        for (y, &q) in out.iter_mut().zip(&self.qs) {
            *y = f32::from(q) * d;
        }
    }
}

impl QuantizeBlock for BlockQ8_0 {
    fn quantize(src: &[f32]) -> Self {
        assert_eq!(src.len(), QK, "Q8_0 block size");
        // ggml's `MAX(a, b)` is `a > b ? a : b`, which differs from `f32::max` on NaN.
        let amax = src.iter().fold(
            0.0_f32,
            |amax, v| if amax > v.abs() { amax } else { v.abs() },
        );
        let d = amax / 127.0;
        // C's `d ? 1.0f/d : 0.0f`: a NaN scale counts as non-zero.
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        Self {
            d: f16::from_bits(fp32_to_fp16(d)),
            // `roundf` rounds halves away from zero, as `f32::round` does; |x * id| <= 127.
            qs: std::array::from_fn(|j| (src[j] * id).round() as i8),
        }
    }
}

impl BlockFormat for BlockQ4_0 {
    const TYPE: GgmlType = GgmlType::Q4_0;
    const BLOCK_SIZE: usize = QK;
    const BLOCK_BYTES: usize = size_of::<Self>();

    fn from_bytes(bytes: &[u8]) -> Self {
        assert_eq!(bytes.len(), Self::BLOCK_BYTES, "Q4_0 block length");
        Self {
            d: read_f16(bytes, 0),
            qs: bytes[2..].try_into().expect("length checked above"),
        }
    }

    fn write_bytes(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BLOCK_BYTES, "Q4_0 block length");
        out[..2].copy_from_slice(&self.d.to_bits().to_le_bytes());
        out[2..].copy_from_slice(&self.qs);
    }

    fn dequantize(&self, out: &mut [f32]) {
        assert_eq!(out.len(), QK, "Q4_0 block size");
        let d = fp16_to_fp32(self.d.to_bits());
        let (lo, hi) = out.split_at_mut(QK / 2);
        for ((&q, y0), y1) in self.qs.iter().zip(lo).zip(hi) {
            let x0 = i32::from(q & 0x0f) - 8;
            let x1 = i32::from(q >> 4) - 8;
            // |x| <= 8, so the int-to-float conversion is exact, as in C.
            *y0 = x0 as f32 * d;
            *y1 = x1 as f32 * d;
        }
    }
}

impl QuantizeBlock for BlockQ4_0 {
    fn quantize(src: &[f32]) -> Self {
        assert_eq!(src.len(), QK, "Q4_0 block size");
        // The scale keeps the sign of the first weight of largest magnitude, so that this
        // weight maps to -8, the end of the range that has no positive counterpart.
        let (mut amax, mut max) = (0.0_f32, 0.0_f32);
        for &v in src {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        // `(int8_t)(x + 8.5f)` truncates toward zero, i.e. rounds x + 8 half-up; +max
        // lands on 16, which `MIN(15, ...)` clamps.
        let quant = |x: f32| ((x * id + 8.5) as i8).min(15) as u8;
        let (lo, hi) = src.split_at(QK / 2);
        Self {
            d: f16::from_bits(fp32_to_fp16(d)),
            qs: std::array::from_fn(|j| quant(lo[j]) | (quant(hi[j]) << 4)),
        }
    }
}
