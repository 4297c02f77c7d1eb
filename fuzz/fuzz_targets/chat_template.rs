//! An arbitrary chat template rendered over arbitrary messages through the server's sandboxed
//! renderer (fuel limit, output bound). It must give text or an error, never panic or hang
//! (libFuzzer's `-timeout` catches a hang).
//!
//! Input: NUL-separated fields: the template source, then role and content of each message.

#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway_daemon::gguf::{Metadata, Value};
use spillway_daemon::server::chat::ChatTemplate;
use spillway_proto::v1::ChatMessage;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut fields = text.split('\0');
    let source = fields.next().unwrap_or_default();
    let rest: Vec<&str> = fields.collect();
    let messages: Vec<ChatMessage> = rest
        .chunks(2)
        .map(|m| ChatMessage {
            role: m[0].to_owned(),
            content: m.get(1).copied().unwrap_or_default().to_owned(),
        })
        .collect();
    let mut md = Metadata::new();
    md.insert("tokenizer.chat_template", Value::String(source.to_owned()))
        .expect("one key");
    let template = ChatTemplate::from_metadata(&md, "<s>", "</s>");
    match template.render(&messages) {
        Ok(prompt) => assert!(prompt.len() <= 2 << 20, "{} bytes", prompt.len()),
        Err(e) => assert!(!e.is_empty()),
    }
});
