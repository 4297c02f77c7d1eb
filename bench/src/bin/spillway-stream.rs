//! `spillway-stream`: read bandwidth of the tile reader, per backend, against a raw sequential
//! baseline on the same file.
//!
//! Each run first drops the file's pages from the page cache (`posix_fadvise DONTNEED`; the
//! reader itself bypasses the cache with O_DIRECT where it can), then reads the file (or its
//! first `--limit` bytes) in tiles of `--tile` bytes, sequentially or in a shuffled order.
//! The baseline reads the same bytes with one thread in large O_DIRECT reads, as
//! `dd iflag=direct bs=64M` would: roughly what the device gives a single stream. Figures are
//! medians of `--runs` runs.
//!
//!     cargo run --release -p spillway-bench --bin spillway-stream -- FILE --tile 4MiB --depth 32
//!     cargo run --release -p spillway-bench --bin spillway-stream -- big.bin --create 4GiB

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use spillway_daemon::stream::{
    AlignedRegion, BackendChoice, HostRegion, Priority, ReadHandle, ReaderOptions, StorageFaults,
    TileReader, TileRequest,
};

#[derive(Parser)]
#[command(about = "Read bandwidth of the SSD tile reader")]
struct Args {
    /// The file to read (a model, or one made with --create).
    file: PathBuf,
    /// Write FILE with this many bytes of noise first, if it does not exist.
    #[arg(long, value_parser = parse_size)]
    create: Option<u64>,
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    tile: u64,
    /// Chunks in flight (io_uring queue depth, or pread threads).
    #[arg(long, default_value_t = 32)]
    depth: usize,
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    chunk: u64,
    /// Read at most this many bytes of the file per run.
    #[arg(long, value_parser = parse_size)]
    limit: Option<u64>,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Tiles in a shuffled order instead of front to back.
    #[arg(long)]
    random: bool,
    /// Block size of the raw sequential baseline.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    baseline_block: u64,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| format!("{s}: not a size"))?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        _ => return Err(format!("{s}: unit is one of KiB, MiB, GiB")),
    };
    Ok(n * mult)
}

fn create(path: &Path, size: u64) -> anyhow::Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut block = vec![0u8; 1 << 20];
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut left = size;
    while left > 0 {
        for b in block.chunks_exact_mut(8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            b.copy_from_slice(&s.to_le_bytes());
        }
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    Ok(())
}

/// Drops the file's cached pages, so a buffered read comes from the device again.
fn drop_cache(path: &Path) -> anyhow::Result<()> {
    let f = File::open(path)?;
    // SAFETY: plain syscall on an open descriptor.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    anyhow::ensure!(
        rc == 0,
        "posix_fadvise: {}",
        std::io::Error::from_raw_os_error(rc)
    );
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds to read `bytes` of `path` front to back in `block`-sized O_DIRECT reads.
fn baseline(path: &Path, bytes: u64, block: u64) -> anyhow::Result<f64> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .context("O_DIRECT open for the baseline")?;
    let region = AlignedRegion::new(block as usize);
    // SAFETY: the region is ours alone and valid for its size.
    let buf = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.size()) };
    let t = Instant::now();
    let mut at = 0;
    while at < bytes {
        let n = f.read_at(buf, at)?;
        if n == 0 {
            break;
        }
        at += n as u64;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Seconds to read `tiles` through a reader on `backend`.
fn read_tiles(
    args: &Args,
    backend: BackendChoice,
    offsets: &[u64],
) -> anyhow::Result<(f64, String)> {
    // Enough buffers for the queue depth's worth of chunks, plus one being waited on.
    let in_flight = (args.depth as u64 * args.chunk).div_ceil(args.tile) as usize;
    let options = ReaderOptions {
        backend,
        queue_depth: args.depth,
        chunk_size: args.chunk as usize,
        buffers: in_flight + 1,
        max_tile: args.tile as usize,
        faults: StorageFaults::default(),
    };
    let reader = TileReader::open(&args.file, &options)?;
    let what = format!(
        "{:?}{}{}",
        reader.backend(),
        if reader.is_direct() {
            ", O_DIRECT"
        } else {
            ", page cache"
        },
        if reader.buffers_registered() {
            ", registered buffers"
        } else {
            ""
        },
    );
    let mut window: VecDeque<ReadHandle> = VecDeque::new();
    let t = Instant::now();
    for &offset in offsets {
        if window.len() == in_flight {
            let oldest = window.pop_front().expect("the window is full");
            drop(oldest.wait()?);
        }
        let request = TileRequest {
            offset,
            len: args.tile as usize,
            priority: Priority::Demand,
            tag: 0,
        };
        window.push_back(reader.read_tile(request));
    }
    for h in window {
        drop(h.wait()?);
    }
    Ok((t.elapsed().as_secs_f64(), what))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(size) = args.create {
        if !args.file.exists() {
            create(&args.file, size)?;
        }
    }
    let len = std::fs::metadata(&args.file)
        .with_context(|| format!("{}", args.file.display()))?
        .len();
    let bytes = args.limit.unwrap_or(len).min(len) / args.tile * args.tile;
    anyhow::ensure!(bytes > 0, "the file is smaller than one tile");
    let mut order: Vec<u64> = (0..bytes / args.tile).map(|i| i * args.tile).collect();
    if args.random {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for i in (1..order.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            order.swap(i, (s % (i as u64 + 1)) as usize);
        }
    }
    println!(
        "{}: {:.2} GiB read per run in {} tiles of {} KiB ({}), depth {} × {} KiB chunks, \
         median of {}",
        args.file.display(),
        bytes as f64 / (1u64 << 30) as f64,
        order.len(),
        args.tile >> 10,
        if args.random { "shuffled" } else { "in order" },
        args.depth,
        args.chunk >> 10,
        args.runs
    );
    let gbs = |secs: f64| bytes as f64 / secs / 1e9;
    let mut runs = Vec::new();
    for _ in 0..args.runs {
        drop_cache(&args.file)?;
        runs.push(gbs(baseline(&args.file, bytes, args.baseline_block)?));
    }
    let limit = median(runs);
    println!("| reader | GB/s | of baseline |");
    println!("| --- | --- | --- |");
    println!(
        "| baseline: 1 thread, {} MiB O_DIRECT reads | {limit:.2} | 1.00 |",
        args.baseline_block >> 20
    );
    for backend in [BackendChoice::Uring, BackendChoice::Pread] {
        let mut runs = Vec::new();
        let mut what = String::new();
        for _ in 0..args.runs {
            drop_cache(&args.file)?;
            match read_tiles(&args, backend, &order) {
                Ok((secs, w)) => {
                    runs.push(gbs(secs));
                    what = w;
                }
                Err(e) => {
                    println!("| {backend:?} | unavailable: {e} | |");
                    break;
                }
            }
        }
        if !runs.is_empty() {
            let m = median(runs);
            println!("| {what} | {m:.2} | {:.2} |", m / limit);
        }
    }
    Ok(())
}
