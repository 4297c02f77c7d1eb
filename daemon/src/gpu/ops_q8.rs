//! Inputs quantized once for the integer-dot-product kernels (`quantize_q8.comp`).
//!
//! A Q4_0 or Q8_0 product in integer dot products multiplies the weights with the inputs
//! quantized to 8 bits (ggml's block_q8_0). Quantized inside the product, every workgroup
//! quantizes every block of the inputs again: a decode step's 4096 inputs are loaded and
//! quantized by each of the hundreds of workgroups of a product, and a product over several
//! tokens does it once per token per workgroup. Where the kernels have a scratch buffer
//! ([`super::Kernels::set_q8_scratch`]), a recording quantizes a product's input vectors once
//! into it ([`Op::QuantizeQ8`]) and the product reads the blocks (the `*Q8` variants of
//! `matvec.comp`). Products that read the same inputs (Q, K and V; an expert's gate and up)
//! share one quantization: the scratch remembers what it holds until those inputs, or the norm
//! weights, are written. The quantized values are those the product would have made itself,
//! so the results are the same bits; with a fused RMSNorm only the order in which Σ x² is
//! summed differs.

use std::sync::Arc;

use ash::vk;
use spillway_shaders::{Feature, Op, QuantizeQ8Params, ShaderId, WeightType};

use super::buffer::Buffer;
use super::error::Result;
use super::record::{Access, Binding, Recorder};

/// Bytes of `n_vec` quantized vectors of `n_in` inputs: a 16-byte header each and 48 bytes a
/// block of 32 (`quant_q8.glsl`).
pub fn q8_bytes(n_in: usize, n_vec: usize) -> u64 {
    (q8_units(n_in) * n_vec) as u64 * 16
}

fn q8_units(n_in: usize) -> usize {
    1 + 3 * (n_in / 32)
}

/// What the scratch holds: `n_vec` vectors of `n_in` floats of buffer `x` from byte
/// `x_offset`, `x_stride` floats apart, times the norm weights `norm` if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    x: vk::Buffer,
    x_offset: u64,
    n_in: usize,
    n_vec: usize,
    x_stride: usize,
    norm: Option<vk::Buffer>,
}

/// What the scratch holds once it quantized those inputs.
fn held(
    x: &Buffer,
    x_offset: u64,
    (n_in, n_vec, x_stride): (usize, usize, usize),
    norm: Option<&Buffer>,
) -> Held {
    Held {
        x: x.raw,
        x_offset,
        n_in,
        n_vec,
        x_stride,
        norm: norm.map(|b| b.raw),
    }
}

/// A recording's scratch for quantized inputs and what it holds.
pub(crate) struct Q8Scratch {
    pub(crate) buffer: Arc<Buffer>,
    pub(crate) holds: Option<Held>,
}

impl Q8Scratch {
    /// Forgets what the scratch holds when a dispatch writes its inputs or norm weights.
    pub(crate) fn forget_written(&mut self, bindings: &[Binding<'_>]) {
        let Some(h) = self.holds else { return };
        let written = |b: &Binding<'_>| {
            b.access == Access::Write && (b.buffer.raw == h.x || Some(b.buffer.raw) == h.norm)
        };
        if bindings.iter().any(written) {
            self.holds = None;
        }
    }
}

/// What a product reads its inputs with: its variant, the scratch where they were quantized
/// (`None`: the product quantizes floats itself) and the step from one input vector to the next
/// in the product's units (floats, or 16-byte units of the scratch).
pub(crate) struct ProductInputs {
    pub(crate) id: ShaderId,
    scratch: Option<Arc<Buffer>>,
    pub(crate) x_stride: u32,
}

impl ProductInputs {
    /// Whether the inputs were quantized before the product (a fused RMSNorm's weights are
    /// then not read by it).
    pub(crate) fn quantized(&self) -> bool {
        self.scratch.is_some()
    }

    /// The binding of the inputs: the quantized vectors, or `floats`.
    pub(crate) fn binding<'b>(&'b self, floats: Binding<'b>) -> Binding<'b> {
        self.scratch.as_deref().map_or(floats, Binding::read)
    }
}

impl Recorder<'_> {
    /// How product `op` ([`Op::MatVec`], [`Op::MatVecId`], [`Op::MatVecCols`] or
    /// [`Op::MatVecRuns`]) of `rows` rows of `wtype` in all (every chosen expert's, every
    /// token's) reads `n_vec` vectors of `n_in` floats of
    /// `x` (from byte `x_offset`, `x_stride` floats apart; 0: one vector for all), times `norm`
    /// if given: where it runs in integer dot products, the kernels have a scratch that fits
    /// them and it has at least [`Kernels::set_q8_min_weights`](super::Kernels::set_q8_min_weights)
    /// weights (`rows` × `n_in`) or the scratch holds them already, the vectors quantized
    /// there (now, unless it holds them) and its `*Q8` variant; otherwise its own variant over
    /// the floats.
    pub(crate) fn product_inputs(
        &mut self,
        (op, wtype, rows): (Op, WeightType, usize),
        x: &Buffer,
        x_offset: u64,
        (n_in, n_vec, x_stride): (usize, usize, usize),
        norm: Option<&Buffer>,
    ) -> Result<ProductInputs> {
        let dims = (n_in, n_vec, x_stride);
        let small = rows.saturating_mul(n_in) < self.q8_min_weights();
        let held = self.q8.as_ref().and_then(|q| q.holds) == Some(held(x, x_offset, dims, norm));
        let quantized = match small && !held {
            true => None,
            false => self.quantize_inputs((op, wtype), x, x_offset, dims, norm)?,
        };
        match quantized {
            Some((id, scratch, units)) => Ok(ProductInputs {
                id,
                scratch: Some(scratch),
                x_stride: if x_stride == 0 { 0 } else { units },
            }),
            None => Ok(ProductInputs {
                id: self.variant(op, Some(wtype))?,
                scratch: None,
                x_stride: x_stride as u32,
            }),
        }
    }

    /// [`Recorder::product_inputs`] where the inputs are quantized: the `*Q8` variant, the
    /// scratch and the 16-byte units of one quantized vector.
    fn quantize_inputs(
        &mut self,
        (op, wtype): (Op, WeightType),
        x: &Buffer,
        x_offset: u64,
        (n_in, n_vec, x_stride): (usize, usize, usize),
        norm: Option<&Buffer>,
    ) -> Result<Option<(ShaderId, Arc<Buffer>, u32)>> {
        let Some(id) = self.q8_variant(op, wtype) else {
            return Ok(None);
        };
        let Some(q8) = &self.q8 else { return Ok(None) };
        let x_bytes = ((n_vec.max(1) - 1) * x_stride + n_in) as u64 * 4;
        if n_vec == 0
            || !n_in.is_multiple_of(32)
            || !x_stride.is_multiple_of(4)
            || q8_bytes(n_in, n_vec) > q8.buffer.size().min(self.max_range)
            || x_offset + x_bytes > x.size()
            || x_bytes > self.max_range
        {
            return Ok(None);
        }
        let held = held(x, x_offset, (n_in, n_vec, x_stride), norm);
        let scratch = q8.buffer.clone();
        let units = q8_units(n_in) as u32;
        if q8.holds != Some(held) {
            let quantize = self.variant(Op::QuantizeQ8, None)?;
            let push = QuantizeQ8Params {
                n_in: n_in as u32,
                n_vec: n_vec as u32,
                x_stride: x_stride as u32,
                q_stride: units,
            };
            let bindings = [
                Binding {
                    buffer: x,
                    offset: x_offset,
                    range: x_bytes,
                    access: Access::Read,
                },
                Binding {
                    range: q8_bytes(n_in, n_vec),
                    ..Binding::write(&scratch)
                },
                Binding::read(norm.unwrap_or(x)),
            ];
            let spec = [u32::from(norm.is_some())];
            self.dispatch_spec(quantize, &spec, &bindings, &push, [n_vec as u32, 1, 1])?;
            if let Some(q8) = &mut self.q8 {
                q8.holds = Some(held);
            }
        }
        Ok(Some((id, scratch, units)))
    }

    /// Forgets what the scratch holds (the host or a copy may have written anything).
    pub(crate) fn forget_q8(&mut self) {
        if let Some(q8) = &mut self.q8 {
            q8.holds = None;
        }
    }

    /// The `*Q8` variant of product `op` on `wtype` where this recording quantizes inputs
    /// first: the kernels have a scratch and run `op` in integer dot products.
    fn q8_variant(&self, op: Op, wtype: WeightType) -> Option<ShaderId> {
        self.q8.as_ref()?;
        let q8_op = match op {
            Op::MatVec => Op::MatVecQ8,
            Op::MatVecId => Op::MatVecIdQ8,
            Op::MatVecCols => Op::MatVecColsQ8,
            Op::MatVecRuns => Op::MatVecRunsQ8,
            _ => return None,
        };
        let feature = self.variant(op, Some(wtype)).ok()?.info().feature;
        match feature {
            Feature::IntDot | Feature::IntDotSubgroup => {
                ShaderId::find(q8_op, Some(wtype), feature)
            }
            _ => None,
        }
    }
}
