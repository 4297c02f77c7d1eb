//! Prompt chunks through the layers a dense model runs on the CPU ([`crate::gpu::cpu_layers`]):
//! for a chunk of at least [`STREAM_MIN_TOKENS`] tokens those layers run on the GPU too, one at
//! a time through a VRAM slot shaped like a layer. For each layer its weights are copied into
//! the slot (from the memory map, through the upload staging), its keys and values so far into
//! the slot's KV cache; the chunk runs through the slot as through a resident layer; and the
//! chunk's new keys and values are copied back into the CPU's KV cache, where the decode steps
//! after the prompt find them. Each weight then crosses PCIe once per chunk (up to 512 tokens)
//! where the CPU would multiply it with every token.
//!
//! The slot takes the VRAM of one layer, so with it the budget holds one resident layer fewer
//! ([`super::super::placement`]); it is made when every CPU layer has the first one's shapes
//! and weight types (a model whose layers mix types keeps its prompts on the CPU).
//!
//! The layers' arithmetic is the GPU's for the chunk and the CPU's for the decode steps, so a
//! prompt's logits follow the GPU run's and the decode steps' the split's.

use std::sync::Arc;

use half::f16;

use super::prefill::{Batch, PREFILL_CHUNK};
use super::{matrix, GateUp, GpuFfn, GpuLayer, GpuModel};
use crate::gpu::alloc::{Allocator, MemoryUse};
use crate::gpu::buffer::Buffer;
use crate::gpu::error::Result;
use crate::gpu::ops::{f32_bytes, fill_parts, StepWord};
use crate::gpu::upload::Uploader;
use crate::model::{Ffn, Layer, Matrix, Model};

/// Fewest tokens in a chunk that goes through the CPU's layers on the GPU; a shorter one stays
/// on the CPU, where a layer's weights are read once either way.
pub const STREAM_MIN_TOKENS: usize = 32;

/// Whether `model`'s layers `0..n_cpu` can take turns in one slot: dense, with the first one's
/// shapes and weight types.
pub(crate) fn streamable(model: &Model, n_cpu: usize) -> bool {
    let Some(first) = model.layers.first() else {
        return false;
    };
    matches!(first.ffn, Ffn::Dense { .. })
        && model.layers[..n_cpu.min(model.layers.len())]
            .iter()
            .all(|l| same_shape(first, l))
}

fn same_shape(a: &Layer, b: &Layer) -> bool {
    let m = |x: &Matrix, y: &Matrix| {
        (x.ty, x.n_in, x.n_out, x.n_mat) == (y.ty, y.n_in, y.n_out, y.n_mat)
    };
    let v = |x: &Option<Vec<f32>>, y: &Option<Vec<f32>>| {
        x.as_ref().map(Vec::len) == y.as_ref().map(Vec::len)
    };
    let (p, q) = (&a.attn, &b.attn);
    let ffn = match (&a.ffn, &b.ffn) {
        (
            Ffn::Dense { gate, up, down },
            Ffn::Dense {
                gate: g,
                up: u,
                down: d,
            },
        ) => m(gate, g) && m(up, u) && m(down, d),
        _ => false,
    };
    ffn && m(&p.wq, &q.wq)
        && m(&p.wk, &q.wk)
        && m(&p.wv, &q.wv)
        && m(&p.wo, &q.wo)
        && p.norm.len() == q.norm.len()
        && a.ffn_norm.len() == b.ffn_norm.len()
        && v(&p.bq, &q.bq)
        && v(&p.bk, &q.bk)
        && v(&p.bv, &q.bv)
        && v(&p.q_norm, &q.q_norm)
        && v(&p.k_norm, &q.k_norm)
}

/// Host-visible bytes for a chunk's keys and values read back.
pub(crate) fn readback_bytes(kv_width: usize) -> u64 {
    (2 * PREFILL_CHUNK * kv_width * 2) as u64
}

/// One layer's buffers in VRAM that the CPU's layers take in turn for a prompt chunk.
pub(super) struct StreamSlot {
    layer: GpuLayer,
    up: Uploader,
    /// Host-visible: a chunk's keys, then its values, read back from the slot's cache.
    readback: Buffer,
    /// The model layer whose weights the slot holds.
    holds: Option<usize>,
}

impl StreamSlot {
    /// A slot shaped like `model`'s first layer, with a KV cache of `capacity` positions; the
    /// caller has checked [`streamable`].
    pub(super) fn new(
        model: &Model,
        al: &Arc<Allocator>,
        staging_bytes: u64,
        capacity: usize,
    ) -> Result<StreamSlot> {
        let mut up = Uploader::new(al, staging_bytes)?;
        let first = &model.layers[0];
        let Ffn::Dense {
            gate,
            up: w_up,
            down,
        } = &first.ffn
        else {
            unreachable!("streamable layers are dense");
        };
        let ffn = GpuFfn::Dense {
            gate_up: GateUp::upload(model, al, &mut up, gate, w_up)?,
            down: matrix(model, al, &mut up, down)?,
        };
        let kv_bytes = (capacity * model.config.kv_width() * 2) as u64;
        let layer = GpuLayer::upload(model, al, &mut up, first, ffn, kv_bytes)?;
        up.flush()?;
        let readback = Buffer::new_in(
            al,
            readback_bytes(model.config.kv_width()),
            MemoryUse::Staging,
        )?;
        Ok(StreamSlot {
            layer,
            up,
            readback,
            holds: Some(0),
        })
    }

    /// Copies layer `il`'s weights into the slot (unless it holds them) and its keys and values
    /// of positions `0..pos` into the slot's cache.
    fn fill(&mut self, model: &Model, il: usize, (keys, values): (&[f16], &[f16])) -> Result<()> {
        let (s, up) = (&self.layer, &mut self.up);
        if self.holds != Some(il) {
            self.holds = None;
            let l = &model.layers[il];
            let a = &l.attn;
            up.upload(&s.attn_norm, 0, &f32_bytes(&a.norm))?;
            for (g, m) in [
                (&s.wq, &a.wq),
                (&s.wk, &a.wk),
                (&s.wv, &a.wv),
                (&s.wo, &a.wo),
            ] {
                fill_parts(up, &g.buffer, &[model.mat(m).data])?;
            }
            let vectors = [
                (&s.bq, &a.bq),
                (&s.bk, &a.bk),
                (&s.bv, &a.bv),
                (&s.q_norm, &a.q_norm),
                (&s.k_norm, &a.k_norm),
            ];
            for (b, v) in vectors {
                if let (Some(b), Some(v)) = (b, v) {
                    up.upload(b, 0, &f32_bytes(v))?;
                }
            }
            up.upload(&s.ffn_norm, 0, &f32_bytes(&l.ffn_norm))?;
            let (
                GpuFfn::Dense { gate_up, down },
                Ffn::Dense {
                    gate,
                    up: w_up,
                    down: w_down,
                },
            ) = (&s.ffn, &l.ffn)
            else {
                unreachable!("streamable layers are dense");
            };
            match gate_up {
                GateUp::Stacked(m) => {
                    let parts = [model.mat(gate).data, model.mat(w_up).data];
                    fill_parts(up, &m.buffer, &parts)?;
                }
                GateUp::Apart { gate: g, up: u } => {
                    fill_parts(up, &g.buffer, &[model.mat(gate).data])?;
                    fill_parts(up, &u.buffer, &[model.mat(w_up).data])?;
                }
            }
            fill_parts(up, &down.buffer, &[model.mat(w_down).data])?;
        }
        if !keys.is_empty() {
            up.upload(&s.k_cache, 0, &f16_bytes(keys))?;
            up.upload(&s.v_cache, 0, &f16_bytes(values))?;
        }
        up.flush()?;
        self.holds = Some(il);
        Ok(())
    }
}

fn f16_bytes(values: &[f16]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect()
}

fn f16s(bytes: &[u8]) -> Vec<f16> {
    bytes
        .chunks_exact(2)
        .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])))
        .collect()
}

impl GpuModel {
    /// Whether a prompt chunk of `n` tokens goes through the CPU's layers on the GPU.
    pub(super) fn streams_chunk(&self, n: usize) -> bool {
        self.stream.is_some() && self.front.is_some() && n >= STREAM_MIN_TOKENS
    }

    /// Runs the chunk `tokens` (at the current position; `batch.step` holds its rows) through
    /// the CPU's layers on the GPU, one layer at a time through the slot (see the module's
    /// notes), leaving their output in `batch.x` and their keys and values in the CPU's cache.
    pub(super) fn stream_front(&mut self, batch: &mut Batch, tokens: &[u32]) -> Result<()> {
        let mut slot = self.stream.take().expect("streams_chunk");
        let ran = self.stream_layers(&mut slot, batch, tokens);
        self.stream = Some(slot);
        ran
    }

    fn stream_layers(
        &mut self,
        slot: &mut StreamSlot,
        batch: &mut Batch,
        tokens: &[u32],
    ) -> Result<()> {
        let (n, pos) = (tokens.len(), self.pos());
        let kvw = self.config.kv_width();
        let front = self.front.as_ref().expect("streams_chunk");
        let model = front.model().clone();
        let x = front.embed(tokens)?;
        batch.input_mut().buffer.write_f32(&x);
        let bytes = (n * kvw * 2) as u64;
        let at = (pos * kvw * 2) as u64;
        for il in 0..front_layers(self) {
            let front = self.front.as_mut().expect("streams_chunk");
            let kv = front.kv_mut();
            let history = (kv.keys(il, pos), kv.values(il, pos));
            slot.fill(&model, il, history)?;
            let b = &*batch;
            self.kernels.record(|rec| {
                rec.after_host_writes();
                if il == 0 {
                    let ids = StepWord {
                        buffer: b.step(),
                        index: 0,
                    };
                    rec.get_rows_n(b.input(), ids, n as u32, b.x())?;
                }
                let l = &slot.layer;
                self.record_chunk_attention(rec, b, l, n)?;
                let GpuFfn::Dense { gate_up, down } = &l.ffn else {
                    unreachable!("streamable layers are dense");
                };
                self.record_chunk_ffn(rec, b, l, (gate_up, down), n)?;
                rec.copy((&l.k_cache, at), (&slot.readback, 0), bytes)?;
                rec.copy((&l.v_cache, at), (&slot.readback, bytes), bytes)
            })?;
            let out = slot.readback.bytes();
            let (k, v) = (
                f16s(&out[..bytes as usize]),
                f16s(&out[bytes as usize..][..bytes as usize]),
            );
            let front = self.front.as_mut().expect("streams_chunk");
            front.kv_mut().store_f16(il, pos, &k, &v);
        }
        batch.set_x_ready();
        self.streamed_chunks += 1;
        Ok(())
    }
}

fn front_layers(m: &GpuModel) -> usize {
    m.front.as_ref().map_or(0, |f| f.n_layers())
}
