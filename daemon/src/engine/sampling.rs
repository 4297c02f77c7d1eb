//! Choosing the next token from logits: greedy, or temperature sampling filtered by a
//! repetition penalty, top-k, top-p and min-p, with a seeded generator so runs repeat.

/// Sampling settings; the default is greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// 0 (or less) means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 keeps all.
    pub min_p: f32,
    /// llama.cpp's penalty: positive logits divided, negative multiplied; 1 disables.
    pub repetition_penalty: f32,
    /// How many of the last tokens the penalty looks at.
    pub repetition_window: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_window: 64,
            seed: 0,
        }
    }
}

/// A sampler with its own random state.
#[derive(Debug, Clone)]
pub struct Sampler {
    config: SamplerConfig,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Sampler {
        let rng = SplitMix64(config.seed);
        Sampler { config, rng }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Picks the next token given the logits and the tokens so far (for the penalty).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let c = &self.config;
        let mut logits = logits.to_vec();
        if c.repetition_penalty != 1.0 {
            let start = history.len().saturating_sub(c.repetition_window);
            let mut seen = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / c.repetition_penalty
                    } else {
                        *l * c.repetition_penalty
                    };
                }
            }
        }
        if c.temperature <= 0.0 {
            return argmax(&logits) as u32;
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / c.temperature))
            .collect();
        // Most likely first, ties by token id: a total order, so selecting the top k and
        // sorting them gives the first k of the whole vocabulary sorted, in O(vocabulary)
        // rather than a sort of every logit (about 6 ms a token for 128K on one core).
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.select_nth_unstable_by(c.top_k - 1, order);
            cand.truncate(c.top_k);
        }
        cand.sort_by(order);
        // Probabilities of the remaining candidates.
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let mut keep = probs.len();
        if c.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &p) in probs.iter().enumerate() {
                acc += p;
                if acc >= c.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if c.min_p > 0.0 {
            let floor = c.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|&&p| p >= floor).count().max(1));
        }
        let probs = &probs[..keep];
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.next_f32() * total;
        for (i, &p) in probs.iter().enumerate() {
            if r < p {
                return cand[i].0;
            }
            r -= p;
        }
        cand[keep - 1].0
    }
}

/// Index of the largest value (the first of equals).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// Sebastiano Vigna's SplitMix64: small, seedable and good enough for sampling.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_argmax_and_penalty_can_change_it() {
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&[0.1, 2.0, 1.9], &[]), 1);
        let mut p = Sampler::new(SamplerConfig {
            repetition_penalty: 1.5,
            ..SamplerConfig::default()
        });
        assert_eq!(p.sample(&[0.1, 2.0, 1.9], &[1]), 2);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_repeat() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7) % 13) as f32 * 0.3).collect();
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 1,
            ..SamplerConfig::default()
        });
        assert_eq!(s.sample(&logits, &[]) as usize, argmax(&logits));
        let cfg = SamplerConfig {
            temperature: 0.8,
            top_p: 0.9,
            min_p: 0.05,
            seed: 42,
            ..SamplerConfig::default()
        };
        let run = |cfg: &SamplerConfig| {
            let mut s = Sampler::new(cfg.clone());
            (0..20).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(&cfg), run(&cfg));
        // min-p keeps only tokens within 5% of the best: all sampled tokens have high logits.
        let best = logits[argmax(&logits)];
        assert!(run(&cfg).iter().all(|&t| logits[t as usize] > best - 3.0));
    }

    /// The tokens of the whole vocabulary sorted, then cut to `top_k`: those that selecting
    /// the top k must keep.
    fn sorted_then_cut(logits: &[f32], c: &SamplerConfig) -> Vec<u32> {
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / c.temperature))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if c.top_k > 0 {
            cand.truncate(c.top_k);
        }
        cand.iter().map(|&(t, _)| t).collect()
    }

    #[test]
    fn top_k_by_selection_samples_what_a_full_sort_would() {
        // Many ties (values from a small set) so the token-id tie break matters.
        let logits: Vec<f32> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) % 17) as f32 * 0.25)
            .collect();
        for &top_k in &[1usize, 2, 40, 999, 4999, 5000, 6000] {
            let c = SamplerConfig {
                temperature: 0.7,
                top_k,
                top_p: 0.9,
                min_p: 0.01,
                seed: 3,
                ..SamplerConfig::default()
            };
            let kept = sorted_then_cut(&logits, &c);
            // The same draws as a sampler over the sorted, cut candidates.
            let mut s = Sampler::new(c.clone());
            let mut reference = Sampler::new(SamplerConfig {
                top_k: 0,
                ..c.clone()
            });
            let cut: Vec<f32> = (0..logits.len())
                .map(|i| match kept.contains(&(i as u32)) {
                    true => logits[i],
                    false => f32::NEG_INFINITY,
                })
                .collect();
            for _ in 0..50 {
                let t = s.sample(&logits, &[]);
                assert!(
                    kept.contains(&t),
                    "top_k {top_k}: token {t} not among the top"
                );
                assert_eq!(t, reference.sample(&cut, &[]), "top_k {top_k}");
            }
        }
    }
}
