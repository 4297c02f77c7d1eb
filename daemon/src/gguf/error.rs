//! Errors of reading a GGUF file.
//!
//! A model file is untrusted input, so every way it can be malformed has its own variant naming
//! the offending key, tensor or field: a user who downloaded a broken file should learn from the
//! message alone what is wrong with it, and tests can match the exact cause.

use super::types::{GgmlType, ValueType};

/// Why a GGUF file was rejected, or why a metadata lookup failed.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("i/o error on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },

    // ---- Framing -------------------------------------------------------------------------
    #[error("not a GGUF file: magic is {found:#010x}, expected 0x46554747 (\"GGUF\")")]
    BadMagic { found: u32 },
    #[error("unsupported GGUF version {version} (supported: 2 and 3)")]
    UnsupportedVersion { version: u32 },
    #[error("the file claims {count} tensors, more than the limit of {max}")]
    TooManyTensors { count: u64, max: u64 },
    #[error("the file claims {count} metadata entries, more than the limit of {max}")]
    TooManyKeys { count: u64, max: u64 },
    #[error(
        "unexpected end of file reading {what} at offset {offset}: \
         needs {needed} bytes, {available} left"
    )]
    UnexpectedEof {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("{what} at offset {offset} claims {len} bytes, but only {available} are left")]
    StringPastEnd {
        what: String,
        offset: u64,
        len: u64,
        available: u64,
    },
    #[error(
        "array {key} claims {count} elements of type {elem_type}, \
         more than the {available} bytes left in the file can hold"
    )]
    ArrayPastEnd {
        key: String,
        count: u64,
        elem_type: ValueType,
        available: u64,
    },
    #[error("{what} is not valid UTF-8")]
    InvalidUtf8 { what: String },

    // ---- Metadata section ----------------------------------------------------------------
    #[error("metadata key {key:?} is {len} bytes long, more than the limit of {max}")]
    KeyTooLong { key: String, len: usize, max: usize },
    #[error("metadata key {key:?} appears more than once")]
    DuplicateKey { key: String },
    #[error("metadata key {key} has unknown value type {type_id}")]
    UnknownValueType { key: String, type_id: u32 },
    #[error("metadata key {key} is an array of arrays, which this reader does not accept")]
    NestedArray { key: String },
    #[error("{what} holds byte {byte:#04x}, which is not a bool (0 or 1)")]
    InvalidBool { what: String, byte: u8 },
    #[error("general.alignment = {value} is not a power of two between 1 and {max}")]
    InvalidAlignment { value: u64, max: u64 },

    // ---- Tensor infos --------------------------------------------------------------------
    #[error("tensor name {name:?} is {len} bytes long, more than the limit of {max}")]
    TensorNameTooLong {
        name: String,
        len: usize,
        max: usize,
    },
    #[error("tensor name {name:?} appears more than once")]
    DuplicateTensor { name: String },
    #[error("tensor {tensor} has unknown ggml type {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },
    #[error("tensor {tensor} has {n_dims} dimensions; 1 to {max} are supported")]
    BadDimensionCount {
        tensor: String,
        n_dims: u32,
        max: u32,
    },
    #[error("tensor {tensor} has size 0 along axis {axis}")]
    ZeroDimension { tensor: String, axis: usize },
    #[error("tensor {tensor}: the {what} overflows 64 bits")]
    SizeOverflow { tensor: String, what: &'static str },
    #[error(
        "tensor {tensor} of type {ggml_type}: ne[0] = {ne0} is not a multiple \
         of the block size {block_size}"
    )]
    NotWholeBlocks {
        tensor: String,
        ggml_type: GgmlType,
        ne0: u64,
        block_size: u64,
    },
    #[error("tensor {tensor} at data offset {offset} is not aligned to {alignment} bytes")]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensors {first} and {second} overlap in the data section")]
    OverlappingTensors { first: String, second: String },
    #[error("tensor {tensor} ends at byte {end}, past the end of the file ({file_size} bytes)")]
    TensorPastEnd {
        tensor: String,
        end: u64,
        file_size: u64,
    },

    // ---- Typed metadata lookups ----------------------------------------------------------
    #[error("metadata key {key} is missing")]
    MissingKey { key: String },
    #[error("metadata key {key} has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("metadata key {key} = {value} does not fit in {target}")]
    IntegerOutOfRange {
        key: String,
        target: &'static str,
        value: i128,
    },

    // ---- Architecture consistency (validate.rs) ------------------------------------------
    #[error("{arch} model is missing tensor {tensor}")]
    MissingTensor { arch: String, tensor: String },
    #[error("tensor {tensor} has {found} along axis {axis}, but {key} implies {expected}")]
    ShapeMismatch {
        tensor: String,
        axis: usize,
        found: u64,
        expected: u64,
        key: String,
    },
    #[error("tensor {tensor} has {found} dimensions larger than 1, expected at most {max}")]
    UnexpectedRank {
        tensor: String,
        found: usize,
        max: usize,
    },
    #[error("tensor {tensor} belongs to a block at or past block_count = {block_count}")]
    TensorBeyondBlockCount { tensor: String, block_count: u64 },
    #[error("metadata key {key} = {id} is not a token id: the vocabulary has {vocab_size} tokens")]
    TokenIdOutOfRange {
        key: String,
        id: u64,
        vocab_size: u64,
    },
    #[error("metadata array {key} has {len} elements, but {reference} has {expected}")]
    ArrayLengthMismatch {
        key: String,
        len: u64,
        expected: u64,
        reference: String,
    },
    #[error("metadata key {key} = {value} is invalid: {reason}")]
    InvalidMetadataValue {
        key: String,
        value: u64,
        reason: &'static str,
    },
}
