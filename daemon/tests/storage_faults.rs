//! Storage faults injected under running requests (`SPILLWAY_FAULT_STORAGE`, `stream::fault`)
//! into a daemon serving a MoE model on Vulkan whose CPU experts come from a RAM budget, read
//! from the model file through the tile reader as they are needed: a read that fails with EIO
//! or stops short fails the request that needed it with UNAVAILABLE naming the file (no token
//! computed from it is sent), and the model serves the same tokens as before to the next
//! requests; reads that come late end a request with a deadline at that deadline, and the
//! model serves on. Runs on whatever Vulkan device the machine has (lavapipe in CI) and skips
//! without one, unless `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "common/daemon.rs"]
mod daemon;

use std::path::{Path, PathBuf};
use std::time::Duration;

use daemon::{load_model, stream_until_end as generate, Daemon};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::{Device, Instance};
use spillway_daemon::model::Model;
use spillway_daemon::synth::SynthModel;
use spillway_proto::v1 as pb;
use tonic::Code;

type Client = pb::spillway_client::SpillwayClient<tonic::transport::Channel>;

/// F16 weights, so that the GPU's greedy tokens are the CPU's (see `server_vulkan`).
fn synth(dir: &Path) -> PathBuf {
    let path = dir.join("experts-f16.gguf");
    SynthModel::from_name("tiny-qwen3moe", "F16".parse().unwrap(), 3)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    path
}

/// A daemon serving `path` on the CPU as "cpu", with `faults` injected into its tile
/// readers, and the same file loaded on Vulkan as "ram": a VRAM budget that leaves most
/// experts to the CPU, and a RAM budget of twice the least, so experts are read from the file
/// again and again.
async fn serving(path: &Path, faults: &str) -> (Daemon, Client) {
    let start_model = format!("cpu={}", path.display());
    let d = Daemon::spawn(
        &["--model", &start_model, "--device", "cpu"],
        &[("SPILLWAY_FAULT_STORAGE", Path::new(faults))],
    );
    d.wait_serving().await;
    let mut client = d.client().await;
    let device = Instance::new().and_then(|i| Device::open(i, None)).unwrap();
    let model = Model::open(path).unwrap();
    let options = GpuModelOptions::default();
    let whole = GpuModel::device_bytes(&model, &options).total();
    let minimum = GpuModel::minimum_budget(&device, &model, &options)
        .unwrap()
        .total();
    let req = pb::LoadModelRequest {
        path: path.display().to_string(),
        name: "ram".into(),
        device: "vulkan".into(),
        budgets: Some(pb::Budgets {
            vram_bytes: minimum + (whole - minimum) / 4,
            ram_bytes: 2 * spillway_daemon::stream::minimum_ram_budget(&model),
        }),
        ..Default::default()
    };
    load_model(&mut client, req).await.unwrap();
    (d, client)
}

fn request(model: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        model: model.into(),
        input: Some(pb::generate_request::Input::Tokens(pb::TokenIds {
            ids: vec![1, 17, 300, 5, 1000],
        })),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Experts the "ram" model computed on the CPU (from its RAM tier, read from the file as
/// needed).
async fn cpu_experts(client: &mut Client) -> u64 {
    let s = client
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let m = s.models.iter().find(|m| m.name == "ram").unwrap();
    m.experts.as_ref().unwrap().cpu
}

#[tokio::test]
async fn a_failed_expert_read_fails_its_request_and_the_model_serves_on() {
    if spillway_daemon::gpu::device_or_skip().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    for (fault, says) in [("eio:3", "Input/output error"), ("short:3", "short read")] {
        let (d, mut client) = serving(&path, fault).await;
        let (want, end) = generate(&mut client, tonic::Request::new(request("cpu", 8))).await;
        end.unwrap();
        assert_eq!(want.len(), 8);

        // The third chunk read of the "ram" model's reader fails: within its first requests.
        let mut failed = 0;
        for i in 0..10 {
            let (tokens, end) = generate(&mut client, tonic::Request::new(request("ram", 8))).await;
            match end {
                Ok(()) => assert_eq!(tokens, want, "{fault}: request {i}"),
                Err(e) => {
                    failed += 1;
                    assert_eq!(e.code(), Code::Unavailable, "{fault}: {}", e.message());
                    for part in [says, "experts-f16.gguf", "offset", "retry"] {
                        assert!(e.message().contains(part), "{fault}: {}", e.message());
                    }
                    // What was sent before the failed step is the start of the right answer.
                    assert_eq!(tokens[..], want[..tokens.len()], "{fault}");
                }
            }
        }
        assert_eq!(failed, 1, "{fault}: the fault fires once");
        assert!(cpu_experts(&mut client).await > 0, "{fault}");
        assert!(d.log_text().contains("fault injection"), "{fault}");
    }
}

#[tokio::test]
async fn reads_that_come_late_end_a_request_at_its_deadline_and_the_model_serves_on() {
    if spillway_daemon::gpu::device_or_skip().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    // Every chunk read takes a quarter of a second more: the first step, which reads experts
    // into the empty RAM tier, outlasts the deadline.
    let (_d, mut client) = serving(&path, "slow:250").await;
    let (want, end) = generate(&mut client, tonic::Request::new(request("cpu", 2))).await;
    end.unwrap();

    let before = cpu_experts(&mut client).await;
    let mut late = tonic::Request::new(request("ram", 64));
    late.set_timeout(Duration::from_millis(100));
    let (tokens, end) = generate(&mut client, late).await;
    let e = end.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{}", e.message());
    assert!(tokens.len() < 64);

    // The model serves on once its step is over (the reads are still slow).
    let (tokens, end) = generate(&mut client, tonic::Request::new(request("ram", 2))).await;
    end.unwrap();
    assert_eq!(tokens, want);
    assert!(
        cpu_experts(&mut client).await > before,
        "experts ran on the CPU"
    );
}
