//! The GPU decode step (`gpu::forward::GpuModel`) against the CPU engine on synthetic models,
//! token by token, on whatever Vulkan device the machine has (lavapipe in CI). Without a device
//! these tests skip, unless `SPILLWAY_REQUIRE_VULKAN` is set, in which case they fail.

use std::sync::Arc;

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::engine::{Engine, EngineOptions};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::{Device, Instance, REQUIRE_VULKAN_ENV};
use spillway_daemon::model::Model;

fn device() -> Option<Arc<Device>> {
    match Instance::new().and_then(|i| Device::open(i, None)) {
        Ok(d) => Some(d),
        Err(e) => {
            let required = std::env::var(REQUIRE_VULKAN_ENV).is_ok_and(|v| v != "0");
            assert!(
                !required,
                "{REQUIRE_VULKAN_ENV} is set but no Vulkan device: {e}"
            );
            eprintln!("skipping: no Vulkan device ({e})");
            None
        }
    }
}

/// Largest |gpu - cpu| over the logits, relative to the largest |cpu| logit.
///
/// The GPU multiplies f32 activations; the CPU first quantizes them to Q8_0/Q8_K (as ggml's CPU
/// backend does), which moves every matrix-vector product by up to ~1% of Σ|w·x|. Through a few
/// layers that stays within 3% of the logits' range; a wrong op (a missed barrier, a wrong
/// RoPE pair, a mis-read scale) moves logits by their whole range.
const TOLERANCE: f32 = 0.03;

fn compare(preset: &str, weights: &str) {
    let Some(dev) = device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    let w: WeightType = weights.parse().unwrap();
    SynthModel::from_name(preset, w, 5)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    let model = Arc::new(Model::open(&path).unwrap());
    let options = EngineOptions {
        threads: 2,
        context: 64,
    };
    let mut cpu = Engine::new(model.clone(), &options);
    let gpu_options = GpuModelOptions {
        vram_budget: None,
        context: 64,
    };
    let mut gpu = GpuModel::new(&dev, &model, &gpu_options).unwrap();
    let tokens = [1u32, 17, 300, 5, 1000, 42, 7, 99];
    let mut agree = 0;
    for (i, &t) in tokens.iter().enumerate() {
        let want = cpu.eval(t).unwrap().to_vec();
        let got = gpu.eval(t).unwrap();
        assert_eq!(got.len(), want.len());
        let range = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("{preset} {weights} token {i}: max |diff| {diff} of {range}");
        assert!(
            diff <= TOLERANCE * range,
            "{preset} {weights} token {i}: logits differ by {diff} (largest logit {range})"
        );
        let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
        agree += usize::from(argmax(&got) == argmax(&want));
    }
    assert!(
        agree >= tokens.len() - 1,
        "{preset}: argmax agreed on {agree} tokens"
    );
    let stats = gpu.last_stats();
    assert!(
        stats.barriers < stats.dispatches,
        "independent dispatches share barriers: {stats:?}"
    );
}

#[test]
fn gpu_decode_matches_cpu_engine_tiny_llama_q4_k_m() {
    compare("tiny-llama", "Q4_K_M");
}

#[test]
fn gpu_decode_matches_cpu_engine_tiny_qwen3_q4_k_m() {
    compare("tiny-qwen3", "Q4_K_M");
}

#[test]
fn gpu_decode_matches_cpu_engine_tiny_llama_q8_0() {
    compare("tiny-llama", "Q8_0");
}

#[test]
fn gpu_model_respects_the_vram_budget() {
    let Some(dev) = device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    SynthModel::from_name("tiny-llama", "Q4_K_M".parse().unwrap(), 5)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    let model = Model::open(&path).unwrap();
    let options = GpuModelOptions {
        vram_budget: Some(256 << 10),
        context: 64,
    };
    let err = GpuModel::new(&dev, &model, &options)
        .err()
        .expect("a 256 KiB budget cannot hold the model");
    assert!(err.is_out_of_memory(), "{err}");
}
