//! The reader against real files, on both backends.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::*;

/// A directory for test files under the target directory: /tmp may be tmpfs, which can
/// refuse O_DIRECT (the tests pass there too, on the fallback).
pub(crate) fn test_dir() -> tempfile::TempDir {
    let exe = std::env::current_exe().unwrap();
    tempfile::Builder::new()
        .prefix("stream-test")
        .tempdir_in(exe.parent().unwrap())
        .unwrap()
}

/// Deterministic noise, so a byte read from the wrong place shows.
pub(crate) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u8
        })
        .collect()
}

pub(crate) fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    let mut f = File::create(&path).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
    path
}

const MAX_TILE: usize = 300_000;

fn options(backend: BackendChoice, depth: usize) -> ReaderOptions {
    ReaderOptions {
        backend,
        queue_depth: depth,
        // Small chunks, so tiles span several and the chunk bookkeeping is exercised.
        chunk_size: 64 << 10,
        buffers: 16,
        max_tile: MAX_TILE,
        faults: StorageFaults::default(),
    }
}

/// Runs `f` with the pread backend forced, then with `Auto`, which is io_uring where this
/// kernel and filesystem allow it and says why not otherwise.
fn each_backend(f: impl Fn(BackendChoice)) {
    f(BackendChoice::Pread);
    f(BackendChoice::Auto);
}

fn req(offset: u64, len: usize, priority: Priority, tag: u64) -> TileRequest {
    TileRequest {
        offset,
        len,
        priority,
        tag,
    }
}

fn demand(offset: u64, len: usize) -> TileRequest {
    req(offset, len, Priority::Demand, 0)
}

fn check(data: &[u8], tile: &Tile) {
    let at = tile.offset() as usize;
    assert_eq!(tile.len(), tile.bytes().len());
    assert!(
        tile.bytes() == &data[at..at + tile.len()],
        "tile at {at}, length {} differs from the file",
        tile.len()
    );
}

#[test]
fn io_uring_is_used_where_the_kernel_allows_it() {
    let dir = test_dir();
    let data = pattern(1 << 20, 1);
    let path = write_file(dir.path(), "m.bin", &data);
    let reader = TileReader::open(&path, &options(BackendChoice::Auto, 8)).unwrap();
    match reader.backend() {
        Backend::Uring => {
            assert!(reader.is_direct());
            assert!(reader.fallback_reason().is_none());
        }
        Backend::Pread => {
            let why = reader.fallback_reason().expect("a fallback says why");
            eprintln!("io_uring is not usable here, testing the pread fallback: {why}");
        }
    }
    let tile = reader.read_tile(demand(12_345, 200_000)).wait().unwrap();
    check(&data, &tile);
}

#[test]
fn forcing_pread_uses_pread() {
    let dir = test_dir();
    let path = write_file(dir.path(), "m.bin", &pattern(8192, 1));
    let reader = TileReader::open(&path, &options(BackendChoice::Pread, 2)).unwrap();
    assert_eq!(reader.backend(), Backend::Pread);
    assert!(reader.fallback_reason().is_none());
}

#[test]
fn unaligned_tiles_match_the_file() {
    each_backend(|backend| {
        let dir = test_dir();
        // A size off alignment, so the last tile ends inside a partial block.
        let data = pattern(3 * (1 << 20) + 123, 2);
        let path = write_file(dir.path(), "m.bin", &data);
        let reader = TileReader::open(&path, &options(backend, 4)).unwrap();
        let len = data.len() as u64;
        let tiles = [
            (0, 4096),
            (1, 1),
            (4095, 2),
            (100_000, MAX_TILE),
            (65_536, 65_536),
            (len - 1, 1),
            (len - 250_000, 250_000),
            (777, 0),
            (len, 0),
        ];
        let handles: Vec<_> = tiles
            .iter()
            .map(|&(o, n)| reader.read_tile(demand(o, n)))
            .collect();
        for h in handles {
            let r = *h.request();
            let tile = h.wait().unwrap_or_else(|e| panic!("{backend:?}: {e}"));
            assert_eq!((tile.offset(), tile.len()), (r.offset, r.len));
            check(&data, &tile);
        }
    });
}

#[test]
fn many_concurrent_mixed_priority_requests_match_byte_for_byte() {
    each_backend(|backend| {
        let dir = test_dir();
        let data = Arc::new(pattern(8 << 20, 3));
        let path = write_file(dir.path(), "m.bin", &data);
        let reader = Arc::new(TileReader::open(&path, &options(backend, 8)).unwrap());
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (reader, data) = (Arc::clone(&reader), Arc::clone(&data));
                std::thread::spawn(move || {
                    let noise = pattern(16 * 100, 10 + t);
                    let mut pending = Vec::new();
                    for i in 0..100 {
                        let word = |k: usize| {
                            u64::from_le_bytes(
                                noise[16 * i + k..16 * i + k + 8].try_into().unwrap(),
                            )
                        };
                        let len = (word(0) % MAX_TILE as u64) as usize;
                        let offset = word(8) % (data.len() - len) as u64;
                        let priority = if i % 3 == 0 {
                            Priority::Demand
                        } else {
                            Priority::Prefetch
                        };
                        pending.push(reader.read_tile(req(offset, len, priority, t)));
                        // Hold at most a few buffers per thread, so the pool never runs dry
                        // with every buffer waiting in someone's queue.
                        if pending.len() == 3 {
                            check(&data, &pending.remove(0).wait().unwrap());
                        }
                    }
                    for h in pending {
                        check(&data, &h.wait().unwrap());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(reader.pool().available(), reader.pool().count());
    });
}

#[test]
fn requests_past_the_end_are_short_reads_and_the_reader_goes_on() {
    each_backend(|backend| {
        let dir = test_dir();
        let data = pattern(10_000, 4);
        let path = write_file(dir.path(), "m.bin", &data);
        let reader = TileReader::open(&path, &options(backend, 2)).unwrap();
        match reader.read_tile(demand(9_000, 2_000)).wait() {
            Err(StreamError::ShortRead {
                offset: 9_000,
                len: 2_000,
                available: 1_000,
                ..
            }) => {}
            other => panic!("{backend:?}: {other:?}"),
        }
        match reader.read_tile(demand(20_000, 10)).wait() {
            Err(e @ StreamError::ShortRead { available: 0, .. }) => {
                assert!(e.to_string().contains("m.bin"), "{e}");
                assert!(e.to_string().contains("offset 20000"), "{e}");
            }
            other => panic!("{backend:?}: {other:?}"),
        }
        check(
            &data,
            &reader.read_tile(demand(5_000, 5_000)).wait().unwrap(),
        );
        assert_eq!(reader.pool().available(), reader.pool().count());
    });
}

/// Injected faults (`stream::fault`) take a real fault's path: the tile whose chunk failed is
/// an error naming the file and offset, its buffer goes back to the pool, and the reader goes
/// on serving the same bytes as before.
#[test]
fn injected_eio_and_short_reads_fail_their_tile_and_the_reader_goes_on() {
    each_backend(|backend| {
        let dir = test_dir();
        let data = pattern(200_000, 5);
        let path = write_file(dir.path(), "m.bin", &data);
        let options = ReaderOptions {
            // One chunk a tile below, so the second and fourth tiles are the faulty reads.
            chunk_size: 1 << 20,
            faults: StorageFaults::parse("eio:2,short:4").unwrap(),
            ..options(backend, 2)
        };
        let reader = TileReader::open(&path, &options).unwrap();
        let read = |offset: u64| reader.read_tile(demand(offset, 10_000)).wait();
        check(&data, &read(1_000).unwrap());
        match read(30_000) {
            Err(
                e @ StreamError::Io {
                    offset: 30_000,
                    len: 10_000,
                    ..
                },
            ) => {
                assert!(e.to_string().contains("m.bin"), "{e}");
                assert!(e.to_string().contains("Input/output error"), "{e}");
            }
            other => panic!("{backend:?}: {other:?}"),
        }
        check(&data, &read(50_000).unwrap());
        match read(70_000) {
            Err(StreamError::ShortRead {
                offset: 70_000,
                available: 0,
                ..
            }) => {}
            other => panic!("{backend:?}: {other:?}"),
        }
        for offset in [30_000, 70_000, 150_000] {
            check(&data, &read(offset).unwrap());
        }
        assert_eq!(reader.pool().available(), reader.pool().count());
    });
}

#[test]
fn a_file_truncated_after_open_is_reported_as_changed() {
    each_backend(|backend| {
        let dir = test_dir();
        let data = pattern(1 << 20, 5);
        let path = write_file(dir.path(), "m.bin", &data);
        let reader = TileReader::open(&path, &options(backend, 2)).unwrap();
        check(
            &data,
            &reader.read_tile(demand(600_000, 1000)).wait().unwrap(),
        );
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(500_000)
            .unwrap();
        for (offset, len) in [(600_000, 1000), (1000, 1000)] {
            match reader.read_tile(demand(offset, len)).wait() {
                Err(StreamError::FileChanged {
                    what, offset: o, ..
                }) => {
                    assert_eq!(o, offset);
                    assert!(what.contains("size"), "{what}");
                }
                other => panic!("{backend:?}: {other:?}"),
            }
        }
        assert_eq!(reader.pool().available(), reader.pool().count());
    });
}

#[test]
fn a_file_replaced_after_open_is_reported_as_changed() {
    each_backend(|backend| {
        let dir = test_dir();
        let data = pattern(1 << 20, 6);
        let path = write_file(dir.path(), "m.bin", &data);
        let reader = TileReader::open(&path, &options(backend, 2)).unwrap();
        // Same size, other contents: only the inode tells.
        let other = write_file(dir.path(), "new.bin", &pattern(1 << 20, 7));
        std::fs::rename(&other, &path).unwrap();
        match reader.read_tile(demand(0, 4096)).wait() {
            Err(StreamError::FileChanged { what, .. }) => assert!(what.contains("replaced")),
            other => panic!("{backend:?}: {other:?}"),
        }
    });
}

#[test]
fn a_file_rewritten_in_place_is_reported_as_changed() {
    let dir = test_dir();
    let path = write_file(dir.path(), "m.bin", &pattern(1 << 16, 8));
    let reader = TileReader::open(&path, &options(BackendChoice::Auto, 2)).unwrap();
    // A rewrite keeps inode and size; the modification time moves (set here, as a write
    // within one clock tick of the open might not move it).
    let f = File::options().write(true).open(&path).unwrap();
    f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000))
        .unwrap();
    assert!(matches!(
        reader.read_tile(demand(0, 100)).wait(),
        Err(StreamError::FileChanged { .. })
    ));
}

#[test]
fn cancelling_prefetches_by_tag_spares_other_tags_and_demand_reads() {
    each_backend(|backend| {
        let dir = test_dir();
        let data = pattern(4 << 20, 9);
        let path = write_file(dir.path(), "m.bin", &data);
        let mut o = options(backend, 1);
        o.buffers = 40;
        let reader = TileReader::open(&path, &o).unwrap();
        let mut handles = Vec::new();
        for i in 0..30u64 {
            let (priority, tag) = match i % 3 {
                0 => (Priority::Prefetch, 7),
                1 => (Priority::Prefetch, 8),
                _ => (Priority::Demand, 7),
            };
            handles.push(reader.read_tile(req(i * 100_000, 100_000, priority, tag)));
        }
        let cancelled = reader.cancel(7);
        assert!(cancelled <= 10);
        let mut saw_cancelled = 0;
        for h in handles {
            let r = *h.request();
            match h.wait() {
                Ok(tile) => check(&data, &tile),
                Err(StreamError::Cancelled { offset, .. }) => {
                    assert_eq!(
                        (r.tag, r.priority, offset),
                        (7, Priority::Prefetch, r.offset)
                    );
                    saw_cancelled += 1;
                }
                Err(e) => panic!("{backend:?}: {e}"),
            }
        }
        // Every prefetch counted as cancelled resolved as such, whether it was queued or in
        // flight; none of the others did.
        assert_eq!(saw_cancelled, cancelled);
        assert_eq!(reader.pool().available(), reader.pool().count());
    });
}

#[test]
fn dropping_the_reader_resolves_every_handle() {
    each_backend(|backend| {
        let dir = test_dir();
        let data = pattern(2 << 20, 10);
        let path = write_file(dir.path(), "m.bin", &data);
        let reader = TileReader::open(&path, &options(backend, 1)).unwrap();
        let handles: Vec<_> = (0..12u64)
            .map(|i| reader.read_tile(req(i * 150_000, 150_000, Priority::Prefetch, 1)))
            .collect();
        drop(reader);
        for h in handles {
            match h.wait() {
                Ok(tile) => check(&data, &tile),
                Err(StreamError::Cancelled { .. }) => {}
                Err(e) => panic!("{backend:?}: {e}"),
            }
        }
    });
}

#[test]
fn a_tile_larger_than_the_buffer_is_refused() {
    let dir = test_dir();
    let path = write_file(dir.path(), "m.bin", &pattern(1 << 20, 11));
    let reader = TileReader::open(&path, &options(BackendChoice::Pread, 1)).unwrap();
    let size = reader.pool().buffer_size();
    assert!(matches!(
        reader.read_tile(demand(1, size)).wait(),
        Err(StreamError::BufferTooSmall { .. })
    ));
    assert_eq!(reader.pool().available(), reader.pool().count());
}

#[test]
fn forcing_io_uring_fails_cleanly_or_works() {
    let dir = test_dir();
    let data = pattern(1 << 16, 12);
    let path = write_file(dir.path(), "m.bin", &data);
    match TileReader::open(&path, &options(BackendChoice::Uring, 2)) {
        Ok(reader) => {
            assert_eq!(reader.backend(), Backend::Uring);
            check(&data, &reader.read_tile(demand(10, 5000)).wait().unwrap());
        }
        Err(e @ StreamError::UringUnavailable { .. }) => {
            eprintln!("io_uring is not usable here: {e}")
        }
        Err(e) => panic!("{e}"),
    }
}
