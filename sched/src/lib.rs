//! Spillway's scheduler: pure logic, no I/O and no GPU calls. The daemon feeds it measurements
//! and asks it for plans.
//!
//! What will live here: measured hardware profiles, latency predictors per (device, op, weight
//! type), the placement planner that assigns every tensor and expert to VRAM, streaming or the
//! CPU under memory budgets, expert-cache and prefetch policies, and a simulator that predicts
//! tokens/s for any model on a described machine.
//!
//! What is here now: [`ByteSize`], the budget sizes users write (`--vram-budget 8GiB`).

mod size;

pub use size::{ByteSize, SizeError};
