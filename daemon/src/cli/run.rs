//! `spillwayd run --model M (--prompt TEXT | --prompt-tokens 1,2,3)`: one generation without a
//! server, on the CPU reference engine or (`--device vulkan[:N]`) the GPU's decode path, printing
//! the generated text as it comes (or the ids, when the model has no usable tokenizer), or a JSON
//! report. Both devices share the request handling and the sampler.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use clap::Args;
use serde::Serialize;
use spillway_daemon::engine::generate::{
    generate_with, model_eos_token, GenerateRequest, Generation, Prompt,
};
use spillway_daemon::engine::{Engine, EngineOptions, RamExperts, RamTierStats, SamplerConfig};
use spillway_daemon::gpu::expert_cache::ExpertStats;
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::placement::{ExpertLayout, MoeMiss};
use spillway_daemon::gpu::{Device, GpuError};
use spillway_daemon::model::Model;
use spillway_daemon::server::device::{self, OpenError};
use spillway_daemon::stream::{open_expert_cache, ReplacementPolicy};
use spillway_daemon::tokenizer::Tokenizer;
use spillway_sched::plan::Pin;
use spillway_sched::ByteSize;

/// Where `run` computes: `cpu`, `vulkan` (the preferred Vulkan device) or `vulkan:N` (device N
/// of `spillwayd devices`).
pub use spillway_daemon::server::device::DeviceChoice as RunDevice;

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// The GGUF model file.
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt text, tokenized with the model's tokenizer (BOS added when its metadata says so;
    /// control tokens such as `<|im_start|>` are recognised).
    #[arg(
        long,
        required_unless_present = "prompt_tokens",
        conflicts_with = "prompt_tokens"
    )]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prompt_tokens: Vec<u32>,
    /// Stop when the generated text contains this string (repeatable); the string is not output.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Where to run: `cpu` (the reference engine), `vulkan` (the preferred Vulkan device) or
    /// `vulkan:N` (device N of `spillwayd devices`).
    #[arg(long, default_value = "cpu")]
    pub device: RunDevice,
    /// Ceiling on the device memory the model may take with `--device vulkan` (e.g. 512MiB, 8G).
    /// A MoE model over it keeps as many routed experts per layer in VRAM as fit.
    #[arg(long)]
    pub vram_budget: Option<ByteSize>,
    /// RAM for a MoE model's routed experts computed on the CPU (all of them with `--device
    /// cpu`, those not in VRAM with `--device vulkan`), e.g. 4GiB: a cache that reads the
    /// others from the model file (io_uring, O_DIRECT) as tokens need them, so a model larger
    /// than RAM runs. Without it they are read through the memory map.
    #[arg(long)]
    pub ram_budget: Option<ByteSize>,
    /// With `--device cpu --ram-budget`: while a decode step computes a layer, read the
    /// experts the next layer's router picks for the current hidden state (while at least 60%
    /// of such predictions are right), and cancel those its real routing does not choose. Off
    /// by default: on the synthetic models measured so far the wrong ones' reads cost the disk
    /// what the right ones gained (`bench/RESULTS.md`).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub predict_experts: bool,
    /// A routed expert not in VRAM: `cpu` computes it on the CPU while the GPU runs the others,
    /// `fetch` copies it into a VRAM slot first, `pcie` keeps every routed expert in system RAM
    /// too and has the GPU read the missing ones from there over the bus (a step is then one
    /// submission, with no host turn between layers); `split` keeps them in system RAM too and
    /// shares each layer's misses between the CPU and the bus in the proportion measured to give
    /// the fastest steps; `auto`: on a GPU across a bus with RAM for the experts, `pcie`, or
    /// `split` where the VRAM budget holds under a sixteenth of the experts; else `cpu`.
    #[arg(long, default_value = "auto")]
    pub moe_miss: MoeMiss,
    /// A dense model over --vram-budget runs its first layers on the CPU; with this, each
    /// decode product of those layers is shared with the GPU, which reads its rows from a copy
    /// of them in system RAM over the bus while the CPU computes the rest (the shares balanced
    /// as they run). The copy takes those layers' size in RAM.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub bus_rows: bool,
    /// With `--moe-miss cpu` or `pcie`, keep in VRAM the routed experts the slots were loaded with. By
    /// default the experts used most come into the slots of residents used less between steps.
    #[arg(long)]
    pub static_experts: bool,
    /// How the expert slots the VRAM budget holds are spread over the MoE layers: `even` (the
    /// same number in each), `layers` (whole layers from the last back, the others one slot,
    /// as llama.cpp's --n-cpu-moe), `cpu` (one slot a layer) or `planned` (the scheduler's
    /// plan on --hardware-profile).
    #[arg(long, default_value = "even")]
    pub expert_layout: String,
    /// PATTERN=DEVICE (gpu or cpu) over routed expert stacks (`ffn_*_exps`), as llama.cpp's
    /// -ot: the placement is then the scheduler's plan around them (repeatable; needs
    /// --hardware-profile). One slot per MoE layer always stays in VRAM.
    #[arg(long = "pin")]
    pub pins: Vec<Pin>,
    /// The hardware profile `--expert-layout planned` plans on: a TOML file from
    /// `spillwayd calibrate`, or a shipped one (laptop-8gb, desktop-24gb, h200).
    #[arg(long)]
    pub hardware_profile: Option<String>,
    /// Which VRAM expert a fetch or a promotion replaces, and which expert the RAM tier of
    /// `--ram-budget` drops: `lru` or `lfu`.
    #[arg(long, default_value = "lru", value_parser = parse_policy)]
    pub expert_cache: ReplacementPolicy,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens below this fraction of the best one's probability (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// For every prompt position, report the top-K log-probabilities of the next token.
    #[arg(long, default_value_t = 0)]
    pub prompt_logprobs: usize,
    /// Kernel threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV cache positions (default: the model's context, at most 4096).
    #[arg(long, default_value_t = 0)]
    pub ctx: usize,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print a JSON report instead of the token ids.
    #[arg(long)]
    pub json: bool,
}

/// What `--json` prints: the generation, plus how long loading took, the device and (on the
/// CPU) the threads used.
#[derive(Debug, Serialize)]
struct RunReport {
    #[serde(flatten)]
    generation: Generation,
    load_ms: f64,
    device: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    threads: Option<usize>,
    /// Where a MoE model's routed experts ran (GPU only).
    #[serde(skip_serializing_if = "Option::is_none")]
    experts: Option<ExpertsReport>,
    /// The CPU engine's RAM tier of routed experts, under `--ram-budget`.
    #[serde(skip_serializing_if = "Option::is_none")]
    ram_tier: Option<RamTierStats>,
    /// Its counters when the first generated token came (the rest is what decoding read).
    #[serde(skip_serializing_if = "Option::is_none")]
    ram_tier_after_prompt: Option<RamTierStats>,
    /// Bytes the process had read from storage (`read_bytes` of `/proc/self/io`: the RAM
    /// tier's reads and the memory map's page faults) when the first generated token came,
    /// and at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    read_bytes_after_prompt: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    read_bytes_at_end: Option<u64>,
}

/// `read_bytes` of `/proc/self/io`: what this process has read from storage, page cache
/// misses and O_DIRECT reads alike; `None` where the kernel does not say.
fn storage_read_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// `--json`'s summary of [`ExpertStats`].
#[derive(Debug, Serialize)]
struct ExpertsReport {
    miss: String,
    slots_per_layer: usize,
    n_expert: usize,
    hits: u64,
    misses: u64,
    cpu: u64,
    fetched: u64,
    pcie: u64,
    evictions: u64,
    bytes_uploaded: u64,
    promoted: u64,
}

impl From<&ExpertStats> for ExpertsReport {
    fn from(s: &ExpertStats) -> ExpertsReport {
        let t = s.total();
        ExpertsReport {
            miss: s.miss.to_string(),
            slots_per_layer: s.slots,
            n_expert: s.n_expert,
            hits: t.hits,
            misses: t.misses,
            cpu: t.cpu,
            fetched: t.fetched,
            pcie: t.pcie,
            evictions: t.evictions,
            bytes_uploaded: t.bytes_uploaded,
            promoted: t.promoted,
        }
    }
}

fn parse_policy(s: &str) -> Result<ReplacementPolicy, String> {
    match s {
        "lru" => Ok(ReplacementPolicy::Lru),
        "lfu" => Ok(ReplacementPolicy::LFU),
        _ => Err(format!("`{s}` is not a cache policy: use lru or lfu")),
    }
}

/// `--expert-layout`, with `planned` (or any `--pin`) made into the plan's VRAM experts per
/// MoE layer.
fn expert_layout(
    args: &RunArgs,
    device: &Arc<Device>,
    model: &Model,
) -> anyhow::Result<ExpertLayout> {
    if args.expert_layout != "planned" && args.pins.is_empty() {
        if args.hardware_profile.is_some() {
            bail!("--hardware-profile is for --expert-layout planned (or --pin)");
        }
        return args.expert_layout.parse().map_err(anyhow::Error::msg);
    }
    if !matches!(args.expert_layout.as_str(), "planned" | "even") {
        bail!("--pin places experts by the scheduler's plan: it takes --expert-layout planned");
    }
    let Some(name) = &args.hardware_profile else {
        bail!(
            "--expert-layout planned and --pin plan on a hardware profile: give --hardware-profile"
        );
    };
    let profile = spillway_daemon::plan::load_profile(Some(name))?;
    let sized = GpuModelOptions {
        vram_budget: args.vram_budget.map(|b| b.0),
        ram_budget: args.ram_budget.map(|b| b.0),
        context: args.ctx,
        ..GpuModelOptions::default()
    };
    spillway_daemon::plan::planned_layout(device, model, &sized, &profile, &args.pins)
        .context("planning the placement")
}

/// The model loaded on the device `run` was given.
enum Loaded {
    Cpu { engine: Engine, threads: usize },
    Gpu { model: Box<GpuModel>, name: String },
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    if args.vram_budget.is_some() && args.device == RunDevice::Cpu {
        bail!("--vram-budget applies to --device vulkan, not cpu");
    }
    let start = Instant::now();
    let model = Arc::new(
        Model::open(&args.model).with_context(|| format!("loading {}", args.model.display()))?,
    );
    if args.ram_budget.is_some() && args.device == RunDevice::Cpu && model.config.moe.is_none() {
        bail!(
            "--ram-budget bounds the RAM of a MoE model's routed experts, and this model has \
             none: on the CPU its weights are read through the memory map"
        );
    }
    let tokenizer = Tokenizer::from_metadata(model.file().metadata());
    if let (Some(_), Err(e)) = (&args.prompt, &tokenizer) {
        bail!("--prompt needs the model's tokenizer, which is unusable: {e}");
    }
    let eos = model_eos_token(&model);
    let mut loaded = match args.device {
        RunDevice::Cpu => {
            let mut options = EngineOptions {
                context: args.ctx,
                ..EngineOptions::default()
            };
            if let Some(t) = args.threads {
                options.threads = t.max(1);
            }
            let threads = options.threads;
            let mut engine = Engine::new(model.clone(), &options);
            if let Some(budget) = args.ram_budget {
                let cache = open_expert_cache(&model, budget.0, args.expert_cache)
                    .context("opening the RAM tier of the routed experts")?;
                engine = engine.with_ram_experts(Arc::new(RamExperts::new(
                    &model,
                    cache,
                    args.predict_experts,
                )));
            }
            Loaded::Cpu { engine, threads }
        }
        RunDevice::Vulkan(index) => {
            let device = open_vulkan(index)?;
            let info = device.info();
            let name = format!("vulkan:{} ({})", info.index, info.name);
            let options = GpuModelOptions {
                vram_budget: args.vram_budget.map(|b| b.0),
                context: args.ctx,
                moe_miss: args.moe_miss,
                expert_layout: expert_layout(&args, &device, &model)?,
                expert_policy: args.expert_cache,
                threads: args.threads.unwrap_or(0),
                host_routing: false,
                ram_budget: args.ram_budget.map(|b| b.0),
                promote_experts: !args.static_experts,
                bus_rows: args.bus_rows,
                ..GpuModelOptions::default()
            };
            let gpu = load_on_gpu(&device, &model, &options)
                .with_context(|| format!("loading {} onto {name}", args.model.display()))?;
            if gpu.cpu_layers() > 0 {
                let bus = match gpu.bus_rows_cpu_shares() {
                    Some(_) => ", sharing their decode products' rows with the GPU over the bus",
                    None => "",
                };
                eprintln!(
                    "the VRAM budget holds layers {}..{} of {}: layers 0..{} run on the CPU{bus}",
                    gpu.cpu_layers(),
                    model.config.n_layer,
                    model.config.n_layer,
                    gpu.cpu_layers()
                );
            }
            let p = gpu.placement();
            if p.is_partial() {
                let prompts = match p.stream_slot {
                    true => format!(
                        "prompt chunks run the others on the GPU through {} slots",
                        p.prompt_expert_slots
                    ),
                    false => "prompts go token by token".to_string(),
                };
                eprintln!(
                    "the VRAM budget holds {} of {} experts per MoE layer; {prompts}",
                    p.slots, p.n_expert
                );
            }
            Loaded::Gpu {
                model: Box::new(gpu),
                name,
            }
        }
    };
    let load_ms = start.elapsed().as_secs_f64() * 1e3;

    let request = GenerateRequest {
        prompt: match &args.prompt {
            Some(text) => Prompt::Text(text.clone()),
            None => Prompt::Tokens(args.prompt_tokens.clone()),
        },
        max_tokens: args.max_tokens,
        sampling: SamplerConfig {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repeat_penalty,
            seed: args.seed,
            ..SamplerConfig::default()
        },
        stop: args.stop.clone(),
        prompt_logprobs: args.prompt_logprobs,
        ignore_eos: args.ignore_eos,
    };
    let stream_text = !args.json;
    // The RAM tier's counters when the first token comes: what decoding alone read.
    let ram = match &loaded {
        Loaded::Cpu { engine, .. } => engine.ram_experts_shared(),
        Loaded::Gpu { .. } => None,
    };
    let (mut after_prompt, mut read_after_prompt) = (None, None);
    let on_text = |piece: &str| {
        if read_after_prompt.is_none() {
            after_prompt = ram.as_ref().map(|r| r.stats());
            read_after_prompt = storage_read_bytes();
        }
        if stream_text {
            print_out(piece);
        }
    };
    let tokenizer = tokenizer.as_ref().ok();
    let generation = match &mut loaded {
        Loaded::Cpu { engine, .. } => generate_with(engine, eos, tokenizer, &request, on_text)?,
        Loaded::Gpu { model, .. } => {
            generate_with(model.as_mut(), eos, tokenizer, &request, on_text)?
        }
    };
    let (device, threads, experts, ram_tier) = match &loaded {
        Loaded::Cpu { threads, engine } => (
            "cpu".to_string(),
            Some(*threads),
            None,
            engine.ram_experts().map(RamExperts::stats),
        ),
        Loaded::Gpu { name, model } => (name.clone(), None, model.expert_stats(), None),
    };
    if let Some(e) = &experts {
        eprintln!("{}", e.summary());
    }
    if let Some(r) = &ram_tier {
        eprintln!("{}", r.summary());
    }
    if args.json {
        let report = RunReport {
            generation,
            load_ms,
            device,
            threads,
            experts: experts.as_ref().map(ExpertsReport::from),
            ram_tier,
            ram_tier_after_prompt: after_prompt,
            read_bytes_after_prompt: read_after_prompt,
            read_bytes_at_end: storage_read_bytes(),
        };
        print_out(&(serde_json::to_string(&report)? + "\n"));
        return Ok(());
    }
    if generation.text.is_some() {
        print_out("\n");
    } else {
        let ids: Vec<String> = generation.tokens.iter().map(u32::to_string).collect();
        print_out(&(ids.join(",") + "\n"));
    }
    let t = &generation.timings;
    let on = match threads {
        Some(n) => format!("{n} threads"),
        None => device,
    };
    eprintln!(
        "prompt: {} tokens in {:.1} ms ({:.1} tok/s); generated {} tokens in {:.1} ms \
         ({:.2} tok/s); {on}; {:?}",
        generation.prompt_tokens.len(),
        t.prompt_ms,
        t.prompt_tokens_per_s,
        generation.tokens.len(),
        t.generate_ms,
        t.tokens_per_s,
        generation.finish_reason
    );
    Ok(())
}

/// The Vulkan device `--device vulkan[:N]` names, with errors that say what the machine has.
fn open_vulkan(index: Option<usize>) -> anyhow::Result<Arc<Device>> {
    let wanted = RunDevice::Vulkan(index);
    device::open_vulkan(index).map_err(|e| match e {
        OpenError::Unavailable(GpuError::NoDevice) => {
            anyhow!("--device {wanted}: no Vulkan device found (`spillwayd devices` lists them)")
        }
        e => anyhow!("--device {wanted}: {e}"),
    })
}

/// Uploads `model`; running out of the budget while uploading says what the model needs.
fn load_on_gpu(
    device: &Arc<Device>,
    model: &Arc<Model>,
    options: &GpuModelOptions,
) -> anyhow::Result<GpuModel> {
    device::load_gpu_model(device, model, options).map_err(|(_, message)| anyhow!(message))
}

fn print_out(text: &str) {
    let mut stdout = std::io::stdout().lock();
    // A closed pipe (`| head`) is not an error worth reporting.
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
}
