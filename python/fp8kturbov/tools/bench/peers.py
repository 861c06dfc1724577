"""The decode peers (decode only, one query token per sequence): torch SDPA over a BF16 cache and
over an FP8 cache cast to BF16, and flashinfer's paged FP8 decode, each timed like the library's
launches; a peer that cannot run here has a status instead (`run_peer`)."""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

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
