//! The raw C ABI of `fp8kturbov.h`, name for name: every function, struct, enum value and macro.
//!
//! C enums are `c_uint` (what C compilers make of an enum without negative values), with one
//! constant per value, so that a value added by a newer library is still representable. Pointer
//! arguments keep their C types here; the safe layer takes device pointers as `u64`.
//! `tests/layout.rs` compares every size, offset, constant and signature below with the header;
//! build.rs links the library.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};

// ---- Versions -----------------------------------------------------------------------------------
pub const FP8KTURBOV_VERSION_MAJOR: c_int = 0;
pub const FP8KTURBOV_VERSION_MINOR: c_int = 5;
pub const FP8KTURBOV_VERSION_PATCH: c_int = 0;
pub const FP8KTURBOV_VERSION: c_int =
    FP8KTURBOV_VERSION_MAJOR * 10000 + FP8KTURBOV_VERSION_MINOR * 100 + FP8KTURBOV_VERSION_PATCH;
pub const FP8KTURBOV_ABI_VERSION: c_int = 1;

// ---- Defaults and limits ------------------------------------------------------------------------
pub const FP8KTURBOV_DEFAULT_SPARSE_V_THRESHOLD: f32 = 1e-3;
pub const FP8KTURBOV_DEFAULT_V_BITS: u32 = 3;
pub const FP8KTURBOV_MAX_QUERY_LEN: u32 = 16;

// ---- Status -------------------------------------------------------------------------------------
pub type fp8kturbov_status_t = c_uint;
pub const FP8KTURBOV_STATUS_SUCCESS: fp8kturbov_status_t = 0;
pub const FP8KTURBOV_STATUS_INVALID_VALUE: fp8kturbov_status_t = 1;
pub const FP8KTURBOV_STATUS_NULL_POINTER: fp8kturbov_status_t = 2;
pub const FP8KTURBOV_STATUS_MISALIGNED: fp8kturbov_status_t = 3;
pub const FP8KTURBOV_STATUS_NOT_SUPPORTED: fp8kturbov_status_t = 4;
pub const FP8KTURBOV_STATUS_BAD_STRUCT_SIZE: fp8kturbov_status_t = 5;
pub const FP8KTURBOV_STATUS_CUDA_ERROR: fp8kturbov_status_t = 6;

/// The opaque stream type: a `CUstream` / `cudaStream_t` (or NULL for the legacy default stream).
#[repr(C)]
pub struct CUstream_st {
    _opaque: [u8; 0],
}
pub type fp8kturbov_stream_t = *mut CUstream_st;

// ---- Checked mode -------------------------------------------------------------------------------
pub type fp8kturbov_index_error_t = c_uint;
pub const FP8KTURBOV_INDEX_ERROR_SLOT: fp8kturbov_index_error_t = 1;
pub const FP8KTURBOV_INDEX_ERROR_BLOCK_TABLE: fp8kturbov_index_error_t = 2;
pub const FP8KTURBOV_INDEX_ERROR_SEQ_LEN: fp8kturbov_index_error_t = 4;
pub const FP8KTURBOV_INDEX_ERROR_QUERY_START: fp8kturbov_index_error_t = 8;

// ---- V encoders and rotation --------------------------------------------------------------------
pub type fp8kturbov_v_encoder_t = c_uint;
pub const FP8KTURBOV_V_ENCODER_MATCHED_NORM: fp8kturbov_v_encoder_t = 0;
pub const FP8KTURBOV_V_ENCODER_MSE: fp8kturbov_v_encoder_t = 1;
pub const FP8KTURBOV_V_ENCODER_PROJECTION: fp8kturbov_v_encoder_t = 2;

pub type fp8kturbov_v_rotation_t = c_uint;
pub const FP8KTURBOV_V_ROTATION_NONE: fp8kturbov_v_rotation_t = 0;
pub const FP8KTURBOV_V_ROTATION_HADAMARD: fp8kturbov_v_rotation_t = 1;

// ---- Parameter structs (fields only ever appended; see the header for units) --------------------
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fp8kturbov_write_params_t {
    pub struct_size: usize,
    pub key: *const c_void,
    pub value: *const c_void,
    pub k_cache: *mut c_void,
    pub v_cache: *mut c_void,
    pub slot_mapping: *const i64,
    pub num_tokens: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub key_stride: u32,
    pub value_stride: u32,
    pub k_scale: f32,
    pub v_bits: u32,
    pub k_block_stride_bytes: u64,
    pub v_block_stride_bytes: u64,
    pub v_data_section_bytes: u64,
    pub num_blocks: u64,
    pub error_flags: *mut u32,
    pub v_encoder: u32,
    pub v_rotation: u32,
}
pub const FP8KTURBOV_WRITE_PARAMS_V1_SIZE: usize = 104;
pub const FP8KTURBOV_WRITE_PARAMS_V2_SIZE: usize = 120;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fp8kturbov_decode_params_t {
    pub struct_size: usize,
    pub q: *const c_void,
    pub k_cache: *const c_void,
    pub v_cache: *const c_void,
    pub output: *mut c_void,
    pub block_tables: *const i32,
    pub seq_lens: *const i32,
    pub max_blocks_per_seq: u32,
    pub num_seqs: u32,
    pub num_q_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub inv_sqrt_d: f32,
    pub k_scale: f32,
    pub q_stride: u32,
    pub v_bits: u32,
    pub k_block_stride_bytes: u64,
    pub v_block_stride_bytes: u64,
    pub v_data_section_bytes: u64,
    pub sliding_window: u32,
    pub sparse_v_threshold: f32,
    pub workspace: *mut c_void,
    pub workspace_bytes: u64,
    pub num_blocks: u64,
    pub error_flags: *mut u32,
    pub sinks: *const f32,
    pub soft_cap: f32,
    pub query_start: *const i32,
    pub max_q_len: u32,
    pub num_query_rows: u32,
    pub v_rotation: u32,
    pub block_tables_stride: u64,
    pub append_key: *const c_void,
    pub append_value: *const c_void,
    pub append_slot_mapping: *const i64,
    pub append_key_stride: u32,
    pub append_value_stride: u32,
    pub v_encoder: u32,
}
pub const FP8KTURBOV_DECODE_PARAMS_V1_SIZE: usize = 144;
pub const FP8KTURBOV_DECODE_PARAMS_V2_SIZE: usize = 160;
pub const FP8KTURBOV_DECODE_PARAMS_V3_SIZE: usize = 200;
pub const FP8KTURBOV_DECODE_PARAMS_V4_SIZE: usize = 208;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fp8kturbov_prefill_params_t {
    pub struct_size: usize,
    pub q: *const c_void,
    pub k_cache: *const c_void,
    pub v_cache: *const c_void,
    pub output: *mut c_void,
    pub lse: *mut f32,
    pub block_tables: *const i32,
    pub seq_lens: *const i32,
    pub query_start: *const i32,
    pub max_blocks_per_seq: u32,
    pub num_seqs: u32,
    pub num_q_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub inv_sqrt_d: f32,
    pub k_scale: f32,
    pub q_stride: u32,
    pub v_bits: u32,
    pub k_block_stride_bytes: u64,
    pub v_block_stride_bytes: u64,
    pub v_data_section_bytes: u64,
    pub block_tables_stride: u64,
    pub sliding_window: u32,
    pub soft_cap: f32,
    pub sinks: *const f32,
    pub v_rotation: u32,
    pub max_q_len: u32,
    pub num_query_rows: u32,
    pub workspace: *mut c_void,
    pub workspace_bytes: u64,
    pub num_blocks: u64,
    pub error_flags: *mut u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fp8kturbov_dequantize_params_t {
    pub struct_size: usize,
    pub k_cache: *const c_void,
    pub v_cache: *const c_void,
    pub slot_mapping: *const i64,
    pub key: *mut c_void,
    pub value: *mut c_void,
    pub num_tokens: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub key_stride: u32,
    pub value_stride: u32,
    pub k_scale: f32,
    pub v_bits: u32,
    pub k_block_stride_bytes: u64,
    pub v_block_stride_bytes: u64,
    pub v_data_section_bytes: u64,
    pub num_blocks: u64,
    pub error_flags: *mut u32,
}
pub const FP8KTURBOV_DEQUANTIZE_PARAMS_V1_SIZE: usize = 104;

extern "C" {
    pub fn fp8kturbov_version() -> c_int;
    pub fn fp8kturbov_abi_version() -> c_int;
    pub fn fp8kturbov_cuda_runtime_version() -> c_int;
    pub fn fp8kturbov_build_commit() -> *const c_char;
    pub fn fp8kturbov_status_string(status: fp8kturbov_status_t) -> *const c_char;
    pub fn fp8kturbov_last_error_message() -> *const c_char;

    pub fn fp8kturbov_k_page_bytes(block_size: u32, num_kv_heads: u32, head_dim: u32) -> u64;
    pub fn fp8kturbov_v_data_section_bytes(
        block_size: u32,
        num_kv_heads: u32,
        head_dim: u32,
        bits: u32,
    ) -> u64;
    pub fn fp8kturbov_v_page_bytes(
        block_size: u32,
        num_kv_heads: u32,
        head_dim: u32,
        bits: u32,
    ) -> u64;

    pub fn fp8kturbov_write_params_init(params: *mut fp8kturbov_write_params_t);
    pub fn fp8kturbov_write_params_init_sized(
        params: *mut fp8kturbov_write_params_t,
        struct_size: usize,
    ) -> fp8kturbov_status_t;
    pub fn fp8kturbov_reshape_and_cache(
        params: *const fp8kturbov_write_params_t,
        stream: fp8kturbov_stream_t,
    ) -> fp8kturbov_status_t;

    pub fn fp8kturbov_decode_params_init(params: *mut fp8kturbov_decode_params_t);
    pub fn fp8kturbov_decode_params_init_sized(
        params: *mut fp8kturbov_decode_params_t,
        struct_size: usize,
    ) -> fp8kturbov_status_t;
    pub fn fp8kturbov_paged_decode_attn(
        params: *const fp8kturbov_decode_params_t,
        stream: fp8kturbov_stream_t,
    ) -> fp8kturbov_status_t;
    pub fn fp8kturbov_paged_decode_workspace_bytes(
        params: *const fp8kturbov_decode_params_t,
        workspace_bytes: *mut u64,
    ) -> fp8kturbov_status_t;

    pub fn fp8kturbov_prefill_params_init(params: *mut fp8kturbov_prefill_params_t);
    pub fn fp8kturbov_prefill_params_init_sized(
        params: *mut fp8kturbov_prefill_params_t,
        struct_size: usize,
    ) -> fp8kturbov_status_t;
    pub fn fp8kturbov_paged_prefill_attn(
        params: *const fp8kturbov_prefill_params_t,
        stream: fp8kturbov_stream_t,
    ) -> fp8kturbov_status_t;
    pub fn fp8kturbov_paged_prefill_workspace_bytes(
        params: *const fp8kturbov_prefill_params_t,
        workspace_bytes: *mut u64,
    ) -> fp8kturbov_status_t;

    pub fn fp8kturbov_dequantize_params_init(params: *mut fp8kturbov_dequantize_params_t);
    pub fn fp8kturbov_dequantize_params_init_sized(
        params: *mut fp8kturbov_dequantize_params_t,
        struct_size: usize,
    ) -> fp8kturbov_status_t;
    pub fn fp8kturbov_dequantize(
        params: *const fp8kturbov_dequantize_params_t,
        stream: fp8kturbov_stream_t,
    ) -> fp8kturbov_status_t;
}

/// The fixed-argument launchers of the original engine, one per V width (V bits in the name).
macro_rules! declare_fixed_launchers {
    ($($write:ident, $decode:ident;)*) => {
        extern "C" {
            $(
                pub fn $write(
                    key: *const c_void,
                    value: *const c_void,
                    k_cache: *mut c_void,
                    v_cache: *mut c_void,
                    slot_mapping: *const i64,
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
                    stream: fp8kturbov_stream_t,
                ) -> fp8kturbov_status_t;

                pub fn $decode(
                    q: *const c_void,
                    k_cache: *const c_void,
                    v_cache: *const c_void,
                    output: *mut c_void,
                    block_tables: *const i32,
                    seq_lens: *const i32,
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
                    stream: fp8kturbov_stream_t,
                ) -> fp8kturbov_status_t;
            )*
        }
    };
}
declare_fixed_launchers! {
    fp8kturbov_reshape_and_cache_fp8k_turbo2v, fp8kturbov_paged_decode_attn_fp8k_turbo2v;
    fp8kturbov_reshape_and_cache_fp8k_turbo3v, fp8kturbov_paged_decode_attn_fp8k_turbo3v;
    fp8kturbov_reshape_and_cache_fp8k_turbo4v, fp8kturbov_paged_decode_attn_fp8k_turbo4v;
}
