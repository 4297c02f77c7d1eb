//! A prompt on the GPU in chunks of tokens: each chunk is one submission in which every weight
//! matrix is multiplied with all of the chunk's tokens at once (`matvec_batch.comp`, tiled), so
//! a weight is read once per tile of tokens instead of once per token. Where the device has
//! cooperative matrices the tiles are multiplied in its matrix units, in f16 with f32 sums. A
//! chunk of at most 8 tokens (a batched decode step, [`super::batch`]) multiplies in the
//! several-column matrix-vector kernel instead (`matvec.comp` with COLS).
//! (Dequantizing each matrix to f16 first, `Recorder::matvec_batch_rows_staged`, was slower on
//! the H200: `bench/RESULTS.md`.) Norms, RoPE with the KV-cache append, attention and
//! SwiGLU take the chunk's tokens as one more grid dimension; token `t` of a chunk at position
//! `pos` attends to positions `0..=pos + t` (causal), the earlier chunks' included.
//!
//! A MoE layer with every routed expert in VRAM and no shared expert is routed on the device,
//! in the chunk's one submission ([`GpuModel::routes_chunks_on_device`]): each token's top-k
//! (`moe_route.comp` with CHUNK), the entries laid out by expert (`moe_sort.comp`), every
//! expert's product over its rows in one dispatch a matrix, and each token's experts added back
//! in rank order (`scatter_add.comp` with GATHER). The host reads each layer's counts per
//! expert after the chunk, for its counters.
//!
//! Otherwise a MoE layer ends its chunk's command buffer at its router: the router logits of
//! every token are read back and routed on the host with the CPU engine's routing
//! ([`ChunkRouting`]), then the next command buffer runs each chosen expert once over the
//! tokens that chose it (their rows gathered, the expert's rows of the stacked matrices
//! multiplied as for a dense layer, the outputs added back to their tokens with their weights),
//! in groups of experts where they fit ([`group_runs`]), then a shared expert (Qwen2-MoE) over
//! every token, added with each token's gate (its logits read back with the router's).
//!
//! Under a VRAM budget the experts not resident run over their tokens through slots they take
//! in turn ([`super::stream_experts`]).
//!
//! Partial: a model over its VRAM budget needs the expert slots of [`super::stream_experts`]
//! (a shared expert's model has none), and its MoE layers are routed on the host, one
//! submission each.

mod layers;
mod routing;
mod step_chain;

use spillway_shaders::WeightType;

use super::{GpuFfn, GpuModel, HostTime, MoeMiss};
use crate::gpu::alloc::MemoryUse;
use crate::gpu::buffer::Buffer;
use crate::gpu::error::{GpuError, Result};
use crate::gpu::moe::{ChunkRouting, ExpertRun};
use crate::gpu::moe_groups::{group_runs, route_words_for, RunGroup};
use crate::gpu::ops::{attention_counters, attention_scratch_floats, GpuMatrix};
use crate::gpu::ops_attention::{attention_grid, flash_attention_fits};
use crate::gpu::ops_batch::MAX_MATVEC_COLS;
use crate::gpu::record::{RecordStats, Recorder};

/// Most tokens in one chunk (llama.cpp's default micro-batch).
pub const PREFILL_CHUNK: usize = 512;

/// Tokens per chunk when every token's logits are wanted: the logits of a chunk are read back
/// at once, `n_vocab` floats a token.
pub(super) const LOGITS_CHUNK: usize = 64;

/// Most bytes of attention scratch a chunk takes; later chunks of a long prompt are shorter so
/// that their runs of positions fit.
const SCRATCH_BYTES: usize = 64 << 20;

/// Bytes of attention scratch one token takes when its chunk ends at `end` positions.
fn scratch_per_token(c: &crate::model::Config, end: usize) -> usize {
    attention_scratch_floats(c.n_head, c.head_dim, end) * 4
}

/// Most bytes of a MoE chunk's gathered rows (each an expert's input, gate, up and output),
/// unless one chunk's tokens take more.
const MOE_SCRATCH_BYTES: usize = 128 << 20;

/// Tokens of the chunk made for `n` ([`GpuModel::make_batch`]): a multiple of 64, at most
/// [`PREFILL_CHUNK`]; for the few tokens of a batched decode step (at most the several-column
/// kernel's [`MAX_MATVEC_COLS`]), that many, so that a VRAM budget too small for a prompt's
/// chunk may still hold a step's.
fn chunk_tokens(n: usize) -> usize {
    if n <= MAX_MATVEC_COLS as usize {
        MAX_MATVEC_COLS as usize
    } else {
        n.next_multiple_of(64).min(PREFILL_CHUNK)
    }
}

/// Rows of a MoE chunk of `tokens` tokens' gathered scratch ([`BatchMoe`]): room for every
/// token's `k` entries where [`MOE_SCRATCH_BYTES`] holds them, so that a layer's resident
/// experts make one group ([`group_runs`]) whose products fill the device, and never fewer than
/// the chunk's tokens (the most one expert takes).
pub(crate) fn moe_rows(c: &crate::model::Config, tokens: usize) -> usize {
    let Some(m) = &c.moe else {
        return 0;
    };
    let row = 4 * (2 * c.n_embd + 2 * m.n_ff_expert);
    (tokens * m.n_expert_used)
        .min(MOE_SCRATCH_BYTES / row)
        .max(tokens)
}

/// Device memory of a dense model's [`Batch`] for `tokens` tokens with a KV cache of
/// `capacity` positions, the host-visible rows of hidden states included (the most it takes;
/// the driver's alignment comes on top), but not every token's logits ([`logits_bytes`]).
pub(crate) fn batch_bytes(c: &crate::model::Config, tokens: usize, capacity: usize) -> u64 {
    let n = tokens;
    let floats = n * (3 * c.n_embd + 2 * c.q_width() + 2 * c.kv_width() + 2 * c.n_ff);
    let scratch = (scratch_per_token(c, capacity) * n).min(SCRATCH_BYTES);
    let counters = c.n_head * n * 4;
    (floats * 4 + scratch + counters + 3 * n * 4) as u64
}

/// Host-visible memory a [`Batch`] takes for chunks that want every token's logits, made at
/// the first such prompt (which goes token by token if it is refused).
pub(crate) fn logits_bytes(c: &crate::model::Config) -> u64 {
    (LOGITS_CHUNK * c.n_vocab * 4) as u64
}

/// Activations of a chunk of tokens, token-major; made at the first prompt, for as many tokens
/// as it has ([`chunk_tokens`]), and made again larger
/// for a longer prompt, so that short prompts do not pin a full chunk's memory.
pub(super) struct Batch {
    /// Most tokens a chunk may have.
    tokens: usize,
    x: Buffer,
    xn: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    attn: Buffer,
    gate: Buffer,
    up: Buffer,
    scores: Buffer,
    /// The attention's counters, a token's after another's.
    attn_done: Buffer,
    /// Host-visible: the chunk's token ids (or, with the first layers on the CPU, the rows of
    /// `input`: 0, 1, ...), then each token's position and its sequence's first KV-cache row
    /// ([`StepWord`](crate::gpu::ops::StepWord)).
    step: Buffer,
    /// One past the last position of the chunk's tokens: the runs of positions its attention
    /// covers.
    end: usize,
    /// The chunk's tokens are one of each of several sequences (a batched decode step), not
    /// consecutive positions of one: no flash attention, whose tiles share their keys.
    ragged: bool,
    /// The chunk's routed experts that miss VRAM run on the CPU (a batched decode step, or a
    /// prompt chunk whose size measured that way cheaper: [`super::prompt_misses`]), not
    /// streamed through slots; each MoE layer's normalised rows go where the CPU reads them.
    cpu_turns: bool,
    /// Host-visible, with the first layers on the CPU: the chunk's hidden states from them (or
    /// its embeddings, when those layers run here too: [`super::stream`]).
    input: Option<GpuMatrix>,
    /// `x` already holds the hidden states the chunk's first layer on the GPU takes.
    x_ready: bool,
    /// Host-visible: every token's logits, for the chunks that want them all.
    logits: Option<Buffer>,
    /// Batched decode steps recorded once and replayed ([`super::batch`]), by token count,
    /// with the MoE layers each routes on the device; `None` for a count whose recording was
    /// not one submission, which is not recorded again. They bind this batch's buffers, so
    /// they go with it.
    pub(super) replays:
        std::collections::HashMap<usize, Option<(crate::gpu::replay::Replay, Vec<usize>)>>,
    /// Batched steps as chains ([`step_chain`]) recorded once and kept, by token count.
    pub(super) chains: std::collections::HashMap<usize, crate::gpu::record::ChainReplay>,
    /// Present for MoE models.
    pub(super) moe: Option<BatchMoe>,
}

/// A chunk's MoE scratch: the layer's normalised input as rows to gather from, the gathered
/// input, gate (then SwiGLU), up and output of an expert's tokens or a group's entries
/// ([`moe_rows`] rows), the router logits read back, and the routing the host writes
/// ([`ChunkRouting`]).
pub(super) struct BatchMoe {
    pub(super) xn: GpuMatrix,
    /// Rows of `xg`, `eg`, `eu` and `ed`.
    rows: usize,
    pub(super) xg: Buffer,
    pub(super) eg: Buffer,
    pub(super) eu: Buffer,
    pub(super) ed: Buffer,
    logits: Buffer,
    pub(super) route: Buffer,
    /// Present where the model has a shared expert (Qwen2-MoE).
    shared: Option<BatchShared>,
    /// Present where the chunk's MoE layers are routed on the device
    /// ([`GpuModel::routes_chunks_on_device`]).
    device: Option<ChunkOnDevice>,
    /// Present where the experts that miss VRAM run on the CPU in batched decode steps
    /// ([`GpuModel::cpu_misses`]).
    pub(super) cpu: Option<BatchCpu>,
}

/// Host-visible scratch of a batched step's experts on the CPU: the chunk's normalised rows
/// for the CPU to read, and each token's sum of the experts it ran, for the GPU to add.
pub(super) struct BatchCpu {
    pub(super) xn: Buffer,
    pub(super) sum: Buffer,
    /// Each token's k resident experts' slots and weights (an empty entry for each expert the
    /// CPU ran), [`OffVram::by_entry`].
    pub(super) route: Buffer,
}

impl BatchMoe {
    /// Whether the scratch holds `n` tokens' entries by entry ([`GpuMoe::record_tokens`]):
    /// their gate and up rows, and those of the stacks in system RAM in the gathered rows'
    /// and outputs' room.
    pub(super) fn holds_entries(&self, n: usize, c: &crate::model::Config) -> bool {
        let Some(m) = &c.moe else { return false };
        let entries = n * m.n_expert_used;
        self.rows >= entries && self.rows * c.n_embd >= entries * m.n_ff_expert
    }
}

/// A chunk's routing on the device: the router logits, each token's experts and weights
/// (`moe_route.comp` with CHUNK), and each MoE layer's count per expert, which the host reads
/// after the chunk for its counters (host-visible).
struct ChunkOnDevice {
    logits: Buffer,
    sel: Buffer,
    counts: Buffer,
    /// With experts in system RAM, a few tokens' routing split between slots and those
    /// ([`GpuModel::moe_by_entry`]): 3k floats a token.
    split: Option<Buffer>,
}

/// A chunk's shared-expert scratch: each token's gate logit read back, and the expert's gate
/// (then SwiGLU) and up over every token (its output goes to `BatchMoe::ed`).
struct BatchShared {
    logits: Buffer,
    gate: Buffer,
    up: Buffer,
}

impl Batch {
    fn new(m: &GpuModel, tokens: usize) -> Result<Batch> {
        let c = &m.config;
        let al = &m.allocator;
        let n = tokens;
        let f32s = |floats: usize| Buffer::new_in(al, floats as u64 * 4, MemoryUse::DeviceLocal);
        let n_ff = m
            .layers
            .iter()
            .map(|l| match &l.ffn {
                GpuFfn::Dense { gate_up, .. } => gate_up.n_ff(),
                GpuFfn::Moe(_) => 0,
            })
            .max()
            .unwrap_or(0);
        Ok(Batch {
            tokens: n,
            x: f32s(n * c.n_embd)?,
            xn: f32s(n * c.n_embd)?,
            q: f32s(n * c.q_width())?,
            k: f32s(n * c.kv_width())?,
            v: f32s(n * c.kv_width())?,
            attn: f32s(n * c.q_width())?,
            gate: f32s(n * n_ff)?,
            up: f32s(n * n_ff)?,
            // A whole chunk at the last positions, within SCRATCH_BYTES.
            scores: Buffer::new_in(
                al,
                (scratch_per_token(c, m.capacity) * n).min(SCRATCH_BYTES) as u64,
                MemoryUse::DeviceLocal,
            )?,
            attn_done: attention_counters(al, c.n_head, n)?,
            step: Buffer::new_in(al, (3 * n as u64 + 3) * 4, MemoryUse::DeviceMapped)?,
            end: 0,
            ragged: false,
            cpu_turns: false,
            input: match m.front {
                Some(_) => Some(GpuMatrix {
                    buffer: Buffer::new_in(al, (n * c.n_embd) as u64 * 4, MemoryUse::DeviceMapped)?,
                    wtype: WeightType::F32,
                    n_in: c.n_embd,
                    n_out: n,
                    row_bytes: c.n_embd as u64 * 4,
                }),
                None => None,
            },
            logits: None,
            replays: std::collections::HashMap::new(),
            chains: std::collections::HashMap::new(),
            x_ready: false,
            moe: match &c.moe {
                Some(cfg) => {
                    let k = cfg.n_expert_used;
                    let shared_ff = m
                        .layers
                        .iter()
                        .map(|l| match &l.ffn {
                            GpuFfn::Moe(moe) => moe.shared_ff(),
                            GpuFfn::Dense { .. } => 0,
                        })
                        .max()
                        .unwrap_or(0);
                    let shared = shared_ff > 0;
                    let weights_at = ChunkRouting::weights_at_for(n, k, shared);
                    let rows = moe_rows(c, n);
                    Some(BatchMoe {
                        rows,
                        xn: GpuMatrix {
                            buffer: f32s(n * c.n_embd)?,
                            wtype: WeightType::F32,
                            n_in: c.n_embd,
                            n_out: n,
                            row_bytes: c.n_embd as u64 * 4,
                        },
                        xg: f32s(rows * c.n_embd)?,
                        eg: f32s(rows * cfg.n_ff_expert)?,
                        eu: f32s(rows * cfg.n_ff_expert)?,
                        ed: f32s(rows * c.n_embd)?,
                        logits: Buffer::new_in(
                            al,
                            (n * cfg.n_expert * 4) as u64,
                            MemoryUse::Staging,
                        )?,
                        route: Buffer::new_in(
                            al,
                            ((2 * weights_at + route_words_for(n, k, cfg.n_expert)) * 4) as u64,
                            MemoryUse::DeviceMapped,
                        )?,
                        device: match m.routes_chunks_on_device(n) {
                            true => Some(ChunkOnDevice {
                                logits: f32s(n * cfg.n_expert)?,
                                sel: f32s(n * 2 * k)?,
                                counts: Buffer::new_in(
                                    al,
                                    (c.n_layer * cfg.n_expert * 4) as u64,
                                    MemoryUse::Staging,
                                )?,
                                split: match m.placement.is_partial() {
                                    true => Some(f32s(MAX_MATVEC_COLS as usize * 3 * k)?),
                                    false => None,
                                },
                            }),
                            false => None,
                        },
                        cpu: match m.cpu_misses() {
                            true => Some(BatchCpu {
                                xn: Buffer::new_in(
                                    al,
                                    (n * c.n_embd * 4) as u64,
                                    MemoryUse::Staging,
                                )?,
                                sum: Buffer::new_in(
                                    al,
                                    (n * c.n_embd * 4) as u64,
                                    MemoryUse::Staging,
                                )?,
                                route: Buffer::new_in(
                                    al,
                                    (n * 2 * k * 4) as u64,
                                    MemoryUse::Staging,
                                )?,
                            }),
                            false => None,
                        },
                        shared: match shared {
                            true => Some(BatchShared {
                                logits: Buffer::new_in(al, n as u64 * 4, MemoryUse::Staging)?,
                                gate: f32s(n * shared_ff)?,
                                up: f32s(n * shared_ff)?,
                            }),
                            false => None,
                        },
                    })
                }
                None => None,
            },
        })
    }

    pub(super) fn step(&self) -> &Buffer {
        &self.step
    }

    /// Whether the chunk's misses run on the CPU (see the field).
    pub(super) fn cpu_turns(&self) -> bool {
        self.cpu_turns && self.moe.as_ref().is_some_and(|m| m.cpu.is_some())
    }

    /// Writes the step buffer: the chunk's token ids, then its positions ([`StepWord`](crate::gpu::ops::StepWord)).
    pub(super) fn write_step(&mut self, words: &[u8]) {
        self.step.write(words);
    }

    /// Sets the chunk's end to `end` positions (the runs its attention covers).
    pub(super) fn set_end(&mut self, end: usize) {
        self.end = end;
    }

    /// Reads `n` tokens' logits from the host-visible buffer of every token's logits.
    pub(super) fn read_logits(&self, n: usize, n_vocab: usize) -> Vec<f32> {
        self.logits
            .as_ref()
            .expect("made for a batched step")
            .read_f32(n * n_vocab)
    }

    /// Whether the attention scratch holds `n` tokens at any positions of `m`'s sequences
    /// (the decode kernel's runs, which a batched step takes).
    pub(super) fn holds_attention(&self, m: &GpuModel, n: usize) -> bool {
        n <= self.tokens
            && n * scratch_per_token(&m.config, m.capacity) <= self.scores.size() as usize
    }

    pub(super) fn x(&self) -> &Buffer {
        &self.x
    }

    /// The host-visible rows of hidden states (a model with layers on the CPU).
    pub(super) fn input(&self) -> &GpuMatrix {
        self.input.as_ref().expect("a model with layers on the CPU")
    }

    pub(super) fn input_mut(&mut self) -> &mut GpuMatrix {
        self.input.as_mut().expect("a model with layers on the CPU")
    }

    pub(super) fn set_x_ready(&mut self) {
        self.x_ready = true;
    }

    /// Makes the host-visible buffer for every token's logits, if not made yet.
    fn logits_buffer(&mut self, m: &GpuModel) -> Result<()> {
        if self.logits.is_none() {
            let bytes = (LOGITS_CHUNK.min(self.tokens) * m.config.n_vocab * 4) as u64;
            self.logits = Some(Buffer::new_in(&m.allocator, bytes, MemoryUse::Staging)?);
        }
        Ok(())
    }
}

/// A chunk paused at a MoE layer's router: the layer, its routing, its resident experts' runs,
/// those runs in groups and where its other experts went.
type Paused = (
    usize,
    ChunkRouting,
    Vec<ExpertRun>,
    Option<Vec<RunGroup>>,
    OffVram,
);

/// Where a paused MoE layer's experts that are not resident ran, and how its resident ones
/// run in the chunk's next command buffer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct OffVram {
    /// The CPU ran them into the batch's `cpu.sum`, for the next command buffer to add
    /// (else they were streamed through slots, [`super::stream_experts`], or there were none).
    pub(super) cpu_sum: bool,
    /// The resident ones run by entry, each token's k from the batch's `cpu.route`
    /// ([`crate::gpu::moe::GpuMoe::record_tokens`]), not by expert from their runs.
    pub(super) by_entry: bool,
}

/// Where a chunk's next command buffer starts after MoE layer `layer`'s router: its resident
/// experts (the experts not resident ran meanwhile), then its shared expert, with the route
/// buffer's weights from word `weights_at`.
pub(super) struct ChunkResume<'a> {
    layer: usize,
    weights_at: usize,
    runs: &'a [ExpertRun],
    /// `runs` as groups, their words written to the route buffer ([`group_runs`]).
    groups: Option<&'a [RunGroup]>,
    shared_from: Option<usize>,
    off_vram: OffVram,
}

impl GpuModel {
    /// Whether [`GpuModel::eval_prompt`] runs prompts in chunks (not MoE models over their
    /// VRAM budget with neither slots for their missing experts nor the CPU to run them, and
    /// not after the device memory for a chunk was refused) rather than token by token. While
    /// profiling, each chunk is profiled as a step is ([`super::profile`]):
    /// [`GpuModel::last_profile`] is the last chunk's.
    pub fn batches_prompts(&self) -> bool {
        // Every routed expert in VRAM, or slots that the missing ones take in turn, or the
        // CPU to run them.
        let moe_ok = !self.placement.is_partial()
            || self.expert_stream.is_some()
            || (self.cpu_misses() && !self.has_shared_experts())
            || self.routes_chunks_on_device(PREFILL_CHUNK);
        moe_ok && !self.chunks_refused(1)
    }

    /// Whether a MoE layer has a shared expert (Qwen2-MoE): its prompts over the budget stay
    /// token by token (partial: their chunks with misses on the CPU are not done).
    fn has_shared_experts(&self) -> bool {
        self.layers.iter().any(|l| match &l.ffn {
            GpuFfn::Moe(m) => m.shared_ff() > 0,
            GpuFfn::Dense { .. } => false,
        })
    }

    /// Whether the VRAM budget refused a chunk as large as one of `n` tokens takes.
    pub(super) fn chunks_refused(&self, n: usize) -> bool {
        self.batch_refused.is_some_and(|r| chunk_tokens(n) >= r)
    }

    /// Whether a batched decode step runs the routed experts that miss VRAM on the CPU, each
    /// once for all the tokens that chose it ([`MoeMiss::Cpu`] with CPU experts); a prompt's
    /// chunk does too, or streams them through VRAM slots where it has those and that measured
    /// cheaper ([`super::prompt_misses`]).
    pub(super) fn cpu_misses(&self) -> bool {
        self.experts
            .as_ref()
            .is_some_and(|e| matches!(e.miss, MoeMiss::Cpu | MoeMiss::Split) && e.cpu.is_some())
    }

    /// Whether a chunk of `n` tokens routes its MoE layers on the device, in its one
    /// submission: every routed expert resident, or in system RAM for the GPU to read those
    /// without a slot ([`crate::gpu::placement::MoeMiss::Pcie`]); routing on the device allowed
    /// ([`GpuModel::routes_on_device`]), no shared expert, and scratch rows for every token's
    /// entries ([`moe_rows`]). Otherwise each MoE layer's router logits are read back and routed
    /// on the host, a submission per layer.
    pub(super) fn routes_chunks_on_device(&self, n: usize) -> bool {
        let Some(cfg) = &self.config.moe else {
            return false;
        };
        let whole = !self.placement.is_partial();
        self.routes_on_device
            && moe_rows(&self.config, n) >= n * cfg.n_expert_used
            && self.layers.iter().all(|l| match &l.ffn {
                GpuFfn::Moe(m) => m.shared_ff() == 0 && (whole || m.has_host_experts()),
                GpuFfn::Dense { .. } => true,
            })
    }

    /// Whether prompt chunks take their attention in the flash-attention kernel.
    fn flash_prompts(&self) -> bool {
        self.flash_attention && flash_attention_fits(self.attention_args())
    }

    /// Evaluates `tokens` at the next positions: the last token's logits, or with `all_logits`
    /// every token's, one after another. Prompts take chunks of up to [`PREFILL_CHUNK`]
    /// tokens per submission (a MoE model's, one per MoE layer) where
    /// [`GpuModel::batches_prompts`] says so, else go token by token. So does a model whose
    /// chunk's activations the device memory refused once: the model was placed without
    /// them, and its prompts still run. Where the VRAM budget refused a prompt's chunk, the
    /// prompt takes chunks of a batched step's size, and goes token by token only where those
    /// are refused too.
    pub fn eval_prompt(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        self.check_tokens(tokens)?;
        self.flush_promotions()?;
        if self.batches_prompts()
            && tokens.len() > 1
            && !self.make_batch(tokens.len())?
            && self.chunks_refused(tokens.len())
        {
            // Chunks as small as a batched step's where the budget refused larger ones (not
            // the driver, whose refusal is not remembered: that prompt goes token by token).
            self.make_batch(MAX_MATVEC_COLS as usize)?;
        }
        if !self.batches_prompts() || self.batch.is_none() || tokens.len() == 1 {
            return self.eval_each(tokens, all_logits);
        }
        let started = std::time::Instant::now();
        let logits = self.eval_chunks(tokens, all_logits)?;
        // The prompt's routing counted in the experts' demand: the hot ones come in now.
        self.promote_experts(started.elapsed())?;
        Ok(logits)
    }

    /// Makes a chunk's activations for `n` tokens ([`chunk_tokens`]) unless the ones made hold
    /// them (the smaller one's memory is given back first); `false` where the device memory
    /// was refused: prompts then go token by token, and batched steps one sequence at a time.
    /// A refusal by the VRAM budget is remembered for chunks as large (they would be refused
    /// again); one by the driver is not, and the next prompt tries again.
    pub(super) fn make_batch(&mut self, n: usize) -> Result<bool> {
        let wanted = chunk_tokens(n);
        if self.batch.as_ref().is_some_and(|b| b.tokens >= wanted) {
            return Ok(true);
        }
        if self.chunks_refused(n) {
            return Ok(false);
        }
        self.batch = None;
        match Batch::new(self, wanted) {
            Ok(b) => {
                self.batch = Some(b);
                Ok(true)
            }
            Err(e @ GpuError::OutOfMemory(_)) => {
                tracing::warn!(
                    "this prompt goes token by token, or this step a sequence at a time: {e}"
                );
                Ok(false)
            }
            Err(e) if e.is_out_of_memory() => {
                tracing::warn!(
                    "prompts go token by token, batched steps a sequence at a time: {e}"
                );
                self.batch_refused = Some(self.batch_refused.map_or(wanted, |r| r.min(wanted)));
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Makes the made chunk's host-visible buffer for every token's logits, if not made yet;
    /// `false` where the memory was refused.
    pub(super) fn make_batch_logits(&mut self) -> Result<bool> {
        let mut b = self.batch.take().expect("made by make_batch");
        let made = b.logits_buffer(self);
        self.batch = Some(b);
        match made {
            Ok(()) => Ok(true),
            Err(e) if e.is_out_of_memory() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// [`GpuModel::eval_prompt`] token by token; with the first layers on the CPU those take
    /// the prompt at once (the CPU engine's matrix-matrix products, each token's arithmetic as
    /// alone), the GPU's layers a token at a time. `eval_prompt` checked the tokens.
    fn eval_each(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        let n_vocab = self.config.n_vocab;
        let mut out = Vec::with_capacity(if all_logits { tokens.len() } else { 1 } * n_vocab);
        let (mut hidden, mut share) = (None, std::time::Duration::ZERO);
        if let Some(front) = self.front.as_mut().filter(|_| tokens.len() > 1) {
            let t = std::time::Instant::now();
            hidden = Some(front.run(tokens, self.positions[self.seq], None)?);
            share = t.elapsed() / tokens.len() as u32;
        }
        let e = self.config.n_embd;
        for (i, &t) in tokens.iter().enumerate() {
            let row = hidden.as_ref().map(|x| &x[i * e..(i + 1) * e]);
            if row.is_some() {
                // Each token's profile shows its share of the CPU layers' time.
                self.front_time = share;
            }
            let logits = self.eval_from(t, row)?;
            if all_logits || i + 1 == tokens.len() {
                out.extend_from_slice(&logits);
            }
        }
        Ok(out)
    }

    /// [`GpuModel::eval_prompt`] in chunks, the batch made.
    fn eval_chunks(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        if all_logits && !self.make_batch_logits()? {
            // Host-visible memory for every token's logits: these go one by one.
            return self.eval_each(tokens, all_logits);
        }
        let scratch = self.batch.as_ref().expect("made").scores.size() as usize;
        let mut out = Vec::new();
        let mut rest = tokens;
        while !rest.is_empty() {
            let made = self.batch.as_ref().expect("made").tokens;
            let most = if all_logits {
                LOGITS_CHUNK.min(made)
            } else {
                made
            };
            // Scratch per token grows with the runs of positions below the chunk's end; the
            // flash-attention kernel takes none.
            let end = (self.pos() + most).min(self.capacity);
            let fits = match self.flash_prompts() {
                true => most,
                false => (scratch / scratch_per_token(&self.config, end)).max(1),
            };
            let n = rest.len().min(most).min(fits);
            let (chunk, later) = rest.split_at(n);
            let logits = self.eval_chunk(chunk, all_logits, None)?;
            if all_logits || later.is_empty() {
                out.extend(logits);
            }
            rest = later;
        }
        Ok(out)
    }

    /// One chunk of a prompt: one submission, or with MoE layers one per MoE layer plus one
    /// (each MoE layer's router logits are read back and routed on the host); its last token's
    /// logits, or all of them. With `seqs`, token `i` is the next of sequence `seqs[i]` (a
    /// batched decode step, [`super::batch`]) instead of the selected sequence's next.
    pub(super) fn eval_chunk(
        &mut self,
        tokens: &[u32],
        all_logits: bool,
        seqs: Option<&[usize]>,
    ) -> Result<Vec<f32>> {
        let (n, n_vocab) = (tokens.len(), self.config.n_vocab);
        // A prompt chunk of a model whose misses go to the CPU runs them there, or, where it
        // can also stream them through slots, the way measured cheaper for its size.
        let prompt_cpu = seqs.is_none() && self.cpu_misses();
        let choice =
            (prompt_cpu && self.expert_stream.is_some()).then(|| self.prompt_misses.on_cpu(n));
        let on_cpu = prompt_cpu && choice != Some(false);
        let started = std::time::Instant::now();
        let chained = on_cpu && self.chains_prompt(n)?;
        let logits = match chained {
            // As a chain, the device running the resident experts while the CPU runs the rest.
            true => self
                .eval_step_chain(tokens, &vec![self.seq; n])
                .map(|l| match all_logits {
                    true => l,
                    false => l[(n - 1) * n_vocab..].to_vec(),
                }),
            false => self.eval_chunk_parts(tokens, all_logits, (seqs, on_cpu)),
        };
        if logits.is_ok() {
            if choice.is_some() {
                let secs = started.elapsed().as_secs_f64();
                self.prompt_misses.record(n, on_cpu, secs);
            }
            self.cpu_prompt_chunks += u64::from(on_cpu);
            self.chained_prompt_chunks += u64::from(chained);
        }
        logits
    }

    /// [`GpuModel::eval_chunk`] through the chunk's path ([`GpuModel::run_chunk`]): a
    /// submission, or one per MoE layer plus one.
    fn eval_chunk_parts(
        &mut self,
        tokens: &[u32],
        all_logits: bool,
        (seqs, on_cpu): (Option<&[usize]>, bool),
    ) -> Result<Vec<f32>> {
        let (n, n_vocab) = (tokens.len(), self.config.n_vocab);
        // The device-loss injection counts tokens evaluated, a chunk's each (a chain counts
        // its own).
        self.count_for_faults(n);
        let mut batch = self.batch.take().expect("made by eval_prompt");
        let ran = self.run_chunk(&mut batch, tokens, all_logits, (seqs, on_cpu));
        let logits = ran.map(|()| match (&batch.logits, all_logits) {
            (Some(l), true) => l.read_f32(n * n_vocab),
            _ => self.act.logits.read_f32(n_vocab),
        });
        self.batch = Some(batch);
        if logits.is_ok() {
            match seqs {
                None => self.positions[self.seq] += n,
                Some(seqs) => seqs.iter().for_each(|&s| self.positions[s] += 1),
            }
        }
        logits
    }

    /// Whether a prompt chunk of `n` tokens whose misses run on the CPU runs as a batched
    /// step's chain (`prefill::step_chain`), its tokens the selected sequence's next ones:
    /// where steps are chains and the chunk's memory holds `n` tokens' entries, attention and
    /// logits (made now if they are not yet; `false` where that memory is refused).
    fn chains_prompt(&mut self, n: usize) -> Result<bool> {
        let holds = |m: &GpuModel| m.batch.as_ref().is_some_and(|b| b.holds_attention(m, n));
        Ok(n <= LOGITS_CHUNK && self.chains_steps(n) && holds(self) && self.make_batch_logits()?)
    }

    fn run_chunk(
        &mut self,
        batch: &mut Batch,
        tokens: &[u32],
        all_logits: bool,
        (seqs, cpu_misses): (Option<&[usize]>, bool),
    ) -> Result<()> {
        let n = tokens.len();
        let mut words = Vec::with_capacity((3 * n + 3) * 4);
        let streams = self.streams_chunk(n);
        match (self.front.as_mut(), batch.input.as_mut()) {
            (Some(front), Some(input)) => {
                for row in 0..n as u32 {
                    words.extend_from_slice(&row.to_le_bytes());
                }
                let t = std::time::Instant::now();
                if !streams {
                    let pos = self.positions[self.seq];
                    input.buffer.write_f32(&front.run(tokens, pos, None)?);
                }
                self.front_time = t.elapsed();
            }
            _ => {
                for t in tokens {
                    words.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        self.position_words(batch, &mut words, n, seqs);
        batch.cpu_turns |= cpu_misses;
        batch.step.write(&words);
        batch.x_ready = false;
        let profiling = self.profiler.is_some();
        if profiling {
            self.profile_before();
        }
        // The slots of experts read from system RAM, as the chunk's routing reads them.
        self.write_slot_map();
        if streams {
            self.stream_front(batch, tokens)?;
        }
        // The whole chunk, and the host's time inside its submissions (recording, submitting,
        // waiting): the rest is its routing and its missing experts' turns.
        let (started, mut waited) = (std::time::Instant::now(), std::time::Duration::ZERO);
        // The GPU's time in those submissions, when profiling.
        let mut busy = Some(0);
        let mut stats = RecordStats::default();
        let mut resume: Option<Paused> = None;
        // The MoE layers routed on the device (in this chunk's submissions).
        let mut on_device = Vec::new();
        loop {
            let mut paused = None;
            let from = resume
                .as_ref()
                .map(|(il, r, runs, groups, cpu)| ChunkResume {
                    layer: *il,
                    weights_at: r.weights_at(),
                    runs,
                    groups: groups.as_deref(),
                    shared_from: r.shared_from,
                    off_vram: *cpu,
                });
            let t = std::time::Instant::now();
            let record = |rec: &mut Recorder<'_>| {
                let out = (&mut paused, &mut on_device);
                self.record_chunk(rec, batch, (n, all_logits), from, out)
            };
            let part = match profiling {
                true => self.kernels.record_timed(record)?,
                false => self.kernels.record(record)?,
            };
            waited += t.elapsed();
            busy = busy.zip(part.gpu_ns).map(|(a, b)| a + b);
            stats.dispatches += part.dispatches;
            stats.barriers += part.barriers;
            stats.submits += part.submits;
            let Some(il) = paused else { break };
            let cfg = self.config.moe.expect("MoE layers have a MoE config");
            let m = batch.moe.as_mut().expect("MoE scratch");
            let shared = m.shared.as_ref().map(|s| s.logits.read_f32(n));
            let logits = m.logits.read_f32(n * cfg.n_expert);
            let routing = ChunkRouting::new(&cfg, &logits, shared.as_deref());
            let bytes: Vec<u8> = routing.words.iter().flat_map(|w| w.to_le_bytes()).collect();
            m.route.write(&bytes);
            // The experts not in VRAM run here (streamed through slots, or on the CPU in a
            // batched decode step); the resident ones in the next part.
            let (resident, off_vram) = self.chunk_experts(batch, (il, n), &routing)?;
            // The resident experts in groups, described after the routing's words.
            let m = batch.moe.as_mut().expect("MoE scratch");
            let base = routing.words.len();
            let groups = group_runs(&resident, &routing.words, m.rows, base)
                .filter(|(words, _)| (base + words.len()) as u64 * 4 <= m.route.size())
                .map(|(words, groups)| {
                    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    m.route.bytes_mut()[base * 4..base * 4 + bytes.len()].copy_from_slice(&bytes);
                    groups
                });
            resume = Some((il, routing, resident, groups, off_vram));
        }
        batch.x_ready = false;
        self.count_routed_on_device(batch, &on_device);
        self.last_stats = stats;
        self.last_routing = Vec::new();
        self.last_host_time = None;
        if profiling {
            let host = HostTime {
                step_ns: started.elapsed().as_nanos() as u64,
                wait_ns: waited.as_nanos() as u64,
                cpu_layers_ns: match self.front {
                    Some(_) => self.front_time.as_nanos() as u64,
                    None => 0,
                },
                ..HostTime::default()
            };
            self.profile_after(Some(host))?;
            if let Some(p) = self.last_profile.as_mut() {
                p.submissions_gpu_ns = busy;
            }
        }
        Ok(())
    }

    /// Appends each of a chunk's `n` tokens' position and its sequence's first KV-cache row to
    /// `words` (after its token ids, [`StepWord`](crate::gpu::ops::StepWord)): the selected sequence's next positions, or
    /// with `seqs` each listed sequence's next one (a sequence listed again takes the position
    /// after its previous token's: a step that carries part of a prompt with other sequences'
    /// next tokens, [`GpuModel::eval_mixed`]); then the grid of the chunk's attention
    /// (word `3n` on, [`Recorder::attention_n_grid`]: every token's runs up to its position);
    /// sets the chunk's end and whether it is ragged.
    pub(super) fn position_words(
        &self,
        batch: &mut Batch,
        words: &mut Vec<u8>,
        n: usize,
        seqs: Option<&[usize]>,
    ) {
        let at: Vec<(usize, usize)> = match seqs {
            None => (0..n).map(|t| (self.pos() + t, self.seq)).collect(),
            Some(seqs) => {
                let mut next = std::collections::HashMap::new();
                seqs.iter()
                    .map(|&s| {
                        let pos = next.entry(s).or_insert(self.positions[s]);
                        *pos += 1;
                        (*pos - 1, s)
                    })
                    .collect()
            }
        };
        for &(pos, seq) in &at {
            words.extend_from_slice(&(pos as u32).to_le_bytes());
            words.extend_from_slice(&self.seq_row(seq).to_le_bytes());
        }
        batch.end = at.iter().map(|&(pos, _)| pos + 1).max().unwrap_or(0);
        batch.ragged = seqs.is_some();
        batch.cpu_turns = seqs.is_some();
        let last = batch.end.saturating_sub(1) as u32;
        let [heads, runs, _] = attention_grid(self.attention_args(), last);
        for w in [heads, runs, n as u32] {
            words.extend_from_slice(&w.to_le_bytes());
        }
    }
}
