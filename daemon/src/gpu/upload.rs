//! Filling device-local buffers: bytes go to a host-visible staging buffer, then a copy command
//! moves them. Copies are batched until the staging buffer is full or `flush` is called, and
//! each batch ends with a barrier that makes the copies visible to later compute shaders.

use std::sync::Arc;

use ash::vk;

use super::alloc::{Allocator, MemoryUse};
use super::buffer::Buffer;
use super::error::Result;
use crate::cpu::ThreadPool;

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
        check_upload(dst, dst_offset, data);
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

    /// [`Uploader::upload`] of each `(dst, dst_offset, data)`, the bytes copied into staging
    /// by `pool`'s threads (the host's copies are most of an upload's time when the device's
    /// copy engine is fast). Data larger than the staging goes through `upload`.
    pub fn upload_parallel(
        &mut self,
        pool: &ThreadPool,
        items: &[(&Buffer, u64, &[u8])],
    ) -> Result<()> {
        let cap = self.staging.size();
        let mut group: Vec<(&Buffer, u64, &[u8])> = Vec::new();
        let mut bytes = 0u64;
        for &(dst, dst_offset, data) in items {
            let len = data.len() as u64;
            if len > cap {
                // What is grouped fits the staging left; this goes after it.
                self.stage_group(pool, &group)?;
                group.clear();
                bytes = 0;
                self.upload(dst, dst_offset, data)?;
                continue;
            }
            if self.used + bytes + len > cap {
                self.stage_group(pool, &group)?;
                group.clear();
                bytes = 0;
                self.flush()?;
            }
            group.push((dst, dst_offset, data));
            bytes += len;
        }
        self.stage_group(pool, &group)
    }

    /// Copies `group`, which fits the staging left, into it in parallel and queues its copies.
    fn stage_group(&mut self, pool: &ThreadPool, group: &[(&Buffer, u64, &[u8])]) -> Result<()> {
        /// Bytes a task copies: large enough to amortise a task, small enough to share out.
        const TASK_BYTES: usize = 256 << 10;
        let mut starts = Vec::with_capacity(group.len() + 1);
        let mut total = 0usize;
        for &(dst, dst_offset, data) in group {
            check_upload(dst, dst_offset, data);
            starts.push(total);
            total += data.len();
        }
        starts.push(total);
        if total == 0 {
            return Ok(());
        }
        let at = self.used as usize;
        let region = &mut self.staging.bytes_mut()[at..at + total];
        pool.for_each_chunk(region, TASK_BYTES, &|first, out| {
            // The items this chunk overlaps, in order.
            let mut i = starts.partition_point(|&s| s <= first) - 1;
            let mut done = 0;
            while done < out.len() {
                let pos = first + done;
                let data = group[i].2;
                let from = pos - starts[i];
                let n = (data.len() - from).min(out.len() - done);
                out[done..done + n].copy_from_slice(&data[from..from + n]);
                done += n;
                i += 1;
            }
        });
        for (k, &(dst, dst_offset, data)) in group.iter().enumerate() {
            self.pending.push((
                dst.raw,
                self.used + starts[k] as u64,
                dst_offset,
                data.len() as u64,
            ));
        }
        self.used += total as u64;
        Ok(())
    }

    /// Submits the pending copies and waits for them.
    pub fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let device = self.staging.device().clone();
        // SAFETY: `run_once` waits for the copies before returning.
        device.run_once(|cmd| unsafe { self.record_pending(cmd) })?;
        self.submitted();
        Ok(())
    }

    /// Forgets the pending copies once a recording of them ([`Uploader::record_pending`]) was
    /// submitted: the staging is free for new uploads once that submission completes.
    pub(crate) fn submitted(&mut self) {
        self.pending.clear();
        self.used = 0;
    }

    /// Whether copies wait for [`Uploader::flush`] (or [`Uploader::record_pending`]).
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Records the pending copies, and a barrier that makes them visible to later compute
    /// shaders, into `cmd`. They stay pending until [`Uploader::submitted`] says `cmd` went to
    /// the device (a recording that is never submitted leaves them for the next one).
    ///
    /// # Safety
    /// `cmd` is recording, and, once submitted, completes before this uploader takes another
    /// upload (which overwrites the staging its copies read) and while every destination is
    /// alive.
    pub(crate) unsafe fn record_pending(&self, cmd: vk::CommandBuffer) {
        let dev = &self.staging.device().raw;
        let src = self.staging.raw;
        // SAFETY: the caller's contract; every region lies inside its buffers, as `upload`
        // checked.
        unsafe {
            for &(dst, src_off, dst_off, len) in &self.pending {
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
    }
}

/// An upload's bounds: `data` fits in `dst` at `dst_offset`, both in whole words.
fn check_upload(dst: &Buffer, dst_offset: u64, data: &[u8]) {
    assert!(
        dst_offset + data.len() as u64 <= dst.size(),
        "upload past the buffer"
    );
    assert!(
        dst_offset.is_multiple_of(4) && data.len().is_multiple_of(4),
        "uploads are whole words"
    );
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
