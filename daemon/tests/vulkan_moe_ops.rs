//! The MoE ops on the Vulkan device against the CPU engine: the routing (`engine::routing`) with
//! ties and near ties, with a slot map and fused into the router's product, the expert-indexed
//! product against the rows of the same expert, and the routed sum against `scale_add`. They run
//! on whatever Vulkan device the machine has (lavapipe in CI); without one they skip, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set, in which case they fail. Tolerances are stated where each
//! comparison is made.

#[path = "common/noise.rs"]
mod noise;
use noise::noise;
#[path = "common/ops_device.rs"]
mod ops_device;
use ops_device::{device, weight_rows, Gpu, TYPES};

use spillway_daemon::gguf::GgmlType;

// ---- MoE routing on the device ----

/// Router logits for `n` experts: noise, then equal values and near ties among the largest.
fn router_logits(n: usize, seed: u64, case: usize) -> Vec<f32> {
    let mut l: Vec<f32> = noise(n, seed).iter().map(|v| v * 4.0).collect();
    let mut by_size: Vec<usize> = (0..n).collect();
    by_size.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    match case {
        // Plain noise.
        0 => {}
        // The largest few repeated at higher indices: ties across the k-th place.
        1 => {
            for w in by_size.windows(2).take(6) {
                l[w[1].max(w[0])] = l[w[1].min(w[0])];
            }
        }
        // Near ties: neighbours 1e-4 apart, and -0.0 beside 0.0.
        2 => {
            for w in by_size.windows(2).take(6) {
                l[w[1]] = l[w[0]] - 1e-4;
            }
            l[0] = 0.0;
            l[n - 1] = -0.0;
        }
        // Every expert equal: the lowest k win.
        _ => l.iter_mut().for_each(|v| *v = 0.25),
    }
    l
}

#[test]
fn moe_route_matches_engine_routing_with_ties() {
    use spillway_daemon::engine::routing::{route, shared_expert_gate};
    use spillway_daemon::gpu::ops::{route_floats, route_log_floats, MoeRouteArgs};
    use spillway_daemon::model::MoeConfig;
    let Some(dev) = device() else { return };
    for gpu in Gpu::both(&dev) {
        for (n_expert, k, norm_weights, shared) in [
            (16, 4, true, false),
            (16, 4, false, true),
            (60, 4, false, true),
            (128, 8, true, false),
            (256, 8, true, false),
            (8, 8, false, false),
        ] {
            let cfg = MoeConfig {
                n_expert,
                n_expert_used: k,
                n_ff_expert: 32,
                norm_weights,
            };
            for case in 0..4 {
                for seed in 0..3 {
                    let what = format!("{n_expert} experts top {k}, case {case}, seed {seed}");
                    let logits = router_logits(n_expert, 11 * seed + case as u64, case);
                    let shared_logit = noise(1, seed + 40)[0] * 3.0;
                    let lb = gpu.f32s(&logits);
                    let sb = gpu.f32s(&[shared_logit]);
                    let rb = gpu.zeros(route_floats(k));
                    // Logged at the second slot, as layer 1 would be.
                    let per = route_log_floats(n_expert, k);
                    let log = gpu.zeros(2 * per);
                    let args = MoeRouteArgs {
                        n_expert: n_expert as u32,
                        k: k as u32,
                        norm_weights,
                        log_offset: per as u32,
                        slots: None,
                    };
                    gpu.kernels
                        .record(|r| r.moe_route(&lb, shared.then_some(&sb), &rb, &log, args))
                        .unwrap();
                    let got = rb.read_f32(route_floats(k));
                    let want = route(&cfg, &logits);
                    let ids: Vec<usize> = got[..k].iter().map(|v| v.to_bits() as usize).collect();
                    let want_ids: Vec<usize> = want.iter().map(|r| r.expert).collect();
                    assert_eq!(ids, want_ids, "{what}: experts");
                    for (r, w) in want.iter().enumerate() {
                        // Softmax through the device's exp: within a few ulp.
                        let g = got[k + r];
                        assert!(
                            (g - w.weight).abs() <= 1e-5 * w.weight + 1e-9,
                            "{what}: weight {r}: gpu {g} cpu {}",
                            w.weight
                        );
                    }
                    if shared {
                        let g = got[2 * k];
                        let w = shared_expert_gate(shared_logit);
                        assert!((g - w).abs() <= 1e-6, "{what}: shared gate {g} vs {w}");
                    }
                    let logged = log.read_f32(2 * per);
                    assert_eq!(&logged[per..per + n_expert], &logits[..], "{what}: log");
                    let routing = &logged[per + n_expert..per + n_expert + 2 * k];
                    assert_eq!(
                        routing.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        got[..2 * k].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{what}: the log holds the routing"
                    );
                }
            }
        }
        let (lb, rb, log) = (gpu.zeros(300), gpu.zeros(17), gpu.zeros(400));
        let args = MoeRouteArgs {
            n_expert: 300,
            k: 8,
            norm_weights: true,
            log_offset: 0,
            slots: None,
        };
        let over = gpu
            .kernels
            .record(|r| r.moe_route(&lb, None, &rb, &log, args));
        assert!(over.is_err(), "more than 256 experts are refused");
    }
}

#[test]
fn moe_route_with_a_slot_map_lists_slots_and_experts_without_one_apart() {
    // A layer over its VRAM budget: the routing's ids become slots, and the experts without
    // one are listed after the shared gate; each list leaves the other's entries empty.
    use spillway_daemon::engine::routing::route;
    use spillway_daemon::gpu::ops::{
        route_floats, route_log_floats, route_split_floats, MoeRouteArgs,
    };
    use spillway_daemon::model::MoeConfig;
    let Some(dev) = device() else { return };
    const NONE: u32 = u32::MAX;
    for gpu in Gpu::both(&dev) {
        let (n_expert, k) = (16, 4);
        let cfg = MoeConfig {
            n_expert,
            n_expert_used: k,
            n_ff_expert: 32,
            norm_weights: true,
        };
        for seed in 0..6 {
            let logits = router_logits(n_expert, 7 + seed, 0);
            // Layer 1's part of the map: even experts hold slot e / 2, odd ones none; layer
            // 0's part is garbage that must not be read.
            let mut map = vec![7u32; n_expert];
            map.extend((0..n_expert as u32).map(|e| if e % 2 == 0 { e / 2 } else { NONE }));
            let map_f: Vec<f32> = map.iter().map(|&w| f32::from_bits(w)).collect();
            let mb = gpu.f32s(&map_f);
            let lb = gpu.f32s(&logits);
            let rb = gpu.zeros(route_split_floats(k));
            let log = gpu.zeros(route_log_floats(n_expert, k));
            let args = MoeRouteArgs {
                n_expert: n_expert as u32,
                k: k as u32,
                norm_weights: true,
                log_offset: 0,
                slots: Some((&mb, n_expert as u32)),
            };
            gpu.kernels
                .record(|r| r.moe_route(&lb, None, &rb, &log, args))
                .unwrap();
            let got: Vec<u32> = rb
                .read_f32(route_split_floats(k))
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let want = route(&cfg, &logits);
            let host_at = route_floats(k);
            for (r, w) in want.iter().enumerate() {
                let (slot, host) = (got[r], got[host_at + r]);
                if w.expert % 2 == 0 {
                    assert_eq!(
                        (slot, host),
                        (w.expert as u32 / 2, NONE),
                        "seed {seed} rank {r}"
                    );
                } else {
                    assert_eq!(
                        (slot, host),
                        (NONE, w.expert as u32),
                        "seed {seed} rank {r}"
                    );
                }
            }
            let logged = log.read_f32(route_log_floats(n_expert, k));
            let ids: Vec<usize> = logged[n_expert..n_expert + k]
                .iter()
                .map(|v| v.to_bits() as usize)
                .collect();
            let want_ids: Vec<usize> = want.iter().map(|r| r.expert).collect();
            assert_eq!(ids, want_ids, "seed {seed}: the log keeps the experts");
        }
        let (lb, rb, log, mb) = (gpu.zeros(16), gpu.zeros(9), gpu.zeros(40), gpu.zeros(16));
        let args = MoeRouteArgs {
            n_expert: 16,
            k: 4,
            norm_weights: true,
            log_offset: 0,
            slots: Some((&mb, 0)),
        };
        let short = gpu
            .kernels
            .record(|r| r.moe_route(&lb, None, &rb, &log, args));
        assert!(
            short.is_err(),
            "a route buffer without room for the second list is refused"
        );
    }
}

#[test]
fn moe_router_in_one_dispatch_matches_the_product_then_the_routing() {
    // The router's product (RMSNorm fused) and the routing done by the last workgroup, against
    // the two dispatches they replace: the same logits within rounding, the same experts and
    // weights, the same log; the counter left at zero, so a second dispatch routes again.
    use spillway_daemon::gpu::ops::{
        route_floats, route_log_floats, zeroed_counters, Fused, MoeRouteArgs,
    };
    let Some(dev) = device() else { return };
    for gpu in Gpu::both(&dev) {
        for (n_expert, k, n_in, norm_weights) in [(128, 8, 256, true), (8, 2, 64, false)] {
            let what = format!("{n_expert} experts top {k}, {n_in} wide");
            let router: Vec<f32> = noise(n_expert * n_in, 71).iter().map(|v| v * 0.5).collect();
            let bytes: Vec<u8> = router.iter().flat_map(|v| v.to_le_bytes()).collect();
            let m = gpu.matrix(GgmlType::F32, n_in, n_expert, &bytes);
            let x = gpu.f32s(&noise(n_in, 72));
            let norm_w: Vec<f32> = noise(n_in, 73).iter().map(|v| 1.0 + v).collect();
            let nw = gpu.f32s(&norm_w);
            let eps = 1e-6;
            let per = route_log_floats(n_expert, k);
            let args = MoeRouteArgs {
                n_expert: n_expert as u32,
                k: k as u32,
                norm_weights,
                log_offset: 0,
                slots: None,
            };
            let (logits, route, log) = (
                gpu.zeros(n_expert),
                gpu.zeros(route_floats(k)),
                gpu.zeros(per),
            );
            gpu.kernels
                .record(|r| {
                    let normed = Fused {
                        norm: Some((&nw, eps)),
                        ..Fused::default()
                    };
                    r.matvec_fused(&m, &x, &logits, normed)?;
                    r.moe_route(&logits, None, &route, &log, args)
                })
                .unwrap();
            let (want_route, want_log) = (route.read_f32(route_floats(k)), log.read_f32(per));
            let done = zeroed_counters(&gpu.alloc, 1).unwrap();
            for run in 0..2 {
                let (logits, route, log) = (
                    gpu.zeros(n_expert),
                    gpu.zeros(route_floats(k)),
                    gpu.zeros(per),
                );
                gpu.kernels
                    .record(|r| {
                        r.moe_router(&m, (&x, (&nw, eps)), (&logits, &done), &route, &log, args)
                    })
                    .unwrap();
                let got = route.read_f32(route_floats(k));
                let what = format!("{what}, run {run}");
                assert_eq!(
                    got[..k].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want_route[..k]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    "{what}: experts"
                );
                for r in 0..k {
                    let (g, w) = (got[k + r], want_route[k + r]);
                    assert!(
                        (g - w).abs() <= 1e-5 * w.abs() + 1e-7,
                        "{what}: weight {r}: {g} vs {w}"
                    );
                }
                let got_log = log.read_f32(per);
                for (e, (g, w)) in got_log[..n_expert].iter().zip(&want_log).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * w.abs() + 1e-5,
                        "{what}: logit {e}: {g} vs {w}"
                    );
                }
                assert_eq!(
                    &got_log[n_expert..n_expert + 2 * k],
                    &got[..2 * k],
                    "{what}: the log holds the routing"
                );
                assert_eq!(
                    done.read_f32(1)[0].to_bits(),
                    0,
                    "{what}: the counter is left at zero"
                );
            }
            // Only F32 routers: the kernel reads the rows as floats.
            let q8 = gpu.matrix(
                GgmlType::Q8_0,
                64,
                8,
                &weight_rows(GgmlType::Q8_0, 64, 8, 3),
            );
            let small = MoeRouteArgs {
                n_expert: 8,
                k: 2,
                ..args
            };
            let refused = gpu.kernels.record(|r| {
                r.moe_router(&q8, (&x, (&nw, eps)), (&logits, &done), &route, &log, small)
            });
            assert!(refused.is_err(), "{what}: a Q8_0 router is refused");
        }
    }
}

// ---- expert-indexed products ----

#[test]
fn matvec_id_matches_matvec_rows_of_the_same_expert() {
    let Some(dev) = device() else { return };
    for gpu in Gpu::both(&dev) {
        for ty in [GgmlType::F32].into_iter().chain(TYPES) {
            let (n_in, rows, experts, k) = (256, 6, 9, 3);
            let data = weight_rows(ty, n_in, rows * experts, 21);
            let m = gpu.matrix(ty, n_in, rows * experts, &data);
            // Routing buffer: a float before the ids, which start at rank 1.
            let chosen = [7usize, 0, 8];
            let mut ids = vec![0.0f32];
            ids.extend(chosen.iter().map(|&e| f32::from_bits(e as u32)));
            let idb = gpu.f32s(&ids);
            // Each rank its own input, `n_in` apart; results `rows + 2` apart.
            let xs = noise(n_in * k, 22);
            let xb = gpu.f32s(&xs);
            let stride = rows + 2;
            let y = gpu.zeros(stride * k);
            gpu.kernels
                .record(|r| {
                    r.matvec_id(
                        &m,
                        rows,
                        (&idb, 1),
                        k as u32,
                        (&xb, n_in as u32),
                        (&y, stride as u32),
                    )
                })
                .unwrap();
            let got = y.read_f32(stride * k);
            for (z, &e) in chosen.iter().enumerate() {
                let x = gpu.f32s(&xs[z * n_in..(z + 1) * n_in]);
                let want = gpu.zeros(rows);
                gpu.kernels
                    .record(|r| r.matvec_rows(&m, e * rows, rows, &x, &want))
                    .unwrap();
                let want = want.read_f32(rows);
                let got = &got[z * stride..z * stride + rows];
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty} rank {z} (expert {e}): {got:?} vs {want:?}"
                );
            }
            let past = gpu
                .kernels
                .record(|r| r.matvec_id(&m, rows * experts + 1, (&idb, 1), 1, (&xb, 0), (&y, 0)));
            assert!(past.is_err(), "{ty}: experts that do not divide the stack");
        }
    }
}

#[test]
fn scale_add_routed_adds_each_term_as_scale_add_does() {
    let Some(dev) = device() else { return };
    let gpu = Gpu::new(&dev);
    let (n, count, stride) = (700, 3, 710);
    let a = noise(n, 31);
    let b = noise(stride * count, 32);
    let route = [9.0, 0.5, 0.25, 0.125, 7.0];
    let (ab, bb, rb) = (gpu.f32s(&a), gpu.f32s(&b), gpu.f32s(&route));
    gpu.kernels
        .record(|r| r.scale_add_routed(&ab, (&bb, stride as u32), (&rb, 1, count as u32), n as u32))
        .unwrap();
    let mut want = a.clone();
    for r in 0..count {
        for (i, w) in want.iter_mut().enumerate() {
            *w += route[1 + r] * b[r * stride + i];
        }
    }
    // Each product and sum rounded once, in the same order: exact.
    assert_eq!(ab.read_f32(n), want);
}
