//! The first layers of a dense model that does not fit the VRAM budget, run on the CPU for a
//! [`GpuModel`](super::forward::GpuModel) that holds the rest ([`super::placement`]).
//!
//! Each token (or prompt chunk) is embedded and run through these layers by the CPU engine
//! ([`engine::forward::hidden_after`](crate::engine::forward::hidden_after)), with the weights
//! read in place from the memory-mapped file and the layers' keys and values in a KV cache in
//! RAM; the hidden states then go to the GPU through a host-visible buffer, once per token.
//! The arithmetic is the CPU engine's (activations quantized for the weight type), so these
//! layers' outputs are the CPU engine's, and the GPU's layers take them from there.

use std::sync::Arc;

use crate::cpu::ThreadPool;
use crate::engine::forward::hidden_after;
use crate::engine::row_help::RowHelper;
use crate::engine::KvCache;
use crate::model::{Model, ModelError};

pub struct CpuLayers {
    model: Arc<Model>,
    pool: ThreadPool,
    kv: KvCache,
    n_layers: usize,
}

impl CpuLayers {
    /// Layers `0..n_layers` of `model` on `threads` threads (0: every core), with a KV cache of
    /// `capacity` positions.
    pub fn new(model: Arc<Model>, n_layers: usize, threads: usize, capacity: usize) -> CpuLayers {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        CpuLayers {
            pool: ThreadPool::new(threads),
            kv: KvCache::new(n_layers, capacity, model.config.kv_width()),
            model,
            n_layers,
        }
    }

    /// How many of the model's layers run here.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// The whole model (these layers are its first).
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// These layers' KV cache: a prompt chunk computed on the GPU stores its keys and values
    /// here, for the decode steps after it.
    pub fn kv_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    /// The embeddings of `tokens`, `n_embd` floats each.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let e = self.model.config.n_embd;
        let mut x = vec![0.0f32; tokens.len() * e];
        for (row, &t) in x.chunks_exact_mut(e).zip(tokens) {
            self.model.embed(t, row)?;
        }
        Ok(x)
    }

    /// The hidden states of `tokens` at positions `start..` after these layers, `n_embd`
    /// floats per token, in chunks of at most [`crate::engine::MAX_BATCH`] tokens; `help`
    /// computes the last rows of the products of a single token
    /// ([`crate::engine::row_help`]). The caller has checked the token ids and positions.
    pub fn run(
        &mut self,
        tokens: &[u32],
        start: usize,
        mut help: Option<&mut (dyn RowHelper + 'static)>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::with_capacity(tokens.len() * self.model.config.n_embd);
        for (i, chunk) in tokens.chunks(crate::engine::MAX_BATCH).enumerate() {
            let at = start + i * crate::engine::MAX_BATCH;
            let x = hidden_after(
                &self.model,
                &self.pool,
                &mut self.kv,
                chunk,
                at,
                self.n_layers,
                help.as_deref_mut(),
            )?;
            out.extend_from_slice(&x);
        }
        Ok(out)
    }
}
