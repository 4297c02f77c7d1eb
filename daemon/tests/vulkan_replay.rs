//! A step that is one submission (a dense model, or a MoE model with every expert in VRAM) is
//! recorded once and replayed for every token, the token id and position read from a buffer on
//! the device (`gpu::replay`). Replayed steps give the logits, routings and counters of steps
//! recorded anew, bit for bit, across positions and after a reset. The tests run on whatever
//! Vulkan device the machine has (lavapipe in CI) and skip without one, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

use std::sync::Arc;

use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions, SMALL_PRODUCT_WEIGHTS};
use spillway_daemon::gpu::moe::LayerRouting;
use spillway_daemon::model::Model;
use spillway_daemon::synth::SynthModel;

const TOKENS: [u32; 8] = [1, 17, 300, 5, 1000, 42, 7, 99];

type Step = (Vec<f32>, Vec<LayerRouting>, u32, u32);

fn decode(gpu: &mut GpuModel) -> Vec<Step> {
    TOKENS
        .iter()
        .map(|&t| {
            let logits = gpu.eval(t).unwrap();
            let stats = gpu.last_stats();
            (
                logits,
                gpu.last_routing().to_vec(),
                stats.dispatches,
                stats.submits,
            )
        })
        .collect()
}

/// The synthetic model `preset` in `ty` (seed 3), in a directory that lives as long as the
/// first value.
fn synthetic(preset: &str, ty: &str) -> (tempfile::TempDir, Arc<Model>) {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(format!("{preset}.gguf"));
    SynthModel::from_name(preset, ty.parse().unwrap(), 3)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    (tmp, Arc::new(Model::open(&path).unwrap()))
}

fn replay_matches_recording(preset: &str, ty: &str) {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let (_tmp, model) = synthetic(preset, ty);
    let options = |replay| GpuModelOptions {
        context: 16,
        replay,
        ..Default::default()
    };
    let mut recorded = GpuModel::new(&dev, &model, &options(false)).unwrap();
    let want = decode(&mut recorded);
    let mut replayed = GpuModel::new(&dev, &model, &options(true)).unwrap();
    let got = decode(&mut replayed);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.3, 1, "{preset}: token {i} is one submission");
        assert_eq!(g.2, w.2, "{preset}: token {i}'s dispatches");
        assert!(
            g.0.iter()
                .zip(&w.0)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{preset}: token {i}'s logits differ"
        );
        assert_eq!(g.1, w.1, "{preset}: token {i}'s routing");
    }
    if model.config.moe.is_some() {
        assert!(
            replayed.routes_on_device(),
            "{preset}: routed on the device"
        );
        assert_eq!(replayed.expert_stats(), recorded.expert_stats(), "{preset}");
    }
    // A new sequence replays the same recording from position 0.
    replayed.reset();
    let again = decode(&mut replayed);
    assert!(
        again.iter().zip(&got).all(|(a, b)| a.0 == b.0),
        "{preset}: after a reset"
    );
}

#[test]
fn llama_replayed_steps_equal_recorded_ones() {
    replay_matches_recording("tiny-llama", "Q4_0");
}

#[test]
fn qwen3moe_replayed_steps_equal_recorded_ones() {
    replay_matches_recording("tiny-qwen3moe", "Q8_0");
}

#[test]
fn qwen3_replayed_steps_equal_recorded_ones() {
    replay_matches_recording("tiny-qwen3", "Q4_K_M");
}

/// A timed replay runs its warm-up and its timed part every time it is run: `a += b` three
/// times as warm-up and once timed, run twice, adds `b` eight times.
#[test]
fn a_timed_replay_runs_everything_it_recorded_each_time() {
    use spillway_daemon::gpu::ops::upload_f32;
    use spillway_daemon::gpu::{Allocator, Kernels, Uploader};
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let alloc = Allocator::new(&dev, None);
    let kernels = Kernels::new(&dev);
    let mut up = Uploader::new(&alloc, 1 << 20).unwrap();
    let n = 1000;
    let a = upload_f32(&alloc, &mut up, &vec![1.0; n]).unwrap();
    let b = upload_f32(&alloc, &mut up, &vec![0.5; n]).unwrap();
    up.flush().unwrap();
    let add = |r: &mut spillway_daemon::gpu::Recorder<'_>| r.add(&a, &b, n as u32);
    let replay = kernels
        .record_timed_replay(|r| (0..3).try_for_each(|_| add(r)), add)
        .unwrap();
    for _ in 0..2 {
        if let Some((whole, timed)) = replay.run().unwrap() {
            assert!(whole >= timed, "{whole} ns in all, {timed} ns timed");
        }
    }
    let out = spillway_daemon::gpu::upload::download(&alloc, &a, 0, 4 * n as u64).unwrap();
    let out: Vec<f32> = out
        .chunks_exact(4)
        .map(|w| f32::from_le_bytes(w.try_into().unwrap()))
        .collect();
    assert!(out.iter().all(|&v| v == 5.0), "{:?}", &out[..4]);
}

/// Small products quantize their inputs in their own workgroups
/// (`GpuModelOptions::q8_min_weights`; the tiny models' products are all small), larger ones
/// read them quantized once by a dispatch before them: the same logits either way within the
/// order of Σ x² (the quantized values are the same), and the second way records that dispatch.
#[test]
fn small_products_quantize_their_own_inputs() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    if !dev.integer_dot_product() {
        return; // no integer-dot products: nothing is quantized
    }
    let (_tmp, model) = synthetic("tiny-llama", "Q4_0");
    let options = |q8_min_weights| GpuModelOptions {
        context: 16,
        q8_min_weights,
        ..Default::default()
    };
    let mut own = GpuModel::new(&dev, &model, &options(usize::MAX)).unwrap();
    let mut once = GpuModel::new(&dev, &model, &options(0)).unwrap();
    for (i, &t) in TOKENS.iter().enumerate() {
        let a = own.eval(t).unwrap();
        let b = once.eval(t).unwrap();
        let range = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 1e-3 * range, "token {i}: {diff} of {range}");
        let (sa, sb) = (own.last_stats(), once.last_stats());
        assert!(
            sb.dispatches > sa.dispatches,
            "token {i}: {} dispatches quantizing once, {} in the products",
            sb.dispatches,
            sa.dispatches
        );
    }
    // The default quantizes the tiny model's products in place, as `own` does.
    let mut default = GpuModel::new(&dev, &model, &options(SMALL_PRODUCT_WEIGHTS)).unwrap();
    default.eval(TOKENS[0]).unwrap();
    own.reset();
    own.eval(TOKENS[0]).unwrap();
    assert_eq!(default.last_stats().dispatches, own.last_stats().dispatches);
}
