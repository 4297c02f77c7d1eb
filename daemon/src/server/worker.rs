//! A loaded model's worker: one thread owning the model's engine, taking generation jobs from a
//! bounded queue and streaming each token to its caller. Up to the engine's number of sequences
//! run together (continuous batching): a job joins the running ones as soon as a sequence is
//! free, and every decode step evaluates one token of each in a single forward pass. A job stops
//! within one decode step when its caller goes away, its deadline passes, the model is unloaded
//! or the daemon shuts down. A profile job (`profile`) runs alone, between decode steps.

use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use spillway_proto::v1 as pb;
use spillway_sched::refine::ObservedProducts;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::admission::{Demand, Forecast, QueueLimits, Refused};
use super::gpu::GpuSequence;
use super::profile::costs::Costs;
use super::profile::{step_message, totals_message, ProfileJob};
use super::stats::ModelStats;
use super::step_share::step_tokens;
use crate::engine::decode::{DecodeOptions, Decoder, TokenStep};
use crate::engine::generate::{top_logprobs, FinishReason, GenerateError};
use crate::engine::{argmax, BatchEngine, StepProfile, MAX_BATCH};
use crate::gpu::GpuError;
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// What a worker drives: the sequences of one loaded model, on the CPU ([`BatchEngine`]) or a
/// device that holds fewer (the GPU's one, `super::gpu`).
pub trait Sequences: Send + 'static {
    fn model(&self) -> &Model;
    /// How many sequences run together.
    fn sequences(&self) -> usize;
    /// Positions each sequence may hold.
    fn capacity(&self) -> usize;
    /// Tokens evaluated so far in sequence `seq`.
    fn position(&self, seq: usize) -> usize;
    /// Forgets sequence `seq`.
    fn reset(&mut self, seq: usize);
    /// Most prompt tokens evaluated between two checks for cancellation and deadlines.
    fn prompt_chunk(&self) -> usize;
    /// Evaluates `tokens` at the next positions of sequence `seq`; the logits after every one
    /// (`all_logits`) or the last.
    fn eval_sequence(
        &mut self,
        seq: usize,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, GenerateError>;
    /// One decode step: one token of each listed sequence; `n_vocab` logits per input.
    fn step(&mut self, inputs: &[(usize, u32)]) -> Result<Vec<f32>, GenerateError>;
    /// Most tokens a step of [`Sequences::step_mixed`] carries: where a newly admitted
    /// request's prompt goes into the running sequences' steps, a part of it each step (0:
    /// prompts run apart, each whole before the request joins the steps).
    fn mixed_step_tokens(&self) -> usize {
        0
    }
    /// One step in which each listed sequence takes its tokens at its next positions;
    /// `n_vocab` logits after each entry's last token.
    fn step_mixed(&mut self, inputs: &[(usize, &[u32])]) -> Result<Vec<f32>, GenerateError> {
        let mut out = Vec::new();
        for &(seq, tokens) in inputs {
            out.extend(self.eval_sequence(seq, tokens, false)?);
        }
        Ok(out)
    }
    /// The CPU engine, for per-layer profiles; `None` where the device has no profiler.
    fn profiler(&mut self) -> Option<&mut BatchEngine> {
        None
    }
    /// The GPU model, for per-layer profiles from GPU timestamps; `None` on the CPU.
    fn gpu_profiler(&mut self) -> Option<&mut GpuSequence> {
        None
    }
    /// After its device was lost: opens the device again and reloads the model there.
    fn recover(&mut self) -> Result<(), String> {
        Err("this engine has no device to recover".into())
    }
}

/// The status of requests an engine error ended: UNAVAILABLE when the device was lost (the
/// model is being reloaded) or a read of the model file failed (the next request reads
/// again), RESOURCE_EXHAUSTED when memory ran out, FAILED_PRECONDITION when the file changed
/// underneath, INTERNAL otherwise.
fn engine_status(e: &GenerateError) -> Status {
    use crate::engine::EngineError;
    use crate::stream::StreamError;
    let storage = match e {
        GenerateError::Gpu(GpuError::Storage(s)) => Some(s),
        GenerateError::Engine(EngineError::Expert(s)) => Some(s),
        _ => None,
    };
    match storage {
        Some(StreamError::FileChanged { .. }) => {
            return Status::failed_precondition(format!("{e}: load the model again"))
        }
        Some(StreamError::Io { .. } | StreamError::ShortRead { .. }) => {
            return Status::unavailable(format!(
                "{e}: the request was stopped, nothing computed from the failed read was sent; \
                 the model serves on, so retry (and check the disk if this repeats)"
            ))
        }
        _ => {}
    }
    let GenerateError::Gpu(gpu) = e else {
        return Status::internal(e.to_string());
    };
    match gpu {
        GpuError::DeviceLost => {
            Status::unavailable(format!("{e}: the model is being reloaded; retry shortly"))
        }
        g if g.is_out_of_memory() => Status::resource_exhausted(format!(
            "{e}: the request was stopped; retry when fewer requests run, or load the model \
             with a smaller context or budget"
        )),
        _ => Status::internal(e.to_string()),
    }
}

/// Pause between two failed attempts to recover a lost device.
const RECOVERY_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

impl Sequences for BatchEngine {
    fn model(&self) -> &Model {
        BatchEngine::model(self)
    }

    fn sequences(&self) -> usize {
        BatchEngine::sequences(self)
    }

    fn capacity(&self) -> usize {
        BatchEngine::capacity(self)
    }

    fn position(&self, seq: usize) -> usize {
        BatchEngine::position(self, seq)
    }

    fn reset(&mut self, seq: usize) {
        BatchEngine::reset(self, seq);
    }

    fn prompt_chunk(&self) -> usize {
        MAX_BATCH
    }

    fn eval_sequence(
        &mut self,
        seq: usize,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, GenerateError> {
        Ok(BatchEngine::eval_sequence(self, seq, tokens, all_logits)?)
    }

    fn step(&mut self, inputs: &[(usize, u32)]) -> Result<Vec<f32>, GenerateError> {
        Ok(BatchEngine::step(self, inputs)?)
    }

    fn profiler(&mut self) -> Option<&mut BatchEngine> {
        Some(self)
    }
}

/// What a generation stream carries.
pub type GenerateItem = Result<pb::GenerateResponse, Status>;

/// One validated generation request.
pub struct GenerateJob {
    pub prompt: Vec<u32>,
    pub options: DecodeOptions,
    pub prompt_logprobs: usize,
    pub deadline: Option<Instant>,
    /// When the request arrived (time to first token counts from here).
    pub arrived: Instant,
    pub tx: mpsc::Sender<GenerateItem>,
}

/// What the worker's queue carries.
enum Job {
    Generate(GenerateJob),
    Profile(ProfileJob),
}

/// The handle the service keeps: submit jobs, unload. The thread ends once the handle is
/// dropped and its queue is drained.
pub struct Worker {
    /// `None` once stopped ([`Worker::stop_and_join`]): the thread ends when this is gone.
    jobs: Mutex<Option<SyncSender<Job>>>,
    /// The thread, until joined.
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Cancelled when the model is unloaded: running and waiting jobs end with ABORTED.
    unload: CancellationToken,
    stats: Arc<ModelStats>,
    limits: QueueLimits,
    /// Predicts how long a new request would wait ([`super::admission`]).
    forecast: Arc<Forecast>,
    max_batch: usize,
    /// Positions a sequence holds (bounds the tokens a request may generate).
    capacity: usize,
}

/// Whether a job whose caller is gone (`closed`), with `deadline`, must stop, given the
/// model's `unload` token and the daemon's `shutdown` token.
fn check(
    unload: &CancellationToken,
    shutdown: &CancellationToken,
    closed: bool,
    deadline: Option<Instant>,
) -> Result<(), Interrupt> {
    if closed {
        return Err(Interrupt::Gone);
    }
    if unload.is_cancelled() {
        return Err(Interrupt::Fail(Status::aborted(
            "the model was unloaded while this request ran",
        )));
    }
    if shutdown.is_cancelled() {
        return Err(Interrupt::Fail(Status::unavailable(
            "the daemon is shutting down; retry against a running daemon",
        )));
    }
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return Err(Interrupt::Fail(Status::deadline_exceeded(
            "the deadline passed before the request finished",
        )));
    }
    Ok(())
}

/// Why a job stopped before its natural end.
pub(crate) enum Interrupt {
    /// The caller went away: nobody to tell.
    Gone,
    Fail(Status),
}

impl Worker {
    /// Starts the worker thread. Up to `limits.depth` requests may wait while the engine's
    /// sequences are all busy (and with `limits.max_wait`, only those predicted to start
    /// within it); `shutdown` is the daemon's token for cancelling in-flight work once the
    /// grace period is over.
    pub fn spawn(
        name: &str,
        engine: impl Sequences,
        tokenizer: Option<Arc<Tokenizer>>,
        limits: QueueLimits,
        shutdown: CancellationToken,
    ) -> std::io::Result<Worker> {
        let max_batch = engine.sequences();
        let (jobs, rx) = sync_channel(limits.depth + max_batch);
        let capacity = engine.capacity();
        let stats = Arc::new(ModelStats::default());
        let forecast = Arc::new(Forecast::new(max_batch));
        let unload = CancellationToken::new();
        let ctx = WorkerContext {
            engine,
            tokenizer,
            stats: stats.clone(),
            forecast: forecast.clone(),
            unload: unload.clone(),
            shutdown,
            lost: false,
        };
        let thread = std::thread::Builder::new()
            .name(format!("model-{name}"))
            .spawn(move || {
                // `run` owns the model and drops it when it returns.
                ctx.run(rx);
                crate::host_memory::release_freed();
            })?;
        Ok(Worker {
            jobs: Mutex::new(Some(jobs)),
            thread: Mutex::new(Some(thread)),
            unload,
            stats,
            limits,
            forecast,
            max_batch,
            capacity,
        })
    }

    /// Queues a job, or refuses it at once with RESOURCE_EXHAUSTED when the queue is full.
    #[allow(clippy::result_large_err)] // the error is the gRPC status the caller returns
    pub fn submit(&self, job: GenerateJob) -> Result<(), Status> {
        let room = self.capacity.saturating_sub(job.prompt.len()).max(1);
        let demand = Demand {
            prompt: job.prompt.len(),
            tokens: job.options.max_tokens.clamp(1, room),
        };
        self.enqueue(Job::Generate(job), demand)
    }

    /// Queues a profile job as [`Worker::submit`] does a generation.
    #[allow(clippy::result_large_err)]
    pub fn submit_profile(&self, job: ProfileJob) -> Result<(), Status> {
        let demand = Demand {
            prompt: job.prompt.len(),
            tokens: job.steps,
        };
        self.enqueue(Job::Profile(job), demand)
    }

    #[allow(clippy::result_large_err)]
    fn enqueue(&self, job: Job, demand: Demand) -> Result<(), Status> {
        if self.unload.is_cancelled() {
            return Err(Status::unavailable("the model is being unloaded"));
        }
        if self.stats.recovering.load(Ordering::SeqCst) {
            return Err(Status::unavailable(
                "the model's GPU device was lost and the model is being reloaded; retry shortly",
            ));
        }
        // Accepted and not finished: running and waiting. The queue's channel holds the waiting
        // ones only, so it is sized for them all, and this count bounds them: with depth 0, a
        // request is taken only while a sequence is free for it. A full queue refuses before
        // any wait is predicted.
        let accepted = self.stats.in_queue.fetch_add(1, Ordering::SeqCst);
        let sent = if accepted >= self.max_batch + self.limits.depth {
            Err(Refused::Queue(TrySendError::Full(job)))
        } else {
            let jobs = self.jobs.lock();
            self.forecast
                .enqueue(demand, self.limits, || match jobs.as_ref() {
                    Some(jobs) => jobs.try_send(job),
                    None => Err(TrySendError::Disconnected(job)),
                })
        };
        sent.map_err(|e| {
            self.stats.in_queue.fetch_sub(1, Ordering::SeqCst);
            match e {
                Refused::TooLong {
                    wait,
                    limit,
                    running,
                    waiting,
                } => Status::resource_exhausted(format!(
                    "this request would wait about {} ms for a free sequence ({running} \
                     running, {waiting} waiting), more than --max-queue-wait-ms {}; retry later",
                    wait.as_millis(),
                    limit.as_millis()
                )),
                Refused::Queue(TrySendError::Full(_)) => Status::resource_exhausted(format!(
                    "the model's queue is full ({} waiting, {} running); retry later or \
                     start the daemon with a larger --queue-depth",
                    self.limits.depth, self.max_batch
                )),
                Refused::Queue(TrySendError::Disconnected(_)) => {
                    Status::unavailable("the model's worker has stopped")
                }
            }
        })
    }

    pub fn stats(&self) -> &ModelStats {
        &self.stats
    }

    pub fn queue_capacity(&self) -> usize {
        self.limits.depth
    }

    /// Requests that run together.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Ends the running and waiting jobs with ABORTED and refuses new ones.
    pub fn unload(&self) {
        self.unload.cancel();
    }

    /// [`Worker::unload`], then waits for the thread to end, having dropped the model's engine
    /// (and with it, for a GPU model, its device memory). At shutdown this comes before the
    /// process exits, so that no thread still frees Vulkan objects while the driver's own exit
    /// handlers run (which crashed NVIDIA's driver). Blocks: call it off the async runtime.
    pub fn stop_and_join(&self) {
        self.unload.cancel();
        drop(self.jobs.lock().take());
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }
}

/// What the worker thread owns.
struct WorkerContext<E> {
    engine: E,
    tokenizer: Option<Arc<Tokenizer>>,
    stats: Arc<ModelStats>,
    /// Told what runs and how long steps take, for predicting waits.
    forecast: Arc<Forecast>,
    unload: CancellationToken,
    shutdown: CancellationToken,
    /// The device was lost: the next turn of the loop recovers before admitting anyone.
    lost: bool,
}

/// A request being decoded in one of the engine's sequences.
struct Active<'t> {
    job: GenerateJob,
    seq: usize,
    decoder: Decoder<'t>,
    started: Instant,
    prompt_done: Instant,
    first_token_at: Option<Instant>,
    prompt_logprobs: Vec<pb::PromptLogprobs>,
    /// Prompt tokens evaluated: all of them, unless the prompt goes into the steps
    /// ([`Sequences::mixed_step_tokens`]), where the request samples its first token at the
    /// step that takes the prompt's last.
    prompt_at: usize,
}

impl Active<'_> {
    /// Whether the request's prompt is still going into the steps.
    fn prompting(&self) -> bool {
        self.prompt_at < self.job.prompt.len()
    }
}

impl<E: Sequences> WorkerContext<E> {
    /// Admits waiting jobs into free sequences (blocking only when none runs), then runs one
    /// decode step for all running sequences together, until the queue is closed and drained.
    fn run(mut self, rx: Receiver<Job>) {
        let tokenizer = self.tokenizer.clone();
        let tokenizer = tokenizer.as_deref();
        let eos = self
            .engine
            .model()
            .file()
            .metadata()
            .opt_u32("tokenizer.ggml.eos_token_id")
            .ok()
            .flatten();
        let mut active: Vec<Active<'_>> = Vec::new();
        let mut free: Vec<usize> = (0..self.engine.sequences()).rev().collect();
        // Whose turn it is among the decoding requests when a prompt leaves room for only some.
        let mut turn = 0usize;
        loop {
            if self.lost && active.is_empty() {
                self.recover();
            }
            while let Some(&seq) = free.last() {
                if self.lost {
                    break;
                }
                let job = if active.is_empty() {
                    match rx.recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    }
                } else {
                    match rx.try_recv() {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                };
                let job = match job {
                    Job::Generate(job) => job,
                    Job::Profile(job) => {
                        self.forecast.start(None);
                        let result = self.profile(&job, seq);
                        self.stats.in_queue.fetch_sub(1, Ordering::SeqCst);
                        if let Err(Interrupt::Fail(status)) = result {
                            // The profile's only UNAVAILABLE: the device was lost.
                            self.lost |= status.code() == tonic::Code::Unavailable;
                            tracing::debug!(code = ?status.code(), "profile ended early: {}", status.message());
                            let _ = job.tx.blocking_send(Err(status));
                        }
                        continue;
                    }
                };
                let tx = job.tx.clone();
                let most = job.options.max_tokens.min(self.engine.capacity());
                self.forecast.start(Some((seq, most)));
                match self.start(job, seq, tokenizer, eos) {
                    Ok(Some(a)) => {
                        free.pop();
                        active.push(a);
                    }
                    Ok(None) => self.done(seq, &tx, Ok(())),
                    Err(i) => self.done(seq, &tx, Err(i)),
                }
            }
            if active.is_empty() {
                continue;
            }
            // Requests whose caller left, whose deadline passed, or that must stop, end here:
            // within one decode step.
            let mut i = 0;
            while i < active.len() {
                if let Err(why) = self.interrupted(&active[i].job) {
                    let a = active.swap_remove(i);
                    free.push(a.seq);
                    self.done(a.seq, &a.job.tx, Err(why));
                } else {
                    i += 1;
                }
            }
            if active.is_empty() {
                continue;
            }
            // Each running request's next token and part of each prompt going into the steps.
            let prompts: Vec<Option<usize>> = active
                .iter()
                .map(|a| a.prompting().then(|| a.job.prompt.len() - a.prompt_at))
                .collect();
            let taken = step_tokens(&prompts, self.engine.mixed_step_tokens(), turn);
            let used: usize = taken.iter().sum();
            turn += taken
                .iter()
                .zip(&prompts)
                .filter(|(&t, p)| t > 0 && p.is_none())
                .count();
            let entries: Vec<(usize, &[u32])> = active
                .iter()
                .zip(&taken)
                .filter(|(_, &t)| t > 0)
                .map(|(a, &t)| match a.prompting() {
                    true => (a.seq, &a.job.prompt[a.prompt_at..a.prompt_at + t]),
                    false => {
                        let last = a.decoder.tokens().last().expect("a sampled token");
                        (a.seq, std::slice::from_ref(last))
                    }
                })
                .collect();
            let inputs: Vec<(usize, u32)> = entries.iter().map(|&(s, t)| (s, t[0])).collect();
            let step_began = Instant::now();
            self.forecast.stepping();
            let mixed = active
                .iter()
                .zip(&taken)
                .any(|(a, &t)| a.prompting() && t > 0);
            let stepped = match mixed {
                true => self.engine.step_mixed(&entries),
                false => self.engine.step(&inputs),
            };
            let stepped = stepped.map_err(|e| self.engine_failed(&e));
            // Logits computed from a model file changed underneath reach no one.
            let stepped = stepped.and_then(|l| self.file_intact().map(|()| l));
            let logits = match stepped {
                Ok(l) => {
                    if inputs.len() > 1 {
                        self.stats.shared_steps.fetch_add(1, Ordering::Relaxed);
                    }
                    if mixed {
                        self.stats.prompt_steps.fetch_add(1, Ordering::Relaxed);
                    }
                    l
                }
                Err(status) => {
                    for a in active.drain(..) {
                        free.push(a.seq);
                        self.done(a.seq, &a.job.tx, Err(Interrupt::Fail(status.clone())));
                    }
                    continue;
                }
            };
            let n_vocab = self.engine.model().config.n_vocab;
            let mut finished = Vec::new();
            let stepped_now = active
                .iter_mut()
                .zip(taken)
                .enumerate()
                .filter(|(_, (_, t))| *t > 0);
            for ((i, (a, t)), l) in stepped_now.zip(logits.chunks_exact(n_vocab)) {
                if a.prompting() {
                    a.prompt_at += t;
                    if a.prompting() {
                        continue;
                    }
                    a.prompt_done = Instant::now();
                }
                let room = self.engine.position(a.seq) < self.engine.capacity();
                let step = a.decoder.step(l, room);
                match self.emit(a, step) {
                    Ok(false) => {}
                    Ok(true) => finished.push((i, Ok(()))),
                    Err(why) => finished.push((i, Err(why))),
                }
            }
            tracing::trace!(
                entries = inputs.len(),
                tokens = used,
                ms = step_began.elapsed().as_secs_f64() * 1e3,
                "step"
            );
            self.forecast.stepped(
                step_began.elapsed(),
                active.iter().map(|a| (a.seq, self.tokens_left(a))),
            );
            for (i, result) in finished.into_iter().rev() {
                let a = active.swap_remove(i);
                free.push(a.seq);
                self.done(a.seq, &a.job.tx, result);
            }
        }
    }

    /// The status the requests an engine error ended get ([`engine_status`]); a lost device
    /// is reloaded before the next request.
    fn engine_failed(&mut self, e: &GenerateError) -> Status {
        if matches!(e, GenerateError::Gpu(GpuError::DeviceLost)) {
            self.lost = true;
        }
        engine_status(e)
    }

    /// Opens the lost device again and reloads the model, retrying until it works or the
    /// model is unloaded or the daemon stops. New requests are refused meanwhile.
    fn recover(&mut self) {
        self.stats.set_recovering(true);
        tracing::error!("the GPU device was lost: opening it again and reloading the model");
        let start = Instant::now();
        while self.lost && !self.unload.is_cancelled() && !self.shutdown.is_cancelled() {
            match self.engine.recover() {
                Ok(()) => {
                    self.lost = false;
                    tracing::info!(
                        seconds = start.elapsed().as_secs_f64(),
                        "the model is on a new device and serves again"
                    );
                }
                Err(e) => {
                    tracing::error!("reloading after the device loss failed: {e}; retrying");
                    std::thread::sleep(RECOVERY_RETRY);
                }
            }
        }
        self.stats.set_recovering(false);
    }

    /// The most tokens a running request may still generate.
    fn tokens_left(&self, a: &Active<'_>) -> usize {
        let room = self
            .engine
            .capacity()
            .saturating_sub(self.engine.position(a.seq));
        let left = a
            .job
            .options
            .max_tokens
            .saturating_sub(a.decoder.tokens().len());
        left.min(room)
    }

    /// A job in sequence `seq` has ended: count it out of the queue, free its sequence and
    /// tell its caller why it failed.
    fn done(&self, seq: usize, tx: &mpsc::Sender<GenerateItem>, result: Result<(), Interrupt>) {
        self.forecast.end(seq);
        self.stats.in_queue.fetch_sub(1, Ordering::SeqCst);
        if let Err(Interrupt::Fail(status)) = result {
            tracing::debug!(code = ?status.code(), "generation ended early: {}", status.message());
            let _ = tx.blocking_send(Err(status));
        }
    }

    /// FAILED_PRECONDITION once the model's file changed on disk since it was loaded
    /// (truncated, rewritten or replaced: `GgufFile::intact`), checked before a request's
    /// prompt and after every forward pass, so that a request never gets tokens computed from
    /// a changed file; the model serves again once loaded again.
    fn file_intact(&self) -> Result<(), Status> {
        self.engine
            .model()
            .file()
            .intact()
            .map_err(Status::failed_precondition)
    }

    /// Checked before every forward pass.
    fn interrupted(&self, job: &GenerateJob) -> Result<(), Interrupt> {
        self.check(job.tx.is_closed(), job.deadline)
    }

    /// Whether a job whose caller is gone (`closed`), with `deadline`, must stop.
    fn check(&self, closed: bool, deadline: Option<Instant>) -> Result<(), Interrupt> {
        check(&self.unload, &self.shutdown, closed, deadline)
    }

    /// Evaluates a job's prompt in sequence `seq` and samples its first token. `None` when the
    /// job already finished with that token.
    fn start<'t>(
        &mut self,
        job: GenerateJob,
        seq: usize,
        tokenizer: Option<&'t Tokenizer>,
        eos: Option<u32>,
    ) -> Result<Option<Active<'t>>, Interrupt> {
        self.interrupted(&job)?;
        self.file_intact().map_err(Interrupt::Fail)?;
        tracing::debug!(
            prompt_tokens = job.prompt.len(),
            max_tokens = job.options.max_tokens,
            seq,
            "generate"
        );
        let started = Instant::now();
        let n_vocab = self.engine.model().config.n_vocab;
        let want_all = job.prompt_logprobs > 0;
        self.engine.reset(seq);
        if self.engine.mixed_step_tokens() > 0 && !want_all {
            // The prompt goes into the steps, beside the running requests' tokens.
            let decoder = Decoder::new(tokenizer, eos, &job.prompt, job.options.clone());
            return Ok(Some(Active {
                job,
                seq,
                decoder,
                started,
                prompt_done: started,
                first_token_at: None,
                prompt_logprobs: Vec::new(),
                prompt_at: 0,
            }));
        }

        self.forecast.prompting(job.prompt.len());
        // The prompt in chunks, so that a long one can be interrupted too.
        let mut prompt_logprobs = Vec::new();
        let mut logits = Vec::new();
        for chunk in job.prompt.chunks(self.engine.prompt_chunk()) {
            self.interrupted(&job)?;
            let out = match self.engine.eval_sequence(seq, chunk, want_all) {
                Ok(out) => out,
                Err(e) => return Err(Interrupt::Fail(self.engine_failed(&e))),
            };
            if want_all {
                for l in out.chunks_exact(n_vocab) {
                    let top = top_logprobs(l, job.prompt_logprobs);
                    prompt_logprobs.push(pb::PromptLogprobs {
                        position: prompt_logprobs.len() as u32,
                        top: top.into_iter().map(to_pb_logprob).collect(),
                    });
                }
            }
            logits.clear();
            logits.extend_from_slice(&out[out.len() - n_vocab..]);
        }
        self.forecast.prompt(job.prompt.len(), started.elapsed());
        self.file_intact().map_err(Interrupt::Fail)?;
        let decoder = Decoder::new(tokenizer, eos, &job.prompt, job.options.clone());
        let job_prompt_len = job.prompt.len();
        let mut a = Active {
            job,
            seq,
            decoder,
            started,
            prompt_done: Instant::now(),
            first_token_at: None,
            prompt_logprobs,
            prompt_at: job_prompt_len,
        };
        let room = self.engine.position(seq) < self.engine.capacity();
        let step = a.decoder.step(&logits, room);
        Ok(if self.emit(&mut a, step)? {
            None
        } else {
            Some(a)
        })
    }

    /// Runs a profile job in sequence `seq`: the prompt, then greedy decode steps, each sent
    /// with its records as it completes; the last carries the totals.
    fn profile(&mut self, job: &ProfileJob, seq: usize) -> Result<(), Interrupt> {
        let (unload, shutdown) = (self.unload.clone(), self.shutdown.clone());
        let check = || check(&unload, &shutdown, job.tx.is_closed(), job.deadline);
        check()?;
        tracing::debug!(
            prompt_tokens = job.prompt.len(),
            steps = job.steps,
            seq,
            "profile"
        );
        if let Some(gpu) = self.engine.gpu_profiler() {
            gpu.select(seq);
            return super::profile::gpu::run(gpu, job, &check);
        }
        let Some(engine) = self.engine.profiler() else {
            return Err(Interrupt::Fail(Status::failed_precondition(
                "this model's device has no per-layer profiler",
            )));
        };
        let fail = |e: crate::engine::EngineError| Interrupt::Fail(Status::internal(e.to_string()));
        let layers = engine.model().config.n_layer;
        let costs = Costs::new(engine.model(), job.hardware.get());
        let mut seen = ObservedProducts::default();
        let send =
            |msg: pb::ProfileStep| job.tx.blocking_send(Ok(msg)).map_err(|_| Interrupt::Gone);
        engine.reset(seq);
        let origin = Instant::now();
        let mut prefill = StepProfile::default();
        let logits = engine
            .eval_sequence_with(seq, &job.prompt, false, Some(&mut prefill))
            .map_err(fail)?;
        let mut next = argmax(&logits) as u32;
        let mut msg = step_message(0, &prefill, origin);
        costs.annotate_cpu(&mut msg);
        send(msg)?;
        let mut decode: Vec<StepProfile> = Vec::with_capacity(job.steps);
        let mut sent: Vec<Vec<pb::ProfileRow>> = Vec::with_capacity(job.steps);
        for i in 1..=job.steps {
            check()?;
            let mut p = StepProfile::default();
            let logits = engine
                .eval_sequence_with(seq, &[next], false, Some(&mut p))
                .map_err(fail)?;
            next = argmax(&logits) as u32;
            let mut msg = step_message(i, &p, origin);
            costs.annotate_cpu(&mut msg);
            costs.observe(&msg, &mut seen);
            decode.push(p);
            // Their rows, for the totals (not the trace slices, which can be many).
            sent.push(msg.rows.clone());
            if i == job.steps {
                let mut totals = totals_message(&prefill, &decode, layers);
                costs.complete_totals(&mut totals, &sent);
                msg.totals = Some(totals);
            }
            send(msg)?;
        }
        engine.reset(seq);
        job.hardware.refine(&seen);
        Ok(())
    }

    /// Sends one step to the caller; true when it was the last.
    fn emit(&self, a: &mut Active<'_>, step: TokenStep) -> Result<bool, Interrupt> {
        let now = Instant::now();
        self.stats.token(now);
        a.first_token_at.get_or_insert(now);
        let finish = step.finish;
        let mut msg = to_pb_step(step);
        msg.prompt_logprobs = std::mem::take(&mut a.prompt_logprobs);
        if let Some(reason) = finish {
            let job = &a.job;
            let decode_ms = ms(a.prompt_done, now);
            let generated = a.decoder.tokens().len();
            msg.finish_reason = to_pb_finish(reason) as i32;
            msg.timings = Some(pb::Timings {
                time_to_first_token_ms: ms(job.arrived, a.first_token_at.unwrap_or(now)),
                prefill_tokens_per_second: per_s(job.prompt.len(), ms(a.started, a.prompt_done)),
                // The last token is only sampled, never evaluated.
                decode_tokens_per_second: per_s(generated.saturating_sub(1), decode_ms),
                prompt_tokens: job.prompt.len() as u32,
                generated_tokens: generated as u32,
                queue_ms: ms(job.arrived, a.started),
                prompt_ms: ms(a.started, a.prompt_done),
                decode_ms,
            });
        }
        // A slow reader holds up the whole batch while its channel is full; the channel is
        // deep enough that a reader keeping up never does.
        a.job
            .tx
            .blocking_send(Ok(msg))
            .map_err(|_| Interrupt::Gone)?;
        Ok(finish.is_some())
    }
}

fn to_pb_step(step: TokenStep) -> pb::GenerateResponse {
    pb::GenerateResponse {
        token: step.token,
        text: step.text,
        logprob: step.logprob,
        top_logprobs: step.top_logprobs.into_iter().map(to_pb_logprob).collect(),
        ..Default::default()
    }
}

fn to_pb_logprob(t: crate::engine::generate::TokenLogprob) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token: t.token,
        logprob: t.logprob,
    }
}

pub fn to_pb_finish(reason: FinishReason) -> pb::FinishReason {
    match reason {
        FinishReason::MaxTokens => pb::FinishReason::MaxTokens,
        FinishReason::StopToken => pb::FinishReason::StopToken,
        FinishReason::StopString => pb::FinishReason::StopString,
        FinishReason::ContextFull => pb::FinishReason::ContextFull,
    }
}

fn ms(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64() * 1e3
}

fn per_s(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1e3 / ms
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::MemoryKind;
    use crate::stream::StreamError;
    use std::path::PathBuf;
    use tonic::Code;

    #[test]
    fn engine_errors_map_to_codes_a_client_can_act_on() {
        let path = PathBuf::from("/models/m.gguf");
        let cases = [
            (GpuError::DeviceLost, Code::Unavailable, "reloaded"),
            (
                GpuError::OutOfMemory(MemoryKind::Device),
                Code::ResourceExhausted,
                "retry",
            ),
            (
                GpuError::Storage(StreamError::Io {
                    path: path.clone(),
                    offset: 4096,
                    len: 10,
                    source: std::io::Error::from_raw_os_error(libc::EIO),
                }),
                Code::Unavailable,
                "m.gguf: read error at offset 4096",
            ),
            (
                GpuError::Storage(StreamError::ShortRead {
                    path: path.clone(),
                    offset: 4096,
                    len: 10,
                    available: 0,
                }),
                Code::Unavailable,
                "short read",
            ),
            (
                GpuError::Storage(StreamError::FileChanged {
                    path,
                    offset: 0,
                    len: 10,
                    what: "truncated".into(),
                }),
                Code::FailedPrecondition,
                "load the model again",
            ),
            (
                GpuError::Unsupported("x".into()),
                Code::Internal,
                "unsupported",
            ),
        ];
        for (e, code, says) in cases {
            let s = engine_status(&GenerateError::Gpu(e));
            assert_eq!(s.code(), code, "{}", s.message());
            assert!(s.message().contains(says), "{}", s.message());
        }
        let s = engine_status(&GenerateError::EmptyPrompt);
        assert_eq!(s.code(), Code::Internal);
    }
}
