//! GGUF model files: the format's types, a validating reader over a memory map, and a streaming
//! writer. A model file is untrusted input: the reader returns a typed [`GgufError`] for every
//! malformed file and never panics.

pub mod error;
pub(crate) mod identity;
pub mod inspect;
pub mod reader;
mod sigbus;
pub mod types;
pub mod validate;
pub mod value;
pub mod writer;

pub use error::GgufError;
pub use reader::{parse_header, parse_header_structure, GgufFile, Header, Metadata, TensorInfo};
pub use types::{GgmlType, ValueType};
pub use value::{Array, Value};

/// `"GGUF"` as the little-endian u32 at the start of every file.
pub const GGUF_MAGIC: u32 = u32::from_le_bytes(*b"GGUF");
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
