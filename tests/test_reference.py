"""CPU tests of the NumPy reference ``fp8kturbov.reference`` against the format specification (docs/format.md).

Expected values come from FORMAT.md's written examples, from independent models written here (a bit-level
E4M3 rounder, a whole-group bit-stream packer, a scalar §3.2 encoder, addresses spelled out from §2-§4, a
dense float64 attention) or from the original engine's golden vectors in tests/data/golden.
Random inputs use a fresh seed per run, printed and quoted in assertion messages; set FP8KTURBOV_SEED
to replay one.
"""
from __future__ import annotations

import os
import pathlib
import secrets
from dataclasses import dataclass
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fp8kturbov import reference as R

GOLDEN_FILES = sorted((pathlib.Path(__file__).parent / "data" / "golden").glob("*.npz"))
BITS = [4, 3, 2]
BF16 = ml_dtypes.bfloat16


@pytest.fixture
def rng() -> tuple[np.random.Generator, int]:
    seed = int(os.environ.get("FP8KTURBOV_SEED", secrets.randbits(63)))
    print(f"FP8KTURBOV_SEED={seed}")
    return np.random.default_rng(seed), seed


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


# ---------------------------------------------------------------------------------------------------
# §3.1 constants
# ---------------------------------------------------------------------------------------------------
# The tables exactly as written in FORMAT.md §3.1.
FORMAT_LEVELS = {
    4: "-2.7326 -2.0690 -1.6180 -1.2562 -0.9423 -0.6568 -0.3880 -0.1284 "
       "0.1284 0.3880 0.6568 0.9423 1.2562 1.6180 2.0690 2.7326",
    3: "-2.1520 -1.3440 -0.7560 -0.2451 0.2451 0.7560 1.3440 2.1520",
    2: "-1.5104 -0.4528 0.4528 1.5104",
}
FORMAT_BOUNDS = {
    4: "-2.4008 -1.8435 -1.4371 -1.0993 -0.7996 -0.5224 -0.2582 0.0 "
       "0.2582 0.5224 0.7996 1.0993 1.4371 1.8435 2.4008",
    3: "-1.748 -1.050 -0.501 0.0 0.501 1.050 1.748",
    2: "-0.9816 0.0 0.9816",
}


def _is_nearest_float32(value: np.float32, decimal: str) -> bool:
    """True when ``value`` is the float32 nearest to the decimal (what a C ``1.2345f`` literal gives)."""
    exact = Fraction(decimal)
    err = abs(Fraction(float(value)) - exact)
    neighbours = (np.nextafter(value, np.float32(np.inf)), np.nextafter(value, np.float32(-np.inf)))
    return all(err <= abs(Fraction(float(nb)) - exact) for nb in neighbours)


@pytest.mark.parametrize("bits", BITS)
def test_codebook_constants_match_format_tables(bits: int) -> None:
    for table, written in ((R.CODEBOOKS[bits], FORMAT_LEVELS[bits]), (R.BOUNDS[bits], FORMAT_BOUNDS[bits])):
        decimals = written.split()
        assert table.dtype == np.float32 and len(table) == len(decimals)
        for value, decimal in zip(table, decimals):
            assert _is_nearest_float32(value, decimal), f"{bits}-bit: {value!r} is not float32({decimal})"
    assert len(R.CODEBOOKS[bits]) == 2 ** bits and len(R.BOUNDS[bits]) == 2 ** bits - 1
    assert np.all(np.diff(R.BOUNDS[bits]) > 0) and not np.any(R.CODEBOOKS[bits] == 0)
    assert R.LEVEL_MAX[bits] == R.CODEBOOKS[bits][-1] and isinstance(R.LEVEL_MAX[bits], np.float32)
    assert R.GROUP_ELEMS == 16 and R.E4M3_MAX == 448.0


# ---------------------------------------------------------------------------------------------------
# §2, §3 size rules
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits, sixteenths, d128_bytes", [(4, 9, 72), (3, 7, 56), (2, 5, 40)])
def test_size_rules(bits: int, sixteenths: int, d128_bytes: int) -> None:
    for block_size, num_kv_heads, head_dim in [(16, 8, 128), (32, 1, 64), (1, 4, 256), (8, 2, 512)]:
        n = num_kv_heads * head_dim
        assert R.k_page_bytes(block_size, num_kv_heads, head_dim) == block_size * n
        assert R.v_page_bytes(block_size, num_kv_heads, head_dim, bits) == sixteenths * block_size * n // 16
        assert R.v_data_section_bytes(block_size, num_kv_heads, head_dim, bits) == block_size * n * bits // 8
        assert R.v_scale_section_bytes(block_size, num_kv_heads, head_dim) == block_size * n // 16
    # Per token per KV head at D = 128: K 128 B, V 72 / 56 / 40 B.
    assert R.k_page_bytes(1, 1, 128) == 128
    assert R.v_page_bytes(1, 1, 128, bits) == d128_bytes
    assert R.v_group_bytes(bits) == 2 * bits


def test_size_rules_reject_bad_shapes() -> None:
    with pytest.raises(ValueError):
        R.k_page_bytes(16, 8, 72)
    with pytest.raises(ValueError):
        R.v_page_bytes(16, 8, 128, 5)
    with pytest.raises(ValueError):
        R.v_group_bytes(8)


# ---------------------------------------------------------------------------------------------------
# §2 E4M3
# ---------------------------------------------------------------------------------------------------
def e4m3_byte(sign: int, exponent_field: int, mantissa: int) -> int:
    return (sign << 7) | (exponent_field << 3) | mantissa


def model_e4m3_encode(x: np.float32) -> int:
    """Independent E4M3_rn_satfinite on the float32 bit pattern, with integer arithmetic only.

    |x| = sig · 2^e2 exactly. The E4M3 quantum at |x| is 2^qe with qe = max(floor(log2|x|), -6) - 3;
    r = sig · 2^(e2 - qe) rounded half to even is the value in quanta, and the byte is
    ((qe + 9) << 3) + r (this also covers subnormals, qe = -9, and a carry into the next binade).
    Anything above 0x7E (448) saturates; NaN gives 0x7F.
    """
    bits = int(np.array(x, dtype=np.float32).view(np.uint32))
    sign, exp_field, frac = bits >> 31, (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exp_field == 0xFF:
        return 0x7F if frac else e4m3_byte(sign, 15, 6)
    sig, e2 = (frac, -149) if exp_field == 0 else (frac | (1 << 23), exp_field - 150)
    log2 = sig.bit_length() - 1 + e2
    qe = max(log2, -6) - 3
    shift = qe - e2
    if shift <= 0:
        r = sig << -shift
    else:
        r, rem, half = sig >> shift, sig & ((1 << shift) - 1), 1 << (shift - 1)
        if rem > half or (rem == half and r & 1):
            r += 1
    magnitude = ((qe + 9) << 3) + r if r else 0
    return (sign << 7) | min(magnitude, 0x7E)


def model_e4m3_decode(byte: int) -> float:
    sign, exp_field, mantissa = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if exp_field == 15 and mantissa == 7:
        return float("nan")
    magnitude = mantissa * 2.0 ** -9 if exp_field == 0 else (1 + mantissa / 8) * 2.0 ** (exp_field - 7)
    return -magnitude if sign else magnitude


def test_e4m3_decode_all_bytes() -> None:
    got = R.e4m3_decode(np.arange(256, dtype=np.uint8))
    assert got.dtype == np.float32
    for byte in range(256):
        expected = model_e4m3_decode(byte)
        if np.isnan(expected):
            assert np.isnan(got[byte]), hex(byte)
        else:
            assert got[byte] == expected and np.signbit(got[byte]) == bool(byte >> 7), hex(byte)


def test_e4m3_saturation() -> None:
    values = f32([449, 464, 480, 1e30, 3.4e38, np.inf, 440, 448, -449, -1e30, -np.inf])
    max_pos, max_neg = e4m3_byte(0, 15, 6), e4m3_byte(1, 15, 6)  # ±448 = 1.75 · 2^8
    expected = [max_pos] * 8 + [max_neg] * 3  # 440 is above the 416/448 midpoint 432
    assert R.e4m3_encode(values).tolist() == expected
    assert (max_pos, max_neg) == (0x7E, 0xFE)


# (value, expected byte): value exactly halfway between two neighbours; the even mantissa wins.
TIES = [
    (1.0625, e4m3_byte(0, 7, 0)),      # 1.0 (m=0) | 1.125 (m=1)
    (1.1875, e4m3_byte(0, 7, 2)),      # 1.125 (m=1) | 1.25 (m=2)
    (1.9375, e4m3_byte(0, 8, 0)),      # 1.875 (m=7) | 2.0 (next binade, m=0)
    (432.0, e4m3_byte(0, 15, 6)),      # 416 (m=5) | 448 (m=6)
    (-1.0625, e4m3_byte(1, 7, 0)),
    (3 * 2.0 ** -10, e4m3_byte(0, 0, 2)),   # subnormals 1·2^-9 (m=1) | 2·2^-9 (m=2)
    (15 * 2.0 ** -10, e4m3_byte(0, 1, 0)),  # largest subnormal 7·2^-9 | smallest normal 2^-6 (m=0)
    (2.0 ** -10, e4m3_byte(0, 0, 0)),       # 0 | smallest subnormal 2^-9: ties to 0
]


@pytest.mark.parametrize("value, expected", TIES)
def test_e4m3_ties_to_even(value: float, expected: int) -> None:
    tie = np.float32(value)
    assert R.e4m3_encode(tie).item() == expected
    # Just off the tie, rounding goes to the nearer neighbour (the byte one away from zero or the other).
    away = np.nextafter(tie, np.float32(np.copysign(np.inf, value)))
    toward = np.nextafter(tie, np.float32(0))
    got_away, got_toward = int(R.e4m3_encode(away)), int(R.e4m3_encode(toward))
    assert abs(R.e4m3_decode(np.uint8(got_away))) > abs(value) > abs(R.e4m3_decode(np.uint8(got_toward)))
    assert got_away - got_toward == 1


def test_e4m3_subnormals_and_zeros() -> None:
    tiny = 2.0 ** -9  # smallest E4M3 subnormal
    values = f32([tiny, tiny / 2, np.nextafter(np.float32(tiny / 2), np.float32(1)), tiny / 2.001, 1e-45,
                  0.0, -0.0, -tiny, -tiny / 4, 7 * tiny, 2.0 ** -6])
    expected = [0x01, 0x00, 0x01, 0x00, 0x00, 0x00, 0x80, 0x81, 0x80, e4m3_byte(0, 0, 7), e4m3_byte(0, 1, 0)]
    assert R.e4m3_encode(values).tolist() == expected


def test_e4m3_nan_either_sign() -> None:
    nan_patterns = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=np.uint32)
    assert R.e4m3_encode(nan_patterns.view(np.float32)).tolist() == [0x7F] * 4


def test_e4m3_encode_matches_bit_level_model(rng) -> None:
    gen, seed = rng
    finite = R.e4m3_decode(np.array([b for b in range(128) if b != 0x7F], dtype=np.uint8))  # 0 ... 448
    mids = (finite[:-1] + finite[1:]) / np.float32(2)  # exact in float32 (5 significant bits)
    nudged = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))])
    edges = f32([448, 464, 480, np.nextafter(np.float32(464), np.float32(0)), 1e-45, 3.4e38])
    random_bits = gen.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    random_range = (gen.standard_normal(5000) * 2.0 ** gen.uniform(-14, 10, 5000)).astype(np.float32)
    sweep = np.concatenate([finite, mids, nudged, edges, random_bits, random_range])
    sweep = np.concatenate([sweep, -sweep])
    got = R.e4m3_encode(sweep)
    expected = np.array([model_e4m3_encode(v) for v in sweep], dtype=np.uint8)
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, f"seed {seed}: {bad.size} mismatches, e.g. {sweep[bad[:5]]!r}"


# ---------------------------------------------------------------------------------------------------
# §2 K
# ---------------------------------------------------------------------------------------------------
def test_encode_k_multiplies_by_float32_reciprocal(rng) -> None:
    gen, seed = rng
    k_scale = np.float32(gen.choice([0.05, 0.3, 3.0, 7.0, 0.011]))
    x = (gen.standard_normal(4096) * float(k_scale) * 40).astype(np.float32)
    inv = np.float32(1) / k_scale
    expected = np.array([model_e4m3_encode(v) for v in x * inv], dtype=np.uint8)
    np.testing.assert_array_equal(R.encode_k(x, float(k_scale)), expected, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(R.encode_k(x.astype(BF16), float(k_scale)),
                                  R.encode_k(x.astype(BF16).astype(np.float32), float(k_scale)))
    # A multiply by the float32 reciprocal, not a division: with k_scale = 7, x = 7·(E4M3 midpoint) is exact,
    # x / 7 is exactly the tie but x · float32(1/7) is not, and several of these round differently.
    seven = np.float32(7)
    finite = R.e4m3_decode(np.arange(1, 0x7F, dtype=np.uint8))
    x_ties = seven * ((finite[:-1] + finite[1:]) / np.float32(2))
    by_multiply = [model_e4m3_encode(v * (np.float32(1) / seven)) for v in x_ties]
    assert by_multiply != [model_e4m3_encode(v / seven) for v in x_ties]
    assert R.encode_k(x_ties, 7.0).tolist() == by_multiply


def test_decode_k(rng) -> None:
    gen, seed = rng
    k_scale = np.float32(gen.uniform(0.01, 2.0))
    b = np.arange(256, dtype=np.uint8)
    expected = np.array([model_e4m3_decode(int(v)) for v in b], dtype=np.float32) * k_scale
    np.testing.assert_array_equal(R.decode_k(b, float(k_scale)), expected, err_msg=f"seed {seed}")
    x = (gen.uniform(0.1, 400, 1000) * gen.choice([-1, 1], 1000) * k_scale).astype(np.float32)
    back = R.decode_k(R.encode_k(x, float(k_scale)), float(k_scale))
    assert np.all(np.abs(back - x) <= 2.0 ** -4 * np.abs(x) * (1 + 1e-5)), f"seed {seed}"


# ---------------------------------------------------------------------------------------------------
# §3.3 packing
# ---------------------------------------------------------------------------------------------------
def model_pack_group(codes: list[int], bits: int) -> bytes:
    """All three §3.3 layouts are the same rule: the group is a 16·b-bit little-endian integer holding
    code i at bits b·i (4-bit: c[2j] at bits 8j.., 2-bit likewise; 3-bit: triplet 1 starts at bit 24 = 3·8)."""
    word = sum(int(c) << (bits * i) for i, c in enumerate(codes))
    return word.to_bytes(2 * bits, "little")


@pytest.mark.parametrize("bits", BITS)
def test_pack_codes_matches_bit_stream_model(rng, bits: int) -> None:
    gen, seed = rng
    codes = gen.integers(0, 2 ** bits, (3, 5, 64), dtype=np.uint8)
    packed = R.pack_codes(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == np.uint8
    groups = codes.reshape(-1, 16)
    expected = b"".join(model_pack_group(list(g), bits) for g in groups)
    assert packed.tobytes() == expected, f"seed {seed}"


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_round_trip(rng, bits: int) -> None:
    gen, seed = rng
    codes = gen.integers(0, 2 ** bits, (7, 128), dtype=np.uint8)
    np.testing.assert_array_equal(R.unpack_codes(R.pack_codes(codes, bits), bits), codes, err_msg=f"seed {seed}")
    data = gen.integers(0, 256, (4, 6 * 2 * bits), dtype=np.uint8)  # every byte pattern is a valid packing
    np.testing.assert_array_equal(R.pack_codes(R.unpack_codes(data, bits), bits), data, err_msg=f"seed {seed}")
    with pytest.raises(ValueError):
        R.pack_codes(np.full(16, 2 ** bits), bits)
    with pytest.raises(ValueError):
        R.unpack_codes(np.zeros(2 * bits + 1, np.uint8), bits)


# ---------------------------------------------------------------------------------------------------
# §3.2 encoder, §3.4 read, §3.5 worked example
# ---------------------------------------------------------------------------------------------------
WORKED_INPUT = [0.5, -0.25, 0.125, 1.0, -1.5, 0.0, 0.75, -0.0625, 0.3125, -0.875, 2.0, -0.4375, 0.0, 0.1875,
                -1.0, 0.625]
WORKED = {  # FORMAT.md §3.5: codes, scale byte, packed data bytes
    4: ("10 6 8 12 1 8 11 7 9 3 15 5 8 8 3 11", 0x34, "6a c8 81 7b 39 5f 88 b3"),
    3: ("5 3 4 6 1 4 5 3 4 2 7 3 4 4 1 5", 0x37, "1d 1d 76 d4 47 a6"),
    2: ("2 1 2 2 0 2 2 1 2 1 3 1 2 2 1 2", 0x3A, "a6 68 76 9a"),
}


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_worked_example(bits: int, dtype) -> None:
    codes_text, scale_byte, data_hex = WORKED[bits]
    codes = np.array(codes_text.split(), dtype=np.uint8)
    data_bytes = bytes.fromhex(data_hex)
    data, scales = R.encode_v(np.array(WORKED_INPUT, dtype=dtype), bits)
    assert R.unpack_codes(data, bits).tolist() == codes.tolist()
    assert scales.tolist() == [scale_byte]
    assert data.tobytes() == data_bytes
    assert R.pack_codes(codes, bits).tobytes() == data_bytes
    np.testing.assert_array_equal(R.decode_v(data, scales, bits),
                                  R.CODEBOOKS[bits][codes] * np.float32(model_e4m3_decode(scale_byte)))


def model_encode_group(x: list[np.float32], bits: int) -> tuple[list[int], int]:
    """§3.2 for one group, scalar float32 arithmetic, written independently of the vectorised reference."""
    zero = np.float32(0)
    n2, amax = zero, zero
    for xi in x:
        n2 = np.float32(n2 + np.float32(xi * xi))
        amax = amax if np.isnan(xi) else max(amax, np.float32(abs(xi)))
    level_max = np.float32(R.CODEBOOKS[bits][-1])
    inv = np.float32(level_max / amax) if amax > np.float32(1e-12) else np.float32(1)
    codes = [sum(1 for bound in R.BOUNDS[bits] if np.float32(xi * inv) >= bound) for xi in x]
    r2 = zero
    for c in codes:
        level = R.CODEBOOKS[bits][c]
        r2 = np.float32(r2 + np.float32(level * level))
    sqrt_r2 = np.float32(np.sqrt(r2))
    s = np.float32(np.float32(np.sqrt(n2)) / sqrt_r2) if sqrt_r2 > np.float32(1e-10) else zero
    if s > np.float32(448):
        s = np.float32(448)
    return codes, model_e4m3_encode(s)


@pytest.mark.parametrize("bits", BITS)
def test_encode_v_matches_scalar_model(rng, bits: int) -> None:
    gen, seed = rng
    num_groups = 96
    magnitudes = 10.0 ** gen.uniform(-6, 6, (num_groups, 1))
    x = (gen.standard_normal((num_groups, 16)) * magnitudes).astype(BF16).astype(np.float32)
    x[gen.random((num_groups, 16)) < 0.05] = 0.0
    x[::17] = 0.0
    x[5::23, 3] = np.nan
    x[7::29] *= np.float32(1e-14)  # amax below 1e-12: inv = 1
    with np.errstate(invalid="ignore", over="ignore"):
        data, scales = R.encode_v(x.reshape(4, 24, 16).reshape(4, 384), bits)
        codes = R.unpack_codes(data, bits).reshape(num_groups, 16)
        for g in range(num_groups):
            expected_codes, expected_scale = model_encode_group(list(x[g]), bits)
            assert codes[g].tolist() == expected_codes, f"seed {seed}, group {g}: {x[g]!r}"
            assert int(scales.reshape(-1)[g]) == expected_scale, f"seed {seed}, group {g}: {x[g]!r}"


@pytest.mark.parametrize("bits", BITS)
def test_encode_v_near_scale_rounding_midpoints_matches_scalar_model(rng, bits: int) -> None:
    """Groups scaled so that s sits within a few float32 ulps of an E4M3 rounding midpoint: there the scale
    byte depends on every float32 rounding of §3.2 (sequential sums, no fused multiply-add)."""
    gen, seed = rng
    num_groups = 300
    x = gen.standard_normal((num_groups, 16))
    amax = np.abs(x).max(axis=-1, keepdims=True)
    codes = (x[..., None] * (float(R.LEVEL_MAX[bits]) / amax)[..., None] >= R.BOUNDS[bits]).sum(axis=-1)
    s = np.linalg.norm(x, axis=-1) / np.linalg.norm(R.CODEBOOKS[bits][codes].astype(np.float64), axis=-1)
    finite = R.e4m3_decode(np.arange(0x08, 0x7F, dtype=np.uint8)).astype(np.float64)  # normal range
    midpoints = gen.choice((finite[:-1] + finite[1:]) / 2, num_groups)
    x = (x * (midpoints / s)[:, None]).astype(np.float32)
    data, scales = R.encode_v(x.reshape(-1), bits)
    codes_got = R.unpack_codes(data, bits).reshape(num_groups, 16)
    for g in range(num_groups):
        expected_codes, expected_scale = model_encode_group(list(x[g]), bits)
        assert codes_got[g].tolist() == expected_codes, f"seed {seed}, group {g}: {x[g]!r}"
        assert int(scales[g]) == expected_scale, f"seed {seed}, group {g}: {x[g]!r}"


@pytest.mark.parametrize("bits", BITS)
def test_value_on_a_bound_takes_the_upper_level(bits: int) -> None:
    # With amax = MAX, inv = MAX / MAX = 1 exactly, so x_i·inv = x_i lands exactly on each bound.
    bounds = R.BOUNDS[bits]
    for start in range(0, len(bounds), 15):
        x = np.full(16, 0.1, dtype=np.float32)
        x[0] = R.LEVEL_MAX[bits]
        chunk = bounds[start:start + 15]
        x[1:1 + len(chunk)] = chunk
        codes = R.unpack_codes(R.encode_v(x, bits)[0], bits)
        assert codes[1:1 + len(chunk)].tolist() == list(range(start + 1, start + 1 + len(chunk)))


@pytest.mark.parametrize("bits", BITS)
def test_zero_group_reads_back_as_exact_zeros(rng, bits: int) -> None:
    gen, seed = rng
    x = gen.standard_normal((3, 64)).astype(np.float32)
    x[1, 16:32] = 0.0
    x[2, 48:64] = -0.0
    data, scales = R.encode_v(x, bits)
    assert scales[1, 1] == 0x00 and scales[2, 3] == 0x00, f"seed {seed}"
    smallest_positive = 2 ** (bits - 1)  # ±0 reaches the 0.0 bound
    assert np.all(R.unpack_codes(data, bits)[1, 16:32] == smallest_positive)
    decoded = R.decode_v(data, scales, bits)
    assert np.all(decoded[1, 16:32] == 0) and np.all(decoded[2, 48:64] == 0)
    assert np.all(decoded[0] != 0), f"seed {seed}"


@pytest.mark.parametrize("bits", BITS)
def test_nan_group_reads_back_as_nan_in_that_group_only(rng, bits: int) -> None:
    gen, seed = rng
    x = gen.standard_normal(128).astype(np.float32)
    clean_data, clean_scales = R.encode_v(x, bits)
    bad_group, bad_elem = int(gen.integers(0, 8)), int(gen.integers(0, 16))
    x[16 * bad_group + bad_elem] = 0.0
    zeroed_codes = R.unpack_codes(R.encode_v(x, bits)[0], bits).reshape(8, 16)
    x[16 * bad_group + bad_elem] = np.float32(np.copysign(np.nan, gen.choice([-1.0, 1.0])))
    data, scales = R.encode_v(x, bits)
    others = np.arange(8) != bad_group
    assert scales[bad_group] == 0x7F, f"seed {seed}"
    # amax ignores NaN (fmax), so the other codes are those of the group with the NaN read as 0; NaN gets code 0.
    expected_codes = zeroed_codes[bad_group].copy()
    expected_codes[bad_elem] = 0
    np.testing.assert_array_equal(R.unpack_codes(data, bits).reshape(8, 16)[bad_group], expected_codes,
                                  err_msg=f"seed {seed}")
    np.testing.assert_array_equal(scales[others], clean_scales[others], err_msg=f"seed {seed}")
    decoded = R.decode_v(data, scales, bits).reshape(8, 16)
    assert np.all(np.isnan(decoded[bad_group])) and not np.any(np.isnan(decoded[others])), f"seed {seed}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_decoded_group_norm_matches_input_norm(rng, bits: int, dtype) -> None:
    gen, seed = rng
    sigma = 10.0 ** gen.uniform(-1, 2, (256, 1))
    x = (gen.standard_normal((256, 64)) * sigma).astype(dtype)
    data, scales = R.encode_v(x, bits)
    scale_values = R.e4m3_decode(scales)
    assert np.all((scale_values >= 2.0 ** -6) & (scale_values < 448)), f"seed {seed}: scale outside normal range"
    norm_in = np.linalg.norm(x.astype(np.float64).reshape(-1, 16), axis=-1)
    norm_out = np.linalg.norm(R.decode_v(data, scales, bits).astype(np.float64).reshape(-1, 16), axis=-1)
    rel = np.abs(norm_out - norm_in) / norm_in
    assert rel.max() <= 2.0 ** -4 * (1 + 1e-5), f"seed {seed}: max relative norm error {rel.max()}"


@pytest.mark.parametrize("bits", BITS)
def test_scale_saturates_at_448(bits: int) -> None:
    x = np.full(16, 1e6, dtype=np.float32)
    x[::2] = -3e5
    assert R.encode_v(x, bits)[1].tolist() == [0x7E]


def test_encode_v_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        R.encode_v(np.zeros(24, np.float32), 4)
    for bits in (1, 5, 8):
        with pytest.raises(ValueError):
            R.encode_v(np.zeros(16, np.float32), bits)


# ---------------------------------------------------------------------------------------------------
# §4 cache write
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Page layout with the addresses spelled out from FORMAT.md §2/§3; ``*_pad`` grow it past packed."""
    block_size: int
    num_kv_heads: int
    head_dim: int
    bits: int
    k_pad: int = 0
    v_data_pad: int = 0
    v_pad: int = 0

    @property
    def n(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def k_block_stride_bytes(self) -> int:
        return self.block_size * self.n + self.k_pad

    @property
    def v_data_section_bytes(self) -> int:
        return self.block_size * self.n * self.bits // 8 + self.v_data_pad

    @property
    def v_block_stride_bytes(self) -> int:
        return self.v_data_section_bytes + self.block_size * self.n // 16 + self.v_pad

    def k_addr(self, page: int, offset: int) -> np.ndarray:
        return page * self.k_block_stride_bytes + offset * self.n + np.arange(self.n)

    def v_data_addr(self, page: int, offset: int) -> np.ndarray:
        group_bytes = 2 * self.bits
        base = page * self.v_block_stride_bytes + offset * (self.n * self.bits // 8)
        return np.concatenate([base + g * group_bytes + np.arange(group_bytes) for g in range(self.n // 16)])

    def v_scale_addr(self, page: int, offset: int) -> np.ndarray:
        return page * self.v_block_stride_bytes + self.v_data_section_bytes + offset * (self.n // 16) \
            + np.arange(self.n // 16)

    def poisoned_pools(self, gen: np.random.Generator, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        return (gen.integers(0, 256, num_pages * self.k_block_stride_bytes, dtype=np.uint8),
                gen.integers(0, 256, num_pages * self.v_block_stride_bytes, dtype=np.uint8))

    def write(self, key, value, k_pool, v_pool, slots, key_stride, value_stride, k_scale) -> None:
        R.write_cache(key, value, k_pool, v_pool, slots, len(slots), self.num_kv_heads, self.head_dim,
                      self.block_size, key_stride, value_stride, k_scale, self.k_block_stride_bytes,
                      self.v_block_stride_bytes, self.v_data_section_bytes, self.bits)

    def read(self, k_pool, v_pool, page: int, offset: int, k_scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Dequantised (K, V) of one slot, float64 ``[H_kv, D]`` each."""
        k = R.decode_k(k_pool[self.k_addr(page, offset)], k_scale)
        v = R.decode_v(v_pool[self.v_data_addr(page, offset)], v_pool[self.v_scale_addr(page, offset)], self.bits)
        shape = (self.num_kv_heads, self.head_dim)
        return k.astype(np.float64).reshape(shape), v.astype(np.float64).reshape(shape)


def strided_rows(gen: np.random.Generator, num_tokens: int, n: int, stride: int,
                 dtype) -> tuple[np.ndarray, np.ndarray]:
    """(2-D buffer [num_tokens, stride] whose padding is NaN, the rows it holds)."""
    rows = (gen.standard_normal((num_tokens, n)) * gen.uniform(0.1, 5, (num_tokens, 1))).astype(dtype)
    buffer = np.full((num_tokens, stride), np.nan, dtype=dtype)
    buffer[:, :n] = rows
    return buffer, rows


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_write_cache_touches_exactly_the_addressed_slots(rng, bits: int, padded: bool, dtype) -> None:
    gen, seed = rng
    layout = Layout(16, 2, 64, bits, *((80, 24, 40) if padded else (0, 0, 0)))
    num_pages, num_tokens, k_scale = 5, 40, float(gen.uniform(0.02, 0.5))
    key_stride = layout.n + (24 if padded else 0)
    value_stride = layout.n + (40 if padded else 0)
    key, key_rows = strided_rows(gen, num_tokens, layout.n, key_stride, dtype)
    value, value_rows = strided_rows(gen, num_tokens, layout.n, value_stride, dtype)
    slots = gen.permutation(num_pages * layout.block_size)[:num_tokens].astype(np.int64)
    slots[gen.random(num_tokens) < 0.25] = -1
    slots[gen.integers(0, num_tokens)] = -7
    k_pool, v_pool = layout.poisoned_pools(gen, num_pages)
    k_expected, v_expected = k_pool.copy(), v_pool.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            page, offset = divmod(int(slot), layout.block_size)
            k_expected[layout.k_addr(page, offset)] = R.encode_k(key_rows[t], k_scale)
            data, scales = R.encode_v(value_rows[t], bits)
            v_expected[layout.v_data_addr(page, offset)] = data
            v_expected[layout.v_scale_addr(page, offset)] = scales

    flat_key = key.reshape(-1) if dtype == np.float32 else key  # 1-D and 2-D inputs are both flat arrays
    layout.write(flat_key, value, k_pool, v_pool, slots, key_stride, value_stride, k_scale)
    k_diff, v_diff = np.count_nonzero(k_pool != k_expected), np.count_nonzero(v_pool != v_expected)
    assert (k_diff, v_diff) == (0, 0), f"seed {seed}: {k_diff} K and {v_diff} V bytes differ"


def test_negative_slots_write_nothing(rng) -> None:
    gen, seed = rng
    layout = Layout(16, 2, 64, 3)
    key, _ = strided_rows(gen, 8, layout.n, layout.n, BF16)
    k_pool, v_pool = layout.poisoned_pools(gen, 2)
    k_before, v_before = k_pool.copy(), v_pool.copy()
    layout.write(key, key, k_pool, v_pool, np.array([-1, -2, -16, -17, -1, -1, -100, -(2 ** 40)]),
                 layout.n, layout.n, 0.1)
    assert np.array_equal(k_pool, k_before) and np.array_equal(v_pool, v_before), f"seed {seed}"


def test_write_cache_rejects_bad_layouts() -> None:
    layout = Layout(16, 2, 64, 4)
    k_pool, v_pool = np.zeros(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)
    x = np.zeros(layout.n, np.float32)
    args = dict(key=x, value=x, k_cache=k_pool, v_cache=v_pool, slot_mapping=np.zeros(1, np.int64), num_tokens=1,
                num_kv_heads=2, head_dim=64, block_size=16, key_stride=128, value_stride=128, k_scale=1.0,
                k_block_stride_bytes=layout.k_block_stride_bytes, v_block_stride_bytes=layout.v_block_stride_bytes,
                v_data_section_bytes=layout.v_data_section_bytes, bits=4)
    for change in (dict(k_block_stride_bytes=layout.k_block_stride_bytes - 1),
                   dict(v_data_section_bytes=layout.v_data_section_bytes - 1),
                   dict(v_block_stride_bytes=layout.v_block_stride_bytes - 1),
                   dict(head_dim=72, num_kv_heads=1), dict(bits=5)):
        with pytest.raises(ValueError):
            R.write_cache(**{**args, **change})


# ---------------------------------------------------------------------------------------------------
# Golden vectors of the original engine
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.stem for p in GOLDEN_FILES])
def test_golden_write_is_byte_identical(path: pathlib.Path) -> None:
    g = np.load(path)
    key, value = g["key_bf16_bits"].view(BF16), g["value_bf16_bits"].view(BF16)
    num_tokens, n = key.shape
    k_pool, v_pool = g["k_pool_before"].copy(), g["v_pool_before"].copy()
    R.write_cache(key, value, k_pool, v_pool, g["slot_mapping"], num_tokens, int(g["num_kv_heads"]),
                  int(g["head_dim"]), int(g["block_size"]), n, n, float(g["k_scale"]),
                  int(g["k_block_stride_bytes"]), int(g["v_block_stride_bytes"]), int(g["v_data_section_bytes"]),
                  int(g["bits"]))
    k_diff = np.count_nonzero(k_pool != g["k_pool_after"])
    v_diff = np.count_nonzero(v_pool != g["v_pool_after"])
    assert (k_diff, v_diff) == (0, 0), f"{path.name}: {k_diff} K and {v_diff} V bytes differ"


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.stem for p in GOLDEN_FILES])
def test_golden_decode_within_1e2(path: pathlib.Path) -> None:
    g = np.load(path)
    tables = g["block_tables"]
    num_seqs, num_q_heads, head_dim = g["q_bf16_bits"].shape
    out = R.paged_decode(g["q_bf16_bits"].view(BF16), g["decode_k_pool"], g["decode_v_pool"], tables,
                         g["seq_lens"], tables.shape[1], num_seqs, num_q_heads, int(g["num_kv_heads"]), head_dim,
                         int(g["block_size"]), float(g["inv_sqrt_d"]), float(g["k_scale"]), num_q_heads * head_dim,
                         int(g["v_block_stride_bytes"]), int(g["v_data_section_bytes"]), int(g["sliding_window"]),
                         int(g["bits"]), k_block_stride_bytes=int(g["k_block_stride_bytes"]),
                         sparse_v_threshold=0.0)
    original = g["out_bf16_bits"].view(BF16).astype(np.float64)
    err = np.linalg.norm(out - original, axis=-1)
    ref_norm = np.linalg.norm(original, axis=-1)
    nonzero = ref_norm > 0
    rel = err[nonzero] / ref_norm[nonzero]
    assert rel.max() <= 1e-2, f"{path.name}: max relative error per head {rel.max():.3g}"
    assert np.all(err[~nonzero] <= 1e-3), f"{path.name}: zero-norm heads off by {err[~nonzero].max():.3g}"


# ---------------------------------------------------------------------------------------------------
# §5 paged decode
# ---------------------------------------------------------------------------------------------------
@dataclass
class Cache:
    layout: Layout
    k_pool: np.ndarray
    v_pool: np.ndarray
    tables: np.ndarray
    seq_lens: np.ndarray
    k_scale: float


def build_cache(gen: np.random.Generator, layout: Layout, seq_lens: list[int], max_blocks: int) -> Cache:
    """Pools written by write_cache: each sequence gets random distinct pages; page ids not used stay poison."""
    num_seqs = len(seq_lens)
    num_pages = num_seqs * max_blocks + 3
    tables = gen.permutation(num_pages)[:num_seqs * max_blocks].reshape(num_seqs, max_blocks).astype(np.int32)
    k_pool, v_pool = layout.poisoned_pools(gen, num_pages)
    k_scale = float(gen.uniform(0.02, 0.1))
    for s, seq_len in enumerate(seq_lens):
        positions = np.arange(seq_len)
        slots = tables[s, positions // layout.block_size].astype(np.int64) * layout.block_size \
            + positions % layout.block_size
        keys = gen.standard_normal((seq_len, layout.n)).astype(BF16)
        values = gen.standard_normal((seq_len, layout.n)).astype(BF16)
        layout.write(keys, values, k_pool, v_pool, slots, layout.n, layout.n, k_scale)
    return Cache(layout, k_pool, v_pool, tables, np.array(seq_lens, dtype=np.int32), k_scale)


def run_decode(cache: Cache, q: np.ndarray, q_stride: int, num_q_heads: int, inv_sqrt_d: float,
               sliding_window: int = 0, sparse_v_threshold: float = 0.0) -> np.ndarray:
    lay = cache.layout
    return R.paged_decode(q, cache.k_pool, cache.v_pool, cache.tables, cache.seq_lens, cache.tables.shape[1],
                          len(cache.seq_lens), num_q_heads, lay.num_kv_heads, lay.head_dim, lay.block_size,
                          inv_sqrt_d, cache.k_scale, q_stride, lay.v_block_stride_bytes, lay.v_data_section_bytes,
                          sliding_window, lay.bits, sparse_v_threshold=sparse_v_threshold,
                          # packed layouts rely on the default B·n
                          k_block_stride_bytes=lay.k_block_stride_bytes if lay.k_pad else None)


def attended(cache: Cache, s: int, kv_head: int, sliding_window: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) float64 ``[P, D]`` of the positions sequence ``s`` attends to, read slot by slot."""
    lay = cache.layout
    seq_len = int(cache.seq_lens[s])
    start = max(seq_len - sliding_window, 0) if sliding_window > 0 else 0
    ks, vs = [], []
    for p in range(start, seq_len):
        k, v = lay.read(cache.k_pool, cache.v_pool, int(cache.tables[s, p // lay.block_size]),
                        p % lay.block_size, cache.k_scale)
        ks.append(k[kv_head])
        vs.append(v[kv_head])
    return np.array(ks).reshape(-1, lay.head_dim), np.array(vs).reshape(-1, lay.head_dim)


def dense_attention(cache: Cache, q_heads: np.ndarray, inv_sqrt_d: float, sliding_window: int = 0) -> np.ndarray:
    """Exact float64 softmax attention, query head h reading KV head h // G."""
    num_seqs, num_q_heads, head_dim = q_heads.shape
    group = num_q_heads // cache.layout.num_kv_heads
    out = np.zeros(q_heads.shape)
    for s in range(num_seqs):
        for h in range(num_q_heads):
            k, v = attended(cache, s, h // group, sliding_window)
            if len(k):
                scores = k @ q_heads[s, h].astype(np.float64) * inv_sqrt_d
                p = np.exp(scores - scores.max())
                out[s, h] = p @ v / p.sum()
    return out


def random_q(gen: np.random.Generator, num_seqs: int, num_q_heads: int, head_dim: int, pad: int,
             scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, int]:
    """(flat q buffer with NaN padding between sequences, q as [S, Hq, D], q_stride in elements)."""
    q_stride = num_q_heads * head_dim + pad
    buffer, rows = strided_rows(gen, num_seqs, num_q_heads * head_dim, q_stride, np.float32)
    rows = (rows * scale).astype(np.float32)
    buffer[:, :num_q_heads * head_dim] = rows
    return buffer.reshape(-1), rows.reshape(num_seqs, num_q_heads, head_dim), q_stride


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("sliding_window", [0, 20])
def test_paged_decode_matches_dense_attention(rng, bits: int, sliding_window: int) -> None:
    gen, seed = rng
    layout = Layout(16, 2, 64, bits, k_pad=48, v_data_pad=16, v_pad=32)
    cache = build_cache(gen, layout, [0, 1, 20, 37, 64], max_blocks=4)
    q, q_heads, q_stride = random_q(gen, 5, 8, 64, pad=16)
    inv_sqrt_d = float(gen.uniform(0.05, 0.3))
    out = run_decode(cache, q, q_stride, 8, inv_sqrt_d, sliding_window, sparse_v_threshold=0.0)
    expected = dense_attention(cache, q_heads, inv_sqrt_d, sliding_window)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")
    assert out.dtype == np.float64 and np.all(out[0] == 0), f"seed {seed}: L = 0 must give zeros"


def test_paged_decode_empty_sequences_give_zeros(rng) -> None:
    gen, seed = rng
    cache = build_cache(gen, Layout(16, 1, 64, 4), [0, 0], max_blocks=2)
    q, _, q_stride = random_q(gen, 2, 2, 64, pad=0)
    for window in (0, 8):
        out = run_decode(cache, q, q_stride, 2, 0.125, window)
        assert out.shape == (2, 2, 64) and np.all(out == 0), f"seed {seed}"


@pytest.mark.parametrize("bits", BITS)
def test_sliding_window_equals_attention_over_last_positions(rng, bits: int) -> None:
    gen, seed = rng
    layout = Layout(16, 2, 64, bits)
    seq_len, window = 50, 21
    full = build_cache(gen, layout, [seq_len], max_blocks=4)
    # A second cache holding only the last `window` positions, copied slot by slot, at positions 0 ... W-1.
    last = build_cache(gen, layout, [0], max_blocks=2)
    last.seq_lens[0], last.k_scale = window, full.k_scale
    for i, p in enumerate(range(seq_len - window, seq_len)):
        src = (int(full.tables[0, p // 16]), p % 16)
        dst = (int(last.tables[0, i // 16]), i % 16)
        last.k_pool[layout.k_addr(*dst)] = full.k_pool[layout.k_addr(*src)]
        last.v_pool[layout.v_data_addr(*dst)] = full.v_pool[layout.v_data_addr(*src)]
        last.v_pool[layout.v_scale_addr(*dst)] = full.v_pool[layout.v_scale_addr(*src)]
    q, _, q_stride = random_q(gen, 1, 4, 64, pad=0)
    windowed = run_decode(full, q, q_stride, 4, 0.125, sliding_window=window)
    np.testing.assert_allclose(windowed, run_decode(last, q, q_stride, 4, 0.125), rtol=1e-13, atol=1e-14,
                               err_msg=f"seed {seed}")
    # A window at least L long attends to everything.
    for wide in (seq_len, seq_len + 5):
        np.testing.assert_array_equal(run_decode(full, q, q_stride, 4, 0.125, sliding_window=wide),
                                      run_decode(full, q, q_stride, 4, 0.125), err_msg=f"seed {seed}")


def test_gqa_query_head_h_reads_kv_head_h_over_g(rng) -> None:
    gen, seed = rng
    layout = Layout(16, 2, 64, 4)
    cache = build_cache(gen, layout, [30, 45], max_blocks=3)
    # Swap the two KV heads in every written slot: query heads 0..3 and 4..7 must swap their outputs.
    swapped = Cache(layout, cache.k_pool.copy(), cache.v_pool.copy(), cache.tables, cache.seq_lens, cache.k_scale)
    for s, seq_len in enumerate(cache.seq_lens):
        for p in range(seq_len):
            page, offset = int(cache.tables[s, p // 16]), p % 16
            for pool_src, pool_dst, addr in (
                    (cache.k_pool, swapped.k_pool, layout.k_addr(page, offset)),
                    (cache.v_pool, swapped.v_pool, layout.v_data_addr(page, offset)),
                    (cache.v_pool, swapped.v_pool, layout.v_scale_addr(page, offset))):
                first, second = np.split(addr, 2)
                pool_dst[first], pool_dst[second] = pool_src[second], pool_src[first]
    q, q_heads, q_stride = random_q(gen, 2, 8, 64, pad=0)
    q_same = np.concatenate([q_heads[:, :4], q_heads[:, :4]], axis=1).reshape(-1)  # heads 4..7 = heads 0..3
    out, out_swapped = run_decode(cache, q_same, 8 * 64, 8, 0.125), run_decode(swapped, q_same, 8 * 64, 8, 0.125)
    np.testing.assert_array_equal(out_swapped[:, :4], out[:, 4:], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(out_swapped[:, 4:], out[:, :4], err_msg=f"seed {seed}")
    assert not np.allclose(out[:, :4], out[:, 4:]), f"seed {seed}: the two KV heads should differ"


@pytest.mark.parametrize("bits", BITS)
def test_sparse_v_error_is_bounded_by_the_skippable_mass(rng, bits: int) -> None:
    gen, seed = rng
    layout = Layout(16, 2, 64, bits)
    cache = build_cache(gen, layout, [1, 33, 64], max_blocks=4)
    q, q_heads, q_stride = random_q(gen, 3, 4, 64, pad=8, scale=3.0)  # wide score range: many skips
    tau = 1e-2
    exact = run_decode(cache, q, q_stride, 4, 0.125, sparse_v_threshold=0.0)
    np.testing.assert_allclose(exact, dense_attention(cache, q_heads, 0.125), rtol=1e-12, atol=1e-12)
    sparse = run_decode(cache, q, q_stride, 4, 0.125, sparse_v_threshold=tau)
    for s in range(3):
        for h in range(4):
            k, v = attended(cache, s, h // 2, 0)
            scores = k @ q_heads[s, h].astype(np.float64) * 0.125
            weights = np.exp(scores - scores.max())
            softmax = weights / weights.sum()
            skippable = weights <= tau
            bound = np.sum(softmax[skippable] * np.linalg.norm(v[skippable], axis=-1))
            err = np.linalg.norm(sparse[s, h] - exact[s, h])
            assert err <= bound * (1 + 1e-9) + 1e-15, f"seed {seed}: seq {s} head {h}: {err} > {bound}"
    assert np.any(sparse != exact), f"seed {seed}: no V row was skipped, the test proves nothing"


@pytest.mark.parametrize("high_first", [False, True])
def test_sparse_v_uses_the_running_maximum(high_first: bool) -> None:
    # Two positions, scores 0 and 10 (exp(-10) ≈ 4.5e-5 < τ = 1e-3). Scored with the running maximum, the
    # low position is skipped only when it comes after the high one.
    layout = Layout(16, 1, 64, 4)
    k_pool, v_pool = np.zeros(layout.k_block_stride_bytes, np.uint8), np.zeros(layout.v_block_stride_bytes, np.uint8)
    keys = np.zeros((2, 64), np.float32)
    keys[1 if not high_first else 0, 0] = 1.0  # k_scale 1: exactly 1.0 after E4M3
    values = np.zeros((2, 64), np.float32)
    values[0, :16], values[1, 16:32] = 1.0, 1.0  # disjoint non-zero groups; the rest read back as zeros
    layout.write(keys, values, k_pool, v_pool, np.array([0, 1]), 64, 64, 1.0)
    v = np.array([R.decode_v(v_pool[layout.v_data_addr(0, o)], v_pool[layout.v_scale_addr(0, o)], 4)
                  for o in (0, 1)], dtype=np.float64)
    q = np.zeros(64, np.float32)
    q[0] = 10.0
    out = R.paged_decode(q, k_pool, v_pool, np.zeros((1, 1), np.int32), np.array([2]), 1, 1, 1, 1, 64, 16, 1.0,
                         1.0, 64, layout.v_block_stride_bytes, layout.v_data_section_bytes, 0, 4,
                         sparse_v_threshold=1e-3)[0, 0]
    low, high = (1, 0) if high_first else (0, 1)
    w_low = np.exp(-10.0)
    expected = (v[high] + (0.0 if high_first else w_low) * v[low]) / (1.0 + w_low)
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=0)
    assert np.abs(v[low]).max() > 0 and np.all(v[low] * v[high] == 0)


def test_paged_decode_rejects_bad_shapes() -> None:
    layout = Layout(16, 2, 64, 4)
    cache = Cache(layout, np.zeros(layout.k_block_stride_bytes, np.uint8),
                  np.zeros(layout.v_block_stride_bytes, np.uint8), np.zeros((1, 1), np.int32),
                  np.array([1], np.int32), 1.0)
    with pytest.raises(ValueError):
        run_decode(cache, np.zeros(3 * 64, np.float32), 3 * 64, 3, 0.125)  # 3 query heads, 2 KV heads
