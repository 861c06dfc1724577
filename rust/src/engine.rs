//! The original engine's six launchers, argument for argument: device pointers as `u64`, sizes
//! `u32`, scales `f32`, byte strides `u64`, the stream last as `u64`. An engine replaces
//! `ops::reshape_and_cache_fp8k_turbo3v(gpu, kernel, key, ...)` by
//! `fp8kturbov::reshape_and_cache_fp8k_turbo3v(key, ...)`: the library picks its own kernels.
//!
//! They map to the header's fixed-argument entry points: packed K pages for the decode,
//! sparse-V threshold `FP8KTURBOV_DEFAULT_SPARSE_V_THRESHOLD`, no workspace (one CTA per
//! sequence and KV head). The generic [`crate::paged_decode_attn`] takes a workspace.

use std::ffi::c_void;

use crate::error::{check, Result};
use crate::ops::stream_handle;
use crate::sys;
use crate::version::check_abi;

fn ptr(address: u64) -> *mut c_void {
    address as usize as *mut c_void
}

macro_rules! write_launcher {
    ($(#[$doc:meta])* $name:ident => $sys:path) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// As for [`crate::reshape_and_cache`]: every address is a device allocation of the size
        /// the header gives it, and `stream` a valid stream of the current device or 0.
        #[allow(clippy::too_many_arguments)] // the engine's signature, kept as it is
        pub unsafe fn $name(
            key: u64,
            value: u64,
            k_cache: u64,
            v_cache: u64,
            slot_mapping: u64,
            num_tokens: u32,
            num_kv_heads: u32,
            head_dim: u32,
            block_size: u32,
            key_stride: u32,
            value_stride: u32,
            k_scale: f32,
            k_block_stride_bytes: u64,
            v_block_stride_bytes: u64,
            v_data_section_bytes: u64,
            stream: u64,
        ) -> Result<()> {
            check_abi()?;
            check($sys(
                ptr(key), ptr(value), ptr(k_cache), ptr(v_cache), ptr(slot_mapping) as *const i64,
                num_tokens, num_kv_heads, head_dim, block_size, key_stride, value_stride, k_scale,
                k_block_stride_bytes, v_block_stride_bytes, v_data_section_bytes,
                stream_handle(stream),
            ))
        }
    };
}

macro_rules! decode_launcher {
    ($(#[$doc:meta])* $name:ident => $sys:path) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// As for [`crate::paged_decode_attn`]: every address is a device allocation of the size
        /// the header gives it, the attended block-table entries are pages inside the pools, and
        /// `stream` is a valid stream of the current device or 0.
        #[allow(clippy::too_many_arguments)] // the engine's signature, kept as it is
        pub unsafe fn $name(
            q: u64,
            k_cache: u64,
            v_cache: u64,
            output: u64,
            block_tables: u64,
            seq_lens: u64,
            max_blocks_per_seq: u32,
            num_seqs: u32,
            num_q_heads: u32,
            num_kv_heads: u32,
            head_dim: u32,
            block_size: u32,
            inv_sqrt_d: f32,
            k_scale: f32,
            q_stride: u32,
            v_block_stride_bytes: u64,
            v_data_section_bytes: u64,
            sliding_window: u32,
            stream: u64,
        ) -> Result<()> {
            check_abi()?;
            check($sys(
                ptr(q), ptr(k_cache), ptr(v_cache), ptr(output), ptr(block_tables) as *const i32,
                ptr(seq_lens) as *const i32, max_blocks_per_seq, num_seqs, num_q_heads,
                num_kv_heads, head_dim, block_size, inv_sqrt_d, k_scale, q_stride,
                v_block_stride_bytes, v_data_section_bytes, sliding_window, stream_handle(stream),
            ))
        }
    };
}

write_launcher!(
    /// Writes K (FP8) and V (2-bit codes) of `num_tokens` tokens into the paged pools.
    reshape_and_cache_fp8k_turbo2v => sys::fp8kturbov_reshape_and_cache_fp8k_turbo2v
);
write_launcher!(
    /// Writes K (FP8) and V (3-bit codes) of `num_tokens` tokens into the paged pools.
    reshape_and_cache_fp8k_turbo3v => sys::fp8kturbov_reshape_and_cache_fp8k_turbo3v
);
write_launcher!(
    /// Writes K (FP8) and V (4-bit codes) of `num_tokens` tokens into the paged pools.
    reshape_and_cache_fp8k_turbo4v => sys::fp8kturbov_reshape_and_cache_fp8k_turbo4v
);
decode_launcher!(
    /// Paged decode attention over a cache with 2-bit V, one query token per sequence.
    paged_decode_attn_fp8k_turbo2v => sys::fp8kturbov_paged_decode_attn_fp8k_turbo2v
);
decode_launcher!(
    /// Paged decode attention over a cache with 3-bit V, one query token per sequence.
    paged_decode_attn_fp8k_turbo3v => sys::fp8kturbov_paged_decode_attn_fp8k_turbo3v
);
decode_launcher!(
    /// Paged decode attention over a cache with 4-bit V, one query token per sequence.
    paged_decode_attn_fp8k_turbo4v => sys::fp8kturbov_paged_decode_attn_fp8k_turbo4v
);
