//! Element-wise and per-row operations of the forward pass, written to follow ggml's CPU
//! implementations (same accumulation types, same order of float operations where it matters).

use crate::model::RopeLayout;

/// `x * (1 / sqrt(mean(x²) + eps)) * w`, with the sum of squares in f64 as ggml does.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * w;
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(w) {
        *v = (*v * scale) * w;
    }
}

/// Cosines and sines of RoPE at one position, for the `n_rot / 2` rotated pairs.
///
/// As ggml's `ggml_rope_cache_init`: the angle starts at the position and is multiplied by
/// `base^(-2 / n_rot)` pair after pair (in f32, so the rounding matches), and each pair's angle
/// is divided by its frequency factor when the model has some (Llama 3.1 scaling).
pub fn rope_cache(
    pos: usize,
    n_rot: usize,
    base: f32,
    freq_scale: f32,
    factors: Option<&[f32]>,
    cos: &mut [f32],
    sin: &mut [f32],
) {
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    let mut theta = pos as f32;
    for i in 0..n_rot / 2 {
        let ff = factors.map_or(1.0, |f| f[i]);
        let t = freq_scale * (theta / ff);
        cos[i] = t.cos();
        sin[i] = t.sin();
        theta *= theta_scale;
    }
}

/// Rotates one head in place with the angles of [`rope_cache`]; dims past `2 * cos.len()` are
/// left alone.
pub fn rope_head(x: &mut [f32], layout: RopeLayout, cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = match layout {
            RopeLayout::Normal => (2 * i, 2 * i + 1),
            RopeLayout::Neox => (i, i + half),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos[i] - x1 * sin[i];
        x[b] = x0 * sin[i] + x1 * cos[i];
    }
}

/// Softmax in place: max subtracted, the sum accumulated in f64 as ggml does.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate[i] = silu(gate[i]) * up[i]`: SwiGLU.
pub fn swiglu_inplace(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Log-softmax in f64, for log-probabilities.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&v| f64::from(v - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    logits
        .iter()
        .map(|&v| (f64::from(v) - lse) as f32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_by_position_times_frequency() {
        let (mut c, mut s) = ([0.0; 2], [0.0; 2]);
        rope_cache(3, 4, 10_000.0, 1.0, None, &mut c, &mut s);
        assert!((c[0] - 3f32.cos()).abs() < 1e-6);
        assert!((s[1] - (3.0f32 / 100.0).sin()).abs() < 1e-6);
        let mut x = [1.0, 0.0, 0.0, 0.0];
        rope_head(&mut x, RopeLayout::Normal, &c, &s);
        assert!((x[1] - 3f32.sin()).abs() < 1e-6);
        let mut y = [1.0, 0.0, 0.0, 0.0];
        rope_head(&mut y, RopeLayout::Neox, &c, &s);
        assert!((y[2] - 3f32.sin()).abs() < 1e-6 && y[1] == 0.0);
    }

    #[test]
    fn norms_and_softmax() {
        let mut out = [0.0; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
        let mut p = [1.0, 2.0, 3.0];
        softmax(&mut p);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6 && p[2] > p[1]);
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        assert!((lp[2].exp() - p[2]).abs() < 1e-6);
    }
}
