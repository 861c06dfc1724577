"""Helpers shared by the ABI tests (test_abi.py, test_fuzz.py): the eight entry points by name,
and what may be launched where."""

from __future__ import annotations

from dataclasses import dataclass

import fp8kturbov
from conftest import gpu_unavailable_reason
from fp8kturbov import Status
from fp8kturbov._lib import lib

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
