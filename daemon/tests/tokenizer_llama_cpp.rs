//! The tokenizer against llama.cpp: fixtures recorded by `scripts/fixtures/make_tokenizer_fixtures.py`
//! from llama-cpp-python on vocab-only GGUF files of the synthetic generator's tiny presets
//! (committed beside them in `tests/data/tokenizer/`). Token ids, pieces and detokenized bytes
//! must be identical.

use std::path::PathBuf;

// The `spillwayd tokenize` subcommand lives in the binary; compile it here to test it.
// (`run` itself writes to stdout, which tests do not capture: they call `write_tokens`.)
#[allow(dead_code)]
#[path = "../src/cli/tokenize.rs"]
mod cli_tokenize;

use serde_json::Value as Json;
use spillway_daemon::gguf::GgufFile;
use spillway_daemon::tokenizer::{DecodeOptions, Detokenizer, EncodeOptions, Tokenizer, VocabKind};

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer")
}

struct Fixture {
    json: Json,
    tokenizer: Tokenizer,
}

fn load(preset: &str) -> Fixture {
    load_from(&data_dir(), preset)
}

fn load_from(dir: &std::path::Path, preset: &str) -> Fixture {
    let text = std::fs::read_to_string(dir.join(format!("{preset}.json"))).unwrap();
    let json: Json = serde_json::from_str(&text).unwrap();
    let vocab = dir.join(json["vocab_file"].as_str().unwrap());
    // Vocab-only files have no tensors, which the architecture checks would refuse.
    let file = GgufFile::open_structure_only(&vocab).unwrap();
    let tokenizer = Tokenizer::from_metadata(file.metadata()).unwrap();
    Fixture { json, tokenizer }
}

fn ids(v: &Json) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn hex(v: &Json) -> Vec<u8> {
    let s = v.as_str().unwrap();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Collects every mismatch so one run shows them all.
#[derive(Default)]
struct Mismatches(Vec<String>);

impl Mismatches {
    fn check<T: PartialEq + std::fmt::Debug>(
        &mut self,
        what: &str,
        text: &str,
        ours: T,
        theirs: T,
    ) {
        if ours != theirs {
            self.0.push(format!(
                "{what} of {text:?}:\n  ours:      {ours:?}\n  llama.cpp: {theirs:?}"
            ));
        }
    }

    fn assert_none(self, preset: &str) {
        assert!(
            self.0.is_empty(),
            "{preset}: {} mismatches with llama.cpp:\n{}",
            self.0.len(),
            self.0
                .iter()
                .take(20)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

fn check_header(f: &Fixture) {
    let t = &f.tokenizer;
    assert_eq!(t.n_vocab() as u64, f.json["n_vocab"].as_u64().unwrap());
    assert_eq!(t.bos().map(u64::from), f.json["bos"].as_u64());
    assert_eq!(t.eos().map(u64::from), f.json["eos"].as_u64());
    assert_eq!(t.add_bos(), f.json["add_bos"].as_bool().unwrap());
}

fn check_pieces(preset: &str, f: &Fixture) {
    let mut m = Mismatches::default();
    for (key, special) in [("pieces", false), ("pieces_special", true)] {
        for (id, p) in f.json[key].as_array().unwrap().iter().enumerate() {
            let what = format!("{key}[{id}]");
            m.check(
                &what,
                "",
                f.tokenizer.token_to_piece(id as u32, special),
                &hex(p)[..],
            );
        }
    }
    m.assert_none(preset);
}

fn check_cases(preset: &str, f: &Fixture) {
    let t = &f.tokenizer;
    let mut m = Mismatches::default();
    let opts = |add_special, parse_special| EncodeOptions {
        add_special,
        parse_special,
    };
    for case in f.json["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let plain = t.encode_with(text, opts(false, false));
        let bos = t.encode_with(text, opts(true, false));
        let special = t.encode_with(text, opts(true, true));
        m.check("ids", text, &plain, &ids(&case["ids"]));
        m.check("ids_bos", text, &bos, &ids(&case["ids_bos"]));
        m.check("ids_special", text, &special, &ids(&case["ids_special"]));

        // Decode llama.cpp's own ids, so a tokenize mismatch does not hide a decode one.
        let dec = |key: &str, opts: DecodeOptions| t.detokenize(&ids(&case[key]), opts);
        let keep = DecodeOptions::default();
        let strip_show = DecodeOptions {
            remove_special: true,
            unparse_special: true,
        };
        m.check("decode", text, dec("ids", keep), hex(&case["decode"]));
        m.check(
            "decode_bos",
            text,
            dec("ids_bos", keep),
            hex(&case["decode_bos"]),
        );
        m.check(
            "decode_special",
            text,
            dec("ids_special", strip_show),
            hex(&case["decode_special"]),
        );
    }
    m.assert_none(preset);
}

/// Streaming the ids of a text gives the text back: exactly for byte-level BPE, after the
/// space prefix for SentencePiece (llama.cpp's `decode` strips it again).
fn check_round_trip(preset: &str, f: &Fixture) {
    let t = &f.tokenizer;
    let mut m = Mismatches::default();
    for case in f.json["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        if t.kind() == VocabKind::Spm && text.contains('\u{2581}') {
            // A literal `▁` decodes as a space in SentencePiece, in llama.cpp too.
            continue;
        }
        let ids = t.encode(text, false);
        let mut d = Detokenizer::new(t, false);
        let mut streamed: String = ids.iter().map(|&id| d.push(id)).collect();
        streamed.push_str(&d.finish());
        let expected = match t.kind() {
            VocabKind::Spm if !text.is_empty() => format!(" {text}"),
            _ => text.to_owned(),
        };
        m.check("streamed", text, &streamed, &expected);
        if t.kind() == VocabKind::Spm || preset == "tiny-qwen3" {
            // No clean_up_tokenization_spaces for these: decode is the exact inverse.
            m.check("decode(encode)", text, t.decode(&ids), text.to_owned());
        }
    }
    m.assert_none(preset);
}

fn check_preset(preset: &str) {
    check(preset, &load(preset));
}

fn check(preset: &str, f: &Fixture) {
    check_header(f);
    check_pieces(preset, f);
    check_cases(preset, f);
    check_round_trip(preset, f);
}

#[test]
fn llama3_bpe_ids_match_llama_cpp() {
    check_preset("tiny-llama");
}

#[test]
fn qwen2_bpe_ids_match_llama_cpp() {
    check_preset("tiny-qwen3");
}

#[test]
fn sentencepiece_ids_match_llama_cpp() {
    check_preset("tiny-mixtral");
}

/// Fixtures made elsewhere, e.g. for the real-size presets, whose vocab files are too large to
/// commit: `python3 scripts/fixtures/make_tokenizer_fixtures.py --presets llama-3.2-1b,qwen3-0.6b
/// --out /tmp/tok` then `SPILLWAY_TOKENIZER_FIXTURES=/tmp/tok cargo test -p spillway-daemon
/// --test tokenizer_llama_cpp`. Without the variable this test checks nothing.
#[test]
fn fixtures_from_the_environment_match_llama_cpp() {
    let Some(dir) = std::env::var_os("SPILLWAY_TOKENIZER_FIXTURES") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            let preset = path.file_stem().unwrap().to_str().unwrap().to_owned();
            check(&preset, &load_from(&dir, &preset));
            n += 1;
        }
    }
    assert!(n > 0, "no fixtures in {}", dir.display());
}

#[test]
fn fixtures_name_their_llama_cpp_version() {
    for preset in ["tiny-llama", "tiny-qwen3", "tiny-mixtral"] {
        let f = load(preset);
        assert!(f.json["llama_cpp_python"]
            .as_str()
            .is_some_and(|v| !v.is_empty()));
        assert!(f.json["cases"].as_array().unwrap().len() > 100);
    }
}

#[test]
fn tokenize_command_reads_a_vocab_only_file() {
    let args = |json| cli_tokenize::TokenizeArgs {
        model: data_dir().join("tiny-qwen3.vocab.gguf"),
        text: "<|im_start|>user\nHello<|im_end|>".into(),
        parse_special: true,
        json,
    };
    let mut out = Vec::new();
    cli_tokenize::write_tokens(&args(false), &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.starts_with("  2044 -> \"<|im_start|>\"\n"), "{text}");
    assert!(text.ends_with("  2045 -> \"<|im_end|>\"\n"), "{text}");

    let mut out = Vec::new();
    cli_tokenize::write_tokens(&args(true), &mut out).unwrap();
    let json: Json = serde_json::from_slice(&out).unwrap();
    let f = load("tiny-qwen3");
    let expected = f.tokenizer.encode_with(
        "<|im_start|>user\nHello<|im_end|>",
        EncodeOptions {
            add_special: true,
            parse_special: true,
        },
    );
    assert_eq!(ids(&json["ids"]), expected);

    let mut missing = args(false);
    missing.model = data_dir().join("missing.gguf");
    let err = cli_tokenize::write_tokens(&missing, &mut Vec::new()).unwrap_err();
    assert!(format!("{err:#}").contains("missing.gguf"));
}
