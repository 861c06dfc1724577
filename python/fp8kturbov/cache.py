"""The cache object: one layer's K and V pools with their layout, K scale and checked mode.

:class:`KVCache` wraps pools of any array kind that :mod:`fp8kturbov._interop` describes, or
allocates them from a backend (torch, CuPy, or ``cuMemAlloc`` as a :class:`DeviceBuffer`); the
tensor operations of :mod:`fp8kturbov.arrays` launch on it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from . import _device, ops
from ._device import DeviceBuffer
from ._errors import ArgumentError
from ._interop import (check_array, check_max_q_len, check_writable, common_device, describe_now,
                       positive_finite, v_rotation_option)
from ._lib import VRotation
from .checked import ErrorWord
from .layout import CacheLayout

__all__ = ["BACKENDS", "KVCache"]

#: Where pools and workspaces can come from: torch, CuPy, or ``cuMemAlloc`` ("cuda").
BACKENDS = ("torch", "cupy", "cuda")


# ---- Device memory from a backend ---------------------------------------------------------------
def _import_backend(backend: str) -> Any:
    try:
        return importlib.import_module(backend)
    except ImportError as exc:
        raise ImportError(f"backend={backend!r} needs the {backend} package: {exc}") from exc


def allocate(backend: str, shape: tuple[int, ...], dtype: str, device: int) -> Any:
    """Uninitialised device memory from ``backend`` on CUDA device ``device``: a dense torch or
    CuPy array of ``shape`` and ``dtype`` ("uint8" or "bfloat16"; CuPy's bfloat16 is
    ``ml_dtypes.bfloat16``, CuPy >= 14), or for "cuda" a :class:`DeviceBuffer` of ``shape[0]``
    BYTES (uint8 only)."""
    if backend == "torch":
        torch = _import_backend("torch")
        return torch.empty(shape, dtype=getattr(torch, dtype), device=torch.device("cuda", device))
    if backend == "cupy":
        cupy = _import_backend("cupy")
        if dtype == "bfloat16":
            element = importlib.import_module("ml_dtypes").bfloat16
        else:
            element = cupy.uint8
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=element)
    (nbytes,) = shape
    return DeviceBuffer(nbytes, device)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r}, expected one of {', '.join(map(repr, BACKENDS))}")


# ---- The cache object ---------------------------------------------------------------------------
@dataclass(eq=False)
class KVCache:
    """One layer's K and V pools (1-D uint8 device arrays), their layout and the K scale.

    Build it with :meth:`wrap` (pools the caller owns; the constructor does the same) or
    :meth:`allocate` (pools this object owns). ``k_pool``/``v_pool`` are the array objects;
    ``k_ptr``/``v_ptr`` their device addresses; ``device`` the CUDA ordinal (None where no driver
    can tell); ``backend`` where :meth:`decode_workspace` and :func:`dequantize_kv` allocate
    ("torch" or "cupy" for such pools, else "cuda"). Pool sizes are checked in BYTES against
    ``layout.k_pool_bytes`` / ``layout.v_pool_bytes`` (larger pools are accepted; the pages past
    ``num_blocks`` are unused).

    ``checked=True`` turns on checked mode (see :mod:`fp8kturbov.checked`): the cache owns an
    :class:`~fp8kturbov.ErrorWord` on its device (``error_word``; None when unchecked), and
    :func:`write_kv`, :func:`paged_decode` and :func:`dequantize_kv` on it pass
    ``num_blocks = layout.num_blocks`` and that word, so that slots and block-table entries
    outside the first ``layout.num_blocks`` pages are skipped instead of reaching past them.
    :meth:`check_errors` raises :class:`~fp8kturbov.CacheIndexError` for what was skipped; the
    launches never wait for the device, :meth:`check_errors` waits for the stream it is given.

    ``v_rotation`` (a :class:`~fp8kturbov.VRotation` or its lower-case name; head_dim 128, 256 or
    512 for "hadamard"): how V is kept, FORMAT.md §6. :func:`write_kv` rotates each V head before
    it is quantised and :func:`paged_decode` rotates each output head back, so a cache is always
    written and read the same way; :func:`dequantize_kv` returns V as stored (rotated).
    """

    k_pool: Any = field(repr=False)
    v_pool: Any = field(repr=False)
    layout: CacheLayout
    k_scale: float
    checked: bool = False
    v_rotation: VRotation = VRotation.NONE
    backend: str = field(init=False)
    device: int | None = field(init=False)
    k_ptr: int = field(init=False, repr=False)
    v_ptr: int = field(init=False, repr=False)
    owns_memory: bool = field(init=False, default=False)
    closed: bool = field(init=False, default=False)
    error_word: ErrorWord | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        _check_layout(self.layout)
        self.k_scale = positive_finite("k_scale", self.k_scale)
        _check_checked_mode(self.checked, self.layout)
        self.v_rotation = v_rotation_option(self.v_rotation, self.layout)
        pools = (describe_now("k_pool", self.k_pool), describe_now("v_pool", self.v_pool))
        for pool, needed in zip(pools, (self.layout.k_pool_bytes, self.layout.v_pool_bytes)):
            check_array(pool, "uint8", (None,), "[bytes] (1-D)")
            if pool.nbytes < needed:
                raise ArgumentError(pool.name, f"{pool.nbytes} bytes",
                                    f"at least layout.{pool.name}_bytes = {needed}")
            check_writable(pool)
        self.device = common_device(pools, None, "")
        self.k_ptr, self.v_ptr = pools[0].ptr, pools[1].ptr
        self.backend = pools[0].kind if pools[0].kind in ("torch", "cupy") else "cuda"
        if self.checked:
            self.error_word = ErrorWord(self.device or 0)

    @classmethod
    def wrap(cls, k_pool: Any, v_pool: Any, layout: CacheLayout, k_scale: float, *,
             checked: bool = False, v_rotation: VRotation | str = VRotation.NONE) -> KVCache:
        """A cache over pools the caller allocated and keeps owning (any array kind the tensor
        API takes; 1-D uint8, contiguous, writable, on one device). ``checked``,
        ``v_rotation``: see the class docstring."""
        return cls(k_pool, v_pool, layout, k_scale, checked, v_rotation)

    @classmethod
    def allocate(cls, layout: CacheLayout, k_scale: float, *, backend: str = "torch",
                 device: int = 0, checked: bool = False,
                 v_rotation: VRotation | str = VRotation.NONE) -> KVCache:
        """A cache with new, uninitialised pools from ``backend`` ("torch", "cupy", or "cuda" for
        ``cuMemAlloc`` through cuda.bindings) on CUDA device ``device``. The cache owns them:
        :meth:`close` (or the end of a ``with`` block) releases them; "cuda" memory is also freed
        when the pools are garbage-collected. ``checked``, ``v_rotation``: see the class docstring."""
        _check_backend(backend)
        _check_layout(layout)
        positive_finite("k_scale", k_scale)
        _check_checked_mode(checked, layout)
        v_rotation_option(v_rotation, layout)
        k_pool = allocate(backend, (layout.k_pool_bytes,), "uint8", device)
        v_pool = allocate(backend, (layout.v_pool_bytes,), "uint8", device)
        cache = cls(k_pool, v_pool, layout, k_scale, checked, v_rotation)
        cache.owns_memory = True
        return cache

    def decode_workspace(self, num_seqs: int, num_q_heads: int, max_blocks_per_seq: int,
                         sliding_window: int = 0, max_q_len: int = 1) -> Any:
        """Scratch for :func:`paged_decode` with this shape: ``ops.paged_decode_workspace_bytes``
        BYTES (sized for this cache's device, whose SM count sets the split and the head groups)
        of uninitialised memory from this cache's backend, as a 1-D uint8 array (a
        :class:`DeviceBuffer` for "cuda"; empty when neither would help). ``max_q_len`` (1..16):
        the query rows per sequence of a multi-token decode, as passed to :func:`paged_decode`
        with ``query_start`` (the workspace grows with it). Allocate once, reuse every step: a
        decode whose shape needs more than the buffer holds runs unsplit, one KV head per CTA
        (slower, no less correct)."""
        layout = open_cache(self).layout
        max_q_len = check_max_q_len(max_q_len)
        with _device.on_device(self.device):
            nbytes = ops.paged_decode_workspace_bytes(
                max_blocks_per_seq=max_blocks_per_seq, num_seqs=num_seqs, num_q_heads=num_q_heads,
                q_stride=num_q_heads * layout.head_dim, sliding_window=sliding_window,
                k_scale=self.k_scale, max_q_len=max_q_len, **self._layout_args())
        return allocate(self.backend, (nbytes,), "uint8", self.device or 0)

    def prefill_workspace(self, num_seqs: int, num_q_heads: int, max_blocks_per_seq: int, max_q_len: int,
                          num_query_rows: int, sliding_window: int = 0) -> Any:
        """Scratch for :func:`paged_prefill` with this shape: ``ops.paged_prefill_workspace_bytes``
        BYTES of uninitialised memory from this cache's backend, as :meth:`decode_workspace` gives it
        (empty where the plan neither splits nor expands the context)."""
        layout = open_cache(self).layout
        with _device.on_device(self.device):
            nbytes = ops.paged_prefill_workspace_bytes(
                max_blocks_per_seq=max_blocks_per_seq, num_seqs=num_seqs, num_q_heads=num_q_heads,
                q_stride=num_q_heads * layout.head_dim, sliding_window=sliding_window, k_scale=self.k_scale,
                max_q_len=max_q_len, num_query_rows=num_query_rows, **self._layout_args())
        return allocate(self.backend, (nbytes,), "uint8", self.device or 0)

    def check_errors(self, stream: Any = None) -> None:
        """Raise :class:`~fp8kturbov.CacheIndexError` if the launches on this cache queued on
        ``stream`` so far met slots or block-table entries outside ``layout.num_blocks`` pages
        (or seq_lens or query_start out of range), after zeroing the error word for the next ones
        (:meth:`ErrorWord.check <fp8kturbov.ErrorWord.check>`). The host waits for ``stream``
        (any kind the launches take). An :class:`ArgumentError` if the cache is not checked."""
        if open_cache(self).error_word is None:
            raise ArgumentError("cache", "a KVCache built with checked=False",
                                "one built with checked=True")
        self.error_word.check(stream)

    def close(self) -> None:
        """Release the pools and the error word: owned "cuda" memory and the error word are
        freed, torch/CuPy memory goes back to its allocator once unreferenced, wrapped memory
        stays the caller's. Call it once the work on the pools is done. Idempotent; the cache
        is unusable afterwards."""
        if self.owns_memory:
            for pool in (self.k_pool, self.v_pool):
                if isinstance(pool, DeviceBuffer):
                    pool.close()
        if self.error_word is not None:
            self.error_word.close()
            self.error_word = None
        self.k_pool = self.v_pool = None
        self.k_ptr = self.v_ptr = 0
        self.closed = True

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _layout_args(self) -> dict[str, int]:
        """The launchers' layout arguments (counts; page strides and sections in BYTES)."""
        layout = self.layout
        return dict(num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                    block_size=layout.block_size, v_bits=layout.v_bits,
                    k_block_stride_bytes=layout.k_block_stride_bytes,
                    v_block_stride_bytes=layout.v_block_stride_bytes,
                    v_data_section_bytes=layout.v_data_section_bytes)

    def _checked_args(self) -> dict[str, int]:
        """The launchers' checked-mode arguments: pages per pool and the error word's device
        address, or zeros (unchecked)."""
        if self.error_word is None:
            return dict(num_blocks=0, error_flags=0)
        return dict(num_blocks=self.layout.num_blocks, error_flags=self.error_word.ptr)


def _check_layout(layout: Any) -> None:
    if not isinstance(layout, CacheLayout):
        raise TypeError(f"layout: {type(layout).__name__}, expected fp8kturbov.CacheLayout")


def _check_checked_mode(checked: Any, layout: CacheLayout) -> None:
    if not isinstance(checked, bool):
        raise TypeError(f"checked: {type(checked).__name__}, expected bool")
    if checked and layout.num_blocks == 0:  # to the library, num_blocks = 0 means unchecked
        raise ArgumentError("layout", "num_blocks = 0", "at least one page with checked=True")


def open_cache(cache: Any) -> KVCache:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: {type(cache).__name__}, expected fp8kturbov.KVCache")
    if cache.closed:
        raise ArgumentError("cache", "a closed KVCache", "an open one")
    return cache
