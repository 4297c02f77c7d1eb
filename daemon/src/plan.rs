//! The scheduler's plans for the daemon: a model file as the planner sees it ([`model_desc`],
//! [`kv_positions`]), hardware profiles by name or file ([`load_profile`]), the VRAM experts per
//! MoE layer a plan gives a model on the GPU ([`expert_slots`], which `--expert-layout planned`
//! and LoadModel's pins run), and the pins such a model can run ([`check_gpu_pins`], which the
//! Plan call applies too).

use spillway_sched::model::{ExpertRouting, ModelDesc, TensorDesc, WeightType};
use spillway_sched::plan::{minimum_vram, plan, Pin, Placement, Plan, PlanOptions};
use spillway_sched::profile::HardwareProfile;
use spillway_sched::simulate::{shipped_profile, SHIPPED_PROFILES};
use spillway_sched::ByteSize;

use crate::gguf::{GgufError, GgufFile, Metadata};

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("reading the model's header: {0}")]
    Header(#[source] GgufError),
    #[error("model metadata: {0}")]
    Metadata(#[from] GgufError),
    #[error("the model has no general.architecture")]
    NoArchitecture,
    #[error(transparent)]
    Model(#[from] spillway_sched::model::ModelError),
    #[error(transparent)]
    Plan(#[from] spillway_sched::plan::PlanError),
    #[error(
        "no hardware profile named: pass a TOML file from `spillwayd calibrate` or one of {0}"
    )]
    NoProfile(String),
    #[error("hardware profile {name}: {message}")]
    Profile { name: String, message: String },
    #[error(
        "pin `{pin}` puts {tensor} on the {tier}: a model on the GPU keeps every tensor but its \
         routed experts in VRAM, so pins can place only expert stacks (`ffn_*_exps`)"
    )]
    PinnedOffVram {
        pin: String,
        tensor: String,
        tier: &'static str,
    },
    #[error("the model has no stacked routed experts for a plan to place")]
    NotMoe,
}

/// The hardware profile `name` names: a shipped one (laptop-8gb, desktop-24gb, h200,
/// h200-calibrated) or a TOML file.
pub fn load_profile(name: Option<&str>) -> Result<HardwareProfile, PlanError> {
    let shipped: Vec<&str> = SHIPPED_PROFILES.iter().map(|p| p.0).collect();
    let Some(name) = name else {
        return Err(PlanError::NoProfile(shipped.join(", ")));
    };
    let bad = |message: String| PlanError::Profile {
        name: name.to_string(),
        message,
    };
    if let Some(p) = shipped_profile(name) {
        return p.map_err(|e| bad(e.to_string()));
    }
    let text = std::fs::read_to_string(name).map_err(|e| bad(e.to_string()))?;
    HardwareProfile::from_toml(&text).map_err(|e| bad(e.to_string()))
}

/// The scheduler's view of a GGUF file: every tensor with its type, shape and bytes, and the
/// few hyper-parameters that size the KV cache and route experts.
pub fn model_desc(name: &str, file: &GgufFile) -> Result<ModelDesc, PlanError> {
    let md: &Metadata = file.metadata();
    let arch = file.architecture().ok_or(PlanError::NoArchitecture)?;
    let key = |k: &str| format!("{arch}.{k}");
    let n_layer = md.get_u32(&key("block_count"))?;
    let n_embd = u64::from(md.get_u32(&key("embedding_length"))?);
    let n_head = u64::from(md.get_u32(&key("attention.head_count"))?);
    let n_head_kv = md
        .opt_u32(&key("attention.head_count_kv"))?
        .map_or(n_head, u64::from);
    let head_dim = md
        .opt_u32(&key("attention.key_length"))?
        .map_or(n_embd / n_head.max(1), u64::from);
    let experts = match md.opt_u32(&key("expert_count"))? {
        Some(count) if count > 0 => Some(ExpertRouting {
            count,
            used: md.get_u32(&key("expert_used_count"))?,
            probabilities: None,
        }),
        _ => None,
    };
    let tensors = file
        .tensors()
        .iter()
        .map(|t| {
            TensorDesc::new(
                &t.name,
                WeightType::new(t.ggml_type.name()),
                &t.dims,
                t.n_bytes,
            )
        })
        .collect();
    let model = ModelDesc {
        name: md
            .opt_str("general.name")?
            .map_or_else(|| name.to_string(), str::to_string),
        n_layer,
        n_embd,
        n_head_kv,
        head_dim,
        experts,
        tensors,
    };
    model.validate()?;
    Ok(model)
}

/// KV cache positions the engines give a model of `file` for a requested `context`: 0 means
/// the model's context length (4096 when its metadata has none), at most 4096.
pub fn kv_positions(file: &GgufFile, context: usize) -> Result<u64, PlanError> {
    if context > 0 {
        return Ok(context as u64);
    }
    let arch = file.architecture().ok_or(PlanError::NoArchitecture)?;
    let length = file
        .metadata()
        .opt_u32(&format!("{arch}.context_length"))?
        .unwrap_or(4096);
    Ok(u64::from(length.min(4096)))
}

/// Refuses a plan for a model on the GPU that pins a tensor off VRAM which the GPU model keeps
/// there: everything but its routed experts.
pub fn check_gpu_pins(plan: &Plan) -> Result<(), PlanError> {
    for t in &plan.tensors {
        let tier = match &t.placement {
            Placement::Vram | Placement::Experts(_) => continue,
            Placement::Stream { .. } => "stream",
            Placement::Cpu { .. } => "CPU",
        };
        if let Some(pin) = &t.pinned {
            return Err(PlanError::PinnedOffVram {
                pin: pin.clone(),
                tensor: t.name.clone(),
                tier,
            });
        }
    }
    Ok(())
}

/// VRAM experts per MoE layer (in layer order) of the plan for `file` on `profile` with
/// `pins`, given `expert_room` bytes of VRAM for routed experts (what the GPU model's budget
/// leaves after everything else it keeps there): what the GPU model runs as
/// [`crate::gpu::placement::ExpertLayout::Given`]. The planner's own reserve (its KV cache,
/// activations and slack, which differ from the GPU model's) is added to the room, so the plan
/// divides the same expert bytes the model has. Pins that would move anything but routed
/// experts off VRAM are refused, since the GPU model keeps the rest there.
pub fn expert_slots(
    file: &GgufFile,
    profile: &HardwareProfile,
    expert_room: u64,
    ram_budget: Option<u64>,
    context: usize,
    pins: &[Pin],
) -> Result<Vec<usize>, PlanError> {
    let desc = model_desc("model", file)?;
    let mut opts = PlanOptions::new(ByteSize(0), ram_budget.map_or(profile.ram.memory, ByteSize));
    opts.context = match context {
        0 => 4096,
        n => n as u64,
    };
    let reserve = minimum_vram(&desc, profile, &opts)?;
    opts.vram_budget = ByteSize(
        reserve
            .0
            .saturating_add(expert_room)
            .min(profile.gpu.memory.0),
    );
    opts.pins = pins.to_vec();
    let plan = plan(&desc, profile, &opts)?;
    check_gpu_pins(&plan)?;
    let slots: Vec<usize> = (0..desc.n_layer)
        .filter_map(
            |l| match plan.placement(&format!("blk.{l}.ffn_gate_exps.weight")) {
                Some(Placement::Experts(e)) => Some(e.vram.len()),
                _ => None,
            },
        )
        .collect();
    if slots.is_empty() {
        return Err(PlanError::NotMoe);
    }
    Ok(slots)
}

/// Bytes of VRAM a GPU model of `model` under `vram_budget` has for routed experts: the
/// budget less what it keeps besides them; every expert's bytes when it has no budget; `None`
/// for a dense model.
pub fn expert_room(
    device: &std::sync::Arc<crate::gpu::Device>,
    model: &crate::model::Model,
    options: &crate::gpu::forward::GpuModelOptions,
) -> Option<u64> {
    use crate::gpu::forward::GpuModel;
    let all = GpuModel::device_bytes(model, options).experts;
    if all == 0 {
        return None;
    }
    let minimum = GpuModel::minimum_budget(device, model, options)?;
    Some(match options.vram_budget {
        Some(b) => b
            .saturating_sub(minimum.total() - minimum.one_slot_per_layer)
            .min(all),
        None => all,
    })
}

/// The layout that runs the plan for a GPU model of `model` under `options`' VRAM budget and
/// context, with `pins`: [`expert_room`] given to [`expert_slots`].
pub fn planned_layout(
    device: &std::sync::Arc<crate::gpu::Device>,
    model: &crate::model::Model,
    options: &crate::gpu::forward::GpuModelOptions,
    profile: &HardwareProfile,
    pins: &[Pin],
) -> Result<crate::gpu::placement::ExpertLayout, PlanError> {
    let room = expert_room(device, model, options).ok_or(PlanError::NotMoe)?;
    let slots = expert_slots(
        model.file(),
        profile,
        room,
        options.ram_budget,
        options.context,
        pins,
    )?;
    Ok(crate::gpu::placement::ExpertLayout::Given(slots))
}
