//! AVX2 products of one weight row with every token of a prompt batch.
//!
//! A dot product spends most of its instructions turning packed weights into vectors of
//! bytes and scales: nibble masks, 6-bit scale shuffles, f16 conversions. In a batch the same
//! row meets every token, so [`Panel::unpack`] does that work once per row, into a small
//! buffer that stays in cache, and the per-token loops only multiply and add. A panel holds
//! [`PANEL_ROWS`] rows side by side, so each block of a token's activations is loaded once
//! for all of them. The per-token
//! arithmetic is the instruction sequence of the matching kernel in [`super::avx2`] (same
//! integer sums in the same lanes, same float operations in the same order), so a batch gives
//! bit-identical results to multiplying its tokens one at a time.
//!
//! Activation-only terms (Q8_0 scales as f32, Q8_K pair sums, Q6_K's `32 · y`) are computed
//! once per batch by [`Batch::new`].
//!
//! Every function here requires AVX2, FMA and F16C; [`super::matvec`] uses them only after
//! [`super::Isa::detect`] has found them.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::gguf::GgmlType;
use crate::quant::BlockQ8_0;

use super::act::{Activation, BlockQ8K};
use super::avx2::{
    broadcast_i16, f16_to_f32, hsum_ps, q6_k_quarters, unpack_q4_k_scales, Q6K_SCALE_SHUFFLE,
};

/// Rows unpacked and multiplied together.
pub const PANEL_ROWS: usize = 4;

/// Weight types with a batched kernel here.
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4K | GgmlType::Q6K
    )
}

/// The tokens of a batch, converted for one weight type, with their per-batch extras.
pub struct Batch<'a> {
    ty: GgmlType,
    acts: &'a [Activation<'a>],
    /// Q8_0: each block's scale as f32, token-major.
    dy: Vec<f32>,
    /// Q8_K: each super-block's activation sums per 32 elements (`hadd` of its `bsums`).
    pair_sums: Vec<__m128i>,
    /// Q6_K: `maddubs(32, y)` for every 32 activations, token-major.
    y32: Vec<__m256i>,
    /// Q4_0: `8 y` summed in fours (the lanes of a `madd`), per block, token-major.
    y8: Vec<__m256i>,
    blocks: usize,
}

impl<'a> Batch<'a> {
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    ///
    /// # Panics
    /// If `ty` has no batched kernel, or an activation is not in `ty`'s format.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn new(ty: GgmlType, acts: &'a [Activation<'a>]) -> Batch<'a> {
        assert!(supports(ty), "no batched kernel for {ty}");
        let mut b = Batch {
            ty,
            acts,
            dy: Vec::new(),
            pair_sums: Vec::new(),
            y32: Vec::new(),
            y8: Vec::new(),
            blocks: 0,
        };
        for act in acts {
            match act {
                Activation::Q8_0(y) => {
                    b.blocks = y.len();
                    b.dy.extend(y.iter().map(|blk| f16_to_f32(blk.d.to_bits())));
                    if ty == GgmlType::Q4_0 {
                        let eights = _mm256_set1_epi8(8);
                        for blk in y {
                            // SAFETY: `qs` is 32 bytes.
                            let q = unsafe { _mm256_loadu_si256(blk.qs.as_ptr() as *const _) };
                            let p = _mm256_maddubs_epi16(eights, q);
                            b.y8.push(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
                        }
                    }
                }
                Activation::Q8K(y) => {
                    b.blocks = y.len();
                    for blk in y {
                        // SAFETY: `bsums` is 16 i16 = 32 bytes.
                        let bsums =
                            unsafe { _mm256_loadu_si256(blk.bsums.as_ptr() as *const __m256i) };
                        b.pair_sums.push(_mm_hadd_epi16(
                            _mm256_castsi256_si128(bsums),
                            _mm256_extracti128_si256::<1>(bsums),
                        ));
                        if ty == GgmlType::Q6K {
                            let m32 = _mm256_set1_epi8(32);
                            for k in 0..8 {
                                // SAFETY: 32 activations at 32 k < 256.
                                let y = unsafe {
                                    _mm256_loadu_si256(blk.qs.as_ptr().add(32 * k) as *const _)
                                };
                                b.y32.push(_mm256_maddubs_epi16(m32, y));
                            }
                        }
                    }
                }
                _ => panic!("activation format does not match {ty}"),
            }
        }
        b
    }

    pub fn n_tokens(&self) -> usize {
        self.acts.len()
    }
}

/// Up to [`PANEL_ROWS`] weight rows unpacked for [`Batch`] products, block-interleaved (block
/// 0 of every row, then block 1, ...); reused from one group of rows to the next.
#[derive(Default)]
pub struct Panel {
    /// Weights as bytes (signed for Q8_0, with their magnitudes; unsigned for Q4_0 and the
    /// K-quants); for the K-quants each 32 weights' scale, spread for `madd`.
    vecs: Vec<__m256i>,
    /// Q4_K: each super-block's mins, widened to i16.
    mins: Vec<__m128i>,
    /// Block scales (`d`) and, for Q4_K, interleaved with `dmin`.
    scales: Vec<f32>,
    rows: usize,
}

impl Panel {
    /// Unpacks `rows` (at most [`PANEL_ROWS`]) of `batch`'s weight type.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    ///
    /// # Panics
    /// If there are too many rows, or a row is not as many whole blocks as the activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn unpack(&mut self, batch: &Batch<'_>, rows: &[&[u8]]) {
        assert!(!rows.is_empty() && rows.len() <= PANEL_ROWS, "panel rows");
        let bb = batch.ty.block_bytes() as usize;
        for row in rows {
            assert_eq!(row.len(), batch.blocks * bb, "row width");
        }
        self.vecs.clear();
        self.mins.clear();
        self.scales.clear();
        self.rows = rows.len();
        for b in 0..batch.blocks {
            for row in rows {
                // SAFETY: the caller's guarantee.
                unsafe { self.unpack_block(batch.ty, &row[b * bb..(b + 1) * bb]) };
            }
        }
    }

    /// Appends one block of a row.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_block(&mut self, ty: GgmlType, b: &[u8]) {
        let half = |b: &[u8], at: usize| f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]));
        match ty {
            GgmlType::Q8_0 => {
                // SAFETY: a Q8_0 block has 32 bytes after its scale.
                let w = unsafe { _mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i) };
                self.vecs.push(w);
                self.vecs.push(_mm256_sign_epi8(w, w));
                self.scales.push(half(b, 0));
            }
            GgmlType::Q4_0 => {
                // SAFETY: a Q4_0 block has 16 bytes after its scale.
                let w = unsafe { super::avx2::q4_0_weights(b.as_ptr().add(2)) };
                self.vecs.push(_mm256_add_epi8(w, _mm256_set1_epi8(8)));
                self.scales.push(half(b, 0));
            }
            GgmlType::Q4K => {
                let low = _mm256_set1_epi8(0x0f);
                let (scales, mins) = unpack_q4_k_scales(&b[4..16]);
                self.mins
                    .push(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64)));
                let sc128 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64));
                let sc = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(sc128), sc128);
                for i in 0..4 {
                    // SAFETY: 32 bytes of nibbles at 16 + 32 i < 144.
                    let bits =
                        unsafe { _mm256_loadu_si256(b.as_ptr().add(16 + 32 * i) as *const _) };
                    self.vecs.push(_mm256_and_si256(bits, low));
                    self.vecs
                        .push(_mm256_and_si256(_mm256_srli_epi16::<4>(bits), low));
                    self.vecs
                        .push(_mm256_shuffle_epi8(sc, broadcast_i16(2 * i)));
                    self.vecs
                        .push(_mm256_shuffle_epi8(sc, broadcast_i16(2 * i + 1)));
                }
                self.scales.push(half(b, 0));
                self.scales.push(half(b, 2));
            }
            GgmlType::Q6K => {
                // SAFETY: the 16 scale bytes are b[192..208].
                let scales = unsafe { _mm_loadu_si128(b.as_ptr().add(192) as *const _) };
                for n in 0..2 {
                    // SAFETY: ql[64 n..64 n + 64] < 128 and qh at 128 + 32 n < 192.
                    let (l0, l1, h) = unsafe {
                        let p = b.as_ptr();
                        (
                            _mm256_loadu_si256(p.add(64 * n) as *const __m256i),
                            _mm256_loadu_si256(p.add(64 * n + 32) as *const __m256i),
                            _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i),
                        )
                    };
                    let q = q6_k_quarters(l0, l1, h);
                    for (k, q) in q.into_iter().enumerate() {
                        // SAFETY: a 16-byte row of the table.
                        let shuffle = unsafe {
                            _mm_loadu_si128(Q6K_SCALE_SHUFFLE[4 * n + k].as_ptr() as *const __m128i)
                        };
                        self.vecs.push(q);
                        self.vecs
                            .push(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, shuffle)));
                    }
                }
                self.scales.push(half(b, 208));
            }
            other => unreachable!("Batch::new refuses {other}"),
        }
    }

    /// `row_r · token_t` for every unpacked row `r` and token `t` of `batch`, into
    /// `out[t * stride + first + r]` (token-major, as the caller's batch of outputs).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `self` must hold rows unpacked for `batch`;
    /// `out` must be valid for writes at those indices for every token, and nothing else may
    /// access them meanwhile.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn products(&self, batch: &Batch<'_>, out: *mut f32, stride: usize, first: usize) {
        // SAFETY: the caller's guarantee.
        unsafe {
            match self.rows {
                4 => self.products_of::<4>(batch, out, stride, first),
                3 => self.products_of::<3>(batch, out, stride, first),
                2 => self.products_of::<2>(batch, out, stride, first),
                _ => self.products_of::<1>(batch, out, stride, first),
            }
        }
    }

    /// One token at a time: pairs of tokens (sharing each unpacked vector) measured no
    /// faster on Zen 2, for the registers they take.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn products_of<const R: usize>(
        &self,
        batch: &Batch<'_>,
        out: *mut f32,
        stride: usize,
        first: usize,
    ) {
        for t in 0..batch.n_tokens() {
            // SAFETY: the caller's guarantee.
            unsafe {
                let [dots] = self.tokens::<R, 1>(batch, [t]);
                for (r, d) in dots.into_iter().enumerate() {
                    out.add(t * stride + first + r).write(d);
                }
            }
        }
    }

    /// The products of the unpacked rows with tokens `ts`: `[token][row]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tokens<const R: usize, const T: usize>(
        &self,
        batch: &Batch<'_>,
        ts: [usize; T],
    ) -> [[f32; R]; T] {
        let nb = batch.blocks;
        // SAFETY (all three): the CPU features are the caller's guarantee; the activation
        // formats were checked by `Batch::new`.
        match batch.acts[ts[0]] {
            Activation::Q8_0(_) => {
                let y = ts.map(|t| match &batch.acts[t] {
                    Activation::Q8_0(y) => &y[..],
                    _ => unreachable!("checked by Batch::new"),
                });
                let dy = ts.map(|t| &batch.dy[t * nb..(t + 1) * nb]);
                if batch.ty == GgmlType::Q4_0 {
                    let c8 = ts.map(|t| &batch.y8[t * nb..(t + 1) * nb]);
                    unsafe { self.q4_0::<R, T>(y, dy, c8) }
                } else {
                    unsafe { self.q8_0::<R, T>(y, dy) }
                }
            }
            Activation::Q8K(_) => {
                let y = ts.map(|t| match &batch.acts[t] {
                    Activation::Q8K(y) => &y[..],
                    _ => unreachable!("checked by Batch::new"),
                });
                if batch.ty == GgmlType::Q4K {
                    let ps = ts.map(|t| &batch.pair_sums[t * nb..(t + 1) * nb]);
                    unsafe { self.q4_k::<R, T>(y, ps) }
                } else {
                    let y32 = ts.map(|t| &batch.y32[t * nb * 8..(t + 1) * nb * 8]);
                    unsafe { self.q6_k::<R, T>(y, y32) }
                }
            }
            _ => unreachable!("checked by Batch::new"),
        }
    }

    /// `super::avx2::dot_q4_0` over unpacked rows. The panel holds the unsigned nibbles
    /// `w + 8`; `Σ (w + 8) y - Σ 8 y` per lane is the same integer as `dot_q4_0`'s `Σ w y`,
    /// with one vector less to load and no sign fix-up.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_0<const R: usize, const T: usize>(
        &self,
        y: [&[BlockQ8_0]; T],
        dy: [&[f32]; T],
        y8: [&[__m256i]; T],
    ) -> [[f32; R]; T] {
        let mut acc = [[_mm256_setzero_ps(); R]; T];
        let ones = _mm256_set1_epi16(1);
        for (b, (wv, dw)) in self
            .vecs
            .chunks_exact(R)
            .zip(self.scales.chunks_exact(R))
            .enumerate()
        {
            // SAFETY: `qs` is 32 bytes.
            let qy = y.map(|y| unsafe { _mm256_loadu_si256(y[b].qs.as_ptr() as *const __m256i) });
            for r in 0..R {
                for k in 0..T {
                    let dot = _mm256_maddubs_epi16(wv[r], qy[k]);
                    let sums = _mm256_sub_epi32(_mm256_madd_epi16(dot, ones), y8[k][b]);
                    acc[k][r] = _mm256_fmadd_ps(
                        _mm256_set1_ps(dw[r] * dy[k][b]),
                        _mm256_cvtepi32_ps(sums),
                        acc[k][r],
                    );
                }
            }
        }
        acc.map(|a| a.map(|a| hsum_ps(a)))
    }

    /// `super::avx2::dot_q8_0` over unpacked rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0<const R: usize, const T: usize>(
        &self,
        y: [&[BlockQ8_0]; T],
        dy: [&[f32]; T],
    ) -> [[f32; R]; T] {
        let mut acc = [[_mm256_setzero_ps(); R]; T];
        for (b, (wv, dw)) in self
            .vecs
            .chunks_exact(2 * R)
            .zip(self.scales.chunks_exact(R))
            .enumerate()
        {
            // SAFETY: `qs` is 32 bytes.
            let qy = y.map(|y| unsafe { _mm256_loadu_si256(y[b].qs.as_ptr() as *const __m256i) });
            for r in 0..R {
                let (w, aw) = (wv[2 * r], wv[2 * r + 1]);
                for k in 0..T {
                    let sy = _mm256_sign_epi8(qy[k], w);
                    let dot = _mm256_maddubs_epi16(aw, sy);
                    let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)));
                    acc[k][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[r] * dy[k][b]), sums, acc[k][r]);
                }
            }
        }
        acc.map(|a| a.map(|a| hsum_ps(a)))
    }

    /// `super::avx2::dot_q4_k` over unpacked rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k<const R: usize, const T: usize>(
        &self,
        y: [&[BlockQ8K]; T],
        pair_sums: [&[__m128i]; T],
    ) -> [[f32; R]; T] {
        let mut acc = [[_mm256_setzero_ps(); R]; T];
        let mut acc_m = [[_mm_setzero_ps(); R]; T];
        for (b, ((v, mins), d)) in self
            .vecs
            .chunks_exact(16 * R)
            .zip(self.mins.chunks_exact(R))
            .zip(self.scales.chunks_exact(2 * R))
            .enumerate()
        {
            let y = y.map(|y| &y[b]);
            for r in 0..R {
                let mut isum = [_mm256_setzero_si256(); T];
                for k in 0..T {
                    let m = _mm_madd_epi16(mins[r], pair_sums[k][b]);
                    acc_m[k][r] = _mm_fmadd_ps(
                        _mm_set1_ps(d[2 * r + 1] * y[k].d),
                        _mm_cvtepi32_ps(m),
                        acc_m[k][r],
                    );
                }
                for i in 0..4 {
                    let w = &v[16 * r + 4 * i..16 * r + 4 * i + 4];
                    for k in 0..T {
                        // SAFETY: 64 activations at 64 i < 256.
                        let (y0, y1) = unsafe {
                            let q = y[k].qs.as_ptr().add(64 * i);
                            (
                                _mm256_loadu_si256(q as *const __m256i),
                                _mm256_loadu_si256(q.add(32) as *const __m256i),
                            )
                        };
                        let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w[0], y0), w[2]);
                        let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w[1], y1), w[3]);
                        isum[k] = _mm256_add_epi32(isum[k], _mm256_add_epi32(p0, p1));
                    }
                }
                for k in 0..T {
                    acc[k][r] = _mm256_fmadd_ps(
                        _mm256_set1_ps(d[2 * r] * y[k].d),
                        _mm256_cvtepi32_ps(isum[k]),
                        acc[k][r],
                    );
                }
            }
        }
        std::array::from_fn(|k| {
            std::array::from_fn(|r| {
                let a = acc_m[k][r];
                let m = _mm_add_ps(a, _mm_movehl_ps(a, a));
                let m = _mm_add_ss(m, _mm_movehdup_ps(m));
                hsum_ps(acc[k][r]) - _mm_cvtss_f32(m)
            })
        })
    }

    /// `super::avx2::dot_q6_k` over unpacked rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k<const R: usize, const T: usize>(
        &self,
        y: [&[BlockQ8K]; T],
        y32: [&[__m256i]; T],
    ) -> [[f32; R]; T] {
        let mut acc = [[_mm256_setzero_ps(); R]; T];
        for (b, (v, d)) in self
            .vecs
            .chunks_exact(16 * R)
            .zip(self.scales.chunks_exact(R))
            .enumerate()
        {
            let y = y.map(|y| &y[b]);
            for r in 0..R {
                let mut isum = [_mm256_setzero_si256(); T];
                for j in 0..8 {
                    let w = &v[16 * r + 2 * j..16 * r + 2 * j + 2];
                    for k in 0..T {
                        // SAFETY: 32 activations at 32 j < 256.
                        let q =
                            unsafe { _mm256_loadu_si256(y[k].qs.as_ptr().add(32 * j) as *const _) };
                        let p16 =
                            _mm256_sub_epi16(_mm256_maddubs_epi16(w[0], q), y32[k][8 * b + j]);
                        isum[k] = _mm256_add_epi32(isum[k], _mm256_madd_epi16(p16, w[1]));
                    }
                }
                for k in 0..T {
                    acc[k][r] = _mm256_fmadd_ps(
                        _mm256_set1_ps(d[r] * y[k].d),
                        _mm256_cvtepi32_ps(isum[k]),
                        acc[k][r],
                    );
                }
            }
        }
        acc.map(|a| a.map(|a| hsum_ps(a)))
    }
}
