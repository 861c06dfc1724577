"""The MSE V encoder and the rotation of the NumPy reference, and the ``quality`` command.

Runs without a GPU. The default encoder's bytes against the original engine's golden pools are checked
by tests/test_reference.py (``test_golden_write_is_byte_identical``); here the same pools are written
with ``encoder`` passed explicitly as the default, and the MSE encoder must be opt-in.
"""
from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from fp8kturbov.tools import cli, quality
from fp8kturbov import reference as R

BF16 = ml_dtypes.bfloat16
GOLDEN_FILES = sorted((pathlib.Path(__file__).parent / "data" / "golden").glob("*.npz"))
NMSE_TARGETS = {2: 0.100, 3: 0.0215, 4: 0.0053}


def group_errors_f32(x: np.ndarray, codes: np.ndarray, scale_bytes: np.ndarray, bits: int) -> np.ndarray:
    """Per-group ``Σ (x_i − level·s)²`` in the MSE encoder's float32 arithmetic (sequential over i)."""
    s = R.e4m3_decode(scale_bytes)
    err = np.zeros(x.shape[0], dtype=np.float32)
    for i in range(R.GROUP_ELEMS):
        d = x[:, i] - R.CODEBOOKS[bits][codes[:, i]] * s
        err = err + d * d
    return err


def encode_groups(x: np.ndarray, bits: int, encoder: str) -> tuple[np.ndarray, np.ndarray]:
    data, scales = R.encode_v(x.reshape(-1), bits, encoder=encoder)
    return R.unpack_codes(data, bits).reshape(-1, R.GROUP_ELEMS), scales


def model_mse_group(x: list[np.float32], bits: int) -> tuple[list[int], int]:
    """Scalar model of the documented MSE rule, one Python float32 operation at a time."""
    levels, bounds = R.CODEBOOKS[bits], R.BOUNDS[bits]
    best, best_byte, best_codes = np.float32(np.inf), 0, []
    for byte in range(0x7F):
        s = R.e4m3_decode(np.uint8(byte))[()]
        codes = [int(np.sum((xi if byte == 0 else np.float32(xi / s)) >= bounds)) for xi in x]
        err = np.float32(0.0)
        for xi, c in zip(x, codes):
            d = np.float32(xi - np.float32(levels[c] * s))
            err = np.float32(err + np.float32(d * d))
        if err < best:
            best, best_byte, best_codes = err, byte, codes
    return best_codes, best_byte


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_encoder_matches_scalar_model(bits: int) -> None:
    gen = np.random.default_rng(1234 + bits)
    x = (gen.standard_normal((12, 16)) * np.exp(gen.uniform(-6, 4, (12, 1)))).astype(np.float32)
    x[0] = x[0].astype(BF16).astype(np.float32)  # a bf16-exact group too
    codes, scales = encode_groups(x, bits, "mse")
    for g in range(x.shape[0]):
        want_codes, want_byte = model_mse_group(list(x[g]), bits)
        assert (list(codes[g]), int(scales[g])) == (want_codes, want_byte), f"group {g}"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_error_is_minimal_over_every_candidate_byte(bits: int) -> None:
    """The guarantee, exactly: for every byte c in 0x00..0x7E, the chosen error ≤ error(c, nearest codes)."""
    gen = np.random.default_rng(77 + bits)
    x = gen.standard_normal((2000, 16)).astype(np.float32) * np.float32(3.0)
    codes, scales = encode_groups(x, bits, "mse")
    chosen = group_errors_f32(x, codes, scales, bits)
    for byte in R.MSE_CANDIDATE_BYTES:
        s = R.e4m3_decode(byte)
        y = x if byte == 0 else x / s
        c = np.searchsorted(R.BOUNDS[bits], y, side="right")
        other = group_errors_f32(x, c, np.full(x.shape[0], byte, dtype=np.uint8), bits)
        assert np.all(chosen <= other)
        tie = (chosen == other) & (scales > byte)
        assert not np.any(tie), "ties must go to the smaller byte"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_never_worse_than_matched_norm(bits: int) -> None:
    """Where matched-norm's codes are the nearest-level codes of its own scale, its (byte, codes) pair is a
    candidate, so the MSE error is ≤ in exact float32 terms. Elsewhere matched-norm's codes (chosen for
    scale amax/MAX, not for its final scale) are no better than the nearest ones up to the written bounds'
    offset from the exact midpoints, so the MSE error is ≤ matched-norm's plus that slack (float64 check)."""
    gen = np.random.default_rng(99 + bits)
    x = np.concatenate([gen.standard_normal((3000, 16)), gen.standard_t(3, (3000, 16))]).astype(np.float32)
    mse_codes, mse_scales = encode_groups(x, bits, "mse")
    mn_codes, mn_scales = encode_groups(x, bits, "matched_norm")

    s_mn = R.e4m3_decode(mn_scales)
    nearest = np.searchsorted(R.BOUNDS[bits], x / s_mn[:, None], side="right")
    candidate = np.all(nearest == mn_codes, axis=1)
    assert candidate.mean() > 0.2  # the exact case is common enough to be tested
    e_mse = group_errors_f32(x, mse_codes, mse_scales, bits)
    e_mn = group_errors_f32(x, mn_codes, mn_scales, bits)
    assert np.all(e_mse[candidate] <= e_mn[candidate])

    levels = R.CODEBOOKS[bits].astype(np.float64)
    mids = (levels[1:] + levels[:-1]) / 2
    gaps = levels[1:] - levels[:-1]
    slack_per_elem = np.max(2 * gaps * np.abs(R.BOUNDS[bits].astype(np.float64) - mids))
    x64 = x.astype(np.float64)
    err64 = lambda c, s: np.sum((x64 - levels[c] * R.e4m3_decode(s).astype(np.float64)[:, None]) ** 2, axis=1)
    slack = 16 * slack_per_elem * s_mn.astype(np.float64) ** 2 + 1e-5 * err64(mn_codes, mn_scales)
    assert np.all(err64(mse_codes, mse_scales) <= err64(mn_codes, mn_scales) + slack)
    assert np.sum(err64(mse_codes, mse_scales)) < np.sum(err64(mn_codes, mn_scales))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_meets_nmse_targets_on_gaussian_data(bits: int) -> None:
    x = np.random.default_rng(2024).standard_normal(16 * 16384).astype(np.float32)
    nmse = {}
    for encoder in R.V_ENCODERS:
        data, scales = R.encode_v(x, bits, encoder=encoder)
        x_hat = R.decode_v(data, scales, bits).astype(np.float64)
        nmse[encoder] = np.sum((x_hat - x) ** 2) / np.sum(x.astype(np.float64) ** 2)
    assert nmse["mse"] <= NMSE_TARGETS[bits], nmse
    assert nmse["mse"] < nmse["matched_norm"]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_keeps_the_byte_format(bits: int) -> None:
    gen = np.random.default_rng(5 + bits)
    x = (gen.standard_normal((4, 3, 128)) * np.exp(gen.uniform(-12, 8, (4, 3, 1)))).astype(BF16)
    data, scales = R.encode_v(x, bits, encoder="mse")
    assert data.shape == (4, 3, 128 * bits // 8) and data.dtype == np.uint8
    assert scales.shape == (4, 3, 8) and scales.dtype == np.uint8
    assert np.all(scales <= 0x7E)
    out = R.decode_v(data, scales, bits)
    assert out.shape == x.shape and np.all(np.isfinite(out))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_special_groups(bits: int) -> None:
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    x[0] = 0.0
    x[1, 0] = -0.0
    x[1, 1:] = 0.0
    x[2, 3] = np.nan
    x[3, 7] = np.inf
    x[4] *= np.float32(1e-7)  # below every positive scale's reach: zero is the best reconstruction
    codes, scales = encode_groups(x, bits, "mse")
    mn_codes, mn_scales = encode_groups(x, bits, "matched_norm")
    assert list(scales[:2]) == [0x00, 0x00]
    np.testing.assert_array_equal(codes[:2], mn_codes[:2])  # all-zero groups: matched-norm's bytes
    assert scales[2] == 0x7F and scales[2] == mn_scales[2]  # NaN group falls back: reads as NaN
    np.testing.assert_array_equal(codes[2:4], mn_codes[2:4])
    assert scales[3] == mn_scales[3] == 0x7E  # inf saturates as in matched-norm
    assert scales[4] == 0x00
    out = R.decode_v(*R.encode_v(x.reshape(-1), bits, encoder="mse"), bits).reshape(5, 16)
    assert np.all(out[0] == 0) and np.all(out[1] == 0) and np.all(np.isnan(out[2]))


def test_encoder_argument_is_checked_and_defaults_to_matched_norm() -> None:
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    default = R.encode_v(x, 3)
    explicit = R.encode_v(x, 3, encoder="matched_norm")
    assert all(np.array_equal(a, b) for a, b in zip(default, explicit))
    assert R.V_ENCODERS[0] == "matched_norm"
    with pytest.raises(ValueError, match="encoder"):
        R.encode_v(x, 3, encoder="nearest")


def test_the_kernels_offer_every_encoder_of_the_reference() -> None:
    """The C ABI's encoders (fp8kturbov.VEncoder, mirrored from the header) are the reference's, in
    order: a write or fused append names its encoder as the reference does."""
    assert tuple(encoder.name.lower() for encoder in fp8kturbov.VEncoder) == R.V_ENCODERS


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.stem for p in GOLDEN_FILES])
def test_default_encoder_still_writes_golden_pools(path: pathlib.Path) -> None:
    g = np.load(path)
    value = g["value_bf16_bits"].view(BF16)
    num_tokens, n = value.shape
    bits = int(g["bits"])
    k_pool, v_pool = g["k_pool_before"].copy(), g["v_pool_before"].copy()
    R.write_cache(g["key_bf16_bits"].view(BF16), value, k_pool, v_pool, g["slot_mapping"], num_tokens,
                  int(g["num_kv_heads"]), int(g["head_dim"]), int(g["block_size"]), n, n, float(g["k_scale"]),
                  int(g["k_block_stride_bytes"]), int(g["v_block_stride_bytes"]),
                  int(g["v_data_section_bytes"]), bits)
    assert np.array_equal(v_pool, g["v_pool_after"]) and np.array_equal(k_pool, g["k_pool_after"])


# ---------------------------------------------------------------------------------------------------
# Rotation (FORMAT.md §6)
# ---------------------------------------------------------------------------------------------------
def test_s1_128_begins_as_the_format_says() -> None:
    s1, _ = R.rotation_signs(128)
    assert list(s1[:8]) == [-1, 1, 1, -1, -1, 1, -1, 1]


def test_s1_512_is_s1_256_then_s2_256() -> None:
    s1_256, s2_256 = R.rotation_signs(256)
    s1_512, s2_512 = R.rotation_signs(512)
    np.testing.assert_array_equal(s1_512, np.concatenate([s1_256, s2_256]))
    assert len(s2_512) == 512 and set(np.unique(s2_512)) == {-1.0, 1.0}


def test_hadamard_is_sylvester() -> None:
    h2 = np.array([[1.0, 1.0], [1.0, -1.0]])
    np.testing.assert_array_equal(R.hadamard(8), np.kron(np.kron(h2, h2), h2))
    np.testing.assert_array_equal(R.hadamard(128) @ R.hadamard(128), 128 * np.eye(128))


@pytest.mark.parametrize("head_dim", R.ROTATION_DIMS)
def test_rotation_is_orthogonal_and_inverted(head_dim: int) -> None:
    x = np.random.default_rng(head_dim).standard_normal((5, 3, head_dim))
    y = R.rotate(x, head_dim)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(R.unrotate(y, head_dim), x, atol=1e-12)
    np.testing.assert_allclose(R.rotate(R.unrotate(x, head_dim), head_dim), x, atol=1e-12)
    s1, s2 = R.rotation_signs(head_dim)
    matrix = (s2[:, None] * R.hadamard(head_dim) * s1[None, :]) / np.sqrt(head_dim)
    np.testing.assert_allclose(y, x @ matrix.T, atol=1e-12)  # y = S2 · H/√n · S1 · x


@pytest.mark.parametrize("head_dim", R.ROTATION_DIMS)
def test_rotate_f32_is_the_rotation_within_float32_rounding(head_dim: int) -> None:
    x = np.random.default_rng(head_dim + 1).standard_normal((6, 2, head_dim)).astype(np.float32)
    y = R.rotate_f32(x, head_dim)
    assert y.dtype == np.float32
    # each butterfly stage rounds sums of ±x_i, so each error is at most 2^-24 · Σ|x_i|; then the scale
    bound = (np.log2(head_dim) + 2) * 2.0 ** -24 * np.abs(x).sum(-1, keepdims=True) / np.sqrt(head_dim)
    assert np.all(np.abs(y - R.rotate(x, head_dim)) <= bound)
    np.testing.assert_allclose(R.unrotate(y, head_dim), x, atol=1e-5)


def write_one_page(value: np.ndarray, bits: int, rotation: bool) -> tuple[np.ndarray, np.ndarray]:
    """``value [T, H, D]`` written by the reference into one page of T slots; returns the V pool and
    the V read back from it (``[T, H, D]``, rotated back where written rotated)."""
    tokens, heads, head_dim = value.shape
    n = heads * head_dim
    data_bytes = R.v_data_section_bytes(tokens, heads, head_dim, bits)
    v_pool = np.zeros(R.v_page_bytes(tokens, heads, head_dim, bits), dtype=np.uint8)
    k_pool = np.zeros(tokens * n, dtype=np.uint8)
    R.write_cache(np.zeros((tokens, n), np.float32), value.reshape(tokens, n), k_pool, v_pool, np.arange(tokens),
                  tokens, heads, head_dim, tokens, n, n, 1.0, tokens * n, len(v_pool), data_bytes, bits,
                  rotation=rotation)
    read = R.decode_v(v_pool[:data_bytes], v_pool[data_bytes:], bits).astype(np.float64).reshape(value.shape)
    return v_pool, (R.unrotate(read, head_dim) if rotation else read)


def test_rotated_write_encodes_the_float32_rotation() -> None:
    gen = np.random.default_rng(7)
    value = gen.standard_normal((16, 2, 128)).astype(np.float32)
    value[:, :, [3, 40, 77, 100]] *= 20  # channel outliers, which the rotation spreads out
    pool, read = write_one_page(value, 3, rotation=True)
    data, scales = R.encode_v(R.rotate_f32(value, 128).reshape(-1), 3)
    np.testing.assert_array_equal(pool, np.concatenate([data, scales]))
    _, plain = write_one_page(value, 3, rotation=False)
    nmse = {name: np.sum((v - value) ** 2) / np.sum(value.astype(np.float64) ** 2)
            for name, v in (("rotated", read), ("plain", plain))}
    assert nmse["rotated"] < 0.03 < 0.06 < nmse["plain"]  # QUALITY.md: ~0.02 against ~0.09 at 3 bits


def test_rotation_rejects_other_head_dims() -> None:
    with pytest.raises(ValueError):
        R.rotate(np.zeros(64), 64)
    with pytest.raises(ValueError):
        R.unrotate(np.zeros(128), 256)


# ---------------------------------------------------------------------------------------------------
# Quality module and command
# ---------------------------------------------------------------------------------------------------
def test_nvfp4_round_trip_values() -> None:
    x = np.array([0.0, 0.25, 0.75, 1.25, -1.75, 2.5, 3.5, 5.0, 6.0, -6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0],
                 dtype=np.float32)
    out = quality.nvfp4_round_trip(x)  # amax 6 → scale 1 exactly; ties to the even code
    np.testing.assert_array_equal(out, [0, 0, 1, 1, -2, 2, 4, 4, 6, -6, 0.5, 1, 1.5, 2, 3, 4])


def test_quality_command_prints_every_row(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "q.json"
    status = cli.main(["quality", "--seed", "3", "--tokens", "64", "--queries", "4", "--json", str(path)])
    assert status == 0
    text = capsys.readouterr().out
    assert "no real-model rows" in text  # said where --model is not given
    rows = json.loads(path.read_text())["rows"]
    # per distribution: 3 peers + 3 widths x the encoders x 2 rotations
    assert len(rows) == 3 * (3 + 3 * len(R.V_ENCODERS) * 2)
    table_rows = [line for line in text.splitlines() if line.split()[:1] and line.split()[0] in quality.DISTRIBUTIONS]
    assert len(table_rows) == len(rows)
    for r in rows:
        assert 0 <= r["v_nmse"] < 1 and 0 < r["attn_rel_err"] < 1
    again = quality.run_quality(quality.Config(seed=3, tokens=64, queries=4))
    assert again == rows  # deterministic in the seed


def test_quality_command_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["quality", "--head-dim", "100"]) == 2
    assert "head_dim" in capsys.readouterr().err
