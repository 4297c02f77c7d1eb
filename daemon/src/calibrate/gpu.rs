//! The GPU half of calibration, on one Vulkan device.

use std::sync::Arc;

use ash::vk;
use spillway_sched::model::WeightType;

use super::{ggml_type, median_seconds, random_matrix, CalibrateError};
use crate::gpu::ops::GpuMatrix;
use crate::gpu::upload::DEFAULT_STAGING_BYTES;
use crate::gpu::{Allocator, Buffer, Device, DeviceInfo, Instance, Kernels, MemoryUse, Uploader};

pub struct GpuBench {
    device: Arc<Device>,
    allocator: Arc<Allocator>,
    kernels: Arc<Kernels>,
}

impl GpuBench {
    /// Opens device `index` (the preferred device when `None`).
    pub fn open(index: Option<usize>) -> Result<GpuBench, CalibrateError> {
        Ok(GpuBench::on(Device::open(Instance::new()?, index)?))
    }

    /// Measures `device`.
    pub fn on(device: Arc<Device>) -> GpuBench {
        GpuBench {
            allocator: Allocator::new(&device, None),
            kernels: Kernels::new(&device),
            device,
        }
    }

    pub fn info(&self) -> &DeviceInfo {
        self.device.info()
    }

    /// Seconds to copy `from` into `to` (`bytes` of each), submit included.
    fn copy(&self, from: &Buffer, to: &Buffer, bytes: u64) -> Result<f64, CalibrateError> {
        let raw = &self.device.raw;
        Ok(median_seconds(|| {
            self.device.run_once(|cmd| {
                let region = [vk::BufferCopy {
                    src_offset: 0,
                    dst_offset: 0,
                    size: bytes,
                }];
                // SAFETY: `cmd` is recording, both buffers outlive the submission (run_once
                // waits for it), and the region lies inside both (each holds `bytes`).
                unsafe { raw.cmd_copy_buffer(cmd, from.raw, to.raw, &region) };
            })
        })?)
    }

    /// Device-memory traffic of `bytes` through the simplest streaming kernel, `a += b` (each
    /// element read twice and written once: 12 bytes), timed by GPU timestamps where the queue
    /// has them, so the submit does not blur it.
    pub fn read(&mut self, bytes: u64) -> Result<f64, CalibrateError> {
        // The add kernel's grid is one dimension of at most 65535 groups of 256.
        const CHUNK: u64 = 65535 * 256;
        let mut left = (bytes / 12).max(256);
        let mut pairs = Vec::new();
        while left > 0 {
            let n = left.min(CHUNK);
            let a = Buffer::new_in(&self.allocator, n * 4, MemoryUse::DeviceLocal)?;
            let b = Buffer::new_in(&self.allocator, n * 4, MemoryUse::DeviceLocal)?;
            pairs.push((a, b, n as u32));
            left -= n;
        }
        self.gpu_seconds(|r| {
            for (a, b, n) in &pairs {
                r.add(a, b, *n)?;
            }
            Ok(())
        })
    }

    /// Median seconds of recordings of `f`: GPU time from timestamps where the queue has them,
    /// else wall time (which includes the submit).
    fn gpu_seconds(
        &self,
        f: impl Fn(&mut crate::gpu::Recorder<'_>) -> Result<(), crate::gpu::GpuError>,
    ) -> Result<f64, CalibrateError> {
        let mut gpu_s = Vec::new();
        let wall = median_seconds(|| {
            let stats = self.kernels.record_timed(&f)?;
            if let Some(ns) = stats.gpu_ns {
                gpu_s.push(ns as f64 * 1e-9);
            }
            Ok::<(), CalibrateError>(())
        })?;
        // The first entry is the warm-up's.
        let mut timed: Vec<f64> = gpu_s.into_iter().skip(1).collect();
        timed.sort_by(f64::total_cmp);
        Ok(timed.get(timed.len() / 2).copied().unwrap_or(wall))
    }

    /// `batch` products of a `k`-wide, `n`-tall matrix of `t` with a vector, in one command
    /// buffer; GPU time from timestamps where the queue has them, else wall time.
    pub fn matvec(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        batch: u64,
    ) -> Result<f64, CalibrateError> {
        let ty = ggml_type(t)?;
        let data = random_matrix(ty, k, n)?;
        let mut uploader = Uploader::new(&self.allocator, DEFAULT_STAGING_BYTES)?;
        let w = GpuMatrix::upload(
            &self.allocator,
            &mut uploader,
            ty,
            k as usize,
            n as usize,
            &data,
        )?;
        let mut x = Buffer::new_in(&self.allocator, k * 4, MemoryUse::Staging)?;
        x.write_f32(&vec![0.5; k as usize]);
        let y = Buffer::new_in(&self.allocator, n * 4, MemoryUse::DeviceLocal)?;
        uploader.flush()?;
        self.gpu_seconds(|r| {
            for _ in 0..batch {
                r.matvec(&w, &x, &y)?;
            }
            Ok(())
        })
    }

    /// An empty command buffer submitted and waited for.
    pub fn submit(&mut self) -> Result<f64, CalibrateError> {
        Ok(median_seconds(|| self.device.run_once(|_| {}))?)
    }

    /// `bytes` from host-visible staging memory into device-local memory.
    pub fn host_to_device(&mut self, bytes: u64) -> Result<f64, CalibrateError> {
        let bytes = bytes.max(4) & !3;
        let src = Buffer::new_in(&self.allocator, bytes, MemoryUse::Staging)?;
        let dst = Buffer::new_in(&self.allocator, bytes, MemoryUse::DeviceLocal)?;
        self.copy(&src, &dst, bytes)
    }
}
