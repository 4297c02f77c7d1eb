//! The Spillway runtime.
//!
//! - [`gguf`]: reading (validated, memory-mapped) and writing GGUF model files.
//! - [`quant`]: weight block formats and their dequantization.
//! - [`tokenizer`]: SentencePiece and GPT-2 BPE tokenizers from GGUF metadata, as llama.cpp
//!   tokenizes.
//! - [`model`]: architectures: hyper-parameters from metadata, weights viewed in the memory map.
//! - [`cpu`]: SIMD kernels over quantized rows and the persistent thread pool.
//! - [`engine`]: the forward pass, KV cache and sampling.
//! - [`gpu`]: the Vulkan backend through `ash`.
//! - [`host_memory`]: the RAM a load may still take (cgroup and machine).
//! - [`plan`]: the scheduler's plans for a model file, which the GPU model can run.
//! - [`stream`]: the SSD tile reader (io_uring, or pread threads) and the expert cache.
//! - [`server`]: the gRPC daemon (`spillwayd serve`).
//! - [`synth`]: synthetic GGUF models (random weights, real shapes and tokenizers).

pub mod calibrate;
pub mod cpu;
pub mod engine;
pub mod gguf;
pub mod gpu;
pub mod host_memory;
pub mod model;
pub mod plan;
pub mod quant;
pub mod server;
pub mod stream;
pub mod synth;
pub mod tokenizer;
