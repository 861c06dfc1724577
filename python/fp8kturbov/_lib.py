"""Loads ``libfp8kturbov.so`` on first use, checks its ABI version, then binds every C signature.

Importing this module needs no library: `library()` (or the ``lib`` attribute) loads it once, on
the first call that needs it; the load's errors are ImportError, naming ``FP8KTURBOV_LIBRARY``
where it chose the file: no library beside the package, no such file, a file that does not load
as a shared library, a too old driver, another ABI, a library lacking one of the functions.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import importlib.metadata
import os
import re
import sys
import threading
from typing import Any
from pathlib import Path

from ._device import driver_version
from ._errors import Status, error_for
from ._limits import ROTATION_HEAD_DIMS  # noqa: F401  (importable from here, as before)

#: The ABI this package was written against (``FP8KTURBOV_ABI_VERSION`` of the header).
ABI_VERSION = 1
LIBRARY_NAME = "libfp8kturbov.so"
LIBRARY_ENV = "FP8KTURBOV_LIBRARY"
HEADER_NAME = "fp8kturbov.h"
#: Set to 1 to load the library whatever the driver (the load's driver check is skipped).
SKIP_DRIVER_CHECK_ENV = "FP8KTURBOV_SKIP_DRIVER_CHECK"
#: The oldest Linux driver branch of each CUDA major (minor-version compatibility within a major).
MIN_DRIVER_BRANCH = {12: 525, 13: 580}
#: The distributions that install this package: a plain build, and the wheels of each CUDA major.
DISTRIBUTION_NAMES = ("fp8kturbov", *(f"fp8kturbov-cu{major}" for major in sorted(MIN_DRIVER_BRANCH)))

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
    PROJECTION = 2


class VRotation(enum.IntEnum):
    """Mirror of ``fp8kturbov_v_rotation_t``: the optional V rotation of FORMAT.md §6, fused into
    the write (each V head rotated before it is quantised) and the decode (outputs rotated back);
    head_dim in ``ROTATION_HEAD_DIMS``. A cache written rotated must be decoded rotated."""

    NONE = 0
    HADAMARD = 1


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
        ("append_key", _ptr),
        ("append_value", _ptr),
        ("append_slot_mapping", _ptr),
        ("append_key_stride", _u32),
        ("append_value_stride", _u32),
        ("v_encoder", _u32),
    ]


class PrefillParams(ctypes.Structure):
    """Mirror of ``fp8kturbov_prefill_params_t``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("q", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("output", _ptr),
        ("lse", _ptr),
        ("block_tables", _ptr),
        ("seq_lens", _ptr),
        ("query_start", _ptr),
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
        ("block_tables_stride", _u64),
        ("sliding_window", _u32),
        ("soft_cap", _f32),
        ("sinks", _ptr),
        ("v_rotation", _u32),
        ("max_q_len", _u32),
        ("num_query_rows", _u32),
        ("workspace", _ptr),
        ("workspace_bytes", _u64),
        ("num_blocks", _u64),
        ("error_flags", _ptr),
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
    "fp8kturbov_cuda_runtime_version": (ctypes.c_int, []),
    "fp8kturbov_build_commit": (ctypes.c_char_p, []),
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
    "fp8kturbov_prefill_params_init": (None, [ctypes.POINTER(PrefillParams)]),
    "fp8kturbov_prefill_params_init_sized": (_status, [ctypes.POINTER(PrefillParams), ctypes.c_size_t]),
    "fp8kturbov_paged_prefill_attn": (_status, [ctypes.POINTER(PrefillParams), _ptr]),
    "fp8kturbov_paged_prefill_workspace_bytes": (
        _status, [ctypes.POINTER(PrefillParams), ctypes.POINTER(_u64)]),
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


@functools.cache
def providing_distribution() -> importlib.metadata.Distribution | None:
    """The installed distribution whose files hold this very package, or None (a source tree, a
    copied package): one of the same name elsewhere on the path (an older install beside a
    checkout) does not count."""
    here = Path(__file__).resolve()
    for name in DISTRIBUTION_NAMES:
        try:
            distribution = importlib.metadata.distribution(name)
            if Path(str(distribution.locate_file("fp8kturbov/_lib.py"))).resolve() == here:
                return distribution
        except Exception:
            continue
    return None


def cuda_runtime_major(loaded: ctypes.CDLL, path: Path) -> tuple[int, str]:
    """The CUDA major of the runtime the library at ``path`` was built with (its
    ``fp8kturbov_cuda_runtime_version``), and a description naming the release for messages."""
    release = _bound(loaded, path, "fp8kturbov_cuda_runtime_version")()
    major, minor = release // 1000, release % 1000 // 10
    return major, f"{path.name} (built with CUDA {major}.{minor})"


def check_driver(required: tuple[int, str]) -> None:
    """Raise ImportError where a CUDA driver is present but older than ``required``, the library's
    CUDA major and its description (`cuda_runtime_major`). No driver or
    ``FP8KTURBOV_SKIP_DRIVER_CHECK=1``: nothing is checked."""
    if os.environ.get(SKIP_DRIVER_CHECK_ENV, "") not in ("", "0"):
        return
    found = driver_version()
    if found is None:
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


def _source(path: Path) -> str:
    """How the library at ``path`` was chosen, for an error message."""
    return f"{LIBRARY_ENV}={os.environ[LIBRARY_ENV]!r}" if os.environ.get(LIBRARY_ENV) else str(path)


def _bound(loaded: ctypes.CDLL, path: Path, name: str) -> Any:
    """``loaded``'s function ``name`` with its `SIGNATURES` types; ImportError where it lacks it."""
    try:
        function = getattr(loaded, name)
    except AttributeError:
        raise ImportError(f"{_source(path)} is not the fp8kturbov library this package needs (ABI "
                          f"version {ABI_VERSION}): it has no symbol {name}") from None
    function.restype, function.argtypes = SIGNATURES[name]
    return function


def _load() -> ctypes.CDLL:
    path = library_path()
    if not path.is_file():
        raise ImportError(f"{_source(path)}: {'not a file' if path.exists() else 'no such file'}")
    try:
        loaded = ctypes.CDLL(str(path))
    except OSError as exc:
        raise ImportError(f"{_source(path)} does not load as a shared library: {exc}") from None
    # The ABI version first: a library of another ABI may lack symbols or declare them otherwise.
    found = _bound(loaded, path, "fp8kturbov_abi_version")()
    if found != ABI_VERSION:
        raise ImportError(f"{_source(path)} has ABI version {found}, this package needs {ABI_VERSION}")
    # Loading touches no CUDA (the static runtime starts on the first launch), so the driver is
    # checked against the runtime the library itself reports before anything runs.
    check_driver(cuda_runtime_major(loaded, path))
    for name in SIGNATURES:
        _bound(loaded, path, name)
    return loaded


_loaded: ctypes.CDLL | None = None
_load_lock = threading.Lock()


def library() -> ctypes.CDLL:
    """The library with every signature of `SIGNATURES` bound, loaded on the first call."""
    global _loaded
    if _loaded is None:
        with _load_lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded


def __getattr__(name: str) -> object:
    if name == "lib":  # ``_lib.lib``: the loaded library
        return library()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check(status: int) -> None:
    """Raise the exception of a failed call, with the C library's detail message."""
    if status != Status.SUCCESS:
        message = library().fp8kturbov_last_error_message().decode("utf-8", "replace")
        raise error_for(status, message)


def version() -> str:
    """The library version as ``major.minor.patch`` (loads the library)."""
    v = library().fp8kturbov_version()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def cuda_runtime_version() -> str:
    """The CUDA runtime the library was built with, as ``major.minor`` (loads the library)."""
    release = library().fp8kturbov_cuda_runtime_version()
    return f"{release // 1000}.{release % 1000 // 10}"


def build_commit() -> str | None:
    """The source commit the library was built from (``-dirty`` with uncommitted changes), baked
    in at build time; None where the build had none (loads the library)."""
    commit = library().fp8kturbov_build_commit().decode("ascii", "replace")
    return None if commit == "unknown" else commit


_HEADER_VERSION = re.compile(r"^#define FP8KTURBOV_VERSION_(MAJOR|MINOR|PATCH) (\d+)$", re.M)


def header_version(header: Path) -> str | None:
    """``major.minor.patch`` from the version macros of a copy of the header (what CMake and
    pyproject.toml read too); None where it lacks one of them."""
    parts = dict(_HEADER_VERSION.findall(header.read_text()))
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}" if len(parts) == 3 else None


def package_version() -> str:
    """This package's version (``fp8kturbov.__version__``), the header's version macros in the
    end: the metadata of the distribution that installed it; else the header beside the package
    (a wheel's ``include/``, a checkout's ``cuda/include/``); else the library's `version`."""
    distribution = providing_distribution()
    if distribution is not None:
        return distribution.version
    package = Path(__file__).resolve().parent
    for header in (package / "include" / HEADER_NAME, package.parents[1] / "cuda" / "include" / HEADER_NAME):
        if header.is_file() and (found := header_version(header)) is not None:
            return found
    return version()
