//! Reading `tokenizer.ggml.*` into a [`Vocab`]: tokens, scores, attributes, merges, special ids
//! and flags, with llama.cpp's defaults and its fix-ups (`llama_vocab::impl::load`).

use std::collections::HashMap;

use crate::gguf::{Array, Metadata, Value};

use super::pretokenize::PreTokenizer;
use super::{TokenAttr, TokenizerError};

/// `tokenizer.ggml.model` and, for BPE, the pre-tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    /// SentencePiece-style (`"llama"`): score-driven bigram merges, byte fallback.
    Spm,
    /// GPT-2 byte-level BPE (`"gpt2"`): rank-driven merges after a regex pre-tokenizer.
    Bpe(PreTokenizer),
}

#[derive(Debug, Clone)]
pub(crate) struct Vocab {
    pub kind: VocabKind,
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub attrs: Vec<TokenAttr>,
    pub token_to_id: HashMap<String, u32>,
    /// (left id, right id) -> rank, first occurrence wins as in llama.cpp.
    pub bpe_ranks: HashMap<(u32, u32), u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub eog: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// Llama 3: a pre-tokenized word that is itself a token is not merged.
    pub ignore_merges: bool,
    /// `clean_up_tokenization_spaces`, applied by `detokenize`.
    pub clean_spaces: bool,
}

const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";

/// Texts llama.cpp treats as end-of-generation whatever their token type (and then forces to
/// CONTROL), from `llama_vocab::impl::load`.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
];

/// Texts llama.cpp takes as the end-of-turn token when `eot_token_id` is absent.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle texts that llama.cpp also forces to CONTROL.
const FIM_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// What llama.cpp's `load` sets for a BPE `tokenizer.ggml.pre`.
struct BpeConfig {
    pre: PreTokenizer,
    ignore_merges: bool,
    add_bos: bool,
    clean_spaces: bool,
}

fn bpe_config(pre: Option<&str>) -> Result<BpeConfig, TokenizerError> {
    let config = |pre, ignore_merges, add_bos, clean_spaces| BpeConfig {
        pre,
        ignore_merges,
        add_bos,
        clean_spaces,
    };
    Ok(match pre {
        Some(
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
            | "lfm2",
        ) => config(PreTokenizer::Llama3, true, true, true),
        Some("dbrx" | "smaug-bpe") => config(PreTokenizer::Llama3, false, false, true),
        Some("qwen2" | "deepseek-r1-qwen") => config(PreTokenizer::Qwen2, false, false, false),
        Some("megrez") => config(PreTokenizer::Qwen2, false, false, true),
        other => {
            return Err(TokenizerError::UnsupportedPreTokenizer {
                pre: other.unwrap_or("(missing)").to_owned(),
            })
        }
    })
}

impl Vocab {
    pub fn from_metadata(md: &Metadata) -> Result<Vocab, TokenizerError> {
        let model = md
            .opt_str("tokenizer.ggml.model")?
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.model"))?;
        let pre = md.opt_str("tokenizer.ggml.pre")?;
        let (kind, ignore_merges, mut add_bos, clean_spaces, add_space_prefix) = match model {
            "llama" => (VocabKind::Spm, false, true, false, true),
            "gpt2" => {
                let c = bpe_config(pre)?;
                (
                    VocabKind::Bpe(c.pre),
                    c.ignore_merges,
                    c.add_bos,
                    c.clean_spaces,
                    false,
                )
            }
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    model: other.to_owned(),
                })
            }
        };
        let add_space_prefix = md
            .opt_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(add_space_prefix);

        let raw_tokens = md
            .opt_string_array(KEY_TOKENS)?
            .ok_or(TokenizerError::MissingKey(KEY_TOKENS))?;
        if raw_tokens.is_empty() {
            return Err(TokenizerError::EmptyVocab);
        }
        let n = raw_tokens.len();
        if n > i32::MAX as usize {
            return Err(TokenizerError::VocabTooLarge { n_tokens: n });
        }

        let scores: Vec<f32> = match md.get(KEY_SCORES) {
            None => vec![0.0; n],
            Some(Value::Array(Array::F32(s))) => s.clone(),
            Some(Value::Array(Array::I32(s))) => s.iter().map(|&x| x as f32).collect(),
            Some(_) => {
                return Err(TokenizerError::WrongType {
                    key: KEY_SCORES,
                    expected: "array of f32 or i32",
                })
            }
        };
        if scores.len() < n {
            return Err(TokenizerError::ShortArray {
                key: KEY_SCORES,
                len: scores.len(),
                n_tokens: n,
            });
        }
        let mut attrs: Vec<TokenAttr> = match md.opt_i32_array(KEY_TYPES)? {
            None => vec![TokenAttr::NORMAL; n],
            Some(types) if types.len() < n => {
                return Err(TokenizerError::ShortArray {
                    key: KEY_TYPES,
                    len: types.len(),
                    n_tokens: n,
                })
            }
            Some(types) => types[..n]
                .iter()
                .map(|&t| TokenAttr::from_type(t))
                .collect(),
        };

        let mut tokens = Vec::with_capacity(n);
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in raw_tokens.iter().enumerate() {
            // As llama.cpp: an empty token gets a placeholder text nobody can type by accident.
            let text = if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.clone()
            };
            if let Some(&first) = token_to_id.get(&text) {
                return Err(TokenizerError::DuplicateToken {
                    text,
                    first,
                    second: i as u32,
                });
            }
            token_to_id.insert(text.clone(), i as u32);
            tokens.push(text);
        }

        let bpe_ranks = match kind {
            VocabKind::Spm => HashMap::new(),
            VocabKind::Bpe(_) => {
                let merges = md
                    .opt_string_array(KEY_MERGES)?
                    .ok_or(TokenizerError::MissingKey(KEY_MERGES))?;
                let mut ranks = HashMap::with_capacity(merges.len());
                for (rank, m) in merges.iter().enumerate() {
                    // llama.cpp splits at the first space after the first byte.
                    let split = m
                        .bytes()
                        .skip(1)
                        .position(|b| b == b' ')
                        .map(|p| p + 1)
                        .ok_or_else(|| TokenizerError::InvalidMerge {
                            rank,
                            merge: m.clone(),
                        })?;
                    let (left, right) = (&m[..split], &m[split + 1..]);
                    let id = |piece: &str| {
                        token_to_id.get(piece).copied().ok_or_else(|| {
                            TokenizerError::MergeUnknownPiece {
                                rank,
                                merge: m.clone(),
                                piece: piece.to_owned(),
                            }
                        })
                    };
                    ranks.entry((id(left)?, id(right)?)).or_insert(rank as u32);
                }
                ranks
            }
        };

        // Special ids: llama.cpp's defaults per model, disabled when out of range.
        let in_range = |id: u32| (id as usize) < n;
        let (default_bos, default_eos, default_unk) = match kind {
            VocabKind::Spm => (Some(1), Some(2), Some(0)),
            VocabKind::Bpe(_) => (Some(11), Some(11), None),
        };
        let special =
            |key: &'static str, default: Option<u32>| -> Result<Option<u32>, TokenizerError> {
                match md.opt_u32(key)? {
                    None => Ok(default.filter(|&id| in_range(id))),
                    Some(id) if in_range(id) => Ok(Some(id)),
                    Some(id) => Err(TokenizerError::SpecialTokenOutOfRange {
                        key,
                        id,
                        n_tokens: n,
                    }),
                }
            };
        let bos = special("tokenizer.ggml.bos_token_id", default_bos)?;
        let eos = special("tokenizer.ggml.eos_token_id", default_eos)?;
        let mut eot = special("tokenizer.ggml.eot_token_id", None)?;
        let mut eom = special("tokenizer.ggml.eom_token_id", None)?;
        let unk = special("tokenizer.ggml.unknown_token_id", default_unk)?;
        let pad = special("tokenizer.ggml.padding_token_id", None)?;
        let mut eog_extra = Vec::new();
        for key in [
            "tokenizer.ggml.fim_pad_token_id",
            "tokenizer.ggml.fim_rep_token_id",
            "tokenizer.ggml.fim_sep_token_id",
        ] {
            eog_extra.extend(special(key, None)?);
        }

        if let Some(b) = md.opt_bool("tokenizer.ggml.add_bos_token")? {
            add_bos = b;
        }
        let add_eos = md
            .opt_bool("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                flag: "tokenizer.ggml.add_bos_token",
                id_key: "tokenizer.ggml.bos_token_id",
            });
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                flag: "tokenizer.ggml.add_eos_token",
                id_key: "tokenizer.ggml.eos_token_id",
            });
        }

        // llama.cpp's fix-ups by token text: end-of-turn and FIM markers are CONTROL whatever
        // the converter wrote, and `<|eot_id|>`-like texts end generation.
        let mut eog: Vec<u32> = eog_extra;
        for (id, text) in tokens.iter().enumerate() {
            let id = id as u32;
            let t = text.as_str();
            if EOG_TEXTS.contains(&t) {
                attrs[id as usize] |= TokenAttr::CONTROL;
                eog.push(id);
                if eot.is_none() && EOT_TEXTS.contains(&t) {
                    eot = Some(id);
                }
                if eom.is_none() && t == "<|eom_id|>" {
                    eom = Some(id);
                }
            }
            if FIM_TEXTS.contains(&t) {
                attrs[id as usize] |= TokenAttr::CONTROL;
            }
            // gpt-oss: always rendered.
            if matches!(
                t,
                "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>"
            ) {
                attrs[id as usize] = TokenAttr::USER_DEFINED;
            }
        }
        eog.extend(eos);
        eog.extend(eot);
        eog.extend(eom);
        eog.sort_unstable();
        eog.dedup();

        // Phi-3 strips spaces to the right of its special tokens (llama.cpp sets this by name).
        let name = md
            .opt_str("general.name")?
            .unwrap_or_default()
            .to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for (i, a) in attrs.iter_mut().enumerate() {
                let t = tokens[i].as_str();
                if a.is_special_cache() || t == "</s>" {
                    *a |= TokenAttr::RSTRIP;
                }
                if matches!(t, "<unk>" | "<s>" | "<|endoftext|>") {
                    *a = TokenAttr(a.0 & !TokenAttr::RSTRIP.0);
                }
            }
        }

        Ok(Vocab {
            kind,
            tokens,
            scores: scores[..n].to_vec(),
            attrs,
            token_to_id,
            bpe_ranks,
            bos,
            eos,
            eot,
            eom,
            unk,
            pad,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
            ignore_merges,
            clean_spaces,
        })
    }

    pub fn id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }
}
