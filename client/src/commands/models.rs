//! Model management: `models`, `load` (with a progress bar, or `--plan` for the scheduler's
//! plan of the load), `unload`, `ps`.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use clap::Args;
use spillway_proto::v1 as pb;

use crate::connect::Client;
use crate::exit::Failure;

#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// The GGUF file, as the daemon sees it (a relative path is made absolute here).
    pub path: PathBuf,
    /// Name to serve it under (default: the file name without `.gguf`).
    #[arg(long, default_value = "")]
    pub name: String,
    /// KV cache positions (default: the model's context, at most 4096).
    #[arg(long, default_value_t = 0)]
    pub ctx: u32,
    /// Where it runs: `cpu`, `vulkan` or `vulkan:N` (default: the daemon's --device).
    #[arg(long, default_value = "")]
    pub device: String,
    /// Device memory this model may hold on a Vulkan device, e.g. `6GiB` (default: the
    /// daemon's --vram-budget); routed experts beyond it run on the CPU.
    #[arg(long)]
    pub vram_budget: Option<spillway_sched::ByteSize>,
    /// RAM for the routed experts a model on a Vulkan device computes on the CPU, e.g. `4GiB`
    /// (default: the daemon's --ram-budget); the others are read from the file as needed.
    #[arg(long)]
    pub ram_budget: Option<spillway_sched::ByteSize>,
    /// PATTERN=DEVICE (`gpu` or `cpu`): a regular expression over tensor names, as llama.cpp's
    /// -ot, placing routed expert stacks (`ffn_*_exps`); the daemon plans around the pins on
    /// its hardware profile. Repeatable; the first matching pin wins.
    #[arg(long = "pin", value_parser = parse_pin)]
    pub pins: Vec<pb::TensorPin>,
    /// Load nothing: print the scheduler's plan for this load instead, as `spillwayd plan`
    /// does: where each tensor (each expert, for MoE models) would go under the budgets and
    /// pins, the predicted decode tokens/s and the bottleneck (GPU, CPU, PCIe or SSD). The
    /// daemon plans from the file's header on its hardware profile (`spillwayd serve
    /// --hardware-profile`); without --device vulkan (or a daemon on one) the plan is for the
    /// CPU alone.
    #[arg(long)]
    pub plan: bool,
    /// With --plan: print the plan as JSON, as `spillwayd plan --json`.
    #[arg(long, requires = "plan")]
    pub json: bool,
}

/// `PATTERN=DEVICE`, split at the last `=` (a pattern may hold one).
fn parse_pin(s: &str) -> Result<pb::TensorPin, String> {
    let (pattern, placement) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{s}` is not PATTERN=DEVICE (gpu, stream or cpu)"))?;
    Ok(pb::TensorPin {
        pattern: pattern.to_string(),
        placement: placement.to_string(),
    })
}

pub async fn models(client: &mut Client) -> Result<(), Failure> {
    let list = client
        .list_models(pb::ListModelsRequest {})
        .await?
        .into_inner();
    if list.models.is_empty() {
        println!("no model is loaded; load one with `spillway load MODEL.gguf`");
        return Ok(());
    }
    println!(
        "{:<24} {:<10} {:>10} {:>10} {:>8}  PATH",
        "NAME", "ARCH", "PARAMS", "SIZE", "CONTEXT"
    );
    for m in list.models {
        let name = if m.is_default {
            format!("{} (default)", m.name)
        } else {
            m.name
        };
        println!(
            "{:<24} {:<10} {:>10} {:>10} {:>8}  {}",
            name,
            m.architecture,
            human_count(m.parameters),
            human_bytes(m.file_bytes),
            m.context_length,
            m.path
        );
    }
    Ok(())
}

pub async fn load(client: &mut Client, args: &LoadArgs) -> Result<(), Failure> {
    let path = std::path::absolute(&args.path).unwrap_or_else(|_| args.path.clone());
    let request = pb::LoadModelRequest {
        path: path.display().to_string(),
        name: args.name.clone(),
        context_length: args.ctx,
        device: args.device.clone(),
        budgets: (args.vram_budget.is_some() || args.ram_budget.is_some()).then(|| pb::Budgets {
            vram_bytes: args.vram_budget.map_or(0, |b| b.0),
            ram_bytes: args.ram_budget.map_or(0, |b| b.0),
        }),
        pins: args.pins.clone(),
    };
    if args.plan {
        return plan(client, request, args.json).await;
    }
    let mut stream = client.load_model(request).await?.into_inner();
    let bar = std::io::stderr().is_terminal();
    let mut last_stage = String::new();
    while let Some(p) = stream.message().await? {
        if p.ready {
            if bar {
                eprint!("\r\x1b[K");
            }
            eprintln!("loaded {} ({})", path.display(), human_bytes(p.bytes_total));
            return Ok(());
        }
        if bar {
            eprint!("\r\x1b[K{}", progress_line(&p, 30));
            let _ = std::io::stderr().flush();
        } else if p.stage != last_stage {
            eprintln!("{}", p.stage);
            last_stage = p.stage.clone();
        }
    }
    Err(Failure::new(
        1,
        "the load stream ended before the model was ready",
    ))
}

/// `spillway load --plan`: the daemon's plan of the load, as a table or JSON on stdout.
async fn plan(client: &mut Client, load: pb::LoadModelRequest, json: bool) -> Result<(), Failure> {
    let plan = client
        .plan(pb::PlanRequest { load: Some(load) })
        .await?
        .into_inner();
    let text = if json {
        format!("{}\n", plan.json)
    } else {
        plan.table
    };
    // A closed pipe (`| head`) ends the output, not the program with an error.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    eprintln!(
        "nothing was loaded; hardware profile: {}",
        plan.hardware_profile
    );
    Ok(())
}

/// `reading weights [#######-------]  42% 1.2 GiB / 2.9 GiB`
fn progress_line(p: &pb::LoadModelProgress, width: usize) -> String {
    let frac = if p.bytes_total > 0 {
        (p.bytes_done as f64 / p.bytes_total as f64).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let filled = (frac * width as f64).round() as usize;
    format!(
        "{} [{}{}] {:>3.0}% {} / {}",
        p.stage,
        "#".repeat(filled),
        "-".repeat(width - filled),
        frac * 100.0,
        human_bytes(p.bytes_done),
        human_bytes(p.bytes_total)
    )
}

pub async fn unload(client: &mut Client, name: &str) -> Result<(), Failure> {
    client
        .unload_model(pb::UnloadModelRequest {
            name: name.to_string(),
        })
        .await?;
    eprintln!("unloaded {name}");
    Ok(())
}

pub async fn ps(client: &mut Client) -> Result<(), Failure> {
    let status = client.status(pb::StatusRequest {}).await?.into_inner();
    let memory = format!(
        "daemon: {} resident, {} of Vulkan memory",
        human_bytes(status.rss_bytes),
        human_bytes(status.device_memory_bytes)
    );
    if status.models.is_empty() {
        println!("no model is loaded ({memory})");
        return Ok(());
    }
    println!(
        "{:<24} {:<8} {:>20} {:>10} {:>7} {:>8}",
        "NAME", "DEVICE", "WEIGHTS", "KV CACHE", "QUEUE", "TOK/S"
    );
    for m in status.models {
        let weights = m
            .tiers
            .iter()
            .map(|t| format!("{} {}", human_bytes(t.bytes), t.tier.to_uppercase()))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "{:<24} {:<8} {:>20} {:>10} {:>7} {:>8.1}",
            m.name,
            // `vulkan:0 (NAME)`: the name goes on the line below.
            m.device.split(" (").next().unwrap_or_default(),
            weights,
            human_bytes(m.kv_cache_bytes),
            format!("{}/{}", m.queue_depth, m.queue_capacity + m.max_batch),
            m.recent_tokens_per_second
        );
        if let Some(line) = gpu_line(&m) {
            println!("  {line}");
        }
        if let Some(t) = &m.ram_tier {
            println!("  {}", ram_tier_line(t));
        }
    }
    println!("{memory}");
    Ok(())
}

/// For a MoE model on the CPU under a RAM budget: the cache its routed experts are read into.
fn ram_tier_line(t: &pb::RamTierCounters) -> String {
    let lookups = t.hits + t.misses;
    let share = |n: u64, of: u64| {
        if of == 0 {
            0.0
        } else {
            100.0 * n as f64 / of as f64
        }
    };
    let mut line = format!(
        "experts read from the SSD into {} of RAM: {lookups} lookups, {:.1}% in RAM, {} read, \
         {} read ahead",
        human_bytes(t.buffer_bytes),
        share(t.hits, lookups),
        human_bytes(t.bytes_read),
        t.prefetches
    );
    let predicted = t.predicted_right + t.predicted_wrong;
    if predicted > 0 {
        line += &format!(
            ", next-layer predictions {:.1}% right",
            share(t.predicted_right, predicted)
        );
    }
    line
}

/// For a model on a Vulkan device: the VRAM it holds, requests at a time, and where a MoE
/// model's routed experts ran.
fn gpu_line(m: &pb::ModelStatus) -> Option<String> {
    if m.device == "cpu" || m.device.is_empty() {
        return None;
    }
    let budget = match m.vram_budget_bytes {
        0 => String::new(),
        b => format!(" of a {} budget", human_bytes(b)),
    };
    let at_a_time = match m.max_batch {
        1 => "1 request at a time".to_string(),
        n if m.prompt_steps > 0 => format!(
            "up to {n} requests at a time, {} decode steps shared, {} carried prompts",
            m.shared_steps, m.prompt_steps
        ),
        n => format!(
            "up to {n} requests at a time, {} decode steps shared",
            m.shared_steps
        ),
    };
    let mut line = format!(
        "{}: VRAM {} held{budget}; {at_a_time}",
        m.device,
        human_bytes(m.vram_bytes),
    );
    if let Some(e) = &m.experts {
        let routed = e.hits + e.misses;
        let hit = if routed == 0 {
            0.0
        } else {
            100.0 * e.hits as f64 / routed as f64
        };
        line += &format!(
            "; experts {} of {} per layer in VRAM, {routed} routed, {hit:.1}% hits, {} on the \
             CPU, {} fetched, {} over PCIe, {} promoted (misses {})",
            e.slots_per_layer, e.n_expert, e.cpu, e.fetched, e.pcie, e.promoted, e.miss
        );
    }
    Some(line)
}

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn human_count(n: u64) -> String {
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}K", n as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.1}B", n as f64 / 1e9),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_model_gets_a_line_with_its_vram_and_experts() {
        let mut m = pb::ModelStatus {
            device: "cpu".into(),
            ..Default::default()
        };
        assert_eq!(gpu_line(&m), None);
        m.device = "vulkan:0 (llvmpipe)".into();
        m.vram_bytes = 3 << 20;
        m.max_batch = 1;
        m.experts = Some(pb::ExpertCounters {
            slots_per_layer: 2,
            n_expert: 8,
            miss: "cpu".into(),
            hits: 3,
            misses: 1,
            cpu: 1,
            promoted: 2,
            ..Default::default()
        });
        assert_eq!(
            gpu_line(&m).unwrap(),
            "vulkan:0 (llvmpipe): VRAM 3.0 MiB held; 1 request at a time; experts 2 of 8 per layer in VRAM, 4 \
             routed, 75.0% hits, 1 on the CPU, 0 fetched, 0 over PCIe, 2 promoted (misses cpu)"
        );
        m.experts = None;
        (m.max_batch, m.shared_steps) = (4, 17);
        assert_eq!(
            gpu_line(&m).unwrap(),
            "vulkan:0 (llvmpipe): VRAM 3.0 MiB held; up to 4 requests at a time, 17 decode steps \
             shared"
        );
    }

    #[test]
    fn sizes_and_progress_read_naturally() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(human_count(30_500_000_000), "30.5B");
        let p = pb::LoadModelProgress {
            bytes_done: 1 << 20,
            bytes_total: 4 << 20,
            stage: "reading weights".into(),
            ready: false,
        };
        assert_eq!(
            progress_line(&p, 8),
            "reading weights [##------]  25% 1.0 MiB / 4.0 MiB"
        );
    }
}
