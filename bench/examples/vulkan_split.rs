//! Decode speed of a synthetic dense model over the VRAM budget: its first layers on the CPU,
//! the rest on the GPU (`gpu::cpu_layers`), for each budget given, beside the whole model on the
//! GPU and the CPU engine alone on the same threads, as a table.
//!
//! `cargo run --release -p spillway-bench --example vulkan_split -- PRESET TYPE TOKENS DIR
//! budgets=2048,4096 [threads=N] [ctx=N] [pp=N]` (`pp`: also time prompts of N tokens) e.g. `llama-3-8b Q4_0 64 /tmp budgets=2048` (the
//! offloading issue's `-ngl 16` row holds about 2 GiB of VRAM). Each figure is the median of
//! three runs of TOKENS decode steps after a 16-token prompt, the runs of every setting
//! interleaved. Each budget runs twice: with a VRAM slot for the CPU layers' prompt chunks
//! (`GpuModelOptions::stream_prompts`, the default) and without (`no-noslot` leaves that out).
//! `bus=m,0.6`: each budget also with the CPU's layers sharing their products' rows with the
//! GPU over the bus (`GpuModelOptions::bus_rows`), the CPU's share of each group of products
//! balanced as they run (`m`) or fixed (a number), the shares printed after. `budgets-only`: without the whole model and the CPU
//! engine alone. `warmup=N`: N untimed decode steps per model first (default 2). `single`:
//! the first budget's model alone in the process, decode only.

use std::sync::Arc;
use std::time::{Duration, Instant};

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::engine::{Engine, EngineOptions};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::{Device, Instance};
use spillway_daemon::model::Model;

const PROMPT: usize = 16;

enum Loaded {
    Gpu(Box<GpuModel>),
    Cpu(Engine),
}

struct Runner {
    model: Loaded,
    /// Per run: the CPU's layers' time per token, in ms, and the rest of a step's (GPU models
    /// only).
    cpu_ms: Vec<f64>,
    rest_ms: Vec<f64>,
}

impl Runner {
    fn new(model: Loaded) -> Runner {
        Runner {
            model,
            cpu_ms: Vec::new(),
            rest_ms: Vec::new(),
        }
    }

    /// Tokens/s of `tokens` decode steps after a prompt.
    fn time(&mut self, prompt: &[u32], tokens: &[u32]) -> f64 {
        match &mut self.model {
            Loaded::Gpu(g) => {
                g.reset();
                g.eval_prompt(prompt, false).unwrap();
                let t0 = Instant::now();
                let mut cpu = Duration::ZERO;
                for &t in tokens {
                    g.eval(t).unwrap();
                    cpu += g.last_cpu_layers_time().unwrap_or_default();
                }
                let secs = t0.elapsed().as_secs_f64();
                let n = tokens.len() as f64;
                self.cpu_ms.push(cpu.as_secs_f64() * 1e3 / n);
                self.rest_ms.push((secs - cpu.as_secs_f64()) * 1e3 / n);
                n / secs
            }
            Loaded::Cpu(e) => {
                e.reset();
                e.eval_batch(prompt, false).unwrap();
                let t0 = Instant::now();
                for &t in tokens {
                    e.eval(t).unwrap();
                }
                tokens.len() as f64 / t0.elapsed().as_secs_f64()
            }
        }
    }
}

fn prompt_for_single() -> Vec<u32> {
    (0..PROMPT as u32).map(|i| (i * 31 + 5) % 1000).collect()
}

fn single_tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + 13) % 1000).collect()
}

fn main() {
    let mut budgets: Vec<u64> = Vec::new();
    let mut threads = 0;
    let mut ctx = 0;
    let mut pp = 0;
    let mut single = false;
    let mut bus: Vec<Option<f32>> = Vec::new();
    let mut no_slot = true;
    let mut budgets_only = false;
    let mut warmup = 2;
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| {
            if let Some(list) = a.strip_prefix("budgets=") {
                budgets = list
                    .split(',')
                    .map(|m| m.parse::<u64>().unwrap() << 20)
                    .collect();
            } else if let Some(n) = a.strip_prefix("threads=") {
                threads = n.parse().unwrap();
            } else if a == "single" {
                single = true;
            } else if a == "no-noslot" {
                no_slot = false;
            } else if a == "budgets-only" {
                budgets_only = true;
            } else if let Some(n) = a.strip_prefix("warmup=") {
                warmup = n.parse().unwrap();
            } else if let Some(list) = a.strip_prefix("bus=") {
                bus = list
                    .split(',')
                    .map(|v| (v != "m").then(|| v.parse().unwrap()))
                    .collect();
            } else if let Some(n) = a.strip_prefix("pp=") {
                pp = n.parse().unwrap();
            } else if let Some(n) = a.strip_prefix("ctx=") {
                ctx = n.parse().unwrap();
            } else {
                return true;
            }
            false
        })
        .collect();
    let preset = args.first().map_or("llama-3.2-1b", String::as_str);
    let type_name = args.get(1).map_or("Q4_0", String::as_str);
    let weights: WeightType = type_name.parse().unwrap();
    let n_tokens: usize = args.get(2).map_or(64, |s| s.parse().unwrap());
    let dir = std::path::PathBuf::from(args.get(3).map_or("/tmp", String::as_str));
    let path = dir.join(format!("{preset}-{type_name}-synth.gguf"));
    if !path.exists() {
        SynthModel::from_name(preset, weights, 7)
            .unwrap()
            .write(&path, false, |_, _| {})
            .unwrap();
    }
    let model = Arc::new(Model::open(&path).unwrap());
    assert!(model.config.moe.is_none(), "{preset} is not a dense model");
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let context = match ctx {
        0 => PROMPT + n_tokens + 8,
        n => n,
    };
    let device = Device::open(Instance::new().unwrap(), None).unwrap();
    let options = |budget| GpuModelOptions {
        vram_budget: budget,
        context,
        threads,
        ..GpuModelOptions::default()
    };
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let whole = GpuModel::device_bytes(&model, &options(None)).total();
    println!(
        "{preset} {type_name}: {:.0} MiB on the device whole, {} layers, context {context}, {threads} CPU threads, {}",
        mib(whole),
        model.config.n_layer,
        device.info().name
    );

    let mut runs: Vec<(String, usize, f64, Runner)> = Vec::new();
    // (prompt slot, rows over the bus: the CPU's share, `None` measured)
    let mut variants: Vec<(bool, Option<Option<f32>>)> = vec![(true, None)];
    if !single && no_slot {
        variants.push((false, None));
    }
    variants.extend(bus.iter().map(|&b| (true, Some(b))));
    for (&b, &(stream, bus)) in budgets
        .iter()
        .flat_map(|b| variants.iter().map(move |v| (b, v)))
    {
        let opts = GpuModelOptions {
            stream_prompts: stream,
            bus_rows: bus.is_some(),
            split_cpu_share: bus.flatten(),
            ..options(Some(b))
        };
        match GpuModel::new(&device, &model, &opts) {
            Ok(g) if !stream && g.cpu_layers() == 0 => drop(g),
            Ok(g) => {
                let held = mib(g.allocator().budget().held());
                let cpu = g.cpu_layers();
                let how = match bus {
                    _ if !stream => ", no prompt slot".to_string(),
                    Some(Some(x)) => format!(", bus rows at {x}"),
                    Some(None) => ", bus rows measured".to_string(),
                    None => String::new(),
                };
                runs.push((
                    format!("{:.0} MiB{how}", mib(b)),
                    cpu,
                    held,
                    Runner::new(Loaded::Gpu(Box::new(g))),
                ));
            }
            Err(e) => println!("budget {:.0} MiB: {e}", mib(b)),
        }
    }
    if single {
        // One model in the process: nothing else holds the device's memory or the CPU.
        let (name, cpu, _, r) = &mut runs[0];
        let mut t: Vec<f64> = (0..3)
            .map(|_| r.time(&prompt_for_single(), &single_tokens(n_tokens)))
            .collect();
        t.sort_by(f64::total_cmp);
        r.cpu_ms.sort_by(f64::total_cmp);
        r.rest_ms.sort_by(f64::total_cmp);
        println!(
            "single model {name}: {cpu} layers on the CPU, decode {:.2} tok/s (median of 3), CPU layers {:.2} ms, rest {:.2} ms a token",
            t[1], r.cpu_ms[1], r.rest_ms[1]
        );
        return;
    }
    let budgets_run = runs.len();
    let n_layer = model.config.n_layer;
    if !budgets_only {
        let g = GpuModel::new(&device, &model, &options(None)).unwrap();
        let held = mib(g.allocator().budget().held());
        runs.push((
            "none (whole model)".into(),
            0,
            held,
            Runner::new(Loaded::Gpu(Box::new(g))),
        ));
        let engine = Engine::new(model.clone(), &EngineOptions { threads, context });
        runs.push((
            "CPU engine alone".into(),
            n_layer,
            0.0,
            Runner::new(Loaded::Cpu(engine)),
        ));
    }

    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 31 + 5) % 1000).collect();
    let tokens: Vec<u32> = (0..n_tokens as u32)
        .map(|i| (i * 7919 + 13) % 1000)
        .collect();
    // Pipelines, the replay's recording and the page cache: not timed.
    for (_, _, _, r) in runs.iter_mut() {
        r.time(&prompt, &tokens[..warmup.min(tokens.len())]);
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); runs.len()];
    for _ in 0..3 {
        for (i, (_, _, _, r)) in runs.iter_mut().enumerate() {
            times[i].push(r.time(&prompt, &tokens));
        }
    }
    // Prompts of `pp` tokens (a model over the budget with `stream_prompts` takes its CPU
    // layers through the slot on the GPU).
    if pp > 0 {
        let long: Vec<u32> = (0..pp as u32).map(|i| (i * 7919 + 13) % 1000).collect();
        println!("| VRAM budget | layers on the CPU | prompt slot | prompt of {pp} tok/s (median of 3) | runs |");
        println!("| --- | ---: | --- | ---: | --- |");
        for (name, cpu, _, r) in runs.iter_mut() {
            let mut t: Vec<f64> = (0..3)
                .map(|_| {
                    let t0 = Instant::now();
                    match &mut r.model {
                        Loaded::Gpu(g) => {
                            g.reset();
                            g.eval_prompt(&long, false).unwrap();
                        }
                        Loaded::Cpu(e) => {
                            e.reset();
                            e.eval_batch(&long, false).unwrap();
                        }
                    }
                    pp as f64 / t0.elapsed().as_secs_f64()
                })
                .collect();
            let runs: Vec<String> = t.iter().map(|v| format!("{v:.1}")).collect();
            t.sort_by(f64::total_cmp);
            let slot = match &r.model {
                Loaded::Gpu(g) => g.streams_prompts().to_string(),
                Loaded::Cpu(_) => "-".into(),
            };
            println!(
                "| {name} | {cpu} | {slot} | {:.1} | {} |",
                t[1],
                runs.join(", ")
            );
        }
    }
    println!("| VRAM budget | layers on the CPU | VRAM held MiB | decode tok/s (median of 3) | CPU layers ms/token | rest of a step ms | runs |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | --- |");
    for ((name, cpu, held, r), t) in runs.iter_mut().zip(&mut times) {
        let runs: Vec<String> = t.iter().map(|v| format!("{v:.2}")).collect();
        t.sort_by(f64::total_cmp);
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2)
                .map_or("-".into(), |ms| format!("{ms:.2}"))
        };
        let (cpu_ms, rest_ms) = match r.model {
            Loaded::Gpu(_) => (median(&mut r.cpu_ms), median(&mut r.rest_ms)),
            Loaded::Cpu(_) => ("-".into(), "-".into()),
        };
        println!(
            "| {name} | {cpu} of {n_layer} | {held:.0} | {:.2} | {cpu_ms} | {rest_ms} | {} |",
            t[1],
            runs.join(", ")
        );
    }
    for (name, _, _, r) in &runs {
        if let Loaded::Gpu(g) = &r.model {
            if let Some(shares) = g.bus_rows_cpu_shares() {
                let shares: Vec<String> = shares
                    .iter()
                    .map(|(group, s)| format!("{group:?} {s:.3}"))
                    .collect();
                println!(
                    "{name}: the CPU's shares of the rows: {}",
                    shares.join(", ")
                );
            }
        }
    }

    // The device's time of each GPU model's step (timestamps; profiling records steps anew).
    println!("| VRAM budget | step GPU ms (timestamps) | step wall ms, profiled | CPU layers ms |");
    println!("| --- | ---: | ---: | ---: |");
    for (name, _, _, r) in runs.iter_mut() {
        let Loaded::Gpu(g) = &mut r.model else {
            continue;
        };
        g.set_profiling(true).unwrap();
        g.reset();
        g.eval_prompt(&prompt, false).unwrap();
        let (mut gpu_ms, mut wall, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
        for &t in &tokens[..8] {
            let t0 = Instant::now();
            g.eval(t).unwrap();
            wall.push(t0.elapsed().as_secs_f64() * 1e3);
            let p = g.last_profile().expect("profiling");
            gpu_ms.push(p.step_gpu_ns.unwrap_or(0) as f64 / 1e6);
            cpu.push(g.last_cpu_layers_time().unwrap_or_default().as_secs_f64() * 1e3);
        }
        let p = g.last_profile().expect("profiling");
        let rows: Vec<String> = p
            .rows
            .iter()
            .map(|r| {
                let ms = r.gpu_ns.unwrap_or(0) as f64 / 1e6;
                match r.layer {
                    Some(l) => format!("{l}.{} {ms:.3}", r.op),
                    None => format!("{} {ms:.3}", r.op),
                }
            })
            .collect();
        println!("last step, {name}: {}", rows.join(", "));
        g.set_profiling(false).unwrap();
        for v in [&mut gpu_ms, &mut wall, &mut cpu] {
            v.sort_by(f64::total_cmp);
        }
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} |",
            gpu_ms[4], wall[4], cpu[4]
        );
    }

    // A step of the whole model after the host has kept the device idle for a while (as the
    // CPU's layers do): its wall time and its GPU time (timestamps).
    if budgets_only {
        return;
    }
    let Loaded::Gpu(whole) = &mut runs[budgets_run].3.model else {
        unreachable!("the whole model's runner")
    };
    println!("| device idle before the step | step wall ms | step GPU ms (timestamps) |");
    println!("| ---: | ---: | ---: |");
    for gap_ms in [0u64, 2, 5, 10, 20, 40] {
        let (mut wall, mut gpu_ms) = (Vec::new(), Vec::new());
        for profiled in [false, true] {
            whole.set_profiling(profiled).unwrap();
            whole.reset();
            whole.eval_prompt(&prompt, false).unwrap();
            for &t in &tokens[..8] {
                let spin = Instant::now();
                while spin.elapsed() < Duration::from_millis(gap_ms) {
                    std::hint::spin_loop();
                }
                let t0 = Instant::now();
                whole.eval(t).unwrap();
                if profiled {
                    let p = whole.last_profile().expect("profiling");
                    gpu_ms.push(p.step_gpu_ns.unwrap_or(0) as f64 / 1e6);
                } else {
                    wall.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        whole.set_profiling(false).unwrap();
        wall.sort_by(f64::total_cmp);
        gpu_ms.sort_by(f64::total_cmp);
        println!("| {gap_ms} ms | {:.2} | {:.2} |", wall[4], gpu_ms[4]);
    }
}
