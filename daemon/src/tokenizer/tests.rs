//! Unit tests on small hand-built vocabularies. The comparison with llama.cpp itself is the
//! integration test `tests/tokenizer_llama_cpp.rs`.

use super::*;
use crate::gguf::{Array, Value};

fn strings(v: &[&str]) -> Value {
    Value::Array(Array::String(v.iter().map(|s| s.to_string()).collect()))
}

/// A SentencePiece vocabulary: `<unk> <s> </s>`, the 256 byte tokens, then `pieces` with
/// descending scores (the first piece merges first).
fn spm_metadata(pieces: &[&str]) -> Metadata {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let mut scores = vec![0.0f32; tokens.len()];
    for (i, p) in pieces.iter().enumerate() {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(-(i as f32));
    }
    let mut md = Metadata::new();
    md.insert("tokenizer.ggml.model", Value::String("llama".into()))
        .unwrap();
    md.insert("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))
        .unwrap();
    md.insert("tokenizer.ggml.scores", Value::Array(Array::F32(scores)))
        .unwrap();
    md.insert("tokenizer.ggml.token_type", Value::Array(Array::I32(types)))
        .unwrap();
    md
}

/// A byte-level BPE vocabulary: the 256 byte stand-ins, the products of `merges` in order, then
/// `specials` as (text, token type).
fn bpe_metadata(pre: &str, merges: &[&str], specials: &[(&str, i32)]) -> Metadata {
    let table = pretokenize::byte_to_char_table();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    for m in merges {
        let joined = m.replacen(' ', "", 1);
        if !tokens.contains(&joined) {
            tokens.push(joined);
        }
    }
    let mut types = vec![1; tokens.len()];
    for (t, ty) in specials {
        tokens.push(t.to_string());
        types.push(*ty);
    }
    let mut md = Metadata::new();
    md.insert("tokenizer.ggml.model", Value::String("gpt2".into()))
        .unwrap();
    md.insert("tokenizer.ggml.pre", Value::String(pre.into()))
        .unwrap();
    md.insert("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))
        .unwrap();
    md.insert("tokenizer.ggml.token_type", Value::Array(Array::I32(types)))
        .unwrap();
    md.insert("tokenizer.ggml.merges", strings(merges)).unwrap();
    if let Some(bos) = specials.iter().position(|(t, _)| *t == "<|begin_of_text|>") {
        md.insert(
            "tokenizer.ggml.bos_token_id",
            Value::U32((256 + merges.len() + bos) as u32),
        )
        .unwrap();
    }
    md
}

fn texts(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&i| t.token_text(i).unwrap().to_string())
        .collect()
}

#[test]
fn spm_merges_highest_score_first() {
    let t = Tokenizer::from_metadata(&spm_metadata(&[
        "▁hello", "▁he", "llo", "ll", "▁h", "▁", "h", "e", "l", "o",
    ]))
    .unwrap();
    assert_eq!(t.kind(), VocabKind::Spm);
    let ids = t.encode("hello", true);
    assert_eq!(ids[0], 1, "BOS by default for SentencePiece");
    assert_eq!(texts(&t, &ids[1..]), ["▁hello"]);
    // As llama.cpp: the leading space is stripped from the first token only, and BOS is first.
    assert_eq!(t.decode(&ids), " hello");
    assert_eq!(t.decode(&ids[1..]), "hello");
    assert_eq!(
        texts(&t, &t.encode("hello hello", false)),
        ["▁hello", "▁hello"]
    );
}

#[test]
fn spm_ties_merge_leftmost_and_unknown_characters_fall_back_to_bytes() {
    // "ab" and "bc" score the same; in "abc" the left pair wins.
    let t = Tokenizer::from_metadata(&spm_metadata(&["ab", "bc", "▁", "a", "b", "c"])).unwrap();
    let ids = t.encode("abc", false);
    assert_eq!(texts(&t, &ids), ["▁", "ab", "c"]);
    // é is not a piece: its two UTF-8 bytes come out as byte tokens.
    let ids = t.encode("é", false);
    assert_eq!(texts(&t, &ids), ["▁", "<0xC3>", "<0xA9>"]);
    assert_eq!(t.decode(&ids), "é");
}

#[test]
fn spm_add_space_prefix_can_be_turned_off() {
    let mut md = spm_metadata(&["▁a", "▁", "a"]);
    md.insert("tokenizer.ggml.add_space_prefix", Value::Bool(false))
        .unwrap();
    let t = Tokenizer::from_metadata(&md).unwrap();
    assert_eq!(texts(&t, &t.encode("a a", false)), ["a", "▁a"]);
    assert_eq!(t.decode(&t.encode("a a", false)), "a a");
}

#[test]
fn spm_control_tokens_only_with_parse_special() {
    let t = Tokenizer::from_metadata(&spm_metadata(&["▁a", "▁", "a", "<", ">", "/", "s"])).unwrap();
    let plain = t.encode_with(
        "a</s>",
        EncodeOptions {
            add_special: false,
            parse_special: false,
        },
    );
    assert!(!plain.contains(&2));
    let parsed = t.encode_with(
        "a</s>a",
        EncodeOptions {
            add_special: false,
            parse_special: true,
        },
    );
    // A space prefix follows a special token too.
    assert_eq!(texts(&t, &parsed), ["▁a", "</s>", "▁a"]);
    assert_eq!(t.decode(&parsed), "a a");
    assert_eq!(
        String::from_utf8(t.detokenize(
            &parsed,
            DecodeOptions {
                remove_special: false,
                unparse_special: true
            }
        ))
        .unwrap(),
        "a</s> a"
    );
}

#[test]
fn bpe_merges_by_rank() {
    let merges = ["Ġ t", "h e", "Ġt he", "t h"];
    let t = Tokenizer::from_metadata(&bpe_metadata("qwen2", &merges, &[])).unwrap();
    // "th" ranks after "he", so " the" is Ġt + he, then Ġthe.
    assert_eq!(texts(&t, &t.encode(" the", true)), ["Ġthe"]);
    assert_eq!(texts(&t, &t.encode("the", false)), ["t", "he"]);
    assert!(!t.add_bos(), "Qwen2 adds no BOS by default");
    assert_eq!(texts(&t, &t.encode("x 12", false)), ["x", "Ġ", "1", "2"]);
    assert_eq!(
        t.decode(&t.encode("x 12 é 日本 🦀", false)),
        "x 12 é 日本 🦀"
    );
}

#[test]
fn llama3_ignores_merges_for_whole_word_tokens_and_adds_bos() {
    // "Ġab" is a token but no merge chain builds it from Ġ a b: Llama 3 still emits it.
    let merges = ["a b", "Ġ ab"];
    let md = bpe_metadata("llama-bpe", &merges, &[("<|begin_of_text|>", 3)]);
    let t = Tokenizer::from_metadata(&md).unwrap();
    let ids = t.encode(" ab", true);
    assert_eq!(texts(&t, &ids), ["<|begin_of_text|>", "Ġab"]);
    assert_eq!(
        texts(&t, &t.encode("1234567", false)),
        ["1", "2", "3", "4", "5", "6", "7"]
    );
    assert_eq!(t.decode(&ids), " ab");
    // clean_up_tokenization_spaces: " ," loses its space on decode, as in llama.cpp.
    assert_eq!(t.decode(&t.encode("a , b", false)), "a, b");
}

#[test]
fn user_defined_tokens_always_match_control_tokens_on_request() {
    let specials = [("<|im_start|>", 3), ("<think>", 4), ("<|im_start|>x", 4)];
    let t = Tokenizer::from_metadata(&bpe_metadata("qwen2", &[], &specials)).unwrap();
    let im = t.token_id("<|im_start|>").unwrap();
    let think = t.token_id("<think>").unwrap();
    let ids = t.encode("<think>a<|im_start|>", false);
    assert_eq!(ids[0], think);
    assert!(!ids.contains(&im));
    let ids = t.encode_with(
        "<think>a<|im_start|>",
        EncodeOptions {
            add_special: true,
            parse_special: true,
        },
    );
    assert_eq!(ids, [think, t.token_id("a").unwrap(), im]);
    // Longest special text first.
    let ids = t.encode_with(
        "<|im_start|>x",
        EncodeOptions {
            add_special: false,
            parse_special: true,
        },
    );
    assert_eq!(ids, [t.token_id("<|im_start|>x").unwrap()]);
    assert_eq!(t.token_to_piece(im, false), b"");
    assert_eq!(t.token_to_piece(im, true), b"<|im_start|>");
    assert_eq!(t.token_to_piece(think, false), b"<think>");
}

#[test]
fn end_of_turn_texts_become_control_and_end_generation() {
    let t = Tokenizer::from_metadata(&bpe_metadata("qwen2", &[], &[("<|im_end|>", 1)])).unwrap();
    let id = t.token_id("<|im_end|>").unwrap();
    assert!(t.token_attr(id).unwrap().contains(TokenAttr::CONTROL));
    assert!(t.is_eog(id));
    assert_eq!(t.eot(), Some(id));
}

#[test]
fn empty_text() {
    let t = Tokenizer::from_metadata(&spm_metadata(&["▁"])).unwrap();
    assert_eq!(t.encode("", true), [1]);
    assert!(t.encode("", false).is_empty());
    assert_eq!(t.decode(&[]), "");
}

#[test]
fn detokenizer_holds_back_split_characters() {
    let t = Tokenizer::from_metadata(&spm_metadata(&["▁", "a"])).unwrap();
    let ids = t.encode("a€a", false);
    assert_eq!(
        texts(&t, &ids),
        ["▁", "a", "<0xE2>", "<0x82>", "<0xAC>", "a"]
    );
    let mut d = Detokenizer::new(&t, false);
    let out: Vec<String> = ids.iter().map(|&id| d.push(id)).collect();
    assert_eq!(out, [" ", "a", "", "", "€", "a"]);
    assert!(d.pending().is_empty());
    // A lone continuation byte can never complete: it comes out replaced.
    let mut d = Detokenizer::new(&t, false);
    assert_eq!(d.push(t.token_id("<0xE2>").unwrap()), "");
    assert_eq!(d.push(t.token_id("a").unwrap()), "\u{FFFD}a");
    assert_eq!(d.push(t.token_id("<0xE2>").unwrap()), "");
    assert_eq!(d.finish(), "\u{FFFD}");
}

// llama.cpp's CVE-2025-49847: a vocabulary piece longer than its `token_to_piece` buffer (a
// length past i32 cast to a negative one) was copied whole over it. Pieces here are copied into
// growing buffers: a piece of 100 KiB, alone and between others, comes out whole, through both
// the one-call and the streaming detokenizer.
#[test]
fn a_very_long_piece_comes_out_whole() {
    let long: String = "ab€".repeat(100 * 1024 / 5);
    let t = Tokenizer::from_metadata(&spm_metadata(&["▁", "a", &long])).unwrap();
    let id = t.token_id(&long).unwrap();
    let a = t.token_id("a").unwrap();
    assert_eq!(t.decode(&[id]), long);
    assert_eq!(t.decode(&[a, id, a]), format!("a{long}a"));
    let mut d = Detokenizer::new(&t, false);
    let streamed: String = [a, id, a].iter().map(|&i| d.push(i)).collect();
    assert_eq!(streamed + &d.finish(), format!("a{long}a"));
}

#[test]
fn clean_spaces_as_llama_cpp() {
    let merges: [&str; 0] = [];
    let t = Tokenizer::from_metadata(&bpe_metadata(
        "llama-bpe",
        &merges,
        &[("<|begin_of_text|>", 3)],
    ))
    .unwrap();
    let dec = |s: &str| t.decode(&t.encode(s, false));
    assert_eq!(dec("a ? b ! c . d , e"), "a? b! c. d, e");
    assert_eq!(dec("x ' y"), "x'y");
    assert_eq!(dec(" ' ' x"), "'' x");
    assert_eq!(
        dec("it 's I 'm we 're you 've don 't I 'd we 'll"),
        "it's I'm we're you've don 't I 'd we 'll"
    );
}

#[test]
fn errors_are_clear() {
    let mut md = Metadata::new();
    md.insert("tokenizer.ggml.model", Value::String("gpt2".into()))
        .unwrap();
    md.insert("tokenizer.ggml.pre", Value::String("qwen2".into()))
        .unwrap();
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::MissingKey("tokenizer.ggml.tokens"))
    ));
    md.insert("tokenizer.ggml.tokens", strings(&["a", "b"]))
        .unwrap();
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::MissingKey("tokenizer.ggml.merges"))
    ));
    md.insert("tokenizer.ggml.merges", strings(&["a c"]))
        .unwrap();
    let e = Tokenizer::from_metadata(&md).unwrap_err();
    assert!(
        matches!(e, TokenizerError::MergeUnknownPiece { ref piece, .. } if piece == "c"),
        "{e}"
    );

    let e = Tokenizer::from_metadata(&bpe_metadata("default", &[], &[])).unwrap_err();
    assert!(
        matches!(e, TokenizerError::UnsupportedPreTokenizer { .. }),
        "{e}"
    );

    let mut md = spm_metadata(&["▁"]);
    md.insert("tokenizer.ggml.bos_token_id", Value::U32(99_999))
        .unwrap();
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::SpecialTokenOutOfRange { id: 99_999, .. })
    ));

    let mut md = Metadata::new();
    md.insert("tokenizer.ggml.model", Value::String("llama".into()))
        .unwrap();
    md.insert("tokenizer.ggml.tokens", strings(&["a", "b", "a"]))
        .unwrap();
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::DuplicateToken {
            first: 0,
            second: 2,
            ..
        })
    ));

    let mut md = Metadata::new();
    md.insert("tokenizer.ggml.model", Value::String("bert".into()))
        .unwrap();
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::UnsupportedModel { .. })
    ));

    // Qwen2 has no default BOS; asking to add one without an id is an error.
    let mut md = bpe_metadata("qwen2", &[], &[]);
    md.insert("tokenizer.ggml.add_bos_token", Value::Bool(true))
        .unwrap();
    assert!(
        Tokenizer::from_metadata(&md).is_ok(),
        "default BPE BOS id 11 is in range"
    );
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
}

#[test]
fn phi3_special_tokens_strip_spaces_to_their_right() {
    let mut md = spm_metadata(&["▁a", "▁", "a"]);
    md.insert("general.name", Value::String("Phi-3 mini".into()))
        .unwrap();
    let t = Tokenizer::from_metadata(&md).unwrap();
    let ids = t.encode_with(
        "</s>  a",
        EncodeOptions {
            add_special: false,
            parse_special: true,
        },
    );
    assert_eq!(texts(&t, &ids), ["</s>", "▁a"]);
}

#[test]
fn detokenizer_shows_control_tokens_on_request() {
    let t = Tokenizer::from_metadata(&bpe_metadata("qwen2", &[], &[("<|im_end|>", 3)])).unwrap();
    let end = t.token_id("<|im_end|>").unwrap();
    let a = t.token_id("a").unwrap();
    let mut shown = Detokenizer::new(&t, true);
    assert_eq!(shown.push(a) + &shown.push(end), "a<|im_end|>");
    let mut hidden = Detokenizer::new(&t, false);
    assert_eq!(hidden.push(a) + &hidden.push(end), "a");
}
