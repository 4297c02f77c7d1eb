//! Errors of reading a GGUF file.

/// Why a GGUF file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("i/o error on {path}: {source}")]
    Io { path: String, source: std::io::Error },
}
