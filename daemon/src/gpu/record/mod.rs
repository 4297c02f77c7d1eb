//! Many dispatches in one command buffer. [`Kernels`] creates each variant's pipeline once and
//! keeps it; a [`Recorder`] binds, pushes and dispatches, and inserts a barrier only where a
//! dispatch touches a buffer that an earlier dispatch since the last barrier wrote (read after
//! write, write after write) or read (write after read).

use std::collections::HashMap;
use std::sync::Arc;

use ash::vk;
use parking_lot::Mutex;
use spillway_shaders::{Feature, Op, PushConstants, ShaderId, WeightType};

mod bindings;
mod descriptors;
mod timer;

pub use bindings::{Access, Binding};
pub(crate) use descriptors::DescriptorArena;

use bindings::Hazards;
use timer::Timer;

use super::buffer::Buffer;
use super::chain::{Chain, ChainRecording, Handoff};
use super::device::Device;
use super::error::{GpuError, Result};
use super::matmul_tile::MatMulTile;
use super::ops::{MatVecShape, StepWord};
use super::ops_batch::MAX_MATVEC_COLS;
use super::ops_q8::Q8Scratch;
use super::pipeline::{write_storage_buffers, ComputePipeline};
use super::replay::Replay;

/// A variant and the values of its specialization constants 0..n.
type PipelineKey = (ShaderId, Vec<u32>);

/// The pipelines of the shader table, created on first use and cached.
pub struct Kernels {
    device: Arc<Device>,
    /// Use the `Subgroup` variants where the table has them.
    subgroups: bool,
    /// Use the `CoopMat` variants where the table has them.
    coopmat: bool,
    /// Use the `IntDot` variants (`IntDotSubgroup` with `subgroups`) where the table has them.
    int_dot: bool,
    /// Pipelines by variant and specialization constants.
    cache: Mutex<HashMap<PipelineKey, Arc<ComputePipeline>>>,
    /// A matrix-vector workgroup shape for every weight type instead of the tuned ones.
    matvec_shape: Mutex<Option<MatVecShape>>,
    /// The cooperative-matrix product's tile instead of the tuned one.
    matmul_tile: Mutex<Option<MatMulTile>>,
    /// Products over at most this many tokens take the several-column matrix-vector kernel
    /// rather than the tiled one ([`Kernels::set_matvec_cols`]).
    matvec_cols: std::sync::atomic::AtomicUsize,
    /// Products of fewer weights quantize their inputs in their own workgroups even with a
    /// scratch ([`Kernels::set_q8_min_weights`]).
    q8_min_weights: std::sync::atomic::AtomicUsize,
    /// Where the integer-dot products' inputs are quantized once before them
    /// ([`Kernels::set_q8_scratch`]); without it each product quantizes the blocks it reads.
    q8_scratch: Mutex<Option<Arc<Buffer>>>,
    /// Scratches replaced since: recordings made with them may still be replayed.
    q8_retired: Mutex<Vec<Arc<Buffer>>>,
}

impl Kernels {
    /// The kernels for `device`: its subgroup variants when it has subgroup arithmetic.
    pub fn new(device: &Arc<Device>) -> Arc<Kernels> {
        Kernels::with_subgroups(device, device.subgroup_arithmetic())
    }

    /// With `subgroups` false, only the `Base` variants (tests compare both); cooperative
    /// matrices where the device has them.
    pub fn with_subgroups(device: &Arc<Device>, subgroups: bool) -> Arc<Kernels> {
        Kernels::with_features(device, subgroups, true)
    }

    /// With `subgroups` or `coopmat` false, the variants without subgroup arithmetic or without
    /// cooperative matrices, even where the device has them (tests and benchmarks compare them).
    /// No integer dot products: products are the f32 dots of the weights' values.
    pub fn with_features(device: &Arc<Device>, subgroups: bool, coopmat: bool) -> Arc<Kernels> {
        Kernels::with_int_dot(device, (subgroups, coopmat), false)
    }

    /// [`Kernels::with_features`], and with `int_dot` the integer-dot-product variants where the
    /// device has them (Q4_0 and Q8_0 weights times inputs quantized to 8 bits, as the CPU engine does).
    pub fn with_int_dot(
        device: &Arc<Device>,
        (subgroups, coopmat): (bool, bool),
        int_dot: bool,
    ) -> Arc<Kernels> {
        Arc::new(Kernels {
            device: device.clone(),
            subgroups: subgroups && device.subgroup_arithmetic(),
            coopmat: coopmat && device.cooperative_matrix(),
            int_dot: int_dot && device.integer_dot_product(),
            cache: Mutex::new(HashMap::new()),
            matvec_shape: Mutex::new(None),
            matmul_tile: Mutex::new(None),
            matvec_cols: (MAX_MATVEC_COLS as usize).into(),
            q8_min_weights: 0.into(),
            q8_scratch: Mutex::new(None),
            q8_retired: Mutex::new(Vec::new()),
        })
    }

    /// Device memory where the integer-dot-product kernels' inputs are quantized, once for
    /// every product that reads them ([`Op::QuantizeQ8`]), in recordings made from now on: a
    /// product then reads a block of 32 inputs as 48 bytes of bytes, scale and sum instead of
    /// quantizing 128 bytes of floats again in every workgroup (on the H200 a 4096 × 14336
    /// SwiGLU stack took 23.3 µs instead of 38.5 in a chain, `bench/RESULTS.md`). Products
    /// whose inputs do not fit it ([`q8_bytes`](super::ops_q8::q8_bytes)) quantize in place, as without one. A scratch replaced stays alive as long
    /// as the kernels, since replayed recordings bind it.
    pub fn set_q8_scratch(&self, scratch: Option<Arc<Buffer>>) {
        let old = std::mem::replace(&mut *self.q8_scratch.lock(), scratch);
        self.q8_retired.lock().extend(old);
    }

    /// Matrix-vector products of fewer than `weights` weights quantize their inputs in their
    /// own workgroups rather than through the scratch ([`Kernels::set_q8_scratch`]): that
    /// saves the quantization's dependent dispatch, and costs each workgroup a read of the
    /// inputs as floats, about as many bytes (from cache) as the product's Q4_0 weights, so it
    /// pays for small products only; 0: every product that can reads the scratch.
    pub fn set_q8_min_weights(&self, weights: usize) {
        self.q8_min_weights
            .store(weights, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn q8_min_weights(&self) -> usize {
        self.q8_min_weights
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Products over at most `n` tokens (up to [`MAX_MATVEC_COLS`]) run in the several-column
    /// matrix-vector kernel (a decode step of a few sequences, a prompt of a few tokens), which
    /// reads each weight once for all of them as a decode step does for one; more go to the
    /// tiled kernel, whose tiles of 64 tokens waste most of their work on a few. 0 or 1: every
    /// product over several tokens tiled, for comparisons.
    pub fn set_matvec_cols(&self, n: usize) {
        let n = n.min(MAX_MATVEC_COLS as usize);
        self.matvec_cols
            .store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// The most tokens a product takes in the several-column kernel (see
    /// [`Kernels::set_matvec_cols`]).
    pub fn matvec_cols(&self) -> usize {
        self.matvec_cols.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Uses `shape` for the matrix-vector products of every weight type (benchmarks compare
    /// shapes; tests run each one), or the tuned shapes again with `None`.
    pub fn set_matvec_shape(&self, shape: Option<MatVecShape>) -> Result<()> {
        if let Some(s) = shape {
            s.check()?;
        }
        *self.matvec_shape.lock() = shape;
        Ok(())
    }

    /// Uses `tile` for the cooperative-matrix products (benchmarks compare tiles), or the tuned
    /// one again with `None`.
    pub fn set_matmul_tile(&self, tile: Option<MatMulTile>) -> Result<()> {
        if let Some(t) = tile {
            t.check_on(&self.device)?;
        }
        *self.matmul_tile.lock() = tile;
        Ok(())
    }

    /// The cooperative-matrix product's tile.
    pub fn matmul_tile(&self) -> MatMulTile {
        self.matmul_tile.lock().unwrap_or_else(|| {
            // A device with less shared memory than the tuned tile needs takes a shallower one.
            match MatMulTile::TUNED.check_on(&self.device) {
                Ok(()) => MatMulTile::TUNED,
                Err(_) => MatMulTile {
                    depth: 32,
                    ..MatMulTile::TUNED
                },
            }
        })
    }

    /// The matrix-vector workgroup shape for `wtype`.
    pub fn matvec_shape(&self, wtype: WeightType) -> MatVecShape {
        self.matvec_shape
            .lock()
            .unwrap_or_else(|| MatVecShape::tuned(wtype))
    }

    /// The shape for a product `op` of `wtype` with `results.0` results (all experts' together),
    /// each taking `results.1` rows of a workgroup (2 with SwiGLU), `normed` when RMSNorm is
    /// fused into it, its rows `n_in` weights long (times the experts summed, for a sum over
    /// experts): the tuned shape ([`MatVecShape::int_dot`] for the integer-dot-product kernels)
    /// with fewer rows where it would leave fewer than [`MatVecShape::MIN_GROUPS`] workgroups
    /// ([`MatVecShape::MIN_GROUPS_NORMED`] when normed; [`MatVecShape::for_results`]), unless
    /// [`Kernels::set_matvec_shape`] set one.
    pub fn matvec_shape_for(
        &self,
        (op, wtype): (Op, WeightType),
        results: (usize, u32),
        normed: bool,
        n_in: usize,
    ) -> MatVecShape {
        let min_groups = match normed {
            true => MatVecShape::MIN_GROUPS_NORMED,
            false => MatVecShape::MIN_GROUPS,
        };
        if let Some(shape) = *self.matvec_shape.lock() {
            return shape;
        }
        let tuned = match self.runs_int_dot(op, wtype) {
            true => MatVecShape::int_dot(n_in.div_ceil(32)),
            false => MatVecShape::tuned(wtype),
        };
        tuned.for_results(results.0, results.1, min_groups)
    }

    /// Whether `op` on `wtype` rows runs an integer-dot-product variant.
    fn runs_int_dot(&self, op: Op, wtype: WeightType) -> bool {
        self.variant(op, Some(wtype))
            .is_ok_and(|id| matches!(id.info().feature, Feature::IntDot | Feature::IntDotSubgroup))
    }

    /// Whether the cooperative-matrix variants are in use.
    pub fn uses_coopmat(&self) -> bool {
        self.coopmat
    }

    /// Whether the subgroup variants are in use.
    pub fn uses_subgroups(&self) -> bool {
        self.subgroups
    }

    /// Whether the integer-dot-product variants are in use.
    pub fn uses_int_dot(&self) -> bool {
        self.int_dot
    }

    /// The variant of `op` for `wtype` this device runs best.
    pub fn variant(&self, op: Op, wtype: Option<WeightType>) -> Result<ShaderId> {
        if let Some(id) = self
            .coopmat
            .then(|| ShaderId::find(op, wtype, Feature::CoopMat))
            .flatten()
        {
            return Ok(id);
        }
        if self.int_dot {
            let found = match self.subgroups {
                true => ShaderId::find(op, wtype, Feature::IntDotSubgroup),
                false => ShaderId::find(op, wtype, Feature::IntDot),
            };
            if let Some(id) = found {
                return Ok(id);
            }
        }
        let subgroup = self
            .subgroups
            .then(|| ShaderId::find(op, wtype, Feature::Subgroup))
            .flatten();
        subgroup
            .or_else(|| ShaderId::find(op, wtype, Feature::Base))
            .ok_or_else(|| GpuError::Unsupported(format!("no {op:?} kernel for {wtype:?}")))
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The pipeline of `shader`, created the first time it is asked for.
    pub fn pipeline(&self, shader: ShaderId) -> Result<Arc<ComputePipeline>> {
        self.pipeline_spec(shader, &[])
    }

    /// The pipeline of `shader` with specialization constants 0..n set to `spec`.
    pub fn pipeline_spec(&self, shader: ShaderId, spec: &[u32]) -> Result<Arc<ComputePipeline>> {
        let mut cache = self.cache.lock();
        let key = (shader, spec.to_vec());
        if let Some(p) = cache.get(&key) {
            return Ok(p.clone());
        }
        let p = Arc::new(ComputePipeline::for_shader_spec(
            &self.device,
            shader,
            spec,
        )?);
        cache.insert(key, p.clone());
        Ok(p)
    }

    /// Pipelines created so far.
    pub fn cached(&self) -> usize {
        self.cache.lock().len()
    }

    /// Records `f`'s dispatches into one command buffer, submits it and waits. Nothing is
    /// submitted if `f` fails. Shader writes are visible to the host and to transfers after.
    pub fn record(&self, f: impl FnOnce(&mut Recorder<'_>) -> Result<()>) -> Result<RecordStats> {
        self.record_with_max_range(self.device.max_storage_buffer_range(), f)
    }

    /// [`Kernels::record`], running `meanwhile` on the host while the device runs the
    /// recording (see [`Device::try_run_overlapped`]); its result comes back with the stats.
    pub fn record_overlapped<R>(
        &self,
        f: impl FnOnce(&mut Recorder<'_>) -> Result<()>,
        meanwhile: impl FnOnce() -> R,
    ) -> Result<(RecordStats, R)> {
        let max_range = self.device.max_storage_buffer_range();
        let mut arena = DescriptorArena::new(&self.device);
        self.device.try_run_overlapped(
            |cmd| self.record_into(cmd, &mut arena, max_range, None, f),
            meanwhile,
        )
    }

    /// Records `n_parts` command buffers (`f(i, rec)` for part `i`) and submits them as a
    /// chain ([`super::chain`]): part `i > 0` starts once the host released it, after
    /// everything earlier on the queue and with the host's writes to mapped memory visible.
    /// The stats count each part as a submission.
    pub fn start_chain(
        &self,
        handoff: Handoff,
        n_parts: usize,
        f: impl FnMut(usize, &mut Recorder<'_>) -> Result<()>,
    ) -> Result<(ChainRun, RecordStats)> {
        let mut recording = self.record_chain(handoff, n_parts, f)?;
        let chain = recording.start(None)?;
        let stats = recording.stats();
        Ok((
            ChainRun {
                chain,
                _recording: recording,
            },
            stats,
        ))
    }

    /// [`Kernels::start_chain`]'s parts recorded once and kept: [`ChainReplay::start`] submits
    /// them as a new chain for every step, with no recording on the host's side of it. What
    /// the parts read must change only in buffers (as a replayed step's,
    /// [`Kernels::record_replay`]).
    pub fn record_chain(
        &self,
        handoff: Handoff,
        n_parts: usize,
        mut f: impl FnMut(usize, &mut Recorder<'_>) -> Result<()>,
    ) -> Result<ChainReplay> {
        let max_range = self.device.max_storage_buffer_range();
        let mut arena = DescriptorArena::new(&self.device);
        let mut pipelines = Vec::new();
        let (recording, parts) = ChainRecording::new(&self.device, handoff, n_parts, |i, cmd| {
            self.record_keeping(cmd, &mut arena, max_range, None, &mut pipelines, |rec| {
                if i > 0 {
                    rec.after_host_writes();
                }
                f(i, rec)
            })
        })?;
        Ok(ChainReplay {
            recording,
            stats: sum_stats(&parts),
            _arena: arena,
            _pipelines: pipelines,
        })
    }

    /// [`Kernels::record`] with GPU timestamps around the whole recording: `gpu_ns` of the
    /// stats is the time the GPU took (for benchmarks; `None` where the queue has no
    /// timestamps).
    pub fn record_timed(
        &self,
        f: impl FnOnce(&mut Recorder<'_>) -> Result<()>,
    ) -> Result<RecordStats> {
        let timer = Timer::new(&self.device)?;
        let max_range = self.device.max_storage_buffer_range();
        let mut stats = self.record_inner(max_range, Some(&timer), f)?;
        stats.gpu_ns = timer.elapsed_ns()?;
        Ok(stats)
    }

    /// `warm`, then `f` between timestamps (which start once `warm`'s dispatches are done),
    /// recorded once into a [`TimedReplay`] that can be run again and again: a benchmark's
    /// repetitions then cost the host one recording, and the device runs them back to back.
    /// A GPU that idled before a submission may run its first dispatches slower than a decode
    /// step, which keeps it busy, sees; `warm` takes those.
    pub fn record_timed_replay(
        &self,
        warm: impl FnOnce(&mut Recorder<'_>) -> Result<()>,
        f: impl FnOnce(&mut Recorder<'_>) -> Result<()>,
    ) -> Result<TimedReplay> {
        let (whole, timer) = (Timer::new(&self.device)?, Timer::new(&self.device)?);
        let max_range = self.device.max_storage_buffer_range();
        let replay = Replay::new(&self.device, |cmd| {
            let mut arena = DescriptorArena::new(&self.device);
            let mut pipelines = Vec::new();
            let stats =
                self.record_keeping(cmd, &mut arena, max_range, None, &mut pipelines, |rec| {
                    // A run reads what the run before it wrote.
                    rec.after_earlier_submissions();
                    whole.begin(rec.cmd);
                    warm(rec)?;
                    rec.after_earlier_submissions();
                    timer.begin_after(rec.cmd);
                    f(rec)?;
                    timer.end(rec.cmd);
                    whole.end(rec.cmd);
                    Ok(())
                })?;
            Ok((stats, arena, pipelines))
        })?;
        Ok(TimedReplay {
            replay,
            whole,
            timer,
        })
    }

    /// [`Kernels::record`] binding at most `max_range` bytes of a buffer at once (tests use a
    /// small limit to exercise splitting without huge buffers).
    pub fn record_with_max_range(
        &self,
        max_range: u64,
        f: impl FnOnce(&mut Recorder<'_>) -> Result<()>,
    ) -> Result<RecordStats> {
        self.record_inner(max_range, None, f)
    }

    fn record_inner(
        &self,
        max_range: u64,
        timer: Option<&Timer>,
        f: impl FnOnce(&mut Recorder<'_>) -> Result<()>,
    ) -> Result<RecordStats> {
        let mut arena = DescriptorArena::new(&self.device);
        self.device
            .try_run_once(|cmd| self.record_into(cmd, &mut arena, max_range, timer, f))
        // `arena` (the descriptor sets) drops here, after the wait.
    }

    /// Records `f`'s dispatches once into a [`Replay`]: a command buffer submitted again for
    /// every step, which reads what changes between steps from buffers ([`super::ops::StepWord`]).
    pub fn record_replay(&self, f: impl FnOnce(&mut Recorder<'_>) -> Result<()>) -> Result<Replay> {
        let max_range = self.device.max_storage_buffer_range();
        Replay::new(&self.device, |cmd| {
            let mut arena = DescriptorArena::new(&self.device);
            let mut pipelines = Vec::new();
            let stats = self.record_keeping(cmd, &mut arena, max_range, None, &mut pipelines, f)?;
            Ok((stats, arena, pipelines))
        })
    }

    fn record_into(
        &self,
        cmd: vk::CommandBuffer,
        arena: &mut DescriptorArena,
        max_range: u64,
        timer: Option<&Timer>,
        f: impl FnOnce(&mut Recorder<'_>) -> Result<()>,
    ) -> Result<RecordStats> {
        self.record_keeping(cmd, arena, max_range, timer, &mut Vec::new(), f)
    }

    /// [`Kernels::record_into`], handing the pipelines the recording uses to `keep`.
    fn record_keeping(
        &self,
        cmd: vk::CommandBuffer,
        arena: &mut DescriptorArena,
        max_range: u64,
        timer: Option<&Timer>,
        keep: &mut Vec<Arc<ComputePipeline>>,
        f: impl FnOnce(&mut Recorder<'_>) -> Result<()>,
    ) -> Result<RecordStats> {
        let mut rec = Recorder {
            kernels: self,
            cmd,
            arena,
            hazards: Hazards::default(),
            stats: RecordStats::default(),
            pipelines: Vec::new(),
            max_range: max_range.min(self.device.max_storage_buffer_range()),
            align: self.device.storage_offset_alignment(),
            q8: self.q8_scratch.lock().clone().map(|buffer| Q8Scratch {
                buffer,
                holds: None,
            }),
        };
        if let Some(t) = timer {
            t.begin(cmd);
        }
        f(&mut rec)?;
        if let Some(t) = timer {
            t.end(cmd);
        }
        rec.finish();
        rec.stats.submits = 1;
        keep.append(&mut rec.pipelines);
        Ok(rec.stats)
    }
}

/// The stats of a chain's parts together, each a submission.
fn sum_stats(parts: &[RecordStats]) -> RecordStats {
    parts
        .iter()
        .fold(RecordStats::default(), |a, p| RecordStats {
            dispatches: a.dispatches + p.dispatches,
            barriers: a.barriers + p.barriers,
            submits: a.submits + p.submits,
            gpu_ns: None,
        })
}

/// A chain's parts kept with the descriptor sets and pipelines they use
/// ([`Kernels::record_chain`]); fields drop in order, the command buffers first.
pub struct ChainReplay {
    recording: ChainRecording,
    stats: RecordStats,
    _arena: DescriptorArena,
    _pipelines: Vec<Arc<ComputePipeline>>,
}

impl ChainReplay {
    /// Submits the parts as a new chain, `first`'s recording ahead of part 0 in its submission
    /// (copies the step reads, [`super::replay::Replay::run_after`]).
    ///
    /// # Panics
    /// If the chain of the last start is still held.
    pub fn start(&mut self, first: Option<&Replay>) -> Result<Chain> {
        self.recording.run(first.map(Replay::command_buffer))
    }

    /// Dispatches, barriers and submissions (one a part) of a run.
    pub fn stats(&self) -> RecordStats {
        self.stats
    }
}

/// A chain in flight with the recording of its parts, which outlives it (fields drop in
/// order: the chain runs out first).
pub struct ChainRun {
    pub chain: Chain,
    _recording: ChainReplay,
}

/// What a recording did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordStats {
    pub dispatches: u32,
    pub barriers: u32,
    /// Command buffers submitted (each one waited for before the next).
    pub submits: u32,
    /// GPU time of the recording, from timestamps (only [`Kernels::record_timed`]).
    pub gpu_ns: Option<u64>,
}

/// A dispatch's grid of workgroups.
#[derive(Clone, Copy)]
pub(crate) enum Grid<'b> {
    Fixed([u32; 3]),
    /// Three words of a host-written buffer from this word on, read when the dispatch runs, so
    /// that a recorded step replayed at another position launches only the workgroups it
    /// needs. The host writes them before the submission (its writes are visible to it); no
    /// shader writes them.
    Indirect(StepWord<'b>),
}

/// Records dispatches into one command buffer (see [`Kernels::record`]).
pub struct Recorder<'k> {
    kernels: &'k Kernels,
    cmd: vk::CommandBuffer,
    arena: &'k mut DescriptorArena,
    hazards: Hazards,
    stats: RecordStats,
    /// Pipelines used, kept alive until the recording is done.
    pipelines: Vec<Arc<ComputePipeline>>,
    pub(crate) max_range: u64,
    pub(crate) align: u64,
    /// The kernels' [`Kernels::set_q8_scratch`], and what it holds now.
    pub(crate) q8: Option<Q8Scratch>,
}

impl Recorder<'_> {
    /// The device's subgroup size (workgroups of the cooperative-matrix kernels are four
    /// subgroups).
    pub(crate) fn subgroup_size(&self) -> u32 {
        self.kernels.device().subgroup_size()
    }

    pub(crate) fn matmul_tile(&self) -> MatMulTile {
        self.kernels.matmul_tile()
    }

    pub fn stats(&self) -> RecordStats {
        self.stats
    }

    /// See [`Kernels::variant`].
    pub fn variant(&self, op: Op, wtype: Option<WeightType>) -> Result<ShaderId> {
        self.kernels.variant(op, wtype)
    }

    /// The matrix-vector workgroup shape for `wtype` (see [`Kernels::matvec_shape`]).
    pub fn matvec_shape(&self, wtype: WeightType) -> MatVecShape {
        self.kernels.matvec_shape(wtype)
    }

    /// See [`Kernels::matvec_cols`].
    pub(crate) fn matvec_cols(&self) -> usize {
        self.kernels.matvec_cols()
    }

    /// See [`Kernels::set_q8_min_weights`].
    pub(crate) fn q8_min_weights(&self) -> usize {
        self.kernels.q8_min_weights()
    }

    /// The shape for a product's results (see [`Kernels::matvec_shape_for`]).
    pub fn matvec_shape_for(
        &self,
        op: (Op, WeightType),
        results: (usize, u32),
        normed: bool,
        n_in: usize,
    ) -> MatVecShape {
        self.kernels.matvec_shape_for(op, results, normed, n_in)
    }

    /// Records one dispatch of `shader` with `bindings` at bindings 0..n.
    pub fn dispatch<P: PushConstants>(
        &mut self,
        shader: ShaderId,
        bindings: &[Binding<'_>],
        push: &P,
        groups: [u32; 3],
    ) -> Result<()> {
        self.dispatch_spec(shader, &[], bindings, push, groups)
    }

    /// [`Recorder::dispatch`] of the pipeline specialized with `spec` (constants 0..n).
    pub fn dispatch_spec<P: PushConstants>(
        &mut self,
        shader: ShaderId,
        spec: &[u32],
        bindings: &[Binding<'_>],
        push: &P,
        groups: [u32; 3],
    ) -> Result<()> {
        self.dispatch_grid(shader, spec, bindings, push, Grid::Fixed(groups))
    }

    /// [`Recorder::dispatch_spec`] with its grid fixed now or read when it runs
    /// ([`Grid::Indirect`]).
    pub(crate) fn dispatch_grid<P: PushConstants>(
        &mut self,
        shader: ShaderId,
        spec: &[u32],
        bindings: &[Binding<'_>],
        push: &P,
        grid: Grid<'_>,
    ) -> Result<()> {
        if let Grid::Indirect(words) = grid {
            if u64::from(words.index) * 4 + 12 > words.buffer.size() {
                return Err(GpuError::Unsupported(format!(
                    "a grid at word {} of a {}-byte buffer",
                    words.index,
                    words.buffer.size()
                )));
            }
        }
        let pipeline = self.kernels.pipeline_spec(shader, spec)?;
        let push = push.bytes();
        if bindings.len() != pipeline.n_buffers as usize
            || push.len() != pipeline.push_bytes as usize
        {
            return Err(GpuError::Unsupported(format!(
                "{shader:?} takes {} buffers and {} push bytes, got {} and {}",
                pipeline.n_buffers,
                pipeline.push_bytes,
                bindings.len(),
                push.len()
            )));
        }
        for b in bindings {
            if b.range > self.max_range || b.offset + b.range > b.buffer.size() {
                return Err(GpuError::Unsupported(format!(
                    "binding of {} bytes at {} of a {}-byte buffer (at most {} at once): bind it by ranges",
                    b.range,
                    b.offset,
                    b.buffer.size(),
                    self.max_range
                )));
            }
            if !b.offset.is_multiple_of(self.align) {
                return Err(GpuError::Unsupported(format!(
                    "binding offset {} is not a multiple of {}",
                    b.offset, self.align
                )));
            }
        }
        if bindings.iter().any(|b| self.hazards.conflicts(b)) {
            self.barrier();
        }
        if let Some(q8) = &mut self.q8 {
            q8.forget_written(bindings);
        }
        bindings.iter().for_each(|b| self.hazards.note(b));

        let set = self.arena.set(pipeline.set_layout)?;
        let infos: Vec<_> = bindings
            .iter()
            .map(|b| {
                vk::DescriptorBufferInfo::default()
                    .buffer(b.buffer.raw)
                    .offset(b.offset)
                    .range(b.range)
            })
            .collect();
        let dev = &self.kernels.device.raw;
        // SAFETY: `set` is new and unused; `cmd` is recording; the pipeline, its layout and the
        // set belong to this device and outlive the submission (kept in `self.pipelines` and
        // the arena); the bound ranges lie inside their buffers, as checked above.
        unsafe {
            write_storage_buffers(dev, set, &infos);
            dev.cmd_bind_pipeline(self.cmd, vk::PipelineBindPoint::COMPUTE, pipeline.raw);
            dev.cmd_bind_descriptor_sets(
                self.cmd,
                vk::PipelineBindPoint::COMPUTE,
                pipeline.layout,
                0,
                &[set],
                &[],
            );
            if !push.is_empty() {
                dev.cmd_push_constants(
                    self.cmd,
                    pipeline.layout,
                    vk::ShaderStageFlags::COMPUTE,
                    0,
                    &push,
                );
            }
            match grid {
                Grid::Fixed([x, y, z]) => dev.cmd_dispatch(self.cmd, x, y, z),
                Grid::Indirect(words) => dev.cmd_dispatch_indirect(
                    self.cmd,
                    words.buffer.raw,
                    u64::from(words.index) * 4,
                ),
            }
        }
        self.pipelines.push(pipeline);
        self.stats.dispatches += 1;
        Ok(())
    }

    /// Resets queries `0..count` of `pool` (before any is written in this step).
    pub(crate) fn reset_queries(&mut self, pool: vk::QueryPool, count: u32) {
        // SAFETY: `cmd` is recording, outside a render pass; `pool` has `count` queries.
        unsafe {
            self.kernels
                .device
                .raw
                .cmd_reset_query_pool(self.cmd, pool, 0, count)
        };
    }

    /// Writes a timestamp into `query` of `pool` once every command recorded before it on the
    /// queue has completed.
    pub(crate) fn write_timestamp(&mut self, pool: vk::QueryPool, query: u32) {
        // SAFETY: `cmd` is recording; `query` lies in `pool` and was reset earlier on the queue.
        unsafe {
            self.kernels.device.raw.cmd_write_timestamp(
                self.cmd,
                vk::PipelineStageFlags::ALL_COMMANDS,
                pool,
                query,
            )
        };
    }

    /// Makes what earlier submissions' dispatches wrote visible to this recording's: a recording
    /// that continues work an earlier one left (after the host read something back) starts with
    /// this. A pipeline barrier orders everything before it on the queue, earlier command
    /// buffers included; a fence wait alone does not make device writes visible to the device.
    pub fn after_earlier_submissions(&mut self) {
        self.barrier();
        self.forget_q8();
    }

    /// As [`Recorder::after_earlier_submissions`], and the host's writes to mapped memory
    /// before this part was released (by a semaphore signal) are visible to it too.
    pub fn after_host_writes(&mut self) {
        self.forget_q8();
        self.barrier_after(vk::PipelineStageFlags::HOST, vk::AccessFlags::HOST_WRITE);
    }

    /// Copies `size` bytes of `src` from `src_offset` into `dst` at `dst_offset` once every
    /// dispatch recorded before it is done; later dispatches, and the host once the recording
    /// has completed, see what it wrote.
    pub fn copy(
        &mut self,
        (src, src_offset): (&Buffer, u64),
        (dst, dst_offset): (&Buffer, u64),
        size: u64,
    ) -> Result<()> {
        self.copies(&[(src, src_offset, dst, dst_offset, size)])
    }

    /// [`Recorder::copy`] of each `(src, src_offset, dst, dst_offset, size)`, all between one
    /// barrier before and one after.
    pub fn copies(&mut self, copies: &[(&Buffer, u64, &Buffer, u64, u64)]) -> Result<()> {
        self.forget_q8();
        for &(src, src_offset, dst, dst_offset, size) in copies {
            if src_offset + size > src.size() || dst_offset + size > dst.size() {
                return Err(GpuError::Unsupported(format!(
                    "a copy of {size} bytes from {src_offset} of {} into {dst_offset} of {}",
                    src.size(),
                    dst.size()
                )));
            }
        }
        let dev = &self.kernels.device.raw;
        let before = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE)
            .dst_access_mask(vk::AccessFlags::TRANSFER_READ | vk::AccessFlags::TRANSFER_WRITE);
        let after = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(
                vk::AccessFlags::SHADER_READ
                    | vk::AccessFlags::SHADER_WRITE
                    | vk::AccessFlags::HOST_READ,
            );
        // SAFETY: `cmd` is recording; the buffers outlive the recording's submission (the
        // caller's borrows) and every region lies inside them, as checked above.
        unsafe {
            dev.cmd_pipeline_barrier(
                self.cmd,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::PipelineStageFlags::TRANSFER,
                vk::DependencyFlags::empty(),
                &[before],
                &[],
                &[],
            );
            for &(src, src_offset, dst, dst_offset, size) in copies {
                let region = [vk::BufferCopy {
                    src_offset,
                    dst_offset,
                    size,
                }];
                dev.cmd_copy_buffer(self.cmd, src.raw, dst.raw, &region);
            }
            dev.cmd_pipeline_barrier(
                self.cmd,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::HOST,
                vk::DependencyFlags::empty(),
                &[after],
                &[],
                &[],
            );
        }
        self.hazards = Hazards::default();
        self.stats.barriers += 2;
        Ok(())
    }

    /// The copies `up` has pending, run here, before what is recorded next: a step takes a
    /// promotion's copies this way instead of a submission and a wait of their own. The caller
    /// tells `up` once the recording is submitted ([`super::upload::Uploader::submitted`]).
    ///
    /// # Safety
    /// As [`super::upload::Uploader::record_pending`].
    pub(crate) unsafe fn uploads(&mut self, up: &super::upload::Uploader) {
        if !up.has_pending() {
            return;
        }
        self.forget_q8();
        // SAFETY: `cmd` is recording; the caller's contract covers the staging.
        unsafe { up.record_pending(self.cmd) };
        self.hazards = Hazards::default();
        self.stats.barriers += 1;
    }

    /// Compute writes before it are visible to compute reads and writes after it.
    fn barrier(&mut self) {
        self.barrier_after(vk::PipelineStageFlags::empty(), vk::AccessFlags::empty());
    }

    /// [`Recorder::barrier`], whose first scope also holds `stage`'s `access`.
    fn barrier_after(&mut self, stage: vk::PipelineStageFlags, access: vk::AccessFlags) {
        let barrier = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::SHADER_READ | access)
            .dst_access_mask(vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE);
        // SAFETY: `cmd` is recording.
        unsafe {
            self.kernels.device.raw.cmd_pipeline_barrier(
                self.cmd,
                vk::PipelineStageFlags::COMPUTE_SHADER | stage,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::DependencyFlags::empty(),
                &[barrier],
                &[],
                &[],
            );
        }
        self.hazards = Hazards::default();
        self.stats.barriers += 1;
    }

    /// Makes every shader write visible to the host and to transfers.
    fn finish(&mut self) {
        let barrier = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE)
            .dst_access_mask(vk::AccessFlags::HOST_READ | vk::AccessFlags::TRANSFER_READ);
        // SAFETY: `cmd` is recording.
        unsafe {
            self.kernels.device.raw.cmd_pipeline_barrier(
                self.cmd,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::PipelineStageFlags::HOST | vk::PipelineStageFlags::TRANSFER,
                vk::DependencyFlags::empty(),
                &[barrier],
                &[],
                &[],
            );
        }
    }
}

/// A recording of a warm-up and a timed part, run as often as wanted
/// ([`Kernels::record_timed_replay`]).
pub struct TimedReplay {
    // Dropped first: the command buffer refers to the timers' query pools.
    replay: Replay,
    whole: Timer,
    timer: Timer,
}

impl TimedReplay {
    /// Runs the recording and waits: nanoseconds of the whole recording and of the timed part
    /// (`None` where the queue has no timestamps).
    pub fn run(&self) -> Result<Option<(u64, u64)>> {
        self.replay.run()?;
        Ok(self.whole.elapsed_ns()?.zip(self.timer.elapsed_ns()?))
    }
}
