//! Model graphs: hyper-parameters from GGUF metadata ([`config`]) and the weights of every layer
//! as views into the memory-mapped file ([`weights`]); the forward pass lives in `engine`.
//!
//! Supported: `llama` (with Mixtral-style routed experts), `qwen2`, `qwen2moe`, `qwen3`,
//! `qwen3moe`, with matrices in F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K and Q6_K.

pub mod config;
pub mod weights;

use crate::gguf::{GgmlType, GgufError};
use crate::quant::QuantError;

pub use config::{Arch, Config, MoeConfig, RopeLayout};
pub use weights::{Attention, Ffn, Layer, MatRef, Matrix, Model, MoeWeights, SharedExpert};

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error("architecture {0:?} is not supported (llama, qwen2, qwen2moe, qwen3, qwen3moe are)")]
    UnsupportedArchitecture(String),
    #[error("tensor {0} is missing")]
    MissingTensor(String),
    #[error("tensor {tensor} has shape {found:?}, expected {expected:?}")]
    Shape {
        tensor: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("tensor {tensor}: weight type {ty} is not supported by the CPU kernels")]
    UnsupportedType { tensor: String, ty: GgmlType },
    #[error("inconsistent hyper-parameters: {0}")]
    Inconsistent(String),
}

/// Weight types the CPU kernels multiply by.
pub const SUPPORTED_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

#[cfg(test)]
mod tests;
