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
use spillway_daemon::engine::ops::log_softmax;
use spillway_daemon::engine::{Engine, EngineOptions, Sampler, SamplerConfig};
use spillway_daemon::model::Model;
use spillway_daemon::tokenizer::{Detokenizer, EncodeOptions, Tokenizer};

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

/// Why generation ended.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    MaxTokens,
    StopToken,
    StopString,
    ContextFull,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RunReport {
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    /// The generated text (without a matched stop string), when the model has a tokenizer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    pub finish_reason: FinishReason,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prompt_logprobs: Vec<Vec<TokenLogprob>>,
    pub timings: Timings,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let stream_text = !args.json;
    let report = generate_with(&args, |piece| {
        if stream_text {
            print_out(piece);
        }
    })?;
    let text = if args.json {
        serde_json::to_string(&report)? + "\n"
    } else if report.text.is_some() {
        "\n".to_string()
    } else {
        let ids: Vec<String> = report.tokens.iter().map(u32::to_string).collect();
        ids.join(",") + "\n"
    };
    print_out(&text);
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

fn print_out(text: &str) {
    let mut stdout = std::io::stdout().lock();
    // A closed pipe (`| head`) is not an error worth reporting.
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
}

/// Loads the model and generates; the report is what `run` prints.
#[allow(dead_code)] // the binary streams through `generate_with`; tests call this
pub fn generate(args: &RunArgs) -> anyhow::Result<RunReport> {
    generate_with(args, |_| {})
}

/// As [`generate`], handing each piece of generated text to `on_text` as soon as it is complete
/// and cannot be part of a stop string.
pub fn generate_with(args: &RunArgs, mut on_text: impl FnMut(&str)) -> anyhow::Result<RunReport> {
    if args.device != "cpu" {
        bail!(
            "--device {}: only `cpu` runs models so far (the Vulkan backend lists devices with \
             `spillwayd devices` but does not run a forward pass yet)",
            args.device
        );
    }
    if args.stop.iter().any(String::is_empty) {
        bail!("--stop needs a non-empty string");
    }
    let start = Instant::now();
    let model =
        Model::open(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
    let tokenizer = Tokenizer::from_metadata(model.file().metadata());
    let prompt_tokens = match (&args.prompt, &tokenizer) {
        (Some(text), Ok(tok)) => tok.encode_with(
            text,
            EncodeOptions {
                add_special: true,
                parse_special: true,
            },
        ),
        (Some(_), Err(e)) => bail!("--prompt needs the model's tokenizer, which is unusable: {e}"),
        (None, _) => args.prompt_tokens.clone(),
    };
    if prompt_tokens.is_empty() {
        bail!("the prompt is empty: give a non-empty --prompt or at least one --prompt-tokens id");
    }
    let tokenizer = tokenizer.ok();
    let eos = model
        .file()
        .metadata()
        .opt_u32("tokenizer.ggml.eos_token_id")
        .ok()
        .flatten();
    let is_stop_token = |t: u32| {
        !args.ignore_eos && (Some(t) == eos || tokenizer.as_ref().is_some_and(|k| k.is_eog(t)))
    };
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
    if prompt_tokens.len() >= engine.capacity() {
        bail!(
            "the prompt has {} tokens but the context holds {}; shorten it or raise --ctx",
            prompt_tokens.len(),
            engine.capacity()
        );
    }
    let prompt_logits = engine
        .eval_batch(&prompt_tokens, want_all)
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
    let mut history = prompt_tokens.clone();
    let mut tokens = Vec::new();
    let mut text = StopScanner::new(&args.stop);
    let mut detok = tokenizer.as_ref().map(|t| Detokenizer::new(t, false));
    let mut finish_reason = FinishReason::MaxTokens;
    while tokens.len() < args.max_tokens {
        let next = sampler.sample(&logits, &history);
        tokens.push(next);
        history.push(next);
        if is_stop_token(next) {
            finish_reason = FinishReason::StopToken;
            break;
        }
        if let Some(d) = detok.as_mut() {
            if text.push(&d.push(next), &mut on_text) {
                finish_reason = FinishReason::StopString;
                break;
            }
        }
        if tokens.len() == args.max_tokens {
            break;
        }
        if engine.position() >= engine.capacity() {
            finish_reason = FinishReason::ContextFull;
            break;
        }
        logits = engine.eval(next).context("generating")?.to_vec();
    }
    if let Some(d) = detok {
        if finish_reason != FinishReason::StopString {
            text.push(&d.finish(), &mut on_text);
        }
    }
    let text = tokenizer.as_ref().map(|_| text.finish(&mut on_text));
    let generate_ms = ms(t_gen);
    // Every generated token but the last was evaluated (the last only sampled).
    let evaluated = tokens.len().saturating_sub(1).max(1);
    Ok(RunReport {
        prompt_tokens: prompt_tokens.clone(),
        tokens,
        text,
        finish_reason,
        prompt_logprobs,
        timings: Timings {
            load_ms,
            prompt_ms,
            prompt_tokens_per_s: per_s(prompt_tokens.len(), prompt_ms),
            generate_ms,
            tokens_per_s: per_s(evaluated, generate_ms),
            threads,
        },
    })
}

/// Generated text, released to the caller only once no stop string can still begin in it.
struct StopScanner<'s> {
    stops: &'s [String],
    text: String,
    released: usize,
}

impl<'s> StopScanner<'s> {
    fn new(stops: &'s [String]) -> Self {
        StopScanner {
            stops,
            text: String::new(),
            released: 0,
        }
    }

    /// Adds `piece`; returns true when a stop string has appeared (the text is cut before it).
    fn push(&mut self, piece: &str, on_text: &mut impl FnMut(&str)) -> bool {
        let search_from = self.released;
        self.text.push_str(piece);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| search_from + i)
            })
            .min();
        if let Some(at) = hit {
            self.text.truncate(at);
            self.release(at, on_text);
            return true;
        }
        // Hold back the longest tail that could still grow into a stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| {
                s.char_indices()
                    .map(|(i, _)| i)
                    .filter(|&i| i > 0 && self.text.ends_with(&s[..i]))
            })
            .max()
            .unwrap_or(0);
        let mut safe = self.text.len() - hold;
        while !self.text.is_char_boundary(safe) {
            safe -= 1;
        }
        self.release(safe, on_text);
        false
    }

    fn release(&mut self, upto: usize, on_text: &mut impl FnMut(&str)) {
        if upto > self.released {
            on_text(&self.text[self.released..upto]);
            self.released = upto;
        }
    }

    fn finish(mut self, on_text: &mut impl FnMut(&str)) -> String {
        let end = self.text.len();
        self.release(end, on_text);
        self.text
    }
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

#[cfg(test)]
mod stop_tests {
    use super::StopScanner;

    fn scan(stops: &[&str], pieces: &[&str]) -> (bool, String, Vec<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut scanner = StopScanner::new(&stops);
        let mut released = Vec::new();
        let mut stopped = false;
        for p in pieces {
            if scanner.push(p, &mut |t: &str| released.push(t.to_string())) {
                stopped = true;
                break;
            }
        }
        let text = scanner.finish(&mut |t: &str| released.push(t.to_string()));
        (stopped, text, released)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_found_and_never_released() {
        let (stopped, text, released) = scan(&["\n\n"], &["Hello", " world\n", "\nmore"]);
        assert!(stopped);
        assert_eq!(text, "Hello world");
        assert_eq!(released.concat(), "Hello world");
    }

    #[test]
    fn text_that_cannot_start_a_stop_string_is_released_at_once() {
        let (stopped, text, released) = scan(&["END"], &["abc", "dE", "x"]);
        assert!(!stopped);
        assert_eq!(text, "abcdEx");
        assert_eq!(released, ["abc", "d", "Ex"]);
    }

    #[test]
    fn multibyte_stop_strings_are_held_back_on_char_boundaries() {
        let (stopped, text, _) = scan(&["日本"], &["a日", "本b"]);
        assert!(stopped);
        assert_eq!(text, "a");
        let (stopped, text, _) = scan(&["é!"], &["café", "?"]);
        assert!(!stopped);
        assert_eq!(text, "café?");
    }
}
