//! [`TileReader`]: reads tiles of one model file into pool buffers, through io_uring when the
//! kernel and the filesystem allow it, else through a pread thread pool.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Once};
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use super::buffer::{aligned_span, buffer_size_for_tile, BufferPool, TileBuffer};
use super::error::StreamError;
use super::fault::{Injector, StorageFaults};
use super::file::ModelFile;
use super::request::{ReadHandle, Slot, TileRequest};
use super::schedule::{Finished, Scheduler};
use super::{pread, uring};

/// Which backend to use. `Auto` takes io_uring when it works and falls back to pread, saying
/// why once in the log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    #[default]
    Auto,
    /// io_uring or an error: for benchmarks that must not measure the fallback.
    Uring,
    /// The pread thread pool even where io_uring works: for tests and comparison.
    Pread,
}

/// The backend a reader runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Uring,
    Pread,
}

#[derive(Clone, Debug)]
pub struct ReaderOptions {
    pub backend: BackendChoice,
    /// Chunks in flight at once: io_uring's queue depth, or the number of pread threads.
    pub queue_depth: usize,
    /// Reads are split into chunks of this size (rounded up to 4 KiB).
    pub chunk_size: usize,
    /// Buffers in the pool that [`TileReader::open`] allocates.
    pub buffers: usize,
    /// The largest tile those buffers must hold, at any offset.
    pub max_tile: usize,
    /// Faults to inject (`SPILLWAY_FAULT_STORAGE` by default; see [`super::fault`]).
    pub faults: StorageFaults,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            backend: BackendChoice::Auto,
            queue_depth: 32,
            chunk_size: 1 << 20,
            buffers: 32,
            max_tile: 4 << 20,
            faults: StorageFaults::from_env(),
        }
    }
}

/// What the reader and its backend threads share.
pub(crate) struct Shared {
    pub(crate) sched: Mutex<Scheduler>,
    /// pread threads wait here for work.
    pub(crate) work: Condvar,
    pub(crate) file: ModelFile,
    /// What every chunk read's result passes through before the scheduler sees it.
    pub(crate) faults: Injector,
    /// Wakes the io_uring thread, which sleeps in the kernel rather than on `work`.
    wake_fd: Option<OwnedFd>,
}

impl Shared {
    pub(crate) fn wake_fd(&self) -> Option<RawFd> {
        self.wake_fd.as_ref().map(|fd| fd.as_raw_fd())
    }

    fn wake(&self) {
        self.work.notify_all();
        if let Some(fd) = self.wake_fd() {
            uring::wake(fd);
        }
    }
}

/// Reads tiles of one file: demand reads before prefetches, prefetches cancellable by tag.
/// Dropping the reader cancels what is queued and waits for what is in flight.
pub struct TileReader {
    shared: Arc<Shared>,
    pool: Arc<BufferPool>,
    backend: Backend,
    buffers_registered: bool,
    fallback: Option<String>,
    threads: Vec<JoinHandle<()>>,
}

impl TileReader {
    /// Opens `path` with a pool of `options.buffers` buffers sized for `options.max_tile`.
    pub fn open(path: &Path, options: &ReaderOptions) -> Result<TileReader, StreamError> {
        let pool = BufferPool::allocate(options.buffers, buffer_size_for_tile(options.max_tile));
        TileReader::open_with_pool(path, options, pool)
    }

    /// Opens `path` reading into `pool`'s buffers (which io_uring registers).
    pub fn open_with_pool(
        path: &Path,
        options: &ReaderOptions,
        pool: Arc<BufferPool>,
    ) -> Result<TileReader, StreamError> {
        let file = ModelFile::open(path)?;
        let depth = options.queue_depth.max(1);
        let mut fallback = None;
        let ring = match options.backend {
            BackendChoice::Pread => None,
            choice => {
                let ring = match file.direct_refused() {
                    Some(why) => Err(why.to_string()),
                    None => uring::Ring::new(&pool, depth)
                        .and_then(|ring| Ok((ring, uring::wake_fd()?)))
                        .map_err(|e| format!("io_uring setup failed: {e}")),
                };
                match ring {
                    Ok(ring) => Some(ring),
                    Err(reason) if choice == BackendChoice::Uring => {
                        return Err(StreamError::UringUnavailable {
                            path: path.to_path_buf(),
                            reason,
                        })
                    }
                    Err(reason) => {
                        log_fallback_once(&reason);
                        fallback = Some(reason);
                        None
                    }
                }
            }
        };
        let sched = Scheduler::new(options.chunk_size, file.is_direct());
        let backend = if ring.is_some() {
            Backend::Uring
        } else {
            Backend::Pread
        };
        let buffers_registered = ring.as_ref().is_some_and(|(r, _)| r.buffers_registered());
        let (ring, wake_fd) = ring.unzip();
        let shared = Arc::new(Shared {
            sched: Mutex::new(sched),
            work: Condvar::new(),
            file,
            faults: Injector::new(options.faults.clone()),
            wake_fd,
        });
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .expect("spawning a streamer thread")
        };
        let threads = match ring {
            Some(ring) => {
                let shared = Arc::clone(&shared);
                let pool = Arc::clone(&pool);
                vec![spawn(
                    "spillway-uring".into(),
                    Box::new(move || {
                        uring::run(ring, shared, depth);
                        // The registered buffers outlive the ring.
                        drop(pool);
                    }),
                )]
            }
            None => (0..depth)
                .map(|i| {
                    let shared = Arc::clone(&shared);
                    spawn(
                        format!("spillway-pread-{i}"),
                        Box::new(move || pread::run(shared)),
                    )
                })
                .collect(),
        };
        Ok(TileReader {
            shared,
            pool,
            backend,
            buffers_registered,
            fallback,
            threads,
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Why `Auto` fell back to pread, if it did.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.shared.file.is_direct()
    }

    /// Whether the pool's buffers are registered with io_uring (`read_fixed`).
    pub fn buffers_registered(&self) -> bool {
        self.buffers_registered
    }

    /// The file's size when it was opened.
    /// Bytes of the tiles delivered so far (their requested lengths) and how many: what the
    /// reader moved from the SSD into RAM. Failed and cancelled reads are not counted.
    pub fn delivered(&self) -> (u64, u64) {
        self.shared.file.delivered()
    }

    pub fn file_len(&self) -> u64 {
        self.shared.file.len()
    }

    pub fn path(&self) -> &Path {
        self.shared.file.path()
    }

    pub fn pool(&self) -> &Arc<BufferPool> {
        &self.pool
    }

    /// Queues `request`, reading into `buf`. Errors arrive through the handle; a request past
    /// the end of the file fails without I/O.
    ///
    /// # Panics
    ///
    /// If `buf` is not from this reader's pool.
    pub fn read(&self, request: TileRequest, buf: TileBuffer) -> ReadHandle {
        assert!(
            buf.is_from(&self.pool),
            "tile buffers must come from the reader's pool"
        );
        let slot = Slot::new();
        let handle = ReadHandle::new(Arc::clone(&slot), request);
        let span = aligned_span(request.offset, request.len);
        let needed = (span.1 - span.0) as usize;
        if needed > buf.len() {
            let capacity = buf.len();
            drop(buf);
            slot.resolve(Err(StreamError::BufferTooSmall {
                path: self.path().to_path_buf(),
                offset: request.offset,
                len: request.len,
                needed,
                capacity,
            }));
            return handle;
        }
        let file_len = self.shared.file.len();
        let finished = if request.offset + request.len as u64 > file_len {
            Some(Finished::past_end(request, buf, slot, file_len))
        } else {
            self.shared.sched.lock().push(request, span, buf, slot)
        };
        match finished {
            Some(f) => f.resolve(&self.shared.file),
            None => self.shared.wake(),
        }
        handle
    }

    /// [`read`](Self::read) into the next free buffer of the pool, waiting for one if need be.
    pub fn read_tile(&self, request: TileRequest) -> ReadHandle {
        self.read(request, self.pool.acquire())
    }

    /// Cancels the prefetches tagged `tag`: queued ones are dropped, in-flight ones have their
    /// result discarded; either way the handle gets [`StreamError::Cancelled`] and the buffer
    /// returns to the pool. Returns how many were cancelled.
    pub fn cancel(&self, tag: u64) -> usize {
        let (count, finished) = self.shared.sched.lock().cancel(tag);
        for f in finished {
            f.resolve(&self.shared.file);
        }
        count
    }

    /// Makes the queued prefetches tagged `tag` demand reads. Returns how many moved.
    pub fn promote(&self, tag: u64) -> usize {
        self.shared.sched.lock().promote(tag)
    }
}

impl Drop for TileReader {
    fn drop(&mut self) {
        let finished = self.shared.sched.lock().close();
        for f in finished {
            f.resolve(&self.shared.file);
        }
        self.shared.wake();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn log_fallback_once(reason: &str) {
    static LOGGED: Once = Once::new();
    LOGGED.call_once(|| tracing::warn!("tile reader: using pread threads: {reason}"));
}
