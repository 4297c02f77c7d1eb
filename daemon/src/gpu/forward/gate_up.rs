//! A dense FFN's gate and up matrices on the GPU, stacked where one dispatch can turn them into
//! SwiGLU's output (`Recorder::matvec_fused` with `glu`).

use std::sync::Arc;

use super::matrix;
use crate::gpu::alloc::Allocator;
use crate::gpu::error::Result;
use crate::gpu::ops::GpuMatrix;
use crate::gpu::upload::Uploader;
use crate::model::{Matrix, Model};

/// A dense FFN's gate and up matrices: one stack (gate rows, then up rows) that a single
/// dispatch turns into SwiGLU's output, where both have one type and the stack fits one binding;
/// else two matrices.
pub(super) enum GateUp {
    Stacked(GpuMatrix),
    Apart { gate: GpuMatrix, up: GpuMatrix },
}

impl GateUp {
    pub(super) fn upload(
        model: &Model,
        alloc: &Arc<Allocator>,
        up: &mut Uploader,
        gate: &Matrix,
        w_up: &Matrix,
    ) -> Result<GateUp> {
        let (g, u) = (model.mat(gate), model.mat(w_up));
        let bytes = (g.data.len() + u.data.len()) as u64;
        if g.ty == u.ty
            && g.n_in == u.n_in
            && g.n_out == u.n_out
            && bytes <= alloc.device().max_storage_buffer_range()
        {
            let stack = GpuMatrix::upload_stack(alloc, up, g.ty, g.n_in, &[g.data, u.data])?;
            return Ok(GateUp::Stacked(stack));
        }
        Ok(GateUp::Apart {
            gate: matrix(model, alloc, up, gate)?,
            up: matrix(model, alloc, up, w_up)?,
        })
    }

    /// Rows of the gate matrix: the FFN's width.
    pub(super) fn n_ff(&self) -> usize {
        match self {
            GateUp::Stacked(m) => m.n_out / 2,
            GateUp::Apart { gate, .. } => gate.n_out,
        }
    }
}
