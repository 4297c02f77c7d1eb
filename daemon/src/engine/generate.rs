//! One generation request on an [`Engine`] (or any [`SequenceModel`], such as the GPU's): prompt
//! evaluation, optional prompt log-probabilities, sampling until a stop condition, and streamed,
//! stop-string-safe text.

use std::time::Instant;

use serde::Serialize;

use super::decode::{DecodeOptions, Decoder};
use super::ops::log_softmax;
use super::{Engine, EngineError, SamplerConfig};
use crate::gpu::forward::GpuModel;
use crate::gpu::GpuError;
use crate::model::Model;
use crate::tokenizer::{EncodeOptions, Tokenizer};

/// What to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Tokenized with the model's tokenizer: BOS as its metadata says, control tokens parsed.
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    /// Generation stops when the text contains one of these; it is not part of the output.
    pub stop: Vec<String>,
    /// For every prompt position, the top-K log-probabilities of the next token (0: none).
    pub prompt_logprobs: usize,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    MaxTokens,
    /// An end-of-generation token of the vocabulary (eos, eot, ...).
    StopToken,
    StopString,
    ContextFull,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Timings {
    pub prompt_ms: f64,
    pub prompt_tokens_per_s: f64,
    pub generate_ms: f64,
    /// Generated tokens that were evaluated (the last one is only sampled) per second.
    pub tokens_per_s: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Generation {
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    /// The generated text without a matched stop string, when there is a tokenizer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    pub finish_reason: FinishReason,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prompt_logprobs: Vec<Vec<TokenLogprob>>,
    pub timings: Timings,
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt is empty: give some text or at least one token id")]
    EmptyPrompt,
    #[error("a text prompt needs the model's tokenizer, and this model has none")]
    NoTokenizer,
    #[error("stop strings must not be empty")]
    EmptyStop,
    #[error("the prompt has {tokens} tokens but the context holds {capacity}; shorten the prompt or enlarge the context")]
    PromptTooLong { tokens: usize, capacity: usize },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// One sequence of a model that turns tokens into next-token logits: the CPU [`Engine`] or a
/// [`GpuModel`].
pub trait SequenceModel {
    fn n_vocab(&self) -> usize;
    /// Positions the sequence may hold.
    fn capacity(&self) -> usize;
    /// Tokens evaluated so far.
    fn position(&self) -> usize;
    /// Forgets the sequence.
    fn reset(&mut self);
    /// Evaluates `tokens` at the next positions; the logits after every one of them
    /// (`all_logits`, `n_vocab` each) or after the last.
    fn eval_tokens(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, GenerateError>;
}

impl SequenceModel for Engine {
    fn n_vocab(&self) -> usize {
        self.model().config.n_vocab
    }

    fn capacity(&self) -> usize {
        Engine::capacity(self)
    }

    fn position(&self) -> usize {
        Engine::position(self)
    }

    fn reset(&mut self) {
        Engine::reset(self);
    }

    fn eval_tokens(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, GenerateError> {
        Ok(self.eval_batch(tokens, all_logits)?.to_vec())
    }
}

/// The selected sequence's prompts in chunks of tokens where the model batches them
/// ([`GpuModel::eval_prompt`]).
impl SequenceModel for GpuModel {
    fn n_vocab(&self) -> usize {
        self.config().n_vocab
    }

    fn capacity(&self) -> usize {
        GpuModel::capacity(self)
    }

    fn position(&self) -> usize {
        GpuModel::position(self)
    }

    fn reset(&mut self) {
        GpuModel::reset(self);
    }

    fn eval_tokens(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, GenerateError> {
        let n_vocab = self.config().n_vocab;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::TokenOutOfRange { token, n_vocab }.into());
        }
        if self.position() + tokens.len() > self.capacity() {
            let capacity = self.capacity();
            return Err(EngineError::ContextFull { capacity }.into());
        }
        Ok(self.eval_prompt(tokens, all_logits)?)
    }
}

/// The prompt's token ids: text is tokenized (BOS as the metadata says, control tokens parsed).
/// Checks that the prompt is not empty and leaves room in a context of `capacity` positions for
/// at least one generated token.
pub fn prompt_tokens(
    prompt: &Prompt,
    tokenizer: Option<&Tokenizer>,
    capacity: usize,
) -> Result<Vec<u32>, GenerateError> {
    let tokens = match (prompt, tokenizer) {
        (Prompt::Text(text), Some(tok)) => tok.encode_with(
            text,
            EncodeOptions {
                add_special: true,
                parse_special: true,
            },
        ),
        (Prompt::Text(_), None) => return Err(GenerateError::NoTokenizer),
        (Prompt::Tokens(ids), _) => ids.clone(),
    };
    if tokens.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    if tokens.len() >= capacity {
        return Err(GenerateError::PromptTooLong {
            tokens: tokens.len(),
            capacity,
        });
    }
    Ok(tokens)
}

/// The end-of-sequence id the model's metadata names, if any.
pub fn eos_token(engine: &Engine) -> Option<u32> {
    model_eos_token(engine.model())
}

/// The end-of-sequence id `model`'s metadata names, if any.
pub fn model_eos_token(model: &Model) -> Option<u32> {
    model
        .file()
        .metadata()
        .opt_u32("tokenizer.ggml.eos_token_id")
        .ok()
        .flatten()
}

/// Runs `request` from the start of `engine`'s sequence (the engine is reset first), handing
/// each piece of generated text to `on_text` as soon as it is complete UTF-8 and cannot be the
/// start of a stop string. Checks the request before any compute.
pub fn generate(
    engine: &mut Engine,
    tokenizer: Option<&Tokenizer>,
    request: &GenerateRequest,
    on_text: impl FnMut(&str),
) -> Result<Generation, GenerateError> {
    let eos = eos_token(engine);
    generate_with(engine, eos, tokenizer, request, on_text)
}

/// [`generate`] on any [`SequenceModel`]; `eos` is the end-of-sequence id of its metadata
/// ([`model_eos_token`]), for models without a usable tokenizer.
pub fn generate_with(
    engine: &mut impl SequenceModel,
    eos: Option<u32>,
    tokenizer: Option<&Tokenizer>,
    request: &GenerateRequest,
    mut on_text: impl FnMut(&str),
) -> Result<Generation, GenerateError> {
    if request.stop.iter().any(String::is_empty) {
        return Err(GenerateError::EmptyStop);
    }
    let prompt_tokens = prompt_tokens(&request.prompt, tokenizer, engine.capacity())?;
    engine.reset();

    let t_prompt = Instant::now();
    let n_vocab = engine.n_vocab();
    let want_all = request.prompt_logprobs > 0;
    let prompt_logits = engine.eval_tokens(&prompt_tokens, want_all)?;
    let prompt_logprobs = if want_all {
        prompt_logits
            .chunks_exact(n_vocab)
            .map(|l| top_logprobs(l, request.prompt_logprobs))
            .collect()
    } else {
        Vec::new()
    };
    let mut logits = prompt_logits[prompt_logits.len() - n_vocab..].to_vec();
    let prompt_ms = ms(t_prompt);

    let t_gen = Instant::now();
    let options = DecodeOptions {
        max_tokens: request.max_tokens,
        sampling: request.sampling.clone(),
        stop: request.stop.clone(),
        logprobs: false,
        top_logprobs: 0,
        ignore_eos: request.ignore_eos,
    };
    let mut decoder = Decoder::new(tokenizer, eos, &prompt_tokens, options);
    while decoder.finish_reason().is_none() {
        let step = decoder.step(&logits, engine.position() < engine.capacity());
        if !step.text.is_empty() {
            on_text(&step.text);
        }
        if step.finish.is_none() {
            logits = engine.eval_tokens(&[step.token], false)?;
        }
    }
    let generate_ms = ms(t_gen);
    let tokens = decoder.tokens().to_vec();
    let evaluated = tokens.len().saturating_sub(1).max(1);
    Ok(Generation {
        timings: Timings {
            prompt_ms,
            prompt_tokens_per_s: per_s(prompt_tokens.len(), prompt_ms),
            generate_ms,
            tokens_per_s: per_s(evaluated, generate_ms),
        },
        text: decoder.text().map(str::to_string),
        finish_reason: decoder.finish_reason().unwrap_or(FinishReason::MaxTokens),
        prompt_tokens,
        tokens,
        prompt_logprobs,
    })
}

/// The `k` most likely next tokens with their log-probabilities, most likely first (ties by id).
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<TokenLogprob> {
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
