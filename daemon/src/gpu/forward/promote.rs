//! A MoE model under its VRAM budget whose misses run on the CPU brings its most used experts
//! into VRAM between steps: [`LayerSlots::promotions`](crate::gpu::expert_cache::LayerSlots::promotions)
//! names, per layer, the experts used more than the residents the policy would give up, and
//! their weights are copied into those residents' slots (from the memory map into upload
//! staging by the CPU experts' threads, idle between steps, then by the device) after the
//! step, before the next one reads the slots. Misses then become hits as the hot experts
//! arrive, where the slots used to keep the experts they were loaded with.
//!
//! The copies are paid for out of a credit: each step (or prompt) adds [`PROMOTE_SHARE`] of its
//! time, and an expert costs the copy time measured on the previous promotions (the first
//! round copies one expert a layer to measure it). Steps thus spend about a tenth of their
//! time on them while there is something to gain, and nothing once the slots hold the hot
//! experts; after a prompt, whose routing filled the demand counts, a tenth of the prompt's
//! time brings many at once. Layers take turns when the credit covers fewer copies than
//! layers want.
//!
//! The device's copies run at the start of the next step's first command buffer when the step
//! is a chain ([`super::chained`]), so they cost no submission of their own (about 0.55 ms on
//! the H200 machine); before any other step or a prompt they are submitted and waited for.
//!
//! With every expert also in system RAM ([`MoeMiss::Pcie`](crate::gpu::placement::MoeMiss::Pcie))
//! the host copies nothing: the device copies the expert from there into the slot, in a
//! command buffer that a replayed step submits ahead of itself (the first round's are run
//! alone and timed, to price the later ones).
//!
//! Partial: the copies go through the compute queue, not on a transfer queue beside it; under
//! a RAM budget their bytes still come through the memory map.

use std::time::{Duration, Instant};

use super::GpuModel;
use crate::gpu::alloc::Allocator;
use crate::gpu::buffer::Buffer;
use crate::gpu::error::Result;
use crate::gpu::placement::ExpertShape;
use crate::gpu::replay::Replay;
use crate::gpu::upload::Uploader;
use crate::model::{Ffn, Model};

/// The share of a step's time that promotions may take, on average.
pub const PROMOTE_SHARE: f64 = 0.1;

/// Experts a promotion round stages at once where staging is host memory that the VRAM budget
/// does not count (a discrete GPU): more than that waits for a flush of its own.
const STAGING_EXPERTS: usize = 16;

/// Credit is capped at this many experts' copies, so that a long pause does not buy a long
/// stall.
const MAX_CREDIT_EXPERTS: f64 = 64.0;

pub(super) struct Promoter {
    up: Uploader,
    /// Measured: nanoseconds a round spent on one expert (staging it on the host, and any
    /// flush a full staging forced; a chained step's copies are in the step's own time).
    ns_per_expert: Option<f64>,
    credit_ns: f64,
    /// The model's MoE layers, which take turns.
    moe_layers: Vec<usize>,
    /// The MoE layer (index into `moe_layers`) whose turn comes first next round.
    next: usize,
    /// Promotions (layer, slot, expert) whose copies come from the experts in system RAM
    /// ([`MoeMiss::Pcie`](crate::gpu::placement::MoeMiss::Pcie)) and wait for the next step's
    /// submission, ahead of it.
    host_copies: Vec<(usize, usize, usize)>,
    /// Whether promotions are copied by the device from the experts in system RAM (a
    /// replayed step's), rather than staged by the host (a chained step's, or without them).
    from_host: bool,
    /// Time spent, in all.
    time: PromotionTime,
}

/// Where promotions' time went since the model was loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromotionTime {
    /// Copying weights from the memory map into upload staging, on the host.
    pub staging: Duration,
    /// The device's copies from staging into the slots, where they took a submission and a
    /// wait of their own (before a step that is not a chain, or a prompt); a chained step runs
    /// them at its start, in its own time.
    pub transfer: Duration,
}

impl PromotionTime {
    pub fn total(&self) -> Duration {
        self.staging + self.transfer
    }
}

impl Promoter {
    /// The uploader holding the staged copies.
    pub(super) fn uploader(&mut self) -> &mut Uploader {
        &mut self.up
    }

    /// `load_up` is the loading staging (the placement's size), kept where the budget counts
    /// staging; elsewhere the promoter takes staging for [`STAGING_EXPERTS`] experts. With
    /// every expert in system RAM (`from_host`) the device copies from there and staging goes
    /// unused: a token amount of it is kept.
    pub(super) fn new(
        model: &Model,
        al: &std::sync::Arc<Allocator>,
        load_up: Uploader,
        from_host: bool,
    ) -> Result<Promoter> {
        let up = match ExpertShape::of(model) {
            _ if from_host => {
                drop(load_up);
                Uploader::new(al, 4096)?
            }
            Some(shape) if !al.budget_counts(crate::gpu::alloc::MemoryUse::Staging) => {
                drop(load_up);
                Uploader::new(al, shape.staging_bytes_for(STAGING_EXPERTS))?
            }
            _ => load_up,
        };
        let moe_layers = (0..model.layers.len())
            .filter(|&il| matches!(model.layers[il].ffn, Ffn::Moe(_)))
            .collect();
        Ok(Promoter {
            up,
            moe_layers,
            ns_per_expert: None,
            credit_ns: 0.0,
            next: 0,
            host_copies: Vec::new(),
            from_host,
            time: PromotionTime::default(),
        })
    }
}

impl GpuModel {
    /// Time spent copying promoted experts since the model was loaded (zero without
    /// promotions).
    pub fn promotion_time(&self) -> PromotionTime {
        self.experts
            .as_ref()
            .and_then(|e| e.promoter.as_ref())
            .map_or(PromotionTime::default(), |p| p.time)
    }

    /// The promoter, taken out while a chained step records its copies at the start of its
    /// first part (the chain completes before the next promotion stages anything).
    pub(super) fn take_promoter(&mut self) -> Option<Promoter> {
        self.experts.as_mut().and_then(|e| e.promoter.take())
    }

    pub(super) fn restore_promoter(&mut self, p: Option<Promoter>) {
        if let (Some(e), Some(p)) = (self.experts.as_mut(), p) {
            e.promoter = Some(p);
        }
    }

    /// Submits the promotions' pending copies and waits for them: before anything but a
    /// chained step reads the slots.
    pub(super) fn flush_promotions(&mut self) -> Result<()> {
        self.flush_staged_promotions()?;
        self.run_host_copies().map(drop)
    }

    /// The staged part of [`GpuModel::flush_promotions`]: copies from upload staging.
    pub(super) fn flush_staged_promotions(&mut self) -> Result<()> {
        let Some(p) = self.experts.as_mut().and_then(|e| e.promoter.as_mut()) else {
            return Ok(());
        };
        if !p.up.has_pending() {
            return Ok(());
        }
        let t = Instant::now();
        p.up.flush()?;
        p.time.transfer += t.elapsed();
        Ok(())
    }

    /// The pending copies from the experts in system RAM, as the device's copy commands.
    fn host_copy_regions(&self) -> Vec<(&Buffer, u64, &Buffer, u64, u64)> {
        let Some(p) = self.experts.as_ref().and_then(|e| e.promoter.as_ref()) else {
            return Vec::new();
        };
        p.host_copies
            .iter()
            .flat_map(|&(il, slot, expert)| match &self.layers[il].ffn {
                super::GpuFfn::Moe(m) => m.host_slot_copies(slot, expert),
                super::GpuFfn::Dense { .. } => unreachable!("layer {il} is MoE"),
            })
            .collect()
    }

    fn clear_host_copies(&mut self) {
        if let Some(p) = self.experts.as_mut().and_then(|e| e.promoter.as_mut()) {
            p.host_copies.clear();
        }
    }

    /// Submits the pending copies from the experts in system RAM and waits for them: before
    /// anything but a replayed step (which takes them ahead of itself,
    /// [`GpuModel::host_copies_recording`]) reads the slots. The time they took.
    fn run_host_copies(&mut self) -> Result<Duration> {
        let regions = self.host_copy_regions();
        if regions.is_empty() {
            return Ok(Duration::ZERO);
        }
        let t = Instant::now();
        self.kernels.record(|rec| rec.copies(&regions))?;
        let spent = t.elapsed();
        self.clear_host_copies();
        if let Some(p) = self.experts.as_mut().and_then(|e| e.promoter.as_mut()) {
            p.time.transfer += spent;
        }
        Ok(spent)
    }

    /// The pending copies from the experts in system RAM, recorded for a replayed step to
    /// submit ahead of itself ([`Replay::run_after`]); `None` when there are none.
    pub(super) fn host_copies_recording(&mut self) -> Result<Option<Replay>> {
        let regions = self.host_copy_regions();
        if regions.is_empty() {
            return Ok(None);
        }
        let replay = self.kernels.record_replay(|rec| rec.copies(&regions))?;
        self.clear_host_copies();
        Ok(Some(replay))
    }

    /// Promotes experts after a step or a prompt that took `spent` (see the module's notes):
    /// rounds of copies while the credit lasts and some layer has an expert to gain.
    pub(super) fn promote_experts(&mut self, spent: Duration) -> Result<()> {
        let Some(p) = self.experts.as_mut().and_then(|e| e.promoter.as_mut()) else {
            return Ok(());
        };
        let earned = PROMOTE_SHARE * spent.as_nanos() as f64;
        p.credit_ns += earned;
        loop {
            let p = self
                .experts
                .as_mut()
                .and_then(|e| e.promoter.as_mut())
                .expect("checked above");
            let limit = match p.ns_per_expert {
                // The first round measures the copies: one expert a layer.
                None => usize::MAX,
                Some(ns) => {
                    // A long pause buys at most a few dozen copies, a prompt its own share.
                    p.credit_ns = p.credit_ns.min((MAX_CREDIT_EXPERTS * ns).max(earned));
                    (p.credit_ns / ns) as usize
                }
            };
            let made = self.promote_round(limit)?;
            if made == 0 {
                return Ok(());
            }
            // Copies from system RAM are the device's alone: the first round's are run now
            // and timed, to price the later ones (which go ahead of the next step).
            let p = self
                .experts
                .as_mut()
                .and_then(|e| e.promoter.as_mut())
                .expect("checked above");
            if p.ns_per_expert.is_none() && !p.host_copies.is_empty() {
                let spent = self.run_host_copies()?;
                let p = self
                    .experts
                    .as_mut()
                    .and_then(|e| e.promoter.as_mut())
                    .expect("checked above");
                p.ns_per_expert = Some(spent.as_nanos() as f64 / made as f64);
                p.credit_ns = (p.credit_ns - spent.as_nanos() as f64).max(0.0);
            }
        }
    }

    /// One round: up to `limit` copies (at most one a layer when the copy time is not yet
    /// measured), the layers taking turns; the number of copies made.
    fn promote_round(&mut self, limit: usize) -> Result<usize> {
        let GpuModel {
            experts,
            layers,
            model,
            ..
        } = self;
        let ex = experts.as_mut().expect("a MoE model");
        let p = ex.promoter.as_mut().expect("promotions on");
        let moe = &p.moe_layers;
        if moe.is_empty() {
            return Ok(0);
        }
        let limit = match p.ns_per_expert {
            None => limit.min(moe.len()),
            Some(_) => limit,
        };
        let per_layer = limit.div_ceil(moe.len());
        let mut copies = Vec::new();
        for turn in 0..moe.len() {
            let il = moe[(p.next + turn) % moe.len()];
            let left = limit - copies.len();
            let slots = ex.slots[il].as_mut().expect("a MoE layer has slots");
            for (slot, expert) in slots.promotions(per_layer.min(left), &mut ex.stats[il]) {
                copies.push((il, slot, expert));
            }
            if copies.len() == limit {
                p.next = (p.next + turn + 1) % moe.len();
                break;
            }
        }
        if copies.is_empty() {
            return Ok(0);
        }
        ex.map_stale = true;
        let from_host = p.from_host
            && copies.iter().all(
            |&(il, ..)| matches!(&layers[il].ffn, super::GpuFfn::Moe(m) if m.has_host_experts()),
        );
        if from_host {
            for &(il, slot, expert) in &copies {
                let super::GpuFfn::Moe(gpu) = &layers[il].ffn else {
                    unreachable!("layer {il} is MoE");
                };
                let bytes: u64 = gpu.host_slot_copies(slot, expert).iter().map(|c| c.4).sum();
                ex.stats[il].bytes_uploaded += bytes;
            }
            let n = copies.len();
            p.host_copies.extend(copies);
            if let Some(ns) = p.ns_per_expert {
                p.credit_ns = (p.credit_ns - ns * n as f64).max(0.0);
            }
            return Ok(n);
        }
        let t = Instant::now();
        let mut uploads = Vec::with_capacity(3 * copies.len());
        for &(il, slot, expert) in &copies {
            let (super::GpuFfn::Moe(gpu), Ffn::Moe(weights)) =
                (&layers[il].ffn, &model.layers[il].ffn)
            else {
                unreachable!("layer {il} is MoE");
            };
            for u in gpu.slot_uploads(model, weights, slot, expert) {
                ex.stats[il].bytes_uploaded += u.2.len() as u64;
                uploads.push(u);
            }
        }
        match &ex.cpu {
            Some(cpu) => p.up.upload_parallel(cpu.pool(), &uploads)?,
            None => {
                for &(buffer, at, data) in &uploads {
                    p.up.upload(buffer, at, data)?;
                }
            }
        }
        // The device's copies wait for the next step ([`GpuModel::promoted_uploads`]).
        let spent = t.elapsed();
        p.time.staging += spent;
        let ns = spent.as_nanos() as f64;
        p.credit_ns = (p.credit_ns - ns).max(0.0);
        let each = ns / copies.len() as f64;
        p.ns_per_expert = Some(match p.ns_per_expert {
            None => each,
            Some(old) => 0.5 * (old + each),
        });
        Ok(copies.len())
    }
}
