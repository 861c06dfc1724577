"""GPU tests: pools over 4 GiB and slot numbers over 2^31 (and 2^32), touched at their last page.

Each test allocates real K and V pools of the size stated (it skips, saying how much memory it
needs, where the GPU has less free), uploads random bytes into the few pages it touches, writes
tokens into page 0 and the last page, reads them back through ``dequantize`` (and ``decode``, at a
head dim it is built for), and compares with the NumPy reference run on a compact copy of the
touched pages: only those pages travel between host and device. Pages 1 and last - 1 are touched
only as canaries: a write that lands a page off, or at its slot number modulo 2^32, shows there.
The pools are freed when each test ends.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from conftest import relative_error_per_head
from fp8kturbov import CacheLayout
from fp8kturbov import reference as ref

try:
    from cuda.bindings import driver as cu
    from gpu_util import check_driver_result as _check
except ImportError:  # the tests are skipped (conftest)
    cu = None

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
POISON = 0x7FC1  # a bf16 NaN: an output element still holding it was not written
GiB = 1 << 30
HEADROOM_BYTES = 1 * GiB  # left free besides the pools (the small buffers, the kernels' needs)
K_SCALE = 0.05


@pytest.fixture(scope="module")
def device():
    from gpu_util import Device

    dev = Device()
    yield dev
    dev.free_all()


@contextlib.contextmanager
def big_pools(device, layout: CacheLayout) -> Iterator[tuple[int, int]]:
    """Device K and V pools of ``layout``'s sizes (contents undefined), freed on exit; skips the
    test where the GPU has too little free memory."""
    need = layout.k_pool_bytes + layout.v_pool_bytes + HEADROOM_BYTES
    free, total = _check(cu.cuMemGetInfo())
    if free < need:
        pytest.skip(f"needs {need / GiB:.1f} GiB of free GPU memory (pools {layout.k_pool_bytes / GiB:.1f} + "
                    f"{layout.v_pool_bytes / GiB:.1f} GiB), {free / GiB:.1f} of {total / GiB:.1f} GiB free")
    pools = []
    try:
        for nbytes in (layout.k_pool_bytes, layout.v_pool_bytes):
            err, ptr = cu.cuMemAlloc(nbytes)
            if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                pytest.skip(f"cuMemAlloc({nbytes / GiB:.1f} GiB) ran out of memory "
                            f"({free / GiB:.1f} GiB were reported free)")
            _check((err, ptr))
            pools.append(ptr)
        yield int(pools[0]), int(pools[1])
    finally:
        # Cleanup ignores CUDA errors: it also runs while an earlier error propagates.
        cu.cuStreamSynchronize(device.stream)
        for ptr in pools:
            cu.cuMemFree(ptr)


class TouchedPages:
    """The pages of a pool too large to copy that a test touches, mirrored on the host as a
    compact pool: page ``pages[i]`` of the device pools is page ``i`` of ``k`` / ``v``, which
    start as random bytes."""

    def __init__(self, rng, layout: CacheLayout, pages: list[int]) -> None:
        self.layout, self.pages = layout, list(pages)
        self.k = rng.integers(0, 256, len(pages) * layout.k_block_stride_bytes, dtype=np.uint8)
        self.v = rng.integers(0, 256, len(pages) * layout.v_block_stride_bytes, dtype=np.uint8)

    def compact_pages(self, pages: np.ndarray) -> np.ndarray:
        compact = [self.pages.index(int(p)) for p in np.ravel(pages)]
        return np.array(compact, dtype=np.int64).reshape(np.shape(pages))

    def compact_slots(self, slots: np.ndarray) -> np.ndarray:
        """``slots`` with each page id replaced by its compact index (negative slots kept)."""
        out = slots.copy()
        real = slots >= 0
        pages, offsets = np.divmod(slots[real], self.layout.block_size)
        out[real] = self.compact_pages(pages) * self.layout.block_size + offsets
        return out

    def upload(self, device, k_cache: int, v_cache: int) -> None:
        """Copy the compact pages to their places in the device pools."""
        k_stride, v_stride = self.layout.k_block_stride_bytes, self.layout.v_block_stride_bytes
        for i, page in enumerate(self.pages):
            for address, host in ((k_cache + page * k_stride, self.k[i * k_stride:(i + 1) * k_stride]),
                                  (v_cache + page * v_stride, self.v[i * v_stride:(i + 1) * v_stride])):
                _check(cu.cuMemcpyHtoDAsync(address, host.ctypes.data, host.nbytes, device.stream))
        device.synchronize()

    def download(self, device, k_cache: int, v_cache: int) -> tuple[np.ndarray, np.ndarray]:
        """The touched pages as they are on the device, compact like ``k`` / ``v``."""
        k_stride, v_stride = self.layout.k_block_stride_bytes, self.layout.v_block_stride_bytes
        k = [device.download(k_cache + page * k_stride, self.k[:k_stride]) for page in self.pages]
        v = [device.download(v_cache + page * v_stride, self.v[:v_stride]) for page in self.pages]
        return np.concatenate(k), np.concatenate(v)


def pool_scalars(layout: CacheLayout) -> dict[str, Any]:
    return dict(num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, block_size=layout.block_size,
                v_bits=layout.v_bits, k_scale=K_SCALE, k_block_stride_bytes=layout.k_block_stride_bytes,
                v_block_stride_bytes=layout.v_block_stride_bytes,
                v_data_section_bytes=layout.v_data_section_bytes)


def bf16_rows(rng, num_rows: int, row_elems: int) -> np.ndarray:
    return rng.standard_normal((num_rows, row_elems)).astype(np.float32).astype(BF16)


def assert_bytes_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    differ = np.flatnonzero(got != want)
    assert differ.size == 0, f"{what}: {differ.size} differ, first at {differ[:8].tolist()}"


def write_and_read_back(device, rng, layout: CacheLayout, touched: TouchedPages, slots: np.ndarray,
                        k_cache: int, v_cache: int) -> tuple[np.ndarray, np.ndarray]:
    """Write random rows to ``slots``, check the touched pages and a dequantize of ``slots``
    against the reference; returns the compact reference pools after the write."""
    n, num_tokens = layout.row_elems, len(slots)
    key, value = bf16_rows(rng, num_tokens, n), bf16_rows(rng, num_tokens, n)
    touched.upload(device, k_cache, v_cache)
    slots_dev = device.upload(slots)
    fp8kturbov.reshape_and_cache(device.upload(key.view(np.uint16)), device.upload(value.view(np.uint16)),
                                 k_cache, v_cache, slots_dev, num_tokens=num_tokens, key_stride=n,
                                 value_stride=n, stream=device.stream, **pool_scalars(layout))
    got_k, got_v = touched.download(device, k_cache, v_cache)

    compact = touched.compact_slots(slots)
    want_k, want_v = touched.k.copy(), touched.v.copy()
    ref.write_cache(key, value, want_k, want_v, compact, num_tokens, layout.num_kv_heads, layout.head_dim,
                    layout.block_size, n, n, K_SCALE, layout.k_block_stride_bytes,
                    layout.v_block_stride_bytes, layout.v_data_section_bytes, layout.v_bits)
    assert_bytes_equal(got_k, want_k, "K bytes of pages " + str(touched.pages))
    assert_bytes_equal(got_v, want_v, "V bytes of pages " + str(touched.pages))

    poison = np.full((num_tokens, n), POISON, dtype=np.uint16)
    key_out, value_out = device.upload(poison), device.upload(poison)
    fp8kturbov.dequantize(k_cache, v_cache, slots_dev, key_out, value_out, num_tokens=num_tokens,
                          key_stride=n, value_stride=n, stream=device.stream, **pool_scalars(layout))
    want_key, want_value = ref.dequantize_cache(
        want_k, want_v, compact, num_tokens, layout.num_kv_heads, layout.head_dim, layout.block_size, K_SCALE,
        layout.k_block_stride_bytes, layout.v_block_stride_bytes, layout.v_data_section_bytes, layout.v_bits)
    assert_bytes_equal(device.download(key_out, poison), want_key.view(np.uint16), "dequantized keys")
    assert_bytes_equal(device.download(value_out, poison), want_value.view(np.uint16), "dequantized values")
    return want_k, want_v


@pytest.mark.parametrize("bits, slot_bits", [(2, 31), (3, 31), (4, 31), (2, 32)],
                         ids=["2bit_past_2^31", "3bit_past_2^31", "4bit_past_2^31", "2bit_past_2^32"])
def test_slots_past_2_to_the_31(device, rng, bits, slot_bits):
    """One KV head of 16 elements in pages of 16 slots (K 16 B and V 5, 7 or 9 B per slot), so
    2^31 slots take 42 to 50 GiB and 2^32 slots 84 GiB. The write and the dequantize take any
    head dim; the decode is built for 64 and up only, so it reads the model shape's pools below."""
    block_size = 16
    layout = CacheLayout(2**slot_bits // block_size + 2, block_size, 1, 16, bits)
    last = layout.num_blocks - 1
    touched = TouchedPages(rng, layout, [0, 1, last - 1, last])
    offsets = np.array([0, 5, block_size - 1])
    slots = np.concatenate([offsets, last * block_size + offsets, [-1]]).astype(np.int64)
    rng.shuffle(slots)
    assert slots.max() > 2**slot_bits and layout.k_pool_bytes > 4 * GiB
    with big_pools(device, layout) as (k_cache, v_cache):
        write_and_read_back(device, rng, layout, touched, slots, k_cache, v_cache)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pools_over_4_gib_at_a_model_shape(device, rng, bits):
    """8 KV heads of 128, pages of 16 slots, enough pages that the V pool alone is over 4 GiB
    (the K pool is larger): 11 to 17 GiB. Page 0 and the last page are written whole, read back
    through dequantize, and attended by decodes whose page tables point at the last page."""
    num_kv_heads, head_dim, block_size, group_size = 8, 128, 16, 4
    v_page = ref.v_page_bytes(block_size, num_kv_heads, head_dim, bits)
    layout = CacheLayout(2**32 // v_page + 2, block_size, num_kv_heads, head_dim, bits)
    assert layout.v_pool_bytes > 4 * GiB and layout.k_pool_bytes > 4 * GiB
    last = layout.num_blocks - 1
    touched = TouchedPages(rng, layout, [0, 1, last - 1, last])
    slots = np.concatenate([np.arange(block_size), last * block_size + np.arange(block_size), [-1]])
    slots = rng.permutation(slots.astype(np.int64))

    num_q_heads = num_kv_heads * group_size
    block_tables = np.array([[last, 0], [last, 0], [0, last]], dtype=np.int32)
    seq_lens = np.array([block_size, 2 * block_size - 3, block_size + 5], dtype=np.int32)
    num_seqs, max_blocks_per_seq = block_tables.shape
    q_stride = num_q_heads * head_dim
    q = bf16_rows(rng, num_seqs, q_stride)
    decode_scalars = dict(pool_scalars(layout), max_blocks_per_seq=max_blocks_per_seq, num_seqs=num_seqs,
                          num_q_heads=num_q_heads, inv_sqrt_d=float(head_dim**-0.5), q_stride=q_stride,
                          sliding_window=0, sparse_v_threshold=0.0)

    with big_pools(device, layout) as (k_cache, v_cache):
        want_k, want_v = write_and_read_back(device, rng, layout, touched, slots, k_cache, v_cache)
        want = ref.paged_decode(q, want_k, want_v, touched.compact_pages(block_tables), seq_lens,
                                max_blocks_per_seq, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size,
                                decode_scalars["inv_sqrt_d"], K_SCALE, q_stride, layout.v_block_stride_bytes,
                                layout.v_data_section_bytes, 0, bits,
                                k_block_stride_bytes=layout.k_block_stride_bytes)
        split_bytes = fp8kturbov.paged_decode_workspace_bytes(**decode_scalars)
        for workspace_bytes in sorted({0, split_bytes}):  # unsplit, and split where that helps
            poison = np.full((num_seqs, num_q_heads, head_dim), POISON, dtype=np.uint16)
            out = device.upload(poison)
            fp8kturbov.paged_decode_attn(
                device.upload(q.view(np.uint16)), k_cache, v_cache, out, device.upload(block_tables),
                device.upload(seq_lens), workspace=device.upload(np.zeros(max(workspace_bytes, 1), np.uint8)),
                workspace_bytes=workspace_bytes, stream=device.stream, **decode_scalars)
            got = device.download(out, poison).view(BF16).astype(np.float64)
            what = f"decode with a workspace of {workspace_bytes} bytes"
            assert not np.isnan(got).any(), f"{what}: an output element is NaN or unwritten"
            err = relative_error_per_head(got, want)
            assert err.max() <= 1e-2, f"{what}: max relative error per head {err.max():.3g}"
