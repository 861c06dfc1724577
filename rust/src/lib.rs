//! Rust bindings to libfp8kturbov, a paged KV cache with FP8 E4M3 keys and TurboQuant 2/3/4-bit
//! values, through its C ABI (`fp8kturbov.h`).
//!
//! - [`sys`]: the header, one declaration per C item, checked against it by `tests/layout.rs`;
//! - statuses as [`Result`] with the library's message ([`Error`]), the ABI checked once
//!   ([`check_abi`]) before any other call;
//! - sizes: [`k_page_bytes`], [`v_page_bytes`], [`v_data_section_bytes`], [`CacheLayout`];
//! - the generic entry points with params builders whose defaults are the library's:
//!   [`reshape_and_cache`] / [`WriteParams`], [`paged_decode_attn`] and
//!   [`paged_decode_workspace_bytes`] / [`DecodeParams`], [`dequantize`] / [`DequantizeParams`];
//! - the original engine's launchers, argument for argument:
//!   `reshape_and_cache_fp8k_turbo{2,3,4}v`, `paged_decode_attn_fp8k_turbo{2,3,4}v`.
//!
//! Device pointers and streams are `u64` throughout the safe layer; launches are `unsafe fn`
//! because the kernels access whatever those addresses point to.

mod engine;
mod error;
mod layout;
mod ops;
mod params;
pub mod sys;
mod version;

pub use engine::{
    paged_decode_attn_fp8k_turbo2v, paged_decode_attn_fp8k_turbo3v, paged_decode_attn_fp8k_turbo4v,
    reshape_and_cache_fp8k_turbo2v, reshape_and_cache_fp8k_turbo3v, reshape_and_cache_fp8k_turbo4v,
};
pub use error::{check, Error, Result, Status};
pub use layout::{k_page_bytes, v_data_section_bytes, v_page_bytes, CacheLayout};
pub use ops::{dequantize, paged_decode_attn, paged_decode_workspace_bytes, reshape_and_cache};
pub use params::{DecodeParams, DequantizeParams, VEncoder, VRotation, WriteParams};
pub use version::{abi_version, check_abi, version};
