"""The C ABI from Rust: the crate in rust/ built against the library that
``fp8kturbov.library_path()`` names (``FP8KTURBOV_LIB_DIR``), its CPU tests (``cargo test``:
layouts against the header, statuses and messages, no success without a GPU) and its GPU example,
which exits 77 without a GPU and 0 on one. Needs cargo (skipped otherwise) and a C compiler; no
crate registry (the crate has no dependencies). Build outputs go to pytest's tmp_path."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from example_util import check_example_without_gpu_contract

import fp8kturbov

REPO = Path(__file__).resolve().parents[1]
CRATE = REPO / "rust"
LIBRARY_FILE = "libfp8kturbov.so"
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def cargo_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if shutil.which("cargo") is None:
        pytest.skip("no cargo")
    if not (CRATE / "Cargo.toml").exists():
        pytest.skip(f"{CRATE} not found (tests run from a checkout)")
    library = fp8kturbov.library_path().resolve()
    if library.name != LIBRARY_FILE:
        pytest.skip(f"{library} is not named {LIBRARY_FILE}, which the crate links by name")
    return dict(os.environ, FP8KTURBOV_LIB_DIR=str(library.parent),
                CARGO_TARGET_DIR=str(tmp_path_factory.mktemp("cargo-target")))


def _cargo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cmd = ["cargo", *args, "--offline"]
    result = subprocess.run(cmd, cwd=CRATE, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, (f"{' '.join(cmd)} exited {result.returncode}\n"
                                    f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
    return result


@pytest.fixture(scope="module")
def example(cargo_env: dict[str, str]) -> Path:
    _cargo(cargo_env, "build", "--examples")
    exe = Path(cargo_env["CARGO_TARGET_DIR"]) / "debug" / "examples" / "gpu_decode"
    assert exe.is_file()
    return exe


def test_cargo_test(cargo_env: dict[str, str]):
    ran = _cargo(cargo_env, "test")
    summaries = [line for line in ran.stdout.splitlines() if line.startswith("test result:")]
    assert summaries and all(" 0 failed" in line for line in summaries), ran.stdout


def test_example_builds(example: Path):
    check_example_without_gpu_contract(example)


@pytest.mark.gpu
@pytest.mark.parametrize("v_bits", ["2", "3", "4"])
def test_example_runs_on_gpu(example: Path, v_bits: str):
    ran = subprocess.run([str(example), v_bits], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, f"exit {ran.returncode}\n{ran.stdout}{ran.stderr}"
    assert ran.stdout.rstrip().endswith("PASSED"), ran.stdout
