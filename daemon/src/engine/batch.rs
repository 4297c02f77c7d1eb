//! Several sequences of one model sharing decode steps (continuous batching): each sequence has
//! its own KV cache and position, and one step evaluates one token of every listed sequence in
//! a single forward pass, so each weight matrix is multiplied once per step for all of them.
//! Prompts are evaluated per sequence, in chunks. A sequence's results are exactly those of an
//! [`Engine`](super::Engine) running it alone.

use std::sync::Arc;

use crate::cpu::ThreadPool;
use crate::model::Model;

use super::forward::{forward_slots, Slot};
use super::{EngineError, EngineOptions, KvCache, RamExperts, StepProfile, MAX_BATCH};

/// A model with a thread pool and the state of up to `max_sequences` sequences.
#[derive(Debug)]
pub struct BatchEngine {
    model: Arc<Model>,
    pool: ThreadPool,
    /// Routed experts through a RAM tier; `None`: the memory map.
    ram: Option<Arc<RamExperts>>,
    caches: Vec<KvCache>,
    positions: Vec<usize>,
}

impl BatchEngine {
    pub fn new(model: Arc<Model>, options: &EngineOptions, max_sequences: usize) -> BatchEngine {
        let c = &model.config;
        let context = options.positions(c);
        let n = max_sequences.max(1);
        BatchEngine {
            pool: ThreadPool::new(options.threads.max(1)),
            ram: None,
            caches: (0..n)
                .map(|_| KvCache::new(c.n_layer, context, c.kv_width()))
                .collect(),
            positions: vec![0; n],
            model,
        }
    }

    /// Reads the routed experts through `ram` instead of the memory map (shared, for its
    /// counters).
    pub fn with_ram_experts(mut self, ram: Arc<RamExperts>) -> BatchEngine {
        self.ram = Some(ram);
        self
    }

    /// The RAM tier of the routed experts, when there is one.
    pub fn ram_experts(&self) -> Option<&RamExperts> {
        self.ram.as_deref()
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// How many sequences it holds.
    pub fn sequences(&self) -> usize {
        self.caches.len()
    }

    /// Positions each sequence's cache holds.
    pub fn capacity(&self) -> usize {
        self.caches[0].capacity()
    }

    /// Tokens evaluated so far in sequence `seq`.
    pub fn position(&self, seq: usize) -> usize {
        self.positions[seq]
    }

    /// Forgets sequence `seq` (its cache is overwritten from position 0).
    pub fn reset(&mut self, seq: usize) {
        self.positions[seq] = 0;
    }

    fn check(&self, seq: usize, tokens: &[u32]) -> Result<(), EngineError> {
        let n_vocab = self.model.config.n_vocab;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::TokenOutOfRange { token, n_vocab });
        }
        if self.positions[seq] + tokens.len() > self.capacity() {
            return Err(EngineError::ContextFull {
                capacity: self.capacity(),
            });
        }
        Ok(())
    }

    /// Evaluates `tokens` at the next positions of sequence `seq` (at most [`MAX_BATCH`] per
    /// pass) and returns the next-token logits after every one (`all_logits`) or the last.
    pub fn eval_sequence(
        &mut self,
        seq: usize,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, EngineError> {
        self.eval_sequence_with(seq, tokens, all_logits, None)
    }

    /// [`BatchEngine::eval_sequence`], timing every op group of every layer into `profile`
    /// when given.
    pub fn eval_sequence_with(
        &mut self,
        seq: usize,
        tokens: &[u32],
        all_logits: bool,
        mut profile: Option<&mut StepProfile>,
    ) -> Result<Vec<f32>, EngineError> {
        self.check(seq, tokens)?;
        if let Some(p) = profile.as_deref_mut() {
            p.begin(tokens.len(), &self.pool);
        }
        let result = self.eval_chunks(seq, tokens, all_logits, profile.as_deref_mut());
        if let Some(p) = profile {
            p.finish(&self.pool);
        }
        result
    }

    fn eval_chunks(
        &mut self,
        seq: usize,
        tokens: &[u32],
        all_logits: bool,
        mut profile: Option<&mut StepProfile>,
    ) -> Result<Vec<f32>, EngineError> {
        let mut logits = Vec::new();
        let mut part = Vec::new();
        for chunk in tokens.chunks(MAX_BATCH) {
            let start = self.positions[seq];
            let slots: Vec<Slot> = (0..chunk.len())
                .map(|b| Slot {
                    seq: 0,
                    pos: start + b,
                })
                .collect();
            let rows: Vec<usize> = if all_logits {
                (0..chunk.len()).collect()
            } else {
                vec![chunk.len() - 1]
            };
            forward_slots(
                &self.model,
                &self.pool,
                self.ram.as_deref(),
                &mut [&mut self.caches[seq]],
                chunk,
                &slots,
                &rows,
                &mut part,
                profile.as_deref_mut(),
            )?;
            self.positions[seq] += chunk.len();
            if !all_logits {
                logits.clear();
            }
            logits.extend_from_slice(&part);
        }
        Ok(logits)
    }

    /// One decode step: evaluates each `(sequence, token)` at that sequence's next position,
    /// all in one forward pass, and returns `n_vocab` logits per input, in order. A sequence
    /// may appear once. Nothing is evaluated when a token or a position is out of range.
    pub fn step(&mut self, inputs: &[(usize, u32)]) -> Result<Vec<f32>, EngineError> {
        for (i, &(seq, token)) in inputs.iter().enumerate() {
            assert!(
                inputs[..i].iter().all(|&(s, _)| s != seq),
                "sequence {seq} appears twice in one step"
            );
            self.check(seq, &[token])?;
        }
        let mut logits = Vec::new();
        for chunk in inputs.chunks(MAX_BATCH) {
            // The caches of this chunk's sequences, in input order; slot i is cache i.
            let mut wanted: Vec<Option<&mut KvCache>> = self.caches.iter_mut().map(Some).collect();
            let mut caches: Vec<&mut KvCache> = chunk
                .iter()
                .map(|&(seq, _)| wanted[seq].take().expect("distinct sequences"))
                .collect();
            let slots: Vec<Slot> = chunk
                .iter()
                .enumerate()
                .map(|(i, &(seq, _))| Slot {
                    seq: i,
                    pos: self.positions[seq],
                })
                .collect();
            let tokens: Vec<u32> = chunk.iter().map(|&(_, t)| t).collect();
            let rows: Vec<usize> = (0..chunk.len()).collect();
            let mut part = Vec::new();
            forward_slots(
                &self.model,
                &self.pool,
                self.ram.as_deref(),
                &mut caches,
                &tokens,
                &slots,
                &rows,
                &mut part,
                None,
            )?;
            for &(seq, _) in chunk {
                self.positions[seq] += 1;
            }
            logits.extend_from_slice(&part);
        }
        Ok(logits)
    }
}
