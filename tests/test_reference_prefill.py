"""The NumPy reference's paged prefill (``reference.paged_prefill``): chunks of any length over the
cache, and each row's log-denominator (``lse``). Checked against dense float64 attention over the
dequantized cache, computed here independently, and against the decode for short chunks."""

from __future__ import annotations

import numpy as np
import pytest

from fp8kturbov import reference as ref
from test_reference_decode_options import Cache


def prefill(cache: Cache, starts, window=0, **options):
    return ref.paged_prefill(cache.q, cache.k_pool, cache.v_pool, cache.tables, cache.seq_lens, starts,
                             cache.max_blocks, cache.num_seqs, cache.num_q_heads, cache.num_kv_heads,
                             cache.head_dim, cache.block_size, 1 / np.sqrt(cache.head_dim), 0.05, cache.q_stride,
                             cache.v_stride, cache.v_data, window, cache.bits, **options)


def sequence_kv(cache: Cache, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence s's K and V, float64 [positions, H_kv, D], read from the pools' bytes at the
    addresses of FORMAT §2-§3 and decoded by `decode_k` / `decode_v`."""
    n, bits, bs = cache.num_kv_heads * cache.head_dim, cache.bits, cache.block_size
    pos = np.arange(int(cache.seq_lens[s]))
    pages, offsets = cache.tables[s, pos // bs].astype(np.int64), pos % bs
    k_starts = pages * bs * n + offsets * n
    code_starts = pages * cache.v_stride + offsets * (n * bits // 8)
    scale_starts = pages * cache.v_stride + cache.v_data + offsets * (n // 16)
    k = ref.decode_k(np.stack([cache.k_pool[a:a + n] for a in k_starts]), 0.05)
    v = ref.decode_v(np.stack([cache.v_pool[a:a + n * bits // 8] for a in code_starts]),
                     np.stack([cache.v_pool[a:a + n // 16] for a in scale_starts]), bits)
    shape = (len(pos), cache.num_kv_heads, cache.head_dim)
    return k.astype(np.float64).reshape(shape), v.astype(np.float64).reshape(shape)


@pytest.mark.parametrize("window", [0, 11])
def test_prefill_is_dense_causal_attention_with_its_log_denominator(rng, window):
    """Chunks longer than the decode's 16 tokens (and a whole sequence): each row equals softmax
    attention over its causal window, and lse = log Σ e^score (+ e^sink), so out = Σ e^(score − lse)·v."""
    q_lens = np.array([1, 23, 40, 0])
    cache = Cache(rng, seq_lens=(1, 23, 70, 5), rows=int(q_lens.sum()))
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    sinks = rng.standard_normal(cache.num_q_heads) * 2
    got, got_lse = prefill(cache, starts, window, sinks=sinks)
    q = cache.q.astype(np.float64).reshape(-1, cache.num_q_heads, cache.head_dim)
    for s, q_len in enumerate(q_lens):
        if q_len == 0:
            continue
        k, v = sequence_kv(cache, s)
        group = cache.num_q_heads // cache.num_kv_heads
        for i in range(q_len):
            end = int(cache.seq_lens[s]) - q_len + i + 1
            start = end - window if 0 < window < end else 0
            for h in range(cache.num_q_heads):
                scores = k[start:end, h // group] @ q[starts[s] + i, h] / np.sqrt(cache.head_dim)
                lse = np.log(np.exp(scores).sum() + np.exp(sinks[h]))
                want = np.exp(scores - lse) @ v[start:end, h // group]
                np.testing.assert_allclose(got_lse[starts[s] + i, h], lse, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(got[starts[s] + i, h], want, rtol=1e-9, atol=1e-12)


def test_empty_sequences_and_chunks_longer_than_their_sequence(rng):
    """An empty sequence with an empty chunk has no rows; a chunk longer than its sequence (a row
    before position 0, which the kernels give zeros and lse −inf) is refused by the reference."""
    cache = Cache(rng, seq_lens=(0, 6), rows=3)
    got, lse = prefill(cache, np.array([0, 0, 3]))
    assert got.shape == (3, cache.num_q_heads, cache.head_dim) and np.all(np.isfinite(lse))
    with pytest.raises(ValueError, match="more query tokens"):
        prefill(cache, np.array([0, 1, 3]))


def test_short_chunks_are_the_decode_s(rng):
    """Up to 16 tokens the prefill is the multi-token decode with exact V (sparse_v_threshold 0)."""
    q_lens = np.array([1, 16, 3, 5])
    cache = Cache(rng, seq_lens=(1, 23, 70, 5), rows=int(q_lens.sum()))
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    out, _ = prefill(cache, starts)
    np.testing.assert_array_equal(out, cache.decode(query_start=starts, sparse_v_threshold=0.0))
