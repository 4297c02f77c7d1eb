//! Writes the seed corpora of the fuzz targets into `DIR/<target>/`, from the synthetic models:
//! micro versions of the tiny presets (same layouts and tokenizers, smallest shapes) as GGUF
//! files, text and token ids of their vocabularies, their chat templates, and requests.
//!
//! Usage: `seeds DIR` (`fuzz/seed.sh` builds and runs it).

// Links libFuzzer, which defines the coverage hooks of the instrumented build.
use libfuzzer_sys as _;

use std::fs;
use std::path::{Path, PathBuf};

use prost::Message;
use spillway_daemon::server::chat::CHATML;
use spillway_daemon::synth::presets::{self, Preset};
use spillway_daemon::synth::{SynthModel, WeightType};
use spillway_daemon::tokenizer::EncodeOptions;
use spillway_fuzz::{tokenizers, vocab_metadata, PRESETS, SEED};
use spillway_proto::v1 as pb;

const CORPUS: &str = include_str!("../../../daemon/src/synth/vocab/corpus.txt");

/// Texts beyond the corpus: special tokens, spaces, non-Latin scripts, SentencePiece's marker.
const TEXTS: &[&str] = &[
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<s>[INST] Hello [/INST] Hi</s>",
    "  two leading spaces, a tab\there,\r\nand CRLF  ",
    "don't ? isn't ! it 's 've 're",
    "12345 678.9 3.14159e-10",
    "héllo wörld — “quotes” ½ €100",
    "日本語のテキスト 中文 한국어",
    "emoji 🦀🎉👩‍👩‍👧 and ZWJ",
    "\u{2581}marker\u{2581}\u{2581}spaces",
    "<think>\nreasoning\n</think>\n",
];

fn main() {
    let dir = PathBuf::from(std::env::args().nth(1).expect("usage: seeds DIR"));
    gguf(&dir.join("gguf_reader"));
    tokenizer(&dir.join("tokenizer"));
    chat_template(&dir.join("chat_template"));
    request_validation(&dir.join("request_validation"));
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    fs::create_dir_all(dir).expect("create the corpus folder");
    fs::write(dir.join(name), bytes).expect("write a seed");
}

/// A tiny preset shrunk to the smallest shapes that keep its layout.
fn micro(p: &Preset) -> &'static Preset {
    Box::leak(Box::new(Preset {
        n_vocab: 384,
        n_embd: 32,
        n_layer: 1,
        n_head: 2,
        n_head_kv: 1,
        head_dim: 16,
        n_ff: 64,
        context: 64,
        experts: p.experts.map(|e| presets::Experts {
            count: 4,
            used: 2,
            // Mixtral's experts are as wide as `feed_forward_length`.
            n_ff: 64,
            shared_n_ff: e.shared_n_ff.map(|_| 64),
        }),
        ..p.clone()
    }))
}

fn gguf(dir: &Path) {
    fs::create_dir_all(dir).expect("create the corpus folder");
    for p in presets::PRESETS.iter().filter(|p| p.is_tiny()) {
        for ty in ["F32", "F16", "Q8_0", "Q4_0", "Q4_K_M"] {
            let weights: WeightType = ty.parse().expect("a weight type");
            let model = SynthModel::new(micro(p), weights, SEED).expect("micro presets build");
            let name = format!("{}-{ty}", p.name.replace("tiny", "micro"));
            model
                .write(dir.join(name), false, |_, _| {})
                .expect("write a micro model");
        }
    }
}

fn tokenizer(dir: &Path) {
    let texts: Vec<&str> = CORPUS
        .lines()
        .filter(|l| !l.is_empty())
        .chain(TEXTS.iter().copied())
        .collect();
    for (i, tok) in tokenizers().iter().enumerate() {
        for (j, text) in texts.iter().enumerate() {
            // Encode with and without special tokens parsed.
            for flags in [0u8, 0b11000] {
                let mut seed = vec![i as u8 | flags];
                seed.extend_from_slice(text.as_bytes());
                write(dir, &format!("{}-encode-{j}-{flags}", PRESETS[i]), &seed);
            }
            let opts = EncodeOptions {
                add_special: true,
                parse_special: true,
            };
            let mut seed = vec![i as u8 | 4];
            for id in tok.encode_with(text, opts) {
                seed.extend_from_slice(&(id as u16).to_le_bytes());
            }
            write(dir, &format!("{}-decode-{j}", PRESETS[i]), &seed);
        }
    }
}

fn chat_template(dir: &Path) {
    let chat = "\0system\0Be brief.\0user\0Hello  \0assistant\0Hi!\0user\0And now?";
    let mut templates: Vec<String> = PRESETS
        .iter()
        .map(|p| {
            let md = vocab_metadata(p);
            md.get_str("tokenizer.chat_template")
                .expect("presets have templates")
                .to_owned()
        })
        .collect();
    templates.push(CHATML.to_owned());
    templates.extend(
        [
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('no system') }}{% endif %}\
             {% for m in messages %}{{ loop.index }}:{{ m.role | upper }}={{ m.content.strip() }}\
             {% if not loop.last %}, {% endif %}{% endfor %}",
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}\
             {% endfor %}{{ ns.n }} {{ messages | map(attribute='role') | join(',') }}",
            "{%- for m in messages[::-1] %}{{ m['content'].split(' ')[0] | tojson }}{% endfor -%}",
            "{% macro r(x) %}{{ x ~ bos_token ~ eos_token }}{% endmacro %}{{ r(messages | length) }}",
        ]
        .map(str::to_owned),
    );
    for (i, t) in templates.iter().enumerate() {
        write(
            dir,
            &format!("template-{i}"),
            format!("{t}{chat}").as_bytes(),
        );
    }
}

fn request_validation(dir: &Path) {
    use pb::generate_request::Input;
    let sampling = pb::SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        repetition_penalty: 1.1,
        seed: Some(7),
    };
    let chat = pb::ChatMessages {
        messages: vec![
            pb::ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            pb::ChatMessage {
                role: "user".into(),
                content: "Hello".into(),
            },
        ],
    };
    let generate = [
        pb::GenerateRequest {
            input: Some(Input::Text("In the beginning".into())),
            ..Default::default()
        },
        pb::GenerateRequest {
            input: Some(Input::Tokens(pb::TokenIds {
                ids: vec![1, 2, 3, 300],
            })),
            max_tokens: 8,
            sampling: Some(sampling),
            stop: vec!["\n".into(), "The end".into()],
            top_logprobs: 5,
            prompt_logprobs: 2,
            logprobs: true,
            ..Default::default()
        },
        pb::GenerateRequest {
            input: Some(Input::Chat(chat)),
            max_tokens: 4,
            ..Default::default()
        },
    ];
    use pb::profile_request::Input as P;
    let profile = [
        pb::ProfileRequest {
            input: Some(P::Text("Once upon a time".into())),
            steps: 4,
            ..Default::default()
        },
        pb::ProfileRequest {
            input: Some(P::Tokens(pb::TokenIds { ids: vec![5, 6] })),
            ..Default::default()
        },
        pb::ProfileRequest {
            input: Some(P::TokenCount(12)),
            steps: 2,
            ..Default::default()
        },
    ];
    // Every model, at the 256- and 2048-position contexts.
    for model in 0..4u8 {
        for ctx in [2u8 << 3, 3 << 3] {
            for (i, r) in generate.iter().enumerate() {
                let mut seed = vec![model | ctx];
                r.encode(&mut seed).expect("encode to a Vec");
                write(dir, &format!("generate-{model}-{ctx}-{i}"), &seed);
            }
            for (i, r) in profile.iter().enumerate() {
                let mut seed = vec![model | 4 | ctx];
                r.encode(&mut seed).expect("encode to a Vec");
                write(dir, &format!("profile-{model}-{ctx}-{i}"), &seed);
            }
        }
    }
}
