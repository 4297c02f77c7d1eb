//! The tile of the prompts' cooperative-matrix products (`matvec_batch.comp`): its size, the
//! shared memory it takes, and the specialization constants that give the kernel its shape.

use spillway_shaders::COOPMAT_BLOCKS;

use super::device::Device;
use super::error::{GpuError, Result};

/// The tile of the cooperative-matrix products (`matvec_batch.comp`): `rows` rows × `tokens`
/// tokens per workgroup, a subgroup per [`COOPMAT_BLOCKS`] blocks of 16 × 16 results, `depth`
/// inputs taken into shared memory at each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatMulTile {
    /// 32, 64 or 128.
    pub depth: u32,
    /// 64 or 128.
    pub rows: u32,
    /// 64 or 128.
    pub tokens: u32,
}

impl MatMulTile {
    /// Measured best on the H200 for prompts of 512 tokens (`bench/RESULTS.md`).
    pub const TUNED: MatMulTile = MatMulTile {
        depth: 64,
        rows: 128,
        tokens: 128,
    };

    /// Rows and tokens of one subgroup's results.
    pub fn subgroup_results() -> (u32, u32) {
        (16 * COOPMAT_BLOCKS.0, 16 * COOPMAT_BLOCKS.1)
    }

    /// Subgroups of a workgroup along rows and along tokens (the kernel's `ROW_GROUPS` and
    /// `COL_GROUPS`).
    pub fn groups(self) -> (u32, u32) {
        let (r, t) = Self::subgroup_results();
        (self.rows / r, self.tokens / t)
    }

    /// Subgroups of a workgroup.
    pub fn subgroups(self) -> u32 {
        let (r, t) = self.groups();
        r * t
    }

    /// Shared memory of `matvec_batch.comp` with this tile: f16 weights and inputs (rows padded
    /// by 8 halves) and a 16 × 16 block of f32 results per subgroup.
    pub fn shared_bytes(self) -> u32 {
        let padded = self.depth + 8;
        (self.rows + self.tokens) * padded * 2 + self.subgroups() * 256 * 4
    }

    /// Refuses tiles the kernel cannot run on `device`, over its shared memory or its
    /// workgroup size.
    pub fn check_on(self, device: &Device) -> Result<()> {
        self.check()?;
        let shared_memory = device.max_shared_memory();
        if self.shared_bytes() > shared_memory {
            return Err(GpuError::Unsupported(format!(
                "a product tile of {} rows × {} tokens, {} inputs deep: {} bytes of shared \
                 memory, the device has {shared_memory}",
                self.rows,
                self.tokens,
                self.depth,
                self.shared_bytes()
            )));
        }
        Ok(())
    }

    pub fn check(self) -> Result<()> {
        let (r, t) = Self::subgroup_results();
        if ![32, 64, 128].contains(&self.depth)
            || ![64, 128].contains(&self.rows)
            || ![64, 128].contains(&self.tokens)
            || !self.rows.is_multiple_of(r)
            || !self.tokens.is_multiple_of(t)
        {
            return Err(GpuError::Unsupported(format!(
                "a product tile of {} rows × {} tokens, {} inputs deep (64 or 128 rows and \
                 tokens; 32, 64 or 128 deep)",
                self.rows, self.tokens, self.depth
            )));
        }
        Ok(())
    }

    /// The kernel's specialization constants: workgroup size, accumulate, depth, subgroups
    /// along rows and tokens.
    pub(crate) fn spec(self, subgroup_size: u32, accumulate: bool) -> [u32; 5] {
        let (r, t) = self.groups();
        [
            self.subgroups() * subgroup_size,
            accumulate as u32,
            self.depth,
            r,
            t,
        ]
    }
}
