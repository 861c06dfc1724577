"""fp8kturbov: a paged KV cache with FP8 E4M3 keys and TurboQuant 2/3/4-bit values.

The raw-pointer launchers mirror the C ABI one to one (``reshape_and_cache_fp8k_turbo3v``,
``paged_decode_attn_fp8k_turbo3v``, ``dequantize``, ...); ``CacheLayout`` gives the pool sizes and
strides; the tensor-level ``write_kv`` / ``paged_decode`` / ``dequantize_kv`` take torch, CuPy,
``__cuda_array_interface__`` or DLPack arrays and a ``KVCache``; the NumPy reference of the byte
format is ``fp8kturbov.reference`` (needs ``ml-dtypes``). ``calibrate_k_scale``,
``bytes_per_token``, ``tokens_that_fit`` and ``capacity_table`` (from ``fp8kturbov.planning``)
size an engine's cache.
"""

from ._errors import (
    BadStructSizeError,
    CudaError,
    Fp8kturbovError,
    InvalidValueError,
    MisalignedError,
    NotSupportedError,
    NullPointerError,
    Status,
)
from ._lib import ABI_VERSION, library_path, version
from .arrays import ArgumentError, DeviceBuffer, KVCache, dequantize_kv, paged_decode, write_kv
from .layout import CacheLayout
from .planning import (CapacityPlan, bytes_per_token, calibrate_k_scale, capacity_table,
                       tokens_that_fit)
from .ops import (
    dequantize,
    paged_decode_attn,
    paged_decode_attn_fp8k_turbo2v,
    paged_decode_attn_fp8k_turbo3v,
    paged_decode_attn_fp8k_turbo4v,
    paged_decode_workspace_bytes,
    reshape_and_cache,
    reshape_and_cache_fp8k_turbo2v,
    reshape_and_cache_fp8k_turbo3v,
    reshape_and_cache_fp8k_turbo4v,
    stream_handle,
)

__version__ = "0.1.0"

__all__ = [
    "ABI_VERSION", "ArgumentError", "BadStructSizeError", "CacheLayout", "CudaError",
    "DeviceBuffer", "Fp8kturbovError", "InvalidValueError", "KVCache", "MisalignedError",
    "NotSupportedError", "NullPointerError", "Status", "dequantize", "dequantize_kv",
    "library_path", "paged_decode", "paged_decode_attn", "paged_decode_attn_fp8k_turbo2v",
    "paged_decode_attn_fp8k_turbo3v", "paged_decode_attn_fp8k_turbo4v",
    "paged_decode_workspace_bytes", "reshape_and_cache",
    "reshape_and_cache_fp8k_turbo2v", "reshape_and_cache_fp8k_turbo3v",
    "reshape_and_cache_fp8k_turbo4v", "stream_handle", "version", "write_kv",
    "CapacityPlan", "bytes_per_token", "calibrate_k_scale", "capacity_table", "tokens_that_fit",
]
