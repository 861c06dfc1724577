"""Benchmark harness: paged decode and cache write against the device's memory roofline.

Run it as ``python -m fp8kturbov bench`` (``--help`` lists the options) or call `run_benchmarks`.
Everything is measured in one process on one GPU, through cuda.bindings (driver API) alone; torch
is imported only for the BF16 peer and flashinfer only for the FP8 peer. The driver calls and
`Device` live in `fp8kturbov._device` (``bench.Device`` is that class).

What is measured
----------------
* **read bandwidth**: a kernel that reads ``Config.ceiling_bytes`` (2 GiB) with 16-byte loads,
  4 in flight per thread, 8 CTAs of 256 threads per SM (``cuda/bench``); the median of 30
  event-timed reads after 3 warm-up reads. It is the ceiling that every "% of ceiling" and every
  floor refers to: what plain streaming reads reach on this device, somewhat below the
  datasheet's HBM bandwidth. A decode mostly reads, so this is the bound it is held to.
* **copy bandwidth (read+write)**: one ``cuMemcpyDtoDAsync`` of ``Config.ceiling_bytes``, counting
  the bytes read plus the bytes written, timed the same way; reported beside the ceiling (the
  ceiling of earlier versions of this harness: about 4250 GB/s on an H200, where traffic that
  only reads goes faster, torch SDPA's long BF16 decode about 4600 GB/s).
* **launch floor**: a CUDA graph holding one empty kernel (one warp, ``cuda/bench``), timed exactly
  like the library's launches: the smallest time this method reports for any launch.
* **decode / write**: one library launch per CUDA graph (one graph per input set), replayed.
* **plain read** (``plain_read_us``, decode rows and their peers): the read kernel of the ceiling
  over exactly the row's bytes, one launch per CUDA graph replay, rotating as many buffers as the
  row has input sets. It is what one launch that must read those bytes takes at best on this
  device, its launch, ramp-up and tail included, where the floor counts the bytes alone: a short
  row's plain read lies well above its floor (on an H200, 48 MB take 14.9 µs against 10.7 µs).
* **in-graph time** (``in_graph_us``, also of the launch floor): one CUDA graph of 32 launches
  back to back, rotating the input sets, replayed; its time divided by 32. That is what a launch
  costs inside an engine's captured decode step: a graph node, without a graph launch of its own.
* **peers** (decode only, shared by the rows of one shape whatever the V bits): torch's
  ``scaled_dot_product_attention`` over contiguous BF16 K/V (``bf16_sdpa``); the straightforward
  FP8 cache decode in torch, contiguous FP8 E4M3 K/V cast to BF16 in each decode and then the same
  SDPA (``fp8_sdpa``); and flashinfer's paged decode over an FP8 E4M3 cache (``fp8_flashinfer``).
  Each is "absent" when its modules are not importable; all decode one query token per sequence,
  so they do not run with ``q_len > 1`` (``--q-len``, the multi-token decode through
  ``query_start``).

How a time is taken
-------------------
Sample ``i`` is: an event, the launch for input set ``i mod sets``, an event, all on one stream;
the reported time is the median over samples. The samples are queued behind a gate (the stream
waits with ``cuStreamWaitValue32`` on a device word that a second stream writes once a chunk of
samples is queued), so the GPU runs them back to back and the host's cost of launching is not
timed (on an H200 the launch floor reads 2.4 µs so, 4.3 µs without the gate). Where the driver
refuses stream memory operations, or when asked (``Device(timing_gate=False)``,
``--no-timing-gate``: under compute-sanitizer's initcheck, gated runs never finished), the gate is
off (``timing_gate`` in the device dict) and short launches then include some host time. Input
sets rotate so that consecutive launches read different memory; a row whose sets together fit in
L2 is marked "L2" and its bandwidth may exceed the ceiling (the H200's L2 holds 60 MB: the short
shapes fit). Each set's own median is kept too (``set_medians_us``): where they lie more than 5 %
apart the row is marked "sets N %", since its median then is one set's time rather than the
others' and moves between runs with the sets (memory placement, say); where a row moves between
runs although its sets agree, the cause lies elsewhere. One such cause is the GPU's power limit
(or its temperature) holding its clocks down, which slows an issue-bound kernel: NVML's counters
of that time (`fp8kturbov.tools._nvml`) are read around each row's timing and each peer's, and kept
as ``clock_limited`` (the share of the measuring time per limit); a row where a limit held the
clocks for more than 1 % of it is marked "power cap N %" or "thermal N %". Where NVML is not
available the report says so and nothing is marked.

Power (``power_window_s``, ``--power-window``): after a row's timing its launches run back to back
(in graphs of `GRAPH_CHAIN`; a peer's, one per graph replay) for about that many seconds more, and
NVML's energy counter gives the board's mean power over them, from one of its steps (about every
100 ms on an H200) to another: ``power_w``, and ``energy_mj`` per launch at the row's time. It is
the whole board's power, idle share included; short launches whose host cost exceeds their GPU
time leave the GPU gaps and read low.

Units
-----
Sizes are bytes unless named ``*_elems``; times are microseconds (µs); bandwidths are GB/s with
1 GB = 1e9 bytes. "Bytes" of a launch are the bytes the format obliges it to move
(`launch_bytes`), not what a profiler would count; the floor is those bytes over the ceiling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from fp8kturbov import (CacheLayout, VEncoder, VRotation, paged_decode_attn, paged_decode_workspace_bytes,
                        reshape_and_cache, version)
from fp8kturbov._device import BenchError, Device, cu, driver_call, first_line
from fp8kturbov._lib import ROTATION_HEAD_DIMS
from fp8kturbov.arrays import MAX_Q_LEN

from . import _bench_kernels
from ._bench_kernels import READ_ALIGNMENT
from ._nvml import NvmlCounters

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_DECODE_SHAPES: tuple[tuple[int, int], ...] = (
    (1, 32768), (1, 131072), (8, 8192), (32, 8192), (128, 2048), (32, 32768), (1, 1024), (8, 4096))
DEFAULT_WRITE_TOKENS: tuple[int, ...] = (1, 16, 128, 32768)
OPS = ("decode", "write")
#: How the decode's sequences of a shape ``BxC`` are long: all ``C`` tokens ("equal"), or
#: sequence ``i`` of ``B`` holding ``ceil(C * (i + 1) / B)`` ("ramp": up to ``C``, about half of
#: the tokens, a batch of mixed lengths such as continuous batching makes).
LENGTHS = ("equal", "ramp")
V_BITS = (2, 3, 4)
V_ENCODER_NAMES = tuple(encoder.name.lower() for encoder in VEncoder)
V_ROTATION_NAMES = tuple(rotation.name.lower() for rotation in VRotation)
E4M3_MAX = 448.0
BF16_BYTES = 2
COPY_ITERS, COPY_WARMUP = 30, 3  # timed and warm-up runs of the ceiling's read and copy
#: Launches per graph for the in-graph time. An engine captures a whole decode step (every layer's
#: write and decode) in one graph, where a launch costs a graph node rather than a graph launch.
#: A sample of the chain averages this many launches, so it gets a quarter of `Config.iters`.
GRAPH_CHAIN = 32
READ_CTAS_PER_SM = 8  # CTAs of the read kernel per SM: 2048 threads, a full SM
#: Samples queued behind one gate. Kept small: were the launch queue to fill while the stream
#: waits, the host would block inside a launch and never open the gate.
GATE_CHUNK = 32
#: Share of the free device memory a case (or a peer) may take; the rest is slack for the
#: allocator's rounding and whatever torch keeps cached.
MEMORY_HEADROOM = 0.9
#: The ``"schema"`` of the JSON that `write_json` writes.
BENCH_SCHEMA = "fp8kturbov-bench/1"


class PeerUnavailable(Exception):
    """A peer that cannot run here; the message is its status ("absent", "skipped: ...")."""


# ---- Configuration -------------------------------------------------------------------------------


def parse_count(text: str) -> int:
    """A positive integer, optionally with a ``k`` suffix (x1024): ``"32768"``, ``"32k"``."""
    body = text.strip().lower()
    scale = 1024 if body.endswith("k") else 1
    digits = body[:-1] if scale > 1 else body
    if not digits.isdigit() or int(digits) == 0:
        raise ValueError(f"{text!r} is not a positive integer (a 'k' suffix means x1024)")
    return int(digits) * scale


def parse_counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of `parse_count` values: ``"128,256"``."""
    return tuple(parse_count(item) for item in text.split(","))


def parse_q_len(text: str) -> int:
    """Query tokens per sequence: a `parse_count` of at most ``MAX_Q_LEN`` (the library's limit)."""
    count = parse_count(text)
    if count > MAX_Q_LEN:
        raise ValueError(f"{text!r} is more than {MAX_Q_LEN} query tokens per sequence")
    return count


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """Decode shapes ``"BATCHxCONTEXT,..."``: ``"1x32768,8x8k"`` -> ``((1, 32768), (8, 8192))``."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2:
            raise ValueError(f"shape {item!r} is not BATCHxCONTEXT (e.g. 8x8192)")
        shapes.append((parse_count(parts[0]), parse_count(parts[1])))
    return tuple(shapes)


def sequence_lengths(batch: int, context: int, lengths: str) -> np.ndarray:
    """The int32 ``seq_lens`` of a decode shape ``batch x context`` (tokens), as `LENGTHS` says."""
    if lengths == "ramp":
        sequence = np.arange(1, batch + 1, dtype=np.int64)
        return (-(-context * sequence // batch)).astype(np.int32)
    return np.full(batch, context, np.int32)


@dataclass(frozen=True)
class Config:
    """What to run. Counts are elements/tokens/sequences; ``ceiling_bytes`` is bytes."""

    ops: tuple[str, ...] = OPS
    shapes: tuple[tuple[int, int], ...] = DEFAULT_DECODE_SHAPES  # decode: (batch, context tokens)
    tokens: tuple[int, ...] = DEFAULT_WRITE_TOKENS  # write: token rows per launch
    bits: tuple[int, ...] = V_BITS
    head_dims: tuple[int, ...] = (128,)
    num_q_heads: int = 32
    num_kv_heads: int = 8
    block_size: int = 16
    iters: int = 200  # timed samples per case
    warmup: int = 20  # untimed launches before them
    sets: int = 3  # input sets rotated among
    sparse_v_threshold: float = 1e-3
    checked: bool = False  # checked mode (pool capacity and an error word) on every launch
    v_encoder: str = "matched_norm"  # the write's V encoder (a lower-case VEncoder name)
    soft_cap: float = 0.0  # decode logit soft-capping, 0 = off
    sinks: bool = False  # decode with attention sinks (zero logits)
    v_rotation: str = "none"  # write and decode with this V rotation (a lower-case VRotation name)
    q_len: int = 1  # decode: query tokens per sequence (1: no query_start, the one-token decode)
    lengths: str = "equal"  # decode: one of LENGTHS
    table_positions: int = 0  # decode: block-table row width in positions; 0 = each shape's context
    whole_table_rows: bool = False  # decode: plan for the row width (else pass the pages, stride = width)
    peers: bool = True  # not run with q_len > 1: they decode one query token per sequence
    ceiling_bytes: int = 2 * GiB  # read by the ceiling's kernel, and copied by the copy
    chunk_tokens: int = 2048  # token rows the NumPy reference encodes, replicated through the pools
    seed: int = 0
    power_window_s: float = 0.0  # seconds of back-to-back launches per row for its mean power; 0 = off

    def __post_init__(self) -> None:
        problems = [f"op {op!r} is not one of {OPS}" for op in self.ops if op not in OPS]
        problems += [f"V bits {b} is not one of {V_BITS}" for b in self.bits if b not in V_BITS]
        problems += [f"head_dim {d} is not a positive multiple of 16"
                     for d in self.head_dims if d <= 0 or d % 16]
        counts = {"num_q_heads": self.num_q_heads, "num_kv_heads": self.num_kv_heads,
                  "block_size": self.block_size, "iters": self.iters, "sets": self.sets,
                  "ceiling_bytes": self.ceiling_bytes, "chunk_tokens": self.chunk_tokens}
        problems += [f"{name} = {value} must be >= 1" for name, value in counts.items() if value < 1]
        if self.warmup < 0:
            problems.append(f"warmup = {self.warmup} must be >= 0")
        if self.ceiling_bytes % READ_ALIGNMENT:
            problems.append(f"ceiling_bytes = {self.ceiling_bytes} is not a multiple of {READ_ALIGNMENT}")
        if self.num_kv_heads >= 1 and self.num_q_heads % self.num_kv_heads:
            problems.append(f"num_q_heads = {self.num_q_heads} is not a multiple of "
                            f"num_kv_heads = {self.num_kv_heads}")
        if not self.sparse_v_threshold >= 0:
            problems.append(f"sparse_v_threshold = {self.sparse_v_threshold} must be >= 0")
        if self.v_encoder not in V_ENCODER_NAMES:
            problems.append(f"v_encoder {self.v_encoder!r} is not one of {V_ENCODER_NAMES}")
        if not 0 <= self.power_window_s < float("inf"):
            problems.append(f"power_window_s = {self.power_window_s} must be finite and >= 0")
        if not 0 <= self.soft_cap < float("inf"):
            problems.append(f"soft_cap = {self.soft_cap} must be finite and >= 0")
        if self.v_rotation not in V_ROTATION_NAMES:
            problems.append(f"v_rotation {self.v_rotation!r} is not one of {V_ROTATION_NAMES}")
        elif self.v_rotation != "none":
            problems += [f"v_rotation {self.v_rotation!r} needs a head_dim in {ROTATION_HEAD_DIMS}, not {d}"
                         for d in self.head_dims if d not in ROTATION_HEAD_DIMS]
        if self.lengths not in LENGTHS:
            problems.append(f"lengths {self.lengths!r} is not one of {LENGTHS}")
        if not 1 <= self.q_len <= MAX_Q_LEN:
            problems.append(f"q_len = {self.q_len} must be in 1..{MAX_Q_LEN}")
        elif "decode" in self.ops:
            problems += [f"decode shape {batch}x{context} has a sequence of fewer than q_len = "
                         f"{self.q_len} tokens" for batch, context in self.shapes
                         if sequence_lengths(batch, context, self.lengths).min() < self.q_len]
        if self.table_positions < 0:
            problems.append(f"table_positions = {self.table_positions} must be >= 0")
        elif self.table_positions and "decode" in self.ops:
            problems += [f"table_positions = {self.table_positions} is shorter than the context of "
                         f"decode shape {batch}x{context}" for batch, context in self.shapes
                         if context > self.table_positions]
        if self.whole_table_rows and not self.table_positions:
            problems.append("whole_table_rows needs table_positions")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Shape:
    """One benchmark case.

    ``op == "decode"``: ``batch`` sequences of up to ``context`` cached tokens (`seq_lens`),
    ``q_len`` query tokens each (the last ``q_len`` positions; with ``q_len > 1`` passed through
    ``query_start``), each sequence on ``blocks_per_seq`` pages of its own; its block-table rows
    are ``table_blocks`` pages wide, of which the launch plans for `planned_blocks`.
    ``op == "write"``: ``batch`` token rows written, ``context == 0``, ``q_len == 1``, and the
    decode's fields at their defaults.
    """

    op: str
    bits: int
    batch: int
    context: int
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int
    q_len: int = 1
    lengths: str = "equal"
    table_positions: int = 0
    whole_table_rows: bool = False

    @property
    def label(self) -> str:
        return f"{self.batch}x{self.context}" if self.op == "decode" else f"{self.batch} tok"

    @property
    def row_elems(self) -> int:
        """Elements of one token row of K (or V): ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def blocks_per_seq(self) -> int:
        """Pages per sequence (decode): ``ceil(context / block_size)``."""
        return -(-self.context // self.block_size)

    @property
    def seq_lens(self) -> np.ndarray:
        """The decode's int32 ``seq_lens`` ``[batch]`` (tokens), as ``lengths`` says."""
        return sequence_lengths(self.batch, self.context, self.lengths)

    @property
    def attended_tokens(self) -> int:
        """Cached tokens the decode attends, over all sequences: the sum of `seq_lens`."""
        return int(self.seq_lens.sum())

    @property
    def seq_blocks(self) -> np.ndarray:
        """The pages each sequence's tokens fill, int64 ``[batch]``: ``ceil(seq_len / block_size)``."""
        return -(-self.seq_lens.astype(np.int64) // self.block_size)

    @property
    def used_blocks(self) -> int:
        """Block-table entries the decode reads: the sum of `seq_blocks`."""
        return int(self.seq_blocks.sum())

    @property
    def table_blocks(self) -> int:
        """Pages per block-table row: ``ceil(table_positions / block_size)``, or
        `blocks_per_seq` where ``table_positions`` is 0 (the compact table)."""
        return max(self.blocks_per_seq, -(-self.table_positions // self.block_size))

    @property
    def planned_blocks(self) -> int:
        """The launch's ``max_blocks_per_seq``: `table_blocks` with ``whole_table_rows`` (rows
        passed whole, the plan sized for them), else `blocks_per_seq` with the row width as
        ``block_tables_stride`` (a column slice, the plan sized for the context)."""
        return self.table_blocks if self.whole_table_rows else self.blocks_per_seq

    @property
    def num_blocks(self) -> int:
        """Pages of one input set's pools: every sequence's own pages (decode), or just enough
        slots for the rows written (write)."""
        if self.op == "decode":
            return self.batch * self.blocks_per_seq
        return -(-self.batch // self.block_size)

    @property
    def query_rows(self) -> int:
        """Rows of q and of the output (decode): ``batch * q_len``."""
        return self.batch * self.q_len

    @property
    def q_elems(self) -> int:
        """Elements of q, and of the output (decode): ``query_rows * num_q_heads * head_dim``."""
        return self.query_rows * self.num_q_heads * self.head_dim

    @property
    def query_start(self) -> np.ndarray | None:
        """The decode's int32 ``query_start`` ``[batch + 1]`` (``q_len`` rows per sequence), or
        None for ``q_len == 1``, which passes none (one query row per sequence)."""
        if self.q_len == 1:
            return None
        return np.arange(self.batch + 1, dtype=np.int32) * self.q_len

    @property
    def query_start_bytes(self) -> int:
        """Bytes of `query_start` (int32), 0 where there is none."""
        return 0 if self.q_len == 1 else (self.batch + 1) * 4

    def describe(self) -> str:
        return f"{self.op} {self.bits}b D{self.head_dim} {self.label}"


def build_cases(config: Config) -> list[Shape]:
    """The cases of ``config`` in run order: decode then write; the bits of one shape adjacent,
    so that the peers (which ignore the bits) run once per shape."""
    heads = (config.num_q_heads, config.num_kv_heads, config.block_size)
    sizes = {"decode": config.shapes, "write": [(tokens, 0) for tokens in config.tokens]}
    decode_fields = {"decode": dict(q_len=config.q_len, lengths=config.lengths,
                                    table_positions=config.table_positions,
                                    whole_table_rows=config.whole_table_rows),
                     "write": {}}
    return [Shape(op, bits, batch, context, head_dim, *heads, **decode_fields[op])
            for op in OPS if op in config.ops
            for head_dim in config.head_dims
            for batch, context in sizes[op]
            for bits in config.bits]


# ---- Byte counts (all in bytes) ----------------------------------------------------------------


def cache_bytes_per_token(shape: Shape) -> int:
    """Cache bytes of one token, all KV heads: K (1 per element) + V codes (bits/8 per element)
    + V scales (1 per 16 elements)."""
    d = shape.head_dim
    return shape.num_kv_heads * (d + d * shape.bits // 8 + d // 16)


def launch_bytes(shape: Shape) -> int:
    """Bytes one launch must move.

    decode: the cache bytes of every attended token (once, whatever ``q_len``: the query tokens
    of a sequence attend its positions together), q read and the output written (bf16,
    ``q_len`` rows per sequence), the used block-table entries and seq_lens (int32), and
    ``query_start`` (int32) where ``q_len > 1``. write: the bf16 K and V rows read, their cache
    bytes written, and the int64 slot mapping.
    """
    if shape.op == "decode":
        tables = (shape.used_blocks + shape.batch) * 4
        return (shape.attended_tokens * cache_bytes_per_token(shape)
                + 2 * shape.q_elems * BF16_BYTES + tables + shape.query_start_bytes)
    rows_read = shape.batch * shape.row_elems * 2 * BF16_BYTES
    return rows_read + shape.batch * (cache_bytes_per_token(shape) + 8)


def peer_bytes(shape: Shape, kv_element_bytes: int) -> int:
    """Bytes a dense-cache peer must move for a decode shape: K and V of ``kv_element_bytes``
    per element for every attended token, plus q and the output (bf16)."""
    kv = 2 * shape.attended_tokens * shape.row_elems * kv_element_bytes
    return kv + 2 * shape.q_elems * BF16_BYTES


def device_bytes(shape: Shape, sets: int) -> int:
    """Device memory one case allocates for ``sets`` input sets: the pools plus the inputs."""
    pool_slots = shape.num_blocks * shape.block_size
    pools = pool_slots * cache_bytes_per_token(shape)
    if shape.op == "decode":
        per_set = (pools + 2 * shape.q_elems * BF16_BYTES + shape.batch * (shape.table_blocks + 1) * 4
                   + shape.query_start_bytes)
    else:
        per_set = pools + shape.batch * (2 * shape.row_elems * BF16_BYTES + 8)
    return sets * per_set


def gbps(nbytes: float, time_us: float) -> float:
    """Bandwidth in GB/s (1e9 bytes per second) of ``nbytes`` moved in ``time_us``."""
    return nbytes / time_us / 1e3


def floor_us(nbytes: float, ceiling_gbps: float) -> float:
    """The least time ``nbytes`` can take at the ceiling, µs."""
    return nbytes / (ceiling_gbps * 1e3)


def fits_in_l2(nbytes: int, sets: int, l2_bytes: int) -> bool:
    """Whether all input sets' bytes fit in L2 together, so that replays may be served from it."""
    return nbytes * sets <= l2_bytes


def fits_in_memory(needed: int, free: int) -> bool:
    return needed <= MEMORY_HEADROOM * free


# ---- Results -------------------------------------------------------------------------------------

#: `Shape` fields that do not apply to a write row: null in its `Result`.
WRITE_UNSET_FIELDS = ("context", "q_len", "lengths", "table_positions", "whole_table_rows")


@dataclass(frozen=True)
class Timing:
    """Per-launch times of one case, µs; ``set_medians_us``: the median of each input set's
    samples (sample ``i`` is of set ``i mod sets``)."""

    median_us: float
    min_us: float
    samples: int
    set_medians_us: tuple[float, ...] = ()
    power_w: float | None = None  # the board's mean power while the launches ran (`mean_power_w`)

    @classmethod
    def of(cls, samples_us: Sequence[float], sets: int = 1) -> Timing:
        return cls(statistics.median(samples_us), min(samples_us), len(samples_us),
                   tuple(statistics.median(samples_us[k::sets]) for k in range(min(sets, len(samples_us)))))

    def per_launch(self, launches: int) -> Timing:
        """The times of samples that each ran ``launches`` launches, per launch."""
        return Timing(self.median_us / launches, self.min_us / launches, self.samples,
                      tuple(t / launches for t in self.set_medians_us))

    def set_spread(self) -> float:
        """How far apart the input sets' medians are: the slowest over the fastest, minus 1."""
        return max(self.set_medians_us) / min(self.set_medians_us) - 1.0 if self.set_medians_us else 0.0


# A row whose input sets' medians are further apart than this is marked: its median is then mostly
# one set's time, and moves between runs with the sets.
SET_SPREAD_NOTE = 0.05

# A row is marked where a limit held the GPU's clocks down for more than this share of its
# measuring time ("power cap N %", "thermal N %"): an issue-bound kernel runs slower for it.
CLOCK_LIMIT_NOTE = 0.01


@contextlib.contextmanager
def clock_limits_held(counters: NvmlCounters | None,
                      clock_ns: Callable[[], int] = time.perf_counter_ns) -> Iterator[dict[str, float]]:
    """Yields a dict that, once the block has run, holds per limit ("power cap", "thermal") the
    share (0 to 1) of the block's wall time (by ``clock_ns``) during which that limit held the
    GPU's clocks down. It stays empty where ``counters`` is None or NVML did not answer."""
    shares: dict[str, float] = {}
    before = counters.held_ns() if counters is not None else None
    start = clock_ns()
    yield shares
    if counters is None or before is None:
        return
    after = counters.held_ns()
    if after is not None:
        wall_ns = max(clock_ns() - start, 1)
        shares.update({name: min(1.0, (after[name] - before[name]) / wall_ns) for name in after})


def clock_limit_note(shares: dict[str, float]) -> str:
    """The note of the limits that held the clocks for more than `CLOCK_LIMIT_NOTE` of the time."""
    return ", ".join(f"{name} {100 * share:.0f} %" for name, share in shares.items() if share > CLOCK_LIMIT_NOTE)


#: NVML's energy counter moves in steps (about every 100 ms on an H200). A power reading waits
#: this long at most for its first step before it gives up (a counter that does not move).
ENERGY_STEP_TIMEOUT_S = 1.0
#: While power is measured, replays are queued in batches of at least this much GPU time (s), and
#: `POWER_QUEUE` batches ahead: a reading of NVML's energy counter takes milliseconds (3-5 ms on an
#: H200 host), during which fewer queued replays would leave the GPU idle.
POWER_BATCH_S = 0.02
POWER_QUEUE = 2


@dataclass(frozen=True)
class PowerProbe:
    """How a row's mean board power is measured: NVML's counters, and the seconds of the window."""

    counters: NvmlCounters
    window_s: float


def mean_power_w(dev: Device, replay: Callable[[], None], replay_us: float, probe: PowerProbe,
                 clock: Callable[[], float] = time.perf_counter) -> float | None:
    """The board's mean power (W) while ``replay`` (which enqueues on ``dev.stream`` work of about
    ``replay_us`` µs) runs back to back, in batches of `POWER_BATCH_S` and `POWER_QUEUE` batches
    ahead: the energy counter's growth from its first step to its first
    step at least ``probe.window_s`` seconds (by ``clock``) later, over the time between them. The
    load runs for a step before the window opens, so the window holds no ramp-up. None where the
    counter does not answer, or does not step within `ENERGY_STEP_TIMEOUT_S` (of the start, or of
    the window's end)."""
    per_batch = max(1, math.ceil(POWER_BATCH_S * 1e6 / replay_us))
    free, queued = list(dev.events(POWER_QUEUE)), []
    last = probe.counters.energy_mj()
    began = clock()
    start: tuple[float, int] | None = None  # (time, energy) of the window's first step
    power = None
    try:
        while last is not None:
            while free:
                for _ in range(per_batch):
                    replay()
                dev.record(free[-1])
                queued.append(free.pop())
            if dev.done(queued[0]):
                free.append(queued.pop(0))
                continue
            now, energy = clock(), probe.counters.energy_mj()
            if energy is not None and energy != last:
                if start is None:
                    start = (now, energy)
                elif now - start[0] >= probe.window_s:
                    power = (energy - start[1]) / 1e3 / (now - start[0])
                    break
            else:
                # The first step is due within the timeout of the start, the closing one of the window's end.
                due = began if start is None else start[0] + probe.window_s
                if energy is None or now > due + ENERGY_STEP_TIMEOUT_S:
                    break  # the counter stopped answering, or stepping
            last = energy
    finally:
        dev.synchronize()
    return power


def energy_mj(power_w: float | None, launch_us: float | None) -> float | None:
    """Energy per launch (mJ) at ``power_w`` for a launch of ``launch_us`` µs; None if either is."""
    return None if power_w is None or launch_us is None else power_w * launch_us * 1e-3


def measured(nbytes: int, timing: Timing, ceiling_gbps: float) -> dict[str, Any]:
    """The numbers of ``timing`` for a launch moving ``nbytes``: times (µs), GB/s, % of ceiling,
    and where measured the mean power (W) and the energy per launch (mJ)."""
    achieved = gbps(nbytes, timing.median_us)
    return {"bytes": nbytes, "median_us": timing.median_us, "min_us": timing.min_us,
            "samples": timing.samples, "set_medians_us": list(timing.set_medians_us), "gbps": achieved,
            "pct_of_ceiling": 100.0 * achieved / ceiling_gbps, "power_w": timing.power_w,
            "energy_mj": energy_mj(timing.power_w, timing.median_us)}


@dataclass
class Result:
    """One output row; `run_benchmarks` returns these as dicts (schema: `write_json`)."""

    op: str
    shape: str
    bits: int | None = None
    batch: int | None = None
    context: int | None = None
    head_dim: int | None = None
    num_q_heads: int | None = None
    num_kv_heads: int | None = None
    block_size: int | None = None
    q_len: int | None = None
    lengths: str | None = None
    table_positions: int | None = None
    whole_table_rows: bool | None = None
    bytes: int = 0
    median_us: float | None = None
    min_us: float | None = None
    samples: int = 0
    set_medians_us: list[float] = field(default_factory=list)
    gbps: float | None = None
    pct_of_ceiling: float | None = None
    floor_us: float | None = None
    plain_read_us: float | None = None  # the row's bytes by the ceiling's read kernel (`time_plain_read`)
    in_graph_us: float | None = None  # per launch, GRAPH_CHAIN of them in one graph (median)
    clock_limited: dict[str, float] | None = None  # see `clock_limits_held`; None: not known
    power_w: float | None = None  # mean board power, W (`mean_power_w`); None: not measured
    energy_mj: float | None = None  # per launch, mJ: power_w over in_graph_us (measured in a graph)
    note: str = ""
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def for_shape(cls, shape: Shape) -> Result:
        fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(Shape)}
        if shape.op == "write":
            fields.update(dict.fromkeys(WRITE_UNSET_FIELDS))
        return cls(shape=shape.label, bytes=launch_bytes(shape), **fields)

    def record(self, timing: Timing, ceiling_gbps: float) -> None:
        for name, value in measured(self.bytes, timing, ceiling_gbps).items():
            setattr(self, name, value)
        self.floor_us = floor_us(self.bytes, ceiling_gbps)

    def mark_clock_limits(self, shares: dict[str, float]) -> None:
        """Keep the shares of `clock_limits_held` (None where not known) and add the note of those
        above `CLOCK_LIMIT_NOTE` to the row's."""
        self.clock_limited = shares or None
        self.note = ", ".join(filter(None, [self.note, clock_limit_note(shares)]))


# ---- Timing (the device access through cuda.bindings is `fp8kturbov._device`) --------------------


def time_launches(dev: Device, launches: Sequence[Callable[[], None]], iters: int,
                  warmup: int, gate_chunk: int = GATE_CHUNK, power: PowerProbe | None = None) -> Timing:
    """Per-launch times, µs: ``warmup`` untimed launches, then ``iters`` event-timed samples,
    sample ``i`` being ``launches[i % len(launches)]()`` (which must enqueue on ``dev.stream``),
    ``gate_chunk`` of them queued behind each gate. With ``power``, then the mean power of
    ``launches[0]`` back to back (`mean_power_w`)."""
    for i in range(warmup):
        launches[i % len(launches)]()
    dev.synchronize()
    events = dev.events(2 * iters)
    for first in range(0, iters, gate_chunk):
        with dev.gate():
            for i in range(first, min(first + gate_chunk, iters)):
                dev.record(events[2 * i])
                launches[i % len(launches)]()
                dev.record(events[2 * i + 1])
    dev.synchronize()
    timing = Timing.of([dev.elapsed_us(events[2 * i], events[2 * i + 1]) for i in range(iters)], len(launches))
    if power is not None:
        timing = dataclasses.replace(timing, power_w=mean_power_w(dev, launches[0], timing.median_us, power))
    return timing


def chain_graph(dev: Device, enqueues: Sequence[Callable[[], None]]) -> Any:
    """One CUDA graph of `GRAPH_CHAIN` launches back to back, launch ``i`` from
    ``enqueues[i % len(enqueues)]``."""
    def chain() -> None:
        for i in range(GRAPH_CHAIN):
            enqueues[i % len(enqueues)]()

    return dev.capture(chain)


def time_graph_chain(dev: Device, enqueues: Sequence[Callable[[], None]], iters: int,
                     warmup: int) -> Timing:
    """Per-launch times, µs, inside a `chain_graph`: `time_launches` of its replays, each sample
    divided by `GRAPH_CHAIN`. Assumes ``enqueues`` ran once already (`time_graphs` does that)."""
    graph = chain_graph(dev, enqueues)
    # One replay per gate: it queues as many kernels as a gate's chunk of single launches.
    timing = time_launches(dev, [functools.partial(dev.launch, graph)], iters, warmup,
                           gate_chunk=max(1, GATE_CHUNK // GRAPH_CHAIN))
    return timing.per_launch(GRAPH_CHAIN)


def time_graphs(dev: Device, enqueues: Sequence[Callable[[], None]], iters: int,
                warmup: int) -> Timing:
    """`time_launches` of CUDA-graph replays of each ``enqueue`` (one graph per input set)."""
    for enqueue in enqueues:  # once outside capture: argument checks and lazy set-up
        enqueue()
    dev.synchronize()
    graphs = [dev.capture(enqueue) for enqueue in enqueues]
    return time_launches(dev, [functools.partial(dev.launch, g) for g in graphs], iters, warmup)


# ---- Inputs --------------------------------------------------------------------------------------


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


def _layout(shape: Shape) -> CacheLayout:
    return CacheLayout(shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
                       shape.bits)


@dataclass(frozen=True)
class DecodeBuffers:
    """Device addresses of one decode input set."""

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


def _page_strides(layout: CacheLayout) -> dict[str, int]:
    """The page-layout arguments (bytes) that both library calls take."""
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
                **_page_strides(layout))


def query_start_arguments(dev: Device, shape: Shape) -> dict[str, Any]:
    """The multi-token decode's arguments of one input set: `Shape.query_start` uploaded and
    ``num_query_rows``; none where ``shape.q_len == 1`` (one query row per sequence)."""
    starts = shape.query_start
    if starts is None:
        return {}
    return {"query_start": dev.upload(starts), "num_query_rows": shape.query_rows}


def launch_options(dev: Device, shape: Shape, layout: CacheLayout, config: Config) -> dict[str, Any]:
    """The optional arguments of one input set's launch: checked mode (the pools' page count and
    a zeroed error word), the decode's sinks (zero logits), soft cap, query rows
    (`query_start_arguments`) and block-table row stride (rows wider than `Shape.planned_blocks`),
    the write's V encoder, the V rotation (write and decode); only those ``config`` and ``shape``
    turn on."""
    options: dict[str, Any] = {}
    if config.v_rotation != "none":
        options["v_rotation"] = VRotation[config.v_rotation.upper()]
    if config.checked:
        word = dev.alloc(4)
        dev.memset(word, 0, 4)
        options.update(num_blocks=layout.num_blocks, error_flags=word)
    if shape.op == "decode":
        if config.sinks:
            options["sinks"] = dev.upload(np.zeros(shape.num_q_heads, dtype=np.float32))
        if config.soft_cap:
            options["soft_cap"] = config.soft_cap
        if shape.table_blocks != shape.planned_blocks:
            options["block_tables_stride"] = shape.table_blocks
        options.update(query_start_arguments(dev, shape))
    elif config.v_encoder != "matched_norm":
        options["v_encoder"] = VEncoder[config.v_encoder.upper()]
    return options


def launch_decode(scalars: dict[str, Any], buffers: DecodeBuffers, stream: Any) -> None:
    """The benchmark's one call of the library's decode, with its split-K workspace."""
    paged_decode_attn(
        buffers.q, buffers.k_cache, buffers.v_cache, buffers.output, buffers.block_tables,
        buffers.seq_lens, workspace=buffers.workspace, workspace_bytes=buffers.workspace_bytes,
        stream=stream, **scalars)


def launch_write(shape: Shape, layout: CacheLayout, k_scale: float, buffers: WriteBuffers,
                 stream: Any, options: dict[str, Any] | None = None) -> None:
    """The benchmark's one call of the library's cache write (``options``: `launch_options`)."""
    reshape_and_cache(
        buffers.key, buffers.value, buffers.k_cache, buffers.v_cache, buffers.slot_mapping,
        num_tokens=shape.batch, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        block_size=shape.block_size, key_stride=shape.row_elems, value_stride=shape.row_elems,
        k_scale=k_scale, v_bits=shape.bits, stream=stream, **_page_strides(layout), **(options or {}))


def block_table(shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """A decode's int32 block table ``[batch, table_blocks]``: the pools' pages in a random
    order, `Shape.blocks_per_seq` per sequence, then page 0 to the row's end."""
    pages = rng.permutation(shape.num_blocks).astype(np.int32).reshape(shape.batch, shape.blocks_per_seq)
    return np.pad(pages, ((0, 0), (0, shape.table_blocks - shape.blocks_per_seq)))


def decode_enqueues(dev: Device, shape: Shape, config: Config, chunk: Chunk,
                    rng: np.random.Generator) -> list[Callable[[], None]]:
    """One decode launch per input set: pools filled with ``chunk``, each sequence on its own
    pages in a random order (block-table rows of `Shape.table_blocks` pages, page 0 past
    the sequence's own), sequences as long as `Shape.seq_lens`, random bf16 q of ``q_len`` rows
    per sequence."""
    layout = _layout(shape)
    scalars = decode_scalars(shape, layout, chunk.k_scale, config.sparse_v_threshold)
    workspace_bytes = paged_decode_workspace_bytes(**scalars)
    enqueues = []
    for _ in range(config.sets):
        q = rng.standard_normal(shape.q_elems, dtype=np.float32)
        buffers = DecodeBuffers(
            q=dev.upload(bf16_bits(q)), k_cache=dev.alloc(layout.k_pool_bytes),
            v_cache=dev.alloc(layout.v_pool_bytes), output=dev.alloc(shape.q_elems * BF16_BYTES),
            block_tables=dev.upload(block_table(shape, rng)),
            seq_lens=dev.upload(shape.seq_lens),
            workspace=dev.alloc(workspace_bytes) if workspace_bytes else 0,
            workspace_bytes=workspace_bytes)
        replicate(dev, buffers.k_cache, layout.k_pool_bytes, chunk.k_pages)
        replicate(dev, buffers.v_cache, layout.v_pool_bytes, chunk.v_pages)
        launch_scalars = {**scalars, **launch_options(dev, shape, layout, config)}
        enqueues.append(functools.partial(launch_decode, launch_scalars, buffers, dev.stream))
    return enqueues


def write_enqueues(dev: Device, shape: Shape, config: Config,
                   rng: np.random.Generator) -> list[Callable[[], None]]:
    """One write launch per input set: N(0, 1) bf16 rows to distinct random slots."""
    layout = _layout(shape)
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


# ---- Peers (decode only) -------------------------------------------------------------------------


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise PeerUnavailable("absent") from None


def _check_peer_memory(dev: Device, needed: int) -> None:
    free, _ = dev.memory()
    if not fits_in_memory(needed, free):
        raise PeerUnavailable(f"skipped: needs {needed / GiB:.1f} GiB, {free / GiB:.1f} GiB free")


def _torch_graph(torch: Any, fn: Callable[[], Any]) -> Any:
    """A ``torch.cuda.CUDAGraph`` of ``fn``, run once eagerly first (kernel choice, lazy set-up)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _time_torch(dev: Device, torch: Any, make_fn: Callable[[], Callable[[], Any]],
                config: Config, power: PowerProbe | None = None) -> Timing:
    """Time graph replays of ``make_fn()`` (called once per input set) on ``dev.stream``, and with
    ``power`` measure their mean power."""
    stream = torch.cuda.ExternalStream(int(dev.stream))
    with torch.cuda.stream(stream):  # tensors, warm-up and replays all on the timing stream
        fns = [make_fn() for _ in range(config.sets)]  # holds the inputs the graphs read
        graphs = [_torch_graph(torch, fn) for fn in fns]
        return time_launches(dev, [g.replay for g in graphs], config.iters, config.warmup, power=power)


def _sdpa_with_gqa(torch: Any, group: int) -> tuple[Callable[..., Any], int]:
    """torch's SDPA taking ``group`` query heads per K/V head: (sdpa with ``enable_gqa``, 1), or
    where torch lacks it (< 2.5) (plain sdpa, ``group``): K/V heads must then be repeated that many
    times."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        probe = torch.zeros(1, group, 1, 16, dtype=torch.bfloat16, device="cuda")
        sdpa(probe, probe[:, :1], probe[:, :1], enable_gqa=True)
        return functools.partial(sdpa, enable_gqa=True), 1
    except TypeError:
        return sdpa, group


def _dense_kv_shape(shape: Shape) -> tuple[int, int, int, int]:
    """The dense peers' K and V: ``[batch, kv_heads, context, head_dim]``; a batch of mixed
    lengths has none (they would read every sequence padded to ``context``)."""
    if shape.lengths != "equal":
        raise PeerUnavailable("skipped: dense K/V hold sequences of one length")
    return shape.batch, shape.num_kv_heads, shape.context, shape.head_dim


def _bf16_query(torch: Any, shape: Shape) -> Any:
    """One query token per sequence: ``[batch, q_heads, 1, head_dim]`` bf16."""
    return torch.randn(shape.batch, shape.num_q_heads, 1, shape.head_dim, dtype=torch.bfloat16,
                       device="cuda")


def peer_bf16_sdpa(dev: Device, shape: Shape, config: Config,
                   power: PowerProbe | None = None) -> tuple[int, Timing]:
    """torch SDPA over contiguous bf16 K/V ``[batch, kv_heads, context, head_dim]``, q
    ``[batch, q_heads, 1, head_dim]``, GQA through ``enable_gqa`` (or K/V heads repeated before
    timing where torch lacks it). Returns (bytes, timing)."""
    dense_shape = _dense_kv_shape(shape)
    torch = _optional("torch")
    sdpa, repeat = _sdpa_with_gqa(torch, shape.num_q_heads // shape.num_kv_heads)
    kv_bytes = peer_bytes(shape, BF16_BYTES)
    _check_peer_memory(dev, config.sets * kv_bytes * repeat + kv_bytes)

    def kv() -> Any:
        dense = torch.randn(*dense_shape, dtype=torch.bfloat16, device="cuda")
        return dense.repeat_interleave(repeat, dim=1) if repeat > 1 else dense

    def make_fn() -> Callable[[], Any]:
        return functools.partial(sdpa, _bf16_query(torch, shape), kv(), kv())

    return kv_bytes, _time_torch(dev, torch, make_fn, config, power)


def peer_fp8_sdpa(dev: Device, shape: Shape, config: Config,
                  power: PowerProbe | None = None) -> tuple[int, Timing]:
    """The straightforward FP8 cache decode in torch: contiguous FP8 E4M3 K/V ``[batch, kv_heads,
    context, head_dim]`` (1 byte per element) cast to bf16 in every decode, then SDPA as in
    `peer_bf16_sdpa` (K/V heads repeated after the cast where torch lacks ``enable_gqa``). The
    per-tensor scales fold into q and the output, so a cast is the whole dequantisation. Returns
    (the bytes an FP8 cache must read, timing): the casts' bf16 copies are extra traffic it pays."""
    dense_shape = _dense_kv_shape(shape)
    torch = _optional("torch")
    sdpa, repeat = _sdpa_with_gqa(torch, shape.num_q_heads // shape.num_kv_heads)
    fp8_bytes = peer_bytes(shape, 1)
    # Per set the FP8 K/V; the bf16 casts (repeated heads included) live in the graph's pool.
    _check_peer_memory(dev, config.sets * fp8_bytes + 2 * repeat * fp8_bytes)

    def kv() -> Any:  # bytes below 0x78 are finite positive E4M3 values: random data without NaN
        return torch.randint(0, 0x78, dense_shape, dtype=torch.uint8,
                             device="cuda").view(torch.float8_e4m3fn)

    def make_fn() -> Callable[[], Any]:
        q, k, v = _bf16_query(torch, shape), kv(), kv()

        def decode() -> Any:
            k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
            if repeat > 1:
                k16, v16 = k16.repeat_interleave(repeat, dim=1), v16.repeat_interleave(repeat, dim=1)
            return sdpa(q, k16, v16)

        return decode

    return fp8_bytes, _time_torch(dev, torch, make_fn, config, power)


def peer_fp8_flashinfer(dev: Device, shape: Shape, config: Config,
                        power: PowerProbe | None = None) -> tuple[int, Timing]:
    """flashinfer's paged decode over an FP8 E4M3 K/V cache (NHD pages of ``block_size``
    tokens), bf16 q and output, on tensor cores (its choice for GQA groups of 4 and more, and the
    setting of the FP8 reference numbers in docs/PERFORMANCE.md). Returns (bytes, timing)."""
    torch = _optional("torch")
    flashinfer = _optional("flashinfer")
    workspace_bytes = 128 << 20  # flashinfer's documented default for decode
    nbytes = peer_bytes(shape, 1)
    _check_peer_memory(dev, config.sets * (nbytes + workspace_bytes))
    pages, seq_pages = shape.num_blocks, shape.seq_blocks  # its planner reads the lengths on the host
    last_page_len = shape.seq_lens - (seq_pages - 1) * shape.block_size

    def make_fn() -> Callable[[], Any]:
        int32 = {"dtype": torch.int32, "device": "cuda"}
        indptr = torch.tensor(np.concatenate([[0], np.cumsum(seq_pages)]), **int32)
        indices = torch.randperm(pages, **int32)[:shape.used_blocks]
        last_len = torch.tensor(last_page_len, **int32)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda"), "NHD",
            use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
            paged_kv_indices_buffer=torch.empty_like(indices),
            paged_kv_last_page_len_buffer=torch.empty_like(last_len))
        wrapper.plan(indptr, indices, last_len, shape.num_q_heads, shape.num_kv_heads,
                     shape.head_dim, shape.block_size, q_data_type=torch.bfloat16,
                     kv_data_type=torch.float8_e4m3fn)
        page_shape = (pages, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # Bytes below 0x78 are finite positive E4M3 values: random data without NaN.
        k, v = (torch.randint(0, 0x78, page_shape, dtype=torch.uint8, device="cuda")
                .view(torch.float8_e4m3fn) for _ in range(2))
        q = torch.randn(shape.batch, shape.num_q_heads, shape.head_dim, dtype=torch.bfloat16,
                        device="cuda")
        return functools.partial(wrapper.run, q, (k, v))

    return nbytes, _time_torch(dev, torch, make_fn, config, power)


#: Each peer times its decode of a shape (and with a `PowerProbe` measures its power): (bytes, timing).
PEERS: dict[str, Callable[[Device, Shape, Config, PowerProbe | None], tuple[int, Timing]]] = {
    "bf16_sdpa": peer_bf16_sdpa,
    "fp8_sdpa": peer_fp8_sdpa,
    "fp8_flashinfer": peer_fp8_flashinfer,
}
#: The peers' names in the report's column headers.
PEER_LABELS = {"bf16_sdpa": "bf16 sdpa", "fp8_sdpa": "fp8 sdpa", "fp8_flashinfer": "flashinfer fp8"}


def run_peer(name: str, dev: Device, shape: Shape, config: Config, ceiling_gbps: float,
             counters: NvmlCounters | None = None, power: PowerProbe | None = None) -> dict[str, Any]:
    """One peer's numbers for ``shape`` (see `measured`, and ``clock_limited`` as a row's) with
    ``status`` "ok"; else only a status: "absent", "skipped: <why>" or "error: <first line of the
    error>"."""
    try:
        with clock_limits_held(counters) as held:
            nbytes, timing = PEERS[name](dev, shape, config, power)
        return {"status": "ok", **measured(nbytes, timing, ceiling_gbps), "clock_limited": held or None}
    except PeerUnavailable as why:
        return {"status": str(why)}
    except BenchError:
        raise
    except Exception as exc:  # a peer's failure must not end the run; the row says what it was
        return {"status": f"error: {first_line(exc)}"}
    finally:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # hand the peer's memory back for the next case


# ---- The run -------------------------------------------------------------------------------------


def progress(items: Sequence[Any], label: Callable[[Any], str], enabled: bool = True) -> Iterator[Any]:
    """Yield ``items`` while showing progress on stderr: a tqdm bar if tqdm is importable, else
    one ``[i/n] label`` line per item."""
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        for i, item in enumerate(items, 1):
            print(f"[{i}/{len(items)}] {label(item)}", file=sys.stderr, flush=True)
            yield item
        return
    with tqdm(items, file=sys.stderr, unit="case", leave=False) as bar:
        for item in bar:
            bar.set_postfix_str(label(item))
            yield item


def read_enqueue(dev: Device, src: int, nbytes: int, sink: int) -> Callable[[], None]:
    """Enqueues the bench's read kernel over ``nbytes`` at ``src`` on ``dev.stream``, with
    `READ_CTAS_PER_SM` CTAs per SM; ``sink``: a writable 4-byte word (`_bench_kernels.read`)."""
    ctas = READ_CTAS_PER_SM * dev.attribute("MULTIPROCESSOR_COUNT")
    return functools.partial(_bench_kernels.read, int(dev.stream), src, nbytes, sink, ctas)


def measure_ceiling(dev: Device, config: Config, counters: NvmlCounters | None = None) -> tuple[Result, Result]:
    """The ceiling, a read of ``config.ceiling_bytes`` by the bench's read kernel (bytes read), and
    beside it a DtoD copy of as many bytes (bytes read plus bytes written): ``(read, copy)``, each
    marked where a clock limit held (``counters``; see `clock_limits_held`)."""
    n = config.ceiling_bytes
    read = Result(op="read", shape=f"{n / GiB:g} GiB read", bytes=n)
    copy = Result(op="copy", shape=f"{n / GiB:g} GiB DtoD", bytes=2 * n)
    free, _ = dev.memory()
    if not fits_in_memory(2 * n, free):
        raise BenchError(f"the ceiling needs 2 x {n / GiB:g} GiB, {free / GiB:.1f} GiB free")
    with dev.scope():
        src, dst, sink = dev.alloc(n), dev.alloc(n), dev.alloc(4)
        dev.memset(src, 1, n)  # touch both buffers before timing
        dev.memset(dst, 0, n)
        read_once = read_enqueue(dev, src, n, sink)
        with clock_limits_held(counters) as held:
            timing = time_launches(dev, [read_once], COPY_ITERS, COPY_WARMUP)
        read.record(timing, gbps(read.bytes, timing.median_us))
        read.mark_clock_limits(held)
        with clock_limits_held(counters) as held:
            timing = time_launches(dev, [functools.partial(dev.copy, dst, src, n)], COPY_ITERS, COPY_WARMUP)
        copy.record(timing, read.gbps)
        copy.mark_clock_limits(held)
    return read, copy


def record_launches(result: Result, dev: Device, enqueues: Sequence[Callable[[], None]],
                    config: Config, ceiling_gbps: float, counters: NvmlCounters | None = None,
                    power: PowerProbe | None = None) -> None:
    """Time ``enqueues`` (one per input set) one launch per graph replay, the row's times, and
    `GRAPH_CHAIN` launches per graph, its ``in_graph_us``. Marks a row whose sets' medians are
    more than `SET_SPREAD_NOTE` apart ("sets N %"), and one during whose timing a clock limit held
    (``counters``; `Result.mark_clock_limits`). With ``power``, then the row's mean power and
    energy per launch."""
    with clock_limits_held(counters) as held:
        timing = time_graphs(dev, enqueues, config.iters, config.warmup)
        chain = time_graph_chain(dev, enqueues, max(1, config.iters // 4), min(config.warmup, 2))
    result.record(timing, ceiling_gbps)
    if timing.set_spread() > SET_SPREAD_NOTE:
        result.note = f"sets {100 * timing.set_spread():.0f} %"
    result.in_graph_us = chain.median_us
    result.mark_clock_limits(held)
    if power is not None:  # over replays of a chain graph: single launches would leave the GPU gaps
        replay = functools.partial(dev.launch, chain_graph(dev, enqueues))
        result.power_w = mean_power_w(dev, replay, GRAPH_CHAIN * result.in_graph_us, power)
        result.energy_mj = energy_mj(result.power_w, result.in_graph_us)


def time_plain_read(dev: Device, nbytes: int, config: Config) -> float | None:
    """µs of the ceiling's read kernel over ``nbytes`` (rounded up to `READ_ALIGNMENT`), one
    launch per graph replay, rotating ``config.sets`` buffers as a row rotates its input sets
    (median of ``config.iters``); None where those buffers do not fit in the free memory."""
    n = -(-nbytes // READ_ALIGNMENT) * READ_ALIGNMENT
    free, _ = dev.memory()
    if not fits_in_memory(config.sets * n, free):
        return None
    with dev.scope():
        sink, buffers = dev.alloc(4), [dev.alloc(n) for _ in range(config.sets)]
        for buffer in buffers:
            dev.memset(buffer, 1, n)
        reads = [read_enqueue(dev, buffer, n, sink) for buffer in buffers]
        return time_graphs(dev, reads, config.iters, config.warmup).median_us


def measure_launch_floor(dev: Device, config: Config, ceiling_gbps: float,
                         counters: NvmlCounters | None = None) -> Result:
    """The launch floor: one empty kernel, timed like the library's launches."""
    result = Result(op="launch", shape="empty-kernel graph", bytes=0)
    with dev.scope():
        record_launches(result, dev, [functools.partial(_bench_kernels.empty, int(dev.stream))], config,
                        ceiling_gbps, counters)
    return result


class _Runner:
    """State shared by the cases of one run: the ceiling, NVML's counters (None: not available),
    the power probe (None: power not measured), encoded chunks, peer results."""

    def __init__(self, dev: Device, config: Config, ceiling_gbps: float,
                 counters: NvmlCounters | None = None, power: PowerProbe | None = None) -> None:
        self.dev, self.config, self.ceiling, self.counters = dev, config, ceiling_gbps, counters
        self.power = power
        self.rng = np.random.default_rng(config.seed)
        self.l2_bytes = dev.attribute("L2_CACHE_SIZE")
        self._chunks: dict[Shape, Chunk] = {}
        self._peers: dict[Shape, dict[str, dict[str, Any]]] = {}
        self._plain_reads: dict[int, float | None] = {}

    def plain_read_us(self, nbytes: int) -> float | None:
        """`time_plain_read` of ``nbytes``, once per byte count of the run."""
        if nbytes not in self._plain_reads:
            self._plain_reads[nbytes] = time_plain_read(self.dev, nbytes, self.config)
        return self._plain_reads[nbytes]

    def chunk(self, shape: Shape) -> Chunk:
        key = dataclasses.replace(shape, batch=0, context=0)  # the chunk depends on the layout only
        if key not in self._chunks:
            self._chunks[key] = encode_chunk(shape, self.config.chunk_tokens, self.rng)
        return self._chunks[key]

    def case(self, shape: Shape) -> Result:
        result = Result.for_shape(shape)
        needed, (free, _) = device_bytes(shape, self.config.sets), self.dev.memory()
        if not fits_in_memory(needed, free):
            result.note = f"skipped: needs {needed / GiB:.1f} GiB, {free / GiB:.1f} GiB free"
            return result
        with self.dev.scope():
            if shape.op == "decode":
                enqueues = decode_enqueues(self.dev, shape, self.config, self.chunk(shape), self.rng)
            else:
                enqueues = write_enqueues(self.dev, shape, self.config, self.rng)
            record_launches(result, self.dev, enqueues, self.config, self.ceiling, self.counters, self.power)
        if fits_in_l2(result.bytes, self.config.sets, self.l2_bytes):
            result.note = ", ".join(filter(None, ["L2", result.note]))
        if shape.op == "decode":
            result.plain_read_us = self.plain_read_us(result.bytes)
            if self.config.peers and shape.q_len == 1:
                result.peers = self.peers(shape)
        return result

    def peers(self, shape: Shape) -> dict[str, dict[str, Any]]:
        key = dataclasses.replace(shape, bits=0)  # peers do not depend on the V bits
        if key not in self._peers:
            peers = {name: run_peer(name, self.dev, shape, self.config, self.ceiling, self.counters, self.power)
                     for name in PEERS}
            for peer in peers.values():
                if peer["status"] == "ok":
                    peer["plain_read_us"] = self.plain_read_us(peer["bytes"])
            self._peers[key] = peers
        return self._peers[key]


def run_benchmarks(config: Config, *, device: Device | None = None,
                   show_progress: bool = True) -> list[dict[str, Any]]:
    """Measure the ceiling, the launch floor and every case of ``config``.

    Returns one dict per row (schema: `write_json`): first ``op == "read"`` (the ceiling), then
    ``op == "copy"`` and ``op == "launch"`` (the launch floor), then the cases in `build_cases`
    order. ``device``: an open `Device` to use; by default one is opened on GPU 0 and closed at
    the end.
    """
    cases = build_cases(config)
    dev = device if device is not None else Device()
    counters = None
    try:
        counters = NvmlCounters.open(dev.pci_bus_id)
        read, copy = measure_ceiling(dev, config, counters)
        rows = [read, copy, measure_launch_floor(dev, config, read.gbps, counters)]
        power = None
        if counters is not None and config.power_window_s > 0:
            power = PowerProbe(counters, config.power_window_s)
        runner = _Runner(dev, config, read.gbps, counters, power)
        rows += [runner.case(shape) for shape in progress(cases, Shape.describe, show_progress)]
    finally:
        if counters is not None:
            counters.close()
        if device is None:
            dev.close()
    return [dataclasses.asdict(row) for row in rows]


# ---- Reporting -----------------------------------------------------------------------------------


def _module_version(name: str) -> str | None:
    """The version of the installed distribution that provides the import package ``name`` (whose
    name may differ: flashinfer comes as ``flashinfer-python``), or None where none does."""
    for distribution in importlib.metadata.packages_distributions().get(name, [name]):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _command_output(*command: str) -> str | None:
    """The first line a command prints, or None where it is missing or fails."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def source_commit() -> str | None:
    """The commit of the code that runs, with "-dirty" where it had uncommitted changes: the one
    an installed package was built from (the ``build_commit.txt`` the build puts beside it), else
    that of the source checkout the package is imported from; None where neither is known."""
    recorded = Path(__file__).parents[1] / "build_commit.txt"  # in fp8kturbov/, beside tools/
    if recorded.is_file():
        return recorded.read_text().strip() or None
    return _command_output("git", "describe", "--always", "--dirty", "--exclude=*")


def describe_device(dev: Device) -> dict[str, Any]:
    """The run's context: GPU, driver, software versions, commit and date (schema: `write_json`)."""
    cuda_version = driver_call(cu.cuDriverGetVersion)
    return {
        "name": dev.name,
        "driver": _command_output("nvidia-smi", f"--id={dev.ordinal}", "--query-gpu=driver_version",
                                  "--format=csv,noheader"),
        "cuda_driver_api": f"{cuda_version // 1000}.{cuda_version % 1000 // 10}",
        "memory_bytes": dev.memory()[1],
        "l2_bytes": dev.attribute("L2_CACHE_SIZE"),
        "sm_count": dev.attribute("MULTIPROCESSOR_COUNT"),
        "timing_gate": dev.gated,
        "library_version": version(),
        "commit": source_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": _module_version("torch"),
        "flashinfer": _module_version("flashinfer"),
    }


def format_number(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals; ``"-"`` for None (not measured)."""
    return "-" if value is None else f"{value:.{digits}f}"


def _peer_cell(peer: dict[str, Any] | None) -> str:
    if peer is None:
        return "-"
    if peer["status"] == "ok":
        return format_number(peer["median_us"], 2)
    return peer["status"].split(":", 1)[0]  # the reason is listed under the table


TABLE_COLUMNS = ("op", "bits", "shape", "D", "us", "GB/s", "% ceil", "floor us", "read us", "in-graph us",
                 *(f"{PEER_LABELS[name]} us" for name in PEERS), "note")


def table_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The cells of the case rows (decode and write), in `TABLE_COLUMNS` order."""
    return [(row["op"], str(row["bits"]), row["shape"], str(row["head_dim"]),
             format_number(row["median_us"], 2), format_number(row["gbps"], 0),
             format_number(row["pct_of_ceiling"]), format_number(row["floor_us"], 2),
             format_number(row["plain_read_us"], 2), format_number(row["in_graph_us"], 2),
             *(_peer_cell(row["peers"].get(name)) for name in PEERS), row["note"].split(":", 1)[0])
            for row in rows if row["op"] in OPS]


def _energy_cell(result: dict[str, Any] | None) -> str:
    """``"mJ (W)"`` of a row or peer whose power was measured, else ``"-"``."""
    if result is None or result.get("power_w") is None:
        return "-"
    return f"{format_number(result['energy_mj'])} ({result['power_w']:.0f})"


ENERGY_COLUMNS = ("op", "bits", "shape", "D", "mJ (W)", *(f"{PEER_LABELS[name]} mJ (W)" for name in PEERS))


def energy_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The cells of the case rows whose power was measured (or a peer's), in `ENERGY_COLUMNS` order."""
    return [(row["op"], str(row["bits"]), row["shape"], str(row["head_dim"]), _energy_cell(row),
             *(_energy_cell(row["peers"].get(name)) for name in PEERS))
            for row in rows if row["op"] in OPS and
            any(r.get("power_w") is not None for r in (row, *row["peers"].values()))]


def format_table(cells: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Plain-text columns: text left-aligned, numbers right-aligned."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *cells)]
    numeric = [all(_is_number(row[i]) for row in cells) and bool(cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(row, widths, numeric)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text == "-"
    return True


def format_report(rows: Sequence[dict[str, Any]], device: dict[str, Any], config: Config) -> str:
    """The table, why any cell is empty, the ceiling and launch-floor lines, the parameters and
    the run's context (commit, GPU, driver, date)."""
    by_op = {row["op"]: row for row in rows}
    lines = [format_table(table_rows(rows), TABLE_COLUMNS), "", *_reasons(rows)]
    energy = energy_rows(rows)
    if energy:
        lines += [f"energy per launch, mJ (the board's mean power, W, over about {config.power_window_s:g} s of "
                  f"back-to-back launches: ours in graphs of {GRAPH_CHAIN}, the peers one per graph replay):",
                  format_table(energy, ENERGY_COLUMNS), ""]
    elif config.power_window_s > 0:
        lines.append("power not measured: NVML's energy counter was not available or did not move")
    if "read" in by_op:
        read = by_op["read"]
        lines.append(f"read bandwidth: {format_number(read['gbps'], 0)} GB/s ({read['shape']}, median "
                     f"of {read['samples']}): the ceiling of '% ceil' and 'floor us'; its kernel over a row's "
                     "bytes, one launch per graph replay, the row's 'read us'")
    if "copy" in by_op:
        copy = by_op["copy"]
        lines.append(f"copy bandwidth (read+write): {format_number(copy['gbps'], 0)} GB/s "
                     f"({copy['shape']}, median of {copy['samples']})")
    if "launch" in by_op:
        launch = by_op["launch"]
        lines.append(f"launch floor: {format_number(launch['median_us'], 2)} us ({launch['shape']}); "
                     f"in a graph of {GRAPH_CHAIN} launches {format_number(launch['in_graph_us'], 2)} us "
                     "per launch, the 'in-graph us' of the rows")
    lines.append(f"q_heads {config.num_q_heads}, kv_heads {config.num_kv_heads}, block_size "
                 f"{config.block_size}, sparse V threshold {config.sparse_v_threshold:g}, "
                 f"{'checked mode' if config.checked else 'unchecked'}{_options_text(config)}; "
                 f"median of {config.iters} graph replays rotating {config.sets} input sets; "
                 "L2: all sets fit in L2 together; sets N %: the sets' own medians N % apart; "
                 "power cap / thermal N %: that limit held the GPU's clocks down for N % of the row's timing")
    if "read" in by_op and by_op["read"].get("clock_limited") is None:
        lines.append("clock limits not known: NVML's counters were not available")
    if not device.get("timing_gate", True):
        lines.append("timing gate unsupported by this driver: short launches include host time")
    lines.append(context_line(device))
    return "\n".join(lines)


def context_line(device: dict[str, Any]) -> str:
    """The run's context (`describe_device`) in one line: commit, GPU, driver and date."""
    return (f"commit {device.get('commit') or 'unknown'} | {device.get('name')} | driver "
            f"{device.get('driver') or 'unknown'} (CUDA {device.get('cuda_driver_api')}) | "
            f"{device.get('date')}")


def _options_text(config: Config) -> str:
    """The options that are on, for the report (nothing when all are off)."""
    on = ([f"V encoder {config.v_encoder}"] if config.v_encoder != "matched_norm" else []) + \
         ([f"soft cap {config.soft_cap:g}"] if config.soft_cap else []) + (["sinks"] if config.sinks else []) + \
         ([f"V rotation {config.v_rotation}"] if config.v_rotation != "none" else [])
    if config.lengths == "ramp":
        on.append("sequence i of B holding ceil(context * (i + 1) / B) tokens"
                  + (" (dense peers not run: one length per batch)" if config.peers else ""))
    if config.table_positions:
        on.append(f"block-table rows of {config.table_positions} positions, "
                  + ("passed whole (the plan sized for them)" if config.whole_table_rows
                     else "passed as a column slice (block_tables_stride)"))
    if config.q_len > 1:
        on.append(f"{config.q_len} query tokens per sequence"
                  + (" (peers not run: they decode one)" if config.peers else ""))
    return "".join(f", {text}" for text in on)


def _reasons(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Why table cells are empty: skipped cases, and peers skipped or failed (once per shape,
    as the peers' results repeat over the bits)."""
    found = []
    for row in rows:
        where = f"{row['op']} {row['shape']} D{row['head_dim']}"
        if row["note"].startswith("skipped"):
            found.append(f"{where} {row['bits']}b: {row['note']}")
        found += [f"{where} {name}: {peer['status']}" for name, peer in row["peers"].items()
                  if ":" in peer["status"]]
    return list(dict.fromkeys(found))


def write_json(path: str | Path, rows: Sequence[dict[str, Any]], device: dict[str, Any],
               config: Config) -> None:
    """Write every number of a run to ``path`` as JSON.

    Schema (``"schema": "fp8kturbov-bench/1"``)::

        {"schema": str,
         "device": {"name": str, "driver": str|null, "cuda_driver_api": "13.0",
                    "memory_bytes": int, "l2_bytes": int, "sm_count": int,
                    "timing_gate": bool, "library_version": str, "commit": str|null,
                    "date": ISO 8601 UTC, "python": str, "torch": str|null,
                    "flashinfer": str|null},
         "config": the `Config` fields,
         "rows": [{"op": "read"|"copy"|"launch"|"decode"|"write",
                   "shape": "8x8192" | "128 tok" | description,
                   "bits", "batch", "context", "head_dim", "num_q_heads", "num_kv_heads",
                   "block_size", "q_len": int|null  (null where not applicable; for write,
                                           "batch" is the token rows written, "context" and
                                           "q_len" are null; "q_len": query tokens per
                                           sequence of the decode),
                   "lengths": "equal"|"ramp"|null  the decode's sequence lengths (LENGTHS),
                   "table_positions": int|null  the decode's block-table row width in
                                           positions, 0 for rows of the context's pages,
                   "whole_table_rows": bool|null  whether the decode planned for the whole
                                           rows (else they were a column slice),
                   "bytes": int            bytes the launch must move (see launch_bytes),
                   "median_us", "min_us": float|null  per launch, µs (null: skipped),
                   "samples": int,
                   "set_medians_us": [float]  per launch, the median of each input set's samples
                                           (sample i is of set i mod sets), µs ([] where skipped),
                   "gbps": float|null      bytes / median, 1e9 B/s,
                   "pct_of_ceiling": float|null,
                   "floor_us": float|null  bytes / ceiling, µs,
                   "in_graph_us": float|null  per launch, median over replays of one graph of
                                           GRAPH_CHAIN (32) launches back to back, µs,
                   "clock_limited": {"power cap": float, "thermal": float}|null  the share
                                           (0 to 1) of the row's timing (both kinds of
                                           launch, host time included) during which that limit
                                           held the GPU's clocks down, from NVML's counters
                                           (null: not available, or skipped),
                   "power_w": float|null   the board's mean power, W, over about
                                           Config.power_window_s of the row's launches back to
                                           back in graphs of GRAPH_CHAIN (null: not measured),
                   "energy_mj": float|null  per launch, mJ: power_w x in_graph_us,
                   "note": "" or, joined by ", ": "L2", "sets <N> %", "power cap <N> %",
                           "thermal <N> %" (a limit's share above 1 %); or "skipped: <why>",
                   "peers": {"bf16_sdpa"|"fp8_sdpa"|"fp8_flashinfer": {"status": "ok"|"absent"|
                             "skipped: <why>"|"error: <why>", and when "ok": "bytes",
                             "median_us", "min_us", "samples", "set_medians_us", "gbps",
                             "pct_of_ceiling", "clock_limited", "power_w" (over its graph replays,
                             one launch each), "energy_mj" (power_w x median_us)}}}]}

    The first row is the ceiling (``op == "read"``), the second the copy, the third the launch
    floor.
    """
    document = {"schema": BENCH_SCHEMA, "device": device,
                "config": dataclasses.asdict(config), "rows": list(rows)}
    Path(path).write_text(json.dumps(document, indent=1) + "\n")


def write_plot(path: str | Path, rows: Sequence[dict[str, Any]]) -> str | None:
    """A roofline-style PNG: bytes per launch (log x) against achieved GB/s (log y), one marker
    series per op/bits/head_dim with each point named by its shape, peers as separate markers,
    the plain read of each point's bytes (where measured) as a dash, the ceiling as a horizontal
    line and the ceiling-plus-launch-floor curve. Returns None when
    written, else why it was not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable"
    by_op = {row["op"]: row for row in rows}
    cases = [row for row in rows if row["op"] in OPS and row["gbps"] is not None]
    if "read" not in by_op or not cases:
        return "no measured cases to plot"
    ceiling = by_op["read"]["gbps"]
    figure, axes = plt.subplots(figsize=(9, 6))
    series: dict[str, list[dict[str, Any]]] = {}
    for row in cases:
        series.setdefault(f"{row['op']} {row['bits']}b D{row['head_dim']}", []).append(row)
    for label, members in series.items():
        axes.plot([r["bytes"] for r in members], [r["gbps"] for r in members], "o", label=label)
        for r in members:  # shapes of equal bytes differ in speed: name each point
            axes.annotate(r["shape"], (r["bytes"], r["gbps"]), fontsize=6, xytext=(3, 3),
                          textcoords="offset points")
    plotted = list(cases)
    for name, marker in zip(PEERS, ("x", "s", "^")):
        peers = [row["peers"][name] for row in cases
                 if row["peers"].get(name, {}).get("status") == "ok"]
        if peers:
            axes.scatter([p["bytes"] for p in peers], [p["gbps"] for p in peers], marker=marker,
                         s=60, color="black", label=f"peer {name}", zorder=3)
        plotted += peers
    reads = [r for r in plotted if r.get("plain_read_us")]
    if reads:
        axes.scatter([r["bytes"] for r in reads], [gbps(r["bytes"], r["plain_read_us"]) for r in reads],
                     marker="_", s=120, color="gray", label="plain read of the same bytes", zorder=2)
    axes.axhline(ceiling, color="red", linestyle="--", label=f"read ceiling {ceiling:.0f} GB/s")
    if "launch" in by_op:
        launch_us = by_op["launch"]["median_us"]
        xs = np.logspace(np.log10(min(r["bytes"] for r in plotted)),
                         np.log10(max(r["bytes"] for r in plotted)), 200)
        axes.plot(xs, [gbps(x, floor_us(x, ceiling) + launch_us) for x in xs], ":", color="gray",
                  label=f"ceiling + launch floor {launch_us:.1f} us")
    axes.set(xscale="log", yscale="log", xlabel="bytes moved per launch",
             ylabel="achieved GB/s (1e9 B/s)", title="fp8kturbov: decode and write vs read ceiling")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None

