//! Comparing two runs' logits in the Vulkan model tests.

/// Every logit of `got` within `tolerance` times the largest magnitude of `want`.
pub fn assert_logits_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let range = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
    assert!(
        diff <= tolerance * range,
        "{what}: logits differ by {diff} (range {range})"
    );
}
