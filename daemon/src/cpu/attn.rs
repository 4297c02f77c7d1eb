//! Attention helpers over the f16 KV cache: `q · k` with f32 queries and f16 keys, and
//! `acc += a * v` with f16 values (bit-identical to the scalar loop). AVX2+FMA+F16C (converting eight halves at a time with
//! `vcvtph2ps`) when [`Isa::detect`] finds them, a scalar reference otherwise. The SIMD
//! versions differ from the scalar ones only in the order of the float additions.

use half::f16;

use super::kernels::Isa;

/// `Σ q[i] * k[i]`.
///
/// # Panics
/// If the lengths differ.
pub fn dot_f32_f16(q: &[f32], k: &[f16]) -> f32 {
    dot_f32_f16_with(Isa::detect(), q, k)
}

/// `acc[i] += a * v[i]`.
///
/// # Panics
/// If the lengths differ.
pub fn axpy_f16(acc: &mut [f32], a: f32, v: &[f16]) {
    axpy_f16_with(Isa::detect(), acc, a, v)
}

/// `out = Σ_p probs[p] * values[p * stride + offset..][..out.len()]`, accumulated in
/// position order from zero: the same operations as [`axpy_f16`] over the positions, so the
/// same result, with the running sums kept in registers instead of memory.
///
/// # Panics
/// If `values` is too short for `probs.len()` rows of `stride`.
pub fn weighted_sum_f16_with(
    isa: Isa,
    out: &mut [f32],
    probs: &[f32],
    values: &[f16],
    stride: usize,
    offset: usize,
) {
    if let Some(last) = probs.len().checked_sub(1) {
        assert!(
            offset + out.len() <= stride && values.len() >= last * stride + offset + out.len(),
            "weighted_sum_f16: values too short"
        );
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (and AVX2, FMA, F16C: `Isa::Avx2`); the bounds are
            // checked above.
            return unsafe { avx512::weighted_sum_f16(out, probs, values, stride, offset) };
        }
        // SAFETY: `Isa::Avx2` means AVX2, FMA and F16C; the bounds are checked above.
        return unsafe { avx2::weighted_sum_f16(out, probs, values, stride, offset) };
    }
    let _ = isa;
    out.fill(0.0);
    for (p, &a) in probs.iter().enumerate() {
        scalar::axpy_f16(out, a, &values[p * stride + offset..][..out.len()]);
    }
}

/// [`dot_f32_f16`] on `isa` (detected once by the caller, for loops).
pub fn dot_f32_f16_with(isa: Isa, q: &[f32], k: &[f16]) -> f32 {
    assert_eq!(q.len(), k.len(), "dot_f32_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (and AVX2, FMA, F16C: `Isa::Avx2`); the lengths
            // are equal.
            return unsafe { avx512::dot_f32_f16(q, k) };
        }
        // SAFETY: `Isa::Avx2` is only returned by `Isa::detect` when the CPU has AVX2, FMA and
        // F16C; the lengths are equal.
        return unsafe { avx2::dot_f32_f16(q, k) };
    }
    let _ = isa;
    scalar::dot_f32_f16(q, k)
}

/// [`axpy_f16`] on `isa` (detected once by the caller, for loops).
pub fn axpy_f16_with(isa: Isa, acc: &mut [f32], a: f32, v: &[f16]) {
    assert_eq!(acc.len(), v.len(), "axpy_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: as in `dot_f32_f16_with`.
        return unsafe { avx2::axpy_f16(acc, a, v) };
    }
    let _ = isa;
    scalar::axpy_f16(acc, a, v)
}

mod scalar {
    use half::f16;

    pub fn dot_f32_f16(q: &[f32], k: &[f16]) -> f32 {
        k.iter().zip(q).map(|(k, q)| k.to_f32() * q).sum()
    }

    pub fn axpy_f16(acc: &mut [f32], a: f32, v: &[f16]) {
        for (o, v) in acc.iter_mut().zip(v) {
            *o += a * v.to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    /// Eight halves from `p` as f32.
    ///
    /// # Safety
    /// F16C; `p` valid for reading 8 halves.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }

    /// # Safety
    /// AVX2, FMA and F16C; `q.len() == k.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f32_f16(q: &[f32], k: &[f16]) -> f32 {
        let n = q.len();
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * j;
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(o)), load8(kp.add(o)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(i)), load8(kp.add(i)), acc[0]);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut sum = crate::cpu::avx2::hsum_ps(s);
        while i < n {
            sum += k[i].to_f32() * q[i];
            i += 1;
        }
        sum
    }

    /// # Safety
    /// AVX2, FMA and F16C; `values` holds `probs.len()` rows of `stride` with
    /// `offset + out.len() <= stride`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_sum_f16(
        out: &mut [f32],
        probs: &[f32],
        values: &[f16],
        stride: usize,
        offset: usize,
    ) {
        let n = out.len();
        let vp = values.as_ptr().add(offset);
        let mut i = 0;
        // 32 columns at a time in four registers, then 8, then one by one.
        while i + 32 <= n {
            let mut acc = [_mm256_setzero_ps(); 4];
            for (p, &a) in probs.iter().enumerate() {
                let av = _mm256_set1_ps(a);
                let row = vp.add(p * stride + i);
                for (j, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(av, load8(row.add(8 * j))));
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(i + 8 * j), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            let mut acc = _mm256_setzero_ps();
            for (p, &a) in probs.iter().enumerate() {
                let v = load8(vp.add(p * stride + i));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(a), v));
            }
            _mm256_storeu_ps(out.as_mut_ptr().add(i), acc);
            i += 8;
        }
        while i < n {
            let mut acc = 0.0f32;
            for (p, &a) in probs.iter().enumerate() {
                acc += a * (*vp.add(p * stride + i)).to_f32();
            }
            out[i] = acc;
            i += 1;
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C; `acc.len() == v.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_f16(acc: &mut [f32], a: f32, v: &[f16]) {
        let n = acc.len();
        let (op, vp) = (acc.as_mut_ptr(), v.as_ptr());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            let o = _mm256_loadu_ps(op.add(i));
            // Multiply, then add (no FMA): bit-identical to the scalar version.
            _mm256_storeu_ps(
                op.add(i),
                _mm256_add_ps(o, _mm256_mul_ps(av, load8(vp.add(i)))),
            );
            i += 8;
        }
        while i < n {
            acc[i] += a * v[i].to_f32();
            i += 1;
        }
    }
}

/// The AVX2 helpers with two of their 256-bit registers in each 512-bit one: the same
/// operations on every lane, in the same order, so the same results bit for bit; half the
/// conversions, multiplications and additions.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::f16;

    /// Sixteen halves from `p` as f32.
    ///
    /// # Safety
    /// AVX-512 F; `p` valid for reading 16 halves.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16(p: *const f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn lo(v: __m512) -> __m256 {
        _mm512_castps512_ps256(v)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn hi(v: __m512) -> __m256 {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
    }

    /// `super::avx2::dot_f32_f16`, its accumulators 0 and 1, and 2 and 3, in one register each.
    ///
    /// # Safety
    /// AVX-512 F, AVX2, FMA and F16C; `q.len() == k.len()`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn dot_f32_f16(q: &[f32], k: &[f16]) -> f32 {
        let n = q.len();
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let (mut a01, mut a23) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            a01 = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(i)), load16(kp.add(i)), a01);
            a23 = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(i + 16)), load16(kp.add(i + 16)), a23);
            i += 32;
        }
        let mut a0 = lo(a01);
        while i + 8 <= n {
            let kv = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i).cast()));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(i)), kv, a0);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(a0, hi(a01)), _mm256_add_ps(lo(a23), hi(a23)));
        let mut sum = crate::cpu::avx2::hsum_ps(s);
        while i < n {
            sum += k[i].to_f32() * q[i];
            i += 1;
        }
        sum
    }

    /// `super::avx2::weighted_sum_f16`, 32 columns in two registers instead of four.
    ///
    /// # Safety
    /// AVX-512 F, AVX2, FMA and F16C; `values` holds `probs.len()` rows of `stride` with
    /// `offset + out.len() <= stride`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn weighted_sum_f16(
        out: &mut [f32],
        probs: &[f32],
        values: &[f16],
        stride: usize,
        offset: usize,
    ) {
        let n = out.len();
        let vp = values.as_ptr().add(offset);
        let mut i = 0;
        while i + 32 <= n {
            let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for (p, &a) in probs.iter().enumerate() {
                let av = _mm512_set1_ps(a);
                let row = vp.add(p * stride + i);
                a0 = _mm512_add_ps(a0, _mm512_mul_ps(av, load16(row)));
                a1 = _mm512_add_ps(a1, _mm512_mul_ps(av, load16(row.add(16))));
            }
            _mm512_storeu_ps(out.as_mut_ptr().add(i), a0);
            _mm512_storeu_ps(out.as_mut_ptr().add(i + 16), a1);
            i += 32;
        }
        if i < n {
            // SAFETY: the caller's guarantee, for the columns left.
            unsafe {
                super::avx2::weighted_sum_f16(&mut out[i..], probs, values, stride, offset + i)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matvec::tests::noise;

    fn halves(x: &[f32]) -> Vec<f16> {
        x.iter().map(|&v| f16::from_f32(v)).collect()
    }

    #[test]
    fn simd_attention_helpers_agree_with_scalar() {
        let isa = Isa::detect();
        if isa == Isa::Scalar {
            eprintln!("no SIMD attention helpers on this CPU: nothing to compare");
        }
        for n in [0, 1, 7, 8, 13, 31, 32, 33, 64, 100, 128, 131] {
            let q = noise(n, 3);
            let k = halves(&noise(n, 5));
            let (fast, slow) = (
                dot_f32_f16_with(isa, &q, &k),
                dot_f32_f16_with(Isa::Scalar, &q, &k),
            );
            let mag: f32 = q.iter().zip(&k).map(|(a, b)| (a * b.to_f32()).abs()).sum();
            assert!(
                (fast - slow).abs() <= 1e-5 * mag.max(1.0),
                "n={n}: {fast} vs {slow}"
            );

            let init = noise(n, 7);
            let (mut a, mut b) = (init.clone(), init);
            axpy_f16_with(isa, &mut a, 0.37, &k);
            axpy_f16_with(Isa::Scalar, &mut b, 0.37, &k);
            // Same operations element by element: exactly equal.
            assert_eq!(a, b, "n={n}");
        }
        for (n, positions) in [(64, 5), (128, 3), (40, 7), (3, 2), (8, 0)] {
            let stride = n + 16;
            let values = halves(&noise(stride * positions, 11));
            let probs = noise(positions, 13);
            let (mut fast, mut slow) = (vec![9.0; n], vec![9.0; n]);
            weighted_sum_f16_with(isa, &mut fast, &probs, &values, stride, 16);
            slow.fill(0.0);
            for (p, &a) in probs.iter().enumerate() {
                axpy_f16_with(Isa::Scalar, &mut slow, a, &values[p * stride + 16..][..n]);
            }
            assert_eq!(fast, slow, "n={n}, {positions} positions");
        }
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx2 && is_x86_feature_detected!("avx512f") {
            // The 512-bit versions do the 256-bit ones' operations lane for lane.
            for n in [0, 8, 13, 32, 40, 64, 72, 100, 128, 131] {
                let q = noise(n, 3);
                let k = halves(&noise(n, 5));
                // SAFETY: the CPU has the features; equal lengths.
                let (a, b) = unsafe { (avx512::dot_f32_f16(&q, &k), avx2::dot_f32_f16(&q, &k)) };
                assert_eq!(a.to_bits(), b.to_bits(), "n={n}: {a} vs {b}");
                let (stride, positions) = (n + 16, 9);
                let values = halves(&noise(stride * positions, 11));
                let probs = noise(positions, 13);
                let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
                // SAFETY: as above; `values` holds the rows.
                unsafe {
                    avx512::weighted_sum_f16(&mut a, &probs, &values, stride, 16);
                    avx2::weighted_sum_f16(&mut b, &probs, &values, stride, 16);
                }
                assert_eq!(a, b, "n={n}");
            }
        }
        assert_eq!(dot_f32_f16(&[2.0], &[f16::from_f32(3.0)]), 6.0);
        let mut acc = [1.0];
        axpy_f16(&mut acc, 2.0, &[f16::from_f32(0.5)]);
        assert_eq!(acc, [2.0]);
    }
}
