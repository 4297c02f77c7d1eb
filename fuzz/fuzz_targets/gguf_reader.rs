//! Arbitrary bytes as a GGUF file: the structural parse, every metadata accessor on every key,
//! the architecture checks, and for files that pass, everything built from a file: the inspect
//! summary, tensor data, the tokenizer, the chat template and the model's weights. Any result is
//! fine; a panic, an out-of-bounds read or a hang is the bug.

#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway_daemon::gguf::inspect::{json_value, Summary};
use spillway_daemon::gguf::validate::validate_architecture;
use spillway_daemon::gguf::{parse_header_structure, GgufFile, Header, Metadata};
use spillway_daemon::model::Model;
use spillway_daemon::server::chat::ChatTemplate;
use spillway_daemon::tokenizer::{DecodeOptions, Tokenizer};

fuzz_target!(|data: &[u8]| {
    let header = match parse_header_structure(data) {
        Ok(h) => h,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    every_accessor(&header);
    let valid = validate_architecture(&header);
    let file = GgufFile::from_bytes(data);
    // The in-memory file runs the same checks as parse + validate.
    assert_eq!(valid.is_ok(), file.is_ok(), "{valid:?} vs {file:?}");
    let Ok(file) = file else { return };
    assert_eq!(file.tensors(), &header.tensors[..]);
    assert_eq!(file.data_offset(), header.data_offset);

    let summary = Summary::new("fuzz.gguf", &file);
    let mut text = String::new();
    summary.write_text(&mut text).expect("writing to a String");
    for t in file.tensors() {
        assert_eq!(file.tensor_data(t).len() as u64, t.n_bytes);
        assert_eq!(file.tensor(&t.name), Some(t));
    }
    let md = file.metadata();
    if let Ok(tok) = Tokenizer::from_metadata(md) {
        let ids = tok.encode("Hello, world! <|im_start|>user", true);
        assert!(ids.iter().all(|&id| (id as usize) < tok.n_vocab()));
        let _ = tok.detokenize(&ids, DecodeOptions::default());
        let (bos, eos) = (tok.bos(), tok.eos());
        let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("");
        let template = ChatTemplate::from_metadata(md, text_of(bos), text_of(eos));
        let _ = template.render(&[]);
    }
    if let Ok(model) = Model::from_file(file) {
        let mut row = vec![0f32; model.config.n_embd];
        for token in [
            0,
            model.config.n_vocab as u32 - 1,
            model.config.n_vocab as u32,
        ] {
            let _ = model.embed(token, &mut row);
        }
    }
});

/// Every typed accessor on every key, and the lookups of the header.
fn every_accessor(header: &Header) {
    let md: &Metadata = &header.metadata;
    assert_eq!(md.iter().count(), md.len());
    for (key, value) in md.iter() {
        // By identity: metadata may hold NaN, which is not equal to itself.
        assert!(md.get(key).is_some_and(|v| std::ptr::eq(v, value)));
        let _ = json_value(value);
        let _ = (
            md.get_u32(key),
            md.get_u64(key),
            md.get_i32(key),
            md.get_i64(key),
        );
        let _ = (
            md.get_f32(key),
            md.get_f64(key),
            md.get_bool(key),
            md.get_str(key),
        );
        let _ = (
            md.get_array(key),
            md.get_string_array(key),
            md.get_f32_array(key),
        );
        let _ = (md.get_i32_array(key), md.get_u32_array(key));
        if let Ok(a) = md.get_array(key) {
            assert_eq!(a.is_empty(), a.len() == 0);
        }
    }
    let _ = header.architecture();
    for t in &header.tensors {
        assert_eq!(header.tensor(&t.name).map(|f| &f.name), Some(&t.name));
        assert!((1..=4).contains(&t.dims.len()));
        assert_eq!(t.n_elements, t.dims.iter().product::<u64>());
        let _ = (0..5).map(|axis| t.dim(axis)).count();
    }
}
