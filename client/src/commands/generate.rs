//! `spillway generate`: one prompt, the text streamed to stdout as it comes, or (`--json`) one
//! JSON object at the end.

use std::io::Write;
use std::time::Duration;

use clap::Args;
use serde::Serialize;
use spillway_proto::v1 as pb;
use tonic::Request;

use crate::connect::Client;
use crate::exit::Failure;

/// Sampling and output options shared by `generate` and `chat`.
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// Model name (`spillway models`); default: the daemon's default model.
    #[arg(long, default_value = "")]
    pub model: String,
    /// Tokens to generate (default: 256, fewer when the context is short).
    #[arg(long, default_value_t = 0)]
    pub max_tokens: u32,
    /// Sampling temperature; 0 is greedy. The sampling defaults are llama.cpp's.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: u32,
    /// Nucleus sampling threshold (1: off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens below this fraction of the best one's probability (0: off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Seed of the sampler.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when the text contains this string (repeatable); it is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Give up after this many seconds (the daemon stops the request too).
    #[arg(long)]
    pub timeout: Option<f64>,
}

impl SamplingArgs {
    pub fn request(&self, input: pb::generate_request::Input) -> pb::GenerateRequest {
        pb::GenerateRequest {
            model: self.model.clone(),
            input: Some(input),
            sampling: Some(pb::SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repetition_penalty: self.repeat_penalty,
                seed: self.seed,
            }),
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            ..Default::default()
        }
    }

    pub fn wrap<T>(&self, message: T) -> Result<Request<T>, Failure> {
        let mut r = Request::new(message);
        if let Some(t) = self.timeout {
            if !(t.is_finite() && t > 0.0) {
                return Err(Failure::usage(
                    "--timeout must be a positive number of seconds",
                ));
            }
            r.set_timeout(Duration::from_secs_f64(t));
        }
        Ok(r)
    }
}

#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// The prompt text (tokenized by the daemon with the model's tokenizer).
    #[arg(
        required_unless_present = "prompt_tokens",
        conflicts_with = "prompt_tokens"
    )]
    pub prompt: Option<String>,
    /// The prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prompt_tokens: Vec<u32>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Report each token's log-probability (in --json).
    #[arg(long)]
    pub logprobs: bool,
    /// Report the K most likely tokens at each step (in --json).
    #[arg(long, default_value_t = 0)]
    pub top_logprobs: u32,
    /// Report the K most likely next tokens at each prompt position (in --json).
    #[arg(long, default_value_t = 0)]
    pub prompt_logprobs: u32,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

/// What `--json` prints.
#[derive(Debug, Default, Serialize)]
struct Report {
    tokens: Vec<u32>,
    text: String,
    finish_reason: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    logprobs: Vec<Option<f32>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    top_logprobs: Vec<Vec<(u32, f32)>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    prompt_logprobs: Vec<Vec<(u32, f32)>>,
    timings: Option<TimingsJson>,
}

#[derive(Debug, Serialize)]
struct TimingsJson {
    time_to_first_token_ms: f64,
    queue_ms: f64,
    prompt_ms: f64,
    decode_ms: f64,
    prompt_tokens: u32,
    generated_tokens: u32,
    prefill_tokens_per_second: f64,
    decode_tokens_per_second: f64,
}

pub async fn run(client: &mut Client, args: &GenerateArgs) -> Result<(), Failure> {
    let input = match &args.prompt {
        Some(text) => pb::generate_request::Input::Text(text.clone()),
        None => pb::generate_request::Input::Tokens(pb::TokenIds {
            ids: args.prompt_tokens.clone(),
        }),
    };
    let mut req = args.sampling.request(input);
    req.logprobs = args.logprobs;
    req.top_logprobs = args.top_logprobs;
    req.prompt_logprobs = args.prompt_logprobs;
    req.ignore_eos = args.ignore_eos;
    let mut stream = client
        .generate(args.sampling.wrap(req)?)
        .await?
        .into_inner();
    let mut report = Report::default();
    let mut out = std::io::stdout().lock();
    while let Some(msg) = stream.message().await? {
        if !args.json {
            // A closed pipe (`| head`) ends the output, not the program with an error.
            let _ = out
                .write_all(msg.text.as_bytes())
                .and_then(|()| out.flush());
        }
        collect(&mut report, msg);
    }
    if args.json {
        let json = serde_json::to_string(&report).map_err(|e| Failure::new(1, e.to_string()))?;
        let _ = writeln!(out, "{json}");
    } else {
        let _ = writeln!(out);
        if let Some(t) = &report.timings {
            eprintln!(
                "{} prompt tokens, {} generated ({}); first token after {:.1} ms, {:.1} tok/s",
                t.prompt_tokens,
                t.generated_tokens,
                report.finish_reason,
                t.time_to_first_token_ms,
                t.decode_tokens_per_second
            );
        }
    }
    if report.timings.is_none() {
        return Err(Failure::new(1, "the stream ended without a finish reason"));
    }
    Ok(())
}

fn collect(report: &mut Report, msg: pb::GenerateResponse) {
    let pairs = |v: Vec<pb::TokenLogprob>| v.into_iter().map(|t| (t.token, t.logprob)).collect();
    report.tokens.push(msg.token);
    report.text.push_str(&msg.text);
    if msg.logprob.is_some() {
        report.logprobs.push(msg.logprob);
    }
    if !msg.top_logprobs.is_empty() {
        report.top_logprobs.push(pairs(msg.top_logprobs));
    }
    report
        .prompt_logprobs
        .extend(msg.prompt_logprobs.into_iter().map(|p| pairs(p.top)));
    if let Some(t) = msg.timings {
        report.finish_reason = finish_name(msg.finish_reason).into();
        report.timings = Some(TimingsJson {
            time_to_first_token_ms: t.time_to_first_token_ms,
            queue_ms: t.queue_ms,
            prompt_ms: t.prompt_ms,
            decode_ms: t.decode_ms,
            prompt_tokens: t.prompt_tokens,
            generated_tokens: t.generated_tokens,
            prefill_tokens_per_second: t.prefill_tokens_per_second,
            decode_tokens_per_second: t.decode_tokens_per_second,
        });
    }
}

/// The finish reason as `spillwayd run --json` spells it.
pub fn finish_name(reason: i32) -> &'static str {
    match pb::FinishReason::try_from(reason) {
        Ok(pb::FinishReason::MaxTokens) => "max_tokens",
        Ok(pb::FinishReason::StopToken) => "stop_token",
        Ok(pb::FinishReason::StopString) => "stop_string",
        Ok(pb::FinishReason::ContextFull) => "context_full",
        _ => "unspecified",
    }
}
