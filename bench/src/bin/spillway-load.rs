//! A bounded load test of `spillwayd serve` on a Unix socket: more concurrent streams than the
//! model admits (running plus queued), for a while, with a share of them cancelled at random
//! points. Reports how the excess was refused (status code and how fast), the admitted
//! streams' time to first token against an idle daemon's, the daemon's memory over the run,
//! and that it is idle and serving afterwards.
//!
//! `spillway-load --spillwayd PATH [--seconds 60] [--clients 16] [--queue-depth 4]
//! [--max-batch 4] [--max-tokens 32] [--cancel 0.25] [--threads N] [-- SERVE_ARGS...]`
//!
//! It starts its own daemon (default model, a temporary socket and cache) so that the queue
//! and batch sizes are known, and stops it at the end. Timings are printed, never asserted.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use hyper_util::rt::TokioIo;
use spillway_proto::v1 as pb;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::Code;

#[derive(Parser)]
#[command(about = "Bounded load test of spillwayd over its Unix socket")]
struct Args {
    /// The daemon binary.
    #[arg(long)]
    spillwayd: PathBuf,
    /// How long the load runs.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Concurrent clients, each sending one request after another.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    #[arg(long, default_value_t = 4)]
    queue_depth: usize,
    #[arg(long, default_value_t = 4)]
    max_batch: usize,
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Share of admitted streams dropped after a random number of tokens.
    #[arg(long, default_value_t = 0.25)]
    cancel: f64,
    #[arg(long)]
    threads: Option<usize>,
    /// Idle requests measured before the load, one at a time (enough that their p99 is not
    /// just their slowest).
    #[arg(long, default_value_t = 200)]
    idle_requests: usize,
    /// More arguments for `spillwayd serve`.
    #[arg(last = true)]
    serve_args: Vec<String>,
}

async fn unix_channel(path: &Path) -> anyhow::Result<Channel> {
    UnixStream::connect(path).await?;
    let path = path.to_path_buf();
    Ok(Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await?)
}

type Client = pb::spillway_client::SpillwayClient<Channel>;

/// How one request ended.
#[derive(Debug, Clone)]
enum Outcome {
    /// Streamed to the end: time to first token, tokens.
    Done { ttft: Duration, tokens: u32 },
    /// Dropped by us after `tokens`.
    Cancelled { tokens: u32 },
    /// Refused before any token: the code and how long after sending it came.
    Refused { code: Code, after: Duration },
    /// Failed after some tokens.
    Failed { code: Code, tokens: u32 },
}

/// A deterministic generator (xorshift) for prompts and cancel points.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

async fn one_request(
    client: &mut Client,
    rng: &mut Rng,
    max_tokens: u32,
    cancel_share: f64,
) -> Outcome {
    let ids: Vec<u32> = (0..8).map(|_| 10 + (rng.next() % 1000) as u32).collect();
    let cancel_at =
        (rng.unit() < cancel_share).then(|| 1 + (rng.next() % u64::from(max_tokens)) as u32);
    let req = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Tokens(pb::TokenIds { ids })),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let sent = Instant::now();
    let mut stream = match client.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(s) => {
            return Outcome::Refused {
                code: s.code(),
                after: sent.elapsed(),
            }
        }
    };
    let mut ttft = None;
    let mut tokens = 0;
    loop {
        match stream.message().await {
            Ok(Some(_)) => {
                ttft.get_or_insert_with(|| sent.elapsed());
                tokens += 1;
                if cancel_at == Some(tokens) {
                    return Outcome::Cancelled { tokens };
                }
            }
            Ok(None) => {
                return Outcome::Done {
                    ttft: ttft.unwrap_or_default(),
                    tokens,
                }
            }
            Err(s) if ttft.is_none() => {
                return Outcome::Refused {
                    code: s.code(),
                    after: sent.elapsed(),
                }
            }
            Err(s) => {
                return Outcome::Failed {
                    code: s.code(),
                    tokens,
                }
            }
        }
    }
}

/// "3 × Unavailable, ..." or "none".
fn counts<'a>(codes: impl Iterator<Item = &'a Code>) -> String {
    let mut by: Vec<(Code, usize)> = Vec::new();
    for &c in codes {
        match by.iter_mut().find(|(k, _)| *k == c) {
            Some(e) => e.1 += 1,
            None => by.push((c, 1)),
        }
    }
    if by.is_empty() {
        return "none".into();
    }
    by.iter()
        .map(|(c, n)| format!("{n} × {c:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = std::env::temp_dir().join(format!("spillway-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("spillway.sock");
    let mut cmd = Command::new(&args.spillwayd);
    cmd.arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--queue-depth", &args.queue_depth.to_string()])
        .args(["--max-batch", &args.max_batch.to_string()])
        .args(["--grace-period", "1"])
        .args(&args.serve_args)
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("daemon.log"))?);
    if let Some(t) = args.threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    let mut daemon = Daemon(cmd.spawn().context("starting spillwayd")?);
    let pid = daemon.0.id();
    let start = Instant::now();
    let channel = loop {
        if let Ok(ch) = unix_channel(&socket).await {
            // Listening comes before the default model is loaded.
            let mut c = Client::new(ch.clone());
            let listed = c.list_models(pb::ListModelsRequest {}).await;
            if listed.is_ok_and(|l| !l.get_ref().models.is_empty()) {
                break ch;
            }
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!(
                "the daemon did not start; see {}",
                dir.join("daemon.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    // Idle: one request at a time.
    let mut client = Client::new(channel.clone());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    one_request(&mut client, &mut rng, args.max_tokens, 0.0).await; // warm-up
    let mut idle = Vec::new();
    for _ in 0..args.idle_requests {
        if let Outcome::Done { ttft, .. } =
            one_request(&mut client, &mut rng, args.max_tokens, 0.0).await
        {
            idle.push(ttft.as_secs_f64() * 1e3);
        }
    }
    let rss_before = rss_kib(pid);

    // Load: `clients` tasks, each sending requests back to back until the time is up.
    let stop = Arc::new(AtomicBool::new(false));
    let outcomes: Arc<Mutex<Vec<Outcome>>> = Arc::default();
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let (stop, outcomes, channel) = (stop.clone(), outcomes.clone(), channel.clone());
        let (max_tokens, cancel) = (args.max_tokens, args.cancel);
        tasks.push(tokio::spawn(async move {
            let mut client = Client::new(channel);
            let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ ((c as u64 + 1) * 0x9e37_79b9));
            while !stop.load(Ordering::Relaxed) {
                let o = one_request(&mut client, &mut rng, max_tokens, cancel).await;
                if let Outcome::Refused { .. } = o {
                    // Back off a little, as a client told to retry later would.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                outcomes.lock().unwrap().push(o);
            }
        }));
    }
    let mut rss = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < args.seconds {
        tokio::time::sleep(Duration::from_secs(1)).await;
        rss.extend(rss_kib(pid));
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let wall = t0.elapsed().as_secs_f64();

    // Afterwards: idle again, and serving.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let status = client.status(pb::StatusRequest {}).await?.into_inner();
    let queued: u32 = status.models.iter().map(|m| m.queue_depth).sum();
    let after = one_request(&mut client, &mut rng, args.max_tokens, 0.0).await;
    let rss_after = rss_kib(pid);

    let outcomes = outcomes.lock().unwrap().clone();
    let (mut ttft, mut refused_ms, mut codes) = (Vec::new(), Vec::new(), Vec::new());
    let (mut done, mut cancelled, mut tokens) = (0, 0, 0u64);
    let mut failed = Vec::new();
    for o in &outcomes {
        match o {
            Outcome::Done { ttft: t, tokens: n } => {
                done += 1;
                tokens += u64::from(*n);
                ttft.push(t.as_secs_f64() * 1e3);
            }
            Outcome::Cancelled { tokens: n } => {
                cancelled += 1;
                tokens += u64::from(*n);
            }
            Outcome::Refused { code, after } => {
                refused_ms.push(after.as_secs_f64() * 1e3);
                codes.push(*code);
            }
            Outcome::Failed { code, tokens: n } => {
                failed.push(*code);
                tokens += u64::from(*n);
            }
        }
    }
    let exhausted = codes
        .iter()
        .filter(|&&c| c == Code::ResourceExhausted)
        .count();
    let (idle_p50, idle_p99) = (percentile(&mut idle, 0.5), percentile(&mut idle, 0.99));
    let (load_p50, load_p99) = (percentile(&mut ttft, 0.5), percentile(&mut ttft, 0.99));
    println!(
        "load: {} clients for {wall:.1} s against max batch {} + queue {} (max tokens {}, {:.0}% cancelled at random)",
        args.clients, args.max_batch, args.queue_depth, args.max_tokens, 100.0 * args.cancel
    );
    println!(
        "requests: {} done, {cancelled} cancelled by the client, {} refused ({exhausted} RESOURCE_EXHAUSTED, others {}), {} failed after a token ({})",
        done,
        codes.len(),
        counts(codes.iter().filter(|&&c| c != Code::ResourceExhausted)),
        failed.len(),
        counts(failed.iter())
    );
    println!(
        "refusals: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms after sending",
        percentile(&mut refused_ms, 0.5),
        percentile(&mut refused_ms, 0.99),
        refused_ms.iter().copied().fold(0.0, f64::max)
    );
    println!(
        "time to first token: idle p50 {idle_p50:.1} ms, p99 {idle_p99:.1} ms; under load p50 {load_p50:.1} ms, p99 {load_p99:.1} ms ({:.2}x idle p99)",
        load_p99 / idle_p99
    );
    println!(
        "tokens: {tokens} in {wall:.1} s, {:.1} tok/s aggregate",
        tokens as f64 / wall
    );
    let mib = |k: Option<u64>| k.map_or(f64::NAN, |k| k as f64 / 1024.0);
    println!(
        "daemon RSS: {:.1} MiB before the load, {:.1}-{:.1} MiB during it, {:.1} MiB after",
        mib(rss_before),
        mib(rss.iter().copied().min()),
        mib(rss.iter().copied().max()),
        mib(rss_after)
    );
    println!(
        "afterwards: {queued} queued, a new request {}",
        match after {
            Outcome::Done { tokens, .. } => format!("streamed {tokens} tokens"),
            other => format!("ended {other:?}"),
        }
    );
    // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let code = daemon.0.wait()?.code();
    println!("daemon exit status after SIGTERM: {code:?}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
