"""GPU tests of the paged prefill (``paged_prefill``): chunks of query tokens over the cache, against
the float64 reference (``reference.paged_prefill``), on fresh random inputs each run.

Each case writes every position of every sequence (the chunks' own tokens included) with ``write_kv``
into poisoned pools, runs the prefill into poisoned outputs (bf16 NaN, ``lse`` a sentinel), and
compares each (row, head) output by its relative error and each log-denominator (``lse``) against the
reference. Chunk lengths cover 0, 1, 15, 16, 17, whole sequences and several query tiles; page tables
are random.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fp8kturbov
from conftest import case_id, relative_error_per_head, shuffled_block_tables
from fp8kturbov import CacheLayout, KVCache
from fp8kturbov import reference as ref
from test_gpu_append import bf16_rows, slots_of, to_device, to_host

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

K_SCALE = 0.06
BOUND = 1e-2      # relative error per head against the float64 reference
LSE_BOUND = 1e-3  # absolute, in natural-log units (fp32 scores)


@dataclasses.dataclass(frozen=True)
class Case:
    bits: int = 3
    head_dim: int = 128
    num_kv_heads: int = 2
    group: int = 4                 # query heads per KV head
    block_size: int = 16
    seq_lens: tuple = (17, 40, 300, 64, 0)
    q_lens: tuple = (1, 16, 137, 64, 0)  # chunk = whole sequence (64); an empty one
    window: int = 0
    rotation: bool = False
    sinks: bool = False
    soft_cap: float = 0.0
    checked: bool = False
    q_row_pad: int = 0             # q rows this many elements wider than num_q_heads * head_dim
    workspace: bool = True         # context splits where the plan takes them

    def __str__(self) -> str:
        return case_id(self)


LONG, LONG_CHUNKS = (2000, 700, 5, 1), (16, 300, 5, 1)

CASES = [
    *(Case(bits=b, head_dim=d) for b in (2, 3, 4) for d in (64, 128, 256)),
    Case(seq_lens=(15, 16, 17, 33, 1), q_lens=(15, 16, 17, 2, 1)),  # around a 16-token page and tile
    Case(group=1, seq_lens=(200, 70), q_lens=(130, 65)),             # several query tiles of one head
    Case(group=8, head_dim=64), Case(group=16, num_kv_heads=1, head_dim=64, bits=2),
    Case(group=3, num_kv_heads=3),                                   # tiles that end inside a token's heads
    Case(block_size=8, window=40), Case(block_size=24, window=7, bits=4),
    Case(sinks=True), Case(soft_cap=20.0, bits=2), Case(sinks=True, soft_cap=5.0, head_dim=256, window=50),
    Case(rotation=True), Case(rotation=True, head_dim=256, bits=2, sinks=True),
    Case(checked=True), Case(q_row_pad=24, bits=4, head_dim=64),
    # Chunks of at most 64 query rows (max_q_len x group): the 64-row kernel also where a 9.0 device
    # takes the warp-specialised one for longer chunks.
    *(Case(**{"bits": b, "head_dim": d, "seq_lens": (15, 40, 17, 1), "q_lens": (15, 16, 3, 1), **options})
      for b, d, options in ((2, 64, dict(sinks=True)), (4, 128, dict(rotation=True, soft_cap=20.0)),
                            (3, 128, dict(window=9, block_size=8)), (3, 64, dict(group=8, q_lens=(8, 5, 3, 1))),
                            (2, 256, dict(sinks=True, rotation=True)))),
    # Without a workspace: chunks of several 128-row tiles dequantize every tile per CTA, where the
    # workspace would have held the expanded context (each tile dequantized once).
    Case(workspace=False), Case(bits=2, head_dim=256, workspace=False, sinks=True),
    Case(bits=4, head_dim=64, workspace=False, soft_cap=20.0, window=50),
    # Short chunks over long contexts: the plan splits the context, a merge combines the splits.
    *(Case(**{"bits": b, "head_dim": d, "seq_lens": LONG, "q_lens": LONG_CHUNKS, **options})
      for b, d, options in ((2, 64, {}), (3, 128, {}), (4, 256, {}), (3, 128, dict(workspace=False)),
                            (3, 128, dict(sinks=True, soft_cap=10.0)), (2, 128, dict(rotation=True, window=300)),
                            (4, 256, dict(rotation=True, sinks=True)), (3, 64, dict(checked=True, group=8)),
                            (3, 128, dict(q_lens=(16, 16, 5, 1))), (4, 128, dict(group=8)))),
]


def run_case(rng, case: Case, *, use_lse: bool = True):
    """Builds the case's cache and runs the prefill; returns (output, lse, want, want_lse)."""
    heads, dim, bs = case.num_kv_heads, case.head_dim, case.block_size
    num_q_heads, n = heads * case.group, heads * case.head_dim
    seq_lens = np.array(case.seq_lens, dtype=np.int32)
    q_lens = np.array(case.q_lens, dtype=np.int32)
    pages = [max((int(s) + bs - 1) // bs, 1) for s in seq_lens]
    max_blocks = max(pages)
    layout = CacheLayout(num_blocks=sum(pages) + 3, block_size=bs, num_kv_heads=heads, head_dim=dim,
                         v_bits=case.bits)
    tables = shuffled_block_tables(rng, pages, layout.num_blocks, max_blocks)
    context = [(s, p) for s, length in enumerate(seq_lens) for p in range(length)]
    slots = slots_of(tables, context, bs)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    rows = int(query_start[-1])
    q_stride = num_q_heads * dim + case.q_row_pad
    q_flat = bf16_rows(rng, rows, q_stride)
    q = q_flat[:, :num_q_heads * dim].reshape(rows, num_q_heads, dim)
    sinks = (rng.standard_normal(num_q_heads) * 3).astype(np.float32) if case.sinks else None
    rotation = "hadamard" if case.rotation else "none"
    with KVCache.allocate(layout, K_SCALE, checked=case.checked, v_rotation=rotation) as cache:
        cache.k_pool.copy_(torch.from_numpy(rng.integers(0, 256, layout.k_pool_bytes, dtype=np.uint8)))
        cache.v_pool.copy_(torch.from_numpy(rng.integers(0, 256, layout.v_pool_bytes, dtype=np.uint8)))
        fp8kturbov.write_kv(to_device(bf16_rows(rng, len(context), n)), to_device(bf16_rows(rng, len(context), n)),
                            cache, to_device(slots))
        q_dev = to_device(q_flat)[:, :num_q_heads * dim].view(rows, num_q_heads, dim)
        out = torch.full((rows, num_q_heads, dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((rows, num_q_heads), 12345.0, dtype=torch.float32, device="cuda") if use_lse else None
        workspace = (cache.prefill_workspace(len(seq_lens), num_q_heads, max_blocks, int(q_lens.max()), rows,
                                             case.window) if case.workspace else None)
        if workspace is not None:
            workspace.fill_(0xFF)  # NaN partials wherever the kernels leave a gap
        fp8kturbov.paged_prefill(q_dev, cache, to_device(tables), to_device(seq_lens), to_device(query_start),
                                 max_q_len=int(q_lens.max()), out=out, lse=lse, sliding_window=case.window,
                                 sinks=None if sinks is None else to_device(sinks), soft_cap=case.soft_cap,
                                 workspace=workspace)
        torch.cuda.synchronize()
        if case.checked:
            cache.check_errors()  # every index in range: nothing reported
        k_pool, v_pool = to_host(cache.k_pool), to_host(cache.v_pool)
        got, got_lse = to_host(out), None if lse is None else to_host(lse)
    want, want_lse = ref.paged_prefill(
        q_flat.reshape(-1), k_pool, v_pool, tables, seq_lens, query_start, max_blocks, len(seq_lens), num_q_heads,
        heads, dim, bs, dim ** -0.5, K_SCALE, q_stride, layout.v_block_stride_bytes, layout.v_data_section_bytes,
        case.window, case.bits, sinks=sinks, soft_cap=case.soft_cap, rotation=case.rotation)
    return got, got_lse, want, want_lse


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_matches_reference(rng, case):
    got, got_lse, want, want_lse = run_case(rng, case)
    error = relative_error_per_head(got.astype(np.float64), want)
    assert error.max() < BOUND, f"output vs reference: {error.max():.3g} at {np.unravel_index(error.argmax(), error.shape)}"
    empty = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(got_lse), empty), "rows without positions: lse -inf exactly there"
    assert np.all(got[empty].astype(np.float32) == 0), "rows without positions: zeros"
    lse_error = np.abs(got_lse[~empty] - want_lse[~empty])
    assert lse_error.max(initial=0.0) < LSE_BOUND, f"lse vs reference: {lse_error.max():.3g}"


def test_prefill_without_lse_writes_the_same_output(rng):
    case = Case(bits=2, seq_lens=(50, 9), q_lens=(33, 9))
    got, got_lse, want, _ = run_case(rng, case, use_lse=False)
    assert got_lse is None
    assert relative_error_per_head(got.astype(np.float64), want).max() < BOUND


@pytest.mark.parametrize("bits", [2, 4])
def test_short_chunks_agree_with_the_multi_token_decode(rng, bits):
    """Chunks of at most 16 tokens: the prefill and the decode's multi-token path read the same bytes;
    both stay within the bound of the reference, hence within twice of each other."""
    heads, dim, bs, group = 2, 128, 16, 4
    seq_lens = np.array([40, 5, 130, 16], dtype=np.int32)
    q_lens = np.array([16, 5, 3, 1], dtype=np.int32)
    pages = [(int(s) + bs - 1) // bs for s in seq_lens]
    layout = CacheLayout(num_blocks=sum(pages) + 1, block_size=bs, num_kv_heads=heads, head_dim=dim, v_bits=bits)
    tables = shuffled_block_tables(rng, pages, layout.num_blocks, max(pages))
    context = [(s, p) for s, length in enumerate(seq_lens) for p in range(length)]
    slots = slots_of(tables, context, bs)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    rows, n = int(query_start[-1]), heads * dim
    q = to_device(bf16_rows(rng, rows, heads * group * dim)).view(rows, heads * group, dim)
    with KVCache.allocate(layout, K_SCALE) as cache:
        fp8kturbov.write_kv(to_device(bf16_rows(rng, len(context), n)), to_device(bf16_rows(rng, len(context), n)),
                            cache, to_device(slots))
        args = (q, cache, to_device(tables), to_device(seq_lens))
        prefill = fp8kturbov.paged_prefill(*args, to_device(query_start), max_q_len=int(q_lens.max()))
        decode = fp8kturbov.paged_decode(*args, query_start=to_device(query_start), max_q_len=int(q_lens.max()),
                                         sparse_v_threshold=0.0)
        a, b = to_host(prefill).astype(np.float64), to_host(decode).astype(np.float64)
    assert relative_error_per_head(a, b).max() < 2 * BOUND


def test_checked_prefill_reports_and_skips_bad_indices(rng):
    """A block-table entry outside the pools is left out of the softmax and reported; a chunk longer than
    max_q_len is not computed (its rows keep their poison) and reported."""
    case = Case(checked=True, seq_lens=(40, 20), q_lens=(8, 4))
    heads, dim, bs = case.num_kv_heads, case.head_dim, case.block_size
    layout = CacheLayout(num_blocks=8, block_size=bs, num_kv_heads=heads, head_dim=dim, v_bits=3)
    tables = np.array([[0, 1, 99], [3, 4, -7]], dtype=np.int32)  # page 99: outside the 8 pages
    seq_lens = np.array(case.seq_lens, dtype=np.int32)
    query_start = np.array([0, 8, 12], dtype=np.int32)
    q = to_device(bf16_rows(rng, 12, heads * case.group * dim)).view(12, heads * case.group, dim)
    for max_q_len, flag in ((8, "BLOCK_TABLE"), (4, "QUERY_START")):
        with KVCache.allocate(layout, K_SCALE, checked=True) as cache:
            cache.k_pool.zero_()
            cache.v_pool.zero_()
            out = torch.full((12, heads * case.group, dim), 7.0, dtype=torch.bfloat16, device="cuda")
            fp8kturbov.paged_prefill(q, cache, to_device(tables), to_device(seq_lens), to_device(query_start),
                                     max_q_len=max_q_len, out=out)
            torch.cuda.synchronize()
            with pytest.raises(fp8kturbov.CacheIndexError, match=flag):
                cache.check_errors()
            if flag == "QUERY_START":  # sequence 0's 8 tokens exceed max_q_len 4: not written
                assert torch.all(out[:8] == 7.0)
                assert torch.all(torch.isfinite(out[8:]))


def test_prefill_in_a_graph_reads_what_each_replay_finds(rng):
    """Captured once, replayed: each replay attends the lengths and chunks in device memory then."""
    heads, dim, bs, group = 2, 64, 16, 4
    layout = CacheLayout(num_blocks=40, block_size=bs, num_kv_heads=heads, head_dim=dim, v_bits=3)
    tables = shuffled_block_tables(rng, [20, 20], layout.num_blocks, 20)
    context = [(s, p) for s in range(2) for p in range(300)]
    slots = slots_of(tables, context, bs)
    n, rows = heads * dim, 64
    q_host = bf16_rows(rng, rows, heads * group * dim)
    with KVCache.allocate(layout, K_SCALE) as cache:
        fp8kturbov.write_kv(to_device(bf16_rows(rng, len(context), n)), to_device(bf16_rows(rng, len(context), n)),
                            cache, to_device(slots))
        k_pool, v_pool = to_host(cache.k_pool), to_host(cache.v_pool)
        q = to_device(q_host).view(rows, heads * group, dim)
        seq_lens, query_start = to_device(np.zeros(2, np.int32)), to_device(np.zeros(3, np.int32))
        out = torch.zeros((rows, heads * group, dim), dtype=torch.bfloat16, device="cuda")
        dev_tables = to_device(tables)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            fp8kturbov.paged_prefill(q, cache, dev_tables, seq_lens, query_start, max_q_len=48, out=out)
        for lengths, chunks in (((300, 120), (48, 16)), ((33, 290), (1, 40))):
            seq_host = np.array(lengths, np.int32)
            starts = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
            seq_lens.copy_(torch.from_numpy(seq_host))
            query_start.copy_(torch.from_numpy(starts))
            graph.replay()
            torch.cuda.synchronize()
            want, _ = ref.paged_prefill(q_host.reshape(-1), k_pool, v_pool, tables, seq_host, starts, 20, 2,
                                        heads * group, heads, dim, bs, dim ** -0.5, K_SCALE, heads * group * dim,
                                        layout.v_block_stride_bytes, layout.v_data_section_bytes, 0, 3)
            got = to_host(out)[:starts[-1]].astype(np.float64)
            assert relative_error_per_head(got, want).max() < BOUND, (lengths, chunks)
