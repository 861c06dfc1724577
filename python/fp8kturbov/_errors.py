"""Status codes of the C library and the exceptions they map to."""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """Mirror of ``fp8kturbov_status_t`` (values are append-only)."""

    SUCCESS = 0
    INVALID_VALUE = 1
    NULL_POINTER = 2
    MISALIGNED = 3
    NOT_SUPPORTED = 4
    BAD_STRUCT_SIZE = 5
    CUDA_ERROR = 6


class Fp8kturbovError(RuntimeError):
    """A call into the library failed; ``status`` is the C status, the text its detail message."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


class InvalidValueError(Fp8kturbovError, ValueError):
    """A scalar argument is out of its range."""


class NullPointerError(Fp8kturbovError, ValueError):
    """A required pointer is 0 while there is work to do."""


class MisalignedError(Fp8kturbovError, ValueError):
    """A pointer or stride breaks an alignment rule."""


class NotSupportedError(Fp8kturbovError, NotImplementedError):
    """The configuration was not built into this library."""


class BadStructSizeError(Fp8kturbovError):
    """The parameter struct of the caller does not match the library's."""


class CudaError(Fp8kturbovError):
    """The CUDA runtime refused the launch (no device, bad stream, ...)."""


_EXCEPTIONS: dict[Status, type[Fp8kturbovError]] = {
    Status.INVALID_VALUE: InvalidValueError,
    Status.NULL_POINTER: NullPointerError,
    Status.MISALIGNED: MisalignedError,
    Status.NOT_SUPPORTED: NotSupportedError,
    Status.BAD_STRUCT_SIZE: BadStructSizeError,
    Status.CUDA_ERROR: CudaError,
}


def error_for(status: int, message: str) -> Fp8kturbovError:
    """The exception for a non-success status code."""
    try:
        known = Status(status)
    except ValueError:
        return Fp8kturbovError(Status.CUDA_ERROR, f"unknown status {status}: {message}")
    return _EXCEPTIONS.get(known, Fp8kturbovError)(known, message)
