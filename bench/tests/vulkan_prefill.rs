//! A model's prompt on the GPU in chunks (`GpuModel::eval_prompt`) against the same model
//! token by token (`GpuModel::eval`, itself checked against the CPU engine in
//! `vulkan_forward.rs`): every token's logits, prompts longer than a chunk, a prompt that starts
//! after earlier tokens, and the decode steps after a prompt, which read the KV cache the chunks
//! wrote; dense and MoE models (experts run over the tokens that chose them). On whatever Vulkan device the machine has (lavapipe in CI); without one these tests
//! skip, unless `SPILLWAY_REQUIRE_VULKAN` is set, in which case they fail.

// The daemon's tests' comparison of logits, shared rather than written again.
#[path = "../../daemon/tests/common/logits.rs"]
mod logits;
use logits::assert_logits_close;
#[path = "common/pcie_budget.rs"]
mod pcie_budget;
use pcie_budget::partial_pcie;

use std::sync::Arc;

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::placement::MoeMiss;
use spillway_daemon::gpu::Device;
use spillway_daemon::model::Model;

fn device() -> Option<Arc<Device>> {
    spillway_daemon::gpu::device_or_skip()
}

/// Largest |a - b| relative to the largest |b|. The chunked products sum in another order than
/// the one-token ones and, with cooperative matrices, round the activations to f16; a wrong op
/// (a token's row or position off by one, a missed barrier) moves logits by their whole range.
const TOLERANCE: f32 = 0.01;

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_logits_close(got, want, TOLERANCE, what);
}

fn tokens(n: usize, n_vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i as u64 * 2_654_435_761 + 17) % n_vocab as u64) as u32)
        .collect()
}

/// The synthetic `preset` with `weights`, written to a temporary file (the map stays valid
/// after the file's directory is gone).
fn synth_model(preset: &str, weights: &str) -> Arc<Model> {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    SynthModel::from_name(preset, weights.parse::<WeightType>().unwrap(), 5)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    Arc::new(Model::open(&path).unwrap())
}

fn models(dev: &Arc<Device>, preset: &str, weights: &str) -> (GpuModel, GpuModel) {
    let model = synth_model(preset, weights);
    // The one-token steps with f32 dots, as the chunks' products: with integer dots they
    // quantize the inputs of Q4_0 rows to 8 bits (checked against the CPU engine, which does the
    // same, in `vulkan_forward.rs`), a difference of about 1% of the logits' range that is not
    // the one this test looks for.
    let options = GpuModelOptions {
        context: 256,
        int_dot: false,
        ..GpuModelOptions::default()
    };
    let one = GpuModel::new(dev, &model, &options).unwrap();
    let batched = GpuModel::new(dev, &model, &options).unwrap();
    assert!(batched.batches_prompts(), "{preset} batches its prompts");
    (one, batched)
}

fn check(preset: &str, weights: &str) {
    let Some(dev) = device() else { return };
    let (mut one, mut batched) = models(&dev, preset, weights);
    let n_vocab = one.config().n_vocab;
    // 70 tokens: two chunks when every token's logits are wanted (64 a chunk).
    let prompt = tokens(70, n_vocab);
    let mut want = Vec::new();
    for &t in &prompt {
        want.extend(one.eval(t).unwrap());
    }
    let got = batched.eval_prompt(&prompt, true).unwrap();
    for (i, (g, w)) in got.chunks(n_vocab).zip(want.chunks(n_vocab)).enumerate() {
        assert_close(g, w, &format!("{preset} {weights} prompt token {i}"));
    }
    assert_eq!(batched.position(), prompt.len());

    // A second prompt after the first (a chunk starting at position 70), last logits only.
    let more = tokens(90, n_vocab / 2);
    let mut last = Vec::new();
    for &t in &more {
        last = one.eval(t).unwrap();
    }
    let got = batched.eval_prompt(&more, false).unwrap();
    assert_close(&got, &last, &format!("{preset} {weights} second prompt"));

    // Decoding after the prompts reads the cache the chunks wrote.
    for t in [5u32, 900, 33] {
        let want = one.eval(t).unwrap();
        let got = batched.eval(t).unwrap();
        assert_close(&got, &want, &format!("{preset} {weights} decode of {t}"));
    }
}

#[test]
fn chunked_prompt_matches_token_by_token_tiny_llama_q4_0() {
    check("tiny-llama", "Q4_0");
}

#[test]
fn chunked_prompt_matches_token_by_token_tiny_llama_q4_k_m() {
    check("tiny-llama", "Q4_K_M");
}

#[test]
fn chunked_prompt_matches_token_by_token_tiny_qwen3_q8_0() {
    check("tiny-qwen3", "Q8_0");
}

#[test]
fn chunked_prompt_matches_token_by_token_tiny_qwen3moe_q8_0() {
    check("tiny-qwen3moe", "Q8_0");
}

#[test]
fn chunked_prompt_matches_token_by_token_tiny_mixtral_q8_0() {
    check("tiny-mixtral", "Q8_0");
}

/// Qwen2-MoE: the shared expert runs over every token of a chunk with each token's gate.
#[test]
fn chunked_prompt_matches_token_by_token_tiny_qwen2moe_q8_0() {
    check("tiny-qwen2moe", "Q8_0");
}

#[test]
fn a_prompt_that_overflows_the_context_is_refused_and_nothing_moves() {
    let Some(dev) = device() else { return };
    let (_, mut batched) = models(&dev, "tiny-llama", "Q8_0");
    let n_vocab = batched.config().n_vocab;
    assert!(batched.eval_prompt(&tokens(300, n_vocab), false).is_err());
    assert_eq!(batched.position(), 0);
    let bad = [1, n_vocab as u32];
    assert!(batched.eval_prompt(&bad, false).is_err());
    assert_eq!(batched.position(), 0);
}

/// A MoE chunk routed on the device (one submission; each token's experts chosen, laid out by
/// expert and summed back on the GPU) against the same chunk routed on the host (a submission
/// per MoE layer, `host_routing`): the same logits within the tolerance, the same experts
/// counted in every layer, and the device's chunk in one submission.
fn check_routing_on_device(preset: &str, weights: &str) {
    let Some(dev) = device() else { return };
    let model = synth_model(preset, weights);
    let options = GpuModelOptions {
        context: 256,
        ..GpuModelOptions::default()
    };
    let mut device = GpuModel::new(&dev, &model, &options).unwrap();
    let host_routing = GpuModelOptions {
        host_routing: true,
        ..options
    };
    let mut host = GpuModel::new(&dev, &model, &host_routing).unwrap();
    let n_vocab = device.config().n_vocab;
    let moe_layers = model.config.n_layer as u32;
    // A chunk of 100 tokens (every token's logits: 64 and 36), then one of 150.
    for (n, all) in [(100, true), (150, false)] {
        let prompt = tokens(n, n_vocab);
        let got = device.eval_prompt(&prompt, all).unwrap();
        assert_eq!(device.last_stats().submits, 1, "{preset}: one submission");
        let want = host.eval_prompt(&prompt, all).unwrap();
        assert_eq!(
            host.last_stats().submits,
            1 + moe_layers,
            "{preset}: host routing"
        );
        for (i, (g, w)) in got.chunks(n_vocab).zip(want.chunks(n_vocab)).enumerate() {
            assert_close(g, w, &format!("{preset} {weights}: {n} tokens, logits {i}"));
        }
    }
    let (a, b) = (device.expert_stats().unwrap(), host.expert_stats().unwrap());
    assert_eq!(a.layers, b.layers, "{preset}: every layer's counters");
    let k = model.config.moe.unwrap().n_expert_used as u64;
    assert_eq!(
        a.total().hits,
        (100 + 150) * u64::from(moe_layers) * k,
        "{preset}"
    );
}

#[test]
fn a_chunk_routed_on_the_device_equals_the_host_routing_tiny_qwen3moe() {
    check_routing_on_device("tiny-qwen3moe", "Q4_0");
}

#[test]
fn a_chunk_routed_on_the_device_equals_the_host_routing_tiny_mixtral() {
    check_routing_on_device("tiny-mixtral", "Q8_0");
}

/// Under a VRAM budget with the misses read from system RAM (`MoeMiss::Pcie`), a chunk is still
/// routed on the device in one submission: the experts without a slot are multiplied from their
/// stacks in system RAM by the same kernels, so the logits are the whole model's chunk's bit for
/// bit, and every routed expert is counted, the missing ones as read over the bus. The
/// placement places no prompt slots (its room for the chunk, on a real model's shape, is
/// `gpu::placement`'s unit test).
fn check_pcie_chunks(preset: &str, weights: &str) {
    let Some(dev) = device() else { return };
    let model = synth_model(preset, weights);
    // A short context keeps the chunk's activations small beside these tiny experts.
    let pcie = GpuModelOptions {
        context: 64,
        moe_miss: MoeMiss::Pcie,
        ..GpuModelOptions::default()
    };
    let mut whole = GpuModel::new(&dev, &model, &pcie).unwrap();
    let options = partial_pcie(&dev, &model, &pcie);
    let budget = options.vram_budget.unwrap();
    let mut gpu = GpuModel::new(&dev, &model, &options).unwrap();
    let p = gpu.placement().clone();
    if !p.is_partial() {
        // A GPU whose staging is system RAM holds these tiny models whole at this budget.
        eprintln!("{preset}: the whole model fits {budget} bytes on this device");
        return;
    }
    assert!(gpu.batches_prompts(), "{preset}");
    assert!(
        !p.stream_slot && p.prompt_expert_slots == 0,
        "{preset}: {p:?}"
    );
    let n_vocab = gpu.config().n_vocab;
    for n in [40, 20] {
        let prompt = tokens(n, n_vocab);
        let got = gpu.eval_prompt(&prompt, false).unwrap();
        let stats = gpu.last_stats();
        assert_eq!(stats.submits, 1, "{preset}: one submission");
        assert!(
            stats.dispatches > 10,
            "{preset}: a chunk, not a step: {stats:?}"
        );
        let want = whole.eval_prompt(&prompt, false).unwrap();
        assert_eq!(got, want, "{preset} {weights}: {n} tokens, {p:?}");
    }
    let t = gpu.expert_stats().unwrap().total();
    let k = model.config.moe.unwrap().n_expert_used as u64;
    let routed = (40 + 20) * model.config.n_layer as u64 * k;
    assert_eq!(t.hits + t.misses, routed, "{preset}: {t:?}");
    assert!(
        t.hits > 0 && t.pcie > 0 && t.pcie == t.misses,
        "{preset}: {t:?}"
    );
}

#[test]
fn a_chunk_over_the_vram_budget_reads_its_missing_experts_over_the_bus_tiny_qwen3moe() {
    check_pcie_chunks("tiny-qwen3moe", "Q4_0");
}

#[test]
fn a_chunk_over_the_vram_budget_reads_its_missing_experts_over_the_bus_tiny_mixtral() {
    check_pcie_chunks("tiny-mixtral", "Q8_0");
}
