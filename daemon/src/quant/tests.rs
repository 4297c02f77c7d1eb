//! Round trips, block layouts and length checks. Bit-exactness against an independent
//! implementation is checked in `daemon/tests/quant_fixtures.rs`.

use half::f16;

use super::k_quants::{scale_min_k4, QK_K};
use super::*;

/// SplitMix64: deterministic test data without a `rand` dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn signed_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A row of `n` weights, each block of 32 with its own magnitude in [1e-2, 1e3].
    fn weights(&mut self, n: usize) -> Vec<f32> {
        let mut row = Vec::with_capacity(n);
        for _ in 0..n / 32 {
            let scale = 10f32.powf(2.5 * self.signed_unit() + 0.5);
            row.extend((0..32).map(|_| scale * self.signed_unit()));
        }
        row
    }
}

fn quantize_vec(ty: GgmlType, src: &[f32]) -> Vec<u8> {
    let bytes = ty.row_bytes(src.len() as u64).unwrap() as usize;
    let mut dst = vec![0u8; bytes];
    quantize_row(ty, src, &mut dst).unwrap();
    dst
}

fn dequantize_vec(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
    let mut dst = vec![0f32; n];
    dequantize_row(ty, src, &mut dst).unwrap();
    dst
}

#[test]
fn block_geometry_agrees_with_gguf_types() {
    fn check<B: BlockFormat>() {
        assert_eq!(B::BLOCK_SIZE as u64, B::TYPE.block_size(), "{}", B::TYPE);
        assert_eq!(B::BLOCK_BYTES as u64, B::TYPE.block_bytes(), "{}", B::TYPE);
    }
    check::<BlockQ8_0>();
    check::<BlockQ4_0>();
    check::<BlockQ4K>();
    check::<BlockQ6K>();
}

#[test]
fn blocks_read_from_unaligned_bytes_and_write_back_identically() {
    fn check<B: BlockFormat + PartialEq + std::fmt::Debug>(rng: &mut Rng) {
        // Offset 1 makes every 2-byte half field odd-aligned.
        let buf: Vec<u8> = (0..B::BLOCK_BYTES + 1)
            .map(|_| rng.next_u64() as u8)
            .collect();
        let block = B::from_bytes(&buf[1..]);
        let mut out = vec![0u8; B::BLOCK_BYTES];
        block.write_bytes(&mut out);
        assert_eq!(out, &buf[1..], "{}", B::TYPE);
        assert_eq!(B::from_bytes(&out), block);
    }
    let mut rng = Rng(1);
    for _ in 0..8 {
        check::<BlockQ8_0>(&mut rng);
        check::<BlockQ4_0>(&mut rng);
        check::<BlockQ4K>(&mut rng);
        check::<BlockQ6K>(&mut rng);
    }
}

#[test]
fn q8_0_round_trip_stays_within_half_a_step() {
    let mut rng = Rng(2);
    let src = rng.weights(32 * 64);
    let q = quantize_vec(GgmlType::Q8_0, &src);
    let y = dequantize_vec(GgmlType::Q8_0, &q, src.len());
    for (b, (x, y)) in src.chunks(32).zip(y.chunks(32)).enumerate() {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        // Half a step from rounding, plus 127 times the f16 rounding of the scale (2^-11).
        let bound = d * (0.5 + 127.0 / 2048.0) + amax * 1e-6;
        for (x, y) in x.iter().zip(y) {
            assert!(
                (x - y).abs() <= bound,
                "block {b}: {x} -> {y}, bound {bound}"
            );
        }
    }
}

#[test]
fn q4_0_round_trip_stays_within_one_step() {
    let mut rng = Rng(3);
    let src = rng.weights(32 * 64);
    let q = quantize_vec(GgmlType::Q4_0, &src);
    let y = dequantize_vec(GgmlType::Q4_0, &q, src.len());
    for (b, (x, y)) in src.chunks(32).zip(y.chunks(32)).enumerate() {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 8.0;
        // Half a step from rounding, except that a weight near -max lands on +8, which is
        // clamped to +7: a whole step. Plus 8 times the f16 rounding of the scale.
        let bound = d * (1.0 + 8.0 / 2048.0) + amax * 1e-6;
        for (x, y) in x.iter().zip(y) {
            assert!(
                (x - y).abs() <= bound,
                "block {b}: {x} -> {y}, bound {bound}"
            );
        }
    }
}

#[test]
fn q4_0_maps_the_first_largest_weight_to_minus_eight() {
    let mut src = [0.25f32; 32];
    src[5] = -2.0;
    src[9] = 2.0; // Same magnitude, later: the scale keeps the sign of src[5].
    let block = BlockQ4_0::quantize(&src);
    assert_eq!(block.d.to_f32(), 0.25);
    assert_eq!(block.qs[5] & 0x0f, 0);
    assert_eq!(block.qs[9] & 0x0f, 15, "+8 clamps to +7");
    let mut y = [0f32; 32];
    block.dequantize(&mut y);
    assert_eq!((y[5], y[9], y[0]), (-2.0, 1.75, 0.25));
}

#[test]
fn zero_blocks_quantize_to_zero_scale_and_zero_weights() {
    let zeros = [0f32; 64];
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
        let q = quantize_vec(ty, &zeros);
        assert_eq!(dequantize_vec(ty, &q, 64), zeros, "{ty}");
    }
    let q8 = BlockQ8_0::quantize(&zeros[..32]);
    assert_eq!((q8.d.to_bits(), q8.qs), (0, [0; 32]));
    // ggml computes the Q4_0 scale as `max / -8`, so a zero block gets d = -0.0.
    let q4 = BlockQ4_0::quantize(&zeros[..32]);
    assert_eq!((q4.d.to_bits(), q4.qs), (0x8000, [0x88; 16]));
}

#[test]
fn q8_0_rounds_halves_away_from_zero() {
    let mut src = [0f32; 32];
    src[0] = 127.0; // d = 1 exactly, so x * id = x.
    src[1..5].copy_from_slice(&[0.5, 1.5, -0.5, -2.5]);
    let block = BlockQ8_0::quantize(&src);
    assert_eq!(&block.qs[..5], &[127, 1, 2, -1, -3]);
}

#[test]
fn float_round_trips_stay_within_their_precision() {
    let mut rng = Rng(4);
    let src = rng.weights(1024);
    for (ty, rel) in [
        (GgmlType::F32, 0.0),
        (GgmlType::F16, 1.0 / 2048.0),
        (GgmlType::BF16, 1.0 / 256.0),
    ] {
        let y = dequantize_vec(ty, &quantize_vec(ty, &src), src.len());
        for (x, y) in src.iter().zip(&y) {
            // Below 2^-14 halves are subnormal and the error is absolute, at most 2^-25.
            let bound = (x.abs() * rel).max(if ty == GgmlType::F16 {
                2.0f32.powi(-25)
            } else {
                0.0
            });
            assert!((x - y).abs() <= bound, "{ty}: {x} -> {y}");
        }
    }
}

/// Packs eight 6-bit scales and mins the way ggml's `quantize_row_q4_K_ref` does.
fn pack_q4k_scales(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

#[test]
fn q4_k_unpacks_scales_mins_and_nibbles_in_ggml_order() {
    let ls = [1, 17, 33, 63, 2, 47, 16, 63];
    let lm = [0, 63, 5, 32, 48, 1, 31, 60];
    let scales = pack_q4k_scales(&ls, &lm);
    for j in 0..8 {
        assert_eq!(scale_min_k4(j, &scales), (ls[j], lm[j]), "sub-block {j}");
    }
    // Weight i gets the 4-bit value (i * 7) % 16, packed as ggml's quantizer packs it.
    let level = |i: usize| ((i * 7) % 16) as u8;
    let mut qs = [0u8; 128];
    for (j, chunk) in qs.chunks_exact_mut(32).enumerate() {
        for (l, q) in chunk.iter_mut().enumerate() {
            *q = level(64 * j + l) | (level(64 * j + l + 32) << 4);
        }
    }
    let block = BlockQ4K {
        d: f16::from_f32(0.5),
        dmin: f16::from_f32(0.25),
        scales,
        qs,
    };
    let mut y = [0f32; QK_K];
    block.dequantize(&mut y);
    for (i, y) in y.iter().enumerate() {
        let s = i / 32;
        let expected = 0.5 * f32::from(ls[s]) * f32::from(level(i)) - 0.25 * f32::from(lm[s]);
        assert_eq!(*y, expected, "weight {i}");
    }
}

#[test]
fn q6_k_unpacks_the_interleaved_layout_in_ggml_order() {
    // Weight i gets the 6-bit value (i * 37) % 64, packed as `quantize_row_q6_K_ref` does.
    let level = |i: usize| ((i * 37) % 64) as u8;
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for half in 0..2 {
        let (j, ql, qh) = (128 * half, &mut ql[64 * half..], &mut qh[32 * half..]);
        for l in 0..32 {
            let [a, b, c, e] = [0, 32, 64, 96].map(|o| level(j + l + o));
            ql[l] = (a & 0x0f) | ((c & 0x0f) << 4);
            ql[l + 32] = (b & 0x0f) | ((e & 0x0f) << 4);
            qh[l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
        }
    }
    let scales: [i8; 16] = std::array::from_fn(|i| (i as i8 - 8) * 15);
    let block = BlockQ6K {
        ql,
        qh,
        scales,
        d: f16::from_f32(0.125),
    };
    let mut y = [0f32; QK_K];
    block.dequantize(&mut y);
    for (i, y) in y.iter().enumerate() {
        let expected = 0.125 * f32::from(scales[i / 16]) * (f32::from(level(i)) - 32.0);
        assert_eq!(*y, expected, "weight {i}");
    }
}

#[test]
fn rows_of_partial_blocks_are_rejected() {
    let err = dequantize_row(GgmlType::Q4_0, &[0; 18], &mut [0.0; 33]).unwrap_err();
    assert_eq!(
        err,
        QuantError::PartialBlock {
            ty: GgmlType::Q4_0,
            elements: 33,
            block_size: 32
        }
    );
    let err = quantize_row(GgmlType::Q8_0, &[0.0; 16], &mut [0; 34]).unwrap_err();
    assert_eq!(
        err,
        QuantError::PartialBlock {
            ty: GgmlType::Q8_0,
            elements: 16,
            block_size: 32
        }
    );
    let err = dequantize_row(GgmlType::Q6K, &[0; 210], &mut [0.0; 255]).unwrap_err();
    assert!(matches!(
        err,
        QuantError::PartialBlock {
            block_size: 256,
            ..
        }
    ));
}

#[test]
fn byte_lengths_that_disagree_with_the_element_count_are_rejected() {
    let err = dequantize_row(GgmlType::Q4K, &[0; 143], &mut [0.0; 256]).unwrap_err();
    let want = QuantError::ByteLength {
        ty: GgmlType::Q4K,
        elements: 256,
        expected: 144,
        actual: 143,
    };
    assert_eq!(err, want);
    let err = dequantize_row(GgmlType::F16, &[0; 10], &mut [0.0; 4]).unwrap_err();
    assert!(matches!(
        err,
        QuantError::ByteLength {
            expected: 8,
            actual: 10,
            ..
        }
    ));
    let err = quantize_row(GgmlType::BF16, &[0.0; 4], &mut [0; 7]).unwrap_err();
    assert!(matches!(
        err,
        QuantError::ByteLength {
            expected: 8,
            actual: 7,
            ..
        }
    ));
    let err = quantize_row(GgmlType::Q4_0, &[0.0; 64], &mut [0; 34]).unwrap_err();
    assert!(matches!(
        err,
        QuantError::ByteLength {
            expected: 36,
            actual: 34,
            ..
        }
    ));
    // Empty rows are whole (zero) blocks.
    dequantize_row(GgmlType::Q8_0, &[], &mut []).unwrap();
}

#[test]
fn unimplemented_types_are_unsupported_whatever_the_lengths() {
    let err = dequantize_row(GgmlType::Q5_0, &[0; 3], &mut [0.0; 5]).unwrap_err();
    assert_eq!(err, QuantError::Unsupported(GgmlType::Q5_0));
    for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::IQ4XS] {
        assert_eq!(
            quantize_row(ty, &[0.0; 256], &mut [0; 210]),
            Err(QuantError::Unsupported(ty))
        );
    }
    assert_eq!(
        QuantError::Unsupported(GgmlType::Q2K).to_string(),
        "conversion of Q2_K tensors is not implemented"
    );
}
