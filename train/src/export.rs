//! `spillway-train export`: trained f32 weights → a quantized `qwen3moe` GGUF.
//!
//! Tensor names, shapes, types and the architecture keys come from the same tables the
//! synthetic models use (`synth::model`), so the file has the layout of a llama.cpp-converted
//! Qwen3-MoE; only the data and the `general.*` description differ.

use std::path::PathBuf;

use anyhow::{bail, ensure, Context};
use clap::Args;
use serde::Deserialize;
use spillway_daemon::gguf::writer::GgufWriter;
use spillway_daemon::gguf::{GgmlType, GgufFile, Value};
use spillway_daemon::quant::quantize_row;
use spillway_daemon::synth::model::{arch_metadata, tensors};
use spillway_daemon::synth::presets::{Arch, Experts, SpecialLayout, TokenizerKind};
use spillway_daemon::synth::{Preset, WeightType};

use crate::safetensors;

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The weights `train.py` saved.
    #[arg(long)]
    pub weights: PathBuf,
    /// The model's hyper-parameters, as `train.py` saved them (`config.json`).
    #[arg(long)]
    pub config: PathBuf,
    /// The vocabulary `prepare` wrote (`tokenizer.gguf`).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Weight type of the matrices (norms and the router stay F32).
    #[arg(long, default_value = "q8_0")]
    pub r#type: String,
    /// `general.name` of the model.
    #[arg(long, default_value = "Spillway KJV MoE")]
    pub name: String,
    /// One line on how it was made (`general.description`).
    #[arg(long, default_value = "")]
    pub description: String,
    #[arg(long)]
    pub out: PathBuf,
}

/// What `train.py` writes to `config.json`.
#[derive(Debug, Deserialize)]
pub struct ModelConfig {
    pub n_vocab: u32,
    pub n_embd: u32,
    pub n_layer: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_ff_expert: u32,
    pub context: u32,
    pub rope_base: f32,
    pub rms_eps: f32,
}

fn preset(c: &ModelConfig) -> Preset {
    Preset {
        name: "kjv-moe",
        model_name: "Spillway KJV MoE",
        summary: "trained on the King James Bible",
        arch: Arch::Qwen3Moe,
        tokenizer: TokenizerKind::Qwen2,
        specials: SpecialLayout::Compact,
        n_vocab: c.n_vocab,
        n_embd: c.n_embd,
        n_layer: c.n_layer,
        n_head: c.n_head,
        n_head_kv: c.n_head_kv,
        head_dim: c.head_dim,
        n_ff: c.n_ff_expert,
        context: c.context,
        rope_base: c.rope_base,
        rms_eps: c.rms_eps,
        experts: Some(Experts {
            count: c.n_expert,
            used: c.n_expert_used,
            n_ff: c.n_ff_expert,
            shared_n_ff: None,
        }),
        tied_embeddings: true,
        rope_scaling: None,
    }
}

pub fn run(args: &ExportArgs) -> anyhow::Result<()> {
    let config: ModelConfig = serde_json::from_slice(
        &std::fs::read(&args.config)
            .with_context(|| format!("reading {}", args.config.display()))?,
    )?;
    let weights = WeightType::Uniform(match args.r#type.to_ascii_lowercase().as_str() {
        "q8_0" => GgmlType::Q8_0,
        "q4_0" => GgmlType::Q4_0,
        "f16" => GgmlType::F16,
        "f32" => GgmlType::F32,
        other => bail!("--type {other}: one of q8_0, q4_0, f16, f32"),
    });
    let preset = preset(&config);
    let (plans, notes) = tensors(&preset, weights);
    for n in notes {
        println!("note: {n}");
    }

    let mut metadata: Vec<(String, Value)> = arch_metadata(&preset, weights, 0)
        .into_iter()
        .map(|(k, v)| match k.as_str() {
            "general.name" => (k, Value::String(args.name.clone())),
            "general.description" => (k, Value::String(args.description.clone())),
            _ => (k, v),
        })
        .collect();
    let vocab = GgufFile::open_structure_only(&args.tokenizer)
        .with_context(|| format!("reading {}", args.tokenizer.display()))?;
    metadata.extend(
        vocab
            .metadata()
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.to_string(), v.clone())),
    );
    metadata.push(("general.quantization_version".into(), Value::U32(2)));

    let mut source = safetensors::read(&args.weights)?;
    let specs: Vec<_> = plans.iter().map(|p| p.spec.clone()).collect();
    let mut w = GgufWriter::create(&args.out, &metadata, &specs)?;
    for spec in &specs {
        let t = source
            .remove(&spec.name)
            .with_context(|| format!("{} is not in {}", spec.name, args.weights.display()))?;
        let want: Vec<u64> = spec.dims.iter().rev().copied().collect();
        ensure!(
            t.shape == want,
            "{}: shape {:?} in the weights, {:?} expected",
            spec.name,
            t.shape,
            want
        );
        let row = spec.dims[0] as usize;
        let row_bytes = spec
            .ggml_type
            .row_bytes(row as u64)
            .context("row size overflows")? as usize;
        let mut out = vec![0u8; row_bytes];
        w.begin_tensor(&spec.name)?;
        for r in t.data.chunks_exact(row) {
            quantize_row(spec.ggml_type, r, &mut out)?;
            w.write_chunk(&out)?;
        }
    }
    if !source.is_empty() {
        let mut left: Vec<_> = source.keys().cloned().collect();
        left.sort();
        bail!("weights not in a qwen3moe model: {}", left.join(", "));
    }
    w.finish()?;
    let size = std::fs::metadata(&args.out)?.len();
    println!(
        "{}: {} tensors, {} bytes",
        args.out.display(),
        specs.len(),
        size
    );
    Ok(())
}
