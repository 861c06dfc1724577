//! Valid arguments for every entry point, shared by the tests: pages of B = 16 tokens, 2 KV heads
//! of D = 128, 4 query heads; NULL pointers and zero work unless a test sets them.
#![allow(dead_code)] // each test crate uses a part

use fp8kturbov::{
    CacheLayout, DecodeParams, DequantizeParams, Error, PrefillParams, Result, Status, WriteParams,
};

pub const B: u32 = 16;
pub const HKV: u32 = 2;
pub const HQ: u32 = 4;
pub const D: u32 = 128;
pub const N: u32 = HKV * D;
pub const INV_SQRT_D: f32 = 0.088388;

pub fn layout(v_bits: u32) -> CacheLayout {
    CacheLayout::new(8, B, HKV, D, v_bits).unwrap()
}

pub fn valid_write() -> WriteParams {
    WriteParams::new().unwrap().cache_layout(&layout(3)).key_stride(N).value_stride(N).k_scale(1.0)
}

/// The fields that the decode and the prefill name alike, valid.
macro_rules! valid_attention {
    ($params:ident) => {
        $params::new()
            .unwrap()
            .cache_layout(&layout(3))
            .max_blocks_per_seq(4)
            .num_q_heads(HQ)
            .inv_sqrt_d(INV_SQRT_D)
            .k_scale(1.0)
            .q_stride(HQ * D)
    };
}

pub fn valid_decode() -> DecodeParams {
    valid_attention!(DecodeParams)
}

pub fn valid_prefill() -> PrefillParams {
    valid_attention!(PrefillParams)
}

pub fn valid_dequantize() -> DequantizeParams {
    DequantizeParams::new()
        .unwrap()
        .cache_layout(&layout(3))
        .key_stride(N)
        .value_stride(N)
        .k_scale(1.0)
}

/// `result` failed with `status`, its message naming `entry` first and holding `text`.
pub fn assert_failure(result: Result<()>, status: Status, entry: &str, text: &str) {
    let err = result.expect_err(text);
    assert_eq!(err.status(), Some(status), "{err}");
    let Error::Status { message, .. } = &err else { unreachable!() };
    assert!(message.starts_with(&format!("{entry}: ")) && message.contains(text), "{err}");
}
