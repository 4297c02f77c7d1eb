//! Weight block formats (`#[repr(C)]` blocks with compile-time size checks) and dequantization.
//!
//! Everything here is the scalar reference: it reproduces ggml's `dequantize_row_*` and
//! `quantize_row_*_ref` bit for bit (same operations in the same order), so that CPU kernels,
//! GPU shaders and llama.cpp fixtures can all be checked against it. SIMD dot products will sit
//! beside each format (`blocks.rs`, `k_quants.rs`), with these block methods as their reference.
//!
//! Blocks in a model file are read by copying their fields out of the (possibly unaligned)
//! mapped bytes with [`BlockFormat::from_bytes`]; nothing here reinterprets `&[u8]` as blocks.

mod blocks;
mod float;
mod k_quants;

#[cfg(test)]
mod tests;

use thiserror::Error;

use crate::gguf::GgmlType;

pub use blocks::{BlockQ4_0, BlockQ8_0};
pub use float::{bf16_to_fp32, fp16_to_fp32, fp32_to_bf16, fp32_to_fp16};
pub(crate) use k_quants::scale_min_k4;
pub use k_quants::{BlockQ4K, BlockQ6K};

/// Why a row could not be converted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuantError {
    #[error("conversion of {0} tensors is not implemented")]
    Unsupported(GgmlType),
    #[error("{ty}: {elements} elements is not a whole number of {block_size}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        elements: usize,
        block_size: usize,
    },
    #[error("{ty}: {elements} elements take {expected} bytes, but the buffer has {actual}")]
    ByteLength {
        ty: GgmlType,
        elements: usize,
        expected: usize,
        actual: usize,
    },
}

/// A quantized block as ggml lays it out: `BLOCK_SIZE` weights in `BLOCK_BYTES` bytes.
pub trait BlockFormat: Copy {
    const TYPE: GgmlType;
    /// Weights per block.
    const BLOCK_SIZE: usize;
    /// Bytes per block in the file; equal to `size_of::<Self>()` (checked at compile time).
    const BLOCK_BYTES: usize;

    /// Copies one block out of exactly `BLOCK_BYTES` little-endian bytes, at any alignment.
    ///
    /// # Panics
    /// If `bytes.len() != BLOCK_BYTES`.
    fn from_bytes(bytes: &[u8]) -> Self;

    /// Writes the block into exactly `BLOCK_BYTES` bytes, in the file's layout.
    ///
    /// # Panics
    /// If `out.len() != BLOCK_BYTES`.
    fn write_bytes(&self, out: &mut [u8]);

    /// Expands the block into `out[..BLOCK_SIZE]`, exactly as ggml's `dequantize_row_*`.
    ///
    /// # Panics
    /// If `out.len() != BLOCK_SIZE`.
    fn dequantize(&self, out: &mut [f32]);
}

/// A format with a reference quantizer matching ggml's `quantize_row_*_ref`.
///
/// Only Q8_0 and Q4_0 have one for now: the K-quant quantizers (with their iterative scale
/// search) are not needed until the project writes K-quant files itself.
pub trait QuantizeBlock: BlockFormat {
    /// Quantizes `src[..BLOCK_SIZE]` into one block.
    ///
    /// # Panics
    /// If `src.len() != BLOCK_SIZE`.
    fn quantize(src: &[f32]) -> Self;
}

/// Dequantizes one row: `src` holds `dst.len()` weights of type `ty` in ggml's layout.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let convert: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => float::dequantize_f32,
        GgmlType::F16 => float::dequantize_f16,
        GgmlType::BF16 => float::dequantize_bf16,
        GgmlType::Q8_0 => dequantize_blocks::<BlockQ8_0>,
        GgmlType::Q4_0 => dequantize_blocks::<BlockQ4_0>,
        GgmlType::Q4K => dequantize_blocks::<BlockQ4K>,
        GgmlType::Q6K => dequantize_blocks::<BlockQ6K>,
        other => return Err(QuantError::Unsupported(other)),
    };
    check_geometry(ty, dst.len(), src.len())?;
    convert(src, dst);
    Ok(())
}

/// Quantizes one row of `src.len()` weights into `dst`, in ggml's layout for `ty`.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    let convert: fn(&[f32], &mut [u8]) = match ty {
        GgmlType::F32 => float::quantize_f32,
        GgmlType::F16 => float::quantize_f16,
        GgmlType::BF16 => float::quantize_bf16,
        GgmlType::Q8_0 => quantize_blocks::<BlockQ8_0>,
        GgmlType::Q4_0 => quantize_blocks::<BlockQ4_0>,
        other => return Err(QuantError::Unsupported(other)),
    };
    check_geometry(ty, src.len(), dst.len())?;
    convert(src, dst);
    Ok(())
}

/// Checks that `elements` weights of `ty` are whole blocks taking exactly `bytes` bytes.
fn check_geometry(ty: GgmlType, elements: usize, bytes: usize) -> Result<(), QuantError> {
    // Block geometry is at most 256 elements and 292 bytes, so these casts are lossless.
    let block_size = ty.block_size() as usize;
    let block_bytes = ty.block_bytes() as usize;
    if !elements.is_multiple_of(block_size) {
        return Err(QuantError::PartialBlock {
            ty,
            elements,
            block_size,
        });
    }
    // Cannot overflow for real slices (at most 8 bytes per element); checked all the same,
    // so that a 32-bit target reports an absurd length instead of wrapping.
    let expected = (elements / block_size).checked_mul(block_bytes);
    if expected != Some(bytes) {
        return Err(QuantError::ByteLength {
            ty,
            elements,
            expected: expected.unwrap_or(usize::MAX),
            actual: bytes,
        });
    }
    Ok(())
}

/// Dequantizes whole blocks; the caller has checked that the lengths match.
fn dequantize_blocks<B: BlockFormat>(src: &[u8], dst: &mut [f32]) {
    for (bytes, out) in src
        .chunks_exact(B::BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(B::BLOCK_SIZE))
    {
        B::from_bytes(bytes).dequantize(out);
    }
}

/// Quantizes whole blocks; the caller has checked that the lengths match.
fn quantize_blocks<B: QuantizeBlock>(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src
        .chunks_exact(B::BLOCK_SIZE)
        .zip(dst.chunks_exact_mut(B::BLOCK_BYTES))
    {
        B::quantize(x).write_bytes(out);
    }
}
