//! `spillway-bench`: benchmark harness commands and the synthetic model generator.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};
use spillway_bench::demo;
use spillway_bench::progress::Progress;
use spillway_bench::synth::{model, SynthModel, WeightType, PRESETS};
use spillway_daemon::gguf::inspect::{human_bytes, human_count};

#[derive(Parser)]
#[command(
    version,
    about = "Spillway benchmark harness and synthetic model generator"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a random-weight GGUF model shaped like a real one.
    Synth {
        /// Preset name (see `presets`).
        #[arg(long)]
        preset: String,
        /// Weight type: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K or the Q4_K_M mix.
        #[arg(long = "type", default_value = "Q4_K_M")]
        weights: WeightType,
        /// Seed of the weights and of the vocabulary fill; same seed, same file.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Leave weight matrices as holes (zeros, no disk space).
        #[arg(long)]
        sparse: bool,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// List the model presets.
    Presets,
    /// Write a tiny synthetic MoE model, validate and describe it, and check its weights on the
    /// Vulkan device against the CPU.
    Demo {
        /// Where to write the model.
        #[arg(short, long, default_value = "models/tiny-qwen3moe-q8_0.gguf")]
        output: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Synth {
            preset,
            weights,
            seed,
            sparse,
            output,
        } => synth(&preset, weights, seed, sparse, &output),
        Command::Presets => {
            presets();
            Ok(())
        }
        Command::Demo { output } => demo(&output),
    }
}

fn synth(
    preset: &str,
    weights: WeightType,
    seed: u64,
    sparse: bool,
    output: &PathBuf,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let model = SynthModel::from_name(preset, weights, seed)?;
    let (params, _) = model.totals();
    let mut progress = Progress::new(format!("{preset} {weights}"), model.bytes_to_write(sparse));
    let size = model
        .write(output, sparse, |done, total| progress.update(done, total))
        .with_context(|| format!("writing {}", output.display()))?;
    progress.finish();
    for note in &model.notes {
        eprintln!("note: {note}");
    }
    let types: Vec<String> = model::type_counts(&model.tensors)
        .iter()
        .map(|(t, n)| format!("{t}×{n}"))
        .collect();
    println!(
        "wrote {} ({}{}): preset {preset}, type {weights}, seed {seed}, {} parameters, \
         {} tensors [{}] in {:.1}s",
        output.display(),
        human_bytes(size),
        if sparse { ", sparse" } else { "" },
        human_count(params),
        model.tensors.len(),
        types.join(" "),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

fn demo(output: &std::path::Path) -> anyhow::Result<()> {
    if let Some(dir) = output.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let file = demo::write_and_describe("tiny-qwen3moe", output)?;
    match demo::dequantize_on_gpu(&file) {
        Ok(check) => println!(
            "vulkan: {} Q8_0 tensors ({} values) dequantized on {}: identical to the CPU",
            check.tensors,
            human_count(check.values),
            check.device
        ),
        Err(demo::DemoError::Gpu(e)) => println!("vulkan: not available ({e}); CPU only"),
        Err(e) => return Err(e.into()),
    }
    let prompt = "In the beginning";
    print!("cpu engine, greedy, random weights: {prompt}");
    demo::generate_text(output, prompt, 24)?;
    println!();
    Ok(())
}

fn presets() {
    println!(
        "{:<16} {:<9} {:>6} {:>6} {:>8} {:>8} {:>9} {:>10}  summary",
        "preset", "arch", "layers", "embd", "experts", "vocab", "params", "Q4_K_M"
    );
    for p in PRESETS {
        let (tensors, _) = model::tensors(p, WeightType::Q4KM);
        let (params, bytes) = model::totals(&tensors);
        let experts = p
            .experts
            .map_or("-".to_string(), |e| format!("{} of {}", e.used, e.count));
        let params = human_count(params);
        println!(
            "{:<16} {:<9} {:>6} {:>6} {:>8} {:>8} {:>9} {:>10}  {}",
            p.name,
            p.arch.name(),
            p.n_layer,
            p.n_embd,
            experts,
            p.n_vocab,
            params,
            human_bytes(bytes),
            p.summary
        );
    }
}
