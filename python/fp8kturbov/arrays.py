"""Tensor-level API: arrays in, checked, launched through :mod:`fp8kturbov.ops`.

``write_kv``, ``paged_decode`` and ``dequantize_kv`` take arrays instead of raw pointers, check
dtype, shape, strides and device (an :class:`ArgumentError` names the argument, what was found and
what was expected), and call the generic launchers ``ops.reshape_and_cache`` /
``ops.paged_decode_attn`` / ``ops.dequantize``.
:class:`KVCache` holds one layer's K and V pools with their :class:`CacheLayout` and ``k_scale``,
and in checked mode the error word its launches report out-of-range indices in
(:mod:`fp8kturbov.checked`); it lives in :mod:`fp8kturbov.cache` and is importable from here.

Arrays: torch tensors, CuPy arrays, ``__cuda_array_interface__`` and DLPack objects, in the
order :mod:`fp8kturbov._interop` recognises them. torch and CuPy are never imported except to
allocate for their backend (:mod:`fp8kturbov.cache`).

Streams. A call launches on the first of:

1. the ``stream`` argument (anything ``stream_handle`` takes, or a ``torch.cuda.Stream`` /
   ``cupy.cuda.Stream``);
2. the stream of the first array argument that has one, in signature order: a torch tensor gives
   ``torch.cuda.current_stream(device)``, a CuPy array ``cupy.cuda.get_current_stream(device)``,
   a CAI v3 object its ``stream`` field (1 = legacy default, 2 = per-thread default);
3. the legacy default stream (0).

Ordering after the producers, never by host synchronisation: when a CAI object names a stream
other than the launch stream, an event is recorded on that stream and the launch stream waits for
it (CAI v3 requires the consumer to do so). DLPack objects are exported with
``__dlpack__(stream=launch stream)``, which makes the producer order its own work first (DLPack's
rule). Torch tensors and CuPy arrays carry no producer stream: as with torch's own operators, work
on the current stream is ordered, and a caller passing another ``stream`` orders it itself. The
cache's pools are described once, when the :class:`KVCache` is built, and take no part.

Units: ``*_bytes`` are bytes; strides of arrays are passed to the library in ELEMENTS. Launches
are asynchronous: every array must stay alive, and with stream-ordered allocators unreused, until
the launch stream has passed the call, as for any CUDA kernel.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from . import _device, ops
from ._device import DeviceBuffer
from ._errors import ArgumentError
from ._interop import (ArrayArgument, check_array, check_max_q_len, check_token_rows,
                       check_writable, common_device, describe, from_dlpack, instance_of,
                       row_stride, v_encoder_option)
from ._lib import VEncoder
from .layout import CacheLayout
from ._limits import MAX_Q_LEN  # noqa: F401  (importable from here, as before the split)
from .cache import BACKENDS, KVCache, allocate, open_cache  # noqa: F401  (BACKENDS: the same)

__all__ = ["ArgumentError", "DeviceBuffer", "KVCache", "dequantize_kv", "paged_decode", "paged_prefill", "write_kv"]


# ---- One call: its arrays and its stream --------------------------------------------------------
def _implied_stream(arrays: Iterable[ArrayArgument]) -> int:
    """Rule 2 of the module docstring, else the legacy default stream."""
    for array in arrays:
        if array.kind == "torch":
            return int(sys.modules["torch"].cuda.current_stream(array.device).cuda_stream)
        if array.kind == "cupy":
            return int(sys.modules["cupy"].cuda.get_current_stream(array.device).ptr)
        if array.stream is not None:
            return array.stream
    return 0


@dataclass
class _Call:
    """The array arguments of one call, described, and the stream it launches on."""

    arrays: dict[str, ArrayArgument]
    stream: int
    exports: list[Any]  # DLPack capsules, kept until the launch is queued

    @classmethod
    def gather(cls, stream: Any, **objects: Any) -> _Call:
        """Describe ``objects`` (None ones are left out), then pick the launch stream."""
        described = {name: describe(name, obj) for name, obj in objects.items() if obj is not None}
        handle = (_device.stream_argument(stream) if stream is not None
                  else _implied_stream(a for a in described.values() if a is not None))
        exports = []
        for name, array in described.items():
            if array is None:
                # DLPack writes the legacy default stream as 1 (0 is ambiguous there).
                described[name], capsule = from_dlpack(name, objects[name], handle or 1)
                exports.append(capsule)
        return cls(described, handle, exports)

    def __getitem__(self, name: str) -> ArrayArgument:
        """A required array: one given as None (or not at all) is refused by name."""
        if name not in self.arrays:
            raise ArgumentError(name, "None", "an array (it is required)")
        return self.arrays[name]

    def get(self, name: str) -> ArrayArgument | None:
        return self.arrays.get(name)

    def wait_for_producers(self) -> None:
        """CAI v3: order the launch stream after every other stream an array names."""
        waited: list[int] = []
        for array in self.arrays.values():
            producer = array.stream
            if producer is None or _device.same_stream(producer, self.stream) or producer in waited:
                continue
            _device.stream_wait(self.stream, producer)
            waited.append(producer)

    @contextlib.contextmanager
    def launching(self, cache: KVCache) -> Iterator[None]:
        """Check the devices, then make the launch device current and the stream ordered."""
        device = common_device(self.arrays.values(), cache.device, "cache")
        with _device.on_device(device):
            self.wait_for_producers()
            yield


# ---- The operations -----------------------------------------------------------------------------
def write_kv(key: Any, value: Any, cache: KVCache, slot_mapping: Any, *,
             k_scale: float | None = None, v_encoder: VEncoder | str = VEncoder.MATCHED_NORM,
             stream: Any = None) -> None:
    """Write token rows into the cache (``reshape_and_cache``, docs/format.md §4).

    ``key``, ``value``: bf16 ``[num_tokens, num_kv_heads*head_dim]`` or
    ``[num_tokens, num_kv_heads, head_dim]``, each row contiguous, any row stride (ELEMENTS) of
    at least a row. ``slot_mapping``: int64 ``[num_tokens]``, contiguous; ``slot = page *
    block_size + offset``, a negative slot writes nothing; on a checked cache a slot past
    ``layout.num_blocks`` pages is skipped and reported (:meth:`KVCache.check_errors`).
    ``k_scale`` defaults to ``cache.k_scale``. ``v_encoder``: a :class:`~fp8kturbov.VEncoder` or
    its lower-case name ("matched_norm", the default, "mse" or "projection"; the reference's ``encoder``).
    Streams: see the module docstring. Asynchronous; returns nothing.
    """
    layout = open_cache(cache).layout
    encoder = v_encoder_option(v_encoder)
    call = _Call.gather(stream, key=key, value=value, slot_mapping=slot_mapping)
    key_stride = check_token_rows(call["key"], layout)
    value_stride = check_token_rows(call["value"], layout)
    num_tokens = call["key"].shape[0]
    if call["value"].shape[0] != num_tokens:
        raise ArgumentError("value", f"{call['value'].shape[0]} rows", f"{num_tokens} (as key)")
    check_array(call["slot_mapping"], "int64", (num_tokens,), f"[{num_tokens}] (num_tokens)")
    with call.launching(cache):
        ops.reshape_and_cache(
            key=call["key"].ptr, value=call["value"].ptr, k_cache=cache.k_ptr,
            v_cache=cache.v_ptr, slot_mapping=call["slot_mapping"].ptr, num_tokens=num_tokens, key_stride=key_stride, value_stride=value_stride,
            k_scale=cache.k_scale if k_scale is None else k_scale, v_encoder=encoder,
            v_rotation=cache.v_rotation, stream=call.stream, **cache._layout_args(),
            **cache._checked_args())


def paged_decode(q: Any, cache: KVCache, block_tables: Any, seq_lens: Any, *, out: Any = None,
                 inv_sqrt_d: float | None = None, sliding_window: int = 0,
                 sparse_v_threshold: float | None = None, workspace: Any = None,
                 sinks: Any = None, soft_cap: float = 0.0, query_start: Any = None,
                 max_q_len: int | None = None, append_key: Any = None, append_value: Any = None,
                 append_slot_mapping: Any = None,
                 v_encoder: VEncoder | str = VEncoder.MATCHED_NORM, stream: Any = None) -> Any:
    """Paged decode attention over the cache (docs/format.md §5); returns ``out``.

    ``q``: bf16 ``[num_seqs, num_q_heads, head_dim]`` (with ``query_start``:
    ``[num_query_rows, num_q_heads, head_dim]``), heads contiguous, any row stride (ELEMENTS) of at
    least ``num_q_heads*head_dim``; ``num_q_heads`` a multiple of the cache's ``num_kv_heads``.
    ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``, rows contiguous, any row stride
    (ELEMENTS) of at least ``max_blocks_per_seq``. The split plan is sized for
    ``max_blocks_per_seq * block_size`` positions, not for ``seq_lens``: where an engine's table
    rows are sized for its longest context, pass the column slice of the batch's pages
    (``block_tables[:, :pages]``, pages enough for its longest sequence), and size the workspace
    with the same ``max_blocks_per_seq``. A batch of mixed lengths is planned for its longest
    sequence; where that plan has several long splits per sequence, the sequences share its CTAs
    by their ``seq_lens`` on the device (docs/api.md). ``seq_lens``: int32 ``[num_seqs]``, contiguous.
    ``out``: bf16, dense, q's shape; None allocates it like q (torch or CuPy q only; on their
    allocator's current stream). ``inv_sqrt_d`` defaults to
    ``head_dim**-0.5``; ``sliding_window`` 0 is off; ``sparse_v_threshold`` 0 is exact, None
    the library's default (``DEFAULT_SPARSE_V_THRESHOLD``).
    ``workspace``: any contiguous writable device array (its size in BYTES is passed), e.g. from
    :meth:`KVCache.decode_workspace`; None runs unsplit. On a checked cache, block-table entries
    outside ``layout.num_blocks`` pages are left out and out-of-range seq_lens clamped, both
    reported (:meth:`KVCache.check_errors`). ``sinks``: float32 ``[num_q_heads]``, contiguous,
    one attention-sink logit per query head (in score units), joining the softmax denominator
    only; None for none. ``soft_cap`` > 0: scores become ``soft_cap·tanh(score / soft_cap)``; 0 is
    off. A cache with ``v_rotation`` (:class:`KVCache`) gets each output head rotated back.

    Multi-token decode (speculative or chunked decode): ``query_start``, int32 ``[num_seqs + 1]``,
    contiguous, on the device like ``block_tables``, non-decreasing from 0: sequence ``s`` owns the
    rows ``query_start[s] .. query_start[s+1]-1`` of q and out, ``q_len = query_start[s+1] -
    query_start[s]`` (0 to ``min(max_q_len, seq_len)``); its token ``i`` attends the positions
    before ``seq_len - q_len + i + 1``, the sliding window counting back from there. ``num_seqs``
    is then ``block_tables.shape[0]`` and ``num_query_rows = q.shape[0]`` (rows past
    ``query_start[num_seqs]`` are not written). ``max_q_len``: the largest ``q_len``, a host int in
    1..16, required with ``query_start`` (the library never reads ``query_start`` on the host, so
    nothing synchronises) and refused without it; size the workspace with the same value. A checked cache
    also reports a ``query_start`` that breaks these rules (the sequence is skipped). None: one
    query row per sequence.

    The fused append, for one launch per layer and step: with ``append_slot_mapping`` (int64
    ``[rows]``, contiguous; rows as q's), ``append_key`` and ``append_value`` (bf16 ``[rows,
    num_kv_heads*head_dim]`` or ``[rows, num_kv_heads, head_dim]``, as :func:`write_kv` takes them)
    hold each query row's new token, written to its slot with ``v_encoder`` before it is attended:
    the cache bytes and the output are those of :func:`write_kv` followed by this decode, provided
    each slot is the one ``block_tables`` gives the row's position (``seq_len - q_len + i``; a
    negative slot writes nothing). Streams: see the module docstring.
    """
    layout = open_cache(cache).layout
    multi_token = query_start is not None
    if multi_token:
        max_q_len = check_max_q_len(max_q_len)
    elif max_q_len is not None:
        raise ArgumentError("max_q_len", repr(max_q_len), "None without query_start")
    if out is None:
        out = _new_output(q)
    call = _Call.gather(stream, q=q, block_tables=block_tables, seq_lens=seq_lens, out=out,
                        workspace=workspace, sinks=sinks, query_start=query_start,
                        append_key=append_key, append_value=append_value,
                        append_slot_mapping=append_slot_mapping)
    q_array, heads, dim = call["q"], layout.num_kv_heads, layout.head_dim
    rows_text = "num_query_rows" if multi_token else "num_seqs"
    check_array(q_array, "bfloat16", (None, None, dim), f"[{rows_text}, num_q_heads, {dim}]",
                 dense_from=1)
    num_rows, num_q_heads = q_array.shape[:2]
    if num_q_heads == 0 or num_q_heads % heads:
        raise ArgumentError("q", f"{num_q_heads} query heads",
                            f"a positive multiple of the cache's num_kv_heads = {heads}")
    q_stride = row_stride(q_array, num_q_heads * dim)
    if call.get("sinks") is not None:
        check_array(call["sinks"], "float32", (num_q_heads,), f"[{num_q_heads}] (num_q_heads)")
    if multi_token:
        check_array(call["block_tables"], "int32", (None, None), "[num_seqs, max_blocks_per_seq]",
                     dense_from=1)
        num_seqs = call["block_tables"].shape[0]
        check_array(call["query_start"], "int32", (num_seqs + 1,),
                     f"[{num_seqs + 1}] (num_seqs + 1)")
        query_row_args = dict(query_start=call["query_start"].ptr, max_q_len=max_q_len,
                              num_query_rows=num_rows)
    else:
        num_seqs = num_rows
        check_array(call["block_tables"], "int32", (num_seqs, None),
                     f"[{num_seqs} (num_seqs), max_blocks_per_seq]", dense_from=1)
        query_row_args = dict(query_start=0, max_q_len=0, num_query_rows=0)
    max_blocks_per_seq = call["block_tables"].shape[1]
    block_tables_stride = row_stride(call["block_tables"], max_blocks_per_seq)
    check_array(call["seq_lens"], "int32", (num_seqs,), f"[{num_seqs}] (num_seqs)")
    check_array(call["out"], "bfloat16", q_array.shape, f"{list(q_array.shape)} (as q)")
    check_writable(call["out"])
    append_args = _append_args(call, layout, num_rows, v_encoder)
    scratch = _checked_workspace(call)
    with call.launching(cache):
        ops.paged_decode_attn(
            q=q_array.ptr, k_cache=cache.k_ptr, v_cache=cache.v_ptr, output=call["out"].ptr,
            block_tables=call["block_tables"].ptr, seq_lens=call["seq_lens"].ptr,
            max_blocks_per_seq=max_blocks_per_seq, block_tables_stride=block_tables_stride,
            num_seqs=num_seqs, num_q_heads=num_q_heads,
            inv_sqrt_d=dim ** -0.5 if inv_sqrt_d is None else inv_sqrt_d, k_scale=cache.k_scale,
            q_stride=q_stride, sliding_window=sliding_window,
            sparse_v_threshold=sparse_v_threshold,
            workspace=scratch.ptr if scratch is not None else 0,
            workspace_bytes=scratch.nbytes if scratch is not None else 0,
            sinks=call["sinks"].ptr if call.get("sinks") is not None else 0, soft_cap=soft_cap,
            v_rotation=cache.v_rotation, stream=call.stream, **query_row_args, **append_args,
            **cache._layout_args(), **cache._checked_args())
    return out


def paged_prefill(q: Any, cache: KVCache, block_tables: Any, seq_lens: Any, query_start: Any, *, max_q_len: int,
                  out: Any = None, lse: Any = None, inv_sqrt_d: float | None = None, sliding_window: int = 0,
                  sinks: Any = None, soft_cap: float = 0.0, workspace: Any = None, stream: Any = None) -> Any:
    """Paged prefill attention over the cache (chunked prefill, long verify); returns ``out``.

    Each sequence's chunk, rows ``query_start[s] .. query_start[s+1]-1`` of ``q`` (bf16
    ``[num_query_rows, num_q_heads, head_dim]``, as :func:`paged_decode` takes it with
    ``query_start``), is its last ``q_len`` positions, written to the cache first (:func:`write_kv`):
    token ``i`` attends the positions before ``seq_len - q_len + i + 1`` (causal inside the chunk and
    over the cached prefix), the sliding window counting back from there. ``max_q_len``: the largest
    ``q_len``, a host int (the library never reads ``query_start`` on the host; a longer chunk is not
    computed, a checked cache reports it). ``lse``: None, or float32 ``[num_query_rows,
    num_q_heads]``, contiguous: each row's natural-log softmax denominator (``-inf`` for a row with
    no position), for merging with another attention. ``block_tables``, ``seq_lens``, ``out``,
    ``inv_sqrt_d``, ``sliding_window``, ``sinks``, ``soft_cap``, streams: as :func:`paged_decode`.
    ``workspace``: None, or any contiguous writable device array (its size in BYTES is passed) of the
    size :meth:`KVCache.prefill_workspace` gives: with it, short chunks over long contexts split the
    context over the GPU; with less (or None) the prefill runs unsplit. Tensor cores (compute
    capability 8.0 or newer); head_dim 64, 128 or 256.
    """
    layout = open_cache(cache).layout
    if out is None:
        out = _new_output(q)
    call = _Call.gather(stream, q=q, block_tables=block_tables, seq_lens=seq_lens, query_start=query_start,
                        out=out, lse=lse, sinks=sinks, workspace=workspace)
    q_array, heads, dim = call["q"], layout.num_kv_heads, layout.head_dim
    check_array(q_array, "bfloat16", (None, None, dim), f"[num_query_rows, num_q_heads, {dim}]", dense_from=1)
    num_rows, num_q_heads = q_array.shape[:2]
    if num_q_heads == 0 or num_q_heads % heads:
        raise ArgumentError("q", f"{num_q_heads} query heads",
                            f"a positive multiple of the cache's num_kv_heads = {heads}")
    check_array(call["block_tables"], "int32", (None, None), "[num_seqs, max_blocks_per_seq]", dense_from=1)
    num_seqs, max_blocks_per_seq = call["block_tables"].shape
    check_array(call["seq_lens"], "int32", (num_seqs,), f"[{num_seqs}] (num_seqs)")
    check_array(call["query_start"], "int32", (num_seqs + 1,), f"[{num_seqs + 1}] (num_seqs + 1)")
    check_array(call["out"], "bfloat16", q_array.shape, f"{list(q_array.shape)} (as q)")
    check_writable(call["out"])
    if call.get("lse") is not None:
        check_array(call["lse"], "float32", (num_rows, num_q_heads), f"[{num_rows}, {num_q_heads}] (q's rows, heads)")
        check_writable(call["lse"])
    if call.get("sinks") is not None:
        check_array(call["sinks"], "float32", (num_q_heads,), f"[{num_q_heads}] (num_q_heads)")
    scratch = _checked_workspace(call)
    with call.launching(cache):
        ops.paged_prefill_attn(
            q=q_array.ptr, k_cache=cache.k_ptr, v_cache=cache.v_ptr, output=call["out"].ptr,
            block_tables=call["block_tables"].ptr, seq_lens=call["seq_lens"].ptr,
            query_start=call["query_start"].ptr, lse=call["lse"].ptr if call.get("lse") is not None else 0,
            max_blocks_per_seq=max_blocks_per_seq,
            block_tables_stride=row_stride(call["block_tables"], max_blocks_per_seq), num_seqs=num_seqs,
            num_q_heads=num_q_heads, inv_sqrt_d=dim ** -0.5 if inv_sqrt_d is None else inv_sqrt_d,
            k_scale=cache.k_scale, q_stride=row_stride(q_array, num_q_heads * dim), max_q_len=max_q_len,
            num_query_rows=num_rows, sliding_window=sliding_window,
            sinks=call["sinks"].ptr if call.get("sinks") is not None else 0, soft_cap=soft_cap,
            workspace=scratch.ptr if scratch is not None else 0,
            workspace_bytes=scratch.nbytes if scratch is not None else 0,
            v_rotation=cache.v_rotation, stream=call.stream, **cache._layout_args(), **cache._checked_args())
    return out


def _checked_workspace(call: _Call) -> Any:
    """The call's workspace array (any shape, contiguous, writable), or None."""
    scratch = call.get("workspace")
    if scratch is not None:
        check_array(scratch, None, (None,) * len(scratch.shape), "any shape")
        check_writable(scratch)
    return scratch


def _append_args(call: _Call, layout: CacheLayout, num_rows: int, v_encoder: VEncoder | str) -> dict[str, int]:
    """The decode's fused-append arguments: none without ``append_slot_mapping``, else its rows
    checked as :func:`write_kv` checks them, one per query row."""
    encoder = v_encoder_option(v_encoder)
    if call.get("append_slot_mapping") is None:
        for name in ("append_key", "append_value"):
            if call.get(name) is not None:
                raise ArgumentError(name, "an array", "None without append_slot_mapping")
        if encoder != VEncoder.MATCHED_NORM:
            raise ArgumentError("v_encoder", repr(v_encoder), "the default without append_slot_mapping")
        return {}
    key_stride = check_token_rows(call["append_key"], layout)
    value_stride = check_token_rows(call["append_value"], layout)
    for name in ("append_key", "append_value"):
        if call[name].shape[0] != num_rows:
            raise ArgumentError(name, f"{call[name].shape[0]} rows", f"{num_rows} (as q)")
    check_array(call["append_slot_mapping"], "int64", (num_rows,), f"[{num_rows}] (as q's rows)")
    return dict(append_key=call["append_key"].ptr, append_value=call["append_value"].ptr,
                append_slot_mapping=call["append_slot_mapping"].ptr, append_key_stride=key_stride,
                append_value_stride=value_stride, v_encoder=encoder)


def _new_output(q: Any) -> Any:
    """A dense array of q's shape and dtype from q's own library (its allocator, on its current
    stream); other array kinds need ``out``."""
    if instance_of(q, "torch", "Tensor"):
        return sys.modules["torch"].empty(tuple(q.shape), dtype=q.dtype, device=q.device)
    if instance_of(q, "cupy", "ndarray"):
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(q.device.id):
            return cupy.empty(q.shape, dtype=q.dtype)
    raise TypeError(f"out: None needs q to be a torch tensor or a CuPy array, "
                    f"got {type(q).__name__}; pass out")


def dequantize_kv(cache: KVCache, slot_mapping: Any, key: Any = None, value: Any = None, *,
                  stream: Any = None) -> tuple[Any, Any]:
    """Read cached token rows back into bf16 (``dequantize``, the inverse of the write); returns
    ``(key, value)``.

    ``slot_mapping``: int64 ``[num_tokens]``, contiguous; ``slot = page * block_size + offset``, a
    negative slot gives a row of zeros, and so does, on a checked cache, a slot past
    ``layout.num_blocks`` pages (reported: :meth:`KVCache.check_errors`). ``key``, ``value``:
    writable bf16 ``[num_tokens, num_kv_heads*head_dim]`` or
    ``[num_tokens, num_kv_heads, head_dim]``, each row contiguous, any row stride (ELEMENTS) of at
    least a row; only the row elements are written. None allocates a dense
    ``[num_tokens, num_kv_heads, head_dim]`` array from the cache's backend on its device (torch
    or CuPy pools only, on their allocator's current stream; a "cuda"-backend cache needs both
    outputs). Elements are ``E4M3(K byte) * cache.k_scale`` and
    ``level[code] * E4M3(group scale)``, computed in float32 and rounded to bf16 (docs/format.md
    §2, §3). Streams: see the module docstring. Asynchronous.
    """
    layout = open_cache(cache).layout
    call = _Call.gather(stream, slot_mapping=slot_mapping, key=key, value=value)
    check_array(call["slot_mapping"], "int64", (None,), "[num_tokens] (1-D)")
    num_tokens = call["slot_mapping"].shape[0]
    outputs = {"key": key, "value": value}
    strides = {}
    for name in outputs:
        if outputs[name] is None:
            outputs[name] = _new_token_rows(cache, name, num_tokens)
            call.arrays[name] = describe(name, outputs[name])
        strides[name] = check_token_rows(call[name], layout)
        if call[name].shape[0] != num_tokens:
            raise ArgumentError(name, f"{call[name].shape[0]} rows",
                                f"{num_tokens} (as slot_mapping)")
        check_writable(call[name])
    with call.launching(cache):
        ops.dequantize(
            k_cache=cache.k_ptr, v_cache=cache.v_ptr, slot_mapping=call["slot_mapping"].ptr,
            key=call["key"].ptr, value=call["value"].ptr, num_tokens=num_tokens,
            key_stride=strides["key"], value_stride=strides["value"], k_scale=cache.k_scale,
            stream=call.stream, **cache._layout_args(), **cache._checked_args())
    return outputs["key"], outputs["value"]


def _new_token_rows(cache: KVCache, name: str, num_tokens: int) -> Any:
    """A dense bf16 ``[num_tokens, num_kv_heads, head_dim]`` array from the cache's backend, on
    its device; "cuda" pools have no bf16 arrays to go with them."""
    if cache.backend not in ("torch", "cupy"):
        raise TypeError(f"{name}: None needs a cache with torch or CuPy pools, got backend "
                        f"{cache.backend!r}; pass {name}")
    shape = (num_tokens, cache.layout.num_kv_heads, cache.layout.head_dim)
    return allocate(cache.backend, shape, "bfloat16", cache.device or 0)
