//! Inputs quantized once before the integer-dot products (`quantize_q8.comp`,
//! `Kernels::set_q8_scratch`) against the same products quantizing their inputs themselves:
//! the same bits for a plain product, a SwiGLU stack, experts chosen on the device (one input
//! for all, or each its own) and a weighted sum over experts; with RMSNorm fused, within f32
//! rounding (Σ x² is summed in another order). Products that read the same input share one
//! quantization, and an input written in between is quantized again. The several-column
//! products are checked the same way in `vulkan_batch.rs`. On whatever Vulkan device the
//! machine has (lavapipe in CI); without one these tests skip, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

use std::sync::Arc;

use spillway_daemon::calibrate::random_matrix;
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::gpu::ops::{Fused, GpuMatrix};
use spillway_daemon::gpu::ops_moe::IdFused;
use spillway_daemon::gpu::ops_q8::q8_bytes;
use spillway_daemon::gpu::record::{RecordStats, Recorder};
use spillway_daemon::gpu::{Allocator, Buffer, Device, GpuError, Kernels, MemoryUse, Uploader};

/// The weight types with integer-dot-product kernels.
const TYPES: [GgmlType; 2] = [GgmlType::Q4_0, GgmlType::Q8_0];

struct Gpu {
    alloc: Arc<Allocator>,
    /// Quantizing in the product, and over inputs quantized first.
    in_product: Arc<Kernels>,
    first: Arc<Kernels>,
}

impl Gpu {
    /// `None` where the device has no integer dot products (a failure in CI).
    fn new(dev: &Arc<Device>, subgroups: bool) -> Option<Gpu> {
        let alloc = Allocator::new(dev, None);
        let in_product = Kernels::with_int_dot(dev, (subgroups, true), true);
        if !in_product.uses_int_dot() {
            assert!(
                std::env::var_os("SPILLWAY_REQUIRE_VULKAN").is_none(),
                "the Vulkan device has no integer dot products (core in Vulkan 1.3)"
            );
            return None;
        }
        let first = Kernels::with_int_dot(dev, (subgroups, true), true);
        let scratch = Buffer::new_in(&alloc, q8_bytes(2048, 8), MemoryUse::DeviceLocal).unwrap();
        first.set_q8_scratch(Some(Arc::new(scratch)));
        Some(Gpu {
            alloc,
            in_product,
            first,
        })
    }

    fn f32s(&self, values: &[f32]) -> Buffer {
        let mut b =
            Buffer::new_in(&self.alloc, values.len() as u64 * 4, MemoryUse::Staging).unwrap();
        b.write_f32(values);
        b
    }

    fn matrix(&self, ty: GgmlType, n_in: usize, n_out: usize) -> GpuMatrix {
        let data = random_matrix(ty, n_in as u64, n_out as u64).unwrap();
        let mut up = Uploader::new(&self.alloc, 1 << 20).unwrap();
        let m = GpuMatrix::upload(&self.alloc, &mut up, ty, n_in, n_out, &data).unwrap();
        up.flush().unwrap();
        m
    }

    /// `y`'s values after `record` on each set of kernels (from `y0` each time), and the
    /// second recording's statistics.
    fn both<F>(&self, y0: &[f32], record: F) -> (Vec<f32>, Vec<f32>, RecordStats)
    where
        F: Fn(&mut Recorder<'_>, &Buffer) -> Result<(), GpuError>,
    {
        let run = |k: &Arc<Kernels>| {
            let y = self.f32s(y0);
            let stats = k.record(|r| record(r, &y)).unwrap();
            (y.read_f32(y0.len()), stats)
        };
        let (a, _) = run(&self.in_product);
        let (b, stats) = run(&self.first);
        (a, b, stats)
    }
}

fn inputs(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 700.0 - 1.4)
        .collect()
}

fn gpus() -> Vec<Gpu> {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return Vec::new();
    };
    [false, true]
        .into_iter()
        .filter(|&sg| !sg || dev.subgroup_arithmetic())
        .filter_map(|sg| Gpu::new(&dev, sg))
        .collect()
}

#[test]
fn products_over_inputs_quantized_first_are_the_same_bits() {
    for gpu in gpus() {
        for ty in TYPES {
            // 1056 inputs: 33 blocks, so the blocks an invocation takes are uneven.
            let (n_in, n_out) = (1056, 70);
            let m = gpu.matrix(ty, n_in, n_out);
            let x = gpu.f32s(&inputs(n_in, 5));
            let y0 = inputs(n_out, 6);
            let (a, b, stats) = gpu.both(&y0, |r, y| r.matvec(&m, &x, y));
            assert_eq!(a, b, "{ty}: plain");
            assert_eq!(
                stats.dispatches, 2,
                "{ty}: the quantization, then the product"
            );
            let (a, b, _) = gpu.both(&y0, |r, y| r.matvec_add(&m, &x, y));
            assert_eq!(a, b, "{ty}: added");

            // A SwiGLU stack: 35 gate rows then 35 up rows.
            let glu = Fused {
                glu: true,
                ..Fused::default()
            };
            let (a, b, _) = gpu.both(&y0[..35], |r, y| r.matvec_fused(&m, &x, y, glu));
            assert_eq!(a, b, "{ty}: SwiGLU");

            // RMSNorm fused: the same blocks; Σ x² summed in another order.
            let norm_w = gpu.f32s(
                &inputs(n_in, 7)
                    .iter()
                    .map(|v| 1.0 + 0.3 * v)
                    .collect::<Vec<_>>(),
            );
            let normed = Fused {
                norm: Some((&norm_w, 1e-5)),
                ..Fused::default()
            };
            let (a, b, _) = gpu.both(&y0, |r, y| r.matvec_fused(&m, &x, y, normed));
            for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                assert!(
                    (p - q).abs() <= 1e-5 * p.abs().max(1.0),
                    "{ty}: normed [{i}] {p} vs {q}"
                );
            }
        }
    }
}

#[test]
fn expert_products_over_inputs_quantized_first_are_the_same_bits() {
    for gpu in gpus() {
        for ty in TYPES {
            let (n_in, rows, experts) = (512, 24, 5);
            let m = gpu.matrix(ty, n_in, rows * experts);
            // Experts 3, then an empty entry, then 1; the weights of a sum after the ids.
            let ids: Vec<f32> = [3u32, u32::MAX, 1]
                .into_iter()
                .map(f32::from_bits)
                .chain([0.25, 0.5, -1.5])
                .collect();
            let ids = gpu.f32s(&ids);
            let xs = gpu.f32s(&inputs(3 * n_in, 11));
            let y0 = inputs(3 * rows, 12);
            let shared = |r: &mut Recorder<'_>, y: &Buffer| {
                r.matvec_id(&m, rows, (&ids, 0), 3, (&xs, 0), (y, rows as u32))
            };
            let (a, b, _) = gpu.both(&y0, shared);
            assert_eq!(a, b, "{ty}: one input for every expert");
            let own = |r: &mut Recorder<'_>, y: &Buffer| {
                r.matvec_id(&m, rows, (&ids, 0), 3, (&xs, n_in as u32), (y, rows as u32))
            };
            let (a, b, _) = gpu.both(&y0, own);
            assert_eq!(a, b, "{ty}: each expert its own input");
            let summed = IdFused {
                sum_weights_at: Some(3),
                ..IdFused::default()
            };
            let sum = |r: &mut Recorder<'_>, y: &Buffer| {
                r.matvec_id_fused(&m, rows, (&ids, 0), 3, (&xs, n_in as u32), (y, 0), summed)
            };
            let (a, b, _) = gpu.both(&y0[..rows], sum);
            assert_eq!(a, b, "{ty}: weighted sum over experts");
        }
    }
}

#[test]
fn products_of_one_input_share_its_quantization_until_it_is_written() {
    for gpu in gpus() {
        let (n_in, n_out) = (256, 16);
        let (m, m2) = (
            gpu.matrix(GgmlType::Q4_0, n_in, n_out),
            gpu.matrix(GgmlType::Q8_0, n_in, n_out),
        );
        let x = gpu.f32s(&inputs(n_in, 21));
        let (y1, y2) = (gpu.f32s(&[0.0; 16]), gpu.f32s(&[0.0; 16]));
        // Two products of x: one quantization.
        let stats = gpu
            .first
            .record(|r| {
                r.matvec(&m, &x, &y1)?;
                r.matvec(&m2, &x, &y2)
            })
            .unwrap();
        assert_eq!(stats.dispatches, 3);
        let want = y2.read_f32(n_out);
        // x written between two products that read it (by a dispatch that quantizes
        // nothing): quantized again, and the last product reads the new x.
        let other = gpu.f32s(&inputs(n_in, 99));
        let run = |k: &Arc<Kernels>| {
            let x = gpu.f32s(&inputs(n_in, 21));
            let stats = k
                .record(|r| {
                    r.matvec(&m, &x, &y1)?;
                    r.add(&x, &other, n_in as u32)?;
                    r.matvec(&m2, &x, &y2)
                })
                .unwrap();
            (y2.read_f32(n_out), stats)
        };
        let (again, stats) = run(&gpu.first);
        assert_eq!(stats.dispatches, 5, "x written: quantized again");
        assert_eq!(again, run(&gpu.in_product).0);
        assert_ne!(again, want, "the last product read the rewritten input");
    }
}
