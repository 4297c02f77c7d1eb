//! What a caller asks for (a [`TileRequest`]), what it holds while waiting (a [`ReadHandle`]),
//! and what it gets (a [`Tile`]).

use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::buffer::TileBuffer;
use super::error::StreamError;

/// Demand reads are needed now (the layer is waiting); prefetches are guesses and yield to them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Priority {
    Demand,
    Prefetch,
}

/// `len` bytes of the file at `offset`. The tag is the caller's: prefetches are cancelled and
/// promoted by tag, so one tag can name all the tiles of one expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileRequest {
    pub offset: u64,
    pub len: usize,
    pub priority: Priority,
    pub tag: u64,
}

/// The bytes of a completed read, in the buffer they were read into. Dropping the tile returns
/// the buffer to its pool.
pub struct Tile {
    buf: TileBuffer,
    start: usize,
    len: usize,
    offset: u64,
}

impl Tile {
    /// `start` is where the file offset `offset` landed in `buf`; the bytes
    /// `start..start + len` must have been written by a completed read.
    pub(crate) fn new(buf: TileBuffer, start: usize, len: usize, offset: u64) -> Tile {
        assert!(start + len <= buf.len());
        Tile {
            buf,
            start,
            len,
            offset,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        self.buf.slice(self.start, self.len)
    }

    /// The file offset of the first byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Gives the buffer back for another read, without returning it to the pool.
    pub fn into_buffer(self) -> TileBuffer {
        self.buf
    }
}

impl Deref for Tile {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

impl std::fmt::Debug for Tile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tile")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// Where a backend leaves a request's outcome for its handle.
pub(crate) struct Slot {
    /// The outcome and when it was known.
    result: Mutex<Option<(Result<Tile, StreamError>, Instant)>>,
    done: Condvar,
}

impl Slot {
    pub(crate) fn new() -> Arc<Slot> {
        Arc::new(Slot {
            result: Mutex::new(None),
            done: Condvar::new(),
        })
    }

    pub(crate) fn resolve(&self, result: Result<Tile, StreamError>) {
        *self.result.lock() = Some((result, Instant::now()));
        self.done.notify_all();
    }
}

/// A read in progress. Waiting consumes it; dropping it does not cancel the read (use
/// [`TileReader::cancel`](super::TileReader::cancel)), the tile just goes back to the pool.
pub struct ReadHandle {
    slot: Arc<Slot>,
    request: TileRequest,
    issued: Instant,
}

/// When a read was issued and when its outcome was known (the read completed, failed or was
/// cancelled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadTimes {
    pub issued: Instant,
    pub done: Instant,
}

impl ReadHandle {
    pub(crate) fn new(slot: Arc<Slot>, request: TileRequest) -> ReadHandle {
        ReadHandle {
            slot,
            request,
            issued: Instant::now(),
        }
    }

    pub fn request(&self) -> &TileRequest {
        &self.request
    }

    pub fn is_done(&self) -> bool {
        self.slot.result.lock().is_some()
    }

    /// Blocks until the read completed, failed or was cancelled.
    pub fn wait(self) -> Result<Tile, StreamError> {
        self.wait_timed().0
    }

    /// [`ReadHandle::wait`], with when the read was issued and when it ended.
    pub fn wait_timed(self) -> (Result<Tile, StreamError>, ReadTimes) {
        let mut result = self.slot.result.lock();
        loop {
            if let Some((r, done)) = result.take() {
                let times = ReadTimes {
                    issued: self.issued,
                    done,
                };
                return (r, times);
            }
            self.slot.done.wait(&mut result);
        }
    }
}
