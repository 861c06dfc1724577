//! Rust bindings to libfp8kturbov, a paged KV cache with FP8 E4M3 keys and TurboQuant 2/3/4-bit
//! values, through its C ABI (`fp8kturbov.h`).
//!
//! - [`sys`]: the header, one declaration per C item, checked against it by `tests/layout.rs`.

pub mod sys;
