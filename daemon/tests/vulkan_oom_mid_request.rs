//! Device memory refused in the middle of a request (injected: `gpu::alloc::fault::
//! fail_allocation_after`): the first prompt of a GPU model makes its chunk's activations, and
//! when the driver refuses that memory, at the chunk's first buffer or after some were made,
//! the prompt goes token by token and gives the logits it gives so; nothing of the refused
//! chunk stays allocated; the refusal is not remembered (the driver may have room later), so
//! the next prompt is taken in chunks again, and a hundred prompts after it give the same
//! logits. Its own test binary: the injection point is process-wide. Runs on whatever Vulkan
//! device the machine has (lavapipe in CI) and skips without one, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

use std::sync::Arc;

use spillway_daemon::gpu::alloc::fault::fail_allocation_after;
use spillway_daemon::gpu::alloc::process_bytes;
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::model::Model;
use spillway_daemon::synth::SynthModel;

const PROMPT: [u32; 8] = [1, 17, 300, 5, 1000, 42, 7, 99];

#[test]
fn a_chunk_refused_device_memory_goes_token_by_token_and_the_next_prompt_batches_again() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("dense.gguf");
    SynthModel::from_name("tiny-llama", "F16".parse().unwrap(), 3)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    let model = Arc::new(Model::open(&path).unwrap());
    let options = GpuModelOptions {
        context: 32,
        ..Default::default()
    };
    let mut gpu = GpuModel::new(&dev, &model, &options).unwrap();
    assert!(
        gpu.batches_prompts(),
        "a dense model in VRAM takes prompts in chunks"
    );

    // The prompt token by token, as a model without room for a chunk takes it.
    let mut each = Vec::new();
    for &t in &PROMPT {
        each = gpu.eval(t).unwrap();
    }
    gpu.reset();
    let held = |gpu: &GpuModel| (gpu.allocator().allocated_bytes(), process_bytes());
    let baseline = held(&gpu);

    // The chunk's first buffer refused, then its third (two made and given back).
    for nth in [1, 3] {
        fail_allocation_after(nth);
        let got = gpu.eval_prompt(&PROMPT, false).unwrap();
        assert_eq!(
            got, each,
            "refused at allocation {nth}: the prompt token by token"
        );
        assert_eq!(
            held(&gpu),
            baseline,
            "refused at allocation {nth}: nothing of the chunk stays"
        );
        gpu.reset();
    }

    // Not remembered: the next prompt makes its chunk and takes the prompt in it.
    fail_allocation_after(0);
    assert!(gpu.batches_prompts());
    let chunked = gpu.eval_prompt(&PROMPT, false).unwrap();
    assert!(
        held(&gpu).0 > baseline.0,
        "the chunk's activations are made"
    );
    let worst = chunked
        .iter()
        .zip(&each)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = each.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-2 * scale.max(1.0),
        "a chunk's logits against token by token: {worst} (largest logit {scale})"
    );
    for i in 0..100 {
        gpu.reset();
        assert_eq!(
            gpu.eval_prompt(&PROMPT, false).unwrap(),
            chunked,
            "prompt {i}"
        );
    }
}
