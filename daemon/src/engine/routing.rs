//! Routing of a MoE layer: which experts a token runs and how much each one's output counts,
//! from the token's router logits. The CPU forward pass and the GPU's (`gpu::moe`) both call
//! this, so they pick the same experts from the same logits; a placement that runs some experts
//! elsewhere starts from its answer.
//!
//! Every supported architecture routes the same way (llama.cpp's `build_moe_ffn` with softmax
//! gating): softmax over all experts, the top k, and for Mixtral and Qwen3-MoE (not Qwen2-MoE)
//! the k weights divided by their sum. Qwen2-MoE's shared expert is scaled by the sigmoid of its
//! own gate logit ([`shared_expert_gate`]).

use super::ops::softmax;
use crate::model::MoeConfig;

/// One selected expert of a token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoutedExpert {
    pub expert: usize,
    /// Its output's weight in the layer's sum.
    pub weight: f32,
}

/// The `cfg.n_expert_used` experts of a token whose router logits are `logits` (one per
/// expert), most probable first, with their weights.
pub fn route(cfg: &MoeConfig, logits: &[f32]) -> Vec<RoutedExpert> {
    let mut probs = logits.to_vec();
    softmax(&mut probs);
    let chosen = top_k(&probs, cfg.n_expert_used);
    let sum: f32 = chosen.iter().map(|&x| probs[x]).sum();
    chosen
        .into_iter()
        .map(|expert| RoutedExpert {
            expert,
            weight: if cfg.norm_weights {
                probs[expert] / sum
            } else {
                probs[expert]
            },
        })
        .collect()
}

/// The weight of Qwen2-MoE's shared expert from its gate's logit.
pub fn shared_expert_gate(logit: f32) -> f32 {
    1.0 / (1.0 + (-logit).exp())
}

/// Indices of the `k` largest values, largest first (ties to the lower index), in the order
/// of `f32::total_cmp`. One pass that keeps the best `k` in order: a prompt chunk routes each
/// of its tokens on the host, and sorting all of a layer's experts for each (128 for
/// Qwen3-30B-A3B) took longer than the chunk's experts on an H200.
pub(crate) fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(x.len());
    let mut top: Vec<usize> = Vec::with_capacity(k + 1);
    if k == 0 {
        return top;
    }
    let above = |a: f32, b: f32| a.total_cmp(&b) == std::cmp::Ordering::Greater;
    for (i, &v) in x.iter().enumerate() {
        if top.len() == k && !above(v, x[top[k - 1]]) {
            continue;
        }
        // After every kept value at least as large: an equal one has the lower index.
        let at = top
            .iter()
            .position(|&j| above(v, x[j]))
            .unwrap_or(top.len());
        top.insert(at, i);
        top.truncate(k);
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(norm_weights: bool) -> MoeConfig {
        MoeConfig {
            n_expert: 4,
            n_expert_used: 2,
            n_ff_expert: 32,
            norm_weights,
        }
    }

    /// The sort that `top_k` replaces, as the reference.
    fn top_k_by_sorting(x: &[f32], k: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..x.len()).collect();
        idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
        idx.truncate(k);
        idx
    }

    #[test]
    fn top_k_is_the_sorted_order_with_ties_to_the_lower_index() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..2000 {
            let n = 1 + (next() % 160) as usize;
            // Few distinct values, so that ties are common; a NaN or an infinity now and then.
            let x: Vec<f32> = (0..n)
                .map(|_| match next() % 50 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => -0.0,
                    r => (r % 9) as f32 - 4.0,
                })
                .collect();
            for k in [0, 1, 2, 8, n.saturating_sub(1), n, n + 3] {
                assert_eq!(
                    top_k(&x, k),
                    top_k_by_sorting(&x, k),
                    "round {round}, k {k}: {x:?}"
                );
            }
        }
    }

    #[test]
    fn picks_the_largest_logits_first_and_renormalises_when_the_arch_does() {
        let logits = [0.5, 2.0, -1.0, 1.0];
        let r = route(&cfg(true), &logits);
        assert_eq!([r[0].expert, r[1].expert], [1, 3]);
        assert!((r[0].weight + r[1].weight - 1.0).abs() < 1e-6);
        let raw = route(&cfg(false), &logits);
        let e = |v: f32| v.exp();
        let p1 = e(2.0) / (e(0.5) + e(2.0) + e(-1.0) + e(1.0));
        assert!((raw[0].weight - p1).abs() < 1e-6, "{raw:?}");
        assert!(raw[0].weight + raw[1].weight < 1.0);
    }

    #[test]
    fn ties_go_to_the_lower_expert() {
        let r = route(&cfg(true), &[1.0, 3.0, 3.0, 3.0]);
        assert_eq!([r[0].expert, r[1].expert], [1, 2]);
    }
}
