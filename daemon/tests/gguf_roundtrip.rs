//! The streaming writer and the validating reader agree: what one writes, the other reads back,
//! metadata of every value type, tensors of several types and shapes, holes included.

use std::io::Read;

use spillway_daemon::gguf::writer::{GgufWriter, TensorSpec};
use spillway_daemon::gguf::{Array, GgmlType, GgufFile, Value};

fn every_value_type() -> Vec<(String, Value)> {
    let entries = vec![
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60_000)),
        ("t.i16", Value::I16(-30_000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.f32", Value::F32(-1.5e-6)),
        ("t.bool", Value::Bool(true)),
        ("t.string", Value::String("ünïcødé ▁piece Ġ".into())),
        ("t.empty_string", Value::String(String::new())),
        ("t.u64", Value::U64(u64::MAX)),
        ("t.i64", Value::I64(i64::MIN)),
        ("t.f64", Value::F64(std::f64::consts::PI)),
        ("a.u8", Value::Array(Array::U8(vec![0, 1, 255]))),
        ("a.i8", Value::Array(Array::I8(vec![-128, 0, 127]))),
        ("a.u16", Value::Array(Array::U16(vec![1, 65_535]))),
        ("a.i16", Value::Array(Array::I16(vec![-1, 32_767]))),
        ("a.u32", Value::Array(Array::U32(vec![7; 1000]))),
        ("a.i32", Value::Array(Array::I32(vec![-7, 3, 6]))),
        ("a.f32", Value::Array(Array::F32(vec![0.0, -0.25, 1e30]))),
        ("a.bool", Value::Array(Array::Bool(vec![true, false, true]))),
        (
            "a.string",
            Value::Array(Array::String(vec!["a".into(), String::new(), "é b".into()])),
        ),
        ("a.u64", Value::Array(Array::U64(vec![u64::MAX, 0]))),
        ("a.i64", Value::Array(Array::I64(vec![i64::MIN, 1]))),
        ("a.f64", Value::Array(Array::F64(vec![1e-300, -2.0]))),
        ("a.empty", Value::Array(Array::U32(Vec::new()))),
    ];
    entries
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn tensors() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("vec.f32", GgmlType::F32, &[7]),
        TensorSpec::new("mat.f16", GgmlType::F16, &[64, 3]),
        TensorSpec::new("mat.q8_0", GgmlType::Q8_0, &[96, 5]),
        TensorSpec::new("mat.q4_k", GgmlType::Q4K, &[512, 2]),
        TensorSpec::new("experts.q6_k", GgmlType::Q6K, &[256, 3, 4]),
        TensorSpec::new("four.bf16", GgmlType::BF16, &[2, 3, 4, 5]),
    ]
}

/// Distinct, recognisable bytes for each tensor.
fn pattern(index: usize, n: u64) -> Vec<u8> {
    (0..n)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(index as u8 * 17 + 1)
        })
        .collect()
}

#[test]
fn metadata_and_tensors_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("all.gguf");
    let metadata = every_value_type();
    let specs = tensors();
    let mut w = GgufWriter::create(&path, &metadata, &specs).unwrap();
    let sizes: Vec<u64> = w.layout().tensors.iter().map(|t| t.n_bytes).collect();
    for (i, spec) in specs.iter().enumerate() {
        let data = pattern(i, sizes[i]);
        if i % 2 == 0 {
            w.write_tensor_data(&spec.name, &data[..]).unwrap();
        } else {
            // Odd chunk sizes: the writer must not care where chunks end.
            w.begin_tensor(&spec.name).unwrap();
            for chunk in data.chunks(7) {
                w.write_chunk(chunk).unwrap();
            }
        }
    }
    let planned_size = w.layout().file_size();
    w.finish().unwrap();

    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.file_size(), planned_size);
    let read: Vec<(String, Value)> = file
        .metadata()
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    assert_eq!(read, metadata);
    assert_eq!(file.tensors().len(), specs.len());
    for (i, (t, spec)) in file.tensors().iter().zip(&specs).enumerate() {
        assert_eq!(t.name, spec.name);
        assert_eq!(t.ggml_type, spec.ggml_type);
        assert_eq!(t.dims, spec.dims);
        assert_eq!(t.n_bytes, sizes[i]);
        assert_eq!(t.offset % 32, 0);
        assert_eq!(file.tensor_data(t), pattern(i, sizes[i]), "{}", t.name);
    }
}

#[test]
fn custom_alignment_places_data_on_its_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("aligned.gguf");
    let metadata = vec![("general.alignment".to_string(), Value::U32(256))];
    let specs = tensors();
    let mut w = GgufWriter::create(&path, &metadata, &specs).unwrap();
    for t in w.layout().tensors.clone() {
        w.write_tensor_data(&t.spec.name, &pattern(0, t.n_bytes)[..])
            .unwrap();
    }
    w.finish().unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.alignment(), 256);
    assert_eq!(file.data_offset() % 256, 0);
    assert!(file.tensors().iter().all(|t| t.offset % 256 == 0));
}

#[test]
fn skipped_tensors_read_back_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.gguf");
    let specs = tensors();
    let mut w = GgufWriter::create(&path, &[], &specs).unwrap();
    let layout = w.layout().clone();
    for (i, t) in layout.tensors.iter().enumerate() {
        if i == 0 {
            w.write_tensor_data(&t.spec.name, &pattern(i, t.n_bytes)[..])
                .unwrap();
        } else {
            w.skip_tensor(&t.spec.name).unwrap();
        }
    }
    w.finish().unwrap();
    let mut bytes = Vec::new();
    std::fs::File::open(&path)
        .unwrap()
        .read_to_end(&mut bytes)
        .unwrap();
    assert_eq!(bytes.len() as u64, layout.file_size());
    let file = GgufFile::open(&path).unwrap();
    let first = &file.tensors()[0];
    assert_eq!(file.tensor_data(first), pattern(0, first.n_bytes));
    for t in &file.tensors()[1..] {
        assert!(file.tensor_data(t).iter().all(|&b| b == 0), "{}", t.name);
    }
}

#[test]
fn a_file_with_no_tensors_is_valid() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.gguf");
    let metadata = every_value_type();
    GgufWriter::create(&path, &metadata, &[])
        .unwrap()
        .finish()
        .unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert!(file.tensors().is_empty());
    assert_eq!(file.metadata().len(), metadata.len());
}
