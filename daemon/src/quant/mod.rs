//! Weight block formats (`#[repr(C)]` blocks with compile-time size checks) and dequantization.
