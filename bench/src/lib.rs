//! Benchmark harness and the synthetic model generator.
