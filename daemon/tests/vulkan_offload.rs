//! MoE models over the VRAM budget (`gpu::placement`): from the smallest budget that runs them
//! to the whole model, with misses computed on the CPU, fetched into VRAM slots or read by the
//! GPU from system RAM, ten decode
//! steps give the logits of the unconstrained GPU run, and the expert counters show which path
//! each expert took. F16 weights keep the CPU experts' rounding (activations to f16) within
//! 0.1% of the logits, as in `bench/tests/vulkan_forward.rs`. The tests run on whatever Vulkan
//! device the machine has (lavapipe in CI) and skip without one, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "common/f16_model.rs"]
mod f16_model;
use f16_model::f16_model;
#[path = "common/chain_device.rs"]
mod chain_device;
#[path = "common/logits.rs"]
mod logits;
use chain_device::chain_device;
use logits::assert_logits_close;

use std::sync::Arc;

use spillway_daemon::gpu::alloc::MemoryUse;
use spillway_daemon::gpu::chain::Handoff;
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::moe::LayerRouting;
use spillway_daemon::gpu::placement::{ExpertLayout, MoeMiss};
use spillway_daemon::gpu::{Device, GpuError};
use spillway_daemon::stream::ReplacementPolicy;

fn device() -> Option<Arc<Device>> {
    spillway_daemon::gpu::device_or_skip()
}

/// As `vulkan_forward.rs`: with F16 weights the CPU's experts stay within 0.1% of the logits.
const TOLERANCE_F16: f32 = 0.003;

/// Router logits whose k-th and (k+1)-th are this close (relative to the largest) may route
/// differently once a CPU expert's rounding reached the layer's input; such a token is excused.
const ROUTER_TIE: f32 = 0.02;

const TOKENS: [u32; 10] = [1, 17, 300, 5, 1000, 42, 7, 99, 3, 800];

fn options(budget: Option<u64>, miss: MoeMiss) -> GpuModelOptions {
    GpuModelOptions {
        vram_budget: budget,
        context: 32,
        moe_miss: miss,
        expert_layout: ExpertLayout::Even,
        expert_policy: ReplacementPolicy::Lru,
        threads: 2,
        host_routing: false,
        ram_budget: None,
        // Split misses: half each to the CPU and the bus, so that both paths run.
        split_cpu_share: Some(0.5),
        ..GpuModelOptions::default()
    }
}

/// Logits and routings of every step.
fn decode(gpu: &mut GpuModel) -> (Vec<Vec<f32>>, Vec<Vec<LayerRouting>>) {
    TOKENS
        .iter()
        .map(|&t| {
            let logits = gpu.eval(t).unwrap();
            (logits, gpu.last_routing().to_vec())
        })
        .unzip()
}

fn near_tie(r: &LayerRouting) -> bool {
    let mut l = r.router_logits.clone();
    l.sort_by(|a, b| b.total_cmp(a));
    let k = r.experts.len();
    let top = l.iter().fold(0f32, |m, v| m.max(v.abs()));
    k < l.len() && l[k - 1] - l[k] < ROUTER_TIE * top
}

fn experts_of(r: &[LayerRouting]) -> Vec<Vec<usize>> {
    r.iter()
        .map(|l| l.experts.iter().map(|e| e.expert).collect())
        .collect()
}

/// `got`'s logits are `want`'s within the F16 tolerance, but for tokens whose routing had a
/// near tie (at most a quarter of them).
fn assert_near(
    what: &str,
    (got, routing): (&[Vec<f32>], &[Vec<LayerRouting>]),
    (want, want_routing): (&[Vec<f32>], &[Vec<LayerRouting>]),
) {
    let mut excused = 0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let range = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let rerouted = experts_of(&routing[i]) != experts_of(&want_routing[i]);
        eprintln!("{what}: token {i}: |diff| {diff} of {range}, rerouted {rerouted}");
        if diff > TOLERANCE_F16 * range {
            let tie = want_routing[i].iter().any(near_tie);
            assert!(tie, "{what}: token {i} differs by {diff} of {range}");
            excused += 1;
        }
    }
    assert!(excused * 4 <= TOKENS.len(), "{what}: {excused} excused");
}

fn offload(preset: &str) {
    let Some(dev) = device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), preset);
    let cfg = model.config.moe.unwrap();
    let whole = GpuModel::device_bytes(&model, &options(None, MoeMiss::Cpu)).total();
    let minimum = GpuModel::minimum_budget(&dev, &model, &options(None, MoeMiss::Cpu))
        .expect("a MoE model has a minimum budget")
        .total();
    assert!(minimum < whole, "{preset}: minimum {minimum} of {whole}");
    let mut reference = GpuModel::new(&dev, &model, &options(None, MoeMiss::Cpu)).unwrap();
    let (want, want_routing) = decode(&mut reference);
    // Every expert resident: routed on the device, one submission per token.
    assert!(reference.routes_on_device(), "{preset}: unconstrained");
    assert_eq!(reference.last_stats().submits, 1, "{preset}: unconstrained");
    // The same experts all resident, routed on the host: the arithmetic of the read-back path,
    // which slots filled by fetches must reproduce exactly.
    let host = GpuModelOptions {
        host_routing: true,
        ..options(None, MoeMiss::Cpu)
    };
    let mut host = GpuModel::new(&dev, &model, &host).unwrap();
    let (want_host, _) = decode(&mut host);
    assert!(!host.routes_on_device(), "{preset}: host routing");
    assert_eq!(host.last_stats().submits as usize, 1 + model.config.n_layer);
    let routed = (TOKENS.len() * model.config.n_layer * cfg.n_expert_used) as u64;
    let all = reference.expert_stats().unwrap().total();
    assert_eq!(
        (all.hits, all.misses),
        (routed, 0),
        "{preset}: unconstrained"
    );

    // Enough for half the experts in every layer beside the minimum's one.
    let half = minimum + (whole - minimum) / 2;
    for budget in [minimum, half, whole] {
        let asked_all = [
            MoeMiss::Cpu,
            MoeMiss::Fetch,
            MoeMiss::Pcie,
            MoeMiss::Split,
            MoeMiss::Auto,
        ];
        for asked in asked_all {
            let what = format!("{preset}, budget {budget} of {whole}, misses {asked}");
            let mut gpu = GpuModel::new(&dev, &model, &options(Some(budget), asked)).unwrap();
            // `auto` is resolved at load: the CPU where the device has no memory across a bus
            // (lavapipe), as CI has it.
            let miss = gpu.expert_stats().unwrap().miss;
            match asked {
                MoeMiss::Auto if gpu.allocator().budget_counts(MemoryUse::Staging) => {
                    assert_eq!(miss, MoeMiss::Cpu, "{what}")
                }
                MoeMiss::Auto => assert_ne!(miss, MoeMiss::Auto, "{what}"),
                _ => assert_eq!(miss, asked, "{what}"),
            }
            let slots = gpu.placement().slots;
            let over_bus = matches!(miss, MoeMiss::Pcie | MoeMiss::Split);
            if budget == minimum && !over_bus {
                assert_eq!(slots, 1, "{what}: the minimum holds one slot per layer");
            }
            if over_bus && slots < cfg.n_expert {
                // The embedding went to system RAM with the experts: the minimum of misses on
                // the CPU holds more slots.
                assert!(gpu.host_embedding_bytes() > 0, "{what}");
                if budget == minimum {
                    assert!(slots > 1, "{what}: {slots} slots");
                }
            }
            let (got, routing) = decode(&mut gpu);
            // Misses on the CPU, fetched or split need the routing on the host: a read-back
            // per MoE layer. Read over PCIe, they do not.
            let on_device = slots == cfg.n_expert || miss == MoeMiss::Pcie;
            assert_eq!(gpu.routes_on_device(), on_device, "{what}");
            if !gpu.routes_on_device() {
                let submits = gpu.last_stats().submits as usize;
                assert!(submits > model.config.n_layer, "{what}: {submits} submits");
            }
            assert_near(&what, (&got, &routing), (&want, &want_routing));

            let stats = gpu.expert_stats().unwrap();
            let t = stats.total();
            eprintln!("{what}: {}", stats.summary());
            assert_eq!(t.hits + t.misses, routed, "{what}");
            assert_eq!(t.cpu + t.fetched + t.pcie, t.misses, "{what}");
            if slots == cfg.n_expert {
                assert_eq!(t.misses, 0, "{what}");
                assert_eq!(got, want, "{what}: all resident is the unconstrained run");
                continue;
            }
            assert!(t.misses > 0, "{what}: {t:?}");
            match miss {
                MoeMiss::Cpu | MoeMiss::Auto => {
                    assert_eq!((t.cpu, t.fetched), (t.misses, 0), "{what}")
                }
                MoeMiss::Fetch => {
                    assert!(t.fetched > 0 && t.evictions > 0, "{what}: {t:?}");
                    assert!(t.bytes_uploaded > 0, "{what}");
                }
                MoeMiss::Pcie => {
                    // The same kernels on the same weights, the sum of the experts in VRAM
                    // and of those read from RAM added apart: rounding only, on every token.
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_logits_close(g, w, 1e-4, &format!("{what}: token {i}"));
                    }
                    assert_eq!((t.pcie, t.cpu, t.fetched), (t.misses, 0, 0), "{what}");
                    assert_eq!(gpu.last_stats().submits, 1, "{what}: one submission a step");
                    assert!(gpu.host_expert_bytes() > 0, "{what}");
                }
                MoeMiss::Split => {
                    // Half of each layer's misses on the CPU, the rest read over the bus, in
                    // a chain: one part for the start and two for each MoE layer. (A lone
                    // miss goes to the CPU.)
                    if budget < whole {
                        assert!(t.cpu > 0 && t.pcie > 0, "{what}: {t:?}");
                    }
                    assert_eq!(t.cpu + t.pcie, t.misses, "{what}");
                    assert!(gpu.host_expert_bytes() > 0, "{what}");
                    assert_eq!(gpu.split_cpu_share(), Some(0.5), "{what}");
                    let n_moe = model.config.n_layer;
                    assert_eq!(gpu.last_stats().submits as usize, 1 + 2 * n_moe, "{what}");
                }
            }
            if budget == half {
                assert!(t.hits > 0, "{what}: {t:?}");
                if miss == MoeMiss::Fetch {
                    // Slots enough for every expert of a token: all run on the GPU, as the
                    // unconstrained run computes them, just from other slots.
                    assert!(slots >= cfg.n_expert_used, "{what}");
                    assert_eq!(t.cpu, 0, "{what}");
                    assert_eq!(got, want_host, "{what}: fetching changes no arithmetic");
                }
            }
        }
    }

    let err = GpuModel::new(&dev, &model, &options(Some(minimum - 1), MoeMiss::Cpu))
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
    assert!(msg.contains("one expert slot per MoE layer"), "{msg}");
}

#[test]
fn qwen3moe_over_the_vram_budget_decodes_as_unconstrained() {
    offload("tiny-qwen3moe");
}

#[test]
fn qwen2moe_over_the_vram_budget_decodes_as_unconstrained() {
    offload("tiny-qwen2moe");
}

/// A step with CPU experts as one chain of command buffers gives the logits, the routing and
/// the expert counters of the same step as separate submissions, bit for bit: the chain changes
/// when the host acts, not what the device computes. At the minimum budget (one slot) and at
/// half the experts, with either handoff between the host and the device (timeline semaphores,
/// events), and with the chain's parts recorded once and submitted again for every step or
/// recorded anew for each.
fn chain_matches_separate_submissions(preset: &str) {
    // A driver without chains keeps separate submissions, which the test above covers.
    let Some(dev) = chain_device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), preset);
    let n_moe = model
        .layers
        .iter()
        .filter(|l| matches!(l.ffn, spillway_daemon::model::Ffn::Moe(_)))
        .count();
    let base = options(None, MoeMiss::Cpu);
    let whole = GpuModel::device_bytes(&model, &base).total();
    let minimum = GpuModel::minimum_budget(&dev, &model, &base)
        .unwrap()
        .total();
    for budget in [minimum, minimum + (whole - minimum) / 2] {
        let what = format!("{preset}, budget {budget} of {whole}");
        let run = |chain: bool, handoff: Handoff, replay: bool| {
            // Promotions follow measured times, which differ between runs: off here, so that
            // both runs keep the same experts resident.
            let o = GpuModelOptions {
                chain,
                handoff,
                replay,
                promote_experts: false,
                ..options(Some(budget), MoeMiss::Cpu)
            };
            let mut gpu = GpuModel::new(&dev, &model, &o).unwrap();
            let (logits, routing) = decode(&mut gpu);
            let stats = gpu.expert_stats().unwrap().total();
            (logits, routing, stats, gpu.last_stats().submits as usize)
        };
        let (want, want_routing, want_stats, separate) = run(false, Handoff::Semaphores, true);
        assert!(separate > 1 + n_moe, "{what}: {separate} submissions");
        for (handoff, replay) in [
            (Handoff::Semaphores, true),
            (Handoff::Events, true),
            (Handoff::Semaphores, false),
        ] {
            let what = format!("{what}, {handoff:?}, parts kept: {replay}");
            let (got, routing, stats, parts) = run(true, handoff, replay);
            assert!(stats.cpu > 0, "{what}: some experts ran on the CPU");
            assert_eq!(parts, 1 + 2 * n_moe, "{what}: parts of a chained step");
            assert_eq!(got, want, "{what}: logits");
            assert_eq!(routing, want_routing, "{what}: routing");
            assert_eq!(stats, want_stats, "{what}: expert counters");
        }
    }
}

#[test]
fn qwen3moe_chained_steps_equal_separate_submissions() {
    chain_matches_separate_submissions("tiny-qwen3moe");
}

#[test]
fn qwen2moe_chained_steps_equal_separate_submissions() {
    chain_matches_separate_submissions("tiny-qwen2moe");
}

/// Under a RAM budget the CPU's experts come from a cache that reads them from the file
/// (io_uring or pread) instead of the memory map: the same bytes, so the same logits bit for
/// bit; every CPU expert is one lookup of the cache, what missed was read, and the cache never
/// holds more than the budget. A budget under the k experts of one token is refused, and so is
/// a RAM budget for fetched experts.
fn ram_tier(preset: &str) {
    let Some(dev) = device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), preset);
    let k = model.config.moe.unwrap().n_expert_used as u64;
    let base = options(None, MoeMiss::Cpu);
    let vram = GpuModel::minimum_budget(&dev, &model, &base)
        .unwrap()
        .total();
    // Promotions follow measured times, which differ between runs (and with the machine's
    // load): off here, so that every run keeps the same experts resident.
    let fixed = GpuModelOptions {
        promote_experts: false,
        ..options(Some(vram), MoeMiss::Cpu)
    };
    let mut mapped = GpuModel::new(&dev, &model, &fixed).unwrap();
    let (want, _) = decode(&mut mapped);
    assert!(mapped.ram_tier().is_none());
    let cpu_experts = mapped.expert_stats().unwrap().total().cpu;
    assert!(cpu_experts > 0, "{preset}: experts on the CPU");

    let minimum = spillway_daemon::stream::minimum_ram_budget(&model);
    let one = spillway_daemon::stream::expert_bytes(&model);
    assert!(
        minimum >= k * one,
        "{preset}: {minimum} for {k} experts of {one} bytes"
    );
    for ram in [minimum, 2 * minimum] {
        let what = format!("{preset}, RAM budget {ram}");
        let o = GpuModelOptions {
            ram_budget: Some(ram),
            ..fixed.clone()
        };
        let mut gpu = GpuModel::new(&dev, &model, &o).unwrap();
        let (got, _) = decode(&mut gpu);
        assert_eq!(got, want, "{what}: logits");
        let (layers, held) = gpu.ram_tier().expect("a RAM tier");
        let hits: u64 = layers.iter().map(|l| l.hits).sum();
        let misses: u64 = layers.iter().map(|l| l.misses).sum();
        eprintln!("{what}: {hits} hits, {misses} misses, {held} bytes held");
        assert_eq!(
            hits + misses,
            cpu_experts,
            "{what}: one lookup per CPU expert"
        );
        assert!(misses > 0, "{what}");
        assert!(held <= ram, "{what}: {held} bytes held");
    }

    let o = GpuModelOptions {
        ram_budget: Some(minimum - 1),
        ..options(Some(vram), MoeMiss::Cpu)
    };
    let err = GpuModel::new(&dev, &model, &o)
        .err()
        .expect("under k experts");
    assert!(
        err.to_string()
            .contains(&format!("below the {minimum} bytes")),
        "{preset}: {err}"
    );
    let o = GpuModelOptions {
        ram_budget: Some(minimum),
        ..options(Some(vram), MoeMiss::Fetch)
    };
    let err = GpuModel::new(&dev, &model, &o)
        .err()
        .expect("fetch and RAM");
    assert!(matches!(err, GpuError::Unsupported(_)), "{preset}: {err}");
}

#[test]
fn qwen3moe_cpu_experts_from_a_ram_budget_equal_the_memory_map() {
    ram_tier("tiny-qwen3moe");
}

#[test]
fn qwen2moe_cpu_experts_from_a_ram_budget_equal_the_memory_map() {
    ram_tier("tiny-qwen2moe");
}

/// The expert layouts under a budget of half the experts: each layer holds the slots its
/// layout gives it, a whole layer misses nothing, a one-slot layer misses, and the logits stay
/// the unconstrained run's.
#[test]
fn expert_layouts_place_slots_per_layer_and_decode_as_unconstrained() {
    let Some(dev) = device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), "tiny-qwen3moe");
    let n = model.config.moe.unwrap().n_expert;
    let layers = model.config.n_layer;
    let whole = GpuModel::device_bytes(&model, &options(None, MoeMiss::Cpu)).total();
    let minimum = GpuModel::minimum_budget(&dev, &model, &options(None, MoeMiss::Cpu))
        .unwrap()
        .total();
    let budget = minimum + (whole - minimum) * 3 / 4;
    let mut reference = GpuModel::new(&dev, &model, &options(None, MoeMiss::Cpu)).unwrap();
    let want = decode(&mut reference);
    let even = GpuModel::new(&dev, &model, &options(Some(budget), MoeMiss::Cpu)).unwrap();
    let capacity = even.placement().slots * layers;
    drop(even);
    let mut given = vec![1; layers];
    given[0] = n;
    for layout in [
        ExpertLayout::Layers,
        ExpertLayout::Cpu,
        ExpertLayout::Given(given.clone()),
    ] {
        let what = format!("tiny-qwen3moe, budget {budget} of {whole}, {layout:?}");
        let o = GpuModelOptions {
            expert_layout: layout.clone(),
            ..options(Some(budget), MoeMiss::Cpu)
        };
        let mut gpu = GpuModel::new(&dev, &model, &o).unwrap();
        let per_layer = gpu.placement().per_layer();
        eprintln!("{what}: slots {per_layer:?} of {capacity}");
        assert!(per_layer.iter().sum::<usize>() <= capacity, "{what}");
        match &layout {
            ExpertLayout::Cpu => assert!(per_layer.iter().all(|&s| s == 1), "{what}"),
            ExpertLayout::Layers => {
                assert_eq!(per_layer[layers - 1], n, "{what}: the last layer whole");
                assert_eq!(per_layer[0], 1, "{what}");
            }
            _ => assert_eq!(per_layer, given, "{what}"),
        }
        let got = decode(&mut gpu);
        assert_near(&what, (&got.0, &got.1), (&want.0, &want.1));
        let stats = gpu.expert_stats().unwrap();
        for (il, s) in stats.layers.iter().enumerate() {
            if per_layer[il] == n {
                assert_eq!(s.misses, 0, "{what}: layer {il}");
            } else {
                assert!(
                    s.misses > 0 && s.cpu == s.misses,
                    "{what}: layer {il}: {s:?}"
                );
            }
        }
    }
}
