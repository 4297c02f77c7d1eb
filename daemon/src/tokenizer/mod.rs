//! The tokenizer: text to token ids and back, with the same ids as llama.cpp for the same GGUF
//! file.
//!
//! Two vocabularies are supported, the ones Spillway's target models use:
//! - SentencePiece-style (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Mixtral), as
//!   llama.cpp's `llm_tokenizer_spm`: a space prefix, spaces as `▁`, score-driven bigram merges,
//!   `<0xXX>` byte fallback (`spm.rs`).
//! - GPT-2 byte-level BPE (`"gpt2"`) with the Llama 3 (`llama-bpe`) or Qwen2 (`qwen2`)
//!   pre-tokenizer, as `llm_tokenizer_bpe` ([`pretokenize`], `bpe.rs`).
//!
//! Special tokens are cut out of the text first (`special.rs`); decoding and the streaming
//! [`Detokenizer`] are in `detok.rs`. Fixtures recorded from llama.cpp check all of it
//! (`daemon/tests/tokenizer_llama_cpp.rs`).
//!
//! Not supported (an error at load, not wrong ids): llama.cpp's other tokenizer models (WPM,
//! UGM, RWKV, PLaMo-2) and BPE pre-tokenizers other than the Llama 3 and Qwen2 families
//! (GPT-2, DeepSeek, Falcon, ...). Of llama.cpp's per-model token attributes only Phi-3's RSTRIP
//! is reproduced (the others belong to unsupported BERT-style models). `\p{L}`/`\p{N}` come from
//! Unicode 16 tables, llama.cpp's from the Unicode version its generator ran on: characters
//! assigned in between may be classed differently.

mod bpe;
mod detok;
pub mod pretokenize;
mod special;
mod spm;
mod vocab;

#[cfg(test)]
mod tests;

use crate::gguf::{GgufError, Metadata};

pub use detok::{DecodeOptions, Detokenizer};
pub use pretokenize::PreTokenizer;
pub use vocab::VocabKind;

use special::Fragment;
use vocab::Vocab;

/// A token's attributes, llama.cpp's `llama_token_attr` bits (from `tokenizer.ggml.token_type`
/// and llama.cpp's fix-ups by token text).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TokenAttr(pub u16);

impl TokenAttr {
    pub const UNDEFINED: TokenAttr = TokenAttr(0);
    pub const UNKNOWN: TokenAttr = TokenAttr(1 << 0);
    pub const UNUSED: TokenAttr = TokenAttr(1 << 1);
    pub const NORMAL: TokenAttr = TokenAttr(1 << 2);
    pub const CONTROL: TokenAttr = TokenAttr(1 << 3);
    pub const USER_DEFINED: TokenAttr = TokenAttr(1 << 4);
    pub const BYTE: TokenAttr = TokenAttr(1 << 5);
    pub const LSTRIP: TokenAttr = TokenAttr(1 << 7);
    pub const RSTRIP: TokenAttr = TokenAttr(1 << 8);

    /// From a `tokenizer.ggml.token_type` value (llama.cpp's `llama_token_type`).
    pub fn from_type(t: i32) -> TokenAttr {
        match t {
            1 => Self::NORMAL,
            2 => Self::UNKNOWN,
            3 => Self::CONTROL,
            4 => Self::USER_DEFINED,
            5 => Self::UNUSED,
            6 => Self::BYTE,
            _ => Self::UNDEFINED,
        }
    }

    pub fn contains(self, other: TokenAttr) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn intersects(self, other: TokenAttr) -> bool {
        self.0 & other.0 != 0
    }

    /// Tokens matched in text before tokenizing: CONTROL, USER_DEFINED and UNKNOWN.
    pub fn is_special_cache(self) -> bool {
        self.intersects(Self::CONTROL | Self::USER_DEFINED | Self::UNKNOWN)
    }
}

impl std::ops::BitOr for TokenAttr {
    type Output = TokenAttr;
    fn bitor(self, rhs: TokenAttr) -> TokenAttr {
        TokenAttr(self.0 | rhs.0)
    }
}

impl std::ops::BitOrAssign for TokenAttr {
    fn bitor_assign(&mut self, rhs: TokenAttr) {
        self.0 |= rhs.0;
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("the file has no tokenizer: {0} is missing")]
    MissingKey(&'static str),
    #[error("{key} has the wrong type: expected {expected}")]
    WrongType {
        key: &'static str,
        expected: &'static str,
    },
    #[error("unsupported tokenizer model {model:?} (supported: \"llama\" (SentencePiece) and \"gpt2\" (BPE))")]
    UnsupportedModel { model: String },
    #[error("unsupported BPE pre-tokenizer {pre:?} (supported: llama-bpe and qwen2 families)")]
    UnsupportedPreTokenizer { pre: String },
    #[error("the vocabulary (tokenizer.ggml.tokens) is empty")]
    EmptyVocab,
    #[error("the vocabulary has {n_tokens} tokens, more than token ids can address")]
    VocabTooLarge { n_tokens: usize },
    #[error("{key} has {len} entries for {n_tokens} tokens")]
    ShortArray {
        key: &'static str,
        len: usize,
        n_tokens: usize,
    },
    #[error("duplicate token {text:?} in the vocabulary, ids {first} and {second}")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },
    #[error("merge {rank} ({merge:?}) is not two pieces separated by a space")]
    InvalidMerge { rank: usize, merge: String },
    #[error("merge {rank} ({merge:?}) uses {piece:?}, which is not in the vocabulary")]
    MergeUnknownPiece {
        rank: usize,
        merge: String,
        piece: String,
    },
    #[error("{key} = {id} is outside the vocabulary of {n_tokens} tokens")]
    SpecialTokenOutOfRange {
        key: &'static str,
        id: u32,
        n_tokens: usize,
    },
    #[error("{flag} is true, but {id_key} is not set")]
    MissingSpecial {
        flag: &'static str,
        id_key: &'static str,
    },
}

/// How [`Tokenizer::encode_with`] treats special tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add BOS (and EOS) as the vocabulary's `add_bos_token` / `add_eos_token` say.
    pub add_special: bool,
    /// Match CONTROL tokens such as `<|im_start|>` in the text (llama.cpp's `special = true`).
    /// USER_DEFINED tokens are always matched.
    pub parse_special: bool,
}

/// A vocabulary ready to encode and decode. Immutable, so one can be shared across threads.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    vocab: Vocab,
    /// Special-token ids, longest text first.
    special_order: Vec<u32>,
    /// GPT-2 byte stand-ins (used by BPE vocabularies only).
    byte_table: [char; 256],
    /// Each token's bytes with special tokens shown.
    pieces: Vec<Vec<u8>>,
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes.
    pub fn from_metadata(md: &Metadata) -> Result<Tokenizer, TokenizerError> {
        let vocab = Vocab::from_metadata(md)?;
        let byte_table = pretokenize::byte_to_char_table();
        let special_order = special::matching_order(&vocab);
        let pieces = detok::build_pieces(&vocab);
        Ok(Tokenizer {
            vocab,
            special_order,
            byte_table,
            pieces,
        })
    }

    /// Token ids of `text`; special-token texts in it are tokenized as plain text.
    /// With `add_special`, BOS is prepended when the vocabulary asks for it
    /// (`tokenizer.ggml.add_bos_token`; by default true for SentencePiece and Llama 3, false
    /// for Qwen2).
    pub fn encode(&self, text: &str, add_special: bool) -> Vec<u32> {
        self.encode_with(
            text,
            EncodeOptions {
                add_special,
                parse_special: false,
            },
        )
    }

    /// llama.cpp's `llama_tokenize(text, add_special, parse_special)`.
    pub fn encode_with(&self, text: &str, opts: EncodeOptions) -> Vec<u32> {
        let v = &self.vocab;
        let fragments = special::partition(v, &self.special_order, text, opts.parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if opts.add_special && v.add_bos {
            out.extend(v.bos);
        }
        match v.kind {
            VocabKind::Spm => {
                // A space goes before the first text and before text that follows a special token.
                let mut prev_special = true;
                for f in fragments {
                    match f {
                        Fragment::Text(s, e) => {
                            let mut t = String::with_capacity(e - s + 3);
                            if v.add_space_prefix && prev_special {
                                t.push(' ');
                            }
                            t.push_str(&text[s..e]);
                            spm::tokenize(v, &t.replace(' ', "\u{2581}"), &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            VocabKind::Bpe(pre) => {
                for f in fragments {
                    match f {
                        Fragment::Text(s, e) => {
                            bpe::tokenize(v, pre, &self.byte_table, &text[s..e], &mut out)
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if opts.add_special && v.add_eos {
            out.extend(v.eos);
        }
        out
    }

    /// The bytes token `id` renders to. CONTROL and UNKNOWN tokens render as their text with
    /// `special`, as nothing without; an id outside the vocabulary renders as nothing.
    pub fn token_to_piece(&self, id: u32, special: bool) -> &[u8] {
        let Some(attr) = self.vocab.attrs.get(id as usize) else {
            return &[];
        };
        if !special && attr.intersects(TokenAttr::UNKNOWN | TokenAttr::CONTROL) {
            return &[];
        }
        &self.pieces[id as usize]
    }

    pub fn kind(&self) -> VocabKind {
        self.vocab.kind
    }

    pub fn n_vocab(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// The vocabulary's text of a token (`▁the`, `Ġthe`, `<0x0A>`, `<|im_end|>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of a token by its vocabulary text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    pub fn token_attr(&self, id: u32) -> Option<TokenAttr> {
        self.vocab.attrs.get(id as usize).copied()
    }

    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }

    pub fn eot(&self) -> Option<u32> {
        self.vocab.eot
    }

    pub fn eom(&self) -> Option<u32> {
        self.vocab.eom
    }

    pub fn unk(&self) -> Option<u32> {
        self.vocab.unk
    }

    pub fn pad(&self) -> Option<u32> {
        self.vocab.pad
    }

    /// Whether `encode(.., add_special = true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether `encode(.., add_special = true)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.vocab.add_eos
    }

    /// Whether generation should stop at `id` (EOS, EOT, EOM and llama.cpp's end-of-turn texts).
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.binary_search(&id).is_ok()
    }

    /// The end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.vocab.eog
    }
}
