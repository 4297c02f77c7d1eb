//! Benchmark harness and the synthetic model generator.
//!
//! - [`synth`]: random-weight GGUF models shaped exactly like real llama.cpp files.
//! - [`progress`]: a progress line for long jobs.

pub mod progress;
pub mod synth;
