//! Unit tests of the reader: a file with every value type parses back exactly, and the typed
//! metadata accessors check what is stored.

use super::*;

/// Encodes a value the way GGUF stores it (type tag first), for building test files.
fn encode(v: &Value, out: &mut Vec<u8>) {
    out.extend((v.value_type() as u32).to_le_bytes());
    match v {
        Value::Array(a) => {
            out.extend((a.element_type() as u32).to_le_bytes());
            out.extend((a.len() as u64).to_le_bytes());
            match a {
                Array::U8(x) => out.extend(x),
                Array::I8(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Array::U16(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Array::I16(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Array::U32(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Array::I32(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Array::F32(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Array::Bool(x) => out.extend(x.iter().map(|&b| u8::from(b))),
                Array::String(x) => x.iter().for_each(|s| put_str(s, out)),
                Array::U64(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Array::I64(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
                Array::F64(x) => x.iter().for_each(|e| out.extend(e.to_le_bytes())),
            }
        }
        scalar => encode_scalar(scalar, out),
    }
}

fn encode_scalar(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(s, out),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Array(_) => unreachable!("arrays are encoded by `encode`"),
    }
}

fn put_str(s: &str, out: &mut Vec<u8>) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn sample_entries() -> Vec<(String, Value)> {
    let s = |x: &str| x.to_owned();
    vec![
        (s("general.alignment"), Value::U32(64)),
        (s("t.u8"), Value::U8(200)),
        (s("t.i8"), Value::I8(-100)),
        (s("t.u16"), Value::U16(60_000)),
        (s("t.i16"), Value::I16(-30_000)),
        (s("t.u32"), Value::U32(4_000_000_000)),
        (s("t.i32"), Value::I32(-1)),
        (s("t.f32"), Value::F32(1.5e-5)),
        (s("t.bool"), Value::Bool(true)),
        (s("t.string"), Value::String(s("héllo"))),
        (s("t.u64"), Value::U64(u64::MAX)),
        (s("t.i64"), Value::I64(i64::MIN)),
        (s("t.f64"), Value::F64(-2.25)),
        (s("a.u8"), Value::Array(Array::U8(vec![1, 2, 255]))),
        (s("a.i8"), Value::Array(Array::I8(vec![-1, 7]))),
        (s("a.u16"), Value::Array(Array::U16(vec![65_535]))),
        (s("a.i16"), Value::Array(Array::I16(vec![-2, 3]))),
        (s("a.u32"), Value::Array(Array::U32(vec![9, 8, 7]))),
        (s("a.i32"), Value::Array(Array::I32(vec![-5, 5]))),
        (
            s("a.f32"),
            Value::Array(Array::F32(vec![0.5, -0.0, f32::MAX])),
        ),
        (s("a.bool"), Value::Array(Array::Bool(vec![true, false]))),
        (
            s("a.string"),
            Value::Array(Array::String(vec![s("a"), s(""), s("Ġthe")])),
        ),
        (s("a.u64"), Value::Array(Array::U64(vec![1 << 40]))),
        (s("a.i64"), Value::Array(Array::I64(vec![-(1 << 40)]))),
        (s("a.f64"), Value::Array(Array::F64(vec![]))),
    ]
}

/// Two tensors, an F32 [4, 2] (32 bytes) and a Q8_0 [32] (34 bytes), aligned to 64.
fn sample_file() -> Vec<u8> {
    let entries = sample_entries();
    let mut out = Vec::new();
    out.extend(GGUF_MAGIC.to_le_bytes());
    out.extend(3u32.to_le_bytes());
    out.extend(2u64.to_le_bytes());
    out.extend((entries.len() as u64).to_le_bytes());
    for (k, v) in &entries {
        put_str(k, &mut out);
        encode(v, &mut out);
    }
    for (name, dims, ty, offset) in [("a", &[4u64, 2][..], 0u32, 0u64), ("b", &[32], 8, 64)] {
        put_str(name, &mut out);
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
    }
    out.resize(out.len().next_multiple_of(64), 0);
    out.extend((0..64u8).chain(100..134));
    out
}

#[test]
fn every_value_type_and_tensor_parses_back_exactly() {
    let bytes = sample_file();
    let h = parse_header(&bytes).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.alignment, 64);
    assert_eq!(h.data_offset % 64, 0);
    assert_eq!(bytes.len() as u64, h.data_offset + 64 + 34);
    let got: Vec<(String, Value)> = h
        .metadata
        .iter()
        .map(|(k, v)| (k.to_owned(), v.clone()))
        .collect();
    assert_eq!(got, sample_entries());
    let a = TensorInfo {
        name: "a".into(),
        ggml_type: GgmlType::F32,
        dims: vec![4, 2],
        offset: 0,
        n_elements: 8,
        n_bytes: 32,
    };
    let b = TensorInfo {
        name: "b".into(),
        ggml_type: GgmlType::Q8_0,
        dims: vec![32],
        offset: 64,
        n_elements: 32,
        n_bytes: 34,
    };
    assert_eq!(h.tensors, vec![a, b]);
    assert_eq!(h.architecture(), None);
}

#[test]
fn open_maps_the_tensor_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sample.gguf");
    std::fs::write(&path, sample_file()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.file_size(), sample_file().len() as u64);
    assert_eq!(f.metadata().len(), sample_entries().len());
    let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    let a = f.tensor("a").unwrap();
    assert_eq!(f.tensor_data(a), (0..32).collect::<Vec<u8>>());
    let b = f.tensor("b").unwrap();
    assert_eq!(f.tensor_data(b), (100..134).collect::<Vec<u8>>());
    assert!(f.tensor("c").is_none());
    let mut foreign = b.clone();
    foreign.offset = u64::MAX - 3;
    assert!(f.tensor_data(&foreign).is_empty());
}

#[test]
fn from_bytes_gives_the_file_open_gives_and_the_same_errors() {
    let bytes = sample_file();
    let f = GgufFile::from_bytes(&bytes).unwrap();
    assert_eq!(f.header(), &parse_header(&bytes).unwrap());
    assert_eq!(f.file_size(), bytes.len() as u64);
    let b = f.tensor("b").unwrap();
    assert_eq!(f.tensor_data(b), (100..134).collect::<Vec<u8>>());
    assert!(matches!(
        GgufFile::from_bytes(&[]),
        Err(GgufError::UnexpectedEof { .. })
    ));
    let cut = &bytes[..bytes.len() - 1];
    assert!(matches!(
        GgufFile::from_bytes(cut),
        Err(GgufError::TensorPastEnd { ref tensor, .. }) if tensor == "b"
    ));
}

#[test]
fn integer_accessors_accept_any_width_that_fits() {
    let md = parse_header(&sample_file()).unwrap().metadata;
    assert_eq!(md.get_u32("t.u8").unwrap(), 200);
    assert_eq!(md.get_u32("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(md.get_u64("t.u64").unwrap(), u64::MAX);
    assert_eq!(md.get_i32("t.i8").unwrap(), -100);
    assert_eq!(md.get_i64("t.i64").unwrap(), i64::MIN);
    assert!(matches!(
        md.get_u32("t.i32"),
        Err(GgufError::IntegerOutOfRange { key, target: "u32", value: -1 }) if key == "t.i32"
    ));
    assert!(matches!(
        md.get_i32("t.u32"),
        Err(GgufError::IntegerOutOfRange { target: "i32", .. })
    ));
    assert!(matches!(
        md.get_u32("t.f32"),
        Err(GgufError::WrongType {
            expected: "u32",
            found: "f32",
            ..
        })
    ));
    assert!(matches!(
        md.get_u64("t.bool"),
        Err(GgufError::WrongType { found: "bool", .. })
    ));
}

#[test]
fn typed_accessors_check_the_stored_type() {
    let md = parse_header(&sample_file()).unwrap().metadata;
    assert_eq!(md.get_f32("t.f32").unwrap(), 1.5e-5);
    assert_eq!(md.get_f64("t.f32").unwrap(), f64::from(1.5e-5f32));
    assert_eq!(md.get_f64("t.f64").unwrap(), -2.25);
    assert!(md.get_bool("t.bool").unwrap());
    assert_eq!(md.get_str("t.string").unwrap(), "héllo");
    assert_eq!(md.get_array("a.u8").unwrap().len(), 3);
    assert_eq!(md.get_string_array("a.string").unwrap()[2], "Ġthe");
    assert_eq!(md.get_f32_array("a.f32").unwrap()[0], 0.5);
    assert_eq!(md.get_i32_array("a.i32").unwrap(), [-5, 5]);
    assert_eq!(md.get_u32_array("a.u32").unwrap(), [9, 8, 7]);

    assert!(matches!(
        md.get_f32("t.f64"),
        Err(GgufError::WrongType { found: "f64", .. })
    ));
    assert!(matches!(
        md.get_str("t.u32"),
        Err(GgufError::WrongType {
            expected: "string",
            ..
        })
    ));
    assert!(matches!(
        md.get_bool("t.u8"),
        Err(GgufError::WrongType {
            expected: "bool",
            ..
        })
    ));
    assert!(matches!(
        md.get_array("t.string"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        md.get_string_array("a.f32"),
        Err(GgufError::WrongType {
            expected: "array of string",
            found: "array of f32",
            ..
        })
    ));
    assert!(matches!(
        md.get_i32_array("a.u32"),
        Err(GgufError::WrongType {
            found: "array of u32",
            ..
        })
    ));
    assert!(matches!(md.get_u32("nope"), Err(GgufError::MissingKey { key }) if key == "nope"));
    assert_eq!(md.opt_u32("nope").unwrap(), None);
    assert_eq!(md.opt_str("t.string").unwrap(), Some("héllo"));
    assert!(md.opt_str("t.u8").is_err());
}

#[test]
fn metadata_insert_rejects_duplicates_and_keeps_order() {
    let mut md = Metadata::new();
    md.insert("b", Value::U8(1)).unwrap();
    md.insert("a", Value::U8(2)).unwrap();
    assert!(
        matches!(md.insert("b", Value::U8(3)), Err(GgufError::DuplicateKey { key }) if key == "b")
    );
    assert_eq!(md.iter().map(|(k, _)| k).collect::<Vec<_>>(), ["b", "a"]);
    assert_eq!(md.get("b"), Some(&Value::U8(1)));
}
