//! Benchmark harness and the synthetic model generator.
//!
//! - [`synth`]: random-weight GGUF models shaped exactly like real llama.cpp files.
//! - [`demo`]: the README's first command.
//! - [`progress`]: a progress line for long jobs.

pub mod demo;
pub mod progress;
pub mod synth;
