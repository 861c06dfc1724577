"""What ``python -m fp8kturbov info``, ``--include-dir`` and ``--library`` report.

`include_dir` finds ``fp8kturbov.h``; `library_architectures` reads the GPU code the library
holds from its fatbin headers (no GPU, no toolkit needed), `kernels_for` picks the code a GPU
runs; `gpu_lines` asks the driver for its version and the GPUs; `summary` is the whole
``info`` report.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Sequence

from fp8kturbov import __version__, _device, library_path, version
from fp8kturbov._device import BenchError, first_line

from .console import GiB

HEADER_NAME = "fp8kturbov.h"


def include_dir() -> Path:
    """The folder holding ``fp8kturbov.h``: ``include/`` inside the installed package (where the
    wheel puts it), else ``cuda/include`` of the source checkout the package is imported from
    (run with ``FP8KTURBOV_LIBRARY`` pointing at a built library). Raises FileNotFoundError."""
    package = Path(__file__).resolve().parents[1]  # this module is fp8kturbov/tools/info.py
    candidates = [package / "include", package.parents[1] / "cuda" / "include"]
    for folder in candidates:
        if (folder / HEADER_NAME).is_file():
            return folder
    raise FileNotFoundError(f"{HEADER_NAME} is in none of {', '.join(map(str, candidates))}; "
                            "reinstall the package with pip")


# ---- The GPU code inside the library -------------------------------------------------------------

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
#: Fatbin entry kinds: 1 holds PTX (JIT-compiled by the driver), 2 an ELF cubin.
_ENTRY_PREFIX = {1: "compute_", 2: "sm_"}
#: Entry flag bits of the arch-specific (``a``) and family (``f``) variants (as nvcc 13 sets them).
_SUFFIX_FLAGS = ((0x100000, "a"), (0x200000, "f"))


def _arch_order(name: str) -> tuple[bool, int, str]:
    """Sort key: cubins before PTX, then by SM number."""
    return name.startswith("compute_"), int(re.sub(r"\D", "", name)), name


def elf_section(image: bytes, name: str) -> bytes | None:
    """The bytes of section ``name`` of a 64-bit little-endian ELF image, or None (not such an
    ELF file, or no such section). Raises struct.error on a truncated image."""
    if image[:6] != b"\x7fELF\x02\x01":
        return None
    (table,) = struct.unpack_from("<Q", image, 0x28)  # e_shoff
    entry_bytes, count, names_index = struct.unpack_from("<HHH", image, 0x3A)

    def section(i: int) -> tuple[int, int, int]:  # (sh_name, sh_offset, sh_size)
        base = table + i * entry_bytes
        (name_offset,) = struct.unpack_from("<I", image, base)
        return (name_offset, *struct.unpack_from("<QQ", image, base + 0x18))

    names = section(names_index)[1]
    wanted = name.encode() + b"\0"
    for i in range(count):
        name_offset, offset, size = section(i)
        if image[names + name_offset:names + name_offset + len(wanted)] == wanted:
            return image[offset:offset + size]
    return None


def fatbin_architectures(blob: bytes) -> list[str]:
    """The GPU code in the fatbins of ``blob``: cubins as ``sm_XY``, PTX as ``compute_XY``,
    arch-specific and family variants suffixed ``a`` / ``f``; cubins first, by SM number.

    The layout read is the one nvcc writes (it has no public specification): a fatbin is a
    16-byte header ``magic 0xBA55ED50 (u32), version (u16), header bytes (u16), body bytes (u64)``
    and a body of entries, each starting ``kind (u16), version (u16), header bytes (u32), payload
    bytes (u64)``, with the SM number (u32) at byte 28 and flags (u64) at byte 40.
    """
    found: set[str] = set()
    start = blob.find(FATBIN_MAGIC)
    while 0 <= start <= len(blob) - 16:
        _, _, header_bytes, body_bytes = struct.unpack_from("<IHHQ", blob, start)
        entry, end = start + header_bytes, min(start + header_bytes + body_bytes, len(blob))
        while entry + 48 <= end:
            kind, _, entry_header_bytes, payload_bytes = struct.unpack_from("<HHIQ", blob, entry)
            (sm,) = struct.unpack_from("<I", blob, entry + 28)
            (flags,) = struct.unpack_from("<Q", blob, entry + 40)
            if kind in _ENTRY_PREFIX:
                suffix = "".join(letter for bit, letter in _SUFFIX_FLAGS if flags & bit)
                found.add(f"{_ENTRY_PREFIX[kind]}{sm}{suffix}")
            if entry_header_bytes == 0:
                break
            entry += entry_header_bytes + payload_bytes
        start = blob.find(FATBIN_MAGIC, max(end, start + 4))
    return sorted(found, key=_arch_order)


def cuobjdump_architectures(path: Path) -> list[str]:
    """The architectures ``cuobjdump --list-elf --list-ptx`` names (``x.1.sm_90.cubin`` ->
    ``sm_90``, ``x.1.sm_120.ptx`` -> ``compute_120``); [] without the tool or on its failure."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        return []
    try:
        listing = subprocess.run([tool, "--list-elf", "--list-ptx", str(path)],
                                 capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = {("sm_" if kind == "cubin" else "compute_") + arch
             for arch, kind in re.findall(r"\bsm_(\d+[af]?)\.(cubin|ptx)\b", listing)}
    return sorted(found, key=_arch_order)


def library_architectures(path: Path) -> tuple[list[str], str]:
    """The GPU architectures the library at ``path`` has code for, and how they were found:
    the fatbin headers of its ``.nv_fatbin`` section, read directly (no GPU, no toolkit), else
    ``cuobjdump`` where it is on PATH; an empty list and the reason when neither finds any."""
    try:
        image = path.read_bytes()
    except OSError as exc:
        return [], f"cannot read the library: {first_line(exc)}"
    try:
        section = elf_section(image, ".nv_fatbin")
        found = fatbin_architectures(image if section is None else section)
    except struct.error:
        found = []
    if found:
        return found, "read from the library's fatbin headers"
    found = cuobjdump_architectures(path)
    if found:
        return found, "listed by cuobjdump"
    return [], "no fatbin headers found, nothing from cuobjdump"


def _runs_on(name: str, major: int, minor: int) -> bool:
    """Whether code ``name`` (``sm_90``, ``compute_120``, ``sm_90a``...) runs on a GPU of
    compute capability ``major.minor``: a cubin (or family PTX) of its major version not above
    it, PTX not above it, an arch-specific (``a``) build of exactly it."""
    kind, number, suffix = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", name).groups()
    sm, device = int(number), 10 * major + minor
    if suffix == "a":
        return sm == device
    if kind == "sm" or suffix == "f":
        return sm // 10 == major and sm <= device
    return sm <= device


def kernels_for(major: int, minor: int, archs: Sequence[str]) -> str:
    """The code of ``archs`` a GPU of compute capability ``major.minor`` runs: the newest cubin
    it can run, else the newest PTX (JIT-compiled by the driver at first use)."""
    usable = [name for name in archs if _runs_on(name, major, minor)]
    cubins = [name for name in usable if name.startswith("sm_")]
    if cubins:
        return f"{cubins[-1]} cubin"
    return f"{usable[-1]} PTX (JIT-compiled at first use)" if usable else "none in this library"


# ---- The driver and the GPUs ---------------------------------------------------------------------


def gpu_lines(archs: Sequence[str]) -> list[str]:
    """The CUDA driver's version and one line per GPU (name, compute capability, memory, the
    library's code it would run); where that fails, what was found and one ``no GPU: <reason>``."""
    cu, call = _device.cu, _device.driver_call
    if cu is None:
        return ["no GPU: cuda.bindings is not importable (pip install cuda-python)"]
    lines: list[str] = []
    try:
        driver = call(cu.cuDriverGetVersion)
        lines.append(f"CUDA driver API: {driver // 1000}.{driver % 1000 // 10}")
        call(cu.cuInit, 0)
        count = call(cu.cuDeviceGetCount)
        for ordinal in range(count):
            device = call(cu.cuDeviceGet, ordinal)
            major, minor = (call(cu.cuDeviceGetAttribute, getattr(
                cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{part}"), device)
                for part in ("MAJOR", "MINOR"))
            name = call(cu.cuDeviceGetName, 256, device).split(b"\0", 1)[0].decode()
            memory = call(cu.cuDeviceTotalMem, device) / GiB
            lines.append(f"GPU {ordinal}: {name}, compute capability {major}.{minor}, "
                         f"{memory:.1f} GiB; runs: {kernels_for(major, minor, archs)}")
    except BenchError as exc:  # a driver call failed
        return lines + [f"no GPU: {first_line(exc)}"]
    except Exception as exc:  # cuda.bindings raises when it cannot load the driver library
        return lines + [f"no GPU: {type(exc).__name__}: {first_line(exc)}"]
    return lines if count else lines + ["no GPU: the driver reports no CUDA device"]


def summary() -> list[str]:
    """The lines of ``info``: the library's version, ABI, CUDA runtime, build commit and path, the
    header's path, the CUDA architectures the library holds code for, then `gpu_lines`."""
    from fp8kturbov._lib import build_commit, cuda_runtime_version, lib  # only this report loads it

    path = library_path().resolve()
    try:
        header = str(include_dir() / HEADER_NAME)
    except FileNotFoundError as exc:
        header = f"not found: {exc}"
    archs, method = library_architectures(path)
    return [
        f"fp8kturbov library {version()} (ABI {lib.fp8kturbov_abi_version()}, CUDA runtime "
        f"{cuda_runtime_version()}, commit {build_commit() or 'unknown'}), Python package {__version__}",
        f"library: {path}",
        f"header: {header}",
        f"CUDA architectures: {' '.join(archs) or 'unknown'} ({method})",
        *gpu_lines(archs)]
