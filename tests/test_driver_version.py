"""The load-time driver check: a driver older than the CUDA major of the runtime the library
reports stops the library's load (on first use) with both versions named; no driver (CPU use) or
a new enough one lets it load."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from fp8kturbov import _device, _lib


@pytest.fixture
def driver(monkeypatch):
    """Set the driver version the check sees (None: no driver)."""
    monkeypatch.delenv(_lib.SKIP_DRIVER_CHECK_ENV, raising=False)

    def set_(found: int | None):
        monkeypatch.setattr(_lib, "driver_version", lambda: found)

    return set_


@pytest.mark.parametrize("found, required, shown, needed", [
    (12040, 13, "12.4", "CUDA 13 driver (580 or newer)"),
    (12090, 13, "12.9", "CUDA 13 driver (580 or newer)"),
    (11080, 12, "11.8", "CUDA 12 driver (525 or newer)"),
])
def test_a_too_old_driver_stops_the_import_naming_both_versions(driver, found, required, shown, needed):
    driver(found)
    with pytest.raises(ImportError) as info:
        _lib.check_driver((required, f"libfp8kturbov.so (built with CUDA {required}.0)"))
    message = str(info.value)
    assert needed in message and f"found a CUDA {shown} driver" in message
    assert f"built with CUDA {required}.0" in message
    assert _lib.SKIP_DRIVER_CHECK_ENV in message


def test_the_message_points_a_cuda12_driver_at_the_cu12_wheel(driver):
    driver(12040)
    with pytest.raises(ImportError, match="install fp8kturbov-cu12 or update the NVIDIA driver"):
        _lib.check_driver((13, "libfp8kturbov.so"))


def test_no_driver_is_no_error(driver):
    driver(None)
    _lib.check_driver((13, "libfp8kturbov.so"))


@pytest.mark.parametrize("found, required", [(13000, 13), (13020, 13), (12080, 12), (12020, 12),
                                             (13000, 12)])
def test_a_new_enough_driver_is_no_error(driver, found, required):
    driver(found)
    _lib.check_driver((required, "libfp8kturbov.so"))


def test_the_environment_variable_skips_the_check(driver, monkeypatch):
    driver(12040)
    monkeypatch.setenv(_lib.SKIP_DRIVER_CHECK_ENV, "1")
    _lib.check_driver((13, "libfp8kturbov.so"))


def _fake_cuda_bindings(monkeypatch, get_version):
    """Install a stand-in ``cuda.bindings.driver`` whose ``cuDriverGetVersion`` is ``get_version``
    as the bindings of the driver layer."""
    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_NO_DEVICE = 100

    fake = types.ModuleType("cuda.bindings.driver")
    fake.CUresult = CUresult
    fake.cuDriverGetVersion = get_version
    monkeypatch.setattr(_device, "cu", fake)
    return CUresult


def test_driver_version_reads_cu_driver_get_version(monkeypatch):
    result = _fake_cuda_bindings(monkeypatch, lambda: (0, 12040))
    assert _device.driver_version() == 12040
    _fake_cuda_bindings(monkeypatch, lambda: (result.CUDA_ERROR_NO_DEVICE, 0))
    assert _device.driver_version() is None


def test_driver_version_is_none_where_the_driver_library_cannot_load(monkeypatch):
    def missing():
        raise RuntimeError("libcuda.so.1: cannot open shared object file")

    _fake_cuda_bindings(monkeypatch, missing)
    assert _device.driver_version() is None


def test_driver_version_is_none_without_cuda_bindings(monkeypatch):
    monkeypatch.setattr(_device, "cu", None)
    assert _device.driver_version() is None


@pytest.mark.parametrize("release, major, shown", [(12040, 12, "12.4"), (12090, 12, "12.9"),
                                                   (13000, 13, "13.0"), (13020, 13, "13.2")])
def test_the_required_major_is_the_runtime_the_library_reports(release, major, shown):
    def fp8kturbov_cuda_runtime_version():
        return release

    loaded = types.SimpleNamespace(fp8kturbov_cuda_runtime_version=fp8kturbov_cuda_runtime_version)
    assert _lib.cuda_runtime_major(loaded, Path("/x/lib.so")) == (major, f"lib.so (built with CUDA {shown})")


def test_a_library_without_the_runtime_version_is_refused():
    with pytest.raises(ImportError, match="no symbol fp8kturbov_cuda_runtime_version"):
        _lib.cuda_runtime_major(types.SimpleNamespace(), Path("lib.so"))


def test_the_loaded_library_reports_a_cuda_runtime_of_a_known_major():
    """Whatever nvcc built it (12.4 writes no release string into the fatbin, 13.0 does), the
    library names its runtime; a wheel of a CUDA major holds a library of that major."""
    release = _lib.library().fp8kturbov_cuda_runtime_version()
    assert release % 10 == 0 and release // 1000 in _lib.MIN_DRIVER_BRANCH, release
    distribution = None if os.environ.get(_lib.LIBRARY_ENV) else _lib.providing_distribution()
    name = distribution.metadata["Name"].replace("_", "-").lower() if distribution else ""
    if name.startswith("fp8kturbov-cu"):
        assert name == f"fp8kturbov-cu{release // 1000}", (name, release)


def test_loading_with_a_too_old_driver_fails_and_without_one_succeeds(tmp_path):
    """End to end in a fresh interpreter: a stand-in cuda.bindings reporting a CUDA 11.8 driver,
    older than any toolkit the library can be built with, stops the library's load (the first
    call that needs it) and leaves ``import fp8kturbov`` working."""
    fake = tmp_path / "cuda" / "bindings"
    fake.mkdir(parents=True)
    (tmp_path / "cuda" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("__version__ = '11.8.0'\n")
    (fake / "driver.py").write_text(textwrap.dedent("""\
        import os
        class CUresult:
            CUDA_SUCCESS = 0
        def cuDriverGetVersion():
            if os.environ.get("FAKE_NO_DRIVER"):
                raise RuntimeError("libcuda.so.1: cannot open shared object file")
            return (0, 11080)
        """))
    path = os.pathsep.join([str(tmp_path), *(p for p in sys.path if p)])
    env = {k: v for k, v in os.environ.items() if k != _lib.SKIP_DRIVER_CHECK_ENV}
    env["PYTHONPATH"] = path
    run = [sys.executable, "-c", "import fp8kturbov; print('imported'); fp8kturbov.version(); print('loaded')"]
    old = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert old.returncode != 0 and old.stdout.split() == ["imported"], old.stdout
    assert "ImportError" in old.stderr and "found a CUDA 11.8 driver" in old.stderr, old.stderr
    none = subprocess.run(run, env={**env, "FAKE_NO_DRIVER": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert none.returncode == 0 and "loaded" in none.stdout, none.stderr
