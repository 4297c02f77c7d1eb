//! `spillwayd devices`: the Vulkan devices this machine offers, in the order `--device vulkan:N`
//! counts them.

use clap::Args;
use spillway_daemon::gpu::Instance;

#[derive(Args)]
pub struct DevicesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &DevicesArgs) -> anyhow::Result<()> {
    let devices = match Instance::new().and_then(|i| i.devices()) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("no Vulkan: {e}");
            Vec::new()
        }
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&devices)?);
        return Ok(());
    }
    if devices.is_empty() {
        println!("no Vulkan devices; Spillway runs on the CPU");
    }
    for d in &devices {
        let free = d
            .device_local_budget
            .map_or(String::new(), |b| format!(" ({} MiB free for us)", b >> 20));
        println!(
            "vulkan:{}  {}  [{:?}]  Vulkan {}  {} MiB device-local{free}  {}",
            d.index,
            d.name,
            d.kind,
            d.api_version,
            d.device_local_bytes >> 20,
            d.driver,
        );
        let c = &d.capabilities;
        let named = [
            (c.float16, "fp16"),
            (c.int8, "int8"),
            (c.storage_16bit, "16-bit storage"),
            (c.storage_8bit, "8-bit storage"),
            (c.subgroup_arithmetic, "subgroup arithmetic"),
            (c.subgroup_size_control, "subgroup size control"),
            (c.integer_dot_product, "integer dot product"),
            (c.cooperative_matrix, "cooperative matrices"),
            (c.memory_budget, "memory budget"),
            (c.transfer_queue, "transfer queue"),
        ];
        let has: Vec<&str> = named
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .collect();
        println!(
            "    {}",
            if has.is_empty() {
                "Vulkan 1.2 compute only".to_string()
            } else {
                has.join(", ")
            }
        );
    }
    Ok(())
}
