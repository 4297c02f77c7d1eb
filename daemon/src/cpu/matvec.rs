//! Matrix-vector and matrix-matrix products over quantized rows, split by rows across the
//! thread pool. A matrix-matrix product reads each weight row once for all tokens of a batch
//! (the row stays in L1 while it meets every activation), which is what makes prompt
//! processing cheaper per token than decoding; the per-pair dot products are the same as
//! [`matvec`]'s, so results are bit-identical to multiplying the tokens one by one.

use crate::gguf::GgmlType;
use crate::model::MatRef;

use super::act::Activation;
#[cfg(target_arch = "x86_64")]
use super::gemm_avx2;
#[cfg(target_arch = "x86_64")]
use super::gemm_avx512;
use super::kernels::{dot_kernel, Isa};
use super::pool::ThreadPool;

/// Rows per task: enough work to amortise claiming a task, few enough to balance the load.
pub(super) fn rows_per_task(n_rows: usize, n_threads: usize) -> usize {
    (n_rows / (4 * n_threads)).clamp(8, 256)
}

/// Fewest tokens for which unpacking a row into a panel pays: below it (a few sequences
/// decoding together, an expert few tokens chose) each row is dotted with each token directly.
/// Both ways give the same bits. (Only x86-64 has the panels; elsewhere the CPU experts'
/// one-job path takes its limit from here too, [`super::ffn_group`].)
pub(super) const MIN_PANEL_TOKENS: usize = 4;

/// `out[i] = row_i(m) · x` for every row of `m`.
///
/// # Panics
/// If `x.len() != m.n_in` or `out.len() != m.n_out`.
pub fn matvec(pool: &ThreadPool, m: MatRef<'_>, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), m.n_in, "matvec input width");
    assert_eq!(out.len(), m.n_out, "matvec output height");
    let act = Activation::new(m.ty, x);
    matvec_act(pool, m, &act, out);
}

/// Like [`matvec`] with the activation already converted for `m.ty`.
pub fn matvec_act(pool: &ThreadPool, m: MatRef<'_>, act: &Activation<'_>, out: &mut [f32]) {
    matvec_with(pool, m, act, out, Isa::detect());
}

/// [`matvec_act`] on a chosen instruction set (tests compare them).
pub fn matvec_with(
    pool: &ThreadPool,
    m: MatRef<'_>,
    act: &Activation<'_>,
    out: &mut [f32],
    isa: Isa,
) {
    let dot = dot_kernel(m.ty, isa);
    let chunk = rows_per_task(m.n_out, pool.n_threads());
    pool.for_each_chunk(out, chunk, &|start, part| {
        for (k, o) in part.iter_mut().enumerate() {
            *o = dot(m.row(start + k), act);
        }
    });
}

/// `out[b * n_out + i] = row_i(m) · xs[b * n_in..]` for the `xs.len() / n_in` tokens of a
/// batch (token-major in and out).
///
/// # Panics
/// If `xs` is not whole rows of `m.n_in` or `out` not as many rows of `m.n_out`.
pub fn matmul(pool: &ThreadPool, m: MatRef<'_>, xs: &[f32], out: &mut [f32]) {
    assert!(
        m.n_in > 0 && xs.len().is_multiple_of(m.n_in),
        "matmul input width"
    );
    let acts = activations(m.ty, xs, m.n_in);
    matmul_act(pool, m, &acts, out);
}

/// The rows of `xs` (each `width` wide) converted for multiplication with rows of `ty`.
pub fn activations(ty: GgmlType, xs: &[f32], width: usize) -> Vec<Activation<'_>> {
    xs.chunks_exact(width)
        .map(|x| Activation::new(ty, x))
        .collect()
}

/// [`matmul`] over tokens already converted for `m.ty` (so that several matrices, or the
/// experts a token is routed to, share one conversion).
///
/// # Panics
/// If `out` is not `acts.len()` rows of `m.n_out`, or an activation's format or width does not
/// fit `m`.
pub fn matmul_act(pool: &ThreadPool, m: MatRef<'_>, acts: &[Activation<'_>], out: &mut [f32]) {
    let n_tok = acts.len();
    assert_eq!(out.len(), n_tok * m.n_out, "matmul output size");
    if n_tok == 1 {
        return matvec_act(pool, m, &acts[0], out);
    }
    let rows_per = rows_per_task(m.n_out, pool.n_threads());
    let isa = Isa::detect();
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2
        && gemm_avx512::supports(m.ty)
        && n_tok >= MIN_PANEL_TOKENS
        && gemm_avx512::available()
    {
        // SAFETY: `available` found the features.
        let batch = unsafe { gemm_avx512::Batch::new(m.ty, acts) };
        let dst = OutPtr(out.as_mut_ptr());
        pool.run(m.n_out.div_ceil(rows_per), &|task| {
            let dst = &dst;
            let end = ((task + 1) * rows_per).min(m.n_out);
            // SAFETY: as below; rows `task * rows_per..end` of every token are this task's.
            unsafe { gemm_avx512::products(&batch, m, task * rows_per, end, dst.0, m.n_out) };
        });
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && gemm_avx2::supports(m.ty) && n_tok >= MIN_PANEL_TOKENS {
        // SAFETY: `Isa::detect` found AVX2, FMA and F16C.
        let batch = unsafe { gemm_avx2::Batch::new(m.ty, acts) };
        let dst = OutPtr(out.as_mut_ptr());
        let n_tasks = m.n_out.div_ceil(rows_per);
        pool.run(n_tasks, &|task| {
            let dst = &dst;
            let mut panel = gemm_avx2::Panel::default();
            let end = ((task + 1) * rows_per).min(m.n_out);
            for first in (task * rows_per..end).step_by(gemm_avx2::PANEL_ROWS) {
                let n_rows = gemm_avx2::PANEL_ROWS.min(end - first);
                let mut rows: [&[u8]; gemm_avx2::PANEL_ROWS] = Default::default();
                for (k, row) in rows[..n_rows].iter_mut().enumerate() {
                    *row = m.row(first + k);
                }
                // SAFETY: the CPU features as above; the panel is unpacked for this batch
                // just before; `out` has `n_tok` rows of `n_out`, and rows `first..first +
                // n_rows` of every token belong to this task alone.
                unsafe {
                    panel.unpack(&batch, &rows[..n_rows]);
                    panel.products(&batch, dst.0, m.n_out, first);
                }
            }
        });
        return;
    }
    // Row-major (one row's results for every token together), then transposed.
    let mut by_row = vec![0.0f32; m.n_out * n_tok];
    let chunk = rows_per * n_tok;
    let dot = dot_kernel(m.ty, isa);
    pool.for_each_chunk(&mut by_row, chunk, &|start, part| {
        let first = start / n_tok;
        for (k, row_out) in part.chunks_exact_mut(n_tok).enumerate() {
            let row = m.row(first + k);
            for (o, act) in row_out.iter_mut().zip(acts) {
                *o = dot(row, act);
            }
        }
    });
    transpose_into(pool, &by_row, n_tok, m.n_out, out);
}

/// `out` of a batched product, written by several tasks at disjoint indices.
#[cfg(target_arch = "x86_64")]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements, and `out` outlives the pool's `run`.
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for OutPtr {}

/// `out[b * n_out + i] = by_row[i * n_tok + b]`, spread over the pool by tokens. Each 16 × 16
/// tile goes through a local buffer so that every output row segment is written whole: with
/// power-of-two widths the rows of a tile share cache sets, and scattered single stores
/// would evict each other's lines.
fn transpose_into(pool: &ThreadPool, by_row: &[f32], n_tok: usize, n_out: usize, out: &mut [f32]) {
    const TILE: usize = 16;
    pool.for_each_chunk(out, TILE * n_out, &|start, part| {
        let b0 = start / n_out;
        let nb = part.len() / n_out;
        let mut tile = [[0.0f32; TILE]; TILE];
        for i0 in (0..n_out).step_by(TILE) {
            let ni = TILE.min(n_out - i0);
            for k in 0..ni {
                let src = &by_row[(i0 + k) * n_tok + b0..][..nb];
                for (b, &v) in src.iter().enumerate() {
                    tile[b][k] = v;
                }
            }
            for (b, row) in tile.iter().take(nb).enumerate() {
                part[b * n_out + i0..b * n_out + i0 + ni].copy_from_slice(&row[..ni]);
            }
        }
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gguf::GgmlType;
    use crate::quant::{dequantize_row, quantize_row};

    /// A deterministic pseudo-random vector in [-1, 1).
    pub(crate) fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Compares with f32 dot products of dequantized rows and the activation as the kernel
    /// sees it, within `rel` of the sum of absolute products.
    fn check(ty: GgmlType, bytes: &[u8], n_in: usize, n_out: usize, rel: f32) {
        let m = MatRef {
            ty,
            n_in,
            n_out,
            data: bytes,
        };
        let x = noise(n_in, 7);
        let pool = ThreadPool::new(3);
        let mut out = vec![0.0; n_out];
        matvec(&pool, m, &x, &mut out);
        let xq = Activation::new(ty, &x).to_f32();
        let mut row = vec![0.0; n_in];
        for (i, &o) in out.iter().enumerate() {
            if ty == GgmlType::Q5K {
                crate::cpu::dot::dequantize_q5_k(m.row(i), &mut row);
            } else {
                dequantize_row(ty, m.row(i), &mut row).unwrap();
            }
            let want: f32 = row.iter().zip(&xq).map(|(a, b)| a * b).sum();
            let scale: f32 = row.iter().zip(&xq).map(|(a, b)| (a * b).abs()).sum();
            assert!(
                (o - want).abs() <= rel * scale,
                "{ty} row {i}: {o} vs {want}"
            );
        }
    }

    #[test]
    fn quantized_matvec_agrees_with_dequantized_rows() {
        let (n_in, n_out) = (512, 37);
        let w = noise(n_in * n_out, 3);
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
        ] {
            let mut bytes = vec![0u8; ty.row_bytes((n_in * n_out) as u64).unwrap() as usize];
            quantize_row(ty, &w, &mut bytes).unwrap();
            check(ty, &bytes, n_in, n_out, 1e-5);
        }
    }

    /// Rows of `ty` with finite scales: quantized noise, or for the K-quants random bytes
    /// whose f16 scales (at `d_at` in each block) are set.
    pub(crate) fn rows_of(ty: GgmlType, n_in: usize, n_out: usize, d_at: &[usize]) -> Vec<u8> {
        if d_at.is_empty() {
            let w = noise(n_in * n_out, 1);
            let mut bytes = vec![0u8; ty.row_bytes((n_in * n_out) as u64).unwrap() as usize];
            quantize_row(ty, &w, &mut bytes).unwrap();
            return bytes;
        }
        let bb = ty.block_bytes() as usize;
        let mut bytes: Vec<u8> = noise(n_out * n_in / 256 * bb, 5)
            .iter()
            .map(|v| (v.to_bits() >> 7) as u8)
            .collect();
        for (i, block) in bytes.chunks_exact_mut(bb).enumerate() {
            for &at in d_at {
                let d = half::f16::from_f32(0.01 + 0.001 * (i % 5) as f32);
                block[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
            }
        }
        bytes
    }

    #[test]
    fn matmul_is_matvec_per_token() {
        // Bit-identical: the batched kernels do each token's arithmetic as the dot products do.
        let (n_in, n_out) = (512, 19);
        for (ty, d_at, n_tok) in [
            (GgmlType::F16, &[][..], 5),
            (GgmlType::Q8_0, &[][..], 5),
            (GgmlType::Q4_0, &[][..], 5),
            (GgmlType::Q4_0, &[][..], 2),
            (GgmlType::Q4K, &[0, 2][..], 5),
            (GgmlType::Q4K, &[0, 2][..], 3),
            (GgmlType::Q5K, &[0, 2][..], 5),
            (GgmlType::Q6K, &[208][..], 5),
        ] {
            let bytes = rows_of(ty, n_in, n_out, d_at);
            let m = MatRef {
                ty,
                n_in,
                n_out,
                data: &bytes,
            };
            let xs = noise(n_in * n_tok, 2);
            let pool = ThreadPool::new(2);
            let mut out = vec![0.0; n_out * n_tok];
            matmul(&pool, m, &xs, &mut out);
            for b in 0..n_tok {
                let mut one = vec![0.0; n_out];
                matvec(&pool, m, &xs[b * n_in..(b + 1) * n_in], &mut one);
                assert_eq!(&out[b * n_out..(b + 1) * n_out], &one[..], "{ty} token {b}");
            }
        }
    }

    #[test]
    fn k_quant_matvec_agrees_with_dequantized_rows() {
        // Arbitrary bytes are valid K-quant blocks once the f16 scales are made finite.
        let (n_in, n_out) = (512, 9);
        for (ty, d_at) in [
            (GgmlType::Q4K, &[0usize, 2][..]),
            (GgmlType::Q5K, &[0, 2][..]),
            (GgmlType::Q6K, &[208][..]),
        ] {
            let bb = ty.block_bytes() as usize;
            let mut bytes: Vec<u8> = noise(n_out * n_in / 256 * bb, 5)
                .iter()
                .map(|v| (v.to_bits() >> 7) as u8)
                .collect();
            for block in bytes.chunks_exact_mut(bb) {
                for &at in d_at {
                    block[at..at + 2]
                        .copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
                }
            }
            check(ty, &bytes, n_in, n_out, 1e-5);
        }
    }
}
