"""Checked mode: the device word in which the kernels report indices outside the pools.

With ``num_blocks > 0`` (pages per pool) and ``error_flags`` (the device address of a 4-byte
aligned uint32 word) the write, the decode and the dequantize check every page they are about to
touch, skip what is out of range, and OR :class:`~fp8kturbov.IndexErrorFlags` bits into the word
(cuda/include/fp8kturbov.h, "Checked mode"). A launch reports nothing about it: launches never
wait for the device. The caller asks when it chooses, with :meth:`ErrorWord.check` (or
:func:`check_errors` for a word of its own). Those calls and :meth:`ErrorWord.read` make the host
wait for the given stream; apart from creating an :class:`ErrorWord` (once, at setup) nothing else
here waits for the device.

A :class:`~fp8kturbov.KVCache` built with ``checked=True`` owns an :class:`ErrorWord` and passes
it to every launch on the cache; :meth:`KVCache.check_errors` reads it.

Streams: ``None`` (the legacy default stream), an ``int`` handle, a ``CUstream``, an object with
``__cuda_stream__``, or a torch / CuPy stream. Pass the stream the checked launches ran on: a
read sees the work queued on that stream so far, and launches on other streams only once those
are ordered before it (an event).
"""

from __future__ import annotations

import ctypes
from typing import Any

from . import _device
from ._device import DeviceBuffer, cuda_call
from ._errors import CacheIndexError, IndexErrorFlags, MisalignedError, NullPointerError, Status
from ._scalars import pointer

__all__ = ["ErrorWord", "check_errors"]

WORD_BYTES = 4  # one uint32


def _read(driver: Any, ptr: int, stream: int) -> IndexErrorFlags:
    """The word at ``ptr`` once ``stream`` has done the work queued on it so far (the host waits
    for the stream), in the current context."""
    host = ctypes.c_uint32()
    handle = driver.CUstream(stream)
    cuda_call(driver.cuMemcpyDtoHAsync, ctypes.addressof(host), ptr, WORD_BYTES, handle)
    cuda_call(driver.cuStreamSynchronize, handle)
    return IndexErrorFlags(host.value)


def _zero(driver: Any, ptr: int, stream: int) -> None:
    """Zero the word at ``ptr`` in stream order: work queued on ``stream`` afterwards finds 0.
    The host does not wait."""
    cuda_call(driver.cuMemsetD32Async, ptr, 0, 1, driver.CUstream(stream))


def _check(driver: Any, ptr: int, stream: int) -> None:
    """Read the word; if any bit is set, zero it and raise CacheIndexError."""
    flags = _read(driver, ptr, stream)
    if flags:
        _zero(driver, ptr, stream)
        raise CacheIndexError(flags)


class ErrorWord:
    """A zeroed 4-byte (one uint32) error word in device memory of CUDA device ``device``, for
    the ``error_flags`` argument of the launchers.

    ``ptr`` is its device address, ``device`` its CUDA ordinal. Memory and context handling are
    those of :class:`~fp8kturbov.DeviceBuffer` (freed by :meth:`close`, a ``with`` block or
    garbage collection). Creating one waits for the zeroing to finish (a setup cost, once), so
    that every stream finds 0; afterwards only :meth:`read` and :meth:`check` wait for the
    device, and only when called."""

    def __init__(self, device: int = 0) -> None:
        self._buffer = DeviceBuffer(WORD_BYTES, device)
        self.ptr = self._buffer.ptr
        self.device = self._buffer.device
        with _device.primary_context(self.device) as driver:
            _zero(driver, self.ptr, 0)
            # The memset ran on the legacy default stream, which non-blocking streams do not
            # follow: wait for it here rather than on every launch.
            cuda_call(driver.cuStreamSynchronize, driver.CUstream(0))

    @property
    def closed(self) -> bool:
        return self._buffer.closed

    def _live_ptr(self) -> int:
        if self.closed:
            raise ValueError("the ErrorWord is closed")
        return self.ptr

    def read(self, stream: Any = None) -> IndexErrorFlags:
        """The flags set so far, once ``stream`` has done the work queued on it (the host waits
        for that stream). The word is left as it is."""
        ptr, handle = self._live_ptr(), _device.stream_argument(stream)
        with _device.primary_context(self.device) as driver:
            return _read(driver, ptr, handle)

    def check(self, stream: Any = None) -> None:
        """Raise :class:`~fp8kturbov.CacheIndexError` if the launches queued on ``stream`` so
        far set any flag, after zeroing the word for the next ones (stream-ordered on
        ``stream``). The host waits for ``stream``; nothing else synchronises."""
        ptr, handle = self._live_ptr(), _device.stream_argument(stream)
        with _device.primary_context(self.device) as driver:
            _check(driver, ptr, handle)

    def reset(self, stream: Any = None) -> None:
        """Zero the word, ordered on ``stream`` (launches queued there afterwards find 0); the
        host does not wait."""
        ptr, handle = self._live_ptr(), _device.stream_argument(stream)
        with _device.primary_context(self.device) as driver:
            _zero(driver, ptr, handle)

    def close(self) -> None:
        """Free the word (idempotent). Call it once no queued launch uses it any more."""
        self._buffer.close()
        self.ptr = 0

    def __enter__(self) -> ErrorWord:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ErrorWord(device={self.device}, ptr={self.ptr:#x})"


def check_errors(error_flags: int, stream: Any = None) -> None:
    """:meth:`ErrorWord.check` for a word the caller allocated: ``error_flags`` is its device
    address (4-byte aligned, in the context current on this thread). Raises
    :class:`~fp8kturbov.CacheIndexError` if a flag is set, after zeroing the word in stream
    order on ``stream``; the host waits for ``stream``."""
    ptr = pointer("error_flags", error_flags)
    if ptr == 0:
        raise NullPointerError(Status.NULL_POINTER, "error_flags is NULL")
    if ptr % WORD_BYTES:
        raise MisalignedError(Status.MISALIGNED, f"error_flags = {ptr:#x} is not 4-byte aligned")
    _check(_device.require_driver(), ptr, _device.stream_argument(stream))
