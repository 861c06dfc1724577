"""Heads sharded over tensor-parallel ranks (docs/integration.md, "Multi-GPU"), in the NumPy reference:
a rank that writes its share of the KV heads with the layer's one K scale holds exactly the bytes of
those heads in a one-GPU cache, and its decode of the matching query heads gives those heads' outputs
of the one-GPU decode. A scale calibrated per rank breaks the first (the K bytes differ)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fp8kturbov import calibrate_k_scale
from fp8kturbov import reference as ref

BF16 = ml_dtypes.bfloat16
HEAD_DIM, BLOCK, GROUP = 128, 16, 2  # 128: the smallest head_dim with a rotation (FORMAT §6)


class Pools:
    """The reference's pools for ``heads`` KV heads of ``blocks`` pages, written with ``key``/``value``
    (``[slots, heads, HEAD_DIM]``) at slots 0.. in order."""

    def __init__(self, key, value, k_scale, bits, rotation):
        slots, self.heads, _ = key.shape
        self.blocks = slots // BLOCK
        n = self.heads * HEAD_DIM
        self.v_data = ref.v_data_section_bytes(BLOCK, self.heads, HEAD_DIM, bits)
        self.v_stride = ref.v_page_bytes(BLOCK, self.heads, HEAD_DIM, bits)
        self.k_pool = np.zeros(self.blocks * BLOCK * n, dtype=np.uint8)
        self.v_pool = np.zeros(self.blocks * self.v_stride, dtype=np.uint8)
        self.k_scale, self.bits, self.rotation = k_scale, bits, rotation
        ref.write_cache(key.reshape(slots, n), value.reshape(slots, n), self.k_pool, self.v_pool, np.arange(slots),
                        slots, self.heads, HEAD_DIM, BLOCK, n, n, k_scale, BLOCK * n, self.v_stride, self.v_data, bits,
                        rotation=rotation)

    def k_bytes(self):  # [slots, heads, HEAD_DIM]
        return self.k_pool.reshape(self.blocks * BLOCK, self.heads, HEAD_DIM)

    def v_bytes(self):  # each page: codes [BLOCK, heads, ...], then scales [BLOCK, heads, ...]
        pages = self.v_pool.reshape(self.blocks, self.v_stride)
        codes = pages[:, :self.v_data].reshape(self.blocks * BLOCK, self.heads, -1)
        scales = pages[:, self.v_data:self.v_data + BLOCK * self.heads * HEAD_DIM // 16]
        return codes, scales.reshape(self.blocks * BLOCK, self.heads, -1)

    def decode(self, q, seq_lens):
        tables = np.arange(self.blocks, dtype=np.int32).reshape(1, -1).repeat(len(seq_lens), 0)
        num_q_heads = self.heads * GROUP
        return ref.paged_decode(q.reshape(len(seq_lens), -1), self.k_pool, self.v_pool, tables, seq_lens, self.blocks,
                                len(seq_lens), num_q_heads, self.heads, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5,
                                self.k_scale, num_q_heads * HEAD_DIM, self.v_stride, self.v_data, 0, self.bits,
                                rotation=self.rotation)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("rotation", [False, True])
def test_a_rank_holds_the_bytes_and_outputs_of_its_heads(rng, bits, rotation):
    heads, tp, slots = 4, 2, 3 * BLOCK
    key = rng.standard_normal((slots, heads, HEAD_DIM)).astype(BF16)
    value = rng.standard_normal((slots, heads, HEAD_DIM)).astype(BF16)
    k_scale = float(calibrate_k_scale(np.abs(key.astype(np.float32)).max()))  # over all heads
    whole = Pools(key, value, k_scale, bits, rotation)
    q = rng.standard_normal((2, heads * GROUP, HEAD_DIM)).astype(BF16)
    seq_lens = np.array([slots, 21], dtype=np.int32)
    want = whole.decode(q, seq_lens)
    local = heads // tp
    for rank in range(tp):
        kv = slice(rank * local, (rank + 1) * local)
        shard = Pools(key[:, kv], value[:, kv], k_scale, bits, rotation)
        assert np.array_equal(shard.k_bytes(), whole.k_bytes()[:, kv])
        for got_part, want_part in zip(shard.v_bytes(), whole.v_bytes(), strict=True):
            assert np.array_equal(got_part, want_part[:, kv])
        qh = slice(rank * local * GROUP, (rank + 1) * local * GROUP)  # the query heads of its KV heads
        np.testing.assert_array_equal(shard.decode(q[:, qh], seq_lens), want[:, qh])


def test_a_scale_calibrated_per_rank_changes_the_k_bytes(rng):
    heads, slots = 4, BLOCK
    key = rng.standard_normal((slots, heads, HEAD_DIM)).astype(BF16)
    key[:, :2] *= 4  # rank 0's heads carry the layer's largest keys
    value = rng.standard_normal((slots, heads, HEAD_DIM)).astype(BF16)
    layer_scale = float(calibrate_k_scale(np.abs(key.astype(np.float32)).max()))
    rank_scale = float(calibrate_k_scale(np.abs(key[:, 2:].astype(np.float32)).max()))
    assert rank_scale < layer_scale
    whole = Pools(key, value, layer_scale, 3, False)
    own = Pools(key[:, 2:], value[:, 2:], rank_scale, 3, False)
    assert not np.array_equal(own.k_bytes(), whole.k_bytes()[:, 2:])
