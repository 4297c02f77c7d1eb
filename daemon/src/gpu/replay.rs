//! A recording kept and submitted again for every step.
//!
//! A decode step records hundreds of dispatches (a 32-layer model: over 500), and recording them
//! costs the host a descriptor set, its update and four commands each, every token, while the
//! device waits. The step's shapes do not change from one token to the next: only the token id
//! and the position do, and the kernels read those from a small host-visible buffer when they run
//! ([`super::ops::StepWord`]). So the step is recorded once and each token is a write of two
//! words, a submission and a wait.
//!
//! A [`Replay`] owns its command buffer, the descriptor sets it binds and a fence. What it binds
//! must outlive it: its owner keeps the buffers (a [`super::forward::GpuModel`] holds both).

use std::sync::Arc;

use ash::vk;

use super::chain::wait_fence;
use super::device::Device;
use super::error::{map_vk, Result};
use super::lost::LossPoint;
use super::pipeline::ComputePipeline;
use super::record::{DescriptorArena, RecordStats};

/// A recorded command buffer, submitted by [`Replay::run`] as often as needed.
pub struct Replay {
    device: Arc<Device>,
    cmd: vk::CommandBuffer,
    fence: vk::Fence,
    stats: RecordStats,
    // Freed after the command buffer (in `Drop`), which refers to them.
    _arena: DescriptorArena,
    _pipelines: Vec<Arc<ComputePipeline>>,
}

impl Replay {
    /// Records `record` into a command buffer that can be submitted many times (one at a time).
    /// Nothing runs yet.
    pub(super) fn new(
        device: &Arc<Device>,
        record: impl FnOnce(
            vk::CommandBuffer,
        )
            -> Result<(RecordStats, DescriptorArena, Vec<Arc<ComputePipeline>>)>,
    ) -> Result<Replay> {
        let dev = &device.raw;
        // Recording into a command buffer needs its pool synchronised too: the lock is held
        // until the recording ends (the recording itself never takes it).
        let pool = device.pool.lock();
        let cmd = device.allocate_commands(&pool, 1)?[0];
        let free = || {
            // SAFETY: `cmd` was never submitted; the pool's lock is held.
            unsafe { dev.free_command_buffers(*pool, &[cmd]) };
        };
        // No ONE_TIME_SUBMIT: the buffer is submitted again after each completion.
        let begin = vk::CommandBufferBeginInfo::default();
        // SAFETY: `cmd` is a freshly allocated primary command buffer of this device.
        if let Err(e) = unsafe { dev.begin_command_buffer(cmd, &begin) } {
            free();
            return Err(map_vk(e));
        }
        let recorded = record(cmd);
        // SAFETY: recording began above.
        let ended = unsafe { dev.end_command_buffer(cmd) };
        let (stats, arena, pipelines) = match (recorded, ended) {
            (Ok(r), Ok(())) => r,
            (Err(e), _) => {
                free();
                return Err(e);
            }
            (Ok(_), Err(e)) => {
                free();
                return Err(map_vk(e));
            }
        };
        drop(pool);
        // SAFETY: `dev` is live.
        let fence = match unsafe { dev.create_fence(&vk::FenceCreateInfo::default(), None) } {
            Ok(f) => f,
            Err(e) => {
                let pool = device.pool.lock();
                // SAFETY: `cmd` was never submitted; the pool's lock is held.
                unsafe { dev.free_command_buffers(*pool, &[cmd]) };
                return Err(map_vk(e));
            }
        };
        Ok(Replay {
            device: device.clone(),
            cmd,
            fence,
            stats,
            _arena: arena,
            _pipelines: pipelines,
        })
    }

    /// The recorded command buffer, for a submission that puts it ahead of other work
    /// ([`super::record::ChainReplay::start`]); not pending when that submission is made.
    pub(super) fn command_buffer(&self) -> vk::CommandBuffer {
        self.cmd
    }

    /// Dispatches, barriers and submissions (one) of a run.
    pub fn stats(&self) -> RecordStats {
        self.stats
    }

    /// Submits the recording and waits for it. The host's writes to mapped memory before the
    /// call are visible to it (a submission makes them so); its writes are visible to the host
    /// after.
    pub fn run(&self) -> Result<()> {
        self.run_after(None)
    }

    /// [`Replay::run`], with `first`'s recording ahead of this one in the same submission (a
    /// barrier at its end orders what this one reads after what it wrote): copies into VRAM
    /// that the step needs, without a submission and a wait of their own. `first`'s own fence
    /// is not used.
    pub fn run_after(&self, first: Option<&Replay>) -> Result<()> {
        self.submit(first)?;
        self.finish()
    }

    /// [`Replay::run`], with `meanwhile` run on the host while the device runs the recording
    /// (even when the submission fails): the host's work beside the device's. Also says
    /// whether the device had finished when `meanwhile` returned.
    pub fn run_with<R>(&self, meanwhile: impl FnOnce() -> R) -> (R, Result<bool>) {
        match self.submit(None) {
            Ok(()) => {
                let r = meanwhile();
                // SAFETY: the fence belongs to this device and is in use by the submission.
                let early = unsafe { self.device.raw.get_fence_status(self.fence) };
                let done = self.finish();
                (r, done.map(|()| early == Ok(true)))
            }
            Err(e) => (meanwhile(), Err(e)),
        }
    }

    fn submit(&self, first: Option<&Replay>) -> Result<()> {
        self.device.check_lost(LossPoint::Submit)?;
        let dev = &self.device.raw;
        let cmds: Vec<vk::CommandBuffer> = first.iter().map(|f| f.cmd).chain([self.cmd]).collect();
        let submit = [vk::SubmitInfo::default().command_buffers(&cmds)];
        let queue = self.device.queue.lock();
        // SAFETY: the queue is externally synchronised by its mutex; both command buffers are
        // executable and not pending (every submission is waited for by `finish` before the
        // next, which covers `first` too); the fence is unsignalled (created so, reset after
        // each wait).
        unsafe { dev.queue_submit(*queue, &submit, self.fence) }
            .map_err(|r| self.device.map_result(r))
    }

    /// Waits for the submission `submit` made and resets the fence.
    fn finish(&self) -> Result<()> {
        let waited = self.wait();
        // SAFETY: the fence is not in use by a pending submission once waited for (or once the
        // device is lost, when nothing is pending).
        let reset = unsafe { self.device.raw.reset_fences(&[self.fence]) };
        waited?;
        reset.map_err(map_vk)?;
        self.device.check_lost(LossPoint::Wait)
    }

    /// Polls the fence a while (a step is usually done within it), then sleeps in the driver.
    fn wait(&self) -> Result<()> {
        wait_fence(&self.device.raw, self.fence).map_err(|r| self.device.map_result(r))
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        let dev = &self.device.raw;
        // SAFETY: `run` waits for every submission before returning, so nothing is pending; the
        // fence and the command buffer belong to this device.
        unsafe {
            dev.destroy_fence(self.fence, None);
            let pool = self.device.pool.lock();
            dev.free_command_buffers(*pool, &[self.cmd]);
        }
    }
}
