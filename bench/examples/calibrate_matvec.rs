//! The calibration's timing of matrix-vector products (`spillwayd calibrate`'s GPU cases), for
//! comparing with `vulkan_matvec`: seconds per product of chains of 16 and 64, for each weight
//! type in turn, optionally after the calibration's other GPU cases (`full`: memory reads of
//! 4 to 256 MiB, submits and the dispatch chain, as `spillwayd calibrate` runs them first).
//!
//! `cargo run --release -p spillway-bench --example calibrate_matvec -- [full] [TYPE,...]
//! [K N ...]` (default: Q4_0 4096 4096 4096 14336 14336 4096).

use spillway_daemon::calibrate::gpu::GpuBench;
use spillway_sched::model::WeightType;

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let full = args.first().is_some_and(|a| a == "full");
    if full {
        args.remove(0);
    }
    let types: Vec<WeightType> = args
        .first()
        .map_or("Q4_0", String::as_str)
        .split(',')
        .map(WeightType::new)
        .collect();
    let dims: Vec<u64> = match args.len() > 1 {
        true => args[1..].iter().map(|a| a.parse().unwrap()).collect(),
        false => vec![4096, 4096, 4096, 14336, 14336, 4096],
    };
    let mut bench = GpuBench::open(None).unwrap();
    println!("device: {}", bench.info().name);
    if full {
        for bytes in [4u64 << 20, 16 << 20, 64 << 20, 256 << 20] {
            let s = bench.read(bytes).unwrap();
            println!(
                "read {} MiB: {:.1} GB/s",
                bytes >> 20,
                12.0 * (bytes / 12) as f64 / s / 1e9
            );
        }
        for _ in 0..3 {
            bench.submit().unwrap();
        }
        println!("dispatch: {:.2} µs", bench.dispatch().unwrap() * 1e6);
    }
    println!("| type | k × n | chain | µs a product |");
    println!("| --- | --- | ---: | ---: |");
    for ty in &types {
        for kn in dims.chunks_exact(2) {
            for chain in [16, 64] {
                let s = bench.matvec(ty, kn[0], kn[1], chain).unwrap();
                println!(
                    "| {} | {} × {} | {chain} | {:.1} |",
                    ty.name(),
                    kn[0],
                    kn[1],
                    s * 1e6
                );
            }
        }
    }
}
