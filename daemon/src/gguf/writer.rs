//! A streaming GGUF v3 writer.
//!
//! The caller declares every metadata pair and every tensor (name, type, shape) up front; the
//! writer lays out the data section (each tensor at an offset aligned to `general.alignment`),
//! writes the header, and then takes each tensor's bytes in declaration order, in chunks of any
//! size. Nothing about the model has to sit in memory: a 100 GB model streams through a
//! `BufWriter`. A tensor can also be left as a hole ([`GgufWriter::skip_tensor`]), so that a file
//! with the real shapes of a model larger than the disk can be made sparse.

use std::fs::File;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use super::types::GgmlType;
use super::value::{Array, Value};
use super::DEFAULT_ALIGNMENT;

/// GGUF version this writer produces.
pub const GGUF_VERSION: u32 = 3;
/// ggml's `GGML_MAX_DIMS`: llama.cpp rejects tensors with more dimensions.
pub const MAX_DIMS: usize = 4;

const ALIGNMENT_KEY: &str = "general.alignment";

/// Why a file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("i/o error while writing GGUF: {0}")]
    Io(#[from] io::Error),
    #[error("metadata key {0:?} is declared twice")]
    DuplicateKey(String),
    #[error("tensor {0:?} is declared twice")]
    DuplicateTensor(String),
    #[error("general.alignment must be a u32, found {0}")]
    AlignmentType(&'static str),
    #[error("general.alignment {0} is not a non-zero power of two")]
    InvalidAlignment(u64),
    #[error("tensor {name:?} has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")]
    BadDimCount { name: String, n_dims: usize },
    #[error("tensor {name:?} has a zero-length dimension")]
    ZeroDim { name: String },
    #[error(
        "tensor {name:?}: row of {ne0} elements is not a whole number of {ty} blocks ({block})"
    )]
    PartialBlock {
        name: String,
        ty: GgmlType,
        ne0: u64,
        block: u64,
    },
    #[error("tensor {name:?}: size overflows u64")]
    SizeOverflow { name: String },
    #[error("expected data of tensor {expected:?} next, got {got:?}")]
    OutOfOrder {
        expected: Option<String>,
        got: String,
    },
    #[error("data written with no tensor begun")]
    NoTensorBegun,
    #[error("tensor {name:?} takes {expected} bytes; {attempted} were written to it")]
    TensorOverflow {
        name: String,
        expected: u64,
        attempted: u64,
    },
    #[error("tensor {name:?} takes {expected} bytes; only {written} were written")]
    TensorIncomplete {
        name: String,
        expected: u64,
        written: u64,
    },
    #[error("finished with {remaining} tensors unwritten, the first {next:?}")]
    MissingTensors { next: String, remaining: usize },
}

/// A tensor as declared before writing: dims are ggml's `ne`, innermost (row length) first.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub ggml_type: GgmlType,
    pub dims: Vec<u64>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, ggml_type: GgmlType, dims: &[u64]) -> Self {
        TensorSpec {
            name: name.into(),
            ggml_type,
            dims: dims.to_vec(),
        }
    }

    pub fn n_elements(&self) -> Option<u64> {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// Bytes of data, checked: whole blocks per row, no overflow.
    pub fn n_bytes(&self) -> Result<u64, WriteError> {
        if self.dims.is_empty() || self.dims.len() > MAX_DIMS {
            return Err(WriteError::BadDimCount {
                name: self.name.clone(),
                n_dims: self.dims.len(),
            });
        }
        if self.dims.contains(&0) {
            return Err(WriteError::ZeroDim {
                name: self.name.clone(),
            });
        }
        let ne0 = self.dims[0];
        let block = self.ggml_type.block_size();
        if !ne0.is_multiple_of(block) {
            return Err(WriteError::PartialBlock {
                name: self.name.clone(),
                ty: self.ggml_type,
                ne0,
                block,
            });
        }
        let overflow = || WriteError::SizeOverflow {
            name: self.name.clone(),
        };
        let rows = self.dims[1..]
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(overflow)?;
        self.ggml_type
            .row_bytes(ne0)
            .and_then(|r| r.checked_mul(rows))
            .ok_or_else(overflow)
    }
}

/// Where a declared tensor lands in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTensor {
    pub spec: TensorSpec,
    /// Offset from the start of the data section (what the tensor table stores).
    pub offset: u64,
    pub n_bytes: u64,
}

/// The complete layout of a file, known before a byte of it is written.
#[derive(Debug, Clone)]
pub struct Layout {
    pub alignment: u64,
    /// Absolute offset of the data section (the header's size, padded).
    pub data_offset: u64,
    pub tensors: Vec<PlannedTensor>,
    /// Size of the data section, each tensor padded to the alignment.
    pub data_size: u64,
}

impl Layout {
    /// Size of the finished file.
    pub fn file_size(&self) -> u64 {
        self.data_offset + self.data_size
    }

    /// Validates the declarations and places every tensor.
    pub fn plan(metadata: &[(String, Value)], tensors: &[TensorSpec]) -> Result<Self, WriteError> {
        let mut keys = std::collections::HashSet::new();
        let mut alignment = DEFAULT_ALIGNMENT;
        for (key, value) in metadata {
            if !keys.insert(key.as_str()) {
                return Err(WriteError::DuplicateKey(key.clone()));
            }
            if key == ALIGNMENT_KEY {
                alignment = match value {
                    Value::U32(a) => u64::from(*a),
                    other => return Err(WriteError::AlignmentType(other.value_type().name())),
                };
                if !alignment.is_power_of_two() {
                    return Err(WriteError::InvalidAlignment(alignment));
                }
            }
        }
        let header = header_size(metadata, tensors);
        let data_offset = align_up(header, alignment);
        let mut names = std::collections::HashSet::new();
        let mut offset = 0u64;
        let mut planned = Vec::with_capacity(tensors.len());
        for spec in tensors {
            if !names.insert(spec.name.as_str()) {
                return Err(WriteError::DuplicateTensor(spec.name.clone()));
            }
            let n_bytes = spec.n_bytes()?;
            let overflow = || WriteError::SizeOverflow {
                name: spec.name.clone(),
            };
            let end = offset
                .checked_add(n_bytes)
                .and_then(|e| e.checked_next_multiple_of(alignment))
                .ok_or_else(overflow)?;
            planned.push(PlannedTensor {
                spec: spec.clone(),
                offset,
                n_bytes,
            });
            offset = end;
        }
        Ok(Layout {
            alignment,
            data_offset,
            tensors: planned,
            data_size: offset,
        })
    }
}

fn align_up(x: u64, alignment: u64) -> u64 {
    x.div_ceil(alignment) * alignment
}

fn string_size(s: &str) -> u64 {
    8 + s.len() as u64
}

fn value_size(value: &Value) -> u64 {
    match value {
        Value::String(s) => string_size(s),
        Value::Array(a) => {
            12 + match a {
                Array::String(v) => v.iter().map(|s| string_size(s)).sum(),
                other => {
                    let scalar = other.element_type().scalar_size().unwrap_or(0) as u64;
                    scalar * other.len() as u64
                }
            }
        }
        other => other.value_type().scalar_size().unwrap_or(0) as u64,
    }
}

fn header_size(metadata: &[(String, Value)], tensors: &[TensorSpec]) -> u64 {
    let kv: u64 = metadata
        .iter()
        .map(|(k, v)| string_size(k) + 4 + value_size(v))
        .sum();
    let ti: u64 = tensors
        .iter()
        .map(|t| string_size(&t.name) + 4 + 8 * t.dims.len() as u64 + 4 + 8)
        .sum();
    4 + 4 + 8 + 8 + kv + ti
}

/// Tracks the tensor whose bytes are being written.
#[derive(Debug)]
struct Current {
    index: usize,
    written: u64,
}

/// Writes one GGUF file: header at construction, then tensor data in declaration order.
pub struct GgufWriter<W: Write + Seek> {
    out: W,
    layout: Layout,
    /// Index of the next tensor to begin.
    next: usize,
    current: Option<Current>,
    /// Absolute position the stream is at (tracked to seek and pad without asking the OS).
    pos: u64,
    /// Whether the last bytes of the file were skipped rather than written.
    ends_in_hole: bool,
}

impl GgufWriter<BufWriter<File>> {
    /// Creates (truncates) `path` and writes the header.
    pub fn create(
        path: impl AsRef<Path>,
        metadata: &[(String, Value)],
        tensors: &[TensorSpec],
    ) -> Result<Self, WriteError> {
        let file = File::create(path)?;
        Self::new(BufWriter::with_capacity(1 << 20, file), metadata, tensors)
    }
}

impl<W: Write + Seek> GgufWriter<W> {
    /// Plans the layout and writes header, metadata, tensor table and padding to `out`, which
    /// must be positioned at the start of the file.
    pub fn new(
        out: W,
        metadata: &[(String, Value)],
        tensors: &[TensorSpec],
    ) -> Result<Self, WriteError> {
        let layout = Layout::plan(metadata, tensors)?;
        let mut w = GgufWriter {
            out,
            layout,
            next: 0,
            current: None,
            pos: 0,
            ends_in_hole: false,
        };
        w.write_header(metadata)?;
        Ok(w)
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn write_header(&mut self, metadata: &[(String, Value)]) -> Result<(), WriteError> {
        let mut h = Vec::with_capacity(1 << 16);
        h.extend_from_slice(b"GGUF");
        h.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        h.extend_from_slice(&(self.layout.tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            put_string(&mut h, key);
            h.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            put_value(&mut h, value);
            // Flush big tokenizer arrays as they come so the header never needs much memory.
            if h.len() > 1 << 20 {
                self.emit(&h)?;
                h.clear();
            }
        }
        for t in &self.layout.tensors {
            put_string(&mut h, &t.spec.name);
            h.extend_from_slice(&(t.spec.dims.len() as u32).to_le_bytes());
            for d in &t.spec.dims {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&(t.spec.ggml_type as u32).to_le_bytes());
            h.extend_from_slice(&t.offset.to_le_bytes());
        }
        self.emit(&h)?;
        debug_assert!(self.pos <= self.layout.data_offset);
        self.pad_to(self.layout.data_offset, false)
    }

    fn emit(&mut self, bytes: &[u8]) -> Result<(), WriteError> {
        self.out.write_all(bytes)?;
        self.pos += bytes.len() as u64;
        self.ends_in_hole = false;
        Ok(())
    }

    /// Moves to absolute `target` (>= pos) with zeros, or with a seek when `hole`.
    fn pad_to(&mut self, target: u64, hole: bool) -> Result<(), WriteError> {
        if target == self.pos {
            return Ok(());
        }
        if hole {
            self.out.seek(SeekFrom::Start(target))?;
            self.pos = target;
            self.ends_in_hole = true;
        } else {
            const ZEROS: [u8; 4096] = [0; 4096];
            while self.pos < target {
                let n = (target - self.pos).min(ZEROS.len() as u64) as usize;
                self.emit(&ZEROS[..n])?;
            }
        }
        Ok(())
    }

    fn check_current_complete(&self) -> Result<(), WriteError> {
        if let Some(cur) = &self.current {
            let t = &self.layout.tensors[cur.index];
            if cur.written != t.n_bytes {
                return Err(WriteError::TensorIncomplete {
                    name: t.spec.name.clone(),
                    expected: t.n_bytes,
                    written: cur.written,
                });
            }
        }
        Ok(())
    }

    /// Checks that `name` is the next declared tensor and positions the stream at its data.
    fn advance_to(&mut self, name: &str, hole: bool) -> Result<usize, WriteError> {
        self.check_current_complete()?;
        let index = self.next;
        match self.layout.tensors.get(index) {
            Some(t) if t.spec.name == name => {}
            other => {
                return Err(WriteError::OutOfOrder {
                    expected: other.map(|t| t.spec.name.clone()),
                    got: name.to_string(),
                })
            }
        }
        let start = self.layout.data_offset + self.layout.tensors[index].offset;
        // Padding before a hole may itself be a hole; before real data it is written.
        self.pad_to(start, hole)?;
        self.next += 1;
        Ok(index)
    }

    /// Starts the data of tensor `name`, which must be the next one declared.
    pub fn begin_tensor(&mut self, name: &str) -> Result<(), WriteError> {
        let index = self.advance_to(name, false)?;
        self.current = Some(Current { index, written: 0 });
        Ok(())
    }

    /// Appends bytes to the tensor begun last; more than its size is an error.
    pub fn write_chunk(&mut self, bytes: &[u8]) -> Result<(), WriteError> {
        let cur = self.current.as_mut().ok_or(WriteError::NoTensorBegun)?;
        let t = &self.layout.tensors[cur.index];
        let attempted = cur.written + bytes.len() as u64;
        if attempted > t.n_bytes {
            return Err(WriteError::TensorOverflow {
                name: t.spec.name.clone(),
                expected: t.n_bytes,
                attempted,
            });
        }
        cur.written = attempted;
        self.emit(bytes)
    }

    /// Writes the whole data of tensor `name` from `reader`, which must yield exactly its size.
    pub fn write_tensor_data(&mut self, name: &str, reader: impl Read) -> Result<(), WriteError> {
        self.begin_tensor(name)?;
        let expected = self.layout.tensors[self.next - 1].n_bytes;
        // Read one byte past the size so that a reader with too much data is caught.
        let mut limited = reader.take(expected + 1);
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = limited.read(&mut buf)?;
            if n == 0 {
                break;
            }
            self.write_chunk(&buf[..n])?;
        }
        self.check_current_complete()
    }

    /// Leaves the data of tensor `name` as a hole: it reads back as zeros, and on file systems
    /// with sparse files it takes no disk space.
    pub fn skip_tensor(&mut self, name: &str) -> Result<(), WriteError> {
        let index = self.advance_to(name, true)?;
        let n_bytes = self.layout.tensors[index].n_bytes;
        let end = self.layout.data_offset + self.layout.tensors[index].offset + n_bytes;
        self.pad_to(end, true)?;
        self.current = Some(Current {
            index,
            written: n_bytes,
        });
        Ok(())
    }

    /// Checks that every tensor was written, pads the file to its planned size, flushes, and
    /// returns the underlying stream.
    pub fn finish(mut self) -> Result<W, WriteError> {
        self.check_current_complete()?;
        if let Some(t) = self.layout.tensors.get(self.next) {
            return Err(WriteError::MissingTensors {
                next: t.spec.name.clone(),
                remaining: self.layout.tensors.len() - self.next,
            });
        }
        let end = self.layout.file_size();
        if self.ends_in_hole {
            // A seek alone does not extend a file: write its last byte so the size is right.
            self.out.seek(SeekFrom::Start(end - 1))?;
            self.pos = end - 1;
            self.emit(&[0])?;
        } else {
            self.pad_to(end, false)?;
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

fn put_string(h: &mut Vec<u8>, s: &str) {
    h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    h.extend_from_slice(s.as_bytes());
}

fn put_value(h: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => h.push(*v),
        Value::I8(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => h.push(u8::from(*v)),
        Value::String(s) => put_string(h, s),
        Value::U64(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::Array(a) => put_array(h, a),
    }
}

fn put_array(h: &mut Vec<u8>, a: &Array) {
    h.extend_from_slice(&(a.element_type() as u32).to_le_bytes());
    h.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                h.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => h.extend_from_slice(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::Bool(v) => h.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_string(h, s)),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F64(v) => le!(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn meta() -> Vec<(String, Value)> {
        vec![
            ("general.architecture".into(), Value::String("llama".into())),
            (
                "a.list".into(),
                Value::Array(Array::String(vec!["x".into(), "yz".into()])),
            ),
        ]
    }

    #[test]
    fn header_size_matches_what_is_written() {
        let tensors = [
            TensorSpec::new("a", GgmlType::F32, &[3]),
            TensorSpec::new("b", GgmlType::Q8_0, &[64, 2]),
        ];
        let w = GgufWriter::new(Cursor::new(Vec::new()), &meta(), &tensors).unwrap();
        assert_eq!(w.pos, w.layout.data_offset);
        assert_eq!(w.layout.data_offset % 32, 0);
        assert_eq!(w.layout.tensors[1].offset, 32);
        assert_eq!(w.layout.data_size, 32 + 136 + 24);
    }

    #[test]
    fn out_of_order_overflow_and_missing_tensors_are_errors() {
        let tensors = [
            TensorSpec::new("a", GgmlType::F32, &[2]),
            TensorSpec::new("b", GgmlType::F32, &[2]),
        ];
        let mut w = GgufWriter::new(Cursor::new(Vec::new()), &meta(), &tensors).unwrap();
        assert!(matches!(
            w.begin_tensor("b"),
            Err(WriteError::OutOfOrder { .. })
        ));
        w.begin_tensor("a").unwrap();
        assert!(matches!(
            w.write_chunk(&[0; 9]),
            Err(WriteError::TensorOverflow { .. })
        ));
        w.write_chunk(&[0; 4]).unwrap();
        assert!(matches!(
            w.begin_tensor("b"),
            Err(WriteError::TensorIncomplete { .. })
        ));
        w.write_chunk(&[0; 4]).unwrap();
        assert!(matches!(
            w.finish(),
            Err(WriteError::MissingTensors { remaining: 1, .. })
        ));
    }

    #[test]
    fn declarations_are_validated() {
        let bad = |t: TensorSpec| Layout::plan(&[], &[t]).unwrap_err();
        assert!(matches!(
            bad(TensorSpec::new("q", GgmlType::Q4K, &[128, 2])),
            WriteError::PartialBlock { .. }
        ));
        assert!(matches!(
            bad(TensorSpec::new("z", GgmlType::F32, &[0])),
            WriteError::ZeroDim { .. }
        ));
        assert!(matches!(
            bad(TensorSpec::new("d", GgmlType::F32, &[1, 1, 1, 1, 1])),
            WriteError::BadDimCount { .. }
        ));
        assert!(matches!(
            bad(TensorSpec::new("o", GgmlType::F32, &[u64::MAX, 2])),
            WriteError::SizeOverflow { .. }
        ));
        let align = |v: Value| Layout::plan(&[(ALIGNMENT_KEY.into(), v)], &[]).unwrap_err();
        assert!(matches!(
            align(Value::U32(24)),
            WriteError::InvalidAlignment(24)
        ));
        assert!(matches!(
            align(Value::U64(32)),
            WriteError::AlignmentType(_)
        ));
    }

    #[test]
    fn skipped_last_tensor_still_gives_the_planned_size() {
        let tensors = [
            TensorSpec::new("a", GgmlType::F32, &[2]),
            TensorSpec::new("b", GgmlType::F32, &[100]),
        ];
        let mut w = GgufWriter::new(Cursor::new(Vec::new()), &meta(), &tensors).unwrap();
        w.write_tensor_data("a", &[1u8; 8][..]).unwrap();
        w.skip_tensor("b").unwrap();
        let size = w.layout.file_size();
        let out = w.finish().unwrap().into_inner();
        assert_eq!(out.len() as u64, size);
        assert!(out[out.len() - 416..].iter().all(|&b| b == 0));
    }
}
