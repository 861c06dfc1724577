"""GPU tests of the decode's fused append (``paged_decode(..., append_key=, append_value=,
append_slot_mapping=)``): one launch must leave the cache and the output exactly as ``write_kv``
followed by ``paged_decode`` leave them.

Each case fills two caches with the same context (every position of every sequence written by
``write_kv`` with random rows), then gives each query row a new token: cache A takes it through
``write_kv`` and decodes, cache B through the fused append. The pools are compared byte for byte
(whole pools: bytes outside the new tokens' slots must not move either), the outputs bit for bit
(the same kernel reads the same bytes), and the output against the float64 reference over B's
pools, so that a decode which read its tokens before writing them, or not at all, shows.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from conftest import case_id, relative_error_per_head, shuffled_block_tables
from fp8kturbov import CacheLayout, KVCache
from fp8kturbov import reference as ref

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

BF16 = ml_dtypes.bfloat16
K_SCALE = 0.06
BOUND = 1e-2  # relative error per head against the float64 reference (docs/api.md)


@dataclasses.dataclass(frozen=True)
class Case:
    bits: int = 3
    head_dim: int = 128
    num_kv_heads: int = 2
    group: int = 4                 # query heads per KV head
    block_size: int = 16
    seq_lens: tuple = (1, 17, 250, 64)
    q_lens: tuple | None = None    # multi-token decode: new tokens per sequence
    window: int = 0
    encoder: str = "matched_norm"
    rotation: bool = False
    workspace: bool = True         # context splits and head groups where the plan takes them
    padding: bool = False          # some rows with slot -1: nothing written, the old token read
    checked: bool = False          # one row's slot past the pools: skipped and reported

    def __str__(self) -> str:
        return case_id(self)


# A batch whose grid runs in several waves on any GPU (160 sequences x 8 KV heads, more CTAs than
# 9 per multiprocessor of 132): CTAs of later waves write their tokens while earlier ones decode.
MANY_SEQ_LENS = tuple(7 * i % 97 + 16 for i in range(160))
MANY = dict(num_kv_heads=8, seq_lens=MANY_SEQ_LENS)

CASES = [
    *(Case(bits=b, head_dim=d) for b in (2, 3, 4) for d in (64, 128, 256)),
    *(Case(bits=b, head_dim=d, **MANY) for b, d in ((2, 64), (3, 128), (4, 256))),
    Case(encoder="mse", padding=True, checked=True, **MANY),
    Case(q_lens=tuple(i % 5 for i in range(160)), window=40, **MANY),
    Case(q_lens=tuple(i % 3 + 1 for i in range(160)), rotation=True, padding=True, **MANY),
    Case(workspace=False),
    Case(encoder="mse"),
    Case(encoder="mse", bits=2, head_dim=256),
    Case(encoder="projection"),
    Case(encoder="projection", bits=2, head_dim=256),
    Case(encoder="projection", bits=4, head_dim=64, padding=True, checked=True, **MANY),
    Case(group=8), Case(group=16, num_kv_heads=1),  # several CTAs per KV head write the same token
    Case(num_kv_heads=8, group=1, seq_lens=(3000, 1200)),  # long splits, head groups
    Case(block_size=24), Case(block_size=8, window=40),
    Case(padding=True),
    Case(checked=True),
    Case(q_lens=(1, 5, 16, 2)),
    Case(q_lens=(0, 16, 7, 3), window=40),
    Case(q_lens=(1, 4, 16, 9), group=8, bits=2),
    Case(q_lens=(1, 3, 16, 2), rotation=True),
    Case(q_lens=(1, 3, 16, 2), rotation=True, encoder="mse", head_dim=256, bits=4),
    Case(q_lens=(1, 3, 16, 2), rotation=True, encoder="projection", bits=2),
    Case(rotation=True, bits=2, padding=True),
    Case(q_lens=(1, 9, 16, 2), padding=True, checked=True, block_size=24),
]


def bf16_rows(rng, num_rows: int, row_elems: int) -> np.ndarray:
    return rng.standard_normal((num_rows, row_elems)).astype(np.float32).astype(BF16)


def to_device(host: np.ndarray):
    if host.dtype == BF16:
        return torch.from_numpy(host.view(np.int16).copy()).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(host)).cuda()


def to_host(array) -> np.ndarray:
    if array.dtype == torch.bfloat16:
        return array.view(torch.int16).cpu().numpy().view(BF16)
    return array.cpu().numpy()


def slots_of(tables: np.ndarray, positions: list[tuple[int, int]], block_size: int) -> np.ndarray:
    """The slot of each (sequence, position) through its block table."""
    return np.array([int(tables[s, p // block_size]) * block_size + p % block_size for s, p in positions],
                    dtype=np.int64)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_append_equals_write_then_decode(rng, case):
    heads, dim, bs = case.num_kv_heads, case.head_dim, case.block_size
    num_q_heads, n = heads * case.group, heads * case.head_dim
    seq_lens = np.array(case.seq_lens, dtype=np.int32)
    pages = [(int(s) + bs - 1) // bs for s in seq_lens]
    max_blocks = max(pages)
    layout = CacheLayout(num_blocks=sum(pages) + 3, block_size=bs, num_kv_heads=heads, head_dim=dim,
                         v_bits=case.bits)
    tables = shuffled_block_tables(rng, pages, layout.num_blocks, max_blocks)
    q_lens = case.q_lens or (1,) * len(seq_lens)
    # Query row r: token i of sequence s, at position seq_len - q_len + i.
    positions = [(s, int(seq_lens[s]) - q + i) for s, q in enumerate(q_lens) for i in range(q)]
    rows = len(positions)
    new_slots = slots_of(tables, positions, bs)
    if case.padding:
        new_slots[rng.random(rows) < 0.3] = -1
    if case.checked:
        new_slots[rng.integers(rows)] = layout.num_blocks * bs + 5  # a page past the pools
    context = [(s, p) for s, length in enumerate(seq_lens) for p in range(length)]
    context_key, context_value = bf16_rows(rng, len(context), n), bf16_rows(rng, len(context), n)
    new_key, new_value = bf16_rows(rng, rows, n), bf16_rows(rng, rows, n)
    q = bf16_rows(rng, rows, num_q_heads * dim).reshape(rows, num_q_heads, dim)

    rotation = "hadamard" if case.rotation else "none"
    dev = {name: to_device(a) for name, a in dict(
        context_key=context_key, context_value=context_value, context_slots=slots_of(tables, context, bs),
        new_key=new_key, new_value=new_value, new_slots=new_slots, q=q, tables=tables,
        seq_lens=seq_lens).items()}
    options = dict(sliding_window=case.window, sparse_v_threshold=0.0)  # exact, as the reference
    if case.q_lens is not None:
        query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        options.update(query_start=to_device(query_start), max_q_len=max(q_lens))
    poison = rng.integers(0, 256, size=layout.k_pool_bytes + layout.v_pool_bytes, dtype=np.uint8)  # both caches'
    outputs, pools = [], []
    for fused in (False, True):
        with KVCache.allocate(layout, K_SCALE, checked=case.checked, v_rotation=rotation) as cache:
            cache.k_pool.copy_(torch.from_numpy(poison[:layout.k_pool_bytes]))
            cache.v_pool.copy_(torch.from_numpy(poison[layout.k_pool_bytes:]))
            fp8kturbov.write_kv(dev["context_key"], dev["context_value"], cache, dev["context_slots"])
            workspace = (cache.decode_workspace(len(seq_lens), num_q_heads, max_blocks, case.window,
                                                max(q_lens)) if case.workspace else None)
            append = dict(append_key=dev["new_key"], append_value=dev["new_value"],
                          append_slot_mapping=dev["new_slots"], v_encoder=case.encoder)
            if not fused:
                fp8kturbov.write_kv(dev["new_key"], dev["new_value"], cache, dev["new_slots"],
                                    v_encoder=case.encoder)
                if case.checked:
                    with pytest.raises(fp8kturbov.CacheIndexError):
                        cache.check_errors()
            out = fp8kturbov.paged_decode(dev["q"], cache, dev["tables"], dev["seq_lens"], workspace=workspace,
                                          **options, **(append if fused else {}))
            torch.cuda.synchronize()
            if case.checked and fused:
                with pytest.raises(fp8kturbov.CacheIndexError, match="SLOT"):
                    cache.check_errors()
            elif case.checked:
                cache.check_errors()  # nothing else out of range
            outputs.append(to_host(out))
            pools.append((to_host(cache.k_pool), to_host(cache.v_pool)))
    for what, a, b in (("K pool", pools[0][0], pools[1][0]), ("V pool", pools[0][1], pools[1][1])):
        differ = np.flatnonzero(a != b)
        assert differ.size == 0, f"{what}: {differ.size} bytes differ from write_kv's, first at {differ[:8]}"
    differ = np.flatnonzero(outputs[0].view(np.uint16) != outputs[1].view(np.uint16))
    assert differ.size == 0, f"output: {differ.size} elements differ from write_kv + decode's"

    want = ref.paged_decode(
        q, pools[1][0], pools[1][1], tables, seq_lens, max_blocks, len(seq_lens), num_q_heads, heads, dim, bs,
        dim ** -0.5, K_SCALE, num_q_heads * dim, layout.v_block_stride_bytes, layout.v_data_section_bytes,
        case.window, case.bits,
        query_start=None if case.q_lens is None else np.concatenate([[0], np.cumsum(q_lens)]),
        rotation=case.rotation)
    error = relative_error_per_head(outputs[1].astype(np.float64), want)
    assert error.max() < BOUND, f"output vs reference: {error.max():.3g}"


@pytest.mark.parametrize("waves", ["one wave", "several waves"])
def test_fused_append_in_a_graph(rng, waves):
    """Captured once, replayed with new rows: each replay writes and attends the rows it finds (also
    on a grid of several waves)."""
    if waves == "one wave":
        kv_heads, seq_lens, q_lens = 2, (5, 40, 200, 17), (1, 3, 16, 2)
    else:
        kv_heads, seq_lens, q_lens = 8, MANY_SEQ_LENS, tuple(i % 3 + 1 for i in range(160))
    seq_lens = np.array(seq_lens, dtype=np.int32)
    pages = [(int(s) + 15) // 16 for s in seq_lens]
    layout = CacheLayout(num_blocks=sum(pages) + 3, block_size=16, num_kv_heads=kv_heads, head_dim=128, v_bits=3)
    tables = shuffled_block_tables(rng, pages, layout.num_blocks, max(pages))
    positions = [(s, int(seq_lens[s]) - q + i) for s, q in enumerate(q_lens) for i in range(q)]
    rows, n = len(positions), layout.row_elems
    query_start = to_device(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    slots = to_device(slots_of(tables, positions, 16))
    key, value = to_device(bf16_rows(rng, rows, n)), to_device(bf16_rows(rng, rows, n))
    q = to_device(bf16_rows(rng, rows, 4 * kv_heads * 128).reshape(rows, 4 * kv_heads, 128))
    dev_tables, dev_lens = to_device(tables), to_device(seq_lens)
    with KVCache.allocate(layout, K_SCALE) as fused, KVCache.allocate(layout, K_SCALE) as plain:
        for cache in (fused, plain):
            cache.k_pool.zero_()
            cache.v_pool.zero_()
        out = torch.empty_like(q)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            fp8kturbov.paged_decode(q, fused, dev_tables, dev_lens, out=out, query_start=query_start,
                                    max_q_len=16, append_key=key, append_value=value, append_slot_mapping=slots)
        for _ in range(2):
            key.copy_(to_device(bf16_rows(rng, rows, n)))
            value.copy_(to_device(bf16_rows(rng, rows, n)))
            graph.replay()
            fp8kturbov.write_kv(key, value, plain, slots)
            want = fp8kturbov.paged_decode(q, plain, dev_tables, dev_lens, query_start=query_start, max_q_len=16)
            torch.cuda.synchronize()
            assert torch.equal(fused.k_pool, plain.k_pool) and torch.equal(fused.v_pool, plain.v_pool)
            assert torch.equal(out.view(torch.int16), want.view(torch.int16))
