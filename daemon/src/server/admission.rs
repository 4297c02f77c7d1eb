//! Which requests a model's queue admits: at most `depth` waiting while every sequence is busy,
//! and, with a wait limit (`spillwayd serve --max-queue-wait`), only those predicted to start
//! within it. A request the queue would hold longer is refused at once with RESOURCE_EXHAUSTED,
//! so that the requests it does admit keep a time to first token close to an idle daemon's.
//!
//! The prediction ([`Forecast::wait`]) replays the worker's next moves from what the worker
//! reports: what it is doing now (a decode step or a prompt, and when that should end), the
//! most tokens each running request may still generate, the requests already waiting (prompt
//! length, most tokens), and two measured times, a decode step and a prompt token, as moving
//! averages. A running request is assumed to run to its limit: one that stops
//! earlier (a stop string, end of text, a caller leaving) frees its sequence sooner, so the
//! prediction errs towards refusing. Before the first decode step is measured there is nothing
//! to predict from, and only the depth applies.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How many requests may wait, and for how long.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueLimits {
    /// Requests that may wait while every sequence runs one.
    pub depth: usize,
    /// Longest predicted wait for a free sequence that a request is admitted with; `None`: any.
    pub max_wait: Option<Duration>,
}

/// What a request asks of the worker, for predicting the waits behind it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    /// Prompt tokens to evaluate before its first token.
    pub prompt: usize,
    /// Most tokens it generates (decode steps it holds a sequence for).
    pub tokens: usize,
}

/// Why a request was not queued.
#[derive(Debug)]
pub enum Refused<E> {
    /// Predicted to wait longer than the limit.
    TooLong {
        wait: Duration,
        limit: Duration,
        running: usize,
        waiting: usize,
    },
    /// The queue itself refused it (full, or its worker gone).
    Queue(E),
}

/// Weight of a new measurement in the moving averages.
const ALPHA: f64 = 0.2;

fn average(into: &mut Option<f64>, seconds: f64) {
    *into = Some(match *into {
        None => seconds,
        Some(old) => old + ALPHA * (seconds - old),
    });
}

/// What the worker is doing.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Work {
    /// A decode step, which gives each running request one of its tokens.
    Step,
    /// A request's prompt, between two steps.
    Prompt,
}

#[derive(Debug, Default)]
struct State {
    /// What the worker is doing, and when it should be done (from the averages).
    busy: Option<(Work, Instant)>,
    /// Per sequence: the most tokens its request may still generate; `None` when free.
    running: Vec<Option<usize>>,
    /// Requests queued, in the order the worker takes them.
    waiting: VecDeque<Demand>,
    /// Seconds a decode step takes (of the batch that ran).
    step: Option<f64>,
    /// Seconds a prompt token takes.
    prompt_token: Option<f64>,
}

/// Shared by a model's service side (which asks and queues) and its worker (which reports).
#[derive(Debug)]
pub struct Forecast {
    state: Mutex<State>,
}

impl Forecast {
    pub fn new(sequences: usize) -> Forecast {
        Forecast {
            state: Mutex::new(State {
                running: vec![None; sequences],
                ..State::default()
            }),
        }
    }

    /// Queues a request through `send` (the queue's own non-blocking send) unless its
    /// predicted wait exceeds `limits.max_wait`. The prediction and the send happen under one
    /// lock, so that the waiting list stays in the queue's order.
    pub fn enqueue<E>(
        &self,
        demand: Demand,
        limits: QueueLimits,
        send: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), Refused<E>> {
        let mut s = self.state.lock();
        if let Some(limit) = limits.max_wait {
            if let Some(wait) = s.wait(Instant::now()).filter(|&w| w > limit) {
                return Err(Refused::TooLong {
                    wait,
                    limit,
                    running: s.running.iter().flatten().count(),
                    waiting: s.waiting.len(),
                });
            }
        }
        send().map_err(Refused::Queue)?;
        s.waiting.push_back(demand);
        Ok(())
    }

    /// The predicted wait of a request arriving now until a sequence is free for it and the
    /// worker gets to it; `None` until a decode step was measured.
    pub fn wait(&self) -> Option<Duration> {
        self.state.lock().wait(Instant::now())
    }

    /// The worker begins a decode step.
    pub fn stepping(&self) {
        let mut s = self.state.lock();
        s.busy = s
            .step
            .map(|step| (Work::Step, Instant::now() + Duration::from_secs_f64(step)));
    }

    /// The worker begins evaluating a prompt of `tokens`.
    pub fn prompting(&self, tokens: usize) {
        let mut s = self.state.lock();
        s.busy = s.prompt_token.map(|t| {
            let took = Duration::from_secs_f64(t * tokens as f64);
            (Work::Prompt, Instant::now() + took)
        });
    }

    /// The worker took the oldest waiting request; it runs in `seq`, generating at most
    /// `tokens` more (`None`: it runs alone between steps, as a profile does).
    pub fn start(&self, run: Option<(usize, usize)>) {
        let mut s = self.state.lock();
        s.waiting.pop_front();
        if let Some((seq, tokens)) = run {
            if let Some(slot) = s.running.get_mut(seq) {
                *slot = Some(tokens);
            }
        }
    }

    /// Sequence `seq` is free again.
    pub fn end(&self, seq: usize) {
        if let Some(slot) = self.state.lock().running.get_mut(seq) {
            *slot = None;
        }
    }

    /// A prompt of `tokens` was evaluated in `took` (or failed): the worker is free.
    pub fn prompt(&self, tokens: usize, took: Duration) {
        let mut s = self.state.lock();
        s.busy = None;
        if tokens > 0 {
            average(&mut s.prompt_token, took.as_secs_f64() / tokens as f64);
        }
    }

    /// A decode step took `took`; `left` is, per sequence still running after it, the most
    /// tokens it may still generate.
    pub fn stepped(&self, took: Duration, left: impl IntoIterator<Item = (usize, usize)>) {
        let mut s = self.state.lock();
        s.busy = None;
        average(&mut s.step, took.as_secs_f64());
        for (seq, tokens) in left {
            if let Some(slot) = s.running.get_mut(seq) {
                *slot = Some(tokens);
            }
        }
    }
}

impl State {
    /// Replays the worker from `now`: it finishes what it is doing; each waiting request, in
    /// order, takes the sequence that frees first; the worker evaluates prompts one at a time
    /// between decode steps, and a prompt delays the steps of every request still running.
    fn wait(&self, now: Instant) -> Option<Duration> {
        let step = self.step?;
        let prompt_token = self.prompt_token.unwrap_or(0.0);
        let nanos = |seconds: f64| (seconds * 1e9) as u64;
        // When the worker is done with what it does now, and the steps still to come for a
        // request with `n` tokens left (the step under way gives one of them).
        let (mut worker, steps) = match self.busy {
            None => (0, 0),
            Some((work, until)) => (
                until.saturating_duration_since(now).as_nanos() as u64,
                usize::from(work == Work::Step),
            ),
        };
        // When each sequence is free, in nanoseconds from now.
        let mut free: Vec<u64> = self
            .running
            .iter()
            .map(|r| r.map_or(0, |n| worker + nanos(n.saturating_sub(steps) as f64 * step)))
            .collect();
        let soonest = |free: &[u64]| (0..free.len()).min_by_key(|&i| free[i]);
        for demand in &self.waiting {
            let seq = soonest(&free)?;
            let start = free[seq].max(worker);
            let prompt = nanos(demand.prompt as f64 * prompt_token);
            for f in free.iter_mut().filter(|f| **f > start) {
                *f += prompt;
            }
            worker = start + prompt;
            free[seq] = worker + nanos(demand.tokens.saturating_sub(1) as f64 * step);
        }
        let seq = soonest(&free)?;
        Some(Duration::from_nanos(free[seq].max(worker)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn limits(max_wait: Option<Duration>) -> QueueLimits {
        QueueLimits { depth: 8, max_wait }
    }

    fn demand(prompt: usize, tokens: usize) -> Demand {
        Demand { prompt, tokens }
    }

    #[test]
    fn nothing_is_predicted_before_a_step_was_measured() {
        let f = Forecast::new(2);
        f.start(Some((0, 10)));
        f.start(Some((1, 10)));
        assert_eq!(f.wait(), None);
        // Without a prediction only the depth applies.
        assert!(f
            .enqueue(demand(4, 4), limits(Some(MS)), || Ok::<(), ()>(()))
            .is_ok());
    }

    #[test]
    fn a_free_sequence_means_no_wait() {
        let f = Forecast::new(2);
        f.start(Some((0, 10)));
        f.stepped(10 * MS, [(0, 9)]);
        assert_eq!(f.wait(), Some(Duration::ZERO));
    }

    #[test]
    fn the_wait_is_the_soonest_end_of_a_running_request() {
        let f = Forecast::new(2);
        f.start(Some((0, 10)));
        f.start(Some((1, 10)));
        f.stepped(10 * MS, [(0, 7), (1, 3)]);
        assert_eq!(f.wait(), Some(30 * MS));
        f.end(1);
        assert_eq!(f.wait(), Some(Duration::ZERO));
    }

    #[test]
    fn waiting_requests_take_sequences_in_order_and_their_prompts_take_the_worker() {
        let f = Forecast::new(2);
        f.start(Some((0, 10)));
        f.start(Some((1, 10)));
        f.prompt(10, 10 * MS); // 1 ms a prompt token
        f.stepped(10 * MS, [(0, 5), (1, 2)]);
        let send = || Ok::<(), ()>(());
        // Sequence 1 frees after 20 ms; the first waiting request's prompt (5 ms) runs then,
        // which delays sequence 0's end to 55 ms, and it holds sequence 1 for 3 more steps
        // after its first token (20 + 5 + 30 = 55 ms).
        f.enqueue(demand(5, 4), limits(None), send).unwrap();
        assert_eq!(f.wait(), Some(55 * MS));
        // A second waiting request takes one of them at 55 ms; its prompt (1 ms) delays the
        // other, and it generates one token: its sequence is free again at 56 ms.
        f.enqueue(demand(1, 1), limits(None), send).unwrap();
        assert_eq!(f.wait(), Some(56 * MS));
        // The worker takes the first one into sequence 1 (4 tokens left: free at 40 ms); the
        // other waiting request gets it and frees it at 41 ms.
        f.end(1);
        f.start(Some((1, 4)));
        assert_eq!(f.wait(), Some(41 * MS));
    }

    #[test]
    fn a_request_predicted_to_wait_too_long_is_refused_and_not_counted() {
        let f = Forecast::new(1);
        f.start(Some((0, 32)));
        f.stepped(2 * MS, [(0, 20)]);
        let sent = std::cell::Cell::new(0);
        let send = || {
            sent.set(sent.get() + 1);
            Ok::<(), ()>(())
        };
        match f.enqueue(demand(4, 4), limits(Some(10 * MS)), send) {
            Err(Refused::TooLong {
                wait,
                limit,
                running,
                waiting,
            }) => {
                assert_eq!((wait, limit, running, waiting), (40 * MS, 10 * MS, 1, 0));
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(sent.get(), 0);
        // The running request nears its end: now it fits.
        f.stepped(2 * MS, [(0, 4)]);
        f.enqueue(demand(4, 4), limits(Some(10 * MS)), send)
            .unwrap();
        assert_eq!(sent.get(), 1);
    }

    #[test]
    fn a_request_the_queue_refuses_is_not_counted_as_waiting() {
        let f = Forecast::new(1);
        f.start(Some((0, 3)));
        f.stepped(MS, [(0, 3)]);
        assert!(matches!(
            f.enqueue(demand(1, 100), limits(None), || Err("full")),
            Err(Refused::Queue("full"))
        ));
        assert_eq!(f.wait(), Some(3 * MS));
    }

    #[test]
    fn the_work_under_way_counts_in_the_wait() {
        let f = Forecast::new(2);
        f.start(Some((0, 10)));
        f.stepped(10 * MS, [(0, 3)]);
        let now = Instant::now();
        let mut s = f.state.lock();
        // Sequence 1 is free, but the worker is in a step for 4 ms more.
        s.busy = Some((Work::Step, now + 4 * MS));
        assert_eq!(s.wait(now), Some(4 * MS));
        // Both run: the step under way gives sequence 0 one of its 3 tokens, 2 steps after.
        s.running[1] = Some(5);
        assert_eq!(s.wait(now), Some(24 * MS));
        // A prompt under way gives none.
        s.busy = Some((Work::Prompt, now + 4 * MS));
        assert_eq!(s.wait(now), Some(34 * MS));
        // A step past its estimate: about to end.
        s.busy = Some((Work::Step, now - MS));
        assert_eq!(s.wait(now), Some(20 * MS));
        drop(s);
        // The worker's reports set and clear it.
        f.end(1);
        f.stepped(Duration::from_secs(10), [(0, 3)]);
        f.stepping();
        assert!(f.wait().unwrap() > Duration::from_secs(1));
        f.stepped(Duration::from_secs(10), [(0, 2)]);
        assert_eq!(f.wait(), Some(Duration::ZERO));
        f.prompt(1, Duration::from_secs(10));
        f.prompting(1);
        assert!(f.wait().unwrap() > Duration::from_secs(1));
    }

    #[test]
    fn the_step_time_is_a_moving_average() {
        let f = Forecast::new(1);
        f.start(Some((0, 10)));
        f.stepped(10 * MS, [(0, 1)]);
        f.stepped(20 * MS, [(0, 1)]);
        // 10 + 0.2 × (20 − 10) = 12 ms a step.
        assert_eq!(f.wait(), Some(12 * MS));
    }
}
