"""Raw-pointer launches: the C entry points one to one, for engines that manage their own memory.

Every pointer is a device address given as an ``int`` (0 for none). Sizes named ``*_bytes`` are in
bytes, ``*_stride`` without a unit in elements. ``stream`` may be ``None`` (the legacy default
stream), an ``int`` handle, a ``cuda.bindings.driver.CUstream`` or any object implementing
``__cuda_stream__``. Launches are asynchronous; argument errors raise before anything is launched.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ._device import stream_handle
from ._lib import DecodeParams, DequantizeParams, PrefillParams, WriteParams, check, library
from ._limits import DEFAULT_SPARSE_V_THRESHOLD
from ._scalars import U32_MAX, U64_MAX, float32, pointer, unsigned

#: The parameters whose Python default is None: "keep what ``*_params_init`` set".
_LIBRARY_DEFAULTS = frozenset({"sparse_v_threshold"})


def _fill(params: ctypes.Structure, fields: dict[str, Any]) -> dict[str, Any]:
    """Set the struct fields named in ``fields``, range-checking each by its C type; a field of
    `_LIBRARY_DEFAULTS` given as None keeps its value (the library's default). Returns the
    checked values by name (plain ints and floats)."""
    ctypes_by_name = dict(params._fields_)
    checked = {}
    for name, value in fields.items():
        if value is None and name in _LIBRARY_DEFAULTS:
            continue
        ctype = ctypes_by_name[name]
        if ctype is ctypes.c_void_p:
            value = pointer(name, value)
        elif ctype is ctypes.c_uint32:
            value = unsigned(name, value, U32_MAX)
        elif ctype is ctypes.c_uint64:
            value = unsigned(name, value, U64_MAX)
        elif ctype is ctypes.c_float:
            value = float32(name, value)
        setattr(params, name, value)
        checked[name] = value
    return checked


def _params(params_type: type[ctypes.Structure], init_sized: str, **fields: Any) -> ctypes.Structure:
    """A ``params_type`` struct set to its defaults by the C function ``init_sized``
    (``*_params_init_sized``: it writes this struct's size only, whichever library version runs
    it), then to ``fields`` by name (each range-checked by its C type)."""
    params = params_type()
    check(getattr(library(), init_sized)(ctypes.byref(params), ctypes.sizeof(params_type)))
    _fill(params, fields)
    return params


def reshape_and_cache(
    key: int, value: int, k_cache: int, v_cache: int, slot_mapping: int, *,
    num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
    key_stride: int, value_stride: int, k_scale: float, v_bits: int,
    k_block_stride_bytes: int, v_block_stride_bytes: int, v_data_section_bytes: int,
    num_blocks: int = 0, error_flags: int = 0, v_encoder: int = 0, v_rotation: int = 0,
    stream: Any = None,
) -> None:
    """Write K/V rows into the pools (``fp8kturbov_reshape_and_cache``); see the C header.

    ``v_encoder``: a :class:`~fp8kturbov.VEncoder` (0 = matched-norm, the default; 1 = the MSE
    scale search; 2 = the projection encoder). ``v_rotation``: a :class:`~fp8kturbov.VRotation`
    (0 = none, the default; 1 = each V head rotated first, FORMAT.md §6; decode such a cache with
    the same ``v_rotation``).

    Checked mode (the header's "Checked mode"): ``num_blocks`` is the number of pages each pool
    holds (0 = unchecked), ``error_flags`` the device address of a 4-byte aligned uint32 word
    (e.g. :attr:`fp8kturbov.ErrorWord.ptr`) the kernel ORs :class:`~fp8kturbov.IndexErrorFlags`
    bits into; read it with :func:`fp8kturbov.check_errors`."""
    params = _params(
        WriteParams, "fp8kturbov_write_params_init_sized",
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
        num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, key_stride=key_stride, value_stride=value_stride, k_scale=k_scale,
        v_bits=v_bits, k_block_stride_bytes=k_block_stride_bytes,
        v_block_stride_bytes=v_block_stride_bytes, v_data_section_bytes=v_data_section_bytes,
        num_blocks=num_blocks, error_flags=error_flags, v_encoder=v_encoder,
        v_rotation=v_rotation)
    check(library().fp8kturbov_reshape_and_cache(ctypes.byref(params), stream_handle(stream)))


def dequantize(
    k_cache: int, v_cache: int, slot_mapping: int, key: int, value: int, *,
    num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
    key_stride: int, value_stride: int, k_scale: float, v_bits: int,
    k_block_stride_bytes: int, v_block_stride_bytes: int, v_data_section_bytes: int,
    num_blocks: int = 0, error_flags: int = 0, stream: Any = None,
) -> None:
    """Read slots of the pools back into bf16 K/V rows (``fp8kturbov_dequantize``); see the C
    header. ``key``/``value`` are written at ``t*key_stride`` / ``t*value_stride`` (ELEMENTS).
    ``num_blocks`` (pages per pool), ``error_flags`` (device address): checked mode, as in
    :func:`reshape_and_cache`."""
    params = _params(
        DequantizeParams, "fp8kturbov_dequantize_params_init_sized",
        k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, key=key, value=value,
        num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, key_stride=key_stride, value_stride=value_stride, k_scale=k_scale,
        v_bits=v_bits, k_block_stride_bytes=k_block_stride_bytes,
        v_block_stride_bytes=v_block_stride_bytes, v_data_section_bytes=v_data_section_bytes,
        num_blocks=num_blocks, error_flags=error_flags)
    check(library().fp8kturbov_dequantize(ctypes.byref(params), stream_handle(stream)))


def _decode_params(**fields: Any) -> DecodeParams:
    return _params(DecodeParams, "fp8kturbov_decode_params_init_sized", **fields)


def paged_decode_attn(
    q: int, k_cache: int, v_cache: int, output: int, block_tables: int, seq_lens: int, *,
    max_blocks_per_seq: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, inv_sqrt_d: float, k_scale: float, q_stride: int,
    v_bits: int, v_block_stride_bytes: int, v_data_section_bytes: int,
    k_block_stride_bytes: int = 0, sliding_window: int = 0, sparse_v_threshold: float | None = None,
    workspace: int = 0, workspace_bytes: int = 0, num_blocks: int = 0, error_flags: int = 0,
    sinks: int = 0, soft_cap: float = 0.0, query_start: int = 0, max_q_len: int = 0,
    num_query_rows: int = 0, v_rotation: int = 0, block_tables_stride: int = 0,
    append_key: int = 0, append_value: int = 0, append_slot_mapping: int = 0,
    append_key_stride: int = 0, append_value_stride: int = 0, v_encoder: int = 0,
    stream: Any = None,
) -> None:
    """Paged decode attention (``fp8kturbov_paged_decode_attn``); see the C header.

    The fused append (``append_slot_mapping`` nonzero): each query row's new token, bf16 rows of
    ``append_key`` / ``append_value`` (``append_key_stride`` / ``append_value_stride`` ELEMENTS
    apart) written to slot ``append_slot_mapping[row]`` (int64, < 0 writes nothing) with
    ``v_encoder`` before it is attended: :func:`reshape_and_cache` and this decode in one launch,
    where each slot is the one the block table gives its position.

    ``block_tables_stride``: int32 entries (ELEMENTS) between rows of ``block_tables``, at least
    ``max_blocks_per_seq`` (0 = ``max_blocks_per_seq``). The split plan is sized for
    ``max_blocks_per_seq * block_size`` positions: with rows sized for an engine's longest context,
    pass their width here and the pages of the batch's longest sequence as ``max_blocks_per_seq``.

    ``v_rotation``: the :class:`~fp8kturbov.VRotation` the cache was written with; with
    ``HADAMARD`` each output head is rotated back.

    ``sinks``: device address of float32 ``[num_q_heads]`` attention-sink logits (0 = none);
    ``soft_cap`` > 0 soft-caps the scores (``cap · tanh(score / cap)``), 0 is off.
    Multi-token decode: ``query_start`` is the device address of int32 ``[num_seqs + 1]`` query-row
    offsets (0 = one row per sequence), ``max_q_len`` (1…16) the largest ``q_len`` and
    ``num_query_rows`` the rows of ``q`` and ``output``; token ``i`` of a sequence attends the
    positions before ``seq_len − q_len + i + 1``.

    ``k_block_stride_bytes = 0`` means packed K pages; ``sparse_v_threshold = 0`` is exact, None
    the library's default (``DEFAULT_SPARSE_V_THRESHOLD``).
    ``workspace`` is a device buffer of ``workspace_bytes`` bytes (see
    :func:`paged_decode_workspace_bytes`); without it the context is not split across CTAs and
    the KV heads are not read in head groups (docs/api.md).
    ``num_blocks`` (pages per pool), ``error_flags`` (device address): checked mode, as in
    :func:`reshape_and_cache`.
    """
    params = _decode_params(
        q=q, k_cache=k_cache, v_cache=v_cache, output=output, block_tables=block_tables,
        seq_lens=seq_lens, max_blocks_per_seq=max_blocks_per_seq, num_seqs=num_seqs,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, inv_sqrt_d=inv_sqrt_d, k_scale=k_scale, q_stride=q_stride,
        v_bits=v_bits, k_block_stride_bytes=k_block_stride_bytes,
        v_block_stride_bytes=v_block_stride_bytes, v_data_section_bytes=v_data_section_bytes,
        sliding_window=sliding_window, sparse_v_threshold=sparse_v_threshold,
        workspace=workspace, workspace_bytes=workspace_bytes, num_blocks=num_blocks,
        error_flags=error_flags, sinks=sinks, soft_cap=soft_cap, query_start=query_start,
        max_q_len=max_q_len, num_query_rows=num_query_rows, v_rotation=v_rotation,
        block_tables_stride=block_tables_stride, append_key=append_key, append_value=append_value,
        append_slot_mapping=append_slot_mapping, append_key_stride=append_key_stride,
        append_value_stride=append_value_stride, v_encoder=v_encoder)
    check(library().fp8kturbov_paged_decode_attn(ctypes.byref(params), stream_handle(stream)))


def paged_decode_workspace_bytes(
    *, max_blocks_per_seq: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, q_stride: int, v_bits: int, v_block_stride_bytes: int,
    v_data_section_bytes: int, k_block_stride_bytes: int = 0, sliding_window: int = 0,
    inv_sqrt_d: float = 1.0, k_scale: float = 1.0, sparse_v_threshold: float | None = None,
    soft_cap: float = 0.0, max_q_len: int = 0, v_rotation: int = 0,
) -> int:
    """Workspace BYTES for :func:`paged_decode_attn` with these scalars on the current device
    (0 when neither a split nor head groups would help). A host query: no synchronisation.
    ``sparse_v_threshold``: None is the library's default, as for the decode."""
    params = _decode_params(
        max_blocks_per_seq=max_blocks_per_seq, num_seqs=num_seqs, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, q_stride=q_stride,
        v_bits=v_bits, v_block_stride_bytes=v_block_stride_bytes,
        v_data_section_bytes=v_data_section_bytes, k_block_stride_bytes=k_block_stride_bytes,
        sliding_window=sliding_window, inv_sqrt_d=inv_sqrt_d, k_scale=k_scale,
        sparse_v_threshold=sparse_v_threshold, soft_cap=soft_cap, max_q_len=max_q_len,
        v_rotation=v_rotation)
    result = ctypes.c_uint64()
    check(library().fp8kturbov_paged_decode_workspace_bytes(ctypes.byref(params),
                                                            ctypes.byref(result)))
    return result.value


def paged_prefill_attn(
    q: int, k_cache: int, v_cache: int, output: int, block_tables: int, seq_lens: int, query_start: int, *,
    max_blocks_per_seq: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, inv_sqrt_d: float, k_scale: float, q_stride: int, v_bits: int,
    v_block_stride_bytes: int, v_data_section_bytes: int, max_q_len: int, num_query_rows: int,
    lse: int = 0, k_block_stride_bytes: int = 0, block_tables_stride: int = 0, sliding_window: int = 0,
    soft_cap: float = 0.0, sinks: int = 0, v_rotation: int = 0, workspace: int = 0,
    workspace_bytes: int = 0, num_blocks: int = 0, error_flags: int = 0, stream: Any = None,
) -> None:
    """Paged prefill attention (``fp8kturbov_paged_prefill_attn``); see the C header.

    Sequence ``s``'s chunk is query rows ``query_start[s] … query_start[s+1] − 1`` (int32, device),
    its last ``q_len`` positions, already written to the cache: token ``i`` attends the positions
    before ``seq_len − q_len + i + 1``. ``max_q_len``: the largest ``q_len`` (it sizes the grid);
    ``num_query_rows``: the rows of ``q``, ``output`` and ``lse``. ``lse``: 0, or the device address
    of float32 ``[num_query_rows, num_q_heads]`` natural-log softmax denominators, for merging with
    another attention. The other arguments are :func:`paged_decode_attn`'s.
    """
    params = _params(
        PrefillParams, "fp8kturbov_prefill_params_init_sized",
        q=q, k_cache=k_cache, v_cache=v_cache, output=output, lse=lse, block_tables=block_tables,
        seq_lens=seq_lens, query_start=query_start, max_blocks_per_seq=max_blocks_per_seq,
        num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, inv_sqrt_d=inv_sqrt_d, k_scale=k_scale, q_stride=q_stride, v_bits=v_bits,
        k_block_stride_bytes=k_block_stride_bytes, v_block_stride_bytes=v_block_stride_bytes,
        v_data_section_bytes=v_data_section_bytes, block_tables_stride=block_tables_stride,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, v_rotation=v_rotation,
        max_q_len=max_q_len, num_query_rows=num_query_rows, workspace=workspace,
        workspace_bytes=workspace_bytes, num_blocks=num_blocks, error_flags=error_flags)
    check(library().fp8kturbov_paged_prefill_attn(ctypes.byref(params), stream_handle(stream)))


def paged_prefill_workspace_bytes(
    *, max_blocks_per_seq: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, q_stride: int, v_bits: int, v_block_stride_bytes: int, v_data_section_bytes: int,
    max_q_len: int, num_query_rows: int, k_block_stride_bytes: int = 0, sliding_window: int = 0,
    inv_sqrt_d: float = 1.0, k_scale: float = 1.0, soft_cap: float = 0.0, v_rotation: int = 0,
) -> int:
    """Workspace BYTES for :func:`paged_prefill_attn` with these scalars on the current device: the
    partial rows of the context splits its plan takes where the query tiles alone leave the GPU short
    of a wave, and the expanded context (each tile dequantized once) where a chunk takes eight or
    more query tiles per KV head; 0 where it takes neither. A host query (cached device attributes): no
    synchronisation. A smaller workspace is allowed: the prefill then drops what does not fit."""
    params = _params(
        PrefillParams, "fp8kturbov_prefill_params_init_sized",
        max_blocks_per_seq=max_blocks_per_seq, num_seqs=num_seqs, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, q_stride=q_stride,
        v_bits=v_bits, v_block_stride_bytes=v_block_stride_bytes, v_data_section_bytes=v_data_section_bytes,
        max_q_len=max_q_len, num_query_rows=num_query_rows, k_block_stride_bytes=k_block_stride_bytes,
        sliding_window=sliding_window, inv_sqrt_d=inv_sqrt_d, k_scale=k_scale, soft_cap=soft_cap,
        v_rotation=v_rotation)
    result = ctypes.c_uint64()
    check(library().fp8kturbov_paged_prefill_workspace_bytes(ctypes.byref(params), ctypes.byref(result)))
    return result.value


def _call_fixed(c_function: str, params_type: type[ctypes.Structure], stream: Any,
                **arguments: Any) -> None:
    """Call the C function ``c_function`` with ``arguments`` (named as the struct fields, in the
    function's order), each range-checked by its field's C type (NumPy scalars become plain
    numbers ctypes accepts), then the stream."""
    checked = _fill(params_type(), arguments)
    check(getattr(library(), c_function)(*checked.values(), stream_handle(stream)))


def _fixed_bits_write(bits: int):
    c_function = f"fp8kturbov_reshape_and_cache_fp8k_turbo{bits}v"

    def launcher(key: int, value: int, k_cache: int, v_cache: int, slot_mapping: int,
                 num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
                 key_stride: int, value_stride: int, k_scale: float,
                 k_block_stride_bytes: int, v_block_stride_bytes: int,
                 v_data_section_bytes: int, stream: Any = None) -> None:
        _call_fixed(c_function, WriteParams, stream, key=key, value=value, k_cache=k_cache,
                    v_cache=v_cache, slot_mapping=slot_mapping, num_tokens=num_tokens,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                    key_stride=key_stride, value_stride=value_stride, k_scale=k_scale,
                    k_block_stride_bytes=k_block_stride_bytes,
                    v_block_stride_bytes=v_block_stride_bytes,
                    v_data_section_bytes=v_data_section_bytes)

    launcher.__name__ = launcher.__qualname__ = f"reshape_and_cache_fp8k_turbo{bits}v"
    launcher.__doc__ = (f"``{c_function}``: the original engine's {bits}-bit write launcher, "
                        f"argument for argument.")
    return launcher


def _fixed_bits_decode(bits: int):
    c_function = f"fp8kturbov_paged_decode_attn_fp8k_turbo{bits}v"

    def launcher(q: int, k_cache: int, v_cache: int, output: int, block_tables: int,
                 seq_lens: int, max_blocks_per_seq: int, num_seqs: int, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, inv_sqrt_d: float,
                 k_scale: float, q_stride: int, v_block_stride_bytes: int,
                 v_data_section_bytes: int, sliding_window: int, stream: Any = None) -> None:
        _call_fixed(c_function, DecodeParams, stream, q=q, k_cache=k_cache, v_cache=v_cache,
                    output=output, block_tables=block_tables, seq_lens=seq_lens,
                    max_blocks_per_seq=max_blocks_per_seq, num_seqs=num_seqs,
                    num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    block_size=block_size, inv_sqrt_d=inv_sqrt_d, k_scale=k_scale,
                    q_stride=q_stride, v_block_stride_bytes=v_block_stride_bytes,
                    v_data_section_bytes=v_data_section_bytes, sliding_window=sliding_window)

    launcher.__name__ = launcher.__qualname__ = f"paged_decode_attn_fp8k_turbo{bits}v"
    launcher.__doc__ = (f"``{c_function}``: the original engine's {bits}-bit decode launcher "
                        f"(packed K pages, sparse-V threshold {DEFAULT_SPARSE_V_THRESHOLD:g}).")
    return launcher


reshape_and_cache_fp8k_turbo2v = _fixed_bits_write(2)
reshape_and_cache_fp8k_turbo3v = _fixed_bits_write(3)
reshape_and_cache_fp8k_turbo4v = _fixed_bits_write(4)
paged_decode_attn_fp8k_turbo2v = _fixed_bits_decode(2)
paged_decode_attn_fp8k_turbo3v = _fixed_bits_decode(3)
paged_decode_attn_fp8k_turbo4v = _fixed_bits_decode(4)
