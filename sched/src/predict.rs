//! Latency predictors: roofline models of kernels and transfers, fitted to measured timings by
//! least squares, and scored against measurements.
//!
//! A [`Roofline`] predicts `fixed + max(bytes / bandwidth, flops / flop_rate)`. Fitting it is a
//! piecewise-linear least-squares problem: each observation is memory-bound or compute-bound
//! under the current parameters, which makes the model linear in (fixed, 1/bandwidth,
//! 1/flop_rate); we alternate classifying and solving until the classes settle. Residuals are
//! relative (weights 1/t²) so that small kernels count as much as large ones.

use serde::{Deserialize, Serialize};

/// What one operation moves and computes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Work {
    pub bytes: f64,
    pub flops: f64,
}

impl Work {
    /// A matrix of `k`×`n` weights stored in `bytes`, applied to `batch` vectors.
    pub fn matvec(k: u64, n: u64, bytes: u64, batch: u64) -> Work {
        Work {
            bytes: bytes as f64,
            flops: 2.0 * k as f64 * n as f64 * batch as f64,
        }
    }

    /// A copy or read of `bytes`.
    pub fn transfer(bytes: u64) -> Work {
        Work {
            bytes: bytes as f64,
            flops: 0.0,
        }
    }
}

/// Predicted time of an operation: a fixed cost plus the slower of its memory and compute roofs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Roofline {
    /// Seconds paid once per operation (a dispatch, a submit, a copy command, a read request).
    pub fixed_s: f64,
    /// Bytes per second.
    pub bandwidth: f64,
    /// FLOP per second; `None` where compute never binds (copies, reads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flop_rate: Option<f64>,
}

impl Roofline {
    pub fn memory_bound(bandwidth: f64, fixed_s: f64) -> Roofline {
        Roofline {
            fixed_s,
            bandwidth,
            flop_rate: None,
        }
    }

    /// Time without the fixed cost: what one more operation in an already recorded dispatch
    /// costs (an expert among the experts of a layer).
    pub fn marginal(&self, w: Work) -> f64 {
        let mem = w.bytes / self.bandwidth;
        let compute = self.flop_rate.map_or(0.0, |r| w.flops / r);
        mem.max(compute)
    }

    pub fn predict(&self, w: Work) -> f64 {
        self.fixed_s + self.marginal(w)
    }

    /// Least-squares fit to `(work, seconds, weight)` observations, starting from `self`.
    /// Parameters the observations cannot determine keep `self`'s values: a flop rate with no
    /// compute-bound observation, a bandwidth with no memory-bound one. Returns `self` when
    /// there are fewer than three observations.
    pub fn fit(&self, obs: &[(Work, f64, f64)]) -> Roofline {
        let obs: Vec<_> = obs
            .iter()
            .filter(|(w, t, wt)| *t > 0.0 && *wt > 0.0 && w.bytes >= 0.0)
            .collect();
        if obs.len() < 3 {
            return *self;
        }
        let mut cur = *self;
        let mut classes: Vec<bool> = Vec::new();
        for _ in 0..20 {
            // true: memory-bound under the current parameters.
            let now: Vec<bool> = obs
                .iter()
                .map(|(w, _, _)| {
                    w.bytes / cur.bandwidth >= cur.flop_rate.map_or(0.0, |r| w.flops / r)
                })
                .collect();
            if now == classes {
                break;
            }
            classes = now;
            let n_mem = classes.iter().filter(|&&m| m).count();
            let n_cmp = classes.len() - n_mem;
            // Columns: fixed, seconds per byte (memory-bound rows), seconds per flop (others).
            let mut cols = vec![0usize];
            if n_mem > 0 {
                cols.push(1);
            }
            if n_cmp > 0 && cur.flop_rate.is_some() {
                cols.push(2);
            }
            let rows: Vec<([f64; 3], f64, f64)> = obs
                .iter()
                .zip(&classes)
                .map(|((w, t, wt), &mem)| {
                    let x = if mem {
                        [1.0, w.bytes, 0.0]
                    } else {
                        [1.0, 0.0, w.flops]
                    };
                    // Relative residuals: divide the row by t.
                    (x, *t, wt / (t * t))
                })
                .collect();
            let Some(theta) = solve_nonneg(&rows, &cols) else {
                break;
            };
            // A column left out, or solved to zero, keeps the current value.
            cur = Roofline {
                fixed_s: theta[0],
                bandwidth: if cols.contains(&1) && theta[1] > 0.0 {
                    1.0 / theta[1]
                } else {
                    cur.bandwidth
                },
                flop_rate: match cur.flop_rate {
                    Some(_) if cols.contains(&2) && theta[2] > 0.0 => Some(1.0 / theta[2]),
                    r => r,
                },
            };
        }
        cur
    }
}

/// One calibrated product: seconds per product of a `k`-wide, `n`-tall matrix stored in
/// `bytes`, as a decode step runs it (on the GPU, its share of a chain of products).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ShapePoint {
    pub k: u64,
    pub n: u64,
    pub bytes: u64,
    pub seconds: f64,
}

/// What calibration measured at its shapes, for a kernel whose efficiency depends on its
/// shape, which one fixed cost and one bandwidth cannot describe (a GPU product of a few
/// thousand rows keeps fewer loads in flight than one of a hundred thousand; short rows give
/// each workgroup little to stream; a CPU product of a few hundred kilobytes barely wakes the
/// pool's threads).
///
/// `fixed` is the kernel's measured fixed cost (a dispatch, a pool job). Each calibrated shape
/// gives an effective bandwidth: its bytes over its time less `fixed`. The result is the
/// seconds past `fixed` of a `k`-wide, `n`-tall product of `bytes`: its bytes over the
/// effective bandwidth at its shape, from a local linear fit of log bandwidth in (log row
/// length, log rows) weighted by closeness to the shape (moving least squares). At a
/// calibrated shape that is the measurement; between shapes, the trend; past the last shapes
/// the trend is held within the bandwidths measured (from half the least to a quarter above
/// the most). `None` without a usable point.
pub fn shaped_marginal(
    fixed: f64,
    points: &[ShapePoint],
    bytes: u64,
    k: u64,
    n: u64,
) -> Option<f64> {
    let (lk, ln) = ((k.max(1) as f64).ln(), (n.max(1) as f64).ln());
    let mut rows = Vec::new();
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for p in points {
        let busy = p.seconds - fixed;
        if busy.is_nan() || busy <= 0.0 || p.bytes == 0 || p.k == 0 || p.n == 0 {
            continue;
        }
        let bw = (p.bytes as f64 / busy).ln();
        let (dk, dn) = ((p.k as f64).ln() - lk, (p.n as f64).ln() - ln);
        let d2 = dk * dk + dn * dn;
        if d2 < 1e-12 {
            return Some(bytes as f64 / bw.exp());
        }
        lo = lo.min(bw);
        hi = hi.max(bw);
        // A shape one e-fold away weighs a fifth of one half an e-fold away.
        rows.push(([1.0, dk, dn], bw, 1.0 / (d2 + 0.25)));
    }
    if rows.is_empty() {
        return None;
    }
    let weights: f64 = rows.iter().map(|r| r.2).sum();
    let mean = rows.iter().map(|r| r.2 * r.1).sum::<f64>() / weights;
    // The intercept of the local fit is the log bandwidth at the shape; with too few points,
    // or points on one line, the weighted mean.
    let local = if rows.len() >= 3 {
        solve(&rows, &[0, 1, 2]).map_or(mean, |theta| theta[0])
    } else {
        mean
    };
    let bw = local.clamp(lo - std::f64::consts::LN_2, hi + 1.25f64.ln());
    Some(bytes as f64 / bw.exp())
}

/// Weighted least squares over the columns `cols` of `rows` (`x`, `y`, `weight`), with
/// coefficients that would come out negative dropped to zero and the rest solved again.
fn solve_nonneg(rows: &[([f64; 3], f64, f64)], cols: &[usize]) -> Option<[f64; 3]> {
    let mut active = cols.to_vec();
    while !active.is_empty() {
        let theta = solve(rows, &active)?;
        match active.iter().position(|&c| theta[c] < 0.0) {
            None => return Some(theta),
            Some(i) => {
                active.remove(i);
            }
        }
    }
    Some([0.0; 3])
}

fn solve(rows: &[([f64; 3], f64, f64)], cols: &[usize]) -> Option<[f64; 3]> {
    let n = cols.len();
    // Columns scaled to unit size first: seconds per byte is ~1e-12, the fixed cost ~1e-5.
    let scale: Vec<f64> = cols
        .iter()
        .map(|&c| {
            rows.iter()
                .map(|(x, _, _)| x[c].abs())
                .fold(0.0, f64::max)
                .max(f64::MIN_POSITIVE)
        })
        .collect();
    let mut a = vec![vec![0.0; n + 1]; n];
    for (x, y, w) in rows {
        for i in 0..n {
            let xi = x[cols[i]] / scale[i];
            for j in 0..n {
                a[i][j] += w * xi * x[cols[j]] / scale[j];
            }
            a[i][n] += w * xi * y;
        }
    }
    // Gaussian elimination with partial pivoting.
    for c in 0..n {
        let p = (c..n).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))?;
        // `<=`: a column of zeros (every point at the query's width, say) is singular too.
        if a[p][c].abs() <= 1e-12 * a.iter().map(|r| r[c].abs()).fold(0.0, f64::max) {
            return None;
        }
        a.swap(c, p);
        let pivot = a[c].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / pivot[c];
                for (x, p) in row.iter_mut().zip(&pivot).skip(c) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut theta = [0.0; 3];
    for i in 0..n {
        theta[cols[i]] = a[i][n] / a[i][i] / scale[i];
    }
    Some(theta)
}

/// How well predictions match measurements.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AccuracyReport {
    pub count: usize,
    /// Median of |predicted − measured| / measured.
    pub median_rel_error: f64,
    pub p90_rel_error: f64,
    pub max_rel_error: f64,
}

impl AccuracyReport {
    /// Scores `(predicted, measured)` pairs, for example one per layer of a profiled step.
    /// `None` when no pair has a positive measurement.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (f64, f64)>) -> Option<AccuracyReport> {
        let mut errs: Vec<f64> = pairs
            .into_iter()
            .filter(|&(_, m)| m > 0.0)
            .map(|(p, m)| (p - m).abs() / m)
            .collect();
        if errs.is_empty() {
            return None;
        }
        errs.sort_by(f64::total_cmp);
        let at = |q: f64| errs[((errs.len() - 1) as f64 * q).round() as usize];
        Some(AccuracyReport {
            count: errs.len(),
            median_rel_error: at(0.5),
            p90_rel_error: at(0.9),
            max_rel_error: errs[errs.len() - 1],
        })
    }

    /// The bar the predictors are held to: median relative error of per-layer predictions.
    pub fn within(&self, median: f64) -> bool {
        self.median_rel_error <= median
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// splitmix64: deterministic noise for tests, no dependency.
    pub(crate) struct Rng(u64);

    impl Rng {
        pub(crate) fn new(seed: u64) -> Rng {
            Rng(seed)
        }

        pub(crate) fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        /// Uniform in [0, 1).
        pub(crate) fn unit(&mut self) -> f64 {
            (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
        }

        /// Multiplicative noise: exp(N(0, sigma)), by Box–Muller.
        pub(crate) fn noise(&mut self, sigma: f64) -> f64 {
            let (u1, u2) = (self.unit().max(1e-12), self.unit());
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            (sigma * z).exp()
        }
    }

    const TRUTH: Roofline = Roofline {
        fixed_s: 12e-6,
        bandwidth: 900e9,
        flop_rate: Some(40e12),
    };

    /// Matrix-vector and small-batch products of varied shapes: memory-bound at batch 1,
    /// compute-bound at large batches, so both roofs are seen.
    fn workload(rng: &mut Rng, n: usize) -> Vec<Work> {
        (0..n)
            .map(|_| {
                let k = 1024 << (rng.next_u64() % 4);
                let m = 1024 << (rng.next_u64() % 5);
                let batch = [1, 1, 4, 64, 512][(rng.next_u64() % 5) as usize];
                Work::matvec(k, m, k * m * 9 / 16, batch)
            })
            .collect()
    }

    #[test]
    fn fit_recovers_a_known_roofline_from_noisy_timings() {
        let mut rng = Rng::new(7);
        let train: Vec<_> = workload(&mut rng, 300)
            .into_iter()
            .map(|w| (w, TRUTH.predict(w) * rng.noise(0.08), 1.0))
            .collect();
        // A prior off by 2-3x in every parameter.
        let prior = Roofline {
            fixed_s: 40e-6,
            bandwidth: 300e9,
            flop_rate: Some(100e12),
        };
        let fit = prior.fit(&train);
        assert!(
            (fit.bandwidth / TRUTH.bandwidth - 1.0).abs() < 0.05,
            "{fit:?}"
        );
        let rate = fit.flop_rate.unwrap();
        assert!((rate / 40e12 - 1.0).abs() < 0.05, "{fit:?}");
        assert!((fit.fixed_s / TRUTH.fixed_s - 1.0).abs() < 0.2, "{fit:?}");

        // Held-out shapes, each measured with fresh noise: the median error is the noise's.
        let test: Vec<_> = workload(&mut rng, 200)
            .into_iter()
            .map(|w| (fit.predict(w), TRUTH.predict(w) * rng.noise(0.08)))
            .collect();
        let report = AccuracyReport::from_pairs(test).unwrap();
        assert!(report.within(0.15), "{report:?}");
        // And the prior alone misses the bar, so the check can fail.
        let before: Vec<_> = workload(&mut rng, 200)
            .into_iter()
            .map(|w| (prior.predict(w), TRUTH.predict(w)))
            .collect();
        assert!(!AccuracyReport::from_pairs(before).unwrap().within(0.15));
    }

    #[test]
    fn fit_keeps_what_the_data_cannot_tell() {
        // Batch-1 products only: never compute-bound, so the flop rate stays the prior's.
        let mut rng = Rng::new(3);
        let obs: Vec<_> = (0..50)
            .map(|i| {
                let w = Work::matvec(4096, 1024 * (1 + i % 8), 4096 * 1024 * (1 + i % 8), 1);
                (w, TRUTH.predict(w) * rng.noise(0.02), 1.0)
            })
            .collect();
        let prior = Roofline {
            fixed_s: 1e-6,
            bandwidth: 1e12,
            flop_rate: Some(7e12),
        };
        let fit = prior.fit(&obs);
        assert_eq!(fit.flop_rate, Some(7e12));
        assert!(
            (fit.bandwidth / TRUTH.bandwidth - 1.0).abs() < 0.03,
            "{fit:?}"
        );
        // Too few observations: unchanged.
        assert_eq!(prior.fit(&obs[..2]), prior);
    }

    /// A kernel whose bandwidth grows with its rows: `peak · n / (n + 8192)`, plus 4 µs.
    fn rows_bound(k: u64, n: u64) -> f64 {
        let bytes = (k * n * 9 / 16) as f64;
        4e-6 + bytes / (2e12 * n as f64 / (n as f64 + 8192.0))
    }

    #[test]
    fn shaped_predictions_follow_a_kernel_that_one_roofline_cannot() {
        let shapes = [
            (2048, 512),
            (512, 2048),
            (2048, 2048),
            (4096, 4096),
            (4096, 14336),
            (14336, 4096),
            (2048, 65536),
        ];
        let points: Vec<ShapePoint> = shapes
            .iter()
            .map(|&(k, n)| ShapePoint {
                k,
                n,
                bytes: k * n * 9 / 16,
                seconds: rows_bound(k, n),
            })
            .collect();
        let obs: Vec<_> = points
            .iter()
            .map(|p| (Work::matvec(p.k, p.n, p.bytes, 1), p.seconds, 1.0))
            .collect();
        let fit = Roofline::memory_bound(1e12, 0.0).fit(&obs);
        // The fixed cost is measured on its own (a dispatch): the truth's 4 µs.
        let shaped =
            |k: u64, n: u64| 4e-6 + shaped_marginal(4e-6, &points, k * n * 9 / 16, k, n).unwrap();
        // At a calibrated shape: its measurement.
        assert!((shaped(4096, 4096) / rows_bound(4096, 4096) - 1.0).abs() < 1e-9);
        // Shapes between and beyond the calibrated ones: a decode layer's and a head's.
        let held_out = [
            (2048, 8192),
            (8192, 2048),
            (2048, 4096),
            (4096, 2048),
            (2048, 768),
            (768, 2048),
            (2048, 128256),
        ];
        let score = |use_shape: bool| {
            let pairs = held_out.iter().map(|&(k, n)| {
                let w = Work::matvec(k, n, k * n * 9 / 16, 1);
                let p = if use_shape {
                    shaped(k, n)
                } else {
                    fit.predict(w)
                };
                (p, rows_bound(k, n))
            });
            AccuracyReport::from_pairs(pairs).unwrap()
        };
        let (with_shape, plain) = (score(true), score(false));
        assert!(with_shape.within(0.10), "{with_shape:?}");
        assert!(
            with_shape.median_rel_error < plain.median_rel_error,
            "{with_shape:?} {plain:?}"
        );
        // No points: nothing to say.
        assert_eq!(shaped_marginal(4e-6, &[], 1 << 20, 4096, 4096), None);
    }

    #[test]
    fn points_of_one_width_predict_that_width() {
        // Three products 2048 wide, asked about another 2048-wide one: the width column of
        // the local fit is all zeros, which once made the fit NaN.
        let point = |n: u64, gbps: f64| {
            let bytes = 2048 * n * 9 / 16;
            ShapePoint {
                k: 2048,
                n,
                bytes,
                seconds: bytes as f64 / (gbps * 1e9),
            }
        };
        let points = [point(512, 1000.0), point(2048, 1500.0), point(8192, 2000.0)];
        let s = shaped_marginal(0.0, &points, 2048 * 768 * 9 / 16, 2048, 768).unwrap();
        let gbps = (2048 * 768 * 9 / 16) as f64 / s / 1e9;
        assert!((1000.0..=2000.0).contains(&gbps), "{gbps} GB/s");
    }

    #[test]
    fn accuracy_report_takes_median_and_tail() {
        let r =
            AccuracyReport::from_pairs([(1.1, 1.0), (2.0, 2.0), (0.5, 1.0), (3.0, 0.0)]).unwrap();
        assert_eq!(r.count, 3);
        assert!((r.median_rel_error - 0.1).abs() < 1e-12);
        assert!((r.max_rel_error - 0.5).abs() < 1e-12);
        assert!(AccuracyReport::from_pairs([]).is_none());
    }
}
