//! Weights on the device: a model's matrices (and stacks of experts' matrices) uploaded to
//! device-local memory, or kept in host-visible system RAM for the GPU to read over the bus, in
//! the layout the matrix-vector kernels read.

use std::sync::Arc;

use spillway_shaders::WeightType;

use super::alloc::{Allocator, MemoryUse};
use super::buffer::Buffer;
use super::error::{GpuError, Result};
use super::upload::Uploader;
use crate::gguf::GgmlType;

/// The shader weight type of a GGUF type, if the GPU kernels read it.
pub fn weight_type(ty: GgmlType) -> Option<WeightType> {
    Some(match ty {
        GgmlType::F32 => WeightType::F32,
        GgmlType::F16 => WeightType::F16,
        GgmlType::Q8_0 => WeightType::Q8_0,
        GgmlType::Q4_0 => WeightType::Q4_0,
        GgmlType::Q4K => WeightType::Q4K,
        GgmlType::Q6K => WeightType::Q6K,
        _ => return None,
    })
}

/// A weight matrix in device-local memory: `n_out` rows of `n_in` weights, in the file's
/// encoding.
pub struct GpuMatrix {
    pub buffer: Buffer,
    pub wtype: WeightType,
    pub n_in: usize,
    pub n_out: usize,
    pub row_bytes: u64,
}

impl GpuMatrix {
    /// Uploads `data` (rows of `ty`) into a new device-local buffer. The copy may still be
    /// pending in `uploader` when this returns.
    pub fn upload(
        allocator: &Arc<Allocator>,
        uploader: &mut Uploader,
        ty: GgmlType,
        n_in: usize,
        n_out: usize,
        data: &[u8],
    ) -> Result<GpuMatrix> {
        let m = GpuMatrix::upload_stack(allocator, uploader, ty, n_in, &[data])?;
        assert_eq!(m.n_out, n_out, "matrix bytes");
        Ok(m)
    }

    /// Uploads matrices of the same type and width as one, the rows of `parts[0]` first (a GLU
    /// stack: gate rows, then up rows).
    pub fn upload_stack(
        allocator: &Arc<Allocator>,
        uploader: &mut Uploader,
        ty: GgmlType,
        n_in: usize,
        parts: &[&[u8]],
    ) -> Result<GpuMatrix> {
        let (wtype, row_bytes, len) = stack_layout(ty, n_in, parts)?;
        let buffer = Buffer::new_in(allocator, len as u64, MemoryUse::DeviceLocal)?;
        fill_parts(uploader, &buffer, parts)?;
        Ok(GpuMatrix {
            buffer,
            wtype,
            n_in,
            n_out: (len as u64 / row_bytes) as usize,
            row_bytes,
        })
    }

    /// Matrices of the same type and width as one (as [`GpuMatrix::upload_stack`]), in a buffer
    /// of system RAM that the GPU reads over the bus ([`Buffer::new_host_memory`]), copied
    /// there by the host's threads: MoE experts that have no VRAM slot.
    pub fn in_host_memory(
        device: &Arc<super::device::Device>,
        ty: GgmlType,
        n_in: usize,
        parts: &[&[u8]],
    ) -> Result<GpuMatrix> {
        let (wtype, row_bytes, len) = stack_layout(ty, n_in, parts)?;
        let mut buffer = Buffer::new_host_memory(device, len as u64)?;
        let dst = buffer.bytes_mut();
        let (filled, rest) = dst.split_at_mut(len);
        rest.fill(0);
        let mut pieces = Vec::new();
        let mut left = filled;
        for p in parts {
            let (d, r) = left.split_at_mut(p.len());
            pieces.push((d, *p));
            left = r;
        }
        copy_parallel(pieces);
        Ok(GpuMatrix {
            buffer,
            wtype,
            n_in,
            n_out: (len as u64 / row_bytes) as usize,
            row_bytes,
        })
    }
}

/// The weight type, row bytes and total bytes of matrices of type `ty` and width `n_in` laid
/// one after another from `parts` (each whole rows).
fn stack_layout(ty: GgmlType, n_in: usize, parts: &[&[u8]]) -> Result<(WeightType, u64, usize)> {
    let wtype =
        weight_type(ty).ok_or_else(|| GpuError::Unsupported(format!("{ty} weights on the GPU")))?;
    let row_bytes = ty
        .row_bytes(n_in as u64)
        .filter(|_| n_in.is_multiple_of(32))
        .ok_or_else(|| GpuError::Unsupported(format!("rows of {n_in} {ty} weights")))?;
    let len: usize = parts.iter().map(|p| p.len()).sum();
    assert!(
        parts
            .iter()
            .all(|p| (p.len() as u64).is_multiple_of(row_bytes)),
        "matrix bytes"
    );
    Ok((wtype, row_bytes, len))
}

/// Copies each `(destination, source)` pair, large ones cut into pieces spread over the
/// machine's threads (one thread copies from a memory map at a fraction of memory speed).
pub(crate) fn copy_parallel(pairs: Vec<(&mut [u8], &[u8])>) {
    const PIECE: usize = 8 << 20;
    let mut jobs: Vec<(&mut [u8], &[u8])> = Vec::new();
    for (d, s) in pairs {
        jobs.extend(d.chunks_mut(PIECE).zip(s.chunks(PIECE)));
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len());
    if threads <= 1 {
        jobs.into_iter().for_each(|(d, s)| d.copy_from_slice(s));
        return;
    }
    let per = jobs.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut rest = jobs;
        while !rest.is_empty() {
            let tail = rest.split_off(per.min(rest.len()));
            let mine = std::mem::replace(&mut rest, tail);
            scope.spawn(move || mine.into_iter().for_each(|(d, s)| d.copy_from_slice(s)));
        }
    });
}

/// Copies `parts` one after another into `buffer` from its start (a matrix's bytes, or a GLU
/// stack's). Uploads are whole words: a length that is not is padded with zeros, which the
/// buffer (rounded up to words) has room for.
pub(crate) fn fill_parts(uploader: &mut Uploader, buffer: &Buffer, parts: &[&[u8]]) -> Result<()> {
    if parts.iter().all(|p| p.len().is_multiple_of(4)) {
        let mut at = 0u64;
        for p in parts {
            uploader.upload(buffer, at, p)?;
            at += p.len() as u64;
        }
    } else {
        let mut padded = parts.concat();
        padded.resize(padded.len().next_multiple_of(4), 0);
        uploader.upload(buffer, 0, &padded)?;
    }
    Ok(())
}

/// The little-endian bytes of `values`, as an f32 buffer holds them.
pub(crate) fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A device-local f32 vector filled from the host.
pub fn upload_f32(
    allocator: &Arc<Allocator>,
    uploader: &mut Uploader,
    values: &[f32],
) -> Result<Buffer> {
    let buffer = Buffer::new_in(allocator, values.len() as u64 * 4, MemoryUse::DeviceLocal)?;
    uploader.upload(&buffer, 0, &f32_bytes(values))?;
    Ok(buffer)
}
