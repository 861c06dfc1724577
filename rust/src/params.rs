//! Builders for the four params structs. Each starts from the library's
//! `*_params_init_sized(params, size_of)`, so that the defaults are the library's and a newer
//! library writes exactly this crate's version of the struct; setters take the C field names,
//! device pointers as `u64`.

use std::mem::{size_of, MaybeUninit};

use crate::error::{check, Result};
use crate::layout::CacheLayout;
use crate::sys;
use crate::version::check_abi;

/// `fp8kturbov_v_encoder_t`: how the write picks a group's codes and scale byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum VEncoder {
    /// The original engine's encoder (the default).
    MatchedNorm = sys::FP8KTURBOV_V_ENCODER_MATCHED_NORM,
    /// The scale byte with the least squared error after E4M3 rounding.
    Mse = sys::FP8KTURBOV_V_ENCODER_MSE,
    /// The codes of the least angle to the group, scaled to keep its projection on them.
    Projection = sys::FP8KTURBOV_V_ENCODER_PROJECTION,
}

/// `fp8kturbov_v_rotation_t`: the rotation fused into the write and undone by the decode and the
/// prefill; a cache must be read with the rotation it was written with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum VRotation {
    None = sys::FP8KTURBOV_V_ROTATION_NONE,
    Hadamard = sys::FP8KTURBOV_V_ROTATION_HADAMARD,
}

/// A setter per field: `ptr` fields take a device address as `u64`, the others their C type.
macro_rules! setters {
    ($builder:ident { $($kind:tt $field:ident),* $(,)? }) => {
        impl $builder {
            $( setters!(@one $kind $field); )*
        }
    };
    (@one ptr $field:ident) => {
        #[doc = concat!("Sets `", stringify!($field), "`, a device address (0 = NULL).")]
        pub fn $field(mut self, address: u64) -> Self {
            self.raw.$field = address as usize as _;
            self
        }
    };
    (@one $ty:ident $field:ident) => {
        #[doc = concat!("Sets `", stringify!($field), "` (in the unit its name says).")]
        pub fn $field(mut self, value: $ty) -> Self {
            self.raw.$field = value;
            self
        }
    };
}

/// The builder type around a params struct, its constructor from `init_sized` and the accessors.
macro_rules! builder {
    ($(#[$doc:meta])* $builder:ident, $raw:ty, $init_sized:path) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub struct $builder {
            raw: $raw,
        }

        impl $builder {
            /// The library's defaults. Fails when the library's ABI differs from this crate's, or
            /// (`BadStructSize`) when the library is older than the header this crate mirrors.
            pub fn new() -> Result<Self> {
                check_abi()?;
                let mut raw = MaybeUninit::<$raw>::zeroed();
                // SAFETY: writes at most size_of::<$raw>() bytes into `raw`.
                check(unsafe { $init_sized(raw.as_mut_ptr(), size_of::<$raw>()) })?;
                // SAFETY: zeroed, then filled by the library: every field is initialised.
                Ok(Self { raw: unsafe { raw.assume_init() } })
            }

            /// The C struct, for reading fields or passing it to `sys`.
            pub fn as_raw(&self) -> &$raw {
                &self.raw
            }
        }

        // SAFETY: the pointers are device addresses that the host never dereferences.
        unsafe impl Send for $builder {}
        unsafe impl Sync for $builder {}
    };
}

builder!(
    /// `fp8kturbov_write_params_t`, for [`crate::reshape_and_cache`].
    WriteParams, sys::fp8kturbov_write_params_t, sys::fp8kturbov_write_params_init_sized
);
builder!(
    /// `fp8kturbov_decode_params_t`, for [`crate::paged_decode_attn`] and
    /// [`crate::paged_decode_workspace_bytes`].
    DecodeParams, sys::fp8kturbov_decode_params_t, sys::fp8kturbov_decode_params_init_sized
);
builder!(
    /// `fp8kturbov_prefill_params_t`, for [`crate::paged_prefill_attn`] and
    /// [`crate::paged_prefill_workspace_bytes`].
    PrefillParams, sys::fp8kturbov_prefill_params_t, sys::fp8kturbov_prefill_params_init_sized
);
builder!(
    /// `fp8kturbov_dequantize_params_t`, for [`crate::dequantize`].
    DequantizeParams,
    sys::fp8kturbov_dequantize_params_t,
    sys::fp8kturbov_dequantize_params_init_sized
);

setters!(WriteParams {
    ptr key, ptr value, ptr k_cache, ptr v_cache, ptr slot_mapping,
    u32 num_tokens, u32 num_kv_heads, u32 head_dim, u32 block_size, u32 key_stride,
    u32 value_stride, f32 k_scale, u32 v_bits, u64 k_block_stride_bytes,
    u64 v_block_stride_bytes, u64 v_data_section_bytes, u64 num_blocks, ptr error_flags,
});
setters!(DecodeParams {
    ptr q, ptr k_cache, ptr v_cache, ptr output, ptr block_tables, ptr seq_lens,
    u32 max_blocks_per_seq, u32 num_seqs, u32 num_q_heads, u32 num_kv_heads, u32 head_dim,
    u32 block_size, f32 inv_sqrt_d, f32 k_scale, u32 q_stride, u32 v_bits,
    u64 k_block_stride_bytes, u64 v_block_stride_bytes, u64 v_data_section_bytes,
    u32 sliding_window, f32 sparse_v_threshold, ptr workspace, u64 workspace_bytes,
    u64 num_blocks, ptr error_flags, ptr sinks, f32 soft_cap, ptr query_start, u32 max_q_len,
    u32 num_query_rows, u64 block_tables_stride, ptr append_key, ptr append_value,
    ptr append_slot_mapping, u32 append_key_stride, u32 append_value_stride,
});
setters!(PrefillParams {
    ptr q, ptr k_cache, ptr v_cache, ptr output, ptr lse, ptr block_tables, ptr seq_lens,
    ptr query_start, u32 max_blocks_per_seq, u32 num_seqs, u32 num_q_heads, u32 num_kv_heads,
    u32 head_dim, u32 block_size, f32 inv_sqrt_d, f32 k_scale, u32 q_stride, u32 v_bits,
    u64 k_block_stride_bytes, u64 v_block_stride_bytes, u64 v_data_section_bytes,
    u64 block_tables_stride, u32 sliding_window, f32 soft_cap, ptr sinks, u32 max_q_len,
    u32 num_query_rows, ptr workspace, u64 workspace_bytes, u64 num_blocks, ptr error_flags,
});
setters!(DequantizeParams {
    ptr k_cache, ptr v_cache, ptr slot_mapping, ptr key, ptr value,
    u32 num_tokens, u32 num_kv_heads, u32 head_dim, u32 block_size, u32 key_stride,
    u32 value_stride, f32 k_scale, u32 v_bits, u64 k_block_stride_bytes,
    u64 v_block_stride_bytes, u64 v_data_section_bytes, u64 num_blocks, ptr error_flags,
});

impl WriteParams {
    pub fn v_encoder(mut self, encoder: VEncoder) -> Self {
        self.raw.v_encoder = encoder as u32;
        self
    }
}

impl DecodeParams {
    /// The V encoder of the fused append's tokens.
    pub fn v_encoder(mut self, encoder: VEncoder) -> Self {
        self.raw.v_encoder = encoder as u32;
        self
    }
}

/// The layout fields that every params struct shares, from a [`CacheLayout`].
macro_rules! cache_layout_setter {
    ($($builder:ident),*) => {
        $(impl $builder {
            /// Sets `num_kv_heads`, `head_dim`, `block_size`, `v_bits` and the packed page
            /// strides (`k_block_stride_bytes`, `v_block_stride_bytes`, `v_data_section_bytes`).
            pub fn cache_layout(self, layout: &CacheLayout) -> Self {
                self.num_kv_heads(layout.num_kv_heads())
                    .head_dim(layout.head_dim())
                    .block_size(layout.block_size())
                    .v_bits(layout.v_bits())
                    .k_block_stride_bytes(layout.k_block_stride_bytes())
                    .v_block_stride_bytes(layout.v_block_stride_bytes())
                    .v_data_section_bytes(layout.v_data_section_bytes())
            }
        })*
    };
}
cache_layout_setter!(WriteParams, DecodeParams, PrefillParams, DequantizeParams);

/// The `v_rotation` setter of the params that have the field (all but the dequantize's).
macro_rules! v_rotation_setter {
    ($($builder:ident),*) => {
        $(impl $builder {
            pub fn v_rotation(mut self, rotation: VRotation) -> Self {
                self.raw.v_rotation = rotation as u32;
                self
            }
        })*
    };
}
v_rotation_setter!(WriteParams, DecodeParams, PrefillParams);
