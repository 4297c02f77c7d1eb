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
//! - Q4_K and Q6_K: a register holds one row's 32-weight sub-block against two tokens, as
//!   for Q4_0; `vpdpwssd` applies the sub-block's scale and accumulates in one instruction.
//!   Each lane's integer sum over a super-block is the AVX2 kernels' (the same terms; integer
//!   additions in any order give the same result). Q6_K's `Σ (q - 32) y` comes from one `vpdpbusd` too,
//!   started from `-Σ 32 y`, instead of two `maddubs` and a subtraction.
//!
//! A prompt's activations are larger than the caches closest to the core, so the rows of a
//! task are unpacked [`GROUP_ROWS`] at a time and met with the tokens a chunk at a time: a
//! chunk's activations stay in L2 while every panel of the group uses them.
//!
//! Every function here requires the features [`available`] checks for.

#![cfg(target_arch = "x86_64")]
// The AVX-512 intrinsics and target features are stable since Rust 1.89, the workspace's
// `rust-version`.

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
/// Token pairs multiplied together (Q4_0, K-quants).
const Q4_0_PAIRS: usize = 3;
const K_PAIRS: usize = 2;

/// Whether the CPU has what these kernels (and the one-row ones of [`super::avx512`]) use:
/// AVX-512 F, BW, VL and VNNI, and AVX2, FMA and F16C for the helpers shared with
/// [`super::avx2`]. `SPILLWAY_CPU_AVX512=0` turns them off (the AVX2 kernels give the same
/// bits), to compare the two.
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
            && super::Isa::detect() == super::Isa::Avx2
            && std::env::var("SPILLWAY_CPU_AVX512").map_or(true, |v| v != "0")
    })
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

/// One Q8_K super-block of two tokens (the second a copy of the first for the last token of
/// an odd batch), each 256-bit half one token, like [`PairBlock`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct PairSuper {
    /// Each 32 activations of the two tokens.
    y: [__m512i; 8],
    /// The activation scale, in the eight lanes of each token.
    dy: __m512,
    /// The activation scale, in the four lanes of each token (for the mins).
    dy4: __m256,
    /// Each token's activation sums per 32 elements.
    sums: __m256i,
}

/// The tokens of a batch, converted for one weight type, with their per-batch extras; by
/// pairs of tokens, then blocks.
pub struct Batch<'a> {
    ty: GgmlType,
    n_tok: usize,
    blocks: usize,
    /// Q4_0.
    pairs: Vec<PairBlock>,
    /// Q4_K and Q6_K.
    supers: Vec<PairSuper>,
    /// Q6_K: `-Σ 32 y` in fours for every 32 activations of the two tokens: what
    /// `vpdpbusd` starts from, so that the unsigned weights `q` give `Σ (q - 32) y`.
    y32: Vec<[__m512i; 8]>,
    _acts: std::marker::PhantomData<&'a [Activation<'a>]>,
}

impl<'a> Batch<'a> {
    /// # Safety
    /// The CPU must have the features [`available`] checks for.
    ///
    /// # Panics
    /// If `ty` has no kernel here, or an activation is not in `ty`'s format or width.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn new(ty: GgmlType, acts: &'a [Activation<'a>]) -> Batch<'a> {
        assert!(supports(ty), "no AVX-512 batched kernel for {ty}");
        let mut b = Batch {
            ty,
            n_tok: acts.len(),
            blocks: 0,
            pairs: Vec::new(),
            supers: Vec::new(),
            y32: Vec::new(),
            _acts: std::marker::PhantomData,
        };
        for pair in acts.chunks(2) {
            let (a, c) = (&pair[0], pair.last().unwrap());
            match (a, c) {
                (Activation::Q8_0(ya), Activation::Q8_0(yc)) if ty == GgmlType::Q4_0 => {
                    assert_eq!(ya.len(), yc.len(), "activation widths");
                    b.blocks = ya.len();
                    for (a, c) in ya.iter().zip(yc.iter()) {
                        // SAFETY: `qs` is 32 bytes.
                        let (qa, qc) = unsafe {
                            (
                                _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i),
                                _mm256_loadu_si256(c.qs.as_ptr() as *const __m256i),
                            )
                        };
                        let y = join(qa, qc);
                        let eights =
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(8), y);
                        let (da, dc) = (f16_to_f32(a.d.to_bits()), f16_to_f32(c.d.to_bits()));
                        b.pairs.push(PairBlock {
                            y,
                            neg8: _mm512_sub_epi32(_mm512_setzero_si512(), eights),
                            dy: join_ps(_mm256_set1_ps(da), _mm256_set1_ps(dc)),
                        });
                    }
                }
                (Activation::Q8K(ya), Activation::Q8K(yc)) if ty != GgmlType::Q4_0 => {
                    assert_eq!(ya.len(), yc.len(), "activation widths");
                    b.blocks = ya.len();
                    for (a, c) in ya.iter().zip(yc.iter()) {
                        // SAFETY: reads inside the blocks' arrays.
                        unsafe { b.push_super(ty, a, c) };
                    }
                }
                _ => panic!("activation format does not match {ty}"),
            }
        }
        b
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn push_super(&mut self, ty: GgmlType, a: &BlockQ8K, c: &BlockQ8K) {
        let mut y = [_mm512_setzero_si512(); 8];
        for (j, v) in y.iter_mut().enumerate() {
            // SAFETY: 32 activations at 32 j < 256.
            *v = unsafe {
                join(
                    _mm256_loadu_si256(a.qs.as_ptr().add(32 * j) as *const _),
                    _mm256_loadu_si256(c.qs.as_ptr().add(32 * j) as *const _),
                )
            };
        }
        let mut sums = [_mm_setzero_si128(); 2];
        for (h, blk) in [a, c].into_iter().enumerate() {
            // SAFETY: `bsums` is 16 i16 = 32 bytes.
            let bsums = unsafe { _mm256_loadu_si256(blk.bsums.as_ptr() as *const __m256i) };
            sums[h] = _mm_hadd_epi16(
                _mm256_castsi256_si128(bsums),
                _mm256_extracti128_si256::<1>(bsums),
            );
        }
        self.supers.push(PairSuper {
            y,
            dy: join_ps(_mm256_set1_ps(a.d), _mm256_set1_ps(c.d)),
            dy4: _mm256_insertf128_ps::<1>(
                _mm256_castps128_ps256(_mm_set1_ps(a.d)),
                _mm_set1_ps(c.d),
            ),
            sums: _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(sums[0]), sums[1]),
        });
        if ty == GgmlType::Q6K {
            let (m32, zero) = (_mm512_set1_epi8(32), _mm512_setzero_si512());
            let mut y32 = [zero; 8];
            for (n, y) in y32.iter_mut().zip(y) {
                *n = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, m32, y));
            }
            self.y32.push(y32);
        }
    }

    /// Bytes of per-token data the kernels read for one token.
    fn token_bytes(&self) -> usize {
        self.blocks
            * match self.ty {
                GgmlType::Q4_0 => size_of::<PairBlock>() / 2,
                GgmlType::Q4K => size_of::<PairSuper>() / 2,
                _ => size_of::<PairSuper>() / 2 + 8 * 32,
            }
    }
}

thread_local! {
    /// Each thread's panels, kept from one task to the next.
    static PANELS: std::cell::RefCell<Vec<Panel>> = const { std::cell::RefCell::new(Vec::new()) };
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
pub unsafe fn products(
    batch: &Batch<'_>,
    m: MatRef<'_>,
    start: usize,
    end: usize,
    out: *mut f32,
    stride: usize,
) {
    assert_eq!(m.ty, batch.ty, "batch made for another weight type");
    PANELS.with_borrow_mut(|panels| {
        panels.resize_with(GROUP_ROWS / PANEL_ROWS, Panel::default);
        // SAFETY: the caller's guarantee.
        unsafe { products_with(panels, batch, m, start, end, out, stride) }
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn products_with(
    panels: &mut [Panel],
    batch: &Batch<'_>,
    m: MatRef<'_>,
    start: usize,
    end: usize,
    out: *mut f32,
    stride: usize,
) {
    let n_pairs = batch.n_tok.div_ceil(2);
    // Pairs of tokens a chunk: a multiple of both kernels' pairs at once.
    let step = Q4_0_PAIRS * K_PAIRS;
    let chunk = (CHUNK_BYTES / (2 * batch.token_bytes()).max(1) / step).max(1) * step;
    for g in (start..end).step_by(GROUP_ROWS) {
        let g_end = (g + GROUP_ROWS).min(end);
        let n_panels = (g_end - g).div_ceil(PANEL_ROWS);
        for (k, panel) in panels[..n_panels].iter_mut().enumerate() {
            let first = g + k * PANEL_ROWS;
            let n = PANEL_ROWS.min(g_end - first);
            let mut rows: [&[u8]; PANEL_ROWS] = [&[]; PANEL_ROWS];
            for (j, row) in rows[..n].iter_mut().enumerate() {
                *row = m.row(first + j);
            }
            // SAFETY: the caller's guarantee.
            unsafe { panel.unpack(batch, &rows[..n]) };
        }
        for p0 in (0..n_pairs).step_by(chunk) {
            let p1 = (p0 + chunk).min(n_pairs);
            for (k, panel) in panels[..n_panels].iter().enumerate() {
                let at = Out {
                    ptr: out,
                    stride,
                    first: g + k * PANEL_ROWS,
                    n_tok: batch.n_tok,
                };
                // SAFETY: the caller's guarantee.
                unsafe { panel.products(batch, p0, p1, at) };
            }
        }
    }
}

/// Where a panel's results go: `ptr[t * stride + first + r]` for tokens below `n_tok`.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    stride: usize,
    first: usize,
    n_tok: usize,
}

impl Out {
    /// Writes row `r`'s products with tokens `2 pair` and `2 pair + 1`.
    ///
    /// # Safety
    /// As [`products`].
    #[inline]
    unsafe fn put(&self, pair: usize, r: usize, a: f32, b: f32) {
        let t = 2 * pair;
        // SAFETY: the caller's guarantee.
        unsafe {
            self.ptr.add(t * self.stride + self.first + r).write(a);
            if t + 1 < self.n_tok {
                self.ptr
                    .add((t + 1) * self.stride + self.first + r)
                    .write(b);
            }
        }
    }
}

/// Up to [`PANEL_ROWS`] weight rows unpacked, block-interleaved (block 0 of every row, then
/// block 1, ...).
#[derive(Default)]
struct Panel {
    /// Q4_0: each block's weights plus 8, as unsigned bytes. K-quants: per super-block, for
    /// each 32 weights, the unsigned weights and their scales spread for `vpdpwssd`.
    w256: Vec<__m256i>,
    /// Q4_K: each super-block's mins, widened to i16, in both halves.
    mins: Vec<__m256i>,
    /// Q4_K: per super-block, for each two rows, their [`Panel::mins`] side by side, and their
    /// `dmin` in eight lanes each (the last row twice when the rows are odd).
    mins2: Vec<(__m512i, __m512)>,
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

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn join_ps(lo: __m256, hi: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
        _mm256_castps_pd(hi),
    ))
}

/// `_mm512_dpwssd_epi32`, kept as one instruction: LLVM splits the intrinsic into `vpmaddwd`
/// and `vpaddd` unless it is tuning for a CPU it knows to run `vpdpwssd` fast, and the split
/// costs a quarter of the K-quant kernels' speed on Sapphire Rapids. Same result.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut acc = acc;
    // SAFETY: the function's target features include AVX-512 VNNI; no memory access.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// The sums of the eight lanes of each half.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn hsum_halves(a: __m512) -> (f32, f32) {
    (
        hsum_ps(_mm512_castps512_ps256(a)),
        hsum_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
            _mm512_castps_pd(a),
        ))),
    )
}

/// The sums of the four lanes of each half.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn hsum4_halves(a: __m256) -> (f32, f32) {
    let h = |a: __m128| {
        let m = _mm_add_ps(a, _mm_movehl_ps(a, a));
        _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)))
    };
    (
        h(_mm256_castps256_ps128(a)),
        h(_mm256_extractf128_ps::<1>(a)),
    )
}

// The kernels index accumulators, registers and activations by the same row and token indices:
// plain index loops say that most directly.
#[allow(clippy::needless_range_loop)]
impl Panel {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(&mut self, batch: &Batch<'_>, rows: &[&[u8]]) {
        let bb = batch.ty.block_bytes() as usize;
        for row in rows {
            assert_eq!(row.len(), batch.blocks * bb, "row width");
        }
        self.w256.clear();
        self.mins.clear();
        self.mins2.clear();
        self.scales.clear();
        let n = rows.len();
        self.rows = n;
        for b in 0..batch.blocks {
            for row in rows {
                // SAFETY: the caller's guarantee.
                unsafe { self.unpack_block(batch.ty, &row[b * bb..(b + 1) * bb]) };
            }
            if batch.ty == GgmlType::Q4K {
                let (mins, d) = (&self.mins[b * n..], &self.scales[2 * b * n..]);
                for r in (0..n).step_by(2) {
                    let s = (r + 1).min(n - 1);
                    self.mins2.push((
                        join(mins[r], mins[s]),
                        join_ps(_mm256_set1_ps(d[2 * r + 1]), _mm256_set1_ps(d[2 * s + 1])),
                    ));
                }
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
                let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64));
                self.mins.push(_mm256_inserti128_si256::<1>(
                    _mm256_castsi128_si256(mins),
                    mins,
                ));
                let sc128 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64));
                let sc = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(sc128), sc128);
                for i in 0..4 {
                    // SAFETY: 32 bytes of nibbles at 16 + 32 i < 144.
                    let bits =
                        unsafe { _mm256_loadu_si256(b.as_ptr().add(16 + 32 * i) as *const _) };
                    self.w256.push(_mm256_and_si256(bits, low));
                    self.w256
                        .push(_mm256_shuffle_epi8(sc, broadcast_i16(2 * i)));
                    self.w256
                        .push(_mm256_and_si256(_mm256_srli_epi16::<4>(bits), low));
                    self.w256
                        .push(_mm256_shuffle_epi8(sc, broadcast_i16(2 * i + 1)));
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
                    // Each 32-bit lane's sum `Σ (q - 32) y` of four weights fits in its low
                    // 16 bits (|·| ≤ 4 · 32 · 128), so `vpdpwssd` with the scale in the low
                    // half and 0 in the high half multiplies it by the scale.
                    let low16 = _mm256_set1_epi32(0xffff);
                    for (k, q) in q.into_iter().enumerate() {
                        self.w256.push(q);
                        self.w256.push(_mm256_and_si256(sc(4 * n + k), low16));
                    }
                }
                self.scales.push(half(b, 208));
            }
            other => unreachable!("Batch::new refuses {other}"),
        }
    }

    /// Products of the unpacked rows with token pairs `p0..p1`.
    ///
    /// # Safety
    /// As [`products`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn products(&self, batch: &Batch<'_>, p0: usize, p1: usize, out: Out) {
        // SAFETY (all): the caller's guarantee.
        unsafe {
            match self.rows {
                4 => self.products_of::<4>(batch, p0, p1, out),
                3 => self.products_of::<3>(batch, p0, p1, out),
                2 => self.products_of::<2>(batch, p0, p1, out),
                _ => self.products_of::<1>(batch, p0, p1, out),
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn products_of<const R: usize>(
        &self,
        batch: &Batch<'_>,
        p0: usize,
        p1: usize,
        out: Out,
    ) {
        let mut p = p0;
        // SAFETY (all): the caller's guarantee.
        unsafe {
            while p < p1 {
                let left = p1 - p;
                p += match batch.ty {
                    GgmlType::Q4_0 if left >= 3 => self.q4_0::<R, 3>(batch, p, out),
                    GgmlType::Q4_0 if left == 2 => self.q4_0::<R, 2>(batch, p, out),
                    GgmlType::Q4_0 => self.q4_0::<R, 1>(batch, p, out),
                    GgmlType::Q4K if left >= 2 => self.q4_k::<R, 2>(batch, p, out),
                    GgmlType::Q4K => self.q4_k::<R, 1>(batch, p, out),
                    _ if left >= 2 => self.q6_k::<R, 2>(batch, p, out),
                    _ => self.q6_k::<R, 1>(batch, p, out),
                };
            }
        }
    }

    /// `super::avx2::dot_q4_0` for `R` rows and token pairs `pair..pair + P`: per lane
    /// `acc = fma(d_w · d_y, Σ w y, acc)` block after block, as there. Returns `P`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q4_0<const R: usize, const P: usize>(
        &self,
        batch: &Batch<'_>,
        pair: usize,
        out: Out,
    ) -> usize {
        let nb = batch.blocks;
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let ys = &batch.pairs[pair * nb..(pair + P) * nb];
        for (b, (w, dw)) in self
            .w256
            .chunks_exact(R)
            .zip(self.scales.chunks_exact(R))
            .enumerate()
        {
            for r in 0..R {
                let w = _mm512_broadcast_i64x4(w[r]);
                let dw = _mm512_set1_ps(dw[r]);
                for k in 0..P {
                    let y = &ys[k * nb + b];
                    let s = _mm512_dpbusd_epi32(y.neg8, w, y.y);
                    acc[r][k] =
                        _mm512_fmadd_ps(_mm512_mul_ps(dw, y.dy), _mm512_cvtepi32_ps(s), acc[r][k]);
                }
            }
        }
        for r in 0..R {
            for k in 0..P {
                let (a, b) = hsum_halves(acc[r][k]);
                // SAFETY: the caller's guarantee.
                unsafe { out.put(pair + k, r, a, b) };
            }
        }
        P
    }

    /// `super::avx2::dot_q4_k` for `R` rows and token pairs `pair..pair + P`. Returns `P`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q4_k<const R: usize, const P: usize>(
        &self,
        batch: &Batch<'_>,
        pair: usize,
        out: Out,
    ) -> usize {
        let nb = batch.blocks;
        let ys = &batch.supers[pair * nb..(pair + P) * nb];
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        for (b, (v, d)) in self
            .w256
            .chunks_exact(16 * R)
            .zip(self.scales.chunks_exact(2 * R))
            .enumerate()
        {
            for r in 0..R {
                let mut isum = [_mm512_setzero_si512(); P];
                for j in 0..8 {
                    let w = _mm512_broadcast_i64x4(v[16 * r + 2 * j]);
                    let s = _mm512_broadcast_i64x4(v[16 * r + 2 * j + 1]);
                    for k in 0..P {
                        let p = _mm512_maddubs_epi16(w, ys[k * nb + b].y[j]);
                        isum[k] = dpwssd(isum[k], p, s);
                    }
                }
                let dr = _mm512_set1_ps(d[2 * r]);
                for k in 0..P {
                    let y = &ys[k * nb + b];
                    acc[r][k] = _mm512_fmadd_ps(
                        _mm512_mul_ps(dr, y.dy),
                        _mm512_cvtepi32_ps(isum[k]),
                        acc[r][k],
                    );
                }
            }
        }
        // The mins' chains apart (their own block order, as in `dot_q4_k`), two rows to a
        // register: `[row r: token a, token b | row r + 1: token a, token b]`.
        let rp = R.div_ceil(2);
        let mut acc_m = [[_mm512_setzero_ps(); P]; 2];
        for (b, mins) in self.mins2.chunks_exact(rp).enumerate() {
            for (acc_m, &(m2, dmin2)) in acc_m.iter_mut().zip(mins) {
                for k in 0..P {
                    let y = &ys[k * nb + b];
                    let m = _mm512_madd_epi16(m2, _mm512_broadcast_i64x4(y.sums));
                    let dy4 = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(y.dy4)));
                    acc_m[k] =
                        _mm512_fmadd_ps(_mm512_mul_ps(dmin2, dy4), _mm512_cvtepi32_ps(m), acc_m[k]);
                }
            }
        }
        for r in 0..R {
            for k in 0..P {
                let (a, b) = hsum_halves(acc[r][k]);
                let m = acc_m[r / 2][k];
                let m = if r % 2 == 0 {
                    _mm512_castps512_ps256(m)
                } else {
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(m)))
                };
                let (ma, mb) = hsum4_halves(m);
                // SAFETY: the caller's guarantee.
                unsafe { out.put(pair + k, r, a - ma, b - mb) };
            }
        }
        P
    }

    /// `super::avx2::dot_q6_k` for `R` rows and token pairs `pair..pair + P`. Returns `P`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q6_k<const R: usize, const P: usize>(
        &self,
        batch: &Batch<'_>,
        pair: usize,
        out: Out,
    ) -> usize {
        let nb = batch.blocks;
        let ys = &batch.supers[pair * nb..(pair + P) * nb];
        let y32 = &batch.y32[pair * nb..(pair + P) * nb];
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        for (b, (v, d)) in self
            .w256
            .chunks_exact(16 * R)
            .zip(self.scales.chunks_exact(R))
            .enumerate()
        {
            for r in 0..R {
                let mut isum = [_mm512_setzero_si512(); P];
                for j in 0..8 {
                    let w = _mm512_broadcast_i64x4(v[16 * r + 2 * j]);
                    let s = _mm512_broadcast_i64x4(v[16 * r + 2 * j + 1]);
                    for k in 0..P {
                        let p = _mm512_dpbusd_epi32(y32[k * nb + b][j], w, ys[k * nb + b].y[j]);
                        isum[k] = dpwssd(isum[k], p, s);
                    }
                }
                let dr = _mm512_set1_ps(d[r]);
                for k in 0..P {
                    let y = &ys[k * nb + b];
                    acc[r][k] = _mm512_fmadd_ps(
                        _mm512_mul_ps(dr, y.dy),
                        _mm512_cvtepi32_ps(isum[k]),
                        acc[r][k],
                    );
                }
            }
        }
        for r in 0..R {
            for k in 0..P {
                let (a, b) = hsum_halves(acc[r][k]);
                // SAFETY: the caller's guarantee.
                unsafe { out.put(pair + k, r, a, b) };
            }
        }
        P
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
            // Row counts around the panel and group sizes (panels of 1 to 4 rows); odd token
            // counts (tokens go in pairs) and counts that are not whole blocks of pairs.
            for (n_out, n_tok) in [(1, 1), (5, 2), (6, 4), (7, 5), (37, 5), (33, 7), (64, 13)] {
                check(ty, d_at, 512, n_out, n_tok);
            }
            // Wide rows: the tokens come in several chunks.
            check(ty, d_at, 8192, 6, 53);
        }
    }
}
