//! Backend B: threads calling `pread`, for kernels or sandboxes without io_uring and for
//! filesystems that refuse O_DIRECT (then reads go through the page cache).

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::reader::Shared;
use super::schedule::{Chunk, Step};

/// One pread thread: takes the next chunk, reads it, records it, until the reader closes.
pub(crate) fn run(shared: Arc<Shared>) {
    let mut next: Option<Chunk> = None;
    loop {
        let chunk = match next.take() {
            Some(chunk) => chunk,
            None => {
                let mut sched = shared.sched.lock();
                loop {
                    if let Some(chunk) = sched.next_chunk() {
                        break chunk;
                    }
                    if sched.is_closed() {
                        return;
                    }
                    shared.work.wait(&mut sched);
                }
            }
        };
        // SAFETY: the chunk's bytes lie in a buffer the scheduler keeps for this request until
        // the chunk completes, and no one else touches them meanwhile.
        let buf = unsafe { std::slice::from_raw_parts_mut(chunk.ptr.0, chunk.len) };
        let result = shared
            .faults
            .apply(shared.file.file().read_at(buf, chunk.offset));
        let step = shared.sched.lock().complete(chunk, result);
        match step {
            Step::Pending => {}
            Step::Retry(chunk) => next = Some(chunk),
            Step::Finished(f) => f.resolve(&shared.file),
        }
    }
}
