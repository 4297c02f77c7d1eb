//! The decode step of a MoE model whose routed experts are partly computed on the CPU, as one
//! chain of command buffers ([`crate::gpu::chain`]) recorded before the routing is known.
//!
//! Parts, for the MoE layers `L0, L1, ...`:
//!
//! - part 0: the embedding, the layers up to `L0`, and `L0`'s router and shared expert;
//! - part `2j + 1`: the resident experts of `Lj` that the host chose, read from the routing it
//!   wrote ([`GpuMoe::record_host_routed`]), added to the residual; the entries of experts the
//!   CPU computes are left empty, so the device skips them;
//! - part `2j + 2`: the CPU experts' sum of `Lj` added, then the layers up to the next MoE
//!   layer's router (or the logits).
//!
//! The host waits for part `2j`, routes `Lj` from its router logits, writes the slots and
//! weights and releases part `2j + 1`, so the GPU runs the resident experts while the CPU
//! computes the rest; then it writes the CPU's sum and releases part `2j + 2`. Each MoE layer
//! costs one wait on the device, where the step of separate submissions paid two submissions
//! and two fence waits, and the device never waits for a command buffer to be recorded.
//!
//! The parts read whatever changes from one token to the next from buffers (the step words,
//! the routing and sums the host writes), so they are recorded at the first step and submitted
//! again for every token after ([`crate::gpu::record::ChainReplay`]; recording a 30B-shape
//! chain took 2.2–3.5 ms of each token on an H100). Promotions' copies then go in a small
//! recording of their own ahead of part 0. A profiled step, whose parts write timestamps, is
//! recorded anew, as is every step with `GpuModelOptions::replay` off.
//!
//! The arithmetic is the separate submissions' (the same products, added in the same order), so
//! the logits are the same. Experts that miss VRAM go to the CPU here (fetching into slots keeps
//! the separate submissions), or with `MoeMiss::Split` some of them to the device, read from
//! system RAM over the bus in part `2j + 1` beside the resident ones ([`super::split`]).

use std::time::Instant;

use super::promote::Promoter;
use super::{GpuModel, HostTime, Result};
use crate::gpu::chain::Chain;
use crate::gpu::moe::LayerRouting;
use crate::gpu::ops::{route_floats, route_split_floats};
use crate::gpu::record::{ChainRun, RecordStats, Recorder};
use crate::gpu::replay::Replay;

/// An entry of a host-written routing with no expert: the expert-indexed products skip it.
pub(super) const EMPTY_ENTRY: u32 = u32::MAX;

impl GpuModel {
    /// [`GpuModel::eval`] of `token` as a chain (see the module's notes); the logits.
    pub(super) fn eval_chained(&mut self) -> Result<Vec<f32>> {
        let cfg = self.config.moe.expect("a chained step is a MoE model's");
        let (k, n_embd) = (cfg.n_expert_used, self.config.n_embd);
        let moe_layers = self.moe_layer_indices();
        let n_parts = 1 + 2 * moe_layers.len();
        // Promotions staged after the last step: their copies open part 0.
        let mut promoter = self.take_promoter();
        let submitting = Instant::now();
        let kept = self.chain_replays && self.profiler.is_none();
        let started = if kept {
            self.start_kept_chain(&moe_layers, promoter.as_mut())
        } else {
            self.kernels
                .start_chain(self.handoff, n_parts, |part, rec| {
                    if let (0, Some(p)) = (part, promoter.as_mut()) {
                        // SAFETY: the chain completes (`finish`, or its drop) before the
                        // promoter is used again.
                        unsafe { rec.uploads(p.uploader()) };
                    }
                    self.record_chain_part(rec, part, &moe_layers)
                })
                .map(|(run, stats)| {
                    if let Some(p) = promoter.as_mut() {
                        p.uploader().submitted();
                    }
                    (StepChain::Once(run), stats)
                })
        };
        self.restore_promoter(promoter);
        let (mut run, stats) = started?;
        let mut routings: Vec<LayerRouting> = Vec::with_capacity(moe_layers.len());
        let mut time = HostTime {
            submit_ns: submitting.elapsed().as_nanos() as u64,
            ..HostTime::default()
        };
        let start = Instant::now();
        for (j, &il) in moe_layers.iter().enumerate() {
            time.waiting(|| run.chain().wait(2 * j))?;
            let routing = self.moe_layer(il).route(il, &cfg, self.moe_scratch());
            let ex = self
                .experts
                .as_mut()
                .expect("MoE models track their experts");
            let slots = ex.slots[il].as_mut().expect("a MoE layer has slots");
            let mut placed = slots.place(&routing.experts, ex.miss, &mut ex.stats[il]);
            debug_assert!(placed.fetch.is_empty(), "misses go to the CPU");
            let misses = placed.cpu.len();
            // Split misses: the CPU keeps its share, the bus takes the rest.
            let bus = match &self.split {
                Some(share) => placed.cpu.split_off(share.cpu_count(misses)),
                None => Vec::new(),
            };
            let stats = &mut ex.stats[il];
            stats.cpu -= bus.len() as u64;
            stats.pcie += bus.len() as u64;
            // Resident experts first, in rank order, then those read over the bus (listed
            // after the shared gate), then empty entries (no expert, weight 0).
            let mut route = vec![0.0f32; route_split_floats(k)];
            route[..k].fill(f32::from_bits(EMPTY_ENTRY));
            let host_at = route_floats(k);
            route[host_at..].fill(f32::from_bits(EMPTY_ENTRY));
            for (r, g) in placed.gpu.iter().enumerate() {
                route[r] = f32::from_bits(g.slot as u32);
                route[k + r] = g.weight;
            }
            for (r, e) in (placed.gpu.len()..).zip(&bus) {
                route[host_at + r] = f32::from_bits(e.expert as u32);
                route[k + r] = e.weight;
            }
            route[2 * k] = routing.shared_gate.unwrap_or(0.0);
            let scratch = self.act.moe.as_mut().expect("MoE scratch");
            scratch.route_host.write_f32(&route);
            run.chain().release(2 * j + 1)?;

            // The CPU's experts while the device runs the resident ones.
            let t = Instant::now();
            let sum = if placed.cpu.is_empty() {
                vec![0.0f32; n_embd]
            } else {
                let xn = scratch.xn_host.read_f32(n_embd);
                let cpu = ex
                    .cpu
                    .as_ref()
                    .expect("a partial placement has CPU experts");
                cpu.weighted_sum(il, &xn, &placed.cpu)?
            };
            scratch.cpu_sum.write_f32(&sum);
            time.cpu_experts_ns += t.elapsed().as_nanos() as u64;
            time.waiting(|| run.chain().release(2 * j + 2))?;
            routings.push(routing);
        }
        time.waiting(|| run.chain().finish())?;
        time.step_ns = start.elapsed().as_nanos() as u64;
        if let Some(share) = self.split.as_mut() {
            share.observe_step(time.step_ns);
        }
        drop(run);
        self.last_host_time = Some(time);
        self.last_stats = stats;
        self.last_routing = routings;
        Ok(self.act.logits.read_f32(self.config.n_vocab))
    }

    /// Records part `part` of a chained step over the MoE layers `moe_layers` (see the
    /// module's notes); part 0's copies of promotions are the caller's.
    fn record_chain_part(
        &self,
        rec: &mut Recorder<'_>,
        part: usize,
        moe_layers: &[usize],
    ) -> Result<()> {
        let a = &self.act;
        if part == 0 {
            self.record_embedding(rec)?;
            return self.record_from(rec, 0, &mut None);
        }
        let il = moe_layers[(part - 1) / 2];
        if part % 2 == 1 {
            let k = self
                .config
                .moe
                .expect("a chained step is a MoE model's")
                .n_expert_used;
            let s = self.moe_scratch();
            self.moe_layer(il)
                .record_host_routed(rec, k, (&a.xn, &a.x), s)
        } else {
            let n_embd = self.config.n_embd as u32;
            rec.scale_add(&a.x, &self.moe_scratch().cpu_sum, 1.0, n_embd)?;
            self.record_from(rec, il + 1, &mut None)
        }
    }

    /// Submits the step's chain from the kept recording (made now the first time), the copies
    /// of promotions `promoter` has pending ahead of it.
    fn start_kept_chain(
        &mut self,
        moe_layers: &[usize],
        promoter: Option<&mut Promoter>,
    ) -> Result<(StepChain, RecordStats)> {
        if self.chain_replay.is_none() {
            let n_parts = 1 + 2 * moe_layers.len();
            let replay = self
                .kernels
                .record_chain(self.handoff, n_parts, |part, rec| {
                    self.record_chain_part(rec, part, moe_layers)
                })?;
            self.chain_replay = Some(replay);
        }
        let mut copies = None;
        if let Some(p) = promoter {
            if !p.uploader().has_pending() {
                return self.start_kept(None);
            }
            // SAFETY: the copies complete with the chain, before the promoter is used again.
            let r = self.kernels.record_replay(|rec| {
                unsafe { rec.uploads(p.uploader()) };
                Ok(())
            })?;
            p.uploader().submitted();
            copies = Some(r);
        }
        self.start_kept(copies)
    }

    /// Submits the kept chain, `copies` ahead of it.
    fn start_kept(&mut self, copies: Option<Replay>) -> Result<(StepChain, RecordStats)> {
        let replay = self.chain_replay.as_mut().expect("recorded before");
        let chain = replay.start(copies.as_ref())?;
        Ok((StepChain::Kept(chain, copies), replay.stats()))
    }
}

/// A chained step in flight: recorded for this step, or submitted from the kept recording with
/// the recording of its copies (dropped after the chain, which waits for its last part).
pub(super) enum StepChain {
    Once(ChainRun),
    /// The copies' recording is held, not read, until the chain is done.
    Kept(Chain, #[allow(dead_code)] Option<Replay>),
}

impl StepChain {
    pub(super) fn chain(&mut self) -> &mut Chain {
        match self {
            StepChain::Once(run) => &mut run.chain,
            StepChain::Kept(chain, _) => chain,
        }
    }
}
