//! Filling device-local buffers: bytes go to a host-visible staging buffer, then a copy command
//! moves them. Copies are batched until the staging buffer is full or `flush` is called, and
//! each batch ends with a barrier that makes the copies visible to later compute shaders.

use std::sync::Arc;

use ash::vk;

use super::alloc::{Allocator, MemoryUse};
use super::buffer::Buffer;
use super::error::Result;

/// Staging bytes per batch of copies.
pub const DEFAULT_STAGING_BYTES: u64 = 32 << 20;

pub struct Uploader {
    staging: Buffer,
    /// Bytes of `staging` in use by copies not yet submitted.
    used: u64,
    /// (destination, staging offset, destination offset, length) of the pending copies.
    pending: Vec<(vk::Buffer, u64, u64, u64)>,
}

impl Uploader {
    pub fn new(allocator: &Arc<Allocator>, staging_bytes: u64) -> Result<Uploader> {
        Ok(Uploader {
            staging: Buffer::new_in(allocator, staging_bytes, MemoryUse::Staging)?,
            used: 0,
            pending: Vec::new(),
        })
    }

    /// Copies `data` into `dst` at `dst_offset`. The copy may still be pending when this
    /// returns: `dst` must stay alive until [`Uploader::flush`].
    ///
    /// # Panics
    /// If the data does not fit in `dst` or `dst_offset`/`data.len()` are not multiples of 4.
    pub fn upload(&mut self, dst: &Buffer, dst_offset: u64, data: &[u8]) -> Result<()> {
        assert!(
            dst_offset + data.len() as u64 <= dst.size(),
            "upload past the buffer"
        );
        assert!(
            dst_offset.is_multiple_of(4) && data.len().is_multiple_of(4),
            "uploads are whole words"
        );
        let cap = self.staging.size();
        let mut done = 0usize;
        while done < data.len() {
            if self.used == cap {
                self.flush()?;
            }
            let n = (data.len() - done).min((cap - self.used) as usize);
            let at = self.used as usize;
            self.staging.bytes_mut()[at..at + n].copy_from_slice(&data[done..done + n]);
            self.pending
                .push((dst.raw, self.used, dst_offset + done as u64, n as u64));
            self.used += n as u64;
            done += n;
        }
        Ok(())
    }

    /// Submits the pending copies and waits for them.
    pub fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let dev = &self.staging.device().raw;
        let src = self.staging.raw;
        let pending = std::mem::take(&mut self.pending);
        self.staging.device().run_once(|cmd| {
            // SAFETY: `cmd` is recording; every destination is alive (the caller keeps it until
            // this flush) and every region lies inside its buffers, as `upload` checked.
            unsafe {
                for &(dst, src_off, dst_off, len) in &pending {
                    let region = [vk::BufferCopy {
                        src_offset: src_off,
                        dst_offset: dst_off,
                        size: len,
                    }];
                    dev.cmd_copy_buffer(cmd, src, dst, &region);
                }
                let barrier = vk::MemoryBarrier::default()
                    .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                    .dst_access_mask(vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE);
                dev.cmd_pipeline_barrier(
                    cmd,
                    vk::PipelineStageFlags::TRANSFER,
                    vk::PipelineStageFlags::COMPUTE_SHADER,
                    vk::DependencyFlags::empty(),
                    &[barrier],
                    &[],
                    &[],
                );
            }
        })?;
        self.used = 0;
        Ok(())
    }
}

/// Copies `len` bytes of `src` at `offset` back into host memory through a staging buffer.
pub fn download(
    allocator: &Arc<Allocator>,
    src: &Buffer,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>> {
    let staging = Buffer::new_in(allocator, len, MemoryUse::Staging)?;
    let dev = &src.device().raw;
    src.device().run_once(|cmd| {
        // SAFETY: `cmd` is recording; both buffers are alive until the wait inside `run_once`.
        unsafe {
            let before = vk::MemoryBarrier::default()
                .src_access_mask(vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE)
                .dst_access_mask(vk::AccessFlags::TRANSFER_READ);
            dev.cmd_pipeline_barrier(
                cmd,
                vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::TRANSFER,
                vk::DependencyFlags::empty(),
                &[before],
                &[],
                &[],
            );
            let region = [vk::BufferCopy {
                src_offset: offset,
                dst_offset: 0,
                size: len,
            }];
            dev.cmd_copy_buffer(cmd, src.raw, staging.raw, &region);
            let after = vk::MemoryBarrier::default()
                .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                .dst_access_mask(vk::AccessFlags::HOST_READ);
            dev.cmd_pipeline_barrier(
                cmd,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::HOST,
                vk::DependencyFlags::empty(),
                &[after],
                &[],
                &[],
            );
        }
    })?;
    Ok(staging.bytes()[..len as usize].to_vec())
}
