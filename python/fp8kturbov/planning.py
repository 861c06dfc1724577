"""Planning an engine's cache: the K scale from sample keys, and how many tokens a budget holds.

Units: ``*_bytes`` and ``budget_bytes`` are bytes; ``head_dim`` is elements; ``block_size`` is
tokens per page; token counts are tokens. Cache sizes of the fp8k_turbo formats come from the
library's own size functions (through `CacheLayout`), so C and Python cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._scalars import integer
from .layout import CacheLayout

__all__ = ["FORMATS", "ZERO_K_SCALE", "MIN_K_SCALE", "CapacityPlan", "bytes_per_token",
           "calibrate_k_scale", "capacity_table", "page_bytes", "tokens_that_fit"]

E4M3_MAX = 448.0
#: The scale `calibrate_k_scale` returns for all-zero keys: any positive scale stores zeros
#: exactly, and 1.0 keeps later keys up to ±448 representable.
ZERO_K_SCALE = 1.0
#: The smallest scale `calibrate_k_scale` returns (the smallest normal float32, 2^-126): the
#: write computes ``1.0f / k_scale`` in float32, which must stay finite.
MIN_K_SCALE = 2.0 ** -126
_F32_MAX = float(np.finfo(np.float32).max)

#: Cache formats compared by the planner: V bits of the fp8k_turbo formats, None for dense ones.
FORMATS: dict[str, int | None] = {
    "bf16": None, "fp8": None, "fp8k_turbo2v": 2, "fp8k_turbo3v": 3, "fp8k_turbo4v": 4}
#: Bytes per element of K (and of V) in the dense formats.
_DENSE_ELEMENT_BYTES = {"bf16": 2, "fp8": 1}


def _as_array(keys: Any) -> np.ndarray:
    """``keys`` as a NumPy array; objects NumPy cannot view directly (a torch bf16 tensor) are
    converted through their ``float()`` method first."""
    try:
        return np.asarray(keys)
    except (TypeError, RuntimeError):
        to_float = getattr(keys, "float", None)
        if to_float is None:
            raise
        return np.asarray(to_float())


def calibrate_k_scale(keys: Any, percentile: float | None = None) -> float:
    """The per-tensor K scale for ``keys``: ``max |keys| / 448`` (so the largest key maps to the
    largest E4M3 value), or with ``percentile`` (0 < p <= 100) the p-th percentile of ``|keys|``
    (NumPy's linear interpolation) over 448: keys above it saturate to ±448 · scale.

    ``keys``: any array-like of keys (float32, float64, ml_dtypes bfloat16, a CPU torch tensor or
    anything with ``__array__``), any shape; a sample of an engine's keys is enough.
    Returns a Python float (the ``k_scale`` argument of the write and decode calls):
    ``ZERO_K_SCALE`` (1.0) when every key is zero; when the percentile is zero but some key is not,
    the max-based scale; never below ``MIN_K_SCALE``.
    Raises ValueError for empty input, a percentile out of range, keys holding NaN or ±inf (the
    scale would not be finite), or a scale beyond float32.
    """
    values = _as_array(keys)
    if values.size == 0:
        raise ValueError("calibrate_k_scale: keys is empty")
    if percentile is not None and not 0 < percentile <= 100:
        raise ValueError(f"calibrate_k_scale: percentile = {percentile} is not in (0, 100]")
    magnitudes = np.abs(values.astype(np.float64).reshape(-1))
    amax = float(magnitudes.max())
    if not math.isfinite(amax):
        raise ValueError("calibrate_k_scale: the keys hold NaN or ±inf")
    if amax == 0:
        return ZERO_K_SCALE
    level = amax if percentile is None else float(np.percentile(magnitudes, percentile))
    scale = (level if level > 0 else amax) / E4M3_MAX
    if scale > _F32_MAX:
        raise ValueError(f"calibrate_k_scale: the scale {scale:g} overflows float32")
    return max(scale, MIN_K_SCALE)


def _check_format(fmt: str) -> int | None:
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def _count(name: str, value: int, least: int = 1) -> int:
    """``value`` as a Python int (NumPy integers too: their arithmetic would wrap) of at least
    ``least``."""
    number = integer(value)
    if number is None or number < least:
        raise ValueError(f"{name} = {value!r} is not an integer >= {least}")
    return number


def page_bytes(num_kv_heads: int, head_dim: int, fmt: str, block_size: int = 16) -> int:
    """Bytes of one page of ``block_size`` tokens of one layer, K and V together, all KV heads.

    Dense formats: ``2 · block_size · num_kv_heads · head_dim · element bytes`` (2 for bf16, 1
    for fp8). fp8k_turbo formats: the library's packed K and V page sizes (docs/format.md §2, §3;
    ``head_dim`` must be a multiple of 16).
    """
    bits = _check_format(fmt)
    num_kv_heads, head_dim, block_size = (_count(name, value) for name, value in (
        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("block_size", block_size)))
    if bits is None:
        return 2 * block_size * num_kv_heads * head_dim * _DENSE_ELEMENT_BYTES[fmt]
    layout = CacheLayout(1, block_size, num_kv_heads, head_dim, bits)
    return layout.k_block_stride_bytes + layout.v_block_stride_bytes


def bytes_per_token(num_kv_heads: int, head_dim: int, fmt: str) -> int:
    """Cache bytes one token occupies in one layer, K and V together, all KV heads (the page
    bytes of a one-token page). At head_dim 128, per KV head: bf16 512, fp8 256, fp8k_turbo4v
    200, fp8k_turbo3v 184, fp8k_turbo2v 168."""
    return page_bytes(num_kv_heads, head_dim, fmt, block_size=1)


def tokens_that_fit(budget_bytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int,
                    fmt: str, block_size: int = 16) -> int:
    """Tokens the cache of every layer holds in ``budget_bytes``, counting whole pages only:
    ``pages · block_size`` with ``pages = budget_bytes // (num_layers · page_bytes)``."""
    budget_bytes = _count("budget_bytes", budget_bytes, least=0)
    num_layers = _count("num_layers", num_layers)
    block_size = _count("block_size", block_size)
    pages = budget_bytes // (num_layers * page_bytes(num_kv_heads, head_dim, fmt, block_size))
    return pages * block_size


@dataclass(frozen=True)
class CapacityPlan:
    """One format's row of `capacity_table`.

    ``bytes_per_token``: bytes per token per layer (K+V, all KV heads); ``page_bytes``: bytes of
    one page of one layer; ``pages``: pages per layer in the budget; ``tokens``: tokens that fit;
    ``tokens_vs_bf16``: ``tokens`` over bf16's tokens (None when bf16 fits none);
    ``bytes_vs_bf16``: ``bytes_per_token`` over bf16's.
    """

    fmt: str
    bytes_per_token: int
    page_bytes: int
    pages: int
    tokens: int
    tokens_vs_bf16: float | None
    bytes_vs_bf16: float


def capacity_table(budget_bytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int,
                   block_size: int = 16) -> list[CapacityPlan]:
    """Every format of `FORMATS` for one model and a cache budget in bytes (all layers
    together), in `FORMATS` order; see `tokens_that_fit` for the counting."""
    shape = {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
    bf16_tokens = tokens_that_fit(budget_bytes, num_layers=num_layers, fmt="bf16",
                                  block_size=block_size, **shape)
    bf16_bytes = bytes_per_token(fmt="bf16", **shape)
    rows = []
    for fmt in FORMATS:
        tokens = tokens_that_fit(budget_bytes, num_layers=num_layers, fmt=fmt,
                                 block_size=block_size, **shape)
        per_token = bytes_per_token(fmt=fmt, **shape)
        rows.append(CapacityPlan(
            fmt=fmt, bytes_per_token=per_token,
            page_bytes=page_bytes(fmt=fmt, block_size=block_size, **shape),
            pages=tokens // block_size, tokens=tokens,
            tokens_vs_bf16=tokens / bf16_tokens if bf16_tokens else None,
            bytes_vs_bf16=per_token / bf16_bytes))
    return rows
