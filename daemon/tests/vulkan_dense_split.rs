//! Dense models over the VRAM budget (`gpu::placement`, `gpu::cpu_layers`): the first layers
//! run on the CPU and the rest on the GPU. From the smallest budget that runs a model (its last
//! layer on the GPU) to the whole model, a prompt's logits (every token's, in chunks) and ten
//! decode steps after it give the unconstrained GPU run's logits; below the smallest budget the
//! model is refused with what it needs. F16 weights keep the CPU layers' rounding (activations
//! to f16) within 0.1% of the logits, as in `bench/tests/vulkan_forward.rs`. The tests run on
//! whatever Vulkan device the machine has (lavapipe in CI) and skip without one, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "common/f16_model.rs"]
mod f16_model;
use f16_model::f16_model;

use std::sync::Arc;

use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions, STREAM_MIN_TOKENS};
use spillway_daemon::gpu::{footprint, Device, GpuError};

fn device() -> Option<Arc<Device>> {
    spillway_daemon::gpu::device_or_skip()
}

/// As `vulkan_forward.rs`: with F16 weights the CPU's arithmetic stays within 0.1% of the
/// logits' range.
const TOLERANCE_F16: f32 = 0.003;

/// Prompts: one shorter than `STREAM_MIN_TOKENS`, whose CPU layers run on the CPU, and one
/// long enough for them to run on the GPU through the stream slot.
const SHORT: [u32; 9] = [2, 40, 7, 500, 33, 1, 1200, 8, 64];
const LONG: usize = 40;
const CONTEXT: usize = 80;
const TOKENS: [u32; 10] = [1, 17, 300, 5, 1000, 42, 7, 99, 3, 800];

fn options(budget: Option<u64>, stream: bool) -> GpuModelOptions {
    GpuModelOptions {
        vram_budget: budget,
        context: CONTEXT,
        threads: 2,
        stream_prompts: stream,
        ..GpuModelOptions::default()
    }
}

/// Every prompt token's logits, then each decode step's: a short prompt, decode steps, a long
/// prompt after them (its chunk reads the keys before it), decode steps; then after a reset the
/// long prompt alone and decode steps.
fn run(gpu: &mut GpuModel, n_vocab: usize) -> Vec<Vec<f32>> {
    const { assert!(LONG >= STREAM_MIN_TOKENS) };
    let long: Vec<u32> = (0..LONG as u32).map(|i| (i * 37 + 11) % 1500).collect();
    let mut out = Vec::new();
    for (reset, prompt) in [(true, &SHORT[..]), (false, &long), (true, &long)] {
        if reset {
            gpu.reset();
        }
        let at = gpu.position();
        let logits = gpu.eval_prompt(prompt, true).unwrap();
        out.extend(logits.chunks_exact(n_vocab).map(<[f32]>::to_vec));
        out.extend(TOKENS.iter().map(|&t| gpu.eval(t).unwrap()));
        assert_eq!(gpu.position(), at + prompt.len() + TOKENS.len());
    }
    assert_eq!(out.len(), SHORT.len() + 2 * LONG + 3 * TOKENS.len());
    out
}

fn assert_near(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let range = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= TOLERANCE_F16 * range,
            "{what}: position {i} differs by {diff} of {range}"
        );
    }
}

fn split(preset: &str) {
    let Some(dev) = device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), preset);
    let (n_layer, n_vocab) = (model.config.n_layer, model.config.n_vocab);
    let whole = GpuModel::device_bytes(&model, &options(None, true)).total();
    let minimum = GpuModel::minimum_budget(&dev, &model, &options(None, true))
        .expect("a dense model of several layers has a minimum budget")
        .total();
    // The whole model loads with its upload staging (16 MiB, counted where the device's memory
    // is one heap, as lavapipe's) and the alignment margin on top.
    let top = whole + (64 << 20);
    assert!(minimum < top, "{preset}: minimum {minimum} of {whole}");

    let mut reference = GpuModel::new(&dev, &model, &options(None, true)).unwrap();
    assert_eq!(reference.cpu_layers(), 0);
    let want = run(&mut reference, n_vocab);
    drop(reference);

    // From the minimum to the whole model (with its staging and margin) in steps, then well
    // above: fewer layers on the CPU as the budget grows, each split giving the same logits.
    let full = whole + (17 << 20);
    let mut budgets: Vec<u64> = (0..8u64)
        .map(|i| minimum + full.saturating_sub(minimum) * i / 8)
        .chain([top])
        .collect();
    // And budgets that hold the stream slot beside `k` layers on the CPU (with the staging and
    // the margin), where that is less than the whole model.
    let slot = footprint::stream_slot_bytes(&model, CONTEXT);
    budgets.extend(
        (1..n_layer)
            .map(|k| footprint::split_bytes(&model, CONTEXT, k).total() + slot + (17 << 20))
            .filter(|&b| b < whole + (16 << 20)),
    );
    budgets.sort_unstable();
    let (mut seen, mut streamed) = (Vec::new(), 0);
    // Layer 0's keys and values after the last sequence of `run` with the prompt's CPU layers
    // on the CPU: those computed through the stream slot must be the same but for rounding
    // (the logits of these random models hardly depend on the keys read).
    let mut cpu_kv: Option<(Vec<f32>, Vec<f32>)> = None;
    for (i, &budget) in budgets.iter().enumerate() {
        for stream in [false, true] {
            let mut gpu = GpuModel::new(&dev, &model, &options(Some(budget), stream)).unwrap();
            let cpu = gpu.cpu_layers();
            let held = gpu.allocator().budget().held();
            let what = format!(
                "{preset}, budget {budget}: {cpu} of {n_layer} layers on the CPU, prompts through \
             a slot: {}",
                gpu.streams_prompts()
            );
            eprintln!("{what}, {held} bytes held");
            assert!(held <= budget, "{what}: {held} bytes held");
            assert_eq!(gpu.config().n_layer, n_layer - cpu, "{what}");
            assert!(!gpu.streams_prompts() || (stream && cpu > 0), "{what}");

            if i == 0 {
                assert_eq!(cpu, n_layer - 1, "{what}: the minimum holds one layer");
            }
            if budget == top {
                assert_eq!(cpu, 0, "{what}: the whole model fits");
            }
            if !stream {
                assert!(seen.last().is_none_or(|&last| cpu <= last), "{what}");
                seen.push(cpu);
            }
            let got = run(&mut gpu, n_vocab);
            // Well above the whole model the prompt's chunk fits too (under a tighter budget its
            // buffers may not, and the prompt then goes token by token).
            if budget == top {
                assert_eq!(
                    got, want,
                    "{what}: the whole model is the unconstrained run"
                );
            }
            assert_near(&what, &got, &want);
            // Two of the three prompts are long enough.
            if gpu.streams_prompts() {
                assert_eq!(gpu.streamed_chunks(), 2, "{what}");
                streamed += 1;
            }
            let Some(kv) = gpu.cpu_kv_cache() else {
                continue;
            };
            let n = LONG + TOKENS.len();
            let f32s = |h: &[half::f16]| h.iter().map(|v| v.to_f32()).collect::<Vec<_>>();
            let layer0 = (f32s(kv.keys(0, n)), f32s(kv.values(0, n)));
            match (&cpu_kv, gpu.streams_prompts()) {
                (_, false) => cpu_kv = Some(layer0),
                (Some(want), true) => {
                    for (got, want) in [(&layer0.0, &want.0), (&layer0.1, &want.1)] {
                        let range = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let diff = got
                            .iter()
                            .zip(want)
                            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                        assert!(
                            range > 0.0 && diff <= 0.02 * range,
                            "{what}: cache {diff} of {range}"
                        );
                    }
                }
                (None, true) => {}
            }
        }
    }
    // With two layers a budget that holds one and the slot holds the whole model.
    if n_layer > 2 {
        assert!(
            streamed > 0,
            "{preset}: no budget left room for the stream slot"
        );
    }
    // Every split from the most layers on the CPU to none.
    let mut splits = seen.clone();
    splits.dedup();
    assert_eq!(
        splits,
        (0..n_layer).rev().collect::<Vec<_>>(),
        "{preset}: {seen:?}"
    );

    let err = GpuModel::new(&dev, &model, &options(Some(minimum - 1), true))
        .err()
        .expect("below the minimum budget");
    assert!(
        matches!(err, GpuError::BelowMinimumBudget { .. }),
        "{preset}: {err}"
    );
    let msg = err.to_string();
    eprintln!("{preset}, budget {}: {msg}", minimum - 1);
    assert!(
        msg.contains(&format!("needs at least {minimum} bytes")),
        "{msg}"
    );
}

/// Four layers, an untied output: one to three layers on the CPU.
#[test]
fn llama_over_the_vram_budget_runs_its_first_layers_on_the_cpu() {
    split("tiny-llama");
}

/// QK-norm and an output tied to the embedding, which the GPU then holds for the head alone.
#[test]
fn qwen3_over_the_vram_budget_runs_its_first_layers_on_the_cpu() {
    split("tiny-qwen3");
}

/// With the CPU's layers sharing each decode step's products with the GPU, which reads its rows
/// over the bus (`GpuModelOptions::bus_rows`), the logits stay the unconstrained run's: at the
/// smallest budget (every layer but the last on the CPU), with the CPU taking half the rows,
/// none of them (the GPU all but the rows past its last whole step), all of them, and shares
/// balanced group by group.
fn bus_rows(preset: &str) {
    let Some(dev) = device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), preset);
    let (n_layer, n_vocab) = (model.config.n_layer, model.config.n_vocab);
    let want = run(
        &mut GpuModel::new(&dev, &model, &options(None, true)).unwrap(),
        n_vocab,
    );
    let minimum = GpuModel::minimum_budget(&dev, &model, &options(None, true))
        .unwrap()
        .total();
    for share in [Some(0.5), Some(0.0), Some(1.0), None] {
        let opts = GpuModelOptions {
            bus_rows: true,
            split_cpu_share: share,
            ..options(Some(minimum), true)
        };
        let mut gpu = GpuModel::new(&dev, &model, &opts).unwrap();
        let what = format!("{preset}, the CPU's share {share:?}");
        assert_eq!(gpu.cpu_layers(), n_layer - 1, "{what}");
        let got = run(&mut gpu, n_vocab);
        assert_near(&what, &got, &want);
        let now = gpu.bus_rows_cpu_shares().expect("rows over the bus");
        for (group, now) in now {
            match share {
                Some(s) => assert_eq!(now, s, "{what}: {group:?}"),
                None => assert!((0.0..=1.0).contains(&now), "{what}: {group:?} {now}"),
            }
        }
    }
    // Without layers on the CPU there is nothing to share.
    let whole = GpuModelOptions {
        bus_rows: true,
        ..options(None, true)
    };
    let gpu = GpuModel::new(&dev, &model, &whole).unwrap();
    assert!(gpu.bus_rows_cpu_shares().is_none(), "{preset}");
}

#[test]
fn llama_shares_its_cpu_layers_rows_with_the_gpu_over_the_bus() {
    bus_rows("tiny-llama");
}

#[test]
fn qwen3_shares_its_cpu_layers_rows_with_the_gpu_over_the_bus() {
    bus_rows("tiny-qwen3");
}
