"""Raw-pointer launches: the C entry points one to one, for engines that manage their own memory.

Every pointer is a device address given as an ``int`` (0 for none). Sizes named ``*_bytes`` are in
bytes, ``*_stride`` without a unit in elements. ``stream`` may be ``None`` (the legacy default
stream), an ``int`` handle, a ``cuda.bindings.driver.CUstream`` or any object implementing
``__cuda_stream__``. Launches are asynchronous; argument errors raise before anything is launched.
"""

from __future__ import annotations

import ctypes
import math
import operator
from typing import Any

from ._errors import InvalidValueError, Status
from ._lib import DecodeParams, DequantizeParams, WriteParams, check, lib

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_F32_MAX = 3.4028234663852886e38


def stream_handle(stream: Any) -> int:
    """The raw ``CUstream`` value of ``stream`` (see the module docstring for accepted kinds)."""
    if stream is None:
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _unsigned("stream", stream, _U64_MAX)
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        _version, handle = protocol() if callable(protocol) else protocol
        return int(handle)
    try:
        from cuda.bindings import driver
    except ImportError:
        driver = None
    if driver is not None and isinstance(stream, driver.CUstream):
        return int(stream)
    raise TypeError(f"stream: expected None, int, CUstream or __cuda_stream__, got {type(stream)!r}")


def _unsigned(name: str, value: Any, limit: int) -> int:
    """``value`` as an unsigned C integer; ctypes would silently wrap anything out of range."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or not 0 <= number <= limit:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} is not an integer in [0, {limit}]")
    return number


def _float32(name: str, value: Any) -> float:
    """``value`` as a float that fits float32 (NaN and infinities pass: the library judges them)."""
    number = None
    if not isinstance(value, (str, bytes, bytearray)):
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            number = None
    if number is None:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} is not a number")
    if math.isfinite(number) and abs(number) > _F32_MAX:
        raise InvalidValueError(Status.INVALID_VALUE, f"{name} = {value!r} overflows float32")
    return number


def _pointer(name: str, value: int) -> int:
    return _unsigned(name, value, _U64_MAX)


def _fill(params: ctypes.Structure, values: dict[str, Any]) -> dict[str, Any]:
    """Set the struct fields from ``values``, range-checking each by its C type; returns the
    checked values (plain ints and floats) by name."""
    checked = {}
    for name, ctype in params._fields_:
        if name == "struct_size" or name not in values:
            continue
        value = values[name]
        if ctype is ctypes.c_void_p:
            value = _pointer(name, value)
        elif ctype is ctypes.c_uint32:
            value = _unsigned(name, value, _U32_MAX)
        elif ctype is ctypes.c_uint64:
            value = _unsigned(name, value, _U64_MAX)
        elif ctype is ctypes.c_float:
            value = _float32(name, value)
        setattr(params, name, value)
        checked[name] = value
    return checked


def _params(params_type: type[ctypes.Structure], init_sized, fields: dict[str, Any]) -> ctypes.Structure:
    """A ``params_type`` struct set to its defaults by the C ``init_sized`` (``*_params_init_sized``:
    it writes this struct's size only, whichever library version runs it), then to ``fields``
    (each range-checked by its C type)."""
    params = params_type()
    check(init_sized(ctypes.byref(params), ctypes.sizeof(params_type)))
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
    scale search). ``v_rotation``: a :class:`~fp8kturbov.VRotation` (0 = none, the default; 1 =
    each V head rotated first, FORMAT.md §6; decode such a cache with the same ``v_rotation``).

    Checked mode (the header's "Checked mode"): ``num_blocks`` is the number of pages each pool
    holds (0 = unchecked), ``error_flags`` the device address of a 4-byte aligned uint32 word
    (e.g. :attr:`fp8kturbov.ErrorWord.ptr`) the kernel ORs :class:`~fp8kturbov.IndexErrorFlags`
    bits into; read it with :func:`fp8kturbov.check_errors`."""
    params = _params(WriteParams, lib.fp8kturbov_write_params_init_sized, dict(locals()))
    check(lib.fp8kturbov_reshape_and_cache(ctypes.byref(params), stream_handle(stream)))


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
    params = _params(DequantizeParams, lib.fp8kturbov_dequantize_params_init_sized, dict(locals()))
    check(lib.fp8kturbov_dequantize(ctypes.byref(params), stream_handle(stream)))


def _decode_params(fields: dict[str, Any]) -> DecodeParams:
    return _params(DecodeParams, lib.fp8kturbov_decode_params_init_sized, fields)


def paged_decode_attn(
    q: int, k_cache: int, v_cache: int, output: int, block_tables: int, seq_lens: int, *,
    max_blocks_per_seq: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, inv_sqrt_d: float, k_scale: float, q_stride: int,
    v_bits: int, v_block_stride_bytes: int, v_data_section_bytes: int,
    k_block_stride_bytes: int = 0, sliding_window: int = 0, sparse_v_threshold: float = 1e-3,
    workspace: int = 0, workspace_bytes: int = 0, num_blocks: int = 0, error_flags: int = 0,
    sinks: int = 0, soft_cap: float = 0.0, query_start: int = 0, max_q_len: int = 0,
    num_query_rows: int = 0, v_rotation: int = 0, block_tables_stride: int = 0, stream: Any = None,
) -> None:
    """Paged decode attention (``fp8kturbov_paged_decode_attn``); see the C header.

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

    ``k_block_stride_bytes = 0`` means packed K pages; ``sparse_v_threshold = 0`` is exact.
    ``workspace`` is a device buffer of ``workspace_bytes`` bytes (see
    :func:`paged_decode_workspace_bytes`); without it the context is not split across CTAs and
    the KV heads are not read in head groups (docs/api.md).
    ``num_blocks`` (pages per pool), ``error_flags`` (device address): checked mode, as in
    :func:`reshape_and_cache`.
    """
    fields = dict(locals())
    del fields["stream"]
    check(lib.fp8kturbov_paged_decode_attn(ctypes.byref(_decode_params(fields)),
                                           stream_handle(stream)))


def paged_decode_workspace_bytes(
    *, max_blocks_per_seq: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, q_stride: int, v_bits: int, v_block_stride_bytes: int,
    v_data_section_bytes: int, k_block_stride_bytes: int = 0, sliding_window: int = 0,
    inv_sqrt_d: float = 1.0, k_scale: float = 1.0, sparse_v_threshold: float = 1e-3,
    soft_cap: float = 0.0, max_q_len: int = 0, v_rotation: int = 0,
) -> int:
    """Workspace BYTES for :func:`paged_decode_attn` with these scalars on the current device
    (0 when neither a split nor head groups would help). A host query: no synchronisation."""
    result = ctypes.c_uint64()
    check(lib.fp8kturbov_paged_decode_workspace_bytes(ctypes.byref(_decode_params(dict(locals()))),
                                                      ctypes.byref(result)))
    return result.value


def _call_fixed(c_function, params_type: type[ctypes.Structure], names: tuple[str, ...],
                values: tuple[Any, ...], stream: Any) -> None:
    """Range-check ``values`` by the C types of the matching struct fields, then call with the
    checked values (NumPy scalars become plain numbers ctypes accepts)."""
    checked = _fill(params_type(), dict(zip(names, values)))
    check(c_function(*(checked[name] for name in names), stream_handle(stream)))


_WRITE_ARG_NAMES = ("key", "value", "k_cache", "v_cache", "slot_mapping", "num_tokens",
                    "num_kv_heads", "head_dim", "block_size", "key_stride", "value_stride",
                    "k_scale", "k_block_stride_bytes", "v_block_stride_bytes",
                    "v_data_section_bytes")
_DECODE_ARG_NAMES = ("q", "k_cache", "v_cache", "output", "block_tables", "seq_lens",
                     "max_blocks_per_seq", "num_seqs", "num_q_heads", "num_kv_heads", "head_dim",
                     "block_size", "inv_sqrt_d", "k_scale", "q_stride", "v_block_stride_bytes",
                     "v_data_section_bytes", "sliding_window")


def _fixed_bits_write(bits: int):
    c_function = getattr(lib, f"fp8kturbov_reshape_and_cache_fp8k_turbo{bits}v")

    def launcher(key: int, value: int, k_cache: int, v_cache: int, slot_mapping: int,
                 num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
                 key_stride: int, value_stride: int, k_scale: float,
                 k_block_stride_bytes: int, v_block_stride_bytes: int,
                 v_data_section_bytes: int, stream: Any = None) -> None:
        _call_fixed(c_function, WriteParams, _WRITE_ARG_NAMES,
                    (key, value, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads,
                     head_dim, block_size, key_stride, value_stride, k_scale,
                     k_block_stride_bytes, v_block_stride_bytes, v_data_section_bytes), stream)

    launcher.__name__ = launcher.__qualname__ = f"reshape_and_cache_fp8k_turbo{bits}v"
    launcher.__doc__ = (f"``fp8kturbov_reshape_and_cache_fp8k_turbo{bits}v``: the original engine's "
                        f"{bits}-bit write launcher, argument for argument.")
    return launcher


def _fixed_bits_decode(bits: int):
    c_function = getattr(lib, f"fp8kturbov_paged_decode_attn_fp8k_turbo{bits}v")

    def launcher(q: int, k_cache: int, v_cache: int, output: int, block_tables: int,
                 seq_lens: int, max_blocks_per_seq: int, num_seqs: int, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, inv_sqrt_d: float,
                 k_scale: float, q_stride: int, v_block_stride_bytes: int,
                 v_data_section_bytes: int, sliding_window: int, stream: Any = None) -> None:
        _call_fixed(c_function, DecodeParams, _DECODE_ARG_NAMES,
                    (q, k_cache, v_cache, output, block_tables, seq_lens, max_blocks_per_seq,
                     num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, inv_sqrt_d,
                     k_scale, q_stride, v_block_stride_bytes, v_data_section_bytes,
                     sliding_window), stream)

    launcher.__name__ = launcher.__qualname__ = f"paged_decode_attn_fp8k_turbo{bits}v"
    launcher.__doc__ = (f"``fp8kturbov_paged_decode_attn_fp8k_turbo{bits}v``: the original engine's "
                        f"{bits}-bit decode launcher (packed K pages, sparse-V threshold 1e-3).")
    return launcher


reshape_and_cache_fp8k_turbo2v = _fixed_bits_write(2)
reshape_and_cache_fp8k_turbo3v = _fixed_bits_write(3)
reshape_and_cache_fp8k_turbo4v = _fixed_bits_write(4)
paged_decode_attn_fp8k_turbo2v = _fixed_bits_decode(2)
paged_decode_attn_fp8k_turbo3v = _fixed_bits_decode(3)
paged_decode_attn_fp8k_turbo4v = _fixed_bits_decode(4)
