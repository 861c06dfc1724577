"""Bit-exact NumPy reference of the fp8k_turbo{2,3,4}v paged KV-cache format.

Every rule here is a transcription of ``docs/format.md`` (the contract shared with the original
engine); each function names the section it implements. The code is written to be read: all encoder arithmetic is done in float32 with
separate numpy operations (no fused multiply-add) and with the sums taken sequentially over the 16
elements of a group, exactly as FORMAT.md §3.2 prescribes; attention (§5) is done in float64.

The codec (constants, sizes, E4M3, the encoders and decoders of a group, packing) lives in
`_reference_codec` and is re-exported here; this module holds the cache write, the dequantize and the
attention built on it.

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
from ._reference_codec import (  # the codec (FORMAT.md §1-§3)
    BOUNDS, CODEBOOKS, E4M3_MAX, LEVEL_MAX, MSE_CANDIDATE_BYTES, PROJECTION_CANDIDATE_BYTES, decode_k, decode_v,
    e4m3_decode, e4m3_encode, encode_k, encode_v, k_page_bytes, pack_codes, unpack_codes, v_data_section_bytes,
    v_group_bytes, v_page_bytes, v_scale_section_bytes,
)
from ._reference_rotation import ROTATION_DIMS, hadamard, rotate, rotate_f32, rotation_signs, unrotate
from ._reference_args import (  # the argument rules
    _block_tables, _check_bits, _check_encoder, _check_entries, _check_finite_non_negative, _check_k_reciprocal, _check_k_scale, _check_page_shape, _check_q_heads, _check_q_stride, _check_rotation, _check_row_stride, _check_score_scale, _check_table_width, _float_data, _index_array, _pool, _token_rows, _u32,
)

__all__ = [
    "BOUNDS", "CODEBOOKS", "E4M3_MAX", "GROUP_ELEMS", "LEVEL_MAX",
    "k_page_bytes", "v_data_section_bytes", "v_scale_section_bytes", "v_page_bytes", "v_group_bytes",
    "e4m3_encode", "e4m3_decode", "encode_k", "decode_k", "pack_codes", "unpack_codes",
    "encode_v", "decode_v", "write_cache", "dequantize_cache", "paged_decode", "paged_prefill",
    "V_ENCODERS", "MSE_CANDIDATE_BYTES", "PROJECTION_CANDIDATE_BYTES", "ROTATION_DIMS", "rotation_signs", "hadamard", "rotate", "unrotate",
]

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
