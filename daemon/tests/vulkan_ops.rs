//! The memory sub-allocator, staging uploads and the decode step's matrix-vector products, norms,
//! RoPE, element-wise ops, KV cache and attention against the CPU reference (`cpu::matvec`,
//! `engine::ops`), on whatever Vulkan device the machine has (lavapipe in CI); the MoE routing and
//! expert-indexed ops are in `vulkan_moe_ops.rs`. Without a device these tests skip, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set, in which case they fail. Tolerances are stated where each
//! comparison is made.

#[path = "common/noise.rs"]
mod noise;
use noise::noise;
#[path = "common/ops_device.rs"]
mod ops_device;
use ops_device::{device, noise_bytes, weight_rows, Gpu, TYPES};

use half::f16;
use spillway_daemon::cpu::{attn, matvec, ThreadPool};
use spillway_daemon::engine::ops;
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::gpu::ops::{
    attention_counters, attention_scratch_floats, rope_table, AttentionArgs, Fused, RopeArgs,
    StepWord,
};
use spillway_daemon::gpu::upload::download;
use spillway_daemon::gpu::{Buffer, Kernels, MemoryUse};
use spillway_daemon::model::{MatRef, RopeLayout};
use spillway_daemon::quant::dequantize_row;

// ---- matrix-vector products ----

/// `Σ_i w_i x_i` in f64 over the dequantized row, and `Σ_i |w_i x_i|` for the tolerance.
fn exact_dots(ty: GgmlType, data: &[u8], n_in: usize, n_out: usize, x: &[f32]) -> Vec<(f64, f64)> {
    let rb = data.len() / n_out;
    let mut w = vec![0f32; n_in];
    (0..n_out)
        .map(|r| {
            dequantize_row(ty, &data[r * rb..(r + 1) * rb], &mut w).unwrap();
            w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| {
                let p = f64::from(w) * f64::from(x);
                (s + p, a + p.abs())
            })
        })
        .collect()
}

/// The CPU engine's product of the rows `data` with `x` (its kernel quantizes `x` first for the
/// quantized types, as ggml does).
fn cpu_matvec(ty: GgmlType, data: &[u8], (n_in, n_out): (usize, usize), x: &[f32]) -> Vec<f32> {
    let mref = MatRef {
        ty,
        n_in,
        n_out,
        data,
    };
    let mut y = vec![0f32; n_out];
    matvec(&ThreadPool::new(2), mref, x, &mut y);
    y
}

fn check_matvec(ty: GgmlType) {
    let Some(dev) = device() else { return };
    for gpu in Gpu::both(&dev) {
        let (n_in, n_out) = (1024, 300);
        let data = weight_rows(ty, n_in, n_out, ty as u64 + 11);
        let x = noise(n_in, 5);
        let m = gpu.matrix(ty, n_in, n_out, &data);
        let (xb, yb) = (gpu.f32s(&x), gpu.zeros(n_out));
        gpu.kernels.record(|r| r.matvec(&m, &xb, &yb)).unwrap();
        let got = yb.read_f32(n_out);

        // Accumulating into a residual: each result is `y + (W · x)`, the same product added
        // once, bit for bit.
        let residual: Vec<f32> = noise(n_out, 6).iter().map(|v| v * 4.0).collect();
        let acc = gpu.f32s(&residual);
        gpu.kernels.record(|r| r.matvec_add(&m, &xb, &acc)).unwrap();
        let want: Vec<f32> = residual.iter().zip(&got).map(|(a, b)| a + b).collect();
        assert_eq!(acc.read_f32(n_out), want, "{ty}: matvec_add");

        check_fused(&gpu, ty, (&data, n_in, n_out), &x);

        let exact = exact_dots(ty, &data, n_in, n_out, &x);
        let cpu = cpu_matvec(ty, &data, (n_in, n_out), &x);
        for (r, ((&g, &c), &(e, abs))) in got.iter().zip(&cpu).zip(&exact).enumerate() {
            // Against the exact dot of the same weights: f32 rounding only.
            assert!(
                (f64::from(g) - e).abs() <= 1e-5 * abs + 1e-6,
                "{ty} row {r}: gpu {g} exact {e}"
            );
            // Against the CPU kernel, which quantizes x to Q8 first: 1% of Σ|w·x|.
            assert!(
                (f64::from(g) - f64::from(c)).abs() <= 1e-2 * abs + 1e-4,
                "{ty} row {r}: gpu {g} cpu {c}"
            );
        }
    }
}

/// The norm and SwiGLU fused into a product (`Fused`) against the same ops as separate
/// dispatches: RMSNorm then the product, and the gate and up products then SwiGLU. The fused
/// kernel scales each sum once instead of each input, so they agree to f32 rounding: 1e-5 of
/// Σ|w·x| (from `exact_dots`) plus a few ulp of the activation.
fn check_fused(gpu: &Gpu, ty: GgmlType, (data, n_in, n_out): (&[u8], usize, usize), x: &[f32]) {
    let norm_w: Vec<f32> = noise(n_in, 7).iter().map(|v| 1.0 + 0.5 * v).collect();
    let x_scaled: Vec<f32> = x.iter().map(|v| v * 3.0).collect();
    let (xb, nb) = (gpu.f32s(&x_scaled), gpu.f32s(&norm_w));
    let eps = 1e-5;
    let m = gpu.matrix(ty, n_in, n_out, data);
    // Separate dispatches.
    let (xn, want) = (gpu.zeros(n_in), gpu.zeros(n_out));
    gpu.kernels
        .record(|r| {
            r.rms_norm(&xb, &nb, &xn, n_in as u32, 1, eps)?;
            r.matvec(&m, &xn, &want)
        })
        .unwrap();
    let want = want.read_f32(n_out);
    let mut xn_cpu = vec![0f32; n_in];
    ops::rms_norm(&x_scaled, &norm_w, eps, &mut xn_cpu);
    let bound: Vec<f64> = exact_dots(ty, data, n_in, n_out, &xn_cpu)
        .iter()
        .map(|&(_, abs)| 1e-5 * abs + 1e-6)
        .collect();
    let got = gpu.zeros(n_out);
    let normed = Fused {
        norm: Some((&nb, eps)),
        ..Fused::default()
    };
    gpu.kernels
        .record(|r| r.matvec_fused(&m, &xb, &got, normed))
        .unwrap();
    for (r, (g, w)) in got.read_f32(n_out).iter().zip(&want).enumerate() {
        assert!(
            f64::from((g - w).abs()) <= bound[r],
            "{ty} row {r}: fused norm {g}, separate {w}"
        );
    }

    // A stack of gate rows (the first half) and up rows (the second).
    let half = n_out / 2;
    let rb = data.len() / n_out;
    let (gate, up) = data[..2 * half * rb].split_at(half * rb);
    let (gm, um) = (
        gpu.matrix(ty, n_in, half, gate),
        gpu.matrix(ty, n_in, half, up),
    );
    let (gb, ub) = (gpu.zeros(half), gpu.zeros(half));
    gpu.kernels
        .record(|r| {
            r.matvec(&gm, &xn, &gb)?;
            r.matvec(&um, &xn, &ub)?;
            r.swiglu(&gb, &ub, half as u32)
        })
        .unwrap();
    let g_sep = gb.read_f32(half);
    let stack = gpu.matrix(ty, n_in, 2 * half, &data[..2 * half * rb]);
    let glu = gpu.zeros(half);
    let fused = Fused {
        norm: Some((&nb, eps)),
        glu: true,
        ..Fused::default()
    };
    gpu.kernels
        .record(|r| r.matvec_fused(&stack, &xb, &glu, fused))
        .unwrap();
    for (r, g) in glu.read_f32(half).iter().enumerate() {
        // d(silu(g)·u) = silu'(g)·u·dg + silu(g)·du, |silu'| <= 1.1, |silu(g)| <= |g| + 0.3.
        let (gv, uv) = (want[r], want[half + r]);
        let tol = 1.1 * f64::from(uv.abs()) * bound[r]
            + f64::from(gv.abs() + 0.3) * bound[half + r]
            + 1e-5 * f64::from(g_sep[r].abs()).max(1e-3);
        assert!(
            f64::from((g - g_sep[r]).abs()) <= tol,
            "{ty} row {r}: fused SwiGLU {g}, separate {} (gate {gv}, up {uv}, tol {tol})",
            g_sep[r]
        );
    }
}

#[test]
fn matvec_f32_matches_cpu() {
    check_matvec(GgmlType::F32);
}

#[test]
fn matvec_f16_matches_cpu() {
    check_matvec(GgmlType::F16);
}

#[test]
fn matvec_q8_0_matches_cpu() {
    check_matvec(GgmlType::Q8_0);
}

#[test]
fn matvec_q4_0_matches_cpu() {
    check_matvec(GgmlType::Q4_0);
}

#[test]
fn matvec_q4_0_with_integer_dots_matches_the_cpu_kernel() {
    check_int_dot(GgmlType::Q4_0);
}

#[test]
fn matvec_q8_0_with_integer_dots_matches_the_cpu_kernel() {
    check_int_dot(GgmlType::Q8_0);
}

fn check_int_dot(ty: GgmlType) {
    // The integer-dot-product variants quantize each block of inputs as the CPU engine does
    // (ggml's Q8_0) and sum the products exactly in integers: they agree with the CPU kernel to
    // f32 rounding, where the f32 variant only agrees with it to the quantization of x.
    let Some(dev) = device() else { return };
    for sg in [false, true] {
        let kernels = Kernels::with_int_dot(&dev, (sg, true), true);
        if !kernels.uses_int_dot() {
            assert!(
                std::env::var_os("SPILLWAY_REQUIRE_VULKAN").is_none(),
                "the Vulkan device has no integer dot products (core in Vulkan 1.3)"
            );
            return;
        }
        let gpu = Gpu {
            kernels,
            ..Gpu::new(&dev)
        };
        // The kernels take an invocation a block of 32 inputs (`MatVecShape::int_dot`): 32
        // invocations for 1024 inputs, 256 for 5120 (160 blocks: some invocations have none).
        for n_in in [1024, 5120] {
            check_int_dot_width(&gpu, ty, sg, n_in);
        }
    }
}

fn check_int_dot_width(gpu: &Gpu, ty: GgmlType, sg: bool, n_in: usize) {
    {
        let n_out = 300;
        let data = weight_rows(ty, n_in, n_out, 31);
        let x: Vec<f32> = noise(n_in, 32).iter().map(|v| v * 3.0).collect();
        let m = gpu.matrix(ty, n_in, n_out, &data);
        let (xb, yb) = (gpu.f32s(&x), gpu.zeros(n_out));
        gpu.kernels.record(|r| r.matvec(&m, &xb, &yb)).unwrap();
        let got = yb.read_f32(n_out);
        let cpu = cpu_matvec(ty, &data, (n_in, n_out), &x);
        let exact = exact_dots(ty, &data, n_in, n_out, &x);
        for (r, ((&g, &c), &(_, abs))) in got.iter().zip(&cpu).zip(&exact).enumerate() {
            assert!(
                (f64::from(g) - f64::from(c)).abs() <= 1e-5 * abs + 1e-5,
                "{ty} subgroups {sg} width {n_in} row {r}: gpu {g} cpu {c}"
            );
        }
        // With RMSNorm fused the kernel quantizes x times the norm's weights and scales the sums
        // after: the same blocks but for the f16 rounding of their scales.
        let norm_w: Vec<f32> = noise(n_in, 33).iter().map(|v| 1.0 + 0.5 * v).collect();
        let nb = gpu.f32s(&norm_w);
        let eps = 1e-5;
        let mut xn = vec![0f32; n_in];
        ops::rms_norm(&x, &norm_w, eps, &mut xn);
        let cpu = cpu_matvec(ty, &data, (n_in, n_out), &xn);
        let normed = Fused {
            norm: Some((&nb, eps)),
            ..Fused::default()
        };
        gpu.kernels
            .record(|r| r.matvec_fused(&m, &xb, &yb, normed))
            .unwrap();
        let exact = exact_dots(ty, &data, n_in, n_out, &xn);
        for (r, ((&g, &c), &(_, abs))) in
            yb.read_f32(n_out).iter().zip(&cpu).zip(&exact).enumerate()
        {
            assert!(
                (f64::from(g) - f64::from(c)).abs() <= 2e-3 * abs + 1e-5,
                "{ty} subgroups {sg} width {n_in} row {r}: fused norm gpu {g} cpu {c}"
            );
        }
    }
}

#[test]
fn matvec_q4_k_matches_cpu() {
    check_matvec(GgmlType::Q4K);
}

#[test]
fn matvec_q6_k_matches_cpu() {
    check_matvec(GgmlType::Q6K);
}

#[test]
fn matvec_past_the_binding_limit_is_split_by_rows_with_the_same_results() {
    let Some(dev) = device() else { return };
    let gpu = Gpu::new(&dev);
    for ty in [GgmlType::Q4_0, GgmlType::Q6K] {
        let (n_in, n_out) = (512, 77);
        let data = weight_rows(ty, n_in, n_out, 9);
        let m = gpu.matrix(ty, n_in, n_out, &data);
        let x = gpu.f32s(&noise(n_in, 2));
        let (whole, split) = (gpu.zeros(n_out), gpu.zeros(n_out));
        let one = gpu.kernels.record(|r| r.matvec(&m, &x, &whole)).unwrap();
        // 4 KiB per binding: a few rows at a time, at offsets that are not block-aligned.
        let many = gpu
            .kernels
            .record_with_max_range(4096, |r| r.matvec(&m, &x, &split))
            .unwrap();
        assert_eq!(one.dispatches, 1);
        assert!(
            many.dispatches >= (data.len() / 4096) as u32,
            "{ty}: {many:?}"
        );
        let (a, b) = (whole.read_f32(n_out), split.read_f32(n_out));
        assert!(
            a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ty}: split results differ"
        );
    }
}

#[test]
fn matvec_rows_of_one_expert_in_a_stack_match_the_whole_product() {
    let Some(dev) = device() else { return };
    let gpu = Gpu::new(&dev);
    // Rows of 34 and 18 bytes: most experts start off every binding-offset alignment.
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
        let (n_in, rows, experts) = (32, 5, 7);
        let data = weight_rows(ty, n_in, rows * experts, 4);
        let m = gpu.matrix(ty, n_in, rows * experts, &data);
        let x = gpu.f32s(&noise(n_in, 8));
        let whole = gpu.zeros(rows * experts);
        gpu.kernels.record(|r| r.matvec(&m, &x, &whole)).unwrap();
        let whole = whole.read_f32(rows * experts);
        for e in 0..experts {
            let y = gpu.zeros(rows);
            gpu.kernels
                .record(|r| r.matvec_rows(&m, e * rows, rows, &x, &y))
                .unwrap();
            let got = y.read_f32(rows);
            let want = &whole[e * rows..(e + 1) * rows];
            assert!(
                got.iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ty} expert {e}: {got:?} vs {want:?}"
            );
        }
        let y = gpu.zeros(rows);
        let past = gpu
            .kernels
            .record(|r| r.matvec_rows(&m, rows * experts - 1, 2, &x, &y));
        assert!(past.is_err(), "{ty}: rows past the end are refused");
    }
}

#[test]
fn matvec_over_a_matrix_larger_than_max_storage_buffer_range() {
    let Some(dev) = device() else { return };
    let gpu = Gpu::new(&dev);
    let ty = GgmlType::Q8_0;
    let max = dev.max_storage_buffer_range();
    let n_in = 4096;
    let rb = ty.row_bytes(n_in as u64).unwrap() as usize;
    // Just past the limit (128 MiB on lavapipe), so one binding cannot cover it.
    let n_out = (max as usize).div_ceil(rb) + 300;
    let mut data = noise_bytes(rb * n_out, 77);
    let d = f16::from_f32(0.01).to_le_bytes();
    for b in data.chunks_exact_mut(34) {
        b[..2].copy_from_slice(&d);
    }
    let m = gpu.matrix(ty, n_in, n_out, &data);
    assert!(m.buffer.size() > max);
    let x = noise(n_in, 6);
    let (xb, yb) = (gpu.f32s(&x), gpu.zeros(n_out));
    let stats = gpu.kernels.record(|r| r.matvec(&m, &xb, &yb)).unwrap();
    assert!(stats.dispatches >= 2, "{stats:?}");
    let got = yb.read_f32(n_out);
    // Every 97th row, and the rows on both sides of each binding boundary.
    let per_binding = ((max - dev.storage_offset_alignment()) / rb as u64) as usize;
    let mut rows: Vec<usize> = (0..n_out).step_by(97).collect();
    rows.extend([per_binding - 1, per_binding, n_out - 1]);
    let mut w = vec![0f32; n_in];
    for r in rows {
        dequantize_row(ty, &data[r * rb..(r + 1) * rb], &mut w).unwrap();
        let (e, abs) = w.iter().zip(&x).fold((0f64, 0f64), |(s, a), (&w, &x)| {
            let p = f64::from(w) * f64::from(x);
            (s + p, a + p.abs())
        });
        assert!(
            (f64::from(got[r]) - e).abs() <= 1e-5 * abs + 1e-6,
            "row {r}: gpu {} exact {e}",
            got[r]
        );
    }
}

// ---- rows, norms, element-wise ops ----

/// The row comes from the step buffer; bound whole, and bound as runs of a few rows (as a
/// matrix larger than `maxStorageBufferRange` is), where only the run holding it writes.
#[test]
fn get_rows_matches_dequantize_row_bit_for_bit() {
    let Some(dev) = device() else { return };
    let gpu = Gpu::new(&dev);
    for ty in TYPES {
        let (n_in, n_out) = (512, 40);
        let data = weight_rows(ty, n_in, n_out, 21);
        let m = gpu.matrix(ty, n_in, n_out, &data);
        let out = gpu.zeros(n_in);
        for (row, max_range) in [
            (0u32, None),
            (7, None),
            (39, None),
            (0, Some(4096)),
            (23, Some(4096)),
            (39, Some(4096)),
        ] {
            let step = gpu.words(&[9999, row]);
            let word = StepWord {
                buffer: &step,
                index: 1,
            };
            let max_range = max_range.unwrap_or(u64::MAX);
            gpu.kernels
                .record_with_max_range(max_range, |r| {
                    r.get_rows(&m, word, &out)?;
                    assert!(
                        max_range == u64::MAX || r.stats().dispatches > 2,
                        "{ty}: runs"
                    );
                    Ok(())
                })
                .unwrap();
            let rb = data.len() / n_out;
            let mut want = vec![0f32; n_in];
            let at = row as usize * rb;
            dequantize_row(ty, &data[at..at + rb], &mut want).unwrap();
            let got = out.read_f32(n_in);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ty} row {row}, bound {max_range}"
            );
        }
    }
}

/// `|a - b| <= tol * max(1, |b|)` everywhere.
fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}[{i}]: gpu {a} cpu {b}"
        );
    }
}

#[test]
fn rms_norm_matches_cpu() {
    let Some(dev) = device() else { return };
    for gpu in Gpu::both(&dev) {
        let (n, rows) = (1000, 3);
        let x: Vec<f32> = noise(n * rows, 1).iter().map(|v| v * 3.0).collect();
        let w = noise(n, 2);
        let (xb, wb, out) = (gpu.f32s(&x), gpu.f32s(&w), gpu.zeros(n * rows));
        gpu.kernels
            .record(|r| r.rms_norm(&xb, &wb, &out, n as u32, rows as u32, 1e-6))
            .unwrap();
        let mut want = vec![0f32; n * rows];
        for (xr, o) in x.chunks_exact(n).zip(want.chunks_exact_mut(n)) {
            ops::rms_norm(xr, &w, 1e-6, o);
        }
        // f32 sum of squares on the GPU, f64 on the CPU.
        assert_close(&out.read_f32(n * rows), &want, 1e-5, "rms_norm");
    }
}

#[test]
fn rope_matches_cpu_in_both_layouts_with_and_without_qk_norm() {
    let Some(dev) = device() else { return };
    for gpu in Gpu::both(&dev) {
        let (n_heads, head_dim, n_rot, pos) = (4usize, 64usize, 48usize, 37usize);
        let table = gpu.f32s(&rope_table(64, n_rot, 10_000.0, 1.0, None));
        let norm_w: Vec<f32> = noise(head_dim, 8).iter().map(|v| 1.0 + v).collect();
        let norm_b = gpu.f32s(&norm_w);
        let x = noise(n_heads * head_dim, 4);
        for layout in [RopeLayout::Normal, RopeLayout::Neox] {
            for qk_norm in [false, true] {
                let xb = gpu.f32s(&x);
                let args = RopeArgs {
                    layout,
                    n_heads: n_heads as u32,
                    head_dim: head_dim as u32,
                    n_rot: n_rot as u32,
                    eps: 1e-6,
                };
                let norm = qk_norm.then_some(&norm_b);
                // A token id, then its position and its sequence's first cache row.
                let step = gpu.words(&[1, pos as u32, 0]);
                let pos_word = StepWord {
                    buffer: &step,
                    index: 1,
                };
                gpu.kernels
                    .record(|r| r.rope(&xb, norm, &table, args, pos_word))
                    .unwrap();
                let (mut c, mut s) = (vec![0.0; n_rot / 2], vec![0.0; n_rot / 2]);
                ops::rope_cache(pos, n_rot, 10_000.0, 1.0, None, &mut c, &mut s);
                let mut want = x.clone();
                for head in want.chunks_exact_mut(head_dim) {
                    if qk_norm {
                        ops::rms_norm_inplace(head, &norm_w, 1e-6);
                    }
                    ops::rope_head(head, layout, &c, &s);
                }
                let what = format!("rope {layout:?} qk_norm={qk_norm}");
                assert_close(&xb.read_f32(x.len()), &want, 1e-5, &what);
            }
        }
    }
}

/// RoPE of K stored straight into the cache, with V beside it, gives the caches that RoPE then
/// the KV store give, bit for bit, in both layouts, with and without QK-norm.
#[test]
fn rope_store_fills_the_caches_as_rope_then_kv_store() {
    let Some(dev) = device() else { return };
    for gpu in Gpu::both(&dev) {
        let (n_heads, head_dim, n_rot, ctx) = (2usize, 64usize, 64usize, 16usize);
        let kvw = n_heads * head_dim;
        let table = gpu.f32s(&rope_table(ctx, n_rot, 10_000.0, 1.0, None));
        let norm_b = gpu.f32s(
            &noise(head_dim, 8)
                .iter()
                .map(|v| 1.0 + v)
                .collect::<Vec<_>>(),
        );
        let (k, v) = (noise(kvw, 4), noise(kvw, 5));
        let vb = gpu.f32s(&v);
        let cache =
            || Buffer::new_in(&gpu.alloc, (ctx * kvw * 2) as u64, MemoryUse::Staging).unwrap();
        for layout in [RopeLayout::Normal, RopeLayout::Neox] {
            for qk_norm in [false, true] {
                let args = RopeArgs {
                    layout,
                    n_heads: n_heads as u32,
                    head_dim: head_dim as u32,
                    n_rot: n_rot as u32,
                    eps: 1e-6,
                };
                let norm = qk_norm.then_some(&norm_b);
                let step = gpu.words(&[0, 5, 0]);
                let pos = StepWord {
                    buffer: &step,
                    index: 1,
                };
                let (k1, k2) = (gpu.f32s(&k), gpu.f32s(&k));
                let (kc1, vc1, kc2, vc2) = (cache(), cache(), cache(), cache());
                gpu.kernels
                    .record(|r| {
                        r.rope(&k1, norm, &table, args, pos)?;
                        r.kv_store((&k1, &vb), (&kc1, &vc1), kvw as u32, pos)
                    })
                    .unwrap();
                gpu.kernels
                    .record(|r| r.rope_store((&k2, &vb), norm, &table, args, pos, (&kc2, &vc2)))
                    .unwrap();
                let what = format!("{layout:?} qk_norm={qk_norm}");
                assert_eq!(kc1.bytes(), kc2.bytes(), "K cache, {what}");
                assert_eq!(vc1.bytes(), vc2.bytes(), "V cache, {what}");
                assert!(
                    kc2.bytes().iter().any(|&b| b != 0),
                    "{what}: stored nothing"
                );
                assert_eq!(k2.read_f32(kvw), k, "{what}: K itself is left as it was");
            }
        }
    }
}

#[test]
fn add_swiglu_scale_add_and_softmax_match_cpu() {
    let Some(dev) = device() else { return };
    for gpu in Gpu::both(&dev) {
        let n = 5000;
        let a: Vec<f32> = noise(n, 1).iter().map(|v| v * 6.0).collect();
        let b = noise(n, 2);
        let (ab, bb) = (gpu.f32s(&a), gpu.f32s(&b));
        gpu.kernels.record(|r| r.add(&ab, &bb, n as u32)).unwrap();
        let mut want = a.clone();
        ops::add_inplace(&mut want, &b);
        // One f32 addition each: exact.
        assert_eq!(ab.read_f32(n), want, "add");

        let gb = gpu.f32s(&a);
        gpu.kernels
            .record(|r| r.swiglu(&gb, &bb, n as u32))
            .unwrap();
        let mut want = a.clone();
        ops::swiglu_inplace(&mut want, &b);
        // The GPU's exp is within a few ulp.
        assert_close(&gb.read_f32(n), &want, 1e-5, "swiglu");

        let sa = gpu.f32s(&a);
        gpu.kernels
            .record(|r| r.scale_add(&sa, &bb, 0.37, n as u32))
            .unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b * 0.37).collect();
        // A product and a sum, each rounded once, as on the CPU: exact.
        assert_eq!(sa.read_f32(n), want, "scale_add");

        let rows = 3;
        let s: Vec<f32> = noise(n * rows, 3).iter().map(|v| v * 20.0).collect();
        let sb = gpu.f32s(&s);
        gpu.kernels
            .record(|r| r.softmax(&sb, n as u32, rows as u32))
            .unwrap();
        let mut want = s.clone();
        want.chunks_exact_mut(n).for_each(ops::softmax);
        let got = sb.read_f32(n * rows);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            // Probabilities: within 1e-5 of each value, relative.
            assert!(
                (g - w).abs() <= 1e-5 * w + 1e-9,
                "softmax[{i}]: gpu {g} cpu {w}"
            );
        }
    }
}

// ---- KV cache and attention ----

#[test]
fn kv_store_and_gqa_attention_match_cpu() {
    let Some(dev) = device() else { return };
    // One run of positions, and three (the last partial) joined by the last to finish.
    for (gpu, (ctx, n_kv)) in Gpu::both(&dev)
        .into_iter()
        .flat_map(|g| [(64usize, 50usize), (300, 290)].map(|c| (g.clone(), c)))
    {
        let (n_heads, n_kv_heads, hd) = (8usize, 2usize, 64usize);
        let kvw = n_kv_heads * hd;
        let k_cache =
            Buffer::new_in(&gpu.alloc, (ctx * kvw * 2) as u64, MemoryUse::DeviceLocal).unwrap();
        let v_cache =
            Buffer::new_in(&gpu.alloc, (ctx * kvw * 2) as u64, MemoryUse::DeviceLocal).unwrap();
        let keys: Vec<f32> = noise(n_kv * kvw, 1).iter().map(|v| v * 2.0).collect();
        let values = noise(n_kv * kvw, 2);
        let (mut kb, mut vb) = (gpu.zeros(kvw), gpu.zeros(kvw));
        // The position, then the sequence's first cache row.
        let mut step = gpu.words(&[0, 0]);
        fn pos(step: &Buffer) -> StepWord<'_> {
            StepWord {
                buffer: step,
                index: 0,
            }
        }
        for p in 0..n_kv {
            kb.write_f32(&keys[p * kvw..(p + 1) * kvw]);
            vb.write_f32(&values[p * kvw..(p + 1) * kvw]);
            step.write(&(p as u32).to_le_bytes());
            gpu.kernels
                .record(|r| r.kv_store((&kb, &vb), (&k_cache, &v_cache), kvw as u32, pos(&step)))
                .unwrap();
        }
        // The cache holds the values rounded to f16, as the CPU's `KvCache::store` rounds them.
        let halves = |b: &Buffer| -> Vec<f16> {
            download(&gpu.alloc, b, 0, (n_kv * kvw * 2) as u64)
                .unwrap()
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        let (kh, vh) = (halves(&k_cache), halves(&v_cache));
        let k16: Vec<f16> = keys.iter().map(|&v| f16::from_f32(v)).collect();
        let v16: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        assert!(
            kh == k16 && vh == v16,
            "f16 cache contents differ from round-to-nearest"
        );

        let q = noise(n_heads * hd, 3);
        let (qb, out) = (gpu.f32s(&q), gpu.zeros(n_heads * hd));
        let scores = gpu.zeros(attention_scratch_floats(n_heads, hd, ctx));
        let done = attention_counters(&gpu.alloc, n_heads, 1).unwrap();
        let args = AttentionArgs {
            n_heads: n_heads as u32,
            n_kv_heads: n_kv_heads as u32,
            head_dim: hd as u32,
            capacity: ctx as u32,
        };
        // The new token's position: positions 0..=pos attend.
        step.write(&(n_kv as u32 - 1).to_le_bytes());
        let attend = || {
            gpu.kernels
                .record(|r| {
                    r.attention(
                        &qb,
                        (&k_cache, &v_cache),
                        (&scores, &done),
                        &out,
                        args,
                        pos(&step),
                    )
                })
                .unwrap();
            out.read_f32(n_heads * hd)
        };
        let first = attend();
        // Each dispatch leaves the counters zero, so the next one joins its runs again.
        let counts = done.read_f32(n_heads);
        assert!(counts.iter().all(|c| c.to_bits() == 0), "{counts:?}");
        assert_eq!(attend(), first, "a second attention with the same counters");

        // The CPU engine's attention for one token (engine::forward).
        let scale = 1.0 / (hd as f32).sqrt();
        let mut want = vec![0f32; n_heads * hd];
        for h in 0..n_heads {
            let kvh = h / (n_heads / n_kv_heads);
            let head = kvh * hd..(kvh + 1) * hd;
            let qh: Vec<f32> = q[h * hd..(h + 1) * hd]
                .iter()
                .map(|&v| f16::from_f32(v).to_f32())
                .collect();
            let mut s: Vec<f32> = k16
                .chunks_exact(kvw)
                .map(|k| attn::dot_f32_f16(&qh, &k[head.clone()]) * scale)
                .collect();
            ops::softmax(&mut s);
            let o = &mut want[h * hd..(h + 1) * hd];
            for (&p, v) in s.iter().zip(v16.chunks_exact(kvw)) {
                attn::axpy_f16(o, f16::from_f32(p).to_f32(), &v[head.clone()]);
            }
        }
        // Sums in another order, and probabilities kept f32 where the CPU rounds them to f16.
        assert_close(&first, &want, 1e-3, &format!("attention of {n_kv}"));
    }
}

// ---- recording ----

#[test]
fn independent_dispatches_share_one_barrier_and_pipelines_are_cached() {
    let Some(dev) = device() else { return };
    let gpu = Gpu::new(&dev);
    let n = 256;
    let data = weight_rows(GgmlType::Q8_0, n, n, 4);
    let (wq, wk) = (
        gpu.matrix(GgmlType::Q8_0, n, n, &data),
        gpu.matrix(GgmlType::Q8_0, n, n, &data),
    );
    let (x, w, xn) = (gpu.f32s(&noise(n, 1)), gpu.f32s(&noise(n, 2)), gpu.zeros(n));
    let (q, k) = (gpu.zeros(n), gpu.zeros(n));
    let record = || {
        gpu.kernels
            .record(|r| {
                r.rms_norm(&x, &w, &xn, n as u32, 1, 1e-5)?;
                // Both read `xn`, written above: one barrier before the first, none between.
                r.matvec(&wq, &xn, &q)?;
                r.matvec(&wk, &xn, &k)?;
                // Reads `q`, written above: a second barrier.
                r.add(&k, &q, n as u32)
            })
            .unwrap()
    };
    let stats = record();
    assert_eq!((stats.dispatches, stats.barriers), (4, 2));
    let cached = gpu.kernels.cached();
    assert_eq!(cached, 3, "rms_norm, matvec_q8_0, add");
    record();
    assert_eq!(
        gpu.kernels.cached(),
        cached,
        "the second recording creates no pipeline"
    );
    // The barriers did their job: k = Wk·xn + Wq·xn = 2 · (W·xn) with the same matrix.
    let (qv, kv) = (q.read_f32(n), k.read_f32(n));
    assert!(qv.iter().zip(&kv).all(|(&q, &k)| k == q + q));
}
