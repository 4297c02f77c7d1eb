//! The matrix-vector kernel under every workgroup shape it accepts: widths at block boundaries,
//! row counts that no shape divides, rows split across bindings, and the expert-indexed forms
//! (plain, with RMSNorm and SwiGLU fused, summed over experts), against the exact dot of the dequantized rows. Skips without a Vulkan device unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

use std::sync::Arc;

#[path = "common/noise.rs"]
mod noise;
use noise::noise;

use half::f16;
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::gpu::ops::{GpuMatrix, IdFused, MatVecShape};
use spillway_daemon::gpu::ops_moe::IdTokens;
use spillway_daemon::gpu::{Allocator, Buffer, Device, Kernels, MemoryUse, Uploader};
use spillway_daemon::quant::{dequantize_row, quantize_row};

const TYPES: [GgmlType; 6] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4K,
    GgmlType::Q6K,
];

/// Shapes with one to eight rows and one invocation to many subgroups.
const SHAPES: [(u32, u32); 5] = [(4, 1), (32, 3), (64, 8), (128, 2), (256, 5)];

/// Rows of `ty` quantized from noise; the K-quants (no quantizer here) are noise bytes with
/// small finite scales.
fn weight_rows(ty: GgmlType, n_in: usize, n_out: usize, seed: u64) -> Vec<u8> {
    let rb = ty.row_bytes(n_in as u64).unwrap() as usize;
    let values = noise(n_in * n_out, seed);
    if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
        let mut out: Vec<u8> = values.iter().map(|v| (v.to_bits() >> 7) as u8).collect();
        out.truncate(rb * n_out);
        let at = if ty == GgmlType::Q4K { 0 } else { 208 };
        for (k, b) in out.chunks_exact_mut(ty.block_bytes() as usize).enumerate() {
            let d = f16::from_f32(0.002 * (1 + k % 7) as f32).to_le_bytes();
            b[at..at + 2].copy_from_slice(&d);
            if ty == GgmlType::Q4K {
                b[2..4].copy_from_slice(&f16::from_f32(0.003).to_le_bytes());
            }
        }
        return out;
    }
    let mut out = vec![0u8; rb * n_out];
    for (row, v) in out.chunks_exact_mut(rb).zip(values.chunks_exact(n_in)) {
        quantize_row(ty, v, row).unwrap();
    }
    out
}

struct Gpu {
    alloc: Arc<Allocator>,
    kernels: Arc<Kernels>,
}

impl Gpu {
    /// Base kernels, then the subgroup variants where the device has them.
    fn both(dev: &Arc<Device>) -> Vec<Gpu> {
        [false, true]
            .into_iter()
            .filter(|&sg| !sg || dev.subgroup_arithmetic())
            .map(|sg| Gpu {
                alloc: Allocator::new(dev, None),
                kernels: Kernels::with_subgroups(dev, sg),
            })
            .collect()
    }

    fn f32s(&self, values: &[f32]) -> Buffer {
        let mut b =
            Buffer::new_in(&self.alloc, values.len() as u64 * 4, MemoryUse::Staging).unwrap();
        b.write_f32(values);
        b
    }

    fn zeros(&self, n: usize) -> Buffer {
        Buffer::new_in(&self.alloc, n as u64 * 4, MemoryUse::Staging).unwrap()
    }

    fn matrix(&self, ty: GgmlType, n_in: usize, n_out: usize, data: &[u8]) -> GpuMatrix {
        let mut up = Uploader::new(&self.alloc, 1 << 20).unwrap();
        let m = GpuMatrix::upload(&self.alloc, &mut up, ty, n_in, n_out, data).unwrap();
        up.flush().unwrap();
        m
    }
}

/// Asserts `got` is the f32 rounding of the exact dots of the dequantized rows with `x`.
fn assert_exact(ty: GgmlType, data: &[u8], n_in: usize, x: &[f32], got: &[f32], what: &str) {
    let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    for (r, &g) in got.iter().enumerate() {
        let (e, abs) = dot_row(ty, data, n_in, r, &x);
        assert!(
            (f64::from(g) - e).abs() <= 1e-5 * abs + 1e-6,
            "{ty} {what} row {r}: gpu {g} exact {e}"
        );
    }
}

/// Widths of one block, of an odd number of blocks, and a longer row.
fn widths(ty: GgmlType) -> [usize; 3] {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => [256, 9 * 256, 17 * 256],
        _ => [32, 9 * 32, 33 * 32],
    }
}

#[test]
fn every_workgroup_shape_gives_the_exact_dot_at_block_boundary_widths() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    for gpu in Gpu::both(&dev) {
        for ty in TYPES {
            for n_in in widths(ty) {
                // 13 rows: no shape's row count divides it; 1 row: a single, partial workgroup.
                for n_out in [13, 1] {
                    let data = weight_rows(ty, n_in, n_out, n_in as u64 + ty as u64);
                    let m = gpu.matrix(ty, n_in, n_out, &data);
                    let x = noise(n_in, 3);
                    let xb = gpu.f32s(&x);
                    for (threads, rows) in SHAPES {
                        let shape = MatVecShape { threads, rows };
                        gpu.kernels.set_matvec_shape(Some(shape)).unwrap();
                        let y = gpu.zeros(n_out);
                        gpu.kernels.record(|r| r.matvec(&m, &xb, &y)).unwrap();
                        let what = format!("{n_in}x{n_out} {threads}x{rows}");
                        assert_exact(ty, &data, n_in, &x, &y.read_f32(n_out), &what);
                    }
                }
            }
        }
    }
}

#[test]
fn rows_split_across_bindings_give_the_same_bits_for_every_type_and_shape() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let gpu = Gpu::both(&dev).pop().unwrap();
    for ty in TYPES {
        let (n_in, n_out) = (512, 45);
        let data = weight_rows(ty, n_in, n_out, 5);
        let m = gpu.matrix(ty, n_in, n_out, &data);
        let x = gpu.f32s(&noise(n_in, 6));
        for (threads, rows) in [(32, 3), (64, 8)] {
            gpu.kernels
                .set_matvec_shape(Some(MatVecShape { threads, rows }))
                .unwrap();
            let (whole, split) = (gpu.zeros(n_out), gpu.zeros(n_out));
            gpu.kernels.record(|r| r.matvec(&m, &x, &whole)).unwrap();
            // 4 KiB per binding: runs of rows whose first row starts mid-binding.
            let many = gpu
                .kernels
                .record_with_max_range(4096, |r| r.matvec(&m, &x, &split))
                .unwrap();
            assert!(many.dispatches >= (data.len() / 4096) as u32, "{ty}");
            let (a, b) = (whole.read_f32(n_out), split.read_f32(n_out));
            assert!(
                a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ty} {threads}x{rows}: split results differ"
            );
        }
    }
}

#[test]
fn expert_indexed_products_match_the_expert_rows_for_every_shape() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let gpu = Gpu::both(&dev).pop().unwrap();
    for ty in TYPES {
        let (n_in, rows, experts) = (256, 7, 4);
        let data = weight_rows(ty, n_in, rows * experts, 8);
        let m = gpu.matrix(ty, n_in, rows * experts, &data);
        let ids = gpu.f32s(&[f32::from_bits(3), f32::from_bits(1)]);
        let xs = noise(2 * n_in, 9);
        let xb = gpu.f32s(&xs);
        for (threads, rows_per) in SHAPES {
            gpu.kernels
                .set_matvec_shape(Some(MatVecShape {
                    threads,
                    rows: rows_per,
                }))
                .unwrap();
            let y = gpu.zeros(2 * rows);
            gpu.kernels
                .record(|r| {
                    r.matvec_id(
                        &m,
                        rows,
                        (&ids, 0),
                        2,
                        (&xb, n_in as u32),
                        (&y, rows as u32),
                    )
                })
                .unwrap();
            let got = y.read_f32(2 * rows);
            for (z, e) in [3usize, 1].into_iter().enumerate() {
                let per = data.len() / experts;
                let expert = &data[e * per..(e + 1) * per];
                let what = format!("expert {e} {threads}x{rows_per}");
                let x = &xs[z * n_in..(z + 1) * n_in];
                assert_exact(ty, expert, n_in, x, &got[z * rows..(z + 1) * rows], &what);
            }
        }
    }
}

#[test]
fn empty_expert_entries_are_skipped_and_add_nothing() {
    // A routing the host wrote with an empty entry (id 0xFFFFFFFF, weight 0): the product
    // leaves that entry's output as it was, and the routed sum adds only the real expert.
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let gpu = Gpu::both(&dev).pop().unwrap();
    let ty = GgmlType::Q8_0;
    let (n_in, rows, experts) = (64, 5, 3);
    let data = weight_rows(ty, n_in, rows * experts, 4);
    let m = gpu.matrix(ty, n_in, rows * experts, &data);
    // ids then weights: expert 2 with weight 0.5, then an empty entry.
    let route = gpu.f32s(&[f32::from_bits(2), f32::from_bits(u32::MAX), 0.5, 0.0]);
    let xb = gpu.f32s(&noise(n_in, 3));
    let y = gpu.f32s(&[f32::NAN; 10]);
    let acc = gpu.f32s(&[1.0; 5]);
    gpu.kernels
        .record(|r| {
            r.matvec_id(&m, rows, (&route, 0), 2, (&xb, 0), (&y, rows as u32))?;
            r.scale_add_routed(&acc, (&y, rows as u32), (&route, 2, 2), rows as u32)
        })
        .unwrap();
    let got = y.read_f32(2 * rows);
    assert!(got[..rows].iter().all(|v| v.is_finite()), "{got:?}");
    assert!(
        got[rows..].iter().all(|v| v.is_nan()),
        "the empty entry wrote: {got:?}"
    );
    let sum = acc.read_f32(rows);
    for (i, s) in sum.iter().enumerate() {
        // The NaN output of the empty entry was not added.
        assert_eq!(*s, 1.0 + 0.5 * got[i], "row {i}");
    }
}

#[test]
fn shapes_the_kernel_cannot_run_are_refused() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let kernels = Kernels::new(&dev);
    for (threads, rows) in [(48, 4), (512, 4), (2, 4), (64, 0), (64, 9)] {
        let shape = MatVecShape { threads, rows };
        assert!(kernels.set_matvec_shape(Some(shape)).is_err(), "{shape:?}");
    }
    let max = MatVecShape {
        threads: MatVecShape::MAX_THREADS,
        rows: MatVecShape::MAX_ROWS,
    };
    kernels.set_matvec_shape(Some(max)).unwrap();
    let q4_0 = spillway_daemon::gpu::ops::weight_type(GgmlType::Q4_0).unwrap();
    assert_eq!(kernels.matvec_shape(q4_0), max);
}

/// The exact dot of row `r` of `data` (rows of `n_in` weights of `ty`) with `x`, and the sum of
/// the absolute products (the scale of its rounding).
fn dot_row(ty: GgmlType, data: &[u8], n_in: usize, r: usize, x: &[f64]) -> (f64, f64) {
    let rb = ty.row_bytes(n_in as u64).unwrap() as usize;
    let mut w = vec![0f32; n_in];
    dequantize_row(ty, &data[r * rb..(r + 1) * rb], &mut w).unwrap();
    w.iter().zip(x).fold((0f64, 0f64), |(s, a), (&w, &x)| {
        let p = f64::from(w) * x;
        (s + p, a + p.abs())
    })
}

#[test]
fn fused_expert_products_match_the_host_for_every_type_and_shape() {
    // A MoE layer's two expert dispatches: RMSNorm, gate, up and SwiGLU of the chosen experts
    // from one gate-then-up stack; then their down products summed with the routing's weights
    // into a residual. An empty entry (id 0xFFFFFFFF) writes and adds nothing.
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    for gpu in Gpu::both(&dev) {
        for ty in TYPES {
            let (n_embd, ff, experts, eps) = (256, 256, 4, 1e-5f32);
            let gate = weight_rows(ty, n_embd, ff * experts, 21);
            let up = weight_rows(ty, n_embd, ff * experts, 22);
            let mut stack_bytes = gate.clone();
            stack_bytes.extend_from_slice(&up);
            let stack = gpu.matrix(ty, n_embd, 2 * ff * experts, &stack_bytes);
            // Down: 13 outputs an expert (no shape's rows divide it).
            let n_out = 13;
            let down = weight_rows(ty, ff, n_out * experts, 23);
            let down_m = gpu.matrix(ty, ff, n_out * experts, &down);
            let x = noise(n_embd, 24);
            let norm_w: Vec<f32> = noise(n_embd, 25).iter().map(|v| 1.0 + v).collect();
            let (xb, nb) = (gpu.f32s(&x), gpu.f32s(&norm_w));
            let chosen = [(3usize, 0.7f32), (usize::MAX, 0.0), (1, 0.3)];
            let mut route: Vec<f32> = chosen.iter().map(|c| f32::from_bits(c.0 as u32)).collect();
            route.extend(chosen.iter().map(|c| c.1));
            let route = gpu.f32s(&route);

            let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / n_embd as f64;
            let scale = 1.0 / (ms + f64::from(eps)).sqrt();
            let xn: Vec<f64> = x
                .iter()
                .zip(&norm_w)
                .map(|(&v, &w)| f64::from(v) * f64::from(w) * scale)
                .collect();
            for shape in [
                None,
                Some((64, 8)),
                Some((32, 3)),
                Some((4, 1)),
                Some((256, 5)),
            ] {
                let shape = shape.map(|(threads, rows)| MatVecShape { threads, rows });
                gpu.kernels.set_matvec_shape(shape).unwrap();
                let h = gpu.f32s(&vec![f32::NAN; chosen.len() * ff]);
                let y = gpu.f32s(&vec![1.0; n_out]);
                gpu.kernels
                    .record(|r| {
                        let glu = IdFused {
                            norm: Some((&nb, eps)),
                            glu_up_rows: Some(ff * experts),
                            ..IdFused::default()
                        };
                        let n = chosen.len() as u32;
                        r.matvec_id_fused(
                            &stack,
                            ff,
                            (&route, 0),
                            n,
                            (&xb, 0),
                            (&h, ff as u32),
                            glu,
                        )?;
                        let sum = IdFused {
                            sum_weights_at: Some(n),
                            ..IdFused::default()
                        };
                        r.matvec_id_fused(
                            &down_m,
                            n_out,
                            (&route, 0),
                            n,
                            (&h, ff as u32),
                            (&y, 0),
                            sum,
                        )
                    })
                    .unwrap();
                let hs = h.read_f32(chosen.len() * ff);
                let what = format!("{ty} {shape:?}");
                let mut want_y = vec![1f64; n_out];
                let mut scale_y = vec![0f64; n_out];
                for (z, &(e, w)) in chosen.iter().enumerate() {
                    let got = &hs[z * ff..(z + 1) * ff];
                    if e == usize::MAX {
                        assert!(
                            got.iter().all(|v| v.is_nan()),
                            "{what}: the empty entry wrote"
                        );
                        continue;
                    }
                    for (r, &v) in got.iter().enumerate() {
                        let (g, ga) = dot_row(ty, &gate, n_embd, e * ff + r, &xn);
                        let (u, ua) = dot_row(ty, &up, n_embd, e * ff + r, &xn);
                        let want = g / (1.0 + (-g).exp()) * u;
                        // silu' is below 1.1 and |silu(g)| at most |g|: the rounding of g and u
                        // (a few ulps of their absolute sums) carried through.
                        let tol = 2e-5 * (ga * u.abs() + g.abs() * ua) + 1e-5;
                        let v = f64::from(v);
                        assert!(
                            (v - want).abs() <= tol,
                            "{what} expert {e} row {r}: gpu {v} host {want}"
                        );
                    }
                    let hz: Vec<f64> = got.iter().map(|&v| f64::from(v)).collect();
                    for (r, (wy, sy)) in want_y.iter_mut().zip(&mut scale_y).enumerate() {
                        let (d, a) = dot_row(ty, &down, ff, e * n_out + r, &hz);
                        *wy += f64::from(w) * d;
                        *sy += f64::from(w) * a;
                    }
                }
                let ys = y.read_f32(n_out);
                for r in 0..n_out {
                    let v = f64::from(ys[r]);
                    assert!(
                        (v - want_y[r]).abs() <= 1e-5 * scale_y[r] + 1e-5,
                        "{what} sum row {r}: gpu {v} host {}",
                        want_y[r]
                    );
                }
            }
        }
    }
}

#[test]
fn expert_products_of_several_tokens_in_one_dispatch_equal_each_token_alone() {
    // A batched decode step's MoE layer by entry (`IdFused::tokens`): three tokens' entries
    // (two each, one empty) in one gate/up/SwiGLU dispatch and one summed down dispatch, each
    // token's ids and weights 2k words after the previous token's, against each token's
    // entries run alone as a decode step runs them: the same bits.
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    for gpu in Gpu::both(&dev) {
        for ty in TYPES {
            let (n_embd, ff, experts, k, n_out) = (256, 256, 4, 2, 64);
            let mut stack_bytes = weight_rows(ty, n_embd, ff * experts, 31);
            stack_bytes.extend_from_slice(&weight_rows(ty, n_embd, ff * experts, 32));
            let stack = gpu.matrix(ty, n_embd, 2 * ff * experts, &stack_bytes);
            let down = gpu.matrix(
                ty,
                ff,
                n_out * experts,
                &weight_rows(ty, ff, n_out * experts, 33),
            );
            let chosen = [
                [(3usize, 0.7f32), (0, 0.3)],
                [(usize::MAX, 0.0), (2, 1.0)],
                [(1, 0.4), (3, 0.6)],
            ];
            let mut route = Vec::new();
            for token in &chosen {
                route.extend(token.iter().map(|c| f32::from_bits(c.0 as u32)));
                route.extend(token.iter().map(|c| c.1));
            }
            let route = gpu.f32s(&route);
            let xs = noise(chosen.len() * n_embd, 34);
            let xb = gpu.f32s(&xs);
            let n = chosen.len() as u32;
            let (k32, ff32, e32) = (k as u32, ff as u32, n_embd as u32);
            let glu = IdFused {
                glu_up_rows: Some(ff * experts),
                ..IdFused::default()
            };
            let summed = IdFused {
                sum_weights_at: Some(k32),
                ..IdFused::default()
            };

            let h = gpu.f32s(&vec![f32::NAN; chosen.len() * k * ff]);
            let y = gpu.f32s(&vec![1.0; chosen.len() * n_out]);
            let tokens = |x_stride, y_stride| IdTokens {
                n,
                ids_stride: 2 * k32,
                x_stride,
                y_stride,
            };
            gpu.kernels
                .record(|r| {
                    let each = IdFused {
                        tokens: Some(tokens(e32, 0)),
                        ..glu
                    };
                    r.matvec_id_fused(&stack, ff, (&route, 0), k32, (&xb, 0), (&h, ff32), each)?;
                    let sum = IdFused {
                        tokens: Some(tokens(0, n_out as u32)),
                        ..summed
                    };
                    r.matvec_id_fused(&down, n_out, (&route, 0), k32, (&h, ff32), (&y, 0), sum)
                })
                .unwrap();
            let (hs, ys) = (
                h.read_f32(chosen.len() * k * ff),
                y.read_f32(chosen.len() * n_out),
            );

            for t in 0..chosen.len() {
                let x = gpu.f32s(&xs[t * n_embd..(t + 1) * n_embd]);
                let h1 = gpu.f32s(&vec![f32::NAN; k * ff]);
                let y1 = gpu.f32s(&vec![1.0; n_out]);
                let rank = (t * 2 * k) as u32;
                gpu.kernels
                    .record(|r| {
                        r.matvec_id_fused(
                            &stack,
                            ff,
                            (&route, rank),
                            k32,
                            (&x, 0),
                            (&h1, ff32),
                            glu,
                        )?;
                        let sum = IdFused {
                            sum_weights_at: Some(rank + k32),
                            ..summed
                        };
                        r.matvec_id_fused(
                            &down,
                            n_out,
                            (&route, rank),
                            k32,
                            (&h1, ff32),
                            (&y1, 0),
                            sum,
                        )
                    })
                    .unwrap();
                let what = format!("{ty} token {t}");
                let alone = h1.read_f32(k * ff);
                let together = &hs[t * k * ff..(t + 1) * k * ff];
                assert!(
                    alone
                        .iter()
                        .zip(together)
                        .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())),
                    "{what}: gate and up"
                );
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&y1.read_f32(n_out)),
                    bits(&ys[t * n_out..(t + 1) * n_out]),
                    "{what}: summed down products"
                );
            }
        }
    }
}
