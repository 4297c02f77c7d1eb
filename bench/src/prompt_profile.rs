//! Where a prompt chunk's time went: a profiled chunk's rows ([`GpuStepProfile`]) summed by op
//! across layers, beside the host's side (the chunk's wall time and its time inside the
//! submissions).

use spillway_daemon::gpu::forward::GpuStepProfile;

/// One line: each op's GPU milliseconds summed over the layers, in the order the ops first
/// appear, then the chunk's GPU total and the host's wall and submission times.
pub fn summary(p: &GpuStepProfile) -> String {
    let mut ops: Vec<(&str, u64)> = Vec::new();
    for r in &p.rows {
        let ns = r.gpu_ns.unwrap_or(0);
        match ops.iter_mut().find(|(op, _)| *op == r.op) {
            Some((_, sum)) => *sum += ns,
            None => ops.push((r.op, ns)),
        }
    }
    let ms = |ns: u64| ns as f64 / 1e6;
    let mut parts: Vec<String> = ops
        .iter()
        .map(|(op, ns)| format!("{op} {:.2}", ms(*ns)))
        .collect();
    parts.push(format!("GPU total {:.2}", ms(p.step_gpu_ns.unwrap_or(0))));
    if let Some(busy) = p.submissions_gpu_ns {
        parts.push(format!("GPU in submissions {:.2}", ms(busy)));
    }
    if let Some(h) = p.host {
        parts.push(format!(
            "host: wall {:.2}, in submissions {:.2}, outside them {:.2}",
            ms(h.step_ns),
            ms(h.wait_ns),
            ms(h.step_ns.saturating_sub(h.wait_ns))
        ));
    }
    format!("chunk profile, ms: {}", parts.join(", "))
}
