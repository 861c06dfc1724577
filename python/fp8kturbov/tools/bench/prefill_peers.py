"""The prefill peers: flashinfer's BF16 paged prefill (``BatchPrefillWithPagedKVCacheWrapper``,
causal) over a BF16 paged cache of the case's tokens, alone (``bf16_fa2``, ``bf16_fa3``) and after
the library's dequantize of the context into that cache, the two in one graph
(``dequant_bf16_fa2``, ``dequant_bf16_fa3``: the round trip an engine makes where it cannot
attend the compressed cache), each with flashinfer's FA2 and (on compute capability 9.x) FA3
backend; a prefill row is compared with the faster of each pair (`BF16_PREFILL_PEERS`,
`ROUND_TRIP_PEERS`). Timed like the decode peers (`peers.measure_peer`); each output is checked
once per shape against float64 causal attention over the values its cache holds
(`check_prefill_output`), so that a misconfigured peer cannot flatter the library."""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from fp8kturbov import dequantize
from fp8kturbov._device import Device

from .config import BF16_BYTES, Config, Shape, peer_bytes, written_bytes
from .launches import Chunk, case_layout, page_strides, replicate
from .nvml import NvmlCounters
from .peers import (PeerUnavailable, _check_peer_memory, _optional, _random_pages, _time_torch, attention_error,
                    judged, measure_peer, sequence_kv)
from .power import PowerProbe
from .timing import Timing

#: flashinfer's float workspace per wrapper (its split-KV partial outputs).
WORKSPACE_BYTES = 1 << 30  # fa2 asks 512 MiB for 8192-token chunks
#: flashinfer's FA3 backend runs on Hopper (compute capability 9.x) only.
FA3_MAJOR = 9


def _modules(backend: str) -> tuple[Any, Any]:
    """torch and flashinfer ("absent" where either is not importable); "skipped" for FA3 off
    Hopper."""
    torch, flashinfer = _optional("torch"), _optional("flashinfer")
    if backend == "fa3" and torch.cuda.get_device_capability()[0] != FA3_MAJOR:
        raise PeerUnavailable(f"skipped: flashinfer's fa3 needs compute capability {FA3_MAJOR}.x")
    return torch, flashinfer


def planned_prefill(torch: Any, flashinfer: Any, shape: Shape, backend: str, tables: Any) -> Any:
    """flashinfer's paged prefill wrapper (CUDA-graph mode, NHD pages of ``block_size`` tokens, a
    zeroed workspace) planned for ``shape``: causal, softmax scale ``head_dim ** -0.5``, bf16 q,
    K/V and output, sequence ``s``'s chunk rows ``query_start[s]..`` and its pages ``tables[s]``
    (equal lengths: each row of the table is the sequence's pages)."""
    int32 = {"dtype": torch.int32, "device": "cuda"}
    qo_indptr = torch.tensor(shape.query_start, **int32)
    kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(shape.seq_blocks)]), **int32)
    indices = tables.reshape(-1)
    last_len = torch.tensor(shape.seq_lens - (shape.seq_blocks - 1) * shape.block_size, **int32)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"), "NHD", use_cuda_graph=True,
        qo_indptr_buf=torch.empty_like(qo_indptr), paged_kv_indptr_buf=torch.empty_like(kv_indptr),
        paged_kv_indices_buf=torch.empty_like(indices), paged_kv_last_page_len_buf=torch.empty_like(last_len),
        backend=backend)
    wrapper.plan(qo_indptr, kv_indptr, indices, last_len, shape.num_q_heads, shape.num_kv_heads,
                 shape.head_dim, shape.block_size, causal=True, sm_scale=shape.head_dim ** -0.5,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return wrapper


def check_prefill_output(torch: Any, out: Any, q: Any, k_pages: Any, v_pages: Any, tables: Any,
                         shape: Shape) -> float:
    """The largest relative error per head of a prefill's output ``out`` ``[query_rows, q_heads,
    head_dim]`` (of q, the same shape) against float64 causal attention over the pages
    (``[pages, block_size, kv_heads, head_dim]``, NHD; sequence ``s``'s page ids ``tables[s]``),
    for the first and the last token of the chunk of the first and the last sequence (the first
    token attends ``seq_len - q_len + 1`` positions, the last all); raises `PeerUnavailable`
    ("error: ...") above `peers.PEER_OUTPUT_TOLERANCE`."""
    worst = 0.0
    for s in sorted({0, shape.batch - 1}):
        length = int(shape.seq_lens[s])
        k, v = sequence_kv(torch, k_pages, v_pages, tables[s], length)
        for i in sorted({0, shape.q_len - 1}):
            row, visible = int(shape.query_start[s]) + i, length - shape.q_len + i + 1
            worst = max(worst, attention_error(torch, out[row], q[row], k[:visible], v[:visible],
                                               shape.head_dim ** -0.5))
    return judged(worst)


def _prefill_run(torch: Any, flashinfer: Any, shape: Shape, backend: str, k: Any, v: Any,
                 checked: list[float], before: Callable[[], None] | None = None) -> Callable[[], None]:
    """One input set's launches: ``before()`` (where given), then flashinfer's prefill over the
    pages ``k`` and ``v``, handed out to the sequences in random order, of random bf16 q; its
    output checked (`check_prefill_output`) where ``checked`` is still empty."""
    tables = torch.randperm(shape.num_blocks, dtype=torch.int32, device="cuda").reshape(shape.batch, -1)
    q = torch.randn(shape.query_rows, shape.num_q_heads, shape.head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    wrapper = planned_prefill(torch, flashinfer, shape, backend, tables)

    def run() -> None:
        if before is not None:
            before()
        wrapper.run(q, (k, v), out=out)

    if not checked:
        run()
        checked.append(check_prefill_output(torch, out, q, k, v, tables, shape))
    return run


def _set_bytes(shape: Shape) -> int:
    """Device memory of one input set of a BF16 prefill peer: K and V pages, q and the output,
    flashinfer's workspace."""
    pages = 2 * shape.num_blocks * shape.block_size * shape.row_elems * BF16_BYTES
    return pages + 2 * shape.q_elems * BF16_BYTES + WORKSPACE_BYTES


def _bf16_prefill(backend: str) -> Callable[..., tuple[int, Timing]]:
    def peer(dev: Device, shape: Shape, config: Config, chunk: Chunk,
             power: PowerProbe | None = None) -> tuple[int, Timing]:
        """flashinfer's causal paged prefill (the ``backend`` named by the peer) over BF16 pages of
        standard normal K and V (NHD, ``block_size`` tokens, handed out in random order), bf16 q
        and output; ``chunk`` is not read. Returns (bytes, timing)."""
        torch, flashinfer = _modules(backend)
        _check_peer_memory(dev, config.sets * _set_bytes(shape))
        checked: list[float] = []

        def make_fn() -> Callable[[], None]:
            k, v = (_random_pages(torch, shape, torch.bfloat16) for _ in range(2))
            return _prefill_run(torch, flashinfer, shape, backend, k, v, checked)

        return peer_bytes(shape, BF16_BYTES), _time_torch(dev, torch, make_fn, config, power)

    return peer


def _round_trip(backend: str) -> Callable[..., tuple[int, Timing]]:
    def peer(dev: Device, shape: Shape, config: Config, chunk: Chunk,
             power: PowerProbe | None = None) -> tuple[int, Timing]:
        """The library's ``dequantize`` of every slot of the context's pages (pools filled with
        ``chunk``, as the library's own row reads them) into BF16 pages of the same ids, then
        flashinfer's causal paged prefill (the peer's ``backend``) over them, in one graph.
        Returns (bytes: the dequantize's, as a write of those tokens in reverse, and the BF16
        prefill's; timing)."""
        torch, flashinfer = _modules(backend)
        layout = case_layout(shape)
        slots = layout.num_slots
        pools_bytes = layout.k_pool_bytes + layout.v_pool_bytes + 8 * slots  # and the slot mapping
        _check_peer_memory(dev, config.sets * (_set_bytes(shape) + pools_bytes))
        checked: list[float] = []

        def make_fn() -> Callable[[], None]:
            pools = [torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                     for nbytes in (layout.k_pool_bytes, layout.v_pool_bytes)]
            for pool, pattern in zip(pools, (chunk.k_pages, chunk.v_pages)):
                replicate(dev, pool.data_ptr(), pool.numel(), pattern)
            slot_mapping = torch.arange(slots, dtype=torch.int64, device="cuda")  # slot t to row t: same pages
            page_shape = (shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
            k, v = (torch.empty(page_shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))

            def dequantize_context() -> None:  # on the stream being captured, where it is
                dequantize(pools[0].data_ptr(), pools[1].data_ptr(), slot_mapping.data_ptr(), k.data_ptr(),
                           v.data_ptr(), num_tokens=slots, num_kv_heads=shape.num_kv_heads,
                           head_dim=shape.head_dim, block_size=shape.block_size, key_stride=shape.row_elems,
                           value_stride=shape.row_elems, k_scale=chunk.k_scale, v_bits=shape.bits,
                           stream=torch.cuda.current_stream().cuda_stream, **page_strides(layout))

            return _prefill_run(torch, flashinfer, shape, backend, k, v, checked, before=dequantize_context)

        nbytes = written_bytes(shape, slots) + peer_bytes(shape, BF16_BYTES)
        return nbytes, _time_torch(dev, torch, make_fn, config, power)

    return peer


#: Each peer times a prefill case, given the case's encoded chunk (and with a `PowerProbe`
#: measures its power): (bytes, timing).
PEERS: dict[str, Callable[..., tuple[int, Timing]]] = {
    "bf16_fa2": _bf16_prefill("fa2"),
    "bf16_fa3": _bf16_prefill("fa3"),
    "dequant_bf16_fa2": _round_trip("fa2"),
    "dequant_bf16_fa3": _round_trip("fa3"),
}
#: The BF16 prefill alone (a row's "vs bf16 alone" is the faster one's time over the row's).
BF16_PREFILL_PEERS = ("bf16_fa2", "bf16_fa3")
#: The round trip, dequantize then the BF16 prefill (the row's "vs round trip"); they depend on
#: the V bits (the dequantize reads the row's cache), the others do not.
ROUND_TRIP_PEERS = ("dequant_bf16_fa2", "dequant_bf16_fa3")


def run_peer(name: str, dev: Device, shape: Shape, config: Config, chunk: Chunk, ceiling_gbps: float,
             counters: NvmlCounters | None = None, power: PowerProbe | None = None) -> dict[str, Any]:
    """One prefill peer's numbers for ``shape`` (`peers.measure_peer` of ``PEERS[name]``)."""
    return measure_peer(functools.partial(PEERS[name], dev, shape, config, chunk), ceiling_gbps, counters, power)
