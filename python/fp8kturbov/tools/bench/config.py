"""What a benchmark run measures: the `Config` (with the command line's parsers of its values),
the cases it expands to (`Shape`, `build_cases`), the bytes each case must move (all in bytes;
bandwidths in GB/s of 1e9 bytes) and a prefill's floating-point operations (`prefill_flops`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fp8kturbov import VEncoder, VRotation
from fp8kturbov._limits import DEFAULT_SPARSE_V_THRESHOLD, MAX_Q_LEN, ROTATION_HEAD_DIMS
from fp8kturbov._scalars import F32_MAX, I32_MAX, U64_MAX

from ..console import GiB
from .kernels import READ_ALIGNMENT

DEFAULT_DECODE_SHAPES: tuple[tuple[int, int], ...] = (
    (1, 32768), (1, 131072), (8, 8192), (32, 8192), (128, 2048), (32, 32768), (1, 1024), (8, 4096))
DEFAULT_WRITE_TOKENS: tuple[int, ...] = (1, 16, 128, 32768)
#: The prefill's shapes where none are given: every `DEFAULT_PREFILL_CHUNKS` fits their contexts.
DEFAULT_PREFILL_SHAPES: tuple[tuple[int, int], ...] = ((1, 8192), (1, 32768), (8, 8192))
#: The prefill's chunks: query tokens per sequence, the last of each sequence's context.
DEFAULT_PREFILL_CHUNKS: tuple[int, ...] = (16, 128, 512, 2048, 8192)
#: The head dims the prefill computes (docs/api.md, "Paged prefill"; others are NOT_SUPPORTED).
PREFILL_HEAD_DIMS = (64, 128, 256)
#: The memory-bound ops, judged against the read ceiling (the roofline table and plot): what a run
#: times unless told otherwise (``--op all``).
BANDWIDTH_OPS = ("decode", "write")
#: Every op, in run order. The prefill, mostly compute-bound and long, runs only when named.
OPS = (*BANDWIDTH_OPS, "prefill")
#: How the decode's sequences of a shape ``BxC`` are long: all ``C`` tokens ("equal"), or
#: sequence ``i`` of ``B`` holding ``ceil(C * (i + 1) / B)`` ("ramp": up to ``C``, about half of
#: the tokens, a batch of mixed lengths such as continuous batching makes).
LENGTHS = ("equal", "ramp")
#: How a decode row's step writes its new tokens (one per query row) before it attends them:
#: not at all ("none": the decode alone), by the decode's fused append ("fused": one launch), or
#: by the cache write followed by the decode ("write": two launches).
APPENDS = ("none", "fused", "write")
V_BITS = (2, 3, 4)
V_ENCODER_NAMES = tuple(encoder.name.lower() for encoder in VEncoder)
V_ROTATION_NAMES = tuple(rotation.name.lower() for rotation in VRotation)
BF16_BYTES = 2
#: Share of the free device memory a case (or a peer) may take; the rest is slack for the
#: allocator's rounding and whatever torch keeps cached.
MEMORY_HEADROOM = 0.9
#: The most of any count the command line takes (tokens, sequences, heads, elements, samples): the
#: C ABI holds sequence lengths, block-table page ids and query_start as int32 positions, its other
#: counts as uint32, so every count up to this one fits wherever the library takes it.
MAX_COUNT = I32_MAX
#: The most of a seed. NumPy's default_rng takes any integer >= 0; the bench's JSON records the seed,
#: and its readers hold 64-bit integers.
MAX_SEED = U64_MAX
#: The largest value of the C ABI's float parameters (float32: sparse_v_threshold, soft_cap); a
#: larger double is inf there.
MAX_C_FLOAT = F32_MAX


def _decimal(digits: str, most: int) -> int | None:
    """The value of ASCII decimal ``digits`` where it is at most ``most``, else None (also for
    text that is not such digits). Measured by its length first: Python refuses to convert very
    long digit strings."""
    significant = digits.lstrip("0") or "0"
    if not (digits.isascii() and digits.isdigit()) or len(significant) > len(str(most)):
        return None
    value = int(significant)
    return value if value <= most else None


def _parse_count(text: str, zero_allowed: bool) -> int:
    """An integer in ``0..MAX_COUNT`` (``1..`` unless ``zero_allowed``), optionally with a ``k``
    suffix (x1024)."""
    body = text.strip().lower()
    scale = 1024 if body.endswith("k") else 1
    digits = body[:-1] if scale > 1 else body
    if not (digits.isascii() and digits.isdigit()) or not (zero_allowed or digits.strip("0")):
        kind = "an integer >= 0" if zero_allowed else "a positive integer"
        raise ValueError(f"{text!r} is not {kind} (a 'k' suffix means x1024)")
    value = _decimal(digits, MAX_COUNT // scale)
    if value is None:
        raise ValueError(f"{text!r} is more than {MAX_COUNT}, the most the library's int32 positions hold")
    return value * scale


def parse_count(text: str) -> int:
    """A positive integer up to `MAX_COUNT`, optionally with a ``k`` suffix (x1024): ``"32768"``,
    ``"32k"``."""
    return _parse_count(text, zero_allowed=False)


def parse_count_or_zero(text: str) -> int:
    """A `parse_count` that may be 0: ``"0"``, ``"20"``."""
    return _parse_count(text, zero_allowed=True)


def parse_counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of `parse_count` values: ``"128,256"``."""
    return tuple(parse_count(item) for item in text.split(","))


def parse_seed(text: str) -> int:
    """A random seed: an integer in ``0..MAX_SEED`` (what NumPy's default_rng takes)."""
    value = _decimal(text.strip(), MAX_SEED)
    if value is None:
        raise ValueError(f"{text!r} is not a seed: an integer in 0..{MAX_SEED}")
    return value


def nonnegative_problem(name: str, value: float, most: float = math.inf) -> str | None:
    """Why ``value``, the option or field ``name``, is not a finite number in ``0..most``; None
    where it is one. NaN and inf never are."""
    if 0 <= value <= most and math.isfinite(value):
        return None
    limit = "" if most == math.inf else f" and at most {most:.4g}"
    return f"{name} = {value} must be finite, >= 0{limit}"


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


def parse_appends(text: str) -> tuple[str, ...]:
    """A comma-separated list of `APPENDS` modes: ``"none,fused"`` -> ``("none", "fused")``."""
    modes = tuple(item.strip() for item in text.split(","))
    unknown = [mode for mode in modes if mode not in APPENDS]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not one of {', '.join(APPENDS)}")
    return modes


def sequence_lengths(batch: int, context: int, lengths: str) -> np.ndarray:
    """The int32 ``seq_lens`` of a decode shape ``batch x context`` (tokens), as `LENGTHS` says."""
    if lengths == "ramp":
        sequence = np.arange(1, batch + 1, dtype=np.int64)
        return (-(-context * sequence // batch)).astype(np.int32)
    return np.full(batch, context, np.int32)


@dataclass(frozen=True)
class Config:
    """What to run. Counts are elements/tokens/sequences; ``ceiling_bytes`` is bytes."""

    ops: tuple[str, ...] = BANDWIDTH_OPS
    # decode, prefill: (batch, context tokens). None (replaced as the Config is made): its ops' default,
    # `DEFAULT_PREFILL_SHAPES` for a run of the prefill without the decode, else `DEFAULT_DECODE_SHAPES`
    shapes: tuple[tuple[int, int], ...] | None = None
    tokens: tuple[int, ...] = DEFAULT_WRITE_TOKENS  # write: token rows per launch
    chunks: tuple[int, ...] = DEFAULT_PREFILL_CHUNKS  # prefill: query tokens per sequence (each <= context)
    bits: tuple[int, ...] = V_BITS
    head_dims: tuple[int, ...] = (128,)
    num_q_heads: int = 32
    num_kv_heads: int = 8
    block_size: int = 16
    iters: int = 200  # timed samples per case
    warmup: int = 20  # untimed launches before them
    sets: int = 3  # input sets rotated among
    sparse_v_threshold: float = DEFAULT_SPARSE_V_THRESHOLD
    checked: bool = False  # checked mode (pool capacity and an error word) on every launch
    v_encoder: str = "matched_norm"  # the write's V encoder (a lower-case VEncoder name)
    soft_cap: float = 0.0  # decode and prefill logit soft-capping, 0 = off
    sinks: bool = False  # decode and prefill with attention sinks (zero logits)
    v_rotation: str = "none"  # write, decode and prefill with this V rotation (a lower-case VRotation name)
    q_len: int = 1  # decode: query tokens per sequence (1: no query_start, the one-token decode)
    lengths: str = "equal"  # decode: one of LENGTHS
    appends: tuple[str, ...] = ("none",)  # decode: a row per APPENDS entry (the step's new tokens)
    table_positions: int = 0  # decode: block-table row width in positions; 0 = each shape's context
    whole_table_rows: bool = False  # decode: plan for the row width (else pass the pages, stride = width)
    peers: bool = True  # the prefill's, and the decode's (not with q_len > 1: they decode one query token)
    ceiling_bytes: int = 2 * GiB  # read by the ceiling's kernel, and copied by the copy
    chunk_tokens: int = 2048  # token rows the NumPy reference encodes, replicated through the pools
    seed: int = 0
    power_window_s: float = 0.0  # seconds of back-to-back launches per row for its mean power; 0 = off

    def __post_init__(self) -> None:
        if self.shapes is None:
            prefill_only = "prefill" in self.ops and "decode" not in self.ops
            object.__setattr__(self, "shapes", DEFAULT_PREFILL_SHAPES if prefill_only else DEFAULT_DECODE_SHAPES)
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
        problems += filter(None, [
            nonnegative_problem("sparse_v_threshold", self.sparse_v_threshold, MAX_C_FLOAT),
            nonnegative_problem("soft_cap", self.soft_cap, MAX_C_FLOAT),
            nonnegative_problem("power_window_s", self.power_window_s)])
        if self.v_encoder not in V_ENCODER_NAMES:
            problems.append(f"v_encoder {self.v_encoder!r} is not one of {V_ENCODER_NAMES}")
        if self.v_rotation not in V_ROTATION_NAMES:
            problems.append(f"v_rotation {self.v_rotation!r} is not one of {V_ROTATION_NAMES}")
        elif self.v_rotation != "none":
            problems += [f"v_rotation {self.v_rotation!r} needs a head_dim in {ROTATION_HEAD_DIMS}, not {d}"
                         for d in self.head_dims if d not in ROTATION_HEAD_DIMS]
        if self.lengths not in LENGTHS:
            problems.append(f"lengths {self.lengths!r} is not one of {LENGTHS}")
        problems += [f"append {mode!r} is not one of {APPENDS}" for mode in self.appends if mode not in APPENDS]
        if not self.appends:
            problems.append(f"appends is empty: give at least one of {APPENDS}")
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
        if "prefill" in self.ops:
            problems += [f"the prefill needs a head_dim in {PREFILL_HEAD_DIMS}, not {d}"
                         for d in self.head_dims if d not in PREFILL_HEAD_DIMS]
            problems += [f"chunk {chunk} must be >= 1" for chunk in self.chunks if chunk < 1]
            problems += [f"chunk {chunk} is longer than the context of prefill shape {batch}x{context}"
                         for batch, context in self.shapes for chunk in self.chunks if chunk > context]
            if not self.chunks:
                problems.append("chunks is empty: give at least one chunk length")
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
    are ``table_blocks`` pages wide, of which the launch plans for `planned_blocks`; ``append``
    (`APPENDS`) says how the step writes each query row's new token first.
    ``op == "prefill"``: as a decode of equal lengths in compact tables, whose ``q_len`` query
    tokens per sequence (its chunk, up to ``context``) always pass through ``query_start``.
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
    append: str = "none"

    @property
    def label(self) -> str:
        return f"{self.batch} tok" if self.op == "write" else f"{self.batch}x{self.context}"

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
        """Pages of one input set's pools: every sequence's own pages (decode, prefill), or just
        enough slots for the rows written (write)."""
        if self.op != "write":
            return self.batch * self.blocks_per_seq
        return -(-self.batch // self.block_size)

    @property
    def query_rows(self) -> int:
        """Rows of q and of the output (decode, prefill): ``batch * q_len``."""
        return self.batch * self.q_len

    @property
    def q_elems(self) -> int:
        """Elements of q, and of the output (decode, prefill): ``query_rows * num_q_heads * head_dim``."""
        return self.query_rows * self.num_q_heads * self.head_dim

    @property
    def query_start(self) -> np.ndarray | None:
        """The int32 ``query_start`` ``[batch + 1]`` (``q_len`` rows per sequence), or None for a
        decode of ``q_len == 1``, which passes none (one query row per sequence); the prefill
        always passes one."""
        if self.q_len == 1 and self.op != "prefill":
            return None
        return np.arange(self.batch + 1, dtype=np.int32) * self.q_len

    @property
    def query_start_bytes(self) -> int:
        """Bytes of `query_start` (int32), 0 where there is none."""
        return 0 if self.query_start is None else (self.batch + 1) * 4

    @property
    def appended_tokens(self) -> int:
        """Token rows the step writes before the decode: one per query row, or none."""
        return 0 if self.op != "decode" or self.append == "none" else self.query_rows

    def describe(self) -> str:
        step = "" if self.append == "none" else f" +{self.append} append"
        chunk = f" chunk {self.q_len}" if self.op == "prefill" else ""
        return f"{self.op} {self.bits}b D{self.head_dim} {self.label}{chunk}{step}"


def build_cases(config: Config) -> list[Shape]:
    """The cases of ``config`` in run order: decode, write, then prefill (a case per chunk of each
    shape); the bits of one shape (and chunk) adjacent, so that the peers (which ignore the bits)
    run once per shape."""
    heads = (config.num_q_heads, config.num_kv_heads, config.block_size)
    sizes = {"decode": config.shapes, "write": [(tokens, 0) for tokens in config.tokens],
             "prefill": config.shapes}
    fields = {"decode": [dict(q_len=config.q_len, lengths=config.lengths, table_positions=config.table_positions,
                              whole_table_rows=config.whole_table_rows)],
              "write": [{}], "prefill": [dict(q_len=chunk) for chunk in config.chunks]}
    appends = {"decode": config.appends, "write": ("none",), "prefill": ("none",)}
    return [Shape(op, bits, batch, context, head_dim, *heads, **shape_fields, append=append)
            for op in OPS if op in config.ops
            for head_dim in config.head_dims
            for batch, context in sizes[op]
            for shape_fields in fields[op]
            for bits in config.bits
            for append in appends[op]]


# ---- Byte and operation counts (bytes; a prefill's FLOPs) -----------------------------------------


def cache_bytes_per_token(shape: Shape) -> int:
    """Cache bytes of one token, all KV heads: K (1 per element) + V codes (bits/8 per element)
    + V scales (1 per 16 elements)."""
    d = shape.head_dim
    return shape.num_kv_heads * (d + d * shape.bits // 8 + d // 16)


def launch_bytes(shape: Shape) -> int:
    """Bytes one launch must move.

    decode: the cache bytes of every attended token (once, whatever ``q_len``: the query tokens
    of a sequence attend its positions together), q read and the output written (bf16,
    ``q_len`` rows per sequence), the used block-table entries and seq_lens (int32),
    ``query_start`` (int32) where ``q_len > 1``, and the appended tokens' write
    (`Shape.appended_tokens`). prefill: the same for its chunk of ``q_len`` rows per sequence
    (the cache bytes of the whole context once, though its CTAs read them once per tile of query
    rows; ``query_start`` always). write: the bf16 K and V rows read, their cache bytes written,
    and the int64 slot mapping.
    """
    if shape.op != "write":
        tables = (shape.used_blocks + shape.batch) * 4
        return (shape.attended_tokens * cache_bytes_per_token(shape)
                + 2 * shape.q_elems * BF16_BYTES + tables + shape.query_start_bytes
                + written_bytes(shape, shape.appended_tokens))
    return written_bytes(shape, shape.batch)


def written_bytes(shape: Shape, tokens: int) -> int:
    """Bytes of a write of ``tokens`` rows: their bf16 K and V read, their cache bytes written,
    their int64 slots read."""
    return tokens * (2 * shape.row_elems * BF16_BYTES + cache_bytes_per_token(shape) + 8)


def peer_bytes(shape: Shape, kv_element_bytes: int) -> int:
    """Bytes a dense-cache peer must move for a decode (or prefill) shape: K and V of
    ``kv_element_bytes`` per element for every attended token, plus q and the output (bf16)."""
    kv = 2 * shape.attended_tokens * shape.row_elems * kv_element_bytes
    return kv + 2 * shape.q_elems * BF16_BYTES


def device_bytes(shape: Shape, sets: int) -> int:
    """Device memory one case allocates for ``sets`` input sets: the pools plus the inputs."""
    pool_slots = shape.num_blocks * shape.block_size
    pools = pool_slots * cache_bytes_per_token(shape)
    if shape.op != "write":
        per_set = (pools + 2 * shape.q_elems * BF16_BYTES + shape.batch * (shape.table_blocks + 1) * 4
                   + shape.query_start_bytes + shape.appended_tokens * (2 * shape.row_elems * BF16_BYTES + 8))
    else:
        per_set = pools + shape.batch * (2 * shape.row_elems * BF16_BYTES + 8)
    return sets * per_set


def prefill_flops(shape: Shape) -> int:
    """Floating-point operations of a prefill: ``4 * num_q_heads * head_dim`` per (query token,
    attended position) pair (``Q·Kᵀ`` and ``P·V``, a multiply and an add each), the pairs counted
    exactly over the causal triangle: token ``i`` of a chunk of ``q_len`` attends the first
    ``seq_len - q_len + i + 1`` positions."""
    seq_lens, q_len = shape.seq_lens.astype(np.int64), shape.q_len
    pairs = int((q_len * (seq_lens - q_len) + q_len * (q_len + 1) // 2).sum())
    return 4 * shape.num_q_heads * shape.head_dim * pairs


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
