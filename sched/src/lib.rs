//! Spillway's scheduler: pure logic, no I/O and no GPU calls. The daemon feeds it measurements
//! and asks it for plans.
//!
//! - [`model`]: the model as the planner sees it (tensors, types, sizes, roles, expert routing),
//!   filled by the daemon from a GGUF header or built from a preset.
//! - [`profile`]: what a machine can do, measured ([`calibrate`]) or described, stored as TOML.
//! - [`predict`]: roofline latency predictors fitted by least squares, and their accuracy.
//! - [`refine`]: the profile refined online from timings of real decode steps.
//! - [`plan`]: the placement planner (VRAM, streamed, CPU; expert caches; tile size and prefetch
//!   depth) and its table and JSON output.
//! - [`simulate`]: the planner on described machines and preset models.
//! - [`ByteSize`]: the budget sizes users write (`--vram-budget 8GiB`).

pub mod calibrate;
pub mod model;
pub mod plan;
pub mod predict;
pub mod profile;
pub mod refine;
pub mod simulate;
mod size;

pub use size::{ByteSize, SizeError};
