//! A prompt whose chunk's device memory is refused still runs, token by token: the first
//! prompt allocates the chunk's activations; an injected failure of that allocation
//! (`gpu::alloc::fault`, process-wide, hence this test's own binary) has that prompt run one
//! token at a time, with the logits token by token gives. The driver's refusal is not
//! remembered: the next prompt is taken in a chunk again. On whatever Vulkan device the machine
//! has (lavapipe in CI); without one this test skips, unless `SPILLWAY_REQUIRE_VULKAN` is set,
//! in which case it fails.

#[path = "../../daemon/tests/common/logits.rs"]
mod logits;
use logits::assert_logits_close;

use std::sync::Arc;

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::gpu::alloc::fault::fail_block_after;
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::model::Model;

#[test]
fn a_refused_chunk_leaves_prompts_token_by_token() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    SynthModel::from_name("tiny-llama", "Q8_0".parse::<WeightType>().unwrap(), 5)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    let model = Arc::new(Model::open(&path).unwrap());
    // A long context and a full chunk of 512 make the chunk's attention scratch a buffer of its
    // own block (over half of 64 MiB), so the chunk needs a new block whatever the blocks the
    // load left.
    let options = GpuModelOptions {
        context: 16384,
        ..GpuModelOptions::default()
    };
    let mut one = GpuModel::new(&dev, &model, &options).unwrap();
    let mut refused = GpuModel::new(&dev, &model, &options).unwrap();
    let held = refused.allocator().budget().held();
    let n_vocab = one.config().n_vocab;
    let prompt: Vec<u32> = (0..600u32)
        .map(|i| (i * 7919 + 3) % n_vocab as u32)
        .collect();

    assert!(refused.batches_prompts());
    fail_block_after(1);
    let got = refused.eval_prompt(&prompt, false).unwrap();
    fail_block_after(0);
    assert!(
        refused.batches_prompts(),
        "the driver's refusal is not remembered"
    );
    assert_eq!(refused.position(), prompt.len());
    assert_eq!(
        refused.allocator().budget().held(),
        held,
        "what the refused chunk took is given back"
    );

    let mut want = Vec::new();
    for &t in &prompt {
        want = one.eval(t).unwrap();
    }
    // Token by token both ways: the same kernels on the same inputs.
    assert_eq!(got, want);
    // The next prompt is taken in a chunk, whose tiled products follow token by token's
    // within the chunks' tolerance.
    let more = [5u32, 900, 33];
    let got = refused.eval_prompt(&more, false).unwrap();
    let mut last = Vec::new();
    for &t in &more {
        last = one.eval(t).unwrap();
    }
    assert_logits_close(&got, &last, 0.01, "the prompt after the refusal");
}
