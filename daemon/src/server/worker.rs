//! A loaded model's worker: one thread owning the model's engine, taking generation jobs from a
//! bounded queue and streaming each token to its caller. A job stops within one decode step when
//! its caller goes away, its deadline passes, the model is unloaded or the daemon shuts down.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use spillway_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::stats::ModelStats;
use crate::engine::decode::{DecodeOptions, Decoder, TokenStep};
use crate::engine::generate::{eos_token, top_logprobs, FinishReason};
use crate::engine::{Engine, MAX_BATCH};
use crate::tokenizer::Tokenizer;

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

/// The handle the service keeps: submit jobs, unload. The thread ends once the handle is
/// dropped and its queue is drained.
pub struct Worker {
    jobs: SyncSender<GenerateJob>,
    /// Cancelled when the model is unloaded: running and waiting jobs end with ABORTED.
    unload: CancellationToken,
    stats: Arc<ModelStats>,
    queue_capacity: usize,
}

/// Why a job stopped before its natural end.
enum Interrupt {
    /// The caller went away: nobody to tell.
    Gone,
    Fail(Status),
}

impl Worker {
    /// Starts the worker thread. `queue_capacity` requests may wait while one runs; `shutdown`
    /// is the daemon's token for cancelling in-flight work once the grace period is over.
    pub fn spawn(
        name: &str,
        engine: Engine,
        tokenizer: Option<Arc<Tokenizer>>,
        queue_capacity: usize,
        shutdown: CancellationToken,
    ) -> std::io::Result<Worker> {
        let (jobs, rx) = sync_channel(queue_capacity);
        let stats = Arc::new(ModelStats::default());
        let unload = CancellationToken::new();
        let ctx = WorkerContext {
            engine,
            tokenizer,
            stats: stats.clone(),
            unload: unload.clone(),
            shutdown,
        };
        std::thread::Builder::new()
            .name(format!("model-{name}"))
            .spawn(move || ctx.run(rx))?;
        Ok(Worker {
            jobs,
            unload,
            stats,
            queue_capacity,
        })
    }

    /// Queues a job, or refuses it at once with RESOURCE_EXHAUSTED when the queue is full.
    #[allow(clippy::result_large_err)] // the error is the gRPC status the caller returns
    pub fn submit(&self, job: GenerateJob) -> Result<(), Status> {
        if self.unload.is_cancelled() {
            return Err(Status::unavailable("the model is being unloaded"));
        }
        self.stats.in_queue.fetch_add(1, Ordering::SeqCst);
        match self.jobs.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.stats.in_queue.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => Status::resource_exhausted(format!(
                        "the model's queue is full ({} waiting and one running); retry later \
                         or start the daemon with a larger --queue-depth",
                        self.queue_capacity
                    )),
                    TrySendError::Disconnected(_) => {
                        Status::unavailable("the model's worker has stopped")
                    }
                })
            }
        }
    }

    pub fn stats(&self) -> &ModelStats {
        &self.stats
    }

    pub fn queue_capacity(&self) -> usize {
        self.queue_capacity
    }

    /// Ends the running and waiting jobs with ABORTED and refuses new ones.
    pub fn unload(&self) {
        self.unload.cancel();
    }
}

/// What the worker thread owns.
struct WorkerContext {
    engine: Engine,
    tokenizer: Option<Arc<Tokenizer>>,
    stats: Arc<ModelStats>,
    unload: CancellationToken,
    shutdown: CancellationToken,
}

impl WorkerContext {
    fn run(mut self, rx: Receiver<GenerateJob>) {
        while let Ok(job) = rx.recv() {
            let tx = job.tx.clone();
            let result = self.generate(job);
            self.stats.in_queue.fetch_sub(1, Ordering::SeqCst);
            if let Err(Interrupt::Fail(status)) = result {
                tracing::debug!(code = ?status.code(), "generation ended early: {}", status.message());
                let _ = tx.blocking_send(Err(status));
            }
        }
    }

    /// Checked before every forward pass.
    fn interrupted(&self, job: &GenerateJob) -> Result<(), Interrupt> {
        if job.tx.is_closed() {
            return Err(Interrupt::Gone);
        }
        if self.unload.is_cancelled() {
            return Err(Interrupt::Fail(Status::aborted(
                "the model was unloaded while this request ran",
            )));
        }
        if self.shutdown.is_cancelled() {
            return Err(Interrupt::Fail(Status::unavailable(
                "the daemon is shutting down; retry against a running daemon",
            )));
        }
        if job.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Interrupt::Fail(Status::deadline_exceeded(
                "the deadline passed before generation finished",
            )));
        }
        Ok(())
    }

    fn generate(&mut self, job: GenerateJob) -> Result<(), Interrupt> {
        self.interrupted(&job)?;
        tracing::debug!(
            prompt_tokens = job.prompt.len(),
            max_tokens = job.options.max_tokens,
            "generate"
        );
        let started = Instant::now();
        let queue_ms = ms(job.arrived, started);
        let n_vocab = self.engine.model().config.n_vocab;
        let want_all = job.prompt_logprobs > 0;
        self.engine.reset();

        // The prompt in chunks, so that a long one can be interrupted too.
        let mut prompt_lp = Vec::new();
        let mut logits = Vec::new();
        for chunk in job.prompt.chunks(MAX_BATCH) {
            self.interrupted(&job)?;
            let out = self
                .engine
                .eval_batch(chunk, want_all)
                .map_err(|e| Interrupt::Fail(Status::internal(e.to_string())))?;
            if want_all {
                for l in out.chunks_exact(n_vocab) {
                    let top = top_logprobs(l, job.prompt_logprobs);
                    prompt_lp.push(pb::PromptLogprobs {
                        position: prompt_lp.len() as u32,
                        top: top.into_iter().map(to_pb_logprob).collect(),
                    });
                }
            }
            logits.clear();
            logits.extend_from_slice(&out[out.len() - n_vocab..]);
        }
        let prompt_done = Instant::now();

        let tokenizer = self.tokenizer.clone();
        let eos = eos_token(&self.engine);
        let mut decoder = Decoder::new(tokenizer.as_deref(), eos, &job.prompt, job.options.clone());
        let mut first_token_at = None;
        let mut prompt_lp = Some(prompt_lp);
        loop {
            let room = self.engine.position() < self.engine.capacity();
            let step = decoder.step(&logits, room);
            let now = Instant::now();
            self.stats.token(now);
            first_token_at.get_or_insert(now);
            let finish = step.finish;
            let mut msg = to_pb_step(step);
            msg.prompt_logprobs = prompt_lp.take().unwrap_or_default();
            if let Some(reason) = finish {
                let decode_ms = ms(prompt_done, now);
                let generated = decoder.tokens().len();
                msg.finish_reason = to_pb_finish(reason) as i32;
                msg.timings = Some(pb::Timings {
                    time_to_first_token_ms: ms(job.arrived, first_token_at.unwrap_or(now)),
                    prefill_tokens_per_second: per_s(job.prompt.len(), ms(started, prompt_done)),
                    // The last token is only sampled, never evaluated.
                    decode_tokens_per_second: per_s(generated.saturating_sub(1), decode_ms),
                    prompt_tokens: job.prompt.len() as u32,
                    generated_tokens: generated as u32,
                    queue_ms,
                    prompt_ms: ms(started, prompt_done),
                    decode_ms,
                });
            }
            if job.tx.blocking_send(Ok(msg)).is_err() {
                return Err(Interrupt::Gone);
            }
            let Some(token) = finish
                .is_none()
                .then_some(decoder.tokens()[decoder.tokens().len() - 1])
            else {
                return Ok(());
            };
            self.interrupted(&job)?;
            logits = self
                .engine
                .eval(token)
                .map_err(|e| Interrupt::Fail(Status::internal(e.to_string())))?
                .to_vec();
        }
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
