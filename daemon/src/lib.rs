//! The Spillway runtime.
//!
//! - [`gguf`]: reading (validated, memory-mapped) and writing GGUF model files.
//! - [`quant`]: weight block formats and their dequantization.
//! - [`gpu`]: the Vulkan backend through `ash`.

pub mod gguf;
pub mod gpu;
pub mod quant;
