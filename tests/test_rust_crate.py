"""The C ABI from Rust: the crate in rust/ built against the library that
``fp8kturbov.library_path()`` names (``FP8KTURBOV_LIB_DIR``), its CPU tests (``cargo test``:
layouts against the header, statuses and messages, no success without a GPU) and its GPU example,
which exits 77 without a GPU and 0 on one, and whose saved pools and outputs (``--save``) match the
NumPy reference over the same inputs. Needs cargo (skipped otherwise) and a C compiler; no crate
registry (the crate has no dependencies). Build outputs go to pytest's tmp_path.

``FP8KTURBOV_RUST_EXAMPLE`` names an example binary built elsewhere, for a machine without a Rust
toolchain: the example's tests then run that binary instead of building one."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import relative_error_per_head
from example_util import check_example_without_gpu_contract

import fp8kturbov
from fp8kturbov import reference as ref
from fp8kturbov._limits import DEFAULT_SPARSE_V_THRESHOLD

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
def example(request: pytest.FixtureRequest) -> Path:
    prebuilt = os.environ.get("FP8KTURBOV_RUST_EXAMPLE")
    if prebuilt:
        return Path(prebuilt)
    cargo_env = request.getfixturevalue("cargo_env")
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


def _load_saved(folder: Path) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    meta = {name: int(value) for name, value in
            (line.split() for line in (folder / "meta.txt").read_text().splitlines())}
    dtypes = {"bf16": ml_dtypes.bfloat16, "i64": np.int64, "i32": np.int32, "u8": np.uint8}
    arrays = {path.stem: np.fromfile(path, dtype=dtypes[path.suffix[1:]])
              for path in folder.iterdir() if path.suffix[1:] in dtypes}
    return meta, arrays


def _f32(bits: int) -> float:
    return float(np.array(bits, dtype=np.uint32).view(np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("v_bits", [2, 3, 4])
def test_example_matches_reference(example: Path, v_bits: int, tmp_path: Path):
    """The Rust launchers' pools are the reference write's byte for byte (pools start zeroed), and
    both decodes (the library's default sparse-V threshold) match the reference decode over them."""
    ran = subprocess.run([str(example), str(v_bits), "--save", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, f"exit {ran.returncode}\n{ran.stdout}{ran.stderr}"
    meta, saved = _load_saved(tmp_path)
    assert meta["v_bits"] == v_bits
    k_scale, inv_sqrt_d = _f32(meta["k_scale_bits"]), _f32(meta["inv_sqrt_d_bits"])
    heads, dim, block = meta["num_kv_heads"], meta["head_dim"], meta["block_size"]
    row = heads * dim
    strides = (meta["k_block_stride_bytes"], meta["v_block_stride_bytes"], meta["v_data_section_bytes"])

    k_pool = np.zeros(meta["num_blocks"] * strides[0], dtype=np.uint8)
    v_pool = np.zeros(meta["num_blocks"] * strides[1], dtype=np.uint8)
    ref.write_cache(saved["key"], saved["value"], k_pool, v_pool, saved["slot_mapping"],
                    meta["num_tokens"], heads, dim, block, row, row, k_scale, *strides, v_bits)
    assert np.array_equal(saved["k_pool"], k_pool), "K pool differs from the reference write"
    assert np.array_equal(saved["v_pool"], v_pool), "V pool differs from the reference write"

    num_q_heads, num_seqs = meta["num_q_heads"], meta["num_seqs"]
    want = ref.paged_decode(saved["q"], k_pool, v_pool, saved["block_tables"], saved["seq_lens"],
                            meta["max_blocks_per_seq"], num_seqs, num_q_heads, heads, dim, block,
                            inv_sqrt_d, k_scale, num_q_heads * dim, strides[1], strides[2], 0,
                            v_bits, strides[0], DEFAULT_SPARSE_V_THRESHOLD)
    for name in ("output_engine", "output_generic"):
        got = saved[name].astype(np.float64).reshape(num_seqs, num_q_heads, dim)
        assert np.isfinite(got).all(), name
        err = relative_error_per_head(got, want)
        assert err.max() <= 1e-2, f"{name}: max relative error per head {err.max():.3g}"
