//! The `Profile` RPC for models on a Vulkan device, end to end: a real `spillwayd serve` with a
//! dense model and a MoE model over its VRAM budget (some experts on the CPU, read from the SSD
//! into a RAM budget) on the GPU. Every step has a GPU row for each layer's attention and FFN,
//! on the "gpu-compute" track, with its weight bytes and predicted time (the daemon runs with a
//! shipped hardware profile); MoE layers count their experts and the bytes the RAM tier read;
//! the totals give each link's bandwidth against the profile's limit. Asserts what the stream
//! carries, never how fast. Runs on
//! whatever Vulkan device the machine has (lavapipe in CI) and skips without one, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "common/daemon.rs"]
mod daemon;

use std::path::{Path, PathBuf};

use daemon::{load_model, Daemon};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::model::Model;
use spillway_daemon::synth::SynthModel;
use spillway_proto::v1 as pb;
use tonic::transport::Channel;

type Client = pb::spillway_client::SpillwayClient<Channel>;

fn synth(dir: &Path, preset: &str) -> PathBuf {
    let path = dir.join(format!("{preset}.gguf"));
    SynthModel::from_name(preset, "F16".parse().unwrap(), 5)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    path
}

async fn profile(client: &mut Client, model: &str) -> Vec<pb::ProfileStep> {
    let req = pb::ProfileRequest {
        model: model.into(),
        input: Some(pb::profile_request::Input::Tokens(pb::TokenIds {
            ids: vec![1, 17, 300],
        })),
        steps: 3,
    };
    let mut stream = client.profile(req).await.unwrap().into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        out.push(m);
    }
    out
}

/// Every step lists each layer's attention and FFN on the GPU; the totals come last.
fn check(what: &str, steps: &[pb::ProfileStep], moe: bool) {
    assert_eq!(steps.len(), 4, "{what}: the prompt and 3 decode steps");
    let totals = steps[3].totals.clone().expect("totals on the last step");
    assert_eq!((totals.prompt_tokens, totals.decode_steps), (3, 3));
    assert_eq!(totals.device_times[0].device, "gpu");
    assert!(totals.device_times[0].ns > 0, "{what}: {totals:?}");
    // The GPU's busiest op, or the host's experts when they take most of a step; then the
    // link closest to its limit.
    let b = &totals.bottleneck;
    assert!(
        b.starts_with("gpu ") || (moe && b.starts_with("cpu experts: ")),
        "{b}"
    );
    assert!(b.contains("; busiest link: "), "{b}");
    let ffn = if moe { "experts" } else { "ffn" };
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s.tokens, if i == 0 { 3 } else { 1 }, "{what}");
        let gpu: Vec<_> = s.rows.iter().filter(|r| r.device != "cpu").collect();
        assert!(gpu.iter().all(|r| r.track == "gpu-compute"), "{what}");
        for r in &gpu {
            // The MoE model's experts beyond the VRAM budget run on the CPU.
            let both = moe && r.op == "experts";
            assert_eq!(r.device, if both { "both" } else { "gpu" }, "{what}: {r:?}");
        }
        assert_eq!(gpu.len() as u32, 2 + 2 * totals.layers, "{what}, step {i}");
        for layer in 0..totals.layers {
            let ops: Vec<_> = gpu
                .iter()
                .filter(|r| r.layer == Some(layer))
                .map(|r| r.op.as_str())
                .collect();
            assert_eq!(ops, ["attention", ffn], "{what}, step {i}, layer {layer}");
        }
        for r in gpu.iter().filter(|r| r.op == "experts") {
            let n = r.cache_hits.unwrap() + r.cache_misses.unwrap();
            // The prompt's three tokens each routed their experts.
            assert!(n > 0 && !r.experts.is_empty(), "{what}, step {i}: {r:?}");
        }
        for r in s.rows.iter().filter(|r| r.device == "cpu") {
            assert_eq!(r.track, "engine");
        }
        for r in &gpu {
            assert!(r.weight_bytes > 0, "{what}, step {i}: {r:?}");
            assert!(r.predicted_ns.is_some_and(|p| p > 0), "{what}: {r:?}");
            let pcie = r
                .ram_to_vram_bytes
                .expect("GPU rows count copies into VRAM");
            // Misses run on the CPU: nothing is copied into VRAM.
            assert_eq!(pcie, 0, "{what}: {r:?}");
        }
    }
    assert!(!totals.hardware_profile.is_empty());
    let gpu = totals.bandwidths.iter().find(|b| b.link == "gpu").unwrap();
    assert!(gpu.bytes > 0 && gpu.bytes_per_second > 0.0, "{gpu:?}");
    assert!(gpu.limit_bytes_per_second.is_some_and(|l| l > 0.0));
}

#[tokio::test]
async fn vulkan_models_answer_profile_with_gpu_rows_for_every_layer() {
    let Some(device) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dense = synth(dir.path(), "tiny-llama");
    let moe = synth(dir.path(), "tiny-qwen3moe");
    let start = format!("dense={}", dense.display());
    let mut d = Daemon::start(&[
        "--device",
        "vulkan",
        "--model",
        &start,
        "--hardware-profile",
        "h200",
        "--grace-period",
        "1",
    ])
    .await;
    let mut client = d.client().await;

    let model = Model::open(&moe).unwrap();
    let minimum = GpuModel::minimum_budget(&device, &model, &GpuModelOptions::default())
        .unwrap()
        .total();
    load_model(
        &mut client,
        pb::LoadModelRequest {
            path: moe.display().to_string(),
            name: "moe".into(),
            device: "vulkan".into(),
            budgets: Some(pb::Budgets {
                vram_bytes: minimum,
                ram_bytes: spillway_daemon::stream::minimum_ram_budget(&model),
            }),
            ..Default::default()
        },
    )
    .await
    .unwrap();

    check("dense", &profile(&mut client, "dense").await, false);
    let steps = profile(&mut client, "moe").await;
    check("moe", &steps, true);
    let mut ssd = 0;
    for s in &steps[1..] {
        // Steps with experts on the CPU add the host's time: its experts and its waits.
        let host: Vec<_> = s.rows.iter().filter(|r| r.device == "cpu").collect();
        let ops: Vec<_> = host.iter().map(|r| r.op.as_str()).collect();
        let cpu: u32 = s.rows.iter().filter_map(|r| r.cache_misses).sum();
        if cpu > 0 {
            assert_eq!(ops, ["cpu_experts", "host_wait"], "step {}", s.step);
            assert!(host[0].weight_bytes > 0 && host[0].predicted_ns.is_some());
        }
        let mut step_ssd = 0;
        for r in s.rows.iter().filter(|r| r.op == "experts") {
            step_ssd += r.ssd_to_ram_bytes.expect("a RAM budget counts SSD reads");
        }
        // The trace's reads carry the same bytes; the CPU's experts have worker slices.
        let traced: u64 = s
            .slices
            .iter()
            .filter(|sl| sl.track == "io_uring")
            .map(|sl| sl.bytes)
            .sum();
        assert_eq!(traced, step_ssd, "step {}", s.step);
        if cpu > 0 {
            assert!(s
                .slices
                .iter()
                .any(|sl| sl.track.starts_with("cpu-worker-") && sl.expert.is_some()));
        }
        ssd += step_ssd;
    }
    let totals = steps[3].totals.as_ref().unwrap();
    let links: Vec<_> = totals.bandwidths.iter().map(|b| b.link.as_str()).collect();
    let mean_ssd = totals
        .bandwidths
        .iter()
        .find(|b| b.link == "ssd")
        .map(|b| b.bytes);
    if ssd > 0 {
        assert_eq!(mean_ssd, Some(ssd / 3), "{links:?}");
    }
    assert!(
        links.contains(&"cpu") && links.contains(&"gpu"),
        "{links:?}"
    );
    // The model still generates after a profile (the sequence was reset).
    let steps = profile(&mut client, "dense").await;
    assert_eq!(steps.len(), 4);

    // SIGTERM with GPU models loaded: their threads end and free the device's memory before
    // the process exits, which exits 0.
    drop(client);
    d.terminate();
    let status = d.wait_exit();
    assert_eq!(status.code(), Some(0), "log:\n{}", d.log_text());
}
