"""The library's launches of one case: cache pages encoded by the NumPy reference and replicated
through device pools (`encode_chunk`, `replicate`), one input set's buffers and arguments, and the
decode, prefill and write calls (`decode_enqueues`, `prefill_enqueues`, `write_enqueues`: one
launch per input set)."""

from __future__ import annotations

import functools
import importlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fp8kturbov import (CacheLayout, VEncoder, VRotation, paged_decode_attn, paged_decode_workspace_bytes,
                        paged_prefill_attn, paged_prefill_workspace_bytes, reshape_and_cache)
from fp8kturbov._device import BenchError, Device, first_line

from .config import BF16_BYTES, Config, Shape

E4M3_MAX = 448.0


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BenchError(f"the benchmark needs {module} ({first_line(exc)}); "
                         "pip install ml-dtypes") from None


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) of float32 ``values``, rounded to nearest even."""
    return values.astype(_require("ml_dtypes").bfloat16).view(np.uint16)


@dataclass(frozen=True)
class Chunk:
    """Whole pages of cache bytes encoded by the NumPy reference, to be replicated on the device."""

    k_pages: np.ndarray  # uint8, packed K pages
    v_pages: np.ndarray  # uint8, packed V pages
    k_scale: float


def encode_chunk(shape: Shape, tokens: int, rng: np.random.Generator) -> Chunk:
    """``tokens`` rows (rounded up to whole pages) of N(0, 1) bf16 K and V written by
    `reference.write_cache` into packed pools of their own; ``k_scale = max|K| / 448``."""
    ref = _require("fp8kturbov.reference")
    pages = -(-tokens // shape.block_size)
    layout = CacheLayout(pages, shape.block_size, shape.num_kv_heads, shape.head_dim, shape.bits)
    n, slots = layout.row_elems, layout.num_slots
    key, value = (rng.standard_normal((slots, n), dtype=np.float32) for _ in range(2))
    key_bits, value_bits = bf16_bits(key), bf16_bits(value)
    bf16 = _require("ml_dtypes").bfloat16
    k_scale = float(np.abs(key_bits.view(bf16).astype(np.float32)).max()) / E4M3_MAX
    k_pages = np.zeros(layout.k_pool_bytes, np.uint8)
    v_pages = np.zeros(layout.v_pool_bytes, np.uint8)
    ref.write_cache(key_bits.view(bf16), value_bits.view(bf16), k_pages, v_pages, np.arange(slots),
                    slots, shape.num_kv_heads, shape.head_dim, shape.block_size, n, n, k_scale,
                    layout.k_block_stride_bytes, layout.v_block_stride_bytes,
                    layout.v_data_section_bytes, shape.bits)
    return Chunk(k_pages, v_pages, k_scale)


def replicate(dev: Device, dst: int, nbytes: int, pattern: np.ndarray) -> None:
    """Fill ``nbytes`` at ``dst`` with repeats of ``pattern``: one upload, then device copies
    that double the filled part (a logarithmic number of copies)."""
    filled = min(nbytes, pattern.nbytes)
    dev.write(dst, pattern[:filled])
    while filled < nbytes:
        step = min(filled, nbytes - filled)
        dev.copy(dst + filled, dst, step)
        filled += step


def case_layout(shape: Shape) -> CacheLayout:
    """The page layout of one input set's pools (`Shape.num_blocks` pages)."""
    return CacheLayout(shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
                       shape.bits)


@dataclass(frozen=True)
class DecodeBuffers:
    """Device addresses of one decode (or prefill) input set."""

    q: int
    k_cache: int
    v_cache: int
    output: int
    block_tables: int
    seq_lens: int
    workspace: int
    workspace_bytes: int


@dataclass(frozen=True)
class WriteBuffers:
    """Device addresses of one write input set."""

    key: int
    value: int
    k_cache: int
    v_cache: int
    slot_mapping: int


def page_strides(layout: CacheLayout) -> dict[str, int]:
    """The page-layout arguments (bytes) that every library call takes."""
    return {"k_block_stride_bytes": layout.k_block_stride_bytes,
            "v_block_stride_bytes": layout.v_block_stride_bytes,
            "v_data_section_bytes": layout.v_data_section_bytes}


def decode_scalars(shape: Shape, layout: CacheLayout, k_scale: float,
                   sparse_v_threshold: float) -> dict[str, Any]:
    """The decode's scalar arguments for ``shape`` (shared by the launch and the workspace query;
    ``max_q_len`` sizes both, and is ignored by the launch without `query_start_arguments`)."""
    return dict(max_blocks_per_seq=shape.planned_blocks, num_seqs=shape.batch,
                num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim, block_size=shape.block_size,
                inv_sqrt_d=shape.head_dim ** -0.5, k_scale=k_scale,
                q_stride=shape.num_q_heads * shape.head_dim, v_bits=shape.bits,
                sparse_v_threshold=sparse_v_threshold, max_q_len=shape.q_len,
                **page_strides(layout))


def prefill_scalars(shape: Shape, layout: CacheLayout, k_scale: float) -> dict[str, Any]:
    """The prefill's scalar arguments: the decode's (`decode_scalars`, ``max_q_len`` the chunk)
    but the sparse-V threshold, which the prefill has not (it is exact), and the query rows, which size
    its workspace."""
    scalars = decode_scalars(shape, layout, k_scale, 0.0)
    del scalars["sparse_v_threshold"]
    return {**scalars, "num_query_rows": shape.query_rows}


def query_start_arguments(dev: Device, shape: Shape) -> dict[str, Any]:
    """The query rows of one input set (multi-token decode, prefill): `Shape.query_start` uploaded
    and ``num_query_rows``; none for a decode of one query row per sequence."""
    starts = shape.query_start
    if starts is None:
        return {}
    return {"query_start": dev.upload(starts), "num_query_rows": shape.query_rows}


def launch_options(dev: Device, shape: Shape, layout: CacheLayout, config: Config) -> dict[str, Any]:
    """The optional arguments of one input set's launch: checked mode (the pools' page count and
    a zeroed error word), the decode's and the prefill's sinks (zero logits), soft cap, query rows
    (`query_start_arguments`) and block-table row stride (rows wider than `Shape.planned_blocks`),
    the write's V encoder, the V rotation (every op); only those ``config`` and ``shape`` turn
    on."""
    options: dict[str, Any] = {}
    if config.v_rotation != "none":
        options["v_rotation"] = VRotation[config.v_rotation.upper()]
    if config.checked:
        word = dev.alloc(4)
        dev.memset(word, 0, 4)
        options.update(num_blocks=layout.num_blocks, error_flags=word)
    if shape.op != "write":
        if config.sinks:
            options["sinks"] = dev.upload(np.zeros(shape.num_q_heads, dtype=np.float32))
        if config.soft_cap:
            options["soft_cap"] = config.soft_cap
        if shape.table_blocks != shape.planned_blocks:
            options["block_tables_stride"] = shape.table_blocks
        options.update(query_start_arguments(dev, shape))
    if config.v_encoder != "matched_norm" and (shape.op == "write" or shape.append == "fused"):
        options["v_encoder"] = VEncoder[config.v_encoder.upper()]
    return options


def _attend(attention: Callable[..., None], scalars: dict[str, Any], buffers: DecodeBuffers,
            stream: Any) -> None:
    attention(
        buffers.q, buffers.k_cache, buffers.v_cache, buffers.output, buffers.block_tables,
        buffers.seq_lens, workspace=buffers.workspace, workspace_bytes=buffers.workspace_bytes,
        stream=stream, **scalars)


def launch_decode(scalars: dict[str, Any], buffers: DecodeBuffers, stream: Any) -> None:
    """The benchmark's one call of the library's decode, with its split-K workspace."""
    _attend(paged_decode_attn, scalars, buffers, stream)


def launch_prefill(scalars: dict[str, Any], buffers: DecodeBuffers, stream: Any) -> None:
    """The benchmark's one call of the library's prefill (``scalars`` hold ``query_start``), with
    its workspace."""
    _attend(paged_prefill_attn, scalars, buffers, stream)


def launch_write(shape: Shape, layout: CacheLayout, k_scale: float, buffers: WriteBuffers,
                 stream: Any, options: dict[str, Any] | None = None, num_tokens: int | None = None) -> None:
    """The benchmark's one call of the library's cache write (``options``: `launch_options`) of
    ``num_tokens`` rows (default: a write shape's ``batch``)."""
    reshape_and_cache(
        buffers.key, buffers.value, buffers.k_cache, buffers.v_cache, buffers.slot_mapping,
        num_tokens=shape.batch if num_tokens is None else num_tokens, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=shape.block_size, key_stride=shape.row_elems, value_stride=shape.row_elems,
        k_scale=k_scale, v_bits=shape.bits, stream=stream, **page_strides(layout), **(options or {}))


def block_table(shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """A decode's int32 block table ``[batch, table_blocks]``: the pools' pages in a random
    order, `Shape.blocks_per_seq` per sequence, then page 0 to the row's end."""
    pages = rng.permutation(shape.num_blocks).astype(np.int32).reshape(shape.batch, shape.blocks_per_seq)
    return np.pad(pages, ((0, 0), (0, shape.table_blocks - shape.blocks_per_seq)))


def step_slots(shape: Shape, table: np.ndarray) -> np.ndarray:
    """The int64 slots of the step's new tokens through the block table: query row ``i`` of
    sequence ``s`` at position ``seq_len - q_len + i``."""
    positions = shape.seq_lens[:, None].astype(np.int64) - shape.q_len + np.arange(shape.q_len)
    pages = np.take_along_axis(table, positions // shape.block_size, axis=1).astype(np.int64)
    return (pages * shape.block_size + positions % shape.block_size).reshape(-1)


def step_enqueue(dev: Device, shape: Shape, config: Config, layout: CacheLayout, k_scale: float,
                 scalars: dict[str, Any], buffers: DecodeBuffers, table: np.ndarray,
                 rng: np.random.Generator) -> Callable[[], None]:
    """One step of ``shape.append``: the decode alone ("none"), with its fused append of one
    N(0, 1) bf16 K and V row per query row ("fused"), or the cache write of those rows and then
    the decode ("write")."""
    decode = functools.partial(launch_decode, scalars, buffers, dev.stream)
    if shape.append == "none":
        return decode
    key, value = (dev.upload(bf16_bits(rng.standard_normal((shape.query_rows, shape.row_elems), dtype=np.float32)))
                  for _ in range(2))
    slots = dev.upload(step_slots(shape, table))
    if shape.append == "fused":
        append = dict(append_key=key, append_value=value, append_slot_mapping=slots,
                      append_key_stride=shape.row_elems, append_value_stride=shape.row_elems)
        return functools.partial(launch_decode, {**scalars, **append}, buffers, dev.stream)
    rows = WriteBuffers(key=key, value=value, k_cache=buffers.k_cache, v_cache=buffers.v_cache, slot_mapping=slots)
    write = functools.partial(launch_write, shape, layout, k_scale, rows, dev.stream,
                              launch_options(dev, dataclasses.replace(shape, op="write"), layout, config),
                              shape.query_rows)

    def write_then_decode() -> None:
        write()
        decode()
    return write_then_decode


def attention_buffers(dev: Device, shape: Shape, layout: CacheLayout, chunk: Chunk, workspace_bytes: int,
                      rng: np.random.Generator) -> tuple[DecodeBuffers, np.ndarray]:
    """One decode or prefill input set and its block table (`block_table`): pools filled with
    ``chunk`` (the whole context written before any launch), sequences as long as
    `Shape.seq_lens`, random bf16 q of ``q_len`` rows per sequence, a workspace of
    ``workspace_bytes``."""
    q = rng.standard_normal(shape.q_elems, dtype=np.float32)
    table = block_table(shape, rng)
    buffers = DecodeBuffers(
        q=dev.upload(bf16_bits(q)), k_cache=dev.alloc(layout.k_pool_bytes),
        v_cache=dev.alloc(layout.v_pool_bytes), output=dev.alloc(shape.q_elems * BF16_BYTES),
        block_tables=dev.upload(table),
        seq_lens=dev.upload(shape.seq_lens),
        workspace=dev.alloc(workspace_bytes) if workspace_bytes else 0,
        workspace_bytes=workspace_bytes)
    replicate(dev, buffers.k_cache, layout.k_pool_bytes, chunk.k_pages)
    replicate(dev, buffers.v_cache, layout.v_pool_bytes, chunk.v_pages)
    return buffers, table


def decode_enqueues(dev: Device, shape: Shape, config: Config, chunk: Chunk,
                    rng: np.random.Generator) -> list[Callable[[], None]]:
    """One decode step per input set (`step_enqueue`) over `attention_buffers`: each sequence
    on its own pages in a random order (block-table rows of `Shape.table_blocks` pages, page 0
    past the sequence's own)."""
    layout = case_layout(shape)
    scalars = decode_scalars(shape, layout, chunk.k_scale, config.sparse_v_threshold)
    workspace_bytes = paged_decode_workspace_bytes(**scalars)
    enqueues = []
    for _ in range(config.sets):
        buffers, table = attention_buffers(dev, shape, layout, chunk, workspace_bytes, rng)
        launch_scalars = {**scalars, **launch_options(dev, shape, layout, config)}
        enqueues.append(step_enqueue(dev, shape, config, layout, chunk.k_scale, launch_scalars, buffers, table, rng))
    return enqueues


def prefill_enqueues(dev: Device, shape: Shape, config: Config, chunk: Chunk,
                     rng: np.random.Generator) -> list[Callable[[], None]]:
    """One prefill launch per input set over `attention_buffers` (each sequence's chunk the last
    ``q_len`` positions of its context, already in the pools), with the workspace that
    `paged_prefill_workspace_bytes` asks for."""
    layout = case_layout(shape)
    scalars = prefill_scalars(shape, layout, chunk.k_scale)
    workspace_bytes = paged_prefill_workspace_bytes(**scalars)
    enqueues = []
    for _ in range(config.sets):
        buffers, _table = attention_buffers(dev, shape, layout, chunk, workspace_bytes, rng)
        launch_scalars = {**scalars, **launch_options(dev, shape, layout, config)}
        enqueues.append(functools.partial(launch_prefill, launch_scalars, buffers, dev.stream))
    return enqueues


def write_enqueues(dev: Device, shape: Shape, config: Config,
                   rng: np.random.Generator) -> list[Callable[[], None]]:
    """One write launch per input set: N(0, 1) bf16 rows to distinct random slots."""
    layout = case_layout(shape)
    key, value = (rng.standard_normal((shape.batch, shape.row_elems), dtype=np.float32)
                  for _ in range(2))
    k_scale = float(np.abs(key).max()) / E4M3_MAX
    key_bits, value_bits = bf16_bits(key), bf16_bits(value)
    enqueues = []
    for _ in range(config.sets):
        slots = rng.permutation(layout.num_slots)[:shape.batch].astype(np.int64)
        buffers = WriteBuffers(
            key=dev.upload(key_bits), value=dev.upload(value_bits),
            k_cache=dev.alloc(layout.k_pool_bytes), v_cache=dev.alloc(layout.v_pool_bytes),
            slot_mapping=dev.upload(slots))
        enqueues.append(functools.partial(launch_write, shape, layout, k_scale, buffers, dev.stream,
                                          launch_options(dev, shape, layout, config)))
    return enqueues
