"""The decode options of the NumPy reference (off by default): multi-token decode (``query_start``),
attention sinks and logit soft-capping. Each is checked against the reference without it, on fresh
random caches: what the option must reduce to, and properties that follow from its definition."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from conftest import shuffled_block_tables
from fp8kturbov import reference as ref

BF16 = ml_dtypes.bfloat16


class Cache:
    """A random cache written by the reference: 2 KV heads, GQA group of 2, ragged sequences,
    shuffled pages; ``rows`` query rows of random bf16."""

    def __init__(self, rng, seq_lens=(1, 23, 70, 5), bits=3, head_dim=64, block_size=16, rows=None):
        self.seq_lens = np.array(seq_lens, dtype=np.int32)
        self.num_seqs = len(seq_lens)
        self.bits, self.head_dim, self.block_size = bits, head_dim, block_size
        self.num_kv_heads, self.num_q_heads = 2, 4
        n = self.num_kv_heads * head_dim
        blocks = -(-self.seq_lens // block_size)
        self.max_blocks = int(blocks.max())
        num_blocks = int(blocks.sum())
        self.tables = shuffled_block_tables(rng, blocks, num_blocks, self.max_blocks, unused=0)
        self.v_data = ref.v_data_section_bytes(block_size, self.num_kv_heads, head_dim, bits)
        self.v_stride = ref.v_page_bytes(block_size, self.num_kv_heads, head_dim, bits)
        self.k_pool = np.zeros(num_blocks * block_size * n, dtype=np.uint8)
        self.v_pool = np.zeros(num_blocks * self.v_stride, dtype=np.uint8)
        slots = num_blocks * block_size
        ref.write_cache(rng.standard_normal((slots, n)).astype(BF16), rng.standard_normal((slots, n)).astype(BF16),
                        self.k_pool, self.v_pool, np.arange(slots), slots, self.num_kv_heads, head_dim,
                        block_size, n, n, 0.05, block_size * n, self.v_stride, self.v_data, bits)
        self.q_stride = self.num_q_heads * head_dim
        self.q = rng.standard_normal((rows or self.num_seqs, self.q_stride)).astype(BF16)

    def decode(self, q=None, seq_lens=None, window=0, **options):
        return ref.paged_decode(self.q if q is None else q, self.k_pool, self.v_pool, self.tables,
                                self.seq_lens if seq_lens is None else seq_lens, self.max_blocks,
                                self.num_seqs, self.num_q_heads, self.num_kv_heads, self.head_dim,
                                self.block_size, 1 / np.sqrt(self.head_dim), 0.05, self.q_stride,
                                self.v_stride, self.v_data, window, self.bits, **options)


@pytest.mark.parametrize("window", [0, 9])
def test_one_query_per_sequence_is_the_default(rng, window):
    cache = Cache(rng)
    starts = np.arange(cache.num_seqs + 1)
    assert np.array_equal(cache.decode(window=window, query_start=starts), cache.decode(window=window))


@pytest.mark.parametrize("window", [0, 9])
def test_chunk_token_attends_up_to_its_own_position(rng, window):
    """Token i of a chunk of q_len is position L − q_len + i: the same as a one-token decode of that
    query over the sequence cut to L − q_len + i + 1 positions (ragged q_len, one empty chunk)."""
    q_lens = np.array([1, 0, 16, 5])
    cache = Cache(rng, seq_lens=(1, 23, 70, 5), rows=int(q_lens.sum()))
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    got = cache.decode(window=window, query_start=starts)
    assert got.shape == (q_lens.sum(), cache.num_q_heads, cache.head_dim)
    for s, q_len in enumerate(q_lens):
        for i in range(q_len):
            row = starts[s] + i
            lens = cache.seq_lens.copy()
            lens[s] = cache.seq_lens[s] - q_len + i + 1
            q_rows = np.zeros_like(cache.q[:cache.num_seqs])
            q_rows[s] = cache.q[row]
            want = cache.decode(q=q_rows, seq_lens=lens, window=window)[s]
            np.testing.assert_array_equal(got[row], want)


def test_query_start_is_checked(rng):
    cache = Cache(rng, seq_lens=(1, 23, 70, 5), rows=8)
    with pytest.raises(ValueError, match="more query tokens"):
        cache.decode(query_start=[0, 2, 3, 4, 5])  # 2 tokens for a sequence of 1 position
    with pytest.raises(ValueError, match="non-decreasing"):
        cache.decode(query_start=[0, 1, 0, 1, 2])
    with pytest.raises(ValueError, match="non-decreasing"):
        cache.decode(query_start=[0, 1, 2])


def test_sink_only_rescales_each_row(rng):
    """A sink logit joins the denominator only: each output row is the no-sink row times
    Z / (Z + e^sink) — one factor in (0, 1) per row, smaller for a larger sink; a sink of −inf is
    no sink."""
    cache = Cache(rng)
    plain = cache.decode()
    assert np.array_equal(cache.decode(sinks=np.full(cache.num_q_heads, -np.inf)), plain)
    low, high = np.full(cache.num_q_heads, -1.0), np.full(cache.num_q_heads, 2.0)
    with_low, with_high = cache.decode(sinks=low), cache.decode(sinks=high)
    for s in range(cache.num_seqs):
        for h in range(cache.num_q_heads):
            row = plain[s, h]
            factors = []
            for scaled in (with_low[s, h], with_high[s, h]):
                # The row's factor by least squares, then every element against it, to within
                # rounding of the row's magnitude (an element-wise ratio is ill-conditioned
                # where an element nearly cancels).
                factor = float(scaled @ row / (row @ row))
                np.testing.assert_allclose(scaled, factor * row, rtol=0, atol=1e-12 * np.abs(row).max())
                factors.append(factor)
            assert 0 < factors[1] < factors[0] < 1


def test_sink_of_a_one_position_sequence(rng):
    """With one position, out = v / (1 + e^(sink − score)): the sink's weight is explicit."""
    cache = Cache(rng, seq_lens=(1, 1, 1, 1))
    sinks = rng.standard_normal(cache.num_q_heads)
    plain, got = cache.decode(), cache.decode(sinks=sinks)
    n, d = cache.num_kv_heads * cache.head_dim, cache.head_dim
    for s in range(cache.num_seqs):
        page = cache.tables[s, 0]
        k = ref.decode_k(cache.k_pool[page * cache.block_size * n:][:n], 0.05).astype(np.float64)
        for h in range(cache.num_q_heads):
            kv = h // 2
            score = k[kv * d:(kv + 1) * d] @ cache.q[s, h * d:(h + 1) * d].astype(np.float64) / np.sqrt(d)
            np.testing.assert_allclose(got[s, h], plain[s, h] / (1 + np.exp(sinks[h] - score)), rtol=1e-12)


def test_soft_cap(rng):
    """A cap far above every score changes nothing measurable; a tiny cap flattens every score to
    ~0, which makes the attention the mean of the V rows in range."""
    cache = Cache(rng)
    # cap·tanh(s/cap) = s - s³/(3·cap²) + ...: at cap 1e9 the change is below float64 rounding of s.
    np.testing.assert_allclose(cache.decode(soft_cap=1e9), cache.decode(), rtol=1e-9, atol=1e-12)
    flat = cache.decode(soft_cap=1e-9)
    n, d = cache.num_kv_heads * cache.head_dim, cache.head_dim
    for s, length in enumerate(cache.seq_lens):
        positions = np.arange(length)
        pages = cache.tables[s, positions // cache.block_size]
        offsets = positions % cache.block_size
        starts = pages * cache.v_stride
        data = cache.v_pool[(starts + offsets * n * cache.bits // 8)[:, None] + np.arange(n * cache.bits // 8)]
        scales = cache.v_pool[(starts + cache.v_data + offsets * n // 16)[:, None] + np.arange(n // 16)]
        v = ref.decode_v(data, scales, cache.bits).astype(np.float64).reshape(length, cache.num_kv_heads, d)
        for h in range(cache.num_q_heads):
            np.testing.assert_allclose(flat[s, h], v[:, h // 2].mean(axis=0), rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="soft_cap"):
        cache.decode(soft_cap=-1.0)
