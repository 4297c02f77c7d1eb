//! The tokenizers of the synthetic models (SentencePiece, GPT-2 BPE with the Llama 3 and the
//! Qwen2 pre-tokenizer) on arbitrary input.
//!
//! Input: the first byte picks the vocabulary (bits 0-1, modulo 3), encode or decode (bit 2) and
//! the options (bits 3-4). To encode, the rest is text (invalid UTF-8 replaced); to decode, it
//! is token ids, two little-endian bytes each, some beyond the vocabulary.
//!
//! Checked: every id is inside the vocabulary; a Qwen2 (byte-level, no clean-up) round trip
//! gives the text back; the streaming detokenizer's chunks concatenate to exactly the lossy
//! decoding of the same pieces, so no character is ever split or lost.

#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway_daemon::tokenizer::{DecodeOptions, Detokenizer, EncodeOptions, Tokenizer};
use spillway_fuzz::tokenizers;

fuzz_target!(|data: &[u8]| {
    let Some((&head, rest)) = data.split_first() else {
        return;
    };
    let which = usize::from(head & 3) % 3;
    let tok = &tokenizers()[which];
    let (flag_a, flag_b) = (head & 8 != 0, head & 16 != 0);
    if head & 4 == 0 {
        let text = String::from_utf8_lossy(rest);
        encode(tok, which, &text, flag_a, flag_b);
    } else {
        let ids: Vec<u32> = rest
            .chunks_exact(2)
            .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
            .collect();
        decode(tok, &ids, flag_a, flag_b);
    }
});

fn encode(tok: &Tokenizer, which: usize, text: &str, add_special: bool, parse_special: bool) {
    let opts = EncodeOptions {
        add_special,
        parse_special,
    };
    let ids = tok.encode_with(text, opts);
    assert!(
        ids.iter().all(|&id| (id as usize) < tok.n_vocab()),
        "{ids:?}"
    );
    if which == 2 && !add_special && !parse_special {
        // Byte-level BPE without clean-up is lossless.
        let back = tok.detokenize(&ids, DecodeOptions::default());
        assert_eq!(back, text.as_bytes(), "ids {ids:?}");
    }
    stream(tok, &ids, parse_special);
}

fn decode(tok: &Tokenizer, ids: &[u32], remove_special: bool, unparse_special: bool) {
    let opts = DecodeOptions {
        remove_special,
        unparse_special,
    };
    let _ = tok.detokenize(ids, opts);
    let _ = tok.decode(ids);
    for &id in ids {
        let _ = (tok.token_text(id), tok.token_attr(id), tok.is_eog(id));
    }
    stream(tok, ids, unparse_special);
}

/// Pushes `ids` one at a time through a [`Detokenizer`].
fn stream(tok: &Tokenizer, ids: &[u32], special: bool) {
    let mut d = Detokenizer::new(tok, special);
    let mut streamed = String::new();
    let mut pieces = Vec::new();
    for &id in ids {
        streamed.push_str(&d.push(id));
        pieces.extend_from_slice(tok.token_to_piece(id, special));
        assert!(
            d.pending().len() < 4,
            "{} bytes held back",
            d.pending().len()
        );
    }
    streamed.push_str(&d.finish());
    assert_eq!(streamed, String::from_utf8_lossy(&pieces));
}
