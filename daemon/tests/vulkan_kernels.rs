//! GPU kernels against the CPU reference, on whatever Vulkan device the machine has (lavapipe in
//! CI). Without a device these tests skip, unless `SPILLWAY_REQUIRE_VULKAN` is set (as CI does),
//! in which case they fail.

use std::sync::Arc;

use spillway_daemon::gguf::GgmlType;
use spillway_daemon::gpu::{Buffer, ComputePipeline, Device, Instance, Kernels};
use spillway_daemon::quant::{dequantize_row, quantize_row};
use spillway_shaders::{DequantParams, Feature, Op, PushConstants, ShaderId, WeightType};

fn device() -> Option<Arc<Device>> {
    spillway_daemon::gpu::device_or_skip()
}

/// Deterministic values in [-2, 2) with some exact zeros, from a 64-bit LCG.
fn test_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if i % 97 == 0 {
                0.0
            } else {
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            }
        })
        .collect()
}

fn check_dequant(ty: GgmlType, wtype: WeightType) {
    let Some(dev) = device() else { return };
    let n = 256 * 125 + 256 * 3; // not a multiple of the workgroup size
    let values = test_values(n, ty as u64);
    let row_bytes = ty.row_bytes(n as u64).unwrap() as usize;
    let mut blocks = vec![0u8; row_bytes];
    match ty {
        // No K-quant quantizer: random bytes, with small finite scales in place.
        GgmlType::Q4K | GgmlType::Q6K => {
            for (i, b) in blocks.iter_mut().enumerate() {
                *b = (values[i % n].to_bits() >> 9) as u8;
            }
            let bb = ty.block_bytes() as usize;
            for (k, b) in blocks.chunks_exact_mut(bb).enumerate() {
                let d = half::f16::from_f32(0.001 * (1 + k % 13) as f32).to_le_bytes();
                let at = if ty == GgmlType::Q4K { 0 } else { 208 };
                b[at..at + 2].copy_from_slice(&d);
                if ty == GgmlType::Q4K {
                    b[2..4].copy_from_slice(&half::f16::from_f32(0.0007).to_le_bytes());
                }
            }
        }
        _ => quantize_row(ty, &values, &mut blocks).unwrap(),
    }
    let mut expected = vec![0f32; n];
    dequantize_row(ty, &blocks, &mut expected).unwrap();

    let shader = ShaderId::find(Op::Dequant, Some(wtype), Feature::Base).unwrap();
    let pipeline = ComputePipeline::new(
        &dev,
        shader,
        2,
        std::mem::size_of::<DequantParams>() as u32,
        &[],
    )
    .unwrap();
    let mut src = Buffer::new_host_visible(&dev, row_bytes.next_multiple_of(4) as u64).unwrap();
    src.write(&blocks);
    let dst = Buffer::new_host_visible(&dev, (n * 4) as u64).unwrap();
    let n_units = (n / 32) as u32;
    let params = DequantParams {
        n_blocks: n_units,
        src_offset: 0,
        dst_offset: 0,
    };
    pipeline
        .dispatch(&[&src, &dst], &params.bytes(), [n_units.div_ceil(64), 1, 1])
        .unwrap();
    let got = dst.read_f32(n);
    // Each output is one f16 scale times a small integer (K-quants: the CPU's own products and
    // difference, kept unfused by `precise`): exact on any IEEE device.
    let mismatches: Vec<_> = (0..n)
        .filter(|&i| got[i].to_bits() != expected[i].to_bits())
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} of {n} values differ on {}; first at {}: gpu {} cpu {}",
        mismatches.len(),
        dev.info().name,
        mismatches[0],
        got[mismatches[0]],
        expected[mismatches[0]]
    );
}

#[test]
fn dequant_q8_0_matches_cpu() {
    check_dequant(GgmlType::Q8_0, WeightType::Q8_0);
}

#[test]
fn dequant_q4_0_matches_cpu() {
    check_dequant(GgmlType::Q4_0, WeightType::Q4_0);
}

#[test]
fn dequant_q4_k_matches_cpu() {
    check_dequant(GgmlType::Q4K, WeightType::Q4K);
}

#[test]
fn dequant_q6_k_matches_cpu() {
    check_dequant(GgmlType::Q6K, WeightType::Q6K);
}

#[test]
fn dequant_f16_matches_cpu() {
    check_dequant(GgmlType::F16, WeightType::F16);
}

#[test]
fn dequant_f32_matches_cpu() {
    check_dequant(GgmlType::F32, WeightType::F32);
}

#[test]
fn devices_are_listed_with_a_kind_and_a_name() {
    let Some(dev) = device() else { return };
    let listed = Instance::new().unwrap().devices().unwrap();
    assert!(listed.iter().any(|d| d.name == dev.info().name));
    assert!(dev.max_storage_buffer_range() >= 1 << 27);
    assert!(dev.subgroup_size() >= 1);
}

/// The capabilities agree with what the kernels use, and a memory budget is reported exactly
/// where the device has the extension, within its device-local memory.
#[test]
fn capabilities_match_what_the_kernels_use_and_the_budget_its_extension() {
    let Some(dev) = device() else { return };
    let caps = *dev.capabilities();
    eprintln!("{}: {caps:?}", dev.info().name);
    assert_eq!(caps.subgroup_arithmetic, dev.subgroup_arithmetic());
    let kernels = Kernels::new(&dev);
    assert_eq!(kernels.uses_subgroups(), caps.subgroup_arithmetic);
    let budget = dev.memory_budget();
    assert_eq!(budget.is_some(), caps.memory_budget, "{budget:?}");
    if let Some(b) = budget {
        assert!(
            b <= dev.info().device_local_bytes,
            "{b} free of {}",
            dev.info().device_local_bytes
        );
    }
    let listed = Instance::new().unwrap().devices().unwrap();
    let same = listed.iter().find(|d| d.name == dev.info().name).unwrap();
    assert_eq!(same.capabilities, caps);
}

#[test]
fn dispatch_with_wrong_arity_is_an_error_not_a_crash() {
    let Some(dev) = device() else { return };
    let shader = ShaderId::DequantQ8_0;
    let pipeline = ComputePipeline::new(&dev, shader, 2, 12, &[]).unwrap();
    let a = Buffer::new_host_visible(&dev, 64).unwrap();
    assert!(pipeline.dispatch(&[&a], &[0; 12], [1, 1, 1]).is_err());
}
