"""Dequantize (pages -> bf16 rows): the NumPy reference, the C entry point's argument checks, and
the kernel against the reference bit for bit.

The CPU tests need no GPU and also pass on a GPU machine: every C call has zero work, breaks a rule
checked before anything is launched, or (fake pointers that a missing check would launch on) runs
only where conftest finds no usable GPU. Expected messages come from the header's rules (the
write's row and pool rules, then the pointers), never from the library under test.

The GPU tests read pools of random bytes into which the reference wrote rows (outliers, an all-zero
group, NaN bytes), through padded page strides, into poisoned outputs with padded row strides, and
compare every output element's bits with ``reference.dequantize_cache``.
"""

from __future__ import annotations

import ctypes
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from abi_util import EXCEPTIONS, last_error, no_gpu, struct_before_an_unreadable_page, v1_struct_size
from fp8kturbov import Status
from fp8kturbov import reference as ref
from fp8kturbov._lib import DequantizeParams, lib

BF16 = ml_dtypes.bfloat16
C_NAME = "fp8kturbov_dequantize"
POINTERS = ["k_cache", "v_cache", "slot_mapping", "key", "value"]  # header order: the order checked
FAKE_BASE = 0x7F00_0000_0000  # 16-aligned addresses that are only passed where nothing is launched
U64_MAX = 2**64 - 1
V, NULL, MIS = Status.INVALID_VALUE, Status.NULL_POINTER, Status.MISALIGNED


class Pools:
    """One layer's pools of random bytes with padded page strides, into which the reference wrote
    half of the slots: N(0, 1) rows, 1/8 of them x10, group 0 of the first V row all zero."""

    def __init__(self, rng: np.random.Generator, bits: int, head_dim: int, *, num_kv_heads: int = 2,
                 block_size: int = 16, num_blocks: int = 12, k_scale: float = 0.25) -> None:
        self.bits, self.head_dim, self.num_kv_heads = bits, head_dim, num_kv_heads
        self.block_size, self.k_scale = block_size, k_scale
        self.n = n = num_kv_heads * head_dim
        self.k_stride = ref.k_page_bytes(block_size, num_kv_heads, head_dim) + 48
        self.v_data = ref.v_data_section_bytes(block_size, num_kv_heads, head_dim, bits) + 8
        self.v_stride = self.v_data + ref.v_scale_section_bytes(block_size, num_kv_heads, head_dim) + 24
        self.num_slots = num_blocks * block_size
        self.k_pool = rng.integers(0, 256, size=num_blocks * self.k_stride, dtype=np.uint8)
        self.v_pool = rng.integers(0, 256, size=num_blocks * self.v_stride, dtype=np.uint8)

        self.written = rng.choice(self.num_slots, size=self.num_slots // 2, replace=False).astype(np.int64)
        rows = rng.standard_normal((2, len(self.written), n)).astype(np.float32)
        rows[:, rng.random(len(self.written)) < 1 / 8] *= 10
        rows[1, 0, :ref.GROUP_ELEMS] = 0
        self.keys, self.values = rows.astype(BF16)
        ref.write_cache(self.keys, self.values, self.k_pool, self.v_pool, self.written, len(self.written),
                        num_kv_heads, head_dim, block_size, n, n, k_scale, self.k_stride, self.v_stride,
                        self.v_data, bits)

    def add_nan_bytes(self) -> tuple[int, int]:
        """Byte 0x7F (NaN) at K element 5 and at the scale of V group 1 of the first written row;
        returns the elements (K, first of the V group) that read back as NaN."""
        page, offset = divmod(int(self.written[0]), self.block_size)
        self.k_pool[page * self.k_stride + offset * self.n + 5] = 0x7F
        self.v_pool[page * self.v_stride + self.v_data + offset * (self.n // ref.GROUP_ELEMS) + 1] = 0x7F
        return 5, ref.GROUP_ELEMS

    def scalars(self) -> dict[str, Any]:
        """The layout arguments of ``fp8kturbov.dequantize`` (page strides and sections in BYTES)."""
        return dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=self.block_size,
                    k_scale=self.k_scale, v_bits=self.bits, k_block_stride_bytes=self.k_stride,
                    v_block_stride_bytes=self.v_stride, v_data_section_bytes=self.v_data)

    def reference(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ref.dequantize_cache(self.k_pool, self.v_pool, slots, len(slots), self.num_kv_heads,
                                    self.head_dim, self.block_size, self.k_scale, self.k_stride,
                                    self.v_stride, self.v_data, self.bits)


# ---- The reference ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_reference_reads_back_what_the_write_wrote(rng, bits, head_dim):
    pools = Pools(rng, bits, head_dim)
    slots = pools.written.copy()
    padding = rng.random(len(slots)) < 0.1
    slots[padding] = -1
    key, value = pools.reference(slots)
    assert key.dtype == value.dtype == BF16 and key.shape == value.shape == (len(slots), pools.n)

    # K: within the E4M3 rounding of the keys (half a step: 2^-4 relative, 2^-10 · k_scale among
    # the subnormals), plus the rounding of the product to bf16 (2^-9 relative).
    keys = pools.keys.astype(np.float32)[~padding]
    error = np.abs(key[~padding].astype(np.float32) - keys)
    assert np.all(error <= np.abs(keys) * (2**-4 + 2**-8) + pools.k_scale * 2**-10 * 1.01), error.max()
    # V: the decoded bytes of the write (codes and scales of its encoder), rounded to bf16.
    data, scales = ref.encode_v(pools.values[~padding], bits)
    assert np.array_equal(value[~padding].view(np.uint16),
                          ref.decode_v(data, scales, bits).astype(BF16).view(np.uint16))
    assert not np.any(key[padding].view(np.uint16)) and not np.any(value[padding].view(np.uint16))


def test_reference_negative_slots_give_zero_rows(rng):
    pools = Pools(rng, 3, 64)
    slots = np.array([-1, -2, -pools.num_slots, np.iinfo(np.int64).min], dtype=np.int64)
    for rows in pools.reference(slots):
        assert rows.shape == (len(slots), pools.n) and not np.any(rows.view(np.uint16))  # +0.0


def test_reference_nan_bytes_read_back_as_nan(rng):
    pools = Pools(rng, 4, 64)
    k_element, v_group_start = pools.add_nan_bytes()
    key, value = pools.reference(pools.written[:1])
    assert np.flatnonzero(np.isnan(key[0].astype(np.float32))).tolist() == [k_element]
    assert np.flatnonzero(np.isnan(value[0].astype(np.float32))).tolist() == \
        list(range(v_group_start, v_group_start + ref.GROUP_ELEMS))


@pytest.mark.parametrize("byte, k_scale, bits", [
    (0x38, 1 + 2**-8, 0x3F80),      # 1.0 · k_scale halfway between 0x3F80 and 0x3F81: the even one
    (0x38, 1 + 3 * 2**-8, 0x3F82),  # halfway between 0x3F81 and 0x3F82: the even one
    (0x39, 1 + 2**-8, 0x3F91),      # 1.125 · k_scale = 1.1294: nearer 0x3F91 (1.1328) than 0x3F90
], ids=["tie_to_even_below", "tie_to_even_above", "nearest"])
def test_reference_rounds_the_float32_product_to_nearest_even(byte, k_scale, bits):
    """One token, one head of 16 elements, pages of one slot (16 K bytes; 6 + 1 V bytes)."""
    k_pool = np.full(16, byte, dtype=np.uint8)
    v_pool = np.zeros(7, dtype=np.uint8)
    key, _ = ref.dequantize_cache(k_pool, v_pool, [0], 1, 1, 16, 1, k_scale, 16, 7, 6, 3)
    assert key.view(np.uint16).tolist() == [[bits] * 16]


# ---- Argument checks through the C library ------------------------------------------------------------
def valid_args(work: int = 0, *, head_dim: int = 128, num_kv_heads: int = 2, block_size: int = 16,
               v_bits: int = 3) -> dict[str, Any]:
    """Valid keyword arguments of ``fp8kturbov.dequantize``: packed pages (FORMAT §2, §3 sizes),
    NULL pointers and ``work`` tokens."""
    n = num_kv_heads * head_dim
    args: dict[str, Any] = dict.fromkeys(POINTERS, 0)
    args.update(num_tokens=work, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                key_stride=n, value_stride=n, k_scale=1.0, v_bits=v_bits,
                k_block_stride_bytes=ref.k_page_bytes(block_size, num_kv_heads, head_dim),
                v_block_stride_bytes=ref.v_page_bytes(block_size, num_kv_heads, head_dim, v_bits),
                v_data_section_bytes=ref.v_data_section_bytes(block_size, num_kv_heads, head_dim, v_bits))
    return args


def fake_pointers(names: list[str]) -> dict[str, int]:
    return {name: FAKE_BASE + 0x10_0000 * i for i, name in enumerate(names)}


def params_struct(args: dict[str, Any], struct_size: int | None = None) -> DequantizeParams:
    """The defaults of ``fp8kturbov_dequantize_params_init``, then ``args``; ``struct_size``
    claimed instead of the full size if given."""
    params = DequantizeParams()
    lib.fp8kturbov_dequantize_params_init(ctypes.byref(params))
    for name, value in args.items():
        setattr(params, name, value)
    if struct_size is not None:
        params.struct_size = struct_size
    return params


def call_c(args: dict[str, Any], struct_size: int | None = None) -> int:
    """``fp8kturbov_dequantize`` on its own (no Python check in between), NULL stream."""
    return lib.fp8kturbov_dequantize(ctypes.byref(params_struct(args, struct_size)), None)


def show(name: str, value: Any) -> str:
    """``name = value`` as the C message prints it (%u / PRIu64, %g, %p)."""
    if isinstance(value, float):
        return f"{name} = {value:g}"
    if name in POINTERS:
        return f"{name} = {value:#x}"
    return f"{name} = {value}"


def _set(**overrides: Any) -> Callable[[dict], dict]:
    return lambda args: overrides


def _add(name: str, delta: int) -> Callable[[dict], dict]:
    return lambda args: {name: args[name] + delta}


@dataclass(frozen=True)
class Bad:
    """A change to the valid arguments that breaks one rule; the message must show ``named`` as
    ``name = value`` (or contain ``text``)."""

    id: str
    change: Callable[[dict], dict]
    named: str = ""
    status: Status = V
    text: str = ""

    def args(self, work: int) -> dict[str, Any]:
        args = valid_args(work)
        return args | self.change(args)

    def expected(self, args: dict[str, Any]) -> str:
        return self.text or show(self.named, args[self.named])


BAD = [
    *[Bad(f"v_bits_{b}", _set(v_bits=b), "v_bits") for b in (0, 1, 5)],
    *[Bad(f"head_dim_{d}", _set(head_dim=d), "head_dim") for d in (0, 8, 100)],
    Bad("num_kv_heads_0", _set(num_kv_heads=0), "num_kv_heads"),
    Bad("block_size_0", _set(block_size=0), "block_size"),
    Bad("row_over_uint32", _set(num_kv_heads=2**28, head_dim=32), text=f"num_kv_heads * head_dim = {2**33}"),
    *[Bad(f"{name}_short", _add(name, -1), name) for name in ("key_stride", "value_stride")],
    *[Bad(f"k_scale_{v}", _set(k_scale=v), "k_scale")
      for v in (0.0, -0.0, -1.0, math.nan, math.inf, -math.inf)],
    Bad("k_page_stride_short", _add("k_block_stride_bytes", -16), "k_block_stride_bytes"),
    Bad("k_page_stride_unaligned", _add("k_block_stride_bytes", 8), "k_block_stride_bytes", MIS),
    Bad("k_cache_unaligned", _set(k_cache=FAKE_BASE + 8), "k_cache", MIS),
    Bad("v_data_short", _add("v_data_section_bytes", -1), "v_data_section_bytes"),
    Bad("v_page_stride_short", _add("v_block_stride_bytes", -1), "v_block_stride_bytes"),
    Bad("v_data_past_page", _add("v_data_section_bytes", 1), "v_block_stride_bytes"),
    Bad("v_data_wraps", _set(v_data_section_bytes=U64_MAX), "v_block_stride_bytes"),
]


def expect_failure(args: dict[str, Any], status: Status, text: str) -> None:
    """Through Python and then through C alone: the status, its exception, a message that starts
    with the entry point's name and contains ``text``."""
    with pytest.raises(EXCEPTIONS[status]) as info:
        fp8kturbov.dequantize(**args)
    error = info.value
    assert error.status == status
    assert error.message.startswith(f"{C_NAME}: ") and text in error.message, error.message
    assert last_error() == error.message
    assert call_c(args) == status
    assert last_error() == error.message


@pytest.mark.parametrize("work", [0, 1], ids=["no_tokens", "one_token"])
@pytest.mark.parametrize("bad", BAD, ids=lambda bad: bad.id)
def test_bad_argument_is_rejected_naming_it(bad, work):
    """A broken scalar rule is reported with or without work, before any pointer is looked at."""
    args = bad.args(work)
    expect_failure(args, bad.status, bad.expected(args))


SHAPES = {
    "packed": {},
    **{f"head_dim_{d}": {"head_dim": d} for d in (16, 80, 1024)},
    "block_size_1": {"block_size": 1},
    "one_kv_head": {"num_kv_heads": 1},
    **{f"v_bits_{b}": {"v_bits": b} for b in (2, 3, 4)},
}
CHANGES = {
    "padded_k_pages": _add("k_block_stride_bytes", 16),
    "padded_v_pages": lambda a: {"v_data_section_bytes": a["v_data_section_bytes"] + 4,
                                 "v_block_stride_bytes": a["v_block_stride_bytes"] + 16},
    "odd_v_pages": _add("v_block_stride_bytes", 7),
    "padded_rows": lambda a: {"key_stride": a["key_stride"] + 3, "value_stride": a["value_stride"] + 8},
    "k_scale_1e-45": _set(k_scale=1e-45),  # no reciprocal is taken: a denormal scale is valid
    "k_scale_3e38": _set(k_scale=3e38),
    # Checked mode needs its error word only when there is work.
    "checked_null_error_flags": _set(num_blocks=8),
    "checked_misaligned_error_flags": _set(num_blocks=8, error_flags=FAKE_BASE + 2),
}


GOOD = {**{name: valid_args(**shape) for name, shape in SHAPES.items()},
        **{name: valid_args() | change(valid_args()) for name, change in CHANGES.items()}}


@pytest.mark.parametrize("args", GOOD.values(), ids=GOOD.keys())
def test_zero_tokens_with_null_pointers_succeed(args):
    lib.fp8kturbov_dequantize(None, None)  # a known earlier failure
    fp8kturbov.dequantize(**args)
    assert last_error() == ""  # a success clears it
    lib.fp8kturbov_dequantize(None, None)
    assert call_c(args) == Status.SUCCESS and last_error() == ""


# For calls with every pointer set: a missing check would launch on the fake pointers.
RISKY = [] if no_gpu() else [pytest.mark.skip(reason="a GPU may be usable: no fake pointers")]


@pytest.mark.parametrize("index", [pytest.param(i, id=name, marks=RISKY if name == POINTERS[-1] else [])
                                   for i, name in enumerate(POINTERS)])
def test_null_pointer_with_work_is_named(index):
    """The pointers before ``index`` are set, the others NULL: the first NULL one is reported."""
    args = valid_args(work=1) | fake_pointers(POINTERS[:index])
    expect_failure(args, NULL, f"{POINTERS[index]} is NULL")
    assert last_error() == f"{C_NAME}: {POINTERS[index]} is NULL"


@pytest.mark.parametrize("name, offset", [pytest.param(name, offset, id=f"{name}+{offset}", marks=RISKY)
                                          for name in ("key", "value") for offset in (1, 3)])
def test_odd_output_address_is_misaligned(name, offset):
    args = valid_args(work=1) | fake_pointers(POINTERS)
    args[name] += offset
    expect_failure(args, MIS, show(name, args[name]))


@pytest.mark.skipif(not no_gpu(), reason="a GPU may be usable: no fake pointers")
def test_launch_without_gpu_reports_the_cuda_error():
    """Outputs 2-byte aligned (not 16) pass every check: the launch itself is refused."""
    args = valid_args(work=1) | fake_pointers(POINTERS)
    args["key"] += 2
    args["value"] += 6
    with pytest.raises(fp8kturbov.CudaError) as info:
        fp8kturbov.dequantize(**args)
    assert info.value.message.startswith(f"{C_NAME}: ")
    assert re.search(r"\bcudaError[A-Z]\w+", info.value.message), info.value.message


WORD = FAKE_BASE + 0x100_0000  # a fake error word, 16-byte aligned


def checked_args(**checked_mode: int) -> dict[str, Any]:
    """One token, every pointer set, and ``checked_mode`` (num_blocks, error_flags)."""
    return valid_args(work=1) | fake_pointers(POINTERS) | checked_mode


@pytest.mark.parametrize("error_flags, status, text", [
    pytest.param(0, NULL, "error_flags is NULL", id="null", marks=RISKY),
    *[pytest.param(WORD + offset, MIS, f"error_flags = {WORD + offset:#x} is not 4-byte aligned",
                   id=f"misaligned+{offset}", marks=RISKY) for offset in (1, 2)]])
def test_checked_mode_needs_an_aligned_error_word(error_flags, status, text):
    expect_failure(checked_args(num_blocks=8, error_flags=error_flags), status, text)


def test_checked_mode_error_word_is_checked_after_the_other_pointers():
    expect_failure(valid_args(work=1) | {"num_blocks": 8}, NULL, f"{POINTERS[0]} is NULL")


@pytest.mark.skipif(not no_gpu(), reason="a GPU may be usable: no fake pointers")
@pytest.mark.parametrize("error_flags", [0, WORD + 2], ids=["null", "misaligned"])
def test_unchecked_call_ignores_error_flags(error_flags):
    """num_blocks = 0: every check passes and the launch itself is refused (no GPU)."""
    args = checked_args(num_blocks=0, error_flags=error_flags)
    with pytest.raises(fp8kturbov.CudaError):
        fp8kturbov.dequantize(**args)
    assert call_c(args) == Status.CUDA_ERROR


def test_v1_struct_size_is_accepted():
    v1_size = v1_struct_size("dequantize")
    lib.fp8kturbov_dequantize(None, None)  # a known earlier failure
    assert call_c(valid_args() | {"num_blocks": 8, "error_flags": WORD + 1}, v1_size) == Status.SUCCESS
    assert last_error() == ""
    assert call_c(valid_args() | {"head_dim": 100}, v1_size) == V  # the version-1 fields are read
    assert "head_dim = 100" in last_error()


@pytest.mark.skipif(not no_gpu(), reason="a GPU may be usable: no fake pointers")
@pytest.mark.parametrize("error_flags", [0, WORD + 2], ids=["null", "misaligned"])
def test_v1_struct_size_ignores_the_checked_mode_fields(error_flags):
    """Checked mode past the V1 size would fail on error_flags; read as 0 (unchecked), the call
    gets to the launch, which fails without a GPU."""
    args = checked_args(num_blocks=8, error_flags=error_flags)
    assert call_c(args, v1_struct_size("dequantize")) == Status.CUDA_ERROR, last_error()
    assert call_c(args) == (NULL if error_flags == 0 else MIS)


@pytest.mark.parametrize("work", [0, pytest.param(1, marks=RISKY)], ids=["no_work", "work"])
def test_v1_struct_is_not_read_past_its_size(work):
    """An old caller's struct may end where its memory ends (a fault here kills the test run)."""
    v1_size = v1_struct_size("dequantize")
    args = valid_args() if work == 0 else checked_args()
    params, _mapping = struct_before_an_unreadable_page(params_struct(args, v1_size), v1_size)
    expected = Status.SUCCESS if work == 0 else Status.CUDA_ERROR
    assert lib.fp8kturbov_dequantize(params, None) == expected, last_error()


def test_null_params_struct():
    assert lib.fp8kturbov_dequantize(None, None) == NULL
    assert last_error() == f"{C_NAME}: params is NULL"


@pytest.mark.parametrize("delta", [-8, 8, "zero"])
def test_wrong_struct_size(delta):
    params = DequantizeParams()
    lib.fp8kturbov_dequantize_params_init(ctypes.byref(params))
    params.struct_size = 0 if delta == "zero" else ctypes.sizeof(DequantizeParams) + delta
    assert lib.fp8kturbov_dequantize(ctypes.byref(params), None) == Status.BAD_STRUCT_SIZE
    assert last_error().startswith(f"{C_NAME}: ")
    assert f"struct_size = {params.struct_size}" in last_error()
    assert str(ctypes.sizeof(DequantizeParams)) in last_error()


RANGE_ERRORS = [("num_tokens", -1), ("key_stride", 2**32), ("head_dim", True), ("block_size", 16.0),
                ("k_scale", 1e39), ("v_data_section_bytes", 2**64), ("key", -2), ("slot_mapping", 2**64),
                ("num_blocks", -1), ("error_flags", 2**64)]


@pytest.mark.parametrize("name, value", [pytest.param(name, value, id=f"{name}={value!r}")
                                         for name, value in RANGE_ERRORS])
def test_python_range_error_is_raised_before_c(name, value):
    lib.fp8kturbov_dequantize(None, None)
    before = last_error()
    with pytest.raises(fp8kturbov.InvalidValueError) as info:
        fp8kturbov.dequantize(**(valid_args() | {name: value}))
    assert f"{name} = {value!r}" in info.value.message
    assert last_error() == before  # C was not called


# ---- The kernel against the reference (GPU) -----------------------------------------------------------
POISON = 0x7FC1  # a bf16 NaN no conversion produces: an element still holding it was not written
# (1 + 2^-8) / 8: the K product of every E4M3 value with mantissa 0 lies halfway between two bf16
# values, so the kernel's round-half-to-even is checked on ties too.
TIE_K_SCALE = (1 + 2**-8) / 8


@pytest.fixture(scope="module")
def device():
    from gpu_util import Device

    dev = Device()
    yield dev
    dev.free_all()


def is_nan(bits: np.ndarray) -> np.ndarray:
    """Which bf16 bit patterns are NaN (exponent all ones, mantissa nonzero)."""
    return (bits & 0x7FFF) > 0x7F80


def assert_rows_match(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """``got`` (uint16 bits) equals ``want`` (bf16) bit for bit, except that a NaN may be any NaN;
    NaN positions must be the same, and none may be the poison."""
    want_bits = want.view(np.uint16)
    nan = is_nan(want_bits)
    moved = np.argwhere(is_nan(got) != nan)
    assert moved.size == 0, f"{what}: NaN positions differ, first {moved[:4].tolist()}"
    unwritten = np.argwhere(got == POISON)
    assert unwritten.size == 0, f"{what}: {len(unwritten)} not written, first {unwritten[:4].tolist()}"
    differ = np.argwhere((got != want_bits) & ~nan)
    assert differ.size == 0, (f"{what}: {len(differ)} elements differ, first (token, element) "
                              f"{differ[:4].tolist()}: {got[tuple(differ[0])]:#06x} vs "
                              f"{want_bits[tuple(differ[0])]:#06x}")


def read_slots(rng, pools: Pools, num_tokens: int) -> np.ndarray:
    """Slots to read: written and unwritten ones (random bytes), repeats, negative ones, and the
    first written row (which holds the NaN bytes)."""
    slots = rng.integers(0, pools.num_slots, size=num_tokens, dtype=np.int64)
    slots[rng.random(num_tokens) < 0.1] = -1
    slots[:3] = [pools.written[0], np.iinfo(np.int64).min, -pools.num_slots]
    return slots


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("row_pad", [(8, 3), (3, 8)],
                         ids=["key_vector_value_scalar", "key_scalar_value_vector"])
def test_kernel_matches_reference_bit_for_bit(device, rng, bits, head_dim, row_pad):
    """Row strides in elements: n + 8 from a 256-byte aligned buffer allows 16-byte stores, n + 3
    only 2-byte ones; the padding between rows must keep its poison."""
    pools = Pools(rng, bits, head_dim, k_scale=TIE_K_SCALE)
    pools.add_nan_bytes()
    num_tokens, n = 150, pools.n
    slots = read_slots(rng, pools, num_tokens)
    key_stride, value_stride = n + row_pad[0], n + row_pad[1]
    key_poison = np.full((num_tokens, key_stride), POISON, dtype=np.uint16)
    value_poison = np.full((num_tokens, value_stride), POISON, dtype=np.uint16)
    key_dev, value_dev = device.upload(key_poison), device.upload(value_poison)
    fp8kturbov.dequantize(device.upload(pools.k_pool), device.upload(pools.v_pool), device.upload(slots),
                          key_dev, value_dev, num_tokens=num_tokens, key_stride=key_stride,
                          value_stride=value_stride, stream=device.stream, **pools.scalars())
    got_key, got_value = device.download(key_dev, key_poison), device.download(value_dev, value_poison)

    want_key, want_value = pools.reference(slots)
    assert is_nan(want_key.view(np.uint16)).any() and is_nan(want_value.view(np.uint16)).any()
    assert not want_key[1].view(np.uint16).any(), "a negative slot gives +0.0"
    assert_rows_match(got_key[:, :n], want_key, "key")
    assert_rows_match(got_value[:, :n], want_value, "value")
    assert np.all(got_key[:, n:] == POISON), "key: the padding between rows was written"
    assert np.all(got_value[:, n:] == POISON), "value: the padding between rows was written"


@pytest.mark.gpu
def test_kernel_zero_tokens_writes_nothing(device, rng):
    pools = Pools(rng, 3, 128)
    poison = np.full((4, pools.n), POISON, dtype=np.uint16)
    key_dev, value_dev = device.upload(poison), device.upload(poison)
    fp8kturbov.dequantize(device.upload(pools.k_pool), device.upload(pools.v_pool),
                          device.upload(read_slots(rng, pools, 4)), key_dev, value_dev, num_tokens=0,
                          key_stride=pools.n, value_stride=pools.n, stream=device.stream, **pools.scalars())
    assert np.all(device.download(key_dev, poison) == POISON)
    assert np.all(device.download(value_dev, poison) == POISON)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["key", "value"])
def test_kernel_odd_output_address_is_refused(device, rng, name):
    pools = Pools(rng, 3, 128)
    rows = np.zeros((2, pools.n + 1), dtype=np.uint16)
    args = dict(k_cache=device.upload(pools.k_pool), v_cache=device.upload(pools.v_pool),
                slot_mapping=device.upload(pools.written[:2]), key=device.upload(rows),
                value=device.upload(rows))
    args[name] += 1
    with pytest.raises(fp8kturbov.MisalignedError, match=f"{C_NAME}: {name} = 0x"):
        fp8kturbov.dequantize(**args, num_tokens=2, key_stride=pools.n, value_stride=pools.n,
                              stream=device.stream, **pools.scalars())
