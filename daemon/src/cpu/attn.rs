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

/// [`dot_f32_f16`] on `isa` (detected once by the caller, for loops).
pub fn dot_f32_f16_with(isa: Isa, q: &[f32], k: &[f16]) -> f32 {
    assert_eq!(q.len(), k.len(), "dot_f32_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
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
        let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        let mut sum = _mm_cvtss_f32(s);
        while i < n {
            sum += k[i].to_f32() * q[i];
            i += 1;
        }
        sum
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
        assert_eq!(dot_f32_f16(&[2.0], &[f16::from_f32(3.0)]), 6.0);
        let mut acc = [1.0];
        axpy_f16(&mut acc, 2.0, &[f16::from_f32(0.5)]);
        assert_eq!(acc, [2.0]);
    }
}
