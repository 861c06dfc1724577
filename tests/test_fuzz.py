"""Hostile scalars against every C entry point and against the Python layer's checks (CPU only).

Property tests (hypothesis) for "never a silent wrong result": random and extreme scalars (0, 1,
2^31 - 1, 2^31, 2^32 - 1; 2^63, 2^64 - 1; NaN, ±Inf, ±0, denormals, ±FLT_MAX), random head dims,
mismatched head counts, huge strides and wrong struct sizes go straight to the C functions through
ctypes; negative and huge ints, floats where ints belong, bools, NumPy scalars and NaN go to the
Python functions.

Nothing can launch, on a GPU machine either: every C call has all its pointers NULL or zero work
(num_tokens = 0 / num_seqs = 0), which `assert_cannot_launch` checks before each call; Python-layer
calls go through `watch_c`, whose argument converters refuse, before ctypes converts anything, a
value out of its C type's range (ctypes would wrap it silently) and a call with work and a
non-NULL pointer.

The expected outcome comes from a small model of the documented rules (cuda/include/fp8kturbov.h,
docs/format.md, docs/api.md), not from the library. The model is free of check order: it lists the
rules an argument set breaks, and a failing call must report one of them (its status, and the
argument its message names). What it cannot decide (rules computed from an invalid shape; the V-load
width of the decode, which the header only bounds by 8 bytes) it lists as "possible".
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import math
import operator
import os
import re
import struct
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fp8kturbov  # noqa: E402
from abi_util import EXCEPTIONS, EntryPoint, last_error, no_gpu, old_struct_sizes  # noqa: E402
from conftest import gpu_unavailable_reason  # noqa: E402
from fp8kturbov import Status, _lib  # noqa: E402
from fp8kturbov._lib import lib  # noqa: E402
from fp8kturbov._limits import DEFAULT_SPARSE_V_THRESHOLD  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "cuda" / "include" / "fp8kturbov.h"
if not HEADER.exists():
    pytest.skip(f"{HEADER} not found (tests run from a checkout)", allow_module_level=True)

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I32_MAX = 2**31 - 1
FLT_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]
V_BITS = (2, 3, 4)
V_ENCODERS = tuple(int(encoder) for encoder in fp8kturbov.VEncoder)
DECODE_HEAD_DIMS = (64, 128, 256, 512)  # docs/api.md: the head dims decode supports
V, NULL, MIS, UNSUP = Status.INVALID_VALUE, Status.NULL_POINTER, Status.MISALIGNED, Status.NOT_SUPPORTED
STATUS_VALUES = {int(s) for s in Status}

# About 3 ms an example: the whole file runs in about 15 s. FP8KTURBOV_FUZZ_SCALE=10 runs ten times as
# many examples (a deeper, slower search).
_SCALE = float(os.environ.get("FP8KTURBOV_FUZZ_SCALE", "1"))


def examples(n: int) -> settings:
    return settings(max_examples=max(1, round(n * _SCALE)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


FUZZ, FEW = examples(150), examples(40)


# ---- The entry points -------------------------------------------------------------------------------
def _fixed_launcher_params(macro: str) -> list[str]:
    """Parameter names of a FP8KTURBOV_DECLARE_* launcher macro of the header, in order."""
    code = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S).replace("\\\n", " ")
    body = re.search(rf"#define\s+{macro}\(BITS\)(.*)", code).group(1)
    decls = re.search(r"\(([^)]*)\)\s*;", body).group(1).split(",")
    return [decl.replace("*", " ").split()[-1] for decl in decls]


STRUCTS = {"write": _lib.WriteParams, "decode": _lib.DecodeParams}
FIELD_TYPES = {op: dict(s._fields_) for op, s in STRUCTS.items()}
# Pointer fields in header order.
ALL_POINTERS = {op: [n for n, t in s._fields_ if t is ctypes.c_void_p] for op, s in STRUCTS.items()}
# Required pointers in header order (the optional decode workspace, sinks, query_start and fused
# append and the checked-mode error word excluded).
POINTERS = {op: [n for n in names if n not in ("workspace", "error_flags", "sinks", "query_start", "append_key",
                                               "append_value", "append_slot_mapping")]
            for op, names in ALL_POINTERS.items()}
WORK = {"write": "num_tokens", "decode": "num_seqs"}
# FP8KTURBOV_<OP>_PARAMS_V<n>_SIZE: the earlier versions of the structs, still accepted; version 1
# is the struct before the checked-mode fields.
OLD_SIZES = {op: old_struct_sizes(op) for op in STRUCTS}
V1_SIZES = {op: sizes[0] for op, sizes in OLD_SIZES.items()}
# How the library reads a version-1 struct's tail (unchecked, the default V encoder, no sinks, no
# soft-capping, one query row per sequence).
UNCHECKED = {"num_blocks": 0, "error_flags": 0, "v_encoder": 0, "sinks": 0, "soft_cap": 0.0,
             "query_start": 0, "max_q_len": 0, "num_query_rows": 0, "v_rotation": 0, "block_tables_stride": 0}
FIXED_PARAMS = {"write": _fixed_launcher_params("FP8KTURBOV_DECLARE_WRITE"),
                "decode": _fixed_launcher_params("FP8KTURBOV_DECLARE_DECODE")}
assert all(names[-1] == "stream" for names in FIXED_PARAMS.values()), FIXED_PARAMS
assert all(set(FIXED_PARAMS[op][:-1]) <= set(FIELD_TYPES[op]) for op in STRUCTS), FIXED_PARAMS


@dataclass(frozen=True)
class Entry(EntryPoint):
    """An entry point with the names of the arguments it takes."""

    @property
    def names(self) -> list[str]:
        """Argument names (the stream excluded): the struct fields, or the launcher's parameters."""
        if self.bits is None:
            return [n for n, _ in STRUCTS[self.op]._fields_ if n != "struct_size"]
        return FIXED_PARAMS[self.op][:-1]


ENTRIES = [Entry(op, bits) for op in ("write", "decode") for bits in (None, 2, 3, 4)]
WRITE, DECODE = ENTRIES[0], ENTRIES[4]
QUERY = "fp8kturbov_paged_decode_workspace_bytes"
entries = pytest.mark.parametrize("entry", ENTRIES, ids=str)






def set_error_message() -> str:
    """Make one C call fail so that the thread has a known last-error message."""
    assert lib.fp8kturbov_reshape_and_cache(None, None) == Status.NULL_POINTER
    return last_error()


def f32(x: float) -> float:
    """``x`` as the C ``float`` ctypes passes (round to nearest)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_cannot_launch(op: str, args: dict[str, Any]) -> None:
    """The safety rule of this file: with work, every pointer is NULL."""
    if args.get(WORK[op], 0):
        live = [p for p in ALL_POINTERS[op] if args.get(p)]
        assert not live, f"refusing a call with work and non-NULL pointers {live}"


def call_c(entry: Entry, args: dict[str, Any], struct_size: int | None = None) -> int:
    """The C function with ``args`` and a NULL stream, no Python check in between."""
    assert_cannot_launch(entry.op, args)
    fn = getattr(lib, entry.c_name)
    if entry.bits is None:
        params = STRUCTS[entry.op]()
        getattr(lib, f"fp8kturbov_{entry.op}_params_init")(ctypes.byref(params))
        for name, value in args.items():
            setattr(params, name, value)
        if struct_size is not None:
            params.struct_size = struct_size
        return fn(ctypes.byref(params), None)
    return fn(*(args[name] for name in entry.names), None)


# ---- The model of the validation rules ---------------------------------------------------------------
@dataclass
class Expect:
    """The rules an argument set breaks: (status, text its message must contain)."""

    broken: list[tuple[Status, str]] = field(default_factory=list)
    possible: list[tuple[Status, str]] = field(default_factory=list)
    invalid_value: bool = False  # a head_dim that is not a multiple of 16: always INVALID_VALUE

    def rule(self, broken: bool, status: Status, text: str, decided: bool = True) -> None:
        if not decided:
            self.possible.append((status, text))
        elif broken:
            self.broken.append((status, text))


def model(op: str, bits: int, a: dict[str, Any], *, query: bool = False) -> Expect:
    """The documented rules of a write or a decode (or the decode's workspace query)."""
    e = Expect()
    get = lambda name, default=0: a.get(name, default)  # noqa: E731 (fixed launchers lack some)
    hd, nkv, bs = a["head_dim"], a["num_kv_heads"], a["block_size"]
    row = nkv * hd
    bits_ok = bits in V_BITS
    hd16 = hd > 0 and hd % 16 == 0
    e.rule(not bits_ok, V, "v_bits = ")
    e.rule(not hd16, V, "head_dim = ")
    e.invalid_value = not hd16
    e.rule(nkv == 0, V, "num_kv_heads = ")
    e.rule(bs == 0, V, "block_size = ")
    k_scale = f32(a["k_scale"])
    k_scale_ok = math.isfinite(k_scale) and k_scale > 0
    e.rule(not k_scale_ok, V, "k_scale = ")
    with np.errstate(over="ignore"):
        e.rule(op == "write" and k_scale_ok and not np.isfinite(np.float32(1) / np.float32(k_scale)),
               V, "k_scale = ")
    e.rule(get("v_rotation") not in (0, 1), V, "v_rotation = ")
    e.rule(get("v_rotation") == 1 and hd not in (128, 256, 512), V, "v_rotation = 1 (HADAMARD) needs")
    e.rule(get("v_encoder") not in V_ENCODERS, V, "v_encoder = ")  # the write's, or the decode's append
    if op == "write":
        e.rule(row > U32_MAX, V, "num_kv_heads * head_dim = ")
        for name in ("key_stride", "value_stride"):
            e.rule(a[name] < row, V, f"{name} = ")
        shape_ok = bits_ok and hd16 and nkv > 0 and bs > 0 and row <= U32_MAX
        k_stride = a["k_block_stride_bytes"]
        blocks = -(-a["num_tokens"] * (row // 16) // 256)  # one thread per 16-element group
        e.rule(blocks > I32_MAX, V, "num_tokens = ", decided=shape_ok)
    else:
        nq, mb = a["num_q_heads"], a["max_blocks_per_seq"]
        hd_built = hd in DECODE_HEAD_DIMS
        e.rule(hd16 and not hd_built, UNSUP, "head_dim = ")
        e.rule(nq == 0, V, "num_q_heads = ")
        e.rule(nkv > 0 and nq % nkv != 0, V, "num_q_heads = ", decided=nkv > 0)
        e.rule(nq > 65535, V, "num_q_heads = ")
        max_q_len = get("max_q_len")
        e.rule(max_q_len > 16, V, "max_q_len = ")
        if nkv > 0 and 0 < nq <= 65535 and nq % nkv == 0:  # one CTA per (sequence, KV head, 8 columns)
            columns = max(min(max_q_len, 16), 1) * (nq // nkv)
            e.rule(a["num_seqs"] * nkv * -(-columns // 8) > I32_MAX, V, "num_seqs = ", decided=max_q_len <= 16)
        else:
            e.rule(a["num_seqs"] > I32_MAX, V, "num_seqs = ", decided=False)
        e.rule(mb == 0, V, "max_blocks_per_seq = ")
        e.rule(mb * bs > I32_MAX, V, "max_blocks_per_seq * block_size = ")
        e.rule(0 < get("block_tables_stride") < mb, V, "block_tables_stride = ")
        e.rule(a["q_stride"] < nq * hd, V, "q_stride = ")
        inv_sqrt_d = f32(a["inv_sqrt_d"])
        e.rule(not math.isfinite(inv_sqrt_d), V, "inv_sqrt_d = ")
        with np.errstate(over="ignore", invalid="ignore"):  # judged below for valid factors only
            score_scale = np.float32(inv_sqrt_d) * np.float32(k_scale)
        e.rule(k_scale_ok and math.isfinite(inv_sqrt_d) and not np.isfinite(score_scale),
               V, "inv_sqrt_d * k_scale = ")
        e.rule(k_scale_ok and math.isfinite(inv_sqrt_d) and inv_sqrt_d != 0 and score_scale == 0,
               V, "underflows")
        sparse = f32(get("sparse_v_threshold", 1e-3))
        e.rule(not (math.isfinite(sparse) and sparse >= 0), V, "sparse_v_threshold = ")
        soft_cap = f32(get("soft_cap", 0.0))
        e.rule(not (math.isfinite(soft_cap) and soft_cap >= 0), V, "soft_cap = ")
        shape_ok = bits_ok and hd_built and nkv > 0 and bs > 0 and 0 < nq <= 65535 and nq % nkv == 0
        k_stride = get("k_block_stride_bytes") or bs * row  # 0 = packed
    # FORMAT §2, §3: the pages hold what the shape needs, K pages and the K pool 16-byte aligned.
    k_page = bs * row
    v_data = k_page * bits // 8
    v_scales = k_page // 16
    v_data_bytes, v_stride = a["v_data_section_bytes"], a["v_block_stride_bytes"]
    e.rule(k_stride % 16 != 0, MIS, "k_block_stride_bytes = ")
    e.rule(get("k_cache") % 16 != 0, MIS, "k_cache = ")
    e.rule(k_stride < k_page, V, "k_block_stride_bytes = ", decided=shape_ok)
    e.rule(v_data_bytes < v_data, V, "v_data_section_bytes = ", decided=shape_ok)
    e.rule(v_data_bytes + v_scales > v_stride, V, "v_block_stride_bytes = ", decided=shape_ok)
    if op == "decode":
        # The decode copies V in pieces of 4 bytes at least (docs/api.md).
        e.rule(v_stride % 4 != 0, MIS, "v_block_stride_bytes = ")
        e.rule(v_data_bytes % 4 != 0, MIS, "v_data_section_bytes = ")
        e.rule(get("v_cache") % 4 != 0, MIS, "v_cache = ")
    if not query and a[WORK[op]] > 0:
        nulls = [p for p in POINTERS[op] if not get(p)]
        assert nulls == POINTERS[op], "the fuzz only calls with work when every pointer is NULL"
        e.rule(True, NULL, f"{nulls[0]} is NULL")
        # Checked mode (the workspace query ignores it): the error word, NULL here as well.
        e.rule(get("num_blocks") > 0 and not get("error_flags"), NULL, "error_flags is NULL")
        e.rule(op == "decode" and get("sinks") % 4 != 0, MIS, "sinks = ")
        e.rule(op == "decode" and get("max_q_len") > 1 and not get("query_start"), NULL, "query_start is NULL")
        e.rule(op == "decode" and get("query_start") % 4 != 0, MIS, "query_start = ")
    return e


def names_an_argument(message: str) -> bool:
    return " = " in message or "is NULL" in message or "struct_size" in message


def check_status(c_name: str, status: int, e: Expect, ok: set[Status] = frozenset({Status.SUCCESS})) -> None:
    """``status`` and the last-error message are what the model allows."""
    assert status in STATUS_VALUES, status
    message = last_error()
    if status in ok:  # SUCCESS; or CUDA_ERROR of the workspace query where no GPU is usable
        assert not e.broken, (Status(status).name, e.broken, message)
        if status == Status.SUCCESS:
            assert message == "", message
        else:
            assert message.startswith(f"{c_name}: "), message
        return
    status = Status(status)
    assert status != Status.CUDA_ERROR, (message, e.broken)  # it tried to launch or query a device
    assert message.startswith(f"{c_name}: "), message
    assert names_an_argument(message), message
    allowed = e.broken + e.possible
    assert any(status == s and text in message for s, text in allowed), (status.name, message, allowed)
    if e.invalid_value:
        assert status == V, (status.name, message)


# ---- Strategies for the C calls ----------------------------------------------------------------------
U32_EDGES = [0, 1, 2**31 - 1, 2**31, U32_MAX]
U64_EDGES = [0, 1, 2**31, 2**32 - 1, 2**32, 2**63, U64_MAX]
FLOAT_EDGES = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-140,
               2.0**-126, FLT_MAX, -FLT_MAX, f32(1e-38), f32(1e-30), f32(1e30), f32(3e38), 1.0, -1.0, 0.125]
c_floats = st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(width=32))
c_pointers = st.one_of(st.just(0), st.integers(1, 2**44).map(lambda x: 16 * x), st.integers(1, U64_MAX),
                       st.sampled_from([1, 8, 2**63, U64_MAX - 15, U64_MAX]))


def _near(value: int, limit: int) -> list[int]:
    """Values next to a valid one: off by one, by a group, doubled, halved."""
    near = {value - 1, value + 1, value - 16, value + 16, value + 8, 2 * value, value // 2}
    return sorted(v for v in near if 0 <= v <= limit)


def c_hostile(op: str, name: str, valid: Any) -> st.SearchStrategy:
    ctype = FIELD_TYPES[op][name]
    if ctype is ctypes.c_float:
        return c_floats
    limit, edges = (U32_MAX, U32_EDGES) if ctype is ctypes.c_uint32 else (U64_MAX, U64_EDGES)
    return st.one_of(st.sampled_from(edges), st.integers(0, limit), st.sampled_from(_near(valid, limit)))


@st.composite
def valid_args(draw, entry: Entry, work: st.SearchStrategy = st.just(0)) -> dict[str, Any]:
    """Valid scalars of a random shape, NULL pointers, and ``work`` tokens / sequences."""
    bits = entry.bits or draw(st.sampled_from(V_BITS))
    if entry.op == "write":  # any multiple of 16, rows up to 2^32 - 2^16 elements
        head_dim = 16 * draw(st.one_of(st.integers(1, 64), st.sampled_from([2**12, 2**16 - 1])))
        num_kv_heads = draw(st.one_of(st.integers(1, 16), st.sampled_from([2**8, 2**12])))
    else:
        head_dim = draw(st.sampled_from(DECODE_HEAD_DIMS))
        num_kv_heads = draw(st.integers(1, 16))
    block_size = draw(st.one_of(st.sampled_from([1, 16, 32]), st.integers(1, 1024)))
    row = num_kv_heads * head_dim
    k_page = block_size * row
    v_data = k_page * bits // 8
    v_data_pad = draw(st.sampled_from([0, 8]))  # multiples of 4 keep the decode's V copies aligned
    # valid: the write needs a finite 1/k_scale, the decode a finite inv_sqrt_d · k_scale that
    # is not 0 unless inv_sqrt_d is
    k_scale = draw(st.floats(2.0**-126 if entry.op == "write" else 2.0**-149,
                             FLT_MAX if entry.op == "write" else 2.0**40, width=32))
    args: dict[str, Any] = dict.fromkeys(ALL_POINTERS[entry.op], 0)
    args.update(num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, v_bits=bits,
                num_blocks=draw(st.one_of(st.just(0), st.sampled_from(U64_EDGES), st.integers(0, U64_MAX))),
                k_scale=k_scale, v_data_section_bytes=v_data + v_data_pad,
                v_block_stride_bytes=v_data + v_data_pad + k_page // 16 + draw(st.sampled_from([0, 8, 64])))
    if entry.op == "write":
        args.update(num_tokens=draw(work), key_stride=row + draw(st.integers(0, 64)),
                    v_encoder=draw(st.sampled_from(V_ENCODERS)),
                    v_rotation=draw(st.sampled_from([0, 1])) if head_dim in (128, 256, 512) else 0,
                    value_stride=row + draw(st.integers(0, 64)),
                    k_block_stride_bytes=k_page + 16 * draw(st.integers(0, 4)))
    else:
        num_q_heads = num_kv_heads * draw(st.integers(1, 8))
        max_blocks_per_seq = draw(st.integers(1, 1024))
        args.update(num_seqs=draw(work), num_q_heads=num_q_heads, max_blocks_per_seq=max_blocks_per_seq,
                    block_tables_stride=draw(st.one_of(st.just(0), st.just(max_blocks_per_seq),
                                                       st.integers(max_blocks_per_seq, U64_MAX))),
                    inv_sqrt_d=draw(st.floats(-(2.0**80), 2.0**80, width=32).filter(
                        lambda x: x == 0 or np.float32(x) * np.float32(k_scale) != 0)),
                    q_stride=num_q_heads * head_dim + draw(st.integers(0, 64)),
                    sliding_window=draw(st.one_of(st.sampled_from(U32_EDGES), st.integers(0, U32_MAX))),
                    k_block_stride_bytes=draw(st.sampled_from([0, k_page, k_page + 16])),
                    sparse_v_threshold=draw(st.floats(0.0, FLT_MAX, width=32)),
                    soft_cap=draw(st.one_of(st.just(0.0), st.floats(0.0, FLT_MAX, width=32))),
                    max_q_len=draw(st.integers(0, 16)), num_query_rows=draw(st.sampled_from(U32_EDGES)),
                    v_rotation=draw(st.sampled_from([0, 1])) if head_dim in (128, 256, 512) else 0,
                    workspace_bytes=draw(st.sampled_from(U64_EDGES)),
                    append_key_stride=row + draw(st.integers(0, 64)), append_value_stride=row + draw(st.integers(0, 64)),
                    v_encoder=draw(st.sampled_from(V_ENCODERS)))
    return {name: args[name] for name in entry.names}


WORK_VALUES = st.one_of(st.just(0), st.sampled_from(U32_EDGES), st.integers(0, U32_MAX))


@st.composite
def hostile_args(draw, entry: Entry, work: st.SearchStrategy = WORK_VALUES,
                 max_changes: int = 4) -> dict[str, Any]:
    """Valid arguments with up to ``max_changes`` scalars replaced by hostile ones; random pointers
    only with zero work."""
    args = draw(valid_args(entry, work))
    scalars = [n for n in entry.names if FIELD_TYPES[entry.op][n] is not ctypes.c_void_p]
    for name in draw(st.lists(st.sampled_from(scalars), unique=True, max_size=max_changes)):
        args[name] = draw(c_hostile(entry.op, name, args[name]))
    if args[WORK[entry.op]] == 0:
        for name in entry.names:
            if FIELD_TYPES[entry.op][name] is ctypes.c_void_p:
                args[name] = draw(c_pointers)
    return args


def bits_of(entry: Entry, args: dict[str, Any]) -> int:
    return entry.bits or args["v_bits"]


# ---- The C entry points --------------------------------------------------------------------------
@entries
@FUZZ
@given(data=st.data())
def test_c_launcher_hostile_scalars(entry, data):
    args = data.draw(hostile_args(entry), label="args")
    status = call_c(entry, args)
    check_status(entry.c_name, status, model(entry.op, bits_of(entry, args), args))


@entries
@FEW
@given(data=st.data())
def test_c_zero_work_with_valid_scalars_succeeds(entry, data):
    args = data.draw(valid_args(entry), label="args")
    for name in entry.names:  # any aligned pointers: zero work reads none of them
        if FIELD_TYPES[entry.op][name] is ctypes.c_void_p:
            args[name] = data.draw(st.integers(0, 2**44).map(lambda x: 16 * x), label=name)
    set_error_message()
    assert call_c(entry, args) == Status.SUCCESS, last_error()
    assert last_error() == ""
    assert not model(entry.op, bits_of(entry, args), args).broken


@entries
@FEW
@given(data=st.data())
def test_c_work_with_null_pointers_names_the_first_pointer(entry, data):
    args = data.draw(valid_args(entry, st.one_of(st.sampled_from([1, 2**31 - 1]), st.integers(1, 2**31 - 1))),
                     label="args")
    e = model(entry.op, bits_of(entry, args), args)
    # Not too many tokens. A checked-mode call has no error word either: it is checked after the
    # required pointers, so the first of those is still the one named.
    assume(all(status == NULL for status, _ in e.broken) and not e.possible)
    assert call_c(entry, args) == Status.NULL_POINTER, last_error()
    assert last_error() == f"{entry.c_name}: {POINTERS[entry.op][0]} is NULL"


@entries
@FEW
@given(data=st.data())
def test_c_head_dim_not_a_multiple_of_16_is_invalid_value(entry, data):
    args = data.draw(hostile_args(entry, max_changes=2), label="args")
    args["head_dim"] = data.draw(st.one_of(st.just(0), st.sampled_from([1, 8, 15, 17, 100, U32_MAX]),
                                           st.integers(0, U32_MAX).filter(lambda d: d % 16)), label="head_dim")
    status = call_c(entry, args)
    assert status == V, (Status(status).name, last_error())
    check_status(entry.c_name, status, model(entry.op, bits_of(entry, args), args))


@pytest.mark.parametrize("entry", [WRITE, DECODE], ids=str)
@FEW
@given(data=st.data())
def test_c_struct_size_other_than_the_library_s_is_refused(entry, data):
    size, known = ctypes.sizeof(STRUCTS[entry.op]), [ctypes.sizeof(STRUCTS[entry.op]), *OLD_SIZES[entry.op]]
    near = [0, 1] + [k + d for k in known for d in (-8, -1, 1, 8)]
    struct_size = data.draw(st.one_of(st.sampled_from(near + [2**63, U64_MAX]), st.integers(0, U64_MAX))
                            .filter(lambda n: n not in known), label="struct_size")
    args = data.draw(hostile_args(entry), label="args")
    assert call_c(entry, args, struct_size=struct_size) == Status.BAD_STRUCT_SIZE, last_error()
    assert last_error().startswith(f"{entry.c_name}: ")
    assert f"struct_size = {struct_size}" in last_error() and str(size) in last_error()
    if entry.op == "decode":  # the workspace query checks the same struct
        params = STRUCTS["decode"]()
        lib.fp8kturbov_decode_params_init(ctypes.byref(params))
        params.struct_size = struct_size
        out = ctypes.c_uint64()
        assert lib.fp8kturbov_paged_decode_workspace_bytes(ctypes.byref(params), ctypes.byref(out)) == \
            Status.BAD_STRUCT_SIZE
        assert last_error().startswith(f"{QUERY}: ") and f"struct_size = {struct_size}" in last_error()


@pytest.mark.parametrize("entry", [WRITE, DECODE], ids=str)
@FUZZ
@given(data=st.data())
def test_c_v1_struct_size_reads_the_checked_mode_fields_as_0(entry, data):
    """A struct_size of the version-1 struct: the fields before it are checked as usual and the
    checked-mode fields past it, set here to anything, read as 0 (unchecked)."""
    args = data.draw(hostile_args(entry), label="args")
    args["num_blocks"] = data.draw(st.integers(1, U64_MAX), label="num_blocks")
    status = call_c(entry, args, struct_size=V1_SIZES[entry.op])
    check_status(entry.c_name, status, model(entry.op, bits_of(entry, args), args | UNCHECKED))
    if entry.op == "decode":  # the workspace query accepts the same size (and ignores pointers)
        args |= dict.fromkeys(POINTERS["decode"], 0)
        status = _query(args, ctypes.byref(ctypes.c_uint64()), struct_size=V1_SIZES["decode"])
        check_status(QUERY, status, model("decode", args["v_bits"], args | UNCHECKED, query=True),
                     ok=query_ok())


def test_c_null_params():
    out = ctypes.c_uint64()
    for name, args in [("fp8kturbov_reshape_and_cache", (None, None)), ("fp8kturbov_paged_decode_attn", (None, None)),
                       (QUERY, (None, ctypes.byref(out))), (QUERY, (None, None))]:
        set_error_message()
        assert getattr(lib, name)(*args) == Status.NULL_POINTER
        assert last_error() == f"{name}: params is NULL"


@pytest.mark.parametrize("op", ["write", "decode"])
@FEW
@given(data=st.data())
def test_c_params_init_ignores_garbage_and_null(op, data):
    mirror = STRUCTS[op]
    init = getattr(lib, f"fp8kturbov_{op}_params_init")
    init(None)  # documented as a no-op; must not crash
    garbage = data.draw(st.binary(min_size=ctypes.sizeof(mirror), max_size=ctypes.sizeof(mirror)))
    params = mirror.from_buffer_copy(garbage)
    init(ctypes.byref(params))
    fresh = mirror()
    init(ctypes.byref(fresh))
    assert params.struct_size == ctypes.sizeof(mirror)
    for name, _ in mirror._fields_:
        assert getattr(params, name) == getattr(fresh, name), name


def _query(args: dict[str, Any], out: Any, struct_size: int | None = None) -> int:
    params = STRUCTS["decode"]()
    lib.fp8kturbov_decode_params_init(ctypes.byref(params))
    for name, value in args.items():
        setattr(params, name, value)
    if struct_size is not None:
        params.struct_size = struct_size
    return lib.fp8kturbov_paged_decode_workspace_bytes(ctypes.byref(params), out)


def query_ok() -> set[Status]:
    """Outcomes of a valid workspace query: it reads the device's SM count."""
    return {Status.SUCCESS} | ({Status.CUDA_ERROR} if gpu_unavailable_reason() is not None else set())


@FUZZ
@given(data=st.data())
def test_c_workspace_bytes_hostile_scalars(data):
    args = data.draw(hostile_args(DECODE), label="args")
    for name in POINTERS["decode"]:  # pointers are ignored by the query (tested below): NULL here
        args[name] = 0
    args["workspace"] = data.draw(c_pointers, label="workspace")  # ignored as well, never launched
    args["error_flags"] = data.draw(c_pointers, label="error_flags")  # so is checked mode
    out_null = data.draw(st.integers(0, 9), label="out") == 0
    out = ctypes.c_uint64(0xDEAD)
    status = _query(args, None if out_null else ctypes.byref(out))
    e = model("decode", args["v_bits"], args, query=True)
    if out_null:
        e = Expect(broken=[(NULL, "workspace_bytes is NULL")] + e.broken, possible=e.possible)
    check_status(QUERY, status, e, ok=query_ok())
    if status == Status.SUCCESS and args["num_seqs"] == 0:
        assert out.value == 0


# The header: "Workspace BYTES with which `params` (pointers and workspace fields ignored) runs ...".
@pytest.mark.parametrize("pointer", [("k_cache", 8), ("v_cache", 1)], ids=lambda p: f"{p[0]}={p[1]}")
def test_c_workspace_bytes_ignores_pointer_fields(pointer):
    args = {"max_blocks_per_seq": 4, "num_seqs": 1, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 128,
            "block_size": 16, "inv_sqrt_d": 0.125, "k_scale": 1.0, "q_stride": 512, "v_bits": 3,
            "v_block_stride_bytes": 7 * 16 * 256 // 16, "v_data_section_bytes": 16 * 256 * 3 // 8}
    out = ctypes.c_uint64()
    assert _query(args, ctypes.byref(out)) in query_ok()
    name, value = pointer
    status = _query(args | {name: value}, ctypes.byref(out))
    assert status in query_ok(), last_error()


# Only where a GPU is usable: without one the query stops at the device query (CUDA_ERROR) first.
# Not marked "gpu": it launches nothing, and the sanitizer runs of ci/gpu-test.sh need not run it.
@pytest.mark.skipif(gpu_unavailable_reason() is not None, reason="needs a usable CUDA GPU (SM count query)")
def test_c_workspace_bytes_of_zero_sequences():
    script = textwrap.dedent("""
        import fp8kturbov
        print(fp8kturbov.paged_decode_workspace_bytes(
            max_blocks_per_seq=4, num_seqs=0, num_q_heads=4, num_kv_heads=2, head_dim=128, block_size=16,
            q_stride=512, v_bits=3, v_block_stride_bytes=7 * 16 * 256 // 16,
            v_data_section_bytes=16 * 256 * 3 // 8))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.split() == ["0"]


def format_sizes(block_size: int, num_kv_heads: int, head_dim: int, bits: int) -> dict[str, int]:
    """FORMAT.md §2, §3 packed sizes in unbounded ints; 0 where no entry point accepts the shape."""
    n = num_kv_heads * head_dim
    if not (block_size and num_kv_heads and head_dim and head_dim % 16 == 0 and n <= U32_MAX):
        return {"k_page_bytes": 0, "v_data_section_bytes": 0, "v_page_bytes": 0}
    k_page = block_size * n
    if bits not in V_BITS:
        return {"k_page_bytes": k_page, "v_data_section_bytes": 0, "v_page_bytes": 0}
    return {"k_page_bytes": k_page, "v_data_section_bytes": k_page * bits // 8,
            "v_page_bytes": (2 * bits + 1) * k_page // 16}


c_u32 = st.one_of(st.sampled_from(U32_EDGES + [16, 64, 128, 2**16, 2**28, 2**32 - 16]), st.integers(0, U32_MAX))


@examples(500)
@given(block_size=c_u32, num_kv_heads=c_u32,
       head_dim=st.one_of(c_u32, st.integers(0, 2**28).map(lambda x: 16 * x)),
       bits=st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 8, U32_MAX]), c_u32))
def test_c_size_functions_are_exact_or_zero(block_size, num_kv_heads, head_dim, bits):
    expected = format_sizes(block_size, num_kv_heads, head_dim, bits)
    assert all(v <= U64_MAX for v in expected.values())
    assert lib.fp8kturbov_k_page_bytes(block_size, num_kv_heads, head_dim) == expected["k_page_bytes"]
    assert lib.fp8kturbov_v_data_section_bytes(block_size, num_kv_heads, head_dim, bits) == \
        expected["v_data_section_bytes"]
    assert lib.fp8kturbov_v_page_bytes(block_size, num_kv_heads, head_dim, bits) == expected["v_page_bytes"]


# ---- The Python layer ----------------------------------------------------------------------------
LIMITS = {ctypes.c_uint32: U32_MAX, ctypes.c_uint64: U64_MAX, ctypes.c_void_p: U64_MAX}
FIXED_OPS = {e.c_name: e.op for e in ENTRIES if e.bits is not None}


class Recording:
    """What ``watch_c`` saw: one list of converted arguments per C call, and any violation."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[Any]]] = []
        self.violations: list[str] = []

    def refuse(self, text: str) -> None:
        self.violations.append(text)
        raise ValueError(text)  # ctypes turns it into ArgumentError: the call does not happen


class _Checked:
    """An ``argtypes`` entry that checks a value against its C type before ctypes converts it."""

    def __init__(self, c_name: str, index: int, ctype: Any, last: bool, record: Recording) -> None:
        self.c_name, self.index, self.ctype, self.last, self.record = c_name, index, ctype, last, record

    def from_param(self, value: Any) -> Any:
        record, where = self.record, f"{self.c_name} argument {self.index}"
        if self.index == 0:
            record.calls.append((self.c_name, []))
        if self.ctype in LIMITS:
            if value is None and self.ctype is ctypes.c_void_p:
                value = 0
            try:
                number = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
            except TypeError:
                number = None
            if number is None or not 0 <= number <= LIMITS[self.ctype]:
                record.refuse(f"{where}: {value!r} does not fit {self.ctype.__name__}")
            record.calls[-1][1].append(number)
        elif self.ctype is ctypes.c_float:
            number = float(value)
            if math.isfinite(number) and abs(number) > FLT_MAX:
                record.refuse(f"{where}: {value!r} overflows float32")
            record.calls[-1][1].append(number)
        elif isinstance(getattr(value, "_obj", None), ctypes.Structure):  # byref(params)
            params = value._obj
            snapshot = {name: getattr(params, name) for name, _ in params._fields_}
            record.calls[-1][1].append(snapshot)
            op = "write" if isinstance(params, _lib.WriteParams) else "decode"
            if self.c_name != QUERY and snapshot[WORK[op]] and any(
                    snapshot.get(p) for p in ALL_POINTERS[op]):
                record.refuse(f"{where}: work with non-NULL pointers")
        else:
            record.calls[-1][1].append(value)
        if self.last and self.c_name in FIXED_OPS:  # a fixed launcher: all its arguments are in
            op = FIXED_OPS[self.c_name]
            got = dict(zip(FIXED_PARAMS[op], record.calls[-1][1]))
            if got[WORK[op]] and any(got[p] for p in POINTERS[op]):
                record.refuse(f"{where}: work with non-NULL pointers")
        return self.ctype.from_param(value)


@contextlib.contextmanager
def watch_c(*c_names: str) -> Iterator[Recording]:
    """Route the C functions' arguments through range checks and a recorder while inside."""
    record = Recording()
    saved = {}
    try:
        for name in c_names:
            fn = getattr(lib, name)
            saved[name] = fn.argtypes
            n = len(fn.argtypes)
            fn.argtypes = [_Checked(name, i, t, i == n - 1, record) for i, t in enumerate(saved[name])]
        yield record
    finally:
        for name, argtypes in saved.items():
            getattr(lib, name).argtypes = argtypes


@dataclass(frozen=True)
class PyEntry:
    """A Python function over one C entry point."""

    name: str
    c_name: str
    op: str
    bits: int | None
    query: bool = False

    @property
    def names(self) -> list[str]:
        return [n for n in inspect.signature(getattr(fp8kturbov, self.name)).parameters if n != "stream"]

    @property
    def fixed(self) -> bool:
        return self.bits is not None

    def __str__(self) -> str:
        return self.name


PY_ENTRIES = [PyEntry(e.name, e.c_name, e.op, e.bits) for e in ENTRIES] + [
    PyEntry("paged_decode_workspace_bytes", QUERY, "decode", None, query=True)]


def classify_int(value: Any, limit: int) -> tuple[str, int | None]:
    """("ok", the integer) / ("range", None) / ("type", None), as docs/api.md describes the checks."""
    if isinstance(value, (bool, np.bool_)):
        return "type", None
    try:
        number = operator.index(value)
    except TypeError:
        return "type", None
    return ("ok", number) if 0 <= number <= limit else ("range", None)


def classify_float(value: Any) -> tuple[str, float | None]:
    assert not isinstance(value, (str, bytes)), "strings: see test_python_string_for_a_float_is_refused"
    if isinstance(value, (bool, np.bool_)):  # True is no scale
        return "type", None
    try:
        number = float(value)
    except TypeError:
        return "type", None
    if math.isfinite(number) and abs(number) > FLT_MAX:
        return "range", None
    if number != 0.0 and np.float32(number) == 0.0:  # would turn into 0 (soft-capping off, say)
        return "range", None
    return "ok", number


def classify(op: str, name: str, value: Any) -> tuple[str, Any]:
    if value is None and name in fp8kturbov.ops._LIBRARY_DEFAULTS:  # None keeps the library's default
        return "ok", DEFAULT_SPARSE_V_THRESHOLD
    ctype = FIELD_TYPES[op][name]
    return classify_float(value) if ctype is ctypes.c_float else classify_int(value, LIMITS[ctype])


def _np_ints(low: int, high: int) -> st.SearchStrategy:
    kinds = [(np.int8, -2**7, 2**7 - 1), (np.uint32, 0, U32_MAX), (np.int64, -2**63, 2**63 - 1),
             (np.uint64, 0, U64_MAX)]
    return st.one_of(*[st.integers(max(lo, low), min(hi, high)).map(kind) for kind, lo, hi in kinds
                       if max(lo, low) <= min(hi, high)])


def py_int_hostile(limit: int, valid: int, numpy: bool = True) -> st.SearchStrategy:
    """Integers in and out of range, and values of other types, for an integer argument."""
    options = [
        st.integers(-2**70, -1), st.integers(limit + 1, 2**70),
        st.sampled_from([-1, limit + 1, 2**64, 2**64 + 16, -2**63]),
        st.integers(0, limit), st.sampled_from(_near(valid, limit)),
        st.booleans(), st.sampled_from([np.True_, np.False_]),
        st.floats(), st.sampled_from([float(valid), math.nan, np.float64(valid), np.float32(math.nan)]),
        st.sampled_from([None, str(valid), b"\x10", Fraction(valid), Decimal(valid), complex(valid), [valid]]),
    ]
    if numpy:
        options.append(_np_ints(-2**63, U64_MAX))
    return st.one_of(*options)


py_float_hostile = st.one_of(
    st.floats(),  # NaN, ±Inf, and doubles beyond float32
    st.sampled_from(FLOAT_EDGES + [1e-50, 2.0**-150]),
    st.floats(min_value=FLT_MAX, exclude_min=True) | st.floats(max_value=-FLT_MAX, exclude_max=True),
    st.sampled_from([2 * FLT_MAX, -1e300, 1e39, 3.4028235677973366e38, 2**128, -(2**1000), np.float64(1e300)]),
    st.integers(-2**200, 2**200),  # ints beyond float64: see test_python_huge_int_for_a_float_is_refused
    st.booleans(),
    st.floats(width=32).map(np.float32), st.floats().map(np.float64), st.sampled_from([np.float16(65504)]),
    st.sampled_from([Fraction(1, 3), Decimal("0.5"), Decimal("NaN"), Decimal("-1e400"), None, 1j, [1.0]]),
)


def py_hostile(entry: PyEntry, name: str, valid: Any, zero_work: bool) -> st.SearchStrategy:
    ctype = FIELD_TYPES[entry.op][name]
    if ctype is ctypes.c_float:
        return py_float_hostile
    if ctype is ctypes.c_void_p:
        if not zero_work:
            return st.just(0)
        # NumPy integer pointers: see test_python_numpy_integer_pointer_is_accepted
        return st.one_of(py_int_hostile(U64_MAX, 16, numpy=not entry.fixed), c_pointers)
    return py_int_hostile(LIMITS[ctype], valid)


@st.composite
def py_args(draw, entry: PyEntry) -> dict[str, Any]:
    c_entry = Entry(entry.op, entry.bits)
    base = draw(valid_args(c_entry, WORK_VALUES))
    if entry.query:  # scalars only
        base = {n: v for n, v in base.items() if n in entry.names}
    args = dict(base)
    # Few changes: the Python layer stops at the first refused value, which would hide the others.
    by_kind: dict[Any, list[str]] = {}
    for name in entry.names:
        if name in args:
            by_kind.setdefault(FIELD_TYPES[entry.op][name], []).append(name)
    names = st.one_of(*[st.sampled_from(group) for group in by_kind.values()])  # each C type as often
    changed = draw(st.lists(names, unique=True, min_size=1, max_size=3))
    pointers = [n for n in changed if FIELD_TYPES[entry.op][n] is ctypes.c_void_p]
    for name in changed:
        if name not in pointers:
            args[name] = draw(py_hostile(entry, name, base[name], zero_work=False))
    kind, work = classify(entry.op, WORK[entry.op], args[WORK[entry.op]])
    for name in pointers:  # random pointers only with zero work
        args[name] = draw(py_hostile(entry, name, 0, zero_work=kind == "ok" and work == 0))
    return args


def _converted_matches(entry: PyEntry, converted: dict[str, Any], seen: list[Any]) -> None:
    """The C function got exactly the converted values."""
    if entry.fixed:
        got = dict(zip(FIXED_PARAMS[entry.op], seen))
        assert got["stream"] == 0
    else:
        got = seen[0]
    for name, value in converted.items():
        if FIELD_TYPES[entry.op][name] is ctypes.c_float:
            expected = value if entry.fixed else f32(value)  # the fixed launchers pass a double to ctypes
            assert same_float(got[name], expected), (name, got[name], expected)
        else:
            assert (got[name] or 0) == value, (name, got[name], value)


@pytest.mark.parametrize("entry", PY_ENTRIES, ids=str)
@examples(120)
@given(data=st.data())
def test_python_hostile_values(entry, data):
    args = data.draw(py_args(entry), label="args")
    if entry.query and not no_gpu() and classify_int(args["num_seqs"], U32_MAX) == ("ok", 0):
        args["num_seqs"] = 1  # a GPU may be usable: see test_c_workspace_bytes_of_zero_sequences
    verdicts = {name: classify(entry.op, name, value) for name, value in args.items()}
    refused = {name: kind for name, (kind, _) in verdicts.items() if kind != "ok"}
    before = set_error_message()
    with watch_c(entry.c_name) as record:
        try:
            getattr(fp8kturbov, entry.name)(**args)
            raised = None
        except Exception as error:  # noqa: BLE001 (checked below)
            raised = error
    assert not record.violations, record.violations  # never reaches C with a value it would wrap
    if refused:
        assert record.calls == [] and last_error() == before, "C was called"
        if isinstance(raised, fp8kturbov.Fp8kturbovError):
            assert type(raised) is fp8kturbov.InvalidValueError and raised.status == V, raised
            assert any(f"{name} = " in raised.message for name in refused), (raised.message, refused)
        else:
            assert isinstance(raised, TypeError), (raised, refused)
            assert "type" in refused.values(), (raised, refused)
        return
    assert len(record.calls) == 1, record.calls
    converted = {name: value for name, (_, value) in verdicts.items()}
    _converted_matches(entry, converted, record.calls[0][1])
    full = {**(DECODE_QUERY_DEFAULTS if entry.query else {}), **converted}
    e = model(entry.op, entry.bits or full["v_bits"], full, query=entry.query)
    if raised is None:
        status = Status.SUCCESS
    else:
        assert isinstance(raised, fp8kturbov.Fp8kturbovError), raised
        assert type(raised) is EXCEPTIONS[raised.status] and raised.message == last_error()
        status = raised.status
    check_status(entry.c_name, status, e, ok=query_ok() if entry.query else {Status.SUCCESS})


DECODE_QUERY_DEFAULTS = {"k_cache": 0, "v_cache": 0}


# CacheLayout: integers in [1, 2^32 - 1] for the shape (v_bits 2, 3, 4), num_blocks >= 0.
@st.composite
def layout_args(draw) -> dict[str, Any]:
    args = {"num_blocks": draw(st.one_of(st.integers(0, 2**70), st.just(0))),
            "block_size": draw(st.one_of(st.sampled_from([1, 16]), c_u32)),
            "num_kv_heads": draw(st.one_of(st.integers(1, 64), c_u32)),
            "head_dim": draw(st.one_of(st.sampled_from([16, 64, 128, 80, 100]), c_u32)),
            "v_bits": draw(st.one_of(st.sampled_from([2, 3, 4]), c_u32))}
    for name in draw(st.lists(st.sampled_from(sorted(args)), unique=True, max_size=3)):
        hostile = py_int_hostile(U32_MAX, 16).filter(lambda v: not isinstance(v, (bool, np.bool_)))
        args[name] = draw(hostile)  # bools: see test_python_cache_layout_refuses_bools
    return args


SIZE_FUNCTIONS = ("fp8kturbov_k_page_bytes", "fp8kturbov_v_data_section_bytes", "fp8kturbov_v_page_bytes")


@FUZZ
@given(args=layout_args())
def test_python_cache_layout_hostile_values(args):
    shape_names = ("block_size", "num_kv_heads", "head_dim", "v_bits")
    accepted = {}
    refused, either = [], []  # either: NumPy integers, which CacheLayout may refuse
    for name, value in args.items():
        kind, number = classify_int(value, 2**70 if name == "num_blocks" else U32_MAX)
        if kind == "ok" and (name == "num_blocks" or number > 0):
            accepted[name] = number
            if not type(value) is int:
                either.append(name)
        else:
            refused.append(name)
    with watch_c(*SIZE_FUNCTIONS) as record:
        try:
            layout = fp8kturbov.CacheLayout(**args)
            raised = None
        except Exception as error:  # noqa: BLE001 (checked below)
            raised = error
    assert not record.violations, record.violations
    if refused:
        assert isinstance(raised, fp8kturbov.InvalidValueError), (raised, refused)
        assert any(name in raised.message for name in refused + either), (raised.message, refused)
        return
    sizes = format_sizes(*(accepted[n] for n in shape_names))
    if raised is not None:
        assert isinstance(raised, fp8kturbov.InvalidValueError), raised
        assert either or 0 in sizes.values(), (raised, args)
        return
    assert 0 not in sizes.values(), (layout, args)
    assert (layout.k_block_stride_bytes, layout.v_data_section_bytes, layout.v_block_stride_bytes) == \
        (sizes["k_page_bytes"], sizes["v_data_section_bytes"], sizes["v_page_bytes"])
    assert layout.k_pool_bytes == accepted["num_blocks"] * sizes["k_page_bytes"]
    assert layout.v_pool_bytes == accepted["num_blocks"] * sizes["v_page_bytes"]


# ---- Python-layer defects found by the fuzz (expected to fail until fixed) ----------------------------
def _python_valid(entry: PyEntry) -> dict[str, Any]:
    n, bits = 2 * 128, entry.bits or 3
    args = {"num_kv_heads": 2, "head_dim": 128, "block_size": 16, "k_scale": 1.0, "v_bits": bits,
            "v_block_stride_bytes": (2 * bits + 1) * 16 * n // 16,
            "v_data_section_bytes": 16 * n * bits // 8,
            "num_tokens": 0, "key_stride": n, "value_stride": n, "k_block_stride_bytes": 16 * n,
            "max_blocks_per_seq": 4, "num_seqs": 0, "num_q_heads": 4, "inv_sqrt_d": 0.125,
            "q_stride": 2 * n, "sliding_window": 0, "sparse_v_threshold": 1e-3}
    args.update(dict.fromkeys(POINTERS[entry.op], 0))
    return {name: args[name] for name in entry.names if name in args}


def _float_cases() -> Iterator[Any]:
    """Each Python function with one of its float arguments (every one for the generic decode)."""
    for entry in PY_ENTRIES:
        floats = [n for n in entry.names if FIELD_TYPES[entry.op][n] is ctypes.c_float]
        for name in floats if entry.name == "paged_decode_attn" else floats[-1:]:
            yield pytest.param(entry, name, id=f"{entry}-{name}")


@pytest.mark.parametrize("entry, name", list(_float_cases()))
def test_python_huge_int_for_a_float_is_refused(entry, name):
    value = -(10**400) if "decode" in entry.name else Fraction(10**400)
    before = set_error_message()
    with pytest.raises(fp8kturbov.InvalidValueError, match=f"{name} = "):
        getattr(fp8kturbov, entry.name)(**(_python_valid(entry) | {name: value}))
    assert last_error() == before


@pytest.mark.parametrize("entry", [e for e in PY_ENTRIES if e.bits in (None, 3) and not e.query], ids=str)
@pytest.mark.parametrize("value", ["0.5", b"1", "abc"], ids=repr)
def test_python_string_for_a_float_is_refused(entry, value):
    before = set_error_message()
    with pytest.raises((fp8kturbov.InvalidValueError, TypeError)):
        getattr(fp8kturbov, entry.name)(**(_python_valid(entry) | {"k_scale": value}))
    assert last_error() == before


@pytest.mark.parametrize("entry", [e for e in PY_ENTRIES if not e.query], ids=str)
@pytest.mark.parametrize("value", [np.uint64(0), np.int64(2**44)], ids=repr)
def test_python_numpy_integer_pointer_is_accepted(entry, value):
    """Integer arguments accept NumPy integers (operator.index); pointers too, with zero work."""
    args = _python_valid(entry) | {POINTERS[entry.op][1]: value}
    getattr(fp8kturbov, entry.name)(**args)  # zero work: a no-op
    assert last_error() == ""


@pytest.mark.parametrize("name", ["block_size", "num_kv_heads"])
def test_python_cache_layout_refuses_bools(name):
    kwargs = {"num_blocks": 4, "block_size": 16, "num_kv_heads": 2, "head_dim": 128, "v_bits": 3}
    with pytest.raises(fp8kturbov.InvalidValueError):
        fp8kturbov.CacheLayout(**(kwargs | {name: True}))
