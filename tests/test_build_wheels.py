"""The wheel builder's pieces that run without a toolkit or a GPU: ci/library_record.py (the check
that a built library records its CUDA major and commit) against the loaded library, the usage of
ci/build-wheels.sh, the reuse of an assembled CUDA 12 root by ci/cuda12-toolkit.sh, and the
default architecture lists, read as fatbin entries."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import fp8kturbov
from fp8kturbov import _lib

CI = Path(__file__).resolve().parents[1] / "ci"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, CI / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


library_record = _module("library_record")
fatbin_archs = _module("fatbin_archs")


def test_the_record_is_what_the_loaded_library_reports():
    lib = _lib.library()
    assert library_record.record(str(fp8kturbov.library_path())) == (
        lib.fp8kturbov_cuda_runtime_version(), lib.fp8kturbov_build_commit().decode())


def test_the_check_passes_on_the_library_own_record_and_fails_on_another(capsys):
    path = str(fp8kturbov.library_path())
    runtime, commit = library_record.record(path)
    major = runtime // 1000
    assert library_record.main([path, str(major), commit]) == 0
    assert library_record.main([path, str(major + 1), commit]) == 1
    assert f"not CUDA {major + 1}" in capsys.readouterr().err
    assert library_record.main([path, str(major), commit + "x"]) == 1
    assert f"not {commit + 'x'!r}" in capsys.readouterr().err


@pytest.mark.parametrize("runtime, major, commit, want, problems", [
    (12040, 12, "abc1234", "abc1234", []),
    (13000, 12, "abc1234", "abc1234", ["built with the CUDA 13.0 runtime, not CUDA 12"]),
    (12040, 12, "unknown", "abc1234", ["records commit 'unknown', not 'abc1234'"]),
])
def test_mismatches_name_each_difference(runtime, major, commit, want, problems):
    assert library_record.mismatches(runtime, commit, major, want) == problems


@pytest.mark.parametrize("argv", [[], ["lib.so", "twelve", "abc"], ["lib.so", "12"]])
def test_bad_usage_exits_2(argv):
    assert library_record.main(argv) == 2


def test_a_library_that_does_not_load_exits_2(tmp_path):
    (tmp_path / "lib.so").write_bytes(b"not an ELF file")
    assert library_record.main([str(tmp_path / "lib.so"), "12", "abc"]) == 2


def test_build_wheels_refuses_an_unknown_flavour():
    done = subprocess.run(["bash", str(CI / "build-wheels.sh"), "cu11"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "usage:" in done.stderr, done.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in CI.glob("*.sh")))
def test_ci_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(CI / script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_cuda12_toolkit_reuses_an_assembled_root(tmp_path):
    """A root whose nvcc reports a 12.x release is printed as it is: no apt, no download."""
    nvcc = tmp_path / "root" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    tools = tmp_path / "tools"  # the text tools the script needs, and neither apt-get nor dpkg
    tools.mkdir()
    for tool in ("sed", "head", "cut"):
        (tools / tool).symlink_to(shutil.which(tool))
    env = {**os.environ, "PATH": str(tools)}
    done = subprocess.run(["/bin/bash", str(CI / "cuda12-toolkit.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "root")
    assert "reusing" in done.stderr and "12.4" in done.stderr


def _script_lists() -> dict[str, str]:
    """The default architecture lists assigned in build-wheels.sh (name -> CMake list)."""
    text = (CI / "build-wheels.sh").read_text()
    return dict(re.findall(r'^(\w+_archs)="([^"]+)"', text, re.M))


def test_the_default_lists_are_the_wheels_promised():
    lists = {name: fatbin_archs.expected(value) for name, value in _script_lists().items()}
    cuda12 = {"sm_80", "sm_86", "sm_89", "sm_90a", "compute_90"}
    assert lists == {"default_archs": cuda12 - {"compute_90"} | {"sm_100", "sm_120", "compute_120"},
                     "before_12_8_archs": cuda12}
