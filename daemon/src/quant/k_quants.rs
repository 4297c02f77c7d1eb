//! The 256-weight "K" formats, Q4_K and Q6_K: super-blocks of sub-blocks, each sub-block with
//! its own small integer scale (ggml-quants.c, `dequantize_row_q4_K` / `dequantize_row_q6_K`).
//!
//! Only dequantization: the K-quant quantizers (an iterative search for scales and mins) are
//! not needed until the project writes K-quant files itself.

use half::f16;

use super::blocks::read_f16;
use super::float::fp16_to_fp32;
use super::BlockFormat;
use crate::gguf::GgmlType;

/// Weights per super-block (`QK_K`).
pub(crate) const QK_K: usize = 256;
/// Bytes of packed 6-bit scales and mins in a Q4_K block (`K_SCALE_SIZE`).
const K_SCALE_SIZE: usize = 12;

/// `block_q4_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qs[128]; }`.
///
/// Eight sub-blocks of 32 weights; sub-block `s` has a 6-bit scale `sc` and a 6-bit min `m`
/// (see [`scale_min_k4`]) and its weight `l` is `d * sc * q - dmin * m` with a 4-bit `q`.
/// Each 32 bytes of `qs` hold two sub-blocks: the first in the low nibbles, the next in the
/// high nibbles.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}

const _: () = assert!(size_of::<BlockQ4K>() == 144);

/// `block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }`.
///
/// Sixteen sub-blocks of 16 weights, each with a signed 8-bit scale; weight `q` is 6 bits,
/// its low 4 bits in `ql` and its high 2 bits in `qh`, stored with an offset of 32. The
/// interleaving is spelled out in [`BlockQ6K::dequantize`].
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

const _: () = assert!(size_of::<BlockQ6K>() == 210);

/// Scale and min of Q4_K sub-block `j` (0..8), ggml's `get_scale_min_k4`. Sub-blocks 0..4 keep
/// their 6 bits in the low bits of `q[j]` (scale) and `q[j + 4]` (min); sub-blocks 4..8 keep
/// their low 4 bits in the nibbles of `q[j + 4]` and their top 2 bits in the spare top bits of
/// `q[j - 4]` (scale) and `q[j]` (min).
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl BlockFormat for BlockQ4K {
    const TYPE: GgmlType = GgmlType::Q4K;
    const BLOCK_SIZE: usize = QK_K;
    const BLOCK_BYTES: usize = size_of::<Self>();

    fn from_bytes(bytes: &[u8]) -> Self {
        assert_eq!(bytes.len(), Self::BLOCK_BYTES, "Q4_K block length");
        Self {
            d: read_f16(bytes, 0),
            dmin: read_f16(bytes, 2),
            scales: bytes[4..16].try_into().expect("length checked above"),
            qs: bytes[16..].try_into().expect("length checked above"),
        }
    }

    fn write_bytes(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BLOCK_BYTES, "Q4_K block length");
        out[0..2].copy_from_slice(&self.d.to_bits().to_le_bytes());
        out[2..4].copy_from_slice(&self.dmin.to_bits().to_le_bytes());
        out[4..16].copy_from_slice(&self.scales);
        out[16..].copy_from_slice(&self.qs);
    }

    fn dequantize(&self, out: &mut [f32]) {
        assert_eq!(out.len(), QK_K, "Q4_K block size");
        let d = fp16_to_fp32(self.d.to_bits());
        let min = fp16_to_fp32(self.dmin.to_bits());
        // Every 32 bytes of qs carry sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles).
        for (j, (q, y)) in self
            .qs
            .chunks_exact(32)
            .zip(out.chunks_exact_mut(64))
            .enumerate()
        {
            let (sc, m) = scale_min_k4(2 * j, &self.scales);
            let (d1, m1) = (d * f32::from(sc), min * f32::from(m));
            let (sc, m) = scale_min_k4(2 * j + 1, &self.scales);
            let (d2, m2) = (d * f32::from(sc), min * f32::from(m));
            let (y1, y2) = y.split_at_mut(32);
            for ((&q, y1), y2) in q.iter().zip(y1).zip(y2) {
                *y1 = d1 * f32::from(q & 0x0f) - m1;
                *y2 = d2 * f32::from(q >> 4) - m2;
            }
        }
    }
}

impl BlockFormat for BlockQ6K {
    const TYPE: GgmlType = GgmlType::Q6K;
    const BLOCK_SIZE: usize = QK_K;
    const BLOCK_BYTES: usize = size_of::<Self>();

    fn from_bytes(bytes: &[u8]) -> Self {
        assert_eq!(bytes.len(), Self::BLOCK_BYTES, "Q6_K block length");
        Self {
            ql: bytes[0..128].try_into().expect("length checked above"),
            qh: bytes[128..192].try_into().expect("length checked above"),
            scales: std::array::from_fn(|i| bytes[192 + i] as i8),
            d: read_f16(bytes, 208),
        }
    }

    fn write_bytes(&self, out: &mut [u8]) {
        assert_eq!(out.len(), Self::BLOCK_BYTES, "Q6_K block length");
        out[0..128].copy_from_slice(&self.ql);
        out[128..192].copy_from_slice(&self.qh);
        for (o, &s) in out[192..208].iter_mut().zip(&self.scales) {
            *o = s as u8;
        }
        out[208..].copy_from_slice(&self.d.to_bits().to_le_bytes());
    }

    /// Each half of the block (128 weights) uses 64 bytes of `ql`, 32 of `qh` and 8 scales.
    /// Within a half, `ql[l]` holds weights `l` (low nibble) and `l + 64` (high nibble),
    /// `ql[l + 32]` weights `l + 32` and `l + 96`; `qh[l]` holds the top 2 bits of weights
    /// `l`, `l + 32`, `l + 64`, `l + 96` from its low bits up; scales go per 16 weights.
    fn dequantize(&self, out: &mut [f32]) {
        assert_eq!(out.len(), QK_K, "Q6_K block size");
        let d = fp16_to_fp32(self.d.to_bits());
        for (n, y) in out.chunks_exact_mut(128).enumerate() {
            let ql = &self.ql[64 * n..64 * n + 64];
            let qh = &self.qh[32 * n..32 * n + 32];
            let sc = &self.scales[8 * n..8 * n + 8];
            for l in 0..32 {
                let is = l / 16;
                // The 6-bit values are < 64, so the C casts to int8_t are value-preserving.
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                // C evaluates `d * sc[is] * q` left to right: (d * sc) * q.
                y[l] = d * f32::from(sc[is]) * f32::from(q1);
                y[l + 32] = d * f32::from(sc[is + 2]) * f32::from(q2);
                y[l + 64] = d * f32::from(sc[is + 4]) * f32::from(q3);
                y[l + 96] = d * f32::from(sc[is + 6]) * f32::from(q4);
            }
        }
    }
}
