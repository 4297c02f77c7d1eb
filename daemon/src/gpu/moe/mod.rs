//! MoE layers of a [`GpuModel`](super::forward::GpuModel)'s decode step. A MoE layer is
//! recorded in two parts with the host between them:
//!
//! 1. [`GpuMoe::record_router`]: the router logits (`ffn_gate_inp · xn`) into a host-visible
//!    buffer, and Qwen2-MoE's shared expert with its gate logit, which need no routing; the
//!    step's command buffer is submitted and waited for there.
//! 2. [`GpuMoe::route`] on the host, with the CPU engine's own routing
//!    ([`engine::routing::route`](crate::engine::routing::route)), so both pick the same experts
//!    from the same logits; the expert cache ([`super::expert_cache`]) says which are in VRAM
//!    slots; then [`GpuMoe::record_experts`] opens the next command buffer with those experts'
//!    gate/up/SwiGLU/down and adds each to the residual with its weight. Experts computed on
//!    the CPU meanwhile ([`super::cpu_experts`]) are added from the host-visible
//!    [`MoeScratch::cpu_sum`] with [`Recorder::scale_add`].
//!
//! A layer's routed experts live in slot stacks: each of gate, up and down is `n_slots × n_out`
//! rows, slot `s` being rows `s * n_out..(s + 1) * n_out`, bound from the offset boundary below
//! its first row (the kernel skips to the row, so slots need not start on
//! `minStorageBufferOffsetAlignment`). Where gate and up have one type and fit one binding
//! together, the up stack follows the gate stack in one [`GpuMatrix`], so that one dispatch
//! takes both and their SwiGLU. With every expert resident the stacks
//! are the file's and slot `e` holds expert `e`; under a VRAM budget there are fewer slots
//! ([`super::placement`]) and [`GpuMoe::fill_slot`] replaces a slot's expert.
//!
//! With every routed expert resident (slots == experts) and each stack within one binding, the
//! host is not needed: [`GpuMoe::record_routed`] routes on the device
//! ([`Recorder::moe_route`]) and runs the k experts with the expert read from the routing
//! buffer ([`Recorder::matvec_id_fused`]): the layer's RMSNorm, gate, up and SwiGLU of all k as
//! one dispatch, then their down products summed with the routing's weights into the residual
//! as another, so a whole token is one submission. Without a shared expert the router's product
//! and the routing are one dispatch too ([`Recorder::moe_router`]): a MoE layer is three
//! dependent dispatches. The logits and routing of each layer go to a host-visible log that
//! [`GpuMoe::logged_routing`] reads once the step is done.
//!
//! A prompt's chunk ([`super::forward`]'s prefill) routes all its tokens on the host from one
//! read-back per layer and runs each chosen expert once over its tokens
//! ([`GpuMoe::record_chunk_experts`]), then the shared expert over all of them with each
//! token's gate ([`GpuMoe::record_chunk_shared`]).
//!
//! Partial: on the read-back path (some experts not resident) one
//! read-back per MoE layer per token, and the experts of a token run one after another through
//! per-rank scratch.

use std::sync::Arc;

mod chunk;
pub(super) use chunk::{ChunkRouting, ExpertRun};

use super::alloc::{Allocator, MemoryUse};
use super::buffer::Buffer;
use super::error::Result;
use super::expert_cache::SlotExpert;
use super::ops::{
    route_floats, route_log_floats, route_split_floats, zeroed_counters, Fused, GpuMatrix, IdFused,
    MoeRouteArgs, MOE_ROUTE_MAX_EXPERTS,
};
use super::record::Recorder;
use super::upload::Uploader;
use crate::engine::routing::{route, shared_expert_gate, RoutedExpert};
use crate::model::{Matrix, Model, MoeConfig, MoeWeights};
use spillway_shaders::WeightType;

/// Qwen2-MoE's always-on expert and the weight (`[n_embd, 1]`) of its sigmoid gate.
struct SharedExpert {
    gate_inp: GpuMatrix,
    gate: GpuMatrix,
    up: GpuMatrix,
    down: GpuMatrix,
}

/// One MoE layer's weights in device-local memory.
pub(super) struct GpuMoe {
    /// `n_expert` rows (F32 in llama.cpp's files).
    router: GpuMatrix,
    /// Slot stacks: `n_slots` experts' matrices, each stack one matrix; `up` is `None` where
    /// the up stack follows the gate stack in `gate` (rows `n_slots * n_ff..`).
    gate: GpuMatrix,
    up: Option<GpuMatrix>,
    down: GpuMatrix,
    n_slots: usize,
    /// Rows of one expert's gate and up (its hidden width).
    n_ff: usize,
    /// Rows of one expert's down.
    n_embd: usize,
    shared: Option<SharedExpert>,
    /// Every routed expert of the layer in system RAM, where some have no slot and the GPU
    /// reads those over the bus ([`GpuMoe::attach_host_experts`]).
    host: Option<HostExperts>,
}

/// A MoE layer's routed experts in system RAM, all of them, laid out as the file's stacks
/// (expert `e` in place `e`), the up stack after the gate stack where both fit one binding.
struct HostExperts {
    gate: GpuMatrix,
    up: Option<GpuMatrix>,
    down: GpuMatrix,
}

/// A layer's expert stacks as the expert-indexed products bind them: `n` experts in each.
#[derive(Clone, Copy)]
struct Stacks<'a> {
    gate: &'a GpuMatrix,
    up: Option<&'a GpuMatrix>,
    down: &'a GpuMatrix,
    n: usize,
}

impl<'a> Stacks<'a> {
    /// The matrix holding the up stack and its first row: its own, or the rows after the gate
    /// stack's (`n` experts of `ff` rows).
    fn up_rows(&self, ff: usize) -> (&'a GpuMatrix, usize) {
        match self.up {
            Some(up) => (up, 0),
            None => (self.gate, self.n * ff),
        }
    }
}

/// Where one token's MoE layer goes: the routed experts, best first, and the shared expert's
/// weight (Qwen2-MoE), decided from the router logits read back.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRouting {
    pub layer: usize,
    pub router_logits: Vec<f32>,
    pub experts: Vec<RoutedExpert>,
    pub shared_gate: Option<f32>,
}

/// Buffers every MoE layer of a step reuses.
pub(super) struct MoeScratch {
    /// Host-visible: the router logits, read back between the two parts of a layer.
    router_logits: Buffer,
    /// Host-visible: the shared expert's gate logit.
    shared_logit: Buffer,
    /// Host-visible: the layer's normalised input, for experts computed on the CPU.
    pub(super) xn_host: Buffer,
    /// Host-visible: the weighted sum of the experts computed on the CPU.
    pub(super) cpu_sum: Buffer,
    /// Host-visible: a routing the host decided, laid out as [`route_floats`] (slots in place
    /// of experts), then the experts read over the bus as [`route_split_floats`] lists them,
    /// for [`GpuMoe::record_host_routed`].
    pub(super) route_host: Buffer,
    /// Per rank of the top k: gate (then SwiGLU), up and the expert's output, so the k experts
    /// are independent dispatches.
    gate: Vec<Buffer>,
    up: Vec<Buffer>,
    out: Vec<Buffer>,
    /// The shared expert's gate, up and output (empty without one).
    shared_gate: Buffer,
    shared_up: Buffer,
    shared_out: Buffer,
    /// Routing on the device: the router logits and the shared gate's logit (device-local), the
    /// routing ([`route_floats`]), and every layer's logits and routing, host-visible
    /// ([`route_log_floats`] per layer).
    router_dev: Buffer,
    /// The counter [`Recorder::moe_router`] finds its last workgroup with.
    router_done: Buffer,
    shared_logit_dev: Buffer,
    route: Buffer,
    log: Buffer,
    /// The k experts' gate (then SwiGLU), up and output, one after another, for the
    /// dispatches that run all k.
    gate_all: Buffer,
    up_all: Buffer,
    out_all: Buffer,
    /// As `gate_all` and `up_all`, for the experts read from system RAM, so that their
    /// products do not wait for the slots' (empty without such experts).
    gate_host: Buffer,
    up_host: Buffer,
    /// Host-visible, where experts are read from system RAM: each MoE layer's slot of each
    /// expert (`u32::MAX` for none), `n_expert` words a layer, written by the host whenever
    /// the slots change ([`MoeScratch::write_slot_map`]).
    slot_map: Option<Buffer>,
}

fn upload_matrix(
    model: &Model,
    alloc: &Arc<Allocator>,
    up: &mut Uploader,
    m: &Matrix,
) -> Result<GpuMatrix> {
    let r = model.stacked(m);
    GpuMatrix::upload(alloc, up, r.ty, r.n_in, r.n_out, r.data)
}

/// Experts `0..n` of a stack, as one matrix.
fn upload_experts(
    model: &Model,
    alloc: &Arc<Allocator>,
    up: &mut Uploader,
    m: &Matrix,
    n: usize,
) -> Result<GpuMatrix> {
    let r = model.stacked(m);
    let bytes = r.data.len() / m.n_mat * n;
    GpuMatrix::upload(alloc, up, r.ty, r.n_in, m.n_out * n, &r.data[..bytes])
}

/// Experts `0..n` of the gate stack then of the up stack, as one matrix (see the module's
/// notes), where both have one type and shape and fit one binding together.
fn upload_gate_up(
    model: &Model,
    alloc: &Arc<Allocator>,
    up: &mut Uploader,
    (gate, w_up): (&Matrix, &Matrix),
    n: usize,
) -> Result<Option<GpuMatrix>> {
    let (g, u) = (model.stacked(gate), model.stacked(w_up));
    let (gb, ub) = (g.data.len() / gate.n_mat * n, u.data.len() / w_up.n_mat * n);
    let fits = (gb + ub) as u64 <= alloc.device().max_storage_buffer_range();
    if g.ty != u.ty || g.n_in != u.n_in || gate.n_out != w_up.n_out || gb != ub || !fits {
        return Ok(None);
    }
    let parts = [&g.data[..gb], &u.data[..ub]];
    GpuMatrix::upload_stack(alloc, up, g.ty, g.n_in, &parts).map(Some)
}

impl GpuMoe {
    /// Uploads one layer's router and shared expert, and `n_slots` slots holding experts
    /// `0..n_slots` (all of them: the file's stacks).
    pub(super) fn upload(
        model: &Model,
        alloc: &Arc<Allocator>,
        up: &mut Uploader,
        moe: &MoeWeights,
        n_slots: usize,
    ) -> Result<GpuMoe> {
        let n_slots = n_slots.clamp(1, moe.gate.n_mat);
        let (gate, w_up) = match upload_gate_up(model, alloc, up, (&moe.gate, &moe.up), n_slots)? {
            Some(stack) => (stack, None),
            None => (
                upload_experts(model, alloc, up, &moe.gate, n_slots)?,
                Some(upload_experts(model, alloc, up, &moe.up, n_slots)?),
            ),
        };
        let down = upload_experts(model, alloc, up, &moe.down, n_slots)?;
        let mut m = |w: &Matrix| upload_matrix(model, alloc, up, w);
        let shared = match &moe.shared {
            Some(s) => Some(SharedExpert {
                gate_inp: m(&s.gate_inp)?,
                gate: m(&s.gate)?,
                up: m(&s.up)?,
                down: m(&s.down)?,
            }),
            None => None,
        };
        Ok(GpuMoe {
            router: m(&moe.router)?,
            gate,
            up: w_up,
            down,
            n_slots,
            n_ff: moe.gate.n_out,
            n_embd: moe.down.n_out,
            shared,
            host: None,
        })
    }

    /// Copies every routed expert of `moe` (this layer's weights) into system RAM that the GPU
    /// reads over the bus, for [`GpuMoe::record_routed`] to run the experts without a slot
    /// there; the bytes it holds.
    pub(super) fn attach_host_experts(
        &mut self,
        model: &Model,
        device: &Arc<super::device::Device>,
        moe: &MoeWeights,
    ) -> Result<u64> {
        let (g, u, d) = (
            model.stacked(&moe.gate),
            model.stacked(&moe.up),
            model.stacked(&moe.down),
        );
        let stackable = g.ty == u.ty
            && g.n_in == u.n_in
            && moe.gate.n_out == moe.up.n_out
            && g.data.len() == u.data.len()
            && (g.data.len() + u.data.len()) as u64 <= device.max_storage_buffer_range();
        let host = if stackable {
            HostExperts {
                gate: GpuMatrix::in_host_memory(device, g.ty, g.n_in, &[g.data, u.data])?,
                up: None,
                down: GpuMatrix::in_host_memory(device, d.ty, d.n_in, &[d.data])?,
            }
        } else {
            HostExperts {
                gate: GpuMatrix::in_host_memory(device, g.ty, g.n_in, &[g.data])?,
                up: Some(GpuMatrix::in_host_memory(device, u.ty, u.n_in, &[u.data])?),
                down: GpuMatrix::in_host_memory(device, d.ty, d.n_in, &[d.data])?,
            }
        };
        let bytes = [Some(&host.gate), host.up.as_ref(), Some(&host.down)]
            .iter()
            .flatten()
            .map(|m| m.buffer.size())
            .sum();
        self.host = Some(host);
        Ok(bytes)
    }

    /// The VRAM slot stacks.
    fn slot_stacks(&self) -> Stacks<'_> {
        Stacks {
            gate: &self.gate,
            up: self.up.as_ref(),
            down: &self.down,
            n: self.n_slots,
        }
    }

    /// The stacks of every expert in system RAM, where the layer has them.
    fn host_stacks(&self) -> Option<Stacks<'_>> {
        self.host.as_ref().map(|h| Stacks {
            gate: &h.gate,
            up: h.up.as_ref(),
            down: &h.down,
            n: self.gate_stack_experts(&h.gate, h.up.is_none()),
        })
    }

    /// Copies expert `expert` of `moe` (this layer's weights) into slot `slot`; the bytes
    /// copied. The copies may still be pending in `up`: flush it before recording.
    pub(super) fn fill_slot(
        &self,
        model: &Model,
        moe: &MoeWeights,
        up: &mut Uploader,
        slot: usize,
        expert: usize,
    ) -> Result<u64> {
        let mut bytes = 0;
        for (buffer, at, data) in self.slot_uploads(model, moe, slot, expert) {
            up.upload(buffer, at, data)?;
            bytes += data.len() as u64;
        }
        Ok(bytes)
    }

    /// The uploads (destination, offset, bytes) that put expert `expert` of `moe` (this
    /// layer's weights) into slot `slot`: its gate, up and down matrices.
    pub(super) fn slot_uploads<'a>(
        &'a self,
        model: &'a Model,
        moe: &MoeWeights,
        slot: usize,
        expert: usize,
    ) -> [(&'a Buffer, u64, &'a [u8]); 3] {
        assert!(slot < self.n_slots, "slot {slot} of {}", self.n_slots);
        let (up_stack, up_first) = self.up_rows();
        let up_slot = up_first / self.n_ff + slot;
        [
            (&self.gate, &moe.gate, slot),
            (up_stack, &moe.up, up_slot),
            (&self.down, &moe.down, slot),
        ]
        .map(|(stack, m, at)| {
            let data = model.expert(m, expert).data;
            (&stack.buffer, (at * data.len()) as u64, data)
        })
    }

    /// Whether the layer's experts are also in system RAM ([`GpuMoe::attach_host_experts`]).
    pub(super) fn has_host_experts(&self) -> bool {
        self.host.is_some()
    }

    /// The device's copies (source, offset, destination, offset, bytes) that put expert
    /// `expert` into slot `slot` from the layer's experts in system RAM: its gate, up and down.
    ///
    /// # Panics
    /// Without experts in system RAM, or with `slot` out of range.
    pub(super) fn host_slot_copies(
        &self,
        slot: usize,
        expert: usize,
    ) -> [(&Buffer, u64, &Buffer, u64, u64); 3] {
        assert!(slot < self.n_slots, "slot {slot} of {}", self.n_slots);
        let h = self.host.as_ref().expect("experts in system RAM");
        let up = h.up.as_ref().unwrap_or(&h.gate);
        // Where the up stack follows the gate stack, its expert 0 comes after all the gates.
        let host_up_first = match h.up {
            Some(_) => 0,
            None => self.gate_stack_experts(&h.gate, true),
        };
        let (vram_up, vram_up_first) = self.up_rows();
        let vram_up_slot = vram_up_first / self.n_ff + slot;
        let bytes = |m: &GpuMatrix, rows: usize| (rows as u64) * m.row_bytes;
        let (g, u, d) = (
            bytes(&h.gate, self.n_ff),
            bytes(up, self.n_ff),
            bytes(&h.down, self.n_embd),
        );
        let (e, s) = (expert as u64, slot as u64);
        [
            (&h.gate.buffer, e * g, &self.gate.buffer, s * g, g),
            (
                &up.buffer,
                (host_up_first as u64 + e) * u,
                &vram_up.buffer,
                vram_up_slot as u64 * u,
                u,
            ),
            (&h.down.buffer, e * d, &self.down.buffer, s * d, d),
        ]
    }

    /// The matrix holding the up stack and the row where it starts there.
    fn up_rows(&self) -> (&GpuMatrix, usize) {
        self.slot_stacks().up_rows(self.n_ff)
    }

    /// Whether [`GpuMoe::record_routed`] can run this layer: every expert resident or in system
    /// RAM for the GPU ([`GpuMoe::attach_host_experts`]), at most [`MOE_ROUTE_MAX_EXPERTS`],
    /// and each stack within one binding of `max_range` bytes.
    pub(super) fn routes_on_device(&self, cfg: &MoeConfig, max_range: u64) -> bool {
        let host_fit = self.host.as_ref().is_some_and(|h| {
            [Some(&h.gate), h.up.as_ref(), Some(&h.down)]
                .iter()
                .flatten()
                .all(|m| m.buffer.size() <= max_range)
        });
        (self.n_slots == cfg.n_expert || host_fit)
            && cfg.n_expert <= MOE_ROUTE_MAX_EXPERTS
            && self.stacks_fit(max_range)
    }

    /// The whole layer with the routing decided on the device (see the module's notes), from
    /// the residual `x` and the layer's FFN norm: the router (the norm in its dispatch), the
    /// routing into layer `layer`'s place in the log, the shared expert (from the norm written to
    /// `xn`), and the k experts added to `x` with their weights, then the shared expert, as
    /// [`GpuMoe::record_experts`] adds them.
    pub(super) fn record_routed(
        &self,
        rec: &mut Recorder<'_>,
        (layer, cfg): (usize, &MoeConfig),
        (x, norm, xn): (&Buffer, (&Buffer, f32), &Buffer),
        s: &MoeScratch,
    ) -> Result<()> {
        let k = cfg.n_expert_used;
        let slots = match (&self.host, &s.slot_map) {
            (Some(_), Some(map)) => Some((map, (layer * cfg.n_expert) as u32)),
            (Some(_), None) => {
                return Err(super::error::GpuError::Unsupported(
                    "experts in system RAM without a slot map".into(),
                ))
            }
            (None, _) => None,
        };
        let args = MoeRouteArgs {
            n_expert: cfg.n_expert as u32,
            k: k as u32,
            norm_weights: cfg.norm_weights,
            log_offset: (layer * route_log_floats(cfg.n_expert, k)) as u32,
            slots,
        };
        if self.shared.is_none() && self.router.wtype == WeightType::F32 {
            // The router's product and the routing in one dispatch.
            let scratch = (&s.router_dev, &s.router_done);
            rec.moe_router(&self.router, (x, norm), scratch, &s.route, &s.log, args)?;
            return self.record_fused(rec, k, (x, norm), &s.route, s);
        }
        let normed = Fused {
            norm: Some(norm),
            ..Fused::default()
        };
        rec.matvec_fused(&self.router, x, &s.router_dev, normed)?;
        if let Some(sh) = &self.shared {
            rec.rms_norm(x, norm.0, xn, self.n_embd as u32, 1, norm.1)?;
            rec.matvec(&sh.gate_inp, xn, &s.shared_logit_dev)?;
            rec.matvec(&sh.gate, xn, &s.shared_gate)?;
            rec.matvec(&sh.up, xn, &s.shared_up)?;
            rec.swiglu(&s.shared_gate, &s.shared_up, sh.gate.n_out as u32)?;
            rec.matvec(&sh.down, &s.shared_gate, &s.shared_out)?;
        }
        let shared_logit = self.shared.as_ref().map(|_| &s.shared_logit_dev);
        rec.moe_route(&s.router_dev, shared_logit, &s.route, &s.log, args)?;
        self.record_fused(rec, k, (x, norm), &s.route, s)
    }

    /// Whether every slot stack fits one binding of `max_range` bytes, as the expert-indexed
    /// products ([`Recorder::matvec_id`]) need.
    pub(super) fn stacks_fit(&self, max_range: u64) -> bool {
        [Some(&self.gate), self.up.as_ref(), Some(&self.down)]
            .iter()
            .flatten()
            .all(|m| m.buffer.size() <= max_range)
    }

    /// Part 2 of a layer whose routing the host wrote into [`MoeScratch::route_host`] after
    /// part 1 ([`GpuMoe::record_router`]) ran: the slots of the k entries there, each expert
    /// one dispatch for all k, added to `x` with the weights there (zero for the entries the
    /// CPU computes), then the shared expert with the gate there. A chained step
    /// ([`super::chain`]) records it before the routing is known.
    ///
    /// With the layer's experts also in system RAM ([`GpuMoe::attach_host_experts`]), the
    /// route is [`route_split_floats`] long: the entries of experts read over the bus list them
    /// after the shared gate, and run from there beside the slots' ([`GpuMoe::record_stacks`];
    /// the misses a chain shares between the CPU and the bus, `MoeMiss::Split`).
    pub(super) fn record_host_routed(
        &self,
        rec: &mut Recorder<'_>,
        k: usize,
        (xn, x): (&Buffer, &Buffer),
        s: &MoeScratch,
    ) -> Result<()> {
        if self.host.is_none() {
            return self.record_indexed(rec, k, (xn, x), &s.route_host, s);
        }
        let plain = IdFused::default();
        self.record_both_stacks(rec, k, (xn, plain), &s.route_host, s, x)
    }

    /// The k experts whose slots `route` holds (as [`route_floats`] lays them out), from the
    /// residual `x` RMSNorm'd with `norm` in the dispatch that runs them, their sum with the
    /// weights from `route` added to `x`, then the shared expert with its gate from `route`.
    /// With experts in system RAM, those `route` lists after the shared gate
    /// ([`route_split_floats`]) run from there, beside the slots' (their gate and up products
    /// in dispatches of their own, which the slots' do not wait for), and their sum is added
    /// after the slots'.
    fn record_fused(
        &self,
        rec: &mut Recorder<'_>,
        k: usize,
        (x, norm): (&Buffer, (&Buffer, f32)),
        route: &Buffer,
        s: &MoeScratch,
    ) -> Result<()> {
        let normed = IdFused {
            norm: Some(norm),
            ..IdFused::default()
        };
        self.record_both_stacks(rec, k, (x, normed), route, s, x)
    }

    /// The k entries `route` lists ([`route_split_floats`]: slots from word 0, experts in
    /// system RAM after the shared gate), from `input` with what `each` fuses, summed with the
    /// weights from `route` into `y`, then the shared expert with its gate from `route`.
    fn record_both_stacks(
        &self,
        rec: &mut Recorder<'_>,
        k: usize,
        (input, each): (&Buffer, IdFused<'_>),
        route: &Buffer,
        s: &MoeScratch,
        y: &Buffer,
    ) -> Result<()> {
        let k32 = k as u32;
        let summed = IdFused {
            sum_weights_at: Some(k32),
            ..IdFused::default()
        };
        let outs = [(&s.gate_all, &s.up_all), (&s.gate_host, &s.up_host)];
        let ids = (route, Some(route_floats(k) as u32));
        self.record_stacks(rec, ids, k32, input, outs, (each, summed), y)?;
        self.add_shared(rec, k32, y, route, s)
    }

    /// The `k` entries of the slot stacks whose ids `route` lists from word 0 and, with
    /// experts in system RAM and a `host_rank`, of those stacks from word `host_rank` (`None`:
    /// the route lists no expert in system RAM): their gate, up and SwiGLU
    /// from `x` with `each` (RMSNorm fused, or several tokens' entries) into `outs[0]` for the
    /// slots and `outs[1]` for system RAM (gate, then up where the up stack is apart), then
    /// their down products summed with `summed` into `y`, the slots' first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record_stacks(
        &self,
        rec: &mut Recorder<'_>,
        (route, host_rank): (&Buffer, Option<u32>),
        k32: u32,
        x: &Buffer,
        outs: [(&Buffer, &Buffer); 2],
        (each, summed): (IdFused<'_>, IdFused<'_>),
        y: &Buffer,
    ) -> Result<()> {
        let mut halves = vec![(self.slot_stacks(), 0, outs[0])];
        if let (Some(stacks), Some(rank)) = (self.host_stacks(), host_rank) {
            halves.push((stacks, rank, outs[1]));
        }
        for &(stacks, rank, out) in &halves {
            self.record_gate_up(rec, stacks, (route, rank), k32, x, out, each)?;
        }
        let ff32 = self.n_ff as u32;
        for &(stacks, rank, (gate_out, _)) in &halves {
            let (ids, input) = ((route, rank), (gate_out, ff32));
            rec.matvec_id_fused(stacks.down, self.n_embd, ids, k32, input, (y, 0), summed)?;
        }
        Ok(())
    }

    /// Experts in a gate stack (with the up stack after it where `with_up`).
    fn gate_stack_experts(&self, gate: &GpuMatrix, with_up: bool) -> usize {
        gate.n_out / self.n_ff / if with_up { 2 } else { 1 }
    }

    /// The gate, up and SwiGLU of the k experts (of each token, with `each.tokens`) of `stacks`
    /// whose ids `ids` lists, from `x` with what `each` fuses, into `gate_out` (`up_out` holding
    /// the up products where the up stack is apart).
    #[allow(clippy::too_many_arguments)]
    fn record_gate_up(
        &self,
        rec: &mut Recorder<'_>,
        stacks: Stacks<'_>,
        ids: (&Buffer, u32),
        k32: u32,
        x: &Buffer,
        (gate_out, up_out): (&Buffer, &Buffer),
        each: IdFused<'_>,
    ) -> Result<()> {
        let (ff, ff32) = (self.n_ff, self.n_ff as u32);
        match stacks.up {
            None => {
                let glu = IdFused {
                    glu_up_rows: Some(stacks.n * ff),
                    ..each
                };
                rec.matvec_id_fused(stacks.gate, ff, ids, k32, (x, 0), (gate_out, ff32), glu)
            }
            Some(up) => {
                rec.matvec_id_fused(stacks.gate, ff, ids, k32, (x, 0), (gate_out, ff32), each)?;
                rec.matvec_id_fused(up, ff, ids, k32, (x, 0), (up_out, ff32), each)?;
                let n_tok = each.tokens.map_or(1, |t| t.n);
                rec.swiglu(gate_out, up_out, n_tok * k32 * ff32)
            }
        }
    }

    /// The k experts whose slots `route` holds, from `xn`, each expert's products one dispatch
    /// for all k, added to `x` one after another with their weights from `route`, then the
    /// shared expert with its gate from `route`: the sums [`GpuMoe::record_experts`] makes, bit
    /// for bit, which a chained step ([`super::chain`]) must match.
    fn record_indexed(
        &self,
        rec: &mut Recorder<'_>,
        k: usize,
        (xn, x): (&Buffer, &Buffer),
        route: &Buffer,
        s: &MoeScratch,
    ) -> Result<()> {
        let (ff, n_embd) = (self.n_ff, self.n_embd);
        let (k32, ff32, e32) = (k as u32, ff as u32, n_embd as u32);
        let ids = (route, 0);
        let (up, up_first) = self.up_rows();
        let up_stack = IdFused {
            first_row: up_first,
            ..IdFused::default()
        };
        rec.matvec_id(&self.gate, ff, ids, k32, (xn, 0), (&s.gate_all, ff32))?;
        let up_out = (&s.up_all, ff32);
        rec.matvec_id_fused(up, ff, ids, k32, (xn, 0), up_out, up_stack)?;
        rec.swiglu(&s.gate_all, &s.up_all, k32 * ff32)?;
        let down_in = (&s.gate_all, ff32);
        rec.matvec_id(&self.down, n_embd, ids, k32, down_in, (&s.out_all, e32))?;
        rec.scale_add_routed(x, (&s.out_all, e32), (route, k32, k32), e32)?;
        self.add_shared(rec, k32, x, route, s)
    }

    /// The shared expert's output (Qwen2-MoE) added to `x` with its gate from `route`.
    fn add_shared(
        &self,
        rec: &mut Recorder<'_>,
        k32: u32,
        x: &Buffer,
        route: &Buffer,
        s: &MoeScratch,
    ) -> Result<()> {
        if self.shared.is_some() {
            let e32 = self.n_embd as u32;
            rec.scale_add_routed(x, (&s.shared_out, 0), (route, 2 * k32, 1), e32)?;
        }
        Ok(())
    }

    /// The routing [`GpuMoe::record_routed`] logged for layer `layer`, from its part of the
    /// log ([`MoeScratch::read_log`]).
    pub(super) fn logged_routing(
        &self,
        layer: usize,
        cfg: &MoeConfig,
        log: &[f32],
    ) -> LayerRouting {
        let (n, k) = (cfg.n_expert, cfg.n_expert_used);
        let (router_logits, routing) = log[..route_log_floats(n, k)].split_at(n);
        LayerRouting {
            layer,
            router_logits: router_logits.to_vec(),
            experts: (0..k)
                .map(|r| RoutedExpert {
                    expert: routing[r].to_bits() as usize,
                    weight: routing[k + r],
                })
                .collect(),
            shared_gate: self.shared.as_ref().map(|_| routing[2 * k]),
        }
    }

    /// The shared expert's hidden width (0 without one).
    pub(super) fn shared_ff(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.gate.n_out)
    }

    /// Part 1: router logits of `xn` into the host-visible scratch, and the shared expert's
    /// output and gate logit. The caller submits after this and calls [`GpuMoe::route`].
    pub(super) fn record_router(
        &self,
        rec: &mut Recorder<'_>,
        xn: &Buffer,
        s: &MoeScratch,
    ) -> Result<()> {
        rec.matvec(&self.router, xn, &s.router_logits)?;
        if let Some(sh) = &self.shared {
            rec.matvec(&sh.gate_inp, xn, &s.shared_logit)?;
            let ff = sh.gate.n_out as u32;
            rec.matvec(&sh.gate, xn, &s.shared_gate)?;
            rec.matvec(&sh.up, xn, &s.shared_up)?;
            rec.swiglu(&s.shared_gate, &s.shared_up, ff)?;
            rec.matvec(&sh.down, &s.shared_gate, &s.shared_out)?;
        }
        Ok(())
    }

    /// The routing of the logits [`GpuMoe::record_router`] left, once its submission has
    /// completed.
    pub(super) fn route(&self, layer: usize, cfg: &MoeConfig, s: &MoeScratch) -> LayerRouting {
        let router_logits = s.router_logits.read_f32(cfg.n_expert);
        LayerRouting {
            layer,
            experts: route(cfg, &router_logits),
            router_logits,
            shared_gate: self
                .shared
                .as_ref()
                .map(|_| shared_expert_gate(s.shared_logit.read_f32(1)[0])),
        }
    }

    /// Part 2: the experts in `experts`' slots (some or all of a routing's) from `xn`, each
    /// added to `x` with its weight in the order given, then the shared expert with
    /// `shared_gate`, as the CPU sums them. Call [`Recorder::after_earlier_submissions`] first.
    pub(super) fn record_experts(
        &self,
        rec: &mut Recorder<'_>,
        experts: &[SlotExpert],
        shared_gate: Option<f32>,
        (xn, x): (&Buffer, &Buffer),
        s: &MoeScratch,
    ) -> Result<()> {
        assert!(experts.len() <= s.out.len(), "more experts than ranks");
        let (ff, n_embd) = (self.n_ff, self.n_embd);
        let (up, up_first) = self.up_rows();
        for (r, ex) in experts.iter().enumerate() {
            let first = ex.slot * ff;
            rec.matvec_rows(&self.gate, first, ff, xn, &s.gate[r])?;
            rec.matvec_rows(up, up_first + first, ff, xn, &s.up[r])?;
        }
        for r in 0..experts.len() {
            rec.swiglu(&s.gate[r], &s.up[r], ff as u32)?;
        }
        for (r, ex) in experts.iter().enumerate() {
            let first = ex.slot * n_embd;
            rec.matvec_rows(&self.down, first, n_embd, &s.gate[r], &s.out[r])?;
        }
        for (r, ex) in experts.iter().enumerate() {
            rec.scale_add(x, &s.out[r], ex.weight, n_embd as u32)?;
        }
        if let Some(g) = shared_gate {
            rec.scale_add(x, &s.shared_out, g, n_embd as u32)?;
        }
        Ok(())
    }
}

impl GpuMoe {
    /// `n_expert` rows, F32: the router.
    pub(super) fn router(&self) -> &GpuMatrix {
        &self.router
    }

    /// The shared expert's gate (`[n_embd, 1]`), where the layer has one.
    pub(super) fn shared_gate_inp(&self) -> Option<&GpuMatrix> {
        self.shared.as_ref().map(|s| &s.gate_inp)
    }

    /// Slots of each of gate, up and down.
    pub(super) fn n_slots(&self) -> usize {
        self.n_slots
    }
}

impl MoeScratch {
    /// The log of the first `n_layer` layers' routings on the device, [`route_log_floats`]
    /// per layer, once the step's submission has completed.
    pub(super) fn read_log(&self, cfg: &MoeConfig, n_layer: usize) -> Vec<f32> {
        self.log
            .read_f32(n_layer * route_log_floats(cfg.n_expert, cfg.n_expert_used))
    }

    /// Scratch for `n_layer` layers of `cfg` with experts of `n_embd` outputs and a shared
    /// expert of `shared_ff` hidden rows (0: none).
    /// With `host_experts`, room for the experts read from system RAM and the slot map.
    pub(super) fn new(
        alloc: &Arc<Allocator>,
        cfg: &MoeConfig,
        (n_layer, n_embd, shared_ff): (usize, usize, usize),
        host_experts: bool,
    ) -> Result<MoeScratch> {
        let k = cfg.n_expert_used;
        let f32s = |n: usize| Buffer::new_in(alloc, n as u64 * 4, MemoryUse::DeviceLocal);
        let ranks =
            |n: usize| -> Result<Vec<Buffer>> { (0..cfg.n_expert_used).map(|_| f32s(n)).collect() };
        Ok(MoeScratch {
            router_logits: Buffer::new_in(alloc, cfg.n_expert as u64 * 4, MemoryUse::Staging)?,
            shared_logit: Buffer::new_in(alloc, 4, MemoryUse::Staging)?,
            xn_host: Buffer::new_in(alloc, n_embd as u64 * 4, MemoryUse::Staging)?,
            cpu_sum: Buffer::new_in(alloc, n_embd as u64 * 4, MemoryUse::Staging)?,
            route_host: Buffer::new_in(
                alloc,
                route_split_floats(k) as u64 * 4,
                MemoryUse::Staging,
            )?,
            gate: ranks(cfg.n_ff_expert)?,
            up: ranks(cfg.n_ff_expert)?,
            out: ranks(n_embd)?,
            shared_gate: f32s(shared_ff)?,
            shared_up: f32s(shared_ff)?,
            shared_out: f32s(if shared_ff > 0 { n_embd } else { 0 })?,
            router_dev: f32s(cfg.n_expert)?,
            router_done: zeroed_counters(alloc, 1)?,
            shared_logit_dev: f32s(1)?,
            route: f32s(route_split_floats(k))?,
            log: Buffer::new_in(
                alloc,
                (n_layer * route_log_floats(cfg.n_expert, k)) as u64 * 4,
                MemoryUse::Staging,
            )?,
            gate_all: f32s(k * cfg.n_ff_expert)?,
            up_all: f32s(k * cfg.n_ff_expert)?,
            out_all: f32s(k * n_embd)?,
            gate_host: f32s(if host_experts { k * cfg.n_ff_expert } else { 0 })?,
            up_host: f32s(if host_experts { k * cfg.n_ff_expert } else { 0 })?,
            slot_map: if host_experts {
                let words = (n_layer * cfg.n_expert) as u64;
                Some(Buffer::new_in(alloc, words * 4, MemoryUse::DeviceMapped)?)
            } else {
                None
            },
        })
    }

    /// The slot map, where experts are read from system RAM.
    pub(super) fn slot_map(&self) -> Option<&Buffer> {
        self.slot_map.as_ref()
    }

    /// Writes layer `layer`'s part of the slot map: `slot_of[e]`, the slot of expert `e`.
    /// Only between steps: a step reads it while it runs.
    pub(super) fn write_slot_map(&mut self, layer: usize, slot_of: &[Option<usize>]) {
        let map = self
            .slot_map
            .as_mut()
            .expect("a slot map where experts are read from system RAM");
        let at = layer * slot_of.len() * 4;
        let bytes = &mut map.bytes_mut()[at..at + slot_of.len() * 4];
        for (w, s) in bytes.chunks_exact_mut(4).zip(slot_of) {
            w.copy_from_slice(&s.map_or(u32::MAX, |s| s as u32).to_le_bytes());
        }
    }
}
