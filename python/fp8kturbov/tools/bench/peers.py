"""The decode peers (decode only, one query token per sequence): torch SDPA over a BF16 cache and
over an FP8 cache cast to BF16, flashinfer's paged FP8 decode (FA2 on tensor cores), and XQA (the
FP8 and BF16 paged decode that engines run on Hopper, flashinfer's
``trtllm_batch_decode_with_kv_cache(backend="xqa")``), each timed like the library's launches; a
peer that cannot run here has a status instead (`run_peer`). The paged peers' outputs are checked
once per shape against float64 attention over the same cache values (`check_paged_output`), so
that a misconfigured peer cannot flatter the library."""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable, Sequence

import numpy as np

from fp8kturbov._device import BenchError, Device, first_line

from ..console import GiB
from .config import BF16_BYTES, Config, Shape, fits_in_memory, peer_bytes
from .nvml import NvmlCounters
from .power import PowerProbe, clock_limits_held
from .rows import measured
from .timing import Timing, time_launches


class PeerUnavailable(Exception):
    """A peer that cannot run here; the message is its status ("absent", "skipped: ...")."""


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
    setting of the FP8 reference numbers in docs/PERFORMANCE.md); its output checked once
    (`check_paged_output`). Returns (bytes, timing)."""
    torch = _optional("torch")
    flashinfer = _optional("flashinfer")
    workspace_bytes = 128 << 20  # flashinfer's documented default for decode
    nbytes = peer_bytes(shape, 1)
    _check_peer_memory(dev, config.sets * (nbytes + workspace_bytes))
    pages, seq_pages = shape.num_blocks, shape.seq_blocks  # its planner reads the lengths on the host
    last_page_len = shape.seq_lens - (seq_pages - 1) * shape.block_size
    checked = []  # its output is checked once (check_paged_output)

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
        k, v = (_random_pages(torch, shape, torch.float8_e4m3fn) for _ in range(2))
        q = torch.randn(shape.batch, shape.num_q_heads, shape.head_dim, dtype=torch.bfloat16,
                        device="cuda")
        run = functools.partial(wrapper.run, q, (k, v))
        if not checked:
            checked.append(check_paged_output(torch, run(), q, k, v, lambda s: indices[indptr[s]:indptr[s + 1]],
                                              shape.seq_lens, shape.head_dim ** -0.5))
        return run

    return nbytes, _time_torch(dev, torch, make_fn, config, power)


#: A paged peer's largest relative error per (sequence, head) against float64 attention over the
#: values its cache holds: the FP8 peers compute in lower precision (XQA's FP8 path was measured at
#: about 4e-2), a wrong layout, scale or length gives errors near 1.
PEER_OUTPUT_TOLERANCE = 0.1
#: Sequences of a batch whose outputs `check_paged_output` recomputes (the first and the last).
CHECKED_SEQUENCES = 2


def _random_pages(torch: Any, shape: Shape, dtype: Any) -> Any:
    """K or V pages ``[pages, block_size, kv_heads, head_dim]`` (NHD) of ``dtype`` (bf16 or FP8
    E4M3): standard normal values, so that the scores are of the size a model's are and a peer's
    output can be checked against exact attention (values of hundreds would make every softmax
    one-hot, and any rounding could pick another row)."""
    page_shape = (shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    pages = torch.empty(page_shape, dtype=dtype, device="cuda")
    for chunk in pages.split(max(1, (1 << 28) // pages[0].numel())):  # float32 scratch of 1 GiB at most
        chunk.copy_(torch.randn(chunk.shape, device="cuda"))
    return pages


def _gathered(torch: Any, pages: Any, rows: Any) -> Any:
    """``pages[rows]`` as float64 (FP8 pages gathered as bytes: indexing is not defined on them)."""
    if pages.element_size() == 1:
        return pages.view(torch.uint8)[rows].view(pages.dtype).float().double()
    return pages[rows].double()


def sequence_kv(torch: Any, k_pages: Any, v_pages: Any, pages: Any, length: int) -> tuple[Any, Any]:
    """A sequence's K and V ``[length, kv_heads, head_dim]`` as float64, from the pages
    (``[pages, block_size, kv_heads, head_dim]``, NHD) whose ids ``pages`` holds in order."""
    rows = pages[:-(-length // k_pages.shape[1])].long()
    return tuple(_gathered(torch, pool, rows).reshape(-1, *pool.shape[2:])[:length] for pool in (k_pages, v_pages))


def attention_error(torch: Any, got: Any, q: Any, k: Any, v: Any, sm_scale: float) -> float:
    """The largest relative error per head of one query row's output ``got`` ``[q_heads,
    head_dim]`` against float64 attention of ``q`` (the same shape) over ``k`` and ``v``
    (float64 ``[positions, kv_heads, head_dim]``, GQA: consecutive query heads share a KV head)."""
    kv_heads, head_dim = k.shape[1:]
    qs = q.double().reshape(kv_heads, -1, head_dim)
    scores = torch.einsum("hgd,lhd->hgl", qs, k) * sm_scale
    want = torch.einsum("hgl,lhd->hgd", torch.softmax(scores, dim=-1), v).reshape(-1, head_dim)
    got = got.double()
    return float((torch.linalg.vector_norm(got - want, dim=-1) / torch.linalg.vector_norm(want, dim=-1)).max())


def judged(worst: float) -> float:
    """``worst``, a peer's largest relative error (`attention_error`); raises `PeerUnavailable`
    ("error: ...") above `PEER_OUTPUT_TOLERANCE` (and for NaN)."""
    if not worst <= PEER_OUTPUT_TOLERANCE:
        raise PeerUnavailable(f"error: output differs from float64 attention over its cache "
                              f"(relative error {worst:.3g} > {PEER_OUTPUT_TOLERANCE})")
    return worst


def check_paged_output(torch: Any, out: Any, q: Any, k_pages: Any, v_pages: Any,
                       seq_pages: Callable[[int], Any], seq_lens: np.ndarray, sm_scale: float) -> float:
    """The largest relative error per head of a paged decode's output ``out`` ``[batch, q_heads,
    head_dim]`` against float64 attention over the pages (``[pages, block_size, kv_heads,
    head_dim]``, NHD; ``seq_pages(s)``: sequence s's page ids in order), for the first and last
    sequence; raises `PeerUnavailable` ("error: ...") above `PEER_OUTPUT_TOLERANCE`."""
    worst = 0.0
    for s in sorted({0, out.shape[0] - 1})[:CHECKED_SEQUENCES]:
        k, v = sequence_kv(torch, k_pages, v_pages, seq_pages(s), int(seq_lens[s]))
        worst = max(worst, attention_error(torch, out[s], q[s], k, v, sm_scale))
    return judged(worst)


def _paged_inputs(torch: Any, shape: Shape, kv_dtype: Any) -> tuple[Any, Any, Any, Any]:
    """A paged peer's inputs: bf16 q ``[batch, q_heads, head_dim]``, K and V pages
    (`_random_pages`) and the block tables ``[batch, pages per sequence]``, the pages handed out in
    random order."""
    k, v = (_random_pages(torch, shape, kv_dtype) for _ in range(2))
    q = torch.randn(shape.batch, shape.num_q_heads, shape.head_dim, dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(shape.num_blocks, dtype=torch.int32, device="cuda").reshape(shape.batch, -1)
    return q, k, v, tables


def _xqa(kv_element_bytes: int):
    def peer(dev: Device, shape: Shape, config: Config,
             power: PowerProbe | None = None) -> tuple[int, Timing]:
        """XQA (flashinfer's ``trtllm_batch_decode_with_kv_cache``, ``backend="xqa"``) over NHD
        pages of ``block_size`` tokens, FP8 E4M3 or BF16 K/V, bf16 q and output, the lengths on
        the device (no host plan): ``bmm1_scale`` = k_scale · softmax scale, ``bmm2_scale`` =
        v_scale (both scales 1 here), a zero-initialised workspace per input set. Its output is
        checked once (`check_paged_output`). Returns (bytes, timing)."""
        torch = _optional("torch")
        decode = getattr(_optional("flashinfer.decode"), "trtllm_batch_decode_with_kv_cache", None)
        if decode is None:
            raise PeerUnavailable("absent")
        workspace_bytes = 128 << 20
        nbytes = peer_bytes(shape, kv_element_bytes)
        _check_peer_memory(dev, config.sets * (nbytes + workspace_bytes))
        kv_dtype = torch.float8_e4m3fn if kv_element_bytes == 1 else torch.bfloat16
        sm_scale = shape.head_dim ** -0.5
        seq_lens = shape.seq_lens
        checked = []  # the output is checked once

        def make_fn() -> Callable[[], Any]:
            q, k, v, tables = _paged_inputs(torch, shape, kv_dtype)
            lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
            workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device="cuda")
            out = torch.empty_like(q)
            run = functools.partial(decode, q, (k, v), workspace, tables, lens, int(seq_lens.max()),
                                    bmm1_scale=sm_scale, bmm2_scale=1.0, out=out, kv_layout="NHD",
                                    backend="xqa")
            if not checked:
                run()
                checked.append(check_paged_output(torch, out, q, k, v, tables.__getitem__, seq_lens, sm_scale))
            return run

        return nbytes, _time_torch(dev, torch, make_fn, config, power)

    return peer


peer_fp8_xqa = _xqa(1)
peer_bf16_xqa = _xqa(BF16_BYTES)


#: The peers over an FP8 cache: the "vs best FP8" column compares each row with the fastest of them.
FP8_PEERS = ("fp8_sdpa", "fp8_flashinfer", "fp8_xqa")


def fastest_peer(results: dict[str, dict[str, Any]], names: Sequence[str]) -> tuple[str, float] | None:
    """The fastest of the peers ``names`` that ran among ``results`` (`run_peer`'s, by name) and
    its median µs, or None where none ran."""
    ran = [(results[name]["median_us"], name) for name in names
           if results.get(name, {}).get("status") == "ok"]
    if not ran:
        return None
    median_us, name = min(ran)
    return name, median_us


def best_fp8_peer(results: dict[str, dict[str, Any]]) -> tuple[str, float] | None:
    """The fastest FP8 peer that ran among ``results`` (`fastest_peer` of `FP8_PEERS`)."""
    return fastest_peer(results, FP8_PEERS)


#: Each peer times its decode of a shape (and with a `PowerProbe` measures its power): (bytes, timing).
PEERS: dict[str, Callable[[Device, Shape, Config, PowerProbe | None], tuple[int, Timing]]] = {
    "bf16_sdpa": peer_bf16_sdpa,
    "fp8_sdpa": peer_fp8_sdpa,
    "fp8_flashinfer": peer_fp8_flashinfer,
    "fp8_xqa": peer_fp8_xqa,
    "bf16_xqa": peer_bf16_xqa,
}


def run_peer(name: str, dev: Device, shape: Shape, config: Config, ceiling_gbps: float,
             counters: NvmlCounters | None = None, power: PowerProbe | None = None) -> dict[str, Any]:
    """One decode peer's numbers for ``shape`` (`measure_peer` of ``PEERS[name]``)."""
    return measure_peer(functools.partial(PEERS[name], dev, shape, config), ceiling_gbps, counters, power)


def measure_peer(peer: Callable[[PowerProbe | None], tuple[int, Timing]], ceiling_gbps: float,
                 counters: NvmlCounters | None = None, power: PowerProbe | None = None) -> dict[str, Any]:
    """A peer's numbers (see `measured`, and ``clock_limited`` as a row's) with ``status`` "ok",
    ``peer(power)`` giving its bytes and timing; else only a status: "absent", "skipped: <why>"
    or "error: <first line of the error>"."""
    try:
        with clock_limits_held(counters) as held:
            nbytes, timing = peer(power)
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
