//! The `spillway.v1.Spillway` service: requests are checked here, then generation goes to the
//! model's worker and loading to a blocking task.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use spillway_proto::v1 as pb;
use spillway_proto::v1::spillway_server::Spillway;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use super::admission::QueueLimits;
use super::deadline::Deadlined;
use super::device::{DeviceChoice, OpenError};
use super::gpu::GpuStatus;
use super::models::{self, LoadError, LoadOptions, LoadedModel, Registry};
use super::profile::{ProfileItem, ProfileJob};
use super::validate::{self, ModelLimits};
use super::worker::{GenerateItem, GenerateJob};
use crate::engine::RamExperts;
use crate::gguf::inspect::Group;
use crate::gpu::GpuError;
use crate::model::Model;
use crate::plan::PlanError;
use crate::tokenizer::DecodeOptions as DetokenizeOptions;
use spillway_sched::plan::Pin;

/// Name under which the health service reports this service.
pub const SERVICE_NAME: &str = "spillway.v1.Spillway";

/// Settings every loaded model gets.
#[derive(Debug, Clone)]
pub struct ModelDefaults {
    pub threads: usize,
    /// How many requests may wait per model, and how long (`--queue-depth`,
    /// `--max-queue-wait`).
    pub queue: QueueLimits,
    /// Requests decoded together per model.
    pub max_batch: usize,
    /// KV cache positions; 0: the model's context, at most 4096.
    pub context: usize,
    /// Where models run unless LoadModel says otherwise (`--device`, after falling back to the
    /// CPU when Vulkan is not usable).
    pub device: DeviceChoice,
    /// Ceiling on the device memory of each model on a Vulkan device (`--vram-budget`).
    pub vram_budget: Option<u64>,
    /// RAM for the routed experts each MoE model computes on the CPU (`--ram-budget`).
    pub ram_budget: Option<u64>,
    /// Whether a MoE model on the CPU under a RAM budget reads the next layer's predicted
    /// experts ahead (`--predict-experts`).
    pub predict_experts: bool,
    /// The machine's measured limits, for profiles' predicted times and bandwidths
    /// (`--hardware-profile`), refined by profiled steps.
    pub hardware: Arc<super::hardware::HardwareCell>,
    /// How MoE models on a Vulkan device spread their expert slots (`--expert-layout`).
    pub expert_layout: super::models::LayoutChoice,
    /// Where MoE models on a Vulkan device run their experts not in VRAM (`--moe-miss`).
    pub moe_miss: crate::gpu::placement::MoeMiss,
    /// Whether a dense model's layers on the CPU share their rows with the GPU over the bus
    /// (`--bus-rows`).
    pub bus_rows: bool,
    /// How steps of several requests run on a Vulkan device (`--step-batching`).
    pub step_batching: crate::gpu::forward::StepBatching,
    /// Whether prompts may go into the running requests' steps (`--prompt-steps`).
    pub prompt_steps: bool,
}

/// State shared by the service, the loader and shutdown.
pub struct DaemonState {
    pub registry: Registry,
    pub health: HealthReporter,
    pub defaults: ModelDefaults,
    /// Set once shutdown begins: new calls are refused.
    pub draining: AtomicBool,
    /// Cancelled when the grace period is over: in-flight work stops.
    pub shutdown: CancellationToken,
    loads_running: AtomicUsize,
    /// What health last reported (0: nothing yet, 1: SERVING, 2: NOT_SERVING), to log changes.
    reported: std::sync::atomic::AtomicU8,
}

impl DaemonState {
    pub fn new(health: HealthReporter, defaults: ModelDefaults) -> Arc<DaemonState> {
        Arc::new(DaemonState {
            registry: Registry::default(),
            health,
            defaults,
            draining: AtomicBool::new(false),
            shutdown: CancellationToken::new(),
            loads_running: AtomicUsize::new(0),
            reported: std::sync::atomic::AtomicU8::new(0),
        })
    }

    /// Reports NOT_SERVING while a load runs, while a model recovers from a lost device, or
    /// once draining; SERVING otherwise.
    pub async fn update_health(&self) {
        let draining = self.draining.load(Ordering::SeqCst);
        let loading = self.loads_running.load(Ordering::SeqCst) > 0;
        let recovering = self.registry.any_recovering();
        let serving = !draining && !loading && !recovering;
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        let code = if serving { 1 } else { 2 };
        if self.reported.swap(code, Ordering::SeqCst) != code {
            let why = if draining {
                " (shutting down)"
            } else if loading {
                " (a model is loading)"
            } else if recovering {
                " (a model is reloading after its device was lost)"
            } else {
                ""
            };
            tracing::info!(
                "health: {}{why}",
                if serving { "SERVING" } else { "NOT_SERVING" }
            );
        }
        self.health.set_service_status("", status).await;
        self.health.set_service_status(SERVICE_NAME, status).await;
    }

    /// Loads a model (health NOT_SERVING meanwhile) and registers it. `progress` gets every
    /// stage; it may fail once the caller has gone, which does not stop the load.
    pub async fn load_model(
        self: &Arc<Self>,
        options: LoadOptions,
        progress: impl FnMut(models::LoadProgress) + Send + 'static,
    ) -> Result<Arc<LoadedModel>, Status> {
        self.loads_running.fetch_add(1, Ordering::SeqCst);
        self.update_health().await;
        let shutdown = self.shutdown.clone();
        let name = options.name.clone();
        let result =
            tokio::task::spawn_blocking(move || models::load(&options, shutdown, progress))
                .await
                .map_err(|e| Status::internal(format!("the loader failed: {e}")));
        self.loads_running.fetch_sub(1, Ordering::SeqCst);
        self.update_health().await;
        let loaded = result?.map_err(load_status)?;
        // Health turns NOT_SERVING while the model recovers from a lost device. The worker's
        // thread is outside the runtime, so it may block on the update.
        let (state, runtime) = (Arc::downgrade(self), tokio::runtime::Handle::current());
        loaded.worker.stats().on_recovery(Box::new(move || {
            if let Some(state) = state.upgrade() {
                runtime.block_on(state.update_health());
            }
        }));
        if let Err(model) = self.registry.insert(loaded) {
            model.worker.unload();
            return Err(name_taken(&name));
        }
        tracing::info!(model = %name, "loaded");
        self.registry
            .get(&name)
            .ok_or_else(|| Status::internal("the model was unloaded while it loaded"))
    }
}

/// This process's resident set (`VmRSS` of `/proc/self/status`).
fn resident_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The status a failed load (or plan) answers: INVALID_ARGUMENT for what the request must
/// change, FAILED_PRECONDITION for what the budgets, pins or daemon must.
fn load_status(e: LoadError) -> Status {
    match e {
        LoadError::NotFound(_) => Status::not_found(e.to_string()),
        // Other processes may free memory: a later try may succeed.
        LoadError::HostMemory { .. } => Status::resource_exhausted(e.to_string()),
        LoadError::Model { .. } => Status::invalid_argument(e.to_string()),
        LoadError::Thread(_) => Status::internal(e.to_string()),
        LoadError::Device { ref source, .. } => match source {
            OpenError::NoSuchDevice { .. } => Status::invalid_argument(e.to_string()),
            OpenError::Unavailable(_) => Status::failed_precondition(e.to_string()),
            OpenError::Other(_) => Status::internal(e.to_string()),
        },
        // The driver out of memory (other users of the device): a later try may succeed.
        LoadError::Gpu {
            source: GpuError::OutOfMemory(_),
            ..
        } => Status::resource_exhausted(e.to_string()),
        // A model over its VRAM budget: the budget (or the model) must change.
        LoadError::Gpu { ref source, .. } if source.is_out_of_memory() => {
            Status::failed_precondition(e.to_string())
        }
        LoadError::Gpu {
            source: GpuError::Unsupported(_),
            ..
        } => Status::invalid_argument(e.to_string()),
        LoadError::Gpu { .. } => Status::internal(e.to_string()),
        LoadError::Placement(_) | LoadError::NoHardwareProfile(_) => {
            Status::failed_precondition(e.to_string())
        }
        LoadError::RamTier(crate::stream::StreamError::RamBelowMinimum { .. }) => {
            Status::failed_precondition(e.to_string())
        }
        LoadError::RamTier(_) => Status::internal(e.to_string()),
        LoadError::Plan { ref source, .. } => {
            use spillway_sched::plan::PlanError as Sched;
            match source {
                // A file that is no model, or a budget the machine does not have.
                PlanError::Header(_)
                | PlanError::Metadata(_)
                | PlanError::NoArchitecture
                | PlanError::Model(_)
                | PlanError::Plan(Sched::Model(_) | Sched::OverMachine { .. }) => {
                    Status::invalid_argument(e.to_string())
                }
                // A model over its budgets, or pins the GPU model cannot run.
                PlanError::Plan(Sched::VramTooSmall { .. } | Sched::RamTooSmall { .. })
                | PlanError::PinnedOffVram { .. }
                | PlanError::NotMoe
                | PlanError::NoProfile(_)
                | PlanError::Profile { .. } => Status::failed_precondition(e.to_string()),
            }
        }
    }
}

fn name_taken(name: &str) -> Status {
    Status::already_exists(format!(
        "a model called {name:?} is loaded; unload it first or choose another name"
    ))
}

pub struct SpillwayService {
    state: Arc<DaemonState>,
}

impl SpillwayService {
    pub fn new(state: Arc<DaemonState>) -> SpillwayService {
        SpillwayService { state }
    }

    #[allow(clippy::result_large_err)]
    fn check_open(&self) -> Result<(), Status> {
        if self.state.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable(
                "the daemon is shutting down; retry against a running daemon",
            ));
        }
        Ok(())
    }

    #[allow(clippy::result_large_err)]
    fn model(&self, name: &str) -> Result<Arc<LoadedModel>, Status> {
        self.state.registry.get(name).ok_or_else(|| {
            let names = self.state.registry.names();
            if names.is_empty() {
                Status::failed_precondition("no model is loaded; load one with `spillway load`")
            } else {
                Status::invalid_argument(format!(
                    "model {name:?} is not loaded; loaded: {} (`spillway models`)",
                    names.join(", ")
                ))
            }
        })
    }

    /// What a LoadModel request (or the load a Plan request plans) asks for, with the daemon's
    /// defaults filled in; no path, a malformed pin or a budget for the wrong device is
    /// INVALID_ARGUMENT.
    #[allow(clippy::result_large_err)]
    fn load_options(&self, req: &pb::LoadModelRequest) -> Result<LoadOptions, Status> {
        if req.path.is_empty() {
            return Err(Status::invalid_argument("give the path of a GGUF file"));
        }
        let defaults = &self.state.defaults;
        let device = match req.device.as_str() {
            "" => defaults.device,
            d => d
                .parse::<DeviceChoice>()
                .map_err(Status::invalid_argument)?,
        };
        let pins = req
            .pins
            .iter()
            .map(|p| {
                format!("{}={}", p.pattern, p.placement)
                    .parse::<Pin>()
                    .map_err(|e| Status::invalid_argument(format!("pin {:?}: {e}", p.pattern)))
            })
            .collect::<Result<Vec<Pin>, Status>>()?;
        if !pins.is_empty() && device == DeviceChoice::Cpu {
            return Err(Status::invalid_argument(
                "pins place routed experts between VRAM and the CPU: they apply to a model on \
                 a Vulkan device; give device \"vulkan\" or no pins",
            ));
        }
        let vram_budget = match (device, req.budgets.map_or(0, |b| b.vram_bytes)) {
            (DeviceChoice::Cpu, 0) => None,
            (DeviceChoice::Cpu, _) => {
                return Err(Status::invalid_argument(
                    "budgets.vram_bytes applies to a model on a Vulkan device, and this one \
                     would run on the CPU; give device \"vulkan\" or no VRAM budget",
                ))
            }
            (DeviceChoice::Vulkan(_), 0) => defaults.vram_budget,
            (DeviceChoice::Vulkan(_), n) => Some(n),
        };
        // The routed experts computed on the CPU, on either device (a dense model has none:
        // its weights are mapped).
        let ram_budget = match req.budgets.map_or(0, |b| b.ram_bytes) {
            0 => defaults.ram_budget,
            n => Some(n),
        };
        let path = PathBuf::from(&req.path);
        let name = if req.name.is_empty() {
            models::name_from_path(&path)
        } else {
            req.name.clone()
        };
        Ok(LoadOptions {
            name,
            path,
            context: match req.context_length {
                0 => defaults.context,
                n => n as usize,
            },
            threads: defaults.threads,
            queue: defaults.queue,
            max_batch: defaults.max_batch,
            device,
            vram_budget,
            ram_budget,
            predict_experts: defaults.predict_experts,
            expert_layout: defaults.expert_layout.clone(),
            moe_miss: defaults.moe_miss,
            bus_rows: defaults.bus_rows,
            step_batching: defaults.step_batching,
            prompt_steps: defaults.prompt_steps,
            pins,
            hardware: defaults.hardware.get(),
        })
    }
}

type ResponseStream<T> = ReceiverStream<Result<T, Status>>;

#[tonic::async_trait]
impl Spillway for SpillwayService {
    type GenerateStream = Deadlined<pb::GenerateResponse>;
    type LoadModelStream = ResponseStream<pb::LoadModelProgress>;
    type ProfileStream = Deadlined<pb::ProfileStep>;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let arrived = Instant::now();
        self.check_open()?;
        let deadline = deadline(&request, arrived);
        let req = request.into_inner();
        let model = self.model(&req.model)?;
        let valid = with_limits(&model, |limits| validate::generate_request(&req, limits))?;
        let (tx, rx) = mpsc::channel::<GenerateItem>(32);
        model.worker.submit(GenerateJob {
            prompt: valid.prompt,
            options: valid.options,
            prompt_logprobs: valid.prompt_logprobs,
            deadline,
            arrived,
            tx,
        })?;
        Ok(Response::new(Deadlined::new(rx, deadline)))
    }

    async fn profile(
        &self,
        request: Request<pb::ProfileRequest>,
    ) -> Result<Response<Self::ProfileStream>, Status> {
        let arrived = Instant::now();
        self.check_open()?;
        let deadline = deadline(&request, arrived);
        let req = request.into_inner();
        let model = self.model(&req.model)?;
        let valid = with_limits(&model, |limits| validate::profile_request(&req, limits))?;
        let (tx, rx) = mpsc::channel::<ProfileItem>(32);
        model.worker.submit_profile(ProfileJob {
            prompt: valid.prompt,
            steps: valid.steps,
            deadline,
            tx,
            hardware: self.state.defaults.hardware.clone(),
        })?;
        Ok(Response::new(Deadlined::new(rx, deadline)))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        self.check_open()?;
        let req = request.into_inner();
        let model = self.model(&req.model)?;
        let tok = tokenizer(&model)?;
        if req.text.len() > validate::MAX_PROMPT_BYTES {
            return Err(Status::invalid_argument(format!(
                "the text has {} bytes; at most {} are accepted",
                req.text.len(),
                validate::MAX_PROMPT_BYTES
            )));
        }
        // As a text prompt is tokenized: control tokens written in the text are recognised.
        let tokens = tok.encode_with(
            &req.text,
            crate::tokenizer::EncodeOptions {
                add_special: req.add_special,
                parse_special: true,
            },
        );
        Ok(Response::new(pb::TokenizeResponse { tokens }))
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        self.check_open()?;
        let req = request.into_inner();
        let model = self.model(&req.model)?;
        let tok = tokenizer(&model)?;
        if let Some(&bad) = req.tokens.iter().find(|&&t| t as usize >= tok.n_vocab()) {
            return Err(Status::invalid_argument(format!(
                "token id {bad} is outside the model's vocabulary of {} tokens",
                tok.n_vocab()
            )));
        }
        let bytes = tok.detokenize(&req.tokens, DetokenizeOptions::default());
        Ok(Response::new(pb::DetokenizeResponse {
            text: String::from_utf8_lossy(&bytes).into_owned(),
        }))
    }

    async fn list_models(
        &self,
        _request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let all = self.state.registry.all();
        let models = all
            .iter()
            .enumerate()
            .map(|(i, m)| pb::ModelInfo {
                name: m.name.clone(),
                path: m.path.display().to_string(),
                architecture: m.model.file().architecture().unwrap_or("").to_string(),
                parameters: m.parameters,
                file_bytes: m.model.file().file_size(),
                loaded: true,
                is_default: i == 0,
                context_length: m.context as u32,
            })
            .collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }

    async fn load_model(
        &self,
        request: Request<pb::LoadModelRequest>,
    ) -> Result<Response<Self::LoadModelStream>, Status> {
        self.check_open()?;
        let options = self.load_options(&request.into_inner())?;
        if self.state.registry.contains(&options.name) {
            return Err(name_taken(&options.name));
        }
        let (tx, rx) = mpsc::channel(16);
        let state = self.state.clone();
        tokio::spawn(async move {
            let progress_tx = tx.clone();
            let result = state
                .load_model(options, move |p| {
                    let _ = progress_tx.blocking_send(Ok(pb::LoadModelProgress {
                        bytes_done: p.bytes_done,
                        bytes_total: p.bytes_total,
                        stage: p.stage.to_string(),
                        ready: false,
                    }));
                })
                .await;
            let last = result.map(|m| pb::LoadModelProgress {
                bytes_done: m.weight_bytes,
                bytes_total: m.weight_bytes,
                stage: "ready".into(),
                ready: true,
            });
            let _ = tx.send(last).await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn plan(
        &self,
        request: Request<pb::PlanRequest>,
    ) -> Result<Response<pb::PlanResponse>, Status> {
        self.check_open()?;
        let load = request.into_inner().load.ok_or_else(|| {
            Status::invalid_argument("give the load to plan: a LoadModelRequest with its path")
        })?;
        let options = self.load_options(&load)?;
        let hardware = options.hardware.clone();
        // Reading the header and planning a large MoE model take a while: off the async threads.
        let plan = tokio::task::spawn_blocking(move || models::plan(&options))
            .await
            .map_err(|e| Status::internal(format!("the planner failed: {e}")))?
            .map_err(load_status)?;
        let mut table = String::new();
        plan.write_table(&mut table)
            .map_err(|e| Status::internal(format!("writing the plan's table: {e}")))?;
        Ok(Response::new(pb::PlanResponse {
            table,
            json: plan.to_json(),
            tokens_per_second: plan.tokens_per_s,
            bottleneck: plan.bottleneck.to_string(),
            hardware_profile: hardware.map_or_else(String::new, |h| {
                format!("{} ({}, {})", h.source, h.key.device, h.key.cpu)
            }),
        }))
    }

    async fn unload_model(
        &self,
        request: Request<pb::UnloadModelRequest>,
    ) -> Result<Response<pb::UnloadModelResponse>, Status> {
        self.check_open()?;
        let name = request.into_inner().name;
        if name.is_empty() {
            return Err(Status::invalid_argument(
                "give the name of the model to unload",
            ));
        }
        let model = self.state.registry.remove(&name).ok_or_else(|| {
            Status::not_found(format!(
                "model {name:?} is not loaded; loaded: {}",
                self.state.registry.names().join(", ")
            ))
        })?;
        model.worker.unload();
        tracing::info!(model = %name, "unloaded");
        Ok(Response::new(pb::UnloadModelResponse {}))
    }

    async fn status(
        &self,
        _request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let now = Instant::now();
        let models = self
            .state
            .registry
            .all()
            .iter()
            .map(|m| {
                let stats = m.worker.stats();
                let mut status = pb::ModelStatus {
                    name: m.name.clone(),
                    // The CPU engine reads every weight from RAM (the page cache).
                    tiers: vec![pb::TierUsage {
                        tier: "ram".into(),
                        bytes: m.weight_bytes,
                        tensors: m.tensors,
                    }],
                    expert_cache_hit_rate: Vec::new(),
                    queue_depth: stats.in_queue.load(Ordering::SeqCst) as u32,
                    recent_tokens_per_second: stats.recent_tokens_per_second(now),
                    device: m.device().to_string(),
                    kv_cache_bytes: m.kv_cache_bytes,
                    queue_capacity: m.worker.queue_capacity() as u32,
                    generated_tokens: stats.generated.load(Ordering::Relaxed),
                    max_batch: m.worker.max_batch() as u32,
                    shared_steps: stats.shared_steps.load(Ordering::Relaxed),
                    prompt_steps: stats.prompt_steps.load(Ordering::Relaxed),
                    ..Default::default()
                };
                if let Some(gpu) = &m.gpu {
                    gpu_status(gpu, m.tensors, &mut status);
                }
                if let Some(ram) = &m.ram_experts {
                    ram_tier_status(&m.model, ram, m.tensors, &mut status);
                }
                status
            })
            .collect();
        Ok(Response::new(pb::StatusResponse {
            models,
            device_memory_bytes: crate::gpu::alloc::process_bytes(),
            rss_bytes: resident_bytes().unwrap_or(0),
        }))
    }
}

/// What a model on a Vulkan device adds to its status: VRAM held, where the weights are, and
/// where a MoE model's routed experts ran.
fn gpu_status(gpu: &GpuStatus, tensors: u32, status: &mut pb::ModelStatus) {
    status.vram_bytes = gpu.vram_bytes();
    status.vram_budget_bytes = gpu.vram_budget().unwrap_or(0);
    status.tiers = vec![pb::TierUsage {
        tier: "vram".into(),
        bytes: gpu.vram_weights,
        tensors,
    }];
    let ram_tier = gpu.ram_tier.lock().clone();
    if gpu.ram_weights > 0 {
        // The routed experts without a VRAM slot: stacked with the resident ones, so no
        // tensor of their own. Under a RAM budget they live in the file, read into the RAM
        // tier as tokens need them.
        status.tiers.push(pb::TierUsage {
            tier: if ram_tier.is_some() { "ssd" } else { "ram" }.into(),
            bytes: gpu.ram_weights,
            tensors: 0,
        });
    }
    if let Some(ram) = &ram_tier {
        status.ram_tier = Some(ram_tier_counters(ram));
    }
    if let Some(e) = gpu.experts.lock().as_ref() {
        let t = e.total();
        status.expert_cache_hit_rate = e.layers.iter().map(|l| l.hit_rate() as f32).collect();
        status.experts = Some(pb::ExpertCounters {
            slots_per_layer: e.slots as u32,
            n_expert: e.n_expert as u32,
            miss: e.miss.to_string(),
            hits: t.hits,
            misses: t.misses,
            cpu: t.cpu,
            fetched: t.fetched,
            evictions: t.evictions,
            bytes_uploaded: t.bytes_uploaded,
            promoted: t.promoted,
            pcie: t.pcie,
        });
    }
}

/// What a MoE model on the CPU under a RAM budget adds to its status: its routed experts live
/// in the file, read into the RAM tier as tokens need them, and the tier's counters.
fn ram_tier_status(model: &Model, ram: &RamExperts, tensors: u32, status: &mut pb::ModelStatus) {
    let experts: Vec<_> = model
        .file()
        .tensors()
        .iter()
        .filter(|t| Group::of(&t.name) == Group::RoutedExperts)
        .collect();
    let expert_bytes: u64 = experts.iter().map(|t| t.n_bytes).sum();
    let mapped = &mut status.tiers[0];
    mapped.bytes -= expert_bytes;
    mapped.tensors = tensors - experts.len() as u32;
    status.tiers.push(pb::TierUsage {
        tier: "ssd".into(),
        bytes: expert_bytes,
        tensors: experts.len() as u32,
    });
    status.expert_cache_hit_rate = ram
        .cache()
        .layer_stats()
        .iter()
        .map(|l| l.hit_rate() as f32)
        .collect();
    status.ram_tier = Some(ram_tier_counters(ram));
}

fn ram_tier_counters(ram: &RamExperts) -> pb::RamTierCounters {
    let s = ram.stats();
    pb::RamTierCounters {
        buffer_bytes: s.buffer_bytes,
        hits: s.hits,
        misses: s.misses,
        bytes_read: s.bytes_read,
        prefetches: s.prefetches,
        predicted_right: s.predicted_right,
        predicted_wrong: s.predicted_wrong,
    }
}

#[allow(clippy::result_large_err)]
/// When a call must end, from its `grpc-timeout` header, counted from its arrival.
fn deadline<T>(request: &Request<T>, arrived: Instant) -> Option<Instant> {
    request
        .metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(validate::grpc_timeout)
        .map(|d| arrived + d)
}

/// Runs `f` with what validation needs to know of `model`.
fn with_limits<R>(model: &LoadedModel, f: impl FnOnce(&ModelLimits<'_>) -> R) -> R {
    let render = |m: &[pb::ChatMessage]| model.chat_template.render(m);
    f(&ModelLimits {
        tokenizer: model.tokenizer.as_deref(),
        n_vocab: model.model.config.n_vocab,
        context: model.context,
        render_chat: &render,
    })
}

fn tokenizer(model: &LoadedModel) -> Result<&crate::tokenizer::Tokenizer, Status> {
    model.tokenizer.as_deref().ok_or_else(|| {
        Status::failed_precondition(format!(
            "model {:?} has no usable tokenizer; use token ids",
            model.name
        ))
    })
}
