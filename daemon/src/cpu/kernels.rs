//! Run-time choice of the dot-product kernel for a weight type: AVX2 when the CPU has it (and
//! FMA, F16C), with AVX-512 VNNI for Q8_0 and Q4_0 rows where the CPU has that too (the same
//! bits as AVX2), NEON on aarch64, the scalar reference otherwise.

use crate::gguf::GgmlType;

use super::act::Activation;

/// `row · act` for rows of one weight type.
pub type DotFn = fn(&[u8], &Activation<'_>) -> f32;

/// Which implementation to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Neon,
}

impl Isa {
    /// The best the running CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Isa::Avx2;
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            return Isa::Neon;
        }
        Isa::Scalar
    }
}

/// Wraps a kernel over one activation format as a [`DotFn`].
macro_rules! wrap {
    ($name:ident, $variant:ident, $kernel:expr) => {
        pub fn $name(row: &[u8], act: &Activation<'_>) -> f32 {
            match act {
                Activation::$variant(y) => $kernel(row, y),
                _ => panic!("activation format does not match the weight type"),
            }
        }
    };
}

/// The kernel for rows of `ty` on `isa`. A kernel panics if handed an activation in a format
/// other than the one [`Activation::new`] makes for `ty`.
///
/// # Panics
/// For a weight type without kernels (the model loader only accepts those with).
pub fn dot_kernel(ty: GgmlType, isa: Isa) -> DotFn {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && super::gemm_avx512::available() {
        match ty {
            GgmlType::Q8_0 => return avx512::q8_0,
            GgmlType::Q4_0 => return avx512::q4_0,
            _ => {}
        }
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        match ty {
            GgmlType::F32 => return avx2::f32,
            GgmlType::F16 => return avx2::f16,
            GgmlType::Q8_0 => return avx2::q8_0,
            GgmlType::Q4_0 => return avx2::q4_0,
            GgmlType::Q4K => return avx2::q4_k,
            GgmlType::Q5K => return avx2::q5_k,
            GgmlType::Q6K => return avx2::q6_k,
            _ => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        match ty {
            GgmlType::F32 => return neon::f32,
            GgmlType::F16 => return neon::f16,
            GgmlType::Q8_0 => return neon::q8_0,
            GgmlType::Q4_0 => return neon::q4_0,
            GgmlType::Q4K => return neon::q4_k,
            GgmlType::Q5K => return neon::q5_k,
            GgmlType::Q6K => return neon::q6_k,
            _ => {}
        }
    }
    let _ = isa;
    match ty {
        GgmlType::F32 => scalar::f32,
        GgmlType::F16 => scalar::f16,
        GgmlType::BF16 => scalar::bf16,
        GgmlType::Q8_0 => scalar::q8_0,
        GgmlType::Q4_0 => scalar::q4_0,
        GgmlType::Q4K => scalar::q4_k,
        GgmlType::Q5K => scalar::q5_k,
        GgmlType::Q6K => scalar::q6_k,
        other => panic!("no dot-product kernel for {other}"),
    }
}

mod scalar {
    use super::super::dot;
    use super::Activation;

    wrap!(f32, F32, dot::dot_f32);
    wrap!(f16, Rounded, dot::dot_f16);
    wrap!(bf16, Rounded, dot::dot_bf16);
    wrap!(q8_0, Q8_0, dot::dot_q8_0);
    wrap!(q4_0, Q8_0, dot::dot_q4_0);
    wrap!(q4_k, Q8K, dot::dot_q4_k);
    wrap!(q5_k, Q8K, dot::dot_q5_k);
    wrap!(q6_k, Q8K, dot::dot_q6_k);
}

/// SAFETY (every call below): `dot_kernel` hands these out only for `Isa::Avx2`, which
/// `Isa::detect` returns only when the CPU has AVX2, FMA and F16C; lengths are checked inside.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::avx2 as k;
    use super::Activation;

    wrap!(f32, F32, |r, y| unsafe { k::dot_f32(r, y) });
    wrap!(f16, Rounded, |r, y| unsafe { k::dot_f16(r, y) });
    wrap!(q8_0, Q8_0, |r, y| unsafe { k::dot_q8_0(r, y) });
    wrap!(q4_0, Q8_0, |r, y| unsafe { k::dot_q4_0(r, y) });
    wrap!(q4_k, Q8K, |r, y| unsafe { k::dot_q4_k(r, y) });
    wrap!(q5_k, Q8K, |r, y| unsafe { k::dot_q5_k(r, y) });
    wrap!(q6_k, Q8K, |r, y| unsafe { k::dot_q6_k(r, y) });
}

/// SAFETY (every call below): `dot_kernel` hands these out only for `Isa::Avx2` when
/// `gemm_avx512::available` found AVX-512 F, BW, VL and VNNI; lengths are checked inside.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::avx512 as k;
    use super::Activation;

    wrap!(q8_0, Q8_0, |r, y| unsafe { k::dot_q8_0(r, y) });
    wrap!(q4_0, Q8_0, |r, y| unsafe { k::dot_q4_0(r, y) });
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::super::neon as k;
    use super::Activation;

    wrap!(f32, F32, k::dot_f32);
    wrap!(f16, Rounded, k::dot_f16);
    wrap!(q8_0, Q8_0, k::dot_q8_0);
    wrap!(q4_0, Q8_0, k::dot_q4_0);
    wrap!(q4_k, Q8K, k::dot_q4_k);
    wrap!(q5_k, Q8K, k::dot_q5_k);
    wrap!(q6_k, Q8K, k::dot_q6_k);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matvec::tests::noise;

    /// Random rows of `ty` whose f16 scales (at `d_at` in each block) are made finite.
    fn random_rows(ty: GgmlType, n_in: usize, n_rows: usize, d_at: &[usize]) -> Vec<u8> {
        let bb = ty.block_bytes() as usize;
        let n_blocks = n_rows * n_in / ty.block_size() as usize;
        let mut bytes: Vec<u8> = noise(n_blocks * bb, 11)
            .iter()
            .map(|v| (v.to_bits() >> 7) as u8)
            .collect();
        for (i, block) in bytes.chunks_exact_mut(bb).enumerate() {
            for &at in d_at {
                let d = half::f16::from_f32(0.001 + 0.0001 * (i % 7) as f32);
                block[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
            }
        }
        bytes
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_vnni_kernels_give_the_avx2_kernels_bits() {
        if Isa::detect() != Isa::Avx2 || !crate::cpu::gemm_avx512::available() {
            eprintln!("no AVX-512 VNNI on this CPU: nothing to compare");
            return;
        }
        let n_in = 4096;
        let x = noise(n_in, 5);
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
            let rows = random_rows(ty, n_in, 7, &[0]);
            let act = Activation::new(ty, &x);
            let (vnni, plain) = match ty {
                GgmlType::Q8_0 => (avx512::q8_0 as DotFn, avx2::q8_0 as DotFn),
                _ => (avx512::q4_0 as DotFn, avx2::q4_0 as DotFn),
            };
            assert!(
                std::ptr::fn_addr_eq(dot_kernel(ty, Isa::Avx2), vnni),
                "{ty}"
            );
            for row in rows.chunks_exact(rows.len() / 7) {
                let (a, b) = (vnni(row, &act), plain(row, &act));
                assert_eq!(a.to_bits(), b.to_bits(), "{ty}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn simd_kernels_agree_with_scalar_ones() {
        #[cfg(target_arch = "aarch64")]
        assert_eq!(Isa::detect(), Isa::Neon, "every aarch64 Linux CPU has NEON");
        if Isa::detect() == Isa::Scalar {
            eprintln!("no SIMD kernels on this CPU: nothing to compare");
            return;
        }
        let n_in = 1024;
        let x = noise(n_in, 9);
        let cases: [(GgmlType, &[usize]); 7] = [
            (GgmlType::F32, &[]),
            (GgmlType::F16, &[]),
            (GgmlType::Q8_0, &[0]),
            (GgmlType::Q4_0, &[0]),
            (GgmlType::Q4K, &[0, 2]),
            (GgmlType::Q5K, &[0, 2]),
            (GgmlType::Q6K, &[208]),
        ];
        for (ty, d_at) in cases {
            let rows: Vec<u8> = if ty == GgmlType::F32 {
                noise(n_in * 5, 4)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect()
            } else if ty == GgmlType::F16 {
                noise(n_in * 5, 4)
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
                    .collect()
            } else {
                random_rows(ty, n_in, 5, d_at)
            };
            let act = Activation::new(ty, &x);
            let (fast, slow) = (dot_kernel(ty, Isa::detect()), dot_kernel(ty, Isa::Scalar));
            let rb = rows.len() / 5;
            for row in rows.chunks_exact(rb) {
                let (a, b) = (fast(row, &act), slow(row, &act));
                assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{ty}: {a} vs {b}");
                // NEON keeps the scalar kernels' float operations for the quantized types.
                if Isa::detect() == Isa::Neon && !matches!(ty, GgmlType::F32 | GgmlType::F16) {
                    assert_eq!(a.to_bits(), b.to_bits(), "{ty}: {a} vs {b}");
                }
            }
            // Odd lengths exercise the scalar tails.
            if matches!(ty, GgmlType::F32 | GgmlType::F16) {
                let act = Activation::new(ty, &x[..13]);
                let row = &rows[..13 * if ty == GgmlType::F32 { 4 } else { 2 }];
                assert!((fast(row, &act) - slow(row, &act)).abs() < 1e-5);
            }
        }
    }
}
