//! `spillwayd run --device vulkan`: the same greedy tokens and prompt log-probabilities as
//! `--device cpu` on a tiny synthetic MoE model, also with only some experts in VRAM
//! (`--vram-budget`, `--moe-miss`), the same greedy tokens from a dense model with only its last
//! layer in VRAM, and clear errors for a device that does not exist, a budget
//! below what the model needs and a machine without a Vulkan driver; and on the CPU, a MoE
//! model's experts read through a RAM tier (`--ram-budget`) give the memory map's tokens and
//! log-probabilities to the bit. The GPU tests run
//! on whatever Vulkan device the machine has (lavapipe in CI) and skip without one, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::model::Model;
use spillway_daemon::synth::SynthModel;

fn has_vulkan() -> bool {
    spillway_daemon::gpu::device_or_skip().is_some()
}

/// F16 weights: the GPU's logits stay within ~0.1% of the CPU's, so a random model's close
/// greedy choices still agree (quantized weights move logits by ~1%, enough to flip them).
fn tiny_moe(dir: &Path) -> PathBuf {
    let path = dir.join("tiny-qwen2moe-f16.gguf");
    SynthModel::from_name("tiny-qwen2moe", "F16".parse().unwrap(), 3)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    path
}

fn spillwayd(model: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spillwayd"))
        .arg("run")
        .arg("--model")
        .arg(model)
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("spillwayd runs")
}

fn run_json(model: &Path, device: &str) -> Value {
    run_json_with(model, &["--device", device])
}

fn run_json_with(model: &Path, extra: &[&str]) -> Value {
    let out = spillwayd(
        model,
        &[
            extra,
            &[
                "--prompt-tokens",
                "1,17,300,5,1000",
                "--max-tokens",
                "8",
                "--temperature",
                "0",
                "--prompt-logprobs",
                "3",
                "--ignore-eos",
                "--json",
                "--threads",
                "2",
            ],
        ]
        .concat(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{extra:?}: {stderr}");
    if extra.contains(&"vulkan") {
        assert!(
            stderr.contains("experts: "),
            "a MoE model's summary: {stderr}"
        );
    }
    serde_json::from_slice(&out.stdout).unwrap()
}

fn stderr_of(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn vulkan_run_generates_the_cpu_runs_greedy_tokens() {
    if !has_vulkan() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_moe(dir.path());
    let cpu = run_json(&model, "cpu");
    let gpu = run_json(&model, "vulkan");
    assert_eq!(cpu["tokens"].as_array().unwrap().len(), 8);
    assert_eq!(gpu["tokens"], cpu["tokens"]);
    assert_eq!(gpu["prompt_tokens"], cpu["prompt_tokens"]);
    assert_eq!(cpu["device"], "cpu");
    assert!(gpu["device"].as_str().unwrap().starts_with("vulkan:"));

    let (cpu_lp, gpu_lp) = (
        cpu["prompt_logprobs"].as_array().unwrap(),
        gpu["prompt_logprobs"].as_array().unwrap(),
    );
    assert_eq!(cpu_lp.len(), 5);
    assert_eq!(gpu_lp.len(), cpu_lp.len());
    for (p, (c, g)) in cpu_lp.iter().zip(gpu_lp).enumerate() {
        let entries = |v: &Value| -> Vec<(u64, f64)> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|e| (e["token"].as_u64().unwrap(), e["logprob"].as_f64().unwrap()))
                .collect()
        };
        let (c, g) = (entries(c), entries(g));
        assert_eq!(g.len(), 3);
        // Log-probabilities move by about the logits' difference: well under 0.01 with F16.
        assert!(
            (c[0].1 - g[0].1).abs() < 0.01,
            "position {p}: {c:?} vs {g:?}"
        );
        for &(token, lp) in &g {
            if let Some(&(_, want)) = c.iter().find(|e| e.0 == token) {
                assert!(
                    (lp - want).abs() < 0.01,
                    "position {p} token {token}: {lp} vs {want}"
                );
            }
        }
    }
}

#[test]
fn experts_beyond_the_vram_budget_give_the_same_greedy_tokens() {
    let Some(device) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_moe(dir.path());
    let model = Model::open(&path).unwrap();
    let options = GpuModelOptions::default();
    let whole = GpuModel::device_bytes(&model, &options).total();
    let minimum = GpuModel::minimum_budget(&device, &model, &options)
        .unwrap()
        .total();
    let budget = (minimum + (whole - minimum) / 3).to_string();
    let all = run_json(&path, "vulkan");
    assert_eq!(all["experts"]["misses"], 0);
    for miss in ["cpu", "fetch", "pcie"] {
        let args = [
            "--device",
            "vulkan",
            "--vram-budget",
            &budget,
            "--moe-miss",
            miss,
        ];
        let got = run_json_with(&path, &args);
        assert_eq!(got["tokens"], all["tokens"], "--moe-miss {miss}");
        let e = &got["experts"];
        assert_eq!(e["miss"], miss);
        assert!(e["slots_per_layer"].as_u64().unwrap() < e["n_expert"].as_u64().unwrap());
        assert!(e["misses"].as_u64().unwrap() > 0, "{e}");
        let path_taken = match miss {
            "cpu" => "cpu",
            "fetch" => "fetched",
            _ => "pcie",
        };
        assert!(e[path_taken].as_u64().unwrap() > 0, "{e}");
        assert!(e["promoted"].as_u64().is_some(), "{e}");
    }
    // Slots that keep the experts they were loaded with: no promotions, the same tokens.
    let args = [
        "--device",
        "vulkan",
        "--vram-budget",
        &budget,
        "--static-experts",
    ];
    let got = run_json_with(&path, &args);
    assert_eq!(got["tokens"], all["tokens"], "--static-experts");
    assert_eq!(got["experts"]["promoted"], 0, "{}", got["experts"]);
    // The default miss policy is reported as what it resolved to.
    let miss = got["experts"]["miss"].as_str().unwrap();
    assert!(["cpu", "pcie"].contains(&miss), "{}", got["experts"]);
}

/// A dense model under its whole size runs its first layers on the CPU, says so, and gives
/// the unconstrained run's greedy tokens; so it does with those layers' rows shared with the
/// GPU over the bus (`--bus-rows true`).
#[test]
fn a_dense_model_beyond_the_vram_budget_gives_the_same_greedy_tokens() {
    let Some(device) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-llama-f16.gguf");
    SynthModel::from_name("tiny-llama", "F16".parse().unwrap(), 3)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    let model = Model::open(&path).unwrap();
    let options = GpuModelOptions {
        context: 64,
        ..GpuModelOptions::default()
    };
    let minimum = GpuModel::minimum_budget(&device, &model, &options)
        .expect("a dense model of four layers has a minimum")
        .total()
        .to_string();
    fn args(budget: Option<&str>) -> Vec<&str> {
        let mut a = vec!["--device", "vulkan", "--ctx", "64"];
        a.extend(budget.map(|b| ["--vram-budget", b]).into_iter().flatten());
        a.extend([
            "--prompt-tokens",
            "1,17,300,5,1000",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
            "--threads",
            "2",
        ]);
        a
    }
    let tokens = |out: &Output| {
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        (json["tokens"].clone(), stderr)
    };
    let (want, stderr) = tokens(&spillwayd(&path, &args(None)));
    assert!(!stderr.contains("run on the CPU"), "{stderr}");
    let (got, stderr) = tokens(&spillwayd(&path, &args(Some(&minimum))));
    assert_eq!(got, want, "--vram-budget {minimum}");
    assert!(
        stderr.contains("the VRAM budget holds layers 3..4 of 4: layers 0..3 run on the CPU"),
        "{stderr}"
    );
    assert!(!stderr.contains("over the bus"), "{stderr}");
    let mut bus = args(Some(&minimum));
    bus.extend(["--bus-rows", "true"]);
    let (got, stderr) = tokens(&spillwayd(&path, &bus));
    assert_eq!(got, want, "--vram-budget {minimum} --bus-rows true");
    assert!(
        stderr.contains(
            "layers 0..3 run on the CPU, sharing their decode products' rows with the GPU over \
             the bus"
        ),
        "{stderr}"
    );
}

#[test]
fn a_missing_vulkan_device_index_names_the_devices_there_are() {
    if !has_vulkan() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_moe(dir.path());
    let err = stderr_of(&spillwayd(
        &model,
        &["--device", "vulkan:99", "--prompt-tokens", "1,2"],
    ));
    assert!(err.contains("vulkan:99"), "{err}");
    assert!(err.contains("vulkan:0 ("), "{err}");
}

#[test]
fn a_budget_below_the_models_minimum_is_refused_with_what_it_needs() {
    if !has_vulkan() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_moe(dir.path());
    let err = stderr_of(&spillwayd(
        &model,
        &[
            "--device",
            "vulkan",
            "--vram-budget",
            "1MiB",
            "--prompt-tokens",
            "1,2",
        ],
    ));
    assert!(err.contains("the model needs at least"), "{err}");
    assert!(err.contains("VRAM budget of 1048576 bytes"), "{err}");
    assert!(err.contains("one expert slot per MoE layer"), "{err}");
}

#[test]
fn vulkan_without_a_driver_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_moe(dir.path());
    let missing = dir.path().join("no-such-icd.json");
    let out = Command::new(env!("CARGO_BIN_EXE_spillwayd"))
        .args(["run", "--device", "vulkan", "--prompt-tokens", "1,2"])
        .arg("--model")
        .arg(&model)
        // The loader's variables for the driver list (older and newer names): none usable.
        .env("VK_ICD_FILENAMES", &missing)
        .env("VK_DRIVER_FILES", &missing)
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert!(err.contains("--device vulkan"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn vram_budget_is_refused_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_moe(dir.path());
    let err = stderr_of(&spillwayd(
        &model,
        &["--vram-budget", "1G", "--prompt-tokens", "1,2"],
    ));
    assert!(
        err.contains("--vram-budget applies to --device vulkan"),
        "{err}"
    );
}

#[test]
fn a_ram_budget_on_the_cpu_gives_the_memory_maps_tokens_and_logprobs() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_moe(dir.path());
    let mapped = run_json(&model, "cpu");
    let ram = run_json_with(&model, &["--device", "cpu", "--ram-budget", "1MiB"]);
    // The same arithmetic on the same bytes: equal, not close.
    assert_eq!(ram["tokens"], mapped["tokens"]);
    assert_eq!(ram["prompt_logprobs"], mapped["prompt_logprobs"]);
    assert!(mapped.get("ram_tier").is_none());
    let tier = &ram["ram_tier"];
    assert!(tier["buffer_bytes"].as_u64().unwrap() <= 1 << 20, "{tier}");
    assert!(tier["misses"].as_u64().unwrap() > 0, "{tier}");
    assert!(tier["bytes_read"].as_u64().unwrap() > 0, "{tier}");

    let err = stderr_of(&spillwayd(
        &model,
        &["--ram-budget", "1KiB", "--prompt-tokens", "1,2"],
    ));
    assert!(err.contains("experts a token may compute"), "{err}");
}

#[test]
fn a_ram_budget_for_a_dense_model_on_the_cpu_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-llama.gguf");
    SynthModel::from_name("tiny-llama", "Q8_0".parse().unwrap(), 1)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    let err = stderr_of(&spillwayd(
        &path,
        &["--ram-budget", "1GiB", "--prompt-tokens", "1,2"],
    ));
    assert!(err.contains("this model has none"), "{err}");
}
