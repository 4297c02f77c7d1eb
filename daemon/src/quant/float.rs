//! Scalar float formats (F32, F16, BF16): element conversions that reproduce ggml's exactly,
//! including what it does with NaNs, and whole-row conversions over little-endian bytes.
//!
//! The conversions are written out bit by bit instead of going through `half`, because `half`
//! keeps NaN payloads when narrowing while ggml's reference does not, and because a test that
//! compares against ggml must not depend on which CPU features `half` detects at run time.

/// Widens IEEE binary16 bits to f32, as ggml's `GGML_FP16_TO_FP32` does: exact for every
/// non-NaN value; a NaN keeps its sign and payload and comes back quiet (ggml's portable
/// version gets there by multiplying the NaN, F16C and ARM's `fcvt` by converting it).
pub const fn fp16_to_fp32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x03ff) as u32;
    let bits = if exp == 0x1f {
        if man == 0 {
            0x7f80_0000
        } else {
            0x7fc0_0000 | (man << 13)
        }
    } else if exp != 0 {
        ((exp + 127 - 15) << 23) | (man << 13)
    } else if man == 0 {
        0
    } else {
        // Subnormal half: shift the mantissa up until its leading one is the implicit bit.
        let shift = man.leading_zeros() - 21;
        ((127 - 15 + 1 - shift) << 23) | ((man << (13 + shift)) & 0x007f_ffff)
    };
    f32::from_bits(sign | bits)
}

/// Narrows f32 to binary16 bits with ggml's portable `ggml_compute_fp32_to_fp16` (the one the
/// base library's `ggml_fp32_to_fp16_row` uses on x86): round to nearest even, overflow to
/// infinity, and every NaN becomes the canonical quiet NaN `0x7e00` with the input's sign.
/// (ggml's aarch64 builds use the hardware conversion, which keeps NaN payloads instead.)
pub fn fp32_to_fp16(f: f32) -> u16 {
    // Port of the branch-free rounding trick (from the FP16 library ggml borrows it from):
    // adding a power of two chosen from the input's exponent makes the float adder do the
    // round-to-nearest-even at the half's precision, subnormal halves included.
    const SCALE_TO_INF: f32 = f32::from_bits(0x7780_0000); // 2^112
    const SCALE_TO_ZERO: f32 = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (f.abs() * SCALE_TO_INF) * SCALE_TO_ZERO;

    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let bias = (shl1_w & 0xff00_0000).max(0x7100_0000);

    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7c00;
    let mantissa_bits = bits & 0x0000_0fff;
    let nonsign = exp_bits + mantissa_bits;
    let magnitude = if shl1_w > 0xff00_0000 {
        0x7e00
    } else {
        nonsign
    };
    ((sign >> 16) | magnitude) as u16
}

/// Widens bfloat16 bits to f32: the upper half of the f32, NaNs untouched (`GGML_BF16_TO_FP32`).
pub const fn bf16_to_fp32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Narrows f32 to bfloat16 bits as ggml's `ggml_compute_fp32_to_bf16` does: round to nearest
/// even (so the largest finite floats round up to infinity), subnormals kept, and a NaN
/// truncated with its quiet bit forced on so that truncation cannot turn it into infinity.
pub const fn fp32_to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    // Cannot overflow: the largest non-NaN input, 0xff80_0000, plus 0x8000 fits in u32.
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// Little-endian f32 bytes to f32s (a bit-exact copy; NaN payloads survive).
pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (bytes, y) in src.chunks_exact(4).zip(dst) {
        *y = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    }
}

pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (bytes, y) in src.chunks_exact(2).zip(dst) {
        *y = fp16_to_fp32(u16::from_le_bytes([bytes[0], bytes[1]]));
    }
}

pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (bytes, y) in src.chunks_exact(2).zip(dst) {
        *y = bf16_to_fp32(u16::from_le_bytes([bytes[0], bytes[1]]));
    }
}

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (x, bytes) in src.iter().zip(dst.chunks_exact_mut(4)) {
        bytes.copy_from_slice(&x.to_le_bytes());
    }
}

pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (&x, bytes) in src.iter().zip(dst.chunks_exact_mut(2)) {
        bytes.copy_from_slice(&fp32_to_fp16(x).to_le_bytes());
    }
}

pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (&x, bytes) in src.iter().zip(dst.chunks_exact_mut(2)) {
        bytes.copy_from_slice(&fp32_to_bf16(x).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn fp16_to_fp32_is_exact_for_every_half_and_quiets_nans() {
        for h in 0..=u16::MAX {
            let ours = fp16_to_fp32(h);
            let theirs = f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                let expected =
                    (u32::from(h & 0x8000) << 16) | 0x7fc0_0000 | (u32::from(h & 0x3ff) << 13);
                assert_eq!(ours.to_bits(), expected, "half {h:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "half {h:#06x}");
            }
        }
    }

    #[test]
    fn fp32_to_fp16_rounds_to_nearest_even_like_half() {
        // Every half value, the midpoints next to it (ties) and points just off them.
        for h in 0..=u16::MAX {
            let x = f16::from_bits(h).to_f32();
            if x.is_nan() {
                continue;
            }
            let b = x.to_bits();
            for probe in [
                b,
                b.wrapping_add(0x1000),
                b.wrapping_add(0x0fff),
                b.wrapping_add(0x1001),
            ] {
                let p = f32::from_bits(probe);
                if p.is_nan() {
                    continue;
                }
                assert_eq!(
                    fp32_to_fp16(p),
                    f16::from_f32(p).to_bits(),
                    "f32 {probe:#010x}"
                );
            }
        }
        for x in [
            65519.99_f32,
            65520.0,
            1e10,
            f32::INFINITY,
            f32::MAX,
            2.98e-8,
            2.99e-8,
            1e-30,
        ] {
            assert_eq!(fp32_to_fp16(x), f16::from_f32(x).to_bits(), "{x}");
            assert_eq!(fp32_to_fp16(-x), f16::from_f32(-x).to_bits(), "{}", -x);
        }
    }

    #[test]
    fn fp32_to_fp16_makes_every_nan_canonical() {
        for bits in [0x7f80_0001_u32, 0x7fc0_0000, 0x7fff_ffff, 0x7fa0_1234] {
            assert_eq!(fp32_to_fp16(f32::from_bits(bits)), 0x7e00);
            assert_eq!(fp32_to_fp16(f32::from_bits(bits | 0x8000_0000)), 0xfe00);
        }
    }

    #[test]
    fn bf16_conversions_follow_ggml() {
        // Ties go to even: 0x3f80_8000 stays at 0x3f80, 0x3f81_8000 goes up to 0x3f82.
        assert_eq!(fp32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(fp32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(fp32_to_bf16(f32::MAX), 0x7f80);
        // Subnormals are rounded, not flushed (current ggml; old versions flushed them).
        assert_eq!(fp32_to_bf16(f32::from_bits(0x0000_8001)), 0x0001);
        // A signalling NaN whose payload lies in the dropped bits must stay a NaN.
        assert_eq!(fp32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(fp32_to_bf16(f32::from_bits(0xff81_0000)), 0xffc1);
        for x in [0.0_f32, -0.0, 1.0, -3.5e-20, 1e30, f32::INFINITY] {
            assert_eq!(fp32_to_bf16(x), bf16::from_f32(x).to_bits(), "{x}");
        }
        for h in 0..=u16::MAX {
            assert_eq!(bf16_to_fp32(h).to_bits(), u32::from(h) << 16);
        }
    }
}
