// The one table of shader variants: op × weight type × device feature. Read by `build.rs`, which
// compiles each row and generates `ShaderId`, and by the crate itself for the enums below.

/// What a kernel computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Weight blocks to f32.
    Dequant,
    /// f16 × f16 → f32 matrix product.
    Matmul,
}

/// The weight type a variant reads (the ggml type of the same name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightType {
    F16,
    Q8_0,
    Q4_0,
}

/// The device feature a variant needs beyond Vulkan 1.2 compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    /// Runs on every Vulkan 1.2 device.
    Base,
    /// `VK_KHR_cooperative_matrix` with 16×16×16 f16 → f32 at subgroup scope, and shader f16.
    CoopMat,
}

#[allow(dead_code)] // build.rs reads every field; the library reads them through `ShaderInfo`.
pub struct Variant {
    pub name: &'static str,
    pub source: &'static str,
    pub op: Op,
    pub wtype: Option<WeightType>,
    pub feature: Feature,
    pub defines: &'static [(&'static str, &'static str)],
}

pub const VARIANTS: &[Variant] = &[
    Variant {
        name: "dequant_f16",
        source: "dequant.comp",
        op: Op::Dequant,
        wtype: Some(WeightType::F16),
        feature: Feature::Base,
        defines: &[("WTYPE_F16", "1")],
    },
    Variant {
        name: "dequant_q8_0",
        source: "dequant.comp",
        op: Op::Dequant,
        wtype: Some(WeightType::Q8_0),
        feature: Feature::Base,
        defines: &[("WTYPE_Q8_0", "1")],
    },
    Variant {
        name: "dequant_q4_0",
        source: "dequant.comp",
        op: Op::Dequant,
        wtype: Some(WeightType::Q4_0),
        feature: Feature::Base,
        defines: &[("WTYPE_Q4_0", "1")],
    },
    Variant {
        name: "matmul_f16_coopmat",
        source: "matmul_coopmat.comp",
        op: Op::Matmul,
        wtype: None,
        feature: Feature::CoopMat,
        defines: &[],
    },
];
