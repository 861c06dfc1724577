"""The decode tests' error measure (conftest.relative_error_per_head): relative per (row, head),
with a floor only where bf16 holds no relative precision, so that it still fails real errors."""

from __future__ import annotations

import numpy as np

from conftest import relative_error_per_head


def test_relative_error_is_relative_at_ordinary_and_small_magnitudes():
    rng = np.random.default_rng(0)
    for scale in (1e2, 1.0, 1e-30):  # 1e-30: far below ordinary outputs, far above the floor
        want = rng.standard_normal((3, 4, 128)) * scale
        assert np.allclose(relative_error_per_head(want * 1.02, want), 0.02)
        assert np.all(relative_error_per_head(want, want) == 0)


def test_rows_below_the_smallest_normal_may_flush_to_zero():
    want = np.full((1, 2, 128), 2e-40)  # bf16 subnormals: what a sink e^90 above the scores gives
    assert relative_error_per_head(np.zeros_like(want), want).max() < 1e-2
    # A row of smallest normals flushed is still under 1e-2; one of ordinary size is not.
    assert relative_error_per_head(np.zeros_like(want), np.full_like(want, 2.0**-126)).max() <= 1e-2
    assert relative_error_per_head(np.zeros_like(want), np.full_like(want, 1e-3)).max() == 1.0


def test_a_zero_reference_row_takes_the_absolute_error():
    want = np.zeros((1, 1, 128))
    got = np.full_like(want, 1e-3)
    assert np.isclose(relative_error_per_head(got, want)[0, 0], np.sqrt(128) * 1e-3)
