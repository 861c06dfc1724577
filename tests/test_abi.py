"""CPU tests of the C ABI (cuda/include/fp8kturbov.h) and of the ctypes layer over it.

No GPU is needed, and the tests also pass on a GPU machine: every call that could launch either
has zero work (num_tokens = 0 / num_seqs = 0, a no-op) or breaks a rule checked before the launch.
The one real launch attempt (fake pointers, expecting CUDA_ERROR) runs only where conftest finds
no usable GPU.

Expected values come from the header text (version macros, the status enum, the declarations, the
struct fields, the documented defaults) and from the FORMAT.md size formulas, never from the
library under test.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import itertools
import math
import re
import shutil
import struct
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

import fp8kturbov
from abi_util import (EXCEPTIONS, EntryPoint, last_error, no_gpu, struct_before_an_unreadable_page,
                      old_struct_sizes, v1_struct_size)
from conftest import gpu_unavailable_reason
from fp8kturbov import Status, _lib, ops
from fp8kturbov._lib import lib

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "cuda" / "include" / "fp8kturbov.h"
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1



# ---- The header, parsed ---------------------------------------------------------------------------
def _header_code() -> str:
    """The header without comments, with line continuations joined."""
    if not HEADER.exists():
        pytest.skip(f"{HEADER} not found (tests run from a checkout)", allow_module_level=True)
    text = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    return text.replace("\\\n", " ")


def header_macro(name: str) -> int:
    return int(re.search(rf"#define\s+{name}\s+(\d+)\b", _header_code()).group(1))


def header_status_enum() -> dict[str, int]:
    body = re.search(r"typedef enum fp8kturbov_status \{(.*?)\}", _header_code(), re.S).group(1)
    return {name: int(value) for name, value in re.findall(r"(FP8KTURBOV_STATUS_\w+)\s*=\s*(\d+)", body)}


def _split_decl(decl: str) -> tuple[str, str]:
    """``"const void* key"`` -> ``("const void*", "key")``."""
    decl = " ".join(decl.replace("*", "* ").split())
    type_, name = decl.rsplit(" ", 1)
    return type_.replace(" *", "*"), name


@functools.lru_cache(maxsize=None)
def header_functions() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """name -> (return type, [(parameter type, parameter name)]), the DECLARE macros expanded."""
    code = _header_code()
    lines = code.splitlines()
    plain = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    for macro, body in re.findall(r"#define\s+(FP8KTURBOV_DECLARE_\w+)\(BITS\)(.*)", code):
        for bits in re.findall(rf"^\s*{macro}\((\d+)\)", code, re.M):
            plain = plain.replace(f"{macro}({bits})", body.replace("##BITS##", bits), 1)
    functions = {}
    pattern = r"FP8KTURBOV_API\s+([\w\s\*]+?)\s*\b(fp8kturbov_\w+)\s*\(([^)]*)\)\s*;"
    for ret, name, params in re.findall(pattern, plain):
        params = params.strip()
        decls = [] if params == "void" else [_split_decl(p) for p in params.split(",")]
        functions[name] = (" ".join(ret.replace("*", "* ").split()).replace(" *", "*"), decls)
    return functions


def header_struct(tag: str) -> list[tuple[str, str]]:
    """[(field type, field name)] of ``typedef struct <tag> {...}``."""
    body = re.search(rf"typedef struct {tag} \{{(.*?)\}}", _header_code(), re.S).group(1)
    return [_split_decl(decl) for decl in body.split(";") if decl.strip()]


def ctype_of(c_type: str) -> Any:
    """The ctypes type the C ABI of ``c_type`` requires on this platform."""
    structs = {"fp8kturbov_write_params_t": _lib.WriteParams,
               "fp8kturbov_decode_params_t": _lib.DecodeParams,
               "fp8kturbov_dequantize_params_t": _lib.DequantizeParams,
               "fp8kturbov_prefill_params_t": _lib.PrefillParams}
    base = c_type.replace("const ", "")
    if base.endswith("*") and base[:-1] in structs:
        return ctypes.POINTER(structs[base[:-1]])
    if base == "char*":
        return ctypes.c_char_p
    if base == "uint64_t*":  # an out-parameter
        return ctypes.POINTER(ctypes.c_uint64)
    if base.endswith("*") or base == "fp8kturbov_stream_t":
        return ctypes.c_void_p
    return {"void": None, "int": ctypes.c_int, "fp8kturbov_status_t": ctypes.c_int,
            "size_t": ctypes.c_size_t, "uint32_t": ctypes.c_uint32,
            "uint64_t": ctypes.c_uint64, "float": ctypes.c_float}[base]






# ---- Versions and statuses -------------------------------------------------------------------------
def test_versions_match_header():
    major, minor, patch = (header_macro(f"FP8KTURBOV_VERSION_{p}") for p in ("MAJOR", "MINOR", "PATCH"))
    assert lib.fp8kturbov_version() == major * 10000 + minor * 100 + patch
    assert fp8kturbov.version() == f"{major}.{minor}.{patch}" == fp8kturbov.__version__
    abi = header_macro("FP8KTURBOV_ABI_VERSION")
    assert lib.fp8kturbov_abi_version() == abi == fp8kturbov.ABI_VERSION


def test_status_enum_and_strings_match_header():
    enum = header_status_enum()
    assert enum, "no FP8KTURBOV_STATUS_ values parsed from the header"
    assert {f"FP8KTURBOV_STATUS_{s.name}": int(s) for s in Status} == enum
    for name, value in enum.items():
        assert lib.fp8kturbov_status_string(value).decode() == name


@pytest.mark.parametrize("offset", [1, 100])
def test_status_string_of_unknown_value(offset):
    enum = header_status_enum()
    for value in (max(enum.values()) + offset, -offset):
        text = lib.fp8kturbov_status_string(value)
        assert text is not None and text.decode().startswith("FP8KTURBOV_STATUS_")
        assert text.decode() not in enum


# ---- Signatures, exports and struct mirrors ----------------------------------------------------------
def test_signature_table_matches_header_declarations():
    declared = header_functions()
    fixed_bits = {f"fp8kturbov_{op}_fp8k_turbo{bits}v" for op in ("reshape_and_cache", "paged_decode_attn")
                  for bits in (2, 3, 4)}
    assert fixed_bits <= set(declared)  # the FP8KTURBOV_DECLARE_* macros were expanded
    assert set(_lib.SIGNATURES) == set(declared)
    for name, (ret, params) in declared.items():
        restype, argtypes = _lib.SIGNATURES[name]
        assert restype is ctype_of(ret), name
        assert argtypes == [ctype_of(t) for t, _ in params], name


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found")
    return path


def exported_symbols() -> set[str]:
    out = subprocess.run([_tool("nm"), "-D", "--defined-only", str(fp8kturbov.library_path())],
                         capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if len(line.split()) == 3}


def test_exports_are_exactly_the_signature_table():
    exported = exported_symbols()
    assert all(s.startswith("fp8kturbov_") for s in exported), sorted(exported)
    assert exported == set(_lib.SIGNATURES)


def test_library_needs_no_cuda_runtime_or_driver_library():
    out = subprocess.run([_tool("readelf"), "-d", str(fp8kturbov.library_path())],
                         capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.+?)\]", out)
    assert needed, "readelf printed no NEEDED entries"
    assert not [n for n in needed if re.match(r"libcuda(rt)?\.so", n)], needed


STRUCTS = {"fp8kturbov_write_params": _lib.WriteParams,
           "fp8kturbov_decode_params": _lib.DecodeParams,
           "fp8kturbov_dequantize_params": _lib.DequantizeParams,
           "fp8kturbov_prefill_params": _lib.PrefillParams}


@pytest.fixture(scope="module")
def c_struct_layout(tmp_path_factory) -> dict[str, dict[str, tuple[int, int]]]:
    """{struct tag: {field or "sizeof": (offset, size)}} as a C99 compiler lays them out."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    lines = []
    for tag in STRUCTS:
        lines.append(f'printf("{tag} sizeof 0 %zu\\n", sizeof({tag}_t));')
        for _, name in header_struct(tag):
            lines.append(f'printf("{tag} {name} %zu %zu\\n", offsetof({tag}_t, {name}), '
                         f"sizeof((({tag}_t*)0)->{name}));")
    src = tmp_path_factory.mktemp("layout") / "layout.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"fp8kturbov.h\"\n"
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = src.with_suffix("")
    subprocess.run([cc, "-std=c99", "-Wall", "-Werror", f"-I{HEADER.parent}", str(src), "-o", str(exe)],
                   check=True)
    layout: dict[str, dict[str, tuple[int, int]]] = {tag: {} for tag in STRUCTS}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
        tag, name, offset, size = line.split()
        layout[tag][name] = (int(offset), int(size))
    return layout


@pytest.mark.parametrize("tag", STRUCTS)
def test_struct_mirror_matches_c_layout(tag, c_struct_layout):
    mirror = STRUCTS[tag]
    fields = header_struct(tag)
    assert [name for name, _ in mirror._fields_] == [name for _, name in fields]
    assert [ctype for _, ctype in mirror._fields_] == [ctype_of(t) for t, _ in fields]
    c_layout = c_struct_layout[tag]
    assert ctypes.sizeof(mirror) == c_layout["sizeof"][1]
    for _, name in fields:
        assert (getattr(mirror, name).offset, getattr(mirror, name).size) == c_layout[name], name


# The fields each version after the first appended, in header order (version 1 = library 0.1).
ADDED_FIELDS = {"fp8kturbov_write_params": [["num_blocks", "error_flags"], ["v_encoder", "v_rotation"]],
                "fp8kturbov_decode_params": [["num_blocks", "error_flags"],
                                             ["sinks", "soft_cap", "query_start", "max_q_len", "num_query_rows",
                                              "v_rotation"], ["block_tables_stride"],
                                             ["append_key", "append_value", "append_slot_mapping",
                                              "append_key_stride", "append_value_stride", "v_encoder"]],
                "fp8kturbov_dequantize_params": [["num_blocks", "error_flags"]],
                "fp8kturbov_prefill_params": []}  # one version so far


@pytest.mark.parametrize("tag", STRUCTS)
def test_each_old_size_ends_where_the_next_version_s_fields_begin(tag, c_struct_layout):
    added = ADDED_FIELDS[tag]
    names = [name for _, name in header_struct(tag)]
    assert names[len(names) - sum(map(len, added)):] == [name for fields in added for name in fields]
    sizes = old_struct_sizes(tag.removeprefix("fp8kturbov_").removesuffix("_params"))
    assert sizes == [c_struct_layout[tag][fields[0]][0] for fields in added]


def documented_defaults(tag: str) -> dict[str, float]:
    """The ``name = value`` pairs of the header's "Fills *params with the defaults (...)" comment."""
    text = HEADER.read_text()
    init = text.index(f"{tag}_params_init(")
    comment = text[text.rindex("Fills *params with the defaults", 0, init):init]
    return {name: float(value) for name, value in re.findall(r"(\w+) = ([\d.e+-]+)", comment)}


@pytest.mark.parametrize("tag", ["write", "decode", "dequantize", "prefill"])
def test_params_init_sets_size_and_documented_defaults(tag):
    mirror = STRUCTS[f"fp8kturbov_{tag}_params"]
    params = mirror.from_buffer_copy(b"\xab" * ctypes.sizeof(mirror))  # garbage everywhere
    getattr(lib, f"fp8kturbov_{tag}_params_init")(ctypes.byref(params))
    defaults = documented_defaults(tag)
    assert "v_bits" in defaults
    assert params.struct_size == ctypes.sizeof(mirror)
    added = [name for fields in ADDED_FIELDS[f"fp8kturbov_{tag}_params"] for name in fields]
    assert {name for name, _ in mirror._fields_} >= set(added)  # zeroed too
    for name, ctype in mirror._fields_:
        if name == "struct_size":
            continue
        expected = defaults.get(name, 0)
        if ctype is ctypes.c_float:  # the documented decimal, rounded to float32
            expected = struct.unpack("f", struct.pack("f", expected))[0]
        assert (getattr(params, name) or 0) == expected, name


def garbage(nbytes: int) -> ctypes.Array:
    """``nbytes`` bytes of 0xAB."""
    buffer = ctypes.create_string_buffer(nbytes)
    ctypes.memset(buffer, 0xAB, nbytes)
    return buffer


@pytest.mark.parametrize("tag", ["write", "decode", "dequantize", "prefill"])
def test_params_init_sized_writes_exactly_the_callers_struct(tag):
    """Each accepted size (earlier versions and this header's) gets that version's defaults over
    exactly its bytes: a program built against an older header can run with this library."""
    mirror = STRUCTS[f"fp8kturbov_{tag}_params"]
    init_sized = getattr(lib, f"fp8kturbov_{tag}_params_init_sized")
    full = mirror.from_buffer_copy(b"\xab" * ctypes.sizeof(mirror))
    getattr(lib, f"fp8kturbov_{tag}_params_init")(ctypes.byref(full))
    before = set_error_message()
    for size in [*old_struct_sizes(tag), ctypes.sizeof(mirror)]:
        buffer = garbage(ctypes.sizeof(mirror) + 64)
        params = ctypes.cast(buffer, ctypes.POINTER(mirror))
        assert init_sized(params, size) == Status.SUCCESS
        assert last_error() == before  # success leaves the message alone
        assert params.contents.struct_size == size
        assert buffer.raw[8:size] == bytes(full)[8:size]  # the defaults of that version
        assert buffer.raw[size:] == b"\xab" * (len(buffer.raw) - size), size  # nothing past it


@pytest.mark.parametrize("tag", ["write", "decode", "dequantize"])
def test_params_init_sized_refuses_unknown_sizes_and_null(tag):
    mirror = STRUCTS[f"fp8kturbov_{tag}_params"]
    init_sized = getattr(lib, f"fp8kturbov_{tag}_params_init_sized")
    for size in (0, 8, old_struct_sizes(tag)[0] - 8, ctypes.sizeof(mirror) + 8, U64_MAX):
        buffer = garbage(ctypes.sizeof(mirror) + 64)
        assert init_sized(ctypes.cast(buffer, ctypes.POINTER(mirror)), size) == Status.BAD_STRUCT_SIZE
        assert f"struct_size = {size}" in last_error()
        assert buffer.raw == b"\xab" * len(buffer.raw)  # nothing written
    assert init_sized(None, ctypes.sizeof(mirror)) == Status.NULL_POINTER
    assert "params is NULL" in last_error()


# ---- Layout sizes (FORMAT.md §2, §3) --------------------------------------------------------------
V_PAGE_SIXTEENTHS = {4: 9, 3: 7, 2: 5}  # FORMAT §3: the V page is 9/7/5 · B·n/16 bytes


def format_sizes(block_size: int, num_kv_heads: int, head_dim: int, bits: int) -> dict[str, int]:
    """FORMAT.md §2, §3 packed sizes in bytes, with n = num_kv_heads·head_dim."""
    bn = block_size * num_kv_heads * head_dim
    return {"k_page_bytes": bn, "v_data_section_bytes": bn * bits // 8,
            "v_page_bytes": V_PAGE_SIXTEENTHS[bits] * bn // 16}


def c_sizes(block_size, num_kv_heads, head_dim, bits) -> dict[str, int]:
    return {"k_page_bytes": lib.fp8kturbov_k_page_bytes(block_size, num_kv_heads, head_dim),
            "v_data_section_bytes": lib.fp8kturbov_v_data_section_bytes(block_size, num_kv_heads, head_dim, bits),
            "v_page_bytes": lib.fp8kturbov_v_page_bytes(block_size, num_kv_heads, head_dim, bits)}


SHAPES = list(itertools.product([1, 16, 64], [1, 4, 8], [16, 64, 80, 128, 512]))


@pytest.mark.parametrize("block_size, num_kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_sizes_follow_format(block_size, num_kv_heads, head_dim, bits):
    expected = format_sizes(block_size, num_kv_heads, head_dim, bits)
    assert c_sizes(block_size, num_kv_heads, head_dim, bits) == expected
    layout = fp8kturbov.CacheLayout(3, block_size, num_kv_heads, head_dim, bits)
    assert layout.k_block_stride_bytes == expected["k_page_bytes"]
    assert layout.v_block_stride_bytes == expected["v_page_bytes"]
    assert layout.v_data_section_bytes == expected["v_data_section_bytes"]
    assert (layout.k_pool_bytes, layout.v_pool_bytes) == (3 * expected["k_page_bytes"], 3 * expected["v_page_bytes"])


@pytest.mark.parametrize("block_size, num_kv_heads, head_dim, bits", [
    (16, 2, 100, 3), (16, 2, 8, 3), (16, 2, 0, 3), (0, 2, 128, 3), (16, 0, 128, 3),
    (16, 2, 128, 0), (16, 2, 128, 1), (16, 2, 128, 5), (16, 2, 128, 8),
])
def test_sizes_of_invalid_arguments_are_zero(block_size, num_kv_heads, head_dim, bits):
    shape_ok = block_size and num_kv_heads and head_dim and head_dim % 16 == 0
    k_page = block_size * num_kv_heads * head_dim if shape_ok else 0
    assert c_sizes(block_size, num_kv_heads, head_dim, bits) == {
        "k_page_bytes": k_page, "v_data_section_bytes": 0, "v_page_bytes": 0}


@pytest.mark.parametrize("function", ["k_page_bytes", "v_data_section_bytes", "v_page_bytes"])
@pytest.mark.parametrize("shape", [
    (2**16, 2**8, 2**12, 4), (2**31, 1, 2**32 - 16, 4), (U32_MAX, U32_MAX, 2**32 - 16, 2),
])
def test_sizes_of_huge_shapes_are_exact_or_zero(function, shape):
    exact = format_sizes(*shape)[function]
    assert c_sizes(*shape)[function] == (exact if exact <= U64_MAX else 0)


@pytest.mark.parametrize("kwargs", [
    {"num_blocks": -1}, {"block_size": 0}, {"block_size": 2**32}, {"num_kv_heads": 0}, {"head_dim": 0},
    {"head_dim": 8}, {"head_dim": 100}, {"head_dim": 128.0}, {"v_bits": 0}, {"v_bits": 1}, {"v_bits": 5},
], ids=repr)
def test_cache_layout_rejects_bad_input(kwargs):
    with pytest.raises(fp8kturbov.InvalidValueError):
        fp8kturbov.CacheLayout(**{"num_blocks": 4, "block_size": 16, "num_kv_heads": 2,
                                  "head_dim": 128, "v_bits": 3, **kwargs})


def test_reference_sizes_match_c():
    reference = pytest.importorskip("fp8kturbov.reference")
    functions = ["k_page_bytes", "v_data_section_bytes", "v_page_bytes"]
    if not all(hasattr(reference, f) for f in functions):
        pytest.skip("fp8kturbov.reference has no size functions")
    for shape, bits in itertools.product(SHAPES, [2, 3, 4]):
        ref = {f: getattr(reference, f)(*shape) if f == "k_page_bytes" else getattr(reference, f)(*shape, bits)
               for f in functions}
        assert ref == c_sizes(*shape, bits), (shape, bits)
    for args in [(16, 2, 100, 3), (16, 2, 128, 5)]:  # what C sizes as 0 the reference refuses
        try:
            assert reference.v_page_bytes(*args) == 0
        except ValueError:
            pass


# ---- The eight entry points ---------------------------------------------------------------------------
# Required pointers (the optional decode workspace and checked-mode error word excluded).
POINTER_FIELDS = {op: [name for type_, name in header_struct(f"fp8kturbov_{op}_params")
                       if type_.endswith("*") and name not in ("workspace", "error_flags", "sinks", "query_start",
                                                               "append_key", "append_value", "append_slot_mapping")]
                  for op in ("write", "decode")}
FAKE_BASE = 0x7F00_0000_0000  # 16-aligned addresses that are only passed where nothing is launched


def fake_pointers(names: list[str]) -> dict[str, int]:
    return {name: FAKE_BASE + 0x10_0000 * i for i, name in enumerate(names)}


@dataclass(frozen=True)
class Entry(EntryPoint):
    """An entry point with the arguments this file builds for it and its two ways of calling."""

    def valid_args(self, *, work: int = 0, head_dim: int = 128, num_kv_heads: int = 2,
                   block_size: int = 16, v_bits: int = 3) -> dict[str, Any]:
        """Valid keyword arguments with packed pages, NULL pointers and ``work`` tokens / sequences
        (``v_bits`` only for the generic entry points)."""
        bits = self.bits or v_bits
        sizes = format_sizes(block_size, num_kv_heads, head_dim, bits)
        n = num_kv_heads * head_dim
        args: dict[str, Any] = dict.fromkeys(POINTER_FIELDS[self.op], 0)
        args.update(num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, k_scale=1.0,
                    v_block_stride_bytes=sizes["v_page_bytes"],
                    v_data_section_bytes=sizes["v_data_section_bytes"])
        if self.op == "write":
            args.update(num_tokens=work, key_stride=n, value_stride=n,
                        k_block_stride_bytes=sizes["k_page_bytes"])
        else:
            args.update(max_blocks_per_seq=4, num_seqs=work, num_q_heads=2 * num_kv_heads,
                        inv_sqrt_d=head_dim**-0.5, q_stride=2 * n, sliding_window=0)
        if self.bits is None:
            args.update(v_bits=bits, num_blocks=0, error_flags=0)
            if self.op == "decode":
                args.update(k_block_stride_bytes=sizes["k_page_bytes"], sparse_v_threshold=1e-3,
                            block_tables_stride=0)
        return args

    def call(self, args: dict[str, Any]) -> None:
        """Through the Python package (its range checks, then C)."""
        getattr(fp8kturbov, self.name)(**args)

    def call_c(self, args: dict[str, Any]) -> int:
        """The C function on its own, no Python check in between; returns the status."""
        if self.bits is None:
            params = STRUCTS[f"fp8kturbov_{self.op}_params"]()
            getattr(lib, f"fp8kturbov_{self.op}_params_init")(ctypes.byref(params))
            for name, value in args.items():
                setattr(params, name, value)
            return getattr(lib, self.c_name)(ctypes.byref(params), None)
        names = [name for _, name in header_functions()[self.c_name][1]]
        return getattr(lib, self.c_name)(*(args.get(name) for name in names))  # stream: NULL


ENTRIES = [Entry(op, bits) for op in ("write", "decode") for bits in (None, 2, 3, 4)]
entries = pytest.mark.parametrize("entry", ENTRIES, ids=str)


def _set(**overrides) -> Callable[[dict], dict]:
    return lambda args: overrides


def _add(name: str, delta: int) -> Callable[[dict], dict]:
    return lambda args: {name: args[name] + delta}


@dataclass(frozen=True)
class Case:
    """Arguments derived from an entry point's valid ones: ``shape`` picks them, ``change`` edits."""

    id: str
    change: Callable[[dict], dict] = _set()
    shape: dict = field(default_factory=dict)
    ops: tuple[str, ...] = ("write", "decode")

    def args(self, entry: Entry) -> dict[str, Any]:
        args = entry.valid_args(**self.shape)
        args.update(self.change(args))
        return args

    def applies(self, entry: Entry) -> bool:
        if entry.op not in self.ops or ("v_bits" in self.shape and entry.bits is not None):
            return False
        valid = entry.valid_args(**self.shape)
        try:
            return set(self.change(valid)) <= set(valid)
        except KeyError:  # the change reads an argument this entry point does not take
            return False


def show(name: str, value: Any) -> str:
    """``name = value`` as the C message prints it (%u / PRIu64, %g, %p)."""
    if isinstance(value, float):
        return f"{name} = {value:g}"
    if name in POINTER_FIELDS["write"] + POINTER_FIELDS["decode"] + ["error_flags"]:
        return f"{name} = {value:#x}"
    return f"{name} = {value}"


@dataclass(frozen=True)
class Bad(Case):
    status: Status = Status.INVALID_VALUE
    named: tuple[str, ...] = ()  # arguments the message must show as "name = value"
    text: Callable[[dict], tuple[str, ...]] = lambda args: ()  # further message substrings

    def expected(self, args: dict) -> list[str]:
        return [show(name, args[name]) for name in self.named] + list(self.text(args))


MISALIGNED, NOT_SUPPORTED = Status.MISALIGNED, Status.NOT_SUPPORTED
BAD = [
    Bad("head_dim_100", _set(head_dim=100), named=("head_dim",)),
    Bad("head_dim_0", _set(head_dim=0), named=("head_dim",)),
    *[Bad(f"head_dim_{d}_not_built", _set(head_dim=d), status=NOT_SUPPORTED, named=("head_dim",),
          ops=("decode",)) for d in (80, 1024)],
    Bad("num_kv_heads_0", _set(num_kv_heads=0), named=("num_kv_heads",)),
    Bad("num_q_heads_not_multiple", lambda a: {"num_q_heads": 2 * a["num_kv_heads"] + 1},
        named=("num_q_heads", "num_kv_heads"), ops=("decode",)),
    Bad("num_q_heads_0", _set(num_q_heads=0), named=("num_q_heads",), ops=("decode",)),
    Bad("num_q_heads_over_65535", lambda a: {"num_q_heads": 65536, "q_stride": 65536 * a["head_dim"]},
        named=("num_q_heads",), ops=("decode",)),
    Bad("num_seqs_over_int32", _set(num_seqs=2**31), named=("num_seqs",), ops=("decode",)),
    Bad("block_size_0", _set(block_size=0), named=("block_size",)),
    Bad("max_blocks_per_seq_0", _set(max_blocks_per_seq=0), named=("max_blocks_per_seq",), ops=("decode",)),
    Bad("block_tables_stride_short", lambda a: {"block_tables_stride": a["max_blocks_per_seq"] - 1},
        named=("block_tables_stride", "max_blocks_per_seq"), ops=("decode",)),
    Bad("positions_over_int32", _set(max_blocks_per_seq=2**27), ops=("decode",),
        text=lambda a: (f"max_blocks_per_seq * block_size = {2**27} * {a['block_size']}",)),
    Bad("row_over_uint32", _set(num_kv_heads=2**28, head_dim=32), ops=("write",),
        text=lambda a: (f"num_kv_heads * head_dim = {2**33}",)),
    Bad("num_tokens_over_one_launch", _set(num_tokens=U32_MAX), shape={"num_kv_heads": 32},
        named=("num_tokens",), ops=("write",)),
    *[Bad(f"{name}_short", lambda a, name=name: {name: a["num_kv_heads"] * a["head_dim"] - 1},
          named=(name,), ops=("write",)) for name in ("key_stride", "value_stride")],
    Bad("q_stride_short", lambda a: {"q_stride": a["num_q_heads"] * a["head_dim"] - 1},
        named=("q_stride",), ops=("decode",)),
    Bad("k_page_stride_short", _add("k_block_stride_bytes", -16), named=("k_block_stride_bytes",)),
    Bad("k_page_stride_unaligned", _add("k_block_stride_bytes", 8), status=MISALIGNED,
        named=("k_block_stride_bytes",), text=lambda a: ("multiple of 16",)),
    Bad("k_cache_unaligned", _set(k_cache=FAKE_BASE + 8), status=MISALIGNED, named=("k_cache",),
        text=lambda a: ("16-byte aligned",)),
    Bad("v_page_stride_short", _add("v_block_stride_bytes", -1), named=("v_block_stride_bytes",)),
    Bad("v_data_short", _add("v_data_section_bytes", -1), named=("v_data_section_bytes",)),
    Bad("v_data_past_page", _add("v_data_section_bytes", 1), named=("v_block_stride_bytes",),
        text=lambda a: (f"v_data_section_bytes + the scale section ({a['v_data_section_bytes']} + ",)),
    Bad("v_page_stride_unaligned", _add("v_block_stride_bytes", 7), status=MISALIGNED,
        named=("v_block_stride_bytes",), ops=("decode",), text=lambda a: ("not a multiple of",)),
    Bad("v_data_unaligned", lambda a: {"v_data_section_bytes": a["v_data_section_bytes"] + 5,
                                       "v_block_stride_bytes": a["v_block_stride_bytes"] + 16},
        status=MISALIGNED, named=("v_data_section_bytes",), ops=("decode",), text=lambda a: ("multiple of 4",)),
    Bad("v_data_wraps", _set(v_data_section_bytes=U64_MAX),
        text=lambda a: ("v_data_section_bytes", str(U64_MAX))),
    *[Bad(f"k_scale_{v}", _set(k_scale=v), named=("k_scale",)) for v in (0.0, -0.0, -1.0, math.nan, math.inf)],
    *[Bad(f"inv_sqrt_d_{v}", _set(inv_sqrt_d=v), named=("inv_sqrt_d",)) for v in (math.nan, math.inf, -math.inf)],
    # FORMAT §2 multiplies by 1/k_scale (the write) and §5 by inv_sqrt_d · k_scale (the decode).
    Bad("k_scale_reciprocal_overflows", _set(k_scale=1e-39), named=("k_scale",), ops=("write",),
        text=lambda a: ("1/k_scale overflows",)),
    Bad("score_scale_overflows", _set(inv_sqrt_d=1e30, k_scale=1e30), ops=("decode",),
        text=lambda a: ("inv_sqrt_d * k_scale = ",)),
    # A nonzero inv_sqrt_d whose product with k_scale is 0 in float would zero every score.
    *[Bad(f"score_scale_underflows_{v}", _set(inv_sqrt_d=v, k_scale=1e-30), ops=("decode",),
          text=lambda a: ("inv_sqrt_d", "k_scale", "underflows")) for v in (1e-30, -1e-30)],
    Bad("score_scale_underflows_denormal_k_scale", _set(k_scale=1e-45), ops=("decode",),
        text=lambda a: ("underflows",)),
    *[Bad(f"sparse_v_threshold_{v}", _set(sparse_v_threshold=v), named=("sparse_v_threshold",))
      for v in (-1e-3, math.nan, math.inf)],
    *[Bad(f"v_bits_{v}", _set(v_bits=v), named=("v_bits",)) for v in (0, 1, 5)],
]
BAD_CASES = [pytest.param(entry, bad, id=f"{entry}-{bad.id}")
             for entry in ENTRIES for bad in BAD if bad.applies(entry)]


def expect_failure(entry: Entry, args: dict, status: Status, substrings) -> str:
    """Call ``entry`` through Python; check the exception class, status and message."""
    with pytest.raises(EXCEPTIONS[status]) as info:
        entry.call(args)
    error = info.value
    assert error.status == status
    assert error.message.startswith(f"{entry.c_name}: "), error.message
    for text in substrings:
        assert text in error.message, (text, error.message)
    assert last_error() == error.message
    return error.message


@pytest.mark.parametrize("entry, bad", BAD_CASES)
def test_bad_argument_is_rejected_naming_it(entry, bad):
    args = bad.args(entry)
    expect_failure(entry, args, bad.status, bad.expected(args))


DIRECT = {"head_dim_100", "block_size_0", "k_cache_unaligned", "k_scale_nan", "v_bits_5",
          "num_q_heads_not_multiple", "head_dim_80_not_built"}


@pytest.mark.parametrize("entry, bad", [case for case in BAD_CASES if case.values[1].id in DIRECT])
def test_c_validates_without_the_python_layer(entry, bad):
    args = bad.args(entry)
    assert entry.call_c(args) == bad.status
    assert last_error().startswith(f"{entry.c_name}: ")
    assert all(text in last_error() for text in bad.expected(args)), last_error()


def set_error_message() -> str:
    """Make one call fail in C so that the thread has a known last-error message."""
    assert lib.fp8kturbov_reshape_and_cache(None, None) == Status.NULL_POINTER
    return last_error()


GOOD = [
    Case("packed"),
    *[Case(f"head_dim_{d}", shape={"head_dim": d}, ops=("write",)) for d in (16, 80, 1024)],
    *[Case(f"head_dim_{d}", shape={"head_dim": d}) for d in (64, 256, 512)],
    Case("block_size_1", shape={"block_size": 1}),
    Case("one_kv_head", shape={"num_kv_heads": 1}),
    *[Case(f"v_bits_{b}", shape={"v_bits": b}) for b in (2, 3, 4)],
    Case("padded_k_pages", _add("k_block_stride_bytes", 16)),
    Case("padded_v_pages", lambda a: {"v_data_section_bytes": a["v_data_section_bytes"] + 4,
                                      "v_block_stride_bytes": a["v_block_stride_bytes"] + 16}),
    # The write reads V bytewise; the decode copies 4 bytes at least and wants aligned pages.
    Case("odd_v_pages", lambda a: {"v_block_stride_bytes": a["v_block_stride_bytes"] + 7}, ops=("write",)),
    Case("odd_v_data_section", lambda a: {"v_data_section_bytes": a["v_data_section_bytes"] + 5,
                                          "v_block_stride_bytes": a["v_block_stride_bytes"] + 16},
         ops=("write",)),
    Case("k_stride_0_means_packed", _set(k_block_stride_bytes=0), ops=("decode",)),
    *[Case(f"block_tables_stride_{name}",
           lambda a, extra=extra: {"block_tables_stride": a["max_blocks_per_seq"] + extra}, ops=("decode",))
      for name, extra in (("equal", 0), ("wider", 5))],
    Case("mha", lambda a: {"num_q_heads": a["num_kv_heads"]}),
    Case("gqa_8", lambda a: {"num_q_heads": 8 * a["num_kv_heads"], "q_stride": 8 * a["q_stride"]}),
    Case("padded_rows", lambda a: {"key_stride": a["key_stride"] + 3, "value_stride": a["value_stride"] + 5}),
    *[Case(f"inv_sqrt_d_{v}", _set(inv_sqrt_d=v)) for v in (0.0, -0.5, 1e30)],
    Case("long_window", _set(sliding_window=U32_MAX)),
    Case("exact_sparse_v", _set(sparse_v_threshold=0.0)),
    # Denormal scales: valid while inv_sqrt_d * k_scale is not 0 (or inv_sqrt_d is 0 already).
    Case("k_scale_1e-45", _set(k_scale=1e-45, inv_sqrt_d=1.0), ops=("decode",)),
    Case("k_scale_1e-45_inv_sqrt_d_0", _set(k_scale=1e-45, inv_sqrt_d=0.0), ops=("decode",)),
    # Checked mode needs its error word only when there is work.
    Case("checked_zero_work_null_error_flags", _set(num_blocks=8)),
    Case("checked_zero_work_misaligned_error_flags", _set(num_blocks=8, error_flags=FAKE_BASE + 2)),
    Case("k_scale_3e38", _set(k_scale=3e38)),
]
GOOD_CASES = [pytest.param(entry, case, id=f"{entry}-{case.id}")
              for entry in ENTRIES for case in GOOD if case.applies(entry)]


@pytest.mark.parametrize("entry, case", GOOD_CASES)
def test_valid_zero_work_call_with_null_pointers_succeeds(entry, case):
    set_error_message()
    entry.call(case.args(entry))  # raises on a failure
    assert last_error() == ""  # a successful call clears the earlier message


@entries
def test_c_zero_work_succeeds(entry):
    set_error_message()
    assert entry.call_c(entry.valid_args()) == Status.SUCCESS
    assert last_error() == ""


def _null_pointer_cases():
    for entry in ENTRIES:
        pointers = POINTER_FIELDS[entry.op]
        for index, name in enumerate(pointers):
            # With every other pointer set, a missing check would launch on fake pointers.
            risky = index == len(pointers) - 1 and not no_gpu()
            marks = [pytest.mark.skip(reason="a GPU may be usable: no fake pointers")] if risky else []
            yield pytest.param(entry, index, id=f"{entry}-{name}", marks=marks)


@pytest.mark.parametrize("entry, index", list(_null_pointer_cases()))
def test_null_pointer_with_work_is_named(entry, index):
    """The pointers before ``index`` are set, the others NULL: the first NULL one is reported."""
    pointers = POINTER_FIELDS[entry.op]
    args = entry.valid_args(work=1) | fake_pointers(pointers[:index])
    expect_failure(entry, args, Status.NULL_POINTER, [f"{pointers[index]} is NULL"])


# Each pointer a kernel loads at its element's width, and that width.
ELEMENT_POINTERS = [("write", "key", 2), ("write", "value", 2), ("write", "slot_mapping", 8), ("decode", "q", 2),
                    ("decode", "output", 2), ("decode", "block_tables", 4), ("decode", "seq_lens", 4)]


@pytest.mark.skipif(not no_gpu(), reason="a GPU may be usable: no fake pointers")
@pytest.mark.parametrize("entry, name, width", [(entry, name, width) for entry in ENTRIES
                                                for op, name, width in ELEMENT_POINTERS if entry.op == op], ids=str)
@pytest.mark.parametrize("offset", [1, 2, 4])
def test_element_pointer_off_its_width_is_misaligned(entry, name, width, offset):
    """Every other check passes: a pointer off its element's width is refused by name before a launch,
    at any offset below the width; at a multiple of it the call goes on (to the missing GPU)."""
    args = entry.valid_args(work=1) | fake_pointers(POINTER_FIELDS[entry.op])
    args[name] += offset
    if offset % width:
        expect_failure(entry, args, MISALIGNED, [show(name, args[name]), f"{width}-byte aligned"])
    else:
        with pytest.raises(fp8kturbov.Fp8kturbovError) as info:
            entry.call(args)
        assert info.value.status != MISALIGNED, info.value.message


@pytest.mark.skipif(not no_gpu(), reason="a GPU may be usable: no fake pointers")
@pytest.mark.parametrize("entry", [entry for entry in ENTRIES if entry.bits is None], ids=str)
@pytest.mark.parametrize("pool, stride", [("k_cache", "k_block_stride_bytes"), ("v_cache", "v_block_stride_bytes")])
def test_checked_pool_past_the_address_space_is_refused(entry, pool, stride):
    """Checked mode: num_blocks pages of a pool's stride must end below 2^64, or the kernels' page
    offsets would wrap to memory below the pool. The pool lies 1 MiB below the end of the address
    space, the other one low, and num_blocks is one page more than that MiB holds (its last page
    would end at 2^64 exactly: refused too)."""
    args = entry.valid_args(work=1) | fake_pointers(POINTER_FIELDS[entry.op])
    args[pool] = 2**64 - 2**20
    args.update(error_flags=FAKE_BASE - 0x1000, num_blocks=2**20 // args[stride] + 1)
    expect_failure(entry, args, Status.INVALID_VALUE,
                   [f"num_blocks = {args['num_blocks']} pages of {args[stride]} bytes from {pool}",
                    "pass the end of the address space"])
    args["num_blocks"] -= 2  # now they end below 2^64: the call goes on (to the missing GPU)
    with pytest.raises(fp8kturbov.Fp8kturbovError) as info:
        entry.call(args)
    assert info.value.status != Status.INVALID_VALUE, info.value.message


@pytest.mark.parametrize("op", ["write", "decode"])
def test_null_params_struct(op):
    c_name = Entry(op).c_name
    assert getattr(lib, c_name)(None, None) == Status.NULL_POINTER
    assert last_error() == f"{c_name}: params is NULL"


@pytest.mark.parametrize("op", ["write", "decode"])
@pytest.mark.parametrize("delta", [-4, 8, "zero"])  # (sizeof - 8 is the version-2 write struct)
def test_wrong_struct_size(op, delta):
    entry = Entry(op)
    mirror = STRUCTS[f"fp8kturbov_{op}_params"]
    params = mirror()
    getattr(lib, f"fp8kturbov_{op}_params_init")(ctypes.byref(params))
    params.struct_size = 0 if delta == "zero" else ctypes.sizeof(mirror) + delta
    assert getattr(lib, entry.c_name)(ctypes.byref(params), None) == Status.BAD_STRUCT_SIZE
    assert last_error().startswith(f"{entry.c_name}: ")
    assert f"struct_size = {params.struct_size}" in last_error()
    assert str(ctypes.sizeof(mirror)) in last_error()


# ---- Checked mode (num_blocks, error_flags) and the version-1 struct size -----------------------------
GENERIC_ENTRIES = [entry for entry in ENTRIES if entry.bits is None]
generic_entries = pytest.mark.parametrize("entry", GENERIC_ENTRIES, ids=str)
# Every required pointer set, with work: a missing check would launch on the fake pointers.
only_without_gpu = pytest.mark.skipif(not no_gpu(), reason="a GPU may be usable: no fake pointers")
WORD = FAKE_BASE + 0x100_0000  # a fake error word, 16-byte aligned


def checked_args(entry: Entry, **checked_mode) -> dict[str, Any]:
    """Work, every required pointer set, and ``checked_mode`` (num_blocks, error_flags)."""
    return entry.valid_args(work=1) | fake_pointers(POINTER_FIELDS[entry.op]) | checked_mode


@only_without_gpu
@generic_entries
def test_checked_mode_needs_the_error_word(entry):
    expect_failure(entry, checked_args(entry, num_blocks=8, error_flags=0), Status.NULL_POINTER,
                   ["error_flags is NULL"])
    assert last_error() == f"{entry.c_name}: error_flags is NULL"


@only_without_gpu
@generic_entries
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_checked_mode_error_word_must_be_4_byte_aligned(entry, offset):
    args = checked_args(entry, num_blocks=1, error_flags=WORD + offset)
    expect_failure(entry, args, MISALIGNED, [show("error_flags", args["error_flags"]), "4-byte aligned"])


@generic_entries
def test_checked_mode_error_word_is_checked_after_the_other_pointers(entry):
    """Nothing set but checked mode: the first required pointer is named, not error_flags."""
    args = entry.valid_args(work=1) | {"num_blocks": 8}
    expect_failure(entry, args, Status.NULL_POINTER, [f"{POINTER_FIELDS[entry.op][0]} is NULL"])


@only_without_gpu
@generic_entries
@pytest.mark.parametrize("error_flags", [0, WORD + 2], ids=["null", "misaligned"])
def test_unchecked_call_ignores_error_flags(entry, error_flags):
    """num_blocks = 0: every check passes and the launch itself is refused (no GPU)."""
    expect_failure(entry, checked_args(entry, num_blocks=0, error_flags=error_flags),
                   Status.CUDA_ERROR, [])


def params_struct(entry: Entry, args: dict[str, Any], struct_size: int) -> ctypes.Structure:
    """The generic entry point's full struct with ``args``, claiming ``struct_size`` bytes."""
    params = STRUCTS[f"fp8kturbov_{entry.op}_params"]()
    getattr(lib, f"fp8kturbov_{entry.op}_params_init")(ctypes.byref(params))
    for name, value in args.items():
        setattr(params, name, value)
    params.struct_size = struct_size
    return params


def call_with_struct_size(entry: Entry, args: dict[str, Any], struct_size: int) -> int:
    return getattr(lib, entry.c_name)(ctypes.byref(params_struct(entry, args, struct_size)), None)


@generic_entries
def test_v1_struct_size_is_accepted(entry):
    set_error_message()
    args = entry.valid_args() | {"num_blocks": 8, "error_flags": WORD + 1}
    assert call_with_struct_size(entry, args, v1_struct_size(entry.op)) == Status.SUCCESS, last_error()
    assert last_error() == ""
    # The version-1 fields are read as before.
    args["head_dim"] = 100
    assert call_with_struct_size(entry, args, v1_struct_size(entry.op)) == Status.INVALID_VALUE
    assert "head_dim = 100" in last_error()


@only_without_gpu
@generic_entries
@pytest.mark.parametrize("error_flags", [0, WORD + 2], ids=["null", "misaligned"])
def test_v1_struct_size_ignores_the_checked_mode_fields(entry, error_flags):
    """With work and every pointer set, checked mode past the V1 size would fail on error_flags;
    read as 0 (unchecked), the call gets to the launch, which fails without a GPU."""
    args = checked_args(entry, num_blocks=8, error_flags=error_flags)
    assert call_with_struct_size(entry, args, v1_struct_size(entry.op)) == Status.CUDA_ERROR, last_error()
    assert call_with_struct_size(entry, args, ctypes.sizeof(STRUCTS[f"fp8kturbov_{entry.op}_params"])) \
        == (Status.NULL_POINTER if error_flags == 0 else Status.MISALIGNED)


@generic_entries
@pytest.mark.parametrize("work", [0, pytest.param(1, marks=only_without_gpu)], ids=["no_work", "work"])
def test_v1_struct_is_not_read_past_its_size(entry, work):
    """An old caller's struct may end where its memory ends (a fault here kills the test run)."""
    args = entry.valid_args() if work == 0 else checked_args(entry)
    v1_size = v1_struct_size(entry.op)
    params, _mapping = struct_before_an_unreadable_page(params_struct(entry, args, v1_size), v1_size)
    expected = Status.SUCCESS if work == 0 else Status.CUDA_ERROR
    assert getattr(lib, entry.c_name)(params, None) == expected, last_error()
    if entry.op == "decode":  # the workspace query reads the same struct
        out = ctypes.c_uint64()
        assert lib.fp8kturbov_paged_decode_workspace_bytes(params, ctypes.byref(out)) in query_ok()


def query_ok() -> set[Status]:
    """Outcomes of a valid workspace query: it reads the device's SM count."""
    return {Status.SUCCESS} | ({Status.CUDA_ERROR} if gpu_unavailable_reason() is not None else set())


@pytest.mark.parametrize("error_flags", [0, WORD + 2], ids=["null", "misaligned"])
def test_workspace_query_ignores_checked_mode(error_flags):
    entry = Entry("decode")
    args = entry.valid_args(work=1) | {"num_blocks": 8, "error_flags": error_flags}
    params = params_struct(entry, args, ctypes.sizeof(_lib.DecodeParams))
    out = ctypes.c_uint64()
    assert lib.fp8kturbov_paged_decode_workspace_bytes(ctypes.byref(params), ctypes.byref(out)) in query_ok(), \
        last_error()


# ---- The Python layer ------------------------------------------------------------------------------
RANGE_ERRORS = [
    ("num_tokens", -1), ("num_seqs", 2**32), ("num_kv_heads", -1), ("head_dim", 2**32),
    ("head_dim", True), ("block_size", 16.0), ("v_bits", -3), ("sliding_window", 2**32),
    ("k_scale", 1e39), ("k_scale", -3.5e38), ("inv_sqrt_d", 1e39), ("sparse_v_threshold", -1e39),
    ("v_block_stride_bytes", 2**64), ("v_data_section_bytes", -1), ("k_cache", -16), ("k_cache", 2**64),
    ("num_blocks", -1), ("num_blocks", 2**64), ("error_flags", -4), ("error_flags", 2**64),
]
RANGE_CASES = [pytest.param(entry, name, value, id=f"{entry}-{name}={value!r}")
               for entry in ENTRIES for name, value in RANGE_ERRORS if name in entry.valid_args()]


@pytest.mark.parametrize("entry, name, value", RANGE_CASES)
def test_python_range_error_is_raised_before_c(entry, name, value):
    before = set_error_message()
    with pytest.raises(fp8kturbov.InvalidValueError) as info:
        entry.call(entry.valid_args() | {name: value})
    assert info.value.status == Status.INVALID_VALUE
    shown = float(value) if isinstance(value, float) else value
    assert f"{name} = {shown!r}" in info.value.message
    assert last_error() == before  # C was not called


def test_python_launchers_take_the_library_s_defaults():
    """A parameter whose Python default is None keeps what ``*_params_init`` set; any other None
    is refused like any other value out of range."""
    for function in (ops.paged_decode_attn, ops.paged_decode_workspace_bytes, fp8kturbov.paged_decode):
        assert inspect.signature(function).parameters["sparse_v_threshold"].default is None, function
    initialised = _lib.DecodeParams()
    lib.fp8kturbov_decode_params_init(ctypes.byref(initialised))
    assert ops._decode_params(sparse_v_threshold=None).sparse_v_threshold == initialised.sparse_v_threshold
    assert ops._decode_params(sparse_v_threshold=0.5).sparse_v_threshold == 0.5
    with pytest.raises(fp8kturbov.InvalidValueError, match="num_blocks = None"):
        ops._decode_params(num_blocks=None)


def test_last_error_message_is_per_thread():
    write, decode = Entry("write"), Entry("decode")
    mine = expect_failure(write, write.valid_args(head_dim=100), Status.INVALID_VALUE, ["head_dim = 100"])
    seen: dict[str, str] = {}

    def other_thread():
        seen["fresh"] = last_error()
        try:
            decode.call(decode.valid_args() | {"k_scale": 0.0})
        except fp8kturbov.InvalidValueError as error:
            seen["error"] = error.message
        seen["after"] = last_error()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen["fresh"] == ""
    assert seen["after"] == seen["error"] and "k_scale = 0" in seen["error"]
    assert last_error() == mine
    write.call(write.valid_args())
    assert last_error() == ""


class ProtocolStream:
    """A stream object of some other library, seen through the ``__cuda_stream__`` protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cu_stream(handle: int) -> Any:
    driver = pytest.importorskip("cuda.bindings.driver")
    return driver.CUstream(handle)


STREAMS = {"none": (lambda: None, 0), "int": (lambda: 0x1230, 0x1230),
           "CUstream": (lambda: _cu_stream(0x4560), 0x4560),
           "cuda_stream_protocol": (lambda: ProtocolStream(0x7890), 0x7890)}


@pytest.mark.parametrize("kind", STREAMS)
def test_stream_handle_accepts(kind):
    make, handle = STREAMS[kind]
    stream = make()
    assert fp8kturbov.stream_handle(stream) == handle
    for entry in (Entry("write"), Entry("decode", 2)):
        entry.call(entry.valid_args() | {"stream": stream})  # zero work: the handle is never used


@pytest.mark.parametrize("stream", [1.5, "0", b"\0", [0], object()],
                         ids=["float", "str", "bytes", "list", "object"])  # repr(object()) differs by process
def test_stream_handle_rejects_other_types(stream):
    pytest.importorskip("cuda.bindings.driver")  # stream_handle imports it for the CUstream check
    with pytest.raises(TypeError):
        fp8kturbov.stream_handle(stream)
    with pytest.raises(TypeError):
        Entry("write", 3).call(Entry("write", 3).valid_args() | {"stream": stream})


# ---- A real launch attempt, only where no GPU is usable ------------------------------------------------
@pytest.mark.skipif(not no_gpu(), reason="a GPU may be usable: no fake pointers")
@entries
def test_launch_without_gpu_reports_the_cuda_error(entry):
    args = entry.valid_args(work=1) | fake_pointers(POINTER_FIELDS[entry.op])
    message = expect_failure(entry, args, Status.CUDA_ERROR, [])
    assert re.search(r"\bcudaError[A-Z]\w+", message), message


# ---- The V encoder of the write (v_encoder) and the version-2 write struct ------------------------
WRITE_ENTRY = next(entry for entry in GENERIC_ENTRIES if entry.op == "write")
DECODE_ENTRY = next(entry for entry in GENERIC_ENTRIES if entry.op == "decode")


def test_v_encoder_values_mirror_the_header():
    code = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    values = dict(re.findall(r"FP8KTURBOV_V_ENCODER_(\w+)\s*=\s*(\d+)", code))
    assert {name: int(v) for name, v in values.items()} == {e.name: e.value for e in fp8kturbov.VEncoder}


@pytest.mark.parametrize("entry", [WRITE_ENTRY, DECODE_ENTRY], ids=lambda e: e.op)
@pytest.mark.parametrize("v_encoder", list(fp8kturbov.VEncoder))
def test_write_and_decode_accept_each_v_encoder(entry, v_encoder):
    """The write's encoder, and the decode's for its fused append."""
    set_error_message()
    struct_size = ctypes.sizeof(STRUCTS[f"fp8kturbov_{entry.op}_params"])
    assert call_with_struct_size(entry, entry.valid_args() | {"v_encoder": v_encoder}, struct_size) == Status.SUCCESS, \
        last_error()
    assert last_error() == ""


@pytest.mark.parametrize("entry", [WRITE_ENTRY, DECODE_ENTRY], ids=lambda e: e.op)
@pytest.mark.parametrize("v_encoder", [3, 2**31, 2**32 - 1])
def test_write_and_decode_refuse_an_unknown_v_encoder(entry, v_encoder):
    expect_failure(entry, entry.valid_args() | {"v_encoder": v_encoder}, Status.INVALID_VALUE,
                   [f"v_encoder = {v_encoder}", "_PROJECTION (2)"])


@pytest.mark.parametrize("soft_cap", [math.nan, math.inf, -1.0, -1e-30])
def test_decode_refuses_a_soft_cap_not_finite_and_non_negative(soft_cap):
    entry = next(e for e in GENERIC_ENTRIES if e.op == "decode")
    expect_failure(entry, entry.valid_args() | {"soft_cap": soft_cap}, Status.INVALID_VALUE, ["soft_cap = "])


@only_without_gpu
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_decode_sinks_must_be_4_byte_aligned(offset):
    entry = next(e for e in GENERIC_ENTRIES if e.op == "decode")
    args = checked_args(entry, sinks=WORD + offset)
    expect_failure(entry, args, MISALIGNED, [f"sinks = {args['sinks']:#x}", "4-byte aligned"])


@pytest.mark.parametrize("max_q_len", [17, 2**31, 2**32 - 1])
def test_decode_refuses_max_q_len_above_16(max_q_len):
    entry = next(e for e in GENERIC_ENTRIES if e.op == "decode")
    expect_failure(entry, entry.valid_args() | {"max_q_len": max_q_len}, Status.INVALID_VALUE,
                   [f"max_q_len = {max_q_len}", "16"])


@only_without_gpu
def test_decode_needs_query_start_for_more_than_one_query_row():
    entry = next(e for e in GENERIC_ENTRIES if e.op == "decode")
    expect_failure(entry, checked_args(entry, max_q_len=2), Status.NULL_POINTER,
                   ["query_start is NULL", "max_q_len = 2"])


@only_without_gpu
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_decode_query_start_must_be_4_byte_aligned(offset):
    entry = next(e for e in GENERIC_ENTRIES if e.op == "decode")
    args = checked_args(entry, query_start=WORD + offset, max_q_len=4)
    expect_failure(entry, args, MISALIGNED, [f"query_start = {args['query_start']:#x}", "4-byte aligned"])


def test_v2_decode_struct_reads_sinks_and_soft_cap_as_off():
    """A decode struct of library 0.2: sinks and soft_cap past it are not read."""
    entry = next(e for e in GENERIC_ENTRIES if e.op == "decode")
    v2_size = old_struct_sizes("decode")[1]
    args = entry.valid_args() | {"soft_cap": math.nan, "sinks": WORD + 1}
    assert call_with_struct_size(entry, args, v2_size) == Status.SUCCESS, last_error()
    params, _mapping = struct_before_an_unreadable_page(params_struct(entry, args, v2_size), v2_size)
    assert lib.fp8kturbov_paged_decode_attn(params, None) == Status.SUCCESS, last_error()
    assert call_with_struct_size(entry, args, ctypes.sizeof(_lib.DecodeParams)) == Status.INVALID_VALUE


def test_v2_write_struct_reads_v_encoder_as_matched_norm():
    """A struct of library 0.2 (checked mode, no v_encoder): what lies past it is not read."""
    v2_size = old_struct_sizes("write")[1]
    args = WRITE_ENTRY.valid_args() | {"v_encoder": 7, "num_blocks": 8, "error_flags": WORD}
    assert call_with_struct_size(WRITE_ENTRY, args, v2_size) == Status.SUCCESS, last_error()
    params, _mapping = struct_before_an_unreadable_page(params_struct(WRITE_ENTRY, args, v2_size), v2_size)
    assert lib.fp8kturbov_reshape_and_cache(params, None) == Status.SUCCESS, last_error()
    # The version-2 fields are read: checked mode with work still needs its error word.
    args |= {"num_tokens": 1, "num_blocks": 8, "error_flags": 0}
    assert call_with_struct_size(WRITE_ENTRY, args, v2_size) == Status.NULL_POINTER


def test_prefill_refuses_chunks_whose_rows_pass_32_bits():
    """A chunk's (token, query head) rows are counted in 32 bits on the device: max_q_len times the group
    size must stay below 2^31 (2^20 tokens of 4096 query heads over one KV head do not)."""
    from fp8kturbov import ops
    layout = fp8kturbov.CacheLayout(num_blocks=1, block_size=16, num_kv_heads=1, head_dim=64, v_bits=3)
    args = dict(max_blocks_per_seq=2**16, num_seqs=1, num_q_heads=4096, num_kv_heads=1, head_dim=64, block_size=16,
                inv_sqrt_d=0.125, k_scale=1.0, q_stride=4096 * 64, v_bits=3,
                v_block_stride_bytes=layout.v_block_stride_bytes, v_data_section_bytes=layout.v_data_section_bytes,
                num_query_rows=2**20)
    with pytest.raises(fp8kturbov.InvalidValueError, match="max_q_len \\* group size = 1048576 \\* 4096"):
        ops.paged_prefill_attn(0, 0, 0, 0, 0, 0, 0, max_q_len=2**20, **args)
    with pytest.raises(fp8kturbov.InvalidValueError, match="group size"):
        ops.paged_prefill_workspace_bytes(max_q_len=2**20, **{k: v for k, v in args.items()
                                                            if k not in ("inv_sqrt_d",)})

