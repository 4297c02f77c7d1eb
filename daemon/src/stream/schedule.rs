//! The queue both backends drain: requests split into chunks, demand before prefetch,
//! cancellation by tag, and the bookkeeping that turns chunk completions into one outcome per
//! request. Pure bookkeeping under one lock; the backends do the I/O outside it.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::Arc;

use super::buffer::{TileBuffer, ALIGN};
use super::error::StreamError;
use super::file::ModelFile;
use super::request::{Priority, Slot, Tile, TileRequest};

/// Where a chunk lands in its buffer; only the kernel or a pread thread writes through it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BufPtr(pub(crate) *mut u8);

// SAFETY: the pointer is into a buffer the scheduler owns until the chunk completes; it is
// handed to exactly one reader of the file at a time.
unsafe impl Send for BufPtr {}

/// One read of at most the chunk size, aligned when the file is opened with O_DIRECT.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) request: u64,
    pub(crate) offset: u64,
    pub(crate) len: usize,
    pub(crate) ptr: BufPtr,
    pub(crate) buf_index: u16,
}

enum Outcome {
    Cancelled,
    ShortRead { available: u64 },
    Io(io::Error),
}

struct Active {
    request: TileRequest,
    /// The aligned file span read into the buffer.
    start: u64,
    end: u64,
    /// The first byte not yet handed out as a chunk.
    next: u64,
    in_flight: u32,
    buf: TileBuffer,
    slot: Arc<Slot>,
    /// Set by the first failure or a cancellation; no chunk is handed out after it.
    outcome: Option<Outcome>,
}

impl Active {
    fn want_end(&self) -> u64 {
        self.request.offset + self.request.len as u64
    }
}

/// What a chunk's completion led to.
pub(crate) enum Step {
    Pending,
    /// Read the rest of a short chunk, or retry an interrupted one.
    Retry(Chunk),
    Finished(Finished),
}

/// A request with nothing in flight any more, to be resolved outside the lock.
pub(crate) struct Finished {
    request: TileRequest,
    start: u64,
    buf: TileBuffer,
    slot: Arc<Slot>,
    outcome: Option<Outcome>,
}

impl Finished {
    /// A request answered without I/O: it reaches past the end of the file seen at open.
    pub(crate) fn past_end(
        request: TileRequest,
        buf: TileBuffer,
        slot: Arc<Slot>,
        file_len: u64,
    ) -> Finished {
        Finished {
            request,
            start: request.offset,
            buf,
            slot,
            outcome: Some(Outcome::ShortRead {
                available: file_len.saturating_sub(request.offset),
            }),
        }
    }

    /// Gives the handle its tile, or the error; a failed read's buffer goes back to the pool.
    /// The file is checked against what was seen at open on every request, so a tile is never
    /// a mix of two versions of the file.
    pub(crate) fn resolve(self, file: &ModelFile) {
        let Finished {
            request,
            start,
            buf,
            slot,
            outcome,
        } = self;
        let TileRequest { offset, len, .. } = request;
        let path = file.path().to_path_buf();
        let mut buf = Some(buf);
        let result = match outcome {
            Some(Outcome::Cancelled) => Err(StreamError::Cancelled { path, offset, len }),
            outcome => match (file.changed(), outcome) {
                (Some(what), _) => Err(StreamError::FileChanged {
                    path,
                    offset,
                    len,
                    what,
                }),
                (None, None) => {
                    let buf = buf.take().expect("the buffer is still here");
                    file.count_tile(len);
                    Ok(Tile::new(buf, (offset - start) as usize, len, offset))
                }
                (None, Some(Outcome::ShortRead { available })) => Err(StreamError::ShortRead {
                    path,
                    offset,
                    len,
                    available,
                }),
                (None, Some(Outcome::Io(source))) => Err(StreamError::Io {
                    path,
                    offset,
                    len,
                    source,
                }),
                (None, Some(Outcome::Cancelled)) => unreachable!(),
            },
        };
        // A failed read's buffer is back in the pool before the waiter wakes.
        drop(buf);
        slot.resolve(result);
    }
}

pub(crate) struct Scheduler {
    demand: VecDeque<u64>,
    prefetch: VecDeque<u64>,
    requests: HashMap<u64, Active>,
    next_id: u64,
    chunk_size: usize,
    direct: bool,
    closed: bool,
}

impl Scheduler {
    /// `chunk_size` is rounded up to [`ALIGN`]; `direct` says whether a short read that ends
    /// off alignment means the end of the file (it does under O_DIRECT).
    pub(crate) fn new(chunk_size: usize, direct: bool) -> Scheduler {
        Scheduler {
            demand: VecDeque::new(),
            prefetch: VecDeque::new(),
            requests: HashMap::new(),
            next_id: 0,
            chunk_size: chunk_size.max(1).next_multiple_of(ALIGN),
            direct,
            closed: false,
        }
    }

    /// Queues a read of the aligned span `[start, end)` into `buf`, which the caller checked is
    /// large enough. An empty span finishes at once.
    pub(crate) fn push(
        &mut self,
        request: TileRequest,
        (start, end): (u64, u64),
        buf: TileBuffer,
        slot: Arc<Slot>,
    ) -> Option<Finished> {
        assert!((end - start) as usize <= buf.len());
        let outcome = self.closed.then_some(Outcome::Cancelled);
        if start == end || outcome.is_some() {
            return Some(Finished {
                request,
                start,
                buf,
                slot,
                outcome,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        match request.priority {
            Priority::Demand => self.demand.push_back(id),
            Priority::Prefetch => self.prefetch.push_back(id),
        }
        let active = Active {
            request,
            start,
            end,
            next: start,
            in_flight: 0,
            buf,
            slot,
            outcome: None,
        };
        self.requests.insert(id, active);
        None
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    /// Closed, and nothing left in flight: a backend may stop.
    pub(crate) fn is_drained(&self) -> bool {
        self.closed && self.requests.is_empty()
    }

    /// The next chunk to read: the oldest demand request's, else the oldest prefetch's. A
    /// request stays at the head of its queue until all its chunks are out, so a demand
    /// request arriving mid-prefetch overtakes that prefetch's remaining chunks.
    pub(crate) fn next_chunk(&mut self) -> Option<Chunk> {
        let queue = if self.demand.is_empty() {
            &mut self.prefetch
        } else {
            &mut self.demand
        };
        let id = *queue.front()?;
        let a = self
            .requests
            .get_mut(&id)
            .expect("queued request is active");
        let len = (self.chunk_size as u64).min(a.end - a.next) as usize;
        let chunk = Chunk {
            request: id,
            offset: a.next,
            len,
            // SAFETY (of the add): next - start < end - start <= buffer length.
            ptr: BufPtr(unsafe { a.buf.as_ptr().add((a.next - a.start) as usize) }),
            buf_index: a.buf.index(),
        };
        a.next += len as u64;
        a.in_flight += 1;
        if a.next == a.end {
            queue.pop_front();
        }
        Some(chunk)
    }

    /// Records a chunk's result: `Ok(bytes read)` or the error.
    pub(crate) fn complete(&mut self, chunk: Chunk, result: io::Result<usize>) -> Step {
        let id = chunk.request;
        let a = self
            .requests
            .get_mut(&id)
            .expect("completed chunk's request");
        a.in_flight -= 1;
        let mut failure = None;
        match result {
            Ok(n) if n >= chunk.len => {}
            Ok(n) => {
                let end = chunk.offset + n as u64;
                // A read that stops past the tile's last byte just met the end of the file
                // in the alignment padding.
                if end < a.want_end() {
                    let at_eof = n == 0 || (self.direct && !end.is_multiple_of(ALIGN as u64));
                    if at_eof {
                        failure = Some(Outcome::ShortRead {
                            available: end.saturating_sub(a.request.offset),
                        });
                    } else if a.outcome.is_none() {
                        a.in_flight += 1;
                        return Step::Retry(Chunk {
                            request: id,
                            offset: end,
                            len: chunk.len - n,
                            // SAFETY: n < chunk.len, still inside the chunk.
                            ptr: BufPtr(unsafe { chunk.ptr.0.add(n) }),
                            buf_index: chunk.buf_index,
                        });
                    }
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                ) =>
            {
                if a.outcome.is_none() {
                    a.in_flight += 1;
                    return Step::Retry(chunk);
                }
            }
            Err(e) => failure = Some(Outcome::Io(e)),
        }
        if let Some(f) = failure {
            self.stop(id, f);
        }
        let a = &self.requests[&id];
        if a.in_flight == 0 && (a.next == a.end || a.outcome.is_some()) {
            Step::Finished(self.remove(id))
        } else {
            Step::Pending
        }
    }

    /// Cancels the prefetches tagged `tag`: queued ones finish at once (returned), those with
    /// chunks in flight finish when the last chunk lands. Demand reads are never cancelled.
    pub(crate) fn cancel(&mut self, tag: u64) -> (usize, Vec<Finished>) {
        let ids: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, a)| {
                a.request.tag == tag
                    && a.request.priority == Priority::Prefetch
                    && a.outcome.is_none()
            })
            .map(|(&id, _)| id)
            .collect();
        let mut finished = Vec::new();
        for &id in &ids {
            self.stop(id, Outcome::Cancelled);
            if self.requests[&id].in_flight == 0 {
                finished.push(self.remove(id));
            }
        }
        (ids.len(), finished)
    }

    /// Turns the queued prefetches tagged `tag` into demand reads (the guess came true).
    pub(crate) fn promote(&mut self, tag: u64) -> usize {
        let requests = &mut self.requests;
        let mut moved = Vec::new();
        self.prefetch.retain(|id| {
            let a = requests.get_mut(id).expect("queued request is active");
            let hit = a.request.tag == tag;
            if hit {
                a.request.priority = Priority::Demand;
                moved.push(*id);
            }
            !hit
        });
        self.demand.extend(&moved);
        moved.len()
    }

    /// Stops taking work: everything not yet finished is cancelled. Returns what finished now.
    pub(crate) fn close(&mut self) -> Vec<Finished> {
        self.closed = true;
        let ids: Vec<u64> = self.requests.keys().copied().collect();
        let mut finished = Vec::new();
        for id in ids {
            if self.requests[&id].outcome.is_none() {
                self.stop(id, Outcome::Cancelled);
            }
            if self.requests[&id].in_flight == 0 {
                finished.push(self.remove(id));
            }
        }
        finished
    }

    /// Records the first failure and takes the request out of its queue.
    fn stop(&mut self, id: u64, outcome: Outcome) {
        let a = self.requests.get_mut(&id).expect("active request");
        if a.outcome.is_none() {
            a.outcome = Some(outcome);
        }
        let queue = match a.request.priority {
            Priority::Demand => &mut self.demand,
            Priority::Prefetch => &mut self.prefetch,
        };
        queue.retain(|&q| q != id);
    }

    fn remove(&mut self, id: u64) -> Finished {
        let a = self.requests.remove(&id).expect("active request");
        Finished {
            request: a.request,
            start: a.start,
            buf: a.buf,
            slot: a.slot,
            outcome: a.outcome,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::buffer::BufferPool;
    use crate::stream::request::ReadHandle;
    use crate::stream::tests::{pattern, test_dir, write_file};

    const A: usize = ALIGN;

    struct Fixture {
        _dir: tempfile::TempDir,
        file: ModelFile,
        pool: Arc<BufferPool>,
        sched: Scheduler,
    }

    fn fixture() -> Fixture {
        let dir = test_dir();
        let path = write_file(dir.path(), "m.bin", &pattern(64 * A, 1));
        Fixture {
            file: ModelFile::open(&path).unwrap(),
            _dir: dir,
            pool: BufferPool::allocate(8, 8 * A),
            sched: Scheduler::new(A, true),
        }
    }

    impl Fixture {
        fn push(&mut self, offset: u64, len: usize, priority: Priority, tag: u64) -> ReadHandle {
            let request = TileRequest {
                offset,
                len,
                priority,
                tag,
            };
            let slot = Slot::new();
            let handle = ReadHandle::new(Arc::clone(&slot), request);
            let span = crate::stream::buffer::aligned_span(offset, len);
            assert!(self
                .sched
                .push(request, span, self.pool.acquire(), slot)
                .is_none());
            handle
        }

        fn next(&mut self) -> Chunk {
            self.sched.next_chunk().expect("a chunk")
        }

        fn finish(&mut self, chunk: Chunk, result: io::Result<usize>) {
            match self.sched.complete(chunk, result) {
                Step::Finished(f) => f.resolve(&self.file),
                _ => panic!("expected the request to finish"),
            }
        }
    }

    #[test]
    fn demand_overtakes_the_queued_chunks_of_prefetches() {
        let mut f = fixture();
        let _p = f.push(0, 3 * A, Priority::Prefetch, 1);
        let _q = f.push(10 * A as u64, A, Priority::Prefetch, 2);
        assert_eq!(f.next().offset, 0);
        let _d = f.push(20 * A as u64, 2 * A, Priority::Demand, 3);
        let order: Vec<u64> = std::iter::from_fn(|| f.sched.next_chunk())
            .map(|c| c.offset / A as u64)
            .collect();
        // The demand read's chunks first, then the rest of the first prefetch, then the next.
        assert_eq!(order, [20, 21, 1, 2, 10]);
    }

    #[test]
    fn promoted_prefetches_join_the_demand_queue() {
        let mut f = fixture();
        let _p = f.push(0, A, Priority::Prefetch, 1);
        let _q = f.push(A as u64, A, Priority::Prefetch, 2);
        assert_eq!(f.sched.promote(2), 1);
        assert_eq!(f.next().offset, A as u64);
        assert_eq!(f.next().offset, 0);
    }

    #[test]
    fn a_queued_prefetch_cancels_at_once_and_returns_its_buffer() {
        let mut f = fixture();
        let p = f.push(0, 2 * A, Priority::Prefetch, 7);
        let d = f.push(4 * A as u64, A, Priority::Demand, 7);
        let (count, finished) = f.sched.cancel(7);
        assert_eq!((count, finished.len()), (1, 1));
        finished.into_iter().for_each(|x| x.resolve(&f.file));
        assert!(matches!(p.wait(), Err(StreamError::Cancelled { .. })));
        assert_eq!(f.pool.available(), 7);
        // The demand read with the same tag is untouched.
        let c = f.next();
        f.finish(c, Ok(A));
        assert!(d.wait().is_ok());
    }

    #[test]
    fn an_in_flight_prefetch_cancelled_has_its_result_discarded() {
        let mut f = fixture();
        let p = f.push(0, 2 * A, Priority::Prefetch, 7);
        let c0 = f.next();
        let (count, finished) = f.sched.cancel(7);
        assert_eq!((count, finished.len()), (1, 0));
        // Its second chunk is never handed out; the first completes and finishes it.
        assert!(f.sched.next_chunk().is_none());
        assert!(!p.is_done());
        f.finish(c0, Ok(A));
        assert!(matches!(p.wait(), Err(StreamError::Cancelled { .. })));
        assert_eq!(f.pool.available(), 8);
    }

    #[test]
    fn an_io_error_fails_its_request_and_the_next_one_succeeds() {
        let mut f = fixture();
        let bad = f.push(3 * A as u64 + 5, 3 * A, Priority::Demand, 1);
        let good = f.push(0, A, Priority::Demand, 2);
        let c0 = f.next();
        let c1 = f.next();
        // One chunk fails while another is in flight: the request waits for it, hands out no
        // more chunks, and reports the error once.
        assert!(matches!(
            f.sched
                .complete(c0, Err(io::Error::from_raw_os_error(libc::EIO))),
            Step::Pending
        ));
        f.finish(c1, Ok(A));
        match bad.wait() {
            Err(StreamError::Io {
                offset,
                len,
                source,
                ..
            }) => {
                assert_eq!((offset, len), (3 * A as u64 + 5, 3 * A));
                assert_eq!(source.raw_os_error(), Some(libc::EIO));
            }
            other => panic!("{other:?}"),
        }
        let c = f.next();
        assert_eq!(c.offset, 0);
        f.finish(c, Ok(A));
        assert!(good.wait().is_ok());
        assert_eq!(f.pool.available(), 8);
    }

    #[test]
    fn a_short_chunk_is_read_again_for_the_rest() {
        let mut f = fixture();
        f.sched = Scheduler::new(4 * A, true);
        let h = f.push(0, 4 * A, Priority::Demand, 1);
        let c = f.next();
        let Step::Retry(rest) = f.sched.complete(c, Ok(A)) else {
            panic!("expected a retry");
        };
        assert_eq!((rest.offset, rest.len), (A as u64, 3 * A));
        let Step::Retry(again) = f
            .sched
            .complete(rest, Err(io::ErrorKind::Interrupted.into()))
        else {
            panic!("expected a retry");
        };
        f.finish(again, Ok(3 * A));
        assert!(h.wait().is_ok());
    }

    #[test]
    fn a_short_read_that_ends_off_alignment_is_the_end_of_the_file() {
        let mut f = fixture();
        f.sched = Scheduler::new(4 * A, true);
        let h = f.push(100, 2 * A, Priority::Demand, 1);
        let c = f.next();
        assert_eq!((c.offset, c.len), (0, 3 * A));
        f.finish(c, Ok(A + 50));
        match h.wait() {
            Err(StreamError::ShortRead { available, .. }) => assert_eq!(available, A as u64 - 50),
            other => panic!("{other:?}"),
        }
    }
}
