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
        println!(
            "vulkan:{}  {}  [{:?}]  Vulkan {}  {} MiB device-local  {}{}",
            d.index,
            d.name,
            d.kind,
            d.api_version,
            d.device_local_bytes >> 20,
            d.driver,
            if d.cooperative_matrix {
                "  cooperative matrices"
            } else {
                ""
            }
        );
    }
    Ok(())
}
