//! The GPU half of calibration, on one Vulkan device.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ash::vk;
use spillway_sched::model::WeightType;

use super::{ggml_type, median_seconds, random_matrix, CalibrateError};
use crate::gpu::ops::{
    attention_counters, attention_scratch_floats, rope_table, AttentionArgs, RopeArgs, StepWord,
};
use crate::gpu::ops::{upload_f32, GpuMatrix};
use crate::gpu::ops_attention::{attention_grid, Unroped};
use crate::gpu::ops_moe::IdFused;
use crate::gpu::upload::DEFAULT_STAGING_BYTES;
use crate::gpu::{
    Allocator, Buffer, Device, DeviceInfo, DeviceKind, Instance, Kernels, MemoryUse, Uploader,
};
use crate::model::RopeLayout;
use spillway_sched::calibrate::AttentionHeads;

/// The least a GPU runs a case before it is timed ([`GpuBench::gpu_seconds`]).
const WARM_UP: Duration = Duration::from_millis(30);

/// The least for the cases that follow a long setup on the host (a MoE layer's stacks,
/// attention's caches): on an H100 the clocks climbed for longer than [`WARM_UP`] after
/// them, and three runs in a row could agree on the way up (an expert's share of the same
/// layer timed at 1.6, 3.7 and 9.5 µs in three calibrations, when its stack's rows were all
/// made on one host thread for seconds; 300 ms fixed that, and 150 ms, with the setups now
/// a tenth as long, kept those figures).
const LONG_WARM_UP: Duration = Duration::from_millis(150);

/// How a timing warms the device up ([`GpuBench::gpu_seconds_warm`]).
#[derive(Debug, Clone, Copy)]
enum WarmUp {
    /// After the host set a case up, the device idle meanwhile: recordings of the case,
    /// repeated until each keeps the device busy, for at least this long and until three in
    /// a row agree.
    AfterSetup(Duration),
    /// Right after a timing of the same case that ran these repetitions before its own and
    /// left the clocks up: from them, until two recordings agree.
    Following(usize),
}

/// The most: an idle GPU's clocks took about a second to come back on the H100.
const MAX_WARM_UP: Duration = Duration::from_millis(1500);

/// GPU time the repetitions before a timed case take at an idle device's pace (at most
/// [`MAX_REPS`] of them).
const BUSY: Duration = Duration::from_millis(10);
const MAX_REPS: usize = 256;

/// Experts of random rows a calibration stack repeats ([`GpuBench::experts`]).
const POOL_EXPERTS: u64 = 8;

/// The widest input whose quantization products share (wider ones quantize in each product).
const MAX_INPUTS: usize = 65536;

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
        let allocator = Allocator::new(&device, None);
        // The kernels a model runs: integer dot products where the device has them, their
        // inputs quantized once for the products that read them, as a decode step's are.
        let kernels = Kernels::with_int_dot(&device, (device.subgroup_arithmetic(), true), true);
        if kernels.uses_int_dot() {
            let bytes = crate::gpu::ops_q8::q8_bytes(MAX_INPUTS, 1);
            let scratch = Buffer::new_in(&allocator, bytes, MemoryUse::DeviceLocal).ok();
            kernels.set_q8_scratch(scratch.map(Arc::new));
        }
        GpuBench {
            allocator,
            kernels,
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
    ///
    /// On a GPU, `f` is timed on a device kept busy, as a decode step finds it. A GPU left idle
    /// while the host sets a case up (making and uploading a large matrix's copies takes
    /// seconds) lowers its clocks, and short recordings do not bring them back: on the H100
    /// the SM clock fell from 1980 to 345 MHz during the calibration's largest cases and
    /// stayed there, and every later product ran three times slower than in decode. So the
    /// timing records `f` repeated for about [`BUSY`] at the pace of one `f` on the idle
    /// device, then `f` alone between timestamps, once (recording thousands of dispatches
    /// anew for every run left the device idle as long as it ran); it runs that recording
    /// until the pace of the repetitions stops falling (three runs in a row within 3% of the
    /// best, for at least [`WARM_UP`]), then times `f` in [`super::REPEATS`] more runs. A
    /// device that is the CPU is timed one recording of `f` at a time.
    fn gpu_seconds(
        &self,
        f: impl Fn(&mut crate::gpu::Recorder<'_>) -> Result<(), crate::gpu::GpuError>,
    ) -> Result<f64, CalibrateError> {
        Ok(self.gpu_seconds_warm(WarmUp::AfterSetup(WARM_UP), f)?.0)
    }

    /// [`GpuBench::gpu_seconds`] warmed up as `warm_up` says; also the repetitions the timed
    /// recordings ran before `f`, for a [`WarmUp::Following`] timing of the same case.
    fn gpu_seconds_warm(
        &self,
        warm_up: WarmUp,
        f: impl Fn(&mut crate::gpu::Recorder<'_>) -> Result<(), crate::gpu::GpuError>,
    ) -> Result<(f64, usize), CalibrateError> {
        let repeated = |reps: usize| {
            let f = &f;
            move |r: &mut crate::gpu::Recorder<'_>| (0..reps).try_for_each(|_| f(r))
        };
        // A device that is the CPU, or a queue without timestamps: each run recorded and
        // timed alone (wall time without timestamps).
        let untimed = || -> Result<(f64, usize), CalibrateError> {
            let mut gpu_s = Vec::new();
            let wall = median_seconds(|| {
                if let Some(ns) = self.kernels.record_timed(&f)?.gpu_ns {
                    gpu_s.push(ns as f64 * 1e-9);
                }
                Ok::<(), CalibrateError>(())
            })?;
            // The first entry is the warm-up's.
            let mut timed: Vec<f64> = gpu_s.into_iter().skip(1).collect();
            timed.sort_by(f64::total_cmp);
            Ok((timed.get(timed.len() / 2).copied().unwrap_or(wall), 0))
        };
        if self.device.info().kind == DeviceKind::Cpu {
            return untimed();
        }
        let (reps, least, agree) = match warm_up {
            WarmUp::AfterSetup(least) => {
                // Enough repetitions to keep the device busy for `BUSY` at the pace of one run
                // now (an idle device's clocks make it slow; the runs follow each other closely
                // enough to keep it busy once they are up).
                let Some(ns) = self.kernels.record_timed(&f)?.gpu_ns else {
                    return untimed();
                };
                let reps = (BUSY.as_nanos() as u64).div_ceil(ns.max(1)) as usize;
                (reps.clamp(1, MAX_REPS), least, 3)
            }
            WarmUp::Following(reps) => (reps.clamp(1, MAX_REPS), Duration::ZERO, 1),
        };
        // Recorded once, run until the pace of the repetitions settles, then timed.
        let replay = self.kernels.record_timed_replay(repeated(reps), &f)?;
        let (start, mut best, mut settled, mut runs) = (Instant::now(), f64::MAX, 0, 0);
        while start.elapsed() < MAX_WARM_UP {
            let Some((whole, _)) = replay.run()? else {
                return untimed();
            };
            runs += 1;
            let each = whole as f64 / (reps + 1) as f64;
            settled = if each < 0.97 * best { 0 } else { settled + 1 };
            best = best.min(each);
            if settled >= agree && start.elapsed() >= least {
                break;
            }
        }
        tracing::debug!(
            "calibration warm-up: {:.0} ms, {runs} runs of {reps}, {}",
            start.elapsed().as_secs_f64() * 1e3,
            if settled >= agree {
                "settled"
            } else {
                "did not settle"
            }
        );
        let mut timed = Vec::with_capacity(super::REPEATS);
        for _ in 0..super::REPEATS {
            if let Some((_, ns)) = replay.run()? {
                timed.push(ns as f64 * 1e-9);
            }
        }
        timed.sort_by(f64::total_cmp);
        match timed.get(timed.len() / 2) {
            Some(&s) => Ok((s, reps)),
            None => untimed(),
        }
    }

    /// Seconds per product of a chain of `chain` products of a `k`-wide, `n`-tall matrix of
    /// `t` with a vector, recorded into one command buffer (a barrier after each on a GPU, as
    /// decode records most: see `overlap`); each product reads the next of copies of the matrix that
    /// together pass the caches. GPU time from timestamps where the queue has them, else wall
    /// time.
    pub fn matvec(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        chain: u64,
    ) -> Result<f64, CalibrateError> {
        let ty = ggml_type(t)?;
        let data = random_matrix(ty, k, n)?;
        let mut uploader = Uploader::new(&self.allocator, DEFAULT_STAGING_BYTES)?;
        let copies = super::cold::copies(data.len() as u64, self.cold_bytes());
        // One upload, the other copies made on the device: through the host they took a
        // first start seconds while the GPU idled.
        let first = GpuMatrix::upload(
            &self.allocator,
            &mut uploader,
            ty,
            k as usize,
            n as usize,
            &data,
        )?;
        let w = (1..copies)
            .map(|_| {
                let buffer =
                    Buffer::new_in(&self.allocator, data.len() as u64, MemoryUse::DeviceLocal)?;
                Ok(GpuMatrix {
                    buffer,
                    wtype: first.wtype,
                    n_in: first.n_in,
                    n_out: first.n_out,
                    row_bytes: first.row_bytes,
                })
            })
            .collect::<Result<Vec<_>, CalibrateError>>()?;
        uploader.flush()?;
        let bytes = data.len() as u64;
        self.device_copies(&first.buffer, w.iter().map(|m| (&m.buffer, 0, bytes)))?;
        let w: Vec<GpuMatrix> = std::iter::once(first).chain(w).collect();
        // The vector in device memory, as decode keeps its activations: read from host-visible
        // memory, every workgroup's read of it would cross the bus.
        let x = upload_f32(&self.allocator, &mut uploader, &vec![0.5; k as usize])?;
        // Products here write `overlap` outputs in turn, so a barrier falls every `overlap`
        // products (when an output is written again): after each on a GPU, as most of
        // decode's do ([`GpuBench::overlap`]).
        let overlap = self.overlap();
        let y = (0..overlap)
            .map(|_| Buffer::new_in(&self.allocator, n * 4, MemoryUse::DeviceLocal))
            .collect::<Result<Vec<_>, _>>()?;
        uploader.flush()?;
        let next = std::cell::Cell::new(0usize);
        let total = self.gpu_seconds(|r| {
            for i in 0..chain as usize {
                r.matvec(&w[next.get() % w.len()], &x, &y[i % overlap])?;
                next.set(next.get() + 1);
            }
            Ok(())
        })?;
        Ok(total / chain.max(1) as f64)
    }

    /// Seconds one more chosen expert adds to a MoE layer's routed experts for one token, as a
    /// decode step runs them with every expert in VRAM (`GpuMoe`'s routed path): `used`
    /// experts of a stack against a quarter and half as many (the slope), each a
    /// `k`→`n` gate and up and an `n`→`k` down of type `t`; one expert-indexed dispatch takes
    /// the input's RMSNorm, every chosen expert's gate and up and their SwiGLU, the next adds
    /// their down products, weighted, into the input, which the next layer's experts read.
    /// Timed over a chain of layers, each choosing other experts than the layer before it,
    /// from a stack whose experts together pass the GPU's caches. `None` where `used` such
    /// experts' gate and up stack would pass one binding (`maxStorageBufferRange`).
    pub fn experts(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        used: u64,
    ) -> Result<Option<f64>, CalibrateError> {
        const CHAIN: usize = 16;
        let ty = ggml_type(t)?;
        let unsupported = || CalibrateError::Unsupported(format!("{t} experts of {n}×{k}"));
        let row = |width: u64| ty.row_bytes(width).ok_or_else(unsupported);
        let expert_bytes = 2 * n * row(k)? + k * row(n)?;
        let used = used.max(1);
        // Experts in the stack: as many as pass the caches, at least two layers' worth (so that
        // a layer's experts are not the one's before it), at most a large model's count (256),
        // within one binding for the gate and up stack.
        let max_range = self.device.max_storage_buffer_range();
        let wanted = self
            .cold_bytes()
            .div_ceil(expert_bytes)
            .clamp(2 * used, 256)
            .div_ceil(used)
            * used;
        let fits = max_range / (2 * n * row(k)?).max(1);
        let n_expert = (wanted.min(fits) / used * used).max(used);
        if n_expert > fits {
            // A model's stack of such experts would not fit one binding either: its experts
            // would not run this way here.
            return Ok(None);
        }
        let mut uploader = Uploader::new(&self.allocator, DEFAULT_STAGING_BYTES)?;
        // A few experts' random rows, repeated through the stack: making every expert's own
        // took seconds a case on the host (a stack of 512 MiB), and the GPU reads them the same.
        // Copied on the device from one upload.
        let pool = n_expert.min(POOL_EXPERTS);
        let (k_us, n_us) = (k as usize, n as usize);
        let rows = n_expert as usize;
        let gate_up = random_matrix(ty, k, 2 * pool * n)?;
        let gate_up = self.repeated(&mut uploader, ty, k_us, 2 * rows * n_us, &gate_up)?;
        let down = random_matrix(ty, n, pool * k)?;
        let down = self.repeated(&mut uploader, ty, n_us, rows * k_us, &down)?;
        // Routings one after another, `route_floats(used)` words each: the ids (as bits),
        // the weights, the shared expert's gate.
        let words = crate::gpu::ops_moe::route_floats(used as usize);
        let routings = (n_expert / used) as usize;
        let mut route = Vec::with_capacity(routings * words);
        for r in 0..routings {
            let first = r as u64 * used;
            route.extend((first..first + used).map(|e| f32::from_bits(e as u32)));
            route.extend((0..used).map(|_| 1.0 / used as f32));
            route.push(0.0);
        }
        let route = upload_f32(&self.allocator, &mut uploader, &route)?;
        let x = upload_f32(&self.allocator, &mut uploader, &vec![0.5; k_us])?;
        let norm = upload_f32(&self.allocator, &mut uploader, &vec![1.0; k_us])?;
        let h = Buffer::new_in(&self.allocator, used * n * 4, MemoryUse::DeviceLocal)?;
        uploader.flush()?;
        let n32 = n as u32;
        let next = std::cell::Cell::new(0usize);
        // A chain of layers each running `count` of its routing's experts.
        let layer_seconds = |count: u32, warm_up: WarmUp| {
            let (total, reps) = self.gpu_seconds_warm(warm_up, |r| {
                for _ in 0..CHAIN {
                    let rank = ((next.get() % routings) * words) as u32;
                    next.set(next.get() + 1);
                    let glu = IdFused {
                        norm: Some((&norm, 1e-6)),
                        glu_up_rows: Some(rows * n_us),
                        ..IdFused::default()
                    };
                    let (ids, h_out) = ((&route, rank), (&h, n32));
                    r.matvec_id_fused(&gate_up, n_us, ids, count, (&x, 0), h_out, glu)?;
                    let summed = IdFused {
                        sum_weights_at: Some(rank + used as u32),
                        ..IdFused::default()
                    };
                    r.matvec_id_fused(&down, k_us, ids, count, h_out, (&x, 0), summed)?;
                }
                Ok(())
            })?;
            Ok::<(f64, usize), CalibrateError>((total / CHAIN as f64, reps))
        };
        // What one more expert adds: the least-squares slope over a quarter, half and all of
        // `used`, so that the layer's fixed costs (its dispatches, their barriers) cancel. On
        // lavapipe single timings of the same layer scatter by a fifth, which a slope between
        // two counts magnified.
        let mut counts = vec![(used / 4).max(1), (used / 2).max(1), used];
        counts.dedup();
        // Only the first count follows the setup's idle device; the others follow it, busy.
        let mut warm_up = WarmUp::AfterSetup(LONG_WARM_UP);
        let mut times = Vec::with_capacity(counts.len());
        for &c in &counts {
            let (seconds, reps) = layer_seconds(c as u32, warm_up)?;
            times.push(seconds);
            warm_up = WarmUp::Following(reps);
        }
        if counts.len() == 1 {
            return Ok(Some(times[0] / used as f64));
        }
        let n = counts.len() as f64;
        let mc = counts.iter().sum::<u64>() as f64 / n;
        let mt = times.iter().sum::<f64>() / n;
        let (mut cov, mut var) = (0.0, 0.0);
        for (&c, &t) in counts.iter().zip(&times) {
            cov += (c as f64 - mc) * (t - mt);
            var += (c as f64 - mc).powi(2);
        }
        Ok(Some((cov / var).max(0.0)))
    }

    /// Seconds of one layer's decode attention for a token at each of `positions`, as a
    /// decode step runs it ([`Recorder::attention_rope`](crate::gpu::Recorder::attention_rope):
    /// the QK-norm, RoPE and the KV-cache append in its dispatch, the grid read from the
    /// step's words, which live in host-visible memory as decode's do), with heads `h`. Timed
    /// over a chain of layers, each with its own cache (as long as the last position needs),
    /// one after another. Only the first position follows the setup's idle device, so only it
    /// gets the long warm-up.
    pub fn attention(
        &mut self,
        h: AttentionHeads,
        positions: &[u64],
    ) -> Result<Vec<f64>, CalibrateError> {
        const CHAIN: usize = 16;
        let Some(&last) = positions.iter().max() else {
            return Ok(Vec::new());
        };
        let (n_heads, n_kv, hd) = (
            h.n_heads as usize,
            h.n_kv_heads as usize,
            h.head_dim as usize,
        );
        let capacity = last as usize + 1;
        let args = AttentionArgs {
            n_heads: n_heads as u32,
            n_kv_heads: n_kv as u32,
            head_dim: hd as u32,
            capacity: capacity as u32,
        };
        let rope = |n: usize| RopeArgs {
            layout: RopeLayout::Neox,
            n_heads: n as u32,
            head_dim: hd as u32,
            n_rot: hd as u32,
            eps: 1e-6,
        };
        let mut uploader = Uploader::new(&self.allocator, DEFAULT_STAGING_BYTES)?;
        let mut f32s = |v: &[f32]| upload_f32(&self.allocator, &mut uploader, v);
        let table = f32s(&rope_table(capacity + 4, hd, 10_000.0, 1.0, None))?;
        let (q, k, v) = (
            f32s(&vec![0.1; n_heads * hd])?,
            f32s(&vec![0.1; n_kv * hd])?,
            f32s(&vec![0.1; n_kv * hd])?,
        );
        let norms = (f32s(&vec![1.0; hd])?, f32s(&vec![1.0; hd])?);
        let out = f32s(&vec![0.0; n_heads * hd])?;
        let scores = f32s(&vec![0.0; attention_scratch_floats(n_heads, hd, capacity)])?;
        // Each layer's K and V caches, f16 (two to a float), of small values: one uploaded,
        // the others copied from it on the device.
        let cache_floats = capacity * n_kv * hd / 2;
        let first = f32s(&vec![0.01; cache_floats])?;
        uploader.flush()?;
        let cache_bytes = cache_floats as u64 * 4;
        let caches = (0..CHAIN)
            .map(|_| {
                let new = || Buffer::new_in(&self.allocator, cache_bytes, MemoryUse::DeviceLocal);
                Ok((new()?, new()?))
            })
            .collect::<Result<Vec<_>, CalibrateError>>()?;
        let copies = caches.iter().flat_map(|(kc, vc)| [kc, vc]);
        self.device_copies(&first, copies.map(|c| (c, 0, cache_bytes)))?;
        drop(first);
        let done = attention_counters(&self.allocator, n_heads, 1)?;
        // The position, the sequence's first cache row, the grid of the position's runs.
        let mut step = Buffer::new_in(&self.allocator, 24, MemoryUse::DeviceMapped)?;
        let mut seconds = Vec::with_capacity(positions.len());
        // Only the first position follows the setup's idle device.
        let mut warm_up = WarmUp::AfterSetup(LONG_WARM_UP);
        for &position in positions {
            let words: Vec<f32> = [position as u32, 0]
                .into_iter()
                .chain(attention_grid(args, position as u32))
                .map(f32::from_bits)
                .collect();
            step.write_f32(&words);
            let (total, reps) = self.gpu_seconds_warm(warm_up, |r| {
                for (kc, vc) in &caches {
                    let new = Unroped {
                        q: &q,
                        k: &k,
                        v: &v,
                        qk_norm: Some((&norms.0, &norms.1)),
                    };
                    let pos = StepWord {
                        buffer: &step,
                        index: 0,
                    };
                    let grid = StepWord {
                        buffer: &step,
                        index: 2,
                    };
                    r.attention_rope(
                        new,
                        (&table, rope(n_heads)),
                        (kc, vc),
                        (&scores, &done),
                        &out,
                        args,
                        (pos, Some(grid)),
                    )?;
                }
                Ok(())
            })?;
            seconds.push(total / CHAIN as f64);
            warm_up = WarmUp::Following(reps);
        }
        Ok(seconds)
    }

    /// A matrix of `n_out` rows of `n_in` weights of `ty` whose rows repeat `pool` (whole
    /// rows): `pool` uploaded once, then copied on the device until the rows are filled.
    fn repeated(
        &self,
        uploader: &mut Uploader,
        ty: crate::gguf::GgmlType,
        n_in: usize,
        n_out: usize,
        pool: &[u8],
    ) -> Result<GpuMatrix, CalibrateError> {
        let row = ty
            .row_bytes(n_in as u64)
            .ok_or_else(|| CalibrateError::Unsupported(format!("rows of {n_in} {ty} weights")))?;
        let total = row * n_out as u64;
        let mut m = GpuMatrix::upload(
            &self.allocator,
            uploader,
            ty,
            n_in,
            pool.len() / row as usize,
            pool,
        )?;
        uploader.flush()?;
        let buffer = Buffer::new_in(&self.allocator, total, MemoryUse::DeviceLocal)?;
        let pool_bytes = pool.len() as u64;
        let at = (0..total).step_by(pool.len());
        self.device_copies(
            &m.buffer,
            at.map(|o| (&buffer, o, pool_bytes.min(total - o))),
        )?;
        m.buffer = buffer;
        m.n_out = n_out;
        Ok(m)
    }

    /// Copies the start of `from` to each `(buffer, offset, bytes)` of `to`, on the device,
    /// and waits.
    fn device_copies<'a>(
        &self,
        from: &Buffer,
        to: impl Iterator<Item = (&'a Buffer, u64, u64)>,
    ) -> Result<(), CalibrateError> {
        let to: Vec<(&Buffer, u64, u64)> = to.collect();
        let raw = &self.device.raw;
        self.device.run_once(|cmd| {
            for &(dst, at, size) in &to {
                let region = [vk::BufferCopy {
                    src_offset: 0,
                    dst_offset: at,
                    size,
                }];
                // SAFETY: `cmd` is recording; both buffers outlive the submission (run_once
                // waits for it); the callers keep each region within `from` and its
                // destination.
                unsafe { raw.cmd_copy_buffer(cmd, from.raw, dst.raw, &region) };
            }
        })?;
        Ok(())
    }

    /// Products a chain of [`GpuBench::matvec`] runs between barriers: on a GPU one, as most
    /// of a decode layer's products wait on the one before (on the H100, timed three to a
    /// barrier, the Llama-3-8B shape's layers were predicted at 71 µs where profiled steps
    /// took 103; one to a barrier, at 90); on a device that is the CPU three, whose barriers
    /// cost little. `SPILLWAY_CALIBRATE_OVERLAP` sets it instead, for measuring what the
    /// order changes.
    fn overlap(&self) -> usize {
        let set = std::env::var("SPILLWAY_CALIBRATE_OVERLAP")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n > 0);
        set.unwrap_or(match self.device.info().kind {
            DeviceKind::Cpu => 3,
            _ => 1,
        })
    }

    /// Bytes a rotation of device buffers covers: the host's figure on a device that is the
    /// CPU (its caches are the CPU's), the floor for GPUs' caches elsewhere.
    fn cold_bytes(&self) -> u64 {
        if let Some(b) = super::cold::override_bytes() {
            return b;
        }
        if self.device.info().kind == DeviceKind::Cpu {
            super::cold::host_cold_bytes()
        } else {
            super::cold::MIN_COLD_BYTES
        }
    }

    /// Seconds per dispatch of [`CHAIN`] small matrix-vector products recorded into one command
    /// buffer, each reading the one before's output: the fixed cost of an op in a decode step.
    pub fn dispatch(&mut self) -> Result<f64, CalibrateError> {
        const CHAIN: u64 = 64;
        const N: usize = 256;
        let data = random_matrix(crate::gguf::GgmlType::F16, N as u64, N as u64)?;
        let mut uploader = Uploader::new(&self.allocator, DEFAULT_STAGING_BYTES)?;
        let w = GpuMatrix::upload(
            &self.allocator,
            &mut uploader,
            crate::gguf::GgmlType::F16,
            N,
            N,
            &data,
        )?;
        uploader.flush()?;
        let a = Buffer::new_in(&self.allocator, N as u64 * 4, MemoryUse::DeviceLocal)?;
        let b = Buffer::new_in(&self.allocator, N as u64 * 4, MemoryUse::DeviceLocal)?;
        let chain = self.gpu_seconds(|r| {
            for i in 0..CHAIN {
                let (x, y) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
                r.matvec(&w, x, y)?;
            }
            Ok(())
        })?;
        Ok(chain / CHAIN as f64)
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
