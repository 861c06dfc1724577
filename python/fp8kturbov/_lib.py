"""Loads ``libfp8kturbov.so`` once, declares every C signature and checks the ABI version."""

from __future__ import annotations

import ctypes
import enum
import importlib.metadata
import mmap
import os
import re
import sys
from pathlib import Path

from ._errors import Status, error_for

#: The ABI this package was written against (``FP8KTURBOV_ABI_VERSION`` of the header).
ABI_VERSION = 1
LIBRARY_NAME = "libfp8kturbov.so"
LIBRARY_ENV = "FP8KTURBOV_LIBRARY"
#: Set to 1 to load the library whatever the driver (the import-time driver check is skipped).
SKIP_DRIVER_CHECK_ENV = "FP8KTURBOV_SKIP_DRIVER_CHECK"
#: The oldest Linux driver branch of each CUDA major (minor-version compatibility within a major).
MIN_DRIVER_BRANCH = {12: 525, 13: 580}

_u32 = ctypes.c_uint32
_u64 = ctypes.c_uint64
_f32 = ctypes.c_float
_ptr = ctypes.c_void_p
_status = ctypes.c_int


class WriteParams(ctypes.Structure):
    """Mirror of ``fp8kturbov_write_params_t``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("key", _ptr),
        ("value", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("slot_mapping", _ptr),
        ("num_tokens", _u32),
        ("num_kv_heads", _u32),
        ("head_dim", _u32),
        ("block_size", _u32),
        ("key_stride", _u32),
        ("value_stride", _u32),
        ("k_scale", _f32),
        ("v_bits", _u32),
        ("k_block_stride_bytes", _u64),
        ("v_block_stride_bytes", _u64),
        ("v_data_section_bytes", _u64),
        ("num_blocks", _u64),
        ("error_flags", _ptr),
        ("v_encoder", _u32),
        ("v_rotation", _u32),
    ]


class VEncoder(enum.IntEnum):
    """Mirror of ``fp8kturbov_v_encoder_t``: how the write encodes V (same bytes format and decoder
    either way); the lower-case names are the reference's ``encode_v(encoder=...)``."""

    MATCHED_NORM = 0
    MSE = 1


class VRotation(enum.IntEnum):
    """Mirror of ``fp8kturbov_v_rotation_t``: the optional V rotation of FORMAT.md §6, fused into
    the write (each V head rotated before it is quantised) and the decode (outputs rotated back);
    head_dim 128, 256 or 512. A cache written rotated must be decoded rotated."""

    NONE = 0
    HADAMARD = 1


ROTATION_HEAD_DIMS = (128, 256, 512)
"""The head dims the library accepts with ``VRotation.HADAMARD`` (those FORMAT.md §6 gives signs
for; ``reference.ROTATION_DIMS``, which needs ml-dtypes)."""


class DecodeParams(ctypes.Structure):
    """Mirror of ``fp8kturbov_decode_params_t``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("q", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("output", _ptr),
        ("block_tables", _ptr),
        ("seq_lens", _ptr),
        ("max_blocks_per_seq", _u32),
        ("num_seqs", _u32),
        ("num_q_heads", _u32),
        ("num_kv_heads", _u32),
        ("head_dim", _u32),
        ("block_size", _u32),
        ("inv_sqrt_d", _f32),
        ("k_scale", _f32),
        ("q_stride", _u32),
        ("v_bits", _u32),
        ("k_block_stride_bytes", _u64),
        ("v_block_stride_bytes", _u64),
        ("v_data_section_bytes", _u64),
        ("sliding_window", _u32),
        ("sparse_v_threshold", _f32),
        ("workspace", _ptr),
        ("workspace_bytes", _u64),
        ("num_blocks", _u64),
        ("error_flags", _ptr),
        ("sinks", _ptr),
        ("soft_cap", _f32),
        ("query_start", _ptr),
        ("max_q_len", _u32),
        ("num_query_rows", _u32),
        ("v_rotation", _u32),
        ("block_tables_stride", _u64),
    ]


class DequantizeParams(ctypes.Structure):
    """Mirror of ``fp8kturbov_dequantize_params_t``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("slot_mapping", _ptr),
        ("key", _ptr),
        ("value", _ptr),
        ("num_tokens", _u32),
        ("num_kv_heads", _u32),
        ("head_dim", _u32),
        ("block_size", _u32),
        ("key_stride", _u32),
        ("value_stride", _u32),
        ("k_scale", _f32),
        ("v_bits", _u32),
        ("k_block_stride_bytes", _u64),
        ("v_block_stride_bytes", _u64),
        ("v_data_section_bytes", _u64),
        ("num_blocks", _u64),
        ("error_flags", _ptr),
    ]


WRITE_ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _ptr, _u32, _u32, _u32, _u32, _u32, _u32, _f32,
                  _u64, _u64, _u64, _ptr]
DECODE_ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _u32, _u32, _u32, _u32, _u32, _u32,
                   _f32, _f32, _u32, _u64, _u64, _u32, _ptr]

#: Every exported function: name -> (restype, argtypes).
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "fp8kturbov_version": (ctypes.c_int, []),
    "fp8kturbov_abi_version": (ctypes.c_int, []),
    "fp8kturbov_status_string": (ctypes.c_char_p, [_status]),
    "fp8kturbov_last_error_message": (ctypes.c_char_p, []),
    "fp8kturbov_k_page_bytes": (_u64, [_u32, _u32, _u32]),
    "fp8kturbov_v_data_section_bytes": (_u64, [_u32, _u32, _u32, _u32]),
    "fp8kturbov_v_page_bytes": (_u64, [_u32, _u32, _u32, _u32]),
    "fp8kturbov_write_params_init": (None, [ctypes.POINTER(WriteParams)]),
    "fp8kturbov_write_params_init_sized": (_status, [ctypes.POINTER(WriteParams), ctypes.c_size_t]),
    "fp8kturbov_reshape_and_cache": (_status, [ctypes.POINTER(WriteParams), _ptr]),
    "fp8kturbov_decode_params_init": (None, [ctypes.POINTER(DecodeParams)]),
    "fp8kturbov_decode_params_init_sized": (_status, [ctypes.POINTER(DecodeParams), ctypes.c_size_t]),
    "fp8kturbov_paged_decode_attn": (_status, [ctypes.POINTER(DecodeParams), _ptr]),
    "fp8kturbov_paged_decode_workspace_bytes": (
        _status, [ctypes.POINTER(DecodeParams), ctypes.POINTER(_u64)]),
    "fp8kturbov_dequantize_params_init": (None, [ctypes.POINTER(DequantizeParams)]),
    "fp8kturbov_dequantize_params_init_sized": (
        _status, [ctypes.POINTER(DequantizeParams), ctypes.c_size_t]),
    "fp8kturbov_dequantize": (_status, [ctypes.POINTER(DequantizeParams), _ptr]),
    **{f"fp8kturbov_reshape_and_cache_fp8k_turbo{b}v": (_status, WRITE_ARGTYPES) for b in (2, 3, 4)},
    **{f"fp8kturbov_paged_decode_attn_fp8k_turbo{b}v": (_status, DECODE_ARGTYPES) for b in (2, 3, 4)},
}


def library_path() -> Path:
    """Where the shared library is loaded from: ``$FP8KTURBOV_LIBRARY`` or the package folder."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return Path(override)
    package_path = list(sys.modules[__package__].__path__)
    for folder in package_path:
        candidate = Path(folder) / LIBRARY_NAME
        if candidate.exists():
            return candidate
    raise ImportError(
        f"{LIBRARY_NAME} is not in the fp8kturbov package ({', '.join(package_path)}); "
        f"install the package with pip, or point {LIBRARY_ENV} at a built library"
    )


def driver_version() -> int | None:
    """The CUDA driver's version as ``cuDriverGetVersion`` gives it (12040 for 12.4), or None
    where there is no driver (or no cuda.bindings): the library then still loads, for CPU use."""
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
    except Exception:  # cuda.bindings raises when libcuda itself cannot be loaded
        return None
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    return int(version)


def _distribution_major() -> tuple[int, str] | None:
    """The CUDA major from the wheel's distribution name (``fp8kturbov-cu12``/``-cu13``), where
    this package was installed by one of those and loads its own library."""
    if os.environ.get(LIBRARY_ENV):
        return None
    here = Path(__file__).resolve()
    for major in sorted(MIN_DRIVER_BRANCH):
        name = f"fp8kturbov-cu{major}"
        try:
            located = importlib.metadata.distribution(name).locate_file("fp8kturbov/_lib.py")
            if Path(str(located)).resolve() == here:
                return major, name
        except Exception:
            continue
    return None


_NVCC_RELEASE = re.compile(rb"Cuda compilation tools, release (\d+)\.(\d+)")


def _library_major(path: Path) -> tuple[int, str] | None:
    """The CUDA major of the nvcc that built the library: every fatbin entry nvcc writes names
    its toolkit ("Cuda compilation tools, release 13.0"); None if unreadable or not found."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as image:
            found = _NVCC_RELEASE.search(image)
            release = found.group(1, 2) if found else None
    except (OSError, ValueError):
        return None
    if release is None:
        return None
    major, minor = (int(part) for part in release)
    return major, f"{path.name} (built with CUDA {major}.{minor})"


def required_cuda_major(path: Path) -> tuple[int, str] | None:
    """The CUDA major the library needs a driver for, and where that was read; None if unknown."""
    return _distribution_major() or _library_major(path)


def check_driver(path: Path) -> None:
    """Raise ImportError where a CUDA driver is present but older than the library's CUDA major.
    No driver, an unknown requirement or ``FP8KTURBOV_SKIP_DRIVER_CHECK=1``: nothing is checked."""
    if os.environ.get(SKIP_DRIVER_CHECK_ENV, "") not in ("", "0"):
        return
    found = driver_version()
    if found is None:
        return
    try:
        required = required_cuda_major(path)
    except Exception:  # never let the check itself break the import
        required = None
    if required is None:
        return
    major, source = required
    if found // 1000 >= major:
        return
    branch = MIN_DRIVER_BRANCH.get(major)
    newer = f" ({branch} or newer)" if branch else ""
    other = f"fp8kturbov-cu{found // 1000}" if found // 1000 in MIN_DRIVER_BRANCH else None
    hint = f"install {other} or update the NVIDIA driver" if other else "update the NVIDIA driver"
    raise ImportError(
        f"fp8kturbov ({source}) needs a CUDA {major} driver{newer}; found a CUDA "
        f"{found // 1000}.{found % 1000 // 10} driver: {hint} "
        f"(or set {SKIP_DRIVER_CHECK_ENV}=1 to load it anyway)"
    )


def _load() -> ctypes.CDLL:
    check_driver(library_path())
    lib = ctypes.CDLL(str(library_path()))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    found = lib.fp8kturbov_abi_version()
    if found != ABI_VERSION:
        raise ImportError(
            f"{library_path()} has ABI version {found}, this package needs {ABI_VERSION}"
        )
    return lib


lib = _load()


def check(status: int) -> None:
    """Raise the exception of a failed call, with the C library's detail message."""
    if status != Status.SUCCESS:
        message = lib.fp8kturbov_last_error_message().decode("utf-8", "replace")
        raise error_for(status, message)


def version() -> str:
    """The library version as ``major.minor.patch``."""
    v = lib.fp8kturbov_version()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
