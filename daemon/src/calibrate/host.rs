//! The host half of calibration: CPU kernels, host memory, and the disk.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use spillway_sched::model::WeightType;

use super::{ggml_type, median_seconds, random_matrix, CalibrateError};
use crate::cpu::matvec::matvec;
use crate::cpu::pool::ThreadPool;
use crate::engine::experts::routed_experts_with;
use crate::model::MatRef;
use crate::stream::{Priority, ReaderOptions, StorageFaults, TileReader, TileRequest};

/// Tiles kept in flight by the disk measurement (the reader's default queue depth).
const IN_FLIGHT: usize = 32;

pub struct HostBench {
    pools: HashMap<u32, ThreadPool>,
    /// The cold rotation ([`super::cold`]): copies of the last case's data, its allocation
    /// kept for the next case (fresh pages cost more to fault in than to fill); and the
    /// matrix it holds, reused while the shape and type stay the same.
    rotation: Vec<u8>,
    matrix: Option<(String, u64, u64)>,
    /// Bytes a rotation covers.
    cold: u64,
    /// The file the disk is read from, and whether it is ours to delete.
    file: PathBuf,
    owned: bool,
}

impl HostBench {
    /// Reads from `file` (a model file, ideally on the disk models load from) or, when `None`,
    /// from a file of `scratch_bytes` random bytes written under `scratch_dir`.
    pub fn new(
        file: Option<&Path>,
        scratch_dir: &Path,
        scratch_bytes: u64,
    ) -> Result<HostBench, CalibrateError> {
        let (file, owned) = match file {
            Some(f) => (f.to_path_buf(), false),
            None => {
                std::fs::create_dir_all(scratch_dir)?;
                remove_stale_scratch(scratch_dir);
                let path = scratch_path(scratch_dir);
                let mut rng = crate::synth::rng::Xoshiro256::seed_from(1);
                let mut data = vec![0u8; scratch_bytes as usize];
                rng.fill_bytes(&mut data);
                std::fs::write(&path, &data)?;
                (path, true)
            }
        };
        Ok(HostBench {
            pools: HashMap::new(),
            rotation: Vec::new(),
            matrix: None,
            cold: super::cold::host_cold_bytes(),
            file,
            owned,
        })
    }

    /// One product of a `k`-wide, `n`-tall matrix of `t` with a vector on `threads` threads,
    /// each run on a copy of the matrix the runs before it did not read.
    pub fn matvec(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        threads: u32,
    ) -> Result<f64, CalibrateError> {
        let ty = ggml_type(t)?;
        let key = (t.name().to_string(), k, n);
        let bytes = ty.row_bytes(k).expect("random_matrix sized it") as usize * n as usize;
        let copies = super::cold::copies(bytes as u64, self.cold);
        if self.matrix.as_ref() != Some(&key) {
            self.matrix = None;
            let one = random_matrix(ty, k, n)?;
            repeat_into(&mut self.rotation, &[&one], copies);
            self.matrix = Some(key);
        }
        let all = &self.rotation[..bytes * copies];
        let mut copy = all.chunks_exact(bytes).cycle();
        let x = vec![0.5f32; k as usize];
        let mut out = vec![0f32; n as usize];
        let pool = pool(&mut self.pools, threads);
        median_seconds(|| {
            let m = MatRef {
                ty,
                n_in: k as usize,
                n_out: n as usize,
                data: copy.next().expect("a cycle of at least two copies"),
            };
            matvec(pool, m, &x, &mut out);
            Ok::<(), CalibrateError>(())
        })
    }

    /// One MoE layer's routed experts for one token, as the CPU engine runs them
    /// ([`routed_experts_with`]: one token's gate, up and down products of every expert in one
    /// job of the pool): `used` experts, each a `k`→`n` gate and up and an `n`→`k` down of type
    /// `t`, each run on copies of the experts the runs before it did not read.
    pub fn experts(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        used: u64,
        threads: u32,
    ) -> Result<f64, CalibrateError> {
        let ty = ggml_type(t)?;
        let (gate, down) = (random_matrix(ty, k, n)?, random_matrix(ty, n, k)?);
        let expert = 2 * gate.len() + down.len();
        let group = expert * used as usize;
        let copies = super::cold::copies(group as u64, self.cold);
        self.matrix = None;
        repeat_into(
            &mut self.rotation,
            &[&gate, &gate, &down],
            copies * used as usize,
        );
        let all = &self.rotation[..group * copies];
        let mut groups = all.chunks_exact(group).cycle();
        let x = vec![0.5f32; k as usize];
        let chosen: Vec<usize> = (0..used as usize).collect();
        let pool = pool(&mut self.pools, threads);
        let (k, n, g) = (k as usize, n as usize, gate.len());
        median_seconds(|| {
            let stack = groups.next().expect("a cycle of at least two copies");
            let mats = |ex: usize| {
                let at = ex * expert;
                let m = |from: usize, len: usize, n_in: usize, n_out: usize| MatRef {
                    ty,
                    n_in,
                    n_out,
                    data: &stack[at + from..at + from + len],
                };
                [m(0, g, k, n), m(g, g, k, n), m(2 * g, down.len(), n, k)]
            };
            std::hint::black_box(routed_experts_with(pool, &mats, &x, &chosen, used as usize));
            Ok::<(), CalibrateError>(())
        })
    }

    /// One empty job on `threads` threads of the pool, run and waited for: the fixed cost of
    /// each parallel op of a CPU decode step.
    pub fn dispatch(&mut self, threads: u32) -> Result<f64, CalibrateError> {
        let pool = pool(&mut self.pools, threads);
        let tasks = threads.max(1) as usize;
        const JOBS: u32 = 1000;
        let per_run = median_seconds(|| {
            for _ in 0..JOBS {
                pool.run(tasks, &|i| {
                    std::hint::black_box(i);
                });
            }
            Ok::<(), CalibrateError>(())
        })?;
        Ok(per_run / f64::from(JOBS))
    }

    /// Sums `bytes` of host memory as 8-byte words on `threads` threads, each run over a
    /// window of a larger buffer the runs before it did not read.
    pub fn read(&mut self, bytes: u64, threads: u32) -> Result<f64, CalibrateError> {
        // Windows of fresh memory (what they hold does not matter), read as words: here the
        // rotation's pages, or fresh ones after it was let go, read a third slower.
        let window = 8 * (bytes / 8).max(1) as usize;
        let copies = super::cold::copies(bytes, self.cold);
        let fresh = vec![1u8; window * copies];
        let mut windows = fresh.chunks_exact(window).cycle();
        let pool = pool(&mut self.pools, threads);
        let tasks = threads.max(1) as usize;
        let chunk = (window / 8).div_ceil(tasks) * 8;
        median_seconds(|| {
            let bytes = windows.next().expect("a cycle of at least two windows");
            pool.run(tasks, &|i| {
                let part = &bytes[(i * chunk).min(bytes.len())..((i + 1) * chunk).min(bytes.len())];
                std::hint::black_box(sum_words(part));
            });
            Ok::<(), CalibrateError>(())
        })
    }

    /// `count` tiles of `tile` bytes read from the file through the tile reader, up to
    /// [`IN_FLIGHT`] at once, the file's pages dropped from the page cache before each run.
    /// Tiles past the end of the file wrap around to its start.
    pub fn ssd_read(&mut self, tile: u64, count: u64) -> Result<f64, CalibrateError> {
        let options = ReaderOptions {
            max_tile: tile as usize,
            buffers: IN_FLIGHT,
            // A measurement of the disk, not of injected faults.
            faults: StorageFaults::default(),
            ..ReaderOptions::default()
        };
        let reader = TileReader::open(&self.file, &options)?;
        let len = reader.file_len();
        if len < tile {
            return Err(CalibrateError::Unsupported(format!(
                "{} holds {len} bytes, less than one {tile}-byte tile",
                self.file.display()
            )));
        }
        let tiles_in_file = len / tile;
        let file = std::fs::File::open(&self.file)?;
        median_seconds(|| {
            // SAFETY: a valid descriptor; the advice has no memory-safety effect.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            let mut in_flight = VecDeque::with_capacity(IN_FLIGHT);
            for i in 0..count {
                if in_flight.len() == IN_FLIGHT {
                    let h: crate::stream::ReadHandle =
                        in_flight.pop_front().expect("the queue is full");
                    drop(h.wait()?);
                }
                in_flight.push_back(reader.read_tile(TileRequest {
                    offset: (i % tiles_in_file) * tile,
                    len: tile as usize,
                    priority: Priority::Demand,
                    tag: i,
                }));
            }
            for h in in_flight {
                drop(h.wait()?);
            }
            Ok::<(), CalibrateError>(())
        })
    }
}

/// The pool of `threads` threads, made on first use.
fn pool(pools: &mut HashMap<u32, ThreadPool>, threads: u32) -> &ThreadPool {
    pools
        .entry(threads)
        .or_insert_with(|| ThreadPool::new(threads as usize))
}

impl Drop for HostBench {
    fn drop(&mut self) {
        if self.owned {
            let _ = std::fs::remove_file(&self.file);
        }
    }
}

/// This process's scratch file in `dir`, when it measures reads from a file of its own.
pub fn scratch_path(dir: &Path) -> std::path::PathBuf {
    dir.join(format!("calibrate-{}.bin", std::process::id()))
}

/// Deletes the scratch files in `dir` of calibrations whose process is gone (a daemon killed
/// during its first start leaves its file behind): `calibrate-PID.bin` where `/proc/PID`
/// does not exist.
fn remove_stale_scratch(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.strip_prefix("calibrate-"))
            .and_then(|n| n.strip_suffix(".bin"))
            .and_then(|n| n.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !Path::new("/proc").join(pid.to_string()).exists() {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// The wrapping sum of `bytes` as little-endian 8-byte words (a tail under 64 bytes is
/// skipped), in eight independent sums so that the loads are not one chain of adds.
fn sum_words(bytes: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    for line in bytes.chunks_exact(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            let w: [u8; 8] = line[8 * j..8 * j + 8].try_into().expect("8 bytes");
            *a = a.wrapping_add(u64::from_le_bytes(w));
        }
    }
    acc.iter().fold(0, |s, &a| s.wrapping_add(a))
}

/// Fills the start of `buf` with `copies` repetitions of `parts` laid one after another,
/// written by the machine's threads; `buf` grows when it is too short and keeps its length
/// otherwise.
fn repeat_into(buf: &mut Vec<u8>, parts: &[&[u8]], copies: usize) {
    let one: usize = parts.iter().map(|p| p.len()).sum();
    let total = one * copies;
    if total == 0 {
        return;
    }
    if buf.len() < total {
        buf.resize(total, 0);
    }
    let mut pairs = Vec::with_capacity(copies * parts.len());
    for copy in buf[..total].chunks_exact_mut(one) {
        let mut rest = copy;
        for p in parts {
            let (dst, after) = rest.split_at_mut(p.len());
            pairs.push((dst, *p));
            rest = after;
        }
    }
    crate::gpu::matrix::copy_parallel(pairs);
}

#[cfg(test)]
mod tests {
    use super::{repeat_into, sum_words};

    #[test]
    fn scratch_of_gone_processes_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mine = format!("calibrate-{}.bin", std::process::id());
        // No process has this id (pid_max is at most 2^22).
        let gone = "calibrate-4294967295.bin";
        for name in [mine.as_str(), gone, "calibrate-notes.bin", "other.bin"] {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        super::remove_stale_scratch(dir.path());
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = vec![mine, "calibrate-notes.bin".into(), "other.bin".into()];
        want.sort();
        assert_eq!(left, want);
    }

    #[test]
    fn words_sum_by_lines() {
        let bytes: Vec<u8> = (0..128u64).flat_map(|w| (w % 16).to_le_bytes()).collect();
        assert_eq!(sum_words(&bytes[..1024]), 8 * (0..16).sum::<u64>());
    }

    #[test]
    fn a_rotation_repeats_its_parts_and_keeps_its_allocation() {
        let mut buf = Vec::new();
        repeat_into(&mut buf, &[&[1, 2], &[3]], 5);
        assert_eq!(buf, [1, 2, 3].repeat(5));
        let at = buf.as_ptr();
        repeat_into(&mut buf, &[&[9]], 4);
        assert_eq!(&buf[..4], [9; 4]);
        assert_eq!(buf.as_ptr(), at, "a shorter rotation reuses the buffer");
    }
}
