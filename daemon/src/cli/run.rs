//! `spillwayd run --model M (--prompt TEXT | --prompt-tokens 1,2,3)`: one generation on the CPU
//! reference engine without a server, printing the generated text as it comes (or the ids, when
//! the model has no usable tokenizer), or a JSON report.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use spillway_daemon::engine::generate::{generate, GenerateRequest, Generation, Prompt};
use spillway_daemon::engine::{Engine, EngineOptions, SamplerConfig};
use spillway_daemon::model::Model;
use spillway_daemon::tokenizer::Tokenizer;

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// The GGUF model file.
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt text, tokenized with the model's tokenizer (BOS added when its metadata says so;
    /// control tokens such as `<|im_start|>` are recognised).
    #[arg(
        long,
        required_unless_present = "prompt_tokens",
        conflicts_with = "prompt_tokens"
    )]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prompt_tokens: Vec<u32>,
    /// Stop when the generated text contains this string (repeatable); the string is not output.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Where to run: `cpu` (the only device of the reference engine).
    #[arg(long, default_value = "cpu")]
    pub device: String,
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

/// What `--json` prints: the generation, plus how long loading took and the threads used.
#[derive(Debug, Serialize)]
struct RunReport {
    #[serde(flatten)]
    generation: Generation,
    load_ms: f64,
    threads: usize,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    if args.device != "cpu" {
        bail!(
            "--device {}: only `cpu` runs models so far (the Vulkan backend lists devices with \
             `spillwayd devices` but does not run a forward pass yet)",
            args.device
        );
    }
    let start = Instant::now();
    let model =
        Model::open(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
    let tokenizer = Tokenizer::from_metadata(model.file().metadata());
    if let (Some(_), Err(e)) = (&args.prompt, &tokenizer) {
        bail!("--prompt needs the model's tokenizer, which is unusable: {e}");
    }
    let mut options = EngineOptions {
        context: args.ctx,
        ..EngineOptions::default()
    };
    if let Some(t) = args.threads {
        options.threads = t.max(1);
    }
    let threads = options.threads;
    let mut engine = Engine::new(Arc::new(model), &options);
    let load_ms = start.elapsed().as_secs_f64() * 1e3;

    let request = GenerateRequest {
        prompt: match &args.prompt {
            Some(text) => Prompt::Text(text.clone()),
            None => Prompt::Tokens(args.prompt_tokens.clone()),
        },
        max_tokens: args.max_tokens,
        sampling: SamplerConfig {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repeat_penalty,
            seed: args.seed,
            ..SamplerConfig::default()
        },
        stop: args.stop.clone(),
        prompt_logprobs: args.prompt_logprobs,
        ignore_eos: args.ignore_eos,
    };
    let stream_text = !args.json;
    let generation = generate(&mut engine, tokenizer.as_ref().ok(), &request, |piece| {
        if stream_text {
            print_out(piece);
        }
    })?;
    if args.json {
        let report = RunReport {
            generation,
            load_ms,
            threads,
        };
        print_out(&(serde_json::to_string(&report)? + "\n"));
        return Ok(());
    }
    if generation.text.is_some() {
        print_out("\n");
    } else {
        let ids: Vec<String> = generation.tokens.iter().map(u32::to_string).collect();
        print_out(&(ids.join(",") + "\n"));
    }
    let t = &generation.timings;
    eprintln!(
        "prompt: {} tokens in {:.1} ms ({:.1} tok/s); generated {} tokens in {:.1} ms \
         ({:.2} tok/s); {} threads; {:?}",
        generation.prompt_tokens.len(),
        t.prompt_ms,
        t.prompt_tokens_per_s,
        generation.tokens.len(),
        t.generate_ms,
        t.tokens_per_s,
        threads,
        generation.finish_reason
    );
    Ok(())
}

fn print_out(text: &str) {
    let mut stdout = std::io::stdout().lock();
    // A closed pipe (`| head`) is not an error worth reporting.
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
}
