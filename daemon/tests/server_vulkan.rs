//! `spillwayd serve` with models on a Vulkan device: greedy generations over gRPC give the tokens
//! the CPU-served copy of the same model gives (a MoE and a dense model), `Status` shows the
//! device, the VRAM held and the expert counters, a device that does not exist and a budget
//! below the model's minimum get their documented errors, a MoE model over its budget with its
//! misses on the CPU shares decode steps among requests, and a machine without a Vulkan driver
//! is served on the CPU. The GPU tests run on whatever Vulkan device the machine has (lavapipe
//! in CI) and skip without one, unless `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "common/daemon.rs"]
mod daemon;

use std::path::{Path, PathBuf};

use daemon::{load_model, stream_tokens, tensor_pins, Daemon};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::placement::MoeMiss;
use spillway_daemon::gpu::{Device, Instance};
use spillway_daemon::model::Model;
use spillway_daemon::synth::SynthModel;
use spillway_proto::v1 as pb;
use tonic::transport::Channel;
use tonic::Code;

type Client = pb::spillway_client::SpillwayClient<Channel>;

fn has_vulkan() -> bool {
    spillway_daemon::gpu::device_or_skip().is_some()
}

/// F16 weights: the GPU's logits stay within ~0.1% of the CPU's, so a random model's greedy
/// choices agree (quantized weights move logits enough to flip close ones).
fn synth(dir: &Path, preset: &str, seed: u64) -> PathBuf {
    let path = dir.join(format!("{preset}-f16.gguf"));
    SynthModel::from_name(preset, "F16".parse().unwrap(), seed)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    path
}

/// A VRAM budget `num / den` of the way from `model`'s smallest budget with `options` on this
/// machine's device to its whole footprint: some experts in VRAM, the others not.
fn budget_between(model: &Model, options: &GpuModelOptions, (num, den): (u64, u64)) -> u64 {
    let device = Instance::new().and_then(|i| Device::open(i, None)).unwrap();
    let whole = GpuModel::device_bytes(model, options).total();
    let minimum = GpuModel::minimum_budget(&device, model, options)
        .unwrap()
        .total();
    minimum + (whole - minimum) * num / den
}

fn load_request(path: &Path, name: &str, device: &str) -> pb::LoadModelRequest {
    pb::LoadModelRequest {
        path: path.display().to_string(),
        name: name.into(),
        device: device.into(),
        ..Default::default()
    }
}

/// Eight greedy tokens after a fixed prompt.
async fn greedy(client: &mut Client, model: &str) -> Vec<u32> {
    greedy_after(client, model, vec![1, 17, 300, 5, 1000]).await
}

/// Eight greedy tokens after `prompt`.
async fn greedy_after(client: &mut Client, model: &str, prompt: Vec<u32>) -> Vec<u32> {
    let req = pb::GenerateRequest {
        model: model.into(),
        input: Some(pb::generate_request::Input::Tokens(pb::TokenIds {
            ids: prompt,
        })),
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    let (tokens, finish) = stream_tokens(client, req).await;
    assert_eq!(finish, pb::FinishReason::MaxTokens as i32, "{model}");
    tokens
}

async fn status_of(client: &mut Client, name: &str) -> pb::ModelStatus {
    let status = client.status(pb::StatusRequest {}).await.unwrap();
    status
        .into_inner()
        .models
        .into_iter()
        .find(|m| m.name == name)
        .unwrap()
}

#[tokio::test]
async fn models_on_vulkan_generate_the_tokens_of_their_cpu_served_copies() {
    if !has_vulkan() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let moe = synth(dir.path(), "tiny-qwen2moe", 3);
    let dense = synth(dir.path(), "tiny-llama", 5);
    let start_model = format!("moe={}", moe.display());
    // The daemon's --device puts its start-up model on the GPU; LoadModel's device picks per
    // model.
    let d = Daemon::start(&["--device", "vulkan", "--model", &start_model]).await;
    let mut client = d.client().await;
    load_model(&mut client, load_request(&moe, "moe-cpu", "cpu"))
        .await
        .unwrap();
    load_model(&mut client, load_request(&dense, "dense", "vulkan"))
        .await
        .unwrap();
    load_model(&mut client, load_request(&dense, "dense-cpu", "cpu"))
        .await
        .unwrap();

    for (gpu, cpu) in [("moe", "moe-cpu"), ("dense", "dense-cpu")] {
        let want = greedy(&mut client, cpu).await;
        assert_eq!(want.len(), 8);
        assert_eq!(greedy(&mut client, gpu).await, want, "{gpu} against {cpu}");
    }
    // Four requests at once on a GPU model: its KV cache holds --max-batch sequences, and its
    // decode steps take one token of each running request together. Each gets the tokens it
    // gets alone on the CPU.
    // Prompts longer than a step's chunk of 8 tokens go into several steps.
    let prompts = [
        vec![1, 17, 300],
        vec![2, 40, 7, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19],
        vec![5],
        vec![600, 3, 3, 8, 1, 70, 71, 72, 73],
    ];
    for (gpu, cpu) in [("moe", "moe-cpu"), ("dense", "dense-cpu")] {
        let mut want = Vec::new();
        for p in &prompts {
            want.push(greedy_after(&mut client, cpu, p.clone()).await);
        }
        let mut running = tokio::task::JoinSet::new();
        for (i, p) in prompts.iter().enumerate() {
            let (mut c, p) = (client.clone(), p.clone());
            running.spawn(async move { (i, greedy_after(&mut c, gpu, p).await) });
        }
        let mut got = vec![Vec::new(); prompts.len()];
        while let Some(r) = running.join_next().await {
            let (i, tokens) = r.unwrap();
            got[i] = tokens;
        }
        assert_eq!(got, want, "{gpu} against {cpu}, four at once");
        let shared = status_of(&mut client, gpu).await.shared_steps;
        assert!(shared > 0, "{gpu}: the requests shared no decode step");
    }

    let moe = status_of(&mut client, "moe").await;
    assert!(moe.device.starts_with("vulkan:0 ("), "{}", moe.device);
    // The daemon's --max-batch (4): every expert in VRAM, so steps take sequences together.
    assert_eq!(moe.max_batch, 4);
    assert!(moe.vram_bytes > 0 && moe.kv_cache_bytes > 0);
    assert_eq!(moe.vram_budget_bytes, 0);
    assert_eq!(moe.tiers.len(), 1, "every expert in VRAM: {:?}", moe.tiers);
    assert_eq!(moe.tiers[0].tier, "vram");
    assert_eq!(moe.generated_tokens, 8 + 4 * 8);
    let e = moe.experts.expect("a MoE model's expert counters");
    assert_eq!(e.slots_per_layer, e.n_expert);
    assert!(e.hits > 0 && e.misses == 0, "{e:?}");
    assert!(moe.expert_cache_hit_rate.iter().all(|&r| r == 1.0));

    let dense = status_of(&mut client, "dense").await;
    assert!(dense.device.starts_with("vulkan:"));
    assert!(dense.vram_bytes > 0);
    assert!(dense.experts.is_none());
    assert_eq!(dense.max_batch, 4);
    let cpu = status_of(&mut client, "dense-cpu").await;
    assert_eq!((cpu.device.as_str(), cpu.vram_bytes), ("cpu", 0));
    assert!(cpu.max_batch > 1);
}

#[tokio::test]
async fn bad_devices_and_budgets_get_their_documented_errors() {
    if !has_vulkan() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let moe = synth(dir.path(), "tiny-qwen2moe", 3);
    let d = Daemon::with_test_model(&[]).await;
    let mut client = d.client().await;

    let err = load_model(&mut client, load_request(&moe, "far", "vulkan:99"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("vulkan:99"), "{}", err.message());
    assert!(err.message().contains("vulkan:0 ("), "{}", err.message());

    let err = load_model(&mut client, load_request(&moe, "odd", "gpu"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    let small = |device: &str, bytes: u64| pb::LoadModelRequest {
        budgets: Some(pb::Budgets {
            vram_bytes: bytes,
            ram_bytes: 0,
        }),
        ..load_request(&moe, "small", device)
    };
    let err = load_model(&mut client, small("cpu", 1 << 20))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("vram_bytes"), "{}", err.message());

    let err = load_model(&mut client, small("vulkan", 1 << 20))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("the model needs at least"),
        "{}",
        err.message()
    );
    assert!(
        err.message().contains("VRAM budget of 1048576 bytes"),
        "{}",
        err.message()
    );

    // Between the minimum and the whole model: some experts stay in RAM and run on the CPU.
    let model = Model::open(&moe).unwrap();
    let budget = budget_between(&model, &GpuModelOptions::default(), (1, 3));
    load_model(&mut client, small("vulkan", budget))
        .await
        .unwrap();
    assert_eq!(greedy(&mut client, "small").await.len(), 8);
    let s = status_of(&mut client, "small").await;
    assert_eq!(s.vram_budget_bytes, budget);
    assert!(s.vram_bytes > 0 && s.vram_bytes <= budget);
    assert_eq!(
        s.tiers.iter().map(|t| t.tier.as_str()).collect::<Vec<_>>(),
        ["vram", "ram"]
    );
    let e = s.experts.unwrap();
    assert!(e.slots_per_layer < e.n_expert);
    assert!(e.misses > 0 && e.cpu > 0, "{e:?}");
    assert_eq!(e.miss, "cpu");

    // The CPU's experts from a RAM budget (read from the file as needed): the same tokens.
    let ram = |device: &str, name: &str, ram_bytes: u64| pb::LoadModelRequest {
        budgets: Some(pb::Budgets {
            vram_bytes: if device == "cpu" { 0 } else { budget },
            ram_bytes,
        }),
        ..load_request(&moe, name, device)
    };
    let minimum_ram = spillway_daemon::stream::minimum_ram_budget(&model);
    let err = load_model(&mut client, ram("vulkan", "ram-low", minimum_ram - 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("RAM budget"), "{}", err.message());
    load_model(&mut client, ram("vulkan", "ram", 2 * minimum_ram))
        .await
        .unwrap();
    assert_eq!(
        greedy(&mut client, "ram").await,
        greedy(&mut client, "small").await
    );
}

#[tokio::test]
async fn without_a_vulkan_driver_the_daemon_says_so_and_serves_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-icd.json");
    let model = daemon::test_model().to_str().unwrap().to_string();
    // The loader's variables for the driver list (older and newer names): none usable.
    let d = Daemon::spawn(
        &["--device", "vulkan", "--model", &model],
        &[
            ("VK_ICD_FILENAMES", &missing),
            ("VK_DRIVER_FILES", &missing),
        ],
    );
    d.wait_serving().await;
    let log = d.log_text();
    assert_eq!(
        log.matches("serving on the CPU instead").count(),
        1,
        "{log}"
    );
    let mut client = d.client().await;
    let s = status_of(&mut client, "tiny-qwen3moe-q8_0").await;
    assert_eq!(s.device, "cpu");
}

/// LoadModel's pins: the scheduler plans around them on the daemon's hardware profile, and the
/// GPU model runs the plan (an expert stack pinned to the GPU is whole in VRAM, one pinned to the
/// CPU keeps one slot); pins a GPU model cannot honour, on a CPU model, or without a profile get
/// their documented errors.
#[tokio::test]
async fn pins_place_expert_stacks_and_impossible_pins_are_refused() {
    if !has_vulkan() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let moe = synth(dir.path(), "tiny-qwen3moe", 3);
    let model = Model::open(&moe).unwrap();
    let n_expert = model.config.moe.unwrap().n_expert as u32;
    let budget = budget_between(&model, &GpuModelOptions::default(), (3, 4));
    let pinned = |name: &str, device: &str, pins: &[(&str, &str)]| pb::LoadModelRequest {
        budgets: Some(pb::Budgets {
            vram_bytes: if device == "cpu" { 0 } else { budget },
            ram_bytes: 0,
        }),
        pins: tensor_pins(pins),
        ..load_request(&moe, name, device)
    };
    let pins = [
        (r"blk\.0\.ffn_.*_exps", "cpu"),
        (r"blk\.1\.ffn_.*_exps", "gpu"),
    ];

    let d = Daemon::with_test_model(&["--hardware-profile", "desktop-24gb"]).await;
    let mut client = d.client().await;
    load_model(&mut client, pinned("pinned", "vulkan", &pins))
        .await
        .unwrap();
    greedy(&mut client, "pinned").await;
    let s = status_of(&mut client, "pinned").await;
    let e = s.experts.clone().unwrap();
    assert_eq!(e.n_expert, n_expert);
    // Layer 1 whole in VRAM: every lookup hits; layer 0 has one slot of 16.
    assert_eq!(s.expert_cache_hit_rate.len(), 2, "{s:?}");
    assert_eq!(s.expert_cache_hit_rate[1], 1.0, "{s:?}");
    assert!(s.expert_cache_hit_rate[0] < 0.5, "{s:?}");
    assert!(e.cpu > 0, "{e:?}");

    let err = load_model(&mut client, pinned("on-cpu", "cpu", &pins))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    assert!(err.message().contains("Vulkan device"), "{}", err.message());
    let err = load_model(&mut client, pinned("attn", "vulkan", &[("attn_q", "cpu")]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("expert stacks"), "{}", err.message());
    let err = load_model(&mut client, pinned("odd", "vulkan", &[("exps", "tpu")]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    let dense = synth(dir.path(), "tiny-llama", 3);
    let err = load_model(
        &mut client,
        pb::LoadModelRequest {
            pins: vec![pb::TensorPin {
                pattern: "exps".into(),
                placement: "cpu".into(),
            }],
            ..load_request(&dense, "dense", "vulkan")
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("has none"), "{}", err.message());

    // A daemon that plans every model still loads a dense one whole.
    let planned = Daemon::with_test_model(&[
        "--hardware-profile",
        "desktop-24gb",
        "--expert-layout",
        "planned",
    ])
    .await;
    let mut client = planned.client().await;
    load_model(&mut client, load_request(&dense, "dense", "vulkan"))
        .await
        .unwrap();
    greedy(&mut client, "dense").await;

    // A daemon without a hardware profile has nothing to plan on.
    let bare = Daemon::with_test_model(&[]).await;
    let mut client = bare.client().await;
    let err = load_model(&mut client, pinned("pinned", "vulkan", &pins))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().contains("hardware profile"),
        "{}",
        err.message()
    );
}

/// The tiny Qwen3-MoE model written into `dir`, and a VRAM budget a third of the way from
/// its minimum to the whole model with `sequences` sequences and misses on the CPU.
fn offloaded_moe(dir: &Path, sequences: usize) -> (PathBuf, Model, u64) {
    let path = synth(dir, "tiny-qwen3moe", 9);
    let model = Model::open(&path).unwrap();
    let options = GpuModelOptions {
        sequences,
        moe_miss: MoeMiss::Cpu,
        ..GpuModelOptions::default()
    };
    let budget = budget_between(&model, &options, (1, 3));
    (path, model, budget)
}

/// A MoE model over its VRAM budget with its missing experts on the CPU (`--moe-miss cpu`; what
/// `auto` gives a device without a separate bus, as lavapipe) still shares decode steps among requests: four at once
/// each get the tokens the CPU-served copy gives, some steps take several of them, prompts go
/// into the steps beside the others' tokens, and the CPU ran experts.
#[tokio::test]
async fn an_offloaded_moe_model_shares_decode_steps_with_its_misses_on_the_cpu() {
    if !has_vulkan() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The daemon's model: four sequences (--max-batch).
    let (path, _, budget) = offloaded_moe(dir.path(), 4);

    let d = Daemon::start(&[
        "--device",
        "vulkan",
        "--max-batch",
        "4",
        "--moe-miss",
        "cpu",
    ])
    .await;
    let mut client = d.client().await;
    let over = pb::LoadModelRequest {
        budgets: Some(pb::Budgets {
            vram_bytes: budget,
            ram_bytes: 0,
        }),
        ..load_request(&path, "over", "vulkan")
    };
    load_model(&mut client, over).await.unwrap();
    load_model(&mut client, load_request(&path, "on-cpu", "cpu"))
        .await
        .unwrap();
    let s = status_of(&mut client, "over").await;
    let e = s.experts.expect("a MoE model's expert counters");
    assert!(e.slots_per_layer < e.n_expert, "{e:?}");
    // (--moe-miss cpu: on a device across a bus too, where `auto` reads them over it.)
    assert_eq!(e.miss, "cpu", "{e:?}");
    assert_eq!(
        s.max_batch, 4,
        "misses on the CPU no longer hold one sequence"
    );

    let prompts = [
        vec![1, 17, 300],
        vec![2, 40, 7, 9],
        vec![5],
        vec![600, 3, 3, 8, 1],
    ];
    let mut want = Vec::new();
    for p in &prompts {
        want.push(greedy_after(&mut client, "on-cpu", p.clone()).await);
    }
    let mut running = tokio::task::JoinSet::new();
    for (i, p) in prompts.iter().enumerate() {
        let (mut c, p) = (client.clone(), p.clone());
        running.spawn(async move { (i, greedy_after(&mut c, "over", p).await) });
    }
    let mut got = vec![Vec::new(); prompts.len()];
    while let Some(r) = running.join_next().await {
        let (i, tokens) = r.unwrap();
        got[i] = tokens;
    }
    assert_eq!(got, want, "four at once against the CPU");
    let s = status_of(&mut client, "over").await;
    assert!(s.shared_steps > 0, "the requests shared no decode step");
    assert!(s.prompt_steps > 0, "no prompt went into the steps");
    let e = s.experts.unwrap();
    assert!(e.cpu > 0 && e.hits > 0, "{e:?}");
}

/// A MoE model over its VRAM budget with its missing experts on the CPU under a RAM budget:
/// those experts live in the file, read into the RAM tier as tokens need them. Its status
/// says so (an "ssd" tier beside VRAM, the tier's counters), and it generates the tokens of
/// the CPU-served copy.
#[tokio::test]
async fn an_offloaded_moe_model_under_a_ram_budget_reports_its_ram_tier() {
    if !has_vulkan() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (path, model, budget) = offloaded_moe(dir.path(), 1);
    let ram = spillway_daemon::stream::minimum_ram_budget(&model);

    let d = Daemon::start(&["--device", "vulkan", "--moe-miss", "cpu"]).await;
    let mut client = d.client().await;
    let over = pb::LoadModelRequest {
        budgets: Some(pb::Budgets {
            vram_bytes: budget,
            ram_bytes: ram,
        }),
        ..load_request(&path, "over", "vulkan")
    };
    load_model(&mut client, over).await.unwrap();
    load_model(&mut client, load_request(&path, "on-cpu", "cpu"))
        .await
        .unwrap();
    let want = greedy_after(&mut client, "on-cpu", vec![1, 17, 300]).await;
    let got = greedy_after(&mut client, "over", vec![1, 17, 300]).await;
    assert_eq!(got, want, "against the CPU");

    let s = status_of(&mut client, "over").await;
    let tiers: Vec<&str> = s.tiers.iter().map(|t| t.tier.as_str()).collect();
    assert_eq!(tiers, ["vram", "ssd"]);
    let e = s.experts.expect("a MoE model's expert counters");
    assert!(e.cpu > 0, "{e:?}");
    let tier = s.ram_tier.expect("the RAM tier's counters");
    assert!(tier.misses > 0 && tier.bytes_read > 0, "{tier:?}");
    assert!(tier.buffer_bytes <= ram, "{tier:?} within {ram}");
    let mapped = status_of(&mut client, "on-cpu").await;
    assert!(mapped.ram_tier.is_none());
}
