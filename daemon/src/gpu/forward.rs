//! A model's decode step on the GPU: every weight uploaded to device-local memory once,
//! the KV cache kept there in f16, and each token's whole forward pass (embedding, every layer,
//! output norm and head) recorded into one command buffer, with barriers only where a dispatch
//! reads what an earlier one wrote. It follows `engine::forward` operation by operation, so its
//! logits track the CPU engine's; it differs in that activations stay f32 in the matrix-vector
//! products (the CPU quantizes them to Q8_0/Q8_K, as ggml's CPU backend does).
//!
//! MoE layers (`qwen2moe`, `qwen3moe`, Mixtral-style `llama`) are in [`super::moe`]: the step
//! is then one command buffer per MoE layer plus one, since the routing is decided on the host
//! from the router logits read back.
//!
//! Partial: one token per step (prompts go token by token), every weight must fit the VRAM
//! budget (no streaming, no expert offloading yet).

use std::sync::Arc;

use super::alloc::{Allocator, MemoryUse};
use super::buffer::Buffer;
use super::device::Device;
use super::error::{GpuError, Result};
use super::footprint::{device_bytes, DeviceBytes};
use super::moe::{GpuMoe, LayerRouting, MoeScratch};
use super::ops::{rope_table, upload_f32, AttentionArgs, GpuMatrix, RopeArgs};
use super::record::{Kernels, RecordStats, Recorder};
use super::upload::{Uploader, DEFAULT_STAGING_BYTES};
use crate::model::{Config, Ffn, Matrix, Model};

/// Settings of a [`GpuModel`].
#[derive(Debug, Clone, Default)]
pub struct GpuModelOptions {
    /// Hard ceiling on device memory held (`--vram-budget`); `None`: the device's own.
    pub vram_budget: Option<u64>,
    /// KV cache positions; 0 means the model's context length, capped at 4096.
    pub context: usize,
}

struct GpuLayer {
    attn_norm: Buffer,
    wq: GpuMatrix,
    wk: GpuMatrix,
    wv: GpuMatrix,
    wo: GpuMatrix,
    bq: Option<Buffer>,
    bk: Option<Buffer>,
    bv: Option<Buffer>,
    q_norm: Option<Buffer>,
    k_norm: Option<Buffer>,
    ffn_norm: Buffer,
    ffn: GpuFfn,
    k_cache: Buffer,
    v_cache: Buffer,
}

// One per layer, built once: the size difference between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
enum GpuFfn {
    Dense {
        gate: GpuMatrix,
        up: GpuMatrix,
        down: GpuMatrix,
    },
    Moe(GpuMoe),
}

/// Activations of one token, reused by every layer.
struct Activations {
    x: Buffer,
    xn: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    attn: Buffer,
    proj: Buffer,
    gate: Buffer,
    up: Buffer,
    ffn_out: Buffer,
    scores: Buffer,
    /// Host-visible, read back after each step.
    logits: Buffer,
    /// Present when the model has MoE layers.
    moe: Option<MoeScratch>,
}

/// A model resident on one GPU, with one sequence's KV cache.
pub struct GpuModel {
    kernels: Arc<Kernels>,
    allocator: Arc<Allocator>,
    config: Config,
    token_embd: GpuMatrix,
    /// `None` when the output is tied to the embedding.
    output: Option<GpuMatrix>,
    output_norm: Buffer,
    layers: Vec<GpuLayer>,
    rope: Buffer,
    act: Activations,
    capacity: usize,
    pos: usize,
    last_stats: RecordStats,
    last_routing: Vec<LayerRouting>,
}

fn matrix(
    model: &Model,
    alloc: &Arc<Allocator>,
    up: &mut Uploader,
    m: &Matrix,
) -> Result<GpuMatrix> {
    let r = model.mat(m);
    GpuMatrix::upload(alloc, up, r.ty, r.n_in, r.n_out, r.data)
}

fn opt_vec(
    alloc: &Arc<Allocator>,
    up: &mut Uploader,
    v: &Option<Vec<f32>>,
) -> Result<Option<Buffer>> {
    v.as_deref().map(|v| upload_f32(alloc, up, v)).transpose()
}

impl GpuModel {
    /// Device memory `model` would take with `options`, before any upload.
    pub fn device_bytes(model: &Model, options: &GpuModelOptions) -> DeviceBytes {
        device_bytes(model, Self::capacity_for(&model.config, options))
    }

    fn capacity_for(c: &Config, options: &GpuModelOptions) -> usize {
        match options.context {
            0 => c.context_length.min(4096),
            n => n,
        }
    }

    /// Uploads `model`'s weights to `device` and makes room for `options.context` positions.
    /// A model that cannot fit `options.vram_budget` is refused before anything is uploaded
    /// ([`GpuError::ModelOverBudget`]).
    pub fn new(device: &Arc<Device>, model: &Model, options: &GpuModelOptions) -> Result<GpuModel> {
        let c = model.config.clone();
        let capacity = Self::capacity_for(&c, options);
        let needed = device_bytes(model, capacity);
        if let Some(budget) = options.vram_budget.filter(|&b| needed.total() > b) {
            return Err(GpuError::ModelOverBudget {
                needed: needed.total(),
                budget,
            });
        }
        let allocator = Allocator::new(device, options.vram_budget);
        let kernels = Kernels::new(device);
        let mut up = Uploader::new(&allocator, DEFAULT_STAGING_BYTES.min(16 << 20))?;
        let al = &allocator;
        let token_embd = matrix(model, al, &mut up, &model.token_embd)?;
        let output = if model.output == model.token_embd {
            None
        } else {
            Some(matrix(model, al, &mut up, &model.output)?)
        };
        let output_norm = upload_f32(al, &mut up, &model.output_norm)?;
        let kv_bytes = (capacity * c.kv_width() * 2) as u64;
        let mut layers = Vec::with_capacity(c.n_layer);
        for layer in &model.layers {
            let ffn = match &layer.ffn {
                Ffn::Dense {
                    gate,
                    up: w_up,
                    down,
                } => GpuFfn::Dense {
                    gate: matrix(model, al, &mut up, gate)?,
                    up: matrix(model, al, &mut up, w_up)?,
                    down: matrix(model, al, &mut up, down)?,
                },
                Ffn::Moe(moe) => GpuFfn::Moe(GpuMoe::upload(model, al, &mut up, moe)?),
            };
            let a = &layer.attn;
            layers.push(GpuLayer {
                attn_norm: upload_f32(al, &mut up, &a.norm)?,
                wq: matrix(model, al, &mut up, &a.wq)?,
                wk: matrix(model, al, &mut up, &a.wk)?,
                wv: matrix(model, al, &mut up, &a.wv)?,
                wo: matrix(model, al, &mut up, &a.wo)?,
                bq: opt_vec(al, &mut up, &a.bq)?,
                bk: opt_vec(al, &mut up, &a.bk)?,
                bv: opt_vec(al, &mut up, &a.bv)?,
                q_norm: opt_vec(al, &mut up, &a.q_norm)?,
                k_norm: opt_vec(al, &mut up, &a.k_norm)?,
                ffn_norm: upload_f32(al, &mut up, &layer.ffn_norm)?,
                ffn,
                k_cache: Buffer::new_in(al, kv_bytes, MemoryUse::DeviceLocal)?,
                v_cache: Buffer::new_in(al, kv_bytes, MemoryUse::DeviceLocal)?,
            });
            // Bounds the staging memory the pending copies pin to one layer's worth.
            up.flush()?;
        }
        let table = rope_table(
            capacity,
            c.n_rot,
            c.rope_freq_base,
            c.rope_freq_scale,
            model.rope_freqs.as_deref(),
        );
        let rope = upload_f32(al, &mut up, &table)?;
        up.flush()?;
        let f32s = |n: usize| Buffer::new_in(al, n as u64 * 4, MemoryUse::DeviceLocal);
        let mut dense_ff = 0;
        let mut shared_ff = 0;
        for l in &layers {
            match &l.ffn {
                GpuFfn::Dense { gate, .. } => dense_ff = dense_ff.max(gate.n_out),
                GpuFfn::Moe(m) => shared_ff = shared_ff.max(m.shared_ff()),
            }
        }
        let moe = match &c.moe {
            Some(cfg) => Some(MoeScratch::new(al, cfg, c.n_embd, shared_ff)?),
            None => None,
        };
        let act = Activations {
            x: f32s(c.n_embd)?,
            xn: f32s(c.n_embd)?,
            q: f32s(c.q_width())?,
            k: f32s(c.kv_width())?,
            v: f32s(c.kv_width())?,
            attn: f32s(c.q_width())?,
            proj: f32s(c.n_embd)?,
            gate: f32s(dense_ff)?,
            up: f32s(dense_ff)?,
            ffn_out: f32s(c.n_embd)?,
            scores: f32s(c.n_head * capacity)?,
            logits: Buffer::new_in(al, c.n_vocab as u64 * 4, MemoryUse::Staging)?,
            moe,
        };
        drop(up);
        Ok(GpuModel {
            kernels,
            allocator,
            config: c,
            token_embd,
            output,
            output_norm,
            layers,
            rope,
            act,
            capacity,
            pos: 0,
            last_stats: RecordStats::default(),
            last_routing: Vec::new(),
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    /// Forgets the sequence (the cache is overwritten from position 0).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Device memory held, budget included.
    pub fn allocator(&self) -> &Arc<Allocator> {
        &self.allocator
    }

    /// Dispatches and barriers of the last step.
    pub fn last_stats(&self) -> RecordStats {
        self.last_stats
    }

    /// The routing of every MoE layer in the last step, in layer order (empty for dense
    /// models).
    pub fn last_routing(&self) -> &[LayerRouting] {
        &self.last_routing
    }

    /// Evaluates `token` at the next position; the logits of the token after it.
    pub fn eval(&mut self, token: u32) -> Result<Vec<f32>> {
        let c = &self.config;
        if token as usize >= c.n_vocab {
            return Err(GpuError::Unsupported(format!(
                "token {token} is outside the vocabulary of {}",
                c.n_vocab
            )));
        }
        if self.pos >= self.capacity {
            return Err(GpuError::Unsupported(format!(
                "the context of {} positions is full",
                self.capacity
            )));
        }
        let (a, e, eps) = (&self.act, c.n_embd as u32, c.rms_eps);
        let mut stats = RecordStats::default();
        // After a MoE layer's router, the next command buffer starts with its experts.
        let mut routings: Vec<LayerRouting> = Vec::new();
        loop {
            let mut paused_at = None;
            let part = self.kernels.record(|rec| {
                let from = match routings.last() {
                    None => {
                        rec.get_rows(&self.token_embd, token, &a.x)?;
                        0
                    }
                    Some(routing) => {
                        rec.after_earlier_submissions();
                        let moe = self.moe_layer(routing.layer);
                        // Every routed expert runs here; a placement would pass only those
                        // resident on the GPU and add the others' outputs from elsewhere.
                        moe.record_experts(
                            rec,
                            &routing.experts,
                            routing.shared_gate,
                            (&a.xn, &a.x),
                            self.moe_scratch(),
                        )?;
                        routing.layer + 1
                    }
                };
                for (il, l) in self.layers.iter().enumerate().skip(from) {
                    self.record_attention(rec, l)?;
                    rec.rms_norm(&a.x, &l.ffn_norm, &a.xn, e, 1, eps)?;
                    match &l.ffn {
                        GpuFfn::Dense { gate, up, down } => {
                            rec.matvec(gate, &a.xn, &a.gate)?;
                            rec.matvec(up, &a.xn, &a.up)?;
                            rec.swiglu(&a.gate, &a.up, gate.n_out as u32)?;
                            rec.matvec(down, &a.gate, &a.ffn_out)?;
                            rec.add(&a.x, &a.ffn_out, e)?;
                        }
                        GpuFfn::Moe(moe) => {
                            moe.record_router(rec, &a.xn, self.moe_scratch())?;
                            paused_at = Some(il);
                            return Ok(());
                        }
                    }
                }
                rec.rms_norm(&a.x, &self.output_norm, &a.xn, e, 1, eps)?;
                let head = self.output.as_ref().unwrap_or(&self.token_embd);
                rec.matvec(head, &a.xn, &a.logits)
            })?;
            stats.dispatches += part.dispatches;
            stats.barriers += part.barriers;
            let Some(il) = paused_at else { break };
            let cfg = c.moe.as_ref().expect("MoE layers have a MoE config");
            routings.push(self.moe_layer(il).route(il, cfg, self.moe_scratch()));
        }
        self.last_stats = stats;
        self.last_routing = routings;
        self.pos += 1;
        Ok(self.act.logits.read_f32(self.config.n_vocab))
    }

    /// Attention of layer `l` at the current position, its output added to `x`.
    fn record_attention(&self, rec: &mut Recorder<'_>, l: &GpuLayer) -> Result<()> {
        let (c, a) = (&self.config, &self.act);
        let pos = self.pos as u32;
        let (e, qw, kvw) = (c.n_embd as u32, c.q_width() as u32, c.kv_width() as u32);
        let eps = c.rms_eps;
        let rope = |n_heads: usize| RopeArgs {
            layout: c.rope_layout,
            n_heads: n_heads as u32,
            head_dim: c.head_dim as u32,
            n_rot: c.n_rot as u32,
            pos,
            eps,
        };
        let attn_args = AttentionArgs {
            n_heads: c.n_head as u32,
            n_kv_heads: c.n_head_kv as u32,
            head_dim: c.head_dim as u32,
            n_kv: pos + 1,
            scores_stride: self.capacity as u32,
        };
        rec.rms_norm(&a.x, &l.attn_norm, &a.xn, e, 1, eps)?;
        rec.matvec(&l.wq, &a.xn, &a.q)?;
        rec.matvec(&l.wk, &a.xn, &a.k)?;
        rec.matvec(&l.wv, &a.xn, &a.v)?;
        for (x, b, n) in [(&a.q, &l.bq, qw), (&a.k, &l.bk, kvw), (&a.v, &l.bv, kvw)] {
            if let Some(b) = b {
                rec.add(x, b, n)?;
            }
        }
        rec.rope(&a.q, l.q_norm.as_ref(), &self.rope, rope(c.n_head))?;
        rec.rope(&a.k, l.k_norm.as_ref(), &self.rope, rope(c.n_head_kv))?;
        rec.kv_store((&a.k, &a.v), (&l.k_cache, &l.v_cache), kvw, pos)?;
        rec.attention(
            &a.q,
            (&l.k_cache, &l.v_cache),
            &a.scores,
            &a.attn,
            attn_args,
        )?;
        rec.matvec(&l.wo, &a.attn, &a.proj)?;
        rec.add(&a.x, &a.proj, e)
    }

    fn moe_layer(&self, il: usize) -> &GpuMoe {
        match &self.layers[il].ffn {
            GpuFfn::Moe(m) => m,
            GpuFfn::Dense { .. } => unreachable!("layer {il} is dense"),
        }
    }

    fn moe_scratch(&self) -> &MoeScratch {
        self.act
            .moe
            .as_ref()
            .expect("a model with MoE layers has MoE scratch")
    }
}
