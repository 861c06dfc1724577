"""Status codes of the C library, the exceptions they map to, and those of checked mode."""

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


class ArgumentError(InvalidValueError):
    """An array argument is not what the call needs (memory kind, dtype, shape, strides, device).

    ``argument`` is the parameter's name; ``found`` and ``expected`` describe the mismatch."""

    def __init__(self, argument: str, found: str, expected: str) -> None:
        super().__init__(Status.INVALID_VALUE, f"{argument}: {found}, expected {expected}")
        self.argument = argument
        self.found = found
        self.expected = expected


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


class IndexErrorFlags(enum.IntFlag):
    """Mirror of ``fp8kturbov_index_error_t``: the bits checked mode ORs into the caller's error
    word (values are append-only)."""

    SLOT = 1
    BLOCK_TABLE = 2
    SEQ_LEN = 4
    QUERY_START = 8


# What each flag means and what the kernels did about it (the header's comments).
_INDEX_ERROR_MEANINGS: dict[IndexErrorFlags, str] = {
    IndexErrorFlags.SLOT: "a slot's page (slot / block_size) was >= num_blocks, so the write (or the decode's append) "
                          "skipped that token and the dequantize gave it rows of zeros",
    IndexErrorFlags.BLOCK_TABLE: "a block-table entry of an attended position was < 0 or >= "
                                 "num_blocks, so the decode left out that page's positions "
                                 "(neither read nor counted in the softmax)",
    IndexErrorFlags.SEQ_LEN: "a seq_len was < 0 or > max_blocks_per_seq * block_size, so the "
                             "decode clamped it to that range",
    IndexErrorFlags.QUERY_START: "a multi-token decode's query_start was negative or decreasing, "
                                 "or gave a q_len above max_q_len or rows past num_query_rows, so "
                                 "the decode skipped that sequence (its outputs not written); or a "
                                 "q_len above the sequence's seq_len, whose rows were computed by "
                                 "the causal rule (zeros where nothing is attended)",
}
_KNOWN_INDEX_ERRORS = sum(_INDEX_ERROR_MEANINGS)


class CacheIndexError(RuntimeError):
    """Checked mode found indices outside the pools since the error word was last zeroed.

    ``flags`` (:class:`IndexErrorFlags`) says which kinds; the message names each with what the
    kernels did: the out-of-range work was skipped or clamped (a q_len above its seq_len computed
    by the causal rule), never read or written outside the pools or the output. Bits this package
    does not know (from a newer library) are shown in hex."""

    def __init__(self, flags: int) -> None:
        self.flags = IndexErrorFlags(flags)
        found = [f"{flag.name}: {meaning}" for flag, meaning in _INDEX_ERROR_MEANINGS.items()
                 if flag in self.flags]
        unknown = int(self.flags) & ~_KNOWN_INDEX_ERRORS
        if unknown:
            found.append(f"unknown bits {unknown:#x}")
        super().__init__(f"cache index out of range (error flags {int(self.flags):#x}): "
                         + "; ".join(found))
