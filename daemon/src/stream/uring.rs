//! Backend A: one thread owning an io_uring ring, reading chunks with O_DIRECT into the pool's
//! buffers (registered with the ring, so `read_fixed` skips the per-read page pinning).
//!
//! The thread sleeps only in `io_uring_enter`; new work wakes it through an eventfd that the
//! ring polls, so a demand read never waits behind a sleeping submitter.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Once};

use io_uring::{opcode, types, IoUring};

use super::buffer::{BufferPool, MAX_BUFFERS};
use super::reader::Shared;
use super::schedule::{Chunk, Step};

/// The completion of the eventfd poll; chunk completions carry their slot index.
const WAKE: u64 = u64::MAX;

pub(crate) struct Ring {
    ring: IoUring,
    registered: bool,
}

impl Ring {
    /// Sets up a ring for `depth` reads in flight and registers `pool`'s buffers with it.
    /// Fails when the kernel or a seccomp filter refuses io_uring.
    pub(crate) fn new(pool: &BufferPool, depth: usize) -> io::Result<Ring> {
        let entries = (depth + 1).next_power_of_two() as u32;
        let ring = IoUring::builder().build(entries)?;
        let registered = if pool.count() > MAX_BUFFERS {
            Err(io::Error::other("too many buffers to register"))
        } else {
            // SAFETY: the regions stay valid while the pool lives, and the ring thread holds
            // the pool (through `Shared`) for as long as it holds the ring.
            unsafe { ring.submitter().register_buffers(&pool.iovecs()) }
        };
        if let Err(e) = &registered {
            static LOGGED: Once = Once::new();
            LOGGED.call_once(|| {
                tracing::warn!("io_uring: buffers not registered ({e}); reading without read_fixed")
            });
        }
        Ok(Ring {
            ring,
            registered: registered.is_ok(),
        })
    }

    pub(crate) fn buffers_registered(&self) -> bool {
        self.registered
    }
}

/// The eventfd that wakes the ring thread.
pub(crate) fn wake_fd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the descriptor is owned from here on.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(crate) fn wake(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64. Failure (counter full) still leaves it readable.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

fn drain(fd: RawFd) {
    let mut n: u64 = 0;
    // SAFETY: reads 8 bytes into a valid u64; non-blocking.
    unsafe { libc::read(fd, (&mut n as *mut u64).cast(), 8) };
}

/// The ring thread: keeps up to `depth` chunks in flight until the reader closes and drains.
pub(crate) fn run(ring: Ring, shared: Arc<Shared>, depth: usize) {
    let Ring {
        mut ring,
        registered,
    } = ring;
    let efd = shared
        .wake_fd()
        .expect("the io_uring backend has a wake eventfd");
    let fd = types::Fd(shared.file.fd());
    let mut slots: Vec<Option<Chunk>> = (0..depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut retries: Vec<Chunk> = Vec::new();
    let mut poll_armed = false;
    let mut completions = Vec::with_capacity(depth + 1);
    loop {
        {
            let mut sq = ring.submission();
            if !poll_armed {
                let poll = opcode::PollAdd::new(types::Fd(efd), libc::POLLIN as u32)
                    .build()
                    .user_data(WAKE);
                // SAFETY: the eventfd outlives the ring (both are dropped after this loop).
                unsafe {
                    sq.push(&poll)
                        .expect("the submission queue holds depth + 1")
                };
                poll_armed = true;
            }
            let mut sched = shared.sched.lock();
            while let Some(&slot) = free.last() {
                let Some(chunk) = retries.pop().or_else(|| sched.next_chunk()) else {
                    break;
                };
                free.pop();
                let entry = if registered {
                    opcode::ReadFixed::new(fd, chunk.ptr.0, chunk.len as u32, chunk.buf_index)
                        .offset(chunk.offset)
                        .build()
                } else {
                    opcode::Read::new(fd, chunk.ptr.0, chunk.len as u32)
                        .offset(chunk.offset)
                        .build()
                };
                // SAFETY: the buffer is owned by the scheduler until this chunk completes, and
                // the file descriptor by `shared`, which outlives the ring.
                unsafe { sq.push(&entry.user_data(slot as u64)) }
                    .expect("the submission queue holds depth + 1");
                slots[slot] = Some(chunk);
            }
            if free.len() == depth && sched.is_drained() {
                return;
            }
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) => {}
            Err(e) => panic!("io_uring_enter failed: {e}"),
        }
        // Results pass the fault injection here, where no lock is held (it may sleep).
        completions.extend(ring.completion().map(|c| {
            let res = c.result();
            let result = if res < 0 {
                Err(io::Error::from_raw_os_error(-res))
            } else {
                Ok(res as usize)
            };
            let result = if c.user_data() == WAKE {
                result
            } else {
                shared.faults.apply(result)
            };
            (c.user_data(), result)
        }));
        let mut finished = Vec::new();
        {
            let mut sched = shared.sched.lock();
            for (user_data, result) in completions.drain(..) {
                if user_data == WAKE {
                    drain(efd);
                    poll_armed = false;
                    continue;
                }
                let slot = user_data as usize;
                let chunk = slots[slot].take().expect("completion of a chunk in flight");
                free.push(slot);
                match sched.complete(chunk, result) {
                    Step::Pending => {}
                    Step::Retry(chunk) => retries.push(chunk),
                    Step::Finished(f) => finished.push(f),
                }
            }
        }
        for f in finished {
            f.resolve(&shared.file);
        }
    }
}
