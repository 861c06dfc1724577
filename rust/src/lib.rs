#![doc = include_str!("../README.md")]
// Modules, one concern each: `sys` (the header), `error` (statuses as Result), `version` (the ABI
// check), `layout` (sizes), `params` (builders), `ops` (the generic entry points), `engine` (the
// original engine's launchers).

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
pub use ops::{
    dequantize, paged_decode_attn, paged_decode_workspace_bytes, paged_prefill_attn,
    paged_prefill_workspace_bytes, reshape_and_cache,
};
pub use params::{DecodeParams, DequantizeParams, PrefillParams, VEncoder, VRotation, WriteParams};
pub use version::{abi_version, check_abi, version};
