//! Two variants of a measurement taken in turns (A B, B A, A B, ...), so that drift in a shared
//! machine's speed hits both alike, and their medians.

/// Runs `run(false)` and `run(true)` `runs` times each, alternating which goes first; returns
/// each variant's results sorted ascending (`false` first).
pub fn interleaved(runs: usize, mut run: impl FnMut(bool) -> f64) -> (Vec<f64>, Vec<f64>) {
    let (mut a, mut b) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    for r in 0..runs {
        if r % 2 == 0 {
            a.push(run(false));
            b.push(run(true));
        } else {
            b.push(run(true));
            a.push(run(false));
        }
    }
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    (a, b)
}

/// The median of sorted values (the upper one of an even count).
pub fn median(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_alternate_and_results_come_sorted() {
        let mut order = Vec::new();
        let (a, b) = interleaved(3, |v| {
            order.push(v);
            order.len() as f64
        });
        assert_eq!(order, [false, true, true, false, false, true]);
        assert_eq!((a, b), (vec![1.0, 4.0, 5.0], vec![2.0, 3.0, 6.0]));
        assert_eq!(median(&[1.0, 4.0, 5.0]), 4.0);
    }
}
