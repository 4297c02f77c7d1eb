//! Routed experts computed on the CPU for a [`GpuModel`](super::forward::GpuModel) whose VRAM
//! holds only some of them: the CPU engine's own expert code
//! ([`engine::experts`](crate::engine::experts)) on a persistent thread pool. The model
//! submits the GPU's part of the layer (the resident experts) and computes these while it runs;
//! their weighted sum goes back through a host-visible buffer and is added to the residual with
//! one `scale_add`.
//!
//! The experts' bytes come from the memory-mapped file (the page cache holds what the OS can),
//! or, under a RAM budget, from a [`crate::stream::ExpertCache`] that reads misses from the SSD
//! (io_uring, O_DIRECT) into at most that much RAM.
//!
//! The input is the GPU's own normalised hidden state, read back, so a CPU expert sees what a
//! GPU one would; its arithmetic is the CPU engine's (activations rounded to f16 or quantized to
//! Q8 for the weight type), so its output differs from the GPU's by that rounding. The experts
//! of a token share the pool's jobs (all gate and up products in one, all down products in
//! another).

use std::sync::Arc;

use parking_lot::Mutex;

use crate::cpu::{ThreadPool, WorkerSpan};
use crate::engine::experts::routed_experts;
use crate::engine::routing::RoutedExpert;
use crate::engine::RamExperts;
use crate::model::{Ffn, Model};
use crate::stream::{ExpertCache, ExpertRead, LayerStats, StreamError};

pub struct CpuExperts {
    model: Arc<Model>,
    pool: ThreadPool,
    /// The RAM tier under a budget; `None`: the memory map.
    ram: Option<Arc<RamExperts>>,
    /// While tracing: the pool's spans, each with the layer whose experts it ran.
    traced: Mutex<Option<Vec<(usize, WorkerSpan)>>>,
}

impl CpuExperts {
    /// `threads` in all, the caller's included; experts read through `ram` when given.
    pub fn new(model: Arc<Model>, threads: usize, ram: Option<ExpertCache>) -> CpuExperts {
        // The GPU path routes a layer on the device; it predicts no layer ahead.
        let ram = ram.map(|cache| Arc::new(RamExperts::new(&model, cache, false)));
        CpuExperts {
            model,
            pool: ThreadPool::new(threads.max(1)),
            ram,
            traced: Mutex::new(None),
        }
    }

    /// The threads the experts run on (idle between steps: promotions' staging copies use
    /// them).
    pub(crate) fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// `Σ weight · expert(xn)` over `experts` of MoE layer `layer`, summed in their order.
    ///
    /// # Errors
    /// A read of an expert from the file failed (under a RAM budget).
    ///
    /// # Panics
    /// If layer `layer` is dense.
    pub fn weighted_sum(
        &self,
        layer: usize,
        xn: &[f32],
        experts: &[RoutedExpert],
    ) -> Result<Vec<f32>, StreamError> {
        let e = self.model.config.n_embd;
        let chosen: Vec<usize> = experts.iter().map(|r| r.expert).collect();
        let y = self.outputs(layer, xn, &chosen, chosen.len())?;
        let mut sum = vec![0.0f32; e];
        for (r, y) in experts.iter().zip(y.chunks_exact(e)) {
            for (s, y) in sum.iter_mut().zip(y) {
                *s += y * r.weight;
            }
        }
        Ok(sum)
    }

    /// For the tokens of a step, `xn` their normalised rows (`n_embd` each): each token's
    /// `Σ weight · expert(xn)` over the `entries` that name it, `(token, expert)`, summed in
    /// their order; a token no entry names gets zeros. Each expert is read once for all the
    /// tokens that chose it, so the step's tokens share its weights.
    ///
    /// # Errors
    /// As [`CpuExperts::weighted_sum`].
    ///
    /// # Panics
    /// As [`CpuExperts::weighted_sum`], or if an entry's token has no row in `xn`.
    pub fn weighted_sums(
        &self,
        layer: usize,
        xn: &[f32],
        entries: &[(usize, RoutedExpert)],
    ) -> Result<Vec<f32>, StreamError> {
        let e = self.model.config.n_embd;
        let mut sums = vec![0.0f32; xn.len()];
        // A row of inputs per entry, each its own expert's (k = 1); each expert is read once
        // (under a RAM budget its experts are held a group at a time, as many as the cache
        // holds: a budget that serves one token serves a step of several).
        let rows: Vec<f32> = entries
            .iter()
            .flat_map(|&(t, _)| xn[t * e..(t + 1) * e].iter().copied())
            .collect();
        let chosen: Vec<usize> = entries.iter().map(|(_, r)| r.expert).collect();
        let y = self.outputs(layer, &rows, &chosen, 1)?;
        for (&(t, r), y) in entries.iter().zip(y.chunks_exact(e)) {
            for (s, y) in sums[t * e..(t + 1) * e].iter_mut().zip(y) {
                *s += y * r.weight;
            }
        }
        Ok(sums)
    }

    /// The unweighted outputs of experts `chosen` of layer `layer` for the rows of `xn`, `k`
    /// chosen a row ([`routed_experts`]), each expert read once.
    fn outputs(
        &self,
        layer: usize,
        xn: &[f32],
        chosen: &[usize],
        k: usize,
    ) -> Result<Vec<f32>, StreamError> {
        let Ffn::Moe(moe) = &self.model.layers[layer].ffn else {
            panic!("layer {layer} has no experts");
        };
        let y = match &self.ram {
            None => routed_experts(&self.model, &self.pool, moe, xn, chosen, k),
            Some(ram) => ram.outputs(&self.pool, moe, layer, xn, chosen, k, &[])?,
        };
        if let Some(traced) = self.traced.lock().as_mut() {
            traced.extend(self.pool.take_spans().into_iter().map(|s| (layer, s)));
        }
        Ok(y)
    }

    /// The RAM tier's counters per layer (hits, misses read from the file, evictions) and the
    /// RAM its buffers take; `None` without a RAM budget.
    pub fn ram_stats(&self) -> Option<(Vec<LayerStats>, u64)> {
        let cache = self.ram.as_ref()?.cache();
        Some((cache.layer_stats().to_vec(), cache.buffer_bytes()))
    }

    /// Traces what the pool's threads run and, under a RAM budget, each expert read from the
    /// SSD ([`CpuExperts::take_trace`]), or stops.
    pub fn set_tracing(&self, on: bool) {
        self.pool.set_tracing(on);
        *self.traced.lock() = on.then(Vec::new);
        if let Some(ram) = &self.ram {
            ram.cache().set_tracing(on);
        }
    }

    /// The pool's spans (each with the layer whose experts it ran) and the RAM tier's reads
    /// since the last call, while tracing.
    pub fn take_trace(&self) -> (Vec<(usize, WorkerSpan)>, Vec<ExpertRead>) {
        let reads = self
            .ram
            .as_ref()
            .map_or_else(Vec::new, |r| r.cache().take_reads());
        let spans = self.traced.lock().as_mut().map(std::mem::take);
        (spans.unwrap_or_default(), reads)
    }

    /// The RAM tier, shared (the daemon's status reads its counters); `None` without a RAM
    /// budget.
    pub fn ram_experts(&self) -> Option<Arc<RamExperts>> {
        self.ram.clone()
    }

    /// Bytes and tiles the RAM tier's reader has delivered from the SSD; `None` without a RAM
    /// budget.
    pub fn ram_delivered(&self) -> Option<(u64, u64)> {
        Some(self.ram.as_ref()?.cache().reader().delivered())
    }
}
