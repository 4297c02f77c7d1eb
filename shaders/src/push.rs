//! Push-constant blocks, laid out as the shaders declare them. A test reads each shader's SPIR-V
//! and checks these layouts against it, so a change on one side cannot silently skew the other.

use std::mem::{offset_of, size_of};

/// `dequant.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DequantParams {
    pub n_blocks: u32,
    /// Byte offset of the first block in the weight buffer.
    pub src_offset: u32,
    /// Element offset of the first output value.
    pub dst_offset: u32,
}

/// `matmul_coopmat.comp`'s `Params`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MatmulParams {
    pub m: u32,
    pub n: u32,
    pub k: u32,
}

/// A push-constant struct: its bytes and its fields' (offset, size) in declaration order.
pub trait PushConstants: Copy {
    fn layout() -> Vec<(u32, u32)>;
    fn bytes(&self) -> Vec<u8>;
}

macro_rules! push_constants {
    ($ty:ident { $($field:ident),* }) => {
        impl PushConstants for $ty {
            fn layout() -> Vec<(u32, u32)> {
                vec![$( (offset_of!($ty, $field) as u32, size_of::<u32>() as u32) ),*]
            }
            fn bytes(&self) -> Vec<u8> {
                let mut out = Vec::with_capacity(size_of::<$ty>());
                $( out.extend_from_slice(&self.$field.to_le_bytes()); )*
                out
            }
        }
    };
}

push_constants!(DequantParams {
    n_blocks,
    src_offset,
    dst_offset
});
push_constants!(MatmulParams { m, n, k });
