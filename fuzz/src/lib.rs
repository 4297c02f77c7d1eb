//! What the fuzz targets share: the tokenizers of the tiny synthetic models, one per supported
//! vocabulary kind, built once per process.

use std::sync::OnceLock;

use spillway_daemon::gguf::Metadata;
use spillway_daemon::server::chat::ChatTemplate;
use spillway_daemon::synth::{presets, vocab};
use spillway_daemon::tokenizer::Tokenizer;

/// The synthetic presets whose vocabularies are fuzzed: SentencePiece, GPT-2 BPE with the
/// Llama 3 pre-tokenizer, GPT-2 BPE with the Qwen2 pre-tokenizer.
pub const PRESETS: [&str; 3] = ["tiny-mixtral", "tiny-llama", "tiny-qwen3"];

/// The seed `spillway-bench synth` uses by default, so that ids in seeds match its models.
pub const SEED: u64 = 0;

/// The `tokenizer.ggml.*` metadata (and chat template) of a synthetic preset.
pub fn vocab_metadata(preset: &str) -> Metadata {
    let preset = presets::find(preset).expect("a preset of the synth module");
    let mut md = Metadata::new();
    for (k, v) in vocab::build(preset, SEED)
        .expect("tiny vocabularies build")
        .metadata()
    {
        md.insert(k, v).expect("vocabulary keys are unique");
    }
    md
}

/// The tokenizers of [`PRESETS`], in that order.
pub fn tokenizers() -> &'static [Tokenizer; 3] {
    static TOKENIZERS: OnceLock<[Tokenizer; 3]> = OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        PRESETS.map(|p| Tokenizer::from_metadata(&vocab_metadata(p)).expect("tiny tokenizers load"))
    })
}

/// The chat templates of [`PRESETS`], with their BOS and EOS texts, as the server loads them.
pub fn chat_templates() -> &'static [ChatTemplate; 3] {
    static TEMPLATES: OnceLock<[ChatTemplate; 3]> = OnceLock::new();
    TEMPLATES.get_or_init(|| {
        let mut i = 0;
        PRESETS.map(|p| {
            let tok = &tokenizers()[i];
            i += 1;
            let text = |id: Option<u32>| id.and_then(|id| tok.token_text(id)).unwrap_or("");
            ChatTemplate::from_metadata(&vocab_metadata(p), text(tok.bos()), text(tok.eos()))
        })
    })
}
