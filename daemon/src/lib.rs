//! The Spillway runtime.
//!
//! - [`gguf`]: reading (validated, memory-mapped) and writing GGUF model files.
//! - [`quant`]: weight block formats and their dequantization.
//! - [`gpu`]: the Vulkan backend through `ash`.
//! - [`tokenizer`]: SentencePiece and GPT-2 BPE tokenizers from GGUF metadata, as llama.cpp tokenizes.

pub mod gguf;
pub mod gpu;
pub mod quant;
pub mod tokenizer;
