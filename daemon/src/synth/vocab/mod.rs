//! Real tokenizer metadata for synthetic models: a SentencePiece (`"llama"`) or GPT-2 byte-level
//! BPE (`"gpt2"`) vocabulary whose merges actually merge.
//!
//! The first merges are learnt from `corpus.txt` (a few KB of English prose written for this
//! project), so common English tokenizes into multi-byte pieces; seeded merges then fill the
//! vocabulary to the preset's size. Special tokens sit at their real ids for real-size presets.

mod bpe;

use crate::gguf::{Array, Value};

use super::presets::{Preset, SpecialLayout, TokenizerKind};
use super::rng::Xoshiro256;
use bpe::{count_words, pre_tokenize, Bpe};

const CORPUS: &str = include_str!("corpus.txt");

/// llama.cpp's `llama_token_type` values (`tokenizer.ggml.token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// SentencePiece's word-boundary marker, U+2581.
const SPM_SPACE: char = '\u{2581}';

const LLAMA3_TEMPLATE: &str = "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";
const CHATML_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
const MISTRAL_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}";

#[derive(Debug, thiserror::Error)]
pub enum VocabError {
    #[error("vocabulary of {n_vocab} tokens is too small for {needed} base and special tokens")]
    TooSmall { n_vocab: u32, needed: usize },
}

/// Everything `tokenizer.ggml.*` holds.
#[derive(Debug, Clone)]
pub struct Vocab {
    pub model: &'static str,
    pub pre: Option<&'static str>,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub scores: Option<Vec<f32>>,
    /// `"left right"` pairs, highest priority first.
    pub merges: Option<Vec<String>>,
    pub bos: u32,
    pub eos: u32,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub chat_template: &'static str,
}

impl Vocab {
    pub fn metadata(&self) -> Vec<(String, Value)> {
        let mut m: Vec<(String, Value)> = Vec::new();
        let mut put = |k: &str, v: Value| m.push((format!("tokenizer.ggml.{k}"), v));
        put("model", Value::String(self.model.into()));
        if let Some(pre) = self.pre {
            put("pre", Value::String(pre.into()));
        }
        put("tokens", Value::Array(Array::String(self.tokens.clone())));
        if let Some(scores) = &self.scores {
            put("scores", Value::Array(Array::F32(scores.clone())));
        }
        put(
            "token_type",
            Value::Array(Array::I32(self.token_types.clone())),
        );
        if let Some(merges) = &self.merges {
            put("merges", Value::Array(Array::String(merges.clone())));
        }
        put("bos_token_id", Value::U32(self.bos));
        put("eos_token_id", Value::U32(self.eos));
        if let Some(unk) = self.unk {
            put("unknown_token_id", Value::U32(unk));
        }
        if let Some(pad) = self.pad {
            put("padding_token_id", Value::U32(pad));
        }
        put("add_bos_token", Value::Bool(self.add_bos));
        put("add_eos_token", Value::Bool(false));
        m.push((
            "tokenizer.chat_template".into(),
            Value::String(self.chat_template.into()),
        ));
        m
    }
}

/// Builds the vocabulary of `preset`; the same seed gives the same vocabulary.
pub fn build(preset: &Preset, seed: u64) -> Result<Vocab, VocabError> {
    let mut rng = Xoshiro256::for_stream(seed, "tokenizer");
    match preset.tokenizer {
        TokenizerKind::SentencePiece => sentencepiece(preset.n_vocab, &mut rng),
        TokenizerKind::Llama3 | TokenizerKind::Qwen2 => byte_level(preset, &mut rng),
    }
}

/// GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the others are shifted to
/// U+0100.. so every byte is a visible character. Returned in GPT-2's order, which is also the
/// id order of the 256 single-byte tokens in Llama 3 and Qwen2.
pub fn byte_chars() -> Vec<(u8, char)> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut out: Vec<(u8, char)> = (0..=255u8)
        .filter(|&b| printable(b))
        .map(|b| (b, char::from(b)))
        .collect();
    for (n, b) in (0..=255u8).filter(|&b| !printable(b)).enumerate() {
        out.push((b, char::from_u32(256 + n as u32).unwrap_or('?')));
    }
    out
}

fn byte_level(preset: &Preset, rng: &mut Xoshiro256) -> Result<Vocab, VocabError> {
    let qwen = preset.tokenizer == TokenizerKind::Qwen2;
    let specials = special_tokens(preset);
    let n_vocab = preset.n_vocab as usize;
    let n_bpe = match preset.specials {
        SpecialLayout::Llama30 | SpecialLayout::Llama31 => 128_000,
        SpecialLayout::Qwen => 151_643,
        SpecialLayout::Compact => n_vocab.saturating_sub(specials.len()),
    };
    let needed = 256 + specials.len();
    if n_vocab < needed || n_bpe < 256 || n_bpe + specials.len() > n_vocab {
        return Err(VocabError::TooSmall {
            n_vocab: preset.n_vocab,
            needed,
        });
    }

    let n_merges = n_bpe - 256;
    let mut bpe = train_byte_level(CORPUS, n_merges);
    let space = byte_chars()
        .into_iter()
        .find(|&(b, _)| b == b' ')
        .map_or(' ', |(_, c)| c);
    bpe.fill(
        n_merges,
        rng,
        |s| s.starts_with(space) || s.starts_with(|c: char| c.is_ascii_alphabetic()),
        |s| s.len() <= 3 && s.chars().all(|c| c.is_ascii_lowercase()),
    );
    Ok(byte_level_vocab(bpe, specials, n_vocab, qwen))
}

/// Byte-level BPE pieces learnt from `corpus`: the 256 byte symbols, then up to `n_merges`
/// merges (fewer when no pair occurs twice any more).
fn train_byte_level(corpus: &str, n_merges: usize) -> Bpe {
    let table = byte_chars();
    let mut map = ['\0'; 256];
    for &(b, c) in &table {
        map[b as usize] = c;
    }
    let mut bpe = Bpe::new(table.iter().map(|&(_, c)| c.to_string()).collect());
    let words = count_words(pre_tokenize(corpus).into_iter().map(|w| {
        w.bytes()
            .map(|b| map[b as usize].to_string())
            .collect::<Vec<_>>()
    }));
    bpe.train(&words, n_merges);
    bpe
}

/// A Qwen2-style byte-level vocabulary of `n_vocab` tokens whose merges are all learnt from
/// `corpus` (no seeded fill): for models trained on that corpus. The compact Qwen specials
/// (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`) follow the pieces.
pub fn learned_byte_level(corpus: &str, n_vocab: u32) -> Result<Vocab, VocabError> {
    let specials = special_tokens(&QWEN_COMPACT);
    let needed = 256 + specials.len();
    if (n_vocab as usize) < needed {
        return Err(VocabError::TooSmall { n_vocab, needed });
    }
    let bpe = train_byte_level(corpus, n_vocab as usize - needed);
    Ok(byte_level_vocab(bpe, specials, n_vocab as usize, true))
}

/// Only the tokenizer fields of this preset matter to [`special_tokens`].
const QWEN_COMPACT: Preset = Preset {
    tokenizer: TokenizerKind::Qwen2,
    specials: SpecialLayout::Compact,
    ..super::presets::PRESETS[0]
};

/// The `gpt2` vocabulary of `bpe`'s pieces and merges, then `specials`, padded to `n_vocab`.
fn byte_level_vocab(bpe: Bpe, specials: Vec<(String, i32)>, n_vocab: usize, qwen: bool) -> Vocab {
    let merges = bpe
        .merges
        .iter()
        .map(|&(a, b)| format!("{} {}", bpe.pieces[a as usize], bpe.pieces[b as usize]))
        .collect();
    let mut tokens = bpe.pieces;
    let mut token_types = vec![token_type::NORMAL; tokens.len()];
    for (text, ty) in specials {
        tokens.push(text);
        token_types.push(ty);
    }
    // Rows of the embedding past the tokenizer's own tokens, as the HF converter names them.
    while tokens.len() < n_vocab {
        tokens.push(format!("[PAD{}]", tokens.len()));
        token_types.push(token_type::UNUSED);
    }
    let id = |s: &str| tokens.iter().rposition(|t| t == s).unwrap_or(0) as u32;
    let (bos, eos, pad, template) = if qwen {
        let eot = id("<|endoftext|>");
        (eot, id("<|im_end|>"), Some(eot), CHATML_TEMPLATE)
    } else {
        (
            id("<|begin_of_text|>"),
            id("<|eot_id|>"),
            None,
            LLAMA3_TEMPLATE,
        )
    };
    Vocab {
        model: "gpt2",
        pre: Some(if qwen { "qwen2" } else { "llama-bpe" }),
        tokens,
        token_types,
        scores: None,
        merges: Some(merges),
        bos,
        eos,
        unk: None,
        pad,
        // Llama 3 prepends <|begin_of_text|>; Qwen adds no BOS.
        add_bos: !qwen,
        chat_template: template,
    }
}

/// Special tokens after the BPE pieces, in id order, with their token types.
fn special_tokens(preset: &Preset) -> Vec<(String, i32)> {
    use token_type::{CONTROL, USER_DEFINED};
    let control = |names: &[&str]| -> Vec<(String, i32)> {
        names.iter().map(|n| (n.to_string(), CONTROL)).collect()
    };
    let reserved = |n: u32| format!("<|reserved_special_token_{n}|>");
    match (preset.specials, preset.tokenizer) {
        (SpecialLayout::Llama30 | SpecialLayout::Llama31, _) => {
            // Named ids first; every other slot of the 256 is a reserved token, numbered in order.
            let named: &[(u32, &str)] = if preset.specials == SpecialLayout::Llama30 {
                &[
                    (0, "<|begin_of_text|>"),
                    (1, "<|end_of_text|>"),
                    (6, "<|start_header_id|>"),
                    (7, "<|end_header_id|>"),
                    (9, "<|eot_id|>"),
                ]
            } else {
                &[
                    (0, "<|begin_of_text|>"),
                    (1, "<|end_of_text|>"),
                    (4, "<|finetune_right_pad_id|>"),
                    (6, "<|start_header_id|>"),
                    (7, "<|end_header_id|>"),
                    (8, "<|eom_id|>"),
                    (9, "<|eot_id|>"),
                    (10, "<|python_tag|>"),
                ]
            };
            let mut next_reserved = 0;
            (0..256u32)
                .map(|i| match named.iter().find(|(j, _)| *j == i) {
                    Some((_, n)) => (n.to_string(), CONTROL),
                    None => {
                        next_reserved += 1;
                        (reserved(next_reserved - 1), CONTROL)
                    }
                })
                .collect()
        }
        (SpecialLayout::Qwen, _) => {
            let mut v = control(&[
                "<|endoftext|>",
                "<|im_start|>",
                "<|im_end|>",
                "<|object_ref_start|>",
                "<|object_ref_end|>",
                "<|box_start|>",
                "<|box_end|>",
                "<|quad_start|>",
                "<|quad_end|>",
                "<|vision_start|>",
                "<|vision_end|>",
                "<|vision_pad|>",
                "<|image_pad|>",
                "<|video_pad|>",
            ]);
            // Qwen marks these as not special; the converter stores them as user-defined.
            let user = |n: &str| (n.to_string(), USER_DEFINED);
            v.extend([user("<tool_call>"), user("</tool_call>")]);
            v.extend(control(&[
                "<|fim_prefix|>",
                "<|fim_middle|>",
                "<|fim_suffix|>",
                "<|fim_pad|>",
                "<|repo_name|>",
                "<|file_sep|>",
            ]));
            for n in ["<tool_response>", "</tool_response>", "<think>", "</think>"] {
                v.push(user(n));
            }
            v
        }
        (SpecialLayout::Compact, TokenizerKind::Qwen2) => {
            let mut v = control(&["<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
            v.extend(["<think>", "</think>"].map(|n| (n.to_string(), USER_DEFINED)));
            v
        }
        (SpecialLayout::Compact, _) => control(&[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ]),
    }
}

/// A Llama-2-style SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte-fallback tokens,
/// merged pieces by descending score, then the single characters (as Llama 2's file orders them).
fn sentencepiece(n_vocab: u32, rng: &mut Xoshiro256) -> Result<Vocab, VocabError> {
    // SentencePiece never merges across a word or a script boundary: train per pre-token, with
    // the space that precedes a word turned into the marker, and whitespace left to bytes.
    let words: Vec<Vec<String>> = pre_tokenize(CORPUS)
        .into_iter()
        .filter(|w| !w.trim().is_empty())
        .map(|w| {
            w.replace(' ', &SPM_SPACE.to_string())
                .chars()
                .map(String::from)
                .collect()
        })
        .collect();
    let mut chars: Vec<(String, usize)> = Vec::new();
    for c in words.iter().flatten() {
        match chars.iter_mut().find(|(s, _)| s == c) {
            Some((_, n)) => *n += 1,
            None => chars.push((c.clone(), 1)),
        }
    }
    if !chars.iter().any(|(c, _)| c.starts_with(SPM_SPACE)) {
        chars.push((SPM_SPACE.to_string(), 0));
    }
    // Most frequent characters first, as SentencePiece scores them; stable, so ties keep order.
    chars.sort_by_key(|c| std::cmp::Reverse(c.1));
    let chars: Vec<String> = chars.into_iter().map(|(c, _)| c).collect();

    let fixed = 3 + 256 + chars.len();
    if (n_vocab as usize) < fixed + 1 {
        return Err(VocabError::TooSmall {
            n_vocab,
            needed: fixed + 1,
        });
    }
    let n_merges = n_vocab as usize - fixed;
    let mut bpe = Bpe::new(chars);
    bpe.train(&count_words(words), n_merges);
    bpe.fill(
        n_merges,
        rng,
        |s| s.starts_with(SPM_SPACE) || s.starts_with(|c: char| c.is_ascii_alphabetic()),
        |s| s.len() <= 3 && s.chars().all(|c| c.is_ascii_lowercase()),
    );

    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut token_types = vec![
        token_type::UNKNOWN,
        token_type::CONTROL,
        token_type::CONTROL,
    ];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    token_types.extend([token_type::BYTE; 256]);
    let n_base = bpe.n_base;
    // Merged pieces, then the base characters: a piece's score ranks it for merging.
    tokens.extend(bpe.pieces[n_base..].iter().cloned());
    tokens.extend(bpe.pieces[..n_base].iter().cloned());
    token_types.resize(tokens.len(), token_type::NORMAL);
    let scores = (0..tokens.len())
        .map(|i| if i < 259 { 0.0 } else { -((i - 259) as f32) })
        .collect();
    Ok(Vocab {
        model: "llama",
        pre: None,
        tokens,
        token_types,
        scores: Some(scores),
        merges: None,
        bos: 1,
        eos: 2,
        unk: Some(0),
        pad: None,
        add_bos: true,
        chat_template: MISTRAL_TEMPLATE,
    })
}

#[cfg(test)]
mod tests {
    use super::super::presets::{find, PRESETS};
    use super::*;
    use std::collections::{HashMap, HashSet};

    /// The invariants llama.cpp's BPE relies on, checked on the final token list.
    fn check_byte_level(v: &Vocab) {
        let ids: HashMap<&str, usize> = v
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i))
            .collect();
        assert_eq!(ids.len(), v.tokens.len(), "tokens are unique");
        let mut produced = HashSet::new();
        for m in v.merges.as_ref().unwrap() {
            let (a, b) = m.split_once(' ').unwrap();
            assert!(ids.contains_key(a) && ids.contains_key(b), "{m}");
            let joined = format!("{a}{b}");
            assert!(ids.contains_key(joined.as_str()), "{m}");
            assert!(produced.insert(joined), "one merge per piece: {m}");
        }
        let normal = v.token_types.iter().filter(|&&t| t == token_type::NORMAL);
        assert_eq!(normal.count(), 256 + produced.len());
    }

    #[test]
    fn tiny_byte_level_vocabularies_are_consistent() {
        for name in ["tiny-llama", "tiny-qwen3", "tiny-qwen3moe"] {
            let p = find(name).unwrap();
            let v = build(p, 1).unwrap();
            assert_eq!(v.tokens.len(), p.n_vocab as usize);
            check_byte_level(&v);
            // Corpus training produced real English pieces.
            assert!(v.tokens.iter().any(|t| t == "Ġthe"));
        }
    }

    #[test]
    fn real_llama3_and_qwen_specials_sit_at_their_ids() {
        let v = build(find("llama-3.2-1b").unwrap(), 0).unwrap();
        assert_eq!(v.tokens.len(), 128_256);
        assert_eq!(v.merges.as_ref().unwrap().len(), 127_744);
        assert_eq!(v.tokens[128_000], "<|begin_of_text|>");
        assert_eq!(v.tokens[128_009], "<|eot_id|>");
        assert_eq!(v.tokens[128_011], "<|reserved_special_token_3|>");
        assert_eq!(v.tokens[128_255], "<|reserved_special_token_247|>");
        assert_eq!((v.bos, v.eos), (128_000, 128_009));
        check_byte_level(&v);

        let v = build(find("qwen3-30b-a3b").unwrap(), 0).unwrap();
        assert_eq!(v.tokens.len(), 151_936);
        assert_eq!(v.tokens[151_643], "<|endoftext|>");
        assert_eq!(v.tokens[151_645], "<|im_end|>");
        assert_eq!(v.tokens[151_668], "</think>");
        assert_eq!(v.tokens[151_669], "[PAD151669]");
        assert_eq!((v.bos, v.eos, v.pad), (151_643, 151_645, Some(151_643)));
        check_byte_level(&v);
    }

    #[test]
    fn sentencepiece_vocabulary_has_bytes_and_mergeable_pieces() {
        for p in PRESETS
            .iter()
            .filter(|p| p.tokenizer == TokenizerKind::SentencePiece)
        {
            let v = build(p, 0).unwrap();
            assert_eq!(v.tokens.len(), p.n_vocab as usize);
            assert_eq!(v.tokens[3], "<0x00>");
            assert_eq!(v.tokens[258], "<0xFF>");
            let set: HashSet<&String> = v.tokens.iter().collect();
            assert_eq!(set.len(), v.tokens.len());
            // Every multi-character piece splits into two pieces that exist.
            for t in &v.tokens[259..] {
                let chars: Vec<char> = t.chars().collect();
                if chars.len() > 1 {
                    let ok = (1..chars.len()).any(|k| {
                        let (a, b): (String, String) =
                            (chars[..k].iter().collect(), chars[k..].iter().collect());
                        set.contains(&a) && set.contains(&b)
                    });
                    assert!(ok, "{t}");
                }
            }
            assert!(v.tokens.iter().any(|t| t == "▁the"));
        }
    }

    #[test]
    fn same_seed_same_vocabulary() {
        let p = find("tiny-mixtral").unwrap();
        assert_eq!(build(p, 9).unwrap().tokens, build(p, 9).unwrap().tokens);
        assert_ne!(build(p, 9).unwrap().tokens, build(p, 10).unwrap().tokens);
    }
}
