//! A MoE model over its VRAM budget takes a prompt in chunks: at each MoE layer the experts
//! the chunk's tokens chose that are not resident are copied, a group at a time, into slots
//! they take in turn and run over their tokens on the GPU (`gpu::forward::stream_experts`).
//! Every token's logits must be the unconstrained model's chunked prompt's, the counters must
//! show the streamed experts, and decoding after the prompt must read the KV cache the chunks
//! wrote. F16 weights keep the CPU's experts of the decode steps within 0.1% of the GPU's. On
//! whatever Vulkan device the machine has (lavapipe in CI); without one these tests skip,
//! unless `SPILLWAY_REQUIRE_VULKAN` is set, in which case they fail.

#[path = "common/f16_model.rs"]
mod f16_model;
use f16_model::f16_model;
#[path = "common/logits.rs"]
mod logits;
use logits::assert_logits_close;

use std::sync::Arc;

use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::placement::MoeMiss;
use spillway_daemon::gpu::{footprint, Device};
use spillway_daemon::model::Ffn;

fn device() -> Option<Arc<Device>> {
    spillway_daemon::gpu::device_or_skip()
}

/// Largest |a - b| relative to the largest |b|: the experts' outputs are added to the
/// residual in another order than the unconstrained run's (the streamed ones first); a missed
/// or doubled expert moves logits by a large part of their range.
const TOLERANCE: f32 = 0.01;

fn tokens(n: usize, n_vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i as u64 * 2_654_435_761 + 17) % n_vocab as u64) as u32)
        .collect()
}

fn options(budget: Option<u64>, prompt_expert_slots: usize) -> GpuModelOptions {
    GpuModelOptions {
        vram_budget: budget,
        context: 256,
        moe_miss: MoeMiss::Cpu,
        threads: 2,
        prompt_expert_slots,
        ..GpuModelOptions::default()
    }
}

/// Every prompt token's logits, a second prompt's last ones, and three decode steps after.
fn run(gpu: &mut GpuModel) -> Vec<Vec<f32>> {
    let n_vocab = gpu.config().n_vocab;
    // 70 tokens: two chunks when every token's logits are wanted (64 a chunk).
    let mut out: Vec<Vec<f32>> = gpu
        .eval_prompt(&tokens(70, n_vocab), true)
        .unwrap()
        .chunks(n_vocab)
        .map(<[f32]>::to_vec)
        .collect();
    out.push(gpu.eval_prompt(&tokens(90, n_vocab / 2), false).unwrap());
    for t in [5u32, 900, 33] {
        out.push(gpu.eval(t % n_vocab as u32).unwrap());
    }
    out
}

fn check(preset: &str) {
    let Some(dev) = device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), preset);
    let cfg = model.config.moe.unwrap();
    let moe_layers = model
        .layers
        .iter()
        .filter(|l| matches!(l.ffn, Ffn::Moe(_)))
        .count() as u64;
    let mut whole = GpuModel::new(&dev, &model, &options(None, 0)).unwrap();
    assert!(whole.batches_prompts(), "{preset}: unconstrained");
    let want = run(&mut whole);
    // A prompt short enough to run its MoE layers by entry, as a batched decode step does.
    let short = tokens(5, model.config.n_vocab);
    whole.reset();
    let want_short = whole.eval_prompt(&short, true).unwrap();

    let minimum = GpuModel::minimum_budget(&dev, &model, &options(None, 0))
        .expect("a MoE model has a minimum budget");
    // Two slots for the missing experts (asked for, so they may take any share of the budget
    // that fits; a layer's misses take several groups), their staging (at most 1 MiB here,
    // where the budget counts staging: not on a GPU whose staging is system RAM), a chunk's
    // activations, and about three resident slots a layer.
    let staging = if minimum.staging > 0 { 1 << 20 } else { 0 };
    let stream = footprint::expert_stream_bytes(&model, 256, 2) + staging;
    let budget = minimum.total() + stream + 2 * minimum.one_slot_per_layer;
    let margin = minimum.margin;
    let minimum = minimum.total();
    let whole_bytes = GpuModel::device_bytes(&model, &options(None, 0)).total();
    if staging == 0 && whole_bytes + margin <= budget {
        // A GPU whose staging is system RAM (not counted) holds these tiny models whole at
        // this budget: a chunk's activations outweigh their experts, so nothing streams here.
        // Lavapipe (CI) counts the whole model's staging and streams.
        eprintln!("{preset}: the whole model fits {budget} bytes on this device; not streamed");
        return;
    }
    let mut gpu = GpuModel::new(&dev, &model, &options(Some(budget), 2)).unwrap();
    let what = format!("{preset}, budget {budget}");
    let p = gpu.placement().clone();
    assert!(p.is_partial() && p.stream_slot, "{what}: {p:?}");
    assert!(p.slots > 1, "{what}: {p:?}");
    assert_eq!(p.prompt_expert_slots, 2, "{what}");
    assert!(gpu.batches_prompts(), "{what}");
    let got = run(&mut gpu);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_logits_close(g, w, TOLERANCE, &format!("{what}: output {i}"));
    }
    let t = gpu.expert_stats().unwrap().total();
    eprintln!("{what}: {}", gpu.expert_stats().unwrap().summary());
    // Prompt tokens and decode steps, each token routed to k experts in every MoE layer.
    let routed = (70 + 90 + 3) * moe_layers * cfg.n_expert_used as u64;
    assert_eq!(t.hits + t.misses, routed, "{what}");
    assert!(t.hits > 0 && t.misses > 0, "{what}: {t:?}");
    // The decode steps' misses ran on the CPU, the prompts' through the slots.
    let decode_misses = t.cpu;
    assert!(decode_misses <= 3 * moe_layers * cfg.n_expert_used as u64);
    assert_eq!(t.fetched + t.cpu, t.misses, "{what}");
    assert!(t.fetched > 2 * moe_layers, "{what}: {t:?}");
    assert!(t.bytes_uploaded > 0, "{what}");
    // The prompts' routing counted in the experts' demand: the most used came into VRAM.
    assert!(t.promoted > 0, "{what}: {t:?}");

    // Left to choose, the placement gives the slots at most a quarter of the room for experts,
    // and here they would take more.
    let auto = GpuModel::new(&dev, &model, &options(Some(budget), 0)).unwrap();
    assert!(
        !auto.placement().stream_slot,
        "{what}: {:?}",
        auto.placement()
    );

    // Without the slots the same budget holds more resident experts (here perhaps all), and
    // prompts take chunks with their missing experts on the CPU, with the same logits.
    let off = GpuModelOptions {
        stream_prompts: false,
        ..options(Some(budget), 2)
    };
    let mut each = GpuModel::new(&dev, &model, &off).unwrap();
    let q = each.placement().clone();
    assert!(q.slots > p.slots, "{what}: {q:?}");
    assert!(!q.stream_slot, "{what}");
    assert!(each.batches_prompts(), "{what}: {q:?}");
    for (i, (g, w)) in run(&mut each).iter().zip(&want).enumerate() {
        assert_logits_close(
            g,
            w,
            TOLERANCE,
            &format!("{what}, misses on the CPU: output {i}"),
        );
    }
    if q.is_partial() {
        assert!(each.cpu_prompt_chunks() > 0, "{what}");
    }

    // The smallest budget holds one slot per layer and no room for the prompt's slots: its
    // prompts run their misses on the CPU, in chunks where a chunk's memory fits, else token
    // by token; the same logits either way.
    let mut small = GpuModel::new(&dev, &model, &options(Some(minimum), 2)).unwrap();
    assert_eq!(small.placement().slots, 1, "{preset}: minimum");
    assert!(!small.placement().stream_slot, "{preset}: minimum");
    for (i, (g, w)) in run(&mut small).iter().zip(&want).enumerate() {
        assert_logits_close(g, w, TOLERANCE, &format!("{preset}, minimum: output {i}"));
    }

    // Misses split between the CPU and the bus: every expert is in system RAM too, yet prompt
    // chunks run their misses on the CPU as with `cpu` (the entries the host writes list no
    // expert there), and decode steps share theirs; the same logits.
    // (At 0.4 a layer's one miss goes over the bus, and of two the CPU takes one.)
    let split = |o: GpuModelOptions| GpuModelOptions {
        moe_miss: MoeMiss::Split,
        split_cpu_share: Some(0.4),
        ..o
    };
    for (label, o) in [
        ("no slots", split(off.clone())),
        ("minimum", split(options(Some(minimum), 2))),
    ] {
        let what = format!("{preset}, misses split, {label}");
        let mut gpu = GpuModel::new(&dev, &model, &o).unwrap();
        for (i, (g, w)) in run(&mut gpu).iter().zip(&want).enumerate() {
            assert_logits_close(g, w, TOLERANCE, &format!("{what}: output {i}"));
        }
        gpu.reset();
        let got_short = gpu.eval_prompt(&short, true).unwrap();
        assert_logits_close(
            &got_short,
            &want_short,
            TOLERANCE,
            &format!("{what}: short"),
        );
        if gpu.placement().is_partial() {
            let t = gpu.expert_stats().unwrap().total();
            assert!(gpu.cpu_prompt_chunks() > 0, "{what}");
            // With the embedding in system RAM the larger budget leaves decode steps few
            // misses (or none); the minimum's steps miss on both sides.
            assert!(t.cpu > 0, "{what}: {t:?}");
            if label == "minimum" {
                assert!(t.pcie > 0, "{what}: {t:?}");
            }
        }
    }
}

#[test]
fn qwen3moe_over_the_vram_budget_streams_a_prompts_missing_experts() {
    check("tiny-qwen3moe");
}

#[test]
fn mixtral_over_the_vram_budget_streams_a_prompts_missing_experts() {
    check("tiny-mixtral");
}

/// Qwen2-MoE's prompts take chunks with every expert resident (`bench/tests/vulkan_prefill.rs`),
/// but under a budget they go token by token: a model with a shared expert has no expert slots.
#[test]
fn a_shared_expert_keeps_prompts_token_by_token_over_the_budget() {
    let Some(dev) = device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), "tiny-qwen2moe");
    let bytes = GpuModel::device_bytes(&model, &options(None, 0)).total();
    let minimum = GpuModel::minimum_budget(&dev, &model, &options(None, 0))
        .unwrap()
        .total();
    let half = minimum + (bytes - minimum) / 2;
    let gpu = GpuModel::new(&dev, &model, &options(Some(half), 0)).unwrap();
    assert!(gpu.placement().is_partial());
    assert!(!gpu.placement().stream_slot);
    assert!(!gpu.batches_prompts());
}
