//! The `Plan` RPC end to end: a real `spillwayd serve` with a shipped hardware profile plans
//! LoadModel requests from the files' headers, loading nothing, and refuses bad ones with
//! LoadModel's codes.

#[path = "common/daemon.rs"]
mod daemon;

use std::path::{Path, PathBuf};

use daemon::{tensor_pins, test_model, Daemon};
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::synth::{SynthModel, WeightType};
use spillway_proto::v1 as pb;
use spillway_sched::plan::{Placement, Plan};
use spillway_sched::ByteSize;
use tonic::transport::Channel;
use tonic::Code;

type Client = pb::spillway_client::SpillwayClient<Channel>;

/// A synthetic model of `preset` in `dir`; with `sparse`, its weights are holes (only the
/// header and the 1-D tensors are written), so a 30B model takes no disk.
fn synth(dir: &Path, preset: &str, weights: WeightType, sparse: bool) -> PathBuf {
    let path = dir.join(format!("{preset}.gguf"));
    SynthModel::from_name(preset, weights, 7)
        .unwrap()
        .write(&path, sparse, |_, _| {})
        .unwrap();
    path
}

fn request(path: &Path, device: &str, vram_bytes: u64, pins: &[(&str, &str)]) -> pb::PlanRequest {
    pb::PlanRequest {
        load: Some(pb::LoadModelRequest {
            path: path.display().to_string(),
            name: "planned".into(),
            device: device.into(),
            budgets: (vram_bytes > 0).then_some(pb::Budgets {
                vram_bytes,
                ram_bytes: 0,
            }),
            pins: tensor_pins(pins),
            ..Default::default()
        }),
    }
}

async fn plan(
    client: &mut Client,
    req: pb::PlanRequest,
) -> Result<pb::PlanResponse, tonic::Status> {
    Ok(client.plan(req).await?.into_inner())
}

async fn model_names(client: &mut Client) -> Vec<String> {
    let list = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    list.models.into_iter().map(|m| m.name).collect()
}

/// Qwen3-30B-A3B (Q4_K_M, 17 GiB of weights, none of them on disk) under an 8 GiB VRAM budget
/// on the laptop profile: most experts stay off VRAM, and the answer says how fast and why.
#[tokio::test]
async fn a_moe_model_is_planned_under_its_vram_budget_and_not_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let big = synth(dir.path(), "qwen3-30b-a3b", WeightType::Q4KM, true);
    let d = Daemon::with_test_model(&["--hardware-profile", "laptop-8gb"]).await;
    let mut client = d.client().await;
    let loaded = model_names(&mut client).await;

    let budget = 8u64 << 30;
    let r = plan(&mut client, request(&big, "vulkan", budget, &[]))
        .await
        .unwrap();
    assert!(
        ["GPU", "CPU", "PCIe", "SSD"].contains(&r.bottleneck.as_str()),
        "{}",
        r.bottleneck
    );
    assert!(
        r.tokens_per_second.is_finite() && r.tokens_per_second > 0.0,
        "{}",
        r.tokens_per_second
    );
    assert!(
        r.hardware_profile.contains("RTX 4060"),
        "{}",
        r.hardware_profile
    );
    let p = Plan::from_json(&r.json).unwrap();
    assert_eq!(p.vram_budget, ByteSize(budget));
    assert!(p.vram.total <= p.vram_budget, "{:?}", p.vram);
    assert!(p.ram.total <= p.ram_budget, "{:?}", p.ram);
    assert!(!p.cpu_only);
    assert_eq!(
        (p.tokens_per_s, p.bottleneck.to_string()),
        (r.tokens_per_second, r.bottleneck.clone())
    );
    let e = p.experts.as_ref().expect("a MoE model's expert caches");
    assert!(e.in_vram > 0 && e.in_vram < e.experts, "{e:?}");
    // Each of the 48 layers, and the head.
    assert_eq!(p.layers.len(), 49);
    // The table is `spillwayd plan`'s: the prediction, then every tensor's placement.
    assert!(
        r.table.contains(&format!("bottleneck: {}", r.bottleneck))
            && r.table.contains("budgets: VRAM 8.00 GiB")
            && r.table.contains("blk.47.ffn_down_exps.weight"),
        "{}",
        r.table
    );
    assert!(r.table.ends_with('\n'));

    // Pins are planned around: layer 0's experts all on the CPU.
    let r = plan(
        &mut client,
        request(&big, "vulkan", budget, &[(r"blk\.0\.ffn_.*_exps", "cpu")]),
    )
    .await
    .unwrap();
    let p = Plan::from_json(&r.json).unwrap();
    let Some(Placement::Experts(e)) = p.placement("blk.0.ffn_down_exps.weight") else {
        panic!("{}", r.table)
    };
    assert_eq!((e.vram.len(), e.cpu.len()), (0, 128), "{e:?}");
    assert!(r.table.contains("[pinned:"), "{}", r.table);

    // A model on the CPU is planned for the CPU alone; a name a loaded model has is fine.
    let mut cpu = request(&big, "cpu", 0, &[]);
    cpu.load.as_mut().unwrap().name = loaded[0].clone();
    let p = Plan::from_json(&plan(&mut client, cpu).await.unwrap().json).unwrap();
    assert!(p.cpu_only && p.vram.total == ByteSize(0), "{:?}", p.vram);

    // Nothing was loaded.
    assert_eq!(model_names(&mut client).await, loaded);
}

#[tokio::test]
async fn bad_plans_get_load_models_codes() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::with_test_model(&["--hardware-profile", "h200"]).await;
    let mut client = d.client().await;
    let moe = test_model();
    let dense = synth(
        dir.path(),
        "tiny-llama",
        WeightType::Uniform(GgmlType::Q8_0),
        false,
    );
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a model").unwrap();
    let missing = dir.path().join("missing.gguf");

    let cases: Vec<(pb::PlanRequest, Code, &str)> = vec![
        (
            pb::PlanRequest { load: None },
            Code::InvalidArgument,
            "give the load",
        ),
        (
            request(Path::new(""), "vulkan", 0, &[]),
            Code::InvalidArgument,
            "path",
        ),
        (
            request(moe, "vulkan", 0, &[(r"blk\.(0", "cpu")]),
            Code::InvalidArgument,
            "regex",
        ),
        (
            request(moe, "vulkan", 0, &[("exps", "tpu")]),
            Code::InvalidArgument,
            "unknown device",
        ),
        (
            request(moe, "cpu", 0, &[("exps", "cpu")]),
            Code::InvalidArgument,
            "Vulkan device",
        ),
        (
            request(moe, "cpu", 1 << 30, &[]),
            Code::InvalidArgument,
            "budgets.vram_bytes",
        ),
        (
            request(moe, "vulkan", 1 << 40, &[]),
            Code::InvalidArgument,
            "the profile says the machine has",
        ),
        (
            request(&junk, "vulkan", 0, &[]),
            Code::InvalidArgument,
            "junk.gguf",
        ),
        (
            request(&missing, "vulkan", 0, &[]),
            Code::NotFound,
            "no such file",
        ),
        (
            request(moe, "vulkan", 1 << 10, &[]),
            Code::FailedPrecondition,
            "needs at least",
        ),
        (
            request(moe, "vulkan", 0, &[("attn_q", "cpu")]),
            Code::FailedPrecondition,
            "expert stacks",
        ),
        (
            request(&dense, "vulkan", 0, &[("exps", "cpu")]),
            Code::FailedPrecondition,
            "has none",
        ),
    ];
    for (req, code, says) in cases {
        let e = plan(&mut client, req.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
        assert!(
            e.message().contains(says),
            "{:?} lacks {says:?}",
            e.message()
        );
    }
    // The same model without the faults plans, dense or MoE.
    for path in [moe, dense.as_path()] {
        let r = plan(&mut client, request(path, "vulkan", 0, &[]))
            .await
            .unwrap();
        assert!(r.tokens_per_second > 0.0, "{}", r.table);
    }
    assert_eq!(model_names(&mut client).await.len(), 1);
}

#[tokio::test]
async fn a_daemon_without_a_hardware_profile_says_how_to_get_one() {
    let d = Daemon::with_test_model(&[]).await;
    let mut client = d.client().await;
    let e = plan(&mut client, request(test_model(), "vulkan", 0, &[]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("spillwayd calibrate") && e.message().contains("--hardware-profile"),
        "{}",
        e.message()
    );
}
