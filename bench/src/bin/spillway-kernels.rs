//! `spillway-kernels`: throughput of the CPU matrix kernels on random weights, per weight type.
//!
//! For each type and shape: the matrix-vector product (decode; GB/s of weights read) and the
//! matrix-matrix product over a prompt batch (prefill; multiply-adds per second). Figures are
//! the best of several repetitions, so a shared machine's noise mostly drops out.
//!
//! With `--expert-layers N` it also times what a MoE layer's CPU experts do for one token
//! (`engine::experts`): six experts of the Qwen3-30B-A3B shape (gate and up 768 × 2048, down
//! 2048 × 768), gate and up of all six in one pool job, then the six downs in another, over N
//! layers of distinct weights, so that with enough layers the weights come from DRAM rather
//! than the caches (GB/s of weights read). `--dense-layers N` times the same for N dense FFN
//! layers of the Llama-3-8B shape (gate and up 14336 × 4096, down 4096 × 14336, one "expert"
//! each): the same pool jobs over large matrices, for comparison from DRAM.
//!
//!     cargo run --release -p spillway-bench --bin spillway-kernels -- --threads 1

use std::time::Instant;

use clap::Parser;
use spillway_daemon::cpu::{
    activations, gated_ffn_group, matmul, matmul_group, matvec, GatedFfn, Product, ThreadPool,
};
use spillway_daemon::engine::ops::swiglu_inplace as swiglu;
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::model::MatRef;
use spillway_daemon::quant::quantize_row;

#[derive(Parser)]
#[command(about = "Throughput of the CPU matrix kernels")]
struct Args {
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Tokens in the prefill batch.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Weight types (Q4_0, Q8_0, Q4_K, Q6_K, ...); all with kernels when absent.
    #[arg(long = "type")]
    types: Vec<String>,
    /// Layers of six experts for the MoE-layer measurement (0: skip it).
    #[arg(long, default_value_t = 0)]
    expert_layers: usize,
    /// Dense FFN layers of the Llama-3-8B shape for the same measurement (0: skip it).
    #[arg(long, default_value_t = 0)]
    dense_layers: usize,
}

/// Deterministic noise in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Rows of `ty`: quantized noise where we have a quantizer, otherwise random bytes with the
/// block's f16 scales made small and finite (any bit pattern is a valid K-quant block then).
fn weights(ty: GgmlType, n_in: usize, n_out: usize) -> Vec<u8> {
    let n = n_in * n_out;
    let mut bytes = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
    if quantize_row(ty, &noise(n, 1), &mut bytes).is_ok() {
        return bytes;
    }
    let d_at: &[usize] = match ty {
        GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => panic!("no way to make {ty} weights"),
    };
    for (b, v) in bytes.iter_mut().zip(noise(n, 3)) {
        *b = (v.to_bits() >> 7) as u8;
    }
    let bb = ty.block_bytes() as usize;
    for block in bytes.chunks_exact_mut(bb) {
        for &at in d_at {
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
        }
    }
    bytes
}

fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let types: Vec<GgmlType> = if args.types.is_empty() {
        vec![GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K]
    } else {
        let known = [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ];
        args.types
            .iter()
            .map(|t| {
                known
                    .into_iter()
                    .find(|k| k.to_string().eq_ignore_ascii_case(t))
                    .ok_or_else(|| anyhow::anyhow!("{t}: not one of {known:?}"))
            })
            .collect::<anyhow::Result<_>>()?
    };
    let pool = ThreadPool::new(args.threads);
    println!(
        "threads {}, batch {} tokens, best of {}",
        args.threads, args.tokens, args.reps
    );
    println!("| type | n_in × n_out | matvec GB/s | matmul GMAC/s |");
    println!("| --- | --- | --- | --- |");
    for &ty in &types {
        for (n_in, n_out) in [(2048, 2048), (8192, 2048)] {
            let data = weights(ty, n_in, n_out);
            let m = MatRef {
                ty,
                n_in,
                n_out,
                data: &data,
            };
            let x = noise(n_in * args.tokens, 9);
            let mut out = vec![0.0; n_out * args.tokens];
            let t1 = best(args.reps, || {
                matvec(&pool, m, &x[..n_in], &mut out[..n_out])
            });
            let tn = best(args.reps, || matmul(&pool, m, &x, &mut out));
            println!(
                "| {ty} | {n_in} × {n_out} | {:.1} | {:.1} |",
                data.len() as f64 / t1 / 1e9,
                (n_in * n_out * args.tokens) as f64 / tn / 1e9
            );
        }
    }
    if args.expert_layers > 0 {
        for &ty in &types {
            ffn_layers(&pool, ty, (args.expert_layers, args.reps), (6, 2048, 768));
        }
    }
    if args.dense_layers > 0 {
        for &ty in &types {
            ffn_layers(&pool, ty, (args.dense_layers, args.reps), (1, 4096, 14336));
        }
    }
    Ok(())
}

/// One token's FFN of `experts` experts of width `e` and hidden size `ff` per layer, over
/// `n_layers` layers of distinct weights: in two pool jobs a layer (gate and up of all, then
/// the downs), and in one ([`gated_ffn_group`]).
fn ffn_layers(
    pool: &ThreadPool,
    ty: GgmlType,
    (n_layers, reps): (usize, usize),
    (experts, e, ff): (usize, usize, usize),
) {
    // One matrix's bytes, shared by every copy (the copies are distinct memory all the same).
    let up_proto = weights(ty, e, ff);
    let down_proto = weights(ty, ff, e);
    // Per layer, per expert: gate, up and down.
    type Expert = (Vec<u8>, Vec<u8>, Vec<u8>);
    let layers: Vec<Vec<Expert>> = (0..n_layers)
        .map(|_| {
            (0..experts)
                .map(|_| (up_proto.clone(), up_proto.clone(), down_proto.clone()))
                .collect()
        })
        .collect();
    let bytes: usize = experts * (2 * up_proto.len() + down_proto.len()) * n_layers;
    let x = noise(e, 11);
    let acts = activations(ty, &x, e);
    let mut g = vec![vec![0.0f32; ff]; experts];
    let mut u = vec![vec![0.0f32; ff]; experts];
    let mut y = vec![vec![0.0f32; e]; experts];
    let two_jobs = best(reps, || {
        for layer in &layers {
            let mut products: Vec<Product<'_>> = Vec::with_capacity(2 * experts);
            for ((w, g), u) in layer.iter().zip(g.iter_mut()).zip(u.iter_mut()) {
                products.push(Product {
                    m: mat(ty, e, ff, &w.0),
                    acts: &acts,
                    out: g,
                    label: None,
                });
                products.push(Product {
                    m: mat(ty, e, ff, &w.1),
                    acts: &acts,
                    out: u,
                    label: None,
                });
            }
            matmul_group(pool, &mut products);
            drop(products);
            for (g, u) in g.iter_mut().zip(&u) {
                swiglu(g, u);
            }
            let down_acts: Vec<_> = g.iter().map(|g| activations(ty, g, ff)).collect();
            let mut products: Vec<Product<'_>> = layer
                .iter()
                .zip(y.iter_mut())
                .zip(&down_acts)
                .map(|((w, y), acts)| Product {
                    m: mat(ty, ff, e, &w.2),
                    acts,
                    out: y,
                    label: None,
                })
                .collect();
            matmul_group(pool, &mut products);
        }
    });
    let one_job = best(reps, || {
        for layer in &layers {
            let mut ffns: Vec<GatedFfn<'_>> = layer
                .iter()
                .zip(y.iter_mut())
                .map(|(w, y)| GatedFfn {
                    gate: mat(ty, e, ff, &w.0),
                    up: mat(ty, e, ff, &w.1),
                    down: mat(ty, ff, e, &w.2),
                    gate_acts: &acts,
                    up_acts: &acts,
                    out: y,
                    label: None,
                })
                .collect();
            gated_ffn_group(pool, &mut ffns, &swiglu);
        }
    });
    let gbs = |t: f64| bytes as f64 / t / 1e9;
    println!(
        "{ty}: {n_layers} layers of {experts} × ({e} → {ff} → {e}) ({:.0} MiB): two jobs a layer {:.2} ms, {:.1} GB/s; one job {:.2} ms, {:.1} GB/s",
        bytes as f64 / (1 << 20) as f64,
        two_jobs * 1e3 / n_layers as f64,
        gbs(two_jobs),
        one_job * 1e3 / n_layers as f64,
        gbs(one_job),
    );
}

fn mat(ty: GgmlType, n_in: usize, n_out: usize, data: &[u8]) -> MatRef<'_> {
    MatRef {
        ty,
        n_in,
        n_out,
        data,
    }
}
