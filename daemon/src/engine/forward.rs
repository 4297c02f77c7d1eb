//! The forward pass over a batch of consecutive tokens: embedding, then per layer attention
//! and FFN (dense or routed experts) with residuals, then the output norm and head. It follows
//! llama.cpp's graphs (`llm_build_llama`, `llm_build_qwen2`, `llm_build_qwen2moe`,
//! `llm_build_qwen3`, `llm_build_qwen3moe`) operation by operation.
//!
//! Decoding one sequence is a batch of one. A longer batch (a prompt, or one token of each of
//! several sequences decoding together, see `batch`) multiplies every weight matrix with all its
//! tokens at once; each token's arithmetic is the same as alone, so batching changes speed, not
//! results. Every token carries its own sequence (whose KV cache it reads and appends to) and
//! position.
//!
//! An optional [`StepProfile`] times every op group of every layer (see `profile`); without one
//! nothing is timed.

use half::f16;

use crate::cpu::attn::{dot_f32_f16_with, weighted_sum_f16_with};
use crate::cpu::{activations, matmul, matmul_group, ActFormat, Isa, Product, ThreadPool};
use crate::model::{Attention, Ffn, Matrix, Model, ModelError, MoeWeights};
use crate::stream::StreamError;

use super::experts::routed_experts;
use super::kv_cache::KvCache;
use super::ops::{
    add_inplace, rms_norm, rms_norm_inplace, rope_cache, rope_head, softmax, swiglu_inplace,
};
use super::profile::{Laps, OpGroup, StepProfile};
use super::ram_experts::RamExperts;
use super::routing::{route, shared_expert_gate};
use super::row_help::{shared_rows, LayerProducts, RowHelper};
use super::EngineError;

/// RoPE angles of every token of a batch: `half` cosines and sines per token.
struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl Rope {
    fn new(model: &Model, positions: &[usize]) -> Rope {
        let c = &model.config;
        let half = c.n_rot / 2;
        let n = positions.len();
        let (mut cos, mut sin) = (vec![0.0; n * half], vec![0.0; n * half]);
        for (b, &pos) in positions.iter().enumerate() {
            let r = b * half..(b + 1) * half;
            rope_cache(
                pos,
                c.n_rot,
                c.rope_freq_base,
                c.rope_freq_scale,
                model.rope_freqs.as_deref(),
                &mut cos[r.clone()],
                &mut sin[r],
            );
        }
        Rope { cos, sin, half }
    }

    fn token(&self, b: usize) -> (&[f32], &[f32]) {
        let r = b * self.half..(b + 1) * self.half;
        (&self.cos[r.clone()], &self.sin[r])
    }
}

/// Runs `tokens` at positions `start..start + tokens.len()` of one sequence through `model`,
/// writing the next-token logits of every token (`all_logits`) or of the last one into
/// `logits`. The caller has checked the positions against the cache and the token ids.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    model: &Model,
    pool: &ThreadPool,
    ram: Option<&RamExperts>,
    kv: &mut KvCache,
    tokens: &[u32],
    start: usize,
    all_logits: bool,
    logits: &mut Vec<f32>,
    profile: Option<&mut StepProfile>,
) -> Result<(), EngineError> {
    let slots: Vec<Slot> = (0..tokens.len())
        .map(|b| Slot {
            seq: 0,
            pos: start + b,
        })
        .collect();
    let rows: Vec<usize> = if all_logits {
        (0..tokens.len()).collect()
    } else {
        vec![tokens.len() - 1]
    };
    forward_slots(
        model,
        pool,
        ram,
        &mut [kv],
        tokens,
        &slots,
        &rows,
        logits,
        profile,
    )
}

/// Where one token of a batch belongs: its sequence (an index into the caches) and position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    pub seq: usize,
    pub pos: usize,
}

/// Runs a batch of tokens, each at its own sequence and position, through `model`, writing the
/// next-token logits of the tokens at `rows` (batch indices, in that order) into `logits`.
/// Within a sequence the batch's positions must be consecutive and follow what its cache holds;
/// the caller has checked them and the token ids.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_slots(
    model: &Model,
    pool: &ThreadPool,
    ram: Option<&RamExperts>,
    caches: &mut [&mut KvCache],
    tokens: &[u32],
    slots: &[Slot],
    rows: &[usize],
    logits: &mut Vec<f32>,
    profile: Option<&mut StepProfile>,
) -> Result<(), EngineError> {
    let mut laps = Laps(profile);
    laps.mark();
    let c = &model.config;
    let (n, e) = (tokens.len(), c.n_embd);
    let mut x = vec![0.0f32; n * e];
    for (row, &t) in x.chunks_exact_mut(e).zip(tokens) {
        model.embed(t, row)?;
    }
    let positions: Vec<usize> = slots.iter().map(|s| s.pos).collect();
    let rope = Rope::new(model, &positions);
    laps.lap(None, OpGroup::Embedding, || {
        n as u64 * model.token_embd.row_bytes()
    });
    let n_layers = model.layers.len();
    run_layers(
        model, pool, ram, None, caches, &mut x, slots, &rope, n_layers, &mut laps,
    )?;
    let mut out_rows = Vec::with_capacity(rows.len() * e);
    for &b in rows {
        let mut row = x[b * e..(b + 1) * e].to_vec();
        rms_norm_inplace(&mut row, &model.output_norm, c.rms_eps);
        out_rows.extend_from_slice(&row);
    }
    logits.clear();
    logits.resize(rows.len() * c.n_vocab, 0.0);
    matmul(pool, model.mat(&model.output), &out_rows, logits);
    laps.lap(None, OpGroup::OutputHead, || model.output.bytes());
    Ok(())
}

/// The hidden states of `tokens` (one sequence, at positions `start..`) after the first
/// `n_layers` layers, `n_embd` floats per token, their keys and values stored in `kv`: the
/// CPU's share of a dense model whose later layers run on the GPU. The caller has checked the
/// positions against the cache and the token ids.
pub fn hidden_after(
    model: &Model,
    pool: &ThreadPool,
    kv: &mut KvCache,
    tokens: &[u32],
    start: usize,
    n_layers: usize,
    help: Option<&mut (dyn RowHelper + 'static)>,
) -> Result<Vec<f32>, ModelError> {
    let e = model.config.n_embd;
    let mut x = vec![0.0f32; tokens.len() * e];
    for (row, &t) in x.chunks_exact_mut(e).zip(tokens) {
        model.embed(t, row)?;
    }
    let slots: Vec<Slot> = (0..tokens.len())
        .map(|b| Slot {
            seq: 0,
            pos: start + b,
        })
        .collect();
    let positions: Vec<usize> = slots.iter().map(|s| s.pos).collect();
    let rope = Rope::new(model, &positions);
    let caches = &mut [kv];
    run_layers(
        model,
        pool,
        None,
        help,
        caches,
        &mut x,
        &slots,
        &rope,
        n_layers,
        &mut Laps(None),
    )
    .expect("without a RAM tier no expert is read from the file");
    Ok(x)
}

/// The first `n_layers` layers over the hidden states `x` (a row per token of `slots`, whose
/// RoPE angles `rope` holds); routed experts come from `ram` when given, else the map; `help`
/// computes the last rows of dense layers' products in passes of one token.
///
/// # Errors
/// A routed expert could not be read from the file (under a RAM tier).
#[allow(clippy::too_many_arguments)]
fn run_layers(
    model: &Model,
    pool: &ThreadPool,
    ram: Option<&RamExperts>,
    mut help: Option<&mut (dyn RowHelper + 'static)>,
    caches: &mut [&mut KvCache],
    x: &mut [f32],
    slots: &[Slot],
    rope: &Rope,
    n_layers: usize,
    laps: &mut Laps<'_>,
) -> Result<(), StreamError> {
    let c = &model.config;
    let mut xn = vec![0.0f32; x.len()];
    for (il, layer) in model.layers.iter().enumerate().take(n_layers) {
        let a = &layer.attn;
        norm_rows(x, &a.norm, c.rms_eps, &mut xn);
        let proj = attention(
            model,
            (pool, help.as_deref_mut()),
            caches,
            a,
            il,
            slots,
            &xn,
            rope,
            laps,
        );
        add_inplace(x, &proj);
        laps.lap(Some(il), OpGroup::AttnOutput, || a.wo.bytes());

        let next = match ram {
            Some(ram) if ram.predicts() && il + 1 < n_layers => {
                predict_experts(model, pool, il + 1, x)
            }
            _ => Vec::new(),
        };
        norm_rows(x, &layer.ffn_norm, c.rms_eps, &mut xn);
        match &layer.ffn {
            Ffn::Dense { gate, up, down } => {
                let help = (help.as_deref_mut(), il);
                let out = swiglu_ffn(model, pool, help, (gate, up, down), &xn);
                add_inplace(x, &out);
                laps.lap(Some(il), OpGroup::Ffn, || {
                    gate.bytes() + up.bytes() + down.bytes()
                });
            }
            Ffn::Moe(moe) => {
                let experts = Experts { ram, next: &next };
                let out = moe_ffn(model, pool, moe, &xn, il, experts, laps)?;
                add_inplace(x, &out);
            }
        }
    }
    Ok(())
}

/// Most tokens of a pass whose next layer's experts are predicted: a decode step's. A prompt's
/// chunk chooses most of a layer's experts anyway.
const PREDICT_TOKENS: usize = 8;

/// The experts MoE layer `layer` is expected to choose for the hidden states `x` (a row per
/// token), sorted: its router applied to `x` as it stands before the layer above it finishes;
/// none where `layer` is dense or the pass has more than [`PREDICT_TOKENS`] tokens.
fn predict_experts(model: &Model, pool: &ThreadPool, layer: usize, x: &[f32]) -> Vec<usize> {
    let c = &model.config;
    let (Some(cfg), Ffn::Moe(moe)) = (c.moe, &model.layers[layer].ffn) else {
        return Vec::new();
    };
    let n = x.len() / c.n_embd;
    if n > PREDICT_TOKENS {
        return Vec::new();
    }
    let mut xn = vec![0.0f32; x.len()];
    norm_rows(x, &model.layers[layer].ffn_norm, c.rms_eps, &mut xn);
    let mut probs = vec![0.0f32; n * cfg.n_expert];
    matmul(pool, model.mat(&moe.router), &xn, &mut probs);
    let mut experts: Vec<usize> = probs
        .chunks_exact(cfg.n_expert)
        .flat_map(|p| route(&cfg, p).into_iter().map(|r| r.expert))
        .collect();
    experts.sort_unstable();
    experts.dedup();
    experts
}

/// Where a MoE layer's routed experts come from: the map, or a RAM tier (with the next
/// layer's predicted experts to read ahead).
#[derive(Clone, Copy)]
struct Experts<'a> {
    ram: Option<&'a RamExperts>,
    next: &'a [usize],
}

/// RMSNorm of every row of `x` (rows as wide as `w`) into `out`.
fn norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (row, o) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        rms_norm(row, w, eps, o);
    }
}

/// Adds `bias` to every row of `x`.
fn add_bias_rows(x: &mut [f32], bias: &Option<Vec<f32>>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            add_inplace(row, b);
        }
    }
}

/// Q/K/V, biases, QK-norm, RoPE, cache append, causal GQA attention and the output
/// projection, for every token of the batch; returns the projection (`n × n_embd`).
#[allow(clippy::too_many_arguments)]
fn attention(
    model: &Model,
    (pool, mut help): (&ThreadPool, Option<&mut (dyn RowHelper + 'static)>),
    caches: &mut [&mut KvCache],
    a: &Attention,
    il: usize,
    slots: &[Slot],
    xn: &[f32],
    rope: &Rope,
    laps: &mut Laps<'_>,
) -> Vec<f32> {
    let c = &model.config;
    let (hd, qw, kvw) = (c.head_dim, c.q_width(), c.kv_width());
    let n = xn.len() / c.n_embd;
    let mut q = vec![0.0f32; n * qw];
    let mut k = vec![0.0f32; n * kvw];
    let mut v = vec![0.0f32; n * kvw];
    let qkv = [model.mat(&a.wq), model.mat(&a.wk), model.mat(&a.wv)];
    let at = (il, LayerProducts::Qkv);
    if !shared_rows(
        pool,
        help.as_deref_mut(),
        at,
        &qkv,
        xn,
        &mut [&mut q, &mut k, &mut v],
    ) {
        matmul(pool, qkv[0], xn, &mut q);
        matmul(pool, qkv[1], xn, &mut k);
        matmul(pool, qkv[2], xn, &mut v);
    }
    add_bias_rows(&mut q, &a.bq);
    add_bias_rows(&mut k, &a.bk);
    add_bias_rows(&mut v, &a.bv);
    laps.lap(Some(il), OpGroup::Qkv, || {
        a.wq.bytes() + a.wk.bytes() + a.wv.bytes()
    });
    for (x, width, norm) in [(&mut q, qw, &a.q_norm), (&mut k, kvw, &a.k_norm)] {
        for (b, row) in x.chunks_exact_mut(width).enumerate() {
            let (cos, sin) = rope.token(b);
            for head in row.chunks_exact_mut(hd) {
                if let Some(w) = norm {
                    rms_norm_inplace(head, w, c.rms_eps);
                }
                rope_head(head, c.rope_layout, cos, sin);
            }
        }
    }
    for (b, s) in slots.iter().enumerate() {
        caches[s.seq].store(
            il,
            s.pos,
            &k[b * kvw..(b + 1) * kvw],
            &v[b * kvw..(b + 1) * kvw],
        );
    }
    laps.lap(Some(il), OpGroup::RopeCache, || 0);

    let caches: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
    let group = c.gqa_group();
    let scale = 1.0 / (hd as f32).sqrt();
    let mut attn = vec![0.0f32; n * qw];
    let isa = Isa::detect();
    // One task per (token, head); token b sees positions 0..=pos of its own sequence.
    pool.for_each_chunk(&mut attn, hd, &|offset, out| {
        let (b, h) = (offset / qw, (offset % qw) / hd);
        let kvh = h / group;
        let Slot { seq, pos } = slots[b];
        let n_kv = pos + 1;
        let (keys, values) = (caches[seq].keys(il, n_kv), caches[seq].values(il, n_kv));
        // llama.cpp multiplies Q with the f16 keys in f16 (`vec_dot_type` of F16 is F16): Q is
        // rounded to f16 once per head, then dotted in f32 with the f16 keys.
        let qh: Vec<f32> = q[offset..offset + hd]
            .iter()
            .map(|&v| f16::from_f32(v).to_f32())
            .collect();
        let head = kvh * hd..(kvh + 1) * hd;
        let mut scores: Vec<f32> = keys
            .chunks_exact(kvw)
            .take(n_kv)
            .map(|key| dot_f32_f16_with(isa, &qh, &key[head.clone()]) * scale)
            .collect();
        softmax(&mut scores);
        // ... and the probabilities with the f16 values, so they are rounded too.
        for p in scores.iter_mut() {
            *p = f16::from_f32(*p).to_f32();
        }
        weighted_sum_f16_with(isa, out, &scores, values, kvw, head.start);
    });
    laps.lap(Some(il), OpGroup::Attention, || 0);
    let mut proj = vec![0.0f32; n * c.n_embd];
    let wo = [model.mat(&a.wo)];
    if !shared_rows(
        pool,
        help,
        (il, LayerProducts::Output),
        &wo,
        &attn,
        &mut [&mut proj],
    ) {
        matmul(pool, wo[0], &attn, &mut proj);
    }
    proj
}

/// `down(silu(gate · x) * (up · x))` for every row of `xs` (a dense FFN, or Qwen2-MoE's shared
/// expert), with gate and up in one job of the pool. `up` shares `gate`'s conversion of the
/// tokens when its type takes the same format. `help`: a helper for the rows of layer `il`'s
/// products.
fn swiglu_ffn(
    model: &Model,
    pool: &ThreadPool,
    (mut help, il): (Option<&mut (dyn RowHelper + 'static)>, usize),
    (gate, up, down): (&Matrix, &Matrix, &Matrix),
    xs: &[f32],
) -> Vec<f32> {
    let n = xs.len() / gate.n_in;
    let mut g = vec![0.0f32; n * gate.n_out];
    let mut u = vec![0.0f32; n * up.n_out];
    let gate_up = [model.mat(gate), model.mat(up)];
    let at = (il, LayerProducts::GateUp);
    if !shared_rows(
        pool,
        help.as_deref_mut(),
        at,
        &gate_up,
        xs,
        &mut [&mut g, &mut u],
    ) {
        let acts = activations(gate.ty, xs, gate.n_in);
        let up_acts = (ActFormat::for_weights(up.ty) != ActFormat::for_weights(gate.ty))
            .then(|| activations(up.ty, xs, up.n_in));
        matmul_group(
            pool,
            &mut [
                Product {
                    m: gate_up[0],
                    acts: &acts,
                    out: &mut g,
                    label: None,
                },
                Product {
                    m: gate_up[1],
                    acts: up_acts.as_deref().unwrap_or(&acts),
                    out: &mut u,
                    label: None,
                },
            ],
        );
    }
    swiglu_inplace(&mut g, &u);
    let mut out = vec![0.0f32; n * down.n_out];
    let d = [model.mat(down)];
    if !shared_rows(
        pool,
        help,
        (il, LayerProducts::Down),
        &d,
        &g,
        &mut [&mut out],
    ) {
        matmul(pool, d[0], &g, &mut out);
    }
    out
}

/// Routed experts (routed as [`route`] says), plus Qwen2-MoE's sigmoid-gated shared expert, for
/// every row of `xn`, in layer `il`.
fn moe_ffn(
    model: &Model,
    pool: &ThreadPool,
    moe: &MoeWeights,
    xn: &[f32],
    il: usize,
    experts: Experts<'_>,
    laps: &mut Laps<'_>,
) -> Result<Vec<f32>, StreamError> {
    let cfg = model.config.moe.expect("MoE layer in a MoE model");
    let (e, k) = (model.config.n_embd, cfg.n_expert_used);
    let n = xn.len() / e;
    let mut probs = vec![0.0f32; n * cfg.n_expert];
    matmul(pool, model.mat(&moe.router), xn, &mut probs);

    // Per token: the chosen experts in rank order and their weights.
    let mut chosen = Vec::with_capacity(n * k);
    let mut weights = Vec::with_capacity(n * k);
    for p in probs.chunks_exact(cfg.n_expert) {
        for r in route(&cfg, p) {
            chosen.push(r.expert);
            weights.push(r.weight);
        }
    }
    laps.lap(Some(il), OpGroup::Router, || moe.router.bytes());

    // Each expert runs once over the tokens that chose it; results land at (token, rank).
    let expert_out = match experts.ram {
        None => routed_experts(model, pool, moe, xn, &chosen, k),
        Some(ram) => ram.outputs(pool, moe, il, xn, &chosen, k, experts.next)?,
    };
    // Summed in rank order, as ggml adds the weighted experts.
    let mut out = vec![0.0f32; n * e];
    for (b, o) in out.chunks_exact_mut(e).enumerate() {
        for r in 0..k {
            let s = b * k + r;
            let w = weights[s];
            for (o, &y) in o.iter_mut().zip(&expert_out[s * e..(s + 1) * e]) {
                *o += y * w;
            }
        }
    }
    laps.lap_experts(il, &chosen, || {
        moe.gate.bytes() + moe.up.bytes() + moe.down.bytes()
    });
    if let Some(sh) = &moe.shared {
        let mut logit = vec![0.0f32; n];
        matmul(pool, model.mat(&sh.gate_inp), xn, &mut logit);
        let y = swiglu_ffn(model, pool, (None, il), (&sh.gate, &sh.up, &sh.down), xn);
        for ((o, y), &l) in out.chunks_exact_mut(e).zip(y.chunks_exact(e)).zip(&logit) {
            let g = shared_expert_gate(l);
            for (o, &y) in o.iter_mut().zip(y) {
                *o += y * g;
            }
        }
        laps.lap(Some(il), OpGroup::SharedExpert, || {
            sh.gate_inp.bytes() + sh.gate.bytes() + sh.up.bytes() + sh.down.bytes()
        });
    }
    Ok(out)
}
