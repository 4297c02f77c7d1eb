//! The daemon's loaded models: loading one (open and validate the file, read its weights into
//! the page cache, start its worker), planning one without loading it, looking them up by name,
//! unloading.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;
use tokio_util::sync::CancellationToken;

use super::admission::QueueLimits;
use super::chat::ChatTemplate;
use super::device::{self, DeviceChoice, OpenError};
use super::gpu::{GpuSequence, GpuStatus};
use super::worker::Worker;
use crate::engine::{BatchEngine, EngineOptions, KvCache, RamExperts};
use crate::gguf::inspect::Group;
use crate::gguf::GgufFile;
use crate::gpu::forward::{GpuModel, GpuModelOptions};
use crate::gpu::placement::ExpertLayout;
use crate::gpu::GpuError;
use crate::host_memory;
use crate::model::{Model, ModelError};
use crate::plan::PlanError;
use crate::stream::open_expert_cache;
use crate::tokenizer::Tokenizer;
use spillway_sched::plan::{Pin, Plan, PlanOptions};
use spillway_sched::profile::HardwareProfile;
use spillway_sched::ByteSize;

/// Bytes read between two progress reports while the weights are paged in.
const PROGRESS_STEP: u64 = 16 << 20;

/// A model with its worker.
pub struct LoadedModel {
    pub name: String,
    pub path: PathBuf,
    pub model: Arc<Model>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// Renders chat input: the model's own template, or ChatML.
    pub chat_template: ChatTemplate,
    /// KV cache positions of the worker's engine.
    pub context: usize,
    pub parameters: u64,
    pub weight_bytes: u64,
    pub tensors: u32,
    pub kv_cache_bytes: u64,
    pub worker: Worker,
    /// `None` on the CPU.
    pub gpu: Option<Arc<GpuStatus>>,
    /// On the CPU, a MoE model's routed experts under a RAM budget (shared with its engine).
    pub ram_experts: Option<Arc<RamExperts>>,
}

impl LoadedModel {
    /// Where the forward pass runs: `cpu` or `vulkan:N (NAME)`.
    pub fn device(&self) -> &str {
        self.gpu.as_ref().map_or("cpu", |g| g.device.as_str())
    }
}

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub name: String,
    pub path: PathBuf,
    pub context: usize,
    pub threads: usize,
    /// How many requests may wait, and how long ([`QueueLimits`]).
    pub queue: QueueLimits,
    /// Requests decoded together (sequences of the engine; 1 on a Vulkan device).
    pub max_batch: usize,
    pub device: DeviceChoice,
    /// Ceiling on the device memory a model on a Vulkan device may hold.
    pub vram_budget: Option<u64>,
    /// RAM for the routed experts a model on a Vulkan device computes on the CPU, read from
    /// its file as needed; `None`: the memory map.
    pub ram_budget: Option<u64>,
    /// With a RAM budget on the CPU: read the next layer's predicted experts ahead
    /// ([`RamExperts`]).
    pub predict_experts: bool,
    /// How a MoE model on a Vulkan device spreads its expert slots over the layers.
    pub expert_layout: LayoutChoice,
    /// Where a MoE model's experts not in VRAM run.
    pub moe_miss: crate::gpu::placement::MoeMiss,
    /// Whether a dense model's layers on the CPU share their rows with the GPU over the bus.
    pub bus_rows: bool,
    /// How a model on a Vulkan device runs steps of several requests.
    pub step_batching: crate::gpu::forward::StepBatching,
    /// Whether prompts may go into the running requests' steps.
    pub prompt_steps: bool,
    /// Placements of routed expert stacks (LoadModel's pins), planned around on `hardware`.
    pub pins: Vec<Pin>,
    /// The machine's profile, which plans are made on.
    pub hardware: Option<Arc<HardwareProfile>>,
}

/// `--expert-layout`: a fixed layout, or the scheduler's plan for each model as it loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutChoice {
    Fixed(ExpertLayout),
    Planned,
}

impl std::str::FromStr for LayoutChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<LayoutChoice, String> {
        match s {
            "planned" => Ok(LayoutChoice::Planned),
            _ => s.parse().map(LayoutChoice::Fixed).map_err(|e: String| {
                format!("{e}, or planned (the scheduler's plan on the hardware profile)")
            }),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: {source}", path.display())]
    Model {
        path: PathBuf,
        #[source]
        source: ModelError,
    },
    #[error("{}: no such file", .0.display())]
    NotFound(PathBuf),
    #[error("starting the model's worker thread: {0}")]
    Thread(#[from] std::io::Error),
    #[error("{choice}: {source}")]
    Device {
        choice: DeviceChoice,
        #[source]
        source: OpenError,
    },
    /// Pins or `--expert-layout planned` could not be planned: what to change.
    #[error("placing the experts: {0}")]
    Placement(String),
    /// What is planned on the machine's hardware profile, and the daemon has none.
    #[error(
        "{0} on the machine's hardware profile, and the daemon has none: run `spillwayd \
         calibrate`, or start it with --hardware-profile"
    )]
    NoHardwareProfile(&'static str),
    /// The scheduler could not plan the model (the Plan call).
    #[error("planning {}: {source}", path.display())]
    Plan {
        path: PathBuf,
        #[source]
        source: PlanError,
    },
    /// The RAM tier of a CPU model's routed experts could not open: a budget under what one
    /// token's experts need, or the file.
    #[error("the RAM budget of the routed experts: {0}")]
    RamTier(crate::stream::StreamError),
    /// What the load would allocate in host memory does not fit under the daemon's memory
    /// cgroup or the machine's available memory.
    #[error(
        "the load needs {} of host memory besides the mapped weights (KV cache, buffers and \
         any RAM tier of experts), and {bound} leaves {}: lower --ctx, --max-batch or \
         --ram-budget, or give the daemon more memory",
        host_memory::mib(*needed),
        host_memory::mib(*available)
    )]
    HostMemory {
        needed: u64,
        available: u64,
        bound: String,
    },
    /// The model could not be put on the device; `message` is the GPU's, with what it needs.
    #[error("loading onto {device}: {message}")]
    Gpu {
        device: String,
        source: GpuError,
        message: String,
    },
}

/// The layout `options` asks for; with pins or `planned`, the plan's VRAM experts per layer.
fn expert_layout(
    options: &LoadOptions,
    device: &Arc<crate::gpu::Device>,
    model: &Model,
) -> Result<ExpertLayout, LoadError> {
    if model.config.moe.is_none() {
        if !options.pins.is_empty() {
            return Err(LoadError::Placement(NO_EXPERTS_TO_PIN.into()));
        }
        // Nothing to spread: a dense model is whole in VRAM or refused.
        return Ok(ExpertLayout::Even);
    }
    let fixed = match &options.expert_layout {
        LayoutChoice::Fixed(layout) if options.pins.is_empty() => return Ok(layout.clone()),
        LayoutChoice::Fixed(ExpertLayout::Even) | LayoutChoice::Planned => None,
        LayoutChoice::Fixed(other) => Some(other),
    };
    if let Some(layout) = fixed {
        return Err(LoadError::Placement(format!(
            "pins are planned around by the scheduler, which replaces the daemon's \
             --expert-layout {layout:?}: start it with --expert-layout even or planned"
        )));
    }
    let Some(hardware) = &options.hardware else {
        return Err(LoadError::NoHardwareProfile(
            "pins and --expert-layout planned are planned",
        ));
    };
    let sized = GpuModelOptions {
        vram_budget: options.vram_budget,
        ram_budget: options.ram_budget,
        context: options.context,
        ..GpuModelOptions::default()
    };
    let layout = crate::plan::planned_layout(device, model, &sized, hardware, &options.pins)
        .map_err(|e| LoadError::Placement(e.to_string()))?;
    tracing::info!(model = %options.name, ?layout, "planned VRAM experts per MoE layer");
    Ok(layout)
}

const NO_EXPERTS_TO_PIN: &str = "pins place routed expert stacks, and this model has none";

/// The scheduler's plan for the load `options` describe, on their hardware profile: what the
/// Plan call answers. Only the file's header is read; no device is opened. A model on a Vulkan
/// device is planned under its VRAM budget (the profile's GPU memory without one) and RAM
/// budget (the profile's RAM without one), and its pins are refused where loading would refuse
/// them; a model on the CPU is planned for the CPU alone.
pub fn plan(options: &LoadOptions) -> Result<Plan, LoadError> {
    let path = &options.path;
    if !path.exists() {
        return Err(LoadError::NotFound(path.clone()));
    }
    let Some(hardware) = options.hardware.as_deref() else {
        return Err(LoadError::NoHardwareProfile("plans are made"));
    };
    let planning = |source: PlanError| LoadError::Plan {
        path: path.clone(),
        source,
    };
    let file = GgufFile::open_structure_only(path).map_err(|e| planning(PlanError::Header(e)))?;
    let desc = crate::plan::model_desc(&options.name, &file).map_err(planning)?;
    let gpu = matches!(options.device, DeviceChoice::Vulkan(_));
    if gpu && !options.pins.is_empty() && desc.experts.is_none() {
        return Err(LoadError::Placement(NO_EXPERTS_TO_PIN.into()));
    }
    let vram_budget = if gpu {
        options.vram_budget.map_or(hardware.gpu.memory, ByteSize)
    } else {
        ByteSize(0)
    };
    let ram_budget = options.ram_budget.map_or(hardware.ram.memory, ByteSize);
    let mut opts = PlanOptions::new(vram_budget, ram_budget);
    opts.cpu_only = !gpu;
    opts.context = crate::plan::kv_positions(&file, options.context).map_err(planning)?;
    opts.pins = options.pins.clone();
    let plan = spillway_sched::plan::plan(&desc, hardware, &opts)
        .map_err(|e| planning(PlanError::Plan(e)))?;
    if gpu {
        crate::plan::check_gpu_pins(&plan).map_err(planning)?;
    }
    Ok(plan)
}

/// One load stage for progress reports.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadProgress {
    pub stage: &'static str,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// Loads a model and starts its worker, reporting progress. Blocking: run it off the async
/// threads.
pub fn load(
    options: &LoadOptions,
    shutdown: CancellationToken,
    mut progress: impl FnMut(LoadProgress),
) -> Result<LoadedModel, LoadError> {
    let path = &options.path;
    if !path.exists() {
        return Err(LoadError::NotFound(path.clone()));
    }
    let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    progress(LoadProgress {
        stage: "validating",
        bytes_done: 0,
        bytes_total: file_bytes,
    });
    let model = Model::open(path).map_err(|source| LoadError::Model {
        path: path.clone(),
        source,
    })?;
    check_host_memory(options, &model)?;
    let tensors = model.file().tensors();
    let weight_bytes: u64 = tensors.iter().map(|t| t.n_bytes).sum();
    let parameters: u64 = tensors.iter().map(|t| t.n_elements).sum();
    let n_tensors = tensors.len() as u32;
    // Routed experts read through a RAM tier stay on the SSD until a token needs them.
    let ram_tier = options.ram_budget.filter(|_| model.config.moe.is_some());
    page_in(&model, ram_tier.is_some(), &mut progress);
    let tokenizer = match Tokenizer::from_metadata(model.file().metadata()) {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => {
            tracing::warn!(model = %options.name, "no usable tokenizer, token ids only: {e}");
            None
        }
    };
    let special = |id: Option<u32>| {
        tokenizer
            .as_ref()
            .and_then(|t| id.and_then(|id| t.token_text(id)))
            .unwrap_or("")
            .to_string()
    };
    let (bos, eos) = match &tokenizer {
        Some(t) => (special(t.bos()), special(t.eos())),
        None => Default::default(),
    };
    let chat_template = ChatTemplate::from_metadata(model.file().metadata(), &bos, &eos);
    tracing::info!(
        model = %options.name,
        "chat template: {}",
        if chat_template.from_model { "the model's own" } else { "ChatML (the model has none)" }
    );
    let model = Arc::new(model);
    let mut ram_experts = None;
    let (worker, context, kv_cache_bytes, gpu) = match options.device {
        DeviceChoice::Cpu => {
            let mut engine = BatchEngine::new(
                model.clone(),
                &EngineOptions {
                    threads: options.threads,
                    context: options.context,
                },
                options.max_batch,
            );
            if options.ram_budget.is_some() && ram_tier.is_none() {
                tracing::info!(
                    model = %options.name,
                    "no routed experts: the RAM budget does not apply, the weights are mapped"
                );
            }
            if let Some(budget) = ram_tier {
                // The policy a GPU model's RAM tier takes (the daemon has no flag for it).
                let policy = GpuModelOptions::default().expert_policy;
                let cache =
                    open_expert_cache(&model, budget, policy).map_err(LoadError::RamTier)?;
                // Next-layer read-ahead only when asked (`--predict-experts`): off by
                // default, as `spillwayd run`'s (its wrong reads cost what its right ones
                // gained on the models measured).
                let ram = Arc::new(RamExperts::new(&model, cache, options.predict_experts));
                engine = engine.with_ram_experts(ram.clone());
                ram_experts = Some(ram);
            }
            let context = engine.capacity();
            let c = &model.config;
            let kv_cache_bytes =
                KvCache::bytes(c.n_layer, context, c.kv_width()) * engine.sequences() as u64;
            let worker = Worker::spawn(
                &options.name,
                engine,
                tokenizer.clone(),
                options.queue,
                shutdown,
            )?;
            (worker, context, kv_cache_bytes, None)
        }
        DeviceChoice::Vulkan(index) => {
            let device = device::open_vulkan(index).map_err(|source| LoadError::Device {
                choice: options.device,
                source,
            })?;
            let name = device::describe(&device);
            progress(LoadProgress {
                stage: "uploading to the GPU",
                bytes_done: 0,
                bytes_total: weight_bytes,
            });
            let gpu_options = GpuModelOptions {
                vram_budget: options.vram_budget,
                ram_budget: options.ram_budget,
                context: options.context,
                threads: options.threads,
                expert_layout: expert_layout(options, &device, &model)?,
                moe_miss: options.moe_miss,
                bus_rows: options.bus_rows,
                sequences: options.max_batch,
                step_batching: options.step_batching,
                prompt_steps: options.prompt_steps,
                ..GpuModelOptions::default()
            };
            let gpu = device::load_gpu_model(&device, &model, &gpu_options).map_err(
                |(source, message)| LoadError::Gpu {
                    device: name.clone(),
                    source,
                    message,
                },
            )?;
            let context = gpu.capacity();
            let cpu_layers = gpu.cpu_layers();
            // The footprint of the sequences the model holds (fewer where steps cannot batch).
            let footprint = GpuModel::device_bytes(
                &model,
                &GpuModelOptions {
                    sequences: gpu.sequences(),
                    ..gpu_options.clone()
                },
            );
            let sequences = gpu.sequences();
            let (sequence, status) = GpuSequence::new(
                model.clone(),
                gpu,
                (index, gpu_options.clone()),
                name.clone(),
                footprint,
            );
            let kv_cache_bytes = footprint.kv_cache;
            tracing::info!(
                model = %options.name,
                device = %name,
                vram_bytes = status.vram_bytes(),
                cpu_layers,
                sequences,
                "on the GPU, up to {sequences} requests at a time"
            );
            let worker = Worker::spawn(
                &options.name,
                sequence,
                tokenizer.clone(),
                options.queue,
                shutdown,
            )?;
            (worker, context, kv_cache_bytes, Some(status))
        }
    };
    Ok(LoadedModel {
        name: options.name.clone(),
        path: path.clone(),
        parameters,
        tensors: n_tensors,
        weight_bytes,
        kv_cache_bytes,
        context,
        tokenizer,
        chat_template,
        model,
        worker,
        gpu,
        ram_experts,
    })
}

/// Host memory a load takes besides its own allocations: the worker's scratch, the thread
/// pool, the tokenizer.
const HOST_MARGIN: u64 = 32 << 20;

/// Refuses a load whose host allocations would not fit (`host_memory`): [`load_host_bytes`]
/// and a margin.
fn check_host_memory(options: &LoadOptions, model: &Model) -> Result<(), LoadError> {
    let needed = load_host_bytes(options, model) + HOST_MARGIN;
    match host_memory::headroom() {
        Some(room) if needed > room.bytes => Err(LoadError::HostMemory {
            needed,
            available: room.bytes,
            bound: room.bound,
        }),
        _ => Ok(()),
    }
}

/// The host memory a load allocates itself: the CPU engine's KV caches, or a GPU model's
/// staging buffers (its KV cache is in VRAM), and, for a MoE model under a RAM budget, the
/// RAM tier of its experts, whose buffers are allocated when it loads. The weights are mapped
/// from the file, so they are not counted: the kernel can drop their pages and read them
/// again. A GPU model's copy of its experts for reading over the bus (`--moe-miss pcie`) is
/// bounded by half the headroom where it is chosen, and counted there.
fn load_host_bytes(options: &LoadOptions, model: &Model) -> u64 {
    let c = &model.config;
    let ram_tier = match (&c.moe, options.ram_budget) {
        (Some(_), Some(budget)) => crate::stream::ram_tier_bytes(model, budget),
        _ => 0,
    };
    match options.device {
        DeviceChoice::Cpu => {
            let engine = EngineOptions {
                threads: options.threads,
                context: options.context,
            };
            // One cache per sequence, as `BatchEngine::new` makes them.
            KvCache::bytes(c.n_layer, engine.positions(c), c.kv_width())
                * options.max_batch.max(1) as u64
                + ram_tier
        }
        DeviceChoice::Vulkan(_) => crate::gpu::upload::DEFAULT_STAGING_BYTES + ram_tier,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::profile::costs::tests::tiny_moe;

    #[test]
    fn a_gpu_load_counts_the_ram_tier_its_budget_allocates_up_to_every_expert() {
        let (_dir, model) = tiny_moe();
        let mut options = LoadOptions {
            name: "m".into(),
            path: model.file().path().unwrap().to_path_buf(),
            context: 64,
            threads: 1,
            queue: QueueLimits {
                depth: 1,
                max_wait: None,
            },
            max_batch: 1,
            device: DeviceChoice::Vulkan(None),
            vram_budget: None,
            ram_budget: None,
            predict_experts: false,
            expert_layout: LayoutChoice::Planned,
            moe_miss: Default::default(),
            bus_rows: false,
            step_batching: Default::default(),
            prompt_steps: true,
            pins: Vec::new(),
            hardware: None,
        };
        let staging = crate::gpu::upload::DEFAULT_STAGING_BYTES;
        assert_eq!(load_host_bytes(&options, &model), staging);
        let minimum = crate::stream::minimum_ram_budget(&model);
        options.ram_budget = Some(minimum);
        assert_eq!(load_host_bytes(&options, &model), staging + minimum);
        // A budget past every expert allocates what every expert takes, no more.
        options.ram_budget = Some(u64::MAX / 2);
        let every = load_host_bytes(&options, &model) - staging;
        let cfg = model.config.moe.unwrap();
        let n_moe = model
            .layers
            .iter()
            .filter(|l| matches!(l.ffn, crate::model::Ffn::Moe(_)))
            .count() as u64;
        let buffer = minimum / (cfg.n_expert_used as u64 * 3);
        assert_eq!(every, n_moe * cfg.n_expert as u64 * 3 * buffer);
        // The CPU engine's RAM tier takes the same.
        options.device = DeviceChoice::Cpu;
        let cpu = load_host_bytes(&options, &model);
        options.ram_budget = None;
        assert_eq!(load_host_bytes(&options, &model), cpu - every);
    }
}

/// Reads every page of the weights once, so they are in RAM before the first request rather
/// than faulted in during it; with `skip_experts`, not the routed experts' stacks (a RAM tier
/// reads them from the file).
fn page_in(model: &Model, skip_experts: bool, progress: &mut impl FnMut(LoadProgress)) {
    const PAGE: usize = 4096;
    let experts = |name: &str| skip_experts && Group::of(name) == Group::RoutedExperts;
    let tensors: Vec<_> = model
        .file()
        .tensors()
        .iter()
        .filter(|t| !experts(&t.name))
        .collect();
    let total: u64 = tensors.iter().map(|t| t.n_bytes).sum();
    let mut done = 0u64;
    let mut next_report = 0u64;
    let mut sink = 0u8;
    for t in tensors {
        let data = model.file().tensor_data(t);
        for page in data.chunks(PAGE) {
            sink ^= page[0];
            done += page.len() as u64;
            if done >= next_report {
                progress(LoadProgress {
                    stage: "reading weights",
                    bytes_done: done,
                    bytes_total: total,
                });
                next_report = done + PROGRESS_STEP;
            }
        }
    }
    std::hint::black_box(sink);
    progress(LoadProgress {
        stage: "reading weights",
        bytes_done: total,
        bytes_total: total,
    });
}

/// The loaded models, in load order; the first is the default.
#[derive(Default)]
pub struct Registry {
    models: RwLock<Vec<Arc<LoadedModel>>>,
}

impl Registry {
    /// The model called `name`, or the default one for an empty name.
    pub fn get(&self, name: &str) -> Option<Arc<LoadedModel>> {
        let models = self.models.read();
        if name.is_empty() {
            return models.first().cloned();
        }
        models.iter().find(|m| m.name == name).cloned()
    }

    /// Whether a model's worker is recovering from a lost device.
    pub fn any_recovering(&self) -> bool {
        self.models.read().iter().any(|m| {
            m.worker
                .stats()
                .recovering
                .load(std::sync::atomic::Ordering::SeqCst)
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.models.read().iter().any(|m| m.name == name)
    }

    pub fn names(&self) -> Vec<String> {
        self.models.read().iter().map(|m| m.name.clone()).collect()
    }

    pub fn all(&self) -> Vec<Arc<LoadedModel>> {
        self.models.read().clone()
    }

    /// Adds a model, or gives it back when the name is taken.
    pub fn insert(&self, model: LoadedModel) -> Result<(), Box<LoadedModel>> {
        let mut models = self.models.write();
        if models.iter().any(|m| m.name == model.name) {
            return Err(Box::new(model));
        }
        models.push(Arc::new(model));
        Ok(())
    }

    /// Removes every model (at shutdown); the caller stops their workers.
    pub fn drain(&self) -> Vec<Arc<LoadedModel>> {
        std::mem::take(&mut *self.models.write())
    }

    /// Removes a model from the registry; the caller stops its worker.
    pub fn remove(&self, name: &str) -> Option<Arc<LoadedModel>> {
        let mut models = self.models.write();
        let i = models.iter().position(|m| m.name == name)?;
        Some(models.remove(i))
    }
}

/// A model's name from its file: the file stem (`qwen3-30b-q4_k_m.gguf` → `qwen3-30b-q4_k_m`).
pub fn name_from_path(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "model".into())
}
