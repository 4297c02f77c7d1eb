//! Spillway's compute kernels: GLSL in `glsl/`, compiled to SPIR-V when the crate builds, one
//! variant per row of the table in `variants.rs` (op × weight type × device feature). This crate
//! holds the kernels, their typed ids and their push-constant layouts; the runtime that creates
//! pipelines from them lives in the daemon.

mod push;
pub mod spirv;

include!("../variants.rs");
include!(concat!(env!("OUT_DIR"), "/shaders.rs"));

pub use push::{
    AttentionParams, AttentionPrefillParams, AttentionRopeParams, DequantParams, EltwiseParams,
    GatherAddParams, GetRowsParams, KvStoreParams, MatVecBatchParams, MatVecColsParams,
    MatVecGroupedParams, MatVecIdParams, MatVecParams, MatVecRunsParams, MoeRouteParams,
    MoeRouterParams, MoeSortParams, PushConstants, QuantizeQ8Params, RmsNormParams, RopeParams,
    ScaleAddParams, ScaleAddRoutedParams, ScatterAddParams,
};

/// One compiled variant.
pub struct ShaderInfo {
    pub id: ShaderId,
    pub name: &'static str,
    pub op: Op,
    pub wtype: Option<WeightType>,
    pub feature: Feature,
    /// SPIR-V as little-endian bytes (use [`ShaderInfo::words`] for the word form Vulkan takes).
    pub spirv: &'static [u8],
}

impl ShaderInfo {
    /// The SPIR-V module as 32-bit words.
    pub fn words(&self) -> Vec<u32> {
        self.spirv
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect()
    }
}

impl ShaderId {
    pub fn info(self) -> &'static ShaderInfo {
        SHADERS
            .iter()
            .find(|s| s.id == self)
            .expect("every ShaderId has a table row")
    }

    /// The variant for an op and weight type, if the table has one.
    pub fn find(op: Op, wtype: Option<WeightType>, feature: Feature) -> Option<ShaderId> {
        SHADERS
            .iter()
            .find(|s| s.op == op && s.wtype == wtype && s.feature == feature)
            .map(|s| s.id)
    }
}
