//! A step submitted as a chain of command buffers that the host releases one at a time.
//!
//! When the host must act in the middle of a step (route a MoE layer from its router logits,
//! compute some experts on the CPU) a step used to be one submission per part, each waited for
//! with a fence: a submit and a fence wait per part, and the device idle from the moment a part
//! finished until the host had recorded and submitted the next. A chain records every part up
//! front and submits them in one call; part `i` waits on a timeline semaphore that the host
//! signals ([`Chain::release`]) once it has written what the part reads (host-visible buffers),
//! and signals the semaphore when it completes ([`Chain::wait`]). The host's turn between two
//! parts is then a wait on a counter, a few writes to mapped memory and a signal.
//!
//! Semaphore values: part `i` waits for `2i` (part 0 waits for nothing) and signals `2i + 1`.
//! Timeline values only grow, so the host releases part `i` only after part `i - 1` has
//! signalled; [`Chain::release`] waits for that itself. If the host stops early (an error, a
//! panic) dropping the chain releases the remaining parts in order, so nothing is left waiting
//! on the device when its command buffers are freed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ash::vk;

use super::device::Device;
use super::error::{map_vk, GpuError, Result};
use super::lost::LossPoint;

/// How long a wait polls the device before it sleeps in the driver: the host's turn is usually
/// due within tens of microseconds, less than a sleeping wait's wake-up. After the first
/// [`SPIN_HARD`] the poll yields between reads, so a device that runs on the CPU (lavapipe)
/// keeps the core.
const SPIN: Duration = Duration::from_micros(2000);
const SPIN_HARD: Duration = Duration::from_micros(50);

/// Polls `done` for up to [`SPIN`]: `Ok(true)` once it says so, `Ok(false)` when the time ran
/// out (the caller then sleeps in the driver).
fn poll<E>(mut done: impl FnMut() -> std::result::Result<bool, E>) -> std::result::Result<bool, E> {
    let start = Instant::now();
    loop {
        if done()? {
            return Ok(true);
        }
        let spun = start.elapsed();
        if spun > SPIN {
            return Ok(false);
        }
        if spun > SPIN_HARD {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Waits until timeline `semaphore` of `dev` reaches `value`: polled first ([`poll`]), then
/// asleep in the driver. Chains and one-off submissions wait this way.
pub(super) fn wait_timeline(
    dev: &ash::Device,
    semaphore: vk::Semaphore,
    value: u64,
) -> ash::prelude::VkResult<()> {
    // SAFETY (both calls): the caller's semaphore belongs to `dev` and outlives the wait; the
    // info's arrays live across the call.
    if poll(|| unsafe { dev.get_semaphore_counter_value(semaphore) }.map(|now| now >= value))? {
        return Ok(());
    }
    let semaphores = [semaphore];
    let values = [value];
    let info = vk::SemaphoreWaitInfo::default()
        .semaphores(&semaphores)
        .values(&values);
    unsafe { dev.wait_semaphores(&info, u64::MAX) }
}

/// Waits for `fence` of `dev`: polled first ([`poll`]), then asleep in the driver. Replays and
/// one-off submissions without timeline semaphores wait this way.
pub(super) fn wait_fence(dev: &ash::Device, fence: vk::Fence) -> ash::prelude::VkResult<()> {
    // SAFETY (both calls): the caller's fence belongs to `dev` and outlives the wait.
    if poll(|| unsafe { dev.get_fence_status(fence) })? {
        return Ok(());
    }
    unsafe { dev.wait_for_fences(&[fence], true, u64::MAX) }
}

/// A submitted chain, and the host's side of it (see the module's notes). Dropping it releases
/// the parts not yet released, in order, and waits for the last before freeing the command
/// buffers; [`Chain::finish`] does the same and reports errors.
pub struct Chain {
    device: Arc<Device>,
    cmds: Vec<vk::CommandBuffer>,
    semaphore: vk::Semaphore,
    /// Parts released so far (part 0 needs no release).
    released: usize,
    finished: bool,
}

impl Chain {
    /// Records `n_parts` command buffers (`record(i, cmd)` for part `i`) and submits them as a
    /// chain. A failure to record submits nothing.
    pub fn start<T>(
        device: &Arc<Device>,
        n_parts: usize,
        mut record: impl FnMut(usize, vk::CommandBuffer) -> Result<T>,
    ) -> Result<(Chain, Vec<T>)> {
        if !device.timeline_semaphores {
            return Err(GpuError::Unsupported(
                "the device has no timeline semaphores".into(),
            ));
        }
        assert!(n_parts > 0, "an empty chain");
        let dev = &device.raw;
        let cmds = {
            let pool = device.pool.lock();
            device.allocate_commands(&pool, n_parts as u32)?
        };
        let mut type_info = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let info = vk::SemaphoreCreateInfo::default().push_next(&mut type_info);
        // SAFETY: a valid create info; the semaphore is destroyed in `Drop`.
        let semaphore = match unsafe { dev.create_semaphore(&info, None) } {
            Ok(s) => s,
            Err(e) => {
                free_commands(device, &cmds);
                return Err(map_vk(e));
            }
        };
        // Not yet submitted: `finished` keeps `Drop` from waiting for anything.
        let mut chain = Chain {
            device: device.clone(),
            cmds,
            semaphore,
            released: n_parts,
            finished: true,
        };
        // Recording needs the command pool synchronised: its lock is held while the parts are
        // recorded (recording never takes it), and released before an error drops the chain.
        let values = {
            let _pool = device.pool.lock();
            let mut values = Vec::with_capacity(n_parts);
            let mut failed = None;
            for (i, &cmd) in chain.cmds.iter().enumerate() {
                let begin = vk::CommandBufferBeginInfo::default()
                    .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
                // SAFETY: `cmd` is a freshly allocated primary command buffer of this device.
                if let Err(e) = unsafe { dev.begin_command_buffer(cmd, &begin) } {
                    failed = Some(map_vk(e));
                    break;
                }
                let recorded = record(i, cmd);
                // SAFETY: recording began above.
                let ended = unsafe { dev.end_command_buffer(cmd) }.map_err(map_vk);
                match recorded.and_then(|v| ended.map(|()| v)) {
                    Ok(v) => values.push(v),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            match failed {
                Some(e) => Err(e),
                None => Ok(values),
            }
        }?;
        chain.submit()?;
        chain.released = 1;
        chain.finished = false;
        Ok((chain, values))
    }

    fn submit(&self) -> Result<()> {
        self.device.check_lost(LossPoint::Submit)?;
        let n = self.cmds.len();
        let wait_values: Vec<[u64; 1]> = (0..n).map(|i| [2 * i as u64]).collect();
        let signal_values: Vec<[u64; 1]> = (0..n).map(|i| [2 * i as u64 + 1]).collect();
        let semaphores = [self.semaphore];
        let stages = [vk::PipelineStageFlags::ALL_COMMANDS];
        let mut timeline: Vec<vk::TimelineSemaphoreSubmitInfo<'_>> = (0..n)
            .map(|i| {
                let t = vk::TimelineSemaphoreSubmitInfo::default()
                    .signal_semaphore_values(&signal_values[i]);
                if i == 0 {
                    t
                } else {
                    t.wait_semaphore_values(&wait_values[i])
                }
            })
            .collect();
        let submits: Vec<vk::SubmitInfo<'_>> = timeline
            .iter_mut()
            .zip(self.cmds.chunks_exact(1))
            .enumerate()
            .map(|(i, (t, cmd))| {
                let s = vk::SubmitInfo::default()
                    .command_buffers(cmd)
                    .signal_semaphores(&semaphores)
                    .push_next(t);
                if i == 0 {
                    s
                } else {
                    s.wait_semaphores(&semaphores).wait_dst_stage_mask(&stages)
                }
            })
            .collect();
        let queue = self.device.queue.lock();
        // SAFETY: the queue is externally synchronised by its mutex; every command buffer is
        // executable; the arrays the infos point to live across the call.
        unsafe {
            self.device
                .raw
                .queue_submit(*queue, &submits, vk::Fence::null())
        }
        .map_err(|r| self.device.map_result(r))
    }

    /// Number of parts.
    pub fn len(&self) -> usize {
        self.cmds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cmds.is_empty()
    }

    /// Waits until part `part` has completed: what it wrote to host-visible memory can be read.
    ///
    /// # Panics
    /// If `part` is not a part of the chain, or has not been released.
    pub fn wait(&self, part: usize) -> Result<()> {
        assert!(part < self.len(), "part {part} of {}", self.len());
        assert!(
            part < self.released,
            "part {part} waited for before its release"
        );
        self.wait_done(part)?;
        // An injected loss shows at the wait for the last part, when nothing is pending: the
        // chain's command buffers may then be freed.
        if part + 1 == self.len() {
            self.device.check_lost(LossPoint::Wait)?;
        }
        Ok(())
    }

    fn wait_done(&self, part: usize) -> Result<()> {
        wait_timeline(&self.device.raw, self.semaphore, 2 * part as u64 + 1)
            .map_err(|r| self.device.map_result(r))
    }

    /// Lets part `part` start, once the previous part has completed (waited for here): call it
    /// after writing what `part` reads. Parts are released in order.
    ///
    /// # Panics
    /// If `part` is 0, outside the chain, or not the next part to release.
    pub fn release(&mut self, part: usize) -> Result<()> {
        assert!(part > 0 && part < self.len(), "release of part {part}");
        assert_eq!(part, self.released, "parts are released in order");
        self.wait(part - 1)?;
        let info = vk::SemaphoreSignalInfo::default()
            .semaphore(self.semaphore)
            .value(2 * part as u64);
        // SAFETY: the semaphore belongs to this device; the value is above the counter, which
        // part `part - 1` set to `2 part - 1` and nothing raises until part `part` runs.
        unsafe { self.device.raw.signal_semaphore(&info) }.map_err(map_vk)?;
        self.released = part + 1;
        Ok(())
    }

    /// Releases every part not yet released, in order, and waits for the last.
    pub fn finish(&mut self) -> Result<()> {
        if self.finished {
            return Ok(());
        }
        while self.released < self.len() {
            self.release(self.released)?;
        }
        self.wait(self.len() - 1)?;
        self.finished = true;
        Ok(())
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            // The device is lost (or out of memory): its work counts as done, so freeing the
            // command buffers below is allowed.
            tracing::warn!("a chain of command buffers ended with {e}");
        }
        // SAFETY: every part has completed (or the device is lost); the semaphore is unused.
        unsafe { self.device.raw.destroy_semaphore(self.semaphore, None) };
        free_commands(&self.device, &self.cmds);
    }
}

fn free_commands(device: &Device, cmds: &[vk::CommandBuffer]) {
    let pool = device.pool.lock();
    // SAFETY: the pool is externally synchronised by its mutex; no command buffer is pending.
    unsafe { device.raw.free_command_buffers(*pool, cmds) };
}

impl Device {
    /// Whether [`Chain`]s can run here (timeline semaphores).
    pub fn chains(&self) -> bool {
        self.timeline_semaphores
    }
}
