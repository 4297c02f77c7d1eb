//! What GPU profiling costs: decode tokens/s of a synthetic model on the Vulkan device with
//! per-layer timestamps off (the hot path: no query pool, no timestamp written) and on, median
//! of several runs, the two interleaved so that drift in the machine's speed hits both alike.
//! Optionally under a VRAM budget (experts on the CPU, whose pool then traces too).
//!
//! `cargo run --release -p spillway-bench --example vulkan_profile_overhead -- [PRESET] [TYPE]
//! [TOKENS] [RUNS] [VRAM_BUDGET_BYTES] [DIR]`, e.g. `llama-3.2-1b Q4_0 64 7 0 /tmp` (the
//! defaults; a budget of 0 means none).

use std::sync::Arc;
use std::time::Instant;

use spillway_bench::interleave::{interleaved, median};
use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::{Device, Instance};
use spillway_daemon::model::Model;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let preset = arg(0, "llama-3.2-1b");
    let weights: WeightType = arg(1, "Q4_0").parse().unwrap();
    let n_tokens: usize = arg(2, "64").parse().unwrap();
    let runs: usize = arg(3, "7").parse().unwrap();
    let budget: u64 = arg(4, "0").parse().unwrap();
    let dir = std::path::PathBuf::from(arg(5, "/tmp"));

    let path = dir.join(format!("{preset}-{}-profile-synth.gguf", arg(1, "Q4_0")));
    if !path.exists() {
        SynthModel::from_name(&preset, weights, 7)
            .unwrap()
            .write(&path, false, |_, _| {})
            .unwrap();
    }
    let model = Arc::new(Model::open(&path).unwrap());
    let device = Device::open(Instance::new().unwrap(), None).unwrap();
    let options = GpuModelOptions {
        context: n_tokens + 8,
        vram_budget: (budget > 0).then_some(budget),
        ..GpuModelOptions::default()
    };
    let mut gpu = GpuModel::new(&device, &model, &options).unwrap();
    let n_vocab = model.config.n_vocab as u32;
    let tokens: Vec<u32> = (0..n_tokens as u32)
        .map(|i| (i * 7919 + 13) % n_vocab)
        .collect();

    // Decode tokens/s of one run, profiled or not.
    let mut run = |profiled: bool| -> f64 {
        gpu.set_profiling(profiled).unwrap();
        gpu.reset();
        let t0 = Instant::now();
        for &t in &tokens {
            gpu.eval(t).unwrap();
        }
        let rate = n_tokens as f64 / t0.elapsed().as_secs_f64();
        assert_eq!(gpu.last_profile().is_some(), profiled);
        rate
    };
    run(false); // warm-up: pipelines, page cache
    let (off, on) = interleaved(runs, run);
    let (m_off, m_on) = (median(&off), median(&on));
    println!(
        "{preset} {} on {}, {n_tokens} tokens, {runs} runs{}: profiling off {m_off:.1} tok/s \
         (runs {:.1}-{:.1}), on {m_on:.1} tok/s (runs {:.1}-{:.1}), on/off {:.3}",
        arg(1, "Q4_0"),
        device.info().name,
        if budget > 0 {
            format!(", VRAM budget {budget} B")
        } else {
            String::new()
        },
        off[0],
        off[off.len() - 1],
        on[0],
        on[on.len() - 1],
        m_on / m_off
    );
}
