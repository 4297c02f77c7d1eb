//! How a matrix-vector product's work is cut: invocations a workgroup and rows each workgroup
//! takes, tuned per weight type and kept within the device's limits.

use spillway_shaders::WeightType;

use super::error::{GpuError, Result};

/// One workgroup of `matvec.comp`: `threads` invocations (a power of two) sharing `rows` rows,
/// its specialization constants 0 and 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatVecShape {
    pub threads: u32,
    pub rows: u32,
}

impl MatVecShape {
    /// The kernel's limits (its `MAX_WG` and `MAX_ROWS`).
    pub const MAX_THREADS: u32 = 256;
    pub const MAX_ROWS: u32 = 8;

    /// The shape used for `wtype`, the best of a sweep of ten shapes on the H200 over 4096 ×
    /// 4096, 4096 × 14336 and 14336 × 4096 matrices (`vulkan_matvec wg=...`, `bench/RESULTS.md`,
    /// 2026-12-03): eight rows a workgroup for the 4-bit types, F16 and F32, with 64 invocations
    /// (two NVIDIA subgroups); Q6_K four rows; Q8_0 one subgroup of 32 and eight rows.
    pub fn tuned(wtype: WeightType) -> MatVecShape {
        let (threads, rows) = match wtype {
            WeightType::F32 | WeightType::F16 => (64, 8),
            WeightType::Q4_0 | WeightType::Q4K => (64, 8),
            WeightType::Q6K => (64, 4),
            WeightType::Q8_0 => (32, 8),
        };
        MatVecShape { threads, rows }
    }

    /// The shape of the integer-dot-product kernels for rows of `blocks` blocks of 32 weights
    /// (times the experts summed, for a sum over experts): eight rows and an invocation per block
    /// up to 256 (at least 32). Each invocation quantizes its blocks of inputs before it can
    /// multiply, a chain of dependent steps that the f32 kernel does not have; with the f32
    /// kernel's 64 invocations a 14336-wide row takes seven of those chains one after the other,
    /// and in a decode step, where each product waits for the one before, that latency shows.
    /// Measured on the H200 in such a chain (`vulkan_matvec serial intdot wg=...`,
    /// `bench/RESULTS.md`, 2026-12-03): 14336 × 4096 Q4_0 31.8 µs at 64 × 8, 20.7 µs at 256 × 8;
    /// 4096 × 4096 12.6 µs at 64 × 8, 10.2 µs at 128 × 8.
    pub fn int_dot(blocks: usize) -> MatVecShape {
        let threads = blocks
            .next_power_of_two()
            .clamp(32, Self::MAX_THREADS as usize);
        MatVecShape {
            threads: threads as u32,
            rows: Self::MAX_ROWS,
        }
    }

    /// Workgroups below which a product takes fewer rows a workgroup (see
    /// [`MatVecShape::for_results`]).
    pub const MIN_GROUPS: usize = 512;

    /// As [`MatVecShape::MIN_GROUPS`] for products with RMSNorm fused, whose every workgroup
    /// also reads the whole input and the norm's weights.
    pub const MIN_GROUPS_NORMED: usize = 128;

    /// This shape with its rows halved until `results` results, `rows_per_result` rows each
    /// (2 for SwiGLU), fill `min_groups` workgroups, or a workgroup holds one result. A product
    /// of few rows (a MoE router of 128, an expert's down products) in 8-row workgroups leaves
    /// most of the H200's 132 multiprocessors idle. Measured there (`bench/RESULTS.md`,
    /// 2026-12-03): halving down to 512 workgroups took a Qwen3-30B-A3B-shaped step's expert
    /// dispatches from 3.3 to 2.2 ms, but Llama-3-8B's K and V products, with RMSNorm fused,
    /// were slower in 512 workgroups of 2 rows than in 128 of 8: each workgroup rereads the
    /// input and the norm, hence the lower floor for normed products.
    pub fn for_results(self, results: usize, rows_per_result: u32, min_groups: usize) -> Self {
        let mut rows = self.rows.max(rows_per_result);
        while rows > rows_per_result
            && results.div_ceil((rows / rows_per_result) as usize) < min_groups
        {
            rows /= 2;
        }
        MatVecShape {
            threads: self.threads,
            rows: rows.max(rows_per_result),
        }
    }

    /// Refuses shapes the kernel cannot run.
    pub fn check(self) -> Result<()> {
        let ok = self.threads.is_power_of_two()
            && (4..=Self::MAX_THREADS).contains(&self.threads)
            && (1..=Self::MAX_ROWS).contains(&self.rows);
        if ok {
            Ok(())
        } else {
            Err(GpuError::Unsupported(format!(
                "matrix-vector workgroups of {self:?}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::MatVecShape;

    #[test]
    fn few_results_take_fewer_rows_a_workgroup() {
        let tuned = MatVecShape {
            threads: 64,
            rows: 8,
        };
        let rows = |results, per, min| tuned.for_results(results, per, min).rows;
        // A router of 128 rows: one row a workgroup; 4096 rows keep eight.
        assert_eq!(rows(128, 1, MatVecShape::MIN_GROUPS_NORMED), 1);
        assert_eq!(rows(4096, 1, MatVecShape::MIN_GROUPS), 8);
        // 2048 rows: four a workgroup fill 512 workgroups.
        assert_eq!(rows(2048, 1, MatVecShape::MIN_GROUPS), 4);
        // 1024 normed rows keep eight (128 workgroups).
        assert_eq!(rows(1024, 1, MatVecShape::MIN_GROUPS_NORMED), 8);
        // SwiGLU keeps a gate row and an up row together.
        assert_eq!(rows(100, 2, MatVecShape::MIN_GROUPS), 2);
        assert_eq!(rows(8 * 768, 2, MatVecShape::MIN_GROUPS_NORMED), 8);
        assert_eq!(tuned.for_results(1, 1, 512).threads, 64);
    }

    #[test]
    fn integer_dot_shapes_take_an_invocation_a_block() {
        let threads = |blocks| MatVecShape::int_dot(blocks).threads;
        assert_eq!(threads(4096 / 32), 128);
        assert_eq!(threads(14336 / 32), 256);
        assert_eq!(threads(2048 / 32), 64);
        assert_eq!(threads(1), 32);
        for blocks in [1, 24, 64, 100, 448, 100_000] {
            MatVecShape::int_dot(blocks).check().unwrap();
        }
    }
}
