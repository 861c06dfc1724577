"""GPU access through cuda.bindings (driver API), shared by `bench`, `demo` and `info`.

`driver_call` makes one driver call and raises `BenchError` on failure; `Device` holds a GPU's
primary context, the stream every launch goes to, and the memory, events and graphs made
through it. Importing this module needs no GPU: without cuda.bindings ``cu`` is None and
`Device()` reports that as a one-line `BenchError`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import numpy as np

try:
    from cuda.bindings import driver as cu
except ImportError:  # Device() reports it as a one-line error; the GPU-free helpers still work
    cu = None


class BenchError(RuntimeError):
    """A condition that ends the benchmark with a one-line message (no GPU, a CUDA failure, ...);
    the command line's ``demo`` and ``info`` report it the same way."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name where the message is empty."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def check_result(err: Any, function_name: str) -> None:
    """Raise `BenchError` naming ``function_name`` where ``err`` (a CUresult) is not success."""
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise BenchError(f"{function_name} failed: {name.decode() if name else err}")


def driver_call(function: Callable[..., Any], *args: Any) -> Any:
    """Call a cuda.bindings driver function; return its values, raise `BenchError` on failure."""
    result = function(*args)
    err, *values = result if isinstance(result, tuple) else (result,)
    check_result(err, function.__name__)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class Device:
    """GPU ``ordinal``'s primary context (made current on this thread), the stream every launch
    goes to, and the memory, events and graphs made through it. Use as a context manager.

    ``timing_gate=False`` leaves the timing gate (`gate`) off. The host opens the gate only after
    queueing a whole chunk, so under a tool that keeps a launch from returning while its stream
    waits, nothing ever runs: the bench never finished under compute-sanitizer's initcheck."""

    def __init__(self, ordinal: int = 0, timing_gate: bool = True) -> None:
        if cu is None:
            raise BenchError("cuda.bindings is not importable (pip install cuda-python)")
        try:
            (err,) = cu.cuInit(0)
        except Exception as exc:  # cuda.bindings raises when libcuda itself cannot be loaded
            raise BenchError(f"no usable CUDA GPU: {first_line(exc)}") from None
        if err != cu.CUresult.CUDA_SUCCESS:
            raise BenchError(f"no usable CUDA GPU: cuInit failed: {cu.cuGetErrorName(err)[1].decode()}")
        count = driver_call(cu.cuDeviceGetCount)
        if not 0 <= ordinal < count:
            raise BenchError(f"no CUDA device {ordinal} ({count} found)")
        self.ordinal = ordinal
        self.device = driver_call(cu.cuDeviceGet, ordinal)
        self.context = driver_call(cu.cuDevicePrimaryCtxRetain, self.device)
        driver_call(cu.cuCtxSetCurrent, self.context)
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.stream = driver_call(cu.cuStreamCreate, flags)
        self._gate_stream = driver_call(cu.cuStreamCreate, flags)
        self._buffers: list[Any] = []
        self._graphs: list[Any] = []
        self._events: list[Any] = []
        self._gate = self.alloc(4)
        driver_call(cu.cuMemsetD32Async, self._gate, 0, 1, self.stream)  # on `stream`: see `write`
        self._gate_value = 0
        self._geq = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self.gated = False
        if timing_gate:
            # A wait on a value already reached: succeeds at once where stream memory operations
            # are supported, and tells us where they are not.
            (err,) = cu.cuStreamWaitValue32(self.stream, self._gate, 0, self._geq)
            self.gated = err == cu.CUresult.CUDA_SUCCESS
        self.synchronize()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # Queries
    def attribute(self, name: str) -> int:
        """``cuDeviceGetAttribute`` of ``CU_DEVICE_ATTRIBUTE_<name>``."""
        attribute = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        return driver_call(cu.cuDeviceGetAttribute, attribute, self.device)

    @property
    def name(self) -> str:
        return driver_call(cu.cuDeviceGetName, 256, self.device).split(b"\0", 1)[0].decode()

    @property
    def pci_bus_id(self) -> str:
        """The GPU's PCI address as CUDA names it (``0000:3b:00.0``)."""
        return driver_call(cu.cuDeviceGetPCIBusId, 32, self.device).split(b"\0", 1)[0].decode()

    def memory(self) -> tuple[int, int]:
        """``(free, total)`` device memory, bytes."""
        return driver_call(cu.cuMemGetInfo)

    # Memory
    def alloc(self, nbytes: int) -> int:
        """A new device buffer of ``nbytes`` bytes (freed by `scope` or `close`); its address."""
        ptr = driver_call(cu.cuMemAlloc, max(nbytes, 1))
        self._buffers.append(ptr)
        return int(ptr)

    def upload(self, host: np.ndarray) -> int:
        """A new device buffer holding ``host``'s bytes; its address."""
        ptr = self.alloc(host.nbytes)
        self.write(ptr, host)
        return ptr

    def write(self, address: int, host: np.ndarray) -> None:
        """Copy ``host``'s bytes to ``address``; done when this returns. (A plain cuMemcpyHtoD
        from pageable memory may return before its DMA lands, and a launch on the non-blocking
        `stream` would not wait for it: the copy runs on `stream`, which is then waited for.)"""
        host = np.ascontiguousarray(host)
        driver_call(cu.cuMemcpyHtoDAsync, address, host.ctypes.data, host.nbytes, self.stream)
        self.synchronize()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        driver_call(cu.cuMemcpyDtoDAsync, dst, src, nbytes, self.stream)

    def memset(self, address: int, value: int, nbytes: int) -> None:
        driver_call(cu.cuMemsetD8Async, address, value, nbytes, self.stream)

    def synchronize(self) -> None:
        driver_call(cu.cuStreamSynchronize, self.stream)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Free the buffers and graphs made inside the block when it ends."""
        buffers, graphs = len(self._buffers), len(self._graphs)
        try:
            yield
        finally:
            self._release(buffers, graphs)

    # Graphs and timing
    def capture(self, enqueue: Callable[[], None]) -> Any:
        """An executable CUDA graph of the work ``enqueue()`` puts on `stream`."""
        driver_call(cu.cuStreamBeginCapture, self.stream,
                    cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            enqueue()
        except BaseException:
            cu.cuStreamEndCapture(self.stream)  # leave the stream usable; the error is enqueue's
            raise
        graph = driver_call(cu.cuStreamEndCapture, self.stream)
        try:
            executable = driver_call(cu.cuGraphInstantiate, graph, 0)
        finally:
            cu.cuGraphDestroy(graph)  # the executable graph is a copy
        self._graphs.append(executable)
        return executable

    def launch(self, graph: Any) -> None:
        driver_call(cu.cuGraphLaunch, graph, self.stream)

    def events(self, count: int) -> list[Any]:
        """``count`` timing events (reused across calls)."""
        while len(self._events) < count:
            self._events.append(driver_call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DEFAULT))
        return self._events[:count]

    def record(self, event: Any) -> None:
        driver_call(cu.cuEventRecord, event, self.stream)

    def elapsed_us(self, start: Any, end: Any) -> float:
        return 1e3 * driver_call(cu.cuEventElapsedTime, start, end)

    def done(self, event: Any) -> bool:
        """Whether the work before ``event``'s recording has finished (no wait)."""
        err, = cu.cuEventQuery(event)
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check_result(err, "cuEventQuery")
        return True

    @contextlib.contextmanager
    def gate(self) -> Iterator[None]:
        """Hold `stream` while the block enqueues work, then let it all run back to back."""
        if not self.gated:
            yield
            return
        self._gate_value = (self._gate_value + 1) & 0xFFFFFFFF
        driver_call(cu.cuStreamWaitValue32, self.stream, self._gate, self._gate_value, self._geq)
        try:
            yield
        finally:  # always open it: a stream left waiting would hang the next synchronize
            driver_call(cu.cuStreamWriteValue32, self._gate_stream, self._gate, self._gate_value, 0)

    def _release(self, buffers: int, graphs: int) -> None:
        # Cleanup ignores CUDA errors: it also runs while an earlier error propagates, which it
        # must not replace.
        cu.cuStreamSynchronize(self.stream)
        for graph in self._graphs[graphs:]:
            cu.cuGraphExecDestroy(graph)
        for ptr in self._buffers[buffers:]:
            cu.cuMemFree(ptr)
        del self._graphs[graphs:], self._buffers[buffers:]

    def close(self) -> None:
        """Free everything made through this object and release the primary context."""
        self._release(0, 0)
        for event in self._events:
            cu.cuEventDestroy(event)
        self._events.clear()
        for stream in (self.stream, self._gate_stream):
            cu.cuStreamDestroy(stream)
        cu.cuDevicePrimaryCtxRelease(self.device)
