"""The benchmark harness's own kernels (``cuda/bench``), in ``libfp8kturbov_bench.so`` beside the
library: a read of device memory with 16-byte loads (the bandwidth ceiling) and an empty kernel
(the launch floor). Both enqueue on a raw ``CUstream`` handle; the library's C ABI does not change.
"""

from __future__ import annotations

import ctypes
import functools

from fp8kturbov._device import BenchError, first_line
from fp8kturbov._lib import library_path

BENCH_LIBRARY_NAME = "libfp8kturbov_bench.so"
READ_CTA_THREADS = 256  # threads per CTA of the read kernel (cuda/bench/bench_kernels.cu)
READ_ALIGNMENT = 16  # bytes: the read kernel's loads


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    path = library_path().with_name(BENCH_LIBRARY_NAME)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise BenchError(f"the bench kernels ({path}) are not loadable: {first_line(exc)}") from None
    lib.fp8kturbov_bench_read.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
                                          ctypes.c_uint32, ctypes.c_void_p]
    lib.fp8kturbov_bench_read.restype = ctypes.c_int
    lib.fp8kturbov_bench_empty.argtypes = [ctypes.c_void_p]
    lib.fp8kturbov_bench_empty.restype = ctypes.c_int
    return lib


def _check(error: int, what: str) -> None:
    if error:
        raise BenchError(f"the {what} kernel's launch failed: cudaError_t {error}")


def read(stream: int, src: int, nbytes: int, sink: int, num_ctas: int) -> None:
    """Enqueue a read of ``nbytes`` (a multiple of 16) at ``src`` (16-byte aligned) by ``num_ctas``
    CTAs; ``sink`` is a writable 4-byte word the kernel may store to."""
    if nbytes % READ_ALIGNMENT or src % READ_ALIGNMENT:
        raise BenchError(f"the read needs 16-byte multiples: {nbytes} bytes at {src:#x}")
    _check(_library().fp8kturbov_bench_read(src, nbytes, sink, num_ctas, stream), "read")


def empty(stream: int) -> None:
    """Enqueue one empty kernel (a CTA of one warp)."""
    _check(_library().fp8kturbov_bench_empty(stream), "empty")
