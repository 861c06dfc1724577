"""The reference's codec: the format's constants and sizes (FORMAT.md §1-§3), the E4M3 conversions,
the K and V encoders and decoders of a group (the default matched-norm encoder and the optional MSE and
projection searches), and the code packing. `fp8kturbov.reference` re-exports the public names and
builds the cache write, the dequantize and the attention on them; the module docstring there states
the arithmetic rules that hold here too."""
from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._reference_args import GROUP_ELEMS
from ._reference_args import (  # the argument rules
    _bytes, _check_bits, _check_encoder, _check_k_scale, _check_last_axis, _check_page_shape, _float_data, _integers,
)

E4M3_MAX = 448.0
"""Largest finite E4M3 (e4m3fn) magnitude."""

# FORMAT.md §3.1: unit-variance Gaussian Lloyd-Max levels (code 0 ... 2^b - 1) and decision bounds.
CODEBOOKS: dict[int, NDArray[np.float32]] = {
    4: np.array([-2.7326, -2.0690, -1.6180, -1.2562, -0.9423, -0.6568, -0.3880, -0.1284,
                 0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326], dtype=np.float32),
    3: np.array([-2.1520, -1.3440, -0.7560, -0.2451, 0.2451, 0.7560, 1.3440, 2.1520], dtype=np.float32),
    2: np.array([-1.5104, -0.4528, 0.4528, 1.5104], dtype=np.float32),
}
BOUNDS: dict[int, NDArray[np.float32]] = {
    4: np.array([-2.4008, -1.8435, -1.4371, -1.0993, -0.7996, -0.5224, -0.2582, 0.0,
                 0.2582, 0.5224, 0.7996, 1.0993, 1.4371, 1.8435, 2.4008], dtype=np.float32),
    3: np.array([-1.748, -1.050, -0.501, 0.0, 0.501, 1.050, 1.748], dtype=np.float32),
    2: np.array([-0.9816, 0.0, 0.9816], dtype=np.float32),
}
LEVEL_MAX: dict[int, np.float32] = {b: np.float32(levels[-1]) for b, levels in CODEBOOKS.items()}


# ---------------------------------------------------------------------------------------------------
# Sizes (FORMAT.md §2, §3). All results are bytes.
# ---------------------------------------------------------------------------------------------------
def k_page_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Packed K page, bytes: ``B·n`` (one E4M3 byte per element), FORMAT.md §2."""
    block_size, num_kv_heads, head_dim = _check_page_shape(block_size, num_kv_heads, head_dim)
    return block_size * num_kv_heads * head_dim


def v_data_section_bytes(block_size: int, num_kv_heads: int, head_dim: int, bits: int) -> int:
    """Packed V data section, bytes: ``B·n·b/8``, FORMAT.md §3."""
    bits = _check_bits(bits)
    return k_page_bytes(block_size, num_kv_heads, head_dim) * bits // 8


def v_scale_section_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """V scale section, bytes: ``B·n/16`` (one E4M3 byte per 16-element group), FORMAT.md §3."""
    return k_page_bytes(block_size, num_kv_heads, head_dim) // GROUP_ELEMS


def v_page_bytes(block_size: int, num_kv_heads: int, head_dim: int, bits: int) -> int:
    """Packed V page, bytes: data section + scale section = ``(2b+1)·B·n/16``, FORMAT.md §3."""
    return (v_data_section_bytes(block_size, num_kv_heads, head_dim, bits)
            + v_scale_section_bytes(block_size, num_kv_heads, head_dim))


def v_group_bytes(bits: int) -> int:
    """Packed codes of one 16-element group, bytes: ``2b`` (8, 6, 4), FORMAT.md §3."""
    return 2 * _check_bits(bits)


# ---------------------------------------------------------------------------------------------------
# E4M3 and K (FORMAT.md §2)
# ---------------------------------------------------------------------------------------------------
def e4m3_encode(x: ArrayLike) -> NDArray[np.uint8]:
    """E4M3_rn_satfinite of float32 values, one byte per element (FORMAT.md §2).

    Round to nearest even; finite overflow and ±inf saturate to ±448 (0x7E/0xFE); NaN of either sign
    becomes 0x7F.
    """
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):  # NaN is replaced below
        rounded = np.clip(x, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), rounded)


def e4m3_decode(b: ArrayLike) -> NDArray[np.float32]:
    """Float32 value of E4M3 bytes (0x7F/0xFF are NaN), FORMAT.md §2."""
    return _bytes("b", b).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def encode_k(x: ArrayLike, k_scale: float) -> NDArray[np.uint8]:
    """K bytes of float32/bfloat16 values, any shape: ``E4M3(x · (1.0f / k_scale))``, FORMAT.md §2.
    ``k_scale``: finite, > 0. A k_scale whose float32 reciprocal is inf is computed as the format says
    (a zero key becomes NaN): `write_cache`, like the library's write, refuses it."""
    x = _float_data("x", x)
    _check_k_scale(k_scale)
    inv = np.float32(1.0) / np.float32(k_scale)  # once, in float32; then a multiply per element
    with np.errstate(over="ignore"):  # a product beyond float32 is inf, which saturates
        return e4m3_encode(x.astype(np.float32) * inv)


def decode_k(b: ArrayLike, k_scale: float) -> NDArray[np.float32]:
    """Float32 K values of K bytes: ``float(E4M3(byte)) · k_scale``, FORMAT.md §2 (``k_scale`` finite, > 0)."""
    _check_k_scale(k_scale)
    return e4m3_decode(b) * np.float32(k_scale)


# ---------------------------------------------------------------------------------------------------
# V codes, packing and the matched-norm encoder (FORMAT.md §3)
# ---------------------------------------------------------------------------------------------------
def pack_codes(codes: ArrayLike, bits: int) -> NDArray[np.uint8]:
    """Pack b-bit codes ``[..., n]`` (n % 16 == 0, elements) into bytes ``[..., n·b/8]``, FORMAT.md §3.3.

    Groups are packed back to back, so the packing is applied along the whole last axis.
    """
    bits = _check_bits(bits)
    code_max = (1 << bits) - 1
    c = _integers("codes", codes, 0, code_max, f"a {bits}-bit code (0 ... {code_max})").astype(np.uint8)
    n = _check_last_axis("codes", c, GROUP_ELEMS, "codes")
    lead = c.shape[:-1]
    if bits == 4:  # byte j = c[2j] | c[2j+1] << 4
        out = c[..., 0::2] | (c[..., 1::2] << 4)
    elif bits == 2:  # byte j = c[4j] | c[4j+1] << 2 | c[4j+2] << 4 | c[4j+3] << 6
        out = c[..., 0::4] | (c[..., 1::4] << 2) | (c[..., 2::4] << 4) | (c[..., 3::4] << 6)
    else:  # 3-bit: each 8 codes form a 24-bit little-endian word, code i at bits 3i ... 3i+2
        eights = c.reshape(*lead, n // 8, 8).astype(np.uint32)
        word = np.zeros(eights.shape[:-1], dtype=np.uint32)
        for i in range(8):
            word |= eights[..., i] << np.uint32(3 * i)
        out = np.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], axis=-1).astype(np.uint8)
    return out.reshape(*lead, n * bits // 8)


def unpack_codes(data: ArrayLike, bits: int) -> NDArray[np.uint8]:
    """Inverse of `pack_codes`: bytes ``[..., m]`` (m % 2b == 0) to codes ``[..., 8m/b]``, FORMAT.md §3.3."""
    bits = _check_bits(bits)
    d = _bytes("data", data)
    m = _check_last_axis("data", d, v_group_bytes(bits), "bytes")
    lead = d.shape[:-1]
    if bits == 4:
        out = np.stack([d & 0xF, d >> 4], axis=-1)
    elif bits == 2:
        out = np.stack([(d >> (2 * k)) & 0x3 for k in range(4)], axis=-1)
    else:
        trip = d.reshape(*lead, m // 3, 3).astype(np.uint32)
        word = trip[..., 0] | (trip[..., 1] << np.uint32(8)) | (trip[..., 2] << np.uint32(16))
        out = np.stack([(word >> np.uint32(3 * i)) & 0x7 for i in range(8)], axis=-1)
    return out.astype(np.uint8).reshape(*lead, m * 8 // bits)


def encode_v(x: ArrayLike, bits: int, encoder: str = "matched_norm") -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    """V encoder, packed per FORMAT.md §3.3: matched-norm (§3.2, the default) or the MSE scale search.

    ``x``: float32 or bfloat16 ``[..., n]`` with ``n % 16 == 0`` (elements). Returns ``(data, scales)``:
    uint8 ``[..., n·b/8]`` packed codes and uint8 ``[..., n/16]`` E4M3 scale bytes. Every step is one
    float32 numpy operation and the sums run sequentially over i = 0..15, as in the original engine.
    ``encoder="mse"`` selects `_encode_v_mse_groups`, ``encoder="projection"`` `_encode_v_projection_groups`
    (same byte format, same decoder; never the default).
    """
    bits = _check_bits(bits)
    _check_encoder(encoder)
    x = _float_data("x", x).astype(np.float32)
    n = _check_last_axis("x", x, GROUP_ELEMS, "elements")
    xg = x.reshape(*x.shape[:-1], n // GROUP_ELEMS, GROUP_ELEMS)
    searches = {"mse": _encode_v_mse_groups, "projection": _encode_v_projection_groups}
    if encoder in searches:
        codes, scale_bytes = searches[encoder](xg.reshape(-1, GROUP_ELEMS), bits)
        return (pack_codes(codes.reshape(x.shape), bits),
                scale_bytes.reshape(xg.shape[:-1]))
    group_shape = xg.shape[:-1]
    levels = CODEBOOKS[bits]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        # 1. n2 = sum of squares (sequential), amax = fmax fold of |x_i| from 0 (NaN ignored).
        n2 = np.zeros(group_shape, dtype=np.float32)
        amax = np.zeros(group_shape, dtype=np.float32)
        for i in range(GROUP_ELEMS):
            n2 = n2 + xg[..., i] * xg[..., i]
            amax = np.fmax(amax, np.abs(xg[..., i]))
        # 2. inv = MAX / amax, or 1 for (near-)zero groups.
        inv = np.where(amax > np.float32(1e-12), LEVEL_MAX[bits] / amax, np.float32(1.0))
        # 3. code = number of bounds <= x·inv (NaN compares false: code 0; ±0 reaches the 0.0 bound).
        y = xg * inv[..., None]
        codes = (y[..., None] >= BOUNDS[bits]).sum(axis=-1).astype(np.uint8)
        # 4. r2 = sum of squared levels (sequential); s = sqrt(n2) / sqrt(r2).
        r2 = np.zeros(group_shape, dtype=np.float32)
        for i in range(GROUP_ELEMS):
            level = levels[codes[..., i]]
            r2 = r2 + level * level
        sqrt_r2 = np.sqrt(r2)
        s = np.where(sqrt_r2 > np.float32(1e-10), np.sqrt(n2) / sqrt_r2, np.float32(0.0))
        # 5. s = min(s, 448) written as a compare so that NaN stays NaN; then the E4M3 byte.
        s = np.where(s > np.float32(E4M3_MAX), np.float32(E4M3_MAX), s)
    return pack_codes(codes.reshape(x.shape), bits), e4m3_encode(s)


def decode_v(data: ArrayLike, scales: ArrayLike, bits: int) -> NDArray[np.float32]:
    """Float32 V values ``[..., n]`` of packed data ``[..., n·b/8]`` and scale bytes ``[..., n/16]``:
    ``level[code] · float(E4M3(scale))``, FORMAT.md §3.4 (levels kept in float32)."""
    codes = unpack_codes(data, bits)
    scale = e4m3_decode(_bytes("scales", scales))
    n = codes.shape[-1]
    if scale.shape != codes.shape[:-1] + (n // GROUP_ELEMS,):
        raise ValueError(f"scales has shape {scale.shape}, not {codes.shape[:-1] + (n // GROUP_ELEMS,)}: "
                         f"one scale byte per group of the data")
    values = CODEBOOKS[bits][codes].reshape(*codes.shape[:-1], n // GROUP_ELEMS, GROUP_ELEMS)
    return (values * scale[..., None]).reshape(codes.shape)


# ---------------------------------------------------------------------------------------------------
# The MSE-optimal V encoder (an option allowed by FORMAT.md §3.2; same bytes format, same decoder)
# ---------------------------------------------------------------------------------------------------
MSE_CANDIDATE_BYTES: NDArray[np.uint8] = np.arange(0x00, 0x7F, dtype=np.uint8)
"""Scale bytes the MSE encoder tries, in this (ascending) order: 0x00 (zero) and every positive finite
E4M3 byte 0x01 ... 0x7E (2^-9 ... 448)."""


def _encode_v_mse_groups(xg: NDArray[np.float32], bits: int) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    """MSE scale search over float32 groups ``[G, 16]``; returns codes ``[G, 16]`` and scale bytes ``[G]``.

    The exact rule (a kernel must reproduce it byte for byte; all float32, round to nearest, no FMA):
      for every candidate byte ``c`` in 0x00, 0x01, ..., 0x7E, in that order, with ``s = float(E4M3(c))``:
        ``y_i = x_i / s`` (IEEE division) for c ≠ 0; ``y_i = x_i`` for c = 0x00 (scale 1: codes only;
            they are multiplied by zero on read);
        ``code_i`` = number of bounds ``β`` with ``y_i ≥ β`` (the §3.2 step-3 rule: nearest level per the
            written bounds, a value on a bound takes the upper level, ±0 the smallest positive level);
        ``t_i = level[code_i] · s``; ``d_i = x_i − t_i``; ``err = ((0 + d_0·d_0) + d_1·d_1) + … + d_15·d_15``
            (each product and each sum rounded to float32, sequentially over i = 0..15);
      keep the candidate when ``err < best`` (strict; ``best`` starts at +inf), so ties go to the smaller byte.
    0x00 reconstructs exact zeros (its error is ``Σ x_i²``), so an all-zero group gets byte 0x00 and codes
    2^(b−1), as matched-norm gives it. A group with no finite error — one holding NaN or ±inf, or one so
    large that every ``err`` overflows — gets the matched-norm encoder's codes and byte (NaN → scale 0x7F,
    reads back as NaN; ±inf → saturated 448).
    """
    levels, bounds = CODEBOOKS[bits], BOUNDS[bits]
    num_groups = xg.shape[0]
    scales = e4m3_decode(MSE_CANDIDATE_BYTES)
    best_err = np.full(num_groups, np.inf, dtype=np.float32)
    best_byte = np.zeros(num_groups, dtype=np.uint8)
    best_codes = np.zeros((num_groups, GROUP_ELEMS), dtype=np.uint8)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for byte, s in zip(MSE_CANDIDATE_BYTES, scales):
            y = xg if byte == 0 else xg / s
            codes = np.searchsorted(bounds, y, side="right").astype(np.uint8)  # #{β ≤ y}; NaN: groups fall back
            err = np.zeros(num_groups, dtype=np.float32)
            for i in range(GROUP_ELEMS):
                d = xg[:, i] - levels[codes[:, i]] * s
                err = err + d * d
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_byte = np.where(better, byte, best_byte)
            best_codes[better] = codes[better]
    fallback = ~np.isfinite(best_err)
    if np.any(fallback):
        data, fb_scales = encode_v(xg[fallback].reshape(-1), bits)
        best_codes[fallback] = unpack_codes(data, bits).reshape(-1, GROUP_ELEMS)
        best_byte[fallback] = fb_scales
    return best_codes, best_byte.astype(np.uint8)


# ---------------------------------------------------------------------------------------------------
# The projection-keeping V encoder (an option allowed by FORMAT.md §3.2; same bytes format, same decoder)
# ---------------------------------------------------------------------------------------------------
PROJECTION_CANDIDATE_BYTES: NDArray[np.uint8] = np.arange(0x01, 0x7F, dtype=np.uint8)
"""Scale bytes whose codes the projection encoder tries, in this (ascending) order: every positive finite
E4M3 byte 0x01 ... 0x7E (2^-9 ... 448)."""


def _encode_v_projection_groups(xg: NDArray[np.float32], bits: int) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    """Codes of the least angle to the group, scaled so that the decoded group keeps the input's projection;
    float32 groups ``[G, 16]`` → codes ``[G, 16]`` and scale bytes ``[G]``.

    Why: attention averages each position's independent error away, but not a shrink common to all of
    them; the matched-norm and MSE encoders decode a group ``x`` as about ``α·x`` plus noise with
    ``α = ⟨x̂, x⟩/‖x‖² < 1`` (cos θ and cos² θ of the codes' angle θ). Here ``α = 1`` up to the rounding of
    the scale byte, with the codes of the least angle found among the candidates.

    The exact rule (a kernel must reproduce it byte for byte; all float32, round to nearest, no FMA):
      ``xx = ((0 + x_0·x_0) + x_1·x_1) + … + x_15·x_15`` (each product and sum rounded, sequentially);
      for every candidate byte ``c`` in 0x01, 0x02, ..., 0x7E, in that order, with ``s = float(E4M3(c))``:
        ``code_i`` = number of bounds ``β`` with ``x_i / s ≥ β`` (IEEE division; the §3.2 step-3 rule);
        ``dot = Σ level[code_i]·x_i``, ``ll = Σ level[code_i]·level[code_i]`` (sequential, as ``xx``);
        ``q = dot / sqrt(ll)`` (IEEE square root and division);
      keep the candidate's codes and ``dot`` when ``q > best`` (strict; ``best`` starts at −inf), so ties
      go to the smaller byte; then ``s = xx / dot``, ``s = min(s, 448)`` (a compare), byte = E4M3_rn_satfinite(s).
    A group where ``xx`` is not finite or the best ``q`` is not finite and > 0 — it holds NaN or ±inf, is
    all zero, or so large or so small that the sums overflow or vanish — gets the matched-norm bytes.
    """
    levels, bounds = CODEBOOKS[bits], BOUNDS[bits]
    num_groups = xg.shape[0]
    best_q = np.full(num_groups, -np.inf, dtype=np.float32)
    best_dot = np.zeros(num_groups, dtype=np.float32)
    best_codes = np.zeros((num_groups, GROUP_ELEMS), dtype=np.uint8)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        xx = np.zeros(num_groups, dtype=np.float32)
        for i in range(GROUP_ELEMS):
            xx = xx + xg[:, i] * xg[:, i]
        for s in e4m3_decode(PROJECTION_CANDIDATE_BYTES):
            codes = np.searchsorted(bounds, xg / s, side="right").astype(np.uint8)  # #{β ≤ x/s}
            dot = np.zeros(num_groups, dtype=np.float32)
            ll = np.zeros(num_groups, dtype=np.float32)
            for i in range(GROUP_ELEMS):
                level = levels[codes[:, i]]
                dot = dot + level * xg[:, i]
                ll = ll + level * level
            q = dot / np.sqrt(ll)
            better = q > best_q
            best_q = np.where(better, q, best_q)
            best_dot = np.where(better, dot, best_dot)
            best_codes[better] = codes[better]
        scale = xx / best_dot
        scale = np.where(scale > np.float32(E4M3_MAX), np.float32(E4M3_MAX), scale)
    best_byte = e4m3_encode(scale)
    fallback = ~(np.isfinite(xx) & np.isfinite(best_q) & (best_q > 0))
    if np.any(fallback):
        data, fb_scales = encode_v(xg[fallback].reshape(-1), bits)
        best_codes[fallback] = unpack_codes(data, bits).reshape(-1, GROUP_ELEMS)
        best_byte[fallback] = fb_scales
    return best_codes, best_byte
