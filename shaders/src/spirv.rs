//! Just enough SPIR-V reading to check what the host side assumes about a module: the
//! capabilities it declares and the layout of its push-constant block.

const OP_CAPABILITY: u16 = 17;
const OP_TYPE_INT: u16 = 21;
const OP_TYPE_FLOAT: u16 = 22;
const OP_TYPE_STRUCT: u16 = 30;
const OP_TYPE_POINTER: u16 = 32;
const OP_VARIABLE: u16 = 59;
const OP_MEMBER_DECORATE: u16 = 72;
const DECORATION_OFFSET: u32 = 35;
const STORAGE_CLASS_PUSH_CONSTANT: u32 = 9;
/// `CooperativeMatrixKHR`.
pub const CAPABILITY_COOPERATIVE_MATRIX_KHR: u32 = 6022;
/// `GroupNonUniformArithmetic`.
pub const CAPABILITY_GROUP_NON_UNIFORM_ARITHMETIC: u32 = 63;

/// One instruction: opcode and operand words.
fn instructions(words: &[u32]) -> impl Iterator<Item = (u16, &[u32])> {
    let mut rest = words.get(5..).unwrap_or(&[]);
    std::iter::from_fn(move || {
        let first = *rest.first()?;
        let count = (first >> 16) as usize;
        if count == 0 || count > rest.len() {
            return None;
        }
        let (inst, tail) = rest.split_at(count);
        rest = tail;
        Some(((first & 0xFFFF) as u16, &inst[1..]))
    })
}

/// Capabilities the module declares.
pub fn capabilities(words: &[u32]) -> Vec<u32> {
    instructions(words)
        .filter(|(op, _)| *op == OP_CAPABILITY)
        .map(|(_, o)| o[0])
        .collect()
}

/// The push-constant block's members as (offset, size in bytes), in member order, or `None` when
/// the module has no push constants. Members must be 32- or 64-bit scalars.
pub fn push_constant_layout(words: &[u32]) -> Option<Vec<(u32, u32)>> {
    let insts: Vec<(u16, &[u32])> = instructions(words).collect();
    let pointer = insts.iter().find_map(|(op, o)| {
        (*op == OP_VARIABLE && o.get(2) == Some(&STORAGE_CLASS_PUSH_CONSTANT)).then(|| o[0])
    })?;
    let block = insts.iter().find_map(|(op, o)| {
        (*op == OP_TYPE_POINTER && o[0] == pointer && o[1] == STORAGE_CLASS_PUSH_CONSTANT)
            .then(|| o[2])
    })?;
    let members = insts
        .iter()
        .find_map(|(op, o)| (*op == OP_TYPE_STRUCT && o[0] == block).then(|| o[1..].to_vec()))?;
    let width = |ty: u32| {
        insts.iter().find_map(|(op, o)| {
            ((*op == OP_TYPE_INT || *op == OP_TYPE_FLOAT) && o[0] == ty).then(|| o[1] / 8)
        })
    };
    members
        .iter()
        .enumerate()
        .map(|(i, &ty)| {
            let offset = insts.iter().find_map(|(op, o)| {
                (*op == OP_MEMBER_DECORATE
                    && o[0] == block
                    && o[1] == i as u32
                    && o[2] == DECORATION_OFFSET)
                    .then(|| o[3])
            })?;
            Some((offset, width(ty)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::push::PushConstants;
    use crate::{
        AttentionParams, AttentionPrefillParams, AttentionRopeParams, DequantParams, EltwiseParams,
        GatherAddParams, GetRowsParams, KvStoreParams, MatVecBatchParams, MatVecColsParams,
        MatVecGroupedParams, MatVecIdParams, MatVecParams, MatVecRunsParams, MoeRouteParams,
        MoeRouterParams, MoeSortParams, Op, QuantizeQ8Params, RmsNormParams, RopeParams,
        ScaleAddParams, ScaleAddRoutedParams, ScatterAddParams, ShaderId, SHADERS,
    };

    #[test]
    fn every_variant_is_valid_spirv() {
        for s in SHADERS {
            let words = s.words();
            assert_eq!(words[0], 0x0723_0203, "{} has the SPIR-V magic", s.name);
            assert_eq!(ShaderId::find(s.op, s.wtype, s.feature), Some(s.id));
        }
    }

    #[test]
    fn push_constant_structs_match_the_shaders() {
        for s in SHADERS {
            let expected = match s.op {
                Op::Dequant | Op::DequantF16 => DequantParams::layout(),
                Op::Matmul => MatVecBatchParams::layout(),
                Op::MatVec | Op::MatVecQ8 => MatVecParams::layout(),
                Op::MatVecId | Op::MatVecIdQ8 => MatVecIdParams::layout(),
                Op::MatVecCols | Op::MatVecColsQ8 => MatVecColsParams::layout(),
                Op::MatVecRuns | Op::MatVecRunsQ8 => MatVecRunsParams::layout(),
                Op::QuantizeQ8 => QuantizeQ8Params::layout(),
                Op::MoeRoute | Op::MoeRouteChunk => MoeRouteParams::layout(),
                Op::MoeSort => MoeSortParams::layout(),
                Op::MoeRouter => MoeRouterParams::layout(),
                Op::ScaleAddRouted => ScaleAddRoutedParams::layout(),
                Op::MatVecBatch => MatVecBatchParams::layout(),
                Op::GetRows => GetRowsParams::layout(),
                Op::RmsNorm => RmsNormParams::layout(),
                Op::RopeNorm | Op::RopeNeox => RopeParams::layout(),
                Op::Add | Op::Swiglu | Op::Softmax => EltwiseParams::layout(),
                Op::ScaleAdd => ScaleAddParams::layout(),
                Op::ScatterAdd => ScatterAddParams::layout(),
                Op::GatherAdd => GatherAddParams::layout(),
                Op::MatVecBatchGrouped => MatVecGroupedParams::layout(),
                Op::KvStore => KvStoreParams::layout(),
                Op::Attention => AttentionParams::layout(),
                Op::AttentionRopeNorm | Op::AttentionRopeNeox => AttentionRopeParams::layout(),
                Op::AttentionPrefill => AttentionPrefillParams::layout(),
            };
            assert_eq!(
                push_constant_layout(&s.words()),
                Some(expected),
                "{}",
                s.name
            );
        }
    }

    #[test]
    fn every_weight_op_has_every_weight_type() {
        use crate::{Feature, WeightType};
        for op in [
            Op::Dequant,
            Op::DequantF16,
            Op::MatVec,
            Op::MatVecId,
            Op::MatVecCols,
            Op::MatVecRuns,
            Op::MatVecBatch,
            Op::GetRows,
        ] {
            for w in [
                WeightType::F32,
                WeightType::F16,
                WeightType::Q8_0,
                WeightType::Q4_0,
                WeightType::Q4K,
                WeightType::Q6K,
            ] {
                assert!(
                    ShaderId::find(op, Some(w), Feature::Base).is_some(),
                    "{op:?} {w:?}"
                );
            }
        }
    }

    #[test]
    fn subgroup_variants_and_only_they_use_subgroup_arithmetic() {
        use crate::Feature;
        for s in SHADERS {
            let uses = capabilities(&s.words()).contains(&CAPABILITY_GROUP_NON_UNIFORM_ARITHMETIC);
            let subgroup = matches!(s.feature, Feature::Subgroup | Feature::IntDotSubgroup);
            assert_eq!(uses, subgroup, "{}", s.name);
        }
    }

    #[test]
    fn coopmat_variant_declares_cooperative_matrices() {
        let words = ShaderId::MatmulF16Coopmat.info().words();
        assert!(capabilities(&words).contains(&CAPABILITY_COOPERATIVE_MATRIX_KHR));
        let plain = ShaderId::DequantQ8_0.info().words();
        assert!(!capabilities(&plain).contains(&CAPABILITY_COOPERATIVE_MATRIX_KHR));
    }
}
