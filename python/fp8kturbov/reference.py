"""Bit-exact NumPy reference of the fp8k_turbo{2,3,4}v paged KV-cache format.

Every rule here is a transcription of ``docs/format.md`` (the contract shared with the original
engine); each function names the section it implements. The code is written to be read: all encoder arithmetic is done in float32 with
separate numpy operations (no fused multiply-add) and with the sums taken sequentially over the 16
elements of a group, exactly as FORMAT.md §3.2 prescribes; attention (§5) is done in float64.

Units: sizes and strides named ``*_bytes`` are bytes; ``key_stride``, ``value_stride`` and ``q_stride``
are elements; ``n = num_kv_heads * head_dim`` is the number of elements in one token row.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._limits import ROTATION_HEAD_DIMS

__all__ = [
    "BOUNDS", "CODEBOOKS", "E4M3_MAX", "GROUP_ELEMS", "LEVEL_MAX",
    "k_page_bytes", "v_data_section_bytes", "v_scale_section_bytes", "v_page_bytes", "v_group_bytes",
    "e4m3_encode", "e4m3_decode", "encode_k", "decode_k", "pack_codes", "unpack_codes",
    "encode_v", "decode_v", "write_cache", "dequantize_cache", "paged_decode",
    "V_ENCODERS", "MSE_CANDIDATE_BYTES", "ROTATION_DIMS", "rotation_signs", "hadamard", "rotate", "unrotate",
]

GROUP_ELEMS = 16
"""Elements per V group (one scale byte each), FORMAT.md §3."""
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


def _check_bits(bits: int) -> None:
    if bits not in CODEBOOKS:
        raise ValueError(f"V bits must be 2, 3 or 4, got {bits}")


def _check_head_dim(head_dim: int) -> None:
    if head_dim <= 0 or head_dim % GROUP_ELEMS != 0:
        raise ValueError(f"head_dim must be a positive multiple of {GROUP_ELEMS}, got {head_dim}")


# ---------------------------------------------------------------------------------------------------
# Sizes (FORMAT.md §2, §3). All results are bytes.
# ---------------------------------------------------------------------------------------------------
def k_page_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Packed K page, bytes: ``B·n`` (one E4M3 byte per element), FORMAT.md §2."""
    _check_head_dim(head_dim)
    return block_size * num_kv_heads * head_dim


def v_data_section_bytes(block_size: int, num_kv_heads: int, head_dim: int, bits: int) -> int:
    """Packed V data section, bytes: ``B·n·b/8``, FORMAT.md §3."""
    _check_head_dim(head_dim)
    _check_bits(bits)
    return block_size * num_kv_heads * head_dim * bits // 8


def v_scale_section_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """V scale section, bytes: ``B·n/16`` (one E4M3 byte per 16-element group), FORMAT.md §3."""
    _check_head_dim(head_dim)
    return block_size * num_kv_heads * head_dim // GROUP_ELEMS


def v_page_bytes(block_size: int, num_kv_heads: int, head_dim: int, bits: int) -> int:
    """Packed V page, bytes: data section + scale section = ``(2b+1)·B·n/16``, FORMAT.md §3."""
    return (v_data_section_bytes(block_size, num_kv_heads, head_dim, bits)
            + v_scale_section_bytes(block_size, num_kv_heads, head_dim))


def v_group_bytes(bits: int) -> int:
    """Packed codes of one 16-element group, bytes: ``2b`` (8, 6, 4), FORMAT.md §3."""
    _check_bits(bits)
    return 2 * bits


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
    return np.asarray(b, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def encode_k(x: ArrayLike, k_scale: float) -> NDArray[np.uint8]:
    """K bytes of float32/bfloat16 values, any shape: ``E4M3(x · (1.0f / k_scale))``, FORMAT.md §2."""
    inv = np.float32(1.0) / np.float32(k_scale)  # once, in float32; then a multiply per element
    return e4m3_encode(np.asarray(x).astype(np.float32) * inv)


def decode_k(b: ArrayLike, k_scale: float) -> NDArray[np.float32]:
    """Float32 K values of K bytes: ``float(E4M3(byte)) · k_scale``, FORMAT.md §2."""
    return e4m3_decode(b) * np.float32(k_scale)


# ---------------------------------------------------------------------------------------------------
# V codes, packing and the matched-norm encoder (FORMAT.md §3)
# ---------------------------------------------------------------------------------------------------
def pack_codes(codes: ArrayLike, bits: int) -> NDArray[np.uint8]:
    """Pack b-bit codes ``[..., n]`` (n % 16 == 0, elements) into bytes ``[..., n·b/8]``, FORMAT.md §3.3.

    Groups are packed back to back, so the packing is applied along the whole last axis.
    """
    _check_bits(bits)
    c = np.asarray(codes).astype(np.uint8)
    n = c.shape[-1]
    if n % GROUP_ELEMS != 0:
        raise ValueError(f"last axis must be a multiple of {GROUP_ELEMS} codes, got {n}")
    if np.any(c >= (1 << bits)):
        raise ValueError(f"codes must be < {1 << bits} for {bits}-bit packing")
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
    _check_bits(bits)
    d = np.asarray(data, dtype=np.uint8)
    m = d.shape[-1]
    if m % v_group_bytes(bits) != 0:
        raise ValueError(f"last axis must be a multiple of {v_group_bytes(bits)} bytes, got {m}")
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
    ``encoder="mse"`` selects `_encode_v_mse_groups` (same byte format, same decoder; never the default).
    """
    _check_bits(bits)
    if encoder not in V_ENCODERS:
        raise ValueError(f"encoder must be one of {', '.join(V_ENCODERS)}, got {encoder!r}")
    x = np.asarray(x).astype(np.float32)
    n = x.shape[-1]
    if n % GROUP_ELEMS != 0:
        raise ValueError(f"last axis must be a multiple of {GROUP_ELEMS} elements, got {n}")
    xg = x.reshape(*x.shape[:-1], n // GROUP_ELEMS, GROUP_ELEMS)
    if encoder == "mse":
        codes, scale_bytes = _encode_v_mse_groups(xg.reshape(-1, GROUP_ELEMS), bits)
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
    scale = e4m3_decode(scales)
    n = codes.shape[-1]
    if scale.shape[-1] * GROUP_ELEMS != n:
        raise ValueError(f"{n} codes need {n // GROUP_ELEMS} scale bytes, got {scale.shape[-1]}")
    values = CODEBOOKS[bits][codes].reshape(*codes.shape[:-1], n // GROUP_ELEMS, GROUP_ELEMS)
    return (values * scale[..., None]).reshape(codes.shape)


# ---------------------------------------------------------------------------------------------------
# The MSE-optimal V encoder (an option allowed by FORMAT.md §3.2; same bytes format, same decoder)
# ---------------------------------------------------------------------------------------------------
V_ENCODERS = ("matched_norm", "mse")
"""Values of `encode_v`'s ``encoder``; the first is the default (FORMAT.md §3.2)."""
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
# The optional rotation (FORMAT.md §6)
# ---------------------------------------------------------------------------------------------------
ROTATION_DIMS = ROTATION_HEAD_DIMS
"""Head dims with fixed rotation signs, FORMAT.md §6 (the signs below)."""
_SIGN_WORDS: dict[str, tuple[int, ...]] = {
    "S1_128": (0x42F85949E46A0359, 0x49F250A9A4C63BBB),
    "S2_128": (0x3F628FDC16ACEE90, 0xBEA56562B7A5357A),
    "S1_256": (0xFE5483E8C028BDDD, 0x9A94A01800B54509, 0xDBBF19A357DE2FF8, 0xEBDA40343AFE2DC7),
    "S2_256": (0x7682761DE85431D9, 0x8A4336C9A7532CC2, 0x65C15681E40C84FD, 0x4B75DB54555AACC1),
    "S2_512": (0x5B0E056556746A09, 0x33754D8471316A21, 0x491196087363B6E8, 0x74E09D969DFA1143,
               0xD49B9E8DFD26399E, 0x3E65CA562BF53DB5, 0xAD67A2B67F01D99C, 0x3A6CBE9800803A7B),
}
_SIGN_WORDS["S1_512"] = _SIGN_WORDS["S1_256"] + _SIGN_WORDS["S2_256"]


def _check_rotation_dim(head_dim: int) -> None:
    if head_dim not in ROTATION_DIMS:
        raise ValueError(f"the rotation is defined for head_dim {ROTATION_DIMS}, got {head_dim}")


def rotation_signs(head_dim: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``(S1, S2)`` as float64 ±1 vectors of length ``head_dim``, FORMAT.md §6 (bit i set ⇔ −1)."""
    _check_rotation_dim(head_dim)
    out = []
    for name in ("S1", "S2"):
        words = _SIGN_WORDS[f"{name}_{head_dim}"]
        bits = [(words[i // 64] >> (i % 64)) & 1 for i in range(head_dim)]
        out.append(np.where(np.array(bits) == 1, -1.0, 1.0))
    return out[0], out[1]


def hadamard(n: int) -> NDArray[np.float64]:
    """Sylvester Hadamard matrix ``H[i][j] = (−1)^popcount(i & j)``, float64 ``[n, n]`` (n a power of 2)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"n must be a power of two, got {n}")
    i = np.arange(n, dtype=np.int64)
    anded = i[:, None] & i[None, :]
    parity = np.zeros_like(anded)
    while np.any(anded):
        parity ^= anded & 1
        anded >>= 1
    return np.where(parity == 1, -1.0, 1.0)


def rotate(x: ArrayLike, head_dim: int) -> NDArray[np.float64]:
    """``y = S2 · (H/√D) · S1 · x`` over the last axis (``head_dim`` elements, one head), FORMAT.md §6.

    Computed in float64 (a matrix product, so no bit-exactness is claimed); returns float64.
    """
    s1, s2 = rotation_signs(head_dim)
    x = np.asarray(x).astype(np.float64)
    if x.shape[-1] != head_dim:
        raise ValueError(f"last axis must be head_dim = {head_dim}, got {x.shape[-1]}")
    return ((x * s1) @ hadamard(head_dim)) / np.sqrt(head_dim) * s2


def unrotate(y: ArrayLike, head_dim: int) -> NDArray[np.float64]:
    """Inverse of `rotate`: ``x = S1 · (H/√D) · S2 · y`` over the last axis, in float64."""
    s1, s2 = rotation_signs(head_dim)
    y = np.asarray(y).astype(np.float64)
    if y.shape[-1] != head_dim:
        raise ValueError(f"last axis must be head_dim = {head_dim}, got {y.shape[-1]}")
    return ((y * s2) @ hadamard(head_dim)) / np.sqrt(head_dim) * s1


def _fwht_f32(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """Unnormalised Walsh–Hadamard transform over the last axis in float32: stages over the index bits
    0, 1, …, log2(n) − 1 in that order, each mapping the pair ``(i, i + 2^k)`` (bit k of i clear) to
    ``(a + b, a − b)``, every sum rounded to float32."""
    n = x.shape[-1]
    y = x.astype(np.float32).copy()
    half = 1
    with np.errstate(invalid="ignore", over="ignore"):  # Inf − Inf is NaN, as on the GPU
        while half < n:
            pairs = y.reshape(*y.shape[:-1], n // (2 * half), 2, half)
            a, b = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
            pairs[..., 0, :] = a + b
            pairs[..., 1, :] = a - b
            half *= 2
    return y


def rotate_f32(x: ArrayLike, head_dim: int) -> NDArray[np.float32]:
    """`rotate` in the float32 arithmetic of the fused write (``rotation`` of the write params), bit
    for bit: ``x`` as float32 times S1 (exact), `_fwht_f32`, times ``float32(1/√D)``, times S2 (exact).
    Differs from `rotate` by float32 rounding only."""
    s1, s2 = rotation_signs(head_dim)
    x = np.asarray(x).astype(np.float32)
    if x.shape[-1] != head_dim:
        raise ValueError(f"last axis must be head_dim = {head_dim}, got {x.shape[-1]}")
    return _fwht_f32(x * s1.astype(np.float32)) * np.float32(1.0 / np.sqrt(head_dim)) * s2.astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# Cache write (FORMAT.md §4), its inverse, and paged decode attention (FORMAT.md §5)
# ---------------------------------------------------------------------------------------------------
def _check_layout(block_size: int, num_kv_heads: int, head_dim: int, bits: int, k_block_stride_bytes: int,
                  v_block_stride_bytes: int, data_section_bytes: int) -> None:
    """Reject page layouts smaller than the packed ones of FORMAT.md §2/§3 (pages would overlap)."""
    _check_head_dim(head_dim)
    _check_bits(bits)
    k_min = k_page_bytes(block_size, num_kv_heads, head_dim)
    data_min = v_data_section_bytes(block_size, num_kv_heads, head_dim, bits)
    scale_bytes = v_scale_section_bytes(block_size, num_kv_heads, head_dim)
    if k_block_stride_bytes < k_min:
        raise ValueError(f"k_block_stride_bytes {k_block_stride_bytes} < B·n = {k_min}")
    if data_section_bytes < data_min:
        raise ValueError(f"v_data_section_bytes {data_section_bytes} < B·n·b/8 = {data_min}")
    if v_block_stride_bytes < data_section_bytes + scale_bytes:
        raise ValueError(f"v_block_stride_bytes {v_block_stride_bytes} < "
                         f"v_data_section_bytes + B·n/16 = {data_section_bytes + scale_bytes}")


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
    nothing. Byte addresses (all in bytes):
      K element e:  ``page·k_block_stride_bytes + offset·n + e``                     (§2)
      V group g:    ``page·v_block_stride_bytes + offset·(n·b/8) + g·2b``            (§3)
      V scale g:    ``page·v_block_stride_bytes + v_data_section_bytes + offset·(n/16) + g``  (§3)
    No other byte is touched.
    """
    _check_layout(block_size, num_kv_heads, head_dim, bits, k_block_stride_bytes, v_block_stride_bytes,
                  v_data_section_bytes)
    n = num_kv_heads * head_dim
    row_data_bytes = n * bits // 8
    row_scale_bytes = n // GROUP_ELEMS
    key_flat = np.asarray(key).reshape(-1)
    value_flat = np.asarray(value).reshape(-1)
    slots = np.asarray(slot_mapping, dtype=np.int64)
    for t in range(num_tokens):
        slot = int(slots[t])
        if slot < 0:  # padding: write nothing
            continue
        page, offset = divmod(slot, block_size)

        k_start = page * k_block_stride_bytes + offset * n
        k_cache[k_start:k_start + n] = encode_k(key_flat[t * key_stride:t * key_stride + n], k_scale)

        v_row = value_flat[t * value_stride:t * value_stride + n]
        if rotation:
            v_row = rotate_f32(v_row.reshape(num_kv_heads, head_dim), head_dim).reshape(-1)
        data, scales = encode_v(v_row, bits, encoder)
        page_start = page * v_block_stride_bytes
        data_start = page_start + offset * row_data_bytes
        scale_start = page_start + v_data_section_bytes + offset * row_scale_bytes
        v_cache[data_start:data_start + row_data_bytes] = data
        v_cache[scale_start:scale_start + row_scale_bytes] = scales


def _gather_rows(pool: NDArray[np.uint8], starts: NDArray[np.int64], row_bytes: int) -> NDArray[np.uint8]:
    """Rows ``pool[start : start + row_bytes]`` for every start, as a ``[len(starts), row_bytes]`` array."""
    return pool[starts[:, None] + np.arange(row_bytes, dtype=np.int64)]


def dequantize_cache(k_cache: NDArray[np.uint8], v_cache: NDArray[np.uint8], slot_mapping: ArrayLike,
                     num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, k_scale: float,
                     k_block_stride_bytes: int, v_block_stride_bytes: int, v_data_section_bytes: int,
                     bits: int) -> tuple[NDArray, NDArray]:
    """``dequantize``: read ``num_tokens`` slots of the K and V pools back into bfloat16 rows.

    ``k_cache``/``v_cache``: flat uint8 pools, read at the byte addresses of `write_cache`.
    ``slot_mapping``: int64, ``slot = page·B + offset``; a negative slot gives a row of zeros.
    Returns ``(key, value)``, bfloat16 ``[num_tokens, n]`` each (row stride n elements), where
      K element e = ``float(E4M3(K byte e)) · k_scale``                        (`decode_k`, §2)
      V element e = ``level[code e] · float(E4M3(scale byte of group e // 16))``  (`decode_v`, §3.4)
    each product in float32, then rounded to bfloat16 (round to nearest even).
    """
    _check_layout(block_size, num_kv_heads, head_dim, bits, k_block_stride_bytes, v_block_stride_bytes,
                  v_data_section_bytes)
    n = num_kv_heads * head_dim
    key = np.zeros((num_tokens, n), dtype=np.float32)
    value = np.zeros((num_tokens, n), dtype=np.float32)
    slots = np.asarray(slot_mapping, dtype=np.int64)[:num_tokens]
    read = slots >= 0  # negative slots keep their zeros
    pages, offsets = np.divmod(slots[read], block_size)
    k_bytes, v_data, v_scales = _read_rows(k_cache, v_cache, pages, offsets, n, bits, k_block_stride_bytes,
                                           v_block_stride_bytes, v_data_section_bytes)
    key[read] = decode_k(k_bytes, k_scale)
    value[read] = decode_v(v_data, v_scales, bits)
    return key.astype(ml_dtypes.bfloat16), value.astype(ml_dtypes.bfloat16)


def _read_rows(k_cache: NDArray[np.uint8], v_cache: NDArray[np.uint8], pages: NDArray[np.int64],
               offsets: NDArray[np.int64], n: int, bits: int, k_block_stride_bytes: int,
               v_block_stride_bytes: int, v_data_section_bytes: int
               ) -> tuple[NDArray[np.uint8], NDArray[np.uint8], NDArray[np.uint8]]:
    """The K bytes ``[R, n]``, V codes ``[R, n·b/8]`` and V scale bytes ``[R, n/16]`` of the rows at
    ``(pages[i], offsets[i])``, from the byte addresses of `write_cache`."""
    row_data_bytes = n * bits // 8
    row_scale_bytes = n // GROUP_ELEMS
    v_pages = pages * v_block_stride_bytes
    return (_gather_rows(k_cache, pages * k_block_stride_bytes + offsets * n, n),
            _gather_rows(v_cache, v_pages + offsets * row_data_bytes, row_data_bytes),
            _gather_rows(v_cache, v_pages + v_data_section_bytes + offsets * row_scale_bytes, row_scale_bytes))


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
    ``block_tables[s, p // B]`` at offset ``p % B``. ``k_block_stride_bytes`` defaults to ``B·n``.
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
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    n = num_kv_heads * head_dim
    if k_block_stride_bytes is None:
        k_block_stride_bytes = block_size * n
    _check_layout(block_size, num_kv_heads, head_dim, bits, k_block_stride_bytes, v_block_stride_bytes,
                  v_data_section_bytes)
    if not soft_cap >= 0:
        raise ValueError(f"soft_cap {soft_cap} must be >= 0")
    starts = _query_starts(query_start, seq_lens, num_seqs)
    sink_logits = None if sinks is None else np.asarray(sinks, dtype=np.float64).reshape(num_q_heads)
    group_size = num_q_heads // num_kv_heads
    q_flat = np.asarray(q).reshape(-1)
    tables = np.asarray(block_tables, dtype=np.int64).reshape(num_seqs, max_blocks_per_seq)
    out = np.zeros((int(starts[-1]), num_q_heads, head_dim), dtype=np.float64)
    for s in range(num_seqs):
        seq_len = int(seq_lens[s])
        q_len = int(starts[s + 1] - starts[s])
        if seq_len == 0 or q_len == 0:
            continue
        positions = np.arange(seq_len, dtype=np.int64)
        pages = tables[s, positions // block_size]
        offsets = positions % block_size

        k_bytes, v_data, v_scales = _read_rows(k_cache, v_cache, pages, offsets, n, bits, k_block_stride_bytes,
                                               v_block_stride_bytes, v_data_section_bytes)
        k = decode_k(k_bytes, k_scale).astype(np.float64).reshape(-1, num_kv_heads, head_dim)
        v = decode_v(v_data, v_scales, bits).astype(np.float64).reshape(-1, num_kv_heads, head_dim)

        for i in range(q_len):
            row = int(starts[s]) + i
            end = seq_len - q_len + i + 1
            start = end - sliding_window if 0 < sliding_window < end else 0
            for h in range(num_q_heads):
                kv_head = h // group_size
                q_start = row * q_stride + h * head_dim
                q_head = q_flat[q_start:q_start + head_dim].astype(np.float64)
                scores = (k[start:end, kv_head, :] @ q_head) * float(inv_sqrt_d)
                if soft_cap > 0:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                top = scores.max() if sink_logits is None else max(scores.max(), sink_logits[h])
                weights = np.exp(scores - top)
                denominator = weights.sum() + (0.0 if sink_logits is None else np.exp(sink_logits[h] - top))
                keep = np.ones(len(scores), dtype=bool)
                if sparse_v_threshold > 0:
                    running_max = np.maximum.accumulate(scores)
                    keep = np.exp(scores - running_max) > sparse_v_threshold
                out[row, h] = (weights[keep] @ v[start:end][keep, kv_head, :]) / denominator
    return unrotate(out, head_dim) if rotation else out


def _query_starts(query_start: ArrayLike | None, seq_lens: ArrayLike, num_seqs: int) -> NDArray[np.int64]:
    """``query_start`` checked (non-decreasing from 0, ``q_len ≤ seq_len``), or one query per sequence."""
    if query_start is None:
        return np.arange(num_seqs + 1, dtype=np.int64)
    starts = np.asarray(query_start, dtype=np.int64).reshape(-1)
    if starts.shape != (num_seqs + 1,) or starts[0] != 0 or np.any(np.diff(starts) < 0):
        raise ValueError(f"query_start must be non-decreasing from 0 with num_seqs + 1 = {num_seqs + 1} entries")
    lengths = np.asarray(seq_lens, dtype=np.int64)[:num_seqs]
    if np.any(np.diff(starts) > lengths):
        raise ValueError("a sequence has more query tokens (query_start) than positions (seq_lens)")
    return starts
