//! A decode step of several sequences at once (continuous batching): one token of each, in one
//! pass of the prompt-chunk path ([`super::prefill`]), so that every weight matrix is read once
//! for all of them. The chunk's tokens carry their own positions and their sequences' first KV
//! cache rows ([`crate::gpu::ops::StepWord`]): RoPE, the KV-cache append and attention (the
//! decode kernel over the chunk's tokens, each over its own sequence's positions) take each
//! token where its sequence is; the products, norms and MoE layers do not care whose a token
//! is. Up to 8 tokens, the products run in the several-column matrix-vector kernel (each
//! weight read once, as a decode step reads it for one token), and so do a MoE layer's
//! experts, each over the few tokens that chose it (`matvec.comp` with COLS and RUNS); more
//! tokens take the prompts' tiles.
//!
//! Where a step cannot take the tokens together (a dense model's first layers on the CPU, whose
//! cache holds one sequence; routed experts computed on the CPU or fetched, which the chunk path
//! would stream through VRAM for every step; a chunk's memory refused) the tokens go one after
//! another through [`GpuModel::eval`], each sequence selected in turn: the same logits, without
//! the sharing.

use super::prefill::{LOGITS_CHUNK, PREFILL_CHUNK};
use super::{GpuModel, MoeMiss};
use crate::gpu::error::{GpuError, Result};

/// Most tokens a batched step takes (the host-visible logits of a chunk that wants them all).
pub const MAX_STEP_TOKENS: usize = LOGITS_CHUNK;

impl GpuModel {
    /// One decode step of several sequences: `inputs` holds, for each, the sequence and its
    /// next token; the logits after each, `n_vocab` floats each, in the order of `inputs`. Every
    /// sequence listed advances by one position. The selected sequence stays selected unless
    /// the tokens go one by one (it is then the last one's).
    pub fn eval_batch(&mut self, inputs: &[(usize, u32)]) -> Result<Vec<f32>> {
        self.check_batch(inputs)?;
        let seqs: Vec<usize> = inputs.iter().map(|&(s, _)| s).collect();
        let tokens: Vec<u32> = inputs.iter().map(|&(_, t)| t).collect();
        if inputs.len() > 1 && self.batches_steps(inputs.len())? {
            self.flush_promotions()?;
            let started = std::time::Instant::now();
            let logits = self.eval_chunk(&tokens, true, Some(&seqs))?;
            self.batched_steps += 1;
            // The step's routing counted in the experts' demand, as a decode step's.
            self.promote_experts(started.elapsed())?;
            return Ok(logits);
        }
        let mut out = Vec::with_capacity(inputs.len() * self.config.n_vocab);
        for &(seq, token) in inputs {
            self.select(seq);
            out.extend(self.eval(token)?);
        }
        Ok(out)
    }

    /// Checks `inputs` before anything of them is evaluated: known, distinct sequences with
    /// room for one more position, tokens in the vocabulary, at most [`MAX_STEP_TOKENS`].
    fn check_batch(&self, inputs: &[(usize, u32)]) -> Result<()> {
        let bad = |why: String| Err(GpuError::Unsupported(why));
        if inputs.len() > MAX_STEP_TOKENS {
            return bad(format!(
                "a step of {} sequences: at most {MAX_STEP_TOKENS}",
                inputs.len()
            ));
        }
        for (i, &(seq, token)) in inputs.iter().enumerate() {
            if seq >= self.sequences() {
                return bad(format!("sequence {seq} of {}", self.sequences()));
            }
            if inputs[..i].iter().any(|&(s, _)| s == seq) {
                return bad(format!("sequence {seq} twice in one step"));
            }
            if token as usize >= self.config.n_vocab {
                return bad(format!(
                    "token {token} is outside the vocabulary of {}",
                    self.config.n_vocab
                ));
            }
            if self.positions[seq] >= self.capacity {
                return bad(format!(
                    "the context of {} positions of sequence {seq} is full",
                    self.capacity
                ));
            }
        }
        if self.allocator.device().is_lost() {
            return Err(GpuError::DeviceLost);
        }
        Ok(())
    }

    /// Whether a step of `n` sequences runs as one chunk (see the module's notes), making the
    /// chunk's activations and its host-visible logits now if they are not made yet.
    fn batches_steps(&mut self, n: usize) -> Result<bool> {
        let miss = self.experts.as_ref().map_or(MoeMiss::Cpu, |e| e.miss);
        if !self.placement.batches_steps(miss) || !self.batches_prompts() || self.front.is_some() {
            return Ok(false);
        }
        if self.batch.as_ref().is_none_or(|b| b.tokens() < n) {
            // A prompt's chunk is made as large; the smaller one's memory is given back first.
            self.batch = None;
            let tokens = n.next_multiple_of(64).min(PREFILL_CHUNK);
            match super::prefill::Batch::new(self, tokens) {
                Ok(b) => self.batch = Some(b),
                Err(e) if e.is_out_of_memory() => {
                    tracing::warn!("decode steps go one sequence at a time: {e}");
                    self.batch_refused = true;
                    return Ok(false);
                }
                Err(e) => return Err(e),
            }
        }
        let mut b = self.batch.take().expect("made above");
        let made = b.logits_buffer(self);
        // The attention's scratch for every token at the last positions.
        let fits = b.holds_attention(self, n);
        self.batch = Some(b);
        match made {
            Ok(()) => Ok(fits),
            Err(e) if e.is_out_of_memory() => Ok(false),
            Err(e) => Err(e),
        }
    }
}
