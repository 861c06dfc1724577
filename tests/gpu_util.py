"""Device memory for the GPU tests through cuda.bindings (no framework needed)."""

from __future__ import annotations

import numpy as np
from cuda.bindings import driver as cu


def check_driver_result(result):
    """Unwrap a cuda.bindings call result ``(CUresult, *values)``, raising on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if name else err}")
    return values[0] if len(values) == 1 else tuple(values)


class Device:
    """The primary context of GPU 0, current on the calling thread, and one stream."""

    def __init__(self) -> None:
        check_driver_result(cu.cuInit(0))
        self.device = check_driver_result(cu.cuDeviceGet(0))
        self.context = check_driver_result(cu.cuDevicePrimaryCtxRetain(self.device))
        check_driver_result(cu.cuCtxSetCurrent(self.context))
        self.stream = check_driver_result(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self._buffers: list[cu.CUdeviceptr] = []
        self._graphs: list[cu.CUgraphExec] = []

    def upload(self, host: np.ndarray) -> int:
        """Copy ``host`` into a new device buffer; returns its address once the copy has landed.
        (A plain cuMemcpyHtoD from pageable memory may return before its DMA lands, and launches
        on a non-blocking stream do not wait for it: the copy runs on ``stream``, then the host
        waits for that stream.)"""
        host = np.ascontiguousarray(host)
        ptr = check_driver_result(cu.cuMemAlloc(max(host.nbytes, 1)))
        self._buffers.append(ptr)
        if host.nbytes:
            check_driver_result(cu.cuMemcpyHtoDAsync(ptr, host.ctypes.data, host.nbytes, self.stream))
            self.synchronize()
        return int(ptr)

    def download(self, address: int, like: np.ndarray) -> np.ndarray:
        """Copy ``like.nbytes`` bytes at ``address`` into a new array shaped like ``like``."""
        self.synchronize()
        out = np.empty_like(np.ascontiguousarray(like))
        if out.nbytes:
            check_driver_result(cu.cuMemcpyDtoH(out.ctypes.data, address, out.nbytes))
        return out

    def write(self, address: int, host: np.ndarray) -> None:
        """Copy ``host`` over the device buffer at ``address`` (on ``stream``; waits for it)."""
        host = np.ascontiguousarray(host)
        check_driver_result(cu.cuMemcpyHtoDAsync(address, host.ctypes.data, host.nbytes, self.stream))
        self.synchronize()

    def capture(self, enqueue) -> cu.CUgraphExec:
        """An executable CUDA graph of the work ``enqueue()`` puts on ``stream``."""
        check_driver_result(cu.cuStreamBeginCapture(
            self.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            enqueue()
        except BaseException:
            cu.cuStreamEndCapture(self.stream)  # the stream stays usable; the error is enqueue's
            raise
        graph = check_driver_result(cu.cuStreamEndCapture(self.stream))
        self._graphs.append(check_driver_result(cu.cuGraphInstantiate(graph, 0)))
        check_driver_result(cu.cuGraphDestroy(graph))  # the executable graph is a copy
        return self._graphs[-1]

    def replay(self, graph: cu.CUgraphExec) -> None:
        check_driver_result(cu.cuGraphLaunch(graph, self.stream))

    def synchronize(self) -> None:
        check_driver_result(cu.cuStreamSynchronize(self.stream))

    def free_all(self) -> None:
        self.synchronize()
        for graph in self._graphs:
            check_driver_result(cu.cuGraphExecDestroy(graph))
        self._graphs.clear()
        for ptr in self._buffers:
            check_driver_result(cu.cuMemFree(ptr))
        self._buffers.clear()
