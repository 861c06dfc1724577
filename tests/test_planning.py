"""Cache planning: sizes from docs/format.md's formulas, capacity in whole pages, the K scale."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8kturbov import planning
from fp8kturbov import reference as ref

TURBO_BITS = {"fp8k_turbo2v": 2, "fp8k_turbo3v": 3, "fp8k_turbo4v": 4}


def per_head_bytes(fmt: str, head_dim: int) -> int:
    """Bytes per token per KV head by docs/format.md: K one byte per element (§2); V ``b/8``
    bytes per element of codes plus one scale byte per 16 elements (§3); dense: 2 x D x width."""
    if fmt in TURBO_BITS:
        return head_dim + head_dim * TURBO_BITS[fmt] // 8 + head_dim // 16
    return 2 * head_dim * {"bf16": 2, "fp8": 1}[fmt]


# ---- Sizes -------------------------------------------------------------------------------------------


def test_the_formats_table_at_head_dim_128():
    """docs/format.md §3: per token per KV head at D = 128, K 128 B and V 72 / 56 / 40 B."""
    got = {fmt: planning.bytes_per_token(1, 128, fmt) for fmt in planning.FORMATS}
    assert got == {"bf16": 512, "fp8": 256, "fp8k_turbo2v": 128 + 40, "fp8k_turbo3v": 128 + 56,
                   "fp8k_turbo4v": 128 + 72}


@pytest.mark.parametrize("fmt", list(planning.FORMATS))
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_bytes_per_token_follows_the_format(fmt, num_kv_heads, head_dim):
    assert planning.bytes_per_token(num_kv_heads, head_dim, fmt) == (
        num_kv_heads * per_head_bytes(fmt, head_dim))


@pytest.mark.parametrize("fmt, bits", list(TURBO_BITS.items()))
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_page_bytes_agree_with_the_python_reference(fmt, bits, block_size):
    """The library's sizes (through CacheLayout) against reference.py's, page by page."""
    want = (ref.k_page_bytes(block_size, 8, 128) + ref.v_page_bytes(block_size, 8, 128, bits))
    assert planning.page_bytes(8, 128, fmt, block_size) == want
    assert want == block_size * planning.bytes_per_token(8, 128, fmt)  # packed: no padding


@pytest.mark.parametrize("call, message", [
    (lambda: planning.bytes_per_token(8, 128, "int4"), "format 'int4'"),
    (lambda: planning.bytes_per_token(8, 100, "fp8k_turbo3v"), "multiple of 16"),
    (lambda: planning.bytes_per_token(0, 128, "bf16"), "num_kv_heads = 0"),
    (lambda: planning.bytes_per_token(True, 128, "fp8"), "num_kv_heads = True"),
    (lambda: planning.page_bytes(8, 128, "fp8", block_size=0), "block_size = 0"),
    (lambda: planning.tokens_that_fit(-1, num_layers=1, num_kv_heads=8, head_dim=128,
                                      fmt="fp8"), "budget_bytes = -1"),
    (lambda: planning.tokens_that_fit(1 << 30, num_layers=0, num_kv_heads=8, head_dim=128,
                                      fmt="fp8"), "num_layers = 0"),
])
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- Capacity ----------------------------------------------------------------------------------------


def test_tokens_that_fit_counts_whole_pages():
    layers, heads, dim, block = 32, 8, 128, 16
    page = block * heads * per_head_bytes("fp8k_turbo3v", dim)  # bytes of one layer's page
    kwargs = {"num_layers": layers, "num_kv_heads": heads, "head_dim": dim, "fmt": "fp8k_turbo3v"}
    assert planning.tokens_that_fit(7 * layers * page, **kwargs) == 7 * block
    assert planning.tokens_that_fit(7 * layers * page - 1, **kwargs) == 6 * block
    assert planning.tokens_that_fit(layers * page - 1, **kwargs) == 0
    assert planning.tokens_that_fit(0, **kwargs) == 0
    # 32-token pages are twice as large: 7 small pages of bytes hold 3 large ones.
    assert planning.tokens_that_fit(7 * layers * page, block_size=32, **kwargs) == 3 * 32


@given(budget=st.integers(0, 1 << 44), layers=st.integers(1, 128), heads=st.integers(1, 16),
       dim=st.sampled_from([64, 128, 256]), block=st.sampled_from([1, 8, 16, 64]),
       fmt=st.sampled_from(list(planning.FORMATS)))
def test_tokens_that_fit_is_the_most_whole_pages(budget, layers, heads, dim, block, fmt):
    tokens = planning.tokens_that_fit(budget, num_layers=layers, num_kv_heads=heads,
                                      head_dim=dim, fmt=fmt, block_size=block)
    token_bytes = layers * heads * per_head_bytes(fmt, dim)  # one token, every layer
    assert tokens % block == 0
    assert tokens * token_bytes <= budget < (tokens + block) * token_bytes


def test_capacity_table_compares_every_format():
    budget, shape = 40 << 30, {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
    rows = planning.capacity_table(budget, **shape)
    assert [row.fmt for row in rows] == list(planning.FORMATS)
    by_fmt = {row.fmt: row for row in rows}
    bf16 = by_fmt["bf16"]
    for row in rows:
        token_bytes = 8 * per_head_bytes(row.fmt, 128)
        assert row.bytes_per_token == token_bytes and row.page_bytes == 16 * token_bytes
        assert row.pages == budget // (32 * 16 * token_bytes) and row.tokens == 16 * row.pages
        assert row.tokens_vs_bf16 == pytest.approx(row.tokens / bf16.tokens)
        assert row.bytes_vs_bf16 == pytest.approx(token_bytes / 4096)
    order = ["bf16", "fp8", "fp8k_turbo4v", "fp8k_turbo3v", "fp8k_turbo2v"]
    tokens = [by_fmt[fmt].tokens for fmt in order]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert by_fmt["fp8k_turbo3v"].bytes_vs_bf16 == pytest.approx(184 / 512)  # README's 0.36


def test_capacity_table_with_no_room_has_no_ratio():
    rows = planning.capacity_table(1000, num_layers=2, num_kv_heads=8, head_dim=128)
    assert all(row.tokens == 0 and row.tokens_vs_bf16 is None for row in rows)


# ---- K scale -----------------------------------------------------------------------------------------


def test_k_scale_is_amax_over_448():
    keys = np.random.default_rng(1).standard_normal((64, 8, 128)).astype(np.float32)
    keys[3, 2, 7] = -9.5  # the largest magnitude, negative
    assert planning.calibrate_k_scale(keys) == pytest.approx(9.5 / 448, rel=1e-12)
    assert planning.calibrate_k_scale(keys, percentile=100) == planning.calibrate_k_scale(keys)


def test_k_scale_maps_the_largest_key_to_e4m3_max():
    """Encoded with the calibrated scale, the largest key becomes ±448 and reads back as itself
    (up to float32 rounding); nothing saturates below it."""
    keys = (np.random.default_rng(2).standard_normal(4096) * 3).astype(ml_dtypes.bfloat16)
    scale = planning.calibrate_k_scale(keys)
    codes = ref.encode_k(keys, scale)
    amax = float(np.abs(keys.astype(np.float32)).max())
    assert np.abs(ref.e4m3_decode(codes)).max() == 448.0
    assert np.abs(ref.decode_k(codes, scale)).max() == pytest.approx(amax, rel=1e-6)


def test_k_scale_percentile():
    keys = np.arange(101, dtype=np.float32) * np.where(np.arange(101) % 2, -1, 1)  # |keys| = 0..100
    assert planning.calibrate_k_scale(keys, percentile=37) == pytest.approx(37 / 448)
    assert planning.calibrate_k_scale(keys, percentile=99.5) == pytest.approx(99.5 / 448)
    # A percentile that lands on zeros falls back to the largest key.
    assert planning.calibrate_k_scale([0.0, 0.0, 0.0, 5.0], percentile=50) == pytest.approx(5 / 448)


def test_k_scale_of_zero_keys_and_tiny_keys():
    assert planning.calibrate_k_scale(np.zeros((4, 16))) == planning.ZERO_K_SCALE > 0
    tiny = planning.calibrate_k_scale([1e-300])
    assert tiny == planning.MIN_K_SCALE > 0
    assert np.isfinite(np.float32(1.0) / np.float32(tiny))  # the write's inverse stays finite


class _TensorLike:
    """Stands for a CPU torch tensor: NumPy reads it through ``__array__``."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.float32)

    def __array__(self, dtype=None, copy=None):
        return self.values if dtype is None else self.values.astype(dtype)


class _Bf16TensorLike(_TensorLike):
    """Stands for a torch bfloat16 tensor: NumPy cannot view it, ``float()`` converts it."""

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Got unsupported ScalarType BFloat16")

    def float(self):
        return _TensorLike(self.values)


@pytest.mark.parametrize("wrap", [_TensorLike, _Bf16TensorLike, list])
def test_k_scale_accepts_array_likes(wrap):
    values = [0.5, -2.0, 1.0]
    assert planning.calibrate_k_scale(wrap(values)) == pytest.approx(2.0 / 448)


@pytest.mark.parametrize("keys, percentile, message", [
    (np.array([], dtype=np.float32), None, "empty"),
    ([1.0, np.nan], None, "NaN"),
    ([1.0, -np.inf], 50, "NaN or ±inf"),
    ([1.0], 0, "percentile = 0"),
    ([1.0], 100.5, "percentile = 100.5"),
    ([1e300], None, "overflows float32"),
])
def test_k_scale_rejects(keys, percentile, message):
    with pytest.raises(ValueError, match=message):
        planning.calibrate_k_scale(keys, percentile)


def test_k_scale_is_a_python_float():
    scale = planning.calibrate_k_scale(np.ones(3, dtype=ml_dtypes.bfloat16))
    assert type(scale) is float and math.isclose(scale, 1 / 448)
