//! Decode speed of a synthetic MoE model with only some routed experts in VRAM: for budgets
//! from the smallest that runs the model to its whole size, and for misses computed on the CPU
//! and fetched into VRAM slots, tokens/s and where the experts ran, as a table.
//!
//! `cargo run --release -p spillway-bench --example vulkan_offload -- PRESET TYPE TOKENS [DIR]`
//! e.g. `small-qwen3moe Q4_K_M 32 /tmp` (0.8 B parameters, about 0.5 GB written once and
//! reused) or `qwen3-30b-a3b Q4_K_M 32 /data` (about 17 GB of real weights: the disk and RAM
//! must hold it). Budgets are the minimum, then a quarter, half and three quarters of the way
//! to the whole model, the whole model's bytes, and no budget; or, with `budgets=8192,1024`,
//! those budgets in MiB (`no-whole` leaves out the run with no budget). `modes=cpu` (or
//! `fetch`) runs one miss mode only; `cpu-separate` is `cpu` with a step as separate submissions instead of one chain (`GpuModelOptions::chain`);
//! `cpu-record` is `cpu` with a step that is one submission recorded anew for every token
//! instead of replayed (`GpuModelOptions::replay`).
//! `cpu-noslot` is `cpu` without VRAM slots for a prompt's missing experts
//! (`GpuModelOptions::stream_prompts`: its prompts go token by token); `cpu-static` is `cpu`
//! with slots that keep the experts they were loaded with (`GpuModelOptions::promote_experts`
//! off). `pcie` reads the misses on the GPU from a copy of every expert in system RAM
//! (`MoeMiss::Pcie`); `pcie-static` is that without promotions; `auto` is the default policy,
//! shown as what it resolved to (`auto:pcie` or `auto:cpu`); `split` shares each layer's misses
//! between the CPU and the bus (`MoeMiss::Split`), printing the CPU's share it settled at
//! (`share=X` fixes it at X for every `split` mode, `GpuModelOptions::split_cpu_share`;
//! `split@X` is `split` at X, so that several shares compare in one process);
//! `cpu-ev` and `split-ev` are `cpu` and `split` with chains handed over by events
//! (`GpuModelOptions::handoff`).
//! `warmup=N` decodes N tokens before the clock starts (default 2; promotions ramp up over the
//! first tokens). `threads=N` sets the CPU experts' threads (default: every core); `ram=MiB` gives the CPU's
//! experts a RAM budget (a cache read from the file) in place of the memory map; `pp=N` times
//! a prompt of N tokens from position 0 first (after a warm-up prompt as long), in the
//! `pp tok/s` column,
//! then another, profiled (its last chunk's GPU time by op, and the host's);
//! `tile=DEPTHxROWSxTOKENS` gives every prompt product that tile (`GpuModelOptions::matmul_tile`);
//! `host-routing` routes every MoE layer on the host, prompt chunks' included
//! (`GpuModelOptions::host_routing`).

use std::sync::Arc;
use std::time::Instant;

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::gpu::chain::Handoff;
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::placement::MoeMiss;
use spillway_daemon::gpu::{Device, Instance, MatMulTile};
use spillway_daemon::model::Model;

/// Steps before the clock starts (pipelines are created on first use), unless `warmup=N`.
const WARMUP: usize = 2;

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn main() {
    let mut given_budgets: Option<Vec<u64>> = None;
    let mut modes = vec![
        (MoeMiss::Cpu, true, true, true, true, false, None),
        (MoeMiss::Fetch, true, true, true, true, false, None),
    ];
    let mut threads = 0;
    let mut pp = 0;
    let mut matmul_tile = None;
    let mut warmup = WARMUP;
    let mut ram_budget = None;
    let mut host_routing = false;
    let mut whole_model = true;
    let mut split_share = None;
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| {
            if a == "host-routing" {
                host_routing = true;
                false
            } else if a == "no-whole" {
                whole_model = false;
                false
            } else if let Some(list) = a.strip_prefix("budgets=") {
                given_budgets = Some(
                    list.split(',')
                        .map(|m| m.parse::<u64>().unwrap() << 20)
                        .collect(),
                );
                false
            } else if let Some(x) = a.strip_prefix("share=") {
                split_share = Some(x.parse::<f32>().unwrap());
                false
            } else if let Some(n) = a.strip_prefix("ram=") {
                ram_budget = Some(n.parse::<u64>().unwrap() << 20);
                false
            } else if let Some(n) = a.strip_prefix("threads=") {
                threads = n.parse().unwrap();
                false
            } else if let Some(n) = a.strip_prefix("warmup=") {
                warmup = n.parse().unwrap();
                false
            } else if let Some(n) = a.strip_prefix("pp=") {
                pp = n.parse().unwrap();
                false
            } else if let Some(t) = a.strip_prefix("tile=") {
                let v: Vec<u32> = t.split('x').map(|n| n.parse().unwrap()).collect();
                matmul_tile = Some(MatMulTile {
                    depth: v[0],
                    rows: v[1],
                    tokens: v[2],
                });
                false
            } else if let Some(m) = a.strip_prefix("modes=") {
                modes = m
                    .split(',')
                    .map(|m| match m {
                        _ if m.starts_with("split@") => {
                            let x: f32 = m["split@".len()..].parse().unwrap();
                            (MoeMiss::Split, true, true, true, true, false, Some(x))
                        }
                        _ if m.starts_with("split-record@") => {
                            let x: f32 = m["split-record@".len()..].parse().unwrap();
                            (MoeMiss::Split, true, false, true, true, false, Some(x))
                        }
                        "cpu" => (MoeMiss::Cpu, true, true, true, true, false, None),
                        "cpu-ev" => (MoeMiss::Cpu, true, true, true, true, true, None),
                        "cpu-separate" => (MoeMiss::Cpu, false, true, true, true, false, None),
                        "cpu-record" => (MoeMiss::Cpu, true, false, true, true, false, None),
                        "cpu-noslot" => (MoeMiss::Cpu, true, true, false, true, false, None),
                        "cpu-static" => (MoeMiss::Cpu, true, true, true, false, false, None),
                        "fetch" => (MoeMiss::Fetch, true, true, true, true, false, None),
                        "pcie" => (MoeMiss::Pcie, true, true, true, true, false, None),
                        "pcie-static" => (MoeMiss::Pcie, true, true, true, false, false, None),
                        "split" => (MoeMiss::Split, true, true, true, true, false, None),
                        "split-ev" => (MoeMiss::Split, true, true, true, true, true, None),
                        "auto" => (MoeMiss::Auto, true, true, true, true, false, None),
                        other => panic!(
                            "modes={other}: auto, cpu, cpu-ev, cpu-separate, cpu-record, \
                             cpu-noslot, cpu-static, fetch, pcie, pcie-static, split, split@X, \
                             split-record@X or split-ev"
                        ),
                    })
                    .collect();
                false
            } else {
                true
            }
        })
        .collect();
    let preset = args.first().map_or("small-qwen3moe", String::as_str);
    let type_name = args.get(1).map_or("Q4_K_M", String::as_str);
    let weights: WeightType = type_name.parse().unwrap();
    let n_tokens: usize = args.get(2).map_or(32, |s| s.parse().unwrap());
    let dir = std::path::PathBuf::from(args.get(3).map_or("/tmp", String::as_str));
    let path = dir.join(format!("{preset}-{type_name}-synth.gguf"));
    if !path.exists() {
        let t0 = Instant::now();
        SynthModel::from_name(preset, weights, 7)
            .unwrap()
            .write(&path, false, |_, _| {})
            .unwrap();
        println!(
            "wrote {} in {:.1} s",
            path.display(),
            t0.elapsed().as_secs_f64()
        );
    }
    let model = Arc::new(Model::open(&path).unwrap());
    assert!(model.config.moe.is_some(), "{preset} is not a MoE model");
    let device = Device::open(Instance::new().unwrap(), None).unwrap();
    let base = GpuModelOptions {
        context: n_tokens + warmup + 1 + if pp > 0 { pp } else { 0 },
        threads,
        ram_budget,
        matmul_tile,
        host_routing,
        ..GpuModelOptions::default()
    };
    let whole = GpuModel::device_bytes(&model, &base).total();
    let minimum = GpuModel::minimum_budget(&device, &model, &base)
        .unwrap()
        .total();
    println!(
        "{preset} {type_name} on {}: {:.1} MiB whole, {:.1} MiB at least; {n_tokens} tokens",
        device.info().name,
        mib(whole),
        mib(minimum)
    );
    let mut budgets: Vec<Option<u64>> = match given_budgets {
        Some(list) => list.into_iter().map(Some).collect(),
        None => [0, 1, 2, 3, 4]
            .iter()
            .map(|q| Some(minimum + (whole - minimum) * q / 4))
            .collect(),
    };
    if whole_model {
        budgets.push(None);
    }

    println!(
        "{:>10} {:>7} {:>9} {:>9} {:>8} {:>7} {:>9} {:>9} {:>9} {:>9} {:>11} {:>11} {:>10} {:>11} {:>13} {:>13}",
        "budget",
        "slots",
        "miss",
        "pp tok/s",
        "tok/s",
        "hits",
        "cpu/tok",
        "fetch/tok",
        "pcie/tok",
        "prom/tok",
        "MiB up/tok",
        "wait ms/tok",
        "cpu ms/tok",
        "prom ms/tok",
        "staging share",
        "submit ms/tok"
    );
    let tokens: Vec<u32> = (0..(n_tokens + warmup) as u32)
        .map(|i| (i * 7919 + 13) % 1000)
        .collect();
    for budget in budgets {
        for &(miss, chain, replay, stream_prompts, promote, events, share) in &modes {
            let options = GpuModelOptions {
                vram_budget: budget,
                moe_miss: miss,
                chain,
                handoff: if events {
                    Handoff::Events
                } else {
                    base.handoff
                },
                replay,
                stream_prompts,
                promote_experts: promote,
                split_cpu_share: share.or(split_share),
                ..base.clone()
            };
            let mode = match (miss, chain, replay, stream_prompts, promote) {
                _ if events => format!("{miss}-ev"),
                _ if share.is_some() && !replay => format!("split-rec@{}", share.unwrap_or(0.0)),
                _ if share.is_some() => format!("split@{}", share.unwrap_or(0.0)),
                (MoeMiss::Cpu, false, ..) => "cpu-sep".to_string(),
                (MoeMiss::Cpu, true, false, ..) => "cpu-rec".to_string(),
                (MoeMiss::Cpu, true, true, false, _) => "cpu-nos".to_string(),
                (MoeMiss::Cpu, true, true, true, false) => "cpu-sta".to_string(),
                (MoeMiss::Pcie, true, true, true, false) => "pcie-sta".to_string(),
                (MoeMiss::Auto, ..) => "auto".to_string(),
                _ => miss.to_string(),
            };
            let mut gpu = match GpuModel::new(&device, &model, &options) {
                Ok(g) => g,
                Err(e) => {
                    println!("{budget:?} {mode}: {e}");
                    continue;
                }
            };
            let mut pp_rate = f64::NAN;
            if pp > 0 {
                let prompt = |n: usize, k: u32| -> Vec<u32> {
                    (0..n as u32).map(|i| (i * 31 + k) % 1000).collect()
                };
                // A warm-up prompt of the same length (the chunk's buffers are made for it).
                gpu.eval_prompt(&prompt(pp, 5), false).unwrap();
                // From position 0, as llama-bench's pp.
                gpu.reset();
                let t0 = Instant::now();
                gpu.eval_prompt(&prompt(pp, 11), false).unwrap();
                pp_rate = pp as f64 / t0.elapsed().as_secs_f64();
                // The same prompt again, profiled: where its last chunk's time went.
                gpu.set_profiling(true).unwrap();
                gpu.reset();
                gpu.eval_prompt(&prompt(pp, 13), false).unwrap();
                if let Some(p) = gpu.last_profile() {
                    println!(
                        "{budget:?} {mode}: {}",
                        spillway_bench::prompt_profile::summary(p)
                    );
                }
                gpu.set_profiling(false).unwrap();
            }
            for &t in &tokens[..warmup] {
                gpu.eval(t).unwrap();
            }
            let before = gpu.expert_stats().unwrap().total();
            let promoting = gpu.promotion_time();
            let (mut wait, mut cpu, mut submit) = (0u64, 0u64, 0u64);
            let t0 = Instant::now();
            for &t in &tokens[warmup..] {
                gpu.eval(t).unwrap();
                if let Some(h) = gpu.last_host_time() {
                    wait += h.wait_ns;
                    cpu += h.cpu_experts_ns;
                    submit += h.submit_ns;
                }
            }
            let s = t0.elapsed().as_secs_f64();
            if let Some((layers, held)) = gpu.ram_tier() {
                let (h, m) = layers
                    .iter()
                    .fold((0, 0), |(h, m), l| (h + l.hits, m + l.misses));
                println!(
                    "RAM tier: {:.0} MiB, {h} hits, {m} misses read from the file ({:.1}% hits)",
                    mib(held),
                    100.0 * h as f64 / (h + m).max(1) as f64
                );
            }
            let stats = gpu.expert_stats().unwrap();
            let after = stats.total();
            let mode = match miss {
                MoeMiss::Auto => format!("auto:{}", stats.miss),
                _ => mode,
            };
            let promoted = gpu.promotion_time();
            let per_tok = |a: u64, b: u64| (a - b) as f64 / n_tokens as f64;
            let lookups = (after.hits + after.misses) - (before.hits + before.misses);
            println!(
                "{:>10} {:>7} {:>9} {:>9.1} {:>8.2} {:>6.1}% {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>11.2} {:>11.2} {:>10.2} {:>11.2} {:>12.0}% {:>13.2}",
                budget.map_or("none".into(), |b| format!("{:.1}M", mib(b))),
                format!("{}/{}", stats.slots, stats.n_expert),
                mode,
                pp_rate,
                n_tokens as f64 / s,
                100.0 * (after.hits - before.hits) as f64 / lookups.max(1) as f64,
                per_tok(after.cpu, before.cpu),
                per_tok(after.fetched, before.fetched),
                per_tok(after.pcie, before.pcie),
                per_tok(after.promoted, before.promoted),
                mib(after.bytes_uploaded - before.bytes_uploaded) / n_tokens as f64,
                wait as f64 / 1e6 / n_tokens as f64,
                cpu as f64 / 1e6 / n_tokens as f64,
                (promoted.total() - promoting.total()).as_secs_f64() * 1e3 / n_tokens as f64,
                100.0 * (promoted.staging - promoting.staging).as_secs_f64()
                    / (promoted.total() - promoting.total()).as_secs_f64().max(1e-9),
                submit as f64 / 1e6 / n_tokens as f64,
            );
            if let Some(share) = gpu.split_cpu_share() {
                println!("{mode}: the CPU's share of the misses settled at {share:.2}");
            }
        }
    }
}
