//! Metadata: the file's key-value entries in order, with an index by key and typed accessors
//! that check what is stored, so that model code reads hyperparameters without matching on
//! [`Value`] and gets an error naming the key when a file stores the wrong type.

use std::collections::HashMap;

use crate::gguf::error::GgufError;
use crate::gguf::types::ValueType;
use crate::gguf::value::{Array, Value};

/// Metadata entries in file order, with an index by key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

macro_rules! typed_accessors {
    ($( $(#[$doc:meta])* $get:ident, $opt:ident -> $t:ty = $conv:path; )*) => {
        $(
            $(#[$doc])*
            pub fn $get(&self, key: &str) -> Result<$t, GgufError> {
                self.$opt(key)?.ok_or_else(|| GgufError::MissingKey { key: key.to_owned() })
            }

            /// Like the `get_` accessor of the same type, but `Ok(None)` when the key is absent.
            pub fn $opt(&self, key: &str) -> Result<Option<$t>, GgufError> {
                self.get(key).map(|v| $conv(key, v)).transpose()
            }
        )*
    };
}

impl Metadata {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends an entry; a key may appear only once.
    pub fn insert(&mut self, key: impl Into<String>, value: Value) -> Result<(), GgufError> {
        let key = key.into();
        if self.index.contains_key(&key) {
            return Err(GgufError::DuplicateKey { key });
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Entries in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> + '_ {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    typed_accessors! {
        /// Any integer type is accepted when its value fits in a u32: writers disagree on the
        /// width of counts (llama.cpp writes u32, some converters i32 or u64).
        get_u32, opt_u32 -> u32 = to_u32;
        /// Any integer type whose value is non-negative.
        get_u64, opt_u64 -> u64 = to_u64;
        /// Any integer type whose value fits in an i32.
        get_i32, opt_i32 -> i32 = to_i32;
        /// Any integer type whose value fits in an i64.
        get_i64, opt_i64 -> i64 = to_i64;
        /// Exactly an f32, as llama.cpp requires for float hyperparameters.
        get_f32, opt_f32 -> f32 = to_f32;
        /// An f32 (widened) or an f64.
        get_f64, opt_f64 -> f64 = to_f64;
        /// Exactly a bool.
        get_bool, opt_bool -> bool = to_bool;
        /// Exactly a string.
        get_str, opt_str -> &str = to_str;
        /// An array of any element type.
        get_array, opt_array -> &Array = to_array;
        /// Exactly an array of strings.
        get_string_array, opt_string_array -> &[String] = to_string_array;
        /// Exactly an array of f32.
        get_f32_array, opt_f32_array -> &[f32] = to_f32_array;
        /// Exactly an array of i32.
        get_i32_array, opt_i32_array -> &[i32] = to_i32_array;
        /// Exactly an array of u32.
        get_u32_array, opt_u32_array -> &[u32] = to_u32_array;
    }
}

/// The value of any integer type, widened so that every GGUF integer fits.
fn integer(v: &Value) -> Option<i128> {
    Some(match *v {
        Value::U8(x) => x.into(),
        Value::I8(x) => x.into(),
        Value::U16(x) => x.into(),
        Value::I16(x) => x.into(),
        Value::U32(x) => x.into(),
        Value::I32(x) => x.into(),
        Value::U64(x) => x.into(),
        Value::I64(x) => x.into(),
        _ => return None,
    })
}

/// How a value's type is named in errors, arrays with their element type.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Array(a) => match a.element_type() {
            ValueType::U8 => "array of u8",
            ValueType::I8 => "array of i8",
            ValueType::U16 => "array of u16",
            ValueType::I16 => "array of i16",
            ValueType::U32 => "array of u32",
            ValueType::I32 => "array of i32",
            ValueType::F32 => "array of f32",
            ValueType::Bool => "array of bool",
            ValueType::String => "array of string",
            ValueType::Array => "array of array",
            ValueType::U64 => "array of u64",
            ValueType::I64 => "array of i64",
            ValueType::F64 => "array of f64",
        },
        other => other.value_type().name(),
    }
}

pub(super) fn wrong_type(key: &str, expected: &'static str, v: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: type_name(v),
    }
}

macro_rules! integer_conversions {
    ($( $name:ident -> $t:ident; )*) => {
        $(
            fn $name(key: &str, v: &Value) -> Result<$t, GgufError> {
                let x = integer(v).ok_or_else(|| wrong_type(key, stringify!($t), v))?;
                $t::try_from(x).map_err(|_| GgufError::IntegerOutOfRange {
                    key: key.to_owned(),
                    target: stringify!($t),
                    value: x,
                })
            }
        )*
    };
}

integer_conversions! {
    to_u32 -> u32;
    to_u64 -> u64;
    to_i32 -> i32;
    to_i64 -> i64;
}

/// Conversions that borrow from the value, so they name its lifetime.
macro_rules! exact_conversions {
    ($( $name:ident -> $t:ty, $expected:literal, $pat:pat => $out:expr; )*) => {
        $(
            fn $name<'v>(key: &str, v: &'v Value) -> Result<$t, GgufError> {
                match v {
                    $pat => Ok($out),
                    other => Err(wrong_type(key, $expected, other)),
                }
            }
        )*
    };
}

exact_conversions! {
    to_str -> &'v str, "string", Value::String(s) => s.as_str();
    to_array -> &'v Array, "array", Value::Array(a) => a;
    to_string_array -> &'v [String], "array of string", Value::Array(Array::String(a)) => a;
    to_f32_array -> &'v [f32], "array of f32", Value::Array(Array::F32(a)) => a;
    to_i32_array -> &'v [i32], "array of i32", Value::Array(Array::I32(a)) => a;
    to_u32_array -> &'v [u32], "array of u32", Value::Array(Array::U32(a)) => a;
}

fn to_f32(key: &str, v: &Value) -> Result<f32, GgufError> {
    match *v {
        Value::F32(x) => Ok(x),
        _ => Err(wrong_type(key, "f32", v)),
    }
}

fn to_bool(key: &str, v: &Value) -> Result<bool, GgufError> {
    match *v {
        Value::Bool(x) => Ok(x),
        _ => Err(wrong_type(key, "bool", v)),
    }
}

fn to_f64(key: &str, v: &Value) -> Result<f64, GgufError> {
    v.as_f64().ok_or_else(|| wrong_type(key, "f64", v))
}
