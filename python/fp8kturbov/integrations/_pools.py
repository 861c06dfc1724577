"""One layer's K and V pools behind one interface, on CUDA through the kernels or on the CPU
through the NumPy reference (bit-exact to them by design).

`KernelPools` keeps a :class:`~fp8kturbov.KVCache` of torch pools on the tensors' device and calls
`write_kv`, `paged_decode`, `paged_prefill` and `dequantize_kv`; `ReferencePools` keeps NumPy pools
and calls `reference.write_cache`, `reference.paged_decode` and `reference.dequantize_cache`, its
prefill attending over the dequantised positions (slow, for tiny models and tests). Both take and
return torch tensors and grow their pools as the batch's pages grow
(`fp8kturbov.integrations._paged_batch`). `pools_for` picks one by the tensors' device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._limits import DEFAULT_SPARSE_V_THRESHOLD
from ._dense import prefill_over_dequantized
from ._paged_batch import Step


@dataclass(frozen=True)
class PoolSpec:
    """What a layer's pools hold: the format (``v_bits``, pages of ``block_size`` tokens), the
    write's options (``v_encoder``, ``v_rotation``: lower-case names) and the decode's
    ``sparse_v_threshold`` (None: the library's default)."""

    num_kv_heads: int
    head_dim: int
    v_bits: int
    block_size: int
    v_encoder: str
    v_rotation: str
    sparse_v_threshold: float | None


def pools_for(device: torch.device, spec: PoolSpec, k_scale: float) -> KernelPools | ReferencePools:
    """The pools for tensors on ``device``: the kernels on CUDA, the NumPy reference on the CPU."""
    if device.type == "cuda":
        return KernelPools(spec, k_scale, device)
    if device.type == "cpu":
        return ReferencePools(spec, k_scale)
    raise ValueError(f"the fp8kturbov cache holds CUDA or CPU tensors, not {device.type!r} ones")


def step_array(step: Step, device: torch.device, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The step's array ``name`` on ``device`` as ``dtype``, uploaded once per forward for every
    layer (`Step.uploads`)."""
    key = (name, device)
    if key not in step.uploads:
        step.uploads[key] = torch.from_numpy(np.ascontiguousarray(getattr(step, name))).to(device, dtype)
    return step.uploads[key]


def _grown(capacity: int, needed: int) -> int:
    """A capacity of at least ``needed`` pages, doubling, so that growth costs O(1) per page."""
    return max(needed, 2 * capacity, 1)


class KernelPools:
    """A :class:`~fp8kturbov.KVCache` of torch pools on a CUDA device and the library's kernels."""

    def __init__(self, spec: PoolSpec, k_scale: float, device: torch.device) -> None:
        self.spec, self.k_scale, self.device = spec, k_scale, device
        self.cache: Any = None
        self._workspaces: dict[str, tuple[tuple[int, ...], Any]] = {}

    @property
    def num_pages(self) -> int:
        return 0 if self.cache is None else self.cache.layout.num_blocks

    @property
    def nbytes(self) -> int:
        layout = None if self.cache is None else self.cache.layout
        return 0 if layout is None else layout.k_pool_bytes + layout.v_pool_bytes

    def ensure_pages(self, num_pages: int) -> None:
        if num_pages <= self.num_pages:
            return
        from .. import CacheLayout, KVCache

        spec = self.spec
        layout = CacheLayout(_grown(self.num_pages, num_pages), spec.block_size, spec.num_kv_heads,
                             spec.head_dim, spec.v_bits)
        grown = KVCache.allocate(layout, self.k_scale, backend="torch",
                                 device=self.device.index or 0, v_rotation=spec.v_rotation)
        if self.cache is not None:
            grown.k_pool[:self.cache.k_pool.numel()].copy_(self.cache.k_pool)
            grown.v_pool[:self.cache.v_pool.numel()].copy_(self.cache.v_pool)
            self.cache.close()
        self.cache = grown

    def write(self, key: torch.Tensor, value: torch.Tensor, step: Step) -> None:
        from .. import write_kv

        write_kv(key.to(torch.bfloat16), value.to(torch.bfloat16), self.cache,
                 step_array(step, self.device, "slots", torch.int64), v_encoder=self.spec.v_encoder)

    def decode(self, q: torch.Tensor, step: Step, *, appended: tuple[torch.Tensor, torch.Tensor],
               scaling: float, sliding_window: int, soft_cap: float, sinks: torch.Tensor | None) -> torch.Tensor:
        """The step's query rows attending the cache, after the same rows' new K and V
        (``appended``) are written into it: one launch, the decode's fused append."""
        from .. import paged_decode

        multi = not step.one_token_each
        max_q_len = step.max_new_tokens if multi else 1
        key, value = appended
        return paged_decode(
            *self._attention_inputs(q, step), inv_sqrt_d=scaling, sliding_window=sliding_window,
            sparse_v_threshold=self.spec.sparse_v_threshold, soft_cap=soft_cap, sinks=self._sinks(sinks),
            workspace=self._workspace_for("decode", self.cache.decode_workspace, len(step.seq_lens), q.shape[1],
                                          step.block_tables.shape[1], sliding_window, max_q_len),
            query_start=step_array(step, self.device, "query_start", torch.int32) if multi else None,
            max_q_len=max_q_len if multi else None, append_key=key.to(torch.bfloat16).contiguous(),
            append_value=value.to(torch.bfloat16).contiguous(),
            append_slot_mapping=step_array(step, self.device, "query_slots", torch.int64), v_encoder=self.spec.v_encoder)

    def prefill(self, q: torch.Tensor, step: Step, *, scaling: float, sliding_window: int, soft_cap: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
        """The step's chunks (``q``: its query rows), written to the cache before, attending it:
        one launch of the paged prefill."""
        from .. import paged_prefill

        max_q_len = step.max_new_tokens
        return paged_prefill(
            *self._attention_inputs(q, step), step_array(step, self.device, "query_start", torch.int32),
            max_q_len=max_q_len, inv_sqrt_d=scaling, sliding_window=sliding_window, soft_cap=soft_cap,
            sinks=self._sinks(sinks),
            workspace=self._workspace_for("prefill", self.cache.prefill_workspace, len(step.seq_lens), q.shape[1],
                                          step.block_tables.shape[1], max_q_len, q.shape[0], sliding_window))

    def read(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        from .. import dequantize_kv

        return dequantize_kv(self.cache, self._upload(slots, torch.int64))

    def copy_pages(self, source: np.ndarray, destination: np.ndarray) -> None:
        layout = self.cache.layout
        src = torch.from_numpy(source).to(self.device)
        dst = torch.from_numpy(destination).to(self.device)
        for pool, stride in ((self.cache.k_pool, layout.k_block_stride_bytes),
                             (self.cache.v_pool, layout.v_block_stride_bytes)):
            pages = pool.view(layout.num_blocks, stride)
            pages[dst] = pages[src]  # the gather is complete before the scatter

    def _attention_inputs(self, q: torch.Tensor, step: Step) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """The leading arguments of both attentions: the query rows as bf16, the cache, the step's
        block tables and lengths on the device."""
        return (q.to(torch.bfloat16).contiguous(), self.cache,
                step_array(step, self.device, "block_tables", torch.int32),
                step_array(step, self.device, "seq_lens", torch.int32))

    @staticmethod
    def _sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
        return None if sinks is None else sinks.to(torch.float32).contiguous()

    def _upload(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, dtype)

    def _workspace_for(self, op: str, make: Callable[..., Any], *shape: int) -> Any:
        """``op``'s workspace (``make(*shape)``), kept while its shape stays (a new one each time the
        table gains a page column)."""
        kept = self._workspaces.get(op)
        if kept is None or kept[0] != shape:
            kept = self._workspaces[op] = (shape, make(*shape))
        return kept[1]


class ReferencePools:
    """NumPy pools and the NumPy reference (CPU tensors)."""

    def __init__(self, spec: PoolSpec, k_scale: float) -> None:
        from .. import reference

        self.spec, self.k_scale, self.reference = spec, k_scale, reference
        args = (spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k_page_bytes = reference.k_page_bytes(*args)
        self.v_page_bytes = reference.v_page_bytes(*args, spec.v_bits)
        self.layout_args = dict(
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, block_size=spec.block_size,
            k_block_stride_bytes=self.k_page_bytes, v_block_stride_bytes=self.v_page_bytes,
            v_data_section_bytes=reference.v_data_section_bytes(*args, spec.v_bits))
        self.k_pool = np.zeros(0, dtype=np.uint8)
        self.v_pool = np.zeros(0, dtype=np.uint8)

    @property
    def num_pages(self) -> int:
        return self.k_pool.size // self.k_page_bytes

    @property
    def nbytes(self) -> int:
        return self.k_pool.size + self.v_pool.size

    def ensure_pages(self, num_pages: int) -> None:
        if num_pages <= self.num_pages:
            return
        pages = _grown(self.num_pages, num_pages)
        for name, page_bytes in (("k_pool", self.k_page_bytes), ("v_pool", self.v_page_bytes)):
            grown = np.zeros(pages * page_bytes, dtype=np.uint8)
            old = getattr(self, name)
            grown[:old.size] = old
            setattr(self, name, grown)

    def write(self, key: torch.Tensor, value: torch.Tensor, step: Step) -> None:
        n = self.spec.num_kv_heads * self.spec.head_dim
        self.reference.write_cache(
            _bf16_values(key), _bf16_values(value), self.k_pool, self.v_pool, step.slots,
            len(step.slots),
            key_stride=n, value_stride=n, k_scale=self.k_scale, bits=self.spec.v_bits,
            encoder=self.spec.v_encoder, rotation=self.spec.v_rotation == "hadamard",
            **self.layout_args)

    def decode(self, q: torch.Tensor, step: Step, *, appended: tuple[torch.Tensor, torch.Tensor],
               scaling: float, sliding_window: int, soft_cap: float, sinks: torch.Tensor | None) -> torch.Tensor:
        """As `KernelPools.decode`: the rows' new K and V written (as the fused append writes
        them), then the decode."""
        n = self.spec.num_kv_heads * self.spec.head_dim
        key, value = appended
        self.reference.write_cache(
            _bf16_values(key), _bf16_values(value), self.k_pool, self.v_pool, step.query_slots,
            len(step.query_slots), key_stride=n, value_stride=n, k_scale=self.k_scale, bits=self.spec.v_bits,
            encoder=self.spec.v_encoder, rotation=self.spec.v_rotation == "hadamard", **self.layout_args)
        num_rows, num_q_heads, head_dim = q.shape
        threshold = self.spec.sparse_v_threshold
        out = self.reference.paged_decode(
            _bf16_values(q), self.k_pool, self.v_pool, step.block_tables, step.seq_lens,
            step.block_tables.shape[1], len(step.seq_lens), num_q_heads, inv_sqrt_d=scaling,
            k_scale=self.k_scale, q_stride=num_q_heads * head_dim, sliding_window=sliding_window,
            bits=self.spec.v_bits,
            sparse_v_threshold=DEFAULT_SPARSE_V_THRESHOLD if threshold is None else threshold,
            query_start=None if step.one_token_each else step.query_start,
            sinks=None if sinks is None else sinks.detach().float().numpy(), soft_cap=soft_cap,
            rotation=self.spec.v_rotation == "hadamard", **self.layout_args)
        return torch.from_numpy(out).to(torch.bfloat16)  # the kernels' output type

    def prefill(self, q: torch.Tensor, step: Step, *, scaling: float, sliding_window: int, soft_cap: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
        """As `KernelPools.prefill`, over the positions the reference dequantises."""
        return prefill_over_dequantized(self.read, q, step, rotated=self.spec.v_rotation == "hadamard",
                                        scaling=scaling, sliding_window=sliding_window, soft_cap=soft_cap,
                                        sinks=sinks)

    def read(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        key, value = self.reference.dequantize_cache(
            self.k_pool, self.v_pool, slots, len(slots), k_scale=self.k_scale, bits=spec.v_bits,
            **self.layout_args)
        shape = (len(slots), spec.num_kv_heads, spec.head_dim)
        return (torch.from_numpy(key.astype(np.float32)).to(torch.bfloat16).view(shape),
                torch.from_numpy(value.astype(np.float32)).to(torch.bfloat16).view(shape))

    def copy_pages(self, source: np.ndarray, destination: np.ndarray) -> None:
        for name, page_bytes in (("k_pool", self.k_page_bytes), ("v_pool", self.v_page_bytes)):
            pages = getattr(self, name).reshape(-1, page_bytes)
            pages[destination] = pages[source]  # the gather is complete before the scatter


def _bf16_values(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values rounded to bf16 (what the kernels read), as a float32 NumPy array."""
    return tensor.detach().to(torch.bfloat16).float().contiguous().numpy()
