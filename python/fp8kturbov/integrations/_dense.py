"""Attention of a long chunk of new tokens over dequantised K and V, with the decode's options:
GQA, sliding window, soft cap, sinks, V kept rotated. The CPU pools' prefill (the NumPy reference
has no paged prefill of its own); CUDA pools call the library's paged prefill.

The inputs are what the decode reads: the bf16 K and V that ``dequantize`` gives and the query
rounded to bf16; the output is rounded to bf16 as the decode's is. Query rows are taken in
chunks so that a mask or the scores of a long prompt never need more than ``SCORE_BUDGET_ELEMS``
elements at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ._paged_batch import Step

#: The most float32 scores one chunk of query rows may hold (256 MiB).
SCORE_BUDGET_ELEMS = 1 << 26


def prefill_over_dequantized(read: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]], q_rows: torch.Tensor,
                             step: Step, *, rotated: bool, sliding_window: int, **options: Any) -> torch.Tensor:
    """The step's chunks (``q_rows``: its query rows, ``[rows, Hq, D]``), each sequence over its
    positions dequantised by ``read(slots)`` (from the window's first position on)."""
    out = torch.empty(q_rows.shape, dtype=torch.bfloat16, device=q_rows.device)
    starts, lengths = step.query_start, step.seq_lens
    for s in range(len(lengths)):
        begin, end = int(starts[s]), int(starts[s + 1])
        if begin == end:
            continue
        first = max(0, int(lengths[s]) - (end - begin) - sliding_window + 1) if sliding_window else 0
        key, value = read(step.sequence_slots(s, first))
        out[begin:end] = chunk_attention(q_rows[begin:end], key.to(q_rows.device), value.to(q_rows.device),
                                         sliding_window=sliding_window, rotated=rotated, **options)
    return out


def chunk_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scaling: float,
                    sliding_window: int, soft_cap: float, sinks: torch.Tensor | None,
                    rotated: bool) -> torch.Tensor:
    """Attention of ``q`` (``[n, Hq, D]``: the sequence's last ``n`` positions, in order) over the
    sequence's cached ``key``/``value`` (``[L, H, D]``, positions 0..L-1, the new ones included):
    row ``i`` is position ``p = L - n + i`` and attends positions ``max(0, p - W + 1) .. p`` (W =
    ``sliding_window``, 0 = no window), the library's causal and window rule. ``soft_cap`` > 0 caps
    the scores (``cap · tanh(score / cap)``); ``sinks`` (``[Hq]``) join each head's softmax
    denominator; ``rotated``: V is stored rotated (FORMAT.md §6), so the output is rotated back.
    Without a cap or sinks torch's SDPA takes bf16 inputs (its flash kernels on a GPU); with them
    the scores are computed here in float32. Returns bf16 ``[n, Hq, D]``."""
    num_rows, num_q_heads, head_dim = q.shape
    length = key.shape[0]
    queries = q.to(torch.bfloat16).transpose(0, 1)  # [Hq, n, D]
    keys, values = key.to(torch.bfloat16).transpose(0, 1), value.to(torch.bfloat16).transpose(0, 1)
    attend = _sdpa if soft_cap == 0 and sinks is None else _float32_scores
    out = torch.empty((num_q_heads, num_rows, head_dim), dtype=torch.float32, device=q.device)
    if attend is _sdpa and sliding_window == 0 and num_rows == length:  # SDPA's causal kernels
        out[:] = attend(queries, keys, values, None, scaling, soft_cap, sinks)
    else:
        rows_per_chunk = max(1, SCORE_BUDGET_ELEMS // max(1, num_q_heads * length))
        positions = torch.arange(length, device=q.device)
        for first in range(0, num_rows, rows_per_chunk):
            rows = slice(first, min(num_rows, first + rows_per_chunk))
            query_positions = length - num_rows + torch.arange(rows.start, rows.stop, device=q.device)
            visible = positions[None, :] <= query_positions[:, None]
            if sliding_window > 0:
                visible &= positions[None, :] > query_positions[:, None] - sliding_window
            out[:, rows] = attend(queries[:, rows], keys, values, visible, scaling, soft_cap, sinks)
    out = out.transpose(0, 1)
    if rotated:
        out = unrotate_heads(out)
    return out.to(torch.bfloat16)


def _sdpa(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
          visible: torch.Tensor | None, scaling: float, soft_cap: float,
          sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA over ``[Hq, r, D]`` queries (None ``visible``: causal, queries and keys aligned). The
    KV heads are repeated for their query heads rather than passed with ``enable_gqa``, which
    SDPA's memory-efficient kernel (the one that takes a mask) lacks. The inputs go in as one batch
    of ``[1, Hq, ·, D]``: the flash and memory-efficient kernels take 4-D inputs only, and with 3-D
    ones SDPA computes every score at once (32 GiB for a 32K-token prompt of 16 heads)."""
    group = queries.shape[0] // keys.shape[0]
    return torch.nn.functional.scaled_dot_product_attention(
        queries[None], keys.repeat_interleave(group, dim=0)[None], values.repeat_interleave(group, dim=0)[None],
        attn_mask=None if visible is None else visible[None, None], is_causal=visible is None,
        scale=scaling)[0].float()


def _float32_scores(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    visible: torch.Tensor | None, scaling: float, soft_cap: float,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """The scores in float32, capped, masked, a sink column appended, softmax, times V."""
    group = queries.shape[0] // keys.shape[0]
    keys = keys.float().repeat_interleave(group, dim=0)
    values = values.float().repeat_interleave(group, dim=0)
    scores = torch.matmul(queries.float(), keys.transpose(1, 2)) * scaling  # [Hq, r, L]
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if visible is None:
        visible = torch.ones(scores.shape[1:], dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., :keys.shape[1]]  # a sink's weight multiplies no V
    return torch.matmul(weights, values)


def unrotate_heads(y: torch.Tensor) -> torch.Tensor:
    """``x = S1 · (H/√D) · S2 · y`` over the last axis (one head), FORMAT.md §6, in float32: the
    inverse of the write's rotation (attention being linear in V, outputs can be rotated back)."""
    head_dim = y.shape[-1]
    return torch.matmul(y.float(), _unrotation_matrix(head_dim, y.device))


@functools.lru_cache(maxsize=None)
def _unrotation_matrix(head_dim: int, device: torch.device) -> torch.Tensor:
    """``M`` with ``x = y @ M``: ``diag(S2) · H/√D · diag(S1)`` from the reference's signs."""
    from ..reference import hadamard, rotation_signs

    s1, s2 = rotation_signs(head_dim)
    matrix = (s2[:, None] * hadamard(head_dim) * s1[None, :]) / head_dim ** 0.5
    return torch.from_numpy(matrix).to(device, torch.float32)
