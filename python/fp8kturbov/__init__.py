"""fp8kturbov: a paged KV cache with FP8 E4M3 keys and TurboQuant 2/3/4-bit values.

The raw-pointer launchers mirror the C ABI one to one (``reshape_and_cache_fp8k_turbo3v``,
``paged_decode_attn_fp8k_turbo3v``, ``dequantize``, ...); ``CacheLayout`` gives the pool sizes and
strides; the tensor-level ``write_kv`` / ``paged_decode`` / ``dequantize_kv`` take torch, CuPy,
``__cuda_array_interface__`` or DLPack arrays and a ``KVCache``; the NumPy reference of the byte
format is ``fp8kturbov.reference`` (needs ``ml-dtypes``). ``calibrate_k_scale``,
``bytes_per_token``, ``tokens_that_fit`` and ``capacity_table`` (from ``fp8kturbov.planning``)
size an engine's cache. Checked mode (``KVCache(checked=True)``, or ``num_blocks`` and
``error_flags`` on the raw launchers) makes the kernels skip and report out-of-range slots and page
ids: ``ErrorWord``, ``check_errors`` and ``CacheIndexError`` (from ``fp8kturbov.checked``).

Importing the package needs no built library: it is loaded by the first call that needs it.
"""

from ._errors import (
    ArgumentError,
    BadStructSizeError,
    CacheIndexError,
    CudaError,
    Fp8kturbovError,
    IndexErrorFlags,
    InvalidValueError,
    MisalignedError,
    NotSupportedError,
    NullPointerError,
    Status,
)
from ._device import DeviceBuffer, stream_handle
from ._lib import ABI_VERSION, VEncoder, VRotation, library_path, version
from .arrays import dequantize_kv, paged_decode, paged_prefill, write_kv
from .cache import KVCache
from .checked import ErrorWord, check_errors
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
    paged_prefill_attn,
    paged_prefill_workspace_bytes,
    reshape_and_cache,
    reshape_and_cache_fp8k_turbo2v,
    reshape_and_cache_fp8k_turbo3v,
    reshape_and_cache_fp8k_turbo4v,
)

__all__ = [
    "ABI_VERSION", "ArgumentError", "BadStructSizeError", "CacheIndexError", "CacheLayout",
    "CudaError", "DeviceBuffer", "ErrorWord", "Fp8kturbovError", "IndexErrorFlags",
    "InvalidValueError", "KVCache", "MisalignedError", "NotSupportedError", "NullPointerError",
    "Status", "VEncoder", "VRotation", "check_errors", "dequantize", "dequantize_kv",
    "library_path", "paged_decode", "paged_decode_attn", "paged_decode_attn_fp8k_turbo2v",
    "paged_decode_attn_fp8k_turbo3v", "paged_decode_attn_fp8k_turbo4v",
    "paged_decode_workspace_bytes", "paged_prefill", "paged_prefill_attn", "paged_prefill_workspace_bytes",
    "reshape_and_cache",
    "reshape_and_cache_fp8k_turbo2v", "reshape_and_cache_fp8k_turbo3v",
    "reshape_and_cache_fp8k_turbo4v", "stream_handle", "version", "write_kv",
    "CapacityPlan", "bytes_per_token", "calibrate_k_scale", "capacity_table", "tokens_that_fit",
]


def __getattr__(name: str) -> str:
    # ``__version__`` is looked up on first use (`package_version`), so that the import reads
    # neither metadata nor the library.
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ._lib import package_version

    try:
        found = package_version()
    except (ImportError, OSError) as exc:  # no metadata, no header, and the library won't load
        raise AttributeError(f"fp8kturbov.__version__ is unknown: {exc}") from exc
    globals()["__version__"] = found
    return found
