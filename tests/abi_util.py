"""Helpers shared by the ABI tests (test_abi.py, test_fuzz.py, test_dequantize.py): the eight
entry points by name, what may be launched where, and the version-1 params structs."""

from __future__ import annotations

import ctypes
import mmap
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import fp8kturbov
from conftest import gpu_unavailable_reason
from fp8kturbov import Status
from fp8kturbov._lib import lib

HEADER = Path(__file__).resolve().parents[1] / "cuda" / "include" / "fp8kturbov.h"
PROT_NONE = 0  # <sys/mman.h>; Python's mmap module does not export it

#: The exception class each failing status must raise in Python (the package's contract).
EXCEPTIONS = {
    Status.INVALID_VALUE: fp8kturbov.InvalidValueError,
    Status.NULL_POINTER: fp8kturbov.NullPointerError,
    Status.MISALIGNED: fp8kturbov.MisalignedError,
    Status.NOT_SUPPORTED: fp8kturbov.NotSupportedError,
    Status.BAD_STRUCT_SIZE: fp8kturbov.BadStructSizeError,
    Status.CUDA_ERROR: fp8kturbov.CudaError,
}


@dataclass(frozen=True)
class EntryPoint:
    """One of the eight launching entry points: the write or the decode, generic or fixed-bit."""

    op: str                  # "write" or "decode"
    bits: int | None = None  # None: the generic entry point taking a params struct

    @property
    def name(self) -> str:
        base = "reshape_and_cache" if self.op == "write" else "paged_decode_attn"
        return base if self.bits is None else f"{base}_fp8k_turbo{self.bits}v"

    @property
    def c_name(self) -> str:
        return f"fp8kturbov_{self.name}"

    def __str__(self) -> str:
        return self.name


def no_gpu() -> bool:
    """True only where conftest found no usable GPU *and* could have found one (cuda.bindings
    imports): only then may a call launch on fake pointers."""
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return gpu_unavailable_reason() is not None


def last_error() -> str:
    return lib.fp8kturbov_last_error_message().decode()


def old_struct_sizes(op: str) -> list[int]:
    """``FP8KTURBOV_<OP>_PARAMS_V<n>_SIZE`` of the header, n = 1, 2, ... (op "write", "decode" or
    "dequantize"): the sizes of the earlier versions of a params struct, still accepted (version
    1 = library 0.1, before the checked-mode fields)."""
    if not HEADER.exists():
        pytest.skip(f"{HEADER} not found (tests run from a checkout)")
    code = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    found = dict(re.findall(rf"#define\s+FP8KTURBOV_{op.upper()}_PARAMS_V(\d+)_SIZE\s+(\d+)", code))
    return [int(found[str(v)]) for v in range(1, len(found) + 1)]


def v1_struct_size(op: str) -> int:
    return old_struct_sizes(op)[0]


def struct_before_an_unreadable_page(params: ctypes.Structure, nbytes: int) -> tuple[Any, mmap.mmap]:
    """A copy of the first ``nbytes`` bytes of ``params`` ending at the last readable byte: the
    page after it is PROT_NONE, so reading past ``nbytes`` faults. Returns a pointer to the copy
    (of ``params``'s type) and the mapping holding it, to keep alive while the pointer is used."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    mapping = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    assert libc.mprotect(base + page, page, PROT_NONE) == 0, ctypes.get_errno()
    address = base + page - nbytes
    ctypes.memmove(address, ctypes.addressof(params), nbytes)
    return ctypes.cast(address, ctypes.POINTER(type(params))), mapping
