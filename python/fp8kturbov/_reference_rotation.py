"""The NumPy reference's optional V rotation (FORMAT.md §6): the sign vectors, the Hadamard matrix,
the rotation in float64 and in the fused write's float32 arithmetic. `reference` exports it."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._limits import ROTATION_HEAD_DIMS
from ._reference_args import _check_rotation_dim

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
