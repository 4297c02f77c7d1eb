//! Why a tile read or an expert-cache operation failed.
//!
//! Every variant that concerns a read names the file, the offset and the length, so a log line
//! alone tells which tensor (or expert) could not be loaded.

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: io::Error },

    #[error("io_uring cannot be used for {path}: {reason}")]
    UringUnavailable { path: PathBuf, reason: String },

    #[error(
        "{path}: short read at offset {offset}, length {len}: the file holds only {available} \
         of those bytes"
    )]
    ShortRead {
        path: PathBuf,
        offset: u64,
        len: usize,
        available: u64,
    },

    #[error("{path}: read error at offset {offset}, length {len}: {source}")]
    Io {
        path: PathBuf,
        offset: u64,
        len: usize,
        source: io::Error,
    },

    #[error("{path} changed since it was opened ({what}); read at offset {offset}, length {len}")]
    FileChanged {
        path: PathBuf,
        offset: u64,
        len: usize,
        what: String,
    },

    #[error("{path}: read at offset {offset}, length {len} was cancelled")]
    Cancelled {
        path: PathBuf,
        offset: u64,
        len: usize,
    },

    #[error(
        "{path}: the tile at offset {offset}, length {len} spans {needed} aligned bytes, more \
         than the buffer's {capacity}"
    )]
    BufferTooSmall {
        path: PathBuf,
        offset: u64,
        len: usize,
        needed: usize,
        capacity: usize,
    },

    #[error(
        "expert cache: {needed} bytes do not fit: {pinned} of the {capacity} bytes are pinned"
    )]
    CacheFull {
        needed: u64,
        capacity: u64,
        pinned: u64,
    },

    #[error("the model was not opened from a file, so its experts cannot be read from one")]
    NoFile,

    #[error(
        "a RAM budget of {budget} bytes for routed experts is below the {minimum} bytes that the \
         {k} experts a token may compute on the CPU at once take"
    )]
    RamBelowMinimum { budget: u64, minimum: u64, k: usize },

    #[error(
        "expert cache: no staging buffer is free and none can be freed (all {buffers} are \
         pinned or held outside the cache)"
    )]
    BuffersExhausted { buffers: usize },
}
