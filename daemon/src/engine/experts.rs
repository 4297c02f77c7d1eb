//! Routed experts of a MoE layer on the CPU: each chosen expert runs once over the tokens that
//! chose it, and all experts of the layer share the thread pool's jobs instead of three jobs
//! per expert. Where every expert has few tokens (decode), one job takes every gate, up and
//! down product ([`gated_ffn_group`](crate::cpu::gated_ffn_group)); otherwise two do, every
//! gate and up product together, then every down product
//! ([`matmul_group`](crate::cpu::matmul_group)), through the batched kernels.
//!
//! Used by the CPU engine's forward pass and by the GPU model for the experts that are not in
//! VRAM, so both compute a CPU expert with the same arithmetic.

use std::collections::BTreeMap;

use crate::cpu::ffn_group::{self, gated_ffn_group, GatedFfn};
use crate::cpu::{activations, matmul_group, ActFormat, Activation, Product, ThreadPool};
use crate::model::{MatRef, Model, MoeWeights};

use super::ops::swiglu_inplace;

/// The unweighted outputs of the routed experts for the token rows of `xn` (`n_embd` wide),
/// where slot `s` (token `s / k`) chose expert `chosen[s]`: row `s` of the result is
/// `down(silu(gate · x) * (up · x))` of that expert for that token.
///
/// Tokens are converted for the experts' weights once (not once per expert), as the batched
/// forward pass always did; `up` shares the conversion when its type takes the same format.
///
/// # Panics
/// If `chosen.len()` is not `k` slots per token of `xn`, or an expert index is out of range.
pub(crate) fn routed_experts(
    model: &Model,
    pool: &ThreadPool,
    moe: &MoeWeights,
    xn: &[f32],
    chosen: &[usize],
    k: usize,
) -> Vec<f32> {
    let mats = |ex: usize| [&moe.gate, &moe.up, &moe.down].map(|m| model.expert(m, ex));
    routed_experts_with(pool, &mats, xn, chosen, k)
}

/// [`routed_experts`] with each expert's gate, up and down from `mats` (the memory map, or a
/// copy read into RAM).
///
/// # Panics
/// As [`routed_experts`].
pub(crate) fn routed_experts_with<'w>(
    pool: &ThreadPool,
    mats: &dyn Fn(usize) -> [MatRef<'w>; 3],
    xn: &[f32],
    chosen: &[usize],
    k: usize,
) -> Vec<f32> {
    let Some(&first) = chosen.first() else {
        return Vec::new();
    };
    let [gate0, up0, _] = mats(first);
    let e = gate0.n_in;
    assert_eq!(chosen.len() * e, xn.len() * k, "k chosen experts per token");

    // The experts in use, in index order, each with the slots that chose it.
    let mut slots_of: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (s, &ex) in chosen.iter().enumerate() {
        slots_of.entry(ex).or_default().push(s);
    }
    let acts = activations(gate0.ty, xn, e);
    let up_acts = (ActFormat::for_weights(up0.ty) != ActFormat::for_weights(gate0.ty))
        .then(|| activations(up0.ty, xn, e));
    let gate_in: Vec<Vec<Activation<'_>>> = slots_of.values().map(|s| pick(&acts, s, k)).collect();
    let up_in: Option<Vec<Vec<Activation<'_>>>> = up_acts
        .as_ref()
        .map(|all| slots_of.values().map(|s| pick(all, s, k)).collect());
    let mut y: Vec<Vec<f32>> = slots_of.values().map(|s| vec![0.0; s.len() * e]).collect();

    if slots_of.values().all(|s| ffn_group::dotted(s.len())) {
        // Few tokens an expert (decode): gate, up and down of every expert in one job.
        let mut ffns: Vec<GatedFfn<'_>> = slots_of
            .keys()
            .zip(y.iter_mut())
            .zip(&gate_in)
            .enumerate()
            .map(|(i, ((&ex, out), gate_in))| {
                let [gate, up, down] = mats(ex);
                GatedFfn {
                    gate,
                    up,
                    down,
                    gate_acts: gate_in,
                    up_acts: up_in.as_ref().map_or(gate_in, |up| &up[i]),
                    out,
                    label: Some(ex as u32),
                }
            })
            .collect();
        gated_ffn_group(pool, &mut ffns, &swiglu_inplace);
    } else {
        batched_experts(pool, mats, &slots_of, (&gate_in, up_in.as_deref()), &mut y);
    }

    let mut out = vec![0.0f32; chosen.len() * e];
    for (slots, y) in slots_of.values().zip(&y) {
        for (&s, row) in slots.iter().zip(y.chunks_exact(e)) {
            out[s * e..(s + 1) * e].copy_from_slice(row);
        }
    }
    out
}

/// The experts of [`routed_experts_with`] in two jobs: every gate and up product, then every
/// down product, each through the products' batched kernels where an expert has enough tokens.
fn batched_experts<'w>(
    pool: &ThreadPool,
    mats: &dyn Fn(usize) -> [MatRef<'w>; 3],
    slots_of: &BTreeMap<usize, Vec<usize>>,
    (gate_in, up_in): (&[Vec<Activation<'_>>], Option<&[Vec<Activation<'_>>]>),
    y: &mut [Vec<f32>],
) {
    let [gate0, _, down0] = mats(*slots_of.keys().next().expect("an expert"));
    let ff = gate0.n_out;

    // Gate and up of every expert in one job.
    let mut g: Vec<Vec<f32>> = slots_of.values().map(|s| vec![0.0; s.len() * ff]).collect();
    let mut u: Vec<Vec<f32>> = g.clone();
    {
        let mut products = Vec::with_capacity(2 * g.len());
        for (i, ((&ex, (g, u)), gate_in)) in slots_of
            .keys()
            .zip(g.iter_mut().zip(u.iter_mut()))
            .zip(gate_in)
            .enumerate()
        {
            let [gate, up, _] = mats(ex);
            products.push(Product {
                m: gate,
                acts: gate_in,
                out: g,
                label: Some(ex as u32),
            });
            products.push(Product {
                m: up,
                acts: up_in.map_or(gate_in, |up| &up[i]),
                out: u,
                label: Some(ex as u32),
            });
        }
        matmul_group(pool, &mut products);
    }

    // Down of every expert in one job.
    for (g, u) in g.iter_mut().zip(&u) {
        swiglu_inplace(g, u);
    }
    let down_in: Vec<Vec<Activation<'_>>> =
        g.iter().map(|g| activations(down0.ty, g, ff)).collect();
    {
        let mut products: Vec<Product<'_>> = slots_of
            .keys()
            .zip(y.iter_mut())
            .zip(&down_in)
            .map(|((&ex, out), acts)| Product {
                m: mats(ex)[2],
                acts,
                out,
                label: Some(ex as u32),
            })
            .collect();
        matmul_group(pool, &mut products);
    }
}

/// The converted tokens of `slots` (slot `s` is token `s / k`).
fn pick<'a>(all: &[Activation<'a>], slots: &[usize], k: usize) -> Vec<Activation<'a>> {
    slots.iter().map(|&s| all[s / k].clone()).collect()
}
