"""fp8kturbov.tools.bench.nvml against a fake NVML (tests/fake_nvml.c, built here as a shared library with
the C compiler): the counters it reads, and None wherever NVML cannot answer. Needs no GPU."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from fp8kturbov.tools.bench.nvml import NvmlCounters

SOURCE = Path(__file__).with_name("fake_nvml.c")
BUS_ID = "0000:3b:00.0"  # the fake's GPU
NOT_SUPPORTED = 3


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ctypes.CDLL]:
    """The fake library's path (for `NvmlCounters.open`) and the library itself, to set its state:
    dlopen of the same path gives the same library, so both see one state."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc)")
    library = tmp_path_factory.mktemp("nvml") / "libfake_nvml.so"
    command = [cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", str(SOURCE), "-o", str(library)]
    built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(command)}\n{built.stdout}{built.stderr}"
    fake = ctypes.CDLL(str(library))
    fake.fake_nvml_set.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong]
    fake.fake_nvml_set_energy.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
    return str(library), fake


def test_counters_are_read_until_closed(fake_nvml):
    path, fake = fake_nvml
    fake.fake_nvml_set(0, 0, 5_000_000, 0)
    fake.fake_nvml_set_energy(0, 123_456)
    counters = NvmlCounters.open(BUS_ID, path)
    assert counters is not None and fake.fake_nvml_initialised() == 1
    assert counters.held_ns() == {"power cap": 5_000_000, "thermal": 0}
    assert counters.energy_mj() == 123_456
    fake.fake_nvml_set(0, 0, 12_000_000, 3)  # the counters grow while the limits hold the clocks
    fake.fake_nvml_set_energy(0, 190_000)
    assert counters.held_ns() == {"power cap": 12_000_000, "thermal": 3}
    assert counters.energy_mj() == 190_000
    fake.fake_nvml_set(0, NOT_SUPPORTED, 0, 0)
    fake.fake_nvml_set_energy(NOT_SUPPORTED, 0)
    assert counters.held_ns() is None and counters.energy_mj() is None
    with counters:
        pass
    assert fake.fake_nvml_initialised() == 0


@pytest.mark.parametrize("init, violation, bus_id", [
    (1, 0, BUS_ID),              # nvmlInit_v2 fails (NVML_ERROR_UNINITIALIZED)
    (0, 0, "0000:01:00.0"),      # no such GPU
    (0, NOT_SUPPORTED, BUS_ID),  # the GPU has no counters
])
def test_open_is_none_where_nvml_cannot_answer(fake_nvml, init, violation, bus_id):
    path, fake = fake_nvml
    fake.fake_nvml_set(init, violation, 1, 1)
    assert NvmlCounters.open(bus_id, path) is None
    assert fake.fake_nvml_initialised() == 0  # released again where it was initialised


def test_open_is_none_without_nvml(tmp_path):
    assert NvmlCounters.open(BUS_ID, str(tmp_path / "libnvidia-ml.so.1")) is None
