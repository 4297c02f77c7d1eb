//! Random tensor data, written block by block straight into the file's byte layout.
//!
//! The distribution, chosen so that a forward pass gives finite, non-degenerate logits:
//! - weight matrices and embeddings dequantize to values with mean 0 and standard deviation
//!   [`WEIGHT_STD`] (0.02, the usual transformer initialisation). Float types get an approximately
//!   normal value per element (Irwin–Hall, bounded at ±3.5σ). Quantized types get uniformly random
//!   quants and per-block scales picked so that the dequantized block has that standard deviation:
//!   each block's scale is jittered ±25% (real blocks differ), and its sign is random for the
//!   symmetric formats (ggml's Q4_0/Q8_0/Q6_K scale takes the sign of the block's largest value, so
//!   both signs occur in real files too); for Q4_K/Q5_K the sub-block minimum is set to centre the
//!   sub-block on zero (`dmin·m = d·sc·(2^bits − 1)/2`, with m = sc);
//! - norm weights are F32, 1 + 0.02·N(0,1);
//! - fixed tables (Llama 3 RoPE frequency factors) are written as computed.

use crate::gguf::GgmlType;
use half::{bf16, f16};

use super::rng::Xoshiro256;

/// Standard deviation of every random weight matrix, embeddings included.
pub const WEIGHT_STD: f32 = 0.02;
/// Noise around 1.0 of norm weights.
const NORM_NOISE: f32 = 0.02;

/// What a tensor's data is.
#[derive(Debug, Clone, PartialEq)]
pub enum Init {
    /// Random, mean 0, this standard deviation after dequantization.
    Random { std: f32 },
    /// A norm weight: F32 around 1.0.
    NearOne,
    /// Exactly these F32 values.
    Values(Vec<f32>),
}

/// A ggml type this generator cannot produce.
#[derive(Debug, thiserror::Error)]
#[error("no random-block generator for ggml type {0}")]
pub struct UnsupportedType(pub GgmlType);

/// Types whose blocks [`fill_blocks`] can generate.
pub const GENERATED_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// RMS of `q − offset` for a uniformly random `bits`-bit quant centred by `offset = 2^(bits−1)`
/// (the Q4_0/Q6_K convention: the mean is −0.5, which the random block sign cancels).
fn centred_rms(bits: u32) -> f32 {
    let n = (1u32 << bits) as f32;
    ((n * n - 1.0) / 12.0 + 0.25).sqrt()
}

/// RMS of `q − (2^bits − 1)/2` for a uniformly random quant (the Q4_K/Q5_K convention).
fn symmetric_rms(bits: u32) -> f32 {
    let n = (1u32 << bits) as f32;
    ((n * n - 1.0) / 12.0).sqrt()
}

/// RMS of a sub-scale drawn uniformly from `lo..=hi`.
fn uniform_rms(lo: u32, hi: u32) -> f32 {
    let (lo, hi) = (lo as f32, hi as f32);
    let mean = (lo + hi) / 2.0;
    let n = hi - lo + 1.0;
    (mean * mean + (n * n - 1.0) / 12.0).sqrt()
}

/// Sub-scale ranges of the k-quants: wide enough to vary, high enough to keep precision.
const K_SCALE: (u32, u32) = (32, 63);
const Q6K_SCALE: (u32, u32) = (16, 63);

fn jitter(rng: &mut Xoshiro256) -> f32 {
    0.75 + 0.5 * rng.unit_f32()
}

fn random_sign(rng: &mut Xoshiro256) -> f32 {
    if rng.next_u64() >> 63 == 0 {
        1.0
    } else {
        -1.0
    }
}

fn put_f16(out: &mut [u8], v: f32) {
    out[..2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Fills `out`, a whole number of `ty` blocks, with values following `init`. `first_element` is
/// the index of the tensor element `out` starts at (for [`Init::Values`]).
pub fn fill(
    ty: GgmlType,
    init: &Init,
    first_element: u64,
    rng: &mut Xoshiro256,
    out: &mut [u8],
) -> Result<(), UnsupportedType> {
    match init {
        Init::Random { std } => fill_blocks(ty, *std, rng, out),
        Init::NearOne => fill_floats(ty, out, |_| 1.0 + NORM_NOISE * rng.normal_f32()),
        Init::Values(values) => fill_floats(ty, out, |i| {
            values
                .get((first_element + i as u64) as usize)
                .copied()
                .unwrap_or(0.0)
        }),
    }
}

fn fill_floats(
    ty: GgmlType,
    out: &mut [u8],
    mut value: impl FnMut(usize) -> f32,
) -> Result<(), UnsupportedType> {
    match ty {
        GgmlType::F32 => out
            .chunks_exact_mut(4)
            .enumerate()
            .for_each(|(i, c)| c.copy_from_slice(&value(i).to_le_bytes())),
        GgmlType::F16 => out
            .chunks_exact_mut(2)
            .enumerate()
            .for_each(|(i, c)| c.copy_from_slice(&f16::from_f32(value(i)).to_le_bytes())),
        GgmlType::BF16 => out
            .chunks_exact_mut(2)
            .enumerate()
            .for_each(|(i, c)| c.copy_from_slice(&bf16::from_f32(value(i)).to_le_bytes())),
        other => return Err(UnsupportedType(other)),
    }
    Ok(())
}

/// Random blocks of `ty` whose dequantized values have mean 0 and standard deviation `std`.
pub fn fill_blocks(
    ty: GgmlType,
    std: f32,
    rng: &mut Xoshiro256,
    out: &mut [u8],
) -> Result<(), UnsupportedType> {
    let bytes = ty.block_bytes() as usize;
    debug_assert_eq!(out.len() % bytes, 0);
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            // The rng is borrowed by the closure; floats need no per-block state.
            return fill_floats(ty, out, |_| std * rng.normal_f32());
        }
        GgmlType::Q8_0 => {
            // block_q8_0 { d: f16, qs: [i8; 32] }; x = d·q, q in [-127, 127].
            let d = std / symmetric_rms(8);
            for b in out.chunks_exact_mut(bytes) {
                put_f16(b, random_sign(rng) * d * jitter(rng));
                rng.fill_bytes(&mut b[2..]);
                // ggml rounds to [-127, 127]; -128 never occurs in a real file.
                b[2..]
                    .iter_mut()
                    .filter(|q| **q == 0x80)
                    .for_each(|q| *q = 0x81);
            }
        }
        GgmlType::Q4_0 => {
            // block_q4_0 { d: f16, qs: [u8; 16] }; x = d·(q − 8).
            let d = std / centred_rms(4);
            for b in out.chunks_exact_mut(bytes) {
                put_f16(b, random_sign(rng) * d * jitter(rng));
                rng.fill_bytes(&mut b[2..]);
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            // block_q4_K { d, dmin: f16, scales: [u8; 12], qs: [u8; 128] } and block_q5_K, which
            // adds qh: [u8; 32] before qs; x = d·sc·q − dmin·m per 32-element sub-block.
            let bits = if ty == GgmlType::Q4K { 4 } else { 5 };
            let half_range = ((1u32 << bits) - 1) as f32 / 2.0;
            let d = std / (uniform_rms(K_SCALE.0, K_SCALE.1) * symmetric_rms(bits));
            for b in out.chunks_exact_mut(bytes) {
                let d = d * jitter(rng);
                put_f16(&mut b[0..], d);
                put_f16(&mut b[2..], d * half_range);
                let mut sc = [0u8; 8];
                sc.iter_mut()
                    .for_each(|s| *s = rng.range_inclusive(K_SCALE.0, K_SCALE.1) as u8);
                b[4..16].copy_from_slice(&pack_k_scales(&sc, &sc));
                rng.fill_bytes(&mut b[16..]);
            }
        }
        GgmlType::Q6K => {
            // block_q6_K { ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16 };
            // x = d·scale·(q − 32) per 16-element sub-block.
            let d = std / (uniform_rms(Q6K_SCALE.0, Q6K_SCALE.1) * centred_rms(6));
            for b in out.chunks_exact_mut(bytes) {
                rng.fill_bytes(&mut b[..192]);
                for s in &mut b[192..208] {
                    let mag = rng.range_inclusive(Q6K_SCALE.0, Q6K_SCALE.1) as i8;
                    *s = (mag * random_sign(rng) as i8) as u8;
                }
                put_f16(&mut b[208..], d * jitter(rng));
            }
        }
        other => return Err(UnsupportedType(other)),
    }
    Ok(())
}

/// Packs eight 6-bit scales and mins the way ggml's `get_scale_min_k4` unpacks them.
fn pack_k_scales(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..8 {
        let (ls, lm) = (scales[j] & 63, mins[j] & 63);
        if j < 4 {
            q[j] = ls;
            q[j + 4] = lm;
        } else {
            q[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            q[j - 4] |= (ls >> 4) << 6;
            q[j] |= (lm >> 4) << 6;
        }
    }
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_at(b: &[u8]) -> f32 {
        f16::from_le_bytes([b[0], b[1]]).to_f32()
    }

    /// ggml's `get_scale_min_k4`.
    fn scale_min(j: usize, q: &[u8]) -> (f32, f32) {
        if j < 4 {
            ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
        } else {
            (
                ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)) as f32,
                ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as f32,
            )
        }
    }

    /// Reference dequantization (after ggml-quants.c), independent of the daemon's kernels.
    fn dequant(ty: GgmlType, data: &[u8]) -> Vec<f32> {
        let mut y = Vec::new();
        for b in data.chunks_exact(ty.block_bytes() as usize) {
            match ty {
                GgmlType::Q8_0 => {
                    let d = f16_at(b);
                    y.extend(b[2..].iter().map(|&q| d * f32::from(q as i8)));
                }
                GgmlType::Q4_0 => {
                    let d = f16_at(b);
                    let qs = &b[2..];
                    y.extend(qs.iter().map(|&q| d * ((q & 0xF) as f32 - 8.0)));
                    y.extend(qs.iter().map(|&q| d * ((q >> 4) as f32 - 8.0)));
                }
                GgmlType::Q4K | GgmlType::Q5K => {
                    let (d, dmin) = (f16_at(b), f16_at(&b[2..]));
                    let five = ty == GgmlType::Q5K;
                    let (qh, qs) = if five {
                        (&b[16..48], &b[48..])
                    } else {
                        (&b[16..16], &b[16..])
                    };
                    for j in 0..8 {
                        let (sc, m) = scale_min(j, &b[4..16]);
                        for l in 0..32 {
                            let byte = qs[(j / 2) * 32 + l];
                            let mut q = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
                            if five && qh[l] & (1 << j) != 0 {
                                q += 16;
                            }
                            y.push(d * sc * q as f32 - dmin * m);
                        }
                    }
                }
                GgmlType::Q6K => {
                    let (ql, qh, sc, d) =
                        (&b[..128], &b[128..192], &b[192..208], f16_at(&b[208..]));
                    let mut out = [0f32; 256];
                    for n in 0..2 {
                        let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                        for l in 0..32 {
                            let is = 8 * n + l / 16;
                            let q = [
                                (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                                (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                            ];
                            for (k, q) in q.iter().enumerate() {
                                let s = f32::from(sc[is + 2 * k] as i8);
                                out[128 * n + 32 * k + l] = d * s * (*q as f32 - 32.0);
                            }
                        }
                    }
                    y.extend_from_slice(&out);
                }
                GgmlType::F32 => y.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                GgmlType::F16 => y.push(f16_at(b)),
                GgmlType::BF16 => y.push(bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                _ => unreachable!(),
            }
        }
        y
    }

    #[test]
    fn every_generated_type_dequantizes_to_the_target_std() {
        for &ty in GENERATED_TYPES {
            let blocks = 4096 / ty.block_size() as usize * 16;
            let mut data = vec![0u8; blocks * ty.block_bytes() as usize];
            let mut rng = Xoshiro256::seed_from(3);
            fill_blocks(ty, WEIGHT_STD, &mut rng, &mut data).unwrap();
            let y = dequant(ty, &data);
            let n = y.len() as f64;
            let mean = y.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
            let std = (y.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n).sqrt();
            assert!(y.iter().all(|v| v.is_finite()), "{ty}");
            assert!(mean.abs() < 0.002, "{ty}: mean {mean}");
            assert!(
                (std / f64::from(WEIGHT_STD) - 1.0).abs() < 0.05,
                "{ty}: std {std}"
            );
        }
    }

    #[test]
    fn k_scales_pack_as_ggml_unpacks() {
        let sc = [1, 17, 33, 63, 5, 40, 62, 31];
        let m = [63, 0, 12, 45, 60, 2, 33, 16];
        let q = pack_k_scales(&sc, &m);
        for j in 0..8 {
            assert_eq!(scale_min(j, &q), (sc[j] as f32, m[j] as f32));
        }
    }

    #[test]
    fn values_and_norms_are_written_as_given() {
        let mut rng = Xoshiro256::seed_from(1);
        let mut out = [0u8; 8];
        fill(
            GgmlType::F32,
            &Init::Values(vec![1.0, 2.0, 3.0]),
            1,
            &mut rng,
            &mut out,
        )
        .unwrap();
        assert_eq!(dequant(GgmlType::F32, &out), [2.0, 3.0]);
        fill(GgmlType::F32, &Init::NearOne, 0, &mut rng, &mut out).unwrap();
        assert!(dequant(GgmlType::F32, &out)
            .iter()
            .all(|v| (v - 1.0).abs() < 0.1));
        assert!(fill(GgmlType::Q4_0, &Init::NearOne, 0, &mut rng, &mut out).is_err());
    }
}
