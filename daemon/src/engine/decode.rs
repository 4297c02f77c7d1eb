//! One sequence's generation after its prompt, a token at a time: sampling, end-of-generation
//! tokens, stop strings, the token budget and streamed text. It never touches an engine: the
//! caller evaluates each token (alone, or batched with other sequences) and hands back logits.

use super::generate::{top_logprobs, FinishReason, TokenLogprob};
use super::ops::log_softmax;
use super::stop::StopScanner;
use super::{Sampler, SamplerConfig};
use crate::tokenizer::{Detokenizer, Tokenizer};

/// How to decode one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeOptions {
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    /// Generation stops when the text contains one of these; it is not part of the output.
    pub stop: Vec<String>,
    /// Report the log-probability of every sampled token.
    pub logprobs: bool,
    /// Report this many of the most likely tokens at every step (0: none).
    pub top_logprobs: usize,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
}

/// What one step produced.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenStep {
    pub token: u32,
    /// Text released by this step: complete UTF-8 that cannot begin a stop string. Empty while
    /// a character or a possible stop string is incomplete; on the last step it includes
    /// everything still held back.
    pub text: String,
    /// Log-probability of `token` under the model (before temperature and filters).
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<TokenLogprob>,
    /// Set on the last step.
    pub finish: Option<FinishReason>,
}

/// A sequence being decoded: feed it the logits after its last token, get the next token.
pub struct Decoder<'t> {
    options: DecodeOptions,
    sampler: Sampler,
    history: Vec<u32>,
    tokens: Vec<u32>,
    tokenizer: Option<&'t Tokenizer>,
    eos: Option<u32>,
    detok: Option<Detokenizer<'t>>,
    scanner: Option<StopScanner>,
    text: Option<String>,
    finish: Option<FinishReason>,
}

impl<'t> Decoder<'t> {
    /// `eos`: the end-of-sequence id from the model's metadata, for models without a usable
    /// tokenizer; `prompt` feeds the repetition penalty.
    pub fn new(
        tokenizer: Option<&'t Tokenizer>,
        eos: Option<u32>,
        prompt: &[u32],
        options: DecodeOptions,
    ) -> Decoder<'t> {
        Decoder {
            sampler: Sampler::new(options.sampling.clone()),
            history: prompt.to_vec(),
            tokens: Vec::new(),
            tokenizer,
            eos,
            detok: tokenizer.map(|t| Detokenizer::new(t, false)),
            scanner: Some(StopScanner::new(&options.stop)),
            text: None,
            finish: if options.max_tokens == 0 {
                Some(FinishReason::MaxTokens)
            } else {
                None
            },
            options,
        }
    }

    /// Samples the next token from `logits` (the model's output after the last token).
    /// `room_left`: whether the sequence's cache can still take the token, which it needs
    /// unless this is the last step.
    ///
    /// # Panics
    /// If called after a step that finished.
    pub fn step(&mut self, logits: &[f32], room_left: bool) -> TokenStep {
        assert!(self.finish.is_none(), "step after the sequence finished");
        let o = &self.options;
        let token = self.sampler.sample(logits, &self.history);
        self.tokens.push(token);
        self.history.push(token);
        let (logprob, top) = if o.logprobs || o.top_logprobs > 0 {
            let lp = log_softmax(logits);
            (
                Some(lp[token as usize]),
                top_logprobs(logits, o.top_logprobs),
            )
        } else {
            (None, Vec::new())
        };

        let mut text = String::new();
        let mut finish = None;
        let is_eog = Some(token) == self.eos || self.tokenizer.is_some_and(|k| k.is_eog(token));
        if is_eog && !o.ignore_eos {
            finish = Some(FinishReason::StopToken);
        } else if let (Some(d), Some(s)) = (self.detok.as_mut(), self.scanner.as_mut()) {
            if s.push(&d.push(token), &mut |t: &str| text.push_str(t)) {
                finish = Some(FinishReason::StopString);
            }
        }
        if finish.is_none() && self.tokens.len() >= o.max_tokens {
            finish = Some(FinishReason::MaxTokens);
        }
        if finish.is_none() && !room_left {
            finish = Some(FinishReason::ContextFull);
        }
        if let Some(reason) = finish {
            self.close(reason, &mut text);
        }
        TokenStep {
            token,
            text,
            logprob,
            top_logprobs: top,
            finish,
        }
    }

    /// Releases what is held back and records the whole text.
    fn close(&mut self, reason: FinishReason, out: &mut String) {
        self.finish = Some(reason);
        let Some(mut scanner) = self.scanner.take() else {
            return;
        };
        let mut on_text = |t: &str| out.push_str(t);
        if let Some(d) = self.detok.take() {
            if reason != FinishReason::StopString {
                scanner.push(&d.finish(), &mut on_text);
            }
        }
        let text = scanner.finish(&mut on_text);
        self.text = self.tokenizer.map(|_| text);
    }

    /// Why the sequence ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// The tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The generated text without a matched stop string, once finished, when there is a
    /// tokenizer.
    pub fn text(&self) -> Option<&str> {
        self.text.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(max_tokens: usize) -> DecodeOptions {
        DecodeOptions {
            max_tokens,
            sampling: SamplerConfig::default(),
            stop: Vec::new(),
            logprobs: true,
            top_logprobs: 2,
            ignore_eos: false,
        }
    }

    #[test]
    fn greedy_steps_follow_the_logits_and_stop_at_the_budget() {
        let mut d = Decoder::new(None, Some(0), &[1], options(2));
        let s = d.step(&[0.0, 1.0, 3.0], true);
        assert_eq!((s.token, s.finish), (2, None));
        assert_eq!(
            s.top_logprobs.iter().map(|t| t.token).collect::<Vec<_>>(),
            [2, 1]
        );
        assert!(s.logprob.unwrap() < 0.0);
        let s = d.step(&[0.0, 3.0, 1.0], true);
        assert_eq!((s.token, s.finish), (1, Some(FinishReason::MaxTokens)));
        assert_eq!(d.tokens(), [2, 1]);
    }

    #[test]
    fn the_eos_token_ends_the_sequence_unless_ignored() {
        let mut d = Decoder::new(None, Some(0), &[1], options(5));
        assert_eq!(
            d.step(&[5.0, 1.0], true).finish,
            Some(FinishReason::StopToken)
        );
        let mut d = Decoder::new(
            None,
            Some(0),
            &[1],
            DecodeOptions {
                ignore_eos: true,
                ..options(5)
            },
        );
        assert_eq!(d.step(&[5.0, 1.0], true).finish, None);
    }

    #[test]
    fn a_full_cache_ends_the_sequence() {
        let mut d = Decoder::new(None, None, &[1], options(5));
        assert_eq!(
            d.step(&[0.0, 1.0], false).finish,
            Some(FinishReason::ContextFull)
        );
    }
}
