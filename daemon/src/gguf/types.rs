//! The numeric vocabularies of the GGUF format: metadata value types and ggml tensor types.

use std::fmt;

/// Type tag of a metadata value, as stored in the file (`gguf_metadata_value_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_u32(v: u32) -> Option<Self> {
        use ValueType::*;
        Some(match v {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Size in bytes of one scalar of this type; `None` for strings and arrays.
    pub fn scalar_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

macro_rules! ggml_types {
    ($( $variant:ident = $id:literal, $name:literal, $block:literal, $bytes:literal; )*) => {
        /// A ggml tensor type (`enum ggml_type`): its id in the file, elements per block and
        /// bytes per block. Ids that ggml has retired (4, 5, 31..=33, 36..=38) are unknown.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum GgmlType {
            $( $variant = $id, )*
        }

        impl GgmlType {
            pub const ALL: &'static [GgmlType] = &[$( GgmlType::$variant, )*];

            pub fn from_u32(v: u32) -> Option<Self> {
                match v {
                    $( $id => Some(GgmlType::$variant), )*
                    _ => None,
                }
            }

            /// The name ggml and llama.cpp print for this type.
            pub fn name(self) -> &'static str {
                match self { $( GgmlType::$variant => $name, )* }
            }

            /// Elements in one block.
            pub fn block_size(self) -> u64 {
                match self { $( GgmlType::$variant => $block, )* }
            }

            /// Bytes in one block.
            pub fn block_bytes(self) -> u64 {
                match self { $( GgmlType::$variant => $bytes, )* }
            }

            pub fn from_name(name: &str) -> Option<Self> {
                let name = name.to_ascii_uppercase();
                Self::ALL.iter().copied().find(|t| t.name().eq_ignore_ascii_case(&name))
            }
        }
    };
}

ggml_types! {
    F32 = 0, "F32", 1, 4;
    F16 = 1, "F16", 1, 2;
    Q4_0 = 2, "Q4_0", 32, 18;
    Q4_1 = 3, "Q4_1", 32, 20;
    Q5_0 = 6, "Q5_0", 32, 22;
    Q5_1 = 7, "Q5_1", 32, 24;
    Q8_0 = 8, "Q8_0", 32, 34;
    Q8_1 = 9, "Q8_1", 32, 36;
    Q2K = 10, "Q2_K", 256, 84;
    Q3K = 11, "Q3_K", 256, 110;
    Q4K = 12, "Q4_K", 256, 144;
    Q5K = 13, "Q5_K", 256, 176;
    Q6K = 14, "Q6_K", 256, 210;
    Q8K = 15, "Q8_K", 256, 292;
    IQ2XXS = 16, "IQ2_XXS", 256, 66;
    IQ2XS = 17, "IQ2_XS", 256, 74;
    IQ3XXS = 18, "IQ3_XXS", 256, 98;
    IQ1S = 19, "IQ1_S", 256, 50;
    IQ4NL = 20, "IQ4_NL", 32, 18;
    IQ3S = 21, "IQ3_S", 256, 110;
    IQ2S = 22, "IQ2_S", 256, 82;
    IQ4XS = 23, "IQ4_XS", 256, 136;
    I8 = 24, "I8", 1, 1;
    I16 = 25, "I16", 1, 2;
    I32 = 26, "I32", 1, 4;
    I64 = 27, "I64", 1, 8;
    F64 = 28, "F64", 1, 8;
    IQ1M = 29, "IQ1_M", 256, 56;
    BF16 = 30, "BF16", 1, 2;
    TQ1_0 = 34, "TQ1_0", 256, 54;
    TQ2_0 = 35, "TQ2_0", 256, 66;
    MXFP4 = 39, "MXFP4", 32, 17;
}

impl GgmlType {
    /// Bytes taken by a row of `n` elements, or `None` when `n` is not a whole number of blocks
    /// or the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.block_bytes())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_retired_ids_are_unknown() {
        for &t in GgmlType::ALL {
            assert_eq!(GgmlType::from_u32(t as u32), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 40, 1000] {
            assert_eq!(GgmlType::from_u32(retired), None);
        }
    }

    #[test]
    fn row_bytes_requires_whole_blocks() {
        assert_eq!(GgmlType::Q4K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4K.row_bytes(100), None);
        assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(GgmlType::F32.row_bytes(u64::MAX), None);
    }
}
