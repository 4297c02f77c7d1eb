//! A MoE model over its VRAM budget with misses on the CPU or read from system RAM brings the
//! experts its tokens use most into VRAM between steps (`gpu::forward::promote`): more of its routed experts hit VRAM
//! than with slots that keep the experts they were loaded with, its logits stay those of the
//! unconstrained run within the F16 tolerance of `vulkan_offload.rs`, and the counters show the
//! copies. Runs on the machine's Vulkan device (lavapipe in CI); skips without one unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "common/f16_model.rs"]
mod f16_model;
use f16_model::f16_model;
#[path = "common/logits.rs"]
mod logits;
use logits::assert_logits_close;

use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::placement::{ExpertLayout, MoeMiss};
use spillway_daemon::stream::ReplacementPolicy;

/// Relative to the largest logit, as `vulkan_offload.rs` allows CPU experts (F16 weights).
const TOLERANCE_F16: f32 = 0.003;

/// Decode steps: enough for the promotions to pay back on a tiny model.
const STEPS: u32 = 24;

/// Misses read by the GPU from system RAM run the same kernels on the same weights as the
/// unconstrained run: rounding only (the slots' sum and the others' are added apart).
const TOLERANCE_PCIE: f32 = 1e-4;

fn options(
    budget: Option<u64>,
    (miss, policy): (MoeMiss, ReplacementPolicy),
    promote: bool,
) -> GpuModelOptions {
    GpuModelOptions {
        vram_budget: budget,
        context: 64,
        moe_miss: miss,
        expert_layout: ExpertLayout::Even,
        expert_policy: policy,
        threads: 2,
        promote_experts: promote,
        ..GpuModelOptions::default()
    }
}

/// Every step's logits after a short prompt, one step at a time (each step's greedy token
/// would make the runs diverge at a near tie; a fixed sequence keeps them comparable).
fn decode(gpu: &mut GpuModel) -> Vec<Vec<f32>> {
    gpu.eval_prompt(&[1, 2, 3, 4], false).unwrap();
    (0..STEPS)
        .map(|i| gpu.eval((i * 37 + 11) % 500).unwrap())
        .collect()
}

#[test]
fn promoted_experts_turn_misses_into_hits_and_keep_the_logits() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), "tiny-qwen3moe");
    let cfg = model.config.moe.unwrap();
    let base = options(None, (MoeMiss::Cpu, ReplacementPolicy::Lru), true);
    let whole = GpuModel::device_bytes(&model, &base).total();
    let minimum = GpuModel::minimum_budget(&dev, &model, &base)
        .unwrap()
        .total();
    let mut reference = GpuModel::new(&dev, &model, &base).unwrap();
    let want = decode(&mut reference);
    // A quarter of the way from one slot a layer to all of them.
    let budget = minimum + (whole - minimum) / 4;
    let modes = [
        (MoeMiss::Cpu, ReplacementPolicy::Lru),
        (MoeMiss::Cpu, ReplacementPolicy::LFU),
        (MoeMiss::Pcie, ReplacementPolicy::Lru),
    ];
    for (miss, policy) in modes {
        let what = format!("budget {budget} of {whole}, misses {miss}, {policy:?}");
        let run = |promote: bool| {
            let opts = options(Some(budget), (miss, policy), promote);
            let mut gpu = GpuModel::new(&dev, &model, &opts).unwrap();
            let slots = gpu.placement().slots;
            assert!(slots > 1 && slots < cfg.n_expert, "{what}: {slots} slots");
            let logits = decode(&mut gpu);
            (logits, gpu.expert_stats().unwrap().total())
        };
        let (fixed_logits, fixed) = run(false);
        let (logits, promoted) = run(true);
        eprintln!("{what}: static {fixed:?}\n{what}: promoted {promoted:?}");
        assert_eq!((fixed.promoted, fixed.evictions), (0, 0), "{what}: static");
        assert!(promoted.promoted > 0, "{what}: {promoted:?}");
        assert_eq!(promoted.evictions, promoted.promoted, "{what}");
        assert!(promoted.bytes_uploaded > 0, "{what}");
        // Misses still run where the policy sends them; there are fewer of them.
        let missed = match miss {
            MoeMiss::Pcie => promoted.pcie,
            _ => promoted.cpu,
        };
        assert_eq!(missed, promoted.misses, "{what}");
        assert_eq!(
            promoted.hits + promoted.misses,
            fixed.hits + fixed.misses,
            "{what}"
        );
        assert!(
            promoted.hits > fixed.hits,
            "{what}: {} hits promoted, {} static",
            promoted.hits,
            fixed.hits
        );
        // With misses read from system RAM, the promoted slots were filled by the device's
        // copies from there: any misplaced byte would show far beyond rounding.
        let tolerance = match miss {
            MoeMiss::Pcie => TOLERANCE_PCIE,
            _ => TOLERANCE_F16,
        };
        for (i, (g, w)) in logits.iter().zip(&want).enumerate() {
            assert_logits_close(g, w, tolerance, &format!("{what}: step {i}"));
        }
        for (i, (g, w)) in fixed_logits.iter().zip(&want).enumerate() {
            assert_logits_close(g, w, tolerance, &format!("{what}, static: step {i}"));
        }
    }
}
