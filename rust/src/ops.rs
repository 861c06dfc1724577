//! The generic entry points, taking a params builder and a stream (`CUstream` / `cudaStream_t`
//! as `u64`, 0 = the legacy default stream).
//!
//! The launches are `unsafe`: the kernels read and write wherever the params' device addresses
//! point, which nothing on the host can check. (The ABI was checked when the params were built.)

use crate::error::{check, Result};
use crate::params::{DecodeParams, DequantizeParams, PrefillParams, WriteParams};
use crate::sys;

pub(crate) fn stream_handle(stream: u64) -> sys::fp8kturbov_stream_t {
    stream as usize as sys::fp8kturbov_stream_t
}

/// Writes `num_tokens` K and V rows into the pools (`fp8kturbov_reshape_and_cache`).
///
/// # Safety
/// Every address in `params` is a device allocation of the size the header gives it (in checked
/// mode out-of-range slots are skipped), not used concurrently in a conflicting way, and
/// `stream` is a valid stream of the current device or 0.
pub unsafe fn reshape_and_cache(params: &WriteParams, stream: u64) -> Result<()> {
    check(sys::fp8kturbov_reshape_and_cache(params.as_raw(), stream_handle(stream)))
}

/// Paged decode attention (`fp8kturbov_paged_decode_attn`).
///
/// # Safety
/// As for [`reshape_and_cache`]; the block tables' attended entries are pages inside the pools
/// (unless checked mode is on) and the workspace, if any, is not used by another stream.
pub unsafe fn paged_decode_attn(params: &DecodeParams, stream: u64) -> Result<()> {
    check(sys::fp8kturbov_paged_decode_attn(params.as_raw(), stream_handle(stream)))
}

/// The workspace bytes with which `params` runs its full split plan on the current device (0
/// when a split would not help). A host query: the params' pointers are not read.
pub fn paged_decode_workspace_bytes(params: &DecodeParams) -> Result<u64> {
    let mut bytes = 0u64;
    // SAFETY: reads the params struct and writes one u64 on the host.
    check(unsafe { sys::fp8kturbov_paged_decode_workspace_bytes(params.as_raw(), &mut bytes) })?;
    Ok(bytes)
}

/// Paged prefill attention (`fp8kturbov_paged_prefill_attn`): each sequence's chunk of query
/// rows, `query_start[s] .. query_start[s + 1] - 1`, attends its cached positions causally (the
/// chunk's own K and V written first, by [`reshape_and_cache`]); `lse`, if set, receives each
/// row's log-sum-exp for merging with another attention.
///
/// # Safety
/// As for [`paged_decode_attn`]; `query_start` holds `num_seqs + 1` entries, and `q`, `output`
/// and `lse` (if set) hold `num_query_rows` rows.
pub unsafe fn paged_prefill_attn(params: &PrefillParams, stream: u64) -> Result<()> {
    check(sys::fp8kturbov_paged_prefill_attn(params.as_raw(), stream_handle(stream)))
}

/// The workspace bytes that `params` needs on the current device. A host query: the params'
/// pointers are not read.
pub fn paged_prefill_workspace_bytes(params: &PrefillParams) -> Result<u64> {
    let mut bytes = 0u64;
    // SAFETY: reads the params struct and writes one u64 on the host.
    check(unsafe { sys::fp8kturbov_paged_prefill_workspace_bytes(params.as_raw(), &mut bytes) })?;
    Ok(bytes)
}

/// Reads slots of the pools back into bf16 rows (`fp8kturbov_dequantize`).
///
/// # Safety
/// As for [`reshape_and_cache`].
pub unsafe fn dequantize(params: &DequantizeParams, stream: u64) -> Result<()> {
    check(sys::fp8kturbov_dequantize(params.as_raw(), stream_handle(stream)))
}
