//! A batched decode step of a MoE model whose experts that miss VRAM run on the CPU, as one
//! chain of command buffers ([`crate::gpu::chain`]) recorded before the routing is known: the
//! chunk's path ([`super::super::batch`]) with its turns at the MoE layers taken as a single
//! step's are ([`super::super::chained`]).
//!
//! Parts, for the MoE layers `L0, L1, ...`:
//!
//! - part 0: the embedding and the layers up to `L0`'s router (its logits and the normalised
//!   rows written where the host reads them);
//! - part `2j + 1`: the resident experts of `Lj` by entry, each token's k entries read from the
//!   route the host wrote (an empty entry for each expert the CPU runs);
//! - part `2j + 2`: the CPU experts' sums of `Lj` added, then the layers up to the next MoE
//!   layer's router (or the logits of every token).
//!
//! The host waits for part `2j`, routes `Lj`'s tokens, writes their entries and releases part
//! `2j + 1`, so the GPU runs the resident experts while the CPU runs each missing expert once
//! over the tokens that chose it; then it writes the sums and releases part `2j + 2`. A MoE
//! layer costs one wait on the device, where the chunk's path records, submits and waits for a
//! command buffer per layer with the device idle while the CPU computes.
//!
//! The arithmetic is the chunk's path's by entry (the same products, added in the same
//! order), so the logits are the same.
//!
//! A prompt chunk of such a model whose misses run on the CPU takes the same chain, its
//! tokens one sequence's (`GpuModel::eval_chunk`), where the chunk's memory holds them.

use std::time::Instant;

use super::Batch;
use crate::gpu::error::{GpuError, Result};
use crate::gpu::forward::chained::StepChain;
use crate::gpu::forward::{GpuFfn, GpuModel, HostTime};
use crate::gpu::moe::ChunkRouting;
use crate::gpu::record::Recorder;

impl GpuModel {
    /// Whether a batched step of `n` tokens runs as a chain (see the module's notes): single
    /// steps are chains, misses go to the CPU, the MoE layers run by entry
    /// ([`super::super::GpuModelOptions::moe_by_entry`]) and have no shared expert, and the
    /// batch's scratch holds every token's entries; nothing is profiled (a profile times each
    /// part of the chunk's path).
    pub(in crate::gpu::forward) fn chains_steps(&self, n: usize) -> bool {
        let holds = |b: &Batch| {
            b.moe
                .as_ref()
                .is_some_and(|m| m.cpu.is_some() && m.holds_entries(n, &self.config))
        };
        let no_shared = self.layers.iter().all(|l| match &l.ffn {
            GpuFfn::Moe(m) => m.shared_ff() == 0,
            GpuFfn::Dense { .. } => true,
        });
        self.chained
            && self.moe_by_entry
            && no_shared
            && self.profiler.is_none()
            && self.cpu_misses()
            && self.batch.as_ref().is_some_and(holds)
    }

    /// A batched step of `tokens`, token `i` the next of sequence `seqs[i]` (a sequence
    /// listed again takes its next position: a prompt chunk is one sequence's tokens), as a
    /// chain; every token's logits. The caller has checked [`GpuModel::chains_steps`].
    pub(in crate::gpu::forward) fn eval_step_chain(
        &mut self,
        tokens: &[u32],
        seqs: &[usize],
    ) -> Result<Vec<f32>> {
        let n = tokens.len();
        // The device-loss injection counts tokens evaluated, a step's each.
        self.count_for_faults(n);
        let mut batch = self.batch.take().expect("made by batches_steps");
        let ran = self.run_step_chain(&mut batch, tokens, seqs);
        let logits = ran.map(|()| batch.read_logits(n, self.config.n_vocab));
        self.batch = Some(batch);
        if logits.is_ok() {
            seqs.iter().for_each(|&s| self.positions[s] += 1);
        }
        logits
    }

    fn run_step_chain(&mut self, b: &mut Batch, tokens: &[u32], seqs: &[usize]) -> Result<()> {
        let cfg = self.config.moe.expect("a chained step is a MoE model's");
        let (n, n_embd) = (tokens.len(), self.config.n_embd);
        let moe_layers = self.moe_layer_indices();
        let mut words: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.position_words(b, &mut words, n, Some(seqs));
        b.step.write(&words);
        b.x_ready = false;
        self.write_slot_map();

        let (mut paused, mut on_device) = (None, Vec::new());
        let submitting = Instant::now();
        let n_parts = 1 + 2 * moe_layers.len();
        let kept = self.chain_replays;
        if kept && !b.chains.contains_key(&n) {
            // The attention's grid for every position a sequence holds; the step words give
            // each run's.
            let end = std::mem::replace(&mut b.end, self.capacity);
            let batch = &*b;
            let recorded = self
                .kernels
                .record_chain(self.handoff, n_parts, |part, rec| {
                    self.record_step_part(
                        rec,
                        batch,
                        (n, part),
                        &moe_layers,
                        (&mut paused, &mut on_device),
                    )
                });
            b.end = end;
            b.chains.insert(n, recorded?);
        }
        let (mut run, stats) = if kept {
            let kept = b.chains.get_mut(&n).expect("recorded above");
            (StepChain::Kept(kept.start(None)?, None), kept.stats())
        } else {
            let batch = &*b;
            let (run, stats) = self
                .kernels
                .start_chain(self.handoff, n_parts, |part, rec| {
                    self.record_step_part(
                        rec,
                        batch,
                        (n, part),
                        &moe_layers,
                        (&mut paused, &mut on_device),
                    )
                })?;
            (StepChain::Once(run), stats)
        };
        debug_assert!(on_device.is_empty(), "misses on the CPU route on the host");

        let mut time = HostTime {
            submit_ns: submitting.elapsed().as_nanos() as u64,
            ..HostTime::default()
        };
        let start = Instant::now();
        for (j, &il) in moe_layers.iter().enumerate() {
            time.waiting(|| run.chain().wait(2 * j))?;
            let m = b.moe.as_ref().expect("a MoE model's batch");
            let routing = ChunkRouting::new(&cfg, &m.logits.read_f32(n * cfg.n_expert), None);
            let (resident, missing) = self.place_chunk_experts(il, &routing, true);
            if !self.write_entry_route(b, (n, &routing), (&resident, &missing)) {
                // (chains_steps checked that the scratch holds them.)
                return Err(GpuError::Unsupported(format!(
                    "a step of {n} tokens: the scratch does not hold their entries"
                )));
            }
            run.chain().release(2 * j + 1)?;

            // The CPU's experts while the device runs the resident ones.
            let t = Instant::now();
            match missing.is_empty() {
                true => {
                    let cpu = b.moe.as_mut().and_then(|m| m.cpu.as_mut());
                    let cpu = cpu.expect("checked by chains_steps");
                    cpu.sum.write_f32(&vec![0.0; n * n_embd]);
                }
                false => self.cpu_chunk_experts(b, (il, n), &routing, &missing)?,
            }
            time.cpu_experts_ns += t.elapsed().as_nanos() as u64;
            time.waiting(|| run.chain().release(2 * j + 2))?;
        }
        time.waiting(|| run.chain().finish())?;
        time.step_ns = start.elapsed().as_nanos() as u64;
        drop(run);
        b.x_ready = false;
        self.last_stats = stats;
        self.last_routing = Vec::new();
        self.last_host_time = Some(time);
        Ok(())
    }

    /// Records part `part` of a batched step's chain of `n` tokens over the MoE layers
    /// `moe_layers` (see the module's notes).
    fn record_step_part(
        &self,
        rec: &mut Recorder<'_>,
        batch: &Batch,
        (n, part): (usize, usize),
        moe_layers: &[usize],
        out: (&mut Option<usize>, &mut Vec<usize>),
    ) -> Result<()> {
        let k = self
            .config
            .moe
            .expect("a chained step is a MoE model's")
            .n_expert_used;
        let n_embd = self.config.n_embd;
        let m = batch.moe.as_ref().expect("a MoE model's batch");
        let cpu = m.cpu.as_ref().expect("checked by chains_steps");
        if part == 0 {
            return self.record_chunk(rec, batch, (n, true), None, out);
        }
        let il = moe_layers[(part - 1) / 2];
        let GpuFfn::Moe(moe) = &self.layers[il].ffn else {
            unreachable!("layer {il} is a MoE layer");
        };
        if part % 2 == 1 {
            if !moe.groups_fit(rec) {
                return Err(GpuError::Unsupported(format!(
                    "layer {il}'s experts by entry: a stack past one binding"
                )));
            }
            let scratch = (&m.eg, &m.eu, &m.xg, &m.ed);
            let route = (&cpu.route, 2 * k, false);
            return moe.record_tokens(rec, route, (n, k), &m.xn.buffer, scratch, &batch.x);
        }
        rec.scale_add(&batch.x, &cpu.sum, 1.0, (n_embd * n) as u32)?;
        self.record_chunk_layers(rec, batch, (n, true), il + 1, out)
    }
}
