//! Checks a generation or profile request against the model before any compute, turning it
//! into a job's prompt tokens and decode options (or decode steps); every refusal is
//! INVALID_ARGUMENT saying what to change.

use std::time::Duration;

use spillway_proto::v1 as pb;
use tonic::Status;

use crate::engine::decode::DecodeOptions;
use crate::engine::generate::{prompt_tokens, GenerateError, Prompt};
use crate::engine::SamplerConfig;
use crate::tokenizer::Tokenizer;

/// Longest prompt text, in bytes, or chat messages together.
pub const MAX_PROMPT_BYTES: usize = 1 << 20;
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Tokens generated when the request gives no `max_tokens` (fewer when the context is short).
pub const DEFAULT_MAX_TOKENS: usize = 256;
/// Decode steps a profile runs when the request gives none (fewer when the context is short).
pub const DEFAULT_PROFILE_STEPS: usize = 8;
pub const MAX_PROFILE_STEPS: usize = 1024;

/// A request that passed the checks.
#[derive(Debug)]
pub struct ValidRequest {
    pub prompt: Vec<u32>,
    pub options: DecodeOptions,
    pub prompt_logprobs: usize,
}

/// What the checks need to know about the model.
pub struct ModelLimits<'a> {
    pub tokenizer: Option<&'a Tokenizer>,
    pub n_vocab: usize,
    pub context: usize,
    /// Renders chat messages to prompt text.
    pub render_chat: &'a dyn Fn(&[pb::ChatMessage]) -> Result<String, String>,
}

fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg)
}

#[allow(clippy::result_large_err)] // the error is the gRPC status the caller returns
pub fn generate_request(
    req: &pb::GenerateRequest,
    model: &ModelLimits<'_>,
) -> Result<ValidRequest, Status> {
    let sampling = sampling(req.sampling.as_ref())?;
    if req.stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(format!(
            "{} stop strings given; at most {MAX_STOP_STRINGS} are allowed",
            req.stop.len()
        )));
    }
    if let Some(s) = req
        .stop
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(invalid(format!(
            "stop string {s:?} must have 1 to {MAX_STOP_BYTES} bytes"
        )));
    }
    for (name, k) in [
        ("top_logprobs", req.top_logprobs),
        ("prompt_logprobs", req.prompt_logprobs),
    ] {
        if k > MAX_TOP_LOGPROBS {
            return Err(invalid(format!(
                "{name} is {k}; at most {MAX_TOP_LOGPROBS} is allowed"
            )));
        }
    }

    let prompt = match &req.input {
        None => {
            return Err(invalid(
                "the request has no input: set `text`, `tokens` or `chat`",
            ))
        }
        Some(pb::generate_request::Input::Text(t)) => {
            check_prompt_bytes(t.len())?;
            Prompt::Text(t.clone())
        }
        Some(pb::generate_request::Input::Tokens(t)) => {
            if let Some(&bad) = t.ids.iter().find(|&&id| id as usize >= model.n_vocab) {
                return Err(invalid(format!(
                    "token id {bad} is outside the model's vocabulary of {} tokens",
                    model.n_vocab
                )));
            }
            Prompt::Tokens(t.ids.clone())
        }
        Some(pb::generate_request::Input::Chat(c)) => {
            if c.messages.is_empty() {
                return Err(invalid("the chat has no messages: add at least one"));
            }
            check_prompt_bytes(c.messages.iter().map(|m| m.content.len()).sum())?;
            if let Some(m) = c.messages.iter().find(|m| m.role.is_empty()) {
                return Err(invalid(format!(
                    "a chat message has no role (content {:?}): use system, user or assistant",
                    truncate(&m.content, 40)
                )));
            }
            let text = (model.render_chat)(&c.messages)
                .map_err(|e| invalid(format!("the chat template failed: {e}")))?;
            Prompt::Text(text)
        }
    };
    let tokens = prompt_tokens(&prompt, model.tokenizer, model.context).map_err(prompt_error)?;
    let room = model.context - tokens.len();
    let max_tokens = match req.max_tokens as usize {
        0 => DEFAULT_MAX_TOKENS.min(room),
        n if n > room => {
            return Err(invalid(format!(
                "the prompt has {} tokens and max_tokens is {n}, beyond the context of {}: set \
                 max_tokens to at most {room} or shorten the prompt",
                tokens.len(),
                model.context
            )))
        }
        n => n,
    };
    Ok(ValidRequest {
        prompt: tokens,
        options: DecodeOptions {
            max_tokens,
            sampling,
            stop: req.stop.clone(),
            logprobs: req.logprobs,
            top_logprobs: req.top_logprobs as usize,
            ignore_eos: req.ignore_eos,
        },
        prompt_logprobs: req.prompt_logprobs as usize,
    })
}

fn prompt_error(e: GenerateError) -> Status {
    match e {
        GenerateError::EmptyPrompt => invalid("the prompt is empty: give some text or token ids"),
        GenerateError::NoTokenizer => {
            invalid("this model has no usable tokenizer: send token ids (`tokens`) instead of text")
        }
        GenerateError::PromptTooLong { tokens, capacity } => invalid(format!(
            "the prompt has {tokens} tokens but the context holds {capacity}: shorten it, or \
             load the model with a larger context"
        )),
        other => invalid(other.to_string()),
    }
}

/// A profile request that passed the checks.
#[derive(Debug, PartialEq, Eq)]
pub struct ValidProfile {
    pub prompt: Vec<u32>,
    /// Decode steps after the prompt.
    pub steps: usize,
}

/// Checks a profile request: a prompt (text, token ids or a token count) that leaves room in
/// the context for the decode steps.
#[allow(clippy::result_large_err)]
pub fn profile_request(
    req: &pb::ProfileRequest,
    model: &ModelLimits<'_>,
) -> Result<ValidProfile, Status> {
    use pb::profile_request::Input;
    if req.steps as usize > MAX_PROFILE_STEPS {
        return Err(invalid(format!(
            "steps is {}; at most {MAX_PROFILE_STEPS} are allowed",
            req.steps
        )));
    }
    let prompt = match &req.input {
        None => {
            return Err(invalid(
                "the request has no input: set `text`, `tokens` or `token_count`",
            ))
        }
        Some(Input::Text(t)) => {
            check_prompt_bytes(t.len())?;
            Prompt::Text(t.clone())
        }
        Some(Input::Tokens(t)) => {
            if let Some(&bad) = t.ids.iter().find(|&&id| id as usize >= model.n_vocab) {
                return Err(invalid(format!(
                    "token id {bad} is outside the model's vocabulary of {} tokens",
                    model.n_vocab
                )));
            }
            Prompt::Tokens(t.ids.clone())
        }
        Some(Input::TokenCount(0)) => {
            return Err(invalid("token_count is 0: give at least one prompt token"))
        }
        Some(Input::TokenCount(n)) => {
            let n = *n as usize;
            if n >= model.context {
                return Err(invalid(format!(
                    "token_count is {n} but the context holds {}: leave room for a decode \
                     step",
                    model.context
                )));
            }
            // Any ids will do: the profile times the model, not the text.
            Prompt::Tokens(
                (0..n)
                    .map(|i| ((i * 7919 + 13) % model.n_vocab) as u32)
                    .collect(),
            )
        }
    };
    let prompt = prompt_tokens(&prompt, model.tokenizer, model.context).map_err(prompt_error)?;
    let room = model.context - prompt.len();
    let steps = match req.steps as usize {
        0 => DEFAULT_PROFILE_STEPS.min(room),
        n => n,
    };
    if steps == 0 || steps > room {
        return Err(invalid(format!(
            "the prompt has {} tokens and {} decode steps were asked for, beyond the context \
             of {}: ask for at most {room} steps or shorten the prompt",
            prompt.len(),
            steps.max(1),
            model.context
        )));
    }
    Ok(ValidProfile { prompt, steps })
}

#[allow(clippy::result_large_err)]
fn check_prompt_bytes(n: usize) -> Result<(), Status> {
    if n > MAX_PROMPT_BYTES {
        return Err(invalid(format!(
            "the prompt has {n} bytes; at most {MAX_PROMPT_BYTES} are accepted"
        )));
    }
    Ok(())
}

#[allow(clippy::result_large_err)]
fn sampling(p: Option<&pb::SamplingParams>) -> Result<SamplerConfig, Status> {
    let d = SamplerConfig::default();
    let Some(p) = p else { return Ok(d) };
    let range = |name: &str, v: f32, ok: bool, what: &str| {
        if v.is_finite() && ok {
            Ok(())
        } else {
            Err(invalid(format!(
                "sampling.{name} is {v}; it must be {what}"
            )))
        }
    };
    range(
        "temperature",
        p.temperature,
        (0.0..=100.0).contains(&p.temperature),
        "between 0 (greedy) and 100",
    )?;
    range(
        "top_p",
        p.top_p,
        (0.0..=1.0).contains(&p.top_p),
        "in (0, 1], or 0 for off",
    )?;
    range(
        "min_p",
        p.min_p,
        (0.0..=1.0).contains(&p.min_p),
        "between 0 and 1",
    )?;
    range(
        "repetition_penalty",
        p.repetition_penalty,
        (0.0..=10.0).contains(&p.repetition_penalty),
        "in (0, 10], or 0 for off",
    )?;
    Ok(SamplerConfig {
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
        min_p: p.min_p,
        repetition_penalty: if p.repetition_penalty == 0.0 {
            1.0
        } else {
            p.repetition_penalty
        },
        seed: p.seed.unwrap_or(0),
        ..d
    })
}

/// The `grpc-timeout` header as a duration (`<digits><unit>`, units H M S m u n).
pub fn grpc_timeout(header: &str) -> Option<Duration> {
    let (digits, unit) = header.split_at(header.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(render: &dyn Fn(&[pb::ChatMessage]) -> Result<String, String>) -> ModelLimits<'_> {
        ModelLimits {
            tokenizer: None,
            n_vocab: 100,
            context: 16,
            render_chat: render,
        }
    }

    fn tokens(ids: &[u32]) -> Option<pb::generate_request::Input> {
        Some(pb::generate_request::Input::Tokens(pb::TokenIds {
            ids: ids.to_vec(),
        }))
    }

    fn check(req: pb::GenerateRequest) -> Result<ValidRequest, Status> {
        generate_request(&req, &limits(&|_| Ok(String::new())))
    }

    fn refused(req: pb::GenerateRequest, says: &str) {
        let e = check(req).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains(says),
            "{:?} lacks {says:?}",
            e.message()
        );
    }

    #[test]
    fn a_good_request_gets_defaults_within_the_context() {
        let v = check(pb::GenerateRequest {
            input: tokens(&[1, 2, 3]),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(v.prompt, [1, 2, 3]);
        assert_eq!(
            v.options.max_tokens, 13,
            "the default is capped by the context"
        );
        assert_eq!(v.options.sampling, SamplerConfig::default());
    }

    #[test]
    fn bad_requests_are_refused_with_what_to_change() {
        let base = || pb::GenerateRequest {
            input: tokens(&[1, 2]),
            ..Default::default()
        };
        refused(
            pb::GenerateRequest {
                input: None,
                ..base()
            },
            "no input",
        );
        refused(
            pb::GenerateRequest {
                input: tokens(&[]),
                ..base()
            },
            "empty",
        );
        refused(
            pb::GenerateRequest {
                input: tokens(&[100]),
                ..base()
            },
            "vocabulary",
        );
        refused(
            pb::GenerateRequest {
                max_tokens: 15,
                ..base()
            },
            "at most 14",
        );
        refused(
            pb::GenerateRequest {
                input: tokens(&[1; 16]),
                ..base()
            },
            "context holds 16",
        );
        refused(
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                }),
                ..base()
            },
            "sampling.temperature",
        );
        refused(
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams {
                    top_p: f32::NAN,
                    ..Default::default()
                }),
                ..base()
            },
            "sampling.top_p",
        );
        refused(
            pb::GenerateRequest {
                stop: vec![String::new()],
                ..base()
            },
            "stop string",
        );
        refused(
            pb::GenerateRequest {
                top_logprobs: 21,
                ..base()
            },
            "top_logprobs",
        );
        refused(
            pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Text(
                    "x".repeat(MAX_PROMPT_BYTES + 1),
                )),
                ..base()
            },
            "bytes",
        );
        refused(
            pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Text("hi".into())),
                ..base()
            },
            "tokenizer",
        );
    }

    #[test]
    fn profile_requests_need_an_input_that_leaves_room_for_the_steps() {
        use pb::profile_request::Input;
        let check = |input: Option<Input>, steps: u32| {
            profile_request(
                &pb::ProfileRequest {
                    model: String::new(),
                    input,
                    steps,
                },
                &limits(&|_| Ok(String::new())),
            )
        };
        let ok = check(Some(Input::TokenCount(4)), 0).unwrap();
        assert_eq!((ok.prompt.len(), ok.steps), (4, 8));
        assert!(ok.prompt.iter().all(|&t| t < 100));
        let ok = check(Some(Input::Tokens(pb::TokenIds { ids: vec![1, 2] })), 3);
        assert_eq!(
            ok.unwrap(),
            ValidProfile {
                prompt: vec![1, 2],
                steps: 3
            }
        );
        // The default is capped by the context.
        assert_eq!(check(Some(Input::TokenCount(12)), 0).unwrap().steps, 4);
        for (input, steps, says) in [
            (None, 1, "no input"),
            (Some(Input::TokenCount(0)), 1, "token_count is 0"),
            (Some(Input::TokenCount(16)), 1, "context holds 16"),
            (Some(Input::TokenCount(u32::MAX)), 1, "context holds 16"),
            (Some(Input::TokenCount(4)), 13, "at most 12 steps"),
            (Some(Input::TokenCount(4)), 5000, "at most 1024"),
            (
                Some(Input::Tokens(pb::TokenIds { ids: vec![] })),
                1,
                "empty",
            ),
            (
                Some(Input::Tokens(pb::TokenIds { ids: vec![100] })),
                1,
                "vocabulary",
            ),
            (Some(Input::Text("hi".into())), 1, "tokenizer"),
        ] {
            let e = check(input, steps).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(
                e.message().contains(says),
                "{:?} lacks {says:?}",
                e.message()
            );
        }
    }

    #[test]
    fn grpc_timeouts_parse_in_every_unit() {
        assert_eq!(grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(grpc_timeout("5x"), None);
        assert_eq!(grpc_timeout("S"), None);
        assert_eq!(grpc_timeout("123456789S"), None);
    }
}
