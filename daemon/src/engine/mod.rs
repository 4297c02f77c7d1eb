//! The CPU inference engine: one sequence's KV cache ([`kv_cache`]), the forward pass
//! ([`forward`]), element-wise ops ([`ops`]), MoE routing ([`routing`], shared with the GPU), routed experts ([`experts`], also the GPU's CPU experts),
//! rows of dense layers' products computed by another device at the same time
//! ([`row_help`]), sampling ([`sampling`]), one sequence's decoding a token at a time ([`decode`]), several
//! sequences sharing decode steps ([`batch`]), one request's generation with stop strings
//! and streamed text ([`generate`], [`stop`]), and per-layer profiling of a step ([`profile`]).
//!
//! This is the project's reference path: everything runs on the CPU from the memory-mapped
//! weights, and its logits are checked against llama.cpp's (`bench/tests/engine_llama_cpp.rs`).

pub mod batch;
pub mod decode;
pub mod experts;
pub mod forward;
pub mod generate;
pub mod kv_cache;
pub mod ops;
pub mod profile;
pub mod ram_experts;
pub mod routing;
pub mod row_help;
pub mod sampling;
pub mod stop;

use std::sync::Arc;

use crate::cpu::ThreadPool;
use crate::model::{Model, ModelError};

pub use batch::BatchEngine;
pub use kv_cache::KvCache;
pub use profile::{OpGroup, StepProfile};
pub use ram_experts::{RamExperts, RamTierStats};
pub use sampling::{argmax, Sampler, SamplerConfig};

/// Most tokens one forward pass takes; longer prompts go in several (bounds the activations).
/// As llama.cpp's default micro-batch: the more tokens a pass takes, the more each unpacked
/// weight row serves, which matters most for MoE experts (each sees a share of the tokens).
pub const MAX_BATCH: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("the context of {capacity} positions is full")]
    ContextFull { capacity: usize },
    #[error("token {token} is outside the vocabulary of {n_vocab}")]
    TokenOutOfRange { token: u32, n_vocab: usize },
    /// A routed expert could not be read from the model file (under a RAM budget); the
    /// sequence is where it was before the call.
    #[error("reading a routed expert from the model file: {0}")]
    Expert(#[from] crate::stream::StreamError),
}

/// Engine settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// Threads for the kernels, the caller's included.
    pub threads: usize,
    /// KV cache positions; 0 means the model's context length, capped at 4096.
    pub context: usize,
}

impl EngineOptions {
    /// The KV cache positions these options give a model with `config`.
    pub fn positions(&self, config: &crate::model::Config) -> usize {
        match self.context {
            0 => config.context_length.min(4096),
            n => n,
        }
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            context: 0,
        }
    }
}

/// A model with a thread pool and the state of one sequence.
#[derive(Debug)]
pub struct Engine {
    model: Arc<Model>,
    pool: ThreadPool,
    /// Routed experts through a RAM tier; `None`: the memory map.
    ram: Option<Arc<RamExperts>>,
    kv: KvCache,
    logits: Vec<f32>,
    pos: usize,
}

impl Engine {
    pub fn new(model: Arc<Model>, options: &EngineOptions) -> Engine {
        let c = &model.config;
        let context = options.positions(c);
        Engine {
            pool: ThreadPool::new(options.threads.max(1)),
            ram: None,
            kv: KvCache::new(c.n_layer, context, c.kv_width()),
            logits: Vec::new(),
            pos: 0,
            model,
        }
    }

    /// Reads the routed experts through `ram` instead of the memory map (shared, for its
    /// counters).
    pub fn with_ram_experts(mut self, ram: Arc<RamExperts>) -> Engine {
        self.ram = Some(ram);
        self
    }

    /// The RAM tier of the routed experts, when there is one.
    pub fn ram_experts(&self) -> Option<&RamExperts> {
        self.ram.as_deref()
    }

    /// The RAM tier, shared: its counters can be read while the engine runs.
    pub fn ram_experts_shared(&self) -> Option<Arc<RamExperts>> {
        self.ram.clone()
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Positions the KV cache holds: the longest sequence this engine can evaluate.
    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    /// Tokens evaluated so far in this sequence.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Forgets the sequence (the cache is overwritten from position 0).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Evaluates `token` at the next position and returns the logits of the token after it.
    pub fn eval(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.eval_batch(&[token], false)
    }

    /// Evaluates `tokens` at the next positions, in batches of at most [`MAX_BATCH`], and
    /// returns the next-token logits after every one of them (`all_logits`, `n_vocab` per
    /// token) or after the last. Nothing is evaluated if a token is out of range or the
    /// context is too short.
    pub fn eval_batch(&mut self, tokens: &[u32], all_logits: bool) -> Result<&[f32], EngineError> {
        self.eval_batch_with(tokens, all_logits, None)
    }

    /// [`Engine::eval_batch`], timing every op group of every layer into `profile` when given.
    pub fn eval_batch_with(
        &mut self,
        tokens: &[u32],
        all_logits: bool,
        mut profile: Option<&mut StepProfile>,
    ) -> Result<&[f32], EngineError> {
        let n_vocab = self.model.config.n_vocab;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::TokenOutOfRange { token, n_vocab });
        }
        if self.pos + tokens.len() > self.kv.capacity() {
            return Err(EngineError::ContextFull {
                capacity: self.kv.capacity(),
            });
        }
        if let Some(p) = profile.as_deref_mut() {
            p.begin(tokens.len(), &self.pool);
        }
        let result = self.eval_chunks(tokens, all_logits, profile.as_deref_mut());
        if let Some(p) = profile {
            p.finish(&self.pool);
        }
        result?;
        Ok(&self.logits)
    }

    fn eval_chunks(
        &mut self,
        tokens: &[u32],
        all_logits: bool,
        mut profile: Option<&mut StepProfile>,
    ) -> Result<(), EngineError> {
        self.logits.clear();
        let mut part = Vec::new();
        for chunk in tokens.chunks(MAX_BATCH) {
            forward::forward(
                &self.model,
                &self.pool,
                self.ram.as_deref(),
                &mut self.kv,
                chunk,
                self.pos,
                all_logits,
                &mut part,
                profile.as_deref_mut(),
            )?;
            self.pos += chunk.len();
            if !all_logits {
                self.logits.clear();
            }
            self.logits.extend_from_slice(&part);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_can_move_to_another_thread_and_models_can_be_shared() {
        fn send<T: Send>() {}
        fn sync<T: Send + Sync>() {}
        send::<Engine>();
        sync::<Model>();
    }
}
