//! Predicts a plan for a preset model on a shipped profile, without the hardware:
//! `cargo run -p spillway-sched --example simulate -- PROFILE PRESET [WEIGHTS] [VRAM] [RAM] [--json|--summary]`
//! e.g. `... -- laptop-8gb qwen3-30b-a3b Q4_K_M 8GiB 28GiB`.

use spillway_sched::model::presets::{self, Quant};
use spillway_sched::simulate::{shipped_profile, simulate, SHIPPED_PROFILES};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let summary = args.iter().any(|a| a == "--summary");
    let pos: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    if pos.len() < 2 {
        let names: Vec<&str> = SHIPPED_PROFILES.iter().map(|p| p.0).collect();
        let models: Vec<String> = presets::all().into_iter().map(|s| s.name).collect();
        eprintln!(
            "usage: simulate PROFILE PRESET [WEIGHTS] [VRAM] [RAM] [--json|--summary]\nprofiles: {}\npresets: {}",
            names.join(", "),
            models.join(", ")
        );
        std::process::exit(2);
    }
    let profile = shipped_profile(pos[0])
        .expect("unknown profile")
        .expect("shipped profiles parse");
    let quant: Quant = pos.get(2).map_or("Q4_K_M", |s| s.as_str()).parse().unwrap();
    let model = presets::find(pos[1])
        .expect("unknown preset")
        .describe(&quant);
    let vram = pos.get(3).map(|s| s.parse().unwrap());
    let ram = pos.get(4).map(|s| s.parse().unwrap());
    match simulate(&model, &profile, vram, ram, Vec::new()) {
        Ok(plan) if json => println!("{}", plan.to_json()),
        Ok(plan) if summary => println!(
            "{:<16} {:<14} VRAM {:>10} RAM {:>10}: {:>7.1} tokens/s, bottleneck {}",
            pos[0],
            pos[1],
            plan.vram_budget.to_string(),
            plan.ram_budget.to_string(),
            plan.tokens_per_s,
            plan.bottleneck
        ),
        Ok(plan) => {
            let mut s = String::new();
            plan.write_table(&mut s).unwrap();
            print!("{s}");
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
