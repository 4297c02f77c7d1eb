//! The device memory a [`GpuModel`](super::forward::GpuModel) takes, computed from the model
//! before anything is uploaded, so that a model over the VRAM budget is refused with what it
//! needs rather than failing halfway through its upload. What a MoE model needs with only some
//! of its routed experts in VRAM is in [`super::placement`].

use super::ops::{attention_scratch_floats, route_floats, route_log_floats};
use crate::model::{Config, Ffn, Layer, Matrix, Model};

/// Bytes of device memory, by what they hold. Buffers are counted as allocated (whole words);
/// the driver's alignment of each buffer and the upload staging (freed once loaded) come on top.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceBytes {
    /// Weights, norms, biases and the RoPE table.
    pub weights: u64,
    /// The part of `weights` that is routed experts (the stacks of MoE layers).
    pub experts: u64,
    pub kv_cache: u64,
    /// One token's activations, MoE scratch and the host-visible logits.
    pub activations: u64,
}

impl DeviceBytes {
    pub fn total(&self) -> u64 {
        self.weights + self.kv_cache + self.activations
    }

    /// With a KV cache for each of `n` sequences instead of one.
    pub fn with_sequences(self, n: usize) -> DeviceBytes {
        DeviceBytes {
            kv_cache: self.kv_cache * n as u64,
            ..self
        }
    }
}

/// A buffer of `bytes`, as `Buffer::new_in` rounds it.
fn buffer(bytes: u64) -> u64 {
    bytes.max(4).next_multiple_of(4)
}

fn f32s(n: usize) -> u64 {
    buffer(n as u64 * 4)
}

/// Device memory of `model` with a KV cache of `capacity` positions.
pub fn device_bytes(model: &Model, capacity: usize) -> DeviceBytes {
    split_bytes(model, capacity, 0)
}

/// Device memory of `model` with its first `cpu_layers` layers on the CPU: the GPU holds the
/// later layers and their KV cache, the output norm and head, and takes each token's hidden
/// state from a host-visible buffer instead of embedding it (no embedding table unless the
/// output is tied to it).
pub fn split_bytes(model: &Model, capacity: usize, cpu_layers: usize) -> DeviceBytes {
    let c = &model.config;
    let mat = |m: &Matrix| buffer(model.stacked(m).data.len() as u64);
    let mut weights = f32s(model.output_norm.len()) + mat(&model.output);
    if cpu_layers == 0 && model.output != model.token_embd {
        weights += mat(&model.token_embd);
    }
    // The RoPE table: a cosine and a sine per rotated pair and position.
    weights += f32s(capacity * c.n_rot);
    let (mut dense_ff, mut shared_ff, mut experts) = (0, 0, 0);
    for l in &model.layers[cpu_layers..] {
        weights += attention_weights(model, l);
        weights += match &l.ffn {
            Ffn::Dense { gate, up, down } => {
                dense_ff = dense_ff.max(gate.n_out);
                mat(gate) + mat(up) + mat(down)
            }
            Ffn::Moe(m) => {
                let shared = m.shared.as_ref().map_or(0, |s| {
                    shared_ff = shared_ff.max(s.gate.n_out);
                    mat(&s.gate_inp) + mat(&s.gate) + mat(&s.up) + mat(&s.down)
                });
                let stacks = mat(&m.gate) + mat(&m.up) + mat(&m.down);
                experts += stacks;
                mat(&m.router) + stacks + shared
            }
        };
    }
    let gpu_layers = (c.n_layer - cpu_layers) as u64;
    let kv_cache = gpu_layers * 2 * buffer((capacity * c.kv_width() * 2) as u64);
    let mut activations = activation_bytes(c, capacity, dense_ff, shared_ff);
    if cpu_layers > 0 {
        // The hidden state the CPU's layers hand over.
        activations += f32s(c.n_embd);
    }
    DeviceBytes {
        weights,
        experts,
        kv_cache,
        activations,
    }
}

/// Bytes of layer `l`'s attention matrices, norms and biases.
fn attention_weights(model: &Model, l: &Layer) -> u64 {
    let mat = |m: &Matrix| buffer(model.stacked(m).data.len() as u64);
    let opt = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| f32s(v.len()));
    let a = &l.attn;
    f32s(a.norm.len())
        + f32s(l.ffn_norm.len())
        + mat(&a.wq)
        + mat(&a.wk)
        + mat(&a.wv)
        + mat(&a.wo)
        + opt(&a.bq)
        + opt(&a.bk)
        + opt(&a.bv)
        + opt(&a.q_norm)
        + opt(&a.k_norm)
}

/// Device memory of a VRAM slot that a dense model's first layers take in turn for a prompt
/// chunk (`gpu::forward::stream`): one layer's weights and KV cache of `capacity` positions,
/// the host-visible buffer a chunk's keys and values come back through, and a full prompt
/// chunk's activations, without which the slot would go unused (host-visible memory is
/// counted whether or not it is on the budget on the device).
pub fn stream_slot_bytes(model: &Model, capacity: usize) -> u64 {
    let c = &model.config;
    let l = &model.layers[0];
    let mat = |m: &Matrix| buffer(model.stacked(m).data.len() as u64);
    let mut weights = attention_weights(model, l);
    if let Ffn::Dense { gate, up, down } = &l.ffn {
        weights += mat(gate) + mat(up) + mat(down);
    }
    let kv = 2 * buffer((capacity * c.kv_width() * 2) as u64);
    // A chunk is as long as the prompt, in steps of 64 tokens.
    let tokens = crate::gpu::forward::PREFILL_CHUNK.min(capacity.next_multiple_of(64));
    let chunk = crate::gpu::forward::batch_bytes(c, tokens, capacity)
        + crate::gpu::forward::logits_bytes(c);
    weights + kv + buffer(crate::gpu::forward::readback_bytes(c.kv_width())) + chunk
}

/// Device memory of the slots a MoE model's missing experts take in turn for a prompt chunk
/// (`gpu::forward::stream_experts`): `slots` experts of the first MoE layer's shapes in each of
/// gate, up and down, that layer's router, and a full prompt chunk's activations with its MoE
/// scratch, without which the slots would go unused (their upload staging, `ExpertShape::staging_bytes_for`, is apart; so is
/// the host-visible memory of a prompt that wants every token's logits, which goes token by
/// token where the budget has no room for it).
pub fn expert_stream_bytes(model: &Model, capacity: usize, slots: usize) -> u64 {
    let Some(m) = model.layers.iter().find_map(|l| match &l.ffn {
        Ffn::Moe(m) if model.config.moe.is_some() => Some(m),
        _ => None,
    }) else {
        return 0;
    };
    let stack = |w: &Matrix| buffer(model.expert(w, 0).data.len() as u64 * slots as u64);
    let weights = stack(&m.gate) + stack(&m.up) + stack(&m.down);
    let router = buffer(model.stacked(&m.router).data.len() as u64);
    weights + router + moe_chunk_bytes(model, capacity)
}

/// Device memory of a MoE model's full prompt chunk: its activations and MoE scratch, and
/// where its MoE layers are routed on the device, the routing's own buffers (the host-visible
/// memory of a prompt that wants every token's logits is apart); 0 for a dense model.
pub fn moe_chunk_bytes(model: &Model, capacity: usize) -> u64 {
    let tokens = crate::gpu::forward::PREFILL_CHUNK.min(capacity.next_multiple_of(64));
    moe_chunk_bytes_for(model, capacity, tokens)
}

/// Device memory of a MoE model's chunk for a batched decode step of up to
/// [`MAX_MATVEC_COLS`](crate::gpu::ops_batch::MAX_MATVEC_COLS) sequences, its host-visible
/// logits and its CPU experts' scratch (the normalised rows, their sums, each token's entries)
/// included: what a model whose misses run on the CPU keeps room for when it holds several
/// sequences ([`crate::gpu::forward::GpuModel::eval_batch`]); 0 for a dense model.
pub fn moe_step_chunk_bytes(model: &Model, capacity: usize) -> u64 {
    let c = &model.config;
    let Some(cfg) = c.moe else {
        return 0;
    };
    let tokens = crate::gpu::ops_batch::MAX_MATVEC_COLS as usize;
    let logits = buffer((tokens * c.n_vocab * 4) as u64);
    let cpu = 2 * buffer((tokens * c.n_embd * 4) as u64)
        + buffer((tokens * 2 * cfg.n_expert_used * 4) as u64);
    moe_chunk_bytes_for(model, capacity, tokens) + logits + cpu
}

/// [`moe_chunk_bytes`] for a chunk of `tokens` tokens.
fn moe_chunk_bytes_for(model: &Model, capacity: usize, tokens: usize) -> u64 {
    let c = &model.config;
    let Some(cfg) = c.moe else {
        return 0;
    };
    let chunk = crate::gpu::forward::batch_bytes(c, tokens, capacity);
    // Gathered rows, gate, up and output of a group's entries, the rows to gather from, the
    // router logits read back and the routing (token ids and weights); routed on the device,
    // the logits there, each token's choice and each layer's counts.
    let (e, ff, k) = (c.n_embd, cfg.n_ff_expert, cfg.n_expert_used);
    let rows = crate::gpu::forward::moe_rows(c, tokens) as u64;
    let moe = tokens as u64 * 4 * (e + cfg.n_expert + 2 * k) as u64
        + rows * 4 * (2 * e + 2 * ff) as u64
        + 4 * crate::gpu::moe_groups::route_words_for(tokens, k, cfg.n_expert) as u64;
    let routed = 4 * (tokens * (cfg.n_expert + 2 * k) + c.n_layer * cfg.n_expert) as u64;
    chunk + moe + routed
}

/// The buffers `GpuModel::new` makes for one token's activations (and MoE scratch).
fn activation_bytes(c: &Config, capacity: usize, dense_ff: usize, shared_ff: usize) -> u64 {
    let (e, qw, kvw) = (c.n_embd, c.q_width(), c.kv_width());
    let mut n = 2 * f32s(e) + 2 * f32s(qw) + 2 * f32s(kvw) + 2 * f32s(dense_ff);
    n += f32s(attention_scratch_floats(c.n_head, c.head_dim, capacity)) + f32s(c.n_vocab);
    // The attention's counters, one per head.
    n += f32s(c.n_head);
    // The step buffer: the token id and its position.
    n += f32s(2);
    if let Some(m) = &c.moe {
        // Router logits, the shared gate's logit, the host-visible copy of the layer's input,
        // the CPU experts' sum and a routing the host decided.
        n += f32s(m.n_expert) + f32s(1) + 2 * f32s(e) + f32s(route_floats(m.n_expert_used));
        n += m.n_expert_used as u64 * (2 * f32s(m.n_ff_expert) + f32s(e));
        n += 2 * f32s(shared_ff) + f32s(if shared_ff > 0 { e } else { 0 });
        // Routing on the device: logits, shared logit, the routing, every layer's log, and the
        // k experts' gate, up and output side by side.
        let k = m.n_expert_used;
        n += f32s(m.n_expert) + f32s(1) + f32s(route_floats(k));
        // The counter of the router's and routing's dispatch.
        n += f32s(1);
        n += f32s(c.n_layer * route_log_floats(m.n_expert, k));
        n += 2 * f32s(k * m.n_ff_expert) + f32s(k * e);
    }
    n
}
