//! Token ids back to bytes: each token's piece (llama.cpp's `token_to_piece`), whole sequences
//! (`llama_detokenize`), and a streaming [`Detokenizer`] that only ever emits whole characters.

use super::pretokenize::char_to_byte;
use super::vocab::{Vocab, VocabKind};
use super::{TokenAttr, Tokenizer};

/// The bytes every token renders to when special tokens are shown (llama.cpp's
/// `cache_token_to_piece`, built with `special = true`).
pub(crate) fn build_pieces(vocab: &Vocab) -> Vec<Vec<u8>> {
    vocab
        .tokens
        .iter()
        .zip(&vocab.attrs)
        .map(|(text, &attr)| piece(vocab.kind, text, attr))
        .collect()
}

fn piece(kind: VocabKind, text: &str, attr: TokenAttr) -> Vec<u8> {
    if attr.intersects(TokenAttr::UNKNOWN | TokenAttr::CONTROL | TokenAttr::USER_DEFINED) {
        return text.as_bytes().to_vec();
    }
    if attr.contains(TokenAttr::NORMAL) {
        return match kind {
            VocabKind::Spm => text.replace('\u{2581}', " ").into_bytes(),
            VocabKind::Bpe(_) => decode_byte_level(text),
        };
    }
    if attr.contains(TokenAttr::BYTE) {
        // strtol over the two hex digits of `<0xXX>`; a malformed byte token renders as 0.
        let hex = text.get(3..5).unwrap_or("");
        return vec![u8::from_str_radix(hex, 16).unwrap_or(0)];
    }
    // UNUSED and UNDEFINED tokens render as nothing.
    Vec::new()
}

/// llama.cpp's `llama_decode_text`: stand-in characters back to bytes; a character that stands
/// for no byte is written out as `[UNK_BYTE_0x..<token>]`, as llama.cpp does.
fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// How [`Tokenizer::detokenize`] treats special tokens, as `llama_detokenize`'s two flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Drop a leading BOS and a trailing EOS that the tokenizer would have added.
    pub remove_special: bool,
    /// Render CONTROL and UNKNOWN tokens as their text instead of nothing.
    pub unparse_special: bool,
}

impl Tokenizer {
    /// llama.cpp's `llama_detokenize`: pieces concatenated, the SentencePiece leading space
    /// removed, and for vocabularies with `clean_up_tokenization_spaces` (Llama 3) the spaces
    /// before `?!.,` and some contractions removed as Hugging Face does.
    pub fn detokenize(&self, ids: &[u32], opts: DecodeOptions) -> Vec<u8> {
        let v = &self.vocab;
        let mut ids = ids;
        let mut remove_space = v.add_space_prefix;
        if opts.remove_special && v.add_bos {
            if let (Some(&first), Some(bos)) = (ids.first(), v.bos) {
                if first == bos {
                    remove_space = false;
                    ids = &ids[1..];
                }
            }
        }
        if opts.remove_special && v.add_eos {
            if let (Some(&last), Some(eos)) = (ids.last(), v.eos) {
                if last == eos {
                    ids = &ids[..ids.len() - 1];
                }
            }
        }
        let mut out = Vec::new();
        for &id in ids {
            let mut p = self.token_to_piece(id, opts.unparse_special);
            if remove_space {
                // `lstrip = 1`: at most one leading space, and only from the first token.
                if let Some(rest) = p.strip_prefix(b" ") {
                    p = rest;
                }
            }
            remove_space = false;
            out.extend_from_slice(p);
        }
        if v.clean_spaces {
            clean_spaces(&mut out);
        }
        out
    }

    /// The text of `ids` (special tokens not shown), invalid UTF-8 replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.detokenize(ids, DecodeOptions::default())).into_owned()
    }
}

/// The three passes of llama.cpp's `clean_spaces`, byte for byte.
fn clean_spaces(text: &mut Vec<u8>) {
    // " ?", " !", " .", " ," lose their space.
    let t = std::mem::take(text);
    let mut out: Vec<u8> = Vec::with_capacity(t.len());
    for (i, &x) in t.iter().enumerate() {
        if i > 0 && t[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            out.pop();
        }
        out.push(x);
    }
    // " ' " becomes "'".
    let t = out;
    let mut out: Vec<u8> = Vec::with_capacity(t.len());
    let mut i = 0;
    // llama.cpp overwrites the dropped space with NUL, so it no longer counts as a space.
    let mut prev_dropped = false;
    while i < t.len() {
        let x = t[i];
        let prev_space = i > 0 && t[i - 1] == b' ' && !prev_dropped;
        prev_dropped = false;
        if x == b'\'' && i + 1 < t.len() && prev_space && t[i + 1] == b' ' {
            out.pop();
            out.push(x);
            i += 2;
            prev_dropped = true;
            continue;
        }
        out.push(x);
        i += 1;
    }
    // " 's", " 'm", " 're", " 've" lose their space.
    let t = out;
    let mut out: Vec<u8> = Vec::with_capacity(t.len());
    for (i, &x) in t.iter().enumerate() {
        if i > 0 && t[i - 1] == b' ' && x == b'\'' && i + 1 < t.len() {
            let x1 = t[i + 1];
            let drop = match x1 {
                b's' | b'm' => true,
                b't' | b'd' => false,
                _ => i + 2 < t.len() && matches!((x1, t[i + 2]), (b'r', b'e') | (b'v', b'e')),
            };
            if drop {
                out.pop();
            }
        }
        out.push(x);
    }
    *text = out;
}

/// Streaming detokenization: push ids as they are generated, get back only complete UTF-8 text.
/// A character split across tokens (SentencePiece byte tokens such as `<0xE2>`, or byte-level
/// BPE pieces that end mid-character) is held back until its last byte arrives; bytes that can
/// never form a character come out as U+FFFD.
#[derive(Debug)]
pub struct Detokenizer<'t> {
    tokenizer: &'t Tokenizer,
    special: bool,
    pending: Vec<u8>,
}

impl<'t> Detokenizer<'t> {
    /// `special`: render CONTROL tokens (e.g. `<|im_end|>`) as their text.
    pub fn new(tokenizer: &'t Tokenizer, special: bool) -> Self {
        Detokenizer {
            tokenizer,
            special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.pending
            .extend_from_slice(self.tokenizer.token_to_piece(id, self.special));
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Safe to unwrap: `valid_up_to` bytes are valid UTF-8 by definition.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: what is still held back comes out, lossily.
    pub fn finish(mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&rest).into_owned()
    }
}
