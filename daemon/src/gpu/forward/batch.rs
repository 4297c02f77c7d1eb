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
//! A step that is one submission (a dense model, or MoE layers routed on the device) is recorded
//! once per count of sequences and replayed ([`super::GpuModelOptions::replay`], as a decode
//! step is):
//! the tokens, positions and first rows are words of the step buffer the kernels read when they
//! run, and the attention's grid covers every run of positions of the cache, those past a
//! token's position leaving at once. Recording a step of a 32-layer model costs the host about
//! 2 ms (`bench/RESULTS.md`, 2026-12-03), as long as a step of a few sequences may take.
//!
//! A MoE model whose experts that miss VRAM run on the CPU ([`MoeMiss::Cpu`]) takes the
//! chunk's path with its MoE layers routed on the host: at each, the host reads the router
//! logits, the CPU runs the missing experts, each once over every token that chose it (its
//! weights read from RAM or the file once for the step), and the next command buffer runs the
//! resident ones and adds the CPU's sums. Where single steps are chains, so is such a step
//! (`prefill::step_chain`): recorded whole up front, the device running the resident
//! experts while the CPU runs the rest.
//!
//! Where a step cannot take the tokens together (a dense model's first layers on the CPU, whose
//! cache holds one sequence; routed experts fetched into slots; a chunk's memory refused) the
//! tokens go one after another through [`GpuModel::eval`], each sequence selected in turn: the
//! same logits, without the sharing.

use super::prefill::LOGITS_CHUNK;
use super::{GpuFfn, GpuModel, MoeMiss};
use crate::gpu::error::{GpuError, Result};

/// Most tokens a batched step takes (the host-visible logits of a chunk that wants them all).
pub const MAX_STEP_TOKENS: usize = LOGITS_CHUNK;

/// The sequences the KV cache holds, and the selected one.
impl GpuModel {
    /// Tokens evaluated in the selected sequence.
    pub fn position(&self) -> usize {
        self.positions[self.seq]
    }

    /// Forgets the selected sequence (its cache is overwritten from position 0).
    pub fn reset(&mut self) {
        self.positions[self.seq] = 0;
    }

    /// How many sequences the KV cache holds ([`super::GpuModelOptions::sequences`]).
    pub fn sequences(&self) -> usize {
        self.positions.len()
    }

    /// The sequence that [`GpuModel::eval`], [`GpuModel::eval_prompt`], [`GpuModel::position`]
    /// and [`GpuModel::reset`] act on from now on; each keeps its own position.
    ///
    /// # Panics
    /// If `seq` is not below [`GpuModel::sequences`].
    pub fn select(&mut self, seq: usize) {
        assert!(
            seq < self.positions.len(),
            "sequence {seq} of {}",
            self.positions.len()
        );
        self.seq = seq;
    }

    /// Decode steps since loading that took several sequences' tokens in one pass
    /// ([`GpuModel::eval_batch`]), not one after another.
    pub fn batched_steps(&self) -> u64 {
        self.batched_steps
    }

    /// Of [`GpuModel::batched_steps`], those replayed from a recording of a step of as many
    /// sequences ((this module)).
    pub fn replayed_batches(&self) -> u64 {
        self.replayed_batches
    }

    /// Single decode steps since loading replayed from their recording, profiled ones
    /// included (`super::decode`).
    pub fn replayed_steps(&self) -> u64 {
        self.replayed_steps
    }

    /// Prompt chunks whose routed experts that miss VRAM ran on the CPU, where the chunk's
    /// size measured that cheaper than streaming them through slots
    /// (`super::prompt_misses`).
    pub fn cpu_prompt_chunks(&self) -> u64 {
        self.cpu_prompt_chunks
    }

    /// Of [`GpuModel::cpu_prompt_chunks`], those run as a batched step's chain
    /// (`prefill::step_chain`).
    pub fn chained_prompt_chunks(&self) -> u64 {
        self.chained_prompt_chunks
    }

    /// Of [`GpuModel::batched_steps`], those run as a chain with the host's turns at the MoE
    /// layers (misses on the CPU: `prefill::step_chain`).
    pub fn chained_batches(&self) -> u64 {
        self.chained_batches
    }

    /// The selected sequence.
    pub fn selected(&self) -> usize {
        self.seq
    }

    /// Tokens evaluated in sequence `seq`.
    pub fn position_of(&self, seq: usize) -> usize {
        self.positions[seq]
    }

    /// The selected sequence's position.
    pub(super) fn pos(&self) -> usize {
        self.positions[self.seq]
    }

    /// The KV-cache row of position 0 of sequence `seq`.
    pub(super) fn seq_row(&self, seq: usize) -> u32 {
        (seq * self.capacity) as u32
    }
}

impl GpuModel {
    /// One decode step of several sequences: `inputs` holds, for each, the sequence and its
    /// next token; the logits after each, `n_vocab` floats each, in the order of `inputs`. Every
    /// sequence listed advances by one position. The step is batched where the model can batch
    /// it and, with [`super::StepBatching::Measured`], batching has been measured cheaper than
    /// single steps here ([`super::step_costs`]); otherwise the tokens go one by one. The
    /// selected sequence stays selected unless they do (it is then the last one's).
    pub fn eval_batch(&mut self, inputs: &[(usize, u32)]) -> Result<Vec<f32>> {
        self.check_batch(inputs)?;
        let seqs: Vec<usize> = inputs.iter().map(|&(s, _)| s).collect();
        let tokens: Vec<u32> = inputs.iter().map(|&(_, t)| t).collect();
        let began = std::time::Instant::now();
        if inputs.len() > 1
            && self.batches_steps(inputs.len())?
            && self.step_costs.batch(inputs.len(), self.step_batching)
        {
            let logits = self.run_batched(&tokens, &seqs)?;
            let secs = began.elapsed().as_secs_f64();
            self.step_costs.record_batched(inputs.len(), secs);
            return Ok(logits);
        }
        let mut out = Vec::with_capacity(inputs.len() * self.config.n_vocab);
        for &(seq, token) in inputs {
            self.select(seq);
            out.extend(self.eval(token)?);
        }
        let secs = began.elapsed().as_secs_f64();
        self.step_costs.record_single(inputs.len(), secs);
        Ok(out)
    }

    /// One step in which each listed sequence takes several tokens at its next positions:
    /// `inputs` holds, for each, the sequence and its tokens (a running request's next token,
    /// or part of a newly admitted one's prompt, so that a prompt shares the step's reads of
    /// the weights with the others' tokens instead of running alone between steps). The
    /// logits after each entry's last token, `n_vocab` floats each, in the order of `inputs`;
    /// every sequence advances by its tokens. The step is one pass where the model batches a
    /// step of that many tokens ([`GpuModel::mixed_step_tokens`] says how many it is made
    /// for); otherwise each entry goes in turn through [`GpuModel::eval_prompt`], with the
    /// same logits. The selected sequence stays selected unless they go in turn.
    pub fn eval_mixed(&mut self, inputs: &[(usize, &[u32])]) -> Result<Vec<f32>> {
        self.check_mixed(inputs)?;
        let seqs: Vec<usize> = inputs
            .iter()
            .flat_map(|&(s, t)| std::iter::repeat_n(s, t.len()))
            .collect();
        let tokens: Vec<u32> = inputs
            .iter()
            .flat_map(|&(_, t)| t.iter().copied())
            .collect();
        let (n, n_vocab) = (tokens.len(), self.config.n_vocab);
        let mut out = Vec::with_capacity(inputs.len() * n_vocab);
        if n > 1 && n <= MAX_STEP_TOKENS && self.batches_steps(n)? {
            let all = self.run_batched(&tokens, &seqs)?;
            let mut end = 0;
            for &(_, t) in inputs {
                end += t.len();
                out.extend_from_slice(&all[(end - 1) * n_vocab..end * n_vocab]);
            }
            return Ok(out);
        }
        for &(seq, t) in inputs {
            self.select(seq);
            out.extend(self.eval_prompt(t, false)?);
        }
        Ok(out)
    }

    /// The most tokens a step of [`GpuModel::eval_mixed`] should carry: a batched step's
    /// chunk as the placement keeps room for it, where several sequences are held and the
    /// routed experts that miss VRAM run on the CPU. There a prompt's chunk takes no more
    /// than a step's memory and its weights are read the same way, so a prompt costs about
    /// as much inside steps as apart, and the running sequences go on meanwhile. 0 elsewhere,
    /// and where [`super::GpuModelOptions::prompt_steps`] is off: prompts run apart in their
    /// own chunks.
    pub fn mixed_step_tokens(&self) -> usize {
        let miss = self.experts.as_ref().map_or(MoeMiss::Cpu, |e| e.miss);
        let mixes = self.prompt_steps
            && self.sequences() > 1
            && self.cpu_misses()
            && self.batches_prompts()
            && self.placement.batches_steps(miss);
        match mixes {
            true => crate::gpu::ops_batch::MAX_MATVEC_COLS as usize,
            false => 0,
        }
    }

    /// The tokens of a batched step in one pass ([`GpuModel::batches_steps`] said so):
    /// replayed from its recording, as a chain, or through the chunk's path; every token's
    /// logits.
    fn run_batched(&mut self, tokens: &[u32], seqs: &[usize]) -> Result<Vec<f32>> {
        let n = tokens.len();
        self.flush_promotions()?;
        let started = std::time::Instant::now();
        let logits = match self.replays_steps(n) {
            true => self.replay_step(tokens, seqs)?,
            false => None,
        };
        let logits = match logits {
            Some(l) => {
                self.replayed_batches += 1;
                l
            }
            None if self.chains_steps(n) => {
                let logits = self.eval_step_chain(tokens, seqs)?;
                self.chained_batches += 1;
                logits
            }
            None => self.eval_chunk(tokens, true, Some(seqs))?,
        };
        self.batched_steps += 1;
        // The step's routing counted in the experts' demand, as a decode step's.
        self.promote_experts(started.elapsed())?;
        Ok(logits)
    }

    /// Whether a batched step of `n` tokens is replayed: steps replay
    /// ([`super::GpuModelOptions::replay`]),
    /// nothing is profiled, and the step is one submission (every MoE layer routed on the
    /// device).
    fn replays_steps(&self, n: usize) -> bool {
        self.replays
            && self.profiler.is_none()
            && self.layers.iter().all(|l| match &l.ffn {
                GpuFfn::Dense { .. } => true,
                GpuFfn::Moe(_) => self.routes_chunks_on_device(n),
            })
    }

    /// A batched step of `tokens`, token `i` the next of sequence `seqs[i]`, from its recording
    /// (made now the first time for this many tokens); `None`, with nothing evaluated, where
    /// the recording is not one submission (a MoE layer the device cannot route in it).
    fn replay_step(&mut self, tokens: &[u32], seqs: &[usize]) -> Result<Option<Vec<f32>>> {
        let n = tokens.len();
        let mut batch = self.batch.take().expect("made by batches_steps");
        let mut words: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.position_words(&mut batch, &mut words, n, Some(seqs));
        let ran = self.replay_recorded(&mut batch, &words, n);
        let logits = match ran {
            Ok(true) => Ok(Some(batch.read_logits(n, self.config.n_vocab))),
            Ok(false) => Ok(None),
            Err(e) => Err(e),
        };
        self.batch = Some(batch);
        if let Ok(Some(_)) = logits {
            seqs.iter().for_each(|&s| self.positions[s] += 1);
        }
        logits
    }

    /// [`GpuModel::replay_step`] with the batch out of the model: records the step for `n`
    /// tokens if it is not yet, writes the step buffer and runs it; `false` where the recording
    /// is not one submission.
    fn replay_recorded(
        &mut self,
        batch: &mut super::prefill::Batch,
        words: &[u8],
        n: usize,
    ) -> Result<bool> {
        if !batch.replays.contains_key(&n) {
            // The attention's grid for every position a sequence holds.
            batch.set_end(self.capacity);
            let (mut paused, mut on_device) = (None, Vec::new());
            let b = &*batch;
            let replay = self.kernels.record_replay(|rec| {
                self.record_chunk(rec, b, (n, true), None, (&mut paused, &mut on_device))
            })?;
            let one_submission = paused.is_none().then_some((replay, on_device));
            batch.replays.insert(n, one_submission);
        }
        if batch.replays[&n].is_none() {
            return Ok(false);
        }
        // The device-loss injection counts tokens evaluated, a step's each.
        self.count_for_faults(n);
        batch.write_step(words);
        self.write_slot_map();
        let (replay, on_device) = batch.replays[&n].as_ref().expect("one submission");
        replay.run_after(None)?;
        self.last_stats = replay.stats();
        let on_device = on_device.clone();
        self.count_routed_on_device(batch, &on_device);
        self.last_routing = Vec::new();
        self.last_host_time = None;
        Ok(true)
    }

    /// Checks `inputs` before anything of them is evaluated: at most [`MAX_STEP_TOKENS`], and
    /// as [`GpuModel::check_mixed`] checks a step of one token each.
    fn check_batch(&self, inputs: &[(usize, u32)]) -> Result<()> {
        if inputs.len() > MAX_STEP_TOKENS {
            return Err(GpuError::Unsupported(format!(
                "a step of {} sequences: at most {MAX_STEP_TOKENS}",
                inputs.len()
            )));
        }
        let each: Vec<(usize, &[u32])> = inputs
            .iter()
            .map(|(seq, token)| (*seq, std::slice::from_ref(token)))
            .collect();
        self.check_mixed(&each)
    }

    /// Checks `inputs` of [`GpuModel::eval_mixed`] before anything of them is evaluated:
    /// known, distinct sequences, each with tokens, in the vocabulary, and room for them.
    fn check_mixed(&self, inputs: &[(usize, &[u32])]) -> Result<()> {
        let bad = |why: String| Err(GpuError::Unsupported(why));
        for (i, &(seq, tokens)) in inputs.iter().enumerate() {
            if seq >= self.sequences() {
                return bad(format!("sequence {seq} of {}", self.sequences()));
            }
            if inputs[..i].iter().any(|&(s, _)| s == seq) {
                return bad(format!("sequence {seq} twice in one step"));
            }
            if tokens.is_empty() {
                return bad(format!("no tokens for sequence {seq}"));
            }
            if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.config.n_vocab) {
                return bad(format!(
                    "token {t} is outside the vocabulary of {}",
                    self.config.n_vocab
                ));
            }
            if self.positions[seq] + tokens.len() > self.capacity {
                return bad(format!(
                    "the context of {} positions of sequence {seq} has room for {} more \
                     tokens, not {}",
                    self.capacity,
                    self.capacity - self.positions[seq],
                    tokens.len()
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
        // (Layers on the CPU make the placement's answer no.)
        let chunks = self.batches_prompts() || (self.cpu_misses() && !self.chunks_refused(n));
        if !self.placement.batches_steps(miss) || !chunks {
            return Ok(false);
        }
        if !self.make_batch(n)? || !self.make_batch_logits()? {
            return Ok(false);
        }
        // The attention's scratch for every token at the last positions.
        let b = self.batch.as_ref().expect("made above");
        Ok(b.holds_attention(self, n))
    }
}
