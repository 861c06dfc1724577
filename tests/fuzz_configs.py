"""The random configurations of the differential GPU fuzz (tests/test_gpu_fuzz.py).

A seed gives one configuration (`draw_config`): a cache layout (width, head_dim, KV heads, page size,
pool size, padded page strides and sections, K scale, rotation, checked mode, where the pools start)
and a few steps in random order — writes, decodes and dequantizes — each with its own sizes,
options, row strides, buffer offsets and stream. `FuzzCase` turns the configuration into its inputs
and the NumPy reference's results, step after step on one pair of pools, and launches each step on
the device addresses it is given; the seed replays the whole case. Everything here runs without a
GPU: tests/test_fuzz_configs.py checks that every configuration is one the library accepts.

What a configuration never holds, because the library documents another result or none: slots or
page ids outside the pools without checked mode (undefined behaviour), one slot twice in a write
(a race), and NaN or ±Inf data together with a decode (docs/RELIABILITY.md §4.3: the kernels'
tiles may spread a NaN further than the reference's rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

import fp8kturbov
from conftest import widened_rows
from fp8kturbov import reference as ref
from fp8kturbov._limits import DEFAULT_SPARSE_V_THRESHOLD, MAX_Q_LEN, ROTATION_HEAD_DIMS
from test_checked_mode import remaining_pages
from test_collateral_writes import BF16, PADDING, POISON
from test_gpu_kernels import random_rows, skippable_mass_times_norm

# The kernels multiply V by the softmax weights in fp16, each weight relative to a running maximum
# no larger than the row's final one: a weight below fp16's smallest normal keeps only absolute
# precision (2^-24) or vanishes. Where a row's mass lies on such weights alone (a q scaled up, its
# one large score on a zero V group), its output is tiny and carries no relative precision.
FP16_SMALLEST_NORMAL = 2.0**-14

#: Head dims the decode is built for (FP8KTURBOV_HEAD_DIMS, docs/api.md).
DECODE_HEAD_DIMS = (64, 128, 256, 512)
#: Size classes of a configuration: "small" ones run under compute-sanitizer memcheck, "long" ones
#: hold a sequence of 500 to 3000 positions.
SIZES = ("small", "medium", "long")
#: The alignment in bytes that the library asks of each buffer (cuda/include/fp8kturbov.h); a
#: buffer starts a random multiple of it into its allocation.
ALIGNMENT = {"k_cache": 16, "v_cache": 4, "key": 2, "value": 2, "slot_mapping": 8, "q": 2, "output": 2,
             "block_tables": 4, "seq_lens": 4, "query_start": 4, "sinks": 4, "workspace": 16}
#: Block-table entries that checked mode must leave out (with ``num_blocks``: the first two).
BAD_PAGE_IDS = ("num_blocks", "num_blocks + 1000", -1, -5, np.iinfo(np.int32).min, np.iinfo(np.int32).max)
#: The entry of a block table past a sequence's pages: never read.
UNUSED_ENTRY = -7
FLAGS = fp8kturbov.IndexErrorFlags


# ---- The configuration ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """The cache of a configuration; strides, sections and offsets in bytes."""

    bits: int
    head_dim: int
    num_kv_heads: int
    block_size: int
    num_blocks: int
    k_stride: int
    v_data: int
    v_stride: int
    k_scale: float
    rotation: bool
    checked: bool
    k_offset: int
    v_offset: int

    @property
    def n(self) -> int:
        """Elements of a token row."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def k_packed(self) -> bool:
        return self.k_stride == ref.k_page_bytes(self.block_size, self.num_kv_heads, self.head_dim)

    def scalars(self) -> dict[str, Any]:
        """The launchers' layout arguments."""
        return dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=self.block_size,
                    k_scale=self.k_scale, v_bits=self.bits, k_block_stride_bytes=self.k_stride,
                    v_block_stride_bytes=self.v_stride, v_data_section_bytes=self.v_data)


@dataclass(frozen=True)
class WriteStep:
    entry: str  # "generic" (fp8kturbov_reshape_and_cache) or "fixed" (the bits' own launcher)
    encoder: str
    num_valid: int  # distinct slots inside the pools
    num_padding: int  # negative slots (write nothing)
    num_outside: int  # slots of pages >= num_blocks (checked mode only)
    key_stride: int
    value_stride: int
    hostile: bool  # NaN and ±Inf among the rows
    stream: int
    offsets: dict[str, int] = field(hash=False)


@dataclass(frozen=True)
class DecodeStep:
    entry: str  # "generic" (fp8kturbov_paged_decode_attn) or "fixed" (the bits' own launcher)
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...] | None  # multi-token decode through query_start; None: one row each
    max_q_len: int
    max_blocks_per_seq: int
    table_width: int | None  # block_tables_stride; None: rows as wide as max_blocks_per_seq
    group_size: int
    window: int
    q_stride: int
    q_gain: float
    inv_sqrt_d: float
    sinks: bool
    soft_cap: float
    sparse_v_threshold: float | None  # None: the library's default
    workspace: str  # "none", "full", "partial" or "larger" than paged_decode_workspace_bytes
    k_stride_arg: int  # k_block_stride_bytes as passed (0 = packed)
    bad_pages: int  # attended block-table entries outside the pools (checked mode only)
    bad_seq_len: str | None  # "negative" or "beyond" the table (checked mode only)
    stream: int
    offsets: dict[str, int] = field(hash=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass(frozen=True)
class DequantizeStep:
    num_valid: int  # slots inside the pools, repeats allowed
    num_padding: int  # negative slots (zero rows)
    num_outside: int  # slots of pages >= num_blocks (checked mode only)
    key_stride: int
    value_stride: int
    stream: int
    offsets: dict[str, int] = field(hash=False)


@dataclass(frozen=True)
class FuzzConfig:
    seed: int
    size: str
    layout: Layout
    num_streams: int
    steps: tuple[WriteStep | DecodeStep | DequantizeStep, ...]


def _pick(rng: np.random.Generator, options, weights=None):
    """One of ``options`` (a Python value), with ``weights`` (normalised here) or uniformly."""
    p = None if weights is None else np.asarray(weights, dtype=float) / np.sum(weights)
    return options[int(rng.choice(len(options), p=p))]


def _offsets(rng: np.random.Generator, names: tuple[str, ...]) -> dict[str, int]:
    """Where each buffer starts in its allocation: at 0 half of the time, else a random multiple
    of its alignment up to 15 of them."""
    return {name: ALIGNMENT[name] * (0 if rng.random() < 0.5 else int(rng.integers(1, 16))) for name in names}


def _row_stride(rng: np.random.Generator, n: int) -> int:
    """Row strides in elements: packed, padded by a multiple of 8 (16-byte loads) or oddly."""
    return n + _pick(rng, (0, 0, 8, 64, 1, 3))


def draw_config(seed: int) -> FuzzConfig:
    """The configuration of ``seed`` (an int >= 0); the same seed gives the same configuration."""
    rng = np.random.default_rng([seed, 0])
    size = _pick(rng, SIZES, (25, 72, 3))
    layout = _draw_layout(rng, size)
    num_streams = int(rng.integers(1, 5))
    hostile = rng.random() < 0.1  # NaN/Inf rows: writes and dequantizes only
    kinds = ("write", "dequantize") if hostile else ("write", "decode", "dequantize")
    weights = (2, 1) if hostile else (2, 2, 1)
    steps = []
    for _ in range(int(rng.integers(1, 5 if size == "small" else 6))):
        kind = _pick(rng, kinds, weights)
        stream = int(rng.integers(num_streams))
        if kind == "write":
            steps.append(_draw_write(rng, size, layout, hostile, stream))
        elif kind == "decode":
            steps.append(_draw_decode(rng, size, layout, stream))
        else:
            steps.append(_draw_dequantize(rng, size, layout, stream))
    return FuzzConfig(seed, size, layout, num_streams, tuple(steps))


def _draw_layout(rng: np.random.Generator, size: str) -> Layout:
    bits = _pick(rng, (2, 3, 4))
    if size == "small":
        head_dim, num_kv_heads = _pick(rng, (64, 128)), _pick(rng, (1, 2))
        block_size, num_blocks = _pick(rng, (1, 8, 16)), int(rng.integers(1, 7))
    else:
        head_dim = _pick(rng, DECODE_HEAD_DIMS, (35, 35, 20, 10))
        num_kv_heads = _pick(rng, (1, 2, 3, 4, 8), (3, 3, 1, 2, 1)) if head_dim < 512 else _pick(rng, (1, 2))
        block_size = _pick(rng, (16, 32, 8)) if size == "long" else _pick(rng, (1, 2, 3, 8, 12, 16, 24, 32, 64))
        # At most 2^19 elements of rows in the pools (the reference writes every slot first).
        num_blocks = int(rng.integers(4 if size == "long" else 1, min(40, 2**19 // (block_size * num_kv_heads * head_dim)) + 1))
    packed = (block_size, num_kv_heads, head_dim)
    k_stride = ref.k_page_bytes(*packed) + 16 * _pick(rng, (0, 0, 0, 1, 3))
    v_data = ref.v_data_section_bytes(*packed, bits) + 4 * _pick(rng, (0, 0, 1, 2, 5))
    v_stride = v_data + ref.v_scale_section_bytes(*packed) + 4 * _pick(rng, (0, 0, 1, 3, 6))
    k_scale = 0.05 if rng.random() < 0.5 else float(np.float32(math.exp(rng.uniform(math.log(0.005), math.log(2)))))
    rotation = head_dim in ROTATION_HEAD_DIMS and rng.random() < 0.2
    offsets = _offsets(rng, ("k_cache", "v_cache"))
    return Layout(bits, head_dim, num_kv_heads, block_size, num_blocks, k_stride, v_data, v_stride, k_scale,
                  rotation, checked=bool(rng.random() < 0.3), k_offset=offsets["k_cache"],
                  v_offset=offsets["v_cache"])


def _draw_write(rng: np.random.Generator, size: str, layout: Layout, hostile: bool, stream: int) -> WriteStep:
    fixed = not layout.checked and not layout.rotation and rng.random() < 0.2
    searching = not fixed and rng.random() < 0.1
    encoder = _pick(rng, ("mse", "projection")) if searching else "matched_norm"
    most = 2 if searching else {"small": 8, "medium": 48, "long": 64}[size]  # the reference's cost
    num_valid = int(rng.integers(0 if rng.random() < 0.05 else 1, min(most, layout.num_slots) + 1))
    return WriteStep("fixed" if fixed else "generic", encoder, num_valid, int(rng.integers(0, 3)),
                     int(rng.integers(0, 3)) if layout.checked else 0, _row_stride(rng, layout.n),
                     _row_stride(rng, layout.n), hostile and num_valid > 0, stream,
                     _offsets(rng, ("key", "value", "slot_mapping")))


def _draw_dequantize(rng: np.random.Generator, size: str, layout: Layout, stream: int) -> DequantizeStep:
    most = {"small": 8, "medium": 64, "long": 64}[size]
    return DequantizeStep(int(rng.integers(0, most + 1)), int(rng.integers(0, 3)),
                          int(rng.integers(0, 3)) if layout.checked else 0, _row_stride(rng, layout.n),
                          _row_stride(rng, layout.n), stream, _offsets(rng, ("key", "value", "slot_mapping")))


def _draw_seq_len(rng: np.random.Generator, size: str, block_size: int) -> int:
    """0, 1, the edges of a page and short lengths; up to 300 positions beyond "small"."""
    edges = [0, 1, max(block_size - 1, 0), block_size, block_size + 1, 2 * block_size]
    if size == "small":
        return min(_pick(rng, (*edges, int(rng.integers(2, 41)))), 40)
    return _pick(rng, (*edges, int(rng.integers(2, 65)), int(rng.integers(2, 301))))


def _draw_decode(rng: np.random.Generator, size: str, layout: Layout, stream: int) -> DecodeStep:
    B = layout.block_size
    fixed = layout.k_packed and not layout.rotation and not layout.checked and rng.random() < 0.15
    num_seqs = int(rng.integers(1, {"small": 4, "medium": 7, "long": 4}[size]))
    seq_lens = [_draw_seq_len(rng, size, B) for _ in range(num_seqs)]
    if size == "long":
        seq_lens[0] = int(rng.integers(500, 3001))
    group_size = _pick(rng, (1, 2, 3, 4, 5, 8, 12, 16), (3, 2, 1, 3, 1, 2, 1, 1))
    num_q_heads = layout.num_kv_heads * group_size
    bad_pages = int(rng.integers(1, 4)) if layout.checked and rng.random() < 0.3 else 0
    bad_seq_len = _pick(rng, ("negative", "beyond")) if layout.checked and rng.random() < 0.15 else None
    # Out-of-range pages are left out of a sequence; the reference then reads the remaining ones
    # (test_checked_mode.remaining_pages), in which positions shift: one query row, no window.
    index_errors = bad_pages > 0 or bad_seq_len is not None
    q_lens = None
    if not fixed and not index_errors and rng.random() < 0.25:
        most = max(1, min(MAX_Q_LEN, 256 // (num_seqs * num_q_heads)))  # the reference's cost
        q_lens = tuple(int(rng.integers(0, min(most, length) + 1)) for length in seq_lens)
    max_q_len = 0 if q_lens is None else min(MAX_Q_LEN, max(max(q_lens), 1) + _pick(rng, (0, 0, 1, 5)))
    longest = -(-max(seq_lens) // B)
    extra = _pick(rng, (0, 0, 1, 3, int(rng.integers(8, 4096 // B + 9))))  # long tables plan more splits
    max_blocks_per_seq = max(longest + extra, 1)
    window = 0
    if not index_errors and rng.random() < 0.4:
        window = _pick(rng, (1, B, int(rng.integers(1, 65)), int(rng.integers(1, max(max(seq_lens), 1) + 1))))
    options = not fixed and rng.random() < 0.35
    sinks = options and rng.random() < 0.6
    soft_cap = _pick(rng, (5.0, 30.0)) if options and rng.random() < 0.6 else 0.0
    if fixed:
        sparse_v_threshold = DEFAULT_SPARSE_V_THRESHOLD  # what the fixed launchers use
    elif sinks or soft_cap:
        sparse_v_threshold = 0.0  # the sparse-V bound below is that of plain softmax rows
    else:
        sparse_v_threshold = _pick(rng, (0.0, None, 1e-3, 1e-2), (12, 3, 2, 3))
    return DecodeStep(
        "fixed" if fixed else "generic", tuple(seq_lens), q_lens, max_q_len, max_blocks_per_seq,
        None if fixed or rng.random() < 0.8 else max_blocks_per_seq + int(rng.integers(1, 9)), group_size, window,
        num_q_heads * layout.head_dim + _pick(rng, (0, 0, 1, 8, 13)), _pick(rng, (1.0, 1.0, 4.0, 8.0 if soft_cap else 1.0)),
        _pick(rng, (1 / math.sqrt(layout.head_dim), float(rng.uniform(0.02, 0.5)), 0.0), (14, 5, 1)),
        sinks, soft_cap, sparse_v_threshold, "none" if fixed else _pick(rng, ("none", "full", "full", "partial", "larger")),
        0 if layout.k_packed and (fixed or rng.random() < 0.5) else layout.k_stride, bad_pages, bad_seq_len, stream,
        _offsets(rng, ("q", "output", "block_tables", "seq_lens", "query_start", "sinks", "workspace")))


# ---- Inputs and the reference's results -----------------------------------------------------------
def written_pools(layout: Layout, k_pool: np.ndarray, v_pool: np.ndarray, key: np.ndarray,
                  value: np.ndarray) -> None:
    """``reference.write_cache`` of token rows ``key``/``value`` (``[num_slots, n]``) into every slot in
    order, at once: the reference's encoders on all rows, the bytes placed page by page (FORMAT.md
    §2, §3; tests/test_fuzz_configs.py compares it with ``write_cache``). The bytes between the
    sections and pages keep theirs."""
    B, n, pages = layout.block_size, layout.n, layout.num_blocks
    row_data = n * layout.bits // 8
    k_pages = k_pool.reshape(pages, layout.k_stride)
    k_pages[:, :B * n] = ref.encode_k(key, layout.k_scale).reshape(pages, B * n)
    data, scales = ref.encode_v(value, layout.bits)
    v_pages = v_pool.reshape(pages, layout.v_stride)
    v_pages[:, :B * row_data] = data.reshape(pages, B * row_data)
    v_pages[:, layout.v_data:layout.v_data + B * n // 16] = scales.reshape(pages, B * n // 16)


def pool_image(rng: np.random.Generator, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """The pools before the first step: random bytes, with every slot written (`written_pools`) from
    rows as the GPU tests draw them (N(0, 1), an eighth of them x10, 5 % of the groups zero)."""
    k_pool = rng.integers(0, 256, layout.num_blocks * layout.k_stride, dtype=np.uint8)
    v_pool = rng.integers(0, 256, layout.num_blocks * layout.v_stride, dtype=np.uint8)
    rows = [random_rows(rng, layout.num_slots, layout.n, layout.n, hostile=False) for _ in range(2)]
    written_pools(layout, k_pool, v_pool, *rows)
    return k_pool, v_pool


def _poisoned_rows(num_rows: int, stride: int) -> np.ndarray:
    return np.full((num_rows, stride), POISON, dtype=np.uint16)


def _outside_slots(rng: np.random.Generator, layout: Layout, count: int) -> np.ndarray:
    """Slots of pages ``num_blocks`` and beyond (up to 2^40)."""
    first = layout.num_slots
    return np.array([_pick(rng, (first, first + layout.block_size - 1, first + layout.block_size + 3, 2**40))
                     for _ in range(count)], dtype=np.int64)


def _padding_slots(rng: np.random.Generator, count: int) -> np.ndarray:
    return np.array([_pick(rng, PADDING) for _ in range(count)], dtype=np.int64)


def _write_rows(rng: np.random.Generator, num_rows: int, stride: int, n: int, hostile: bool) -> np.ndarray:
    """A write's token rows as `random_rows` draws them, or none for a write of no tokens
    (`random_rows` cannot shape zero rows into groups of 16)."""
    if num_rows == 0:
        return np.empty((0, stride), BF16)
    return random_rows(rng, num_rows, stride, n, hostile=hostile)


class WriteRun:
    """A write with its inputs and the pools the reference writes."""

    def __init__(self, rng: np.random.Generator, layout: Layout, step: WriteStep, k_pool: np.ndarray,
                 v_pool: np.ndarray) -> None:
        self.layout, self.step = layout, step
        valid = rng.choice(layout.num_slots, size=step.num_valid, replace=False).astype(np.int64)
        slots = np.concatenate([valid, _padding_slots(rng, step.num_padding),
                                _outside_slots(rng, layout, step.num_outside)])
        self.slots = rng.permutation(slots)
        self.num_tokens = len(self.slots)
        self.key = _write_rows(rng, self.num_tokens, step.key_stride, layout.n, step.hostile)
        self.value = _write_rows(rng, self.num_tokens, step.value_stride, layout.n, step.hostile)
        self.expected_flags = FLAGS.SLOT if step.num_outside else FLAGS(0)
        kept = self.slots < layout.num_slots  # checked mode skips the others
        ref.write_cache(self.key[kept], self.value[kept], k_pool, v_pool, self.slots[kept], int(kept.sum()),
                        layout.num_kv_heads, layout.head_dim, layout.block_size, step.key_stride,
                        step.value_stride, layout.k_scale, layout.k_stride, layout.v_stride, layout.v_data,
                        layout.bits, encoder=step.encoder, rotation=layout.rotation)
        self.expected_k_pool, self.expected_v_pool = k_pool.copy(), v_pool.copy()

    def buffers(self) -> dict[str, np.ndarray]:
        """The host arrays the launch reads, by argument name."""
        return {"key": self.key.view(np.uint16), "value": self.value.view(np.uint16), "slot_mapping": self.slots}

    def launch(self, address: dict[str, int], stream: Any, checked: dict[str, int]) -> None:
        """Enqueue the write on ``stream``: ``address`` holds the device address of every buffer
        and of the pools (``k_cache``, ``v_cache``), ``checked`` the checked-mode arguments."""
        step, layout = self.step, self.layout
        pointers = [address[name] for name in ("key", "value", "k_cache", "v_cache", "slot_mapping")]
        rows = dict(num_tokens=self.num_tokens, key_stride=step.key_stride, value_stride=step.value_stride)
        if step.entry == "fixed":
            launcher = getattr(fp8kturbov, f"reshape_and_cache_fp8k_turbo{layout.bits}v")
            scalars = layout.scalars()
            del scalars["v_bits"]
            launcher(*pointers, **rows, **scalars, stream=stream)
            return
        fp8kturbov.reshape_and_cache(*pointers, **rows, **layout.scalars(), **checked,
                                     v_encoder=fp8kturbov.VEncoder[step.encoder.upper()],
                                     v_rotation=int(layout.rotation), stream=stream)


class DequantizeRun:
    """A dequantize with its inputs and the rows the reference reads (bf16 bits in rows of the
    step's strides; the elements past a row's ``n`` keep the poison)."""

    def __init__(self, rng: np.random.Generator, layout: Layout, step: DequantizeStep, k_pool: np.ndarray,
                 v_pool: np.ndarray) -> None:
        self.layout, self.step = layout, step
        slots = np.concatenate([rng.integers(0, max(layout.num_slots, 1), step.num_valid),
                                _padding_slots(rng, step.num_padding), _outside_slots(rng, layout, step.num_outside)])
        self.slots = rng.permutation(slots.astype(np.int64))
        self.num_tokens = len(self.slots)
        self.expected_flags = FLAGS.SLOT if step.num_outside else FLAGS(0)
        inside = np.where(self.slots < layout.num_slots, self.slots, -1)  # checked mode gives zero rows
        key, value = ref.dequantize_cache(k_pool, v_pool, inside, self.num_tokens, layout.num_kv_heads,
                                          layout.head_dim, layout.block_size, layout.k_scale, layout.k_stride,
                                          layout.v_stride, layout.v_data, layout.bits)
        self.expected_key = _poisoned_rows(self.num_tokens, step.key_stride)
        self.expected_key[:, :layout.n] = key.view(np.uint16)
        self.expected_value = _poisoned_rows(self.num_tokens, step.value_stride)
        self.expected_value[:, :layout.n] = value.view(np.uint16)

    def buffers(self) -> dict[str, np.ndarray]:
        """The host arrays of the launch, by argument name: the slots, and the outputs poisoned."""
        return {"slot_mapping": self.slots, "key": _poisoned_rows(self.num_tokens, self.step.key_stride),
                "value": _poisoned_rows(self.num_tokens, self.step.value_stride)}

    def launch(self, address: dict[str, int], stream: Any, checked: dict[str, int]) -> None:
        """Enqueue the dequantize on ``stream`` (see `WriteRun.launch`)."""
        pointers = [address[name] for name in ("k_cache", "v_cache", "slot_mapping", "key", "value")]
        fp8kturbov.dequantize(*pointers, num_tokens=self.num_tokens, key_stride=self.step.key_stride,
                              value_stride=self.step.value_stride, **self.layout.scalars(), **checked,
                              stream=stream)


class DecodeRun:
    """A decode with its inputs, the float64 reference output and the bound on its deviation
    beyond rounding (``bound``): the softmax mass, times V's norm, of the positions whose weight
    is at most the sparse-V threshold or fp16's smallest normal (FP16_SMALLEST_NORMAL)."""

    def __init__(self, rng: np.random.Generator, layout: Layout, step: DecodeStep, k_pool: np.ndarray,
                 v_pool: np.ndarray) -> None:
        self.layout, self.step = layout, step
        B, num_seqs = layout.block_size, step.num_seqs
        self.num_q_heads = layout.num_kv_heads * step.group_size
        self.seq_lens = np.array(step.seq_lens, dtype=np.int32)
        tables = rng.integers(0, layout.num_blocks, (num_seqs, step.max_blocks_per_seq)).astype(np.int32)
        pages = -(-self.seq_lens // B)
        tables[np.arange(step.max_blocks_per_seq) >= pages[:, None]] = UNUSED_ENTRY
        flags = FLAGS(0)
        if step.bad_seq_len is not None:  # clamped to 0, or to the table, whose entries are then all pages
            s = int(rng.integers(num_seqs))
            self.seq_lens[s] = -3 if step.bad_seq_len == "negative" else step.max_blocks_per_seq * B + 5
            tables[s] = rng.integers(0, layout.num_blocks, step.max_blocks_per_seq)
            flags |= FLAGS.SEQ_LEN
        attended = [(s, j) for s in range(num_seqs) for j in range(-(-max(int(self.seq_lens[s]), 0) // B))
                    if j < step.max_blocks_per_seq]
        for index in rng.permutation(len(attended))[:step.bad_pages]:
            s, j = attended[index]
            bad = _pick(rng, BAD_PAGE_IDS)
            tables[s, j] = {"num_blocks": layout.num_blocks, "num_blocks + 1000": layout.num_blocks + 1000}.get(bad, bad)
            flags |= FLAGS.BLOCK_TABLE
        self.expected_flags = flags
        self.block_tables = tables if step.table_width is None else widened_rows(tables, step.table_width)
        self.query_start = None if step.q_lens is None else np.concatenate([[0], np.cumsum(step.q_lens)]).astype(np.int32)
        self.num_rows = num_seqs if step.q_lens is None else int(self.query_start[-1])
        q = np.full((self.num_rows, step.q_stride), np.nan, dtype=np.float32)  # a read of the padding shows
        q[:, :self.num_q_heads * layout.head_dim] = rng.standard_normal(
            (self.num_rows, self.num_q_heads * layout.head_dim)) * step.q_gain
        self.q = q.astype(BF16)
        self.sinks = (rng.standard_normal(self.num_q_heads) * 4).astype(np.float32) if step.sinks else None
        if flags:
            tables, lengths = remaining_pages(SimpleNamespace(block_size=B, max_blocks_per_seq=step.max_blocks_per_seq,
                                                              num_seqs=num_seqs, num_blocks=layout.num_blocks),
                                              tables, self.seq_lens)
        else:
            lengths = self.seq_lens
        threshold = DEFAULT_SPARSE_V_THRESHOLD if step.sparse_v_threshold is None else step.sparse_v_threshold
        self.expected = ref.paged_decode(
            self.q, k_pool, v_pool, tables, lengths, step.max_blocks_per_seq, num_seqs, self.num_q_heads,
            layout.num_kv_heads, layout.head_dim, B, step.inv_sqrt_d, layout.k_scale, step.q_stride,
            layout.v_stride, layout.v_data, step.window, layout.bits, k_block_stride_bytes=layout.k_stride,
            query_start=self.query_start, sinks=self.sinks, soft_cap=step.soft_cap, rotation=layout.rotation)
        self.bound = skippable_mass_times_norm(SimpleNamespace(
            head_dim=layout.head_dim, num_q_heads=self.num_q_heads, num_kv_heads=layout.num_kv_heads,
            num_rows=self.num_rows, q=self.q, query_start=self.query_start, num_seqs=num_seqs,
            seq_lens=lengths, window=step.window, block_tables=tables, block_size=B, k_pool=k_pool,
            k_stride=layout.k_stride, v_pool=v_pool, bits=layout.bits, v_data=layout.v_data,
            v_stride=layout.v_stride, k_scale=layout.k_scale, inv_sqrt_d=step.inv_sqrt_d, soft_cap=step.soft_cap),
            max(threshold, FP16_SMALLEST_NORMAL))

    def plan_scalars(self) -> dict[str, Any]:
        """The scalars that `fp8kturbov.paged_decode_workspace_bytes` takes, as the launch passes them."""
        step, layout = self.step, self.layout
        scalars = layout.scalars()
        scalars["k_block_stride_bytes"] = step.k_stride_arg
        return dict(scalars, max_blocks_per_seq=step.max_blocks_per_seq, num_seqs=step.num_seqs,
                    num_q_heads=self.num_q_heads, q_stride=step.q_stride, sliding_window=step.window,
                    inv_sqrt_d=step.inv_sqrt_d, sparse_v_threshold=step.sparse_v_threshold,
                    soft_cap=step.soft_cap, max_q_len=step.max_q_len, v_rotation=int(layout.rotation))

    def workspace_bytes(self, full: int) -> int:
        """The workspace of the step's kind, given the size of the full plan's (``full``)."""
        kind = self.step.workspace
        return {"none": 0, "full": full, "partial": full // 3 + 5 if full else 0, "larger": full + 4096}[kind]

    def buffers(self) -> dict[str, np.ndarray]:
        """The host arrays of the launch, by argument name: the inputs, and the output poisoned."""
        arrays = {"q": self.q.view(np.uint16), "block_tables": self.block_tables, "seq_lens": self.seq_lens,
                  "output": np.full((self.num_rows, self.num_q_heads, self.layout.head_dim), POISON, np.uint16)}
        if self.query_start is not None:
            arrays["query_start"] = self.query_start
        if self.sinks is not None:
            arrays["sinks"] = self.sinks
        return arrays

    def launch(self, address: dict[str, int], stream: Any, checked: dict[str, int],
               workspace: tuple[int, int] = (0, 0)) -> None:
        """Enqueue the decode on ``stream`` (see `WriteRun.launch`); ``workspace``: its device address
        and size in bytes."""
        step = self.step
        pointers = [address[name] for name in ("q", "k_cache", "v_cache", "output", "block_tables", "seq_lens")]
        scalars = self.plan_scalars()
        if step.entry == "fixed":
            launcher = getattr(fp8kturbov, f"paged_decode_attn_fp8k_turbo{self.layout.bits}v")
            fixed = ("max_blocks_per_seq", "num_seqs", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
                     "inv_sqrt_d", "k_scale", "q_stride", "v_block_stride_bytes", "v_data_section_bytes")
            launcher(*pointers, **{name: scalars[name] for name in fixed}, sliding_window=step.window, stream=stream)
            return
        multi_token = {} if self.query_start is None else dict(query_start=address["query_start"],
                                                               num_query_rows=self.num_rows)
        fp8kturbov.paged_decode_attn(
            *pointers, **scalars, **multi_token, **checked, workspace=workspace[0], workspace_bytes=workspace[1],
            sinks=address.get("sinks", 0), block_tables_stride=step.table_width or 0, stream=stream)


class FuzzCase:
    """A configuration's inputs and the reference's results: the pools before the first step
    (``k_pool``, ``v_pool``), one run per step in order (``runs``; each step sees the pools as the
    steps before it left them) and the pools after the last (``final_k_pool``, ``final_v_pool``)."""

    RUNS = {WriteStep: WriteRun, DecodeStep: DecodeRun, DequantizeStep: DequantizeRun}

    def __init__(self, config: FuzzConfig) -> None:
        self.config = config
        rng = np.random.default_rng([config.seed, 1])
        self.k_pool, self.v_pool = pool_image(rng, config.layout)
        k_pool, v_pool = self.k_pool.copy(), self.v_pool.copy()
        self.runs = [self.RUNS[type(step)](rng, config.layout, step, k_pool, v_pool) for step in config.steps]
        self.final_k_pool, self.final_v_pool = k_pool, v_pool

    def checked_args(self, error_flags: int) -> dict[str, int]:
        """The checked-mode arguments of a launch reporting to the word at ``error_flags``."""
        layout = self.config.layout
        return dict(num_blocks=layout.num_blocks, error_flags=error_flags) if layout.checked else {}
