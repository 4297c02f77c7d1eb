//! `spillwayd plan --model FILE.gguf --vram-budget 8GiB [--profile P] [--pin 'RE=DEV']... [--json]`:
//! where each tensor would go and the predicted decode speed, before anything is loaded.
//! `--device cpu` plans for the CPU alone; `--resident-experts N` predicts the placement the
//! GPU runs today (N routed experts per layer in VRAM, the rest on the CPU) instead.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use spillway_daemon::gguf::GgufFile;
pub use spillway_daemon::plan::{load_profile, model_desc};
use spillway_sched::plan::{plan, with_resident_experts, Pin, PlanOptions};
use spillway_sched::ByteSize;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The GGUF file (only its header is read).
    #[arg(long)]
    pub model: PathBuf,
    /// A hardware profile: a TOML file, or a shipped one (laptop-8gb, desktop-24gb, h200).
    #[arg(long)]
    pub profile: Option<String>,
    /// VRAM the plan may use (required unless --device cpu).
    #[arg(long)]
    pub vram_budget: Option<ByteSize>,
    /// `vulkan`: plan for the GPU and the CPU; `cpu`: for the CPU alone.
    #[arg(long, default_value = "vulkan", value_parser = ["vulkan", "cpu"])]
    pub device: String,
    /// Predict this placement instead of planning one: every tensor but the routed experts in
    /// VRAM, N routed experts per layer in VRAM (all of them when N is at least their count)
    /// and the others on the CPU.
    #[arg(long, value_name = "N")]
    pub resident_experts: Option<u32>,
    /// RAM the plan may use; default: all the profile's RAM.
    #[arg(long)]
    pub ram_budget: Option<ByteSize>,
    /// PATTERN=DEVICE (gpu, stream or cpu); the first matching pin wins. Repeatable.
    #[arg(long = "pin")]
    pub pins: Vec<Pin>,
    /// Tokens of context to size the KV cache for.
    #[arg(long, default_value_t = 4096)]
    pub context: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let profile = load_profile(args.profile.as_deref())?;
    let file = GgufFile::open_structure_only(&args.model)
        .with_context(|| format!("reading {}", args.model.display()))?;
    let model = model_desc(&args.model.display().to_string(), &file)?;
    let cpu_only = args.device == "cpu";
    let vram_budget = match (args.vram_budget, cpu_only) {
        (Some(b), _) => b,
        (None, true) => ByteSize(0),
        (None, false) => {
            bail!("--vram-budget is needed to plan for the GPU (or pass --device cpu)")
        }
    };
    let mut opts = PlanOptions::new(vram_budget, args.ram_budget.unwrap_or(profile.ram.memory));
    opts.pins = args.pins.clone();
    opts.context = args.context;
    opts.cpu_only = cpu_only;
    let mut plan = plan(&model, &profile, &opts)?;
    if let Some(n) = args.resident_experts {
        if cpu_only {
            bail!("--resident-experts places experts in VRAM: it needs --device vulkan");
        }
        plan = with_resident_experts(&plan, &model, &profile, &opts, n)
            .context("re-predicting the plan with a fixed placement")?;
    }
    let mut text = String::new();
    if args.json {
        text = plan.to_json();
        text.push('\n');
    } else {
        plan.write_table(&mut text)?;
    }
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()) {
        // `spillwayd plan ... | head` closing the pipe is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing to stdout"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_daemon::gguf::writer::{GgufWriter, TensorSpec};
    use spillway_daemon::gguf::{GgmlType, Value};
    use spillway_sched::model::presets::{find, Quant};
    use spillway_sched::plan::Placement;

    #[test]
    fn plans_a_moe_gguf_from_its_header() {
        // The scheduler's tiny Qwen3-MoE preset, written as a GGUF with empty tensor data.
        let want = find("tiny-qwen3moe").unwrap().describe(&Quant::Q4KM);
        let specs: Vec<TensorSpec> = want
            .tensors
            .iter()
            .map(|t| {
                let ty = GgmlType::from_name(t.weight_type.name()).unwrap();
                TensorSpec::new(t.name.clone(), ty, &t.shape)
            })
            .collect();
        let u = |k: &str, v: u32| (format!("qwen3moe.{k}"), Value::U32(v));
        let metadata = vec![
            (
                "general.architecture".to_string(),
                Value::String("qwen3moe".into()),
            ),
            u("block_count", 2),
            u("embedding_length", 256),
            u("attention.head_count", 4),
            u("attention.head_count_kv", 2),
            u("attention.key_length", 128),
            u("expert_count", 16),
            u("expert_used_count", 4),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let mut w = GgufWriter::create(&path, &metadata, &specs).unwrap();
        for s in &specs {
            w.skip_tensor(&s.name).unwrap();
        }
        w.finish().unwrap();

        let file = GgufFile::open_structure_only(&path).unwrap();
        let got = model_desc("tiny", &file).unwrap();
        assert_eq!(got.tensors, want.tensors);
        assert_eq!(got.experts, want.experts);
        assert_eq!(got.kv_bytes_per_token(), want.kv_bytes_per_token());

        let profile = load_profile(Some("laptop-8gb")).unwrap();
        let mut opts = PlanOptions::new(ByteSize(1 << 30), ByteSize(1 << 30));
        opts.pins = vec!["ffn_down_exps=cpu".parse().unwrap()];
        let plan = plan(&got, &profile, &opts).unwrap();
        let Some(Placement::Experts(e)) = plan.placement("blk.1.ffn_down_exps.weight") else {
            panic!("{}", plan.to_json())
        };
        assert_eq!(e.cpu.len(), 16);
        assert!(load_profile(None).is_err());
    }
}
