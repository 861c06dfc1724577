"""A GPU's counters in NVML, for the benchmark: how long its clocks were held down by its power
limit or its temperature, and the energy the board has used.

NVML, the driver's management library (``libnvidia-ml.so.1``, installed with the driver), counts
per GPU the nanoseconds during which each limit held the clocks below what the load asked for
(``nvmlDeviceGetViolationStatus``) and the board's energy in millijoules
(``nvmlDeviceGetTotalEnergyConsumption``): counters that only grow, read here through ctypes. The
difference of two readings is what happened in between; an issue-bound kernel runs slower for a
held clock. The energy counter moves in steps (on an H200 about every 100 ms), so it measures
power over windows of a second or more. Where NVML is missing or has no clock-limit counters for
the GPU, `NvmlCounters.open` returns None and nothing is reported.
"""

from __future__ import annotations

import ctypes

NVML_SUCCESS = 0
# The limits reported, by name, with their nvmlPerfPolicyType_t.
LIMITS: dict[str, int] = {"power cap": 0, "thermal": 1}
NVML_LIBRARY = "libnvidia-ml.so.1"


class _ViolationTime(ctypes.Structure):
    """nvmlViolationTime_t: when it was read (µs, host clock) and the limit's held time (ns)."""

    _fields_ = [("reference_time", ctypes.c_ulonglong), ("violation_time", ctypes.c_ulonglong)]


class NvmlCounters:
    """One GPU's counters in NVML: `held_ns` reads the clock limits', `energy_mj` the energy. Close it
    (`close`, or use it as a context manager) to release NVML."""

    def __init__(self, nvml: ctypes.CDLL, handle: ctypes.c_void_p) -> None:
        self._nvml, self._handle = nvml, handle
        nvml.nvmlDeviceGetViolationStatus.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_ViolationTime)]
        nvml.nvmlDeviceGetViolationStatus.restype = ctypes.c_int
        nvml.nvmlDeviceGetTotalEnergyConsumption.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong)]
        nvml.nvmlDeviceGetTotalEnergyConsumption.restype = ctypes.c_int

    @classmethod
    def open(cls, pci_bus_id: str, library: str = NVML_LIBRARY) -> NvmlCounters | None:
        """The counters of the GPU at ``pci_bus_id`` (as CUDA names it: ``0000:3b:00.0``), or None
        where the library cannot be loaded or initialised, has no such GPU, or no counters for it."""
        try:
            nvml = ctypes.CDLL(library)
        except OSError:
            return None
        if nvml.nvmlInit_v2() != NVML_SUCCESS:
            return None
        handle = ctypes.c_void_p()
        limits = cls(nvml, handle)
        found = nvml.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(handle)) == NVML_SUCCESS
        if not found or limits.held_ns() is None:
            limits.close()
            return None
        return limits

    def held_ns(self) -> dict[str, int] | None:
        """Per limit of `LIMITS`, the nanoseconds it has held the clocks down since the driver began
        counting; None where NVML does not answer."""
        held = {}
        for name, policy in LIMITS.items():
            status = _ViolationTime()
            if self._nvml.nvmlDeviceGetViolationStatus(self._handle, policy, ctypes.byref(status)) != NVML_SUCCESS:
                return None
            held[name] = status.violation_time
        return held

    def energy_mj(self) -> int | None:
        """The millijoules the board has used since the driver was loaded; None where NVML does not
        answer (a GPU without the counter)."""
        energy = ctypes.c_ulonglong()
        if self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(energy)) != NVML_SUCCESS:
            return None
        return energy.value

    def close(self) -> None:
        """Release NVML (each successful `open` initialised it once)."""
        self._nvml.nvmlShutdown()

    def __enter__(self) -> NvmlCounters:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
