"""Scalars of the Python layer, hostile and odd: NumPy integers are integers everywhere (the
layout, the planning helpers, the launches), a bool is neither a size nor a scale, and a float
that float32 would round to 0 (a soft cap or a scale of 1e-46) is refused rather than silently
turned into 0. No GPU needed."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8kturbov import CacheLayout, InvalidValueError, planning
from fp8kturbov._scalars import F32_MAX, float32

NUMPY_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_numpy_integers_are_sizes_of_a_layout(kind):
    layout = CacheLayout(kind(8), kind(16), kind(2), kind(64), kind(3))
    assert layout == CacheLayout(8, 16, 2, 64, 3)
    assert all(type(getattr(layout, name)) is int
               for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim", "v_bits"))


@pytest.mark.parametrize("num_blocks", [-1, np.int64(-1), True, 1.0, "8", None])
def test_a_page_count_that_is_no_count_is_refused_by_name(num_blocks):
    with pytest.raises(InvalidValueError, match=re.escape(f"num_blocks = {num_blocks!r} is not an integer >= 0")):
        CacheLayout(num_blocks, 16, 2, 64)


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_numpy_integers_are_counts_of_the_planning_helpers(kind):
    want = planning.tokens_that_fit(2**30, num_layers=2, num_kv_heads=2, head_dim=64, fmt="fp8k_turbo3v")
    assert planning.tokens_that_fit(2**30, num_layers=kind(2), num_kv_heads=kind(2), head_dim=kind(64),
                                    fmt="fp8k_turbo3v", block_size=kind(16)) == want > 0
    assert planning.bytes_per_token(kind(2), kind(64), "bf16") == 2 * 2 * 64 * 2


@pytest.mark.parametrize("value", [True, False, np.True_])
def test_a_bool_is_no_scale(value):
    with pytest.raises(InvalidValueError, match="k_scale = .* is not a number"):
        float32("k_scale", value)


@pytest.mark.parametrize("value", [1e-46, -1e-46, 7e-46, np.float64(1e-300)])
def test_a_float_that_float32_rounds_to_zero_is_refused(value):
    with pytest.raises(InvalidValueError, match="soft_cap = .* underflows float32"):
        float32("soft_cap", value)


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_finite_float_is_taken_exactly_when_float32_keeps_it_non_zero_and_finite(value):
    keeps = abs(value) <= F32_MAX and (value == 0.0 or np.float32(value) != 0.0)
    if keeps:
        assert float32("x", value) == value
    else:
        with pytest.raises(InvalidValueError, match=r"^INVALID_VALUE: x = .* (overflows|underflows) float32"):
            float32("x", value)


def test_nan_and_infinities_pass_to_the_library_which_judges_them():
    assert math.isnan(float32("x", math.nan)) and float32("x", math.inf) == math.inf
