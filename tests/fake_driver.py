"""A fake ``cuda.bindings.driver`` for CPU tests of the package's driver bookkeeping
(fp8kturbov._device and its users); conftest's ``driver`` fixture installs it."""

from __future__ import annotations

import ctypes
import itertools
import struct
from types import SimpleNamespace


class FakeDriver:
    """The cuda.bindings.driver calls the package makes, answering like the real ones (a tuple
    ``(CUresult, *values)``), keeping a context stack, primary-context references, live
    allocations with their bytes, and a log of stream operations. Memory operations need a
    current context, as the real ones do; their log entries name its device."""

    class CUresult:
        CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_CONTEXT = 0, 1, 201

    CUpointer_attribute = SimpleNamespace(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL=9)
    CUevent_flags = SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
    CUstream = int
    GARBAGE = 0xA5  # what new allocations hold: cuMemAlloc does not initialise

    def __init__(self) -> None:
        self.stack: list[int] = []            # devices of the current-context stack
        self.references = {0: 0, 1: 0}        # primary-context references per device
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (bytes, device current at allocation)
        self.memory: dict[int, bytearray] = {}      # ptr -> the allocation's bytes
        self.log: list[tuple] = []
        # ptr -> (CUresult, ordinal) of addresses that are not live allocations
        self.pointer_devices: dict[int, tuple[int, int]] = {}
        self._next = itertools.count(0x1000, 0x1000)

    def word(self, ptr: int) -> int:
        """The uint32 at the start of the allocation ``ptr``."""
        return struct.unpack_from("<I", self.memory[ptr])[0]

    def set_word(self, ptr: int, value: int) -> None:
        """What a kernel's atomicOr leaves in the word: ``value`` ORed in."""
        struct.pack_into("<I", self.memory[ptr], 0, self.word(ptr) | value)

    def cuDeviceGet(self, ordinal):
        return (0, ordinal)

    def cuDevicePrimaryCtxRetain(self, device):
        self.references[device] += 1
        return (0, device)

    def cuDevicePrimaryCtxRelease(self, device):
        self.references[device] -= 1
        return (0,)

    def cuCtxPushCurrent(self, context):
        self.stack.append(context)
        return (0,)

    def cuCtxPopCurrent(self):
        return (0, self.stack.pop())

    def cuCtxGetDevice(self):
        return (0, self.stack[-1]) if self.stack else (self.CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)

    def cuMemAlloc(self, nbytes):
        ptr = next(self._next)
        self.live[ptr] = (nbytes, self.stack[-1])
        self.memory[ptr] = bytearray([self.GARBAGE]) * nbytes
        return (0, ptr)

    def cuMemFree(self, ptr):
        del self.live[ptr]
        del self.memory[ptr]
        return (0,)

    def _stream_operation(self, name: str, stream: int, ptr: int | None = None) -> tuple | None:
        """Log it; the error a real driver would give (no context, unknown memory) or None."""
        if not self.stack:
            return (self.CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if ptr is not None and ptr not in self.memory:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.log.append((name, stream, self.stack[-1]))
        return None

    def cuMemsetD32Async(self, ptr, value, count, stream):
        refused = self._stream_operation("memset", stream, ptr)
        if refused:
            return refused
        self.memory[ptr][:4 * count] = struct.pack("<I", value) * count
        return (0,)

    def cuMemcpyDtoHAsync(self, host_address, ptr, nbytes, stream):
        refused = self._stream_operation("copy", stream, ptr)
        if refused:
            return refused
        ctypes.memmove(host_address, bytes(self.memory[ptr][:nbytes]), nbytes)
        return (0,)

    def cuStreamSynchronize(self, stream):
        return self._stream_operation("sync", stream) or (0,)

    def cuEventCreate(self, flags):
        self.log.append(("create", flags))
        return (0, "event")

    def cuEventRecord(self, event, stream):
        self.log.append(("record", stream))
        return (0,)

    def cuStreamWaitEvent(self, stream, event, flags):
        self.log.append(("wait", stream))
        return (0,)

    def cuEventDestroy(self, event):
        self.log.append(("destroy",))
        return (0,)

    def cuPointerGetAttribute(self, attribute, ptr):
        if ptr in self.pointer_devices:
            return self.pointer_devices[ptr]
        if ptr in self.live:
            return (0, self.live[ptr][1])
        return (self.CUresult.CUDA_ERROR_INVALID_VALUE, 0)

    def cuGetErrorName(self, err):
        return (0, f"CUDA_ERROR_{err}".encode())
