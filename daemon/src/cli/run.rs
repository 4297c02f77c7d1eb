//! `spillwayd run --model M --prompt-tokens 1,2,3`: one generation on the CPU reference
//! engine, from token ids (no tokenizer), printing the generated ids or a JSON report.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use spillway_daemon::engine::ops::log_softmax;
use spillway_daemon::engine::{Engine, EngineOptions, Sampler, SamplerConfig};
use spillway_daemon::model::Model;

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// The GGUF model file.
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..)]
    pub prompt_tokens: Vec<u32>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens below this fraction of the best one's probability (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// For every prompt position, report the top-K log-probabilities of the next token.
    #[arg(long, default_value_t = 0)]
    pub prompt_logprobs: usize,
    /// Kernel threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV cache positions (default: the model's context, at most 4096).
    #[arg(long, default_value_t = 0)]
    pub ctx: usize,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print a JSON report instead of the token ids.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Timings {
    pub load_ms: f64,
    pub prompt_ms: f64,
    pub prompt_tokens_per_s: f64,
    pub generate_ms: f64,
    pub tokens_per_s: f64,
    pub threads: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RunReport {
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prompt_logprobs: Vec<Vec<TokenLogprob>>,
    pub timings: Timings,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let report = generate(&args)?;
    let mut text = if args.json {
        serde_json::to_string(&report)?
    } else {
        let ids: Vec<String> = report.tokens.iter().map(u32::to_string).collect();
        ids.join(",")
    };
    text.push('\n');
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other.context("writing to stdout")?,
    }
    if !args.json {
        let t = &report.timings;
        eprintln!(
            "prompt: {} tokens in {:.1} ms ({:.1} tok/s); generated {} tokens in {:.1} ms \
             ({:.2} tok/s); {} threads",
            report.prompt_tokens.len(),
            t.prompt_ms,
            t.prompt_tokens_per_s,
            report.tokens.len(),
            t.generate_ms,
            t.tokens_per_s,
            t.threads
        );
    }
    Ok(())
}

/// Loads the model and generates; the report is what `run` prints.
pub fn generate(args: &RunArgs) -> anyhow::Result<RunReport> {
    if args.prompt_tokens.is_empty() {
        bail!("--prompt-tokens needs at least one token id");
    }
    let start = Instant::now();
    let model =
        Model::open(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
    let eos = model
        .file()
        .metadata()
        .opt_u32("tokenizer.ggml.eos_token_id")
        .ok()
        .flatten()
        .filter(|_| !args.ignore_eos);
    let mut options = EngineOptions {
        context: args.ctx,
        ..EngineOptions::default()
    };
    if let Some(t) = args.threads {
        options.threads = t.max(1);
    }
    let threads = options.threads;
    let mut engine = Engine::new(Arc::new(model), &options);
    let load_ms = ms(start);

    let mut sampler = Sampler::new(SamplerConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repeat_penalty,
        seed: args.seed,
        ..SamplerConfig::default()
    });
    let t_prompt = Instant::now();
    let n_vocab = engine.model().config.n_vocab;
    let want_all = args.prompt_logprobs > 0;
    let prompt_logits = engine
        .eval_batch(&args.prompt_tokens, want_all)
        .context("evaluating the prompt")?;
    let prompt_logprobs = if want_all {
        prompt_logits
            .chunks_exact(n_vocab)
            .map(|l| top_logprobs(l, args.prompt_logprobs))
            .collect()
    } else {
        Vec::new()
    };
    let mut logits = prompt_logits[prompt_logits.len() - n_vocab..].to_vec();
    let prompt_ms = ms(t_prompt);

    let t_gen = Instant::now();
    let mut history = args.prompt_tokens.clone();
    let mut tokens = Vec::new();
    while tokens.len() < args.max_tokens {
        let next = sampler.sample(&logits, &history);
        tokens.push(next);
        history.push(next);
        if Some(next) == eos || tokens.len() == args.max_tokens {
            break;
        }
        logits = engine.eval(next).context("generating")?.to_vec();
    }
    let generate_ms = ms(t_gen);
    // Every generated token but the last was evaluated (the last only sampled).
    let evaluated = tokens.len().saturating_sub(1).max(1);
    Ok(RunReport {
        prompt_tokens: args.prompt_tokens.clone(),
        tokens,
        prompt_logprobs,
        timings: Timings {
            load_ms,
            prompt_ms,
            prompt_tokens_per_s: per_s(args.prompt_tokens.len(), prompt_ms),
            generate_ms,
            tokens_per_s: per_s(evaluated, generate_ms),
            threads,
        },
    })
}

fn top_logprobs(logits: &[f32], k: usize) -> Vec<TokenLogprob> {
    let lp = log_softmax(logits);
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx.into_iter()
        .map(|i| TokenLogprob {
            token: i as u32,
            logprob: lp[i],
        })
        .collect()
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn per_s(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1e3 / ms
    } else {
        0.0
    }
}
