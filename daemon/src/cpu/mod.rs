//! CPU kernels: activation formats ([`act`]), dot products of weight rows with activations
//! ([`dot`], scalar; `avx2` on x86-64, `neon` on aarch64; chosen at run time by
//! [`kernels`]), matrix-vector products ([`matvec`]), several products in one pool job
//! ([`group`]), several gated FFNs in one pool job ([`ffn_group`]) and a persistent thread
//! pool ([`pool`]).
//!
//! The kernels multiply weights in place from the memory map: a row is never dequantized into
//! a copy. Activations are converted to the format ggml pairs with each weight type (Q8_0 for
//! Q8_0/Q4_0, Q8_K for the K-quants), so results track llama.cpp's CPU backend closely.

pub mod act;
pub mod attn;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod dot;
pub mod ffn_group;
#[cfg(target_arch = "x86_64")]
pub mod gemm_avx2;
#[cfg(target_arch = "x86_64")]
pub mod gemm_avx512;
pub mod group;
pub mod kernels;
pub mod matvec;
#[cfg(target_arch = "aarch64")]
pub mod neon;
pub mod pool;

pub use act::{ActFormat, Activation, BlockQ8K};
pub use ffn_group::{gated_ffn_group, GatedFfn};
pub use group::{matmul_group, Product};
pub use kernels::Isa;
pub use matvec::{activations, matmul, matmul_act, matvec, matvec_act, matvec_with};
pub use pool::{ThreadPool, WorkerSpan};
