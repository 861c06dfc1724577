"""GPU tests of the tensor-level API (fp8kturbov.arrays) through torch and CuPy.

Each write, decode and dequantize goes through arrays on a non-default stream made current in the
array's own library, and is checked three ways: the launch used that stream, the result equals the
NumPy reference (cache bytes exactly over the whole poisoned pools; decode within 1e-2 relative
error per head of the float64 reference, exact softmax; dequantized rows bit for bit), and it
equals, byte for byte, the raw-pointer launch on the same inputs. Each test skips without its
library (torch, CuPy >= 14 for bfloat16).
"""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from conftest import relative_error_per_head, shuffled_block_tables, widened_rows
from fp8kturbov import CacheLayout, DeviceBuffer, KVCache, ops
from fp8kturbov import reference as ref

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
K_SCALE = 0.05
SEQ_LENS = [0, 1, 17, 100, 250, 64]
Q_LENS = [0, 1, 5, 16, 2, 7]  # multi-token decode: query tokens per sequence (<= its seq_len)


class TorchArrays:
    """Host <-> device copies, pointers and a current stream, through torch."""

    backend = "torch"

    def __init__(self) -> None:
        self.torch = pytest.importorskip("torch")

    def to_device(self, host: np.ndarray):
        if host.dtype == BF16:  # through the bits: torch has no NumPy bfloat16
            return self.torch.from_numpy(host.view(np.int16).copy()).cuda().view(self.torch.bfloat16)
        return self.torch.from_numpy(np.ascontiguousarray(host)).cuda()

    def view(self, pool):
        """A tensor over a pool (a tensor already, or any __cuda_array_interface__ object)."""
        return self.torch.as_tensor(pool, device="cuda")

    def to_host(self, array) -> np.ndarray:
        array = self.view(array)
        if array.dtype == self.torch.bfloat16:
            return array.view(self.torch.int16).cpu().numpy().view(BF16)
        return array.cpu().numpy()

    def fill(self, pool, host: np.ndarray) -> None:
        self.view(pool).copy_(self.torch.from_numpy(host))

    def ptr(self, array) -> int:
        return array.data_ptr()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    @contextlib.contextmanager
    def current_stream(self):
        """A new stream, current inside the block; yields its handle, synchronises on exit."""
        self.synchronize()  # inputs were uploaded on the default stream
        stream = self.torch.cuda.Stream()
        with self.torch.cuda.stream(stream):
            yield stream.cuda_stream
        stream.synchronize()


class CupyArrays(TorchArrays):
    """The same through CuPy (>= 14: bfloat16 as ml_dtypes.bfloat16)."""

    backend = "cupy"

    def __init__(self) -> None:
        self.cupy = pytest.importorskip("cupy", minversion="14")

    def to_device(self, host: np.ndarray):
        if host.dtype == BF16:
            return self.cupy.asarray(host.view(np.uint16)).view(BF16)
        return self.cupy.asarray(host)

    def view(self, pool):
        return self.cupy.asarray(pool)

    def to_host(self, array) -> np.ndarray:
        array = self.view(array)
        if array.dtype == BF16:
            return self.cupy.asnumpy(array.view(np.uint16)).view(BF16)
        return self.cupy.asnumpy(array)

    def fill(self, pool, host: np.ndarray) -> None:
        self.view(pool).set(host)

    def ptr(self, array) -> int:
        return array.data.ptr

    def synchronize(self) -> None:
        self.cupy.cuda.Device().synchronize()

    @contextlib.contextmanager
    def current_stream(self):
        self.synchronize()
        with self.cupy.cuda.Stream(non_blocking=True) as stream:
            yield stream.ptr
        stream.synchronize()


LIBRARIES = {"torch": TorchArrays, "cupy": CupyArrays}


@pytest.fixture
def streams_of(monkeypatch):
    """``streams_of(op)``: the list that every later ``ops.<op>`` call appends its stream to
    (the call still runs)."""

    def spy(op: str) -> list:
        seen, launcher = [], getattr(ops, op)

        def recording(*args, **kwargs):
            seen.append(kwargs.get("stream"))
            return launcher(*args, **kwargs)

        monkeypatch.setattr(ops, op, recording)
        return seen

    return spy


def bf16_rows(rng, num_rows: int, row_elems: int, stride: int) -> np.ndarray:
    """bf16 N(0, 1) rows ``[num_rows, stride]``; padding beyond ``row_elems`` is NaN, so reading it
    would show."""
    rows = np.full((num_rows, stride), np.nan, dtype=np.float32)
    rows[:, :row_elems] = rng.standard_normal((num_rows, row_elems))
    return rows.astype(BF16)


def random_bytes(rng, nbytes: int) -> np.ndarray:
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def assert_bytes_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    diff = np.flatnonzero(got.view(np.uint8).reshape(-1) != want.view(np.uint8).reshape(-1))
    assert diff.size == 0, f"{what}: {diff.size} bytes differ, first at {diff[:8].tolist()}"


def layout_for(bits: int, num_blocks: int = 40) -> CacheLayout:
    return CacheLayout(num_blocks=num_blocks, block_size=16, num_kv_heads=2, head_dim=128, v_bits=bits)


def address(lib: TorchArrays, array) -> int:
    return array.ptr if isinstance(array, DeviceBuffer) else lib.ptr(array)


# ---- Write -----------------------------------------------------------------------------------------
def check_write(lib: TorchArrays, cache: KVCache, rng, streams_of) -> None:
    """write_kv on a current non-default stream: 3-D keys with padded rows, 2-D values."""
    layout, n, num_tokens = cache.layout, cache.layout.row_elems, 60
    key_stride = n + 24
    k_before, v_before = random_bytes(rng, layout.k_pool_bytes), random_bytes(rng, layout.v_pool_bytes)
    key_host = bf16_rows(rng, num_tokens, n, key_stride)
    value_host = bf16_rows(rng, num_tokens, n, n)
    slots = rng.choice(layout.num_slots, size=num_tokens, replace=False).astype(np.int64)
    slots[rng.random(num_tokens) < 0.1] = -1
    key_rows, value, slot_mapping = (lib.to_device(a) for a in (key_host, value_host, slots))
    key = key_rows[:, :n].reshape(num_tokens, layout.num_kv_heads, layout.head_dim)
    lib.fill(cache.k_pool, k_before)
    lib.fill(cache.v_pool, v_before)

    streams = streams_of("reshape_and_cache")
    with lib.current_stream() as stream:
        fp8kturbov.write_kv(key, value, cache, slot_mapping)
    assert streams == [stream] and stream != 0

    want_k, want_v = k_before.copy(), v_before.copy()
    ref.write_cache(key_host, value_host, want_k, want_v, slots, num_tokens, layout.num_kv_heads,
                    layout.head_dim, layout.block_size, key_stride, n, K_SCALE,
                    layout.k_block_stride_bytes, layout.v_block_stride_bytes,
                    layout.v_data_section_bytes, layout.v_bits)
    got_k, got_v = lib.to_host(cache.k_pool), lib.to_host(cache.v_pool)
    assert_bytes_equal(got_k, want_k, "K pool vs reference")
    assert_bytes_equal(got_v, want_v, "V pool vs reference")

    with KVCache.allocate(layout, K_SCALE, backend=cache.backend) as twin:
        lib.fill(twin.k_pool, k_before)
        lib.fill(twin.v_pool, v_before)
        lib.synchronize()
        ops.reshape_and_cache(
            lib.ptr(key_rows), lib.ptr(value), twin.k_ptr, twin.v_ptr, lib.ptr(slot_mapping),
            num_tokens=num_tokens, key_stride=key_stride, value_stride=n, k_scale=K_SCALE,
            **twin._layout_args())
        lib.synchronize()
        assert_bytes_equal(lib.to_host(twin.k_pool), got_k, "K pool vs raw-pointer launch")
        assert_bytes_equal(lib.to_host(twin.v_pool), got_v, "V pool vs raw-pointer launch")


# ---- Decode ----------------------------------------------------------------------------------------
def check_decode(lib: TorchArrays, cache: KVCache, rng, streams_of, window: int,
                 q_lens: list[int] | None = None, table_slice: bool = False) -> None:
    """paged_decode on a current non-default stream: padded q rows, out allocated like q, the
    cache's own workspace, exact softmax (sparse_v_threshold = 0). ``q_lens``: a multi-token
    decode with these query tokens per sequence (query_start on the device); None: one each.
    ``table_slice``: block_tables is the column slice of the batch's pages of a wider device table
    (whose other entries are pages far outside the pools), as an engine with rows sized for a
    longer context passes it."""
    layout = cache.layout
    heads, dim, block = layout.num_kv_heads, layout.head_dim, layout.block_size
    n, num_slots = layout.row_elems, layout.num_slots
    k_host, v_host = random_bytes(rng, layout.k_pool_bytes), random_bytes(rng, layout.v_pool_bytes)
    ref.write_cache(bf16_rows(rng, num_slots, n, n), bf16_rows(rng, num_slots, n, n), k_host, v_host,
                    np.arange(num_slots), num_slots, heads, dim, block, n, n, K_SCALE,
                    layout.k_block_stride_bytes, layout.v_block_stride_bytes,
                    layout.v_data_section_bytes, layout.v_bits)
    lib.fill(cache.k_pool, k_host)
    lib.fill(cache.v_pool, v_host)

    seq_lens = np.array(SEQ_LENS, dtype=np.int32)
    num_seqs, num_q_heads = len(seq_lens), 4 * heads
    blocks_needed = -(-seq_lens // block)
    max_blocks = int(blocks_needed.max()) + 1
    tables = shuffled_block_tables(rng, blocks_needed, layout.num_blocks, max_blocks)
    query_start = None if q_lens is None else np.cumsum([0, *q_lens], dtype=np.int32)
    num_rows = num_seqs if q_lens is None else int(query_start[-1])
    max_q_len = 1 if q_lens is None else max(q_lens)
    q_stride = num_q_heads * dim + 8
    q_host = bf16_rows(rng, num_rows, num_q_heads * dim, q_stride)
    q_rows, lens_dev = lib.to_device(q_host), lib.to_device(seq_lens)
    table_width = 2 * max_blocks + 3 if table_slice else max_blocks
    tables_dev = lib.to_device(widened_rows(tables, table_width))[:, :max_blocks]
    q = q_rows[:, :num_q_heads * dim].reshape(num_rows, num_q_heads, dim)
    multi_token = {} if q_lens is None else dict(query_start=lib.to_device(query_start),
                                                 max_q_len=max_q_len)
    workspace = cache.decode_workspace(num_seqs, num_q_heads, max_blocks, sliding_window=window,
                                       max_q_len=max_q_len)

    streams = streams_of("paged_decode_attn")
    with lib.current_stream() as stream:
        out = fp8kturbov.paged_decode(q, cache, tables_dev, lens_dev, sliding_window=window,
                                      sparse_v_threshold=0.0, workspace=workspace, **multi_token)
    assert streams == [stream] and stream != 0
    got = lib.to_host(out)
    assert got.shape == (num_rows, num_q_heads, dim)
    want = ref.paged_decode(q_host, k_host, v_host, tables, seq_lens, max_blocks, num_seqs,
                            num_q_heads, heads, dim, block, dim ** -0.5, K_SCALE, q_stride,
                            layout.v_block_stride_bytes, layout.v_data_section_bytes, window,
                            layout.v_bits, k_block_stride_bytes=layout.k_block_stride_bytes,
                            query_start=query_start)
    got64 = got.astype(np.float64)
    assert not np.isnan(got64).any()
    if q_lens is None:
        assert np.all(got64[seq_lens == 0] == 0)
    err = relative_error_per_head(got64, want)
    assert err.max() <= 1e-2, f"max relative error per head {err.max():.3g}"

    raw_out = lib.to_device(np.full(got.shape, np.nan, dtype=BF16))
    raw_multi_token = {} if q_lens is None else dict(
        query_start=lib.ptr(multi_token["query_start"]), max_q_len=max_q_len, num_query_rows=num_rows)
    lib.synchronize()
    ops.paged_decode_attn(
        lib.ptr(q_rows), cache.k_ptr, cache.v_ptr, lib.ptr(raw_out), lib.ptr(tables_dev),
        lib.ptr(lens_dev), max_blocks_per_seq=max_blocks, block_tables_stride=table_width,
        num_seqs=num_seqs,
        num_q_heads=num_q_heads, inv_sqrt_d=dim ** -0.5, k_scale=K_SCALE, q_stride=q_stride,
        sliding_window=window, sparse_v_threshold=0.0, workspace=address(lib, workspace),
        workspace_bytes=workspace.nbytes, **raw_multi_token, **cache._layout_args())
    lib.synchronize()
    assert_bytes_equal(lib.to_host(raw_out), got, "decode output vs raw-pointer launch")


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("library", list(LIBRARIES))
def test_decode(rng, streams_of, library, bits, window):
    lib = LIBRARIES[library]()
    with KVCache.allocate(layout_for(bits), K_SCALE, backend=lib.backend) as cache:
        check_decode(lib, cache, rng, streams_of, window)


@pytest.mark.parametrize("library", list(LIBRARIES))
def test_decode_from_a_column_slice_of_a_wider_table(rng, streams_of, library):
    """block_tables[:, :pages] of a table whose rows are sized for a longer context: its row
    stride reaches the library (block_tables_stride), which reads only the slice."""
    lib = LIBRARIES[library]()
    with KVCache.allocate(layout_for(3), K_SCALE, backend=lib.backend) as cache:
        check_decode(lib, cache, rng, streams_of, 0, table_slice=True)


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("library", list(LIBRARIES))
def test_multi_token_decode(rng, streams_of, library, window):
    """paged_decode(query_start=..., max_q_len=...) with ragged q_lens (0 to 16) against the
    reference and the raw-pointer launch."""
    lib = LIBRARIES[library]()
    with KVCache.allocate(layout_for(3), K_SCALE, backend=lib.backend) as cache:
        check_decode(lib, cache, rng, streams_of, window, q_lens=Q_LENS)


# ---- Dequantize ------------------------------------------------------------------------------------
def assert_bf16_match(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit for bit, except that a NaN may be any NaN (at the same positions)."""
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan), f"{what}: NaN positions differ"
    assert_bytes_equal(np.where(nan, 0, got.view(np.uint16)), np.where(nan, 0, want.view(np.uint16)), what)


def check_dequantize(lib: TorchArrays, cache: KVCache, rng, streams_of) -> None:
    """dequantize_kv on a current non-default stream over pools of random bytes (NaN bytes
    included): outputs allocated from the cache's backend, then given ones (3-D keys with padded
    rows, 2-D values); against the reference and, byte for byte, the raw-pointer launch."""
    layout, n, num_tokens = cache.layout, cache.layout.row_elems, 60
    heads, dim = layout.num_kv_heads, layout.head_dim
    k_host, v_host = random_bytes(rng, layout.k_pool_bytes), random_bytes(rng, layout.v_pool_bytes)
    lib.fill(cache.k_pool, k_host)
    lib.fill(cache.v_pool, v_host)
    slots = rng.integers(0, layout.num_slots, size=num_tokens, dtype=np.int64)
    slots[rng.random(num_tokens) < 0.1] = -1
    slot_mapping = lib.to_device(slots)
    want_k, want_v = ref.dequantize_cache(k_host, v_host, slots, num_tokens, heads, dim,
                                          layout.block_size, K_SCALE, layout.k_block_stride_bytes,
                                          layout.v_block_stride_bytes, layout.v_data_section_bytes,
                                          layout.v_bits)

    streams = streams_of("dequantize")
    with lib.current_stream() as stream:
        key, value = fp8kturbov.dequantize_kv(cache, slot_mapping)
    assert streams == [stream] and stream != 0
    got_k, got_v = lib.to_host(key), lib.to_host(value)
    assert got_k.shape == got_v.shape == (num_tokens, heads, dim)
    assert_bf16_match(got_k.reshape(num_tokens, n), want_k, "key vs reference")
    assert_bf16_match(got_v.reshape(num_tokens, n), want_v, "value vs reference")

    key_stride = n + 24
    key_rows = lib.to_device(np.full((num_tokens, key_stride), np.nan, dtype=BF16))
    value_rows = lib.to_device(np.full((num_tokens, n), np.nan, dtype=BF16))
    key_view = key_rows[:, :n].reshape(num_tokens, heads, dim)
    with lib.current_stream():
        returned = fp8kturbov.dequantize_kv(cache, slot_mapping, key_view, value_rows)
    assert returned[0] is key_view and returned[1] is value_rows
    got_rows = lib.to_host(key_rows)
    assert_bytes_equal(got_rows[:, :n], got_k.reshape(num_tokens, n), "padded key rows vs allocated")
    assert np.isnan(got_rows[:, n:].astype(np.float32)).all(), "the padding between rows was written"
    assert_bytes_equal(lib.to_host(value_rows), got_v.reshape(num_tokens, n), "value vs allocated")

    raw_k, raw_v = (lib.to_device(np.full((num_tokens, n), np.nan, dtype=BF16)) for _ in range(2))
    lib.synchronize()
    ops.dequantize(cache.k_ptr, cache.v_ptr, lib.ptr(slot_mapping), lib.ptr(raw_k), lib.ptr(raw_v),
                   num_tokens=num_tokens, key_stride=n, value_stride=n, k_scale=K_SCALE,
                   **cache._layout_args())
    lib.synchronize()
    assert_bytes_equal(lib.to_host(raw_k), got_k, "key vs raw-pointer launch")
    assert_bytes_equal(lib.to_host(raw_v), got_v, "value vs raw-pointer launch")


# ---- Write and dequantize, each width and library -------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("library", list(LIBRARIES))
@pytest.mark.parametrize("check", [check_write, check_dequantize], ids=["write", "dequantize"])
def test_write_and_dequantize(rng, streams_of, check, library, bits):
    lib = LIBRARIES[library]()
    with KVCache.allocate(layout_for(bits), K_SCALE, backend=lib.backend) as cache:
        check(lib, cache, rng, streams_of)


# ---- KVCache.allocate, each backend ---------------------------------------------------------------
@pytest.mark.parametrize("backend, library", [("torch", "torch"), ("cupy", "cupy"), ("cuda", "torch"),
                                              ("cuda", "cupy")])
def test_allocate(rng, streams_of, backend, library):
    lib = LIBRARIES[library]()
    layout = layout_for(3)
    cache = KVCache.allocate(layout, K_SCALE, backend=backend, device=0)
    pool_type = {"torch": "Tensor", "cupy": "ndarray", "cuda": "DeviceBuffer"}[backend]
    assert type(cache.k_pool).__name__ == pool_type and cache.owns_memory
    assert (cache.backend, cache.device) == (backend, 0)
    assert (cache.k_pool.nbytes, cache.v_pool.nbytes) == (layout.k_pool_bytes, layout.v_pool_bytes)
    workspace = cache.decode_workspace(6, 8, 17)
    assert type(workspace).__name__ == pool_type
    check_write(lib, cache, rng, streams_of)
    check_decode(lib, cache, rng, streams_of, window=0)
    pools = (cache.k_pool, cache.v_pool)
    cache.close()
    assert cache.closed and cache.k_ptr == 0
    if backend == "cuda":
        assert all(pool.closed and pool.ptr == 0 for pool in pools)


def test_device_buffer_is_an_array():
    torch = pytest.importorskip("torch")
    with DeviceBuffer(4096) as buffer:
        view = torch.as_tensor(buffer, device="cuda")
        view.fill_(7)
        assert view.data_ptr() == buffer.ptr and int(view.sum()) == 7 * 4096
    assert buffer.closed


# ---- Arrays seen only through __cuda_array_interface__ or DLPack -----------------------------------
class CAIView:
    """A torch tensor seen only through __cuda_array_interface__ v3 (bf16 as '<V2'), produced on
    ``stream``."""

    def __init__(self, tensor, stream: int) -> None:
        torch = pytest.importorskip("torch")
        typestr = {torch.bfloat16: "<V2", torch.int64: "<i8", torch.int32: "<i4"}[tensor.dtype]
        self.tensor = tensor
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape), "typestr": typestr, "data": (tensor.data_ptr(), False),
            "strides": tuple(s * tensor.element_size() for s in tensor.stride()),
            "version": 3, "stream": stream}


class DLPackView:
    """A torch tensor seen only through DLPack."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, stream=None):
        return self.tensor.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def test_cai_and_dlpack_arrays_on_other_streams(rng, streams_of):
    """Key and slots produced on one stream (CAI names it), value through DLPack, the launch on a
    third stream: the launch waits for the producer by event and the DLPack export by its rule."""
    lib = TorchArrays()
    torch = lib.torch
    layout = layout_for(4)
    n, num_tokens = layout.row_elems, 33
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    key_host, value_host = bf16_rows(rng, num_tokens, n, n), bf16_rows(rng, num_tokens, n, n)
    slots = rng.choice(layout.num_slots, size=num_tokens, replace=False).astype(np.int64)
    k_before, v_before = random_bytes(rng, layout.k_pool_bytes), random_bytes(rng, layout.v_pool_bytes)
    with KVCache.allocate(layout, K_SCALE, backend="cuda") as cache:
        lib.fill(cache.k_pool, k_before)
        lib.fill(cache.v_pool, v_before)
        lib.synchronize()
        with torch.cuda.stream(producer):
            key, slot_mapping = lib.to_device(key_host), lib.to_device(slots)
        value = lib.to_device(value_host)
        streams = streams_of("reshape_and_cache")
        fp8kturbov.write_kv(CAIView(key, producer.cuda_stream), DLPackView(value), cache,
                            CAIView(slot_mapping, producer.cuda_stream), stream=consumer)
        assert streams == [consumer.cuda_stream]
        consumer.synchronize()
        want_k, want_v = k_before.copy(), v_before.copy()
        ref.write_cache(key_host, value_host, want_k, want_v, slots, num_tokens,
                        layout.num_kv_heads, layout.head_dim, layout.block_size, n, n, K_SCALE,
                        layout.k_block_stride_bytes, layout.v_block_stride_bytes,
                        layout.v_data_section_bytes, layout.v_bits)
        assert_bytes_equal(lib.to_host(cache.k_pool), want_k, "K pool")
        assert_bytes_equal(lib.to_host(cache.v_pool), want_v, "V pool")
