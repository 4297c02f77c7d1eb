//! What the CPU engine's per-layer profiler costs: decode tokens/s of a synthetic model with
//! the profiler off (the hot path) and on, median of several runs, the two interleaved so that
//! drift in the machine's speed hits both alike.
//!
//! `cargo run --release -p spillway-bench --example profile_overhead -- [PRESET] [TYPE] [TOKENS]
//! [RUNS] [THREADS]`, e.g. `qwen3-0.6b Q8_0 64 7 2` (the defaults).

use std::sync::Arc;
use std::time::Instant;

use spillway_bench::interleave::{interleaved, median};
use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::engine::{Engine, EngineOptions, StepProfile};
use spillway_daemon::model::Model;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let preset = arg(0, "qwen3-0.6b");
    let weights: WeightType = arg(1, "Q8_0").parse().unwrap();
    let n_tokens: usize = arg(2, "64").parse().unwrap();
    let runs: usize = arg(3, "7").parse().unwrap();
    let threads: usize = arg(4, "2").parse().unwrap();

    let path = std::env::temp_dir().join(format!("{preset}-{}-profile-synth.gguf", arg(1, "Q8_0")));
    if !path.exists() {
        SynthModel::from_name(&preset, weights, 7)
            .unwrap()
            .write(&path, false, |_, _| {})
            .unwrap();
    }
    let model = Arc::new(Model::open(&path).unwrap());
    let mut engine = Engine::new(
        model.clone(),
        &EngineOptions {
            threads,
            context: n_tokens + 8,
        },
    );
    let n_vocab = model.config.n_vocab as u32;
    let tokens: Vec<u32> = (0..n_tokens as u32)
        .map(|i| (i * 7919 + 13) % n_vocab)
        .collect();

    // Decode tokens/s of one run; `profiled` gives every step a profile.
    let mut run = |profiled: bool| -> f64 {
        engine.reset();
        let mut profile = StepProfile::default();
        let t0 = Instant::now();
        for &t in &tokens {
            let p = profiled.then_some(&mut profile);
            engine.eval_batch_with(&[t], false, p).unwrap();
        }
        n_tokens as f64 / t0.elapsed().as_secs_f64()
    };
    run(false); // warm-up: page the weights in
    let (off, on) = interleaved(runs, run);
    let (m_off, m_on) = (median(&off), median(&on));
    println!(
        "{preset} {}: {n_tokens} decode tokens per run, {runs} runs, {threads} threads",
        arg(1, "Q8_0")
    );
    println!(
        "{:<10} {:>12} {:>12} {:>12} {:>10}",
        "profiler", "median tok/s", "min", "max", "vs off"
    );
    for (name, v, m) in [("off", &off, m_off), ("on", &on, m_on)] {
        println!(
            "{name:<10} {m:>12.2} {:>12.2} {:>12.2} {:>+9.2}%",
            v[0],
            v[v.len() - 1],
            100.0 * (m / m_off - 1.0)
        );
    }
}
