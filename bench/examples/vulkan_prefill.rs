//! GPU prompt processing (`GpuModel::eval_prompt`) on a synthetic model of real size: writes the
//! model, checks a short prompt's last logits against the same model token by token, then times
//! a prompt of PROMPT tokens from position 0, three times each with cooperative matrices (where
//! the device has them), with the f32 kernel, and with cooperative matrices but the chunk's
//! attention in the decode kernel (`GpuModelOptions::flash_attention` off), alternating; the
//! medians are printed, then a profiled prompt's GPU time by op and the host's time.
//!
//! `cargo run --release -p spillway-bench --example vulkan_prefill -- PRESET TYPE PROMPT [DIR]
//! [tile=DEPTHxROWSxTOKENS]`
//! e.g. `llama-3-8b Q4_0 512 /tmp`.

use std::sync::Arc;
use std::time::Instant;

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::{Device, Instance, MatMulTile};
use spillway_daemon::model::Model;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let preset = args.first().map_or("llama-3.2-1b", String::as_str);
    let type_name = args.get(1).map_or("Q4_0", String::as_str);
    let weights: WeightType = type_name.parse().unwrap();
    let n_prompt: usize = args.get(2).map_or(512, |s| s.parse().unwrap());
    let dir = std::path::PathBuf::from(args.get(3).map_or("/tmp", String::as_str));
    let path = dir.join(format!("{preset}-{type_name}-synth.gguf"));
    if !path.exists() {
        SynthModel::from_name(preset, weights, 7)
            .unwrap()
            .write(&path, false, |_, _| {})
            .unwrap();
    }
    let model = Arc::new(Model::open(&path).unwrap());
    let device = Device::open(Instance::new().unwrap(), None).unwrap();
    // `tile=DEPTHxROWSxTOKENS`: the cooperative-matrix product's tile instead of the tuned one.
    let matmul_tile = args.iter().find_map(|a| a.strip_prefix("tile=")).map(|t| {
        let v: Vec<u32> = t.split('x').map(|n| n.parse().unwrap()).collect();
        MatMulTile {
            depth: v[0],
            rows: v[1],
            tokens: v[2],
        }
    });
    let options = GpuModelOptions {
        context: n_prompt + 8,
        matmul_tile,
        ..GpuModelOptions::default()
    };
    let mut coop = GpuModel::new(&device, &model, &options).unwrap();
    // The f32 kernels throughout, token by token too: decode's products in integer dot
    // products would quantize the inputs that the prompt's products take as floats.
    let f32_options = GpuModelOptions {
        coopmat: false,
        int_dot: false,
        ..options.clone()
    };
    let mut plain = GpuModel::new(&device, &model, &f32_options).unwrap();
    // Cooperative matrices, with the chunk's attention in the decode kernel over its tokens.
    let mut unflashed = GpuModel::new(
        &device,
        &model,
        &GpuModelOptions {
            flash_attention: false,
            ..options.clone()
        },
    )
    .unwrap();
    println!(
        "{preset} {type_name} on {}: cooperative matrices {}",
        device.info().name,
        if device.cooperative_matrix() {
            "yes"
        } else {
            "no"
        }
    );
    let n_vocab = model.config.n_vocab;
    let tokens: Vec<u32> = (0..n_prompt as u64)
        .map(|i| ((i * 7919 + 13) % n_vocab as u64) as u32)
        .collect();

    // A short prompt, chunked, against token by token.
    let short = &tokens[..tokens.len().min(40)];
    let mut want = Vec::new();
    for &t in short {
        want = plain.eval(t).unwrap();
    }
    let range = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (name, gpu) in [("coopmat", &mut coop), ("f32", &mut plain)] {
        gpu.reset();
        let got = gpu.eval_prompt(short, false).unwrap();
        let diff = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!(
            "{name}: {} tokens chunked vs token by token: max |diff| {diff:.4} of {range:.4}",
            short.len()
        );
    }

    let time = |gpu: &mut GpuModel| {
        gpu.reset();
        let t0 = Instant::now();
        gpu.eval_prompt(&tokens, false).unwrap();
        n_prompt as f64 / t0.elapsed().as_secs_f64()
    };
    time(&mut coop); // pipelines, buffers: not timed
    time(&mut plain);
    time(&mut unflashed);
    let (mut c, mut p, mut u) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        c.push(time(&mut coop));
        p.push(time(&mut plain));
        u.push(time(&mut unflashed));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let st = coop.last_stats();
    println!(
        "prompt of {n_prompt} tokens, median of 3: coopmat {:.0} tok/s, f32 {:.0} tok/s, coopmat with the decode attention kernel {:.0} tok/s ({} dispatches, {} barriers in the last chunk)",
        median(&mut c),
        median(&mut p),
        median(&mut u),
        st.dispatches,
        st.barriers
    );
    // One more prompt, profiled: where its last chunk's time went.
    coop.set_profiling(true).unwrap();
    coop.reset();
    coop.eval_prompt(&tokens, false).unwrap();
    let p = coop.last_profile().expect("profiling");
    println!("coopmat {}", spillway_bench::prompt_profile::summary(p));
    coop.set_profiling(false).unwrap();
}
