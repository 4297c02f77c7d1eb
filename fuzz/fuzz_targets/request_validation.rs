//! Arbitrary protobuf bytes as a Generate or Profile request, checked by the server's
//! validation against a synthetic model, as the service does before any compute.
//!
//! Input: the first byte picks the model (bits 0-1: the SentencePiece, Llama 3 or Qwen2
//! synthetic vocabulary and its chat template, or 3: no tokenizer), the RPC (bit 2: Generate or
//! Profile) and the context (bits 3-4: 1, 16, 256 or 2048 positions); the rest is the message.
//!
//! Checked: a refusal is INVALID_ARGUMENT; an accepted request has a prompt of known ids that
//! leaves room in the context for what it asks to generate.

#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use spillway_daemon::server::validate::{self, ModelLimits};
use spillway_fuzz::{chat_templates, tokenizers};
use spillway_proto::v1 as pb;
use tonic::Code;

fuzz_target!(|data: &[u8]| {
    let Some((&head, message)) = data.split_first() else {
        return;
    };
    let which = usize::from(head & 3);
    let tokenizer = tokenizers().get(which);
    let n_vocab = tokenizer.map_or(2048, |t| t.n_vocab());
    let context = [1, 16, 256, 2048][usize::from(head >> 3) & 3];
    let template = &chat_templates()[which % 3];
    let render = |m: &[pb::ChatMessage]| template.render(m);
    let limits = ModelLimits {
        tokenizer,
        n_vocab,
        context,
        render_chat: &render,
    };
    let known = |ids: &[u32]| ids.iter().all(|&id| (id as usize) < n_vocab);
    if head & 4 == 0 {
        let Ok(req) = pb::GenerateRequest::decode(message) else {
            return;
        };
        match validate::generate_request(&req, &limits) {
            Ok(v) => {
                assert!(!v.prompt.is_empty() && known(&v.prompt), "{v:?}");
                let room = context - v.prompt.len();
                assert!((1..=room).contains(&v.options.max_tokens), "{v:?}");
                let s = &v.options.sampling;
                assert!(
                    s.temperature.is_finite() && s.top_p > 0.0 && s.top_p <= 1.0,
                    "{s:?}"
                );
            }
            Err(status) => assert_eq!(status.code(), Code::InvalidArgument, "{status:?}"),
        }
    } else {
        let Ok(req) = pb::ProfileRequest::decode(message) else {
            return;
        };
        match validate::profile_request(&req, &limits) {
            Ok(v) => {
                assert!(!v.prompt.is_empty() && known(&v.prompt), "{v:?}");
                assert!((1..=context - v.prompt.len()).contains(&v.steps), "{v:?}");
            }
            Err(status) => assert_eq!(status.code(), Code::InvalidArgument, "{status:?}"),
        }
    }
});
