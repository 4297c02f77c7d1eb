//! Decode attention with its RoPE in the same dispatch (`Recorder::attention_rope`) against RoPE,
//! the KV-cache append and attention as three ops (`Recorder::rope`, `rope_store`, `attention`;
//! those are checked against the CPU in `vulkan_ops.rs`): both RoPE layouts, with and without a
//! QK-norm, GQA, the new position inside a run, first in a run, and past the cache, its grid fixed
//! to the capacity's runs or read when it runs (only the runs up to the position). And a prompt
//! chunk's flash attention (`Recorder::attention_prefill`) against the decode kernel over the
//! chunk's tokens (`attention_n`, checked against token-by-token decode in `vulkan_prefill.rs`):
//! head sizes, chunks from position 0 and later, tiles cut short, positions past the cache. On whatever
//! Vulkan device the machine has (lavapipe in CI); without one these tests skip, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

use std::sync::Arc;

#[path = "common/noise.rs"]
mod noise;
use noise::noise;

use spillway_daemon::gpu::ops::{
    attention_counters, attention_scratch_floats, rope_table, AttentionArgs, RopeArgs, StepWord,
};
use spillway_daemon::gpu::ops_attention::{attention_grid, flash_attention_fits, Unroped};
use spillway_daemon::gpu::{Allocator, Buffer, Kernels, MemoryUse};
use spillway_daemon::model::RopeLayout;

fn host(alloc: &Arc<Allocator>, values: &[f32]) -> Buffer {
    let mut b = Buffer::new_in(alloc, values.len() as u64 * 4, MemoryUse::Staging).unwrap();
    b.write_f32(values);
    b
}

/// The cache's halves, two a float's bits.
fn halves(b: &Buffer, n: usize) -> Vec<u16> {
    b.read_f32(n / 2)
        .iter()
        .flat_map(|v| {
            let w = v.to_bits();
            [w as u16, (w >> 16) as u16]
        })
        .collect()
}

struct Case {
    layout: RopeLayout,
    qk_norm: bool,
    capacity: usize,
    /// The new token's position.
    pos: usize,
}

fn check(kernels: &Arc<Kernels>, alloc: &Arc<Allocator>, c: &Case) {
    let (n_heads, n_kv_heads, hd, n_rot) = (8usize, 2usize, 64usize, 48usize);
    let kvw = n_kv_heads * hd;
    let what = format!(
        "{:?}, QK-norm {}, position {} of {}, subgroups {}",
        c.layout,
        c.qk_norm,
        c.pos,
        c.capacity,
        kernels.uses_subgroups()
    );
    // Two identical caches holding earlier positions (random halves of small floats).
    let earlier: Vec<f32> = noise(c.capacity * kvw, 1)
        .chunks_exact(2)
        .map(|p| {
            let h = |v: f32| half::f16::from_f32(v).to_bits() as u32;
            f32::from_bits(h(p[0]) | (h(p[1]) << 16))
        })
        .collect();
    let caches = || (host(alloc, &earlier), host(alloc, &earlier));
    let (k3, v3) = caches();
    let table = host(
        alloc,
        &rope_table(c.capacity + 4, n_rot, 10_000.0, 1.0, None),
    );
    let norms = (
        host(
            alloc,
            &noise(hd, 7).iter().map(|v| 1.0 + v).collect::<Vec<_>>(),
        ),
        host(
            alloc,
            &noise(hd, 8).iter().map(|v| 1.0 + v).collect::<Vec<_>>(),
        ),
    );
    let (q, k, v) = (noise(n_heads * hd, 3), noise(kvw, 4), noise(kvw, 5));
    let rope = |n: usize| RopeArgs {
        layout: c.layout,
        n_heads: n as u32,
        head_dim: hd as u32,
        n_rot: n_rot as u32,
        eps: 1e-6,
    };
    let args = AttentionArgs {
        n_heads: n_heads as u32,
        n_kv_heads: n_kv_heads as u32,
        head_dim: hd as u32,
        capacity: c.capacity as u32,
    };
    // The position, then the sequence's first cache row, then the grid of the position's runs.
    let mut words = vec![c.pos as u32, 0];
    words.extend(attention_grid(args, c.pos as u32));
    let words: Vec<f32> = words.into_iter().map(f32::from_bits).collect();
    let step = host(alloc, &words);
    let pos = || StepWord {
        buffer: &step,
        index: 0,
    };
    let scratch = || {
        let s = host(
            alloc,
            &vec![0.0; attention_scratch_floats(n_heads, hd, c.capacity)],
        );
        (s, attention_counters(alloc, n_heads, 1).unwrap())
    };
    let norm = c.qk_norm.then_some(&norms);

    // Three ops: RoPE of Q in place, RoPE of K into the cache with V, attention.
    let (qb, kb, vb) = (host(alloc, &q), host(alloc, &k), host(alloc, &v));
    let (s3, d3) = scratch();
    let out3 = host(alloc, &vec![0.0; n_heads * hd]);
    kernels
        .record(|r| {
            r.rope(&qb, norm.map(|n| &n.0), &table, rope(n_heads), pos())?;
            r.rope_store(
                (&kb, &vb),
                norm.map(|n| &n.1),
                &table,
                rope(n_kv_heads),
                pos(),
                (&k3, &v3),
            )?;
            r.attention(&qb, (&k3, &v3), (&s3, &d3), &out3, args, pos())
        })
        .unwrap();

    // One dispatch, from the unroped values, its grid fixed or read from the step words.
    for indirect in [false, true] {
        let what = format!("{what}, grid read when it runs: {indirect}");
        let (k1, v1) = caches();
        let (qb, kb, vb) = (host(alloc, &q), host(alloc, &k), host(alloc, &v));
        let (s1, d1) = scratch();
        let out1 = host(alloc, &vec![0.0; n_heads * hd]);
        let new = Unroped {
            q: &qb,
            k: &kb,
            v: &vb,
            qk_norm: norm.map(|n| (&n.0, &n.1)),
        };
        let grid = indirect.then_some(StepWord {
            buffer: &step,
            index: 2,
        });
        kernels
            .record(|r| {
                r.attention_rope(
                    new,
                    (&table, rope(n_heads)),
                    (&k1, &v1),
                    (&s1, &d1),
                    &out1,
                    args,
                    (pos(), grid),
                )
            })
            .unwrap();
        assert_eq!(qb.read_f32(q.len()), q, "{what}: Q is left as it was");

        let (got, want) = (out1.read_f32(n_heads * hd), out3.read_f32(n_heads * hd));
        let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // The QK-norm's sum in another order can move a value by one f16 step.
            assert!((g - w).abs() <= 2e-3 * scale, "{what}: out[{i}] {g} vs {w}");
        }
        for (name, one, three) in [("K", &k1, &k3), ("V", &v1, &v3)] {
            let (a, b) = (
                halves(one, c.capacity * kvw),
                halves(three, c.capacity * kvw),
            );
            for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
                let row = i / kvw;
                if row == c.pos {
                    // The same value but for the QK-norm's rounding: at most one f16 step apart.
                    assert!(
                        x.abs_diff(y) <= 1,
                        "{what}: {name} cache [{i}] {x:#x} vs {y:#x}"
                    );
                } else {
                    assert_eq!(x, y, "{what}: {name} cache row {row} changed");
                }
            }
        }
        let counts = d1.read_f32(n_heads);
        assert!(
            counts.iter().all(|c| c.to_bits() == 0),
            "{what}: {counts:?}"
        );
    }
    let counts = d3.read_f32(n_heads);
    assert!(
        counts.iter().all(|c| c.to_bits() == 0),
        "{what}: {counts:?}"
    );
}

#[test]
fn attention_with_rope_in_its_dispatch_equals_rope_then_attention() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let alloc = Allocator::new(&dev, None);
    let mut variants = vec![Kernels::with_subgroups(&dev, false)];
    if dev.subgroup_arithmetic() {
        variants.push(Kernels::with_subgroups(&dev, true));
    }
    for kernels in &variants {
        for layout in [RopeLayout::Normal, RopeLayout::Neox] {
            for qk_norm in [false, true] {
                // Inside the first run; first of the third run; last of a partial run; past the
                // cache, where nothing is stored and every cached position attends.
                // And early positions of a long cache, whose runs past them are not launched
                // with the grid read when it runs.
                let cases = [
                    (64, 50),
                    (300, 256),
                    (300, 290),
                    (64, 64),
                    (300, 100),
                    (1000, 130),
                ];
                for (capacity, pos) in cases {
                    let case = Case {
                        layout,
                        qk_norm,
                        capacity,
                        pos,
                    };
                    check(kernels, &alloc, &case);
                }
            }
        }
    }
}

#[test]
fn flash_attention_of_a_chunk_equals_the_decode_kernel_over_its_tokens() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let alloc = Allocator::new(&dev, None);
    let kernels = Kernels::new(&dev);
    // (head size, query heads, KV heads, capacity, first position, tokens)
    for (hd, n_heads, n_kv_heads, capacity, pos0, n_tok) in [
        (64, 8, 2, 300, 0, 70),
        (128, 4, 1, 300, 100, 33),
        (32, 4, 4, 96, 5, 16),
        (64, 8, 2, 300, 250, 64), // the last 14 tokens are past the cache
    ] {
        let what = format!("head {hd}, {n_heads}/{n_kv_heads} heads, {n_tok} tokens from {pos0}");
        let args = AttentionArgs {
            n_heads,
            n_kv_heads,
            head_dim: hd,
            capacity,
        };
        assert!(flash_attention_fits(args), "{what}");
        let kvw = (n_kv_heads * hd) as usize;
        let cache = |seed| {
            let words: Vec<f32> = noise(capacity as usize * kvw, seed)
                .chunks_exact(2)
                .map(|p| {
                    let h = |v: f32| half::f16::from_f32(v * 2.0).to_bits() as u32;
                    f32::from_bits(h(p[0]) | (h(p[1]) << 16))
                })
                .collect();
            host(&alloc, &words)
        };
        let (kc, vc) = (cache(11), cache(12));
        let width = (n_heads * hd) as usize * n_tok as usize;
        let q = host(&alloc, &noise(width, 13));
        // Each token's position and its sequence's first cache row.
        let words: Vec<f32> = (0..n_tok)
            .flat_map(|t| [f32::from_bits(pos0 + t), 0.0])
            .collect();
        let step = host(&alloc, &words);
        let pos = || StepWord {
            buffer: &step,
            index: 0,
        };
        let end = pos0 + n_tok;
        let scratch = host(
            &alloc,
            &vec![
                0.0;
                n_tok as usize
                    * attention_scratch_floats(
                        n_heads as usize,
                        hd as usize,
                        end.min(capacity) as usize
                    )
            ],
        );
        let done = attention_counters(&alloc, n_heads as usize, n_tok as usize).unwrap();
        let (want, got) = (
            host(&alloc, &vec![0.0; width]),
            host(&alloc, &vec![f32::NAN; width]),
        );
        kernels
            .record(|r| {
                r.attention_n(
                    &q,
                    (&kc, &vc),
                    (&scratch, &done),
                    &want,
                    args,
                    pos(),
                    (n_tok, end),
                )
            })
            .unwrap();
        kernels
            .record(|r| r.attention_prefill(&q, (&kc, &vc), &got, args, pos(), n_tok))
            .unwrap();
        let (want, got) = (want.read_f32(width), got.read_f32(width));
        let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-4 * scale, "{what}: out[{i}] {g} vs {w}");
        }
    }
}

/// One cache holding several sequences one after another (a batched decode step's): the decode
/// kernel over one token of each, each at its own position and first row, gives each the
/// output it gets alone over a cache of its own rows; and a prompt chunk of a later sequence
/// takes the flash-attention kernel from its first row as the decode kernel does.
#[test]
fn attention_over_a_cache_of_several_sequences_takes_each_tokens_own_rows() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let alloc = Allocator::new(&dev, None);
    let kernels = Kernels::new(&dev);
    let (hd, n_heads, n_kv_heads, capacity) = (64u32, 8u32, 2u32, 300u32);
    let args = AttentionArgs {
        n_heads,
        n_kv_heads,
        head_dim: hd,
        capacity,
    };
    let kvw = (n_kv_heads * hd) as usize;
    let n_seq = 3usize;
    // Halves of noise, two a float: `rows` cache rows.
    let halves_of = |rows: usize, seed| -> Vec<f32> {
        noise(rows * kvw, seed)
            .chunks_exact(2)
            .map(|p| {
                let h = |v: f32| half::f16::from_f32(v * 2.0).to_bits() as u32;
                f32::from_bits(h(p[0]) | (h(p[1]) << 16))
            })
            .collect()
    };
    let rows = n_seq * capacity as usize;
    let (k_all, v_all) = (halves_of(rows, 21), halves_of(rows, 22));
    let (kc, vc) = (host(&alloc, &k_all), host(&alloc, &v_all));
    let width = (n_heads * hd) as usize;
    let words = |pairs: &[(u32, u32)]| -> Buffer {
        let w: Vec<f32> = pairs
            .iter()
            .flat_map(|&(pos, row)| [f32::from_bits(pos), f32::from_bits(row)])
            .collect();
        host(&alloc, &w)
    };

    // (sequence, position): out of order, in different runs of 128 positions.
    let tokens = [(2usize, 250u32), (0, 10), (1, 130)];
    let n_tok = tokens.len() as u32;
    let q = noise(width * tokens.len(), 23);
    let qb = host(&alloc, &q);
    let step = words(
        &tokens
            .iter()
            .map(|&(s, p)| (p, s as u32 * capacity))
            .collect::<Vec<_>>(),
    );
    let end = tokens.iter().map(|&(_, p)| p + 1).max().unwrap();
    // The decode kernel over `n` tokens whose positions `step` holds: their outputs.
    let attend = |q: &Buffer, (k, v): (&Buffer, &Buffer), step: &Buffer, n: u32| -> Vec<f32> {
        let floats = attention_scratch_floats(n_heads as usize, hd as usize, end as usize);
        let scratch = host(&alloc, &vec![0.0; n as usize * floats]);
        let done = attention_counters(&alloc, n_heads as usize, n as usize).unwrap();
        let out = host(&alloc, &vec![f32::NAN; width * n as usize]);
        let pos = StepWord {
            buffer: step,
            index: 0,
        };
        let scratch = (&scratch, &done);
        kernels
            .record(|r| r.attention_n(q, (k, v), scratch, &out, args, pos, (n, end)))
            .unwrap();
        out.read_f32(width * n as usize)
    };
    let got = attend(&qb, (&kc, &vc), &step, n_tok);
    let floats_a_seq = capacity as usize * kvw / 2;
    for (i, &(seq, p)) in tokens.iter().enumerate() {
        let own = |all: &[f32]| host(&alloc, &all[seq * floats_a_seq..(seq + 1) * floats_a_seq]);
        let (k1, v1) = (own(&k_all), own(&v_all));
        let q1 = host(&alloc, &q[i * width..(i + 1) * width]);
        let alone = attend(&q1, (&k1, &v1), &words(&[(p, 0)]), 1);
        assert_eq!(
            got[i * width..(i + 1) * width],
            alone[..],
            "sequence {seq} at {p}"
        );
    }

    // A prompt chunk of sequence 1 from position 40: flash attention from its first row.
    let (pos0, n_chunk) = (40u32, 20u32);
    let chunk: Vec<(u32, u32)> = (0..n_chunk).map(|t| (pos0 + t, capacity)).collect();
    let step = words(&chunk);
    let qc = host(&alloc, &noise(width * n_chunk as usize, 24));
    let n = width * n_chunk as usize;
    let want = attend(&qc, (&kc, &vc), &step, n_chunk);
    let got = host(&alloc, &vec![f32::NAN; n]);
    let pos = StepWord {
        buffer: &step,
        index: 0,
    };
    kernels
        .record(|r| r.attention_prefill(&qc, (&kc, &vc), &got, args, pos, n_chunk))
        .unwrap();
    let got = got.read_f32(n);
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-4 * scale, "out[{i}] {g} vs {w}");
    }
}
