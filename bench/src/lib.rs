//! Benchmark harness and the synthetic model generator.
//!
//! - [`synth`]: random-weight GGUF models shaped exactly like real llama.cpp files (it lives in
//!   the daemon library, which writes its default model with it; re-exported here).
//! - [`demo`]: the README's first command.
//! - [`progress`]: a progress line for long jobs.
//! - [`interleave`]: two variants of a measurement taken in turns.
//! - [`prompt_profile`]: where a profiled prompt chunk's time went.

pub mod demo;
pub mod interleave;
pub mod progress;
pub mod prompt_profile;

pub use spillway_daemon::synth;
