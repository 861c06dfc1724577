"""Bit-exact NumPy reference of the fp8k_turbo{2,3,4}v paged KV-cache format.

Every rule here is a transcription of ``docs/format.md`` (the contract shared with the original
engine); each function names the section it implements. The code is written to be read: all encoder arithmetic is done in float32 with
separate numpy operations (no fused multiply-add) and with the sums taken sequentially over the 16
elements of a group, exactly as FORMAT.md §3.2 prescribes; attention (§5) is done in float64.

Units: sizes and strides named ``*_bytes`` are bytes; ``key_stride``, ``value_stride`` and ``q_stride``
are elements; ``n = num_kv_heads * head_dim`` is the number of elements in one token row.

Arguments follow the library's rules with the library's wording (``name = value ...``): what the C
entry points refuse, the reference refuses, with a ValueError naming the argument; an array of the
wrong kind (integers where data is expected, floats where bytes, slots or page ids are) is a
TypeError. Where the library defines a result (NaN data, seq_len 0, a seq_len beyond the block
table), the reference computes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _scalars
from ._scalars import U32_MAX, U64_MAX
from ._reference_args import GROUP_ELEMS, V_ENCODERS
from ._reference_rotation import ROTATION_DIMS, hadamard, rotate, rotate_f32, rotation_signs, unrotate
from ._reference_args import (  # the argument rules
    _block_tables, _bytes, _check_bits, _check_encoder, _check_entries, _check_finite_non_negative, _check_k_reciprocal, _check_k_scale, _check_last_axis, _check_page_shape, _check_q_heads, _check_q_stride, _check_rotation, _check_row_stride, _check_score_scale, _check_table_width, _float_data, _index_array, _integers, _pool, _token_rows, _u32,
)

__all__ = [
    "BOUNDS", "CODEBOOKS", "E4M3_MAX", "GROUP_ELEMS", "LEVEL_MAX",
    "k_page_bytes", "v_data_section_bytes", "v_scale_section_bytes", "v_page_bytes", "v_group_bytes",
    "e4m3_encode", "e4m3_decode", "encode_k", "decode_k", "pack_codes", "unpack_codes",
    "encode_v", "decode_v", "write_cache", "dequantize_cache", "paged_decode", "paged_prefill",
    "V_ENCODERS", "MSE_CANDIDATE_BYTES", "PROJECTION_CANDIDATE_BYTES", "ROTATION_DIMS", "rotation_signs", "hadamard", "rotate", "unrotate",
]

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


# ---------------------------------------------------------------------------------------------------
# Cache write (FORMAT.md §4), its inverse, and paged decode attention (FORMAT.md §5)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _PageLayout:
    """The page layout of a call, checked (`_checked_layout`); strides and sections in bytes."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    bits: int
    k_block_stride_bytes: int
    v_block_stride_bytes: int
    v_data_section_bytes: int

    @property
    def n(self) -> int:
        """Elements of one token row."""
        return self.num_kv_heads * self.head_dim

    @property
    def row_data_bytes(self) -> int:
        """Packed V codes of one token row: ``n·b/8``."""
        return self.n * self.bits // 8

    @property
    def row_scale_bytes(self) -> int:
        """V scale bytes of one token row: ``n/16``."""
        return self.n // GROUP_ELEMS

    def num_pages(self, k_cache: Any, v_cache: Any) -> int:
        """The pages that lie whole in both pools (a last page needs no padding after it): the page ids
        that a slot or an attended block-table entry may name."""
        k_page = self.block_size * self.n
        v_page = self.v_data_section_bytes + self.block_size * self.row_scale_bytes
        return min(_whole_pages(_pool("k_cache", k_cache).size, self.k_block_stride_bytes, k_page),
                   _whole_pages(_pool("v_cache", v_cache).size, self.v_block_stride_bytes, v_page))


def _whole_pages(pool_bytes: int, stride_bytes: int, page_bytes: int) -> int:
    """The pages ``p`` with ``p·stride_bytes + page_bytes <= pool_bytes``."""
    return 0 if pool_bytes < page_bytes else (pool_bytes - page_bytes) // stride_bytes + 1


def _checked_layout(block_size: Any, num_kv_heads: Any, head_dim: Any, bits: Any, k_block_stride_bytes: Any,
                    v_block_stride_bytes: Any, data_section_bytes: Any) -> _PageLayout:
    """The library's shape rules and ``check_pool_layout``: pages at least as large as the packed ones of
    FORMAT.md §2/§3 (else they would overlap), and a data section that leaves the scales their room."""
    bits = _check_bits(bits)
    block_size, num_kv_heads, head_dim = _check_page_shape(block_size, num_kv_heads, head_dim)
    if num_kv_heads * head_dim > U32_MAX:
        raise ValueError(f"num_kv_heads * head_dim = {num_kv_heads * head_dim} exceeds 2^32 - 1")
    layout = _PageLayout(block_size, num_kv_heads, head_dim, bits,
                         _scalars.unsigned("k_block_stride_bytes", k_block_stride_bytes, U64_MAX),
                         _scalars.unsigned("v_block_stride_bytes", v_block_stride_bytes, U64_MAX),
                         _scalars.unsigned("v_data_section_bytes", data_section_bytes, U64_MAX))
    k_page = k_page_bytes(block_size, num_kv_heads, head_dim)
    packed_codes = v_data_section_bytes(block_size, num_kv_heads, head_dim, bits)
    scales = v_scale_section_bytes(block_size, num_kv_heads, head_dim)
    if layout.k_block_stride_bytes < k_page:
        raise ValueError(f"k_block_stride_bytes = {layout.k_block_stride_bytes} is smaller than a K page "
                         f"({k_page} bytes)")
    if layout.v_data_section_bytes < packed_codes:
        raise ValueError(f"v_data_section_bytes = {layout.v_data_section_bytes} is smaller than the packed codes "
                         f"of a page ({packed_codes} bytes)")
    if layout.v_block_stride_bytes < layout.v_data_section_bytes + scales:
        raise ValueError(f"v_block_stride_bytes = {layout.v_block_stride_bytes} is smaller than "
                         f"v_data_section_bytes + the scale section ({layout.v_data_section_bytes} + {scales} bytes)")
    return layout


def _slots(slot_mapping: ArrayLike, num_tokens: int, layout: _PageLayout, k_cache: Any,
           v_cache: Any) -> NDArray[np.int64]:
    """The first ``num_tokens`` slots, ``page·B + offset`` (FORMAT.md §4): a negative one is padding, any
    other must lie in a page of the pools (the library's checked mode skips it, its unchecked mode
    writes and reads outside the pools)."""
    num_pages = layout.num_pages(k_cache, v_cache)
    slots = _index_array("slot_mapping", slot_mapping, np.int64).reshape(-1)
    _check_entries("slot_mapping", slots, num_tokens, "num_tokens")
    slots = slots[:num_tokens]
    outside = slots // layout.block_size >= num_pages
    if np.any(outside):
        t = int(np.argmax(outside))
        raise ValueError(f"slot_mapping[{t}] = {slots[t]} is in page {slots[t] // layout.block_size}, outside "
                         f"the pools ({num_pages} pages)")
    return slots


def write_cache(key: ArrayLike, value: ArrayLike, k_cache: NDArray[np.uint8], v_cache: NDArray[np.uint8],
                slot_mapping: ArrayLike, num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
                key_stride: int, value_stride: int, k_scale: float, k_block_stride_bytes: int,
                v_block_stride_bytes: int, v_data_section_bytes: int, bits: int,
                encoder: str = "matched_norm", rotation: bool = False) -> None:
    """``reshape_and_cache``: write ``num_tokens`` token rows into the K and V pools, FORMAT.md §4.
    ``encoder``: the V encoder of `encode_v` (the kernels' ``v_encoder``). ``rotation``: each V head is
    rotated first (FORMAT.md §6) in the fused write's float32 arithmetic, `rotate_f32`, and the rotated
    values are encoded as they are (no bfloat16 rounding in between).

    ``key``/``value``: float32 or bfloat16 arrays read as flat element arrays; token ``t``'s row is
    ``flat[t·key_stride : t·key_stride + n]`` (strides in elements). ``k_cache``/``v_cache``: flat uint8
    pools, edited in place. ``slot_mapping``: int64, ``slot = page·B + offset``; a negative slot writes
    nothing, any other must lie in a page of the pools. Byte addresses (all in bytes):
      K element e:  ``page·k_block_stride_bytes + offset·n + e``                     (§2)
      V group g:    ``page·v_block_stride_bytes + offset·(n·b/8) + g·2b``            (§3)
      V scale g:    ``page·v_block_stride_bytes + v_data_section_bytes + offset·(n/16) + g``  (§3)
    No other byte is touched.
    """
    num_tokens = _u32("num_tokens", num_tokens)
    layout = _checked_layout(block_size, num_kv_heads, head_dim, bits, k_block_stride_bytes, v_block_stride_bytes,
                             v_data_section_bytes)
    n = layout.n
    key_stride = _check_row_stride("key_stride", key_stride, n)
    value_stride = _check_row_stride("value_stride", value_stride, n)
    _check_k_scale(k_scale)
    _check_k_reciprocal(k_scale)
    _check_encoder(encoder)
    _check_rotation(rotation, layout.head_dim)
    slots = _slots(slot_mapping, num_tokens, layout, k_cache, v_cache)
    key_flat = _token_rows("key", key, num_tokens, "key_stride", key_stride, n)
    value_flat = _token_rows("value", value, num_tokens, "value_stride", value_stride, n)
    for t in range(num_tokens):
        slot = int(slots[t])
        if slot < 0:  # padding: write nothing
            continue
        page, offset = divmod(slot, layout.block_size)

        k_start = page * layout.k_block_stride_bytes + offset * n
        k_cache[k_start:k_start + n] = encode_k(key_flat[t * key_stride:t * key_stride + n], k_scale)

        v_row = value_flat[t * value_stride:t * value_stride + n]
        if rotation:
            v_row = rotate_f32(v_row.reshape(layout.num_kv_heads, layout.head_dim), layout.head_dim).reshape(-1)
        data, scales = encode_v(v_row, layout.bits, encoder)
        page_start = page * layout.v_block_stride_bytes
        data_start = page_start + offset * layout.row_data_bytes
        scale_start = page_start + layout.v_data_section_bytes + offset * layout.row_scale_bytes
        v_cache[data_start:data_start + layout.row_data_bytes] = data
        v_cache[scale_start:scale_start + layout.row_scale_bytes] = scales


def _gather_rows(pool: NDArray[np.uint8], starts: NDArray[np.int64], row_bytes: int) -> NDArray[np.uint8]:
    """Rows ``pool[start : start + row_bytes]`` for every start, as a ``[len(starts), row_bytes]`` array."""
    return pool[starts[:, None] + np.arange(row_bytes, dtype=np.int64)]


def dequantize_cache(k_cache: NDArray[np.uint8], v_cache: NDArray[np.uint8], slot_mapping: ArrayLike,
                     num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, k_scale: float,
                     k_block_stride_bytes: int, v_block_stride_bytes: int, v_data_section_bytes: int,
                     bits: int) -> tuple[NDArray, NDArray]:
    """``dequantize``: read ``num_tokens`` slots of the K and V pools back into bfloat16 rows.

    ``k_cache``/``v_cache``: flat uint8 pools, read at the byte addresses of `write_cache`.
    ``slot_mapping``: int64, ``slot = page·B + offset``; a negative slot gives a row of zeros, any
    other must lie in a page of the pools.
    Returns ``(key, value)``, bfloat16 ``[num_tokens, n]`` each (row stride n elements), where
      K element e = ``float(E4M3(K byte e)) · k_scale``                        (`decode_k`, §2)
      V element e = ``level[code e] · float(E4M3(scale byte of group e // 16))``  (`decode_v`, §3.4)
    each product in float32, then rounded to bfloat16 (round to nearest even).
    """
    num_tokens = _u32("num_tokens", num_tokens)
    layout = _checked_layout(block_size, num_kv_heads, head_dim, bits, k_block_stride_bytes, v_block_stride_bytes,
                             v_data_section_bytes)
    _check_k_scale(k_scale)
    slots = _slots(slot_mapping, num_tokens, layout, k_cache, v_cache)
    key = np.zeros((num_tokens, layout.n), dtype=np.float32)
    value = np.zeros((num_tokens, layout.n), dtype=np.float32)
    read = slots >= 0  # negative slots keep their zeros
    if np.any(read):  # (pools of no page may have strides that no int64 address holds)
        pages, offsets = np.divmod(slots[read], layout.block_size)
        k_bytes, v_data, v_scales = _read_rows(k_cache, v_cache, layout, pages, offsets)
        key[read] = decode_k(k_bytes, k_scale)
        value[read] = decode_v(v_data, v_scales, layout.bits)
    return key.astype(ml_dtypes.bfloat16), value.astype(ml_dtypes.bfloat16)


def _read_rows(k_cache: NDArray[np.uint8], v_cache: NDArray[np.uint8], layout: _PageLayout,
               pages: NDArray[np.int64], offsets: NDArray[np.int64]
               ) -> tuple[NDArray[np.uint8], NDArray[np.uint8], NDArray[np.uint8]]:
    """The K bytes ``[R, n]``, V codes ``[R, n·b/8]`` and V scale bytes ``[R, n/16]`` of the rows at
    ``(pages[i], offsets[i])``, from the byte addresses of `write_cache`."""
    v_pages = pages * layout.v_block_stride_bytes
    return (_gather_rows(k_cache, pages * layout.k_block_stride_bytes + offsets * layout.n, layout.n),
            _gather_rows(v_cache, v_pages + offsets * layout.row_data_bytes, layout.row_data_bytes),
            _gather_rows(v_cache, v_pages + layout.v_data_section_bytes + offsets * layout.row_scale_bytes,
                         layout.row_scale_bytes))


def _clamped_seq_lens(seq_lens: ArrayLike, num_seqs: int, table_positions: int) -> NDArray[np.int64]:
    """The first ``num_seqs`` int32 lengths as the kernels read them (decode/ranges.cuh): one below 0 or
    beyond the block table's ``table_positions`` is clamped to that range (the library's checked mode
    reports it as well)."""
    lengths = _index_array("seq_lens", seq_lens, np.int32).reshape(-1)
    _check_entries("seq_lens", lengths, num_seqs, "num_seqs")
    return np.clip(lengths[:num_seqs], 0, table_positions)


def _sink_logits(sinks: ArrayLike, num_q_heads: int) -> NDArray[np.float64]:
    logits = _float_data("sinks", sinks).astype(np.float64).reshape(-1)
    if logits.size != num_q_heads:
        raise ValueError(f"sinks has {logits.size} entries, not num_q_heads = {num_q_heads}")
    return logits


def _attended_pages(tables: NDArray[np.int64], seq: int, table_index: NDArray[np.int64],
                    num_pages: int) -> NDArray[np.int64]:
    """The pages ``tables[seq, table_index]`` of attended positions, each a page of the pools (the
    library's checked mode leaves other ones out of the softmax, its unchecked mode reads outside)."""
    pages = tables[seq, table_index]
    outside = (pages < 0) | (pages >= num_pages)
    if np.any(outside):
        i = int(table_index[np.argmax(outside)])
        raise ValueError(f"block_tables[{seq}][{i}] = {tables[seq, i]} is not a page of the pools "
                         f"({num_pages} pages)")
    return pages


def _sequence_kv(k_cache: NDArray[np.uint8], v_cache: NDArray[np.uint8], layout: _PageLayout,
                 tables: NDArray[np.int64], seq: int, first: int, seq_len: int, num_pages: int,
                 k_scale: float) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Sequence ``seq``'s K and V dequantised as `decode_k`/`decode_v` give them, then float64
    ``[seq_len, H_kv, D]`` indexed by position. Only the attended positions ``first … seq_len − 1`` are
    read; the others stay 0, and their block-table entries need not be pages."""
    positions = np.arange(first, seq_len, dtype=np.int64)
    pages = _attended_pages(tables, seq, positions // layout.block_size, num_pages)
    k_bytes, v_data, v_scales = _read_rows(k_cache, v_cache, layout, pages, positions % layout.block_size)
    shape = (seq_len, layout.num_kv_heads, layout.head_dim)
    k, v = np.zeros(shape), np.zeros(shape)
    k[first:] = decode_k(k_bytes, k_scale).astype(np.float64).reshape(-1, *shape[1:])
    v[first:] = decode_v(v_data, v_scales, layout.bits).astype(np.float64).reshape(-1, *shape[1:])
    return k, v


def _window_start(end: int, sliding_window: int) -> int:
    """The first position that a query row attending the positions before ``end`` attends (§5; 0 = off)."""
    return end - sliding_window if 0 < sliding_window < end else 0


def _attend(q_head: NDArray[np.float64], k: NDArray[np.float64], v: NDArray[np.float64], inv_sqrt_d: float,
            soft_cap: float, sink: float | None, sparse_v_threshold: float) -> tuple[NDArray[np.float64], float]:
    """One query head's output over its attended K and V rows ``[P, D]`` (P > 0), FORMAT.md §5 with the
    options of `paged_decode`, and the natural log of its softmax denominator (the sink's term included)."""
    scores = (k @ q_head) * float(inv_sqrt_d)
    if soft_cap > 0:
        scores = soft_cap * np.tanh(scores / soft_cap)
    top = scores.max() if sink is None else max(scores.max(), sink)
    weights = np.exp(scores - top)
    denominator = weights.sum() + (0.0 if sink is None else np.exp(sink - top))
    keep = np.ones(len(scores), dtype=bool)
    if sparse_v_threshold > 0:
        running_max = np.maximum.accumulate(scores)
        keep = np.exp(scores - running_max) > sparse_v_threshold
    return (weights[keep] @ v[keep]) / denominator, float(top + np.log(denominator))


def paged_decode(q: ArrayLike, k_cache: NDArray[np.uint8], v_cache: NDArray[np.uint8], block_tables: ArrayLike,
                 seq_lens: ArrayLike, max_blocks_per_seq: int, num_seqs: int, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, inv_sqrt_d: float, k_scale: float,
                 q_stride: int, v_block_stride_bytes: int, v_data_section_bytes: int, sliding_window: int,
                 bits: int, k_block_stride_bytes: int | None = None,
                 sparse_v_threshold: float = 0.0, *, query_start: ArrayLike | None = None,
                 sinks: ArrayLike | None = None, soft_cap: float = 0.0,
                 rotation: bool = False) -> NDArray[np.float64]:
    """Paged decode attention over the cache, FORMAT.md §5, in float64. Returns ``[R, num_q_heads, D]``:
    R = ``num_seqs`` query rows, or ``query_start[-1]`` with ``query_start``.

    ``q``: float32/bfloat16, query row ``r`` head ``h`` at flat element ``r·q_stride + h·D`` (row ``r`` =
    sequence ``r`` without ``query_start``).
    ``block_tables``: ``[num_seqs][max_blocks_per_seq]`` page ids; position ``p`` lives in page
    ``block_tables[s, p // B]`` at offset ``p % B``; the entries of attended positions must be pages of
    the pools. ``seq_lens``: a length below 0 or beyond the table (``max_blocks_per_seq · B``) is
    clamped to it, as the kernels clamp it. ``k_block_stride_bytes``: None or 0 is packed, ``B·n``.
    K and V are dequantised exactly as `decode_k`/`decode_v` (float32), then cast to float64.
    Query head ``h`` uses KV head ``h // G``; a query row attends positions ``[start, end)``: for one
    query per sequence ``end = L`` (``seq_lens[s]``), ``start = end − W`` when ``0 < W < end``, else 0;
    ``score_p = (q · k_p) · inv_sqrt_d``; an empty range gives zeros.

    Options (off by default; the original's semantics then):

    - ``query_start`` (multi-token decode, for speculative and chunked decode): int ``[num_seqs + 1]``,
      non-decreasing from 0; sequence ``s`` owns query rows ``query_start[s] … query_start[s+1] − 1``,
      ``q_len = query_start[s+1] − query_start[s]`` ≤ ``L``. Its token ``i`` (row ``query_start[s] + i``)
      is the sequence's position ``L − q_len + i``, so it attends ``end = L − q_len + i + 1`` (causal
      inside the chunk), with the window counted back from that ``end``.
    - ``soft_cap`` (> 0): logit soft-capping, ``score_p ← cap · tanh(score_p / cap)``.
    - ``sinks``: float ``[num_q_heads]``, one learned logit per query head that joins the softmax
      denominator only: ``out = Σ_p e^(score_p − m)·v_p / (Σ_p e^(score_p − m) + e^(sink_h − m))``.
    - ``rotation``: V was written rotated (`write_cache` ``rotation``); each output head is rotated
      back, `unrotate` (attention is linear in V, FORMAT.md §6).

    Sparse V (``sparse_v_threshold`` τ > 0): positions are visited in order, ``m`` is the maximum score
    seen so far including ``p``; the V row of ``p`` is skipped when ``exp(score_p − m) ≤ τ`` but ``p``
    stays in the denominator ``Σ exp(score_p − M)`` (``M`` = final maximum). Since ``m ≤ M``, a skipped
    row has ``exp(score_p − M) ≤ τ``, so ``‖out_τ − out_0‖ ≤ Σ_{p: exp(score_p − M) ≤ τ} softmax_p·‖v_p‖``.
    """
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, max_blocks_per_seq, num_seqs, num_q_heads,
                            num_kv_heads, head_dim, block_size, inv_sqrt_d, k_scale, q_stride, v_block_stride_bytes,
                            v_data_section_bytes, sliding_window, bits, k_block_stride_bytes, sparse_v_threshold,
                            query_start=query_start, sinks=sinks, soft_cap=soft_cap, rotation=rotation)[0]


def paged_prefill(q: ArrayLike, k_cache: NDArray[np.uint8], v_cache: NDArray[np.uint8], block_tables: ArrayLike,
                  seq_lens: ArrayLike, query_start: ArrayLike, max_blocks_per_seq: int, num_seqs: int,
                  num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, inv_sqrt_d: float,
                  k_scale: float, q_stride: int, v_block_stride_bytes: int, v_data_section_bytes: int,
                  sliding_window: int, bits: int, k_block_stride_bytes: int | None = None, *,
                  sinks: ArrayLike | None = None, soft_cap: float = 0.0,
                  rotation: bool = False) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Paged prefill attention over the cache (chunked prefill, long verify), in float64: `paged_decode`
    with ``query_start`` (required; any chunk length up to ``seq_len``) and exact V (no sparse-V
    threshold). Sequence ``s``'s chunk is its last ``q_len`` positions, already in the cache: its token ``i``
    attends the positions before ``seq_len − q_len + i + 1`` (causal inside the chunk and over the cached
    prefix), with the sliding window counted back from there.

    Returns ``(out, lse)``: ``out`` ``[R, num_q_heads, D]`` as `paged_decode`'s, and ``lse``
    ``[R, num_q_heads]``, the natural log of each row's softmax denominator,
    ``log(Σ_p e^(score_p) + e^(sink_h))`` (so ``out = Σ_p e^(score_p − lse)·v_p``; the sink term only with
    ``sinks``), for merging with another attention over other positions; ``−inf`` for a row with no
    position to attend (its output zeros).
    """
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, max_blocks_per_seq, num_seqs, num_q_heads,
                            num_kv_heads, head_dim, block_size, inv_sqrt_d, k_scale, q_stride, v_block_stride_bytes,
                            v_data_section_bytes, sliding_window, bits, k_block_stride_bytes, 0.0,
                            query_start=query_start, sinks=sinks, soft_cap=soft_cap, rotation=rotation)


def _paged_attention(q: ArrayLike, k_cache: NDArray[np.uint8], v_cache: NDArray[np.uint8], block_tables: ArrayLike,
                     seq_lens: ArrayLike, max_blocks_per_seq: int, num_seqs: int, num_q_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int, inv_sqrt_d: float, k_scale: float,
                     q_stride: int, v_block_stride_bytes: int, v_data_section_bytes: int, sliding_window: int,
                     bits: int, k_block_stride_bytes: int | None, sparse_v_threshold: float, *,
                     query_start: ArrayLike | None, sinks: ArrayLike | None, soft_cap: float,
                     rotation: bool) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """`paged_decode`'s and `paged_prefill`'s attention: the outputs and the rows' log-denominators."""
    packed = k_block_stride_bytes is None or _scalars.unsigned("k_block_stride_bytes", k_block_stride_bytes,
                                                                U64_MAX) == 0
    if packed:  # as 0 in the C params
        k_block_stride_bytes = k_page_bytes(block_size, num_kv_heads, head_dim)
    layout = _checked_layout(block_size, num_kv_heads, head_dim, bits, k_block_stride_bytes, v_block_stride_bytes,
                             v_data_section_bytes)
    num_seqs = _u32("num_seqs", num_seqs)
    num_q_heads = _check_q_heads(num_q_heads, layout.num_kv_heads)
    _check_rotation(rotation, layout.head_dim)
    max_blocks_per_seq = _check_table_width(max_blocks_per_seq, layout.block_size)
    q_stride = _check_q_stride(q_stride, num_q_heads * layout.head_dim)
    sliding_window = _u32("sliding_window", sliding_window)
    _check_k_scale(k_scale)
    _check_score_scale(inv_sqrt_d, k_scale)
    _check_finite_non_negative("sparse_v_threshold", sparse_v_threshold)
    _check_finite_non_negative("soft_cap", soft_cap)

    tables = _block_tables(block_tables, num_seqs, max_blocks_per_seq)
    lengths = _clamped_seq_lens(seq_lens, num_seqs, max_blocks_per_seq * layout.block_size)
    starts = _query_starts(query_start, lengths, num_seqs)
    num_rows, head_dim = int(starts[-1]), layout.head_dim
    q_flat = _token_rows("q", q, num_rows, "q_stride", q_stride, num_q_heads * head_dim)
    sink_logits = None if sinks is None else _sink_logits(sinks, num_q_heads)
    num_pages = layout.num_pages(k_cache, v_cache)
    group_size = num_q_heads // layout.num_kv_heads
    out = np.zeros((num_rows, num_q_heads, head_dim), dtype=np.float64)
    lse = np.full((num_rows, num_q_heads), -np.inf)
    for s in range(num_seqs):
        seq_len = int(lengths[s])
        q_len = int(starts[s + 1] - starts[s])
        if seq_len == 0 or q_len == 0:
            continue
        first = _window_start(seq_len - q_len + 1, sliding_window)  # of the sequence's first query row
        k, v = _sequence_kv(k_cache, v_cache, layout, tables, s, first, seq_len, num_pages, k_scale)
        for i in range(q_len):
            row = int(starts[s]) + i
            end = seq_len - q_len + i + 1
            start = _window_start(end, sliding_window)
            for h in range(num_q_heads):
                kv_head = h // group_size
                q_start = row * q_stride + h * head_dim
                q_head = q_flat[q_start:q_start + head_dim].astype(np.float64)
                sink = None if sink_logits is None else sink_logits[h]
                out[row, h], lse[row, h] = _attend(q_head, k[start:end, kv_head, :], v[start:end, kv_head, :],
                                                   inv_sqrt_d, soft_cap, sink, sparse_v_threshold)
    return (unrotate(out, head_dim) if rotation else out), lse


def _query_starts(query_start: ArrayLike | None, seq_lens: NDArray[np.int64], num_seqs: int) -> NDArray[np.int64]:
    """``query_start`` (int32) checked (non-decreasing from 0, ``q_len ≤ seq_len``), or one query per
    sequence; ``seq_lens``: the clamped lengths of the ``num_seqs`` sequences."""
    if query_start is None:
        return np.arange(num_seqs + 1, dtype=np.int64)
    starts = _index_array("query_start", query_start, np.int32).reshape(-1)
    if starts.shape != (num_seqs + 1,) or starts[0] != 0 or np.any(np.diff(starts) < 0):
        raise ValueError(f"query_start must be non-decreasing from 0 with num_seqs + 1 = {num_seqs + 1} entries")
    if np.any(np.diff(starts) > seq_lens):
        raise ValueError("a sequence has more query tokens (query_start) than positions (seq_lens)")
    return starts
