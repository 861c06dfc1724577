"""The CUDA driver layer: every driver call of the package goes through this module.

For the library (the tensor API, :class:`KVCache`, checked mode): `driver` (the bindings once
``cuInit`` succeeded, or None), `cuda_call` (one call; `CudaError` on failure), the device of a
pointer, primary contexts and the device guard of a launch, stream handles and stream ordering,
and :class:`DeviceBuffer`. For the tools (the harness, the demo, ``info``): `driver_call` (one
call; `BenchError` on failure) and `Device`, a GPU's primary context with its stream, memory,
events and graphs. Importing this module needs no GPU: without cuda.bindings ``cu`` is None,
`driver()` None and `Device()` reports that as a one-line `BenchError`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from ._errors import ArgumentError, CudaError, Status
from ._scalars import U64_MAX, unsigned

try:
    from cuda.bindings import driver as cu
except ImportError:  # driver() is None and Device() says why; the GPU-free parts still work
    cu = None


def _unpack(result: Any) -> tuple[Any, Any]:
    """``(CUresult, value)`` of what a cuda.bindings call returns: its values after the
    CUresult, as None, the one value or a tuple."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if not values:
        return err, None
    return err, values[0] if len(values) == 1 else tuple(values)


def _error_name(bindings: Any, err: Any) -> str:
    _, name = bindings.cuGetErrorName(err)
    return name.decode() if name else str(int(err))


# ---- For the library: errors are CudaError ------------------------------------------------------
@functools.cache
def driver() -> Any:
    """The driver bindings after ``cuInit``, or None where no driver or device is usable: then
    nothing is asked of it and a launch reports CUDA_ERROR from the library."""
    if cu is None:
        return None
    try:
        (err,) = cu.cuInit(0)
    except Exception:  # cuda.bindings raises when libcuda itself cannot be loaded
        return None
    return cu if err == cu.CUresult.CUDA_SUCCESS else None


def require_driver() -> Any:
    bindings = driver()
    if bindings is None:
        raise CudaError(Status.CUDA_ERROR, "no usable CUDA driver (cuInit failed)")
    return bindings


def cuda_call(function: Callable[..., Any], *args: Any) -> Any:
    """The value of the driver call ``function(*args)``; a CudaError naming it on failure."""
    bindings = require_driver()
    err, value = _unpack(function(*args))
    if err != bindings.CUresult.CUDA_SUCCESS:
        raise CudaError(Status.CUDA_ERROR, f"{function.__name__}: {_error_name(bindings, err)}")
    return value


def driver_version() -> int | None:
    """The CUDA driver's version as ``cuDriverGetVersion`` gives it (12040 for 12.4), or None
    where there is no driver (or no cuda.bindings): the library then still loads, for CPU use."""
    if cu is None:
        return None
    try:
        err, version = cu.cuDriverGetVersion()
    except Exception:  # cuda.bindings raises when libcuda itself cannot be loaded
        return None
    if err != cu.CUresult.CUDA_SUCCESS:
        return None
    return int(version)


def pointer_device(name: str, ptr: int) -> int | None:
    """CUDA device ordinal of the allocation holding ``ptr``; None where the driver cannot tell
    (no driver, no context current): the library then reports what goes wrong at launch."""
    bindings = driver()
    if bindings is None or ptr == 0:
        return None
    err, ordinal = bindings.cuPointerGetAttribute(
        bindings.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    if err == bindings.CUresult.CUDA_ERROR_INVALID_VALUE:  # not allocated, mapped or registered
        raise ArgumentError(name, f"address {ptr:#x}, unknown to the CUDA driver",
                            "CUDA device memory")
    return int(ordinal) if err == bindings.CUresult.CUDA_SUCCESS else None


@contextlib.contextmanager
def primary_context(device: int) -> Iterator[Any]:
    """``device``'s primary context current on this thread (and retained) inside the block;
    yields the driver bindings."""
    bindings = require_driver()
    handle = cuda_call(bindings.cuDeviceGet, device)
    context = cuda_call(bindings.cuDevicePrimaryCtxRetain, handle)
    try:
        cuda_call(bindings.cuCtxPushCurrent, context)
        try:
            yield bindings
        finally:
            bindings.cuCtxPopCurrent()
    finally:
        bindings.cuDevicePrimaryCtxRelease(handle)


@contextlib.contextmanager
def on_device(device: int | None) -> Iterator[None]:
    """Launch with the arrays' device current, like torch's device guard: the library launches
    in the current context (and sizes workspaces for its device)."""
    bindings = driver()
    if bindings is not None and device is not None:
        err, current = bindings.cuCtxGetDevice()
        if err != bindings.CUresult.CUDA_SUCCESS or int(current) != device:
            with primary_context(device):
                yield
            return
    yield


# ---- Streams --------------------------------------------------------------------------------------
def stream_handle(stream: Any) -> int:
    """The raw ``CUstream`` value of ``stream``: ``None`` (the legacy default stream, 0), an
    ``int`` handle, a ``cuda.bindings.driver.CUstream`` or any object implementing
    ``__cuda_stream__``."""
    if stream is None:
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return unsigned("stream", stream, U64_MAX)
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        _version, handle = protocol() if callable(protocol) else protocol
        return unsigned("stream.__cuda_stream__()[1]", handle, U64_MAX)
    if cu is not None and isinstance(stream, cu.CUstream):
        return int(stream)
    raise TypeError(f"stream: expected None, int, CUstream or __cuda_stream__, got {type(stream)!r}")


def stream_argument(stream: Any) -> int:
    """The handle of an explicit ``stream`` argument of the tensor API or checked mode: torch and
    CuPy stream objects (older releases lack ``__cuda_stream__``), else what `stream_handle` takes."""
    library = type(stream).__module__.partition(".")[0]
    if library == "torch" and hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    if library == "cupy" and hasattr(stream, "ptr"):
        return int(stream.ptr)
    return stream_handle(stream)


def same_stream(a: int, b: int) -> bool:
    """0 and 1 both name the legacy default stream (1 is how CAI and DLPack write it)."""
    return (a if a > 1 else 0) == (b if b > 1 else 0)


def stream_wait(consumer: int, producer: int) -> None:
    """Work queued on ``consumer`` from now on waits for the work queued on ``producer`` so far:
    an event, device-side; the host does not wait."""
    bindings = require_driver()
    event = cuda_call(bindings.cuEventCreate, bindings.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    try:
        cuda_call(bindings.cuEventRecord, event, bindings.CUstream(producer))
        cuda_call(bindings.cuStreamWaitEvent, bindings.CUstream(consumer), event, 0)
    finally:
        bindings.cuEventDestroy(event)  # allowed while pending: released once the device passes it


# ---- Device memory of the "cuda" backend ----------------------------------------------------------
def _free_device_buffer(ptr: int, device: int) -> None:
    bindings = driver()
    if bindings is None:
        return
    handle = cuda_call(bindings.cuDeviceGet, device)
    with primary_context(device):
        bindings.cuMemFree(ptr)
    bindings.cuDevicePrimaryCtxRelease(handle)  # the reference DeviceBuffer took at allocation


class DeviceBuffer:
    """``nbytes`` BYTES of uninitialised device memory from ``cuMemAlloc`` (the "cuda" backend).

    Freed by :meth:`close`, at the end of a ``with`` block, or when garbage-collected. Holds a
    reference on the device's primary context meanwhile (the memory lives in it). Exposes
    ``__cuda_array_interface__`` (1-D uint8, no stream), so it goes wherever an array does.
    ``cuMemFree`` may make the host wait for the device: free at teardown, not per step.
    """

    def __init__(self, nbytes: int, device: int = 0) -> None:
        self.nbytes = int(nbytes)
        self.device = int(device)
        self.ptr = 0
        self._closed = False
        if self.nbytes < 0:
            raise ValueError(f"nbytes: {self.nbytes}, expected >= 0")
        if self.nbytes == 0:  # cuMemAlloc refuses 0 bytes; an empty buffer has no address
            self._finalizer = None
            return
        with primary_context(self.device) as bindings:
            self.ptr = int(cuda_call(bindings.cuMemAlloc, self.nbytes))
            # Our own reference: if the context's last one went, the memory would go with it.
            handle = cuda_call(bindings.cuDeviceGet, self.device)
            cuda_call(bindings.cuDevicePrimaryCtxRetain, handle)
        self._finalizer = weakref.finalize(self, _free_device_buffer, self.ptr, self.device)
        # At exit the process releases device memory anyway, and the driver may be gone.
        self._finalizer.atexit = False

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "stream": None, "version": 3}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the memory now (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self.ptr = 0
        self._closed = True

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DeviceBuffer(nbytes={self.nbytes}, device={self.device}, ptr={self.ptr:#x})"


# ---- For the tools: errors are BenchError ---------------------------------------------------------
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
        raise BenchError(f"{function_name} failed: {_error_name(cu, err)}")


def driver_call(function: Callable[..., Any], *args: Any) -> Any:
    """Call a cuda.bindings driver function; return its values, raise `BenchError` on failure."""
    err, value = _unpack(function(*args))
    check_result(err, function.__name__)
    return value


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
