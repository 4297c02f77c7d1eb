//! Spillway's scheduler: pure logic, no I/O and no GPU calls. The daemon feeds it measurements
//! and asks it for plans.
//!
//! - [`model`]: the model as the planner sees it (tensors, types, sizes, roles, expert routing),
//!   filled by the daemon from a GGUF header or built from a preset.

pub mod calibrate;
pub mod model;
pub mod predict;
pub mod profile;
pub mod refine;
mod size;

pub use size::{ByteSize, SizeError};
