//! AVX-512 VNNI products of weight rows with every token of a prompt batch (Q4_0, Q4_K, Q6_K).
//!
//! The same integer sums and float operations as [`super::gemm_avx2`] and the one-token
//! kernels of [`super::avx2`], so results stay bit-identical to them; what changes is how many
//! lanes carry them:
//!
//! - Q4_0: a 512-bit register holds one row's block against two tokens (the 8-lane
//!   accumulator of each in one half). `vpdpbusd` starting from `-Σ 8 y` gives `dot_q4_0`'s
//!   per-lane integer `Σ w y` in one instruction (AVX2 needs `maddubs`, `madd` and a
//!   subtraction), and the conversion, the scale product and the FMA cover two tokens.
//! - Q4_K and Q6_K: a register holds two 32-weight sub-blocks of one row; `vpdpwssd` applies
//!   their scales and accumulates in one instruction. The two halves are added at the end of
//!   each super-block, which is the AVX2 kernels' per-lane integer sum (integer additions in
//!   any order give the same result).
//!
//! A prompt's activations are larger than the caches closest to the core, so the rows of a
//! task are unpacked [`GROUP_ROWS`] at a time and met with the tokens a chunk at a time: a
//! chunk's activations stay in L2 while every panel of the group uses them.
//!
//! Every function here requires the features [`available`] checks for.

#![cfg(target_arch = "x86_64")]
// The AVX-512 intrinsics and target features are stable since Rust 1.89, one release past the
// workspace's declared `rust-version`: this module needs 1.89 to build.
#![allow(clippy::incompatible_msrv)]

use std::arch::x86_64::*;

use crate::gguf::GgmlType;
use crate::model::MatRef;

use super::act::{Activation, BlockQ8K};
use super::avx2::{
    broadcast_i16, f16_to_f32, hsum_ps, q4_0_weights, q6_k_quarters, unpack_q4_k_scales,
    Q6K_SCALE_SHUFFLE,
};

/// Rows unpacked and multiplied together.
const PANEL_ROWS: usize = 4;
/// Rows whose panels share one pass over a chunk of tokens.
const GROUP_ROWS: usize = 8 * PANEL_ROWS;
/// Bytes of activations (as the kernels read them) in one chunk of tokens.
const CHUNK_BYTES: usize = 256 << 10;
/// Q4_0 token pairs, and K-quant tokens, multiplied together.
const Q4_0_PAIRS: usize = 3;
const K_TOKENS: usize = 4;

/// Whether the CPU has what these kernels use (AVX2, FMA and F16C too, for the helpers shared
/// with [`super::avx2`]).
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && super::Isa::detect() == super::Isa::Avx2
}

/// Weight types with a kernel here.
pub fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4K | GgmlType::Q6K)
}

/// One Q4_0 block of two tokens, each 256-bit half one token (the second a copy of the first
/// for the last token of an odd batch).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct PairBlock {
    y: __m512i,
    /// `-Σ 8 y` in fours: what `vpdpbusd` starts from, so that unsigned weights `w + 8`
    /// give `Σ w y`.
    neg8: __m512i,
    /// The block's activation scale, in the eight lanes of each token.
    dy: __m512,
}

/// The tokens of a batch, converted for one weight type, with their per-batch extras.
pub struct Batch<'a> {
    ty: GgmlType,
    acts: &'a [Activation<'a>],
    blocks: usize,
    /// Q4_0: pair-major, then block.
    pairs: Vec<PairBlock>,
    /// Q8_K: each super-block's activation sums per 32 elements, token-major.
    pair_sums: Vec<__m128i>,
    /// Q6_K: `maddubs(32, y)` for every 64 activations, token-major.
    y32: Vec<__m512i>,
}

impl<'a> Batch<'a> {
    /// # Safety
    /// The CPU must have the features [`available`] checks for.
    ///
    /// # Panics
    /// If `ty` has no kernel here, or an activation is not in `ty`'s format.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn new(ty: GgmlType, acts: &'a [Activation<'a>]) -> Batch<'a> {
        assert!(supports(ty), "no AVX-512 batched kernel for {ty}");
        let mut b = Batch {
            ty,
            acts,
            blocks: 0,
            pairs: Vec::new(),
            pair_sums: Vec::new(),
            y32: Vec::new(),
        };
        if ty == GgmlType::Q4_0 {
            let q8 = |a: &'a Activation<'a>| match a {
                Activation::Q8_0(y) => &y[..],
                _ => panic!("activation format does not match {ty}"),
            };
            for pair in acts.chunks(2) {
                let (y0, y1) = (q8(&pair[0]), q8(pair.last().unwrap()));
                assert_eq!(y0.len(), y1.len(), "activation widths");
                b.blocks = y0.len();
                for (a, c) in y0.iter().zip(y1) {
                    // SAFETY: `qs` is 32 bytes.
                    let (qa, qc) = unsafe {
                        (
                            _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i),
                            _mm256_loadu_si256(c.qs.as_ptr() as *const __m256i),
                        )
                    };
                    let y = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qa), qc);
                    let eights =
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(8), y);
                    let (da, dc) = (f16_to_f32(a.d.to_bits()), f16_to_f32(c.d.to_bits()));
                    b.pairs.push(PairBlock {
                        y,
                        neg8: _mm512_sub_epi32(_mm512_setzero_si512(), eights),
                        dy: _mm512_insertf32x8::<1>(
                            _mm512_castps256_ps512(_mm256_set1_ps(da)),
                            _mm256_set1_ps(dc),
                        ),
                    });
                }
            }
            return b;
        }
        let m32 = _mm512_set1_epi8(32);
        for act in acts {
            let Activation::Q8K(y) = act else {
                panic!("activation format does not match {ty}");
            };
            b.blocks = y.len();
            for blk in y {
                // SAFETY: `bsums` is 16 i16 = 32 bytes.
                let bsums = unsafe { _mm256_loadu_si256(blk.bsums.as_ptr() as *const __m256i) };
                b.pair_sums.push(_mm_hadd_epi16(
                    _mm256_castsi256_si128(bsums),
                    _mm256_extracti128_si256::<1>(bsums),
                ));
                if ty == GgmlType::Q6K {
                    for m in 0..4 {
                        // SAFETY: 64 activations at 64 m < 256.
                        let y =
                            unsafe { _mm512_loadu_si512(blk.qs.as_ptr().add(64 * m) as *const _) };
                        b.y32.push(_mm512_maddubs_epi16(m32, y));
                    }
                }
            }
        }
        b
    }

    fn n_tokens(&self) -> usize {
        self.acts.len()
    }

    /// Bytes of per-token data the kernels read for one token.
    fn token_bytes(&self) -> usize {
        self.blocks
            * match self.ty {
                GgmlType::Q4_0 => size_of::<PairBlock>() / 2,
                GgmlType::Q4K => 256 + 16,
                _ => 2 * 256 + 16,
            }
    }

    fn q8k(&self, t: usize) -> &[BlockQ8K] {
        match &self.acts[t] {
            Activation::Q8K(y) => y,
            _ => unreachable!("checked by Batch::new"),
        }
    }
}

/// `row_i(m) · token_t` for rows `start..end` of `m` and every token of `batch`, into
/// `out[t * stride + i]`.
///
/// # Safety
/// The CPU must have the features [`available`] checks for; `batch` must have been made for
/// `m.ty`; `out` must be valid for writes at those indices, and nothing else may access them
/// meanwhile.
///
/// # Panics
/// If a row is not as many whole blocks as the activations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn products(
    batch: &Batch<'_>,
    m: MatRef<'_>,
    start: usize,
    end: usize,
    out: *mut f32,
    stride: usize,
) {
    assert_eq!(m.ty, batch.ty, "batch made for another weight type");
    let n_tok = batch.n_tokens();
    // A multiple of both token blocks (pairs of Q4_0 pairs, K-quant fours).
    let step = 2 * Q4_0_PAIRS * K_TOKENS;
    let chunk = (CHUNK_BYTES / batch.token_bytes().max(1) / step).max(1) * step;
    let mut panels: Vec<Panel> = (0..GROUP_ROWS / PANEL_ROWS)
        .map(|_| Panel::default())
        .collect();
    for g in (start..end).step_by(GROUP_ROWS) {
        let g_end = (g + GROUP_ROWS).min(end);
        let firsts = (g..g_end).step_by(PANEL_ROWS);
        for (panel, first) in panels.iter_mut().zip(firsts.clone()) {
            let n = PANEL_ROWS.min(g_end - first);
            let rows: [&[u8]; PANEL_ROWS] = std::array::from_fn(|k| m.row(first + k.min(n - 1)));
            // SAFETY: the caller's guarantee.
            unsafe { panel.unpack(batch, &rows[..n]) };
        }
        for t0 in (0..n_tok).step_by(chunk) {
            let t1 = (t0 + chunk).min(n_tok);
            for (panel, first) in panels.iter().zip(firsts.clone()) {
                // SAFETY: the caller's guarantee.
                unsafe { panel.products(batch, t0, t1, out, stride, first) };
            }
        }
    }
}

/// Up to [`PANEL_ROWS`] weight rows unpacked, block-interleaved (block 0 of every row, then
/// block 1, ...).
#[derive(Default)]
struct Panel {
    /// Q4_0: each block's weights plus 8, as unsigned bytes.
    w256: Vec<__m256i>,
    /// K-quants: per super-block, four pairs of (two sub-blocks' unsigned weights, their
    /// scales spread for `vpdpwssd`).
    vecs: Vec<__m512i>,
    /// Q4_K: each super-block's mins, widened to i16.
    mins: Vec<__m128i>,
    /// Block scales (`d`) and, for Q4_K, interleaved with `dmin`.
    scales: Vec<f32>,
    rows: usize,
}

/// Two 256-bit halves as one register.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

impl Panel {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(&mut self, batch: &Batch<'_>, rows: &[&[u8]]) {
        let bb = batch.ty.block_bytes() as usize;
        for row in rows {
            assert_eq!(row.len(), batch.blocks * bb, "row width");
        }
        self.w256.clear();
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

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack_block(&mut self, ty: GgmlType, b: &[u8]) {
        let half = |b: &[u8], at: usize| f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]));
        match ty {
            GgmlType::Q4_0 => {
                // SAFETY: a Q4_0 block has 16 bytes after its scale.
                let w = unsafe { q4_0_weights(b.as_ptr().add(2)) };
                self.w256.push(_mm256_add_epi8(w, _mm256_set1_epi8(8)));
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
                    self.vecs.push(join(
                        _mm256_and_si256(bits, low),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(bits), low),
                    ));
                    self.vecs.push(join(
                        _mm256_shuffle_epi8(sc, broadcast_i16(2 * i)),
                        _mm256_shuffle_epi8(sc, broadcast_i16(2 * i + 1)),
                    ));
                }
                self.scales.push(half(b, 0));
                self.scales.push(half(b, 2));
            }
            GgmlType::Q6K => {
                // SAFETY: the 16 scale bytes are b[192..208].
                let scales = unsafe { _mm_loadu_si128(b.as_ptr().add(192) as *const _) };
                let sc = |j: usize| {
                    // SAFETY: a 16-byte row of the table.
                    let shuffle =
                        unsafe { _mm_loadu_si128(Q6K_SCALE_SHUFFLE[j].as_ptr() as *const __m128i) };
                    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, shuffle))
                };
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
                    for k in [0, 2] {
                        self.vecs.push(join(q[k], q[k + 1]));
                        self.vecs.push(join(sc(4 * n + k), sc(4 * n + k + 1)));
                    }
                }
                self.scales.push(half(b, 208));
            }
            other => unreachable!("Batch::new refuses {other}"),
        }
    }

    /// Products of the unpacked rows with tokens `t0..t1` into `out[t * stride + first + r]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn products(
        &self,
        batch: &Batch<'_>,
        t0: usize,
        t1: usize,
        out: *mut f32,
        stride: usize,
        first: usize,
    ) {
        // SAFETY (all): the caller's guarantee.
        unsafe {
            match self.rows {
                4 => self.products_of::<4>(batch, t0, t1, out, stride, first),
                3 => self.products_of::<3>(batch, t0, t1, out, stride, first),
                2 => self.products_of::<2>(batch, t0, t1, out, stride, first),
                _ => self.products_of::<1>(batch, t0, t1, out, stride, first),
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn products_of<const R: usize>(
        &self,
        batch: &Batch<'_>,
        t0: usize,
        t1: usize,
        out: *mut f32,
        stride: usize,
        first: usize,
    ) {
        // SAFETY (all writes): the caller's guarantee, for tokens below `t1`.
        let put = |t: usize, r: usize, v: f32| {
            if t < t1 {
                unsafe { out.add(t * stride + first + r).write(v) };
            }
        };
        if batch.ty == GgmlType::Q4_0 {
            // `t0` is even: chunks are whole pairs.
            let (p0, p1) = (t0 / 2, t1.div_ceil(2));
            let mut p = p0;
            while p < p1 {
                let n = Q4_0_PAIRS.min(p1 - p);
                let acc = match n {
                    3 => self.q4_0::<R, 3>(batch, p).map(|a| a.to_vec()),
                    2 => self.q4_0::<R, 2>(batch, p).map(|a| a.to_vec()),
                    _ => self.q4_0::<R, 1>(batch, p).map(|a| a.to_vec()),
                };
                for (r, accs) in acc.iter().enumerate() {
                    for (k, &a) in accs.iter().enumerate() {
                        let t = 2 * (p + k);
                        put(t, r, hsum_ps(_mm512_castps512_ps256(a)));
                        put(t + 1, r, hsum_ps(_mm512_extractf32x8_ps::<1>(a)));
                    }
                }
                p += n;
            }
            return;
        }
        let mut t = t0;
        while t < t1 {
            let n = K_TOKENS.min(t1 - t);
            let dots = match (batch.ty, n) {
                (GgmlType::Q4K, 4) => self.q4_k::<R, 4>(batch, t).map(|a| a.to_vec()),
                (GgmlType::Q4K, 3) => self.q4_k::<R, 3>(batch, t).map(|a| a.to_vec()),
                (GgmlType::Q4K, 2) => self.q4_k::<R, 2>(batch, t).map(|a| a.to_vec()),
                (GgmlType::Q4K, _) => self.q4_k::<R, 1>(batch, t).map(|a| a.to_vec()),
                (_, 4) => self.q6_k::<R, 4>(batch, t).map(|a| a.to_vec()),
                (_, 3) => self.q6_k::<R, 3>(batch, t).map(|a| a.to_vec()),
                (_, 2) => self.q6_k::<R, 2>(batch, t).map(|a| a.to_vec()),
                _ => self.q6_k::<R, 1>(batch, t).map(|a| a.to_vec()),
            };
            for (r, ds) in dots.iter().enumerate() {
                for (k, &d) in ds.iter().enumerate() {
                    put(t + k, r, d);
                }
            }
            t += n;
        }
    }

    /// `super::avx2::dot_q4_0` for `R` rows and token pairs `pair..pair + P`: per lane
    /// `acc = fma(d_w · d_y, Σ w y, acc)` block after block, as there.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn q4_0<const R: usize, const P: usize>(
        &self,
        batch: &Batch<'_>,
        pair: usize,
    ) -> [[__m512; P]; R] {
        let nb = batch.blocks;
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let ys: [&[PairBlock]; P] =
            std::array::from_fn(|k| &batch.pairs[(pair + k) * nb..(pair + k + 1) * nb]);
        for (b, (w, dw)) in self
            .w256
            .chunks_exact(R)
            .zip(self.scales.chunks_exact(R))
            .enumerate()
        {
            let y = ys.map(|ys| &ys[b]);
            for r in 0..R {
                let w = _mm512_broadcast_i64x4(w[r]);
                let dw = _mm512_set1_ps(dw[r]);
                for k in 0..P {
                    let s = _mm512_dpbusd_epi32(y[k].neg8, w, y[k].y);
                    acc[r][k] = _mm512_fmadd_ps(
                        _mm512_mul_ps(dw, y[k].dy),
                        _mm512_cvtepi32_ps(s),
                        acc[r][k],
                    );
                }
            }
        }
        acc
    }

    /// `super::avx2::dot_q4_k` for `R` rows and tokens `t..t + T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn q4_k<const R: usize, const T: usize>(&self, batch: &Batch<'_>, t: usize) -> [[f32; T]; R] {
        let nb = batch.blocks;
        let y: [&[BlockQ8K]; T] = std::array::from_fn(|k| batch.q8k(t + k));
        let ps: [&[__m128i]; T] =
            std::array::from_fn(|k| &batch.pair_sums[(t + k) * nb..(t + k + 1) * nb]);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut acc_m = [[_mm_setzero_ps(); T]; R];
        for (b, ((v, mins), d)) in self
            .vecs
            .chunks_exact(8 * R)
            .zip(self.mins.chunks_exact(R))
            .zip(self.scales.chunks_exact(2 * R))
            .enumerate()
        {
            let y = y.map(|y| &y[b]);
            for r in 0..R {
                let mut isum = [_mm512_setzero_si512(); T];
                for i in 0..4 {
                    let (w, s) = (v[8 * r + 2 * i], v[8 * r + 2 * i + 1]);
                    for k in 0..T {
                        // SAFETY: 64 activations at 64 i < 256.
                        let q =
                            unsafe { _mm512_loadu_si512(y[k].qs.as_ptr().add(64 * i) as *const _) };
                        isum[k] = _mm512_dpwssd_epi32(isum[k], _mm512_maddubs_epi16(w, q), s);
                    }
                }
                for k in 0..T {
                    let m = _mm_madd_epi16(mins[r], ps[k][b]);
                    acc_m[r][k] = _mm_fmadd_ps(
                        _mm_set1_ps(d[2 * r + 1] * y[k].d),
                        _mm_cvtepi32_ps(m),
                        acc_m[r][k],
                    );
                    let i = _mm256_add_epi32(
                        _mm512_castsi512_si256(isum[k]),
                        _mm512_extracti64x4_epi64::<1>(isum[k]),
                    );
                    acc[r][k] = _mm256_fmadd_ps(
                        _mm256_set1_ps(d[2 * r] * y[k].d),
                        _mm256_cvtepi32_ps(i),
                        acc[r][k],
                    );
                }
            }
        }
        std::array::from_fn(|r| {
            std::array::from_fn(|k| {
                let a = acc_m[r][k];
                let m = _mm_add_ps(a, _mm_movehl_ps(a, a));
                let m = _mm_add_ss(m, _mm_movehdup_ps(m));
                hsum_ps(acc[r][k]) - _mm_cvtss_f32(m)
            })
        })
    }

    /// `super::avx2::dot_q6_k` for `R` rows and tokens `t..t + T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn q6_k<const R: usize, const T: usize>(&self, batch: &Batch<'_>, t: usize) -> [[f32; T]; R] {
        let nb = batch.blocks;
        let y: [&[BlockQ8K]; T] = std::array::from_fn(|k| batch.q8k(t + k));
        let y32: [&[__m512i]; T] =
            std::array::from_fn(|k| &batch.y32[(t + k) * nb * 4..(t + k + 1) * nb * 4]);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for (b, (v, d)) in self
            .vecs
            .chunks_exact(8 * R)
            .zip(self.scales.chunks_exact(R))
            .enumerate()
        {
            let y = y.map(|y| &y[b]);
            for r in 0..R {
                let mut isum = [_mm512_setzero_si512(); T];
                for j in 0..4 {
                    let (w, s) = (v[8 * r + 2 * j], v[8 * r + 2 * j + 1]);
                    for k in 0..T {
                        // SAFETY: 64 activations at 64 j < 256.
                        let q =
                            unsafe { _mm512_loadu_si512(y[k].qs.as_ptr().add(64 * j) as *const _) };
                        let p16 = _mm512_sub_epi16(_mm512_maddubs_epi16(w, q), y32[k][4 * b + j]);
                        isum[k] = _mm512_dpwssd_epi32(isum[k], p16, s);
                    }
                }
                for k in 0..T {
                    let i = _mm256_add_epi32(
                        _mm512_castsi512_si256(isum[k]),
                        _mm512_extracti64x4_epi64::<1>(isum[k]),
                    );
                    acc[r][k] = _mm256_fmadd_ps(
                        _mm256_set1_ps(d[r] * y[k].d),
                        _mm256_cvtepi32_ps(i),
                        acc[r][k],
                    );
                }
            }
        }
        acc.map(|a| a.map(|a| hsum_ps(a)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::dot;
    use crate::cpu::matvec::{
        activations,
        tests::{noise, rows_of},
    };

    /// Every (row, token) of `products` against the one-token AVX2 kernel (bit for bit: the
    /// same integer sums and float operations) and the scalar reference (to rounding).
    fn check(ty: GgmlType, d_at: &[usize], n_in: usize, n_out: usize, n_tok: usize) {
        let bytes = rows_of(ty, n_in, n_out, d_at);
        let m = MatRef {
            ty,
            n_in,
            n_out,
            data: &bytes,
        };
        let xs = noise(n_in * n_tok, 31 + n_tok as u64);
        let acts = activations(ty, &xs, n_in);
        let mut out = vec![f32::NAN; n_out * n_tok];
        // SAFETY: `available` was checked by the caller; `out` is n_tok rows of n_out.
        unsafe {
            let batch = Batch::new(ty, &acts);
            // Two calls over a split of the rows, as two pool tasks would.
            products(&batch, m, 0, 21.min(n_out), out.as_mut_ptr(), n_out);
            products(&batch, m, 21.min(n_out), n_out, out.as_mut_ptr(), n_out);
        }
        for (t, act) in acts.iter().enumerate() {
            for i in 0..n_out {
                let row = m.row(i);
                // SAFETY: `available` implies AVX2, FMA and F16C.
                let (fast, slow) = match act {
                    Activation::Q8_0(y) => unsafe {
                        (super::super::avx2::dot_q4_0(row, y), dot::dot_q4_0(row, y))
                    },
                    Activation::Q8K(y) if ty == GgmlType::Q4K => unsafe {
                        (super::super::avx2::dot_q4_k(row, y), dot::dot_q4_k(row, y))
                    },
                    Activation::Q8K(y) => unsafe {
                        (super::super::avx2::dot_q6_k(row, y), dot::dot_q6_k(row, y))
                    },
                    _ => unreachable!(),
                };
                let got = out[t * n_out + i];
                assert_eq!(
                    got.to_bits(),
                    fast.to_bits(),
                    "{ty} {n_in}x{n_out}, {n_tok} tokens: row {i} token {t}: {got} vs {fast}"
                );
                assert!(
                    (got - slow).abs() <= 1e-4 * slow.abs().max(1.0),
                    "{got} vs {slow}"
                );
            }
        }
    }

    #[test]
    fn batched_products_are_the_one_token_kernels_bit_for_bit() {
        if !available() {
            eprintln!("no AVX-512 VNNI on this CPU: nothing to compare");
            return;
        }
        for (ty, d_at) in [
            (GgmlType::Q4_0, &[][..]),
            (GgmlType::Q4K, &[0, 2][..]),
            (GgmlType::Q6K, &[208][..]),
        ] {
            // Row counts around the panel and group sizes; odd token counts (Q4_0 pairs) and
            // counts that are not whole blocks of tokens.
            for (n_out, n_tok) in [(1, 1), (5, 2), (37, 5), (33, 7), (64, 13)] {
                check(ty, d_at, 512, n_out, n_tok);
            }
            // Wide rows: the tokens come in several chunks.
            check(ty, d_at, 8192, 6, 53);
        }
    }
}
