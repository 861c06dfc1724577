"""The command line's info, build-system flags and demo: GPU-free parts here, the demo's GPU path
at the end (marked ``gpu``)."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
import fp8kturbov.tools.bench.launches
import fp8kturbov.tools.bench.timing
from fp8kturbov import _device
from fp8kturbov.tools import bench, cli, demo, info

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "cuda" / "include" / "fp8kturbov.h"
ARCH_NAME = re.compile(r"(sm|compute)_\d+[af]?")
#: Mean squared error of unit-Gaussian Lloyd-Max quantisers (Max 1960), by bits.
LLOYD_MAX_MSE = {2: 0.1175, 3: 0.03454, 4: 0.009497}
SMALL_DEMO = ["demo", "--no-progress", "--seq-lens", "300,64,17", "--head-dim", "64",
              "--q-heads", "8", "--kv-heads", "2"]


def run_module(*args: str) -> subprocess.CompletedProcess:
    """``python -m fp8kturbov ARGS`` in a fresh process (the library found as in this one)."""
    package_root = str(Path(fp8kturbov.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path,
           "FP8KTURBOV_LIBRARY": str(fp8kturbov.library_path().resolve())}
    return subprocess.run([sys.executable, "-m", "fp8kturbov", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def gpu_absent() -> bool:
    from conftest import gpu_unavailable_reason

    return gpu_unavailable_reason() is not None


# ---- Argument parsing ------------------------------------------------------------------------------


def test_demo_defaults_and_options():
    args = cli.build_parser().parse_args(["demo"])
    assert (args.bits, args.head_dim, args.q_heads, args.kv_heads, args.block_size) == (3, 128, 32, 8, 16)
    assert (args.seq_lens, args.seed, args.kv_file, args.cpu) == (None, 0, None, False)
    assert args.sparse_v_threshold == 1e-3 and args.q_len == 1 and args.handler is cli.run_demo
    args = cli.build_parser().parse_args(
        ["demo", "--bits", "2", "--seq-lens", "2k,17", "--head-dim", "256", "--q-heads", "16",
         "--kv-heads", "4", "--block-size", "32", "--seed", "7", "--kv-file", "x.npz",
         "--sparse-v-threshold", "0", "--iters", "5", "--q-len", "16", "--cpu"])
    assert args.seq_lens == (2048, 17) and (args.bits, args.head_dim, args.block_size) == (2, 256, 32)
    assert (args.q_heads, args.kv_heads, args.seed, args.kv_file) == (16, 4, 7, "x.npz")
    assert (args.sparse_v_threshold, args.iters, args.q_len, args.cpu) == (0.0, 5, 16, True)
    assert cli.build_parser().parse_args(["info"]).handler is cli.run_info


@pytest.mark.parametrize("argv, message", [
    ([], "required: COMMAND"),
    (["demo", "--bits", "5"], "argument --bits"),
    (["demo", "--seq-lens", "10,0"], "argument --seq-lens"),
    (["demo", "--head-dim", "-64"], "argument --head-dim"),
    (["demo", "--q-len", "0"], "argument --q-len: '0' is not a positive integer"),
    (["demo", "--q-len", "17"], "argument --q-len: '17' is more than 16 query tokens per sequence"),
    (["--library", "info"], "take no COMMAND"),
    (["info", "--bogus"], "unrecognized arguments"),
])
def test_bad_command_lines_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ---- --include-dir and --library ---------------------------------------------------------------------


def test_include_dir_and_library_print_paths_for_build_systems(tmp_path):
    """The printed paths are enough to build and run a C program against the library."""
    done = run_module("--include-dir", "--library")
    assert done.returncode == 0, done.stderr
    include, library = (Path(line) for line in done.stdout.splitlines())
    if HEADER.exists():
        assert (include / "fp8kturbov.h").read_bytes() == HEADER.read_bytes()
    assert library == fp8kturbov.library_path().resolve() and library.is_file()
    assert run_module("--library").stdout == f"{library}\n"
    assert run_module("--include-dir").stdout == f"{include}\n"

    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc)")
    source = tmp_path / "abi.c"
    source.write_text("#include <fp8kturbov.h>\n"
                      "int main(void) { return fp8kturbov_abi_version() != FP8KTURBOV_ABI_VERSION; }\n")
    exe = tmp_path / "abi"
    built = subprocess.run([cc, f"-I{include}", str(source), f"-L{library.parent}",
                            f"-l:{library.name}", f"-Wl,-rpath,{library.parent}", "-o", str(exe)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert subprocess.run([str(exe)]).returncode == 0


def test_include_dir_prefers_the_installed_header_and_errors_without_one(tmp_path, monkeypatch,
                                                                         capsys):
    package = tmp_path / "site-packages" / "fp8kturbov"
    (package / "include").mkdir(parents=True)
    monkeypatch.setattr(info, "__file__", str(package / "tools" / "info.py"))
    assert cli.main(["--include-dir"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m fp8kturbov: error: fp8kturbov.h is in none of")
    assert len(err.splitlines()) == 1
    (package / "include" / "fp8kturbov.h").write_text("/* installed */\n")
    assert info.include_dir() == package / "include"


# ---- info --------------------------------------------------------------------------------------------


def test_info_in_a_fresh_process():
    done = run_module("info")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    fields = dict(line.split(": ", 1) for line in lines[1:4])
    lib = fp8kturbov._lib.library()
    runtime = lib.fp8kturbov_cuda_runtime_version()
    assert lines[0].startswith(
        f"fp8kturbov library {fp8kturbov.version()} (ABI {fp8kturbov.ABI_VERSION}, CUDA runtime "
        f"{runtime // 1000}.{runtime % 1000 // 10}, commit {lib.fp8kturbov_build_commit().decode()})"), lines[0]
    assert Path(fields["library"]) == fp8kturbov.library_path().resolve()
    assert Path(fields["header"]).is_file()
    archs = fields["CUDA architectures"].split(" (")[0].split()
    assert archs and all(ARCH_NAME.fullmatch(name) for name in archs), fields
    if gpu_absent():
        assert lines[-1].startswith("no GPU: ") and len(lines[-1].splitlines()) == 1
        assert sum(line.startswith("no GPU") for line in lines) == 1
    else:
        assert any(line.startswith("GPU 0: ") for line in lines), lines


def _cmake_architectures(value: str) -> set[str] | None:
    """The code CMake's CUDA_ARCHITECTURES list builds: ``90-real`` -> sm_90, ``90-virtual`` ->
    compute_90, ``90`` -> both; None for the symbolic values (all, native, ...)."""
    wanted = set()
    for item in value.split(";"):
        match = re.fullmatch(r"(\d+[af]?)(-real|-virtual)?", item.strip())
        if match is None:
            return None
        arch, kind = match.groups()
        if kind != "-virtual":
            wanted.add(f"sm_{arch}")
        if kind != "-real":
            wanted.add(f"compute_{arch}")
    return wanted


def test_architectures_match_the_build_configuration():
    """Where the library sits in its CMake build folder, the architectures read from it must be
    the ones that build was configured with."""
    library = fp8kturbov.library_path().resolve()
    cache = library.parent / "CMakeCache.txt"
    found = re.search(r"^FP8KTURBOV_CUDA_ARCHITECTURES:\w+=(.*)$",
                      cache.read_text(), re.M) if cache.exists() else None
    wanted = _cmake_architectures(found.group(1)) if found else None
    if wanted is None:
        pytest.skip("the library is not in a CMake build folder with explicit architectures")
    archs, method = info.library_architectures(library)
    assert set(archs) == wanted and method == "read from the library's fatbin headers"


def test_architectures_of_a_library_nvcc_builds(tmp_path):
    """A tiny library built with cubins for sm_80 and sm_90a, and PTX for compute_120."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    (tmp_path / "k.cu").write_text("__global__ void k(float* x) { x[threadIdx.x] += 1.f; }\n")
    library = tmp_path / "libk.so"
    gencode = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
               "-gencode=arch=compute_120,code=compute_120"]
    built = subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", *gencode, "-o", str(library),
                            str(tmp_path / "k.cu")], capture_output=True, text=True, timeout=300)
    if built.returncode != 0:
        pytest.skip(f"nvcc cannot build these architectures: {built.stderr[-300:]}")
    assert info.library_architectures(library)[0] == ["sm_80", "sm_90a", "compute_120"]


def _fatbin(*entries: tuple[int, int, int]) -> bytes:
    """A fatbin of (kind, sm, flags) entries with 8-byte payloads, in nvcc's header layout."""
    body = b"".join(struct.pack("<HHIQIIHHIQ", kind, 1, 64, 8, 0, 0, 0, 0, sm, 0)
                    + struct.pack("<Q", flags) + bytes(16) + b"payload!"
                    for kind, sm, flags in entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_fatbin_parser_on_crafted_blobs():
    blob = (b"junk" + _fatbin((2, 90, 0x11), (1, 120, 0x8011)) + b"\0" * 5
            + _fatbin((2, 100, 0x200011), (2, 80, 0x11), (3, 70, 0)) + _fatbin((2, 90, 0x100011)))
    assert info.fatbin_architectures(blob) == ["sm_80", "sm_90", "sm_90a", "sm_100f", "compute_120"]
    assert info.fatbin_architectures(b"no fatbin here") == []
    assert info.fatbin_architectures(_fatbin((2, 90, 0x11))[:40]) == []  # truncated entry
    assert info.elf_section(b"not an ELF file", ".nv_fatbin") is None


def test_architectures_from_cuobjdump_when_no_fatbin(tmp_path, monkeypatch):
    plain = tmp_path / "plain.so"
    plain.write_bytes(b"\x7fELF but nothing else")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert info.library_architectures(plain) == (
        [], "no fatbin headers found, nothing from cuobjdump")
    tool = tmp_path / "cuobjdump"
    tool.write_text("#!/bin/sh\necho 'ELF file    1: plain.1.sm_90.cubin'\n"
                    "echo 'ELF file    2: plain.2.sm_80.cubin'\necho 'PTX file    1: plain.1.sm_90.ptx'\n")
    tool.chmod(0o755)
    assert info.library_architectures(plain) == (["sm_80", "sm_90", "compute_90"],
                                                "listed by cuobjdump")


@pytest.mark.parametrize("capability, archs, want", [
    ((9, 0), ["sm_80", "sm_89", "sm_90", "sm_100", "sm_120", "compute_120"], "sm_90 cubin"),
    ((8, 9), ["sm_80", "sm_89", "sm_90"], "sm_89 cubin"),
    ((8, 6), ["sm_80", "sm_89", "sm_90"], "sm_80 cubin"),
    ((10, 3), ["sm_100f", "compute_120"], "sm_100f cubin"),
    ((12, 1), ["sm_90", "compute_90", "compute_120"], "compute_120 PTX (JIT-compiled at first use)"),
    ((9, 0), ["sm_90a"], "sm_90a cubin"),
    ((10, 0), ["sm_90a", "compute_90a"], "none in this library"),
    ((7, 5), ["sm_80", "compute_80"], "none in this library"),
])
def test_which_code_a_gpu_runs(capability, archs, want):
    assert info.kernels_for(*capability, archs) == want


def _fake_driver(cu_init_error: int = 0) -> types.SimpleNamespace:
    """A stand-in for cuda.bindings.driver with one GPU of compute capability 9.0."""
    attrs = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
                                  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor")

    def cuDriverGetVersion():
        return 0, 12080

    def cuInit(flags):
        return (cu_init_error,)

    def cuDeviceGetCount():
        return 0, 1

    def cuDeviceGet(ordinal):
        return 0, ordinal

    def cuDeviceGetAttribute(attribute, device):
        return 0, {"major": 9, "minor": 0}[attribute]

    def cuDeviceGetName(length, device):
        return 0, b"Test GPU\0\0\0"

    def cuDeviceTotalMem(device):
        return 0, 141 << 30

    def cuGetErrorName(error):
        return 0, b"CUDA_ERROR_NO_DEVICE"

    return types.SimpleNamespace(CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
                                 CUdevice_attribute=attrs, **{f.__name__: f for f in (
                                     cuDriverGetVersion, cuInit, cuDeviceGetCount, cuDeviceGet,
                                     cuDeviceGetAttribute, cuDeviceGetName, cuDeviceTotalMem,
                                     cuGetErrorName)})


def test_gpu_lines_name_each_gpu_and_the_code_it_runs(monkeypatch):
    monkeypatch.setattr(_device, "cu", _fake_driver())
    assert info.gpu_lines(["sm_80", "sm_90"]) == [
        "CUDA driver API: 12.8",
        "GPU 0: Test GPU, compute capability 9.0, 141.0 GiB; runs: sm_90 cubin"]


def test_gpu_lines_without_a_gpu_end_in_one_reason(monkeypatch):
    monkeypatch.setattr(_device, "cu", _fake_driver(cu_init_error=100))
    assert info.gpu_lines(["sm_90"]) == ["CUDA driver API: 12.8",
                                        "no GPU: cuInit failed: CUDA_ERROR_NO_DEVICE"]
    monkeypatch.setattr(_device, "cu", None)
    assert info.gpu_lines(["sm_90"]) == [
        "no GPU: cuda.bindings is not importable (pip install cuda-python)"]


# ---- demo --------------------------------------------------------------------------------------------


def _median_error(stdout: str) -> float:
    line = next(line for line in stdout.splitlines() if line.startswith("format error"))
    return float(re.search(r"median (\S+)$", line).group(1))


def test_demo_on_the_cpu_reports_the_reference_path_and_the_format_error(capsys):
    """The quantisation error of the decode (V dominates it) must be about the RMS error of a
    Lloyd-Max quantiser of a unit Gaussian, relative to the signal: sqrt(MSE), and fall with
    the bits."""
    medians = {}
    for bits in (2, 3, 4):
        assert cli.main([*SMALL_DEMO, "--cpu", "--bits", str(bits)]) == 0
        out = capsys.readouterr().out
        assert "NumPy reference only (--cpu)" in out and "PASS" not in out
        assert "3 sequences of 300, 64, 17 tokens" in out
        medians[bits] = _median_error(out)
        assert 0.5 < medians[bits] / LLOYD_MAX_MSE[bits] ** 0.5 < 1.5, medians
    assert medians[2] > medians[3] > medians[4]


def test_demo_on_the_cpu_with_several_query_tokens(capsys):
    """Every query row of a multi-token decode compared with its own causal prefix: the format
    error stays that of the one-token decode (a row set against the wrong positions would not)."""
    assert cli.main([*SMALL_DEMO, "--cpu", "--q-len", "4"]) == 0
    out = capsys.readouterr().out
    assert "3 sequences of 300, 64, 17 tokens; 4 query tokens per sequence, 8 query heads" in out
    assert 0.5 < _median_error(out) / LLOYD_MAX_MSE[3] ** 0.5 < 1.5


def test_demo_without_a_gpu_says_so_in_one_line():
    if not gpu_absent():
        pytest.skip("a GPU is present")
    done = run_module(*SMALL_DEMO)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    notes = [line for line in done.stdout.splitlines() if "NumPy reference only" in line]
    assert len(notes) == 1 and "no usable CUDA GPU" in notes[0]


def _demo_args(*extra: str):
    return cli.build_parser().parse_args([*SMALL_DEMO, *extra])


def test_demo_case_pages_every_sequence():
    case = demo.build_demo_case(_demo_args("--block-size", "16"))
    slots = case.slot_mapping
    assert len(slots) == 381 and len(set(slots.tolist())) == 381
    assert slots.max() < case.layout.num_slots and case.layout.num_blocks == 19 + 4 + 2
    for s, (start, length) in enumerate(zip(case.starts, case.seq_lens)):
        tokens = np.arange(length)
        assert np.array_equal(slots[start:start + length] // 16, case.block_tables[s, tokens // 16])
        assert np.array_equal(slots[start:start + length] % 16, tokens % 16)
    assert case.k_scale == pytest.approx(np.abs(case.keys.astype(np.float32)).max() / 448)


def test_demo_case_with_several_query_tokens():
    case = demo.build_demo_case(_demo_args("--q-len", "4"))
    assert case.q_len == 4 and case.q.shape == (3 * 4, 8, 64)
    shape = case.shape("decode")
    assert (shape.q_len, shape.query_rows) == (4, 12)
    assert shape.query_start.tolist() == [0, 4, 8, 12]
    assert case.shape("write").q_len == 1
    with pytest.raises(ValueError, match="q_len 4 is more than the 3 tokens of the shortest sequence"):
        demo.build_demo_case(_demo_args("--q-len", "4", "--seq-lens", "300,3"))


def test_exact_attention_of_query_token_i_attends_its_causal_prefix():
    """Row (s, i) of a q_len-token case equals the one-token attention of its query over the
    first seq_len - q_len + i + 1 positions of sequence s."""
    rng = np.random.default_rng(5)
    seq_lens, q_len = [5, 9], 3
    keys, values = (rng.standard_normal((sum(seq_lens), 2, 32)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((len(seq_lens) * q_len, 4, 32)).astype(np.float32)
    out = demo.exact_attention(demo.make_case(keys, values, q, seq_lens, 3, 16, rng, q_len))
    for row in range(len(q)):
        s, i = divmod(row, q_len)
        start, end = sum(seq_lens[:s]), seq_lens[s] - q_len + i + 1
        prefix = demo.make_case(keys[start:start + end], values[start:start + end], q[row:row + 1],
                                [end], 3, 16, rng)
        np.testing.assert_allclose(out[row], demo.exact_attention(prefix)[0], rtol=1e-12)
    assert not np.allclose(out[0], out[1])  # tokens 0 and 1 see different prefixes


def test_exact_attention_of_one_token_is_its_value():
    rng = np.random.default_rng(3)
    keys, values = (rng.standard_normal((1 + 5, 2, 32)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((2, 6, 32)).astype(np.float32)
    case = demo.make_case(keys, values, q, [1, 5], 3, 16, rng)
    out = demo.exact_attention(case)
    group_values = case.values[0].astype(np.float64).repeat(3, axis=0)  # q head h -> KV head h // 3
    assert np.array_equal(out[0], group_values)
    assert not np.allclose(out[1], out[1][:1])  # the 5-token sequence mixes its values


def test_demo_takes_k_v_and_q_from_a_file(tmp_path, capsys):
    rng = np.random.default_rng(4)
    k, v = (rng.standard_normal((16, 2, 64)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    path = tmp_path / "kv.npz"
    np.savez(path, k=k, v=v, q=q, seq_lens=np.array([10, 6]))
    case = demo.build_demo_case(_demo_args("--kv-file", str(path)))
    bf16 = ml_dtypes.bfloat16
    assert np.array_equal(case.keys, k.astype(bf16)) and np.array_equal(case.values, v.astype(bf16))
    assert np.array_equal(case.q, q.astype(bf16)) and case.seq_lens.tolist() == [10, 6]
    assert cli.main([*SMALL_DEMO[:1], "--cpu", "--no-progress", "--kv-file", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 sequences of 10, 6 tokens; 4 query heads, 2 KV heads, head_dim 64" in out
    assert f"K/V from {path}" in out


@pytest.mark.parametrize("arrays, extra, message", [
    ({"k": np.zeros((4, 2, 64))}, [], "has no v array"),
    ({"k": np.zeros((4, 2, 64)), "v": np.zeros((4, 2, 32))}, [], "must both be"),
    ({"k": np.ones((4, 2, 64)), "v": np.ones((4, 2, 64))}, ["--seq-lens", "3"], "add up to the 4"),
    ({"k": np.ones((4, 3, 64)), "v": np.ones((4, 3, 64))}, [], "multiple of 3 query heads"),
    ({"k": np.ones((4, 2, 40)), "v": np.ones((4, 2, 40))}, [], "head_dim"),
])
def test_demo_rejects_bad_files_in_one_line(tmp_path, capsys, arrays, extra, message):
    path = tmp_path / "kv.npz"
    np.savez(path, **arrays)
    assert cli.main(["demo", "--cpu", "--no-progress", "--kv-file", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m fp8kturbov demo: error: ") and message in err
    assert len(err.splitlines()) == 1


class _HostDevice:
    """Stands for `Device` in the demo's GPU path: "device memory" is host arrays."""

    stream = 0

    def __init__(self) -> None:
        self.memory: dict[int, np.ndarray] = {}
        self.closed = False

    def upload(self, host: np.ndarray) -> int:
        address = 4096 * (len(self.memory) + 1)
        self.memory[address] = np.ascontiguousarray(host).copy()
        return address

    def alloc(self, nbytes: int) -> int:
        return self.upload(np.zeros(nbytes, dtype=np.uint8))

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def host_gpu(monkeypatch):
    """The demo's GPU path with the kernels replaced by the NumPy reference on host memory;
    ``dev.corrupt`` optionally edits (pools, output) after each launch."""
    from fp8kturbov import reference as ref

    dev, bf16 = _HostDevice(), ml_dtypes.bfloat16
    dev.corrupt = lambda what, array: None
    mem = dev.memory

    def write(shape, layout, k_scale, buffers, stream, options=None):
        n = layout.row_elems
        encoder = (options or {}).get("v_encoder", fp8kturbov.VEncoder.MATCHED_NORM).name.lower()
        rotation = (options or {}).get("v_rotation", fp8kturbov.VRotation.NONE) != fp8kturbov.VRotation.NONE
        ref.write_cache(mem[buffers.key].view(bf16), mem[buffers.value].view(bf16),
                        mem[buffers.k_cache], mem[buffers.v_cache], mem[buffers.slot_mapping],
                        shape.batch, layout.num_kv_heads, layout.head_dim, layout.block_size, n, n,
                        k_scale, layout.k_block_stride_bytes, layout.v_block_stride_bytes,
                        layout.v_data_section_bytes, layout.v_bits, encoder=encoder, rotation=rotation)
        dev.corrupt("v_pool", mem[buffers.v_cache])

    def decode(scalars, buffers, stream):
        scalars = dict(scalars)
        sinks = mem[scalars.pop("sinks")] if "sinks" in scalars else None
        query_start = mem[scalars.pop("query_start")] if "query_start" in scalars else None
        rows = scalars.pop("num_query_rows", len(mem[buffers.seq_lens]))
        del scalars["max_q_len"]  # the reference reads the query rows from query_start
        rotation = scalars.pop("v_rotation") != fp8kturbov.VRotation.NONE
        out = ref.paged_decode(mem[buffers.q].view(bf16), mem[buffers.k_cache],
                               mem[buffers.v_cache], mem[buffers.block_tables],
                               mem[buffers.seq_lens], bits=scalars.pop("v_bits"),
                               sliding_window=0, sinks=sinks, query_start=query_start,
                               rotation=rotation, **scalars)
        assert len(out) == rows
        dev.corrupt("output", out)
        mem[buffers.output][...] = out.astype(bf16).view(np.uint16)

    monkeypatch.setattr(demo, "open_device", lambda: (dev, ""))
    monkeypatch.setattr(demo, "paged_decode_workspace_bytes", lambda **scalars: 0)
    monkeypatch.setattr(demo, "_download", lambda d, address, like: mem[address].copy())
    monkeypatch.setattr(bench.launches, "launch_write", write)
    monkeypatch.setattr(bench.launches, "launch_decode", decode)
    monkeypatch.setattr(bench.timing, "time_launches",
                        lambda d, launches, iters, warmup: bench.timing.Timing.of([2.5] * iters))
    return dev


def test_demo_options_reach_the_case():
    args = cli.build_parser().parse_args([*SMALL_DEMO, "--v-encoder", "mse", "--soft-cap", "20", "--sinks"])
    case = demo.build_demo_case(args)
    assert (case.v_encoder, case.soft_cap) == ("mse", 20.0)
    assert case.sinks.dtype == np.float32 and case.sinks.shape == (8,) and np.all(np.isfinite(case.sinks))
    assert demo.build_demo_case(cli.build_parser().parse_args(SMALL_DEMO)).sinks is None
    with pytest.raises(ValueError, match="--soft-cap"):
        demo.build_demo_case(cli.build_parser().parse_args([*SMALL_DEMO, "--soft-cap", "-1"]))
    with pytest.raises(ValueError, match=re.escape("needs a head_dim in (128, 256, 512), not 64")):
        demo.build_demo_case(cli.build_parser().parse_args([*SMALL_DEMO, "--v-rotation", "hadamard"]))
    rotated = demo.build_demo_case(cli.build_parser().parse_args(
        [*SMALL_DEMO, "--head-dim", "128", "--v-rotation", "hadamard"]))
    assert rotated.v_rotation == "hadamard" and rotated.decode_scalars(0.0)["v_rotation"] is fp8kturbov.VRotation.HADAMARD


def test_exact_attention_applies_the_soft_cap_and_the_sinks():
    """Exact attention with options against the reference's float64 decode over unquantised
    values: K and V given as float32 bf16-exact rows, one page per sequence."""
    args = cli.build_parser().parse_args([*SMALL_DEMO, "--soft-cap", "0.5", "--sinks"])
    case = demo.build_demo_case(args)
    plain = demo.exact_attention(demo.build_demo_case(cli.build_parser().parse_args(SMALL_DEMO)))
    with_options = demo.exact_attention(case)
    assert not np.allclose(with_options, plain, atol=1e-3), "the options changed nothing"
    # One sequence, one head, by hand: scores capped, the sink in the denominator.
    s, h = 1, 5
    group = case.q.shape[1] // case.keys.shape[1]
    start, length = int(case.starts[s]), int(case.seq_lens[s])
    k = case.keys[start:start + length, h // group].astype(np.float64)
    v = case.values[start:start + length, h // group].astype(np.float64)
    scores = k @ case.q[s, h].astype(np.float64) * case.keys.shape[2] ** -0.5
    scores = 0.5 * np.tanh(scores / 0.5)
    top = max(scores.max(), float(case.sinks[h]))
    weights = np.exp(scores - top)
    want = weights @ v / (weights.sum() + np.exp(float(case.sinks[h]) - top))
    np.testing.assert_allclose(with_options[s, h], want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("options", [["--v-encoder", "mse"], ["--v-encoder", "projection"],
                                     ["--soft-cap", "3", "--sinks"],
                                     ["--q-len", "4"], ["--q-len", "16", "--seq-lens", "300,16"],
                                     ["--head-dim", "128", "--v-rotation", "hadamard"]],
                         ids=["mse_encoder", "projection_encoder", "soft_cap_and_sinks", "q_len",
                              "q_len_of_the_shortest", "v_rotation"])
def test_demo_gpu_path_with_options_passes_when_the_kernels_agree(host_gpu, capsys, options):
    assert cli.main([*SMALL_DEMO, "--iters", "3", *options]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS: the kernels match the reference")


def test_demo_gpu_path_passes_when_the_kernels_agree(host_gpu, capsys):
    assert cli.main([*SMALL_DEMO, "--iters", "3"]) == 0
    out = capsys.readouterr().out
    assert "write, K pool: identical to the reference" in out
    assert "write, V pool: identical to the reference" in out
    assert "write 2.5 us (381 tokens), decode 2.5 us" in out and "median of 3" in out
    assert out.rstrip().endswith("PASS: the kernels match the reference") and host_gpu.closed


def test_demo_gpu_path_fails_on_a_changed_byte(host_gpu, capsys):
    def flip_one_byte(what, array):
        if what == "v_pool":
            array[7] ^= 1

    host_gpu.corrupt = flip_one_byte
    assert cli.main([*SMALL_DEMO, "--iters", "3"]) == 1
    out = capsys.readouterr().out
    assert "write, V pool: 1 of " in out and "differ from the reference, first at [7]" in out
    assert out.rstrip().endswith("FAIL: the kernels differ from the reference")


def test_demo_gpu_path_fails_on_a_wrong_decode(host_gpu, capsys):
    def scale_output(what, array):
        if what == "output":
            array *= 1.05

    host_gpu.corrupt = scale_output
    assert cli.main([*SMALL_DEMO, "--iters", "3"]) == 1
    out = capsys.readouterr().out
    decode = next(line for line in out.splitlines() if line.startswith("decode vs"))
    assert float(re.search(r"max (\S+),", decode).group(1)) == pytest.approx(0.05, rel=0.1)
    assert "FAIL" in out


# ---- On a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_demo_on_a_gpu_matches_the_reference(bits):
    done = run_module("demo", "--no-progress", "--bits", str(bits), "--iters", "5")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "NumPy reference only" not in out
    assert "write, K pool: identical to the reference" in out
    assert "write, V pool: identical to the reference" in out
    decode = next(line for line in out.splitlines() if line.startswith("decode vs"))
    assert float(re.search(r"max (\S+),", decode).group(1)) <= demo.DECODE_REL_TOL
    assert re.search(r"write \d+\.\d us \(4225 tokens\), decode \d+\.\d us", out), out
    assert out.rstrip().endswith("PASS: the kernels match the reference")


@pytest.mark.gpu
def test_demo_on_a_gpu_with_several_query_tokens_matches_the_reference():
    done = run_module("demo", "--no-progress", "--q-len", "4", "--iters", "5")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "4 query tokens per sequence" in out and "NumPy reference only" not in out
    decode = next(line for line in out.splitlines() if line.startswith("decode vs"))
    assert float(re.search(r"max (\S+),", decode).group(1)) <= demo.DECODE_REL_TOL
    assert "unwritten" not in decode
    assert out.rstrip().endswith("PASS: the kernels match the reference")
