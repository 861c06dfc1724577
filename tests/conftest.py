"""Test configuration: tests marked ``gpu`` are skipped cleanly where no CUDA GPU is usable."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device is usable, else why not."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return f"cuda.bindings not importable: {exc}"
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:  # the driver library itself is missing
        return f"no CUDA driver: {exc}"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuInit failed: {err.name}"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        return "no CUDA device"
    return None


def shuffled_block_tables(rng: np.random.Generator, blocks_per_seq, num_blocks: int,
                          max_blocks_per_seq: int, unused: int = -7) -> np.ndarray:
    """Block tables [sequence][max_blocks_per_seq] (int32) in which sequence s holds
    ``blocks_per_seq[s]`` distinct pages, taken in order from a random permutation of
    ``num_blocks`` pages; the entries past a sequence's pages hold ``unused``."""
    pages = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(blocks_per_seq), max_blocks_per_seq), unused, dtype=np.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = pages[used:used + count]
        used += count
    return tables


def widened_rows(tables: np.ndarray, width: int) -> np.ndarray:
    """``tables`` in the first columns of rows ``width`` entries wide (an engine's rows sized for
    a longer context); the other entries hold INT32_MAX, a page far outside any pool, so that a
    read of them faults."""
    wide = np.full((tables.shape[0], width), np.iinfo(np.int32).max, dtype=np.int32)
    wide[:, :tables.shape[1]] = tables
    return wide


REPO = Path(__file__).resolve().parents[1]


def build_filter(tmp_path_factory: pytest.TempPathFactory, name: str, sources: list) -> Path:
    """A C++ filter program (tests/plan/*_cli.cc with the planner sources it tests) built with a
    plain C++ compiler, strict warnings; the test is skipped where there is none."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp(name) / name
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{REPO / 'cuda/include'}",
                    f"-I{REPO / 'cuda/src'}", *map(str, sources), "-o", str(exe)], check=True, timeout=300)
    return exe


def run_filter(exe: Path, inputs: list[dict], fields: list[str], names: list[str]) -> list[dict]:
    """One input line per dict (its ``fields`` in order), one output dict per line (``names``)."""
    text = "".join(" ".join(str(d[f]) for f in fields) + "\n" for d in inputs)
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True, timeout=60)
    return [dict(zip(names, map(int, line.split()))) for line in out.stdout.splitlines()]


def case_id(case) -> str:
    """A dataclass test case's id: its fields that differ from their defaults, or "default"."""
    fields = (f"{f.name}={getattr(case, f.name)}" for f in dataclasses.fields(case)
              if getattr(case, f.name) != f.default)
    return ",".join(fields) or "default"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch):
    """A :class:`fake_driver.FakeDriver` in place of cuda.bindings.driver for the library's
    driver layer (fp8kturbov._device) and everything that goes through it (DeviceBuffer, KVCache,
    the tensor API, checked mode)."""
    # Imported here: the other tests need neither the fake nor the library loaded by conftest.
    from fake_driver import FakeDriver
    from fp8kturbov import _device

    fake = FakeDriver()
    monkeypatch.setattr(_device, "driver", lambda: fake)
    return fake


def relative_error_per_head(got: np.ndarray, want: np.ndarray, allowance: np.ndarray | float = 0.0) -> np.ndarray:
    """Per (row, head): |got - want| / |want| over the last axis; where want is 0, |got| itself.
    Below bf16's smallest normal magnitude the output holds no relative precision (the kernels'
    fp32 arithmetic flushes such results to 0, and bf16's subnormals have a few bits at most), so
    |want| counts as at least 100 times the norm of a row of smallest normals: a row of that size
    or less, flushed or rounded, stays under 1e-2. (Such rows are real: a sink that outweighs a
    short sequence's scores by e^90 gives outputs near 1e-40.) ``allowance`` (per (row, head), or
    one number): a deviation known to be allowed on top, which |got - want| may use up first (the
    bound of what sparse V skips, or of the softmax weights too small for fp16)."""
    num = np.maximum(np.linalg.norm(got - want, axis=-1) - allowance, 0.0)
    den = np.linalg.norm(want, axis=-1)
    floor = 100 * np.sqrt(want.shape[-1]) * float(np.finfo(np.float32).smallest_normal)  # bf16's too
    return np.where(den > 0, num / np.maximum(den, floor), num)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator with a fresh seed per test, printed and recorded so a failure can be replayed:
    FP8KTURBOV_TEST_SEED=<seed> gives the selected tests that seed instead."""
    replayed = os.environ.get("FP8KTURBOV_TEST_SEED")
    seed = int(replayed) if replayed else np.random.SeedSequence().entropy % 2**32
    request.node.user_properties.append(("seed", seed))
    print(f"seed = {seed}")
    return np.random.default_rng(seed)
