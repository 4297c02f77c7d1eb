//! A corpus of malformed GGUF files, one or more per rule of the reader, each opened from disk
//! and expected to fail with the specific error naming what is wrong; plus a check that no
//! truncation or single-byte corruption of a valid file makes the parser panic.

#[path = "common/gguf_bytes.rs"]
mod gguf_bytes;

/// Metadata contradicting the tensors of llama, qwen2/3 and their MoE variants.
#[path = "gguf_malformed/architecture.rs"]
mod architecture;

use gguf_bytes::{llama_spec, model, qwen2moe_spec, vt, Bytes, F32, Q8_0};
use spillway_daemon::gguf::{parse_header, GgmlType, GgufError, GgufFile, ValueType};

fn open(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, bytes).unwrap();
    GgufFile::open(&path)
}

/// A file with one metadata entry, `key` of type `ty`, whose payload `value` writes.
fn one_kv(key: &[u8], ty: u32, value: impl FnOnce(&mut Bytes)) -> Vec<u8> {
    let mut b = Bytes::new();
    b.header(3, 0, 1).str(key).u32(ty);
    value(&mut b);
    b.to_vec()
}

/// A file with the given tensor infos (and `general.alignment` when not 32) and `data` bytes.
fn tensors(infos: &[(&str, &[u64], u32, u64)], data: usize) -> Vec<u8> {
    let mut b = Bytes::new();
    b.header(3, infos.len() as u64, 0);
    for &(name, dims, ty, offset) in infos {
        b.tensor_info(name, dims, ty, offset);
    }
    b.pad_to(32).zeros(data).to_vec()
}

fn alignment_file(ty: u32, value: impl FnOnce(&mut Bytes)) -> Vec<u8> {
    one_kv(b"general.alignment", ty, value)
}

// ---- Framing ------------------------------------------------------------------------------

#[test]
fn rejects_empty_file() {
    assert!(matches!(open(&[]), Err(GgufError::UnexpectedEof { what, .. }) if what == "magic"));
}

#[test]
fn rejects_bad_magic() {
    let mut bytes = tensors(&[], 0);
    bytes[..4].copy_from_slice(b"GGML");
    let found = u32::from_le_bytes(*b"GGML");
    assert!(matches!(open(&bytes), Err(GgufError::BadMagic { found: f }) if f == found));
}

#[test]
fn rejects_version_1() {
    let bytes = Bytes::new().header(1, 0, 0).to_vec();
    assert!(matches!(
        open(&bytes),
        Err(GgufError::UnsupportedVersion { version: 1 })
    ));
}

#[test]
fn rejects_big_endian_version() {
    let bytes = Bytes::new().header(3u32.swap_bytes(), 0, 0).to_vec();
    assert!(matches!(
        open(&bytes),
        Err(GgufError::UnsupportedVersion {
            version: 0x0300_0000
        })
    ));
}

#[test]
fn accepts_version_2() {
    let bytes = Bytes::new().header(2, 0, 0).to_vec();
    assert_eq!(open(&bytes).unwrap().version(), 2);
}

#[test]
fn rejects_tensor_count_over_limit() {
    let bytes = Bytes::new().header(3, 65_537, 0).to_vec();
    assert!(matches!(
        open(&bytes),
        Err(GgufError::TooManyTensors { count: 65_537, .. })
    ));
}

#[test]
fn rejects_kv_count_over_limit() {
    let bytes = Bytes::new().header(3, 0, 8_193).to_vec();
    assert!(matches!(
        open(&bytes),
        Err(GgufError::TooManyKeys { count: 8_193, .. })
    ));
}

#[test]
fn rejects_tensor_count_larger_than_the_file_holds() {
    let bytes = Bytes::new().header(3, 65_536, 0).to_vec();
    assert!(matches!(
        open(&bytes),
        Err(GgufError::UnexpectedEof { what, .. }) if what == "length of name of tensor 0"
    ));
}

// ---- Lengths and counts past the end ----------------------------------------------------------

#[test]
fn rejects_string_length_past_end_of_file() {
    let bytes = one_kv(b"general.name", vt::STRING, |b| {
        b.u64(1_000).raw(b"abc");
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::StringPastEnd { what, len: 1_000, available: 3, .. })
            if what == "value of general.name"
    ));
}

#[test]
fn rejects_key_length_past_end_of_file() {
    let bytes = Bytes::new()
        .header(3, 0, 1)
        .u64(u64::MAX)
        .raw(b"general")
        .to_vec();
    assert!(matches!(
        open(&bytes),
        Err(GgufError::StringPastEnd { what, len: u64::MAX, .. })
            if what == "key of metadata entry 0"
    ));
}

#[test]
fn rejects_huge_array_count_in_tiny_file_without_allocating() {
    let bytes = one_kv(b"tokenizer.ggml.merges", vt::ARRAY, |b| {
        b.u32(vt::U8).u64(1 << 60).raw(&[1, 2, 3]);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::ArrayPastEnd { key, count, elem_type: ValueType::U8, available: 3 })
            if key == "tokenizer.ggml.merges" && count == 1 << 60
    ));
}

#[test]
fn rejects_array_whose_byte_size_overflows() {
    let bytes = one_kv(b"x.ids", vt::ARRAY, |b| {
        b.u32(vt::U64).u64(1 << 62);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::ArrayPastEnd { key, elem_type: ValueType::U64, .. }) if key == "x.ids"
    ));
}

#[test]
fn rejects_string_array_count_past_end_of_file() {
    // 100 strings need at least 800 bytes of length prefixes.
    let bytes = one_kv(b"tokenizer.ggml.tokens", vt::ARRAY, |b| {
        b.u32(vt::STRING).u64(100).zeros(90);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::ArrayPastEnd {
            count: 100,
            elem_type: ValueType::String,
            ..
        })
    ));
}

#[test]
fn rejects_string_array_element_past_end_of_file() {
    let bytes = one_kv(b"tokenizer.ggml.tokens", vt::ARRAY, |b| {
        b.u32(vt::STRING).u64(2).str("a").u64(1_000_000).zeros(8);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::StringPastEnd { what, len: 1_000_000, .. })
            if what == "element 1 of tokenizer.ggml.tokens"
    ));
}

// ---- Value types ------------------------------------------------------------------------------

#[test]
fn rejects_nested_array() {
    let bytes = one_kv(b"x.nested", vt::ARRAY, |b| {
        b.u32(vt::ARRAY).u64(1).u32(vt::U8).u64(0);
    });
    assert!(matches!(open(&bytes), Err(GgufError::NestedArray { key }) if key == "x.nested"));
}

#[test]
fn rejects_unknown_value_type() {
    let bytes = one_kv(b"x.odd", 13, |b| {
        b.u64(0);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::UnknownValueType { key, type_id: 13 }) if key == "x.odd"
    ));
}

#[test]
fn rejects_unknown_array_element_type() {
    let bytes = one_kv(b"x.odd", vt::ARRAY, |b| {
        b.u32(99).u64(0);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::UnknownValueType { key, type_id: 99 }) if key == "x.odd"
    ));
}

#[test]
fn rejects_bool_that_is_neither_0_nor_1() {
    let bytes = one_kv(b"tokenizer.ggml.add_bos_token", vt::BOOL, |b| {
        b.u8(2);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::InvalidBool { what, byte: 2 }) if what == "value of tokenizer.ggml.add_bos_token"
    ));
}

#[test]
fn rejects_duplicate_key() {
    let bytes = Bytes::new()
        .header(3, 0, 2)
        .kv_u32("a.b", 1)
        .kv_u32("a.b", 2)
        .to_vec();
    assert!(matches!(open(&bytes), Err(GgufError::DuplicateKey { key }) if key == "a.b"));
}

// ---- Names and UTF-8 --------------------------------------------------------------------------

#[test]
fn rejects_key_over_256_bytes() {
    let key = "k".repeat(257);
    let bytes = Bytes::new().header(3, 0, 1).kv_u32(&key, 1).to_vec();
    assert!(matches!(
        open(&bytes),
        Err(GgufError::KeyTooLong {
            len: 257,
            max: 256,
            ..
        })
    ));
}

#[test]
fn rejects_tensor_name_of_64_bytes_but_accepts_63() {
    let ok = "n".repeat(63);
    assert!(open(&tensors(&[(&ok, &[8], F32, 0)], 32)).is_ok());
    let long = "n".repeat(64);
    assert!(matches!(
        open(&tensors(&[(&long, &[8], F32, 0)], 32)),
        Err(GgufError::TensorNameTooLong {
            len: 64,
            max: 63,
            ..
        })
    ));
}

#[test]
fn rejects_non_utf8_key() {
    let bytes = one_kv(b"general.\xff", vt::U32, |b| {
        b.u32(1);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::InvalidUtf8 { what }) if what == "key of metadata entry 0"
    ));
}

#[test]
fn rejects_non_utf8_string_value() {
    let bytes = one_kv(b"general.name", vt::STRING, |b| {
        b.str(b"ab\xc3");
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::InvalidUtf8 { what }) if what == "value of general.name"
    ));
}

#[test]
fn rejects_non_utf8_string_in_array() {
    let bytes = one_kv(b"tokenizer.ggml.tokens", vt::ARRAY, |b| {
        b.u32(vt::STRING).u64(2).str("ok").str(b"\x80");
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::InvalidUtf8 { what }) if what == "element 1 of tokenizer.ggml.tokens"
    ));
}

#[test]
fn rejects_non_utf8_tensor_name() {
    let mut b = Bytes::new();
    b.header(3, 1, 0)
        .str(b"blk.\xfe")
        .u32(1)
        .u64(8)
        .u32(F32)
        .u64(0)
        .pad_to(32)
        .zeros(32);
    assert!(matches!(
        open(&b.to_vec()),
        Err(GgufError::InvalidUtf8 { what }) if what == "name of tensor 0"
    ));
}

// ---- Alignment --------------------------------------------------------------------------------

#[test]
fn rejects_alignment_that_is_not_u32() {
    let bytes = alignment_file(vt::U64, |b| {
        b.u64(32);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::WrongType { key, expected: "u32", found: "u64" }) if key == "general.alignment"
    ));
}

#[test]
fn rejects_alignment_not_a_power_of_two() {
    let bytes = alignment_file(vt::U32, |b| {
        b.u32(48);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::InvalidAlignment { value: 48, .. })
    ));
}

#[test]
fn rejects_alignment_zero() {
    let bytes = alignment_file(vt::U32, |b| {
        b.u32(0);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::InvalidAlignment { value: 0, .. })
    ));
}

#[test]
fn rejects_alignment_above_64_kib() {
    let bytes = alignment_file(vt::U32, |b| {
        b.u32(1 << 17);
    });
    assert!(matches!(
        open(&bytes),
        Err(GgufError::InvalidAlignment { value: 131_072, .. })
    ));
}

// ---- Tensor infos -----------------------------------------------------------------------------

#[test]
fn rejects_unknown_tensor_type() {
    let bytes = tensors(&[("w", &[32], 4, 0)], 64);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::UnknownTensorType { tensor, type_id: 4 }) if tensor == "w"
    ));
}

#[test]
fn rejects_duplicate_tensor_name() {
    let bytes = tensors(&[("w", &[8], F32, 0), ("w", &[8], F32, 32)], 64);
    assert!(matches!(open(&bytes), Err(GgufError::DuplicateTensor { name }) if name == "w"));
}

#[test]
fn rejects_tensor_with_zero_dimensions() {
    let bytes = tensors(&[("w", &[], F32, 0)], 32);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::BadDimensionCount { tensor, n_dims: 0, .. }) if tensor == "w"
    ));
}

#[test]
fn rejects_tensor_with_five_dimensions() {
    let bytes = tensors(&[("w", &[1, 1, 1, 1, 1], F32, 0)], 32);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::BadDimensionCount { n_dims: 5, .. })
    ));
}

#[test]
fn rejects_dimension_of_size_zero() {
    let bytes = tensors(&[("w", &[8, 0], F32, 0)], 32);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::ZeroDimension { tensor, axis: 1 }) if tensor == "w"
    ));
}

#[test]
fn rejects_element_count_overflow() {
    let bytes = tensors(&[("w", &[1 << 32, 1 << 32, 2], F32, 0)], 32);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::SizeOverflow { tensor, what: "element count" }) if tensor == "w"
    ));
}

#[test]
fn rejects_byte_size_overflow() {
    // 2^62 elements fit in u64; their 2^64 bytes do not.
    let bytes = tensors(&[("w", &[1 << 62], F32, 0)], 32);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::SizeOverflow {
            what: "byte size",
            ..
        })
    ));
}

#[test]
fn rejects_row_that_is_not_whole_blocks() {
    let bytes = tensors(&[("w", &[40, 2], Q8_0, 0)], 128);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::NotWholeBlocks { tensor, ggml_type: GgmlType::Q8_0, ne0: 40, block_size: 32 })
            if tensor == "w"
    ));
}

#[test]
fn rejects_misaligned_tensor_offset() {
    let bytes = tensors(&[("w", &[8], F32, 4)], 64);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::MisalignedTensor { tensor, offset: 4, alignment: 32 }) if tensor == "w"
    ));
}

#[test]
fn rejects_overlapping_tensors() {
    // "a" takes bytes 0..64, "b" starts at 32.
    let bytes = tensors(&[("b", &[8], F32, 32), ("a", &[16], F32, 0)], 96);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::OverlappingTensors { first, second }) if first == "a" && second == "b"
    ));
}

#[test]
fn rejects_tensor_data_past_end_of_file() {
    let bytes = tensors(&[("a", &[8], F32, 0), ("b", &[8], F32, 32)], 40);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::TensorPastEnd { tensor, .. }) if tensor == "b"
    ));
}

#[test]
fn rejects_tensor_offset_whose_end_overflows() {
    let bytes = tensors(&[("w", &[8], F32, u64::MAX - 31)], 32);
    assert!(matches!(
        open(&bytes),
        Err(GgufError::SizeOverflow { tensor, what: "end offset" }) if tensor == "w"
    ));
}

// llama.cpp's CVE-2025-53630: tensors each within u64 whose sizes sum past it (2^63 bytes each,
// the second at offset 2^63). ggml summed the padded sizes into the data blob's size, which
// wrapped to 0, and then read and wrote every tensor out of bounds. Each tensor's end is checked
// against the file here, never a sum.
#[test]
fn rejects_tensors_whose_sizes_sum_past_u64() {
    let bytes = tensors(
        &[("a", &[1 << 61], F32, 0), ("b", &[1 << 61], F32, 1 << 63)],
        32,
    );
    let err = open(&bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::TensorPastEnd { tensor, .. } if tensor == "a"),
        "{err:?}"
    );
}

// llama.cpp's CVE-2026-27940: one tensor whose byte size is just under 2^64 (2^64 - 4, and
// 2^64 - 32), so that padding it or adding the context's overhead wrapped and the allocation
// came out small. Here its end offset overflows and says so.
#[test]
fn rejects_tensor_sizes_just_below_u64_max() {
    for elements in [(1u64 << 62) - 1, (1 << 62) - 8] {
        let bytes = tensors(&[("w", &[elements], F32, 0)], 32);
        let err = open(&bytes).unwrap_err();
        assert!(
            matches!(&err, GgufError::SizeOverflow { tensor, what: "end offset" } if tensor == "w"),
            "{elements} elements: {err:?}"
        );
    }
}

// llama.cpp's CVE-2024-23496 (`gguf_fread_str`, a length of 2^64 - 1 that wrapped `calloc(n +
// 1)`) on the path of a tensor's name; `rejects_key_length_past_end_of_file` covers keys.
#[test]
fn rejects_tensor_name_length_of_u64_max() {
    let bytes = Bytes::new()
        .header(3, 1, 0)
        .u64(u64::MAX)
        .raw(b"w")
        .to_vec();
    let err = open(&bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::StringPastEnd { what, len: u64::MAX, .. } if what == "name of tensor 0"),
        "{err:?}"
    );
}

#[test]
fn rejects_truncated_file_at_several_points() {
    let full = model(&llama_spec()).to_bytes();
    let eof_reading = |len: usize| match parse_header(&full[..len]) {
        Err(GgufError::UnexpectedEof { what, .. }) => what,
        other => panic!("truncated at {len}: {other:?}"),
    };
    assert_eq!(eof_reading(2), "magic");
    assert_eq!(eof_reading(6), "version");
    assert_eq!(eof_reading(12), "tensor count");
    assert_eq!(eof_reading(20), "metadata entry count");
    assert_eq!(eof_reading(28), "length of key of metadata entry 0");
    assert_eq!(
        eof_reading(24 + 8 + 20 + 2),
        "value type of general.architecture"
    );
    // Cut inside the first key's bytes: its length now claims more than is left.
    assert!(matches!(
        parse_header(&full[..40]),
        Err(GgufError::StringPastEnd { what, .. }) if what == "key of metadata entry 0"
    ));
    // Cut in the last tensor info's offset field: name (8 + 13), n_dims (4), 2 dims, type (4).
    let name_at = full
        .windows(13)
        .rposition(|w| w == b"output.weight")
        .unwrap();
    assert_eq!(
        eof_reading(name_at + 13 + 4 + 16 + 4 + 3),
        "offset of tensor output.weight"
    );
    // Cut in the data section: the last tensor no longer fits.
    assert!(matches!(
        open(&full[..full.len() - 1]),
        Err(GgufError::TensorPastEnd { tensor, .. }) if tensor == "output.weight"
    ));
}

// ---- Robustness -------------------------------------------------------------------------------

/// Every prefix and ~2000 single-byte corruptions of a valid MoE file parse to Ok or Err; a
/// panic (or an abort from a huge allocation) fails the test.
#[test]
fn truncations_and_byte_mutations_never_panic() {
    let valid = model(&qwen2moe_spec()).to_bytes();
    let header_end = parse_header(&valid).unwrap().data_offset as usize;
    for len in 0..valid.len() {
        let _ = parse_header(&valid[..len]);
    }
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        state >> 33
    };
    let mut bytes = valid.clone();
    let mut rejected = 0;
    for _ in 0..2_000 {
        // Mutate the header, where the structure lives; the zeroed data section is inert.
        let at = next() as usize % header_end;
        let byte = next() as u8;
        bytes[at] = byte;
        rejected += usize::from(parse_header(&bytes).is_err());
        bytes[at] = valid[at];
    }
    assert!(rejected > 0);
}
