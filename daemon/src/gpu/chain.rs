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
//! Semaphore values: part `i` waits for `base + 2i` (part 0 waits for nothing) and signals
//! `base + 2i + 1`, `base` 0 for a recording's first run. Timeline values only grow, so the
//! host releases part `i` only after part `i - 1` has signalled; [`Chain::release`] waits for
//! that itself. If the host stops early (an error, a
//! panic) dropping the chain releases the remaining parts in order, so nothing is left waiting
//! on the device when its command buffers are freed.
//!
//! Two handoffs ([`Handoff`]): the timeline semaphore above, where each part is a submission
//! of its own that the driver holds until the host signals; or events, where every part is in
//! one submission, part `i > 0` opens with a wait on an event the host sets
//! (`vkCmdWaitEvents` after `vkSetEvent`, allowed outside render passes) and closes by setting
//! an event the host polls. The device then waits for the host in its own command stream
//! rather than in the driver's scheduling of submissions. `SPILLWAY_CHAIN_HANDOFF=semaphores`
//! or `events` picks one (read once, [`Handoff::configured`]); semaphores by default.
//!
//! Recording the parts is the host's largest cost in such a step (a MoE step of 48 layers,
//! about 100 parts, took 2–3.5 ms of each token on an H100, against 13–14 µs a host turn). A
//! [`ChainRecording`] keeps the parts and submits them again for every step: run `r` takes the
//! timeline values from `base = 2rn` (n parts), and with events the events and the fence are
//! reset between runs. The parts must then read everything that changes between steps from
//! buffers.

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

/// A timeline semaphore of `dev` at 0; the caller destroys it.
pub(super) fn new_timeline(dev: &ash::Device) -> ash::prelude::VkResult<vk::Semaphore> {
    let mut type_info = vk::SemaphoreTypeCreateInfo::default()
        .semaphore_type(vk::SemaphoreType::TIMELINE)
        .initial_value(0);
    let info = vk::SemaphoreCreateInfo::default().push_next(&mut type_info);
    // SAFETY: a valid create info.
    unsafe { dev.create_semaphore(&info, None) }
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

/// How the host and the device hand a chain's parts to each other (see the module's notes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handoff {
    /// A submission a part, each waiting on a timeline semaphore the host signals.
    Semaphores,
    /// One submission; each part waits on an event the host sets and sets one when done.
    Events,
}

impl Handoff {
    /// The handoff chains use: `SPILLWAY_CHAIN_HANDOFF` (`semaphores` or `events`) where set,
    /// else semaphores. An unknown value is logged once and ignored.
    pub fn configured() -> Handoff {
        static CHOSEN: std::sync::OnceLock<Handoff> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(
            || match std::env::var("SPILLWAY_CHAIN_HANDOFF").as_deref() {
                Ok("events") => Handoff::Events,
                Ok("semaphores") | Err(_) => Handoff::Semaphores,
                Ok(other) => {
                    tracing::warn!(
                        "SPILLWAY_CHAIN_HANDOFF={other} is neither `semaphores` nor `events`; \
                     using semaphores"
                    );
                    Handoff::Semaphores
                }
            },
        )
    }
}

/// The objects of a chain's handoff.
enum PartSync {
    /// Part `i` waits for `2i` and signals `2i + 1`.
    Timeline(vk::Semaphore),
    /// `release[i]` lets part `i` start (`release[0]` unused), part `i` sets `done[i]`; the
    /// fence signals when the submission completes.
    Events {
        release: Vec<vk::Event>,
        done: Vec<vk::Event>,
        fence: vk::Fence,
    },
}

impl PartSync {
    /// Makes events and fence unsignaled again for the next run of a kept recording (no
    /// submission that uses them is pending); a timeline needs nothing, each run takes values
    /// of its own.
    fn reset(&self, device: &Device) -> Result<()> {
        let PartSync::Events {
            release,
            done,
            fence,
        } = self
        else {
            return Ok(());
        };
        let dev = &device.raw;
        for &e in release.iter().chain(done) {
            // SAFETY: the event belongs to this device and no pending command waits on it.
            unsafe { dev.reset_event(e) }.map_err(map_vk)?;
        }
        // SAFETY: the fence belongs to this device and no pending submission uses it.
        unsafe { dev.reset_fences(&[*fence]) }.map_err(map_vk)
    }

    fn new(device: &Device, handoff: Handoff, n_parts: usize) -> Result<PartSync> {
        let dev = &device.raw;
        match handoff {
            // Destroyed by `destroy`.
            Handoff::Semaphores => Ok(PartSync::Timeline(new_timeline(dev).map_err(map_vk)?)),
            Handoff::Events => {
                let mut sync = PartSync::Events {
                    release: Vec::with_capacity(n_parts),
                    done: Vec::with_capacity(n_parts),
                    fence: vk::Fence::null(),
                };
                if let Err(e) = sync.fill_events(device, n_parts) {
                    sync.destroy(device);
                    return Err(e);
                }
                Ok(sync)
            }
        }
    }

    /// Creates the events and the fence of a [`PartSync::Events`] (whatever is made is destroyed
    /// by `destroy`, on failure too).
    fn fill_events(&mut self, device: &Device, n_parts: usize) -> Result<()> {
        let dev = &device.raw;
        let PartSync::Events {
            release,
            done,
            fence,
        } = self
        else {
            unreachable!("events only");
        };
        for _ in 0..n_parts {
            // SAFETY: a valid create info; destroyed by `destroy`. Created unsignaled.
            release.push(
                unsafe { dev.create_event(&vk::EventCreateInfo::default(), None) }
                    .map_err(map_vk)?,
            );
            // SAFETY: as above.
            done.push(
                unsafe { dev.create_event(&vk::EventCreateInfo::default(), None) }
                    .map_err(map_vk)?,
            );
        }
        // SAFETY: a valid create info; destroyed by `destroy`.
        *fence =
            unsafe { dev.create_fence(&vk::FenceCreateInfo::default(), None) }.map_err(map_vk)?;
        Ok(())
    }

    fn destroy(&self, device: &Device) {
        let dev = &device.raw;
        // SAFETY: no submission that uses these objects is pending (its caller's contract).
        unsafe {
            match self {
                PartSync::Timeline(s) => dev.destroy_semaphore(*s, None),
                PartSync::Events {
                    release,
                    done,
                    fence,
                } => {
                    for &e in release.iter().chain(done) {
                        dev.destroy_event(e, None);
                    }
                    if *fence != vk::Fence::null() {
                        dev.destroy_fence(*fence, None);
                    }
                }
            }
        }
    }
}

/// Polls `event` until the device sets it: spinning, then yielding, then sleeping in short
/// naps (an event has no sleeping wait in the driver).
fn wait_event(dev: &ash::Device, event: vk::Event) -> ash::prelude::VkResult<()> {
    // SAFETY (every call): the caller's event belongs to `dev` and outlives the wait.
    if poll(|| unsafe { dev.get_event_status(event) })? {
        return Ok(());
    }
    loop {
        std::thread::sleep(Duration::from_micros(50));
        if unsafe { dev.get_event_status(event) }? {
            return Ok(());
        }
    }
}

/// A chain's command buffers and handoff objects, freed when the last holder lets go: a
/// [`Chain`] in flight, or a [`ChainRecording`] kept for the next steps. A holder lets go only
/// once no submission of them is pending ([`Chain`]'s drop waits for its last part).
struct Parts {
    device: Arc<Device>,
    cmds: Vec<vk::CommandBuffer>,
    sync: PartSync,
}

impl Drop for Parts {
    fn drop(&mut self) {
        // No submission of the parts is pending: the sync objects are unused.
        self.sync.destroy(&self.device);
        free_commands(&self.device, &self.cmds);
    }
}

impl Parts {
    /// Records `n_parts` command buffers (`record(i, cmd)` for part `i`), to be submitted
    /// as often as wanted. A failure frees what was made.
    fn record<T>(
        device: &Arc<Device>,
        handoff: Handoff,
        n_parts: usize,
        mut record: impl FnMut(usize, vk::CommandBuffer) -> Result<T>,
    ) -> Result<(Parts, Vec<T>)> {
        if handoff == Handoff::Semaphores && !device.timeline_semaphores {
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
        let sync = match PartSync::new(device, handoff, n_parts) {
            Ok(s) => s,
            Err(e) => {
                free_commands(device, &cmds);
                return Err(e);
            }
        };
        // Never submitted if recording fails: dropping it then frees everything.
        let parts = Parts {
            device: device.clone(),
            cmds,
            sync,
        };
        // Recording needs the command pool synchronised: its lock is held while the parts are
        // recorded (recording never takes it), and released before an error drops the parts.
        let values = {
            let _pool = device.pool.lock();
            let mut values = Vec::with_capacity(n_parts);
            let mut failed = None;
            // No ONE_TIME_SUBMIT: the parts may be submitted again after each completion.
            for (i, &cmd) in parts.cmds.iter().enumerate() {
                let begin = vk::CommandBufferBeginInfo::default();
                // SAFETY: `cmd` is a freshly allocated primary command buffer of this device.
                if let Err(e) = unsafe { dev.begin_command_buffer(cmd, &begin) } {
                    failed = Some(map_vk(e));
                    break;
                }
                // SAFETY: `cmd` is recording; the events belong to this device.
                unsafe { parts.sync.open_part(dev, cmd, i) };
                let recorded = record(i, cmd);
                // SAFETY: as above.
                unsafe { parts.sync.close_part(dev, cmd, i) };
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
        Ok((parts, values))
    }
}

/// A submitted chain, and the host's side of it (see the module's notes). Dropping it releases
/// the parts not yet released, in order, and waits for the last before letting go of the
/// command buffers; [`Chain::finish`] does the same and reports errors.
pub struct Chain {
    parts: Arc<Parts>,
    /// Where this run's timeline values start: part `i` waits for `base + 2i` and signals
    /// `base + 2i + 1` (a kept recording's runs continue one semaphore's values).
    base: u64,
    /// Parts released so far (part 0 needs no release).
    released: usize,
    finished: bool,
}

impl Chain {
    /// Submits `parts` with timeline values from `base`, `first` (a recording of copies the
    /// step reads) ahead of part 0 in its submission.
    fn submit(parts: Arc<Parts>, base: u64, first: Option<vk::CommandBuffer>) -> Result<Chain> {
        let device = &parts.device;
        device.check_lost(LossPoint::Submit)?;
        let n = parts.cmds.len();
        let submitted = match &parts.sync {
            PartSync::Events { fence, .. } => {
                let cmds: Vec<vk::CommandBuffer> = first
                    .into_iter()
                    .chain(parts.cmds.iter().copied())
                    .collect();
                let submit = [vk::SubmitInfo::default().command_buffers(&cmds)];
                let queue = device.queue.lock();
                // SAFETY: the queue is externally synchronised by its mutex; every command
                // buffer is executable and none is pending; the arrays live across the call;
                // the fence and the events are unsignaled (new, or reset by the recording).
                unsafe { device.raw.queue_submit(*queue, &submit, *fence) }
            }
            PartSync::Timeline(semaphore) => {
                let wait_values: Vec<[u64; 1]> = (0..n).map(|i| [base + 2 * i as u64]).collect();
                let signal_values: Vec<[u64; 1]> =
                    (0..n).map(|i| [base + 2 * i as u64 + 1]).collect();
                let semaphores = [*semaphore];
                let stages = [vk::PipelineStageFlags::ALL_COMMANDS];
                let first_cmds: Vec<vk::CommandBuffer> =
                    first.into_iter().chain([parts.cmds[0]]).collect();
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
                    .zip(parts.cmds.chunks_exact(1))
                    .enumerate()
                    .map(|(i, (t, cmd))| {
                        let cmds = if i == 0 { &first_cmds[..] } else { cmd };
                        let s = vk::SubmitInfo::default()
                            .command_buffers(cmds)
                            .signal_semaphores(&semaphores)
                            .push_next(t);
                        if i == 0 {
                            s
                        } else {
                            s.wait_semaphores(&semaphores).wait_dst_stage_mask(&stages)
                        }
                    })
                    .collect();
                let queue = device.queue.lock();
                // SAFETY: the queue is externally synchronised by its mutex; every command
                // buffer is executable and none is pending; the arrays the infos point to live
                // across the call; every value is above the semaphore's counter.
                unsafe { device.raw.queue_submit(*queue, &submits, vk::Fence::null()) }
            }
        };
        submitted.map_err(|r| device.map_result(r))?;
        Ok(Chain {
            parts,
            base,
            released: 1,
            finished: false,
        })
    }

    /// Number of parts.
    pub fn len(&self) -> usize {
        self.parts.cmds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.cmds.is_empty()
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
            self.parts.device.check_lost(LossPoint::Wait)?;
        }
        Ok(())
    }

    fn wait_done(&self, part: usize) -> Result<()> {
        let device = &self.parts.device;
        let dev = &device.raw;
        match &self.parts.sync {
            PartSync::Timeline(s) => wait_timeline(dev, *s, self.base + 2 * part as u64 + 1),
            // The last part's completion is the submission's: its fence has a sleeping wait.
            PartSync::Events { fence, .. } if part + 1 == self.len() => wait_fence(dev, *fence),
            PartSync::Events { done, .. } => wait_event(dev, done[part]),
        }
        .map_err(|r| device.map_result(r))
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
        let dev = &self.parts.device.raw;
        match &self.parts.sync {
            PartSync::Timeline(s) => {
                let info = vk::SemaphoreSignalInfo::default()
                    .semaphore(*s)
                    .value(self.base + 2 * part as u64);
                // SAFETY: the semaphore belongs to this device; the value is above the
                // counter, which part `part - 1` set to `base + 2 part - 1` and nothing raises
                // until part `part` runs.
                unsafe { dev.signal_semaphore(&info) }.map_err(map_vk)?;
            }
            // SAFETY: the event belongs to this device; only the host sets it, once a run.
            PartSync::Events { release, .. } => {
                unsafe { dev.set_event(release[part]) }.map_err(map_vk)?
            }
        }
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
            // The device is lost (or out of memory): its work counts as done, so letting go
            // of the command buffers (freed with the last holder of the parts) is allowed.
            tracing::warn!("a chain of command buffers ended with {e}");
        }
    }
}

/// A chain's parts recorded once and submitted again for every step ([`ChainRecording::run`]),
/// as [`super::replay::Replay`] does for a step of one submission: what changes between steps
/// the parts read from buffers, and the host's turns write.
pub struct ChainRecording {
    parts: Arc<Parts>,
    /// Runs submitted so far: run `r` uses timeline values from `2 r n`.
    runs: u64,
}

impl ChainRecording {
    /// Records `n_parts` command buffers (`record(i, cmd)` for part `i`) to be submitted as a
    /// chain handed over by `handoff`, each time [`ChainRecording::run`] is called.
    pub fn new<T>(
        device: &Arc<Device>,
        handoff: Handoff,
        n_parts: usize,
        record: impl FnMut(usize, vk::CommandBuffer) -> Result<T>,
    ) -> Result<(ChainRecording, Vec<T>)> {
        let (parts, values) = Parts::record(device, handoff, n_parts, record)?;
        let recording = ChainRecording {
            parts: Arc::new(parts),
            runs: 0,
        };
        Ok((recording, values))
    }

    /// Number of parts.
    pub fn len(&self) -> usize {
        self.parts.cmds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.cmds.is_empty()
    }

    /// Submits the parts again as a new chain, `first` ahead of part 0 in its submission (see
    /// [`super::replay::Replay::run_after`]: copies the step reads).
    ///
    /// # Panics
    /// If the chain of the last run is still held (it must have finished, or been dropped).
    pub fn run(&mut self, first: Option<vk::CommandBuffer>) -> Result<Chain> {
        assert_eq!(
            Arc::strong_count(&self.parts),
            1,
            "the last run of a kept chain is still held"
        );
        let n = self.len() as u64;
        if self.runs > 0 {
            self.parts.sync.reset(&self.parts.device)?;
        }
        let base = 2 * n * self.runs;
        let chain = Chain::submit(self.parts.clone(), base, first)?;
        self.runs += 1;
        Ok(chain)
    }
}

impl PartSync {
    /// Opens part `i`'s recording: with events, a wait for the host's release of it (`i > 0`)
    /// that makes the host's writes visible to its shaders and copies.
    ///
    /// # Safety
    /// `cmd` is a command buffer of `dev` that is recording.
    unsafe fn open_part(&self, dev: &ash::Device, cmd: vk::CommandBuffer, i: usize) {
        let PartSync::Events { release, .. } = self else {
            return;
        };
        if i == 0 {
            return;
        }
        let barrier = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::HOST_WRITE)
            .dst_access_mask(vk::AccessFlags::SHADER_READ | vk::AccessFlags::TRANSFER_READ);
        let dst = vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER;
        let host = vk::PipelineStageFlags::HOST;
        // SAFETY: the caller's contract; outside any render pass, as a wait for an event the
        // host sets after submission must be.
        unsafe { dev.cmd_wait_events(cmd, &release[i..=i], host, dst, &[barrier], &[], &[]) };
    }

    /// Closes part `i`'s recording: with events, the event the host polls for its completion
    /// (set once everything before it on the queue is done; the part's recording ends with a
    /// barrier that makes its writes visible to the host).
    ///
    /// # Safety
    /// As [`PartSync::open_part`].
    unsafe fn close_part(&self, dev: &ash::Device, cmd: vk::CommandBuffer, i: usize) {
        if let PartSync::Events { done, .. } = self {
            // SAFETY: the caller's contract.
            unsafe { dev.cmd_set_event(cmd, done[i], vk::PipelineStageFlags::ALL_COMMANDS) };
        }
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
