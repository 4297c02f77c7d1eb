//! Timestamp queries around a recording ([`super::Kernels::record_timed`]).

use std::sync::Arc;

use ash::vk;

use crate::gpu::device::Device;
use crate::gpu::error::{map_vk, Result};

/// Two timestamp queries around a recording.
pub(super) struct Timer {
    pool: vk::QueryPool,
    device: Arc<Device>,
}

impl Timer {
    pub(super) fn new(device: &Arc<Device>) -> Result<Timer> {
        let info = vk::QueryPoolCreateInfo::default()
            .query_type(vk::QueryType::TIMESTAMP)
            .query_count(2);
        // SAFETY: a valid create info; the pool is destroyed in `Drop`.
        let pool = unsafe { device.raw.create_query_pool(&info, None) }.map_err(map_vk)?;
        Ok(Timer {
            pool,
            device: device.clone(),
        })
    }

    pub(super) fn begin(&self, cmd: vk::CommandBuffer) {
        self.reset_and_start(cmd, vk::PipelineStageFlags::TOP_OF_PIPE);
    }

    /// [`Timer::begin`] in the middle of a recording: the first timestamp is written once
    /// every command before it has completed.
    pub(super) fn begin_after(&self, cmd: vk::CommandBuffer) {
        self.reset_and_start(cmd, vk::PipelineStageFlags::BOTTOM_OF_PIPE);
    }

    /// Resets the queries and writes the first timestamp at `stage`.
    fn reset_and_start(&self, cmd: vk::CommandBuffer, stage: vk::PipelineStageFlags) {
        // SAFETY: `cmd` is recording; the pool has two queries.
        unsafe {
            self.device.raw.cmd_reset_query_pool(cmd, self.pool, 0, 2);
            self.device
                .raw
                .cmd_write_timestamp(cmd, stage, self.pool, 0);
        }
    }

    pub(super) fn end(&self, cmd: vk::CommandBuffer) {
        // SAFETY: as `begin`.
        unsafe {
            self.device.raw.cmd_write_timestamp(
                cmd,
                vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                self.pool,
                1,
            );
        }
    }

    /// Nanoseconds between the two timestamps, once the recording has completed.
    pub(super) fn elapsed_ns(&self) -> Result<Option<u64>> {
        let mut ticks = [0u64; 2];
        // SAFETY: both queries were written by a completed submission.
        unsafe {
            self.device.raw.get_query_pool_results(
                self.pool,
                0,
                &mut ticks,
                vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT,
            )
        }
        .map_err(map_vk)?;
        let period = f64::from(self.device.limits.timestamp_period);
        Ok((period > 0.0).then(|| (ticks[1].wrapping_sub(ticks[0]) as f64 * period) as u64))
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: the submission that used the pool has completed.
        unsafe { self.device.raw.destroy_query_pool(self.pool, None) };
    }
}
