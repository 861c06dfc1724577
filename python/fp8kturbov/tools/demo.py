"""What ``python -m fp8kturbov demo`` runs: a ragged batch written and decoded, checked against
the NumPy reference.

`build_demo_case` makes the batch (random K/V with outlier rows, or a ``--kv-file``'s arrays);
`reference_pools` and `reference_decode` run the float64 NumPy reference; `run_kernels` runs and
times the library's kernels on a `Device`; `gpu_report` compares the two and `exact_attention`
gives the format's error against unquantised attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import zipfile
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from fp8kturbov import CacheLayout, VEncoder, VRotation, paged_decode_workspace_bytes, planning
from fp8kturbov._device import BenchError, Device, cu, driver_call, first_line
from fp8kturbov._limits import ROTATION_HEAD_DIMS

from .bench import launches, timing
from .bench.config import MAX_C_FLOAT, Shape, gbps, nonnegative_problem
from .console import progress

DEFAULT_SEQ_LENS = (2048, 1500, 640, 37)
#: Share of the random token rows scaled by OUTLIER_GAIN (in K and V, every KV head).
OUTLIER_ROW_SHARE, OUTLIER_GAIN = 1 / 64, 10.0
#: Largest relative error per (sequence, head) allowed between the decode kernel and the float64
#: reference decode of the same cache (the bound of the GPU test suite).
DECODE_REL_TOL = 1e-2
DEMO_WARMUP = 3
#: The arrays a ``--kv-file`` may hold: the kind of number each holds, and its dimensions.
KV_FILE_ARRAYS = {"k": (np.floating, 3), "v": (np.floating, 3), "q": (np.floating, 3),
                  "seq_lens": (np.integer, 1)}


def _bf16() -> Any:
    """``ml_dtypes.bfloat16``: imported on use, as the NumPy reference's own dependency."""
    import ml_dtypes

    return ml_dtypes.bfloat16


@dataclass(frozen=True)
class DemoCase:
    """One demo batch. Token arrays hold the sequences back to back; counts are tokens unless
    named otherwise, pools are bytes."""

    keys: np.ndarray  # bf16 [num_tokens, num_kv_heads, head_dim]
    values: np.ndarray  # bf16, like keys
    q: np.ndarray  # bf16 [num_seqs * q_len, num_q_heads, head_dim]: each sequence's rows in turn
    seq_lens: np.ndarray  # int32 [num_seqs]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks_per_seq]: page ids, shuffled
    layout: CacheLayout  # exactly the pages the sequences need
    k_scale: float
    k_pool_init: np.ndarray  # uint8 [k_pool_bytes]: random poison both pools start from
    v_pool_init: np.ndarray  # uint8 [v_pool_bytes]
    v_encoder: str = "matched_norm"  # the write's V encoder (a lower-case VEncoder name)
    soft_cap: float = 0.0  # decode logit soft-capping, 0 = off
    sinks: np.ndarray | None = None  # float32 [num_q_heads] attention-sink logits, or None
    v_rotation: str = "none"  # written and decoded with this V rotation (a lower-case VRotation name)
    q_len: int = 1  # query tokens per sequence: its last q_len positions (multi-token decode)

    @property
    def starts(self) -> np.ndarray:
        """Index of each sequence's first token row."""
        return np.cumsum(self.seq_lens) - self.seq_lens

    @property
    def slot_mapping(self) -> np.ndarray:
        """int64 [num_tokens]: ``page · block_size + offset`` of every token row."""
        size = self.layout.block_size
        return np.concatenate([self.block_tables[s, t // size].astype(np.int64) * size + t % size
                               for s, t in enumerate(map(np.arange, self.seq_lens))])

    @property
    def cache_bytes(self) -> int:
        """Cache bytes of all token rows, K and V (one layer)."""
        return len(self.keys) * self.layout.bytes_per_token

    def shape(self, op: str) -> Shape:
        """The `Shape` of the write (all token rows) or of the decode (longest sequence,
        ``q_len`` query tokens per sequence)."""
        batch, context, q_len = ((len(self.keys), 0, 1) if op == "write"
                                 else (len(self.seq_lens), int(self.seq_lens.max()), self.q_len))
        return Shape(op, self.layout.v_bits, batch, context, self.layout.head_dim,
                     self.q.shape[1], self.layout.num_kv_heads, self.layout.block_size, q_len)

    def decode_scalars(self, sparse_v_threshold: float) -> dict[str, Any]:
        """The decode's scalar arguments (``inv_sqrt_d = head_dim ** -0.5``, dense q; the
        sinks and query_start are not scalars: see `run_kernels`)."""
        return {**launches.decode_scalars(self.shape("decode"), self.layout, self.k_scale,
                                          sparse_v_threshold), "soft_cap": self.soft_cap,
                "v_rotation": VRotation[self.v_rotation.upper()]}


def random_kv(rng: np.random.Generator, num_tokens: int, num_kv_heads: int,
              head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """N(0, 1) K and V ``[num_tokens, num_kv_heads, head_dim]``, ``OUTLIER_ROW_SHARE`` of the
    token rows scaled by ``OUTLIER_GAIN``."""
    kv = rng.standard_normal((2, num_tokens, num_kv_heads, head_dim), dtype=np.float32)
    kv[:, rng.random(num_tokens) < OUTLIER_ROW_SHARE] *= OUTLIER_GAIN
    return kv[0], kv[1]


def _finite_in_bf16(array: np.ndarray) -> bool:
    """Whether every value of ``array`` stays finite in bf16, the demo's input type (a value
    beyond its range rounds to inf there)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(array.astype(_bf16())).all())


def _read_npz(path: str) -> dict[str, np.ndarray]:
    """The `KV_FILE_ARRAYS` that the ``.npz`` archive ``path`` holds. Raises ValueError naming
    ``path`` where it is no such archive (truncated, a single ``.npy`` array, pickled objects),
    OSError where it cannot be read."""
    try:
        npz = np.load(path)
        if not isinstance(npz, np.lib.npyio.NpzFile):  # a .npy file
            raise ValueError("a single array, not an archive of named arrays")
        with npz:
            return {name: npz[name] for name in KV_FILE_ARRAYS if name in npz.files}
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable .npz archive ({first_line(exc)})") from None


def load_kv_file(path: str) -> dict[str, np.ndarray]:
    """The arrays of a ``--kv-file``: ``k`` and ``v`` (float, ``[num_tokens, num_kv_heads,
    head_dim]``, the sequences back to back), optionally ``seq_lens`` (int, tokens per sequence)
    and ``q`` (float, ``[num_seqs * q_len, num_q_heads, head_dim]``), every float finite in bf16.
    Raises ValueError or OSError."""
    arrays = _read_npz(path)
    missing = {"k", "v"} - set(arrays)
    if missing:
        raise ValueError(f"{path} has no {' or '.join(sorted(missing))} array "
                         "(k and v: [num_tokens, num_kv_heads, head_dim])")
    for name, array in arrays.items():
        kind, ndim = KV_FILE_ARRAYS[name]
        if not np.issubdtype(array.dtype, kind):
            raise ValueError(f"{path}: {name} holds {array.dtype}, not "
                             f"{'floats' if kind is np.floating else 'integers'}")
        if array.ndim != ndim or 0 in array.shape[1:]:
            raise ValueError(f"{path}: {name} {array.shape} must have {ndim} dimension(s), "
                             "all but the first of them non-empty")
        if kind is np.floating and not _finite_in_bf16(array):
            raise ValueError(f"{path}: {name} holds NaN, inf or values beyond bf16's range")
    if arrays["k"].shape != arrays["v"].shape:
        raise ValueError(f"{path}: k {arrays['k'].shape} and v {arrays['v'].shape} must both be "
                         "[num_tokens, num_kv_heads, head_dim]")
    return arrays


def make_case(keys: np.ndarray, values: np.ndarray, q: np.ndarray, seq_lens: Sequence[int],
              bits: int, block_size: int, rng: np.random.Generator, q_len: int = 1) -> DemoCase:
    """A `DemoCase`: bf16 inputs, each sequence on its own pages in a shuffled order, random
    poison in the pools, ``k_scale`` from `planning.calibrate_k_scale`; ``q`` holds ``q_len``
    query rows per sequence. Raises ValueError."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if lens.ndim != 1 or lens.size == 0 or lens.min() < 1 or lens.sum() != len(keys):
        raise ValueError(f"sequence lengths {lens.tolist()} must be >= 1 and add up to the "
                         f"{len(keys)} token rows of K and V")
    if lens.min() < q_len:
        raise ValueError(f"q_len {q_len} is more than the {lens.min()} tokens of the shortest "
                         "sequence")
    num_kv_heads, head_dim = keys.shape[1:]
    if q.shape[0] != lens.size * q_len or q.shape[2:] != (head_dim,) or q.shape[1] % num_kv_heads:
        raise ValueError(f"q {q.shape} must be [{lens.size * q_len} query rows ({q_len} per "
                         f"sequence), a multiple of {num_kv_heads} query heads, {head_dim}]")
    pages = -(-lens // block_size)
    layout = CacheLayout(int(pages.sum()), block_size, num_kv_heads, head_dim, bits)
    order = rng.permutation(layout.num_blocks).astype(np.int32)
    tables = np.zeros((lens.size, int(pages.max())), dtype=np.int32)
    for s, (first, count) in enumerate(zip(np.cumsum(pages) - pages, pages)):
        tables[s, :count] = order[first:first + count]
    bf16 = _bf16()
    keys = keys.astype(bf16)
    return DemoCase(keys, values.astype(bf16), q.astype(bf16), lens.astype(np.int32),
                    tables, layout, planning.calibrate_k_scale(keys),
                    rng.integers(0, 256, layout.k_pool_bytes, dtype=np.uint8),
                    rng.integers(0, 256, layout.v_pool_bytes, dtype=np.uint8), q_len=q_len)


def build_demo_case(args: argparse.Namespace) -> DemoCase:
    """The case of ``demo``'s options: random K/V, or ``--kv-file``'s arrays (whose shapes then
    replace ``--kv-heads``/``--head-dim``; its ``seq_lens`` replace ``--seq-lens``, whose default
    there is one sequence). Random q where none is given. Raises ValueError or OSError."""
    problem = (nonnegative_problem("--sparse-v-threshold", args.sparse_v_threshold, MAX_C_FLOAT)
               or nonnegative_problem("--soft-cap", args.soft_cap, MAX_C_FLOAT))
    if problem:
        raise ValueError(problem)
    rng = np.random.default_rng(args.seed)
    if args.kv_file:
        given = load_kv_file(args.kv_file)
        keys, values = given["k"], given["v"]
        seq_lens = given.get("seq_lens", args.seq_lens or (len(keys),))
    else:
        seq_lens = args.seq_lens or DEFAULT_SEQ_LENS
        keys, values = random_kv(rng, sum(seq_lens), args.kv_heads, args.head_dim)
        given = {}
    q = given.get("q")
    if q is None:
        q = rng.standard_normal((len(seq_lens) * args.q_len, args.q_heads, keys.shape[2]),
                                dtype=np.float32)
    case = make_case(keys, values, q, seq_lens, args.bits, args.block_size, rng, args.q_len)
    sinks = (2 * rng.standard_normal(case.q.shape[1])).astype(np.float32) if args.sinks else None
    if args.v_rotation != "none" and case.layout.head_dim not in ROTATION_HEAD_DIMS:
        raise ValueError(f"--v-rotation {args.v_rotation} needs a head_dim in {ROTATION_HEAD_DIMS}, not "
                         f"{case.layout.head_dim}")
    return dataclasses.replace(case, v_encoder=args.v_encoder, soft_cap=args.soft_cap, sinks=sinks,
                               v_rotation=args.v_rotation)


def reference_pools(case: DemoCase, show_progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """The K and V pools `reference.write_cache` leaves, starting from the poisoned ones."""
    from fp8kturbov import reference as ref

    layout, n = case.layout, case.layout.row_elems
    k_pool, v_pool = case.k_pool_init.copy(), case.v_pool_init.copy()
    slots, starts = case.slot_mapping, case.starts

    def label(s: int) -> str:
        return f"reference write, sequence {s} ({case.seq_lens[s]} tokens)"

    for s in progress(range(len(case.seq_lens)), label, show_progress):
        rows = slice(starts[s], starts[s] + case.seq_lens[s])
        ref.write_cache(case.keys[rows], case.values[rows], k_pool, v_pool, slots[rows],
                        int(case.seq_lens[s]), layout.num_kv_heads, layout.head_dim,
                        layout.block_size, n, n, case.k_scale, layout.k_block_stride_bytes,
                        layout.v_block_stride_bytes, layout.v_data_section_bytes, layout.v_bits,
                        encoder=case.v_encoder, rotation=case.v_rotation != "none")
    return k_pool, v_pool


def reference_decode(case: DemoCase, k_pool: np.ndarray, v_pool: np.ndarray,
                     sparse_v_threshold: float) -> np.ndarray:
    """`reference.paged_decode` of the pools, float64 ``[num_seqs * q_len, num_q_heads,
    head_dim]``."""
    from fp8kturbov import reference as ref

    scalars = case.decode_scalars(sparse_v_threshold)
    bits = scalars.pop("v_bits")
    del scalars["max_q_len"]  # the reference reads the query rows from query_start itself
    rotation = scalars.pop("v_rotation") != VRotation.NONE
    return ref.paged_decode(case.q, k_pool, v_pool, case.block_tables, case.seq_lens,
                            bits=bits, sliding_window=0, sinks=case.sinks,
                            query_start=case.shape("decode").query_start, rotation=rotation, **scalars)


def exact_attention(case: DemoCase) -> np.ndarray:
    """Attention over the unquantised bf16 K/V in float64, ``[num_seqs * q_len, num_q_heads,
    head_dim]``: what the decode would give without the cache's quantisation (with the case's
    soft cap and sinks; query token ``i`` of a sequence of ``L`` tokens attends its first
    ``L - q_len + i + 1``)."""
    num_kv_heads, head_dim = case.keys.shape[1:]
    group = case.q.shape[1] // num_kv_heads
    out = np.zeros(case.q.shape, dtype=np.float64)
    sinks = (np.full((num_kv_heads, group, 1), -np.inf) if case.sinks is None
             else case.sinks.astype(np.float64).reshape(num_kv_heads, group, 1))
    for row in range(len(case.q)):
        s, i = divmod(row, case.q_len)
        start = int(case.starts[s])
        end = start + int(case.seq_lens[s]) - case.q_len + i + 1
        k, v = (x[start:end].astype(np.float64) for x in (case.keys, case.values))
        q = case.q[row].astype(np.float64).reshape(num_kv_heads, group, head_dim)
        scores = np.einsum("hgd,lhd->hgl", q, k) * head_dim ** -0.5
        if case.soft_cap > 0:
            scores = case.soft_cap * np.tanh(scores / case.soft_cap)
        top = np.maximum(scores.max(axis=-1, keepdims=True), sinks)
        weights = np.exp(scores - top)
        denominator = weights.sum(axis=-1, keepdims=True) + np.exp(sinks - top)
        heads = np.einsum("hgl,lhd->hgd", weights, v) / denominator
        out[row] = heads.reshape(-1, head_dim)
    return out


def relative_error_per_head(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``‖got − want‖ / ‖want‖`` over the last axis (the absolute norm where ``want`` is 0)."""
    num, den = np.linalg.norm(got - want, axis=-1), np.linalg.norm(want, axis=-1)
    return np.where(den > 0, num / np.where(den > 0, den, 1), num)


def error_text(err: np.ndarray) -> str:
    """The largest and the median of the errors ``err``, as text."""
    return f"max {err.max():.2e}, median {np.median(err):.2e}"


@dataclass(frozen=True)
class GpuRun:
    """What the kernels produced for a `DemoCase`, and their times (µs, median of the runs)."""

    k_pool: np.ndarray
    v_pool: np.ndarray
    output: np.ndarray  # float64 [num_seqs * q_len, num_q_heads, head_dim]
    write_us: float
    decode_us: float


def _download(dev: Device, address: int, like: np.ndarray) -> np.ndarray:
    dev.synchronize()
    out = np.empty_like(like)
    driver_call(cu.cuMemcpyDtoH, out.ctypes.data, address, out.nbytes)
    return out


def run_kernels(dev: Device, case: DemoCase, sparse_v_threshold: float,
                iters: int) -> GpuRun:
    """Write the cache and decode with the library (the decode with its split workspace), read
    the pools and output back, then time ``iters`` CUDA-event-timed runs of each."""
    write = launches.WriteBuffers(
        key=dev.upload(case.keys.view(np.uint16)), value=dev.upload(case.values.view(np.uint16)),
        k_cache=dev.upload(case.k_pool_init), v_cache=dev.upload(case.v_pool_init),
        slot_mapping=dev.upload(case.slot_mapping))
    scalars = case.decode_scalars(sparse_v_threshold)
    workspace_bytes = paged_decode_workspace_bytes(**scalars)
    scalars.update(launches.query_start_arguments(dev, case.shape("decode")))
    poison = np.full(case.q.shape, 0x7FC1, dtype=np.uint16)  # a bf16 NaN: unwritten shows
    decode = launches.DecodeBuffers(
        q=dev.upload(case.q.view(np.uint16)), k_cache=write.k_cache, v_cache=write.v_cache,
        output=dev.upload(poison), block_tables=dev.upload(case.block_tables),
        seq_lens=dev.upload(case.seq_lens),
        workspace=dev.alloc(workspace_bytes) if workspace_bytes else 0,
        workspace_bytes=workspace_bytes)
    write_options = {"v_encoder": VEncoder[case.v_encoder.upper()], "v_rotation": scalars["v_rotation"]}
    if case.sinks is not None:
        scalars["sinks"] = dev.upload(case.sinks)
    launch_write = functools.partial(launches.launch_write, case.shape("write"), case.layout,
                                     case.k_scale, write, dev.stream, write_options)
    launch_decode = functools.partial(launches.launch_decode, scalars, decode, dev.stream)
    launch_write()
    k_pool, v_pool = (_download(dev, address, like) for address, like in
                      ((write.k_cache, case.k_pool_init), (write.v_cache, case.v_pool_init)))
    launch_decode()
    output = _download(dev, decode.output, poison).view(_bf16()).astype(np.float64)
    write_time = timing.time_launches(dev, [launch_write], iters, DEMO_WARMUP)
    decode_time = timing.time_launches(dev, [launch_decode], iters, DEMO_WARMUP)
    return GpuRun(k_pool, v_pool, output, write_time.median_us, decode_time.median_us)


def pool_check(got: np.ndarray, want: np.ndarray, what: str) -> tuple[str, bool]:
    """A line on whether the kernel's pool equals the reference's, byte for byte; and whether."""
    diff = np.flatnonzero(got != want)
    if diff.size == 0:
        return f"{what}: identical to the reference ({got.nbytes} bytes)", True
    return (f"{what}: {diff.size} of {got.nbytes} bytes differ from the reference, first at "
            f"{diff[:4].tolist()}"), False


def gpu_report(run: GpuRun, case: DemoCase, pools: tuple[np.ndarray, np.ndarray],
               want: np.ndarray, iters: int) -> tuple[list[str], bool]:
    """Lines comparing the kernels with the reference (whole pools byte for byte, the decode by
    relative error per head) and giving their speed; and whether every check passed."""
    checks = [pool_check(run.k_pool, pools[0], "write, K pool"),
              pool_check(run.v_pool, pools[1], "write, V pool")]
    err = relative_error_per_head(run.output, want)
    unwritten = int(np.isnan(run.output).sum())
    checks.append((f"decode vs the float64 reference decode: relative error per head "
                   f"{error_text(err)} (limit {DECODE_REL_TOL:g})"
                   + (f"; {unwritten} output elements unwritten" if unwritten else ""),
                   unwritten == 0 and bool(err.max() <= DECODE_REL_TOL)))
    speed = (f"kernel time, median of {iters} CUDA-event-timed runs: write {run.write_us:.1f} us "
             f"({len(case.keys)} tokens), decode {run.decode_us:.1f} us (reads "
             f"{case.cache_bytes / 1e6:.2f} MB of cache: "
             f"{gbps(case.cache_bytes, run.decode_us):.0f} GB/s)")
    return [line for line, _ in checks] + [speed], all(ok for _, ok in checks)


def describe_case(case: DemoCase, args: argparse.Namespace) -> str:
    """Two lines: the shape and where K/V come from; the K scale and the cache's size."""
    layout = case.layout
    source = (f"K/V from {args.kv_file}" if args.kv_file else
              f"random N(0,1) K/V with x{OUTLIER_GAIN:g} outlier rows, seed {args.seed}")
    bf16_bytes = len(case.keys) * planning.bytes_per_token(layout.num_kv_heads, layout.head_dim,
                                                           "bf16")
    return (f"demo: {len(case.seq_lens)} sequences of {', '.join(map(str, case.seq_lens))} tokens; "
            f"{f'{case.q_len} query tokens per sequence, ' if case.q_len > 1 else ''}"
            f"{case.q.shape[1]} query heads, {layout.num_kv_heads} KV heads, head_dim "
            f"{layout.head_dim}, {layout.block_size}-token pages, fp8k_turbo{layout.v_bits}v"
            f"{f' with V rotation {case.v_rotation}' if case.v_rotation != 'none' else ''}; "
            f"{source}\n"
            f"k_scale {case.k_scale:.4g} (max |K| / 448); cache {len(case.keys)} tokens x "
            f"{layout.bytes_per_token} B = {case.cache_bytes / 1e6:.2f} MB per layer "
            f"(bf16: {bf16_bytes / 1e6:.2f} MB)")


def open_device() -> tuple[Device | None, str]:
    """GPU 0, or None and why not."""
    try:
        return Device(), ""
    except BenchError as exc:
        return None, first_line(exc)
