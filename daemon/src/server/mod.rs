//! The resident daemon: the `spillway.v1` gRPC service over the engine, with `grpc.health.v1`
//! and server reflection.
//!
//! - [`listen`]: the Unix socket (default) or TCP listener.
//! - [`auth`]: bearer tokens for TCP.
//! - [`service`]: the service; requests are checked by [`validate`] before any compute.
//! - [`models`]: loading and the registry of loaded models; [`worker`]: one thread per model
//!   owning its engine, with a bounded queue; [`stats`]: what `Status` reports; [`profile`]:
//!   the `Profile` RPC's steps on the worker.
//! - [`device`]: `cpu`, `vulkan` or `vulkan:N`, and opening the Vulkan device; [`gpu`]: a
//!   model's worker on a Vulkan device (up to `--max-batch` requests sharing each decode step
//!   where the model's placement allows) and what `Status` reads of it.
//! - [`chat`]: chat messages to prompt text (the model's template, or ChatML); [`default_model`]: the model served when none is
//!   configured.
//!
//! Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING, new calls are refused, in-flight
//! calls get the grace period to finish and are then cancelled, and [`serve`] returns.

pub mod admission;
pub mod auth;
pub mod chat;
pub mod deadline;
pub mod default_model;
pub mod device;
pub mod gpu;
pub mod hardware;
pub mod listen;
pub mod models;
pub mod profile;
pub mod service;
pub mod stats;
mod step_share;
pub mod validate;
pub mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use spillway_proto::v1::spillway_server::SpillwayServer;
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::transport::Server;

use device::DeviceChoice;
use listen::Listener;
use models::LoadOptions;
use service::{DaemonState, ModelDefaults, SpillwayService};

/// Largest request message accepted; prompts have their own, smaller limit
/// ([`validate::MAX_PROMPT_BYTES`]).
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Where to listen.
#[derive(Debug, Clone, PartialEq)]
pub enum ListenAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

/// The daemon's configuration, validated from the command line.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: ListenAddr,
    /// Bearer token clients must send (TCP only).
    pub token: Option<String>,
    /// Models to load at start, with their names; empty: the default model.
    pub models: Vec<(String, PathBuf)>,
    /// Where the default model is written; needed when `models` is empty.
    pub cache_dir: Option<PathBuf>,
    pub defaults: ModelDefaults,
    /// How long in-flight calls may run on after a shutdown signal.
    pub grace: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("a daemon already listens on {}; stop it or use another --socket", .0.display())]
    AlreadyRunning(PathBuf),
    #[error("refusing to listen on {0} without --token-file: only loopback addresses may go without a token")]
    OpenWithoutToken(SocketAddr),
    #[error(
        "no cache directory for the default model: set XDG_CACHE_HOME or HOME, or pass --model"
    )]
    NoCacheDir,
    #[error(transparent)]
    DefaultModel(#[from] default_model::DefaultModelError),
    #[error("loading {name}: {message}")]
    Load { name: String, message: String },
    #[error("--device {choice}: {message}")]
    Device {
        choice: DeviceChoice,
        message: String,
    },
    #[error("reflection: {0}")]
    Reflection(String),
    #[error("the gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("installing the signal handlers: {0}")]
    Signals(std::io::Error),
}

/// Runs the daemon until SIGTERM or SIGINT. `on_ready` is called with the address clients use
/// once the listener is bound (models may still be loading).
pub async fn serve(config: ServeConfig, on_ready: impl FnOnce(&str)) -> Result<(), ServeError> {
    serve_with_signals(config, Signals::install()?, on_ready).await
}

/// [`serve`] with the signal handlers installed before (by a caller that had work to do
/// before serving, such as a first start's calibration, and listened for them meanwhile).
pub async fn serve_with_signals(
    config: ServeConfig,
    mut signals: Signals,
    on_ready: impl FnOnce(&str),
) -> Result<(), ServeError> {
    // Before binding: a device that does not exist stops the daemon with nothing to clean up.
    let mut defaults = config.defaults.clone();
    defaults.device = resolve_device(defaults.device)?;
    if defaults.device == DeviceChoice::Cpu {
        // The RAM budget bounds the routed experts computed on the CPU on either device.
        defaults.vram_budget = None;
    }
    let listener = match &config.listen {
        ListenAddr::Unix(path) => listen::bind_unix(path).await?,
        ListenAddr::Tcp(addr) => listen::bind_tcp(*addr, config.token.is_some()).await?,
    };
    let describe = listener.describe().unwrap_or_default();

    let (health, health_service) = tonic_health::server::health_reporter();
    let state = DaemonState::new(health, defaults);
    // NOT_SERVING until the start-up models are loaded.
    state
        .health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    state
        .health
        .set_service_status(
            service::SERVICE_NAME,
            tonic_health::ServingStatus::NotServing,
        )
        .await;

    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(spillway_proto::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let auth = auth::BearerAuth::new(config.token.clone());
    let spillway = SpillwayServer::new(SpillwayService::new(state.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let spillway =
        tonic::service::interceptor::InterceptedService::new(spillway, move |r| auth.check(r));
    let router = Server::builder()
        .add_service(health_service)
        .add_service(reflection)
        .add_service(spillway);

    let (stop_accepting, stopped) = tokio::sync::oneshot::channel::<()>();
    let stop_signal = async {
        let _ = stopped.await;
    };
    let server = match listener {
        Listener::Unix { listener, .. } => tokio::spawn(
            router.serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop_signal),
        ),
        Listener::Tcp(listener) => tokio::spawn(
            router.serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop_signal),
        ),
    };
    tracing::info!(addr = %describe, "listening");
    on_ready(&describe);

    let startup = load_startup_models(&state, &config);
    let interrupted = tokio::select! {
        r = startup => r.map(|()| None),
        sig = signals.next() => Ok(Some(sig)),
    };
    match interrupted {
        Err(e) => {
            let _ = stop_accepting.send(());
            let _ = server.await;
            cleanup(&config);
            return Err(e);
        }
        Ok(Some(sig)) => tracing::info!("{sig} during start-up: shutting down"),
        Ok(None) => {
            state.update_health().await;
            tracing::info!("ready");
            let sig = signals.next().await;
            tracing::info!("{sig}: shutting down");
        }
    }

    // Refuse new calls and stop accepting connections; in-flight calls run on for the grace.
    state.draining.store(true, Ordering::SeqCst);
    state.update_health().await;
    let _ = stop_accepting.send(());
    let mut server = server;
    let finished = tokio::time::timeout(config.grace, &mut server).await;
    if finished.is_err() {
        tracing::warn!(
            grace_s = config.grace.as_secs_f64(),
            "in-flight calls outlived the grace period: cancelling them"
        );
        state.shutdown.cancel();
        // Cancelled streams end within a decode step; do not wait on a stuck client forever.
        let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    }
    state.shutdown.cancel();
    // Every model's thread ends, and its engine is dropped, before the process exits.
    let models = state.registry.drain();
    let _ = tokio::task::spawn_blocking(move || {
        for m in models {
            m.worker.stop_and_join();
        }
    })
    .await;
    cleanup(&config);
    tracing::info!("stopped");
    Ok(())
}

async fn load_startup_models(
    state: &Arc<DaemonState>,
    config: &ServeConfig,
) -> Result<(), ServeError> {
    let mut models = config.models.clone();
    if models.is_empty() {
        let dir = config.cache_dir.clone().ok_or(ServeError::NoCacheDir)?;
        let path = tokio::task::spawn_blocking(move || default_model::ensure(&dir))
            .await
            .map_err(|e| ServeError::Load {
                name: default_model::MODEL_NAME.into(),
                message: e.to_string(),
            })??;
        models.push((default_model::MODEL_NAME.into(), path));
    }
    for (name, path) in models {
        let options = LoadOptions {
            name: name.clone(),
            path,
            context: state.defaults.context,
            threads: state.defaults.threads,
            queue: state.defaults.queue,
            max_batch: state.defaults.max_batch,
            device: state.defaults.device,
            vram_budget: state.defaults.vram_budget,
            ram_budget: state.defaults.ram_budget,
            predict_experts: state.defaults.predict_experts,
            expert_layout: state.defaults.expert_layout.clone(),
            moe_miss: state.defaults.moe_miss,
            bus_rows: state.defaults.bus_rows,
            step_batching: state.defaults.step_batching,
            prompt_steps: state.defaults.prompt_steps,
            pins: Vec::new(),
            hardware: state.defaults.hardware.get(),
        };
        state
            .load_model(options, |_| {})
            .await
            .map_err(|status| ServeError::Load {
                name,
                message: status.message().to_string(),
            })?;
    }
    Ok(())
}

/// The daemon's `--device`: a Vulkan device it can open, or the CPU, said once in the log, when
/// Vulkan is not usable here at all. A device index the machine does not have is an error.
fn resolve_device(choice: DeviceChoice) -> Result<DeviceChoice, ServeError> {
    let DeviceChoice::Vulkan(index) = choice else {
        return Ok(choice);
    };
    match device::open_vulkan(index) {
        Ok(d) => {
            tracing::info!(device = %device::describe(&d), "models run on the GPU");
            Ok(choice)
        }
        Err(e @ device::OpenError::NoSuchDevice { .. }) => Err(ServeError::Device {
            choice,
            message: e.to_string(),
        }),
        Err(e) => {
            tracing::warn!("--device {choice}: {e}; serving on the CPU instead");
            Ok(DeviceChoice::Cpu)
        }
    }
}

fn cleanup(config: &ServeConfig) {
    if let ListenAddr::Unix(path) = &config.listen {
        let _ = std::fs::remove_file(path);
    }
}

/// SIGTERM and SIGINT, listened for from [`Signals::install`] on (inside a Tokio runtime).
pub struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    pub fn install() -> Result<Signals, ServeError> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate()).map_err(ServeError::Signals)?,
            int: signal(SignalKind::interrupt()).map_err(ServeError::Signals)?,
        })
    }

    /// The next signal's name.
    pub async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
