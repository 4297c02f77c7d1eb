//! Our weight formats against gguf-py, an independent (numpy) implementation of ggml's.
//!
//! The fixtures in `tests/data/quant/` come from `scripts/fixtures/make_quant_fixtures.py`;
//! `manifest.json` there lists them and records the gguf package version. Every comparison
//! is bit for bit. gguf-py and ggml's C differ only on NaN bits, in two places where numpy
//! casts instead of following ggml, and there the test checks ggml's behaviour instead:
//! - F16 dequantization: numpy keeps a signalling NaN signalling, ggml (software, F16C and
//!   ARM alike) quiets it and keeps the payload.
//! - F16 quantization: numpy keeps NaN payloads, ggml's reference writes 0x7e00; the script
//!   therefore feeds no NaNs to F16 quantization (the unit tests pin ggml's NaN there).

use std::path::{Path, PathBuf};

use serde_json::Value;
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::quant::{dequantize_row, quantize_row};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant")
}

/// One entry of `manifest.json`.
struct Fixture {
    op: String,
    ty: GgmlType,
    rows: usize,
    row_elements: usize,
    input: Vec<u8>,
    expected: Vec<u8>,
}

fn fixtures() -> Vec<Fixture> {
    let dir = data_dir();
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).expect("manifest.json"))
            .expect("manifest JSON");
    let read =
        |v: &Value| std::fs::read(dir.join(v.as_str().expect("file name"))).expect("fixture file");
    let count = |v: &Value| v.as_u64().expect("count") as usize;
    manifest["fixtures"]
        .as_array()
        .expect("fixtures array")
        .iter()
        .map(|f| Fixture {
            op: f["op"].as_str().expect("op").to_owned(),
            ty: GgmlType::from_name(f["type"].as_str().expect("type")).expect("known type"),
            rows: count(&f["rows"]),
            row_elements: count(&f["row_elements"]),
            input: read(&f["input"]),
            expected: read(&f["expected"]),
        })
        .collect()
}

fn fixture(op: &str, ty: GgmlType) -> Fixture {
    fixtures()
        .into_iter()
        .find(|f| f.op == op && f.ty == ty)
        .unwrap_or_else(|| panic!("no {op} fixture for {ty}"))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Dequantizes the fixture row by row and compares the f32 bits with gguf-py's.
fn check_dequantize(ty: GgmlType) {
    let f = fixture("dequantize", ty);
    let row_bytes = f.input.len() / f.rows;
    assert_eq!(
        Some(row_bytes as u64),
        ty.row_bytes(f.row_elements as u64),
        "{ty}: fixture geometry"
    );
    let expected = f32s(&f.expected);
    assert_eq!(expected.len(), f.rows * f.row_elements);

    let mut mismatches = Vec::new();
    for (r, (src, want)) in f
        .input
        .chunks_exact(row_bytes)
        .zip(expected.chunks_exact(f.row_elements))
        .enumerate()
    {
        let mut got = vec![0f32; f.row_elements];
        dequantize_row(ty, src, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let mut want_bits = w.to_bits();
            if ty == GgmlType::F16 && w.is_nan() {
                want_bits |= 0x0040_0000; // ggml quiets NaNs when widening; numpy does not.
            }
            if g.to_bits() != want_bits {
                mismatches.push(format!(
                    "row {r} [{i}]: got {:#010x} want {want_bits:#010x}",
                    g.to_bits()
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{ty}: {} mismatches, first: {:?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(8)]
    );
}

/// Quantizes the fixture's f32 rows and compares the bytes with gguf-py's.
fn check_quantize(ty: GgmlType) {
    let f = fixture("quantize", ty);
    let src = f32s(&f.input);
    assert_eq!(src.len(), f.rows * f.row_elements);
    let row_bytes = ty.row_bytes(f.row_elements as u64).unwrap() as usize;
    assert_eq!(
        f.expected.len(),
        f.rows * row_bytes,
        "{ty}: fixture geometry"
    );

    for (r, (x, want)) in src
        .chunks_exact(f.row_elements)
        .zip(f.expected.chunks_exact(row_bytes))
        .enumerate()
    {
        let mut got = vec![0u8; row_bytes];
        quantize_row(ty, x, &mut got).unwrap();
        if got != want {
            let first = got.iter().zip(want).position(|(g, w)| g != w).unwrap();
            panic!(
                "{ty} row {r}: first differing byte {first}: got {:#04x} want {:#04x}",
                got[first], want[first]
            );
        }
    }
}

#[test]
fn manifest_covers_every_implemented_format_and_records_the_generator() {
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(data_dir().join("manifest.json")).unwrap()).unwrap();
    assert!(manifest["gguf_version"]
        .as_str()
        .is_some_and(|v| !v.is_empty()));
    let all = fixtures();
    let has = |op: &str, ty| all.iter().any(|f| f.op == op && f.ty == ty);
    use GgmlType::*;
    for ty in [F32, F16, BF16, Q8_0, Q4_0, Q4K, Q6K] {
        assert!(has("dequantize", ty), "dequantize {ty}");
    }
    for ty in [F16, BF16, Q8_0, Q4_0] {
        assert!(has("quantize", ty), "quantize {ty}");
    }
}

#[test]
fn dequantize_f32_matches_gguf_py() {
    check_dequantize(GgmlType::F32);
}

#[test]
fn dequantize_f16_matches_gguf_py() {
    check_dequantize(GgmlType::F16);
}

#[test]
fn dequantize_bf16_matches_gguf_py() {
    check_dequantize(GgmlType::BF16);
}

#[test]
fn dequantize_q8_0_matches_gguf_py() {
    check_dequantize(GgmlType::Q8_0);
}

#[test]
fn dequantize_q4_0_matches_gguf_py() {
    check_dequantize(GgmlType::Q4_0);
}

#[test]
fn dequantize_q4_k_matches_gguf_py() {
    check_dequantize(GgmlType::Q4K);
}

#[test]
fn dequantize_q6_k_matches_gguf_py() {
    check_dequantize(GgmlType::Q6K);
}

#[test]
fn quantize_f16_matches_gguf_py() {
    check_quantize(GgmlType::F16);
}

#[test]
fn quantize_bf16_matches_gguf_py() {
    check_quantize(GgmlType::BF16);
}

#[test]
fn quantize_q8_0_matches_gguf_py() {
    check_quantize(GgmlType::Q8_0);
}

#[test]
fn quantize_q4_0_matches_gguf_py() {
    check_quantize(GgmlType::Q4_0);
}
