//! Decode steps of several sequences at once on the GPU (`GpuModel::eval_batch`): aggregate
//! tokens/s of 1, 2, 4, 8 ... sequences decoding together, one model, on a synthetic model of
//! real size, optionally under a VRAM budget.
//!
//! `cargo run --release -p spillway-bench --example vulkan_decode_batch -- PRESET TYPE
//! [budget=MiB] [miss=cpu|pcie|fetch|auto] [batches=1,2,4,8] [steps=32] [model=PATH]
//! [cols=N] [replay=0|1] [chain=0|1] [q8=0|1] [batching=always|measured] [moe=entry|grouped] [ctx=N]`, e.g.
//! `qwen3-30b-a3b Q4_0 budget=8192 miss=pcie`; `ctx=N` gives each sequence N positions (the
//! daemon's default is 4096; default here: just what the run takes); `cols=0` multiplies
//! a batched step in the tiled kernels instead of the several-column one
//! (`GpuModelOptions::matvec_cols`); `replay=0` records every step anew
//! (`GpuModelOptions::replay`); `chain=0` submits a step with experts on the CPU a part at a
//! time instead of as one chain (`GpuModelOptions::chain`); `q8=0` has the integer-dot products quantize their inputs in
//! each workgroup (`GpuModelOptions::q8_inputs`); `batching=measured` runs each step batched or
//! a sequence at a time, whichever the model has measured cheaper, as the daemon does
//! (`GpuModelOptions::step_batching`; the default here is `always`); `moe=grouped` runs a
//! batched step's MoE layers laid out by expert as a prompt chunk's, not by entry
//! (`GpuModelOptions::moe_by_entry`). Each sequence first takes a prompt of 16 tokens;
//! then `steps` steps are timed, three times, and the median is printed. One sequence steps
//! through the replayed decode step (`GpuModel::eval`); several through one chunk a step. Then
//! one step of the most sequences is profiled (GPU time by op group, and the host's).
//! Without `model=` the synthetic model is written to /tmp from seed 7.

use std::sync::Arc;
use std::time::Instant;

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions, StepBatching};
use spillway_daemon::gpu::placement::MoeMiss;
use spillway_daemon::gpu::{Device, Instance};
use spillway_daemon::model::Model;

fn arg<'a>(args: &'a [String], key: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let preset = args.first().map_or("llama-3.2-1b", String::as_str);
    let weights = args.get(1).map_or("Q4_0", String::as_str);
    let batches: Vec<usize> = arg(&args, "batches")
        .unwrap_or("1,2,4,8")
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    let steps: usize = arg(&args, "steps").map_or(32, |s| s.parse().unwrap());
    let budget = arg(&args, "budget").map(|s| s.parse::<u64>().unwrap() << 20);
    let miss: MoeMiss = arg(&args, "miss").unwrap_or("auto").parse().unwrap();
    let path = match arg(&args, "model") {
        Some(p) => std::path::PathBuf::from(p),
        None => {
            let p = std::path::PathBuf::from(format!("/tmp/{preset}-{weights}-synth.gguf"));
            let t = weights.parse::<WeightType>().unwrap();
            SynthModel::from_name(preset, t, 7)
                .unwrap()
                .write(&p, false, |_, _| {})
                .unwrap();
            p
        }
    };
    let model = Arc::new(Model::open(&path).unwrap());
    let device = Device::open(Instance::new().unwrap(), None).unwrap();
    let most = *batches.iter().max().unwrap();
    let prompt = 16;
    let options = GpuModelOptions {
        context: arg(&args, "ctx").map_or(prompt + 4 * steps + 8, |s| s.parse().unwrap()),
        vram_budget: budget,
        moe_miss: miss,
        sequences: most,
        matvec_cols: arg(&args, "cols").map_or(8, |s| s.parse().unwrap()),
        replay: arg(&args, "replay") != Some("0"),
        chain: arg(&args, "chain") != Some("0"),
        q8_inputs: arg(&args, "q8") != Some("0"),
        step_batching: arg(&args, "batching").map_or(StepBatching::Always, |s| s.parse().unwrap()),
        moe_by_entry: arg(&args, "moe") != Some("grouped"),
        ..GpuModelOptions::default()
    };
    let t0 = Instant::now();
    let mut gpu = GpuModel::new(&device, &model, &options).unwrap();
    let p = gpu.placement();
    println!(
        "{preset} {weights}: loaded in {:.1} s on {}, {:.0} MiB held, {} of {} experts a layer \
         in VRAM, {} sequences",
        t0.elapsed().as_secs_f64(),
        device.info().name,
        gpu.allocator().budget().held() as f64 / (1 << 20) as f64,
        p.slots,
        p.n_expert,
        gpu.sequences(),
    );
    let n_vocab = model.config.n_vocab as u64;
    let token =
        |s: usize, i: usize| ((s as u64 * 7919 + i as u64 * 2_654_435_761) % n_vocab) as u32;
    let mut rows = Vec::new();
    for &b in &batches {
        let b = b.min(gpu.sequences());
        let mut runs = Vec::new();
        let mut batched = 0;
        for _ in 0..3 {
            for s in 0..b {
                gpu.select(s);
                gpu.reset();
                let p: Vec<u32> = (0..prompt).map(|i| token(s, i)).collect();
                gpu.eval_prompt(&p, false).unwrap();
            }
            let before = gpu.batched_steps();
            let t = Instant::now();
            for i in 0..steps {
                let inputs: Vec<(usize, u32)> = (0..b).map(|s| (s, token(s, 100 + i))).collect();
                let logits = gpu.eval_batch(&inputs).unwrap();
                assert_eq!(logits.len() as u64, b as u64 * n_vocab);
            }
            runs.push(t.elapsed().as_secs_f64());
            batched += gpu.batched_steps() - before;
            if b > 1 && options.step_batching == StepBatching::Always {
                assert_eq!(
                    gpu.batched_steps() - before,
                    steps as u64,
                    "steps went one by one"
                );
            }
        }
        runs.sort_by(f64::total_cmp);
        let s = runs[1];
        let stats = gpu.expert_stats().map(|e| e.total());
        rows.push((b, s, stats));
        // The host's side of the last step, where it had turns in it (experts on the CPU).
        let host = gpu.last_host_time().map_or(String::new(), |h| {
            format!(
                "; last step's host: {:.2} ms, waiting {:.2}, CPU experts {:.2}",
                h.step_ns as f64 / 1e6,
                h.wait_ns as f64 / 1e6,
                h.cpu_experts_ns as f64 / 1e6
            )
        });
        println!(
            "  {b} sequences: {:.2} ms a step, {:.1} tok/s together (runs {:?} s), {batched} of \
             {} steps batched ({} chained){host}",
            1e3 * s / steps as f64,
            (b * steps) as f64 / s,
            runs.iter()
                .map(|r| (r * 1e3).round() / 1e3)
                .collect::<Vec<_>>(),
            3 * steps,
            gpu.chained_batches(),
        );
    }
    // One more step of the most sequences, profiled: where a batched step's time goes.
    let b = most.min(gpu.sequences());
    if b > 1 {
        gpu.set_profiling(true).unwrap();
        let inputs: Vec<(usize, u32)> = (0..b).map(|s| (s, token(s, 7))).collect();
        gpu.eval_batch(&inputs).unwrap();
        let st = gpu.last_stats();
        let p = gpu.last_profile().expect("profiling");
        println!(
            "a step of {b} sequences, profiled ({} dispatches, {} barriers, {} submissions): {}",
            st.dispatches,
            st.barriers,
            st.submits,
            spillway_bench::prompt_profile::summary(p)
        );
        gpu.set_profiling(false).unwrap();
    }
    println!("\n| sequences | ms a step | aggregate tok/s | against one |");
    println!("| ---: | ---: | ---: | ---: |");
    let one = rows.iter().find(|r| r.0 == 1).map(|r| steps as f64 / r.1);
    for (b, s, _) in &rows {
        let tps = (b * steps) as f64 / s;
        let ratio = one.map_or(String::from("—"), |o| format!("{:.2}×", tps / o));
        println!(
            "| {b} | {:.2} | {:.1} | {ratio} |",
            1e3 * s / steps as f64,
            tps
        );
    }
}
