//! Routed experts computed on the CPU for a [`GpuModel`](super::forward::GpuModel) whose VRAM
//! holds only some of them: the CPU engine's own expert code
//! ([`engine::experts::routed_experts`](crate::engine::experts::routed_experts)) over the
//! memory-mapped file, on a persistent thread pool. The model submits the GPU's part of the
//! layer (the resident experts) and computes these while it runs
//! ([`Kernels::record_overlapped`](super::record::Kernels::record_overlapped)); their weighted
//! sum goes back through a host-visible buffer and is added to the residual with one
//! `scale_add`.
//!
//! The input is the GPU's own normalised hidden state, read back, so a CPU expert sees what a
//! GPU one would; its arithmetic is the CPU engine's (activations rounded to f16 or quantized to
//! Q8 for the weight type), so its output differs from the GPU's by that rounding.
//!
//! Partial: the expert's bytes come from the memory map; experts not in RAM would be read with
//! [`crate::stream::ExpertCache`] (not wired). The experts of a token share the pool's jobs
//! (all gate and up products in one, all down products in another).

use std::sync::Arc;

use crate::cpu::ThreadPool;
use crate::engine::experts::routed_experts;
use crate::engine::routing::RoutedExpert;
use crate::model::{Ffn, Model};

pub struct CpuExperts {
    model: Arc<Model>,
    pool: ThreadPool,
}

impl CpuExperts {
    /// `threads` in all, the caller's included.
    pub fn new(model: Arc<Model>, threads: usize) -> CpuExperts {
        CpuExperts {
            model,
            pool: ThreadPool::new(threads.max(1)),
        }
    }

    /// `Σ weight · expert(xn)` over `experts` of MoE layer `layer`, summed in their order.
    ///
    /// # Panics
    /// If layer `layer` is dense.
    pub fn weighted_sum(&self, layer: usize, xn: &[f32], experts: &[RoutedExpert]) -> Vec<f32> {
        let Ffn::Moe(moe) = &self.model.layers[layer].ffn else {
            panic!("layer {layer} has no experts");
        };
        let e = self.model.config.n_embd;
        let chosen: Vec<usize> = experts.iter().map(|r| r.expert).collect();
        let y = routed_experts(&self.model, &self.pool, moe, xn, &chosen, chosen.len());
        let mut sum = vec![0.0f32; e];
        for (r, y) in experts.iter().zip(y.chunks_exact(e)) {
            for (s, y) in sum.iter_mut().zip(y) {
                *s += y * r.weight;
            }
        }
        sum
    }
}
