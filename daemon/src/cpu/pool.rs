//! A persistent thread pool: workers are spawned once, spin briefly after a job (the next
//! matrix of a decode step usually follows within microseconds) and then sleep on a condition
//! variable, so a decode step neither spawns threads nor pays a wake-up per matrix. A job is a closure run for task
//! indices `0..n`, claimed dynamically; the caller's thread takes part and `run` returns when
//! every task has finished, which is what lets the closure borrow from the caller's stack.
//!
//! A job is done when its tasks are, not when every worker has looked at it: a worker still
//! waking up from its sleep (tens to hundreds of microseconds on a loaded or virtual machine)
//! finds the tasks claimed and does nothing, and the caller does not wait for it. Tasks are
//! claimed with the job's generation in the same word as the next index, so such a late worker
//! can never claim a task of a later job with the earlier job's closure.
//!
//! For profiles the pool can trace which thread ran what ([`ThreadPool::set_tracing`]): each
//! thread that takes part in a job records one span per run of its tasks with the same label
//! (a job's tasks may carry labels, [`ThreadPool::run_labeled`]: the experts of a grouped
//! product). Each thread writes its spans into its own slot before it counts its task done,
//! so when `run` returns every span of the job is there. With tracing off a task pays one
//! untaken branch.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

type Task = dyn Fn(usize) + Sync;

/// The job being run: a lifetime-erased pointer to the caller's closure.
#[derive(Clone, Copy)]
struct Job {
    task: *const Task,
    n_tasks: usize,
    /// The job's generation (the low 32 bits of [`Shared::generation`]).
    generation: u32,
    /// Tracing: the caller's task labels (`(first task, label)`, ascending), lifetime-erased
    /// like `task`; `None` when the pool does not trace.
    parts: Option<*const [(usize, u32)]>,
}

/// What one thread ran of one job, when the pool traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerSpan {
    /// 0 for the caller's thread, `1..` for the workers.
    pub thread: usize,
    /// The label of the tasks (see [`ThreadPool::run_labeled`]); `None` for unlabelled ones.
    pub label: Option<u32>,
    /// From the thread's first task of the run to the end of its last.
    pub start: Instant,
    pub end: Instant,
}

// SAFETY: the pointee is `Sync`, and `ThreadPool::run` keeps it alive while any of its tasks is
// unclaimed or running; a task is only run after claiming it (see `claim_tasks`).
unsafe impl Send for Job {}

/// Spin iterations (each a `pause`) before the caller sleeps waiting for a job's last tasks:
/// tens of microseconds.
const SPIN: u32 = 4096;

/// How long an idle worker spins for the next job before it sleeps. A decode step's jobs follow
/// each other within microseconds, but a GPU model's CPU experts come once per MoE layer, after
/// the device's part of it (a quarter of a millisecond on the H200): a worker that slept by then
/// costs the job a wake-up.
const WORKER_SPIN: std::time::Duration = std::time::Duration::from_micros(500);

struct State {
    job: Option<Job>,
    shutdown: bool,
    panic: Option<Box<dyn std::any::Any + Send>>,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    done: Condvar,
    /// The current job's generation (high 32 bits) and next task index (low 32 bits).
    next: AtomicU64,
    /// Bumped (under the state lock) for every job.
    generation: AtomicU64,
    /// Tasks of the current job not finished yet; the task that finishes last notifies
    /// `done` under the lock.
    pending: AtomicUsize,
    tracing: AtomicBool,
    /// Per thread (the caller's first): its spans since the last `take_spans`.
    spans: Vec<Mutex<Vec<WorkerSpan>>>,
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises callers: one job at a time.
    run_lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all, the caller's included (so `n_threads - 1` workers).
    pub fn new(n_threads: usize) -> ThreadPool {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                job: None,
                shutdown: false,
                panic: None,
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            next: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            tracing: AtomicBool::new(false),
            spans: (0..n_threads.max(1))
                .map(|_| Mutex::new(Vec::new()))
                .collect(),
        });
        let workers = (1..n_threads.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("spillway-cpu-{i}"))
                    .spawn(move || worker(&shared, i))
                    .expect("spawning a CPU worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            run_lock: Mutex::new(()),
        }
    }

    /// Threads that run a job, the caller's included.
    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Turns tracing on or off (see the module's documentation); turning it on drops the
    /// spans of earlier jobs.
    pub fn set_tracing(&self, on: bool) {
        self.take_spans();
        self.shared.tracing.store(on, Ordering::Relaxed);
    }

    /// The spans traced since the last call, thread by thread, each thread's in time order.
    pub fn take_spans(&self) -> Vec<WorkerSpan> {
        let mut out = Vec::new();
        for slot in &self.shared.spans {
            out.append(&mut slot.lock());
        }
        out
    }

    /// Runs `task(i)` for every `i` in `0..n_tasks` on the pool and the calling thread, and
    /// returns when all have finished. A panic in a task is re-raised here.
    pub fn run<'a>(&self, n_tasks: usize, task: &'a (dyn Fn(usize) + Sync + 'a)) {
        self.run_labeled(n_tasks, &[], task);
    }

    /// [`ThreadPool::run`] with labels for tracing: `parts` lists `(first task, label)` in
    /// ascending order of first task; a task before the first part has no label.
    pub fn run_labeled<'a>(
        &self,
        n_tasks: usize,
        parts: &'a [(usize, u32)],
        task: &'a (dyn Fn(usize) + Sync + 'a),
    ) {
        let traced = self.shared.tracing.load(Ordering::Relaxed);
        if self.workers.is_empty() || n_tasks <= 1 {
            if traced {
                let mut spans = Spans::new(&self.shared, 0, parts);
                for i in 0..n_tasks {
                    spans.run(i, || task(i));
                }
            } else {
                (0..n_tasks).for_each(task);
            }
            return;
        }
        assert!(n_tasks <= u32::MAX as usize, "{n_tasks} tasks in one job");
        let _one_job = self.run_lock.lock();
        // SAFETY: erases the closure's lifetime; we do not return before every task has
        // finished (`pending == 0`), and a task is only run after claiming it, which a late
        // worker cannot do once the tasks are all claimed (see `claim_tasks`).
        let task_ptr: *const Task =
            unsafe { std::mem::transmute::<&'a (dyn Fn(usize) + Sync + 'a), &'static Task>(task) };
        let job = {
            let mut st = self.shared.state.lock();
            let generation = self.shared.generation.load(Ordering::Relaxed) + 1;
            // SAFETY: as `task_ptr`: read only by tasks of this job, while `run` waits.
            let parts = traced.then_some(parts as *const [(usize, u32)]);
            let job = Job {
                task: task_ptr,
                n_tasks,
                generation: generation as u32,
                parts,
            };
            self.shared.pending.store(n_tasks, Ordering::Relaxed);
            self.shared
                .next
                .store(u64::from(job.generation) << 32, Ordering::Release);
            st.job = Some(job);
            self.shared.generation.store(generation, Ordering::Release);
            self.shared.wake.notify_all();
            job
        };
        claim_tasks(&self.shared, job, 0);
        spin_while(|| self.shared.pending.load(Ordering::Acquire) != 0);
        let mut st = self.shared.state.lock();
        while self.shared.pending.load(Ordering::Acquire) != 0 {
            self.shared.done.wait(&mut st);
        }
        st.job = None;
        let panic = st.panic.take();
        drop(st);
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }

    /// Splits `out` into chunks of `chunk` elements and runs `f(first_index, chunk)` on each
    /// in parallel.
    pub fn for_each_chunk<T: Send>(
        &self,
        out: &mut [T],
        chunk: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let chunk = chunk.max(1);
        let len = out.len();
        let n_tasks = len.div_ceil(chunk);
        let base = SendPtr(out.as_mut_ptr());
        self.run(n_tasks, &|t| {
            let start = t * chunk;
            let end = (start + chunk).min(len);
            let base = &base;
            // SAFETY: tasks cover disjoint ranges of `out`, which outlives `run`.
            let part = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
            f(start, part);
        });
    }
}

struct SendPtr<T>(*mut T);
// SAFETY: only used to hand disjoint sub-slices of a `Send` slice to pool tasks.
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// One thread's spans of one job while it runs tasks.
struct Spans<'a> {
    slot: &'a Mutex<Vec<WorkerSpan>>,
    thread: usize,
    parts: &'a [(usize, u32)],
    /// The index in `slot` of this job's last span.
    open: Option<usize>,
}

impl<'a> Spans<'a> {
    fn new(shared: &'a Shared, thread: usize, parts: &'a [(usize, u32)]) -> Spans<'a> {
        Spans {
            slot: &shared.spans[thread],
            thread,
            parts,
            open: None,
        }
    }

    /// Runs task `i` with `f` and records it: the open span grows when the label is the same,
    /// else a new one opens. Written before the task counts as done.
    fn run(&mut self, i: usize, f: impl FnOnce()) {
        let k = self.parts.partition_point(|&(first, _)| first <= i);
        let label = k.checked_sub(1).map(|k| self.parts[k].1);
        let start = Instant::now();
        f();
        let end = Instant::now();
        let mut slot = self.slot.lock();
        match self.open.and_then(|j| slot.get_mut(j)) {
            Some(s) if s.label == label => s.end = end,
            _ => {
                self.open = Some(slot.len());
                slot.push(WorkerSpan {
                    thread: self.thread,
                    label,
                    start,
                    end,
                });
            }
        }
    }
}

/// Claims and runs tasks of `job` until none is left, as thread `thread` (0: the caller). A
/// claim succeeds only while the shared word still holds `job`'s generation, so a worker that
/// read a finished job claims nothing.
fn claim_tasks(shared: &Shared, job: Job, thread: usize) {
    // SAFETY: the parts live as long as the job's closure (see `Job::parts`); a thread only
    // reads them after claiming a task, while `run` waits.
    let mut spans = job
        .parts
        .map(|p| Spans::new(shared, thread, unsafe { &*p }));
    let mut cur = shared.next.load(Ordering::Acquire);
    loop {
        let (generation, i) = ((cur >> 32) as u32, (cur as u32) as usize);
        if generation != job.generation || i >= job.n_tasks {
            return;
        }
        match shared
            .next
            .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: task `i` of this job is claimed and not finished, so `run` has not
                // returned and the closure is alive.
                let task = unsafe { &*job.task };
                let run = || {
                    if let Err(p) = catch_unwind(AssertUnwindSafe(|| task(i))) {
                        shared.state.lock().panic.get_or_insert(p);
                    }
                };
                match spans.as_mut() {
                    Some(s) => s.run(i, run),
                    None => run(),
                }
                if shared.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                    let _st = shared.state.lock();
                    shared.done.notify_all();
                }
                cur = shared.next.load(Ordering::Acquire);
            }
            Err(now) => cur = now,
        }
    }
}

/// Spins while `cond` holds, at most [`SPIN`] times.
/// Spins while `cond` holds, for at most `limit`.
fn spin_for(limit: std::time::Duration, cond: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while cond() {
        for _ in 0..64 {
            std::hint::spin_loop();
        }
        if start.elapsed() > limit {
            return;
        }
    }
}

fn spin_while(cond: impl Fn() -> bool) {
    for _ in 0..SPIN {
        if !cond() {
            return;
        }
        std::hint::spin_loop();
    }
}

fn worker(shared: &Shared, thread: usize) {
    let mut seen = 0u64;
    loop {
        spin_for(WORKER_SPIN, || {
            shared.generation.load(Ordering::Acquire) == seen
        });
        let job = {
            let mut st = shared.state.lock();
            while shared.generation.load(Ordering::Acquire) == seen && !st.shutdown {
                shared.wake.wait(&mut st);
            }
            if st.shutdown {
                return;
            }
            seen = shared.generation.load(Ordering::Acquire);
            st.job
        };
        if let Some(job) = job {
            claim_tasks(shared, job, thread);
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_jobs() {
        let pool = ThreadPool::new(4);
        for n in [0, 1, 3, 100] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        let mut out = vec![0usize; 1000];
        pool.for_each_chunk(&mut out, 7, &|start, part| {
            for (k, v) in part.iter_mut().enumerate() {
                *v = start + k;
            }
        });
        assert!(out.iter().enumerate().all(|(i, &v)| i == v));
    }

    #[test]
    fn many_short_jobs_run_each_task_once() {
        // Jobs of a few tasks, back to back: workers waking late for one job find the next
        // one running, and must neither run a task twice nor one of the earlier job.
        let pool = ThreadPool::new(4);
        for job in 0..20_000usize {
            let n = 2 + job % 5;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(job + 1, Ordering::Relaxed);
            });
            for h in &hits {
                assert_eq!(h.load(Ordering::Relaxed), job + 1, "job {job}");
            }
        }
    }

    #[test]
    fn a_panicking_task_is_reraised_and_the_pool_survives() {
        let pool = ThreadPool::new(3);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(50, &|i| assert_ne!(i, 17, "task 17 fails"));
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(10, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 10);
    }

    /// Traced, every labelled part appears on some thread, each thread's spans follow each
    /// other without overlapping, and every span of a job is there when `run` returns; off,
    /// nothing is recorded.
    #[test]
    fn tracing_records_each_threads_runs_of_labelled_tasks() {
        let pool = ThreadPool::new(3);
        pool.run(100, &|_| {});
        assert!(pool.take_spans().is_empty(), "tracing is off");
        pool.set_tracing(true);
        let parts = [(0, 7), (40, 9), (90, 3)];
        for _ in 0..50 {
            let before = Instant::now();
            pool.run_labeled(100, &parts, &|i| {
                std::hint::black_box((0..200 + i).sum::<usize>());
            });
            let after = Instant::now();
            let spans = pool.take_spans();
            let mut labels: Vec<u32> = spans.iter().filter_map(|s| s.label).collect();
            labels.sort_unstable();
            labels.dedup();
            assert_eq!(labels, [3, 7, 9]);
            for t in 0..3 {
                let mine: Vec<_> = spans.iter().filter(|s| s.thread == t).collect();
                for w in mine.windows(2) {
                    assert!(w[0].end <= w[1].start, "{w:?}");
                }
            }
            assert!(spans
                .iter()
                .all(|s| before <= s.start && s.start <= s.end && s.end <= after));
        }
        pool.run(4, &|_| {});
        assert!(pool.take_spans().iter().all(|s| s.label.is_none()));
        pool.set_tracing(false);
        pool.run(10, &|_| {});
        assert!(pool.take_spans().is_empty());
    }
}
