//! `spillwayd serve`: the resident daemon. Parses and checks the command line into a
//! [`ServeConfig`], sets up logging and runs the server until SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use spillway_daemon::gpu::forward::StepBatching;
use spillway_daemon::gpu::placement::MoeMiss;
use spillway_daemon::server::admission::QueueLimits;
use spillway_daemon::server::auth::read_token_file;
use spillway_daemon::server::default_model;
use spillway_daemon::server::device::DeviceChoice;
use spillway_daemon::server::hardware::HardwareCell;
use spillway_daemon::server::models::name_from_path;
use spillway_daemon::server::models::LayoutChoice;
use spillway_daemon::server::service::ModelDefaults;
use spillway_daemon::server::{serve_with_signals, ListenAddr, ServeConfig, Signals};
use spillway_proto::endpoint::default_socket_path;
use spillway_sched::profile::HardwareProfile;
use spillway_sched::ByteSize;

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// GGUF model to load at start (repeatable), as PATH or NAME=PATH; the first is the default
    /// model. Without any, a small synthetic MoE model is written to the cache directory on
    /// first start and served as `default`.
    #[arg(long = "model", value_name = "[NAME=]PATH")]
    pub models: Vec<String>,
    /// Unix socket to listen on [default: $XDG_RUNTIME_DIR/spillway.sock, or
    /// /tmp/spillway-$UID/spillway.sock].
    #[arg(long, conflicts_with = "listen")]
    pub socket: Option<PathBuf>,
    /// Listen on TCP at this address instead (e.g. 127.0.0.1:50051). Addresses other than
    /// loopback need --token-file.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// File whose first line is the bearer token TCP clients must send.
    #[arg(long, requires = "listen")]
    pub token_file: Option<PathBuf>,
    /// Kernel threads per model (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV cache positions per model (default: the model's context, at most 4096).
    #[arg(long, default_value_t = 0)]
    pub ctx: usize,
    /// Requests that may wait per model while --max-batch run; more are refused with
    /// RESOURCE_EXHAUSTED. 0 admits only requests that start at the next step.
    #[arg(long, default_value_t = 8)]
    pub queue_depth: usize,
    /// Queue a request only when it is predicted to wait at most this many milliseconds for a
    /// free sequence (from the measured step and prompt times and the most tokens each running
    /// and waiting request may generate); others are refused at once with RESOURCE_EXHAUSTED.
    /// Keeps the admitted requests' time to first token near an idle daemon's under load.
    /// Default: no limit but --queue-depth.
    #[arg(long, value_name = "MS")]
    pub max_queue_wait_ms: Option<f64>,
    /// Requests per model decoded together, sharing each decode step (each has its own KV
    /// cache of --ctx positions). On a Vulkan device, where a step can take them together
    /// (every layer on the GPU; experts not in VRAM read over the bus or run on the CPU);
    /// otherwise one. There the caches count against --vram-budget: 1 leaves the most VRAM to
    /// the weights.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub max_batch: u16,
    /// Where models run: `cpu`, `vulkan` (the preferred Vulkan device) or `vulkan:N` (device N
    /// of `spillwayd devices`). Without a usable Vulkan driver or device the daemon says so and
    /// serves on the CPU.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Ceiling on the device memory each model may take with `--device vulkan` (e.g. 512MiB,
    /// 8G). A MoE model over it keeps as many routed experts per layer in VRAM as fit.
    #[arg(long)]
    pub vram_budget: Option<ByteSize>,
    /// RAM for the routed experts each MoE model computes on the CPU (all of them on the CPU,
    /// those not in VRAM on a Vulkan device), e.g. 4GiB: a cache that reads the others from the
    /// model file (io_uring, O_DIRECT) as tokens need them, so a model larger than RAM runs.
    /// Without it they are read through the memory map.
    #[arg(long)]
    pub ram_budget: Option<ByteSize>,
    /// With `--device cpu --ram-budget`: while a decode step computes a layer, read the
    /// experts the next layer's router picks for the current hidden state (while at least 60%
    /// of such predictions are right), as `spillwayd run --predict-experts` does. Off by
    /// default (`bench/RESULTS.md`: on the synthetic models measured the wrong reads cost the
    /// disk what the right ones gained).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub predict_experts: bool,
    /// How each MoE model over --vram-budget spreads its expert slots over the layers: `even`,
    /// `layers` (whole layers from the last back, as llama.cpp's --n-cpu-moe), `cpu` (one slot a
    /// layer) or `planned` (the scheduler's plan on --hardware-profile, which LoadModel's pins
    /// also use).
    #[arg(long, default_value = "even")]
    pub expert_layout: LayoutChoice,
    /// A routed expert of a MoE model over --vram-budget that is not in VRAM: `cpu` computes it
    /// on the CPU while the GPU runs the others, `fetch` copies it into a VRAM slot first,
    /// `pcie` keeps every routed expert in system RAM too and has the GPU read the missing ones
    /// over the bus, `split` shares each layer's misses between the CPU and the bus (one
    /// request at a time); `auto`: on a GPU across a bus with RAM for the experts, `pcie`, or
    /// `cpu` where the VRAM budget holds under a sixteenth of the experts (`split` with
    /// `--max-batch 1`); else `cpu`.
    #[arg(long, default_value = "auto")]
    pub moe_miss: MoeMiss,
    /// A dense model over --vram-budget runs its first layers on the CPU; with this, each
    /// decode product of those layers is shared with the GPU, which reads its rows from a copy
    /// of them in system RAM over the bus while the CPU computes the rest (the shares balanced
    /// as they run). The copy takes those layers' size in RAM.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub bus_rows: bool,
    /// Whether a newly admitted request's prompt goes into the running requests' decode steps,
    /// a few tokens a step, on a Vulkan device where a MoE model's misses run on the CPU (its
    /// steps and prompt chunks are then the same size); `false`: each prompt runs whole
    /// before its request joins the steps.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub prompt_steps: bool,
    /// How a decode step of several requests on a Vulkan device runs: `measured` (batched or a
    /// request at a time, whichever has been measured cheaper for that model) or `always`
    /// (batched wherever the model can take the requests together).
    #[arg(long, default_value = "measured")]
    pub step_batching: StepBatching,
    /// Seconds in-flight requests may run on after SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 10.0)]
    pub grace_period: f64,
    /// The machine's hardware profile, for the predicted times and bandwidth limits of
    /// `spillway profile`: a TOML file from `spillwayd calibrate`, or a shipped one (laptop-8gb,
    /// desktop-24gb, h200). Default with --device vulkan: this machine's stored profile, or one
    /// calibrated at first start (see --calibrate); with --device cpu, the one profile stored
    /// in the cache directory, if there is exactly one; else profiles carry no predictions.
    #[arg(long, value_name = "FILE|NAME")]
    pub hardware_profile: Option<String>,
    /// With `--device vulkan` and no --hardware-profile: `auto` uses the profile stored for
    /// this GPU, driver and CPU, or calibrates one at this first start (about ten seconds on a
    /// GPU, with progress; longer on a software device) and stores it; `never` does not
    /// measure.
    #[arg(long, value_enum, default_value_t = Calibrate::Auto)]
    pub calibrate: Calibrate,
    /// Log level or filter (`info`, `debug`, `spillway_daemon=trace`); RUST_LOG wins when set.
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Calibrate {
    Auto,
    Never,
}

impl ServeArgs {
    /// Checks the arguments once into the daemon's configuration.
    fn config(&self) -> anyhow::Result<ServeConfig> {
        let listen = match (&self.listen, &self.socket) {
            (Some(addr), _) => ListenAddr::Tcp(*addr),
            (None, Some(path)) => ListenAddr::Unix(path.clone()),
            (None, None) => ListenAddr::Unix(default_socket_path()),
        };
        let token = match &self.token_file {
            Some(path) => Some(
                read_token_file(path)
                    .with_context(|| format!("reading the token file {}", path.display()))?,
            ),
            None => None,
        };
        if self.vram_budget.is_some() && self.device == DeviceChoice::Cpu {
            bail!("--vram-budget applies to --device vulkan, not cpu");
        }
        if self
            .max_queue_wait_ms
            .is_some_and(|ms| !(ms.is_finite() && ms >= 0.0))
        {
            bail!("--max-queue-wait-ms must be a number of milliseconds, 0 or more");
        }
        if !(self.grace_period.is_finite() && self.grace_period >= 0.0) {
            bail!("--grace-period must be a number of seconds, 0 or more");
        }
        let models = self
            .models
            .iter()
            .map(|m| match m.split_once('=') {
                Some((name, path)) if !name.is_empty() && !name.contains('/') => {
                    (name.to_string(), PathBuf::from(path))
                }
                _ => (name_from_path(m.as_ref()), PathBuf::from(m)),
            })
            .collect();
        let cache_dir = default_model::env_cache_dir();
        let (hardware, store) = match (&self.hardware_profile, self.device, cache_dir.as_deref()) {
            (None, DeviceChoice::Vulkan(index), Some(cache))
                if self.calibrate == Calibrate::Auto =>
            {
                first_start_profile(index, cache)
            }
            _ => hardware_profile(self.hardware_profile.as_deref(), cache_dir.as_deref())?,
        }
        .map_or((None, None), |(p, store)| (Some(Arc::new(p)), store));
        let hardware = HardwareCell::new(hardware, store);
        Ok(ServeConfig {
            listen,
            token,
            models,
            cache_dir,
            defaults: ModelDefaults {
                threads: self
                    .threads
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
                    .max(1),
                queue: QueueLimits {
                    depth: self.queue_depth,
                    max_wait: self
                        .max_queue_wait_ms
                        .map(|ms| Duration::from_secs_f64(ms / 1e3)),
                },
                max_batch: self.max_batch as usize,
                context: self.ctx,
                device: self.device,
                vram_budget: self.vram_budget.map(|b| b.0),
                ram_budget: self.ram_budget.map(|b| b.0),
                predict_experts: self.predict_experts,
                hardware,
                expert_layout: self.expert_layout.clone(),
                moe_miss: self.moe_miss,
                bus_rows: self.bus_rows,
                step_batching: self.step_batching,
                prompt_steps: self.prompt_steps,
            },
            grace: Duration::from_secs_f64(self.grace_period),
        })
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    init_logging(&args.log_level)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .thread_name("spillwayd-rpc")
        .build()
        .context("starting the async runtime")?;
    // The signals are listened for from the start: a first start's calibration takes seconds,
    // and SIGTERM or SIGINT then ends the daemon at once with status 0. Nothing serves yet and
    // nothing is half written (a profile is stored whole or not at all; the next start
    // removes the calibration's scratch file).
    let configured = runtime.block_on(async {
        let mut signals = Signals::install()?;
        let configure = tokio::task::spawn_blocking(move || args.config());
        tokio::select! {
            config = configure => {
                let config = config.context("configuring the daemon")??;
                anyhow::Ok(Some((config, signals)))
            }
            sig = signals.next() => {
                tracing::info!("{sig} before serving: exiting");
                Ok(None)
            }
        }
    })?;
    let Some((config, signals)) = configured else {
        // The calibration's thread is still measuring: leave it to the process's exit, but not
        // its scratch file (unlinked under it, if it has one yet).
        if let Some(cache) = default_model::env_cache_dir() {
            let _ = std::fs::remove_file(spillway_daemon::calibrate::host::scratch_path(&cache));
        }
        runtime.shutdown_background();
        return Ok(());
    };
    runtime.block_on(serve_with_signals(config, signals, |addr| {
        eprintln!("spillwayd: listening on {addr}")
    }))?;
    Ok(())
}

fn init_logging(level: &str) -> anyhow::Result<()> {
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(f) if !f.is_empty() => EnvFilter::try_new(f).context("RUST_LOG")?,
        _ => EnvFilter::try_new(level).context("--log-level")?,
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    Ok(())
}

/// This machine's stored profile, or one calibrated now and stored (see `--calibrate`). A
/// machine that cannot be measured (no Vulkan device, a disk that refuses the scratch file)
/// serves without one: the models fall back to the CPU or run without predictions, as they
/// would have.
fn first_start_profile(
    index: Option<usize>,
    cache: &Path,
) -> Option<(HardwareProfile, Option<PathBuf>)> {
    use spillway_daemon::calibrate::first_start::{stored_or_calibrate, Outcome};
    use std::io::{IsTerminal, Write};

    let terminal = std::io::stderr().is_terminal();
    let mut stage = String::new();
    let mut clock = spillway_daemon::calibrate::StageClock::start();
    let mut last = std::time::Instant::now();
    let mut progress = |p: spillway_sched::calibrate::Progress<'_>| {
        clock.report(p.what);
        tracing::debug!(
            "calibration step {}/{} {}: {:.0} ms",
            p.done,
            p.total,
            p.what,
            last.elapsed().as_secs_f64() * 1e3
        );
        last = std::time::Instant::now();
        if terminal {
            let mut e = std::io::stderr();
            let _ = write!(
                e,
                "\rspillwayd: calibrating this machine (first start) {:>3}/{} {:<24}",
                p.done, p.total, p.what
            );
            if p.done == p.total {
                let _ = writeln!(e);
            }
        } else if p.what != stage {
            stage = p.what.to_string();
            tracing::info!(
                "calibrating this machine (first start): {}/{} {}",
                p.done,
                p.total,
                p.what
            );
        }
    };
    match stored_or_calibrate(index, cache, &mut progress) {
        Ok((profile, Outcome::Stored(path))) => {
            tracing::info!("hardware profile: {}", path.display());
            Some((profile, Some(path)))
        }
        Ok((profile, Outcome::Calibrated { path, seconds })) => {
            tracing::info!("calibration stages: {}", clock.summary());
            tracing::info!(
                "calibrated this machine in {seconds:.1} s; hardware profile stored in {} \
                 (`spillwayd calibrate` measures more shapes)",
                path.display()
            );
            Some((profile, Some(path)))
        }
        Err(e) => {
            tracing::warn!("no hardware profile: calibration at first start failed: {e}");
            None
        }
    }
}

/// The hardware profile `name` names (see `--hardware-profile`), or the one calibrated profile
/// in the cache directory with its path, where refinements are stored.
fn hardware_profile(
    name: Option<&str>,
    cache_dir: Option<&Path>,
) -> anyhow::Result<Option<(HardwareProfile, Option<PathBuf>)>> {
    if let Some(name) = name {
        return Ok(Some((super::plan::load_profile(Some(name))?, None)));
    }
    let Some(dir) = cache_dir.map(|d| d.join("profiles")) else {
        return Ok(None);
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(None);
    };
    let stored: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    match stored.as_slice() {
        [one] => {
            let text = std::fs::read_to_string(one)
                .with_context(|| format!("reading {}", one.display()))?;
            let profile = HardwareProfile::from_toml(&text)
                .with_context(|| format!("hardware profile {}", one.display()))?;
            tracing::info!("hardware profile: {}", one.display());
            Ok(Some((profile, Some(one.clone()))))
        }
        [] => Ok(None),
        many => {
            tracing::info!(
                "{} hardware profiles in {}: pass --hardware-profile to use one",
                many.len(),
                dir.display()
            );
            Ok(None)
        }
    }
}
