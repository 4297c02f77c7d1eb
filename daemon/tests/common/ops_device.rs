//! The Vulkan device, buffers, matrices and weight rows for the tests that hold the GPU's ops
//! to the CPU engine's. The including test declares `mod noise` (`common/noise.rs`) beside this
//! module.

#![allow(dead_code)]

use std::sync::Arc;

use half::f16;
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::gpu::ops::GpuMatrix;
use spillway_daemon::gpu::{Allocator, Buffer, Device, Kernels, MemoryUse, Uploader};
use spillway_daemon::quant::quantize_row;

use crate::noise::noise;

pub fn device() -> Option<Arc<Device>> {
    spillway_daemon::gpu::device_or_skip()
}

pub fn noise_bytes(n: usize, seed: u64) -> Vec<u8> {
    noise(n, seed)
        .iter()
        .map(|v| (v.to_bits() >> 11) as u8)
        .collect()
}

/// Rows of `ty`: quantized from noise, or for the K-quants (which the project cannot quantize)
/// random bytes with small, finite f16 scales.
pub fn weight_rows(ty: GgmlType, n_in: usize, n_out: usize, seed: u64) -> Vec<u8> {
    let rb = ty.row_bytes(n_in as u64).unwrap() as usize;
    let mut out = vec![0u8; rb * n_out];
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => {
            out = noise_bytes(rb * n_out, seed);
            let bb = ty.block_bytes() as usize;
            let scales = noise(2 * out.len() / bb, seed + 1);
            for (b, s) in out.chunks_exact_mut(bb).zip(scales.chunks_exact(2)) {
                let d = f16::from_f32(0.002 + 0.01 * s[0].abs()).to_le_bytes();
                let dmin = f16::from_f32(0.001 + 0.005 * s[1].abs()).to_le_bytes();
                if ty == GgmlType::Q4K {
                    b[0..2].copy_from_slice(&d);
                    b[2..4].copy_from_slice(&dmin);
                } else {
                    b[208..210].copy_from_slice(&d);
                }
            }
        }
        // Routers stay F32 in model files.
        GgmlType::F32 => {
            out = noise(n_in * n_out, seed)
                .iter()
                .flat_map(|v| (v * 0.1).to_le_bytes())
                .collect();
        }
        _ => {
            let values = noise(n_in * n_out, seed);
            for (row, v) in out.chunks_exact_mut(rb).zip(values.chunks_exact(n_in)) {
                quantize_row(ty, v, row).unwrap();
            }
        }
    }
    out
}

pub const TYPES: [GgmlType; 5] = [
    GgmlType::F16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4K,
    GgmlType::Q6K,
];

#[derive(Clone)]
pub struct Gpu {
    pub alloc: Arc<Allocator>,
    pub kernels: Arc<Kernels>,
}

impl Gpu {
    pub fn new(dev: &Arc<Device>) -> Gpu {
        Gpu {
            alloc: Allocator::new(dev, None),
            kernels: Kernels::new(dev),
        }
    }

    /// With the base kernels, then with the subgroup variants when the device has them: the
    /// tests that use it hold both to the same tolerances.
    pub fn both(dev: &Arc<Device>) -> Vec<Gpu> {
        [false, true]
            .into_iter()
            .filter(|&sg| !sg || dev.subgroup_arithmetic())
            .map(|sg| {
                eprintln!("subgroup variants: {sg}");
                Gpu {
                    alloc: Allocator::new(dev, None),
                    kernels: Kernels::with_subgroups(dev, sg),
                }
            })
            .collect()
    }

    /// A host-visible buffer holding `values`.
    pub fn f32s(&self, values: &[f32]) -> Buffer {
        let mut b =
            Buffer::new_in(&self.alloc, values.len() as u64 * 4, MemoryUse::Staging).unwrap();
        b.write_f32(values);
        b
    }

    /// A step buffer holding `words` (token ids, positions) for the kernels that read them.
    pub fn words(&self, words: &[u32]) -> Buffer {
        let mut b =
            Buffer::new_in(&self.alloc, words.len() as u64 * 4, MemoryUse::Staging).unwrap();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        b.write(&bytes);
        b
    }

    pub fn zeros(&self, n: usize) -> Buffer {
        Buffer::new_in(&self.alloc, n as u64 * 4, MemoryUse::Staging).unwrap()
    }

    pub fn matrix(&self, ty: GgmlType, n_in: usize, n_out: usize, data: &[u8]) -> GpuMatrix {
        let mut up = Uploader::new(&self.alloc, 1 << 20).unwrap();
        let m = GpuMatrix::upload(&self.alloc, &mut up, ty, n_in, n_out, data).unwrap();
        up.flush().unwrap();
        m
    }
}
