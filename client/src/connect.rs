//! Reaching the daemon: a Unix socket path or an `http://host:port` address, with an optional
//! bearer token; on the default socket, a daemon that is not running is started.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use spillway_proto::endpoint::default_socket_path;
use spillway_proto::v1::spillway_client::SpillwayClient;
use tokio::net::UnixStream;
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::exit::Failure;

/// How long to wait for a daemon this client started to report SERVING (it may first write the
/// default model).
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// Where the daemon is.
#[derive(Debug, Clone, PartialEq)]
pub enum Addr {
    Unix(PathBuf),
    Http(String),
}

impl Addr {
    /// `http://…`/`https://…` is TCP; anything else is a socket path.
    pub fn parse(s: &str) -> Addr {
        if s.starts_with("http://") || s.starts_with("https://") {
            Addr::Http(s.to_string())
        } else {
            Addr::Unix(PathBuf::from(s))
        }
    }
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Addr::Unix(p) => write!(f, "{}", p.display()),
            Addr::Http(u) => f.write_str(u),
        }
    }
}

/// Adds `authorization: Bearer …` to every call when a token is configured.
#[derive(Clone)]
pub struct Auth(Option<MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            r.metadata_mut().insert("authorization", v.clone());
        }
        Ok(r)
    }
}

pub type Client = SpillwayClient<InterceptedService<Channel, Auth>>;

/// Connects to `addr`, or to the default socket, starting `spillwayd serve` there when nothing
/// answers and `autostart` allows it.
pub async fn connect(
    addr: Option<&str>,
    token_file: Option<&Path>,
    autostart: bool,
) -> Result<Client, Failure> {
    let token = match token_file {
        Some(path) => Some(read_token(path)?),
        None => None,
    };
    let (addr, is_default) = match addr {
        Some(a) => (Addr::parse(a), false),
        None => (Addr::Unix(default_socket_path()), true),
    };
    let channel = match channel(&addr).await {
        Ok(c) => c,
        Err(e) if is_default && autostart => {
            let Addr::Unix(path) = &addr else {
                unreachable!("the default address is a socket")
            };
            start_daemon(path)?;
            wait_until_serving(&addr, START_TIMEOUT)
                .await
                .map_err(|why| {
                    Failure::unreachable(format!(
                        "started spillwayd, but it did not become ready on {addr}: {why}"
                    ))
                })?;
            channel(&addr).await.map_err(|_| e)?
        }
        Err(e) => return Err(e),
    };
    Ok(SpillwayClient::with_interceptor(channel, Auth(token)).max_decoding_message_size(16 << 20))
}

async fn channel(addr: &Addr) -> Result<Channel, Failure> {
    let unreachable = |e: &dyn std::fmt::Display| {
        Failure::unreachable(format!(
            "no daemon answers on {addr}: {e}. Start one with `spillwayd serve`{}",
            match addr {
                Addr::Unix(_) => "",
                Addr::Http(_) => " --listen ADDR",
            }
        ))
    };
    match addr {
        Addr::Http(url) => {
            let endpoint = Endpoint::from_shared(url.clone())
                .map_err(|e| Failure::usage(format!("--addr {url}: {e}")))?;
            endpoint.connect().await.map_err(|e| unreachable(&e))
        }
        Addr::Unix(path) => {
            // Fail fast with the real reason (no socket, refused) rather than tonic's.
            UnixStream::connect(path)
                .await
                .map_err(|e| unreachable(&e))?;
            let path = path.clone();
            // The URI is required by the API but unused: the connector dials the socket.
            Endpoint::from_static("http://[::1]:50051")
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move {
                        Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?))
                    }
                }))
                .await
                .map_err(|e| unreachable(&e))
        }
    }
}

fn read_token(path: &Path) -> Result<MetadataValue<tonic::metadata::Ascii>, Failure> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Failure::usage(format!("reading --token-file {}: {e}", path.display())))?;
    let token = text.lines().next().unwrap_or("").trim();
    if token.is_empty() {
        return Err(Failure::usage(format!(
            "--token-file {} is empty",
            path.display()
        )));
    }
    format!("Bearer {token}")
        .parse()
        .map_err(|_| Failure::usage("the token has characters a header cannot carry"))
}

/// `spillwayd` next to this executable, else on PATH.
fn find_daemon() -> Option<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("spillwayd")))
        .filter(|p| p.is_file());
    beside.or_else(|| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("spillwayd"))
                .find(|p| p.is_file())
        })
    })
}

/// Starts `spillwayd serve --socket PATH` in the background, its log next to the socket.
fn start_daemon(socket: &Path) -> Result<(), Failure> {
    let exe = find_daemon().ok_or_else(|| {
        Failure::unreachable(format!(
            "no daemon answers on {} and spillwayd is neither next to this program nor on PATH; \
             install it or start it yourself with `spillwayd serve`",
            socket.display()
        ))
    })?;
    let log_path = socket.with_extension("log");
    if let Some(dir) = socket.parent() {
        use std::os::unix::fs::DirBuilderExt;
        let _ = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir);
    }
    let log = std::fs::File::create(&log_path).map_err(|e| {
        Failure::unreachable(format!(
            "creating the daemon's log {}: {e}",
            log_path.display()
        ))
    })?;
    let child = Command::new(&exe)
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| Failure::unreachable(format!("starting {}: {e}", exe.display())))?;
    eprintln!(
        "spillway: no daemon was running; started {} serve (pid {}), log in {}",
        exe.display(),
        child.id(),
        log_path.display()
    );
    Ok(())
}

/// Polls the health service until it reports SERVING.
pub async fn wait_until_serving(addr: &Addr, timeout: Duration) -> Result<(), String> {
    let start = Instant::now();
    let mut last = String::from("no answer");
    while start.elapsed() < timeout {
        if let Ok(ch) = channel(addr).await {
            let mut health = HealthClient::new(ch);
            match health
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
            {
                Ok(r) if r.get_ref().status == ServingStatus::Serving as i32 => return Ok(()),
                Ok(r) => last = format!("health is {:?}", r.get_ref().status()),
                Err(s) => last = s.message().to_string(),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_sockets_unless_they_are_urls() {
        assert_eq!(Addr::parse("/run/x.sock"), Addr::Unix("/run/x.sock".into()));
        assert_eq!(Addr::parse("x.sock"), Addr::Unix("x.sock".into()));
        assert_eq!(
            Addr::parse("http://127.0.0.1:5"),
            Addr::Http("http://127.0.0.1:5".into())
        );
    }
}
