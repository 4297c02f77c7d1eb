//! GPU decode (`gpu::forward::GpuModel`) on a synthetic model of real size: writes the model,
//! compares the first tokens' logits with the CPU engine, then times decode.
//!
//! `cargo run --release -p spillway-bench --example vulkan_decode -- PRESET TYPE TOKENS [DIR]
//! [host-routing|one]` e.g. `llama-3.2-1b Q4_K_M 64 /tmp`; `host-routing` routes MoE layers on the
//! host (a read-back per layer) even with every expert in VRAM, to compare with the device's
//! routing; `one` times the first way only (a model too large for four copies in VRAM);
//! `q8weights=A,B,...` times models whose products of fewer weights than A (then B, ...) quantize
//! their inputs themselves (`GpuModelOptions::q8_min_weights`) besides. A model file already in
//! DIR is reused. Decode is timed three times each way, alternating: steps replayed from one recording,
//! steps recorded anew (`GpuModelOptions::replay`), and steps replayed with f32 dots for every
//! weight type (`GpuModelOptions::int_dot` off: Q4_0 and Q8_0 products without integer dot products),
//! and steps replayed with the integer-dot products quantizing their inputs in each workgroup
//! (`GpuModelOptions::q8_inputs` off) instead of once before them; the medians are printed.

use std::sync::Arc;
use std::time::Instant;

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::engine::{Engine, EngineOptions};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::{Device, Instance};
use spillway_daemon::model::Model;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let preset = args.first().map_or("llama-3.2-1b", String::as_str);
    let weights: WeightType = args
        .get(1)
        .map_or("Q4_K_M", String::as_str)
        .parse()
        .unwrap();
    let n_tokens: usize = args.get(2).map_or(64, |s| s.parse().unwrap());
    let dir = std::path::PathBuf::from(args.get(3).map_or("/tmp", String::as_str));
    let path = dir.join(format!("{preset}-synth.gguf"));
    if !path.exists() {
        SynthModel::from_name(preset, weights, 7)
            .unwrap()
            .write(&path, false, |_, _| {})
            .unwrap();
    }
    let model = Arc::new(Model::open(&path).unwrap());
    let device = Device::open(Instance::new().unwrap(), None).unwrap();
    let context = n_tokens + 8;
    let t0 = Instant::now();
    let options = GpuModelOptions {
        context,
        host_routing: args.get(4).is_some_and(|a| a == "host-routing"),
        ..GpuModelOptions::default()
    };
    let one = args.get(4).is_some_and(|a| a == "one");
    let mut gpu = GpuModel::new(&device, &model, &options).unwrap();
    let others = (!one).then(|| {
        let recorded = GpuModel::new(
            &device,
            &model,
            &GpuModelOptions {
                replay: false,
                ..options.clone()
            },
        )
        .unwrap();
        let float_dots = GpuModel::new(
            &device,
            &model,
            &GpuModelOptions {
                int_dot: false,
                ..options.clone()
            },
        )
        .unwrap();
        let in_product = GpuModel::new(
            &device,
            &model,
            &GpuModelOptions {
                q8_inputs: false,
                ..options.clone()
            },
        )
        .unwrap();
        (recorded, float_dots, in_product)
    });
    let budget = gpu.allocator().budget();
    println!(
        "{preset} {}: uploaded in {:.2} s, {:.0} MiB of device memory held, on {}, MoE routed on the {}, integer dots {}",
        args.get(1).map_or("Q4_K_M", String::as_str),
        t0.elapsed().as_secs_f64(),
        budget.held() as f64 / (1 << 20) as f64,
        device.info().name,
        if gpu.routes_on_device() { "device" } else { "host" },
        match (gpu.uses_int_dot(), device.integer_dot_product_accelerated()) {
            (false, _) => "off",
            (true, true) => "on (in hardware)",
            (true, false) => "on (emulated)",
        }
    );

    let mut cpu = Engine::new(
        model.clone(),
        &EngineOptions {
            context,
            ..EngineOptions::default()
        },
    );
    let tokens: Vec<u32> = (0..n_tokens as u32)
        .map(|i| (i * 7919 + 13) % 1000)
        .collect();
    for &t in &tokens[..3] {
        let want = cpu.eval(t).unwrap().to_vec();
        let got = gpu.eval(t).unwrap();
        let range = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("token {t}: max |gpu - cpu| {diff:.4} of {range:.4}");
    }
    let time = |gpu: &mut GpuModel| {
        gpu.reset();
        gpu.eval(tokens[0]).unwrap(); // the replay's recording, pipelines: not timed
        gpu.reset();
        let t0 = Instant::now();
        for &t in &tokens {
            gpu.eval(t).unwrap();
        }
        n_tokens as f64 / t0.elapsed().as_secs_f64()
    };
    let (mut replayed, mut anew, mut floats, mut apart) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let q8weights: Vec<usize> = args
        .iter()
        .find_map(|a| a.strip_prefix("q8weights="))
        .map(|m| m.split(',').map(|v| v.parse().unwrap()).collect())
        .unwrap_or_default();
    let mut by_weights: Vec<(usize, GpuModel, Vec<f64>)> = q8weights
        .iter()
        .map(|&w| {
            let o = GpuModelOptions {
                q8_min_weights: w,
                ..options.clone()
            };
            (w, GpuModel::new(&device, &model, &o).unwrap(), Vec::new())
        })
        .collect();
    let mut others = others;
    // One untimed pass first: a GPU that idled through the uploads and the CPU's tokens runs
    // the first timed pass at lower clocks (150-230 against 280-320 tok/s on an H100).
    time(&mut gpu);
    for _ in 0..3 {
        replayed.push(time(&mut gpu));
        for (_, g, runs) in by_weights.iter_mut() {
            runs.push(time(g));
        }
        if let Some((recorded, float_dots, in_product)) = others.as_mut() {
            anew.push(time(recorded));
            floats.push(time(float_dots));
            apart.push(time(in_product));
        }
    }
    println!("replayed runs: {replayed:.1?}");
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    for (w, g, runs) in by_weights.iter_mut() {
        let st = g.last_stats();
        println!(
            "products of fewer than {w} weights quantizing their own inputs: median {:.1} tok/s of {runs:.1?} ({} dispatches, {} barriers)",
            median(runs),
            st.dispatches,
            st.barriers
        );
    }
    let st = gpu.last_stats();
    println!(
        "decode: {n_tokens} tokens, median of 3: replayed {:.1} tok/s, recorded each step {:.1} tok/s, replayed with f32 dots {:.1} tok/s, replayed with inputs quantized in each product {:.1} tok/s ({} dispatches, {} barriers, {} submits per token)",
        median(&mut replayed),
        median(&mut anew),
        median(&mut floats),
        median(&mut apart),
        st.dispatches,
        st.barriers,
        st.submits
    );

    // Where a step's GPU time goes: timestamps around each op group (profiling records each
    // step anew, so its wall time is not the replay's).
    gpu.set_profiling(true).unwrap();
    gpu.reset();
    let mut sums: Vec<(&'static str, f64)> = Vec::new();
    let mut step_ms = 0.0;
    for &t in &tokens {
        gpu.eval(t).unwrap();
    }
    let p = gpu.last_profile().expect("profiling is on");
    for row in &p.rows {
        let ms = row.gpu_ns.unwrap_or(0) as f64 / 1e6;
        match sums.iter_mut().find(|(op, _)| *op == row.op) {
            Some((_, sum)) => *sum += ms,
            None => sums.push((row.op, ms)),
        }
    }
    step_ms += p.step_gpu_ns.unwrap_or(0) as f64 / 1e6;
    let parts: Vec<String> = sums
        .iter()
        .map(|(op, ms)| format!("{op} {ms:.3} ms"))
        .collect();
    println!(
        "GPU time of the step at position {}: {step_ms:.3} ms ({})",
        n_tokens - 1,
        parts.join(", ")
    );
}
