//! A real `spillwayd serve` process on a Unix socket in a temporary directory, and gRPC
//! clients for it, for end-to-end tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::synth::{SynthModel, WeightType};
use spillway_proto::v1 as pb;
use spillway_proto::v1::spillway_client::SpillwayClient;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Longest wait for a daemon to come up or go down; only reached when something is broken.
pub const PATIENCE: Duration = Duration::from_secs(120);

/// The tiny synthetic MoE model every test loads, written once per test binary.
pub fn test_model() -> &'static Path {
    static MODEL: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, path) = MODEL.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny-qwen3moe-q8_0.gguf");
        SynthModel::from_name("tiny-qwen3moe", WeightType::Uniform(GgmlType::Q8_0), 7)
            .unwrap()
            .write(&path, false, |_, _| {})
            .unwrap();
        (dir, path)
    });
    path
}

pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    /// What the daemon printed on stderr (collected by a thread).
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Daemon {
    /// Starts `spillwayd serve --socket DIR/s.sock` with `args`, and waits until it is SERVING.
    pub async fn start(args: &[&str]) -> Daemon {
        let d = Daemon::spawn(args, &[]);
        d.wait_serving().await;
        d
    }

    /// Starts `spillwayd serve` serving the test model with `args`.
    pub async fn with_test_model(args: &[&str]) -> Daemon {
        let model = test_model().to_str().unwrap().to_string();
        let mut all = vec!["--model", &model];
        all.extend_from_slice(args);
        Daemon::start(&all).await
    }

    /// Starts the process without waiting; `env` is added to its environment.
    pub fn spawn(args: &[&str], env: &[(&str, &Path)]) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("s.sock");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_spillwayd"));
        cmd.arg("serve");
        if !args.contains(&"--listen") {
            cmd.arg("--socket").arg(&socket);
        }
        cmd.args(["--threads", "1", "--log-level", "debug"]);
        // Calibrating at first start takes a minute on lavapipe; the test that checks it asks.
        if !args.contains(&"--calibrate") {
            cmd.args(["--calibrate", "never"]);
        }
        cmd.args(args)
            .env_remove("RUST_LOG")
            .env("XDG_CACHE_HOME", dir.path().join("cache"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spillwayd starts");
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Daemon {
            child,
            dir,
            socket,
            log,
        }
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    pub async fn wait_serving(&self) {
        let start = Instant::now();
        loop {
            if let Ok(ch) = self.try_channel().await {
                let status = HealthClient::new(ch)
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await;
                if status.is_ok_and(|s| s.get_ref().status == ServingStatus::Serving as i32) {
                    return;
                }
            }
            assert!(
                start.elapsed() < PATIENCE,
                "the daemon never became SERVING; its log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn try_channel(&self) -> Result<Channel, Box<dyn std::error::Error>> {
        unix_channel(&self.socket).await
    }

    pub async fn channel(&self) -> Channel {
        self.try_channel().await.expect("connects to the daemon")
    }

    pub async fn client(&self) -> SpillwayClient<Channel> {
        SpillwayClient::new(self.channel().await)
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
        let rc = unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        assert_eq!(rc, 0, "SIGTERM delivered");
    }

    /// Waits for the process to exit.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(start.elapsed() < PATIENCE, "the daemon did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A gRPC channel over the Unix socket at `path`.
pub async fn unix_channel(path: &Path) -> Result<Channel, Box<dyn std::error::Error>> {
    UnixStream::connect(path).await?;
    let path = path.to_path_buf();
    let ch = Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await?;
    Ok(ch)
}

/// LoadModel's `pins` from (pattern, placement) pairs.
pub fn tensor_pins(pins: &[(&str, &str)]) -> Vec<pb::TensorPin> {
    pins.iter()
        .map(|(pattern, placement)| pb::TensorPin {
            pattern: pattern.to_string(),
            placement: placement.to_string(),
        })
        .collect()
}

/// LoadModel, waiting for its progress stream to say the model is ready.
pub async fn load_model(
    client: &mut SpillwayClient<Channel>,
    req: pb::LoadModelRequest,
) -> Result<(), tonic::Status> {
    let mut progress = client.load_model(req).await?.into_inner();
    while let Some(p) = progress.message().await? {
        if p.ready {
            return Ok(());
        }
    }
    panic!("the load stream ended before the model was ready");
}

/// Streams `req` until it ends: the tokens streamed, and how the stream ended (a failed call
/// is an error with no tokens).
pub async fn stream_until_end(
    client: &mut SpillwayClient<Channel>,
    req: tonic::Request<pb::GenerateRequest>,
) -> (Vec<u32>, Result<(), tonic::Status>) {
    let mut tokens = Vec::new();
    let mut stream = match client.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(e) => return (tokens, Err(e)),
    };
    loop {
        match stream.message().await {
            Ok(Some(m)) => tokens.push(m.token),
            Ok(None) => return (tokens, Ok(())),
            Err(e) => return (tokens, Err(e)),
        }
    }
}

/// Streams `req` to its end: every message's token, and the last one's finish reason.
pub async fn stream_tokens(
    client: &mut SpillwayClient<Channel>,
    req: pb::GenerateRequest,
) -> (Vec<u32>, i32) {
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let (mut tokens, mut finish) = (Vec::new(), 0);
    while let Some(m) = stream.message().await.unwrap() {
        tokens.push(m.token);
        finish = m.finish_reason;
    }
    (tokens, finish)
}
